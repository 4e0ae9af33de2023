"""``dls audit CONFIG.yaml``: can the config's model train in each half format, from which loss scale, and how do
FP8 recipes treat it? Nothing is trained and nothing of the model changes.

The model and data are built exactly as ``dls train`` builds them at step 0 (same seeds, so the same initial
weights and the first batches of the run), in float32 whatever ``precision:`` says (``half_params`` and ``fp8``
change how a run stores and computes, not what each format does to its activations and gradients). The loss
audited is the training loss times ``model.loss_weight``: what the loss scaler scales.

* :func:`audit_formats`: ``dls.audit`` per format on the first ``steps`` batches (every format sees the same
  batches): per-format verdicts, recommended initial loss scales and per-module tables; optionally the PNG.
* :func:`compare_fp8`: per FP8 recipe, ``steps`` forward/backward passes under ``dls.fp8.emulate`` on the same
  batches (no optimizer step), against the float32 loss of the same passes: the shares of grad_output values that
  the casts saturated and flushed to zero, the share of forward (input and weight) values flushed, and the loss.
  The gradients carry the loss scale the run would start with (its initial scale; 1 without loss scaling), as
  they do in training, because that is what the recipes without per-tensor gradient scales see.

Outputs: the text goes to the console; ``--out DIR`` writes ``DIR/audit.png`` following the trainer's write rules
(``dls.train.rundir``: the directory resolved once, created if missing, locked while writing, the file written to
a temporary name and renamed, never through a symbolic link). Without ``--out`` nothing is written.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import torch
from torch import nn

import dls
import dls.fp8
from dls.diagnostics import AuditResult, FormatAudit
from dls.diagnostics.scales import percent, pow2
from dls.train import checkpoint as ckpt
from dls.train.config import TrainConfig, loss_scaling_mode, scaler_settings
from dls.train.data import Batch, BatchIterator, build_dataset
from dls.train.launch import resolve_device
from dls.train.models import TrainModel, build_model
from dls.train.reporting import describe_fp8
from dls.train.rundir import RunDir, resolve_model_dir

__all__ = ["AUDIT_PLOT", "DEFAULT_FORMATS", "Fp8Comparison", "audit_formats", "build_inputs", "compare_fp8"]

DEFAULT_FORMATS = ("float16", "bfloat16", "cbfloat16")
AUDIT_PLOT = "audit.png"


class Batches:
    """The run's first ``steps`` batches (rank 0's) on ``device``, made anew each time they are gone through: never
    all held at once, so ``--steps`` costs time, not memory."""

    def __init__(self, make: Callable[[], BatchIterator], steps: int, device: torch.device) -> None:
        self.make, self.steps, self.device = make, steps, device

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[Batch]:
        iterator = self.make()
        for _ in range(self.steps):
            x, y = iterator.next()
            yield x.to(self.device), y.to(self.device)


def build_inputs(cfg: TrainConfig, steps: int) -> tuple[TrainModel, Batches]:
    """The float32 model of ``cfg`` as ``dls train`` initialises it, on the run's device, and the run's first
    ``steps`` batches (:class:`Batches`)."""
    rc = cfg.runconfig
    device = resolve_device(rc.device)
    ckpt.seed_everything(rc.seed)  # the order of what follows is the trainer's: the same weights and batches
    dataset = build_dataset(cfg.data)
    seed = cfg.data.shuffle_seed if cfg.data.shuffle_seed is not None else rc.seed
    BatchIterator(dataset, cfg.data.batch_size, cfg.data.shuffle, seed, 0, 1)  # its errors, before the model
    model = build_model(cfg.model, dataset.info).to(device)

    def make() -> BatchIterator:
        return BatchIterator(dataset, cfg.data.batch_size, cfg.data.shuffle, seed, 0, 1)

    return model, Batches(make, steps, device)


def _cycle(batches: Iterable[Batch]) -> Iterator[Batch]:
    while True:  # not itertools.cycle, which keeps every batch
        yield from batches


def audit_formats(model: TrainModel, batches: Batches, formats: Sequence[str], loss_weight: float = 1.0) -> AuditResult:
    """``dls.audit`` of ``model`` on ``batches`` (one pass per batch) for each of ``formats``, every format on the
    same batches in the same order; the loss is ``model.loss(batch) * loss_weight``."""
    stream = _cycle(batches)

    def loss_fn(m: nn.Module) -> torch.Tensor:
        loss: torch.Tensor = model.loss(next(stream)) * loss_weight
        return loss

    audits: dict[str, FormatAudit] = {}
    keep: dict[str, list[str] | None] = {}
    result = None
    for fmt in formats:  # one call per format, so that each starts at the first batch
        stream = _cycle(batches)
        result = dls.audit(model, loss_fn, formats=[fmt], steps=len(batches))
        audits.update(result.audits)
        keep.update(result.keep_in_float32)
    assert result is not None, "formats is not empty"
    return dataclasses.replace(result, audits=audits, keep_in_float32=keep)


@dataclasses.dataclass(frozen=True)
class Fp8Comparison:
    """One FP8 recipe on the audited batches: ``recipe`` (its ``to_dict()``), the shares of nonzero grad_output
    values saturated / flushed to zero and of forward (input and weight) values flushed, over every cast of every
    pass; ``loss`` (mean over the passes) and ``reference`` (float32's mean loss on the same passes)."""

    recipe: dict[str, object]
    grad_saturated: float
    grad_flushed: float
    forward_flushed: float
    loss: float
    reference: float


def compare_fp8(
    model: TrainModel,
    batches: Iterable[Batch],
    recipes: Sequence[dls.fp8.Recipe],
    loss_weight: float = 1.0,
    loss_scale: float = 1.0,
    seed: int = 0,
) -> list[Fp8Comparison]:
    """Run ``model`` on ``batches`` in float32 and under each recipe (forward and backward of
    ``loss * loss_weight * loss_scale``, no optimizer step; each pass seeded alike, so dropout masks agree) and
    compare. The parameters are never written, and every ``.grad`` is put back as it was."""
    params = list(model.parameters())
    grads = [p.grad for p in params]
    devices = [torch.cuda.current_device()] if params and params[0].is_cuda else []

    def passes(backward: bool) -> list[torch.Tensor]:
        losses = []
        for i, batch in enumerate(batches):
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(seed + i)
                with torch.set_grad_enabled(backward):
                    loss = model.loss(batch)
                if backward:
                    (loss * (loss_weight * loss_scale)).backward()
                    for p in params:
                        p.grad = None
            losses.append(loss.detach())
        return losses

    def mean(losses: list[torch.Tensor]) -> float:
        return float(torch.stack(losses).double().mean())

    rows = []
    try:
        reference = mean(passes(backward=False))
        for recipe in recipes:
            handle = dls.fp8.emulate(model, recipe)
            try:
                loss = mean(passes(backward=True))
                totals = handle.stats.totals()
            finally:
                handle.remove()
            grad, inp, weight = totals["grad_output"], totals["input"], totals["weight"]
            forward_values = inp["values"] + weight["values"]
            forward_flushed = (
                (inp["flushed_fraction"] * inp["values"] + weight["flushed_fraction"] * weight["values"])
                / forward_values
                if forward_values
                else 0.0
            )
            rows.append(
                Fp8Comparison(
                    recipe=recipe.to_dict(),
                    grad_saturated=float(grad["saturated_fraction"]),
                    grad_flushed=float(grad["flushed_fraction"]),
                    forward_flushed=float(forward_flushed),
                    loss=loss,
                    reference=reference,
                )
            )
    finally:
        for p, g in zip(params, grads):
            p.grad = g
    return rows


def fp8_table(rows: Sequence[Fp8Comparison], loss_scale: float, passes: int) -> str:
    """The comparison as a compact text table, with a line saying what the columns are."""
    header = ["recipe", "grad_output saturated", "grad_output flushed", "forward flushed", "loss", "vs fp32"]
    body = [["float32", "-", "-", "-", f"{rows[0].reference:.5g}" if rows else "-", "1.0000x"]]
    for r in rows:
        body.append(
            [
                describe_fp8(r.recipe),
                percent(r.grad_saturated),
                percent(r.grad_flushed),
                percent(r.forward_flushed),
                f"{r.loss:.5g}",
                f"{r.loss / r.reference:.4f}x" if r.reference else "-",
            ]
        )
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()
        for row in [header, *body]
    ]
    lines.append(
        f"{passes} forward/backward passes per recipe on the batches above, gradients at loss scale "
        f"{pow2(loss_scale)}. saturated / flushed: shares of the nonzero values the FP8 casts clamped to the "
        "format's max / rounded to zero (grad_output: the gradients flowing into each Linear layer; forward: its "
        "inputs and weights). loss: mean over the passes. Delayed scaling casts its first pass at scale 1 (its "
        "history is empty), as a run's first step does."
    )
    return "\n".join(lines)


def recommendation_lines(cfg: TrainConfig, result: AuditResult) -> list[str]:
    """How to use the recommended scales in this config (``-o optimizer.initial_loss_scale=...``), and how they
    compare with the config's own initial scale."""
    lines = ["Recommended initial loss scales (optimizer.initial_loss_scale; loss_scaling_factor: dynamic):"]
    for name, scale in result.recommended_init_scale.items():
        lines.append(
            f"  {name:<10} " + ("none: loss scaling cannot help (see the verdict)" if scale is None else pow2(scale))
        )
    half = cfg.precision.fp16_type
    if loss_scaling_mode(cfg) == "dynamic" and half in result.audits:
        scale = result.recommended_init_scale[half]
        given = scaler_settings(cfg).init_scale
        if scale is not None and scale != given:
            lines.append(
                f"This config starts {half} at {pow2(given)}; to start at the audit's scale: "
                f"-o optimizer.initial_loss_scale={scale:g}"
            )
    return lines


def write_plot(result: AuditResult, out: Path) -> Path:
    """``out/audit.png`` (see the module docstring for how it is written); its path.

    ``AuditResult.save_plot`` takes a path only, so the PNG is drawn into a private temporary directory (mode 0700,
    removed at once) and its bytes are then written into ``out`` by the rundir rules."""
    import tempfile

    directory = resolve_model_dir(out, "--out")
    with tempfile.TemporaryDirectory(prefix="dls-audit-") as scratch:
        png = result.save_plot(Path(scratch) / AUDIT_PLOT).read_bytes()
    with RunDir(directory, "--out") as run_dir:
        return run_dir.replace(AUDIT_PLOT, png)
