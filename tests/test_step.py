"""optimizer_step equals the manual sequence, validates first, and handles lists of optimizers."""

from __future__ import annotations

import math

import pytest
import torch

import dls


def _setup(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _loss(model: torch.nn.Module, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return model(torch.randn(8, 6, generator=g)).pow(2).mean() * 10


@pytest.mark.parametrize("clip", [None, "norm", "value", "scaler-norm"])
def test_optimizer_step_equals_manual_sequence(clip: str | None):
    model, opt = _setup()
    ref, ref_opt = _setup()
    scaler_norm = 0.05 if clip == "scaler-norm" else None
    scaler = dls.GradScaler("dynamic", init_scale=2.0**10, steps_per_increase=2, max_gradient_norm=scaler_norm)
    ref_scaler = dls.GradScaler("dynamic", init_scale=2.0**10, steps_per_increase=2)
    for i in range(8):
        dls.optimizer_step(
            _loss(model, i),
            opt,
            scaler,
            max_gradient_norm=0.05 if clip == "norm" else None,
            max_gradient_value=0.01 if clip == "value" else None,
        )
        ref_scaler.scale(_loss(ref, i)).backward()
        ref_scaler.unscale_(ref_opt)
        if clip in ("norm", "scaler-norm"):
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        elif clip == "value":
            torch.nn.utils.clip_grad_value_(ref.parameters(), 0.01)
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        ref_opt.zero_grad()
        assert scaler.get_scale() == ref_scaler.get_scale()
        assert all(p.grad is None for p in model.parameters())
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_optimizer_step_with_a_list_shares_one_norm_and_one_flag():
    m1, o1 = _setup(1)
    m2, o2 = _setup(2)
    r1, q1 = _setup(1)
    r2, q2 = _setup(2)
    scaler = dls.GradScaler("dynamic")
    dls.optimizer_step(_loss(m1, 0) + _loss(m2, 0), [o1, o2], scaler, max_gradient_norm=0.1)
    (_loss(r1, 0) + _loss(r2, 0)).backward()
    torch.nn.utils.clip_grad_norm_(list(r1.parameters()) + list(r2.parameters()), 0.1)
    q1.step()
    q2.step()
    for p, q in zip(list(m1.parameters()) + list(m2.parameters()), list(r1.parameters()) + list(r2.parameters())):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_optimizer_step_skips_on_overflow():
    model, opt = _setup()
    scaler = dls.GradScaler("dynamic", init_scale=2.0**10)
    before = [p.detach().clone() for p in model.parameters()]
    loss = _loss(model, 0) * float("inf")
    dls.optimizer_step(loss, opt, scaler, max_gradient_norm=1.0)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert scaler.get_num_skipped_steps() == 1 and scaler.get_scale() == 2.0**9
    assert opt.state_dict()["state"] == {}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_gradient_norm": 1.0, "max_gradient_value": 1.0}, "not both"),
        ({"max_gradient_norm": -1.0}, "max_gradient_norm"),
        ({"max_gradient_value": -0.5}, "max_gradient_value"),
        ({"max_gradient_value": float("nan")}, "max_gradient_value"),
    ],
)
def test_optimizer_step_validates_before_running(kwargs: dict, message: str):
    model, opt = _setup()
    scaler = dls.GradScaler("dynamic")
    with pytest.raises(ValueError, match=message):
        dls.optimizer_step(_loss(model, 0), opt, scaler, **kwargs)
    assert all(p.grad is None for p in model.parameters())  # nothing ran, not even backward
    with pytest.raises(ValueError, match="grad_scaler"):
        dls.optimizer_step(_loss(model, 0), opt, torch.amp.GradScaler("cpu"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="optimizer"):
        dls.optimizer_step(_loss(model, 0), model, scaler)  # type: ignore[arg-type]


def test_optimizer_step_with_disabled_scaler_still_clips():
    model, opt = _setup()
    ref, ref_opt = _setup()
    dls.optimizer_step(_loss(model, 0), opt, dls.GradScaler(enabled=False), max_gradient_norm=0.05)
    _loss(ref, 0).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("started", ["unscale_", "clip", "step"])
def test_optimizer_step_in_a_started_iteration_raises_and_changes_nothing(started: str):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = dls.GradScaler("dynamic", init_scale=2.0**10)
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    {
        "unscale_": lambda: scaler.unscale_(opt),
        "clip": lambda: scaler.clip_gradients_and_return_isfinite(opt),
        "step": lambda: scaler.step(opt),
    }[started]()
    weights = [p.detach().clone() for p in model.parameters()]
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    scale = scaler.get_scale()
    with pytest.raises(RuntimeError, match="already been called"):
        dls.optimizer_step(model(torch.ones(2, 4)).sum(), opt, scaler)
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))  # type: ignore[arg-type]
    assert scaler.get_scale() == scale


def test_optimizer_step_returns_device_tensors_without_reading_them():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = dls.GradScaler("dynamic", init_scale=2.0**10, max_gradient_norm=0.5)
    result = dls.optimizer_step(model(torch.ones(2, 4)).sum(), opt, scaler)
    assert result.loss_scale.item() == 2.0**10 and not result.found_inf.item()
    # The norm before clipping: the gradients of sum(Wx + b) over 2 rows of ones are 2 each (5 of them).
    assert result.grad_norm is not None and abs(result.grad_norm.item() - math.sqrt(5 * 4.0)) < 1e-5
    plain = dls.GradScaler("dynamic")
    assert dls.optimizer_step(model(torch.ones(2, 4)).sum(), opt, plain).grad_norm is None
    asked = dls.optimizer_step(model(torch.ones(2, 4)).sum(), opt, plain, gradient_norm=True)
    assert asked.grad_norm is not None and abs(asked.grad_norm.item() - math.sqrt(20.0)) < 1e-4
