"""The demo's picture: every run in a panel of its own, so none can hide another."""

from __future__ import annotations

import io
import math
from typing import Any

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


def demo_groups() -> list:
    from dls.train.reporting import PlotGroup, PlotRun

    reference = PlotRun("float32", rows([1.0, 0.5, 0.25, 0.2, 0.15, 0.1]))
    runs = [
        PlotRun("matches float32", rows([1.0, 0.5, 0.25, 0.2, 0.15, 0.1], scale=2.0**36)),
        PlotRun("backs off", [{**r, "loss_scale": 2.0 ** (40 - min(i, 4))} for i, r in enumerate(rows([1.0] * 6))]),
        PlotRun("broke", rows([1.0, 0.9, math.nan, math.nan, math.nan], scale=2.0**10), stopped=5, why="weights"),
        PlotRun("no scale", rows([0.9, 0.8, 0.7, 0.6, 0.5, 0.4])),
    ]
    healed = PlotRun("heals", rows([math.inf, 0.5, 0.3], scale=2.0**14, skipped=(1,)), event=(1, "kept"))
    return [PlotGroup("model", reference, runs), PlotGroup("second model", reference, [healed])]


def test_the_demo_picture_draws_each_run_over_float32_with_its_own_scale_axis() -> None:
    from dls.train.reporting import plot_demo

    out = io.BytesIO()
    fig = plot_demo(demo_groups(), out, title="t")
    assert out.getvalue().startswith(b"\x89PNG")
    assert [sub._suptitle.get_text() for sub in fig.subfigs] == ["model", "second model"]
    axes = {ax.get_title().split("  (")[0]: ax for sub in fig.subfigs for ax in sub.axes if ax.get_title()}
    assert set(axes) == {"matches float32", "backs off", "broke", "no scale", "heals"}  # every run has a panel
    reference, run = axes["matches float32"].lines[:2]
    # the reference is drawn first, wider than the run: a run that matches float32 lies inside it, both visible
    assert reference.get_linewidth() > 2 * run.get_linewidth() and list(run.get_ydata()) == list(reference.get_ydata())

    def below(ax: Any) -> Any:  # the scale axis under a loss axis
        spec = ax.get_subplotspec()
        return next(
            other
            for other in ax.figure.axes
            if other.get_subplotspec().rowspan.start == spec.rowspan.stop
            and other.get_subplotspec().colspan == spec.colspan
        )

    scale_axes = {title: below(ax) for title, ax in axes.items()}
    backs_off = scale_axes["backs off"]
    low, high = (math.log2(v) for v in backs_off.get_ylim())
    assert 35 < low < 36 and 40 < high < 41  # its own range, not every run's
    assert [t.get_text() for t in backs_off.get_yticklabels()] == [f"$2^{{{k}}}$" for k in range(36, 41)]
    broke = axes["broke"]
    notes = " ".join(t.get_text() for t in broke.texts)
    assert "loss inf/NaN from step 3 on" in notes and "stopped at step 5" in notes
    assert any(list(line.get_xdata()) == [5, 5] for line in broke.lines)  # the stop, marked
    assert any(line.get_marker() == "x" and list(line.get_xdata()) == [2] for line in broke.lines)  # its last loss
    assert "no loss scaling" in [t.get_text() for t in scale_axes["no scale"].texts]
    assert "loss inf/NaN at 1 step" in " ".join(t.get_text() for t in axes["heals"].texts)
