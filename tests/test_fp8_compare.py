"""``dls.fp8.compare_recipes``: every recipe on the same batches and dropout masks, the shares it saturates and
flushes, the loss beside float32's, as a table too, and nothing of the model or the global RNG left changed."""

from __future__ import annotations

import re
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
    fp8 = dls.fp8.compare_recipes(model, loss_of(model), batches, recipes, loss_weight=1e-6, seed=3)
    assert [r.recipe for r in fp8.results] == recipes and fp8.passes == 3 and fp8.loss_scale == 1.0
    float32 = sum(loss_of(model.eval())(b).item() for b in batches) / 3
    assert fp8.reference == pytest.approx(float32, rel=0.2)  # (dropout on: near, not equal)
    static, current, _ = fp8.results
    assert static.grad_flushed > 0.99 and current.grad_flushed < 0.01  # 1e-6 x the gradients: below E5M2 at scale 1
    assert current.grad_saturated == 0 and abs(current.loss / fp8.reference - 1) < 0.05
    assert all(0 <= r.forward_flushed < 0.05 for r in fp8.results)
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    assert model[0].weight.grad is marker and all(p.grad is None for p in list(model.parameters())[1:])
    assert torch.equal(torch.get_rng_state(), rng)
    model.train()
    again = dls.fp8.compare_recipes(model, loss_of(model), batches, recipes, loss_weight=1e-6, seed=3)
    assert again == fp8  # seeded per pass: the same dropout masks, the same numbers


def test_to_text_is_a_table_of_the_recipes_beside_float32() -> None:
    model, batches = model_and_batches()
    recipes = [dls.fp8.CurrentScaling(), dls.fp8.DelayedScaling(margin=2)]
    text = dls.fp8.compare_recipes(model, loss_of(model), batches, recipes, loss_scale=2.0**15).to_text()
    header, reference, current, delayed, note = text.splitlines()
    columns = ["recipe", "grad_output saturated", "grad_output flushed", "forward flushed", "loss", "vs fp32"]
    assert re.split(r"\s{2,}", header) == columns
    assert reference.split()[:4] == ["float32", "-", "-", "-"] and reference.endswith("1.0000x")
    assert current.startswith("current scaling  ") and delayed.startswith("delayed scaling, margin 2  ")
    assert note.startswith("3 forward/backward passes per recipe, gradients at loss scale 2^15.")


def test_a_loss_scale_lifts_the_gradients_into_range() -> None:
    model, batches = model_and_batches()
    recipe = [dls.fp8.StaticScaling()]
    (plain,) = dls.fp8.compare_recipes(model, loss_of(model), batches, recipe, loss_weight=1e-6).results
    (scaled,) = dls.fp8.compare_recipes(
        model, loss_of(model), batches, recipe, loss_weight=1e-6, loss_scale=2.0**20
    ).results
    assert scaled.grad_flushed < 0.05 < 0.99 < plain.grad_flushed
    assert scaled.loss == plain.loss  # the scale reaches the backward pass only


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"recipes": [{"recipe": "static"}]}, "recipes must be dls.fp8 recipes"),
        ({"loss_scale": float("inf")}, "loss_scale must be a finite number"),
        ({"loss_weight": True}, "loss_weight must be a finite number"),
        ({"batches": []}, "batches yielded no batch"),
    ],
)
def test_bad_arguments_raise_before_anything_runs(kwargs: dict, needle: str) -> None:
    model, batches = model_and_batches()
    calls: list[int] = []

    def counted(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        calls.append(1)
        return loss_of(model)(batch)

    with pytest.raises(ValueError, match=needle):
        dls.fp8.compare_recipes(model, counted, **{"batches": batches, "recipes": [dls.fp8.CurrentScaling()], **kwargs})
    assert calls == []
