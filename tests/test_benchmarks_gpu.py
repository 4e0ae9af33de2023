"""Smoke runs of the GPU benchmark scripts on the CPU (``--quick``): every table is built and printed, with its A/A
row. No figure is checked (timings are the scripts' business, never a unit test's)."""

from __future__ import annotations

import atexit
import importlib
import sys
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(autouse=True)
def _no_exit_report(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scripts print their wall time at interpreter exit: not at the end of the test session."""
    monkeypatch.setattr(atexit, "register", lambda *args, **kwargs: None)


def script(name: str) -> Any:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.mark.slow
def test_bench_gpu_quick_prints_every_table_with_an_aa_row(capsys: pytest.CaptureFixture[str]) -> None:
    script("bench_gpu").main(["--quick", "--device", "cpu", "--reps", "2", "--warmup", "0", "--preroll", "1"])
    out = capsys.readouterr().out
    for title in (
        "1. unscale",
        "2. unscale + global clip",
        "3. a whole training step",
        "4. host overhead",
        "5. CUDA graphs",
    ):
        assert title in out
    assert out.count("A/A  ") >= 5


@pytest.mark.slow
def test_bench_fp8_gpu_quick_compares_emulated_and_scaled_mm_fp8(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--quick", "--device", "cpu", "--reference", "scaled_mm", "--reps", "2", "--warmup", "0", "--steps", "2"]
    script("bench_fp8_gpu").main(argv)
    out = capsys.readouterr().out
    assert "1. first step" in out and "2. training loss" in out and "3. cost of a training step" in out
    assert " NO " not in out  # dls's scales and payloads equal torch's on the CPU too
    assert "A/A: high again / high" in out
