"""Memory and time of half-precision parameters with float32 masters (``dls.master_weights``) against autocast.

The small transformer of ``bench_step.py``, trained three ways with a dynamic ``dls.GradScaler``:

* ``autocast``     -- float32 parameters, forward under ``torch.autocast`` in the half dtype (torch.amp's way);
* ``masters``      -- parameters in the half dtype, no autocast, optimizer wrapped by ``dls.master_weights``;
* ``half only``    -- parameters in the half dtype, plain optimizer: the memory floor, but updates below half a
  unit in the last place of a weight are lost (see ``examples/master_weights.py``).

For plain SGD (no state) and AdamW, and for a small and a large batch (parameters vs activations dominating):

1. counted bytes, after ``backward`` and ``step`` and before ``zero_grad`` (the moment everything is alive):
   model parameters, model gradients, masters with their gradients, optimizer state;
2. the peak of one whole training step (forward, backward, step, update, ``zero_grad``) from torch.profiler's
   memory profile (every tensor alive during the step, pre-existing ones included; not RSS);
3. step time, every variant timed in the same loop (interleaved, random order per round), as the median of
   per-round ratios to ``autocast``; ``autocast again`` is an A/A control showing the run's noise.

    python benchmarks/bench_master_weights.py              # bfloat16 on CPU (float16 on CUDA)
    python benchmarks/bench_master_weights.py --quick
    python benchmarks/bench_master_weights.py --smoke    # a tiny model, 2 rounds: runs, nothing to read
    python benchmarks/bench_master_weights.py --dtype float16 --device cuda
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import os
import statistics
import tempfile
import warnings
from collections.abc import Callable, Sequence

import torch
from bench_scaler import Case, add_common_args, add_smoke_arg, describe, interleave, print_table, ratio, setup, spread
from bench_step import TinyLM, token_batches

import dls
from dls.master_weights import MasterWeights, master_weights

VARIANTS = ("autocast", "masters", "half only")
MB = 2.0**20


def build(
    base: torch.nn.Module, variant: str, opt_name: str, dtype: torch.dtype
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = copy.deepcopy(base)
    if variant != "autocast":
        model.to(dtype)
    opt: torch.optim.Optimizer
    if opt_name == "SGD":
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if variant == "masters":
        opt = master_weights(opt)
    return model, opt


def make_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    scaler: dls.GradScaler,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    autocast_dtype: torch.dtype | None,
) -> tuple[Callable[[], None], Callable[[], None]]:
    """``(through_step, finish)``: forward, backward, step and update; then ``zero_grad``."""
    device_type = next(model.parameters()).device.type
    counter = [0]

    def through_step() -> None:
        tokens, targets = batches[counter[0] % len(batches)]
        counter[0] += 1
        no_autocast = autocast_dtype is None
        with contextlib.nullcontext() if no_autocast else torch.autocast(device_type, dtype=autocast_dtype):
            logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    def finish() -> None:
        opt.zero_grad(set_to_none=True)

    return through_step, finish


class Diverged(RuntimeError):
    """Every step overflows (e.g. AdamW on float16 parameters and state: its eps=1e-8 is 0 in float16)."""


def clean_step(
    step: Callable[[], None],
    finish: Callable[[], None],
    scaler: dls.GradScaler,
    opt: torch.optim.Optimizer,
    keep_grads: bool = False,
) -> None:
    """``step(); finish()``, repeated (at most 30 times) until the step was not skipped for overflow; with
    ``keep_grads`` the clean step's gradients are left alive (no ``finish``)."""
    for _ in range(30):
        step()
        skipped = scaler.step_was_skipped(opt)
        if skipped or not keep_grads:
            finish()
        if not skipped:
            return
    raise Diverged(f"30 overflowing steps in a row, scale {scaler.get_scale():g}")


def counted_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    def size(t: torch.Tensor | None) -> int:
        return 0 if t is None else t.numel() * t.element_size()

    params = list(model.parameters())
    masters = [opt.master_of(p) for p in params] if isinstance(opt, MasterWeights) else []
    masters = [m for m, p in zip(masters, params) if m is not p]
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    # The copy a step keeps of what it changes until its masters are known to fit (dls.master_weights' refusal).
    copies = getattr(opt, "_copies", None)
    kept = copies.saved if copies is not None else []
    return {
        "params": sum(size(p) for p in params),
        "grads": sum(size(p.grad) for p in params),
        "masters": sum(size(m) for m in masters),
        "master grads": sum(size(m.grad) for m in masters),
        "state": sum(size(v) for v in state),
        "kept copy": sum(size(v) for v in kept),
    }


def profiled_peak(step: Callable[[], None], device: torch.device) -> int:
    """The largest total of live tensor bytes on ``device`` during ``step()``, from torch.profiler's memory
    timeline (tensors that existed before the step and are used in it included)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, profile_memory=True, record_shapes=True, with_stack=True) as prof:
        step()
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # export_memory_timeline: deprecated for CUDA snapshots
        path = os.path.join(tmp, "timeline.json")
        prof.export_memory_timeline(path, device=str(device))
        with open(path) as f:
            _times, sizes = json.load(f)
    return max(sum(row) for row in sizes) if sizes else 0


def measure_memory(
    args: argparse.Namespace, device: torch.device, dtype: torch.dtype, batch: int
) -> tuple[list[list[str]], dict[tuple[str, str], int]]:
    base, batches = model_and_batches(args, device, batch)
    params = sum(p.numel() for p in base.parameters())
    rows, peaks = [], {}
    for opt_name in ("SGD", "AdamW"):
        for variant in VARIANTS:
            model, opt = build(base, variant, opt_name, dtype)
            scaler = dls.GradScaler(loss_scale="dynamic")
            step, finish = make_step(model, opt, scaler, batches, dtype if variant == "autocast" else None)
            try:
                clean_step(step, finish, scaler, opt)  # the scale has settled and the state exists
                clean_step(step, finish, scaler, opt, keep_grads=True)
                counts = counted_bytes(model, opt)
                finish()
                # A skipped step would not touch the optimizer state, and the profile would not see it.
                peak = profiled_peak(functools.partial(clean_step, step, finish, scaler, opt), device)
            except Diverged as why:
                rows.append([f"{opt_name} b{batch}", variant, *["-"] * 9, "diverged"])
                print(f"  {opt_name} b{batch} {variant}: diverged ({why})", flush=True)
                continue
            peaks[(opt_name, variant)] = peak
            total = sum(counts.values())
            rows.append(
                [
                    f"{opt_name} b{batch}",
                    variant,
                    *(
                        f"{counts[k] / MB:.1f}"
                        for k in ("params", "grads", "masters", "master grads", "state", "kept copy")
                    ),
                    f"{total / MB:.1f}",
                    f"{total / params:.1f}",
                    f"{peak / MB:.1f}",
                    f"{peak / peaks[(opt_name, 'autocast')]:.2f}",
                ]
            )
    return rows, peaks


def measure_time(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, batch: int) -> list[list[str]]:
    base, batches = model_and_batches(args, device, batch)
    rows = []
    for opt_name in ("SGD", "AdamW"):
        cases, scalers = {}, {}
        for variant in (*VARIANTS, "autocast again"):
            model, opt = build(base, variant.removesuffix(" again"), opt_name, dtype)
            scaler = dls.GradScaler(loss_scale="dynamic")
            step, finish = make_step(model, opt, scaler, batches, dtype if variant.startswith("autocast") else None)
            step()
            finish()

            def run(step: Callable[[], None] = step, finish: Callable[[], None] = finish) -> None:
                step()
                finish()

            cases[variant] = Case(run=run)
            scalers[variant] = scaler
        times = interleave(cases, device, args.reps, args.warmup)
        for variant in cases:
            skipped = scalers[variant].get_num_skipped_steps()
            rows.append(
                [
                    f"{opt_name} b{batch}",
                    variant,
                    f"{statistics.median(times[variant]) * 1e3:.2f}",
                    f"{ratio(times, variant, 'autocast'):.3f}",
                    "[{:.2f},{:.2f}]".format(*spread(times, variant, "autocast")),
                    f"{skipped} of {args.reps + args.warmup + 1}" if skipped else "",
                ]
            )
    return rows


def model_and_batches(
    args: argparse.Namespace, device: torch.device, batch: int
) -> tuple[torch.nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(args.seed)
    base = TinyLM(args.vocab, args.width, args.layers, args.heads, args.context).to(device)
    batches = token_batches(args.vocab, batch, args.context, 2, args.seed, device)
    return base, batches


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, reps=30, warmup=3)
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], help="default: bf16 on CPU, fp16 on CUDA")
    parser.add_argument("--batches", type=int, nargs="+", default=[2, 64], help="batch sizes (default 2 64)")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="8 timed rounds, one batch size per table")
    add_smoke_arg(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.reps, args.warmup = 8, 2
    if args.smoke:
        args.quick, args.reps, args.warmup, args.batches = True, 2, 1, [2]
        args.context, args.vocab, args.width, args.layers, args.heads = 16, 64, 32, 1, 2
    device = setup(args)
    dtype_name = args.dtype or ("float16" if device.type == "cuda" else "bfloat16")
    dtype = getattr(torch, dtype_name)
    params = sum(p.numel() for p in TinyLM(args.vocab, args.width, args.layers, args.heads, args.context).parameters())
    print(f"bench_master_weights: {describe(device, args.threads)}")
    print(
        f"model: {args.layers}-layer transformer, width {args.width}, vocab {args.vocab}, {params / 1e6:.2f}M "
        f"parameters; {args.context} tokens per sequence; half dtype {dtype_name}; {args.reps} timed rounds"
    )
    memory_rows: list[list[str]] = []
    time_rows: list[list[str]] = []
    for batch in args.batches:
        memory_rows += measure_memory(args, device, dtype, batch)[0]
        print(f"  ... memory, batch {batch} done", flush=True)
    for batch in args.batches[:1] if args.quick else args.batches:
        time_rows += measure_time(args, device, dtype, batch)
        print(f"  ... time, batch {batch} done", flush=True)
    print_table(
        "memory (MiB): counted after backward+step, before zero_grad; peak of a whole step from torch.profiler",
        [
            "run",
            "variant",
            "params",
            "grads",
            "masters",
            "m.grads",
            "state",
            "kept",
            "total",
            "B/param",
            "peak",
            "/autocast",
        ],
        memory_rows,
    )
    print_table(
        "step time (forward, backward, step, update, zero_grad): median of per-round ratios [25%, 75%]",
        ["run", "variant", "ms", "/autocast", "[iqr]", "skipped"],
        time_rows,
    )


if __name__ == "__main__":
    main()
