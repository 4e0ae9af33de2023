"""dls.emulate: forward and backward rounding of a float32 model to a half format, through module hooks.

The reference for every check is written independently of the hooks: explicit rounding of inputs, weights and
outputs, and a tensor hook that rounds the gradient flowing into each output.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import dls
from dls import formats
from dls.emulation import EmulationHandle
from dls.formats import FloatFormat

CB = formats.cbfloat16
F16 = formats.float16


def ste(t: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Rounded in forward, identity in backward (written without dls' autograd function)."""
    return t + (fmt.quantize(t.detach()) - t).detach()


def out(t: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Rounded in forward; the gradient flowing into it is rounded too."""
    y = ste(t, fmt)
    y.register_hook(fmt.quantize)
    return y


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def manual_mlp(model: nn.Sequential, x: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    lin1, _, lin2 = model
    h = out(F.linear(ste(x, fmt), ste(lin1.weight, fmt), ste(lin1.bias, fmt)), fmt)
    h = out(F.relu(ste(h, fmt)), fmt)
    return out(F.linear(ste(h, fmt), ste(lin2.weight, fmt), ste(lin2.bias, fmt)), fmt)


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("fmt", [CB, F16, formats.bfloat16, formats.float8_e4m3fn], ids=lambda f: f.name)
def test_forward_and_backward_match_explicit_rounding(fmt: FloatFormat) -> None:
    model, reference = mlp(), mlp()
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1)) * 3
    target = torch.randn(32, 3, generator=torch.Generator().manual_seed(2))
    with dls.emulate(model, fmt):
        y = model(x)
        F.mse_loss(y, target).backward()
    y_ref = manual_mlp(reference, x, fmt)
    F.mse_loss(y_ref, target).backward()
    assert torch.equal(y, y_ref)
    assert torch.equal(y, fmt.quantize(y))  # outputs lie on the format's grid
    for g, g_ref in zip(grads(model), grads(reference), strict=True):
        assert torch.equal(g, g_ref)
    # and the emulation changed something (the reference is not plain float32)
    assert not torch.equal(y_ref, mlp()(x))


def test_master_weights_stay_float32_and_untouched() -> None:
    model = mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    with dls.emulate(model, "cbfloat16"):
        model(torch.randn(4, 8)).sum().backward()
        assert list(model.parameters()) == params  # the same Parameter objects, outside forward
    for p in params:
        assert isinstance(p, nn.Parameter) and p.dtype == torch.float32 and p.grad is not None
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # An update far below cbfloat16's resolution around 1.0 still moves the float32 master weight.
    with torch.no_grad():
        model[0].weight.fill_(1.0)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with dls.emulate(model, "cbfloat16"):
        opt.zero_grad()
        (model(torch.ones(1, 8))[0, 0] * 1e-5).backward()
        opt.step()
    w = model[0].weight
    assert (w != 1.0).any() and CB.quantize(w).eq(1.0).all()


def test_weights_seen_by_forward_are_rounded() -> None:
    seen: list[torch.Tensor] = []

    class Probe(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(self.weight.detach().clone())
            return super().forward(x)

    torch.manual_seed(0)
    probe = Probe(4, 4)
    with dls.emulate(probe, "float8_e5m2"):
        probe(torch.randn(2, 4))
    assert torch.equal(seen[0], formats.float8_e5m2.quantize(probe.weight.detach()))
    assert not torch.equal(seen[0], probe.weight.detach())
    assert isinstance(probe.weight, nn.Parameter)


def test_underflow_is_counted_and_loss_scaling_rescues_it() -> None:
    model, x = mlp(), torch.randn(64, 8, generator=torch.Generator().manual_seed(3))
    with dls.emulate(model, "float16") as handle:
        (model(x).sum() * 1e-9).backward()  # gradient 1e-9 into the output: below float16's 2**-25
        assert handle.stats is not None
        assert handle.stats.underflow_fraction == 1.0
        assert handle.stats.flushed == handle.stats.nonzero == 64 * 3
        assert all(torch.count_nonzero(g) == 0 for g in grads(model))
        handle.stats.reset()
        assert handle.stats.as_dict()["nonzero"] == 0
        model.zero_grad()
        (model(x).sum() * 1e-9 * 2.0**24).backward()  # the same loss, scaled
        assert handle.stats.underflow_fraction < 0.01
        scaled = [g / 2.0**24 for g in grads(model)]
    reference = mlp()
    (reference(x).sum() * 1e-9).backward()
    for g, g_ref in zip(scaled, grads(reference), strict=True):
        torch.testing.assert_close(g, g_ref, rtol=2e-2, atol=1e-12)


def test_overflow_is_counted() -> None:
    model = nn.Linear(4, 4)
    with dls.emulate(model, "float16") as handle:
        (model(torch.randn(3, 4)).sum() * 1e6).backward()
        assert handle.stats is not None
        assert handle.stats.overflow_fraction == 1.0 and handle.stats.overflowed == 12
        assert handle.stats.elements == 12
    assert model.weight.grad is not None and not torch.isfinite(model.weight.grad).any()  # inf, or NaN from inf - inf


def test_remove_is_idempotent_and_restores_plain_float32() -> None:
    model = mlp()
    x = torch.randn(5, 8)
    plain = model(x)
    hook_counts = [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()]
    handle = dls.emulate(model, "cbfloat16")
    assert isinstance(handle, EmulationHandle) and handle.active
    assert "cbfloat16" in repr(handle) and "active" in repr(handle)
    assert len(handle.modules) == 3  # two Linear and the ReLU; Sequential has no parameters of its own
    assert not torch.equal(model(x), plain)
    handle.remove()
    handle.remove()
    assert not handle.active and "removed" in repr(handle)
    assert torch.equal(model(x), plain)
    assert [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()] == hook_counts
    with dls.emulate(model, F16) as h2:
        assert h2.active
    assert not h2.active and torch.equal(model(x), plain)


def test_exception_in_forward_puts_parameters_back() -> None:
    class Boom(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("boom")

    module = Boom(2, 2)
    weight = module.weight
    with dls.emulate(module, "cbfloat16"):
        with pytest.raises(RuntimeError, match="boom"):
            module(torch.ones(1, 2))
        assert module.weight is weight
    assert module.weight is weight and isinstance(module.weight, nn.Parameter)


def test_tuple_outputs_kwargs_and_integer_inputs() -> None:
    torch.manual_seed(0)
    gru = nn.GRU(4, 6, batch_first=True)
    x = torch.randn(2, 5, 4)
    with dls.emulate(gru, CB):
        y, h = gru(x)
    assert torch.equal(y, CB.quantize(y)) and torch.equal(h, CB.quantize(h))

    class Scaled(nn.Module):
        def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"y": x * scale}

    scaled = Scaled()
    x, s = torch.tensor([1.0 + 2**-12]), torch.tensor([3.0 + 2**-11])
    with dls.emulate(scaled, F16):
        result = scaled(x, scale=s)["y"]
    assert result.item() == F16.quantize(F16.quantize(x) * F16.quantize(s)).item()

    emb = nn.Embedding(10, 4)
    idx = torch.tensor([[1, 2], [3, 9]])
    with dls.emulate(emb, F16):
        e = emb(idx)
    assert torch.equal(e, F16.quantize(emb.weight.detach())[idx])


def test_shared_module_called_twice_accumulates_gradients() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    reference = copy.deepcopy(lin)
    x = torch.randn(3, 4) * 10
    with dls.emulate(lin, CB):
        lin(lin(x)).pow(2).sum().backward()
    inner = out(F.linear(ste(x, CB), ste(reference.weight, CB), ste(reference.bias, CB)), CB)
    outer = out(F.linear(ste(inner, CB), ste(reference.weight, CB), ste(reference.bias, CB)), CB)
    outer.pow(2).sum().backward()
    assert torch.equal(lin.weight.grad, reference.weight.grad)
    assert torch.equal(lin.bias.grad, reference.bias.grad)


def test_module_with_parameters_and_children_rounds_its_whole_subtree() -> None:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    rounded = copy.deepcopy(mha)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(CB.quantize(p))
    q = torch.randn(2, 3, 8)
    with dls.emulate(mha, CB):
        y, _ = mha(q, q, q)
    y_ref, _ = rounded(q, q, q)
    assert torch.equal(y, y_ref)  # out_proj.weight is read without calling out_proj; it is rounded all the same


def test_flags_select_what_is_rounded() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(4, 2)
    x = torch.randn(3, 4) * 7
    w, b = lin.weight.detach(), lin.bias.detach()
    with dls.emulate(lin, F16, round_weights=False):
        assert torch.equal(lin(x), F16.quantize(F.linear(F16.quantize(x), w, b)))
    with dls.emulate(lin, F16, round_inputs=False, round_outputs=False):
        assert torch.equal(lin(x), F.linear(x, F16.quantize(w), F16.quantize(b)))
    with dls.emulate(lin, F16, round_grads=False, track_stats=False) as handle:
        assert handle.stats is None
        (lin(x).sum() * 1e-12).backward()
    assert lin.weight.grad is not None and torch.count_nonzero(lin.weight.grad) > 0


def test_eval_and_no_grad() -> None:
    model = mlp()
    x = torch.randn(4, 8)
    with dls.emulate(model, CB) as handle, torch.no_grad():
        y = model(x)
    assert not y.requires_grad and torch.equal(y, CB.quantize(y))
    assert handle.stats is not None and handle.stats.elements == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"model": nn.Linear(2, 2), "fmt": "cbfloat32"}, r"fmt must be .*'cbfloat16'"),
        ({"model": nn.Linear(2, 2), "fmt": torch.float32}, r"fmt must be"),
        ({"model": "not a module", "fmt": "float16"}, "model must be a torch.nn.Module"),
        ({"model": nn.Linear(2, 2), "fmt": "float16", "round_grads": 1}, "round_grads must be True or False"),
    ],
)
def test_invalid_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        dls.emulate(**kwargs)


def test_fmt_by_name_dtype_and_registered_override() -> None:
    model = nn.Linear(2, 2)
    handle = dls.emulate(model, torch.bfloat16)
    assert handle.fmt is formats.bfloat16
    handle.remove()
    custom = FloatFormat(4, 5, name="e4m5")
    with dls.emulate(model, custom) as handle:
        assert handle.fmt is custom
    variant = FloatFormat(6, 9, subnormals=False, name="cbfloat16")
    formats.register(variant)
    try:
        with dls.emulate(model, "cbfloat16") as handle:
            assert handle.fmt is variant
    finally:
        formats.register(formats.cbfloat16)
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks


@pytest.mark.cuda
def test_cuda_matches_cpu() -> None:
    model = mlp()
    gpu = copy.deepcopy(model).cuda()
    x = torch.randn(16, 8)
    with dls.emulate(model, CB) as h_cpu, dls.emulate(gpu, CB) as h_gpu:
        y, y_gpu = model(x), gpu(x.cuda())
        (y.sum() * 1e-11).backward()
        (y_gpu.sum() * 1e-11).backward()
        assert h_cpu.stats is not None and h_gpu.stats is not None
        assert h_cpu.stats.as_dict() == h_gpu.stats.as_dict()
    torch.testing.assert_close(y_gpu.cpu(), y, rtol=1e-2, atol=1e-6)
    assert all(p.device.type == "cuda" and p.dtype == torch.float32 for p in gpu.parameters())
