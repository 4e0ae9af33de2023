"""``update()``: the scale rule once per iteration, or a scale set by the user (``new_scale``), always a scale the
scaler can hold."""

from __future__ import annotations

import math

import pytest
import torch

import dls


def _iteration(scaler: dls.GradScaler, p: torch.nn.Parameter, opt: torch.optim.Optimizer, grad: float = 1.0) -> None:
    scaler.scale(p.sum() * grad).backward()
    scaler.step(opt)


@pytest.mark.parametrize("bad", [math.nan, 0.0, -4.0, math.inf, 1e-300, 1e-40, 1e39])
def test_a_bad_float_new_scale_raises_and_changes_nothing(bad: float):
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = dls.GradScaler("dynamic", init_scale=8.0)
    _iteration(scaler, p, opt)
    with pytest.raises(ValueError, match="new_scale"):
        scaler.update(new_scale=bad)
    assert scaler.get_scale() == 8.0


@pytest.mark.parametrize("bad", [math.nan, 0.0, -4.0, math.inf, 1e-300, 1e-40])
def test_a_bad_tensor_new_scale_keeps_the_old_scale_and_is_warned_about_at_the_next_read(bad: float):
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = dls.GradScaler("dynamic", init_scale=8.0)
    _iteration(scaler, p, opt)
    scaler.update(new_scale=torch.tensor(bad, dtype=torch.float64))  # checked on the device: no error here
    opt.zero_grad()
    _iteration(scaler, p, opt)  # and training goes on at the old scale, with finite weights
    scaler.update()
    assert torch.isfinite(p).all()
    with pytest.warns(UserWarning, match="1 value"):
        assert scaler.get_scale() == 8.0
    with pytest.warns(UserWarning, match="1 value"):
        scaler.update(new_scale=torch.tensor(bad))
        scaler.state_dict()


def test_a_good_tensor_new_scale_is_taken_without_reading_the_device():
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = dls.GradScaler("dynamic", init_scale=8.0)
    _iteration(scaler, p, opt)
    calls = []
    original = torch.Tensor.item
    torch.Tensor.item = lambda self: calls.append(1) or original(self)  # type: ignore[method-assign]
    try:
        scaler.update(new_scale=torch.tensor(0.5))
    finally:
        torch.Tensor.item = original  # type: ignore[method-assign]
    assert not calls and scaler.get_scale() == 0.5


def test_a_new_scale_below_one_makes_the_next_unscale_check_the_unscaled_values():
    # The host cannot know a tensor new_scale; the next step must still catch the overflow it allows.
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = dls.GradScaler("dynamic", init_scale=2.0**10)
    _iteration(scaler, p, opt, grad=1.0)
    scaler.update(new_scale=torch.tensor(0.25))
    opt.zero_grad()
    scaler.scale((p.float() * 2e-15).sum() * 1e20).backward()  # 2e5 per element: fits scaled, not unscaled
    assert scaler.step(opt) is None and torch.isfinite(p).all()
