"""Host synchronisation: which paths read a device value back (``conftest.host_reads`` counts them), and what the
sync-free paths compute.

``scale``, ``unscale_``, ``clip_gradients_and_return_isfinite`` and ``update`` read nothing back; ``step`` reads one
flag per optimizer, none for torch's fused optimizers and with ``sync_free=True`` (after an optimizer's first step,
which is decided on the host). A sync-free step runs and is undone on the device where the gradients overflowed: it
equals the default path's skipped step, bit for bit, over runs with injected overflows (the very first step
included). With CUDA the same paths also run under ``torch.cuda.set_sync_debug_mode("error")``, which catches syncs
made inside C++ too.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import pytest
import torch

import dls
from conftest import (
    DLS_DIR,
    INF,
    NAN,
    assert_same,
    assert_tensors_equal,
    batch,
    dls_scaler,
    from_dls,
    host_reads,
    inject,
    loss_of,
    snapshot,
    tiny_model,
    train,
)

FUSED = ["Adam", "AdamW", "SGD", "Adagrad"]
# torch 2.11's Adagrad(fused=True) (CPU only there) does not declare ``_step_supports_amp_scaling``: its step is not
# handed the scale and flag, by torch.amp's GradScaler or by dls, and is decided on the host (one flag read per step).
# torch 2.13's declares it.
HOST_DECIDED_BEFORE_2_13 = {"Adagrad"}


def make_optimizer(name: str, params: torch.nn.Module | Iterable[Any], **kwargs: Any) -> torch.optim.Optimizer:
    """torch.optim's ``name`` over ``params`` (a module's parameters) at lr 0.05 (SGD with momentum 0.9), ``kwargs``
    applied last."""
    options: dict[str, Any] = {"lr": 0.05, **({"momentum": 0.9} if name == "SGD" else {}), **kwargs}
    params = params.parameters() if isinstance(params, torch.nn.Module) else params
    return getattr(torch.optim, name)(params, **options)


def test_host_reads_spy_sees_every_kind_of_read() -> None:
    t = torch.ones(())
    original = torch.Tensor.item
    with host_reads() as calls:
        t.item()
        bool(t)
        float(t)
        int(t)
        t.tolist()
        t.cpu()
        if t:
            pass
    assert [c[0] for c in calls] == ["item", "__bool__", "__float__", "__int__", "tolist", "cpu", "__bool__"]
    assert torch.Tensor.item is original  # restored


# ---------------------------------------------------------------------------------------------- no host reads
def test_scale_unscale_clip_update_read_nothing_back(device: torch.device) -> None:
    model = tiny_model(device=device)
    opt = make_optimizer("SGD", model)
    scaler = dls.GradScaler(max_gradient_norm=1.0, steps_per_increase=2)
    for step in range(4):
        loss = loss_of(model, step)
        with host_reads() as calls:
            scaled = scaler.scale(loss)
        assert calls == [], "scale()"
        scaled.backward()
        if step == 1:
            inject(model, INF, index=3)
        with host_reads() as calls:
            if step % 2:
                scaler.unscale_(opt)
            else:
                ok = scaler.clip_gradients_and_return_isfinite(opt)
                assert isinstance(ok, torch.Tensor)
        assert calls == [], "unscale_() / clip_gradients_and_return_isfinite()"
        scaler.step(opt)
        with host_reads() as calls:
            scaler.update()
        assert calls == [], "update()"
        opt.zero_grad()


def test_update_with_a_tensor_new_scale_reads_nothing_back(device: torch.device) -> None:
    model = tiny_model(device=device)
    opt = make_optimizer("SGD", model)
    scaler = dls.GradScaler("dynamic")
    scaler.scale(loss_of(model, 0)).backward()
    scaler.unscale_(opt)
    new_scale = torch.tensor(128.0, device=device)
    with host_reads() as calls:
        scaler.update(new_scale)
    assert calls == []
    assert scaler.get_scale() == 128.0


@pytest.mark.parametrize("name", FUSED)
@pytest.mark.parametrize("clip", [None, 1.0], ids=["noclip", "clip"])
def test_fused_optimizer_step_reads_nothing_back(name: str, clip: float | None) -> None:
    model = tiny_model()
    opt = make_optimizer(name, model, fused=True)
    takes_flag = getattr(opt, "_step_supports_amp_scaling", False)
    assert takes_flag or (name in HOST_DECIDED_BEFORE_2_13 and torch.__version__ < (2, 13))  # type: ignore[operator]
    scaler = dls.GradScaler(max_gradient_norm=clip, steps_per_increase=2)
    for step in range(4):
        scaler.scale(loss_of(model, step)).backward()
        if step in (1, 2):
            inject(model, NAN, index=3)
        with host_reads() as calls:
            scaler.step(opt)
            scaler.update()
        # The optimizer's first step is decided on the host, once (its state does not exist yet); none after.
        expected = 1 if step == 0 or not takes_flag else 0
        assert len(calls) == expected, f"step {step}: {calls}"
        assert all(c == ("item", os.path.join(DLS_DIR, "loss_scale.py")) for c in calls), calls  # the flag, read once
        opt.zero_grad()
    assert scaler.get_num_skipped_steps() == 2


@pytest.mark.parametrize("name", ["SGD", "Adam", "RMSprop"])
def test_sync_free_step_reads_nothing_back(name: str, device: torch.device) -> None:
    model = tiny_model(device=device)
    opt = make_optimizer(name, model)
    scaler = dls.GradScaler(sync_free=True, steps_per_increase=2)
    stepped = False
    for step in range(5):
        scaler.scale(loss_of(model, step)).backward()
        overflow = step in (0, 3)
        if overflow:
            inject(model, INF, index=3)
        with host_reads() as calls:
            scaler.step(opt)
            scaler.update()
        # Until the optimizer has taken one step its state does not exist, so the skip is decided on the host
        # (one read); after that nothing. torch's own Adam and RMSprop read their (host-resident,
        # non-capturable) step count with .item(): not a device sync and not dls's; SGD reads nothing at all.
        assert len(from_dls(calls)) == (0 if stepped else 1), f"step {step}: {calls}"
        if name == "SGD" and stepped:
            assert calls == [], f"step {step}: {calls}"
        stepped = stepped or not overflow
        opt.zero_grad()
    assert scaler.get_num_skipped_steps() == 2


@pytest.mark.parametrize("clip", [None, 1.0], ids=["noclip", "clip"])
@pytest.mark.parametrize("n_optimizers", [1, 2])
@pytest.mark.filterwarnings("ignore:step\\(\\) clips each optimizer:UserWarning")  # per-optimizer clip on purpose
def test_default_step_reads_one_flag_per_optimizer(clip: float | None, n_optimizers: int, device: torch.device) -> None:
    model = tiny_model(device=device)
    params = list(model.parameters())
    opts = [torch.optim.SGD(params[i::n_optimizers], lr=0.05, momentum=0.9) for i in range(n_optimizers)]
    scaler = dls.GradScaler(max_gradient_norm=clip)
    for step in range(3):
        scaler.scale(loss_of(model, step)).backward()
        if step == 1:
            inject(model, INF, index=3)
        with host_reads() as calls:
            for opt in opts:
                scaler.step(opt)
            scaler.update()
        assert [c[0] for c in calls] == ["item"] * n_optimizers, calls
        assert from_dls(calls) == calls
        for opt in opts:
            opt.zero_grad()


def test_sync_free_with_a_fused_optimizer_uses_the_fused_path(device: torch.device) -> None:
    model = tiny_model(device=device)
    opt = make_optimizer("Adam", model, fused=True)
    scaler = dls.GradScaler("dynamic", sync_free=True)
    scaler.scale(loss_of(model, 0)).backward()
    scaler.step(opt)  # the first step is decided on the host
    scaler.update()
    opt.zero_grad()
    scaler.scale(loss_of(model, 1)).backward()
    inject(model, INF, index=3)
    before = snapshot(model, opt)
    with host_reads() as calls:
        scaler.step(opt)
        scaler.update()
    assert calls == []
    # The fused kernel skipped the step itself: parameters and state are bit-identical.
    assert_same(before, snapshot(model, opt), "skipped fused step")


# ---------------------------------------------------------------------------------------------- masked == skipped
MASKED_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "SGD-plain": ("SGD", {"momentum": 0.0}),
    "SGD-momentum": ("SGD", {}),
    "SGD-nesterov-foreach": ("SGD", {"nesterov": True, "foreach": True}),
    "Adam": ("Adam", {}),
    "AdamW-amsgrad": ("AdamW", {"amsgrad": True}),
    "AdamW-amsgrad-foreach": ("AdamW", {"amsgrad": True, "foreach": True}),
    "Adagrad": ("Adagrad", {}),
    "Adamax": ("Adamax", {}),
    "RAdam": ("RAdam", {}),
    "Adadelta": ("Adadelta", {"lr": 0.5}),
    "RMSprop-momentum-centered": ("RMSprop", {"momentum": 0.5, "centered": True}),
    # State that does not start at zero: only a host-decided first step leaves it as an optimizer that never stepped.
    "SGD-dampening": ("SGD", {"dampening": 0.5}),  # the momentum buffer starts at the first gradient
    "Rprop": ("Rprop", {}),  # step_size starts at lr
    "NAdam": ("NAdam", {}),  # mu_product starts at 1
    "ASGD": ("ASGD", {}),  # eta starts at lr, mu at 1
}


@pytest.mark.parametrize("case", list(MASKED_CASES))
def test_sync_free_masked_step_equals_the_default_skipped_step(case: str, device: torch.device) -> None:
    # Overflows at the very first steps (no state yet: decided on the host), then on masked steps.
    overflows = {0: INF, 1: NAN, 4: -INF, 5: INF, 9: NAN}
    name, kwargs = MASKED_CASES[case]
    default_model, masked_model = tiny_model(device=device), tiny_model(device=device)
    default_opt = make_optimizer(name, default_model, **kwargs)
    masked_opt = make_optimizer(name, masked_model, **kwargs)
    default = dls_scaler(2.0**10, 2)
    masked = dls_scaler(2.0**10, 2, sync_free=True)
    for step in range(12):
        for model, opt, scaler in ((default_model, default_opt, default), (masked_model, masked_opt, masked)):
            train(scaler, model, opt, range(step, step + 1), overflows)
        assert_same(snapshot(default_model, default_opt), snapshot(masked_model, masked_opt), f"step {step}")
        assert default.get_scale() == masked.get_scale()
    assert masked.get_num_skipped_steps() == len(overflows)


def _late_branch_run(name: str, kwargs: dict[str, Any], sync_free: bool, device: torch.device) -> list[torch.Tensor]:
    torch.manual_seed(0)
    a, b = torch.nn.Linear(6, 1).to(device), torch.nn.Linear(6, 1).to(device)
    opt = make_optimizer(name, [*a.parameters(), *b.parameters()], **kwargs)
    scaler = dls_scaler(init_scale=2.0**10, sync_free=sync_free)
    for i in range(5):
        x, _ = batch(i, device=device)
        loss = a(x).pow(2).mean() + (b(x).pow(2).mean() if i >= 1 else 0.0)  # branch b unused at first
        scaler.scale(loss).backward()
        if i == 1:  # b's first gradient arrives in an overflowing step
            inject(a)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in (*a.parameters(), *b.parameters())]


@pytest.mark.parametrize("case", ["Adam", "SGD-dampening", "Rprop", "NAdam"])
def test_sync_free_parameter_whose_first_grad_arrives_in_an_overflowing_step(case: str, device: torch.device) -> None:
    name, kwargs = MASKED_CASES[case]
    masked, default = _late_branch_run(name, kwargs, True, device), _late_branch_run(name, kwargs, False, device)
    assert_tensors_equal(masked, default)


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


def test_sync_free_restores_non_tensor_optimizer_state() -> None:
    out = []
    for sync_free in (False, True):
        p = torch.nn.Parameter(torch.ones(2))
        opt = _IntStepSGD([p])
        scaler = dls_scaler(sync_free=sync_free)
        for overflow in (False, True, False):
            scaler.scale(p.sum() * (INF if overflow else 1.0)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        out.append((opt.state[p]["step"], p.detach().clone()))
    assert out[0][0] == out[1][0] == 2
    assert torch.equal(out[0][1], out[1][1])


def _bits_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().view(torch.int32)


def test_a_skipped_sync_free_step_keeps_every_bit_of_nan_payloads_and_signed_zeros() -> None:
    """The masked step selects integer bits: a NaN's payload and a zero's sign come back as they were (a select by
    float arithmetic would give NaN * 0 = NaN and -0.0 + 0 = 0.0)."""
    p = torch.nn.Parameter(torch.tensor([1.0, -0.0, 2.0, 3.0]))
    odd_nan = torch.tensor([0x7FC0_1234], dtype=torch.int32).view(torch.float32)
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    scaler = dls_scaler(sync_free=True)
    for overflow in (False, True):
        with torch.no_grad():
            p[3] = odd_nan[0]  # a NaN weight (with its gradient clean, the step leaves a NaN there)
        p.grad = torch.tensor([INF if overflow else 1.0, 0.0, 1.0, 1.0]) * scaler.get_scale()
        before = [_bits_of(p), _bits_of(opt.state[p]["momentum_buffer"])] if overflow else []
        scaler.step(opt)
        scaler.update()
    assert scaler.get_num_skipped_steps() == 1
    assert torch.equal(before[0], _bits_of(p)) and torch.equal(before[1], _bits_of(opt.state[p]["momentum_buffer"]))
    assert before[0][1] == torch.tensor(-0.0).view(torch.int32) and before[0][3] == 0x7FC0_1234


class _ReplacingSGD(torch.optim.Optimizer):
    """Momentum SGD that replaces its state tensors by new ones each step (not in place), as a hand-written
    optimizer may."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["buf"] = state["buf"] * 0.9 + p.grad if "buf" in state else p.grad.clone()
                state["n"] = torch.ones(()) if "n" not in state else state["n"] + 1
                p.add_(state["buf"], alpha=-group["lr"])


def test_sync_free_restores_state_tensors_the_step_replaces() -> None:
    overflows = {1: INF, 3: NAN, 4: INF, 6: NAN}
    models = [tiny_model(), tiny_model()]
    opts = [_ReplacingSGD(m.parameters()) for m in models]
    scalers = [dls_scaler(2.0**10, 2), dls_scaler(2.0**10, 2, sync_free=True)]
    for step in range(8):
        for model, opt, scaler in zip(models, opts, scalers):
            train(scaler, model, opt, range(step, step + 1), overflows)
        assert_same(snapshot(models[0], opts[0]), snapshot(models[1], opts[1]), f"step {step}")
    assert scalers[1].get_num_skipped_steps() == len(overflows)


class _RetypingSGD(torch.optim.Optimizer):
    """SGD counting its steps in a state tensor that the step replaces, by a float64 one from the third step on (a
    state entry of another dtype: no selection of bits can put the float32 one back)."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.05})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state[p]
                    count = state.get("count", torch.zeros((), dtype=torch.float32)) + 1
                    state["count"] = count.double() if count >= 3 else count
                    p.add_(p.grad, alpha=-group["lr"] / float(count))


def test_sync_free_puts_back_a_state_tensor_the_step_replaced_by_another_dtype() -> None:
    """An overflowing step that replaces a float32 state tensor by a float64 one: the float32 one comes back, bit for
    bit (its bits added into the float64 tensor's were a meaningless number), as on the default path."""
    models = [tiny_model(), tiny_model()]
    opts = [_RetypingSGD(m.parameters()) for m in models]
    scalers = [dls_scaler(2.0**10, 2), dls_scaler(2.0**10, 2, sync_free=True)]
    for step in range(6):
        for model, opt, scaler in zip(models, opts, scalers):
            train(scaler, model, opt, range(step, step + 1), {2: INF, 4: NAN})
        assert_same(snapshot(models[0], opts[0]), snapshot(models[1], opts[1]), f"step {step}")
    assert scalers[1].get_num_skipped_steps() == 2
    assert all(s["count"].dtype == torch.float64 for s in opts[1].state.values())  # replaced at the clean step 3


def test_sync_free_follows_a_parameter_given_new_storage() -> None:
    """``p.data = ...`` between steps moves a parameter's elements: what the masked step kept of it is built anew
    (else the restore would write the old storage and leave the new one stepped)."""
    models = [tiny_model(), tiny_model()]
    opts = [make_optimizer("SGD", m) for m in models]
    scalers = [dls_scaler(2.0**10, 2), dls_scaler(2.0**10, 2, sync_free=True)]
    for step in range(6):
        for model, opt, scaler in zip(models, opts, scalers):
            if step == 3:
                first = next(model.parameters())
                first.data = first.data.clone()
            train(scaler, model, opt, range(step, step + 1), {2: INF, 3: INF, 5: NAN})
        assert_same(snapshot(models[0], opts[0]), snapshot(models[1], opts[1]), f"step {step}")


class _NewStorageSGD(torch.optim.Optimizer):
    """Momentum SGD writing each new parameter into fresh storage (``p.data = ...``), its momentum in place."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.05})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state[p]
                    if "momentum" not in state:
                        state["momentum"] = p.grad.clone()
                    else:
                        state["momentum"].mul_(0.9).add_(p.grad)
                    p.data = p.data - group["lr"] * state["momentum"]


def test_sync_free_follows_a_parameter_the_step_gives_new_storage() -> None:
    """A step that moves a parameter's elements (``p.data = ...`` inside it) while updating its state in place: the
    restore writes the parameter's new storage (not the views of the old one taken before the step, which would
    leave the overflowed step's -inf in the weight)."""
    models = [tiny_model(), tiny_model()]
    opts = [_NewStorageSGD(m.parameters()) for m in models]
    scalers = [dls_scaler(2.0**10, 2), dls_scaler(2.0**10, 2, sync_free=True)]
    for step in range(6):
        for model, opt, scaler in zip(models, opts, scalers):
            train(scaler, model, opt, range(step, step + 1), {2: INF, 3: INF, 5: NAN})
        assert_same(snapshot(models[0], opts[0]), snapshot(models[1], opts[1]), f"step {step}")
    assert scalers[1].get_num_skipped_steps() == 3
    assert all(bool(torch.isfinite(p).all()) for p in models[1].parameters())


def test_a_masked_step_declines_state_kept_off_the_flags_device() -> None:
    """State on the host while the flag is on a device (AdamW's step counts without capturable=True on CUDA) would
    need the flag read to be put back: the masked step declines before anything runs, and the scaler decides the
    step on the host (one read, as without sync_free; tests/test_sync_free.py's CUDA test counts it)."""
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    opt = torch.optim.AdamW([p], foreach=True)
    opt.step()
    assert dls.device_step.masked_snapshot(opt, torch.zeros((), device="meta"), None) is None
    assert dls.device_step.masked_snapshot(opt, torch.zeros(()), None) is not None


def test_a_declined_masked_step_is_decided_on_the_host_and_said_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the masked step declines (state on the host, the flag on a GPU: declined for a CPU optimizer here), the
    step is the default path's: one read of the flag, skipped without running, and one warning for the optimizer."""
    monkeypatch.setattr(dls.device_step, "masked_snapshot", lambda *args: None)
    models = [tiny_model(), tiny_model()]
    opts = [make_optimizer("Adam", m) for m in models]
    scalers = [dls_scaler(2.0**10, 2), dls_scaler(2.0**10, 2, sync_free=True)]
    said = []
    for step in range(5):
        for model, opt, scaler in zip(models, opts, scalers):
            scaler.scale(loss_of(model, step)).backward()
            if step in (0, 3):
                inject(model, INF if step else NAN)
            with warnings.catch_warnings(record=True) as caught, host_reads() as calls:
                warnings.simplefilter("always")
                scaler.step(opt)
                scaler.update()
            opt.zero_grad()
            if scaler is scalers[1]:
                said.append(sum("keeps optimizer state on the host" in str(w.message) for w in caught))
                assert len(from_dls(calls)) == 1, f"step {step}: {calls}"  # the flag, read on the host
        assert_same(snapshot(models[0], opts[0]), snapshot(models[1], opts[1]), f"step {step}")
    assert said == [0, 0, 1, 0, 0]  # steps 0 and 1 are first steps (host-decided anyway); then said once


# ---------------------------------------------------------------------------------------------- CUDA
@contextlib.contextmanager
def cuda_sync_errors() -> Iterator[None]:
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "name, kwargs, sync_free",
    [
        ("Adam", {"fused": True}, False),
        ("AdamW", {"fused": True}, False),
        ("SGD", {"fused": True}, False),
        ("SGD", {}, True),
        ("Adam", {"capturable": True}, True),
    ],
)
def test_cuda_sync_debug_mode_sees_no_sync(name: str, kwargs: dict[str, Any], sync_free: bool) -> None:
    model = tiny_model().cuda()
    opt = make_optimizer(name, model, **kwargs)
    scaler = dls.GradScaler(sync_free=sync_free, max_gradient_norm=1.0)
    x, y = (t.cuda() for t in batch(0))
    for step in range(3):
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        if step == 1:
            inject(model, INF, index=3)
        # The first step reads its flag once, by design: an overflowing first step must leave the optimizer's
        # state empty, and a fused kernel would have created it. Every later step makes no host sync.
        with cuda_sync_errors() if step > 0 else contextlib.nullcontext():
            scaler.clip_gradients_and_return_isfinite(opt)
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
    assert scaler.get_num_skipped_steps() == 1


@pytest.mark.cuda
def test_cuda_default_step_syncs() -> None:
    model = tiny_model().cuda()
    opt = make_optimizer("SGD", model)
    scaler = dls.GradScaler()
    x, y = (t.cuda() for t in batch(0))
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    with cuda_sync_errors():
        scaler.unscale_(opt)
        with pytest.raises(RuntimeError, match="synchroniz"):
            scaler.step(opt)


@pytest.mark.cuda
def test_cuda_sync_free_with_host_side_state_syncs_once_per_step() -> None:
    """AdamW without capturable=True keeps its step counts on the host: restoring them would need the flag there, so
    the step is decided on the host, one read per step (on the first GPU run the masked step copied the flag once per
    parameter: 148 syncs for GPT-2 small; then once per step, with the copies around it), said once."""
    model = tiny_model().cuda()
    opt = make_optimizer("AdamW", model)
    scaler = dls.GradScaler(sync_free=True)
    x, y = (t.cuda() for t in batch(0))
    counts, said = [], []
    for step in range(3):
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        if step == 2:
            inject(model, INF, index=3)
        previous = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                scaler.step(opt)
                scaler.update()
            finally:
                torch.cuda.set_sync_debug_mode(previous)
        counts.append(sum("synchroniz" in str(w.message) for w in caught))
        said.append(sum("keeps optimizer state on the host" in str(w.message) for w in caught))
        opt.zero_grad()
    assert any(p.device.type == "cpu" for state in opt.state.values() for p in state.values())
    assert counts[1:] == [1, 1]
    assert said == [0, 1, 0]
    assert scaler.get_num_skipped_steps() == 1


@pytest.mark.parametrize("fused", [False, True], ids=["sync_free", "fused"])
def test_asking_step_was_skipped_before_update_changes_no_trajectory(fused: bool) -> None:
    """step_was_skipped() reads the flag, and update() then applies the rule knowing it: the same state as the
    rule applied on the device, step after step (hysteresis, tolerance and the clamps included)."""
    cfg = {"hysteresis": 2, "overflow_tolerance": 0.3, "max_loss_scale": 2.0**6, "min_loss_scale": 0.25}
    trajectories = []
    for ask in (False, True):
        p = torch.nn.Parameter(torch.ones(2))
        opt = torch.optim.Adam([p], lr=0.0, fused=True) if fused else torch.optim.SGD([p], lr=0.0, momentum=0.9)
        scaler = dls.GradScaler(init_scale=8.0, steps_per_increase=2, sync_free=not fused, **cfg)
        trajectory = []
        for i in range(40):
            overflow = i % 5 in (1, 2) or i % 7 == 3
            scaler.scale(p.sum() * (INF if overflow else 1.0)).backward()
            scaler.step(opt)
            if ask:
                assert scaler.step_was_skipped(opt) is overflow
            scaler.update()
            opt.zero_grad()
            trajectory.append((scaler.state_dict(), scaler.get_non_clamped_scale()))
        trajectories.append(trajectory)
    assert trajectories[0] == trajectories[1]
