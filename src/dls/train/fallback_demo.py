"""The float32 fallback's rows of ``dls demo``: a model with one amplifying layer whose float16 output overflows.

The model (``AmplifyingNet``): ``Linear(16, 64)`` → ``amplify = Linear(64, 64)`` with weights 3e5 times their
default initialisation, so that its outputs reach about 5e5 (float16's largest value is 65504) → ``LayerNorm`` →
``Tanh`` → ``Linear(64, 1)``. The LayerNorm brings the activations back to order 1, so in float32 the model trains
normally. It learns ``tanh(x0 * x1)`` from Gaussian inputs (fresh batches of 64 each step); Adam, lr 1e-2 decaying
by 0.99 per applied step.

Three runs from identical weights and batches, float16 under ``torch.autocast``:

* float32: the reference;
* float16 + DLS: every forward pass overflows in ``amplify``, every step is skipped, and the scale falls to its
  floor (the run stops there, as the trainer does);
* float16 + DLS + fallback (``scaler.watch(model, fallback=True)``): the first overflow arms the watch, the next
  pass finds ``amplify``, which computes in float32 from then on; the row says how many steps were skipped first.

The loss is the float32 mean squared error on 8 held-out batches after training.
"""

from __future__ import annotations

import math
import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

import dls
from dls.diagnostics.scales import pow2

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["FallbackRow", "amplifying_net", "print_fallback_rows", "run_fallback_rows"]

GAIN = 3e5


def amplifying_net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(
        OrderedDict(
            embed=nn.Linear(16, 64),
            amplify=nn.Linear(64, 64),
            norm=nn.LayerNorm(64),
            act=nn.Tanh(),
            head=nn.Linear(64, 1),
        )
    )
    amplify = model.get_submodule("amplify")
    assert isinstance(amplify, nn.Linear)
    with torch.no_grad():
        amplify.weight.mul_(GAIN)
    return model


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(64, 16, generator=g)
    return x, torch.tanh(x[:, :1] * x[:, 1:2])


@dataclass(frozen=True)
class FallbackRow:
    """One run: ``loss`` (``None`` when stopped), ``stopped`` (the step it stopped at), ``skipped`` (steps
    skipped), ``skipped_before_kept`` (steps skipped before the fallback's last addition), ``kept`` (module
    names), ``scale`` (final loss scale; ``None`` for float32), ``seconds``."""

    label: str
    loss: float | None
    stopped: int | None
    skipped: int
    skipped_before_kept: int | None
    kept: tuple[str, ...]
    scale: float | None
    seconds: float


def _train(label: str, steps: int, half: bool, fallback: bool, seed: int) -> FallbackRow:
    start = time.perf_counter()
    model = amplifying_net(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    schedule = torch.optim.lr_scheduler.ExponentialLR(optimizer, 0.99)
    scaler = dls.GradScaler("cpu", init_scale=2.0**16, enabled=half)
    watch = scaler.watch(model, fallback=True) if fallback else None
    skipped = 0
    before_kept: int | None = None
    stopped = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's warning is what the row reports
        for step in range(steps):
            x, y = _batch(step)
            with torch.autocast("cpu", dtype=torch.float16, enabled=half):
                out = model(x)
            loss = nn.functional.mse_loss(out.float(), y)
            optimizer.zero_grad()
            kept_before = len(watch.kept_in_float32) if watch is not None else 0
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if watch is not None and len(watch.kept_in_float32) > kept_before:
                before_kept = skipped + 1  # this step was skipped too
            if half and scaler.step_was_skipped(optimizer):
                skipped += 1
                if scaler.get_non_clamped_scale() < scaler.get_scale():  # pinned at the floor: the trainer stops
                    stopped = step
                    break
            else:
                schedule.step()
    with torch.no_grad():
        losses = [nn.functional.mse_loss(model(_batch(10_000 + i)[0]), _batch(10_000 + i)[1]).item() for i in range(8)]
    kept = watch.kept_in_float32 if watch is not None else ()
    if watch is not None:
        watch.remove()
    final = sum(losses) / len(losses)
    return FallbackRow(
        label=label,
        loss=None if stopped is not None or not math.isfinite(final) else final,
        stopped=stopped,
        skipped=skipped,
        skipped_before_kept=before_kept,
        kept=kept,
        scale=scaler.get_scale() if half else None,
        seconds=time.perf_counter() - start,
    )


def run_fallback_rows(steps: int = 600, seed: int = 0) -> list[FallbackRow]:
    """The three runs of the module docstring, in order: float32, float16 + DLS, float16 + DLS + fallback."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is as fast as two, and far faster on shared cores
    try:
        return [
            _train("float32", steps, half=False, fallback=False, seed=seed),
            _train("fp16 + DLS", steps, half=True, fallback=False, seed=seed),
            _train("fp16 + DLS + fallback", steps, half=True, fallback=True, seed=seed),
        ]
    finally:
        torch.set_num_threads(threads)


def print_fallback_rows(console: Console, rows: list[FallbackRow], steps: int) -> None:
    """The runs as a table in the style of the demo's, then one sentence on what the fallback did."""
    from rich import box  # here: examples/self_healing_fp16.py builds its model with amplifying_net, without rich
    from rich.table import Table

    reference = rows[0].loss
    table = Table(
        title=f"float16 that heals itself: one layer outputs ~5e5 ({steps} steps each)",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
    )
    for column in ("run", "loss", "vs fp32", "skipped", "scale", "kept in float32"):
        table.add_column(column, justify="left" if column in ("run", "kept in float32") else "right", no_wrap=True)
    for row in rows:
        loss = f"stopped@{row.stopped}" if row.stopped is not None else "-" if row.loss is None else f"{row.loss:.4g}"
        ratio = f"{row.loss / reference:.2f}x" if row.loss is not None and reference else "-"
        skipped = "-" if row.scale is None else str(row.skipped)
        kept = ", ".join(row.kept) or "-"
        if row.skipped_before_kept is not None:
            kept += f" after {row.skipped_before_kept}"
        scale = "-" if row.scale is None else pow2(row.scale)
        table.add_row(row.label, loss, ratio, skipped, scale, kept)
    console.print()
    console.print(table)
    plain, healed = rows[1], rows[2]
    console.print(
        "kept in float32: after N = after N skipped steps. A second model: its layer 'amplify' outputs ~5e5, "
        "beyond float16's 65504, followed by a LayerNorm (dls.train.fallback_demo). Plain float16 + DLS skips every "
        "step"
        + (f" and stops at step {plain.stopped}, the scale at its floor" if plain.stopped is not None else "")
        + "; loss scaling cannot fix a forward overflow. With scaler.watch(model, fallback=True) the watch keeps "
        f"{', '.join(repr(n) for n in healed.kept) or 'nothing'} in float32 after {healed.skipped_before_kept} "
        "skipped steps"
        + (f" and ends at {healed.loss / reference:.2f}x float32's loss." if healed.loss and reference else "."),
        highlight=False,
    )
