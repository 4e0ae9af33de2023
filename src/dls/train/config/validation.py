"""Training configs: YAML in either Cerebras Model Zoo layout (or dls's own), read safely and mapped key by key onto
dls's sections, each key declared once below as a pydantic field (its type, bounds, default and help for ``dls
keys``). Numbers are strict (``true`` is not 1, ``"1024"`` is not 1024), finite and at most float32's max in size;
counts are integers (``100.0`` is not a count, as ``GradScaler`` and the FP8 recipes refuse it) with fixed upper
bounds; every error names the key as written. The loss-scaling keys are judged by
``ScalerSettings.cerebras``, so the config accepts exactly what ``GradScaler`` accepts."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import os
import re
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from dls.settings import TORCH_INIT_SCALE, ScalerSettings, SettingsError
from dls.train.errors import ConfigError
from dls.train.launch import free_memory

F32_MAX = 3.4028234663852886e38
INT64_MAX = 2**63 - 1
MAX_CONFIG_NODES = 100_000
MAX_CONFIG_BYTES = 1 << 20
ModelName = Literal["mlp", "transformer_lm", "fc_mnist", "gpt2", "gpt3", "llama"]
MODEL_NAMES, ZOO_MODELS = get_args(ModelName)[:2], get_args(ModelName)[2:]  # dls's built-in models; Model Zoo's
ZooProcessor = Literal["MNISTDataProcessor", "GptHDF5DataProcessor", "GptHDF5MapDataProcessor"]
ZOO_PROCESSORS: tuple[str, ...] = get_args(ZooProcessor)
MODEL_DATASETS = {"mlp": "teacher_regression", "transformer_lm": "char_corpus"}
# Model Zoo's --load_checkpoint_states values, plus "rng" (the random-number generators, needed for bit-identity).
CHECKPOINT_STATES = ("model", "optimizer", "dataloader", "grad_scaler", "lr_scheduler", "global_step", "rng")
# Keys that matter only on Cerebras hardware (or to Model Zoo's launcher): accepted, listed once as ignored.
CEREBRAS_ONLY = {
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
# Names from other frameworks, pointed at the one key that does the same thing here.
_HINTS = {
    "growth_interval": "steps_per_increase", "loss_scale_window": "steps_per_increase",
    "init_scale": "initial_loss_scale", "loss_scale": "loss_scaling_factor", "lr": "learning_rate",
    "clip_grad_norm": "max_gradient_norm", "gradient_clipping": "max_gradient_norm", "type": "optimizer_type",
    "dtype": "fp16_type", "amp": "mixed_precision",
}  # fmt: skip


def did_you_mean(word: Any, allowed: Any) -> str:
    names = [str(a) for a in allowed]
    same = [a for a in names if a.lower() == str(word).lower()]
    close = same or difflib.get_close_matches(str(word), names, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _unknown(path: str, key: Any, allowed: Sequence[str]) -> str:
    hint = f" (did you mean {_HINTS[key]!r}?)" if key in _HINTS else did_you_mean(key, allowed)
    return f"unknown key {path}.{key}{hint}; allowed keys: {', '.join(allowed)}"


# ---------------------------------------------------------------------- the sections' keys
def Bounds(ge: int = 0, le: int = INT64_MAX) -> Any:
    """An integer key's bounds (strict: ``true`` and ``"1"`` are not integers)."""
    return Field(strict=True, ge=ge, le=le)


def Finite(ge: float | None = None, le: float | None = None, gt: float | None = None, lt: float | None = None) -> Any:
    """A number key's bounds: finite, and at most float32's max in size unless a tighter bound is given."""
    ge = -F32_MAX if ge is None and gt is None else ge
    le = F32_MAX if le is None and lt is None else le
    return Field(strict=True, allow_inf_nan=False, ge=ge, le=le, gt=gt, lt=lt)


_CANONICAL = {n.lower(): n for n in ("SGD", "Adam", "AdamW", "Constant", "Linear", "CosineDecay")}


def parse_checkpoint_states(value: str | Sequence[str]) -> tuple[str, ...]:
    """``"model,optimizer"`` or a list → validated tuple of state names (``"all"`` → every state)."""
    items = [s.strip() for s in value.split(",")] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not items or not all(isinstance(s, str) and s for s in items):
        raise ValueError(f"expected a comma-separated list of {', '.join(CHECKPOINT_STATES)} (or 'all'); got {value!r}")
    if list(items) == ["all"]:
        return CHECKPOINT_STATES
    if bad := [s for s in items if s not in CHECKPOINT_STATES]:
        bad_ones = ", ".join(map(repr, bad)) + did_you_mean(bad[0], CHECKPOINT_STATES)
        raise ValueError(f"unknown checkpoint state(s) {bad_ones}; allowed: {', '.join(CHECKPOINT_STATES)}")
    return tuple(dict.fromkeys(items))


LISTED = BeforeValidator(lambda v: tuple(v) if isinstance(v, list) else v)  # a YAML list as a tuple
SCHEDULE = BeforeValidator(lambda v: (v,) if isinstance(v, dict) else tuple(v) if isinstance(v, list) else v)
CASELESS = BeforeValidator(lambda v: _CANONICAL.get(v.lower(), v) if isinstance(v, str) else v)  # Model Zoo: adamw
Unit = Annotated[float, Finite(ge=0, lt=1)]
NonNegative = Annotated[float, Finite(ge=0)]
Steps = Annotated[int, Bounds(1)]
Seed = Annotated[int, Bounds(0, 2**32 - 1)]  # NumPy's seeds are 32-bit
Size = Annotated[int, Bounds(1, 1 << 20)]
Length = Annotated[int, Bounds(1, 1 << 22)]
Layers = Annotated[int, Bounds(1, 4096)]


def help_(default: Any, text: str, only: str = "") -> Any:
    """A key's default and help (``dls keys``); ``only``: the variants of its section it applies to (:data:`ONLY`)."""
    return Field(default, description=text, json_schema_extra={"only": only} if only else None)


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class ModelConfig(Section):
    """``model:``. A Model Zoo model (``fc_mnist``, ``gpt2``, ``gpt3``, ``llama``) takes its keys in ``params``,
    judged by ``dls.train.modelzoo``."""

    name: ModelName = help_("mlp", "mlp | transformer_lm (built in), or Model Zoo's fc_mnist | gpt2 | gpt3 | llama")
    loss_weight: Annotated[float, Finite(gt=0)] = help_(1.0, "multiplies the training loss (logged unweighted)")
    hidden_size: Size = help_(128, "width of the hidden layers / the model dimension")
    depth: Layers = help_(3, "number of hidden layers", "mlp")
    activation_fn: Literal["tanh", "relu", "gelu"] = help_("tanh", "activation of the hidden layers", "mlp")
    dropout: Unit = help_(0.0, "dropout probability after each activation", "mlp")
    num_hidden_layers: Layers = help_(2, "number of transformer blocks", "transformer_lm")
    num_heads: Layers = help_(4, "attention heads (must divide hidden_size)", "transformer_lm")
    filter_size: Length = help_(256, "width of each block's feed-forward layer", "transformer_lm")
    dropout_rate: Unit = help_(0.0, "dropout probability", "transformer_lm")
    max_position_embeddings: Length = help_(256, "longest sequence the model accepts", "transformer_lm")
    params: dict[str, Any] = help_({}, "a Model Zoo model's own keys, as written in model:")


class DataConfig(Section):
    """``train_input:`` / ``eval_input:`` (dls's own configs: ``data:``). A Model Zoo ``data_processor`` takes its
    keys in ``params``, judged by ``dls.train.modelzoo``."""

    dataset: Literal["teacher_regression", "char_corpus"] | None = help_(
        None, "generated teacher_regression, or the character corpus shipped with dls (default: the model's)"
    )
    data_processor: ZooProcessor | None = help_(None, "a Model Zoo reader: " + " | ".join(ZOO_PROCESSORS))
    batch_size: Annotated[int, Bounds(1, 1 << 24)] = help_(64, "samples (sequences) per step and rank")
    shuffle: bool = help_(True, "reshuffle the samples every epoch")
    shuffle_seed: Seed | None = help_(None, "seed of the sample order (null: the seed)")
    drop_last_batch: bool = help_(True, "drop an incomplete last batch (dls's built-in data sets always do)")
    num_samples: Annotated[int, Bounds(1, 1 << 40)] = help_(
        4096, "samples in the generated data set", "teacher_regression"
    )
    input_dim: Size = help_(32, "features per sample", "teacher_regression")
    output_dim: Size = help_(64, "regression targets per sample", "teacher_regression")
    noise_std: NonNegative = help_(0.0, "standard deviation of noise added to the targets", "teacher_regression")
    dataset_seed: Seed = help_(1234, "seed that generates the data set (the teacher)", "teacher_regression")
    max_sequence_length: Length = help_(64, "characters per training sequence", "char_corpus")
    params: dict[str, Any] = help_({}, "a Model Zoo data processor's own keys, as written")

    @property
    def loader_params(self) -> dict[str, Any]:
        """The section as ``dls.train.modelzoo``'s readers take it: ``params`` and the keys dls keeps apart."""
        kept = {k: getattr(self, k) for k in ("batch_size", "shuffle", "shuffle_seed")}
        if "drop_last_batch" in self.model_fields_set:  # else the reader's drop_last, or its default, decides
            kept["drop_last_batch"] = self.drop_last_batch
        return {**self.params, **kept}


class PrecisionConfig(Section):
    """``precision:``. The run computes in ``fp16_type`` with ``mixed_precision``, else in float32."""

    fp16_type: Literal["float16", "bfloat16", "cbfloat16", "float32"] = help_("float16", "half format")
    mixed_precision: bool = help_(False, "compute in fp16_type (false: everything in float32)")
    emulate: bool = help_(False, "round with dls.emulate instead of torch.autocast (cbfloat16 always emulates)")
    half_params: bool = help_(False, "parameters in fp16_type, stepped through float32 master weights")
    master_weights: bool = help_(True, "with half_params: step float32 masters (false: the half parameters)")
    fp8: dict[str, Any] | None = help_(None, "FP8 Linear layers: {recipe: current|delayed|mxfp8|static, <fields>}")
    keep_in_float32: Annotated[tuple[str, ...], LISTED] = help_((), "names of modules that compute in float32")
    fallback: bool | None = help_(
        None, "keep the module where a forward overflow starts in float32 (null: on for float16 and cbfloat16)"
    )
    log_underflow: bool = help_(False, "also log the fraction of gradients that underflow (slower)")

    @property
    def fallback_on(self) -> bool:
        return self.compute_dtype in ("float16", "cbfloat16") if self.fallback is None else self.fallback

    @property
    def compute_dtype(self) -> str:
        return self.fp16_type if self.mixed_precision else "float32"

    @property
    def emulated(self) -> bool:
        """Whether the run rounds through ``dls.emulate`` (always for cbfloat16) instead of ``torch.autocast``."""
        return self.compute_dtype == "cbfloat16" or (self.emulate and self.compute_dtype != "float32")

    @property
    def param_dtype(self) -> str:
        return self.fp16_type if self.half_params and self.fp16_type in ("float16", "bfloat16") else "float32"


class SchedulePiece(Section):
    scheduler: Annotated[Literal["Constant", "Linear", "CosineDecay"], CASELESS]
    learning_rate: NonNegative | None = None
    initial_learning_rate: NonNegative | None = None
    end_learning_rate: NonNegative | None = None
    total_iters: Steps | None = None

    @model_validator(mode="after")
    def _required(self) -> SchedulePiece:
        need = ["learning_rate"] if self.scheduler == "Constant" else ["initial_learning_rate", "end_learning_rate"]
        missing = [k for k in need + ["total_iters"] * (self.scheduler != "Constant") if getattr(self, k) is None]
        if missing:
            raise ValueError(f"{missing[0]} is required for {self.scheduler}")
        return self


class OptimizerConfig(Section):
    """``optimizer:``: the optimizer, its learning rate and the loss-scaling keys (null: the scaler's default)."""

    optimizer_type: Annotated[Literal["SGD", "Adam", "AdamW"], CASELESS] = help_("Adam", "the torch optimizer")
    learning_rate: NonNegative | Annotated[tuple[SchedulePiece, ...], SCHEDULE] = help_(
        1e-3, "a number, or a schedule: [{scheduler: Linear|CosineDecay|Constant, ...}, ...] (on applied steps)"
    )
    momentum: Unit = help_(0.0, "SGD momentum", "SGD")
    weight_decay: NonNegative = help_(0.0, "weight decay")
    betas: Annotated[tuple[Unit, Unit], LISTED] = help_((0.9, 0.999), "Adam/AdamW betas", "Adam AdamW")
    eps: Annotated[float, Finite(gt=0)] = help_(
        1e-8, "Adam/AdamW epsilon (Model Zoo's layouts: 1e-6, cstorch's)", "Adam AdamW"
    )
    correct_bias: bool = help_(
        True, "AdamW's bias correction, as cstorch's (Model Zoo's layouts); Adam always corrects", "Adam AdamW"
    )
    adjust_learning_rate: dict[str, Annotated[float, Finite(gt=0)]] = help_(
        {}, "Model Zoo's learning-rate factors of parameter groups (muP): {group: factor}"
    )
    loss_scaling_factor: Any = help_(None, "'dynamic', a static scale, or null: dynamic for float16/cbfloat16")
    initial_loss_scale: Any = help_(None, "first dynamic scale (null: the max)")
    steps_per_increase: Any = help_(None, "the scale grows on the next clean step after this many")
    min_loss_scale: Any = help_(None, "floor of the dynamic scale")
    max_loss_scale: Any = help_(None, "ceiling of the dynamic scale")
    overflow_tolerance: Any = help_(None, "fraction of overflowing steps tolerated before backing off")
    growth_factor: Any = help_(None, "multiplies the scale when it grows")
    backoff_factor: Any = help_(None, "multiplies the scale on overflow")
    hysteresis: Any = help_(None, "overflows per back-off (DeepSpeed/Megatron)")
    consecutive_hysteresis: Any = help_(None, "hysteresis counts consecutive overflows only")
    max_gradient_norm: Any = help_(None, "clip the global gradient L2 norm")
    max_gradient_value: Annotated[float, Finite(gt=0)] | None = help_(None, "clip each gradient to [-value, value]")
    force_loss_scaling: bool = help_(
        False, "bfloat16 in Model Zoo's layouts: scale the loss as loss_scaling_factor says (Model Zoo does not)"
    )
    log_summaries: bool = help_(False, "also log the parameter norm and per-layer gradient norms (Model Zoo's)")
    log_loss_scale: bool | None = help_(
        None, "log the loss scale (null: yes; Model Zoo's layouts: with log_summaries (legacy), when dynamic (current))"
    )


class RunConfig(Section):
    """``runconfig:`` (the current layout's ``loop``, ``checkpoint``, ``logging``, ``model_dir``, ``seed``)."""

    max_steps: Steps = help_(100, "train until this global step (num_epochs instead, when this is not given)")
    num_steps: Steps | None = help_(None, "train this many steps in this run (then stop)")
    num_epochs: Size | None = help_(None, "train this many epochs (when max_steps is not given)")
    steps_per_epoch: Steps | None = help_(None, "steps per epoch (default: the training data's batches)")
    grad_accum_steps: Annotated[int, Bounds(1, 65536)] = help_(1, "micro-batches per optimizer step")
    eval_frequency: Steps | Annotated[float, Finite(gt=0, le=1)] | None = help_(
        None, "evaluate every N steps (an integer) or every fraction of the run (a float in (0, 1])"
    )
    eval_steps: Steps | None = help_(None, "batches per evaluation (null: the whole eval data)")
    checkpoint_steps: Annotated[int, Bounds(0)] = help_(0, "checkpoint every N steps (0: only at the end)")
    save_initial_checkpoint: bool = help_(False, "also checkpoint step 0")
    keep_checkpoint_max: Size = help_(5, "keep only the last N checkpoints")
    log_steps: Steps = help_(10, "write metrics every N steps (skipped steps are always written)")
    model_dir: Annotated[str, Field(min_length=1)] = help_("model_dir", "directory for checkpoints and metrics")
    seed: Seed = help_(0, "seed of initialisation, data order and dropout")
    device: Literal["auto", "cpu", "cuda"] = help_("cpu", "'cpu', 'cuda', or 'auto' (cuda when available)")
    backend: Literal["CSX", "CPU", "GPU"] | None = help_(
        None, "Model Zoo's backend_type: whose loss-scaling rule the run follows (null and CSX: cstorch.amp's)"
    )
    # More threads than any machine has cores only oversubscribes them.
    num_threads: Annotated[int, Bounds(1, 1024)] | None = help_(
        None,
        "torch CPU threads for the run, restored after (null: leave torch's setting). Tiny models on busy cores "
        "train fastest with 1: a tiny MLP on 2 cores shared with other work ran 25-40x faster with 1 thread than 2",
    )
    tensorboard: bool = help_(False, "also write TensorBoard events into model_dir/tensorboard/")
    record_trace: bool | Literal["model"] = help_(
        True,
        "record the loss scaler's steps into model_dir/trace.jsonl for dls replay / dls tune (false: not); 'model': "
        "also every tensor flowing backward, which decides more steps and costs more (not under emulation or FP8)",
    )
    max_overflows_at_min_loss_scale: Annotated[int, Bounds(1, 1 << 31)] = help_(
        10, "stop after N overflows pinned at the floor"
    )
    load_checkpoint_states: Annotated[tuple[str, ...], BeforeValidator(parse_checkpoint_states)] | None = help_(
        None, "when starting from a checkpoint of another run: the states to load (default: all)"
    )
    checkpoint_path: Annotated[str, Field(min_length=1)] | None = help_(None, "a checkpoint to start from")
    autoload_last_checkpoint: bool = help_(False, "continue from model_dir's newest checkpoint (the same command)")
    disable_strict_checkpoint_loading: bool = help_(False, "load a model state with missing/extra entries")


class TrainConfig(BaseModel):
    """A validated config. ``eval_data``: the evaluation loader (``eval_input`` / ``val_dataloader``);
    ``notes``: what the run should say once at start (Model Zoo defaults taken, keys ignored on this hardware,
    keys without effect in the chosen mode); ``layout``: ``dls``, ``legacy`` or ``current``."""

    model_config = ConfigDict(frozen=True)
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    precision: PrecisionConfig = PrecisionConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    runconfig: RunConfig = RunConfig()
    eval_data: DataConfig | None = None
    notes: tuple[str, ...] = ()
    layout: str = "dls"
    sources: dict[str, str] = {}  # "section.key" -> the key as the file wrote it


# dls's sections: TrainConfig's fields that are one.
SECTION_CLASSES: dict[str, type[Section]] = {
    k: type(f.default) for k, f in TrainConfig.model_fields.items() if isinstance(f.default, Section)
}
# Keys that apply to one variant of their section only (the section's selector value: model.name, ...).
ONLY = {
    k: tuple(str(f.json_schema_extra["only"]).split())
    for c in SECTION_CLASSES.values()
    for k, f in c.model_fields.items()
    if isinstance(f.json_schema_extra, dict)
}
# The keys ScalerSettings judges (typed Any above) -> its argument.
_RENAMED = {"loss_scaling_factor": "loss_scale", "initial_loss_scale": "init_scale"}
SCALER_KEYS = {k: _RENAMED.get(k, k) for k, f in OptimizerConfig.model_fields.items() if f.annotation is Any}


# ---------------------------------------------------------------------- pydantic's errors, as the config wrote them
_SHAPES = {  # what a compound key allows, in words
    "learning_rate": "a number >= 0 or a schedule (a list of {scheduler: Linear|CosineDecay|Constant, ...})",
    "betas": "a list of two numbers in [0, 1), e.g. [0.9, 0.999]",
    "fp8": "null (no FP8) or a mapping {recipe: current | delayed | mxfp8 | static, <the recipe's fields>}",
}
_KINDS = {"boolean": "true or false", "string": "text", "object": "a mapping", "array": "a list of names"}


def _allowed(schema: dict[str, Any], big: bool) -> str:
    """A key's JSON schema in words (``an integer in [0, 4294967295] or null``); ``big``: name a bound of 2**63-1."""
    if "anyOf" in schema:
        return " or ".join(_allowed(s, big) for s in schema["anyOf"])
    if "enum" in schema or "const" in schema:
        return "one of " + ", ".join(map(repr, schema["enum"])) if "enum" in schema else str(schema["const"]).lower()
    kind = schema.get("type", "null")
    if kind not in ("integer", "number"):
        return "non-empty text" if schema.get("minLength") else _KINDS.get(kind, kind)
    text = "an integer" if kind == "integer" else "a number"
    lows = [(k, schema[k]) for k in ("minimum", "ge", "exclusiveMinimum") if schema.get(k, -F32_MAX) != -F32_MAX]
    highs = [(k, schema[k]) for k in ("maximum", "le", "exclusiveMaximum") if schema.get(k, F32_MAX) != F32_MAX]
    low_key, low = lows[0] if lows else ("", None)
    high_key, high = highs[0] if highs else ("", None)
    open_low, open_high = low_key.startswith("exclusive"), high_key.startswith("exclusive")
    if low is not None and high is not None and (big or high != INT64_MAX):
        return f"{text} in {'(' if open_low else '['}{low}, {high}{')' if open_high else ']'}"
    return f"{text} {'>' if open_low else '>='} {low}" if low is not None else text


def _problems(exc: ValidationError, section: str, r: _Reader) -> None:
    """One error per key of ``section`` pydantic refused: the key as written, what it allows and what it got."""
    cls, values = SECTION_CLASSES[section.removeprefix("eval_")], r.sections[section]
    errors: list[tuple[list[Any], Any]] = [
        ([p for p in e["loc"] if isinstance(p, int) or p.isidentifier()], e) for e in exc.errors()
    ]
    pieces = {loc[0] for loc, _ in errors if len(loc) > 1 and loc[0] == "learning_rate"}  # said in the pieces
    for loc, err in errors:
        inner = loc[0] in pieces
        if inner and len(loc) == 1:
            continue
        path = r.at(section, loc[0]) + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[1:] if inner)
        value, key, model = (err["input"], loc[2:3], SchedulePiece) if inner else (values[loc[0]], loc[:1], cls)
        if err["type"] == "extra_forbidden":
            r.errors.append(_unknown(path.rsplit(".", 1)[0], loc[-1], list(model.model_fields)))
        elif err["type"] == "missing" and inner:
            r.errors.append(f"{path} is required")
        elif err["type"] == "value_error":
            r.errors.append(f"{path}: {err['msg'].removeprefix('Value error, ')}")
        else:
            schema = model.model_json_schema()["properties"][key[0]] if key else {"type": "object"}
            big = isinstance(value, int) and not isinstance(value, bool) and value > INT64_MAX
            allowed = _SHAPES.get(str(loc[0])) if not inner else None
            allowed = allowed or _allowed(schema, big)
            if isinstance(value, (int, float)) and abs(value) > F32_MAX and "a number" in allowed:
                allowed += ", at most float32's max 3.4e38 in size"
            names = [n for s in [schema, *schema.get("anyOf", [])] for n in s.get("enum", [])]
            hint = did_you_mean(value, names) if isinstance(value, str) and names else ""
            r.errors.append(f"{path} must be {allowed}; got {value!r}{hint}")


# ---------------------------------------------------------------------- YAML
class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 floats (``1e-3`` is a number). A key given twice in one mapping: a section (a mapping
    value) is refused; any other value is taken from the last, as Model Zoo's loader (PyYAML's) does, and each such
    key is listed in ``repeated`` as ``(key, first line, last line)``."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.repeated: list[tuple[str, int, int]] = []

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        """Merged keys (``<<: [*a, *b]``) count once, the last value wins."""
        seen: dict[Any, tuple[int, yaml.Node]] = {}
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                line = key.start_mark.line + 1
                if key.value in seen:
                    first, before = seen[key.value]
                    if isinstance(value, yaml.MappingNode) or isinstance(before, yaml.MappingNode):
                        raise ConfigError([f"section {key.value!r} is given twice: lines {first} and {line}"])
                    self.repeated.append((key.value, first, line))
                seen[key.value] = (line, value)
        super().flatten_mapping(node)  # the merged keys first: without de-duplication they can multiply
        index = {
            (k.tag, k.value) if isinstance(k, yaml.ScalarNode) else id(k): i for i, (k, _) in enumerate(node.value)
        }
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


def _where(exc: yaml.YAMLError, text: str) -> str:
    """Where in ``text`` PyYAML failed, as ``line:column`` (1-based), and what it found there."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or getattr(exc, "context", None)
    if isinstance(exc, yaml.reader.ReaderError):  # a character YAML does not allow: a position in the text
        line = text.count("\n", 0, exc.position) + 1
        column = exc.position - (text.rfind("\n", 0, exc.position) + 1) + 1
        code = exc.character if isinstance(exc.character, int) else ord(exc.character)  # PyYAML gives its code
        return f"{line}:{column}: character U+{code:04X} ({chr(code)!r}) is not allowed in YAML"
    if mark is None or problem is None:
        return f"1:1: {str(exc).splitlines()[0]}"
    return f"{mark.line + 1}:{mark.column + 1}: {problem}"


def load_yaml(text: str, source: str = "<string>", notes: list[str] | None = None) -> Any:
    """Parse YAML text into plain data, aliases expanded into copies. Raises :class:`ConfigError`; a syntax error is
    one line, ``source:line:column: what``. A key repeated with a value that is not a section takes the last value,
    as Model Zoo's loader does: each is added to ``notes``."""
    loader = None
    try:
        loader = _Loader(text)  # its reader already refuses characters YAML does not allow (a NUL byte)
        data = _unshare(loader.get_single_data(), [MAX_CONFIG_NODES])
    except ConfigError as exc:
        raise ConfigError(exc.errors, source) from None
    except yaml.YAMLError as exc:
        raise ConfigError([f"{source}:{_where(exc, text)} (not valid YAML)"]) from None
    except RecursionError:
        raise ConfigError(["not a config: nested too deeply, or an alias contains itself"], source) from None
    except ValueError as exc:
        raise ConfigError([f"the config expands to {exc}"], source) from None
    finally:
        if loader is not None:
            loader.dispose()
    said = [f"{source}: {key!r} is given twice (lines {a} and {b}); the value of line {b} is used, as Model Zoo's "
            "YAML loader does" for key, a, b in loader.repeated]  # fmt: skip
    if notes is not None:
        notes.extend(said)
    return data


def read_config(path: str | Path, overrides: Sequence[str] = (), notes: list[str] | None = None) -> dict[str, Any]:
    """The YAML file ``path`` (a regular file of at most 1 MiB of UTF-8) as a dict, ``overrides`` applied; what the
    run should say about the file (a repeated key) is added to ``notes``."""
    if not str(path):
        raise ConfigError(["the config path is empty (''): give a YAML file, e.g. one `dls init` copies"])
    try:  # opened non-blocking: a FIFO without a writer must not block
        with open(path, "rb", opener=lambda name, flags: os.open(name, flags | os.O_NONBLOCK)) as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ConfigError(["not a regular file: a config is read from a plain file"], str(path))
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError([f"cannot read config file: {exc.strerror or exc}"], str(path)) from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(["larger than 1 MiB: not a YAML config (a checkpoint? see --resume)"], str(path))
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        why = f"not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); save the config as UTF-8"
        raise ConfigError([why], str(path)) from None
    raw = load_yaml(text, str(path), notes)
    return apply_overrides({} if raw is None else raw, overrides, source=str(path), notes=notes)


def _shown(text: str, most: int = 120) -> str:
    """``text`` quoted, cut to ``most`` characters (an override echoed back in an error)."""
    return repr(text) if len(text) <= most else f"{text[:most]!r}... ({len(text):,} characters)"


def apply_overrides(
    raw: Any, overrides: Sequence[str], source: str | None = None, notes: list[str] | None = None
) -> dict[str, Any]:
    """A copy of ``raw`` with each ``"a.b.c=value"`` set at the path as written (values are YAML, read as a file
    is: a key given twice in a value is added to ``notes``)."""
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
            errors.append(f"override {_shown(item)} must look like section.key=value, e.g. runconfig.max_steps=20")
            continue
        try:
            said: list[str] = []
            value = load_yaml(text, "value", said) if text.strip() else ""
        except ConfigError as exc:
            errors.append(f"override {_shown(item)}: {exc.errors[0]}")
            continue
        if notes is not None:
            notes.extend(f"override {_shown(item)}: {note.removeprefix('value: ')}" for note in said)
        node = result
        for i, k in enumerate(keys[:-1]):
            if node.get(k) is None:
                node[k] = {}
            node = node[k]
            if not isinstance(node, dict):
                errors.append(f"override {_shown(item)}: {'.'.join(keys[: i + 1])} is not a section/mapping")
                break
        else:
            node[keys[-1]] = value
    if errors:
        raise ConfigError(errors, source)
    return result


def default_model_dir(raw: Mapping[str, Any], directory: str) -> dict[str, Any]:
    """``raw`` with ``directory`` as its model_dir where its layout keeps it (``runconfig.model_dir``; the current
    layout's ``trainer.init.model_dir``) when it names none: ``--resume DIR`` continues in DIR unless the config (or
    an override) names another model_dir."""
    out = dict(raw)
    trainer = out.get("trainer")
    if isinstance(trainer, Mapping):  # the current layout
        init: Mapping[str, Any] = trainer["init"] if isinstance(trainer.get("init"), Mapping) else {}
        if "model_dir" not in init:
            out["trainer"] = {**trainer, "init": {**init, "model_dir": directory}}
        return out
    section = out.get("runconfig")
    if not (isinstance(section, Mapping) and "model_dir" in section):
        out["runconfig"] = {**(section if isinstance(section, Mapping) else {}), "model_dir": directory}
    return out


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> TrainConfig:
    """Read a YAML config file, apply overrides, validate. Raises :class:`ConfigError`."""
    notes: list[str] = []
    return parse_config(read_config(path, overrides, notes), source=str(path), notes=notes)


# ---------------------------------------------------------------------- layouts → sections
def _same(section: str, keys: str) -> dict[str, tuple[str, str]]:
    return {k: (section, k) for k in keys.split()}


_LEGACY = {"train_input": "data", "data": "data", "eval_input": "eval_data"}  # a legacy section -> dls's
_LEGACY.update({k: k for k in ("model", "optimizer", "runconfig", "precision")})
_MOVED: dict[str, dict[str, Any]] = {  # a legacy section's keys that are read into another section's key
    "model": _same("precision", "mixed_precision fp16_type"),
    "optimizer": {"weight_decay_rate": ("optimizer", "weight_decay"), **_same("runconfig", "grad_accum_steps")},
}
_DLS_FIELDS = ("name", "data_processor", "batch_size", "shuffle", "shuffle_seed", "drop_last_batch")
_OPTIMIZER_ARGS = _same("optimizer", "learning_rate momentum weight_decay betas eps correct_bias adjust_learning_rate")
_OPTIMIZER_ARGS["lr"] = ("optimizer", "learning_rate")  # torch's name
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


class _Reader:
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
            elif key in CEREBRAS_ONLY or ignore:
                self.ignored.append(where)
            elif params is not None and key not in _DLS_FIELDS:
                params[key] = value
            else:
                self.errors.append(_unknown(path, key, list(table)))

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
            section = _LEGACY.get(name)
            if name == "sparsity":
                self.sparsity(body, name)
            elif name == "csconfig":  # Release 1.x: the Cerebras system's settings
                self.walk(body, name, {"use_cbfloat16": _Reader.use_cbfloat16}, ignore=True)
            elif section is None:
                hint = did_you_mean(name, [*_LEGACY, "sparsity"])
                self.errors.append(f"unknown section {name}{hint}; allowed: {', '.join(_LEGACY)}")
            elif section in seen:
                self.errors.append(f"give section {section!r} once: both {seen[section]!r} and {name!r} are present")
            else:
                seen[section] = str(name)
                self.section(section, body, str(name), _MOVED.get(section, {}))

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
        self.walk(args, f"{path}.{name}", _OPTIMIZER_ARGS)

    def callbacks(self, value: Any, path: str) -> None:
        for i, item in enumerate(value if isinstance(value, list) else [value]):
            name = next(iter(item)) if isinstance(item, Mapping) and len(item) == 1 else None
            if name is None:
                self.errors.append(f"{path}[{i}] must be {{CallbackName: {{...}}}}; got {item!r}")
            elif name in CEREBRAS_ONLY or name in _CALLBACKS:
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
_MOVED["runconfig"] = {
    key: (
        _Reader.backend_type if to == "backend" else _listed_as(to) if to in (CEREBRAS, NOT_DONE) else ("runconfig", to)
    )
    for key, to in ZOO_RUNCONFIG.items()
}
_MOVED["optimizer"]["ws_summary"] = _listed_as(NOT_DONE)  # TensorFlow Model Zoo's summaries; no PyTorch code reads it
# Model Zoo's callbacks of the current layout that dls honours (Cerebras-only ones: CEREBRAS_ONLY).
_CALLBACKS: dict[str, Any] = {
    "LoadCheckpointStates": _same("runconfig", "load_checkpoint_states"),
    "KeepNCheckpoints": {"n": ("runconfig", "keep_checkpoint_max")},
    "ComputeNorm": lambda r, value, path: r.put("optimizer", "log_summaries", True, path),
    "CheckLoss": _listed_as(NOT_DONE),
    "LogInputSummaries": _listed_as(NOT_DONE),
}

# The current layout's trainer: each key -> (section, key), a table of its keys, or the reader of its value.
_TRAINER: dict[str, Any] = {
    "init": {
        **_same("runconfig", "model_dir seed device num_threads tensorboard max_overflows_at_min_loss_scale"),
        "model": lambda r, value, path: r.section("model", value, path),
        "backend": _Reader.backend,
        "optimizer": _Reader.optimizer,
        "schedulers": _Reader.schedulers,
        "callbacks": _Reader.callbacks,
        "sparsity": _Reader.sparsity,
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
_TRAINER["validate_all"] = _TRAINER["validate"]


# ---------------------------------------------------------------------- validation
def parse_config(raw: Mapping[str, Any], source: str | None = None, notes: Sequence[str] = ()) -> TrainConfig:
    """Validate a config dict (the parsed YAML, either layout) and build the :class:`TrainConfig`. Raises
    :class:`ConfigError` listing every problem, each naming its key as written. ``notes``: what the run should say
    first (from reading the file: :func:`read_config`)."""
    raw = apply_overrides(raw, (), source)  # a mapping, aliases expanded into copies
    layout = "current" if "trainer" in raw else "legacy"
    holder = raw if layout == "legacy" else (raw["trainer"] if isinstance(raw["trainer"], Mapping) else {}).get("init")
    model = holder.get("model") if isinstance(holder, Mapping) else None
    name = model.get("name") if isinstance(model, Mapping) else None
    if problem := _refused_whole(raw, layout, model):  # said first, alone: every other key would be misread
        raise ConfigError([problem], source)
    release_1: list[str] = []
    if layout == "legacy" and any(
        isinstance(raw.get(s), Mapping) and set(ks) & set(raw[s]) for s, ks in _RELEASE_1.items()
    ):
        raw, release_1, problems = _from_release_1(dict(raw))
        if problems:
            raise ConfigError(problems, source)
    r = _Reader(name in ZOO_MODELS)
    r.notes.extend([*notes, *release_1])
    if layout == "current":
        r.errors += [f"unknown section {n}: the current layout has trainer: alone" for n in raw if n != "trainer"]
        r.walk(raw.get("trainer"), "trainer", _TRAINER)
    else:
        r.legacy(raw)
    r.layout = _defaults(r, layout)
    built = _build(r)
    if built["optimizer"] is not None:
        _check_loss_scaling(built, r)
    if not r.errors:
        _check_combinations(built, r)
        _check_zoo(built, r)
    if not r.errors:
        _check_optimizer_step(built, r)
    if not r.errors and built["precision"].fp8 is not None:
        built["precision"] = built["precision"].model_copy(update={"fp8": _fp8(built["precision"].fp8, r)})
    if r.errors:
        raise ConfigError(list(dict.fromkeys(r.errors)), source)
    if r.ignored:
        r.notes.append(f"ignored on this hardware (Cerebras only): {', '.join(dict.fromkeys(r.ignored))}")
    if r.not_done:
        table = "docs/guides/trainer.md, Model Zoo's keys"
        r.notes.append(f"not done by dls (what each means: {table}): {', '.join(dict.fromkeys(r.not_done))}")
    return TrainConfig(**built, notes=tuple(r.notes), layout=r.layout, sources=r.written)


# Keys only Model Zoo's Release 1.x configs (1.8, 1.9) write: a legacy config holding one is read by
# _from_release_1, as those releases' PyTorch code read it.
_RELEASE_1 = {
    "optimizer": ("beta1", "beta2", "epsilon", "use_bias_correction", "disable_lr_steps_reset"),
    "model": ("use_rms_norm", "use_position_embedding"),
}


def _from_release_1(raw: dict[str, Any]) -> tuple[dict[str, Any], list[str], list[str]]:
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
    """Release 1.x's learning-rate pieces in Release 2's keys (see ``_from_release_1``)."""
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


def _refused_whole(raw: Mapping[str, Any], layout: str, model: Any) -> str | None:
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


def _defaults(r: _Reader, layout: str) -> str:
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
        value = _CANONICAL.get(value.lower(), value) if isinstance(value, str) else value
        for key in [k for k in s[section] if k in ONLY and value is not None and value not in ONLY[k]]:
            only = " or ".join(map(repr, ONLY[key]))
            r.errors.append(f"{r.at(section, key)} applies only when {section}.{selector} is {only}; it is {value!r}")
            del s[section][key]
    return layout


def _zoo_defaults(r: _Reader, layout: str) -> None:
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
    if isinstance(kind, str) and _CANONICAL.get(kind.lower()) in ("Adam", "AdamW") and "optimizer.eps" not in r.written:
        s["optimizer"]["eps"] = ZOO_ADAM_EPS
        path = f"{r.at('optimizer', 'optimizer_type')}.{kind}.eps" if layout == "current" else "optimizer.eps"
        r.notes.append(f"{path}: {ZOO_ADAM_EPS:g}, Model Zoo's default (cstorch's {kind}; dls's own layout: 1e-08)")


def _build(r: _Reader) -> dict[str, Any]:
    """Each section built from what was read (``None``: refused, its problems said; ``eval_data``: also when not
    given)."""
    s = r.sections
    built: dict[str, Any] = {"eval_data": None}
    classes: dict[str, type[Section]] = {**SECTION_CLASSES, **({"eval_data": DataConfig} if s["eval_data"] else {})}
    for section, cls in classes.items():
        try:
            built[section] = cls(**s[section])
        except ValidationError as exc:
            built[section] = None
            _problems(exc, section, r)
    return built


def _fp8(recipe: Mapping[str, Any], r: _Reader) -> Any:
    """``{recipe: current|delayed|mxfp8|static, <fields>}`` judged field by field by ``dls.fp8``'s recipe classes."""
    from dls.fp8 import RECIPE_NAMES, recipe_from_dict

    path = r.at("precision", "fp8")
    cls = RECIPE_NAMES.get(recipe["recipe"]) if isinstance(recipe.get("recipe"), str) else None
    if cls is None:
        got = repr(recipe["recipe"]) if "recipe" in recipe else "nothing"
        r.errors.append(f"{path}.recipe must be one of {', '.join(map(repr, RECIPE_NAMES))}; got {got}")
        return None
    types = {f.name: f.type for f in dataclasses.fields(cls)}
    fields = {f: v for f, v in recipe.items() if f != "recipe"}
    for key, value in fields.items():
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if key not in types:
            r.errors.append(_unknown(path, key, ["recipe", *types]))
        elif key == "amax_history_len" and not (number and isinstance(value, int) and 1 <= value <= 65536):
            r.errors.append(f"{path}.amax_history_len must be an integer in [1, 65536]; got {value!r}")
        else:
            try:
                cls(**{key: value})
            except (ValueError, TypeError) as exc:
                message = str(exc)
                r.errors.append(f"{path}.{message}" if message.startswith(f"{key} ") else f"{path}.{key}: {message}")
            else:
                if number and abs(value) > F32_MAX:  # the recipe takes any finite float; the config, float32's
                    r.errors.append(f"{path}.{key} must be at most float32's max 3.4e38 in size; got {value!r}")
    return None if r.errors else recipe_from_dict({"recipe": recipe["recipe"], **fields}).to_dict()


def _check_combinations(b: dict[str, Any], r: _Reader) -> None:
    model, data, prec, opt, run = b["model"], b["data"], b["precision"], b["optimizer"], b["runconfig"]
    at, refuse, note = r.at, r.errors.append, r.notes.append
    builtin = MODEL_DATASETS.get(model.name)
    if builtin and data.data_processor is not None:
        refuse(f"{at('data', 'data_processor')}: model.name {model.name!r} trains on dls's built-in data ({builtin})")
    elif builtin and data.dataset != builtin:
        refuse(f"{at('data', 'dataset')} {data.dataset!r} does not fit model.name {model.name!r}; allowed: {builtin}")
    if data.dataset is not None and not data.drop_last_batch:
        refuse(f"{at('data', 'drop_last_batch')}: false is not supported for built-in data sets (they drop it)")
    if model.name == "transformer_lm" and model.hidden_size % model.num_heads:
        refuse(f"{at('model', 'num_heads')} ({model.num_heads}) must divide model.hidden_size ({model.hidden_size})")
    if model.name == "transformer_lm" and data.max_sequence_length > model.max_position_embeddings:
        length, most = data.max_sequence_length, model.max_position_embeddings
        refuse(f"{at('data', 'max_sequence_length')} ({length}) exceeds model.max_position_embeddings ({most})")
    if not prec.mixed_precision and "precision.fp16_type" in r.written and prec.fp16_type != "float32":
        note(f"{at('precision', 'fp16_type')} ({prec.fp16_type!r}) has no effect: mixed_precision is off")
    if prec.half_params and prec.compute_dtype == "float32":
        why = "(precision.mixed_precision: true and a half fp16_type): without it the parameters are float32"
        refuse(f"{at('precision', 'half_params')} needs a half-precision run {why}")
    if prec.half_params and prec.fp16_type == "cbfloat16" and not prec.master_weights:
        refuse(f"{at('precision', 'master_weights')}: false does not work with cbfloat16 half_params")
    if prec.fp8 is not None and prec.emulated:
        refuse(f"{at('precision', 'fp8')} cannot be combined with dls.emulate (cbfloat16 or precision.emulate)")
    if opt.max_gradient_norm is not None and opt.max_gradient_value is not None:
        refuse(f"give {at('optimizer', 'max_gradient_norm')} or {at('optimizer', 'max_gradient_value')}, not both")
    if "master_weights" in prec.model_fields_set and not prec.half_params:
        note(f"{at('precision', 'master_weights')} has no effect without precision.half_params: true")
    if prec.half_params and prec.emulate and prec.fp16_type != "cbfloat16":
        note(f"{at('precision', 'emulate')} has no effect: with half_params the model computes natively")
        b["precision"] = prec = prec.model_copy(update={"emulate": False})
    if prec.fallback and prec.compute_dtype not in ("float16", "cbfloat16"):
        note(f"{at('precision', 'fallback')} has no effect: the run computes in {prec.compute_dtype}")
    if run.eval_steps is not None and b["eval_data"] is None:
        note(f"{at('runconfig', 'eval_steps')}: no eval_input / val_dataloader: evaluation reads the training data")


def _check_zoo(b: dict[str, Any], r: _Reader) -> None:
    """A Model Zoo model's and readers' own keys, judged by ``dls.train.modelzoo``'s parsers (no torch, no files), and
    the optimizer keys of Model Zoo's optimizers."""
    from dls.train.modelzoo import LR_GROUPS, parse_loader, parse_model

    for section, default in (("model", "model"), ("data", "train_input"), ("eval_data", "eval_input")):
        part, where = b[section], r.written.get(f"{section}.params", default)
        try:
            if section == "model" and part.name in ZOO_MODELS:
                r.ignored.extend(parse_model(part.name, dict(part.params), where)[1])
            elif section != "model" and part is not None and part.data_processor is not None:
                r.ignored.extend(parse_loader(part.data_processor, part.loader_params, where)[1])
        except ConfigError as exc:
            r.errors.extend(exc.errors)
    opt, name = b["optimizer"], b["model"].name
    if opt.adjust_learning_rate and name not in ("gpt2", "gpt3", "llama"):
        r.errors.append(f"{r.at('optimizer', 'adjust_learning_rate')} applies to gpt2, gpt3 and llama; this is {name}")
    elif bad := [k for k in opt.adjust_learning_rate if k not in LR_GROUPS]:
        key = f"{r.at('optimizer', 'adjust_learning_rate')}.{bad[0]}"
        r.errors.append(f"{key}: not a group of Model Zoo's {name}{did_you_mean(bad[0], LR_GROUPS)}; its groups: "
                        f"{', '.join(LR_GROUPS)}")  # fmt: skip
    if opt.optimizer_type == "Adam" and "optimizer.correct_bias" in r.written:
        how = "cstorch's Adam always corrects the bias (Model Zoo warns that the key is unused)"
        r.notes.append(f"{r.at('optimizer', 'correct_bias')} is not used: {how}")
    if not opt.correct_bias and opt.optimizer_type == "AdamW" and r.layout == "dls":
        torch_s = "dls's own layout trains with torch's AdamW, which always corrects the bias"
        r.errors.append(
            f"{r.at('optimizer', 'correct_bias')}: false is cstorch's AdamW, Model Zoo's layouts'; {torch_s}"
        )
    if opt.force_loss_scaling and r.layout == "dls":
        r.notes.append(f"{r.at('optimizer', 'force_loss_scaling')} has no effect: dls's own layout scales bfloat16 as "
                       "loss_scaling_factor says")  # fmt: skip


def step_once(cls: type, hyper: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """One step of the optimizer ``cls`` with the hyperparameters ``hyper`` on a throwaway one-element parameter (1,
    gradient 1): its group as it then is, and whether the parameter stayed finite. What the optimizer refuses (a
    ``ValueError``, or torch's ``RuntimeError`` for a step size beyond float32) is raised."""
    import inspect

    import torch

    param = torch.ones(1, requires_grad=True)
    param.grad = torch.ones(1)
    accepted = inspect.signature(cls).parameters
    optimizer = cls([param], **{k: v for k, v in hyper.items() if k in accepted})
    optimizer.param_groups[0].update(hyper)  # also what the constructor does not take (initial_lr, kept state)
    optimizer.step()
    group = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    return group, bool(torch.isfinite(param).all())


def optimizer_class(opt: OptimizerConfig, model: str) -> tuple[type, dict[str, Any]]:
    """The optimizer class that ``optimizer:`` (``opt``) builds for the model ``model`` and its hyperparameters but
    the learning rate: Model Zoo's models take cstorch's Adam and AdamW (``dls.train.modelzoo.CerebrasAdam``, which
    honours ``correct_bias``), dls's own models torch's; SGD is torch's for both (as cstorch's)."""
    import torch

    if opt.optimizer_type == "SGD":
        return torch.optim.SGD, {"momentum": opt.momentum, "weight_decay": opt.weight_decay}
    hyper = {"betas": opt.betas, "eps": opt.eps, "weight_decay": opt.weight_decay}
    if model in ZOO_MODELS:
        from dls.train.modelzoo import CerebrasAdam

        decoupled = opt.optimizer_type == "AdamW"
        return CerebrasAdam, {**hyper, "correct_bias": opt.correct_bias, "decoupled_weight_decay": decoupled}
    return torch.optim.Adam if opt.optimizer_type == "Adam" else torch.optim.AdamW, hyper


def _check_optimizer_step(b: dict[str, Any], r: _Reader) -> None:
    """One step of the run's optimizer at the schedule's largest learning rate (times the largest
    ``adjust_learning_rate`` factor), on a weight of 1 with a gradient of 1, is taken and finite: else the learning
    rate (and the weight decay, when it takes part) is refused, before anything is built. A learning rate of 1e38
    passes the bound of every float key, but Adam's first step size (``lr / (1 - beta1)``) is beyond float32."""
    opt, lr = b["optimizer"], b["optimizer"].learning_rate
    rates = [lr] if isinstance(lr, (int, float)) else [
        v for piece in lr for v in (piece.learning_rate, piece.initial_learning_rate, piece.end_learning_rate)
        if v is not None
    ]  # fmt: skip
    largest = max(rates) * max([1.0, *opt.adjust_learning_rate.values()])
    cls, hyper = optimizer_class(opt, b["model"].name)
    try:
        if step_once(cls, {**hyper, "lr": largest})[1]:
            return
        why = "gives inf/NaN"
    except (ValueError, RuntimeError) as exc:
        why = f"fails ({' '.join(str(exc).split())})"
    keys = r.at("optimizer", "learning_rate")
    with contextlib.suppress(ValueError, RuntimeError):
        if hyper.get("weight_decay") and step_once(cls, {**hyper, "weight_decay": 0.0, "lr": largest})[1]:
            keys += f" with {r.at('optimizer', 'weight_decay')} {opt.weight_decay:g}"
    r.errors.append(
        f"{keys}: one step of {cls.__name__} at the learning rate {largest:g} on a weight of 1 with a gradient of 1 "
        f"{why}; give a smaller learning rate"
    )


# ---------------------------------------------------------------------- loss scaling
def _check_loss_scaling(b: dict[str, Any], r: _Reader) -> None:
    """``ScalerSettings`` judges every loss-scaling key given, each problem under its key as written; the keys
    without effect in the run's mode are noted and dropped."""
    opt, prec, factor = b["optimizer"], b["precision"], b["optimizer"].loss_scaling_factor
    names = {arg: r.at("optimizer", key) for key, arg in SCALER_KEYS.items()}
    if isinstance(factor, str) and factor != "dynamic":
        hint = did_you_mean(factor, ["dynamic"])
        r.errors.append(f"{names['loss_scale']} must be 'dynamic' (lower case), a number or null; got {factor!r}{hint}")
        return
    if prec is None:  # the precision section's own errors are said
        return
    half = "float16" if prec.fp16_type == "float32" else prec.fp16_type
    given = {arg: getattr(opt, key) for key, arg in SCALER_KEYS.items() if getattr(opt, key) is not None}
    try:
        mode = ScalerSettings.cerebras(factor, half_dtype=half).mode  # the scaler's own rule for the mode
        ScalerSettings.cerebras(**{**given, "loss_scale": "dynamic"}, half_dtype=half)  # the others, as dynamic
    except SettingsError as exc:
        pattern = re.compile(r"\b(" + "|".join(sorted(names, key=len, reverse=True)) + r")\b")
        kept = [m for arg, m in exc.problems if arg in given] or [m for _, m in exc.problems]  # the keys written
        r.errors.extend(pattern.sub(lambda m: names[m.group(1)], m) for m in kept)
        return
    if (norm := opt.max_gradient_norm) is not None and norm > F32_MAX:  # the scaler takes any finite norm
        r.errors.append(f"{names['max_gradient_norm']} must be at most float32's max 3.4e38; got {norm!r}")
    if r.layout != "dls" and prec.compute_dtype == "bfloat16" and not opt.force_loss_scaling:
        _bfloat16_as_model_zoo(b, r, names)
        return
    if prec.compute_dtype == "float32":
        mode, why = "off", "the run computes in float32, without loss scaling"
    elif prec.fp16_type == "cbfloat16" and mode != "dynamic":
        r.errors.append(f"{names['loss_scale']} must be 'dynamic' for cbfloat16 (as on Cerebras); got {factor!r}")
        return
    else:
        why = f"loss_scaling_factor is a static {factor:g}" if mode == "static" else f"loss scaling is off for {half}"
    update: dict[str, Any] = {"loss_scaling_factor": float(factor)} if isinstance(factor, (int, float)) else {}
    dynamic_only = [k for k, arg in SCALER_KEYS.items() if arg not in ("loss_scale", "max_gradient_norm")]
    ignored = [k for k in ["loss_scaling_factor"] * (mode == "off") + dynamic_only if getattr(opt, k) is not None]
    if mode != "dynamic":
        r.notes.extend(f"{names[SCALER_KEYS[k]]} is ignored: {why}" for k in ignored)
        update.update(dict.fromkeys(ignored))
    b["optimizer"] = opt.model_copy(update=update)
    if mode != "off":
        _backend_notes(b, r, names)


def _bfloat16_as_model_zoo(b: dict[str, Any], r: _Reader, names: dict[str, str]) -> None:
    """Model Zoo's layouts in bfloat16: no loss scaling, as Model Zoo's trainer (its precision callback drops the
    grad scaler for bfloat16); one note when a loss-scaling key written is not used."""
    opt = b["optimizer"]
    unused = [k for k, arg in SCALER_KEYS.items() if arg != "max_gradient_norm" and getattr(opt, k) is not None]
    b["optimizer"] = opt.model_copy(update=dict.fromkeys(unused))
    if [k for k in unused if k != "loss_scaling_factor" or opt.loss_scaling_factor != 1.0]:
        current = r.layout == "current"
        force = r.written.get("optimizer.force_loss_scaling", f"{'trainer.init.precision' if current else 'optimizer'}"
                              ".force_loss_scaling")  # fmt: skip
        half = r.written.get("precision.fp16_type", f"{'trainer.init.precision' if current else 'model'}.fp16_type")
        listed = ", ".join(names[SCALER_KEYS[k]] for k in unused)
        r.notes.append(
            f"{half} bfloat16: no loss scaling, as Model Zoo trains bfloat16 ({listed} not "
            f"used; {force}: true scales the loss)"
        )


def _backend_notes(b: dict[str, Any], r: _Reader, names: dict[str, str]) -> None:
    """What a Model Zoo backend_type means for a run with loss scaling: GPU, Model Zoo's torch.amp rule (the bounds
    unused); CPU, CSX's numerics here, unlike Model Zoo's own CPU path."""
    opt, where = b["optimizer"], r.at("runconfig", "backend")
    backend = b["runconfig"].backend if b["runconfig"] is not None else None
    if backend == "GPU":
        bounds = [k for k in ("min_loss_scale", "max_loss_scale") if getattr(opt, k) is not None]
        if bounds:
            b["optimizer"] = opt.model_copy(update=dict.fromkeys(bounds))
            listed = " and ".join(names[SCALER_KEYS[k]] for k in bounds)
            r.notes.append(f"{listed} not used: {where} GPU scales as Model Zoo's GPU path, torch.amp.GradScaler")
        if b["precision"].compute_dtype == "cbfloat16":
            r.notes.append(
                f"{where} GPU: the run computes cbfloat16 (dls.emulate); Model Zoo's GPU path computes bfloat16"
            )
        if isinstance(opt.loss_scaling_factor, float):
            r.notes.append(
                f"{where} GPU: the static {names['loss_scale']} {opt.loss_scaling_factor:g} is torch.amp.GradScaler's "
                "starting scale, as in Model Zoo's GPU path: it backs off on overflow and never grows (dls: growth "
                f"every {GPU_NEVER:,} clean steps, which a run of at most {GPU_NEVER - 1:,} steps never reaches)"
            )
    elif backend == "CPU":
        half = b["precision"].compute_dtype
        r.notes.append(
            f"{where} CPU: the run computes {half} with cstorch.amp's loss scaling, as on CSX; Model Zoo's own CPU "
            "path would compute in bfloat16 without loss scaling"
        )


# Model Zoo's GPU path never grows a static scale (torch.amp's growth_interval 2**63 - 1); dls's count of clean steps
# is int32, as torch's: its largest growth interval, which a run of fewer steps (the trainer's limit) never reaches.
GPU_NEVER = 2**31 - 1


def scaler_settings(cfg: TrainConfig) -> ScalerSettings:
    """The loss scaler's settings of ``cfg``: cstorch.amp's (Cerebras' dialect, ``precision.fp16_type`` as the half
    dtype); with ``backend_type: GPU``, what Model Zoo's GPU path builds, ``torch.amp.GradScaler``: dynamic from
    ``initial_loss_scale`` (else 2**16) growing every ``steps_per_increase`` clean steps, or a static factor as a
    starting scale that backs off and never grows (:data:`GPU_NEVER`), without bounds."""
    opt, fp16_type = cfg.optimizer, cfg.precision.fp16_type
    half = "float16" if fp16_type == "float32" else fp16_type
    args = {arg: getattr(opt, key) for key, arg in SCALER_KEYS.items() if getattr(opt, key) is not None}
    settings = ScalerSettings.cerebras(**args, half_dtype=half)
    if cfg.runconfig.backend != "GPU" or settings.mode == "off":
        return settings
    rule = {k: v for k, v in args.items() if k not in ("loss_scale", "init_scale", "steps_per_increase")}
    if settings.mode == "static":
        return ScalerSettings.torch(init_scale=args["loss_scale"], growth_interval=GPU_NEVER, half_dtype=half, **rule)
    start, interval = (
        args.get("init_scale", TORCH_INIT_SCALE),
        args.get("steps_per_increase", settings.steps_per_increase),
    )
    return ScalerSettings.torch(init_scale=start, growth_interval=interval, half_dtype=half, **rule)


def loss_scaling_mode(cfg: TrainConfig) -> str:
    """``"dynamic"``, ``"static"`` or ``"off"`` (``"off"`` when the run computes in float32)."""
    return "off" if cfg.precision.compute_dtype == "float32" else scaler_settings(cfg).mode


# ---------------------------------------------------------------------- output
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


def describe_keys() -> str:
    """Every section and key with its default and help (``dls keys``); a loss-scaling key's default is the
    scaler's (``null: 2^15``)."""
    from dls.diagnostics.scales import pow2

    def shown(value: Any, arg: str) -> str:
        return "null" if value is None else pow2(value) if arg.endswith("scale") else f"{value:g}"

    f16, cb16 = (ScalerSettings.cerebras(loss_scale="dynamic", half_dtype=h) for h in ("float16", "cbfloat16"))
    lines = []
    for name, cls in SECTION_CLASSES.items():
        lines.append(f"{name}:")
        for key, field in cls.model_fields.items():
            default, text = field.default, field.description or ""
            default = "null" if default is None else str(default).lower() if isinstance(default, bool) else default
            arg = SCALER_KEYS.get(key, "") if name == "optimizer" else ""
            if arg not in ("", "loss_scale", "max_gradient_norm"):
                default, cb = f"null: {shown(getattr(f16, arg), arg)}", shown(getattr(cb16, arg), arg)
                text += f" (cbfloat16: {cb})" if f"null: {cb}" != default else ""
            only = f" [{'/'.join(ONLY[key])} only]" if key in ONLY else ""
            lines.append(f"  {key:<32} {default!s:<19} {text}{only}")
    return "\n".join(lines)


def missing_paths(cfg: TrainConfig) -> list[str]:
    """What is missing or malformed here in the data of the loaders ``dls train`` uses (a note for ``validate``, an
    error for ``train``), naming the key as written and the layout expected."""
    from dls.train.modelzoo import check_data

    lines, cwd = [], f" (relative paths resolve against {Path.cwd()})"
    for section, split in (("data", "train"), ("eval_data", "val")):
        data = getattr(cfg, section)
        if data is not None and data.data_processor is not None:
            key = cfg.sources.get(f"{section}.params", "train_input" if split == "train" else "eval_input")
            lines += [p + cwd for p in check_data(data.data_processor, data.loader_params, split=split, prefix=key)]
    return lines


# float32 weights, gradients and Adam's two states (16 bytes), and a checkpoint's weights and Adam states serialised
# in memory before it is written (12; see dls.train.checkpoint): measured 28 bytes per parameter at the peak.
BYTES_PER_PARAMETER = 28.0


def memory_problem(cfg: TrainConfig) -> str | None:
    """What of ``cfg`` will not fit this machine's free memory (the generated data set; the model with its
    gradients, Adam's two states and a checkpoint being written), naming the key as written; ``None`` when it
    fits. A note for ``validate``, exit status 3 for ``train``."""
    m, d, p = cfg.model, cfg.data, cfg.model.params
    need: dict[str, float] = {}
    if d.dataset == "teacher_regression":
        need["data.num_samples"] = 4.0 * d.num_samples * (d.input_dim + d.output_dim)
    h = p.get("hidden_size", m.hidden_size)
    if m.name in ("gpt2", "gpt3", "llama") and all(isinstance(p.get(k), int) for k in ("hidden_size", "filter_size")):
        embeddings = p.get("vocab_size", 1) * h * (1 if p.get("share_embedding_weights", True) else 2)
        block = 4 * h + (3 if p.get("nonlinearity") == "swiglu" else 2) * p["filter_size"]  # attention and MLP
        blocks = p.get("num_hidden_layers", 1) * h * block
        need[cfg.sources.get("model.params", "model") + ".hidden_size"] = BYTES_PER_PARAMETER * (embeddings + blocks)
    elif m.name == "mlp":
        need["model.hidden_size"] = BYTES_PER_PARAMETER * h * (d.input_dim + h * (m.depth - 1) + d.output_dim)
    if (free := free_memory()) is None or sum(need.values()) <= free:
        return None
    key = max(need, key=need.__getitem__)
    gib = f"about {sum(need.values()) / 2**30:.1f} GiB, {free / 2**30:.1f} GiB are free here"
    return f"{cfg.sources.get(key, key)}: this run needs {gib}"
