"""Loss-scale update rules as pure tensor functions.

A rule maps ``(state, found_inf) -> state``. Everything is a 0-dim tensor on the scale's device, so an update
never reads a value back to the host: it can run inside CUDA graphs and ``torch.compile`` graphs, and a
training loop that never asks for the scale never synchronises on it.

``ScaleState`` is immutable; the rules return new tensors and the caller decides whether to copy them into
long-lived buffers (the scaler does, so CUDA graphs that captured those buffers see the new values).

The dynamic rule, applied once per iteration with ``f = 1`` if any gradient was inf/NaN:

1. ``steps_since_rescale += 1``; ``overflows_since_rescale += f``; ``num_skipped_steps += f``.
2. If ``f`` and ``overflows_since_rescale / steps_since_rescale > overflow_tolerance``: one hysteresis hit;
   after ``hysteresis`` hits the scale is multiplied by ``backoff_factor`` and the hits reset. The step
   counters reset on every hit.
3. Else, if ``steps_since_rescale >= steps_per_increase``: the scale is multiplied by ``growth_factor``
   unless that would leave float32's finite range; counters and hits reset.
4. Clamp to ``max_loss_scale`` (this is the *non-clamped* scale that callers can inspect), then to
   ``min_loss_scale``.

With ``overflow_tolerance=0`` and ``hysteresis=1`` this is ``torch.amp.GradScaler``'s rule with
``growth_interval = steps_per_increase``, plus the clamps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

FLOAT32_MAX = torch.finfo(torch.float32).max
FLOAT32_TINY = torch.finfo(torch.float32).tiny  # 2**-126, the smallest normal float32
MAX_STEPS_PER_INCREASE = 2**31 - 1  # steps_since_rescale is int32, as torch's growth tracker


class ScaleState(NamedTuple):
    """The loss scale and its counters: scales float32, ``steps_since_rescale`` int32 (the growth tracker torch's
    kernel takes), the other counters int64."""

    loss_scale: torch.Tensor
    non_clamped_scale: torch.Tensor
    steps_since_rescale: torch.Tensor
    overflows_since_rescale: torch.Tensor
    num_skipped_steps: torch.Tensor
    hysteresis_hits: torch.Tensor


def initial_state(loss_scale: float, device: torch.device | str | None = None) -> ScaleState:
    """A fresh state holding ``loss_scale`` with every counter at zero."""
    scale = torch.tensor(loss_scale, dtype=torch.float32, device=device)
    zero = torch.zeros((), dtype=torch.int64, device=device)
    steps = torch.zeros((), dtype=torch.int32, device=device)
    return ScaleState(scale, scale.clone(), steps, zero.clone(), zero.clone(), zero.clone())


def assign_(state: ScaleState, new: ScaleState) -> None:
    """Copy ``new`` into the buffers of ``state``, so graphs that captured those buffers see the new values."""
    for dst, src in zip(state, new):
        if dst is not src:
            dst.copy_(src)


def _times(scale: torch.Tensor, factor: float) -> torch.Tensor:
    """``scale * factor`` computed in float64 and rounded once to float32, as torch's update kernel does (a
    float32 multiply would round 0.3 first: 90 * 0.3 gives 27.000002). MPS has no float64."""
    if scale.device.type == "mps":
        return scale * factor
    return (scale.double() * factor).float()


# Validators shared by the rules, dls.settings and the trainer's config: each returns None when ``value`` is
# allowed, else a message that names ``name`` and says what is allowed.
def _real(value: object) -> float | None:
    """``value`` as a float when it is a real number (not a bool) that a float can hold, else ``None``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value)
    except OverflowError:  # an int beyond float's range
        return None


def scale_problem(name: str, value: object) -> str | None:
    """A loss scale must be a normal float32 (2**-126 to float32's max): its inverse is then finite too, so
    unscaling never multiplies by inf (0 * inf would turn every gradient into NaN)."""
    v = _real(value)
    if v is not None and FLOAT32_TINY <= v <= FLOAT32_MAX:
        return None
    return f"{name} must be a number from 2**-126 to float32's max 3.4028e38 (a normal float32); got {value!r}"


def factor_problem(name: str, value: object, above_one: bool) -> str | None:
    """``growth_factor`` (``above_one``) must be in (1, float32 max]; ``backoff_factor`` in (0, 1)."""
    v = _real(value)
    if v is not None and (1 < v <= FLOAT32_MAX if above_one else 0 < v < 1):
        return None
    allowed = "a number > 1" if above_one else "a number in (0, 1)"
    return f"{name} must be {allowed}; got {value!r}"


def count_problem(name: str, value: object, maximum: int = MAX_STEPS_PER_INCREASE) -> str | None:
    """A positive integer that fits the int32 counters it is compared with."""
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= maximum:
        return None
    return f"{name} must be an integer from 1 to 2**31 - 1 (the counters are int32, as torch's); got {value!r}"


def limit_problem(name: str, value: object) -> str | None:
    """A gradient limit (``max_gradient_norm``, ``max_gradient_value``): a positive finite number (never a bool) or
    ``None``."""
    v = _real(value)
    if value is None or (v is not None and 0 < v < math.inf):
        return None
    return f"{name} must be a positive finite number or None; got {value!r}"


def tolerance_problem(name: str, value: object) -> str | None:
    v = _real(value)
    if v is not None and 0 <= v < 1:
        return None
    return f"{name} must be a number in [0, 1); got {value!r}"


def _raise_first(*problems: str | None) -> None:
    for problem in problems:
        if problem is not None:
            raise ValueError(problem)


@dataclass(frozen=True)
class StaticRule:
    """A fixed scale. Overflowing steps are still skipped and counted; nothing else changes."""

    def update(self, state: ScaleState, found_inf: torch.Tensor) -> ScaleState:
        f = (found_inf > 0).to(torch.int64)
        return state._replace(num_skipped_steps=state.num_skipped_steps + f)

    def update_(self, state: ScaleState, found_inf: torch.Tensor) -> None:
        """``update`` written into ``state``'s buffers."""
        state.num_skipped_steps.add_((found_inf > 0).to(torch.int64))


@dataclass(frozen=True)
class DynamicRule:
    """Grow the scale after ``steps_per_increase`` clean steps, back off on overflow (see module docstring)."""

    steps_per_increase: int = 2000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    overflow_tolerance: float = 0.0
    hysteresis: int = 1
    min_loss_scale: float = 2.0**-14
    max_loss_scale: float = 2.0**15

    def __post_init__(self) -> None:
        _raise_first(
            count_problem("steps_per_increase", self.steps_per_increase),
            count_problem("hysteresis", self.hysteresis),
            factor_problem("growth_factor", self.growth_factor, above_one=True),
            factor_problem("backoff_factor", self.backoff_factor, above_one=False),
            tolerance_problem("overflow_tolerance", self.overflow_tolerance),
            scale_problem("min_loss_scale", self.min_loss_scale),
            scale_problem("max_loss_scale", self.max_loss_scale),
        )
        if self.min_loss_scale > self.max_loss_scale:
            raise ValueError(
                f"min_loss_scale ({self.min_loss_scale!r}) must not exceed max_loss_scale ({self.max_loss_scale!r})"
            )

    def update(self, state: ScaleState, found_inf: torch.Tensor) -> ScaleState:
        overflow = found_inf > 0
        f = overflow.to(torch.int64)
        steps = state.steps_since_rescale + 1
        overflows = state.overflows_since_rescale + f
        # float32 division on both sides of the comparison: the documented contract of the tolerance test.
        over_tolerance = overflow & (overflows.float() / steps.float() > self.overflow_tolerance)
        hits = state.hysteresis_hits + over_tolerance.to(torch.int64)
        backoff = over_tolerance & (hits >= self.hysteresis)
        grown = _times(state.loss_scale, self.growth_factor)
        grow = ~over_tolerance & (steps >= self.steps_per_increase)
        scale = torch.where(backoff, _times(state.loss_scale, self.backoff_factor), state.loss_scale)
        # Growth that leaves float32's finite range is dropped, but the counters still reset (as in torch).
        scale = torch.where(grow & torch.isfinite(grown), grown, scale)
        reset_counters = over_tolerance | grow
        zero = torch.zeros_like(steps)
        non_clamped = torch.clamp(scale, max=self.max_loss_scale)
        return ScaleState(
            loss_scale=torch.clamp(non_clamped, min=self.min_loss_scale),
            non_clamped_scale=non_clamped,
            steps_since_rescale=torch.where(reset_counters, zero, steps),
            overflows_since_rescale=torch.where(reset_counters, zero, overflows),
            num_skipped_steps=state.num_skipped_steps + f,
            hysteresis_hits=torch.where(backoff | grow, zero, hits),
        )

    def update_(self, state: ScaleState, found_inf: torch.Tensor) -> None:
        """``update`` written into ``state``'s buffers: the same values, in about 6 ops instead of 35.

        With ``overflow_tolerance=0`` and ``hysteresis=1`` the rule is exactly torch's, so torch's fused kernel
        computes it (the overflow counter and the hits then stay 0).
        """
        if not self._torch_rule:
            assign_(state, self.update(state, found_inf))
            return
        # torch's kernel grows at tracker + 1 == interval; a loaded tracker at or past it must grow next time.
        state.steps_since_rescale.clamp_(max=self.steps_per_increase - 1)
        torch._amp_update_scale_(
            state.loss_scale,
            state.steps_since_rescale,
            found_inf,
            self.growth_factor,
            self.backoff_factor,
            self.steps_per_increase,
        )
        torch.clamp(state.loss_scale, max=self.max_loss_scale, out=state.non_clamped_scale)
        torch.clamp(state.non_clamped_scale, min=self.min_loss_scale, out=state.loss_scale)
        state.num_skipped_steps.add_((found_inf > 0).to(torch.int64))

    @property
    def _torch_rule(self) -> bool:
        return self.overflow_tolerance == 0 and self.hysteresis == 1
