"""``step_was_skipped``: the public answer to "was the last step of this optimizer applied?"."""

from __future__ import annotations

import pytest
import torch

import dls


@pytest.mark.parametrize("sync_free", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_step_was_skipped_follows_injected_overflows(fused: bool, sync_free: bool):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)
    scaler = dls.GradScaler("dynamic", sync_free=sync_free)
    with pytest.raises(RuntimeError, match="has not stepped"):
        scaler.step_was_skipped(opt)
    seen = []
    for i in range(5):
        scaler.scale(model(torch.randn(3, 4)).sum()).backward()
        if i in (0, 3):
            model.weight.grad[0, 0] = float("inf")  # type: ignore[index]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        seen.append((scaler.step_was_skipped(opt), bool(scaler.step_was_skipped_tensor(opt))))
    assert seen == [(i in (0, 3), i in (0, 3)) for i in range(5)]


def test_disabled_scaler_never_skips():
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = dls.GradScaler("dynamic", enabled=False)
    scaler.scale(model(torch.randn(3, 4)).sum()).backward()
    scaler.step(opt)
    assert scaler.step_was_skipped(opt) is False
    assert not scaler.step_was_skipped_tensor(opt)
