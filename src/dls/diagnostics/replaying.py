"""Replaying loss-scaling policies over a recorded trace (``dls.diagnostics.record``), and searching their settings.

Each policy is a ``dls.settings.ScalerSettings`` built from one table, ``POLICIES``: a peer's name
(``torch``, ``cerebras``, ``megatron``, ``deepspeed``, ``static``, or ``recorded``: the recorded run's own settings
and state), its own argument names and defaults, overridden as ``name:key=value,...``. Replay runs the rule those
settings give (``settings.rule().update_`` on a ``dls.policy.ScaleState``, the code the scaler runs) once per
recorded step, on the overflow flag the trace implies at the policy's scale.

What the trace decides. A step overflows at scale ``s`` when some tensor of its backward pass exceeds its
format's range; backward is linear in the scale (exactly so for power-of-two ratios, short of underflow), so a
step that overflows at ``s`` overflows at every larger scale. A step recorded at scale ``r``:

* recorded **clean**: does not overflow at ``s <= r``; overflows at ``s`` above the smallest *overflow scale* the
  trace holds for it (per module with ``record(model=...)``; of the gradients themselves, from ``grad_amax``);
  between the two the trace cannot tell (the largest tensor of backward may be one no hook saw);
* recorded **overflowing**: overflows at ``s >= r``; below ``r`` the trace cannot tell.

Where the trace cannot tell, replay follows both outcomes: it keeps every distinct state the rule can reach (with
the fewest and the most skipped steps, steps at the minimum scale and underflow of any way of reaching it) and
reports the resulting **bounds**, exact over all outcomes consistent with the trace. Beside them, one **estimate**
trajectory (plotted, and the figure tune ranks by after the bounds): an undecided step keeps its recorded outcome,
except an overflow right after the recorded scale grew (a probe of the larger scale), taken not to overflow at or
below the previous step's, clean, scale. The estimate is a guess and is always shown with its bounds.

Underflow: the fraction of the nonzero gradient values of the latest histogram that would round to zero in the
format (``float16``, ``bfloat16``, ``cbfloat16``, ``float8_e4m3fn``, ``float8_e5m2``) at the policy's scale,
counting the exponent bins entirely below half the format's smallest subnormal: exact for power-of-two scales
but for values exactly at that half; the mean over the applied (not skipped) steps. Values that already
underflowed in the recorded run are zeros in the trace and are not counted.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dls import formats
from dls.checks import FLOAT32_MAX, FLOAT32_TINY
from dls.diagnostics.record import Trace
from dls.loss_scale import LossScale
from dls.policy import PEERS, ScaleState
from dls.scaler_state import parse_state_dict
from dls.settings import ScalerSettings, SettingsError

__all__ = [
    "POLICIES",
    "Policy",
    "PolicyKind",
    "Replay",
    "TuneResult",
    "config_lines",
    "parse_policy",
    "replay",
    "tune",
]

FLOAT16_MAX = 65504.0
MAX_BRANCHES = 256  # distinct rule states followed at once; beyond, the bounds of the rest are loose (documented)


# ------------------------------------------------------------------------------------------------ the policy table
@dataclass(frozen=True)
class PolicyKind:
    """One row of ``POLICIES``: a peer's dynamic loss-scaling policy.

    Attributes:
        name: the name given on the command line.
        summary: what it is, in a line.
        defaults: the peer's own argument names and defaults (``None``: the peer derives it).
        build: ``(values, half_dtype) -> ScalerSettings`` with ``values`` the defaults, overridden.
        grid: for ``dls tune``: the values tried per argument (the others keep their defaults).
        labels: the peer's name of a ``ScalerSettings`` argument whose name differs (for error messages).
    """

    name: str
    summary: str
    defaults: dict[str, Any]
    build: Callable[[dict[str, Any], str], ScalerSettings]
    grid: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)  # a ScalerSettings argument -> this peer's key


def _torch(v: dict[str, Any], half: str) -> ScalerSettings:
    return ScalerSettings.torch(**v, half_dtype=half)


def _cerebras(v: dict[str, Any], half: str) -> ScalerSettings:
    given = {k: value for k, value in v.items() if value is not None}
    return ScalerSettings.cerebras(loss_scale="dynamic", half_dtype=half, **given)


def _megatron(v: dict[str, Any], half: str) -> ScalerSettings:
    from dls.scaler import GradScaler  # the library's constructor for Megatron-LM's arguments

    return GradScaler.from_megatron("cpu", **v).settings


def _deepspeed(v: dict[str, Any], half: str) -> ScalerSettings:
    from dls.scaler import GradScaler  # the library's constructor for DeepSpeed's fp16 section (its growth timing)

    return GradScaler.from_deepspeed({"enabled": True, "loss_scale": 0, **v}, device="cpu").settings


def _like(name: str, v: dict[str, Any], half: str) -> ScalerSettings:
    return ScalerSettings.like(name, **v)  # the field's peers scale float16 (their defaults are float16's)


def _static(v: dict[str, Any], half: str) -> ScalerSettings:
    return ScalerSettings.torch(loss_scale=v["loss_scale"], half_dtype=half)


POWERS = tuple(2.0**k for k in (8, 12, 16, 20, 24))
POLICIES: dict[str, PolicyKind] = {
    k.name: k
    for k in (
        PolicyKind(
            "torch",
            "torch.amp.GradScaler: grow x2 after growth_interval clean steps, halve on overflow, no floor",
            {"init_scale": 2.0**16, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000},
            _torch,
            {"init_scale": POWERS, "growth_interval": (100, 250, 500, 1000, 2000)},
            {"steps_per_increase": "growth_interval"},
        ),
        PolicyKind(
            "cerebras",
            "cstorch.amp.GradScaler: ceiling 2**15 (2**31 for cbfloat16), floor 2**-14, overflow tolerance",
            {
                "init_scale": None,
                "steps_per_increase": 2000,
                "min_loss_scale": 2.0**-14,
                "max_loss_scale": None,
                "overflow_tolerance": 0.0,
            },
            _cerebras,
            {"steps_per_increase": (100, 250, 500, 1000, 2000), "overflow_tolerance": (0.0, 0.01, 0.05)},
        ),
        PolicyKind(
            "megatron",
            "Megatron-LM's DynamicGradScaler: start 2**32, hysteresis 2, floor 1, grow after 1000 clean steps",
            {
                "initial_scale": 2.0**32,
                "min_scale": 1.0,
                "growth_factor": 2.0,
                "backoff_factor": 0.5,
                "growth_interval": 1000,
                "hysteresis": 2,
            },
            _megatron,
            {
                "initial_scale": (2.0**16, 2.0**24, 2.0**32),
                "growth_interval": (250, 500, 1000),
                "hysteresis": (1, 2, 4),
            },
        ),
        PolicyKind(
            "deepspeed",
            "DeepSpeed's DynamicLossScaler: 2**16, window 1000 (first growth after 1001), hysteresis 2, floor 1",
            {
                "initial_scale_power": 16,
                "loss_scale_window": 1000,
                "hysteresis": 2,
                "consecutive_hysteresis": False,
                "min_loss_scale": 1.0,
            },
            _deepspeed,
            {"initial_scale_power": (12, 16, 24, 32), "loss_scale_window": (250, 500, 1000), "hysteresis": (1, 2, 4)},
        ),
        *(
            PolicyKind(
                name,
                PEERS[name].summary,
                {k: v for k, v in PEERS[name].defaults.items() if k not in PEERS[name].state_arguments},
                functools.partial(_like, name),
                grid,
            )
            for name, grid in (
                ("keras", {"initial_scale": POWERS, "dynamic_growth_steps": (100, 250, 500, 1000, 2000)}),
                ("apex", {"init_scale": POWERS, "scale_window": (100, 250, 500, 1000, 2000)}),
                ("apex_fp16_utils", {"init_scale": (2.0**16, 2.0**24, 2.0**32), "scale_window": (250, 500, 1000)}),
                (
                    "fairseq",
                    {"init_scale": (2.0**7, 2.0**15), "scale_window": (128, 512, 2000), "tolerance": (0.0, 0.05, 0.25)},
                ),
                ("mxnet", {}),
                (
                    "colossalai",
                    {
                        "initial_scale": (2.0**16, 2.0**24, 2.0**32),
                        "growth_interval": (250, 500, 1000),
                        "hysteresis": (1, 2, 4),
                    },
                ),
                ("jmp", {"loss_scale": POWERS, "period": (100, 250, 500, 1000, 2000)}),
            )
        ),
        PolicyKind(
            "static",
            "a fixed scale: overflowing steps are skipped, the scale never moves",
            {"loss_scale": 2.0**16},
            _static,
            {"loss_scale": POWERS},
        ),
    )
}
RECORDED = "recorded"


@dataclass(frozen=True)
class Policy:
    """A policy to replay: ``spec`` as given, its ``kind`` (a ``POLICIES`` name or ``"recorded"``), the
    ``values`` of its arguments (defaults overridden) and the ``settings`` they build. ``state``: where the
    ``recorded`` policy starts (the trace's first header); other policies start fresh."""

    spec: str
    kind: str
    values: dict[str, Any]
    settings: ScalerSettings
    state: dict[str, Any] | None = None


_NUMBER = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")
_POWER = re.compile(r"^2\*\*([+-]?\d+)$")


def _parse_value(text: str) -> Any:
    """``true``/``false``, an integer, a float, or ``2**k``."""
    t = text.strip()
    if t.lower() in ("true", "false"):
        return t.lower() == "true"
    if m := _POWER.match(t):
        k = int(m.group(1))
        return 2**k if k >= 0 else 2.0**k
    if _NUMBER.match(t):
        return int(t) if re.match(r"^[+-]?\d+$", t) else float(t)
    raise ValueError(f"{text!r} is not a number (an integer, a float such as 1e-3, or 2**k) nor true/false")


def parse_policy(spec: str, trace: Trace | None = None, half_dtype: str | None = None) -> Policy:
    """The policy ``spec`` names: ``NAME`` or ``NAME:key=value,key=value`` with NAME from ``POLICIES`` or
    ``recorded`` (the trace's own settings and starting state; needs ``trace``).

    Args:
        spec: the policy as written, e.g. ``"torch"`` or ``"cerebras:steps_per_increase=500"``.
        trace: the trace, for ``recorded`` and for the half dtype.
        half_dtype: the format whose defaults apply (default: the trace's, else float16).

    Raises:
        ValueError: an unknown name or key (with the allowed ones), a value that is not a number, or settings the
            peer's constructor refuses; every message names the policy and the key.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"a policy must be a name such as 'torch' or 'cerebras:steps_per_increase=500'; got {spec!r}")
    name, _, rest = spec.strip().partition(":")
    name = name.strip()
    half = half_dtype or (trace.half_dtype if trace is not None else "float16")
    allowed = [*POLICIES, RECORDED]
    if name == RECORDED:
        if rest.strip():
            raise ValueError(f"policy 'recorded' takes no settings (it is the recorded run's own); got {spec!r}")
        if trace is None:
            raise ValueError("policy 'recorded' needs a trace: it replays the recorded run's own settings")
        header = trace.segments[0].header
        return Policy(spec, RECORDED, {}, _recorded_settings(header), dict(header.get("state") or {}))
    if name not in POLICIES:
        close = difflib.get_close_matches(name, allowed, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown policy {name!r}{hint}; allowed: {', '.join(allowed)}")
    kind = POLICIES[name]
    values = dict(kind.defaults)
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, text = item.partition("=")
        key = key.strip()
        if not eq:
            raise ValueError(
                f"policy {name!r}: {item!r} is not key=value (e.g. {name}:{next(iter(kind.defaults), 'key')}=...)"
            )
        if key not in kind.defaults:
            close = difflib.get_close_matches(key, list(kind.defaults), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"policy {name!r} has no key {key!r}{hint}; allowed: {', '.join(kind.defaults)}")
        try:
            values[key] = _parse_value(text)
        except ValueError as exc:
            raise ValueError(f"policy {name!r}, key {key!r}: {exc}") from None
    return Policy(spec, name, values, _build(kind, values, half))


def _build(kind: PolicyKind, values: dict[str, Any], half: str) -> ScalerSettings:
    try:
        return kind.build(values, half)
    except SettingsError as exc:
        problems = "; ".join(
            message.replace(argument, kind.labels[argument], 1) if argument in kind.labels else message
            for argument, message in exc.problems
        )
        raise ValueError(f"policy {kind.name!r}: {problems}") from None
    except ValueError as exc:
        raise ValueError(f"policy {kind.name!r}: {exc}") from None


def _recorded_settings(header: dict[str, Any]) -> ScalerSettings:
    fields = {f.name for f in dataclasses.fields(ScalerSettings)}
    values = {k: v for k, v in dict(header.get("settings") or {}).items() if k in fields}
    try:
        return ScalerSettings(**values)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the trace's settings cannot be read by this dls: {exc}") from None


# ------------------------------------------------------------------------------------------------ what a step allows
@dataclass(frozen=True)
class _Step:
    number: int  # the trace's step
    scale: float  # the scale it was recorded at
    overflow: bool  # whether it overflowed there
    clean_up_to: float  # it does not overflow at scales up to this
    overflows_above: float  # it overflows at scales above this (inf: no such bound)
    estimate_above: float  # the estimate: it overflows at scales above this
    histogram: int  # index into the histograms in effect (-1: none yet)


def _finite_scales(row: dict[str, Any]) -> list[float | None]:
    return [
        v if isinstance(v, (int, float)) and 0 < v < math.inf else None for v in row.get("module_overflow_scale") or []
    ]


def _steps(trace: Trace) -> tuple[list[_Step], list[list[tuple[int, int]]], list[int]]:
    """The steps of ``trace`` as replay reads them, the histograms as ``[(exponent, count), ...]``, and the index
    of the first step of each segment."""
    out: list[_Step] = []
    histograms: list[list[tuple[int, int]]] = []
    starts: list[int] = []
    for segment in trace.segments:
        starts.append(len(out))
        complete = bool(segment.header.get("modules"))  # every tensor of backward measured (record(model=...))
        rows = segment.steps
        steps: list[_Step | None] = []
        for row in rows:  # the clean steps first: an overflow's estimate looks at its clean neighbours
            if isinstance(row.get("exponents"), dict):
                exponents = row["exponents"]
                low = int(exponents.get("min", 0))
                histograms.append([(low + i, int(c)) for i, c in enumerate(exponents.get("counts") or []) if c])
            steps.append(None if row["overflow"] else _clean_step(row, complete, len(histograms) - 1))
        histogram = out[-1].histogram if out else -1
        for i, row in enumerate(rows):
            step = steps[i]
            if step is None:
                step = _Step(int(row["step"]), float(row["scale"]), True, 0.0, float(row["scale"]),
                             _overflow_estimate(rows, steps, i), histogram)  # fmt: skip
            histogram = step.histogram
            out.append(step)
    return out, histograms, starts


def _clean_step(row: dict[str, Any], complete: bool, histogram: int) -> _Step:
    scale = float(row["scale"])
    modules = _finite_scales(row)
    bounds = [v for v in modules if v is not None]
    amax, amax16 = row.get("grad_amax"), row.get("grad_amax_float16")
    if isinstance(amax, (int, float)) and amax > 0:
        bounds.append(FLOAT32_MAX / amax)
    if isinstance(amax16, (int, float)) and amax16 > 0:
        bounds.append(FLOAT16_MAX / amax16)
    above = max(min(bounds), scale) if bounds else math.inf  # it was clean at its own scale
    measured = complete and any(v is not None for v in modules)
    return _Step(int(row["step"]), scale, False, above if measured else scale, above, above, histogram)


def _overflow_estimate(rows: list[dict[str, Any]], steps: list[_Step | None], i: int) -> float:
    """The estimate of the scale above which the overflowing step ``i`` overflows (it did at its scale). Its
    reference is the step before it when that one is clean, else, when no step before it in the segment was clean
    (a run starting above the scale its gradients allow), the first clean step after it. With both measured: the
    reference's own overflow scale, divided by how much larger the tensors measured in both steps were in this one
    (a loss spike divides it; a step like its neighbour leaves it; a step with nothing finite measured overflows
    at every scale: its first tensor of backward overflowed already). Unmeasured: an overflow right after the scale
    grew is a probe, no overflow at the previous, clean, scale; one at the start, none at the first clean scale.
    Else: an overflow at every scale."""
    scale = float(rows[i]["scale"])
    if i and steps[i - 1] is not None:
        reference = i - 1
    elif all(step is None for step in steps[:i]):
        reference = next((j for j in range(i + 1, len(steps)) if steps[j] is not None), -1)
        if reference < 0:
            return 0.0
    else:
        return 0.0
    known = steps[reference]
    assert known is not None
    before = _finite_scales(rows[reference])
    ratios = [b / a for a, b in zip(_finite_scales(rows[i]), before) if a is not None and b is not None]
    if known.clean_up_to > known.scale or (ratios and known.clean_up_to == known.scale):  # measured
        # Nothing finite measured in this step: its backward overflowed from its first tensor on (a spike).
        return min(known.clean_up_to / max(ratios), scale * 0.5) if ratios else 0.0
    if reference > i or known.scale < scale:
        return known.scale
    return 0.0


def _decide(step: _Step, s: float) -> bool | None:
    """Whether the step overflows at scale ``s``, or ``None`` where the trace cannot tell."""
    if s <= step.clean_up_to and not step.overflow:
        return False
    if s > step.overflows_above or (step.overflow and s >= step.scale):
        return True
    return None


def _estimate(step: _Step, s: float) -> bool:
    """The estimate's outcome of an undecided step (see the module docstring)."""
    return s > step.estimate_above


class _Underflow:
    """Underflow fractions per histogram and scale, cached (scales repeat)."""

    def __init__(self, histograms: list[list[tuple[int, int]]], fmt: formats.FloatFormat) -> None:
        self.histograms = histograms
        self.half_min = fmt.min_subnormal / 2
        self._cache: dict[tuple[int, float], float] = {}

    def at(self, index: int, scale: float) -> float | None:
        if index < 0:
            return None
        key = (index, scale)
        if key not in self._cache:
            bins = self.histograms[index]
            total = sum(c for _, c in bins)
            below = sum(c for e, c in bins if 2.0 ** (e + 1) * scale <= self.half_min)
            self._cache[key] = below / total if total else 0.0
        return self._cache[key]


# ------------------------------------------------------------------------------------------------ the replay
@dataclass
class Replay:
    """One policy replayed over a trace. Counts are ``(estimate, lowest, highest)``: the estimate trajectory and
    the bounds over every outcome the trace allows (``bounds_exact``: ``False`` when more than
    ``MAX_BRANCHES`` states had to be followed, then the upper bounds assume every later step may overflow).

    Attributes:
        policy: the ``Policy`` replayed.
        steps: steps replayed.
        skipped: skipped steps (lost updates).
        at_min_scale: steps taken at the policy's minimum scale (pinned at the floor).
        underflow: the mean underflow fraction over applied steps in ``format`` (``None`` without histograms).
        undecided: steps of the estimate trajectory whose outcome the trace could not decide.
        scales, skips, guessed: per step of the estimate: the scale used, whether skipped, whether guessed.
        scale_low, scale_high: per step, the lowest and highest scale any allowed outcome reaches.
        first_departure: for ``recorded``: the first step whose replayed scale or skip differs from the trace's
            (``None``: the replay reproduces the recording exactly).
        format: the format the underflow is for.
    """

    policy: Policy
    steps: int
    skipped: tuple[int, int, int]
    at_min_scale: tuple[int, int, int]
    underflow: tuple[float, float, float] | None
    undecided: int
    bounds_exact: bool
    scales: list[float]
    skips: list[bool]
    guessed: list[bool]
    scale_low: list[float]
    scale_high: list[float]
    first_departure: int | None
    format: str

    @property
    def final_scale(self) -> float | None:
        """The estimate's scale after the last step."""
        return self.scales[-1] if self.scales else None

    def to_dict(self, per_step: bool = True) -> dict[str, Any]:
        """Plain data (``--json``).

        Args:
            per_step: also each step's scale and skip.
        """
        out: dict[str, Any] = {
            "policy": self.policy.spec,
            "kind": self.policy.kind,
            "values": self.policy.values,
            "settings": dataclasses.asdict(self.policy.settings),
            "steps": self.steps,
            "skipped": dict(zip(("estimate", "low", "high"), self.skipped)),
            "at_min_scale": dict(zip(("estimate", "low", "high"), self.at_min_scale)),
            "underflow": None if self.underflow is None else dict(zip(("estimate", "low", "high"), self.underflow)),
            "format": self.format,
            "undecided": self.undecided,
            "bounds_exact": self.bounds_exact,
            "final_scale": self.final_scale,
            "first_departure": self.first_departure,
        }
        if per_step:
            out.update(
                scales=self.scales, skips=self.skips, guessed=self.guessed, scale_low=self.scale_low,
                scale_high=self.scale_high,
            )  # fmt: skip
        return out


_ONE = torch.ones((), dtype=torch.float32)
_ZERO = torch.zeros((), dtype=torch.float32)


def _start(settings: ScalerSettings, values: dict[str, Any] | None) -> ScaleState:
    """The state a scaler with ``settings`` holds at the start (``values``: loaded as the scaler loads a state).
    Any rule's state (``dls.policy``: ``ScaleState`` for most, a peer's own for others)."""
    loss_scale = LossScale(settings, torch.device("cpu"))
    if values:
        loaded = parse_state_dict(dict(values), settings, apply_settings=False)
        loss_scale.load(loaded.values, settings)
        loss_scale.rule.normalise_(loss_scale.state)  # as the scaler does before its next update
    return loss_scale.state


def _clone(state: ScaleState) -> ScaleState:
    return type(state)(*(t.clone() for t in state))


def _key(state: ScaleState) -> tuple[float, ...]:
    return tuple(
        value.item()
        for name, value in zip(state._fields, state)
        if name not in ("num_skipped_steps", "non_clamped_scale")
    )


@dataclass
class _Branch:
    state: ScaleState
    acc: list[float]  # low/high pairs: skipped, at_min, underflow sum, applied


def _merge(a: list[float], b: list[float]) -> list[float]:
    return [min(x, y) if i % 2 == 0 else max(x, y) for i, (x, y) in enumerate(zip(a, b))]


def replay(trace: Trace, policies: Iterable[str | Policy], fmt: str | None = None) -> list[Replay]:
    """Replay each policy over ``trace`` (see the module docstring).

    Args:
        trace: a trace from ``read_trace``.
        policies: specs (parsed by ``parse_policy``) or ``Policy`` objects.
        fmt: the format the underflow is computed for (default: the trace's half dtype).

    Raises:
        ValueError: a policy ``parse_policy`` refuses, an unknown format, or a trace without steps.
    """
    steps, histograms, starts = _steps(trace)
    if not steps:
        raise ValueError(f"the trace {trace.path} has no steps (was the scaler's update() called while recording?)")
    name = fmt or trace.half_dtype
    try:
        underflow = _Underflow(histograms, formats.get(name))
    except (KeyError, ValueError):
        raise ValueError(f"format must be one of {', '.join(formats.names())}; got {name!r}") from None
    parsed = [p if isinstance(p, Policy) else parse_policy(p, trace) for p in policies]
    return [_replay_one(trace, p, steps, starts, underflow, name) for p in parsed]


def _replay_one(
    trace: Trace, policy: Policy, steps: list[_Step], starts: list[int], underflow: _Underflow, fmt: str
) -> Replay:
    recorded = policy.kind == RECORDED
    segment_of = {start: i for i, start in enumerate(starts)}
    settings = policy.settings
    rule = settings.rule()
    floor = settings.min_loss_scale if settings.mode == "dynamic" else -1.0
    branches = [_Branch(_start(settings, policy.state), [0.0] * 8)]
    estimate = _clone(branches[0].state)
    est_skipped = est_at_min = est_applied = undecided = 0
    est_under = 0.0
    exact = True
    scales: list[float] = []
    skips: list[bool] = []
    guessed: list[bool] = []
    low: list[float] = []
    high: list[float] = []
    first_departure: int | None = None
    for t, step in enumerate(steps):
        if recorded and t in segment_of and t and exact:  # a resumed run: its own settings and state again
            header = trace.segments[segment_of[t]].header
            settings = _recorded_settings(header)
            rule, floor = settings.rule(), settings.min_loss_scale if settings.mode == "dynamic" else -1.0
            start = _start(settings, header.get("state"))
            branches = [_Branch(start, _merge_all(b.acc for b in branches))]
            estimate = _clone(start)
        # The estimate trajectory.
        s = float(estimate.loss_scale.item())
        decided = _decide(step, s)
        overflow = _estimate(step, s) if decided is None else decided
        undecided += decided is None
        est_skipped += overflow
        est_at_min += s == floor
        if not overflow:
            u = underflow.at(step.histogram, s)
            if u is not None:
                est_under += u
            est_applied += 1
        scales.append(s)
        skips.append(overflow)
        guessed.append(decided is None)
        if recorded and first_departure is None and (s != step.scale or overflow != step.overflow):
            first_departure = step.number
        rule.update_(estimate, _ONE if overflow else _ZERO)
        # The bounds: every outcome the trace allows.
        if exact:
            branches, step_low, step_high = _advance(branches, step, rule, floor, underflow)
            if len(branches) > MAX_BRANCHES:
                exact = False
                base = _merge_all(b.acc for b in branches)
                branches = []
        else:  # from here on, any step may overflow or not, at any scale
            step_low, step_high = math.nan, math.nan
            base = [base[0], base[1] + 1, base[2], base[3] + 1, base[4], base[5] + 1, base[6], base[7] + 1]
        low.append(step_low)
        high.append(step_high)
    acc = _merge_all(b.acc for b in branches) if exact else base
    applied_est = est_applied
    under_est = est_under / applied_est if applied_est else 0.0
    has_hist = any(step.histogram >= 0 for step in steps)
    under: tuple[float, float, float] | None = None
    if has_hist:
        lo = acc[4] / acc[7] if acc[7] else 0.0
        hi = acc[5] / acc[6] if acc[6] else 1.0
        under = (under_est, min(lo, under_est), max(min(hi, 1.0), under_est))
    return Replay(
        policy=policy,
        steps=len(steps),
        skipped=(est_skipped, int(acc[0]), int(acc[1])),
        at_min_scale=(est_at_min, int(acc[2]), int(acc[3])),
        underflow=under,
        undecided=undecided,
        bounds_exact=exact,
        scales=scales,
        skips=skips,
        guessed=guessed,
        scale_low=low,
        scale_high=high,
        first_departure=first_departure,
        format=fmt,
    )


def _merge_all(accs: Iterable[list[float]]) -> list[float]:
    out: list[float] | None = None
    for acc in accs:
        out = list(acc) if out is None else _merge(out, acc)
    assert out is not None
    return out


def _advance(
    branches: list[_Branch], step: _Step, rule: Any, floor: float, underflow: _Underflow
) -> tuple[list[_Branch], float, float]:
    """Every branch one step on (two where the trace cannot decide), equal states merged; the lowest and highest
    scale used."""
    out: list[_Branch] = []
    scales: list[float] = []
    for branch in branches:
        s = float(branch.state.loss_scale.item())
        scales.append(s)
        decided = _decide(step, s)
        outcomes = [decided] if decided is not None else [True, False]
        for k, overflow in enumerate(outcomes):
            state = branch.state if k == len(outcomes) - 1 else _clone(branch.state)
            acc = list(branch.acc)
            at_min = float(s == floor)
            acc[0] += overflow
            acc[1] += overflow
            acc[2] += at_min
            acc[3] += at_min
            if not overflow:
                u = underflow.at(step.histogram, s) or 0.0
                acc[4] += u
                acc[5] += u
                acc[6] += 1
                acc[7] += 1
            rule.update_(state, _ONE if overflow else _ZERO)
            out.append(_Branch(state, acc))
    if len(out) > 1:
        merged: dict[tuple[float, ...], _Branch] = {}
        for branch in out:
            key = _key(branch.state)
            if key in merged:
                merged[key].acc = _merge(merged[key].acc, branch.acc)
            else:
                merged[key] = branch
        out = list(merged.values())
    return out, min(scales), max(scales)


# ------------------------------------------------------------------------------------------------ config lines
def config_lines(settings: ScalerSettings) -> dict[str, str]:
    """The lines that configure ``settings``' rule in each system that can express it exactly: ``dls``,
    ``torch.amp``, ``Model Zoo YAML`` (dls's trainer and cstorch's keys), ``DeepSpeed JSON``, ``Megatron flags``;
    a system that cannot express it is left out.

    Args:
        settings: the rule to configure.
    """
    s = settings
    out: dict[str, str] = {}
    deepspeed_timing = s.dialect == "deepspeed"
    interval = s.growth_interval  # torch's meaning: growth on the interval-th clean update
    factors = (s.growth_factor, s.backoff_factor)
    no_ceiling = s.max_loss_scale >= FLOAT32_MAX
    if s.mode == "dynamic" and s.dialect in _FIELD_LINES:
        return _FIELD_LINES[s.dialect](s)
    if s.mode == "static":
        out["dls"] = f"dls.GradScaler(loss_scale={_num(s.init_scale)})"
        out["Model Zoo YAML"] = f"optimizer:\n  loss_scaling_factor: {_num(s.init_scale)}"
        out["DeepSpeed JSON"] = f'"fp16": {{"enabled": true, "loss_scale": {_num(s.init_scale)}}}'
        return out
    if deepspeed_timing:
        power = math.log2(s.init_scale)
        fp16 = (
            f'{{"enabled": true, "loss_scale": 0, "initial_scale_power": {int(power)}, "loss_scale_window": '
            f'{s.steps_per_increase}, "hysteresis": {s.hysteresis}, "consecutive_hysteresis": '
            f'{str(s.consecutive_hysteresis).lower()}, "min_loss_scale": {_num(s.min_loss_scale)}}}'
        )
        out["dls"] = f"dls.GradScaler.from_deepspeed({fp16.replace('true', 'True').replace('false', 'False')})"
        out["DeepSpeed JSON"] = f'"fp16": {fp16}'
        return out
    extras = []
    if s.hysteresis != 1:
        extras.append(f"hysteresis={s.hysteresis}")
    if s.consecutive_hysteresis:
        extras.append("consecutive_hysteresis=True")
    if s.overflow_tolerance:
        extras.append(f"overflow_tolerance={_num(s.overflow_tolerance)}")
    if s.dialect == "megatron":
        args = [
            '"cuda"',
            f"initial_scale={_num(s.init_scale)}",
            f"min_scale={_num(s.min_loss_scale)}",
            f"growth_factor={_num(factors[0])}",
            f"backoff_factor={_num(factors[1])}",
            f"growth_interval={interval}",
            f"hysteresis={s.hysteresis}",
        ]
        out["dls"] = f"dls.GradScaler.from_megatron({', '.join(args)})"
    elif s.dialect == "cerebras":
        args = [
            'loss_scale="dynamic"',
            f"init_scale={_num(s.init_scale)}",
            f"steps_per_increase={s.steps_per_increase}",
            f"min_loss_scale={_num(s.min_loss_scale)}",
            f"max_loss_scale={_num(s.max_loss_scale)}",
        ]
        if factors != (2.0, 0.5):
            args += [f"growth_factor={_num(factors[0])}", f"backoff_factor={_num(factors[1])}"]
        out["dls"] = f"dls.GradScaler({', '.join(args + extras)})"
    else:
        args = [
            '"cuda"',
            f"init_scale={_num(s.init_scale)}",
            f"growth_factor={_num(factors[0])}",
            f"backoff_factor={_num(factors[1])}",
            f"growth_interval={interval}",
        ]
        if s.min_loss_scale > FLOAT32_TINY:
            extras.append(f"min_loss_scale={_num(s.min_loss_scale)}")
        if not no_ceiling:
            extras.append(f"max_loss_scale={_num(s.max_loss_scale)}")
        out["dls"] = f"dls.GradScaler({', '.join(args + extras)})"
    if s.hysteresis == 1 and not s.overflow_tolerance and no_ceiling and s.min_loss_scale <= FLOAT32_TINY:
        out["torch.amp"] = (
            f'torch.amp.GradScaler("cuda", init_scale={_num(s.init_scale)}, growth_factor={_num(factors[0])}, '
            f"backoff_factor={_num(factors[1])}, growth_interval={interval})"
        )
    if interval >= 2:
        yaml = [
            "optimizer:",
            "  loss_scaling_factor: dynamic",
            f"  initial_loss_scale: {_num(s.init_scale)}",
            f"  steps_per_increase: {interval - 1}",
            f"  min_loss_scale: {_num(s.min_loss_scale)}",
            f"  max_loss_scale: {_num(s.max_loss_scale)}",
        ]
        if factors != (2.0, 0.5):
            yaml += [f"  growth_factor: {_num(factors[0])}", f"  backoff_factor: {_num(factors[1])}"]
        if s.overflow_tolerance:
            yaml.append(f"  overflow_tolerance: {_num(s.overflow_tolerance)}")
        if s.hysteresis != 1:
            yaml.append(f"  hysteresis: {s.hysteresis}")
        if s.consecutive_hysteresis:
            yaml.append("  consecutive_hysteresis: true")
        out["Model Zoo YAML"] = "\n".join(yaml)
    if factors == (2.0, 0.5) and not s.overflow_tolerance and not s.consecutive_hysteresis and no_ceiling:
        out["Megatron flags"] = (
            f"--fp16 --initial-loss-scale {_num(s.init_scale)} --min-loss-scale {_num(s.min_loss_scale)} "
            f"--loss-scale-window {interval} --hysteresis {s.hysteresis}"
        )
    return out


def _args(values: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v if isinstance(v, str) else _num(v)}" for k, v in values.items())


def _peer_lines(name: str, system: str, values: dict[str, Any], line: str | None) -> dict[str, str]:
    """The ``dls`` line (``GradScaler.like`` with the peer's own arguments) and the peer's own, where it has one."""
    out = {"dls": f'dls.GradScaler.like("{name}", "cuda"{", " if values else ""}{_args(values)})'}
    if line is not None:
        out[system] = line
    return out


def _keras_lines(s: ScalerSettings) -> dict[str, str]:
    v = {"initial_scale": s.init_scale, "dynamic_growth_steps": s.steps_per_increase}
    return _peer_lines("keras", "Keras", v, f"keras.optimizers.LossScaleOptimizer(optimizer, {_args(v)})")


def _apex_lines(s: ScalerSettings) -> dict[str, str]:
    v: dict[str, Any] = {"init_scale": s.init_scale, "scale_window": s.steps_per_increase}
    if s.min_loss_scale > FLOAT32_TINY:
        v["min_loss_scale"] = s.min_loss_scale
    v["max_loss_scale"] = s.max_loss_scale
    return _peer_lines("apex", "Apex", v, f'apex.amp.scaler.LossScaler("dynamic", {_args(v)})')


def _apex_fp16_utils_lines(s: ScalerSettings) -> dict[str, str]:
    v = {"init_scale": s.init_scale, "scale_factor": s.growth_factor, "scale_window": s.steps_per_increase}
    return _peer_lines("apex_fp16_utils", "Apex fp16_utils", v, f"apex.fp16_utils.DynamicLossScaler({_args(v)})")


def _fairseq_lines(s: ScalerSettings) -> dict[str, str]:
    v: dict[str, Any] = {"init_scale": s.init_scale, "scale_factor": s.growth_factor}
    v |= {"scale_window": s.steps_per_increase, "tolerance": s.overflow_tolerance}
    if s.min_loss_scale > FLOAT32_TINY:
        v["threshold"] = s.min_loss_scale
    v["min_loss_scale"] = 0.0 if s.stop_loss_scale is None else s.stop_loss_scale
    flags = None
    if s.growth_factor == 2.0 and s.init_scale == int(s.init_scale):  # its command line: an int start, factor 2
        flags = (
            f"--fp16 --fp16-init-scale {_num(s.init_scale)} --fp16-scale-window {s.steps_per_increase} "
            f"--fp16-scale-tolerance {_num(s.overflow_tolerance)} --min-loss-scale {_num(v['min_loss_scale'])}"
        )
        if "threshold" in v:
            flags += f" --threshold-loss-scale {_num(v['threshold'])}"
    return _peer_lines("fairseq", "fairseq flags", v, flags)


def _mxnet_lines(s: ScalerSettings) -> dict[str, str]:
    return _peer_lines("mxnet", "MXNet", {}, "amp.init(); amp.init_trainer(trainer)  # its LossScaler() takes none")


def _colossalai_lines(s: ScalerSettings) -> dict[str, str]:
    v: dict[str, Any] = {"initial_scale": s.init_scale, "growth_factor": s.growth_factor}
    v |= {"backoff_factor": s.backoff_factor, "growth_interval": s.steps_per_increase}
    if s.min_loss_scale > FLOAT32_TINY:
        v["min_scale"] = s.min_loss_scale
    if s.max_loss_scale < FLOAT32_MAX:
        v["max_scale"] = s.max_loss_scale
    v["hysteresis"] = s.hysteresis
    return _peer_lines("colossalai", "ColossalAI", v, f"DynamicGradScaler({_args(v)})")


def _jmp_lines(s: ScalerSettings) -> dict[str, str]:
    floor = 0.0 if s.min_loss_scale <= FLOAT32_TINY else s.min_loss_scale
    v = {"loss_scale": s.init_scale, "period": s.steps_per_increase, "factor": s.growth_factor, "min_loss_scale": floor}
    line = (
        f"jmp.DynamicLossScale(jnp.float32({_num(s.init_scale)}), period={s.steps_per_increase}, "
        f"factor={_num(s.growth_factor)}, min_loss_scale=jnp.float32({_num(floor)}))"
    )
    return _peer_lines("jmp", "jmp", v, line)


# The field's peers (issue 41): each configured in its own syntax, and in dls with its own arguments.
_FIELD_LINES: dict[str, Callable[[ScalerSettings], dict[str, str]]] = {
    "keras": _keras_lines,
    "apex": _apex_lines,
    "apex_fp16_utils": _apex_fp16_utils_lines,
    "fairseq": _fairseq_lines,
    "mxnet": _mxnet_lines,
    "colossalai": _colossalai_lines,
    "jmp": _jmp_lines,
}


def _num(value: float) -> str:
    """A number as a config file would hold it: ``2**k`` powers as plain integers or ``2**-k`` decimals."""
    if value == int(value) and abs(value) < 2**63:
        return str(int(value))
    return repr(float(value))


# ------------------------------------------------------------------------------------------------ tune
@dataclass
class TuneResult:
    """What ``tune`` found. ``candidates``: every setting tried, replayed, in rank order (the fewest skipped
    steps in the worst case the trace allows, then the estimate, then the least underflow); ``feasible``: whether
    each met ``max_underflow`` (its underflow upper bound); ``best``: per policy, the first feasible candidate."""

    candidates: list[Replay]
    feasible: list[bool]
    max_underflow: float | None
    best: dict[str, Replay]
    grid: dict[str, dict[str, tuple[Any, ...]]]


def tune(
    trace: Trace,
    kinds: Sequence[str] | None = None,
    *,
    max_underflow: float | None = 1e-3,
    fmt: str | None = None,
) -> TuneResult:
    """Search each policy's grid (``PolicyKind.grid``: every combination of the listed values, the other
    arguments at their defaults) over ``trace`` and rank the settings (see ``TuneResult``).

    Args:
        trace: a trace from ``dls.diagnostics.record.read_trace``.
        kinds: policy names of ``POLICIES`` (default: all that this dls can build).
        max_underflow: the largest mean underflow fraction allowed (by its upper bound); ``None``: no limit.
        fmt: the format of the underflow (default: the trace's half dtype).

    Raises:
        ValueError: an unknown policy name, a ``max_underflow`` outside [0, 1], or a trace without histograms
            while ``max_underflow`` is set.
    """
    if max_underflow is not None and (
        isinstance(max_underflow, bool) or not isinstance(max_underflow, (int, float)) or not 0 <= max_underflow <= 1
    ):
        raise ValueError(f"max_underflow must be a number in [0, 1] or None; got {max_underflow!r}")
    names = list(kinds) if kinds else [k for k in POLICIES if _buildable(k, trace)]
    for name in names:
        if name not in POLICIES:
            close = difflib.get_close_matches(name, list(POLICIES), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"unknown policy {name!r}{hint}; allowed: {', '.join(POLICIES)}")
    steps, _, _ = _steps(trace)
    if max_underflow is not None and not any(s.histogram >= 0 for s in steps):
        raise ValueError(
            "the trace has no gradient histograms, so underflow cannot be bounded: record with histogram_every, "
            "or pass max_underflow=None (--max-underflow none)"
        )
    policies: list[Policy] = []
    for name in names:
        kind = POLICIES[name]
        keys = list(kind.grid)
        for combo in _product([kind.grid[k] for k in keys]):
            spec = name + ":" + ",".join(f"{k}={_num(v) if isinstance(v, float) else v}" for k, v in zip(keys, combo))
            try:
                policies.append(parse_policy(spec, trace))
            except ValueError:
                continue  # a combination the peer refuses (e.g. an initial scale below the floor)
    results = replay(trace, policies, fmt)

    def ok(r: Replay) -> bool:
        return max_underflow is None or (r.underflow is not None and r.underflow[2] <= max_underflow)

    def rank(r: Replay) -> tuple[float, ...]:
        under = r.underflow[0] if r.underflow is not None else 0.0
        return (not ok(r), r.skipped[2], r.skipped[0], r.at_min_scale[2], under)

    ordered = sorted(results, key=rank)
    best: dict[str, Replay] = {}
    for r in ordered:
        if ok(r) and r.policy.kind not in best:
            best[r.policy.kind] = r
    return TuneResult(ordered, [ok(r) for r in ordered], max_underflow, best, {n: POLICIES[n].grid for n in names})


def _buildable(name: str, trace: Trace) -> bool:
    try:
        parse_policy(name, trace)
    except ValueError:
        return False
    return True


def _product(lists: list[tuple[Any, ...]]) -> Iterable[tuple[Any, ...]]:
    if not lists:
        yield ()
        return
    for head in lists[0]:
        for tail in _product(lists[1:]):
            yield (head, *tail)
