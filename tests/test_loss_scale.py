"""The host's bound on the scale (``dls.loss_scale``): it decides whether the passes check unscaled values, so it
must never be above the scale, and must not decay into needless checks on paths that never read the device."""

from __future__ import annotations

import pytest
import torch

import dls
from conftest import host_reads
from dls import kernels


def _fused_run(scaler: dls.GradScaler, steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    for _ in range(steps):
        scaler.scale(model(torch.randn(3, 4)).sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return model, opt


def test_the_bound_stays_exact_without_host_reads_on_the_fused_path(monkeypatch: pytest.MonkeyPatch):
    scaler = dls.GradScaler("cpu")  # 2**16: 40 updates would take a decaying bound far below 1
    model, opt = _fused_run(scaler, 2)
    seen: list[bool] = []
    original = kernels.check_unscaled_

    def spy(groups, factor, found_inf, factor_may_exceed_one):  # type: ignore[no-untyped-def]
        seen.append(factor_may_exceed_one)
        return original(groups, factor, found_inf, factor_may_exceed_one)

    monkeypatch.setattr(kernels, "check_unscaled_", spy)
    with host_reads() as calls:
        for _ in range(40):
            scaler.scale(model(torch.randn(3, 4)).sum()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    assert not [c for c in calls if "dls" in c[1]]
    assert seen == [False] * 40


@pytest.mark.parametrize("value", [0.25, 4.0])
def test_a_tensor_new_scale_is_known_on_the_host_at_the_next_check(value: float):
    scaler = dls.GradScaler("cpu", init_scale=2.0**10)
    model, opt = _fused_run(scaler, 2)
    scaler.scale(model(torch.randn(3, 4)).sum()).backward()
    scaler.step(opt)
    scaler.update(new_scale=torch.tensor(value))
    loss_scale = scaler._scale  # the bound is an internal of the scaler: checked here, where it is defined
    assert loss_scale.at_least <= value
    assert loss_scale.may_be_below_one == (value < 1)
    assert loss_scale.at_least == value
