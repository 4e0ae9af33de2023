"""``dls.fp8.emulate_recipe``: make every ``nn.Linear`` of a model compute its GEMMs with FP8 operands, exactly.

``handle = dls.fp8.emulate_recipe(model, recipe)`` replaces the ``forward`` of each selected ``nn.Linear`` (an
instance attribute: the class, parameters, state-dict keys, hooks and the optimizer are untouched) by a custom
``autograd.Function`` that runs the layer's three GEMMs on operands cast to FP8 per the recipe and cast back
(``payload / scale``), with float32 products and accumulation:

* forward: ``output = input_fp8 @ weight_fp8.T`` (+ bias, in high precision);
* backward: ``grad_input = grad_output_fp8 @ weight_fp8`` and ``grad_weight = grad_output_fp8.T @ input_fp8``;
  the bias gradient is the sum of the unquantized output gradient (as torchao and TransformerEngine do).

This is the computation of torchao's ``Float8Linear`` with ``emulate=True`` (tested equal for
[`CurrentScaling`][dls.fp8.CurrentScaling]), on any device. Real FP8 GEMMs apply the two scales to the float32
accumulator instead of to each operand, and accumulate in a different order: results differ from hardware by
float32 rounding, never by FP8 rounding. Inputs of other dtypes (bfloat16 models, autocast) are computed in
float32 the same way; the output has the dtype ``F.linear`` would give (the autocast dtype under autocast).

A layer kept in float32 (``dls.keep_in_float32``) computes a plain float32 ``F.linear`` instead: no FP8 casts.

**Loss scaling.** The output gradient that reaches a layer carries the loss scale of a ``dls.GradScaler``.
Per-tensor recipes divide it out again when they scale the gradient to E5M2's range, so the loss scale matters
for FP8 only where the FP8 scale does not follow the gradient: [`StaticScaling`][dls.fp8.StaticScaling] (the loss scale
is the only scale the gradients get) and [`DelayedScaling`][dls.fp8.DelayedScaling] (whose gradient scale lags by one
step: a gradient that grew, or a loss scale that doubled, exceeds E5M2's max). What happens then is the
recipe's ``saturate_gradients``: ``True`` clamps to ±max, hiding the overflow from the scaler (the step is
taken with clipped gradients); ``False`` produces inf/NaN, which the scaler detects, skipping the step and
lowering the loss scale. Float32 values the cast flushes to zero are counted in ``handle.stats``.

**Distributed.** With ``torch.distributed`` initialised, delayed scaling all-reduces every recorded amax with
MAX over ``process_group`` (default: the world), so all ranks keep identical histories and scales (the
reduction is launched asynchronously and waited for at that role's next cast). Every rank must run the same
casts in the same order, as DDP does. Current, static and MX scaling need no communication.

**torch.compile.** Everything above is device tensor ops with in-place state updates, which Dynamo traces:
a model under delayed scaling with statistics compiles to one graph (``fullgraph=True``, tested with the
``aot_eager`` backend) with results identical to eager. The distributed amax reduction is not covered by
that test.

**No host synchronisation** in forward or backward: scales, histories and statistics are device tensors, read
only when you ask (``handle.stats``, ``handle.state_dict()``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from dls import distributed
from dls.formats import FloatFormat
from dls.fp8 import scaling
from dls.fp8.recipes import (
    MXFP8,
    ROLES,
    CurrentScaling,
    DelayedScaling,
    Recipe,
    StaticScaling,
    recipe_from_dict,
)
from dls.handles import Removable
from dls.keep import in_kept_call

__all__ = ["Fp8Handle", "Fp8Stats", "emulate_recipe"]

_RECIPE_TYPES = (CurrentScaling, DelayedScaling, MXFP8, StaticScaling)


class _Role:
    """One (module, role): its format, delayed-scaling state and statistics (all device tensors)."""

    def __init__(self, recipe: Recipe, role: str, device: torch.device, track_stats: bool, group: Any) -> None:
        self.fmt: FloatFormat = scaling.fp8_format(recipe.dtype_name(role))
        self.saturate = role != "grad_output" or recipe.saturate_gradients
        self.group = group
        self.track_stats = track_stats
        self.history: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None
        self._pending: distributed.Agreement | None = None
        if isinstance(recipe, DelayedScaling):
            self.history = torch.zeros(recipe.amax_history_len, dtype=torch.float32, device=device)
            self.scale = torch.ones((), dtype=torch.float32, device=device)
            self.margin = recipe.margin
            self.most_recent = recipe.amax_compute_algo == "most_recent"
        elif isinstance(recipe, StaticScaling):
            self.scale = torch.tensor(recipe.scale, dtype=torch.float32, device=device)
        # Statistics, updated in place (no Python state changes, so that Dynamo traces them): amax and scale
        # of the latest cast; casts, then the raw counts of scaling.cast_count_sums, summed over casts.
        self.last = torch.full((2,), math.nan, dtype=torch.float32, device=device)
        self.count_sums = torch.zeros(4, dtype=torch.float64, device=device)

    # ------------------------------------------------------------------ delayed scaling
    def delayed_scale(self) -> torch.Tensor:
        """The scale of the next cast (after folding in an amax whose reduction was in flight)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._commit(pending.wait())
        assert self.scale is not None
        return self.scale

    def record(self, amax: torch.Tensor) -> None:
        """Record a cast's amax: now, or once its all-reduce across ranks has completed (on a private copy:
        the collective writes into it while the cast's own amax may still be read)."""
        amax = amax.reshape(1).to(torch.float32, copy=True)
        agreement = distributed.start_agreement(amax, self.group)
        if agreement is None:
            self._commit(amax)
        else:
            self._pending = agreement

    def _commit(self, amax: torch.Tensor) -> None:
        assert self.history is not None and self.scale is not None
        h = self.history
        h.copy_(torch.cat([amax.reshape(1), h[:-1]]))  # newest first
        reduced = h[0] if self.most_recent else h.amax()
        fresh = scaling._scale_from_amax(reduced, self.fmt, self.margin, False, 0.0)
        keep = ~torch.isfinite(reduced) | (reduced <= 0)
        self.scale.copy_(torch.where(keep, self.scale, fresh))

    def settle(self) -> None:
        """Fold in any amax still being reduced (before reading or writing the state)."""
        if self._pending is not None:
            self.delayed_scale()

    def clear_pending(self) -> None:
        if self._pending is not None:
            self._pending.wait()
            self._pending = None

    # ------------------------------------------------------------------ statistics
    def note(self, amax: torch.Tensor, scale: torch.Tensor, count_sums: torch.Tensor | None) -> None:
        """Record a cast's statistics (device ops only)."""
        assert count_sums is not None
        self.last.copy_(torch.stack([amax.reshape(()), scale.reshape(())]))
        self.count_sums.add_(torch.cat([count_sums.new_ones(1), count_sums]))


class _TensorCaster:
    """Per-tensor recipes (current ``"tensor"``, delayed, static): each operand cast once, with one scale; the
    forward casts of input and weight are reused by the backward GEMMs."""

    def __init__(self, recipe: Recipe, roles: dict[str, _Role]) -> None:
        self.recipe = recipe
        self.roles = roles

    def cast(self, role_name: str, t: torch.Tensor, record: bool) -> torch.Tensor:
        role = self.roles[role_name]
        recipe = self.recipe
        amax: torch.Tensor | None = None
        if isinstance(recipe, CurrentScaling):
            amax = t.abs().amax()
            scale = scaling._scale_from_amax(amax, role.fmt, 0, recipe.power_2_scales, recipe.amax_epsilon)
        elif isinstance(recipe, DelayedScaling):
            scale = role.delayed_scale().clone()  # the history update below must not change it
            amax = t.abs().amax()
            if record:
                role.record(amax)
        else:
            assert role.scale is not None
            scale = role.scale
        dq, counts = scaling.cast_scaled(t, scale, role.fmt, role.saturate, role.track_stats)
        if role.track_stats:
            role.note(t.abs().amax() if amax is None else amax, scale, counts)
        return dq

    def forward(self, x: torch.Tensor, w: torch.Tensor, record: bool) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        xq = self.cast("input", x, record)
        wq = self.cast("weight", w, record)
        return xq, wq, (xq, wq)

    def backward(
        self, gy: torch.Tensor, saved: tuple[torch.Tensor, ...], need_x: bool, need_w: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        xq, wq = saved
        gq = self.cast("grad_output", gy, True)
        return (torch.mm(gq, wq) if need_x else None), (torch.mm(gq.t(), xq) if need_w else None)


class _AxisCaster:
    """Per-row and MX recipes: scales along each GEMM's reduction axis, so every operand is cast per GEMM from
    its high-precision values (the forward saves input and weight unquantized)."""

    def __init__(self, recipe: Recipe, roles: dict[str, _Role]) -> None:
        self.recipe = recipe
        self.roles = roles

    def cast(self, role_name: str, t: torch.Tensor, dim: int) -> torch.Tensor:
        role = self.roles[role_name]
        recipe = self.recipe
        if isinstance(recipe, CurrentScaling):
            amax = t.abs().amax(dim, keepdim=True)
            scale = scaling._scale_from_amax(amax, role.fmt, 0, recipe.power_2_scales, recipe.amax_epsilon)
            dq, counts = scaling.cast_scaled(t, scale, role.fmt, role.saturate, role.track_stats)
            if role.track_stats:
                role.note(amax.amax(), scale.amin(), counts)
            return dq
        assert isinstance(recipe, MXFP8)
        n = t.shape[dim]
        pad = -n % scaling.MX_BLOCK_SIZE
        if pad:  # zeros change neither a block's amax nor the GEMM
            t = torch.cat([t, t.new_zeros((*t.shape[:dim], pad, *t.shape[dim + 1 :]))], dim)
        cast = scaling.mx_cast(t, dim, role.fmt, recipe.scale_mode, role.saturate, role.track_stats)
        dq = cast.payload.mul_(cast.scale).flatten(dim, dim + 1)
        if role.track_stats:
            role.note(cast.amax.amax(), cast.scale.amax().reciprocal(), cast.count_sums)
        return dq.narrow(dim, 0, n) if pad else dq

    def forward(self, x: torch.Tensor, w: torch.Tensor, record: bool) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        return self.cast("input", x, 1), self.cast("weight", w, 1), (x, w)

    def backward(
        self, gy: torch.Tensor, saved: tuple[torch.Tensor, ...], need_x: bool, need_w: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        x, w = saved
        grad_x = grad_w = None
        if need_x:
            grad_x = torch.mm(self.cast("grad_output", gy, 1), self.cast("weight", w, 0))
        if need_w:
            grad_w = torch.mm(self.cast("grad_output", gy, 0).t(), self.cast("input", x, 0))
        return grad_x, grad_w


_Caster = _TensorCaster | _AxisCaster


@contextlib.contextmanager
def _no_autocast(device_type: str) -> Iterator[None]:
    if torch.is_autocast_enabled(device_type):
        with torch.autocast(device_type, enabled=False):
            yield
    else:
        yield


class _Fp8Linear(torch.autograd.Function):
    """``x @ weight.T`` with the operands of all three GEMMs cast per the module's caster."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, caster: _Caster, record: bool) -> torch.Tensor:
        out_dtype = x.dtype
        if torch.is_autocast_enabled(x.device.type):
            out_dtype = torch.get_autocast_dtype(x.device.type)
        with _no_autocast(x.device.type):
            x2 = x.reshape(-1, x.shape[-1]).to(torch.float32)
            xq, wq, saved = caster.forward(x2, weight.to(torch.float32), record)
            out = torch.mm(xq, wq.t())
        ctx.save_for_backward(*saved)
        ctx.caster = caster
        ctx.x_meta = (x.shape, x.dtype, weight.dtype)
        return out.reshape(*x.shape[:-1], out.shape[-1]).to(out_dtype)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad = grads[0]
        x_shape, x_dtype, w_dtype = ctx.x_meta
        with _no_autocast(grad.device.type):
            gy = grad.reshape(-1, grad.shape[-1]).to(torch.float32)
            need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
            grad_x, grad_w = ctx.caster.backward(gy, ctx.saved_tensors, need_x, need_w)
        if grad_x is not None:
            grad_x = grad_x.reshape(x_shape).to(x_dtype)
        if grad_w is not None:
            grad_w = grad_w.to(w_dtype)
        return grad_x, grad_w, None, None


def _make_forward(module: nn.Linear, caster: _Caster) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(input: torch.Tensor) -> torch.Tensor:
        if in_kept_call():  # kept in float32 (dls.keep_in_float32): a plain float32 linear, no FP8 casts
            return nn.Linear.forward(module, input)
        out: torch.Tensor = _Fp8Linear.apply(input, module.weight, caster, torch.is_grad_enabled())
        if module.bias is not None:
            out = out + module.bias.to(out.dtype)
        return out

    forward._dls_fp8 = True  # type: ignore[attr-defined]
    return forward


class Fp8Stats:
    """What the FP8 casts did, per module and role (``"input"``, ``"weight"``, ``"grad_output"``).

    ``as_dict()`` (one device sync) returns ``{module name: {role: entry}}`` with, per entry: ``casts`` (how
    many casts), ``amax`` (largest magnitude of the latest cast's unscaled values), ``scale`` (the multiplier
    applied before that cast; for per-row and MX recipes the smallest one, i.e. that of the largest values),
    ``saturated_fraction`` (values whose scaled magnitude rounded above the format's max, inf included),
    ``flushed_fraction`` (nonzero values that became zero), both over all casts since the last ``reset()``, and
    ``values`` (the nonzero scaled values those fractions are out of; NaN is in none of them). ``amax`` and
    ``scale`` are ``None`` before a cast. ``totals()`` sums the counts per role over all modules.
    """

    def __init__(self, roles: dict[str, dict[str, _Role]]) -> None:
        self._roles = roles

    def _read(self) -> list[tuple[str, str, _Role, list[float], list[float]]]:
        """``(module, role, state, [casts, *raw counts], [amax, scale])`` for every role, in one transfer."""
        entries = [(name, role_name, role) for name, rs in self._roles.items() for role_name, role in rs.items()]
        if not entries:
            return []
        device = entries[0][2].count_sums.device
        rows = torch.stack(
            [torch.cat([r.count_sums.to(device), r.last.to(device, torch.float64)]) for _, _, r in entries]
        ).tolist()
        return [(name, role_name, role, row[:4], row[4:]) for (name, role_name, role), row in zip(entries, rows)]

    def as_dict(self) -> dict[str, dict[str, dict[str, float | int | None]]]:
        """Per module and tensor role, as Python numbers: amax, scale, saturated and flushed fractions."""
        out: dict[str, dict[str, dict[str, float | int | None]]] = {}
        for name, role_name, role, sums, (amax, scale) in self._read():
            casts = int(sums[0])
            nonzero, saturated, flushed = scaling.cast_counts(sums[1:], role.fmt)
            out.setdefault(name, {})[role_name] = {
                "casts": casts,
                "amax": amax if casts else None,
                "scale": scale if casts else None,
                "saturated_fraction": saturated / nonzero if nonzero else 0.0,
                "flushed_fraction": flushed / nonzero if nonzero else 0.0,
                "values": int(nonzero),
            }
        return out

    def __getitem__(self, module_name: str) -> dict[str, dict[str, float | int | None]]:
        if module_name not in self._roles:
            raise KeyError(module_name)
        return self.as_dict()[module_name]

    def totals(self) -> dict[str, dict[str, float | int]]:
        """Per role, over all modules: ``saturated_fraction``, ``flushed_fraction``, ``values`` (one sync)."""
        sums = {role: [0.0, 0.0, 0.0] for role in ROLES}
        for _, role_name, role, raw, _ in self._read():
            for i, v in enumerate(scaling.cast_counts(raw[1:], role.fmt)):
                sums[role_name][i] += v
        return {
            role: {
                "saturated_fraction": s[1] / s[0] if s[0] else 0.0,
                "flushed_fraction": s[2] / s[0] if s[0] else 0.0,
                "values": int(s[0]),
            }
            for role, s in sums.items()
        }

    def reset(self) -> None:
        """Zero every count and forget the latest amax and scale."""
        for rs in self._roles.values():
            for role in rs.values():
                role.count_sums.zero_()
                role.last.fill_(math.nan)

    def __repr__(self) -> str:
        return f"Fp8Stats(modules={len(self._roles)})"


class Fp8Handle(Removable):
    """What [`emulate_recipe`][dls.fp8.gemm.emulate_recipe] returns. ``remove()`` restores the modules (idempotent);
    the handle is a context manager that removes on exit.

    Attributes:
        recipe: the recipe in use.
        modules: ``{name: module}`` of the emulated ``nn.Linear`` layers (names from ``model.named_modules()``).
        stats: [`Fp8Stats`][dls.fp8.Fp8Stats].
    """

    def __init__(
        self,
        model: nn.Module,
        recipe: Recipe,
        module_filter: Callable[[str, nn.Linear], bool] | None,
        process_group: Any,
        track_stats: bool,
    ) -> None:
        self.recipe = recipe
        self.modules: dict[str, nn.Linear] = {}
        self._roles: dict[str, dict[str, _Role]] = {}
        self._previous: dict[str, Any] = {}
        per_axis = isinstance(recipe, MXFP8) or (isinstance(recipe, CurrentScaling) and recipe.granularity == "row")
        selected = []
        for name, module in model.named_modules():
            # Subclasses with a forward of their own (LoRA layers, ...) compute something else: left alone.
            if not isinstance(module, nn.Linear) or type(module).forward is not nn.Linear.forward:
                continue
            if module_filter is not None and not module_filter(name, module):
                continue
            if getattr(module.__dict__.get("forward"), "_dls_fp8", False):
                raise ValueError(f"model: {name!r} is already emulated by another dls.fp8 handle; remove that first")
            selected.append((name, module))
        for name, module in selected:
            device = module.weight.device
            roles = {r: _Role(recipe, r, device, track_stats, process_group) for r in ROLES}
            caster: _Caster = _AxisCaster(recipe, roles) if per_axis else _TensorCaster(recipe, roles)
            self._previous[name] = module.__dict__.get("forward")
            module.forward = _make_forward(module, caster)  # type: ignore[method-assign,assignment]
            self.modules[name] = module
            self._roles[name] = roles
        self.stats = Fp8Stats(self._roles)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """``{"recipe": recipe.to_dict(), "modules": {name: {role: {"amax_history", "scale"}}}}``: copies of
        the delayed-scaling state (histories newest first); ``"modules"`` is empty for stateless recipes.
        Loading it into a handle on an identical model resumes bit-identically."""
        modules: dict[str, Any] = {}
        if isinstance(self.recipe, DelayedScaling):
            for name, roles in self._roles.items():
                entry = {}
                for role_name, role in roles.items():
                    role.settle()
                    assert role.history is not None and role.scale is not None
                    entry[role_name] = {"amax_history": role.history.clone(), "scale": role.scale.clone()}
                modules[name] = entry
        return {"recipe": self.recipe.to_dict(), "modules": modules}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore [`state_dict`][dls.fp8.Fp8Handle.state_dict]'s output (tensors are copied to each module's device).

        Args:
            state: what ``state_dict()`` returned.

        Raises:
            ValueError: a different recipe, different module names, histories of another length, or a scale
                that is not finite and > 0 (histories may hold inf/NaN); nothing is changed then.
        """
        if not isinstance(state, dict) or "recipe" not in state or "modules" not in state:
            raise ValueError("state must be a dict from Fp8Handle.state_dict() (keys 'recipe' and 'modules')")
        recipe = recipe_from_dict(state["recipe"])
        if recipe != self.recipe:
            raise ValueError(f"state's recipe {recipe!r} differs from this handle's recipe {self.recipe!r}")
        modules = state["modules"]
        expected = set(self._roles) if isinstance(self.recipe, DelayedScaling) else set()
        if not isinstance(modules, dict) or set(modules) != expected:
            got = set(modules) if isinstance(modules, dict) else modules
            raise ValueError(f"state's modules {sorted(got)} differ from this handle's {sorted(expected)}")
        updates = []
        for name, entry in modules.items():
            for role_name, role in self._roles[name].items():
                item = entry.get(role_name) if isinstance(entry, dict) else None
                if not isinstance(item, dict) or set(item) != {"amax_history", "scale"}:
                    raise ValueError(f"state['modules'][{name!r}][{role_name!r}] must hold 'amax_history' and 'scale'")
                history, scale = item["amax_history"], item["scale"]
                assert role.history is not None and role.scale is not None
                key = f"state['modules'][{name!r}][{role_name!r}]"
                scaling.check_saved_state(history, scale, key, tuple(role.history.shape))
                updates.append((role, history, scale))
        for role, history, scale in updates:
            assert role.history is not None and role.scale is not None
            role.clear_pending()
            role.history.copy_(history)
            role.scale.copy_(scale.reshape(()))

    # ------------------------------------------------------------------ lifetime
    @property
    def active(self) -> bool:
        """Whether the modules still compute in FP8."""
        return bool(self._previous)

    def remove(self) -> None:
        """Give every module its own ``forward`` back. Safe to call repeatedly."""
        for name, previous in self._previous.items():
            module = self.modules[name]
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous  # type: ignore[method-assign]
        self._previous.clear()

    def __repr__(self) -> str:
        return f"Fp8Handle({self.recipe!r}, modules={len(self.modules)}, {self._state()})"


def emulate_recipe(
    model: nn.Module,
    recipe: Recipe,
    *,
    module_filter: Callable[[str, nn.Linear], bool] | None = None,
    process_group: Any = None,
    track_stats: bool = True,
) -> Fp8Handle:
    """Run every ``nn.Linear`` of ``model`` in emulated FP8 under ``recipe``, until the handle is removed.

    Args:
        model: any ``nn.Module`` (a bare ``nn.Linear`` too); its parameters stay as they are (the master
            weights) and are cast at every forward.
        recipe: [`CurrentScaling`][dls.fp8.CurrentScaling], [`DelayedScaling`][dls.fp8.DelayedScaling],
            [`MXFP8`][dls.fp8.MXFP8] or [`StaticScaling`][dls.fp8.StaticScaling].
        module_filter: ``fn(name, linear) -> bool``; only the Linear layers it accepts are emulated (e.g. keep
            the output layer in high precision). Default: every ``nn.Linear`` (and subclass) that uses
            ``nn.Linear.forward``. Subclasses with their own ``forward`` are left alone, and so are layers whose
            weight is used without calling them (``nn.MultiheadAttention``'s ``out_proj``).
        process_group: the group delayed scaling reduces amaxes over (default: the world, when
            ``torch.distributed`` is initialised).
        track_stats: keep ``handle.stats`` (a few extra reductions per cast).

    Returns:
        An [`Fp8Handle`][dls.fp8.Fp8Handle].

    Raises:
        ValueError: ``model`` is not an ``nn.Module`` or is already emulated by another handle, ``recipe`` not a
            recipe, a flag not a bool, or ``module_filter`` not callable.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    if not isinstance(recipe, _RECIPE_TYPES):
        raise ValueError(
            "recipe must be dls.fp8.CurrentScaling, DelayedScaling, MXFP8 or StaticScaling; "
            f"got {type(recipe).__name__}"
        )
    if module_filter is not None and not callable(module_filter):
        raise ValueError(f"module_filter must be callable or None; got {module_filter!r}")
    if not isinstance(track_stats, bool):
        raise ValueError(f"track_stats must be True or False; got {track_stats!r}")
    return Fp8Handle(model, recipe, module_filter, process_group, track_stats)
