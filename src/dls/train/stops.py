"""When a run stops because loss scaling cannot help, and what it tells the user (:class:`TrainingStopped`, exit
status 1, always after a checkpoint).

* Dynamic scaling: the scale is pinned at its floor, i.e. the rule wanted to go below ``min_loss_scale``
  (``scaler.get_non_clamped_scale() < scaler.get_scale()``, Model Zoo's test), and the gradients overflowed on
  ``max_overflows_at_min_loss_scale`` such steps without a clean step between. Skipped steps that did not back off
  (``hysteresis``, ``overflow_tolerance``) neither count nor reset the count.
* Static scaling: that many consecutive overflowing steps (a static scale never comes down).
* No loss scaling (float32, bfloat16 by default): one step with inf/NaN gradients. Nothing would skip it, so
  :func:`refuse_nonfinite_gradients`, an optimizer step pre-hook, refuses it before the optimizer applies it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dls import kernels
from dls.diagnostics.scales import pow2
from dls.scaler import GradScaler

__all__ = ["FloorWatch", "NonFiniteGradients", "nonfinite_message", "refuse_nonfinite_gradients"]


class NonFiniteGradients(Exception):
    """Raised by :func:`refuse_nonfinite_gradients` before the optimizer applies inf/NaN gradients."""


def refuse_nonfinite_gradients(device: torch.device) -> Callable[[torch.optim.Optimizer, Any, Any], None]:
    """An optimizer step pre-hook (``optimizer.register_step_pre_hook``) for runs without loss scaling: it raises
    :class:`NonFiniteGradients` when a gradient holds inf/NaN, so that the step is not applied. One read pass over
    the gradients (``dls.kernels.check_nonfinite``) and one read of the flag per step; data-parallel, every rank
    holds the same (all-reduced) gradients and decides alike."""

    def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        flags = []
        for (grad_device, _), grads in kernels.group_grads(params).items():
            flag = torch.zeros((), dtype=torch.float32, device=grad_device)
            kernels.check_nonfinite(grads, flag)
            flags.append(flag.to(device))
        if flags and bool(torch.stack(flags).amax() > 0):
            raise NonFiniteGradients

    return hook


def nonfinite_message(step: int, loss: float, compute_dtype: str, saved_step: int, path: object) -> str:
    """The stop message of a run without loss scaling whose step ``step`` had inf/NaN gradients."""
    scaling = ", or optimizer.loss_scaling_factor: dynamic." if compute_dtype != "float32" else "."
    return (
        f"Step {step}: the gradients are inf/NaN (loss {loss}) and loss scaling is off ({compute_dtype}), so nothing "
        f"can skip this step. Training stopped before applying it; the model as of step {saved_step} is saved in "
        f"{path}. Try a lower optimizer.learning_rate, optimizer.max_gradient_norm (e.g. 1.0){scaling}"
    )


class FloorWatch:
    """Counts the overflowing steps at the scale's floor (see the module docstring). ``count`` is checkpointed
    (``trainer.overflows_at_floor``)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.count = 0

    def after_step(self, scaler: GradScaler, skipped: bool) -> str | None:
        """Update the count after a step; when it reaches the limit, what happened and what to try (else ``None``).
        Reads the scaler only after a skipped step."""
        if not scaler.is_enabled():
            return None
        if not skipped:
            self.count = 0
            return None
        scale = scaler.get_scale()
        static = scaler.mode == "static"
        if static or scaler.get_non_clamped_scale() < scale:
            self.count += 1
        if self.count < self.limit:
            return None
        if static:
            what = (
                f"the static loss scale {pow2(scale)} made the gradients overflow on {self.limit} consecutive steps, "
                "and a static scale never comes down"
            )
            advice = (
                "use optimizer.loss_scaling_factor: dynamic (it finds the largest scale that does not overflow), or a "
                "smaller static scale"
            )
        else:
            what = (
                f"the loss scale is pinned at min_loss_scale ({pow2(scale)}) and the gradients still overflowed on "
                f"{self.limit} steps without a clean step between (Model Zoo: 'Minimum loss scale threshold was "
                "reached but gradient norms are still encountering NaN or inf values')"
            )
            advice = (
                "lower optimizer.learning_rate or clip with optimizer.max_gradient_norm (the model may have "
                "diverged); check the data for inf/NaN; switch to bfloat16 (precision.fp16_type: bfloat16), whose "
                "range matches float32, if the forward pass itself overflows in float16; or lower "
                "optimizer.min_loss_scale"
            )
        return f"{what}. Skipping more steps cannot help. To try: {advice}"
