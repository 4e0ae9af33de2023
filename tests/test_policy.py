"""The pure scale rule of ``dls.policy`` (its docstring is the rule) step by step against reference state machines:
``conftest.ReferenceRule`` (the docstring's pseudo-code in Python numbers) and the peers' own rules re-stated from
their sources (Megatron-LM ``DynamicGradScaler.update``, DeepSpeed ``DynamicLossScaler.update_scale`` with and
without ``consecutive_hysteresis``, cstorch.amp ``update_scale`` with tolerance 0 and > 0), on random and bursty
overflow traces: the fast property tests. The real packages are driven by tests/test_peers_*.py."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dls
from conftest import ReferenceRule
from dls.policy import DynamicRule, StaticRule, initial_state

rules = st.builds(
    DynamicRule,
    growth_interval=st.integers(2, 6),
    steps_after_growth=st.sampled_from([0, 0, 1]),
    growth_factor=st.sampled_from([2.0, 1.5, 4.0, 16.0]),
    backoff_factor=st.sampled_from([0.5, 0.25, 0.9]),
    overflow_tolerance=st.sampled_from([0.0, 0.1, 0.25, 0.5, 0.75]),
    hysteresis=st.integers(1, 3),
    consecutive_hysteresis=st.booleans(),
    min_loss_scale=st.sampled_from([2.0**-14, 1.0, 8.0]),
    max_loss_scale=st.sampled_from([2.0**15, 2.0**31, 3.0e38]),
)


@st.composite
def bursty(draw: st.DrawFn) -> list[bool]:
    """Runs of clean steps and bursts of overflows, as loss spikes come."""
    trace: list[bool] = []
    for _ in range(draw(st.integers(1, 8))):
        trace += [False] * draw(st.integers(0, 9)) + [True] * draw(st.integers(1, 4))
    return trace + [False] * draw(st.integers(0, 9))


traces = st.one_of(st.lists(st.booleans(), min_size=1, max_size=60), bursty())


@settings(max_examples=300, deadline=None)
@given(rule=rules, overflows=traces, init_exp=st.integers(-14, 40))
def test_dynamic_rule_matches_reference(rule: DynamicRule, overflows: list[bool], init_exp: int) -> None:
    init = min(max(2.0**init_exp, rule.min_loss_scale), rule.max_loss_scale)
    ref = ReferenceRule(rule, init)
    state = initial_state(init, rule.hysteresis)
    for overflow in overflows:
        before = state.loss_scale.item()
        event = ref.update(overflow)
        state = rule.update(state, torch.tensor(float(overflow)))
        scale = state.loss_scale.item()
        assert scale == ref.scale
        assert state.non_clamped_scale.item() == ref.non_clamped
        assert state.steps_since_rescale.item() == ref.steps
        assert state.overflows_since_rescale.item() == ref.overflows
        assert state.num_skipped_steps.item() == ref.skipped
        assert state.hysteresis_tracker.item() == ref.budget
        # Invariants that hold whatever the reference says.
        assert rule.min_loss_scale <= scale <= rule.max_loss_scale
        assert 1 <= ref.budget <= rule.hysteresis
        if event in ("none", "hit"):
            assert scale == before
        if event == "backoff":
            assert overflow and scale <= before
        if event == "growth":
            assert not overflow or rule.overflow_tolerance > 0
            assert scale >= before


# ---------------------------------------------------------------------------------------------- the peers
@dataclass
class Megatron:
    """Megatron-LM ``core/optimizer/grad_scaler.py``, ``DynamicGradScaler.update(found_inf)``."""

    scale: float
    min_scale: float
    growth_interval: int
    hysteresis: int
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_tracker: int = 0
    hysteresis_tracker: int = field(init=False)

    def __post_init__(self) -> None:
        self.hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale = self.scale * self.growth_factor


@dataclass
class DeepSpeed:
    """DeepSpeed ``runtime/fp16/loss_scaler.py``, ``DynamicLossScaler.update_scale(overflow)`` (``delayed_shift`` is
    the hysteresis; ``raise_error_at_min_scale`` off)."""

    cur_scale: float
    scale_window: int
    min_scale: float
    delayed_shift: int
    consecutive_hysteresis: bool
    scale_factor: float = 2.0
    cur_iter: int = 0
    last_overflow_iter: int = -1
    cur_hysteresis: int = field(init=False)

    def __post_init__(self) -> None:
        self.cur_hysteresis = self.delayed_shift

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
            if (stable_interval > 0) and (stable_interval % self.scale_window == 0):
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1


@dataclass
class Cstorch:
    """cstorch.amp ``GradScaler.update_scale`` (dynamic): tolerance by the overflow fraction since the last rescale,
    growth when ``steps_per_increase < steps_since_rescale``, clamps."""

    scale: float
    steps_per_increase: int
    overflow_tolerance: float
    min_loss_scale: float
    max_loss_scale: float
    steps: int = 0
    overflows: int = 0

    def update_scale(self, isfinite: bool) -> None:
        self.steps += 1
        self.overflows += 1 - int(isfinite)
        ratio = np.float32(self.overflows) / np.float32(self.steps)
        if np.float32(self.overflow_tolerance) < ratio:
            self.scale /= 2.0
            self.steps = self.overflows = 0
        if self.steps_per_increase < self.steps:
            self.scale *= 2.0
            self.steps = self.overflows = 0
        self.scale = max(min(self.scale, self.max_loss_scale), self.min_loss_scale)


def _through_the_scaler(scaler: dls.GradScaler, overflow: bool) -> dict[str, float]:
    """One ``update()`` with ``overflow`` recorded (the public path), then the state dict."""
    p = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([p], lr=0.0)
    scaler.scale(p.sum() * (float("inf") if overflow else 1.0)).backward()
    scaler.step(opt)
    scaler.update()
    return scaler.state_dict()


@settings(max_examples=60, deadline=None)
@given(trace=traces, interval=st.integers(1, 5), hysteresis=st.integers(1, 4))
def test_hysteresis_is_megatrons(trace: list[bool], interval: int, hysteresis: int) -> None:
    megatron = Megatron(2.0**10, min_scale=1.0, growth_interval=interval, hysteresis=hysteresis)
    scaler = dls.GradScaler("cpu", init_scale=2.0**10, growth_interval=interval, hysteresis=hysteresis)
    scaler = dls.GradScaler.from_settings(scaler.settings.replace(min_loss_scale=1.0))
    for i, overflow in enumerate(trace):
        megatron.update(overflow)
        sd = _through_the_scaler(scaler, overflow)
        got = (sd["loss_scale"], sd["steps_since_rescale"], sd["hysteresis_tracker"])
        assert got == (megatron.scale, megatron.growth_tracker, max(megatron.hysteresis_tracker, 1)), (i, trace)


@settings(max_examples=60, deadline=None)
@given(trace=traces, window=st.integers(1, 5), hysteresis=st.integers(1, 4), consecutive=st.booleans())
def test_the_deepspeed_dialect_is_deepspeeds_rule(trace: list[bool], window: int, hysteresis: int, consecutive: bool):
    reference = DeepSpeed(2.0**10, window, min_scale=1.0, delayed_shift=hysteresis, consecutive_hysteresis=consecutive)
    settings = dls.ScalerSettings.deepspeed(
        initial_scale_power=10, loss_scale_window=window, hysteresis=hysteresis, consecutive_hysteresis=consecutive
    )
    scaler = dls.GradScaler.from_settings(settings)
    for i, overflow in enumerate(trace):
        reference.update_scale(overflow)
        sd = _through_the_scaler(scaler, overflow)
        got = (sd["loss_scale"], sd["hysteresis_tracker"])
        assert got == (reference.cur_scale, reference.cur_hysteresis), (i, trace)
        clean = reference.cur_iter - reference.last_overflow_iter - 1  # DeepSpeed's count, before its next update
        assert sd["steps_since_rescale"] == (0 if clean == 0 else (clean - 1) % window + 1), (i, trace)


def test_deepspeeds_first_growth_needs_one_clean_step_more_than_the_later_ones() -> None:
    config = {"enabled": True, "initial_scale_power": 0, "loss_scale_window": 3}
    scaler = dls.GradScaler.from_deepspeed(config, device="cpu")
    scales = [_through_the_scaler(scaler, overflow)["loss_scale"] for overflow in [False] * 7 + [True] + [False] * 4]
    # Growth on the 4th clean update, then every 3rd; after the overflow (absorbed by hysteresis 2) the 4th again.
    assert scales == [1, 1, 1, 2, 2, 2, 4, 4, 4, 4, 4, 8]


@settings(max_examples=60, deadline=None)
@given(
    trace=traces,
    steps_per_increase=st.integers(1, 5),
    tolerance=st.sampled_from([0.0, 0.0, 0.1, 0.25, 0.5, 0.75]),
    init_exp=st.integers(-4, 12),
)
def test_cerebras_dialect_is_cstorch_update_scale(
    trace: list[bool], steps_per_increase: int, tolerance: float, init_exp: int
) -> None:
    cstorch = Cstorch(2.0**init_exp, steps_per_increase, tolerance, min_loss_scale=2.0**-3, max_loss_scale=2.0**10)
    scaler = dls.GradScaler(
        loss_scale="dynamic",
        init_scale=min(max(2.0**init_exp, 2.0**-3), 2.0**10),
        steps_per_increase=steps_per_increase,
        overflow_tolerance=tolerance,
        min_loss_scale=2.0**-3,
        max_loss_scale=2.0**10,
    )
    cstorch.scale = scaler.get_scale()
    for i, overflow in enumerate(trace):
        cstorch.update_scale(not overflow)
        sd = _through_the_scaler(scaler, overflow)
        got = (sd["loss_scale"], sd["steps_since_rescale"], sd["overflows_since_rescale"])
        assert got == (cstorch.scale, cstorch.steps, cstorch.overflows), (i, trace)


def test_a_burst_backs_off_on_every_overflow_once_the_budget_is_spent() -> None:
    # hysteresis 2: the first overflow of a burst spends the budget, every further one halves (Megatron, DeepSpeed).
    scaler = dls.GradScaler("cpu", init_scale=1024.0, hysteresis=2)
    scales = [_through_the_scaler(scaler, True)["loss_scale"] for _ in range(4)]
    assert scales == [1024.0, 512.0, 256.0, 128.0]


def test_torch_dialect_grows_on_the_interval_th_clean_step_cerebras_one_later() -> None:
    torch_dialect = dls.GradScaler("cpu", init_scale=1.0, steps_per_increase=3)  # the name does not pick the rule
    cerebras = dls.GradScaler(loss_scale="dynamic", init_scale=1.0, steps_per_increase=3, max_loss_scale=2.0**10)
    assert [_through_the_scaler(torch_dialect, False)["loss_scale"] for _ in range(4)] == [1.0, 1.0, 2.0, 2.0]
    assert [_through_the_scaler(cerebras, False)["loss_scale"] for _ in range(4)] == [1.0, 1.0, 1.0, 2.0]
    assert cerebras.state_dict()["growth_interval"] == 4  # what torch.amp needs to follow the same trajectory


def test_torch_rule_with_zero_tolerance_and_one_hit() -> None:
    # torch's test: scale 4, interval 2: clean, clean → 4 then 8; overflow → scale * backoff, tracker 0.
    rule = DynamicRule(growth_interval=2, max_loss_scale=2.0**20)
    state = initial_state(4.0)
    state = rule.update(state, torch.tensor(0.0))
    assert state.loss_scale.item() == 4.0 and state.steps_since_rescale.item() == 1
    state = rule.update(state, torch.tensor(0.0))
    assert state.loss_scale.item() == 8.0 and state.steps_since_rescale.item() == 0
    state = rule.update(state, torch.tensor(1.0))
    assert state.loss_scale.item() == 4.0 and state.steps_since_rescale.item() == 0
    assert state.num_skipped_steps.item() == 1


def test_growth_never_reaches_inf_and_still_refills_the_budget() -> None:
    rule = DynamicRule(growth_interval=1, growth_factor=16.0, max_loss_scale=3.0e38, hysteresis=3)
    state = initial_state(1e38, 3)._replace(hysteresis_tracker=torch.tensor(1))
    for _ in range(3):
        state = rule.update(state, torch.tensor(0.0))
        assert torch.isfinite(state.loss_scale) and state.hysteresis_tracker.item() == 3
    assert state.loss_scale.item() == pytest.approx(1e38, rel=1e-6)


def test_growth_clamped_at_the_maximum_refills_the_budget() -> None:
    rule = DynamicRule(growth_interval=1, max_loss_scale=4.0, hysteresis=2)
    state = initial_state(4.0, 2)
    state = rule.update(state, torch.tensor(1.0))
    assert state.hysteresis_tracker.item() == 1 and state.loss_scale.item() == 4.0
    state = rule.update(state, torch.tensor(0.0))  # grows to 8, clamped to 4: still a growth event
    assert state.hysteresis_tracker.item() == 2 and state.loss_scale.item() == 4.0


def test_floor_reports_non_clamped_scale() -> None:
    rule = DynamicRule(min_loss_scale=1.0, max_loss_scale=4.0)
    state = initial_state(1.0)
    state = rule.update(state, torch.tensor(1.0))
    assert state.loss_scale.item() == 1.0
    assert state.non_clamped_scale.item() == 0.5


def test_tolerance_skips_without_backoff() -> None:
    rule = DynamicRule(growth_interval=10, overflow_tolerance=0.5)
    state = initial_state(1024.0)
    for overflow in (0.0, 1.0):  # ratio 1/2 is not above 0.5
        state = rule.update(state, torch.tensor(overflow))
    assert state.loss_scale.item() == 1024.0 and state.num_skipped_steps.item() == 1
    state = rule.update(state, torch.tensor(1.0))  # 2/3 > 0.5
    assert state.loss_scale.item() == 512.0 and state.steps_since_rescale.item() == 0


def test_the_skip_count_saturates() -> None:
    top = 2**63 - 1
    for rule in (DynamicRule(), DynamicRule(hysteresis=2), StaticRule()):
        state = initial_state(8.0, 2)._replace(num_skipped_steps=torch.tensor(top))
        assert rule.update(state, torch.tensor(1.0)).num_skipped_steps.item() == top
        rule.update_(state, torch.tensor(1.0))
        assert state.num_skipped_steps.item() == top


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
        ({"growth_interval": 0}, "growth_interval"),
        ({"consecutive_hysteresis": 1}, "consecutive_hysteresis"),
        ({"hysteresis": 0}, "hysteresis"),
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"backoff_factor": 1.0}, "backoff_factor"),
        ({"backoff_factor": 0.0}, "backoff_factor"),
        ({"overflow_tolerance": 1.0}, "overflow_tolerance"),
        ({"overflow_tolerance": -0.1}, "overflow_tolerance"),
        ({"min_loss_scale": 0.0}, "min_loss_scale"),
        ({"max_loss_scale": float("inf")}, "max_loss_scale"),
        ({"min_loss_scale": 8.0, "max_loss_scale": 4.0}, "min_loss_scale"),
        ({"steps_after_growth": 2, "growth_interval": 4}, "steps_after_growth"),
        ({"steps_after_growth": 1, "growth_interval": 1}, "steps_after_growth"),
        ({"growth_interval": 100.0}, "growth_interval must be an integer"),
    ],
)
def test_invalid_rule_settings(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DynamicRule(**kwargs)  # type: ignore[arg-type]


torch_rules = st.builds(
    DynamicRule,
    growth_interval=st.integers(2, 6),
    steps_after_growth=st.sampled_from([0, 0, 1]),
    consecutive_hysteresis=st.booleans(),
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
    start_steps = min(start_steps, rule.growth_interval - 1)  # as loaded (clamped) or left by an update
    pure = initial_state(init, rule.hysteresis)
    pure = pure._replace(steps_since_rescale=torch.tensor(start_steps, dtype=torch.int32))
    in_place = initial_state(init, rule.hysteresis)
    in_place.steps_since_rescale.fill_(start_steps)
    for overflow in overflows:
        flag = torch.tensor(float(overflow))
        pure = rule.update(pure, flag)
        rule.update_(in_place, flag)
        for name, a, b in zip(pure._fields, pure, in_place):
            assert a.item() == b.item(), name


@settings(max_examples=200, deadline=None)
@given(
    rule=torch_rules,
    flags=st.lists(st.booleans(), min_size=1, max_size=40),
    init_exp=st.integers(-14, 127),
)
def test_an_update_known_clean_on_the_host_changes_what_the_whole_rule_changes(
    rule: DynamicRule, flags: list[bool], init_exp: int
) -> None:
    """``update_(known_clean=True)`` (a step decided on the host, clean, the scale at least the floor) leaves out
    ops, never an effect: the state equals the whole rule's, but ``non_clamped_scale``, left unwritten (it is the
    scale)."""
    init = min(max(2.0**init_exp, rule.min_loss_scale), rule.max_loss_scale)
    whole, known = rule.initial_state(init), rule.initial_state(init)
    for overflow in flags:
        flag = torch.tensor(float(overflow))
        rule.update_(whole, flag)
        rule.update_(known, flag, known_clean=not overflow)
        for name, a, b in zip(whole._fields, whole, known):
            if name == "non_clamped_scale" and not overflow:
                assert a.item() == whole.loss_scale.item(), name
            else:
                assert a.item() == b.item(), name
        known.non_clamped_scale.copy_(whole.non_clamped_scale)


def test_the_static_rule_known_clean_changes_nothing() -> None:
    state = StaticRule(hysteresis=2).initial_state(128.0)
    before = [t.clone() for t in state]
    StaticRule(hysteresis=2).update_(state, torch.tensor(0.0), known_clean=True)
    assert [t.item() for t in state] == [t.item() for t in before] and state.hysteresis_tracker.item() == 2


def test_normalise_brings_loaded_counters_within_the_rule() -> None:
    rule = DynamicRule(growth_interval=4, hysteresis=2)
    state = rule.initial_state(8.0)._replace(
        steps_since_rescale=torch.tensor(9, dtype=torch.int32),
        overflows_since_rescale=torch.tensor(7),
        hysteresis_tracker=torch.tensor(-3),
    )
    rule.normalise_(state)
    assert (state.steps_since_rescale.item(), state.overflows_since_rescale.item()) == (3, 3)
    assert state.hysteresis_tracker.item() == 1
    rule.update_(state, torch.tensor(0.0))  # the next clean update grows
    assert state.loss_scale.item() == 16.0


def test_lowest_after_bounds_the_scale_after_any_update() -> None:
    rule = DynamicRule(growth_interval=1, backoff_factor=0.25, min_loss_scale=1.0, max_loss_scale=64.0)
    state = rule.initial_state(8.0)
    low = 8.0
    for overflow in (True, True, False, True, False, False, False, False):
        rule.update_(state, torch.tensor(float(overflow)))
        low = rule.lowest_after(low, known_clean=not overflow)
        assert low <= state.loss_scale.item()
    assert rule.lowest_after(100.0, known_clean=True) == 64.0  # the clamp to the maximum
    assert StaticRule().lowest_after(3.0, known_clean=False) == 3.0
