"""Sync-free steps for optimizers that cannot take the overflow flag themselves (``GradScaler(sync_free=True)``).

The step always runs; afterwards parameters and optimizer state are put back, with ``torch.where`` on the device,
wherever the flag says the gradients overflowed. Nothing is read back to the host, so a training loop can run ahead
of the device (and be captured in a CUDA graph); the price is a copy of parameters and state per step.

Only valid once every parameter with a gradient has taken a real step: state that does not exist yet cannot be
restored on the device, so the scaler decides an optimizer's first step on the host.
"""

from __future__ import annotations

import copy
from typing import Any

import torch


def masked_step(
    optimizer: torch.optim.Optimizer, found_inf: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Run the step unconditionally, then put back parameters and optimizer state where it overflowed.

    Only called once every parameter with a gradient has stepped since the optimizer's state was last reset
    (``Tracker.has_stepped`` in ``dls.scaler``), so the state the step touches exists before it. Exact:
    ``torch.where`` selects the old bits. The state must live on the flag's device (e.g. ``capturable=True`` for
    Adam on CUDA), or each ``torch.where`` copies the flag over. State that
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
    host_values: list[tuple[dict[str, Any], str, Any]] = []
    with torch.no_grad():
        for p, old in zip(params, before_params):
            p.copy_(torch.where(overflow.to(p.device), old, p))
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
                value.copy_(torch.where(overflow.to(value.device), old_value, value))
    if host_values and overflow.item():
        for state, key, old_value in host_values:
            state[key] = old_value
    restored = getattr(optimizer, "dls_state_restored", None)
    if restored is not None:  # e.g. master weights: re-derive what the step wrote from the restored state
        restored()
    return result
