"""``dls demo``: one small MLP trained ten ways (:data:`RUNS`); its loss weight of 1e-4 pushes float16's gradients
below its smallest subnormal, the case loss scaling exists for. The runs and columns: docs/guides/trainer.md.

Then the float32 fallback's rows (:func:`run_fallback_rows`): a plain-PyTorch loop on :func:`amplifying_net`, whose
layer ``amplify`` outputs ~5e5 (beyond float16's 65504) before a LayerNorm, learning ``tanh(x0 * x1)``; from identical
weights and batches: float32; float16 + DLS under autocast (every step skipped, stopped with the scale at its floor, as
the trainer does); the same with ``scaler.watch(model, fallback=True)``, which keeps ``amplify`` in float32 after the
first overflows. Loss: float32 MSE on 8 held-out batches after training.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import stat
import time
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any, NamedTuple

import torch
from rich import box
from rich.console import Console
from rich.table import Table
from torch import nn

import dls
from dls.diagnostics.scales import pow2
from dls.train.config import load_yaml, parse_config, to_dict
from dls.train.errors import ModelDirError, TrainingStopped
from dls.train.reporting import PlotGroup, PlotRun, TrainResult, plot_demo, read_metrics
from dls.train.rundir import CONFIG_FILE, RunDir, earlier_run_files, resolve_model_dir
from dls.train.trainer import Trainer

LOSS_WEIGHT = 1e-4
STATIC_SCALE = 256.0
# float16 + DLS starts this high, so that the demo shows the scaler backing off and probing above its scale later.
DYNAMIC = {"loss_scaling_factor": "dynamic", "steps_per_increase": 100}
DLS = {**DYNAMIC, "max_loss_scale": 2.0**40}
FP16 = {"mixed_precision": True, "fp16_type": "float16"}
FP8 = {"mixed_precision": False}  # FP8 Linear layers, everything else in float32 (no loss scaling)


def base_config(steps: int, model_dir: Path) -> dict[str, Any]:
    return {
        "model": {"name": "mlp", "hidden_size": 128, "depth": 3, "activation_fn": "tanh", "loss_weight": LOSS_WEIGHT},
        "data": {"dataset": "teacher_regression", "batch_size": 128, "num_samples": 4096, "input_dim": 32},
        "precision": {"log_underflow": True},
        "optimizer": {"optimizer_type": "Adam", "learning_rate": 1e-3},
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


# slug (the run's directory below --out): label, precision and optimizer sections
RUNS = {
    "float32": ("float32", {"mixed_precision": False}, {}),
    "float16_no_scaling": ("fp16, no scaling", FP16, {"loss_scaling_factor": 1.0}),
    "float16_static": (f"fp16, static {pow2(STATIC_SCALE)}", FP16, {"loss_scaling_factor": STATIC_SCALE}),
    "float16_dls": ("fp16 + DLS", FP16, DLS),
    "cbfloat16_dls": ("cbfloat16 + DLS", {**FP16, "fp16_type": "cbfloat16"}, DYNAMIC),
    "float16_params": ("fp16 params, no masters", {**FP16, "half_params": True, "master_weights": False}, DLS),
    "float16_params_masters": ("fp16 params + masters", {**FP16, "half_params": True}, DLS),
    "fp8_scale_1": ("fp8, scale 1", {**FP8, "fp8": {"recipe": "static", "scale": 1.0}}, {}),
    "fp8_delayed": ("fp8 delayed", {**FP8, "fp8": {"recipe": "delayed", "amax_history_len": 16}}, {}),
    "fp8_current": ("fp8 current", {**FP8, "fp8": {"recipe": "current"}}, {}),
}
# label, result, the step it stopped at because scaling cannot help, and why (a few words)
Result = tuple[str, TrainResult, "int | None", str]


def run_demo(out: Path, steps: int, progress: bool = True) -> None:
    """Train every run into ``out/<slug>/`` (``out`` locked like a model_dir), print the tables, write demo.png. An
    earlier demo's output there is replaced, and said so (:func:`replace_earlier_demo`)."""
    console = Console()
    with RunDir(resolve_model_dir(out, "--out"), "--out") as run_dir:
        replace_earlier_demo(out, console)
        console.print(
            f"[bold]dls demo[/]: a 3-layer tanh MLP learns a random teacher network; Adam, lr 1e-3, batch 128, {steps} "
            f"steps; the loss is multiplied by {LOSS_WEIGHT:g} (model.loss_weight), so float16 flushes many gradients."
        )
        start = time.perf_counter()
        results = {slug: _train_one(slug, out, steps, progress, console) for slug in RUNS}
        total = time.perf_counter() - start
        reference = results["float32"][1].eval_loss
        rows = []
        for slug, (label, r, stopped, _) in results.items():
            measured = r.grad_underflow if r.fp8_flushed is None else r.fp8_flushed
            underflow = "-" if measured is None or slug == "float32" else f"{100 * measured:.1f}%"
            cells = _cells(label, r.eval_loss, stopped, reference, r.loss_scale, r.skipped_steps)
            rows.append([*cells, underflow, f"{r.wall_time:.1f}s"])
        note = (
            "loss: final float32 loss (unweighted MSE over the data set); underflow: share of nonzero activation "
            "gradients (fp8: grad_output values) flushed to zero at the scale in use; stopped@N: see the message above."
        )
        _print_table(console, f"dls demo ({steps} steps each)", ["underflow", "time"], rows, note)
        fallback = run_fallback_rows(steps)
        _print_fallback_rows(console, fallback, steps)
        png = io.BytesIO()
        plot_demo(demo_groups(results, fallback), png, title=f"dls demo: {steps} steps per run")
        plot = run_dir.replace("demo.png", png.getbuffer())
        _print_verdict(console, results)
        console.print(f"Total wall time {total:.1f} s. Plot: {plot}. Per-run metrics and checkpoints: {out}/<run>/")


def demo_config(slug: str, steps: int, model_dir: Path) -> dict[str, Any]:
    """The config of the run ``slug`` of :data:`RUNS`."""
    _, precision, optimizer = RUNS[slug]
    raw = base_config(steps, model_dir)
    raw["precision"].update(precision)
    raw["optimizer"].update(optimizer)
    return raw


def replace_earlier_demo(out: Path, console: Console) -> None:
    """Delete the files an earlier ``dls demo`` wrote into ``out/<slug>/`` (the names a run writes, as
    ``dls.train.rundir.earlier_run_files`` lists them; other files stay), and say so: a run directory is a
    demo's when its config.yaml is the config this demo trains there (but for ``max_steps``). Any other earlier
    run's files refuse the demo before anything is deleted (:class:`ModelDirError`, naming them). Each directory is
    locked while its files are deleted, never through a link."""
    replaced = []
    for slug in RUNS:
        model_dir = resolve_model_dir(out / slug, "--out")
        if not (earlier := earlier_run_files(model_dir)):
            continue
        if not _is_demo_output(model_dir, slug) or any(p.is_dir() and not p.is_symlink() for p in earlier):
            names = ", ".join(p.name for p in earlier)
            raise ModelDirError(
                f"--out {out}: {model_dir} holds {names} of a run that is not an earlier dls demo's (its config.yaml "
                "is not the one this demo trains there), which the demo would replace. To keep them, choose another "
                "--out (or move them away)"
            )
        replaced.append((model_dir, earlier))
    for model_dir, earlier in replaced:
        with RunDir(model_dir, "--out") as previous:
            for path in earlier:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path.name, dir_fd=previous.fd)
    if replaced:
        runs = f"{len(replaced)} run{'s' * (len(replaced) > 1)}"
        console.print(f"Replacing the output of an earlier dls demo in {out} ({runs})", highlight=False)


def _is_demo_output(model_dir: Path, slug: str) -> bool:
    """Whether ``model_dir/config.yaml`` (a regular file, not followed) is the config :func:`demo_config` trains
    for ``slug``, whatever its ``max_steps`` and ``model_dir``."""
    try:
        fd = os.open(model_dir / CONFIG_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return False
            saved = parse_config(load_yaml(f.read(1 << 20).decode("utf-8")))
    except (OSError, ValueError):  # missing, a link, unreadable, not UTF-8, not a config (ConfigError)
        return False
    run = {"max_steps": saved.runconfig.max_steps, "model_dir": saved.runconfig.model_dir}
    mine = parse_config(demo_config(slug, 1, model_dir))
    mine = mine.model_copy(update={"runconfig": mine.runconfig.model_copy(update=run)})
    return to_dict(saved) == to_dict(mine)


def _train_one(slug: str, out: Path, steps: int, progress: bool, console: Console) -> Result:
    label = RUNS[slug][0]
    raw = demo_config(slug, steps, out / slug)
    console.print(f"\n[bold]{label}[/]")
    cfg = parse_config(raw, source=f"demo run {slug}")
    trainer = Trainer(cfg, console=console, progress=progress, summary=False, plot=False)
    try:
        return label, trainer.train(), None, ""
    except TrainingStopped as stop:
        console.print(f"stopped: {stop}", highlight=False, markup=False)
        why = "its weights became inf/NaN" if "weights hold inf/NaN" in str(stop) else "loss scaling cannot help"
        return label, stop.result, trainer.global_step, why


def _cells(
    label: str, loss: float | None, stopped: int | None, reference: float | None, scale: float | None, skipped: int
) -> list[str]:
    """A table row's first columns: run, loss (or stopped@N), vs fp32, skipped, scale (the last two: with scaling)."""
    finished = stopped is None and loss is not None and math.isfinite(loss)
    shown = f"stopped@{stopped}" if stopped is not None else "-" if loss is None else f"{loss:.4g}"
    ratio = f"{loss / reference:.2f}x" if finished and loss is not None and reference else "-"
    return [label, shown, ratio, "-" if scale is None else str(skipped), "-" if scale is None else pow2(scale)]


def _print_table(console: Console, title: str, extra: list[str], rows: list[list[str]], note: str) -> None:
    # collapse_padding: fits 80 columns (a console that is no terminal)
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for column in ["run", "loss", "vs fp32", "skipped", "scale", *extra]:
        table.add_column(column, justify="left" if column in ("run", "kept in float32") else "right", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    console.print()
    console.print(table)
    console.print(note, highlight=False)


def _print_verdict(console: Console, results: dict[str, Result]) -> None:
    loss = {slug: r.eval_loss for slug, (_, r, _, _) in results.items()}
    ref, plain, dyn = loss["float32"], loss["float16_no_scaling"], loss["float16_dls"]
    if ref is None or plain is None or dyn is None:
        return
    within = "within 5%" if abs(dyn - ref) <= 0.05 * ref else f"{dyn / ref:.2f}x: NOT within 5% this time"
    lines = [f"float16 + DLS ends at {dyn:.4g} vs float32's {ref:.4g} ({within})."]
    how = f"{plain / ref:.1f}x float32's: its flushed gradients never reach the weights"
    how = how if plain > 1.05 * ref else "about as well as float32 in this run"
    lines.append(f"float16 without loss scaling ends at {plain:.4g}, {how}.")
    _, bare, stopped, _ = results["float16_params"]
    masters = loss["float16_params_masters"]
    if results["float16_params_masters"][2] is None and masters is not None:
        without = f"the run stopped at step {stopped}: its float16 weights became inf/NaN"
        without = without if stopped is not None else f"at {bare.eval_loss:.4g}"
        lines.append(
            f"float16 parameters with float32 master weights end at {masters:.4g} ({masters / ref:.2f}x float32's); "
            f"without masters {without}."
        )
    fixed, delayed, current = (results[slug][1] for slug in ("fp8_scale_1", "fp8_delayed", "fp8_current"))
    if all(r.eval_loss is not None and r.fp8_flushed is not None for r in (fixed, delayed, current)):
        lines.append(
            f"FP8 at scale 1 flushes {100 * (fixed.fp8_flushed or 0):.0f}% of the gradients and ends at "
            f"{fixed.eval_loss:.4g}; per-tensor scaling keeps them: delayed ends at {delayed.eval_loss:.4g}, "
            f"current at {current.eval_loss:.4g} (float32: {ref:.4g})."
        )
    console.print("\n".join(lines), highlight=False)


def amplifying_net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    embed, amplify = nn.Linear(16, 64), nn.Linear(64, 64)
    with torch.no_grad():
        amplify.weight.mul_(3e5)
    layers = OrderedDict(embed=embed, amplify=amplify, norm=nn.LayerNorm(64), act=nn.Tanh(), head=nn.Linear(64, 1))
    return nn.Sequential(layers)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(step))
    return x, torch.tanh(x[:, :1] * x[:, 1:2])


class FallbackRow(NamedTuple):
    label: str
    loss: float | None  # None when stopped
    stopped: int | None  # the step it stopped at
    skipped: int  # steps skipped
    skipped_before_kept: int | None  # steps skipped before the fallback's last addition
    kept: tuple[str, ...]  # the modules kept in float32
    scale: float | None  # the final loss scale; None for float32
    rows: tuple[dict[str, Any], ...] = ()  # per step, as metrics.jsonl's rows: step, loss, loss_scale, skipped
    kept_at: int | None = None  # the step after which the fallback last kept a module


def _train_fallback_row(label: str, steps: int, half: bool, fallback: bool, seed: int) -> FallbackRow:
    model = amplifying_net(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = dls.GradScaler("cpu", init_scale=2.0**16, enabled=half)
    schedule = dls.skip_aware(torch.optim.lr_scheduler.ExponentialLR(optimizer, 0.99), scaler)
    watch = scaler.watch(model, fallback=True) if fallback else None
    skipped, before_kept, stopped, kept_at = 0, None, None, None
    kept: tuple[str, ...] = ()
    rows: list[dict[str, Any]] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's warning is what the row reports
        for step in range(steps):
            x, y = _batch(step)
            with torch.autocast("cpu", dtype=torch.float16, enabled=half):
                loss = nn.functional.mse_loss(model(x).float(), y)
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            schedule.step()  # skip_aware: after applied steps only
            if watch is not None and watch.kept_in_float32 != kept:
                kept, before_kept, kept_at = watch.kept_in_float32, skipped + 1, step + 1  # this step was skipped too
            was_skipped = half and scaler.step_was_skipped(optimizer)
            scale = scaler.get_scale() if half else None
            rows.append({"step": step + 1, "loss": loss.item(), "loss_scale": scale, "skipped": was_skipped})
            if was_skipped:
                skipped += 1
                if scaler.get_non_clamped_scale() < scaler.get_scale():  # pinned at the floor: the trainer stops
                    stopped = step
                    break
    with torch.no_grad():
        final = sum(nn.functional.mse_loss(model(x), y).item() for x, y in map(_batch, range(10_000, 10_008))) / 8
    if watch is not None:
        watch.remove()
    loss_shown = None if stopped is not None or not math.isfinite(final) else final
    final_scale = scaler.get_scale() if half else None
    return FallbackRow(label, loss_shown, stopped, skipped, before_kept, kept, final_scale, tuple(rows), kept_at)


def run_fallback_rows(steps: int = 600, seed: int = 0) -> list[FallbackRow]:
    """The three runs of the module docstring, in order: float32, float16 + DLS, float16 + DLS + fallback."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is as fast as two, and far faster on shared cores
    try:
        runs = [("float32", False, False), ("fp16 + DLS", True, False), ("fp16 + DLS + fallback", True, True)]
        return [_train_fallback_row(label, steps, half, fallback, seed) for label, half, fallback in runs]
    finally:
        torch.set_num_threads(threads)


def demo_groups(results: dict[str, Result], fallback: list[FallbackRow]) -> list[PlotGroup]:
    """The demo's runs as the picture's two groups: the MLP's runs against float32, the fallback's against its own."""
    runs = {
        slug: PlotRun(label, read_metrics(r.metrics_path.read_bytes()), stopped, why)
        for slug, (label, r, stopped, why) in results.items()
    }
    reference, plain, healed = fallback
    kept = f"{', '.join(healed.kept)} kept in float32" if healed.kept else ""
    return [
        PlotGroup(
            f"A 3-layer MLP, loss weight {LOSS_WEIGHT:g}: each run against float32",
            runs["float32"],
            [run for slug, run in runs.items() if slug != "float32"],
        ),
        PlotGroup(
            "float16 that heals itself: one layer outputs ~5e5, beyond float16's 65504",
            PlotRun(reference.label, reference.rows),
            [
                PlotRun(
                    plain.label,
                    plain.rows,
                    None if plain.stopped is None else plain.stopped + 1,
                    "the scale fell to its floor" if plain.stopped is not None else "",
                ),
                PlotRun(
                    healed.label,
                    healed.rows,
                    event=None if healed.kept_at is None else (healed.kept_at, kept),
                ),
            ],
        ),
    ]


def _print_fallback_rows(console: Console, rows: list[FallbackRow], steps: int) -> None:
    """The runs as a table in the style of the demo's, then one sentence on what the fallback did."""
    reference, plain, healed = rows[0].loss, rows[1], rows[2]
    cells = []
    for r in rows:
        kept = (", ".join(r.kept) or "-") + ("" if r.skipped_before_kept is None else f" after {r.skipped_before_kept}")
        cells.append([*_cells(r.label, r.loss, r.stopped, reference, r.scale, r.skipped), kept])
    note = (
        "kept in float32: after N = after N skipped steps. A second model: its layer 'amplify' outputs ~5e5, "
        "beyond float16's 65504, followed by a LayerNorm (dls.train.demo). Plain float16 + DLS skips every step"
        + (f" and stops at step {plain.stopped}, the scale at its floor" if plain.stopped is not None else "")
        + "; loss scaling cannot fix a forward overflow. With scaler.watch(model, fallback=True) the watch keeps "
        f"{', '.join(repr(n) for n in healed.kept) or 'nothing'} in float32 after {healed.skipped_before_kept} "
        "skipped steps"
        + (f" and ends at {healed.loss / reference:.2f}x float32's loss." if healed.loss and reference else ".")
    )
    title = f"float16 that heals itself: one layer outputs ~5e5 ({steps} steps each)"
    _print_table(console, title, ["kept in float32"], cells, note)
