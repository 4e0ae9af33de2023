"""dls.fp8.emulate_recipe: Linear layers computing on FP8 operands per recipe.

Against references: torchao's ``Float8LinearConfig(emulate=True)`` (tensorwise and rowwise) and its MXFP8
training GEMM (``mx_mm`` with emulated kernels), TransformerEngine's closed-form delayed-scaling scenario.
Then the behaviours: first cast at scale 1, previous scale kept on 0/inf/NaN amaxes, dls.GradScaler with and
without saturating gradient casts, bit-identical resume, torch.compile, statistics, no host sync, misuse.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import dls
import dls.fp8
from dls.fp8 import MXFP8, CurrentScaling, DelayedScaling, StaticScaling, scaling

with warnings.catch_warnings():  # torchao warns about its CUDA-only extensions on import
    warnings.simplefilter("ignore")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_training_tensor import LinearMMConfig, hp_tensor_and_scale_to_float8
    from torchao.float8.float8_utils import tensor_to_scale
    from torchao.prototype.moe_training.mxfp8_linear import mx_mm
    from torchao.prototype.mx_formats.config import (
        MXFP8Dim0CastKernelChoice,
        MXFP8Dim1CastKernelChoice,
        ScaleCalculationMode,
    )
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

FLT_MAX = torch.finfo(torch.float32).max


def linear_pair(in_features: int, out_features: int, bias: bool = True) -> tuple[nn.Linear, nn.Linear]:
    torch.manual_seed(0)
    lin = nn.Linear(in_features, out_features, bias=bias)
    return lin, copy.deepcopy(lin)


def run(module: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, g: torch.Tensor) -> tuple[Any, ...]:
    """Output and input gradient of ``module`` on ``x`` with output gradient ``g``."""
    x = x.detach().clone().requires_grad_(True)
    y = module(x)
    y.backward(g)
    return y.detach(), x.grad


# ----------------------------------------------------------------------------------------------- torchao
@pytest.mark.parametrize("shape", [(16, 64), (4, 8, 64), (2, 3, 4, 64)], ids=["2d", "3d", "4d"])
def test_current_tensorwise_equals_torchao_float8_linear(shape: tuple[int, ...]) -> None:
    """Same payloads and scales as torchao's casts; outputs and gradients equal: both run the same float32
    GEMMs on the same dequantized operands."""
    lin, ref = linear_pair(64, 48)
    ref_model = convert_to_float8_training(nn.Sequential(ref), config=Float8LinearConfig(emulate=True))
    handle = dls.fp8.emulate_recipe(lin, CurrentScaling())
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=gen)
    g = torch.randn((*shape[:-1], 48), generator=gen)
    y, gx = run(lin, x, g)
    y_ref, gx_ref = run(ref_model, x, g)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    torch.testing.assert_close(gx, gx_ref, rtol=0, atol=0)
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad, rtol=0, atol=0)
    torch.testing.assert_close(lin.bias.grad, ref.bias.grad, rtol=0, atol=0)
    stats = handle.stats[""]
    for role, tensor, dtype in (
        ("input", x, torch.float8_e4m3fn),
        ("weight", lin.weight.detach(), torch.float8_e4m3fn),
        ("grad_output", g, torch.float8_e5m2),
    ):
        scale_ref = tensor_to_scale(tensor, dtype)
        payload_ref = hp_tensor_and_scale_to_float8(tensor, scale_ref, dtype, LinearMMConfig())._data
        scale = dls.fp8.scale_from_amax(tensor.abs().amax(), dtype)
        assert scale.view(torch.int32) == scale_ref.view(torch.int32)
        assert stats[role]["scale"] == scale.item()  # the scale the emulation used
        fmt = scaling.fp8_format(dtype)
        payload = scaling.round_scaled(tensor * scale, fmt, saturate=True).to(dtype)
        assert torch.equal(payload.view(torch.uint8), payload_ref.view(torch.uint8))


def test_current_rowwise_equals_torchao_rowwise_recipe() -> None:
    lin, ref = linear_pair(64, 48)
    config = Float8LinearConfig.from_recipe_name("rowwise")
    config = Float8LinearConfig(**{**config.__dict__, "emulate": True})
    ref_model = convert_to_float8_training(nn.Sequential(ref), config=config)
    dls.fp8.emulate_recipe(lin, CurrentScaling(granularity="row", power_2_scales=True, fp8_format="e4m3"))
    gen = torch.Generator().manual_seed(2)
    x, g = torch.randn(4, 8, 64, generator=gen), torch.randn(4, 8, 48, generator=gen)
    y, gx = run(lin, x, g)
    y_ref, gx_ref = run(ref_model, x, g)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    torch.testing.assert_close(gx, gx_ref, rtol=0, atol=0)
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad, rtol=0, atol=0)


def torchao_mx_linear(weight: torch.Tensor, mode: str, grad_dtype: torch.dtype) -> Callable[..., torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = mx_mm.apply(
            x, weight, torch.float8_e4m3fn, torch.float8_e4m3fn, grad_dtype, 32, KernelPreference.EMULATED,
            MXFP8Dim0CastKernelChoice.TORCH, MXFP8Dim1CastKernelChoice.TORCH,
            ScaleCalculationMode(mode), False,
        )  # fmt: skip
        return out

    return forward


@pytest.mark.parametrize("mode", ["rceil", "floor"])
@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
def test_mxfp8_equals_torchao_mx_training_gemms(mode: str, fmt: str) -> None:
    """Blocks of 32 along each GEMM's reduction axis (in_features, out_features, batch), as torchao's MX
    training matmul with emulated kernels."""
    lin, ref = linear_pair(96, 64, bias=False)
    dls.fp8.emulate_recipe(lin, MXFP8(scale_mode=mode, fp8_format=fmt))
    weight = ref.weight.detach().clone().requires_grad_(True)
    grad_dtype = torch.float8_e5m2 if fmt == "hybrid" else torch.float8_e4m3fn
    gen = torch.Generator().manual_seed(3)
    x, g = torch.randn(2, 32, 96, generator=gen), torch.randn(2, 32, 64, generator=gen)
    y, gx = run(lin, x, g)
    y_ref, gx_ref = run(torchao_mx_linear(weight, mode, grad_dtype), x, g)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    torch.testing.assert_close(gx, gx_ref, rtol=0, atol=0)
    torch.testing.assert_close(lin.weight.grad, weight.grad, rtol=0, atol=0)


def test_mxfp8_pads_reduction_axes_with_zeros() -> None:
    """Sizes that are not multiples of 32 (40 in, 24 out, batch 20) compute as the zero-padded problem."""
    lin, _ = linear_pair(40, 24, bias=False)
    dls.fp8.emulate_recipe(lin, MXFP8())
    padded = torch.zeros(32, 64)
    padded[:24, :40] = lin.weight.detach()
    weight = padded.requires_grad_(True)
    gen = torch.Generator().manual_seed(4)
    x, g = torch.randn(20, 40, generator=gen), torch.randn(20, 24, generator=gen)
    y, gx = run(lin, x, g)
    x_pad, g_pad = torch.zeros(32, 64), torch.zeros(32, 32)
    x_pad[:20, :40], g_pad[:20, :24] = x, g
    y_ref, gx_ref = run(torchao_mx_linear(weight, "rceil", torch.float8_e5m2), x_pad, g_pad)
    torch.testing.assert_close(y, y_ref[:20, :24], rtol=0, atol=0)
    torch.testing.assert_close(gx, gx_ref[:20, :40], rtol=0, atol=0)
    torch.testing.assert_close(lin.weight.grad, weight.grad[:24, :40], rtol=0, atol=0)


# --------------------------------------------------------------------------------------- delayed scaling
@pytest.mark.parametrize("history_len", [31, 1024])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_delayed_scaling_reproduces_transformer_engine_closed_form(history_len: int, algo: str) -> None:
    """TransformerEngine's tests/pytorch/test_recipe.py (NVIDIA/TransformerEngine,
    ``TestFP8Recipe.test_fp8_scale_update_with_linear_fuser_op``): a 16x16 Linear, HYBRID format, margin 2;
    at step s the input is filled with s + 0.25, the weight with s + 0.5, the output gradient with s + 0.75.
    After each step the history holds the amaxes so far, and the scale is ``(max / amax) / 2**margin`` with
    ``amax`` the history's max ("max") or latest ("most_recent") entry, max 448 forward and 57344 backward.
    Here with the float32 arithmetic that formula means, compared bitwise."""
    lin = nn.Linear(16, 16)
    handle = dls.fp8.emulate_recipe(lin, DelayedScaling(margin=2, amax_history_len=history_len, amax_compute_algo=algo))
    histories: dict[str, list[float]] = {"input": [], "weight": [], "grad_output": []}
    fp8_max = {"input": 448.0, "weight": 448.0, "grad_output": 57344.0}
    previous = dict.fromkeys(histories, 1.0)  # the first cast uses scale 1
    for step in range(4):
        histories["input"].append(step + 0.25)
        histories["weight"].append(step + 0.5)
        histories["grad_output"].append(step + 0.75)
        x = torch.full((16, 16), step + 0.25, requires_grad=True)
        with torch.no_grad():
            lin.weight.fill_(step + 0.5)
        lin(x).backward(torch.full((16, 16), step + 0.75))
        state = handle.state_dict()["modules"][""]
        used = handle.stats[""]
        for role, history in histories.items():
            h = state[role]["amax_history"]
            assert h[: step + 1].tolist() == history[::-1]  # newest first
            assert not h[step + 1 :].any()
            amax = max(history) if algo == "max" else history[-1]
            expected = np.float32(np.float32(fp8_max[role]) / np.float32(amax)) / np.float32(2**2)
            assert state[role]["scale"].numpy().view(np.uint32) == np.float32(expected).view(np.uint32)
            assert used[role]["scale"] == previous[role]  # this step's cast used the previous step's scale
            previous[role] = float(expected)


def test_delayed_scaling_first_cast_uses_scale_one_then_the_recorded_amax() -> None:
    """Values below half of E4M3's smallest subnormal (2**-10) flush at the first cast; the second cast's
    scale comes from the first cast's amax, and they survive."""
    lin = nn.Linear(8, 4, bias=False)
    handle = dls.fp8.emulate_recipe(lin, DelayedScaling(amax_history_len=4))
    x = torch.full((2, 8), 2.0**-11)
    y0 = lin(x)
    assert not y0.any()
    assert handle.stats[""]["input"]["flushed_fraction"] == 1.0
    handle.stats.reset()
    y1 = lin(x)
    assert handle.stats[""]["input"]["flushed_fraction"] == 0.0
    assert handle.stats[""]["input"]["scale"] == 448.0 * 2**11
    torch.testing.assert_close(y1, nn.functional.linear(x, lin.weight), rtol=2**-3, atol=0)


def test_delayed_scaling_keeps_the_previous_scale_for_zero_inf_nan_amax_and_caps_at_float32_max() -> None:
    """TransformerEngine's test_scale_update_numeric_scenarios, through casts of the input role."""
    lin = nn.Linear(4, 4, bias=False)
    handle = dls.fp8.emulate_recipe(lin, DelayedScaling(amax_history_len=1))

    def cast(value: float) -> float:
        lin(torch.full((1, 4), value, requires_grad=True))
        return float(handle.state_dict()["modules"][""]["input"]["scale"])

    assert cast(0.0) == 1.0
    assert cast(math.inf) == 1.0
    assert cast(math.nan) == 1.0
    assert cast(2.0) == 224.0
    for special in (0.0, math.inf, math.nan):
        assert cast(special) == 224.0  # the previous scale, not 1
    tiny = (torch.tensor(448.0) / FLT_MAX / 2).item()
    assert cast(tiny) == FLT_MAX


def test_delayed_scaling_max_over_the_history_window() -> None:
    lin = nn.Linear(4, 4, bias=False)
    handle = dls.fp8.emulate_recipe(lin, DelayedScaling(amax_history_len=3))
    for value in (8.0, 1.0, 2.0, 0.5):
        lin(torch.full((1, 4), value, requires_grad=True))
    state = handle.state_dict()["modules"][""]["input"]
    assert state["amax_history"].tolist() == [0.5, 2.0, 1.0]  # 8.0 rolled out
    assert state["scale"].item() == 224.0


def test_casts_without_autograd_do_not_record_amaxes() -> None:
    lin = nn.Linear(4, 4)
    handle = dls.fp8.emulate_recipe(lin, DelayedScaling(amax_history_len=2))
    with torch.no_grad():
        lin(torch.ones(2, 4))
    assert not handle.state_dict()["modules"][""]["input"]["amax_history"].any()
    assert handle.stats[""]["input"]["casts"] == 1


# ---------------------------------------------------------------------------------------- loss scaling
def grad_scaler_run(saturate: bool) -> tuple[dls.GradScaler, dls.fp8.Fp8Handle, nn.Module, list[torch.Tensor]]:
    """Two steps: the second gradient is 2**20 times the first, which the delayed E5M2 gradient scale (from
    step one) cannot hold. Returns the scaler, handle, model and the parameters before step two."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    handle = dls.fp8.emulate_recipe(model, DelayedScaling(amax_history_len=1, saturate_gradients=saturate))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = dls.GradScaler(loss_scale="dynamic", init_scale=1.0)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    before: list[torch.Tensor] = []
    for weight in (1.0, 2.0**20):
        before = [p.detach().clone() for p in model.parameters()]
        handle.stats.reset()
        scaler.scale(weight * model(x).square().mean()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return scaler, handle, model, before


def test_saturating_gradient_casts_hide_the_overflow_from_the_scaler() -> None:
    scaler, handle, _, _ = grad_scaler_run(saturate=True)
    assert scaler.get_num_skipped_steps() == 0
    assert handle.stats["2"]["grad_output"]["saturated_fraction"] > 0


def test_non_saturating_gradient_casts_let_the_scaler_skip_the_step() -> None:
    scaler, handle, model, before = grad_scaler_run(saturate=False)
    assert scaler.get_num_skipped_steps() == 1
    assert scaler.get_scale() == 0.5
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert handle.stats["2"]["grad_output"]["saturated_fraction"] > 0


# --------------------------------------------------------------------------------------------- resume
def train_steps(
    model: nn.Module, handle: dls.fp8.Fp8Handle, opt: torch.optim.Optimizer, scaler: dls.GradScaler, steps: range
) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(32, 16, generator=gen), torch.randn(32, 4, generator=gen)
        scaler.scale(nn.functional.mse_loss(model(x), y) * 1e-3).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


def fresh(recipe: Any) -> tuple[nn.Module, dls.fp8.Fp8Handle, torch.optim.Optimizer, dls.GradScaler]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))
    handle = dls.fp8.emulate_recipe(model, recipe)
    return model, handle, torch.optim.Adam(model.parameters(), lr=1e-2), dls.GradScaler(steps_per_increase=3)


def test_resume_after_five_steps_is_bit_identical() -> None:
    """Delayed scaling is the stateful recipe: its histories and scales travel in ``handle.state_dict()``."""
    recipe = DelayedScaling(amax_history_len=4)
    model, handle, opt, scaler = fresh(recipe)
    train_steps(model, handle, opt, scaler, range(10))

    model2, handle2, opt2, scaler2 = fresh(recipe)
    train_steps(model2, handle2, opt2, scaler2, range(5))
    saved = copy.deepcopy(
        {"model": model2.state_dict(), "opt": opt2.state_dict(), "scaler": scaler2.state_dict(),
         "fp8": handle2.state_dict()}
    )  # fmt: skip
    model3, handle3, opt3, scaler3 = fresh(recipe)
    model3.load_state_dict(saved["model"])
    opt3.load_state_dict(saved["opt"])
    scaler3.load_state_dict(saved["scaler"])
    handle3.load_state_dict(saved["fp8"])
    train_steps(model3, handle3, opt3, scaler3, range(5, 10))

    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model3.parameters()))
    s, s3 = handle.state_dict(), handle3.state_dict()
    assert s["recipe"] == s3["recipe"]
    for name, roles in s["modules"].items():
        for role, entry in roles.items():
            assert torch.equal(entry["amax_history"], s3["modules"][name][role]["amax_history"])
            assert torch.equal(entry["scale"], s3["modules"][name][role]["scale"])
    # without the loaded histories the resumed run differs
    model4, handle4, opt4, scaler4 = fresh(recipe)
    model4.load_state_dict(saved["model"])
    opt4.load_state_dict(saved["opt"])
    scaler4.load_state_dict(saved["scaler"])
    train_steps(model4, handle4, opt4, scaler4, range(5, 10))
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), model4.parameters()))


def test_load_state_dict_rejects_mismatches_and_changes_nothing() -> None:
    model, handle, _, _ = fresh(DelayedScaling(amax_history_len=4))
    model(torch.randn(3, 16)).sum().backward()
    before = handle.state_dict()
    other = fresh(DelayedScaling(amax_history_len=8))[1].state_dict()
    with pytest.raises(ValueError, match="recipe"):
        handle.load_state_dict(other)
    bad = copy.deepcopy(before)
    del bad["modules"]["4"]
    with pytest.raises(ValueError, match="modules"):
        handle.load_state_dict(bad)
    bad = copy.deepcopy(before)
    bad["modules"]["4"]["weight"]["amax_history"] = torch.zeros(5)
    bad["modules"]["0"]["input"]["scale"] = torch.tensor(7.0)  # checked before anything is copied
    with pytest.raises(ValueError, match="amax_history"):
        handle.load_state_dict(bad)
    with pytest.raises(ValueError, match="state"):
        handle.load_state_dict({"modules": {}})
    after = handle.state_dict()
    assert all(
        torch.equal(before["modules"][n][r][k], after["modules"][n][r][k])
        for n in before["modules"]
        for r in dls.fp8.ROLES
        for k in ("amax_history", "scale")
    )
    assert CurrentScaling().to_dict() == fresh(CurrentScaling())[1].state_dict()["recipe"]


# ------------------------------------------------------------------------------------------- compile
@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.usefixtures("fresh_dynamo")
def test_torch_compile_traces_one_graph_and_matches_eager() -> None:
    """Delayed scaling with statistics: its in-place history, scale and count updates trace too (the
    stateless recipes have less to trace). ``aot_eager`` keeps it to seconds (no code generation)."""
    recipe = DelayedScaling(amax_history_len=4)
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 8))
    compiled = copy.deepcopy(eager)
    h_eager, h_compiled = dls.fp8.emulate_recipe(eager, recipe), dls.fp8.emulate_recipe(compiled, recipe)
    fn = torch.compile(compiled, backend="aot_eager", fullgraph=True)  # a graph break is an error
    for step in range(3):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step))
        y, y_c = eager(x), fn(x)
        y.square().mean().backward()
        y_c.square().mean().backward()
        assert torch.equal(y, y_c)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(eager.parameters(), compiled.parameters()))
    assert h_eager.stats.as_dict() == h_compiled.stats.as_dict()
    assert str(h_eager.state_dict()) == str(h_compiled.state_dict())


# ---------------------------------------------------------------------------------------------- stats
def test_stats_count_flushed_and_saturated_values_per_role() -> None:
    lin = nn.Linear(4, 1, bias=False)
    handle = dls.fp8.emulate_recipe(lin, StaticScaling(1.0))
    # E4M3 at scale 1: 2**-11 flushes (below 2**-10), 500 saturates (above 464), 1.0 is exact
    x = torch.tensor([[2.0**-11, 500.0, 1.0, 0.0]], requires_grad=True)
    lin(x).backward(torch.tensor([[1e-30]]))  # E5M2 flushes it
    s = handle.stats[""]
    assert s["input"]["values"] == 3 and s["input"]["casts"] == 1
    assert s["input"]["flushed_fraction"] == pytest.approx(1 / 3)
    assert s["input"]["saturated_fraction"] == pytest.approx(1 / 3)
    assert s["input"]["amax"] == 500.0 and s["input"]["scale"] == 1.0
    assert s["grad_output"]["flushed_fraction"] == 1.0
    assert not x.grad.any()
    totals = handle.stats.totals()
    assert totals["input"]["values"] == 3 and totals["grad_output"]["values"] == 1
    handle.stats.reset()
    assert handle.stats[""]["input"] == {
        "casts": 0, "amax": None, "scale": None, "saturated_fraction": 0.0, "flushed_fraction": 0.0, "values": 0
    }  # fmt: skip
    with pytest.raises(KeyError):
        handle.stats["nope"]


def test_e5m2_saturation_threshold_ties_round_up() -> None:
    """E5M2's max 57344 has an odd significand: the midpoint 61440 rounds up (saturates); E4M3's 448 is even:
    its midpoint 464 rounds down to 448."""
    for value, fmt, saturated in ((61440.0, "e5m2", 1), (61439.99, "e5m2", 0), (464.0, "e4m3", 0), (465, "e4m3", 1)):
        sums = scaling.cast_count_sums(torch.tensor([value]), scaling.fp8_format(fmt))
        assert scaling.cast_counts(sums.tolist(), scaling.fp8_format(fmt))[1] == saturated


SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")


@pytest.mark.parametrize(
    "recipe", [CurrentScaling(), CurrentScaling(granularity="row"), DelayedScaling(), MXFP8(), StaticScaling()]
)
def test_forward_and_backward_never_read_device_values_on_the_host(
    recipe: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 40), nn.Tanh(), nn.Linear(40, 3))
    dls.fp8.emulate_recipe(model, recipe)
    x = torch.randn(5, 8)
    calls: list[str] = []
    for name in SYNC_METHODS:
        original = getattr(torch.Tensor, name)

        def spy(self: torch.Tensor, *args: Any, _name: str = name, _original: Any = original, **kw: Any) -> Any:
            calls.append(_name)
            return _original(self, *args, **kw)

        monkeypatch.setattr(torch.Tensor, name, spy)
    for _ in range(2):
        model(x).sum().backward()
    monkeypatch.undo()
    assert calls == []


# -------------------------------------------------------------------------------- handle and misuse
def test_remove_restores_the_plain_linear_and_module_filter_selects_layers() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    x = torch.randn(4, 8)
    plain = model(x)
    with dls.fp8.emulate_recipe(model, StaticScaling(1.0), module_filter=lambda name, m: name == "0") as handle:
        assert list(handle.modules) == ["0"] and handle.active
        assert not torch.equal(model(x), plain)
        assert "forward" in vars(model[0]) and "forward" not in vars(model[2])
    assert not handle.active and "forward" not in vars(model[0])
    assert torch.equal(model(x), plain)
    handle.remove()  # idempotent
    assert "removed" in repr(handle)


def test_subclasses_with_their_own_forward_are_left_alone_and_double_emulation_is_refused() -> None:
    class Scaled(nn.Linear):
        def forward(self, input: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(input)

    model = nn.Sequential(nn.Linear(4, 4), Scaled(4, 4))
    handle = dls.fp8.emulate_recipe(model, CurrentScaling())
    assert list(handle.modules) == ["0"]
    with pytest.raises(ValueError, match="already emulated"):
        dls.fp8.emulate_recipe(model, DelayedScaling())
    handle.remove()
    assert list(dls.fp8.emulate_recipe(model, DelayedScaling()).modules) == ["0"]


def test_low_precision_inputs_and_autocast_keep_the_dtype_linear_would_give() -> None:
    lin = nn.Linear(8, 4).to(torch.bfloat16)
    dls.fp8.emulate_recipe(lin, CurrentScaling())
    x = torch.randn(3, 8, dtype=torch.bfloat16, requires_grad=True)
    y = lin(x)
    y.float().sum().backward()
    assert y.dtype == x.grad.dtype == lin.weight.grad.dtype == torch.bfloat16
    lin32 = nn.Linear(8, 4)
    dls.fp8.emulate_recipe(lin32, CurrentScaling())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert lin32(torch.randn(3, 8)).dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"model": "model"}, "model"),
        ({"recipe": "delayed"}, "recipe"),
        ({"module_filter": 3}, "module_filter"),
        ({"track_stats": 1}, "track_stats"),
    ],
)
def test_emulate_rejects_bad_arguments_by_name(kwargs: dict[str, Any], name: str) -> None:
    args: dict[str, Any] = {"model": nn.Linear(2, 2), "recipe": CurrentScaling(), **kwargs}
    with pytest.raises(ValueError, match=name):
        dls.fp8.emulate_recipe(**args)
