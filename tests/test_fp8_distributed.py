"""Delayed FP8 scaling under DDP (gloo, 2 CPU ranks): amaxes all-reduced with MAX keep every rank's
histories and scales identical; reducing over per-rank groups instead lets them drift apart."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

WORKER = Path(__file__).with_name("_fp8_dist_worker.py")
WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("fp8_ddp")
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(WORLD))
    env["OMP_NUM_THREADS"] = "1"
    with contextlib.suppress(AttributeError, OSError, StopIteration):  # else gloo picks the host name's interface
        env["GLOO_SOCKET_IFNAME"] = next(name for _, name in socket.if_nameindex() if name.startswith("lo"))
    logs = [out / f"rank{r}.log" for r in range(WORLD)]
    procs = []
    for rank, log in enumerate(logs):
        with log.open("w") as f:
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(WORKER), str(out)], env=dict(env, RANK=str(rank)), stdout=f, stderr=f
                )
            )
    deadline = time.monotonic() + 120
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.returncode not in (None, 0) for p in procs):
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    text = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in logs)
    assert [p.returncode for p in procs] == [0] * WORLD, text
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


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
