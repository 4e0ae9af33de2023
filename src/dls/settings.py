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
    count_problem,
    factor_problem,
    flag_problem,
    limit_problem,
    python_number,
    scale_problem,
    tolerance_problem,
)
from dls.formats import HALF_DTYPE_NAMES, get_half_dtype_str, half_dtype_name
from dls.policy import PEERS, Rule, StaticRule

MODES = ("dynamic", "static", "off")
DIALECTS = tuple(PEERS)  # each dialect's defaults and growth timing: its row of dls.policy.PEERS
TORCH, CEREBRAS, DEEPSPEED, MEGATRON = (PEERS[name] for name in ("torch", "cerebras", "deepspeed", "megatron"))
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
)


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
        dialect: ``"cerebras"``, ``"torch"``, ``"deepspeed"`` or ``"megatron"``: whose defaults, and whose growth
            timing (``growth_interval``, ``dls.policy``).
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

    def __post_init__(self) -> None:
        problems = _problems(_plain({f.name: getattr(self, f.name) for f in dataclasses.fields(self)}))
        if problems:
            raise SettingsError(problems)
        for name in NUMBER_FIELDS:
            value = python_number(getattr(self, name))
            if value is not None:  # None: max_gradient_norm off
                whole = name in ("steps_per_increase", "hysteresis")
                object.__setattr__(self, name, int(value) if whole else float(value))

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
    def like(cls, peer: str, **arguments: Any) -> ScalerSettings:
        """The settings of ``peer``'s loss scaler, from its own constructor's arguments (its names, its defaults):
        a name of ``dls.policy.PEERS`` (``"torch"``, ``"cerebras"``, ``"deepspeed"``: its ``fp16`` config section,
        ``"megatron"``), built by the classmethod of that name.

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
            close = difflib.get_close_matches(str(peer), list(PEERS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"peer must be one of {', '.join(map(repr, PEERS))}; got {peer!r}{hint}")
        problems = []
        for name in arguments:
            if name not in row.defaults:
                close = difflib.get_close_matches(name, list(row.defaults), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                problems.append(
                    (name, f"{peer}'s scaler has no argument {name!r}{hint}; it takes {', '.join(row.defaults)}")
                )
        problems += [
            (name, f"{peer}'s scaler requires {name} (e.g. {row[name]!r}, its command line's default)")
            for name in row.required
            if name not in arguments
        ]
        if problems:
            raise SettingsError(problems)
        build: Any = getattr(cls, peer)
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


def interval_name(dialect: str) -> str:
    """What the dialect's users call ``steps_per_increase``.

    Args:
        dialect: ``"torch"``, ``"cerebras"``, ``"deepspeed"`` or ``"megatron"``.
    """
    peer = PEERS.get(dialect) if isinstance(dialect, str) else None
    return peer.interval if peer else "steps_per_increase"


def _named(*checks: tuple[str, str | None]) -> list[tuple[str, str]]:
    return [(name, problem) for name, problem in checks if problem is not None]


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
