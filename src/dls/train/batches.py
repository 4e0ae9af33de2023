"""What the trainer iterates and trains, whatever the data set and model: a data set (:class:`Dataset`, what a
model needs to know of it: :class:`DataInfo`), its resumable batches (:class:`BatchIterator`, from ``(epoch,
position)``; data-parallel ranks take strided batches of one epoch order) and a model that knows its loss
(:class:`TrainModel`). Both the built-in data sets and models (``dls.train.data``) and Model Zoo's
(``dls.train.modelzoo``) are these."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dls.checks import shown
from dls.train.errors import ConfigError

Batch = Any  # (inputs, targets) for the built-in data sets; what a Model Zoo model's loss takes otherwise


@dataclass(frozen=True)
class DataInfo:
    """What a model needs to know about its data."""

    input_dim: int = 0
    output_dim: int = 0
    vocab_size: int = 0
    sequence_length: int = 0


class Dataset:
    """Samples indexed ``0..len-1``; ``batch(indices)`` stacks them into ``(inputs, targets)``: by default the
    samples ``x[indices]`` and targets ``y[indices]``."""

    info: DataInfo
    x: torch.Tensor
    y: torch.Tensor

    def __len__(self) -> int:
        return len(self.y)

    def batch(self, indices: torch.Tensor, epoch: int) -> Batch:
        return self.x[indices], self.y[indices]


@dataclass(eq=False)
class BatchIterator:
    """Batches of ``batch_size`` samples, epoch after epoch; an epoch's incomplete last batch is dropped unless
    ``drop_last`` is false (Model Zoo's readers). ``ConfigError`` naming ``key`` when a rank has no whole batch."""

    dataset: Dataset
    batch_size: int
    shuffle: bool
    seed: int
    rank: int = 0
    world_size: int = 1
    drop_last: bool = True
    key: str = "data.batch_size"

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, world_size={self.world_size}); got {self.rank}")
        if len(self.dataset) // self.batch_size < self.world_size:  # each rank takes at least one whole batch
            ranks = f" per rank * {self.world_size} ranks" if self.world_size > 1 else ""
            size = f"({self.batch_size}){ranks} is larger than the data set ({len(self.dataset)} samples)"
            raise ConfigError([f"{self.key} {size}"])
        self.epoch = self.position = 0
        self._order: torch.Tensor | None = None

    @property
    def batches_per_epoch(self) -> int:
        """Batches this rank takes per epoch."""
        samples = len(self.dataset) + (0 if self.drop_last else self.batch_size - 1)
        return samples // self.batch_size // self.world_size

    def next(self) -> Batch:
        if self.position >= self.batches_per_epoch:
            self.epoch, self.position, self._order = self.epoch + 1, 0, None
        if self._order is None:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            n = len(self.dataset)
            self._order = torch.randperm(n, generator=gen) if self.shuffle else torch.arange(n)
        start = (self.position * self.world_size + self.rank) * self.batch_size
        self.position += 1
        return self.dataset.batch(self._order[start : start + self.batch_size], self.epoch)

    def state_dict(self) -> dict[str, Any]:
        position = self.position * self.world_size  # the batches of this epoch taken by all ranks
        state = {"epoch": self.epoch, "position": position, "seed": self.seed, "batch_size": self.batch_size}
        return state | ({"world_size": self.world_size} if self.world_size > 1 else {})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (:meth:`state_dict`); ``ValueError`` naming the field when it is not one."""
        if not isinstance(state, dict):
            raise ValueError(f"a mapping with epoch and position is expected; got {type(state).__name__}")
        # epoch and position are loaded; seed, batch_size and world_size (when saved) say what the saving run read,
        # and the config decides them now: each is still checked, as a field of the format.
        for key, low in {"epoch": 0, "position": 0, "seed": 0, "batch_size": 1, "world_size": 1}.items():
            value = state.get(key) if key in ("epoch", "position") else state.get(key, low)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value < 2**63:
                raise ValueError(f"{key} must be an integer >= {low}; got {shown(value)}")
        self.epoch, self._order = state["epoch"], None
        self.position = -(-state["position"] // self.world_size)  # rounded up: no batch slot is taken twice


class TrainModel(nn.Module):
    """A model that knows its loss."""

    def loss(self, batch: Batch) -> torch.Tensor:
        raise NotImplementedError
