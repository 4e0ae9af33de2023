"""Construction: the two dialects (torch.amp's and cstorch.amp's), their defaults, the half dtype they follow,
the growth setters, and every bad argument named."""

from __future__ import annotations

import inspect
import math
import typing
import warnings
from typing import Any

import pytest
import torch

import dls
from dls.arguments import CEREBRAS_SIGNATURE, SELECTS_CEREBRAS, TORCH_SIGNATURE
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


def test_a_torch_line_without_a_device_is_torchs_line():
    """No Cerebras-only argument: torch.amp's dialect and defaults on torch's default device "cuda", whatever the
    half dtype; without CUDA both scalers warn and disable themselves."""
    dls.set_half_dtype("bfloat16")  # no effect on the torch dialect
    for args, kwargs in [((), {}), ((), {"init_scale": 1024.0}), ((), {"growth_interval": 10, "enabled": True})]:
        with warnings.catch_warnings(record=True) as theirs_said:
            warnings.simplefilter("always")
            theirs = torch.amp.GradScaler(*args, **kwargs)
        with warnings.catch_warnings(record=True) as ours_said:
            warnings.simplefilter("always")
            ours = dls.GradScaler(*args, **kwargs)
        s = ours.settings
        assert (s.dialect, s.mode, s.half_dtype) == ("torch", "dynamic", "bfloat16")
        assert ours.is_enabled() == theirs.is_enabled() == torch.cuda.is_available()
        assert [str(w.message).replace("torch.cuda.amp", "dls").replace("  ", " ") for w in theirs_said] == [
            str(w.message) for w in ours_said
        ]
        # The settings torch's scaler holds (its getters answer only when enabled: read those of a CPU twin).
        twin = torch.amp.GradScaler("cpu", *args, **kwargs)
        assert (s.init_scale, s.growth_factor, s.backoff_factor, s.growth_interval) == (
            twin.get_scale(),
            twin.get_growth_factor(),
            twin.get_backoff_factor(),
            twin.get_growth_interval(),
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # without CUDA: disabled, as above
        assert dls.GradScaler(hysteresis=2, consecutive_hysteresis=True).settings.dialect == "torch"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"loss_scale": "dynamic"},
        {"loss_scale": None},
        {"steps_per_increase": 10},
        {"min_loss_scale": 1.0},
        {"max_loss_scale": 2.0**20},
        {"overflow_tolerance": 0.1},
        {"max_gradient_norm": 1.0},
        {"max_gradient_norm": None, "init_scale": 8.0},
    ],
)
def test_a_cerebras_only_argument_selects_the_cerebras_dialect(kwargs: dict):
    s = dls.GradScaler(**kwargs).settings
    assert s.dialect == "cerebras" and s.min_loss_scale == kwargs.get("min_loss_scale", 2.0**-14)
    assert s.max_loss_scale == kwargs.get("max_loss_scale", max(2.0**15, kwargs.get("init_scale", 0)))
    assert dls.GradScaler("cpu", **kwargs).settings.dialect == "torch"  # a device still selects torch's


def test_a_first_argument_that_is_not_a_device_is_cstorchs_loss_scale():
    assert dls.GradScaler(65536.0).mode == "static"  # the positional difference: a static scale
    assert dls.GradScaler("dynamic").settings.dialect == "cerebras"
    assert dls.GradScaler(None, 1024.0).get_scale() == 1024.0


@pytest.mark.parametrize("given", ["argument", "set_half_dtype"])
def test_cerebras_defaults_follow_the_half_dtype(given: str):
    def make(half: str | torch.dtype, **kwargs: object) -> dls.GradScaler:
        kwargs.setdefault("loss_scale", None)  # cstorch.amp's default, given: the Cerebras dialect
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
    scaler = dls.GradScaler(loss_scale=None)
    dls.set_half_dtype("bfloat16")
    assert scaler.settings.half_dtype == "cbfloat16" and scaler.settings.max_loss_scale == 2.0**31
    assert scaler.mode == "dynamic"


def test_an_explicit_init_scale_raises_the_default_max_and_an_explicit_max_below_it_is_an_error():
    assert dls.GradScaler(None, init_scale=2.0**20).settings.max_loss_scale == 2.0**20
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


@pytest.mark.parametrize(
    "kwargs",
    [{"init_scale": 1e-300}, {"init_scale": 3.5e38}, {"growth_interval": 2**31}, {"steps_per_increase": 0}],
)
def test_bad_torch_settings_are_errors_too_named_as_given(kwargs: dict):
    with pytest.raises(ValueError, match=f"^{next(iter(kwargs))} must be"):
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


@pytest.mark.parametrize("device", ["bogus", 123, "cuda:x", "meta", "xla", "mps", torch.device("meta")])
def test_bad_and_unsupported_devices_are_named_with_those_supported(device: object):
    message = r"^device must be 'cpu', 'cuda', 'cuda:N' or a torch.device of those types .*; got"
    with pytest.raises(ValueError, match=message):
        dls.GradScaler(device=device)  # type: ignore[call-overload]
    if isinstance(device, (str, torch.device)) and device not in ("bogus", "cuda:x"):  # torch knows the device
        with pytest.raises(ValueError, match=message):
            dls.GradScaler(device)  # type: ignore[call-overload]
        with pytest.raises(ValueError, match=message):
            dls.GradScaler.from_settings(ScalerSettings.torch(), device=device)  # type: ignore[arg-type]


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


# ---------------------------------------------------------------------- numbers and counts
np = pytest.importorskip("numpy")
# Every kind of number a user may hold: NumPy scalars, 0-dim arrays and 0-dim tensors, as torch.amp takes them.
REALS = [np.float32(8.0), np.float64(8.0), np.array(8.0), np.int64(8), torch.tensor(8.0), torch.tensor(8)]
INTEGERS = [np.int64(3), np.int32(3), np.uint8(3), np.array(3), torch.tensor(3), torch.tensor(3, dtype=torch.int32)]
NOT_NUMBERS = [np.array([8.0, 8.0]), torch.tensor([8.0, 8.0]), np.bool_(True), torch.tensor(True), True]


@pytest.mark.parametrize("number", REALS, ids=repr)
def test_numpy_scalars_and_0_dim_tensors_are_numbers_in_both_dialects(number: object):
    torch_dialect = dls.GradScaler("cpu", init_scale=number, growth_factor=number, backoff_factor=number / 16)
    assert torch_dialect.settings.init_scale == torch_dialect.settings.growth_factor == 8.0
    assert torch_dialect.get_backoff_factor() == 0.5 and type(torch_dialect.settings.init_scale) is float
    cerebras = dls.GradScaler(number, max_gradient_norm=number)  # a static scale, clipping
    assert (cerebras.mode, cerebras.get_scale(), cerebras.max_gradient_norm) == ("static", 8.0, 8.0)
    dynamic = dls.GradScaler(init_scale=number, min_loss_scale=number / 8, max_loss_scale=number * 2)
    assert (dynamic.get_scale(), dynamic.settings.min_loss_scale, dynamic.settings.max_loss_scale) == (8.0, 1.0, 16.0)
    dynamic.update(new_scale=number)
    assert dynamic.get_scale() == 8.0
    p = torch.nn.Parameter(torch.full((4,), 4.0))
    opt = torch.optim.SGD([p], lr=0.0)
    dynamic.scale(p.pow(2).sum() / 2).backward()  # gradient 4 per element: norm 8
    isfinite, norm = dynamic.clip_gradients_and_return_isfinite(opt, max_gradient_norm=number / 2, return_norm=True)
    assert bool(isfinite) and float(norm) == 8.0 and torch.allclose(p.grad, torch.full((4,), 2.0))
    dynamic.step(opt)
    dynamic.update()
    opt.zero_grad()
    result = dls.optimizer_step(p.pow(2).sum() / 2, opt, dynamic, max_gradient_norm=number)
    assert float(result.grad_norm) == 8.0
    dls.optimizer_step(p.sum(), opt, dynamic, max_gradient_value=number)


@pytest.mark.parametrize("count", INTEGERS, ids=repr)
def test_numpy_integers_and_0_dim_integer_tensors_are_counts(count: object):
    torch_dialect = dls.GradScaler("cpu", growth_interval=count, hysteresis=count)
    cerebras = dls.GradScaler(steps_per_increase=count, hysteresis=count)
    for s in (torch_dialect.settings, cerebras.settings):
        assert (s.steps_per_increase, s.hysteresis) == (3, 3) and type(s.steps_per_increase) is int
    torch_dialect.set_growth_interval(count)
    assert torch_dialect.get_growth_interval() == 3


@pytest.mark.parametrize(
    ("make", "argument"),
    [
        (lambda v: dls.GradScaler("cpu", init_scale=v), "init_scale"),
        (lambda v: dls.GradScaler("cpu", growth_factor=v), "growth_factor"),
        (lambda v: dls.GradScaler(v), "loss_scale"),
        (lambda v: dls.GradScaler(init_scale=v, max_loss_scale=2.0**20), "init_scale"),
        (lambda v: dls.GradScaler(max_gradient_norm=v), "max_gradient_norm"),
        (lambda v: dls.GradScaler("cpu").update(new_scale=v), "new_scale"),
        (
            lambda v: dls.GradScaler("cpu").clip_gradients_and_return_isfinite([], max_gradient_norm=v),
            "max_gradient_norm",
        ),
        (
            lambda v: dls.optimizer_step(torch.ones(()), torch.optim.SGD([torch.ones(1)]), dls.GradScaler("cpu"), v),
            "max_gradient_norm",
        ),
    ],
)
@pytest.mark.parametrize("value", NOT_NUMBERS, ids=repr)
def test_arrays_of_several_elements_and_bools_are_not_numbers(make: Any, argument: str, value: object):
    if argument == "new_scale" and isinstance(value, torch.Tensor) and value.dtype != torch.bool:
        return  # update(new_scale) takes a 1-element tensor only, as torch's does (its own message)
    with pytest.raises(ValueError, match=f"^{argument} must be"):
        make(value)


@pytest.mark.parametrize(
    ("make", "argument"),
    [
        (lambda v: dls.GradScaler("cpu", growth_interval=v), "growth_interval"),
        (lambda v: dls.GradScaler("cpu", 2.0**16, 2.0, 0.5, v), "growth_interval"),
        (lambda v: dls.GradScaler("cpu", steps_per_increase=v), "steps_per_increase"),
        (lambda v: dls.GradScaler(steps_per_increase=v), "steps_per_increase"),
        (lambda v: dls.GradScaler(growth_interval=v, loss_scale="dynamic"), "growth_interval"),
        (lambda v: dls.GradScaler("cpu", hysteresis=v), "hysteresis"),
        (lambda v: dls.GradScaler(hysteresis=v, loss_scale="dynamic"), "hysteresis"),
        (lambda v: dls.GradScaler("cpu").set_growth_interval(v), "new_interval"),
        (lambda v: ScalerSettings.cerebras(steps_per_increase=v), "steps_per_increase"),
    ],
)
@pytest.mark.parametrize("value", [100.0, np.float64(100.0), torch.tensor(100.0), np.array(100.0)], ids=repr)
def test_a_count_is_an_integer_and_a_float_is_refused_naming_the_argument(make: Any, argument: str, value: object):
    with pytest.raises(ValueError, match=rf"^{argument} must be an integer from 1 to 2\*\*31 - [12] \(a count"):
        make(value)


# ---------------------------------------------------------------------- the signatures, declared once
def _params(signature: inspect.Signature) -> tuple[list[tuple[str, Any]], dict[str, Any]]:
    """(positional parameters with defaults, in order; keyword-only parameters with defaults)."""
    ps = [p for p in signature.parameters.values() if p.name != "self"]
    positional = [(p.name, p.default) for p in ps if p.kind is p.POSITIONAL_OR_KEYWORD]
    return positional, {p.name: p.default for p in ps if p.kind is p.KEYWORD_ONLY}


def test_the_overloads_are_the_declared_signatures():
    get_overloads = getattr(typing, "get_overloads", None)
    if get_overloads is None:
        pytest.skip("typing.get_overloads needs Python 3.11 (the overloads are checked there)")
    overloads = [inspect.signature(f) for f in get_overloads(dls.GradScaler.__init__)]
    assert [_params(s) for s in overloads] == [_params(TORCH_SIGNATURE), _params(CEREBRAS_SIGNATURE)]


def test_the_torch_signature_starts_with_torchs_own():
    theirs = _params(inspect.signature(torch.amp.GradScaler.__init__))[0]
    assert theirs == [
        ("device", "cuda"),
        ("init_scale", 2.0**16),
        ("growth_factor", 2.0),
        ("backoff_factor", 0.5),
        ("growth_interval", 2000),
        ("enabled", True),
    ]
    assert _params(TORCH_SIGNATURE)[0] == theirs


# cstorch.amp's GradScaler.__init__ as cerebras-pytorch 2.10.0 declares it (cerebras/pytorch/amp/grad_scaler.py of
# its wheel; the package cannot be imported here: its native library needs its own torch).
CSTORCH_GRAD_SCALER = [
    ("loss_scale", None),
    ("init_scale", None),
    ("steps_per_increase", None),
    ("min_loss_scale", None),
    ("max_loss_scale", None),
    ("overflow_tolerance", 0.0),
    ("max_gradient_norm", None),
]


def test_the_cerebras_signature_starts_with_cstorchs_own():
    assert _params(CEREBRAS_SIGNATURE)[0][: len(CSTORCH_GRAD_SCALER)] == CSTORCH_GRAD_SCALER
    assert set(SELECTS_CEREBRAS) == {name for name, _ in CSTORCH_GRAD_SCALER} - {"init_scale"}


def test_every_argument_of_one_dialect_is_accepted_by_keyword_in_the_other():
    torch_names = set(TORCH_SIGNATURE.parameters)
    cerebras_names = set(CEREBRAS_SIGNATURE.parameters)
    assert torch_names == cerebras_names


# ---------------------------------------------------------------------- the peers' defaults, in one table
def _defaults(function: Any) -> dict[str, Any]:
    return {
        p.name: p.default
        for p in inspect.signature(function).parameters.values()
        if p.default is not inspect.Parameter.empty
    }


def test_every_peers_defaults_come_from_its_row_of_the_one_table():
    from dls.arguments import DEEPSPEED_DEFAULTS
    from dls.diagnostics.policies import POLICIES
    from dls.policy import PEERS

    torch_row, cerebras_row = PEERS["torch"].defaults, PEERS["cerebras"].defaults
    assert dict(_params(TORCH_SIGNATURE)[0][1:5]) == torch_row
    assert dict(_params(CEREBRAS_SIGNATURE)[0][:7]) == cerebras_row
    assert _defaults(ScalerSettings.deepspeed) == PEERS["deepspeed"].defaults
    assert {k: v for k, v in DEEPSPEED_DEFAULTS.items() if k != "enabled"} == PEERS["deepspeed"].defaults
    megatron = PEERS["megatron"]
    optional = {k: v for k, v in megatron.defaults.items() if k not in megatron.required}
    assert _defaults(ScalerSettings.megatron) == optional
    assert {k: v for k, v in _defaults(dls.GradScaler.from_megatron).items() if k != "device"} == optional
    assert set(inspect.signature(ScalerSettings.megatron).parameters) >= set(megatron.required)
    for name in ("torch", "megatron", "deepspeed"):  # the policy lab's rows say the same
        assert POLICIES[name].defaults.items() <= PEERS[name].defaults.items(), name
    for name, row in PEERS.items():  # and so do the settings each dialect builds
        settings = ScalerSettings(mode="dynamic", init_scale=1.0, min_loss_scale=1.0, max_loss_scale=2.0, dialect=name)
        assert settings.growth_interval - settings.steps_per_increase == row.growth_offset
        rule = settings.rule()
        assert rule.growth_interval == settings.growth_interval and rule.steps_after_growth == row.steps_after_growth


def test_each_dialects_default_bounds_are_its_rows():
    from dls.policy import PEERS

    for half in ("float16", "cbfloat16"):
        cerebras = ScalerSettings.cerebras(half_dtype=half)
        top = PEERS["cerebras"].cbfloat16_max_loss_scale if half == "cbfloat16" else PEERS["cerebras"].max_loss_scale
        assert (cerebras.min_loss_scale, cerebras.max_loss_scale, cerebras.init_scale) == (2.0**-14, top, top)
    assert ScalerSettings.cerebras(half_dtype="cbfloat16").max_loss_scale == 2.0**31
    plain = ScalerSettings.torch()
    assert (plain.min_loss_scale, plain.max_loss_scale) == (PEERS["torch"].min_loss_scale, FLOAT32_MAX)
    assert ScalerSettings.deepspeed().max_loss_scale == ScalerSettings.megatron(1.0, 1.0).max_loss_scale == FLOAT32_MAX


def test_like_builds_each_peers_scaler_from_its_own_arguments():
    assert (
        dls.GradScaler.like("torch", "cpu", init_scale=8.0).settings == dls.GradScaler("cpu", init_scale=8.0).settings
    )
    assert ScalerSettings.like("cerebras", steps_per_increase=5) == ScalerSettings.cerebras(steps_per_increase=5)
    deepspeed = dls.GradScaler.from_deepspeed({"enabled": True, "hysteresis": 1}, device="cpu")
    assert dls.GradScaler.like("deepspeed", "cpu", hysteresis=1).settings == deepspeed.settings
    megatron = dls.GradScaler.from_megatron("cpu", initial_scale=2.0**16, min_scale=1.0, hysteresis=3)
    assert dls.GradScaler.like("megatron", "cpu", initial_scale=2.0**16, min_scale=1.0, hysteresis=3).settings == (
        megatron.settings
    )


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: ScalerSettings.like("megatorn"),
            r"peer must be one of .*; got 'megatorn' \(did you mean 'megatron'\?\)",
        ),
        (lambda: ScalerSettings.like("torch", growth_intervall=3), r"no argument 'growth_intervall' \(did you mean"),
        (lambda: ScalerSettings.like("torch", steps_per_increase=3), r"torch's scaler has no argument 'steps_per_inc"),
        (lambda: ScalerSettings.like("megatron", min_scale=1.0), r"megatron's scaler requires initial_scale"),
        (lambda: ScalerSettings.like("deepspeed", hysteresis=0), r"^hysteresis must be an integer"),
    ],
)
def test_like_refuses_what_the_peer_does_not_take_naming_it(call: Any, message: str):
    with pytest.raises(ValueError, match=message):
        call()
