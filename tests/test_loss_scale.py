"""The host's bound on the scale (``dls.loss_scale``): it decides whether the passes check unscaled values, so it
must never be above the scale, and must not decay into needless checks on paths that never read the device."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import dls
from conftest import OpLog, host_reads
from dls import kernels
from dls.checks import FLOAT32_TINY
from dls.loss_scale import LossScale


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
    known = scaler._scale.known  # the bound is an internal of the scaler: checked here, where it is defined
    assert known.scale_at_least <= value
    assert known.scale_may_be_below_one() == (value < 1)
    assert known.scale_at_least == value


# ---------------------------------------------------------------------------------------------- Known, path by path
def _holds(loss_scale: LossScale) -> None:
    """``Known``'s invariant, read against the device."""
    state, known = loss_scale.state, loss_scale.known
    assert known.scale_at_least <= state.loss_scale.item()
    assert known.skips_at_most >= state.num_skipped_steps.item()
    if known.non_clamped_is_scale:
        assert loss_scale.non_clamped() == state.loss_scale.item()
    if known.counters_in_range:
        assert state.steps_since_rescale.item() < loss_scale.rule.growth_interval  # type: ignore[attr-defined]


def _fresh(**kwargs: Any) -> LossScale:
    return LossScale(dls.ScalerSettings.cerebras("dynamic", **kwargs), torch.device("cpu"))


CLEAN, INF_FLAG = torch.tensor(0.0), torch.tensor(1.0)


def test_known_at_the_start_is_the_initial_state() -> None:
    loss_scale = _fresh(init_scale=8.0)
    known = loss_scale.known
    assert (known.scale_at_least, known.skips_at_most, known.non_clamped_is_scale, known.counters_in_range) == (
        8.0, 0, False, True
    )  # fmt: skip
    _holds(loss_scale)


def test_a_read_makes_the_bound_exact() -> None:
    loss_scale = _fresh(init_scale=0.5, min_loss_scale=2.0**-10)
    loss_scale.update(INF_FLAG)  # not known on the host: the bound falls by one back-off
    loss_scale.known._published = None  # as inside a compiled region: nothing published
    assert loss_scale.known.scale_at_least == 0.25
    loss_scale.state.loss_scale.fill_(0.75)  # as if the device held more than the bound says
    assert loss_scale.read() == 0.75 and loss_scale.known.scale_at_least == 0.75
    _holds(loss_scale)


def test_a_flag_read_while_below_one_reads_the_scale_too() -> None:
    loss_scale = _fresh(init_scale=0.5, min_loss_scale=2.0**-10)
    loss_scale.state.loss_scale.fill_(0.875)
    assert loss_scale.read_flag(CLEAN) is False and loss_scale.known.scale_at_least == 0.875
    _holds(loss_scale)


def test_an_update_known_clean_keeps_the_bound_and_leaves_the_non_clamped_scale_unwritten() -> None:
    loss_scale = _fresh(init_scale=4.0, steps_per_increase=1, max_loss_scale=16.0)
    with OpLog([loss_scale.state.non_clamped_scale]) as log:
        loss_scale.update(CLEAN, overflow=False)
    assert not log.ops  # non_clamped_scale neither read nor written
    assert loss_scale.known.non_clamped_is_scale and loss_scale.known.scale_at_least == 4.0
    assert loss_scale.known.skips_at_most == 0
    _holds(loss_scale)
    loss_scale.update(CLEAN, overflow=False)  # grows to 8 (cstorch's timing: the second update)
    assert loss_scale.state.loss_scale.item() == 8.0 and loss_scale.non_clamped() == 8.0
    _holds(loss_scale)


def test_an_update_known_clean_above_the_maximum_lowers_the_bound_to_it() -> None:
    loss_scale = _fresh(init_scale=4.0, max_loss_scale=16.0)
    loss_scale.set(64.0, None)  # a float new_scale above the bounds: exact
    assert loss_scale.known.scale_at_least == 64.0
    loss_scale.update(CLEAN, overflow=False)
    assert loss_scale.state.loss_scale.item() == 16.0 and loss_scale.known.scale_at_least == 16.0
    _holds(loss_scale)


def test_an_update_below_the_floor_is_not_taken_as_known_clean() -> None:
    loss_scale = _fresh(init_scale=4.0, min_loss_scale=1.0)
    loss_scale.set(0.25, None)  # below min_loss_scale: the next update clamps it, the whole rule runs
    loss_scale.update(CLEAN, overflow=False)
    assert loss_scale.state.loss_scale.item() == 1.0 and not loss_scale.known.non_clamped_is_scale
    assert loss_scale.known.skips_at_most == 2  # set() and the update may each have counted a skip
    _holds(loss_scale)


def test_an_update_the_host_does_not_know_lowers_the_bound_by_one_backoff_and_publishes() -> None:
    loss_scale = _fresh(init_scale=0.5, min_loss_scale=2.0**-10)
    loss_scale.update(CLEAN)  # the flag unknown on the host (fused, sync-free)
    assert loss_scale.known.scale_at_least == 0.25 and loss_scale.known.skips_at_most == 1
    assert not loss_scale.known.non_clamped_is_scale
    assert loss_scale.known.scale_may_be_below_one() and loss_scale.known.scale_at_least == 0.5  # the copy taken
    _holds(loss_scale)


def test_an_overflow_known_on_the_host_runs_the_whole_rule_and_counts_on_the_device() -> None:
    loss_scale = _fresh(init_scale=8.0)
    loss_scale.update(INF_FLAG, overflow=True)
    assert loss_scale.state.num_skipped_steps.item() == 1 and loss_scale.known.skips_at_most == 1
    assert loss_scale.state.loss_scale.item() == 4.0 and loss_scale.known.scale_at_least == 4.0
    _holds(loss_scale)


@pytest.mark.parametrize("new_scale", [2.0, torch.tensor(2.0), torch.tensor(float("nan"))])
def test_update_new_scale_sets_the_bound(new_scale: Any) -> None:
    loss_scale = _fresh(init_scale=8.0)
    loss_scale.set(new_scale, INF_FLAG)
    tensor = isinstance(new_scale, torch.Tensor)
    assert loss_scale.known.scale_at_least == (FLOAT32_TINY if tensor else 2.0)  # before the published copy
    assert loss_scale.known.skips_at_most == 1 and loss_scale.state.num_skipped_steps.item() == 1
    _holds(loss_scale)


def test_a_load_sets_every_bound() -> None:
    loss_scale = _fresh(init_scale=8.0, steps_per_increase=3)
    loss_scale.update(INF_FLAG)
    values = {"loss_scale": 2.0, "num_skipped_steps": 5, "steps_since_rescale": 9, "overflows_since_rescale": 9}
    loss_scale.load(values, loss_scale.settings)
    known = loss_scale.known
    assert (known.scale_at_least, known.skips_at_most, known.non_clamped_is_scale) == (2.0, 5, False)
    assert not known.counters_in_range and loss_scale.state.steps_since_rescale.item() == 9  # as saved, until ...
    loss_scale.update(CLEAN, overflow=False)  # ... the next update brings them within the rule: it grows
    assert known.counters_in_range and loss_scale.state.loss_scale.item() == 4.0
    _holds(loss_scale)


def test_new_settings_bring_the_counters_within_the_new_rule_at_the_next_update() -> None:
    loss_scale = _fresh(init_scale=8.0, steps_per_increase=5)
    for _ in range(4):
        loss_scale.update(CLEAN, overflow=False)
    loss_scale.replace_settings(loss_scale.settings.replace(steps_per_increase=2))
    assert not loss_scale.known.counters_in_range and loss_scale.state.steps_since_rescale.item() == 4
    loss_scale.update(CLEAN, overflow=False)
    assert loss_scale.state.loss_scale.item() == 16.0
    _holds(loss_scale)


def test_a_move_to_another_device_drops_the_published_copy() -> None:
    loss_scale = _fresh(init_scale=0.5, min_loss_scale=2.0**-10)
    loss_scale.update(CLEAN)
    assert loss_scale.known._published is not None
    loss_scale.follow(torch.device("meta"))
    assert loss_scale.known._published is None and loss_scale.device.type == "meta"


def test_the_inverse_scale_has_the_bits_of_torchs_float64_reciprocal(device: torch.device) -> None:
    """``LossScale.inverse`` is one float32 reciprocal where torch.amp takes ``double().reciprocal().float()``
    (three operators): the same bits for every normal float32 scale (a float32 division is correctly rounded, and
    so is a float64 one rounded to float32), here over 2**22 scales across the whole normal range and the powers of
    two."""
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(0x0080_0000, 0x7F80_0000, (1 << 22,), generator=gen, dtype=torch.int64).to(torch.int32)
    scales = torch.cat([bits.view(torch.float32), torch.tensor([2.0**e for e in range(-126, 128)])]).to(device)
    ours = torch.reciprocal(scales)
    torch_amp = scales.double().reciprocal().float()
    assert torch.equal(ours.view(torch.int32), torch_amp.view(torch.int32))
    scale = LossScale(dls.GradScaler("dynamic", init_scale=3.0 * 2**-10).settings, device)
    inverse = scale.inverse()
    assert inverse.dtype == torch.float32 and inverse.device == scale.device
    assert torch.equal(
        inverse.view(torch.int32), scale.state.loss_scale.double().reciprocal().float().view(torch.int32)
    )
