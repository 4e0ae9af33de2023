"""Data-parallel float16 training with DDP and ``dls.GradScaler``.

Every rank skips the same steps and holds the same loss scale: the scaler all-reduces its overflow flag (MAX)
across the ranks before it decides, one one-element collective per step. Run it with::

    torchrun --nproc_per_node=2 examples/ddp.py                      # CPU (gloo), or one GPU per rank (NCCL)
    torchrun --nproc_per_node=4 examples/ddp.py --steps 200 --overflow-every 7

``--overflow-every N`` puts an inf into ONE rank's gradients every N steps, after DDP reduced them (a rank-local
overflow, as in a layer that only one rank's data reaches through a non-reduced path): all ranks skip that step
anyway. At the end every rank checks that it holds the same parameters and scaler state as rank 0. The set-up,
data and loop shared with ``examples/fsdp.py`` are in ``examples/_common.py``.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from _common import Data, check_scaler_states_agree, launch, make_model, report, train_loop
from torch.nn.parallel import DistributedDataParallel

import dls


def train(args: argparse.Namespace, device: torch.device, use_cuda: bool) -> None:
    model = make_model(device)  # the same initial model on every rank (DDP also broadcasts rank 0's)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if use_cuda else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # Distributed needs nothing more: with torch.distributed initialised the scaler agrees across the world group
    # (pass process_group= for another one). Gradients are replicated, so the clipping norm is local.
    scaler = dls.GradScaler(max_gradient_norm=1.0)
    train_loop(args, ddp, model[0].weight, optimizer, scaler, Data(device), autocast=True)

    state = check_scaler_states_agree(scaler)
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    assert torch.equal(flat, reference), f"rank {dist.get_rank()} parameters differ from rank 0's"
    report(state, "identical parameters")


if __name__ == "__main__":
    launch(__doc__.split("\n")[0], train)
