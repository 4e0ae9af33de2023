"""``dls demo``: one small MLP trained ten ways (:data:`RUNS`); its loss weight of 1e-4 pushes float16's gradients
below its smallest subnormal, the case loss scaling exists for. The runs and columns: docs/guides/trainer.md."""

from __future__ import annotations

import io
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from dls.diagnostics.scales import pow2
from dls.train.config import parse_config
from dls.train.errors import TrainingStopped
from dls.train.fallback_demo import print_fallback_rows, run_fallback_rows
from dls.train.plots import plot_comparison, read_metrics
from dls.train.reporting import TrainResult
from dls.train.rundir import CONFIG_FILE, METRICS_FILE, PLOT_FILE, RunDir, resolve_model_dir
from dls.train.trainer import Trainer

DEFAULT_STEPS = 600
LOSS_WEIGHT = 1e-4
STATIC_SCALE = 256.0
# float16 + DLS starts this high, so that the demo shows the scaler backing off and probing above its scale later.
DLS_MAX_SCALE = 2.0**40


def base_config(steps: int, model_dir: Path) -> dict[str, Any]:
    return {
        "model": {"name": "mlp", "hidden_size": 128, "depth": 3, "activation_fn": "tanh", "loss_weight": LOSS_WEIGHT},
        "data": {"dataset": "teacher_regression", "batch_size": 128, "num_samples": 4096, "input_dim": 32},
        "precision": {},
        "optimizer": {"optimizer_type": "Adam", "learning_rate": 1e-3, "log_summaries": True},
        "runconfig": {
            "max_steps": steps,
            "log_steps": 10,
            "checkpoint_steps": 0,
            "keep_checkpoint_max": 1,
            "model_dir": str(model_dir),
            "seed": 0,
            "num_threads": 1,  # tiny matrices: one thread is as fast as two, and far faster on shared cores
        },
    }


@dataclass(frozen=True)
class DemoRun:
    slug: str
    label: str
    precision: dict[str, Any]
    optimizer: dict[str, Any]


DLS = {"loss_scaling_factor": "dynamic", "steps_per_increase": 100, "max_loss_scale": DLS_MAX_SCALE}
FP16 = {"mixed_precision": True, "fp16_type": "float16"}
FP8 = {"mixed_precision": False}  # FP8 Linear layers, everything else in float32 (no loss scaling)

RUNS = (
    DemoRun("float32", "float32", {"mixed_precision": False}, {}),
    DemoRun("float16_no_scaling", "fp16, no scaling", FP16, {"loss_scaling_factor": 1.0}),
    DemoRun("float16_static", f"fp16, static {pow2(STATIC_SCALE)}", FP16, {"loss_scaling_factor": STATIC_SCALE}),
    DemoRun("float16_dls", "fp16 + DLS", FP16, DLS),
    DemoRun(
        "cbfloat16_dls",
        "cbfloat16 + DLS",
        {"mixed_precision": True, "fp16_type": "cbfloat16"},
        {"loss_scaling_factor": "dynamic", "steps_per_increase": 100},
    ),
    DemoRun("float16_params", "fp16 params, no masters", {**FP16, "half_params": True, "master_weights": False}, DLS),
    DemoRun("float16_params_masters", "fp16 params + masters", {**FP16, "half_params": True}, DLS),
    DemoRun("fp8_scale_1", "fp8, scale 1", {**FP8, "fp8": {"recipe": "static", "scale": 1.0}}, {}),
    DemoRun("fp8_delayed", "fp8 delayed", {**FP8, "fp8": {"recipe": "delayed", "amax_history_len": 16}}, {}),
    DemoRun("fp8_current", "fp8 current", {**FP8, "fp8": {"recipe": "current"}}, {}),
)


@dataclass(frozen=True)
class DemoResult:
    """A run's result; ``stopped``: the step it stopped at because loss scaling could not help, or ``None``."""

    result: TrainResult
    stopped: int | None = None


def run_demo(
    out: Path, steps: int = DEFAULT_STEPS, progress: bool = True, console: Console | None = None
) -> list[tuple[DemoRun, DemoResult]]:
    """Train every run into ``out/<slug>/`` (``out`` locked like a model_dir), print the table, write demo.png."""
    console = console if console is not None else Console()
    with RunDir(resolve_model_dir(out, "--out"), "--out") as run_dir:
        console.print(
            f"[bold]dls demo[/]: a 3-layer tanh MLP learns a random teacher network; Adam, lr 1e-3, batch 128, {steps} "
            f"steps; the loss is multiplied by {LOSS_WEIGHT:g} (model.loss_weight), so float16 flushes many gradients."
        )
        start = time.perf_counter()
        results = [(run, _train_one(run, out, steps, progress, console)) for run in RUNS]
        total = time.perf_counter() - start
        _print_table(console, results, steps)
        print_fallback_rows(console, run_fallback_rows(steps), steps)  # its own model: one amplifying layer
        png = io.BytesIO()
        plot_comparison(
            [(run.label, read_metrics(r.result.metrics_path.read_bytes())) for run, r in results],
            png,
            title=f"dls demo: MLP regression, loss weight {LOSS_WEIGHT:g}, {steps} steps",
        )
        plot = run_dir.replace("demo.png", png.getbuffer())
        _print_verdict(console, results)
        console.print(f"Total wall time {total:.1f} s. Plot: {plot}. Per-run metrics and checkpoints: {out}/<run>/")
    return results


def _train_one(run: DemoRun, out: Path, steps: int, progress: bool, console: Console) -> DemoResult:
    model_dir = out / run.slug
    if model_dir.exists():  # a previous demo's outputs (the trainer's names only; links removed, never followed)
        with RunDir(resolve_model_dir(model_dir)) as previous:
            for name in os.listdir(previous.fd):
                checkpoint = name.startswith("checkpoint_") and ".mdl" in name
                if checkpoint or name in (METRICS_FILE, PLOT_FILE, CONFIG_FILE):
                    os.unlink(name, dir_fd=previous.fd)
    raw = base_config(steps, model_dir)
    raw["precision"].update(run.precision)
    raw["optimizer"].update(run.optimizer)
    cfg = parse_config(raw, source=f"demo run {run.slug}")
    console.print(f"\n[bold]{run.label}[/]")
    trainer = Trainer(cfg, console=console, progress=progress, summary=False, plot=False)
    try:
        return DemoResult(trainer.train())
    except TrainingStopped as stop:
        console.print(f"stopped: {stop}", highlight=False, markup=False)
        return DemoResult(stop.result, stopped=trainer.global_step)


def _print_table(console: Console, results: list[tuple[DemoRun, DemoResult]], steps: int) -> None:
    reference = results[0][1].result.eval_loss
    title = f"dls demo ({steps} steps each)"  # collapse_padding: fits 80 columns (a console that is no terminal)
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for i, column in enumerate(("run", "loss", "vs fp32", "skipped", "scale", "underflow", "time")):
        table.add_column(column, justify="right" if i else "left", no_wrap=True)
    for run, outcome in results:
        r = outcome.result
        finished = outcome.stopped is None and r.eval_loss is not None and math.isfinite(r.eval_loss)
        ratio = f"{r.eval_loss / reference:.2f}x" if finished and r.eval_loss is not None and reference else "-"
        measured = r.grad_underflow if r.fp8_flushed is None else r.fp8_flushed
        underflow = "-" if measured is None or run.slug == "float32" else f"{100 * measured:.1f}%"
        loss = "-" if r.eval_loss is None else f"{r.eval_loss:.4g}"
        table.add_row(
            run.label,
            loss if outcome.stopped is None else f"stopped@{outcome.stopped}",
            ratio,
            str(r.skipped_steps) if r.loss_scale is not None else "-",
            "-" if r.loss_scale is None else pow2(r.loss_scale),
            underflow,
            f"{r.wall_time:.1f}s",
        )
    console.print()
    console.print(table)
    console.print(
        "loss: final float32 loss (unweighted MSE over the data set); underflow: share of nonzero activation "
        "gradients (fp8: grad_output values) flushed to zero at the scale in use; stopped@N: see the message above.",
        highlight=False,
    )


def _print_verdict(console: Console, results: list[tuple[DemoRun, DemoResult]]) -> None:
    outcomes = {run.slug: r for run, r in results}
    loss = {slug: r.result.eval_loss for slug, r in outcomes.items()}
    ref, plain, dyn = loss["float32"], loss["float16_no_scaling"], loss["float16_dls"]
    if ref is None or plain is None or dyn is None:
        return
    within = "(within 5%)." if abs(dyn - ref) <= 0.05 * ref else f"({dyn / ref:.2f}x: NOT within 5% this time)."
    lines = [f"float16 + DLS ends at {dyn:.4g} vs float32's {ref:.4g} {within}"]
    lines.append(
        f"float16 without loss scaling ends at {plain:.4g}, {plain / ref:.1f}x float32's: its flushed gradients "
        "never reach the weights."
        if plain > 1.05 * ref
        else f"float16 without loss scaling ends at {plain:.4g}, about as well as float32 in this run."
    )
    bare, masters = outcomes["float16_params"], loss["float16_params_masters"]
    if outcomes["float16_params_masters"].stopped is None and masters is not None:
        without = (
            f"without masters the run stopped at step {bare.stopped}: its float16 weights became inf/NaN."
            if bare.stopped is not None
            else f"without masters at {bare.result.eval_loss:.4g}."
        )
        lines.append(
            f"float16 parameters with float32 master weights end at {masters:.4g} ({masters / ref:.2f}x float32's); "
            + without
        )
    fixed, delayed, current = (outcomes[slug].result for slug in ("fp8_scale_1", "fp8_delayed", "fp8_current"))
    if all(r.eval_loss is not None and r.fp8_flushed is not None for r in (fixed, delayed, current)):
        lines.append(
            f"FP8 at scale 1 flushes {100 * (fixed.fp8_flushed or 0):.0f}% of the gradients and ends at "
            f"{fixed.eval_loss:.4g}; per-tensor scaling keeps them: delayed ends at {delayed.eval_loss:.4g}, "
            f"current at {current.eval_loss:.4g} (float32: {ref:.4g})."
        )
    console.print("\n".join(lines), highlight=False)
