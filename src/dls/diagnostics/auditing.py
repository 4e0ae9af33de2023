"""``audit``: can a model train in a half format, and from which loss scale?

For each format, ``audit`` runs ``steps`` forward/backward passes of ``loss_fn(model)`` under
``dls.emulate(model, fmt)`` (weights, inputs and outputs of every leaf module rounded to the format) and records,
per module, with hooks of its own:

* the largest ``|output|`` of each call, *before* emulation rounds it, in the order the outputs are produced (a
  child's output comes before its parent's): the first one beyond the format's max is the forward overflow, which
  no loss scale can fix;
* the exact (float32, unrounded) gradient flowing into the module's outputs, and the gradients of the parameters
  the module owns: their largest magnitude and a histogram of their binary exponents. The backward pass is not
  rounded, so that every value is counted as it would arrive at the format, unaffected by values flushed
  downstream of it; from the histogram, the share of values that rounding to the format would flush to zero or
  overflow is known for any power-of-two loss scale.

Values computed inside a module's ``forward`` and not returned (attention scores inside ``nn.MultiheadAttention``,
a functional ``exp`` in a parent's ``forward``) are not seen on their own; they show in the outputs they feed.

From those, one initial loss scale per format (see [`recommend_exponent`][dls.diagnostics.recommend_exponent] for the
rule), checked by one more emulated pass at that scale with the gradients rounded too (``FormatAudit.measured``), and
one verdict sentence.

Nothing of the model is left changed: parameters are never written, every parameter's ``.grad`` (the tensor
object itself) and every buffer's values are put back, and so are the global random number generators (torch's
CPU generator, CUDA's if CUDA is initialised, Python's ``random`` and, if imported, NumPy's global one). Each
format starts from the same RNG state and buffers, so all formats see the same batches and dropout masks if
``loss_fn`` draws them from those generators (private ``torch.Generator`` objects are not rewound).
"""

from __future__ import annotations

import dataclasses
import math
import random
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from dls import formats as _formats
from dls.diagnostics.report import AuditResult, FormatAudit, ModuleStats
from dls.diagnostics.scales import HIST_BINS, HIST_LOW, module_label, percent, pow2, recommend_exponent
from dls.emulation import emulate
from dls.formats import FloatFormat
from dls.keep import floating_tensors, in_kept_call, keep_in_float32

__all__ = ["audit"]


# ------------------------------------------------------------------------------------------- results
# ------------------------------------------------------------------------------------------- recording
class _Accumulator:
    """One module's running statistics, as device tensors (read back once per format)."""

    def __init__(self) -> None:
        self.calls = 0
        self.max_activation: torch.Tensor | None = None
        self.max_grad: torch.Tensor | None = None
        self.max_param_grad: torch.Tensor | None = None
        self.histogram: torch.Tensor | None = None
        self.nonfinite: torch.Tensor | None = None

    def add_gradient(self, grad: torch.Tensor, parameter: bool) -> None:
        g = grad.detach()
        if g.is_sparse:
            g = g.coalesce().values()
        if g.numel() == 0:
            return
        if g.dtype not in (torch.float32, torch.float64):
            g = g.float()  # exact for half formats
        a = g.abs()
        finite = torch.isfinite(a)
        a = torch.where(finite, a, torch.zeros((), dtype=a.dtype, device=a.device))
        biggest = a.amax().double()
        _, exponent = torch.frexp(a)  # |g| = m * 2**exponent with m in [0.5, 1): binade exponent - 1
        bins = (exponent[a > 0].long() - (1 + HIST_LOW)).clamp_(0, HIST_BINS - 1)
        hist = torch.bincount(bins, minlength=HIST_BINS)
        nonfinite = (~finite).sum()
        if parameter:
            self.max_param_grad = _maximum(self.max_param_grad, biggest)
        else:
            self.max_grad = _maximum(self.max_grad, biggest)
        self.histogram = _sum(self.histogram, hist)
        self.nonfinite = _sum(self.nonfinite, nonfinite)


def _sum(current: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    return new if current is None else current.add_(new.to(current.device))


def _maximum(current: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    return new if current is None else torch.maximum(current, new.to(current.device))


class _Recorder:
    """Forward hooks on every module of ``root``: the largest ``|output|`` of each call (before emulation rounds
    it: registered in front of emulate's hooks), and tensor hooks on the outputs emulation returns (registered
    after emulate's hooks), which see each module's output gradient before emulation's backward rounds it."""

    def __init__(self, root: nn.Module, fmt: FloatFormat) -> None:
        self.fmt = fmt
        self.modules = list(root.named_modules())
        self.stats = [_Accumulator() for _ in self.modules]
        self.first_seen: list[int] = []  # module indices in the order of their first output
        owners: dict[torch.Tensor, int] = {}
        for i, (_, module) in enumerate(self.modules):
            for p in module._parameters.values():
                if p is not None and p not in owners:
                    owners[p] = i
        self.owned = list(owners.items())
        self.events: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (module, max |output|, any NaN) per call
        self.forward_overflow: tuple[int, float] | None = None
        self.forward_nan: int | None = None
        self._hooks: list[RemovableHandle] = []
        self._tensor_hooks: list[RemovableHandle] = []
        for i, (_, module) in enumerate(self.modules):
            self._hooks.append(module.register_forward_hook(partial(self._on_output, i), prepend=True))
            self._hooks.append(module.register_forward_hook(partial(self._hook_gradients, i)))

    def _on_output(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        outs = [t.detach() for t in floating_tensors(output) if t.numel()]
        stats = self.stats[index]
        if stats.calls == 0:
            self.first_seen.append(index)
        stats.calls += 1
        if not outs:
            return
        biggest = torch.stack([t.abs().nan_to_num(nan=0.0, posinf=math.inf).amax().double() for t in outs]).amax()
        if in_kept_call():  # kept in float32 (dls.keep_in_float32): not rounded to the format, only inf overflows
            biggest = torch.where(torch.isinf(biggest), biggest, torch.zeros_like(biggest))
        has_nan = torch.stack([t.isnan().any() for t in outs]).any()
        stats.max_activation = _maximum(stats.max_activation, biggest)
        self.events.append((index, biggest, has_nan))

    def _hook_gradients(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        for t in floating_tensors(output):
            if t.requires_grad:
                # Removed after the pass: an output can be a tensor the caller keeps (nn.Identity returns its input).
                self._tensor_hooks.append(t.register_hook(partial(self._on_gradient, index)))

    def _on_gradient(self, index: int, grad: torch.Tensor) -> None:
        self.stats[index].add_gradient(grad, parameter=False)

    def end_forward(self) -> None:
        """Resolve this pass's outputs (one host read): the first one beyond the format's max, or with NaN."""
        events, self.events = self.events, []
        if not events or self.forward_overflow is not None:
            return
        values = torch.stack([v.cpu() for _, v, _ in events]).tolist()
        nans = torch.stack([n.cpu() for _, _, n in events]).tolist()
        for (index, _, _), value, nan in zip(events, values, nans):
            if value > self.fmt.max and _exceeds(self.fmt, value):
                self.forward_overflow = (index, value)
                return
            if nan and self.forward_nan is None:
                self.forward_nan = index

    def end_backward(self) -> None:
        for p, index in self.owned:
            if p.grad is not None and p.grad.is_floating_point():
                self.stats[index].add_gradient(p.grad, parameter=True)
        self._remove_tensor_hooks()

    def _remove_tensor_hooks(self) -> None:
        for hook in self._tensor_hooks:
            hook.remove()
        self._tensor_hooks.clear()

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._remove_tensor_hooks()

    def results(self) -> tuple[ModuleStats, ...]:
        rows = []
        for index in self.first_seen:
            name, module = self.modules[index]
            s = self.stats[index]
            rows.append(
                ModuleStats(
                    name=name,
                    type=type(module).__name__,
                    calls=s.calls,
                    max_activation=_read(s.max_activation),
                    max_grad=_read(s.max_grad),
                    max_param_grad=_read(s.max_param_grad),
                    histogram=(0,) * HIST_BINS if s.histogram is None else tuple(s.histogram.tolist()),
                    nonfinite_grads=int(s.nonfinite.item()) if s.nonfinite is not None else 0,
                )
            )
        return tuple(rows)


def _exceeds(fmt: FloatFormat, value: float) -> bool:
    """Whether ``|x| = value`` rounds beyond the format's max (to inf, NaN or a saturated max)."""
    if math.isinf(value):
        return True
    return bool(fmt.count_underflow_overflow(torch.tensor([value], dtype=torch.float64))[2].item())


def _read(value: torch.Tensor | None) -> float | None:
    return None if value is None else float(value.item())


# ------------------------------------------------------------------------------------------- state
class _Snapshot:
    """Gradients (the tensor objects), buffer values and global RNG states, to rewind to and restore."""

    def __init__(self, model: nn.Module) -> None:
        self.params = list(model.parameters())
        self.grads = [p.grad for p in self.params]
        self.buffers = [(b, b.detach().clone()) for b in model.buffers()]
        self.torch_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self.python_rng = random.getstate()
        numpy = sys.modules.get("numpy")
        self.numpy_rng = numpy.random.get_state() if numpy is not None else None

    def backward(self, loss: torch.Tensor) -> None:
        """Gradients into the model's parameters only: tensors of the caller's (inputs that require grad) keep
        their ``.grad``."""
        trainable = [p for p in self.params if p.requires_grad]
        torch.autograd.backward(loss, inputs=trainable if trainable else None)

    def clear_grads(self) -> None:
        for p in self.params:
            p.grad = None

    def rewind(self) -> None:
        """Buffers and RNG states as they were; gradients cleared (for the next format's first pass)."""
        self.clear_grads()
        with torch.no_grad():
            for b, saved in self.buffers:
                b.copy_(saved)
        torch.set_rng_state(self.torch_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        random.setstate(self.python_rng)
        numpy = sys.modules.get("numpy")
        if numpy is not None and self.numpy_rng is not None:
            numpy.random.set_state(self.numpy_rng)

    def restore(self) -> None:
        self.rewind()
        for p, g in zip(self.params, self.grads):
            p.grad = g


# ------------------------------------------------------------------------------------------- audit
KEEP_ROUNDS = 8  # forward audits with modules kept in float32, at most, per format that overflows


def audit(
    model: nn.Module,
    loss_fn: Callable[[nn.Module], torch.Tensor],
    formats: Sequence[str | FloatFormat | torch.dtype] = ("float16", "bfloat16", "cbfloat16"),
    steps: int = 4,
    *,
    underflow_tolerance: float = 1e-3,
) -> AuditResult:
    """Run ``steps`` forward/backward passes of ``loss_fn(model)`` under exact emulation of each format and say,
    per format, whether the forward pass overflows, how the gradients fit, and which loss scale to start at.

    No optimizer step is taken; parameters, every ``.grad``, buffers and the global RNG states are left exactly
    as they were (see the module docstring). The model must not be under ``dls.emulate`` already.

    Args:
        model: the float32 model (not wrapped in DDP).
        loss_fn: called as ``loss_fn(model)``; returns a scalar floating-point loss that requires grad. Each call
            may draw a new batch; every format sees the same sequence of batches.
        formats: format names (``"float16"``, ``"bfloat16"``, ``"cbfloat16"``, any registered name),
            ``FloatFormat`` objects or torch dtypes; results are keyed by the format's name.
        steps: passes per format (plus, per format, one checking pass at the recommended scale).
        underflow_tolerance: the share of nonzero gradient values that may be flushed to zero at the smallest
            acceptable scale (see [`recommend_exponent`][dls.diagnostics.recommend_exponent]), from 0 up to (not
            including) 1.

    Returns:
        An [`AuditResult`][dls.diagnostics.AuditResult]: ``forward_overflow[fmt]``, ``verdicts[fmt]``,
        ``recommended_init_scale[fmt]``, ``audits[fmt].modules`` (the per-module table), ``keep_in_float32[fmt]``,
        ``to_text()``, ``save_plot(path)``.

        ``keep_in_float32[fmt]``: the module names to keep in float32 (``dls.keep_in_float32``) so that the forward
        pass fits the format, found by auditing the forward pass again with the modules found so far kept (fresh
        batches from ``loss_fn`` each round, at most 8 rounds); ``[]`` when it fits already, ``None`` when nothing
        fits that way.

        ``recommended_init_scale[fmt]`` is a power of two at which, over all the gradient values seen, at most
        ``underflow_tolerance`` of them flush to zero with three binades to spare (gradients may shrink 8x) and
        the largest one stays at most half the format's max: of the scales that satisfy both, the one closest to
        1; where none does, the largest scale that does not overflow
        ([`recommend_exponent`][dls.diagnostics.recommend_exponent] states it exactly). Pass it as
        ``GradScaler(init_scale=...)``. ``None`` where loss scaling cannot help (forward overflow or NaN, non-finite
        gradients) or no nonzero gradient was seen.

    Raises:
        ValueError: a bad argument (nothing has run then), or ``loss_fn`` returned something other than a scalar
            floating-point tensor that requires grad (the model is restored first).
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    if not callable(loss_fn):
        raise ValueError(f"loss_fn must be a callable taking the model and returning a loss; got {loss_fn!r}")
    fmts = _resolve_formats(formats)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int; got {steps!r}")
    if (
        isinstance(underflow_tolerance, bool)
        or not isinstance(underflow_tolerance, (int, float))
        or not 0 <= underflow_tolerance < 1
    ):
        raise ValueError(f"underflow_tolerance must be a number in [0, 1); got {underflow_tolerance!r}")

    snapshot = _Snapshot(model)
    runs: list[tuple[FloatFormat, _Recorder, tuple[ModuleStats, ...], int | None, Mapping[str, float] | None]] = []
    try:
        with torch.enable_grad():
            for fmt in fmts:
                snapshot.rewind()
                with emulate(model, fmt, round_grads=False, track_stats=False):
                    recorder = _Recorder(model, fmt)  # after emulate's hooks: it goes in front of and behind them
                    try:
                        for _ in range(steps):
                            snapshot.clear_grads()
                            loss = _checked_loss(loss_fn(model))
                            recorder.end_forward()
                            snapshot.backward(loss)
                            recorder.end_backward()
                    finally:
                        recorder.remove()
                modules = recorder.results()
                exponent = _exponent_for(recorder, modules, fmt, underflow_tolerance)
                measured: Mapping[str, float] | None = None
                if exponent is not None:
                    snapshot.rewind()
                    with emulate(model, fmt) as handle:
                        loss = _checked_loss(loss_fn(model))
                        snapshot.backward(loss.float() * 2.0**exponent)
                    assert handle.stats is not None
                    measured = types.MappingProxyType(handle.stats.as_dict())
                runs.append((fmt, recorder, modules, exponent, measured))

        keep: dict[str, list[str] | None] = {}
        with torch.enable_grad():
            for fmt, recorder, *_ in runs:
                first = _born(recorder)
                keep[fmt.name] = [] if first is None else _fit_by_keeping(model, loss_fn, fmt, first, steps, snapshot)
    finally:
        snapshot.restore()

    clean = [fmt.name for fmt, r, *_ in runs if r.forward_overflow is None and r.forward_nan is None]
    audits = {}
    for fmt, recorder, modules, exponent, stats in runs:
        overflow = recorder.forward_overflow
        nan_at = recorder.forward_nan if overflow is None else None
        draft = FormatAudit(
            format=fmt,
            modules=modules,
            forward_overflow=None if overflow is None else recorder.modules[overflow[0]][0],
            forward_overflow_value=None if overflow is None else overflow[1],
            forward_nan=None if nan_at is None else recorder.modules[nan_at][0],
            recommended_init_scale=None if exponent is None else 2.0**exponent,
            verdict="",
            measured=stats,
        )
        alternatives = [n for n in clean if n != fmt.name]
        verdict = _verdict(draft, exponent, underflow_tolerance, alternatives)
        audits[fmt.name] = dataclasses.replace(draft, verdict=verdict)
    return AuditResult(types.MappingProxyType(audits), steps, float(underflow_tolerance), types.MappingProxyType(keep))


def _born(recorder: _Recorder) -> str | None:
    """Where the forward pass stopped fitting: the first NaN (e.g. a norm of an input rounded to inf) or overflow."""
    index = recorder.forward_nan
    if index is None and recorder.forward_overflow is not None:
        index = recorder.forward_overflow[0]
    return None if index is None else recorder.modules[index][0]


def _fit_by_keeping(
    model: nn.Module,
    loss_fn: Callable[[nn.Module], torch.Tensor],
    fmt: FloatFormat,
    first: str,
    steps: int,
    snapshot: _Snapshot,
) -> list[str] | None:
    """The modules to keep in float32 so that ``steps`` forward passes fit ``fmt``: audit the forward pass again
    with the modules found so far kept, adding the next overflowing one, for at most ``KEEP_ROUNDS`` rounds. Each
    round draws fresh batches (the RNG states are not rewound between rounds). ``None`` when nothing fits: a kept
    module's float32 output overflows (or is NaN), or the pass still overflows after the last round."""
    names = [first]
    for _ in range(KEEP_ROUNDS):
        with keep_in_float32(model, names), emulate(model, fmt, round_grads=False, track_stats=False):
            recorder = _Recorder(model, fmt)
            try:
                for _ in range(steps):
                    snapshot.clear_grads()
                    _checked_loss(loss_fn(model))  # forward only: no gradient is computed
                    recorder.end_forward()
                    if recorder.forward_overflow is not None or recorder.forward_nan is not None:
                        break
            finally:
                recorder.remove()
        name = _born(recorder)
        if name is None:
            return names
        if name in names:
            return None
        names.append(name)
    return None


def _resolve_formats(value: Any) -> list[FloatFormat]:
    allowed = ", ".join(repr(n) for n in _formats.names())
    if isinstance(value, (str, FloatFormat, torch.dtype)) or not isinstance(value, Sequence) or not value:
        raise ValueError(
            f"formats must be a non-empty sequence of format names ({allowed}), FloatFormat objects or torch "
            f"dtypes, e.g. ('float16',); got {value!r}"
        )
    resolved = []
    for item in value:
        try:
            resolved.append(_formats.get(item))
        except ValueError:
            raise ValueError(f"formats: unknown format {item!r}; allowed: {allowed}, or a FloatFormat") from None
    names = [f.name for f in resolved]
    if len(set(names)) != len(names):
        raise ValueError(f"formats must not repeat a format; got {names}")
    return resolved


def _checked_loss(loss: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        raise ValueError(f"loss_fn must return a scalar floating-point tensor; got {_describe(loss)}")
    if not loss.requires_grad:
        raise ValueError("loss_fn must return a loss that requires grad (computed from the model's parameters)")
    return loss


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    return type(value).__name__


def _exponent_for(
    recorder: _Recorder, modules: tuple[ModuleStats, ...], fmt: FloatFormat, tolerance: float
) -> int | None:
    if recorder.forward_overflow is not None or recorder.forward_nan is not None:
        return None
    if any(m.nonfinite_grads for m in modules):
        return None
    histogram = [sum(column) for column in zip(*(m.histogram for m in modules))]
    values = [v for m in modules for v in (m.max_grad, m.max_param_grad) if v is not None]
    return recommend_exponent(histogram, max(values), fmt, tolerance) if values and histogram else None


def _verdict(fa: FormatAudit, exponent: int | None, tolerance: float, alternatives: list[str]) -> str:
    name, fmt = fa.format.name, fa.format
    wider = " or ".join(alternatives) if alternatives else "a format with a wider range"
    if fa.forward_overflow is not None:
        module = module_label(fa.forward_overflow)
        return (
            f"{name}: forward overflow at {module} (max |x| {fa.forward_overflow_value:.3g} > {fmt.max:.6g}): loss "
            f"scaling cannot fix this; use {wider}, or keep {module} in float32"
        )
    if fa.forward_nan is not None:
        return f"{name}: the forward pass produces NaN at {module_label(fa.forward_nan)}: loss scaling cannot fix this"
    bad = next((m for m in fa.modules if m.nonfinite_grads), None)
    if bad is not None:
        return (
            f"{name}: gradients are inf/NaN at loss scale 1 before any rounding (at {module_label(bad.name)}): loss "
            "scaling cannot fix this"
        )
    if exponent is None:
        return f"{name}: no nonzero gradient reached the model's modules; nothing to recommend"
    under, over = fa.underflow(1.0), fa.overflow(1.0)
    scale = 2.0**exponent
    at_best = fa.underflow(scale)
    if at_best > tolerance:
        return (
            f"{name}: the gradients span more than {name}'s range: even at {pow2(scale)}, the largest scale that "
            f"does not overflow, {percent(at_best)} of them underflow; use {wider}"
        )
    if exponent == 0:
        return f"{name}: gradients fit at scale 1 ({percent(under)} underflow, none overflow); no loss scaling needed"
    if exponent > 0:
        return f"{name}: {percent(under)} of gradients underflow at scale 1; start at {pow2(scale)}"
    return (
        f"{name}: {percent(over)} of gradients overflow at scale 1 (max |grad| {fa.max_grad:.3g}); start at "
        f"{pow2(scale)}"
    )
