"""Lightning: ``DLSPrecision``, a mixed-precision plugin that scales with a ``dls.GradScaler``.

```python
import lightning as L
from dls.integrations.lightning import DLSPrecision

trainer = L.Trainer(accelerator="cpu", plugins=[DLSPrecision("16-mixed", "cpu")], max_steps=1000)
trainer.fit(model)
```

Give the plugin instead of ``precision=`` (Lightning refuses both). On CPU, ``precision="16-mixed"`` alone turns
into bf16; this plugin computes in float16 under ``torch.autocast("cpu", dtype=torch.float16)``.
``DLSPrecision("16-mixed", "cpu", fallback=True)`` also keeps modules whose float16 output overflows in float32.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from dls.checks import flag_problem
from dls.diagnostics.watch import OverflowWatch
from dls.keep import unwrap
from dls.scaler import GradScaler
from dls.skip import SkipAware, skip_aware

try:
    from lightning.pytorch.plugins.precision import MixedPrecision
except ImportError as err:  # pragma: no cover - exercised by the import-blocking test
    raise ImportError("dls.integrations.lightning needs the lightning package: pip install 'dls[lightning]'") from err

__all__ = ["DLSPrecision"]

_PRECISIONS = ("16-mixed", "bf16-mixed")


class DLSPrecision(MixedPrecision):
    """Automatic mixed precision with dls's loss scaling, for ``L.Trainer(plugins=[DLSPrecision(...)])``.

    A subclass of Lightning's ``MixedPrecision`` (so Lightning treats it as AMP: autocast in every forward,
    ``scaler.scale(loss)`` before backward, ``scaler.unscale_`` before gradient clipping, ``scaler.step`` and
    ``scaler.update`` per optimizer step) whose scaler is a ``dls.GradScaler``.

    Args:
        precision: ``"16-mixed"`` (float16 autocast, loss scaling) or ``"bf16-mixed"`` (bfloat16 autocast).
        device: the autocast device: ``"cpu"``, ``"cuda"`` (an index such as ``"cuda:1"`` is reduced to its type).
        scaler: the ``dls.GradScaler`` to use. Default: ``dls.GradScaler(device=device)`` for ``"16-mixed"``; for
            ``"bf16-mixed"`` a disabled one (bfloat16 needs no scaling; pass an enabled scaler to have steps with
            non-finite gradients skipped all the same).
        fallback: keep modules whose float16 output overflows in float32, found by themselves
            (``scaler.watch(model, fallback=True)``, see ``dls.diagnostics.fallback``) on the LightningModule the
            Trainer runs. An argument here rather than a call in your code, because the Trainer sets the model up
            inside ``fit`` (and wraps it in DDP there): the plugin watches it when the Trainer connects it, by the
            LightningModule's own module names whatever the strategy wraps it in. Needs loss scaling
            (``"16-mixed"`` or an enabled ``scaler``).

    Attributes:
        scaler: the ``dls.GradScaler``; ``plugin.scaler.step_was_skipped(optimizer)`` tells whether the last step
            was applied (``trainer.precision_plugin.scaler`` from inside a LightningModule).
        watch: with ``fallback=True``, the ``OverflowWatch`` of the LightningModule once the Trainer has set it up
            (``plugin.watch.kept_in_float32`` names the modules kept in float32); ``None`` before, or without it.

    Behaviour:
        * LR schedulers with ``interval="step"`` are wrapped with ``dls.skip_aware`` when the Trainer connects them,
          so they advance only on applied steps (``last_epoch`` counts real updates); with gradient accumulation,
          once per optimizer step. Epoch-interval schedulers are left alone. Schedulers you step by hand in manual
          optimization (``self.lr_schedulers()``) are the same wrapped objects.
        * The scaler's state is saved in Lightning checkpoints under ``"DLSPrecision"`` and restored on resume
          (``ckpt_path=``). A checkpoint written with Lightning's own ``MixedPrecision`` (torch's scaler) resumes
          with its scale.
        * Fused optimizers (``fused=True``) take the scale and the overflow flag themselves, so the step reads
          nothing back; a skip-aware scheduler then reads the flag once per step. Lightning refuses
          ``gradient_clip_val`` with them; ``GradScaler(max_gradient_norm=...)`` clips instead.
        * With ``fallback=True`` the kept modules are part of the scaler's state (``kept_in_float32``), so they are
          in the checkpoint's ``"DLSPrecision"`` entry and kept again from the start of a resumed ``fit``. The
          fallback sees each ``training_step`` as one forward pass of the LightningModule, whether or not it
          calls ``self(...)``. Every process of a DDP run keeps the same modules.
    """

    def __init__(
        self, precision: str, device: str, scaler: GradScaler | None = None, *, fallback: bool = False
    ) -> None:
        if precision not in _PRECISIONS:
            raise ValueError(f"precision must be one of {_PRECISIONS}; got {precision!r}")
        device_type = _device_type(device)
        if problem := flag_problem("fallback", fallback):
            raise ValueError(problem)
        if scaler is None:
            scaler = GradScaler(device=device_type, enabled=precision == "16-mixed")
        elif not isinstance(scaler, GradScaler):
            raise ValueError(
                f"scaler must be a dls.GradScaler or None; got {type(scaler).__name__} (for torch's scaler use "
                "Lightning's own MixedPrecision plugin)"
            )
        if fallback and not scaler.is_enabled():
            raise ValueError(
                "fallback=True needs loss scaling, which decides the skipped steps it learns from: precision "
                f"'16-mixed' or an enabled scaler; got precision {precision!r} with a disabled scaler"
            )
        # MixedPrecision refuses any scaler with bf16; the dls one goes in after its checks.
        super().__init__(precision, device_type, scaler=None if precision == "bf16-mixed" else scaler)  # type: ignore[arg-type]
        self.scaler: GradScaler = scaler  # type: ignore[assignment]
        self.fallback = fallback
        self.watch: OverflowWatch | None = None

    def connect(self, model: Any, optimizers: list[Any], lr_schedulers: list[Any]) -> tuple[Any, list[Any], list[Any]]:
        """Wrap step-interval LR schedulers with ``dls.skip_aware`` and, with ``fallback=True``, watch the
        LightningModule (called by the Trainer during setup, for every ``fit``, ``validate``, ...).

        Args:
            model: the LightningModule.
            optimizers: its optimizers.
            lr_schedulers: its LR scheduler configurations.

        Returns:
            ``(model, optimizers, lr_schedulers)``, the step-interval schedulers wrapped.
        """
        model, optimizers, lr_schedulers = super().connect(model, optimizers, lr_schedulers)
        if self.fallback:
            self._watch(unwrap(model))  # the LightningModule inside DDP: its names are the same for every strategy
        for config in lr_schedulers:
            if config.interval != "step" or isinstance(config.scheduler, SkipAware):
                continue
            owner = getattr(config.scheduler, "optimizer", None)
            if owner is None and len(optimizers) != 1:
                raise ValueError(
                    f"DLSPrecision cannot tell which optimizer drives the step-interval scheduler "
                    f"{type(config.scheduler).__name__}: it has no .optimizer and there are {len(optimizers)} "
                    "optimizers. Give the scheduler an .optimizer attribute."
                )
            driver = owner if owner is not None else optimizers[0]
            config.scheduler = skip_aware(config.scheduler, self.scaler, optimizer=driver)
        return model, optimizers, lr_schedulers

    def _watch(self, module: torch.nn.Module) -> None:
        if self.watch is not None and self.watch.active:
            if unwrap(self.watch.model) is module:
                return  # fit after fit, or validate after fit: the kept modules stay kept
            self.watch.remove()  # the plugin now trains another model
        self.watch = self.scaler.watch(module, fallback=True)

    @contextlib.contextmanager
    def train_step_context(self) -> Iterator[None]:
        """Autocast, and the training step counted as one forward pass of the watched LightningModule (the
        Trainer calls ``training_step``, which need not call ``forward``)."""
        with super().train_step_context():
            if self.watch is None:
                yield
            else:
                with self.watch.forward_pass():
                    yield

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Resume from a checkpoint of Lightning's ``MixedPrecision`` (torch's scaler state) when it has no dls
        state; the Trainer then loads ``checkpoint["DLSPrecision"]`` itself where it exists.

        Args:
            checkpoint: the Lightning checkpoint being loaded.
        """
        super().on_load_checkpoint(checkpoint)
        torch_state = checkpoint.get(MixedPrecision.__qualname__)
        if type(self).__qualname__ not in checkpoint and torch_state:
            self.scaler.load_state_dict(torch_state)


def _device_type(device: Any) -> str:
    try:
        return torch.device(device).type
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device must be a device such as 'cpu' or 'cuda'; got {device!r}") from err
