r"""torchtitan: float16 training with a ``dls.GradScaler``, through torchtitan's own extension points.

torchtitan (0.3.0) has no loss scaler, and its command line takes only bfloat16 and float32 for
``--training.mixed-precision-param``. This module is a config module for ``--module``: every config that
torchtitan registers, ``NAME``, is here as ``NAME_fp16`` (float16 parameters in FSDP's compute, float32 gradient
reduction, dynamic loss scaling)::

    torchrun --nproc_per_node=8 -m torchtitan.train --module dls.integrations.torchtitan \\
        --config llama3_8b_fp16 --loss-scaling.init-scale 65536 --loss-scaling.growth-interval 1000

In a config function of your own: ``return with_dls(llama3_8b(), init_scale=2.0**16)``. What it changes,
without patching a torchtitan file (``DLSTrainer`` is a ``Trainer`` subclass, ``DLSOptimizersContainer`` an
``OptimizersContainer`` one, both built by torchtitan's ``Configurable`` machinery):

* the scale enters where the gradient starts: the gradient of the loss that backward begins from is multiplied
  by the scale. torchtitan's default ``ChunkedLossWrapper`` runs backward inside the loss call, once per chunk,
  and its autograd bridge ignores the returned loss's gradient, so there the scale enters the inner, per-chunk
  loss. The losses torchtitan logs stay unscaled;
* after the last microbatch's backward (``DLSTrainer.unscale_gradients``) the gradients are unscaled and the
  overflow flag is agreed across every rank (one MAX all-reduce, asynchronous), before torchtitan's
  ``clip_grad_norm_``; the optimizers step through the scaler, so an overflowing step is skipped on every rank
  (parameters and optimizer state untouched), then the scale is updated;
* the LR schedulers step only after applied optimizer steps (``dls.skip_aware``);
* the scaler's state is part of torchtitan's ``train_state`` in every DCP checkpoint, and a resume restores the
  scale and its counters; the loss scale and the skipped steps are logged with torchtitan's metrics;
* torchtitan creates optimizer state for a checkpoint with a zero step (``init_optim_state``), which does
  nothing while a gradient is set: when every step before a checkpoint was skipped (no state yet, gradients
  still set), the checkpoint would lack the optimizer state and the resume would fail with ``Missing key
  ...optimizer.state...``. ``DLSOptimizersContainer.state_dict`` sets the gradients aside for that zero step.

Not supported: pipeline parallelism (the schedule holds the loss before the trainer can wrap it), a custom
optimizer container. ``--loss-scaling.enabled False`` trains float16 without scaling (as a comparison).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from dls.scaler import GradScaler
from dls.skip import skip_aware

try:
    from torchtitan.components.loss import ChunkedLossWrapper
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.components.optimizer.utils import init_optim_state
    from torchtitan.trainer import Trainer
except ImportError as err:  # pragma: no cover - exercised by the import-blocking test
    raise ImportError(
        "dls.integrations.torchtitan needs the torchtitan package: pip install 'dls[torchtitan]'"
    ) from err

__all__ = ["DLSOptimizersContainer", "DLSTrainer", "LossScalingConfig", "with_dls"]


@dataclass(kw_only=True, slots=True)
class LossScalingConfig:
    """``--loss-scaling.*``: the ``dls.GradScaler`` of the run, in torch.amp's terms."""

    init_scale: float = 2.0**16
    """The first loss scale."""
    growth_interval: int = 2000
    """Clean steps before the scale grows."""
    growth_factor: float = 2.0
    """Multiplies the scale on growth."""
    backoff_factor: float = 0.5
    """Multiplies the scale after an overflow."""
    enabled: bool = True
    """False: float16 without loss scaling (nothing skipped)."""


class DLSOptimizersContainer(OptimizersContainer):
    """The torchtitan ``OptimizersContainer``, stepping each optimizer through the trainer's ``dls.GradScaler``."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        """``OptimizersContainer.Config``'s fields; builds a ``DLSOptimizersContainer``."""

    scaler: GradScaler | None = None  # set by DLSTrainer once it has built the scaler

    def step(self, closure: Any = None) -> None:
        """Step every optimizer through the scaler (all skipped on overflow), then update the scale.

        Args:
            closure: not supported (torchtitan's container refuses it too).
        """
        assert closure is None, "DLSOptimizersContainer does not support closures"
        if self.scaler is None:
            raise RuntimeError("DLSOptimizersContainer.step(): no scaler; build it through DLSTrainer")
        for optimizer in self.optimizers:
            self.scaler.step(optimizer)
        self.scaler.update()

    def state_dict(self) -> dict[str, Any]:
        """The torchtitan flat state dict; for an optimizer without state yet (every step so far was skipped), the
        gradients are set aside while torchtitan's ``init_optim_state`` creates it."""
        for optimizer in self.optimizers:
            if not optimizer.state:
                params = [p for group in optimizer.param_groups for p in group["params"]]
                grads = [p.grad for p in params]
                for p in params:
                    p.grad = None
                try:
                    init_optim_state(optimizer)
                finally:
                    for p, g in zip(params, grads):
                        p.grad = g
        return super().state_dict()


class DLSTrainer(Trainer):
    """The torchtitan ``Trainer`` training float16 with a ``dls.GradScaler`` (``self.scaler``); see the module."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        """``Trainer.Config`` and ``loss_scaling`` (``--loss-scaling.*``); the default optimizer container becomes a
        ``DLSOptimizersContainer``."""

        loss_scaling: LossScalingConfig = field(default_factory=LossScalingConfig)

        def __post_init__(self) -> None:
            Trainer.Config.__post_init__(self)
            config: Any = self  # torchtitan's fields are not typed for mypy here
            if type(config.optimizer) is OptimizersContainer.Config:  # the default: step through the scaler
                config.optimizer = DLSOptimizersContainer.Config(**_fields(config.optimizer))

    config: Config
    scaler: GradScaler

    def __init__(self, config: Config) -> None:
        if config.parallelism.pipeline_parallel_degree > 1:
            raise ValueError("DLSTrainer: pipeline parallelism is not supported (parallelism.pipeline_parallel_degree)")
        super().__init__(config)
        if not isinstance(self.optimizers, DLSOptimizersContainer):
            raise ValueError(
                f"DLSTrainer needs optimizer=DLSOptimizersContainer.Config(...); got {type(self.optimizers).__name__}"
            )
        ls = config.loss_scaling
        self.scaler = GradScaler(
            self.device,
            init_scale=ls.init_scale,
            growth_factor=ls.growth_factor,
            backoff_factor=ls.backoff_factor,
            growth_interval=ls.growth_interval,
            enabled=ls.enabled,
        )
        self.optimizers.scaler = self.scaler
        self.lr_schedulers.schedulers = [skip_aware(s, self.scaler) for s in self.lr_schedulers.schedulers]
        trainer: Any = self  # torchtitan's attributes are not typed for mypy here
        if isinstance(trainer.loss_fn, ChunkedLossWrapper):
            trainer.loss_fn.loss_fn = _ScaledLoss(trainer.loss_fn.loss_fn, self.scaler)
        else:
            trainer.loss_fn = _ScaledLoss(trainer.loss_fn, self.scaler)
        self._backwards = 0

    def train_step(self, data_iterator: Any) -> None:
        """The torchtitan step (the microbatches' backward, ``unscale_gradients``, clipping, the optimizers through
        the scaler, the LR schedule), then the scale and the skipped steps into the metrics on logging steps.

        Args:
            data_iterator: as torchtitan's.
        """
        self._backwards = 0
        super().train_step(data_iterator)
        if self.metrics_processor.should_log(self.step):
            scale, skipped = self.scaler.get_scale(), self.scaler.get_num_skipped_steps()  # reads: log steps only
            self.metrics_processor.logger.log({"loss_scale": scale, "skipped_steps": skipped}, self.step)

    def forward_backward_step(self, **kwargs: Any) -> torch.Tensor:
        """The torchtitan forward and backward of one microbatch group; after the step's last one,
        ``unscale_gradients``.

        Args:
            **kwargs: as torchtitan's.

        Returns:
            The (unscaled) loss, as torchtitan's.
        """
        loss = super().forward_backward_step(**kwargs)
        self._backwards += 1
        if self._backwards == self.gradient_accumulation_steps:
            self.unscale_gradients()
        return loss

    def unscale_gradients(self) -> None:
        """Unscale every optimizer's gradients and start the agreement of the overflow flag across ranks: called
        once per step, after the last microbatch's backward and before torchtitan clips."""
        for optimizer in self.optimizers:
            self.scaler.unscale_(optimizer)

    def state_dict(self) -> dict[str, Any]:
        """The torchtitan ``train_state`` plus the scaler's state (``loss_scaler``)."""
        return {**super().state_dict(), "loss_scaler": self.scaler.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore torchtitan's ``train_state`` and the scaler (its scale and counters).

        Args:
            state_dict: what ``state_dict()`` saved.
        """
        super().load_state_dict(state_dict)
        self.scaler.load_state_dict(state_dict["loss_scaler"])


class _ScaleBackward(torch.autograd.Function):
    """The identity forward; backward multiplies the incoming gradient by the scale."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(scale)
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (scale,) = ctx.saved_tensors
        return grad * scale.to(grad.device), None


class _ScaledLoss:
    """A torchtitan loss whose value is the loss and whose gradient is the scaled loss's (the loss a backward
    starts from: torchtitan logs and checks the returned value)."""

    def __init__(self, loss_fn: Callable[..., Any], scaler: GradScaler) -> None:
        self.loss_fn, self.scaler = loss_fn, scaler

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        loss, metrics = self.loss_fn(*args, **kwargs)
        if self.scaler.is_enabled() and loss.requires_grad:
            loss = _ScaleBackward.apply(loss, self.scaler.get_scale_tensor())
        return loss, metrics

    def __getattr__(self, name: str) -> Any:
        if name in ("loss_fn", "scaler"):  # not set yet (a copy or unpickling): no recursion through loss_fn
            raise AttributeError(name)
        return getattr(self.loss_fn, name)


def _fields(config: Any) -> dict[str, Any]:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}


def with_dls(config: Trainer.Config, **loss_scaling: Any) -> DLSTrainer.Config:
    """``config`` as a ``DLSTrainer.Config``: float16 parameters in FSDP's compute (float32 gradient reduction),
    the optimizers stepping through the scaler, ``loss_scaling`` as ``LossScalingConfig``'s fields.

    Args:
        config: a torchtitan ``Trainer.Config`` (what a torchtitan config function returns).
        **loss_scaling: ``init_scale``, ``growth_interval``, ``growth_factor``, ``backoff_factor``, ``enabled``.

    Returns:
        The ``DLSTrainer.Config`` (``config`` itself is not changed).

    Raises:
        ValueError: ``config`` is not a ``Trainer.Config``, or a ``loss_scaling`` key is unknown.
    """
    if not isinstance(config, Trainer.Config):
        raise ValueError(f"config must be a torchtitan Trainer.Config; got {type(config).__name__}")
    known = {f.name for f in dataclasses.fields(LossScalingConfig)}
    if unknown := sorted(set(loss_scaling) - known):
        raise ValueError(f"unknown loss_scaling keys {unknown}; allowed: {sorted(known)}")
    values = _fields(config)
    values["training"] = dataclasses.replace(config.training, mixed_precision_param="float16")
    values["loss_scaling"] = LossScalingConfig(**loss_scaling)
    return DLSTrainer.Config(**values)


def _registered(name: str) -> Callable[[], Trainer.Config] | None:
    """The torchtitan registered config function ``name`` (``llama3_debugmodel``), found by its model's prefix."""
    from torchtitan.models import _supported_models

    for model in sorted(_supported_models, key=len, reverse=True):
        if name.startswith(model):
            registry = importlib.import_module(f"torchtitan.models.{model}.config_registry")
            function = getattr(registry, name, None)
            return function if callable(function) else None
    return None


def __getattr__(name: str) -> Any:
    # `--module dls.integrations.torchtitan --config NAME_fp16`: torchtitan's registered config NAME, with dls.
    if name.endswith("_fp16") and not name.startswith("_"):
        base = _registered(name[: -len("_fp16")])
        if base is not None:

            def config() -> DLSTrainer.Config:
                return with_dls(base())

            config.__name__ = config.__qualname__ = name
            config.__doc__ = f"torchtitan's {base.__name__}, float16 with dls loss scaling."
            return config
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
