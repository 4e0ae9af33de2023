"""Optimizer steps decided on the device, without reading the overflow flag back: ``fused_step`` for optimizers whose
kernel takes the scale and the flag (torch's ``fused=True`` optimizers, on every path), ``masked_step`` for those that
cannot (``GradScaler(sync_free=True)``). Which one runs, and when the host decides instead: ``dls.scaler``.

``masked_step``: the step always runs; afterwards parameters and optimizer state are put back, with ``torch.where``
on the device, wherever the flag says the gradients overflowed. Nothing is read back to the host, so a training
loop can run ahead of the device (and be captured in a CUDA graph); the price is a copy of parameters and state
per step. Only valid once every parameter with a gradient has taken a real step: state that does not exist yet
cannot be restored on the device, so the scaler decides an optimizer's first step on the host.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

# Dynamo before torch 2.13 cannot set an attribute of an optimizer in a traced frame: it raises (an AssertionError
# "Attempted setattr on a user-defined object that does not have an AttributeMutation mutation_type", pytorch
# issue 171590), with or without fullgraph. torch 2.13 traces it.
_DYNAMO_SETS_OPTIMIZER_ATTRIBUTES = torch.__version__ >= (2, 13)  # type: ignore[operator]


def _hand_over_and_step(
    optimizer: torch.optim.Optimizer,
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
    optimizer.found_inf = found_inf  # type: ignore[attr-defined]
    try:
        return optimizer.step(*args, **kwargs)
    finally:
        del optimizer.grad_scale  # type: ignore[attr-defined]
        del optimizer.found_inf  # type: ignore[attr-defined]


_untraced_hand_over: Any = None  # torch.compiler.disable(_hand_over_and_step), made once needed (it imports Dynamo)


def fused_step(
    optimizer: torch.optim.Optimizer,
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """``optimizer.step(*args, **kwargs)`` with the scale to divide the gradients by (``None``: already unscaled)
    and the overflow flag handed over as torch's fused kernels read them: as the optimizer's ``grad_scale`` and
    ``found_inf`` attributes, removed afterwards. The kernel unscales and skips by itself.

    Under ``torch.compile`` with torch before 2.13, whose Dynamo cannot set an optimizer's attributes, the hand-over
    and the step run outside the graph: one graph break, where torch's fused kernel (``torch.compiler.disable``d)
    breaks the graph anyway.
    """
    if torch.compiler.is_compiling() and not _DYNAMO_SETS_OPTIMIZER_ATTRIBUTES:
        global _untraced_hand_over
        if _untraced_hand_over is None:
            _untraced_hand_over = torch.compiler.disable(_hand_over_and_step)
        return _untraced_hand_over(optimizer, grad_scale, found_inf, args, kwargs)
    return _hand_over_and_step(optimizer, grad_scale, found_inf, args, kwargs)


def masked_step(
    optimizer: torch.optim.Optimizer,
    found_inf: torch.Tensor,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    refused: Callable[[], torch.Tensor | None] | None = None,
) -> Any:
    """Run the step unconditionally, then put back parameters and optimizer state where it overflowed, or where
    ``refused()`` (asked after the step) says the optimizer declined it (``dls.optimizers.RefusesSteps``).

    Only called once every parameter with a gradient has stepped since the optimizer's state was last reset
    (``Tracker.has_stepped`` in ``dls.scaler``; the scaler then tells a wrapper holding its gradients elsewhere,
    ``dls.optimizers.HoldsGradients``), so the state the step touches exists before it. Exact:
    ``torch.where`` selects the old bits. The state must live on the flag's device (e.g. ``capturable=True`` for
    Adam on CUDA), or the flag is copied to the state's device once per step (one host sync). State that
    is not a tensor (a custom optimizer's Python step count) cannot be selected on the device: when the step
    changed some, the flag is read once and the old values are put back on overflow.

    This is a loop over parameters (the opt-in price of no sync for optimizers without a fused kernel), plus a
    copy of parameters and state.
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    before_params = [p.detach().clone() for p in params]
    before_state = {
        p: {k: (v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)) for k, v in optimizer.state[p].items()}
        for p in params
        if p in optimizer.state
    }
    result = optimizer.step(*args, **kwargs)
    overflow = found_inf > 0
    declined = None if refused is None else refused()
    if declined is not None:
        overflow = overflow | declined.to(overflow.device)
    # One copy of the flag per device: state kept on the host (AdamW's step counts without capturable=True) costs
    # one sync per step, not one per parameter.
    flags = {overflow.device: overflow}

    def on(device: torch.device) -> torch.Tensor:
        if device not in flags:
            flags[device] = overflow.to(device)
        return flags[device]

    host_values: list[tuple[dict[str, Any], str, Any]] = []
    with torch.no_grad():
        for p, old in zip(params, before_params):
            p.copy_(torch.where(on(p.device), old, p))
        for p in params:
            new_state = optimizer.state.get(p)
            if not new_state:
                continue
            old_state = before_state.get(p, {})
            for key, value in new_state.items():
                old_value = old_state.get(key)
                if not isinstance(value, torch.Tensor):
                    if key in old_state and old_value != value:
                        host_values.append((new_state, key, old_value))
                    continue
                if not isinstance(old_value, torch.Tensor):
                    # A state entry this step created for a parameter that had stepped: zero is what the
                    # optimizers that create entries lazily start from.
                    old_value = torch.zeros_like(value)
                value.copy_(torch.where(on(value.device), old_value, value))
    if host_values and bool(on(torch.device("cpu"))):
        for state, key, old_value in host_values:
            state[key] = old_value
    return result
