"""Every key of dls's own config sections, declared once as a pydantic field (its type, bounds, default and
help for ``dls keys``). Numbers are strict: ``true`` is not 1 and ``"1024"`` is not 1024; every number is finite
and at most float32's max in size; counts have fixed upper bounds. The loss-scaling keys are typed loosely here
and judged by ``dls.settings.ScalerSettings`` (``dls.train.config``), so the config accepts what ``GradScaler``
accepts. How a Model Zoo layout maps onto these sections: ``dls.train.config``."""

from __future__ import annotations

import difflib
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

F32_MAX = 3.4028234663852886e38
INT64_MAX = 2**63 - 1
MAX_SEED = 2**32 - 1  # NumPy's seeds are 32-bit
MAX_THREADS = 1024  # more threads than any machine has cores only oversubscribes them
MODEL_NAMES = ("mlp", "transformer_lm")
ZOO_MODELS = ("fc_mnist", "gpt2", "gpt3", "llama")
ZOO_PROCESSORS = ("MNISTDataProcessor", "GptHDF5DataProcessor", "GptHDF5MapDataProcessor")
MODEL_DATASETS = {"mlp": "teacher_regression", "transformer_lm": "char_corpus"}
OPTIMIZERS = ("SGD", "Adam", "AdamW")
# Model Zoo's --load_checkpoint_states values, plus "rng" (the random-number generators, needed for bit-identity).
CHECKPOINT_STATES = ("model", "optimizer", "dataloader", "grad_scaler", "lr_scheduler", "global_step", "rng")
# Keys that apply to one variant of their section only (the section's selector value).
ONLY = {
    "depth": ("mlp",),
    "activation_fn": ("mlp",),
    "dropout": ("mlp",),
    **dict.fromkeys(
        ("num_hidden_layers", "num_heads", "filter_size", "dropout_rate", "max_position_embeddings"),
        ("transformer_lm",),
    ),
    **dict.fromkeys(("num_samples", "input_dim", "output_dim", "noise_std", "dataset_seed"), ("teacher_regression",)),
    "max_sequence_length": ("char_corpus",),
    "momentum": ("SGD",),
    "betas": ("Adam", "AdamW"),
    "eps": ("Adam", "AdamW"),
    "correct_bias": ("AdamW",),
}


def _integral(value: Any) -> Any:
    """YAML's ``1e3`` for an integer key is the integer it is."""
    if isinstance(value, float) and value.is_integer() and abs(value) <= INT64_MAX:
        return int(value)
    return value


def Bounds(ge: int = 0, le: int = INT64_MAX) -> Any:
    """An integer key's bounds (strict: ``true`` and ``"1"`` are not integers)."""
    return Field(strict=True, ge=ge, le=le)


def Finite(ge: float | None = None, le: float | None = None, gt: float | None = None, lt: float | None = None) -> Any:
    """A number key's bounds: finite, and at most float32's max in size unless a tighter bound is given."""
    ge = -F32_MAX if ge is None and gt is None else ge
    le = F32_MAX if le is None and lt is None else le
    return Field(strict=True, allow_inf_nan=False, ge=ge, le=le, gt=gt, lt=lt)


_CANONICAL = {n.lower(): n for n in ("SGD", "Adam", "AdamW", "Constant", "Linear", "CosineDecay")}
INTEGRAL = BeforeValidator(_integral)
LISTED = BeforeValidator(lambda v: tuple(v) if isinstance(v, list) else v)  # a YAML list as a tuple
CASELESS = BeforeValidator(lambda v: _CANONICAL.get(v.lower(), v) if isinstance(v, str) else v)  # Model Zoo: adamw
Unit = Annotated[float, Finite(ge=0, lt=1)]
Steps = Annotated[int, INTEGRAL, Bounds(1)]
Seed = Annotated[int, INTEGRAL, Bounds(0, MAX_SEED)]
Size = Annotated[int, INTEGRAL, Bounds(1, 1 << 20)]
Length = Annotated[int, INTEGRAL, Bounds(1, 1 << 22)]
Layers = Annotated[int, INTEGRAL, Bounds(1, 4096)]
State = Literal["model", "optimizer", "dataloader", "grad_scaler", "lr_scheduler", "global_step", "rng"]


def help_(default: Any, text: str) -> Any:
    return Field(default, description=text)


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class ModelConfig(Section):
    """``model:``. A Model Zoo model (``fc_mnist``, ``gpt2``, ``gpt3``, ``llama``) takes its keys in ``params``,
    judged by ``dls.train.modelzoo``."""

    name: str = help_("mlp", "mlp | transformer_lm (built in), or a Model Zoo model: fc_mnist | gpt2 | gpt3 | llama")
    loss_weight: Annotated[float, Finite(gt=0)] = help_(1.0, "multiplies the training loss (logged unweighted)")
    hidden_size: Size = help_(128, "width of the hidden layers / the model dimension")
    depth: Layers = help_(3, "number of hidden layers")
    activation_fn: Literal["tanh", "relu", "gelu"] = help_("tanh", "activation of the hidden layers")
    dropout: Annotated[float, Finite(ge=0, lt=1)] = help_(0.0, "dropout probability after each activation")
    num_hidden_layers: Layers = help_(2, "number of transformer blocks")
    num_heads: Layers = help_(4, "attention heads (must divide hidden_size)")
    filter_size: Length = help_(256, "width of each block's feed-forward layer")
    dropout_rate: Annotated[float, Finite(ge=0, lt=1)] = help_(0.0, "dropout probability")
    max_position_embeddings: Length = help_(256, "longest sequence the model accepts")
    params: dict[str, Any] = help_({}, "a Model Zoo model's own keys, as written in model:")


class DataConfig(Section):
    """``train_input:`` / ``eval_input:`` (dls's own configs: ``data:``). A Model Zoo ``data_processor`` takes its
    keys in ``params``, judged by ``dls.train.modelzoo``."""

    dataset: Literal["teacher_regression", "char_corpus"] | None = help_(
        None, "generated teacher_regression, or the character corpus shipped with dls (default: the model's)"
    )
    data_processor: str | None = help_(None, "a Model Zoo reader: " + " | ".join(ZOO_PROCESSORS))
    batch_size: Annotated[int, INTEGRAL, Bounds(1, 1 << 24)] = help_(64, "samples (sequences) per step and rank")
    shuffle: bool = help_(True, "reshuffle the samples every epoch")
    shuffle_seed: Seed | None = help_(None, "seed of the sample order (null: the seed)")
    drop_last_batch: bool = help_(True, "drop an incomplete last batch (dls's built-in data sets always do)")
    num_samples: Annotated[int, INTEGRAL, Bounds(1, 1 << 40)] = help_(4096, "samples in the generated data set")
    input_dim: Size = help_(32, "features per sample")
    output_dim: Size = help_(64, "regression targets per sample")
    noise_std: Annotated[float, Finite(ge=0)] = help_(0.0, "standard deviation of noise added to the targets")
    dataset_seed: Seed = help_(1234, "seed that generates the data set (the teacher)")
    max_sequence_length: Length = help_(64, "characters per training sequence")
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
    learning_rate: Annotated[float, Finite(ge=0)] | None = None
    initial_learning_rate: Annotated[float, Finite(ge=0)] | None = None
    end_learning_rate: Annotated[float, Finite(ge=0)] | None = None
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
    learning_rate: Annotated[float, Finite(ge=0)] | Annotated[tuple[SchedulePiece, ...], LISTED] = help_(
        1e-3, "a number, or a schedule: [{scheduler: Linear|CosineDecay|Constant, ...}, ...] (on applied steps)"
    )
    momentum: Annotated[float, Finite(ge=0, lt=1)] = help_(0.0, "SGD momentum")
    weight_decay: Annotated[float, Finite(ge=0)] = help_(0.0, "weight decay")
    betas: Annotated[tuple[Unit, Unit], LISTED] = help_((0.9, 0.999), "Adam/AdamW betas")
    eps: Annotated[float, Finite(gt=0)] = help_(1e-8, "Adam/AdamW epsilon")
    correct_bias: Literal[True] = help_(True, "AdamW bias correction (torch's AdamW always corrects)")
    loss_scaling_factor: Any = help_(None, "'dynamic', a static scale, or null: dynamic for float16/cbfloat16")
    initial_loss_scale: Any = help_(None, "first dynamic scale (null: the max)")
    steps_per_increase: Annotated[Any, BeforeValidator(_integral)] = help_(
        None, "the scale grows on the next clean step after this many"
    )
    min_loss_scale: Any = help_(None, "floor of the dynamic scale")
    max_loss_scale: Any = help_(None, "ceiling of the dynamic scale")
    overflow_tolerance: Any = help_(None, "fraction of overflowing steps tolerated before backing off")
    growth_factor: Any = help_(None, "multiplies the scale when it grows")
    backoff_factor: Any = help_(None, "multiplies the scale on overflow")
    hysteresis: Annotated[Any, BeforeValidator(_integral)] = help_(None, "overflows per back-off (DeepSpeed/Megatron)")
    consecutive_hysteresis: Any = help_(None, "hysteresis counts consecutive overflows only")
    max_gradient_norm: Any = help_(None, "clip the global gradient L2 norm")
    max_gradient_value: Annotated[float, Finite(gt=0)] | None = help_(
        None, "clip each gradient element to [-value, value]"
    )
    log_summaries: bool = help_(False, "also log gradient underflow statistics (slower)")


class RunConfig(Section):
    """``runconfig:`` (the current layout's ``loop``, ``checkpoint``, ``logging``, ``model_dir``, ``seed``)."""

    max_steps: Steps = help_(100, "train until this global step (num_epochs instead, when this is not given)")
    num_steps: Steps | None = help_(None, "train this many steps in this run (then stop)")
    num_epochs: Size | None = help_(None, "train this many epochs (when max_steps is not given)")
    steps_per_epoch: Steps | None = help_(None, "steps per epoch (default: the training data's batches)")
    grad_accum_steps: Annotated[int, INTEGRAL, Bounds(1, 65536)] = help_(
        1, "micro-batches whose gradients make one optimizer step"
    )
    eval_frequency: Steps | Annotated[float, Finite(gt=0, le=1)] | None = help_(
        None, "evaluate every N steps (an integer) or every fraction of the run (a float in (0, 1])"
    )
    eval_steps: Steps | None = help_(None, "batches per evaluation (null: the whole eval data)")
    checkpoint_steps: Annotated[int, INTEGRAL, Bounds(0)] = help_(0, "checkpoint every N steps (0: only at the end)")
    save_initial_checkpoint: bool = help_(False, "also checkpoint step 0")
    keep_checkpoint_max: Size = help_(5, "keep only the last N checkpoints")
    log_steps: Steps = help_(10, "write metrics every N steps (skipped steps are always written)")
    model_dir: Annotated[str, Field(min_length=1)] = help_("model_dir", "directory for checkpoints and metrics")
    seed: Seed = help_(0, "seed of initialisation, data order and dropout")
    device: Literal["auto", "cpu", "cuda"] = help_("cpu", "'cpu', 'cuda', or 'auto' (cuda when available)")
    num_threads: Annotated[int, INTEGRAL, Bounds(1, MAX_THREADS)] | None = help_(
        None,
        "torch CPU threads for the run, restored after (null: leave torch's setting). Tiny models on busy cores "
        "train fastest with 1: a tiny MLP on 2 cores shared with other work ran 25-40x faster with 1 thread than 2",
    )
    tensorboard: bool = help_(False, "also write TensorBoard events into model_dir/tensorboard/")
    max_overflows_at_min_loss_scale: Annotated[int, INTEGRAL, Bounds(1, 1 << 31)] = help_(
        10, "stop after N overflows pinned at the floor"
    )
    load_checkpoint_states: Annotated[tuple[State, ...], LISTED] | None = help_(
        None, "when starting from a checkpoint of another run: the states to load (default: all)"
    )
    checkpoint_path: Annotated[str, Field(min_length=1)] | None = help_(None, "a checkpoint to start from")
    autoload_last_checkpoint: bool = help_(False, "continue from model_dir's newest checkpoint (the same command)")
    disable_strict_checkpoint_loading: bool = help_(False, "load a model state with missing/extra entries")


SECTION_CLASSES: dict[str, type[Section]] = {
    "model": ModelConfig,
    "data": DataConfig,
    "precision": PrecisionConfig,
    "optimizer": OptimizerConfig,
    "runconfig": RunConfig,
}
SCALER_KEYS = {  # optimizer key -> ScalerSettings.cerebras argument
    "loss_scaling_factor": "loss_scale",
    "initial_loss_scale": "init_scale",
    **{k: k for k in ("steps_per_increase", "min_loss_scale", "max_loss_scale", "overflow_tolerance")},
    **{k: k for k in ("growth_factor", "backoff_factor", "hysteresis", "consecutive_hysteresis")},
    "max_gradient_norm": "max_gradient_norm",
}


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

    @property
    def warnings(self) -> tuple[str, ...]:
        return self.notes


_SHAPES = {
    "betas": "a list of two numbers in [0, 1), e.g. [0.9, 0.999]",
    "learning_rate": "a number >= 0 or a schedule (a list of {scheduler: Linear|CosineDecay|Constant, ...})",
    "fp8": "null (no FP8) or a mapping {recipe: current | delayed | mxfp8 | static, <the recipe's fields>}",
    "eval_frequency": "an integer >= 1 (every N steps), a number in (0, 1] (a fraction of the run) or null",
}
_NUMERIC = {"int_type", "int_from_float", "float_type", "finite_number", "int_parsing", "float_parsing"}
_NUMERIC |= {"greater_than_equal", "less_than_equal", "greater_than", "less_than"}
_MESSAGES = {
    "int_type": "must be an integer", "int_from_float": "must be an integer", "float_type": "must be a number",
    "finite_number": "must be a finite number", "bool_type": "must be true or false", "string_type": "must be text",
    "greater_than_equal": "must be {what} >= {ge}", "less_than_equal": "must be {what} <= {le}",
    "greater_than": "must be {what} > {gt}", "less_than": "must be {what} < {lt}", "too_short": "must not be empty",
    "dict_type": "must be a mapping", "tuple_type": "must be a list", "model_type": "must be a mapping",
}  # fmt: skip


def did_you_mean(word: Any, allowed: Any) -> str:
    names = [str(a) for a in allowed]
    same = [a for a in names if a.lower() == str(word).lower()]
    close = same or difflib.get_close_matches(str(word), names, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _allowed(field: Any, value: Any) -> str | None:
    """What a numeric field allows, from its annotation: ``an integer in [0, 4294967295] or null``."""
    annotation = field.annotation
    args = get_args(annotation) if get_origin(annotation) in (Union, UnionType) else (annotation,)
    members = [(get_args(a)[0], a.__metadata__) for a in args if get_origin(a) is Annotated]
    for base, metadata in members or [(annotation, field.metadata)]:
        b: dict[str, Any] = {}
        for meta in metadata:
            for c in [meta, *getattr(meta, "metadata", [])]:
                b.update({k: getattr(c, k) for k in ("ge", "gt", "le", "lt") if getattr(c, k, None) is not None})
        if base not in (int, float):
            continue
        low, high = b.get("ge", b.get("gt")), b.get("le", b.get("lt"))
        low = None if low == -F32_MAX else low
        big = isinstance(value, int) and value > INT64_MAX
        high = None if high == F32_MAX or (high == INT64_MAX and not big) else high
        text = "an integer" if base is int else "a number"
        if low is not None and high is not None:
            text += (
                f" in {'[('['gt' in b]}{low:g}, {high:g}{'])'['lt' in b]}" if base is float else f" in [{low}, {high}]"
            )
        elif low is not None:
            text += f" {'>' if 'gt' in b else '>='} {low:g}"
        return text + (" or null" if type(None) in args else "")
    return None


def problems(exc: ValidationError, where: Any, cls: Any = None) -> list[str]:
    """One line per pydantic error, naming the key as written (``where(loc)`` maps a location to its path)."""
    out: list[str] = []
    done: set[str] = set()
    nested = {e["loc"][0] for e in exc.errors() if len([p for p in e["loc"] if isinstance(p, int)]) > 0}
    for err in exc.errors():
        loc = tuple(p for p in err["loc"] if not str(p).startswith(("function-", "constrained-")))
        loc = tuple(p for p in loc if p not in ("int", "float", "tuple[SchedulePiece, ...]", "str", "none"))
        path, value, kind = where(loc), err.get("input"), err["type"]
        if path in done:  # one problem per key (a union reports each of its members)
            continue
        done.add(path)
        if len(loc) == 1 and loc[0] in nested:  # a union's other member: the nested error says more
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if loc and loc[0] in _SHAPES and (len(loc) == 1 or loc[0] == "betas") and not (number and kind in _NUMERIC):
            out.append(f"{where(loc[:1])} must be {_SHAPES[loc[0]]}; got {value!r}")
        elif kind == "extra_forbidden":
            cls = SECTION_CLASSES.get(str(loc[0]), SchedulePiece) if len(loc) <= 2 else SchedulePiece
            keys = [k for k in cls.model_fields if k != "params"]
            out.append(f"unknown key {path}{did_you_mean(loc[-1], keys)}; allowed keys: {', '.join(keys)}")
        elif kind == "literal_error":
            expected = err.get("ctx", {}).get("expected", "").replace(" or ", ", ")
            hint = did_you_mean(value, [e.strip(" '") for e in expected.split(",")])
            out.append(f"{path} must be one of {expected}; got {value!r}{hint}")
        elif kind in _NUMERIC and cls is not None and len(loc) == 1 and loc[0] in cls.model_fields:
            allowed = str(_allowed(cls.model_fields[loc[0]], value))
            if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) > F32_MAX:
                allowed += ", at most float32's max 3.4e38 in size" if "integer" not in allowed else ""
            out.append(
                f"{path} must be {allowed}; got {value!r}"
                + (f" ({type(value).__name__})" if kind.endswith("type") else "")
            )
        else:
            ctx = {k: ("float32's max 3.4e38" if v == F32_MAX else v) for k, v in err.get("ctx", {}).items()}
            what = "an integer" if isinstance(value, int) and not isinstance(value, bool) else "a number"
            msg = _MESSAGES.get(kind, "").format(what=what, **ctx) or err["msg"].replace("Value error, ", "")
            out.append(f"{path} {msg}; got {value!r}" if msg.startswith("must") else f"{path}: {msg}; got {value!r}")
    return list(dict.fromkeys(out))


def describe_keys() -> str:
    """Every section and key with its default and help (``dls keys``); a loss-scaling key's default is the
    scaler's (``null: 2^15``)."""
    from dls.settings import ScalerSettings

    defaults = {h: ScalerSettings.cerebras(loss_scale="dynamic", half_dtype=h) for h in ("float16", "cbfloat16")}
    lines = []
    for name, cls in SECTION_CLASSES.items():
        lines.append(f"{name}:")
        for key, field in cls.model_fields.items():
            default = field.default
            shown = "null" if default is None else str(default).lower() if isinstance(default, bool) else str(default)
            arg = SCALER_KEYS.get(key) if name == "optimizer" else None
            if arg not in (None, "loss_scale", "max_gradient_norm"):
                f16, cb16 = (getattr(defaults[half], arg, None) for half in ("float16", "cbfloat16"))
                shown = f"null: {_format(f16, arg)}"
                field_help = f"{field.description}" + (f" (cbfloat16: {_format(cb16, arg)})" if cb16 != f16 else "")
            else:
                field_help = field.description or ""
            only = f" [{'/'.join(ONLY[key])} only]" if key in ONLY else ""
            lines.append(f"  {key:<32} {shown:<19} {field_help}{only}")
    return "\n".join(lines)


def _format(value: Any, name: str) -> str:
    from dls.diagnostics.scales import pow2

    return "null" if value is None else pow2(value) if name.endswith("scale") else f"{value:g}"
