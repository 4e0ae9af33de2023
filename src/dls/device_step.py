"""Optimizer steps decided on the device, without reading the overflow flag back: ``fused_step`` for optimizers whose
kernel takes the scale and the flag (torch's ``fused=True`` optimizers, on every path), the masked step for those that
cannot (``GradScaler(sync_free=True)``). Which one runs, and when the host decides instead: ``dls.scaler``.

The masked step (``masked_snapshot``, then the step, then ``Snapshot.restore``): the step always runs; afterwards
parameters and optimizer state are put back, on the device, wherever the flag says the gradients overflowed. Nothing is
read back to the host, so a training loop can run ahead of the device (and be captured in a CUDA graph); the price is
a copy of parameters and state per step and two passes over them after it, each a foreach operator per device and
dtype (an integer view of the bits, multiplied by 0 or 1: exact). Only valid once every parameter with a gradient has
taken a real step: state that does not exist yet cannot be restored on the device, so the scaler decides an
optimizer's first step on the host. State on the host while the flag is on a device (AdamW's step counts without
``capturable=True``) could only be restored by reading the flag: the masked step declines, and the scaler decides
the step on the host, which costs that one read and nothing else.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from dls import distributed

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


# A masked step selects between old and new bits by multiplying integers by 0 or 1 and adding: exact for any value
# (NaN, inf, -0.0), which float arithmetic is not (NaN * 0 is NaN), and each a foreach operator over a whole group.
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_Slot = tuple[int, Any]  # (index of the parameter, state key; None for the parameter itself)


def integer_bits(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s elements as signed integers of the same width: a view, so writing it writes ``tensor``
    (a ``DTensor`` through its local shard, a complex tensor through its real view)."""
    dtensor = distributed.dtensor_class()
    if dtensor is not None and isinstance(tensor, dtensor):
        tensor = tensor.to_local()
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    return tensor.view(_BITS[tensor.element_size()])


class Restorable:
    """What a masked step of one optimizer may put back: its parameters, then each one's tensor state in the
    state's order (``slots``), and views of their bits (``integer_bits``) grouped by (device, integer dtype) for the
    foreach operators. Kept by the scaler per optimizer (``dls.optimizers.OptimizerIndex``) while the optimizer holds
    the same tensors: the same objects at the same addresses (``p.data = ...`` moves one), checked each step."""

    def __init__(self, slots: list[_Slot], tensors: list[torch.Tensor]) -> None:
        self.slots, self.tensors = slots, tensors
        self.addresses = _addresses(tensors)
        self.groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for t in tensors:
            bits = integer_bits(t)
            self.groups.setdefault((bits.device, bits.dtype), []).append(bits)

    def holds(self, slots: list[_Slot], tensors: list[torch.Tensor]) -> bool:
        """Whether ``tensors`` are this one's, at the same addresses (where they could be asked: not under
        ``torch.compile``, where nothing is kept across steps)."""
        return (
            slots == self.slots
            and all(a is b for a, b in zip(tensors, self.tensors))
            and (self.addresses is None or _addresses(tensors) == self.addresses)
        )


def _addresses(tensors: list[torch.Tensor]) -> list[int] | None:
    """Where each of ``tensors`` keeps its elements; ``None`` where that cannot be asked (a ``DTensor`` has no
    storage of its own; under ``torch.compile``): then nothing is kept across steps."""
    dtensor = distributed.dtensor_class()
    if torch.compiler.is_compiling() or (dtensor is not None and any(isinstance(t, dtensor) for t in tensors)):
        return None
    return list(map(torch.Tensor.data_ptr, tensors))


def _contents(optimizer: torch.optim.Optimizer) -> tuple[list[_Slot], list[torch.Tensor], dict[_Slot, Any]]:
    """The optimizer's parameters and tensor state (slots and tensors, in order), and its other state values."""
    slots: list[_Slot] = []
    tensors: list[torch.Tensor] = []
    others: dict[_Slot, Any] = {}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        slots.append((i, None))
        tensors.append(p)
    for i, p in enumerate(params):
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                slots.append((i, key))
                tensors.append(value)
            else:
                others[(i, key)] = value
    return slots, tensors, others


class Snapshot:
    """The bits a masked step puts back where it overflowed, taken before the step: per group, the old bits times
    the overflow (zero where the gradients were clean), and the flag as multipliers of each group's integer dtype
    (a multiplier of another dtype would send the foreach operators down their per-tensor path)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        found_inf: torch.Tensor,
        restorable: Restorable,
        others: dict[_Slot, Any],
    ) -> None:
        self.optimizer, self.restorable = optimizer, restorable
        self.found = overflow = found_inf > 0
        self.keep: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self.kept: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for key, bits in restorable.groups.items():  # a loop, not a comprehension: see dls.kernels.per_device
            on = overflow.to(device=key[0], dtype=key[1], non_blocking=True)
            self.keep[key] = 1 - on
            self.kept[key] = list(torch._foreach_mul(bits, on))
        self.others = {slot: copy.deepcopy(value) for slot, value in others.items()}

    def restore(self) -> None:
        """Put back every parameter and state tensor where the step overflowed: two foreach operators per group when
        the step updated its tensors in place (torch's optimizers do); else per tensor, a state entry this step
        created starting from zero (what the optimizers that create entries lazily start from)."""
        slots, tensors, others = _contents(self.optimizer)
        restorable = self.restorable
        replaced: list[tuple[_Slot, torch.Tensor, torch.Tensor]] = []
        with torch.no_grad():
            # A step may give a parameter new storage (``p.data = ...``): the views taken before it would then
            # write the old storage and leave the stepped one.
            if restorable.holds(slots, tensors):
                for key, bits in restorable.groups.items():
                    torch._foreach_mul_(bits, self.keep[key])
                    torch._foreach_add_(bits, self.kept[key])
            else:
                replaced = self._restore_each(slots, tensors)
        changed = [(slot, old) for slot, old in self.others.items() if slot in others and others[slot] != old]
        # State that is not a tensor (a custom optimizer's Python step count), and a state tensor the step replaced
        # by one of another dtype, shape or device, cannot be selected on the device: where the step changed some,
        # the flag is read once, and the old values are put back where it overflowed.
        if (changed or replaced) and bool(self.found):
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
            for (i, key), old in changed:
                self.optimizer.state[params[i]][key] = old
            with torch.no_grad():
                for (i, key), tensor, kept in replaced:
                    integer_bits(tensor).copy_(kept)  # the old bits, wherever the step wrote to it before replacing it
                    self.optimizer.state[params[i]][key] = tensor

    def _restore_each(
        self, slots: list[_Slot], tensors: list[torch.Tensor]
    ) -> list[tuple[_Slot, torch.Tensor, torch.Tensor]]:
        """The restore per tensor; returns the state tensors the step replaced by one of another dtype, shape or
        device (slot, old tensor, its kept bits), which no selection of bits can put back."""
        old: dict[_Slot, tuple[torch.Tensor, torch.Tensor]] = {}
        positions: dict[tuple[torch.device, torch.dtype], int] = {}
        for slot, t in zip(self.restorable.slots, self.restorable.tensors):
            bits = integer_bits(t)
            key = (bits.device, bits.dtype)
            at = positions.get(key, 0)
            old[slot], positions[key] = (t, self.kept[key][at]), at + 1
        replaced = []
        for slot, t in zip(slots, tensors):
            before = old.get(slot)
            if before is not None and slot[1] is not None and before[0] is not t:
                was = before[0]
                if (t.dtype, t.shape, t.device) != (was.dtype, was.shape, was.device):
                    replaced.append((slot, *before))
                    continue
            bits = integer_bits(t)
            key = (bits.device, bits.dtype)
            if key not in self.keep:  # a device or dtype no tensor had before the step
                self.keep[key] = 1 - self.found.to(device=bits.device, dtype=bits.dtype)
            bits.mul_(self.keep[key])
            if before is not None:
                bits.add_(before[1])
        return replaced


def masked_snapshot(
    optimizer: torch.optim.Optimizer, found_inf: torch.Tensor, restorable: Restorable | None
) -> tuple[Snapshot, Restorable | None] | None:
    """Before a masked step: the bits to put back where it overflows (``Snapshot.restore`` after the step), and what
    to keep for the next step; ``None`` where the optimizer keeps state on the host while the flag is on a device
    (AdamW and Adam without ``capturable=True`` keep their step counts there): restoring them would need the flag on
    the host, a sync, which costs no less than deciding the step on the host (what the scaler then does).

    Only called once every parameter with a gradient has stepped since the optimizer's state was last reset
    (``Tracker.has_stepped`` in ``dls.scaler``; the scaler then tells a wrapper holding its gradients elsewhere,
    ``dls.optimizers.HoldsGradients``), so the state the step touches exists before it. Exact: integer views of
    the bits are multiplied by 0 or 1. A state tensor the step replaces instead of updating in place, or creates,
    is restored per tensor; state that is not a tensor, and a state tensor replaced by one of another dtype, shape
    or device, by a read of the flag where the step changed it.

    The price of no sync for optimizers without a fused kernel: a copy of parameters and state per step (one
    foreach multiply per device and dtype), and two passes over them after the step (a multiply, an add).
    """
    slots, tensors, others = _contents(optimizer)
    if found_inf.device.type != "cpu" and any(t.device.type == "cpu" for t in tensors):
        return None
    current = restorable if restorable is not None and restorable.holds(slots, tensors) else Restorable(slots, tensors)
    # Under torch.compile (no addresses) nothing is kept: the views cost nothing in a graph.
    keep = current if current.addresses is not None else restorable
    return Snapshot(optimizer, found_inf, current, others), keep
