"""Reading ``metrics.jsonl``, and PNG plots of it (matplotlib's Agg canvas: no display, no global backend change;
matplotlib is imported by the plotting functions only, so a run starts without paying for it)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from dls.diagnostics.scales import pow2
from dls.train.errors import ModelDirError


def read_metrics(data: bytes) -> list[dict[str, Any]]:
    """The rows of ``metrics.jsonl`` content, for plotting: lines that are not metrics rows are left out."""
    rows: list[dict[str, Any]] = []
    for line in data.splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # also UnicodeDecodeError
            continue
        if isinstance(row, dict) and _is_step(row.get("step")):
            rows.append(row)
    return rows


def metrics_to_keep(data: bytes | None, path: Path, step: int) -> bytes:
    """The lines of ``metrics.jsonl`` content ``data`` (of the file ``path``) whose step is at most ``step``: what a
    run resumed at ``step`` keeps (a crash may have left rows the checkpoint does not cover). A last line without
    its newline (a run killed while writing it) is dropped. Any other line that is not a metrics row raises
    :class:`~dls.train.errors.ModelDirError` naming it: the file is left as it is rather than losing it."""
    if not data:
        return b""
    lines = data.split(b"\n")
    kept = []
    for number, line in enumerate(lines[:-1], start=1):  # lines[-1] is b"" or an unfinished last line
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            ok = isinstance(row, dict) and _is_step(row.get("step"))
        except ValueError as exc:  # not JSON or not UTF-8
            ok, row = False, str(exc).splitlines()[0]
        if not ok:
            raise ModelDirError(
                f"{path} line {number} is not a metrics row ({str(row)[:80]}); a resumed run rewrites that file "
                "and would lose it: move the file away (resuming does not need it) and run again"
            )
        if row["step"] <= step:
            kept.append(line + b"\n")
    return b"".join(kept)


def _is_step(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _scale_tick(value: float, _pos: Any = None) -> str:
    """A loss-scale axis label: ``dls.diagnostics.scales.pow2``'s ``2^k`` as a mathtext exponent."""
    if value <= 0:
        return ""
    text = pow2(value)
    return f"$2^{{{text[2:]}}}$" if text.startswith("2^") else text


def plot_run(rows: Sequence[dict[str, Any]], out: IO[bytes], title: str = "") -> None:
    """Loss (top) and loss scale (bottom) over steps, as PNG into ``out``; skipped steps are red crosses on both."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    fig = Figure(figsize=(9, 6.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax_loss, ax_scale = fig.subplots(2, 1, sharex=True)
    steps = [r["step"] for r in rows if _finite(r.get("loss"))]
    losses = [r["loss"] for r in rows if _finite(r.get("loss"))]
    ax_loss.plot(steps, losses, color="tab:blue", lw=1.2, label="training loss")
    skipped = [r for r in rows if r.get("skipped")]
    positive = [v for v in losses if v > 0]
    if positive and max(positive) / min(positive) > 20:  # a log axis only where the loss spans decades
        ax_loss.set_yscale("log")
    if skipped:
        low = min(positive) if positive else 0.0
        ys = [r["loss"] if _finite(r.get("loss")) and r["loss"] > 0 else low for r in skipped]
        ax_loss.scatter([r["step"] for r in skipped], ys, marker="x", color="tab:red", zorder=3, label="skipped step")
    ax_loss.set_ylabel("loss")
    ax_loss.grid(True, which="both", alpha=0.3)
    ax_loss.legend(loc="upper right")

    scaled = [r for r in rows if _finite(r.get("loss_scale"))]
    if scaled:
        ax_scale.step([r["step"] for r in scaled], [r["loss_scale"] for r in scaled], where="post", color="tab:green")
        ax_scale.set_yscale("log", base=2)
        ax_scale.yaxis.set_major_formatter(FuncFormatter(_scale_tick))
        marks = [(r["step"], r["loss_scale"]) for r in skipped if _finite(r.get("loss_scale"))]
        if marks:
            ax_scale.scatter(
                [m[0] for m in marks],
                [m[1] for m in marks],
                marker="x",
                color="tab:red",
                zorder=3,
                label=f"skipped step ({len(marks)})",
            )
            ax_scale.legend(loc="lower right")
    else:
        ax_scale.text(0.5, 0.5, "no loss scaling in this run", ha="center", va="center", transform=ax_scale.transAxes)
        ax_scale.set_yticks([])
    ax_scale.set_ylabel("loss scale")
    ax_scale.set_xlabel("step")
    ax_scale.grid(True, which="both", alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=11, wrap=True)
    fig.savefig(out, format="png", dpi=110)


def plot_comparison(runs: Sequence[tuple[str, Sequence[dict[str, Any]]]], out: IO[bytes], title: str = "") -> None:
    """Several runs, as PNG into ``out``: loss curves (top) and loss scales (bottom), skipped steps as crosses."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    fig = Figure(figsize=(10, 7.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax_loss, ax_scale = fig.subplots(2, 1, sharex=True, height_ratios=[3, 2])
    colors = ["black", "tab:red", "tab:orange", "tab:blue", "tab:purple", "tab:green", "tab:brown", "tab:gray"]
    colors += ["tab:olive", "tab:cyan", "tab:pink"]
    any_scale = False
    for i, (label, rows) in enumerate(runs):
        color = colors[i % len(colors)]
        # The first run is the reference: dashed and on top, so it stays visible where others coincide with it;
        # beyond the named colours the styles repeat dotted.
        style, width, order = ("--", 2.0, 5) if i == 0 else ("-" if i < len(colors) else ":", 1.4, 2)
        pts = [(r["step"], r["loss"]) for r in rows if _finite(r.get("loss"))]
        if pts:
            ax_loss.plot(*zip(*pts), style, color=color, lw=width, zorder=order, label=label)
        scaled = [(r["step"], r["loss_scale"]) for r in rows if _finite(r.get("loss_scale"))]
        if scaled:
            any_scale = True
            ax_scale.step(*zip(*scaled), where="post", color=color, lw=1.4, label=label)
            skipped = [(r["step"], r["loss_scale"]) for r in rows if r.get("skipped") and _finite(r.get("loss_scale"))]
            if skipped:
                ax_scale.scatter(*zip(*skipped), marker="x", color=color, zorder=3)
    ax_loss.set_yscale("log")
    ax_loss.set_ylabel("training loss (unweighted)")
    ax_loss.grid(True, which="both", alpha=0.3)
    ax_loss.legend(loc="center right", fontsize=8 if len(runs) > 7 else None)
    if any_scale:
        ax_scale.set_yscale("log", base=2)
        ax_scale.yaxis.set_major_formatter(FuncFormatter(_scale_tick))
        ax_scale.legend(loc="center right")
    ax_scale.set_ylabel("loss scale (x = skipped step)")
    ax_scale.set_xlabel("step")
    ax_scale.grid(True, which="both", alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.savefig(out, format="png", dpi=110)
