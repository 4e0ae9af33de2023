"""``skip_aware``: schedulers and weight averages advance on applied optimizer steps only; the rest passes through."""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys
import textwrap
import warnings
from typing import Any

import pytest
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import dls
from dls.skip import SkipAware, skip_aware

OVERFLOWS = {0, 3, 4}  # iterations whose gradients get an inf (0: the optimizer's very first step)
STEPS = 7


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: dls.GradScaler,
    on_step: Any,
    accumulate: int = 1,
    steps: int = STEPS,
) -> list[bool]:
    """``steps`` optimizer steps of ``accumulate`` micro-batches; ``on_step()`` after each. Returns which skipped."""
    gen = torch.Generator().manual_seed(1)
    skipped = []
    for step in range(steps):
        for micro in range(accumulate):
            x = torch.randn(3, 4, generator=gen)
            scaler.scale(model(x).square().mean() / accumulate).backward()
            if step in OVERFLOWS and micro == 0:
                model[0].weight.grad[0, 0] = float("inf")
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        skipped.append(scaler.step_was_skipped(optimizer))
        on_step()
    return skipped


@pytest.mark.parametrize(
    ("fused", "sync_free"), [(False, False), (True, False), (False, True)], ids=["host", "fused", "sync-free"]
)
def test_scheduler_follows_applied_steps(fused: bool, sync_free: bool) -> None:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)
    scaler = dls.GradScaler(device="cpu", sync_free=sync_free)
    scheduler = skip_aware(torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5), scaler)
    reference = torch.optim.lr_scheduler.StepLR(torch.optim.SGD([torch.zeros(1)], lr=0.1), step_size=2, gamma=0.5)
    lrs: list[tuple[float, float]] = []

    def on_step() -> None:
        scheduler.step()
        if not scaler.step_was_skipped(optimizer):
            reference.step()
        lrs.append((scheduler.get_last_lr()[0], reference.get_last_lr()[0]))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "scheduler stepped before optimizer" after a skipped first step
        skipped = _train(model, optimizer, scaler, on_step)
    assert skipped == [i in OVERFLOWS for i in range(STEPS)]
    assert scheduler.last_epoch == STEPS - len(OVERFLOWS)
    assert [a for a, _ in lrs] == [b for _, b in lrs]
    assert optimizer.param_groups[0]["lr"] == reference.get_last_lr()[0]


def test_gradient_accumulation_decides_per_optimizer_step() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = dls.GradScaler(device="cpu")
    scheduler = skip_aware(torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0), scaler)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        skipped = _train(model, optimizer, scaler, scheduler.step, accumulate=3)
    assert skipped == [i in OVERFLOWS for i in range(STEPS)]
    assert scheduler.last_epoch == STEPS - len(OVERFLOWS)


@pytest.mark.parametrize("sync_free", [False, True], ids=["host", "on-device"])
def test_averaged_model_averages_once_per_applied_step(sync_free: bool) -> None:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    scaler = dls.GradScaler(device="cpu")
    ema = skip_aware(
        AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.5)), scaler, optimizer=optimizer, sync_free=sync_free
    )
    applied: list[list[torch.Tensor]] = []

    def on_step() -> None:
        ema.update_parameters(model)
        if not scaler.step_was_skipped(optimizer):
            applied.append([p.detach().clone() for p in model.parameters()])

    _train(model, optimizer, scaler, on_step)
    assert int(ema.n_averaged) == len(applied) == STEPS - len(OVERFLOWS)
    expected = applied[0]
    for params in applied[1:]:
        expected = [0.5 * e + 0.5 * p for e, p in zip(expected, params)]
    for e, p in zip(expected, ema.module.parameters()):
        torch.testing.assert_close(p, e)  # the kernel's lerp rounds differently from this reference
    x = torch.randn(2, 4)
    assert torch.equal(ema(x), ema.module(x))  # calls pass through


class ForeachEMA(torch.nn.Module):
    """An EMA whose update never reads the device (unlike AveragedModel, which tests ``n_averaged`` on the host)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.shadow = copy.deepcopy(model).requires_grad_(False)
        self.register_buffer("updates", torch.zeros((), dtype=torch.long))

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        torch._foreach_lerp_(list(self.shadow.parameters()), [p.detach() for p in model.parameters()], 0.5)
        self.updates += 1


def test_on_device_ema_reads_nothing_back(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    scaler = dls.GradScaler(device="cpu")
    ema = skip_aware(ForeachEMA(model), scaler, optimizer=optimizer, method="update", sync_free=True)
    host = skip_aware(ForeachEMA(model), scaler, optimizer=optimizer, method="update")
    # Until its first applied step, a fused optimizer's step is decided on the host (iteration 0 overflows).
    _train(model, optimizer, scaler, lambda: None, steps=2)
    reads: list[str] = []
    for name in ("item", "__bool__", "tolist"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=original, _n=name: reads.append(_n) or _o(self, *a))
    gen = torch.Generator().manual_seed(5)
    for step in range(4):
        scaler.scale(model(torch.randn(3, 4, generator=gen)).sum()).backward()
        if step == 1:
            model[0].weight.grad[0, 0] = float("nan")
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        ema.update(model)
        assert reads == [], f"host reads in the fused step or the on-device update: {reads}"
        host.update(model)  # the host path reads the flag once, lazily
        reads.clear()
    monkeypatch.undo()
    assert int(ema.updates) == int(host.updates) == 3
    for a, b in zip(ema.parameters(), host.parameters()):
        assert torch.equal(a, b)


def test_before_the_first_step_and_disabled_scaler_behave_like_the_object() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = skip_aware(torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0), dls.GradScaler(device="cpu"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scheduler.step()
    assert scheduler.last_epoch == 1  # no optimizer step yet: nothing was skipped
    disabled = dls.GradScaler(device="cpu", enabled=False)
    scheduler = skip_aware(torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0), disabled)
    model(torch.randn(2, 4)).sum().backward()
    model[0].weight.grad[0, 0] = float("inf")
    disabled.step(optimizer)
    scheduler.step()
    assert scheduler.last_epoch == 1


class Wrapper:
    """Keeps the optimizer that steps as ``.optimizer``, as Accelerate's and Lightning's wrappers do."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer


class Outer(torch.optim.SGD):
    """An optimizer that is itself stepped and happens to hold another one as ``.optimizer``."""

    def __init__(self, params: Any, inner: torch.optim.Optimizer) -> None:
        super().__init__(params, lr=0.1)
        self.optimizer = inner


def test_finds_the_optimizer_that_steps_through_the_scaler() -> None:
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = dls.GradScaler(device="cpu")
    via_wrapper = skip_aware(torch.optim.lr_scheduler.LambdaLR(Wrapper(inner).optimizer, lambda s: 1.0), scaler)
    ema = skip_aware(AveragedModel(model), scaler, optimizer=Wrapper(inner))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _train(model, inner, scaler, lambda: (via_wrapper.step(), ema.update_parameters(model)))
    assert via_wrapper.last_epoch == int(ema.n_averaged) == STEPS - len(OVERFLOWS)

    model = _model()
    unused = torch.optim.SGD(_model().parameters(), lr=0.1)
    outer = Outer(model.parameters(), unused)
    ema = skip_aware(AveragedModel(model), scaler, optimizer=outer)
    _train(model, outer, scaler, lambda: ema.update_parameters(model))
    assert int(ema.n_averaged) == STEPS - len(OVERFLOWS)


def test_everything_else_passes_through() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = dls.GradScaler(device="cpu")
    raw = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3)
    scheduler = skip_aware(raw, scaler)
    assert isinstance(scheduler, torch.optim.lr_scheduler.StepLR) and isinstance(scheduler, SkipAware)
    assert scheduler.__wrapped__ is raw and "StepLR" in repr(scheduler)
    scheduler.step_size = 5  # attribute writes reach the scheduler
    assert raw.step_size == 5 and scheduler.get_last_lr() == raw.get_last_lr()
    state = scheduler.state_dict()
    assert state == raw.state_dict() and state["step_size"] == 5
    other = skip_aware(torch.optim.lr_scheduler.StepLR(optimizer, step_size=1), scaler)
    other.load_state_dict(state)
    assert other.step_size == 5
    clone = pickle.loads(pickle.dumps(scheduler))
    assert isinstance(clone, SkipAware) and clone.step_size == 5
    copied = copy.deepcopy(scheduler)
    assert isinstance(copied, SkipAware) and copied.__wrapped__ is not raw

    # An averaged model stays a module where it is registered (its state rides in the parent's state_dict).
    parent = torch.nn.Module()
    parent.ema = skip_aware(AveragedModel(model), scaler, optimizer=optimizer)
    assert "ema.n_averaged" in parent.state_dict()


def test_bad_arguments_raise_and_name_them() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = dls.GradScaler(device="cpu")
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3)
    with pytest.raises(ValueError, match=r"scaler must be a dls\.GradScaler"):
        skip_aware(scheduler, torch.amp.GradScaler("cpu"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"optimizer must be a torch\.optim\.Optimizer"):
        skip_aware(AveragedModel(model), scaler, optimizer=object())
    with pytest.raises(ValueError, match="is neither"):
        skip_aware(torch.nn.Linear(2, 2), scaler, optimizer=optimizer)
    with pytest.raises(ValueError, match="method must name a method"):
        skip_aware(scheduler, scaler, method="nonexistent")
    with pytest.raises(ValueError, match="sync_free=True"):
        skip_aware(scheduler, scaler, sync_free=True)
    with pytest.raises(ValueError, match="sync_free must be True or False"):
        skip_aware(scheduler, scaler, sync_free=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="already skip-aware"):
        skip_aware(skip_aware(scheduler, scaler), scaler)


def test_import_dls_without_the_frameworks() -> None:
    script = textwrap.dedent(
        """
        import sys, importlib.abc

        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("lightning", "pytorch_lightning", "accelerate", "transformers"):
                    raise ImportError(f"blocked: {name}")

        sys.meta_path.insert(0, Block())
        import dls, dls.skip, dls.integrations
        for name in ("lightning", "accelerate", "transformers"):
            try:
                getattr(dls.integrations, name)
            except ImportError as err:
                print(name, "->", err)
        blocked = [m for m in sys.modules if m.split(".")[0] in ("lightning", "accelerate", "transformers")]
        print("imported:", blocked)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert "imported: []" in out.stdout
    assert "lightning -> dls.integrations.lightning needs the lightning package: pip install 'dls[lightning]'" in (
        out.stdout
    )
    assert "accelerate -> dls.integrations.accelerate needs the accelerate package: pip install 'dls[hf]'" in out.stdout
    assert "transformers -> dls.integrations.accelerate needs the accelerate package" in out.stdout


def test_without_optimizer_binds_the_one_the_scaler_steps() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = dls.GradScaler(device="cpu")
    ema = skip_aware(AveragedModel(model), scaler)  # no optimizer=, none on the object
    ema.update_parameters(model)  # before any step: passes through
    assert int(ema.n_averaged) == 1
    _train(model, optimizer, scaler, lambda: ema.update_parameters(model))
    assert int(ema.n_averaged) == 1 + STEPS - len(OVERFLOWS)


def test_without_optimizer_several_stepped_optimizers_raise_naming_them() -> None:
    model = _model()
    params = list(model.parameters())
    o1, o2 = torch.optim.SGD(params[:1], lr=0.1), torch.optim.Adam(params[1:], lr=0.1)
    scaler = dls.GradScaler(device="cpu")
    ema = skip_aware(AveragedModel(model), scaler)
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    scaler.step(o1)
    scaler.step(o2)
    scaler.update()
    with pytest.raises(ValueError, match=r"stepped 2 optimizers \(SGD at .*, Adam at .*\); pass optimizer="):
        ema.update_parameters(model)
    assert int(ema.n_averaged) == 0
