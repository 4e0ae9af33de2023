"""The loss-scale update rule, pure: ``(state, found_inf) -> state`` on 0-dim device tensors, never read back.

The dynamic rule, once per ``update()``, with ``f = 1`` if any gradient of the iteration was inf/NaN, else 0:

    steps += 1;  overflows += f;  skipped += f                 # skipped saturates at 2**63 - 1
    if f and overflows / steps > overflow_tolerance:           # an overflow that counts (float32 division)
        steps = overflows = 0                                  # ...resets the growth count
        if budget == 1: scale *= backoff_factor                # budget spent: back off, now and on every
        else:           budget -= 1                            #   further overflow until the next growth
    elif steps >= growth_interval:                             # see the growth timing below
        if isfinite(scale * growth_factor):
            scale *= growth_factor                             # growth that would reach inf is dropped...
        steps = steps_after_growth;  overflows = 0             # ...but still restarts the count
        budget = hysteresis                                    #   and refills the budget
    elif consecutive_hysteresis and not f:
        budget = hysteresis                                    # DeepSpeed's consecutive_hysteresis
    non_clamped = min(scale, max_loss_scale);  scale = max(non_clamped, min_loss_scale)

``budget`` is Megatron-LM's ``hysteresis_tracker`` (DeepSpeed's ``cur_hysteresis``), starting at ``hysteresis``:
with ``hysteresis=1`` every counted overflow backs off. Overflows within ``overflow_tolerance`` (cstorch.amp's
fraction of overflowing updates since the last rescale) neither spend the budget nor reset the counts. Products
are computed in float64 and rounded once to float32: torch's own kernel computes them.

The growth timing is each peer's own, set by the dialect (``ScalerSettings.growth_interval`` and ``rule()``):

* torch.amp and Megatron-LM grow on the interval-th clean step after the last rescale: ``growth_interval`` is the
  interval, ``steps_after_growth = 0``;
* cstorch.amp grows when ``steps_since_rescale > steps_per_increase``: ``growth_interval = steps_per_increase + 1``,
  ``steps_after_growth = 0``;
* DeepSpeed's ``DynamicLossScaler`` grows when ``cur_iter - last_overflow_iter - 1`` (clean updates since the last
  overflow, or since the start, before this one) is a positive multiple of ``scale_window``: its first growth
  comes on the ``(scale_window + 1)``-th clean update, later ones every ``scale_window``, since a growth does not
  restart its count. Here ``growth_interval = scale_window + 1`` and ``steps_after_growth = 1``: ``steps`` is then
  that count of DeepSpeed's, taken modulo the window into ``1..scale_window`` once it is positive.

With ``hysteresis=1``, no tolerance and torch's timing this is torch.amp's rule plus the clamps.

``ScaleState`` is immutable; ``update_`` writes into long-lived buffers so CUDA graphs that captured them see the
new values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

FLOAT32_MAX = torch.finfo(torch.float32).max
FLOAT32_TINY = torch.finfo(torch.float32).tiny  # 2**-126, the smallest normal float32
INT32_MAX = 2**31 - 1  # steps_since_rescale is int32, as torch's growth tracker
INT64_MAX = 2**63 - 1


class ScaleState(NamedTuple):
    """The loss scale and its counters: scales float32, ``steps_since_rescale`` int32 (the growth tracker torch's
    kernel takes), the other counters int64; ``hysteresis_tracker`` is the budget of the module docstring."""

    loss_scale: torch.Tensor
    non_clamped_scale: torch.Tensor
    steps_since_rescale: torch.Tensor
    overflows_since_rescale: torch.Tensor
    num_skipped_steps: torch.Tensor
    hysteresis_tracker: torch.Tensor


def initial_state(loss_scale: float, hysteresis: int = 1, device: torch.device | str | None = None) -> ScaleState:
    """A fresh state holding ``loss_scale``, every counter at zero and the hysteresis budget full."""
    scale = torch.tensor(loss_scale, dtype=torch.float32, device=device)
    zero = torch.zeros((), dtype=torch.int64, device=device)
    steps = torch.zeros((), dtype=torch.int32, device=device)
    budget = torch.tensor(hysteresis, dtype=torch.int64, device=device)
    return ScaleState(scale, scale.clone(), steps, zero.clone(), zero.clone(), budget)


def assign_(state: ScaleState, new: ScaleState) -> None:
    """Copy ``new`` into the buffers of ``state``, so graphs that captured those buffers see the new values."""
    for dst, src in zip(state, new):
        if dst is not src:
            dst.copy_(src)


def shown(value: object) -> str:
    """``value`` for an error message: a tensor by its dtype and shape, anything else by its ``repr``, cut short
    (a 400-digit integer or a long list would bury the message)."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}... ({len(text)} characters)"


# Validators shared by the rules, dls.settings and the trainer's config: each returns None when ``value`` is
# allowed, else a message that names ``name`` and says what is allowed.
def python_number(value: object) -> int | float | None:
    """The Python ``int`` or ``float`` that ``value`` stands for: itself, a NumPy scalar or 0-dim array, or a 0-dim
    tensor of a real dtype (as torch.amp takes them); ``None`` for anything else. A bool is a flag, never a number,
    and so are NumPy's and torch's bools."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.dtype == torch.bool or value.is_complex() or value.is_meta:
            return None
        value = value.item()
    elif type(value).__module__ == "numpy" and getattr(value, "shape", None) == ():
        value = value.item()  # type: ignore[attr-defined]  # NumPy scalars and 0-dim arrays: a Python number
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value


def _real(value: object) -> float | None:
    """``value`` as a float when it is a real number (``python_number``) that a float can hold, else ``None``."""
    number = python_number(value)
    if number is None:
        return None
    try:
        return float(number)
    except OverflowError:  # an int beyond float's range
        return None


def scale_problem(name: str, value: object) -> str | None:
    """A loss scale must be a normal float32 (2**-126 to float32's max): its inverse is then finite too, so
    unscaling never multiplies by inf (0 * inf would turn every gradient into NaN)."""
    v = _real(value)
    if v is not None and FLOAT32_TINY <= v <= FLOAT32_MAX:
        return None
    return f"{name} must be a number from 2**-126 to float32's max 3.4028e38 (a normal float32); got {shown(value)}"


def factor_problem(name: str, value: object, above_one: bool) -> str | None:
    """``growth_factor`` (``above_one``) must be in (1, float32 max]; ``backoff_factor`` in (0, 1)."""
    v = _real(value)
    if v is not None and (1 < v <= FLOAT32_MAX if above_one else 0 < v < 1):
        return None
    allowed = "a number > 1" if above_one else "a number in (0, 1)"
    return f"{name} must be {allowed}; got {shown(value)}"


def count_problem(name: str, value: object, maximum: int = INT32_MAX) -> str | None:
    """A count (a growth interval, a hysteresis) is a positive integer — a Python int, a NumPy integer or a 0-dim
    integer tensor, never a float such as ``100.0`` — that fits the int32 counters it is compared with. The one
    statement of this rule: the scaler's arguments and the trainer's config both use it."""
    number = python_number(value)
    if isinstance(number, int) and 1 <= number <= maximum:
        return None
    limit = "2**31 - 1" if maximum == INT32_MAX else f"2**31 - {INT32_MAX + 1 - maximum}"
    return (
        f"{name} must be an integer from 1 to {limit} (a count: an int, not a float such as 100.0; the counters "
        f"are int32, as torch's); got {shown(value)}"
    )


def flag_problem(name: str, value: object) -> str | None:
    if isinstance(value, bool):
        return None
    return f"{name} must be True or False; got {shown(value)}"


def limit_problem(name: str, value: object) -> str | None:
    """A gradient limit (``max_gradient_norm``, ``max_gradient_value``): a positive finite number (never a bool) or
    ``None``."""
    v = _real(value)
    if value is None or (v is not None and 0 < v < math.inf):
        return None
    return f"{name} must be a positive finite number or None; got {shown(value)}"


def tolerance_problem(name: str, value: object) -> str | None:
    v = _real(value)
    if v is not None and 0 <= v < 1:
        return None
    return f"{name} must be a number in [0, 1); got {shown(value)}"


def _raise_first(*problems: str | None) -> None:
    for problem in problems:
        if problem is not None:
            raise ValueError(problem)


@dataclass(frozen=True)
class StaticRule:
    """A fixed scale. Overflowing steps are still skipped and counted; nothing else changes."""

    def update(self, state: ScaleState, found_inf: torch.Tensor) -> ScaleState:
        return state._replace(num_skipped_steps=count_skip(state.num_skipped_steps, found_inf))

    def update_(self, state: ScaleState, found_inf: torch.Tensor, saturate: bool = True) -> None:
        """``update`` written into ``state``'s buffers (``saturate=False``: the caller knows the skip count is far
        from its maximum, one op fewer)."""
        _count_skip_(state.num_skipped_steps, found_inf > 0, saturate)


@dataclass(frozen=True)
class DynamicRule:
    """The dynamic rule of the module docstring."""

    growth_interval: int = 2000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    overflow_tolerance: float = 0.0
    hysteresis: int = 1
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 2.0**-14
    max_loss_scale: float = 2.0**15
    steps_after_growth: int = 0  # DeepSpeed's timing: 1 (see the module docstring)

    def __post_init__(self) -> None:
        _raise_first(
            count_problem("growth_interval", self.growth_interval),
            None
            if self.steps_after_growth in (0, 1) and self.steps_after_growth < self.growth_interval
            else f"steps_after_growth must be 0, or 1 with a growth_interval above 1; got {self.steps_after_growth!r}",
            count_problem("hysteresis", self.hysteresis),
            flag_problem("consecutive_hysteresis", self.consecutive_hysteresis),
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
        """The rule on a copy of ``state``."""
        new = ScaleState(*(t.clone() for t in state))
        self.update_(new, found_inf)
        return new

    def update_(
        self, state: ScaleState, found_inf: torch.Tensor, saturate: bool = True, count_skip: bool = True
    ) -> None:
        """``update`` written into ``state``'s buffers, around torch's fused kernel (``torch._amp_update_scale_``:
        back off and reset the count on an overflow, else count, and grow at the interval unless the product would
        be inf, resetting the count either way). The kernel is told only of counted overflows; a counted overflow
        the budget absorbs gets its scale back. Device ops with ``saturate=False`` (2 more with it): 5 for torch's
        rule, 14 with hysteresis, 12 with tolerance, 21 with both and ``consecutive_hysteresis``, 8 with DeepSpeed's
        timing and 16 with its hysteresis (tests/test_update.py counts them).

        ``steps_since_rescale`` must be below ``growth_interval`` (the caller clamps it when it loads a state or
        shortens the interval), as after every update: the kernel grows at ``==``. ``count_skip=False`` leaves
        ``num_skipped_steps`` to the caller.
        """
        s, hysteresis, tolerance = state, self.hysteresis > 1, self.overflow_tolerance > 0
        after = self.steps_after_growth
        # As a mask, where something below needs one (torch's rule without the skip count: nothing does).
        overflow = found_inf > 0 if count_skip or hysteresis or tolerance or after else found_inf
        counted_inf = found_inf  # what the kernel backs off on: counted overflows only
        if tolerance:
            s.overflows_since_rescale.add_(overflow)
            # int / int is a float32 division of the counts: the documented contract of the tolerance test.
            counted_inf = found_inf * (
                s.overflows_since_rescale / (s.steps_since_rescale + 1) > self.overflow_tolerance
            )
        if hysteresis or after:
            counted = counted_inf > 0 if tolerance else overflow
        if hysteresis:
            absorbed = counted & (s.hysteresis_tracker > 1)  # the budget pays: no back-off
            before = s.loss_scale.clone()
        torch._amp_update_scale_(
            s.loss_scale,
            s.steps_since_rescale,
            counted_inf,
            self.growth_factor,
            self.backoff_factor,
            self.growth_interval,
        )
        scale = s.loss_scale
        if hysteresis or tolerance or after:
            reset = s.steps_since_rescale == 0  # the kernel resets the count on a counted overflow or a growth
        if tolerance:
            s.overflows_since_rescale.masked_fill_(reset, 0)
        if hysteresis or after:
            grew = reset > counted  # a growth event (reset & ~counted)
        if after:
            s.steps_since_rescale.add_(grew, alpha=after)
        if hysteresis:
            scale = torch.where(absorbed, before, scale)
            s.hysteresis_tracker.add_(absorbed, alpha=-1)  # sub_ refuses a bool
            refill = grew
            if self.consecutive_hysteresis:
                refill = refill >= overflow  # DeepSpeed: also after a clean step (refill | ~overflow)
            s.hysteresis_tracker.masked_fill_(refill, self.hysteresis)
        torch.clamp(scale, max=self.max_loss_scale, out=s.non_clamped_scale)
        torch.clamp(s.non_clamped_scale, min=self.min_loss_scale, out=s.loss_scale)
        if count_skip:
            _count_skip_(s.num_skipped_steps, overflow, saturate)

    def update_known_(self, state: ScaleState, found_inf: torch.Tensor, overflow: bool) -> None:
        """``update_`` when the host knows the flag's value (``overflow``) and the scale is within its bounds,
        without counting the skip (the caller counts it on the host). After a clean step every rule is torch's
        kernel (``steps + 1``, growth at the interval, dropped if it would reach inf, the count reset either way)
        plus the budget refill where the count was reset (and DeepSpeed's count set to 1 there), and a max clamp
        only when ``max_loss_scale`` is below float32's max; ``non_clamped_scale`` is then left stale (it equals
        ``loss_scale``)."""
        if overflow:
            self.update_(state, found_inf, count_skip=False)
            return
        torch._amp_update_scale_(
            state.loss_scale,
            state.steps_since_rescale,
            found_inf,
            self.growth_factor,
            self.backoff_factor,
            self.growth_interval,
        )
        if self.hysteresis > 1 and self.consecutive_hysteresis:
            state.hysteresis_tracker.fill_(self.hysteresis)
        refill = self.hysteresis > 1 and not self.consecutive_hysteresis
        if refill or self.overflow_tolerance > 0 or self.steps_after_growth:
            grew = state.steps_since_rescale == 0  # the kernel resets the count exactly on a growth event
            if refill:
                state.hysteresis_tracker.masked_fill_(grew, self.hysteresis)
            if self.overflow_tolerance > 0:
                state.overflows_since_rescale.masked_fill_(grew, 0)
            if self.steps_after_growth:
                state.steps_since_rescale.add_(grew, alpha=self.steps_after_growth)
        if self.max_loss_scale < FLOAT32_MAX:
            state.loss_scale.clamp_(max=self.max_loss_scale)


def count_skip(skipped: torch.Tensor, found_inf: torch.Tensor) -> torch.Tensor:
    """``skipped + f``, saturating at the int64 maximum instead of wrapping negative."""
    return skipped + ((found_inf > 0) & (skipped < INT64_MAX)).long()


def _count_skip_(skipped: torch.Tensor, overflow: torch.Tensor, saturate: bool) -> None:
    skipped.add_(overflow & (skipped < INT64_MAX) if saturate else overflow)
