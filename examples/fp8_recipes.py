"""Will this model train in FP8, and with which recipe? ``dls demo``'s MLP under every FP8 recipe, emulated.

The setting of ``dls demo``: a 3-layer tanh MLP (32 -> 128 -> 128 -> 128 -> 64) learns a fixed random teacher
network by regression (4096 samples, batch 128), Adam with lr 1e-3, the loss multiplied by 1e-4 (as a
down-weighted auxiliary loss would be: Adam does not mind, but every gradient is 1e4 times smaller). Every
``nn.Linear`` computes its three GEMMs with FP8 operands through ``dls.fp8.emulate_recipe`` (E4M3 inputs and weights,
E5M2 output gradients), from identical initial weights and batches:

* ``float32``: the reference;
* ``fp8, scale 1``: FP8 without per-tensor scaling (``StaticScaling(1.0)``): values are cast as they are;
* ``fp8, scale 1 + DLS``: the same with dynamic loss scaling (``dls.GradScaler``), the one scale the
  gradients get;
* ``current`` / ``current, row``: ``CurrentScaling()`` (torchao's tensorwise) and per-row scales;
* ``delayed``: ``DelayedScaling(amax_history_len=16)`` (TransformerEngine's recipe);
* ``mxfp8``: ``MXFP8()`` (blocks of 32, power-of-two scales).

Printed per run: the final loss (unweighted mean squared error over the whole data set, evaluated in float32
after training, as ``dls demo`` reports it), its ratio to float32's, and the share of nonzero output-gradient
values the E5M2 cast flushed to zero and saturated (over all steps). The loss-scaled run starts at, and is
capped at, a scale of 2**24 (E5M2's smallest subnormal is 2**-16, float16's 2**-24).

Measured (600 steps, seed 0, about 25 s of CPU time):

    run                      loss  vs fp32  grad flushed  grad saturated  loss scale
    float32                0.0217    1.00x             -               -           -
    fp8, scale 1           0.3568   16.41x        100.0%           0.00%           -
    fp8, scale 1 + DLS     0.0220    1.01x          0.0%           0.00%        2^24
    current                0.0220    1.01x          0.0%           0.00%           -
    current, row           0.0219    1.01x          0.0%           0.00%           -
    delayed                0.0220    1.01x          0.2%           0.00%           -
    mxfp8                  0.0220    1.01x          0.0%           0.00%           -

(untrained: 0.3609). Delayed scaling's 0.2% is its first step, cast at scale 1.

    python examples/fp8_recipes.py [--steps 600] [--seed 0] [--threads 1]
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
import dls.fp8

LOSS_WEIGHT = 1e-4

RUNS: tuple[tuple[str, Any, bool], ...] = (
    ("float32", None, False),
    ("fp8, scale 1", dls.fp8.StaticScaling(1.0), False),
    ("fp8, scale 1 + DLS", dls.fp8.StaticScaling(1.0), True),
    ("current", dls.fp8.CurrentScaling(), False),
    ("current, row", dls.fp8.CurrentScaling(granularity="row"), False),
    ("delayed", dls.fp8.DelayedScaling(amax_history_len=16), False),
    ("mxfp8", dls.fp8.MXFP8(), False),
)


def make_problem(samples: int, width: int, depth: int, seed: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """``dls demo``'s task: inputs ``x ~ N(0, 1)`` (32 features) labelled by a random tanh teacher (64 hidden
    units, 64 outputs), and a student MLP of ``depth`` tanh layers of ``width``."""
    gen = torch.Generator().manual_seed(seed)
    d_in, d_out, hidden = 32, 64, 64
    x = torch.randn(samples, d_in, generator=gen)
    w1 = torch.randn(d_in, hidden, generator=gen) / math.sqrt(d_in)
    w2 = torch.randn(hidden, d_out, generator=gen) / math.sqrt(hidden)
    y = torch.tanh(x @ w1) @ w2
    torch.manual_seed(seed + 1)
    sizes = [d_in] + [width] * depth
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(sizes):
        layers += [nn.Linear(a, b), nn.Tanh()]
    layers.append(nn.Linear(width, d_out))
    return nn.Sequential(*layers), x, y


def train(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    recipe: Any,
    use_dls: bool,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
) -> dict[str, Any]:
    """Adam on ``LOSS_WEIGHT * mse`` over shuffled batches; returns the final float32 loss and FP8 facts."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    scaler = dls.GradScaler(loss_scale="dynamic", init_scale=2.0**24, max_loss_scale=2.0**24) if use_dls else None
    handle = dls.fp8.emulate_recipe(model, recipe) if recipe is not None else None
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(x), generator=gen)
    position = 0
    try:
        for _ in range(steps):
            if position + batch_size > len(x):
                order, position = torch.randperm(len(x), generator=gen), 0
            index = order[position : position + batch_size]
            position += batch_size
            loss = LOSS_WEIGHT * nn.functional.mse_loss(model(x[index]), y[index])
            if scaler is None:
                loss.backward()
                optimizer.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            optimizer.zero_grad(set_to_none=True)
        totals = handle.stats.totals()["grad_output"] if handle is not None else None
    finally:
        if handle is not None:
            handle.remove()
    with torch.no_grad():
        final = nn.functional.mse_loss(model(x), y).item()
    return {
        "final_loss": final,
        "flushed_fraction": totals["flushed_fraction"] if totals else None,
        "saturated_fraction": totals["saturated_fraction"] if totals else None,
        "loss_scale": scaler.get_scale() if scaler is not None else None,
    }


def run(
    steps: int = 600,
    *,
    samples: int = 4096,
    width: int = 128,
    depth: int = 3,
    batch_size: int = 128,
    lr: float = 1e-3,
    seed: int = 0,
    runs: tuple[tuple[str, Any, bool], ...] = RUNS,
) -> dict[str, dict[str, Any]]:
    """Train every run of ``runs`` from the same initial weights and batches; ``{run name: results}`` with
    ``final_loss``, ``flushed_fraction`` / ``saturated_fraction`` of the output gradients (``None`` for
    float32) and ``loss_scale``; the untrained loss under ``"initial"``."""
    model, x, y = make_problem(samples, width, depth, seed)
    with torch.no_grad():
        results: dict[str, dict[str, Any]] = {"initial": {"final_loss": nn.functional.mse_loss(model(x), y).item()}}
    for name, recipe, use_dls in runs:
        results[name] = train(
            copy.deepcopy(model), x, y, recipe, use_dls, steps=steps, batch_size=batch_size, lr=lr, seed=seed
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (small tensors: 1 is fastest)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = run(args.steps, seed=args.seed)
    reference = results["float32"]["final_loss"]
    print(
        f"MLP 32-128-128-128-64, loss weight {LOSS_WEIGHT:g}, Adam 1e-3, {args.steps} steps; "
        f"untrained loss {results['initial']['final_loss']:.4f}"
    )
    print(f"{'run':<20}{'loss':>9}{'vs fp32':>9}{'grad flushed':>14}{'grad saturated':>16}{'loss scale':>12}")
    for name, _, _ in RUNS:
        r = results[name]
        flushed = "-" if r["flushed_fraction"] is None else f"{r['flushed_fraction']:.1%}"
        saturated = "-" if r["saturated_fraction"] is None else f"{r['saturated_fraction']:.2%}"
        scale = "-" if r["loss_scale"] is None else f"2^{math.log2(r['loss_scale']):.0f}"
        loss = r["final_loss"]
        print(f"{name:<20}{loss:>9.4f}{loss / reference:>8.2f}x{flushed:>14}{saturated:>16}{scale:>12}")


if __name__ == "__main__":
    main()
