"""Accelerate: ``use_dls(accelerator)`` trains ``mixed_precision="fp16"`` with a ``dls.GradScaler``.

```python
from accelerate import Accelerator
from dls.integrations.accelerate import use_dls

accelerator = Accelerator(mixed_precision="fp16")      # on CPU too
scaler = use_dls(accelerator)                          # before or after prepare()
model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
```

Then the usual loop (``accelerator.backward(loss)``, ``optimizer.step()``, ``scheduler.step()``). What changes:

* fp16 really computes in float16: on CPU Accelerate otherwise has no scaler and no autocast and trains in float32.
* ``optimizer.step_was_skipped`` (and ``accelerator.optimizer_step_was_skipped``) asks the scaler, so it is right
  for fused optimizers too. Accelerate itself infers a skip from whether ``optimizer.step`` was called, but a fused
  optimizer is called and skips inside its kernel. Schedulers prepared by Accelerate step only when it is False,
  so the LR schedule follows real updates.
* ``accelerator.save_state`` / ``load_state`` write and read the dls scaler's state (``scaler.pt``).
* ``use_dls(accelerator, fallback=True)`` keeps modules whose float16 output overflows in float32, found by themselves.
"""

from __future__ import annotations

from types import MethodType
from typing import Any

import torch

from dls.checks import flag_problem
from dls.keep import unwrap
from dls.scaler import GradScaler

try:
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.utils import DistributedType, convert_outputs_to_fp32, get_mixed_precision_context_manager
except ImportError as err:  # pragma: no cover - exercised by the import-blocking test
    raise ImportError("dls.integrations.accelerate needs the accelerate package: pip install 'dls[hf]'") from err

__all__ = ["DLSAcceleratedOptimizer", "use_dls"]

# Set-ups that scale the loss themselves or shard the scaler's work in ways use_dls does not handle.
_UNSUPPORTED = {
    DistributedType.DEEPSPEED: "DeepSpeed scales the loss itself",
    DistributedType.MEGATRON_LM: "Megatron-LM scales the loss itself",
    DistributedType.XLA: "XLA devices are not supported by use_dls",
    DistributedType.FSDP: "FSDP through Accelerate is not supported by use_dls yet",
}


def use_dls(
    accelerator: Accelerator, scaler: GradScaler | None = None, *, fallback: bool = False, **scaler_kwargs: Any
) -> GradScaler:
    """Make ``accelerator`` (``mixed_precision="fp16"``) scale with a ``dls.GradScaler``; returns the scaler.

    Args:
        accelerator: an ``accelerate.Accelerator`` built with ``mixed_precision="fp16"``.
        scaler: the ``dls.GradScaler`` to install, or ``None`` to build ``dls.GradScaler(device=<the accelerator's
            device type>, **scaler_kwargs)``; a ``GradScalerKwargs`` handler given to the Accelerator
            (``init_scale``, ``growth_interval``, ...) is honoured, ``scaler_kwargs`` win over it.
        fallback: keep modules whose float16 output overflows in float32, found by themselves
            (``scaler.watch(model, fallback=True)``, see ``dls.diagnostics.fallback``), in the model prepared for
            training (``accelerator.prepare``; not those prepared with ``evaluation_mode=True``), by the names of
            the model inside Accelerate's DDP or ``torch.compile`` wrapper. An argument here, so that it reaches
            the model wherever ``prepare`` is called (a Hugging Face Trainer calls it inside ``train()``); in a
            loop of your own, ``scaler.watch(model, fallback=True)`` on the prepared model is the same thing and
            gives you the watch. The kept modules are in the scaler's state (``kept_in_float32``), so
            ``save_state`` writes them and ``load_state`` keeps them again. One model only: the kept set names
            modules of one model.
        **scaler_kwargs: passed to ``dls.GradScaler`` when ``scaler`` is ``None``.

    Call it once, right after building the Accelerator, before training. Models and optimizers prepared before the
    call are converted too (their forward runs under float16 autocast, their step goes through the dls scaler);
    those prepared after it are converted by ``prepare``. It replaces the Accelerator's torch scaler (on GPU) and
    enables autocast (on CPU, where Accelerate has none for fp16).

    Raises:
        ValueError: ``accelerator`` is not an Accelerator, its mixed precision is not fp16, it runs DeepSpeed,
            Megatron-LM, XLA or FSDP, dls is already installed, ``scaler`` is not a ``dls.GradScaler`` (or comes
            with ``scaler_kwargs``), or ``fallback`` is not a bool, or is ``True`` with a disabled scaler or with
            two models prepared already. Nothing is changed then. With ``fallback=True``, ``prepare`` raises
            ``ValueError`` before preparing a second model for training.
    """
    scaler = _checked_scaler(accelerator, scaler, fallback, scaler_kwargs)
    watcher = _Fallback(scaler) if fallback else None
    if watcher is not None:
        if not scaler.is_enabled():
            raise ValueError(
                "fallback=True needs an enabled scaler: its skipped steps are what the fallback learns from"
            )
        for model in accelerator._models:
            watcher.check(model)

    accelerator.scaler = scaler
    accelerator.native_amp = True  # Accelerate's switch for autocast in prepared forwards and accelerator.autocast()
    for model in accelerator._models:
        _autocast_forward(accelerator, model)
    for optimizer in accelerator._optimizers:
        _adopt(optimizer, scaler)
    prepare_optimizer = accelerator.prepare_optimizer

    def prepare_dls_optimizer(optimizer: Any, device_placement: bool | None = None) -> Any:
        prepared = prepare_optimizer(optimizer, device_placement=device_placement)
        _adopt(prepared, scaler)
        return prepared

    # prepare() reaches optimizers through this method: an instance attribute shadows the class's for this
    # accelerator only.
    accelerator.prepare_optimizer = prepare_dls_optimizer
    if watcher is not None:
        for model in accelerator._models:
            watcher.watch(model)
        prepare_model = accelerator.prepare_model

        def prepare_watched_model(
            model: Any, device_placement: bool | None = None, evaluation_mode: bool = False
        ) -> Any:
            if not evaluation_mode:
                watcher.check(model)  # before Accelerate changes anything
            prepared = prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
            if not evaluation_mode:
                watcher.watch(prepared)
            return prepared

        accelerator.prepare_model = prepare_watched_model  # prepare() reaches models through it, as above
    return scaler


class _Fallback:
    """``use_dls(..., fallback=True)``: the scaler's fallback watch of the one model prepared for training."""

    def __init__(self, scaler: GradScaler) -> None:
        self.scaler = scaler
        self.root: torch.nn.Module | None = None  # the model, without DDP's or torch.compile's wrapper
        self.watched = False

    def check(self, model: Any) -> None:
        """``ValueError`` on a second model (a model prepared again is the same one)."""
        root = unwrap(model)
        if self.root is not None and root is not self.root:
            raise ValueError(
                f"use_dls(fallback=True) keeps modules of one model; this accelerator prepares a second one "
                f"({type(root).__name__}, after {type(self.root).__name__}). Call scaler.watch(model, fallback=True) "
                "on the one whose float16 forward pass overflows, and use_dls without fallback."
            )
        self.root = root

    def watch(self, model: Any) -> None:
        if not self.watched:
            self.scaler.watch(unwrap(model), fallback=True)  # named as the model itself, inside any wrapper
            self.watched = True


class DLSAcceleratedOptimizer(AcceleratedOptimizer):
    """Accelerate's optimizer wrapper, stepping through a ``dls.GradScaler`` (``use_dls`` converts them).

    ``step()`` steps (through ``scaler.step`` and ``scaler.update``) only when Accelerate syncs gradients, i.e. once
    per optimizer step under gradient accumulation. ``step_was_skipped`` is
    ``scaler.step_was_skipped(optimizer)``: right for fused optimizers, one lazy read of the overflow flag there;
    ``False`` before the first step.
    """

    scaler: GradScaler

    def step(self, closure: Any = None) -> None:
        """Step through the dls scaler (skipped on overflow) once gradients are synchronised.

        Args:
            closure: passed to the optimizer's ``step`` when the scaler is disabled (a closure is refused otherwise).
        """
        if not self.gradient_state.sync_gradients:
            return
        self.scaler.step(self.optimizer, *(() if closure is None else (closure,)))
        self.scaler.update()

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last step was skipped, as the scaler decided it (right for fused optimizers too)."""
        try:
            return self.scaler.step_was_skipped(self.optimizer)
        except RuntimeError:  # the optimizer has not stepped yet, so nothing was skipped
            return False


def _checked_scaler(
    accelerator: Accelerator, scaler: GradScaler | None, fallback: Any, scaler_kwargs: dict[str, Any]
) -> GradScaler:
    """``use_dls``'s arguments checked before anything changes; the scaler to install (built when ``None``)."""
    if not isinstance(accelerator, Accelerator):
        raise ValueError(f"accelerator must be an accelerate.Accelerator; got {type(accelerator).__name__}")
    if accelerator.mixed_precision != "fp16":
        raise ValueError(
            "use_dls needs Accelerator(mixed_precision='fp16'); got mixed_precision="
            f"{accelerator.mixed_precision!r} (bf16 and float32 need no loss scaling)"
        )
    if accelerator.distributed_type in _UNSUPPORTED:
        raise ValueError(f"use_dls: {_UNSUPPORTED[accelerator.distributed_type]} ({accelerator.distributed_type})")
    if problem := flag_problem("fallback", fallback):
        raise ValueError(problem)
    if isinstance(accelerator.scaler, GradScaler):
        raise ValueError("use_dls was already called on this accelerator (accelerator.scaler is a dls.GradScaler)")
    if scaler is None:
        handler = accelerator.scaler_handler.to_kwargs() if accelerator.scaler_handler is not None else {}
        scaler = GradScaler(device=accelerator.device.type, **{**handler, **scaler_kwargs})
    elif not isinstance(scaler, GradScaler):
        raise ValueError(f"scaler must be a dls.GradScaler or None; got {type(scaler).__name__}")
    elif scaler_kwargs:
        raise ValueError(f"give scaler or scaler_kwargs, not both; got scaler and {sorted(scaler_kwargs)}")
    for optimizer in accelerator._optimizers:
        if type(optimizer) not in (AcceleratedOptimizer, DLSAcceleratedOptimizer):
            raise ValueError(f"use_dls cannot take over a prepared {type(optimizer).__name__}")
    return scaler


def _adopt(optimizer: Any, scaler: GradScaler) -> None:
    optimizer.scaler = scaler
    optimizer.__class__ = DLSAcceleratedOptimizer


def _autocast_forward(accelerator: Accelerator, model: Any) -> None:
    """Run a model prepared without autocast under it, as ``prepare`` does for models prepared with it."""
    if hasattr(model, "_original_forward"):  # prepared with autocast already
        return
    autocast = get_mixed_precision_context_manager(True, accelerator.autocast_handler)
    model._original_forward = model.forward  # what accelerator.unwrap_model puts back
    forward = model.forward
    if hasattr(forward, "__func__"):
        model.forward = MethodType(convert_outputs_to_fp32(autocast(forward.__func__)), model)
    else:
        model.forward = convert_outputs_to_fp32(autocast(forward))
