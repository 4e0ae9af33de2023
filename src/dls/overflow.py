"""Deciding overflow: the passes over an optimizer's gradients that unscale them, clip them and raise the flag.

A step overflows when some gradient, *as the optimizer would receive it* (unscaled, and clipped when the scaler
clips), is inf/NaN in the gradient's dtype. Three ways to get there, each a fused pass per (device, dtype) group
(``dls.kernels``), none reading the device back:

* ``unscale_and_check``: one read+write pass (unscale fused with the check), plus a check of the result while the
  scale may be below 1 (only then can a finite scaled gradient overflow once unscaled);
* ``clip_and_check``: one read for the global norm of the still-scaled gradients (its being inf/NaN is the flag),
  one read+write multiplying by ``clip_coef / scale``; the result is checked only when the clip limit nears the
  gradient dtype's largest value (a finite norm bounds every clipped element by the limit);
* ``check_scaled``: for optimizers that unscale inside their own kernel (torch's fused ones), one read pass:
  ``max|g| * (1/scale)``, rounded as an unscale would, is non-finite exactly when some element's product is.

Flags are agreed across ranks (``dls.distributed``) before any decision depends on them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from dls import distributed, kernels
from dls.loss_scale import LossScale
from dls.tracking import IterationState, Stage, Tracker


class OverflowCheck:
    """The overflow passes of one scaler (see the module docstring). With ``enabled=False`` nothing is unscaled or
    skipped, but clipping still applies and its flag still tells the truth."""

    def __init__(
        self, tracker: Tracker, scale: LossScale, enabled: bool, process_group: Any, gradients_sharded: bool | None
    ) -> None:
        self.tracker = tracker
        self.scale = scale
        self.enabled = enabled
        self.process_group = process_group
        self.gradients_sharded = gradients_sharded

    def check_scaled(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """The agreed flag of ``optimizer``'s still-scaled gradients, without unscaling them (one read pass)."""
        groups = self.tracker.grads(optimizer)
        devices = {d for d, _ in groups}
        found = zero_flags(devices)
        inv = kernels.per_device(self.scale.inverse(), devices)
        kernels.check_unscaled_(groups, inv, found, self.scale.may_be_below_one)
        return distributed.agree_on_overflow(self._combine(found), self.process_group)

    def clip_and_check(
        self, optimizers: list[torch.optim.Optimizer], max_norm: float | None, want_norm: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        norm: torch.Tensor | None
        states = [self.tracker.state(opt) for opt in optimizers]
        if any(s.stage is Stage.STEPPED for s in states):
            raise RuntimeError("gradients cannot be clipped after step() on the same optimizer before update().")
        if not self.enabled:
            # Nothing to unscale or skip; clipping still applies, and the flag still tells the truth.
            if max_norm is None and not want_norm:
                return torch.ones((), dtype=torch.bool, device=self.scale.device), None
            found_inf, norm = self._clip([], optimizers, max_norm, want_norm)
            for state in states:
                state.stage = Stage.CLIPPED if max_norm is not None else state.stage
            return found_inf == 0, norm
        ready = [(o, s) for o, s in zip(optimizers, states) if s.stage is Stage.READY]
        done = [o for o, s in zip(optimizers, states) if s.stage is not Stage.READY]
        if max_norm is None and not want_norm:
            if ready:
                self.unscale_and_check([o for o, _ in ready], [s for _, s in ready])
            found_inf, norm = max_flag([s.found_inf for s in states]), None
        else:
            found_inf, norm = self._clip([o for o, _ in ready], done, max_norm, want_norm)
            found_inf = max_flag([found_inf, *(s.found_inf for s in states if s.stage is not Stage.READY)])
            found_inf = distributed.agree_on_overflow(found_inf, self.process_group)
        for state in states:
            state.stage = Stage.CLIPPED if max_norm is not None else Stage.UNSCALED
            state.found_inf = found_inf
        return found_inf == 0, norm

    def unscale_and_check(self, optimizers: list[torch.optim.Optimizer], states: list[IterationState]) -> None:
        """Unscale each optimizer's gradients and set its agreed overflow flag (stage → UNSCALED)."""
        inv_scale = self.scale.inverse()
        for optimizer, state in zip(optimizers, states):
            groups = self.tracker.grads(optimizer)
            devices = {device for device, _ in groups}
            found = zero_flags(devices)
            kernels.mul_and_check_(groups, kernels.per_device(inv_scale, devices), found, self.scale.may_be_below_one)
            # Across ranks the flag is agreed asynchronously: reading state.found_inf waits for the all-reduce.
            flag = self._combine(found)
            state.flag, state.agreement = flag, distributed.start_agreement(flag, self.process_group)
            state.stage = Stage.UNSCALED

    def _clip(
        self,
        scaled: list[torch.optim.Optimizer],
        unscaled: list[torch.optim.Optimizer],
        max_norm: float | None,
        want_norm: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Unscale ``scaled`` and clip all gradients of both lists to ``max_norm`` (``None``: unscale only), in two
        passes: one read for the global norm (of still-scaled gradients times 1/scale), one read+write multiplying
        by ``clip_coef / scale`` (``clip_coef`` alone for already unscaled gradients). Returns the overflow flag
        (the norm is inf/NaN exactly when an element is) and the norm."""
        home = self.scale.device
        inv_scale = self.scale.inverse() if self.enabled else torch.ones((), device=home)
        one = torch.ones((), dtype=torch.float32, device=home)
        parts = [(self.tracker.grads_of(scaled), inv_scale), (self.tracker.grads_of(unscaled), one)]
        if distributed.norm_is_sharded(scaled + unscaled, self.gradients_sharded, self.process_group):
            # Each rank holds a slice of the gradients: squared norms are summed across ranks.
            opts = [(scaled, inv_scale), (unscaled, one)]
            sharded = self.gradients_sharded is True
            total_norm = distributed.global_norm(opts, home, self.process_group, plain_sharded=sharded)
        else:
            norms = [kernels.global_norm(g, kernels.per_device(f, {d for d, _ in g}), home) for g, f in parts]
            total_norm = torch.linalg.vector_norm(torch.stack(norms))
        found = (~torch.isfinite(total_norm)).float()
        coef = one if max_norm is None else kernels.clip_coefficient(total_norm, max_norm)
        # A finite norm bounds every clipped element by max_norm: only a max_norm near a gradient dtype's largest
        # value (or an unscale by more than 1 without clipping) can make a product overflow.
        for groups, factor in parts:
            if not groups or (factor is one and max_norm is None):
                continue
            dtypes_max = min(torch.finfo(dtype).max for _, dtype in groups)
            check = (max_norm is None and self.scale.may_be_below_one) or (max_norm or 0) >= dtypes_max / 2
            devices = {d for d, _ in groups}
            flags = {d: found.to(d) for d in devices} if check else None
            kernels.mul_(groups, kernels.per_device(factor * coef, devices), flags)
            if flags is not None:
                found = max_flag([found, *(f.to(home) for f in flags.values())])
        return found, total_norm

    def _combine(self, found: dict[torch.device, torch.Tensor]) -> torch.Tensor:
        home = self.scale.device
        flags = [f.to(home, non_blocking=True) for f in found.values()]
        return max_flag(flags) if flags else torch.zeros((), dtype=torch.float32, device=home)


def zero_flags(devices: Iterable[torch.device]) -> dict[torch.device, torch.Tensor]:
    """A clean overflow flag (float32 0-dim, as torch's AMP kernels take) on each device."""
    flags: dict[torch.device, torch.Tensor] = {}
    for d in devices:  # a loop, not a comprehension: see kernels.per_device
        if d not in flags:
            flags[d] = torch.zeros((), dtype=torch.float32, device=d)
    return flags


def max_flag(flags: Iterable[torch.Tensor | None]) -> torch.Tensor:
    present = [f for f in flags if f is not None]
    if len(present) == 1:
        return present[0]
    return torch.stack(present).amax()
