"""One rank of the FP8 distributed test (``tests/test_fp8_distributed.py``): DDP with delayed FP8 scaling.

Started once per rank by ``conftest.launch_ranks`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` in
the environment)::

    python tests/_fp8_dist_worker.py OUT_DIR

Trains the same small MLP twice under ``dls.fp8.emulate_recipe(..., DelayedScaling)`` wrapped in DDP (gloo, CPU),
each rank on its own data (rank r's inputs are scaled by 1 + r, so the ranks' amaxes differ):

* ``agree``: amaxes reduced over the world (the default ``process_group``);
* ``local``: each rank reduces over a group of its own, i.e. not across ranks.

Rank ``r`` writes ``OUT_DIR/rank{r}.json``: per scenario the final parameters, the handle's state (histories
and scales) and the amax of the first layer's input as this rank saw it at each step.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import dls.fp8
from conftest import run_rank

RANK = int(os.environ["RANK"])
WS = int(os.environ["WORLD_SIZE"])
STEPS = 5


def train(process_group: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)
    )
    handle = dls.fp8.emulate_recipe(model, dls.fp8.DelayedScaling(amax_history_len=8), process_group=process_group)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    local_amax = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(1000 * step + RANK)
        x = torch.randn(16, 8, generator=gen) * (1 + RANK)
        y = torch.randn(16, 4, generator=gen)
        local_amax.append(x.abs().max().item())
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    state = {
        name: {role: {"amax_history": e["amax_history"].tolist(), "scale": e["scale"].item()} for role, e in r.items()}
        for name, r in handle.state_dict()["modules"].items()
    }
    return {
        "params": [v for p in model.parameters() for v in p.detach().flatten().tolist()],
        "state": state,
        "local_input_amax": local_amax,
    }


def scenarios() -> dict[str, Any]:
    own_groups = [dist.new_group([r]) for r in range(WS)]  # every rank creates every group, in order
    return {"agree": train(None), "local": train(own_groups[RANK])}


def main() -> None:
    run_rank(scenarios)


if __name__ == "__main__":
    main()
