"""``dls demo``: the same small model trained ten ways, to show what loss scaling does in float16, what float32
master weights do for half-precision parameters, and what per-tensor scaling does in FP8.

A 3-layer tanh MLP learns a fixed random "teacher" network (``teacher_regression``, 4096 samples) with Adam; its
loss carries a weight of 1e-4 (``model.loss_weight``), as a down-weighted auxiliary loss would. Adam is invariant
to that factor, so float32 is unaffected, but in float16 many activation gradients fall below the smallest
subnormal (2**-24) and are flushed to zero: the situation loss scaling exists for. The runs (identical initial
weights and batches) are :data:`RUNS`; float16 uses real ``torch.autocast``, cbfloat16 and FP8 are emulated exactly
(``dls.emulate``, ``dls.fp8.emulate``). The underflow column is measured: every 10 steps one extra backward pass
rounds every activation gradient to the run's half format at its current scale (FP8: the share its own E5M2 casts
flushed). A run that stops because loss scaling cannot help is shown as stopped at its step: float16 parameters
without masters are expected to (Adam's float16 second moments underflow, and the update divides by them).
About 35 s on 2 shared CPU cores, one thread per run.
"""

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
from dls.train.outputs import CONFIG_FILE, METRICS_FILE, PLOT_FILE
from dls.train.plots import plot_comparison, read_metrics
from dls.train.reporting import TrainResult
from dls.train.rundir import RunDir, resolve_model_dir
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


DLS = {"loss_scaling_factor": "dynamic", "steps_per_increase": 100, "max_loss_scale": DLS_MAX_SCALE}
FP16 = {"mixed_precision": True, "fp16_type": "float16"}
FP8 = {"mixed_precision": False}  # FP8 Linear layers, everything else in float32 (no loss scaling)

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


def _scale(value: float | None) -> str:
    return "-" if value is None else pow2(value)


@dataclass(frozen=True)
class DemoResult:
    """A run's result; ``stopped``: the step it stopped at because loss scaling could not help, or ``None``."""

    result: TrainResult
    stopped: int | None = None


def run_demo(
    out: Path, steps: int = DEFAULT_STEPS, progress: bool = True, console: Console | None = None
) -> list[tuple[DemoRun, DemoResult]]:
    """Train every run of :data:`RUNS` into ``out/<slug>/``, print the comparison, write ``out/demo.png``; ``out``
    is locked for the whole demo (refused while another run holds it, as a model_dir is)."""
    console = console if console is not None else Console()
    with RunDir(resolve_model_dir(out, "--out"), "--out") as run_dir:
        return _run_all(run_dir, out, steps, progress, console)


def _run_all(
    run_dir: RunDir, out: Path, steps: int, progress: bool, console: Console
) -> list[tuple[DemoRun, DemoResult]]:
    console.print(
        f"[bold]dls demo[/]: a 3-layer tanh MLP (32 -> 128 -> 128 -> 128 -> 64) learns a random teacher network; "
        f"Adam, lr 1e-3, batch 128, {steps} steps. The loss is multiplied by {LOSS_WEIGHT:g} (model.loss_weight, "
        "like a down-weighted auxiliary loss): Adam is invariant to that factor, so float32 is unaffected, but the "
        "gradients are 1e4 times smaller and in float16 many fall below its smallest subnormal (6e-8)."
    )
    results: list[tuple[DemoRun, DemoResult]] = []
    start = time.perf_counter()
    for run in RUNS:
        results.append((run, _train_one(run, out, steps, progress, console)))
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
    console.print(
        "Runs: fp16 = float16 under torch.autocast; 'no scaling' = loss_scaling_factor 1.0 (Model Zoo's value for "
        f"no scaling); 'static {_scale(STATIC_SCALE)}' = a fixed, hand-picked scale; 'fp16 + DLS' = "
        f"loss_scaling_factor: dynamic, started at {_scale(DLS_MAX_SCALE)} so it has to back off; 'cbfloat16 + DLS' = "
        "cbfloat16 emulated exactly by dls.emulate, with the Cerebras defaults (start 2^31). 'fp16 params' = "
        "precision.half_params: the parameters are float16 and the model computes in float16 (no autocast), with "
        "DLS as 'fp16 + DLS'; 'no masters' lets Adam step the float16 parameters (its state is float16 too), "
        "'+ masters' steps float32 master weights (dls.master_weights). 'fp8' = precision.fp8: every Linear layer "
        "computes on FP8 operands (E4M3 forward, E5M2 gradients, emulated exactly by dls.fp8), the rest in float32 "
        "without loss scaling; 'scale 1' casts the values as they are (dls.fp8.StaticScaling), 'delayed' scales "
        "each tensor from the amax history of its earlier casts (TransformerEngine's rule, 16 steps), 'current' from "
        "its own amax (torchao's tensorwise).",
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


def _train_one(run: DemoRun, out: Path, steps: int, progress: bool, console: Console) -> DemoResult:
    model_dir = out / run.slug
    _clear_previous_run(model_dir)
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
    table = Table(
        title=f"dls demo ({steps} steps each)",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,  # fits 80 columns, the width of a console that is not a terminal
    )
    table.add_column("run", no_wrap=True)
    table.add_column("loss", justify="right", no_wrap=True)
    table.add_column("vs fp32", justify="right", no_wrap=True)
    table.add_column("skipped", justify="right", no_wrap=True)
    table.add_column("scale", justify="right", no_wrap=True)
    table.add_column("underflow", justify="right", no_wrap=True)
    table.add_column("time", justify="right", no_wrap=True)
    for run, outcome in results:
        r = outcome.result
        finished = outcome.stopped is None and r.eval_loss is not None and math.isfinite(r.eval_loss)
        ratio = f"{r.eval_loss / reference:.2f}x" if finished and r.eval_loss is not None and reference else "-"
        measured = r.grad_underflow if r.fp8_flushed is None else r.fp8_flushed
        underflow = "-" if measured is None or run.slug == "float32" else f"{100 * measured:.1f}%"
        if outcome.stopped is not None:
            loss = f"stopped@{outcome.stopped}"
        else:
            loss = f"{r.eval_loss:.4g}" if r.eval_loss is not None else "-"
        table.add_row(
            run.label,
            loss,
            ratio,
            str(r.skipped_steps) if r.loss_scale is not None else "-",
            _scale(r.loss_scale),
            underflow,
            f"{r.wall_time:.1f}s",
        )
    console.print()
    console.print(table)
    console.print(
        "loss: final loss, the unweighted mean squared error over the whole data set, evaluated in float32 after "
        "training. scale: final loss scale. underflow: share of nonzero activation gradients that the run's half "
        "format flushes to zero at the loss scale in use (one emulated backward pass every 10 steps, averaged). "
        "skipped: steps whose gradients overflowed and were not applied. For fp8 runs, underflow is the share of "
        "nonzero grad_output values the E5M2 casts flushed to zero (all steps). stopped@N: the run stopped at step "
        "N because loss scaling could not help (its message above says where and why).",
        highlight=False,
    )


def _print_verdict(console: Console, results: list[tuple[DemoRun, DemoResult]]) -> None:
    outcomes = {run.slug: r for run, r in results}
    by_slug = {slug: r.result for slug, r in outcomes.items()}
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
    masters, bare = outcomes["float16_params_masters"], outcomes["float16_params"]
    if masters.stopped is None and masters.result.eval_loss is not None:
        loss = masters.result.eval_loss
        lines.append(
            f"float16 parameters with float32 master weights end at {loss:.4g} ({loss / ref:.2f}x float32's); "
            + (
                f"without masters the run stopped at step {bare.stopped}: its float16 weights became inf/NaN."
                if bare.stopped is not None
                else f"without masters at {bare.result.eval_loss:.4g}."
            )
        )
    fp8 = {slug: by_slug[slug] for slug in ("fp8_scale_1", "fp8_delayed", "fp8_current")}
    if all(r.eval_loss is not None and r.fp8_flushed is not None for r in fp8.values()):
        fixed, delayed, current = fp8.values()
        lines.append(
            f"FP8 at scale 1 flushes {100 * (fixed.fp8_flushed or 0):.0f}% of the gradients and ends at "
            f"{fixed.eval_loss:.4g}; per-tensor scaling keeps them: delayed ends at {delayed.eval_loss:.4g}, "
            f"current at {current.eval_loss:.4g} (float32: {ref:.4g})."
        )
    console.print("\n".join(lines), highlight=False)
