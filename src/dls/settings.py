"""What a loss scaler is configured to do: one frozen, validated object, built from either dialect.

``GradScaler`` speaks two dialects, and which one is decided by whether a device is given:

* **torch** (``GradScaler("cuda", init_scale=2.**16, growth_factor=2., backoff_factor=.5, growth_interval=2000)``,
  or any call with ``device=``): torch.amp's defaults — start at ``2**16``, no upper bound below float32's max (growth
  that would reach inf is dropped, as in torch), a floor at the smallest normal float32 — and dynamic scaling
  whatever the half dtype. It trains bit-identically to ``torch.amp.GradScaler`` until torch's own scale would
  leave float32's normal range.
* **cerebras** (``GradScaler(loss_scale="dynamic", init_scale=..., steps_per_increase=..., ...)``, no device):
  cstorch.amp's defaults — ``max_loss_scale`` ``2**15`` (``2**31`` for cbfloat16), start at the maximum, floor
  ``2**-14``, and ``loss_scale=None`` meaning dynamic for float16/cbfloat16 and off for bfloat16.

In both, an explicit ``init_scale`` above the default maximum raises the maximum (never a silent clamp), and an
explicit ``max_loss_scale`` below an explicit ``init_scale`` is an error naming both. Every scale is a normal
float32 (``2**-126`` to float32's max), so its inverse is finite and unscaling never multiplies by inf.

The trainer's YAML config builds the same object (``ScalerSettings.cerebras``) and re-labels each problem with
its YAML key, so ``dls validate`` accepts exactly what ``GradScaler`` accepts.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any

from dls.formats import HALF_DTYPE_NAMES, get_half_dtype_str, half_dtype_name
from dls.policy import (
    FLOAT32_MAX,
    FLOAT32_TINY,
    INT32_MAX,
    DynamicRule,
    StaticRule,
    count_problem,
    factor_problem,
    flag_problem,
    limit_problem,
    scale_problem,
    tolerance_problem,
)

MODES = ("dynamic", "static", "off")
DIALECTS = ("cerebras", "torch")
CEREBRAS_MAX_LOSS_SCALE = 2.0**15
CBFLOAT16_MAX_LOSS_SCALE = 2.0**31
CEREBRAS_MIN_LOSS_SCALE = 2.0**-14
TORCH_INIT_SCALE = 2.0**16
DEFAULT_STEPS_PER_INCREASE = 2000


class SettingsError(ValueError):
    """Invalid scaler settings. ``problems`` lists ``(argument, message)`` pairs, every message naming its
    argument, so a caller with other names for the arguments (the YAML config) can re-label them."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = list(problems)
        if len(self.problems) == 1:
            message = self.problems[0][1]
        else:
            message = "invalid GradScaler settings:\n" + "\n".join(f"  - {m}" for _, m in self.problems)
        super().__init__(message)


def default_max_loss_scale(half_dtype: str) -> float:
    """cstorch.amp's default ``max_loss_scale`` (and initial scale) for a half dtype.

    Args:
        half_dtype: ``"float16"``, ``"bfloat16"`` or ``"cbfloat16"``.
    """
    return CBFLOAT16_MAX_LOSS_SCALE if half_dtype == "cbfloat16" else CEREBRAS_MAX_LOSS_SCALE


@dataclass(frozen=True)
class ScalerSettings:
    """The resolved, validated settings of a loss scaler. Build it with
    [`cerebras`][dls.settings.ScalerSettings.cerebras] or [`torch`][dls.settings.ScalerSettings.torch], which fill in
    each dialect's defaults; constructing it directly validates the given values as they are.

    Attributes:
        mode: ``"dynamic"``, ``"static"`` (a fixed scale; overflowing steps are still skipped) or ``"off"``.
        init_scale: the first scale (the fixed scale in static mode).
        min_loss_scale, max_loss_scale: bounds of the dynamic scale.
        steps_per_increase: clean steps before the scale grows (torch's ``growth_interval``).
        growth_factor, backoff_factor, overflow_tolerance, hysteresis, consecutive_hysteresis: the dynamic rule
            (``dls.policy``; ``consecutive_hysteresis`` refills the hysteresis budget after every clean step, as
            DeepSpeed's knob of that name).
        max_gradient_norm: global gradient clipping inside ``step()``, or ``None``.
        half_dtype: ``"float16"``, ``"bfloat16"`` or ``"cbfloat16"``: the format the defaults were chosen for.
        dialect: ``"cerebras"`` or ``"torch"``: whose defaults, and whose growth timing (``growth_interval``).
    """

    mode: str
    init_scale: float
    min_loss_scale: float
    max_loss_scale: float
    steps_per_increase: int = DEFAULT_STEPS_PER_INCREASE
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    overflow_tolerance: float = 0.0
    hysteresis: int = 1
    max_gradient_norm: float | None = None
    half_dtype: str = "float16"
    dialect: str = "cerebras"
    consecutive_hysteresis: bool = False

    def __post_init__(self) -> None:
        problems = _problems(dataclasses.asdict(self))
        if problems:
            raise SettingsError(problems)
        for name in ("init_scale", "min_loss_scale", "max_loss_scale", "growth_factor", "backoff_factor"):
            object.__setattr__(self, name, float(getattr(self, name)))
        object.__setattr__(self, "overflow_tolerance", float(self.overflow_tolerance))
        if self.max_gradient_norm is not None:
            object.__setattr__(self, "max_gradient_norm", float(self.max_gradient_norm))

    # ------------------------------------------------------------------ dialects
    @classmethod
    def cerebras(
        cls,
        loss_scale: str | float | None = None,
        init_scale: float | None = None,
        steps_per_increase: int | None = None,
        min_loss_scale: float | None = None,
        max_loss_scale: float | None = None,
        overflow_tolerance: float = 0.0,
        max_gradient_norm: float | None = None,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        hysteresis: int = 1,
        half_dtype: Any = None,
        consecutive_hysteresis: bool = False,
    ) -> ScalerSettings:
        """cstorch.amp's dialect: ``loss_scale`` ``"dynamic"``, a number (static) or ``None`` (dynamic for
        float16/cbfloat16, off for bfloat16); ``max_loss_scale`` ``2**15`` (``2**31`` for cbfloat16), ``init_scale`` the
        maximum, ``min_loss_scale`` ``2**-14``. ``half_dtype`` ``None`` takes ``dls.get_half_dtype_str()``.

        Each argument means what it means for [`GradScaler`][dls.GradScaler].

        Args:
            loss_scale: ``"dynamic"``, a number (static) or ``None``.
            init_scale: the first dynamic scale.
            steps_per_increase: the scale grows when more updates than this passed since the last rescale.
            min_loss_scale: the lower bound of the dynamic scale.
            max_loss_scale: the upper bound of the dynamic scale.
            overflow_tolerance: fraction of overflowing steps tolerated before backing off.
            max_gradient_norm: global gradient clipping inside ``step()``, or ``None``.
            growth_factor: multiplies the scale on growth.
            backoff_factor: multiplies the scale on back-off.
            hysteresis: overflows per back-off (Megatron-LM's and DeepSpeed's rule).
            consecutive_hysteresis: a clean step also refills the hysteresis budget (DeepSpeed's).
            half_dtype: the format the defaults are chosen for.

        Raises:
            SettingsError: every problem with the arguments, each naming its argument.
        """
        problems: list[tuple[str, str]] = []
        half = _half_dtype(half_dtype, problems)
        mode = _mode(loss_scale, half, problems)
        if mode == "static":
            if init_scale is not None:
                problems.append(
                    ("init_scale", "init_scale applies to dynamic loss scaling; a static loss_scale is fixed")
                )
            start: Any = loss_scale
        else:
            start = init_scale
        default_max = default_max_loss_scale(half)
        if max_loss_scale is None:
            # An explicit init_scale above the default maximum raises the maximum: never a silent clamp.
            top: Any = start if mode == "dynamic" and _above(start, default_max) else default_max
        else:
            top = max_loss_scale
        return cls._build(
            problems,
            {"init_scale"} if start is None else set(),
            mode=mode,
            init_scale=top if start is None else start,
            min_loss_scale=CEREBRAS_MIN_LOSS_SCALE if min_loss_scale is None else min_loss_scale,
            max_loss_scale=top,
            steps_per_increase=DEFAULT_STEPS_PER_INCREASE if steps_per_increase is None else steps_per_increase,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            overflow_tolerance=overflow_tolerance,
            hysteresis=hysteresis,
            consecutive_hysteresis=consecutive_hysteresis,
            max_gradient_norm=max_gradient_norm,
            half_dtype=half,
            dialect="cerebras",
        )

    @classmethod
    def torch(
        cls,
        init_scale: float = TORCH_INIT_SCALE,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = DEFAULT_STEPS_PER_INCREASE,
        *,
        loss_scale: str | float = "dynamic",
        min_loss_scale: float | None = None,
        max_loss_scale: float | None = None,
        overflow_tolerance: float = 0.0,
        hysteresis: int = 1,
        consecutive_hysteresis: bool = False,
        max_gradient_norm: float | None = None,
        half_dtype: Any = None,
    ) -> ScalerSettings:
        """torch.amp's dialect: start at ``2**16``, grow every ``growth_interval`` clean steps up to float32's max,
        floor at the smallest normal float32; dynamic whatever the half dtype (``loss_scale`` may still name a
        static scale).

        Each argument means what it means for [`GradScaler`][dls.GradScaler].

        Args:
            init_scale: the first scale.
            growth_interval: the scale grows on this many-th clean step.
            loss_scale: ``"dynamic"`` or a number (static).
            min_loss_scale: the lower bound of the dynamic scale.
            max_loss_scale: the upper bound of the dynamic scale.
            overflow_tolerance: fraction of overflowing steps tolerated before backing off.
            max_gradient_norm: global gradient clipping inside ``step()``, or ``None``.
            growth_factor: multiplies the scale on growth.
            backoff_factor: multiplies the scale on back-off.
            hysteresis: overflows per back-off (Megatron-LM's and DeepSpeed's rule).
            consecutive_hysteresis: a clean step also refills the hysteresis budget (DeepSpeed's).
            half_dtype: the format the defaults are chosen for.

        Raises:
            SettingsError: every problem with the arguments, each naming its argument.
        """
        problems: list[tuple[str, str]] = []
        half = _half_dtype(half_dtype, problems)
        if loss_scale is None:
            loss_scale = "dynamic"
        mode = _mode(loss_scale, half, problems)
        start: Any = loss_scale if mode == "static" else init_scale
        return cls._build(
            problems,
            set(),
            mode=mode,
            init_scale=start,
            min_loss_scale=FLOAT32_TINY if min_loss_scale is None else min_loss_scale,
            max_loss_scale=FLOAT32_MAX if max_loss_scale is None else max_loss_scale,
            steps_per_increase=growth_interval,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            overflow_tolerance=overflow_tolerance,
            hysteresis=hysteresis,
            consecutive_hysteresis=consecutive_hysteresis,
            max_gradient_norm=max_gradient_norm,
            half_dtype=half,
            dialect="torch",
        )

    @classmethod
    def _build(cls, problems: list[tuple[str, str]], derived: set[str], **values: Any) -> ScalerSettings:
        """Construct, reporting the dialect's own ``problems`` together with those of the values. A value in
        ``derived`` was not given but follows another (``init_scale`` defaults to the maximum): a problem it has
        is reported under that other argument only."""
        named = {name for name, _ in problems}
        found = [p for p in _problems(values, skip=named) if p[0] not in named]
        if len(found) > 1:
            found = [p for p in found if p[0] not in derived] or found
        if problems or found:
            raise SettingsError(problems + found)
        return cls(**values)

    # ------------------------------------------------------------------ use
    def replace(self, **changes: Any) -> ScalerSettings:
        """A copy with ``changes`` applied and validated (``SettingsError`` names the argument)."""
        return dataclasses.replace(self, **changes)

    @property
    def growth_interval(self) -> int:
        """Updates since the last rescale after which the scale grows: torch.amp's ``growth_interval`` (torch dialect),
        ``steps_per_increase + 1`` (Cerebras dialect: cstorch.amp grows when ``steps_since_rescale >
        steps_per_increase``). What torch.amp is told in a state dict, so it follows the same trajectory."""
        return self.steps_per_increase + (self.dialect == "cerebras")

    def rule(self) -> DynamicRule | StaticRule:
        """The scale-update rule these settings describe (``off`` keeps the scale: a static rule)."""
        if self.mode != "dynamic":
            return StaticRule()
        return DynamicRule(
            growth_interval=self.growth_interval,
            consecutive_hysteresis=self.consecutive_hysteresis,
            growth_factor=self.growth_factor,
            backoff_factor=self.backoff_factor,
            overflow_tolerance=self.overflow_tolerance,
            hysteresis=self.hysteresis,
            min_loss_scale=self.min_loss_scale,
            max_loss_scale=self.max_loss_scale,
        )


def _problems(v: dict[str, Any], skip: set[str] | frozenset[str] = frozenset()) -> list[tuple[str, str]]:
    """Every problem of the settings values ``v``, as ``(argument, message)``; arguments in ``skip`` (already
    reported) are not checked again. In static mode the scale is the ``loss_scale`` argument."""
    out: list[tuple[str, str]] = []
    static = v["mode"] == "static"
    scale_name = "loss_scale" if static else "init_scale"
    spi_max = INT32_MAX - (v["dialect"] == "cerebras")  # the Cerebras growth interval is steps_per_increase + 1
    checks: list[tuple[str, str | None]] = [
        (
            "mode",
            None if v["mode"] in MODES else f"mode must be one of {', '.join(map(repr, MODES))}; got {v['mode']!r}",
        ),
        (
            "dialect",
            None if v["dialect"] in DIALECTS else f"dialect must be 'cerebras' or 'torch'; got {v['dialect']!r}",
        ),
        (scale_name, scale_problem(scale_name, v["init_scale"])),
        ("min_loss_scale", scale_problem("min_loss_scale", v["min_loss_scale"])),
        ("max_loss_scale", scale_problem("max_loss_scale", v["max_loss_scale"])),
        ("steps_per_increase", count_problem("steps_per_increase", v["steps_per_increase"], spi_max)),
        ("hysteresis", count_problem("hysteresis", v["hysteresis"])),
        ("consecutive_hysteresis", flag_problem("consecutive_hysteresis", v["consecutive_hysteresis"])),
        ("growth_factor", factor_problem("growth_factor", v["growth_factor"], above_one=True)),
        ("backoff_factor", factor_problem("backoff_factor", v["backoff_factor"], above_one=False)),
        ("overflow_tolerance", tolerance_problem("overflow_tolerance", v["overflow_tolerance"])),
        ("max_gradient_norm", limit_problem("max_gradient_norm", v["max_gradient_norm"])),
        (
            "half_dtype",
            None
            if v["half_dtype"] in HALF_DTYPE_NAMES
            else f"half_dtype must be one of {', '.join(map(repr, HALF_DTYPE_NAMES))}; got {v['half_dtype']!r}",
        ),
    ]
    out = [(name, problem) for name, problem in checks if problem is not None and name not in skip]
    bad = {name for name, _ in out} | set(skip)
    low, high, init = v["min_loss_scale"], v["max_loss_scale"], v["init_scale"]
    if not {"min_loss_scale", "max_loss_scale"} & bad and low > high:
        out.append(("min_loss_scale", f"min_loss_scale ({low!r}) must not exceed max_loss_scale ({high!r})"))
    elif v["mode"] == "dynamic" and not {"min_loss_scale", "max_loss_scale", "init_scale"} & bad:
        if init > high:
            out.append(("init_scale", f"init_scale ({init!r}) must not exceed max_loss_scale ({high!r})"))
        elif init < low:
            out.append(("init_scale", f"init_scale ({init!r}) must not be below min_loss_scale ({low!r})"))
    return out


def _above(value: Any, limit: float) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > limit


def _half_dtype(value: Any, problems: list[tuple[str, str]]) -> str:
    if value is None:
        return get_half_dtype_str()
    try:
        return half_dtype_name(value)
    except ValueError as exc:
        problems.append(("half_dtype", str(exc)))
        return "float16"


def _mode(loss_scale: Any, half_dtype: str, problems: list[tuple[str, str]]) -> str:
    if loss_scale is None:
        return "off" if half_dtype == "bfloat16" else "dynamic"
    if loss_scale == "dynamic":
        return "dynamic"
    if isinstance(loss_scale, str):
        close = difflib.get_close_matches(loss_scale.strip().lower(), ["dynamic"], n=1, cutoff=0.6)
        hint = " (did you mean 'dynamic'? only the lower-case spelling is accepted, as in cstorch.amp)" if close else ""
        problems.append(
            (
                "loss_scale",
                f"loss_scale must be 'dynamic', a number (a static scale) or None, or, torch.amp style, a device "
                f"such as 'cuda' or 'cpu' as the first argument; got {loss_scale!r}{hint}",
            )
        )
        return "dynamic"
    return "static"
