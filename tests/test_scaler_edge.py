"""Adversarial edge cases for dls.GradScaler: torch.amp.GradScaler side by side where the behaviours overlap,
the documented contract (README, docstrings) elsewhere.

Each test pins a behaviour found by reading the code adversarially; the bugs it found are fixed.
"""

from __future__ import annotations

import collections
import copy
import pickle
import random
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

import dls

INF, NAN = float("inf"), float("nan")


# ---------------------------------------------------------------------- helpers
def _model(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2)).to(dtype)


def _batch(i: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(1000 + i)).to(dtype)


def _loss(model: torch.nn.Module, i: int = 0) -> torch.Tensor:
    x = _batch(i, next(model.parameters()).dtype)
    return model(x).float().pow(2).mean()


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _assert_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y), (x, y)


def _assert_opt_state_equal(o1: torch.optim.Optimizer, o2: torch.optim.Optimizer) -> None:
    s1, s2 = o1.state_dict()["state"], o2.state_dict()["state"]
    assert s1.keys() == s2.keys()
    for k in s1:
        assert s1[k].keys() == s2[k].keys()
        for name in s1[k]:
            assert torch.equal(torch.as_tensor(s1[k][name]), torch.as_tensor(s2[k][name])), (k, name)


def _torch_scaler(init_scale: float = 2.0**10, growth_interval: int = 2000) -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)


def _dls_scaler(init_scale: float = 2.0**10, steps: int = 2000, **kwargs: Any) -> dls.GradScaler:
    return dls.GradScaler("dynamic", init_scale=init_scale, steps_per_increase=steps, max_loss_scale=2.0**40, **kwargs)


def _side_by_side(
    body: Callable[[Any, torch.nn.Module, torch.optim.Optimizer, int], None],
    make_opt: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    iterations: int,
    init_scale: float = 2.0**10,
    interval: int = 2000,
) -> None:
    """Run ``body`` with a torch scaler and a dls scaler on identical models: same params, state and scales."""
    results = []
    for scaler in (_torch_scaler(init_scale, interval), _dls_scaler(init_scale, interval)):
        model = _model()
        opt = make_opt(list(model.parameters()))
        scales = []
        for i in range(iterations):
            body(scaler, model, opt, i)
            scales.append(scaler.get_scale())
        results.append((model, opt, scales))
    (m1, o1, s1), (m2, o2, s2) = results
    assert s1 == s2
    _assert_equal(_params(m1), _params(m2))
    _assert_opt_state_equal(o1, o2)


# ---------------------------------------------------------------------- parameters without gradients
def test_frozen_params_and_partial_grads_match_torch():
    """Some parameters never get a gradient (frozen branch): unscale/step skip them exactly as torch does."""

    def body(scaler: Any, model: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
        model[2].bias.requires_grad_(False)  # type: ignore[union-attr]
        scaler.scale(_loss(model, i)).backward()
        if i == 2:
            model[0].weight.grad[0, 0] = INF  # type: ignore[index]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    _side_by_side(body, lambda ps: torch.optim.Adam(ps, lr=1e-2), 5, interval=2)


def test_optimizer_with_no_grads_at_all_steps_and_update_counts_a_clean_iteration():
    """torch raises an AssertionError ("No inf checks were recorded for this optimizer") here; dls must not
    crash: nothing to unscale, nothing overflowed, the step is a no-op and update counts a clean step."""
    model, frozen = _model(0), _model(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    frozen_opt = torch.optim.SGD(frozen.parameters(), lr=0.1, momentum=0.9)
    scaler = _dls_scaler(init_scale=8.0, steps=2)
    before = _params(frozen)
    for i in range(2):
        scaler.scale(_loss(model, i)).backward()
        scaler.step(opt)
        assert scaler.step(frozen_opt) is None  # SGD.step returns None; it ran, nothing changed
        scaler.update()
        opt.zero_grad()
    _assert_equal(before, _params(frozen))
    assert frozen_opt.state_dict()["state"] == {}
    assert scaler.get_scale() == 16.0 and scaler.get_num_skipped_steps() == 0
    # An iteration in which only the grad-less optimizer took part is a clean iteration too.
    scaler.unscale_(frozen_opt)
    scaler.update()
    assert scaler.state_dict()["steps_since_rescale"] == 1


def test_zero_size_parameter_with_fused_and_foreach_optimizers():
    for make in (
        lambda ps: torch.optim.AdamW(ps, lr=0.1, fused=True),
        lambda ps: torch.optim.Adam(ps, lr=0.1, foreach=True),
        lambda ps: torch.optim.SGD(ps, lr=0.1),
    ):
        out = []
        for scaler in (_torch_scaler(), _dls_scaler()):
            empty, w = torch.nn.Parameter(torch.zeros(0, 3)), torch.nn.Parameter(torch.ones(3))
            opt = make([empty, w])
            for i in range(2):
                scaler.scale((w * (i + 2)).sum() + empty.sum()).backward()
                if i == 1:
                    w.grad[0] = NAN  # type: ignore[index]
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
            out.append((w.detach().clone(), scaler.get_scale()))
        assert torch.equal(out[0][0], out[1][0]) and out[0][1] == out[1][1]


# ---------------------------------------------------------------------- the per-optimizer parameter cache
def test_add_param_group_mid_training_is_unscaled_like_torch():
    def body(scaler: Any, model: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
        if i == 2:  # unfreeze the head: a new param group
            for p in model[2].parameters():  # type: ignore[union-attr]
                p.requires_grad_(True)
            opt.add_param_group({"params": list(model[2].parameters()), "lr": 0.05})  # type: ignore[union-attr]
        if i == 0:
            for p in model[2].parameters():  # type: ignore[union-attr]
                p.requires_grad_(False)
        scaler.scale(_loss(model, i)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    _side_by_side(body, lambda ps: torch.optim.SGD(ps[:2], lr=0.1, momentum=0.9), 5)


def test_param_group_replaced_by_same_length_list_is_noticed():
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([a], lr=1.0)
    scaler = _dls_scaler(init_scale=1024.0)
    scaler.scale(a.sum()).backward()
    scaler.step(opt)
    scaler.update()
    opt.param_groups[0]["params"] = [b]  # e.g. re-binding the optimizer to a reloaded model
    scaler.scale(b.sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert b.tolist() == [0.0, 0.0]  # 1 - lr * 1; the bug gives 1 - 1024


def test_model_moved_to_float64_mid_training_matches_torch():
    def body(scaler: Any, model: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
        if i == 2:
            model.double()  # same Parameter objects, new dtype
        scaler.scale(_loss(model, i)).backward()
        if i == 3:
            model[0].bias.grad[1] = NAN  # type: ignore[index]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    _side_by_side(body, lambda ps: torch.optim.SGD(ps, lr=0.1), 5, interval=1)


def test_model_moved_to_float16_mid_training_unscales_its_half_grads():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = _dls_scaler(init_scale=2.0**8)
    scaler.scale(_loss(model, 0)).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    model.half()
    ref = copy.deepcopy(model)
    _loss(ref, 1).backward()
    scaler.scale(_loss(model, 1)).backward()
    scaler.unscale_(opt)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.grad is not None and p.grad.dtype == torch.float16
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-3, atol=1e-4)
    scaler.step(opt)
    scaler.update()
    assert scaler.get_num_skipped_steps() == 0


# ---------------------------------------------------------------------- dtypes, sparse, odd losses
def _mixed_params() -> list[torch.nn.Parameter]:
    return [
        torch.nn.Parameter(torch.zeros(3, dtype=torch.float32)),
        torch.nn.Parameter(torch.zeros(3, dtype=torch.float16)),
        torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16)),
    ]


def _set_scaled_grads(params: list[torch.nn.Parameter], scale: float) -> list[torch.Tensor]:
    values = [[1.5, -0.25, 3.0], [0.5, 2.0, -1.0], [-4.0, 0.125, 1.0]]
    for p, v in zip(params, values):
        p.grad = (torch.tensor(v) * scale).to(p.dtype)
    return [torch.tensor(v) for v in values]


def test_mixed_dtype_grads_in_one_optimizer_unscale_exactly():
    params = _mixed_params()
    opt = torch.optim.SGD(params, lr=1.0)
    scaler = _dls_scaler(init_scale=2.0**12)
    expected = _set_scaled_grads(params, 2.0**12)
    scaler.unscale_(opt)
    for p, e in zip(params, expected):
        assert p.grad is not None and p.grad.dtype == p.dtype and p.grad.float().tolist() == e.tolist()
    scaler.step(opt)
    scaler.update()
    for p, e in zip(params, expected):
        assert p.float().tolist() == (-e).tolist()


def test_mixed_dtype_grads_clip_with_one_global_norm():
    params = _mixed_params()
    opt = torch.optim.SGD(params, lr=1.0)
    scaler = _dls_scaler(init_scale=2.0**12, max_gradient_norm=0.5)
    expected = _set_scaled_grads(params, 2.0**12)
    ref = [torch.nn.Parameter(torch.zeros(3)) for _ in expected]
    for r, e in zip(ref, expected):
        r.grad = e.clone()
    torch.nn.utils.clip_grad_norm_(ref, 0.5)
    assert bool(scaler.clip_gradients_and_return_isfinite(opt))
    for p, r in zip(params, ref):
        assert p.grad is not None
        tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[p.dtype]
        torch.testing.assert_close(p.grad.float(), r.grad, rtol=tol, atol=tol)


@pytest.mark.parametrize("where", [0, 1, 2])
def test_mixed_dtype_overflow_in_any_dtype_skips_the_whole_step(where: int):
    params = _mixed_params()
    opt = torch.optim.SGD(params, lr=1.0)
    scaler = _dls_scaler(init_scale=2.0**12)
    _set_scaled_grads(params, 2.0**12)
    params[where].grad[1] = INF  # type: ignore[index]
    assert scaler.step(opt) is None
    scaler.update()
    assert all(p.float().abs().sum().item() == 0 for p in params)
    assert scaler.get_scale() == 2.0**11


@pytest.mark.parametrize("opt_name", ["sgd", "sparse-adam"])
def test_sparse_fp32_grads_with_duplicate_indices_match_torch(opt_name: str):
    """dls coalesces sparse gradients (kernels.group_grads, documented); torch unscales fp32 ones uncoalesced, so
    SGD's sparse add_ sums duplicates in another order: equal to 1 ulp, not bitwise. SparseAdam coalesces itself."""
    make = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.5),
        "sparse-adam": lambda ps: torch.optim.SparseAdam(ps, lr=0.1),
    }[opt_name]
    out = []
    for scaler in (_torch_scaler(2.0**6, 1), _dls_scaler(2.0**6, 1)):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(6, 3, sparse=True)
        opt = make(list(emb.parameters()))
        for i in range(4):
            scaler.scale(emb(torch.tensor([1, 1, 4, 1, i])).pow(2).sum()).backward()
            if i == 2:
                emb.weight.grad._values()[0, 0] = INF  # type: ignore[union-attr]
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        out.append((emb.weight.detach().clone(), scaler.get_scale()))
    assert out[0][1] == out[1][1]
    if opt_name == "sgd":
        torch.testing.assert_close(out[0][0], out[1][0], rtol=1e-6, atol=0.0)
    else:
        assert torch.equal(out[0][0], out[1][0])


def test_sparse_fp16_grads_with_duplicate_indices_are_summed_before_the_check():
    emb = torch.nn.Embedding(5, 2, sparse=True).half()
    opt = torch.optim.SGD(emb.parameters(), lr=1.0)
    scaler = _dls_scaler(init_scale=2.0**14)
    scaler.scale(emb(torch.tensor([1, 1, 1, 2])).float().sum()).backward()
    assert not emb.weight.grad.is_coalesced()  # type: ignore[union-attr]
    scaler.unscale_(opt)
    dense = emb.weight.grad.to_dense()  # type: ignore[union-attr]
    assert dense[1].tolist() == [3.0, 3.0] and dense[2].tolist() == [1.0, 1.0]
    scaler.step(opt)
    scaler.update()
    assert scaler.get_num_skipped_steps() == 0
    opt.zero_grad()
    # 3 * 2**15 = 98304 > float16 max: each duplicate is finite, their sum is not (torch coalesces fp16 too).
    scaler.update(new_scale=2.0**15)
    before = emb.weight.detach().clone()
    scaler.scale(emb(torch.tensor([1, 1, 1])).float().sum()).backward()
    assert scaler.step(opt) is None
    scaler.update()
    assert torch.equal(emb.weight, before) and scaler.get_scale() == 2.0**14


def test_float64_loss_is_scaled_in_float64_and_trains_like_torch():
    scaler = _dls_scaler(init_scale=2.0**10)
    loss = torch.tensor(1.0 / 3.0, dtype=torch.float64)
    scaled = scaler.scale(loss)
    assert scaled.dtype == torch.float64 and scaled.item() == (1.0 / 3.0) * 2**10

    def body(scaler: Any, model: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
        scaler.scale(_loss(model, i).double()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    _side_by_side(body, lambda ps: torch.optim.SGD(ps, lr=0.1), 3)


def test_scale_containers_like_torch_and_named_tuples_keep_their_type():
    t, d = _torch_scaler(2.0**3), _dls_scaler(2.0**3)
    a, b = torch.tensor(1.0), torch.tensor([2.0, 3.0])
    for value in ([a, b], (a, b), [], (), [(a,), [b]]):
        ours, theirs = d.scale(value), t.scale(value)
        assert type(ours) is type(theirs)
        assert repr(ours) == repr(theirs)
    gen_ours, gen_theirs = d.scale(x for x in (a, b)), t.scale(x for x in (a, b))
    assert [x.tolist() for x in gen_ours] == [x.tolist() for x in gen_theirs]
    pair = collections.namedtuple("pair", "loss aux")
    scaled = d.scale(pair(a, [b]))
    assert isinstance(scaled, pair) and scaled.loss.item() == 8.0 and scaled.aux[0].tolist() == [16.0, 24.0]
    assert d.scale(torch.tensor(3, dtype=torch.int64)).item() == 24.0
    with pytest.raises(ValueError, match="outputs"):
        d.scale([a, "loss"])


# ---------------------------------------------------------------------- unusual call orders
def test_update_after_only_unscale_matches_torch():
    def body(scaler: Any, model: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
        scaler.scale(_loss(model, i)).backward()
        if i == 1:
            model[2].weight.grad[0, 0] = INF  # type: ignore[index]
        scaler.unscale_(opt)
        if i % 2 == 0:
            scaler.step(opt)
        scaler.update()  # no step on odd iterations
        opt.zero_grad()

    _side_by_side(body, lambda ps: torch.optim.Adam(ps, lr=1e-2), 6, interval=2)


def test_unscale_one_optimizer_step_another_matches_torch():
    out = []
    for scaler in (_torch_scaler(2.0**6, 1), _dls_scaler(2.0**6, 1)):
        m1, m2 = _model(1), _model(2)
        o1, o2 = torch.optim.SGD(m1.parameters(), lr=0.1), torch.optim.Adam(m2.parameters(), lr=0.01)
        for i in range(4):
            scaler.scale(_loss(m1, i) + _loss(m2, i)).backward()
            if i == 2:
                m1[0].bias.grad[0] = NAN  # type: ignore[index]
            scaler.unscale_(o1)  # o1 is only unscaled (its flag still counts), o2 only stepped
            scaler.step(o2)
            scaler.update()
            o1.zero_grad()
            o2.zero_grad()
        out.append((_params(m1) + _params(m2), scaler.get_scale()))
    _assert_equal(out[0][0], out[1][0])
    assert out[0][1] == out[1][1] == 2.0**6 * 2**3 / 2


def test_update_scale_uses_only_the_given_optimizers_flags_and_keeps_the_iteration_open():
    m1, m2 = _model(1), _model(2)
    o1, o2 = torch.optim.SGD(m1.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)
    scaler = _dls_scaler(init_scale=2.0**6, steps=1)
    scaler.scale(_loss(m1) + _loss(m2)).backward()
    m2[0].bias.grad[0] = INF  # type: ignore[index]
    scaler.step(o1)
    scaler.step(o2)
    scaler.update_scale(o1)  # o1 was clean: grows
    assert scaler.get_scale() == 2.0**7
    scaler.update_scale([o2])  # o2 overflowed: backs off
    assert scaler.get_scale() == 2.0**6
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.step(o1)  # still the same iteration
    with pytest.raises(RuntimeError, match="No inf checks"):
        scaler.update_scale(torch.optim.SGD(_model(3).parameters(), lr=0.1))
    with pytest.raises(ValueError, match="optimizers"):
        scaler.update_scale([])


class _ReturningOptimizer(torch.optim.SGD):
    @torch.no_grad()
    def step(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        super().step()
        return ("stepped", args, kwargs)


def test_step_forwards_args_and_returns_the_optimizer_value_like_torch():
    for scaler in (_torch_scaler(), _dls_scaler()):
        p = torch.nn.Parameter(torch.ones(2))
        opt = _ReturningOptimizer([p], lr=0.1)
        scaler.scale(p.sum()).backward()
        assert scaler.step(opt, 7, flag=True) == ("stepped", (7,), {"flag": True})
        scaler.update()
        opt.zero_grad()
        scaler.scale(p.sum() * INF).backward()
        assert scaler.step(opt, 7) is None
        scaler.update()


def _closure_step(scaler: Any) -> tuple[float, list[float]]:
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.5)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = p.sum()
        loss.backward()
        return loss

    return scaler.step(opt, closure=closure).item(), p.tolist()


def test_disabled_step_passes_a_closure_through_like_torch():
    ours = _closure_step(dls.GradScaler(enabled=False))
    assert ours == _closure_step(torch.amp.GradScaler("cpu", enabled=False)) == (2.0, [0.5, 0.5])


def test_lr_scheduler_follows_skipped_steps_like_torch():
    out = []
    for scaler in (_torch_scaler(2.0**4, 2), _dls_scaler(2.0**4, 2)):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        lrs = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(6):
                scaler.scale(_loss(model, i)).backward()
                if i in (0, 3):  # skipped first step: torch's scheduler warns about the order
                    model[0].weight.grad[0, 0] = INF  # type: ignore[index]
                scaler.step(opt)
                scaler.update()
                sched.step()
                opt.zero_grad()
                lrs.append(sched.get_last_lr()[0])
        messages = sorted(str(w.message)[:60] for w in caught if "lr_scheduler" in str(w.message))
        out.append((lrs, _params(model), scaler.get_scale(), messages))
    assert out[0][0] == out[1][0]
    _assert_equal(out[0][1], out[1][1])
    assert out[0][2] == out[1][2]
    assert out[0][3] == out[1][3]


def test_fused_optimizer_with_user_unscale_and_clip_matches_torch():
    def body(scaler: Any, model: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
        scaler.scale(_loss(model, i)).backward()
        if i == 1:
            model[0].weight.grad[2, 2] = INF  # type: ignore[index]
        if i % 2:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    _side_by_side(body, lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True), 5, interval=2)


def test_fused_adamw_with_float16_params_matches_torch():
    out = []
    for scaler in (_torch_scaler(), _dls_scaler()):
        model = _model(dtype=torch.float16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        for i in range(3):
            scaler.scale(_loss(model, i)).backward()
            if i == 1:
                model[0].weight.grad[0, 0] = INF  # type: ignore[index]
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        out.append((_params(model), scaler.get_scale()))
    _assert_equal(out[0][0], out[1][0])
    assert out[0][1] == out[1][1]


@pytest.mark.parametrize("with_norm", [False, True])
def test_non_contiguous_grads_are_unscaled_in_place_like_torch(with_norm: bool):
    grads = []
    for scaler in (_torch_scaler(2.0**5), _dls_scaler(2.0**5, max_gradient_norm=0.5 if with_norm else None)):
        a, b = torch.nn.Parameter(torch.zeros(3, 4)), torch.nn.Parameter(torch.zeros(4))
        base = torch.arange(24.0).reshape(4, 6) * 2.0**5
        a.grad, b.grad = base[:, :3].t(), base[:, 5]  # transposed and strided views of one buffer
        assert not a.grad.is_contiguous() and not b.grad.is_contiguous()
        opt = torch.optim.SGD([a, b], lr=1.0)
        scaler.scale(torch.tensor(1.0))  # torch creates its scale lazily here
        if isinstance(scaler, torch.amp.GradScaler):
            scaler.unscale_(opt)
            if with_norm:
                torch.nn.utils.clip_grad_norm_([a, b], 0.5)
        else:
            assert bool(scaler.clip_gradients_and_return_isfinite(opt))
        grads.append((a.grad, b.grad, base))
    for x, y in zip(grads[0], grads[1]):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=0.0)


def test_global_clip_over_one_user_unscaled_and_one_fresh_optimizer():
    m1, m2, r1, r2 = _model(1), _model(2), _model(1), _model(2)
    o1, o2 = torch.optim.SGD(m1.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)
    scaler = _dls_scaler(init_scale=2.0**9, max_gradient_norm=0.02)
    scaler.scale(_loss(m1) + _loss(m2)).backward()
    scaler.unscale_(o1)  # o1 unscaled by the user, o2 still scaled
    assert bool(scaler.clip_gradients_and_return_isfinite([o1, o2]))
    (_loss(r1) + _loss(r2)).backward()
    torch.nn.utils.clip_grad_norm_(list(r1.parameters()) + list(r2.parameters()), 0.02)
    for p, q in zip([*m1.parameters(), *m2.parameters()], [*r1.parameters(), *r2.parameters()]):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-10)
    # An overflow seen by the user's unscale_ is not forgotten by the later global clip.
    o1.zero_grad()
    o2.zero_grad()
    scaler.step(o1)
    scaler.step(o2)
    scaler.update()
    scaler.scale(_loss(m1) + _loss(m2)).backward()
    m1[0].bias.grad[0] = INF  # type: ignore[index]
    scaler.unscale_(o1)
    m1[0].bias.grad.zero_()  # type: ignore[union-attr]
    assert not bool(scaler.clip_gradients_and_return_isfinite([o1, o2]))


def test_optimizer_listed_twice_is_unscaled_once():
    m = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = _dls_scaler(init_scale=4.0)
    scaler.scale(m(torch.ones(1, 3)).sum()).backward()
    expected = [p.grad.clone() / 4 for p in m.parameters()]  # type: ignore[union-attr]
    assert bool(scaler.clip_gradients_and_return_isfinite([opt, opt]))
    _assert_equal([p.grad for p in m.parameters()], expected)  # type: ignore[misc]


# ---------------------------------------------------------------------- clipping
def test_max_gradient_norm_with_inf_grad_skips_without_nan_params_or_state():
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = _dls_scaler(init_scale=2.0**8, max_gradient_norm=1.0)
    scaler.scale(_loss(model, 0)).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    before, state = _params(model), copy.deepcopy(opt.state_dict())
    scaler.scale(_loss(model, 1)).backward()
    model[2].bias.grad[0] = INF  # type: ignore[index]
    assert scaler.step(opt) is None
    scaler.update()
    _assert_equal(before, _params(model))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert opt.state_dict()["state"][0]["step"] == state["state"][0]["step"]
    assert scaler.get_scale() == 2.0**7 and scaler.get_num_skipped_steps() == 1


def test_clip_with_all_zero_grads_keeps_zeros_and_steps():
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=0.1, weight_decay=0.5)
    scaler = _dls_scaler(init_scale=2.0**10, max_gradient_norm=1.0)
    scaler.scale(p.sum() * 0.0).backward()
    assert bool(scaler.clip_gradients_and_return_isfinite(opt))
    assert p.grad is not None and p.grad.tolist() == [0.0] * 4
    scaler.step(opt)
    scaler.update()
    assert torch.equal(p, 1.0 - 0.1 * (0.5 * torch.ones(4)))  # weight decay only: the step ran
    assert scaler.get_num_skipped_steps() == 0


def test_clip_gradients_called_twice_in_one_iteration_clips_like_clip_grad_norm_twice():
    model, ref = _model(), _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = _dls_scaler(init_scale=2.0**10, max_gradient_norm=0.01)
    scaler.scale(_loss(model)).backward()
    first = scaler.clip_gradients_and_return_isfinite(opt)
    second = scaler.clip_gradients_and_return_isfinite(opt)
    assert bool(first) and bool(second)
    _loss(ref).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-10)
    scaler.step(opt)  # no third clip, no second unscale
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-10)


@pytest.mark.parametrize("how", ["unscale_", "clip_gradients", "step"])
def test_max_gradient_norm_clips_exactly_once(how: str):
    """With max_gradient_norm, step clips once whatever ran before it: after a user unscale_ it still clips;
    after clip_gradients_and_return_isfinite it does not clip again (a second clip at a small max_norm moves the
    gradients by ~1e-6/max_norm relative, which the tolerance would catch)."""
    model, ref = _model(), _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = _dls_scaler(init_scale=2.0**10, max_gradient_norm=0.01)
    scaler.scale(_loss(model)).backward()
    if how == "unscale_":
        scaler.unscale_(opt)
    elif how == "clip_gradients":
        scaler.clip_gradients_and_return_isfinite(opt)
    scaler.step(opt)
    _loss(ref).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-7, atol=1e-12)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
    assert total.item() == pytest.approx(0.01, rel=1e-5)


# ---------------------------------------------------------------------- the scale rule through the scaler
def _clean_step(scaler: dls.GradScaler, p: torch.nn.Parameter, opt: torch.optim.Optimizer, overflow: bool) -> None:
    scaler.scale(p.sum() * (INF if overflow else 1.0)).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


def test_growth_at_max_scale_stays_at_max_and_resets_counters():
    p = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([p], lr=0.0)
    scaler = dls.GradScaler("dynamic", steps_per_increase=2)  # init = max = 2**15
    for i in range(5):
        _clean_step(scaler, p, opt, overflow=False)
        assert scaler.get_scale() == scaler.get_non_clamped_scale() == 2.0**15
        assert scaler.state_dict()["steps_since_rescale"] == (i + 1) % 2


def test_non_clamped_scale_at_the_floor_then_recovers():
    p = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([p], lr=0.0)
    scaler = dls.GradScaler("dynamic", init_scale=2.0, min_loss_scale=1.0, steps_per_increase=2)
    seen = []
    for overflow in (True, True, True, False, False, False, False):
        _clean_step(scaler, p, opt, overflow)
        seen.append((scaler.get_scale(), scaler.get_non_clamped_scale()))
    assert seen == [(1.0, 1.0), (1.0, 0.5), (1.0, 0.5), (1.0, 1.0), (2.0, 2.0), (2.0, 2.0), (4.0, 4.0)]
    assert scaler.get_num_skipped_steps() == 3


def _reference_rule(cfg: dict[str, Any], flags: list[bool], init: float) -> list[tuple[float, float, int, int, int]]:
    """The README's rule in plain Python."""
    scale, steps, overflows, hits, out = init, 0, 0, 0, []
    for f in flags:
        steps += 1
        overflows += int(f)
        non_clamped = scale
        if f and overflows / steps > cfg["overflow_tolerance"]:
            hits += 1
            if hits >= cfg["hysteresis"]:
                non_clamped, hits = scale * 0.5, 0
            steps = overflows = 0
        elif steps >= cfg["steps_per_increase"]:
            non_clamped, steps, overflows, hits = scale * 2.0, 0, 0, 0
        non_clamped = min(non_clamped, cfg["max_loss_scale"])
        scale = max(non_clamped, cfg["min_loss_scale"])
        out.append((scale, non_clamped, steps, overflows, hits))
    return out


@pytest.mark.parametrize(
    "cfg",
    [
        {"hysteresis": 2, "overflow_tolerance": 0.0, "steps_per_increase": 3},
        {"hysteresis": 1, "overflow_tolerance": 0.25, "steps_per_increase": 4},
        {"hysteresis": 3, "overflow_tolerance": 0.5, "steps_per_increase": 2},
        {"hysteresis": 2, "overflow_tolerance": 0.3, "steps_per_increase": 5},
        {"hysteresis": 1, "overflow_tolerance": 0.0, "steps_per_increase": 2},  # torch's kernel path, clamped
    ],
)
def test_hysteresis_and_tolerance_through_the_scaler_follow_the_readme_rule(cfg: dict[str, Any]):
    cfg = {**cfg, "min_loss_scale": 2.0**-2, "max_loss_scale": 2.0**6}
    rng = random.Random(str(cfg))
    flags = [rng.random() < 0.35 for _ in range(60)]
    expected = _reference_rule(cfg, flags, init=8.0)
    p = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([p], lr=0.0)
    scaler = dls.GradScaler("dynamic", init_scale=8.0, **cfg)
    for i, f in enumerate(flags):
        _clean_step(scaler, p, opt, f)
        sd = scaler.state_dict()
        got = (
            sd["loss_scale"],
            scaler.get_non_clamped_scale(),
            sd["steps_since_rescale"],
            sd["overflows_since_rescale"],
            sd["hysteresis_hits"],
        )
        assert got == expected[i], (i, flags[: i + 1])
    assert scaler.get_num_skipped_steps() == sum(flags)


def test_update_with_new_scale_then_continuing_matches_torch():
    def body(scaler: Any, model: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
        scaler.scale(_loss(model, i)).backward()
        if i == 5:
            model[0].weight.grad[0, 0] = INF  # type: ignore[index]
        scaler.step(opt)
        if i == 2:
            scaler.update(new_scale=48.0)
        elif i == 4:
            scaler.update(torch.tensor(3.0, dtype=torch.float64))
        else:
            scaler.update()
        opt.zero_grad()

    _side_by_side(body, lambda ps: torch.optim.SGD(ps, lr=0.1), 9, interval=3)


@pytest.mark.parametrize(
    "factors",
    [
        pytest.param((4.0, 0.25, 8.0, 0.125), id="powers-of-two"),
        pytest.param((1.7, 0.3, 1.1, 0.9), id="odd"),
    ],
)
def test_factors_and_setters_mid_training_match_torch(factors: tuple[float, float, float, float]):
    """Setters take effect at the next update (torch's _amp_update_scale_ reads them per call); update(new_scale)
    rounds like torch's fill_."""
    growth, backoff, growth2, backoff2 = factors
    out = []
    rng = random.Random(7)
    flags = [rng.random() < 0.3 for _ in range(40)]
    for scaler in (
        torch.amp.GradScaler("cpu", init_scale=1000.0, growth_factor=growth, backoff_factor=backoff, growth_interval=2),
        dls.GradScaler(
            "dynamic",
            init_scale=1000.0,
            growth_factor=growth,
            backoff_factor=backoff,
            growth_interval=2,
            min_loss_scale=2.0**-100,
            max_loss_scale=3e38,
        ),
    ):
        p = torch.nn.Parameter(torch.ones(1))
        opt = torch.optim.SGD([p], lr=0.0)
        scales = []
        for i, f in enumerate(flags):
            if i == 20:
                scaler.set_growth_factor(growth2)
                scaler.set_backoff_factor(backoff2)
                scaler.set_growth_interval(3)
            scaler.scale(p.sum() * (INF if f else 1.0)).backward()
            scaler.step(opt)
            if i == 30:
                scaler.update(new_scale=0.1)
            else:
                scaler.update()
            opt.zero_grad()
            scales.append(scaler.get_scale())
        out.append(scales)
    assert out[0] == out[1]


def test_scale_tensor_is_updated_in_place_by_update_new_scale_and_load():
    scaler = _dls_scaler(init_scale=2.0**4, steps=1)
    buf = scaler.get_scale_tensor()
    p = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([p], lr=0.0)
    _clean_step(scaler, p, opt, overflow=False)
    assert buf.item() == 2.0**5
    scaler.update(new_scale=3.0)
    assert buf.item() == 3.0
    scaler.load_state_dict({"loss_scale": 7.0})
    assert buf.item() == 7.0 and scaler.get_scale_tensor() is buf


# ---------------------------------------------------------------------- checkpoints
def test_torch_style_state_dict_with_tensor_values_loads():
    scaler = dls.GradScaler("dynamic", max_loss_scale=2.0**20)
    scaler.load_state_dict(
        {
            "scale": torch.tensor(2.0**11),
            "growth_factor": torch.tensor(4.0),
            "backoff_factor": 0.25,
            "growth_interval": torch.tensor(3),
            "_growth_tracker": torch.tensor(2, dtype=torch.int32),
        }
    )
    assert scaler.get_scale() == 2.0**11 and scaler.get_growth_factor() == 4.0
    assert scaler.get_backoff_factor() == 0.25 and scaler.get_growth_interval() == 3
    p = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([p], lr=0.0)
    _clean_step(scaler, p, opt, overflow=False)  # tracker 2 -> 3 == interval: grows by 4
    assert scaler.get_scale() == 2.0**13
    _clean_step(scaler, p, opt, overflow=True)
    assert scaler.get_scale() == 2.0**11
    dls_style = {k: torch.tensor(v) for k, v in scaler.state_dict().items()}
    other = dls.GradScaler("dynamic", max_loss_scale=2.0**20)
    other.load_state_dict(dls_style)
    assert other.state_dict() == scaler.state_dict()


def test_dls_state_dict_into_a_static_scaler_keeps_it_static():
    dynamic = _dls_scaler(init_scale=2.0**6, steps=1)
    p = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([p], lr=0.0)
    for f in (False, True, False):
        _clean_step(dynamic, p, opt, f)
    static = dls.GradScaler(loss_scale=128.0)
    static.load_state_dict(dynamic.state_dict())
    assert static.mode == "static" and static.get_scale() == dynamic.get_scale() == 2.0**7
    assert static.get_num_skipped_steps() == 1
    for f in (False, False, True, False):
        _clean_step(static, p, opt, f)
    assert static.get_scale() == 2.0**7  # never grows nor backs off
    assert static.get_num_skipped_steps() == 2
    again = dls.GradScaler(loss_scale=1.0)
    again.load_state_dict(static.state_dict())
    assert again.state_dict() == static.state_dict()


def test_loading_into_a_disabled_scaler_is_a_no_op_like_torch():
    sd = _dls_scaler(init_scale=2.0**3).state_dict()
    torch_sd = _torch_scaler().state_dict()
    for scaler in (dls.GradScaler(enabled=False), torch.amp.GradScaler("cpu", enabled=False)):
        for d in ({}, sd if isinstance(scaler, dls.GradScaler) else torch_sd):
            scaler.load_state_dict(d)
        assert scaler.get_scale() == 1.0 and scaler.state_dict() == {}
    dls.set_half_dtype("bfloat16")  # default scaler of bfloat16: mode off
    bf16_off = dls.GradScaler()
    bf16_off.load_state_dict(sd)
    assert bf16_off.mode == "off" and bf16_off.state_dict() == {}


def test_loaded_scale_respects_the_configured_bounds():
    scaler = dls.GradScaler("dynamic")  # max_loss_scale 2**15
    scaler.load_state_dict(torch.amp.GradScaler("cpu").state_dict())  # scale 2**16
    assert scaler.get_scale() <= 2.0**15
    low = dls.GradScaler("dynamic", min_loss_scale=1.0)
    low.load_state_dict({"loss_scale": 2.0**-10})
    assert low.get_scale() >= 1.0


@pytest.mark.parametrize("clone", ["pickle", "deepcopy"])
def test_copy_between_iterations_then_continue_identically(clone: str):
    def run(scaler: dls.GradScaler, model: torch.nn.Module, opt: torch.optim.Optimizer, start: int) -> list[dict]:
        states = []
        for i in range(start, start + 8):
            scaler.scale(_loss(model, i)).backward()
            if i % 3 == 1:
                model[0].weight.grad[0, 0] = INF  # type: ignore[index]
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            states.append(scaler.state_dict())
        return states

    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = _dls_scaler(2.0**8, 2, hysteresis=2, overflow_tolerance=0.2, max_gradient_norm=0.5)
    run(scaler, model, opt, 0)
    twin = pickle.loads(pickle.dumps(scaler)) if clone == "pickle" else copy.deepcopy(scaler)
    assert twin.get_scale_tensor() is not scaler.get_scale_tensor()
    model2 = copy.deepcopy(model)
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert run(scaler, model, opt, 8) == run(twin, model2, opt2, 8)
    _assert_equal(_params(model), _params(model2))
    assert repr(twin) == repr(scaler)


# ---------------------------------------------------------------------- enabled=False everywhere
def test_disabled_scaler_every_method_is_a_pass_through():
    model, ref = _model(), _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler = dls.GradScaler("dynamic", enabled=False, max_gradient_norm=0.01)
    loss = _loss(model)
    assert scaler.scale(loss) is loss and scaler.scale([loss])[0] is loss
    loss.backward()
    _loss(ref).backward()
    scaler.unscale_(opt)
    scaler.unscale_(opt)  # no stage tracking: no "already called" error
    _assert_equal([p.grad for p in model.parameters()], [p.grad for p in ref.parameters()])  # type: ignore[misc]
    isfinite = scaler.clip_gradients_and_return_isfinite(opt)  # clipping still applies
    assert isfinite.dtype == torch.bool and bool(isfinite)
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-10)
    scaler.update_scale(opt)
    assert scaler.step_if_finite(opt) is None  # steps (no "needs the overflow flag" error)
    ref_opt.step()
    scaler.step(opt)
    ref_opt.step()
    scaler.update()
    scaler.update(new_scale=4.0)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-8)
    assert scaler.get_scale() == scaler.get_non_clamped_scale() == 1.0
    assert scaler.get_num_skipped_steps() == 0 and scaler.state_dict() == {}
    assert not scaler.is_enabled() and scaler.mode == "off"
    # The flag still tells the truth about an overflow, but nothing is skipped when disabled.
    opt.zero_grad()
    scaler.scale(_loss(model) * INF).backward()
    assert not bool(scaler.clip_gradients_and_return_isfinite(opt))
    no_clip = dls.GradScaler(enabled=False)
    assert bool(no_clip.clip_gradients_and_return_isfinite(opt))  # no norm computed without max_gradient_norm
    pickle.loads(pickle.dumps(scaler))


@pytest.mark.parametrize("how", ["enabled=False", "bfloat16-off"])
def test_disabled_scaler_step_still_clips_with_max_gradient_norm(how: str):
    if how == "bfloat16-off":
        dls.set_half_dtype("bfloat16")
        scaler = dls.GradScaler(max_gradient_norm=0.01)
        assert scaler.mode == "off"
    else:
        scaler = dls.GradScaler("dynamic", enabled=False, max_gradient_norm=0.01)
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler.scale((p * 100.0).sum()).backward()
    scaler.step(opt)
    assert p.grad is not None and p.grad.norm().item() == pytest.approx(0.01, rel=1e-4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cpu_only_machine_with_device_cuda_and_enabled_false_constructs_like_torch():
    """``GradScaler("cuda", enabled=use_amp)`` is the usual torch idiom; dls takes the device by keyword."""
    assert not torch.amp.GradScaler("cuda", enabled=False).is_enabled()
    with pytest.warns(UserWarning, match="CUDA is not available"):
        assert not torch.amp.GradScaler("cuda").is_enabled()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_disabled_scaler_never_touches_an_unavailable_device():
    scaler = dls.GradScaler("cuda", enabled=False)
    assert not scaler.is_enabled() and scaler.get_scale() == 1.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_enabled_scaler_on_unavailable_cuda_warns_and_disables_like_torch():
    with pytest.warns(UserWarning, match="CUDA is not available"):
        scaler = dls.GradScaler("cuda")
    assert not scaler.is_enabled()


# ---------------------------------------------------------------------- sync_free restores
_SYNC_FREE_OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adamw-amsgrad": lambda ps: torch.optim.AdamW(ps, lr=0.01, amsgrad=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.01),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=0.01),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=0.01),
    "adadelta": lambda ps: torch.optim.Adadelta(ps, lr=0.5),
    "rmsprop-centered": lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5, centered=True),
    # State that does not start at zero: the first step must be decided on the host, not masked.
    "rprop": lambda ps: torch.optim.Rprop(ps, lr=0.01),  # step_size starts at lr
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=0.01),  # mu_product starts at 1
    "asgd": lambda ps: torch.optim.ASGD(ps, lr=0.01),  # eta starts at lr, mu at 1
    "sgd-dampening": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.5),  # buf starts at grad
}


def _first_step_overflow_run(make_opt: Callable[[Any], torch.optim.Optimizer], sync_free: bool) -> list[torch.Tensor]:
    model = _model()
    opt = make_opt(model.parameters())
    scaler = _dls_scaler(init_scale=2.0**10, sync_free=sync_free)
    for i in range(4):
        scaler.scale(_loss(model, i)).backward()
        if i in (0, 2):  # the very first step (no state yet), then a masked one
            model[0].weight.grad[0, 0] = NAN  # type: ignore[index]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return _params(model)


@pytest.mark.parametrize("name", sorted(_SYNC_FREE_OPTIMIZERS))
def test_sync_free_overflow_equals_a_skipped_step(name: str):
    make = _SYNC_FREE_OPTIMIZERS[name]
    _assert_equal(_first_step_overflow_run(make, True), _first_step_overflow_run(make, False))


def _late_branch_run(make_opt: Callable[[Any], torch.optim.Optimizer], sync_free: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    a, b = torch.nn.Linear(6, 1), torch.nn.Linear(6, 1)
    opt = make_opt([*a.parameters(), *b.parameters()])
    scaler = _dls_scaler(init_scale=2.0**10, sync_free=sync_free)
    for i in range(5):
        x = _batch(i)
        loss = a(x).pow(2).mean() + (b(x).pow(2).mean() if i >= 1 else 0.0)  # branch b unused at first
        scaler.scale(loss).backward()
        if i == 1:  # b's first gradient arrives in an overflowing step
            a.weight.grad[0, 0] = INF  # type: ignore[index]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in (*a.parameters(), *b.parameters())]


@pytest.mark.parametrize("name", ["rprop", "nadam", "sgd-dampening"])
def test_sync_free_parameter_whose_first_grad_arrives_in_an_overflowing_step(name: str):
    make = _SYNC_FREE_OPTIMIZERS[name]
    _assert_equal(_late_branch_run(make, True), _late_branch_run(make, False))


def test_sync_free_late_branch_with_zero_initialised_state_is_exact():
    make = _SYNC_FREE_OPTIMIZERS["adam"]
    _assert_equal(_late_branch_run(make, True), _late_branch_run(make, False))


class _IntStepSGD(torch.optim.Optimizer):
    """A custom optimizer keeping a Python int in its state, as many third-party optimizers do."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state[p]
                    state["step"] = state.get("step", 0) + 1
                    p.add_(p.grad, alpha=-group["lr"] / state["step"])


def test_sync_free_restores_non_tensor_optimizer_state():
    out = []
    for sync_free in (False, True):
        p = torch.nn.Parameter(torch.ones(2))
        opt = _IntStepSGD([p])
        scaler = _dls_scaler(sync_free=sync_free)
        for overflow in (False, True, False):
            scaler.scale(p.sum() * (INF if overflow else 1.0)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        out.append((opt.state[p]["step"], p.detach().clone()))
    assert out[0][0] == out[1][0] == 2
    assert torch.equal(out[0][1], out[1][1])
