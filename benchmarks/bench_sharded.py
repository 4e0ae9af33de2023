"""The scaler's cost per step under FSDP2: dls.ShardedGradScaler against torch's ShardedGradScaler, one run.

Both scalers drive the same FSDP2 run (``fully_shard`` per Linear and the root, ``MixedPrecisionPolicy(float16
params, float32 reduce)``, AdamW), built identically in the same processes and stepped interleaved, at 2 and 4
ranks (gloo on this CPU, 127.0.0.1), with and without ``CPUOffloadPolicy``. Per step, medians over ranks and steps:

* ``unscale_`` (the unscale + inf check pass, and the flag's all-reduce) and ``step + update`` (the skip decision,
  the optimizer's step, the scale update): the optimizer step is the same work under both scalers, so the
  difference between them is the scalers';
* host reads per step made by the scaler (``.item()``, ``bool()``, ...; the optimizer's own excluded): on a GPU
  each is a synchronisation.

Every rank waits at a barrier before each timed call, so a time is the rank's own work plus the collective.

    python benchmarks/bench_sharded.py            # about 3 minutes on 2 cores
    python benchmarks/bench_sharded.py --smoke    # 2 ranks, a few steps: runs, nothing to read
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parents[1] / "src"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def host_reads() -> Iterator[list[str]]:
    """Files of the calls that read a tensor back to the host inside the block (torch.Tensor's methods patched)."""
    import torch

    names = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")
    saved = {name: torch.Tensor.__dict__.get(name) for name in names}
    calls: list[str] = []

    def spy(original: Any) -> Any:
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            calls.append(sys._getframe(1).f_code.co_filename)
            return original(self, *args, **kwargs)

        return wrapper

    for name in names:
        setattr(torch.Tensor, name, spy(getattr(torch.Tensor, name)))
    try:
        yield calls
    finally:
        for name, value in saved.items():
            if value is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, value)


def rank_main(out: Path, steps: int, width: int, layers: int) -> None:
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchSharded

    import dls

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))

    def model(offload: bool) -> torch.nn.Module:
        torch.manual_seed(0)
        mods: list[torch.nn.Module] = [torch.nn.Linear(16, width)]
        for _ in range(layers):
            mods += [torch.nn.Tanh(), torch.nn.Linear(width, width)]
        net = torch.nn.Sequential(*mods, torch.nn.Linear(width, 4))
        kwargs: dict[str, Any] = {"mp_policy": MixedPrecisionPolicy(torch.float16, torch.float32)}
        if offload:
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)  # pinning needs a GPU
        for m in net:
            if isinstance(m, torch.nn.Linear):
                fully_shard(m, **kwargs)
        return fully_shard(net, **kwargs)

    results: dict[str, Any] = {}
    for offload in (False, True):
        runs = {}
        for name, cls in (("torch", TorchSharded), ("dls", dls.ShardedGradScaler)):
            net = model(offload)
            runs[name] = (net, torch.optim.AdamW(net.parameters(), lr=1e-3), cls("cpu", init_scale=2.0**12))
        times: dict[str, dict[str, list[float]]] = {n: {"unscale": [], "step": [], "reads": []} for n in runs}
        for step in range(steps + 2):  # 2 warm-up steps
            gen = torch.Generator().manual_seed(step * 100 + rank)
            x, y = torch.randn(32, 16, generator=gen), torch.randn(32, 4, generator=gen)
            for name, (net, opt, scaler) in runs.items():
                scaler.scale(torch.nn.functional.mse_loss(net(x).float(), y)).backward()
                if step == steps // 2 + 2 and rank == 0:  # one overflow on one rank's shard
                    next(p.grad for p in net.parameters()).to_local().view(-1)[0] = float("inf")
                dist.barrier()
                with host_reads() as calls:
                    start = time.perf_counter()
                    scaler.unscale_(opt)
                    middle = time.perf_counter()
                    scaler.step(opt)
                    scaler.update()
                    end = time.perf_counter()
                opt.zero_grad()
                if step >= 2:
                    times[name]["unscale"].append(middle - start)
                    times[name]["step"].append(end - middle)
                    times[name]["reads"].append(sum(1 for f in calls if f"torch{os.sep}optim{os.sep}" not in f))
        results["offload" if offload else "plain"] = times
    dist.barrier()
    dist.destroy_process_group()
    (out / f"rank{rank}.json").write_text(json.dumps(results))


def launch(world: int, steps: int, width: int, layers: int) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world))
        env.update(OMP_NUM_THREADS="1", PYTHONPATH=path)
        with contextlib.suppress(OSError, StopIteration):
            env["GLOO_SOCKET_IFNAME"] = next(n for _, n in socket.if_nameindex() if n.startswith("lo"))
        sizes = [f"--steps={steps}", f"--width={width}", f"--layers={layers}"]
        cmd = [sys.executable, __file__, "--rank-of", tmp, *sizes]
        procs = [subprocess.Popen(cmd, env=dict(env, RANK=str(r), LOCAL_RANK=str(r))) for r in range(world)]
        codes = [p.wait(timeout=900) for p in procs]
        if codes != [0] * world:
            raise SystemExit(f"bench_sharded: ranks exited with {codes}")
        return [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="2 ranks, 3 steps, a small model")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--rank-of", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_of:
        rank_main(Path(args.rank_of), args.steps, args.width, args.layers)
        return
    worlds, steps, width, layers = ((2,), 3, 32, 2) if args.smoke else ((2, 4), args.steps, args.width, args.layers)
    tensors = 2 * (layers + 2)
    print(f"FSDP2 float16 compute, {layers + 2} Linear layers of width {width} ({tensors} gradient tensors), AdamW, "
          f"{steps} steps (one overflow on rank 0), gloo on CPU; medians over ranks and steps")  # fmt: skip
    print(f"{'ranks':>5} {'offload':>7} | {'unscale_ ms':>19} | {'step+update ms':>19} | {'dls/torch':>9} | "
          f"{'host reads/step':>15}")  # fmt: skip
    print(
        f"{'':>5} {'':>7} | {'torch':>9} {'dls':>9} | {'torch':>9} {'dls':>9} | {'(sum)':>9} | {'torch':>7} {'dls':>7}"
    )
    for world in worlds:
        ranks = launch(world, steps, width, layers)
        for mode in ("plain", "offload"):
            med: dict[str, dict[str, float]] = {}
            for name in ("torch", "dls"):
                med[name] = {
                    k: statistics.median(v for r in ranks for v in r[mode][name][k]) for k in ("unscale", "step")
                }
                med[name]["reads"] = statistics.median(v for r in ranks for v in r[mode][name]["reads"])
            ratio = (med["dls"]["unscale"] + med["dls"]["step"]) / (med["torch"]["unscale"] + med["torch"]["step"])
            t, d = med["torch"], med["dls"]
            unscale = f"{1e3 * t['unscale']:>9.3f} {1e3 * d['unscale']:>9.3f}"
            stepping = f"{1e3 * t['step']:>9.3f} {1e3 * d['step']:>9.3f}"
            reads = f"{t['reads']:>7.0f} {d['reads']:>7.0f}"
            print(f"{world:>5} {mode == 'offload'!s:>7} | {unscale} | {stepping} | {ratio:>8.2f}x | {reads}")
    print("host reads: the scaler's own, per step (the optimizer's are excluded); both scalers skipped the overflow")


if __name__ == "__main__":
    main()
