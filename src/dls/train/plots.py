"""Reading ``metrics.jsonl``, and PNG plots of it (matplotlib's Agg canvas, imported only when plotting)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from dls.diagnostics.scales import pow2
from dls.train.errors import ModelDirError


def _row(line: bytes) -> dict[str, Any] | str:
    """A metrics row (a mapping with a step >= 0), or what is wrong with ``line``."""
    try:
        row = json.loads(line)
    except ValueError as exc:  # not JSON or not UTF-8
        return str(exc).splitlines()[0]
    step = row.get("step") if isinstance(row, dict) else None
    return row if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else str(row)


def read_metrics(data: bytes) -> list[dict[str, Any]]:
    return [row for line in data.splitlines() if isinstance(row := _row(line), dict)]


def metrics_to_keep(data: bytes | None, path: Path, step: int) -> bytes:
    """The rows of ``data`` (the file ``path``) a run resumed at ``step`` keeps; an unfinished last line is
    dropped, any other line that is not a metrics row refused (:class:`ModelDirError`: the file is kept)."""
    kept = []
    for number, line in enumerate((data or b"").split(b"\n")[:-1], start=1):  # [-1]: b"" or an unfinished line
        if not line.strip():
            continue
        row = _row(line)
        if isinstance(row, str):
            raise ModelDirError(
                f"{path} line {number} is not a metrics row ({row[:80]}); a resumed run rewrites that file "
                "and would lose it: move the file away (resuming does not need it) and run again"
            )
        if row["step"] <= step:
            kept.append(line + b"\n")
    return b"".join(kept)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _scale_tick(value: float, _pos: Any = None) -> str:
    """A loss-scale axis label: ``pow2``'s ``2^k`` as a mathtext exponent."""
    if value <= 0:
        return ""
    text = pow2(value)
    return f"$2^{{{text[2:]}}}$" if text.startswith("2^") else text


def plot_run(rows: Sequence[dict[str, Any]], out: IO[bytes], title: str = "") -> None:
    """plots.png: the run's loss over steps and its loss scale below, skipped steps as red crosses."""
    plot_comparison([("training loss", rows)], out, title)


def plot_comparison(runs: Sequence[tuple[str, Sequence[dict[str, Any]]]], out: IO[bytes], title: str = "") -> None:
    comparison_figure(runs, title).savefig(out, format="png", dpi=110)


def comparison_figure(runs: Sequence[tuple[str, Sequence[dict[str, Any]]]], title: str = "") -> Any:
    """Small multiples: per run its loss over the first run's (dashed grey) and its loss scale below, skipped steps
    as red crosses; shared axes, so runs compare by position and no curve hides another."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter

    columns = min(len(runs), 5)
    groups = -(-len(runs) // columns)
    width = 8.4 if columns == 1 else 3.1
    fig = Figure(figsize=(width * columns + 0.6, 3.5 * groups + 0.9), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2 * groups, columns, sharex=True, squeeze=False, height_ratios=[3, 1.3] * groups)
    loss_axes, scale_axes = axes[0::2].ravel(), axes[1::2].ravel()
    for ax in loss_axes[1:]:
        ax.sharey(loss_axes[0])
    for ax in scale_axes[1:]:
        ax.sharey(scale_axes[0])

    def losses(rows: Sequence[dict[str, Any]]) -> list[tuple[Any, Any]]:
        return [(r["step"], r["loss"]) for r in rows if _finite(r.get("loss")) and r["loss"] > 0]

    reference = losses(runs[0][1]) if runs else []
    any_scale = False
    for i, (label, rows) in enumerate(runs):
        ax_loss, ax_scale = loss_axes[i], scale_axes[i]
        if reference and i > 0:
            ax_loss.plot(*zip(*reference), "--", color="0.55", lw=1.2)
        pts = losses(rows)
        if pts:
            ax_loss.plot(*zip(*pts), color="black" if i == 0 and len(runs) > 1 else "tab:blue", lw=1.4)
        skipped = [r for r in rows if r.get("skipped")]
        marks = [(r["step"], r["loss"]) for r in skipped if _finite(r.get("loss")) and r["loss"] > 0]
        if marks:
            ax_loss.scatter(*zip(*marks), marker="x", s=16, color="tab:red", zorder=3)
        if rows and (not pts or pts[-1][0] < rows[-1]["step"]):  # the loss became inf/NaN: say so, not a gap
            text = f"loss inf/NaN after step {pts[-1][0] if pts else 0}\nlast row: step {rows[-1]['step']}"
            ax_loss.text(
                0.97, 0.95, text, ha="right", va="top", fontsize=7, color="tab:red", transform=ax_loss.transAxes
            )
        ax_loss.set_title(label, fontsize=9)
        ax_loss.set_yscale("log")
        ax_loss.grid(True, which="both", alpha=0.3)
        scaled = [(r["step"], r["loss_scale"]) for r in rows if _finite(r.get("loss_scale"))]
        if scaled:
            any_scale = True
            ax_scale.step(*zip(*scaled), where="post", color="tab:green", lw=1.4)
            hits = [(r["step"], r["loss_scale"]) for r in skipped if _finite(r.get("loss_scale"))]
            if hits:
                ax_scale.scatter(*zip(*hits), marker="x", s=16, color="tab:red", zorder=3)
        else:
            ax_scale.text(
                0.5, 0.5, "no loss scale", ha="center", va="center", color="0.4", transform=ax_scale.transAxes
            )
        ax_scale.grid(True, which="both", alpha=0.3)
    for ax in list(loss_axes[len(runs) :]) + list(scale_axes[len(runs) :]):
        ax.set_axis_off()
    if any_scale:
        scale_axes[0].set_yscale("log", base=2)
        scale_axes[0].yaxis.set_major_formatter(FuncFormatter(_scale_tick))
    for row in range(groups):
        loss_axes[row * columns].set_ylabel("loss (unweighted)")
        scale_axes[row * columns].set_ylabel("loss scale")
    for ax in axes[-1]:
        ax.set_xlabel("step")
    handles = [
        Line2D([], [], color="tab:blue", lw=1.4, label="the run's loss"),
        Line2D([], [], color="0.55", ls="--", lw=1.2, label=f"{runs[0][0]} (reference)" if runs else "reference"),
        Line2D([], [], color="tab:green", lw=1.4, label="loss scale"),
        Line2D([], [], color="tab:red", marker="x", ls="", label="skipped step"),
    ]
    if len(runs) == 1:
        del handles[1]  # one run: no reference
    fig.legend(handles=handles, loc="outside lower center", ncols=4, fontsize=9, frameon=False)
    if title:
        fig.suptitle(title)
    return fig
