"""``update()`` and ``update_scale()``: the scale rule once per iteration, through the scaler, against the reference
rule and torch.amp; and ``update(new_scale)``, a scale set by the user, always one the scaler can hold."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

import dls
from conftest import (
    INF,
    NAN,
    OpLog,
    ReferenceRule,
    assert_tensors_equal,
    dls_scaler,
    inject,
    loss_of,
    one_iteration,
    one_parameter,
    params_of,
    side_by_side,
    tiny_model,
    torch_scaler,
)


# ---------------------------------------------------------------------------------------------- the rule
@pytest.mark.parametrize(
    "cfg",
    [
        {"hysteresis": 2, "overflow_tolerance": 0.0, "steps_per_increase": 3},
        {"hysteresis": 1, "overflow_tolerance": 0.25, "steps_per_increase": 4},
        {"hysteresis": 3, "overflow_tolerance": 0.5, "steps_per_increase": 2},
        {"hysteresis": 2, "overflow_tolerance": 0.3, "steps_per_increase": 5, "growth_factor": 3.0},
        {"hysteresis": 1, "overflow_tolerance": 0.0, "steps_per_increase": 2},  # torch's kernel path, clamped
    ],
)
def test_hysteresis_and_tolerance_through_the_scaler_follow_the_reference_rule(cfg: dict[str, Any]) -> None:
    cfg = {**cfg, "min_loss_scale": 2.0**-2, "max_loss_scale": 2.0**6}
    rng = random.Random(str(cfg))
    flags = [rng.random() < 0.35 for _ in range(60)]
    settings = dls.ScalerSettings.cerebras("dynamic", 8.0, **cfg)
    reference = ReferenceRule(settings.rule(), scale=8.0)  # type: ignore[arg-type]
    p, opt = one_parameter()
    scaler = dls.GradScaler("dynamic", init_scale=8.0, **cfg)
    for i, f in enumerate(flags):
        one_iteration(scaler, p, opt, f)
        reference.update(f)
        sd = scaler.state_dict()
        got = (sd["loss_scale"], scaler.get_non_clamped_scale(), sd["steps_since_rescale"])
        got += (sd["overflows_since_rescale"], sd["hysteresis_tracker"], sd["num_skipped_steps"])
        expected = (reference.scale, reference.non_clamped, reference.steps)
        expected += (reference.overflows, reference.budget, reference.skipped)
        assert got == expected, (i, flags[: i + 1])
    assert scaler.get_num_skipped_steps() == sum(flags)


CEREBRAS = dls.ScalerSettings.cerebras


@pytest.mark.parametrize(
    ("settings", "most"),
    [
        (CEREBRAS("dynamic"), 5),
        (CEREBRAS("dynamic", hysteresis=2), 14),
        (CEREBRAS("dynamic", overflow_tolerance=0.25), 12),
        (CEREBRAS("dynamic", hysteresis=2, overflow_tolerance=0.25, consecutive_hysteresis=True), 21),
        (dls.ScalerSettings.deepspeed(hysteresis=1), 8),
        (dls.ScalerSettings.deepspeed(), 15),
    ],
    ids=["cerebras", "hysteresis", "tolerance", "all", "deepspeed-timing", "deepspeed"],
)
def test_an_update_the_host_cannot_decide_runs_a_few_device_ops(settings: dls.ScalerSettings, most: int) -> None:
    """On the sync-free path update() does not know the flag: the whole rule runs on the device, where each op is
    a kernel launch (``DynamicRule.update_``: torch's fused kernel and a few masks around it)."""
    p, opt = one_parameter()
    scaler = dls.GradScaler.from_settings(settings, sync_free=True)
    for overflow in (False, True, False, True):  # the first step is decided on the host
        scaler.scale(p.sum() * (INF if overflow else 1.0)).backward()
        scaler.step(opt)
        with OpLog() as log:
            scaler.update()
        opt.zero_grad()
    assert "_amp_update_scale_" in log.names() and len(log.ops) <= most, log.names()


LIKE = dls.ScalerSettings.like


@pytest.mark.parametrize(
    ("settings", "most", "kernel"),
    [
        (LIKE("keras"), 5, True),
        (LIKE("apex"), 5, True),
        (LIKE("apex_fp16_utils"), 5, True),
        (LIKE("jmp", loss_scale=2.0**15), 5, True),
        (LIKE("colossalai"), 13, True),
        (LIKE("mxnet"), 16, False),  # its own rule: the rescale committed one update late
        (LIKE("fairseq", tolerance=0.25), 34, False),  # its own rule: the overflow fraction, the threshold, the stop
    ],
    ids=["keras", "apex", "apex_fp16_utils", "jmp", "colossalai", "mxnet", "fairseq"],
)
def test_the_field_peers_updates_run_a_bounded_number_of_device_ops(
    settings: dls.ScalerSettings, most: int, kernel: bool
) -> None:
    """Every peer's update, on the sync-free path (the host knows no flag) and on the default path, stays a fixed,
    small number of device ops, whatever happened: those on ``DynamicRule`` around torch's fused kernel, fairseq's
    and MXNet's rules in plain tensor ops (each op is a kernel launch on a GPU: a new rule must not add a loop)."""
    for sync_free in (True, False):
        p, opt = one_parameter()
        scaler = dls.GradScaler.from_settings(settings, device="cpu", sync_free=sync_free)
        for overflow in (False, True, False, True, False):
            scaler.scale(p.sum() * (INF if overflow else 1.0)).backward()
            scaler.step(opt)
            with OpLog() as log:
                scaler.update()
            opt.zero_grad()
            assert len(log.ops) <= most, (sync_free, overflow, log.names())
            assert ("_amp_update_scale_" in log.names()) == kernel, log.names()


def test_an_update_the_host_decided_runs_torchs_kernel_alone_after_a_clean_step() -> None:
    """The host knows a clean step's flag: torch's rule is its fused kernel alone; DeepSpeed's timing adds the
    restart of its count after a growth (two ops)."""
    for settings, most in ((dls.ScalerSettings.torch(), 1), (dls.ScalerSettings.deepspeed(hysteresis=1), 3)):
        p, opt = one_parameter()
        scaler = dls.GradScaler.from_settings(settings, device="cpu")
        scaler.scale(p.sum()).backward()
        scaler.step(opt)
        with OpLog() as log:
            scaler.update()
        assert "_amp_update_scale_" in log.names() and len(log.ops) <= most, log.names()


def test_growth_at_max_scale_stays_at_max_and_resets_counters() -> None:
    p, opt = one_parameter()
    scaler = dls.GradScaler("dynamic", steps_per_increase=2)  # init = max = 2**15; grows on every third update
    for i in range(7):
        one_iteration(scaler, p, opt)
        assert scaler.get_scale() == scaler.get_non_clamped_scale() == 2.0**15
        assert scaler.state_dict()["steps_since_rescale"] == (i + 1) % 3


def test_non_clamped_scale_at_the_floor_then_recovers() -> None:
    p, opt = one_parameter()
    scaler = dls.GradScaler("dynamic", init_scale=2.0, min_loss_scale=1.0, steps_per_increase=2)
    seen = []
    for overflow in (True, True, True, False, False, False, False):
        one_iteration(scaler, p, opt, overflow)
        seen.append((scaler.get_scale(), scaler.get_non_clamped_scale()))
    # cstorch.amp's timing: growth on the third clean update (steps_since_rescale > steps_per_increase).
    assert seen == [(1.0, 1.0), (1.0, 0.5), (1.0, 0.5), (1.0, 1.0), (1.0, 1.0), (2.0, 2.0), (2.0, 2.0)]
    assert scaler.get_num_skipped_steps() == 3


def test_static_mode_keeps_its_scale_and_still_skips() -> None:
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = dls.GradScaler(loss_scale=256.0)
    for i in range(4):
        scaler.scale(loss_of(model, i)).backward()
        if i == 1:
            inject(model, NAN)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert scaler.mode == "static" and scaler.get_scale() == 256.0
    assert scaler.get_num_skipped_steps() == 1


@pytest.mark.parametrize(
    "factors",
    [
        pytest.param((4.0, 0.25, 8.0, 0.125), id="powers-of-two"),
        pytest.param((1.7, 0.3, 1.1, 0.9), id="odd"),
    ],
)
def test_factors_and_setters_mid_training_match_torch(factors: tuple[float, float, float, float]) -> None:
    """Setters take effect at the next update (torch's _amp_update_scale_ reads them per call); update(new_scale)
    rounds like torch's fill_."""
    growth, backoff, growth2, backoff2 = factors
    out = []
    rng = random.Random(7)
    flags = [rng.random() < 0.3 for _ in range(40)]
    for scaler in (
        torch.amp.GradScaler("cpu", init_scale=1000.0, growth_factor=growth, backoff_factor=backoff, growth_interval=2),
        dls.GradScaler(  # the torch dialect: torch's growth timing (the Cerebras dialect grows one update later)
            "cpu",
            init_scale=1000.0,
            growth_factor=growth,
            backoff_factor=backoff,
            growth_interval=2,
            min_loss_scale=2.0**-100,
            max_loss_scale=3e38,
        ),
    ):
        p, opt = one_parameter()
        scales = []
        for i, f in enumerate(flags):
            if i == 20:
                scaler.set_growth_factor(growth2)
                scaler.set_backoff_factor(backoff2)
                scaler.set_growth_interval(3)
            scaler.scale(p.sum() * (INF if f else 1.0)).backward()
            scaler.step(opt)
            if i == 30:
                scaler.update(new_scale=0.1)
            else:
                scaler.update()
            opt.zero_grad()
            scales.append(scaler.get_scale())
        out.append(scales)
    assert out[0] == out[1]


# ---------------------------------------------------------------------------------------------- which flags count
def test_update_after_only_unscale_matches_torch() -> None:
    def body(scaler: Any, model: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
        scaler.scale(loss_of(model, i)).backward()
        if i == 1:
            inject(model)
        scaler.unscale_(opt)
        if i % 2 == 0:
            scaler.step(opt)
        scaler.update()  # no step on odd iterations
        opt.zero_grad()

    side_by_side(body, lambda ps: torch.optim.Adam(ps, lr=1e-2), 6, interval=2)


def test_unscale_one_optimizer_step_another_matches_torch() -> None:
    out = []
    for scaler in (torch_scaler(2.0**6, 1), dls_scaler(2.0**6, 1)):
        m1, m2 = tiny_model(1), tiny_model(2)
        o1, o2 = torch.optim.SGD(m1.parameters(), lr=0.1), torch.optim.Adam(m2.parameters(), lr=0.01)
        for i in range(4):
            scaler.scale(loss_of(m1, i) + loss_of(m2, i)).backward()
            if i == 2:
                inject(m1, NAN)
            scaler.unscale_(o1)  # o1 is only unscaled (its flag still counts), o2 only stepped
            scaler.step(o2)
            scaler.update()
            o1.zero_grad()
            o2.zero_grad()
        out.append((params_of(m1) + params_of(m2), scaler.get_scale()))
    assert_tensors_equal(out[0][0], out[1][0])
    assert out[0][1] == out[1][1] == 2.0**6 * 2**3 / 2


def test_update_scale_uses_only_the_given_optimizers_flags_and_keeps_the_iteration_open() -> None:
    m1, m2 = tiny_model(1), tiny_model(2)
    o1, o2 = torch.optim.SGD(m1.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)
    scaler = dls_scaler(init_scale=2.0**6, steps_per_increase=1)
    scaler.scale(loss_of(m1) + loss_of(m2)).backward()
    inject(m2)
    scaler.step(o1)
    scaler.step(o2)
    scaler.update_scale(o1)  # o1 was clean: grows
    assert scaler.get_scale() == 2.0**7
    scaler.update_scale([o2])  # o2 overflowed: backs off
    assert scaler.get_scale() == 2.0**6
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.step(o1)  # still the same iteration
    with pytest.raises(RuntimeError, match="No inf checks"):
        scaler.update_scale(torch.optim.SGD(tiny_model(3).parameters(), lr=0.1))
    with pytest.raises(ValueError, match="optimizers"):
        scaler.update_scale([])


# ---------------------------------------------------------------------------------------------- new_scale
def test_a_float_or_a_one_element_tensor_new_scale_is_taken() -> None:
    p, opt = one_parameter()
    scaler = dls.GradScaler("dynamic")
    scaler.scale(p.sum()).backward()
    scaler.step(opt)
    scaler.update(new_scale=8.0)
    assert scaler.get_scale() == 8.0
    scaler.update(torch.tensor([4.0]))
    assert scaler.get_scale() == 4.0


@pytest.mark.parametrize("bad", [NAN, 0.0, -1.0, -4.0, INF, 1e-300, 1e-40, 1e39])
def test_a_bad_float_new_scale_raises_and_changes_nothing(bad: float) -> None:
    p, opt = one_parameter()
    scaler = dls.GradScaler("dynamic", init_scale=8.0)
    scaler.scale(p.sum()).backward()
    scaler.step(opt)
    with pytest.raises(ValueError, match="new_scale"):
        scaler.update(new_scale=bad)
    assert scaler.get_scale() == 8.0


@pytest.mark.parametrize(
    "bad",
    [
        torch.ones(2),
        torch.ones(1, requires_grad=True),
        torch.ones(1, dtype=torch.bool),
        torch.ones(1, dtype=torch.complex64),
    ],
)
def test_a_tensor_new_scale_that_is_not_one_real_number_without_grad_raises(bad: torch.Tensor) -> None:
    scaler = dls.GradScaler("dynamic", init_scale=8.0)
    with pytest.raises(ValueError, match=r"^new_scale must be a number or a 1-element real tensor"):
        scaler.update(bad)
    assert scaler.get_scale() == 8.0


def test_an_integer_tensor_new_scale_is_a_number() -> None:
    scaler = dls.GradScaler("dynamic", init_scale=8.0)
    scaler.update(torch.tensor(4))
    assert scaler.get_scale() == 4.0


@pytest.mark.parametrize("bad", [NAN, 0.0, -4.0, INF, 1e-300, 1e-40])
def test_a_bad_tensor_new_scale_keeps_the_old_scale_and_is_warned_about_at_the_next_read(bad: float) -> None:
    p, opt = one_parameter()
    scaler = dls.GradScaler("dynamic", init_scale=8.0)
    scaler.scale(p.sum()).backward()
    scaler.step(opt)
    scaler.update(new_scale=torch.tensor(bad, dtype=torch.float64))  # checked on the device: no error here
    opt.zero_grad()
    one_iteration(scaler, p, opt)  # and training goes on at the old scale, with finite weights
    assert torch.isfinite(p).all()
    with pytest.warns(UserWarning, match="1 value"):
        assert scaler.get_scale() == 8.0
    with pytest.warns(UserWarning, match="1 value"):
        scaler.update(new_scale=torch.tensor(bad))
        scaler.state_dict()


def test_a_tensor_new_scale_below_one_makes_the_next_unscale_check_the_unscaled_values() -> None:
    # The host cannot know a tensor new_scale; the next step must still catch the overflow it allows.
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = dls.GradScaler("dynamic", init_scale=2.0**10)
    scaler.scale(p.float().sum()).backward()
    scaler.step(opt)
    scaler.update(new_scale=torch.tensor(0.25))
    opt.zero_grad()
    scaler.scale((p.float() * 2e-15).sum() * 1e20).backward()  # 2e5 per element: fits scaled, not unscaled
    assert scaler.step(opt) is None and torch.isfinite(p).all()


def test_update_with_new_scale_then_continuing_matches_torch() -> None:
    def body(scaler: Any, model: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
        scaler.scale(loss_of(model, i)).backward()
        if i == 5:
            inject(model)
        scaler.step(opt)
        if i == 2:
            scaler.update(new_scale=48.0)
        elif i == 4:
            scaler.update(torch.tensor(3.0, dtype=torch.float64))
        else:
            scaler.update()
        opt.zero_grad()

    side_by_side(body, lambda ps: torch.optim.SGD(ps, lr=0.1), 9, interval=3)


def test_scale_tensor_is_updated_in_place_by_update_new_scale_and_load() -> None:
    scaler = dls_scaler(init_scale=2.0**4, steps_per_increase=1)
    buf = scaler.get_scale_tensor()
    p, opt = one_parameter()
    one_iteration(scaler, p, opt)
    assert buf.item() == 2.0**5
    scaler.update(new_scale=3.0)
    assert buf.item() == 3.0
    scaler.load_state_dict({"loss_scale": 7.0})
    assert buf.item() == 7.0 and scaler.get_scale_tensor() is buf
