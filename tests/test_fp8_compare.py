"""``dls.fp8.compare_recipes``: every recipe on the same batches and dropout masks, the shares it saturates and
flushes, the loss beside float32's, and nothing of the model or the global RNG left changed."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import dls.fp8


def model_and_batches() -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 1))
    batches = [(torch.randn(64, 16), torch.randn(64, 1)) for _ in range(3)]
    return model, batches


def loss_of(model: nn.Module) -> Callable[[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    return lambda batch: nn.functional.mse_loss(model(batch[0]), batch[1])


def test_compares_each_recipe_with_float32_and_changes_nothing() -> None:
    model, batches = model_and_batches()
    params = [p.detach().clone() for p in model.parameters()]
    marker = torch.full_like(model[0].weight, 7.0)
    model[0].weight.grad = marker
    rng = torch.get_rng_state()
    recipes = [dls.fp8.StaticScaling(), dls.fp8.CurrentScaling(), dls.fp8.DelayedScaling(amax_history_len=4)]
    rows = dls.fp8.compare_recipes(model, loss_of(model), batches, recipes, loss_weight=1e-6, seed=3)
    assert [r.recipe for r in rows] == [r.to_dict() for r in recipes]
    assert len({r.reference for r in rows}) == 1 and rows[0].reference == pytest.approx(
        sum(loss_of(model.eval())(b).item() for b in batches) / 3, rel=0.2
    )  # (dropout on: near, not equal)
    static, current, _ = rows
    assert static.grad_flushed > 0.99 and current.grad_flushed < 0.01  # 1e-6 x the gradients: below E5M2 at scale 1
    assert current.grad_saturated == 0 and abs(current.loss / current.reference - 1) < 0.05
    assert all(0 <= r.forward_flushed < 0.05 for r in rows)
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    assert model[0].weight.grad is marker and all(p.grad is None for p in list(model.parameters())[1:])
    assert torch.equal(torch.get_rng_state(), rng)
    model.train()
    again = dls.fp8.compare_recipes(model, loss_of(model), batches, recipes, loss_weight=1e-6, seed=3)
    assert again == rows  # seeded per pass: the same dropout masks, the same numbers


def test_a_loss_scale_lifts_the_gradients_into_range() -> None:
    model, batches = model_and_batches()
    recipe = [dls.fp8.StaticScaling()]
    (plain,) = dls.fp8.compare_recipes(model, loss_of(model), batches, recipe, loss_weight=1e-6)
    (scaled,) = dls.fp8.compare_recipes(model, loss_of(model), batches, recipe, loss_weight=1e-6, loss_scale=2.0**20)
    assert scaled.grad_flushed < 0.05 < 0.99 < plain.grad_flushed
    assert scaled.loss == plain.loss  # the scale reaches the backward pass only


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"recipes": [{"recipe": "static"}]}, "recipes must be dls.fp8 recipes"),
        ({"loss_scale": float("inf")}, "loss_scale must be a finite number"),
        ({"loss_weight": True}, "loss_weight must be a finite number"),
    ],
)
def test_bad_arguments_raise_before_anything_runs(kwargs: dict, needle: str) -> None:
    model, batches = model_and_batches()
    calls: list[int] = []

    def counted(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        calls.append(1)
        return loss_of(model)(batch)

    with pytest.raises(ValueError, match=needle):
        dls.fp8.compare_recipes(model, counted, batches, **{"recipes": [dls.fp8.CurrentScaling()], **kwargs})
    assert calls == []
