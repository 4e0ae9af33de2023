"""Float32 master weights for half-precision parameters (``dls.master_weights``): small updates survive, the
torch clipping idiom clips what the step uses, skipped steps change nothing (host, fused and sync-free paths),
resuming is bit-identical, cbfloat16 parameters stay on their grid, DDP ranks stay identical, bad input is
rejected with nothing changed."""

from __future__ import annotations

import copy
import io
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dls
from conftest import from_dls, host_reads, launch_ranks, load_example
from dls.master_weights import MasterWeights, master_weights

HALF = [torch.float16, torch.bfloat16]
WORKER = Path(__file__).with_name("_master_dist_worker.py")


# ---------------------------------------------------------------------------------------------- helpers
def regression() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=gen)
    y = torch.tanh(x @ torch.randn(16, 1, generator=gen) / 4) + 0.5
    return x, y


def mlp(dtype: torch.dtype = torch.float32, seed: int = 1, device: torch.device | str = "cpu") -> torch.nn.Sequential:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    return model.to(device=device, dtype=dtype)


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    dtype = next(model.parameters()).dtype
    return torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y)


def loss_reduction(dtype: torch.dtype, masters: bool, clip: float | None = None, steps: int = 300) -> float:
    """The small-update task: plain SGD at lr 2e-5; float32 runs without a scaler, half ones with a dynamic one.
    With ``clip``: ``unscale_`` then ``clip_grad_norm_(model.parameters(), clip)`` (asserting that it bites)."""
    return _train_small_updates(dtype, masters, clip, steps)[0]


def masters_loss_reduction(dtype: torch.dtype, clip: float | None = None, steps: int = 300) -> float:
    """``loss_reduction`` with masters, the loss measured on a float32 model holding the masters."""
    return _train_small_updates(dtype, True, clip, steps)[1]


def _train_small_updates(dtype: torch.dtype, masters: bool, clip: float | None, steps: int) -> tuple[float, float]:
    x, y = regression()
    model = mlp(dtype)
    opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=2e-5)
    if masters:
        opt = master_weights(opt)
    as_float32 = mlp(torch.float32)

    def losses() -> tuple[float, float]:
        with torch.no_grad():
            if isinstance(opt, MasterWeights):
                for p, q in zip(as_float32.parameters(), model.parameters()):
                    p.copy_(opt.master_of(q))
            return loss_of(model, x, y).item(), loss_of(as_float32, x, y).item()

    scaler = dls.GradScaler(loss_scale="dynamic", init_scale=2.0**10, enabled=dtype != torch.float32)
    start = losses()
    bites = 0
    for _ in range(steps):
        scaler.scale(loss_of(model, x, y)).backward()
        if clip is not None:
            scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            bites += int(norm.item() > clip)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert all(p.dtype == dtype for p in model.parameters())
    assert scaler.get_num_skipped_steps() == 0
    if clip is not None:
        assert bites == steps, "the clip must bite on every step"
    end = losses()
    return start[0] - end[0], start[1] - end[1]


def snapshot(model: torch.nn.Module, opt: MasterWeights) -> dict[str, Any]:
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "masters": [opt.master_of(p).detach().clone() for p in model.parameters()],
        "state": copy.deepcopy({i: s for i, s in enumerate(opt.state.values())}),
    }


def assert_identical(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_identical(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for u, v in zip(a, b):
            assert_identical(u, v)
    else:
        assert a == b


def train(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    scaler: dls.GradScaler,
    steps: range,
    poison: tuple[int, ...] = (),
) -> None:
    """AdamW-style training on the regression task (on the model's device); the scaled gradients of the steps in
    ``poison`` overflow."""
    device = next(model.parameters()).device
    x, y = (t.to(device) for t in regression())
    for step in steps:
        rows = slice(32 * (step % 8), 32 * (step % 8) + 32)
        scaler.scale(loss_of(model, x[rows], y[rows])).backward()
        if step in poison:
            grad = model[0].weight.grad
            assert grad is not None
            grad.view(-1)[3] = float("inf")
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


# ---------------------------------------------------------------------------------------------- the small-update task
@pytest.fixture(scope="module")
def float32_reduction() -> dict[float | None, float]:
    return {clip: loss_reduction(torch.float32, masters=False, clip=clip) for clip in (None, 0.5)}


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_small_updates_reach_float32s_loss_with_masters_and_not_without(
    dtype: torch.dtype, float32_reduction: dict[float | None, float]
) -> None:
    reference = float32_reduction[None]
    assert reference > 0.02
    assert 0.9 <= loss_reduction(dtype, masters=True) / reference <= 1.1
    assert loss_reduction(dtype, masters=False) / reference < 0.5


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_the_unscale_then_clip_idiom_matches_float32_with_the_same_clipping(
    dtype: torch.dtype, float32_reduction: dict[float | None, float]
) -> None:
    reference = float32_reduction[0.5]
    assert 0.0 < reference < float32_reduction[None] / 2  # the clip slows float32 down: it bites
    assert 0.9 <= masters_loss_reduction(dtype, clip=0.5) / reference <= 1.1
    ratio = loss_reduction(dtype, masters=True, clip=0.5) / reference
    if dtype == torch.float16:
        assert 0.9 <= ratio <= 1.1
    else:
        # Clipped, the weights move by a few bfloat16 spacings in 300 steps: the model's loss, measured on the
        # masters rounded to bfloat16, lags the masters' own (measured 0.84 of float32's reduction).
        assert 0.75 <= ratio <= 1.1


def test_the_step_uses_the_gradients_the_user_clipped_on_the_model() -> None:
    model = mlp(torch.float16)
    opt = master_weights(torch.optim.SGD(model.parameters(), lr=1.0))
    scaler = dls.GradScaler(loss_scale="dynamic", init_scale=2.0**8)
    before = [opt.master_of(p).detach().clone() for p in model.parameters()]
    x, y = regression()
    scaler.scale(loss_of(model, x, y)).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    clipped = [p.grad.float() for p in model.parameters()]  # type: ignore[union-attr]
    scaler.step(opt)
    for p, old, g in zip(model.parameters(), before, clipped):
        assert torch.equal(opt.master_of(p), old - g)
    assert 0 < torch.linalg.vector_norm(torch.stack([g.norm() for g in clipped])) <= 1.01e-3


def test_without_user_changes_the_step_uses_the_exact_float32_unscaled_gradient() -> None:
    """Scaled float16 gradients of 2**-10 unscaled by 2**20 are 2**-30: zero in float16, exact in the masters.
    After an explicit unscale_ the model's gradients show them (flushed to zero) and the step still uses them."""
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    opt = master_weights(torch.optim.SGD([p], lr=2.0**20))
    scaler = dls.GradScaler(loss_scale="dynamic", init_scale=2.0**20, max_loss_scale=2.0**20)
    p.grad = torch.full((4,), 2.0**-10, dtype=torch.float16)
    scaler.unscale_(opt)
    assert torch.equal(p.grad, torch.zeros(4, dtype=torch.float16))  # what float16 can show
    scaler.step(opt)
    assert torch.equal(opt.master_of(p), torch.full((4,), 1.0 - 2.0**-10))
    assert torch.equal(p, torch.full((4,), 1.0 - 2.0**-10, dtype=torch.float16))


def test_an_unscaled_gradient_beyond_float16s_range_is_no_overflow_and_the_model_shows_it_saturated() -> None:
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))
    opt = master_weights(torch.optim.SGD([p], lr=1e-5))
    scaler = dls.GradScaler(loss_scale="dynamic", init_scale=2.0**-4, min_loss_scale=2.0**-8)
    p.grad = torch.tensor([12496.0, -1.0], dtype=torch.float16)  # unscaled: 199936
    scaler.unscale_(opt)
    assert p.grad.tolist() == [65504.0, -16.0]
    scaler.step(opt)
    assert not scaler.step_was_skipped(opt)
    expected = torch.zeros(2).add_(torch.tensor([199936.0, -16.0]), alpha=-1e-5)  # SGD's float32 update
    assert torch.equal(opt.master_of(p), expected)


def test_the_scalers_clipping_clips_the_float32_masters_and_shows_the_result_on_the_model() -> None:
    model = mlp(torch.bfloat16)
    opt = master_weights(torch.optim.SGD(model.parameters(), lr=1.0))
    scaler = dls.GradScaler(loss_scale="dynamic", init_scale=2.0**8)
    x, y = regression()
    scaler.scale(loss_of(model, x, y)).backward()
    isfinite, norm = scaler.clip_gradients_and_return_isfinite(opt, max_gradient_norm=1e-3, return_norm=True)
    assert bool(isfinite) and norm.item() > 1e-3
    masters = [opt.master_of(p) for p in model.parameters()]
    master_grads = [m.grad.clone() for m in masters]  # type: ignore[union-attr]
    total = torch.linalg.vector_norm(torch.stack([g.norm() for g in master_grads]))
    assert total.item() == pytest.approx(1e-3, rel=1e-4)
    for p, g in zip(model.parameters(), master_grads):
        assert torch.equal(p.grad, g.to(torch.bfloat16))  # type: ignore[arg-type]
    before = [m.detach().clone() for m in masters]
    scaler.step(opt)
    for m, old, g in zip(masters, before, master_grads):
        assert torch.equal(m, old - g)  # the float32 gradients, not their rounded copies


def test_without_a_scaler_step_takes_the_models_gradients_itself() -> None:
    model, reference = mlp(torch.float16), mlp(torch.float32)
    with torch.no_grad():
        for p, r in zip(model.parameters(), reference.parameters()):
            r.copy_(p)
    opt = master_weights(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    x, y = regression()
    for _ in range(3):
        loss_of(model, x, y).backward()
        for p, r in zip(model.parameters(), reference.parameters()):
            r.grad = p.grad.float()  # type: ignore[union-attr]
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        for p, r in zip(model.parameters(), reference.parameters()):
            assert torch.equal(opt.master_of(p), r)
            assert torch.equal(p, r.half())


# ---------------------------------------------------------------------------------------------- skipped steps
@pytest.mark.parametrize(
    "path",
    ["host", "sync_free", "fused", "clip"],
    ids=["host", "sync_free", "fused_adamw", "max_gradient_norm"],
)
def test_an_overflow_after_a_few_adamw_steps_changes_nothing(path: str, device: torch.device) -> None:
    model = mlp(torch.float16, device=device)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=path == "fused")
    opt = master_weights(inner)
    assert opt._step_supports_amp_scaling is (path == "fused")
    scaler = dls.GradScaler(
        loss_scale="dynamic", sync_free=path == "sync_free", max_gradient_norm=1.0 if path == "clip" else None
    )
    train(model, opt, scaler, range(3))
    before = snapshot(model, opt)
    train(model, opt, scaler, range(3, 4), poison=(3,))
    assert scaler.step_was_skipped(opt) and scaler.get_num_skipped_steps() == 1
    assert_identical(snapshot(model, opt), before)
    train(model, opt, scaler, range(4, 5))
    assert not scaler.step_was_skipped(opt)
    assert not torch.equal(model[0].weight, before["params"][0])


def test_fused_steps_with_masters_read_nothing_back_after_the_first(device: torch.device) -> None:
    model = mlp(torch.float16, device=device)
    opt = master_weights(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True))
    scaler = dls.GradScaler(loss_scale="dynamic")
    train(model, opt, scaler, range(1))
    with host_reads() as reads:
        train(model, opt, scaler, range(1, 4), poison=(2,))
    assert from_dls(reads) == []
    assert scaler.get_num_skipped_steps() == 1


# ---------------------------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("model_first", [True, False], ids=["model_then_optimizer", "optimizer_then_model"])
def test_resuming_from_a_checkpoint_is_bit_identical(model_first: bool, device: torch.device) -> None:
    def build(seed: int) -> tuple[torch.nn.Module, MasterWeights, dls.GradScaler]:
        model = mlp(torch.float16, seed=seed, device=device)
        opt = master_weights(torch.optim.AdamW(model.parameters(), lr=1e-3))
        return model, opt, dls.GradScaler(loss_scale="dynamic", steps_per_increase=3)

    model, opt, scaler = build(1)
    train(model, opt, scaler, range(6), poison=(2,))
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict()}, buffer)
    train(model, opt, scaler, range(6, 12), poison=(9,))

    buffer.seek(0)
    saved = torch.load(buffer)
    model2, opt2, scaler2 = build(2)  # different initial weights: everything must come from the checkpoint
    if model_first:
        model2.load_state_dict(saved["model"])
        opt2.load_state_dict(saved["opt"])
    else:
        opt2.load_state_dict(saved["opt"])
        model2.load_state_dict(saved["model"])
    scaler2.load_state_dict(saved["scaler"])
    train(model2, opt2, scaler2, range(6, 12), poison=(9,))
    assert_identical(snapshot(model2, opt2), snapshot(model, opt))
    assert scaler2.get_scale() == scaler.get_scale()


def test_state_dict_holds_the_masters_by_parameter_index() -> None:
    fp32 = torch.nn.Parameter(torch.ones(3))
    half = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    opt = master_weights(torch.optim.SGD([{"params": [fp32]}, {"params": [half]}], lr=0.1))
    state = opt.state_dict()
    assert list(state["master_weights"]) == [1]
    assert state["master_weights"][1] is opt.master_of(half)
    plain = torch.optim.SGD([{"params": [torch.ones(3)]}, {"params": [torch.ones(2)]}], lr=0.1)
    plain.load_state_dict(state)  # an ordinary optimizer ignores the masters


def test_an_ordinary_optimizers_state_dict_loads_with_masters_taken_from_the_model() -> None:
    model = mlp(torch.float16)
    plain = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, plain, dls.GradScaler(loss_scale="dynamic"), range(2))
    opt = master_weights(torch.optim.AdamW(model.parameters(), lr=1e-3))
    opt.load_state_dict(plain.state_dict())
    for p in model.parameters():
        assert torch.equal(opt.master_of(p), p.float())
        assert opt.state[opt.master_of(p)]["exp_avg"].dtype == torch.float32


def test_a_model_changed_from_outside_is_taken_into_the_masters() -> None:
    model = mlp(torch.float16)
    opt = master_weights(torch.optim.SGD(model.parameters(), lr=1e-3))
    train(model, opt, dls.GradScaler(loss_scale="dynamic"), range(3))
    masters = [opt.master_of(p).detach().clone() for p in model.parameters()]
    model.load_state_dict(model.state_dict())  # the same (rounded) values: masters keep their precision
    opt.step()
    assert_identical([opt.master_of(p) for p in model.parameters()], masters)
    assert any(not torch.equal(m, m.half().float()) for m in masters)
    fresh = mlp(torch.float16, seed=5)
    model.load_state_dict(fresh.state_dict())  # new values: the masters follow them
    opt.step()  # no gradients: nothing moves
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(opt.master_of(p), q.float())
        assert torch.equal(p, q)


# ---------------------------------------------------------------------------------------------- formats and groups
def test_cbfloat16_parameters_stay_float32_on_the_cbfloat16_grid() -> None:
    fmt = dls.formats.get("cbfloat16")
    model = mlp(torch.float32)
    opt = master_weights(torch.optim.SGD(model.parameters(), lr=2e-5), fmt="cbfloat16")
    assert opt.fmt is fmt
    for p in model.parameters():
        assert p.dtype == torch.float32 and torch.equal(p, fmt.quantize(p))
    x, y = regression()
    with torch.no_grad():
        start = loss_of(model, x, y).item()
    scaler = dls.GradScaler(loss_scale="dynamic", half_dtype="cbfloat16")
    for _ in range(50):
        scaler.scale(loss_of(model, x, y)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    with torch.no_grad():
        assert loss_of(model, x, y).item() < start
    masters = [opt.master_of(p) for p in model.parameters()]
    for p, m in zip(model.parameters(), masters):
        assert p.dtype == torch.float32 and torch.equal(p, fmt.quantize(m))
    assert any(not torch.equal(p, m) for p, m in zip(model.parameters(), masters))


def test_mixed_groups_float32_passes_through_and_param_groups_are_the_inner_ones() -> None:
    a = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    b = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    c = torch.nn.Parameter(torch.ones(3))
    inner = torch.optim.SGD([{"params": [a, c]}, {"params": [b], "lr": 0.5}], lr=0.1)
    opt = master_weights(inner)
    assert opt.param_groups is inner.param_groups and opt.state is inner.state
    assert opt.optimizer is inner
    assert opt.master_of(c) is c and inner.param_groups[0]["params"][1] is c
    assert opt.master_of(a).dtype == opt.master_of(b).dtype == torch.float32
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    for p in (a, b, c):
        p.grad = torch.ones_like(p)
    opt.step()
    scheduler.step()
    assert inner.param_groups[0]["lr"] == 0.05 and inner.param_groups[1]["lr"] == 0.25
    for p in (a, b, c):
        p.grad = torch.ones_like(p)
    opt.step()
    one = torch.ones(3)
    assert torch.equal(opt.master_of(a), one.add(one, alpha=-0.1).add_(one, alpha=-0.05))  # SGD in float32
    assert torch.equal(opt.master_of(b), one.add(one, alpha=-0.5).add_(one, alpha=-0.25))
    assert torch.equal(c, opt.master_of(a))
    assert a.dtype == torch.float16 and torch.equal(a, opt.master_of(a).half())
    assert "2 float16" not in repr(opt) and "1 float16, 1 bfloat16" in repr(opt) and "passing through: 1" in repr(opt)


def test_zero_grad_resets_model_and_master_gradients() -> None:
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    opt = master_weights(torch.optim.SGD([p], lr=0.1))
    scaler = dls.GradScaler(loss_scale="dynamic")
    p.grad = torch.ones(3, dtype=torch.float16)
    scaler.step(opt)
    scaler.update()
    master = opt.master_of(p)
    assert master.grad is not None
    opt.zero_grad(set_to_none=False)
    assert torch.equal(p.grad, torch.zeros(3, dtype=torch.float16)) and torch.equal(master.grad, torch.zeros(3))
    opt.zero_grad()
    assert p.grad is None and master.grad is None


def test_add_param_group_gives_new_half_parameters_masters() -> None:
    a = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    b = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    opt = master_weights(torch.optim.SGD([a], lr=0.1))
    opt.add_param_group({"params": b, "lr": 2.0**-12})
    assert opt.master_of(b) is opt.param_groups[1]["params"][0]
    for _ in range(4):  # each update is below half of float16's spacing at 1: only the master takes it
        b.grad = torch.ones(2, dtype=torch.float16)
        opt.step()
    assert torch.equal(opt.master_of(b), torch.full((2,), 1 - 2.0**-10))
    assert torch.equal(b, torch.full((2,), 1 - 2.0**-10, dtype=torch.float16))
    with pytest.raises(ValueError, match="already in this optimizer"):
        opt.add_param_group({"params": [a]})
    assert len(opt.param_groups) == 2


def test_a_closure_sees_the_written_back_parameters() -> None:
    model = mlp(torch.float16)
    opt = master_weights(torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=5))
    x, y = regression()

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = loss_of(model, x, y)
        loss.backward()
        return loss

    with torch.no_grad():
        start = loss_of(model, x, y).item()
    opt.step(closure)
    with torch.no_grad():
        assert loss_of(model, x, y).item() < start
    for p in model.parameters():
        assert p.dtype == torch.float16 and torch.equal(p, opt.master_of(p).half())


# ---------------------------------------------------------------------------------------------- bad input
def test_bad_input_raises_value_error_naming_the_argument_and_changes_nothing() -> None:
    p = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"optimizer must be a torch\.optim\.Optimizer"):
        master_weights([p])  # type: ignore[arg-type]
    with pytest.warns(UserWarning, match="duplicate parameters"):
        twice = torch.optim.SGD([p, p], lr=0.1)  # torch only warns
    with pytest.raises(ValueError, match="optimizer lists a parameter more than once"):
        master_weights(twice)
    assert twice.param_groups[0]["params"] == [p, p]
    inner = torch.optim.SGD([p], lr=0.1)
    with pytest.raises(ValueError, match="fmt must be None"):
        master_weights(inner, fmt="float24")
    assert inner.param_groups[0]["params"][0] is p
    opt = master_weights(inner)
    with pytest.raises(ValueError, match="already wrapped"):
        master_weights(inner)
    with pytest.raises(ValueError, match="already wrapped"):
        master_weights(opt)
    stepped = torch.optim.Adam([torch.nn.Parameter(torch.ones(2, dtype=torch.float16))])
    stepped.param_groups[0]["params"][0].grad = torch.ones(2, dtype=torch.float16)
    stepped.step()
    with pytest.raises(ValueError, match="already has state"):
        master_weights(stepped)
    before = copy.deepcopy(opt.state_dict())
    bad = copy.deepcopy(before)
    bad["master_weights"] = {0: torch.zeros(5)}
    with pytest.raises(ValueError, match=r"master_weights'\]\[0\] must be a tensor of shape \(2,\)"):
        opt.load_state_dict(bad)
    bad["master_weights"] = {1: torch.zeros(2)}
    with pytest.raises(ValueError, match="holds masters for parameters"):
        opt.load_state_dict(bad)
    assert_identical(opt.state_dict(), before)
    with pytest.raises(ValueError, match="param is not a parameter"):
        opt.master_of(torch.ones(2))


# ---------------------------------------------------------------------------------------------- DDP (gloo, 2 ranks)
@pytest.fixture(scope="module")
def ddp_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return launch_ranks(WORKER, [], tmp_path_factory.mktemp("master_ddp"), 2, timeout=120)


@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed+gloo")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_ddp_reduces_half_gradients_and_every_rank_steps_identical_masters(
    ddp_ranks: list[dict[str, Any]], dtype: str
) -> None:
    r0, r1 = (r[dtype] for r in ddp_ranks)
    assert r0["grad_dtypes"] == [dtype] and r0["param_dtypes"] == [dtype]
    assert r0["reduced_in_half"] and r1["reduced_in_half"]
    assert r0["skipped"] == r1["skipped"] == [3]  # the overflow was injected on rank 1 only
    assert r0["params"] == r1["params"] and r0["masters"] == r1["masters"] and r0["state"] == r1["state"]
    assert r0["masters_finer_than_params"]
    assert r0["loss_after"] < r0["loss_before"]


def test_a_deep_copy_trains_like_the_original() -> None:
    model = mlp(torch.float16)
    opt = master_weights(torch.optim.AdamW(model.parameters(), lr=1e-3))
    scaler = dls.GradScaler(loss_scale="dynamic")
    train(model, opt, scaler, range(2))
    model2, opt2 = copy.deepcopy((model, opt))
    scaler2 = copy.deepcopy(scaler)
    train(model, opt, scaler, range(2, 5))
    train(model2, opt2, scaler2, range(2, 5))
    assert_identical(snapshot(model2, opt2), snapshot(model, opt))
    assert all(opt2.master_of(p) is not opt.master_of(q) for p, q in zip(model2.parameters(), model.parameters()))


def test_the_example_runs_and_masters_beat_half_parameters() -> None:
    example = load_example("master_weights.py")
    threads = torch.get_num_threads()
    try:
        rows = {label: reduction for label, reduction, _ in example.main(["--steps", "40"])}
    finally:
        torch.set_num_threads(threads)
    for name in ("float16", "bfloat16"):
        assert rows[f"{name} params, float32 masters"] > 2 * rows[f"{name} params, no masters"]


def test_fmt_may_be_a_torch_dtype_as_dls_emulate_takes() -> None:
    p = torch.nn.Parameter(torch.full((2,), 1.0 + 2.0**-12))
    opt = master_weights(torch.optim.SGD([p], lr=0.1), fmt=torch.bfloat16)
    assert opt.fmt is dls.formats.get("bfloat16")
    assert p.dtype == torch.float32 and torch.equal(p, torch.ones(2))
    assert torch.equal(opt.master_of(p), torch.full((2,), 1.0 + 2.0**-12))


# ---------------------------------------------------------------------------------- loaded masters (issue 30)
@pytest.mark.parametrize(
    ("dtype", "fmt", "value", "beyond"),
    [
        (torch.float16, None, torch.full((4,), 1e5), "float16"),  # finite in float32, beyond float16's 65504
        (torch.float16, None, torch.full((4,), 3e38), "float16"),
        (torch.bfloat16, None, torch.full((4,), 1e300, dtype=torch.float64), "float32"),  # inf once cast
        (torch.float16, None, torch.full((4,), 1e300, dtype=torch.float64), "float32"),
        (torch.float32, "cbfloat16", torch.full((4,), 1e10), "cbfloat16"),  # beyond cbfloat16's 4.29e9
    ],
)
def test_loaded_masters_are_cast_then_checked_in_the_parameters_format(
    dtype: torch.dtype, fmt: str | None, value: torch.Tensor, beyond: str
) -> None:
    """Issue 30 A1: a master that is finite as saved but not once cast to float32, or once rounded to the model's
    parameter, is refused naming it; the model, the masters and the optimizer state stay as they were."""
    model = torch.nn.Linear(4, 4).to(dtype)
    opt = master_weights(torch.optim.AdamW(model.parameters(), lr=1e-3), fmt=fmt)
    model(torch.randn(2, 4, dtype=dtype)).float().sum().backward()
    opt.step()
    before = snapshot(model, opt)
    crafted = copy.deepcopy(opt.state_dict())
    crafted["master_weights"][1] = value
    crafted["state"][1]["exp_avg"] = torch.zeros(4)  # would change the state if anything were loaded
    with pytest.raises(ValueError, match=rf"state_dict\['master_weights'\]\[1\] holds values beyond {beyond}'s range"):
        opt.load_state_dict(crafted)
    assert_identical(snapshot(model, opt), before)
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_loaded_masters_that_are_inf_complex_or_float8_are_judged_by_their_values() -> None:
    model = torch.nn.Linear(2, 2).half()
    opt = master_weights(torch.optim.SGD(model.parameters(), lr=0.1))
    good = copy.deepcopy(opt.state_dict())
    before = snapshot(model, opt)
    for value, needle in [
        (torch.tensor([1.0, float("nan")]), "holds inf or NaN"),
        (torch.tensor([1.0, 2.0], dtype=torch.complex64), "must be a dense real tensor"),
        (torch.tensor([1.0, 2.0]).to_sparse(), "must be a dense real tensor"),
        (torch.empty(2, device="meta"), "must be a dense real tensor; got a torch.strided torch.float32 tensor on the"),
    ]:
        with pytest.raises(ValueError, match=rf"state_dict\['master_weights'\]\[1\] {needle}"):
            opt.load_state_dict({**good, "master_weights": {0: good["master_weights"][0], 1: value}})
        assert_identical(snapshot(model, opt), before)
    with pytest.raises(ValueError, match=r"holds masters for parameters none \(it is a list\)"):
        opt.load_state_dict({**good, "master_weights": list(good["master_weights"].values())})
    assert_identical(snapshot(model, opt), before)
    # float8 masters (no isfinite of their own) are read through float32: 448 fits float16
    float8 = torch.tensor([448.0, -2.0]).to(torch.float8_e4m3fn)
    opt.load_state_dict({**good, "master_weights": {0: good["master_weights"][0], 1: float8}})
    assert torch.equal(model.bias, torch.tensor([448.0, -2.0], dtype=torch.float16))
    assert opt.master_of(model.bias).dtype == torch.float32
