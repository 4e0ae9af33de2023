"""How a ``GradScaler`` step ends, on each path: taken, skipped on the host, handed to a fused kernel with the
flag, or run and undone on the device (sync-free); and the overflow report built when a watched step overflowed.

The default path decides on the host with the one read it makes anyway. Optimizers whose kernel takes the scale and
the flag (torch's fused Adam/AdamW/SGD/Adagrad) get them and decide on the device; so does ``sync_free=True`` for the
others. A parameter's first step is always decided on the host: state that does not exist yet cannot be protected
on the device (torch's fused SGD with momentum would keep uninitialised buffers after an overflowing first step).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from dls import sync_free
from dls.loss_scale import LossScale
from dls.overflow import OverflowCheck
from dls.tracking import IterationState, Stage, Tracker

if TYPE_CHECKING:
    from dls.diagnostics.watch import OverflowReport, OverflowWatch


class Reports:
    """The watches of a scaler and the overflow report of the current iteration (``GradScaler.watch``)."""

    def __init__(self) -> None:
        self.watches: list[OverflowWatch] = []
        self.seen_loss: Any = None  # what the last scale() was given, detached, while a watch is active
        self.report: OverflowReport | None = None
        self.stale = False  # update() ran: the next scale() starts an iteration without a report
        self.kept: list[str] | None = None  # a loaded state dict's kept_in_float32, for fallback watches made later

    def watch(self, model: torch.nn.Module, fallback: bool = False, process_group: Any = None) -> OverflowWatch:
        from dls.diagnostics.watch import OverflowWatch

        self.watches = [w for w in self.watches if w.active]
        watch = OverflowWatch(model, fallback=fallback, process_group=process_group)
        if fallback and self.kept is not None:
            try:
                watch.keep(self.kept, "the loaded state_dict['kept_in_float32']")
            except ValueError:
                watch.remove()
                raise
        self.watches.append(watch)
        return watch

    def kept_state(self) -> dict[str, list[str]]:
        from dls.diagnostics.fallback import kept_state

        return kept_state(self.active(), self.kept)

    def load_kept(self, state_dict: Any) -> tuple[Any, Any]:
        from dls.diagnostics.fallback import load_kept

        return load_kept(self, state_dict)

    def active(self) -> list[OverflowWatch]:
        return [w for w in self.watches if w.active]

    def new_loss(self, outputs: Any) -> None:
        """``scale()`` was called: a new iteration clears the last report; keep the loss for the next one."""
        if self.stale:
            self.report, self.stale = None, False
        if self.watches:
            self.seen_loss = _detached(outputs)

    def overflowed(self, watches: list[OverflowWatch], scale: LossScale) -> None:
        if self.report is not None:
            return  # the iteration's first overflowing step has reported already
        value = float(scale.tensor)  # the overflow path: one more read is fine
        reports = [w.after_skip(w.build_report(self.seen_loss, loss_scale=value)) for w in watches]
        self.report = next((r for r in reports if r.first_module is not None), reports[0] if reports else None)


class Stepper:
    """Takes or skips one optimizer's step once its overflow flag is known (see the module docstring)."""

    def __init__(
        self, tracker: Tracker, scale: LossScale, check: OverflowCheck, sync_free: bool, reports: Reports
    ) -> None:
        self.tracker = tracker
        self.scale = scale
        self.check = check
        self.sync_free = sync_free
        self.reports = reports

    def unchecked(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A disabled scaler's step: never skipped (closures pass through, as in torch)."""
        self.tracker.record_step(optimizer, None, False)
        return optimizer.step(*args, **kwargs)

    def if_finite(
        self, optimizer: torch.optim.Optimizer, state: IterationState, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        found_inf = state.found_inf
        assert found_inf is not None
        if takes_scale_and_flag(optimizer):
            return self.fused(optimizer, state, args, kwargs)
        state.stage = Stage.STEPPED
        if self.sync_free and self.tracker.has_stepped(optimizer):
            self._record(optimizer, found_inf, None)
            return sync_free.masked_step(optimizer, found_inf, args, kwargs)
        if self._record(optimizer, found_inf, self.scale.read_flag(found_inf)):
            return None
        result = optimizer.step(*args, **kwargs)
        self.tracker.mark_stepped(optimizer)
        return result

    def fused(
        self, optimizer: torch.optim.Optimizer, state: IterationState, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Hand the scale and the flag to an optimizer whose kernel unscales and skips by itself (no sync)."""
        grad_scale: torch.Tensor | None = None
        if state.stage is Stage.READY:
            # Only a read pass for the flag: the optimizer kernel divides by grad_scale while it updates.
            state.found_inf = self.check.check_scaled(optimizer)
            grad_scale = self.scale.tensor
        found_inf = state.found_inf
        assert found_inf is not None
        first_step = not self.tracker.has_stepped(optimizer)
        state.stage = Stage.STEPPED
        if first_step and self.scale.read_flag(found_inf):
            self._record(optimizer, found_inf, True)
            return None
        if self._record(optimizer, found_inf, False if first_step else None):
            return None  # known on the host (a watch read it): nothing for the kernel to do
        optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
        optimizer.found_inf = found_inf  # type: ignore[attr-defined]
        try:
            result = optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale  # type: ignore[attr-defined]
            del optimizer.found_inf  # type: ignore[attr-defined]
        if first_step:
            self.tracker.mark_stepped(optimizer)
        return result

    def _record(self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor, skipped: bool | None) -> bool:
        """Remember how the step ended; while a watch is active, know it now (one read on the fused and sync-free
        paths) and build the overflow report from the gradients, which still exist. Returns whether skipped."""
        watches = self.reports.active()
        if skipped is None and watches:
            skipped = self.scale.read_flag(found_inf)
        self.tracker.record_step(optimizer, found_inf, skipped)
        if skipped and watches:
            self.reports.overflowed(watches, self.scale)
        return bool(skipped)


def takes_scale_and_flag(optimizer: torch.optim.Optimizer) -> bool:
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def _detached(outputs: Any) -> Any:
    """``outputs`` (a tensor or nested lists/tuples of them) detached: kept for a report, without its graph."""
    if isinstance(outputs, torch.Tensor):
        return outputs.detach()
    if isinstance(outputs, (list, tuple)):
        return [_detached(o) for o in outputs]
    return None
