"""What a run shows (progress, one-line descriptions, the summary), from values the loop has already read."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from dls.diagnostics.scales import pow2
from dls.train.config import TrainConfig, loss_scaling_mode, scaler_settings


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
    mode = loss_scaling_mode(cfg)
    if mode == "off":
        return "no loss scaling"
    s = scaler_settings(cfg)
    if mode == "static":
        return f"static loss scale {pow2(s.init_scale)}"
    return (
        f"dynamic loss scaling (start {pow2(s.init_scale)}, x{s.growth_factor:g} after {s.growth_interval} "
        f"clean steps, range {pow2(s.min_loss_scale)}..{pow2(s.max_loss_scale)})"
    )


def describe_precision(cfg: TrainConfig) -> str:
    prec = cfg.precision
    dtype = prec.compute_dtype
    if dtype == "float32":
        text = "float32"
    elif prec.half_params:
        how = "dls.emulate, parameters on its grid" if dtype == "cbfloat16" else "parameters, no autocast"
        masters = "float32 master weights" if prec.master_weights else "no master weights"
        text = f"{dtype} ({how}; {masters})"
    else:
        text = f"{dtype} ({'dls.emulate' if prec.emulated else 'torch.autocast'})"
    if prec.fp8 is not None:
        text += f", FP8 Linear layers ({describe_fp8(prec.fp8)})"
    return text


def describe_fp8(recipe: Mapping[str, Any]) -> str:
    """``delayed scaling, margin 2``: the recipe's name and the fields that differ from its defaults."""
    from dls.fp8 import RECIPE_NAMES

    name = recipe["recipe"]
    defaults = RECIPE_NAMES[name]().to_dict()
    changed = [f"{k} {v}" for k, v in recipe.items() if k != "recipe" and defaults.get(k) != v]
    return ", ".join([f"{name} scaling", *changed])


def describe_run(
    cfg: TrainConfig, start_step: int, model_dir: Path, world_size: int, device_type: str, max_steps: int
) -> str:
    text = (
        f"{cfg.model.name} on {cfg.data.dataset or cfg.data.data_processor}, {describe_precision(cfg)}, "
        f"{describe_scaling(cfg)}; steps {start_step}->{max_steps}; output in {model_dir}"
    )
    if world_size > 1:
        text += f"; data-parallel on {world_size} ranks ({device_type}), global batch {world_size} x "
        text += str(cfg.data.batch_size)
    return text


class ProgressDisplay:
    """A rich progress bar on a terminal; otherwise a plain line about every 10% of the steps."""

    def __init__(self, console: Console, enabled: bool, total: int, start: int, label: str) -> None:
        self.console = console
        self.total = total
        self.every = max(1, (total - start) // 10)
        self.progress: Progress | None = None
        self.enabled = enabled
        if enabled and console.is_terminal:
            bar = (TextColumn("[bold]{task.fields[label]}"), BarColumn(), MofNCompleteColumn())
            times = (TextColumn("{task.description}"), TimeElapsedColumn(), TimeRemainingColumn())
            self.progress = Progress(*bar, *times, console=console)
            self.task = self.progress.add_task("", total=total, completed=start, label=label)
            self.progress.start()

    def update(self, row: dict[str, Any], skipped_total: int | None) -> None:
        if not self.enabled:
            return
        step = row["step"]
        parts = [f"loss {row['loss']:.4g}" if row["loss"] is not None else "loss nan"]
        if row["loss_scale"] is not None:
            parts.append(f"scale {pow2(row['loss_scale'])}")
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
    table = Table(title=f"dls train: {result.model_dir}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    table.add_row("global step", f"{result.global_step} ({result.steps_run} in this session)")
    table.add_row("precision", describe_precision(cfg))
    table.add_row("loss scaling", describe_scaling(cfg))
    if result.final_loss is not None:
        table.add_row("training loss (last 10%)", f"{result.final_loss:.5g}")
    if result.eval_loss is not None:
        table.add_row("eval loss (float32)", f"{result.eval_loss:.5g}")
    if result.loss_scale is not None:
        pct = 100 * result.skipped_steps / max(result.global_step, 1)
        table.add_row("final loss scale", pow2(result.loss_scale))
        table.add_row("skipped steps", f"{result.skipped_steps} ({pct:.1f}%)")
    if result.grad_underflow is not None:
        table.add_row("gradient underflow", f"{100 * result.grad_underflow:.2f}% of nonzero activation gradients")
    if result.fp8_flushed is not None and result.fp8_saturated is not None:
        flushed, saturated = 100 * result.fp8_flushed, 100 * result.fp8_saturated
        table.add_row(
            "FP8 grad_output", f"{flushed:.2f}% of nonzero values flushed to zero, {saturated:.2f}% saturated"
        )
    table.add_row("wall time", f"{result.wall_time:.1f} s")
    table.add_row("checkpoint", str(result.checkpoint))
    table.add_row("metrics", str(result.metrics_path))
    if result.plot_path is not None:
        table.add_row("plot", str(result.plot_path))
    console.print(table)
