"""Half-precision parameters lose small updates; float32 master weights keep them.

A small regression trained with plain SGD at lr 2e-5 for 300 steps. Each update is smaller than half the spacing
of float16/bfloat16 numbers around most weights, so a model stored in half precision rounds it away; with
``master_weights`` the optimizer steps float32 copies and the model receives them rounded, and the loss falls as
far as in float32. The model itself stays in half precision throughout. Also shown: the torch clipping idiom
(``unscale_`` then ``clip_grad_norm_(model.parameters())``), which clips the gradients the step uses.

    python examples/master_weights.py          # ~5 s on one CPU core
    python examples/master_weights.py --steps 50
"""

from __future__ import annotations

import argparse

import torch

import dls
from dls.master_weights import master_weights


def data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=gen)
    y = torch.tanh(x @ torch.randn(16, 1, generator=gen) / 4) + 0.5
    return x, y


def train(dtype: torch.dtype, masters: bool, steps: int, clip: float | None = None) -> float:
    """Loss reduction after ``steps`` of SGD at lr 2e-5, parameters in ``dtype``."""
    x, y = data()
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)).to(dtype)
    optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=2e-5)
    if masters:
        optimizer = master_weights(optimizer)  # float32 masters of the half parameters
    scaler = dls.GradScaler(loss_scale="dynamic", enabled=dtype != torch.float32)

    def loss_fn() -> torch.Tensor:
        return torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y)

    with torch.no_grad():
        start = loss_fn().item()
    for _ in range(steps):
        scaler.scale(loss_fn()).backward()
        if clip is not None:
            scaler.unscale_(optimizer)  # the model's .grad now holds the unscaled gradients
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)  # ... and the step uses what this leaves
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    assert all(p.dtype == dtype for p in model.parameters())
    with torch.no_grad():
        return start - loss_fn().item()


def main(argv: list[str] | None = None) -> list[tuple[str, float, float]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # tiny half-precision matmuls: one thread is the fastest on a shared machine
    rows = []
    for clip in (None, 0.5):
        reference = train(torch.float32, masters=False, steps=args.steps, clip=clip)
        suffix = "" if clip is None else f", clip_grad_norm_ {clip}"
        rows.append((f"float32{suffix}", reference, 1.0))
        for dtype in (torch.float16, torch.bfloat16):
            name = str(dtype).removeprefix("torch.")
            for masters in (False, True):
                reduction = train(dtype, masters, args.steps, clip)
                label = f"{name} params, {'float32 masters' if masters else 'no masters'}{suffix}"
                rows.append((label, reduction, reduction / reference))
    width = max(len(r[0]) for r in rows)
    print(f"{'run':<{width}}  loss reduction  vs float32")
    for label, reduction, relative in rows:
        print(f"{label:<{width}}  {reduction:14.5f}  {relative:9.2f}x")
    return rows


if __name__ == "__main__":
    main()
