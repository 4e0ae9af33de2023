"""Each peer's loss-scale rule, once: pure ``(state, found_inf) -> state`` on 0-dim device tensors, never read back;
the state each rule acts on; and ``PEERS``, the one table of the peers dls follows (their defaults and timing).

The dynamic rule of torch.amp, cstorch.amp, Megatron-LM and DeepSpeed, once per ``update()``, with ``f = 1`` if any
gradient of the iteration was inf/NaN, else 0:

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

The growth timing is each peer's own, set by its row of ``PEERS`` (``growth_offset``, ``steps_after_growth``):

* torch.amp and Megatron-LM grow on the interval-th clean step after the last rescale: ``growth_interval`` is the
  interval, ``steps_after_growth = 0``;
* cstorch.amp grows when ``steps_since_rescale > steps_per_increase``: ``growth_interval = steps_per_increase + 1``,
  ``steps_after_growth = 0``;
* DeepSpeed's ``DynamicLossScaler`` grows when ``cur_iter - last_overflow_iter - 1`` (clean updates since the last
  overflow, or since the start, before this one) is a positive multiple of ``scale_window``: its first growth
  comes on the ``(scale_window + 1)``-th clean update, later ones every ``scale_window``, since a growth does not
  restart its count. Here ``growth_interval = scale_window + 1`` and ``steps_after_growth = 1``: ``steps`` is then
  that count of DeepSpeed's, taken modulo the window into ``1..scale_window`` once it is positive.

With ``hysteresis=1``, no tolerance and torch's timing this is torch.amp's rule plus the clamps. A static scale
(``StaticRule``) only counts the skipped steps.

The field's other peers (rows of ``PEERS``; their arguments' meaning in ``dls.settings.ScalerSettings.<name>``),
read in their code (where their documentation says otherwise, the code is followed):

* Keras 3's ``LossScaleOptimizer`` (keras 3.15.1, ``keras/src/optimizers/loss_scale_optimizer.py:213-244``): this
  rule with torch's timing (``step_counter == dynamic_growth_steps - 1`` grows), factors 2 and 0.5, no bounds;
* Apex amp's ``LossScaler`` (tag 25.05, ``apex/amp/scaler.py:38-52`` and ``197-217``): torch's timing
  (``_unskipped == scale_window``), x2 and /2 whatever ``scale_factor`` says, ``max_loss_scale`` (``2**24``) and an
  optional ``min_loss_scale``, the start clamped to the maximum;
* Apex fp16_utils' ``DynamicLossScaler`` (tag 25.05, ``apex/fp16_utils/loss_scaler.py:115-123``): it grows when
  ``(cur_iter - last_overflow_iter) % scale_window == 0``, which is torch's timing, and backs off to
  ``max(scale / scale_factor, 1)``: the floor 1;
* ColossalAI's ``DynamicGradScaler`` (0.5.0, ``colossalai/amp/naive_amp/grad_scaler/dynamic_grad_scaler.py:78-115``):
  its hysteresis count (up from 0 at each overflow, a back-off at every overflow once it reaches ``hysteresis``,
  reset only by a growth) is this rule's budget ``hysteresis - count``; torch's timing; scales and factors are
  float32 tensors, and rounded so here;
* jmp's ``DynamicLossScale.adjust`` (0.0.4, ``jmp/_src/loss_scale.py:149-174``): it grows when ``counter ==
  period - 1`` (torch's timing, the counter reset by an overflow), drops a growth to inf (``first_finite``) and backs
  off to ``max(min_loss_scale, scale / factor)``;
* fairseq (``FairseqRule``) and MXNet (``MxnetRule``) have rules of their own.

What every rule offers the scaler (``Rule``): ``initial_state``, ``update_`` (the rule written into the state's
buffers, so that CUDA graphs that captured them see the new values; ``known_clean`` leaves out what an update whose
flag the host knows to be clean cannot change) and ``normalise_`` (counters loaded from elsewhere brought within
what the rule holds, before its next update). A rule's state is a ``NamedTuple`` of 0-dim tensors with the fields
``loss_scale`` (float32) and ``num_skipped_steps`` (int64); its other fields are the rule's own counters,
saved under their names in the scaler's state dict (``dls.scaler_state``). How to add a peer's rule:
``docs/architecture.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Protocol

import torch

from dls import checks
from dls.deprecated import warn_renamed

if TYPE_CHECKING:
    from dls.settings import ScalerSettings


class ScaleState(NamedTuple):
    """The state of the dynamic and the static rule: scales float32, ``steps_since_rescale`` int32 (the growth
    tracker torch's kernel takes), the other counters int64; ``hysteresis_tracker`` is the budget of the module
    docstring."""

    loss_scale: torch.Tensor
    non_clamped_scale: torch.Tensor
    steps_since_rescale: torch.Tensor
    overflows_since_rescale: torch.Tensor
    num_skipped_steps: torch.Tensor
    hysteresis_tracker: torch.Tensor


def initial_state(loss_scale: float, hysteresis: int = 1, device: torch.device | str | None = None) -> ScaleState:
    """A fresh ``ScaleState`` holding ``loss_scale``, every counter at zero and the hysteresis budget full."""
    scale = torch.tensor(loss_scale, dtype=torch.float32, device=device)
    zero = torch.zeros((), dtype=torch.int64, device=device)
    steps = torch.zeros((), dtype=torch.int32, device=device)
    budget = torch.tensor(hysteresis, dtype=torch.int64, device=device)
    return ScaleState(scale, scale.clone(), steps, zero, zero.clone(), budget)


def assign_(state: Any, new: Any) -> None:
    """Copy the tensors of ``new`` into the buffers of ``state`` (a rule's state, same type), so graphs that
    captured those buffers see the new values."""
    for dst, src in zip(state, new):
        if dst is not src:
            dst.copy_(src)


def count_skip(skipped: torch.Tensor, found_inf: torch.Tensor) -> torch.Tensor:
    """``skipped + f``, saturating at the int64 maximum instead of wrapping negative."""
    return skipped + ((found_inf > 0) & (skipped < checks.INT64_MAX)).long()


def _count_skip_(skipped: torch.Tensor, overflow: torch.Tensor, saturate: bool) -> None:
    skipped.add_(overflow & (skipped < checks.INT64_MAX) if saturate else overflow)


class Rule(Protocol):
    """What the scaler (``dls.loss_scale``) and the policy lab ask of a rule."""

    State: ClassVar[type[Any]]  # its state, a NamedTuple of 0-dim tensors (the module docstring)

    def initial_state(self, loss_scale: float, device: torch.device | str | None = None) -> Any:
        """A fresh state (the rule's ``NamedTuple``) starting at ``loss_scale``."""
        ...

    def update_(self, state: Any, found_inf: torch.Tensor, *, known_clean: bool = False, saturate: bool = True) -> None:
        """One update, written into ``state``'s buffers. ``known_clean``: the caller knows that ``found_inf`` is 0
        and that the scale is at least the rule's ``min_loss_scale`` (a step decided on the host): the rule may leave
        out what such an update cannot change, and leaves ``non_clamped_scale`` unwritten (it is the scale).
        ``saturate=False``: the caller knows the skip count is far from its maximum."""
        ...

    def normalise_(self, state: Any) -> None:
        """Bring counters loaded from elsewhere (or left by other settings) within what this rule holds."""
        ...

    def lowest_after(self, scale_at_least: float, known_clean: bool) -> float:
        """A lower bound of the scale after one update, given ``scale_at_least`` before it (``dls.loss_scale``'s
        host bound: a rule that may lower the scale after a clean flag says so here)."""
        ...


@dataclass(frozen=True)
class StaticRule:
    """A fixed scale. Overflowing steps are still skipped and counted; nothing else changes. ``hysteresis``: the
    budget its state carries (a state dict holds it), never spent."""

    hysteresis: int = 1
    State: ClassVar[type[ScaleState]] = ScaleState

    def initial_state(self, loss_scale: float, device: torch.device | str | None = None) -> ScaleState:
        return initial_state(loss_scale, self.hysteresis, device)

    def update(self, state: ScaleState, found_inf: torch.Tensor) -> ScaleState:
        return state._replace(num_skipped_steps=count_skip(state.num_skipped_steps, found_inf))

    def update_(
        self, state: ScaleState, found_inf: torch.Tensor, *, known_clean: bool = False, saturate: bool = True
    ) -> None:
        if not known_clean:
            _count_skip_(state.num_skipped_steps, found_inf > 0, saturate)

    def normalise_(self, state: ScaleState) -> None:
        state.hysteresis_tracker.clamp_(min=1, max=self.hysteresis)

    def lowest_after(self, scale_at_least: float, known_clean: bool) -> float:
        return scale_at_least


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
    State: ClassVar[type[ScaleState]] = ScaleState

    def __post_init__(self) -> None:
        checks.raise_first(
            checks.count_problem("growth_interval", self.growth_interval),
            None
            if self.steps_after_growth in (0, 1) and self.steps_after_growth < self.growth_interval
            else f"steps_after_growth must be 0, or 1 with a growth_interval above 1; got {self.steps_after_growth!r}",
            checks.count_problem("hysteresis", self.hysteresis),
            checks.flag_problem("consecutive_hysteresis", self.consecutive_hysteresis),
            checks.factor_problem("growth_factor", self.growth_factor, above_one=True),
            checks.factor_problem("backoff_factor", self.backoff_factor, above_one=False),
            checks.tolerance_problem("overflow_tolerance", self.overflow_tolerance),
            checks.scale_problem("min_loss_scale", self.min_loss_scale),
            checks.scale_problem("max_loss_scale", self.max_loss_scale),
        )
        if self.min_loss_scale > self.max_loss_scale:
            raise ValueError(
                f"min_loss_scale ({self.min_loss_scale!r}) must not exceed max_loss_scale ({self.max_loss_scale!r})"
            )

    @classmethod
    def from_settings(cls, settings: ScalerSettings) -> DynamicRule:
        """The rule of ``settings``, with the growth timing of its dialect's row of ``PEERS``."""
        return cls(
            growth_interval=settings.growth_interval,
            steps_after_growth=PEERS[settings.dialect].steps_after_growth,
            consecutive_hysteresis=settings.consecutive_hysteresis,
            growth_factor=settings.growth_factor,
            backoff_factor=settings.backoff_factor,
            overflow_tolerance=settings.overflow_tolerance,
            hysteresis=settings.hysteresis,
            min_loss_scale=settings.min_loss_scale,
            max_loss_scale=settings.max_loss_scale,
        )

    def initial_state(self, loss_scale: float, device: torch.device | str | None = None) -> ScaleState:
        return initial_state(loss_scale, self.hysteresis, device)

    def update(self, state: ScaleState, found_inf: torch.Tensor) -> ScaleState:
        """The rule on a copy of ``state``."""
        new = ScaleState(*(t.clone() for t in state))
        self.update_(new, found_inf)
        return new

    def update_(
        self, state: ScaleState, found_inf: torch.Tensor, *, known_clean: bool = False, saturate: bool = True
    ) -> None:
        """``update`` written into ``state``'s buffers, around torch's fused kernel (``torch._amp_update_scale_``:
        back off and reset the count on an overflow, else count, and grow at the interval unless the product would
        be inf, resetting the count either way). The kernel is told only of counted overflows; a counted overflow
        the budget absorbs gets its scale back. Device ops with ``saturate=False`` (2 more with it): 5 for torch's
        rule, 14 with hysteresis, 12 with tolerance, 21 with both and ``consecutive_hysteresis``, 8 with DeepSpeed's
        timing and 16 with its hysteresis; ``known_clean`` (``Rule.update_``): torch's kernel alone for torch's
        rule, plus the restart of the count after a growth, the budget's refill, the reset of the overflow count and
        a max clamp where each applies (tests/test_update.py counts them).

        ``steps_since_rescale`` must be below ``growth_interval`` (``normalise_`` brings loaded counters there), as
        after every update: the kernel grows at ``==``.
        """
        s, hysteresis, tolerance = state, self.hysteresis > 1, self.overflow_tolerance > 0
        after, clean = self.steps_after_growth, known_clean
        overflow = found_inf > 0 if not clean else found_inf  # a mask (a clean flag needs none: it is 0)
        counted_inf = found_inf  # what the kernel backs off on: counted overflows only
        if tolerance and not clean:
            s.overflows_since_rescale.add_(overflow)
            # int / int is a float32 division of the counts: the documented contract of the tolerance test.
            counted_inf = found_inf * (
                s.overflows_since_rescale / (s.steps_since_rescale + 1) > self.overflow_tolerance
            )
        if (hysteresis or after) and not clean:
            counted = counted_inf > 0 if tolerance else overflow
        if hysteresis and not clean:
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
        refill_all = self.consecutive_hysteresis and clean  # every clean step refills: no mask needed
        if tolerance or after or (hysteresis and not refill_all):
            reset = s.steps_since_rescale == 0  # the kernel resets the count on a counted overflow or a growth
        if after or (hysteresis and not refill_all):
            grew = reset if clean else reset > counted  # a growth event (reset & ~counted)
        if tolerance:
            s.overflows_since_rescale.masked_fill_(reset, 0)
        if after:
            s.steps_since_rescale.add_(grew, alpha=after)
        if hysteresis and not clean:
            scale = torch.where(absorbed, before, scale)
            s.hysteresis_tracker.add_(absorbed, alpha=-1)  # sub_ refuses a bool
        if hysteresis and refill_all:
            s.hysteresis_tracker.fill_(self.hysteresis)
        elif hysteresis:  # DeepSpeed's consecutive_hysteresis also refills after a clean step (grew | ~overflow)
            s.hysteresis_tracker.masked_fill_(
                grew >= overflow if self.consecutive_hysteresis else grew, self.hysteresis
            )
        if clean:  # the scale did not fall and was at least min_loss_scale: only growth can pass the maximum
            if self.max_loss_scale < checks.FLOAT32_MAX:
                s.loss_scale.clamp_(max=self.max_loss_scale)
            return
        torch.clamp(scale, max=self.max_loss_scale, out=s.non_clamped_scale)
        torch.clamp(s.non_clamped_scale, min=self.min_loss_scale, out=s.loss_scale)
        _count_skip_(s.num_skipped_steps, overflow, saturate)

    def normalise_(self, state: ScaleState) -> None:
        """Counters at or past the growth interval (loaded, or the interval shortened) are brought to one below it,
        so that the next clean update grows and no counter wraps; the budget into ``[1, hysteresis]``."""
        most = self.growth_interval - 1
        state.steps_since_rescale.clamp_(max=most)
        state.overflows_since_rescale.clamp_(max=most)
        state.hysteresis_tracker.clamp_(min=1, max=self.hysteresis)

    def lowest_after(self, scale_at_least: float, known_clean: bool) -> float:
        """A clean update only grows the scale (or clamps it to the maximum); any other backs off at most once."""
        low = scale_at_least if known_clean else max(scale_at_least * self.backoff_factor, self.min_loss_scale)
        return min(low, self.max_loss_scale)


class FairseqState(NamedTuple):
    """The state of ``FairseqRule``: the scale (float32), the skip count, and fairseq's three counts (int64)."""

    loss_scale: torch.Tensor
    non_clamped_scale: torch.Tensor  # the scale without the floors: below the scale where fairseq would stop
    num_skipped_steps: torch.Tensor
    steps_since_rescale: torch.Tensor  # updates since the last overflow or growth, modulo the window
    iterations_since_rescale: torch.Tensor  # updates since the last back-off or growth: fairseq's denominator
    overflows_since_rescale: torch.Tensor  # overflows since the last back-off (a growth keeps them)


@dataclass(frozen=True)
class FairseqRule:
    """fairseq's ``DynamicLossScaler`` (fairseq 0.12.2, ``fairseq/optim/dynamic_loss_scaler.py``:
        ``check_overflow`` lines 42-70, called by ``FP16Optimizer.clip_grad_norm`` on every step; ``update`` lines
        31-35, called by ``FP16Optimizer.step`` after an applied step), once per ``update()``:

            iterations += 1                                     # fairseq's _iter - _last_rescale_iter
            if f:                                               # every overflow is skipped (OverflowError)
                overflows += 1;  steps = 0                      # _last_overflow_iter = _iter: growth counts anew
                if overflows / iterations >= tolerance:         # float64, >= (0.0: every overflow backs off)
                    new = max(scale / factor, threshold)        # _decrease_loss_scale (threshold: if given)
                    iterations = overflows = 0                  # _last_rescale_iter = _iter
                    if new > stop_loss_scale: scale = new       # fairseq's min_loss_scale: at or below it fairseq
                                                                #   puts the scale back and raises FloatingPointError
            else:
                steps += 1
                if steps == window:                             # (_iter - _last_overflow_iter) % window == 0
                    scale *= factor;  steps = 0;  iterations = 0    # _last_rescale_iter = _iter; overflows kept

    ``threshold`` is ``min_loss_scale`` (``checks.FLOAT32_TINY`` where fairseq sets none), ``window`` the
    ``growth_interval``, ``factor`` the ``growth_factor`` (the back-off divides by it, in float64, rounded once to
    float32). Where fairseq stops training, dls skips the step at the scale fairseq put back and goes on;
    ``non_clamped_scale`` is then the back-off it did not make, below the scale (``GradScaler.get_non_clamped_scale``:
    the trainer's ``max_overflows_at_min_loss_scale`` counts such steps). Growth past float32's maximum (fairseq's
    Python float goes on) is dropped, its count restarted.
    """

    growth_interval: int = 2000
    growth_factor: float = 2.0
    overflow_tolerance: float = 0.0
    min_loss_scale: float = checks.FLOAT32_TINY
    max_loss_scale: float = checks.FLOAT32_MAX
    stop_loss_scale: float = 1e-4
    State: ClassVar[type[FairseqState]] = FairseqState
    steps_after_growth: ClassVar[int] = 0  # a growth restarts the count at 0 (torch's timing)

    @classmethod
    def from_settings(cls, settings: ScalerSettings) -> FairseqRule:
        return cls(
            growth_interval=settings.growth_interval,
            growth_factor=settings.growth_factor,
            overflow_tolerance=settings.overflow_tolerance,
            min_loss_scale=settings.min_loss_scale,
            max_loss_scale=settings.max_loss_scale,
            stop_loss_scale=0.0 if settings.stop_loss_scale is None else settings.stop_loss_scale,
        )

    def initial_state(self, loss_scale: float, device: torch.device | str | None = None) -> FairseqState:
        scale = torch.tensor(loss_scale, dtype=torch.float32, device=device)
        zero = torch.zeros((), dtype=torch.int64, device=device)
        return FairseqState(scale, scale.clone(), zero, zero.clone(), zero.clone(), zero.clone())

    def update_(
        self, state: FairseqState, found_inf: torch.Tensor, *, known_clean: bool = False, saturate: bool = True
    ) -> None:
        """The rule of the class docstring, in device ops (the whole rule whatever ``known_clean`` says)."""
        s, f = state, found_inf > 0
        scale = s.loss_scale.double()
        s.iterations_since_rescale.add_(1)
        s.overflows_since_rescale.add_(f)
        fraction = s.overflows_since_rescale.double() / s.iterations_since_rescale.double()
        backs_off = f & (fraction >= self.overflow_tolerance)
        unfloored = torch.where(backs_off, scale / self.growth_factor, scale)
        lower = unfloored.clamp(min=self.min_loss_scale)
        new = torch.where(backs_off & (lower > self.stop_loss_scale), lower, scale)
        s.steps_since_rescale.add_(1).masked_fill_(f, 0)
        grows = s.steps_since_rescale == self.growth_interval
        higher = scale * self.growth_factor
        grown = grows & (higher <= self.max_loss_scale)
        new = torch.where(grown, higher, new)
        s.non_clamped_scale.copy_(torch.where(grown, higher, unfloored).clamp(max=self.max_loss_scale))
        s.steps_since_rescale.masked_fill_(grows, 0)
        s.iterations_since_rescale.masked_fill_(backs_off | grows, 0)
        s.overflows_since_rescale.masked_fill_(backs_off, 0)
        s.loss_scale.copy_(new.clamp(self.min_loss_scale, self.max_loss_scale))
        _count_skip_(s.num_skipped_steps, f, saturate)

    def normalise_(self, state: FairseqState) -> None:
        state.steps_since_rescale.clamp_(max=self.growth_interval - 1)
        for counter in (state.iterations_since_rescale, state.overflows_since_rescale):
            counter.clamp_(max=checks.INT64_MAX // 2)  # far from wrapping, and the fraction is unchanged in practice

    def lowest_after(self, scale_at_least: float, known_clean: bool) -> float:
        if known_clean:
            return scale_at_least
        return max(scale_at_least / self.growth_factor, self.min_loss_scale)


class MxnetState(NamedTuple):
    """The state of ``MxnetRule``: the scale in use (float32), the skip count, the clean steps counted towards growth
    (int32) and the rescale MXNet has decided and commits at the next update (int64: -1 halve, 0, +1 double)."""

    loss_scale: torch.Tensor
    num_skipped_steps: torch.Tensor
    steps_since_rescale: torch.Tensor
    next_rescale: torch.Tensor


@dataclass(frozen=True)
class MxnetRule:
    """MXNet's AMP ``LossScaler`` (mxnet 1.9.1, ``mxnet/contrib/amp/loss_scaler.py``: ``has_overflow`` lines 45-68,
        called by Gluon's ``Trainer._update``, which skips the step when it returns True), once per ``update()``:

            scale = next                                        # line 57: commit the previous update's decision
            if f:   next = scale / 2;  steps = 0                # the step is skipped
            else:   steps += 1
            if steps == window:                                 # window 2000
                steps = 0;  next = min(max_loss_scale, scale * 2)   # max 2**24

    So a new scale takes effect one update late: the step after an overflow still runs at the old scale, and a growth
    decided at one update is committed at the next even if that one overflows (it then halves the grown scale). ``next``
    is held as the decision (``next_rescale``: -1, 0, +1) and applied to the scale at the next update, where it is
    clamped to ``[min_loss_scale, max_loss_scale]`` (MXNet has no floor: dls's is the smallest normal float32). MXNet's
    constructor takes no arguments: ``2**16``, ``2**24`` and 2000 are its constants.
    """

    growth_interval: int = 2000
    min_loss_scale: float = checks.FLOAT32_TINY
    max_loss_scale: float = 2.0**24
    State: ClassVar[type[MxnetState]] = MxnetState
    steps_after_growth: ClassVar[int] = 0  # a growth restarts the count at 0 (torch's timing)

    @classmethod
    def from_settings(cls, settings: ScalerSettings) -> MxnetRule:
        return cls(settings.growth_interval, settings.min_loss_scale, settings.max_loss_scale)

    def initial_state(self, loss_scale: float, device: torch.device | str | None = None) -> MxnetState:
        scale = torch.tensor(loss_scale, dtype=torch.float32, device=device)
        zero = torch.zeros((), dtype=torch.int64, device=device)
        return MxnetState(scale, zero, torch.zeros((), dtype=torch.int32, device=device), zero.clone())

    def update_(
        self, state: MxnetState, found_inf: torch.Tensor, *, known_clean: bool = False, saturate: bool = True
    ) -> None:
        """The rule of the class docstring, in device ops (a clean update may commit a back-off: the whole rule
        runs whatever ``known_clean`` says)."""
        s, f = state, found_inf > 0
        committed = torch.ldexp(s.loss_scale, s.next_rescale.to(torch.float32))  # exact: a power of two
        s.loss_scale.copy_(committed.clamp(self.min_loss_scale, self.max_loss_scale))
        s.steps_since_rescale.add_(1).masked_fill_(f, 0)
        grows = s.steps_since_rescale == self.growth_interval
        s.steps_since_rescale.masked_fill_(grows, 0)
        s.next_rescale.copy_(grows.long() - f.long())  # -1 on an overflow (steps was reset: no growth), +1, 0
        _count_skip_(s.num_skipped_steps, f, saturate)

    def normalise_(self, state: MxnetState) -> None:
        state.steps_since_rescale.clamp_(max=self.growth_interval - 1)
        state.next_rescale.clamp_(min=-1, max=1)

    def lowest_after(self, scale_at_least: float, known_clean: bool) -> float:
        return max(scale_at_least / 2, self.min_loss_scale)  # a back-off decided before may be committed now


# ------------------------------------------------------------------------------------------------ the peers
REQUIRED = None  # in ``Peer.defaults``: an argument the peer's constructor requires (see ``Peer.required``)


@dataclass(frozen=True)
class Peer:
    """One row of ``PEERS``: a loss scaler that dls follows step by step, and each fact about it that dls uses.

    Attributes:
        name: the dialect's name (``ScalerSettings.dialect``, the policy lab's policy name).
        summary: what it is, in a line.
        defaults: the peer's own constructor arguments, by its names, with its defaults (for an argument in
            ``required``: the value its command line defaults to, used where a value is needed).
        interval: the peer's name for the growth interval (``steps_per_increase`` in dls's settings).
        growth_offset: updates after the last rescale at which the scale grows, minus ``interval``: torch.amp's
            ``growth_interval`` is ``interval + growth_offset`` (what a state dict tells torch.amp).
        steps_after_growth: where the growth count restarts after a growth (DeepSpeed's timing: 1).
        min_loss_scale, max_loss_scale: the bounds dls holds the scale within where the peer sets none.
        cbfloat16_max_loss_scale: the default maximum for cbfloat16, where it differs.
        required: arguments the peer's constructor requires.
        when_none: what an argument whose default is ``None`` stands for, where that is a number (the bounds:
            ``min_loss_scale``, ``max_loss_scale``).
        fixed: the values a peer fixes where others take arguments (MXNet's constructor takes none), by dls's
            names (``init_scale``, ``steps_per_increase``).
        constructor: the arguments of the peer's scaler class where ``defaults`` are its config's keys
            (DeepSpeed's ``DynamicLossScaler``), with the values its config gives them; ``like`` takes either set.
        state_arguments: arguments that set the scaler's starting state rather than its settings (jmp's
            ``counter``): ``GradScaler.like`` loads them as the peer's saved state.
        rule: builds the rule of a ``ScalerSettings`` of this dialect (a dynamic one; a static scale is always
            ``StaticRule``).
    """

    name: str
    summary: str
    defaults: Mapping[str, Any]
    interval: str
    growth_offset: int = 0
    steps_after_growth: int = 0
    min_loss_scale: float = checks.FLOAT32_TINY
    max_loss_scale: float = checks.FLOAT32_MAX
    cbfloat16_max_loss_scale: float | None = None
    required: tuple[str, ...] = ()
    when_none: Mapping[str, Any] = field(default_factory=dict)
    fixed: Mapping[str, Any] = field(default_factory=dict)
    constructor: Mapping[str, Any] = field(default_factory=dict)
    state_arguments: tuple[str, ...] = ()
    rule: Callable[[ScalerSettings], Rule] = field(default=DynamicRule.from_settings)

    def __getitem__(self, argument: str) -> Any:
        """The default of one of the peer's arguments (``PEERS["deepspeed"]["hysteresis"]``)."""
        return self.defaults[argument]


PEERS: dict[str, Peer] = {
    peer.name: peer
    for peer in (
        Peer(
            "torch",
            "torch.amp.GradScaler: grow x2 after growth_interval clean steps, halve on overflow, no floor",
            {"init_scale": 2.0**16, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000},
            interval="growth_interval",
        ),
        Peer(
            "cerebras",
            "cstorch.amp.GradScaler: ceiling 2**15 (2**31 for cbfloat16), floor 2**-14, overflow tolerance",
            {
                "loss_scale": None,
                "init_scale": None,
                "steps_per_increase": None,
                "min_loss_scale": None,
                "max_loss_scale": None,
                "overflow_tolerance": 0.0,
                "max_gradient_norm": None,
            },
            interval="steps_per_increase",
            growth_offset=1,  # cstorch.amp grows when steps_since_rescale > steps_per_increase
            min_loss_scale=2.0**-14,
            max_loss_scale=2.0**15,
            cbfloat16_max_loss_scale=2.0**31,
            when_none={"steps_per_increase": 2000},
        ),
        Peer(
            "deepspeed",
            "DeepSpeed's DynamicLossScaler: 2**16, window 1000 (first growth after 1001), hysteresis 2, floor 1",
            # DeepSpeed's fp16 config section (DeepSpeedFP16Config), as from_deepspeed reads it
            {
                "loss_scale": 0,
                "initial_scale_power": 16,
                "loss_scale_window": 1000,
                "hysteresis": 2,
                "consecutive_hysteresis": False,
                "min_loss_scale": 1,
            },
            interval="loss_scale_window",
            growth_offset=1,  # the first growth after an overflow comes on the (window + 1)-th clean update
            steps_after_growth=1,
            # DynamicLossScaler(init_scale, scale_window, min_scale, delayed_shift, consecutive_hysteresis,
            # raise_error_at_min_scale=True, dtype=torch.half) (deepspeed 0.19.8, runtime/fp16/loss_scaler.py:219-226;
            # its docstring's "default=2**32" is not in the code: the first five are required), with what
            # CreateLossScaler passes from the fp16 section's defaults.
            constructor={
                "init_scale": 2.0**16,
                "scale_window": 1000,
                "min_scale": 1,
                "delayed_shift": 2,
                "consecutive_hysteresis": False,
                "raise_error_at_min_scale": True,
                "dtype": torch.float16,
            },
        ),
        Peer(
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
            interval="growth_interval",
            required=("initial_scale", "min_scale"),  # the values above: --initial-loss-scale, --min-loss-scale
        ),
        # The field's others (issue 41). Each on DynamicRule unless it names its own rule; where its code is quoted,
        # the file and lines are in the rule's docstring or ScalerSettings.<name>'s.
        Peer(
            "keras",
            "Keras 3 LossScaleOptimizer: 2**15, x2 after 2000 clean steps, halve on overflow, no floor, no ceiling",
            {"initial_scale": 2.0**15, "dynamic_growth_steps": 2000},
            interval="dynamic_growth_steps",
        ),
        Peer(
            "apex",
            "NVIDIA Apex amp's LossScaler: 2**16, x2 after 2000 clean steps up to 2**24, halve on overflow",
            {
                "loss_scale": "dynamic",  # amp.initialize's O1/O2 default; LossScaler itself requires it
                "init_scale": 2.0**16,
                "scale_factor": 2.0,  # accepted and ignored, as in Apex (x2 and /2 are written out)
                "scale_window": 2000,
                "min_loss_scale": None,
                "max_loss_scale": 2.0**24,
            },
            interval="scale_window",
        ),
        Peer(
            "apex_fp16_utils",
            "Apex fp16_utils' DynamicLossScaler: 2**32, x2 after 1000 clean steps, /2 on overflow, floor 1",
            {"init_scale": 2.0**32, "scale_factor": 2.0, "scale_window": 1000},
            interval="scale_window",
            min_loss_scale=1.0,  # max(scale / scale_factor, 1), written out
        ),
        Peer(
            "fairseq",
            "fairseq's DynamicLossScaler: 2**15, x2 after 2000 clean steps, overflow tolerance, stops at 1e-4",
            {
                "init_scale": 2.0**15,
                "scale_factor": 2.0,
                "scale_window": 2000,
                "tolerance": 0.0,
                "threshold": None,
                "min_loss_scale": 1e-4,
            },
            interval="scale_window",
            rule=FairseqRule.from_settings,
        ),
        Peer(
            "mxnet",
            "MXNet AMP's LossScaler: 2**16, x2 after 2000 clean steps up to 2**24, each new scale one update late",
            {},
            interval="scale_seq_len",
            max_loss_scale=2.0**24,
            fixed={"init_scale": 2.0**16, "steps_per_increase": 2000},
            rule=MxnetRule.from_settings,
        ),
        Peer(
            "colossalai",
            "ColossalAI's DynamicGradScaler: 2**16, x2 after 1000 clean steps, hysteresis 2 reset only by a growth",
            {
                "initial_scale": 2.0**16,
                "growth_factor": 2.0,
                "backoff_factor": 0.5,
                "growth_interval": 1000,
                "min_scale": None,
                "max_scale": None,
                "hysteresis": 2,
                "verbose": False,
            },
            interval="growth_interval",
        ),
        Peer(
            "jmp",
            "jmp's DynamicLossScale: x2 after 2000 clean steps, halve on overflow, floor 1, growth to inf dropped",
            {"loss_scale": 2.0**15, "counter": 0, "period": 2000, "factor": 2, "min_loss_scale": 1.0},
            interval="period",
            required=("loss_scale",),  # the value above: its docstring's example
            state_arguments=("counter",),
        ),
    )
}


# Moved to dls.checks (one release of deprecated aliases, for code that imported them from here).
_MOVED = (
    "FLOAT32_MAX",
    "FLOAT32_TINY",
    "INT32_MAX",
    "INT64_MAX",
    "shown",
    "python_number",
    "scale_problem",
    "factor_problem",
    "count_problem",
    "flag_problem",
    "limit_problem",
    "tolerance_problem",
)


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        warn_renamed(f"dls.policy.{name}", f"dls.checks.{name}")
        return getattr(checks, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
