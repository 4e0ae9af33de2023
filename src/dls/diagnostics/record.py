"""Recording what the loss scaler saw, step by step, so that every other policy can be replayed on it later.

``recorder = scaler.record("trace.jsonl")`` writes one line per ``update()`` of the scale (one rule step): the
scale the step used, whether it overflowed, the largest magnitude of the unscaled gradients, and every
``histogram_every`` steps a histogram of the gradients' binary exponents; with ``model=``, hooks add per step and
per module the scale at which the tensors flowing backward through that module would overflow their format
(every tensor of backward that the module's forward pass produced: its outputs' gradients, and those inside it,
such as the half-precision gradients of its weights under autocast).
``dls.diagnostics.replaying`` runs the scale rules of ``dls.policy`` over such a trace; ``dls replay`` and
``dls tune`` are its command line.

The file: JSON lines, because the library needs torch alone (Parquet needs pyarrow), because a line is complete
when written (a run killed mid-way leaves a readable trace up to its last write), and because
``pandas.read_json(path, lines=True)`` reads it. Format ``dls-trace``, version 1:

* a **header** line, at the start and again where a resumed run continues the trace (a new *segment*)::

    {"format": "dls-trace", "version": 1, "dls_version": "...", "start_step": 0,
     "settings": {ScalerSettings' fields}, "state": {the scaler's state at the start: loss_scale,
     steps_since_rescale, overflows_since_rescale, num_skipped_steps, hysteresis_tracker, or the counters of
     the rule's own state (STATE_FIELDS)},
     "histogram_every": 100, "modules": ["", "encoder", ...]}

* one **step** line per rule step::

    {"step": 1, "scale": 65536.0, "overflow": false, "grad_amax": 0.0123,
     "grad_amax_float16": 0.0123,            # only where some gradients are float16 tensors
     "exponents": {"min": -40, "counts": [...]},  # every histogram_every steps
     "module_overflow_scale": [1.2e9, null, ...]} # with model=: one per name of the header's "modules"

``step`` counts rule steps from the header's ``start_step`` (the trainer's global step). ``scale`` is the scale the
step's gradients were computed with, ``overflow`` what the scaler decided (the step was skipped). ``grad_amax``
is the largest ``|g|`` over the unscaled gradients as the optimizer received them (after the scaler's clipping,
when it clips), ``null`` on a step that overflowed (or without gradients at ``update()``). ``exponents.counts[i]``
counts the gradient values ``g`` with ``2**(min+i) <= |g| < 2**(min+i+1)``; zeros, float32 subnormals (below
2**-126) and non-finite values are not counted. ``module_overflow_scale[j]``: the largest ``|t|`` among the
tensors flowing backward through module ``j`` (the gradients every autograd node its forward pass created
receives), divided by the step's scale, is the magnitude per unit of scale; the format's largest finite value (of
the tensor's dtype) divided by it is the scale at which that tensor would have overflowed. ``null``: the module ran
no backward this step, its gradients were all zero, or one was not finite (on an overflowing step, the modules
whose backward ran before the overflow keep their values). A reader refuses a ``version`` above the one it
knows.

What it costs, and why this way. The statistics stay on the device in buffers of ``flush_every`` rows; every
``flush_every`` steps they are copied to the host (asynchronously on CUDA, written at the next flush), so
recording adds no host synchronisation to any path of the scaler, fused and sync-free included. Per step: one
pass over the gradients for their largest magnitude (``torch._foreach_norm(ord=inf)`` on accelerators; on a CPU,
where that norm is a scalar loop and ``_foreach_abs`` would copy every gradient, ``_foreach_max`` of the gradients
and of their negation, negated in place and back, which is exact), plus a few 0-dim ops. Every
``histogram_every`` steps one more pass per gradient tensor (a bincount of the exponent bits). The model hooks
walk the autograd graph once per step in Python and measure every tensor of backward (one read each): they are
optional, and cost more. ``benchmarks/bench_record.py`` measures both.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

import torch
from torch import nn

from dls import formats, kernels
from dls.checks import count_problem
from dls.diagnostics.trace import STATE_FIELDS, TRACE_FORMAT, TRACE_VERSION, TraceError, read_trace
from dls.keep import unwrap

if TYPE_CHECKING:
    from dls.scaler import GradScaler

__all__ = ["Recorder", "recording"]

# Exponent field of float32 (biased by 127): fields 1..254 are the normal binades 2**-126 .. 2**127.
_EXPONENT_BIAS = 127
_COLUMNS = 4  # per row on the device: scale, overflow flag, largest |g|, largest |g| of float16 gradients


class Recorder:
    """Records one ``GradScaler``'s rule steps into a trace (see the module docstring); made by
    ``GradScaler.record``. A context manager: leaving it (or ``close``) writes what is buffered, removes the
    model hooks and detaches it from the scaler.

    Args:
        scaler: the scaler to record (enabled: a disabled scaler has nothing to record).
        file: a path (``str`` or ``Path``; created, or replaced unless ``append``) or a binary file object opened
            for writing (kept open on ``close``; the trainer passes one into its model_dir).
        flush_every: rows buffered on the device between writes (a positive integer).
        histogram_every: a histogram of the gradients' exponents every this many steps (a positive integer), or
            ``None`` for none (then the trace cannot tell underflow).
        model: add the per-module overflow scales (hooks on every module of ``model`` that runs).
        start_step: the step before the first recorded one (the trainer's global step when it resumes); default:
            0, or, appending to a trace, its last step (a segment continues the trace at or after it).
        append: with a path, add a segment to an existing trace instead of replacing it (the trace is read
            first, as ``read_trace`` reads it: a file that is not a trace, or a ``start_step`` before its last
            step, is refused before anything is written).
        model_format: with ``model``, the format whose largest finite value float32 tensors stand for (a name of
            ``dls.formats``; for runs under ``dls.emulate``); default: each tensor's own dtype.

    Raises:
        ValueError: an argument outside what is allowed (named), a disabled scaler, or one already recording.
    """

    def __init__(
        self,
        scaler: GradScaler,
        file: str | os.PathLike[str] | IO[bytes],
        *,
        flush_every: int = 100,
        histogram_every: int | None = 100,
        model: nn.Module | None = None,
        start_step: int | None = None,
        append: bool = False,
        model_format: str | None = None,
    ) -> None:
        problems = [
            count_problem("flush_every", flush_every),
            None if histogram_every is None else count_problem("histogram_every", histogram_every),
            None
            if model is None or isinstance(model, nn.Module)
            else f"model must be a torch.nn.Module or None; got {type(model).__name__}",
            None
            if start_step is None
            or (isinstance(start_step, int) and not isinstance(start_step, bool) and start_step >= 0)
            else f"start_step must be None or an integer >= 0; got {start_step!r}",
            None if isinstance(append, bool) else f"append must be True or False; got {append!r}",
            None
            if model_format is None or model_format in formats.names()
            else f"model_format must be None or one of {', '.join(formats.names())}; got {model_format!r}",
            None
            if isinstance(file, (str, os.PathLike)) or hasattr(file, "write")
            else f"file must be a path or a binary file object; got {type(file).__name__}",
        ]
        for problem in problems:
            if problem is not None:
                raise ValueError(problem)
        if not scaler.is_enabled():
            raise ValueError("the scaler is disabled (or its mode is no scaling): there is no loss scale to record")
        if (recorder := recording(scaler)) is not None:
            raise ValueError(f"this scaler is already recording into {recorder.name}; close() that first")
        if append and isinstance(file, (str, os.PathLike)):
            start_step = _appended_start(file, start_step)
        elif start_step is None:
            start_step = 0
        self.flush_every, self.histogram_every = flush_every, histogram_every
        self._scaler_ref = weakref.ref(scaler)
        self.name: str = str(getattr(file, "name", file))
        if isinstance(file, (str, os.PathLike)):
            self._file: IO[bytes] = open(file, "ab" if append else "wb")  # noqa: SIM115  # closed by close()
            self._owns_file = True
        else:
            self._file, self._owns_file = file, False
        self.steps = start_step  # the last step recorded
        self._row = 0
        self._rows: torch.Tensor | None = None  # [flush_every, _COLUMNS] on the scale's device
        self._histograms: dict[int, torch.Tensor] = {}  # row -> counts per exponent field
        self._pending: _Pending | None = None  # copied to the host asynchronously, written at the next flush
        self._closed = False
        self._modules = _ModuleHooks(self, model, model_format) if model is not None else None
        settings = scaler.settings
        header = {
            "format": TRACE_FORMAT,
            "version": TRACE_VERSION,
            "dls_version": _dls_version(),
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "start_step": start_step,
            "settings": {f: getattr(settings, f) for f in settings.__dataclass_fields__},
            "state": {k: v for k, v in scaler.state_dict().items() if k in STATE_FIELDS},
            "histogram_every": histogram_every,
            "modules": [] if self._modules is None else self._modules.names,
        }
        self._write([header])
        _RECORDING[scaler] = self
        self._observation = scaler.observe(self)

    # ------------------------------------------------------------------ what it observes (dls.scaler.StepObserver)
    wants_outcome = False  # nothing is read back: the flag goes into the trace as a device tensor

    def loss_scaled(self, outputs: Any) -> None:
        """Nothing to do: the trace has one row per rule step.

        Args:
            outputs: what ``scale()`` was given.
        """

    def step_decided(self, optimizer: torch.optim.Optimizer, skipped: bool | None) -> None:
        """Nothing to do: the trace has one row per rule step.

        Args:
            optimizer: the optimizer stepped.
            skipped: whether its step was skipped (``None``: not read).
        """

    def iteration_ended(self) -> None:
        """Nothing to do: the row was written before the rule ran."""

    def before_rule(self, found_inf: torch.Tensor, gradients: Callable[[], kernels.Groups]) -> None:
        """Called by ``GradScaler`` right before its rule updates the scale: one row of the trace.

        Args:
            found_inf: the iteration's overflow flag (a device tensor; not read here).
            gradients: groups the iteration's unscaled gradients.
        """
        scaler = self._scaler_ref()
        if scaler is None or self._closed:
            return
        scale = scaler.get_scale_tensor()
        device = scale.device
        if self._rows is None or self._rows.device != device:
            self._flush_async()
            self._rows = torch.empty((self.flush_every, _COLUMNS), dtype=torch.float32, device=device)
            self._nan = torch.full((), math.nan, device=device)
        groups = gradients()
        amax, amax16 = _largest_magnitudes(groups, device, self._nan)
        values = [scale, found_inf.to(device, torch.float32), amax, amax16]
        torch.stack(values, out=self._rows[self._row])
        if self._modules is not None:
            self._modules.end_step()
        self.steps += 1
        if self.histogram_every is not None and self.steps % self.histogram_every == 0:
            self._histograms[self._row] = _exponent_counts(groups, device)
        self._row += 1
        if self._row == self.flush_every:
            self._flush_async()

    # ------------------------------------------------------------------ writing
    def flush(self) -> None:
        """Write every step recorded so far (on CUDA this waits for the device: not for every step; the recorder
        itself writes every ``flush_every`` steps without waiting)."""
        self._flush_async()
        if self._pending is not None:
            self._write(self._pending.lines())
            self._pending = None

    def _flush_async(self) -> None:
        """Start copying the buffered rows to the host; write the rows of the previous flush (no host
        synchronisation on CUDA: the copy of this flush is written at the next one, or at ``flush``)."""
        previous, self._pending = self._pending, None
        if self._row and self._rows is not None:
            modules = None if self._modules is None else self._modules.take(self._row, self._rows.device)
            self._pending = _Pending.start(
                self._rows[: self._row], self._histograms, modules, first_step=self.steps - self._row + 1
            )
            self._row, self._histograms = 0, {}
        if previous is not None:
            self._write(previous.lines())

    def close(self) -> None:
        """Write everything buffered, remove the model hooks, stop recording (safe to call again)."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            if self._modules is not None:
                self._modules.remove()
            self._observation.remove()
            scaler = self._scaler_ref()
            if scaler is not None and _RECORDING.get(scaler) is self:
                del _RECORDING[scaler]
            if self._owns_file:
                self._file.close()

    def _write(self, records: list[dict[str, Any]]) -> None:
        if records:
            self._file.write("".join(json.dumps(r, allow_nan=False) + "\n" for r in records).encode())
            self._file.flush()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Within it, the model hooks measure nothing (a backward pass that is not the step's, e.g. a probe)."""
        if self._modules is None:
            yield
            return
        before, self._modules.paused = self._modules.paused, True
        try:
            yield
        finally:
            self._modules.paused = before

    @property
    def current_row(self) -> int:
        """The buffer row of the step being computed (where the model hooks write)."""
        return self._row

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.steps} steps"
        return f"Recorder({self.name!r}, {state})"


# The recorder of each scaler while it records (one at a time).
_RECORDING: weakref.WeakKeyDictionary[GradScaler, Recorder] = weakref.WeakKeyDictionary()


def recording(scaler: GradScaler) -> Recorder | None:
    """The recorder recording ``scaler`` now, or ``None``.

    Args:
        scaler: a ``dls.GradScaler``.
    """
    return _RECORDING.get(scaler)


def _appended_start(path: str | os.PathLike[str], start_step: int | None) -> int:
    """The ``start_step`` of a segment appended to the trace at ``path``: at or after its last step (``None``: that
    step; a missing or empty file: 0). Read as ``read_trace`` reads it; a file it refuses is a ``ValueError``."""
    if not os.path.exists(path) or (os.path.isfile(path) and os.path.getsize(path) == 0):
        return 0 if start_step is None else start_step
    try:
        trace = read_trace(path)
    except TraceError as exc:
        raise ValueError(f"append=True: {exc}") from None
    last = trace.segments[-1].steps[-1]["step"] if trace.segments[-1].steps else trace.segments[-1].header["start_step"]
    if start_step is None:
        return int(last)
    if start_step < last:
        raise ValueError(
            f"start_step {start_step} comes before step {last}, the last one of {os.fspath(path)}: a segment appended "
            f"continues the trace at or after its last step (start_step={last}, or leave it out)"
        )
    return start_step


def _dls_version() -> str:
    import dls

    return dls.__version__


# ---------------------------------------------------------------------------------------------------- the statistics
def _largest_magnitudes(
    groups: kernels.Groups, home: torch.device, nan: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The largest ``|g|`` over all gradients and over the float16 ones (``nan`` where none), float32 on ``home``:
    one read pass on accelerators; on a CPU two reads and two in-place negations (exact: see the module
    docstring)."""
    found: list[torch.Tensor] = []
    half: list[torch.Tensor] = []
    with torch.no_grad():
        for (device, dtype), all_grads in groups.items():
            grads = [g for g in all_grads if g.numel()]
            if not grads:
                continue
            if device.type == "cpu":
                top = torch._foreach_max(grads)
                torch._foreach_neg_(grads)
                bottom = torch._foreach_max(grads)
                torch._foreach_neg_(grads)
                largest = torch.stack(top + bottom).max().float()
            else:
                largest = torch.stack(torch._foreach_norm(grads, math.inf)).max().float()
            largest = largest.to(home, non_blocking=True)
            found.append(largest)
            if dtype == torch.float16:
                half.append(largest)
    return (kernels.max_flag(found) if found else nan), (kernels.max_flag(half) if half else nan)


def _exponent_counts(groups: kernels.Groups, home: torch.device) -> torch.Tensor:
    """Counts per float32 exponent field (256, int64, on ``home``) of every gradient value: one pass per tensor."""
    total = torch.zeros(256, dtype=torch.int64, device=home)
    with torch.no_grad():
        for (device, _dtype), grads in groups.items():
            counts = torch.zeros(256, dtype=torch.int64, device=device)
            for g in grads:
                if not g.numel():
                    continue
                bits = (g if g.dtype == torch.float32 else g.float()).reshape(-1).view(torch.int32)
                fields = torch.bitwise_and(torch.bitwise_right_shift(bits, 23), 0xFF)
                counts += torch.bincount(fields, minlength=256)
            total += counts.to(home, non_blocking=True)
    return total


class _ModuleHooks:
    """Every tensor flowing backward through a model's modules, measured: a forward hook on each module walks the
    autograd nodes its forward pass created (those not yet claimed by a module that ran before it, submodules
    first) and puts a pre-hook on each, which keeps the largest ``|grad|`` the node receives as a fraction of its
    format's largest finite value, per module, in the recorder's current row (max over the step). Parameters'
    ``AccumulateGrad`` nodes live across steps and are left out (their gradients are ``grad_amax``). The pre-hooks
    are removed at the step's end (``end_step``)."""

    def __init__(self, recorder: Recorder, model: nn.Module, model_format: str | None) -> None:
        self._recorder = recorder
        named = list(unwrap(model).named_modules())
        self.names = [name for name, _ in named]
        # The largest finite value of float32 tensors, when they stand for another format (dls.emulate).
        self._float32_max = None if model_format is None else formats.get(model_format).max
        self._buffer: torch.Tensor | None = None  # [flush_every, modules]; -1: nothing seen yet
        self._claimed: set[int] = set()  # ids of the nodes hooked in this step ...
        self._nodes: list[Any] = []  # ... kept alive until its end, so that no id is reused within it
        self._step_handles: list[Any] = []
        self.paused = False
        self._handles = [module.register_forward_hook(self._forward_hook(j)) for j, (_, module) in enumerate(named)]

    def _forward_hook(self, j: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self.paused or not torch.is_grad_enabled():
                return
            stack = [t.grad_fn for t in _tensors(output) if t.grad_fn is not None]
            if stack:
                self._claim(stack, self._node_hook(j))

        return hook

    def _claim(self, stack: list[Any], node_hook: Any) -> None:
        claimed = self._claimed
        while stack:
            node = stack.pop()
            if node is None or id(node) in claimed:
                continue
            claimed.add(id(node))
            self._nodes.append(node)
            if type(node).__name__ == "AccumulateGrad":
                continue
            self._step_handles.append(node.register_prehook(node_hook))
            stack.extend(next_node for next_node, _ in node.next_functions)

    def _node_hook(self, j: int) -> Any:
        def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
            for grad in grad_outputs:
                if grad is not None and grad.is_floating_point() and grad.numel() and not self._recorder._closed:
                    self._measure(j, grad)

        return hook

    def _measure(self, j: int, grad: torch.Tensor) -> None:
        buffer = self._buffer
        if buffer is None or buffer.device != grad.device:
            buffer = self._buffer = torch.full(
                (self._recorder.flush_every, len(self.names)), -1.0, dtype=torch.float32, device=grad.device
            )
        with torch.no_grad():
            g = grad.detach()
            if g.device.type == "cpu":  # torch's max-abs norm is a scalar loop on CPU
                low, high = torch.aminmax(g)
                amax = torch.maximum(high, -low).float()
            else:
                amax = torch.linalg.vector_norm(g, math.inf).float()
            largest = self._float32_max if self._float32_max and g.dtype == torch.float32 else torch.finfo(g.dtype).max
            slot = buffer[self._recorder.current_row, j]
            torch.maximum(slot, amax * (1.0 / largest), out=slot)

    def end_step(self) -> None:
        """The step's backward is over: its pre-hooks go, its nodes may be freed."""
        for handle in self._step_handles:
            handle.remove()
        self._step_handles.clear()
        self._claimed.clear()
        self._nodes.clear()

    def take(self, rows: int, device: torch.device) -> torch.Tensor:
        """The first ``rows`` rows (a copy; -1 where nothing was measured) and a fresh buffer."""
        if self._buffer is None:
            return torch.full((rows, len(self.names)), -1.0, device=device)
        taken = self._buffer[:rows].clone()
        self._buffer.fill_(-1.0)
        return taken

    def remove(self) -> None:
        self.end_step()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


@dataclass
class _Pending:
    """Rows on their way to the host: device → host copies started, an event behind them on CUDA."""

    rows: torch.Tensor
    histograms: dict[int, torch.Tensor]
    modules: torch.Tensor | None
    first_step: int
    event: Any = None

    @classmethod
    def start(
        cls, rows: torch.Tensor, histograms: dict[int, torch.Tensor], modules: torch.Tensor | None, first_step: int
    ) -> _Pending:
        def host(t: torch.Tensor) -> torch.Tensor:
            if t.device.type != "cuda":
                return t.clone() if t.device.type == "cpu" else t.cpu()
            copy = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            copy.copy_(t, non_blocking=True)
            return copy

        pending = cls(
            host(rows),
            {r: host(h) for r, h in histograms.items()},
            None if modules is None else host(modules),
            first_step,
        )
        if rows.device.type == "cuda":
            pending.event = torch.cuda.Event()
            pending.event.record()
        return pending

    def lines(self) -> list[dict[str, Any]]:
        if self.event is not None:
            self.event.synchronize()
        out = []
        modules = None if self.modules is None else self.modules.tolist()
        for r, (scale, flag, amax, amax16) in enumerate(self.rows.tolist()):
            overflow = flag > 0
            row: dict[str, Any] = {"step": self.first_step + r, "scale": scale, "overflow": overflow}
            row["grad_amax"] = None if overflow or not math.isfinite(amax) else amax
            if not math.isnan(amax16):
                row["grad_amax_float16"] = None if overflow or not math.isfinite(amax16) else amax16
            if r in self.histograms:
                row["exponents"] = _histogram_record(self.histograms[r].tolist())
            if modules is not None:
                row["module_overflow_scale"] = [scale / f if 0 < f < math.inf else None for f in modules[r]]
            out.append(row)
        return out


def _histogram_record(counts: list[int]) -> dict[str, Any]:
    """The normal binades' counts (fields 1..254) as ``{"min": exponent, "counts": [...]}``, trimmed of empty ends."""
    normal = counts[1:255]
    used = [i for i, c in enumerate(normal) if c]
    if not used:
        return {"min": 0, "counts": []}
    lo, hi = used[0], used[-1]
    return {"min": lo + 1 - _EXPONENT_BIAS, "counts": normal[lo : hi + 1]}
