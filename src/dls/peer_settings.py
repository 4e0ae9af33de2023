"""The settings of the field's other loss scalers, from each one's own arguments: DeepSpeed (its ``fp16`` config
section and its ``DynamicLossScaler``), Megatron-LM, Keras, Apex (amp and fp16_utils), fairseq, MXNet, ColossalAI and
jmp. Each builder checks its peer's arguments, names a problem as that peer names the argument, and maps them onto
the fields of :class:`dls.settings.ScalerSettings`, whose classmethods they are (``ScalerSettings.deepspeed(...)``,
``ScalerSettings.like("megatron", ...)``, ``GradScaler.like(...)``). GradScaler's own two dialects, torch.amp's and
cstorch.amp's, and the settings object itself are ``dls.settings``; each peer's defaults and timing are its row of
``dls.policy.PEERS``. A new peer's arguments are a builder here."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from dls.checks import (
    FLOAT32_MAX,
    FLOAT32_TINY,
    INT32_MAX,
    SettingsError,
    count_problem,
    factor_problem,
    flag_problem,
    python_number,
    scale_problem,
    tolerance_problem,
)
from dls.policy import PEERS

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11

DEEPSPEED, MEGATRON, KERAS, APEX, APEX_FP16_UTILS, FAIRSEQ, MXNET, COLOSSALAI, JMP = (
    PEERS[name]
    for name in ("deepspeed", "megatron", "keras", "apex", "apex_fp16_utils", "fairseq", "mxnet", "colossalai", "jmp")
)


class PeerSettings:
    """The builders of :class:`dls.settings.ScalerSettings` from the other peers' arguments (its base class: each
    is a classmethod of ``ScalerSettings``)."""

    if TYPE_CHECKING:  # what ScalerSettings, the only subclass, gives its builders

        def __init__(self, **values: Any) -> None: ...

        @classmethod
        def _build(cls, problems: list[tuple[str, str]], derived: set[str], **values: Any) -> Self: ...

    @classmethod
    def deepspeed(
        cls,
        loss_scale: float = DEEPSPEED["loss_scale"],
        initial_scale_power: int = DEEPSPEED["initial_scale_power"],
        loss_scale_window: int = DEEPSPEED["loss_scale_window"],
        hysteresis: int = DEEPSPEED["hysteresis"],
        consecutive_hysteresis: bool = DEEPSPEED["consecutive_hysteresis"],
        min_loss_scale: float = DEEPSPEED["min_loss_scale"],
    ) -> Self:
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
    ) -> Self:
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
    ) -> Self:
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
    ) -> Self:
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
    ) -> Self:
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
    ) -> Self:
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
    ) -> Self:
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
    def mxnet(cls) -> Self:
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
    ) -> Self:
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
    ) -> Self:
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
