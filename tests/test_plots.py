"""The demo's picture: every run in a panel of its own, so none can hide another."""

from __future__ import annotations

import io
import math

import pytest

pytest.importorskip("matplotlib")

from dls.train.reporting import plot_comparison


def rows(losses: list[float], scale: float | None = None, skipped: tuple[int, ...] = ()) -> list[dict]:
    return [
        {"step": step, "loss": loss, "loss_scale": scale, "skipped": step in skipped}
        for step, loss in enumerate(losses, start=1)
    ]


RUNS = [
    ("float32", rows([1.0, 0.5, 0.25])),
    ("fp16 + DLS", rows([1.0, 0.5, 0.25], scale=2.0**15, skipped=(1,))),
    ("fp16 + DLS, same scale", rows([1.0, 0.5, 0.25], scale=2.0**15)),
    ("diverged", rows([1.0, math.nan, math.nan], scale=2.0**10)),
    ("no scale", rows([0.9, 0.8, 0.7])),
    ("sixth", rows([0.9, 0.8, 0.7], scale=1.0)),
]


def test_every_run_has_its_own_loss_and_scale_panels() -> None:
    fig = plot_comparison(RUNS, io.BytesIO(), title="t")
    visible = [ax for ax in fig.axes if ax.axison]
    assert len(visible) == 2 * len(RUNS)  # two runs with the same scale curve cannot hide each other
    titles = [ax.get_title() for ax in visible if ax.get_title()]
    assert titles == [label for label, _ in RUNS]
    loss_axes = {ax.get_title(): ax for ax in visible if ax.get_title()}
    assert len(loss_axes["float32"].lines) == 1  # the reference alone
    assert len(loss_axes["fp16 + DLS"].lines) == 2  # the run over the reference
    diverged_notes = [t.get_text() for t in loss_axes["diverged"].texts]
    assert any("inf/NaN after step 1" in note for note in diverged_notes)
    legend_labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "float32 (reference)" in legend_labels and "skipped step" in legend_labels


def test_writes_a_png() -> None:
    out = io.BytesIO()
    plot_comparison(RUNS[:2], out)
    assert out.getvalue().startswith(b"\x89PNG")
