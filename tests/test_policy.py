"""The pure scale rules of ``dls.policy`` against ``conftest.ReferenceRule``, the rule written out step by step."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import ReferenceRule
from dls.policy import DynamicRule, StaticRule, initial_state

rules = st.builds(
    DynamicRule,
    steps_per_increase=st.integers(1, 6),
    growth_factor=st.sampled_from([2.0, 1.5, 4.0, 16.0]),
    backoff_factor=st.sampled_from([0.5, 0.25, 0.9]),
    overflow_tolerance=st.sampled_from([0.0, 0.1, 0.25, 0.5, 0.75]),
    hysteresis=st.integers(1, 3),
    min_loss_scale=st.sampled_from([2.0**-14, 1.0, 8.0]),
    max_loss_scale=st.sampled_from([2.0**15, 2.0**31, 3.0e38]),
)


@settings(max_examples=300, deadline=None)
@given(rule=rules, overflows=st.lists(st.booleans(), min_size=1, max_size=60), init_exp=st.integers(-14, 40))
def test_dynamic_rule_matches_reference(rule: DynamicRule, overflows: list[bool], init_exp: int) -> None:
    init = min(max(2.0**init_exp, rule.min_loss_scale), rule.max_loss_scale)
    ref = ReferenceRule(rule, init)
    state = initial_state(init)
    for overflow in overflows:
        before = state.loss_scale.item()
        event = ref.update(overflow)
        state = rule.update(state, torch.tensor(float(overflow)))
        scale = state.loss_scale.item()
        assert scale == pytest.approx(ref.scale, rel=0, abs=0)
        assert state.non_clamped_scale.item() == ref.non_clamped
        assert state.steps_since_rescale.item() == ref.steps
        assert state.overflows_since_rescale.item() == ref.overflows
        assert state.num_skipped_steps.item() == ref.skipped
        assert state.hysteresis_hits.item() == ref.hits
        # Invariants that hold whatever the reference says.
        assert rule.min_loss_scale <= scale <= rule.max_loss_scale
        if event in ("none", "hit"):
            assert scale == before
        if event == "backoff":
            assert overflow and scale <= before
        if event == "growth":
            assert not overflow or rule.overflow_tolerance > 0
            assert scale >= before


def test_torch_rule_with_zero_tolerance_and_one_hit() -> None:
    # torch's test: scale 4, interval 2: clean, clean → 4 then 8; overflow → scale * backoff, tracker 0.
    rule = DynamicRule(steps_per_increase=2, max_loss_scale=2.0**20)
    state = initial_state(4.0)
    state = rule.update(state, torch.tensor(0.0))
    assert state.loss_scale.item() == 4.0 and state.steps_since_rescale.item() == 1
    state = rule.update(state, torch.tensor(0.0))
    assert state.loss_scale.item() == 8.0 and state.steps_since_rescale.item() == 0
    state = rule.update(state, torch.tensor(1.0))
    assert state.loss_scale.item() == 4.0 and state.steps_since_rescale.item() == 0
    assert state.num_skipped_steps.item() == 1


def test_growth_never_reaches_inf() -> None:
    rule = DynamicRule(steps_per_increase=1, growth_factor=16.0, max_loss_scale=3.0e38)
    state = initial_state(1e38)
    for _ in range(3):
        state = rule.update(state, torch.tensor(0.0))
        assert torch.isfinite(state.loss_scale)
    assert state.loss_scale.item() == pytest.approx(1e38, rel=1e-6)


def test_floor_reports_non_clamped_scale() -> None:
    rule = DynamicRule(min_loss_scale=1.0, max_loss_scale=4.0)
    state = initial_state(1.0)
    state = rule.update(state, torch.tensor(1.0))
    assert state.loss_scale.item() == 1.0
    assert state.non_clamped_scale.item() == 0.5


def test_tolerance_skips_without_backoff() -> None:
    rule = DynamicRule(steps_per_increase=10, overflow_tolerance=0.5)
    state = initial_state(1024.0)
    for overflow in (0.0, 1.0):  # ratio 1/2 is not above 0.5
        state = rule.update(state, torch.tensor(overflow))
    assert state.loss_scale.item() == 1024.0 and state.num_skipped_steps.item() == 1
    state = rule.update(state, torch.tensor(1.0))  # 2/3 > 0.5
    assert state.loss_scale.item() == 512.0 and state.steps_since_rescale.item() == 0


def test_hysteresis_needs_several_overflows() -> None:
    rule = DynamicRule(hysteresis=3)
    state = initial_state(1024.0)
    for expected in (1024.0, 1024.0, 512.0, 512.0):
        state = rule.update(state, torch.tensor(1.0))
        assert state.loss_scale.item() == expected


def test_static_rule_counts_skips_only() -> None:
    state = initial_state(128.0)
    state = StaticRule().update(state, torch.tensor(1.0))
    state = StaticRule().update(state, torch.tensor(0.0))
    assert state.loss_scale.item() == 128.0
    assert state.num_skipped_steps.item() == 1
    in_place = initial_state(128.0)
    StaticRule().update_(in_place, torch.tensor(1.0))
    StaticRule().update_(in_place, torch.tensor(0.0))
    assert in_place.num_skipped_steps.item() == 1 and in_place.loss_scale.item() == 128.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"steps_per_increase": 0}, "steps_per_increase"),
        ({"hysteresis": 0}, "hysteresis"),
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"backoff_factor": 1.0}, "backoff_factor"),
        ({"backoff_factor": 0.0}, "backoff_factor"),
        ({"overflow_tolerance": 1.0}, "overflow_tolerance"),
        ({"overflow_tolerance": -0.1}, "overflow_tolerance"),
        ({"min_loss_scale": 0.0}, "min_loss_scale"),
        ({"max_loss_scale": float("inf")}, "max_loss_scale"),
        ({"min_loss_scale": 8.0, "max_loss_scale": 4.0}, "min_loss_scale"),
    ],
)
def test_invalid_rule_settings(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DynamicRule(**kwargs)  # type: ignore[arg-type]


torch_rules = st.builds(
    DynamicRule,
    steps_per_increase=st.integers(1, 6),
    growth_factor=st.sampled_from([2.0, 4.0, 16.0, 1.5]),
    backoff_factor=st.sampled_from([0.5, 0.25, 0.9]),
    min_loss_scale=st.sampled_from([2.0**-14, 1.0, 8.0]),
    max_loss_scale=st.sampled_from([2.0**15, 2.0**31, 3.0e38]),
    hysteresis=st.sampled_from([1, 1, 2]),
    overflow_tolerance=st.sampled_from([0.0, 0.0, 0.5]),
)


@settings(max_examples=200, deadline=None)
@given(
    rule=torch_rules,
    overflows=st.lists(st.booleans(), min_size=1, max_size=40),
    init_exp=st.integers(-14, 127),
    start_steps=st.integers(0, 8),
)
def test_in_place_update_equals_pure_update(
    rule: DynamicRule, overflows: list[bool], init_exp: int, start_steps: int
) -> None:
    init = min(max(2.0**init_exp, rule.min_loss_scale), rule.max_loss_scale)
    pure = initial_state(init)._replace(steps_since_rescale=torch.tensor(start_steps, dtype=torch.int32))
    in_place = initial_state(init)
    in_place.steps_since_rescale.fill_(start_steps)  # e.g. loaded, or the interval was shortened since
    for overflow in overflows:
        flag = torch.tensor(float(overflow))
        pure = rule.update(pure, flag)
        rule.update_(in_place, flag)
        for name, a, b in zip(pure._fields, pure, in_place):
            assert a.item() == b.item(), name
