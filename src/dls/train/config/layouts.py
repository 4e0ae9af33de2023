"""Model Zoo's layouts, key by key, onto dls's sections (:class:`Reader`): the legacy one (top-level ``train_input``,
``model``, ``optimizer``, ``runconfig``, ...), the current one (``trainer: {init, fit, validate}``), Release 1.x's
key names (:func:`from_release_1`), Model Zoo's defaults where they differ from dls's (:func:`apply_defaults`), what
refuses a config as a whole (:func:`refused_whole`), and back: :func:`to_dict`, the config in dls's own layout.
Each key is sent to a ``(section, key)``, a table of its keys, or a reader of its value; Model Zoo's own keys of a
model or data processor go to the section's ``params``; keys that mean nothing off Cerebras hardware are accepted
and listed once (:data:`IGNORED_OFF_CEREBRAS`, :data:`ZOO_RUNCONFIG`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, get_args

from dls.train.config.schema import (
    CANONICAL,
    MODEL_DATASETS,
    MODEL_NAMES,
    ONLY,
    SCALER_KEYS,
    SECTION_CLASSES,
    ZOO_MODELS,
    ModelName,
    did_you_mean,
    unknown_key,
)

if TYPE_CHECKING:  # annotations only
    from dls.train.config.schema import TrainConfig

# Keys that mean nothing off Cerebras hardware (or outside Model Zoo's launcher), in whatever section they appear:
# accepted, and listed once as ignored.
IGNORED_OFF_CEREBRAS = {
    "num_workers", "prefetch_factor", "persistent_workers", "precision_opt_level", "enable_distributed",
    "num_csx", "save_losses", "num_wgt_servers", "num_act_servers", "mgmt_address",
    "credentials_path", "mount_dirs", "python_paths", "compile_dir", "job_labels", "compile_only",
    "validate_only", "use_cs_grad_accum", "micro_batch_size", "enable_act_frequency",
    "log_level", "wsc_log_level", "ScopedTrainFlags", "ScopedValidateFlags", "GlobalFlags",
    "DebugArgsPath", "to_float16", "use_worker_cache", "sync_batchnorm",
}  # fmt: skip
CEREBRAS, NOT_DONE = "Cerebras only", "not done by dls"
# Model Zoo's runconfig keys (the legacy layout's; runconfig_schema.yaml of Releases 1.8.0, 1.9.1, 2.3.1 and 2.10.0,
# copied into tests/data/modelzoo): the dls runconfig key each sets, or CEREBRAS (no meaning off Cerebras hardware or
# outside Model Zoo's launcher) or NOT_DONE (a meaning dls does not carry out): both accepted and listed once. What
# each means, and what dls does: the Model Zoo table of docs/guides/trainer.md.
ZOO_RUNCONFIG: dict[str, str] = {
    **{k: k for k in (
        "autoload_last_checkpoint", "checkpoint_path", "checkpoint_steps", "disable_strict_checkpoint_loading",
        "eval_frequency", "eval_steps", "load_checkpoint_states", "log_steps", "max_steps", "model_dir", "num_epochs",
        "num_steps", "save_initial_checkpoint", "seed", "steps_per_epoch", "keep_checkpoint_max",
    )},
    "max_checkpoints": "keep_checkpoint_max", "target_device": "backend",
    **dict.fromkeys((
        "act_memory_gi", "cbcore_image", "chf_memory_gi", "cmd_memory_gi", "compile_crd_memory_gi", "compile_dir",
        "compile_only", "credentials_path", "debug_args", "debug_args_path", "disable_version_check", "drop_data",
        "dump_activations", "enable_act_frequency", "execute_crd_memory_gi", "fabric_type_blacklist", "ini",
        "job_labels", "job_priority", "job_time_sec", "lazy_initialization", "legacy_event_dirs", "log_initialization",
        "mgmt_address", "mgmt_namespace", "mount_dirs", "num_act_servers", "num_csx", "num_wgt_servers",
        "num_workers_per_csx", "precision_opt_level", "python_paths", "retrace_every_iteration", "transfer_processes",
        "validate_only", "variant", "wgt_memory_gi", "wrk_memory_gi", "wsc_log_level",
        # Releases 1.8 and 1.9 only
        "autogen_policy", "execution_strategy", "experimental_api", "multireplica", "num_replicas", "save_losses",
        "save_stream_size", "service_dir", "skip_train_recv_activations", "use_appliance_data", "use_cs_grad_accum",
        "use_cstorch_optimizer_step",
    ), CEREBRAS),
    **dict.fromkeys((
        "check_loss_values", "dist_addr", "dist_backend", "enable_distributed", "experimental", "hf_cache_dir",
        "init_method", "log_input_summaries", "logging", "main_process_id", "mode", "op_profiler_config",
        "summary_dir", "sync_batchnorm",
        # Releases 1.8 and 1.9 only
        "enable_summaries", "is_pretrained_checkpoint", "save_summary_steps", "show_debug_metrics",
    ), NOT_DONE),
}  # fmt: skip


def _same(section: str, keys: str) -> dict[str, tuple[str, str]]:
    return {k: (section, k) for k in keys.split()}


LEGACY_SECTIONS = {"train_input": "data", "data": "data", "eval_input": "eval_data"}  # a legacy section -> dls's
LEGACY_SECTIONS.update({k: k for k in ("model", "optimizer", "runconfig", "precision")})
MOVED: dict[str, dict[str, Any]] = {  # a legacy section's keys that are read into another section's key
    "model": _same("precision", "mixed_precision fp16_type"),
    "optimizer": {"weight_decay_rate": ("optimizer", "weight_decay"), **_same("runconfig", "grad_accum_steps")},
}
_DLS_FIELDS = ("name", "data_processor", "batch_size", "shuffle", "shuffle_seed", "drop_last_batch")
OPTIMIZER_ARGS = _same("optimizer", "learning_rate momentum weight_decay betas eps correct_bias adjust_learning_rate")
OPTIMIZER_ARGS["lr"] = ("optimizer", "learning_rate")  # torch's name
_SCHEDULERS = {"ConstantLR": "Constant", "LinearLR": "Linear", "CosineDecayLR": "CosineDecay"}
ZOO_ADAM_EPS = 1e-6  # cstorch's Adam and AdamW: Model Zoo's default epsilon
# Model Zoo's defaults where they differ from dls's: (section, key) -> {the key as written in each layout: default}.
_ZOO_DEFAULTS: dict[tuple[str, str], dict[str, Any]] = {
    ("precision", "fp16_type"): {"model.fp16_type": "float16", "trainer.init.precision.fp16_type": "bfloat16"},
    ("precision", "mixed_precision"): {"model.mixed_precision": False, "trainer.init.precision.enabled": True},
    ("optimizer", "loss_scaling_factor"): {
        "optimizer.loss_scaling_factor": 1.0,
        "trainer.init.precision.loss_scaling_factor": 1.0,
    },
    ("runconfig", "autoload_last_checkpoint"): {"trainer.init.checkpoint.autoload_last_checkpoint": True},
}


class Reader:
    """Walks a config onto dls's sections: the values, where each was written (for errors), problems and notes."""

    def __init__(self, zoo_model: bool) -> None:
        self.zoo_model = zoo_model  # a Model Zoo model: its model and data keys go to params
        self.sections: dict[str, dict[str, Any]] = {name: {} for name in [*SECTION_CLASSES, "eval_data"]}
        self.written: dict[str, str] = {}  # "section.key" -> the key as written
        self.errors: list[str] = []
        self.ignored: list[str] = []  # Cerebras-only keys
        self.not_done: list[str] = []  # Model Zoo keys whose meaning dls does not carry out
        self.notes: list[str] = []
        self.layout = "dls"  # dls, legacy or current: whose trainer's semantics the config asks for

    def at(self, section: str, key: str) -> str:
        """``section.key`` as the config wrote it."""
        return self.written.get(f"{section}.{key}", f"{section}.{key}")

    def put(self, section: str, key: str, value: Any, path: str) -> None:
        if f"{section}.{key}" in self.written:
            other, before = self.written[f"{section}.{key}"], self.sections[section][key]
            if key == "learning_rate" and _constant(before) == _constant(value) is not None:
                return  # an optimizer's learning rate and a constant schedule of it: Model Zoo's own configs
            if before != value:
                self.errors.append(f"{other} ({before!r}) and {path} ({value!r}) disagree; give it in one place")
            elif path.split(".")[-1] != other.split(".")[-1]:
                self.errors.append(f"{other} and {path} are the same setting; give one")
            return
        self.sections[section][key] = value
        self.written[f"{section}.{key}"] = path

    def mapping(self, value: Any, path: str) -> Mapping[Any, Any]:
        if value is not None and not isinstance(value, Mapping):
            self.errors.append(f"{'section ' * ('.' not in path)}{path} must be a mapping of keys; got {value!r}")
        return value if isinstance(value, Mapping) else {}

    def walk(
        self, body: Any, path: str, table: Mapping[str, Any], params: dict[str, Any] | None = None, ignore: bool = False
    ) -> None:
        """Each key of the mapping ``body`` (written at ``path``) where ``table`` sends it: to a ``(section, key)``,
        through a nested table, or to a reader ``(reader, value, path)``. Other keys: ignored if Cerebras only (or
        ``ignore``: all), else into ``params`` (a Model Zoo model's or reader's own keys) unless one of dls's, else
        refused."""
        for key, value in self.mapping(body, path).items():
            where, to = f"{path}.{key}", table.get(key)
            if isinstance(to, tuple):
                self.put(to[0], to[1], value, where)
            elif isinstance(to, dict):
                self.walk(value, where, to)
            elif to is not None:
                to(self, value, where)
            elif key in IGNORED_OFF_CEREBRAS or ignore:
                self.ignored.append(where)
            elif params is not None and key not in _DLS_FIELDS:
                params[key] = value
            else:
                self.errors.append(unknown_key(path, key, list(table)))

    def section(self, section: str, body: Any, path: str, moved: Mapping[str, tuple[str, str]] = {}) -> None:
        """A section written as dls's fields; a Model Zoo model's or reader's own keys go to ``params``."""
        body = self.mapping(body, path)
        zoo = self.zoo_model or (section != "model" and "data_processor" in body)
        params: dict[str, Any] | None = {} if zoo and section in ("model", "data", "eval_data") else None
        fields = SECTION_CLASSES[section.removeprefix("eval_")].model_fields
        keys = " ".join(f for f in fields if f != "params" and (params is None or f in _DLS_FIELDS))
        self.walk(body, path, {**_same(section, keys), **moved}, params)
        if params is not None:  # also empty: where the section is written
            self.put(section, "params", params, path)

    def legacy(self, raw: Mapping[Any, Any]) -> None:
        seen: dict[str, str] = {}
        for name, body in raw.items():
            section = LEGACY_SECTIONS.get(name)
            if name == "sparsity":
                self.sparsity(body, name)
            elif name == "csconfig":  # Release 1.x: the Cerebras system's settings
                self.walk(body, name, {"use_cbfloat16": Reader.use_cbfloat16}, ignore=True)
            elif section is None:
                hint = did_you_mean(name, [*LEGACY_SECTIONS, "sparsity"])
                self.errors.append(f"unknown section {name}{hint}; allowed: {', '.join(LEGACY_SECTIONS)}")
            elif section in seen:
                self.errors.append(f"give section {section!r} once: both {seen[section]!r} and {name!r} are present")
            else:
                seen[section] = str(name)
                self.section(section, body, str(name), MOVED.get(section, {}))

    def backend(self, value: Any, path: str) -> None:
        backend = self.mapping(value, path)
        if "backend_type" in backend:
            self.backend_type(backend["backend_type"], f"{path}.backend_type")
        self.ignored.extend(f"{path}.{k}" for k in backend if k != "backend_type")

    def backend_type(self, kind: Any, path: str) -> None:
        """``backend_type`` (legacy: ``runconfig.target_device``): the device, and whose semantics the run follows."""
        if kind in ("CPU", "GPU", "CSX"):
            self.put("runconfig", "device", {"CPU": "cpu", "GPU": "cuda", "CSX": "auto"}[kind], path)
            self.put("runconfig", "backend", kind, path)
            if kind == "CSX":
                self.notes.append(f"{path} CSX: not this hardware; the run uses the best device here")
        elif kind is not None:
            hint = did_you_mean(kind, ("CSX", "CPU", "GPU"))
            self.errors.append(f"{path} must be CSX, CPU or GPU; got {kind!r}{hint}")

    def use_cbfloat16(self, value: Any, path: str) -> None:
        """Release 1.x's ``csconfig.use_cbfloat16``: cbfloat16 for the half format, as ``fp16_type: cbfloat16``."""
        if value is True:
            self.errors.append(f"{path}: write it as Release 2 does, model.fp16_type: cbfloat16 (dls reads that)")
        elif value is not False:
            self.errors.append(f"{path} must be true or false; got {value!r}")

    def sparsity(self, value: Any, path: str) -> None:
        """Model Zoo's ``sparsity``: refused (dls trains dense models), unless removed with ``-o PATH=null``."""
        if value is not None:
            how = f"to train the model dense, remove the section: -o {path}=null"
            self.errors.append(f"{path}: Model Zoo's sparsity is not implemented in dls ({how})")

    def optimizer(self, value: Any, path: str) -> None:
        body = self.mapping(value, path)
        if len(body) != 1:
            self.errors.append(f"{path} must name one optimizer class (SGD, Adam or AdamW); got {list(body)}")
            return
        ((name, args),) = body.items()
        self.put("optimizer", "optimizer_type", name, path)
        self.walk(args, f"{path}.{name}", OPTIMIZER_ARGS)

    def callbacks(self, value: Any, path: str) -> None:
        for i, item in enumerate(value if isinstance(value, list) else [value]):
            name = next(iter(item)) if isinstance(item, Mapping) and len(item) == 1 else None
            if name is None:
                self.errors.append(f"{path}[{i}] must be {{CallbackName: {{...}}}}; got {item!r}")
            elif name in IGNORED_OFF_CEREBRAS or name in _CALLBACKS:
                self.walk(item, f"{path}[{i}]", _CALLBACKS)
            else:
                self.errors.append(f"{path}[{i}]: dls does not run the callback {name!r}; remove it")

    def schedulers(self, value: Any, path: str) -> None:
        """Model Zoo's ``schedulers: [{LinearLR: {...}}]`` (or one ``SequentialLR`` of them) as schedule pieces."""
        items, where = value if isinstance(value, list) else [value], path
        if len(items) == 1 and isinstance(items[0], Mapping) and list(items[0]) == ["SequentialLR"]:
            body, where = items[0]["SequentialLR"], f"{path}[0].SequentialLR"
            if not isinstance(body, Mapping) or not isinstance(body.get("schedulers"), list):
                self.errors.append(f"{where} must hold schedulers: [...]")
                return
            if extra := [k for k in body if k != "schedulers"]:
                self.errors.append(f"{where}.{extra[0]} is not supported (pieces follow their total_iters)")
            items, where = body["schedulers"], f"{where}.schedulers"
        elif len(items) != 1:
            self.errors.append(f"{path} must be one scheduler (use SequentialLR to chain them); got {len(items)}")
            return
        pieces = []
        for i, item in enumerate(items):
            name = next(iter(item)) if isinstance(item, Mapping) and len(item) == 1 else None
            if name not in _SCHEDULERS or not isinstance(item[name], (Mapping, type(None))):
                hint = did_you_mean(name, _SCHEDULERS)
                self.errors.append(f"{where}[{i}] must be one of {', '.join(_SCHEDULERS)}; got {item!r}{hint}")
            else:
                pieces.append({"scheduler": _SCHEDULERS[name], **(item[name] or {})})
        self.put("optimizer", "learning_rate", pieces, path)


def _constant(learning_rate: Any) -> Any:
    """A learning rate that is one number (also a schedule of one ``Constant`` piece): that number; else ``None``."""
    if isinstance(learning_rate, list) and len(learning_rate) == 1 and isinstance(learning_rate[0], Mapping):
        piece = learning_rate[0]
        one = piece.get("scheduler") == "Constant" and set(piece) <= {"scheduler", "learning_rate", "total_iters"}
        learning_rate = piece.get("learning_rate") if one else None
    number = isinstance(learning_rate, (int, float)) and not isinstance(learning_rate, bool)
    return learning_rate if number else None


def _listed_as(kind: str) -> Any:
    """The reader of a key that is accepted and listed once: Cerebras only, or a meaning dls does not carry out."""
    return lambda r, value, path: (r.ignored if kind == CEREBRAS else r.not_done).append(path)


# A legacy runconfig: Model Zoo's keys (ZOO_RUNCONFIG), besides dls's own.
MOVED["runconfig"] = {
    key: (
        Reader.backend_type if to == "backend" else _listed_as(to) if to in (CEREBRAS, NOT_DONE) else ("runconfig", to)
    )
    for key, to in ZOO_RUNCONFIG.items()
}
MOVED["optimizer"]["ws_summary"] = _listed_as(NOT_DONE)  # TensorFlow Model Zoo's summaries; no PyTorch code reads it
# Model Zoo's callbacks of the current layout that dls honours (Cerebras-only ones: IGNORED_OFF_CEREBRAS).
_CALLBACKS: dict[str, Any] = {
    "LoadCheckpointStates": _same("runconfig", "load_checkpoint_states"),
    "KeepNCheckpoints": {"n": ("runconfig", "keep_checkpoint_max")},
    "ComputeNorm": lambda r, value, path: r.put("optimizer", "log_summaries", True, path),
    "CheckLoss": _listed_as(NOT_DONE),
    "LogInputSummaries": _listed_as(NOT_DONE),
}

# The current layout's trainer: each key -> (section, key), a table of its keys, or the reader of its value.
CURRENT_LAYOUT: dict[str, Any] = {
    "init": {
        **_same("runconfig", "model_dir seed device num_threads tensorboard max_overflows_at_min_loss_scale"),
        "model": lambda r, value, path: r.section("model", value, path),
        "backend": Reader.backend,
        "optimizer": Reader.optimizer,
        "schedulers": Reader.schedulers,
        "callbacks": Reader.callbacks,
        "sparsity": Reader.sparsity,
        "precision": {
            "enabled": ("precision", "mixed_precision"),
            **_same(
                "optimizer", " ".join([*SCALER_KEYS, "max_gradient_value", "log_loss_scale", "force_loss_scaling"])
            ),
            **_same("precision", "fp16_type keep_in_float32 fallback emulate half_params master_weights fp8"),
            **_same("precision", "log_underflow"),
        },
        "loop": _same(
            "runconfig", "max_steps num_epochs steps_per_epoch eval_frequency eval_steps grad_accum_steps num_steps"
        ),
        "checkpoint": {
            "steps": ("runconfig", "checkpoint_steps"),
            **_same("runconfig", "save_initial_checkpoint disable_strict_checkpoint_loading autoload_last_checkpoint"),
            **_same("runconfig", "keep_checkpoint_max"),
        },
        "logging": {"log_steps": ("runconfig", "log_steps")},
    },
    "fit": {
        "train_dataloader": lambda r, value, path: r.section("data", value, path),
        "val_dataloader": lambda r, value, path: r.section("eval_data", value, path),
        "ckpt_path": ("runconfig", "checkpoint_path"),
    },
    "validate": lambda r, value, path: r.notes.append(f"{path}: dls train runs trainer.fit (not checked)"),
}
CURRENT_LAYOUT["validate_all"] = CURRENT_LAYOUT["validate"]

# Keys only Model Zoo's Release 1.x configs (1.8, 1.9) write: a legacy config holding one is read by
# from_release_1, as those releases' PyTorch code read it.
RELEASE_1_KEYS = {
    "optimizer": ("beta1", "beta2", "epsilon", "use_bias_correction", "disable_lr_steps_reset"),
    "model": ("use_rms_norm", "use_position_embedding"),
}


def from_release_1(raw: dict[str, Any]) -> tuple[dict[str, Any], list[str], list[str]]:
    """A Release 1.x legacy config in Release 2's keys, each key with the meaning Release 1.8's and 1.9's PyTorch
    code gave it (``modelzoo/common/pytorch/PyTorchBaseModel.py`` and ``transformers/pytorch/gpt2/model.py`` at
    tags Release_1.8.0 and Release_1.9.1); returns the config, a note per translation and the errors.

    - ``optimizer.beta1``/``beta2`` are ``betas`` (each 0.9 / 0.999 when missing, as there);
    - ``optimizer.epsilon`` and ``use_bias_correction`` are TensorFlow keys those releases' PyTorch optimizers never
      read (they read ``eps``, default 1e-6, and ``correct_bias``): not used, as there;
    - ``optimizer.disable_lr_steps_reset: false`` is Release 2's behaviour (each schedule piece counts its own
      steps); ``true`` is refused;
    - a schedule piece's ``steps`` or ``decay_steps`` is its ``total_iters``; ``alpha`` on a Linear piece was not
      read (power 1): not used;
    - ``model.use_rms_norm: true`` is ``norm_type: rmsnorm``; ``use_position_embedding: false`` is
      ``position_embedding_type: null``.

    ``correct_bias`` is the one default the two releases disagree on (1.8: false, 1.9: true); a config that leaves
    it out gets Release 2's (true), and a note says so.
    """
    raw, notes, errors = dict(raw), [], []
    opt = dict(raw["optimizer"]) if isinstance(raw.get("optimizer"), Mapping) else None
    model = dict(raw["model"]) if isinstance(raw.get("model"), Mapping) else None
    if opt is not None:
        if "beta1" in opt or "beta2" in opt:
            if "betas" in opt:
                errors.append("optimizer.betas and optimizer.beta1/beta2 (Release 1.x's names) are both given")
            opt["betas"] = [opt.pop("beta1", 0.9), opt.pop("beta2", 0.999)]
            notes.append(f"optimizer.beta1, beta2 (Release 1.x): betas {opt['betas']}")
        unread = [k for k in ("epsilon", "use_bias_correction") if opt.pop(k, None) is not None]
        if unread:
            keys = ", ".join(f"optimizer.{k}" for k in unread)
            notes.append(f"{keys}: not used, as in Release 1.x's PyTorch optimizers (they read eps and correct_bias)")
        if "disable_lr_steps_reset" in opt and opt.pop("disable_lr_steps_reset") is not False:
            errors.append("optimizer.disable_lr_steps_reset: only false (each schedule piece counts its own "
                          "steps, as in Release 2) is supported")  # fmt: skip
        kind = opt.get("optimizer_type")
        if isinstance(kind, str) and kind.lower() == "adamw" and "correct_bias" not in opt:
            notes.append("optimizer.correct_bias: true, Release 2's default (Release 1.8's was false, 1.9's true; "
                         "set it to choose)")  # fmt: skip
        if "learning_rate" in opt:
            opt["learning_rate"] = _release_1_schedule(opt["learning_rate"], notes, errors)
        raw["optimizer"] = opt
    if model is not None:
        if "use_rms_norm" in model:
            rms = model.pop("use_rms_norm")
            if "norm_type" in model:
                errors.append("model.norm_type and model.use_rms_norm (Release 1.x's name) are both given")
            elif rms is True:
                model["norm_type"] = "rmsnorm"
            elif rms is not False:
                errors.append(f"model.use_rms_norm must be true or false; got {rms!r}")
            notes.append(f"model.use_rms_norm (Release 1.x): norm_type {model.get('norm_type', 'layernorm')}")
        if "use_position_embedding" in model:
            used = model.pop("use_position_embedding")
            if used is False:
                model["position_embedding_type"] = None
                notes.append("model.use_position_embedding: false (Release 1.x): position_embedding_type null")
            elif used is not True:
                errors.append(f"model.use_position_embedding must be true or false; got {used!r}")
        raw["model"] = model
    return raw, notes, errors


def _release_1_schedule(pieces: Any, notes: list[str], errors: list[str]) -> Any:
    """Release 1.x's learning-rate pieces in Release 2's keys (see ``from_release_1``)."""
    if not isinstance(pieces, (list, Mapping)):
        return pieces
    translated = []
    for i, given in enumerate(pieces if isinstance(pieces, list) else [pieces]):
        piece = dict(given) if isinstance(given, Mapping) else given
        where = f"optimizer.learning_rate[{i}]" if isinstance(pieces, list) else "optimizer.learning_rate"
        steps = [k for k in ("steps", "decay_steps") if isinstance(piece, dict) and k in piece]
        if steps and "total_iters" in piece:
            errors.append(f"{where}: {steps[0]} and total_iters are both given")
        elif steps:
            piece["total_iters"] = piece.pop(steps[0])
            piece.pop("decay_steps", None)
            notes.append(f"{where}.{steps[0]} (Release 1.x): total_iters {piece['total_iters']}")
        linear = isinstance(piece, dict) and str(piece.get("scheduler", "")).lower() in ("linear", "linearlr")
        if linear and piece.pop("alpha", None) is not None:
            notes.append(f"{where}.alpha: not used, as in Release 1.x's Linear schedule")
        translated.append(piece)
    return translated if isinstance(pieces, list) else translated[0]


# Model Zoo model features dls's models do not build, each refusing a config as a whole (its other keys would only
# add errors that follow from it, such as the data transforms that feed it).
_UNBUILT_FEATURES = {
    "attention_sliding_window_length": "sliding-window attention",
    "attention_sink_tokens": "attention sink tokens",
}


def refused_whole(raw: Mapping[str, Any], layout: str, model: Any) -> str | None:
    """What refuses a config as a whole, in one line: another model family than dls builds; a model feature dls's
    models do not build (``_UNBUILT_FEATURES``); a model without a name in Model Zoo's layouts."""
    model = model if isinstance(model, Mapping) else {}
    name = model.get("name")
    at = "trainer.init.model" if layout == "current" else "model"
    where = f"{at}.name"
    if unbuilt := [key for key in _UNBUILT_FEATURES if model.get(key) is not None]:
        features = " and ".join(_UNBUILT_FEATURES[key] for key in unbuilt)
        return f"{at}.{unbuilt[0]}: dls's Model Zoo models do not implement {features}, which this config uses"
    if isinstance(name, str) and name not in get_args(ModelName):
        zoo = ", ".join(ZOO_MODELS)
        return f"{where}: {zoo} are supported (and dls's own {', '.join(MODEL_NAMES)}); this config is {name}"
    if name is None and (layout == "current" or any(k in raw for k in ("train_input", "eval_input"))):
        how = f"Model Zoo picks it by its run.py: name it, e.g. -o {where}=gpt2"
        return f"{where} is required ({how}); one of {', '.join(get_args(ModelName))}"
    return None


def apply_defaults(r: Reader, layout: str) -> str:
    """The defaults a config leaves to its trainer: Model Zoo's (each noted) or dls's; the layout (``dls`` for
    dls's own configs). The keys that apply to another variant of their section are refused."""
    s = r.sections
    name = s["model"].get("name")
    if name is None:
        hint = "Model Zoo picks it by its run.py: name it, e.g. -o model.name=gpt2"
        r.errors.append(f"model.name is required ({hint}); one of {', '.join(get_args(ModelName))}")
    if layout == "current" or name in ZOO_MODELS or "data_processor" in s["data"]:
        _zoo_defaults(r, layout)
    else:
        layout = "dls"
    if name in MODEL_NAMES and "data_processor" not in s["data"]:
        s["data"].setdefault("dataset", MODEL_DATASETS[str(name)])
    for section in ("data", "eval_data") if name in ZOO_MODELS else ():  # the reader the model implies (run.py's)
        if s[section].get("data_processor") is None and (s[section] or section == "data"):  # null: the default
            s[section]["data_processor"] = "MNISTDataProcessor" if name == "fc_mnist" else "GptHDF5DataProcessor"
    for section, selector in {"model": "name", "data": "dataset", "optimizer": "optimizer_type"}.items():
        value = s[section].get(selector, "Adam" if section == "optimizer" else None)
        value = CANONICAL.get(value.lower(), value) if isinstance(value, str) else value
        for key in [k for k in s[section] if k in ONLY and value is not None and value not in ONLY[k]]:
            only = " or ".join(map(repr, ONLY[key]))
            r.errors.append(f"{r.at(section, key)} applies only when {section}.{selector} is {only}; it is {value!r}")
            del s[section][key]
    return layout


def _zoo_defaults(r: Reader, layout: str) -> None:
    """Model Zoo's defaults where they differ from dls's, each noted: :data:`_ZOO_DEFAULTS`, and cstorch's Adam
    epsilon 1e-6; and whether the loss scale is logged (``log_loss_scale``), as Model Zoo decides it."""
    s, other = r.sections, "legacy" if layout == "current" else "current"
    for (section, key), given in _ZOO_DEFAULTS.items():
        ours = {p: v for p, v in given.items() if p.startswith("trainer.") == (layout == "current")}
        if ours and f"{section}.{key}" not in r.written:
            ((path, value),) = ours.items()
            s[section][key] = value
            theirs = [v for v in given.values() if v != value]
            differs = f" ({other} layout: {theirs[0]!r})" if theirs else ""
            r.notes.append(f"{path}: {value!r}, Model Zoo's default in the {layout} layout{differs}")
    if s["optimizer"].get("log_loss_scale") is None:  # Model Zoo's: legacy, with log_summaries; current, if dynamic
        opt = s["optimizer"]
        legacy = opt.get("log_summaries") is True
        s["optimizer"]["log_loss_scale"] = legacy if layout == "legacy" else opt.get("loss_scaling_factor") == "dynamic"
    kind = s["optimizer"].get("optimizer_type", "Adam")
    if isinstance(kind, str) and CANONICAL.get(kind.lower()) in ("Adam", "AdamW") and "optimizer.eps" not in r.written:
        s["optimizer"]["eps"] = ZOO_ADAM_EPS
        path = f"{r.at('optimizer', 'optimizer_type')}.{kind}.eps" if layout == "current" else "optimizer.eps"
        r.notes.append(f"{path}: {ZOO_ADAM_EPS:g}, Model Zoo's default (cstorch's {kind}; dls's own layout: 1e-08)")


def to_dict(cfg: TrainConfig) -> dict[str, Any]:
    """The config as plain data in dls's own layout, which :func:`parse_config` reads back to the same run."""
    out = {k: getattr(cfg, k).model_dump(mode="json", exclude_defaults=k != "runconfig") for k in SECTION_CLASSES}
    if cfg.eval_data is not None:
        out["eval_input"] = cfg.eval_data.model_dump(mode="json", exclude_defaults=True)
    out["model"] = {"name": cfg.model.name, **out["model"]}
    out["data"] = {"dataset": cfg.data.dataset, **out["data"]} if cfg.data.dataset else out["data"]  # first
    for body in (out["model"], out["data"], out.get("eval_input", {})):
        body.update(body.pop("params", {}))
    zoo = [*_ZOO_DEFAULTS, *[("optimizer", "eps")] * (cfg.optimizer.optimizer_type != "SGD")]
    for section, key in zoo if cfg.layout != "dls" else ():  # Model Zoo's defaults differ from dls's
        out[section].setdefault(key, getattr(getattr(cfg, section), key))
    return out
