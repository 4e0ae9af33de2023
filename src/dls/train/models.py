"""Built-in models (``mlp``, ``transformer_lm``) and the dispatch to Model Zoo models (``dls.train.modelzoo``).
Each model's ``loss(batch)`` returns the unweighted training loss as a float32 scalar.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from dls.train.data import Batch, CharCorpus, DataInfo, Dataset, modelzoo
from dls.train.schema import ZOO_MODELS, ModelConfig

_ACTIVATIONS: dict[str, type[nn.Module]] = {"tanh": nn.Tanh, "relu": nn.ReLU, "gelu": nn.GELU}


class TrainModel(nn.Module):
    """A model that knows its loss."""

    def loss(self, batch: Batch) -> torch.Tensor:
        raise NotImplementedError


class MLP(TrainModel):
    """``depth`` hidden layers of ``hidden_size`` with ``activation_fn``; mean squared error."""

    def __init__(self, cfg: ModelConfig, info: DataInfo) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = info.input_dim
        for _ in range(cfg.depth):
            layers += [nn.Linear(width, cfg.hidden_size), _ACTIVATIONS[cfg.activation_fn]()]
            if cfg.dropout > 0:
                layers.append(nn.Dropout(cfg.dropout))
            width = cfg.hidden_size
        layers.append(nn.Linear(width, info.output_dim))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out

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
        logits: torch.Tensor = self.head(self.ln_f(x))
        return logits

    def loss(self, batch: Batch) -> torch.Tensor:
        tokens, targets = batch
        logits = self(tokens).float()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build_model(cfg: ModelConfig, info: DataInfo | None) -> TrainModel:
    """The model ``cfg`` names: built in (on ``info``'s data), or a Model Zoo model (``dls.train.modelzoo``)."""
    if cfg.name in ZOO_MODELS:
        model: TrainModel = modelzoo().build_model(cfg.name, dict(cfg.params))
        return model
    assert info is not None, "a built-in model is built on its data set"
    return MLP(cfg, info) if cfg.name == "mlp" else TransformerLM(cfg, info)


@torch.no_grad()
def _mean_loss(model: TrainModel, weighted: Iterable[tuple[Batch, int]], device: torch.device) -> float:
    """The mean loss over ``(batch, weight)`` pairs, in eval mode (no dropout); one read of the device at the end."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = 0
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
