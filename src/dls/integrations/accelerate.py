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
"""

from __future__ import annotations

from types import MethodType
from typing import Any

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


def use_dls(accelerator: Accelerator, scaler: GradScaler | None = None, **scaler_kwargs: Any) -> GradScaler:
    """Make ``accelerator`` (``mixed_precision="fp16"``) scale with a ``dls.GradScaler``; returns the scaler.

    Args:
        accelerator: an ``accelerate.Accelerator`` built with ``mixed_precision="fp16"``.
        scaler: the ``dls.GradScaler`` to install, or ``None`` to build ``dls.GradScaler(device=<the accelerator's
            device type>, **scaler_kwargs)``; a ``GradScalerKwargs`` handler given to the Accelerator
            (``init_scale``, ``growth_interval``, ...) is honoured, ``scaler_kwargs`` win over it.
        **scaler_kwargs: passed to ``dls.GradScaler`` when ``scaler`` is ``None``.

    Call it once, right after building the Accelerator, before training. Models and optimizers prepared before the
    call are converted too (their forward runs under float16 autocast, their step goes through the dls scaler);
    those prepared after it are converted by ``prepare``. It replaces the Accelerator's torch scaler (on GPU) and
    enables autocast (on CPU, where Accelerate has none for fp16).

    Raises:
        ValueError: ``accelerator`` is not an Accelerator, its mixed precision is not fp16, it runs DeepSpeed,
            Megatron-LM, XLA or FSDP, dls is already installed, or ``scaler`` is not a ``dls.GradScaler`` (or comes
            with ``scaler_kwargs``). Nothing is changed then.
    """
    if not isinstance(accelerator, Accelerator):
        raise ValueError(f"accelerator must be an accelerate.Accelerator; got {type(accelerator).__name__}")
    if accelerator.mixed_precision != "fp16":
        raise ValueError(
            "use_dls needs Accelerator(mixed_precision='fp16'); got mixed_precision="
            f"{accelerator.mixed_precision!r} (bf16 and float32 need no loss scaling)"
        )
    if accelerator.distributed_type in _UNSUPPORTED:
        raise ValueError(f"use_dls: {_UNSUPPORTED[accelerator.distributed_type]} ({accelerator.distributed_type})")
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
    return scaler


class DLSAcceleratedOptimizer(AcceleratedOptimizer):
    """Accelerate's optimizer wrapper, stepping through a ``dls.GradScaler`` (``use_dls`` converts them).

    ``step()`` steps (through ``scaler.step`` and ``scaler.update``) only when Accelerate syncs gradients, i.e. once
    per optimizer step under gradient accumulation. ``step_was_skipped`` is
    ``scaler.step_was_skipped(optimizer)``: right for fused optimizers, one lazy read of the overflow flag there;
    ``False`` before the first step.
    """

    scaler: GradScaler

    def step(self, closure: Any = None) -> None:
        """Step through the dls scaler (skipped on overflow) once gradients are synchronised."""
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
