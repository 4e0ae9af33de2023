"""What the differential tests against the peers' real packages share (tests/test_peers_deepspeed.py,
tests/test_peers_megatron.py): gradient traces, the overflow decision a scale makes on them, and a dls scaler
driven through its public API.

A trace is a list of gradient magnitudes, one per step, all powers of two (or 0, inf, NaN), so that every product
below is exact in any order. A step overflows when the scaled gradient is not finite in float16:
``float16(m * scale)`` with the product in float32, as a float16 parameter receives it. So a scale too large makes
its own overflows, as in training, and each scaler's skips follow its own scale: the skip decision is compared too.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from typing import Any

import torch

import dls

FLOAT32_MAX = torch.finfo(torch.float32).max


def overflows(m: float, scale: float) -> bool:
    """Whether a gradient of magnitude ``m`` scaled by ``scale`` (any float: the peers' may leave float32) is
    non-finite in float16."""
    scaled = torch.tensor(m, dtype=torch.float32) * torch.tensor(float(scale), dtype=torch.float32)
    return not math.isfinite(float(scaled.half()))


def traces(seed: int, count: int, steps: int) -> Iterator[tuple[str, list[float]]]:
    """``count`` traces of ``steps`` steps, of each kind in turn: random (non-finite gradients with probability
    0.01 to 0.5, magnitudes 2**0 to 2**-12, so a scale above 2**16 to 2**28 overflows by itself), bursty (clean runs
    and bursts of non-finite gradients), clean (zero gradients: the scale grows to its maximum, then a burst), and
    at the minimum (non-finite gradients for most steps: the scale falls to its floor and stays there)."""
    rng = random.Random(seed)
    kinds = ("random", "bursty", "clean", "minimum")
    for i in range(count):
        kind = kinds[i % len(kinds)]
        trace: list[float] = []
        if kind == "random":
            p = rng.choice([0.01, 0.05, 0.2, 0.5])
            trace = [_bad(rng) if rng.random() < p else 2.0 ** -rng.randint(0, 12) for _ in range(steps)]
        elif kind == "bursty":
            while len(trace) < steps:
                trace += [2.0 ** -rng.randint(0, 12)] * rng.randint(0, 12) + [_bad(rng)] * rng.randint(1, 5)
        elif kind == "clean":
            burst_at = rng.randint(steps // 2, steps)
            trace = [0.0] * burst_at + [_bad(rng)] * rng.randint(1, 6)
        else:
            trace = [_bad(rng) if rng.random() < 0.8 else 2.0**-12 for _ in range(steps)]
        yield kind, trace[:steps]


def _bad(rng: random.Random) -> float:
    return rng.choice([math.inf, -math.inf, math.nan])


class DlsRun:
    """A dls scaler stepping a float16 parameter whose gradient is ``m`` times the scale (``step(m)``)."""

    def __init__(self, scaler: dls.GradScaler) -> None:
        self.scaler = scaler
        self.param = torch.nn.Parameter(torch.ones(1, dtype=torch.float16))
        self.opt = torch.optim.SGD([self.param], lr=0.0)

    def step(self, m: float) -> tuple[bool, float]:
        """One iteration through the public API: ``(skipped, scale after update())``."""
        self.scaler.scale((self.param.float() * m).sum()).backward()
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad()
        return self.scaler.step_was_skipped(self.opt), self.scaler.get_scale()

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict()


def field_traces(seed: int, count: int, steps: int, window: int) -> Iterator[tuple[str, list[float]]]:
    """``count`` traces of ``steps`` steps for a growth window of ``window`` steps, of each kind in turn: random
    (non-finite gradients with probability 0.001 to 0.5, magnitudes 2**0 to 2**-24), bursty (clean runs of up to
    twice the window between bursts), sporadic (single overflows a window apart, give or take one step: growth
    timing off by one shows here), clean (zero gradients, a burst at the end: the scale grows as far as it can) and
    at the minimum (non-finite gradients 80 to 100% of the steps: the scale runs into its floor and stays). The
    first kind is the ``seed``-th, so that a few traces per seed still meet every kind across seeds."""
    rng = random.Random(seed)
    kinds = ("random", "bursty", "sporadic", "clean", "minimum")
    for i in range(count):
        kind = kinds[(seed + i) % len(kinds)]
        trace: list[float] = []
        if kind == "random":
            p = rng.choice([0.001, 0.01, 0.05, 0.2, 0.5])
            trace = [_bad(rng) if rng.random() < p else 2.0 ** -rng.randint(0, 24) for _ in range(steps)]
        elif kind == "bursty":
            while len(trace) < steps:
                trace += [2.0 ** -rng.randint(0, 24)] * rng.randint(0, 2 * window + 1) + [_bad(rng)] * rng.randint(1, 5)
        elif kind == "sporadic":
            while len(trace) < steps:
                trace += [0.0] * max(0, rng.choice([1, 2, 3]) * window + rng.randint(-1, 1)) + [_bad(rng)]
        elif kind == "clean":
            burst_at = rng.randint(steps // 2, steps)
            trace = [0.0] * burst_at + [_bad(rng)] * rng.randint(1, 6)
        else:
            p = rng.choice([0.8, 0.95, 1.0])
            trace = [_bad(rng) if rng.random() < p else 2.0**-12 for _ in range(steps)]
        yield kind, trace[:steps]
