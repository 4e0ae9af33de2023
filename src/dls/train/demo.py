"""``dls demo``: the same small model trained five ways, to show what loss scaling does in float16.

The task is a regression: a 3-layer tanh MLP learns a fixed random "teacher" network (``teacher_regression``,
generated, 4096 samples). Its loss carries a weight of 1e-4 (``model.loss_weight``), as a down-weighted auxiliary
loss would. Adam is invariant to a constant factor on the loss, so in float32 the weight changes nothing, but
every gradient is 1e-4 times smaller, and in float16 a large share of the activation gradients falls below the
smallest subnormal (2**-24 ≈ 6e-8) and is flushed to zero. That is the situation loss scaling exists for.

Runs (identical initial weights and batches): float32; float16 without loss scaling (Model Zoo's
``loss_scaling_factor: 1.0``); float16 with a static scale; float16 with dynamic loss scaling; cbfloat16 with
dynamic loss scaling. float16 runs use real ``torch.autocast``; cbfloat16 has no torch dtype and is emulated
exactly by ``dls.emulate``. The gradient-underflow column is measured, not assumed: every 10 steps one extra
backward pass on the same batch, with ``dls.emulate`` rounding every activation gradient to the run's half
format at the run's current loss scale, counts the nonzero gradient values that become zero.
"""

from __future__ import annotations

import io
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
from dls.train.outputs import CONFIG_FILE, METRICS_FILE, PLOT_FILE
from dls.train.plots import plot_comparison, read_metrics
from dls.train.reporting import TrainResult
from dls.train.rundir import RunDir, open_directory, replace_file, resolve_model_dir
from dls.train.trainer import Trainer

DEFAULT_STEPS = 600
LOSS_WEIGHT = 1e-4
STATIC_SCALE = 256.0
# float16 + DLS starts at (and may grow back to) this scale: high enough that the first steps overflow, so the
# demo shows the scaler backing off to the largest scale that does not overflow, and probing above it later.
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
            # These matrices are tiny: one thread is as fast as two, and far faster when other work shares the cores.
            "num_threads": 1,
        },
    }


@dataclass(frozen=True)
class DemoRun:
    slug: str
    label: str
    precision: dict[str, Any]
    optimizer: dict[str, Any]


RUNS = (
    DemoRun("float32", "float32", {"mixed_precision": False}, {}),
    DemoRun(
        "float16_no_scaling",
        "fp16, no scaling",
        {"mixed_precision": True, "fp16_type": "float16"},
        {"loss_scaling_factor": 1.0},
    ),
    DemoRun(
        "float16_static",
        f"fp16, static {pow2(STATIC_SCALE)}",
        {"mixed_precision": True, "fp16_type": "float16"},
        {"loss_scaling_factor": STATIC_SCALE},
    ),
    DemoRun(
        "float16_dls",
        "fp16 + DLS",
        {"mixed_precision": True, "fp16_type": "float16"},
        {"loss_scaling_factor": "dynamic", "steps_per_increase": 100, "max_loss_scale": DLS_MAX_SCALE},
    ),
    DemoRun(
        "cbfloat16_dls",
        "cbfloat16 + DLS",
        {"mixed_precision": True, "fp16_type": "cbfloat16"},
        {"loss_scaling_factor": "dynamic", "steps_per_increase": 100},
    ),
)


def _scale(value: float | None) -> str:
    return "-" if value is None else pow2(value)


def run_demo(
    out: Path, steps: int = DEFAULT_STEPS, progress: bool = True, console: Console | None = None
) -> list[tuple[DemoRun, TrainResult]]:
    """Train every run of :data:`RUNS` into ``out/<slug>/``, print the comparison, write ``out/demo.png``."""
    console = console if console is not None else Console()
    out.mkdir(parents=True, exist_ok=True)
    console.print(
        f"[bold]dls demo[/]: a 3-layer tanh MLP (32 -> 128 -> 128 -> 128 -> 64) learns a random teacher network; "
        f"Adam, lr 1e-3, batch 128, {steps} steps. The loss is multiplied by {LOSS_WEIGHT:g} (model.loss_weight, "
        "like a down-weighted auxiliary loss): Adam is invariant to that factor, so float32 is unaffected, but the "
        "gradients are 1e4 times smaller and in float16 many fall below its smallest subnormal (6e-8)."
    )
    results: list[tuple[DemoRun, TrainResult]] = []
    start = time.perf_counter()
    for run in RUNS:
        results.append((run, _train_one(run, out, steps, progress, console)))
    total = time.perf_counter() - start
    _print_table(console, results, steps)
    png = io.BytesIO()
    plot_comparison(
        [(run.label, read_metrics(result.metrics_path.read_bytes())) for run, result in results],
        png,
        title=f"dls demo: MLP regression, loss weight {LOSS_WEIGHT:g}, {steps} steps",
    )
    plot = out / "demo.png"
    directory = open_directory(resolve_model_dir(out))
    try:
        replace_file(directory, plot.name, png.getbuffer(), shown=plot)
    finally:
        os.close(directory)
    console.print(
        "Runs: fp16 = float16 under torch.autocast; 'no scaling' = loss_scaling_factor 1.0 (Model Zoo's value for "
        f"no scaling); 'static {_scale(STATIC_SCALE)}' = a fixed, hand-picked scale; 'fp16 + DLS' = "
        f"loss_scaling_factor: dynamic, started at {_scale(DLS_MAX_SCALE)} so it has to back off; 'cbfloat16 + DLS' = "
        "cbfloat16 emulated exactly by dls.emulate, with the Cerebras defaults (start 2^31).",
        highlight=False,
    )
    _print_verdict(console, results)
    console.print(f"Total wall time {total:.1f} s. Plot: {plot}. Per-run metrics and checkpoints: {out}/<run>/")
    return results


def _clear_previous_run(model_dir: Path) -> None:
    """Delete the outputs a previous ``dls demo`` left in ``model_dir`` (the trainer's file names only; links are
    removed, never followed), holding the directory's lock so that a run using it is not disturbed."""
    if not model_dir.exists():
        return
    with RunDir(resolve_model_dir(model_dir)) as run_dir:
        for name in run_dir.names():
            if name in (METRICS_FILE, PLOT_FILE, CONFIG_FILE) or (name.startswith("checkpoint_") and ".mdl" in name):
                os.unlink(name, dir_fd=run_dir.fd)


def _train_one(run: DemoRun, out: Path, steps: int, progress: bool, console: Console) -> TrainResult:
    model_dir = out / run.slug
    _clear_previous_run(model_dir)
    raw = base_config(steps, model_dir)
    raw["precision"].update(run.precision)
    raw["optimizer"].update(run.optimizer)
    cfg = parse_config(raw, source=f"demo run {run.slug}")
    console.print(f"\n[bold]{run.label}[/]")
    return Trainer(cfg, console=console, progress=progress, summary=False, plot=False).train()


def _print_table(console: Console, results: list[tuple[DemoRun, TrainResult]], steps: int) -> None:
    reference = results[0][1].eval_loss
    table = Table(title=f"dls demo ({steps} steps each)", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("run", no_wrap=True)
    table.add_column("loss", justify="right", no_wrap=True)
    table.add_column("vs fp32", justify="right", no_wrap=True)
    table.add_column("skipped", justify="right", no_wrap=True)
    table.add_column("scale", justify="right", no_wrap=True)
    table.add_column("underflow", justify="right", no_wrap=True)
    table.add_column("time", justify="right", no_wrap=True)
    for run, r in results:
        ratio = f"{r.eval_loss / reference:.2f}x" if r.eval_loss is not None and reference else "-"
        underflow = "-" if r.grad_underflow is None or run.slug == "float32" else f"{100 * r.grad_underflow:.1f}%"
        table.add_row(
            run.label,
            f"{r.eval_loss:.4g}" if r.eval_loss is not None else "-",
            ratio,
            str(r.skipped_steps) if r.loss_scale is not None else "-",
            _scale(r.loss_scale),
            underflow,
            f"{r.wall_time:.1f} s",
        )
    console.print()
    console.print(table)
    console.print(
        "loss: final loss, the unweighted mean squared error over the whole data set, evaluated in float32 after "
        "training. scale: final loss scale. underflow: share of nonzero activation gradients that the run's half "
        "format flushes to zero at the loss scale in use (one emulated backward pass every 10 steps, averaged). "
        "skipped: steps whose gradients overflowed and were not applied.",
        highlight=False,
    )


def _print_verdict(console: Console, results: list[tuple[DemoRun, TrainResult]]) -> None:
    by_slug = {run.slug: r for run, r in results}
    ref = by_slug["float32"].eval_loss
    plain = by_slug["float16_no_scaling"].eval_loss
    dls_loss = by_slug["float16_dls"].eval_loss
    if ref is None or plain is None or dls_loss is None:
        return
    lines = []
    close = abs(dls_loss - ref) <= 0.05 * ref
    lines.append(
        f"float16 + DLS ends at {dls_loss:.4g} vs float32's {ref:.4g} "
        + ("(within 5%)." if close else f"({dls_loss / ref:.2f}x: NOT within 5% this time).")
    )
    if plain > 1.05 * ref:
        lines.append(
            f"float16 without loss scaling ends at {plain:.4g}, {plain / ref:.1f}x float32's: its flushed gradients "
            "never reach the weights."
        )
    else:
        lines.append(f"float16 without loss scaling ends at {plain:.4g}, about as well as float32 in this run.")
    console.print("\n".join(lines), highlight=False)
