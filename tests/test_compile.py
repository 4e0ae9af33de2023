"""``torch.compile`` and CUDA graphs.

Dynamo traces ``scale``, ``unscale_``, ``clip_gradients_and_return_isfinite`` and ``update`` with
``fullgraph=True`` (any graph break is an error). ``step`` + ``update`` on the sync-free paths (torch's fused
optimizers, ``sync_free=True``) trace as one graph too once torch's own breaks are taken out of the picture:
``torch.optim.Optimizer.step`` inserts two (``torch._dynamo.graph_break()`` in ``torch/optim/optimizer.py``,
``_use_grad``) and the entry points of the fused kernels are ``torch.compiler.disable()``d. In real use those
breaks remain, and only those. The ``eager`` and ``aot_eager`` backends keep the tests to seconds (no C++ code
generation).

Two differences of torch releases before 2.13 (torch 2.11 seen): Dynamo cannot set an attribute of an optimizer
(pytorch issue 171590), so dls hands the fused kernel its scale and flag outside the graph there (a break beside
the fused kernel's own; the one-graph test of the fused path needs torch 2.13); and Dynamo rewrites
``Tensor.add_(x, alpha=a)`` as ``add_(mul(x, a))``, two roundings where the eager kernel fuses them, so torch.optim's
own ``param.add_(update, alpha=-lr)`` differs from eager in the last bit unless that rewrite is off.

CUDA graph capture of a whole training iteration, fused optimizer included, runs when a GPU is present.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import dls
from conftest import inject, loss_of, tiny_model

OLD_DYNAMO = torch.__version__ < (2, 13)  # type: ignore[operator]  # see the module docstring


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def make(opt_kwargs: dict[str, Any] | None = None, **scaler_kwargs: Any) -> tuple[Any, Any, dls.GradScaler]:
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, **(opt_kwargs or {"momentum": 0.9}))
    return model, opt, dls.GradScaler("dynamic", **scaler_kwargs)


def backward(model: torch.nn.Module, scaler: dls.GradScaler, overflow: bool = False) -> None:
    scaler.scale(loss_of(model, 1)).backward()
    if overflow:
        inject(model)


def take_first_step(model: torch.nn.Module, opt: torch.optim.Optimizer, scaler: dls.GradScaler) -> None:
    """An optimizer's first step is decided on the host (its state does not exist yet); later ones on device."""
    backward(model, scaler)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


def full(fn: Callable[..., Any], backend: str = "eager") -> Callable[..., Any]:
    return torch.compile(fn, fullgraph=True, backend=backend)


# ---------------------------------------------------------------------------------------------- fullgraph
def test_scale_compiles_to_one_graph() -> None:
    _, _, scaler = make()
    loss = torch.tensor(3.0, requires_grad=True) * 1.0
    scaled = full(scaler.scale)(loss)
    assert scaled.item() == 3.0 * scaler.get_scale()
    halves = full(scaler.scale)([loss.half(), loss.bfloat16()])
    assert [h.dtype for h in halves] == [torch.float32, torch.float32]


@pytest.mark.parametrize("clip", [False, True], ids=["unscale_", "clip"])
def test_unscale_and_clip_compile_to_one_graph(clip: bool) -> None:
    model, opt, scaler = make(max_gradient_norm=0.5)
    backward(model, scaler, overflow=True)
    if clip:
        finite = full(scaler.clip_gradients_and_return_isfinite)(opt)
        assert not bool(finite)
    else:
        full(scaler.unscale_)(opt)
    scaler.step(opt)
    scaler.update()
    assert scaler.get_num_skipped_steps() == 1


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize(
    "rule",
    [{}, {"hysteresis": 2, "overflow_tolerance": 0.25}, {"hysteresis": 3, "consecutive_hysteresis": True}],
    ids=["cerebras", "hysteresis-tolerance", "consecutive"],
)
def test_compiled_update_equals_eager_update(backend: str, rule: dict[str, Any]) -> None:
    """The compiled rule updates the scaler's buffers in place, step after step, like the eager one."""
    pattern = [False, False, True, False, False, False, True, True, False, False]
    eager = make(steps_per_increase=2, init_scale=2.0**8, **rule)
    compiled = make(steps_per_increase=2, init_scale=2.0**8, **rule)
    update = full(compiled[2].update, backend)
    for overflow in pattern:
        for (model, opt, scaler), do_update in ((eager, eager[2].update), (compiled, update)):
            backward(model, scaler, overflow)
            scaler.unscale_(opt)
            do_update()
            opt.zero_grad()
        assert eager[2].state_dict() == compiled[2].state_dict()
    assert compiled[2].get_num_skipped_steps() == 3


# ---------------------------------------------------------------------------------------------- step
# torch's own optimizer code is not dls's to make traceable: Optimizer.step calls torch._dynamo.graph_break()
# twice (torch/optim/optimizer.py, _use_grad) and the fused kernels' entry points are torch.compiler.disable()d.
# The step tests take those two out of the picture, so that fullgraph=True fails on any break dls causes.
@pytest.fixture
def no_optimizer_breaks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch._dynamo, "graph_break", lambda: None)


@pytest.mark.skipif(
    OLD_DYNAMO,
    reason=f"torch {torch.__version__}: Dynamo before 2.13 cannot set an optimizer's attributes (pytorch issue "
    "171590), so dls hands the fused kernel its scale and flag outside the graph",
)
@pytest.mark.parametrize("clip", [None, 1.0], ids=["fused", "fused-clip"])
def test_fused_optimizer_step_and_update_compile_to_one_graph(clip: float | None) -> None:
    model, opt, scaler = make({"momentum": 0.9, "fused": True}, max_gradient_norm=clip)
    take_first_step(model, opt, scaler)
    backward(model, scaler, overflow=True)
    handed: list[tuple[Any, Any]] = []

    def fused_kernel_stand_in() -> None:  # what torch's fused step reads from the optimizer
        handed.append((opt.grad_scale, opt.found_inf))  # type: ignore[attr-defined]

    opt.step = fused_kernel_stand_in  # type: ignore[method-assign]

    def iteration() -> None:
        scaler.step(opt)
        scaler.update()

    full(iteration)()
    ((grad_scale, found_inf),) = handed
    assert float(found_inf) == 1.0
    assert (grad_scale is None) == (clip is not None)  # clipped gradients are already unscaled
    assert scaler.get_num_skipped_steps() == 1
    assert not hasattr(opt, "grad_scale")


@pytest.mark.parametrize("clip", [None, 1.0], ids=["fused", "fused-clip"])
def test_compiled_fused_step_equals_eager(clip: float | None) -> None:
    """Compiled as users compile it (graph breaks allowed) with torch's real fused SGD: the same parameters, state
    and scaler state as eager, over an overflow and clean steps, on every torch (before 2.13, setting the
    optimizer's attributes in the traced frame raised)."""
    runs = []
    for compiled in (False, True):
        model, opt, scaler = make({"momentum": 0.9, "fused": True}, max_gradient_norm=clip)
        take_first_step(model, opt, scaler)

        def iteration(opt: torch.optim.Optimizer = opt, scaler: dls.GradScaler = scaler) -> None:
            scaler.step(opt)
            scaler.update()

        run = torch.compile(iteration, backend="eager") if compiled else iteration
        for overflow in (True, False, False):
            backward(model, scaler, overflow)
            run()
            opt.zero_grad()
        assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
        runs.append((model, opt, scaler))
    (eager_model, eager_opt, eager_scaler), (model, opt, scaler) = runs
    assert scaler.state_dict() == eager_scaler.state_dict() and scaler.get_num_skipped_steps() == 1
    for p, q in zip(model.parameters(), eager_model.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["momentum_buffer"], eager_opt.state[q]["momentum_buffer"])


def test_sync_free_step_and_update_compile_to_one_graph(
    no_optimizer_breaks: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if OLD_DYNAMO:  # traced, torch.optim's own SGD update rounds twice there (module docstring): rewrite off
        monkeypatch.setattr(torch._dynamo.config, "enable_dynamo_decompositions", False)
    model, opt, scaler = make(sync_free=True)
    eager_model, eager_opt, eager_scaler = make(sync_free=True)
    take_first_step(model, opt, scaler)
    take_first_step(eager_model, eager_opt, eager_scaler)

    def iteration() -> None:
        scaler.step(opt)
        scaler.update()

    compiled = full(iteration)
    for overflow in (True, False, False):
        backward(model, scaler, overflow)
        compiled()
        opt.zero_grad()
        backward(eager_model, eager_scaler, overflow)
        eager_scaler.step(eager_opt)
        eager_scaler.update()
        eager_opt.zero_grad()
    assert scaler.state_dict() == eager_scaler.state_dict()
    for p, q in zip(model.parameters(), eager_model.parameters()):
        assert torch.equal(p, q)


def test_default_step_does_not_compile_to_one_graph(no_optimizer_breaks: None) -> None:
    # The default path reads the flag back (`if found_inf.item()`), which no graph can hold: this is what the
    # sync-free paths are for. The test pins the difference.
    model, opt, scaler = make()
    backward(model, scaler)

    def iteration() -> None:
        scaler.step(opt)
        scaler.update()

    with pytest.raises(Exception, match=r"data-dependent|item"):
        full(iteration)()


# ---------------------------------------------------------------------------------------------- CUDA graphs
@pytest.mark.cuda
def test_cuda_graph_captures_a_whole_iteration_with_a_fused_optimizer() -> None:
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True, capturable=True)
    scaler = dls.GradScaler(init_scale=2.0**10, steps_per_increase=3)
    static_x = torch.randn(8, 16, device=device)
    static_y = torch.randn(8, 4, device=device)

    def iteration() -> None:
        loss = torch.nn.functional.mse_loss(model(static_x), static_y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            iteration()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        iteration()

    scale = scaler.get_scale()
    params = [p.detach().clone() for p in model.parameters()]
    static_y.fill_(float("inf"))  # every gradient overflows: the replay must skip and back off
    graph.replay()
    torch.cuda.synchronize()
    assert scaler.get_scale() == scale / 2
    for p, q in zip(model.parameters(), params):
        assert torch.equal(p, q)
    static_y.normal_()
    for _ in range(4):  # cstorch grows after steps_per_increase + 1 clean steps: four replays grow it back
        graph.replay()
    torch.cuda.synchronize()
    assert scaler.get_scale() == scale
    assert not any(torch.equal(p, q) for p, q in zip(model.parameters(), params))
