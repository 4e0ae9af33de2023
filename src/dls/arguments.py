"""How ``GradScaler``'s arguments are read: torch.amp's signature when a device is given, cstorch.amp's otherwise.

``GradScaler("cuda", init_scale, growth_factor, backoff_factor, growth_interval, enabled)`` (or any call with
``device=``) is torch.amp's positional signature and defaults; ``GradScaler(loss_scale, init_scale,
steps_per_increase, min_loss_scale, max_loss_scale, overflow_tolerance, max_gradient_norm)`` is cstorch.amp's. Every
other knob is accepted by keyword in both. Unknown keywords are Python's usual ``TypeError``; bad values are
``ValueError`` naming the argument (``dls.settings.SettingsError``).
"""

from __future__ import annotations

from typing import Any

import torch

from dls.settings import DEFAULT_STEPS_PER_INCREASE, TORCH_INIT_SCALE, ScalerSettings


def read_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[ScalerSettings, dict[str, Any]]:
    """``(settings, runtime)``: the scaler's settings, and ``enabled``, ``device`` (a ``torch.device`` or ``None``),
    ``sync_free``, ``process_group``, ``gradients_sharded``."""
    if kwargs.get("device") is not None and args and not _is_device(args[0]):
        raise ValueError(
            f"device={kwargs['device']!r} selects torch.amp's arguments (device, init_scale, growth_factor, "
            f"backoff_factor, growth_interval, enabled), whose first is the device; got {args[0]!r} first: pass "
            "it by keyword (e.g. loss_scale='dynamic')"
        )
    if kwargs.get("device") is not None or (args and _is_device(args[0])):
        runtime, settings = _torch_dialect(*args, **kwargs)
        runtime["device"] = parse_device(args[0] if args else kwargs["device"])
    else:
        runtime, settings = _cerebras_dialect(*args, **kwargs)
        runtime["device"] = None
    return settings, runtime


def _torch_dialect(
    device: Any = None,
    init_scale: float | None = None,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int | None = None,
    enabled: bool = True,
    *,
    loss_scale: str | float | None = "dynamic",
    steps_per_increase: int | None = None,
    min_loss_scale: float | None = None,
    max_loss_scale: float | None = None,
    overflow_tolerance: float = 0.0,
    hysteresis: int = 1,
    consecutive_hysteresis: bool = False,
    max_gradient_norm: float | None = None,
    half_dtype: Any = None,
    sync_free: bool = False,
    process_group: Any = None,
    gradients_sharded: bool | None = None,
) -> tuple[dict[str, Any], ScalerSettings]:
    interval = _one_of(growth_interval, steps_per_increase)
    settings = ScalerSettings.torch(
        TORCH_INIT_SCALE if init_scale is None else init_scale,
        growth_factor,
        backoff_factor,
        DEFAULT_STEPS_PER_INCREASE if interval is None else interval,
        loss_scale=loss_scale if loss_scale is not None else "dynamic",
        min_loss_scale=min_loss_scale,
        max_loss_scale=max_loss_scale,
        overflow_tolerance=overflow_tolerance,
        hysteresis=hysteresis,
        consecutive_hysteresis=consecutive_hysteresis,
        max_gradient_norm=max_gradient_norm,
        half_dtype=half_dtype,
    )
    runtime = {"enabled": enabled, "sync_free": sync_free, "process_group": process_group}
    return runtime | {"gradients_sharded": gradients_sharded}, settings


def _cerebras_dialect(
    loss_scale: str | float | None = None,
    init_scale: float | None = None,
    steps_per_increase: int | None = None,
    min_loss_scale: float | None = None,
    max_loss_scale: float | None = None,
    overflow_tolerance: float = 0.0,
    max_gradient_norm: float | None = None,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    hysteresis: int = 1,
    enabled: bool = True,
    *,
    growth_interval: int | None = None,
    consecutive_hysteresis: bool = False,
    half_dtype: Any = None,
    sync_free: bool = False,
    process_group: Any = None,
    gradients_sharded: bool | None = None,
    device: None = None,
) -> tuple[dict[str, Any], ScalerSettings]:
    settings = ScalerSettings.cerebras(
        loss_scale,
        init_scale,
        _one_of(steps_per_increase, growth_interval),
        min_loss_scale,
        max_loss_scale,
        overflow_tolerance,
        max_gradient_norm,
        growth_factor,
        backoff_factor,
        hysteresis,
        half_dtype=half_dtype,
        consecutive_hysteresis=consecutive_hysteresis,
    )
    runtime = {"enabled": enabled, "sync_free": sync_free, "process_group": process_group}
    return runtime | {"gradients_sharded": gradients_sharded}, settings


def _one_of(steps_per_increase: int | None, growth_interval: int | None) -> int | None:
    if steps_per_increase is not None and growth_interval is not None:
        raise ValueError("give steps_per_increase or its torch name growth_interval, not both")
    return steps_per_increase if steps_per_increase is not None else growth_interval


def _is_device(value: Any) -> bool:
    if isinstance(value, torch.device):
        return True
    if not isinstance(value, str) or value == "dynamic":
        return False
    try:
        torch.device(value)
    except (RuntimeError, ValueError):
        return False
    return True


def parse_device(value: Any) -> torch.device:
    if isinstance(value, torch.device):
        return value
    if isinstance(value, str):
        try:
            return torch.device(value)
        except (RuntimeError, ValueError):
            pass
    raise ValueError(
        f"device must be a device name such as 'cuda', 'cuda:1' or 'cpu', or a torch.device; got {value!r}"
    )


def device_kind(device: torch.device) -> str:
    return "CUDA" if device.type == "cuda" else device.type


def is_available(device: torch.device) -> bool:
    module = getattr(torch, device.type, None)
    is_available = getattr(module, "is_available", None)
    return bool(is_available()) if callable(is_available) else True
