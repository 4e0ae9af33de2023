"""Resumable batches (from ``(epoch, position)``; data-parallel ranks take strided batches of one epoch order) of
dls's built-in data sets (``teacher_regression``, ``char_corpus``) and Model Zoo's readers."""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch

from dls.train.errors import ConfigError
from dls.train.schema import DataConfig

Batch = Any  # (inputs, targets) for the built-in data sets; what a Model Zoo model's loss takes otherwise


@dataclass(frozen=True)
class DataInfo:
    """What a model needs to know about its data: ``task`` is ``"regression"`` or ``"language_model"``."""

    task: str
    input_dim: int = 0
    output_dim: int = 0
    vocab_size: int = 0
    sequence_length: int = 0


class Dataset:
    """Samples indexed ``0..len-1``; ``batch(indices)`` stacks them into ``(inputs, targets)``."""

    info: DataInfo

    def __len__(self) -> int:
        raise NotImplementedError

    def batch(self, indices: torch.Tensor, epoch: int) -> Batch:
        raise NotImplementedError


class TeacherRegression(Dataset):
    """``num_samples`` inputs ``x ~ N(0, 1)`` and targets ``tanh(x W1 / sqrt(d_in)) W2 / sqrt(64)`` (+ noise)."""

    def __init__(self, cfg: DataConfig) -> None:
        gen = torch.Generator().manual_seed(cfg.dataset_seed)
        d_in, d_out, hidden = cfg.input_dim, cfg.output_dim, 64
        self.x = torch.randn(cfg.num_samples, d_in, generator=gen)
        w1 = torch.randn(d_in, hidden, generator=gen) / math.sqrt(d_in)
        w2 = torch.randn(hidden, d_out, generator=gen) / math.sqrt(hidden)
        self.y = torch.tanh(self.x @ w1) @ w2
        if cfg.noise_std > 0:
            self.y += cfg.noise_std * torch.randn(self.y.shape, generator=gen)
        self.info = DataInfo(task="regression", input_dim=d_in, output_dim=d_out)

    def __len__(self) -> int:
        return self.x.shape[0]

    def batch(self, indices: torch.Tensor, epoch: int) -> Batch:
        return self.x[indices], self.y[indices]


class CharCorpus(Dataset):
    """Windows of ``max_sequence_length + 1`` characters of the corpus shipped with dls, at an offset that changes
    every epoch; inputs are a window's first ``L`` characters, targets its last ``L``."""

    def __init__(self, cfg: DataConfig) -> None:
        text = resources.files("dls.train").joinpath("data/corpus.txt").read_text(encoding="utf-8")
        self.chars = sorted(set(text))
        index = {c: i for i, c in enumerate(self.chars)}
        self.tokens = torch.tensor([index[c] for c in text], dtype=torch.long)
        self.length = cfg.max_sequence_length
        self.windows = (len(self.tokens) - self.length) // self.length  # fits at every offset < length
        if self.windows < 1:
            raise ValueError(
                f"data.max_sequence_length ({self.length}) is too long for the corpus ({len(self.tokens)} characters)"
            )
        self.info = DataInfo(task="language_model", vocab_size=len(self.chars), sequence_length=self.length)

    def __len__(self) -> int:
        return self.windows

    def batch(self, indices: torch.Tensor, epoch: int) -> Batch:
        starts = (epoch * 7919) % self.length + indices * self.length
        seq = self.tokens[starts[:, None] + torch.arange(self.length + 1)[None, :]]
        return seq[:, :-1], seq[:, 1:]


def build_dataset(cfg: DataConfig) -> Dataset:
    return TeacherRegression(cfg) if cfg.dataset == "teacher_regression" else CharCorpus(cfg)


def build_batches(
    cfg: DataConfig, seed: int, split: str, rank: int = 0, world_size: int = 1, prefix: str | None = None
) -> BatchIterator:
    """The resumable batches of a data section: a built-in data set, or a Model Zoo reader
    (``dls.train.modelzoo.build_loader``, itself a :class:`BatchIterator`; ``prefix``: the section as written)."""
    shuffle_seed = cfg.shuffle_seed if cfg.shuffle_seed is not None else seed
    if cfg.data_processor is None:
        return BatchIterator(build_dataset(cfg), cfg.batch_size, cfg.shuffle, shuffle_seed, rank, world_size)
    params = {**cfg.loader_params, "shuffle_seed": shuffle_seed}
    split = params.pop("split", split)
    batches: BatchIterator = modelzoo().build_loader(
        cfg.data_processor, params, split=split, seed=shuffle_seed, rank=rank, world_size=world_size, prefix=prefix
    )
    return batches


def modelzoo() -> Any:
    """``dls.train.modelzoo`` (Model Zoo's models and readers), imported only when a config uses them."""
    return importlib.import_module("dls.train.modelzoo")


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
            ranks = f" * {self.world_size} ranks" if self.world_size > 1 else ""
            size = f"({self.batch_size}){ranks} is larger than the data set ({len(self.dataset)} samples)"
            raise ConfigError([f"{self.key} {size}"])
        self.epoch = self.position = 0
        self._order: torch.Tensor | None = None
        self.ignored_keys: list[str] = []  # a Model Zoo reader's keys that matter only on Cerebras hardware

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
        # position: the batches of this epoch taken by all ranks
        state = {"epoch": self.epoch, "position": self.position * self.world_size, "seed": self.seed}
        return (
            state | {"batch_size": self.batch_size} | ({"world_size": self.world_size} if self.world_size > 1 else {})
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (:meth:`state_dict`); ``ValueError`` naming the field when it is not one."""
        if not isinstance(state, dict):
            raise ValueError(f"a mapping with epoch and position is expected; got {type(state).__name__}")
        for key in ("epoch", "position"):
            value = state.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
                raise ValueError(f"{key} must be an integer >= 0; got {value!r}")
        self.epoch = state["epoch"]
        self.position = -(-state["position"] // self.world_size)  # rounded up: no batch slot is taken twice
        self._order = None
