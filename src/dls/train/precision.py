"""How a run computes and steps: ``precision:`` (parameter dtype, FP8 layers, master weights, autocast or
``dls.emulate``, the underflow each logged row measures), ``optimizer:`` (the optimizer and its LR schedule), and the
stops where its numbers cannot go on (exit 1, after a finite checkpoint), each telling the user what to try."""

from __future__ import annotations

import contextlib
import copy
import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

import dls
import dls.fp8
from dls import kernels
from dls.diagnostics import OverflowReport
from dls.diagnostics.scales import module_label, pow2
from dls.emulate import EmulationHandle
from dls.scaler import GradScaler
from dls.train.config import TrainConfig
from dls.train.data import Batch
from dls.train.models import TrainModel
from dls.train.schema import OptimizerConfig, PrecisionConfig

HALF_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


class RunPrecision:
    """The precision set-up of ``cfg`` applied to ``model`` (on ``device``): casts the model to the parameters' dtype
    and, with ``precision.fp8``, installs FP8 Linear layers (``process_group``: a data-parallel run's ranks)."""

    def __init__(self, cfg: TrainConfig, model: TrainModel, device: torch.device, process_group: Any = None) -> None:
        self.cfg, self.prec, self.model, self.device = cfg, cfg.precision, model, device
        self.log_summaries = cfg.optimizer.log_summaries
        self.param_dtype = HALF_DTYPES.get(self.prec.param_dtype, torch.float32)
        model.to(self.param_dtype)
        self.fp8: dls.fp8.Fp8Handle | None = None
        if self.prec.fp8 is not None:
            recipe = dls.fp8.recipe_from_dict(dict(self.prec.fp8))
            self.fp8 = dls.fp8.emulate(model, recipe, process_group=process_group)
        self.emulation: EmulationHandle | None = None  # dls.emulate's hooks, while a session trains
        self._recorded: tuple[list[float], ...] = ([], [], [])  # grad_underflow, FP8 flushed, saturated: per row

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, scaled: bool) -> torch.optim.Optimizer:
        """``optimizer`` stepping float32 masters (``dls.master_weights``) where the config asks for them; in a run
        without loss scaling (not ``scaled``), where nothing can skip a step, refusing inf/NaN gradients."""
        if self.prec.half_params and self.prec.master_weights:
            optimizer = dls.master_weights(optimizer, fmt="cbfloat16" if self.prec.fp16_type == "cbfloat16" else None)
        if not scaled:
            optimizer.register_step_pre_hook(refuse_nonfinite_gradients(self.device, self.model.parameters()))
        return optimizer

    def start_session(self) -> None:
        """Install this session's ``dls.emulate`` hooks (cbfloat16, ``precision.emulate``)."""
        if self.prec.emulated:
            self.emulation = dls.emulate(self.model, self.prec.compute_dtype, track_stats=self.log_summaries)

    def remove_hooks(self) -> None:
        """Take out this session's emulation and FP8 hooks (the FP8 state stays for the final checkpoint)."""
        if self.emulation is not None:
            self.emulation.remove()
            self.emulation = None
        if self.fp8 is not None:
            self.fp8.remove()

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """``torch.autocast`` for float16/bfloat16 without emulation or half parameters, else nothing."""
        dtype = HALF_DTYPES.get(self.prec.compute_dtype)
        if dtype is not None and self.emulation is None and not self.prec.half_params:
            return torch.autocast(self.device.type, dtype=dtype)
        return contextlib.nullcontext()

    def to_device(self, batch: Batch, dtype: torch.dtype | None = None) -> Batch:
        """``batch`` (tensors in tuples, lists, dicts) on the device; floating-point inputs in ``dtype``."""
        dtype = dtype or self.param_dtype
        if isinstance(batch, torch.Tensor):
            cast = dtype if batch.is_floating_point() else None
            return batch.to(self.device, dtype=cast, non_blocking=True)
        if isinstance(batch, dict):
            return {k: self.to_device(v, dtype) for k, v in batch.items()}
        if isinstance(batch, tuple) and len(batch) == 2 and isinstance(batch[1], torch.Tensor):
            return self.to_device(batch[0], dtype), batch[1].to(self.device, non_blocking=True)
        if isinstance(batch, (list, tuple)):
            return type(batch)(self.to_device(v, dtype) for v in batch)
        return batch

    @property
    def probes_underflow(self) -> bool:
        """Whether logged steps run :meth:`probe_underflow` (``log_summaries``, half precision, no emulation/FP8)."""
        half = self.prec.compute_dtype != "float32"
        return self.log_summaries and half and self.emulation is None and self.fp8 is None

    def probe_underflow(self, batch: Batch, scale: float) -> float:
        """The fraction of nonzero activation gradients flushed to zero at ``scale`` (one emulated backward pass)."""
        model: TrainModel = self.model
        if self.param_dtype != torch.float32:  # half parameters: a float32 copy holds the same values
            model = copy.deepcopy(model).float()
            batch = self.to_device(batch, torch.float32)
        params = [p for p in model.parameters() if p.requires_grad]
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), dls.emulate(model, self.prec.compute_dtype) as handle:
            loss = model.loss(batch) * (self.cfg.model.loss_weight * scale)
            torch.autograd.grad(loss, params, allow_unused=True)
        assert handle.stats is not None
        return float(handle.stats.underflow_fraction)

    def emulated_underflow(self) -> float | None:
        """Under ``dls.emulate`` with ``log_summaries``: the underflow counted since the last call; else ``None``."""
        if self.emulation is None or not self.log_summaries:
            return None
        stats = self.emulation.stats
        assert stats is not None, "log_summaries installs the hooks with track_stats"
        underflow = stats.underflow_fraction
        stats.reset()
        return underflow

    def fp8_fractions(self) -> list[float]:
        """With FP8: ``[flushed, saturated]`` fractions of grad_output casts since the last call; else ``[]``."""
        if self.fp8 is None:
            return []
        totals = self.fp8.stats.totals()["grad_output"]
        self.fp8.stats.reset()
        return [float(totals["flushed_fraction"]), float(totals["saturated_fraction"])]

    def record(self, underflow: float | None, fp8: Sequence[float]) -> None:
        """Keep a logged row's ``grad_underflow`` and FP8 fractions for :meth:`means`."""
        for values, value in zip(self._recorded, (underflow, *(fp8 or (None, None)))):
            if value is not None:
                values.append(value)

    def means(self) -> tuple[float | None, ...]:
        """The means of the recorded underflow, FP8 flushed and saturated fractions (``None``: none recorded)."""
        return tuple(sum(values) / len(values) if values else None for values in self._recorded)


def build_optimizer(cfg: OptimizerConfig, params: Any) -> torch.optim.Optimizer:
    """``optimizer:``'s optimizer with learning rate 1.0: the LR schedule (a ``LambdaLR``) sets the real one. Model
    Zoo's argument names (``correct_bias`` is torch's only behaviour and is checked by the schema)."""
    if cfg.optimizer_type == "SGD":
        return torch.optim.SGD(params, lr=1.0, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    cls = torch.optim.Adam if cfg.optimizer_type == "Adam" else torch.optim.AdamW
    return cls(params, lr=1.0, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)


def learning_rate_at(schedule: float | Sequence[Any], step: int) -> float:
    """The learning rate after ``step`` applied updates (0-based): a constant, or the schedule pieces one after
    another (``Constant``, ``Linear``, ``CosineDecay`` over ``total_iters`` steps each; the last holds its end)."""
    if isinstance(schedule, (int, float)):
        return float(schedule)
    t = step
    for i, item in enumerate(schedule):
        piece = item if isinstance(item, dict) else item.model_dump()
        total = piece.get("total_iters")
        if total is not None and t >= total and i < len(schedule) - 1:
            t -= total
            continue
        if piece["scheduler"] == "Constant":
            return float(piece["learning_rate"])
        start, end = float(piece["initial_learning_rate"]), float(piece["end_learning_rate"])
        frac = min(t / total, 1.0) if total else 1.0
        if piece["scheduler"] == "Linear":
            return start + (end - start) * frac
        return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * frac))
    raise AssertionError("unreachable: a schedule has at least one piece")


def build_scheduler(cfg: OptimizerConfig, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` over the schedule's LR (the optimizer's own is 1.0), wrapped by the trainer with
    ``dls.skip_aware`` so that it advances on applied steps."""
    schedule = cfg.learning_rate

    def lr_at(step: int) -> float:  # a plain function: LambdaLR.state_dict() does not store it
        return learning_rate_at(schedule, step)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)


# ---------------------------------------------------------------------- stops
class NonFiniteGradients(Exception):
    """Raised before the optimizer applies inf/NaN gradients."""


def refuse_nonfinite_gradients(
    device: torch.device, params: Iterable[torch.Tensor]
) -> Callable[[torch.optim.Optimizer, Any, Any], None]:
    """An optimizer step pre-hook for runs without loss scaling: :class:`NonFiniteGradients` when a gradient of
    ``params`` (the model's: master weights get theirs inside the step) holds inf/NaN; one read per step."""
    params = list(params)

    def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        flags = []
        for (grad_device, _), grads in kernels.group_grads(params).items():
            flag = torch.zeros((), dtype=torch.float32, device=grad_device)
            kernels.check_nonfinite(grads, flag)
            flags.append(flag.to(device))
        if flags and bool(torch.stack(flags).amax() > 0):
            raise NonFiniteGradients

    return hook


def _listed(names: Sequence[str], count: int = 6) -> str:
    shown = [module_label(n) for n in names[:count]]
    return ", ".join(shown) + (f" and {len(names) - count} more" if len(names) > count else "")


# Formats with more range than each half format, for a forward pass that overflowed it.
_WIDER = {
    "float16": "bfloat16 or cbfloat16 (precision.fp16_type), whose ranges reach float32's max and 2^32",
    "cbfloat16": "bfloat16 (precision.fp16_type: bfloat16), whose range is float32's",
}
_DIVERGED = "lower optimizer.learning_rate or clip with optimizer.max_gradient_norm (the model may have diverged)"


class Stops:
    """When a run stops because its numbers cannot go on (a finite checkpoint saved first), and what it tells the
    user: inf/NaN gradients without loss scaling, inf/NaN weights, and overflowing steps at the scale's floor (Model
    Zoo's test: ``get_non_clamped_scale() < get_scale()``; static scaling: every overflowing step) counted up to
    ``limit`` without a clean step between. ``count`` is checkpointed; the counted steps' overflow reports of this
    session name where the overflow started."""

    def __init__(self, limit: int, prec: PrecisionConfig) -> None:
        self.limit, self.half_dtype, self.compute_dtype = limit, prec.fp16_type, prec.compute_dtype
        self.repair = "precision.master_weights: true, " if prec.half_params and not prec.master_weights else ""
        self.count = 0
        self.reports: list[OverflowReport | None] = []

    def nonfinite_gradients(self, step: int, loss: float, saved_step: int, path: object, report: Any) -> str:
        """The stop message of a run without loss scaling whose gradients became inf/NaN (``report``: where)."""
        scaling = ", or optimizer.loss_scaling_factor: dynamic." if self.compute_dtype != "float32" else "."
        where = ""
        if report is not None and report.first_module is not None:
            where = (
                f" The first module with inf/NaN gradients, in backward order, is {module_label(report.first_module)} "
                f"({report.first_module_type}); modules with inf/NaN gradients: {_listed(report.modules)}."
            )
        return (
            f"Step {step}: the gradients are inf/NaN (loss {loss}) and loss scaling is off ({self.compute_dtype}), so "
            f"nothing can skip this step.{where} Training stopped before applying it; the model as of step "
            f"{saved_step} is saved in {path}. Try a lower optimizer.learning_rate, optimizer.max_gradient_norm (e.g. "
            f"1.0){scaling}"
        )

    def nonfinite_weights(self, model: torch.nn.Module, step: int, last: object, model_dir: object) -> str | None:
        """When ``model``'s parameters hold inf/NaN (one device read; buffers may hold them by design), the stop
        message: ``last`` stays the newest checkpoint; else ``None``."""
        named = [(n, t) for n, t in model.named_parameters() if t.is_floating_point()]
        finite = torch.stack([torch.isfinite(t).all() for _, t in named]).tolist() if named else []
        if not (broken := [n for (n, _), ok in zip(named, finite) if not ok]):
            return None
        then = f"then --resume {model_dir} (its metrics rows after that step are dropped)" if last else "start again"
        newest = (
            f"the newest checkpoint, {last}, is the last with finite weights" if last else "the run has no checkpoint"
        )
        return (
            f"Step {step}: the model's weights hold inf/NaN ({_listed(broken, 4)}): an applied step broke them, so "
            f"every step after it would overflow. No checkpoint of them was written; {newest}. To try: {self.repair}a "
            f"lower optimizer.learning_rate or clipping (optimizer.max_gradient_norm), {then}"
        )

    def after_step(self, scaler: GradScaler, skipped: bool, report: OverflowReport | None = None) -> str | None:
        """Count a step (reading the scaler only when skipped); at the limit, the stop message, else ``None``."""
        if not scaler.is_enabled():
            return None
        if not skipped:
            self.count = 0
            self.reports.clear()
            return None
        scale, static = scaler.get_scale(), scaler.mode == "static"
        if static or scaler.get_non_clamped_scale() < scale:
            self.count += 1
            self.reports = [*self.reports[-(self.limit - 1) :], report] if self.limit > 1 else [report]
        if self.count < self.limit:
            return None
        if static:
            what = (
                f"the static loss scale {pow2(scale)} made the gradients overflow on {self.limit} consecutive steps, "
                "and a static scale never comes down"
            )
            advice = "use optimizer.loss_scaling_factor: dynamic (it finds the largest scale that does not overflow), "
            advice += "or a smaller static scale"
        else:
            what = (
                f"the loss scale is pinned at min_loss_scale ({pow2(scale)}) and the gradients still overflowed on "
                f"{self.limit} steps without a clean step between (Model Zoo: 'Minimum loss scale threshold was "
                "reached but gradient norms are still encountering NaN or inf values')"
            )
            advice = (
                f"{_DIVERGED}; check the data for inf/NaN; switch to bfloat16 (precision.fp16_type: bfloat16), whose "
                "range matches float32, if the forward pass itself overflows in float16; or lower "
                "optimizer.min_loss_scale"
            )
        # Where the counted overflows started, and whether the forward pass overflowed in most of them.
        reports, where = [r for r in self.reports if r is not None], ""
        n, forward = len(reports), sum(1 for r in reports if r.forward)
        of = f"of the last {n} counted steps" if n < self.count else f"of the {n} steps"
        if firsts := Counter(r.first_module for r in reports if r.first_module is not None):
            ranked = ", ".join(f"{module_label(m)} in {k}" for m, k in firsts.most_common(3))
            modules = list(dict.fromkeys(m for r in reports for m in r.modules))
            where += (
                f" First module with inf/NaN gradients, in backward order: {ranked} {of}; modules with inf/NaN "
                f"gradients: {_listed(modules)}."
            )
        if forward:
            where += (
                f" The loss was already inf/NaN before scaling in {forward} {of}: the forward pass overflowed, and "
                "loss scaling cannot fix that."
            )
        elif reports and all(r.forward is False for r in reports):
            where += " The loss was finite every time: the overflow arose in backward."
        if forward * 2 > n:
            wider = _WIDER.get(self.half_dtype)
            advice = (
                (f"use {wider}, if {self.half_dtype}'s range is what overflowed; " if wider else "")
                + "`dls audit CONFIG.yaml` names the first module whose output exceeds each format; if float32's "
                f"range overflowed too, {_DIVERGED}, or check the data and model.loss_weight"
            )
        return f"{what}.{where} Skipping more steps cannot help. To try: {advice}"
