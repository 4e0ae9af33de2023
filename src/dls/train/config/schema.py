"""The config's schema: dls's sections and every key of them, each declared once as a pydantic field (its type,
bounds, default and the help ``dls keys`` prints); what a Model Zoo model's or data processor's own keys are is
``dls.train.config.zoo_keys``'. Numbers are strict (``true`` is not 1, ``"1024"`` is not 1024), finite and at most
float32's max in size; counts are integers (``100.0`` is not a count, as ``GradScaler`` and the FP8 recipes refuse
it) with fixed upper bounds. The loss-scaling keys are ``Any`` here: ``ScalerSettings`` judges them
(``dls.train.config.validation``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from dls.checks import FLOAT32_MAX, INT64_MAX, did_you_mean
from dls.settings import ScalerSettings

ModelName = Literal["mlp", "transformer_lm", "fc_mnist", "gpt2", "gpt3", "llama"]
MODEL_NAMES, ZOO_MODELS = get_args(ModelName)[:2], get_args(ModelName)[2:]  # dls's built-in models; Model Zoo's
ZooProcessor = Literal["MNISTDataProcessor", "GptHDF5DataProcessor", "GptHDF5MapDataProcessor"]
ZOO_PROCESSORS: tuple[str, ...] = get_args(ZooProcessor)
MODEL_DATASETS = {"mlp": "teacher_regression", "transformer_lm": "char_corpus"}
# Model Zoo's --load_checkpoint_states values, plus "rng" (the random-number generators, needed for bit-identity).
CHECKPOINT_STATES = ("model", "optimizer", "dataloader", "grad_scaler", "lr_scheduler", "global_step", "rng")

# Names from other frameworks, pointed at the one key that does the same thing here.
_HINTS = {
    "growth_interval": "steps_per_increase", "loss_scale_window": "steps_per_increase",
    "init_scale": "initial_loss_scale", "loss_scale": "loss_scaling_factor", "lr": "learning_rate",
    "clip_grad_norm": "max_gradient_norm", "gradient_clipping": "max_gradient_norm", "type": "optimizer_type",
    "dtype": "fp16_type", "amp": "mixed_precision",
}  # fmt: skip


def unknown_key(path: str, key: Any, allowed: Sequence[str]) -> str:
    """The error for the unknown key ``path.key``, with a "did you mean" among ``allowed``."""
    hint = f" (did you mean {_HINTS[key]!r}?)" if key in _HINTS else did_you_mean(key, allowed)
    return f"unknown key {path}.{key}{hint}; allowed keys: {', '.join(allowed)}"


# ---------------------------------------------------------------------- the sections' keys
def Bounds(ge: int = 0, le: int = INT64_MAX) -> Any:
    """An integer key's bounds (strict: ``true`` and ``"1"`` are not integers)."""
    return Field(strict=True, ge=ge, le=le)


def Finite(ge: float | None = None, le: float | None = None, gt: float | None = None, lt: float | None = None) -> Any:
    """A number key's bounds: finite, and at most float32's max in size unless a tighter bound is given."""
    ge = -FLOAT32_MAX if ge is None and gt is None else ge
    le = FLOAT32_MAX if le is None and lt is None else le
    return Field(strict=True, allow_inf_nan=False, ge=ge, le=le, gt=gt, lt=lt)


CANONICAL = {n.lower(): n for n in ("SGD", "Adam", "AdamW", "Constant", "Linear", "CosineDecay")}


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
CASELESS = BeforeValidator(lambda v: CANONICAL.get(v.lower(), v) if isinstance(v, str) else v)  # Model Zoo: adamw
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
