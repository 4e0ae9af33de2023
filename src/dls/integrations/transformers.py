"""Hugging Face Trainer: ``use_dls(trainer)`` trains ``fp16=True`` with a ``dls.GradScaler``.

```python
from transformers import Trainer, TrainingArguments
from dls.integrations.transformers import use_dls

trainer = Trainer(model=model, args=TrainingArguments(output_dir="out", fp16=True, report_to=[]), ...)
scaler = use_dls(trainer)        # after building the Trainer, before train()
trainer.train()
```

``use_dls(trainer, fallback=True)`` also keeps modules whose float16 output overflows in float32.

The Trainer trains through its ``Accelerator``; ``use_dls`` is ``dls.integrations.accelerate.use_dls`` on it. A
``TrainerCallback`` could not do this: callbacks see the model, optimizer and scheduler, never the Trainer or its
Accelerator.
"""

from __future__ import annotations

from typing import Any

from dls.integrations.accelerate import use_dls as use_dls_in_accelerate
from dls.scaler import GradScaler

try:
    from transformers import Trainer
except ImportError as err:  # pragma: no cover - exercised by the import-blocking test
    raise ImportError("dls.integrations.transformers needs the transformers package: pip install 'dls[hf]'") from err

__all__ = ["use_dls"]


def use_dls(
    trainer: Trainer, scaler: GradScaler | None = None, *, fallback: bool = False, **scaler_kwargs: Any
) -> GradScaler:
    """Make a Hugging Face ``Trainer`` with ``TrainingArguments(fp16=True)`` scale with a ``dls.GradScaler``.

    Args:
        trainer: the Trainer, built (its Accelerator exists) and not yet training.
        scaler: the ``dls.GradScaler`` to use, or ``None`` to build ``dls.GradScaler(device=<the Trainer's device
            type>, **scaler_kwargs)``.
        fallback: keep modules whose float16 output overflows in float32, found by themselves
            (``dls.diagnostics.fallback``), in the model the Trainer trains. An argument, because the Trainer
            prepares its model inside ``train()`` (after re-creating it with ``model_init``, wrapping it in DDP):
            the model is watched when the Trainer prepares it, by the names of ``trainer.model``. The kept modules
            are named in ``scaler.state_dict()["kept_in_float32"]`` (each addition is warned once), saved in every
            checkpoint's ``scaler.pt`` and kept again from the first step of ``train(resume_from_checkpoint=...)``.
            The kept set names modules of one model: a second ``train()`` that re-creates the model with
            ``model_init`` is refused; build a new Trainer for it.
        **scaler_kwargs: passed to ``dls.GradScaler`` when ``scaler`` is ``None``.

    Returns:
        The scaler (``scaler.step_was_skipped(...)``, ``get_scale()``, ``get_num_skipped_steps()``).

    With it, on CPU and GPU:

    * the forward runs under float16 autocast (on CPU the Trainer's ``fp16=True`` otherwise trains in float32);
    * the LR scheduler steps only after applied optimizer steps: the Trainer asks
      ``accelerator.optimizer_step_was_skipped``, which now asks the scaler, so it is right for the Trainer's default
      fused AdamW (where Accelerate alone reports a skipped step as taken);
    * checkpoints carry the scaler's state (``scaler.pt``) and ``train(resume_from_checkpoint=...)`` restores it.

    ``hyperparameter_search`` builds a new Accelerator for every trial, without dls. To keep dls there, subclass the
    Trainer and call ``use_dls(self)`` at the end of its ``create_accelerator_and_postprocess()``.

    Raises:
        ValueError: ``trainer`` is not a Trainer, ``fp16`` is not set, DeepSpeed or FSDP is enabled, or an argument
            is invalid (see ``dls.integrations.accelerate.use_dls``). Nothing is changed then.
    """
    if not isinstance(trainer, Trainer):
        raise ValueError(f"trainer must be a transformers.Trainer; got {type(trainer).__name__}")
    if not trainer.args.fp16:
        raise ValueError(
            "use_dls needs TrainingArguments(fp16=True); got fp16=False"
            + (" and bf16=True (bf16 needs no loss scaling)" if trainer.args.bf16 else "")
        )
    return use_dls_in_accelerate(trainer.accelerator, scaler, fallback=fallback, **scaler_kwargs)
