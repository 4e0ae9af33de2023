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
    """What is cached per optimizer, valid while its param groups hold the same parameters (an identity check of
    the lists per step: a parameter swapped into an existing list re-indexes)."""

    signature: tuple[tuple[int, ...], ...]
    grads: kernels.GradIndex  # holds the parameters, so the ids in the signature cannot be reused
    has_dtensors: bool
    # Parameters that have taken a step through this scaler (id → parameter), valid while the optimizer's state is
    # the same object and has not shrunk: only for them does all the state a step touches exist, so that their step
    # can be skipped or masked on the device. A reset (optimizer.load_state_dict, optimizer.state.clear()) forgets
    # them, and their next step is decided on the host again.
    stepped: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    state: Any = None  # the optimizer.state object the stepped record refers to
    state_len: int = 0  # its length when last marked
    # Other optimizers of this scaler sharing a parameter with this one: (optimizer ref, where, where theirs).
    shared: list[tuple[weakref.ref[torch.optim.Optimizer], str, str, tuple[int, ...]]] = dataclasses.field(
        default_factory=list
    )


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
        index = self._index(optimizer)
        if index.shared:
            self.check_disjoint([optimizer])
        if not state.collected:
            state.collected = True
            collect = getattr(optimizer, "dls_collect_gradients", None)
            if collect is not None:
                collect()
        groups = index.grads.groups()
        return distributed.local_shards(groups) if index.has_dtensors else groups

    def grads_of(self, optimizers: list[torch.optim.Optimizer]) -> kernels.Groups:
        merged: kernels.Groups = {}
        for optimizer in optimizers:
            for key, grads in self.grads(optimizer).items():
                merged.setdefault(key, []).extend(grads)
        return merged

    def _index(self, optimizer: torch.optim.Optimizer) -> _Index:
        signature = tuple(tuple(map(id, g["params"])) for g in optimizer.param_groups)
        index = self._indexes.get(optimizer)
        if index is None or index.signature != signature:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            _refuse_repeats(optimizer)
            index = _Index(signature, kernels.GradIndex(params), distributed.has_dtensors(params))
            self._link_shared(optimizer, index)
            self._indexes[optimizer] = index
        return index

    def _link_shared(self, optimizer: torch.optim.Optimizer, index: _Index) -> None:
        """Record which other optimizers of this scaler hold a parameter of ``optimizer`` (both ways): unscaling
        both in one iteration would unscale that gradient twice (``check_disjoint``)."""
        where = _positions(optimizer)
        for other, other_index in list(self._indexes.items()):
            other_index.shared = [s for s in other_index.shared if s[0]() not in (None, optimizer)]
            if other is optimizer:
                continue
            theirs = _positions(other)
            common = where.keys() & theirs.keys()
            if common:
                pid = next(iter(common))
                shape = tuple(where[pid][1].shape)
                index.shared.append((weakref.ref(other), where[pid][0], theirs[pid][0], shape))
                other_index.shared.append((weakref.ref(optimizer), theirs[pid][0], where[pid][0], shape))

    def check_disjoint(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Refuse, before anything changes, to unscale ``optimizers`` together or after other optimizers of this
        iteration when they share a parameter: its gradient would be unscaled (and counted in a norm) twice."""
        indexes = [self._index(optimizer) for optimizer in optimizers]  # built first: building links them
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
                stage = self.iteration.get(id(other))
                if j is None and stage is not None and stage.stage is not Stage.READY:
                    name = "optimizer" if len(optimizers) == 1 else f"optimizers[{i}]"
                    raise ValueError(
                        f"{name}.{mine} (shape {shape}) is also {theirs} of another optimizer already unscaled or "
                        "stepped in this iteration: its gradient would be unscaled twice; give each parameter to one "
                        "optimizer"
                    )

    # ------------------------------------------------------------------ steps
    def has_stepped(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether every parameter with a gradient has taken a step through this scaler since the optimizer's state
        was last reset: only then does all the state a step touches exist, so that the step can be skipped or
        masked on the device. O(1) once every parameter has stepped (the identity and length of
        ``optimizer.state``); a scan over parameters before that."""
        index = self._index(optimizer)
        state = optimizer.state
        if state is not index.state or len(state) < index.state_len:
            index.stepped.clear()  # reset (load_state_dict, state.clear(), del state[p]): look again
            index.state, index.state_len = state, len(state)
        if len(index.stepped) == len(index.grads.params):
            return True
        return all(id(p) in index.stepped for p in index.grads.params if p.grad is not None)

    def mark_stepped(self, optimizer: torch.optim.Optimizer) -> None:
        index = self._index(optimizer)
        if len(index.stepped) < len(index.grads.params):
            index.stepped.update((id(p), p) for p in index.grads.params if p.grad is not None)
        index.state, index.state_len = optimizer.state, len(optimizer.state)

    def record_step(
        self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor | None, skipped: bool | None
    ) -> None:
        self._last[optimizer] = LastStep(found_inf, skipped)

    def stepped_optimizers(self) -> list[torch.optim.Optimizer]:
        return list(self._last.keys())

    def last_step(self, optimizer: torch.optim.Optimizer) -> LastStep:
        check_optimizer(optimizer)
        last = self._last.get(optimizer)
        if last is None:
            raise RuntimeError("step_was_skipped(): this optimizer has not stepped through this scaler yet")
        return last


def _positions(optimizer: torch.optim.Optimizer) -> dict[int, tuple[str, torch.Tensor]]:
    return {
        id(p): (f"param_groups[{g}]['params'][{k}]", p)
        for g, group in enumerate(optimizer.param_groups)
        for k, p in enumerate(group["params"])
    }


def _refuse_repeats(optimizer: torch.optim.Optimizer) -> None:
    """A parameter twice in one optimizer (an in-place edit of its param groups) would be unscaled twice."""
    seen: dict[int, str] = {}
    for g, group in enumerate(optimizer.param_groups):
        for k, p in enumerate(group["params"]):
            where = f"param_groups[{g}]['params'][{k}]"
            if id(p) in seen:
                raise ValueError(
                    f"optimizer.{where} (shape {tuple(p.shape)}) is also optimizer.{seen[id(p)]}: a parameter listed "
                    "twice would have its gradient unscaled twice"
                )
            seen[id(p)] = where


def check_optimizer(optimizer: Any) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer; got {type(optimizer).__name__}")
