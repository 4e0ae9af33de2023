"""``compare_recipes``: what each FP8 recipe does to one model on the same batches, before training with any."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from dls.diagnostics.scales import percent, pow2
from dls.fp8.gemm import emulate_recipe
from dls.fp8.recipes import RECIPE_NAMES, Recipe

__all__ = ["RecipeComparison", "RecipeResult", "compare_recipes"]


@dataclasses.dataclass(frozen=True)
class RecipeResult:
    """One recipe, over every cast of every pass: the shares of nonzero values saturated (clamped to the format's
    max) and flushed (rounded to zero), and the mean loss.

    Attributes:
        recipe: the recipe.
        grad_saturated: share of nonzero ``grad_output`` values (the gradients into each Linear layer) saturated.
        grad_flushed: share of nonzero ``grad_output`` values flushed to zero.
        forward_flushed: share of nonzero forward operands (inputs and weights) flushed to zero.
        loss: the mean of ``loss_fn`` over the passes under the recipe.
    """

    recipe: Recipe
    grad_saturated: float
    grad_flushed: float
    forward_flushed: float
    loss: float


@dataclasses.dataclass(frozen=True)
class RecipeComparison:
    """What [`compare_recipes`][dls.fp8.compare_recipes] returns: ``results`` (one
    [`RecipeResult`][dls.fp8.RecipeResult] per recipe, in order), the float32 ``reference`` loss (the mean over the same
    passes, no FP8), the ``loss_scale`` the gradients were cast at and the number of ``passes`` per recipe;
    ``to_text()`` renders them as a table."""

    results: tuple[RecipeResult, ...]
    reference: float
    loss_scale: float
    passes: int

    def to_text(self) -> str:
        """A table: per recipe (``Recipe.describe()``) the three shares, the loss and its ratio to float32's."""
        body = [["recipe", "grad_output saturated", "grad_output flushed", "forward flushed", "loss", "vs fp32"]]
        body.append(["float32", "-", "-", "-", f"{self.reference:.5g}", "1.0000x"])
        for r in self.results:
            shares = [percent(v) for v in (r.grad_saturated, r.grad_flushed, r.forward_flushed)]
            ratio = f"{r.loss / self.reference:.4f}x" if self.reference else "-"
            body.append([r.recipe.describe(), *shares, f"{r.loss:.5g}", ratio])
        widths = [max(map(len, column)) for column in zip(*body)]
        lines = ["  ".join([row[0].ljust(widths[0]), *map(str.rjust, row[1:], widths[1:])]).rstrip() for row in body]
        return "\n".join(lines) + (
            f"\n{self.passes} forward/backward passes per recipe, gradients at loss scale {pow2(self.loss_scale)}. "
            "saturated / flushed: shares of nonzero values clamped to the format's max / rounded to zero "
            "(grad_output: into each Linear layer; forward: its inputs and weights). Delayed scaling's first pass is "
            "at scale 1, as a run's."
        )


def compare_recipes(
    model: nn.Module,
    loss_fn: Callable[[Any], torch.Tensor],
    batches: Iterable[Any],
    recipes: Sequence[Recipe],
    *,
    loss_weight: float = 1.0,
    loss_scale: float = 1.0,
    seed: int = 0,
) -> RecipeComparison:
    """Run ``loss_fn(batch)`` (``model``'s loss on ``batch``) for every batch of ``batches`` in float32 (no backward),
    then with ``model`` under [`dls.fp8.emulate_recipe`][dls.fp8.gemm.emulate_recipe] with each recipe in turn
    (forward and backward), and compare.

    ``batches`` is iterated once for the float32 reference and once per recipe, so it must yield the same batches
    each time (a list, or an object whose ``__iter__`` starts over). Pass ``i`` of each iteration runs with torch's
    RNGs seeded ``seed + i`` (dropout draws alike under every recipe) inside ``torch.random.fork_rng``, so the
    global RNG states are left as they were. The backward pass differentiates ``loss * loss_weight * loss_scale``:
    ``loss_scale`` is the loss scale the gradients would be cast at (a ``dls.GradScaler``'s), ``loss_weight`` a
    factor of the gradients the reported loss leaves out. No optimizer step is taken: parameters are never written
    and every parameter's ``.grad`` (the tensor object itself) is put back.

    Args:
        model: the model, in float32; every ``nn.Linear`` in it is emulated under each recipe in turn.
        loss_fn: ``loss_fn(batch)`` computes ``model``'s loss on ``batch``.
        batches: the batches, iterable more than once.
        recipes: the recipes to compare (``dls.fp8`` recipes).
        loss_weight: a factor of the gradients that the reported loss leaves out.
        loss_scale: the loss scale the gradients are cast at.
        seed: torch's RNGs are seeded ``seed + i`` for pass ``i``.

    Returns:
        A [`RecipeComparison`][dls.fp8.RecipeComparison]: ``results[i]`` for ``recipes[i]``, the float32 ``reference``
        loss, ``to_text()``. A delayed-scaling recipe starts from fresh amax histories: its first pass casts at scale 1,
        as a run's first step does.

    Raises:
        ValueError: a recipe that is not a ``dls.fp8`` recipe, or a ``loss_weight`` / ``loss_scale`` that is not a
            finite number (nothing has run then); ``batches`` yielded nothing.
    """
    if bad := [r for r in recipes if not isinstance(r, tuple(RECIPE_NAMES.values()))]:
        raise ValueError(f"recipes must be dls.fp8 recipes; got {bad[0]!r}")
    for name, value in (("loss_weight", loss_weight), ("loss_scale", loss_scale)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number; got {value!r}")
    params = list(model.parameters())
    grads = [p.grad for p in params]
    devices = [torch.cuda.current_device()] if params and params[0].is_cuda else []

    def losses(backward: bool) -> list[torch.Tensor]:
        out = []
        for i, batch in enumerate(batches):
            with torch.random.fork_rng(devices=devices), torch.set_grad_enabled(backward):
                torch.manual_seed(seed + i)
                loss = loss_fn(batch)
                if backward:
                    (loss * (loss_weight * loss_scale)).backward()
                    model.zero_grad(set_to_none=True)
            out.append(loss.detach())
        return out

    results = []
    try:
        float32 = losses(backward=False)
        if not float32:
            raise ValueError("batches yielded no batch")
        for recipe in recipes:
            with emulate_recipe(model, recipe) as handle:
                loss, totals = _mean(losses(backward=True)), handle.stats.totals()
            grad, inp, weight = totals["grad_output"], totals["input"], totals["weight"]
            values = inp["values"] + weight["values"]
            flushed = inp["flushed_fraction"] * inp["values"] + weight["flushed_fraction"] * weight["values"]
            shares = float(grad["saturated_fraction"]), float(grad["flushed_fraction"]), float(flushed / (values or 1))
            results.append(RecipeResult(recipe, *shares, loss))
    finally:
        for p, g in zip(params, grads):
            p.grad = g
    return RecipeComparison(tuple(results), _mean(float32), loss_scale, len(float32))


def _mean(losses: list[torch.Tensor]) -> float:
    return float(torch.stack(losses).double().mean())
