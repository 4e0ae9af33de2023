"""Issue 18, items 1-4 and 14: what an attacker and a careless user broke in the scaler, each as a test.

1. an optimizer-state reset before an overflowing fused / sync-free step must not let the step create state;
2. a parameter swapped into an optimizer's existing list is checked like any other;
3. counters at their limits (the skip count saturates, the step count is clamped before the rule runs): every
   state dict the scaler can produce loads back;
4. a parameter in two optimizers is refused before anything changes;
14. only lower-case "dynamic"; booleans are never numbers.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dls
from conftest import assert_same, snapshot

INF = math.inf


def _step(scaler: dls.GradScaler, params: list[torch.nn.Parameter], opt: Any, value: float) -> None:
    loss = sum((p * value).sum() for p in params)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


# ---------------------------------------------------------------------------------------------- 1. state reset
RESETS = {
    "load_state_dict": lambda opt, fresh: opt.load_state_dict(fresh),
    "state.clear": lambda opt, fresh: opt.state.clear(),
}


@pytest.mark.parametrize("reset", sorted(RESETS))
@pytest.mark.parametrize(
    ("make", "sync_free"),
    [
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True), False),
        (lambda ps: torch.optim.Adam(ps, lr=0.1, fused=True), False),
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), True),
        (lambda ps: torch.optim.Adam(ps, lr=0.1), True),
    ],
    ids=["sgd-fused", "adam-fused", "sgd-sync-free", "adam-sync-free"],
)
def test_overflow_after_optimizer_state_reset_is_skipped(make: Any, sync_free: bool, reset: str) -> None:
    p = torch.nn.Parameter(torch.ones(4))
    opt = make([p])
    fresh = opt.state_dict()
    scaler = dls.GradScaler("cpu", init_scale=4.0, sync_free=sync_free)
    _step(scaler, [p], opt, 1.0)
    RESETS[reset](opt, fresh)
    before = snapshot([p], opt)
    _step(scaler, [p], opt, INF)
    assert scaler.step_was_skipped(opt)
    assert_same(before, snapshot([p], opt), "overflowing step after a reset")
    _step(scaler, [p], opt, 1.0)
    control_p = torch.nn.Parameter(before[0][0].clone())
    control = make([control_p])
    control.load_state_dict(fresh)
    control_p.grad = torch.ones(4)
    control.step()
    assert torch.equal(p.detach(), control_p.detach())
    assert torch.isfinite(p).all()


# ---------------------------------------------------------------------------------------------- 2. swapped parameter
@pytest.mark.parametrize("fused", [False, True])
def test_parameter_swapped_into_the_same_list_is_checked(fused: bool) -> None:
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1, fused=fused)
    scaler = dls.GradScaler("cpu", init_scale=4.0)
    _step(scaler, [p], opt, 1.0)
    q = torch.nn.Parameter(torch.ones(2))
    opt.param_groups[0]["params"][0] = q
    before = q.detach().clone()
    _step(scaler, [q], opt, INF)
    assert scaler.step_was_skipped(opt)
    assert torch.equal(q.detach(), before)
    _step(scaler, [q], opt, 1.0)
    assert torch.isfinite(q).all() and not torch.equal(q.detach(), before)


# ---------------------------------------------------------------------------------------------- 4. shared parameter
def test_parameter_in_two_optimizers_is_refused_by_optimizer_step() -> None:
    shared, other = torch.nn.Parameter(torch.ones(3, 2)), torch.nn.Parameter(torch.ones(1))
    o1 = torch.optim.SGD([other, shared], lr=0.1)
    o2 = torch.optim.SGD([shared], lr=0.1)
    scaler = dls.GradScaler("cpu", init_scale=4.0)
    loss = (shared.sum() + other.sum()) * 1.0
    with pytest.raises(ValueError, match=r"optimizers\[0\]\.param_groups\[0\]\['params'\]\[1\] \(shape \(3, 2\)\)"):
        dls.optimizer_step(loss, [o1, o2], scaler)
    assert shared.grad is None and scaler.get_scale() == 4.0  # refused before backward


def test_parameter_in_two_optimizers_is_refused_by_unscale_and_step() -> None:
    shared = torch.nn.Parameter(torch.ones(2))
    o1 = torch.optim.SGD([shared], lr=0.1)
    o2 = torch.optim.SGD([torch.nn.Parameter(torch.ones(1)), shared], lr=0.1)
    scaler = dls.GradScaler("cpu", init_scale=4.0)
    scaler.scale(shared.sum()).backward()
    scaler.unscale_(o1)
    grad = shared.grad.clone()  # type: ignore[union-attr]
    for call in (scaler.unscale_, scaler.step):
        with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\] \(shape \(2,\)\)"):
            call(o2)
        assert torch.equal(shared.grad, grad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"optimizers\[0\]"):
        scaler.clip_gradients_and_return_isfinite([o2, o1])


def test_disjoint_optimizers_and_separate_iterations_are_fine() -> None:
    shared = torch.nn.Parameter(torch.ones(2))
    o1, o2 = torch.optim.SGD([shared], lr=0.1), torch.optim.SGD([shared], lr=0.1)
    scaler = dls.GradScaler("cpu", init_scale=4.0)
    _step(scaler, [shared], o1, 1.0)  # one optimizer per iteration: allowed
    _step(scaler, [shared], o2, 1.0)
    assert torch.allclose(shared.detach(), torch.full((2,), 0.8))


def test_parameter_listed_twice_in_one_optimizer_is_refused() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    opt.param_groups[0]["params"].append(p)
    scaler = dls.GradScaler("cpu", init_scale=4.0)
    scaler.scale(p.sum()).backward()
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\].*also optimizer\.param_groups\[0\]"):
        scaler.step(opt)
    assert torch.equal(p.grad, torch.full((2,), 4.0))  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- 14. one judgement
@pytest.mark.parametrize("spelling", ["Dynamic", "DYNAMIC", "dynamc", " dynamic"])
def test_only_lower_case_dynamic(spelling: str) -> None:
    with pytest.raises(ValueError, match="did you mean 'dynamic'"):
        dls.GradScaler(loss_scale=spelling)


@pytest.mark.parametrize("value", [True, False])
def test_booleans_are_never_numbers(value: bool) -> None:
    p = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = dls.GradScaler("cpu")
    with pytest.raises(ValueError, match="max_gradient_norm"):
        scaler.clip_gradients_and_return_isfinite(opt, max_gradient_norm=value)
    with pytest.raises(ValueError, match="max_gradient_norm"):
        dls.optimizer_step(p.sum(), opt, scaler, max_gradient_norm=value)
    for name in ("loss_scale", "init_scale", "steps_per_increase", "max_gradient_norm", "hysteresis"):
        with pytest.raises(ValueError, match=name):
            dls.GradScaler(**{name: value})
    assert p.grad is None


# ---------------------------------------------------------------------------------------------- 3. counters at limits
def _iteration(scaler: dls.GradScaler, overflow: bool) -> None:
    p = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([p], lr=0.0)
    _step(scaler, [p], opt, INF if overflow else 1.0)


def test_a_saturated_skip_count_and_a_full_step_count_load_back() -> None:
    scaler = dls.GradScaler(init_scale=8.0, hysteresis=2, steps_per_increase=5)
    scaler.load_state_dict({"num_skipped_steps": 2**63 - 1, "steps_since_rescale": 2**31 - 1})
    for overflow in (True, False, True, True):
        _iteration(scaler, overflow)
        saved = scaler.state_dict()
        assert saved["num_skipped_steps"] == 2**63 - 1 and 0 <= saved["steps_since_rescale"] < 6
        dls.GradScaler(init_scale=8.0, hysteresis=2, steps_per_increase=5).load_state_dict(saved)


@settings(max_examples=40, deadline=None)
@given(
    kwargs=st.fixed_dictionaries(
        {
            "steps_per_increase": st.sampled_from([1, 2, 7, 2**31 - 2]),
            "hysteresis": st.sampled_from([1, 2, 5]),
            "overflow_tolerance": st.sampled_from([0.0, 0.3]),
            "consecutive_hysteresis": st.booleans(),
        }
    ),
    loaded=st.fixed_dictionaries(
        {},
        optional={
            "steps_since_rescale": st.sampled_from([0, 1, 2**31 - 2, 2**31 - 1]),
            "overflows_since_rescale": st.sampled_from([0, 3, 2**63 - 1]),
            "num_skipped_steps": st.sampled_from([0, 2**63 - 2, 2**63 - 1]),
            "hysteresis_tracker": st.sampled_from([0, 1, 2**31 - 1]),
            "loss_scale": st.sampled_from([2.0**-20, 1.0, 2.0**40]),
        },
    ),
    trace=st.lists(st.booleans(), max_size=8),
)
def test_every_state_dict_the_scaler_writes_loads_back(
    kwargs: dict[str, Any], loaded: dict[str, Any], trace: list[bool]
) -> None:
    scaler = dls.GradScaler(**kwargs)
    if loaded:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a scale outside the bounds is clamped with a warning
            scaler.load_state_dict(loaded)
    for overflow in [None, *trace]:
        if overflow is not None:
            _iteration(scaler, overflow)
        saved = scaler.state_dict()
        assert all(v >= 0 for v in saved.values())
        again = dls.GradScaler(**kwargs)
        again.load_state_dict(saved)
        assert again.state_dict() == saved


# ---------------------------------------------------------------------------------------------- adversarial round
PATHS = {
    "host": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), False),
    "fused": (lambda ps: torch.optim.Adam(ps, lr=0.1, fused=True), False),
    "sync-free": (lambda ps: torch.optim.Adam(ps, lr=0.1), True),
}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_param_group_added_mid_run_is_protected_on_every_path(path: str) -> None:
    make, sync_free = PATHS[path]
    p = torch.nn.Parameter(torch.ones(3))
    opt = make([p])
    scaler = dls.GradScaler("cpu", init_scale=4.0, sync_free=sync_free)
    _step(scaler, [p], opt, 1.0)
    _step(scaler, [p], opt, 1.0)
    q = torch.nn.Parameter(torch.ones(2))
    opt.add_param_group({"params": [q]})
    before = snapshot([p, q], opt)
    _step(scaler, [p, q], opt, INF)  # the new group's first step overflows: no state may be created for q
    assert scaler.step_was_skipped(opt)
    assert_same(before, snapshot([p, q], opt), "overflow after add_param_group")
    _step(scaler, [p, q], opt, 1.0)
    assert not scaler.step_was_skipped(opt) and torch.isfinite(q).all() and not torch.equal(q.detach(), torch.ones(2))


@pytest.mark.parametrize("make", [lambda ps: torch.optim.LBFGS(ps), lambda ps: torch.optim.Adam(ps, fused=True)])
def test_closures_are_refused_before_anything_changes(make: Any) -> None:
    p = torch.nn.Parameter(torch.ones(2))
    opt = make([p])
    scaler = dls.GradScaler("cpu", init_scale=4.0)
    scaler.scale(p.sum()).backward()
    grad = p.grad.clone()  # type: ignore[union-attr]

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = scaler.scale(p.sum())
        loss.backward()
        return loss

    for call in (lambda: scaler.step(opt, closure), lambda: scaler.step(opt, closure=closure)):
        with pytest.raises(RuntimeError, match="Closure use is not currently supported"):
            call()
        assert torch.equal(p.grad, grad) and torch.equal(p.detach(), torch.ones(2))  # type: ignore[arg-type]
        assert scaler.stage(opt) is dls.Stage.READY
    scaler.step(opt) if not isinstance(opt, torch.optim.LBFGS) else scaler.unscale_(opt)
    scaler.update()
