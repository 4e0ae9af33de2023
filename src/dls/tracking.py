"""What a ``GradScaler`` tracks per optimizer: where it is in the iteration, its gradients (grouped once), which
of its parameters have taken a step, and how its last step ended.

Optimizers that keep their gradients somewhere other than ``param.grad`` of the parameters in ``param_groups``
(``dls.master_weights`` keeps float32 masters beside half-precision parameters) take part through three optional
methods, all called by the scaler, never by users:

* ``dls_collect_gradients()``: once per iteration, before the scaler first reads the gradients of
  ``param_groups`` (so the masters' gradients can be filled from the half ones);
* ``dls_gradients_unscaled()``: after an explicit ``scaler.unscale_(optimizer)``, so that user code that inspects
  or clips gradients next (``clip_grad_norm_(model.parameters())``) sees unscaled values where it looks;
* ``dls_state_restored()``: after a sync-free step put parameters and state back (``dls.sync_free``).
"""

from __future__ import annotations

import dataclasses
import enum
import weakref
from typing import Any

import torch

from dls import distributed, kernels


class Stage(enum.Enum):
    """Where an optimizer is in the current iteration (``GradScaler.stage``)."""

    READY = "ready"  # gradients still scaled
    UNSCALED = "unscaled"  # unscale_() ran: gradients unscaled, overflow flag recorded
    CLIPPED = "clipped"  # unscaled and clipped by the scaler (clip_gradients_and_return_isfinite, or step())
    STEPPED = "stepped"  # step() ran (or skipped); update() starts the next iteration


@dataclasses.dataclass
class IterationState:
    """One optimizer in the current iteration."""

    stage: Stage = Stage.READY
    flag: torch.Tensor | None = None  # float32 0-dim on the scale's device; read it through found_inf
    agreement: distributed.Agreement | None = None  # the flag's all-reduce across ranks while in flight
    collected: bool = False  # dls_collect_gradients() was called this iteration

    @property
    def found_inf(self) -> torch.Tensor | None:
        """The overflow flag, agreed across ranks: waits for its all-reduce if one is in flight."""
        if self.agreement is not None:
            self.flag, self.agreement = self.agreement.wait(), None
        return self.flag

    @found_inf.setter
    def found_inf(self, value: torch.Tensor | None) -> None:
        self.flag, self.agreement = value, None


@dataclasses.dataclass
class LastStep:
    """How the last ``step()`` of an optimizer ended: ``skipped`` when decided on the host, else read lazily from
    ``found_inf`` (the fused and sync-free paths never read it themselves)."""

    found_inf: torch.Tensor | None
    skipped: bool | None

    def was_skipped(self) -> bool:
        if self.skipped is None:
            assert self.found_inf is not None
            self.skipped = bool(self.found_inf.item())
        return self.skipped


@dataclasses.dataclass
class _Index:
    """What is cached per optimizer, valid while its param groups keep the same lists and lengths."""

    signature: tuple[tuple[int, int], ...]
    param_lists: list[list[Any]]  # held so the ids in the signature cannot be reused by new lists
    grads: kernels.GradIndex
    has_dtensors: bool
    # Parameters that have taken a step through this scaler (id → parameter, held so ids stay unique): only for
    # them does all the state a step touches exist, so that their step can be skipped or masked on the device.
    stepped: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)


class Tracker:
    """Per-optimizer bookkeeping of one scaler. Optimizers are keyed weakly (or by id within an iteration, as
    torch does), so tracking never keeps an optimizer alive."""

    def __init__(self) -> None:
        self.iteration: dict[int, IterationState] = {}
        self._indexes: weakref.WeakKeyDictionary[torch.optim.Optimizer, _Index] = weakref.WeakKeyDictionary()
        self._last: weakref.WeakKeyDictionary[torch.optim.Optimizer, LastStep] = weakref.WeakKeyDictionary()

    def state(self, optimizer: torch.optim.Optimizer) -> IterationState:
        check_optimizer(optimizer)
        return self.iteration.setdefault(id(optimizer), IterationState())

    def new_iteration(self) -> None:
        self.iteration.clear()

    # ------------------------------------------------------------------ gradients
    def grads(self, optimizer: torch.optim.Optimizer) -> kernels.Groups:
        """The optimizer's gradients grouped by (device, dtype); ``DTensor`` gradients (FSDP2) as their local
        shards, which in-place passes reach through."""
        state = self.state(optimizer)
        if not state.collected:
            state.collected = True
            collect = getattr(optimizer, "dls_collect_gradients", None)
            if collect is not None:
                collect()
        index = self._index(optimizer)
        groups = index.grads.groups()
        return distributed.local_shards(groups) if index.has_dtensors else groups

    def grads_of(self, optimizers: list[torch.optim.Optimizer]) -> kernels.Groups:
        merged: kernels.Groups = {}
        for optimizer in optimizers:
            for key, grads in self.grads(optimizer).items():
                merged.setdefault(key, []).extend(grads)
        return merged

    def _index(self, optimizer: torch.optim.Optimizer) -> _Index:
        signature = tuple((id(g["params"]), len(g["params"])) for g in optimizer.param_groups)
        index = self._indexes.get(optimizer)
        if index is None or index.signature != signature:
            lists = [g["params"] for g in optimizer.param_groups]
            params = [p for ps in lists for p in ps]
            index = _Index(signature, lists, kernels.GradIndex(params), distributed.has_dtensors(params))
            self._indexes[optimizer] = index
        return index

    # ------------------------------------------------------------------ steps
    def has_stepped(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether every parameter with a gradient has taken a step through this scaler: only then does all the
        state a step touches exist, so that the step can be skipped or masked on the device. O(1) once every
        parameter of the optimizer has stepped; a scan over parameters before that."""
        index = self._index(optimizer)
        if len(index.stepped) == len(index.grads.params):
            return True
        return all(id(p) in index.stepped for p in index.grads.params if p.grad is not None)

    def mark_stepped(self, optimizer: torch.optim.Optimizer) -> None:
        index = self._index(optimizer)
        if len(index.stepped) < len(index.grads.params):
            index.stepped.update((id(p), p) for p in index.grads.params if p.grad is not None)

    def record_step(
        self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor | None, skipped: bool | None
    ) -> None:
        self._last[optimizer] = LastStep(found_inf, skipped)

    def last_step(self, optimizer: torch.optim.Optimizer) -> LastStep:
        check_optimizer(optimizer)
        last = self._last.get(optimizer)
        if last is None:
            raise RuntimeError("step_was_skipped(): this optimizer has not stepped through this scaler yet")
        return last


def check_optimizer(optimizer: Any) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer; got {type(optimizer).__name__}")
