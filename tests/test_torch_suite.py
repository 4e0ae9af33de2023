"""PyTorch's own GradScaler tests, run on CPU against ``torch.amp.GradScaler`` and ``dls.GradScaler``.

Ported from pytorch/pytorch ``test/test_torch.py`` (class ``TestTorchDeviceType``: every ``test_grad_scaling_*`` test
and the GradScaler tests beside them; read at a recent main, the fork bobrenjc93/pytorch at 39b8f9df) and
``test/test_optim.py`` (``test_grad_scaling_autocast_fused_optimizers``). Each test that builds a scaler takes the
scaler class as a parameter: passing with torch's class shows the port is faithful, passing with dls's shows the
drop-in. The one change to a test body is the class constructed where torch constructs
``torch.amp.GradScaler(device, ...)``; assertions keep their meaning. The tests of torch's AMP kernels alone
(``*_kernel``) take no scaler: they pin the arithmetic both scalers must reproduce.

torch's helpers (``torch.testing._internal``: ``_create_scaling_case``, ``TensorTracker``, the ``optim_db`` inputs)
cannot be imported here (they need ``expecttest``), so ``_scaling_case``, ``_Tracker`` and ``OPTIM_INPUTS``
re-implement them; ``_assert_equal`` has ``TestCase.assertEqual``'s defaults (NaN equals NaN, dtypes must match,
devices need not), and an autouse fixture seeds torch as ``TestCase.setUp`` does (1234).

Where a test reads a scaler's internals (``_scale``, ``_init_growth_tracker``, ``_unscale_grads_``,
``_per_optimizer_states``) the test below reads the public equivalent (``get_scale()``, ``state_dict()``; the overflow
flag through ``update()``'s back-off); where none exists, the original runs as a ``*_internals`` test, an expected
failure for dls (strict, so it shows when dls grows the attribute). Not ported: ``test_grad_scaler_deprecated_warning``
(``torch.cpu.amp.GradScaler``'s deprecation, nothing of dls) and
``test_params_invalidated_with_grads_invalidated_and_graph_partition`` (the same body under an inductor setting that
eager code never reads).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import math
import pickle
import warnings
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import pytest
import torch

import dls

DEVICE = "cpu"
TORCH_SEED = 1234  # torch.testing._internal.common_utils.SEED, set by TestCase.setUp


@pytest.fixture(autouse=True)
def _seed() -> Iterator[None]:
    torch.manual_seed(TORCH_SEED)
    yield


def scalers(
    dls_xfail: str | None = None, raises: tuple[type[BaseException], ...] = (AttributeError, AssertionError)
) -> list[Any]:
    """The scaler classes to run a test with; ``dls_xfail`` marks dls's run a strict expected failure, which must
    raise one of ``raises`` (by default: the internal is missing, or is not what torch's is)."""
    marks = [pytest.mark.xfail(strict=True, raises=raises, reason=dls_xfail)] if dls_xfail else []
    return [pytest.param(torch.amp.GradScaler, id="torch"), pytest.param(dls.GradScaler, id="dls", marks=marks)]


ScalerClass = Callable[..., Any]


def _assert_equal(actual: Any, expected: Any, *, atol: float | None = None, rtol: float | None = None, msg: Any = None):
    """``TestCase.assertEqual`` of torch's test suite: equal_nan, exact dtype, any device."""
    torch.testing.assert_close(
        actual, expected, atol=atol, rtol=rtol, equal_nan=True, check_device=False, check_dtype=True, msg=msg
    )


# ---------------------------------------------------------------------- torch.testing._internal equivalents
def _scaling_models_optimizers(
    device: str, optimizer_ctor: Callable[..., torch.optim.Optimizer] = torch.optim.SGD, optimizer_kwargs: Any = None
) -> tuple[torch.nn.Sequential, torch.nn.Sequential, torch.optim.Optimizer, torch.optim.Optimizer]:
    """common_cuda._create_scaling_models_optimizers: a control model and an identical one to scale, lr 1.0."""
    mod_control = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).to(device=device)
    mod_scaling = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).to(device=device)
    with torch.no_grad():
        for c, s in zip(mod_control.parameters(), mod_scaling.parameters(), strict=True):
            s.copy_(c)
    kwargs = {"lr": 1.0, **(optimizer_kwargs or {})}
    return (
        mod_control,
        mod_scaling,
        optimizer_ctor(mod_control.parameters(), **kwargs),
        optimizer_ctor(mod_scaling.parameters(), **kwargs),
    )


def _scaling_case(
    device: str,
    dtype: torch.dtype = torch.float,
    optimizer_ctor: Callable[..., torch.optim.Optimizer] = torch.optim.SGD,
    optimizer_kwargs: Any = None,
) -> tuple[Any, ...]:
    """common_cuda._create_scaling_case: models and optimizers, four (8, 8) batches, MSE, overflow at iteration 2."""
    data = [
        (torch.randn((8, 8), dtype=dtype, device=device), torch.randn((8, 8), dtype=dtype, device=device))
        for _ in range(4)
    ]
    loss_fn = torch.nn.MSELoss().to(device)
    skip_iter = 2
    return (*_scaling_models_optimizers(device, optimizer_ctor, optimizer_kwargs), data, loss_fn, skip_iter)


class _Tracker:
    """common_optimizers.TensorTracker: queue clones of the control's tensors; pop one, compare it with the
    scaling run's tensor, then copy it there so deviations do not compound over steps."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []

    def add(self, tensor: torch.Tensor) -> None:
        self.tensors.append(tensor.detach().clone())

    def pop_check_set(self, tensor_to_set: torch.Tensor, assert_eq_kwargs: dict[str, float] | None = None) -> None:
        assert len(self.tensors) > 0, "no tensors to pop"
        ref = self.tensors.pop(0)
        _assert_equal(tensor_to_set, ref, **(assert_eq_kwargs or {}))
        with torch.no_grad():
            tensor_to_set.copy_(ref)


def _scale_after_update(scaler: Any) -> float:
    """The public view of an iteration's overflow flag: ``update()`` then the scale (backed off iff inf/NaN)."""
    scaler.update()
    return float(scaler.get_scale())


# ---------------------------------------------------------------------- test_torch.py: test_pickle_gradscaler
# pytorch/pytorch test/test_torch.py, TestTorchDeviceType.test_pickle_gradscaler (CPU branch). Internals replaced:
# b._init_growth_tracker -> b.state_dict()["_growth_tracker"]; a._scale.device and b._per_optimizer_states are
# checked in test_pickle_gradscaler_internals.
@pytest.mark.parametrize("scaler_cls", scalers())
def test_pickle_gradscaler(scaler_cls: ScalerClass) -> None:
    device = torch.device(DEVICE)
    GradScaler = partial(scaler_cls, device=device.type)
    for lazy_init_scale in (True, False):
        a = GradScaler(init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
        assert a.is_enabled()
        if lazy_init_scale:
            a.scale(torch.tensor([4.0], dtype=torch.float32, device=device))
        b = pickle.loads(pickle.dumps(a))
        assert b.is_enabled() == a.is_enabled()
        if a.is_enabled():
            assert b.get_scale() == 3.0
            assert b.get_growth_factor() == 4.0
            assert b.get_backoff_factor() == 0.5
            assert b.get_growth_interval() == 2
            assert b.state_dict()["_growth_tracker"] == 0
            if lazy_init_scale:
                _assert_equal(b.scale(torch.tensor([4.0], dtype=torch.float32, device=device)), torch.tensor([12.0]))


# pytorch/pytorch test/test_torch.py, TestTorchDeviceType.test_pickle_gradscaler, with its internals.
@pytest.mark.parametrize(
    "scaler_cls",
    scalers(
        "reads GradScaler internals: a._scale.device (the lazily created scale tensor), b._init_growth_tracker (read "
        "publicly in test_pickle_gradscaler) and b._per_optimizer_states['fdsa'] (a defaultdict of "
        "torch.amp.grad_scaler._refresh_per_optimizer_state()); the first and last have no public equivalent"
    ),
)
def test_pickle_gradscaler_internals(scaler_cls: ScalerClass) -> None:
    device = torch.device(DEVICE)
    GradScaler = partial(scaler_cls, device=device.type)
    for lazy_init_scale in (True, False):
        a = GradScaler(init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
        assert a.is_enabled()
        if lazy_init_scale:
            a.scale(torch.tensor([4.0], dtype=torch.float32, device=device))
            assert a._scale.device.type == device.type
        b = pickle.loads(pickle.dumps(a))
        assert b.is_enabled() == a.is_enabled()
        if a.is_enabled():
            assert b.get_scale() == 3.0
            assert b.get_growth_factor() == 4.0
            assert b.get_backoff_factor() == 0.5
            assert b.get_growth_interval() == 2
            assert b._init_growth_tracker == 0
            assert b._per_optimizer_states["fdsa"] == torch.amp.grad_scaler._refresh_per_optimizer_state()
            if lazy_init_scale:
                _assert_equal(b.scale(torch.tensor([4.0], dtype=torch.float32, device=device)), torch.tensor([12.0]))


# ---------------------------------------------------------------------- test_torch.py: test_grad_scaling_unscale
def _storm_base(dtype: torch.dtype) -> torch.Tensor:
    return torch.full((20, 20), 4.0, dtype=dtype, device=DEVICE)


# pytorch/pytorch test/test_torch.py, TestTorchDeviceType.test_grad_scaling_unscale, first part: torch's AMP kernel
# itself (no scaler; the kernel whose results both scalers must reproduce). Multi-GPU branches do not apply on CPU.
@pytest.mark.parametrize("dtype", [torch.float, torch.double], ids=["float32", "float64"])
def test_grad_scaling_unscale_kernel(dtype: torch.dtype) -> None:
    inv_scale = torch.full((1,), 0.25, dtype=torch.float, device=DEVICE)
    found_inf = torch.full((1,), 0.0, dtype=torch.float, device=DEVICE)
    g = _storm_base(dtype)
    ginf = g.clone()
    ginf[2, 2] = float("inf")
    gnan = g.clone()
    gnan[2, 2] = float("nan")
    # contiguous, transposed (non-contiguous but dense) and sliced (not dense) gradients take different kernels
    cases = (
        ([g.clone(), g.clone()], False),
        ([g.clone(), g.clone().t()], False),
        ([g.clone(), g.clone()[:, :5]], False),
        ([g.clone()[:, :5], g.clone()[:, :5]], False),
        ([g.clone(), ginf.clone()], True),
        ([g.clone(), gnan.clone()], True),
        ([g.clone(), ginf.clone()[:, :5]], True),
        ([g.clone(), gnan.clone()[:, :5]], True),
        ([ginf.clone(), g.clone()[:, :5]], True),
        ([ginf.clone()[:, :5], g.clone()[:, :5]], True),
    )
    for grads, has_inf in cases:
        found_inf.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        if has_inf:
            _assert_equal(found_inf, torch.tensor([1.0]))
        else:
            _assert_equal(found_inf, torch.tensor([0.0]))
            for grad in grads:
                _assert_equal(grad, torch.ones_like(grad), rtol=1e-5, atol=1e-7)
    # mismatched dtypes in one call
    grads = [g.clone(), g.to(dtype=torch.float16)]
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
    for grad in grads:
        _assert_equal(grad, torch.ones_like(grad), rtol=1e-5, atol=1e-7)


def _perfect_storm_grads(g: torch.Tensor, inject_inf: int, *, with_fp16: bool = True) -> list[torch.Tensor]:
    """Gradients of mixed dtypes and layouts; ``inject_inf >= 0`` writes an inf into that one."""
    grads = [g.clone(), g.clone()[:, :5]]
    if with_fp16:
        grads += [g.to(dtype=torch.float16), g.to(dtype=torch.float16)]
    if inject_inf >= 0:
        grads[inject_inf][2, 2] = float("inf")
    return grads


# pytorch/pytorch test/test_torch.py, TestTorchDeviceType.test_grad_scaling_unscale, second part ("perfect storm"),
# as written: it calls scaler._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16=True).
@pytest.mark.parametrize(
    "scaler_cls",
    scalers(
        "calls GradScaler._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16=True) and reads its "
        "found_inf_per_device dict; torch's public unscale_ refuses the test's float16 gradients, so there is no "
        "public equivalent (test_grad_scaling_unscale runs the float32 part of the storm publicly)"
    ),
)
@pytest.mark.parametrize("dtype", [torch.float, torch.double], ids=["float32", "float64"])
def test_grad_scaling_unscale_internals(scaler_cls: ScalerClass, dtype: torch.dtype) -> None:
    inv_scale = torch.full((1,), 0.25, dtype=torch.float, device=DEVICE)
    g = _storm_base(dtype)
    GradScaler = partial(scaler_cls, device=DEVICE)
    scaler = GradScaler()
    dummy_params = [torch.empty_like(x) for x in _perfect_storm_grads(g, -1)]
    dummy_opt = torch.optim.SGD(dummy_params, lr=1.0)
    for inject_inf in range(-1, len(dummy_params)):
        found_inf = torch.full((1,), 0.0, dtype=torch.float, device=DEVICE)
        grads = _perfect_storm_grads(g, inject_inf)
        for i, p in enumerate(dummy_params):
            p.grad = grads[i]
        found_inf_per_device = scaler._unscale_grads_(dummy_opt, inv_scale, found_inf, True)
        if inject_inf < 0:
            assert sum(v.item() for v in found_inf_per_device.values()) == 0
            for grad in grads:
                _assert_equal(grad, torch.ones_like(grad), rtol=1e-5, atol=1e-7)
        else:
            assert sum(v.item() for v in found_inf_per_device.values()) == 1


# pytorch/pytorch test/test_torch.py, TestTorchDeviceType.test_grad_scaling_unscale, second part through the public API:
# _unscale_grads_(opt, inv_scale=0.25, ...) -> a scaler at init_scale 4 and unscale_(opt); "found_inf sums to 1"
# -> update() backs the scale off to 2. The storm keeps its float32/float64 members (contiguous and sliced): torch's
# public unscale_ raises for float16 gradients.
@pytest.mark.parametrize("scaler_cls", scalers())
@pytest.mark.parametrize("dtype", [torch.float, torch.double], ids=["float32", "float64"])
def test_grad_scaling_unscale(scaler_cls: ScalerClass, dtype: torch.dtype) -> None:
    g = _storm_base(dtype)
    GradScaler = partial(scaler_cls, device=DEVICE)
    dummy_params = [torch.empty_like(x) for x in _perfect_storm_grads(g, -1, with_fp16=False)]
    dummy_opt = torch.optim.SGD(dummy_params, lr=1.0)
    for inject_inf in range(-1, len(dummy_params)):
        scaler = GradScaler(init_scale=4.0)
        scaler.scale(torch.ones((), device=DEVICE))
        grads = _perfect_storm_grads(g, inject_inf, with_fp16=False)
        for i, p in enumerate(dummy_params):
            p.grad = grads[i]
        scaler.unscale_(dummy_opt)
        if inject_inf < 0:
            assert _scale_after_update(scaler) == 4.0  # found_inf sums to 0
            for p in dummy_params:
                _assert_equal(p.grad, torch.ones_like(p.grad), rtol=1e-5, atol=1e-7)
        else:
            assert _scale_after_update(scaler) == 2.0  # found_inf sums to 1


# ---------------------------------------------------------------------- test_torch.py: test_grad_scaling_update_scale
# pytorch/pytorch test/test_torch.py, TestTorchDeviceType.test_grad_scaling_update_scale: torch's scale-update kernel
# itself (no scaler).
def test_grad_scaling_update_scale_kernel() -> None:
    growth, backoff, growth_interval = 2.0, 0.25, 2
    scale = torch.full((1,), 4.0, dtype=torch.float, device=DEVICE)
    growth_tracker = torch.full((1,), 0.0, dtype=torch.int32, device=DEVICE)
    found_inf = torch.full((1,), 0.0, dtype=torch.float, device=DEVICE)
    torch._amp_update_scale_(scale, growth_tracker, found_inf, growth, backoff, growth_interval)
    _assert_equal(growth_tracker, torch.tensor([1], dtype=torch.int32))
    _assert_equal(scale, torch.tensor([4.0]))
    torch._amp_update_scale_(scale, growth_tracker, found_inf, growth, backoff, growth_interval)
    _assert_equal(growth_tracker, torch.tensor([0], dtype=torch.int32))
    _assert_equal(scale, torch.tensor([8.0]))
    found_inf.fill_(1.0)
    torch._amp_update_scale_(scale, growth_tracker, found_inf, growth, backoff, growth_interval)
    _assert_equal(growth_tracker, torch.tensor([0], dtype=torch.int32))
    _assert_equal(scale, torch.tensor([2.0]))


# pytorch/pytorch test/test_torch.py, TestTorchDeviceType.test_grad_scaling_update_scale, the same three updates driven
# through a scaler's public API: the kernel's arguments become the constructor's, found_inf an inf gradient seen by
# unscale_, growth_tracker state_dict()["_growth_tracker"], scale get_scale().
@pytest.mark.parametrize("scaler_cls", scalers())
def test_grad_scaling_update_scale(scaler_cls: ScalerClass) -> None:
    scaler = scaler_cls(DEVICE, init_scale=4.0, growth_factor=2.0, backoff_factor=0.25, growth_interval=2)
    param = torch.zeros(3, device=DEVICE)
    optimizer = torch.optim.SGD([param], lr=1.0)

    def iteration(found_inf: bool) -> None:
        scaler.scale(torch.ones((), device=DEVICE))
        param.grad = torch.full_like(param, math.inf if found_inf else 1.0)
        scaler.unscale_(optimizer)
        scaler.update()

    iteration(found_inf=False)
    assert scaler.state_dict()["_growth_tracker"] == 1
    assert scaler.get_scale() == 4.0
    iteration(found_inf=False)
    assert scaler.state_dict()["_growth_tracker"] == 0
    assert scaler.get_scale() == 8.0
    iteration(found_inf=True)
    assert scaler.state_dict()["_growth_tracker"] == 0
    assert scaler.get_scale() == 2.0


# ---------------------------------------------------------------------- test_torch.py: test_grad_scaling_unscale_sparse
def _sparse_case() -> tuple[torch.Tensor, torch.Tensor]:
    i = torch.tensor([[0, 1, 1], [2, 0, 2]], device=DEVICE, dtype=torch.int64)
    v = torch.tensor([16.0, 32.0, 64.0], device=DEVICE, dtype=torch.float)
    return i, torch.sparse_coo_tensor(i, v, torch.Size([2, 3]), device=DEVICE, dtype=torch.float)


# pytorch/pytorch test/test_torch.py, TestTorchDeviceType.test_grad_scaling_unscale_sparse, as written.
@pytest.mark.parametrize(
    "scaler_cls",
    scalers(
        "calls GradScaler._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16) and indexes its "
        "found_inf_per_device dict; its float16 half has no public equivalent in torch "
        "(test_grad_scaling_unscale_sparse runs the float32 half publicly)"
    ),
)
def test_grad_scaling_unscale_sparse_internals(scaler_cls: ScalerClass) -> None:
    device = torch.device(DEVICE)
    dtype = torch.float
    scaler = scaler_cls(device=device.type)
    inv_scale = torch.full((1,), 0.25, dtype=dtype, device=device)
    found_inf = torch.empty((1,), dtype=dtype, device=device)
    cur = found_inf.device
    i, s = _sparse_case()

    p = s.clone()
    assert p.is_sparse
    opt = torch.optim.SGD([p], lr=1.0)
    p.grad = s.clone()
    found_inf.zero_()
    found_inf = scaler._unscale_grads_(opt, inv_scale, found_inf, False)[cur]
    _assert_equal(found_inf, torch.tensor([0.0]))
    _assert_equal(p.grad.to_dense(), (s / 4).to_dense())

    v = torch.tensor([16.0, 32.0, float("inf")])
    p.grad = torch.sparse_coo_tensor(i, v, torch.Size([2, 3]), device=device, dtype=dtype)
    found_inf.zero_()
    found_inf = scaler._unscale_grads_(opt, inv_scale, found_inf, False)[cur]
    _assert_equal(found_inf, torch.tensor([1.0]))

    v = torch.tensor([16.0, 32.0, float("nan")])
    p.grad = torch.sparse_coo_tensor(i, v, torch.Size([2, 3]), device=device, dtype=dtype)
    found_inf.zero_()
    found_inf = scaler._unscale_grads_(opt, inv_scale, found_inf, False)[cur]
    _assert_equal(found_inf, torch.tensor([1.0]))

    p = s.clone().half()
    assert p.is_sparse
    opt = torch.optim.SGD([p], lr=1.0)
    p.grad = s.clone().half()
    found_inf.zero_()
    found_inf = scaler._unscale_grads_(opt, inv_scale, found_inf, True)[cur]
    _assert_equal(found_inf, torch.tensor([0.0]))
    _assert_equal(p.grad.to_dense(), (s.half() / 4).to_dense())

    # Uncoalesced float16 gradient: each value fits, their coalesced sum (64000 + 64000) does not.
    i = torch.tensor([[0, 1, 0], [2, 0, 2]])
    v = torch.tensor([64000.0, 32.0, 64000.0])
    p.grad = torch.sparse_coo_tensor(i, v, torch.Size([2, 3]), device=device, dtype=torch.float16)
    found_inf.zero_()
    found_inf = scaler._unscale_grads_(opt, inv_scale, found_inf, True)[cur]
    _assert_equal(found_inf, torch.tensor([1.0]))


# pytorch/pytorch test/test_torch.py, TestTorchDeviceType.test_grad_scaling_unscale_sparse, its float32 half through the
# public API: _unscale_grads_(opt, inv_scale=0.25, ...) -> a scaler at init_scale 4 and unscale_(opt); found_inf 0/1
# -> update() keeps 4 / backs off to 2.
@pytest.mark.parametrize("scaler_cls", scalers())
def test_grad_scaling_unscale_sparse(scaler_cls: ScalerClass) -> None:
    device = torch.device(DEVICE)
    dtype = torch.float
    GradScaler = partial(scaler_cls, device=device.type, init_scale=4.0)
    i, s = _sparse_case()

    p = s.clone()
    assert p.is_sparse
    opt = torch.optim.SGD([p], lr=1.0)

    def unscale(grad: torch.Tensor) -> float:
        scaler = GradScaler()
        scaler.scale(torch.ones((), device=device))
        p.grad = grad
        scaler.unscale_(opt)
        return _scale_after_update(scaler)

    assert unscale(s.clone()) == 4.0  # found_inf 0
    _assert_equal(p.grad.to_dense(), (s / 4).to_dense())
    v = torch.tensor([16.0, 32.0, float("inf")])
    assert unscale(torch.sparse_coo_tensor(i, v, torch.Size([2, 3]), device=device, dtype=dtype)) == 2.0
    v = torch.tensor([16.0, 32.0, float("nan")])
    assert unscale(torch.sparse_coo_tensor(i, v, torch.Size([2, 3]), device=device, dtype=dtype)) == 2.0


# ---------------------------------------------------------------------- test_torch.py: test_grad_scaling_state_dict
# pytorch/pytorch test/test_torch.py, TestTorchDeviceType.test_grad_scaling_state_dict. Internals replaced:
# `s1._init_growth_tracker = 7` (a value for load_state_dict to overwrite) -> loading a torch-format state dict with
# _growth_tracker 7; `s1._init_growth_tracker == 0` -> s1.state_dict()["_growth_tracker"] == 0. The type of the lazily
# created s1._scale is checked in test_grad_scaling_state_dict_internals.
@pytest.mark.parametrize("scaler_cls", scalers())
def test_grad_scaling_state_dict(scaler_cls: ScalerClass) -> None:
    device = torch.device(DEVICE)
    GradScaler = partial(scaler_cls, device=device.type)
    for lazy_init_scale in (True, False):
        s0 = GradScaler(init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
        s1 = GradScaler(init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1)
        s1.load_state_dict(
            {"scale": 6.0, "growth_factor": 7.0, "backoff_factor": 0.8, "growth_interval": 1, "_growth_tracker": 7}
        )
        assert s1.state_dict()["_growth_tracker"] == 7  # the seed took
        if lazy_init_scale:
            s1.scale(torch.full((1,), 4.0, dtype=torch.float32, device=device))
        s1.load_state_dict(s0.state_dict())
        assert s1.get_scale() == 3.0
        assert s1.get_growth_factor() == 4.0
        assert s1.get_backoff_factor() == 0.5
        assert s1.get_growth_interval() == 2
        assert s1.state_dict()["_growth_tracker"] == 0


# pytorch/pytorch test/test_torch.py, TestTorchDeviceType.test_grad_scaling_state_dict, as written.
@pytest.mark.parametrize(
    "scaler_cls",
    scalers(
        "writes and reads GradScaler._init_growth_tracker and checks isinstance(s1._scale, torch.FloatTensor) (the "
        "lazily created scale tensor); test_grad_scaling_state_dict checks the rest publicly"
    ),
)
def test_grad_scaling_state_dict_internals(scaler_cls: ScalerClass) -> None:
    device = torch.device(DEVICE)
    GradScaler = partial(scaler_cls, device=device.type)
    for lazy_init_scale in (True, False):
        s0 = GradScaler(init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
        s1 = GradScaler(init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1)
        s1._init_growth_tracker = 7
        if lazy_init_scale:
            s1.scale(torch.full((1,), 4.0, dtype=torch.float32, device=device))
            assert isinstance(s1._scale, torch.FloatTensor)
        s1.load_state_dict(s0.state_dict())
        assert s1.get_scale() == 3.0
        assert s1.get_growth_factor() == 4.0
        assert s1.get_backoff_factor() == 0.5
        assert s1.get_growth_interval() == 2
        assert s1._init_growth_tracker == 0


# ---------------------------------------------------------------------- test_torch.py: _run_scaling_case and its users
RunFn = Callable[..., Any]


def _run_scaling_case(
    scaler_cls: ScalerClass,
    device: str,
    run: RunFn,
    unskipped: int,
    skipped: int,
    atol: float = 1e-7,
    optimizer_ctor: Callable[..., torch.optim.Optimizer] = torch.optim.SGD,
    optimizer_kwargs: Any = None,
) -> None:
    """pytorch/pytorch test/test_torch.py, TestTorchDeviceType._run_scaling_case: train a control (unscaled, the
    overflowing iteration's step left out by hand) and a scaled copy; compare scale, gradients, state, parameters."""
    for enabled in (True, False):  # scaling can be disabled without changing the control flow
        mod_control, mod_scaling, opt_control, opt_scaling, data, loss_fn, skip_iter = _scaling_case(
            device, optimizer_ctor=optimizer_ctor, optimizer_kwargs=optimizer_kwargs
        )
        # A modest initial scale and a growth every step magnify errors in the growth handling.
        GradScaler = partial(scaler_cls, device=device)
        scaler = GradScaler(init_scale=128.0, growth_factor=2.0, enabled=enabled, growth_interval=1)

        _ = run(device, data, mod_control, opt_control, scaler, loss_fn, skip_iter, False)
        ret = run(device, data, mod_scaling, opt_scaling, scaler, loss_fn, skip_iter, True)
        scaler = ret if ret else scaler  # run() may return another scaler instance (after pickling)

        if enabled:
            net_growth = scaler.get_growth_factor() ** unskipped if unskipped > 0 else 1.0
            net_backoff = scaler.get_backoff_factor() ** skipped if skipped > 0 else 1.0
            assert scaler.get_scale() == (128.0 * net_growth * net_backoff)
        else:
            assert scaler.get_scale() == 1.0

        for c, s in zip(mod_control.parameters(), mod_scaling.parameters()):
            _assert_equal(c.grad, s.grad, atol=atol, rtol=1e-05)
            c_state, s_state = opt_control.state[c], opt_scaling.state[s]
            for k in c_state:
                _assert_equal(c_state[k], s_state[k], atol=atol, rtol=1e-05, msg=k)
            _assert_equal(c, s, atol=atol, rtol=1e-05)


# pytorch/pytorch test/test_torch.py, TestTorchDeviceType.test_grad_scaling_autocast (optim_db filtered to AdamW, Adam,
# SGD; dtype float32; foreach/fused as parametrized there). Adam and AdamW are expected to fail the comparison there
# too (the test wraps them in assertRaises(AssertionError)).
@pytest.mark.parametrize("scaler_cls", scalers())
@pytest.mark.parametrize(
    "optimizer_ctor", [torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD], ids=lambda c: c.__name__
)
@pytest.mark.parametrize(
    ("foreach", "fused"), [(None, None), (True, None), (None, True)], ids=["forloop", "foreach", "fused"]
)
def test_grad_scaling_autocast(
    scaler_cls: ScalerClass, optimizer_ctor: Callable[..., torch.optim.Optimizer], foreach: Any, fused: Any
) -> None:
    try_pickle = False

    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):  # type: ignore[no-untyped-def]
        for i, (input, target) in enumerate(data):
            optimizer.zero_grad()
            with torch.autocast(device_type=device, dtype=torch.half, enabled=try_scaling_api):
                output = model(input)
                loss = loss_fn(output, target)
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    with torch.no_grad():
                        model[1].weight.grad.fill_(float("inf"))
                scaler.step(optimizer)
                scaler.update()
                if try_pickle:
                    scaler = pickle.loads(pickle.dumps(scaler))
            else:
                loss.backward()
                if (not scaler.is_enabled()) or (i != skip_iter):
                    optimizer.step()
        return scaler

    # Compares no scaling + no autocasting against scaling + autocasting.
    context: Callable[[], Any] = contextlib.nullcontext
    if optimizer_ctor in (torch.optim.Adam, torch.optim.AdamW):
        context = partial(pytest.raises, AssertionError)
    with context():
        # atol 1e-3: pure float32 arithmetic against a mixture of float16 and float32
        _run_scaling_case(
            scaler_cls,
            DEVICE,
            run,
            unskipped=3,
            skipped=1,
            atol=1e-3,
            optimizer_ctor=optimizer_ctor,
            optimizer_kwargs={"foreach": foreach, "fused": fused},
        )
        try_pickle = True  # read by run()
        _run_scaling_case(
            scaler_cls,
            DEVICE,
            run,
            unskipped=3,
            skipped=1,
            atol=1e-3,
            optimizer_ctor=optimizer_ctor,
            optimizer_kwargs={"foreach": foreach, "fused": fused},
        )


# pytorch/pytorch test/test_torch.py, TestTorchDeviceType.test_grad_scaling_clipping: clip the scaled gradients to
# max_norm * get_scale().
@pytest.mark.parametrize("scaler_cls", scalers())
def test_grad_scaling_clipping(scaler_cls: ScalerClass) -> None:
    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):  # type: ignore[no-untyped-def]
        max_norm = 0.2  # a value that actually clips these gradients
        for i, (input, target) in enumerate(data):
            optimizer.zero_grad()
            output = model(input)
            loss = loss_fn(output, target)
            if try_scaling_api:
                scaler.scale(loss).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm * scaler.get_scale())
                if i == skip_iter and scaler.is_enabled():
                    model[1].weight.grad.data.fill_(float("inf"))
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                if (not scaler.is_enabled()) or (i != skip_iter):
                    optimizer.step()

    _run_scaling_case(scaler_cls, DEVICE, run, unskipped=3, skipped=1, atol=1e-5)


# pytorch/pytorch test/test_torch.py, TestTorchDeviceType.test_grad_scaling_clipping_separate_unscale: unscale_, then
# clip the unscaled gradients.
@pytest.mark.parametrize("scaler_cls", scalers())
def test_grad_scaling_clipping_separate_unscale(scaler_cls: ScalerClass) -> None:
    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):  # type: ignore[no-untyped-def]
        max_norm = 0.2
        for i, (input, target) in enumerate(data):
            optimizer.zero_grad()
            output = model(input)
            loss = loss_fn(output, target)
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    model[1].weight.grad.data.fill_(float("inf"))
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, error_if_nonfinite=False)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                if (not scaler.is_enabled()) or (i != skip_iter):
                    optimizer.step()

    _run_scaling_case(scaler_cls, DEVICE, run, unskipped=3, skipped=1)


# pytorch/pytorch test/test_torch.py, TestTorchDeviceType.test_grad_scaling_penalty: a gradient penalty through
# autograd.grad of the scaled loss (create_graph=True), unscaled by 1 / get_scale().
@pytest.mark.parametrize("scaler_cls", scalers())
def test_grad_scaling_penalty(scaler_cls: ScalerClass) -> None:
    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):  # type: ignore[no-untyped-def]
        for i, (input, target) in enumerate(data):
            optimizer.zero_grad()
            output = model(input)
            loss = loss_fn(output, target)
            if try_scaling_api:
                grad_params = torch.autograd.grad(scaler.scale(loss), model.parameters(), create_graph=True)
                inv_scale = 1.0 / scaler.get_scale()
                grad_params = [p * inv_scale for p in grad_params]
            else:
                grad_params = torch.autograd.grad(loss, model.parameters(), create_graph=True)
            grad_norm = 0
            for grad in grad_params:
                grad_norm += grad.pow(2).sum()
            grad_norm = grad_norm.sqrt()
            loss = loss + grad_norm
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    model[1].weight.grad.data.fill_(float("inf"))
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                if (not scaler.is_enabled()) or (i != skip_iter):
                    optimizer.step()

    _run_scaling_case(scaler_cls, DEVICE, run, unskipped=3, skipped=1)


# pytorch/pytorch test/test_torch.py, TestTorchDeviceType.test_grad_scaling_accumulation: two backward passes per step.
@pytest.mark.parametrize("scaler_cls", scalers())
def test_grad_scaling_accumulation(scaler_cls: ScalerClass) -> None:
    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):  # type: ignore[no-untyped-def]
        iters_to_accumulate = 2
        for i, (input, target) in enumerate(data):
            output = model(input)
            loss = loss_fn(output, target)
            loss = loss / iters_to_accumulate
            if try_scaling_api:
                scaler.scale(loss).backward()
            else:
                loss.backward()
            if (i + 1) % iters_to_accumulate == 0:
                if try_scaling_api:
                    scaler.step(optimizer)
                    scaler.update()
                    optimizer.zero_grad()
                else:
                    optimizer.step()
                    optimizer.zero_grad()

    _run_scaling_case(scaler_cls, DEVICE, run, unskipped=2, skipped=0)


# pytorch/pytorch test/test_torch.py, TestTorchDeviceType.test_grad_scaling_multiple: two models, two optimizers, two
# losses; only optimizer1's gradients overflow, so only its step is skipped.
@pytest.mark.parametrize("scaler_cls", scalers())
def test_grad_scaling_multiple(scaler_cls: ScalerClass) -> None:
    device = torch.device(DEVICE)
    for enabled in (True, False):
        mod_control0, mod_scaling0, opt_control0, opt_scaling0, data, loss_fn, skip_iter = _scaling_case(device.type)
        mod_control1, mod_scaling1, opt_control1, opt_scaling1 = _scaling_models_optimizers(device.type)
        GradScaler = partial(scaler_cls, device=device.type)
        scaler = GradScaler(init_scale=128.0, growth_factor=2.0, enabled=enabled, growth_interval=1)

        def run(  # type: ignore[no-untyped-def]
            model0,
            model1,
            optimizer0,
            optimizer1,
            try_scaling_api,
            scaler=scaler,
            data=data,
            loss_fn=loss_fn,
            skip_iter=skip_iter,
        ):
            for i, (input, target) in enumerate(data):
                optimizer0.zero_grad()
                optimizer1.zero_grad()
                output0 = model0(input)
                output1 = model1(input)
                loss0 = loss_fn(0.3 * output0 + 0.7 * output1, target)
                loss1 = loss_fn(0.6 * output0 - 0.4 * output1, target)
                if try_scaling_api:
                    scaler.scale(loss0).backward(retain_graph=True)
                    scaler.scale(loss1).backward()
                    if i == skip_iter and scaler.is_enabled():
                        model1[1].weight.grad.data.fill_(float("inf"))
                    scaler.unscale_(optimizer0)  # an additional stress test: one optimizer unscaled separately
                    scaler.step(optimizer0)
                    scaler.step(optimizer1)
                    scaler.update()
                else:
                    loss0.backward(retain_graph=True)
                    loss1.backward()
                    optimizer0.step()
                    if (not scaler.is_enabled()) or (i != skip_iter):
                        optimizer1.step()

        run(mod_control0, mod_control1, opt_control0, opt_control1, False)
        run(mod_scaling0, mod_scaling1, opt_scaling0, opt_scaling1, True)

        # Grown 3 times, backed off once. The original's `assertTrue(A == B if enabled else 1.0)` asserts nothing when
        # disabled (assertTrue(1.0)); so does this port.
        if enabled:
            assert scaler.get_scale() == 128.0 * scaler.get_growth_factor() ** 3 * scaler.get_backoff_factor() ** 1

        for c, s in zip(
            itertools.chain(mod_control0.parameters(), mod_control1.parameters()),
            itertools.chain(mod_scaling0.parameters(), mod_scaling1.parameters()),
        ):
            _assert_equal(c, s, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------- test_torch.py: other GradScaler tests
# pytorch/pytorch test/test_torch.py, TestTorchDeviceType.test_grad_scale_will_not_overflow: growth that would reach inf
# is dropped. Internal replaced: scaler._scale -> scaler.get_scale().
@pytest.mark.parametrize("scaler_cls", scalers())
def test_grad_scale_will_not_overflow(scaler_cls: ScalerClass) -> None:
    device = torch.device(DEVICE)
    model = torch.nn.Linear(5, 1).to(device)
    optimizer = torch.optim.Adam(model.parameters())
    scaler = scaler_cls(device=device.type, growth_interval=1, growth_factor=2**4, init_scale=1e38)
    optimizer.zero_grad()
    x = torch.randn(1, 5).to(device)
    y = 1e-30 * torch.randn(1, 1).to(device)
    loss = ((model(x) - y) ** 2).mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    scale = scaler.get_scale()
    assert not (scale == float("inf") or scale != scale), f"the scale should not be inf or nan, got {scale}"


# torch 2.13's optim_db inputs on CPU (torch/testing/_internal/common_optimizers.py, optim_inputs_func(device="cpu")),
# written out because that module cannot be imported here.
_ADAM_INPUTS: list[dict[str, Any]] = [
    {},
    {"lr": 0.01},
    {"weight_decay": 0.1},
    {"weight_decay": 0.1, "maximize": True},
    {"weight_decay": 0.1, "amsgrad": True},
]
OPTIM_INPUTS: dict[type[torch.optim.Optimizer], list[dict[str, Any]]] = {
    torch.optim.Adagrad: [
        {},
        {"weight_decay": 0.1},
        {"weight_decay": 0.1, "maximize": True},
        {"lr": 0.1},
        {"initial_accumulator_value": 0.1, "weight_decay": 0.1},
        {"lr": 0.1, "lr_decay": 0.5, "weight_decay": 0.1},
        {"lr": torch.tensor(0.001)},
    ],
    torch.optim.Adam: _ADAM_INPUTS,
    torch.optim.AdamW: _ADAM_INPUTS,
    torch.optim.SGD: [
        {},
        {"lr": 0.01},
        {"lr": torch.tensor(0.001)},
        {"weight_decay": 0.5},
        {"momentum": 0.9},
        {"weight_decay": 0.1, "maximize": True},
        {"momentum": 0.9, "dampening": 0.5},
        {"momentum": 0.9, "weight_decay": 0.1},
        {"momentum": 0.9, "nesterov": True, "weight_decay": 0.1},
    ],
}


def _inputs_with_fused_flag(optimizer_ctor: type[torch.optim.Optimizer]) -> list[dict[str, Any]]:
    """common_optimizers._get_optim_inputs_including_global_cliquey_kwargs(device="cpu", skip=("differentiable",)):
    each input with fused=False and with fused=True (foreach kernels are not supported on CPU)."""
    return [{**kwargs, "fused": fused} for kwargs in OPTIM_INPUTS[optimizer_ctor] for fused in (False, True)]


# pytorch/pytorch test/test_torch.py,
# TestTorchDeviceType.test_params_invalidated_with_grads_invalidated_between_unscale_and_step: gradients broken after
# unscale_ are not checked again, so the step makes the parameters inf/NaN.
@pytest.mark.parametrize("scaler_cls", scalers())
@pytest.mark.parametrize(
    "optimizer_ctor", [torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD], ids=lambda c: c.__name__
)
def test_params_invalidated_with_grads_invalidated_between_unscale_and_step(
    scaler_cls: ScalerClass, optimizer_ctor: type[torch.optim.Optimizer]
) -> None:
    device = DEVICE
    for kwargs in _inputs_with_fused_flag(optimizer_ctor):
        model, _, optimizer, _, data, loss_fn, _ = _scaling_case(
            device, optimizer_ctor=optimizer_ctor, optimizer_kwargs=kwargs
        )
        scaler = scaler_cls(device=device, init_scale=128.0)
        for input, target in data:
            optimizer.zero_grad()
            with torch.autocast(device_type=device, dtype=torch.half):
                output = model(input)
                loss = loss_fn(output, target)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            for j, param in enumerate(model.parameters()):  # deliberately break the gradients
                param.grad.copy_(torch.inf if j % 2 else torch.nan)
            scaler.step(optimizer)
            scaler.update()
        assert all((p.isnan().any() or p.isinf().any()) for p in model.parameters()), kwargs


@contextlib.contextmanager
def _assert_warns(category: type[Warning]) -> Iterator[None]:
    """unittest's ``assertWarns``: an exception from the body propagates unchecked; otherwise a warning of
    ``category`` must have been issued (pytest.warns would replace the body's exception by "DID NOT WARN")."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    assert any(issubclass(w.category, category) for w in caught), f"{category.__name__} not triggered"


def _pass_itself(scaler_cls: ScalerClass, with_optimizer1: bool) -> None:
    device = torch.device(DEVICE)
    GradScaler = partial(scaler_cls, device=device.type)

    class _PlaceHolderOptimizer(torch.optim.Optimizer):
        def __init__(self, params: Any, defaults: dict[str, Any] | None = None) -> None:
            super().__init__(params, defaults or {})
            self._step_supports_amp_scaling = True

    class Optimizer1(_PlaceHolderOptimizer):
        def step(self, closure: Any = None, *, grad_scaler: Any = None) -> None:  # type: ignore[override]
            assert isinstance(grad_scaler, torch.amp.GradScaler)
            assert not hasattr(self, "grad_scale")
            assert not hasattr(self, "found_inf")

    class Optimizer2(_PlaceHolderOptimizer):
        def step(self, closure: Any = None) -> None:  # type: ignore[override]
            assert isinstance(self.grad_scale, torch.Tensor)
            assert isinstance(self.found_inf, torch.Tensor)

    x = torch.randn(4, 4).to(device)
    m = torch.nn.Linear(4, 1).to(device)
    o1 = Optimizer1(m.parameters())
    o2 = Optimizer2(m.parameters())
    scaler = GradScaler(init_scale=2.0)
    with torch.autocast(device_type=device.type, dtype=torch.half):
        y = m(x)
        loss = y.mean()
    scaler.scale(loss).backward()
    if with_optimizer1:
        with _assert_warns(FutureWarning):
            scaler.step(o1)
    scaler.step(o2)
    scaler.update()


# pytorch/pytorch test/test_torch.py, TestTorchDeviceType.test_grad_scaler_pass_itself, as written: an optimizer that
# takes the scale itself and whose step() has a grad_scaler argument receives the scaler (deprecated, FutureWarning).
@pytest.mark.parametrize(
    "scaler_cls",
    scalers(
        "asserts isinstance(grad_scaler, torch.amp.GradScaler) for the scaler passed as step(grad_scaler=...) to an "
        "optimizer with _step_supports_amp_scaling whose step() takes grad_scaler (torch's deprecated protocol, with a "
        "FutureWarning); dls.GradScaler is not a torch.amp.GradScaler subclass and sets grad_scale/found_inf instead",
        raises=(AssertionError,),
    ),
)
def test_grad_scaler_pass_itself(scaler_cls: ScalerClass) -> None:
    _pass_itself(scaler_cls, with_optimizer1=True)


# pytorch/pytorch test/test_torch.py, TestTorchDeviceType.test_grad_scaler_pass_itself, its Optimizer2 half alone: an
# optimizer that takes the scale itself finds grad_scale and found_inf tensors set during its step().
@pytest.mark.parametrize("scaler_cls", scalers())
def test_grad_scaler_pass_itself_grad_scale_and_found_inf(scaler_cls: ScalerClass) -> None:
    _pass_itself(scaler_cls, with_optimizer1=False)


# ---------------------------------------------------------------------- test_optim.py
# pytorch/pytorch test/test_optim.py, TestOptimRenewed.test_grad_scaling_autocast_fused_optimizers (the optimizers fused
# on CPU: Adagrad, Adam, AdamW, SGD): a fused optimizer, which unscales inside its kernel, against its for-loop
# implementation, both under a scaler at init_scale 128, with and without a separate unscale_.
@pytest.mark.parametrize("scaler_cls", scalers())
@pytest.mark.parametrize("optim_cls", list(OPTIM_INPUTS), ids=lambda c: c.__name__)
def test_grad_scaling_autocast_fused_optimizers(
    scaler_cls: ScalerClass, optim_cls: type[torch.optim.Optimizer]
) -> None:
    device = DEVICE
    for optim_kwargs in OPTIM_INPUTS[optim_cls]:
        for separate_unscale in (True, False):
            kwargs = {**copy.deepcopy(optim_kwargs), "fused": True}
            torch.manual_seed(20)
            mod_control, mod_scaling, opt_control, opt_scaling, data, loss_fn, _ = _scaling_case(
                device, optimizer_ctor=optim_cls, optimizer_kwargs=kwargs
            )
            optimizer_kwargs = copy.deepcopy(kwargs)
            optimizer_kwargs["fused"] = False
            if "lr" not in kwargs:
                optimizer_kwargs["lr"] = 1.0  # as _scaling_case sets it
            opt_control = optim_cls(mod_control.parameters(), **optimizer_kwargs)
            scaler_scaling = scaler_cls(device, init_scale=128.0)
            scaler_control = scaler_cls(device, init_scale=128.0)

            tracker = _Tracker()
            # Float betas differ between float64 (for-loop) and float32 (fused) arithmetic: wider tolerance for the
            # parameters and exp_avg_sq / max_exp_avg_sq.
            assert_eq_kwargs: dict[str, float] = {}
            if "betas" in opt_control.param_groups[0] and not torch.is_tensor(opt_control.param_groups[0]["betas"][0]):
                assert_eq_kwargs = {"atol": 2e-5, "rtol": 2e-5}
            for input, target in data:
                opt_control.zero_grad()
                with torch.autocast(device_type=device, dtype=torch.half):
                    output_control = mod_control(input)
                    loss_control = loss_fn(output_control, target)
                scaler_control.scale(loss_control).backward()
                scaler_control.step(opt_control)
                scaler_control.update()

                opt_scaling.zero_grad()
                with torch.autocast(device_type=device, dtype=torch.half):
                    output_scaling = mod_scaling(input)
                    loss_scaling = loss_fn(output_scaling, target)
                scaler_scaling.scale(loss_scaling).backward()
                if separate_unscale:
                    scaler_scaling.unscale_(opt_scaling)
                scaler_scaling.step(opt_scaling)
                scaler_scaling.update()

                tracker.add(loss_control)
                tracker.pop_check_set(loss_scaling)
                for param_control, param_scaling in zip(mod_control.parameters(), mod_scaling.parameters()):
                    tracker.add(param_control.grad)
                    tracker.pop_check_set(param_scaling.grad)
                    tracker.add(param_control)
                    tracker.pop_check_set(param_scaling, assert_eq_kwargs)
                    state_control = opt_control.state[param_control]
                    state_scaling = opt_scaling.state[param_scaling]
                    for k in state_control:
                        actual = state_scaling[k]
                        if k == "step":
                            actual = actual.squeeze()
                        tracker.add(state_control[k])
                        tracker.pop_check_set(actual, assert_eq_kwargs if k in ("exp_avg_sq", "max_exp_avg_sq") else {})
