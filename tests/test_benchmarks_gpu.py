"""The GPU benchmark scripts on the CPU (``--quick``): bench_gpu.py's budget, bench_fp8_gpu.py's tables. No figure is
checked (timings are the scripts' business, never a unit test's). Every table of both, with its A/A row, is also
printed by ``scripts/gpu-check --dry-run`` (tests/test_gpu_check.py)."""

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


def test_bench_gpu_budget_runs_each_tables_first_point_and_names_those_left_out(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Every table once through (all five, quick, are run by scripts/gpu-check's dry run: tests/test_gpu_check.py);
    here the tables of several points, under a budget already spent."""
    argv = ["--quick", "--device", "cpu", "--reps", "2", "--warmup", "0", "--budget", "0"]
    script("bench_gpu").main([*argv, "--tables", "unscale", "clip", "overhead"])
    out = capsys.readouterr().out
    assert "   budget: 2 of 3 points not run: float32 100k x100, float16 100k x10" in out
    assert "   budget: 1 of 2 points not run: bfloat16 100k x100" in out
    assert "   budget: 2 of 3 points not run: SGD fused, Adam fused" in out
    for title in ("1. unscale", "2. unscale + global clip", "4. host overhead"):
        lines = out.split(title)[1].split("\n\n")[0].splitlines()
        assert len([line for line in lines if line.startswith(("float", "bfloat", "      SGD"))]) == 1
        aa = next(i for i, line in enumerate(lines) if line.lstrip().startswith("A/A  "))  # from the one point run
        assert lines[aa + 1].startswith("   budget: ")  # printed right under the table it concerns


def test_bench_gpu_budget_shares_the_seconds_in_order() -> None:
    bench_gpu = script("bench_gpu")
    budget = bench_gpu.Budget(100.0, ["unscale", "step"])
    start = min(budget.deadlines.values()) - 100.0 * 0.3 / 0.55
    assert budget.deadlines["step"] - start == pytest.approx(100.0, abs=0.5)
    assert bench_gpu.Budget(None, ["unscale"]).deadlines == {}
    assert list(bench_gpu.Budget(None, ["clip"]).points("clip", [1, 2, 3])) == [1, 2, 3]


@pytest.mark.slow
def test_bench_fp8_gpu_quick_compares_emulated_and_scaled_mm_fp8(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--quick", "--device", "cpu", "--reference", "scaled_mm", "--reps", "2", "--warmup", "0", "--steps", "2"]
    script("bench_fp8_gpu").main(argv)
    out = capsys.readouterr().out
    assert "1. first step" in out and "2. training loss" in out and "3. cost of a training step" in out
    assert " NO " not in out  # dls's scales and payloads equal torch's on the CPU too
    assert "A/A: high again / high" in out
