"""Host synchronisation (issue 6, item 2): which paths read a device value back, and what the sync-free paths
compute.

A read back is counted by patching the ``torch.Tensor`` methods that copy a value to the host (``item``,
``tolist``, ``cpu``, ``numpy``, ``__bool__``, ``__float__``, ``__int__``, ``__index__``, ``__complex__``) for
the duration of a block. On CPU nothing actually waits, but each of these calls is a host sync on an
accelerator, so the count is what a GPU run would pay. With CUDA, the same paths also run under
``torch.cuda.set_sync_debug_mode("error")``, which catches syncs made inside C++ too.

Correctness: dls on torch's fused optimizers equals ``torch.amp.GradScaler`` on the same optimizers, bit for
bit; ``sync_free=True`` equals the default path, bit for bit, over runs with injected overflows (the very first
step included).
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dls

DLS_DIR = os.path.dirname(dls.__file__)
SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__", "__complex__")
FUSED = ["Adam", "AdamW", "SGD", "Adagrad"]

_INT_OF = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16}
_INT_OF[torch.bfloat16] = torch.int16


@contextlib.contextmanager
def host_reads() -> Iterator[list[tuple[str, str]]]:
    """Record ``(method, calling file)`` for every host read of a tensor value inside the block."""
    calls: list[tuple[str, str]] = []
    saved = {name: torch.Tensor.__dict__.get(name) for name in SYNC_METHODS}

    def spy(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            calls.append((name, sys._getframe(1).f_code.co_filename))
            return original(self, *args, **kwargs)

        return wrapper

    for name in SYNC_METHODS:
        setattr(torch.Tensor, name, spy(name, getattr(torch.Tensor, name)))
    try:
        yield calls
    finally:
        for name, value in saved.items():
            if value is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, value)


def from_dls(calls: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [c for c in calls if c[1].startswith(DLS_DIR)]


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


# ---------------------------------------------------------------------------------------------- helpers
def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(32, 8, generator=gen), torch.randn(32, 4, generator=gen)


def loss_of(model: torch.nn.Module, step: int) -> torch.Tensor:
    x, y = batch(step)
    return torch.nn.functional.mse_loss(model(x), y)


def inject(model: torch.nn.Module, kind: str) -> None:
    """Make one gradient element non-finite (after backward)."""
    grad = next(model.parameters()).grad
    assert grad is not None
    grad.view(-1)[3] = {"inf": float("inf"), "-inf": float("-inf"), "nan": float("nan")}[kind]


def make_optimizer(name: str, model: torch.nn.Module, **kwargs: Any) -> torch.optim.Optimizer:
    options: dict[str, Any] = {"lr": 0.05}
    if name == "SGD":
        options["momentum"] = 0.9
    options.update(kwargs)
    return getattr(torch.optim, name)(model.parameters(), **options)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(_INT_OF[t.dtype]) if t.dtype in _INT_OF else t.detach()


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(bits(a), bits(b)), f"{what}: {a} != {b}"


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
    params = [p.detach().clone() for p in model.parameters()]
    state = [
        {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state.get(p, {}).items()}
        for p in model.parameters()
    ]
    return params, state


def assert_same(a: tuple[list[torch.Tensor], list[dict[str, Any]]], b: Any, where: str) -> None:
    for i, (x, y) in enumerate(zip(a[0], b[0])):
        assert_bits_equal(x, y, f"{where}: param {i}")
    for i, (sx, sy) in enumerate(zip(a[1], b[1])):
        assert sx.keys() == sy.keys(), f"{where}: state keys of param {i}: {sorted(sx)} vs {sorted(sy)}"
        for key in sx:
            if isinstance(sx[key], torch.Tensor):
                assert_bits_equal(sx[key], sy[key], f"{where}: state[{i}][{key!r}]")
            else:
                assert sx[key] == sy[key], f"{where}: state[{i}][{key!r}]"


# ---------------------------------------------------------------------------------------------- no host reads
def test_scale_unscale_clip_update_read_nothing_back() -> None:
    model = make_model()
    opt = make_optimizer("SGD", model)
    scaler = dls.GradScaler(max_gradient_norm=1.0, steps_per_increase=2)
    for step in range(4):
        loss = loss_of(model, step)
        with host_reads() as calls:
            scaled = scaler.scale(loss)
        assert calls == [], "scale()"
        scaled.backward()
        if step == 1:
            inject(model, "inf")
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


def test_update_with_a_tensor_new_scale_reads_nothing_back() -> None:
    model = make_model()
    opt = make_optimizer("SGD", model)
    scaler = dls.GradScaler()
    scaler.scale(loss_of(model, 0)).backward()
    scaler.unscale_(opt)
    with host_reads() as calls:
        scaler.update(torch.tensor(128.0))
    assert calls == []
    assert scaler.get_scale() == 128.0


@pytest.mark.parametrize("name", FUSED)
@pytest.mark.parametrize("clip", [None, 1.0], ids=["noclip", "clip"])
def test_fused_optimizer_step_reads_nothing_back(name: str, clip: float | None) -> None:
    model = make_model()
    opt = make_optimizer(name, model, fused=True)
    scaler = dls.GradScaler(max_gradient_norm=clip, steps_per_increase=2)
    for step in range(4):
        scaler.scale(loss_of(model, step)).backward()
        if step in (1, 2):
            inject(model, "nan")
        with host_reads() as calls:
            scaler.step(opt)
            scaler.update()
        # The optimizer's first step is decided on the host, once (its state does not exist yet); none after.
        assert len(calls) == (1 if step == 0 else 0), f"step {step}: {calls}"
        opt.zero_grad()
    assert scaler.get_num_skipped_steps() == 2


class GradOps(TorchDispatchMode):
    """Names of the aten ops that touch any of the watched gradient buffers."""

    def __init__(self, watched: list[torch.Tensor]) -> None:
        super().__init__()
        self.watched = {t.data_ptr() for t in watched}
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        flat: list[Any] = []
        for a in list(args) + list((kwargs or {}).values()):
            flat.extend(a if isinstance(a, (list, tuple)) else [a])
        if any(isinstance(t, torch.Tensor) and t.data_ptr() in self.watched for t in flat):
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", FUSED)
def test_fused_optimizer_step_folds_unscaling_into_the_kernel(name: str) -> None:
    model = make_model()
    opt = make_optimizer(name, model, fused=True)
    scaler = dls.GradScaler()
    scaler.scale(loss_of(model, 0)).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    with GradOps(grads) as seen:
        scaler.step(opt)
    # Besides the optimizer's fused kernel (which divides by grad_scale as it updates), one pass over the
    # gradients: the inf/NaN check. No unscale pass.
    metadata_only = {"empty_like", "detach", "alias"}  # fused SGD's first step allocates buffers like the grads
    others = [op for op in seen.ops if not op.startswith("_fused_") and op not in metadata_only]
    assert len(others) == 1, seen.ops
    assert any(op.startswith("_fused_") for op in seen.ops), seen.ops


@pytest.mark.parametrize("name", ["SGD", "Adam", "RMSprop"])
def test_sync_free_step_reads_nothing_back(name: str) -> None:
    model = make_model()
    opt = make_optimizer(name, model)
    scaler = dls.GradScaler(sync_free=True, steps_per_increase=2)
    stepped = False
    for step in range(5):
        scaler.scale(loss_of(model, step)).backward()
        overflow = step in (0, 3)
        if overflow:
            inject(model, "inf")
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
def test_default_step_reads_one_flag_per_optimizer(clip: float | None, n_optimizers: int) -> None:
    model = make_model()
    params = list(model.parameters())
    opts = [torch.optim.SGD(params[i::n_optimizers], lr=0.05, momentum=0.9) for i in range(n_optimizers)]
    scaler = dls.GradScaler(max_gradient_norm=clip)
    for step in range(3):
        scaler.scale(loss_of(model, step)).backward()
        if step == 1:
            inject(model, "inf")
        with host_reads() as calls:
            for opt in opts:
                scaler.step(opt)
            scaler.update()
        assert [c[0] for c in calls] == ["item"] * n_optimizers, calls
        assert from_dls(calls) == calls
        for opt in opts:
            opt.zero_grad()


# ---------------------------------------------------------------------------------------------- fused == torch
FUSED_CASES = {
    # The first overflow comes after the first step: on an overflowing first step torch's fused kernels create
    # (zero or, for SGD with momentum, uninitialised) state while dls skips on the host and creates none (see
    # test_fused_sgd_momentum_first_step_overflow_is_a_clean_skip).
    "Adam": ("Adam", {}, 1),
    "AdamW": ("AdamW", {"weight_decay": 0.1}, 1),
    "Adagrad": ("Adagrad", {}, 1),
    "SGD": ("SGD", {"momentum": 0.0, "weight_decay": 0.01}, 1),
    "SGD-momentum": ("SGD", {"momentum": 0.9, "nesterov": True}, 1),
}


@pytest.mark.parametrize("case", list(FUSED_CASES))
def test_fused_optimizer_through_dls_equals_torch_amp(case: str) -> None:
    name, kwargs, first = FUSED_CASES[case]
    overflow_steps = {first: "inf", 3: "nan", 4: "-inf", 8: "inf"}
    ours_model, theirs_model = make_model(), make_model()
    ours_opt = make_optimizer(name, ours_model, fused=True, **kwargs)
    theirs_opt = make_optimizer(name, theirs_model, fused=True, **kwargs)
    # init 2**10 and growth every 2 clean steps: stays below dls's default max (2**15), so the rules agree.
    ours = dls.GradScaler(init_scale=2.0**10, steps_per_increase=2)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    for step in range(10):
        for model, opt, scaler in ((ours_model, ours_opt, ours), (theirs_model, theirs_opt, theirs)):
            scaler.scale(loss_of(model, step)).backward()
            if step in overflow_steps:
                inject(model, overflow_steps[step])
            before = snapshot(model, opt)
            scaler.step(opt)
            scaler.update()
            if step in overflow_steps and step > 0:
                # A skipped step leaves parameters and state bit-identical (the step count included).
                assert_same(before, snapshot(model, opt), f"{type(scaler).__module__} skipped step {step}")
            opt.zero_grad()
        assert_same(snapshot(ours_model, ours_opt), snapshot(theirs_model, theirs_opt), f"step {step}")
        assert ours.get_scale() == theirs.get_scale(), f"step {step}"
    assert ours.get_num_skipped_steps() == len(overflow_steps)


# ---------------------------------------------------------------------------------------------- masked == default
MASKED_CASES = {
    "SGD-momentum": ("SGD", {"momentum": 0.9}),
    "SGD-nesterov-foreach": ("SGD", {"momentum": 0.9, "nesterov": True, "foreach": True}),
    "SGD-plain": ("SGD", {"momentum": 0.0}),
    "Adam": ("Adam", {}),
    "AdamW-amsgrad-foreach": ("AdamW", {"amsgrad": True, "foreach": True}),
    "Adagrad": ("Adagrad", {}),
    "RMSprop-momentum": ("RMSprop", {"momentum": 0.5}),
}


def run_pair(name: str, kwargs: dict[str, Any], overflow_steps: dict[int, str], steps: int) -> None:
    default_model, masked_model = make_model(), make_model()
    default_opt = make_optimizer(name, default_model, **kwargs)
    masked_opt = make_optimizer(name, masked_model, **kwargs)
    default = dls.GradScaler(init_scale=2.0**10, steps_per_increase=2)
    masked = dls.GradScaler(init_scale=2.0**10, steps_per_increase=2, sync_free=True)
    for step in range(steps):
        for model, opt, scaler in ((default_model, default_opt, default), (masked_model, masked_opt, masked)):
            scaler.scale(loss_of(model, step)).backward()
            if step in overflow_steps:
                inject(model, overflow_steps[step])
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        ours, theirs = snapshot(default_model, default_opt), snapshot(masked_model, masked_opt)
        assert_same(ours, theirs, f"step {step}")
        assert default.get_scale() == masked.get_scale()
    assert masked.get_num_skipped_steps() == len(overflow_steps)


@pytest.mark.parametrize("case", list(MASKED_CASES))
def test_sync_free_masked_step_equals_default_path(case: str) -> None:
    name, kwargs = MASKED_CASES[case]
    run_pair(name, kwargs, {0: "inf", 1: "nan", 4: "-inf", 5: "inf", 9: "nan"}, steps=12)


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [("SGD", {"momentum": 0.9, "dampening": 0.5}), ("NAdam", {}), ("Rprop", {}), ("ASGD", {})],
)
def test_sync_free_first_step_overflow_creates_no_state(name: str, kwargs: dict[str, Any]) -> None:
    # Their state does not start from zeros (dampening, NAdam's mu_product, Rprop's step_size, ASGD's eta/mu):
    # only a host-decided first step can leave it exactly as an optimizer that never stepped.
    run_pair(name, kwargs, {0: "inf", 2: "nan"}, steps=4)


def test_fused_sgd_momentum_first_step_overflow_is_a_clean_skip() -> None:
    # torch.optim.SGD(fused=True, momentum>0) makes its momentum buffers with empty_like on the first step and its
    # kernel returns early on found_inf, so after a first-step overflow torch.amp.GradScaler leaves garbage in
    # them. dls decides an optimizer's first step on the host.
    def run(overflow_first: bool) -> Any:
        model = make_model()
        opt = make_optimizer("SGD", model, fused=True, momentum=0.9)
        # Powers of two scale exactly: a run that skipped step 0 (and backed off) equals a run without step 0.
        scaler = dls.GradScaler(init_scale=2.0**15 if overflow_first else 2.0**14)
        for step in range(3):
            if step == 0 and not overflow_first:
                continue
            scaler.scale(loss_of(model, step)).backward()
            if step == 0:
                inject(model, "inf")
                junk = [torch.full_like(p, float("nan")) for p in model.parameters()]
                del junk  # freed NaN blocks: what an uninitialised buffer made now most likely holds
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        return snapshot(model, opt)

    assert_same(run(True), run(False), "after a skipped first step")


def test_sync_free_with_fused_optimizer_uses_the_fused_path() -> None:
    model = make_model()
    opt = make_optimizer("Adam", model, fused=True)
    scaler = dls.GradScaler(sync_free=True)
    scaler.scale(loss_of(model, 0)).backward()
    scaler.step(opt)  # the first step is decided on the host
    scaler.update()
    opt.zero_grad()
    scaler.scale(loss_of(model, 1)).backward()
    inject(model, "inf")
    before = snapshot(model, opt)
    with host_reads() as calls:
        scaler.step(opt)
        scaler.update()
    assert calls == []
    # The fused kernel skipped the step itself: parameters and state are bit-identical.
    assert_same(before, snapshot(model, opt), "skipped fused step")


# ---------------------------------------------------------------------------------------------- CUDA
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none in this environment)")


@contextlib.contextmanager
def cuda_sync_errors() -> Iterator[None]:
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


@cuda
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
    model = make_model().cuda()
    opt = make_optimizer(name, model, **kwargs)
    scaler = dls.GradScaler(sync_free=sync_free, max_gradient_norm=1.0)
    x, y = (t.cuda() for t in batch(0))
    for step in range(3):
        loss = torch.nn.functional.mse_loss(model(x), y)
        scaled = scaler.scale(loss)
        scaled.backward()
        if step == 1:
            inject(model, "inf")
        with cuda_sync_errors():
            scaler.clip_gradients_and_return_isfinite(opt)
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
    assert scaler.get_num_skipped_steps() == 1


@cuda
def test_cuda_default_step_syncs() -> None:
    model = make_model().cuda()
    opt = make_optimizer("SGD", model)
    scaler = dls.GradScaler()
    x, y = (t.cuda() for t in batch(0))
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    with cuda_sync_errors():
        scaler.unscale_(opt)
        with pytest.raises(RuntimeError, match="synchroniz"):
            scaler.step(opt)


def test_copy_of_snapshot_helpers_is_independent() -> None:
    # The comparisons above rely on snapshot() cloning: a later step must not change an earlier snapshot.
    model = make_model()
    opt = make_optimizer("Adam", model)
    loss_of(model, 0).backward()
    opt.step()
    snap = snapshot(model, opt)
    saved = copy.deepcopy(snap)
    opt.step()
    assert_same(snap, saved, "snapshot")
