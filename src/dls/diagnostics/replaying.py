"""Replaying loss-scaling policies over a recorded trace (``dls.diagnostics.trace``): the replay engine.

Each policy is a ``dls.settings.ScalerSettings`` from the table of peers, ``dls.diagnostics.policies``
(``recorded``: the recorded run's own settings and state). Replay runs the rule those settings give
(``settings.rule().update_`` on a ``dls.policy.ScaleState``, the code the scaler runs) once per recorded step, on
the overflow flag the trace implies at the policy's scale. ``dls.diagnostics.tuning`` searches settings with it.

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
below the previous step's, clean, scale. The estimate is a guess and is always shown with its bounds. A figure
the trace cannot decide at all (the scales a step may take once more than ``MAX_BRANCHES`` states would have to
be followed, or once following them has taken ``MAX_BRANCH_STEPS`` rule steps; underflow without histograms) is
``None``, never NaN: ``null`` in JSON, ``-`` in ``dls replay``'s
table.

Underflow: the fraction of the nonzero gradient values of the latest histogram that would round to zero in the
format (``float16``, ``bfloat16``, ``cbfloat16``, ``float8_e4m3fn``, ``float8_e5m2``) at the policy's scale,
counting the exponent bins entirely below half the format's smallest subnormal: exact for power-of-two scales
but for values exactly at that half; the mean over the applied (not skipped) steps. Values that already
underflowed in the recorded run are zeros in the trace and are not counted.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from dls import formats
from dls.checks import FLOAT32_MAX
from dls.diagnostics.policies import RECORDED, Policy, parse_policy, recorded_settings
from dls.diagnostics.trace import FLOAT16_MAX, Trace
from dls.loss_scale import LossScale
from dls.policy import ScaleState
from dls.scaler_state import parse_state_dict
from dls.settings import ScalerSettings

__all__ = ["MAX_BRANCHES", "MAX_BRANCH_STEPS", "Replay", "replay"]

MAX_BRANCHES = 256  # distinct rule states followed at once; beyond, the bounds of the rest are loose (documented)
# Rule steps spent on the bounds per policy (states followed x steps): each is a few device ops on the CPU (about
# 10-30 us), and a long trace without model hooks keeps about MAX_BRANCHES states, so that a 50,000-step trace took
# minutes per policy. Beyond this budget the bounds of the rest are loose, as beyond MAX_BRANCHES.
MAX_BRANCH_STEPS = 100_000


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
        if not ratios:
            return 0.0
        larger = max(ratios)  # 0.0 where the quotient underflowed: this step's tensors were far smaller
        return min(known.clean_up_to / larger if larger > 0 else math.inf, scale * 0.5)
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
    ``MAX_BRANCHES`` states had to be followed, or following them took ``MAX_BRANCH_STEPS`` rule steps; then the
    upper bounds assume every later step may overflow).

    Attributes:
        policy: the ``Policy`` replayed.
        steps: steps replayed.
        skipped: skipped steps (lost updates).
        at_min_scale: steps taken at the policy's minimum scale (pinned at the floor).
        underflow: the mean underflow fraction over applied steps in ``format`` (``None`` without histograms).
        undecided: steps of the estimate trajectory whose outcome the trace could not decide.
        scales, skips, guessed: per step of the estimate: the scale used, whether skipped, whether guessed.
        scale_low, scale_high: per step, the lowest and highest scale any allowed outcome reaches (``None``
            once ``bounds_exact`` is ``False``: any scale).
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
    scale_low: list[float | None]
    scale_high: list[float | None]
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
    name = trace.half_dtype if fmt is None else fmt
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
    spent = 0  # rule steps of the bounds (MAX_BRANCH_STEPS)
    scales: list[float] = []
    skips: list[bool] = []
    guessed: list[bool] = []
    low: list[float | None] = []
    high: list[float | None] = []
    step_low: float | None
    step_high: float | None
    first_departure: int | None = None
    for t, step in enumerate(steps):
        if recorded and t in segment_of and t and exact:  # a resumed run: its own settings and state again
            header = trace.segments[segment_of[t]].header
            settings = recorded_settings(header)
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
        _update(rule, estimate, overflow, s, settings.min_loss_scale)
        # The bounds: every outcome the trace allows.
        if exact:
            spent += len(branches)
            branches, step_low, step_high = _advance(branches, step, rule, floor, underflow, settings.min_loss_scale)
            if len(branches) > MAX_BRANCHES or (spent > MAX_BRANCH_STEPS and len(branches) > 1):
                exact = False
                base = _merge_all(b.acc for b in branches)
                branches = []
        else:  # from here on, any step may overflow or not, at any scale
            step_low, step_high = None, None
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


def _update(rule: Any, state: ScaleState, overflow: bool, scale: float, min_scale: float) -> None:
    """One update of ``state`` as the scaler runs it when the host knows the outcome
    (``dls.loss_scale.LossScale.update``): a clean step at or above the floor on the rule's known-clean path, the
    fewest device ops (``non_clamped_scale`` is then the scale, and no replay reads it)."""
    if not overflow and scale >= min_scale:
        rule.update_(state, _ZERO, known_clean=True)
    else:
        rule.update_(state, _ONE if overflow else _ZERO)


def _advance(
    branches: list[_Branch], step: _Step, rule: Any, floor: float, underflow: _Underflow, min_scale: float
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
            _update(rule, state, overflow, s, min_scale)
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
