"""The checkpoint parser of ``dls.scaler_state`` on its own, and what its format promises torch.amp."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

import dls
from dls.scaler_state import FORMAT_VERSION, parse_state_dict, to_state_dict

CEREBRAS = dls.ScalerSettings.cerebras("dynamic", 2.0**10, steps_per_increase=3, hysteresis=3)


def test_format_1_hysteresis_hits_load_as_the_budget_left() -> None:
    for hits, budget in ((0, 3), (1, 2), (2, 1), (5, 1)):
        assert parse_state_dict({"hysteresis_hits": hits}, CEREBRAS).values == {"hysteresis_tracker": budget}
    with pytest.raises(ValueError, match="both 'hysteresis_hits'"):
        parse_state_dict({"hysteresis_hits": 1, "hysteresis_tracker": 2}, CEREBRAS)


def test_a_newer_format_is_refused_naming_both_versions() -> None:
    with pytest.raises(ValueError, match=rf"format_version'\] is {FORMAT_VERSION + 1}: written by a newer dls.*1 to 2"):
        parse_state_dict({"format_version": FORMAT_VERSION + 1, "loss_scale": 2.0}, CEREBRAS)


def test_a_format_version_that_no_dls_wrote_is_not_called_newer() -> None:
    for version in (0, -1, 1.5):
        with pytest.raises(ValueError, match=r"format_version'\] must be an integer from 1 to 2; got"):
            parse_state_dict({"format_version": version, "loss_scale": 2.0}, CEREBRAS)


def test_numpy_scalars_are_numbers() -> None:
    np = pytest.importorskip("numpy")
    loaded = parse_state_dict({"loss_scale": np.float32(8.0), "steps_since_rescale": np.int64(2)}, CEREBRAS)
    assert loaded.values == {"loss_scale": 8.0, "steps_since_rescale": 2}
    with pytest.raises(ValueError, match="must be a number; got"):
        parse_state_dict({"steps_since_rescale": np.bool_(True)}, CEREBRAS)


def test_megatrons_spent_tracker_and_a_tracker_above_hysteresis_are_brought_into_range() -> None:
    assert parse_state_dict({"hysteresis_tracker": 0}, CEREBRAS).values["hysteresis_tracker"] == 1
    assert parse_state_dict({"hysteresis_tracker": 9}, CEREBRAS).values["hysteresis_tracker"] == 3


def test_the_cerebras_dialect_tells_torch_the_interval_it_grows_at() -> None:
    values = {"loss_scale": 8.0, "steps_since_rescale": 1, "overflows_since_rescale": 0}
    values |= {"num_skipped_steps": 0, "hysteresis_tracker": 3}
    saved = to_state_dict(values, CEREBRAS)
    assert saved["growth_interval"] == 4 and saved["format_version"] == FORMAT_VERSION
    assert parse_state_dict(saved, CEREBRAS).settings.steps_per_increase == 3
    torch_dialect = dls.ScalerSettings.torch(growth_interval=3)
    assert parse_state_dict(saved, torch_dialect).settings.steps_per_increase == 4


def test_without_settings_and_with_a_label() -> None:
    loaded = parse_state_dict({"growth_interval": 99, "scale": 4.0}, CEREBRAS, apply_settings=False)
    assert loaded.settings == CEREBRAS and loaded.values == {"loss_scale": 4.0}
    with pytest.raises(ValueError, match=r"^grad_scaler\.loss_scale in x must be a positive finite number"):
        parse_state_dict({"loss_scale": -1.0}, CEREBRAS, label=lambda key: f"grad_scaler.{key} in x")


def test_torch_amp_loading_a_cerebras_dialect_state_follows_the_same_trajectory() -> None:
    rng = random.Random(3)
    flags = [rng.random() < 0.2 for _ in range(40)]
    ours = dls.GradScaler(loss_scale="dynamic", init_scale=2.0**10, steps_per_increase=2, max_loss_scale=2.0**40)
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(ours.state_dict())
    for flag in flags:
        scales = []
        for scaler in (ours, theirs):
            p = torch.nn.Parameter(torch.ones(1))
            opt = torch.optim.SGD([p], lr=0.0)
            scaler.scale(p.sum() * (float("inf") if flag else 1.0)).backward()
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        assert scales[0] == scales[1]


class _Owner:
    """A registered owner of extra checkpoint state (``GradScaler.register_state``)."""

    def __init__(self) -> None:
        self.value: Any = ["a"]

    def state_dict(self) -> Any:
        return list(self.value)

    def check_state(self, value: Any) -> None:
        if not isinstance(value, list):
            raise ValueError(f"kept must be a list; got {value!r}")

    def load_state_dict(self, value: Any) -> None:
        self.value = list(value)


def test_registered_state_travels_in_the_scalers_checkpoint() -> None:
    scaler, owner = dls.GradScaler("cpu"), _Owner()
    scaler.register_state("kept", owner)
    saved = scaler.state_dict()
    assert saved["kept"] == ["a"]
    other, other_owner = dls.GradScaler("cpu", init_scale=4.0), _Owner()
    other.register_state("kept", other_owner)
    with pytest.raises(ValueError, match="kept must be a list"):
        other.load_state_dict({**saved, "kept": "b"})
    assert other.get_scale() == 4.0  # nothing changed
    other.load_state_dict({**saved, "kept": ["b"]})
    assert other_owner.value == ["b"] and other.get_scale() == scaler.get_scale()
    with pytest.raises(ValueError, match="unknown keys"):
        dls.GradScaler("cpu").load_state_dict(saved)  # nobody registered "kept"
    with pytest.raises(ValueError, match="new state dict key"):
        scaler.register_state("loss_scale", owner)


@pytest.mark.parametrize("state", [{"scale": 1024.0, "num_skipped_steps": 10**400}, {"scale": 10**400}])
def test_an_absurd_value_is_named_and_cut_short_in_the_message(state):
    scaler = dls.GradScaler("cpu")
    with pytest.raises(ValueError, match=r"got 1000000000\d*\.\.\. \(401 characters\)") as info:
        scaler.load_state_dict(state)
    assert len(str(info.value)) < 200
    assert scaler.get_scale() == 2.0**16
