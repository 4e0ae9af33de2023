"""``step`` and ``step_if_finite``: a skipped step leaves parameters and optimizer state bit-identical, torch.amp's
loop patterns give torch's results, fused optimizers take the scale and the flag themselves, an optimizer's first
step is decided on the host, ``step_was_skipped`` says what happened; and ``optimizer_step``, the whole iteration in
one call."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

import dls
from conftest import (
    INF,
    NAN,
    OpLog,
    Snapshot,
    assert_same,
    assert_tensors_equal,
    dls_scaler,
    inject,
    loss_of,
    params_of,
    side_by_side,
    snapshot,
    tiny_model,
    torch_scaler,
    train,
)

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "adam-foreach": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
}


# ---------------------------------------------------------------------------------------------- skipped steps
@pytest.mark.parametrize("sync_free", [False, True])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("bad", [INF, -INF, NAN])
def test_skipped_step_leaves_params_and_optimizer_state_bit_identical(opt_name: str, bad: float, sync_free: bool):
    model = tiny_model()
    opt = OPTIMIZERS[opt_name](list(model.parameters()))
    scaler = dls.GradScaler("dynamic", sync_free=sync_free)
    train(scaler, model, opt, range(3))  # real state first (moments, step counts, momentum)
    before = snapshot(model, opt)
    scale_before = scaler.get_scale()
    scaler.scale(loss_of(model, 9)).backward()
    inject(model, bad, index=9)
    assert scaler.step(opt) is None or opt_name == "adamw-fused" or sync_free
    scaler.update()
    assert_same(before, snapshot(model, opt))
    assert scaler.get_scale() == scale_before / 2
    assert scaler.get_num_skipped_steps() == 1


def test_snapshots_are_independent_of_later_steps() -> None:
    # The comparisons of skipped steps rely on snapshot() cloning: a later step must not change an earlier snapshot.
    model = tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    loss_of(model).backward()
    opt.step()
    snap = snapshot(model, opt)
    saved = snapshot(model, opt)
    opt.step()
    assert_same(snap, saved, "snapshot")
    with pytest.raises(AssertionError):
        assert_same(snap, snapshot(model, opt), "after a step")


# ---------------------------------------------------------------------------------------------- torch.amp loop patterns
def test_gradient_accumulation_matches_one_big_batch() -> None:
    model, ref = tiny_model(), tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler = dls.GradScaler("dynamic", init_scale=2.0**10)
    for micro in range(2):
        scaler.scale(loss_of(model, micro) / 2).backward()
    scaler.step(opt)
    scaler.update()
    ((loss_of(ref, 0) + loss_of(ref, 1)) / 2).backward()
    ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_two_optimizers_skip_independently_and_one_update_backs_off_once() -> None:
    m1, m2 = tiny_model(1), tiny_model(2)
    o1 = torch.optim.SGD(m1.parameters(), lr=0.1)
    o2 = torch.optim.SGD(m2.parameters(), lr=0.1)
    scaler = dls.GradScaler("dynamic", init_scale=2.0**10)
    before1, before2 = params_of(m1), params_of(m2)
    scaler.scale(loss_of(m1) + loss_of(m2)).backward()
    inject(m1)
    assert scaler.step(o1) is None
    scaler.step(o2)
    scaler.update()
    assert_tensors_equal(params_of(m1), before1)
    assert not all(torch.equal(p, q) for p, q in zip(m2.parameters(), before2))
    assert scaler.get_scale() == 2.0**9
    assert scaler.get_num_skipped_steps() == 1  # one iteration, not one per optimizer


def test_torch_scaling_case_final_scale_and_control_run() -> None:
    # torch's test_grad_scaling_*: scale = 128 * 2**unskipped * 0.5**skipped with interval 1; the parameters equal a
    # run without the scaler that leaves the skipped iteration out.
    def run(use_scaler: bool) -> tuple[list[torch.Tensor], float]:
        model = tiny_model(3)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        scaler = dls.GradScaler("cpu", init_scale=128.0, growth_interval=1)  # torch's rule: the torch dialect
        for i in range(6):
            loss = loss_of(model, i)
            if use_scaler:
                scaler.scale(loss).backward()
                if i == 2:
                    model[2].weight.grad.fill_(INF)  # type: ignore[union-attr]
                scaler.step(opt)
                scaler.update()
            elif i != 2:
                loss.backward()
                opt.step()
            opt.zero_grad()
        return params_of(model), scaler.get_scale()

    params, scale = run(use_scaler=True)
    control, _ = run(use_scaler=False)
    assert scale == 128.0 * 2.0**5 * 0.5**1
    for p, q in zip(params, control):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_autocast_float16_training_on_cpu_reduces_the_loss() -> None:
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = dls.GradScaler("cpu")
    losses = []
    for i in range(30):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_of(model, i % 3)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert scaler.get_scale() == 2.0**15


class _ReturningOptimizer(torch.optim.SGD):
    @torch.no_grad()
    def step(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        super().step()
        return ("stepped", args, kwargs)


def test_step_forwards_args_and_returns_the_optimizer_value_like_torch() -> None:
    for scaler in (torch_scaler(), dls_scaler()):
        p = torch.nn.Parameter(torch.ones(2))
        opt = _ReturningOptimizer([p], lr=0.1)
        scaler.scale(p.sum()).backward()
        assert scaler.step(opt, 7, flag=True) == ("stepped", (7,), {"flag": True})
        scaler.update()
        opt.zero_grad()
        scaler.scale(p.sum() * INF).backward()
        assert scaler.step(opt, 7) is None
        scaler.update()


def test_lr_scheduler_follows_skipped_steps_like_torch() -> None:
    out = []
    for scaler in (torch_scaler(2.0**4, 2), dls_scaler(2.0**4, 2)):
        model = tiny_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        lrs = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(6):
                scaler.scale(loss_of(model, i)).backward()
                if i in (0, 3):  # skipped first step: torch's scheduler warns about the order
                    inject(model)
                scaler.step(opt)
                scaler.update()
                sched.step()
                opt.zero_grad()
                lrs.append(sched.get_last_lr()[0])
        messages = sorted(str(w.message)[:60] for w in caught if "lr_scheduler" in str(w.message))
        out.append((lrs, params_of(model), scaler.get_scale(), messages))
    assert out[0][0] == out[1][0]
    assert_tensors_equal(out[0][1], out[1][1])
    assert out[0][2] == out[1][2]
    assert out[0][3] == out[1][3]


# ----------------------------------------------------------------------------------- parameters without gradients
def test_frozen_params_and_partial_grads_match_torch() -> None:
    """Some parameters never get a gradient (frozen branch): unscale/step skip them exactly as torch does."""

    def body(scaler: Any, model: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
        model[2].bias.requires_grad_(False)  # type: ignore[union-attr]
        scaler.scale(loss_of(model, i)).backward()
        if i == 2:
            inject(model)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    side_by_side(body, lambda ps: torch.optim.Adam(ps, lr=1e-2), 5, interval=2)


def test_optimizer_with_no_grads_at_all_steps_and_update_counts_a_clean_iteration() -> None:
    """torch raises an AssertionError ("No inf checks were recorded for this optimizer") here; dls does not: nothing
    to unscale, nothing overflowed, the step is a no-op and update counts a clean step."""
    model, frozen = tiny_model(0), tiny_model(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    frozen_opt = torch.optim.SGD(frozen.parameters(), lr=0.1, momentum=0.9)
    scaler = dls_scaler(init_scale=8.0, steps_per_increase=2)
    before = params_of(frozen)
    for i in range(2):
        scaler.scale(loss_of(model, i)).backward()
        scaler.step(opt)
        assert scaler.step(frozen_opt) is None  # SGD.step returns None; it ran, nothing changed
        scaler.update()
        opt.zero_grad()
    assert_tensors_equal(before, params_of(frozen))
    assert frozen_opt.state_dict()["state"] == {}
    assert scaler.get_scale() == 16.0 and scaler.get_num_skipped_steps() == 0
    # An iteration in which only the grad-less optimizer took part is a clean iteration too.
    scaler.unscale_(frozen_opt)
    scaler.update()
    assert scaler.state_dict()["steps_since_rescale"] == 1


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.AdamW(ps, lr=0.1, fused=True),
        lambda ps: torch.optim.Adam(ps, lr=0.1, foreach=True),
        lambda ps: torch.optim.SGD(ps, lr=0.1),
    ],
    ids=["adamw-fused", "adam-foreach", "sgd"],
)
def test_zero_size_parameter_steps_like_torch(make: Callable[[Any], torch.optim.Optimizer]) -> None:
    out = []
    for scaler in (torch_scaler(), dls_scaler()):
        empty, w = torch.nn.Parameter(torch.zeros(0, 3)), torch.nn.Parameter(torch.ones(3))
        opt = make([empty, w])
        for i in range(2):
            scaler.scale((w * (i + 2)).sum() + empty.sum()).backward()
            if i == 1:
                inject(w.grad, NAN)  # type: ignore[arg-type]
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        out.append((w.detach().clone(), scaler.get_scale()))
    assert torch.equal(out[0][0], out[1][0]) and out[0][1] == out[1][1]


# ---------------------------------------------------------------------------------------------- step_if_finite, misuse
def test_step_if_finite_follows_the_flag_of_one_clip_call_across_optimizers() -> None:
    m1, m2 = tiny_model(1), tiny_model(2)
    o1 = torch.optim.SGD(m1.parameters(), lr=0.1)
    o2 = torch.optim.SGD(m2.parameters(), lr=0.1)
    scaler = dls.GradScaler("dynamic")
    before = params_of(m2)
    scaler.scale(loss_of(m1) + loss_of(m2)).backward()
    inject(m1)
    isfinite = scaler.clip_gradients_and_return_isfinite([o1, o2])
    assert isfinite.dtype == torch.bool and not bool(isfinite)
    assert scaler.step_if_finite(o2) is None  # the shared flag decides for both
    scaler.step(o1)
    scaler.update()
    assert_tensors_equal(params_of(m2), before)


def test_misuse_order_raises_like_torch() -> None:
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = dls.GradScaler("dynamic")
    with pytest.raises(RuntimeError, match="No inf checks"):
        scaler.update()
    scaler.scale(loss_of(model)).backward()
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


# ---------------------------------------------------------------------------------------------- fused optimizers
FUSED_CASES = {
    # The first overflow comes after the first step: on an overflowing first step torch's fused kernels create
    # (zero or, for SGD with momentum, uninitialised) state while dls skips on the host and creates none (see
    # test_fused_sgd_momentum_first_step_overflow_is_a_clean_skip).
    "Adam": ("Adam", {}),
    "AdamW": ("AdamW", {"weight_decay": 0.1}),
    "Adagrad": ("Adagrad", {}),
    "SGD": ("SGD", {"momentum": 0.0, "weight_decay": 0.01}),
    "SGD-momentum": ("SGD", {"momentum": 0.9, "nesterov": True}),
}


@pytest.mark.parametrize("case", list(FUSED_CASES))
def test_fused_optimizer_through_dls_equals_torch_amp(case: str) -> None:
    name, kwargs = FUSED_CASES[case]
    overflows = {1: INF, 3: NAN, 4: -INF, 8: INF}
    ours_model, theirs_model = tiny_model(), tiny_model()
    ours_opt = getattr(torch.optim, name)(ours_model.parameters(), lr=0.05, fused=True, **kwargs)
    theirs_opt = getattr(torch.optim, name)(theirs_model.parameters(), lr=0.05, fused=True, **kwargs)
    ours, theirs = dls_scaler(2.0**10, 2), torch_scaler(2.0**10, 2)
    for step in range(10):
        for model, opt, scaler in ((ours_model, ours_opt, ours), (theirs_model, theirs_opt, theirs)):
            before = snapshot(model, opt)
            train(scaler, model, opt, range(step, step + 1), overflows)
            if step in overflows:
                # A skipped step leaves parameters and state bit-identical (the step count included).
                assert_same(before, snapshot(model, opt), f"{type(scaler).__module__} skipped step {step}")
        assert_same(snapshot(ours_model, ours_opt), snapshot(theirs_model, theirs_opt), f"step {step}")
        assert ours.get_scale() == theirs.get_scale(), f"step {step}"
    assert ours.get_num_skipped_steps() == len(overflows)


@pytest.mark.parametrize("name", ["Adam", "AdamW", "SGD", "Adagrad"])
def test_fused_optimizer_step_folds_unscaling_into_the_kernel(name: str) -> None:
    model = tiny_model()
    opt = getattr(torch.optim, name)(model.parameters(), lr=0.05, fused=True)
    scaler = dls.GradScaler("cpu")
    scaler.scale(loss_of(model)).backward()
    with OpLog([p.grad for p in model.parameters() if p.grad is not None]) as log:
        scaler.step(opt)
    # Besides the optimizer's fused kernel (which divides by grad_scale as it updates), one pass over the
    # gradients: the inf/NaN check. No unscale pass.
    metadata_only = {"empty_like", "detach", "alias"}  # fused SGD's first step allocates buffers like the grads
    others = [op for op in log.names() if not op.startswith("_fused_") and op not in metadata_only]
    assert len(others) == 1, log.ops
    assert any(op.startswith("_fused_") for op in log.names()), log.ops


def test_fused_optimizer_with_user_unscale_and_clip_matches_torch() -> None:
    def body(scaler: Any, model: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
        scaler.scale(loss_of(model, i)).backward()
        if i == 1:
            inject(model, index=14)
        if i % 2:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    side_by_side(body, lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True), 5, interval=2)


def test_fused_adamw_with_float16_params_matches_torch() -> None:
    out = []
    for scaler in (torch_scaler(), dls_scaler()):
        model = tiny_model(dtype=torch.float16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        train(scaler, model, opt, range(3), {1: INF})
        out.append((params_of(model), scaler.get_scale()))
    assert_tensors_equal(out[0][0], out[1][0])
    assert out[0][1] == out[1][1]


# ---------------------------------------------------------------------------------------------- first steps
def test_fused_sgd_momentum_first_step_overflow_is_a_clean_skip() -> None:
    # torch.optim.SGD(fused=True, momentum>0) makes its momentum buffers with empty_like on the first step and its
    # kernel returns early on found_inf, so after a first-step overflow torch.amp.GradScaler leaves garbage in
    # them. dls decides an optimizer's first step on the host.
    def run(overflow_first: bool) -> Snapshot:
        model = tiny_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, fused=True)
        # Powers of two scale exactly: a run that skipped step 0 (and backed off) equals a run without step 0.
        scaler = dls.GradScaler("cpu", init_scale=2.0**15 if overflow_first else 2.0**14)
        for step in range(0 if overflow_first else 1, 3):
            scaler.scale(loss_of(model, step)).backward()
            if step == 0:
                inject(model)
                junk = [torch.full_like(p, NAN) for p in model.parameters()]
                del junk  # freed NaN blocks: what an uninitialised buffer made now most likely holds
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        return snapshot(model, opt)

    assert_same(run(True), run(False), "after a skipped first step")


# ---------------------------------------------------------------------------------------------- step_was_skipped
@pytest.mark.parametrize("sync_free", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_step_was_skipped_follows_injected_overflows(fused: bool, sync_free: bool) -> None:
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)
    scaler = dls.GradScaler("dynamic", sync_free=sync_free)
    with pytest.raises(RuntimeError, match="has not stepped"):
        scaler.step_was_skipped(opt)
    seen = []
    for i in range(5):
        train(scaler, model, opt, range(i, i + 1), {0: INF, 3: INF})
        seen.append((scaler.step_was_skipped(opt), bool(scaler.step_was_skipped_tensor(opt))))
    assert seen == [(i in (0, 3), i in (0, 3)) for i in range(5)]


# ---------------------------------------------------------------------------------------------- optimizer_step
def _adam(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = tiny_model(seed)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


@pytest.mark.parametrize("clip", [None, "norm", "value", "scaler-norm"])
def test_optimizer_step_equals_manual_sequence(clip: str | None) -> None:
    model, ref = tiny_model(), tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    scaler_norm = 0.05 if clip == "scaler-norm" else None
    scaler = dls.GradScaler("dynamic", init_scale=2.0**10, steps_per_increase=2, max_gradient_norm=scaler_norm)
    ref_scaler = dls.GradScaler("dynamic", init_scale=2.0**10, steps_per_increase=2)
    for i in range(8):
        dls.optimizer_step(
            loss_of(model, i),
            opt,
            scaler,
            max_gradient_norm=0.05 if clip == "norm" else None,
            max_gradient_value=0.01 if clip == "value" else None,
        )
        ref_scaler.scale(loss_of(ref, i)).backward()
        ref_scaler.unscale_(ref_opt)
        if clip in ("norm", "scaler-norm"):
            assert float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)) > 0.05  # the clip bites
        elif clip == "value":
            assert max(float(p.grad.abs().max()) for p in ref.parameters()) > 0.01  # type: ignore[union-attr]
            torch.nn.utils.clip_grad_value_(ref.parameters(), 0.01)
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        ref_opt.zero_grad()
        assert scaler.get_scale() == ref_scaler.get_scale()
        assert all(p.grad is None for p in model.parameters())
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_optimizer_step_with_a_list_shares_one_norm_and_one_flag() -> None:
    (m1, o1), (m2, o2), (r1, q1), (r2, q2) = _adam(1), _adam(2), _adam(1), _adam(2)
    scaler = dls.GradScaler("dynamic")
    dls.optimizer_step(loss_of(m1, 0) + loss_of(m2, 0), [o1, o2], scaler, max_gradient_norm=0.1)
    (loss_of(r1, 0) + loss_of(r2, 0)).backward()
    torch.nn.utils.clip_grad_norm_([*r1.parameters(), *r2.parameters()], 0.1)
    q1.step()
    q2.step()
    for p, q in zip([*m1.parameters(), *m2.parameters()], [*r1.parameters(), *r2.parameters()]):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    # One flag: an overflow in the first model's gradients skips both optimizers' steps.
    before = snapshot(m1, o1), snapshot(m2, o2)
    dls.optimizer_step(loss_of(m1, 1) * INF + loss_of(m2, 1), [o1, o2], scaler, max_gradient_norm=0.1)
    assert_same(before[0], snapshot(m1, o1))
    assert_same(before[1], snapshot(m2, o2))
    assert scaler.get_num_skipped_steps() == 1


def test_optimizer_step_skips_on_overflow() -> None:
    model, opt = _adam()
    scaler = dls.GradScaler("dynamic", init_scale=2.0**10)
    before = params_of(model)
    dls.optimizer_step(loss_of(model, 0) * INF, opt, scaler, max_gradient_norm=1.0)
    assert_tensors_equal(params_of(model), before)
    assert scaler.get_num_skipped_steps() == 1 and scaler.get_scale() == 2.0**9
    assert opt.state_dict()["state"] == {}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_gradient_norm": 1.0, "max_gradient_value": 1.0}, "not both"),
        ({"max_gradient_norm": -1.0}, "max_gradient_norm"),
        ({"max_gradient_value": -0.5}, "max_gradient_value"),
        ({"max_gradient_value": NAN}, "max_gradient_value"),
    ],
)
def test_optimizer_step_validates_before_running(kwargs: dict[str, Any], message: str) -> None:
    model, opt = _adam()
    scaler = dls.GradScaler("dynamic")
    with pytest.raises(ValueError, match=message):
        dls.optimizer_step(loss_of(model, 0), opt, scaler, **kwargs)
    assert all(p.grad is None for p in model.parameters())  # nothing ran, not even backward
    with pytest.raises(ValueError, match="grad_scaler"):
        dls.optimizer_step(loss_of(model, 0), opt, torch.amp.GradScaler("cpu"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="optimizer"):
        dls.optimizer_step(loss_of(model, 0), model, scaler)  # type: ignore[arg-type]
    for not_an_optimizer in (5, None, "adam", [], [opt, 5]):  # a non-iterable was a bare TypeError
        with pytest.raises(ValueError, match=r"^optimizer must be a torch\.optim\.Optimizer or a non-empty list"):
            dls.optimizer_step(loss_of(model, 0), not_an_optimizer, scaler)  # type: ignore[arg-type]
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("started", ["unscale_", "clip", "step"])
def test_optimizer_step_in_a_started_iteration_raises_and_changes_nothing(started: str) -> None:
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = dls.GradScaler("dynamic", init_scale=2.0**10)
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    {
        "unscale_": lambda: scaler.unscale_(opt),
        "clip": lambda: scaler.clip_gradients_and_return_isfinite(opt),
        "step": lambda: scaler.step(opt),
    }[started]()
    weights = params_of(model)
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    scale = scaler.get_scale()
    with pytest.raises(RuntimeError, match="already been called"):
        dls.optimizer_step(model(torch.ones(2, 4)).sum(), opt, scaler)
    assert_tensors_equal(params_of(model), weights)
    assert_tensors_equal([p.grad for p in model.parameters()], grads)
    assert scaler.get_scale() == scale


def test_optimizer_step_returns_device_tensors_without_reading_them() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = dls.GradScaler("dynamic", init_scale=2.0**10, max_gradient_norm=0.5)
    result = dls.optimizer_step(model(torch.ones(2, 4)).sum(), opt, scaler)
    assert result.loss_scale.item() == 2.0**10 and not result.found_inf.item()
    # The norm before clipping: the gradients of sum(Wx + b) over 2 rows of ones are 2 each (5 of them).
    assert result.grad_norm is not None and abs(result.grad_norm.item() - math.sqrt(5 * 4.0)) < 1e-5
    plain = dls.GradScaler("dynamic")
    assert dls.optimizer_step(model(torch.ones(2, 4)).sum(), opt, plain).grad_norm is None
    asked = dls.optimizer_step(model(torch.ones(2, 4)).sum(), opt, plain, gradient_norm=True)
    assert asked.grad_norm is not None and abs(asked.grad_norm.item() - math.sqrt(20.0)) < 1e-4
