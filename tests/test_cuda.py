"""dls on a CUDA device: the paths no CPU run can prove.

Every test that needs a GPU is marked ``cuda`` and skips where ``torch.cuda.is_available()`` is False. Where a CPU
analogue exists it runs here on the ``device`` of the run (the CPU unless ``--device cuda`` / ``DLS_TEST_DEVICE=cuda``),
so that the test's logic is exercised in CI too, and the helpers (counting host syncs, finding graph-break sites) are
unit-tested on the CPU with stand-ins.

* fused Adam/AdamW/SGD taking ``grad_scale`` / ``found_inf``: bit-identical to ``torch.amp.GradScaler("cuda")``
  over runs with overflows; float16 and bfloat16 autocast likewise;
* host syncs counted with ``torch.cuda.set_sync_debug_mode("warn")``: none on the fused and ``sync_free`` paths,
  exactly one per step on the default path, and none in ``update()``, whose new scale reaches the host without a
  sync (else the default path would read the scale too once the host's bound of it decayed below 1);
* CUDA graphs: forward + ``scale`` + backward captured (PyTorch's ``test_graph_grad_scaling``) for any optimizer,
  and the whole step with capturable fused optimizers and ``sync_free=True``, replays bit-identical to eager,
  overflows and scale changes included;
* ``torch.compile`` of a whole step with a fused optimizer: no graph break inside dls's code;
* a one-rank NCCL process group through the distributed code path (gloo on the CPU);
* ``dls.fp8.emulate_recipe`` and ``dls.master_weights`` on the device.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import logging
import os
import re
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dls
import dls.fp8
from conftest import (
    DLS_DIR,
    INF,
    NAN,
    assert_same,
    assert_tensors_equal,
    dist_env,
    dls_scaler,
    free_port,
    inject,
    loss_of,
    requested_device,
    snapshot,
    tiny_model,
    torch_scaler,
    train,
)
from dls.fp8 import CurrentScaling, DelayedScaling

CUDA = torch.device("cuda")
# Overflows isolated, in a burst and at a growth boundary (growth interval 10). Not at the very first step: there
# torch's fused SGD keeps the uninitialised momentum buffers its skipped kernel created (dls decides that step on
# the host and creates none), so the two states differ by design; tests/test_torch_differential.py covers a first
# overflowing step with fused AdamW.
OVERFLOWS = {1: INF, 3: NAN, 4: -INF, 5: INF, 19: NAN, 31: INF}
FUSED = {
    "Adam": lambda ps: torch.optim.Adam(ps, lr=1e-3, fused=True),
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
    "SGD": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, fused=True),
}


# ---------------------------------------------------------------------------------------------- the switch
def test_device_switch_reads_the_option_then_the_environment_and_refuses_cuda_without_a_gpu() -> None:
    assert requested_device(None, {}, False) == torch.device("cpu")
    assert requested_device(None, {"DLS_TEST_DEVICE": ""}, False) == torch.device("cpu")
    assert requested_device(None, {"DLS_TEST_DEVICE": "cuda"}, True) == torch.device("cuda")
    assert requested_device("cuda:1", {"DLS_TEST_DEVICE": "cpu"}, True) == torch.device("cuda", 1)
    assert requested_device("cpu", {"DLS_TEST_DEVICE": "cuda"}, False) == torch.device("cpu")  # the option wins
    with pytest.raises(pytest.UsageError, match=r"DLS_TEST_DEVICE=cuda asks for CUDA, but torch.cuda.is_available"):
        requested_device(None, {"DLS_TEST_DEVICE": "cuda"}, False)
    with pytest.raises(pytest.UsageError, match=r"--device=cuda:0 asks for CUDA"):
        requested_device("cuda:0", {}, False)
    for bad in ("tpu", "meta", "cpu:1", "cuda:x", "gpu"):
        with pytest.raises(pytest.UsageError, match=f"must be 'cpu', 'cuda' or 'cuda:N'; got '{bad}'"):
            requested_device(bad, {}, True)


def test_the_device_fixture_is_the_requested_device(device: torch.device, pytestconfig: pytest.Config) -> None:
    option = pytestconfig.getoption("--device")
    assert device == requested_device(option, os.environ, torch.cuda.is_available())


def test_tests_on_the_device_fixture_are_marked_device(device: torch.device, request: pytest.FixtureRequest) -> None:
    """``-m "cuda or device"`` (scripts/gpu-check) selects them."""
    assert request.node.get_closest_marker("device") is not None


@pytest.mark.parametrize("device", ["a test's own argument"])
def test_a_parametrised_device_argument_is_not_marked_device(device: str, request: pytest.FixtureRequest) -> None:
    assert request.node.get_closest_marker("device") is None


# ---------------------------------------------------------------------------------------------- counting host syncs
SYNC_WARNING = "called a synchronizing CUDA operation"


@contextlib.contextmanager
def counted_syncs(
    get_mode: Callable[[], Any] = torch.cuda.get_sync_debug_mode,
    set_mode: Callable[[Any], None] = torch.cuda.set_sync_debug_mode,
) -> Iterator[list[str]]:
    """The host syncs made inside the block, counted by CUDA's sync debug mode ("warn": one warning per sync, in
    C++ too), as a list filled when the block ends. The previous mode is restored; other warnings pass through."""
    syncs: list[str] = []
    previous = get_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        set_mode("warn")
        try:
            yield syncs
        finally:
            set_mode(previous)
    for w in caught:
        if SYNC_WARNING in str(w.message):
            syncs.append(str(w.message))
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def test_counted_syncs_counts_the_sync_warnings_and_restores_the_mode() -> None:
    """With a stand-in for CUDA's mode switch: a device whose syncs warn as CUDA's do in "warn" mode."""
    modes = ["default"]

    def sync() -> None:
        if modes[-1] == "warn":
            warnings.warn(SYNC_WARNING, UserWarning, stacklevel=1)

    with pytest.warns(DeprecationWarning, match="unrelated"), counted_syncs(lambda: modes[-1], modes.append) as syncs:
        sync()
        warnings.warn("unrelated", DeprecationWarning, stacklevel=1)
        sync()
        assert modes[-1] == "warn"
    assert len(syncs) == 2
    assert modes[-1] == "default"
    with pytest.raises(KeyError), counted_syncs(lambda: modes[-1], modes.append):
        raise KeyError("a failing block")
    assert modes[-1] == "default"
    with counted_syncs(lambda: modes[-1], modes.append) as syncs:
        pass
    assert syncs == []


# ---------------------------------------------------------------------------------------------- fused optimizers
def check_fused_like_torch_amp(name: str, device: torch.device) -> None:
    runs = []
    for scaler in (torch_scaler(2.0**12, 10, device), dls_scaler(2.0**12, 10)):
        model = tiny_model(device=device)
        opt = FUSED[name](list(model.parameters()))
        states = train(scaler, model, opt, range(40), OVERFLOWS)
        runs.append(([s["scale"] for s in states], snapshot(model, opt)))
    (ref_scales, ref_state), (scales, state) = runs
    assert scales == ref_scales
    assert len(set(scales)) > 3  # the scale grew and backed off
    assert_same(state, ref_state, f"fused {name} on {device}")


@pytest.mark.cuda
@pytest.mark.parametrize("name", sorted(FUSED))
def test_fused_optimizers_take_grad_scale_and_found_inf_like_torch_amp_on_cuda(name: str) -> None:
    check_fused_like_torch_amp(name, CUDA)


@pytest.mark.parametrize("name", sorted(FUSED))
def test_fused_optimizers_take_grad_scale_and_found_inf_like_torch_amp(name: str, device: torch.device) -> None:
    check_fused_like_torch_amp(name, device)


def autocast_run(scaler: Any, device: torch.device, dtype: torch.dtype, steps: int = 40) -> tuple[list[float], Any]:
    """An MLP under ``dtype`` autocast with fused AdamW, whose first steps overflow by themselves at 2**16 in
    float16 (inputs of magnitude ~30, loss times 50)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    data = torch.Generator().manual_seed(3)
    scales = []
    for step in range(steps):
        x = (torch.randn(64, 16, generator=data) * 30).to(device)
        with torch.autocast(device.type, dtype=dtype):
            loss = model(x).float().pow(2).mean() * 50
        scaler.scale(loss).backward()
        if step == 7:
            inject(model, NAN)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return scales, snapshot(model, opt)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_autocast_on_cuda_trains_bit_identically_to_torch_amp(dtype: torch.dtype) -> None:
    ref_scales, ref_state = autocast_run(torch.amp.GradScaler("cuda"), CUDA, dtype)
    scales, state = autocast_run(dls.GradScaler("cuda"), CUDA, dtype)
    assert scales == ref_scales
    assert min(scales) < 2.0**16  # overflows happened (the injected one at least) and were skipped alike
    assert_same(state, ref_state, f"{dtype} autocast on CUDA")


def test_bfloat16_autocast_trains_bit_identically_to_torch_amp(device: torch.device) -> None:
    ref_scales, ref_state = autocast_run(torch.amp.GradScaler(device.type), device, torch.bfloat16, steps=12)
    scales, state = autocast_run(dls.GradScaler(device.type), device, torch.bfloat16, steps=12)
    assert scales == ref_scales and min(scales) < 2.0**16
    assert_same(state, ref_state, f"bfloat16 autocast on {device}")


# ---------------------------------------------------------------------------------------------- host syncs
SYNC_FREE_CASES = {
    "Adam-fused": ("Adam", {"fused": True}, False),
    "AdamW-fused": ("AdamW", {"fused": True}, False),
    "SGD-fused": ("SGD", {"fused": True, "momentum": 0.9}, False),
    "SGD-sync_free": ("SGD", {"momentum": 0.9}, True),
    "Adam-capturable-sync_free": ("Adam", {"capturable": True}, True),
}


def sync_counts(
    device: torch.device, name: str, kwargs: dict[str, Any], sync_free: bool, steps: int
) -> list[tuple[int, int]]:
    """``(syncs in scale + step, syncs in update)`` of each iteration at scale 2**16 (an overflow at step 5),
    counted by ``counted_syncs``."""
    model = tiny_model(device=device)
    opt = getattr(torch.optim, name)(model.parameters(), lr=0.01, **kwargs)
    scaler = dls.GradScaler(sync_free=sync_free)
    counts = []
    for step in range(steps):
        loss = loss_of(model, step)
        with counted_syncs() as in_step:
            scaled = scaler.scale(loss)
        scaled.backward()
        if step == 5:
            inject(model, INF, index=3)
        with counted_syncs() as more:
            scaler.step(opt)
        in_step += more
        with counted_syncs() as in_update:
            scaler.update()
        opt.zero_grad()
        counts.append((len(in_step), len(in_update)))
    assert scaler.get_num_skipped_steps() == 1
    return counts


@pytest.mark.cuda
@pytest.mark.parametrize("case", list(SYNC_FREE_CASES))
def test_fused_and_sync_free_paths_make_no_host_sync_on_cuda(case: str) -> None:
    counts = sync_counts(CUDA, *SYNC_FREE_CASES[case], steps=40)
    # The optimizer's first step is decided on the host (its state does not exist yet); none after, for 40 steps
    # at 2**16: past the 17 updates after which an unpublished scale's host bound would be below 1.
    assert counts[1:] == [(0, 0)] * 39, counts


@pytest.mark.cuda
def test_default_path_syncs_once_per_step_and_update_publishes_the_scale_without_a_sync() -> None:
    counts = sync_counts(CUDA, "SGD", {"momentum": 0.9}, False, steps=40)
    # One read of the overflow flag per step. Were the scale not published to the host by update() (an async copy
    # to pinned memory behind an event), the host's bound of the scale would fall below 1 after 17 updates at
    # 2**16 and the default step would read the scale as well: two syncs in those steps.
    assert counts[1:] == [(1, 0)] * 39, counts


# ---------------------------------------------------------------------------------------------- CUDA graphs
def graph_grad_scaling(scaler: Any, make_opt: Callable[[list[torch.Tensor]], torch.optim.Optimizer]) -> list[Any]:
    """PyTorch's ``test_graph_grad_scaling``: forward, ``scale`` and backward captured in a CUDA graph, ``step`` and
    ``update`` eager; replays at inputs 5, 20000, 5, 40000 with init scale 4 (the scaled float16 gradient overflows
    at 20000 and 40000). Returns, per replay, the gradient, the scale after the update and the weight."""
    weight = torch.ones((100,), device=CUDA, requires_grad=True)
    opt = make_opt([weight])
    static_input = torch.ones_like(weight)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: the scaler makes its device tensors here, not in the capture
        scaler.scale((weight.half() * static_input).sum()).backward()
    torch.cuda.current_stream().wait_stream(side)
    opt.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        graph.capture_begin()
        scaler.scale((weight.half() * static_input).sum()).backward()
        graph.capture_end()
    out = []
    for value in (5, 20000, 5, 40000):
        static_input.copy_(torch.full_like(static_input, value))
        graph.replay()
        assert weight.grad is not None
        grad = weight.grad.clone()
        scaler.step(opt)
        scaler.update()
        out.append((grad, scaler.get_scale(), weight.detach().clone()))
    return out


@pytest.mark.cuda
@pytest.mark.parametrize(
    "make_opt",
    [lambda ps: torch.optim.SGD(ps, lr=0.1), lambda ps: torch.optim.Adam(ps, lr=0.1)],
    ids=["SGD", "Adam"],
)
def test_captured_forward_scale_backward_replays_like_torch_amp(make_opt: Any) -> None:
    ours = graph_grad_scaling(dls.GradScaler("cuda", init_scale=4.0), make_opt)
    theirs = graph_grad_scaling(torch.amp.GradScaler("cuda", init_scale=4.0), make_opt)
    assert [s for _, s, _ in ours] == [4.0, 2.0, 2.0, 1.0]  # torch's expected_scales
    expected_grads = [5 * 4, INF, 5 * 2, INF]
    for (grad, _, _), value in zip(ours, expected_grads):
        assert torch.equal(grad, torch.full_like(grad, value))
    for i, ((g, s, w), (g_ref, s_ref, w_ref)) in enumerate(zip(ours, theirs)):
        assert s == s_ref, i
        assert_tensors_equal([g, w], [g_ref, w_ref], f"replay {i}")


WHOLE_STEP_CASES = {
    "Adam-fused-capturable": ("Adam", {"fused": True, "capturable": True}, False),
    "AdamW-fused-capturable": ("AdamW", {"fused": True, "capturable": True}, False),
    "Adam-capturable-sync_free": ("Adam", {"capturable": True}, True),
    "SGD-sync_free": ("SGD", {"momentum": 0.9}, True),
}


@pytest.mark.cuda
@pytest.mark.parametrize("case", list(WHOLE_STEP_CASES))
def test_whole_step_captured_replays_bit_identical_to_eager(case: str) -> None:
    """The whole iteration (forward, scale, backward, step, update) captured after warm-up steps; each replay
    against the same iteration run eagerly on an identical copy, through overflows (inf inputs) and growth."""
    name, kwargs, sync_free = WHOLE_STEP_CASES[case]
    torch.manual_seed(0)
    template = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to(CUDA)
    copies = []
    for _ in range(2):
        model = copy.deepcopy(template)
        opt = getattr(torch.optim, name)(model.parameters(), lr=1e-3, **kwargs)
        scaler = dls.GradScaler(init_scale=2.0**10, steps_per_increase=3, sync_free=sync_free)
        x, y = torch.zeros(8, 16, device=CUDA), torch.zeros(8, 4, device=CUDA)
        copies.append((model, opt, scaler, x, y))
    inputs = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 16, generator=inputs), torch.randn(8, 4, generator=inputs)) for _ in range(12)]
    for i in (4, 8, 9):  # overflows after the capture: the replays must skip and back off
        batches[i][0][0, 0] = INF

    def iteration(model: Any, opt: Any, scaler: dls.GradScaler, x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()

    captured, eager = copies
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for bx, by in batches[:3]:
            captured[3].copy_(bx)
            captured[4].copy_(by)
            iteration(*captured)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        iteration(*captured)
    for bx, by in batches[:3]:
        eager[3].copy_(bx)
        eager[4].copy_(by)
        iteration(*eager)
    scales = set()
    for step, (bx, by) in enumerate(batches[3:], start=3):
        for target in (captured, eager):
            target[3].copy_(bx)
            target[4].copy_(by)
        graph.replay()
        iteration(*eager)
        torch.cuda.synchronize()
        assert captured[2].get_scale() == eager[2].get_scale(), f"step {step}"
        assert_tensors_equal(captured[0].parameters(), eager[0].parameters(), f"step {step}")
        scales.add(eager[2].get_scale())
    assert len(scales) > 2  # backed off and grew during the replays
    assert captured[2].state_dict() == eager[2].state_dict()
    assert eager[2].get_num_skipped_steps() == 3


# ---------------------------------------------------------------------------------------------- torch.compile
GRAPH_BREAK_LOG = "torch._dynamo.symbolic_convert.__graph_breaks"


@contextlib.contextmanager
def graph_break_sites() -> Iterator[list[str]]:
    """``"file:line"`` of the innermost frame of every graph break Dynamo takes inside the block (from its
    ``graph_breaks`` log), as a list filled as they happen."""
    sites: list[str] = []

    class Sites(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            sites.extend(f"{f}:{n}" for f, n in re.findall(r"in user code at (.+?):(\d+)", record.getMessage()))

    handler = Sites()
    logger = logging.getLogger(GRAPH_BREAK_LOG)
    torch._logging.set_logs(graph_breaks=True)
    logger.addHandler(handler)
    try:
        yield sites
    finally:
        logger.removeHandler(handler)
        torch._logging.set_logs()


def test_graph_break_sites_names_the_frame_that_breaks() -> None:
    torch._dynamo.reset()

    def breaks(x: torch.Tensor) -> torch.Tensor:
        x = x + 1
        torch._dynamo.graph_break()
        return x * 2

    with graph_break_sites() as sites:
        out = torch.compile(breaks, backend="eager")(torch.ones(2))
    torch._dynamo.reset()
    assert out.tolist() == [4.0, 4.0]
    assert len(sites) == 1 and sites[0].startswith(f"{__file__}:"), sites


def compiled_step_run(device: torch.device) -> tuple[list[str], Any, Any]:
    """A whole step (forward, ``scale``, backward, ``step``, ``update``, ``zero_grad``) with fused AdamW,
    compiled (eager backend) on one copy and eager on another, through an overflow. Returns the graph-break
    sites and both copies' snapshots and scaler states (each copy skipped its overflowing step)."""
    torch._dynamo.reset()
    runs = []
    sites: list[str] = []
    for compiled in (True, False):
        model = tiny_model(device=device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        scaler = dls.GradScaler(init_scale=2.0**10, steps_per_increase=2)
        big = torch.tensor(1.0, device=device)

        def step(model: Any = model, opt: Any = opt, scaler: Any = scaler, big: Any = big) -> None:
            scaler.scale(loss_of(model) * big).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()

        step()  # an optimizer's first step is decided on the host (its state does not exist yet): eager
        run = torch.compile(step, backend="eager") if compiled else step
        with graph_break_sites() if compiled else contextlib.nullcontext([]) as found:
            for i in range(5):
                big.fill_(INF if i == 2 else 1.0)
                run()
        sites += found
        assert scaler.get_num_skipped_steps() == 1
        runs.append((snapshot(model, opt), scaler.state_dict()))
    torch._dynamo.reset()
    return sites, runs[0], runs[1]


def check_compiled_step(device: torch.device) -> None:
    sites, (state, scaler_state), (ref_state, ref_scaler_state) = compiled_step_run(device)
    assert sites, "expected torch's own breaks (backward, Optimizer.step, the fused kernel)"
    inside_dls = [s for s in sites if s.startswith(DLS_DIR)]
    if torch.__version__ < (2, 13):  # type: ignore[operator]
        # Dynamo cannot set an optimizer's attributes there: dls.device_step.fused_step hands the fused kernel its
        # scale and flag outside the graph, a break beside the kernel's own.
        inside_dls = [s for s in inside_dls if not s.startswith(os.path.join(DLS_DIR, "device_step.py:"))]
    assert inside_dls == [], f"graph breaks inside dls: {inside_dls}"
    assert scaler_state == ref_scaler_state
    assert_same(state, ref_state, "compiled vs eager")


@pytest.mark.slow  # Dynamo's first compile in a process: a few seconds
def test_compiled_step_with_a_fused_optimizer_breaks_only_in_torch(device: torch.device) -> None:
    check_compiled_step(device)


@pytest.mark.cuda
def test_compiled_step_with_a_fused_optimizer_breaks_only_in_torch_on_cuda() -> None:
    check_compiled_step(CUDA)


# ---------------------------------------------------------------------------------------------- one-rank group
@contextlib.contextmanager
def one_rank_group(backend: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A process group of this process alone (rank 0 of 1, on 127.0.0.1), destroyed after the block."""
    assert not dist.is_initialized()
    interface = dist_env().get("GLOO_SOCKET_IFNAME")
    if backend == "gloo" and interface is not None:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", interface)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def ddp_run(scaler: Any, device: torch.device) -> tuple[list[float], Any]:
    """A tiny model in DDP (one rank) with SGD, overflows injected: scales and final state."""
    model = tiny_model(device=device)
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index or 0] if device.type == "cuda" else None
    )
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    scales = []
    for step in range(12):
        scaler.scale(loss_of(ddp, step)).backward()
        if step in (2, 7):
            inject(model, NAN if step == 2 else INF)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return scales, snapshot(model, opt)


def check_one_rank_group(backend: str, device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    with one_rank_group(backend, monkeypatch):
        ref_scales, ref_state = ddp_run(torch_scaler(2.0**10, 3, device), device)
        scales, state = ddp_run(dls_scaler(2.0**10, 3), device)
    assert scales == ref_scales
    assert scales.count(2.0**9) >= 1  # backed off at the first overflow
    assert_same(state, ref_state, f"one-rank {backend}")


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed+gloo")
def test_one_rank_gloo_group_trains_like_torch_amp(monkeypatch: pytest.MonkeyPatch) -> None:
    check_one_rank_group("gloo", torch.device("cpu"), monkeypatch)


@pytest.mark.cuda
@pytest.mark.skipif(not dist.is_available() or not dist.is_nccl_available(), reason="needs NCCL")
def test_one_rank_nccl_group_trains_like_torch_amp(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.cuda.set_device(0)
    check_one_rank_group("nccl", torch.device("cuda", 0), monkeypatch)


# ---------------------------------------------------------------------------------------------- fp8, master weights
def assert_close_to_float32_rounding(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal up to float32 sums in another order: the largest difference within 1e-5 of the largest magnitude (an
    FP8 rounding difference would be 2**-4 of a value or more)."""
    assert (a - b).abs().max() <= 1e-5 * b.abs().max(), (a - b).abs().max()


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", [CurrentScaling(), DelayedScaling(amax_history_len=4)], ids=["current", "delayed"])
def test_fp8_emulation_on_cuda_casts_like_on_the_cpu(recipe: Any) -> None:
    """Payload scales, amax histories and cast statistics bitwise equal to the CPU's; outputs and gradients equal
    to float32 rounding (the GEMMs accumulate in another order)."""
    torch.manual_seed(0)
    cpu = torch.nn.Linear(32, 16)
    gpu = copy.deepcopy(cpu).to(CUDA)
    handles = [dls.fp8.emulate_recipe(cpu, recipe), dls.fp8.emulate_recipe(gpu, recipe)]
    gen = torch.Generator().manual_seed(2)
    for step in range(3):
        x = torch.randn(8, 32, generator=gen) * 10**step
        g = torch.randn(8, 16, generator=gen)
        y, y_gpu = cpu(x), gpu(x.to(CUDA))
        y.backward(g)
        y_gpu.backward(g.to(CUDA))
        assert_close_to_float32_rounding(y_gpu.cpu(), y)
        assert handles[0].stats.as_dict() == handles[1].stats.as_dict(), f"step {step}"
    for p, q in zip(cpu.parameters(), gpu.parameters()):
        assert p.grad is not None and q.grad is not None
        assert_close_to_float32_rounding(q.grad.cpu(), p.grad)
    state, state_gpu = handles[0].state_dict(), handles[1].state_dict()
    for name, roles in state["modules"].items():
        for role, entry in roles.items():
            gpu_entry = state_gpu["modules"][name][role]
            assert_tensors_equal([t.cpu() for t in gpu_entry.values()], list(entry.values()), f"{name}.{role}")


@pytest.mark.cuda
def test_master_weights_on_cuda_skip_overflowing_steps_and_round_masters_into_the_model() -> None:
    model = tiny_model(dtype=torch.float16, device=CUDA)
    opt = dls.master_weights(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True))
    scaler = dls.GradScaler("cuda", init_scale=2.0**10)
    for step in range(6):
        before = [p.detach().clone() for p in model.parameters()]
        masters = [opt.master_of(p).detach().clone() for p in model.parameters()]
        scaler.scale(loss_of(model, step)).backward()
        if step in (0, 3):
            inject(model, INF)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if step in (0, 3):
            assert_tensors_equal(model.parameters(), before, f"skipped step {step}")
            assert_tensors_equal([opt.master_of(p) for p in model.parameters()], masters, f"masters {step}")
        for p in model.parameters():
            master = opt.master_of(p)
            assert master.device.type == "cuda" and master.dtype == torch.float32
            assert torch.equal(p, master.to(torch.float16))
    assert scaler.get_num_skipped_steps() == 2
