"""``scale()``: the loss times the scale, in float32 for half-precision losses, through the containers torch.amp
accepts, and in torch's gradient-penalty pattern."""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch

import dls
from conftest import dls_scaler, loss_of, side_by_side, tiny_model, torch_scaler


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_losses_are_scaled_in_float32(dtype: torch.dtype) -> None:
    scaler = dls.GradScaler("dynamic", init_scale=2.0**15)
    scaled = scaler.scale(torch.tensor(4.0, dtype=dtype))
    assert scaled.dtype == torch.float32 and scaled.item() == 4.0 * 2**15  # in float16 it would be inf


def test_float64_loss_is_scaled_in_float64_and_trains_like_torch() -> None:
    scaled = dls_scaler(init_scale=2.0**10).scale(torch.tensor(1.0 / 3.0, dtype=torch.float64))
    assert scaled.dtype == torch.float64 and scaled.item() == (1.0 / 3.0) * 2**10

    def body(scaler: Any, model: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
        scaler.scale(loss_of(model, i).double()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    side_by_side(body, lambda ps: torch.optim.SGD(ps, lr=0.1), 3)


def test_containers_are_scaled_like_torch_and_named_tuples_keep_their_type() -> None:
    t, d = torch_scaler(2.0**3), dls_scaler(2.0**3)
    a, b = torch.tensor(1.0), torch.tensor([2.0, 3.0])
    for value in ([a, b], (a, b), [], (), [(a,), [b]]):
        ours, theirs = d.scale(value), t.scale(value)
        assert type(ours) is type(theirs)
        assert repr(ours) == repr(theirs)
    gen_ours, gen_theirs = d.scale(x for x in (a, b)), t.scale(x for x in (a, b))
    assert [x.tolist() for x in gen_ours] == [x.tolist() for x in gen_theirs]
    pair = collections.namedtuple("pair", "loss aux")
    scaled = d.scale(pair(a, [b]))
    assert isinstance(scaled, pair) and scaled.loss.item() == 8.0 and scaled.aux[0].tolist() == [16.0, 24.0]
    assert d.scale(torch.tensor(3, dtype=torch.int64)).item() == 24.0
    with pytest.raises(ValueError, match="outputs must be a Tensor"):
        d.scale(3.0)
    with pytest.raises(ValueError, match="outputs"):
        d.scale([a, "loss"])


def test_gradient_penalty_with_create_graph_matches_unscaled_training() -> None:
    model, ref = tiny_model(), tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler = dls.GradScaler("dynamic", init_scale=2.0**10)

    loss = loss_of(model)
    scaled_grads = torch.autograd.grad(scaler.scale(loss), list(model.parameters()), create_graph=True)
    inv_scale = 1.0 / scaler.get_scale()
    penalty = sum(((g * inv_scale) ** 2).sum() for g in scaled_grads)
    scaler.scale(loss + penalty).backward()
    scaler.step(opt)
    scaler.update()

    ref_loss = loss_of(ref)
    grads = torch.autograd.grad(ref_loss, list(ref.parameters()), create_graph=True)
    (ref_loss + sum((g**2).sum() for g in grads)).backward()
    ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
