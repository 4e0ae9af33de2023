"""Training configs: YAML in either Cerebras Model Zoo layout (or dls's own), read safely, mapped key by key onto
:class:`~dls.train.schema.TrainConfig` with every error naming the key as written; the loss-scaling keys are judged
by ``ScalerSettings.cerebras``, so the config accepts what ``GradScaler`` accepts."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from dls.settings import ScalerSettings, SettingsError
from dls.train.errors import ConfigError
from dls.train.schema import (
    CHECKPOINT_STATES,
    F32_MAX,
    MODEL_DATASETS,
    MODEL_NAMES,
    ONLY,
    OPTIMIZERS,
    SCALER_KEYS,
    SECTION_CLASSES,
    ZOO_MODELS,
    ZOO_PROCESSORS,
    DataConfig,
    TrainConfig,
    _integral,
    describe_keys,
    did_you_mean,
    problems,
)

__all__ = [
    "CHECKPOINT_STATES", "ConfigError", "TrainConfig", "apply_overrides", "describe_keys", "load_config", "load_yaml",
    "loss_scaling_mode", "parse_checkpoint_states", "parse_config", "read_config", "scaler_settings", "to_dict",
]  # fmt: skip

MAX_CONFIG_NODES = 100_000
MAX_CONFIG_BYTES = 1 << 20
# Keys that matter only on Cerebras hardware (or to Model Zoo's launcher): accepted, listed once as ignored.
CEREBRAS_ONLY = {
    "num_workers", "prefetch_factor", "persistent_workers", "precision_opt_level", "enable_distributed",
    "num_csx", "mode", "log_loss_scale", "save_losses", "num_wgt_servers", "num_act_servers", "mgmt_address",
    "credentials_path", "mount_dirs", "python_paths", "compile_dir", "job_labels", "compile_only",
    "validate_only", "execute_crd_memory_gb", "use_cs_grad_accum", "micro_batch_size", "enable_act_frequency",
    "log_level", "wsc_log_level", "ScopedTrainFlags", "ScopedValidateFlags", "ComputeNorm", "GlobalFlags",
    "DebugArgsPath", "to_float16", "use_worker_cache", "sync_batchnorm",
}  # fmt: skip
# Names from other frameworks, pointed at the one key that does the same thing here.
_HINTS = {
    "growth_interval": "steps_per_increase", "loss_scale_window": "steps_per_increase",
    "init_scale": "initial_loss_scale", "loss_scale": "loss_scaling_factor", "lr": "learning_rate",
    "clip_grad_norm": "max_gradient_norm", "gradient_clipping": "max_gradient_norm", "type": "optimizer_type",
    "dtype": "fp16_type", "amp": "mixed_precision",
}  # fmt: skip
# The current layout's trainer.init.<group>.<key> -> (section, key).
_PRECISION = {"enabled": ("precision", "mixed_precision"), "fp16_type": ("precision", "fp16_type")}
_PRECISION.update({k: ("optimizer", k) for k in [*SCALER_KEYS, "max_gradient_value", "log_summaries"]})
_PRECISION.update({k: ("precision", k) for k in ("keep_in_float32", "fallback", "emulate", "half_params")})
_PRECISION.update({k: ("precision", k) for k in ("master_weights", "fp8")})
_LOOP = {k: ("runconfig", k) for k in ("max_steps", "num_epochs", "steps_per_epoch", "eval_frequency")}
_LOOP.update({k: ("runconfig", k) for k in ("eval_steps", "grad_accum_steps", "num_steps")})
_CHECKPOINT = {"steps": ("runconfig", "checkpoint_steps")}
_CHECKPOINT.update({k: ("runconfig", k) for k in ("save_initial_checkpoint", "disable_strict_checkpoint_loading")})
_CHECKPOINT.update({k: ("runconfig", k) for k in ("autoload_last_checkpoint", "keep_checkpoint_max")})
_INIT = {"precision": _PRECISION, "loop": _LOOP, "checkpoint": _CHECKPOINT}
_INIT["logging"] = {"log_steps": ("runconfig", "log_steps"), "log_summaries": ("optimizer", "log_summaries")}
_DLS_FIELDS = ("name", "data_processor", "batch_size", "shuffle", "shuffle_seed", "drop_last_batch")
_RUN_KEYS = ("model_dir", "seed", "device", "num_threads", "tensorboard", "max_overflows_at_min_loss_scale")
_SCHEDULERS = {"ConstantLR": "Constant", "LinearLR": "Linear", "CosineDecayLR": "CosineDecay"}
# Model Zoo's defaults where they differ from dls's: (section, key) -> {layout: (where it is written, value)}.
_ZOO_DEFAULTS: dict[tuple[str, str], dict[str, tuple[str, Any]]] = {
    ("precision", "fp16_type"):
        {"legacy": ("model.fp16_type", "float16"), "current": ("precision.fp16_type", "bfloat16")},
    ("precision", "mixed_precision"):
        {"legacy": ("model.mixed_precision", False), "current": ("precision.enabled", True)},
    ("optimizer", "loss_scaling_factor"):
        {"legacy": ("optimizer.loss_scaling_factor", 1.0), "current": ("precision.loss_scaling_factor", 1.0)},
    ("runconfig", "autoload_last_checkpoint"): {"current": ("checkpoint.autoload_last_checkpoint", True)},
}  # fmt: skip


# ---------------------------------------------------------------------- YAML
class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 floats (``1e-3`` is a number) that refuses a key given twice in one mapping."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key, _ in node.value:
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                line = key.start_mark.line + 1
                if key.value in seen:
                    raise ConfigError([f"key {key.value!r} is given twice: lines {seen[key.value]} and {line}"])
                seen[key.value] = line
        return super().construct_mapping(node, deep=deep)

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        """Merge keys (``<<: [*a, *b]``) that cannot multiply: each key once, the last value given wins."""
        super().flatten_mapping(node)
        index = {
            (k.tag, k.value) if isinstance(k, yaml.ScalarNode) else id(k): i for i, (k, _) in enumerate(node.value)
        }
        if len(index) < len(node.value):
            node.value = [node.value[i] for i in sorted(index.values())]


_FLOAT = r"^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+|\.[0-9_]+"
_FLOAT += r"(?:[eE][-+][0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
_Loader.yaml_implicit_resolvers = {
    k: [(t, r) for t, r in v if t != "tag:yaml.org,2002:float"]
    for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(_FLOAT), list("-+0123456789."))


def _unshare(data: Any, budget: list[int]) -> Any:
    """``data`` with every alias expanded into a copy; at most :data:`MAX_CONFIG_NODES` values in all."""
    budget[0] -= 1
    if budget[0] < 0:
        raise ValueError(f"more than {MAX_CONFIG_NODES:,} values once its YAML aliases are expanded (an alias bomb?)")
    if isinstance(data, dict):
        return {_unshare(k, budget): _unshare(v, budget) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_unshare(v, budget) for v in data]
    return data


def load_yaml(text: str, source: str = "<string>") -> Any:
    """Parse YAML text into plain data, aliases expanded into copies. Raises :class:`ConfigError`."""
    try:
        data = yaml.load(text, Loader=_Loader)  # a SafeLoader subclass
        return _unshare(data, [MAX_CONFIG_NODES])
    except ConfigError as exc:
        raise ConfigError(exc.errors, source) from None
    except yaml.YAMLError as exc:
        raise ConfigError([f"not valid YAML: {exc}"], source) from None
    except RecursionError:
        raise ConfigError(["not a config: nested too deeply, or an alias contains itself"], source) from None
    except ValueError as exc:
        raise ConfigError([f"the config expands to {exc}"], source) from None


def read_config(path: str | Path, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The YAML file ``path`` (a regular file of at most 1 MiB of UTF-8) as a dict, ``overrides`` applied."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO without a writer must not block
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ConfigError(["not a regular file: a config is read from a plain file"], str(path))
            with os.fdopen(os.dup(fd), "rb") as f:
                data = f.read(MAX_CONFIG_BYTES + 1)
        finally:
            os.close(fd)
    except OSError as exc:
        raise ConfigError([f"cannot read config file: {exc.strerror or exc}"], str(path)) from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(["larger than 1 MiB: not a YAML config (a checkpoint? see --resume)"], str(path))
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            [f"not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); save the config as UTF-8"],
            str(path),
        ) from None
    raw = load_yaml(text, str(path))
    return apply_overrides({} if raw is None else raw, overrides, source=str(path))


def apply_overrides(raw: Any, overrides: Sequence[str], source: str | None = None) -> dict[str, Any]:
    """A copy of ``raw`` with each ``"a.b.c=value"`` set at the path as written (values are YAML)."""
    if not isinstance(raw, Mapping):
        raise ConfigError([f"the top level must be a mapping of sections; got {raw!r}"], source)
    try:
        result: dict[str, Any] = _unshare(dict(raw), [MAX_CONFIG_NODES])
    except (ValueError, RecursionError):
        raise ConfigError(["the config is too large or contains itself"], source) from None
    errors = []
    for item in overrides:
        path, sep, text = item.partition("=")
        keys = path.strip().split(".")
        if not sep or len(keys) < 2 or not all(keys):
            errors.append(f"override {item!r} must look like section.key=value, e.g. runconfig.max_steps=20")
            continue
        try:
            value = load_yaml(text, "<override>") if text.strip() else ""
        except ConfigError as exc:
            errors.append(f"override {item!r}: value is not valid YAML ({exc.errors[0]})")
            continue
        node = result
        for i, k in enumerate(keys[:-1]):
            if node.get(k) is None:
                node[k] = {}
            child = node[k]
            if not isinstance(child, dict):
                errors.append(f"override {item!r}: {'.'.join(keys[: i + 1])} is not a section/mapping")
                break
            node = child
        else:
            node[keys[-1]] = value
    if errors:
        raise ConfigError(errors, source)
    return result


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> TrainConfig:
    """Read a YAML config file, apply overrides, validate. Raises :class:`ConfigError`."""
    return parse_config(read_config(path, overrides), source=str(path))


def parse_checkpoint_states(value: str | Sequence[str]) -> tuple[str, ...]:
    """``"model,optimizer"`` or a list → validated tuple of state names (``"all"`` → every state)."""
    items = [s.strip() for s in value.split(",")] if isinstance(value, str) else list(value)
    if not items or not all(isinstance(s, str) and s for s in items):
        raise ValueError(f"expected a comma-separated list of {', '.join(CHECKPOINT_STATES)} (or 'all'); got {value!r}")
    if items == ["all"]:
        return CHECKPOINT_STATES
    bad = [s for s in items if s not in CHECKPOINT_STATES]
    if bad:
        hint = did_you_mean(bad[0], CHECKPOINT_STATES)
        raise ValueError(
            f"unknown checkpoint state(s) {', '.join(map(repr, bad))}{hint}; allowed: {', '.join(CHECKPOINT_STATES)}"
        )
    return tuple(dict.fromkeys(items))


# ---------------------------------------------------------------------- layouts → sections
class _Reader:
    """Collects the sections' values, where each was written (for errors), problems and notes."""

    def __init__(self, zoo_model: bool) -> None:
        self.zoo_model = zoo_model  # a Model Zoo model: its model and data keys go to params
        self.sections: dict[str, dict[str, Any]] = {name: {} for name in SECTION_CLASSES}
        self.sections["eval_data"] = {}
        self.written: dict[tuple[str, str], str] = {}
        self.errors: list[str] = []
        self.ignored: list[str] = []
        self.notes: list[str] = []

    def put(self, section: str, key: str, value: Any, path: str) -> None:
        if (section, key) in self.written:
            other, before = self.written[section, key], self.sections[section][key]
            if before != value:
                self.errors.append(f"{other} ({before!r}) and {path} ({value!r}) disagree; give it in one place")
            elif path.split(".")[-1] != other.split(".")[-1]:
                self.errors.append(f"{other} and {path} are the same setting; give one")
            return
        self.sections[section][key] = value
        self.written[section, key] = path

    def mapping(self, value: Any, path: str) -> Mapping[Any, Any]:
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            self.errors.append(f"{'section ' * ('.' not in path)}{path} must be a mapping of keys; got {value!r}")
            return {}
        return value

    def unknown(self, path: str, key: Any, allowed: Sequence[str]) -> None:
        if str(key) in CEREBRAS_ONLY:
            self.ignored.append(f"{path}.{key}")
            return
        hint = f" (did you mean {_HINTS[key]!r}?)" if key in _HINTS else did_you_mean(key, allowed)
        self.errors.append(f"unknown key {path}.{key}{hint}; allowed keys: {', '.join(allowed)}")

    def section(self, section: str, body: Any, path: str, moved: Mapping[str, tuple[str, str]] = {}) -> None:
        """A section written as dls's fields (legacy layout); Model Zoo models' and readers' keys go to ``params``."""
        body = self.mapping(body, path)
        fields = [k for k in SECTION_CLASSES["data" if section == "eval_data" else section].model_fields]
        zoo = self.zoo_model if section == "model" else self.zoo_model or "data_processor" in body
        zoo = zoo and section in ("model", "data", "eval_data")
        params = {}
        for key, value in body.items():
            where = f"{path}.{key}"
            if key in moved:
                self.put(*moved[key], value, where)
            elif key in CEREBRAS_ONLY:
                self.ignored.append(where)
            elif zoo and key not in _DLS_FIELDS:  # the model's or reader's own key
                params[key] = value
            elif key in fields and key != "params":
                self.put(section, key, value, where)
            else:
                self.unknown(path, key, [f for f in fields if f != "params"])
        if params:
            self.put(section, "params", params, path)

    def legacy(self, raw: Mapping[Any, Any]) -> None:
        names = {"train_input": "data", "data": "data", "eval_input": "eval_data", "model": "model"}
        names.update({"optimizer": "optimizer", "runconfig": "runconfig", "precision": "precision"})
        moved = {"mixed_precision": ("precision", "mixed_precision"), "fp16_type": ("precision", "fp16_type")}
        alias = {"weight_decay_rate": ("optimizer", "weight_decay")}
        seen: dict[str, str] = {}
        for name, body in raw.items():
            if name not in names:
                self.errors.append(f"unknown section {name}{did_you_mean(name, names)}; allowed: {', '.join(names)}")
                continue
            section = names[name]
            if section in seen:
                self.errors.append(f"give section {section!r} once: both {seen[section]!r} and {name!r} are present")
                continue
            seen[section] = str(name)
            self.section(section, body, str(name), moved if section == "model" else alias)

    def current(self, raw: Mapping[Any, Any]) -> None:
        for name in raw:
            if name != "trainer":
                self.errors.append(f"unknown section {name}: the current layout has trainer: alone")
        trainer = self.mapping(raw.get("trainer"), "trainer")
        for name in trainer:
            if name not in ("init", "fit", "validate", "validate_all"):
                self.unknown("trainer", name, ["init", "fit", "validate", "validate_all"])
        init = self.mapping(trainer.get("init"), "trainer.init")
        allowed = ["model_dir", "seed", "backend", "model", "optimizer", "schedulers", "callbacks", *_INIT]
        for key, value in init.items():
            path = f"trainer.init.{key}"
            if key in _RUN_KEYS:
                self.put("runconfig", key, value, path)
            elif key == "model":
                self.section("model", value, path)
            elif key in _INIT:
                for k, v in self.mapping(value, path).items():
                    if k in _INIT[key]:
                        self.put(*_INIT[key][k], v, f"{path}.{k}")
                    else:
                        self.unknown(path, k, list(_INIT[key]))
            elif key == "backend":
                self.backend(self.mapping(value, path), path)
            elif key == "optimizer":
                self.optimizer(self.mapping(value, path), path)
            elif key == "schedulers":
                self.put("optimizer", "learning_rate", _schedule(value, path, self.errors), path)
            elif key == "callbacks":
                self.callbacks(value, path)
            else:
                self.unknown("trainer.init", key, allowed)
        if {"validate", "validate_all"} & trainer.keys():
            self.notes.append("trainer.validate / trainer.validate_all: dls train runs trainer.fit (not checked)")
        fit = self.mapping(trainer.get("fit"), "trainer.fit")
        for key, value in fit.items():
            if key in ("train_dataloader", "val_dataloader"):
                self.section("data" if key == "train_dataloader" else "eval_data", value, f"trainer.fit.{key}")
            elif key == "ckpt_path":
                self.put("runconfig", "checkpoint_path", value, "trainer.fit.ckpt_path")
            else:
                self.unknown("trainer.fit", key, ["train_dataloader", "val_dataloader", "ckpt_path"])

    def backend(self, backend: Mapping[Any, Any], path: str) -> None:
        kind = backend.get("backend_type")
        if kind in ("CPU", "GPU"):
            self.put("runconfig", "device", "cpu" if kind == "CPU" else "cuda", f"{path}.backend_type")
        elif kind == "CSX":
            self.notes.append(f"{path}.backend_type CSX: not this hardware; the run uses the best device here")
            self.put("runconfig", "device", "auto", f"{path}.backend_type")
        elif kind is not None:
            self.errors.append(f"{path}.backend_type must be CSX, CPU or GPU; got {kind!r}{did_you_mean(kind, 'CPU')}")
        self.ignored.extend(f"{path}.{k}" for k in backend if k != "backend_type")

    def optimizer(self, body: Mapping[Any, Any], path: str) -> None:
        if len(body) != 1:
            self.errors.append(f"{path} must name one optimizer class (SGD, Adam or AdamW); got {list(body)}")
            return
        ((name, args),) = body.items()
        self.put("optimizer", "optimizer_type", name, path)
        for key, value in self.mapping(args, f"{path}.{name}").items():
            fields = ["learning_rate", "momentum", "weight_decay", "betas", "eps", "correct_bias"]
            if key in fields or key == "lr":
                self.put("optimizer", "learning_rate" if key == "lr" else key, value, f"{path}.{name}.{key}")
            else:
                self.unknown(f"{path}.{name}", key, fields)

    def callbacks(self, value: Any, path: str) -> None:
        for i, item in enumerate(value if isinstance(value, list) else [value]):
            if not isinstance(item, Mapping) or len(item) != 1:
                self.errors.append(f"{path}[{i}] must be {{CallbackName: {{...}}}}; got {item!r}")
                continue
            ((name, args),) = item.items()
            if name == "LoadCheckpointStates":
                states = self.mapping(args, f"{path}[{i}].LoadCheckpointStates").get("load_checkpoint_states")
                self.put("runconfig", "load_checkpoint_states", states, f"{path}[{i}].LoadCheckpointStates")
            elif name in CEREBRAS_ONLY:
                self.ignored.append(f"{path}[{i}].{name}")
            else:
                self.errors.append(f"{path}[{i}]: dls does not run the callback {name!r}; remove it")


def _schedule(value: Any, path: str, errors: list[str]) -> Any:
    """Model Zoo's ``schedulers: [{LinearLR: {...}}]`` (or one ``SequentialLR`` of them) as schedule pieces."""
    items = value if isinstance(value, list) else [value]
    if len(items) == 1 and isinstance(items[0], Mapping) and list(items[0]) == ["SequentialLR"]:
        body = items[0]["SequentialLR"]
        if not isinstance(body, Mapping) or not isinstance(body.get("schedulers"), list):
            errors.append(f"{path}[0].SequentialLR must hold schedulers: [...]")
            return None
        extra = [k for k in body if k != "schedulers"]
        if extra:
            errors.append(f"{path}[0].SequentialLR.{extra[0]} is not supported (pieces follow their total_iters)")
        items, path = body["schedulers"], f"{path}[0].SequentialLR.schedulers"
    elif len(items) != 1:
        errors.append(f"{path} must be one scheduler (use SequentialLR to chain them); got {len(items)}")
        return None
    pieces = []
    for i, item in enumerate(items):
        name = next(iter(item)) if isinstance(item, Mapping) and len(item) == 1 else None
        if name not in _SCHEDULERS or not isinstance(item[name], (Mapping, type(None))):
            errors.append(
                f"{path}[{i}] must be one of {', '.join(_SCHEDULERS)}; got {item!r}{did_you_mean(name, _SCHEDULERS)}"
            )
            continue
        pieces.append({"scheduler": _SCHEDULERS[name], **(item[name] or {})})
    return pieces


# ---------------------------------------------------------------------- validation
_MNIST = {"fc_mnist": "MNISTDataProcessor", "gpt2": "GptHDF5DataProcessor"}
_MNIST.update({"gpt3": "GptHDF5DataProcessor", "llama": "GptHDF5DataProcessor"})
_ZOO_PROCESSOR = {"data": _MNIST, "eval_data": _MNIST}  # the reader a legacy config's model implies


def _get(raw: Any, *keys: str) -> Any:
    for key in keys:
        raw = raw.get(key) if isinstance(raw, Mapping) else None
    return raw


def parse_config(raw: Mapping[str, Any], source: str | None = None) -> TrainConfig:
    """Validate a config dict (the parsed YAML, either layout) and build the :class:`TrainConfig`. Raises
    :class:`ConfigError` listing every problem, each naming its key as written."""
    if not isinstance(raw, Mapping):
        raise ConfigError([f"the top level must be a mapping of sections; got {raw!r}"], source)
    raw = apply_overrides(raw, (), source)
    layout = "current" if "trainer" in raw else "legacy"
    model = raw.get("model") if layout == "legacy" else _get(raw, "trainer", "init", "model")
    r = _Reader(isinstance(model, Mapping) and model.get("name") in ZOO_MODELS)
    r.current(raw) if layout == "current" else r.legacy(raw)
    s = r.sections
    name = s["model"].get("name")
    every = (*MODEL_NAMES, *ZOO_MODELS)
    if name is None:
        hint = "Model Zoo picks it by its run.py: name it, e.g. -o model.name=gpt2"
        r.errors.append(f"model.name is required ({hint}); one of {', '.join(every)}")
    elif name not in every:
        hint = did_you_mean(name, every)
        r.errors.append(f"model.name must be one of {', '.join(map(repr, every))}; got {name!r}{hint}")
    zoo = layout == "current" or name in ZOO_MODELS or "data_processor" in s["data"]
    if zoo:
        for (section, key), defaults in _ZOO_DEFAULTS.items():
            if (section, key) not in r.written and layout in defaults:
                path, value = defaults[layout]
                s[section][key] = value
                other = defaults.get("legacy" if layout == "current" else "current", (None, value))[1]
                differs = (
                    f" ({'legacy' if layout == 'current' else 'current'} layout: {other!r})" if other != value else ""
                )
                prefix = "trainer.init." if layout == "current" else ""
                r.notes.append(f"{prefix}{path}: {value!r}, Model Zoo's default in the {layout} layout{differs}")
    else:
        layout = "dls"
    for key in ("data", "eval_data"):
        proc = s[key].get("data_processor")
        if proc is not None and proc not in ZOO_PROCESSORS:
            r.errors.append(
                f"{r.written.get((key, 'data_processor'))} must be one of {', '.join(ZOO_PROCESSORS)}; "
                f"got {proc!r}{did_you_mean(proc, ZOO_PROCESSORS)}"
            )
    if name in MODEL_DATASETS and "data_processor" not in s["data"]:
        s["data"].setdefault("dataset", MODEL_DATASETS[name])
    for section, default in _ZOO_PROCESSOR.items():
        given = {"dataset", "data_processor"} & s[section].keys()
        if name in ZOO_MODELS and not given and (s[section] or section == "data"):
            s[section]["data_processor"] = default[name]
    kind = s["optimizer"].get("optimizer_type", "Adam")
    kind = {k.lower(): k for k in OPTIMIZERS}.get(kind.lower(), kind) if isinstance(kind, str) else kind
    selectors = {
        "model": ("name", name),
        "data": ("dataset", s["data"].get("dataset")),
        "optimizer": ("optimizer_type", kind),
    }
    for section, (selector, value) in selectors.items():
        for key in list(s[section]):
            if key in ONLY and value is not None and value not in ONLY[key]:
                only = " or ".join(map(repr, ONLY[key]))
                r.errors.append(
                    f"{r.written[section, key]} applies only when {section}.{selector} is {only}; it is {value!r}"
                )
                del s[section][key]
    if s["runconfig"].get("load_checkpoint_states") is not None:
        try:
            s["runconfig"]["load_checkpoint_states"] = parse_checkpoint_states(s["runconfig"]["load_checkpoint_states"])
        except ValueError as exc:
            r.errors.append(f"{r.written['runconfig', 'load_checkpoint_states']}: {exc}")
            del s["runconfig"]["load_checkpoint_states"]
    built: dict[str, Any] = {}
    for section, cls in SECTION_CLASSES.items():
        built[section] = _build(cls, section, s[section], r)
    if s["eval_data"]:
        built["eval_data"] = _build(DataConfig, "eval_data", s["eval_data"], r)
    factor = s["optimizer"].get("loss_scaling_factor")
    if isinstance(factor, str) and factor != "dynamic":
        hint = did_you_mean(factor, ["dynamic"])
        where = r.written["optimizer", "loss_scaling_factor"]
        r.errors.append(f"{where} must be 'dynamic' (lower case), a number or null; got {factor!r}{hint}")
    if built["optimizer"] is not None and built["precision"] is not None:
        _check_loss_scaling(built, r)
    _check_numbers(s, r)
    if not r.errors:
        _check_combinations(built, r)
        _check_zoo(built, r)
    if not r.errors and built["precision"].fp8 is not None:
        built["precision"] = built["precision"].model_copy(update={"fp8": _fp8(built["precision"].fp8, r)})
    if r.errors:
        raise ConfigError(r.errors, source)
    if r.ignored:
        r.notes.append(f"ignored on this hardware (Cerebras only): {', '.join(dict.fromkeys(r.ignored))}")
    sources = {f"{section}.{key}": path for (section, key), path in r.written.items()}
    return TrainConfig(**built, notes=tuple(r.notes), layout=layout, sources=sources)


def _build(cls: type, section: str, values: dict[str, Any], r: _Reader) -> Any:
    def where(loc: tuple[Any, ...]) -> str:
        head = r.written.get((section, str(loc[0])), f"{section}.{loc[0]}") if loc else section
        return head + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[1:])

    if section == "optimizer" and isinstance(values.get("learning_rate"), dict):
        values["learning_rate"] = [values["learning_rate"]]
    try:
        return cls(**values)
    except ValidationError as exc:
        r.errors.extend(problems(exc, where, cls))
        return None


def _check_numbers(s: Mapping[str, Any], r: _Reader) -> None:
    """Every number finite and at most float32's max in size (loss-scaling keys included)."""

    def walk(value: Any, path: str) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not (math.isfinite(value) and abs(value) <= F32_MAX) and not any(e.startswith(path) for e in r.errors):
                r.errors.append(f"{path} must be a finite number of at most float32's max (3.4e38); got {value!r}")
        elif isinstance(value, Mapping):
            for k, v in value.items():
                walk(v, f"{path}.{k}")
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(v, f"{path}[{i}]")

    for section in ("optimizer", "precision"):
        for key, value in s[section].items():
            if key in SCALER_KEYS or key == "fp8":
                walk(value, r.written.get((section, key), f"{section}.{key}"))
    r.errors[:] = list(dict.fromkeys(r.errors))


def _fp8(recipe: Mapping[str, Any], r: _Reader) -> Any:
    """``{recipe: current|delayed|mxfp8|static, <fields>}`` judged field by field by ``dls.fp8``'s recipe classes."""
    from dls.fp8 import RECIPE_NAMES, recipe_from_dict

    path = r.written.get(("precision", "fp8"), "precision.fp8")
    cls = RECIPE_NAMES.get(recipe.get("recipe"))  # type: ignore[arg-type]
    if cls is None:
        got = repr(recipe["recipe"]) if "recipe" in recipe else "nothing"
        r.errors.append(f"{path}.recipe must be one of {', '.join(map(repr, RECIPE_NAMES))}; got {got}")
        return None
    types = {f.name: f.type for f in dataclasses.fields(cls)}
    fields = {f: _integral(v) if types.get(f) == "int" else v for f, v in recipe.items() if f != "recipe"}
    for key, value in fields.items():
        if key not in cls.__dataclass_fields__:
            r.unknown(path, key, ["recipe", *cls.__dataclass_fields__])
        elif key == "amax_history_len" and not (
            isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 65536
        ):
            r.errors.append(f"{path}.amax_history_len must be an integer in [1, 65536]; got {value!r}")
        else:
            try:
                cls(**{key: value})
            except (ValueError, TypeError) as exc:
                message = str(exc)
                r.errors.append(f"{path}.{message}" if message.startswith(f"{key} ") else f"{path}.{key}: {message}")
    if r.errors:
        return None
    return recipe_from_dict({"recipe": recipe["recipe"], **fields}).to_dict()


def _check_combinations(b: dict[str, Any], r: _Reader) -> None:
    model, data, prec, opt, run = b["model"], b["data"], b["precision"], b["optimizer"], b["runconfig"]
    at = lambda section, key: r.written.get((section, key), f"{section}.{key}")  # noqa: E731
    refuse, note = r.errors.append, r.notes.append
    if model.name in MODEL_DATASETS and data.dataset != MODEL_DATASETS[model.name]:
        refuse(
            f"{at('data', 'dataset')} {data.dataset!r} does not fit model.name {model.name!r}; "
            f"allowed: {MODEL_DATASETS[model.name]}"
        )
    if model.name in ZOO_MODELS and data.data_processor is None and data.dataset is None:
        refuse(f"{model.name} reads Model Zoo data: set train_input.data_processor ({', '.join(ZOO_PROCESSORS)})")
    if model.name in MODEL_NAMES and data.data_processor is not None:
        refuse(
            f"{at('data', 'data_processor')}: model.name {model.name!r} trains on dls's built-in data "
            f"({MODEL_DATASETS[model.name]})"
        )
    if data.dataset is not None and not data.drop_last_batch:
        refuse(f"{at('data', 'drop_last_batch')}: false is not supported for built-in data sets (they drop it)")
    if model.name == "transformer_lm":
        if model.hidden_size % model.num_heads:
            refuse(
                f"{at('model', 'num_heads')} ({model.num_heads}) must divide model.hidden_size ({model.hidden_size})"
            )
        if data.max_sequence_length > model.max_position_embeddings:
            refuse(
                f"{at('data', 'max_sequence_length')} ({data.max_sequence_length}) exceeds "
                f"model.max_position_embeddings ({model.max_position_embeddings})"
            )
    if not prec.mixed_precision and ("precision", "fp16_type") in r.written and prec.fp16_type != "float32":
        note(f"{at('precision', 'fp16_type')} ({prec.fp16_type!r}) has no effect: mixed_precision is off")
    if prec.half_params and prec.compute_dtype == "float32":
        refuse(
            f"{at('precision', 'half_params')} needs a half-precision run (precision.mixed_precision: true and a half "
            "fp16_type): float32 parameters are what it keeps without half_params"
        )
    if prec.half_params and prec.fp16_type == "cbfloat16" and not prec.master_weights:
        refuse(f"{at('precision', 'master_weights')}: false does not work with cbfloat16 half_params")
    if prec.fp8 is not None and prec.emulated:
        refuse(
            f"{at('precision', 'fp8')} cannot be combined with dls.emulate's rounding (cbfloat16 or precision.emulate)"
        )
    if opt.max_gradient_norm is not None and opt.max_gradient_value is not None:
        refuse(f"give {at('optimizer', 'max_gradient_norm')} or {at('optimizer', 'max_gradient_value')}, not both")
    if "master_weights" in prec.model_fields_set and not prec.half_params:
        note(f"{at('precision', 'master_weights')} has no effect without precision.half_params: true")
    if prec.half_params and prec.emulate and prec.fp16_type != "cbfloat16":
        note(f"{at('precision', 'emulate')} has no effect: with half_params the model computes natively")
        b["precision"] = prec = prec.model_copy(update={"emulate": False})
    if prec.fallback and prec.compute_dtype not in ("float16", "cbfloat16"):
        note(f"{at('precision', 'fallback')} has no effect: the run computes in {prec.compute_dtype}")
    if run.eval_steps is not None and b.get("eval_data") is None and "eval_data" not in b:
        note(f"{at('runconfig', 'eval_steps')}: no eval_input / val_dataloader: evaluation reads the training data")


def _check_zoo(b: dict[str, Any], r: _Reader) -> None:
    """A Model Zoo model's and readers' own keys, judged by ``dls.train.modelzoo.keys`` (no torch, no files)."""
    from dls.train.modelzoo.keys import parse_loader, parse_model

    checks: list[tuple[Any, str, dict[str, Any], str]] = []
    if b["model"].name in ZOO_MODELS:
        checks.append(
            (parse_model, b["model"].name, dict(b["model"].params), r.written.get(("model", "params"), "model"))
        )
    for section, default in (("data", "train_input"), ("eval_data", "eval_input")):
        data = b.get(section)
        if data is not None and data.data_processor is not None:
            where = r.written.get((section, "data_processor"), f"{default}.").rsplit(".", 1)[0]
            checks.append((parse_loader, data.data_processor, data.loader_params, where))
    for parse, name, params, where in checks:
        try:
            r.ignored.extend(parse(name, params, where)[1])
        except ConfigError as exc:
            r.errors.extend(exc.errors)


def _scaler_arguments(opt: Any) -> dict[str, Any]:
    return {arg: getattr(opt, key) for key, arg in SCALER_KEYS.items() if getattr(opt, key) is not None}


def _settings(opt: Any, fp16_type: str, **replace: Any) -> ScalerSettings:
    half = "float16" if fp16_type == "float32" else fp16_type
    args = {**_scaler_arguments(opt), **replace}
    return ScalerSettings.cerebras(**args, half_dtype=half)


def _check_loss_scaling(b: dict[str, Any], r: _Reader) -> None:
    """``ScalerSettings`` judges every loss-scaling key given, each problem under its key as written."""
    opt, prec = b["optimizer"], b["precision"]
    factor = opt.loss_scaling_factor
    names = {arg: r.written.get(("optimizer", key), f"optimizer.{key}") for key, arg in SCALER_KEYS.items()}
    if isinstance(factor, str) and factor != "dynamic":
        return  # said by parse_config
    pattern = re.compile(r"\b(" + "|".join(sorted(names, key=len, reverse=True)) + r")\b")
    half = "float16" if prec.fp16_type == "float32" else prec.fp16_type
    try:
        only = {"loss_scale": factor} if factor is not None else {}
        mode = ScalerSettings.cerebras(**only, half_dtype=half).mode  # the scaler's own rule for the mode
        _settings(opt, prec.fp16_type, loss_scale="dynamic")
    except SettingsError as exc:
        given = _scaler_arguments(opt)
        named = [(set(pattern.findall(m)), m) for _, m in exc.problems]
        kept = [m for n, m in named if n & given.keys()] or [m for _, m in named]
        r.errors.extend(pattern.sub(lambda m: names[m.group(1)], m) for m in kept)
        return
    except TypeError as exc:  # an argument this dls's GradScaler does not have yet
        arg = next((a for a in names if f"'{a}'" in str(exc)), None)
        r.errors.append(f"{names.get(arg or '', 'optimizer')}: not supported by this dls's GradScaler ({exc})")
        return
    if prec.compute_dtype == "float32":
        mode, why = "off", "the run computes in float32, without loss scaling"
    elif prec.fp16_type == "cbfloat16" and mode != "dynamic":
        r.errors.append(f"{names['loss_scale']} must be 'dynamic' for cbfloat16 (as on Cerebras); got {factor!r}")
        return
    else:
        why = f"loss_scaling_factor is a static {factor:g}" if mode == "static" else f"loss scaling is off for {half}"
    if isinstance(factor, (int, float)) and not isinstance(factor, bool):
        b["optimizer"] = opt = opt.model_copy(update={"loss_scaling_factor": float(factor)})
    dynamic_only = [k for k, a in SCALER_KEYS.items() if a not in ("loss_scale", "max_gradient_norm")]
    ignored = [k for k in ["loss_scaling_factor"] * (mode == "off") + dynamic_only if getattr(opt, k) is not None]
    if mode != "dynamic" and ignored:
        r.notes.extend(f"{r.written.get(('optimizer', k), 'optimizer.' + k)} is ignored: {why}" for k in ignored)
        b["optimizer"] = opt.model_copy(update=dict.fromkeys(ignored))


def scaler_settings(cfg: TrainConfig) -> ScalerSettings:
    """The loss scaler's settings of ``cfg`` (Cerebras' dialect, ``precision.fp16_type`` as the half dtype)."""
    return _settings(cfg.optimizer, cfg.precision.fp16_type)


def loss_scaling_mode(cfg: TrainConfig) -> str:
    """``"dynamic"``, ``"static"`` or ``"off"`` (``"off"`` when the run computes in float32)."""
    return "off" if cfg.precision.compute_dtype == "float32" else scaler_settings(cfg).mode


def to_dict(cfg: TrainConfig) -> dict[str, Any]:
    """The config as plain data in dls's own layout, which :func:`parse_config` reads back to the same run."""
    out: dict[str, Any] = {}
    for name in SECTION_CLASSES:
        section = getattr(cfg, name)
        out[name] = section.model_dump(mode="json", exclude_defaults=name != "runconfig")
    if cfg.eval_data is not None:
        out["eval_input"] = cfg.eval_data.model_dump(mode="json", exclude_defaults=True)
    out["data"] = {"dataset": cfg.data.dataset, **out["data"]} if cfg.data.dataset else out["data"]
    out["model"] = {"name": cfg.model.name, **out["model"]}
    for section in ("model", "data", "eval_input"):
        if section in out and "params" in out[section]:
            out[section].update(out[section].pop("params"))
    opt = out["optimizer"]
    if cfg.layout != "dls":  # Model Zoo's default scaling factor differs from dls's null
        opt.setdefault("loss_scaling_factor", cfg.optimizer.loss_scaling_factor)
        out["precision"].setdefault("fp16_type", cfg.precision.fp16_type)
        out["precision"].setdefault("mixed_precision", cfg.precision.mixed_precision)
    return out


def missing_paths(cfg: TrainConfig) -> list[str]:
    """What is missing or malformed here in the data of the loaders ``dls train`` uses (a note for ``validate``, an
    error for ``train``), naming the key as written and the layout expected."""
    from dls.train.modelzoo import check_data

    lines = []
    for section, data in (("data", cfg.data), ("eval_data", cfg.eval_data)):
        if data is None or data.data_processor is None:
            continue
        dirs = data.params.get("data_dir")
        missing = [d for d in ([dirs] if isinstance(dirs, str) else dirs or []) if not Path(str(d)).exists()]
        key = cfg.sources.get(f"{section}.params", "train_input" if section == "data" else "eval_input")
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            lines.append(
                f"{key}.data_dir {missing[0]}{more} does not exist here (relative paths resolve against {Path.cwd()})"
            )
        else:
            split = "train" if section == "data" else "val"
            lines += check_data(data.data_processor, data.loader_params, split=split, prefix=key)
    return lines


# float32 weights, gradients and Adam's two states (16 bytes), and a checkpoint's weights and Adam states serialised
# in memory before it is written (12; see dls.train.checkpoint): measured 28 bytes per parameter at the peak.
BYTES_PER_PARAMETER = 28.0


def memory_problem(cfg: TrainConfig) -> str | None:
    """What of ``cfg`` will not fit this machine's free memory (the generated data set; the model with its
    gradients, Adam's two states and a checkpoint being written), naming the key as written; ``None`` when it
    fits. A note for ``validate``, exit status 3 for ``train``."""
    m, d = cfg.model, cfg.data
    need: dict[str, float] = {}
    if d.dataset == "teacher_regression":
        need["data.num_samples"] = 4.0 * d.num_samples * (d.input_dim + d.output_dim)
    p = m.params
    h = p.get("hidden_size", m.hidden_size)
    if m.name in ("gpt2", "gpt3", "llama") and all(isinstance(p.get(k), int) for k in ("hidden_size", "filter_size")):
        layers, vocab = p.get("num_hidden_layers", 1), p.get("vocab_size", 1)
        mlp = 3 if p.get("nonlinearity") == "swiglu" else 2
        count = vocab * h * (1 if p.get("share_embedding_weights", True) else 2) + layers * h * (
            4 * h + mlp * p["filter_size"]
        )
        need[cfg.sources.get("model.params", "model") + ".hidden_size"] = BYTES_PER_PARAMETER * count
    elif m.name == "mlp":
        need["model.hidden_size"] = BYTES_PER_PARAMETER * h * (d.input_dim + h * (m.depth - 1) + d.output_dim)
    try:
        pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        with open("/proc/meminfo", "rb") as f:
            free = next((int(line.split()[1]) * 1024 for line in f if line.startswith(b"MemAvailable:")), pages)
    except (OSError, ValueError):
        return None
    key = max(need, key=need.__getitem__, default="")
    if sum(need.values()) <= free:
        return None
    where = cfg.sources.get(key, key)
    return f"{where}: this run needs about {sum(need.values()) / 2**30:.1f} GiB, {free / 2**30:.1f} GiB are free here"
