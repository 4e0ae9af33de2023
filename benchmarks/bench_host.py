"""Host cost of dls.GradScaler against torch.amp.GradScaler, side by side from one run (issue 19).

On CPU every tensor op runs synchronously, so wall time is host time plus the (tiny) kernels. Timed interleaved,
medians over ``--reps`` repetitions:

* ``update()``: the rule after an unfused step (the step untimed), one optimizer; target: dls at most 2x torch;
* whole step: ``scale(loss).backward(); step(opt); update()`` on ``--params`` small parameters (default 200, 16
  elements each, plain SGD); target: dls at most torch;
* device ops per ``update()`` (aten ops, counted with a dispatch mode): on a GPU each is a kernel launch.

    python benchmarks/bench_host.py
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


def _setup(scaler: Any, count: int) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer, Callable[[], None]]:
    params = [torch.nn.Parameter(torch.ones(16)) for _ in range(count)]
    opt = torch.optim.SGD(params, lr=0.0)

    def backward_and_step() -> None:
        loss = torch.stack([p.sum() for p in params]).sum()
        scaler.scale(loss).backward()
        scaler.step(opt)

    return params, opt, backward_and_step


def time_interleaved(
    makers: dict[str, Callable[[], Any]], count: int, reps: int, whole: bool
) -> dict[str, list[float]]:
    """Per repetition, one timed call per scaler in turn (drift in machine load hits every scaler alike): the whole
    ``scale+backward+step+update`` (``whole``), else ``update()`` alone after an untimed step."""
    setups = {name: (make(), *_setup_params(count)) for name, make in makers.items()}
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


def _setup_params(count: int) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
    params = [torch.nn.Parameter(torch.ones(16)) for _ in range(count)]
    return params, torch.optim.SGD(params, lr=0.0)


def ops_per_update(scaler: Any) -> list[str]:
    _, opt, before = _setup(scaler, 1)
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
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    makers: dict[str, Callable[[], Any]] = {
        "torch.amp": lambda: torch.amp.GradScaler("cpu"),
        "dls (torch dialect)": lambda: dls.GradScaler("cpu"),
        "dls (Cerebras dialect)": lambda: dls.GradScaler(),
        "dls (hysteresis=2)": lambda: dls.GradScaler(hysteresis=2),
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


if __name__ == "__main__":
    main()
