"""``dls audit``: which half formats hold the config's model (as ``dls train`` starts it, in float32), from
which loss scale, and what FP8 recipes do to it. Nothing is trained; ``--out`` writes by the model_dir rules."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from torch import nn

import dls
import dls.fp8
from dls import formats as half_formats
from dls.diagnostics import AuditResult, FormatAudit
from dls.diagnostics.scales import pow2
from dls.train import checkpoint as ckpt
from dls.train.checkpoint import RunDir, resolve_model_dir
from dls.train.cli import config_errors
from dls.train.config import TrainConfig, load_config, loss_scaling_mode, scaler_settings
from dls.train.data import Batch, BatchIterator, TrainModel, build_dataset, build_model
from dls.train.errors import UsageError
from dls.train.launch import resolve_device

DEFAULT_FORMATS = ("float16", "bfloat16", "cbfloat16")
AUDIT_PLOT = "audit.png"


class Batches:
    """The run's first ``steps`` batches on ``device``, made anew per pass (``--steps`` costs time, not memory)."""

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
    """The float32 model of ``cfg`` as ``dls train`` initialises it, and the run's first ``steps`` batches."""
    rc = cfg.runconfig
    device = resolve_device(rc.device)
    ckpt.seed_everything(rc.seed)  # the order of what follows is the trainer's: the same weights and batches
    dataset = build_dataset(cfg.data)
    seed = cfg.data.shuffle_seed if cfg.data.shuffle_seed is not None else rc.seed
    make = functools.partial(BatchIterator, dataset, cfg.data.batch_size, cfg.data.shuffle, seed, 0, 1)
    make()  # its errors, before the model
    return build_model(cfg.model, dataset.info).to(device), Batches(make, steps, device)


def audit_formats(model: TrainModel, batches: Batches, formats: Sequence[str], loss_weight: float = 1.0) -> AuditResult:
    audits: dict[str, FormatAudit] = {}
    keep: dict[str, list[str] | None] = {}
    for fmt in formats:  # one call per format, so that each starts at the first batch
        stream = itertools.chain.from_iterable(itertools.repeat(batches))  # not itertools.cycle: it keeps every batch

        def loss_fn(m: nn.Module, stream: Iterator[Batch] = stream) -> torch.Tensor:
            loss: torch.Tensor = model.loss(next(stream)) * loss_weight
            return loss

        result = dls.audit(model, loss_fn, formats=[fmt], steps=len(batches))
        audits.update(result.audits)
        keep.update(result.keep_in_float32)
    return dataclasses.replace(result, audits=audits, keep_in_float32=keep)


def command(args: argparse.Namespace) -> None:
    """``dls audit``: the arguments checked, then the verdicts, the scales, the FP8 table and the plot."""
    names = args.formats if args.formats is not None else list(DEFAULT_FORMATS)
    if unknown := [name for name in names if name not in half_formats.names()]:
        raise UsageError(f"--formats: unknown format {unknown[0]!r}; allowed: {', '.join(half_formats.names())}")
    recipe_names = None if args.fp8_recipes is None else list(dict.fromkeys(args.fp8_recipes or dls.fp8.RECIPE_NAMES))
    if unknown := [r for r in recipe_names or () if r not in dls.fp8.RECIPE_NAMES]:
        allowed = ", ".join(dls.fp8.RECIPE_NAMES)
        raise UsageError(f"--fp8-recipes: unknown recipe(s) {', '.join(map(repr, unknown))}; allowed: {allowed}")
    cfg = load_config(args.config, args.override)
    threads = torch.get_num_threads()
    if cfg.runconfig.num_threads is not None:
        torch.set_num_threads(cfg.runconfig.num_threads)
    try:
        with config_errors(args.config):
            model, batches = build_inputs(cfg, args.steps)
        weight, half = cfg.model.loss_weight, cfg.precision.fp16_type
        print(
            f"dls audit {args.config}: {cfg.model.name} on {cfg.data.dataset}, the first {args.steps} batches of "
            f"{cfg.data.batch_size}, float32 weights as dls train initialises them, loss x {weight:g} "
            "(model.loss_weight)"
        )
        result = audit_formats(model, batches, names, weight)
        print(
            f"{result.to_text()}\n\nRecommended initial loss scales (optimizer.initial_loss_scale; "
            "loss_scaling_factor: dynamic):"
        )
        for name, scale in result.recommended_init_scale.items():
            print(f"  {name:<10} {pow2(scale) if scale else 'none: loss scaling cannot help (see the verdict)'}")
        given, scale = scaler_settings(cfg).init_scale, result.recommended_init_scale.get(half)
        if loss_scaling_mode(cfg) == "dynamic" and scale is not None and scale != given:
            print(
                f"This config starts {half} at {pow2(given)}; to start at the audit's scale: "
                f"-o optimizer.initial_loss_scale={scale:g}"
            )
        if recipe_names is not None:
            own = cfg.precision.fp8 or {"recipe": None}  # a recipe the config names keeps its fields
            recipes = [
                dls.fp8.recipe_from_dict(dict(own) if own["recipe"] == r else {"recipe": r}) for r in recipe_names
            ]
            at = given if loss_scaling_mode(cfg) != "off" else 1.0
            fp8 = dls.fp8.compare_recipes(
                model, model.loss, batches, recipes, loss_weight=weight, loss_scale=at, seed=cfg.runconfig.seed
            )
            print("\n" + fp8.to_text())
        if args.out is not None:  # save_plot takes a path only: drawn in a private temporary directory first
            directory = resolve_model_dir(Path(args.out), "--out")
            with tempfile.TemporaryDirectory(prefix="dls-audit-") as scratch:
                png = result.save_plot(Path(scratch) / AUDIT_PLOT).read_bytes()
            with RunDir(directory, "--out") as run_dir:
                print(f"\nPlot: {run_dir.replace(AUDIT_PLOT, png)}")
    finally:
        torch.set_num_threads(threads)
