"""One rank of the master-weights DDP test (``tests/test_master_weights.py``): a half-precision model under DDP
(gloo, CPU) with ``dls.master_weights`` and a dynamic ``dls.GradScaler``; an overflow is injected on rank 1 only,
after the all-reduce. Writes ``OUT_DIR/rank{r}.json``: per dtype, what the test compares across ranks.

    python tests/_master_dist_worker.py OUT_DIR      (started once per rank by ``conftest.launch_ranks``)
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import dls
from conftest import run_rank
from dls.master_weights import master_weights

RANK = int(os.environ["RANK"])
STEPS = 6
POISON_STEP = 3  # on rank 1 only


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 8, generator=gen), torch.randn(16, 2, generator=gen)


def run(dtype: torch.dtype) -> dict[str, Any]:
    torch.manual_seed(0)  # the same initial model on every rank
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)).to(dtype)
    ddp = DistributedDataParallel(model)
    opt = master_weights(torch.optim.AdamW(model.parameters(), lr=1e-3))
    scaler = dls.GradScaler(loss_scale="dynamic", init_scale=2.0**8)
    x_eval, y_eval = batch(99, 0)

    def eval_loss() -> float:
        with torch.no_grad():
            return torch.nn.functional.mse_loss(model(x_eval.to(dtype)).float(), y_eval).item()

    loss_before = eval_loss()
    skipped, reduced_in_half, grad_dtypes = [], True, set()
    for step in range(STEPS):
        x, y = batch(step, RANK)
        loss = torch.nn.functional.mse_loss(ddp(x.to(dtype)).float(), y)
        scaler.scale(loss).backward()
        grads = [p.grad for p in model.parameters()]
        assert all(g is not None for g in grads)
        grad_dtypes |= {str(g.dtype).removeprefix("torch.") for g in grads if g is not None}
        # The half gradients are what DDP reduced: every rank holds the same bits.
        flat = torch.cat([g.reshape(-1).float() for g in grads if g is not None])
        others = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(others, flat)
        reduced_in_half &= all(torch.equal(o, flat) for o in others)
        if step == POISON_STEP and RANK == 1:
            grads[0].view(-1)[0] = float("inf")  # type: ignore[union-attr]
        scaler.step(opt)
        scaler.update()
        if scaler.step_was_skipped(opt):
            skipped.append(step)
        opt.zero_grad()
    masters = [opt.master_of(p) for p in model.parameters()]
    return {
        "param_dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()}),
        "grad_dtypes": sorted(grad_dtypes),
        "reduced_in_half": reduced_in_half,
        "skipped": skipped,
        "params": [p.float().reshape(-1).tolist() for p in model.parameters()],
        "masters": [m.reshape(-1).tolist() for m in masters],
        "state": [[opt.state[m][k].reshape(-1).tolist() for k in ("exp_avg", "exp_avg_sq")] for m in masters],
        "masters_finer_than_params": any(not torch.equal(m, m.to(dtype).float()) for m in masters),
        "loss_before": loss_before,
        "loss_after": eval_loss(),
    }


def main() -> None:
    run_rank(lambda: {name: run(getattr(torch, name)) for name in ("float16", "bfloat16")})


if __name__ == "__main__":
    main()
