"""Multi-process agreement: every rank skips the same steps and holds the same scale (CPU, gloo).

The scenarios run in separate processes (``tests/_dist_worker.py``, one per rank, on 127.0.0.1 only), once per
world size, and write their results as JSON; the tests below compare the ranks. Gradients overflow on ONE rank
(sometimes two) after they were reduced, in three layouts: (a) DDP, replicated parameters; (b) FSDP2
``fully_shard``, ``DTensor`` shards; (c) hand-sharded, each rank's optimizer owns a disjoint slice.
Every launch has a deadline, and the process groups a timeout, so a hang fails instead of blocking CI.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dls
from conftest import dist_env, free_port, launch_ranks
from dls import distributed

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed+gloo"),
]

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_dist_worker.py"
EXAMPLES = HERE.parent / "examples"
LAYOUTS = ["ddp", "ddp_fused", "ddp_clip", "fsdp", "fsdp_clip", "zero", "zero_clip"]
SCENARIOS = [*LAYOUTS, "noagree", "clip_equiv", "nograd"]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"world{n}")
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    """The results of every rank, for world size 2 and 4 (one launch each, shared by the tests)."""
    n = request.param
    return launch_ranks(WORKER, SCENARIOS, tmp_path_factory.mktemp(f"world{n}"), n, timeout=300)


def _skipped(trace: list[list[Any]]) -> list[int]:
    return [i for i, (_scale, _skipped, changed) in enumerate(trace) if not changed]


def _flat(values: list[list[float]]) -> torch.Tensor:
    return torch.tensor([v for part in values for v in part], dtype=torch.float64)


# ---------------------------------------------------------------------- agreement in every layout
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_rank_skips_the_same_steps_and_holds_the_same_scale(ranks: list[Any], layout: str) -> None:
    expected = ranks[0]["schedule"]["steps"]
    traces = [r[layout]["trace"] for r in ranks]
    for rank, trace in enumerate(traces):
        # Per step: scale after update(), num_skipped_steps, whether this rank's (local) parameters changed.
        assert trace == traces[0], f"rank {rank} diverged from rank 0 in layout {layout}"
        assert _skipped(trace) == expected
    assert traces[0][-1][1] == len(expected)
    assert len({scale for scale, _, _ in traces[0]}) >= 3  # the scale backed off and grew
    if layout.startswith(("ddp", "fsdp")):  # (a), (b): the (full) parameters are bit-identical across ranks
        assert len({r[layout]["digest"] for r in ranks}) == 1


@pytest.mark.parametrize("clip", [False, True], ids=["plain", "clip"])
def test_fsdp2_trains_like_ddp(ranks: list[Any], clip: bool) -> None:
    """Same data, same overflows: the FSDP2 model (sharded flags, sharded clipping norm) ends where DDP does."""
    suffix = "_clip" if clip else ""
    fsdp, ddp = _flat(ranks[0][f"fsdp{suffix}"]["params"]), _flat(ranks[0][f"ddp{suffix}"]["params"])
    torch.testing.assert_close(fsdp, ddp, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", ["ddp", "ddp_fused", "ddp_clip", "fsdp", "fsdp_clip"])
def test_state_dicts_are_identical_and_rank0s_resumes_everywhere(ranks: list[Any], layout: str) -> None:
    state = ranks[0][layout]["state_dict"]
    assert state["num_skipped_steps"] == len(ranks[0]["schedule"]["steps"])
    for r in ranks:
        assert r[layout]["state_dict"] == state
        assert r[layout]["resumed_state_dict"] == state  # every rank loaded rank 0's state dict
    if "resumed_trace" in ranks[0][layout]:  # DDP went on training with the resumed scalers
        traces = [r[layout]["resumed_trace"] for r in ranks]
        assert all(t == traces[0] for t in traces)
        assert [i + 30 for i in _skipped(traces[0])] == ranks[0]["schedule"]["resumed"]
        assert len({r[layout]["resumed_digest"] for r in ranks}) == 1


def test_without_agreement_the_ranks_fork(ranks: list[Any]) -> None:
    """Negative control: the same layout (c) run with the collective switched off skips different steps on
    different ranks, so the tests above can see a missing agreement."""
    skips = [_skipped(r["noagree"]["trace"]) for r in ranks]
    assert any(s != skips[0] for s in skips)


# ---------------------------------------------------------------------- clipping with sharded gradients
def test_global_norm_clipping_of_sharded_gradients_equals_the_unsharded_model(ranks: list[Any]) -> None:
    for r in ranks:
        result = r["clip_equiv"]
        assert result["ref_norm"] > 2 * 0.05  # clipping is active
        reference = _flat(result["ref"])
        for layout in ("fsdp", "zero"):  # DTensor shards (auto), plain slices (gradients_sharded=True)
            assert result[f"{layout}_finite"]
            torch.testing.assert_close(_flat(result[layout]), reference, rtol=1e-5, atol=1e-8)
        # Each rank clipping by its local norm is measurably different: the comparison has teeth.
        assert not torch.allclose(_flat(result["zero_local"]), reference, rtol=1e-3)


# ---------------------------------------------------------------------- a rank without gradients
def test_a_rank_without_gradients_still_joins_the_collectives(ranks: list[Any]) -> None:
    """Rank 1 has no gradient at all on some steps while rank 0 overflows on others. Were any collective
    skipped for lack of gradients, the other ranks would wait: the process group times out (60 s) and the
    launch is killed (300 s), either way a failure."""
    for kind in ("flag", "fused", "clip"):
        traces = [r["nograd"][kind] for r in ranks]
        assert all(t == traces[0] for t in traces), kind
        assert traces[0][-1][1] == 2  # the two steps where rank 0 overflowed, skipped on every rank


# ---------------------------------------------------------------------- examples
@pytest.mark.parametrize("example", ["ddp.py", "fsdp.py"])
def test_example_runs_under_torchrun(example: str) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(EXAMPLES / example),
        "--steps=25",
        "--cpu",
    ]
    out, err = subprocess.PIPE, subprocess.STDOUT
    proc = subprocess.Popen(cmd, env=dist_env(), stdout=out, stderr=err, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # torchrun and its workers
        output, _ = proc.communicate()
        pytest.fail(f"{example} did not finish in 180 s\n{output.decode(errors='replace')[-4000:]}")
    text = output.decode(errors="replace")
    assert proc.returncode == 0, text[-4000:]
    assert "all 2 ranks agree" in text


# ---------------------------------------------------------------------- in process: nothing when not distributed
def test_nothing_happens_when_not_distributed() -> None:
    assert not dist.is_initialized()
    flag = torch.ones(())
    assert not distributed.is_active()
    assert distributed.agree_on_overflow(flag) is flag
    assert distributed.start_agreement(flag) is None
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert not distributed.norm_is_sharded([opt], None)
    assert not distributed.norm_is_sharded([opt], True)  # gradients_sharded=True without ranks: local norm
    assert not distributed.has_dtensors(model.parameters())
    scaler = dls.GradScaler(init_scale=4.0, max_gradient_norm=1.0, gradients_sharded=True)
    scaler.scale(model(torch.ones(3, 4)).sum()).backward()
    scaler.unscale_(opt)
    state = scaler._tracker.iteration[id(opt)]
    assert state.agreement is None
    assert state.found_inf is not None and float(state.found_inf) == 0.0


def test_gradients_sharded_is_validated() -> None:
    with pytest.raises(ValueError, match="gradients_sharded"):
        dls.GradScaler(gradients_sharded=1)  # type: ignore[arg-type]


def test_flag_moves_to_a_device_the_backend_reduces_on(monkeypatch: pytest.MonkeyPatch) -> None:
    class Group:
        def __init__(self, *types: str) -> None:
            self._device_types = [torch.device(t) for t in types]

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert distributed._reduction_device(cpu, Group("cuda")) == torch.device("cuda", 1)  # NCCL, CPU flag
    assert distributed._reduction_device(cuda, Group("cpu", "cuda")) is None  # gloo reduces CUDA tensors
    assert distributed._reduction_device(cpu, Group("cpu", "cuda")) is None
    assert distributed._reduction_device(cuda, Group("cpu")) == cpu


def test_agreement_waits_then_copies_the_staged_result_back() -> None:
    class Work:
        waited = False

        def wait(self) -> None:
            self.waited = True

    work, result = Work(), torch.zeros(())
    agreement = distributed.Agreement(result, work, torch.ones(()))
    assert agreement.wait() is result
    assert work.waited and float(result) == 1.0
