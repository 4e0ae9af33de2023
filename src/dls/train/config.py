"""Training configs: a Model-Zoo-style YAML file (or dict) → validated, frozen dataclasses.

A config has five sections::

    model:      {name: mlp | transformer_lm, <sizes>, loss_weight}
    data:       {dataset: teacher_regression | char_corpus, batch_size, ...}    (Model Zoo: train_input)
    precision:  {fp16_type: float16 | bfloat16 | cbfloat16 | float32, mixed_precision, emulate, half_params,
                 master_weights, fp8: {recipe: current | delayed | mxfp8 | static, ...}}
    optimizer:  {optimizer_type, learning_rate, loss_scaling_factor: dynamic | <number>, initial_loss_scale,
                 steps_per_increase, min_loss_scale, max_loss_scale, overflow_tolerance, max_gradient_norm,
                 max_gradient_value, log_summaries, ...}
    runconfig:  {max_steps, checkpoint_steps, log_steps, model_dir, seed, num_threads, keep_checkpoint_max,
                 tensorboard, ...}

Every key is declared once, in ``dls.train.keys`` (a dataclass field with its check, help and scope in its
metadata); this module reads, validates and writes configs. Key names follow the Cerebras Model Zoo: the
loss-scaling keys live in ``optimizer:``; ``model:`` may also hold ``mixed_precision`` and ``fp16_type`` (aliases of
the ``precision:`` keys: giving both with different values is an error); ``train_input:`` is accepted for ``data:``
and ``weight_decay_rate`` for ``weight_decay``. Unknown keys, wrong types and out-of-range values are errors naming
the key and what is allowed; the whole file is checked at once and every problem is reported together
(:class:`ConfigError`). Keys that are valid but have no effect in the chosen mode (``steps_per_increase`` with a
static scale) are warnings (``TrainConfig.warnings``) and are dropped.

Loss scaling is the library's to define: the keys that configure the scaler (``loss_scaling_factor`` is its
``loss_scale``, ``initial_loss_scale`` its ``init_scale``, the others keep their names) are validated by building
``dls.settings.ScalerSettings.cerebras`` with the run's ``precision.fp16_type`` as the half dtype, and each problem
it finds is reported under the YAML key (a key is checked even where the run's mode ignores it). So the config
accepts exactly what ``GradScaler`` accepts, a key left out (or null) takes the scaler's default, and the mode
follows the scaler's rule: dynamic for float16 and cbfloat16, off for bfloat16, unless ``loss_scaling_factor`` says
otherwise. Two rules are the trainer's own: a run computing in float32 has no loss scaling (its scaler is
disabled), and cbfloat16 takes only dynamic scaling (as on Cerebras).

Precision modes beyond autocast: ``precision.half_params`` (the parameters themselves in ``fp16_type``, with float32
master weights unless ``master_weights: false``) needs a half-precision run (``mixed_precision: true`` and a half
``fp16_type``): a float32 run already has float32 parameters, so asking for half parameters there is an error rather
than a silent no-op. ``precision.fp8`` (FP8 Linear layers, ``dls.fp8``) works with float32 and with float16/bfloat16
under autocast; it is an error with ``dls.emulate``'s rounding (cbfloat16, ``precision.emulate``), which would
decide what the Linear layers compute too. Its fields are judged by the recipe classes, each problem under its key
(``precision.fp8.margin must be an int ...``).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dls.settings import ScalerSettings, SettingsError
from dls.train import checks
from dls.train.errors import ConfigError
from dls.train.keys import (
    CHECKPOINT_STATES,
    KEY_ALIASES,
    MODEL_DATASETS,
    MOVED_KEYS,
    SECTION_ALIASES,
    SECTION_CLASSES,
    SECTIONS,
    DataConfig,
    Key,
    ModelConfig,
    OptimizerConfig,
    PrecisionConfig,
    RunConfig,
    TrainConfig,
    describe_keys,
    parse_checkpoint_states,
    section_keys,
    selector_of,
)
from dls.train.yamlfile import check_size, parse_yaml_value, read_yaml_file

__all__ = [
    "CHECKPOINT_STATES",
    "SECTIONS",
    "ConfigError",
    "DataConfig",
    "Key",
    "ModelConfig",
    "OptimizerConfig",
    "PrecisionConfig",
    "RunConfig",
    "TrainConfig",
    "apply_overrides",
    "describe_keys",
    "load_config",
    "loss_scaling_mode",
    "parse_checkpoint_states",
    "parse_config",
    "read_config",
    "scaler_settings",
    "to_dict",
]

# Names from other frameworks, pointed at the one key that does the same thing here.
_HINTS = {
    "growth_interval": "steps_per_increase (torch's growth_interval)",
    "loss_scale_window": "steps_per_increase (DeepSpeed's loss_scale_window)",
    "init_scale": "initial_loss_scale (torch's init_scale)",
    "initial_scale_power": "initial_loss_scale (DeepSpeed's initial_scale_power is its log2)",
    "min_scale": "min_loss_scale",
    "min_loss_scale_power": "min_loss_scale",
    "loss_scale": "loss_scaling_factor",
    "lr": "learning_rate",
    "clip_grad_norm": "max_gradient_norm",
    "gradient_clipping": "max_gradient_norm",
    "grad_clip": "max_gradient_norm",
    "type": "optimizer_type",
    "steps": "max_steps",
    "num_steps": "max_steps",
    "dtype": "fp16_type",
    "amp": "mixed_precision",
    "threads": "num_threads",
}


# ---------------------------------------------------------------------- the loss scaler
_SCALER_KEYS = {k.scaler: f"optimizer.{name}" for name, k in section_keys("optimizer").items() if k.scaler}
_SCALER_NAME_RE = re.compile(r"\b(" + "|".join(sorted(map(re.escape, _SCALER_KEYS), key=len, reverse=True)) + r")\b")


def _scaler_arguments(optimizer: Mapping[str, Any]) -> dict[str, Any]:
    """The ``ScalerSettings.cerebras`` arguments that the optimizer keys give (null keys are left to the scaler)."""
    keys = section_keys("optimizer")
    return {k.scaler: optimizer[name] for name, k in keys.items() if k.scaler and optimizer.get(name) is not None}


def _settings(optimizer: Mapping[str, Any], fp16_type: str) -> ScalerSettings:
    # A float32 run has no loss scaling; its (disabled) scaler's settings are float16's.
    half = "float16" if fp16_type == "float32" else fp16_type
    return ScalerSettings.cerebras(**_scaler_arguments(optimizer), half_dtype=half)


def _relabel(error: SettingsError, given: Mapping[str, Any]) -> list[str]:
    """The settings' problems under the YAML keys (``init_scale`` → ``optimizer.initial_loss_scale``). A problem
    that names none of the ``given`` arguments follows from another one (an initial scale that defaults to a bad
    ``max_loss_scale``) and is left out, unless every problem is such."""
    named = [(set(_SCALER_NAME_RE.findall(message)), message) for _, message in error.problems]
    kept = [message for names, message in named if names & given.keys()] or [message for _, message in named]
    return [_SCALER_NAME_RE.sub(lambda m: _SCALER_KEYS[m.group(1)], message) for message in kept]


def scaler_settings(cfg: TrainConfig) -> ScalerSettings:
    """The loss scaler's settings of ``cfg`` (Cerebras' dialect, ``precision.fp16_type`` as the half dtype). The
    scaler is enabled only when the run computes in a half format (:func:`loss_scaling_mode`)."""
    return _settings(dataclasses.asdict(cfg.optimizer), cfg.precision.fp16_type)


def loss_scaling_mode(cfg: TrainConfig) -> str:
    """``"dynamic"``, ``"static"`` or ``"off"``: the scaler's mode, ``"off"`` when the run computes in float32."""
    return "off" if cfg.precision.compute_dtype == "float32" else scaler_settings(cfg).mode


# ---------------------------------------------------------------------- parsing
def load_config(path: str | Path, overrides: Sequence[str] = ()) -> TrainConfig:
    """Read a YAML config file, apply ``section.key=value`` overrides, validate. Raises :class:`ConfigError`."""
    return parse_config(read_config(path, overrides), source=str(path))


def read_config(path: str | Path, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The YAML config file ``path`` as a dict, with ``overrides`` applied, not validated yet
    (:func:`dls.train.yamlfile.read_yaml_file` says what is refused)."""
    raw = read_yaml_file(path)
    return apply_overrides({} if raw is None else raw, overrides, source=str(path))


def apply_overrides(raw: Any, overrides: Sequence[str], source: str | None = None) -> dict[str, Any]:
    """``raw`` with each ``"section.key=value"`` applied (values parsed as YAML). ``raw`` is not changed: the
    mappings on an override's path are copied, the rest is shared (so a large value is never copied)."""
    check_size(raw, source)
    if not isinstance(raw, dict):
        raise ConfigError([f"the top level must be a mapping of sections ({', '.join(SECTIONS)}); got {raw!r}"], source)
    result = dict(raw)
    copies = {id(result)}  # the mappings that belong to result alone
    errors = []
    for item in overrides:
        path, sep, text = item.partition("=")
        keys = path.strip().split(".")
        if not sep or len(keys) < 2 or not all(keys):
            errors.append(f"override {item!r} must look like section.key=value, e.g. runconfig.max_steps=20")
            continue
        try:
            value = parse_yaml_value(text)
        except ConfigError as exc:
            errors.append(f"override {item!r}: value is not valid YAML ({exc.errors[0]})")
            continue
        node = result
        for i, k in enumerate(keys[:-1]):
            child = node.get(k)
            if child is None:
                child = node[k] = {}
                copies.add(id(child))
            if not isinstance(child, dict):
                errors.append(f"override {item!r}: {'.'.join(keys[: i + 1])} is not a section/mapping")
                break
            if id(child) not in copies:
                child = node[k] = dict(child)
                copies.add(id(child))
            node = child
        else:
            node[keys[-1]] = value
    if errors:
        raise ConfigError(errors, source)
    return result


def parse_config(raw: Mapping[str, Any], source: str | None = None) -> TrainConfig:
    """Validate a config dict (the parsed YAML) and build the :class:`TrainConfig`. Raises :class:`ConfigError`
    listing every problem."""
    check_size(dict(raw) if isinstance(raw, Mapping) else raw, source)
    if not isinstance(raw, Mapping):
        raise ConfigError([f"the top level must be a mapping of sections ({', '.join(SECTIONS)}); got {raw!r}"], source)
    errors: list[str] = []
    warnings: list[str] = []
    sections: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    shown: dict[str, str] = {}  # section -> the name the file used for it
    for name, body in raw.items():
        canonical = SECTION_ALIASES.get(str(name), str(name))
        if canonical not in SECTION_CLASSES:
            close = difflib.get_close_matches(str(name), [*SECTIONS, *SECTION_ALIASES], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            errors.append(f"unknown section {name}{hint}; allowed sections: {', '.join(SECTIONS)}")
            continue
        if canonical in shown:
            errors.append(f"give section {canonical!r} once: both {shown[canonical]!r} and {name!r} are present")
            continue
        shown[canonical] = name
        if body is None:
            continue
        if not isinstance(body, Mapping):
            errors.append(f"section {name} must be a mapping of keys; got {body!r}")
            continue
        aliases = KEY_ALIASES.get(canonical, {})
        for k, value in body.items():
            target: str = aliases.get(k, k) if isinstance(k, str) else str(k)
            if target in sections[canonical]:
                errors.append(f"{name}.{k} and {name}.{target} are the same setting; give one")
                continue
            sections[canonical][target] = value

    values: dict[str, dict[str, Any]] = {}
    for name, given in sections.items():
        default_selector = None
        if name == "data":  # the data set defaults to the one the model trains on
            default_selector = MODEL_DATASETS.get(values["model"].get("name", ""), (None,))[0]
        values[name] = _check_section(name, shown.get(name, name), given, errors, default_selector)

    _move_precision_aliases(values, errors)
    _check_combinations(values, errors, warnings)
    _check_loss_scaling(values, errors, warnings)
    if errors:
        raise ConfigError(errors, source)
    built = {name: cls(**values[name]) for name, cls in SECTION_CLASSES.items()}
    return TrainConfig(**built, warnings=tuple(warnings))


def _check_section(
    name: str, shown: str, given: dict[str, Any], errors: list[str], default_selector: str | None = None
) -> dict[str, Any]:
    keys = section_keys(name)
    selector_key = selector_of(name)
    selector = default_selector or (getattr(SECTION_CLASSES[name], selector_key) if selector_key else None)
    if selector_key and selector_key in given:
        parsed, problem = keys[selector_key].check(f"{shown}.{selector_key}", given[selector_key])
        selector = parsed if problem is None else None  # the problem is reported below
    for k, spec in keys.items():
        if spec.required and k not in given:
            allowed = spec.check.choices if isinstance(spec.check, checks.choice) else ("see dls keys",)
            errors.append(f"{shown}.{k} is required; allowed values: {', '.join(allowed)}")
    out: dict[str, Any] = {}
    for k, value in given.items():
        path = f"{shown}.{k}"
        if not isinstance(k, str) or k not in keys:
            applicable = [n for n, spec in keys.items() if not spec.only or selector in spec.only]
            errors.append(checks.unknown_key(path, str(k), applicable, _HINTS.get(str(k))))
            continue
        spec = keys[k]
        parsed, problem = spec.check(path, value)
        if problem:
            errors.extend([problem] if isinstance(problem, str) else problem)
            continue
        if spec.only and selector is not None and selector not in spec.only:
            errors.append(
                f"{path} applies only when {shown}.{selector_key} is {' or '.join(map(repr, spec.only))}; "
                f"it is {selector!r}"
            )
            continue
        out[k] = parsed
    return out


def _move_precision_aliases(values: dict[str, dict[str, Any]], errors: list[str]) -> None:
    for section, names in MOVED_KEYS.items():
        for name in names:
            if name not in values[section]:
                continue
            alias = values[section].pop(name)
            precision = values["precision"]
            if name in precision and precision[name] != alias:
                errors.append(
                    f"{section}.{name} ({alias!r}) and precision.{name} ({precision[name]!r}) disagree; "
                    f"give it in one place (precision.{name})"
                )
            precision[name] = alias


def _check_combinations(values: dict[str, dict[str, Any]], errors: list[str], warnings: list[str]) -> None:
    model, data, prec, opt = (values[s] for s in ("model", "data", "precision", "optimizer"))
    name = model.get("name", ModelConfig.name)
    dataset = data.get("dataset")
    if dataset is None and name in MODEL_DATASETS:
        data["dataset"] = dataset = MODEL_DATASETS[name][0]
    if name in MODEL_DATASETS and dataset not in MODEL_DATASETS[name]:
        errors.append(
            f"data.dataset {dataset!r} does not fit model.name {name!r}; allowed: {', '.join(MODEL_DATASETS[name])}"
        )
    if name == "transformer_lm":
        hidden = model.get("hidden_size", ModelConfig.hidden_size)
        heads = model.get("num_heads", ModelConfig.num_heads)
        if hidden % heads:
            errors.append(f"model.num_heads ({heads}) must divide model.hidden_size ({hidden})")
        seq = data.get("max_sequence_length", DataConfig.max_sequence_length)
        positions = model.get("max_position_embeddings", ModelConfig.max_position_embeddings)
        if seq > positions:
            errors.append(f"data.max_sequence_length ({seq}) exceeds model.max_position_embeddings ({positions})")
    mixed = prec.get("mixed_precision", PrecisionConfig.mixed_precision)
    if not mixed and prec.get("fp16_type") in ("float16", "bfloat16", "cbfloat16"):
        warnings.append(
            f"precision.fp16_type ({prec['fp16_type']!r}) has no effect: precision.mixed_precision is false, so the "
            "run computes in float32 (set mixed_precision: true to use it)"
        )
    if prec.get("emulate") and not (mixed and prec.get("fp16_type", PrecisionConfig.fp16_type) != "float32"):
        warnings.append("precision.emulate has no effect: the run computes in float32")
    _check_precision_modes(prec, errors, warnings)
    if opt.get("max_gradient_norm") is not None and opt.get("max_gradient_value") is not None:
        errors.append("give optimizer.max_gradient_norm or optimizer.max_gradient_value, not both")


def _check_precision_modes(prec: dict[str, Any], errors: list[str], warnings: list[str]) -> None:
    """``half_params``, ``master_weights`` and ``fp8`` against the compute precision (see ``dls.train.keys``)."""
    mixed = prec.get("mixed_precision", PrecisionConfig.mixed_precision)
    half = prec.get("fp16_type", PrecisionConfig.fp16_type)
    compute = half if mixed else "float32"
    if prec.get("half_params"):
        if compute == "float32":
            errors.append(
                "precision.half_params needs a half-precision run: the run computes in float32 (set "
                "precision.mixed_precision: true and precision.fp16_type to float16, bfloat16 or cbfloat16), and "
                "float32 parameters are what it keeps without half_params"
            )
        elif half == "cbfloat16" and prec.get("master_weights") is False:
            errors.append(
                "precision.master_weights: false does not work with cbfloat16 half_params: cbfloat16 has no torch "
                "dtype, and its parameters stay on the cbfloat16 grid only through the master weights"
            )
        elif half != "cbfloat16" and prec.get("emulate"):
            warnings.append(
                f"precision.emulate has no effect: with half_params the model's parameters are {half} and it computes "
                f"in {half} natively"
            )
            prec.pop("emulate")
    elif "master_weights" in prec:
        warnings.append("precision.master_weights has no effect without precision.half_params: true")
        prec.pop("master_weights")
    emulated = compute == "cbfloat16" or (compute != "float32" and prec.get("emulate", False))
    if prec.get("fp8") is not None and emulated:
        errors.append(
            "precision.fp8 cannot be combined with dls.emulate's rounding (fp16_type cbfloat16, or "
            "precision.emulate: true): both decide what the Linear layers compute; with fp8 the rest of the model "
            "computes in float32, or in float16/bfloat16 under torch.autocast"
        )


def _check_loss_scaling(values: dict[str, dict[str, Any]], errors: list[str], warnings: list[str]) -> None:
    """Let ``ScalerSettings`` judge every loss-scaling key that was given, whether or not it takes effect in this run
    (``loss_scaling_factor`` on its own, the others as dynamic scaling's settings), then drop with a warning the keys
    the run's mode ignores."""
    opt, prec = values["optimizer"], values["precision"]
    half = prec.get("fp16_type", PrecisionConfig.fp16_type)
    factor = opt.get("loss_scaling_factor")
    given = _scaler_arguments(opt)
    others = {k: v for k, v in given.items() if k != "loss_scale"}
    try:
        mode = _settings({"loss_scaling_factor": factor}, half).mode  # the scaler's own rule for the mode
        _settings({**opt, "loss_scaling_factor": "dynamic"}, half)
    except SettingsError as exc:
        errors.extend(_relabel(exc, given if "loss_scale" in {a for a, _ in exc.problems} else others))
        return
    if not prec.get("mixed_precision", PrecisionConfig.mixed_precision) or half == "float32":
        mode, why = "off", "the run computes in float32 (precision.mixed_precision is false), without loss scaling"
    elif half == "cbfloat16" and mode != "dynamic":
        errors.append(f"optimizer.loss_scaling_factor must be 'dynamic' for cbfloat16 (as on Cerebras); got {factor!r}")
        return
    elif mode == "static":
        why = f"loss_scaling_factor is a static {factor:g}"
    else:  # off (dynamic scaling ignores nothing)
        why = f"loss scaling is off for {half} (set optimizer.loss_scaling_factor: dynamic to use it)"
    for name, spec in section_keys("optimizer").items():
        ignored = (spec.scaling == "any" and mode == "off") or (spec.scaling == "dynamic" and mode != "dynamic")
        if ignored and opt.get(name) is not None:
            warnings.append(f"optimizer.{name} is ignored: {why}")
            opt.pop(name)


# ---------------------------------------------------------------------- output
def to_dict(cfg: TrainConfig) -> dict[str, Any]:
    """The config as plain nested dicts/lists (YAML- and JSON-friendly) that ``parse_config`` reads back to the
    same config: keys that do not apply (the other model's sizes, dynamic-scaling keys without dynamic scaling,
    ``fp16_type`` without mixed precision) and ``warnings`` are left out. Null loss-scaling keys stay null (the
    scaler's defaults, see :func:`scaler_settings`)."""

    def plain(value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    mode = loss_scaling_mode(cfg)
    out: dict[str, Any] = {}
    for name in SECTIONS:
        section = getattr(cfg, name)
        selector_key = selector_of(name)
        selector = getattr(section, selector_key) if selector_key else None
        body = {}
        for f in dataclasses.fields(section):
            spec: Key = f.metadata["key"]
            if spec.only and selector not in spec.only:
                continue
            if (spec.scaling == "any" and mode == "off") or (spec.scaling == "dynamic" and mode != "dynamic"):
                continue
            body[f.name] = plain(getattr(section, f.name))
        out[name] = body
    if not cfg.precision.mixed_precision:
        out["precision"].pop("fp16_type")
    if not cfg.precision.half_params:
        out["precision"].pop("master_weights")
    return out
