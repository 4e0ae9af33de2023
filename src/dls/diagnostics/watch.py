"""Overflow provenance: which parameters' gradients overflowed, in the order backward produced them.

``watch = OverflowWatch(model)`` names every parameter and module of ``model`` and records the order in which
backward finishes each parameter's gradient. After a step whose gradients overflowed, ``watch.build_report(loss)``
scans the gradients once and returns an [`OverflowReport`][dls.diagnostics.OverflowReport]: the first parameter in
backward order whose gradient is inf/NaN, the innermost module that owns it, every parameter with a non-finite gradient,
and whether the loss itself was already non-finite (a forward overflow, which no loss scale can fix).

How the order is recorded, and why this way. Each watched parameter gets a ``Tensor.register_post_accumulate_grad_
hook`` whose callable is ``OrderedDict.move_to_end`` of one dict holding every parameter: when autograd has
accumulated a parameter's gradient, the parameter moves to the end of that dict. The hook is a C method (no Python
frame, no tensor op, nothing allocated), so backward runs exactly the same kernels as without it (tested with a
dispatch mode that lists every aten op); what it costs is torch calling into Python once per parameter per
backward (about 0.5-1 µs on a CPU; ``benchmarks/bench_watch.py``). The dict holds one entry per parameter, so
memory stays bounded however long training runs. The alternative, rebuilding the order from the autograd graph
when a report is asked for, needs the graph of the loss to be alive at that moment (the scaler only keeps the
detached loss), has to re-implement the engine's scheduling, and misses parameters reached through nested
backward passes (reentrant activation checkpointing). The hooks record what the engine actually did:

* **DDP**: the hooks sit on the parameters themselves, which ``DistributedDataParallel`` shares with the
  wrapped module; its reducer's own hooks on the gradient accumulators are separate and unaffected, and
  ``remove()`` works while the model is wrapped. Names are those of the wrapped module (no ``module.``
  prefix; likewise ``torch.compile``'s ``_orig_mod.``). The report reads the local rank's gradients (after
  DDP's all-reduce, an inf from any rank is in every rank's gradients).
* **gradient accumulation**: each backward moves the parameters again, so the order is that of the most recent
  backward that reached each parameter; a gradient that overflowed in an earlier micro-batch stays non-finite
  (accumulation adds to it) and is reported.
* **dls.emulate**: emulation computes with rounded copies of the parameters, whose gradients flow unchanged
  (straight through) into the float32 ``Parameter`` objects that carry the hooks.

Parameters whose gradient was not accumulated by autograd since the watch was installed (gradients assigned by
hand, parameters frozen at watch time) come after all the others, in reverse registration order. That includes
every parameter under FSDP2 (``fully_shard``), which assigns the reduce-scattered gradient shards itself: there
the order is reverse registration order throughout, which is backward order for models whose modules are
registered in the order they run; the non-finite scan itself works on the local shards.

Modules without parameters cannot be named: ``first_module`` is the innermost module owning a parameter. An
overflow born in a parameter-free module (an activation, a residual addition, an attention softmax) reaches
parameters only upstream of it, so the report names the nearest module with parameters that runs *before* it in
the forward pass. ``dls.diagnostics.audit`` looks at every module's outputs and gradients instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from dls import distributed
from dls.checks import flag_problem
from dls.diagnostics.fallback import Fallback, KeptState
from dls.diagnostics.record import Recorder
from dls.diagnostics.scales import module_label, pow2
from dls.handles import Removable
from dls.keep import KeptInFloat32, resolve_modules, unwrap
from dls.observers import use_diagnostics
from dls.scaler import GradScaler

__all__ = ["NonFiniteGradient", "OverflowReport", "OverflowWatch"]

_LISTED = 12  # parameters listed one per line in str(report); the rest are counted


class _Seen:
    """Marks, in the order dict, where parameters that backward has reached begin."""

    def __repr__(self) -> str:
        return "<seen>"


@dataclasses.dataclass(frozen=True)
class NonFiniteGradient:
    """One parameter whose gradient holds inf or NaN values.

    Attributes:
        name: the parameter's qualified name (as in ``model.named_parameters()``).
        module: qualified name of the innermost module that owns it (``""`` is the root module).
        module_type: that module's class name.
        inf: number of infinite elements; ``nan``: number of NaN elements; ``numel``: elements in the gradient
            (of the local shard for sharded gradients, of the stored values for sparse ones).
    """

    name: str
    module: str
    module_type: str
    inf: int
    nan: int
    numel: int


@dataclasses.dataclass(frozen=True)
class OverflowReport:
    """Where a step's gradients overflowed: what
    [`OverflowWatch.build_report`][dls.diagnostics.OverflowWatch.build_report] returns (immutable).

    Attributes:
        first_module: qualified name of the innermost module owning the first parameter, in backward order, whose
            gradient is inf/NaN (``""`` is the root module); ``None`` when no watched gradient is non-finite (the
            overflow was found on another rank, or in parameters this watch does not cover). Modules without
            parameters are never named (see the module docstring).
        first_module_type: that module's class name, or ``None``.
        parameters: names of the parameters with non-finite gradients, in backward order.
        gradients: one [`NonFiniteGradient`][dls.diagnostics.NonFiniteGradient] per name in ``parameters``, same order.
        forward: ``True`` when the loss given to ``build_report`` was already inf/NaN (the forward pass
            overflowed: loss scaling cannot fix that), ``False`` when it was finite, ``None`` when no loss was given.
        watched: how many parameters the watch covers.
        loss_scale: the loss scale of the step, when the caller gave it (shown by ``str``).
        non_finite_parameters: with ``fallback=True``, after a forward overflow: the parameters whose values are
            inf/NaN (not a range problem: nothing is kept in float32 then), in registration order.
    """

    first_module: str | None
    first_module_type: str | None
    parameters: tuple[str, ...]
    gradients: tuple[NonFiniteGradient, ...]
    forward: bool | None
    watched: int
    loss_scale: float | None = None
    non_finite_parameters: tuple[str, ...] = ()

    @property
    def modules(self) -> tuple[str, ...]:
        """Owning modules of ``parameters``, each once, in backward order of their first parameter."""
        return tuple(dict.fromkeys(g.module for g in self.gradients))

    def __str__(self) -> str:
        scale = "" if self.loss_scale is None else f" at loss scale {pow2(self.loss_scale)}"
        n = len(self.parameters)
        lines = [f"Gradient overflow{scale}: {n} of {self.watched} watched parameters have inf/NaN gradients."]
        if self.first_module is None:
            lines.append(
                "No watched parameter has a non-finite gradient: the overflow was found on another rank, or in "
                "parameters this watch does not cover."
            )
        else:
            lines.append(
                f"First module, in backward order: {module_label(self.first_module)} ({self.first_module_type}). "
                "(Only modules with parameters can be named: an overflow inside a parameter-free module shows "
                "at the nearest module with parameters before it in the forward pass.)"
            )
            lines.append("Parameters, in backward order:")
            width = max(len(g.name) for g in self.gradients[:_LISTED])
            for g in self.gradients[:_LISTED]:
                lines.append(f"  {g.name:<{width}}  {g.inf} inf, {g.nan} NaN of {g.numel}")
            if n > _LISTED:
                rest = dict.fromkeys(module_label(g.module) for g in self.gradients[_LISTED:])
                lines.append(f"  ... and {n - _LISTED} more, in {len(rest)} modules: {_first(rest, 8)}")
        if self.forward is None:
            lines.append("Forward pass: not checked (no loss given).")
        elif self.forward:
            lines.append(
                "Forward pass: the loss was already inf/NaN before scaling, so the forward pass overflowed; no "
                "loss scale can fix that (dls.diagnostics.audit names the first module whose output exceeds the "
                "format)."
            )
        else:
            lines.append("Forward pass: the loss was finite; the overflow arose in backward.")
        if self.non_finite_parameters:
            n = len(self.non_finite_parameters)
            lines.append(
                f"{n} parameters hold inf/NaN values (not a range problem; nothing is kept in float32): "
                f"{_first(self.non_finite_parameters, _LISTED)}"
            )
        return "\n".join(lines)


class OverflowWatch(Removable):
    """Names the parameters and modules of ``model`` and records the order in which backward produces the
    parameters' gradients, so that [`build_report`][dls.diagnostics.OverflowWatch.build_report] can say where an
    overflow started.

    Installing it adds one Python-only hook per parameter that requires grad (see the module docstring for the
    cost and the reasons); nothing else runs until a report is built. Parameters added to the model (or
    replaced by new ``Parameter`` objects) after the watch was created are not watched. The watch is a context
    manager; [`remove`][dls.diagnostics.OverflowWatch.remove] takes every hook out and may be called any number of
    times.

    Args:
        model: an ``nn.Module``; a ``DistributedDataParallel`` or ``torch.compile`` wrapper is named through the
            module it wraps.
        fallback: keep modules whose half-precision output overflows in float32, automatically
            (``dls.diagnostics.fallback``); needs the scaler to tell the watch about skipped steps
            (``scaler.watch(model, fallback=True)``).
        process_group: the group whose ranks agree on the modules kept (the scaler's).

    Raises:
        ValueError: ``model`` is not an ``nn.Module``; ``fallback`` is not a bool.
    """

    def __init__(self, model: nn.Module, *, fallback: bool = False, process_group: Any = None) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be a torch.nn.Module; got {type(model).__name__}")
        if problem := flag_problem("fallback", fallback):
            raise ValueError(problem)
        root = unwrap(model)
        self.model = model
        names: dict[torch.Tensor, str] = {p: name for name, p in root.named_parameters()}
        owners: dict[torch.Tensor, tuple[str, str]] = {}
        for module_name, module in root.named_modules():
            for p in module._parameters.values():
                if p is not None and p in names and p not in owners:
                    owners[p] = (module_name, type(module).__name__)
        self._params: tuple[torch.Tensor, ...] = tuple(names)
        self._names = names
        self._owners = owners
        # Parameters in reverse registration order (a guess at backward order), then the mark; backward moves each
        # parameter it finishes behind the mark, so the dict's order after the mark is the recorded order.
        self._seen = _Seen()
        self._order: OrderedDict[object, None] = OrderedDict((p, None) for p in reversed(self._params))
        self._order[self._seen] = None
        self._hooks: list[RemovableHandle] = [
            p.register_post_accumulate_grad_hook(self._order.move_to_end) for p in self._params if p.requires_grad
        ]
        self.fallback: Fallback | None = Fallback(root, names, process_group) if fallback else None
        self._kept = KeptInFloat32(root, [])  # modules kept by keep() without the fallback
        self._removed = False

    # ------------------------------------------------------------------ queries
    @property
    def active(self) -> bool:
        """Whether the hooks are installed (or, with ``fallback=True``, until ``remove()``)."""
        return bool(self._hooks) or (self.fallback is not None and not self._removed)

    @property
    def kept_in_float32(self) -> tuple[str, ...]:
        """Names of the modules kept in float32 (by the fallback, or by [`keep`][dls.diagnostics.OverflowWatch.keep]),
        in the order they were added."""
        return self._kept.names if self.fallback is None else self.fallback.names

    @property
    def parameter_names(self) -> tuple[str, ...]:
        """Names of the watched parameters, in registration order."""
        return tuple(self._names[p] for p in self._params)

    def owner(self, parameter_name: str) -> str:
        """Qualified name of the innermost module that owns the named parameter (``""`` is the root).

        Args:
            parameter_name: a parameter's qualified name, as in ``model.named_parameters()``.
        """
        for p, name in self._names.items():
            if name == parameter_name:
                return self._owners[p][0]
        raise ValueError(f"parameter_name must be one of the watched parameters' names; got {parameter_name!r}")

    def keep(self, names: Any, what: str = "names") -> None:
        """Keep the named modules in float32 (``dls.keep_in_float32``) until ``remove()``; with ``fallback=True``
        they join ``kept_in_float32`` (and the scaler's state dict). Every name is checked first: ``ValueError``
        naming ``what`` and the first name the watched model does not have.

        Args:
            names: qualified module names, as in ``model.named_modules()``.
            what: how the error message calls ``names`` (e.g. a config key).
        """
        if self.fallback is not None:
            self.fallback.keep(self.fallback.check_names(names, what))
            return
        if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"{what} must be a list of module names; got {names!r}")
        for name, module in resolve_modules(unwrap(self.model), names, what):
            self._kept.add(name, module)

    def after_skip(self, report: OverflowReport) -> OverflowReport:
        """The scaler skipped a step and built ``report``: let the fallback keep, arm or give up (every rank calls
        this at the same skipped steps). Returns the report, naming non-finite parameters when there are some.

        Args:
            report: what the scaler built for the skipped step.
        """
        if self.fallback is None or self._removed:
            return report
        broken = self.fallback.after_skip(report.forward)
        return dataclasses.replace(report, non_finite_parameters=broken) if broken else report

    def forward_pass(self) -> contextlib.AbstractContextManager[None]:
        """A context manager marking one training pass of the watched model, for frameworks that run its
        submodules without calling the model itself (Lightning calls the LightningModule's ``training_step``, not
        its ``forward``): with ``fallback=True``, an armed fallback records the module calls inside it as one
        forward pass of the model. Changes nothing otherwise, and nothing where the model itself is called."""
        if self.fallback is None or self._removed:
            return contextlib.nullcontext()
        return self.fallback.forward_pass()

    def backward_order(self) -> tuple[str, ...]:
        """Names of the parameters whose gradients backward has accumulated since the watch was installed, in the
        order of each one's most recent accumulation."""
        return tuple(self._names[p] for p in self._split()[1])

    # ------------------------------------------------------------------ the report
    def build_report(self, loss: Any = None, *, loss_scale: float | None = None) -> OverflowReport:
        """Scan the watched parameters' gradients for inf/NaN and say where the overflow started.

        Meant for the overflow path: one ``torch._foreach_norm`` (max-abs) pass per (device, dtype) group of
        gradients, one host read per group, then one more for the element counts of the non-finite ones.

        Args:
            loss: the (unscaled) loss of the step, a tensor or nested lists/tuples of tensors, e.g. the detached
                loss given to ``GradScaler.scale``; ``forward`` is ``True`` when any of it is inf/NaN. ``None``:
                not checked.
            loss_scale: the step's loss scale (a number or a one-element tensor), only shown by ``str(report)``.

        Raises:
            ValueError: ``loss`` holds something other than tensors; ``loss_scale`` is not a positive number.
        """
        losses = list(_tensors(loss, "loss"))
        if isinstance(loss_scale, torch.Tensor) and loss_scale.numel() == 1:
            loss_scale = float(loss_scale.item())  # the overflow path: one read is fine
        if loss_scale is not None and (
            isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float)) or not loss_scale > 0
        ):
            raise ValueError(f"loss_scale must be a positive number or None; got {loss_scale!r}")
        forward: bool | None = None
        if loss is not None:
            forward = bool(any((~torch.isfinite(t.detach())).any().item() for t in losses if t.numel()))
        bad = self._non_finite()
        unrecorded, recorded = self._split()
        # Recorded parameters first, in recorded order; the others after them, in reverse registration order.
        rank = {p: i for i, p in enumerate(recorded + unrecorded)}
        bad.sort(key=lambda item: rank[item[0]])
        gradients = tuple(
            NonFiniteGradient(self._names[p], *self._owners[p], inf=n_inf, nan=n_nan, numel=numel)
            for p, n_inf, n_nan, numel in bad
        )
        first = gradients[0] if gradients else None
        return OverflowReport(
            first_module=first.module if first else None,
            first_module_type=first.module_type if first else None,
            parameters=tuple(g.name for g in gradients),
            gradients=gradients,
            forward=forward,
            watched=len(self._params),
            loss_scale=None if loss_scale is None else float(loss_scale),
        )

    def _split(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Watched parameters not yet reached by backward (reverse registration order), and those reached (in the
        order of their most recent accumulation)."""
        unrecorded: list[torch.Tensor] = []
        recorded: list[torch.Tensor] = []
        target = unrecorded
        for key in self._order:
            if key is self._seen:
                target = recorded
            else:
                assert isinstance(key, torch.Tensor)
                target.append(key)
        return unrecorded, recorded

    def _non_finite(self) -> list[tuple[torch.Tensor, int, int, int]]:
        """``(parameter, inf count, NaN count, numel)`` of every watched parameter with a non-finite gradient."""
        groups: dict[tuple[torch.device, torch.dtype], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for p in self._params:
            g = p.grad
            if g is None or not g.is_floating_point():
                continue
            if g.is_sparse:
                g = g._values()
            groups.setdefault((g.device, g.dtype), []).append((p, g))
        found: list[tuple[torch.Tensor, int, int, int]] = []
        for key, members in groups.items():
            grads = distributed.local_shards({key: [g for _, g in members]})[key]
            # Max-abs norms: NaN and inf propagate, and no finite gradient can overflow them (a 2-norm could).
            norms = torch._foreach_norm(grads, math.inf)
            finite = torch.isfinite(torch.stack([n.reshape(()) for n in norms])).tolist()
            suspects = [(p, g) for (p, _), g, ok in zip(members, grads, finite) if not ok]
            if suspects:
                counts = torch.stack([torch.stack([torch.isinf(g).sum(), torch.isnan(g).sum()]) for _, g in suspects])
                for (p, g), (n_inf, n_nan) in zip(suspects, counts.tolist()):
                    found.append((p, int(n_inf), int(n_nan), g.numel()))
        return found

    # ------------------------------------------------------------------ lifetime
    def remove(self) -> None:
        """Take every hook out (safe to call repeatedly, also while the model is wrapped in DDP). Reports can
        still be built afterwards, with the order recorded until then."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        if self.fallback is not None:
            self.fallback.remove()  # the model computes as before the watch again
        self._kept.remove()
        self._removed = True

    def __repr__(self) -> str:
        kept = "" if self.fallback is None else f", kept_in_float32={list(self.kept_in_float32)}"
        return (
            f"OverflowWatch({type(unwrap(self.model)).__name__}, parameters={len(self._params)}{kept}, {self._state()})"
        )


class Watches:
    """The watches of one ``GradScaler`` (``GradScaler.watch``), the overflow report of the current iteration and
    the modules its fallback watches keep in float32 (``kept``: the scaler's checkpoint entry ``kept_in_float32``).
    It observes the scaler (``dls.scaler.StepObserver``) only while a watch exists or a report is held: a step
    without them never enters this file."""

    def __init__(self, scaler: GradScaler) -> None:
        self._scaler = weakref.ref(scaler)
        self.watches: list[OverflowWatch] = []
        # What scale() was given in this iteration, detached, while a watch is active: every micro-batch's loss under
        # gradient accumulation, so that a forward overflow in any of them counts (the step is skipped for it).
        self.seen_losses: list[Any] = []
        self.report: OverflowReport | None = None
        self.stale = False  # update() ran: the next scale() starts an iteration without a report
        self.kept = KeptState(self.active)
        self._observation: Removable | None = None

    def watch(self, model: nn.Module, fallback: bool, process_group: Any) -> OverflowWatch:
        self.watches = [w for w in self.watches if w.active]
        watch = OverflowWatch(model, fallback=fallback, process_group=process_group)
        self.kept.adopt(watch)  # a loaded kept_in_float32 applies to a fallback watch made after the load
        self.watches.append(watch)
        scaler = self._scaler()
        if self._observation is None and scaler is not None:
            self._observation = scaler.observe(self)
        return watch

    def active(self) -> list[OverflowWatch]:
        return [w for w in self.watches if w.active]

    # ------------------------------------------------------------------ the scaler's iterations
    @property
    def wants_outcome(self) -> bool:
        """While a watch is active the scaler knows every step's outcome on the host (one read on the fused and
        sync-free paths), so that a skipped step gets its report while its gradients exist."""
        return any(w.active for w in self.watches)

    def loss_scaled(self, outputs: Any) -> None:
        """``scale()`` was called: a new iteration clears the last report and losses; keep the loss for the report."""
        if self.stale:
            self.report, self.stale = None, False
            self.seen_losses.clear()
        if self.watches:
            self.seen_losses.append(_detached(outputs))
        elif self.report is None and self._observation is not None:  # nothing left to observe
            self._observation.remove()
            self._observation = None

    def step_decided(self, optimizer: torch.optim.Optimizer, skipped: bool | None) -> None:
        watches = self.active() if skipped else []
        scaler = self._scaler()
        if watches and scaler is not None:
            self.overflowed(watches, float(scaler.get_scale_tensor()))  # the overflow path: one more read is fine

    def before_rule(self, found_inf: torch.Tensor, gradients: Any) -> None:
        return None

    def iteration_ended(self) -> None:
        self.stale = True

    def overflowed(self, watches: list[OverflowWatch], loss_scale: float) -> None:
        """A step of the iteration was skipped (agreed across ranks): report it, once per iteration."""
        if self.report is not None:
            return  # the iteration's first overflowing step has reported already
        # A fallback watch keeps, arms or gives up here. Its ranks agree on the module with a MAX all-reduce of their
        # own (Fallback.after_skip), on skipped steps only, not as an extra element of the per-step collective: that
        # element would cost every clean step an isfinite(loss) kernel and a larger collective, and the module found
        # is known on the host only after an armed pass.
        losses = self.seen_losses or None  # None: no scale() this iteration, the forward pass is not checked
        reports = [w.after_skip(w.build_report(losses, loss_scale=loss_scale)) for w in watches]
        self.report = next((r for r in reports if r.first_module is not None), reports[0] if reports else None)


class _Diagnostics:
    """What the diagnostics give every ``GradScaler`` (``dls.scaler.Diagnostics``): ``watch``, ``record``,
    ``overflow_report``, and the checkpoint entry ``kept_in_float32``."""

    def __init__(self) -> None:
        self._watches: weakref.WeakKeyDictionary[GradScaler, Watches] = weakref.WeakKeyDictionary()

    def new_scaler(self, scaler: GradScaler) -> None:
        watches = self._watches[scaler] = Watches(scaler)
        scaler.register_state("kept_in_float32", watches.kept)

    def watch(self, scaler: GradScaler, model: nn.Module, fallback: bool, process_group: Any) -> OverflowWatch:
        return self._watches[scaler].watch(model, fallback, process_group)

    def record(self, scaler: GradScaler, file: Any, **options: Any) -> Any:
        return Recorder(scaler, file, **options)

    def overflow_report(self, scaler: GradScaler) -> OverflowReport | None:
        return self._watches[scaler].report


use_diagnostics(_Diagnostics())


def _detached(outputs: Any) -> Any:
    """``outputs`` (a tensor or nested lists/tuples of them) detached: kept for a report, without its graph."""
    if isinstance(outputs, torch.Tensor):
        return outputs.detach()
    if isinstance(outputs, (list, tuple)):
        return [_detached(o) for o in outputs]
    return None


def _tensors(value: Any, what: str) -> Iterator[torch.Tensor]:
    if value is None:
        return
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item, what)
    else:
        raise ValueError(
            f"{what} must be a tensor, nested lists/tuples of tensors, or None; got {type(value).__name__}"
        )


def _first(names: Iterable[str], count: int) -> str:
    items = list(names)
    return ", ".join(items[:count]) + (", ..." if len(items) > count else "")
