"""``FloatFormat.quantize`` throughput relative to torch's own round trip ``x.to(torch.float16).float()``.

For each size, one run times, interleaved in the same loop on the same float32 tensor (uniform random bit
patterns over the normal range of +-2**-40 .. 2**40, so every branch of the rounding is exercised):

* ``cast``                 -- ``x.to(torch.float16).float()``: the baseline, two native cast kernels;
* ``cbfloat16``            -- ``dls.formats.cbfloat16.quantize(x)``: the arithmetic path (no torch dtype);
* ``float16 (arithmetic)`` -- ``dls.formats.float16._quantize_generic(x)``: the same arithmetic for float16,
  which ``quantize`` itself replaces by the native cast;
* ``float16``              -- ``dls.formats.float16.quantize(x)``: the public call (the cast);
* ``float8_e4m3fn``        -- ``dls.formats.float8_e4m3fn.quantize(x)`` (arithmetic; saturating);
* ``count``                -- ``dls.formats.cbfloat16.quantize_and_count(x)``: rounding plus the underflow and
  overflow counts ``dls.emulate`` takes in backward.

Printed: the median per-repetition time ratio ``method / cast`` (lower is better; 1.0 = as fast as the cast),
with the interquartile range, and the cast's median time.

No targets: ``quantize`` is an emulation tool, not on the training step's hot path; the latest figures are in
benchmarks/RESULTS.md. Every ratio is the median over repetitions of ``time(method) / time(cast)`` measured in
the same round of one run.

    python benchmarks/bench_quantize.py                  # 64k, 1M, 16M elements on CPU, 1 thread
    python benchmarks/bench_quantize.py --quick          # 64k and 1M
    python benchmarks/bench_quantize.py --smoke          # 4k elements, 2 repetitions: runs, nothing to read
    python benchmarks/bench_quantize.py --device cuda --sizes 1e6 1e8
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch
from bench_scaler import (
    Case,
    add_common_args,
    add_smoke_arg,
    describe,
    human,
    interleave,
    median_ms,
    print_table,
    ratio,
    setup,
    spread,
)

from dls import formats


def random_values(n: int, device: torch.device) -> torch.Tensor:
    """Float32 values with uniformly random exponents in [-40, 40] and random mantissas and signs."""
    gen = torch.Generator().manual_seed(0)
    exponent = torch.randint(-40, 41, (n,), generator=gen).to(torch.float32)
    mantissa = torch.rand(n, generator=gen) + 1.0
    sign = torch.randint(0, 2, (n,), generator=gen).to(torch.float32) * 2 - 1
    return (sign * mantissa * torch.exp2(exponent)).to(device)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[2**16, 2**20, 2**24])
    parser.add_argument("--quick", action="store_true", help="64k and 1M elements only")
    add_common_args(parser, reps=30, warmup=3)
    add_smoke_arg(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.sizes, args.reps, args.warmup = [2**12], 2, 1
    device = setup(args)
    sizes = [2**16, 2**20] if args.quick and not args.smoke else [int(s) for s in args.sizes]
    print(f"quantize vs x.to(torch.float16).float(); {describe(device, args.threads)}")
    methods = {
        "cbfloat16": lambda x: formats.cbfloat16.quantize(x),
        "float16 (arithmetic)": lambda x: formats.float16._quantize_generic(x),
        "float16": lambda x: formats.float16.quantize(x),
        "float8_e4m3fn": lambda x: formats.float8_e4m3fn.quantize(x),
        "count": lambda x: formats.cbfloat16.quantize_and_count(x),
    }
    rows = []
    for n in sizes:
        x = random_values(n, device)
        cases = {"cast": Case(run=lambda x=x: x.to(torch.float16).float())}
        for name, fn in methods.items():
            cases[name] = Case(run=lambda x=x, fn=fn: fn(x))
        times = interleave(cases, device, args.reps, args.warmup)
        row = [human(n), f"{median_ms(times['cast']):.3f}"]
        for name in methods:
            lo, hi = spread(times, name, "cast")
            row.append(f"{ratio(times, name, 'cast'):.2f} [{lo:.2f}-{hi:.2f}]")
        rows.append(row)
    print_table("time / cast time (median [IQR])", ["elements", "cast ms", *methods], rows)


if __name__ == "__main__":
    main()
