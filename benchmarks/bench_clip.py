"""Loss scaling + gradient clipping: dls's fused path vs torch's ``unscale_`` + ``clip_grad_norm_``.

Methods, timed interleaved in one loop (in a random order each repetition), gradients restored from a master copy
before each call (untimed) and the scaler's iteration closed with ``update()`` after it (untimed):

* ``dls``   -- ``dls.GradScaler(device, ..., max_gradient_norm=...).clip_gradients_and_return_isfinite(opt)``: one
  read for the norm of the still-scaled gradients, one read+write multiplying by ``clip_coef / scale`` (3 passes);
* ``torch`` -- ``torch.amp.GradScaler.unscale_(opt)`` then ``torch.nn.utils.clip_grad_norm_(params, max_norm)``
  (foreach, as torch picks on CPU and CUDA): read+write, read, read+write (5 passes);
* ``floor`` -- ``torch._foreach_norm`` then ``torch._foreach_mul_`` by a device scalar: the two bare passes
  dls's clip cannot do without.

Both scalers take the same arguments (scale 2**15, no growth). The gradients are big enough (scaled norm / scale
> max_norm) that the clip is active. With a clip limit far below the dtype's largest value, a finite norm bounds
every clipped element, so dls adds no check pass whatever its bound of the scale.

Target: ``dls/torch <= 0.7`` (three passes instead of five should cost at most 70 % of torch's unscale + clip).
Every ratio is the median over repetitions of ``time(A) / time(B)`` measured in the same round of one run
(``[iqr]``: 25th and 75th percentiles). ``ok``: the ratio measured in this run is at or below the target;
``MISS``: above it in this run.

    python benchmarks/bench_clip.py            # 10M and 100M float32 elements in 10, 100, 1000 tensors
    python benchmarks/bench_clip.py --quick    # 1M and 10M
    python benchmarks/bench_clip.py --smoke    # 64k elements, 2 repetitions: runs, nothing to read
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence

import torch
from bench_scaler import (
    DTYPES,
    GRAD_STD,
    Case,
    add_common_args,
    add_smoke_arg,
    describe,
    human,
    interleave,
    median_ms,
    print_table,
    ratio,
    reps_for,
    restorable_grads,
    scalers,
    setup,
    spread,
    torch_unscale_,
    verdict,
)

TARGET = 0.7
HEADER = ["dtype", "elements", "tensors", "dls ms", "torch ms", "floor ms", "floor GB/s"]


def bench_clip(
    numel: int, count: int, dtype: torch.dtype, device: torch.device, reps: int, warmup: int
) -> dict[str, list[float]]:
    grads, opt, restore = restorable_grads(numel, count, dtype, device)
    params = [p for g in opt.param_groups for p in g["params"]]
    # The norm of the unscaled gradients is about GRAD_STD * sqrt(numel): clip to a tenth of it.
    max_norm = 0.1 * GRAD_STD * numel**0.5
    ours, theirs = scalers(device, max_gradient_norm=max_norm)
    allow_fp16 = dtype == torch.float16

    def torch_clip() -> None:
        torch_unscale_(theirs, opt, allow_fp16)
        torch.nn.utils.clip_grad_norm_(params, max_norm)

    def floor() -> None:
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32)))
        torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))

    cases = {
        "dls": Case(run=lambda: ours.clip_gradients_and_return_isfinite(opt), prep=restore, reset=ours.update),
        "torch": Case(run=torch_clip, prep=restore, reset=theirs.update),
        "floor": Case(run=floor, prep=restore),
    }
    times = interleave(cases, device, reps, warmup)
    assert ours.get_num_skipped_steps() == 0, "benchmark gradients overflowed"
    return times


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, reps=0, warmup=0)
    parser.set_defaults(reps=None, warmup=None)
    parser.add_argument("--sizes", type=float, nargs="+", help="total gradient elements (default 1e7 1e8)")
    parser.add_argument("--tensors", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=["float32"])
    parser.add_argument("--quick", action="store_true", help="1M and 10M elements")
    add_smoke_arg(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.sizes, args.tensors, args.reps, args.warmup = [2**16], [10, 100], 2, 1
    device = setup(args)
    sizes = [int(s) for s in (args.sizes or ([1e6, 1e7] if args.quick else [1e7, 1e8]))]

    print(f"bench_clip: {describe(device, args.threads)}")
    print("ratios: median over repetitions of (time of A / time of B) measured in the same round; [25%, 75%]")
    rows = []
    for dtype_name in args.dtypes:
        for numel in sizes:
            for count in args.tensors:
                reps, warmup = reps_for(numel, args.reps)
                t = bench_clip(numel, count, DTYPES[dtype_name], device, reps, args.warmup or warmup)
                r = ratio(t, "dls", "torch")
                lo, hi = spread(t, "dls", "torch")
                passes = 3 * numel * DTYPES[dtype_name].itemsize / statistics.median(t["floor"]) / 1e9
                rows.append(
                    [
                        dtype_name,
                        human(numel),
                        count,
                        f"{median_ms(t['dls']):.2f}",
                        f"{median_ms(t['torch']):.2f}",
                        f"{median_ms(t['floor']):.2f}",
                        f"{passes:.0f}",
                        f"{r:.3f}",
                        f"[{lo:.2f},{hi:.2f}]",
                        verdict(r, TARGET),
                        f"{ratio(t, 'dls', 'floor'):.3f}",
                    ]
                )
                print(f"  ... {dtype_name} {human(numel)} x{count}: dls/torch {r:.3f}")
    print_table(
        f"unscale + clip to a global L2 norm: dls fused vs torch unscale_ + clip_grad_norm_ (target <= {TARGET})",
        [*HEADER, "dls/torch", "[iqr]", f"<={TARGET}", "dls/floor"],
        rows,
    )


if __name__ == "__main__":
    main()
