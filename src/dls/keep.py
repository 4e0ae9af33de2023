"""``dls.keep_in_float32(model, modules)``: chosen modules compute in float32 inside ``torch.autocast`` and under
``dls.emulate`` / ``dls.fp8.emulate_recipe``, until the returned handle is removed.

Loss scaling rescues gradients; it cannot rescue a forward pass whose half-precision activations exceed the format's
largest value (65504 for float16). Running the module where that happens in float32 can: Hugging Face keeps such a
list per architecture (``_keep_in_fp32_modules``); here any module can be listed, and ``scaler.watch(model,
fallback=True)`` finds and lists them by itself.

How a module is kept. Its class is swapped for a subclass (created once per class) whose ``__call__``, around the
module's own call (hooks included):

* casts floating-point inputs to float32 and disables autocast on their device type (and the CPU's);
* computes with float32 copies of half-precision parameters of the module and its descendants (``p.float()``, exact;
  the gradient flows back to the half parameter, which is never written), the same parameter substitution
  ``dls.emulate`` uses;
* marks the call as kept, so that ``dls.emulate`` rounds nothing in the module or its descendants and a kept
  ``nn.Linear`` under ``dls.fp8.emulate_recipe`` computes without FP8 casts;
* hands floating outputs back as its neighbours expect them: inside autocast in float32 (the next autocast op casts
  them down as usual); outside it, in the half dtype the call's floating inputs came in (else the half dtype of the
  module's parameters), so that a model whose parameters are half (``model.half()``, the trainer's
  ``precision.half_params``), which computes without autocast, goes on in its dtype. An output beyond the half
  format's range becomes inf there, as it would in the module's consumer: keep the module that holds both.

Why a class swap rather than hooks: ``torch.compile`` guards on a module's class (hooks added after compiling are
ignored by Dynamo), so keeping or releasing a module recompiles. The same technique is used by FSDP2's
``fully_shard``. ``isinstance`` checks, ``named_modules``, parameters and state-dict keys are unchanged;
``remove()`` puts the original class back. A module kept by several handles stays kept until the last is removed.

Copies. A kept module pickles as its original class plus the fact that it is kept, so ``torch.save(model)`` (loaded
with ``torch.load(..., weights_only=False)``), ``copy.deepcopy`` and ``multiprocessing`` (which pickles what it sends
to a spawned process) give a model whose copies of the kept modules compute in float32 too. No handle holds a copy:
``keep_in_float32(copy, names).remove()`` releases it. State dicts are unaffected either way.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from dls.handles import Removable

__all__ = ["KeptInFloat32", "in_kept_call", "is_kept", "keep_in_float32"]

_HALF = (torch.float16, torch.bfloat16)
_kept_depth = 0  # how many kept calls are running (a module-level int: Dynamo traces reads and writes of it)
_holders: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()  # handles keeping each module
_subclasses: dict[type, type] = {}


def in_kept_call() -> bool:
    """Whether a kept module's call is running (``dls.emulate``, ``dls.fp8.emulate_recipe`` then leave values alone)."""
    return _kept_depth > 0


def is_kept(module: nn.Module) -> bool:
    """Whether ``module`` itself is kept in float32."""
    return isinstance(module, _Float32Call)


class _Float32Call:
    """Mixed in front of a kept module's class (see the module docstring)."""

    _dls_original_class: type

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        global _kept_depth
        module: nn.Module = self  # type: ignore[assignment]
        device_types, halves = {"cpu"}, []

        def to_float32(t: torch.Tensor) -> torch.Tensor:
            device_types.add(t.device.type)
            if t.dtype in _HALF:
                halves.append(t.dtype)
            return t if t.dtype == torch.float64 else t.float()

        args, kwargs = map_floating(args, to_float32), map_floating(kwargs, to_float32)
        with contextlib.ExitStack() as stack:
            autocast = False
            for device_type in sorted(device_types):
                if torch.is_autocast_enabled(device_type):
                    autocast = True
                    stack.enter_context(torch.autocast(device_type, enabled=False))
            stack.enter_context(_float32_parameters(module))
            _kept_depth += 1
            try:
                out = super().__call__(*args, **kwargs)  # type: ignore[misc]
            finally:
                _kept_depth -= 1
        if autocast:  # the next autocast op casts the float32 outputs
            return out
        back = halves[0] if halves else next((p.dtype for p in module.parameters() if p.dtype in _HALF), None)
        return out if back is None else map_floating(out, lambda t: t.to(back) if t.dtype == torch.float32 else t)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # The kept class is made at run time (no importable name): pickle the original class, rebuilt kept.
        module: nn.Module = self  # type: ignore[assignment]
        return _new_kept, (self._dls_original_class,), module.__getstate__()


def _new_kept(cls: type) -> Any:
    """A new instance of ``cls`` kept in float32 (what pickles of a kept module are rebuilt from)."""
    kept: Any = _kept_class(cls)
    return kept.__new__(kept)


def _kept_class(cls: type) -> type:
    kept = _subclasses.get(cls)
    if kept is None:
        kept = type(cls.__name__, (_Float32Call, cls), {"_dls_original_class": cls, "__module__": cls.__module__})
        kept.__qualname__ = f"{cls.__qualname__} (kept in float32)"
        _subclasses[cls] = kept
    return kept


@contextlib.contextmanager
def _float32_parameters(module: nn.Module) -> Iterator[None]:
    """Half parameters of ``module`` and its descendants replaced by float32 copies for the call."""
    swapped: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    for owner in module.modules():
        slots: dict[str, Any] = owner._parameters
        for name, p in slots.items():
            if p is not None and p.dtype in _HALF:
                swapped.append((slots, name, p))
    for slots, name, p in swapped:
        slots[name] = p.float()
    try:
        yield
    finally:
        for slots, name, p in reversed(swapped):
            slots[name] = p


def map_floating(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply fn to every floating-point tensor in nested tuples / lists / dicts; anything else passes (the one walk
    over call arguments and outputs, shared with ``dls.emulate``)."""
    if isinstance(value, torch.Tensor):
        return fn(value) if value.is_floating_point() else value
    if isinstance(value, tuple):
        items = [map_floating(v, fn) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, list):
        return [map_floating(v, fn) for v in value]
    if isinstance(value, dict):
        return type(value)((k, map_floating(v, fn)) for k, v in value.items())
    return value


def floating_tensors(value: Any) -> list[torch.Tensor]:
    """The floating-point tensors ``map_floating`` would visit, in its order, without rebuilding the containers."""
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in floating_tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in floating_tensors(v)]
    return []


class KeptInFloat32(Removable):
    """What [`keep_in_float32`][dls.keep_in_float32] returns: ``names`` are the kept modules' qualified names, in the
    order given; ``remove()`` (idempotent; also on leaving a ``with`` block) restores the modules' classes."""

    def __init__(self, model: nn.Module, modules: list[tuple[str, nn.Module]]) -> None:
        self.model = model
        self._modules: dict[str, nn.Module] = {}
        for name, module in modules:
            self.add(name, module)

    @property
    def names(self) -> tuple[str, ...]:
        """Qualified names of the modules this handle keeps, in the order they were added."""
        return tuple(self._modules)

    @property
    def active(self) -> bool:
        """Whether any module is kept by this handle."""
        return bool(self._modules)

    def add(self, name: str, module: nn.Module) -> None:
        """Keep one more module (no-op when this handle keeps it already)."""
        if name in self._modules:
            return
        if not is_kept(module):
            module.__class__ = _kept_class(type(module))
        _holders[module] = _holders.get(module, 0) + 1
        self._modules[name] = module

    def remove(self) -> None:
        """Stop keeping this handle's modules (a module another handle keeps stays kept)."""
        for module in self._modules.values():
            held = _holders.get(module, 0) - 1
            if held > 0:
                _holders[module] = held
                continue
            _holders.pop(module, None)
            if is_kept(module):
                module.__class__ = type(module)._dls_original_class  # type: ignore[attr-defined]
        self._modules.clear()

    def __repr__(self) -> str:
        return f"KeptInFloat32({list(self._modules)}, {self._state()})"


def resolve_modules(
    model: nn.Module, modules: Iterable[str | nn.Module], what: str = "modules"
) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of each entry of ``modules`` (names as in ``model.named_modules()``, or module
    objects of ``model``), checked before anything changes; ``ValueError`` naming the first unknown entry."""
    if isinstance(modules, (str, nn.Module)):
        modules = [modules]
    by_name = dict(model.named_modules(remove_duplicate=False))
    by_object = {id(m): n for n, m in reversed(list(by_name.items()))}
    found: list[tuple[str, nn.Module]] = []
    for entry in modules:
        if isinstance(entry, str):
            if entry not in by_name:
                raise ValueError(
                    f"{what}: the model has no module named {entry!r} (names as in model.named_modules(), e.g. "
                    f"{', '.join(repr(n) for n in list(by_name)[1:4])})"
                )
            found.append((entry, by_name[entry]))
        elif isinstance(entry, nn.Module):
            if id(entry) not in by_object:
                raise ValueError(f"{what}: {type(entry).__name__} module {entry!r} is not part of the model")
            found.append((by_object[id(entry)], entry))
        else:
            raise ValueError(f"{what} must hold module names (str) or nn.Module objects; got {type(entry).__name__}")
    return found


def keep_in_float32(model: nn.Module, modules: Iterable[str | nn.Module]) -> KeptInFloat32:
    """Make the listed modules of ``model`` compute in float32 inside ``torch.autocast`` and under ``dls.emulate``
    (see the module docstring), until the returned handle is removed.

    Args:
        model: an ``nn.Module`` (a ``DistributedDataParallel`` or ``torch.compile`` wrapper is looked through: names
            are those of the wrapped module).
        modules: qualified names as in ``model.named_modules()`` (``""`` is the whole model), or module objects.

    Returns:
        A `KeptInFloat32` handle; ``handle.remove()`` restores the model exactly.

    Raises:
        ValueError: ``model`` is not an ``nn.Module``, or an entry of ``modules`` is not one of its modules (nothing
            changes then).
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    root = unwrap(model)
    return KeptInFloat32(root, resolve_modules(root, modules))


def unwrap(model: nn.Module) -> nn.Module:
    """The module that names the submodules: DDP's ``module`` and torch.compile's ``_orig_mod`` are looked through."""
    while True:
        inner = None
        if isinstance(model, nn.parallel.DistributedDataParallel):
            inner = model.module
        elif type(model).__name__ == "OptimizedModule":
            inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner
