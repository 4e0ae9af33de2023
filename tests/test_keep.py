"""``dls.keep_in_float32``: listed modules compute in float32 inside autocast, under ``dls.emulate`` and
``dls.fp8.emulate_recipe``; half parameters are upcast on the fly and left untouched; ``remove()`` restores the
model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import dls
from _amplify import amplifying_model, batch
from dls.keep import is_kept


def float32_output(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` computed wholly in float32 on a float32 copy."""
    return copy.deepcopy(module).float()(x.float())


def test_a_kept_module_computes_in_float32_inside_autocast() -> None:
    model = amplifying_model()
    x = batch(0)[0]
    seen: dict[str, torch.Tensor] = {}
    for name in ("amplify", "head"):
        getattr(model, name).register_forward_hook(lambda _m, _a, out, name=name: seen.__setitem__(name, out))
    with torch.autocast("cpu", dtype=torch.float16):
        assert not torch.isfinite(model(x)).all()
        with dls.keep_in_float32(model, ["amplify"]) as handle:
            out = model(x)
            assert handle.names == ("amplify",)
            assert torch.isfinite(out).all()
            assert seen["amplify"].dtype == torch.float32  # left float32
            assert seen["head"].dtype == torch.float16  # the next autocast op casts down as usual
            assert torch.equal(seen["amplify"], float32_output(model.amplify, model.embed(x).half()))
            assert torch.is_autocast_enabled("cpu")  # only inside the kept call


def test_half_parameters_are_upcast_exactly_and_left_untouched() -> None:
    model = amplifying_model(affine_norm=False).half()
    params = {name: (p, p.detach().clone()) for name, p in model.named_parameters()}
    x = batch(0)[0].half()
    computed: list[torch.Tensor] = []  # the kept call's output as computed, before it is handed back
    model.amplify.register_forward_hook(lambda _m, _a, out: computed.append(out))
    with dls.keep_in_float32(model, [model.amplify]):
        h = model.embed(x)
        out, (inner,) = model.amplify(h), computed
        assert inner.dtype == torch.float32
        assert torch.equal(inner, float32_output(model.amplify, h))
        # Outside autocast it is handed back in the dtype its neighbours compute in (issue 38, S4).
        assert out.dtype == torch.float16 and torch.equal(out, inner.half())
        inner.sum().backward()
    for name, p in model.named_parameters():
        assert p is params[name][0] and p.dtype == torch.float16 and torch.equal(p, params[name][1])
    assert model.amplify.weight.grad is not None and model.amplify.weight.grad.dtype == torch.float16


def test_under_emulate_a_kept_module_and_its_descendants_are_not_rounded() -> None:
    model = nn.Sequential(amplifying_model(), nn.Linear(1, 1))
    x = batch(0)[0]
    inner = model[0]
    reference = float32_output(inner, x)
    plain_last = model[1](reference)
    with dls.emulate(model, "float16"):
        assert not torch.equal(model[1](reference), plain_last)  # the others are rounded
        with dls.keep_in_float32(model, ["0"]):
            seen = []
            inner.register_forward_hook(lambda _m, _a, out: seen.append(out))
            model(x)
            assert torch.equal(seen[0], reference)


def test_a_kept_linear_skips_fp8_casts() -> None:
    model = amplifying_model(gain=1.0)
    x = torch.randn(4, 32)
    reference = float32_output(model.head, torch.tanh(x))
    with dls.fp8.emulate_recipe(model, dls.fp8.CurrentScaling()):
        assert not torch.equal(model.head(torch.tanh(x)), reference)
        with dls.keep_in_float32(model, ["head"]):
            assert torch.equal(model.head(torch.tanh(x)), reference)


def test_remove_restores_the_model_exactly() -> None:
    model = amplifying_model(gain=1.0)
    x = batch(0)[0]
    with torch.autocast("cpu", dtype=torch.float16):
        before = model(x)
    classes = [type(m) for m in model.modules()]
    keys = list(model.state_dict())
    first = dls.keep_in_float32(model, ["amplify", "norm", ""])
    second = dls.keep_in_float32(model, ["amplify"])
    assert isinstance(model.amplify, nn.Linear) and list(model.state_dict()) == keys
    first.remove()
    assert type(model.amplify) is not nn.Linear  # still kept by the second handle
    assert type(model.norm) is nn.LayerNorm and type(model) is nn.Sequential
    second.remove()
    second.remove()
    assert [type(m) for m in model.modules()] == classes
    with torch.autocast("cpu", dtype=torch.float16):
        assert torch.equal(model(x), before)
    assert "removed" in repr(second)


def test_bad_modules_raise_before_anything_changes() -> None:
    model = amplifying_model()
    with pytest.raises(ValueError, match="'nowhere'"):
        dls.keep_in_float32(model, ["amplify", "nowhere"])
    assert type(model.amplify) is nn.Linear
    with pytest.raises(ValueError, match="not part of the model"):
        dls.keep_in_float32(model, [nn.Linear(1, 1)])
    with pytest.raises(ValueError, match="model must be"):
        dls.keep_in_float32("model", ["amplify"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="module names"):
        dls.keep_in_float32(model, [3])  # type: ignore[list-item]


# ---------------------------------------------------------------------- copies of a kept model (issue 30 B5)
def autocast_output(model: nn.Module, x: torch.Tensor) -> tuple[torch.dtype, torch.Tensor]:
    """The dtype ``model.amplify`` returns inside float16 autocast, and the model's output."""
    seen: list[torch.dtype] = []
    hook = model.amplify.register_forward_hook(lambda _m, _a, out: seen.append(out.dtype))
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    hook.remove()
    return seen[0], out


def run_in_child(model: nn.Module, x: torch.Tensor) -> tuple[str, bool]:
    """What a spawned process computes with the model it was sent (pickled by multiprocessing)."""
    dtype, out = autocast_output(model, x)
    return str(dtype), bool(torch.isfinite(out).all())


@pytest.mark.parametrize("how", ["torch.save", "deepcopy"])
def test_a_model_with_kept_modules_copies_whole_and_the_copy_is_kept(how: str) -> None:
    import io

    model = amplifying_model()
    handle = dls.keep_in_float32(model, ["amplify"])
    x = batch(0)[0]
    if how == "torch.save":
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        copied = torch.load(buffer, weights_only=False)  # a whole model: its classes are unpickled
    else:
        copied = copy.deepcopy(model)
    assert is_kept(copied.amplify) and isinstance(copied.amplify, nn.Linear)
    assert autocast_output(copied, x)[0] == torch.float32
    assert torch.equal(autocast_output(copied, x)[1], autocast_output(model, x)[1])
    handle.remove()  # the original's handle releases the original only
    assert type(model.amplify) is nn.Linear and is_kept(copied.amplify)
    dls.keep_in_float32(copied, ["amplify"]).remove()  # a copy is released by a handle of its own
    assert type(copied.amplify) is nn.Linear


def test_a_model_with_kept_modules_goes_to_a_spawned_process() -> None:
    import multiprocessing

    model = amplifying_model()
    dls.keep_in_float32(model, ["amplify"])
    x = batch(0)[0]
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        dtype, finite = pool.apply(run_in_child, (model, x))
    assert (dtype, finite) == ("torch.float32", True)
