"""What a run shows (progress, one-line descriptions, the summary), from values the loop has already read; reading
``metrics.jsonl``, and PNG plots of it (matplotlib's Agg canvas, imported only when plotting)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from dls.diagnostics.scales import pow2
from dls.fp8 import recipe_from_dict
from dls.train.config import TrainConfig, loss_scaling_mode, scaler_settings
from dls.train.errors import ModelDirError


@dataclass
class TrainResult:
    """What a run did."""

    model_dir: Path
    global_step: int
    steps_run: int
    final_loss: float | None
    eval_loss: float | None
    skipped_steps: int
    loss_scale: float | None
    scaling: str
    grad_underflow: float | None
    wall_time: float
    checkpoint: Path | None
    metrics_path: Path
    plot_path: Path | None
    fp8_flushed: float | None = None
    fp8_saturated: float | None = None


def json_number(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def describe_scaling(cfg: TrainConfig) -> str:
    mode, s = loss_scaling_mode(cfg), scaler_settings(cfg)
    if mode != "dynamic":
        return "no loss scaling" if mode == "off" else f"static loss scale {pow2(s.init_scale)}"
    return (
        f"dynamic loss scaling (start {pow2(s.init_scale)}, x{s.growth_factor:g} after {s.growth_interval} "
        f"clean steps, range {pow2(s.min_loss_scale)}..{pow2(s.max_loss_scale)})"
    )


def describe_precision(cfg: TrainConfig) -> str:
    prec, dtype = cfg.precision, cfg.precision.compute_dtype
    if dtype == "float32":
        text = "float32"
    elif prec.half_params:
        how = "dls.emulate, parameters on its grid" if dtype == "cbfloat16" else "parameters, no autocast"
        masters = "float32 master weights" if prec.master_weights else "no master weights"
        text = f"{dtype} ({how}; {masters})"
    else:
        text = f"{dtype} ({'dls.emulate' if prec.emulated else 'torch.autocast'})"
    if prec.fp8 is not None:
        text += f", FP8 Linear layers ({recipe_from_dict(dict(prec.fp8)).describe()})"
    return text


def describe_run(
    cfg: TrainConfig, start_step: int, model_dir: Path, world_size: int, device_type: str, max_steps: int
) -> str:
    text = (
        f"{cfg.model.name} on {cfg.data.dataset or cfg.data.data_processor}, {describe_precision(cfg)}, "
        f"{describe_scaling(cfg)}; steps {start_step}->{max_steps}; output in {model_dir}"
    )
    batch = f"; data-parallel on {world_size} ranks ({device_type}), global batch {world_size} x {cfg.data.batch_size}"
    return text + (batch if world_size > 1 else "")


class ProgressDisplay:
    """A rich progress bar on a terminal; otherwise a plain line about every 10% of the steps."""

    def __init__(self, console: Console, enabled: bool, total: int, start: int, label: str) -> None:
        self.console, self.enabled, self.total = console, enabled, total
        self.every = max(1, (total - start) // 10)
        self.progress: Progress | None = None
        if enabled and console.is_terminal:
            bar = (TextColumn("[bold]{task.fields[label]}"), BarColumn(), MofNCompleteColumn())
            times = (TextColumn("{task.description}"), TimeElapsedColumn(), TimeRemainingColumn())
            self.progress = Progress(*bar, *times, console=console)
            self.task = self.progress.add_task("", total=total, completed=start, label=label)
            self.progress.start()

    def update(self, row: dict[str, Any], skipped_total: int | None) -> None:
        if not self.enabled:
            return
        step, scale = row["step"], row["loss_scale"]
        parts = [f"loss {row['loss']:.4g}" if row["loss"] is not None else "loss nan"]
        if scale is not None:
            parts.append(f"scale {pow2(scale)}")
        if skipped_total is not None:
            parts.append(f"skipped {skipped_total}")
        text = "  ".join(parts)
        if self.progress is not None:
            self.progress.update(self.task, completed=step, description=text)
        elif step % self.every == 0 or step == self.total:
            self.console.print(f"step {step}/{self.total}  {text}", highlight=False, soft_wrap=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


def print_summary(console: Console, cfg: TrainConfig, result: TrainResult) -> None:
    """The run's summary: a table on a terminal (long values wrap inside their cell); elsewhere (a file, a pipe, a
    log) one ``label  value`` line per row, never wrapped or cut, so paths can be copied whole."""
    rows = [("global step", f"{result.global_step} ({result.steps_run} in this session)")]
    rows += [("precision", describe_precision(cfg)), ("loss scaling", describe_scaling(cfg))]
    if result.final_loss is not None:
        rows.append(("training loss (last 10%)", f"{result.final_loss:.5g}"))
    if result.eval_loss is not None:
        rows.append(("eval loss (float32)", f"{result.eval_loss:.5g}"))
    if result.loss_scale is not None:
        pct = 100 * result.skipped_steps / max(result.global_step, 1)
        rows.append(("final loss scale", pow2(result.loss_scale)))
        rows.append(("skipped steps", f"{result.skipped_steps} ({pct:.1f}%)"))
    if result.grad_underflow is not None:
        rows.append(("gradient underflow", f"{100 * result.grad_underflow:.2f}% of nonzero activation gradients"))
    if result.fp8_flushed is not None and result.fp8_saturated is not None:
        flushed, saturated = 100 * result.fp8_flushed, 100 * result.fp8_saturated
        rows.append(
            ("FP8 grad_output", f"{flushed:.2f}% of nonzero values flushed to zero, {saturated:.2f}% saturated")
        )
    rows += [("wall time", f"{result.wall_time:.1f} s"), ("checkpoint", str(result.checkpoint))]
    rows.append(("metrics", str(result.metrics_path)))
    if result.plot_path is not None:
        rows.append(("plot", str(result.plot_path)))
    title = f"dls train: {result.model_dir}"
    if not console.is_terminal:
        width = max(len(label) for label, _ in rows)
        lines = [title, *(f"  {label:<{width}}  {value}" for label, value in rows)]
        console.print("\n".join(lines), soft_wrap=True, highlight=False, markup=False)
        return
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")
    for label, value in rows:
        table.add_row(label, value)
    console.print(table)


def _row(line: bytes) -> dict[str, Any] | str:
    """A metrics row (a mapping with a step >= 0), or what is wrong with ``line``."""
    try:
        row = json.loads(line)
    except ValueError as exc:  # not JSON or not UTF-8
        return str(exc).splitlines()[0]
    except RecursionError:  # a nesting bomb: no metrics row nests
        return "nested too deeply to be a metrics row"
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


def _finite(rows: Sequence[dict[str, Any]], key: str) -> tuple[list[Any], list[Any]]:
    """The steps and values of ``key`` that a log axis can show (finite, > 0)."""
    kept = [r for r in rows if isinstance(r.get(key), (int, float)) and 0 < r[key] < math.inf]
    return [r["step"] for r in kept], [r[key] for r in kept]


def log2_axis(ax: Any, values: Sequence[float]) -> None:
    """A log2 y axis fitted to ``values`` (powers of two, mostly), ticks labelled ``2^k`` a few binades apart:
    each run's scale gets its own axis, so that a back-off of one binade is as visible as a fall of forty."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    low, high = math.floor(math.log2(min(values))), math.ceil(math.log2(max(values)))
    every = max(1, math.ceil((high - low) / 4))
    first = every * math.floor(low / every)
    ax.set_yscale("log", base=2)
    ax.set_ylim(2.0 ** (low - 0.6), 2.0 ** (high + 0.6))
    ax.yaxis.set_major_locator(FixedLocator([2.0**k for k in range(first, high + 1, every)]))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"$2^{{{round(math.log2(y))}}}$"))


@dataclass
class PlotRun:
    """One run of ``plot_demo``: its metrics rows (``step``, ``loss``, ``loss_scale``, ``skipped``), the step it
    stopped at (``None``: it finished) and why, in a few words; ``event``: a step worth marking, and what happened."""

    label: str
    rows: Sequence[dict[str, Any]]
    stopped: int | None = None
    why: str = ""
    event: tuple[int, str] | None = None


@dataclass
class PlotGroup:
    """Runs of one model, each drawn against ``reference`` (float32) on the same axes."""

    title: str
    reference: PlotRun
    runs: Sequence[PlotRun]


def plot_demo(groups: Sequence[PlotGroup], out: IO[bytes], title: str = "", columns: int = 3) -> Any:
    """The demo's picture as a PNG into ``out``; the figure. One panel per run: its loss (blue) over its group's
    float32 loss (a wide grey band, so a run that matches float32 shows as a blue line inside it), and below, on a
    log2 axis of its own, its loss scale (green) with each skipped step as a red dot. A run that stopped is drawn up
    to the step it stopped at, marked by a red dashed line and why; a loss that became inf/NaN ends in a red cross.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    rows_of = [-(-len(g.runs) // columns) for g in groups]
    fig = Figure(figsize=(4.5 * columns, sum(3.6 * n + 0.5 for n in rows_of) + 0.9), layout="constrained")
    FigureCanvasAgg(fig)
    subfigures = fig.subfigures(len(groups), 1, height_ratios=[3.6 * n + 0.5 for n in rows_of], squeeze=False)
    for group, subfigure, nrows in zip(groups, subfigures[:, 0], rows_of):
        subfigure.suptitle(group.title, fontsize=11, fontweight="bold")
        axes = subfigure.subplots(2 * nrows, columns, sharex=True, squeeze=False, height_ratios=[2.2, 1.2] * nrows)
        loss_axes, scale_axes = axes[0::2].ravel(), axes[1::2].ravel()
        for ax in loss_axes[1:]:
            ax.sharey(loss_axes[0])
        reference = _finite(group.reference.rows, "loss")
        for i, run in enumerate(group.runs):
            _draw_run(loss_axes[i], scale_axes[i], run, reference)
        for ax in [*loss_axes[len(group.runs) :], *scale_axes[len(group.runs) :]]:
            ax.set_axis_off()
        loss_axes[0].set_yscale("log")
        for ax, label in zip(axes[:, 0], ["loss", "loss scale"] * nrows):
            ax.set_ylabel(label)
        for ax in scale_axes[max(0, len(group.runs) - columns) : len(group.runs)]:
            ax.set_xlabel("step")
    handles = [
        Line2D([], [], color="tab:blue", lw=1.4, label="the run's loss"),
        Line2D([], [], color="0.78", lw=5, label="float32's loss (reference)"),
        Line2D([], [], color="tab:green", lw=1.4, label="loss scale"),
        Line2D([], [], color="tab:red", marker="o", ms=3.5, ls="", label="skipped step"),
        Line2D([], [], color="tab:red", ls="--", lw=1.2, label="the run stopped"),
    ]
    fig.legend(handles=handles, loc="outside lower center", ncols=5, fontsize=9, frameon=False)
    if title:
        fig.suptitle(title, fontsize=12)
    fig.savefig(out, format="png", dpi=100)
    return fig


def _draw_run(ax_loss: Any, ax_scale: Any, run: PlotRun, reference: tuple[list[Any], list[Any]]) -> None:
    (steps, losses), (scale_steps, scales) = _finite(run.rows, "loss"), _finite(run.rows, "loss_scale")
    skipped = [r for r in run.rows if r.get("skipped")]
    ax_loss.plot(*reference, color="0.78", lw=5, solid_capstyle="round", zorder=1)
    if steps:
        ax_loss.plot(steps, losses, color="tab:blue", lw=1.4, zorder=3)
    finite = [isinstance(r.get("loss"), (int, float)) and math.isfinite(r["loss"]) for r in run.rows]
    notes = []
    if False in finite:  # the loss ends inf/NaN from some step on, or is inf/NaN at some (skipped) steps only
        end = len(finite) - finite[::-1].index(True) if True in finite else 0
        if end < len(finite):
            if steps:
                ax_loss.plot(steps[-1], losses[-1], "x", color="tab:red", ms=9, mew=2, zorder=4)
            notes.append(f"loss inf/NaN from step {run.rows[end]['step']} on")
        if early := finite[:end].count(False):
            notes.append(f"loss inf/NaN at {early} step{'s' * (early > 1)}")
    if run.stopped is not None:
        for ax in (ax_loss, ax_scale):
            ax.axvline(run.stopped, color="tab:red", ls="--", lw=1.2, zorder=2)
        notes.append(f"stopped at step {run.stopped}" + (f":\n{run.why}" if run.why else ""))
    if run.event is not None:
        step, what = run.event
        for ax in (ax_loss, ax_scale):
            ax.axvline(step, color="tab:purple", ls=":", lw=1.2, zorder=2)
        notes.append(what)
    if notes:
        ax_loss.text(
            0.97, 0.95, "\n".join(notes), ha="right", va="top", fontsize=7.5, color="tab:red",
            transform=ax_loss.transAxes, bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8},
        )  # fmt: skip
    title = run.label + (f"  ({len(skipped)} skipped)" if skipped else "")
    ax_loss.set_title(title, fontsize=9.5)
    if scales:
        ax_scale.step(scale_steps, scales, where="post", color="tab:green", lw=1.4, zorder=3)
        marks = _finite(skipped, "loss_scale")
        if marks[0]:
            ax_scale.scatter(*marks, s=9, color="tab:red", zorder=4, linewidths=0)
        log2_axis(ax_scale, scales)
    else:
        ax_scale.set_yticks([])
        ax_scale.text(0.5, 0.5, "no loss scaling", ha="center", va="center", color="0.4", transform=ax_scale.transAxes)
    for ax in (ax_loss, ax_scale):
        ax.grid(True, which="major", alpha=0.3)


def plot_comparison(runs: Sequence[tuple[str, Sequence[dict[str, Any]]]], out: IO[bytes], title: str = "") -> Any:
    """Small multiples (``runs``: one at least) as a PNG into ``out``; the figure. Per run its loss over the first
    run's (dashed grey) and its loss scale below, skipped steps as red crosses; shared axes, so runs compare by
    position and no curve hides another. A run's plots.png is ``[("training loss", rows)]``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    columns = min(len(runs), 5)
    groups = -(-len(runs) // columns)
    fig = Figure(figsize=((8.4 if columns == 1 else 3.1) * columns + 0.6, 3.5 * groups + 0.9), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2 * groups, columns, sharex=True, squeeze=False, height_ratios=[3, 1.3] * groups)
    loss_axes, scale_axes = axes[0::2].ravel(), axes[1::2].ravel()
    for shared in (loss_axes, scale_axes):
        for ax in shared[1:]:
            ax.sharey(shared[0])

    def points(rows: Sequence[dict[str, Any]], key: str) -> tuple[list[Any], list[Any]]:  # log axes: finite, > 0
        kept = [r for r in rows if isinstance(r.get(key), (int, float)) and 0 < r[key] < math.inf]
        return [r["step"] for r in kept], [r[key] for r in kept]

    reference = points(runs[0][1], "loss")
    for i, (label, rows) in enumerate(runs):
        ax_loss, ax_scale = loss_axes[i], scale_axes[i]
        (steps, losses), scales = points(rows, "loss"), points(rows, "loss_scale")
        skipped = [r for r in rows if r.get("skipped")]
        if reference[0] and i > 0:
            ax_loss.plot(*reference, "--", color="0.55", lw=1.2)
        if steps:
            ax_loss.plot(steps, losses, color="black" if i == 0 and len(runs) > 1 else "tab:blue", lw=1.4)
        if rows and (not steps or steps[-1] < rows[-1]["step"]):  # the loss became inf/NaN: say so, not a gap
            text = f"loss inf/NaN after step {steps[-1] if steps else 0}\nlast row: step {rows[-1]['step']}"
            ax_loss.text(
                0.97, 0.95, text, ha="right", va="top", fontsize=7, color="tab:red", transform=ax_loss.transAxes
            )
        if scales[0]:
            ax_scale.step(*scales, where="post", color="tab:green", lw=1.4)
        else:
            ax_scale.text(
                0.5, 0.5, "no loss scale", ha="center", va="center", color="0.4", transform=ax_scale.transAxes
            )
        ax_loss.set_title(label, fontsize=9)
        ax_loss.set_yscale("log")
        for ax, key in ((ax_loss, "loss"), (ax_scale, "loss_scale")):
            marks = points(skipped, key)
            if marks[0]:  # (an empty scatter breaks a log axis that has no data)
                ax.scatter(*marks, marker="x", s=16, color="tab:red", zorder=3)
            ax.grid(True, which="both", alpha=0.3)
    for ax in [*loss_axes[len(runs) :], *scale_axes[len(runs) :]]:
        ax.set_axis_off()
    if every_scale := [v for _, rows in runs for v in points(rows, "loss_scale")[1]]:
        log2_axis(scale_axes[0], every_scale)  # shared by the runs' scale axes
    for ax, label in zip(axes[:, 0], ["loss (unweighted)", "loss scale"] * groups):
        ax.set_ylabel(label)
    for ax in axes[-1]:
        ax.set_xlabel("step")
    handles = [Line2D([], [], color="tab:blue", lw=1.4, label="the run's loss")]
    if len(runs) > 1:  # the first run is the others' reference
        handles.append(Line2D([], [], color="0.55", ls="--", lw=1.2, label=f"{runs[0][0]} (reference)"))
    handles += [
        Line2D([], [], color="tab:green", lw=1.4, label="loss scale"),
        Line2D([], [], color="tab:red", marker="x", ls="", label="skipped step"),
    ]
    fig.legend(handles=handles, loc="outside lower center", ncols=4, fontsize=9, frameon=False)
    if title:
        fig.suptitle(title)
    fig.savefig(out, format="png", dpi=110)
    return fig
