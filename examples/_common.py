"""What ``examples/ddp.py`` and ``examples/fsdp.py`` share: the command line, the process group, the model and data,
the training loop with rank-local overflows, and the final check that every rank agrees. Not an example on its own:
run one of those two with torchrun."""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

import dls


def launch(description: str, train: Callable[[argparse.Namespace, torch.device, bool], None]) -> None:
    """Parse the common options, join the process group (NCCL with one GPU per rank, else gloo on CPU), run
    ``train(args, device, use_cuda)``, leave the group."""
    parser = argparse.ArgumentParser(description=description)
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


def make_model(device: torch.device) -> torch.nn.Sequential:
    """The same initial MLP on every rank (seeded)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 1)
    ).to(device)


class Data:
    """A linear regression task: every rank draws its own batches, all of the same target."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.generator = torch.Generator().manual_seed(1 + dist.get_rank())
        self.target = torch.randn(32, 1, generator=torch.Generator().manual_seed(0)).to(device)

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(64, 32, generator=self.generator).to(self.device)
        return x, x @ self.target


def train_loop(
    args: argparse.Namespace,
    forward: Callable[[torch.Tensor], torch.Tensor],
    poisoned: torch.nn.Parameter,
    optimizer: torch.optim.Optimizer,
    scaler: dls.GradScaler,
    data: Data,
    autocast: bool,
) -> None:
    """Train for ``args.steps`` steps. Every ``args.overflow_every`` steps ONE rank (in turn) puts an inf into its
    own part of ``poisoned``'s gradient after backward (after DDP reduced it, or into its FSDP shard): a rank-local
    overflow, which every rank must skip anyway."""
    rank, world = dist.get_rank(), dist.get_world_size()
    every = args.overflow_every
    device_type = data.device.type
    for step in range(args.steps):
        x, y = data.batch()
        context = torch.autocast(device_type, dtype=torch.float16) if autocast else contextlib.nullcontext()
        with context:
            loss = torch.nn.functional.mse_loss(forward(x).float(), y)
        scaler.scale(loss).backward()
        if every and step % every == every - 1 and rank == (step // every) % world:
            grad = poisoned.grad
            assert grad is not None
            local = grad.to_local() if hasattr(grad, "to_local") else grad  # an FSDP2 DTensor: this rank's shard
            local.view(-1)[0] = float("inf")  # only this rank sees it
        scaler.step(optimizer)  # unscale, clip, and skip on every rank if any rank overflowed
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0 and (step % 20 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.5f}  scale {scaler.get_scale():g}", flush=True)


def check_scaler_states_agree(scaler: dls.GradScaler) -> dict[str, float]:
    """Assert that every rank holds the same scaler state (so any rank's ``state_dict()`` can go into a checkpoint);
    returns it."""
    states: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(states, scaler.state_dict())
    assert all(s == states[0] for s in states), f"scaler states differ across ranks: {states}"
    return scaler.state_dict()


def report(state: dict[str, float], detail: str) -> None:
    """Rank 0 prints that all ranks agree, with the final scale and the number of skipped steps."""
    if dist.get_rank() == 0:
        print(
            f"all {dist.get_world_size()} ranks agree: scale {state['loss_scale']:g}, "
            f"{state['num_skipped_steps']} skipped steps; {detail}",
            flush=True,
        )
