"""How a run is launched and works across ranks: the device, ``torchrun``'s environment and process group
(:func:`init_distributed`: gloo on CPU, NCCL with one GPU per rank), ``DistributedDataParallel``
(:func:`wrap_data_parallel`), sums over ranks, what rank 0 alone does (:func:`run_on_rank0`), and the stop
request of Ctrl-C / SIGTERM (:class:`StopRequest`, through ``dls_entry``'s one handler).

Imports torch, ``dls_entry``, ``dls.train.errors`` and the standard library only (the ``dls`` command uses
:func:`torchrun_env` before it knows whether the ``train`` extra is installed).
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from dls.train.errors import RankError, Terminated, describe, exit_status
from dls_entry import signals

if TYPE_CHECKING:
    from dls.train.data import Batch
    from dls.train.models import TrainModel

__all__ = [
    "StopRequest",
    "TorchrunEnv",
    "init_distributed",
    "resolve_device",
    "run_on_rank0",
    "shutdown_distributed",
    "sum_over_ranks",
    "torchrun_env",
    "wrap_data_parallel",
]


class TorchrunEnv(NamedTuple):
    """What ``torchrun`` tells each process (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``; 0, 0, 1 outside it)."""

    rank: int
    local_rank: int
    world_size: int

    @property
    def launched(self) -> bool:
        """Whether this process is one of several ranks (``WORLD_SIZE`` > 1)."""
        return self.world_size > 1


def torchrun_env() -> TorchrunEnv:
    """The one reader of ``torchrun``'s environment variables; a value that is not an integer reads as unset."""

    def read(name: str, default: int) -> int:
        try:
            return int(os.environ.get(name, default))
        except ValueError:
            return default

    return TorchrunEnv(read("RANK", 0), read("LOCAL_RANK", 0), read("WORLD_SIZE", 1))


def resolve_device(name: str) -> torch.device:
    """``runconfig.device``: ``auto`` is CUDA when available; ``cuda`` without CUDA is a ``ValueError``."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("runconfig.device is 'cuda' but no CUDA device is available; use 'cpu' or 'auto'")
    return torch.device(name)


def init_distributed(device: str) -> bool:
    """Under ``torchrun`` (``WORLD_SIZE`` > 1), initialise the default process group from the environment: NCCL
    when ``device`` (``runconfig.device``) resolves to CUDA, this rank then using GPU ``LOCAL_RANK``; gloo
    otherwise. Returns whether it initialised the group (then :func:`shutdown_distributed` ends it); ``False``
    outside ``torchrun`` or when the group already exists."""
    env = torchrun_env()
    if not env.launched or not dist.is_available() or dist.is_initialized():
        return False
    if resolve_device(device).type == "cuda":
        torch.cuda.set_device(env.local_rank)
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
    return True


def shutdown_distributed() -> None:
    """Destroy the default process group, after collecting the objects (DDP's reducer) that still hold it:
    with gloo, a group referenced at interpreter exit can abort the process as it shuts down."""
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class _LossOf(torch.nn.Module):
    """What ``DistributedDataParallel`` wraps: ``forward(batch)`` is the model's ``loss(batch)``, so the loss is
    computed through DDP's forward (which prepares its gradient all-reduce)."""

    def __init__(self, model: TrainModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.model.loss(batch)


def wrap_data_parallel(model: TrainModel, device: torch.device) -> DistributedDataParallel:
    """``model`` in ``DistributedDataParallel`` (on ``device``: a GPU of its own per rank, or the CPU), called
    with a batch, returning ``model.loss(batch)``. The model itself stays unwrapped (checkpoints hold it)."""
    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(_LossOf(model), device_ids=ids)


def sum_over_ranks(values: Sequence[float], device: torch.device) -> list[float]:
    """``values`` summed over the ranks of the default process group: one all-reduce (float64, on ``device``)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return [float(v) for v in tensor.tolist()]


def run_on_rank0(action: Callable[[], None], rank: int, world_size: int) -> None:
    """Run ``action`` on rank 0 alone. Data-parallel (``world_size`` > 1), its outcome is broadcast: when it
    failed, every other rank raises :class:`RankError` with rank 0's message and exit status, so all ranks end
    alike."""
    error: Exception | None = None
    if rank == 0:
        try:
            action()
        except Exception as exc:
            error = exc
    if world_size > 1:
        outcome = [None if error is None else (describe(error), int(exit_status(error)))]
        dist.broadcast_object_list(outcome, src=0)
        if rank != 0 and outcome[0] is not None:
            raise RankError(*outcome[0])
    if error is not None:
        raise error


class StopRequest:
    """While active (main thread only), the first Ctrl-C (SIGINT) or SIGTERM asks the loop to stop after the current
    step (which then checkpoints a consistent state and raises :meth:`interrupt`: ``KeyboardInterrupt``, or
    :class:`Terminated` for SIGTERM); a second one interrupts at once. Data-parallel: the request is shared in the
    all-reduce of the next logged step, after which every rank stops at the same step."""

    def __init__(self, log: Callable[[str], None], distributed: bool = False) -> None:
        self.log = log
        self.distributed = distributed
        self.requested = False
        self.forced = False
        self.signum: int = signal.SIGINT
        self._signals = contextlib.ExitStack()

    def _request(self, signum: int) -> bool:
        """The first signal is a request (taken: ``True``); a second one raises at once (``dls_entry``)."""
        if self.requested:
            self.forced = True
            return False
        self.requested, self.signum = True, signum
        when = "at the next logged step (all ranks together)" if self.distributed else "after this step"
        if signum == signal.SIGTERM:
            self.log(f"SIGTERM: stopping {when} and saving a checkpoint")
        else:
            self.log(f"Ctrl-C: stopping {when} and saving a checkpoint (press Ctrl-C again to quit at once)")
        return True

    def interrupt(self) -> KeyboardInterrupt:
        return Terminated() if self.signum == signal.SIGTERM else KeyboardInterrupt()

    def __enter__(self) -> StopRequest:
        self._signals.enter_context(signals(self._request))
        return self

    def __exit__(self, *exc: object) -> None:
        self._signals.close()
