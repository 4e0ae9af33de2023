"""Delayed FP8 scaling under DDP (gloo, 2 CPU ranks): amaxes all-reduced with MAX keep every rank's
histories and scales identical; reducing over per-rank groups instead lets them drift apart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conftest import launch_ranks

WORKER = Path(__file__).with_name("_fp8_dist_worker.py")
WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return launch_ranks(WORKER, [], tmp_path_factory.mktemp("fp8_ddp"), WORLD, timeout=120)


def test_reduced_amaxes_keep_every_rank_identical(ranks: list[dict[str, Any]]) -> None:
    first, second = (r["agree"] for r in ranks)
    assert first["params"] == second["params"]
    assert first["state"] == second["state"]
    # The first layer's input is the data itself: its history is the elementwise max of the ranks' amaxes.
    expected = [max(a, b) for a, b in zip(first["local_input_amax"], second["local_input_amax"])][::-1]
    assert first["state"]["0"]["input"]["amax_history"][: len(expected)] == pytest.approx(expected, rel=0, abs=0)


def test_without_reduction_the_ranks_histories_differ(ranks: list[dict[str, Any]]) -> None:
    first, second = (r["local"] for r in ranks)
    assert first["params"] == second["params"]  # DDP still averages the gradients
    for role in ("input", "grad_output"):
        assert first["state"]["0"][role] != second["state"]["0"][role]
    for r in (first, second):
        history = r["state"]["0"]["input"]["amax_history"]
        assert history[: len(r["local_input_amax"])] == pytest.approx(r["local_input_amax"][::-1], rel=0, abs=0)
