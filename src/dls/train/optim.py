"""The optimizer and learning-rate schedule of ``optimizer:``: a ``LambdaLR`` over the schedule's LR (the
optimizer's own ``lr`` is 1.0), wrapped by the trainer with ``dls.skip_aware`` so it advances on applied steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from dls.train.config import OptimizerConfig

__all__ = ["build_optimizer", "build_scheduler", "learning_rate_at"]


def build_optimizer(cfg: OptimizerConfig, params: Any) -> torch.optim.Optimizer:
    """The optimizer with learning rate 1.0: the LR schedule (a ``LambdaLR``) sets the real one. Model Zoo's
    argument names (``correct_bias`` is torch's only behaviour and is checked by the schema)."""
    if cfg.optimizer_type == "SGD":
        return torch.optim.SGD(params, lr=1.0, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    cls = torch.optim.Adam if cfg.optimizer_type == "Adam" else torch.optim.AdamW
    return cls(params, lr=1.0, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)


def learning_rate_at(schedule: float | Sequence[Any], step: int) -> float:
    """The learning rate after ``step`` applied updates (0-based): a constant, or the schedule pieces one after
    another (``Constant``, ``Linear``, ``CosineDecay`` over ``total_iters`` steps each; the last holds its end)."""
    if isinstance(schedule, (int, float)):
        return float(schedule)
    t = step
    for i, item in enumerate(schedule):
        piece = item if isinstance(item, dict) else item.model_dump()
        total = piece.get("total_iters")
        last = i == len(schedule) - 1
        if total is not None and t >= total and not last:
            t -= total
            continue
        if piece["scheduler"] == "Constant":
            return float(piece["learning_rate"])
        start, end = float(piece["initial_learning_rate"]), float(piece["end_learning_rate"])
        frac = min(t / total, 1.0) if total else 1.0
        if piece["scheduler"] == "Linear":
            return start + (end - start) * frac
        return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * frac))
    raise AssertionError("unreachable: a schedule has at least one piece")


def build_scheduler(cfg: OptimizerConfig, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    schedule = cfg.learning_rate

    def lr_at(step: int) -> float:  # a plain function: LambdaLR.state_dict() does not store it
        return learning_rate_at(schedule, step)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
