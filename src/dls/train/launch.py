"""The machine a run launches on: its free memory, the device and torchrun's process group (gloo on CPU, NCCL with a
GPU per rank); the trainer wraps its model in DDP. Imports torch and the standard library only."""

from __future__ import annotations

import gc
import os
from typing import NamedTuple

import torch
import torch.distributed as dist


class TorchrunEnv(NamedTuple):
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1


def torchrun_env() -> TorchrunEnv:
    """``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` (0, 0, 1 outside torchrun): the one reader of torchrun's variables; a
    value that is not a decimal number reads as unset."""
    values = {field: os.environ.get(field.upper(), "").strip() for field in TorchrunEnv._fields}
    return TorchrunEnv(**{field: int(value) for field, value in values.items() if value.isdecimal()})


def free_memory() -> int | None:
    """The memory available to a new allocation here, in bytes (``MemAvailable``, else the free pages); ``None``
    when the system does not say."""
    try:
        pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        with open("/proc/meminfo", "rb") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith(b"MemAvailable:")), pages)
    except (OSError, ValueError):
        return None


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
