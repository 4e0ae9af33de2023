"""``compare_recipes``: what each FP8 recipe does to one model on the same batches, before training with any."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from dls.fp8.emulate import emulate
from dls.fp8.recipes import RECIPE_NAMES, Recipe

__all__ = ["RecipeComparison", "compare_recipes"]


@dataclasses.dataclass(frozen=True)
class RecipeComparison:
    """One recipe, over every cast of every pass: the shares of nonzero values saturated (clamped to the format's
    max) and flushed (rounded to zero), and the mean loss beside float32's.

    Attributes:
        recipe: the recipe as ``Recipe.to_dict()`` writes it.
        grad_saturated: share of nonzero ``grad_output`` values (the gradients into each Linear layer) saturated.
        grad_flushed: share of nonzero ``grad_output`` values flushed to zero.
        forward_flushed: share of nonzero forward operands (inputs and weights) flushed to zero.
        loss: the mean of ``loss_fn`` over the passes under the recipe.
        reference: the same mean in float32 (no FP8), equal in every row.
    """

    recipe: dict[str, Any]
    grad_saturated: float
    grad_flushed: float
    forward_flushed: float
    loss: float
    reference: float


def compare_recipes(
    model: nn.Module,
    loss_fn: Callable[[Any], torch.Tensor],
    batches: Iterable[Any],
    recipes: Sequence[Recipe],
    *,
    loss_weight: float = 1.0,
    loss_scale: float = 1.0,
    seed: int = 0,
) -> list[RecipeComparison]:
    """Run ``loss_fn(batch)`` (``model``'s loss on ``batch``) for every batch of ``batches`` in float32 (no backward),
    then with ``model`` under :func:`dls.fp8.emulate` with each recipe in turn (forward and backward), and compare.

    ``batches`` is iterated once for the float32 reference and once per recipe, so it must yield the same batches
    each time (a list, or an object whose ``__iter__`` starts over). Pass ``i`` of each iteration runs with torch's
    RNGs seeded ``seed + i`` (dropout draws alike under every recipe) inside ``torch.random.fork_rng``, so the
    global RNG states are left as they were. The backward pass differentiates ``loss * loss_weight * loss_scale``:
    ``loss_scale`` is the loss scale the gradients would be cast at (a ``dls.GradScaler``'s), ``loss_weight`` a
    factor of the gradients the reported loss leaves out. No optimizer step is taken: parameters are never written
    and every parameter's ``.grad`` (the tensor object itself) is put back.

    Returns:
        One :class:`RecipeComparison` per recipe, in order. A delayed-scaling recipe starts from fresh amax
        histories: its first pass casts at scale 1, as a run's first step does.

    Raises:
        ValueError: a recipe that is not a ``dls.fp8`` recipe, or a ``loss_weight`` / ``loss_scale`` that is not a
            finite number (nothing has run then).
    """
    if bad := [r for r in recipes if not isinstance(r, tuple(RECIPE_NAMES.values()))]:
        raise ValueError(f"recipes must be dls.fp8 recipes; got {bad[0]!r}")
    for name, value in (("loss_weight", loss_weight), ("loss_scale", loss_scale)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number; got {value!r}")
    params = list(model.parameters())
    grads = [p.grad for p in params]
    devices = [torch.cuda.current_device()] if params and params[0].is_cuda else []

    def mean_loss(backward: bool) -> float:
        losses = []
        for i, batch in enumerate(batches):
            with torch.random.fork_rng(devices=devices), torch.set_grad_enabled(backward):
                torch.manual_seed(seed + i)
                loss = loss_fn(batch)
                if backward:
                    (loss * (loss_weight * loss_scale)).backward()
                    model.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        return float(torch.stack(losses).double().mean())

    rows = []
    try:
        reference = mean_loss(backward=False)
        for recipe in recipes:
            with emulate(model, recipe) as handle:
                loss, totals = mean_loss(backward=True), handle.stats.totals()
            grad, inp, weight = totals["grad_output"], totals["input"], totals["weight"]
            values = inp["values"] + weight["values"]
            flushed = inp["flushed_fraction"] * inp["values"] + weight["flushed_fraction"] * weight["values"]
            shares = float(grad["saturated_fraction"]), float(grad["flushed_fraction"]), float(flushed / (values or 1))
            rows.append(RecipeComparison(recipe.to_dict(), *shares, loss, reference))
    finally:
        for p, g in zip(params, grads):
            p.grad = g
    return rows
