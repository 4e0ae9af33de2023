"""Replaying policies over a trace (``dls.diagnostics.replaying``): the recorded policy reproduces the recorded run
exactly (the demo model, a small GPT with overflow bursts); on synthetic runs whose overflow scales are known, the
bounds hold the truth and a decided trajectory is the truth; the policy table, its errors, tune, the config lines."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

import dls
from conftest import ReferenceRule
from dls.diagnostics.policies import POLICIES, config_lines, parse_policy
from dls.diagnostics.replaying import replay
from dls.diagnostics.trace import Segment, Trace, read_trace
from dls.diagnostics.tuning import tune
from dls.settings import ScalerSettings
from test_record import fp16_loss, mlp, record_run

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


# ---------------------------------------------------------------------------------------------- the recorded policy
RECORDED_SETTINGS = {
    "torch": lambda: dls.GradScaler("cpu", init_scale=2.0**14, growth_interval=6),
    "cerebras": lambda: dls.GradScaler(
        loss_scale="dynamic",
        init_scale=2.0**14,
        steps_per_increase=5,
        overflow_tolerance=0.2,
        hysteresis=2,
        max_loss_scale=2.0**24,
    ),
    "hysteresis": lambda: dls.GradScaler(
        "cpu", init_scale=2.0**20, growth_interval=4, hysteresis=3, consecutive_hysteresis=True, min_loss_scale=1.0
    ),
    "static": lambda: dls.GradScaler(loss_scale=2.0**17),
}


@pytest.mark.parametrize("name", list(RECORDED_SETTINGS))
def test_replaying_the_recorded_policy_reproduces_the_demo_models_run(name: str) -> None:
    from dls.train import config, data

    cfg = config.load_config(CONFIGS / "mlp_fp16_dls.yaml")
    batches = data.build_batches(cfg.data, 0, "train")
    torch.manual_seed(0)
    model = data.build_model(cfg.model, batches.dataset.info)
    scaler = RECORDED_SETTINGS[name]()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    buf = io.BytesIO()
    seen = []
    with scaler.record(buf, model=model, histogram_every=4, flush_every=16):
        for step in range(60):
            x, y = batches.next()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y) * (2.0**16 if step % 17 == 9 else 1e-4)
            seen.append(scaler.get_scale())
            scaler.scale(loss).backward()
            scaler.step(opt)
            seen[-1] = (seen[-1], scaler.step_was_skipped(opt))
            scaler.update()
            opt.zero_grad()
    buf.seek(0)
    trace = read_trace(buf)
    (result,) = replay(trace, ["recorded"])
    assert sum(s for _, s in seen) >= 3
    assert result.first_departure is None
    assert list(zip(result.scales, result.skips)) == seen
    assert result.skipped == (sum(s for _, s in seen),) * 3 and result.undecided == 0


def test_replaying_the_recorded_policy_reproduces_a_small_gpt_with_overflow_bursts() -> None:
    from dls.train import config, data

    cfg = config.load_config(CONFIGS / "transformer_lm_fp16_dls.yaml")
    batches = data.build_batches(cfg.data, 0, "train")
    torch.manual_seed(0)
    model = data.build_model(cfg.model, batches.dataset.info)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = dls.GradScaler("cpu", init_scale=2.0**15, growth_interval=4, hysteresis=2)
    bursts = {10, 11, 12, 25, 26}  # the loss x 2**14 there: every scale the run holds overflows
    buf = io.BytesIO()
    seen = []
    with scaler.record(buf, model=model, histogram_every=5, flush_every=8):
        for step in range(36):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model.loss(batches.next()) * (2.0**14 if step in bursts else 1.0)
            scale = scaler.get_scale()
            dls.optimizer_step(loss, opt, scaler, max_gradient_norm=1.0)
            seen.append((scale, scaler.step_was_skipped(opt)))
    buf.seek(0)
    trace = read_trace(buf)
    (result,) = replay(trace, ["recorded"])
    assert sum(s for _, s in seen) >= len(bursts)
    assert result.first_departure is None
    assert list(zip(result.scales, result.skips)) == seen


def test_a_scale_set_by_hand_is_reported_as_a_departure() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = dls.GradScaler("cpu", init_scale=2.0**10)
    buf = io.BytesIO()
    with scaler.record(buf, histogram_every=None):
        for step in range(6):
            scaler.scale(fp16_loss(model, step)).backward()
            scaler.step(opt)
            scaler.update(2.0**5 if step == 3 else None)
            opt.zero_grad()
    buf.seek(0)
    trace = read_trace(buf)
    assert len(trace.steps) == 5  # an update(new_scale) is not a rule step: not recorded
    (result,) = replay(trace, ["recorded"])
    assert result.first_departure == 4  # the step after it ran at 2**5, which the rule never chose


# ---------------------------------------------------------------------------------------------- synthetic runs
def synthetic(
    settings: ScalerSettings, thresholds: list[float], *, measured: bool, spikes: dict[int, float] | None = None
) -> tuple[Trace, list[tuple[float, bool]]]:
    """A trace of ``settings``' rule (the suite's ``ReferenceRule``) over steps that overflow above
    ``thresholds[t]``; ``measured``: clean steps carry their threshold as the model hooks would, and overflowing
    steps the tensors measured before the overflow, scaled down by ``spikes[t]`` where the step is a spike."""
    reference = ReferenceRule(settings.rule(), settings.init_scale)  # type: ignore[arg-type]
    rows: list[dict[str, Any]] = []
    seen = []
    previous = None
    for t, threshold in enumerate(thresholds):
        scale = reference.scale
        overflow = scale > threshold
        row: dict[str, Any] = {"step": t + 1, "scale": scale, "overflow": overflow, "grad_amax": None}
        if measured:
            if not overflow:
                row["module_overflow_scale"] = [threshold, threshold * 4]
            else:  # the second module ran before the overflow: its tensors were finite
                upstream = None if previous is None else previous * 4 / (spikes or {}).get(t, 1.0)
                row["module_overflow_scale"] = [None, upstream if upstream and upstream >= scale else None]
        previous = threshold
        rows.append(row)
        seen.append((scale, overflow))
        reference.update(overflow)
    header = {
        "format": "dls-trace", "version": 1, "start_step": 0, "histogram_every": None,
        "settings": {f: getattr(settings, f) for f in settings.__dataclass_fields__}, "state": {},
        "modules": ["a", "b"] if measured else [],
    }  # fmt: skip
    return Trace("synthetic", [Segment(header, rows)]), seen


def truth(settings: ScalerSettings, thresholds: list[float]) -> tuple[list[float], list[bool], int]:
    """What ``settings``' rule does on steps that overflow above ``thresholds``: scales, skips, steps at the floor."""
    if settings.mode == "static":
        return [settings.init_scale] * len(thresholds), [settings.init_scale > t for t in thresholds], 0
    reference = ReferenceRule(settings.rule(), settings.init_scale)  # type: ignore[arg-type]
    floor = settings.min_loss_scale
    scales, skips, at_min = [], [], 0
    for threshold in thresholds:
        scales.append(reference.scale)
        skips.append(reference.scale > threshold)
        at_min += reference.scale == floor
        reference.update(skips[-1])
    return scales, skips, at_min


def thresholds_for(seed: int, steps: int = 160) -> tuple[list[float], dict[int, float]]:
    rng = random.Random(seed)
    level, out, spikes = 18.0, [], {}
    for t in range(steps):
        level = min(max(level + rng.uniform(-0.3, 0.3), 12.0), 26.0)
        value = 2.0**level
        if rng.random() < 0.04:  # a spike: this step's gradients 2**6..2**12 larger
            spikes[t] = 2.0 ** rng.randint(6, 12)
            value /= spikes[t]
        out.append(value)
    return out, spikes


OTHERS = [
    "torch:growth_interval=10",
    "cerebras:steps_per_increase=8,max_loss_scale=2**30",
    "megatron:growth_interval=12",
    "megatron:initial_scale=2**20,hysteresis=1,growth_interval=5",
    "deepspeed:loss_scale_window=9",
    "deepspeed:initial_scale_power=20,hysteresis=1,loss_scale_window=6,consecutive_hysteresis=true",
    "static:loss_scale=2**17",
]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("measured", [True, False], ids=["model-hooks", "no-hooks"])
def test_the_bounds_hold_the_truth_and_a_decided_trajectory_is_the_truth(seed: int, measured: bool) -> None:
    thresholds, spikes = thresholds_for(seed)
    recorded = ScalerSettings.torch(init_scale=2.0**16, growth_interval=7)
    trace, _ = synthetic(recorded, thresholds, measured=measured, spikes=spikes)
    for result in replay(trace, ["recorded", *OTHERS]):
        settings = result.policy.settings
        scales, skips, at_min = truth(settings, thresholds)
        estimate, low, high = result.skipped
        assert low <= sum(skips) <= high, result.policy.spec
        assert result.at_min_scale[1] <= at_min <= result.at_min_scale[2]
        if result.bounds_exact:  # else the states stopped being followed: no band after that step
            assert all(lo <= s <= hi for s, lo, hi in zip(scales, result.scale_low, result.scale_high))
        assert result.bounds_exact or not measured
        if result.undecided == 0:  # every step of the estimate decided: it is the truth
            assert (result.scales, result.skips) == (scales, skips)
            assert estimate == sum(skips)
        # where the estimate and the truth are at the same scale, a decided outcome is the true one
        for s, k, guessed, true_s, true_k in zip(result.scales, result.skips, result.guessed, scales, skips):
            if s == true_s and not guessed:
                assert k == true_k


def test_with_the_model_hooks_only_overflows_below_the_recorded_scale_are_undecided() -> None:
    thresholds, spikes = thresholds_for(3)
    recorded = ScalerSettings.torch(init_scale=2.0**16, growth_interval=7)
    hooked, seen = synthetic(recorded, thresholds, measured=True, spikes=spikes)
    for result in replay(hooked, OTHERS):
        for s, guessed, (recorded_scale, overflow) in zip(result.scales, result.guessed, seen):
            if guessed:
                assert overflow and s < recorded_scale
    plain, _ = synthetic(recorded, thresholds, measured=False)
    above = [
        s > recorded_scale
        for result in replay(plain, OTHERS)
        for s, guessed, (recorded_scale, overflow) in zip(result.scales, result.guessed, seen)
        if guessed and not overflow
    ]
    assert above and all(above)  # without them, clean steps above the recorded scale are undecided


def test_underflow_follows_the_histogram_at_each_policys_scale() -> None:
    # 1000 values at 2**-30 and 1000 at 2**-20 (unscaled): float16 flushes below 2**-25 (half its smallest subnormal)
    settings = ScalerSettings.torch()
    header = {
        "format": "dls-trace", "version": 1, "start_step": 0, "histogram_every": 1, "modules": [], "state": {},
        "settings": {f: getattr(settings, f) for f in settings.__dataclass_fields__},
    }  # fmt: skip
    histogram = {"min": -30, "counts": [1000] + [0] * 9 + [1000]}
    rows = [{"step": 1, "scale": 2.0**10, "overflow": False, "grad_amax": 1e-6, "exponents": histogram}]
    trace = Trace("t", [Segment(header, rows)])
    specs = ("static:loss_scale=1", "static:loss_scale=2**4", "static:loss_scale=2**5")
    at = {spec: replay(trace, [spec])[0].underflow for spec in specs}
    assert at["static:loss_scale=1"] == (0.5, 0.5, 0.5)  # 2**-30 flushes
    assert at["static:loss_scale=2**4"] == (0.5, 0.5, 0.5)  # 2**-26: still below 2**-25
    # 2**-25 up to 2**-24: rounds up to the smallest subnormal (but for values exactly at 2**-25, which tie to 0)
    assert at["static:loss_scale=2**5"] == (0.0, 0.0, 0.0)
    assert replay(trace, ["static:loss_scale=1"], fmt="bfloat16")[0].underflow == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="format must be one of"):
        replay(trace, ["torch"], fmt="float17")


# ---------------------------------------------------------------------------------------------- the policy table
def test_each_policy_is_its_peers_defaults() -> None:
    assert parse_policy("torch").settings == ScalerSettings.torch()
    assert parse_policy("cerebras").settings == ScalerSettings.cerebras(loss_scale="dynamic", half_dtype="float16")
    cb = parse_policy("cerebras", half_dtype="cbfloat16").settings
    assert cb.max_loss_scale == cb.init_scale == 2.0**31
    assert parse_policy("megatron").settings == ScalerSettings.megatron(initial_scale=2.0**32, min_scale=1.0)
    assert (
        parse_policy("megatron").settings
        == dls.GradScaler.from_megatron("cpu", initial_scale=2**32, min_scale=1).settings
    )
    assert parse_policy("deepspeed").settings == ScalerSettings.deepspeed()
    deepspeed = parse_policy("deepspeed").settings
    assert (deepspeed.init_scale, deepspeed.growth_interval, deepspeed.rule().steps_after_growth) == (2.0**16, 1001, 1)
    assert parse_policy("static:loss_scale=1024").settings.mode == "static"
    assert set(POLICIES) >= {"torch", "cerebras", "megatron", "deepspeed", "static"}


def test_overrides_and_their_errors_name_the_policy_and_the_key() -> None:
    assert parse_policy("torch:growth_interval=500,init_scale=2**10").settings.growth_interval == 500
    assert parse_policy("cerebras:steps_per_increase=500").settings.growth_interval == 501
    assert parse_policy("megatron:hysteresis=4, initial_scale=2**24").settings.hysteresis == 4
    cases = [
        ("torhc", "unknown policy 'torhc' (did you mean 'torch'?); allowed: torch, cerebras"),
        ("torch:growth_intervl=5", "policy 'torch' has no key 'growth_intervl' (did you mean 'growth_interval'?)"),
        ("torch:growth_interval", "is not key=value"),
        ("torch:growth_interval=five", "policy 'torch', key 'growth_interval': 'five' is not a number"),
        ("torch:growth_interval=0", "policy 'torch': growth_interval must be an integer from 1"),
        ("cerebras:init_scale=2**20,max_loss_scale=2**10", "policy 'cerebras': "),
        ("megatron:initial_scale=0.5", "policy 'megatron': min_scale (1.0) must not exceed initial_scale (0.5)"),
        ("deepspeed:hysteresis=0", "policy 'deepspeed': hysteresis must be an integer from 1"),
        ("deepspeed:loss_scale_windw=5", "policy 'deepspeed' has no key 'loss_scale_windw' (did you mean"),
        ("recorded:init_scale=1", "policy 'recorded' takes no settings"),
        ("recorded", "policy 'recorded' needs a trace"),
        ("", "a policy must be a name"),
    ]
    for spec, message in cases:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
            parse_policy(spec)


def test_replay_runs_the_scalers_own_rule_code(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    original = dls.policy.DynamicRule.update_

    def counted(self: Any, *args: Any, **kwargs: Any) -> None:
        calls.append(self)
        original(self, *args, **kwargs)

    monkeypatch.setattr(dls.policy.DynamicRule, "update_", counted)
    thresholds, _ = thresholds_for(0, steps=20)
    trace, _ = synthetic(ScalerSettings.torch(growth_interval=3), thresholds, measured=True)
    replay(trace, ["torch:growth_interval=4"])
    assert calls and all(rule == parse_policy("torch:growth_interval=4").settings.rule() for rule in calls)


# ---------------------------------------------------------------------------------------------- tune, config lines
def test_tune_recommends_the_fewest_skips_within_the_underflow_limit() -> None:
    thresholds, _ = thresholds_for(1, steps=120)
    trace, _ = synthetic(ScalerSettings.torch(init_scale=2.0**16, growth_interval=7), thresholds, measured=True)
    result = tune(trace, ["torch", "megatron"], max_underflow=None)
    for kind, best in result.best.items():
        same = [r for r in result.candidates if r.policy.kind == kind]
        assert best.skipped[2] == min(r.skipped[2] for r in same)
    assert len(result.candidates) == 25 + 27
    with pytest.raises(ValueError, match="no gradient histograms"):
        tune(trace, ["torch"])
    with pytest.raises(ValueError, match="max_underflow must be a number in"):
        tune(trace, ["torch"], max_underflow=2.0)
    with pytest.raises(ValueError, match="unknown policy 'torh'"):
        tune(trace, ["torh"], max_underflow=None)


def test_tune_leaves_out_settings_whose_underflow_may_exceed_the_limit() -> None:
    model = mlp()
    scaler = dls.GradScaler("cpu", init_scale=2.0**14, growth_interval=10)
    tiny = {step: 1e-6 for step in range(30)}  # gradients near 2**-20..2**-30: low static scales lose them
    trace, _ = record_run(scaler, 30, model=model, spikes=tiny, histogram_every=3)
    result = tune(trace, ["static"], max_underflow=1e-3)
    feasible = {r.policy.values["loss_scale"] for r, ok in zip(result.candidates, result.feasible) if ok}
    infeasible = {r.policy.values["loss_scale"] for r, ok in zip(result.candidates, result.feasible) if not ok}
    assert infeasible and feasible and max(infeasible) < min(feasible)
    assert all(r.underflow is not None and r.underflow[2] <= 1e-3 for r in result.best.values())


def test_the_config_lines_configure_the_same_rule() -> None:
    from dls.train.config import parse_config, scaler_settings

    for spec in ["torch:growth_interval=500,init_scale=2**12", "cerebras:steps_per_increase=250",
                 "megatron:hysteresis=4,growth_interval=250", "deepspeed:loss_scale_window=500"]:  # fmt: skip
        settings = parse_policy(spec).settings
        lines = config_lines(settings)
        rule = settings.rule()
        pasted = lines["dls"].replace('"cuda"', '"cpu"').replace("})", '}, device="cpu")')  # as a user pastes it
        built = eval(pasted, {"dls": dls})
        assert built.settings.rule() == rule
        if "Model Zoo YAML" in lines:
            yaml = __import__("yaml").safe_load(lines["Model Zoo YAML"])
            mixed = {"precision": {"mixed_precision": True, "fp16_type": "float16"}, "model": {"name": "mlp"}}
            from_yaml = scaler_settings(parse_config({**yaml, **mixed}))
            assert (from_yaml.rule(), from_yaml.init_scale) == (rule, settings.init_scale), spec
        if "DeepSpeed JSON" in lines:
            fp16 = json.loads("{" + lines["DeepSpeed JSON"] + "}")["fp16"]
            assert dls.GradScaler.from_deepspeed(fp16, device="cpu").settings.rule() == rule
        if "torch.amp" in lines:
            amp = eval(lines["torch.amp"].replace('"cuda"', '"cpu"'), {"torch": torch})
            assert (amp.get_scale(), amp.get_growth_interval()) == (settings.init_scale, settings.growth_interval)
        if "Megatron flags" in lines:
            flags = lines["Megatron flags"].split()
            assert int(flags[flags.index("--loss-scale-window") + 1]) == settings.growth_interval
            assert int(flags[flags.index("--hysteresis") + 1]) == settings.hysteresis
    assert "torch.amp" not in config_lines(parse_policy("megatron").settings)  # hysteresis: torch.amp has none
    deepspeed = config_lines(parse_policy("deepspeed").settings)  # DeepSpeed's timing: only dls and DeepSpeed
    assert set(deepspeed) == {"dls", "DeepSpeed JSON"}
    assert json.loads("{" + config_lines(parse_policy("static:loss_scale=2**10").settings)["DeepSpeed JSON"] + "}") == {
        "fp16": {"enabled": True, "loss_scale": 1024}
    }


def test_extreme_overflow_scales_replay_without_an_arithmetic_error() -> None:
    """Schema-valid extremes (a module overflow scale of 5e-324 beside one of 1.7e308): the quotient of the two
    underflows to 0, which the estimate of the overflow reads as "far smaller tensors", not a division by zero."""
    settings = ScalerSettings.torch(init_scale=1.0, growth_interval=2)
    header = {
        "format": "dls-trace", "version": 1, "start_step": 0, "histogram_every": None, "modules": ["a"], "state": {},
        "settings": {f: getattr(settings, f) for f in settings.__dataclass_fields__},
    }  # fmt: skip
    rows = [
        {"step": 1, "scale": 1.0, "overflow": False, "grad_amax": 5e-324, "module_overflow_scale": [5e-324]},
        {"step": 2, "scale": 2.0, "overflow": True, "grad_amax": None, "module_overflow_scale": [1.7e308]},
        {"step": 3, "scale": 1.0, "overflow": False, "grad_amax": 3.4e38, "module_overflow_scale": [1.7e308]},
    ]
    trace = Trace("extreme", [Segment(header, rows)])
    for result in replay(trace, ["recorded", *OTHERS]):
        assert len(result.scales) == 3 and result.skipped[1] <= result.skipped[0] <= result.skipped[2]
        json.dumps(result.to_dict(), allow_nan=False)
