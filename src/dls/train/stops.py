"""When a run stops because loss scaling cannot help (exit 1, after a finite checkpoint), and what it tells the
user: where the overflow started and what to try."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dls import kernels
from dls.diagnostics import OverflowReport
from dls.diagnostics.scales import module_label, pow2
from dls.scaler import GradScaler


class NonFiniteGradients(Exception):
    """Raised before the optimizer applies inf/NaN gradients."""


def refuse_nonfinite_gradients(
    device: torch.device, params: Sequence[torch.Tensor]
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


def nonfinite_message(
    step: int, loss: float, compute_dtype: str, saved_step: int, path: object, report: OverflowReport | None = None
) -> str:
    """The stop message of a run without loss scaling whose gradients became inf/NaN (``report``: where)."""
    scaling = ", or optimizer.loss_scaling_factor: dynamic." if compute_dtype != "float32" else "."
    where = ""
    if report is not None and report.first_module is not None:
        where = (
            f" The first module with inf/NaN gradients, in backward order, is {module_label(report.first_module)} "
            f"({report.first_module_type}); modules with inf/NaN gradients: {_listed(report.modules)}."
        )
    return (
        f"Step {step}: the gradients are inf/NaN (loss {loss}) and loss scaling is off ({compute_dtype}), so nothing "
        f"can skip this step.{where} Training stopped before applying it; the model as of step {saved_step} is saved "
        f"in {path}. Try a lower optimizer.learning_rate, optimizer.max_gradient_norm (e.g. 1.0){scaling}"
    )


def nonfinite_parameters(model: torch.nn.Module) -> list[str]:
    """``model``'s parameters holding inf/NaN (one device read; buffers may hold them by design)."""
    named = [(n, t) for n, t in model.named_parameters() if t.is_floating_point()]
    if not named:
        return []
    finite = torch.stack([torch.isfinite(t).all() for _, t in named]).tolist()
    return [n for (n, _), ok in zip(named, finite) if not ok]


def nonfinite_weights(step: int, broken: Sequence[str], last: object, model_dir: object, repair: str = "") -> str:
    """The stop message of a run whose weights ``broken`` hold inf/NaN: ``last`` stays the newest checkpoint."""
    then = f"then --resume {model_dir} (its metrics rows after that step are dropped)" if last else "start again"
    newest = f"the newest checkpoint, {last}, is the last with finite weights" if last else "the run has no checkpoint"
    return (
        f"Step {step}: the model's weights hold inf/NaN ({_listed(broken, 4)}): an applied step broke them, so every "
        f"step after it would overflow. No checkpoint of them was written; {newest}. "
        f"To try: {repair}a lower optimizer.learning_rate or clipping "
        f"(optimizer.max_gradient_norm), {then}"
    )


def _listed(names: Sequence[str], count: int = 6) -> str:
    shown = [module_label(n) for n in names[:count]]
    return ", ".join(shown) + (f" and {len(names) - count} more" if len(names) > count else "")


# Formats with more range than each half format, for a forward pass that overflowed it.
_WIDER = {
    "float16": "bfloat16 or cbfloat16 (precision.fp16_type), whose ranges reach float32's max and 2^32",
    "cbfloat16": "bfloat16 (precision.fp16_type: bfloat16), whose range is float32's",
}


class FloorWatch:
    """Counts overflowing steps at the scale's floor (Model Zoo's test: ``get_non_clamped_scale() < get_scale()``;
    static scaling: every overflowing step) up to ``limit`` without a clean step between. ``count`` is
    checkpointed; the counted steps' overflow reports of this session name where the overflow started."""

    def __init__(self, limit: int, half_dtype: str = "float16", repair: str = "") -> None:
        self.limit = limit
        self.half_dtype = half_dtype
        self.repair = repair
        self.count = 0
        self.reports: list[OverflowReport | None] = []

    def after_step(self, scaler: GradScaler, skipped: bool, report: OverflowReport | None = None) -> str | None:
        """Count a step (reading the scaler only when skipped); at the limit, the stop message, else ``None``."""
        if not scaler.is_enabled():
            return None
        if not skipped:
            self.count = 0
            self.reports.clear()
            return None
        scale = scaler.get_scale()
        static = scaler.mode == "static"
        if static or scaler.get_non_clamped_scale() < scale:
            self.count += 1
            self.reports = [*self.reports[-(self.limit - 1) :], report] if self.limit > 1 else [report]
        if self.count < self.limit:
            return None
        where, forward = self._provenance()
        if static:
            what = (
                f"the static loss scale {pow2(scale)} made the gradients overflow on {self.limit} consecutive steps, "
                "and a static scale never comes down"
            )
            advice = (
                "use optimizer.loss_scaling_factor: dynamic (it finds the largest scale that does not overflow), or a "
                "smaller static scale"
            )
        else:
            what = (
                f"the loss scale is pinned at min_loss_scale ({pow2(scale)}) and the gradients still overflowed on "
                f"{self.limit} steps without a clean step between (Model Zoo: 'Minimum loss scale threshold was "
                "reached but gradient norms are still encountering NaN or inf values')"
            )
            advice = (
                "lower optimizer.learning_rate or clip with optimizer.max_gradient_norm (the model may have "
                "diverged); check the data for inf/NaN; switch to bfloat16 (precision.fp16_type: bfloat16), whose "
                "range matches float32, if the forward pass itself overflows in float16; or lower "
                "optimizer.min_loss_scale"
            )
        if forward:
            wider = _WIDER.get(self.half_dtype)
            advice = (
                (f"use {wider}, if {self.half_dtype}'s range is what overflowed; " if wider else "")
                + "`dls audit CONFIG.yaml` names the first module whose output exceeds each format; if float32's "
                "range overflowed too, lower optimizer.learning_rate or clip with optimizer.max_gradient_norm (the "
                "model may have diverged), or check the data and model.loss_weight"
            )
        return f"{what}.{where} Skipping more steps cannot help. To try: {advice}"

    def _provenance(self) -> tuple[str, bool]:
        """Where the counted overflows started, and whether the forward pass overflowed in most of them."""
        reports = [r for r in self.reports if r is not None]
        if not reports:
            return "", False
        n = len(reports)
        of = f"of the last {n} counted steps" if n < self.count else f"of the {n} steps"
        firsts = Counter(r.first_module for r in reports if r.first_module is not None)
        text = ""
        if firsts:
            ranked = ", ".join(f"{module_label(m)} in {k}" for m, k in firsts.most_common(3))
            modules = list(dict.fromkeys(m for r in reports for m in r.modules))
            text += (
                f" First module with inf/NaN gradients, in backward order: {ranked} {of}; modules with inf/NaN "
                f"gradients: {_listed(modules)}."
            )
        forward = sum(1 for r in reports if r.forward)
        if forward:
            text += (
                f" The loss was already inf/NaN before scaling in {forward} {of}: the forward pass overflowed, and "
                "loss scaling cannot fix that."
            )
        elif all(r.forward is False for r in reports):
            text += " The loss was finite every time: the overflow arose in backward."
        return text, forward * 2 > n
