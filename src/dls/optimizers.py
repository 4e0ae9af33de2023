"""The optimizers a ``GradScaler`` steps, as it sees them: what an optimizer wrapper may offer the scaler
(``HoldsGradients``, ``RefusesSteps``), and the index of an optimizer's parameters (``OptimizerIndex``), built when
its param groups change: its gradients grouped by device and dtype, the parameters it shares with the scaler's other
optimizers (their gradients would be unscaled twice), and which parameters have stepped since its state was last
reset.

The scaler reads an index every step (``dls.scaler.Tracker``); it is built here, once, and whatever it finds wrong
(a parameter listed twice, shared between optimizers) is refused here, naming where, before anything changes.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from dls import distributed, kernels


@runtime_checkable
class HoldsGradients(Protocol):
    """An optimizer wrapper whose inner optimizer steps other tensors than the model's parameters, with gradients of
    their own (``dls.master_weights``: float32 masters). The scaler tells it, at three points of an iteration:"""

    def dls_collect_gradients(self) -> None:
        """The scaler is about to read this iteration's gradients (once per iteration): fill the ones it steps."""

    def dls_gradients_unscaled(self) -> None:
        """The gradients are unscaled (and clipped, where the scaler clips): user code runs next and may read or
        clip the gradients it knows."""

    def dls_state_restored(self) -> None:
        """A masked (sync-free) step ran and put parameters and optimizer state back where it overflowed:
        re-derive what the step wrote from the restored state."""


@runtime_checkable
class RefusesSteps(Protocol):
    """An optimizer (wrapper) whose ``step()`` may decline a step the gradients allowed, leaving parameters and its
    state as they were (``dls.master_weights``: a master its parameter's format cannot hold). The scaler counts a
    refused step as skipped (``step_was_skipped``, ``num_skipped_steps``); its scale rule sees the gradients' flag."""

    def dls_step_refused(self, found_inf: torch.Tensor | None) -> torch.Tensor | None:
        """After ``step()``, given the gradients' overflow flag (``None``: a disabled scaler's step): whether the
        step was refused though the gradients were clean, a 0-dim bool tensor on the device (not read back), or
        ``None`` when it cannot have been."""

    def dls_next_step(self) -> None:
        """The next ``step()`` is on a path that reads nothing back (fused, sync-free): decide and put a refused
        step back on the device."""

    def dls_refusal_read(self) -> bool | None:
        """Whether the last ``step()`` found itself refused, where it read that on the host (``None``: not read)."""

    def dls_may_refuse(self) -> torch.Tensor | None:
        """Before a step on the default path: whether it may well be refused (a 0-dim bool on the device, which the
        scaler reads in the same transfer as the gradients' flag; ``None``: not known, as before a first step).
        Where it is true the step decides on the host, one read after it, and ``step_was_skipped`` says a refusal at
        once; where false the step puts a refusal back on the device (``dls_next_step``), which only a step moving a
        weight by half its format's range at once can make, counted in ``num_skipped_steps`` and warned of."""


@dataclasses.dataclass
class OptimizerIndex:
    """What is cached per optimizer, valid while its param groups hold the same parameters (an identity check of
    the lists per step: a parameter swapped into an existing list re-indexes)."""

    signature: tuple[tuple[int, ...], ...]
    grads: kernels.GradIndex  # holds the parameters, so the ids in the signature cannot be reused
    has_dtensors: bool
    hooks: HoldsGradients | None  # the optimizer, when it is a wrapper that holds its gradients elsewhere
    # Parameters stepped through this scaler (id → parameter) since the optimizer's state was last reset (a new
    # state object, or a shorter one): see dls.scaler.Tracker.has_stepped.
    stepped: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    optimizer_state: Any = None  # the optimizer.state object the stepped record refers to
    state_len: int = 0  # its length when last marked
    refuses: RefusesSteps | None = None  # the optimizer, when its step may decline (RefusesSteps)
    # What a sync-free (masked) step puts back, kept while the optimizer holds the same tensors (dls.device_step).
    restorable: Any = None
    warned_host_state: bool = False  # sync_free=True, but state on the host: said once (dls.scaler)
    # Other optimizers of this scaler sharing a parameter with this one: (optimizer ref, where, where theirs, shape).
    shared: list[tuple[weakref.ref[torch.optim.Optimizer], str, str, tuple[int, ...]]] = dataclasses.field(
        default_factory=list
    )


def build_index(
    optimizer: torch.optim.Optimizer, sig: tuple[tuple[int, ...], ...], others: Iterable[tuple[Any, OptimizerIndex]]
) -> OptimizerIndex:
    """A new index of ``optimizer`` (``sig``: the ids of its groups' parameters), linked both ways with the
    ``others`` of the same scaler that share a parameter with it."""
    where = _positions(optimizer)
    params = [p for _, p in where.values()]
    hooks = optimizer if isinstance(optimizer, HoldsGradients) else None
    refuses = optimizer if isinstance(optimizer, RefusesSteps) else None
    index = OptimizerIndex(sig, kernels.GradIndex(params), distributed.has_dtensors(params), hooks, refuses=refuses)
    for other, other_index in others:
        other_index.shared = [s for s in other_index.shared if s[0]() not in (None, optimizer)]
        if other is optimizer:
            continue
        theirs = _positions(other, own=False)
        common = where.keys() & theirs.keys()
        if common:
            pid = next(iter(common))
            shape = tuple(where[pid][1].shape)
            index.shared.append((weakref.ref(other), where[pid][0], theirs[pid][0], shape))
            other_index.shared.append((weakref.ref(optimizer), theirs[pid][0], where[pid][0], shape))
    return index


def refuse_shared(
    optimizers: Sequence[torch.optim.Optimizer], indexes: Sequence[OptimizerIndex], started: Iterable[int]
) -> None:
    """Refuse, before anything changes, to unscale ``optimizers`` together or after other optimizers of this
    iteration (``started``: the ids of those already unscaled or stepped) when they share a parameter: its gradient
    would be unscaled (and counted in a norm) twice."""
    started = set(started)
    for i, index in enumerate(indexes):
        for ref, mine, theirs, shape in index.shared:
            other = ref()
            if other is None:
                continue
            j = next((k for k, o in enumerate(optimizers) if o is other), None)
            if j is not None and j > i:
                raise ValueError(
                    f"optimizers[{i}].{mine} (shape {shape}) is also optimizers[{j}].{theirs}: a parameter in "
                    "two optimizers would have its gradient unscaled twice; give each parameter to one optimizer"
                )
            if j is None and id(other) in started:
                name = "optimizer" if len(optimizers) == 1 else f"optimizers[{i}]"
                raise ValueError(
                    f"{name}.{mine} (shape {shape}) is also {theirs} of another optimizer already unscaled or "
                    "stepped in this iteration: its gradient would be unscaled twice; give each parameter to one "
                    "optimizer"
                )


def _positions(optimizer: torch.optim.Optimizer, own: bool = True) -> dict[int, tuple[str, torch.Tensor]]:
    """Where each parameter is in ``optimizer.param_groups``. In the optimizer being indexed (``own``) a parameter
    listed twice (an in-place edit of the groups) would be unscaled twice and raises."""
    where: dict[int, tuple[str, torch.Tensor]] = {}
    for g, group in enumerate(optimizer.param_groups):
        for k, p in enumerate(group["params"]):
            here = f"param_groups[{g}]['params'][{k}]"
            if own and id(p) in where:
                raise ValueError(
                    f"optimizer.{here} (shape {tuple(p.shape)}) is also optimizer.{where[id(p)][0]}: a parameter "
                    "listed twice would have its gradient unscaled twice"
                )
            where[id(p)] = (here, p)
    return where


def optimizer_list(
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer], name: str
) -> list[torch.optim.Optimizer]:
    """``optimizers`` (one or a sequence) as a list without repeats; ``ValueError`` naming ``name`` otherwise."""
    if isinstance(optimizers, torch.optim.Optimizer):
        items = [optimizers]
    else:
        items = list(optimizers) if isinstance(optimizers, Iterable) and not isinstance(optimizers, str) else []
    if not items or not all(isinstance(o, torch.optim.Optimizer) for o in items):
        raise ValueError(f"{name} must be a torch.optim.Optimizer or a non-empty list of them; got {optimizers!r}")
    return list({id(o): o for o in items}.values())  # an optimizer listed twice is still unscaled once
