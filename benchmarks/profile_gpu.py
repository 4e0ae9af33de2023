"""Why a GPU table misses its target: torch.profiler over the cases that missed on the first GPU run (2026-11-28).

For each case the kernels launched and their device time (``torch.profiler``, CUDA activity), dls beside torch.amp
and beside the bandwidth floor, and for the launch-bound case the host-side operators by self CPU time:

1. unscale + check, float32, 100M elements in 10 and in 10,000 tensors (dls/floor 1.5 and 2.4 against <= 1.15);
2. unscale + global clip, float32, 10M elements in 10 tensors (dls/torch 1.29 against <= 0.7);
3. host overhead, fused SGD over 1,000 small parameters (dls/torch 2.2, no target);
4. the read-only check a fused optimizer needs (``dls.kernels.check_unscaled_``: max-abs norms) against torch's AMP
   kernel with a factor of 1 (a read and a write), host and device time, few large and many small tensors.

    python3 benchmarks/profile_gpu.py            # on CUDA (about a minute)
    python3 benchmarks/profile_gpu.py --quick    # tiny sizes, on the CPU too (a smoke run)
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import _this_tree  # noqa: F401  (first: puts this tree's src/ on the path)
import torch
from bench_scaler import NO_GROWTH, close_iteration, restorable_grads, scalers, torch_unscale_

import dls


def profile(title: str, run: Callable[[], None], prep: Callable[[], None], device: torch.device, sort: str) -> None:
    """``run`` five times after two warm-ups (``prep`` untimed before each), then the profiler's table."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    for _ in range(2):
        prep()
        run()
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(5):
            prep()
            with torch.profiler.record_function("timed"):
                run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    print(f"\n=== {title} (5 calls)")
    print(prof.key_averages().table(sort_by=sort, row_limit=12, max_name_column_width=70))


def unscale_cases(device: torch.device, numel: int, count: int, sort: str) -> None:
    grads, opt, restore = restorable_grads(numel, count, torch.float32, device)
    ours, theirs = scalers(device)
    inv = torch.tensor(1 / 65536, device=device)

    def dls_run() -> None:
        ours.unscale_(opt)
        close_iteration(ours)

    def torch_run() -> None:
        torch_unscale_(theirs, opt, False)
        theirs.update()

    label = f"float32 {numel:,} elements in {count} tensors"
    profile(f"unscale dls, {label}", dls_run, restore, device, sort)
    profile(f"unscale torch.amp, {label}", torch_run, restore, device, sort)
    profile(f"floor _foreach_mul_, {label}", lambda: torch._foreach_mul_(grads, inv), restore, device, sort)


def clip_cases(device: torch.device, numel: int, count: int, sort: str) -> None:
    _, opt, restore = restorable_grads(numel, count, torch.float32, device)
    params = [p for group in opt.param_groups for p in group["params"]]
    ours, theirs = scalers(device, max_gradient_norm=0.01)

    def dls_run() -> None:
        ours.clip_gradients_and_return_isfinite(opt)
        close_iteration(ours)

    def torch_run() -> None:
        torch_unscale_(theirs, opt, False)
        torch.nn.utils.clip_grad_norm_(params, 0.01)
        theirs.update()

    label = f"float32 {numel:,} elements in {count} tensors"
    profile(f"clip dls, {label}", dls_run, restore, device, sort)
    profile(f"clip torch.amp + clip_grad_norm_, {label}", torch_run, restore, device, sort)


def overhead_cases(device: torch.device, count: int) -> None:
    for name in ("dls", "torch"):
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(64, generator=gen).to(device)) for _ in range(count)]
        grads = [torch.randn(64, generator=gen).to(device) * 1e-3 for _ in params]
        opt = torch.optim.SGD(params, lr=1e-6, fused=True)
        scaler: dls.GradScaler | torch.amp.GradScaler = (
            dls.GradScaler(device.type, growth_interval=NO_GROWTH)
            if name == "dls"
            else torch.amp.GradScaler(device.type, growth_interval=NO_GROWTH)
        )

        scaler.scale(torch.ones((), device=device))  # torch makes its scale lazily

        def prep(params: list[torch.nn.Parameter] = params, grads: list[torch.Tensor] = grads) -> None:
            for p, g in zip(params, grads):
                p.grad = g.clone()

        def run(scaler: dls.GradScaler | torch.amp.GradScaler = scaler, opt: torch.optim.Optimizer = opt) -> None:
            scaler.step(opt)
            scaler.update()

        profile(f"fused SGD step + update, {name}, {count} parameters", run, prep, device, "self_cpu_time_total")


def check_cases(device: torch.device, shapes: list[tuple[int, int]]) -> None:
    """Microseconds per call: issued (host, no sync) and finished (synchronised after each call)."""
    import time

    from dls import kernels

    print("\n=== the fused path's check: host us (issue only) / total us (synced), per call")
    for numel, count in shapes:
        grads = [torch.randn(numel // count, device=device) for _ in range(count)]
        flag = torch.zeros((), device=device)
        one = torch.ones((), device=device)
        group = {(device, torch.float32): grads}
        variants: dict[str, Callable[[], None]] = {
            "max-abs norms (dls)": lambda g=group, f=flag, o=one: kernels.check_unscaled_(
                g, {device: o}, {device: f}, True
            ),
            "AMP kernel, factor 1 (torch)": lambda g=grads, f=flag, o=one: (
                torch._amp_foreach_non_finite_check_and_unscale_(g, f, o)
            ),
        }
        for name, fn in variants.items():
            for _ in range(3):
                fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(20):
                fn()
            host = (time.perf_counter() - start) / 20 * 1e6
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(20):
                fn()
                if device.type == "cuda":
                    torch.cuda.synchronize()
            total = (time.perf_counter() - start) / 20 * 1e6
            print(f"  {numel:>12,} in {count:>6}: {name:<30} host {host:9.1f}  total {total:9.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run, the CPU too)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    big, small, few = (10_000, 1_000, 10) if args.quick else (10**8, 10**7, 10)
    print(f"profile_gpu: torch {torch.__version__} on {device}")
    unscale_cases(device, big, few, sort)
    unscale_cases(device, big, 100 if args.quick else 10_000, sort)
    clip_cases(device, small, few, sort)
    overhead_cases(device, 50 if args.quick else 1000)
    shapes = (
        [(10_000, 10), (10_000, 100)] if args.quick else [(64_000, 1000), (10**7, 10), (10**8, 10_000), (10**8, 100)]
    )
    check_cases(device, shapes)


if __name__ == "__main__":
    main()
