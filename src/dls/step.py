"""``optimizer_step``: the whole mixed-precision optimizer step in one call, as ``cstorch.amp.optimizer_step``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from dls.checks import limit_problem, python_number
from dls.optimizers import optimizer_list
from dls.scaler import GradScaler, Stage


class StepResult(NamedTuple):
    """What an ``optimizer_step`` saw, as device tensors (nothing is read back to the host).

    ``found_inf``: 0-dim bool, whether the gradients overflowed (the steps were skipped; a step an optimizer refused
    though the gradients were clean, ``dls.master_weights``', is in ``grad_scaler.step_was_skipped``);
    ``loss_scale``: the scale this step used (a copy, float32); ``grad_norm``: the global L2 norm of the unscaled
    gradients before clipping (float32), or ``None`` unless clipping by norm or asked for with ``gradient_norm=True``.
    """

    found_inf: torch.Tensor
    loss_scale: torch.Tensor
    grad_norm: torch.Tensor | None


def optimizer_step(
    loss: torch.Tensor,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    grad_scaler: GradScaler,
    max_gradient_norm: float | None = None,
    max_gradient_value: float | None = None,
    *,
    gradient_norm: bool = False,
) -> StepResult:
    """``scale(loss).backward()``, unscale, clip, step (skipped on overflow), ``update()``, ``zero_grad()``.

    Arguments are validated before anything runs, and so is the iteration: an optimizer already unscaled or
    stepped since the last ``update()`` is the misuse error ``unscale_`` raises, with nothing changed. With several
    optimizers, one global gradient norm covers all of them and one overflow flag decides the skip for all of them.
    ``max_gradient_norm`` defaults to the scaler's own; ``max_gradient_value`` clips each gradient element to
    ``[-value, value]`` instead of the norm. Giving both is an error. The limits are numbers (NumPy scalars and
    0-dim tensors too); a wrong type is a ``ValueError`` naming the argument.

    Args:
        loss: the loss to scale and differentiate.
        optimizer: one optimizer or a list of them, stepped together.
        grad_scaler: the [`GradScaler`][dls.GradScaler] to step through.
        max_gradient_norm: the global L2 norm to clip to; ``None``: the scaler's own ``max_gradient_norm``.
        max_gradient_value: clip each gradient element to ``[-value, value]`` instead.
        gradient_norm: also return the gradient norm when not clipping by norm.

    Returns:
        A [`StepResult`][dls.StepResult] of device tensors.

    Raises:
        ValueError: a bad limit, both limits, or an optimizer given twice.
        RuntimeError: an optimizer already unscaled or stepped since the last ``update()``.
    """
    optimizers = optimizer_list(optimizer, "optimizer")
    if not isinstance(grad_scaler, GradScaler):
        raise ValueError(f"grad_scaler must be a dls.GradScaler; got {type(grad_scaler).__name__}")
    if not isinstance(loss, torch.Tensor):
        raise ValueError(f"loss must be a torch.Tensor; got {type(loss).__name__}")
    if max_gradient_norm is not None and max_gradient_value is not None:
        raise ValueError("give max_gradient_norm or max_gradient_value, not both")
    for name, limit in (("max_gradient_norm", max_gradient_norm), ("max_gradient_value", max_gradient_value)):
        if problem := limit_problem(name, limit):
            raise ValueError(problem)
    # NumPy scalars and 0-dim tensors as the Python numbers they stand for (checked above).
    max_gradient_norm, max_gradient_value = (
        None if limit is None else float(python_number(limit))  # type: ignore[arg-type]
        for limit in (max_gradient_norm, max_gradient_value)
    )
    for opt in optimizers:
        stage = grad_scaler.stage(opt)
        if stage is Stage.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if stage is not Stage.READY:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update(); optimizer_step() runs "
                "a whole iteration (scale, backward, unscale, clip, step, update)"
            )

    grad_scaler.check_disjoint(optimizers)
    max_norm = max_gradient_norm
    if max_norm is None and max_gradient_value is None:
        max_norm = grad_scaler.settings.max_gradient_norm
    loss_scale = grad_scaler.get_scale_tensor().clone()
    grad_scaler.scale(loss).backward()
    want_norm = gradient_norm or max_norm is not None  # clipping by norm computes it anyway
    checked = grad_scaler.clip_gradients_and_return_isfinite(
        optimizers, max_gradient_norm=max_norm, return_norm=want_norm
    )
    isfinite, norm = checked if want_norm else (checked, None)
    if max_gradient_value is not None:
        params = [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
        torch.nn.utils.clip_grad_value_(params, max_gradient_value)
    for opt in optimizers:
        grad_scaler.step(opt)
    grad_scaler.update()
    for opt in optimizers:
        opt.zero_grad()
    return StepResult(found_inf=~isfinite, loss_scale=loss_scale, grad_norm=norm)
