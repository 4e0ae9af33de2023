"""The float32 fallback of ``scaler.watch(model, fallback=True)``: modules whose half-precision output overflows are
found and kept in float32 (``dls.keep_in_float32``), automatically.

When a step is skipped and its loss was already inf/NaN (the forward pass overflowed: no loss scale can fix that),
the fallback first checks the parameters: non-finite parameters are not a range problem, so nothing is kept and
the report names them. Otherwise it *arms*: temporary hooks on every module of the model for the next forward pass
with gradients enabled (passes under ``torch.no_grad()``, e.g. evaluation, are ignored). That pass records, per
module call in completion order, whether its floating inputs were finite and whether its outputs are, as device
flags read back once when the pass ends; the hooks are then removed. The module where the overflow was born is the
first call that produced a non-finite output from finite inputs (its parameters were checked already); a parent
completes after its children, so the innermost module is named.

At that pass's own skipped step the module is kept in float32 from then on and a warning names it, with the
largest |output| it gives in float32 (measured once, on the inputs of the armed pass, without gradients, with the
RNG states and the module's buffers restored). Two skipped steps per kept module, then: the one that showed the
overflow and the armed one. If the kept module's float32 output still overflows the next half-precision op, that
consumer is found the same way at the next overflow. An armed pass that finds nothing (non-finite inputs, an
overflow outside any module, e.g. in the loss function) at a forward-overflow skip counts as fruitless; after 3 the
fallback disarms for good and says so.

Clean steps cost nothing: no hook exists until a forward overflow has been seen. Overflows born in backward
(scaled gradients: the loss was finite) never arm anything: they are the loss scale's job.

Distributed: at a skipped step (which every rank takes, the overflow flag being agreed) the ranks agree with one
MAX all-reduce of one number: 0 no forward overflow anywhere, 1 a forward overflow but no module found,
``2 + (M - 1 - i)`` module ``i`` (of ``M`` in ``named_modules()`` order) found, so that the earliest module found on
any rank wins. It runs at every skipped step (a rank cannot tell from its own loss whether another rank's forward
pass overflowed) and never at a clean one. This is deliberately not an extra element of the scaler's per-step
collective: that would cost every clean step a kernel (whether the loss is finite, as a device flag) and a larger
collective, for an event that only matters once the step is skipped, when the host reads the flag anyway; and the
module an armed pass found is known on the host only. A caller with its own collective at skipped steps can carry
``Fallback.local_code`` in it and pass the reduced value as ``after_skip(agreed=...)``. Every rank must watch
with ``fallback=True``. The scaler calls the fallback at the one place it decides a step is skipped and builds the
overflow report (``dls.diagnostics.watch.Watches.overflowed``), once per iteration.

The kept set travels in the scaler's state dict (key ``kept_in_float32``) through ``KeptState``, which the
scaler registers with ``GradScaler.register_state``.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from dls import distributed

if TYPE_CHECKING:
    from dls.diagnostics.watch import OverflowWatch
    from dls.scaler import GradScaler
from dls.keep import KeptInFloat32, floating_tensors, resolve_modules

__all__ = ["Fallback", "KeptState", "apply_precision_fallback", "fallback_note"]

FRUITLESS_LIMIT = 3  # armed passes that find nothing before the fallback disarms for good


class Fallback:
    """The fallback state of one watch: the kept modules, the armed hooks and what the last armed pass found."""

    def __init__(self, root: nn.Module, params: dict[torch.Tensor, str], process_group: Any) -> None:
        self.root = root
        self.modules: list[tuple[str, nn.Module]] = list(root.named_modules())
        self.params = params
        self.process_group = process_group
        self.kept = KeptInFloat32(root, [])
        self.fruitless = 0
        self.disarmed = False
        self._hooks: list[RemovableHandle] = []
        self._recording = False
        self._calls: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (module index, inputs ok, outputs ok)
        self._open: dict[int, list[torch.Tensor]] = {}  # inputs ok of the calls still running, per module index
        self._inputs: dict[int, tuple[tuple[Any, ...], dict[str, Any]]] = {}
        self._found: int | None = None  # module index the last armed pass found
        self._class: type | None = None  # the root's class while armed
        self._pass_done = False

    # ------------------------------------------------------------------ kept modules
    @property
    def names(self) -> tuple[str, ...]:
        """Names of the kept modules, in the order they were added."""
        return self.kept.names

    def check_names(self, names: Any, what: str) -> list[tuple[str, nn.Module]]:
        """``(name, module)`` of each of ``names`` (a list of module names); ``ValueError`` naming ``what`` and the
        first name the model does not have. Changes nothing."""
        if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"{what} must be a list of module names; got {names!r}")
        return resolve_modules(self.root, names, what)

    def keep(self, modules: Iterable[tuple[str, nn.Module]]) -> None:
        """Keep ``modules`` (as ``check_names`` returns them) in float32 from now on."""
        for name, module in modules:
            self.kept.add(name, module)

    # ------------------------------------------------------------------ the skip path
    def local_code(self, forward: bool | None) -> int:
        """This rank's number for the agreement across ranks (see the module docstring): 0 no forward overflow, 1
        a forward overflow and no module found, ``2 + (M - 1 - i)`` module ``i`` found by the last armed pass."""
        if not forward:
            return 0
        return 1 if self._found is None else 2 + (len(self.modules) - 1 - self._found)

    def after_skip(self, forward: bool | None, agreed: int | None = None) -> tuple[str, ...]:
        """A step was skipped; ``forward``: whether this rank's loss was inf/NaN. Keeps, arms or gives up (see the
        module docstring); returns the names of non-finite parameters (nothing is kept or armed then).

        ``agreed``: the MAX of ``local_code`` over the ranks, when the caller reduced it already (e.g. as one
        more element of its own collective); ``None``: reduced here when distributed."""
        if self._recording:  # the step ran inside the armed pass (Lightning's manual optimization): it ends here
            self._end(self.root, (), None)
        code = self.local_code(forward) if agreed is None else agreed
        pass_done = self._pass_done
        self._found, self._pass_done = None, False
        if agreed is None and distributed.is_active(self.process_group):
            reduced = distributed.agree_on_overflow(torch.tensor(float(code), dtype=torch.float64), self.process_group)
            code = int(reduced.item())
        if code == 0 or self.disarmed:
            self._inputs.clear()
            return ()
        broken = self._non_finite_parameters()
        if broken:
            self._inputs.clear()
            return broken
        if code >= 2 and self._add(len(self.modules) - 1 - (code - 2)):
            self.fruitless = 0
        elif pass_done or code >= 2:  # nothing found, or a module kept already whose float32 output overflows
            self.fruitless += 1
            if self.fruitless >= FRUITLESS_LIMIT:
                self.disarmed = True
                warnings.warn(
                    f"dls fallback: {FRUITLESS_LIMIT} armed forward passes that overflowed found no module to keep "
                    "(the inputs were already inf/NaN, the overflow happens outside any module, e.g. in the loss "
                    "function, or a kept module's output overflows float32 itself, or the half dtype it is handed "
                    "back in to half-precision parameters); the fallback is disarmed and keeps nothing "
                    "more. dls.audit(...) names where the forward pass exceeds the format.",
                    stacklevel=4,
                )
                return ()
            self._arm()
        else:
            self._arm()
        self._inputs.clear()
        return ()

    def _add(self, index: int) -> bool:
        name, module = self.modules[index]
        if name in self.kept.names:
            return False  # kept already: a float32 overflow is not a range problem the fallback can fix
        self.kept.add(name, module)
        largest = self._measure(index)
        seen = "not measured on this rank" if largest is None else f"{largest:.6g}"
        warnings.warn(
            f"dls fallback: module {name or '<root>'!r} ({type(module).__name__}) produced inf/NaN in half precision "
            f"from finite inputs (largest |output| in float32: {seen}); it now runs in float32 "
            "(watch.kept_in_float32; saved in the scaler's state dict).",
            stacklevel=4,
        )
        return True

    def _measure(self, index: int) -> float | None:
        """The largest |output| of module ``index`` on the armed pass's inputs, computed as kept (float32)."""
        saved = self._inputs.get(index)
        if saved is None:
            return None
        module = self.modules[index][1]
        args, kwargs = saved
        buffers = {name: b.clone() for name, b in module.named_buffers()}
        devices = [t.device for t in module.parameters() if t.device.type == "cuda"]
        outputs: list[Any] = []  # as computed in float32, before a kept call hands them back in a half dtype
        hook = module.register_forward_hook(lambda _module, _args, out: outputs.append(out))
        with torch.no_grad(), torch.random.fork_rng(devices=list(dict.fromkeys(devices))):
            try:
                module(*args, **kwargs)
            finally:
                hook.remove()
        out = outputs[-1]
        with torch.no_grad():
            for name, b in module.named_buffers():
                b.copy_(buffers[name])
        values = [t.detach().abs().amax().float() for t in floating_tensors(out) if t.numel()]
        return float(torch.stack(values).amax()) if values else None

    def _non_finite_parameters(self) -> tuple[str, ...]:
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for p in self.params:
            if p.is_floating_point():
                groups.setdefault((p.device, p.dtype), []).append(p)
        broken: list[str] = []
        for key, members in groups.items():
            local = distributed.local_shards({key: [p.detach() for p in members]})[key]
            norms = torch._foreach_norm(local, math.inf)
            finite = torch.isfinite(torch.stack([n.reshape(()) for n in norms])).tolist()
            broken.extend(self.params[p] for p, ok in zip(members, finite) if not ok)
        order = {name: i for i, name in enumerate(self.params.values())}
        return tuple(sorted(broken, key=order.__getitem__))

    # ------------------------------------------------------------------ the armed pass
    @property
    def armed(self) -> bool:
        """Whether hooks wait for the next forward pass with gradients enabled."""
        return bool(self._hooks)

    def _arm(self) -> None:
        if self._hooks:
            return
        # torch.compile ignores hooks added after compiling: while armed, the root's class is one whose call Dynamo
        # does not trace, so the armed pass runs eagerly; restoring the class finds the compiled code again.
        self._class = type(self.root)
        self.root.__class__ = _eager_class(self._class)
        self._hooks.append(self.root.register_forward_pre_hook(_Armed(self._begin)))
        for index, (_, module) in enumerate(self.modules):
            pre = _Armed(self._make_pre(index))
            self._hooks.append(module.register_forward_pre_hook(pre, with_kwargs=True, prepend=True))
            self._hooks.append(module.register_forward_hook(_Armed(self._make_post(index))))
        self._hooks.append(self.root.register_forward_hook(_Armed(self._end)))

    def disarm(self) -> None:
        """Take the armed pass's hooks out and give the root its own class back."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        if self._class is not None and type(self.root) is _eager_classes.get(self._class):
            self.root.__class__ = self._class
        self._class = None
        self._recording = False
        self._calls.clear()
        self._open.clear()

    @contextlib.contextmanager
    def forward_pass(self) -> Iterator[None]:
        """While armed, the module calls inside count as one pass of the root, as if its forward had been called:
        for frameworks that run the root's submodules without calling the root (Lightning calls
        ``training_step``). A call of the root inside ends the pass at its end, as usual."""
        if self.armed:
            self._begin(self.root, ())
        yield
        if self._recording:
            self._end(self.root, (), None)

    def _begin(self, module: nn.Module, args: Any) -> None:
        if not self._recording and torch.is_grad_enabled():
            self._recording = True
            self._calls.clear()
            self._open.clear()
            self._inputs.clear()

    def _make_pre(self, index: int) -> Any:
        def pre(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if self._recording:
                self._inputs.setdefault(index, (args, kwargs))
                self._open.setdefault(index, []).append(_all_finite((args, kwargs)))

        return pre

    def _make_post(self, index: int) -> Any:
        def post(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            opened = self._open.get(index)
            if self._recording and opened:
                self._calls.append((index, opened.pop(), _all_finite(output)))

        return post

    def _end(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._recording:
            return
        calls = list(self._calls)
        self.disarm()
        self._pass_done = True
        self._found = None
        if calls:
            home = calls[0][1].device
            flags = torch.stack([torch.stack([i.to(home), o.to(home)]) for _, i, o in calls]).tolist()  # one read
            for (index, _, _), (inputs_ok, outputs_ok) in zip(calls, flags):
                if inputs_ok and not outputs_ok:
                    self._found = index
                    break
        keep = {} if self._found is None else {self._found: self._inputs[self._found]}
        self._inputs = keep

    def remove(self) -> None:
        """Disarm and stop keeping modules: the model computes as before the watch."""
        self.disarm()
        self._inputs.clear()
        self.kept.remove()


def apply_precision_fallback(
    model: nn.Module, scaler: GradScaler, keep_in_float32: Sequence[str] = (), fallback: bool = False
) -> OverflowWatch:
    """The trainer's wiring of ``precision.keep_in_float32`` and ``precision.fallback``: the scaler's watch of
    ``model`` (``fallback=True`` finds and keeps overflowing modules by itself), with the listed modules kept in
    float32 from the start (and, with the fallback, in ``watch.kept_in_float32`` and the scaler's state dict). Call
    it where the trainer calls ``scaler.watch(model)``, before or after ``scaler.load_state_dict``.

    Raises:
        ValueError: a name the model does not have (naming it and ``precision.keep_in_float32``); nothing changes.
    """
    if not isinstance(fallback, bool):
        raise ValueError(f"precision.fallback must be true or false; got {fallback!r}")
    watch = scaler.watch(model, fallback=fallback)
    try:
        watch.keep(list(keep_in_float32), "precision.keep_in_float32")
    except ValueError:
        watch.remove()
        raise
    return watch


class KeptState:
    """The scaler's checkpoint entry ``kept_in_float32`` (registered with ``GradScaler.register_state``): the names
    of the modules its fallback watches keep, in the order they were added. A loaded list is checked against the
    active fallback watches before anything changes, kept by them, and waits for fallback watches made later
    (``adopt``), so that ``watch(model, fallback=True)`` may come before or after ``load_state_dict``."""

    WHAT = "state_dict['kept_in_float32']"

    def __init__(self, watches: Callable[[], Sequence[OverflowWatch]]) -> None:
        self._watches = watches  # the scaler's active watches
        self.loaded: list[str] | None = None

    def _fallbacks(self) -> list[Fallback]:
        return [w.fallback for w in self._watches() if w.fallback is not None]

    def state_dict(self) -> list[str] | None:
        """The kept names while a fallback watch is active (or a loaded list waits for one); ``None`` otherwise
        (no key in the scaler's state dict)."""
        fallbacks = self._fallbacks()
        if not fallbacks:
            return None if self.loaded is None else list(self.loaded)
        return list(dict.fromkeys(name for fb in fallbacks for name in fb.names))

    def check_state(self, value: Any) -> None:
        """``ValueError`` naming the key and the first name an active fallback watch's model does not have."""
        if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
            raise ValueError(f"{self.WHAT} must be a list of module names; got {value!r}")
        for fb in self._fallbacks():
            fb.check_names(value, self.WHAT)

    def load_state_dict(self, value: list[str]) -> None:
        """Keep the checked names in the active fallback watches, and in those made later."""
        self.loaded = list(value)
        for fb in self._fallbacks():
            fb.keep(fb.check_names(value, self.WHAT))

    def adopt(self, watch: OverflowWatch) -> None:
        """A fallback watch made after a load keeps the loaded modules; on a name its model does not have, the
        watch is removed (the model is as before) and ``ValueError`` names it."""
        if watch.fallback is None or self.loaded is None:
            return
        try:
            watch.keep(self.loaded, f"the loaded {self.WHAT}")
        except ValueError:
            watch.remove()
            raise


def fallback_note(watch: OverflowWatch) -> str:
    """What the float32 fallback tried, for the trainer's stop at the loss-scale floor (``""`` without it)."""
    fb = watch.fallback
    if fb is None:
        kept = watch.kept_in_float32
        return f"; kept in float32 by the config: {', '.join(kept)}" if kept else ""
    tried = ", ".join(repr(n) for n in fb.names) or "no module"
    state = "disarmed after finding nothing" if fb.disarmed else "armed at each forward overflow"
    return f"; the float32 fallback kept {tried} in float32 ({state})"


class _Armed:
    """A hook of the armed pass. A copy of the model (``copy.deepcopy``, pickling) is watched by no fallback: its
    copies of these hooks do nothing."""

    __slots__ = ("hook",)

    def __init__(self, hook: Callable[..., Any]) -> None:
        self.hook = hook

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.hook(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        return _Armed, (_no_hook,)


def _no_hook(*args: Any, **kwargs: Any) -> None:
    return None


_eager_classes: dict[type, type] = {}


def _eager_class(cls: type) -> type:
    """``cls`` with a ``_call_impl`` that Dynamo runs eagerly (created once per class; ``torch._dynamo`` is
    imported only when a watch arms)."""
    eager = _eager_classes.get(cls)
    if eager is None:
        import torch._dynamo

        def _call_impl(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return cls._call_impl(self, *args, **kwargs)  # type: ignore[attr-defined]

        def __reduce_ex__(self: nn.Module, protocol: Any) -> Any:  # a copy is not armed: of the class's own
            own: Any = cls.__reduce_ex__
            if own is not object.__reduce_ex__:  # a kept class's (or one of the user's)
                return own(self, protocol)
            return _new_instance, (cls,), self.__getstate__()

        body = {"_call_impl": torch._dynamo.disable(_call_impl), "__reduce_ex__": __reduce_ex__}
        body["__module__"] = cls.__module__
        eager = _eager_classes[cls] = type(cls.__name__, (cls,), body)
        eager.__qualname__ = cls.__qualname__
    return eager


def _new_instance(cls: Any) -> Any:
    return cls.__new__(cls)


def _all_finite(value: Any) -> torch.Tensor:
    tensors = [t.detach() for t in floating_tensors(value) if t.numel()]
    if not tensors:
        return torch.ones((), dtype=torch.bool)
    device = tensors[0].device
    return torch.stack([torch.isfinite(t).all().to(device) for t in tensors]).all()
