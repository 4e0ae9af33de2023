"""Gradient underflow in half precision, and dynamic loss scaling rescuing it.

A small tanh MLP learns a teacher network by regression. Its loss carries a small weight (``loss_weight``,
as a down-weighted auxiliary term of a multi-task loss would), so the gradients flowing back through the
network are tiny: most are below float16's smallest subnormal (2**-24 ≈ 6e-8), and a large part below even
cbfloat16's (2**-39 ≈ 1.8e-12, under dls' ASSUMPTIONS for cbfloat16). Adam is invariant to the scale of the
loss, so in float32 the weight changes nothing; in an emulated half format (``dls.emulate``) the gradient into
every module's output is rounded to that format, and without loss scaling most of it is flushed to zero.
``dls.GradScaler`` multiplies the loss by a large dynamic scale before backward and divides the float32
gradients by it afterwards, so they survive the rounding.

Five runs from identical initial weights: float32, float16 without scaling, float16 + DLS, cbfloat16 without
scaling, cbfloat16 + DLS. For each it prints the fraction of nonzero gradient values flushed to zero (over
all steps) and the final training loss (unweighted mean squared error, evaluated under the same numerics).

    python examples/underflow.py [--steps 300] [--loss-weight 1e-8] [--seed 0] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import itertools
import math
from typing import Any

import torch
from torch import nn

import dls

CONFIGS: tuple[tuple[str, str | None, bool], ...] = (
    ("float32", None, False),
    ("float16", "float16", False),
    ("float16 + DLS", "float16", True),
    ("cbfloat16", "cbfloat16", False),
    ("cbfloat16 + DLS", "cbfloat16", True),
)


def make_problem(samples: int, width: int, depth: int, seed: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A student MLP (``depth`` tanh layers of ``width``) and a dataset labelled by a random teacher MLP."""
    gen = torch.Generator().manual_seed(seed)
    d_in, d_out = 16, 4
    x = torch.randn(samples, d_in, generator=gen)
    with torch.no_grad():
        teacher = torch.tanh(x @ torch.randn(d_in, 32, generator=gen) / math.sqrt(d_in))
        y = teacher @ torch.randn(32, d_out, generator=gen) / math.sqrt(32)
    torch.manual_seed(seed + 1)
    layers: list[nn.Module] = []
    sizes = [d_in] + [width] * depth
    for a, b in itertools.pairwise(sizes):
        layers += [nn.Linear(a, b), nn.Tanh()]
    layers.append(nn.Linear(width, d_out))
    return nn.Sequential(*layers), x, y


def train(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    fmt: str | None,
    use_dls: bool,
    *,
    steps: int,
    lr: float,
    loss_weight: float,
) -> dict[str, Any]:
    """Full-batch Adam on ``loss_weight * mse``; returns final loss, flushed fraction and scaler facts."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, eps=1e-30)  # eps far below the tiny gradients
    scaler = None
    if use_dls:
        assert fmt is not None
        # half_dtype picks Cerebras' defaults for the format (cbfloat16: max and init 2**31); float16's default
        # ceiling (2**15) is too low for gradients this small: give it cbfloat16's 2**31.
        scaler = dls.GradScaler(half_dtype=fmt, max_loss_scale=2.0**31)
    handle = dls.emulate(model, fmt) if fmt is not None else None
    try:
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            loss = loss_weight * nn.functional.mse_loss(model(x), y)
            if scaler is None:
                loss.backward()
                optimizer.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
        with torch.no_grad():
            final = nn.functional.mse_loss(model(x), y).item()
        stats = handle.stats.as_dict() if handle is not None and handle.stats is not None else None
    finally:
        if handle is not None:
            handle.remove()
    return {
        "final_loss": final,
        "flushed_fraction": stats["underflow_fraction"] if stats else 0.0,
        "gradient_values": int(stats["nonzero"]) if stats else 0,
        "loss_scale": scaler.get_scale() if scaler is not None else None,
        "skipped_steps": scaler.get_num_skipped_steps() if scaler is not None else 0,
    }


def run(
    steps: int = 300,
    *,
    samples: int = 512,
    width: int = 64,
    depth: int = 4,
    lr: float = 3e-3,
    loss_weight: float = 1e-8,
    seed: int = 0,
) -> dict[str, dict[str, Any]]:
    """Train the five configurations from the same initial weights; returns ``{config name: results}`` with
    ``final_loss``, ``flushed_fraction`` (flushed / nonzero gradient values, 0.0 for float32),
    ``gradient_values``, ``loss_scale`` and ``skipped_steps``. Also reports the untrained loss under
    ``"initial"``."""
    model, x, y = make_problem(samples, width, depth, seed)
    with torch.no_grad():
        results: dict[str, dict[str, Any]] = {"initial": {"final_loss": nn.functional.mse_loss(model(x), y).item()}}
    for name, fmt, use_dls in CONFIGS:
        results[name] = train(copy.deepcopy(model), x, y, fmt, use_dls, steps=steps, lr=lr, loss_weight=loss_weight)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--loss-weight", type=float, default=1e-8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (small tensors: 1 is fastest)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = run(args.steps, loss_weight=args.loss_weight, seed=args.seed)
    print(
        f"loss weight {args.loss_weight:g}, {args.steps} steps, untrained loss {results['initial']['final_loss']:.4f}"
    )
    print(f"{'run':<18}{'flushed to zero':>16}{'final loss':>12}{'loss scale':>12}{'skipped':>9}")
    for name, _, _ in CONFIGS:
        r = results[name]
        scale = "" if r["loss_scale"] is None else f"2**{math.log2(r['loss_scale']):.0f}"
        print(f"{name:<18}{r['flushed_fraction']:>16.2%}{r['final_loss']:>12.4f}{scale:>12}{r['skipped_steps']:>9}")


if __name__ == "__main__":
    main()
