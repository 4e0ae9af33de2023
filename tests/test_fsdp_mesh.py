"""fp16 at scale in plain torch: the ShardedGradScaler drop-in, the 2-D device mesh, DCP checkpoints (CPU, gloo).

The ranks run ``tests/_scale_worker.py`` (one launch per world size, every scenario in the same process group);
the tests compare what they wrote. Overflows are injected into ONE rank's local gradient shard (sometimes two).
A launch at 4 ranks saves DCP checkpoints that a launch at 2 ranks then loads, resharded.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dls
from conftest import launch_ranks

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed+gloo"),
]

WORKER = Path(__file__).resolve().parent / "_scale_worker.py"


@pytest.fixture(scope="module")
def world4(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("scale4")
    scenarios = ["dropin", "offload", "mesh_norm", "mesh_train", "dcp_save"]
    return launch_ranks(WORKER, scenarios, out, 4, timeout=400)


@pytest.fixture(scope="module")
def world2(world4: list[dict[str, Any]], tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("scale2")
    shared = str(Path(world4[0]["dcp_save"]["fsdp"]["path"]).parent)
    return launch_ranks(WORKER, ["dropin", "offload", "dcp_load"], out, 2, timeout=300, DLS_SCALE_SHARED=shared)


@pytest.fixture(params=[2, 4], ids=lambda n: f"world{n}")
def ranks(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return request.getfixturevalue(f"world{request.param}")


# ---------------------------------------------------------------------- (1) the ShardedGradScaler drop-in
def test_sharded_grad_scaler_has_torchs_signature() -> None:
    import inspect

    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    ours, theirs = inspect.signature(dls.ShardedGradScaler), inspect.signature(ShardedGradScaler)
    assert list(ours.parameters) == list(theirs.parameters)
    for name, p in theirs.parameters.items():
        if name != "process_group":  # torch's default is dist.group.WORLD, None before init: both mean the world
            assert ours.parameters[name].default == p.default, name
    scaler = dls.ShardedGradScaler("cpu", 2.0**10, 0.25, 4.0, 7)  # positionally: backoff before growth, as torch
    assert (scaler.get_backoff_factor(), scaler.get_growth_factor(), scaler.get_growth_interval()) == (0.25, 4.0, 7)
    assert isinstance(scaler, dls.GradScaler) and scaler.get_scale() == 2.0**10


@pytest.mark.parametrize("clip", [False, True], ids=["step", "unscale_clip_step"])
def test_the_drop_in_trains_bit_identically_to_torchs_under_fsdp2_float16(ranks: list[Any], clip: bool) -> None:
    """FSDP2 fully_shard, MixedPrecisionPolicy(float16 params, float32 reduce), 30 steps: the scales, the steps
    taken, the full parameters and optimizer state, bit for bit; overflows from float16 backward at the first
    scales (2**24 down) and injected into one rank's shard. ``clip``: verl's unscale_ + clip_grad_norm_."""
    suffix = "_clip" if clip else ""
    for rank, r in enumerate(ranks):
        ours, theirs = r["dropin"][f"dls{suffix}"], r["dropin"][f"torch{suffix}"]
        assert ours == theirs, f"rank {rank}"
        assert ours == ranks[0]["dropin"][f"dls{suffix}"]  # and every rank holds the same
    trace = ranks[0]["dropin"][f"dls{suffix}"]["trace"]
    scales = [scale for scale, _ in trace]
    steps_taken = trace[-1][1]
    assert scales[0] < 2.0**24 and len(set(scales)) >= 6  # backed off from float16's own overflows, grew again
    assert steps_taken < len(trace) - 8  # the injected overflows skipped too


def test_cpu_offload_costs_one_host_read_per_step_whatever_the_tensor_count(ranks: list[Any]) -> None:
    """FSDP2 CPUOffloadPolicy: the reads of dls's step()+update() do not grow with the gradient tensors (2 and 6
    layers) and stay below torch's ShardedGradScaler's on the same run; both skipped the one overflow."""
    for r in ranks:
        result = r["offload"]
        assert result["dls_6"]["tensors"] > 2 * result["dls_2"]["tensors"]
        for layers in (2, 6):
            ours, theirs = result[f"dls_{layers}"], result[f"torch_{layers}"]
            assert ours["reads"] == [1] * 6, ours  # the skip decision, nothing per tensor
            assert all(a < b for a, b in zip(ours["reads"], theirs["reads"]) if b > 1)
            assert ours["skipped"] == theirs["skipped"] == 1


# ---------------------------------------------------------------------- (2) the 2-D mesh
def test_global_norm_on_the_2d_mesh_equals_clip_grad_norm(world4: list[Any]) -> None:
    """dp=2 x tp=2: tensor-parallel parameters are (_StridedShard, Shard) there. Every rank's norm is the one
    clip_grad_norm_ computes over the same DTensor parameters, the gathered full gradients' and the unsharded
    model's; after clipping, the full gradients have the norm clipped to."""
    placements = world4[0]["mesh_norm"]["placements"]["tp"]
    assert any("_StridedShard" in p for p in placements)
    for r in world4:
        entry = r["mesh_norm"]["tp"]
        assert entry["finite"]
        for other in ("torch", "full", "reference"):
            assert math.isclose(entry["dls"], entry[other], rel_tol=1e-5), (other, entry)
        assert math.isclose(entry["clipped_full"], 0.1, rel_tol=1e-4)
    assert len({r["mesh_norm"]["tp"]["dls"] for r in world4}) == 1  # the same float on every rank


def test_global_norm_where_clip_grad_norm_refuses_the_layout(world4: list[Any]) -> None:
    """LayerNorms sharded over dp only (a 1-D mesh) next to linears on the 2-D mesh: torch's clip_grad_norm_
    refuses the mix; dls's norm is the gathered full gradients' on every rank."""
    assert "(2,)(Shard(dim=0),)" in world4[0]["mesh_norm"]["placements"]["norms"]
    for r in world4:
        entry = r["mesh_norm"]["norms"]
        assert entry["torch_refuses"]
        assert math.isclose(entry["dls"], entry["full"], rel_tol=1e-5)
        assert math.isclose(entry["dls"], entry["reference"], rel_tol=1e-5)
        assert math.isclose(entry["clipped_full"], 0.1, rel_tol=1e-4)
    assert len({r["mesh_norm"]["norms"]["dls"] for r in world4}) == 1


@pytest.mark.parametrize("kind", ["plain", "clip", "fused", "sync_free"])
def test_the_2d_mesh_skips_on_every_rank_and_trains_like_the_unsharded_model(world4: list[Any], kind: str) -> None:
    """An overflow in one rank's shard skips the step on every rank: nothing of that rank's parameters or
    optimizer state changes (the sync-free path restores them on the device), the scale is the same everywhere,
    and the full parameters end where the unsharded model trained on the global batches ends."""
    traces = [r["mesh_train"][kind]["mesh"]["trace"] for r in world4]
    reference = world4[0]["mesh_train"][kind]["reference"]
    assert all(t == reference["trace"] for t in traces)  # scales, skips, and which steps changed anything
    skipped = [i for i, (_scale, _n, changed) in enumerate(reference["trace"]) if not changed]
    assert skipped == [3, 7, 8]
    for r in world4:
        mesh = r["mesh_train"][kind]["mesh"]["params"]
        flat = torch.tensor([v for p in mesh for v in p], dtype=torch.float64)
        ref = torch.tensor([v for p in reference["params"] for v in p], dtype=torch.float64)
        torch.testing.assert_close(flat, ref, rtol=1e-5, atol=1e-6)
    if kind in ("plain", "sync_free"):  # one all-reduce per step, over the 4 ranks that must agree
        assert all(calls == [4] for calls in world4[0]["mesh_train"][kind]["mesh"]["reduces"])


# ---------------------------------------------------------------------- (3) DCP
@pytest.mark.parametrize("layout", ["fsdp", "mesh"])
def test_dcp_saves_and_resumes_bit_identically_at_4_ranks(world4: list[Any], layout: str) -> None:
    """The scaler inside an app state (fsdp) and as its own Stateful value (mesh, dp=2 x tp=2, as torchtitan
    passes its states): loaded into fresh objects, the same; trained on, bit-identical to the run that never
    stopped."""
    for r in world4:
        result = r["dcp_save"][layout]
        assert result["loaded"] == result["saved"]
        assert result["resumed"] == result["straight"]
        assert result["saved"]["scaler"]["num_skipped_steps"] == 3
        assert result["saved"]["scaler"]["loss_scale"] != 2.0**8  # the scale moved before the save
    assert len({str(r["dcp_save"][layout]["saved"]) for r in world4}) == 1


@pytest.mark.parametrize("layout", ["fsdp", "mesh"])
def test_dcp_checkpoint_of_4_ranks_resumes_at_2_with_the_scale_and_counters(
    world4: list[Any], world2: list[Any], layout: str
) -> None:
    saved = world4[0]["dcp_save"][layout]["saved"]
    for r in world2:
        loaded = r["dcp_load"][layout]
        assert loaded["scaler"] == saved["scaler"]  # every key: scale, growth tracker, skipped steps, ...
        assert loaded["params"] == saved["params"] and loaded["optimizer"] == saved["optimizer"]
        assert loaded["trained"]["num_skipped_steps"] > saved["scaler"]["num_skipped_steps"]  # and trains on
