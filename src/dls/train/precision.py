"""How a run computes (``precision:``): parameter dtype, FP8 layers, master weights, autocast or ``dls.emulate``,
and the underflow each logged row measures (``optimizer.log_summaries``)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Sequence
from typing import Any

import torch

import dls
import dls.fp8
from dls.emulate import EmulationHandle
from dls.train.config import TrainConfig
from dls.train.data import Batch, TrainModel

__all__ = ["HALF_DTYPES", "RunPrecision"]

HALF_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


class RunPrecision:
    """The precision set-up of ``cfg`` applied to ``model`` (on ``device``): casts the model to the parameters' dtype
    and, with ``precision.fp8``, installs FP8 Linear layers (``process_group``: a data-parallel run's ranks)."""

    def __init__(self, cfg: TrainConfig, model: TrainModel, device: torch.device, process_group: Any = None) -> None:
        prec = cfg.precision
        self.model = model
        self.device = device
        self.compute_dtype = prec.compute_dtype
        self.half_params = prec.half_params
        self.master_weights = prec.half_params and prec.master_weights
        self.fp16_type = prec.fp16_type
        self.emulated = prec.emulated
        self.log_summaries = cfg.optimizer.log_summaries
        self.loss_weight = cfg.model.loss_weight
        self.param_dtype = HALF_DTYPES.get(prec.param_dtype, torch.float32)
        model.to(self.param_dtype)
        self.fp8: dls.fp8.Fp8Handle | None = None
        if prec.fp8 is not None:
            self.fp8 = dls.fp8.emulate(model, dls.fp8.recipe_from_dict(dict(prec.fp8)), process_group=process_group)
        self.emulation: EmulationHandle | None = None  # dls.emulate's hooks, while a session trains
        self._underflows: list[float] = []
        self._fp8_fractions: list[tuple[float, float]] = []  # (flushed, saturated) of grad_output, per logged row

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """``optimizer`` stepping float32 masters (``dls.master_weights``) where the config asks for them."""
        if not self.master_weights:
            return optimizer
        return dls.master_weights(optimizer, fmt="cbfloat16" if self.fp16_type == "cbfloat16" else None)

    def start_session(self) -> None:
        """Install this session's ``dls.emulate`` hooks (cbfloat16, ``precision.emulate``)."""
        if self.emulated:
            self.emulation = dls.emulate(self.model, self.compute_dtype, track_stats=self.log_summaries)

    def remove_hooks(self) -> None:
        """Take out this session's emulation and FP8 hooks (the FP8 state stays for the final checkpoint)."""
        if self.emulation is not None:
            self.emulation.remove()
            self.emulation = None
        if self.fp8 is not None:
            self.fp8.remove()

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """``torch.autocast`` for float16/bfloat16 without emulation or half parameters, else nothing."""
        if self.compute_dtype in HALF_DTYPES and self.emulation is None and not self.half_params:
            dtype = torch.float16 if self.compute_dtype == "float16" else torch.bfloat16
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
        return self.log_summaries and self.compute_dtype != "float32" and self.emulation is None and self.fp8 is None

    def probe_underflow(self, batch: Batch, scale: float) -> float:
        """The fraction of nonzero activation gradients flushed to zero at ``scale`` (one emulated backward pass)."""
        model: TrainModel = self.model
        if self.param_dtype != torch.float32:  # half parameters: a float32 copy holds the same values
            model = copy.deepcopy(model).float()
            batch = self.to_device(batch, torch.float32)
        params = [p for p in model.parameters() if p.requires_grad]
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), dls.emulate(model, self.compute_dtype) as handle:
            loss = model.loss(batch) * (self.loss_weight * scale)
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
        if underflow is not None:
            self._underflows.append(underflow)
        if fp8:
            self._fp8_fractions.append((fp8[0], fp8[1]))

    def means(self) -> tuple[float | None, float | None, float | None]:
        """The means of the recorded underflow, FP8 flushed and saturated fractions (``None``: none recorded)."""
        return (
            _mean(self._underflows),
            _mean([f for f, _ in self._fp8_fractions]),
            _mean([s for _, s in self._fp8_fractions]),
        )


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None
