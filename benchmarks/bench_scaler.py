"""Unscale + inf/NaN check: dls vs ``torch.amp.GradScaler`` vs the bandwidth floor, every figure a ratio.

For each size (total gradient elements), tensor count and gradient dtype, one run times, interleaved in the
same loop (in a fresh random order every repetition, so drift and cache effects fall on all methods alike):

* ``dls``    -- ``dls.GradScaler("cpu" or "cuda", ...).unscale_(opt)`` (torch.amp's arguments and defaults): one
  fused read+write pass that unscales and raises the overflow flag;
* ``torch``  -- ``torch.amp.GradScaler.unscale_(opt)`` with the same arguments (for float16 gradients, which its
  public ``unscale_`` refuses, the same code path with ``allow_fp16=True``);
* ``floor``  -- ``torch._foreach_mul_(grads, inv_scale)`` over the same tensors: one read+write pass, nothing
  else, the least any unscale can cost;
* ``kernel`` -- ``torch._amp_foreach_non_finite_check_and_unscale_`` alone on the ready-made list (the kernel
  both scalers call): ``kernel/floor`` is the price of torch's AMP kernel itself, ``dls/kernel`` that of dls's
  host code around it.

Before every timed call the gradients are restored from a master copy (untimed), so every method sees the same
scaled values (scale 2**15); after it the scaler's iteration is closed with ``update()`` and the scale read back
(untimed). The read keeps dls's host-side lower bound of the scale exact, so every timed ``unscale_`` here is the
one-pass case (bound >= 1); the extra check pass dls runs while the bound is below 1 is measured on its own by
``bench_scale_below_one.py``.

A second table times the inf check that precedes the step of an optimizer that unscales inside its own kernel
(``step()`` on torch's ``fused=True`` Adam/AdamW/SGD/Adagrad): dls's ``GradScaler._check_scaled`` (the call
``step()`` makes, scale bound >= 1) against torch's ``_check_inf_per_device`` (a read+write multiply by one) and
the floor.

Reading the tables: every ratio is the median over repetitions of ``time(A) / time(B)``, both measured in the
same round of the same run (``[iqr]``: 25th and 75th percentiles). Absolute times are for orientation only. A
target column names the ratio's goal: ``dls/torch <= 1.05`` (dls costs at most 5 % more than torch's scaler on the
same work) and ``dls/floor <= 1.2`` (within 20 % of one bare read+write pass). ``ok`` means the ratio measured
in this run is at or below the target; ``MISS`` means it is above it in this run (on a shared machine, ratios
within a few % of a target can fall either way from run to run: compare with the noise noted in RESULTS.md).

    python benchmarks/bench_scaler.py                 # 1M, 10M, 100M elements; float32, bfloat16, float16
    python benchmarks/bench_scaler.py --quick         # 1M and 10M, float32 only: seconds
    python benchmarks/bench_scaler.py --smoke         # 64k elements, 2 repetitions: runs, nothing to read
    python benchmarks/bench_scaler.py --sizes 1e6 1e7 1e8 --dtypes float32 bfloat16 float16 --device cuda

The other scripts of this directory import the timing helpers below.
"""

from __future__ import annotations

import argparse
import atexit
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import dls

SCALE = 2.0**15
GRAD_STD = 2.0**-10  # unscaled gradient entries are N(0, GRAD_STD**2); scaled ones stay far from fp16 max
NO_GROWTH = 10**9  # growth interval that never fires during a benchmark, so the scale stays put
CLOCK = "wall"  # set by setup()
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---------------------------------------------------------------------------------------------- shared helpers
def add_common_args(parser: argparse.ArgumentParser, reps: int, warmup: int) -> None:
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1, ...")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: on a small shared machine, a second OpenMP thread that is "
        "descheduled stalls every parallel region and dominates the noise)",
    )
    parser.add_argument(
        "--clock",
        choices=["auto", "wall", "thread"],
        default="auto",
        help="CPU timing clock: 'thread' = CPU time of the calling thread (not advanced while another process "
        "holds the core; valid with --threads 1, where all of torch's CPU work runs on the calling thread), "
        "'wall' = perf_counter; auto (default): thread with --threads 1 on CPU, else wall. CUDA: events",
    )
    parser.add_argument("--reps", type=int, default=reps, help=f"timed repetitions per method (default {reps})")
    parser.add_argument("--warmup", type=int, default=warmup, help=f"untimed repetitions first (default {warmup})")
    parser.add_argument("--seed", type=int, default=0)


def add_smoke_arg(parser: argparse.ArgumentParser) -> None:
    """``--smoke``: the smallest sizes and two repetitions, so that every code path and table of the script runs in
    seconds (``make bench-smoke``, part of ``make test``); its figures mean nothing."""
    parser.add_argument(
        "--smoke", action="store_true", help="smallest sizes, 2 repetitions: checks that the script runs (seconds)"
    )


def load_average() -> str:
    """The 1, 5 and 15 minute load averages of the machine (other users' work included)."""
    if not hasattr(os, "getloadavg"):
        return "n/a"
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def _report_end(started: float) -> None:
    elapsed = time.perf_counter() - started
    print(f"\nwall time {elapsed:.0f} s; load average (1, 5, 15 min) at the end: {load_average()}")


def setup(args: argparse.Namespace) -> torch.device:
    """Apply the common arguments; at exit, print the wall time and the load average (noise context)."""
    atexit.register(_report_end, time.perf_counter())
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda asked for, but torch.cuda.is_available() is False")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    global CLOCK
    if device.type == "cpu":
        CLOCK = args.clock if args.clock != "auto" else ("thread" if args.threads == 1 else "wall")
    else:
        CLOCK = "cuda events"
    return device


def describe(device: torch.device, threads: int) -> str:
    if device.type == "cuda":
        where = f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"
    else:
        where = f"{platform.processor() or platform.machine()} CPU, {threads} torch thread(s)"
    return (
        f"torch {torch.__version__}, Python {platform.python_version()}, {where}; clock: {CLOCK}; "
        f"load average (1, 5, 15 min) at the start: {load_average()}"
    )


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Stopwatch:
    """Times one call. CPU: ``CLOCK`` (thread CPU time or wall clock). CUDA: the device is synchronised before
    the start event (so queued work of the untimed preparation does not hide the call's launch overhead), then
    events around the call."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pending: list[tuple[Any, Any, list[float], int]] = []

    def time(self, fn: Callable[[], object], out: list[float]) -> None:
        synchronize(self.device)
        if self.device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            out.append(float("nan"))
            self._pending.append((start, end, out, len(out) - 1))
        else:
            clock = time.thread_time if CLOCK == "thread" else time.perf_counter
            t0 = clock()
            fn()
            out.append(clock() - t0)

    def resolve(self) -> None:
        synchronize(self.device)
        for start, end, out, index in self._pending:
            out[index] = start.elapsed_time(end) / 1e3
        self._pending.clear()


@dataclass
class Case:
    """One method of an interleaved measurement: ``prep`` (untimed), ``run`` (timed), ``reset`` (untimed)."""

    run: Callable[[], object]
    prep: Callable[[], object] = lambda: None
    reset: Callable[[], object] = lambda: None
    times: list[float] = field(default_factory=list)


def interleave(cases: dict[str, Case], device: torch.device, reps: int, warmup: int) -> dict[str, list[float]]:
    """Run every case ``warmup`` times untimed, then ``reps`` times timed, all in one loop, in a new (seeded)
    random order each repetition, so that no case always runs right after the same other one. Returns seconds
    per case and repetition."""
    watch = Stopwatch(device)
    shuffler = random.Random(0)
    for rep in range(warmup + reps):
        order = list(cases)
        shuffler.shuffle(order)
        for name in order:
            case = cases[name]
            case.prep()
            if rep < warmup:
                synchronize(device)
                case.run()
            else:
                watch.time(case.run, case.times)
            case.reset()
    watch.resolve()
    return {name: case.times for name, case in cases.items()}


def ratio(times: dict[str, list[float]], num: str, den: str) -> float:
    """Median over repetitions of ``times[num][r] / times[den][r]`` (paired: both measured in the same round)."""
    return statistics.median(a / b for a, b in zip(times[num], times[den]))


def spread(times: dict[str, list[float]], num: str, den: str) -> tuple[float, float]:
    """25th and 75th percentiles of the paired ratio."""
    values = sorted(a / b for a, b in zip(times[num], times[den]))
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return q[0], q[2]


def median_ms(values: Sequence[float]) -> float:
    return statistics.median(values) * 1e3


def verdict(value: float, target: float) -> str:
    """``ok``: the ratio measured in this run is at or below its target; ``MISS``: above it in this run."""
    return "ok" if value <= target else "MISS"


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    print(f"\n{title}")
    print("  ".join(str(h).rjust(w) for h, w in zip(header, widths)))
    for row in rows:
        print("  ".join(str(c).rjust(w) for c, w in zip(row, widths)))
    sys.stdout.flush()


def human(n: int) -> str:
    for unit, div in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


# ---------------------------------------------------------------------------------------------- this benchmark
def make_grads(numel: int, count: int, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """``count`` gradients of (nearly) equal size adding up to ``numel`` elements: ``N(0, GRAD_STD**2)`` entries
    times ``SCALE`` (at most ~2**11 in magnitude: inside float16's range, no overflow)."""
    base, extra = divmod(numel, count)
    sizes = [base + (i < extra) for i in range(count)]
    gen = torch.Generator(device="cpu").manual_seed(count)
    chunk = torch.randn(min(numel, 1 << 20), generator=gen) * (GRAD_STD * SCALE)
    grads = []
    for size in sizes:
        g = torch.empty(size, dtype=dtype, device=device)
        # Fill from a repeated random chunk: randn over 100M elements would dominate the benchmark's run time.
        filled = 0
        while filled < size:
            n = min(size - filled, chunk.numel())
            g[filled : filled + n].copy_(chunk[:n])
            filled += n
        grads.append(g)
    return grads


def restorable_grads(
    numel: int, count: int, dtype: torch.dtype, device: torch.device
) -> tuple[list[torch.Tensor], torch.optim.Optimizer, Callable[[], None]]:
    """``make_grads``'s gradients, ``make_optimizer``'s optimizer over them, and ``restore``: copies them back from a
    master copy, a ``Case``'s untimed ``prep`` for methods that change them in place (every call sees the same)."""
    grads = make_grads(numel, count, dtype, device)
    master = [g.clone() for g in grads]

    def restore() -> None:
        torch._foreach_copy_(grads, master)

    return grads, make_optimizer(grads), restore


def make_optimizer(grads: list[torch.Tensor]) -> torch.optim.Optimizer:
    # torch.empty parameters: never touched, so never backed by memory on CPU (only .grad is read).
    params = [torch.nn.Parameter(torch.empty_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g
    return torch.optim.SGD(params, lr=0.0)


def torch_unscale_(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, allow_fp16: bool) -> None:
    """``torch.amp.GradScaler.unscale_``; with ``allow_fp16`` its body with the float16 refusal lifted."""
    if not allow_fp16:
        scaler.unscale_(optimizer)
        return
    from torch.amp.grad_scaler import OptState

    state = scaler._per_optimizer_states[id(optimizer)]
    assert scaler._scale is not None
    inv_scale = scaler._scale.double().reciprocal().float()
    found_inf = torch.full((), 0.0, dtype=torch.float32, device=scaler._scale.device)
    state["found_inf_per_device"] = scaler._unscale_grads_(optimizer, inv_scale, found_inf, True)
    state["stage"] = OptState.UNSCALED


def scalers(
    device: torch.device, scale: float = SCALE, **dls_options: Any
) -> tuple[dls.GradScaler, torch.amp.GradScaler]:
    """A dls and a torch scaler with the same arguments (dls takes torch.amp's dialect when given a device), the
    scale already on ``device``; ``dls_options`` go to dls's only (``max_gradient_norm=...``)."""
    ours = dls.GradScaler(device.type, init_scale=scale, growth_interval=NO_GROWTH, **dls_options)
    theirs = torch.amp.GradScaler(device.type, init_scale=scale, growth_interval=NO_GROWTH)
    probe = torch.ones((), device=device)
    ours.scale(probe)  # moves the scale to the device
    theirs.scale(probe)  # creates torch's lazily made scale tensor
    return ours, theirs


def close_iteration(scaler: dls.GradScaler) -> None:
    """``update()``, then read the scale (untimed): the read makes dls's host-side bound of the scale exact again.

    Without it the bound halves at every ``update()`` (the host cannot know whether the device backed off), and
    after log2(scale) + 1 iterations without a read it falls below 1, where ``unscale_`` adds a check pass. The
    default ``step()`` path refreshes the bound by itself once it falls below 1; ``bench_scale_below_one.py``
    measures that pass and how often each path runs it.
    """
    scaler.update()
    scaler.get_scale()


def bench_unscale(
    numel: int, count: int, dtype: torch.dtype, device: torch.device, reps: int, warmup: int
) -> dict[str, list[float]]:
    grads, opt, restore = restorable_grads(numel, count, dtype, device)
    ours, theirs = scalers(device)
    inv_scale = torch.tensor(1.0 / SCALE, device=device)
    found = torch.zeros((), device=device)
    cases = {
        "dls": Case(run=lambda: ours.unscale_(opt), prep=restore, reset=lambda: close_iteration(ours)),
        "torch": Case(
            run=lambda: torch_unscale_(theirs, opt, dtype == torch.float16), prep=restore, reset=theirs.update
        ),
        "floor": Case(run=lambda: torch._foreach_mul_(grads, inv_scale), prep=restore),
        # torch's AMP kernel alone, on the ready-made list: what dls and torch both call, minus their host code.
        "kernel": Case(run=lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale)),
    }
    cases["kernel"].prep = restore
    times = interleave(cases, device, reps, warmup)
    assert ours.get_num_skipped_steps() == 0, "benchmark gradients overflowed"
    return times


def fused_step_check(scaler: dls.GradScaler, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """The overflow check ``scaler.step(optimizer)`` runs before the step of an optimizer that unscales inside its
    own kernel (``GradScaler._step_fused``): a read of the still-scaled gradients, nothing written. It neither
    changes the scale nor its host bound, so it can be repeated without closing the iteration."""
    return scaler._check_scaled(optimizer, scaler._tracker.progress(optimizer))


def bench_check(
    numel: int, count: int, dtype: torch.dtype, device: torch.device, reps: int, warmup: int
) -> dict[str, list[float]]:
    """Inf check before a fused optimizer step: what each scaler does when ``step()`` finds the optimizer READY.
    dls: ``GradScaler._check_scaled`` at scale 2**15 (bound exact); torch: ``_check_inf_per_device``."""
    grads = make_grads(numel, count, dtype, device)
    opt = make_optimizer(grads)
    ours, theirs = scalers(device)
    one = torch.ones((), device=device)
    cases = {
        "dls": Case(run=lambda: fused_step_check(ours, opt)),
        "torch": Case(run=lambda: theirs._check_inf_per_device(opt)),
        "floor": Case(run=lambda: torch._foreach_mul_(grads, one)),
    }
    times = interleave(cases, device, reps, warmup)
    assert not ours._scale.known.scale_may_be_below_one(), "the check ran in the scale-below-1 case"
    return times


def reps_for(numel: int, reps: int | None) -> tuple[int, int]:
    if reps is not None:
        return reps, 2
    return (11, 2) if numel >= 50_000_000 else (21, 3)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, reps=0, warmup=0)
    parser.set_defaults(reps=None, warmup=None)
    parser.add_argument("--sizes", type=float, nargs="+", help="total gradient elements (default 1e6 1e7 1e8)")
    parser.add_argument("--tensors", type=int, nargs="+", default=[10, 100, 1000], help="tensor counts")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), help="gradient dtypes (default all three)")
    parser.add_argument("--quick", action="store_true", help="1M and 10M elements, float32 only")
    parser.add_argument("--no-check-table", action="store_true", help="skip the fused-optimizer inf-check table")
    add_smoke_arg(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.sizes, args.tensors, args.reps, args.warmup = [2**16], [10, 100], 2, 1
    device = setup(args)
    sizes = [int(s) for s in (args.sizes or ([1e6, 1e7] if args.quick else [1e6, 1e7, 1e8]))]
    dtypes = args.dtypes or (["float32"] if args.quick else list(DTYPES))

    print(f"bench_scaler: {describe(device, args.threads)}")
    print("ratios: median over repetitions of (time of A / time of B) measured in the same round; [25%, 75%]")
    header = ["dtype", "elements", "tensors", "dls ms", "torch ms", "floor ms", "floor GB/s"]
    header += ["dls/torch", "[iqr]", "<=1.05", "dls/floor", "[iqr]", "<=1.2", "kernel/floor", "dls/kernel"]
    rows = []
    misses = bound_rows = bound_misses = 0
    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        for numel in sizes:
            for count in args.tensors:
                reps, warmup = reps_for(numel, args.reps)
                t = bench_unscale(numel, count, dtype, device, reps, args.warmup or warmup)
                r_torch, r_floor = ratio(t, "dls", "torch"), ratio(t, "dls", "floor")
                lo_t, hi_t = spread(t, "dls", "torch")
                lo_f, hi_f = spread(t, "dls", "floor")
                moved = 2 * numel * dtype.itemsize / statistics.median(t["floor"]) / 1e9
                ok_t, ok_f = verdict(r_torch, 1.05), verdict(r_floor, 1.2)
                missed = (ok_t != "ok") + (ok_f != "ok")
                misses += missed
                if dtype == torch.float32 and numel >= 10_000_000:
                    bound_rows += 1
                    bound_misses += missed
                rows.append(
                    [
                        dtype_name,
                        human(numel),
                        count,
                        f"{median_ms(t['dls']):.2f}",
                        f"{median_ms(t['torch']):.2f}",
                        f"{median_ms(t['floor']):.2f}",
                        f"{moved:.0f}",
                        f"{r_torch:.3f}",
                        f"[{lo_t:.2f},{hi_t:.2f}]",
                        ok_t,
                        f"{r_floor:.3f}",
                        f"[{lo_f:.2f},{hi_f:.2f}]",
                        ok_f,
                        f"{ratio(t, 'kernel', 'floor'):.3f}",
                        f"{ratio(t, 'dls', 'kernel'):.3f}",
                    ]
                )
                print(f"  ... {dtype_name} {human(numel)} x{count}: dls/torch {r_torch:.3f}, dls/floor {r_floor:.3f}")
                del t
    title = "unscale_ + inf/NaN check: dls vs torch (target <= 1.05) and vs the bandwidth floor (<= 1.2)"
    print_table(title, header, rows)
    print(
        f"float32 rows of >= 10M elements (bandwidth-bound): {bound_misses} of {2 * bound_rows} targets missed "
        "in this run"
    )
    print(f"all rows: {misses} of {2 * len(rows)} targets missed in this run")

    if not args.no_check_table:
        rows = []
        for numel in sizes:
            for count in args.tensors:
                reps, warmup = reps_for(numel, args.reps)
                t = bench_check(numel, count, torch.float32, device, reps, args.warmup or warmup)
                rows.append(
                    [
                        "float32",
                        human(numel),
                        count,
                        f"{median_ms(t['dls']):.2f}",
                        f"{median_ms(t['torch']):.2f}",
                        f"{median_ms(t['floor']):.2f}",
                        f"{ratio(t, 'dls', 'torch'):.3f}",
                        f"{ratio(t, 'dls', 'floor'):.3f}",
                    ]
                )
        print_table(
            "inf check before a fused optimizer step (dls: check_scaled, read only; torch: multiply by 1, read+write)",
            ["dtype", "elements", "tensors", "dls ms", "torch ms", "floor ms", "dls/torch", "dls/floor"],
            rows,
        )


if __name__ == "__main__":
    main()
