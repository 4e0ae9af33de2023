"""Training configs: a Model-Zoo-style YAML file (or dict) → validated, frozen dataclasses → ``GradScaler`` kwargs.

A config has five sections::

    model:      {name: mlp | transformer_lm, <sizes>, loss_weight}
    data:       {dataset: teacher_regression | char_corpus, batch_size, ...}    (Model Zoo: train_input)
    precision:  {fp16_type: float16 | bfloat16 | cbfloat16 | float32, mixed_precision, emulate}
    optimizer:  {optimizer_type, learning_rate, loss_scaling_factor: dynamic | <number>, initial_loss_scale,
                 steps_per_increase, min_loss_scale, max_loss_scale, overflow_tolerance, max_gradient_norm,
                 max_gradient_value, log_summaries, ...}
    runconfig:  {max_steps, checkpoint_steps, log_steps, model_dir, seed, keep_checkpoint_max, ...}

Key names follow the Cerebras Model Zoo: the loss-scaling keys live in ``optimizer:``; ``model:`` may also hold
``mixed_precision`` and ``fp16_type`` (aliases of the ``precision:`` keys: giving both with different values is
an error); ``train_input:`` is accepted for ``data:`` and ``weight_decay_rate`` for ``weight_decay``. Unknown
keys, wrong types and out-of-range values are errors naming the key and what is allowed; the whole file is
checked at once and every problem is reported together (:class:`ConfigError`). Keys that are valid but have
no effect in the chosen mode (e.g. ``steps_per_increase`` with a static scale) produce warnings instead
(``TrainConfig.warnings``).

Loss scaling follows the precision unless ``loss_scaling_factor`` is given: dynamic for float16 and cbfloat16,
off for bfloat16 and float32. cbfloat16 accepts only ``"dynamic"`` (as on Cerebras).

This module depends on ``dls.scaler`` only; nothing in the core imports it.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dls.scaler import CBFLOAT16_MAX_LOSS_SCALE, DEFAULT_MAX_LOSS_SCALE, GradScaler

__all__ = [
    "CHECKPOINT_STATES",
    "ConfigError",
    "DataConfig",
    "ModelConfig",
    "OptimizerConfig",
    "PrecisionConfig",
    "RunConfig",
    "TrainConfig",
    "apply_overrides",
    "describe_keys",
    "grad_scaler_kwargs",
    "load_config",
    "load_yaml",
    "loss_scaling_mode",
    "parse_checkpoint_states",
    "parse_config",
    "parse_yaml_value",
    "read_config",
    "to_dict",
]

MODEL_NAMES = ("mlp", "transformer_lm")
DATASETS = ("teacher_regression", "char_corpus")
FP16_TYPES = ("float16", "bfloat16", "cbfloat16", "float32")
OPTIMIZERS = ("SGD", "Adam", "AdamW")
SCHEDULERS = ("Constant", "Linear", "CosineDecay")
DEVICES = ("auto", "cpu", "cuda")
ACTIVATIONS = ("tanh", "relu", "gelu")
# Model Zoo's --load_checkpoint_states values, plus "rng" (the random-number generators, needed for bit-identity).
CHECKPOINT_STATES = ("model", "optimizer", "dataloader", "grad_scaler", "lr_scheduler", "global_step", "rng")
# Which data sets each model can train on.
MODEL_DATASETS = {"mlp": ("teacher_regression",), "transformer_lm": ("char_corpus",)}
# Keys that only matter for dynamic loss scaling.
DYNAMIC_KEYS = (
    "initial_loss_scale",
    "steps_per_increase",
    "min_loss_scale",
    "max_loss_scale",
    "overflow_tolerance",
    "growth_factor",
    "backoff_factor",
    "hysteresis",
)
# Every loss scale (static, initial, min, max) is a normal float32 whose inverse is finite.
MIN_LOSS_SCALE_BOUND = 2.0**-126
MAX_LOSS_SCALE_BOUND = 3.4028234663852886e38  # float32 max
_SCALE_RANGE = "a number in [2**-126, 3.4028234663852886e+38] (a normal float32 whose inverse is finite)"
INT64_MAX = 2**63 - 1
MAX_SEED = 2**32 - 1  # NumPy's seeds are 32-bit
# A config is small: the expanded YAML (aliases counted each time they are used) is bounded, so an alias bomb
# ("billion laughs") is rejected at once instead of filling the memory.
MAX_CONFIG_NODES = 100_000
MAX_CONFIG_BYTES = 1 << 20
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
}


class ConfigError(ValueError):
    """An invalid config. ``errors`` lists every problem found, each naming its key (``section.key``)."""

    def __init__(self, errors: Sequence[str], source: str | None = None) -> None:
        self.errors = list(errors)
        self.source = source
        where = f" in {source}" if source else ""
        if len(self.errors) == 1:
            message = f"invalid config{where}: {self.errors[0]}"
        else:
            message = f"invalid config{where} ({len(self.errors)} problems):\n" + "\n".join(
                f"  - {e}" for e in self.errors
            )
        super().__init__(message)


# ---------------------------------------------------------------------- YAML
class _Loader(yaml.SafeLoader):
    """PyYAML's SafeLoader, but ``1e-3`` and ``1e5`` are floats (YAML 1.2) rather than strings (YAML 1.1), and
    merge keys do not multiply: ``<<: [*a, *a]`` would otherwise repeat ``a``'s pairs, doubling them per level."""

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        super().flatten_mapping(node)
        # The same scalar key twice: one pair, at the first one's place, with the last one's value (as a dict
        # built from all the pairs would have).
        last: dict[Any, int] = {}
        for i, (key, _) in enumerate(node.value):
            last[(key.tag, key.value) if isinstance(key, yaml.ScalarNode) else id(key)] = i
        if len(last) < len(node.value):
            first: dict[Any, int] = {}
            for i, (key, _) in enumerate(node.value):
                first.setdefault((key.tag, key.value) if isinstance(key, yaml.ScalarNode) else id(key), i)
            node.value = [(node.value[i][0], node.value[last[k]][1]) for k, i in sorted(first.items(), key=_second)]


def _second(item: tuple[Any, int]) -> int:
    return item[1]


_FLOAT_RE = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+][0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)
_Loader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
for _first in list(_Loader.yaml_implicit_resolvers):
    _Loader.yaml_implicit_resolvers[_first] = [
        (tag, regexp) for tag, regexp in _Loader.yaml_implicit_resolvers[_first] if tag != "tag:yaml.org,2002:float"
    ]
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_RE, list("-+0123456789."))


def load_yaml(text: str, source: str = "<string>") -> Any:
    """Parse YAML text (floats like ``1e-3`` included). A syntax error, nesting too deep, a recursive alias or
    more than :data:`MAX_CONFIG_NODES` values once aliases are expanded is a :class:`ConfigError`."""
    try:
        data = yaml.load(text, Loader=_Loader)  # a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise ConfigError([f"not valid YAML: {exc}"], source) from None
    except RecursionError:
        raise ConfigError(["not a config: the YAML is nested too deeply"], source) from None
    check_size(data, source)
    return data


def check_size(data: Any, source: str | None = None) -> None:
    """Raise :class:`ConfigError` if ``data`` (parsed YAML, or a checkpoint's config) has more than
    :data:`MAX_CONFIG_NODES` values when shared parts (YAML aliases) are counted at each use, or contains itself.
    Takes time in the number of distinct containers, not in the expanded size."""
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(value: Any) -> int:
        if not isinstance(value, (dict, list, tuple)):
            return 1
        key = id(value)
        if key in sizes:
            return sizes[key]
        if key in active:
            raise ConfigError(
                ["a value contains itself (a recursive YAML alias); a config cannot be recursive"], source
            )
        active.add(key)
        items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
        total = 1
        for item in items:
            total += size(item)
            if total > MAX_CONFIG_NODES:
                break
        active.discard(key)
        sizes[key] = total
        return total

    try:
        total = size(data)
    except RecursionError:
        raise ConfigError(["not a config: it is nested too deeply"], source) from None
    if total > MAX_CONFIG_NODES:
        raise ConfigError(
            [
                f"the config expands to more than {MAX_CONFIG_NODES:,} values once its YAML aliases (*name) are "
                "expanded (an alias bomb?); a training config is far smaller"
            ],
            source,
        )


def parse_yaml_value(text: str) -> Any:
    """An override value: a YAML scalar or flow collection (``dynamic``, ``1e-3``, ``null``, ``[0.9, 0.99]``)."""
    if text.strip() == "":
        return ""
    return load_yaml(text, "<override>")


# ---------------------------------------------------------------------- dataclasses
@dataclass(frozen=True)
class ModelConfig:
    """``model:``. ``name`` picks the model; keys of the other model are rejected."""

    name: str = "mlp"
    loss_weight: float = 1.0
    hidden_size: int = 128
    depth: int = 3
    activation_fn: str = "tanh"
    dropout: float = 0.0
    num_hidden_layers: int = 2
    num_heads: int = 4
    filter_size: int = 256
    dropout_rate: float = 0.0
    max_position_embeddings: int = 256


@dataclass(frozen=True)
class DataConfig:
    """``data:`` (Model Zoo: ``train_input:``). Keys of the other data set are rejected."""

    dataset: str = "teacher_regression"
    batch_size: int = 64
    shuffle: bool = True
    shuffle_seed: int | None = None
    num_samples: int = 4096
    input_dim: int = 32
    output_dim: int = 64
    noise_std: float = 0.0
    dataset_seed: int = 1234
    max_sequence_length: int = 64


@dataclass(frozen=True)
class PrecisionConfig:
    """``precision:``. ``compute_dtype`` is what the run computes in: ``fp16_type`` with ``mixed_precision``,
    else float32."""

    fp16_type: str = "float16"
    mixed_precision: bool = False
    emulate: bool = False

    @property
    def compute_dtype(self) -> str:
        return self.fp16_type if self.mixed_precision else "float32"

    @property
    def emulated(self) -> bool:
        """Whether the run rounds through ``dls.emulate`` (always for cbfloat16) instead of ``torch.autocast``."""
        dtype = self.compute_dtype
        return dtype == "cbfloat16" or (self.emulate and dtype != "float32")


@dataclass(frozen=True)
class OptimizerConfig:
    """``optimizer:``: the optimizer, its learning rate (a number or a schedule) and the loss-scaling keys."""

    optimizer_type: str = "Adam"
    learning_rate: float | tuple[dict[str, Any], ...] = 1e-3
    momentum: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    loss_scaling_factor: str | float | None = None
    initial_loss_scale: float | None = None
    steps_per_increase: int = 2000
    min_loss_scale: float = 2.0**-14
    max_loss_scale: float | None = None
    overflow_tolerance: float = 0.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    hysteresis: int = 1
    max_gradient_norm: float | None = None
    max_gradient_value: float | None = None
    log_summaries: bool = False


@dataclass(frozen=True)
class RunConfig:
    """``runconfig:``."""

    max_steps: int = 100
    checkpoint_steps: int = 0
    keep_checkpoint_max: int = 5
    log_steps: int = 10
    model_dir: str = "model_dir"
    seed: int = 0
    device: str = "cpu"
    max_overflows_at_min_loss_scale: int = 10
    load_checkpoint_states: tuple[str, ...] | None = None


@dataclass(frozen=True)
class TrainConfig:
    """A validated config. ``warnings`` lists valid keys that have no effect in the chosen mode."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    runconfig: RunConfig = field(default_factory=RunConfig)
    warnings: tuple[str, ...] = ()


# ---------------------------------------------------------------------- key specs
_Check = Callable[[str, Any], tuple[Any, str | None]]


@dataclass(frozen=True)
class _Key:
    name: str
    check: _Check
    help: str
    only: tuple[str, ...] = ()  # applies only when the section's selector (model name, data set, ...) is one of these


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _int(minimum: int, nullable: bool = False, maximum: int = INT64_MAX) -> _Check:
    """An integer in ``[minimum, maximum]`` (an integral float such as ``1e3`` counts). Every integer key has a
    maximum: the counters and seeds they feed are fixed-width integers in torch and NumPy."""
    allowed = f">= {minimum}" if maximum == INT64_MAX else f"in [{minimum}, {maximum}]"

    def check(key: str, value: Any) -> tuple[Any, str | None]:
        if value is None and nullable:
            return None, None
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        null = " or null" if nullable else ""
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            return None, f"{key} must be an integer {allowed}{null}; got {value!r} ({_type_name(value)})"
        if value > maximum:
            return None, f"{key} must be an integer in [{minimum}, {maximum}]{null}; got {value!r}"
        return value, None

    return check


def _float(
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    nullable: bool = False,
) -> _Check:
    def describe() -> str:
        if low is not None and high is not None:
            return f"a number in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        if low is not None:
            return f"a number {'>' if low_open else '>='} {low:g}"
        return "a number"

    def check(key: str, value: Any) -> tuple[Any, str | None]:
        if value is None and nullable:
            return None, None
        null = " or null" if nullable else ""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return None, f"{key} must be {describe()}{null}; got {value!r} ({_type_name(value)})"
        v = float(value)
        bad_low = low is not None and (v <= low if low_open else v < low)
        bad_high = high is not None and (v >= high if high_open else v > high)
        if bad_low or bad_high:
            return None, f"{key} must be {describe()}{null}; got {value!r}"
        return v, None

    return check


def _bool(key: str, value: Any) -> tuple[Any, str | None]:
    if not isinstance(value, bool):
        return None, f"{key} must be true or false; got {value!r} ({_type_name(value)})"
    return value, None


def _str(key: str, value: Any) -> tuple[Any, str | None]:
    if not isinstance(value, str) or not value:
        return None, f"{key} must be a non-empty string; got {value!r} ({_type_name(value)})"
    return value, None


def _choice(choices: Sequence[str], case_insensitive: bool = False) -> _Check:
    def check(key: str, value: Any) -> tuple[Any, str | None]:
        if isinstance(value, str):
            for c in choices:
                if value == c or (case_insensitive and value.lower() == c.lower()):
                    return c, None
        allowed = ", ".join(repr(c) for c in choices)
        return None, f"{key} must be one of {allowed}; got {value!r}"

    return check


def _scale(nullable: bool = False) -> _Check:
    """A loss scale: a normal float32 whose inverse is a finite float32, i.e. in ``[2**-126, float32 max]``.
    Outside it the scale rounds to 0 or inf in float32, or ``1/scale`` overflows, and unscaled gradients become
    NaN without being flagged."""

    def check(key: str, value: Any) -> tuple[Any, str | None]:
        if value is None and nullable:
            return None, None
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not MIN_LOSS_SCALE_BOUND <= value <= MAX_LOSS_SCALE_BOUND:
            null = " or null" if nullable else ""
            return None, f"{key} must be {_SCALE_RANGE}{null}; got {value!r}"
        return float(value), None

    return check


def _loss_scaling_factor(key: str, value: Any) -> tuple[Any, str | None]:
    if value is None or value == "dynamic":
        return value, None
    if isinstance(value, str) and value.lower() == "dynamic":
        return "dynamic", None
    number, err = _scale()(key, value)
    if err:
        return None, f"{key} must be 'dynamic', null (the default) or a static scale: {_SCALE_RANGE}; got {value!r}"
    return number, None


def _betas(key: str, value: Any) -> tuple[Any, str | None]:
    if (
        isinstance(value, (list, tuple))
        and len(value) == 2
        and all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in value)
    ):
        return (float(value[0]), float(value[1])), None
    return None, f"{key} must be a list of two numbers in [0, 1), e.g. [0.9, 0.999]; got {value!r}"


_SCHEDULE_KEYS = {
    "Constant": ("learning_rate", "total_iters"),
    "Linear": ("initial_learning_rate", "end_learning_rate", "total_iters"),
    "CosineDecay": ("initial_learning_rate", "end_learning_rate", "total_iters"),
}


def _learning_rate(key: str, value: Any) -> tuple[Any, list[str]]:
    """A number, one scheduler dict, or a list of them (run one after another, as Model Zoo's sequential LR)."""
    number, err = _float(0.0)(key, value) if not isinstance(value, (dict, list)) else (None, "")
    if not isinstance(value, (dict, list)):
        if err:
            return None, [
                f"{key} must be a number >= 0 or a schedule (a dict with 'scheduler': one of "
                f"{', '.join(repr(s) for s in SCHEDULERS)}, or a list of them); got {value!r}"
            ]
        return number, []
    items = [value] if isinstance(value, dict) else value
    if not items:
        return None, [f"{key} must not be an empty list"]
    errors: list[str] = []
    schedule: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        path = key if isinstance(value, dict) else f"{key}[{i}]"
        if not isinstance(item, dict):
            errors.append(f"{path} must be a scheduler dict; got {item!r}")
            continue
        name, e = _choice(SCHEDULERS, case_insensitive=True)(f"{path}.scheduler", item.get("scheduler"))
        if e:
            errors.append(e)
            continue
        allowed = _SCHEDULE_KEYS[name]
        entry: dict[str, Any] = {"scheduler": name}
        for k, v in item.items():
            if k == "scheduler":
                continue
            if k not in allowed:
                errors.append(_unknown(f"{path}.{k}", k, allowed))
                continue
            checker = _int(1) if k == "total_iters" else _float(0.0)
            parsed, e = checker(f"{path}.{k}", v)
            if e:
                errors.append(e)
            entry[k] = parsed
        is_last = i == len(items) - 1
        # total_iters may be left out only by a Constant at the end (it then lasts to the end of training).
        required = [k for k in allowed if k != "total_iters" or not (is_last and name == "Constant")]
        for k in required:
            if k not in item:
                errors.append(f"{path}.{k} is required for scheduler {name!r}")
        schedule.append(entry)
    return (tuple(schedule) if not errors else None), errors


def _states(key: str, value: Any) -> tuple[Any, str | None]:
    if value is None:
        return None, None
    try:
        return parse_checkpoint_states(value), None
    except ValueError as exc:
        return None, f"{key}: {exc}"


_SECTION_KEYS: dict[str, tuple[_Key, ...]] = {
    "model": (
        _Key("name", _choice(MODEL_NAMES), "the model: 'mlp' (regression MLP) or 'transformer_lm' (character GPT)"),
        _Key("loss_weight", _float(0.0, low_open=True), "multiplies the training loss (logged loss is unweighted)"),
        _Key("hidden_size", _int(1), "width of the hidden layers / the model dimension"),
        _Key("depth", _int(1), "number of hidden layers", only=("mlp",)),
        _Key("activation_fn", _choice(ACTIVATIONS), "activation of the hidden layers", only=("mlp",)),
        _Key("dropout", _float(0.0, 1.0, high_open=True), "dropout probability after each activation", ("mlp",)),
        _Key("num_hidden_layers", _int(1), "number of transformer blocks", only=("transformer_lm",)),
        _Key("num_heads", _int(1), "attention heads (must divide hidden_size)", only=("transformer_lm",)),
        _Key("filter_size", _int(1), "width of the feed-forward layer of each block", only=("transformer_lm",)),
        _Key("dropout_rate", _float(0.0, 1.0, high_open=True), "dropout probability", only=("transformer_lm",)),
        _Key("max_position_embeddings", _int(1), "longest sequence the model accepts", only=("transformer_lm",)),
        _Key("mixed_precision", _bool, "alias of precision.mixed_precision (Model Zoo puts it here)"),
        _Key("fp16_type", _choice(FP16_TYPES), "alias of precision.fp16_type (Model Zoo puts it here)"),
    ),
    "data": (
        _Key("dataset", _choice(DATASETS), "generated teacher_regression, or the character corpus shipped with dls"),
        _Key("batch_size", _int(1), "samples (sequences) per step"),
        _Key("shuffle", _bool, "reshuffle the samples every epoch"),
        _Key(
            "shuffle_seed",
            _int(0, nullable=True, maximum=MAX_SEED),
            "seed of the sample order (default: runconfig.seed)",
        ),
        _Key("num_samples", _int(1), "samples in the generated data set", only=("teacher_regression",)),
        _Key("input_dim", _int(1), "features per sample", only=("teacher_regression",)),
        _Key("output_dim", _int(1), "regression targets per sample", only=("teacher_regression",)),
        _Key("noise_std", _float(0.0), "standard deviation of noise added to the targets", ("teacher_regression",)),
        _Key(
            "dataset_seed",
            _int(0, maximum=MAX_SEED),
            "seed that generates the data set (the teacher)",
            ("teacher_regression",),
        ),
        _Key("max_sequence_length", _int(1), "characters per training sequence", only=("char_corpus",)),
    ),
    "precision": (
        _Key("fp16_type", _choice(FP16_TYPES), "half format of mixed precision"),
        _Key("mixed_precision", _bool, "compute in fp16_type (false: everything in float32)"),
        _Key("emulate", _bool, "round with dls.emulate instead of torch.autocast (cbfloat16 always emulates)"),
    ),
    "optimizer": (
        _Key("optimizer_type", _choice(OPTIMIZERS, case_insensitive=True), "the torch optimizer"),
        _Key("learning_rate", _float(0.0), "a number, or a schedule: {scheduler: Linear|CosineDecay|Constant, ...}"),
        _Key("momentum", _float(0.0, 1.0, high_open=True), "SGD momentum", only=("SGD",)),
        _Key("weight_decay", _float(0.0), "weight decay (Model Zoo's legacy name weight_decay_rate also works)"),
        _Key("betas", _betas, "Adam/AdamW betas", only=("Adam", "AdamW")),
        _Key("eps", _float(0.0, low_open=True), "Adam/AdamW epsilon", only=("Adam", "AdamW")),
        _Key("loss_scaling_factor", _loss_scaling_factor, "'dynamic', a static scale, or null (precision default)"),
        _Key("initial_loss_scale", _scale(nullable=True), "first dynamic scale (default: max)"),
        _Key("steps_per_increase", _int(1, maximum=2**31 - 1), "clean steps before the dynamic scale grows"),
        _Key("min_loss_scale", _scale(), "floor of the dynamic scale"),
        _Key("max_loss_scale", _scale(nullable=True), "ceiling (2**15; 2**31 for cbfloat16)"),
        _Key("overflow_tolerance", _float(0.0, 1.0, high_open=True), "fraction of overflowing steps tolerated"),
        _Key("growth_factor", _float(1.0, low_open=True), "multiplies the scale when it grows"),
        _Key("backoff_factor", _float(0.0, 1.0, low_open=True, high_open=True), "multiplies the scale on overflow"),
        _Key("hysteresis", _int(1), "overflows needed for one back-off (DeepSpeed/Megatron)"),
        _Key("max_gradient_norm", _float(0.0, low_open=True, nullable=True), "clip the global gradient L2 norm"),
        _Key("max_gradient_value", _float(0.0, low_open=True, nullable=True), "clip each gradient element"),
        _Key("log_summaries", _bool, "also log gradient underflow statistics (slower)"),
    ),
    "runconfig": (
        _Key("max_steps", _int(1), "train until this global step"),
        _Key("checkpoint_steps", _int(0), "checkpoint every N steps (0: only at the end)"),
        _Key("keep_checkpoint_max", _int(1), "keep only the last N checkpoints"),
        _Key("log_steps", _int(1), "write metrics every N steps (skipped steps are always written)"),
        _Key("model_dir", _str, "directory for checkpoints, metrics.jsonl and plots.png"),
        _Key("seed", _int(0, maximum=MAX_SEED), "seed of model initialisation, data order and dropout"),
        _Key("device", _choice(DEVICES), "'cpu', 'cuda', or 'auto' (cuda when available)"),
        _Key("max_overflows_at_min_loss_scale", _int(1), "stop after N consecutive overflows at min_loss_scale"),
        _Key("load_checkpoint_states", _states, "with --resume: which states to load (default: all)"),
    ),
}
_SECTION_ALIASES = {"train_input": "data"}
_KEY_ALIASES: dict[str, dict[str, str]] = {"optimizer": {"weight_decay_rate": "weight_decay"}}
_SELECTORS = {"model": "name", "data": "dataset", "optimizer": "optimizer_type"}
_DATACLASSES: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "precision": PrecisionConfig,
    "optimizer": OptimizerConfig,
    "runconfig": RunConfig,
}
SECTIONS = tuple(_SECTION_KEYS)


def _unknown(path: str, key: str, allowed: Iterable[str]) -> str:
    allowed = list(allowed)
    hint = ""
    if key in _HINTS:
        hint = f" (did you mean {_HINTS[key]}?)"
    else:
        close = difflib.get_close_matches(key, allowed, n=1)
        if close:
            hint = f" (did you mean {close[0]!r}?)"
    return f"unknown key {path}{hint}; allowed keys: {', '.join(allowed)}"


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


# ---------------------------------------------------------------------- parsing
def load_config(path: str | Path, overrides: Sequence[str] = ()) -> TrainConfig:
    """Read a YAML config file, apply ``section.key=value`` overrides, validate. Raises :class:`ConfigError`."""
    return parse_config(read_config(path, overrides), source=str(path))


def read_config(path: str | Path, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The YAML config file ``path`` as a dict, with ``overrides`` applied, not validated yet. Raises
    :class:`ConfigError` naming the file when it cannot be read, is larger than 1 MiB, is not UTF-8 or not
    YAML."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError([f"cannot read config file: {exc.strerror or exc}"], str(p)) from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(
            [f"larger than {MAX_CONFIG_BYTES >> 20} MiB: not a YAML config (a checkpoint? see --resume)"], str(p)
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            [f"not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); save the config as UTF-8"], str(p)
        ) from None
    raw = load_yaml(text, str(p))
    if raw is None:
        raw = {}
    return apply_overrides(raw, overrides, source=str(p))


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
    seen_from: dict[str, str] = {}
    for name, body in raw.items():
        canonical = _SECTION_ALIASES.get(str(name), str(name))
        if canonical not in _SECTION_KEYS:
            close = difflib.get_close_matches(str(name), [*SECTIONS, *_SECTION_ALIASES], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            errors.append(f"unknown section {name}{hint}; allowed sections: {', '.join(SECTIONS)}")
            continue
        if canonical in seen_from:
            errors.append(f"give section {canonical!r} once: both {seen_from[canonical]!r} and {name!r} are present")
            continue
        seen_from[canonical] = name
        if body is None:
            continue
        if not isinstance(body, Mapping):
            errors.append(f"section {name} must be a mapping of keys; got {body!r}")
            continue
        aliases = _KEY_ALIASES.get(canonical, {})
        for key, value in body.items():
            target: str = aliases.get(key, key) if isinstance(key, str) else str(key)
            if target in sections[canonical]:
                errors.append(f"{name}.{key} and {name}.{target} are the same setting; give one")
                continue
            sections[canonical][target] = value

    values: dict[str, dict[str, Any]] = {}
    for name, given in sections.items():
        default_selector = None
        if name == "data":  # the data set defaults to the one the model trains on
            default_selector = MODEL_DATASETS.get(values["model"].get("name", ""), (None,))[0]
        values[name] = _check_section(name, seen_from.get(name, name), given, errors, default_selector)

    _move_precision_aliases(values, sections, errors)
    _check_combinations(values, errors, warnings)
    if errors:
        raise ConfigError(errors, source)
    built = {name: _DATACLASSES[name](**vals) for name, vals in values.items()}
    cfg = TrainConfig(**built, warnings=tuple(warnings))
    try:  # the keys are checked above; this makes sure the scaler accepts what the config accepts
        GradScaler(**grad_scaler_kwargs(cfg))
    except ValueError as exc:
        raise ConfigError([f"optimizer: the loss-scaling keys do not make a valid GradScaler: {exc}"], source) from None
    return cfg


def _check_section(
    name: str, shown: str, given: dict[str, Any], errors: list[str], default_selector: str | None = None
) -> dict[str, Any]:
    keys = {k.name: k for k in _SECTION_KEYS[name]}
    selector_key = _SELECTORS.get(name)
    defaults = {f.name: f.default for f in dataclasses.fields(_DATACLASSES[name])}
    selector = default_selector or (defaults.get(selector_key) if selector_key else None)
    if selector_key and selector_key in given:
        parsed, err = keys[selector_key].check(f"{shown}.{selector_key}", given[selector_key])
        selector = parsed if not err else None  # the error is reported below
    if name == "model" and "name" not in given:
        errors.append(f"{shown}.name is required; allowed values: {', '.join(MODEL_NAMES)}")
    out: dict[str, Any] = {}
    for key, value in given.items():
        path = f"{shown}.{key}"
        if not isinstance(key, str) or key not in keys:
            applicable = [k for k, spec in keys.items() if not spec.only or selector in spec.only]
            errors.append(_unknown(path, str(key), applicable))
            continue
        spec = keys[key]
        if key == "learning_rate":
            parsed, errs = _learning_rate(path, value)
            if errs:
                errors.extend(errs)
                continue
        else:
            parsed, err = spec.check(path, value)
            if err:
                errors.append(err)
                continue
        if spec.only and selector is not None and selector not in spec.only:
            what = {"model": "model.name", "data": "data.dataset", "optimizer": "optimizer.optimizer_type"}[name]
            errors.append(f"{path} applies only when {what} is {' or '.join(map(repr, spec.only))}; it is {selector!r}")
            continue
        out[key] = parsed
    return out


def _move_precision_aliases(
    values: dict[str, dict[str, Any]], sections: dict[str, dict[str, Any]], errors: list[str]
) -> None:
    model, precision = values["model"], values["precision"]
    for key in ("mixed_precision", "fp16_type"):
        if key not in model:
            continue
        alias = model.pop(key)
        if key in precision and precision[key] != alias:
            errors.append(
                f"model.{key} ({alias!r}) and precision.{key} ({precision[key]!r}) disagree; "
                f"give it in one place (precision.{key})"
            )
        precision[key] = alias


def _check_combinations(values: dict[str, dict[str, Any]], errors: list[str], warnings: list[str]) -> None:
    model, data, prec, opt, run = (values[s] for s in SECTIONS)
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

    mixed = prec.get("mixed_precision", False)
    fp16_type = prec.get("fp16_type", PrecisionConfig.fp16_type)
    if not mixed and prec.get("fp16_type") in ("float16", "bfloat16", "cbfloat16"):
        warnings.append(
            f"precision.fp16_type ({fp16_type!r}) has no effect: precision.mixed_precision is false, so the run "
            "computes in float32 (set mixed_precision: true to use it)"
        )
    compute = fp16_type if mixed else "float32"
    if prec.get("emulate") and compute == "float32":
        warnings.append("precision.emulate has no effect: the run computes in float32")

    factor = opt.get("loss_scaling_factor")
    mode = _mode(factor, compute)
    if compute == "cbfloat16" and mode != "dynamic":
        errors.append(f"optimizer.loss_scaling_factor must be 'dynamic' for cbfloat16 (as on Cerebras); got {factor!r}")
    if mode != "dynamic":
        why = (
            f"loss_scaling_factor is a static {factor:g}"
            if mode == "static"
            else f"loss scaling is off for {compute} (set optimizer.loss_scaling_factor: dynamic to use it)"
        )
        for key in DYNAMIC_KEYS:
            if key in opt:
                warnings.append(f"optimizer.{key} is ignored: {why}")
                opt.pop(key)
    else:
        low = opt.get("min_loss_scale", OptimizerConfig.min_loss_scale)
        high = opt.get("max_loss_scale")
        if high is None:
            high = CBFLOAT16_MAX_LOSS_SCALE if compute == "cbfloat16" else DEFAULT_MAX_LOSS_SCALE
        if low > high:
            errors.append(f"optimizer.min_loss_scale ({low:g}) must not exceed optimizer.max_loss_scale ({high:g})")
        init = opt.get("initial_loss_scale")
        if init is not None and init < low:
            errors.append(
                f"optimizer.initial_loss_scale ({init:g}) must not be below optimizer.min_loss_scale ({low:g})"
            )
    if opt.get("max_gradient_norm") is not None and opt.get("max_gradient_value") is not None:
        errors.append("give optimizer.max_gradient_norm or optimizer.max_gradient_value, not both")
    total = run.get("max_steps", RunConfig.max_steps)
    for key in ("checkpoint_steps", "log_steps"):
        if run.get(key, 0) > total:
            warnings.append(f"runconfig.{key} ({run[key]}) is larger than runconfig.max_steps ({total})")


def _mode(factor: Any, compute_dtype: str) -> str:
    if factor is None:
        return "dynamic" if compute_dtype in ("float16", "cbfloat16") else "off"
    return "dynamic" if factor == "dynamic" else "static"


# ---------------------------------------------------------------------- use
def loss_scaling_mode(cfg: TrainConfig) -> str:
    """``"dynamic"``, ``"static"`` or ``"off"``: what the config asks for once precision defaults apply."""
    return _mode(cfg.optimizer.loss_scaling_factor, cfg.precision.compute_dtype)


def grad_scaler_kwargs(cfg: TrainConfig) -> dict[str, Any]:
    """Keyword arguments of ``dls.GradScaler`` for this config (``enabled=False`` when loss scaling is off).

    ``max_gradient_norm`` is included: ``clip_gradients_and_return_isfinite`` of a scaler built from them clips to
    it (the trainer calls that explicitly, whether loss scaling is on or off). ``max_gradient_value`` is not a
    scaler setting (see ``dls.optimizer_step``).
    """
    opt = cfg.optimizer
    mode = loss_scaling_mode(cfg)
    kwargs: dict[str, Any] = {"max_gradient_norm": opt.max_gradient_norm}
    if mode == "off":
        return {"loss_scale": "dynamic", "enabled": False, **kwargs}
    if mode == "static":
        assert isinstance(opt.loss_scaling_factor, float)
        return {"loss_scale": opt.loss_scaling_factor, **kwargs}
    max_scale = opt.max_loss_scale
    if max_scale is None:
        is_cb = cfg.precision.compute_dtype == "cbfloat16"
        max_scale = CBFLOAT16_MAX_LOSS_SCALE if is_cb else DEFAULT_MAX_LOSS_SCALE
    return {
        "loss_scale": "dynamic",
        "init_scale": opt.initial_loss_scale,
        "steps_per_increase": opt.steps_per_increase,
        "min_loss_scale": opt.min_loss_scale,
        "max_loss_scale": max_scale,
        "overflow_tolerance": opt.overflow_tolerance,
        "growth_factor": opt.growth_factor,
        "backoff_factor": opt.backoff_factor,
        "hysteresis": opt.hysteresis,
        **kwargs,
    }


def to_dict(cfg: TrainConfig) -> dict[str, Any]:
    """The config as plain nested dicts/lists (YAML- and JSON-friendly) that ``parse_config`` reads back to the
    same config: keys that do not apply (the other model's sizes, dynamic-scaling keys without dynamic scaling,
    ``fp16_type`` without mixed precision) and ``warnings`` are left out."""

    def plain(value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    out: dict[str, Any] = {}
    for name in SECTIONS:
        section = getattr(cfg, name)
        selector_key = _SELECTORS.get(name)
        selector = getattr(section, selector_key) if selector_key else None
        only = {k.name: k.only for k in _SECTION_KEYS[name]}
        body = {}
        for f in dataclasses.fields(section):
            if f.name not in only or (only[f.name] and selector not in only[f.name]):
                continue
            if name == "model" and f.name in ("mixed_precision", "fp16_type"):
                continue
            body[f.name] = plain(getattr(section, f.name))
        out[name] = body
    if not cfg.precision.mixed_precision:
        out["precision"].pop("fp16_type")
    if loss_scaling_mode(cfg) != "dynamic":
        for key in DYNAMIC_KEYS:
            out["optimizer"].pop(key)
    return out


def describe_keys() -> str:
    """Every section and key with its default and meaning (``dls keys``)."""
    lines = []
    for name, keys in _SECTION_KEYS.items():
        alias = [a for a, c in _SECTION_ALIASES.items() if c == name]
        lines.append(f"{name}:" + (f"  (Model Zoo name {', '.join(alias)}: works too)" if alias else ""))
        defaults = {f.name: f.default for f in dataclasses.fields(_DATACLASSES[name])}
        for key in keys:
            default = defaults.get(key.name)
            if name == "model" and key.name == "name":
                shown = "(required)"
            elif key.name in ("mixed_precision", "fp16_type") and name == "model":
                shown = "-"
            elif isinstance(default, float):
                shown = f"{default:g}"
            elif isinstance(default, tuple):
                shown = "[" + ", ".join(f"{v:g}" for v in default) + "]"
            else:
                shown = (
                    "null" if default is None else str(default).lower() if isinstance(default, bool) else str(default)
                )
            only = f" [{'/'.join(key.only)} only]" if key.only else ""
            lines.append(f"  {key.name:<32} {shown:<19} {key.help}{only}")
    return "\n".join(lines)
