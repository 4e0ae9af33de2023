"""A disabled scaler (``enabled=False``, the bfloat16 default ``loss_scale=None``, or a CUDA device on a machine
without CUDA): every method is a pass-through, as in torch, except that ``max_gradient_norm`` still clips."""

from __future__ import annotations

import pickle
import warnings
from typing import Any

import pytest
import torch

import dls
from conftest import INF, assert_tensors_equal, dls_scaler, loss_of, tiny_model, torch_scaler

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


def test_every_method_is_a_pass_through() -> None:
    model, ref = tiny_model(), tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler = dls.GradScaler("dynamic", enabled=False, max_gradient_norm=0.01)
    loss = loss_of(model)
    assert scaler.scale(loss) is loss and scaler.scale([loss])[0] is loss
    loss.backward()
    loss_of(ref).backward()
    scaler.unscale_(opt)
    scaler.unscale_(opt)  # no stage tracking: no "already called" error
    assert_tensors_equal([p.grad for p in model.parameters()], [p.grad for p in ref.parameters()])
    isfinite = scaler.clip_gradients_and_return_isfinite(opt)  # clipping still applies
    assert isfinite.dtype == torch.bool and bool(isfinite)
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-10)
    scaler.update_scale(opt)
    assert scaler.step_if_finite(opt) is None  # steps (no "needs the overflow flag" error)
    ref_opt.step()
    scaler.step(opt)
    ref_opt.step()
    scaler.update()
    scaler.update(new_scale=4.0)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-8)
    assert scaler.get_scale() == scaler.get_non_clamped_scale() == 1.0
    assert scaler.get_num_skipped_steps() == 0 and scaler.state_dict() == {}
    assert not scaler.is_enabled() and scaler.mode == "off"
    assert scaler.step_was_skipped(opt) is False and not scaler.step_was_skipped_tensor(opt)  # never skips
    # The flag still tells the truth about an overflow, but nothing is skipped when disabled.
    opt.zero_grad()
    scaler.scale(loss_of(model) * INF).backward()
    assert not bool(scaler.clip_gradients_and_return_isfinite(opt))
    no_clip = dls.GradScaler(enabled=False)
    assert bool(no_clip.clip_gradients_and_return_isfinite(opt))  # no norm computed without max_gradient_norm
    pickle.loads(pickle.dumps(scaler))


@pytest.mark.parametrize("entry", ["step", "optimizer_step"])
@pytest.mark.parametrize("how", ["enabled=False", "bfloat16-off"])
def test_max_gradient_norm_still_clips(how: str, entry: str) -> None:
    if how == "bfloat16-off":
        dls.set_half_dtype("bfloat16")
        scaler = dls.GradScaler(max_gradient_norm=0.01)
        assert scaler.mode == "off"
    else:
        scaler = dls.GradScaler("dynamic", enabled=False, max_gradient_norm=0.01)
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=1.0)
    if entry == "step":
        scaler.scale((p * 100.0).sum()).backward()
        scaler.step(opt)
    else:
        dls.optimizer_step((p * 100.0).sum(), opt, scaler)
    # Each gradient is 100 (norm 200), clipped to a norm of 0.01: 0.005 each, one SGD step at lr 1.
    torch.testing.assert_close(p.detach(), torch.full((4,), 1.0 - 0.005), rtol=0, atol=1e-7)


def _closure_step(scaler: Any) -> tuple[float, list[float]]:
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.5)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = p.sum()
        loss.backward()
        return loss

    return scaler.step(opt, closure=closure).item(), p.tolist()


def test_step_passes_a_closure_through_like_torch() -> None:
    ours = _closure_step(dls.GradScaler(enabled=False))
    assert ours == _closure_step(torch.amp.GradScaler("cpu", enabled=False)) == (2.0, [0.5, 0.5])


def test_loading_a_state_dict_is_a_no_op_like_torch() -> None:
    sd = dls_scaler(init_scale=2.0**3).state_dict()
    torch_sd = torch_scaler().state_dict()
    for scaler in (dls.GradScaler(enabled=False), torch.amp.GradScaler("cpu", enabled=False)):
        for d in ({}, sd if isinstance(scaler, dls.GradScaler) else torch_sd):
            scaler.load_state_dict(d)
        assert scaler.get_scale() == 1.0 and scaler.state_dict() == {}
    dls.set_half_dtype("bfloat16")  # default scaler of bfloat16: mode off
    bf16_off = dls.GradScaler(loss_scale=None)
    bf16_off.load_state_dict(sd)
    assert bf16_off.mode == "off" and bf16_off.state_dict() == {}


@no_cuda
@pytest.mark.parametrize("cls", [torch.amp.GradScaler, dls.GradScaler], ids=["torch", "dls"])
def test_device_cuda_without_cuda_disables_silently_when_disabled_and_with_a_warning_otherwise(cls: Any) -> None:
    """``GradScaler("cuda", enabled=use_amp)`` is the usual torch idiom: on a CPU-only machine both libraries build
    a disabled scaler, warning only when it was asked to be enabled, and never touch the device."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet = cls("cuda", enabled=False)
    assert not quiet.is_enabled() and quiet.get_scale() == 1.0
    with pytest.warns(UserWarning, match="CUDA is not available"):
        assert not cls("cuda").is_enabled()
