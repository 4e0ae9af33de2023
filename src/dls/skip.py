"""``skip_aware``: LR schedulers and weight averages that follow real optimizer updates, not attempts.

A ``GradScaler`` skips the optimizer steps whose gradients overflowed. Whatever else advances once per step (an LR
schedule, an EMA or SWA average, a step counter) should advance only when the step was applied, or the schedule
runs ahead of the weights and the average takes in the same weights twice. ``skip_aware(obj, scaler)`` wraps such
an object so that one of its methods does nothing after a skipped step; everything else passes through.

The decision comes from ``scaler.step_was_skipped(optimizer)``, the public record of the optimizer's last step:
free where ``step`` decided on the host (the default path), one lazy read of the overflow flag after a fused or
sync-free step. With ``sync_free=True`` a module's update is instead applied and then undone on the device
(``scaler.step_was_skipped_tensor``), without reading anything back.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from dls.checks import flag_problem
from dls.scaler import GradScaler

_T = TypeVar("_T")
_MAX_WRAPPER_DEPTH = 8  # .optimizer chains longer than this are not optimizer wrappers


class SkipAware:
    """A stand-in for ``obj`` whose gated method does nothing after a skipped optimizer step. Build it with
    [`skip_aware`][dls.skip_aware].

    Attribute reads, writes and calls go to ``obj``; ``isinstance(wrapper, type(obj))`` holds (``__class__``
    reports the wrapped class, as ``unittest.mock`` does), so frameworks that check for an ``LRScheduler`` or an
    ``nn.Module`` accept it. ``isinstance(wrapper, SkipAware)`` tells a wrapper apart, ``wrapper.__wrapped__`` is
    the object itself. Special methods other than ``__call__`` (``len``, iteration, indexing) are not forwarded.
    """

    __slots__ = ("_candidates", "_method", "_optimizer", "_resolved", "_scaler", "_sync_free", "_wrapped")

    _wrapped: Any
    _scaler: GradScaler
    _optimizer: Any
    _method: str
    _sync_free: bool
    _candidates: tuple[torch.optim.Optimizer, ...]
    _resolved: torch.optim.Optimizer | None

    def __init__(
        self,
        obj: Any,
        scaler: GradScaler,
        *,
        optimizer: Any = None,
        method: str | None = None,
        sync_free: bool = False,
    ) -> None:
        if isinstance(obj, SkipAware):
            raise ValueError("obj is already skip-aware; wrap the original object once")
        if not isinstance(scaler, GradScaler):
            raise ValueError(f"scaler must be a dls.GradScaler; got {type(scaler).__name__}")
        if problem := flag_problem("sync_free", sync_free):
            raise ValueError(problem)
        gated = _gated_method(obj, method)
        if sync_free and not isinstance(obj, torch.nn.Module):
            raise ValueError(
                "sync_free=True undoes a skipped update on the device, which needs the object's state as tensors: "
                f"obj must be a torch.nn.Module (an AveragedModel or an EMA module); got {type(obj).__name__}"
            )
        source = optimizer if optimizer is not None else getattr(obj, "optimizer", None)
        # No optimizer named: the one the scaler steps, bound at the first gated call after a step.
        candidates = () if source is None else _optimizer_chain(source)
        if source is not None and not candidates:
            raise ValueError(
                "optimizer must be a torch.optim.Optimizer or a wrapper that keeps one as .optimizer (Accelerate's "
                f"AcceleratedOptimizer, Lightning's LightningOptimizer); got {type(source).__name__}"
            )
        for name, value in (
            ("_wrapped", obj),
            ("_scaler", scaler),
            ("_optimizer", optimizer),
            ("_method", gated),
            ("_sync_free", sync_free),
            ("_candidates", candidates),
            ("_resolved", None),
        ):
            object.__setattr__(self, name, value)

    # ------------------------------------------------------------------ the decision
    def _stepped_optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer of the chain that steps through the scaler; ``None`` while none of them has stepped. Without
        a chain, the scaler's one stepped optimizer (an error naming them when it has stepped several)."""
        if self._resolved is None and not self._candidates:
            stepped = self._scaler.stepped_optimizers()
            if len(stepped) > 1:
                names = ", ".join(f"{type(o).__name__} at {id(o):#x}" for o in stepped)
                raise ValueError(
                    f"skip_aware({type(self._wrapped).__name__}, scaler) cannot tell which optimizer's steps decide: "
                    f"the scaler has stepped {len(stepped)} optimizers ({names}); pass optimizer=<one of them>"
                )
            if stepped:
                object.__setattr__(self, "_resolved", stepped[0])
        if self._resolved is None:
            for candidate in self._candidates:
                try:
                    self._scaler.step_was_skipped_tensor(candidate)
                except RuntimeError:  # the scaler raises for an optimizer that has not stepped through it yet
                    continue
                object.__setattr__(self, "_resolved", candidate)
                break
        return self._resolved

    def _call_gated(self, method: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        optimizer = self._stepped_optimizer()
        if optimizer is None:  # before the first optimizer step nothing was skipped: behave like the object
            return method(*args, **kwargs)
        if not self._sync_free:
            return None if self._scaler.step_was_skipped(optimizer) else method(*args, **kwargs)
        skipped = self._scaler.step_was_skipped_tensor(optimizer)
        module: torch.nn.Module = self._wrapped
        tensors = list(itertools.chain(module.parameters(), module.buffers()))
        before = [t.detach().clone() for t in tensors]
        result = method(*args, **kwargs)
        with torch.no_grad():
            for tensor, old in zip(tensors, before):
                tensor.copy_(torch.where(skipped.to(tensor.device, non_blocking=True), old, tensor))
        return result

    # ------------------------------------------------------------------ the pass-through
    def __getattr__(self, name: str) -> Any:
        if name in SkipAware.__slots__:  # not set yet (half-built): never look it up on the wrapped object
            raise AttributeError(name)
        value = getattr(self._wrapped, name)
        if name != self._method:
            return value

        def gated(*args: Any, **kwargs: Any) -> Any:
            return self._call_gated(value, args, kwargs)

        gated.__name__ = name
        gated.__doc__ = getattr(value, "__doc__", None)
        return gated

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._wrapped, name, value)

    def __delattr__(self, name: str) -> None:
        delattr(self._wrapped, name)

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        return type(self._wrapped)

    @property
    def __wrapped__(self) -> Any:
        return self._wrapped

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the wrapped object."""
        return self._wrapped(*args, **kwargs)

    def __dir__(self) -> list[str]:
        return dir(self._wrapped)

    def __repr__(self) -> str:
        return f"skip_aware({self._wrapped!r}, gates={self._method!r})"

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        # Pickling rebuilds the wrapper around the (pickled) object, scaler and optimizer.
        return (_rebuild, self._arguments())

    def __copy__(self) -> Any:
        return _rebuild(*self._arguments())

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return _rebuild(*copy.deepcopy(self._arguments(), memo))

    def _arguments(self) -> tuple[Any, GradScaler, Any, str, bool]:
        return (self._wrapped, self._scaler, self._optimizer, self._method, self._sync_free)


def skip_aware(
    obj: _T,
    scaler: GradScaler,
    *,
    optimizer: Any = None,
    method: str | None = None,
    sync_free: bool = False,
) -> _T:
    """Wrap ``obj`` so that its per-step method does nothing when the last optimizer step was skipped.

    Args:
        obj: an LR scheduler (its ``step()`` is gated), an averaged model such as
            ``torch.optim.swa_utils.AveragedModel`` (``update_parameters()`` is gated), or any object whose gated
            method you name with ``method=`` (e.g. ``method="update"`` for EMA classes that call it so).
        scaler: the ``dls.GradScaler`` that steps the optimizer.
        optimizer: the optimizer whose steps decide. Default: ``obj.optimizer`` (every torch LR scheduler has one),
            else the optimizer the scaler steps, bound at the first gated call after a step (before any step the
            call passes through; a scaler that has stepped several optimizers makes that call raise, naming them,
            and ``optimizer=`` is needed). Wrappers that keep the real optimizer as ``.optimizer`` (Accelerate's
            ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``) are accepted: the decision comes from the
            first optimizer along ``optimizer``, ``optimizer.optimizer``, ... that has stepped through ``scaler``.
        method: the method to gate; default ``"update_parameters"`` if ``obj`` has one, else ``"step"`` for an
            object with ``.step()`` and ``.optimizer`` (an LR scheduler).
        sync_free: for ``nn.Module`` objects: run the update every time and put back the module's parameters and
            buffers on the device where the step was skipped (``torch.where``, bit-exact), so nothing is read back
            to the host. Costs a copy of the module's parameters and buffers per call; the update must change them
            in place (``AveragedModel`` does). Default: read the decision on the host (free on the scaler's default
            path, one read after fused or sync-free steps).

    Returns:
        The wrapper (typed as ``obj``): use it in place of ``obj``; ``state_dict``, ``get_last_lr`` and every other
        attribute pass through.

    Decisions, per optimizer step:

    * The gated method follows the outcome of the optimizer's most recent ``scaler.step``, however often it is
      called in between: with gradient accumulation the decision is made per optimizer step, not per
      micro-batch, so call the gated method once per optimizer step, as you would without dls. A scheduler
      stepped per epoch must not be wrapped: it would follow only the epoch's last step.
    * Before the optimizer's first step through ``scaler`` nothing has been skipped, and the wrapper behaves
      exactly like ``obj``.
    * A disabled scaler never skips.

    Raises:
        ValueError: ``scaler`` is not a ``dls.GradScaler``, ``obj`` has no such method, ``optimizer`` holds no
            torch optimizer, ``obj`` is already wrapped, or ``sync_free=True`` for an object that is not an
            ``nn.Module``.
    """
    wrapper: Any = SkipAware(obj, scaler, optimizer=optimizer, method=method, sync_free=sync_free)
    return wrapper


def _gated_method(obj: Any, method: str | None) -> str:
    if method is not None:
        if not isinstance(method, str) or not callable(getattr(obj, method, None)):
            raise ValueError(f"method must name a method of {type(obj).__name__}; got {method!r}")
        return method
    if callable(getattr(obj, "update_parameters", None)):
        return "update_parameters"
    if callable(getattr(obj, "step", None)) and hasattr(obj, "optimizer"):
        return "step"
    raise ValueError(
        f"skip_aware wraps an LR scheduler (.step() and .optimizer) or an averaged model (.update_parameters()); "
        f"{type(obj).__name__} is neither: name the method to gate with method=..."
    )


def _optimizer_chain(source: Any) -> tuple[torch.optim.Optimizer, ...]:
    """``source``, ``source.optimizer``, ... : the torch optimizers among them, outermost first."""
    chain: list[torch.optim.Optimizer] = []
    current = source
    for _ in range(_MAX_WRAPPER_DEPTH):
        if isinstance(current, torch.optim.Optimizer) and all(current is not c for c in chain):
            chain.append(current)
        inner = getattr(current, "optimizer", None)
        if inner is None or inner is current:
            break
        current = inner
    return tuple(chain)


def _rebuild(obj: Any, scaler: GradScaler, optimizer: Any, method: str, sync_free: bool) -> Any:
    return SkipAware(obj, scaler, optimizer=optimizer, method=method, sync_free=sync_free)
