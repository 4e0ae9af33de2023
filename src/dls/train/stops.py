"""When a run stops because loss scaling cannot help, and what it tells the user (:class:`TrainingStopped`, exit
status 1, always after a checkpoint of finite weights).

* Dynamic scaling: the scale is pinned at its floor (``scaler.get_non_clamped_scale() < scaler.get_scale()``, Model
  Zoo's test) and the gradients overflowed on ``max_overflows_at_min_loss_scale`` such steps without a clean step
  between (skipped steps that did not back off neither count nor reset the count).
* Static scaling: that many consecutive overflowing steps. No loss scaling: one step with inf/NaN gradients,
  refused by :func:`refuse_nonfinite_gradients` before the optimizer applies it.
* Weights that became inf/NaN (an applied step broke them): never checkpointed (:func:`nonfinite_weights`).

Each message says where the overflow started (the trainer's ``scaler.watch(model)`` reports: the first module in
backward order with inf/NaN gradients, the others, and whether the loss was already inf/NaN: then the forward pass
overflowed, and the advice is a format with more range and ``dls audit``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dls import kernels
from dls.diagnostics import OverflowReport
from dls.diagnostics.scales import module_label, pow2
from dls.scaler import GradScaler

__all__ = [
    "FloorWatch",
    "NonFiniteGradients",
    "nonfinite_message",
    "nonfinite_parameters",
    "nonfinite_weights",
    "refuse_nonfinite_gradients",
]


class NonFiniteGradients(Exception):
    """Raised by :func:`refuse_nonfinite_gradients` before the optimizer applies inf/NaN gradients."""


def refuse_nonfinite_gradients(
    device: torch.device, params: Sequence[torch.Tensor]
) -> Callable[[torch.optim.Optimizer, Any, Any], None]:
    """An optimizer step pre-hook (``optimizer.register_step_pre_hook``) for runs without loss scaling: it raises
    :class:`NonFiniteGradients` when a gradient of ``params`` (the model's parameters: with master weights the
    optimizer's own tensors take their gradients only inside its step) holds inf/NaN, so that the step is not
    applied. One read pass over the gradients (``dls.kernels.check_nonfinite``) and one read of the flag per step;
    data-parallel, every rank holds the same (all-reduced) gradients and decides alike."""
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
    """The stop message of a run without loss scaling whose step ``step`` had inf/NaN gradients; ``report`` (built
    from the trainer's watch) says where they started."""
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
    """Names of ``model``'s floating-point parameters holding inf/NaN (one read of the device; buffers, such as a
    mask of -inf, may hold them by design)."""
    named = [(n, t) for n, t in model.named_parameters() if t.is_floating_point()]
    if not named:
        return []
    finite = torch.stack([torch.isfinite(t).all() for _, t in named]).tolist()
    return [n for (n, _), ok in zip(named, finite) if not ok]


def nonfinite_weights(step: int, broken: Sequence[str], last: object, model_dir: object, repair: str = "") -> str:
    """The stop message of a run whose weights hold inf/NaN at ``step`` (``broken``: their names): no checkpoint
    of them is written, so ``last`` (or none) stays the newest, and what can work from there."""
    then = f"then --resume {model_dir} (its metrics rows after that step are dropped)" if last else "start again"
    return (
        f"Step {step}: the model's weights hold inf/NaN ({_listed(broken, 4)}): an applied step broke them, so every "
        f"step after it would overflow. No checkpoint of them was written; the newest checkpoint, {last or 'none'}, "
        f"is the last with finite weights. To try: {repair}a lower optimizer.learning_rate or clipping "
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
    """Counts the overflowing steps at the scale's floor (see the module docstring). ``count`` is checkpointed
    (``trainer.overflows_at_floor``); the overflow reports of the counted steps are kept for the message (those of
    this session: a resumed run's count may include steps before it).

    Args:
        limit: ``runconfig.max_overflows_at_min_loss_scale``.
        half_dtype: the format the run computes in (``precision.fp16_type``), for the advice.
        repair: the config change that keeps the weights finite, for the advice of :func:`nonfinite_weights`.
    """

    def __init__(self, limit: int, half_dtype: str = "float16", repair: str = "") -> None:
        self.limit = limit
        self.half_dtype = half_dtype
        self.repair = repair
        self.count = 0
        self.reports: list[OverflowReport | None] = []

    def after_step(self, scaler: GradScaler, skipped: bool, report: OverflowReport | None = None) -> str | None:
        """Update the count after a step (``report``: the scaler's overflow report of a skipped step); when it
        reaches the limit, what happened, where, and what to try (else ``None``). Reads the scaler only after a
        skipped step."""
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
        """Where the counted overflows started (a sentence or two beginning with a space), and whether the forward
        pass overflowed in most of them."""
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
