"""Recommending loss-scaling settings from a trace (``dls tune``): each policy's stated grid of settings
(``PolicyKind.grid`` in ``dls.diagnostics.policies``) replayed over the trace (``dls.diagnostics.replaying``) and
ranked: the fewest skipped steps in the worst case the trace allows, then the estimate, among the settings whose
underflow stays within a limit."""

from __future__ import annotations

import difflib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dls.checks import shown
from dls.diagnostics.policies import POLICIES, Policy, buildable, config_number, parse_policy
from dls.diagnostics.replaying import Replay, replay
from dls.diagnostics.trace import Trace

__all__ = ["TuneResult", "tune"]


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
        trace: a trace from ``dls.diagnostics.trace.read_trace``.
        kinds: policy names of ``POLICIES`` (default: all that this dls can build).
        max_underflow: the largest mean underflow fraction allowed (by its upper bound); ``None``: no limit.
        fmt: the format of the underflow (default: the trace's half dtype).

    Raises:
        ValueError: an unknown policy name or one given twice, a ``max_underflow`` outside [0, 1], or a trace
            without histograms while ``max_underflow`` is set.
    """
    if max_underflow is not None and (
        isinstance(max_underflow, bool) or not isinstance(max_underflow, (int, float)) or not 0 <= max_underflow <= 1
    ):
        raise ValueError(f"max_underflow must be a number in [0, 1] or None; got {max_underflow!r}")
    names = list(kinds) if kinds else [k for k in POLICIES if buildable(k, trace)]
    for i, name in enumerate(names):
        if name not in POLICIES:
            close = difflib.get_close_matches(str(name), list(POLICIES), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"unknown policy {shown(name)}{hint}; allowed: {', '.join(POLICIES)}")
        if name in names[:i]:
            raise ValueError(f"policy {name!r} is given twice; give each policy once")
    if max_underflow is not None and not any("exponents" in row for row in trace.steps):
        raise ValueError(
            "the trace has no gradient histograms, so underflow cannot be bounded: record with histogram_every, "
            "or pass max_underflow=None (--max-underflow none)"
        )
    policies: list[Policy] = []
    for name in names:
        kind = POLICIES[name]
        keys = list(kind.grid)
        for combo in itertools.product(*(kind.grid[k] for k in keys)):
            spec = name + ":" + ",".join(f"{k}={config_number(v)}" for k, v in zip(keys, combo))
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
