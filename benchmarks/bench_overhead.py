"""Per-step host overhead against the number of parameters: how dls's per-step cost grows with the tensor count.

Many tiny gradients (``--elements`` each, default 16): the passes over memory cost nothing, what remains is
per-tensor work on the host. For 10, 100, 1000 and 10000 tensors, timed interleaved in one loop:

* ``floor``      -- one ``torch._foreach_mul_`` over a pre-built list of the gradients (the kernel alone);
* ``dls``        -- ``dls.GradScaler(device).unscale_(opt)`` (then ``update()`` and a read of the scale, untimed:
  the one-pass case, host bound of the scale >= 1);
* ``torch``      -- ``torch.amp.GradScaler(device).unscale_(opt)`` (then ``update()``, untimed);
* ``dls step``   -- ``scaler.step(opt); scaler.update()`` on ``SGD(fused=True, lr=0)``, the sync-free path whole
  (overflow check, fused kernel, rule update), as in a long run: after ``--preroll`` untimed steps that never read
  the device. The scaler publishes each new scale to host memory without a synchronisation, so its host bound of
  the scale stays exact and the check keeps its one-pass form (asserted; the scale-below-1 form is
  ``bench_scale_below_one.py``'s subject);
* ``torch step`` -- ``step`` + ``update`` with ``torch.amp.GradScaler``;
* ``bare step``  -- ``opt.step()`` of the same fused SGD without any scaler;
* ``grouping``   -- ``GradIndex.groups()`` alone: the per-step collection of gradients by (device, dtype) that dls
  does (its grouping of parameters is cached per optimizer).

Also the fixed per-iteration costs: ``scale(loss)`` and ``update()`` of each scaler.

Printed: microseconds per step, nanoseconds per parameter, and the growth of the overhead above the floor per
added parameter between consecutive sizes (flat ns/param = overhead linear in the parameter count; 0 would be an
overhead independent of the parameter count). No targets: these tables explain the ratios of the other scripts.

    python benchmarks/bench_overhead.py
    python benchmarks/bench_overhead.py --quick      # 10, 100, 1000 tensors
    python benchmarks/bench_overhead.py --smoke      # 10 and 100 tensors, 2 repetitions: runs, nothing to read
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from collections.abc import Sequence

import torch
from bench_scaler import (
    NO_GROWTH,
    SCALE,
    Case,
    add_common_args,
    add_smoke_arg,
    close_iteration,
    describe,
    interleave,
    print_table,
    setup,
)

import dls
from dls import kernels


def bench(
    count: int, elements: int, device: torch.device, reps: int, warmup: int, preroll: int
) -> dict[str, list[float]]:
    params = [torch.nn.Parameter(torch.zeros(elements, device=device)) for _ in range(count)]
    grads = [torch.full_like(p, SCALE) for p in params]
    for p, g in zip(params, grads):
        p.grad = g
    master = [g.clone() for g in grads]
    opt = torch.optim.SGD(params, lr=0.0)

    def fused_sgd() -> torch.optim.Optimizer:
        ps = [torch.nn.Parameter(torch.zeros(elements, device=device)) for _ in range(count)]
        for p in ps:
            p.grad = torch.full_like(p, SCALE)
        return torch.optim.SGD(ps, lr=0.0, fused=True)

    fused, fused_bare = fused_sgd(), fused_sgd()
    ours, ours_step = (dls.GradScaler(device.type, init_scale=SCALE, growth_interval=NO_GROWTH) for _ in range(2))
    theirs, theirs_step = (
        torch.amp.GradScaler(device.type, init_scale=SCALE, growth_interval=NO_GROWTH) for _ in range(2)
    )
    probe = torch.ones((), device=device)
    for s in (ours, theirs, ours_step, theirs_step):
        s.scale(probe)
    one = torch.ones((), device=device)

    def restore() -> None:  # unscale_ divides by SCALE: put the values back (untimed) before each one
        torch._foreach_copy_(grads, master)

    index = kernels.GradIndex(p for g in opt.param_groups for p in g["params"])

    def dls_step() -> None:
        ours_step.step(fused)
        ours_step.update()

    for _ in range(preroll):
        dls_step()
    assert not ours_step._scale.known.scale_may_be_below_one(), "the published scale did not keep the host bound exact"

    def torch_step() -> None:
        theirs_step.step(fused)
        theirs_step.update()

    cases = {
        "floor": Case(run=lambda: torch._foreach_mul_(grads, one)),
        "dls": Case(run=lambda: ours.unscale_(opt), prep=restore, reset=lambda: close_iteration(ours)),
        "torch": Case(run=lambda: theirs.unscale_(opt), prep=restore, reset=theirs.update),
        "dls step": Case(run=dls_step),
        "torch step": Case(run=torch_step),
        "bare step": Case(run=lambda: fused_bare.step()),
        "grouping": Case(run=index.groups),
    }
    return interleave(cases, device, reps, warmup)


def fixed_costs(device: torch.device, reps: int, warmup: int) -> dict[str, list[float]]:
    """Per-iteration costs that do not depend on the gradients: ``scale(loss)`` and ``update()``."""
    params = [torch.nn.Parameter(torch.zeros(4, device=device)) for _ in range(4)]
    for p in params:
        p.grad = torch.ones_like(p)
    opt = torch.optim.SGD(params, lr=0.0)
    ours = dls.GradScaler(device.type, init_scale=SCALE, growth_interval=NO_GROWTH)
    theirs = torch.amp.GradScaler(device.type, init_scale=SCALE, growth_interval=NO_GROWTH)
    loss = torch.ones((), device=device)
    for s in (ours, theirs):
        s.scale(loss)
    cases = {
        "dls scale": Case(run=lambda: ours.scale(loss)),
        "torch scale": Case(run=lambda: theirs.scale(loss)),
        # update() after an untimed unscale_ (which records the flag the rule consumes)
        "dls update": Case(run=ours.update, prep=lambda: ours.unscale_(opt)),
        "torch update": Case(run=theirs.update, prep=lambda: theirs.unscale_(opt)),
    }
    return interleave(cases, device, reps * 5, warmup)


def slope(pair: tuple[dict[str, float], dict[str, float], int], name: str, base: str) -> str:
    """Growth of ``name - base`` (microseconds) per added parameter between two sizes, in nanoseconds."""
    small, large, added = pair
    grow = (large[name] - large[base]) - (small[name] - small[base])
    return f"{grow / added * 1e3:.0f}"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, reps=21, warmup=3)
    parser.add_argument("--counts", type=int, nargs="+", default=[10, 100, 1000, 10000])
    parser.add_argument("--elements", type=int, default=16, help="elements per tensor (default 16)")
    parser.add_argument(
        "--preroll", type=int, default=20, help="untimed fused steps first: a long run's state (default 20)"
    )
    parser.add_argument("--quick", action="store_true", help="counts 10, 100, 1000")
    add_smoke_arg(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.counts, args.reps, args.warmup, args.preroll = [10, 100], 2, 1, 2
    device = setup(args)
    counts = [10, 100, 1000] if args.quick and not args.smoke else args.counts
    print(f"bench_overhead: {describe(device, args.threads)}; {args.elements} elements per tensor")

    names = ["floor", "dls", "torch", "grouping", "bare step", "dls step", "torch step"]
    medians: dict[int, dict[str, float]] = {}
    for count in counts:
        t = bench(count, args.elements, device, args.reps, args.warmup, args.preroll)
        medians[count] = {k: statistics.median(v) * 1e6 for k, v in t.items()}
        print(f"  ... {count} tensors done")

    rows = [[count, *(f"{medians[count][k]:.0f}" for k in names)] for count in counts]
    print_table("microseconds per step (median)", ["tensors", *names], rows)
    rows = [[count, *(f"{medians[count][k] / count * 1e3:.0f}" for k in names)] for count in counts]
    print_table("nanoseconds per parameter per step", ["tensors", *names], rows)

    rows = []
    for small, large in itertools.pairwise(counts):
        pair = (medians[small], medians[large], large - small)
        rows.append(
            [
                f"{small}->{large}",
                slope(pair, "dls", "floor"),
                slope(pair, "torch", "floor"),
                slope(pair, "dls step", "bare step"),
                slope(pair, "torch step", "bare step"),
            ]
        )
    print_table(
        "overhead above the kernel, growth per added parameter (ns); 0 = overhead independent of parameter count",
        ["tensors", "dls-floor", "torch-floor", "dls step-bare", "torch step-bare"],
        rows,
    )
    fixed = {k: statistics.median(v) * 1e6 for k, v in fixed_costs(device, args.reps, args.warmup).items()}
    print_table(
        "fixed per-iteration costs (microseconds, median)",
        ["dls scale", "torch scale", "dls update", "torch update", "update dls/torch"],
        [
            [
                *(f"{fixed[k]:.1f}" for k in ("dls scale", "torch scale", "dls update", "torch update")),
                f"{fixed['dls update'] / fixed['torch update']:.1f}",
            ]
        ],
    )
    last = counts[-1]
    print(
        f"\nat {last} tensors: dls/torch unscale_ {medians[last]['dls'] / medians[last]['torch']:.3f}, "
        f"dls/torch step {medians[last]['dls step'] / medians[last]['torch step']:.3f}, "
        f"dls step / bare fused step {medians[last]['dls step'] / medians[last]['bare step']:.3f}"
    )


if __name__ == "__main__":
    main()
