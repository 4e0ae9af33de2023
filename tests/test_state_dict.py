"""Checkpoints: one state dict for dls and torch.amp, checked before anything changes."""

from __future__ import annotations

import math

import pytest
import torch

import dls


def _run(scaler, model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range, inf_every: int = 5) -> None:
    for i in steps:
        g = torch.Generator().manual_seed(i)
        scaler.scale(model(torch.randn(4, 8, generator=g)).pow(2).mean()).backward()
        if i % inf_every == 2:
            model.weight.grad[0, 0] = math.inf  # type: ignore[index]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


def _model(seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(8, 2)


def test_torch_loads_a_dls_checkpoint_and_continues_identically():
    model, ref = _model(), _model()
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    ours = dls.GradScaler("cpu", init_scale=2.0**8, growth_factor=4.0, backoff_factor=0.25, growth_interval=3)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_factor=4.0, backoff_factor=0.25, growth_interval=3)
    _run(ours, model, opt, range(11))
    _run(theirs, ref, ref_opt, range(11))
    moved = torch.amp.GradScaler("cpu")
    moved.load_state_dict(ours.state_dict())
    assert moved.state_dict() == theirs.state_dict()
    _run(moved, model, opt, range(11, 20))
    _run(theirs, ref, ref_opt, range(11, 20))
    assert moved.state_dict() == theirs.state_dict()
    assert torch.equal(model.weight, ref.weight)


def test_torch_settings_travel_in_round_trips_and_the_constructor_keeps_the_rest():
    source = dls.GradScaler("cpu", growth_factor=3.0, backoff_factor=0.125, growth_interval=17, hysteresis=2)
    target = dls.GradScaler(min_loss_scale=1.0, max_loss_scale=2.0**20, overflow_tolerance=0.25)
    target.load_state_dict(source.state_dict())
    s = target.settings
    assert (s.growth_factor, s.backoff_factor, s.steps_per_increase) == (3.0, 0.125, 17)
    assert (s.min_loss_scale, s.max_loss_scale, s.overflow_tolerance, s.hysteresis) == (1.0, 2.0**20, 0.25, 1)
    assert target.state_dict()["growth_interval"] == 17


def test_a_loaded_scale_outside_the_bounds_is_clamped_with_one_warning():
    scaler = dls.GradScaler(max_loss_scale=2.0**10)
    with pytest.warns(UserWarning, match="clamped") as record:
        scaler.load_state_dict(torch.amp.GradScaler("cpu").state_dict())  # scale 2**16
    assert len(record) == 1 and scaler.get_scale() == 2.0**10


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"steps_since_rescale": 2**40}, "steps_since_rescale"),
        ({"steps_since_rescale": 2**31}, "steps_since_rescale"),
        ({"steps_since_rescale": -1}, "steps_since_rescale"),
        ({"steps_since_rescale": 1.5}, "steps_since_rescale"),
        ({"num_skipped_steps": 2**70}, "num_skipped_steps"),
        ({"num_skipped_steps": math.inf}, "num_skipped_steps"),
        ({"overflows_since_rescale": math.nan}, "overflows_since_rescale"),
        ({"hysteresis_hits": True}, "hysteresis_hits"),
        ({"loss_scale": math.nan}, "loss_scale"),
        ({"loss_scale": -1.0}, "loss_scale"),
        ({"loss_scale": 10**400}, "loss_scale"),
        ({"growth_interval": 2**31}, "growth_interval"),
        ({"growth_factor": 0.5}, "growth_factor"),
        ({"scale": 4.0}, "scale"),  # disagrees with loss_scale
        ({"_growth_tracker": 3}, "_growth_tracker"),  # disagrees with steps_since_rescale
        ({"loss_scale": torch.ones(2)}, "loss_scale"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_bad_values_are_errors_naming_the_key_and_change_nothing(changes: dict, key: str):
    scaler = dls.GradScaler(init_scale=8.0)
    saved = scaler.state_dict()
    target = dls.GradScaler(init_scale=2.0, steps_per_increase=5)
    before = target.state_dict()
    with pytest.raises(ValueError, match=key):
        target.load_state_dict({**saved, **changes})
    assert target.state_dict() == before and target.settings.steps_per_increase == 5


def test_counters_at_their_limits_load():
    scaler = dls.GradScaler(steps_per_increase=2**31 - 1)
    scaler.load_state_dict({"steps_since_rescale": 2**31 - 1, "num_skipped_steps": 2**62, "loss_scale": 4.0})
    sd = scaler.state_dict()
    assert (sd["steps_since_rescale"], sd["num_skipped_steps"], sd["loss_scale"]) == (2**31 - 1, 2**62, 4.0)
