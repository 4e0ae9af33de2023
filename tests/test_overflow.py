"""The overflow decision: a step is skipped when a gradient, as the optimizer would receive it, is not finite.

Covers gradients that are finite while scaled but overflow once unscaled by a scale below 1 (float16 parameters whose
true gradient exceeds 65504, float32 gradients beyond float32's range), on every path: unfused, fused, with and
without clipping, sync-free; and that no optimizer ever writes a non-finite weight because of them.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import dls

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.1),
    "adam-fused": lambda ps: torch.optim.Adam(ps, lr=0.1, fused=True),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=0.1, foreach=True),
}


def _train(opt_name: str, dtype: torch.dtype, grad: float, steps: int = 25, **scaler_kwargs) -> tuple:
    """Train ``ones(4)`` on a loss whose gradient is ``grad`` per element. The factor is split in two so that the
    backward pass computes ``scale * 1e20 * (grad / 1e20)``: finite whenever the scaled gradient is."""
    p = torch.nn.Parameter(torch.ones(4, dtype=dtype))
    opt = OPTIMIZERS[opt_name]([p])
    scaler = dls.GradScaler("dynamic", **scaler_kwargs)
    taken = 0
    for _ in range(steps):
        before = p.detach().clone()
        scaler.scale((p.float() * (grad / 1e20)).sum() * 1e20).backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's fused kernels warn about fp16 params on CPU
            scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if not scaler.step_was_skipped(opt):
            taken += 1
        else:
            assert torch.equal(p.detach(), before)
    return p.detach(), scaler, taken


@pytest.mark.parametrize("sync_free", [False, True])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_float16_gradient_that_overflows_only_when_unscaled_is_skipped(opt_name: str, sync_free: bool):
    # The true gradient 2e5 exceeds float16's 65504 at every scale: below a scale of ~0.33 the *scaled* gradient
    # fits float16, but the unscaled one does not, so no step may be taken and the weights stay finite.
    p, scaler, taken = _train(opt_name, torch.float16, 2e5, sync_free=sync_free)
    assert torch.isfinite(p).all() and torch.equal(p, torch.ones(4, dtype=torch.float16))
    assert taken == 0 and scaler.get_num_skipped_steps() == 25
    assert scaler.get_scale() < 0.33  # the scaled gradient did fit float16 at the end


@pytest.mark.parametrize("opt_name", ["sgd", "adam", "adam-fused"])
def test_float32_gradient_beyond_float32_range_once_unscaled_is_skipped(opt_name: str):
    # Scaled by 2**-14 a gradient of 1e35 * 2**14 (beyond float32's 3.4e38) fits; unscaled it is inf.
    p, scaler, taken = _train(opt_name, torch.float32, 1e35 * 2.0**14, steps=40, min_loss_scale=2.0**-14)
    assert torch.isfinite(p).all() and taken == 0
    assert scaler.get_scale() == 2.0**-14


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_clipping_keeps_a_large_float16_gradient_finite_and_trains(opt_name: str):
    # With clipping to 1.0 the gradient the optimizer receives is finite and small: the step is taken.
    p, _, taken = _train(opt_name, torch.float16, 2e5, max_gradient_norm=1.0)
    assert torch.isfinite(p).all() and taken > 0 and not torch.equal(p, torch.ones(4, dtype=torch.float16))


def test_clipping_to_a_norm_beyond_float16_still_skips_what_overflows():
    # A clip limit above float16's range does not bound the float16 gradient: overflow after clipping is caught.
    p, _, taken = _train("sgd", torch.float16, 2e5, max_gradient_norm=1e6)
    assert torch.isfinite(p).all() and taken == 0


@pytest.mark.parametrize("opt_name", ["sgd", "adam", "adam-fused"])
def test_the_same_large_gradient_trains_when_it_fits_after_unscaling(opt_name: str):
    # 3e4 fits float16 unscaled: once the scale has backed off below ~2, steps are taken and weights stay finite.
    p, _, taken = _train(opt_name, torch.float16, 3e4, steps=30)
    assert torch.isfinite(p).all() and taken > 0


def test_explicit_unscale_then_step_skips_the_overflowing_unscale():
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = dls.GradScaler("dynamic", init_scale=0.25)
    scaler.scale((p.float() * 2e5).sum()).backward()
    assert torch.isfinite(p.grad).all()  # scaled: 5e4 fits float16
    scaler.unscale_(opt)
    assert scaler.step(opt) is None and torch.equal(p.detach(), torch.ones(4, dtype=torch.float16))


def test_no_extra_pass_while_the_scale_is_known_to_be_at_least_one(monkeypatch: pytest.MonkeyPatch):
    """The post-unscale check costs a pass only while the scale may be below 1."""
    from dls import kernels

    calls: list[int] = []
    original = kernels.check_nonfinite

    def counting(grads, found_inf):  # type: ignore[no-untyped-def]
        calls.append(len(grads))
        return original(grads, found_inf)

    monkeypatch.setattr(kernels, "check_nonfinite", counting)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    high = dls.GradScaler("dynamic", init_scale=2.0**10)
    low = dls.GradScaler("dynamic", init_scale=0.5)
    for scaler, expected in ((high, 0), (low, 1)):
        calls.clear()
        scaler.scale(model(torch.ones(3, 4)).sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        assert len(calls) == expected
