"""Launching across ranks: the device, torchrun's process group (gloo on CPU, NCCL with a GPU per rank), DDP and
what rank 0 alone does. Imports torch and the standard library only."""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from dls.train.errors import RankError, describe, exit_status

if TYPE_CHECKING:
    from dls.train.data import Batch, TrainModel


class TorchrunEnv(NamedTuple):
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1


def torchrun_env() -> TorchrunEnv:
    """``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` (0, 0, 1 outside torchrun): the one reader of torchrun's variables; a
    value that is not a decimal number reads as unset."""
    values = {field: os.environ.get(field.upper(), "").strip() for field in TorchrunEnv._fields}
    return TorchrunEnv(**{field: int(value) for field, value in values.items() if value.isdecimal()})


def resolve_device(name: str) -> torch.device:
    """``runconfig.device``: ``auto`` is CUDA when available."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("runconfig.device is 'cuda' but no CUDA device is available; use 'cpu' or 'auto'")
    return torch.device(name)


def init_distributed(device: str) -> bool:
    """Under torchrun, initialise the default process group (NCCL on GPU ``LOCAL_RANK``, else gloo); whether it
    did (then :func:`shutdown_distributed` ends it)."""
    env = torchrun_env()
    if env.world_size < 2 or not dist.is_available() or dist.is_initialized():
        return False
    cuda = resolve_device(device).type == "cuda"
    if cuda:
        torch.cuda.set_device(env.local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    return True


def shutdown_distributed() -> None:
    # Collect DDP's reducer first: with gloo, a group still referenced at interpreter exit can abort the process.
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class _LossOf(torch.nn.Module):
    """``forward(batch)`` is ``model.loss(batch)``, so the loss goes through DDP's forward (its all-reduce)."""

    def __init__(self, model: TrainModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.model.loss(batch)


def wrap_data_parallel(model: TrainModel, device: torch.device) -> DistributedDataParallel:
    """``model``'s loss in DDP (the model itself stays unwrapped: checkpoints hold it)."""
    return DistributedDataParallel(_LossOf(model), device_ids=[device.index] if device.type == "cuda" else None)


def sum_over_ranks(values: Sequence[float], device: torch.device) -> list[float]:
    """``values`` summed over the ranks: one float64 all-reduce."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return [float(v) for v in tensor.tolist()]


def run_on_rank0(action: Callable[[], object]) -> None:
    """Run ``action`` on rank 0 alone; when it fails, every other rank raises :class:`RankError` alike."""
    ranks = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    rank, error = dist.get_rank() if ranks else 0, None
    if rank == 0:
        try:
            action()
        except Exception as exc:
            error = exc
    if ranks:
        outcome = [None if error is None else (describe(error), int(exit_status(error)))]
        dist.broadcast_object_list(outcome, src=0)
        if rank != 0 and outcome[0] is not None:
            raise RankError(*outcome[0])
    if error is not None:
        raise error
