"""What a loss scaler is configured to do: one frozen, validated object, built from any dialect.

``GradScaler``'s constructor speaks two dialects; its arguments decide which (``dls.arguments``):

* **torch** (``GradScaler("cuda", init_scale=2.**16, growth_factor=2., backoff_factor=.5, growth_interval=2000)``,
  any call with a device, and any call without a Cerebras-only argument, ``GradScaler()`` included): torch.amp's
  defaults — device ``"cuda"``, start at ``2**16``, no upper bound below float32's max (growth that would reach inf is
  dropped, as in torch), a floor at the smallest normal float32 — and dynamic scaling whatever the half dtype. It
  trains bit-identically to ``torch.amp.GradScaler`` until torch's own scale would leave float32's normal range.
* **cerebras** (a call with ``loss_scale``, ``steps_per_increase``, ``min_loss_scale``, ``max_loss_scale``,
  ``overflow_tolerance`` or ``max_gradient_norm``, or a first positional argument that is not a device):
  cstorch.amp's defaults — ``max_loss_scale`` ``2**15`` (``2**31`` for cbfloat16), start at the maximum, floor
  ``2**-14``, and ``loss_scale=None`` meaning dynamic for float16/cbfloat16 and off for bfloat16.

Two more are built by their own constructors, with the peers' own names and defaults:
``GradScaler.from_deepspeed`` (**deepspeed**: DeepSpeed's ``fp16`` config section and its growth timing) and
``GradScaler.from_megatron`` (**megatron**: Megatron-LM's ``DynamicGradScaler`` arguments; torch's timing).

In the torch and Cerebras dialects, an explicit ``init_scale`` above the default maximum raises the maximum
(never a silent clamp), and an explicit ``max_loss_scale`` below an explicit ``init_scale`` is an error naming
both. Every scale is a normal float32 (``2**-126`` to float32's max), so its inverse is finite and unscaling never
multiplies by inf. A number may be a Python ``int`` or ``float``, a NumPy scalar or 0-dim array, or a 0-dim tensor;
a count (``steps_per_increase``/``growth_interval``, ``hysteresis``) must be an integer (``dls.checks.count_problem``).
Each dialect's defaults and growth timing are its row of ``dls.policy.PEERS``.

The trainer's YAML config builds the same object (``ScalerSettings.cerebras``) and re-labels each problem with
its YAML key, so ``dls validate`` accepts exactly what ``GradScaler`` accepts.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any

import torch

from dls.checks import (
    FLOAT32_MAX,
    FLOAT32_TINY,
    INT32_MAX,
    SHOWN_AT_MOST,
    count_problem,
    did_you_mean,
    factor_problem,
    flag_problem,
    limit_problem,
    python_flag,
    python_number,
    scale_problem,
    shown,
    tolerance_problem,
    unknown_names,
)
from dls.formats import HALF_DTYPE_NAMES, get_half_dtype_str, half_dtype_name
from dls.policy import PEERS, Rule, StaticRule

MODES = ("dynamic", "static", "off")
DIALECTS = tuple(PEERS)  # each dialect's defaults and growth timing: its row of dls.policy.PEERS
TORCH, CEREBRAS, DEEPSPEED, MEGATRON = (PEERS[name] for name in ("torch", "cerebras", "deepspeed", "megatron"))
KERAS, APEX, APEX_FP16_UTILS, FAIRSEQ, MXNET, COLOSSALAI, JMP = (
    PEERS[name] for name in ("keras", "apex", "apex_fp16_utils", "fairseq", "mxnet", "colossalai", "jmp")
)
TORCH_INIT_SCALE = TORCH["init_scale"]
# The fields that hold numbers (NumPy scalars and 0-dim tensors are taken as the Python numbers they stand for).
NUMBER_FIELDS = (
    "init_scale",
    "min_loss_scale",
    "max_loss_scale",
    "steps_per_increase",
    "growth_factor",
    "backoff_factor",
    "overflow_tolerance",
    "hysteresis",
    "max_gradient_norm",
    "stop_loss_scale",
)


class SettingsError(ValueError):
    """Invalid scaler settings. ``problems`` lists ``(argument, message)`` pairs, every message naming its
    argument, so a caller with other names for the arguments (the YAML config) can re-label them."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = list(problems)
        if len(self.problems) == 1:
            message = self.problems[0][1]
        else:  # the first few, then how many more (checks.listed's rule)
            lines = [f"  - {m}" for _, m in self.problems[:SHOWN_AT_MOST]]
            if len(self.problems) > SHOWN_AT_MOST:
                lines.append(f"  - and {len(self.problems) - SHOWN_AT_MOST:,} more")
            message = "invalid GradScaler settings:\n" + "\n".join(lines)
        super().__init__(message)


def default_max_loss_scale(half_dtype: str) -> float:
    """cstorch.amp's default ``max_loss_scale`` (and initial scale) for a half dtype.

    Args:
        half_dtype: ``"float16"``, ``"bfloat16"`` or ``"cbfloat16"``.
    """
    cbfloat16 = CEREBRAS.cbfloat16_max_loss_scale
    return cbfloat16 if half_dtype == "cbfloat16" and cbfloat16 is not None else CEREBRAS.max_loss_scale


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
        dialect: a name of ``dls.policy.PEERS`` (``"cerebras"``, ``"torch"``, ``"deepspeed"``, ``"megatron"``,
            ...): whose defaults, and whose rule and growth timing (``growth_interval``, ``dls.policy``).
        stop_loss_scale: fairseq's ``min_loss_scale``: a back-off to this scale or below is not made (fairseq stops
            training there; dls skips the step at the scale it had), or ``None``.
    """

    mode: str
    init_scale: float
    min_loss_scale: float
    max_loss_scale: float
    steps_per_increase: int = CEREBRAS.when_none["steps_per_increase"]
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    overflow_tolerance: float = 0.0
    hysteresis: int = 1
    max_gradient_norm: float | None = None
    half_dtype: str = "float16"
    dialect: str = "cerebras"
    consecutive_hysteresis: bool = False
    stop_loss_scale: float | None = None

    def __post_init__(self) -> None:
        problems = _problems(_plain({f.name: getattr(self, f.name) for f in dataclasses.fields(self)}))
        if problems:
            raise SettingsError(problems)
        for name in NUMBER_FIELDS:
            value = python_number(getattr(self, name))
            if value is not None:  # None: max_gradient_norm off
                whole = name in ("steps_per_increase", "hysteresis")
                object.__setattr__(self, name, int(value) if whole else float(value))
        object.__setattr__(self, "consecutive_hysteresis", python_flag(self.consecutive_hysteresis))

    # ------------------------------------------------------------------ dialects
    @classmethod
    def cerebras(
        cls,
        loss_scale: str | float | None = None,
        init_scale: float | None = None,
        steps_per_increase: int | None = None,
        min_loss_scale: float | None = None,
        max_loss_scale: float | None = None,
        overflow_tolerance: float = CEREBRAS["overflow_tolerance"],
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
            min_loss_scale=CEREBRAS.min_loss_scale if min_loss_scale is None else min_loss_scale,
            max_loss_scale=top,
            steps_per_increase=CEREBRAS.when_none["steps_per_increase"]
            if steps_per_increase is None
            else steps_per_increase,
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
        init_scale: float = TORCH["init_scale"],
        growth_factor: float = TORCH["growth_factor"],
        backoff_factor: float = TORCH["backoff_factor"],
        growth_interval: int = TORCH["growth_interval"],
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
            min_loss_scale=TORCH.min_loss_scale if min_loss_scale is None else min_loss_scale,
            max_loss_scale=TORCH.max_loss_scale if max_loss_scale is None else max_loss_scale,
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
    def deepspeed(
        cls,
        loss_scale: float = DEEPSPEED["loss_scale"],
        initial_scale_power: int = DEEPSPEED["initial_scale_power"],
        loss_scale_window: int = DEEPSPEED["loss_scale_window"],
        hysteresis: int = DEEPSPEED["hysteresis"],
        consecutive_hysteresis: bool = DEEPSPEED["consecutive_hysteresis"],
        min_loss_scale: float = DEEPSPEED["min_loss_scale"],
    ) -> ScalerSettings:
        """DeepSpeed's ``fp16`` config section, with its names and defaults: ``loss_scale`` 0 is dynamic scaling
        from ``2**initial_scale_power``, growing by 2 with DeepSpeed's timing (``dls.policy``) and backing off by half
        once ``hysteresis`` overflows spent the budget, down to ``min_loss_scale``, with no maximum below float32's
        (DeepSpeed has none); a positive ``loss_scale`` is a static scale. Problems name DeepSpeed's keys.

        Args:
            loss_scale: 0 for dynamic scaling, else a static scale.
            initial_scale_power: the first scale is ``2**initial_scale_power``.
            loss_scale_window: clean steps between growths (DeepSpeed's timing).
            hysteresis: overflows tolerated before a back-off.
            consecutive_hysteresis: a clean step also refills the hysteresis budget.
            min_loss_scale: the scale never backs off below it.
        """
        problems: list[tuple[str, str]] = []
        static = python_number(loss_scale)
        if static is None or not (static == 0 or FLOAT32_TINY <= static <= FLOAT32_MAX):
            problems.append(
                (
                    "loss_scale",
                    "loss_scale must be 0 (dynamic loss scaling) or a static scale from 2**-126 to float32's max "
                    f"3.4028e38; got {loss_scale!r}",
                )
            )
        power = python_number(initial_scale_power)
        if not (isinstance(power, int) and -126 <= power <= 127):
            problems.append(
                (
                    "initial_scale_power",
                    "initial_scale_power must be an integer from -126 to 127 (the first scale is "
                    f"2**initial_scale_power, a normal float32); got {initial_scale_power!r}",
                )
            )
        problems += _named(
            ("loss_scale_window", count_problem("loss_scale_window", loss_scale_window, INT32_MAX - 1)),
            ("hysteresis", count_problem("hysteresis", hysteresis)),
            ("consecutive_hysteresis", flag_problem("consecutive_hysteresis", consecutive_hysteresis)),
            ("min_loss_scale", scale_problem("min_loss_scale", min_loss_scale)),
        )
        floor = python_number(min_loss_scale)
        if not problems and static == 0 and 2.0 ** int(power) < float(floor):  # type: ignore[arg-type]
            problems.append(
                (
                    "initial_scale_power",
                    f"2**initial_scale_power ({2.0 ** int(power)!r}) must not be below min_loss_scale ({floor!r})",  # type: ignore[arg-type]
                )
            )
        if problems:
            raise SettingsError(problems)
        return cls(
            mode="dynamic" if static == 0 else "static",
            init_scale=2.0 ** int(power) if static == 0 else static,  # type: ignore[arg-type]
            min_loss_scale=min_loss_scale,
            max_loss_scale=DEEPSPEED.max_loss_scale,
            steps_per_increase=loss_scale_window,
            growth_factor=2.0,
            backoff_factor=0.5,
            hysteresis=hysteresis,
            consecutive_hysteresis=consecutive_hysteresis,
            half_dtype="float16",
            dialect="deepspeed",
        )

    @classmethod
    def megatron(
        cls,
        initial_scale: float,
        min_scale: float,
        growth_factor: float = MEGATRON["growth_factor"],
        backoff_factor: float = MEGATRON["backoff_factor"],
        growth_interval: int = MEGATRON["growth_interval"],
        hysteresis: int = MEGATRON["hysteresis"],
    ) -> ScalerSettings:
        """Megatron-LM's ``DynamicGradScaler(initial_scale, min_scale, growth_factor, backoff_factor,
        growth_interval, hysteresis)``, with the defaults of Megatron's command line for the last four; torch's
        growth timing, no maximum below float32's. The scales and factors are rounded to float32, as Megatron holds
        them (float32 tensors), so products round as Megatron's do. Problems name Megatron's arguments.

        Args:
            initial_scale: the first scale.
            min_scale: the scale never backs off below it.
            growth_factor: the factor of a growth.
            backoff_factor: the factor of a back-off.
            growth_interval: clean steps before the scale grows.
            hysteresis: overflows tolerated before a back-off (refilled by a growth).
        """
        problems = _named(
            ("initial_scale", scale_problem("initial_scale", initial_scale)),
            ("min_scale", scale_problem("min_scale", min_scale)),
            ("growth_factor", factor_problem("growth_factor", growth_factor, above_one=True)),
            ("backoff_factor", factor_problem("backoff_factor", backoff_factor, above_one=False)),
            ("growth_interval", count_problem("growth_interval", growth_interval)),
            ("hysteresis", count_problem("hysteresis", hysteresis)),
        )
        if not problems and python_number(min_scale) > python_number(initial_scale):  # type: ignore[operator]
            problems.append(
                ("min_scale", f"min_scale ({min_scale!r}) must not exceed initial_scale ({initial_scale!r})")
            )
        if problems:
            raise SettingsError(problems)
        given = {"growth_factor": growth_factor, "backoff_factor": backoff_factor}
        as_held = {
            name: float(torch.tensor(float(python_number(value)), dtype=torch.float32))  # type: ignore[arg-type]
            for name, value in {"initial_scale": initial_scale, "min_scale": min_scale, **given}.items()
        }
        for name, value in given.items():  # a factor within a hair of 1 is 1 in float32
            if factor_problem(name, as_held[name], above_one=name == "growth_factor"):
                problems.append(
                    (
                        name,
                        f"{name} is {as_held[name]!r} in float32, as Megatron holds it (given {value!r}): too close "
                        "to 1",
                    )
                )
        if problems:
            raise SettingsError(problems)
        return cls(
            mode="dynamic",
            init_scale=as_held["initial_scale"],
            min_loss_scale=as_held["min_scale"],
            max_loss_scale=MEGATRON.max_loss_scale,
            steps_per_increase=growth_interval,
            growth_factor=as_held["growth_factor"],
            backoff_factor=as_held["backoff_factor"],
            hysteresis=hysteresis,
            half_dtype="float16",
            dialect="megatron",
        )

    @classmethod
    def deepspeed_scaler(
        cls,
        init_scale: float = DEEPSPEED.constructor["init_scale"],
        scale_window: int = DEEPSPEED.constructor["scale_window"],
        min_scale: float = DEEPSPEED.constructor["min_scale"],
        delayed_shift: int = DEEPSPEED.constructor["delayed_shift"],
        consecutive_hysteresis: bool = DEEPSPEED.constructor["consecutive_hysteresis"],
        raise_error_at_min_scale: bool = DEEPSPEED.constructor["raise_error_at_min_scale"],
        dtype: Any = DEEPSPEED.constructor["dtype"],
    ) -> ScalerSettings:
        """DeepSpeed's ``DynamicLossScaler`` by its own arguments (deepspeed 0.19.8,
        ``runtime/fp16/loss_scaler.py:219-226``), defaulting to what ``CreateLossScaler`` passes from the ``fp16``
        section's defaults: the same rule as ``deepspeed`` (its ``fp16`` keys). ``delayed_shift`` is the hysteresis;
        ``raise_error_at_min_scale`` is taken but dls never raises (it keeps skipping at ``min_scale``); ``dtype``
        only shapes DeepSpeed's log messages. ``init_scale`` may be any normal float32, not only a power of two.

        Args:
            init_scale: the first scale.
            scale_window: clean steps between growths (DeepSpeed's timing).
            min_scale: the scale never backs off below it.
            delayed_shift: overflows tolerated before a back-off.
            consecutive_hysteresis: a clean step also refills the hysteresis budget.
            raise_error_at_min_scale: DeepSpeed raises at the minimum; dls keeps skipping.
            dtype: a torch dtype.
        """
        problems = _named(
            ("init_scale", scale_problem("init_scale", init_scale)),
            ("scale_window", count_problem("scale_window", scale_window, INT32_MAX - 1)),
            ("min_scale", scale_problem("min_scale", min_scale)),
            ("delayed_shift", count_problem("delayed_shift", delayed_shift)),
            ("consecutive_hysteresis", flag_problem("consecutive_hysteresis", consecutive_hysteresis)),
            ("raise_error_at_min_scale", flag_problem("raise_error_at_min_scale", raise_error_at_min_scale)),
            ("dtype", None if isinstance(dtype, torch.dtype) else f"dtype must be a torch dtype; got {dtype!r}"),
        )
        problems += _not_below("init_scale", init_scale, "min_scale", min_scale, problems)
        if problems:
            raise SettingsError(problems)
        return cls(
            mode="dynamic",
            init_scale=init_scale,
            min_loss_scale=min_scale,
            max_loss_scale=DEEPSPEED.max_loss_scale,
            steps_per_increase=scale_window,
            hysteresis=delayed_shift,
            consecutive_hysteresis=consecutive_hysteresis,
            dialect="deepspeed",
        )

    @classmethod
    def keras(
        cls, initial_scale: float = KERAS["initial_scale"], dynamic_growth_steps: int = KERAS["dynamic_growth_steps"]
    ) -> ScalerSettings:
        """Keras 3's ``LossScaleOptimizer(inner_optimizer, initial_scale, dynamic_growth_steps)`` (keras 3.15.1,
        ``keras/src/optimizers/loss_scale_optimizer.py:46-53``): the scale (a float32 variable) doubles on the
        ``dynamic_growth_steps``-th clean step since the last change and halves on an overflow, with no floor and no
        ceiling; dls keeps it within float32's normal range. ``dynamic=False`` is refused by Keras and unknown here.

        Args:
            initial_scale: the first scale.
            dynamic_growth_steps: clean steps before the scale doubles.
        """
        problems = _named(
            ("initial_scale", scale_problem("initial_scale", initial_scale)),
            ("dynamic_growth_steps", count_problem("dynamic_growth_steps", dynamic_growth_steps)),
        )
        if problems:
            raise SettingsError(problems)
        return cls(
            mode="dynamic",
            init_scale=_float32(initial_scale),
            min_loss_scale=KERAS.min_loss_scale,
            max_loss_scale=KERAS.max_loss_scale,
            steps_per_increase=dynamic_growth_steps,
            dialect="keras",
        )

    @classmethod
    def apex(
        cls,
        loss_scale: str | float = APEX["loss_scale"],
        init_scale: float = APEX["init_scale"],
        scale_factor: Any = APEX["scale_factor"],
        scale_window: int = APEX["scale_window"],
        min_loss_scale: float | None = APEX["min_loss_scale"],
        max_loss_scale: float = APEX["max_loss_scale"],
    ) -> ScalerSettings:
        """NVIDIA Apex amp's ``LossScaler(loss_scale, init_scale, scale_factor, scale_window, min_loss_scale,
        max_loss_scale)`` (Apex at tag 25.05, ``apex/amp/scaler.py:38-52``, ``197-217``; ``amp.initialize`` passes
        ``loss_scale``, ``min_loss_scale`` and ``max_loss_scale``). ``loss_scale="dynamic"`` (amp's O1/O2
        default) is dynamic; a number, or a string of one as ``amp.initialize`` reads it, is a static scale (Apex
        then checks nothing; dls still skips a non-finite step). The scale starts at ``min(max_loss_scale,
        init_scale)``, doubles on the ``scale_window``-th clean step since the last change (up to
        ``max_loss_scale``) and halves on an overflow (down to ``min_loss_scale`` if one is given: ``None`` or 0
        is none, as Apex's ``if self._min_loss_scale``). ``scale_factor`` is taken and ignored, as Apex ignores it
        (its factors of 2 are written out). A ``max_loss_scale`` past float32's range is float32's max.

        Args:
            loss_scale: ``"dynamic"`` or a static scale.
            init_scale: the first dynamic scale (clamped to ``max_loss_scale``).
            scale_factor: ignored, as in Apex.
            scale_window: clean steps before the scale doubles.
            min_loss_scale: the floor of the dynamic scale, or ``None``.
            max_loss_scale: the ceiling of the dynamic scale.
        """
        problems: list[tuple[str, str]] = []
        static = None if loss_scale == "dynamic" else _apex_number(loss_scale)
        if loss_scale != "dynamic" and (static is None or scale_problem("loss_scale", static)):
            problems.append(
                (
                    "loss_scale",
                    "loss_scale must be 'dynamic' or a static scale from 2**-126 to float32's max (a number, or a "
                    f"string of one, as amp.initialize takes it); got {loss_scale!r}",
                )
            )
        low = None if python_number(min_loss_scale) == 0 else min_loss_scale
        top = python_number(max_loss_scale)
        problems += _named(
            ("init_scale", scale_problem("init_scale", init_scale)),
            ("scale_window", count_problem("scale_window", scale_window)),
            ("min_loss_scale", None if low is None else scale_problem("min_loss_scale", low)),
            (
                "max_loss_scale",
                None
                if top is not None and top >= FLOAT32_TINY
                else f"max_loss_scale must be a number from 2**-126 up (float32's max where it is more); got "
                f"{max_loss_scale!r}",
            ),
        )
        if problems:
            raise SettingsError(problems)
        if static is not None:
            return cls(
                mode="static",
                init_scale=static,
                min_loss_scale=FLOAT32_TINY,
                max_loss_scale=FLOAT32_MAX,
                dialect="apex",
            )
        ceiling = min(float(top), FLOAT32_MAX)  # type: ignore[arg-type]
        start = min(ceiling, float(python_number(init_scale)))  # type: ignore[arg-type]  # line 47
        floor = APEX.min_loss_scale if low is None else low
        problems += _not_below("init_scale", start, "min_loss_scale", floor, problems)
        if problems:
            raise SettingsError(problems)
        return cls(
            mode="dynamic",
            init_scale=start,
            min_loss_scale=floor,
            max_loss_scale=ceiling,
            steps_per_increase=scale_window,
            dialect="apex",
        )

    @classmethod
    def apex_fp16_utils(
        cls,
        init_scale: float = APEX_FP16_UTILS["init_scale"],
        scale_factor: float = APEX_FP16_UTILS["scale_factor"],
        scale_window: int = APEX_FP16_UTILS["scale_window"],
    ) -> ScalerSettings:
        """Apex fp16_utils' ``DynamicLossScaler(init_scale, scale_factor, scale_window)`` (Apex at tag 25.05,
        ``apex/fp16_utils/loss_scaler.py:75-83``, ``115-123``): the scale grows by ``scale_factor`` when ``(cur_iter -
        last_overflow_iter) % scale_window == 0`` (the ``scale_window``-th clean step since the last overflow, then
        every ``scale_window``: torch's timing) and backs off to ``max(scale / scale_factor, 1)``, with no ceiling.
        At tag 25.05 ``FP16_Optimizer`` builds amp's ``LossScaler`` (``GradScaler.like("apex")``), not this class.

        Args:
            init_scale: the first scale, at least 1 (its floor: an overflow below it would set 1).
            scale_factor: the factor of a growth; a back-off divides by it.
            scale_window: clean steps before the scale grows.
        """
        problems = _named(
            ("init_scale", scale_problem("init_scale", init_scale)),
            ("scale_factor", factor_problem("scale_factor", scale_factor, above_one=True)),
            ("scale_window", count_problem("scale_window", scale_window)),
        )
        problems += _not_below("init_scale", init_scale, "its floor", APEX_FP16_UTILS.min_loss_scale, problems)
        if problems:
            raise SettingsError(problems)
        return cls(
            mode="dynamic",
            init_scale=init_scale,
            min_loss_scale=APEX_FP16_UTILS.min_loss_scale,
            max_loss_scale=APEX_FP16_UTILS.max_loss_scale,
            steps_per_increase=scale_window,
            growth_factor=scale_factor,
            backoff_factor=1 / float(python_number(scale_factor)),  # type: ignore[arg-type]
            dialect="apex_fp16_utils",
        )

    @classmethod
    def fairseq(
        cls,
        init_scale: float = FAIRSEQ["init_scale"],
        scale_factor: float = FAIRSEQ["scale_factor"],
        scale_window: int = FAIRSEQ["scale_window"],
        tolerance: float = FAIRSEQ["tolerance"],
        threshold: float | None = FAIRSEQ["threshold"],
        min_loss_scale: float = FAIRSEQ["min_loss_scale"],
    ) -> ScalerSettings:
        """The settings of fairseq's ``DynamicLossScaler(init_scale, scale_factor, scale_window, tolerance, threshold,
        min_loss_scale)`` (fairseq 0.12.2, ``fairseq/optim/dynamic_loss_scaler.py:8-26``; its rule:
        ``dls.policy.FairseqRule``). ``FP16Optimizer`` passes ``--fp16-init-scale`` (128),
        ``--fp16-scale-window`` (``2**14 / world size / update_freq`` when unset), ``--fp16-scale-tolerance``,
        ``--threshold-loss-scale`` and ``--min-loss-scale``. ``threshold`` floors a back-off;
        ``min_loss_scale`` is where fairseq stops training (a back-off to it or below raises
        ``FloatingPointError``): dls skips the step at the scale it had and goes on.

        Args:
            init_scale: the first scale.
            scale_factor: the factor of a growth; a back-off divides by it.
            scale_window: clean steps since the last overflow before the scale grows.
            tolerance: the fraction of overflowing iterations since the last rescale at which an overflow backs
                off (0: every overflow).
            threshold: the floor of a back-off, at most ``init_scale``, or ``None``.
            min_loss_scale: a back-off to this scale or below is not made.
        """
        stop = python_number(min_loss_scale)
        problems = _named(
            ("init_scale", scale_problem("init_scale", init_scale)),
            ("scale_factor", factor_problem("scale_factor", scale_factor, above_one=True)),
            ("scale_window", count_problem("scale_window", scale_window)),
            ("tolerance", tolerance_problem("tolerance", tolerance)),
            ("threshold", None if threshold is None else scale_problem("threshold", threshold)),
            (
                "min_loss_scale",
                None
                if stop is not None and 0 <= stop <= FLOAT32_MAX
                else f"min_loss_scale must be a number from 0 to float32's max; got {min_loss_scale!r}",
            ),
        )
        if threshold is not None:
            problems += _not_below("init_scale", init_scale, "threshold", threshold, problems)
        if problems:
            raise SettingsError(problems)
        return cls(
            mode="dynamic",
            init_scale=init_scale,
            min_loss_scale=FAIRSEQ.min_loss_scale if threshold is None else threshold,
            max_loss_scale=FAIRSEQ.max_loss_scale,
            steps_per_increase=scale_window,
            growth_factor=scale_factor,
            backoff_factor=1 / float(python_number(scale_factor)),  # type: ignore[arg-type]
            overflow_tolerance=tolerance,
            stop_loss_scale=stop,
            dialect="fairseq",
        )

    @classmethod
    def mxnet(cls) -> ScalerSettings:
        """MXNet AMP's ``LossScaler()`` (mxnet 1.9.1, ``mxnet/contrib/amp/loss_scaler.py:34-39``): no arguments;
        it starts at ``2**16``, doubles after 2000 clean steps up to ``2**24``, halves on an overflow with no floor
        (dls's: the smallest normal float32), and commits each new scale one update late
        (``dls.policy.MxnetRule``)."""
        return cls(
            mode="dynamic",
            init_scale=MXNET.fixed["init_scale"],
            min_loss_scale=MXNET.min_loss_scale,
            max_loss_scale=MXNET.max_loss_scale,
            steps_per_increase=MXNET.fixed["steps_per_increase"],
            dialect="mxnet",
        )

    @classmethod
    def colossalai(
        cls,
        initial_scale: float = COLOSSALAI["initial_scale"],
        growth_factor: float = COLOSSALAI["growth_factor"],
        backoff_factor: float = COLOSSALAI["backoff_factor"],
        growth_interval: int = COLOSSALAI["growth_interval"],
        min_scale: float | None = COLOSSALAI["min_scale"],
        max_scale: float | None = COLOSSALAI["max_scale"],
        hysteresis: int = COLOSSALAI["hysteresis"],
        verbose: bool = COLOSSALAI["verbose"],
    ) -> ScalerSettings:
        """ColossalAI's ``DynamicGradScaler(initial_scale, growth_factor, backoff_factor, growth_interval, min_scale,
        max_scale, hysteresis, verbose)`` (colossalai 0.5.0,
        ``colossalai/amp/naive_amp/grad_scaler/dynamic_grad_scaler.py:29-76``): torch's timing; the
        ``hysteresis``-th overflow since the last growth backs off, and so does every later one until the next
        growth (``hysteresis=0`` acts as 1, as there); ``min_scale``/``max_scale`` ``None`` (or 0) are none. Its
        scale, bounds and factors are float32 tensors: rounded to float32 here, so products round as there; a
        ``max_scale`` past float32's range is none. ``verbose`` only logs there. Its booster plugins pass
        ``min_scale=1`` and ``max_scale=2**32``.

        Args:
            initial_scale: the first scale.
            growth_factor: the factor of a growth.
            backoff_factor: the factor of a back-off.
            growth_interval: clean steps before the scale grows.
            min_scale: the floor, or ``None``.
            max_scale: the ceiling, or ``None``.
            hysteresis: overflows since the last growth before the scale backs off.
            verbose: taken and not used (ColossalAI's logging).
        """
        low = None if python_number(min_scale) == 0 else min_scale
        high = None if python_number(max_scale) == 0 else max_scale
        count = python_number(hysteresis)
        problems = _named(
            ("initial_scale", scale_problem("initial_scale", initial_scale)),
            ("growth_factor", factor_problem("growth_factor", growth_factor, above_one=True)),
            ("backoff_factor", factor_problem("backoff_factor", backoff_factor, above_one=False)),
            ("growth_interval", count_problem("growth_interval", growth_interval)),
            ("min_scale", None if low is None else scale_problem("min_scale", low)),
            (
                "max_scale",
                None
                if high is None or (python_number(high) or 0) >= FLOAT32_TINY
                else f"max_scale must be None or a number from 2**-126 up; got {max_scale!r}",
            ),
            (
                "hysteresis",
                None
                if isinstance(count, int) and 0 <= count <= INT32_MAX
                else f"hysteresis must be an integer from 0 to 2**31 - 1 (0 acts as 1); got {hysteresis!r}",
            ),
            ("verbose", flag_problem("verbose", verbose)),
        )
        if problems:
            raise SettingsError(problems)
        held = {
            name: _float32(value)
            for name, value in (
                ("initial_scale", initial_scale),
                ("growth_factor", growth_factor),
                ("backoff_factor", backoff_factor),
            )
        }
        floor = COLOSSALAI.min_loss_scale if low is None else _float32(low)
        ceiling = COLOSSALAI.max_loss_scale if high is None else min(_float32(high), FLOAT32_MAX)
        problems += _not_below("initial_scale", held["initial_scale"], "min_scale", floor, problems)
        if held["initial_scale"] > ceiling:
            problems.append(("max_scale", f"max_scale ({max_scale!r}) must not be below initial_scale"))
        for name in ("growth_factor", "backoff_factor"):  # a factor within a hair of 1 is 1 in float32
            if factor_problem(name, held[name], above_one=name == "growth_factor"):
                problems.append((name, f"{name} is {held[name]!r} in float32, as ColossalAI holds it: too close to 1"))
        if problems:
            raise SettingsError(problems)
        return cls(
            mode="dynamic",
            init_scale=held["initial_scale"],
            min_loss_scale=floor,
            max_loss_scale=ceiling,
            steps_per_increase=growth_interval,
            growth_factor=held["growth_factor"],
            backoff_factor=held["backoff_factor"],
            hysteresis=max(int(count), 1),  # type: ignore[arg-type]
            dialect="colossalai",
        )

    @classmethod
    def jmp(
        cls,
        loss_scale: float,
        counter: int = JMP["counter"],
        period: int = JMP["period"],
        factor: float = JMP["factor"],
        min_loss_scale: float = JMP["min_loss_scale"],
    ) -> ScalerSettings:
        """The settings of jmp's ``DynamicLossScale(loss_scale, counter, period, factor, min_loss_scale)`` (jmp 0.0.4,
        ``jmp/_src/loss_scale.py:118-124``, ``149-174``): the scale (float32) grows by ``factor`` when ``counter ==
        period - 1`` unless that would be inf, and backs off to ``max(min_loss_scale, scale / factor)``; an overflow
        resets the counter. ``counter`` is the starting count (0 to ``period - 1``), which ``GradScaler.like``
        loads; the settings do not hold it. A ``min_loss_scale`` below ``2**-126`` (0 included) is ``2**-126``, dls's
        floor. Its docstring says ``max(1, loss_scale / factor)``; the code uses ``min_loss_scale``, and so does dls
        (under ``jax.jit`` jmp's pytree flattening drops it, and 1 applies there).

        Args:
            loss_scale: the first scale (jmp requires it).
            counter: clean steps already counted towards the first growth.
            period: clean steps before the scale grows.
            factor: the factor of a growth; a back-off divides by it.
            min_loss_scale: the floor.
        """
        floor = python_number(min_loss_scale)
        steps, counted = python_number(period), python_number(counter)
        problems = _named(
            ("loss_scale", scale_problem("loss_scale", loss_scale)),
            ("period", count_problem("period", period)),
            ("factor", factor_problem("factor", factor, above_one=True)),
            (
                "min_loss_scale",
                None
                if floor is not None and 0 <= floor <= FLOAT32_MAX
                else f"min_loss_scale must be a number from 0 to float32's max; got {min_loss_scale!r}",
            ),
        )
        if not any(name == "period" for name, _ in problems) and not (
            isinstance(counted, int) and 0 <= counted < steps  # type: ignore[operator]
        ):
            problems.append(
                ("counter", f"counter must be an integer from 0 to period - 1 ({period!r} - 1); got {counter!r}")
            )
        if problems:
            raise SettingsError(problems)
        low = max(_float32(floor), JMP.min_loss_scale)
        problems += _not_below("loss_scale", _float32(loss_scale), "min_loss_scale", low, problems)
        if problems:
            raise SettingsError(problems)
        return cls(
            mode="dynamic",
            init_scale=_float32(loss_scale),
            min_loss_scale=low,
            max_loss_scale=JMP.max_loss_scale,
            steps_per_increase=period,
            growth_factor=factor,
            backoff_factor=1 / float(python_number(factor)),  # type: ignore[arg-type]
            dialect="jmp",
        )

    @classmethod
    def like(cls, peer: str, **arguments: Any) -> ScalerSettings:
        """The settings of ``peer``'s loss scaler, from its own constructor's arguments (its names, its defaults):
        a name of ``dls.policy.PEERS`` (``"torch"``, ``"cerebras"``, ``"deepspeed"``: its ``fp16`` config section's
        keys or its ``DynamicLossScaler``'s arguments, ``"megatron"``, ``"keras"``, ``"apex"``,
        ``"apex_fp16_utils"``, ``"fairseq"``, ``"mxnet"``, ``"colossalai"``, ``"jmp"``), built by the classmethod of
        that name (``deepspeed_scaler`` for DeepSpeed's class arguments).

        Args:
            peer: the peer's name.
            **arguments: the peer's own arguments; the others take its defaults.

        Raises:
            ValueError: an unknown peer, an argument the peer does not take (each with the closest name), or a
                required one missing.
            SettingsError: a bad value, named as the peer names it.
        """
        row = PEERS.get(peer) if isinstance(peer, str) else None
        if row is None:
            hint = did_you_mean(peer, PEERS)
            raise ValueError(f"peer must be one of {', '.join(map(repr, PEERS))}; got {shown(peer)}{hint}")
        # DeepSpeed: its fp16 keys (row.defaults) or its DynamicLossScaler's arguments (row.constructor), not both.
        own = [name for name in arguments if name in row.constructor and name not in row.defaults]
        keys = row.constructor if own else row.defaults
        known = list(row.defaults) + [name for name in row.constructor if name not in row.defaults]
        problems = []
        unknown = [name for name in arguments if name not in known]
        if unknown:
            takes = ", ".join(row.defaults) or "no arguments"
            if row.constructor:
                takes += f" (its config's keys) or {', '.join(row.constructor)} (its scaler class's)"
            what = f"{len(unknown):,} arguments it does not take:" if len(unknown) > 1 else "no argument"
            names = unknown_names(unknown, known)
            problems.append((unknown[0], f"{peer}'s scaler has {what} {names}; it takes {takes}"))
        for name in arguments:
            if name in known and name not in keys:
                problems.append(
                    (
                        name,
                        f"{peer}'s scaler takes its config's keys or its class's arguments, not both: {name!r} is a "
                        f"config key, {', '.join(map(repr, own))} the class's",
                    )
                )
        problems += [
            (name, f"{peer}'s scaler requires {name} (e.g. {row[name]!r})")
            for name in row.required
            if name not in arguments
        ]
        if problems:
            raise SettingsError(problems)
        build: Any = getattr(cls, f"{peer}_scaler" if own else peer)
        return build(**arguments)

    @classmethod
    def _build(cls, problems: list[tuple[str, str]], derived: set[str], **values: Any) -> ScalerSettings:
        """Construct, reporting the dialect's own ``problems`` together with those of the values. A value in
        ``derived`` was not given but follows another (``init_scale`` defaults to the maximum): a problem it has
        is reported under that other argument only."""
        named = {name for name, _ in problems}
        found = [p for p in _problems(_plain(values), skip=named) if p[0] not in named]
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
        """Updates since the last rescale after which the scale grows: torch.amp's ``growth_interval`` (torch and
        Megatron dialects), ``steps_per_increase + 1`` (Cerebras dialect: cstorch.amp grows when
        ``steps_since_rescale > steps_per_increase``; DeepSpeed dialect: the first growth after an overflow comes on
        the ``(loss_scale_window + 1)``-th clean update, later ones every window, see ``dls.policy``). What
        torch.amp is told in a state dict, so it follows the same trajectory to the next growth."""
        return self.steps_per_increase + self.growth_offset

    @property
    def growth_offset(self) -> int:
        """``growth_interval - steps_per_increase``: 1 in the Cerebras and DeepSpeed dialects, else 0 (the dialect's
        row of ``dls.policy.PEERS``)."""
        return PEERS[self.dialect].growth_offset

    def rule(self) -> Rule:
        """The scale-update rule these settings describe: the dialect's (``dls.policy.PEERS``); a static scale,
        and ``off``, keep the scale (``StaticRule``)."""
        if self.mode != "dynamic":
            return StaticRule(self.hysteresis)
        return PEERS[self.dialect].rule(self)


def _problems(v: dict[str, Any], skip: set[str] | frozenset[str] = frozenset()) -> list[tuple[str, str]]:
    """Every problem of the settings values ``v``, as ``(argument, message)``; arguments in ``skip`` (already
    reported) are not checked again. In static mode the scale is the ``loss_scale`` argument."""
    out: list[tuple[str, str]] = []
    static = v["mode"] == "static"
    scale_name = "loss_scale" if static else "init_scale"
    peer = PEERS.get(v["dialect"]) if isinstance(v["dialect"], str) else None
    spi_max = INT32_MAX - (peer.growth_offset if peer else 0)  # growth_interval fits int32 too
    checks: list[tuple[str, str | None]] = [
        (
            "mode",
            None if v["mode"] in MODES else f"mode must be one of {', '.join(map(repr, MODES))}; got {v['mode']!r}",
        ),
        (
            "dialect",
            None
            if v["dialect"] in DIALECTS
            else f"dialect must be one of {', '.join(map(repr, DIALECTS))}; got {v['dialect']!r}",
        ),
        (scale_name, scale_problem(scale_name, v["init_scale"])),
        ("min_loss_scale", scale_problem("min_loss_scale", v["min_loss_scale"])),
        ("max_loss_scale", scale_problem("max_loss_scale", v["max_loss_scale"])),
        ("steps_per_increase", count_problem(interval_name(v["dialect"]), v["steps_per_increase"], spi_max)),
        ("hysteresis", count_problem("hysteresis", v["hysteresis"])),
        ("consecutive_hysteresis", flag_problem("consecutive_hysteresis", v["consecutive_hysteresis"])),
        ("growth_factor", factor_problem("growth_factor", v["growth_factor"], above_one=True)),
        ("backoff_factor", factor_problem("backoff_factor", v["backoff_factor"], above_one=False)),
        ("overflow_tolerance", tolerance_problem("overflow_tolerance", v["overflow_tolerance"])),
        ("max_gradient_norm", limit_problem("max_gradient_norm", v["max_gradient_norm"])),
        ("stop_loss_scale", _stop_problem(v.get("stop_loss_scale"))),
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


def _stop_problem(value: Any) -> str | None:
    number = python_number(value)
    if value is None or (number is not None and 0 <= number <= FLOAT32_MAX):
        return None
    return f"stop_loss_scale must be None or a number from 0 to float32's max 3.4028e38; got {value!r}"


def interval_name(dialect: str) -> str:
    """What the dialect's users call ``steps_per_increase``.

    Args:
        dialect: ``"torch"``, ``"cerebras"``, ``"deepspeed"`` or ``"megatron"``.
    """
    peer = PEERS.get(dialect) if isinstance(dialect, str) else None
    return peer.interval if peer else "steps_per_increase"


def _named(*checks: tuple[str, str | None]) -> list[tuple[str, str]]:
    return [(name, problem) for name, problem in checks if problem is not None]


def _not_below(
    name: str, value: Any, floor_name: str, floor: Any, problems: list[tuple[str, str]]
) -> list[tuple[str, str]]:
    """``[(name, message)]`` when the start ``value`` is below ``floor`` (neither already named in ``problems``)."""
    if any(n in (name, floor_name) for n, _ in problems):
        return []
    low, start = python_number(floor), python_number(value)
    if low is None or start is None or start >= low:
        return []
    return [(name, f"{name} ({value!r}) must not be below {floor_name} ({floor!r})")]


def _float32(value: Any) -> float:
    """``value`` as a float32 holds it (the peers whose scales are float32 tensors): a float past float32's range
    is inf there."""
    return float(torch.tensor(float(python_number(value)), dtype=torch.float32))  # type: ignore[arg-type]


def _apex_number(value: Any) -> float | None:
    """A static ``loss_scale`` as ``amp.initialize`` reads it (``float(value)``: a number or a string of one)."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    number = python_number(value)
    return None if number is None else float(number)


def _above(value: Any, limit: float) -> bool:
    number = python_number(value)
    return number is not None and number > limit


def _plain(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with every number of ``NUMBER_FIELDS`` as the Python number it stands for (others as given, for
    the messages)."""
    out = dict(values)
    for name in NUMBER_FIELDS:
        number = python_number(out.get(name))
        if number is not None:
            out[name] = number
    return out


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
    if isinstance(loss_scale, str) and loss_scale == "dynamic":
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
