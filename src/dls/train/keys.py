"""Every key of a training config, declared once: a field of its section's dataclass, whose metadata (a
:class:`Key`, made by :func:`key`) holds its check (``dls.train.checks``), its help (``dls keys``), whether it
selects the section's variant (``model.name``, ``data.dataset``, ``optimizer.optimizer_type``), whether it is
required, which variants or loss-scaling modes it applies to, and which ``ScalerSettings`` argument it sets.

Reading, validating and writing configs: ``dls.train.config``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dls.diagnostics.scales import pow2
from dls.settings import ScalerSettings
from dls.train import checks

MODEL_NAMES = ("mlp", "transformer_lm")
DATASETS = ("teacher_regression", "char_corpus")
FP16_TYPES = ("float16", "bfloat16", "cbfloat16", "float32")
OPTIMIZERS = ("SGD", "Adam", "AdamW")
DEVICES = ("auto", "cpu", "cuda")
ACTIVATIONS = ("tanh", "relu", "gelu")
# Model Zoo's --load_checkpoint_states values, plus "rng" (the random-number generators, needed for bit-identity).
CHECKPOINT_STATES = ("model", "optimizer", "dataloader", "grad_scaler", "lr_scheduler", "global_step", "rng")
# Which data sets each model can train on.
MODEL_DATASETS = {"mlp": ("teacher_regression",), "transformer_lm": ("char_corpus",)}
# torch.set_num_threads with more threads than any machine has cores only oversubscribes them.
MAX_THREADS = 1024


def parse_checkpoint_states(value: str | Sequence[str]) -> tuple[str, ...]:
    """``"model,optimizer"`` or a list → validated tuple of state names (``"all"`` → every state)."""
    items = [s.strip() for s in value.split(",")] if isinstance(value, str) else list(value)
    if not items or not all(isinstance(s, str) and s for s in items):
        raise ValueError(f"expected a comma-separated list of {', '.join(CHECKPOINT_STATES)} (or 'all'); got {value!r}")
    if items == ["all"]:
        return CHECKPOINT_STATES
    bad = [s for s in items if s not in CHECKPOINT_STATES]
    if bad:
        raise ValueError(
            f"unknown checkpoint state(s) {', '.join(map(repr, bad))}; allowed: {', '.join(CHECKPOINT_STATES)}"
        )
    return tuple(dict.fromkeys(items))


def _states(key: str, value: Any) -> tuple[Any, checks.Problem]:
    if value is None:
        return None, None
    try:
        return parse_checkpoint_states(value), None
    except ValueError as exc:
        return None, f"{key}: {exc}"


# ---------------------------------------------------------------------- keys
@dataclass(frozen=True)
class Key:
    """What a config key is, kept in its dataclass field's metadata.

    Attributes:
        check: ``(path, value) -> (parsed, problem)`` (``dls.train.checks``).
        help: one line for ``dls keys``.
        only: the section variants (selector values) the key applies to; empty: all.
        selector: the key picks the section's variant (``model.name``, ...).
        required: the key must be given.
        scaler: the ``ScalerSettings.cerebras`` argument the key sets (its value is judged there).
        scaling: ``"any"`` if the key applies only with loss scaling, ``"dynamic"`` only with dynamic scaling.
    """

    check: checks.Check
    help: str
    only: tuple[str, ...] = ()
    selector: bool = False
    required: bool = False
    scaler: str | None = None
    scaling: str | None = None


def key(default: Any, check: checks.Check, help: str, **spec: Any) -> Any:
    """A config key: a dataclass field with ``default`` and a :class:`Key` in its metadata."""
    return field(default=default, metadata={"key": Key(check, help, **spec)})


def _dynamic(scaler: str, check: checks.Check, help: str) -> Any:
    """A key of the dynamic loss-scaling rule: null is the scaler's default."""
    return key(None, check, help, scaler=scaler, scaling="dynamic")


@dataclass(frozen=True)
class ModelConfig:
    """``model:``. ``name`` picks the model; keys of the other model are rejected."""

    name: str = key(
        "mlp",
        checks.choice(MODEL_NAMES),
        "the model: 'mlp' (regression MLP) or 'transformer_lm' (character GPT)",
        selector=True,
        required=True,
    )
    loss_weight: float = key(1.0, checks.number(0.0, low_open=True), "multiplies the training loss (logged unweighted)")
    hidden_size: int = key(128, checks.integer(1), "width of the hidden layers / the model dimension")
    depth: int = key(3, checks.integer(1), "number of hidden layers", only=("mlp",))
    activation_fn: str = key("tanh", checks.choice(ACTIVATIONS), "activation of the hidden layers", only=("mlp",))
    dropout: float = key(
        0.0, checks.number(0.0, 1.0, high_open=True), "dropout probability after each activation", only=("mlp",)
    )
    num_hidden_layers: int = key(2, checks.integer(1), "number of transformer blocks", only=("transformer_lm",))
    num_heads: int = key(4, checks.integer(1), "attention heads (must divide hidden_size)", only=("transformer_lm",))
    filter_size: int = key(256, checks.integer(1), "width of each block's feed-forward layer", only=("transformer_lm",))
    dropout_rate: float = key(
        0.0, checks.number(0.0, 1.0, high_open=True), "dropout probability", only=("transformer_lm",)
    )
    max_position_embeddings: int = key(
        256, checks.integer(1), "longest sequence the model accepts", only=("transformer_lm",)
    )


@dataclass(frozen=True)
class DataConfig:
    """``data:`` (Model Zoo: ``train_input:``). Keys of the other data set are rejected."""

    dataset: str = key(
        "teacher_regression",
        checks.choice(DATASETS),
        "generated teacher_regression, or the character corpus shipped with dls (default: the model's)",
        selector=True,
    )
    batch_size: int = key(64, checks.integer(1), "samples (sequences) per step and rank")
    shuffle: bool = key(True, checks.boolean, "reshuffle the samples every epoch")
    shuffle_seed: int | None = key(
        None, checks.integer(0, nullable=True, maximum=checks.MAX_SEED), "seed of the sample order (null: the seed)"
    )
    num_samples: int = key(4096, checks.integer(1), "samples in the generated data set", only=("teacher_regression",))
    input_dim: int = key(32, checks.integer(1), "features per sample", only=("teacher_regression",))
    output_dim: int = key(64, checks.integer(1), "regression targets per sample", only=("teacher_regression",))
    noise_std: float = key(
        0.0, checks.number(0.0), "standard deviation of noise added to the targets", only=("teacher_regression",)
    )
    dataset_seed: int = key(
        1234,
        checks.integer(0, maximum=checks.MAX_SEED),
        "seed that generates the data set (the teacher)",
        only=("teacher_regression",),
    )
    max_sequence_length: int = key(64, checks.integer(1), "characters per training sequence", only=("char_corpus",))


def _fp8_help() -> str:
    """``precision.fp8``'s help, with each recipe's fields as ``dls.fp8`` declares them."""
    from dls.fp8 import RECIPE_NAMES

    fields = {name: [f.name for f in dataclasses.fields(cls)] for name, cls in RECIPE_NAMES.items()}
    shared = [f for f in next(iter(fields.values())) if all(f in names for names in fields.values())]
    own = "; ".join(f"{name}: {', '.join(f for f in names if f not in shared)}" for name, names in fields.items())
    return (
        f"FP8 Linear layers (dls.fp8.emulate), null: none. {{recipe: {'|'.join(RECIPE_NAMES)}, <fields>}}, e.g. "
        f"{{recipe: delayed, amax_history_len: 16}}; fields: {own}; all: {', '.join(shared)}"
    )


@dataclass(frozen=True)
class PrecisionConfig:
    """``precision:``. ``compute_dtype`` is what the run computes in: ``fp16_type`` with ``mixed_precision``,
    else float32."""

    fp16_type: str = key("float16", checks.choice(FP16_TYPES), "half format of mixed precision")
    mixed_precision: bool = key(False, checks.boolean, "compute in fp16_type (false: everything in float32)")
    emulate: bool = key(
        False, checks.boolean, "round with dls.emulate instead of torch.autocast (cbfloat16 always emulates)"
    )
    half_params: bool = key(
        False,
        checks.boolean,
        "keep the model's parameters in fp16_type, without autocast (cbfloat16: float32 values on its grid), "
        "stepped through float32 master weights (dls.master_weights); needs mixed_precision",
    )
    master_weights: bool = key(
        True,
        checks.boolean,
        "with half_params: step float32 masters (false: the optimizer steps the half parameters themselves; "
        "float16/bfloat16 only)",
    )
    fp8: Mapping[str, Any] | None = key(None, checks.fp8_recipe, _fp8_help())

    @property
    def compute_dtype(self) -> str:
        return self.fp16_type if self.mixed_precision else "float32"

    @property
    def emulated(self) -> bool:
        """Whether the run rounds through ``dls.emulate`` (always for cbfloat16) instead of ``torch.autocast``."""
        dtype = self.compute_dtype
        return dtype == "cbfloat16" or (self.emulate and dtype != "float32")

    @property
    def param_dtype(self) -> str:
        """The dtype of the model's parameters: ``fp16_type`` for float16/bfloat16 ``half_params``, else float32
        (cbfloat16 parameters are float32 values kept on its grid)."""
        return self.fp16_type if self.half_params and self.fp16_type in ("float16", "bfloat16") else "float32"


@dataclass(frozen=True)
class OptimizerConfig:
    """``optimizer:``: the optimizer, its learning rate (a number or a schedule) and the loss-scaling keys, whose
    null values are the scaler's defaults (``dls keys`` shows them)."""

    optimizer_type: str = key(
        "Adam", checks.choice(OPTIMIZERS, case_insensitive=True), "the torch optimizer", selector=True
    )
    learning_rate: float | tuple[dict[str, Any], ...] = key(
        1e-3,
        checks.learning_rate,
        "a number, or a schedule: {scheduler: Linear|CosineDecay|Constant, ...} (advances on applied steps)",
    )
    momentum: float = key(0.0, checks.number(0.0, 1.0, high_open=True), "SGD momentum", only=("SGD",))
    weight_decay: float = key(0.0, checks.number(0.0), "weight decay (Model Zoo's weight_decay_rate also works)")
    betas: tuple[float, float] = key((0.9, 0.999), checks.betas, "Adam/AdamW betas", only=("Adam", "AdamW"))
    eps: float = key(1e-8, checks.number(0.0, low_open=True), "Adam/AdamW epsilon", only=("Adam", "AdamW"))
    loss_scaling_factor: str | float | None = key(
        None,
        checks.loss_scaling_factor,
        "'dynamic', a static scale, or null: dynamic for float16/cbfloat16, off for bfloat16",
        scaler="loss_scale",
        scaling="any",
    )
    initial_loss_scale: float | None = _dynamic("init_scale", checks.as_given, "first dynamic scale (null: the max)")
    steps_per_increase: int | None = _dynamic("steps_per_increase", checks.integral, "clean steps before it grows")
    min_loss_scale: float | None = _dynamic("min_loss_scale", checks.as_given, "floor of the dynamic scale")
    max_loss_scale: float | None = _dynamic("max_loss_scale", checks.as_given, "ceiling of the dynamic scale")
    overflow_tolerance: float | None = _dynamic(
        "overflow_tolerance", checks.as_given, "fraction of overflowing steps tolerated before backing off"
    )
    growth_factor: float | None = _dynamic("growth_factor", checks.as_given, "multiplies the scale when it grows")
    backoff_factor: float | None = _dynamic("backoff_factor", checks.as_given, "multiplies the scale on overflow")
    hysteresis: int | None = _dynamic("hysteresis", checks.integral, "overflows per back-off (DeepSpeed/Megatron)")
    max_gradient_norm: float | None = key(
        None,
        checks.as_given,
        "clip the global gradient L2 norm (with or without loss scaling)",
        scaler="max_gradient_norm",
    )
    max_gradient_value: float | None = key(
        None, checks.number(0.0, low_open=True, nullable=True), "clip each gradient element to [-value, value]"
    )
    log_summaries: bool = key(False, checks.boolean, "also log gradient underflow statistics (slower)")


@dataclass(frozen=True)
class RunConfig:
    """``runconfig:``."""

    max_steps: int = key(100, checks.integer(1), "train until this global step")
    checkpoint_steps: int = key(0, checks.integer(0), "checkpoint every N steps (0: only at the end)")
    keep_checkpoint_max: int = key(5, checks.integer(1), "keep only the last N checkpoints")
    log_steps: int = key(10, checks.integer(1), "write metrics every N steps (skipped steps are always written)")
    model_dir: str = key("model_dir", checks.text, "directory for checkpoints, metrics.jsonl and plots.png")
    seed: int = key(0, checks.integer(0, maximum=checks.MAX_SEED), "seed of initialisation, data order and dropout")
    device: str = key("cpu", checks.choice(DEVICES), "'cpu', 'cuda', or 'auto' (cuda when available)")
    num_threads: int | None = key(
        None,
        checks.integer(1, nullable=True, maximum=MAX_THREADS),
        "torch CPU threads for the run, restored after (null: leave torch's setting). Tiny models on busy cores "
        "train fastest with 1: a tiny MLP on 2 cores shared with other work ran 25-40x faster with 1 thread than 2",
    )
    tensorboard: bool = key(
        False,
        checks.boolean,
        "also write the logged metrics as TensorBoard events into model_dir/tensorboard/ (needs dls[tensorboard])",
    )
    max_overflows_at_min_loss_scale: int = key(
        10, checks.integer(1), "stop after N overflows with the scale pinned at min_loss_scale (no clean step between)"
    )
    load_checkpoint_states: tuple[str, ...] | None = key(
        None, _states, "with --resume: which states to load (default: all)"
    )


SECTION_CLASSES: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "precision": PrecisionConfig,
    "optimizer": OptimizerConfig,
    "runconfig": RunConfig,
}
SECTIONS = tuple(SECTION_CLASSES)
SECTION_ALIASES = {"train_input": "data"}
KEY_ALIASES: dict[str, dict[str, str]] = {"optimizer": {"weight_decay_rate": "weight_decay"}}
# Keys Model Zoo puts in model: that belong to precision: here.
MOVED_KEYS = {"model": ("mixed_precision", "fp16_type")}


@dataclass(frozen=True)
class TrainConfig:
    """A validated config. ``warnings`` lists valid keys that have no effect in the chosen mode (dropped)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    runconfig: RunConfig = field(default_factory=RunConfig)
    warnings: tuple[str, ...] = ()


@functools.cache
def section_keys(section: str) -> dict[str, Key]:
    """The keys of a section (``model`` also holds the precision keys Model Zoo puts there), in declaration order."""
    keys = {f.name: f.metadata["key"] for f in dataclasses.fields(SECTION_CLASSES[section])}
    for name in MOVED_KEYS.get(section, ()):
        moved = section_keys("precision")[name]
        keys[name] = dataclasses.replace(moved, help=f"alias of precision.{name} (Model Zoo puts it here)")
    return keys


def selector_of(section: str) -> str | None:
    """The key that picks the section's variant (``model.name``), if it has one."""
    return next((name for name, k in section_keys(section).items() if k.selector), None)


def describe_keys() -> str:
    """Every section and key with its default and meaning (``dls keys``). A loss-scaling key's default is the
    scaler's (``null: 2000``)."""
    defaults = {
        half: ScalerSettings.cerebras(loss_scale="dynamic", half_dtype=half) for half in ("float16", "cbfloat16")
    }
    lines = []
    for name in SECTIONS:
        alias = [a for a, c in SECTION_ALIASES.items() if c == name]
        lines.append(f"{name}:" + (f"  (Model Zoo name {', '.join(alias)}: works too)" if alias else ""))
        declared = {f.name: f.default for f in dataclasses.fields(SECTION_CLASSES[name])}
        for k, spec in section_keys(name).items():
            help_text = spec.help
            if k not in declared:
                shown = "-"
            elif spec.required:
                shown = "(required)"
            elif spec.scaler and spec.scaler != "loss_scale" and declared[k] is None:
                value = getattr(defaults["float16"], spec.scaler)
                shown = "null" if value is None else f"null: {_format(value, spec.scaler)}"
                other = getattr(defaults["cbfloat16"], spec.scaler)
                if other != value:
                    help_text += f" (cbfloat16: {_format(other, spec.scaler)})"
            else:
                shown = _format(declared[k])
            only = f" [{'/'.join(spec.only)} only]" if spec.only else ""
            lines.append(f"  {k:<32} {shown:<19} {help_text}{only}")
    return "\n".join(lines)


def _format(value: Any, name: str = "") -> str:
    """A default as ``dls keys`` shows it; loss scales (``name`` ends in ``scale``) as powers of two."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return pow2(value) if name.endswith("scale") else f"{value:g}"
    if isinstance(value, tuple):
        return "[" + ", ".join(_format(v) for v in value) + "]"
    return str(value)
