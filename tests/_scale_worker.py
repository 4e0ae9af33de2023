"""One rank of ``tests/test_fsdp_mesh.py``: FSDP2 with float16 compute, the 2-D device mesh, DCP checkpoints.

Started once per rank (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` as torchrun sets them)::

    python tests/_scale_worker.py OUT_DIR SCENARIO [SCENARIO ...]

and writes ``OUT_DIR/rank{r}.json``: ``{scenario: result}``. The process group is shared by every scenario of a
launch. Each scenario is a function of the device it runs on: ``DLS_TEST_DEVICE`` (default ``cpu``) and
``DLS_TEST_BACKEND`` (default ``gloo``; ``nccl`` with ``cuda``) choose them, so that the same code runs on
CUDA + NCCL, at world size 1 too (``torchrun --nproc_per_node=1 tests/_scale_worker.py OUT dropin mesh_norm``).
Shared files (the DCP checkpoints) go to ``DLS_SCALE_SHARED`` (default: ``OUT_DIR``).
"""

from __future__ import annotations

import datetime
import gc
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import dls

RANK = int(os.environ.get("RANK", 0))
WS = int(os.environ.get("WORLD_SIZE", 1))
STEPS = 30
# step -> ranks (mod world size) whose local gradient shard overflows at that step.
SCHEDULE: dict[int, tuple[int, ...]] = {3: (1,), 7: (0,), 8: (-1,), 15: (2,), 16: (0, 1), 22: (-1,), 27: (1,)}


def overflow_ranks(step: int) -> set[int]:
    return {r % WS for r in SCHEDULE.get(step, ())}


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def poison(params: Iterable[torch.Tensor], step: int, ranks: set[int] | None = None) -> bool:
    """inf (odd steps) or NaN (even) into the first non-empty local gradient shard, on the scheduled ranks."""
    if RANK not in (overflow_ranks(step) if ranks is None else ranks):
        return False
    for p in params:
        if p.grad is not None and local(p.grad).numel():
            local(p.grad).view(-1)[0] = float("inf") if step % 2 else float("nan")
            return True
    raise AssertionError("no gradient shard to poison on this rank")


def digest(tensors: Iterable[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def optimizer_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [full(v) for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """This rank's local parameters and optimizer state, copied."""
    opt_local = [local(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return [local(t).detach().clone() for t in [*model.parameters(), *opt_local]]


def batch(step: int, dp_rank: int, device: torch.device, d_in: int = 8, d_out: int = 4) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(1000 * step + dp_rank)
    return torch.randn(16, d_in, generator=gen).to(device), torch.randn(16, d_out, generator=gen).to(device)


# ---------------------------------------------------------------------- (1) the ShardedGradScaler drop-in
def fp16_model(device: torch.device, layers: int = 2, offload: bool = False) -> nn.Module:
    """Linear → [LayerNorm → Tanh → Linear] x layers → Linear, each Linear and the root ``fully_shard``-ed with
    float16 parameters in compute and float32 gradient reduction (optionally offloaded to the CPU)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    mods: list[nn.Module] = [nn.Linear(8, 32)]
    for _ in range(layers):
        mods += [nn.LayerNorm(32), nn.Tanh(), nn.Linear(32, 32)]
    model = nn.Sequential(*mods, nn.Linear(32, 4)).to(device)
    kwargs: dict[str, Any] = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)}
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type != "cpu")  # pinning needs a GPU
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, **kwargs)
    fully_shard(model, **kwargs)
    return model


def train_fp16(
    make_scaler: Callable[[], Any], device: torch.device, steps: int, clip: bool, offload: bool = False, layers: int = 2
) -> tuple[nn.Module, torch.optim.Optimizer, Any, list[list[Any]]]:
    model = fp16_model(device, layers, offload)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = make_scaler()
    trace = []
    for step in range(steps):
        x, y = batch(step, RANK, device)
        loss = nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        poison(model.parameters(), step)
        if clip:  # verl's order: unscale_, torch's clip_grad_norm_ over the DTensor parameters, step, update
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        trace.append([scaler.get_scale(), int(opt.state[next(iter(model.parameters()))]["step"]) if opt.state else 0])
    return model, opt, scaler, trace


def scenario_dropin(device: torch.device) -> dict[str, Any]:
    """The same line with torch's ShardedGradScaler and dls's, on the same FSDP2 float16 run (overflows from the
    forward's float16 at the first scales, and injected into one rank's shard)."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchSharded

    out: dict[str, Any] = {}
    for clip in (False, True):
        for name, cls in (("torch", TorchSharded), ("dls", dls.ShardedGradScaler)):
            model, opt, scaler, trace = train_fp16(
                lambda cls=cls: cls(device.type, init_scale=2.0**24, growth_interval=4), device, STEPS, clip
            )
            key = f"{name}{'_clip' if clip else ''}"
            out[key] = {
                "trace": trace,
                "params": digest(full(p) for p in model.parameters()),
                "optimizer": digest(optimizer_tensors(opt)),
                "state_dict": {k: scaler.state_dict()[k] for k in ("scale", "_growth_tracker")},
            }
    return out


def scenario_offload(device: torch.device) -> dict[str, Any]:
    """Host reads per step (``conftest.host_reads``: .item(), bool(), ...) made by each scaler's step() and update()
    with FSDP2's CPUOffloadPolicy, for a model of 2 and of 6 layers (more than twice the gradient tensors)."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchSharded

    from conftest import host_reads

    out: dict[str, Any] = {}
    for layers in (2, 6):
        for name, cls in (("torch", TorchSharded), ("dls", dls.ShardedGradScaler)):
            model = fp16_model(device, layers, offload=True)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            scaler = cls(device.type, init_scale=2.0**10, growth_interval=3)
            reads = []
            for step in range(6):
                x, y = batch(step, RANK, device)
                scaler.scale(nn.functional.mse_loss(model(x).float(), y)).backward()
                poison(model.parameters(), step, ranks={0} if step == 4 else set())
                with host_reads() as calls:
                    scaler.step(opt)
                    scaler.update()
                # The optimizer's own reads (Adam's for-loop path reads each parameter's step count) are not
                # the scaler's: what is left is what each scaler adds.
                reads.append(sum(1 for _, where in calls if f"torch{os.sep}optim{os.sep}" not in where))
                opt.zero_grad()
            grads = sum(1 for p in model.parameters())
            out[f"{name}_{layers}"] = {"reads": reads, "tensors": grads, "skipped": step_count_skips(opt, 6)}
    return out


def step_count_skips(opt: torch.optim.Optimizer, steps: int) -> int:
    return steps - int(next(iter(opt.state.values()))["step"])


# ---------------------------------------------------------------------- (2) the 2-D mesh: dp x tp
def mesh_2d(device: torch.device) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    tp = 2 if WS % 2 == 0 else 1
    return init_device_mesh(device.type, (WS // tp, tp), mesh_dim_names=("dp", "tp"))


def tp_model(device: torch.device, mesh: Any, norms: bool = False) -> nn.Module:
    """[Linear (colwise) → Tanh → Linear (rowwise)] x 2 over ``tp``, then ``fully_shard`` over ``dp``: the linears'
    parameters live on the 2-D mesh (``_StridedShard`` over dp where tp shards dim 0). ``norms``: a LayerNorm before
    each pair, left out of the tensor-parallel plan, so that FSDP shards it over ``dp`` only (a 1-D mesh next to
    the 2-D one: ``clip_grad_norm_`` refuses such a model)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    mods: list[nn.Module] = []
    plan: dict[str, Any] = {}
    for _ in range(2):
        if norms:
            mods.append(nn.LayerNorm(8))
        plan[str(len(mods))] = ColwiseParallel()
        mods += [nn.Linear(8, 32), nn.Tanh()]
        plan[str(len(mods))] = RowwiseParallel()
        mods.append(nn.Linear(32, 8))
    model = nn.Sequential(*mods).to(device)
    parallelize_module(model, mesh["tp"], plan)
    for m in model:
        if isinstance(m, (nn.Linear, nn.LayerNorm)):
            fully_shard(m, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def reference_model(device: torch.device, norms: bool = False) -> nn.Module:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(2):
        if norms:
            mods.append(nn.LayerNorm(8))
        mods += [nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 8)]
    return nn.Sequential(*mods).to(device)


def mesh_loss(model: nn.Module, step: int, dp_rank: int, device: torch.device) -> torch.Tensor:
    x, y = batch(step, dp_rank, device, 8, 8)
    return nn.functional.mse_loss(model(x), y)


def reference_loss(model: nn.Module, step: int, dp: int, device: torch.device) -> torch.Tensor:
    """The loss whose gradient FSDP's averaged one is: the mean over the data-parallel ranks' batches."""
    return torch.stack([mesh_loss(model, step, r, device) for r in range(dp)]).mean()


def scenario_mesh_norm(device: torch.device) -> dict[str, Any]:
    """dls's global norm on the 2-D mesh, against torch's clip_grad_norm_ over the same DTensor parameters, the
    norm of the gathered full gradients and the unsharded model's; then the layout clip_grad_norm_ refuses."""
    mesh = mesh_2d(device)
    dp = mesh["dp"].size()
    out: dict[str, Any] = {"placements": {}}
    for norms in (False, True):
        model = tp_model(device, mesh, norms)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        scaler = dls.GradScaler(init_scale=2.0**8, max_gradient_norm=0.1)
        scaler.scale(mesh_loss(model, 0, mesh["dp"].get_local_rank(), device)).backward()
        full_norm = float(
            torch.linalg.vector_norm(torch.stack([full(p.grad).norm() / 2.0**8 for p in model.parameters()]))
        )
        entry: dict[str, Any] = {"full": full_norm}
        if not norms:
            unscaled = [p.grad.detach() / 2.0**8 for p in model.parameters()]
            entry["torch"] = float(full(torch.nn.utils.get_total_norm(unscaled)))
        else:
            try:
                torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
                entry["torch_refuses"] = False
            except Exception:  # mixed meshes: DTensor refuses to stack their norms
                entry["torch_refuses"] = True
        finite, norm = scaler.clip_gradients_and_return_isfinite(opt, return_norm=True)
        entry["dls"], entry["finite"] = float(norm), bool(finite)
        entry["clipped_full"] = float(
            torch.linalg.vector_norm(torch.stack([full(p.grad).norm() for p in model.parameters()]))
        )
        ref = reference_model(device, norms)
        reference_loss(ref, 0, dp, device).backward()
        entry["reference"] = float(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]))
        out["norms" if norms else "tp"] = entry
        out["placements"]["norms" if norms else "tp"] = sorted(
            {f"{tuple(p.device_mesh.mesh.shape)}{p.placements}" for p in model.parameters()}
        )
    return out


@contextmanager
def counting_all_reduces() -> Iterator[list[int]]:
    """Count the all-reduces dls launches (``dls.distributed._all_reduce``)."""
    calls: list[int] = []
    saved = dls.distributed._all_reduce

    def counted(tensor: torch.Tensor, op: Any, group: Any, async_op: bool) -> Any:
        calls.append(dist.get_world_size(group))
        return saved(tensor, op, group, async_op)

    dls.distributed._all_reduce = counted
    try:
        yield calls
    finally:
        dls.distributed._all_reduce = saved


def scenario_mesh_train(device: torch.device) -> dict[str, Any]:
    """Training on the 2-D mesh, overflows injected into one rank's shard: per step whether this rank's local
    parameters and optimizer state changed, the scale, dls's all-reduces; at the end the full parameters and
    those of the unsharded model trained on the same global batches with the same scaler settings."""
    mesh = mesh_2d(device)
    dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    out: dict[str, Any] = {}
    kinds: dict[str, tuple[Callable[[Any], torch.optim.Optimizer], dict[str, Any]]] = {
        "plain": (lambda ps: torch.optim.Adam(ps, lr=1e-2), {}),
        "clip": (lambda ps: torch.optim.Adam(ps, lr=1e-2), {"max_gradient_norm": 0.05}),
        "fused": (lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True), {"max_gradient_norm": 0.05}),
        "sync_free": (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), {"sync_free": True}),
    }
    for kind, (make_opt, kwargs) in kinds.items():
        results = {}
        for where in ("mesh", "reference"):
            sharded = where == "mesh"
            model = tp_model(device, mesh) if sharded else reference_model(device)
            opt = make_opt(list(model.parameters()))
            scaler = dls.GradScaler(init_scale=2.0**8, steps_per_increase=3, **kwargs)
            trace, reduces = [], []
            for step in range(12):
                loss = mesh_loss(model, step, dp_rank, device) if sharded else reference_loss(model, step, dp, device)
                scaler.scale(loss).backward()
                overflow = bool(overflow_ranks(step))
                if sharded:
                    poison(model.parameters(), step)
                elif overflow:  # the unsharded model overflows where some rank's shard did
                    next(iter(model.parameters())).grad.view(-1)[0] = float("inf")
                before = snapshot(model, opt) if opt.state else None
                with counting_all_reduces() as calls:
                    scaler.step(opt)
                    scaler.update()
                opt.zero_grad()
                after = snapshot(model, opt)
                changed = before is None or any(not torch.equal(a, b) for a, b in zip(before, after))
                trace.append([scaler.get_scale(), scaler.get_num_skipped_steps(), changed])
                reduces.append(calls)
            results[where] = {
                "trace": trace,
                "reduces": reduces,
                "params": [full(p).flatten().tolist() for p in model.parameters()],
            }
        out[kind] = results
    return out


# ---------------------------------------------------------------------- (3) torch.distributed.checkpoint
class AppState:
    """A DCP ``Stateful``: model and optimizer through ``get_state_dict`` (sharded, resharding on load), and the
    scaler when it is given (else the scaler is its own entry of the saved state dict, as torchtitan does)."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, scaler: Any = None) -> None:
        self.model, self.opt, self.scaler = model, opt, scaler

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, opt_sd = get_state_dict(self.model, self.opt)
        state = {"model": model_sd, "optim": opt_sd}
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])


def dcp_layouts(device: torch.device) -> dict[str, Callable[[], nn.Module]]:
    """The layouts saved and loaded: FSDP2 over every rank (the scaler inside the app state), and the 2-D mesh
    (the scaler its own Stateful entry) where the world is even."""
    layouts: dict[str, Callable[[], nn.Module]] = {"fsdp": lambda: fsdp_model(device)}
    if WS % 2 == 0 and WS > 2:
        layouts["mesh"] = lambda: tp_model(device, mesh_2d(device))
    return layouts


def fsdp_model(device: torch.device, norms: bool = True) -> nn.Module:
    """``reference_model`` with FSDP2 over every rank."""
    from torch.distributed.fsdp import fully_shard

    model = reference_model(device, norms)
    for m in model:
        if isinstance(m, (nn.Linear, nn.LayerNorm)):
            fully_shard(m)
    fully_shard(model)
    return model


def dcp_train(model: nn.Module, opt: torch.optim.Optimizer, scaler: Any, steps: range, device: torch.device) -> None:
    mesh = next(iter(model.parameters())).device_mesh
    dp_rank = mesh.get_coordinate()[0]  # the ranks of a tensor-parallel group see the same batch
    for step in steps:
        scaler.scale(mesh_loss(model, step, dp_rank, device)).backward()
        poison(model.parameters(), step)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


def dcp_parts(make_model: Callable[[], nn.Module]) -> tuple[nn.Module, torch.optim.Optimizer, dls.GradScaler]:
    model = make_model()
    return model, torch.optim.Adam(model.parameters(), lr=1e-2), dls.GradScaler(init_scale=2.0**8, steps_per_increase=3)


def dcp_state(name: str, model: nn.Module, opt: torch.optim.Optimizer, scaler: Any) -> dict[str, Any]:
    if name == "fsdp":
        return {"app": AppState(model, opt, scaler)}
    return {"app": AppState(model, opt), "scaler": scaler}


def summary(model: nn.Module, opt: torch.optim.Optimizer, scaler: Any) -> dict[str, Any]:
    return {
        "params": digest(full(p) for p in model.parameters()),
        "optimizer": digest(optimizer_tensors(opt)),
        "scaler": scaler.state_dict(),
    }


def shared_dir() -> Path:
    return Path(os.environ.get("DLS_SCALE_SHARED", sys.argv[1]))


def scenario_dcp_save(device: torch.device) -> dict[str, Any]:
    """Save after 12 steps; one run goes on to 18, another loads the checkpoint into fresh objects and trains the
    same 6 steps: both end bit-identical. The checkpoint stays in ``DLS_SCALE_SHARED`` for a launch at another
    world size (``dcp_load``)."""
    import torch.distributed.checkpoint as dcp

    out: dict[str, Any] = {}
    for name, make_model in dcp_layouts(device).items():
        path = shared_dir() / f"dcp_{name}_{WS}"
        model, opt, scaler = dcp_parts(make_model)
        dcp_train(model, opt, scaler, range(12), device)
        dcp.save(dcp_state(name, model, opt, scaler), checkpoint_id=str(path))
        saved = summary(model, opt, scaler)
        dcp_train(model, opt, scaler, range(12, 18), device)
        model2, opt2, scaler2 = dcp_parts(make_model)
        dcp.load(dcp_state(name, model2, opt2, scaler2), checkpoint_id=str(path))
        loaded = summary(model2, opt2, scaler2)
        dcp_train(model2, opt2, scaler2, range(12, 18), device)
        out[name] = {"saved": saved, "loaded": loaded, "straight": summary(model, opt, scaler),
                     "resumed": summary(model2, opt2, scaler2), "path": str(path)}  # fmt: skip
    return out


def scenario_dcp_load(device: torch.device) -> dict[str, Any]:
    """Load the checkpoints a 4-rank launch saved (``dcp_save``: FSDP2 over 4 ranks, and dp=2 x tp=2) into FSDP2
    over this launch's ranks: resharded."""
    import torch.distributed.checkpoint as dcp

    out: dict[str, Any] = {}
    for name in ("fsdp", "mesh"):
        path = shared_dir() / f"dcp_{name}_4"
        model, opt, scaler = dcp_parts(lambda name=name: fsdp_model(device, norms=name == "fsdp"))
        dcp.load(dcp_state(name, model, opt, scaler), checkpoint_id=str(path))
        out[name] = summary(model, opt, scaler)
        dcp_train(model, opt, scaler, range(12, 18), device)  # and it trains on
        out[name]["trained"] = summary(model, opt, scaler)["scaler"]
    return out


SCENARIOS: dict[str, Callable[[torch.device], dict[str, Any]]] = {
    "dropin": scenario_dropin,
    "offload": scenario_offload,
    "mesh_norm": scenario_mesh_norm,
    "mesh_train": scenario_mesh_train,
    "dcp_save": scenario_dcp_save,
    "dcp_load": scenario_dcp_load,
}


def run(names: list[str], device: torch.device, backend: str) -> dict[str, Any]:
    """Join the process group the environment describes, run the scenarios, leave it: the entry point for
    CUDA + NCCL runs too."""
    timeout = datetime.timedelta(seconds=float(os.environ.get("DLS_PG_TIMEOUT", 120)))
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(backend, timeout=timeout)
    try:
        results: dict[str, Any] = {"seconds": {}}
        for name in names:
            start = time.perf_counter()
            results[name] = SCENARIOS[name](device)
            results["seconds"][name] = round(time.perf_counter() - start, 1)  # what each scenario costs
        dist.barrier()
    finally:
        gc.collect()
        dist.destroy_process_group()
    return results


def main() -> None:
    out_dir, names = Path(sys.argv[1]), sys.argv[2:]
    torch.set_num_threads(1)
    device = torch.device(os.environ.get("DLS_TEST_DEVICE", "cpu"))
    backend = os.environ.get("DLS_TEST_BACKEND", "nccl" if device.type == "cuda" else "gloo")
    results = run(names, device, backend)
    (out_dir / f"rank{RANK}.json").write_text(json.dumps(results))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the interpreter's slow teardown of torch


if __name__ == "__main__":
    main()
