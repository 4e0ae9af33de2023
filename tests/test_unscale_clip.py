"""``unscale_`` and ``clip_gradients_and_return_isfinite``: the passes over the gradients and the overflow decision.

Unscaling divides in float32 arithmetic whatever the gradients' dtype, in place. Clipping equals ``unscale_``
followed by ``torch.nn.utils.clip_grad_norm_`` (rtol 1e-6 for float32 gradients; within one rounding of the exact
result for float16/bfloat16 gradients, where torch's own half-precision norm is the less exact of the two), in one
read for the norm of the still-scaled gradients and one read+write multiply by ``clip_coef / scale``. A step is
skipped when a gradient, *as the optimizer would receive it*, is not finite: also when it is finite while scaled
and overflows once unscaled by a scale below 1, on every path (unfused, fused, clipped, sync-free).
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any

import pytest
import torch

import dls
from conftest import (
    INF,
    NAN,
    OpLog,
    assert_same,
    assert_tensors_equal,
    dls_scaler,
    inject,
    loss_of,
    side_by_side,
    snapshot,
    tiny_model,
    torch_scaler,
    train,
)
from dls import kernels

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


def exact_clip(params: list[Any], max_norm: float, scale: float = SCALE) -> list[torch.Tensor]:
    """The clipped unscaled gradients in float64, rounded once to the gradients' dtype."""
    norm = float(torch.linalg.vector_norm(torch.cat([p.grad.double().flatten() for p in params])) / scale)
    coef = min(1.0, max_norm / (norm + 1e-6))
    return [(p.grad.double() / scale * coef).to(p.grad.dtype) for p in params]


def scaler(**kwargs: Any) -> dls.GradScaler:
    return dls.GradScaler("dynamic", init_scale=SCALE, **kwargs)


def assert_close_fp32(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-6, atol=0)


def assert_within_one_rounding(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for a, e in zip(actual, expected):
        eps = torch.finfo(a.dtype).eps
        torch.testing.assert_close(a.double(), e.double(), rtol=eps, atol=torch.finfo(a.dtype).tiny)


def assert_grads_close(model: torch.nn.Module, ref: torch.nn.Module, rtol: float = 1e-6, atol: float = 1e-10) -> None:
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=rtol, atol=atol)


def mixed_params() -> tuple[list[torch.nn.Parameter], list[torch.Tensor]]:
    """A float32, a float16 and a bfloat16 parameter with gradients scaled by ``SCALE``, and the unscaled values."""
    values = [[1.5, -0.25, 3.0], [0.5, 2.0, -1.0], [-4.0, 0.125, 1.0]]
    params = [torch.nn.Parameter(torch.zeros(3, dtype=d)) for d in (torch.float32, torch.float16, torch.bfloat16)]
    for p, v in zip(params, values):
        p.grad = (torch.tensor(v) * SCALE).to(p.dtype)
    return params, [torch.tensor(v) for v in values]


# ---------------------------------------------------------------------------------------------- unscale_
def test_half_and_sparse_gradients_are_unscaled_in_float32() -> None:
    s = dls.GradScaler("dynamic", init_scale=2.0**31, max_loss_scale=2.0**31)
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))
    p.grad = torch.tensor([2.0**10, 3.0 * 2**8, 0.0], dtype=torch.float16)
    emb = torch.nn.Embedding(10, 2, sparse=True)
    opt = torch.optim.SGD([p], lr=1.0)
    sparse_opt = torch.optim.SGD(emb.parameters(), lr=1.0)
    s.scale(emb(torch.tensor([1, 1, 3])).sum()).backward()
    s.unscale_(opt)
    s.unscale_(sparse_opt)
    # 2**10 / 2**31 = 2**-21 is a float16 subnormal: rounding the factor to float16 first would give 0.
    assert p.grad.tolist() == [2.0**-21, 3.0 * 2**-23, 0.0]
    dense = emb.weight.grad.to_dense()  # type: ignore[union-attr]
    assert dense[1].tolist() == [2.0, 2.0] and dense[3].tolist() == [1.0, 1.0]
    s.step(opt)
    s.step(sparse_opt)
    s.update()
    assert s.get_num_skipped_steps() == 0


def test_mixed_dtype_grads_in_one_optimizer_unscale_exactly() -> None:
    params, expected = mixed_params()
    opt = torch.optim.SGD(params, lr=1.0)
    s = dls_scaler(init_scale=SCALE)
    s.unscale_(opt)
    for p, e in zip(params, expected):
        assert p.grad is not None and p.grad.dtype == p.dtype and p.grad.float().tolist() == e.tolist()
    s.step(opt)
    s.update()
    for p, e in zip(params, expected):
        assert p.float().tolist() == (-e).tolist()


@pytest.mark.parametrize("with_norm", [False, True])
def test_non_contiguous_grads_are_unscaled_in_place_like_torch(with_norm: bool) -> None:
    out = []
    for s in (torch_scaler(2.0**5), dls_scaler(2.0**5, max_gradient_norm=0.5 if with_norm else None)):
        a, b = torch.nn.Parameter(torch.zeros(3, 4)), torch.nn.Parameter(torch.zeros(4))
        base = torch.arange(24.0).reshape(4, 6) * 2.0**5
        a.grad, b.grad = base[:, :3].t(), base[:, 5]  # transposed and strided views of one buffer
        assert not a.grad.is_contiguous() and not b.grad.is_contiguous()
        opt = torch.optim.SGD([a, b], lr=1.0)
        s.scale(torch.tensor(1.0))  # torch creates its scale lazily here
        if isinstance(s, torch.amp.GradScaler):
            s.unscale_(opt)
            if with_norm:
                torch.nn.utils.clip_grad_norm_([a, b], 0.5)
        else:
            assert bool(s.clip_gradients_and_return_isfinite(opt))
        out.append((a.grad, b.grad, base))
    for x, y in zip(out[0], out[1]):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("opt_name", ["sgd", "sparse-adam"])
def test_sparse_fp32_grads_with_duplicate_indices_match_torch(opt_name: str) -> None:
    """dls coalesces sparse gradients (kernels.group_grads, documented); torch unscales fp32 ones uncoalesced, so
    SGD's sparse add_ sums duplicates in another order: equal to 1 ulp, not bitwise. SparseAdam coalesces itself."""
    make = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.5),
        "sparse-adam": lambda ps: torch.optim.SparseAdam(ps, lr=0.1),
    }[opt_name]
    out = []
    for s in (torch_scaler(2.0**6, 1), dls_scaler(2.0**6, 1)):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(6, 3, sparse=True)
        opt = make(list(emb.parameters()))
        for i in range(4):
            s.scale(emb(torch.tensor([1, 1, 4, 1, i])).pow(2).sum()).backward()
            if i == 2:
                emb.weight.grad._values()[0, 0] = INF  # type: ignore[union-attr]
            s.step(opt)
            s.update()
            opt.zero_grad()
        out.append((emb.weight.detach().clone(), s.get_scale()))
    assert out[0][1] == out[1][1]
    if opt_name == "sgd":
        torch.testing.assert_close(out[0][0], out[1][0], rtol=1e-6, atol=0.0)
    else:
        assert torch.equal(out[0][0], out[1][0])


def test_sparse_fp16_grads_with_duplicate_indices_are_summed_before_the_check() -> None:
    emb = torch.nn.Embedding(5, 2, sparse=True).half()
    opt = torch.optim.SGD(emb.parameters(), lr=1.0)
    s = dls_scaler(init_scale=2.0**14)
    s.scale(emb(torch.tensor([1, 1, 1, 2])).float().sum()).backward()
    assert not emb.weight.grad.is_coalesced()  # type: ignore[union-attr]
    s.unscale_(opt)
    dense = emb.weight.grad.to_dense()  # type: ignore[union-attr]
    assert dense[1].tolist() == [3.0, 3.0] and dense[2].tolist() == [1.0, 1.0]
    s.step(opt)
    s.update()
    assert s.get_num_skipped_steps() == 0
    opt.zero_grad()
    # 3 * 2**15 = 98304 > float16 max: each duplicate is finite, their sum is not (torch coalesces fp16 too).
    s.update(new_scale=2.0**15)
    before = emb.weight.detach().clone()
    s.scale(emb(torch.tensor([1, 1, 1])).float().sum()).backward()
    assert s.step(opt) is None
    s.update()
    assert torch.equal(emb.weight, before) and s.get_scale() == 2.0**14


def test_complex_parameters_are_unscaled_through_their_real_view() -> None:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))
    q = torch.nn.Parameter(p.detach().clone())
    opt, ref = torch.optim.Adam([p], lr=0.1), torch.optim.Adam([q], lr=0.1)
    s = dls.GradScaler("dynamic", init_scale=2.0**4)
    for i in range(3):
        s.scale((p.abs() ** 2).sum()).backward()
        (q.abs() ** 2).sum().backward()
        if i == 1:
            p.grad[0] = complex(math.inf, 0.0)  # type: ignore[index]
        s.step(opt)
        s.update()
        if i != 1:
            ref.step()
        opt.zero_grad()
        ref.zero_grad()
        assert s.step_was_skipped(opt) == (i == 1)
    assert torch.equal(p.detach(), q.detach())


def test_integer_gradients_are_a_clear_error() -> None:
    p = torch.zeros(2, dtype=torch.int64)
    p.grad = torch.zeros(2, dtype=torch.int64)  # what a buggy custom Function could leave behind
    with pytest.raises(ValueError, match="floating point or complex"):
        kernels.group_grads([p])


def test_optimizer_listed_twice_is_unscaled_once() -> None:
    m = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    s = dls_scaler(init_scale=4.0)
    s.scale(m(torch.ones(1, 3)).sum()).backward()
    expected = [p.grad.clone() / 4 for p in m.parameters()]  # type: ignore[union-attr]
    assert bool(s.clip_gradients_and_return_isfinite([opt, opt]))
    assert_tensors_equal([p.grad for p in m.parameters()], expected)


# ---------------------------------------------------------------------------------------------- the gradient cache
def test_add_param_group_mid_training_is_unscaled_like_torch() -> None:
    def body(s: Any, model: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
        if i == 2:  # unfreeze the head: a new param group
            for p in model[2].parameters():  # type: ignore[union-attr]
                p.requires_grad_(True)
            opt.add_param_group({"params": list(model[2].parameters()), "lr": 0.05})  # type: ignore[union-attr]
        if i == 0:
            for p in model[2].parameters():  # type: ignore[union-attr]
                p.requires_grad_(False)
        s.scale(loss_of(model, i)).backward()
        s.step(opt)
        s.update()
        opt.zero_grad()

    side_by_side(body, lambda ps: torch.optim.SGD(ps[:2], lr=0.1, momentum=0.9), 5)


def test_param_group_replaced_by_same_length_list_is_noticed() -> None:
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([a], lr=1.0)
    s = dls_scaler(init_scale=1024.0)
    s.scale(a.sum()).backward()
    s.step(opt)
    s.update()
    opt.param_groups[0]["params"] = [b]  # e.g. re-binding the optimizer to a reloaded model
    s.scale(b.sum()).backward()
    s.step(opt)
    s.update()
    assert b.tolist() == [0.0, 0.0]  # 1 - lr * 1; a stale cache would unscale nothing and give 1 - 1024


def test_model_moved_to_float64_mid_training_matches_torch() -> None:
    def body(s: Any, model: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
        if i == 2:
            model.double()  # same Parameter objects, new dtype
        s.scale(loss_of(model, i)).backward()
        if i == 3:
            inject(model, NAN, index=1)
        s.step(opt)
        s.update()
        opt.zero_grad()

    side_by_side(body, lambda ps: torch.optim.SGD(ps, lr=0.1), 5, interval=1)


def test_model_moved_to_float16_mid_training_unscales_its_half_grads() -> None:
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = dls_scaler(init_scale=2.0**8)
    s.scale(loss_of(model, 0)).backward()
    s.step(opt)
    s.update()
    opt.zero_grad()
    model.half()
    ref = copy.deepcopy(model)
    loss_of(ref, 1).backward()
    s.scale(loss_of(model, 1)).backward()
    s.unscale_(opt)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.grad is not None and p.grad.dtype == torch.float16
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-3, atol=1e-4)
    s.step(opt)
    s.update()
    assert s.get_num_skipped_steps() == 0


# ---------------------------------------------------------------------------------------------- clipping
@pytest.mark.parametrize("max_norm", [1e-3, 5.0, 1e6], ids=["clips-hard", "clips", "no-clip"])
def test_fp32_equals_torch_unscale_then_clip_grad_norm(max_norm: float) -> None:
    ours = make_params(torch.float32)
    theirs = clone_params(ours)
    opt = torch.optim.SGD(ours, lr=0.1)
    torch_opt = torch.optim.SGD(theirs, lr=0.1)
    assert bool(scaler(max_gradient_norm=max_norm).clip_gradients_and_return_isfinite(opt))
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


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("max_norm", [1e-2, 30.0, 1e6], ids=["clips-hard", "clips", "no-clip"])
def test_fused_clip_equals_unfused_and_exact(dtype: str, max_norm: float) -> None:
    ours = make_params(DTYPES[dtype])
    unfused = clone_params(ours)
    expected = exact_clip(ours, max_norm)
    assert bool(scaler(max_gradient_norm=max_norm).clip_gradients_and_return_isfinite(torch.optim.SGD(ours, lr=0.1)))
    # The unfused path: unscale_ (dls's, which takes half gradients) then torch's clip.
    scaler().unscale_(torch.optim.SGD(unfused, lr=0.1))
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
    assert bool(scaler(max_gradient_norm=10.0).clip_gradients_and_return_isfinite(torch.optim.SGD(ours, lr=0.1)))
    for a, e in zip(grads(ours), expected):
        rtol = 1e-6 if a.dtype == torch.float32 else torch.finfo(a.dtype).eps
        torch.testing.assert_close(a.double(), e.double(), rtol=rtol, atol=1e-30)


def test_several_optimizers_share_one_norm_and_step_does_not_clip_again() -> None:
    first, second = make_params(torch.float32, seed=3), make_params(torch.float32, sizes=(50, 3), seed=4)
    expected = exact_clip(first + second, 4.0)
    opts = [torch.optim.SGD(first, lr=0.1), torch.optim.Adam(second, lr=0.1)]
    s = scaler(max_gradient_norm=4.0)
    assert bool(s.clip_gradients_and_return_isfinite(opts))
    assert_close_fp32(grads(first + second), expected)
    before = [g.clone() for g in grads(first + second)]
    for opt in opts:
        s.step(opt)
    s.update()
    assert_close_fp32(grads(first + second), before)


@pytest.mark.parametrize("one_call", [False, True], ids=["step-each", "one-clip-call"])
def test_one_global_norm_over_several_optimizers_takes_one_clip_call(one_call: bool) -> None:
    """The contract: step(opt) clips [opt] by its own norm when no clip call covered it, and warns from the second
    optimizer on; one global norm over several optimizers needs one clip call with all of them, and then no
    warning."""
    first, second = make_params(torch.float32, seed=3), make_params(torch.float32, sizes=(50, 3), seed=4)
    expected = exact_clip(first + second, 4.0) if one_call else exact_clip(first, 4.0) + exact_clip(second, 4.0)
    opts = [torch.optim.SGD(first, lr=0.0), torch.optim.SGD(second, lr=0.0)]
    s = scaler(max_gradient_norm=4.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if one_call:
            s.clip_gradients_and_return_isfinite(opts)
        for opt in opts:
            s.step(opt)
    s.update()
    messages = [str(w.message) for w in caught]
    assert messages == [] if one_call else len(messages) == 1 and "its own gradients" in messages[0], messages
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


def test_user_clip_after_unscale_trains_like_unscaled_training() -> None:
    model, ref = tiny_model(), tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    s = dls.GradScaler("dynamic", init_scale=2.0**12)
    s.scale(loss_of(model)).backward()
    s.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    s.step(opt)
    s.update()
    loss_of(ref).backward()
    assert float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)) > 0.05  # the clip bites
    ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_clip_with_all_zero_grads_keeps_zeros_and_steps() -> None:
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=0.1, weight_decay=0.5)
    s = dls_scaler(init_scale=2.0**10, max_gradient_norm=1.0)
    s.scale(p.sum() * 0.0).backward()
    assert bool(s.clip_gradients_and_return_isfinite(opt))
    assert p.grad is not None and p.grad.tolist() == [0.0] * 4
    s.step(opt)
    s.update()
    assert torch.equal(p, 1.0 - 0.1 * (0.5 * torch.ones(4)))  # weight decay only: the step ran
    assert s.get_num_skipped_steps() == 0


def test_clip_gradients_called_twice_in_one_iteration_clips_like_clip_grad_norm_twice() -> None:
    model, ref = tiny_model(), tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = dls_scaler(init_scale=2.0**10, max_gradient_norm=0.01)
    s.scale(loss_of(model)).backward()
    assert bool(s.clip_gradients_and_return_isfinite(opt)) and bool(s.clip_gradients_and_return_isfinite(opt))
    loss_of(ref).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    assert_grads_close(model, ref)
    s.step(opt)  # no third clip, no second unscale
    assert_grads_close(model, ref)


@pytest.mark.parametrize("how", ["unscale_", "clip_gradients", "step"])
def test_max_gradient_norm_clips_exactly_once(how: str) -> None:
    """With max_gradient_norm, step clips once whatever ran before it: after a user unscale_ it still clips;
    after clip_gradients_and_return_isfinite it does not clip again (a second clip at a small max_norm moves the
    gradients by ~1e-6/max_norm relative, which the tolerance would catch)."""
    model, ref = tiny_model(), tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = dls_scaler(init_scale=2.0**10, max_gradient_norm=0.01)
    s.scale(loss_of(model)).backward()
    if how == "unscale_":
        s.unscale_(opt)
    elif how == "clip_gradients":
        s.clip_gradients_and_return_isfinite(opt)
    s.step(opt)
    loss_of(ref).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    assert_grads_close(model, ref, rtol=1e-7, atol=1e-12)
    total = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))
    assert total.item() == pytest.approx(0.01, rel=1e-5)


# ---------------------------------------------------------------------------------------------- passes
def test_fused_clip_makes_one_read_and_one_read_write_pass() -> None:
    params = make_params(torch.float32) + make_params(torch.bfloat16, seed=1)
    opt = torch.optim.SGD(params, lr=0.1)
    s = scaler(max_gradient_norm=1.0)
    with OpLog(grads(params)) as log:
        s.clip_gradients_and_return_isfinite(opt)
    # Per (device, dtype) group, one op reads the gradients (the norm) and one rewrites them (the multiply by
    # clip_coef / scale); nothing else touches them. 2 groups here: float32 and bfloat16.
    assert log.passes() == (2, 2), log.ops


def test_torch_unfused_path_makes_more_passes() -> None:
    # The baseline the fusion saves against: unscale_ (read+write), norm (read), multiply (read+write).
    params = make_params(torch.float32)
    opt = torch.optim.SGD(params, lr=0.1)
    t = torch.amp.GradScaler("cpu", init_scale=SCALE)
    t.scale(torch.ones(()))
    with OpLog(grads(params)) as log:
        t.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
    assert log.passes() == (1, 2), log.ops


def test_no_check_of_unscaled_values_while_the_scale_is_known_to_be_at_least_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The check after unscaling costs a pass only while the scale may be below 1."""
    calls: list[int] = []
    original = kernels.check_nonfinite

    def counting(grads: Any, found_inf: torch.Tensor) -> None:
        calls.append(len(grads))
        original(grads, found_inf)

    monkeypatch.setattr(kernels, "check_nonfinite", counting)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for init_scale, expected in ((2.0**10, 0), (0.5, 1)):
        s = dls.GradScaler("dynamic", init_scale=init_scale)
        calls.clear()
        s.scale(model(torch.ones(3, 4)).sum()).backward()
        s.step(opt)
        s.update()
        opt.zero_grad()
        assert len(calls) == expected


# ---------------------------------------------------------------------------------------------- the overflow decision
def test_overflow_in_one_optimizer_skips_all_and_backs_off() -> None:
    first, second = make_params(torch.float32, seed=7), make_params(torch.float32, seed=8)
    first_before = [p.detach().clone() for p in first]
    second[2].grad[0] = INF
    opts = [torch.optim.SGD(first, lr=0.1), torch.optim.SGD(second, lr=0.1)]
    s = scaler(max_gradient_norm=1.0)
    s.unscale_(opts[1])  # the overflow is found by the unscale ...
    second[2].grad.zero_()  # ... and only its recorded flag knows of it now: the clip must honour the flag
    assert not bool(s.clip_gradients_and_return_isfinite(opts))
    for opt in opts:
        assert s.step(opt) is None
    s.update()
    assert s.get_scale() == SCALE / 2
    assert s.get_num_skipped_steps() == 1
    assert_tensors_equal(first, first_before)


@pytest.mark.parametrize("where", [0, 1, 2], ids=["float32", "float16", "bfloat16"])
def test_overflow_in_any_dtype_of_an_optimizer_skips_its_whole_step(where: int) -> None:
    params, _ = mixed_params()
    opt = torch.optim.SGD(params, lr=1.0)
    s = dls_scaler(init_scale=SCALE)
    inject(params[where].grad, INF, index=1)  # type: ignore[arg-type]
    assert s.step(opt) is None
    s.update()
    assert all(p.float().abs().sum().item() == 0 for p in params)
    assert s.get_scale() == SCALE / 2


def test_max_gradient_norm_with_inf_grad_skips_without_nan_params_or_state() -> None:
    model = tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    s = dls_scaler(init_scale=2.0**8, max_gradient_norm=1.0)
    train(s, model, opt, range(1))
    before = snapshot(model, opt)
    s.scale(loss_of(model, 1)).backward()
    model[2].bias.grad[0] = INF  # type: ignore[index]
    assert s.step(opt) is None
    s.update()
    assert_same(before, snapshot(model, opt))  # the step count included
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert s.get_scale() == 2.0**7 and s.get_num_skipped_steps() == 1


LARGE_GRADIENT_OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.1),
    "adam-fused": lambda ps: torch.optim.Adam(ps, lr=0.1, fused=True),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=0.1, foreach=True),
}


def train_on_gradient(
    opt_name: str, dtype: torch.dtype, grad: float, steps: int = 25, **scaler_kwargs: Any
) -> tuple[torch.Tensor, dls.GradScaler, int]:
    """Train ``ones(4)`` on a loss whose gradient is ``grad`` per element; returns the parameter, the scaler and the
    number of steps taken (a skipped one must leave the parameter as it was). The factor is split in two so that the
    backward pass computes ``scale * 1e20 * (grad / 1e20)``: finite whenever the scaled gradient is."""
    p = torch.nn.Parameter(torch.ones(4, dtype=dtype))
    opt = LARGE_GRADIENT_OPTIMIZERS[opt_name]([p])
    s = dls.GradScaler("dynamic", **scaler_kwargs)
    taken = 0
    for _ in range(steps):
        before = p.detach().clone()
        s.scale((p.float() * (grad / 1e20)).sum() * 1e20).backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's fused kernels warn about fp16 params on CPU
            s.step(opt)
        s.update()
        opt.zero_grad()
        if not s.step_was_skipped(opt):
            taken += 1
        else:
            assert torch.equal(p.detach(), before)
    return p.detach(), s, taken


@pytest.mark.parametrize("sync_free", [False, True])
@pytest.mark.parametrize("opt_name", sorted(LARGE_GRADIENT_OPTIMIZERS))
def test_float16_gradient_that_overflows_only_when_unscaled_is_skipped(opt_name: str, sync_free: bool) -> None:
    # The true gradient 2e5 exceeds float16's 65504 at every scale: below a scale of ~0.33 the *scaled* gradient
    # fits float16, but the unscaled one does not, so no step may be taken and the weights stay finite.
    p, s, taken = train_on_gradient(opt_name, torch.float16, 2e5, sync_free=sync_free)
    assert torch.isfinite(p).all() and torch.equal(p, torch.ones(4, dtype=torch.float16))
    assert taken == 0 and s.get_num_skipped_steps() == 25
    assert s.get_scale() < 0.33  # the scaled gradient did fit float16 at the end


@pytest.mark.parametrize("opt_name", ["sgd", "adam", "adam-fused"])
def test_float32_gradient_beyond_float32_range_once_unscaled_is_skipped(opt_name: str) -> None:
    # Scaled by 2**-14 a gradient of 1e35 * 2**14 (beyond float32's 3.4e38) fits; unscaled it is inf.
    p, s, taken = train_on_gradient(opt_name, torch.float32, 1e35 * 2.0**14, steps=40, min_loss_scale=2.0**-14)
    assert torch.isfinite(p).all() and taken == 0
    assert s.get_scale() == 2.0**-14


@pytest.mark.parametrize("opt_name", sorted(LARGE_GRADIENT_OPTIMIZERS))
def test_clipping_keeps_a_large_float16_gradient_finite_and_trains(opt_name: str) -> None:
    # With clipping to 1.0 the gradient the optimizer receives is finite and small: the step is taken.
    p, _, taken = train_on_gradient(opt_name, torch.float16, 2e5, max_gradient_norm=1.0)
    assert torch.isfinite(p).all() and taken > 0 and not torch.equal(p, torch.ones(4, dtype=torch.float16))


def test_clipping_to_a_norm_beyond_float16_still_skips_what_overflows() -> None:
    # A clip limit above float16's range does not bound the float16 gradient: overflow after clipping is caught.
    p, _, taken = train_on_gradient("sgd", torch.float16, 2e5, max_gradient_norm=1e6)
    assert torch.isfinite(p).all() and taken == 0


@pytest.mark.parametrize("opt_name", ["sgd", "adam", "adam-fused"])
def test_the_same_large_gradient_trains_when_it_fits_after_unscaling(opt_name: str) -> None:
    # 3e4 fits float16 unscaled: once the scale has backed off below ~2, steps are taken and weights stay finite.
    p, _, taken = train_on_gradient(opt_name, torch.float16, 3e4, steps=30)
    assert torch.isfinite(p).all() and taken > 0


def test_explicit_unscale_then_step_skips_the_overflowing_unscale() -> None:
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    opt = torch.optim.SGD([p], lr=0.1)
    s = dls.GradScaler("dynamic", init_scale=0.25)
    s.scale((p.float() * 2e5).sum()).backward()
    assert torch.isfinite(p.grad).all()  # scaled: 5e4 fits float16
    s.unscale_(opt)
    assert s.step(opt) is None and torch.equal(p.detach(), torch.ones(4, dtype=torch.float16))
