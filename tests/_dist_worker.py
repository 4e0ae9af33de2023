"""One rank of the distributed tests (``tests/test_distributed.py``): runs scenarios, writes results as JSON.

Started once per rank with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` in the environment (as
torchrun sets them)::

    python tests/_dist_worker.py OUT_DIR SCENARIO [SCENARIO ...]

Each scenario trains a tiny model on CPU with gloo and injects inf/NaN into the gradients of ONE rank (or a few)
after they were reduced, so only those ranks see the overflow unless the scaler agrees on it. Rank ``r``
writes ``OUT_DIR/rank{r}.json``: ``{scenario: result}``.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import dls

RANK = int(os.environ.get("RANK", 0))
WS = int(os.environ.get("WORLD_SIZE", 1))
STEPS = 30
# step -> ranks (mod world size) whose gradients overflow at that step: single ranks, varying, and two at once.
SCHEDULE: dict[int, tuple[int, ...]] = {
    1: (0,),
    4: (-1,),
    5: (1,),
    9: (0, 1),
    13: (-1,),
    14: (2,),
    20: (1,),
    21: (0,),
    27: (-1,),
    31: (1,),
    34: (0,),
}


def overflow_ranks(step: int) -> set[int]:
    return {r % WS for r in SCHEDULE.get(step, ())}


def overflow_steps(steps: Iterable[int]) -> list[int]:
    return [s for s in steps if overflow_ranks(s)]


def make_mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)  # the same initial model on every rank
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)
    )


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)


def poison(grads: list[torch.Tensor], step: int) -> None:
    """Put inf (odd steps) or NaN (even steps) into the first non-empty gradient, on the scheduled ranks only."""
    if RANK not in overflow_ranks(step):
        return
    for g in grads:
        if g.numel():
            g.view(-1)[0] = float("inf") if step % 2 else float("nan")
            return
    raise AssertionError("no gradient to poison on this rank")


def grad(p: torch.Tensor) -> torch.Tensor:
    assert p.grad is not None
    return p.grad


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def train(
    module: torch.nn.Module,
    opt: torch.optim.Optimizer,
    scaler: dls.GradScaler,
    steps: Iterable[int],
    *,
    watched: Callable[[], list[torch.Tensor]],
    explicit_unscale: bool = False,
    after_backward: Callable[[int], None] | None = None,
    after_step: Callable[[], None] | None = None,
) -> list[list[Any]]:
    """Train; per step record [scale, num_skipped_steps, whether this rank's ``watched`` tensors changed]."""
    trace = []
    for step in steps:
        x, y = batch(step, RANK)
        loss = torch.nn.functional.mse_loss(module(x), y)
        scaler.scale(loss).backward()
        if after_backward is not None:
            after_backward(step)
        poison([local(p.grad) for g in opt.param_groups for p in g["params"] if p.grad is not None], step)
        before = [t.detach().clone() for t in watched()]
        if explicit_unscale:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        changed = any(not torch.equal(b, t) for b, t in zip(before, watched()))
        if after_step is not None:
            after_step()
        trace.append([scaler.get_scale(), scaler.get_num_skipped_steps(), changed])
    return trace


def digest(tensors: Iterable[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def resume_check(scaler: dls.GradScaler, **kwargs: Any) -> dict[str, Any]:
    """Every rank loads rank 0's state dict into a fresh scaler; returns both state dicts."""
    holder = [scaler.state_dict()]
    dist.broadcast_object_list(holder, src=0)
    resumed = dls.GradScaler(**kwargs)
    resumed.load_state_dict(holder[0])
    return {"state_dict": scaler.state_dict(), "resumed_state_dict": resumed.state_dict(), "resumed": resumed}


# ---------------------------------------------------------------------- (a) DDP: replicated parameters
def scenario_ddp(kind: str) -> dict[str, Any]:
    model = make_mlp()
    ddp = DistributedDataParallel(model)
    if kind == "fused":
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    kwargs: dict[str, Any] = {"init_scale": 2.0**8, "steps_per_increase": 3}
    if kind == "clip":
        kwargs["max_gradient_norm"] = 0.5
    scaler = dls.GradScaler(**kwargs)
    params: Callable[[], list[torch.Tensor]] = lambda: list(model.parameters())  # noqa: E731
    trace = train(ddp, opt, scaler, range(STEPS), watched=params, explicit_unscale=kind == "unscale")
    result: dict[str, Any] = {"trace": trace, "digest": digest(model.parameters())}
    result["params"] = [p.detach().flatten().tolist() for p in model.parameters()]
    resume = resume_check(scaler, **kwargs)
    result["state_dict"], result["resumed_state_dict"] = resume["state_dict"], resume["resumed_state_dict"]
    # Continue with the resumed scaler: the ranks still agree.
    result["resumed_trace"] = train(ddp, opt, resume["resumed"], range(STEPS, STEPS + 6), watched=params)
    result["resumed_digest"] = digest(model.parameters())
    return result


# ---------------------------------------------------------------------- (b) FSDP2: DTensor shards
def fsdp_model() -> torch.nn.Sequential:
    from torch.distributed.fsdp import fully_shard

    model = make_mlp()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def scenario_fsdp(kind: str) -> dict[str, Any]:
    model = fsdp_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    kwargs: dict[str, Any] = {"init_scale": 2.0**8, "steps_per_increase": 3}
    if kind == "clip":
        kwargs["max_gradient_norm"] = 0.5
    scaler = dls.GradScaler(**kwargs)
    watched: Callable[[], list[torch.Tensor]] = lambda: [local(p) for p in model.parameters()]  # noqa: E731
    trace = train(model, opt, scaler, range(STEPS), watched=watched)
    full = [p.full_tensor() for p in model.parameters()]  # type: ignore[attr-defined]
    result: dict[str, Any] = {"trace": trace, "digest": digest(full), "params": [t.flatten().tolist() for t in full]}
    resume = resume_check(scaler, **kwargs)
    result["state_dict"], result["resumed_state_dict"] = resume["state_dict"], resume["resumed_state_dict"]
    return result


# ---------------------------------------------------------------------- (c) hand-sharded (ZeRO-style)
class HandSharded:
    """Replicated model; each rank's optimizer owns the parameters ``i % world == rank`` and only their (averaged)
    gradients; owners broadcast their parameters after the step."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = list(model.parameters())
        self.owned = [p for i, p in enumerate(self.params) if i % WS == RANK]

    def reduce_and_drop(self, step: int = 0) -> None:
        for i, p in enumerate(self.params):
            assert p.grad is not None
            dist.all_reduce(p.grad)
            p.grad.div_(WS)
            if i % WS != RANK:
                p.grad = None

    def broadcast(self) -> None:
        with torch.no_grad():
            for i, p in enumerate(self.params):
                dist.broadcast(p.data, src=i % WS)

    def full_grads(self) -> list[torch.Tensor]:
        out = []
        for i, p in enumerate(self.params):
            g = p.grad.detach().clone() if i % WS == RANK and p.grad is not None else torch.zeros_like(p)
            dist.broadcast(g, src=i % WS)
            out.append(g)
        return out


def scenario_zero(kind: str) -> dict[str, Any]:
    model = make_mlp()
    shards = HandSharded(model)
    opt = torch.optim.SGD(shards.owned, lr=0.05, momentum=0.9, weight_decay=1e-3)
    kwargs: dict[str, Any] = {"init_scale": 2.0**8, "steps_per_increase": 3}
    if kind == "clip":  # sharded global norm (plain tensors) + the device-side masked step
        kwargs.update(max_gradient_norm=0.5, gradients_sharded=True, sync_free=True)
    scaler = dls.GradScaler(**kwargs)
    trace = train(
        model,
        opt,
        scaler,
        range(STEPS),
        watched=lambda: list(shards.owned),
        explicit_unscale=kind == "flag",
        after_backward=shards.reduce_and_drop,
        after_step=shards.broadcast,
    )
    return {"trace": trace, "digest": digest(model.parameters()), "state_dict": scaler.state_dict()}


def scenario_noagree() -> dict[str, Any]:
    """Negative control: layout (c) with the agreement switched off must fork the ranks' skip decisions."""
    saved = dls.distributed.start_agreement, dls.distributed.agree_on_overflow
    dls.distributed.start_agreement = lambda found_inf, group=None: None
    dls.distributed.agree_on_overflow = lambda found_inf, group=None: found_inf
    try:
        return scenario_zero("flag")
    finally:
        dls.distributed.start_agreement, dls.distributed.agree_on_overflow = saved


# ---------------------------------------------------------------------- clipping with sharded gradients
def scenario_clip_equiv() -> dict[str, Any]:
    """Clip once with max_gradient_norm; every rank returns the full clipped gradients of each layout and of the
    unsharded model trained on the global batch (clip_grad_norm_)."""
    max_norm = 0.05
    step = 3
    ref = make_mlp()
    losses = [torch.nn.functional.mse_loss(ref(x), y) for x, y in (batch(step, r) for r in range(WS))]
    torch.stack(losses).mean().backward()
    ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm))
    result: dict[str, Any] = {"ref_norm": ref_norm, "ref": [grad(p).flatten().tolist() for p in ref.parameters()]}
    x, y = batch(step, RANK)

    model = fsdp_model()
    opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = dls.GradScaler(init_scale=2.0**10, max_gradient_norm=max_norm)
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    result["fsdp_finite"] = bool(scaler.clip_gradients_and_return_isfinite(opt))
    result["fsdp"] = [grad(p).full_tensor().flatten().tolist() for p in model.parameters()]  # type: ignore[attr-defined]

    for name, sharded in (("zero", True), ("zero_local", False)):
        model = make_mlp()
        shards = HandSharded(model)
        opt = torch.optim.SGD(shards.owned, lr=0.0)
        scaler = dls.GradScaler(init_scale=2.0**10, max_gradient_norm=max_norm, gradients_sharded=sharded)
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        shards.reduce_and_drop()
        result[f"{name}_finite"] = bool(scaler.clip_gradients_and_return_isfinite(opt))
        result[name] = [g.flatten().tolist() for g in shards.full_grads()]
    return result


# ---------------------------------------------------------------------- a rank without gradients
def scenario_nograd() -> dict[str, Any]:
    """Rank 1 holds no gradient at all on some steps (while rank 0 may overflow): every path still joins the
    collectives (flag after unscale_, fused optimizer, sharded clipping)."""
    out: dict[str, Any] = {}
    for kind in ("flag", "fused", "clip"):
        model = make_mlp()
        shards = HandSharded(model)
        if kind == "fused":
            opt: torch.optim.Optimizer = torch.optim.AdamW(shards.owned, lr=1e-2, fused=True)
        else:
            opt = torch.optim.SGD(shards.owned, lr=0.05)
        kwargs: dict[str, Any] = {"init_scale": 2.0**8, "steps_per_increase": 2}
        if kind == "clip":
            kwargs.update(max_gradient_norm=0.5, gradients_sharded=True)
        scaler = dls.GradScaler(**kwargs)
        trace = []
        for step in range(6):
            x, y = batch(step, RANK)
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            shards.reduce_and_drop()
            if RANK == 1 and step % 2 == 0:
                opt.zero_grad(set_to_none=True)  # no gradients on this rank this step
            if RANK == 0 and step in (2, 3):
                next(p.grad for p in shards.owned if p.grad is not None).view(-1)[0] = float("inf")
            if kind == "flag":
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            shards.broadcast()
            trace.append([scaler.get_scale(), scaler.get_num_skipped_steps()])
        out[kind] = trace
    return out


SCENARIOS: dict[str, Callable[[], dict[str, Any]]] = {
    "ddp": lambda: scenario_ddp("unscale"),
    "ddp_fused": lambda: scenario_ddp("fused"),
    "ddp_clip": lambda: scenario_ddp("clip"),
    "fsdp": lambda: scenario_fsdp("plain"),
    "fsdp_clip": lambda: scenario_fsdp("clip"),
    "zero": lambda: scenario_zero("flag"),
    "zero_clip": lambda: scenario_zero("clip"),
    "noagree": scenario_noagree,
    "clip_equiv": scenario_clip_equiv,
    "nograd": scenario_nograd,
}


def main() -> None:
    out_dir, names = sys.argv[1], sys.argv[2:]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(os.environ.get("DLS_PG_TIMEOUT", 60))))
    try:
        results: dict[str, Any] = {name: SCENARIOS[name]() for name in names}
        resumed = overflow_steps(range(STEPS, STEPS + 6))
        results["schedule"] = {"steps": overflow_steps(range(STEPS)), "resumed": resumed}
        dist.barrier()
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{RANK}.json"), "w") as f:
        json.dump(results, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the interpreter's slow teardown of torch


if __name__ == "__main__":
    main()
