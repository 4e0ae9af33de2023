"""GradScaler behaviour: skips, checkpoints, the torch.amp loop patterns, scale(), misuse and bad input."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import dls


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _loss(model: torch.nn.Module, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return model(torch.randn(4, 8, generator=g)).pow(2).mean()


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[list[torch.Tensor], dict]:
    return [p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict())


def _assert_same(a: tuple[list[torch.Tensor], dict], b: tuple[list[torch.Tensor], dict]) -> None:
    for p, q in zip(a[0], b[0]):
        assert torch.equal(p, q)
    assert a[1]["state"].keys() == b[1]["state"].keys()
    for k, v in a[1]["state"].items():
        for name, t in v.items():
            assert torch.equal(torch.as_tensor(t), torch.as_tensor(b[1]["state"][k][name])), (k, name)


OPTIMIZERS = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "adam-foreach": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
}


@pytest.mark.parametrize("sync_free", [False, True])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_skipped_step_leaves_params_and_optimizer_state_bit_identical(opt_name: str, bad: float, sync_free: bool):
    model = _model()
    opt = OPTIMIZERS[opt_name](list(model.parameters()))
    scaler = dls.GradScaler("dynamic", sync_free=sync_free)
    for i in range(3):  # real state first (moments, step counts, momentum)
        scaler.scale(_loss(model, i)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    before = _snapshot(model, opt)
    scale_before = scaler.get_scale()
    scaler.scale(_loss(model, 9)).backward()
    model[0].weight.grad[1, 1] = bad  # type: ignore[index]
    assert scaler.step(opt) is None or opt_name == "adamw-fused" or sync_free
    scaler.update()
    _assert_same(before, _snapshot(model, opt))
    assert scaler.get_scale() == scale_before / 2
    assert scaler.get_num_skipped_steps() == 1


def test_overflow_on_first_step_with_sync_free_leaves_fresh_optimizer_equivalent():
    model, ref = _model(), _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    scaler, ref_scaler = dls.GradScaler("dynamic", sync_free=True), dls.GradScaler("dynamic")
    for i in range(4):
        for m, o, s in ((model, opt, scaler), (ref, ref_opt, ref_scaler)):
            s.scale(_loss(m, i)).backward()
            if i == 0:
                m[0].weight.grad[0, 0] = float("nan")
            s.step(o)
            s.update()
            o.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_state_dict_round_trip_continues_bit_identically():
    def run(steps: int, model: torch.nn.Module, opt: torch.optim.Optimizer, scaler: dls.GradScaler, start: int):
        for i in range(start, start + steps):
            scaler.scale(_loss(model, i)).backward()
            if i % 7 == 3:
                model[2].weight.grad[0, 0] = float("inf")  # type: ignore[index]
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()

    make = lambda: dls.GradScaler("dynamic", init_scale=2.0**8, steps_per_increase=3, hysteresis=2)  # noqa: E731
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = make()
    run(20, model, opt, scaler, 0)
    saved = copy.deepcopy((model.state_dict(), opt.state_dict(), scaler.state_dict()))
    assert set(saved[2]) == {
        "loss_scale",
        "steps_since_rescale",
        "overflows_since_rescale",
        "num_skipped_steps",
        "hysteresis_hits",
        "scale",
        "_growth_tracker",
        "growth_factor",
        "backoff_factor",
        "growth_interval",
    }
    run(20, model, opt, scaler, 20)

    model2 = _model(seed=5)
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
    scaler2 = make()
    model2.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    scaler2.load_state_dict(saved[2])
    run(20, model2, opt2, scaler2, 20)
    assert scaler2.state_dict() == scaler.state_dict()
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)


def test_partial_state_dict_keeps_missing_values_and_bad_values_change_nothing():
    scaler = dls.GradScaler("dynamic", init_scale=64.0)
    scaler.load_state_dict({"num_skipped_steps": 7})
    assert scaler.get_scale() == 64.0 and scaler.get_num_skipped_steps() == 7
    before = scaler.state_dict()
    for bad in ({"loss_scale": -1.0}, {"loss_scale": 4.0, "steps_since_rescale": -2}, {"loss_scale": float("inf")}):
        with pytest.raises(ValueError, match="state_dict"):
            scaler.load_state_dict(bad)
        assert scaler.state_dict() == before
    with pytest.raises(ValueError, match="unknown keys"):
        scaler.load_state_dict({"loss_scale": 2.0, "bogus": 1})
    with pytest.raises(RuntimeError, match="empty"):
        scaler.load_state_dict({})
    assert scaler.state_dict() == before


def test_gradient_accumulation_matches_one_big_batch():
    model, ref = _model(), _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler = dls.GradScaler("dynamic", init_scale=2.0**10)
    for micro in range(2):
        scaler.scale(_loss(model, micro) / 2).backward()
    scaler.step(opt)
    scaler.update()
    ((_loss(ref, 0) + _loss(ref, 1)) / 2).backward()
    ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_two_models_two_optimizers_skip_independently_and_update_backs_off():
    m1, m2 = _model(1), _model(2)
    o1 = torch.optim.SGD(m1.parameters(), lr=0.1)
    o2 = torch.optim.SGD(m2.parameters(), lr=0.1)
    scaler = dls.GradScaler("dynamic", init_scale=2.0**10)
    before1 = [p.detach().clone() for p in m1.parameters()]
    before2 = [p.detach().clone() for p in m2.parameters()]
    scaler.scale(_loss(m1) + _loss(m2)).backward()
    m1[0].bias.grad[0] = float("inf")  # type: ignore[index]
    assert scaler.step(o1) is None
    scaler.step(o2)
    scaler.update()
    assert all(torch.equal(p, q) for p, q in zip(m1.parameters(), before1))
    assert not all(torch.equal(p, q) for p, q in zip(m2.parameters(), before2))
    assert scaler.get_scale() == 2.0**9
    assert scaler.get_num_skipped_steps() == 1  # one iteration, not one per optimizer


def test_torch_scaling_case_final_scale_and_control_run():
    # torch's test_grad_scaling_*: scale = 128 * 2**unskipped * 0.5**skipped with interval 1.
    def run(skip_iter: int | None, use_scaler: bool) -> tuple[list[torch.Tensor], float]:
        torch.manual_seed(3)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        scaler = dls.GradScaler("dynamic", init_scale=128.0, steps_per_increase=1, max_loss_scale=2.0**40)
        data = torch.Generator().manual_seed(4)
        for i in range(6):
            x, y = torch.randn(4, 8, generator=data), torch.randn(4, 8, generator=data)
            loss = torch.nn.functional.mse_loss(model(x), y)
            if use_scaler:
                scaler.scale(loss).backward()
                if i == skip_iter:
                    model[1].weight.grad.fill_(float("inf"))  # type: ignore[union-attr]
                scaler.step(opt)
                scaler.update()
            elif i != skip_iter:
                loss.backward()
                opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()], scaler.get_scale()

    params, scale = run(2, use_scaler=True)
    control, _ = run(2, use_scaler=False)
    assert scale == 128.0 * 2.0**5 * 0.5**1
    for p, q in zip(params, control):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_clipping_after_unscale_like_torch():
    model, ref = _model(), _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler = dls.GradScaler("dynamic", init_scale=2.0**12)
    scaler.scale(_loss(model)).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    scaler.step(opt)
    scaler.update()
    _loss(ref).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_gradient_penalty_with_create_graph():
    model, ref = _model(), _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler = dls.GradScaler("dynamic", init_scale=2.0**10)

    loss = _loss(model)
    scaled_grads = torch.autograd.grad(scaler.scale(loss), list(model.parameters()), create_graph=True)
    inv_scale = 1.0 / scaler.get_scale()
    penalty = sum(((g * inv_scale) ** 2).sum() for g in scaled_grads)
    scaler.scale(loss + penalty).backward()
    scaler.step(opt)
    scaler.update()

    ref_loss = _loss(ref)
    grads = torch.autograd.grad(ref_loss, list(ref.parameters()), create_graph=True)
    (ref_loss + sum((g**2).sum() for g in grads)).backward()
    ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_autocast_float16_training_on_cpu_reduces_loss():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = dls.GradScaler()
    losses = []
    for i in range(30):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _loss(model, i % 3)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert scaler.get_scale() == 2.0**15


def test_scale_nested_outputs_and_half_losses_in_float32():
    scaler = dls.GradScaler("dynamic", init_scale=2.0**15)
    half = torch.tensor(4.0, dtype=torch.float16)
    scaled = scaler.scale(half)
    assert scaled.dtype == torch.float32 and scaled.item() == 4.0 * 2**15  # float16 would give inf
    assert scaler.scale(torch.tensor(1.0, dtype=torch.float64)).dtype == torch.float64
    nested = scaler.scale([torch.tensor(1.0), (torch.tensor(2.0), torch.tensor(3.0))])
    assert isinstance(nested, list) and isinstance(nested[1], tuple)
    assert nested[1][1].item() == 3.0 * 2**15
    mapped = scaler.scale(t for t in [torch.tensor(1.0)])
    assert [t.item() for t in mapped] == [2.0**15]
    with pytest.raises(ValueError, match="outputs must be a Tensor"):
        scaler.scale(3.0)


def test_half_and_sparse_gradients_are_unscaled_in_float32():
    scaler = dls.GradScaler("dynamic", init_scale=2.0**31, max_loss_scale=2.0**31)
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))
    p.grad = torch.tensor([2.0**10, 3.0 * 2**8, 0.0], dtype=torch.float16)
    emb = torch.nn.Embedding(10, 2, sparse=True)
    opt = torch.optim.SGD([p], lr=1.0)
    sparse_opt = torch.optim.SGD(emb.parameters(), lr=1.0)
    scaler.scale(emb(torch.tensor([1, 1, 3])).sum()).backward()
    scaler.unscale_(opt)
    scaler.unscale_(sparse_opt)
    # 2**10 / 2**31 = 2**-21 is a float16 subnormal: rounding the factor to float16 first would give 0.
    assert p.grad.tolist() == [2.0**-21, 3.0 * 2**-23, 0.0]
    dense = emb.weight.grad.to_dense()  # type: ignore[union-attr]
    assert dense[1].tolist() == [2.0, 2.0] and dense[3].tolist() == [1.0, 1.0]
    scaler.step(opt)
    scaler.step(sparse_opt)
    scaler.update()
    assert scaler.get_num_skipped_steps() == 0


def test_static_mode_keeps_scale_and_still_skips():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = dls.GradScaler(loss_scale=256.0)
    for i in range(4):
        scaler.scale(_loss(model, i)).backward()
        if i == 1:
            model[0].bias.grad[0] = float("nan")  # type: ignore[index]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert scaler.mode == "static" and scaler.get_scale() == 256.0
    assert scaler.get_num_skipped_steps() == 1


def test_disabled_scaler_is_a_pass_through():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = dls.GradScaler(enabled=False)
    loss = _loss(model)
    assert scaler.scale(loss) is loss
    loss.backward()
    assert scaler.step(opt) is None
    scaler.update()
    assert not scaler.is_enabled() and scaler.get_scale() == 1.0 and scaler.state_dict() == {}


def test_defaults_follow_the_half_dtype():
    scaler = dls.GradScaler()
    assert scaler.mode == "dynamic" and scaler.get_scale() == 2.0**15
    dls.set_half_dtype("cbfloat16")
    assert dls.GradScaler().get_scale() == 2.0**31
    assert dls.GradScaler(max_loss_scale=2.0**20).get_scale() == 2.0**20
    dls.set_half_dtype("bfloat16")
    assert not dls.GradScaler().is_enabled()
    assert dls.GradScaler("dynamic").is_enabled()


def test_init_scale_above_the_default_max_raises_it_and_must_fit_explicit_bounds():
    raised = dls.GradScaler("dynamic", init_scale=2.0**20)
    assert raised.get_scale() == 2.0**20 and raised.settings.max_loss_scale == 2.0**20
    with pytest.raises(ValueError, match=r"init_scale .* must not exceed max_loss_scale"):
        dls.GradScaler("dynamic", init_scale=2.0**20, max_loss_scale=2.0**16)
    with pytest.raises(ValueError, match="init_scale"):
        dls.GradScaler("dynamic", init_scale=0.5, min_loss_scale=1.0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"loss_scale": "dynamc"}, "loss_scale"),
        ({"loss_scale": "cuda"}, "device such as 'cuda'"),
        ({"loss_scale": -1.0}, "loss_scale"),
        ({"loss_scale": 0}, "loss_scale"),
        ({"init_scale": -2.0}, "init_scale"),
        ({"min_loss_scale": 0.0}, "min_loss_scale"),
        ({"min_loss_scale": 4.0, "max_loss_scale": 2.0}, "min_loss_scale"),
        ({"max_loss_scale": -1.0}, "max_loss_scale"),
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"backoff_factor": 1.5}, "backoff_factor"),
        ({"overflow_tolerance": 1.0}, "overflow_tolerance"),
        ({"hysteresis": 0}, "hysteresis"),
        ({"steps_per_increase": 0}, "steps_per_increase"),
        ({"steps_per_increase": 5, "growth_interval": 5}, "growth_interval"),
        ({"max_gradient_norm": -1.0}, "max_gradient_norm"),
        ({"enabled": "yes"}, "enabled"),
        ({"loss_scale": 8.0, "init_scale": 4.0}, "init_scale"),
    ],
)
def test_invalid_arguments_name_the_argument(kwargs: dict, message: str):
    with pytest.raises(ValueError, match=message):
        dls.GradScaler(**kwargs)


def test_misuse_order_raises_like_torch():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = dls.GradScaler("dynamic")
    with pytest.raises(RuntimeError, match="No inf checks"):
        scaler.update()
    scaler.scale(_loss(model)).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="Closure"):
        scaler.step(opt, closure=lambda: 0.0)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="after step"):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.step(opt)
    with pytest.raises(ValueError, match="optimizer"):
        scaler.unscale_(model)  # type: ignore[arg-type]
    scaler.update()
    with pytest.raises(RuntimeError, match="needs the overflow flag"):
        scaler.step_if_finite(opt)


def test_update_with_new_scale():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = dls.GradScaler("dynamic")
    scaler.scale(_loss(model)).backward()
    scaler.step(opt)
    scaler.update(new_scale=8.0)
    assert scaler.get_scale() == 8.0
    scaler.update(torch.tensor([4.0]))
    assert scaler.get_scale() == 4.0
    for bad in (-1.0, float("nan"), torch.ones(2), torch.ones(1, requires_grad=True)):
        with pytest.raises(ValueError, match="new_scale"):
            scaler.update(bad)
    assert scaler.get_scale() == 4.0


def test_step_if_finite_and_clip_flag_across_optimizers():
    m1, m2 = _model(1), _model(2)
    o1 = torch.optim.SGD(m1.parameters(), lr=0.1)
    o2 = torch.optim.SGD(m2.parameters(), lr=0.1)
    scaler = dls.GradScaler("dynamic")
    before = [p.detach().clone() for p in m2.parameters()]
    scaler.scale(_loss(m1) + _loss(m2)).backward()
    m1[0].bias.grad[0] = float("inf")  # type: ignore[index]
    isfinite = scaler.clip_gradients_and_return_isfinite([o1, o2])
    assert isfinite.dtype == torch.bool and not bool(isfinite)
    assert scaler.step_if_finite(o2) is None  # the shared flag decides for both
    scaler.step(o1)
    scaler.update()
    assert all(torch.equal(p, q) for p, q in zip(m2.parameters(), before))


def test_global_norm_clipping_across_optimizers_matches_clip_grad_norm():
    m1, m2, r1, r2 = _model(1), _model(2), _model(1), _model(2)
    o1 = torch.optim.SGD(m1.parameters(), lr=0.1)
    o2 = torch.optim.SGD(m2.parameters(), lr=0.1)
    scaler = dls.GradScaler("dynamic", init_scale=2.0**14, max_gradient_norm=0.01)
    scaler.scale(_loss(m1) + _loss(m2)).backward()
    assert bool(scaler.clip_gradients_and_return_isfinite([o1, o2]))
    (_loss(r1) + _loss(r2)).backward()
    torch.nn.utils.clip_grad_norm_(list(r1.parameters()) + list(r2.parameters()), 0.01)
    for p, q in zip(list(m1.parameters()) + list(m2.parameters()), list(r1.parameters()) + list(r2.parameters())):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-9)


def test_step_clips_with_max_gradient_norm():
    model, ref = _model(), _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = dls.GradScaler("dynamic", max_gradient_norm=0.02)
    scaler.scale(_loss(model)).backward()
    scaler.step(opt)
    _loss(ref).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.02)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-9)


def test_pickle_between_iterations_only():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = dls.GradScaler("dynamic", init_scale=512.0)
    clone = pickle.loads(pickle.dumps(scaler))
    assert clone.get_scale() == 512.0
    scaler.scale(_loss(model)).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="pickled"):
        pickle.dumps(scaler)


def test_torch_style_aliases():
    scaler = dls.GradScaler(device="cpu", growth_interval=7)
    assert scaler.get_growth_interval() == 7
    scaler.set_growth_factor(4.0)
    assert scaler.get_growth_factor() == 4.0
    with pytest.raises(ValueError, match="backoff_factor"):
        scaler.set_backoff_factor(2.0)
    assert scaler.get_backoff_factor() == 0.5
