"""What ``dls audit`` (:mod:`dls.train.cli`) runs on: the config's model as ``dls train`` starts it (in float32) and
its first batches; and the audit of each half format, from the first batch."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

import dls
from dls.diagnostics import AuditResult, FormatAudit
from dls.train import checkpoint as ckpt
from dls.train.batches import Batch, BatchIterator, TrainModel
from dls.train.config import TrainConfig
from dls.train.data import build_dataset, build_model
from dls.train.launch import resolve_device


class Batches:
    """The run's first ``steps`` batches on ``device``, made anew per pass (``--steps`` costs time, not memory)."""

    def __init__(self, make: Callable[[], BatchIterator], steps: int, device: torch.device) -> None:
        self.make, self.steps, self.device = make, steps, device

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[Batch]:
        iterator = self.make()
        for _ in range(self.steps):
            x, y = iterator.next()
            yield x.to(self.device), y.to(self.device)


def build_inputs(cfg: TrainConfig, steps: int) -> tuple[TrainModel, Batches]:
    """The float32 model of ``cfg`` as ``dls train`` initialises it, and the run's first ``steps`` batches."""
    rc = cfg.runconfig
    device = resolve_device(rc.device)
    ckpt.seed_everything(rc.seed)  # the order of what follows is the trainer's: the same weights and batches
    dataset = build_dataset(cfg.data)
    seed = cfg.data.shuffle_seed if cfg.data.shuffle_seed is not None else rc.seed
    make = functools.partial(BatchIterator, dataset, cfg.data.batch_size, cfg.data.shuffle, seed, 0, 1)
    make()  # its errors, before the model
    return build_model(cfg.model, dataset.info).to(device), Batches(make, steps, device)


def audit_formats(model: TrainModel, batches: Batches, formats: Sequence[str], loss_weight: float = 1.0) -> AuditResult:
    audits: dict[str, FormatAudit] = {}
    keep: dict[str, list[str] | None] = {}
    for fmt in formats:  # one call per format, so that each starts at the first batch
        stream = itertools.chain.from_iterable(itertools.repeat(batches))  # not itertools.cycle: it keeps every batch

        def loss_fn(m: nn.Module, stream: Iterator[Batch] = stream) -> torch.Tensor:
            return model.loss(next(stream)) * loss_weight

        result = dls.audit(model, loss_fn, formats=[fmt], steps=len(batches))
        audits.update(result.audits)
        keep.update(result.keep_in_float32)
    return dataclasses.replace(result, audits=audits, keep_in_float32=keep)
