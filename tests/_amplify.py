"""A model whose float16 forward pass overflows in one layer: ``amplify`` multiplies activations of order 1 into the
hundreds of thousands (float16's largest value is 65504), and the ``LayerNorm`` after it brings them back, so in
float32 the model trains normally. Shared by ``test_fallback.py``, ``test_keep.py`` and ``_fallback_dist_worker.py``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import dls

GAIN = 3e5  # amplify's weights times this: its outputs reach ~5e5 in float32


def amplifying_model(seed: int = 0, gain: float = GAIN, affine_norm: bool = True) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(
        OrderedDict(
            embed=nn.Linear(8, 32),
            amplify=nn.Linear(32, 32),
            norm=nn.LayerNorm(32, elementwise_affine=affine_norm),
            act=nn.Tanh(),
            head=nn.Linear(32, 1),
        )
    )
    with torch.no_grad():
        model.amplify.weight.mul_(gain)
    return model


def batch(step: int, size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(size, 8, generator=g)
    return x, (x[:, :1] * x[:, 1:2]).tanh()


def loss_fn(model: nn.Module, step: int, half: bool) -> torch.Tensor:
    x, y = batch(step)
    with torch.autocast("cpu", dtype=torch.float16, enabled=half):
        out = model(x)
    return nn.functional.mse_loss(out.float(), y)


def eval_loss(model: nn.Module) -> float:
    """Mean float32 loss over 4 held-out batches."""
    with torch.no_grad():
        return sum(loss_fn(model, 1000 + i, half=False).item() for i in range(4)) / 4


def scaled_step(scaler: dls.GradScaler, optimizer: torch.optim.Optimizer, loss: torch.Tensor) -> None:
    """One step of the AMP recipe on ``loss``: zero the gradients, scaled backward, ``step``, ``update``."""
    optimizer.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


def train(
    model: nn.Module,
    steps: int,
    half: bool,
    setup: Callable[[nn.Module, dls.GradScaler], Any] | None = None,
    scaler: dls.GradScaler | None = None,
    lr: float = 1e-2,
) -> dict[str, Any]:
    """Adam with an exponentially decaying learning rate (so runs converge to comparable losses), a dls scaler."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.ExponentialLR(optimizer, 0.99)
    scaler = scaler if scaler is not None else dls.GradScaler("cpu", init_scale=2.0**16)
    extra = setup(model, scaler) if setup is not None else None
    skipped: list[int] = []
    for step in range(steps):
        scaled_step(scaler, optimizer, loss_fn(model, step, half))
        if scaler.step_was_skipped(optimizer):
            skipped.append(step)
        else:
            schedule.step()
    return {"eval": eval_loss(model), "skipped": skipped, "scaler": scaler, "extra": extra, "optimizer": optimizer}
