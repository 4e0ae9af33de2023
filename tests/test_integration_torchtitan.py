"""dls inside torchtitan 0.3.0's real trainer (``torchtitan.train.main``), on CPU under gloo.

Each run is torchtitan's own entry point with ``--module _torchtitan_harness --config debug_fp16`` (the debug
llama, float16 through ``dls.integrations.torchtitan.with_dls``; the harness holds the CPU-only workarounds and
injects an overflow into ONE rank's gradient shard). Per world size a run saves a DCP checkpoint and a second
run resumes from it: 2 ranks FSDP, where every step before the checkpoint is skipped (torchtitan's
``init_optim_state`` trap), and 4 ranks FSDP x TP.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from conftest import launch_ranks

pytest.importorskip("torchtitan", reason="needs the torchtitan extra: pip install 'dls[torchtitan]'")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed+gloo"),
]

WORKER = Path(__file__).resolve().parent / "_torchtitan_worker.py"
# Factor 2**-8 (and 2**40 at the start): the debug model's float16 backward overflows at 2**40, 2**32 and 2**24.
COMMON = ["--loss-scaling.backoff-factor", "0.00390625", "--loss-scaling.growth-interval", "3", "--checkpoint.enable"]


def _runs(tmp: Path, world: int, first: list[str], second: list[str], poison: str) -> tuple[list[Any], list[Any]]:
    dump = ["--dump-folder", str(tmp / "dump")]
    assets = {"DLS_TT_ASSETS": str(tmp / "assets")}
    saved = launch_ranks(WORKER, [*COMMON, *dump, *first], tmp / "first", world, timeout=300, **assets)
    resumed = launch_ranks(WORKER, [*COMMON, *dump, *second], tmp / "second", world, timeout=300,
                           DLS_TT_POISON=poison, **assets)  # fmt: skip
    return saved, resumed


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], list[Any]]:
    """2 ranks FSDP: 3 steps, all skipped, checkpoint at 3; resume to step 6, rank 1 overflowing at step 5."""
    tmp = tmp_path_factory.mktemp("titan2")
    (tmp / "first").mkdir(), (tmp / "second").mkdir()
    first = ["--training.steps", "3", "--checkpoint.interval", "3"]
    return _runs(tmp, 2, first, ["--training.steps", "6", "--checkpoint.interval", "100"], poison="5:1")


@pytest.fixture(scope="module")
def fsdp_tp4(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], list[Any]]:
    """4 ranks, FSDP 2 x TP 2: 4 steps, checkpoint at 4; resume to step 6, rank 3 overflowing at step 5."""
    tmp = tmp_path_factory.mktemp("titan4")
    (tmp / "first").mkdir(), (tmp / "second").mkdir()
    tp = ["--parallelism.tensor-parallel-degree", "2"]
    first = [*tp, "--training.steps", "4", "--checkpoint.interval", "4"]
    return _runs(tmp, 4, first, [*tp, "--training.steps", "6", "--checkpoint.interval", "100"], poison="5:3")


@pytest.fixture(params=["fsdp2", "fsdp_tp4"])
def runs(request: pytest.FixtureRequest) -> tuple[list[Any], list[Any]]:
    return request.getfixturevalue(request.param)


def _applied(records: list[dict[str, Any]]) -> int:
    return sum(r["changed"] for r in records)


def test_torchtitan_trains_in_float16_and_every_rank_agrees(runs: tuple[list[Any], list[Any]]) -> None:
    for ranks in runs:
        assert all(r["compute_dtype"] == "torch.float16" for r in ranks)  # FSDP's param_dtype, set by with_dls
        assert all(r["records"][0]["param_dtype"] == "torch.float32" for r in ranks)  # sharded float32 masters
        assert all(r["records"] == ranks[0]["records"] for r in ranks)  # scale, skips, changes, LR: every rank


def test_float16_overflows_and_the_injected_one_are_skipped_on_every_rank(runs: tuple[list[Any], list[Any]]) -> None:
    first, second = (ranks[0]["records"] for ranks in runs)
    assert [r["changed"] for r in first[:3]] == [False] * 3  # 2**40, 2**32, 2**24 overflow in float16 backward
    assert first[2]["scale"] == 2.0**16
    by_step = {r["step"]: r for r in first + second}
    assert not by_step[5]["changed"] and by_step[5]["scale"] == by_step[4]["scale"] / 256  # one rank's inf
    assert by_step[4]["changed"] and by_step[6]["changed"]
    for ranks in runs:  # on the poisoned rank and every other: nothing of its shard moved at a skipped step
        for r in ranks:
            assert [x["changed"] for x in r["records"]] == [x["changed"] for x in ranks[0]["records"]]


def test_the_lr_schedule_follows_applied_steps_only(runs: tuple[list[Any], list[Any]]) -> None:
    first, second = (ranks[0]["records"] for ranks in runs)
    for i, record in enumerate(first):
        assert record["last_epoch"] == _applied(first[: i + 1])
    for i, record in enumerate(second):  # the resumed run continues the count from the checkpoint
        assert record["last_epoch"] == _applied(first) + _applied(second[: i + 1])


def test_resume_restores_the_scale_and_counters(runs: tuple[list[Any], list[Any]]) -> None:
    saved, resumed = runs
    last = saved[0]["records"][-1]
    assert resumed[0]["records"][0]["step"] == last["step"] + 1
    for r in resumed:
        assert r["resumed_scaler"]["scale"] == last["scale"]
        assert r["resumed_scaler"]["num_skipped_steps"] == last["skipped"]
        assert r["resumed_scaler"] == resumed[0]["resumed_scaler"]


def test_a_checkpoint_after_skipped_steps_only_resumes(fsdp2: tuple[list[Any], list[Any]]) -> None:
    """Every step before the checkpoint was skipped: no optimizer state yet and gradients still set, where
    torchtitan's init_optim_state does nothing; the resume would fail on the missing optimizer keys."""
    saved, resumed = fsdp2
    assert _applied(saved[0]["records"]) == 0
    assert _applied(resumed[0]["records"]) == 2  # steps 4 and 6 (5 overflowed on rank 1)


def test_with_dls_refuses_what_it_cannot_convert() -> None:
    from dls.integrations.torchtitan import with_dls

    with pytest.raises(ValueError, match=r"Trainer\.Config"):
        with_dls(object())  # type: ignore[arg-type]
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    with pytest.raises(ValueError, match="loss_scaling keys"):
        with_dls(llama3_debugmodel(), init_scal=2.0)
    config = with_dls(llama3_debugmodel(), init_scale=2.0**12)
    assert config.training.mixed_precision_param == "float16" and config.loss_scaling.init_scale == 2.0**12
    assert type(config.optimizer).__name__ == "Config" and type(config.optimizer).__qualname__.startswith("DLS")


def test_every_registered_config_has_an_fp16_twin() -> None:
    import dls.integrations.torchtitan as titan

    config = titan.llama3_debugmodel_fp16()
    assert isinstance(config, titan.DLSTrainer.Config)
    assert config.training.mixed_precision_param == "float16"
    with pytest.raises(AttributeError):
        titan.no_such_model_fp16  # noqa: B018
