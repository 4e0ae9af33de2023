"""``optimizer_step``: the whole mixed-precision optimizer step in one call, as ``cstorch.amp.optimizer_step``."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from dls.scaler import GradScaler, _as_optimizer_list


def optimizer_step(
    loss: torch.Tensor,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    grad_scaler: GradScaler,
    max_gradient_norm: float | None = None,
    max_gradient_value: float | None = None,
) -> None:
    """``scale(loss).backward()``, unscale, clip, step (skipped on overflow), ``update()``, ``zero_grad()``.

    Arguments are validated before anything runs. With several optimizers, one global gradient norm covers all
    of them and one overflow flag decides the skip for all of them. ``max_gradient_norm`` defaults to the
    scaler's own; ``max_gradient_value`` clips each gradient element to ``[-value, value]`` instead of the
    norm. Giving both is an error.
    """
    optimizers = _as_optimizer_list(optimizer, "optimizer")
    if not isinstance(grad_scaler, GradScaler):
        raise ValueError(f"grad_scaler must be a dls.GradScaler; got {type(grad_scaler).__name__}")
    if not isinstance(loss, torch.Tensor):
        raise ValueError(f"loss must be a torch.Tensor; got {type(loss).__name__}")
    if max_gradient_norm is not None and max_gradient_value is not None:
        raise ValueError("give max_gradient_norm or max_gradient_value, not both")
    for name, limit in (("max_gradient_norm", max_gradient_norm), ("max_gradient_value", max_gradient_value)):
        if limit is not None and (
            isinstance(limit, bool) or not isinstance(limit, (int, float)) or not (0 < limit < math.inf)
        ):
            raise ValueError(f"{name} must be a positive finite number or None; got {limit!r}")

    max_norm = max_gradient_norm
    if max_norm is None and max_gradient_value is None:
        max_norm = grad_scaler.max_gradient_norm
    grad_scaler.scale(loss).backward()
    grad_scaler._clip_and_check(optimizers, max_norm)
    if max_gradient_value is not None:
        params = [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
        torch.nn.utils.clip_grad_value_(params, max_gradient_value)
    for opt in optimizers:
        grad_scaler.step(opt)
    grad_scaler.update()
    for opt in optimizers:
        opt.zero_grad()
