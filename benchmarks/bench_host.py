"""Host cost of dls.GradScaler against torch.amp.GradScaler, side by side from one run.

On CPU every tensor op runs synchronously, so wall time is host time plus the (tiny) kernels. Timed interleaved,
medians over ``--reps`` repetitions:

* ``update()``: the rule after an unfused step (the step untimed), one optimizer; target: dls at most 2x torch;
* whole step: ``scale(loss).backward(); step(opt); update()`` on ``--params`` small parameters (default 200, 16
  elements each, plain SGD); target: dls at most torch;
* device ops per ``update()`` (aten ops, counted with a dispatch mode): on a GPU each is a kernel launch;
* ``update()`` where the host does not know the flag (torch's fused Adam, ``sync_free=True``): the whole rule runs
  on the device, against torch.amp's ``update()`` after a fused Adam step.

    python benchmarks/bench_host.py
    python benchmarks/bench_host.py --smoke     # 10 repetitions, 8 parameters: runs, nothing to read
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dls


class OpCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


Optimizer = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


def sgd(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.0)


def fused_adam(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.0, fused=True)


def _setup(
    scaler: Any, count: int, optimizer: Optimizer = sgd
) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer, Callable[[], None]]:
    params = [torch.nn.Parameter(torch.ones(16)) for _ in range(count)]
    opt = optimizer(params)

    def backward_and_step() -> None:
        loss = torch.stack([p.sum() for p in params]).sum()
        scaler.scale(loss).backward()
        scaler.step(opt)

    return params, opt, backward_and_step


def time_interleaved(
    makers: dict[str, Callable[[], Any]],
    count: int,
    reps: int,
    whole: bool,
    optimizers: dict[str, Optimizer] | None = None,
) -> dict[str, list[float]]:
    """Per repetition, one timed call per scaler in turn (drift in machine load hits every scaler alike): the whole
    ``scale+backward+step+update`` (``whole``), else ``update()`` alone after an untimed step. ``optimizers``: per
    scaler, when not plain SGD."""
    optimizers = optimizers or {}
    setups = {name: (make(), *_setup_params(count, optimizers.get(name, sgd))) for name, make in makers.items()}
    out: dict[str, list[float]] = {name: [] for name in makers}
    for rep in range(reps + 20):  # the first 20: warm-up (indexes, lazily created state)
        for name, (scaler, params, opt) in setups.items():
            loss = torch.stack([p.sum() for p in params]).sum()  # the forward pass is not timed
            start = time.perf_counter_ns()
            scaler.scale(loss).backward()
            scaler.step(opt)
            if not whole:
                start = time.perf_counter_ns()
            scaler.update()
            if rep >= 20:
                out[name].append((time.perf_counter_ns() - start) / 1e3)
            opt.zero_grad(set_to_none=False)
    return out


def _setup_params(count: int, optimizer: Optimizer) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
    params = [torch.nn.Parameter(torch.ones(16)) for _ in range(count)]
    return params, optimizer(params)


def ops_per_update(scaler: Any, optimizer: Optimizer = sgd) -> list[str]:
    _, opt, before = _setup(scaler, 1, optimizer)
    for _ in range(3):
        before()
        scaler.update()
        opt.zero_grad(set_to_none=False)
    before()
    with OpCount() as log:
        scaler.update()
    return log.ops


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=2000)
    parser.add_argument("--params", type=int, default=200)
    parser.add_argument(
        "--smoke", action="store_true", help="10 repetitions, 8 parameters: checks that the script runs (seconds)"
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.reps, args.params = 10, 8
    torch.set_num_threads(1)
    makers: dict[str, Callable[[], Any]] = {
        "torch.amp": lambda: torch.amp.GradScaler("cpu"),
        "dls (torch dialect)": lambda: dls.GradScaler("cpu"),
        "dls (Cerebras dialect)": lambda: dls.GradScaler(loss_scale="dynamic"),
        "dls (hysteresis=2)": lambda: dls.GradScaler(loss_scale="dynamic", hysteresis=2),
    }
    results = {
        "update": time_interleaved(makers, 1, args.reps, whole=False),
        "whole": time_interleaved(makers, args.params, args.reps // 4, whole=True),
    }
    base = {kind: statistics.median(times["torch.amp"]) for kind, times in results.items()}
    print(f"host time, CPU, medians (us); whole step = scale+backward+step+update at {args.params} parameters")
    print(f"{'scaler':<24}{'update()':>10}{'ratio':>8}{'whole step':>12}{'ratio':>8}{'ops/update':>12}")
    for name, make in makers.items():
        update = statistics.median(results["update"][name])
        whole = statistics.median(results["whole"][name])
        ops = len(ops_per_update(make()))
        print(
            f"{name:<24}{update:>10.2f}{update / base['update']:>8.2f}{whole:>12.1f}{whole / base['whole']:>8.2f}"
            f"{ops:>12}"
        )
    print("targets: update() ratio <= 2.0, whole-step ratio <= 1.0 (torch dialect and Cerebras dialect)")

    # The flag stays on the device: update() runs the whole rule there (after the first step, decided on the host).
    device_side: dict[str, tuple[Callable[[], Any], Optimizer]] = {
        "torch.amp (fused Adam)": (lambda: torch.amp.GradScaler("cpu"), fused_adam),
        "dls torch (fused Adam)": (lambda: dls.GradScaler("cpu"), fused_adam),
        "dls Cerebras (fused)": (lambda: dls.GradScaler(loss_scale="dynamic"), fused_adam),
        "dls hysteresis=2 (fused)": (lambda: dls.GradScaler(loss_scale="dynamic", hysteresis=2), fused_adam),
        "dls hyst=2+tol (fused)": (lambda: dls.GradScaler(hysteresis=2, overflow_tolerance=0.25), fused_adam),
        "dls torch (sync_free)": (lambda: dls.GradScaler("cpu", sync_free=True), sgd),
        "dls hyst=2+tol (sync_free)": (
            lambda: dls.GradScaler(hysteresis=2, overflow_tolerance=0.25, sync_free=True),
            sgd,
        ),
    }
    times = time_interleaved(
        {name: make for name, (make, _) in device_side.items()},
        1,
        args.reps,
        whole=False,
        optimizers={name: opt for name, (_, opt) in device_side.items()},
    )
    base_update = statistics.median(times["torch.amp (fused Adam)"])
    print("\nupdate() where the flag stays on the device (fused optimizer, sync_free), medians (us)")
    print(f"{'scaler':<28}{'update()':>10}{'ratio':>8}{'ops/update':>12}")
    for name, (make, opt) in device_side.items():
        update = statistics.median(times[name])
        ops = len(ops_per_update(make(), opt))
        print(f"{name:<28}{update:>10.2f}{update / base_update:>8.2f}{ops:>12}")


if __name__ == "__main__":
    main()
