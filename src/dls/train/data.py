"""dls's built-in data sets (``teacher_regression``, ``char_corpus``) and models (``mlp``, ``transformer_lm``; a
model's ``loss(batch)`` is the unweighted training loss as a float32 scalar), the dispatch to Model Zoo's readers and
models (``dls.train.modelzoo``), what of a config's data files is missing here (``missing_paths``), and a model's
mean loss over batches (``evaluate``). What a data set, its resumable batches and a model are to the trainer is
``dls.train.batches``."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from dls.train.batches import Batch, BatchIterator, DataInfo, Dataset, TrainModel
from dls.train.config import ZOO_MODELS, DataConfig, ModelConfig, TrainConfig


def missing_paths(cfg: TrainConfig) -> list[str]:
    """What is missing or malformed here in the data of the loaders ``dls train`` uses (a note for ``validate``, an
    error for ``train``), naming the key as written and the layout expected."""
    from dls.train.modelzoo import check_data  # imported only by runs of Model Zoo data, as in the trainer

    lines, cwd = [], f" (relative paths resolve against {Path.cwd()})"
    for section, split in (("data", "train"), ("eval_data", "val")):
        data = getattr(cfg, section)
        if data is not None and data.data_processor is not None:
            key = cfg.sources.get(f"{section}.params", "train_input" if split == "train" else "eval_input")
            lines += [p + cwd for p in check_data(data.data_processor, data.loader_params, split=split, prefix=key)]
    return lines


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
        self.info = DataInfo(input_dim=d_in, output_dim=d_out)


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
            corpus = f"the corpus ({len(self.tokens)} characters)"
            raise ValueError(f"data.max_sequence_length ({self.length}) is too long for {corpus}")
        self.info = DataInfo(vocab_size=len(self.chars), sequence_length=self.length)

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
    if cfg.data_processor is None:
        shuffle_seed = cfg.shuffle_seed if cfg.shuffle_seed is not None else seed
        return BatchIterator(build_dataset(cfg), cfg.batch_size, cfg.shuffle, shuffle_seed, rank, world_size)
    from dls.train import modelzoo  # imported only by runs of Model Zoo data, as in the trainer

    return modelzoo.build_loader(
        cfg.data_processor, cfg.loader_params, split=split, seed=seed, rank=rank, world_size=world_size, prefix=prefix
    )


class MLP(TrainModel):
    """``depth`` hidden layers of ``hidden_size`` with ``activation_fn``; mean squared error."""

    def __init__(self, cfg: ModelConfig, info: DataInfo) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        activation = {"tanh": nn.Tanh, "relu": nn.ReLU, "gelu": nn.GELU}[cfg.activation_fn]
        width = info.input_dim
        for _ in range(cfg.depth):
            layers += [nn.Linear(width, cfg.hidden_size), activation()]
            if cfg.dropout > 0:
                layers.append(nn.Dropout(cfg.dropout))
            width = cfg.hidden_size
        layers.append(nn.Linear(width, info.output_dim))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def loss(self, batch: Batch) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x).float(), y.float())


class _Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then a GELU feed-forward layer."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hidden, self.heads, self.dropout = cfg.hidden_size, cfg.num_heads, cfg.dropout_rate
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, cfg.filter_size)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(cfg.filter_size, hidden)
        self.drop = nn.Dropout(cfg.dropout_rate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(b, t, c)))
        return x + self.drop(self.fc2(self.act(self.fc1(self.ln2(x)))))


class TransformerLM(TrainModel):
    """Token and position embeddings, ``num_hidden_layers`` blocks, a final LayerNorm and an untied head; cross-
    entropy over every position."""

    def __init__(self, cfg: ModelConfig, info: DataInfo) -> None:
        super().__init__()
        self.tok = nn.Embedding(info.vocab_size, cfg.hidden_size)
        self.pos = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.drop = nn.Dropout(cfg.dropout_rate)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.num_hidden_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size)
        self.head = nn.Linear(cfg.hidden_size, info.vocab_size)
        for name, p in self.named_parameters():  # GPT-2's: the residual outputs scaled down by depth
            if p.dim() >= 2:
                output = name.endswith(("proj.weight", "fc2.weight"))
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.num_hidden_layers) if output else 0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.tok(tokens) + self.pos(positions)[None])
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, batch: Batch) -> torch.Tensor:
        tokens, targets = batch
        logits = self(tokens).float()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build_model(cfg: ModelConfig, info: DataInfo | None) -> TrainModel:
    """The model ``cfg`` names: built in (on ``info``'s data), or a Model Zoo model (``dls.train.modelzoo``)."""
    if cfg.name in ZOO_MODELS:
        from dls.train import modelzoo  # imported only by runs of Model Zoo models, as in the trainer

        return modelzoo.build_model(cfg.name, dict(cfg.params))
    assert info is not None, "a built-in model is built on its data set"
    return MLP(cfg, info) if cfg.name == "mlp" else TransformerLM(cfg, info)


@torch.no_grad()
def _mean_loss(model: TrainModel, weighted: Iterable[tuple[Batch, int]], device: torch.device) -> float:
    """The mean loss over ``(batch, weight)`` pairs, in eval mode (no dropout); one read of the device at the end."""
    was_training = model.training
    model.eval()
    total, count = torch.zeros((), dtype=torch.float64, device=device), 0
    for batch, weight in weighted:
        total += model.loss(batch).double() * weight
        count += weight
    model.train(was_training)
    return float(total) / max(count, 1)


def evaluate_batches(model: TrainModel, batches: Any, steps: int, device: torch.device, prepare: Any) -> float:
    """Mean loss over ``steps`` batches of ``batches`` (``prepare`` puts one on the device), in eval mode."""
    return _mean_loss(model, ((prepare(batches.next()), 1) for _ in range(steps)), device)


def evaluate(model: TrainModel, dataset: Dataset, device: torch.device, max_samples: int = 4096) -> float:
    """Mean loss in float32 over the first ``max_samples`` samples of ``dataset`` (64 sequences for the character
    corpus), in eval mode (no dropout)."""
    if any(p.dtype != torch.float32 for p in model.parameters() if p.is_floating_point()):
        model = copy.deepcopy(model).float()
    n = min(len(dataset), max_samples, 64 if isinstance(dataset, CharCorpus) else max_samples)
    chunks = [(dataset.batch(idx, epoch=0), len(idx)) for idx in torch.arange(n).split(512)]
    return _mean_loss(model, (((x.to(device), y.to(device)), size) for (x, y), size in chunks), device)
