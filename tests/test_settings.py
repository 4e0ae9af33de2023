"""Construction: the two dialects (torch.amp's and cstorch.amp's), their defaults, the half dtype they follow,
the growth setters, and every bad argument named."""

from __future__ import annotations

import math

import pytest
import torch

import dls
from dls.settings import ScalerSettings, SettingsError

FLOAT32_MAX = torch.finfo(torch.float32).max
TINY = torch.finfo(torch.float32).tiny


# ---------------------------------------------------------------------- dialects
@pytest.mark.parametrize(
    "make",
    [
        lambda: dls.GradScaler("cpu"),
        lambda: dls.GradScaler(torch.device("cpu")),
        lambda: dls.GradScaler(device="cpu"),
        lambda: dls.GradScaler("cpu", 2.0**16, 2.0, 0.5, 2000, True),
    ],
)
def test_a_device_selects_torch_defaults(make):
    s = make().settings
    assert (s.dialect, s.mode, s.init_scale, s.steps_per_increase) == ("torch", "dynamic", 2.0**16, 2000)
    assert (s.min_loss_scale, s.max_loss_scale) == (TINY, FLOAT32_MAX)
    assert (s.growth_factor, s.backoff_factor) == (2.0, 0.5)


def test_torch_positional_arguments_mean_what_they_mean_in_torch():
    scaler = dls.GradScaler("cpu", 128.0, 4.0, 0.25, 3, False)
    s = scaler.settings
    assert (s.init_scale, s.growth_factor, s.backoff_factor, s.steps_per_increase) == (128.0, 4.0, 0.25, 3)
    assert not scaler.is_enabled()


def test_without_a_device_the_defaults_are_cerebras():
    s = dls.GradScaler().settings
    assert (s.dialect, s.mode, s.init_scale, s.max_loss_scale, s.min_loss_scale) == (
        "cerebras",
        "dynamic",
        2.0**15,
        2.0**15,
        2.0**-14,
    )
    assert dls.GradScaler(65536.0).mode == "static"  # the positional difference: a static scale


@pytest.mark.parametrize("given", ["argument", "set_half_dtype"])
def test_cerebras_defaults_follow_the_half_dtype(given: str):
    def make(half: str | torch.dtype, **kwargs: object) -> dls.GradScaler:
        if given == "argument":
            return dls.GradScaler(half_dtype=half, **kwargs)  # type: ignore[call-overload]
        dls.set_half_dtype(half)
        return dls.GradScaler(**kwargs)  # type: ignore[call-overload]

    assert make("float16").mode == "dynamic" and make("float16").get_scale() == 2.0**15
    assert make("cbfloat16").settings.max_loss_scale == make("cbfloat16").get_scale() == 2.0**31
    assert make("cbfloat16", max_loss_scale=2.0**20).get_scale() == 2.0**20
    assert make("bfloat16").mode == "off" and not make("bfloat16").is_enabled()
    assert make(torch.bfloat16, loss_scale="dynamic").mode == "dynamic"
    assert make("bfloat16", loss_scale="dynamic").is_enabled()


def test_the_global_half_dtype_is_read_once_at_construction():
    dls.set_half_dtype("cbfloat16")
    scaler = dls.GradScaler()
    dls.set_half_dtype("bfloat16")
    assert scaler.settings.half_dtype == "cbfloat16" and scaler.settings.max_loss_scale == 2.0**31
    assert scaler.mode == "dynamic"


def test_an_explicit_init_scale_raises_the_default_max_and_an_explicit_max_below_it_is_an_error():
    assert dls.GradScaler(init_scale=2.0**20).settings.max_loss_scale == 2.0**20
    assert dls.GradScaler(max_loss_scale=2.0**10).get_scale() == 2.0**10
    with pytest.raises(ValueError, match=r"init_scale \(1048576.0\) must not exceed max_loss_scale \(1024.0\)"):
        dls.GradScaler(init_scale=2.0**20, max_loss_scale=2.0**10)
    raised = dls.GradScaler("dynamic", init_scale=2.0**20)
    assert raised.get_scale() == 2.0**20 and raised.settings.max_loss_scale == 2.0**20
    with pytest.raises(ValueError, match=r"init_scale \(0.5\) must not be below min_loss_scale \(1.0\)"):
        dls.GradScaler("dynamic", init_scale=0.5, min_loss_scale=1.0)


def test_torch_dialect_accepts_dls_knobs_by_keyword():
    scaler = dls.GradScaler("cpu", init_scale=8.0, max_gradient_norm=1.0, min_loss_scale=1.0, hysteresis=2)
    s = scaler.settings
    assert (s.init_scale, s.max_gradient_norm, s.min_loss_scale, s.hysteresis) == (8.0, 1.0, 1.0, 2)
    assert dls.GradScaler("cpu", steps_per_increase=5).get_growth_interval() == 5


def test_a_cerebras_first_argument_with_device_keyword_is_an_error_that_says_what_to_do():
    with pytest.raises(ValueError, match="pass it by keyword"):
        dls.GradScaler("dynamic", device="cpu")
    assert dls.GradScaler(loss_scale="dynamic", device="cpu").settings.dialect == "torch"
    with pytest.raises(SettingsError, match="device such as 'cuda'"):
        dls.GradScaler(loss_scale="cuda")


def test_from_settings_uses_them_as_they_are():
    settings = ScalerSettings.cerebras("dynamic", init_scale=4.0, steps_per_increase=7, half_dtype="float16")
    scaler = dls.GradScaler.from_settings(settings, device="cpu")
    assert scaler.settings is settings and scaler.get_scale() == 4.0
    with pytest.raises(ValueError, match="settings must be"):
        dls.GradScaler.from_settings({"mode": "dynamic"})  # type: ignore[arg-type]


# ---------------------------------------------------------------------- scales that cannot be held
@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"loss_scale": 1e-300}, "loss_scale"),
        ({"loss_scale": 1e-40}, "loss_scale"),  # a float32 subnormal: 1/scale is inf in float32
        ({"loss_scale": 3.5e38}, "loss_scale"),
        ({"loss_scale": math.inf}, "loss_scale"),
        ({"min_loss_scale": 1e-300}, "min_loss_scale"),
        ({"min_loss_scale": 1e-45}, "min_loss_scale"),
        ({"min_loss_scale": 0.0}, "min_loss_scale"),
        ({"init_scale": 1e-300, "min_loss_scale": 1e-300}, "min_loss_scale"),
        ({"init_scale": 1e-39}, "init_scale"),
        ({"max_loss_scale": 1e39}, "max_loss_scale"),
        ({"max_loss_scale": 10**400}, "max_loss_scale"),
        ({"steps_per_increase": 2**31}, "steps_per_increase"),
        ({"steps_per_increase": 1e10}, "steps_per_increase"),
        ({"steps_per_increase": 0}, "steps_per_increase"),
        ({"hysteresis": 2**31}, "hysteresis"),
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"growth_factor": math.nan}, "growth_factor"),
        ({"backoff_factor": 1.0}, "backoff_factor"),
        ({"overflow_tolerance": 1.0}, "overflow_tolerance"),
        ({"max_gradient_norm": -1.0}, "max_gradient_norm"),
        ({"max_gradient_norm": math.inf}, "max_gradient_norm"),
        ({"half_dtype": "float8"}, "half_dtype"),
        ({"loss_scale": "dynamc"}, "loss_scale"),
        ({"loss_scale": "cuda"}, "loss_scale"),
        ({"loss_scale": -1.0}, "loss_scale"),
        ({"loss_scale": 0}, "loss_scale"),
        ({"loss_scale": 8.0, "init_scale": 4.0}, "init_scale"),  # a static scale has no initial scale
        ({"init_scale": -2.0}, "init_scale"),
        ({"min_loss_scale": 4.0, "max_loss_scale": 2.0}, "min_loss_scale"),
        ({"max_loss_scale": -1.0}, "max_loss_scale"),
        ({"backoff_factor": 1.5}, "backoff_factor"),
        ({"hysteresis": 0}, "hysteresis"),
    ],
)
def test_bad_settings_are_errors_naming_the_argument(kwargs: dict, argument: str):
    with pytest.raises(SettingsError) as info:
        dls.GradScaler(**kwargs)
    assert argument in [name for name, _ in info.value.problems]
    assert argument in str(info.value)


@pytest.mark.parametrize("kwargs", [{"init_scale": 1e-300}, {"init_scale": 3.5e38}, {"growth_interval": 2**31}])
def test_bad_torch_settings_are_errors_too(kwargs: dict):
    with pytest.raises(ValueError, match=next(iter(kwargs)).replace("growth_interval", "steps_per_increase")):
        dls.GradScaler("cpu", **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [({"steps_per_increase": 5, "growth_interval": 5}, "growth_interval"), ({"enabled": "yes"}, "enabled")],
)
def test_bad_runtime_arguments_are_value_errors_naming_the_argument(kwargs: dict, argument: str):
    with pytest.raises(ValueError, match=argument):
        dls.GradScaler(**kwargs)


def test_every_problem_is_reported_at_once():
    with pytest.raises(SettingsError) as info:
        dls.GradScaler(loss_scale="bogus", init_scale=-1.0, hysteresis=0, growth_factor=0.5)
    assert [name for name, _ in info.value.problems] == ["loss_scale", "init_scale", "hysteresis", "growth_factor"]


def test_scales_at_the_edges_of_float32_are_accepted_and_their_inverse_is_finite():
    for scale in (TINY, FLOAT32_MAX):
        scaler = dls.GradScaler(loss_scale=scale)
        p = torch.nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([p], lr=0.0)
        scaler.scale(p.sum() * 0.0).backward()
        scaler.step(opt)
        scaler.update()
        assert torch.isfinite(p.grad).all()


@pytest.mark.parametrize(
    ("device", "message"), [("bogus", "device must be"), (123, "device must be"), ("cuda:x", "device must be")]
)
def test_bad_devices_are_named(device: object, message: str):
    with pytest.raises(ValueError, match=message):
        dls.GradScaler(device=device)  # type: ignore[call-overload]


def test_growth_settings_have_torch_getters_and_validated_setters():
    scaler = dls.GradScaler(device="cpu", growth_interval=7)
    assert scaler.get_growth_interval() == 7
    scaler.set_growth_factor(4.0)
    assert scaler.get_growth_factor() == 4.0
    with pytest.raises(ValueError, match="backoff_factor"):
        scaler.set_backoff_factor(2.0)
    assert scaler.get_backoff_factor() == 0.5


# ---------------------------------------------------------------------- the process-wide half dtype
@pytest.mark.parametrize(
    ("value", "dtype", "name"),
    [
        ("float16", torch.float16, "float16"),
        ("bfloat16", torch.bfloat16, "bfloat16"),
        ("cbfloat16", torch.float16, "cbfloat16"),
        (torch.float16, torch.float16, "float16"),
        (torch.bfloat16, torch.bfloat16, "bfloat16"),
    ],
)
def test_set_half_dtype(value: str | torch.dtype, dtype: torch.dtype, name: str) -> None:
    assert dls.set_half_dtype(value) == dtype
    assert dls.get_half_dtype() == dtype
    assert dls.get_half_dtype_str() == name


@pytest.mark.parametrize("bad", ["fp16", "float32", torch.float32, 16, None])
def test_unknown_half_dtype_is_an_error_and_changes_nothing(bad: object) -> None:
    dls.set_half_dtype("bfloat16")
    with pytest.raises(ValueError, match="half_dtype must be one of"):
        dls.set_half_dtype(bad)  # type: ignore[arg-type]
    assert dls.get_half_dtype_str() == "bfloat16"


def test_a_bad_max_is_reported_once_not_again_through_the_init_scale_it_implies():
    with pytest.raises(SettingsError) as info:
        ScalerSettings.cerebras(max_loss_scale=1e39)
    assert [name for name, _ in info.value.problems] == ["max_loss_scale"]
