"""Reliability, round 4 (issue 38), the scaler core: a step whose masters do not fit the parameters' dtype is not
applied (A1), fused optimizers' skips leave everything bit-identical (A3), master weights refuse impossible optimizer
state (S5), crafted scaler state dicts are ValueErrors naming the key (C12), long lists of unknown keys are cut short
(C13), and the number types torch.amp takes are taken (C14)."""

from __future__ import annotations

import fractions
import inspect
import math
import warnings
from typing import Any

import numpy as np
import pytest
import torch

import dls
from dls.master_weights import master_weights


# ---------------------------------------------------------------------------------------------- helpers
def snapshot(params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> list[Any]:
    """Every parameter and every value of the optimizer's state, copied (tensors as clones)."""
    out: list[Any] = [p.detach().clone() for p in params]
    for p in [q for g in optimizer.param_groups for q in g["params"]]:
        for key, value in sorted(optimizer.state.get(p, {}).items()):
            out.append((key, value.clone() if isinstance(value, torch.Tensor) else value))
    return out


def assert_bit_identical(a: list[Any], b: list[Any]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(x, tuple):
            assert x[0] == y[0]
            x, y = x[1], y[1]
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape
            assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), (x, y)
        else:
            assert x == y


def fused_optimizers() -> list[tuple[str, type[torch.optim.Optimizer]]]:
    """Every optimizer of torch.optim that takes ``fused=True`` on the CPU (asked of torch, not listed by hand)."""
    found = []
    for name, cls in vars(torch.optim).items():
        if not (inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer)) or cls is torch.optim.Optimizer:
            continue
        if "fused" not in inspect.signature(cls).parameters:
            continue
        try:
            cls([torch.nn.Parameter(torch.ones(1))], lr=0.1, fused=True)
        except (RuntimeError, ValueError, TypeError):
            continue
        found.append((name, cls))
    return found


FUSED_VARIANTS: dict[str, list[dict[str, Any]]] = {
    "SGD": [{}, {"momentum": 0.9}, {"momentum": 0.9, "nesterov": True, "weight_decay": 0.1}],
    "Adam": [{}, {"amsgrad": True, "weight_decay": 0.1}, {"maximize": True}],
    "AdamW": [{}, {"amsgrad": True}],
    "Adagrad": [{}, {"lr_decay": 0.1, "weight_decay": 0.1}],
}


def fused_cases() -> list[Any]:
    cases = []
    for name, cls in fused_optimizers():
        for i, extra in enumerate(FUSED_VARIANTS.get(name, [{}])):
            cases.append(pytest.param(cls, extra, id=f"{name}-{i}"))
    return cases


def test_the_fused_optimizers_found_are_the_ones_torch_has() -> None:
    # torch 2.13: SGD, Adam, AdamW and Adagrad take fused=True; a new one shows up in fused_cases() by itself.
    assert {"SGD", "Adam", "AdamW", "Adagrad"} <= {name for name, _ in fused_optimizers()}


# ---------------------------------------------------------------------------------------------- A3: fused skips
@pytest.mark.parametrize("masters", [False, True], ids=["plain", "master_weights"])
@pytest.mark.parametrize(("cls", "extra"), fused_cases())
def test_a_fused_optimizers_skipped_step_leaves_parameters_and_every_state_tensor_bit_identical(
    cls: type[torch.optim.Optimizer], extra: dict[str, Any], masters: bool
) -> None:
    """The fused path hands the optimizer the NaN gradients with found_inf set (as torch.amp does): its kernel skips,
    and nothing changes, step counters included."""
    torch.manual_seed(0)
    dtype = torch.float16 if masters else torch.float32
    params = [torch.nn.Parameter(torch.randn(4, 3).to(dtype)), torch.nn.Parameter(torch.randn(3).to(dtype))]
    inner = cls(params, lr=0.01, fused=True, **extra)
    opt: torch.optim.Optimizer = master_weights(inner) if masters else inner
    scaler = dls.GradScaler("cpu", init_scale=2.0**8)
    for step in range(4):
        loss = sum((p.float() ** 2).sum() for p in params) * (step + 1)
        scaler.scale(loss).backward()
        if step == 3:
            params[0].grad[0, 0] = math.nan  # type: ignore[index]
            before = snapshot(params, inner)
            if cls is not torch.optim.SGD or extra:  # plain SGD keeps no state
                assert any(isinstance(v, tuple) and isinstance(v[1], torch.Tensor) for v in before)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert scaler.step_was_skipped(opt) and scaler.get_num_skipped_steps() == 1
    assert_bit_identical(snapshot(params, inner), before)


# ---------------------------------------------------------------------------------------------- C14: number types
@pytest.mark.parametrize(
    ("kwargs", "check"),
    [
        ({"init_scale": fractions.Fraction(1, 2)}, lambda s: s.get_scale() == 0.5),
        ({"growth_factor": fractions.Fraction(2)}, lambda s: s.get_growth_factor() == 2.0),
        ({"backoff_factor": fractions.Fraction(1, 4)}, lambda s: s.get_backoff_factor() == 0.25),
        ({"enabled": np.bool_(True)}, lambda s: s.is_enabled() is True),
        ({"enabled": np.bool_(False)}, lambda s: s.is_enabled() is False),
        ({"init_scale": np.float32(8)}, lambda s: s.get_scale() == 8.0),
        ({"init_scale": np.int64(8)}, lambda s: s.get_scale() == 8.0),
        ({"growth_interval": np.int64(3)}, lambda s: s.get_growth_interval() == 3),
        ({"growth_interval": np.uint8(3)}, lambda s: s.get_growth_interval() == 3),
    ],
)
def test_the_number_types_torch_amp_takes_are_taken(kwargs: dict[str, Any], check: Any) -> None:
    scaler = dls.GradScaler("cpu", **kwargs)
    assert check(scaler)
    settings = scaler.settings
    assert all(type(getattr(settings, k)) in (int, float, bool, str, type(None)) for k in vars(settings))


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"init_scale": True}, "init_scale"),
        ({"growth_interval": True}, "growth_interval"),
        ({"growth_interval": np.bool_(True)}, "growth_interval"),
        ({"growth_interval": 3.0}, "growth_interval"),
        ({"growth_interval": fractions.Fraction(3)}, "growth_interval"),
        ({"growth_factor": np.bool_(True)}, "growth_factor"),
        ({"enabled": 1}, "enabled"),
        ({"init_scale": fractions.Fraction(10**400)}, "init_scale"),
        ({"init_scale": complex(1, 0)}, "init_scale"),
    ],
)
def test_bools_stay_flags_and_counts_stay_integers(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        dls.GradScaler("cpu", **kwargs)


def test_python_number_and_flag_follow_numbers_real_and_integral() -> None:
    from dls.checks import python_flag, python_number

    assert python_number(fractions.Fraction(3, 4)) == 0.75 and type(python_number(fractions.Fraction(3, 4))) is float
    assert python_number(np.int16(5)) == 5 and type(python_number(np.int16(5))) is int
    assert python_number(np.bool_(True)) is None and python_number(True) is None
    assert python_flag(np.bool_(False)) is False and python_flag(True) is True
    assert python_flag(1) is None and python_flag(torch.tensor(True)) is None


def test_settings_flags_given_as_numpy_bools_are_stored_as_bools() -> None:
    settings = dls.settings.ScalerSettings.deepspeed(consecutive_hysteresis=np.bool_(True))
    assert settings.consecutive_hysteresis is True


# ---------------------------------------------------------------------------------------------- C13: long lists
def test_listed_names_the_first_few_and_counts_the_rest() -> None:
    from dls.checks import listed

    assert listed(["a", "b"]) == "'a', 'b'"
    assert listed([f"k{i}" for i in range(100_000)]) == "'k0', 'k1', 'k2', 'k3', 'k4' and 99,995 more"


@pytest.mark.parametrize(
    "call",
    [
        lambda keys: dls.GradScaler.from_deepspeed(dict.fromkeys(keys, 1), device="cpu"),
        lambda keys: dls.GradScaler("cpu").load_state_dict(dict.fromkeys(keys, 1)),
        lambda keys: dls.GradScaler.like("fairseq", device="cpu", **dict.fromkeys(keys, 1)),
    ],
    ids=["from_deepspeed", "load_state_dict", "like"],
)
def test_a_hundred_thousand_unknown_keys_make_a_short_error(call: Any) -> None:
    keys = [f"unknown_key_{i}" for i in range(100_000)]
    with pytest.raises(ValueError) as raised:
        call(keys)
    message = str(raised.value)
    assert len(message) < 2000, len(message)
    assert "'unknown_key_0'" in message and "99,995 more" in message


def test_a_misspelt_key_still_gets_its_hint() -> None:
    with pytest.raises(ValueError, match=r"'loss_scael' \(did you mean 'loss_scale'\?\)"):
        dls.GradScaler("cpu").load_state_dict({"loss_scael": 2.0})
    with pytest.raises(ValueError, match=r"did you mean 'loss_scale_window'"):
        dls.GradScaler.from_deepspeed({"loss_scale_windw": 10}, device="cpu")


# ---------------------------------------------------------------------------------------------- C12: crafted states
def _megatron() -> dls.GradScaler:
    return dls.GradScaler.from_megatron(
        initial_scale=2.0**16, min_scale=1.0, growth_interval=10, hysteresis=2, device="cpu"
    )


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("scale", torch.tensor([2.0**10], device="meta")),
        ("scale", torch.tensor(True)),
        ("scale", torch.tensor([1.0 + 0j])),
        ("scale", torch.tensor([1.0, 2.0])),
        ("scale", torch.sparse_coo_tensor([[0]], [4.0], (1,))),
        ("growth_tracker", torch.tensor(3, device="meta")),
        ("growth_tracker", torch.tensor([True])),
        ("hysteresis_tracker", torch.tensor([1, 2])),
        ("hysteresis_tracker", torch.tensor(1.5)),
    ],
)
def test_a_crafted_megatron_tensor_is_a_value_error_naming_its_key(key: str, value: torch.Tensor) -> None:
    scaler = _megatron()
    state = {"scale": torch.tensor([2.0**12]), "growth_tracker": torch.tensor(1), "hysteresis_tracker": 2}
    state[key] = value
    before = scaler.state_dict()
    with pytest.raises(ValueError, match=key):
        scaler.load_state_dict(state)
    assert scaler.state_dict() == before


@pytest.mark.parametrize(
    "state",
    [
        {"scale": torch.tensor(4.0, device="meta")},
        {"loss_scale": torch.tensor(4.0, device="meta")},
        {"_growth_tracker": torch.tensor(1, device="meta")},
        {"num_skipped_steps": torch.tensor(True)},
    ],
)
def test_crafted_tensors_in_dls_and_torch_states_are_value_errors(state: dict[str, Any]) -> None:
    scaler = dls.GradScaler("cpu")
    with pytest.raises(ValueError, match=next(iter(state))):
        scaler.load_state_dict(state)


@pytest.mark.parametrize("scale", [1e-45, 2.0**-127, 1e39, 2.0**128 - 2.0**100])
def test_a_loaded_scale_that_is_no_normal_float32_is_a_value_error_naming_key_value_and_range(scale: float) -> None:
    """A scale no scaler can hold is refused, as the constructor refuses it; a normal float32 outside this dynamic
    scaler's [min_loss_scale, max_loss_scale] is clamped into them with a warning (test_state_dict.py)."""
    scaler = dls.GradScaler("cpu")
    with pytest.raises(ValueError, match=r"state_dict\['loss_scale'\].*2\*\*-126.*float32's max") as raised:
        scaler.load_state_dict({"loss_scale": scale})
    assert repr(scale)[:6] in str(raised.value)
    assert scaler.get_scale() == 2.0**16


@pytest.mark.parametrize("interval", [10.0, np.float64(10.0), torch.tensor(10.0)])
def test_a_loaded_growth_interval_must_be_an_integer_as_the_constructors(interval: Any) -> None:
    scaler = dls.GradScaler("cpu")
    with pytest.raises(ValueError, match=r"growth_interval.*integer"):
        scaler.load_state_dict({**scaler.state_dict(), "growth_interval": interval})
    assert scaler.get_growth_interval() == 2000
    scaler.load_state_dict({**scaler.state_dict(), "growth_interval": np.int64(10)})
    assert scaler.get_growth_interval() == 10


# ---------------------------------------------------------------------------------------------- S5: master state
def _adam_masters() -> tuple[torch.nn.Parameter, Any, dict[str, Any]]:
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    opt = master_weights(torch.optim.Adam([p], lr=0.1))
    p.grad = torch.ones(3, dtype=torch.float16)
    opt.step()
    return p, opt, opt.state_dict()


@pytest.mark.parametrize(
    ("key", "bad"),
    [
        ("exp_avg", lambda t: torch.full_like(t, math.nan)),
        ("exp_avg_sq", lambda t: -torch.ones_like(t)),
        ("exp_avg", lambda t: torch.zeros(4)),
        ("exp_avg", lambda t: t.long()),
        ("step", lambda t: torch.tensor(-1.0)),
    ],
    ids=["nan-exp_avg", "negative-exp_avg_sq", "wrong-shape", "integer-dtype", "negative-step"],
)
def test_master_weights_refuse_impossible_optimizer_state_before_anything_changes(key: str, bad: Any) -> None:
    p, opt, saved = _adam_masters()
    crafted = {**saved, "state": {0: {**saved["state"][0], key: bad(saved["state"][0][key])}}}
    crafted["master_weights"] = {0: saved["master_weights"][0].clone() + 1}
    state_before = {k: v.clone() for k, v in opt.state[opt.master_of(p)].items()}
    param_before, master_before = p.detach().clone(), opt.master_of(p).detach().clone()
    with pytest.raises(ValueError, match=rf"state\[0\]\.{key}"):
        opt.load_state_dict(crafted)
    assert torch.equal(p, param_before) and torch.equal(opt.master_of(p), master_before)
    assert all(torch.equal(v, state_before[k]) for k, v in opt.state[opt.master_of(p)].items())


def test_master_weights_still_load_their_own_state() -> None:
    p, _, saved = _adam_masters()
    q, again, _ = _adam_masters()
    again.load_state_dict(saved)
    assert torch.equal(q, p)


def test_an_optimizer_whose_state_is_made_when_built_is_wrapped_and_its_state_moves_to_the_masters() -> None:
    """Adagrad makes its ``sum`` and ``step`` in its constructor: master_weights refused it as "has stepped"."""
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    opt = master_weights(torch.optim.Adagrad([p], lr=0.1, initial_accumulator_value=0.5))
    master = opt.master_of(p)
    assert set(opt.state) == {master} and opt.state[master]["sum"].dtype == torch.float32
    assert torch.equal(opt.state[master]["sum"], torch.full((3,), 0.5))
    p.grad = torch.ones(3, dtype=torch.float16)
    opt.step()
    assert float(opt.state[master]["step"]) == 1 and p.dtype == torch.float16 and not torch.equal(p, torch.ones(3))
    stepped = torch.optim.Adagrad([torch.nn.Parameter(torch.ones(2, dtype=torch.float16))], lr=0.1)
    stepped.param_groups[0]["params"][0].grad = torch.ones(2, dtype=torch.float16)
    stepped.step()
    with pytest.raises(ValueError, match="already has state"):
        master_weights(stepped)


# ---------------------------------------------------------------------------------------------- A1: weight range
def _state_of(opt: Any) -> list[Any]:
    return snapshot([], opt.optimizer if hasattr(opt, "optimizer") else opt)


def _near_float16_max(inner: Any = None, path: str = "host") -> tuple[torch.nn.Parameter, Any, dls.GradScaler | None]:
    """A float16 weight at 65000 and an optimizer that takes it to 65992 (inf in float16) with a finite gradient."""
    p = torch.nn.Parameter(torch.full((2,), 65000.0, dtype=torch.float16))
    fused = path == "fused"
    opt = master_weights((inner or torch.optim.SGD)([p], lr=1.0, momentum=0.5, **({"fused": True} if fused else {})))
    scaler = (
        None
        if path == "no_scaler"
        else dls.GradScaler("cpu", init_scale=1.0, sync_free=path == "sync_free", enabled=path != "disabled")
    )
    return p, opt, scaler


def _one_step(p: torch.Tensor, opt: Any, scaler: dls.GradScaler | None, grad: float) -> None:
    loss = (p.float() * torch.full(p.shape, grad)).sum()
    if scaler is None:
        loss.backward()
        opt.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    opt.zero_grad()


@pytest.mark.parametrize("path", ["host", "fused", "sync_free", "disabled", "no_scaler"])
def test_a_step_whose_masters_do_not_fit_float16_is_not_applied_and_counts_as_skipped(path: str) -> None:
    p, opt, scaler = _near_float16_max(path=path)
    _one_step(p, opt, scaler, grad=-1.0)  # applied: 65000 + 1 is 65000 in float16, the master holds 65001
    _one_step(p, opt, scaler, grad=-1.0)  # applied: momentum 1.5, master 65002.5
    before_p, before_m, before_state = p.detach().clone(), opt.master_of(p).detach().clone(), _state_of(opt)
    scale_before = scaler.state_dict() if scaler is not None and scaler.is_enabled() else None
    with pytest.warns(UserWarning, match=r"param_groups\[0\]\['params'\]\[0\].*float16.*dls\.keep_in_float32"):
        _one_step(p, opt, scaler, grad=-992.0)  # finite; the master would be about 65996: inf in float16
    assert torch.equal(p, before_p) and torch.isfinite(p).all()
    assert torch.equal(opt.master_of(p), before_m)
    assert_bit_identical(_state_of(opt), before_state)
    if scaler is not None and scaler.is_enabled():
        assert scaler.step_was_skipped(opt) and bool(scaler.step_was_skipped_tensor(opt))
        state = scaler.state_dict()
        assert state["num_skipped_steps"] == scale_before["num_skipped_steps"] + 1  # type: ignore[index]
        # The scale is not punished for a weight-range problem: the rule saw clean gradients.
        assert state["loss_scale"] == scale_before["loss_scale"]  # type: ignore[index]
        assert state["steps_since_rescale"] == scale_before["steps_since_rescale"] + 1  # type: ignore[index]
        dls.GradScaler("cpu").load_state_dict(state)  # its state loads (it held inf weights before)
    elif scaler is not None:
        assert scaler.step_was_skipped(opt)
    # The next step that fits is applied.
    _one_step(p, opt, scaler, grad=10.0)
    assert not torch.equal(opt.master_of(p), before_m) and torch.isfinite(p).all()


def test_a_refused_first_step_leaves_no_state_behind() -> None:
    p = torch.nn.Parameter(torch.full((2,), 65000.0, dtype=torch.float16))
    opt = master_weights(torch.optim.Adam([p], lr=2000.0))
    scaler = dls.GradScaler("cpu", init_scale=1.0)
    with pytest.warns(UserWarning, match="keep_in_float32"):
        _one_step(p, opt, scaler, grad=-1.0)
    assert not any(opt.state.values()) and torch.equal(p, torch.full((2,), 65000.0, dtype=torch.float16))
    assert scaler.step_was_skipped(opt) and scaler.get_num_skipped_steps() == 1


@pytest.mark.parametrize(
    ("dtype", "start", "lr", "grad", "said"),
    [
        (torch.bfloat16, 3.3e38, 1.0, -1e37, r"bfloat16 cannot hold.*keep_in_float32"),
        (torch.float16, 1.0, 1e38, -10.0, r"inf in float32 already.*make the updates smaller"),
        (torch.bfloat16, 1.0, 3e38, -10.0, r"inf in float32 already.*make the updates smaller"),
        (torch.float16, 1.0, math.nan, -10.0, r"would be NaN.*learning rate"),
    ],
    ids=["bfloat16-beyond-its-max", "float32-master-overflows", "bfloat16-float32-master-overflows", "nan-lr"],
)
def test_masters_beyond_any_half_range_or_float32s_are_refused(
    dtype: torch.dtype, start: float, lr: float, grad: float, said: str
) -> None:
    p = torch.nn.Parameter(torch.full((3,), start).to(dtype))
    opt = master_weights(torch.optim.SGD([p], lr=lr, momentum=0.5))
    scaler = dls.GradScaler("cpu", init_scale=1.0)
    if math.isnan(lr):
        opt.param_groups[0]["lr"] = 1.0
    _one_step(p, opt, scaler, grad=0.0)  # applied: the momentum buffer exists
    opt.param_groups[0]["lr"] = lr  # a NaN one as a crafted checkpoint's param_groups could hold
    before = p.detach().clone(), opt.master_of(p).detach().clone(), _state_of(opt)
    with pytest.warns(UserWarning, match=said):
        _one_step(p, opt, scaler, grad=grad)
    assert torch.isfinite(p).all() and torch.isfinite(opt.master_of(p)).all()
    assert torch.equal(p, before[0]) and torch.equal(opt.master_of(p), before[1])
    assert_bit_identical(_state_of(opt), before[2])
    assert scaler.get_num_skipped_steps() == 1


def test_a_refusal_on_the_fused_path_reads_nothing_back_after_the_first_step() -> None:
    from conftest import from_dls, host_reads

    p, opt, scaler = _near_float16_max(path="fused")
    _one_step(p, opt, scaler, grad=-1.0)
    before = p.detach().clone(), opt.master_of(p).detach().clone(), _state_of(opt)
    with host_reads() as reads, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _one_step(p, opt, scaler, grad=-992.0)
    assert from_dls(reads) == []
    assert any("keep_in_float32" in str(w.message) for w in caught)  # on the CPU the flag is in host memory
    assert torch.equal(p, before[0]) and torch.equal(opt.master_of(p), before[1])
    assert_bit_identical(_state_of(opt), before[2])
    assert scaler is not None and scaler.get_num_skipped_steps() == 1


def test_a_fmt_grid_master_beyond_the_formats_range_is_refused() -> None:
    p = torch.nn.Parameter(torch.full((2,), 4.0e9))
    opt = master_weights(torch.optim.SGD([p], lr=1.0), fmt="cbfloat16")
    before = p.detach().clone(), opt.master_of(p).detach().clone()
    p.grad = torch.full((2,), -1e9)
    with pytest.warns(UserWarning, match="cbfloat16.*keep_in_float32"):
        opt.step()
    assert torch.equal(p, before[0]) and torch.equal(opt.master_of(p), before[1])


def test_a_disabled_scaler_still_indexes_no_optimizer() -> None:
    """A disabled scaler asks an optimizer whether it refused its step without building an index (which refuses a
    parameter listed twice, as an enabled scaler must): a group torch only warns about still steps."""
    p = torch.nn.Parameter(torch.ones(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "a parameter group with duplicate parameters"
        opt = torch.optim.SGD([p, p], lr=0.1)
    scaler = dls.GradScaler("cpu", enabled=False)
    p.grad = torch.ones(2)
    scaler.step(opt)
    assert not scaler.step_was_skipped(opt) and not torch.equal(p, torch.ones(2))


def test_a_refusal_on_the_fused_path_is_warned_of_when_no_scaler_asks_about_it() -> None:
    """unscale_ by a scaler, then the wrapper stepped directly: the refusal is warned of at the next step."""
    p, opt, scaler = _near_float16_max(path="fused")
    assert scaler is not None
    _one_step(p, opt, scaler, grad=-1.0)
    before = p.detach().clone()
    scaler.scale((p.float() * -992.0).sum()).backward()
    scaler.unscale_(opt)
    opt.dls_next_step()  # as the scaler's fused path does: decided on the device
    opt.step()
    assert torch.equal(p, before)
    opt.zero_grad()
    with pytest.warns(UserWarning, match="keep_in_float32"):
        scaler.update()
        scaler.scale((p.float() * 0.0).sum()).backward()
        scaler.step(opt)


def test_a_config_with_forty_thousand_unknown_keys_is_a_short_error() -> None:
    """``dls validate`` printed 18.7 MB for 40,000 unknown keys: the first 20 problems, then the count."""
    from dls.checks import PROBLEMS_SHOWN_AT_MOST
    from dls.train.errors import PROBLEMS_SHOWN_AT_MOST as TRAIN_SHOWN
    from dls.train.errors import ConfigError

    error = ConfigError([f"unknown key optimizer.k{i}" for i in range(40_000)], source="big.yaml")
    assert len(str(error)) < 2000 and str(error).endswith("\n  - and 39,980 more")
    assert "(40000 problems)" in str(error) and TRAIN_SHOWN == PROBLEMS_SHOWN_AT_MOST
    few = ConfigError([f"problem {i}" for i in range(7)])
    assert str(few).count("\n  - ") == 7


@pytest.mark.parametrize(
    ("peer", "kwargs", "state", "key"),
    [
        ("apex", {}, {"loss_scale": torch.tensor(8.0, device="meta")}, "loss_scale"),
        ("apex", {}, {"loss_scale": 8.0, "unskipped": torch.tensor([1, 2])}, "unskipped"),
        ("keras", {}, {"dynamic_scale": torch.tensor(True)}, "dynamic_scale"),
        ("jmp", {"loss_scale": 8.0}, {"loss_scale": 8.0, "counter": torch.tensor(1, device="meta")}, "counter"),
        ("colossalai", {}, {"scale": torch.tensor([1 + 0j]), "hysteresis": 2}, "scale"),
        ("apex_fp16_utils", {}, {"cur_scale": torch.tensor(8.0, device="meta")}, "cur_scale"),
    ],
)
def test_every_dialects_crafted_tensor_is_a_value_error_naming_its_key(
    peer: str, kwargs: dict[str, Any], state: dict[str, Any], key: str
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scaler = dls.GradScaler.like(peer, device="cpu", **kwargs)
    before = scaler.state_dict()
    with pytest.raises(ValueError, match=key):
        scaler.load_state_dict(state)
    assert scaler.state_dict() == before


@pytest.mark.parametrize("path", ["sync_free", "fused"])
def test_a_refused_first_step_does_not_count_as_the_first_step(path: str) -> None:
    """A parameter's first step is decided on the host so that no optimizer creates its state from an overflowing
    step; a refused first step left no state, so the next one is a first step again."""
    p = torch.nn.Parameter(torch.full((2,), 65000.0, dtype=torch.float16))
    opt = master_weights(torch.optim.Adam([p], lr=2000.0, fused=path == "fused"))
    scaler = dls.GradScaler("cpu", init_scale=1.0, sync_free=path == "sync_free")
    with pytest.warns(UserWarning, match="keep_in_float32"):
        _one_step(p, opt, scaler, grad=-1.0)
    assert not any(opt.state.values())
    scaler.scale((p.float() * -1.0).sum()).backward()
    p.grad[0] = math.inf  # type: ignore[index]
    scaler.step(opt)
    scaler.update()
    assert not any(opt.state.values()) and torch.equal(p, torch.full((2,), 65000.0, dtype=torch.float16))
    assert scaler.get_num_skipped_steps() == 2


@pytest.mark.parametrize("enabled", [True, False])
def test_clipping_with_no_gradient_at_all_is_a_norm_of_zero_and_a_clean_step(enabled: bool) -> None:
    """A frozen model (no parameter got a gradient) with clipping on: the norm is 0 (torch's clip_grad_norm_ of no
    gradient), the step is clean and changes nothing (``torch.stack([])`` raised here once)."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = dls.GradScaler("dynamic", max_gradient_norm=1.0, enabled=enabled)
    assert bool(scaler.clip_gradients_and_return_isfinite(opt))
    scaler.step(opt)
    scaler.update()
    assert torch.equal(p.detach(), torch.ones(3)) and not scaler.step_was_skipped(opt)
    again = dls.GradScaler("dynamic", max_gradient_norm=1.0, enabled=enabled)
    again.step(opt)  # the clip inside step()
    again.update()
    assert torch.equal(p.detach(), torch.ones(3))


def _one_half_weight(value: float) -> tuple[torch.nn.Parameter, Any]:
    p = torch.nn.Parameter(torch.full((2,), value, dtype=torch.float16))
    return p, dls.master_weights(torch.optim.SGD([p], lr=2.0))


def test_master_weights_add_no_read_to_a_default_step_far_from_the_limit() -> None:
    """The default path reads the gradients' flag and, in the same transfer, whether a master is near its limit:
    far from it, nothing more is read; near it (a weight at 40,000 in float16), one more read after the step."""
    from conftest import from_dls, host_reads

    for value, reads in ((1.0, 1), (40000.0, 2)):
        p, opt = _one_half_weight(value)
        scaler = dls.GradScaler("cpu", init_scale=1.0)
        for _ in range(3):  # the last, a steady step
            with host_reads() as calls:
                scaler.scale(p.float().sum()).backward()
                scaler.step(opt)
                scaler.update()
                scaler.step_was_skipped(opt)
            opt.zero_grad()
        assert len(from_dls(calls)) == reads, (value, calls)


def test_a_refusal_far_from_the_limit_is_put_back_on_the_device_and_counted() -> None:
    """A weight at 1.0 moved by 80,000 at once (SGD, lr 2, a gradient of 40,000): no read foresaw it, so the default
    path puts the step back on the device; parameters, masters and state bit-identical, counted in
    num_skipped_steps and step_was_skipped_tensor, warned of; step_was_skipped reads it as applied (documented)."""
    p, opt = _one_half_weight(1.0)
    scaler = dls.GradScaler("cpu", init_scale=1.0)
    scaler.scale(p.float().sum()).backward()
    scaler.step(opt)  # a first, clean step: decided on the host
    scaler.update()
    opt.zero_grad()
    before_p, before_m = p.detach().clone(), [m.detach().clone() for g in opt.param_groups for m in g["params"]]
    with pytest.warns(UserWarning, match=r"a step was not applied.*dls\.keep_in_float32"):
        scaler.scale(p.float().sum() * 40000.0).backward()
        scaler.step(opt)
        scaler.update()
    assert torch.equal(p.detach(), before_p)
    assert all(torch.equal(m, b) for m, b in zip([m for g in opt.param_groups for m in g["params"]], before_m))
    assert bool(scaler.step_was_skipped_tensor(opt)) and scaler.get_num_skipped_steps() == 1
    assert not scaler.step_was_skipped(opt)
