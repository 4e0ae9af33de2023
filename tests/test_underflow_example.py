"""examples/underflow.py, small and fast: underflow without loss scaling, rescue with dls.GradScaler."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch

import dls
from conftest import load_example


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, Any]]:
    example = load_example("underflow.py")
    out: dict[str, dict[str, Any]] = example.run(steps=40, samples=128, width=32, depth=3, loss_weight=1e-9)
    return out


def test_float32_trains(results: dict[str, dict[str, Any]]) -> None:
    assert results["float32"]["final_loss"] < 0.1 * results["initial"]["final_loss"]
    assert results["float32"]["flushed_fraction"] == 0.0


def test_without_scaling_gradients_underflow_and_training_lags(results: dict[str, dict[str, Any]]) -> None:
    f32 = results["float32"]["final_loss"]
    for name in ("float16", "cbfloat16"):
        assert results[name]["flushed_fraction"] > 0.5, name
        assert results[name]["final_loss"] > 2 * f32, name
        assert results[name]["loss_scale"] is None
    # float16 loses every gradient value, so Adam never moves: the loss stays where it started.
    assert results["float16"]["flushed_fraction"] == 1.0
    assert results["float16"]["final_loss"] == pytest.approx(results["initial"]["final_loss"], rel=1e-3)


def test_dynamic_loss_scaling_rescues_both_formats(results: dict[str, dict[str, Any]]) -> None:
    f32 = results["float32"]["final_loss"]
    for name in ("float16 + DLS", "cbfloat16 + DLS"):
        assert results[name]["flushed_fraction"] < 0.01, name
        assert results[name]["final_loss"] == pytest.approx(f32, rel=0.05), name
        assert results[name]["loss_scale"] > 2.0**20
        assert results[name]["skipped_steps"] <= 5


def test_run_leaves_the_half_dtype_alone(results: dict[str, dict[str, Any]]) -> None:
    assert dls.get_half_dtype_str() == "float16"  # the conftest default: the scalers were given half_dtype


def test_main_prints_every_configuration(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    example = load_example("underflow.py")
    threads = str(torch.get_num_threads())  # main() sets the thread count: keep this process's
    monkeypatch.setattr(sys, "argv", ["underflow.py", "--steps", "3", "--threads", threads])
    example.main()
    printed = capsys.readouterr().out
    for name, _, _ in example.CONFIGS:
        assert name in printed
    assert "flushed to zero" in printed and "final loss" in printed
