"""Checkpoints: one state dict for dls and torch.amp, checked before anything changes; copies made between
iterations (state dict, pickle, deepcopy) continue bit-identically."""

from __future__ import annotations

import copy
import math
import pickle
from typing import Any

import pytest
import torch

import dls
from conftest import (
    INF,
    assert_same,
    dls_scaler,
    loss_of,
    one_iteration,
    one_parameter,
    snapshot,
    tiny_model,
    torch_scaler,
    train,
)

STATE_KEYS = {"loss_scale", "steps_since_rescale", "overflows_since_rescale", "num_skipped_steps", "hysteresis_tracker"}
STATE_KEYS |= {"format_version"}
TORCH_KEYS = {"scale", "_growth_tracker", "growth_factor", "backoff_factor", "growth_interval"}


EVERY_THIRD = {i: INF for i in range(1, 20, 3)}
EVERY_FIFTH = {i: INF for i in range(1, 20, 5)}


# ---------------------------------------------------------------------------------------------- copies continue
SETTINGS: dict[str, Any] = {"hysteresis": 2, "overflow_tolerance": 0.2, "max_gradient_norm": 0.5}


@pytest.mark.parametrize("clone", ["state_dict", "pickle", "deepcopy"])
def test_a_copy_made_between_iterations_continues_bit_identically(clone: str) -> None:
    model = tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = dls_scaler(2.0**8, 2, **SETTINGS)
    train(scaler, model, opt, range(8), EVERY_THIRD)
    if clone == "state_dict":
        twin = dls_scaler(2.0**8, 2, **SETTINGS)
        twin.load_state_dict(copy.deepcopy(scaler.state_dict()))
    else:
        twin = pickle.loads(pickle.dumps(scaler)) if clone == "pickle" else copy.deepcopy(scaler)
    assert repr(twin) == repr(scaler)
    assert twin.get_scale_tensor() is not scaler.get_scale_tensor()
    model2 = tiny_model(seed=5)
    model2.load_state_dict(model.state_dict())
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert train(scaler, model, opt, range(8, 20), EVERY_THIRD) == train(twin, model2, opt2, range(8, 20), EVERY_THIRD)
    assert_same(snapshot(model, opt), snapshot(model2, opt2))


def test_the_state_dict_holds_dls_and_torch_keys() -> None:
    scaler = dls.GradScaler("dynamic")
    assert set(scaler.state_dict()) == STATE_KEYS | TORCH_KEYS


def test_pickling_in_the_middle_of_an_iteration_is_an_error() -> None:
    scaler = dls.GradScaler("dynamic", init_scale=512.0)
    assert pickle.loads(pickle.dumps(scaler)).get_scale() == 512.0
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(loss_of(model)).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="pickled"):
        pickle.dumps(scaler)


# ---------------------------------------------------------------------------------------------- torch interop
def test_torch_loads_a_dls_checkpoint_and_continues_identically() -> None:
    model, ref = tiny_model(), tiny_model()
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    ours = dls.GradScaler("cpu", init_scale=2.0**8, growth_factor=4.0, backoff_factor=0.25, growth_interval=3)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_factor=4.0, backoff_factor=0.25, growth_interval=3)
    train(ours, model, opt, range(11), EVERY_FIFTH)
    train(theirs, ref, ref_opt, range(11), EVERY_FIFTH)
    moved = torch.amp.GradScaler("cpu")
    moved.load_state_dict(ours.state_dict())
    assert moved.state_dict() == theirs.state_dict()
    train(moved, model, opt, range(11, 20), EVERY_FIFTH)
    train(theirs, ref, ref_opt, range(11, 20), EVERY_FIFTH)
    assert moved.state_dict() == theirs.state_dict()
    assert_same(snapshot(model, opt), snapshot(ref, ref_opt))


def test_a_torch_checkpoint_loads_and_continues_identically() -> None:
    theirs = torch_scaler(2.0**10, 3)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(5):
        theirs.scale(model(torch.ones(2, 4)).sum()).backward()
        theirs.step(opt)
        theirs.update()
    ours = dls.GradScaler("dynamic", max_loss_scale=2.0**30)
    ours.load_state_dict(theirs.state_dict())
    assert ours.get_scale() == theirs.get_scale()
    assert ours.get_growth_interval() == 3
    assert ours.state_dict()["steps_since_rescale"] == theirs._get_growth_tracker()
    for _ in range(4):
        for s in (theirs, ours):
            s.scale(model(torch.ones(2, 4)).sum()).backward()
            s.unscale_(opt)
            opt.zero_grad()
            s.update()
        assert ours.get_scale() == theirs.get_scale()


def test_a_torch_style_state_dict_with_tensor_values_loads() -> None:
    scaler = dls.GradScaler("dynamic", max_loss_scale=2.0**20)
    scaler.load_state_dict(
        {
            "scale": torch.tensor(2.0**11),
            "growth_factor": torch.tensor(4.0),
            "backoff_factor": 0.25,
            "growth_interval": torch.tensor(3),
            "_growth_tracker": torch.tensor(2, dtype=torch.int32),
        }
    )
    assert scaler.get_scale() == 2.0**11 and scaler.get_growth_factor() == 4.0
    assert scaler.get_backoff_factor() == 0.25 and scaler.get_growth_interval() == 3
    p, opt = one_parameter()
    one_iteration(scaler, p, opt)  # tracker 2 -> 3 == interval: grows by 4
    assert scaler.get_scale() == 2.0**13
    one_iteration(scaler, p, opt, overflow=True)
    assert scaler.get_scale() == 2.0**11
    dls_style = {k: torch.tensor(v) for k, v in scaler.state_dict().items()}
    other = dls.GradScaler("dynamic", max_loss_scale=2.0**20)
    other.load_state_dict(dls_style)
    assert other.state_dict() == scaler.state_dict()


def test_torch_settings_travel_in_round_trips_and_the_constructor_keeps_the_rest() -> None:
    source = dls.GradScaler("cpu", growth_factor=3.0, backoff_factor=0.125, growth_interval=17, hysteresis=2)
    target = dls.GradScaler(min_loss_scale=1.0, max_loss_scale=2.0**20, overflow_tolerance=0.25)
    target.load_state_dict(source.state_dict())
    s = target.settings
    # torch's growth_interval 17 is the 17th update since a rescale: steps_per_increase 16 in the Cerebras dialect.
    assert (s.growth_factor, s.backoff_factor, s.steps_per_increase) == (3.0, 0.125, 16)
    assert (s.min_loss_scale, s.max_loss_scale, s.overflow_tolerance, s.hysteresis) == (1.0, 2.0**20, 0.25, 1)
    assert target.state_dict()["growth_interval"] == target.get_growth_interval() == 17


# ---------------------------------------------------------------------------------------------- what is loaded
@pytest.mark.parametrize(
    ("bounds", "saved", "loaded"),
    [
        ({"max_loss_scale": 2.0**10}, torch.amp.GradScaler("cpu").state_dict(), 2.0**10),  # torch's 2**16
        ({"min_loss_scale": 1.0}, {"loss_scale": 2.0**-10}, 1.0),
    ],
    ids=["torch-above-max", "below-min"],
)
def test_a_loaded_scale_outside_the_bounds_is_clamped_with_one_warning(
    bounds: dict[str, float], saved: dict[str, Any], loaded: float
) -> None:
    scaler = dls.GradScaler(**bounds)
    with pytest.warns(UserWarning, match="clamped") as record:
        scaler.load_state_dict(saved)
    assert len(record) == 1 and scaler.get_scale() == loaded


def test_a_partial_state_dict_keeps_the_missing_values_and_an_empty_one_is_an_error() -> None:
    scaler = dls.GradScaler("dynamic", init_scale=64.0)
    scaler.load_state_dict({"num_skipped_steps": 7})
    assert scaler.get_scale() == 64.0 and scaler.get_num_skipped_steps() == 7
    before = scaler.state_dict()
    with pytest.raises(RuntimeError, match="empty"):
        scaler.load_state_dict({})
    assert scaler.state_dict() == before


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
        ({"hysteresis_tracker": 2**31}, "hysteresis_tracker"),
        ({"hysteresis_tracker": -(2**63) - 1}, "hysteresis_tracker"),
        ({"hysteresis_tracker": 1.5}, "hysteresis_tracker"),
        ({"format_version": 3}, "format_version.*newer dls"),
        ({"format_version": "2"}, "format_version"),
        ({"loss_scale": math.nan}, "loss_scale"),
        ({"loss_scale": math.inf}, "loss_scale"),
        ({"loss_scale": -1.0}, "loss_scale"),
        ({"loss_scale": 10**400}, "loss_scale"),
        ({"growth_interval": 2**31}, "growth_interval"),
        ({"growth_factor": 0.5}, "growth_factor"),
        ({"scale": 4.0}, "scale"),  # disagrees with loss_scale
        ({"_growth_tracker": 3}, "_growth_tracker"),  # disagrees with steps_since_rescale
        ({"growth_tracker": 3}, "growth_tracker"),  # Megatron's name: disagrees with steps_since_rescale
        # A value no scaler could hold is named as such, not as two keys that disagree (NaN != NaN).
        ({"scale": math.nan, "loss_scale": math.nan}, r"scale'\] must be a positive finite number; got nan$"),
        ({"_growth_tracker": -1, "steps_since_rescale": -1}, r"'\] must be an integer from 0 to 2\*\*31 - 1; got -1$"),
        ({"los_scale": 3}, "unknown keys.*did you mean 'loss_scale'"),
        ({"cur_scale": 4.0}, "DeepSpeed's loss scaler attributes"),
        ({"loss_scale": torch.ones(2)}, "loss_scale"),
        ({"bogus": 1}, "unknown keys.*bogus"),
    ],
)
def test_bad_values_are_errors_naming_the_key_and_change_nothing(changes: dict[str, Any], key: str) -> None:
    saved = dls.GradScaler("dynamic", init_scale=8.0).state_dict()
    target = dls.GradScaler(init_scale=2.0, steps_per_increase=5)
    before = target.state_dict()
    with pytest.raises(ValueError, match=key):
        target.load_state_dict({**saved, **changes})
    assert target.state_dict() == before and target.settings.steps_per_increase == 5


def test_counters_at_their_limits_load() -> None:
    scaler = dls.GradScaler(steps_per_increase=2**31 - 2)
    scaler.load_state_dict({"steps_since_rescale": 2**31 - 1, "num_skipped_steps": 2**62, "loss_scale": 4.0})
    sd = scaler.state_dict()
    assert (sd["steps_since_rescale"], sd["num_skipped_steps"], sd["loss_scale"]) == (2**31 - 1, 2**62, 4.0)


def test_a_dynamic_state_dict_into_a_static_scaler_keeps_it_static() -> None:
    dynamic = dls_scaler(init_scale=2.0**6, steps_per_increase=1)
    p, opt = one_parameter()
    for f in (False, True, False):
        one_iteration(dynamic, p, opt, f)
    static = dls.GradScaler(loss_scale=128.0)
    static.load_state_dict(dynamic.state_dict())
    assert static.mode == "static" and static.get_scale() == dynamic.get_scale() == 2.0**7
    assert static.get_num_skipped_steps() == 1
    for f in (False, False, True, False):
        one_iteration(static, p, opt, f)
    assert static.get_scale() == 2.0**7  # never grows nor backs off
    assert static.get_num_skipped_steps() == 2
    again = dls.GradScaler(loss_scale=1.0)
    again.load_state_dict(static.state_dict())
    assert again.state_dict() == static.state_dict()
