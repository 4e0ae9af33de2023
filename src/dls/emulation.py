"""Emulated mixed precision: make a float32 model compute as if its tensors were stored in a half format.

``handle = dls.emulate(model, "cbfloat16")`` installs module hooks; ``handle.remove()`` (or leaving a
``with dls.emulate(...):`` block) takes them out again. While installed, every module call is emulated as:

* **weights**: each module that owns parameters computes with copies rounded to the format. In a forward
  pre-hook the module's ``_parameters`` entries are swapped for ``fmt.quantize(p, straight_through=True)``
  (a non-leaf tensor whose gradient flows unchanged to ``p``), and a forward hook registered with
  ``always_call=True`` puts the original ``Parameter`` objects back, even when forward raises. This is the
  same mechanism ``torch.func.functional_call`` uses to substitute tensors, without re-entering ``forward``;
  it leaves the stored float32 parameters (the master weights), their ``.grad`` and the optimizer untouched
  and costs one rounding per parameter per call. (``torch.nn.utils.parametrize`` would do the same but
  rewrites the module's class and state-dict keys.) A module with both parameters and children (e.g.
  ``nn.MultiheadAttention``, which reads ``out_proj.weight`` without calling ``out_proj``) swaps the
  parameters of its whole subtree. Buffers (e.g. BatchNorm running statistics) are not rounded.
* **inputs**: floating-point tensors passed to a leaf module (one without children) are rounded, with a
  straight-through gradient.
* **outputs**: floating-point tensors a leaf module returns are rounded, through an autograd function whose
  backward rounds the incoming gradient to the format too. That backward rounding is where small gradients
  underflow to zero in half precision, and where loss scaling rescues them; ``handle.stats`` counts how many
  nonzero gradient values it flushes to zero (and how many overflow).

Modules kept in float32 (``dls.keep_in_float32``) and their descendants are left alone: nothing in their call is
rounded.

Computations between leaf modules (functional calls in a parent's ``forward``, residual additions, the loss)
run in float32 and are rounded when they enter the next leaf module. Nothing here syncs with the host: the
statistics accumulate in device tensors and are read when you ask for them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from dls import formats
from dls.formats import FloatFormat
from dls.handles import Removable
from dls.keep import in_kept_call, map_floating

__all__ = ["EmulationHandle", "EmulationStats", "emulate"]


class EmulationStats:
    """Counts of the gradient values that the backward rounding of module outputs saw.

    ``elements``: gradient values rounded; ``nonzero``: of those, nonzero and finite; ``flushed``: nonzero
    finite values rounded to zero (underflow); ``overflowed``: nonzero finite values rounded above the
    format's max (to inf, NaN or a saturated max). Reading a count syncs with the device once.
    """

    def __init__(self) -> None:
        self._elements = 0
        self._counts: torch.Tensor | None = None  # int64 [nonzero, flushed, overflowed], on the first grad's device

    def _add(self, numel: int, nonzero: torch.Tensor, flushed: torch.Tensor, overflowed: torch.Tensor) -> None:
        self._elements += numel
        new = torch.stack([nonzero, flushed, overflowed])
        if self._counts is None:
            self._counts = new
        else:
            self._counts.add_(new.to(self._counts.device))

    def _values(self) -> list[int]:
        counts = [0, 0, 0] if self._counts is None else [int(v) for v in self._counts.tolist()]
        return [self._elements, *counts]

    @property
    def elements(self) -> int:
        """Gradient values rounded."""
        return self._values()[0]

    @property
    def nonzero(self) -> int:
        """Nonzero finite gradient values among them."""
        return self._values()[1]

    @property
    def flushed(self) -> int:
        """Nonzero finite gradient values that rounded to zero."""
        return self._values()[2]

    @property
    def overflowed(self) -> int:
        """Nonzero finite gradient values that rounded above the format's max."""
        return self._values()[3]

    @property
    def underflow_fraction(self) -> float:
        """``flushed / nonzero`` (0.0 before any gradient)."""
        _, nonzero, flushed, _ = self._values()
        return flushed / nonzero if nonzero else 0.0

    @property
    def overflow_fraction(self) -> float:
        """``overflowed / nonzero`` (0.0 before any gradient)."""
        _, nonzero, _, overflowed = self._values()
        return overflowed / nonzero if nonzero else 0.0

    def as_dict(self) -> dict[str, float]:
        """All counts and both fractions, read with a single device sync."""
        elements, nonzero, flushed, overflowed = self._values()
        return {
            "elements": elements,
            "nonzero": nonzero,
            "flushed": flushed,
            "overflowed": overflowed,
            "underflow_fraction": flushed / nonzero if nonzero else 0.0,
            "overflow_fraction": overflowed / nonzero if nonzero else 0.0,
        }

    def reset(self) -> None:
        """Zero all counts."""
        self._elements = 0
        self._counts = None

    def __repr__(self) -> str:
        d = self.as_dict()
        return (
            f"EmulationStats(elements={d['elements']}, nonzero={d['nonzero']}, flushed={d['flushed']}, "
            f"overflowed={d['overflowed']})"
        )


class _RoundOutput(torch.autograd.Function):
    """Forward: round (or pass) the output; backward: round (and count) the gradient flowing into it."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        fmt: FloatFormat,
        stats: EmulationStats | None,
        round_forward: bool,
        round_backward: bool,
    ) -> torch.Tensor:
        ctx.fmt, ctx.stats, ctx.round_backward = fmt, stats, round_backward
        return fmt.quantize(x) if round_forward else x.clone()

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None, None]:
        grad = grads[0]
        if grad is None or not ctx.round_backward:
            return grad, None, None, None, None
        q, nonzero, flushed, overflowed = ctx.fmt.quantize_and_count(grad)
        if ctx.stats is not None:
            ctx.stats._add(grad.numel(), nonzero, flushed, overflowed)
        return q, None, None, None, None


_Slot = tuple[nn.Module, str, torch.Tensor]


class EmulationHandle(Removable):
    """What [`emulate`][dls.emulation.emulate] returns: ``remove()`` uninstalls the hooks (idempotent), and the handle
    is a context manager that removes them on exit.

    Attributes:
        fmt: the [`FloatFormat`][dls.formats.FloatFormat] emulated.
        stats: `EmulationStats` of the backward rounding (``None`` when ``track_stats=False``).
        modules: the modules that carry hooks.
    """

    def __init__(
        self,
        model: nn.Module,
        fmt: FloatFormat,
        *,
        round_weights: bool,
        round_inputs: bool,
        round_outputs: bool,
        round_grads: bool,
        track_stats: bool,
    ) -> None:
        self.fmt = fmt
        self.stats: EmulationStats | None = EmulationStats() if track_stats else None
        self._round_inputs = round_inputs
        self._round_outputs = round_outputs
        self._round_grads = round_grads
        self._hooks: list[RemovableHandle] = []
        self._saved: dict[nn.Module, list[list[_Slot]]] = {}
        hooked: list[nn.Module] = []
        for module in model.modules():
            is_leaf = next(module.children(), None) is None
            owns = round_weights and any(p is not None for p in module._parameters.values())
            touches_io = is_leaf and (round_inputs or round_outputs or round_grads)
            if not (owns or touches_io):
                continue
            self._hooks.append(module.register_forward_pre_hook(self._make_pre_hook(owns, is_leaf), with_kwargs=True))
            self._hooks.append(module.register_forward_hook(self._make_post_hook(owns, is_leaf), always_call=True))
            hooked.append(module)
        self.modules: tuple[nn.Module, ...] = tuple(hooked)

    # ------------------------------------------------------------------ hooks
    def _make_pre_hook(self, owns: bool, is_leaf: bool) -> Callable[..., Any]:
        def pre_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if in_kept_call():
                return None
            if owns:
                self._swap_in(module, is_leaf)
            if is_leaf and self._round_inputs:
                return map_floating(args, self._round_input), map_floating(kwargs, self._round_input)
            return None

        return pre_hook

    def _make_post_hook(self, owns: bool, is_leaf: bool) -> Callable[..., Any]:
        def post_hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            if in_kept_call():
                return None
            if owns:
                self._swap_out(module)
            if is_leaf and (self._round_outputs or self._round_grads) and output is not None:
                return map_floating(output, self._round_output)
            return None

        return post_hook

    def _round_input(self, t: torch.Tensor) -> torch.Tensor:
        return self.fmt.quantize(t, straight_through=True)

    def _round_output(self, t: torch.Tensor) -> torch.Tensor:
        if t.requires_grad and torch.is_grad_enabled():
            out: torch.Tensor = _RoundOutput.apply(t, self.fmt, self.stats, self._round_outputs, self._round_grads)
            return out
        return self.fmt.quantize(t) if self._round_outputs else t

    def _swap_in(self, module: nn.Module, is_leaf: bool) -> None:
        owners = [module] if is_leaf else list(module.modules())
        frame: list[_Slot] = []
        for owner in owners:
            slots: dict[str, Any] = owner._parameters  # holds plain tensors for the duration of the call
            for name, p in list(slots.items()):
                if p is not None and p.is_floating_point():
                    frame.append((owner, name, p))
                    slots[name] = self.fmt.quantize(p, straight_through=True)
        self._saved.setdefault(module, []).append(frame)

    def _swap_out(self, module: nn.Module) -> None:
        stack = self._saved.get(module)
        if not stack:
            return
        for owner, name, p in reversed(stack.pop()):
            slots: dict[str, Any] = owner._parameters
            slots[name] = p
        if not stack:
            del self._saved[module]

    # ------------------------------------------------------------------ lifetime
    @property
    def active(self) -> bool:
        """Whether the hooks are installed."""
        return bool(self._hooks)

    def remove(self) -> None:
        """Uninstall every hook (and put back any parameter still swapped out). Safe to call repeatedly."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for module in list(self._saved):
            while module in self._saved:
                self._swap_out(module)

    def __repr__(self) -> str:
        return f"EmulationHandle(fmt={self.fmt.name!r}, modules={len(self.modules)}, {self._state()})"


def emulate(
    model: nn.Module,
    fmt: str | FloatFormat | torch.dtype,
    *,
    round_weights: bool = True,
    round_inputs: bool = True,
    round_outputs: bool = True,
    round_grads: bool = True,
    track_stats: bool = True,
) -> EmulationHandle:
    """Make ``model`` compute as if in the half format ``fmt``, until the returned handle is removed.

    Args:
        model: any ``nn.Module``; parameters stay float32 (or whatever they are) and are never modified.
        fmt: a [`FloatFormat`][dls.formats.FloatFormat], a registered name (``"float16"``, ``"bfloat16"``,
            ``"cbfloat16"``, ``"float8_e4m3fn"``, ``"float8_e5m2"``, or one added with
            ``dls.formats.register``) or a torch dtype of those formats.
        round_weights: round the parameters each module computes with (straight-through gradient).
        round_inputs: round floating-point inputs of leaf modules (straight-through gradient).
        round_outputs: round floating-point outputs of leaf modules.
        round_grads: round the gradient flowing into each leaf module's output (the underflow point).
        track_stats: count underflow/overflow of that gradient rounding in ``handle.stats``.

    Returns:
        An `EmulationHandle`; use ``handle.remove()`` or ``with dls.emulate(model, fmt): ...``.

    Raises:
        ValueError: ``model`` is not an ``nn.Module``, ``fmt`` is unknown, or a flag is not a bool.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    try:
        resolved = formats.get(fmt)
    except ValueError:
        raise ValueError(
            f"fmt must be a FloatFormat, a torch float16/bfloat16/float8 dtype or one of "
            f"{', '.join(repr(n) for n in formats.names())}; got {fmt!r}"
        ) from None
    flags = {
        "round_weights": round_weights,
        "round_inputs": round_inputs,
        "round_outputs": round_outputs,
        "round_grads": round_grads,
        "track_stats": track_stats,
    }
    for key, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"{key} must be True or False; got {value!r}")
    return EmulationHandle(model, resolved, **flags)
