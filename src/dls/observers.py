"""What takes part in a scaler's iterations besides its optimizers, each through a declared protocol: observers of its
steps (``StepObserver``, attached with ``GradScaler.observe``: the diagnostics' watches and recorder), and the
diagnostics themselves (``Diagnostics``: ``dls.diagnostics`` gives ``GradScaler.watch``, ``record`` and
``overflow_report`` their bodies, registering itself with ``use_diagnostics`` when imported, which ``import dls``
does). The core imports nothing of the diagnostics; they use the scaler's public methods alone.

What an optimizer wrapper may offer the scaler: ``dls.optimizers.HoldsGradients``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from dls import kernels
from dls.handles import Removable

if TYPE_CHECKING:
    from dls.scaler import GradScaler

__all__ = ["Diagnostics", "StepObserver", "diagnostics", "use_diagnostics"]


class StepObserver(Protocol):
    """What observes a scaler's iterations, attached with ``GradScaler.observe``: the diagnostics' watches and
    recorder. The scaler calls these, in the order of an iteration."""

    @property
    def wants_outcome(self) -> bool:
        """Whether to know on the host, per step, whether it was skipped: while one observer wants it, the scaler
        reads the flag where it would not (fused and sync-free steps: one read each)."""
        ...

    def loss_scaled(self, outputs: Any) -> None:
        """``scale(outputs)`` was called (a tensor, or nested lists/tuples of them)."""

    def step_decided(self, optimizer: torch.optim.Optimizer, skipped: bool | None) -> None:
        """``step(optimizer)`` was taken or skipped (``skipped``; ``None``: decided on the device, not read)."""

    def before_rule(self, found_inf: torch.Tensor, gradients: Callable[[], kernels.Groups]) -> None:
        """The rule is about to run on ``found_inf``; ``gradients()`` groups this iteration's unscaled gradients."""

    def iteration_ended(self) -> None:
        """``update()`` ran: the next ``scale()`` starts a new iteration."""


class Diagnostics(Protocol):
    """What ``dls.diagnostics`` gives every scaler (``use_diagnostics``), so that the core imports none of it."""

    def new_scaler(self, scaler: GradScaler) -> None:
        """A scaler was made (or unpickled): register the state it keeps in the scaler's checkpoint."""

    def watch(self, scaler: GradScaler, model: torch.nn.Module, fallback: bool, process_group: Any) -> Any:
        """The body of ``GradScaler.watch``."""

    def record(self, scaler: GradScaler, file: Any, **options: Any) -> Any:
        """The body of ``GradScaler.record``."""

    def overflow_report(self, scaler: GradScaler) -> Any:
        """The body of ``GradScaler.overflow_report``."""


_DIAGNOSTICS: list[Diagnostics] = []


def use_diagnostics(diagnostics: Diagnostics) -> None:
    """Give every scaler made from now on ``diagnostics`` (``dls.diagnostics`` calls this when imported)."""
    _DIAGNOSTICS[:] = [diagnostics]


def diagnostics() -> Diagnostics | None:
    """What ``use_diagnostics`` registered, if anything."""
    return _DIAGNOSTICS[0] if _DIAGNOSTICS else None


class Observation(Removable):
    """The handle ``GradScaler.observe`` returns: ``remove()`` detaches the observer."""

    def __init__(self, observers: list[StepObserver], observer: StepObserver) -> None:
        self._observers, self._observer = observers, observer

    @property
    def active(self) -> bool:
        return any(o is self._observer for o in self._observers)

    def remove(self) -> None:
        self._observers[:] = [o for o in self._observers if o is not self._observer]
