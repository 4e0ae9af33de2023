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

The other peers' settings are built from their own names and defaults (``dls.peer_settings``, this class's base:
``ScalerSettings.deepspeed``, ``.megatron``, ...; ``ScalerSettings.like(peer, ...)`` and ``GradScaler.like`` reach
each): ``GradScaler.from_deepspeed`` reads DeepSpeed's ``fp16`` config section as written (its growth timing too),
``GradScaler.like("megatron", ...)`` takes Megatron-LM's ``DynamicGradScaler`` arguments (torch's timing).

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

from dls.checks import (
    FLOAT32_MAX,
    INT32_MAX,
    SettingsError,
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
from dls.peer_settings import PeerSettings
from dls.policy import PEERS, Rule, StaticRule

MODES = ("dynamic", "static", "off")
DIALECTS = tuple(PEERS)  # each dialect's defaults and growth timing: its row of dls.policy.PEERS
TORCH, CEREBRAS = PEERS["torch"], PEERS["cerebras"]
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


def default_max_loss_scale(half_dtype: str) -> float:
    """cstorch.amp's default ``max_loss_scale`` (and initial scale) for a half dtype.

    Args:
        half_dtype: ``"float16"``, ``"bfloat16"`` or ``"cbfloat16"``.
    """
    cbfloat16 = CEREBRAS.cbfloat16_max_loss_scale
    return cbfloat16 if half_dtype == "cbfloat16" and cbfloat16 is not None else CEREBRAS.max_loss_scale


@dataclass(frozen=True)
class ScalerSettings(PeerSettings):
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

    # ------------------------------------------------------------------ GradScaler's two dialects (the other
    # peers' builders, ScalerSettings.deepspeed ... .jmp, are its base class's: dls.peer_settings)
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
