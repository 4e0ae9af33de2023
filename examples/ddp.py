"""Data-parallel float16 training with DDP and ``dls.GradScaler``.

Every rank skips the same steps and holds the same loss scale: the scaler all-reduces its overflow flag (MAX)
across the ranks before it decides, one one-element collective per step. Run it with::

    torchrun --nproc_per_node=2 examples/ddp.py                      # CPU (gloo), or one GPU per rank (NCCL)
    torchrun --nproc_per_node=4 examples/ddp.py --steps 200 --overflow-every 7

``--overflow-every N`` puts an inf into ONE rank's gradients every N steps, after DDP reduced them (a rank-local
overflow, as in a layer that only one rank's data reaches through a non-reduced path): all ranks skip that step
anyway. At the end every rank checks that it holds the same parameters and scaler state as rank 0.
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import dls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--overflow-every", type=int, default=10, help="0: no injected overflow")
    parser.add_argument("--cpu", action="store_true", help="use gloo on CPU even when CUDA is available")
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available() and not args.cpu
    dist.init_process_group("nccl" if use_cuda else "gloo")
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    train(args, device, use_cuda)
    # Free the model and optimizer (their tensors and hooks hold the process group) before destroying the group:
    # with gloo, a group still referenced at interpreter exit can abort the process as it shuts down.
    gc.collect()
    dist.destroy_process_group()


def train(args: argparse.Namespace, device: torch.device, use_cuda: bool) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial model on every rank (DDP also broadcasts rank 0's)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 1)
    ).to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if use_cuda else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # Distributed needs nothing more: with torch.distributed initialised the scaler agrees across the world group
    # (pass process_group= for another one). Gradients are replicated, so the clipping norm is local.
    scaler = dls.GradScaler(max_gradient_norm=1.0)

    data = torch.Generator().manual_seed(1 + rank)  # every rank its own batches
    target = torch.randn(32, 1, generator=torch.Generator().manual_seed(0))
    first_weight = next(model.parameters())
    for step in range(args.steps):
        x = torch.randn(64, 32, generator=data).to(device)
        y = x @ target.to(device)
        with torch.autocast(device.type, dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(ddp(x).float(), y)
        scaler.scale(loss).backward()
        every = args.overflow_every
        if every and step % every == every - 1 and rank == (step // every) % world:
            grad = first_weight.grad
            assert grad is not None
            grad.view(-1)[0] = float("inf")  # only this rank sees it
        scaler.step(optimizer)  # unscale, clip, and skip on every rank if any rank overflowed
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0 and (step % 20 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.5f}  scale {scaler.get_scale():g}", flush=True)

    # The scaler state is identical on every rank, so any rank's state_dict() can go into the checkpoint.
    states: list[object] = [None] * world
    dist.all_gather_object(states, scaler.state_dict())
    assert all(s == states[0] for s in states), f"scaler states differ across ranks: {states}"
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    assert torch.equal(flat, reference), f"rank {rank} parameters differ from rank 0's"
    if rank == 0:
        state = scaler.state_dict()
        print(
            f"all {world} ranks agree: scale {state['loss_scale']:g}, {state['num_skipped_steps']} skipped steps, "
            "identical parameters",
            flush=True,
        )


if __name__ == "__main__":
    main()
