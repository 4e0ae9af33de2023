"""dls.diagnostics.audit: forward overflows, gradient fit and a starting loss scale per format, model untouched."""

from __future__ import annotations

import copy
import random
import subprocess
import sys
from collections.abc import Callable

import numpy
import pytest
import torch
from torch import nn

import dls
from dls import formats
from dls.diagnostics import audit, recommend_exponent
from dls.diagnostics.scales import HIST_BINS, HIST_LOW, count_flushed, count_overflowed

T5_OUTPUT = 66246.0  # a bf16-pretrained T5 feed-forward output that float16 cannot hold


# ----------------------------------------------------------------------------------------------- models
class FeedForward(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.wi = nn.Linear(width, 4 * width, bias=False)
        self.act = nn.ReLU()
        self.wo = nn.Linear(4 * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(self.act(self.wi(x)))


class T5Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.ffn = FeedForward(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ffn(self.norm(x))


class T5Like(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.block = T5Block(width)
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


def t5_like() -> tuple[T5Like, torch.Tensor]:
    """A block whose feed-forward output peaks at T5_OUTPUT (in float32) on its batch, as large weights make it."""
    torch.manual_seed(0)
    model = T5Like()
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        peak = model.block.ffn(model.block.norm(x)).abs().max()
        model.block.ffn.wo.weight.mul_(T5_OUTPUT / peak)
        assert abs(model.block.ffn(model.block.norm(x)).abs().max().item() - T5_OUTPUT) < 1.0
    return model, x


def small_gradient_mlp() -> tuple[nn.Sequential, Callable[[nn.Module], torch.Tensor]]:
    """dls demo's situation: a tanh MLP learning a teacher, its loss weighted by 1e-4 (tiny gradients)."""
    torch.manual_seed(0)

    def mlp() -> nn.Sequential:
        return nn.Sequential(
            nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 16)
        )

    teacher, model = mlp(), mlp()
    data = torch.randn(512, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        targets = teacher(data)

    def loss_fn(m: nn.Module) -> torch.Tensor:
        idx = torch.randint(0, len(data), (64,))
        return nn.functional.mse_loss(m(data[idx]), targets[idx]) * 1e-4

    return model, loss_fn


# ----------------------------------------------------------------------------------------------- forward overflow
def test_t5_like_block_overflows_float16_forward_at_its_innermost_module() -> None:
    model, x = t5_like()
    result = audit(model, lambda m: m(x).pow(2).mean(), steps=1)
    assert result.forward_overflow["float16"] == "block.ffn.wo"  # not block.ffn or block, which return it
    assert result.audits["float16"].forward_overflow_value is not None
    assert result.audits["float16"].forward_overflow_value > formats.float16.max
    assert result.forward_overflow["bfloat16"] is None
    assert result.forward_overflow["cbfloat16"] is None
    verdict = result.verdicts["float16"]
    assert verdict.startswith("float16: forward overflow at block.ffn.wo")
    assert "loss scaling cannot fix this" in verdict and "bfloat16 or cbfloat16" in verdict
    assert result.recommended_init_scale["float16"] is None
    assert "forward overflow" not in result.verdicts["bfloat16"]
    assert result.recommended_init_scale["bfloat16"] == 1.0
    text = result.to_text()
    assert "block.ffn.wo  <- forward overflow" in text and str(result) == text


# ----------------------------------------------------------------------------------------------- small gradients
def test_recommended_scale_lets_float16_training_keep_its_gradients() -> None:
    model, loss_fn = small_gradient_mlp()
    result = audit(model, loss_fn, formats=("float16", "cbfloat16"), steps=2)
    fp16 = result.audits["float16"]
    scale = result.recommended_init_scale["float16"]
    assert scale is not None and scale >= 2.0**8
    assert fp16.underflow(1.0) > 0.5  # at scale 1 most gradient values flush
    assert result.verdicts["float16"].startswith("float16: ")
    assert f"of gradients underflow at scale 1; start at 2^{int(scale).bit_length() - 1}" in result.verdicts["float16"]
    assert fp16.measured is not None and fp16.measured["underflow_fraction"] < 0.01

    def train(start: float | None, steps: int) -> dict[str, float]:
        net = copy.deepcopy(model)
        opt = torch.optim.Adam(net.parameters(), lr=1e-3)
        scaler = None if start is None else dls.GradScaler(loss_scale="dynamic", init_scale=start, max_loss_scale=start)
        with dls.emulate(net, "float16") as handle:
            for _ in range(steps):
                loss = loss_fn(net)
                if scaler is None:
                    loss.backward()
                    opt.step()
                else:
                    scaler.scale(loss).backward()
                    scaler.step(opt)
                    scaler.update()
                opt.zero_grad(set_to_none=True)
        assert handle.stats is not None
        return handle.stats.as_dict()

    scaled = train(scale, 25)
    assert scaled["nonzero"] > 0
    assert scaled["underflow_fraction"] < 0.01
    assert scaled["overflowed"] == 0
    unscaled = train(None, 3)
    assert unscaled["underflow_fraction"] > 0.5


# ----------------------------------------------------------------------------------------------- state
class Noisy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.5)
        self.lin2 = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(self.drop(self.bn(self.lin1(x))))


def test_parameters_grads_buffers_and_rng_states_are_left_as_they_were() -> None:
    torch.manual_seed(0)
    model = Noisy().train()
    model.lin1.weight.grad = torch.randn_like(model.lin1.weight)
    grads = {name: p.grad for name, p in model.named_parameters()}
    grad_values = {name: None if g is None else g.clone() for name, g in grads.items()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    random.seed(3)
    numpy.random.seed(4)
    rng = (torch.get_rng_state(), random.getstate(), numpy.random.get_state())
    seen: list[tuple[float, float, float, float]] = []

    def loss_fn(m: nn.Module) -> torch.Tensor:
        x = torch.randn(8, 4)
        r, n = random.random(), float(numpy.random.rand())
        out = m(x)
        seen.append((x.sum().item(), r, n, out.sum().item()))
        return out.pow(2).mean() * (1 + r + n)

    result = audit(model, loss_fn, steps=2)
    assert len(seen) >= 6
    # every format (and each checking pass) saw the same two batches, dropout masks and draws
    assert len({s[:3] for s in seen}) == 2
    for name, p in model.named_parameters():
        assert p.grad is grads[name]
        if p.grad is not None:
            assert torch.equal(p.grad, grad_values[name])
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert model.training
    assert torch.equal(torch.get_rng_state(), rng[0])
    assert random.getstate() == rng[1]
    after = numpy.random.get_state()
    assert after[0] == rng[2][0] and numpy.array_equal(after[1], rng[2][1]) and after[2:] == rng[2][2:]
    assert set(result.verdicts) == {"float16", "bfloat16", "cbfloat16"}
    assert not model.lin1._forward_hooks and not model._forward_hooks  # every hook removed


def test_no_hook_is_left_on_tensors_the_caller_keeps() -> None:
    model = nn.Sequential(nn.Identity(), nn.Linear(4, 1))  # Identity returns the caller's tensor as its output
    x = torch.randn(8, 4, requires_grad=True)
    audit(model, lambda m: m(x).pow(2).mean(), formats=("float16",), steps=1)
    assert not x._backward_hooks
    assert x.grad is None  # gradients go to the model's parameters only


def test_bad_arguments_raise_before_anything_runs() -> None:
    model = Noisy()
    calls: list[int] = []

    def loss_fn(m: nn.Module) -> torch.Tensor:
        calls.append(1)
        return m(torch.randn(4, 4)).sum()

    cases: list[tuple[dict[str, object], str]] = [
        ({"formats": ()}, "formats"),
        ({"formats": "float16"}, "formats"),
        ({"formats": ("float17",)}, "float17"),
        ({"formats": ("float16", formats.float16)}, "repeat"),
        ({"steps": 0}, "steps"),
        ({"steps": True}, "steps"),
        ({"underflow_tolerance": 1.0}, "underflow_tolerance"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            audit(model, loss_fn, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="model"):
        audit("model", loss_fn)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="loss_fn"):
        audit(model, 3)  # type: ignore[arg-type]
    assert not calls


def test_a_bad_loss_raises_and_restores_the_model() -> None:
    model = Noisy()
    model.lin2.weight.grad = torch.ones_like(model.lin2.weight)
    grad = model.lin2.weight.grad
    with pytest.raises(ValueError, match="scalar"):
        audit(model, lambda m: m(torch.randn(4, 4)))
    assert model.lin2.weight.grad is grad and model.lin1.weight.grad is None
    assert not model.lin1._forward_hooks
    with pytest.raises(ValueError, match="requires grad"):
        audit(model, lambda m: m(torch.randn(4, 4)).sum().detach())


# ----------------------------------------------------------------------------------------------- the rule
def log_uniform(low: int, high: int, n: int = 20000) -> torch.Tensor:
    gen = torch.Generator().manual_seed(low * 1000 + high)
    exponent = torch.rand(n, generator=gen, dtype=torch.float64) * (high - low) + low
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0).double()
    return (sign * torch.exp2(exponent)).float()


def histogram(g: torch.Tensor) -> list[int]:
    binade = torch.floor(torch.log2(g.double().abs())).long() - HIST_LOW
    return torch.bincount(binade, minlength=HIST_BINS).tolist()


@pytest.mark.parametrize("fmt", [formats.float16, formats.cbfloat16, formats.bfloat16], ids=lambda f: f.name)
@pytest.mark.parametrize(("low", "high"), [(-40, -20), (-10, 5), (-30, -2), (10, 14)])
def test_recommended_scale_flushes_nearly_nothing_and_leaves_headroom(
    fmt: formats.FloatFormat, low: int, high: int
) -> None:
    g = log_uniform(low, high)
    k = recommend_exponent(histogram(g), g.abs().max().item(), fmt, 1e-3)
    assert k is not None
    scale = 2.0**k
    assert fmt.fraction_underflow(g * scale) <= 1e-3
    assert fmt.fraction_overflow(g * scale * 2) == 0  # the largest gradient may still double
    if k != 0:
        # scaled only as far as needed: 2**-UNDERFLOW_MARGIN of it would flush more than the tolerance, or a
        # scale twice as large would leave no headroom
        assert fmt.fraction_underflow(g * scale / 2**4) > 1e-3 or fmt.fraction_overflow(g * scale * 4) > 0


def test_gradients_wider_than_the_format_get_the_largest_safe_scale() -> None:
    g = log_uniform(-60, 10)  # 70 binades: float16 holds 40
    fmt = formats.float16
    k = recommend_exponent(histogram(g), g.abs().max().item(), fmt, 1e-3)
    assert k is not None
    assert fmt.fraction_overflow(g * 2.0 ** (k + 1)) == 0 and fmt.fraction_overflow(g * 2.0 ** (k + 2)) > 0
    assert fmt.fraction_underflow(g * 2.0**k) > 0.1
    assert recommend_exponent([0] * HIST_BINS, 0.0, fmt, 1e-3) is None


@pytest.mark.parametrize("fmt", [formats.float16, formats.cbfloat16, formats.float8_e5m2], ids=lambda f: f.name)
def test_binade_counts_agree_with_exact_rounding(fmt: formats.FloatFormat) -> None:
    g = log_uniform(-50, 30, n=5000)
    hist = histogram(g)
    for k in range(-20, 41, 6):
        scaled = g.double() * 2.0**k
        assert count_flushed(hist, fmt, k) == int((fmt.quantize(scaled) == 0).sum())
        exact_over = int(fmt.count_underflow_overflow(scaled)[2])
        top = hist[fmt.emax - k - HIST_LOW] if 0 <= fmt.emax - k - HIST_LOW < HIST_BINS else 0
        # the top binade holds a sliver above max that overflows too
        assert count_overflowed(hist, fmt, k) <= exact_over <= count_overflowed(hist, fmt, k) + top


# ----------------------------------------------------------------------------------------------- outputs
def test_table_and_plot(tmp_path: object) -> None:
    model, x = t5_like()
    result = audit(model, lambda m: m(x).pow(2).mean() * 1e-6, formats=("float16", "bfloat16"), steps=1)
    text = result.to_text()
    for column in ("module", "max|act|", "max|grad|", "underflow@1", "overflow@1"):
        assert column in text
    for name in ("block.norm", "block.ffn.wi", "block.ffn.act", "block.ffn.wo", "head", "(root)"):
        assert name in text
    wo = next(m for m in result.audits["bfloat16"].modules if m.name == "block.ffn.wo")
    assert wo.max_activation is not None and wo.max_activation > 6e4
    assert wo.max_grad is not None and wo.max_param_grad is not None and wo.nonzero > 0
    path = result.save_plot(tmp_path / "audit.png")  # type: ignore[operator]
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_the_core_needs_torch_alone() -> None:
    code = "import sys, dls, dls.diagnostics; assert 'matplotlib' not in sys.modules, 'matplotlib imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
