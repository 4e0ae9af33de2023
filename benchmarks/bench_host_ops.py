"""The host's work around the kernels, per scaler call: dls against torch.amp, counted, on CPU and CUDA alike.

The first GPU run (benchmarks/RESULTS.md, H200) missed two targets by host time around the kernels, not by the
kernels: unscale + check against the bandwidth floor, and DLS + clipping at 10-100 tensors; and ``sync_free=True``
with a non-capturable AdamW cost more than torch's one sync. This script counts what each call dispatches, so that
a change of the host code shows as a change of counts, on the CPU too (where the timings of those misses cannot be
seen). Per call, after warm-up calls (each path past its first, host-decided, step):

* ``ops``: the aten operators dispatched (a ``TorchDispatchMode`` around the call), split into ``passes`` (an
  operator on a gradient-sized tensor or a list of them: a pass over the gradients), ``small`` (every other
  operator that computes: on a GPU, a kernel launch on a few elements: a flag's zeros, a scale's reciprocal, a
  norm's clamp), ``views`` (no kernel) and ``reads`` (``.item()`` and copies to the host: a sync on a GPU);
* ``kernels``: on CUDA, the device activities the profiler saw (kernels, copies, memsets); ``syncs``: on CUDA, the
  host syncs (``torch.cuda.set_sync_debug_mode("warn")``); both ``n/a`` on the CPU;
* ``host us``: the median host time of the call (CUDA: from the call to its return, no sync added; the CPU:
  the whole call), over ``--reps`` calls. For orientation: the counts are the figures to compare.

Tables: 1. ``unscale_`` (dls) vs torch.amp's ``unscale_``, float32 gradients in 10, 100 and 1,000 tensors;
2. ``clip_gradients_and_return_isfinite`` (a dls scaler with ``max_gradient_norm``) vs torch's ``unscale_`` +
``clip_grad_norm_``, 10 and 100 tensors; 3. ``step`` + ``update`` with AdamW (foreach, not capturable: its step
counts stay on the host), fused AdamW, and on CUDA capturable AdamW (its step counts on the device, where
``sync_free=True`` takes the masked path), 10 and 100 tensors: no scaler, torch.amp, dls, dls ``sync_free=True``.

    python benchmarks/bench_host_ops.py                 # the CPU (or --device cuda)
    python benchmarks/bench_host_ops.py --smoke         # 2 repetitions: runs, nothing to read
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import _this_tree  # noqa: F401  (first: puts this tree's src/ on the path)
import torch
from bench_scaler import NO_GROWTH, SCALE, close_iteration, print_table, restorable_grads, scalers, torch_unscale_
from torch.utils._python_dispatch import TorchDispatchMode

import dls

ELEMENTS = 4096  # per gradient: the counts do not depend on it
SYNC_WARNING = "called a synchronizing CUDA operation"
READS = {"aten._local_scalar_dense.default", "aten.is_nonzero.default"}


class Census(TorchDispatchMode):
    """Counts the aten operators dispatched inside it, by kind (the module docstring's ``passes``, ``small``,
    ``views``, ``reads``); ``big``: the fewest elements of a gradient."""

    def __init__(self, big: int) -> None:
        super().__init__()
        self.big = big
        self.kinds: dict[str, int] = {"passes": 0, "small": 0, "views": 0, "reads": 0}
        self.names: list[str] = []

    def _kind(self, func: Any, args: Any, kwargs: Any, out: Any) -> str:
        name = str(func)
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if name in READS or any(
            t.device.type == "cpu" for t in outs if tensors and any(s.device.type != "cpu" for s in tensors)
        ):
            return "reads"
        if getattr(func, "is_view", False):
            return "views"
        if any(t.numel() >= self.big for t in tensors + outs):
            return "passes"
        return "small"

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.kinds[self._kind(func, args, kwargs, out)] += 1
        self.names.append(str(func))
        return out


@dataclass
class Path:
    """One scaler's call on one path: ``call`` is counted and timed; ``prep`` and ``reset`` (untimed, uncounted)
    restore the gradients before it and close the scaler's iteration after it."""

    table: str
    tensors: int
    scaler: str
    call: Callable[[], Any]
    prep: Callable[[], Any] = lambda: None
    reset: Callable[[], Any] = lambda: None


def unscale_paths(device: torch.device, counts: Sequence[int]) -> list[Path]:
    out = []
    for count in counts:
        _, opt, restore = restorable_grads(count * ELEMENTS, count, torch.float32, device)
        ours, theirs = scalers(device)
        out.append(Path("unscale", count, "dls", lambda o=ours, p=opt: o.unscale_(p), restore,
                        lambda o=ours: close_iteration(o)))  # fmt: skip
        out.append(Path("unscale", count, "torch.amp", lambda t=theirs, p=opt: torch_unscale_(t, p, False), restore,
                        theirs.update))  # fmt: skip
    return out


def clip_paths(device: torch.device, counts: Sequence[int]) -> list[Path]:
    out = []
    for count in counts:
        _, opt, restore = restorable_grads(count * ELEMENTS, count, torch.float32, device)
        params = [p for group in opt.param_groups for p in group["params"]]
        ours, theirs = scalers(device, max_gradient_norm=1e-3)

        def torch_clip(t: torch.amp.GradScaler = theirs, p: Any = opt, ps: list[Any] = params) -> None:
            torch_unscale_(t, p, False)
            torch.nn.utils.clip_grad_norm_(ps, 1e-3)

        out.append(Path("clip", count, "dls", lambda o=ours, p=opt: o.clip_gradients_and_return_isfinite(p), restore,
                        lambda o=ours: close_iteration(o)))  # fmt: skip
        out.append(Path("clip", count, "torch.amp", torch_clip, restore, theirs.update))
    return out


STEP_SCALERS: dict[str, Callable[[str], Any]] = {
    "none": lambda device_type: None,
    "torch.amp": lambda device_type: torch.amp.GradScaler(device_type, init_scale=SCALE, growth_interval=NO_GROWTH),
    "dls": lambda device_type: dls.GradScaler(device_type, init_scale=SCALE, growth_interval=NO_GROWTH),
    "dls sync_free": lambda device_type: dls.GradScaler(
        device_type, init_scale=SCALE, growth_interval=NO_GROWTH, sync_free=True
    ),
}


def step_optimizers(device: torch.device) -> dict[str, dict[str, Any]]:
    """The AdamWs of table 3 (label: arguments): foreach (its step counts on the host), fused, and on CUDA
    capturable (its step counts on the device: ``sync_free=True`` takes the masked path there)."""
    kinds: dict[str, dict[str, Any]] = {"AdamW": {"foreach": True}, "AdamW fused": {"fused": True}}
    if device.type == "cuda":
        kinds["AdamW capturable"] = {"foreach": True, "capturable": True}
    return kinds


def step_paths(device: torch.device, counts: Sequence[int]) -> list[Path]:
    out = []
    for label, options in step_optimizers(device).items():
        for count in counts:
            for name, make in STEP_SCALERS.items():
                if options.get("fused") and name == "dls sync_free":
                    continue  # a fused optimizer takes dls's fused path whatever sync_free says
                gen = torch.Generator().manual_seed(count)
                params = [torch.nn.Parameter(torch.randn(ELEMENTS, generator=gen).to(device)) for _ in range(count)]
                grads = [torch.randn(ELEMENTS, generator=gen).to(device) * (1e-3 * SCALE) for _ in params]
                opt = torch.optim.AdamW(params, lr=1e-6, **options)
                scaler = make(device.type)
                if scaler is not None:
                    scaler.scale(torch.ones((), device=device))  # the scale on the device (torch makes it lazily)

                def prep(ps: list[Any] = params, gs: list[torch.Tensor] = grads) -> None:
                    for p, g in zip(ps, gs):
                        p.grad = g.clone()

                def call(s: Any = scaler, o: torch.optim.Optimizer = opt) -> None:
                    if s is None:
                        o.step()
                    else:
                        s.step(o)
                        s.update()

                out.append(Path(f"step {label}", count, name, call, prep))
    return out


def census_of(path: Path, warmup: int) -> Census:
    """The operators of one ``path.call()`` after ``warmup`` calls (each path past its first, host-decided, step)."""
    for _ in range(warmup):
        path.prep()
        path.call()
        path.reset()
    census = Census(ELEMENTS)
    path.prep()
    with census:
        path.call()
    path.reset()
    return census


@dataclass
class Counted:
    path: Path
    kinds: dict[str, int]
    ops: int
    device_ops: int | None
    syncs: int | None
    host_us: float


def count_syncs(fn: Callable[[], Any]) -> int:
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    return sum(SYNC_WARNING in str(w.message) for w in caught)


def count_device_ops(fn: Callable[[], Any]) -> int | None:
    """The device activities (kernels, copies, memsets) the profiler sees during ``fn``; None where it cannot."""
    try:
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            fn()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    except Exception as error:  # the counts of the dispatch mode stand without it: said, not fatal
        print(f"  ... profiler: {type(error).__name__}: {str(error)[:80]}")
        return None


def measure(path: Path, device: torch.device, reps: int, warmup: int) -> Counted:
    cuda = device.type == "cuda"
    census = census_of(path, warmup)
    syncs = device_ops = None
    if cuda:
        path.prep()
        syncs = count_syncs(path.call)
        path.reset()
        path.prep()
        device_ops = count_device_ops(path.call)
        path.reset()
    times = []
    for _ in range(reps):
        path.prep()
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        path.call()
        times.append(time.perf_counter() - start)
        path.reset()
    return Counted(path, census.kinds, len(census.names), device_ops, syncs, statistics.median(times) * 1e6)


TITLES = {
    "unscale": "1. unscale + inf check, per call: dls unscale_ vs torch.amp unscale_ (float32)",
    "clip": "2. unscale + global clip, per call: dls clip_gradients_and_return_isfinite vs unscale_ + clip_grad_norm_",
    "step": "3. step + update, per call: AdamW (foreach, not capturable), fused AdamW (and on CUDA capturable AdamW)",
}
HEADER = ["path", "tensors", "scaler", "ops", "passes", "small", "views", "reads", "kernels", "syncs", "host us"]


def rows_of(counted: list[Counted]) -> list[list[Any]]:
    na = "n/a"
    return [
        [c.path.table, c.path.tensors, c.path.scaler, c.ops, c.kinds["passes"], c.kinds["small"], c.kinds["views"],
         c.kinds["reads"], na if c.device_ops is None else c.device_ops, na if c.syncs is None else c.syncs,
         f"{c.host_us:.1f}"]
        for c in counted
    ]  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1, ...")
    parser.add_argument("--reps", type=int, default=50, help="timed calls per path (default 50)")
    parser.add_argument("--warmup", type=int, default=5, help="calls before counting (default 5)")
    parser.add_argument("--smoke", action="store_true", help="2 repetitions, 10 tensors: runs, nothing to read")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda asked for, but torch.cuda.is_available() is False")
    if args.smoke:
        args.reps, args.warmup = 2, 3
    torch.set_num_threads(1)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"bench_host_ops: torch {torch.__version__} on {where}; counts per call after {args.warmup} warm-up calls; "
          f"host us: median of {args.reps}")  # fmt: skip
    few = [10] if args.smoke else [10, 100]
    groups = {
        "unscale": unscale_paths(device, few if args.smoke else [10, 100, 1000]),
        "clip": clip_paths(device, few),
        "step": step_paths(device, few),
    }
    for table, paths in groups.items():
        counted = [measure(p, device, args.reps, args.warmup) for p in paths]
        print_table(TITLES[table], HEADER, rows_of(counted))
        print("   reads: .item() and copies to the host; AdamW's of its own step counts (host tensors unless")
        print("   capturable) are among them and no sync")
        if device.type == "cpu":
            print("   kernels, syncs: n/a on the CPU (every operator runs on the host there)")
        if table == "step":
            print_sync_free_costs(counted)


def print_sync_free_costs(counted: list[Counted]) -> None:
    """Per optimizer and tensor count, ``sync_free=True`` against the default path (the one flag read it avoids): the
    operators it adds and its host time, medians from the same run."""
    by_key = {(c.path.table, c.path.tensors, c.path.scaler): c for c in counted}
    for (table, tensors, scaler), free in by_key.items():
        default = by_key.get((table, tensors, "dls"))
        if scaler != "dls sync_free" or default is None:
            continue
        syncs = "" if free.syncs is None else f", syncs {free.syncs} vs {default.syncs}"
        print(f"   sync_free vs default, {table.removeprefix('step ')} x{tensors}: ops {free.ops} vs {default.ops}"
              f"{syncs}, host time {free.host_us / default.host_us:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
