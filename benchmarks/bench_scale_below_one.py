"""The price of checking unscaled gradients while the loss scale may be below 1, and how often each path pays it.

Unscaling multiplies by ``1/scale``. While the scale is at least 1 that factor is at most 1, so a finite scaled
gradient stays finite and checking the input (what torch's AMP kernel does) is enough. Below 1 a finite scaled
gradient can overflow once unscaled, so dls also checks the result. The host cannot read the scale without a
device sync, so dls keeps a lower bound of it on the host (``LossScale.known.scale_at_least``: exact after a read,
halved by every ``update()``) and takes the careful form while that bound is below 1:

* ``unscale_`` (and ``step()`` on the default path): one more read pass over the unscaled gradients
  (``kernels.mul_and_check_(..., factor_may_exceed_one=True)``);
* the check before the step of an optimizer that unscales inside its own kernel (torch's ``fused=True`` ones):
  on CPU, the largest ``|g|`` per tensor times ``1/scale`` (``_foreach_abs`` then ``_foreach_max``) instead of
  torch's AMP kernel with a factor of 1; on CUDA the same one read pass either way.

Tables (CPU and CUDA alike, every method of a row timed interleaved in one loop, in a fresh random order per
repetition, gradients restored from one master copy before each call, so every method sees the same tensors):

1. ``unscale_``: ``dls 0.5`` (a ``dls.GradScaler(device, init_scale=0.5)``: two passes) against ``dls 2^10`` (scale
   2**10, bound exact: one pass) and ``torch 0.5`` (``torch.amp.GradScaler(device, init_scale=0.5)``: one pass,
   which does not see a finite gradient that overflows once unscaled). Each scaler's iteration is closed after each
   call with ``update()`` and a read of the scale (untimed), so the bounds stay where they are set.
2. The fused-optimizer check (``GradScaler._check_scaled``, what ``step()`` runs): dls at 0.5 against dls at
   2**10 and torch's ``_check_inf_per_device`` (read+write multiply by one, the same at any scale).
3. How often each ``step()`` path runs the careful form: a loop of ``--steps`` iterations of plain SGD at torch's
   default scale 2**16 without overflow, counting the passes that got ``factor_may_exceed_one=True``. The bound
   halves at every ``update()``: after log2(scale) + 1 updates without a read it is below 1. The default path then
   reads the flag and the scale together (one read, as every step reads the flag), which makes the bound exact
   again: one step in log2(scale) + 1 pays. Paths that never read (fused optimizers, ``sync_free``) pay every step
   from then on, whatever the real scale.

No targets: the ratios are the measurement asked for (``0.5/2^10`` = the extra cost; ``dls/torch`` at 0.5 = the
price of not missing an overflow torch would miss). Every ratio is the median over repetitions of ``time(A) /
time(B)``, both measured in the same round of one run (``[iqr]``: 25th and 75th percentiles).

    python benchmarks/bench_scale_below_one.py             # float32/bfloat16/float16, 1M and 10M, 10/100/1000
    python benchmarks/bench_scale_below_one.py --quick     # float32, 1M and 10M
    python benchmarks/bench_scale_below_one.py --smoke     # 64k elements, 2 repetitions: runs, nothing to read
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from bench_scaler import (
    DTYPES,
    Case,
    add_common_args,
    add_smoke_arg,
    close_iteration,
    describe,
    fused_step_check,
    human,
    interleave,
    make_grads,
    make_optimizer,
    median_ms,
    print_table,
    ratio,
    restorable_grads,
    scalers,
    setup,
    spread,
    torch_unscale_,
)

import dls
from dls import kernels

LOW = 0.5
HIGH = 2.0**10


def bench_unscale(
    numel: int, count: int, dtype: torch.dtype, device: torch.device, reps: int, warmup: int
) -> dict[str, list[float]]:
    # |g| up to ~2**8: finite in every dtype once doubled
    _, opt, restore = restorable_grads(numel, count, dtype, device)
    low, torch_low = scalers(device, LOW)
    high, _ = scalers(device, HIGH)
    allow_fp16 = dtype == torch.float16
    cases = {
        "dls 0.5": Case(run=lambda: low.unscale_(opt), prep=restore, reset=lambda: close_iteration(low)),
        "dls 2^10": Case(run=lambda: high.unscale_(opt), prep=restore, reset=lambda: close_iteration(high)),
        "torch 0.5": Case(run=lambda: torch_unscale_(torch_low, opt, allow_fp16), prep=restore, reset=torch_low.update),
    }
    times = interleave(cases, device, reps, warmup)
    assert low.get_num_skipped_steps() == 0 and high.get_num_skipped_steps() == 0, "benchmark gradients overflowed"
    below = [scaler._scale.known.scale_may_be_below_one() for scaler in (low, high)]
    assert below == [True, False], "a scaler left its case"
    return times


def bench_check(
    numel: int, count: int, dtype: torch.dtype, device: torch.device, reps: int, warmup: int
) -> dict[str, list[float]]:
    grads = make_grads(numel, count, dtype, device)
    opt = make_optimizer(grads)
    low, theirs = scalers(device, LOW)
    high, _ = scalers(device, HIGH)
    cases = {
        "dls 0.5": Case(run=lambda: fused_step_check(low, opt)),
        "dls 2^10": Case(run=lambda: fused_step_check(high, opt)),
        "torch": Case(run=lambda: theirs._check_inf_per_device(opt)),
    }
    times = interleave(cases, device, reps, warmup)
    below = [scaler._scale.known.scale_may_be_below_one() for scaler in (low, high)]
    assert below == [True, False], "a scaler left its case"
    return times


@contextlib.contextmanager
def count_careful_passes(counts: list[int]) -> Iterator[None]:
    """Count the passes that get ``factor_may_exceed_one=True`` (``counts[0]``) and all passes (``counts[1]``)."""
    originals = {name: getattr(kernels, name) for name in ("mul_and_check_", "check_unscaled_")}

    def spy(original: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            careful = kwargs["factor_may_exceed_one"] if "factor_may_exceed_one" in kwargs else args[3]
            counts[0] += bool(careful)
            counts[1] += 1
            return original(*args, **kwargs)

        return wrapper

    for name, original in originals.items():
        setattr(kernels, name, spy(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(kernels, name, original)


def careful_steps(path: str, steps: int, device: torch.device) -> tuple[int, int]:
    """(steps whose overflow check took the scale-below-1 form, steps) for ``steps`` clean iterations on ``path``."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, device=device)) for _ in range(4)]
    opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9, fused=True if path == "fused" else None)
    scaler = dls.GradScaler(device.type, sync_free=path == "sync_free")  # torch's defaults: scale 2**16
    counts = [0, 0]
    with count_careful_passes(counts):
        for _ in range(steps):
            for p in params:
                p.grad = torch.randn_like(p) * scaler.get_scale_tensor()
            scaler.step(opt)
            scaler.update()
    assert counts[1] == steps, f"{path}: expected one overflow pass per step, counted {counts[1]}"
    assert scaler.get_scale() == 2.0**16, f"{path}: the scale moved (overflow in a clean loop?)"
    return counts[0], steps


def ratio_columns(reference: str) -> list[str]:
    return ["0.5/2^10", "[iqr]", f"dls 0.5/{reference}", "[iqr]", f"dls 2^10/{reference}", "[iqr]"]


def row(dtype_name: str, numel: int, count: int, t: dict[str, list[float]], names: Sequence[str]) -> list[str]:
    cells = [dtype_name, human(numel), str(count), *(f"{median_ms(t[n]):.2f}" for n in names)]
    for num, den in (("dls 0.5", "dls 2^10"), ("dls 0.5", names[2]), ("dls 2^10", names[2])):
        lo, hi = spread(t, num, den)
        cells += [f"{ratio(t, num, den):.3f}", f"[{lo:.2f},{hi:.2f}]"]
    return cells


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, reps=31, warmup=3)
    parser.add_argument("--sizes", type=float, nargs="+", help="total gradient elements (default 1e6 1e7)")
    parser.add_argument("--tensors", type=int, nargs="+", default=[10, 100, 1000], help="tensor counts")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), help="gradient dtypes (default all three)")
    parser.add_argument("--steps", type=int, default=200, help="iterations of the step-path count (default 200)")
    parser.add_argument("--quick", action="store_true", help="float32 only")
    add_smoke_arg(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.sizes, args.tensors, args.reps, args.warmup, args.steps = [2**16], [10, 100], 2, 1, 20
    device = setup(args)
    sizes = [int(s) for s in (args.sizes or [1e6, 1e7])]
    dtypes = args.dtypes or (["float32"] if args.quick else list(DTYPES))

    print(f"bench_scale_below_one: {describe(device, args.threads)}")
    print("ratios: median over repetitions of (time of A / time of B) measured in the same round; [25%, 75%]")
    tables: dict[str, list[list[str]]] = {"unscale": [], "check": []}
    for dtype_name in dtypes:
        for numel in sizes:
            for count in args.tensors:
                t = bench_unscale(numel, count, DTYPES[dtype_name], device, args.reps, args.warmup)
                tables["unscale"].append(row(dtype_name, numel, count, t, ["dls 0.5", "dls 2^10", "torch 0.5"]))
                t = bench_check(numel, count, DTYPES[dtype_name], device, args.reps, args.warmup)
                tables["check"].append(row(dtype_name, numel, count, t, ["dls 0.5", "dls 2^10", "torch"]))
                print(f"  ... {dtype_name} {human(numel)} x{count} done")
    base = ["dtype", "elements", "tensors"]
    print_table(
        "1. unscale_ at scale 0.5 (two passes) vs at 2**10 (one pass), and vs torch's unscale_ at 0.5 (one pass)",
        [*base, "dls 0.5 ms", "dls 2^10 ms", "torch 0.5 ms", *ratio_columns("torch 0.5")],
        tables["unscale"],
    )
    print_table(
        "2. check before a fused optimizer's step at scale 0.5 vs 2**10, and vs torch's check (multiply by 1)",
        [*base, "dls 0.5 ms", "dls 2^10 ms", "torch ms", *ratio_columns("torch")],
        tables["check"],
    )
    rows = []
    for path in ("default", "fused", "sync_free"):
        careful, steps = careful_steps(path, args.steps, device)
        rows.append([path, f"{careful} of {steps}", f"{careful / steps:.3f}"])
    print_table(
        f"3. steps whose overflow check took the scale-below-1 form: {args.steps} clean SGD steps at scale 2**16 "
        "(the real scale never below 1)",
        ["step() path", "careful checks", "fraction"],
        rows,
    )


if __name__ == "__main__":
    main()
