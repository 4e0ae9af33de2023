"""Fused unscale + clip (issue 6, item 1): one read for the norm of the still-scaled gradients, one read+write
multiply by ``clip_coef / scale``, and the same numbers as ``unscale_`` followed by
``torch.nn.utils.clip_grad_norm_`` (rtol 1e-6 for float32 gradients; within one rounding of the exact result
for float16/bfloat16 gradients, where torch's own half-precision norm is the less exact of the two)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dls

SCALE = 2.0**12
HALF = {"float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPES = {"float32": torch.float32, **HALF}


def make_params(dtype: torch.dtype, sizes: tuple[int, ...] = (7, 33, 1, 256, 5), seed: int = 0) -> list[Any]:
    """Parameters with gradients ``N(0, 1) * SCALE`` (as a backward of a scaled loss leaves them)."""
    gen = torch.Generator().manual_seed(seed)
    params = []
    for i, n in enumerate(sizes):
        p = torch.nn.Parameter(torch.randn(n, generator=gen).to(dtype))
        p.grad = (torch.randn(n, generator=gen) * (i + 1) * SCALE).to(dtype)
        params.append(p)
    return params


def clone_params(params: list[Any]) -> list[Any]:
    out = []
    for p in params:
        q = torch.nn.Parameter(p.detach().clone())
        q.grad = p.grad.clone()
        out.append(q)
    return out


def grads(params: list[Any]) -> list[torch.Tensor]:
    return [p.grad for p in params]


def total_norm(params: list[Any], scale: float = SCALE) -> float:
    return float(torch.linalg.vector_norm(torch.cat([p.grad.double().flatten() for p in params])) / scale)


def exact_clip(params: list[Any], max_norm: float, scale: float = SCALE) -> list[torch.Tensor]:
    """The clipped unscaled gradients in float64, rounded once to the gradients' dtype."""
    norm = total_norm(params, scale)
    coef = min(1.0, max_norm / (norm + 1e-6))
    return [(p.grad.double() / scale * coef).to(p.grad.dtype) for p in params]


def scaler(**kwargs: Any) -> dls.GradScaler:
    return dls.GradScaler(init_scale=SCALE, **kwargs)


def assert_close_fp32(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-6, atol=0)


def assert_within_one_rounding(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for a, e in zip(actual, expected):
        eps = torch.finfo(a.dtype).eps
        torch.testing.assert_close(a.double(), e.double(), rtol=eps, atol=torch.finfo(a.dtype).tiny)


# ---------------------------------------------------------------------------------------------- float32
@pytest.mark.parametrize("max_norm", [1e-3, 5.0, 1e6], ids=["clips-hard", "clips", "no-clip"])
def test_fp32_equals_torch_unscale_then_clip_grad_norm(max_norm: float) -> None:
    ours = make_params(torch.float32)
    theirs = clone_params(ours)
    opt = torch.optim.SGD(ours, lr=0.1)
    torch_opt = torch.optim.SGD(theirs, lr=0.1)
    s = scaler(max_gradient_norm=max_norm)
    ok = s.clip_gradients_and_return_isfinite(opt)
    assert bool(ok)
    t = torch.amp.GradScaler("cpu", init_scale=SCALE)
    t.scale(torch.ones(()))
    t.unscale_(torch_opt)
    torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    assert_close_fp32(grads(ours), grads(theirs))


def test_step_with_max_gradient_norm_clips_like_torch() -> None:
    ours = make_params(torch.float32)
    theirs = clone_params(ours)
    opt = torch.optim.SGD(ours, lr=0.1, momentum=0.9)
    torch_opt = torch.optim.SGD(theirs, lr=0.1, momentum=0.9)
    s = scaler(max_gradient_norm=2.0)
    s.step(opt)
    s.update()
    t = torch.amp.GradScaler("cpu", init_scale=SCALE)
    t.scale(torch.ones(()))
    t.unscale_(torch_opt)
    torch.nn.utils.clip_grad_norm_(theirs, 2.0)
    t.step(torch_opt)
    assert_close_fp32(grads(ours), grads(theirs))
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------------- all dtypes
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("max_norm", [1e-2, 30.0, 1e6], ids=["clips-hard", "clips", "no-clip"])
def test_fused_equals_unfused_and_exact(dtype: str, max_norm: float) -> None:
    ours = make_params(DTYPES[dtype])
    unfused = clone_params(ours)
    expected = exact_clip(ours, max_norm)
    s = scaler(max_gradient_norm=max_norm)
    assert bool(s.clip_gradients_and_return_isfinite(torch.optim.SGD(ours, lr=0.1)))
    # The unfused path: unscale_ (dls's, which takes half gradients) then torch's clip.
    u = scaler()
    u.unscale_(torch.optim.SGD(unfused, lr=0.1))
    torch.nn.utils.clip_grad_norm_(unfused, max_norm)
    if dtype == "float32":
        assert_close_fp32(grads(ours), grads(unfused))
        assert_close_fp32(grads(ours), expected)
    else:
        # One rounding of the exact result; torch's unfused clip computes its norm in the half dtype itself.
        assert_within_one_rounding(grads(ours), expected)
        eps = torch.finfo(DTYPES[dtype]).eps
        for a, b in zip(grads(ours), grads(unfused)):
            torch.testing.assert_close(a.double(), b.double(), rtol=4 * eps, atol=torch.finfo(a.dtype).tiny)


def test_mixed_dtypes_share_one_global_norm() -> None:
    ours = make_params(torch.float32, sizes=(10, 20)) + make_params(torch.bfloat16, sizes=(30, 5), seed=1)
    ours += make_params(torch.float16, sizes=(17,), seed=2)
    expected = exact_clip(ours, 10.0)
    s = scaler(max_gradient_norm=10.0)
    assert bool(s.clip_gradients_and_return_isfinite(torch.optim.SGD(ours, lr=0.1)))
    for a, e in zip(grads(ours), expected):
        rtol = 1e-6 if a.dtype == torch.float32 else torch.finfo(a.dtype).eps
        torch.testing.assert_close(a.double(), e.double(), rtol=rtol, atol=1e-30)


# ---------------------------------------------------------------------------------------------- several optimizers
def test_several_optimizers_share_one_norm() -> None:
    first, second = make_params(torch.float32, seed=3), make_params(torch.float32, sizes=(50, 3), seed=4)
    expected = exact_clip(first + second, 4.0)
    opts = [torch.optim.SGD(first, lr=0.1), torch.optim.Adam(second, lr=0.1)]
    s = scaler(max_gradient_norm=4.0)
    assert bool(s.clip_gradients_and_return_isfinite(opts))
    assert_close_fp32(grads(first + second), expected)
    # Both are now unscaled and clipped: step() neither unscales nor clips again.
    before = [g.clone() for g in grads(first + second)]
    for opt in opts:
        s.step(opt)
    s.update()
    assert_close_fp32(grads(first + second), before)


def test_step_per_optimizer_clips_each_by_its_own_norm_and_says_so() -> None:
    # The contract: step(opt) clips [opt] when no clip call covered it; one global norm needs one call with all.
    first, second = make_params(torch.float32, seed=3), make_params(torch.float32, sizes=(50, 3), seed=4)
    expected = exact_clip(first, 4.0) + exact_clip(second, 4.0)
    opts = [torch.optim.SGD(first, lr=0.0), torch.optim.SGD(second, lr=0.0)]
    s = scaler(max_gradient_norm=4.0)
    s.step(opts[0])
    with pytest.warns(UserWarning, match="its own gradients"):
        s.step(opts[1])
    s.update()
    assert_close_fp32(grads(first + second), expected)


def test_one_clip_call_with_all_optimizers_shares_one_norm_without_warning() -> None:
    first, second = make_params(torch.float32, seed=3), make_params(torch.float32, sizes=(50, 3), seed=4)
    expected = exact_clip(first + second, 4.0)
    opts = [torch.optim.SGD(first, lr=0.0), torch.optim.SGD(second, lr=0.0)]
    s = scaler(max_gradient_norm=4.0)
    s.clip_gradients_and_return_isfinite(opts)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for opt in opts:
            s.step(opt)
    s.update()
    assert_close_fp32(grads(first + second), expected)


def test_already_unscaled_optimizer_mixed_with_a_ready_one() -> None:
    first, second = make_params(torch.float32, seed=5), make_params(torch.float16, sizes=(64, 9), seed=6)
    expected = exact_clip(first + second, 3.0)
    opt1, opt2 = torch.optim.SGD(first, lr=0.1), torch.optim.SGD(second, lr=0.1)
    s = scaler(max_gradient_norm=3.0)
    s.unscale_(opt1)  # opt1 READY -> UNSCALED before the clip; opt2 still holds scaled gradients
    assert bool(s.clip_gradients_and_return_isfinite([opt1, opt2]))
    assert_close_fp32(grads(first), expected[: len(first)])
    assert_within_one_rounding(grads(second), expected[len(first) :])


def test_overflow_in_one_optimizer_skips_all_and_backs_off() -> None:
    first, second = make_params(torch.float32, seed=7), make_params(torch.float32, seed=8)
    first_before = [p.detach().clone() for p in first]
    second[2].grad[0] = float("inf")
    opts = [torch.optim.SGD(first, lr=0.1), torch.optim.SGD(second, lr=0.1)]
    s = scaler(max_gradient_norm=1.0)
    s.unscale_(opts[1])  # the overflow was found by the unscale, the clip must still honour it
    assert not bool(s.clip_gradients_and_return_isfinite(opts))
    for opt in opts:
        assert s.step(opt) is None
    s.update()
    assert s.get_scale() == SCALE / 2
    assert s.get_num_skipped_steps() == 1
    for p, b in zip(first, first_before):
        assert torch.equal(p, b)


@pytest.mark.parametrize("name", ["Adam", "AdamW", "SGD"])
def test_clip_then_fused_optimizer_equals_clipped_plain_step(name: str) -> None:
    ours = make_params(torch.float32, seed=9)
    ref = clone_params(ours)
    expected = exact_clip(ours, 2.0)
    opt = getattr(torch.optim, name)(ours, lr=0.01, fused=True)
    ref_opt = getattr(torch.optim, name)(ref, lr=0.01, fused=True)
    s = scaler(max_gradient_norm=2.0)
    s.step(opt)  # clips (unscaling), then hands only found_inf to the fused kernel (grad_scale None)
    s.update()
    for p, e in zip(ref, expected):
        p.grad = e.clone()
    ref_opt.step()
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------------- passes
class PassCounter(TorchDispatchMode):
    """Records each aten op that reads or writes any of the watched gradient buffers, as ``(name, writes)``."""

    def __init__(self, watched: list[torch.Tensor]) -> None:
        super().__init__()
        self.watched = {t.data_ptr() for t in watched}
        self.ops: list[tuple[str, bool]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        flat = []
        for a in list(args) + list((kwargs or {}).values()):
            flat.extend(a if isinstance(a, (list, tuple)) else [a])
        if any(isinstance(t, torch.Tensor) and t.data_ptr() in self.watched for t in flat):
            self.ops.append((func.overloadpacket.__name__, func._schema.is_mutable))
        return func(*args, **(kwargs or {}))

    def passes(self) -> tuple[int, int]:
        """(read-only passes, read+write passes)."""
        writes = sum(w for _, w in self.ops)
        return len(self.ops) - writes, writes


def test_fused_clip_makes_one_read_and_one_read_write_pass() -> None:
    params = make_params(torch.float32) + make_params(torch.bfloat16, seed=1)
    s = scaler(max_gradient_norm=1.0)
    opt = torch.optim.SGD(params, lr=0.1)
    with PassCounter(grads(params)) as counter:
        s.clip_gradients_and_return_isfinite(opt)
    # Per (device, dtype) group, one op reads the gradients (the norm) and one rewrites them (the multiply by
    # clip_coef / scale); nothing else touches them. 2 groups here: float32 and bfloat16.
    assert counter.passes() == (2, 2), counter.ops


def test_torch_unfused_path_makes_more_passes() -> None:
    # The baseline the fusion saves against: unscale_ (read+write), norm (read), multiply (read+write).
    params = make_params(torch.float32)
    opt = torch.optim.SGD(params, lr=0.1)
    t = torch.amp.GradScaler("cpu", init_scale=SCALE)
    t.scale(torch.ones(()))
    with PassCounter(grads(params)) as counter:
        t.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
    assert counter.passes() == (1, 2), counter.ops
