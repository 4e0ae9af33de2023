"""What the library's own ``load_state_dict``s refuse, and that they always load back what the library saved.

``dls.master_weights``: masters holding inf/NaN are refused (they would be written into the model at once).
``dls.fp8`` handles: a scale that is not finite and > 0 is refused; an amax history holding inf/NaN is accepted,
since a delayed-scaling handle saves one after an input that overflowed. Every refusal names the key and comes
before anything changes.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from torch import nn

import dls.fp8
from conftest import assert_tensors_equal
from dls.fp8 import DelayedScaling
from dls.master_weights import master_weights


def stepped_masters() -> tuple[nn.Linear, torch.optim.Optimizer]:
    model = nn.Linear(3, 2).to(torch.float16)
    opt = master_weights(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    model(torch.ones(1, 3, dtype=torch.float16)).sum().backward()
    opt.step()
    return model, opt


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_master_weights_refuse_non_finite_masters_naming_the_key_before_anything_changes(bad: float) -> None:
    model, opt = stepped_masters()
    saved = copy.deepcopy(opt.state_dict())
    params, masters = [p.clone() for p in model.parameters()], [opt.master_of(p).clone() for p in model.parameters()]
    bad_state = copy.deepcopy(saved)
    bad_state["master_weights"][1] = bad_state["master_weights"][1].clone()
    bad_state["master_weights"][1][0] = bad
    bad_state["state"][0]["momentum_buffer"] = torch.full_like(saved["master_weights"][0], 7.0)
    with pytest.raises(ValueError, match=r"state_dict\['master_weights'\]\[1\] holds inf or NaN"):
        opt.load_state_dict(bad_state)
    assert_tensors_equal(model.parameters(), params, "parameters")
    assert_tensors_equal([opt.master_of(p) for p in model.parameters()], masters, "masters")
    buffers = [s["momentum_buffer"] for s in opt.state_dict()["state"].values()]
    assert_tensors_equal(buffers, [s["momentum_buffer"] for s in saved["state"].values()], "momentum (not loaded)")
    opt.load_state_dict(saved)  # its own state loads back


def delayed_handle() -> tuple[nn.Linear, Any]:
    lin = nn.Linear(4, 4, bias=False)
    return lin, dls.fp8.emulate_recipe(lin, DelayedScaling(amax_history_len=3))


def cast(lin: nn.Linear, value: float) -> None:
    lin(torch.full((1, 4), value, requires_grad=True)).sum().backward()


@pytest.mark.parametrize("bad", [math.inf, math.nan, 0.0, -1.0, -0.0, 1e39, 1e-46])
def test_fp8_handle_refuses_a_scale_that_is_not_finite_and_positive(bad: float) -> None:
    lin, handle = delayed_handle()
    cast(lin, 2.0)
    before = handle.state_dict()
    state = copy.deepcopy(before)
    state["modules"][""]["weight"]["amax_history"] = torch.full((3,), 5.0)  # would change if loaded
    state["modules"][""]["input"]["scale"] = torch.tensor(bad, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"state\['modules'\]\[''\]\['input'\]\['scale'\] must be finite and > 0"):
        handle.load_state_dict(state)
    after = handle.state_dict()["modules"][""]
    for role, entry in before["modules"][""].items():
        assert_tensors_equal(entry.values(), after[role].values(), role)


def test_fp8_handle_refuses_integer_scales_and_histories() -> None:
    _, handle = delayed_handle()
    state = handle.state_dict()
    state["modules"][""]["input"]["scale"] = torch.tensor(2)
    with pytest.raises(ValueError, match=r"\['input'\]\['scale'\] must be a floating-point tensor"):
        handle.load_state_dict(state)
    state = handle.state_dict()
    state["modules"][""]["grad_output"]["amax_history"] = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"\['grad_output'\]\['amax_history'\] must be a floating-point tensor"):
        handle.load_state_dict(state)


@pytest.mark.parametrize("special", [math.inf, math.nan])
def test_fp8_handle_loads_back_its_own_state_after_an_input_that_overflowed(special: float) -> None:
    """The history keeps the inf/NaN amax (the scale keeps its previous value): that state loads back as is."""
    lin, handle = delayed_handle()
    cast(lin, 2.0)
    cast(lin, special)
    saved = handle.state_dict()
    history = saved["modules"][""]["input"]["amax_history"]
    assert not bool(torch.isfinite(history[0]))
    _, handle2 = delayed_handle()
    handle2.load_state_dict(copy.deepcopy(saved))
    for role, entry in saved["modules"][""].items():
        assert_tensors_equal(entry.values(), handle2.state_dict()["modules"][""][role].values(), role)
