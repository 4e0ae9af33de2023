"""Float32 master weights for half-precision parameters: ``dls.master_weights(optimizer)``.

A model whose parameters are float16 or bfloat16 cannot take updates smaller than half a unit in the last place
of its weights: ``w + lr * g`` rounds back to ``w``. ``master_weights`` wraps an optimizer built over such
parameters, keeps a float32 copy (the *master*) of each half parameter, steps the masters and writes them back,
rounded, into the model. The model computes in half precision; the updates accumulate in float32.

Which parameters get a master:

* float16 and bfloat16 parameters: a float32 master; after every step the model's parameter is the master
  rounded to the parameter's dtype (round to nearest even, torch's cast);
* float32 parameters, when ``fmt`` is given (e.g. ``"cbfloat16"``): a float32 master, and the model's float32
  parameter holds the master rounded to ``fmt``'s grid (``dls.formats``). This emulates storing the model in a
  format torch has no dtype for; it saves no memory (the parameter is still float32, and the master is a second
  float32 copy). Their gradients are float32 already: the master shares the parameter's gradient tensor;
* everything else (float32 parameters without ``fmt``, float64, complex) passes through: the inner optimizer
  steps it as before.

The wrapper is a ``torch.optim.Optimizer`` whose ``param_groups`` are the inner optimizer's own dicts, holding the
masters where the model has half parameters (so LR schedulers reach the inner optimizer), and whose ``state`` is
the inner optimizer's (keyed by the masters). A ``dls.GradScaler`` therefore unscales, checks and clips float32
master gradients: no precision is lost in a half-precision unscale, and an unscaled gradient larger than the half
format's range (possible only while the loss scale is below 1) is an ordinary float32 number, not an overflow.

Gradients. Backward (and DDP's all-reduce) produce half gradients on the model's parameters. They are copied,
exactly, into float32 master gradients (one pass; the buffer is kept while ``zero_grad(set_to_none=False)`` keeps
gradients, freed with them otherwise):

* with a ``dls.GradScaler``: before the scaler first reads the gradients of the iteration (``dls.scaler``'s
  protocol), so the unscale, the overflow check and ``max_gradient_norm`` clipping run on float32;
* otherwise (no scaler, or a disabled one), in ``step()``.

``torch.amp.GradScaler`` does not call that protocol and is not supported (it would unscale stale master
gradients).

After an explicit ``scaler.unscale_(optimizer)`` (or ``clip_gradients_and_return_isfinite``) user code looks at
the model's gradients, so the unscaled values are written back into them (rounded; float16 gradients beyond
±65504 saturate at ±65504 instead of becoming inf). ``step()`` then uses, per parameter, the exact float32 master
gradient if the model's gradient was left alone, or the model's gradient (as float32) if user code changed it in
place or replaced it: ``clip_grad_norm_(model.parameters(), c)`` clips what the step uses, at half precision
(unscaled values below the half format's smallest subnormal are zero there). ``max_gradient_norm`` /
``clip_gradients_and_return_isfinite`` clip the float32 masters instead and lose nothing.

The model's parameters changed from outside (``model.load_state_dict``, a DDP broadcast after wrapping) are
noticed by their version counter: where the new value is not the rounded master, the master is re-read from it.

Memory, per parameter: 2 bytes of half weights + 4 of master, and while gradients are alive 2 + 4 of gradients,
against autocast's 4 + 4: masters cost memory where parameters and optimizer state dominate, and save it where
activations do (the model runs wholly in half precision, so nothing is kept in float32 for autocast's sake).
``benchmarks/bench_master_weights.py`` measures both.

Skipped steps leave model parameters, masters and optimizer state bit-identical on every path: the host path
does not call ``step()``; fused optimizers get ``grad_scale``/``found_inf`` forwarded and leave the masters
alone, so the write-back rewrites the same values; after a sync-free masked step (``dls.device_step``) restored
masters and state, ``dls_state_restored`` writes the restored masters back. The three hooks are what the scaler
tells an optimizer wrapper (``dls.optimizers.HoldsGradients``).

A step whose masters do not fit is refused (a float16 weight at 65000 moved to 65992 is inf in float16): not
applied, parameters, masters and the optimizer's state bit-identical (``dls.refusal``: how on each path), counted
as skipped by a ``dls.GradScaler`` (``dls.optimizers.RefusesSteps``; the scale is not backed off: a weight's range
does not depend on it), with a warning naming the parameter and pointing to ``dls.keep_in_float32`` (at once where
read; else through ``dls.loss_scale.HostCopy``). It costs one more copy of the masters and the optimizer's state.
A closure (LBFGS) evaluates the points it tries with the masters written back as they are; the step's end decides.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from dls import formats, refusal
from dls.loss_scale import HostCopy
from dls.optimizer_state import check_optimizer_state

__all__ = ["MasterWeights", "master_weights"]

HALF_DTYPES = (torch.float16, torch.bfloat16)
STATE_KEY = "master_weights"  # the masters in state_dict(): {parameter index: float32 tensor}

# Optimizers that have been wrapped (their param_groups now hold masters): wrapping one again is an error.
FormatLike = str | formats.FloatFormat | torch.dtype | None  # what ``fmt`` accepts (as ``dls.emulate``)

_wrapped: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


@dataclasses.dataclass(eq=False)
class _Pair:
    """A model parameter and its float32 master."""

    param: torch.Tensor
    master: torch.Tensor
    on_grid: bool  # a float32 parameter kept on fmt's grid (shares its gradient with the master)
    version: int = -1  # the parameter's version after the last write-back
    # The model gradient the master gradient was last taken from or written to, and its version then.
    seen_grad: weakref.ReferenceType[torch.Tensor] | None = None
    seen_version: int = -1

    def grad_is_current(self) -> bool:
        g = self.param.grad
        if g is None:
            return self.master.grad is None
        return self.seen_grad is not None and self.seen_grad() is g and g._version == self.seen_version

    def remember_grad(self) -> None:
        g = self.param.grad
        self.seen_grad = None if g is None else weakref.ref(g)
        self.seen_version = -1 if g is None else g._version


def master_weights(optimizer: torch.optim.Optimizer, fmt: FormatLike = None) -> MasterWeights:
    """Wrap ``optimizer`` (built over a model's parameters) so that it steps float32 masters of its float16 and
    bfloat16 parameters and writes them back rounded (the module docstring of ``dls.master_weights`` states the
    whole contract).

    Use the result everywhere the optimizer was used: ``scaler.step(result)``, ``result.zero_grad()``, LR
    schedulers, checkpoints (``result.state_dict()`` holds the masters). Wrap before the first step.

    Args:
        optimizer: a ``torch.optim.Optimizer`` without state yet; each parameter in at most one group.
        fmt: the format float32 parameters are kept in (``"cbfloat16"``, any name of ``dls.formats``, a
            ``FloatFormat`` or a torch dtype, as ``dls.emulate`` takes); ``None`` (default): float32 parameters
            pass through untouched.

    Raises:
        ValueError: ``optimizer`` is not an optimizer, is already wrapped, has state, lists a parameter twice;
            ``fmt`` is not a format.
    """
    return MasterWeights(optimizer, fmt)


class MasterWeights(torch.optim.Optimizer):
    """An optimizer that steps float32 masters of the half-precision parameters of another one. Build it with
    ``dls.master_weights(optimizer, fmt)``.

    ``param_groups`` and ``state`` are the inner optimizer's; ``optimizer`` is the inner optimizer itself;
    ``master_of(param)`` the float32 tensor the inner optimizer steps for a model parameter.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, fmt: FormatLike = None) -> None:
        if isinstance(optimizer, MasterWeights) or (
            isinstance(optimizer, torch.optim.Optimizer) and optimizer in _wrapped
        ):
            raise ValueError("optimizer is already wrapped by dls.master_weights; wrap the original optimizer once")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"optimizer must be a torch.optim.Optimizer; got {type(optimizer).__name__}")
        if any(optimizer.state.values()) and not _only_initial_state(optimizer):
            raise ValueError(
                "optimizer already has state (it has stepped): wrap it with dls.master_weights before its first "
                "step, then load checkpoints into the wrapper"
            )
        # State an optimizer makes when it is built (Adagrad's sum and step 0) moves to the masters, as float32.
        initial = optimizer.state_dict() if any(optimizer.state.values()) else None
        self._fmt = _parse_fmt(fmt)
        groups = optimizer.param_groups
        _check_unique([p for g in groups for p in g["params"]])
        # torch.optim.Optimizer.__init__ would rebuild the groups from parameters: set up what it sets instead.
        self.defaults = optimizer.defaults
        for hooks in _HOOK_DICTS:
            setattr(self, hooks, OrderedDict())
        self._patch_step_function()
        self._warned_capturable_if_run_uncaptured = True
        self._optimizer = optimizer
        self._pairs: list[_Pair] = []
        self._master_of: dict[int, torch.Tensor] = {}
        self._copies: refusal.KeptCopies | None = None  # the buffers a step's state is kept in until it is known to fit
        self._checks: refusal.FitCheck | None = None  # the masters a step checks, by what their parameters hold
        self._refused: torch.Tensor | None = None  # whether the last step was refused (0-dim bool, on the device)
        self._refusal_read: bool | None = None  # that, where the step read it
        # The last step's [refused, which master, its largest |value|] until a scaler says whether its gradients
        # were clean (dls_step_refused); then on their way to the host, to warn of.
        self._scaled = False  # a scaler collected this iteration's gradients: it asks dls_step_refused after step()
        self._on_device = False  # the next step reads nothing back: dls_next_step
        self._info: torch.Tensor | None = None
        self._unwarned: deque[HostCopy] = deque()
        for group in groups:
            # In place: optimizers that keep a reference to a group's list (LBFGS) see the masters too.
            group["params"][:] = self._make_masters(group["params"])
        # torch's fused optimizers unscale and skip by themselves when handed grad_scale/found_inf: so do we.
        self._step_supports_amp_scaling = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        if initial is not None:
            optimizer.state.clear()
            optimizer.load_state_dict(initial)  # keyed by position: onto the masters, cast to their dtype
        _wrapped.add(optimizer)
        self._write_back()

    # ------------------------------------------------------------------ queries
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's groups (they hold the masters): changes made here reach it."""
        return self._optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._optimizer.param_groups = value

    @property
    def state(self) -> Any:
        """The inner optimizer's state, keyed by the masters (and the parameters passing through)."""
        return self._optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self._optimizer.state = value

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped optimizer (its ``param_groups`` hold the masters)."""
        return self._optimizer

    @property
    def fmt(self) -> formats.FloatFormat | None:
        """The format float32 parameters are kept in, or ``None``."""
        return self._fmt

    def master_of(self, param: torch.Tensor) -> torch.Tensor:
        """The tensor the inner optimizer steps for the model parameter ``param``: its float32 master, or
        ``param`` itself when it passes through. ``ValueError`` for a tensor this optimizer does not hold.

        Args:
            param: a parameter of the wrapped optimizer's param groups.
        """
        self._reload_changed_params()
        master = self._master_of.get(id(param))
        if master is not None:
            return master
        if any(p is param for g in self.param_groups for p in g["params"]):
            return param
        raise ValueError("param is not a parameter of this optimizer")

    # ------------------------------------------------------------------ dls.optimizers.HoldsGradients: the scaler calls
    def dls_collect_gradients(self) -> None:
        """Fill the masters' gradients from the model's (called by ``dls.GradScaler`` before it reads them)."""
        self._scaled = True
        self._reload_changed_params()
        self._take_gradients(self._pairs)

    def dls_gradients_unscaled(self) -> None:
        """Write the unscaled (and maybe clipped) master gradients into the model's gradients, rounded, so user
        code sees them where it looks (called by ``dls.GradScaler`` after ``unscale_``)."""
        pairs = [pr for pr in self._pairs if not pr.on_grid and pr.master.grad is not None]
        dense_params, dense_grads = [], []
        with torch.no_grad():
            for pr in pairs:
                g, mg = pr.param.grad, pr.master.grad
                assert mg is not None
                if g is None or g.is_sparse or mg.is_sparse:
                    pr.param.grad = mg.to(pr.param.dtype)
                else:
                    dense_params.append(g)
                    dense_grads.append(mg)
            if dense_params:
                torch._foreach_copy_(dense_params, dense_grads)
                fp16 = [g for g in dense_params if g.dtype == torch.float16]
                if fp16:  # unscaled by a scale below 1, a float32 gradient can exceed float16's range: saturate
                    fmax = torch.finfo(torch.float16).max
                    torch._foreach_clamp_min_(fp16, -fmax)
                    torch._foreach_clamp_max_(fp16, fmax)
        for pr in pairs:
            pr.remember_grad()

    def dls_state_restored(self) -> None:
        """Write the masters back after a sync-free step restored them (called by ``dls.GradScaler`` after
        the masked step of ``dls.device_step``)."""
        self._write_back()

    # ------------------------------------------------------------------ optimizer interface
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step the masters with the inner optimizer, then write them back into the model's parameters.

        Master gradients not current with the model's gradients (not collected by a scaler this iteration, or
        changed by user code since ``unscale_``) are taken from the model's gradients first. ``grad_scale`` and
        ``found_inf`` set by a scaler are handed to the inner optimizer. A ``closure`` is called with the current
        (written back) parameters, and the gradients it produces are taken over; its loss is returned.

        Args:
            closure: recomputes the loss, as for any torch optimizer.

        Returns:
            The closure's loss, or ``None`` without a closure.
        """
        if self._info is not None:  # an earlier step no scaler asked about
            self._publish(None)
        self._reload_changed_params()
        self._take_gradients([pr for pr in self._pairs if not pr.grad_is_current()])
        wrapped_closure = None
        if closure is not None:

            def wrapped_closure() -> Any:
                self._write_back()  # optimizers that evaluate several points (LBFGS) move the masters first
                with torch.enable_grad():
                    loss = closure()
                self._take_gradients(self._pairs)
                return loss

        forwarded = {name: getattr(self, name) for name in ("grad_scale", "found_inf") if hasattr(self, name)}
        for name, value in forwarded.items():
            setattr(self._optimizer, name, value)
        on_device, self._on_device = self._on_device, False
        before = self._keep_state()
        try:
            result = self._optimizer.step() if wrapped_closure is None else self._optimizer.step(wrapped_closure)
        finally:
            for name in forwarded:
                delattr(self._optimizer, name)
        self._write_back_unless_it_does_not_fit(before, on_device)
        if not self._scaled:  # no scaler will say more of this step's gradients: warn now
            self._publish(None)
        return result

    def dls_step_refused(self, found_inf: torch.Tensor | None) -> torch.Tensor | None:
        """Whether the last ``step()`` was refused because a master would not fit its parameter's format though
        the gradients were clean (``found_inf``, the scaler's flag, zero; ``None``: no flag), a 0-dim bool tensor on
        the device, not read back; ``None`` before the first step (``dls.optimizers.RefusesSteps``: the scaler
        counts a refused step as skipped). A sync-free step runs on overflowing gradients and is put back for them:
        that is no refusal, and no warning.

        Args:
            found_inf: the scaler's overflow flag of this step's gradients, or ``None`` (a disabled scaler's step).
        """
        self._scaled = False
        self._publish(found_inf)
        if self._refused is None or found_inf is None:
            return self._refused
        return self._refused & (found_inf.to(self._refused.device) == 0)

    def dls_refusal_read(self) -> bool | None:
        """Whether the last step read on the host that it was refused (``dls.optimizers.RefusesSteps``)."""
        return self._refusal_read

    def dls_may_refuse(self) -> torch.Tensor | None:
        """Some master within a factor 2 of its parameter's limit now (``dls.refusal.FitCheck.near_limit``, one
        read pass; ``None`` before the first step, decided on the host): ``dls.optimizers.RefusesSteps``."""
        return None if self._refused is None else self._fit_check().near_limit()

    def _fit_check(self) -> refusal.FitCheck:
        if self._checks is None or self._checks.pairs != len(self._pairs):
            self._checks = refusal.FitCheck.of(self._pairs, self._fmt)
        return self._checks

    def dls_next_step(self) -> None:
        """The scaler's next ``step()`` reads nothing back (the fused path, ``sync_free``): a refused step is put
        back on the device (``dls.refusal``)."""
        self._on_device = True

    def _publish(self, found_inf: torch.Tensor | None) -> None:
        """Send the last step's refusal (where the gradients were clean) to the host, and warn of those arrived."""
        info, self._info = self._info, None
        if info is not None:
            if found_inf is not None:
                info = info * (found_inf.to(info.device) == 0)
            self._unwarned.append(HostCopy(info))
            while len(self._unwarned) > 8:  # the host is far behind the device: keep the latest
                self._unwarned.popleft()
        self._warn_refused()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of the masters, of the parameters passing through and of the model's parameters
        (``None``, or zero with ``set_to_none=False``).

        Args:
            set_to_none: set the gradients to ``None`` rather than zero them.
        """
        self._optimizer.zero_grad(set_to_none)
        model_grads = [pr.param.grad for pr in self._pairs if pr.param.grad is not None]
        if set_to_none:
            for pr in self._pairs:
                pr.param.grad = None
        elif model_grads:
            with torch.no_grad():
                for g in model_grads:
                    g.detach_().requires_grad_(False)
                torch._foreach_zero_([g for g in model_grads if not g.is_sparse])
                for g in model_grads:
                    if g.is_sparse:
                        g.zero_()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of model parameters: its half parameters get masters, the inner optimizer the group.
        ``ValueError`` for a parameter this optimizer already holds (nothing changes).

        Args:
            param_group: a param group as for ``torch.optim.Optimizer.add_param_group``, of model parameters.
        """
        if not isinstance(param_group, dict):
            raise ValueError(f"param_group must be a dict; got {type(param_group).__name__}")
        if "params" not in param_group:
            raise ValueError("param_group must have a 'params' entry")
        raw = param_group["params"]
        if isinstance(raw, set):
            raise ValueError("param_group['params'] must be an ordered collection (a list), not a set")
        items = [raw] if isinstance(raw, torch.Tensor) else list(raw)
        tensors = [item[1] if isinstance(item, tuple) else item for item in items]
        held = {id(p) for g in self.param_groups for p in g["params"]} | set(self._master_of)
        if any(not isinstance(p, torch.Tensor) for p in tensors):
            raise ValueError("param_group['params'] must hold tensors (or (name, tensor) pairs)")
        if any(id(p) in held for p in tensors):
            raise ValueError("param_group['params'] holds a parameter that is already in this optimizer")
        _check_unique(tensors, "param_group['params']")
        before = (len(self._pairs), dict(self._master_of))
        masters = self._make_masters(tensors)
        group = dict(param_group)
        group["params"] = [(i[0], m) if isinstance(i, tuple) else m for i, m in zip(items, masters)]
        try:
            self._optimizer.add_param_group(group)
        except Exception:
            del self._pairs[before[0] :]
            self._master_of = before[1]
            raise
        self._write_back(self._pairs[before[0] :])

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict, plus ``"master_weights"``: ``{parameter index: float32 master}``
        (indices as in ``param_groups``; references to the live tensors, as torch's state dicts hold)."""
        self._warn_refused()
        self._reload_changed_params()
        state = self._optimizer.state_dict()
        master_ids = {id(pr.master) for pr in self._pairs}
        state[STATE_KEY] = {i: p for i, p in enumerate(self._flat_params()) if id(p) in master_ids}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of ``state_dict()``'s form: optimizer state and masters, then the model's parameters
        are the rounded masters (resuming is bit-identical). A state dict without masters (an ordinary
        optimizer's) loads the state and takes the masters from the model's current parameters.

        Each saved master is first cast to float32 (the master's dtype), then checked: finite, and still finite
        once rounded to what the model's parameter holds (its half dtype, or ``fmt``'s grid), so a master of 1e5
        for a float16 parameter, or a float64 master beyond float32's range, is refused rather than written into
        the model as inf. ``ValueError`` naming ``state_dict['master_weights'][i]``, with nothing changed, when
        the masters do not match this optimizer's parameters, are not real tensors, or fail these checks. The inner
        optimizer's state is checked first too (``dls.optimizer_state.check_optimizer_state``, against the masters):
        a NaN ``exp_avg``, a negative ``exp_avg_sq``, a tensor of another shape or an integer dtype is a
        ``ValueError`` naming ``state_dict.state[i].key``, with nothing changed.

        Args:
            state_dict: what ``state_dict()`` returned (or an ordinary optimizer's state dict).
        """
        if not isinstance(state_dict, dict):
            raise ValueError(f"state_dict must be a dict; got {type(state_dict).__name__}")
        saved = state_dict.get(STATE_KEY)
        master_ids = {id(pr.master): pr for pr in self._pairs}
        masters = {i: master_ids[id(p)] for i, p in enumerate(self._flat_params()) if id(p) in master_ids}
        loaded: dict[int, torch.Tensor] = {}  # the saved masters as float32, checked
        if saved is not None:
            if not isinstance(saved, dict) or set(saved) != set(masters):
                have = sorted(saved, key=repr) if isinstance(saved, dict) else f"none (it is a {type(saved).__name__})"
                raise ValueError(
                    f"state_dict['{STATE_KEY}'] holds masters for parameters {have}; this optimizer keeps masters "
                    f"for parameters {sorted(masters)}"
                )
            loaded = {
                i: self._checked_master(saved[i], pr, f"state_dict['{STATE_KEY}'][{i}]") for i, pr in masters.items()
            }
        inner = {k: v for k, v in state_dict.items() if k != STATE_KEY}
        # What the inner optimizer would load, judged against its parameters (the masters): finite, second moments
        # non-negative, shapes and dtypes as the masters' (torch's load_state_dict takes a NaN exp_avg).
        check_optimizer_state(self._optimizer, inner, name="state_dict")
        self._optimizer.load_state_dict(inner)
        with torch.no_grad():
            for i, pr in masters.items():
                pr.master.copy_(loaded[i] if saved is not None else pr.param)
        self._write_back()

    def _checked_master(self, value: Any, pair: _Pair, field: str) -> torch.Tensor:
        """``value`` as the float32 master of ``pair``; ``ValueError`` naming ``field`` unless it is a real tensor of
        the master's shape that is finite in float32 and once rounded to what the model's parameter holds. A
        non-finite master would be written into the model at once and stay there: the scaler's promise (no step
        ever writes inf/NaN) covers the state it resumes from too."""
        shape = tuple(pair.master.shape)
        if not isinstance(value, torch.Tensor) or value.shape != pair.master.shape:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"{field} must be a tensor of shape {shape}; got {got}")
        if value.is_complex() or value.layout != torch.strided or value.is_quantized or value.is_meta:
            where = " on the meta device" if value.is_meta else ""
            raise ValueError(f"{field} must be a dense real tensor; got a {value.layout} {value.dtype} tensor{where}")
        value = value.detach()
        cast = value.to(pair.master.device, torch.float32)
        held = self._fmt.quantize(cast) if pair.on_grid and self._fmt else cast.to(pair.param.dtype)
        if not bool(torch.isfinite(held).all()):  # an inf of the cast stays inf when rounded
            if not bool(torch.isfinite(_real_view(value)).all()):
                raise ValueError(f"{field} holds inf or NaN; master weights must be finite")
            kind = self._fmt.name if pair.on_grid and self._fmt else str(pair.param.dtype).removeprefix("torch.")
            kind = kind if bool(torch.isfinite(cast).all()) else "float32"
            largest = float(_real_view(value).abs().max())
            raise ValueError(
                f"{field} holds values beyond {kind}'s range (largest |value| {largest:.6g}): loaded, the model's "
                "parameter would be inf; master weights must be finite in the parameter's format"
            )
        return cast

    def __repr__(self) -> str:
        counts: dict[str, int] = {}
        for pr in self._pairs:
            key = f"float32 on the {self._fmt.name} grid" if pr.on_grid and self._fmt else str(pr.param.dtype)[6:]
            counts[key] = counts.get(key, 0) + 1
        kept = ", ".join(f"{n} {k}" for k, n in counts.items()) or "none"
        through = sum(len(g["params"]) for g in self.param_groups) - len(self._pairs)
        inner = "\n".join("    " + line for line in repr(self._optimizer).splitlines())
        return f"MasterWeights(float32 masters for: {kept}; passing through: {through};\n{inner}\n)"

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()  # torch's keeps only defaults, state and param_groups
        # Weak references do not pickle; without them every gradient counts as new (taken over at the next step).
        state["_pairs"] = [dataclasses.replace(pr, seen_grad=None) for pr in self._pairs]
        del state["_master_of"]  # keyed by id: rebuilt for the copies
        state["_copies"] = state["_checks"] = None  # rebuilt at the next step
        state["_unwarned"], state["_info"], state["_scaled"], state["_on_device"] = deque(), None, False, False
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._master_of = {id(pr.param): pr.master for pr in self._pairs}
        self._patch_step_function()
        _wrapped.add(self._optimizer)

    # ------------------------------------------------------------------ a step that does not fit is refused
    def _keep_state(self) -> refusal.StateBefore:
        """What a step may change, kept (``dls.refusal.keep_state``): the groups' tensors (masters and parameters
        passing through) and their state."""
        before, self._copies = refusal.keep_state(self._optimizer, self._flat_params(), self._copies)
        return before

    def _write_back_unless_it_does_not_fit(self, before: refusal.StateBefore, on_device: bool) -> None:
        """After the inner step: write the masters back, and where one is inf or NaN once rounded to what its
        parameter holds (its half dtype, or ``fmt``), put everything the step changed back, exactly, and write back
        again. The check is the gradients' one (``dls.kernels.check_nonfinite``: torch's fused AMP check) over the
        parameters as written. By default (a master near its limit: ``dls_may_refuse``) the flag is read and the
        kept values copied back only where refused. ``on_device`` (the fused and sync-free paths; the default path
        with no master near its limit): put back on the device, unread, when the step changed only tensors it had
        before (every step after a parameter's first); else the flag is read once and put back on the host."""
        self._write_back()
        checks = self._fit_check()
        refused = checks.nonfinite_params()
        self._remember_versions()  # the check writes x * 1 back: the parameters are still the rounded masters
        self._refused, self._info, self._refusal_read = refused, None, None
        if refused is None:
            return
        state = self._optimizer.state
        if not on_device or before.changed_on_host(state):
            self._refusal_read = bool(refused)
            if self._refusal_read:  # read: the host path, a parameter's first step, state the device cannot put back
                self._warn(*checks.first_unfit(read=True))
                assert self._copies is not None
                before.put_back(state, self._copies)
                self._write_back()
            return
        self._info = checks.first_unfit(refused=refused)  # on its way to the host with dls_step_refused
        assert self._copies is not None
        with torch.no_grad():
            self._copies.select(refused)
        self._write_back()  # the rounded masters again: as before the step where it was refused

    def _remember_versions(self, pairs: list[_Pair] | None = None) -> None:
        """The parameters' versions now: a later change of one from outside is told by its version."""
        for pr in self._pairs if pairs is None else pairs:
            pr.version = pr.param._version

    def _warn_refused(self) -> None:
        """Warn of each refused step whose flag has reached the host (on the CPU at once; on CUDA once its copy has
        arrived: no synchronisation)."""
        while self._unwarned:
            values = self._unwarned[0].read()
            if values is None:
                return
            self._unwarned.popleft()
            if values[0]:
                self._warn(int(values[1]), values[2])

    def _warn(self, position: int, largest: float) -> None:
        assert self._checks is not None
        text = refusal.refusal_warning(self._checks, self.param_groups, self._fmt, position, largest)
        warnings.warn(text, stacklevel=3)

    # ------------------------------------------------------------------ implementation
    def _make_masters(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors the inner optimizer steps for ``params``: new float32 masters, or the parameters themselves
        (records the pairs; the caller writes back)."""
        out = []
        for p in params:
            on_grid = self._fmt is not None and p.dtype == torch.float32
            if p.dtype not in HALF_DTYPES and not on_grid:
                out.append(p)
                continue
            master = torch.nn.Parameter(p.detach().to(torch.float32, copy=True), requires_grad=p.requires_grad)
            self._pairs.append(_Pair(p, master, on_grid))
            self._master_of[id(p)] = master
            out.append(master)
        return out

    def _flat_params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _take_gradients(self, pairs: Iterable[_Pair]) -> None:
        """Master gradients := the model's gradients, as float32 (one exact copy; the buffer is reused)."""
        dst, src, done = [], [], []
        for pr in pairs:
            g, master = pr.param.grad, pr.master
            if pr.on_grid or g is None:
                master.grad = g  # float32 already: share the tensor
            elif g.is_sparse or master.grad is None or master.grad.is_sparse or master.grad.shape != g.shape:
                master.grad = g.to(torch.float32)  # a new buffer (first step, sparse, or after set_to_none)
            else:
                dst.append(master.grad)
                src.append(g)
            done.append(pr)
        if dst:
            with torch.no_grad():
                torch._foreach_copy_(dst, src)
        for pr in done:
            pr.remember_grad()

    def _write_back(self, pairs: list[_Pair] | None = None) -> None:
        """Model parameters := their masters, rounded to the parameter's dtype or to ``fmt``'s grid."""
        pairs = self._pairs if pairs is None else pairs
        with torch.no_grad():
            half = [pr for pr in pairs if not pr.on_grid]
            if half:
                torch._foreach_copy_([pr.param for pr in half], [pr.master for pr in half])
            for pr in pairs:
                if pr.on_grid:
                    assert self._fmt is not None
                    pr.param.copy_(self._fmt.quantize(pr.master))
        self._remember_versions(pairs)

    def _reload_changed_params(self) -> None:
        """Masters := model parameters that were changed from outside (not the rounded master any more)."""
        changed = [pr for pr in self._pairs if pr.param._version != pr.version]
        if not changed:
            return
        with torch.no_grad():
            for pr in changed:
                rounded = self._fmt.quantize(pr.master) if pr.on_grid and self._fmt else pr.master.to(pr.param.dtype)
                if not torch.equal(rounded, pr.param):
                    pr.master.copy_(pr.param)
        self._write_back(changed)


_HOOK_DICTS = (
    "_optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)


def _parse_fmt(fmt: Any) -> formats.FloatFormat | None:
    if fmt is None:
        return None
    if isinstance(fmt, (str, formats.FloatFormat, torch.dtype)):
        try:
            return formats.get(fmt)
        except ValueError:
            pass
    raise ValueError(
        f"fmt must be None, a dls.formats.FloatFormat, a torch half dtype or one of "
        f"{', '.join(repr(n) for n in formats.names())}; got {fmt!r}"
    )


def _only_initial_state(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s state is what it made when built, before any step: every entry has a ``step`` of 0
    (Adagrad makes its ``sum`` and ``step`` in its constructor); state without a step count has come from a step."""
    for entry in optimizer.state.values():
        step = entry.get("step") if isinstance(entry, dict) else None
        if step is None or (isinstance(step, torch.Tensor) and (step.is_meta or step.numel() != 1)):
            return False
        if float(step) != 0:
            return False
    return True


def _real_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` in a dtype ``torch.isfinite`` and ``abs`` take: float8 (which they do not) as float32."""
    return t.float() if t.is_floating_point() and t.element_size() == 1 else t


def _check_unique(params: list[torch.Tensor], name: str = "optimizer") -> None:
    seen: set[int] = set()
    for p in params:
        if id(p) in seen:
            raise ValueError(f"{name} lists a parameter more than once (shape {tuple(p.shape)}, {p.dtype})")
        seen.add(id(p))


if TYPE_CHECKING:  # what the scaler relies on, checked by mypy
    from dls.optimizers import HoldsGradients

    _HOLDS_GRADIENTS: type[HoldsGradients] = MasterWeights
