"""How ``GradScaler``'s arguments are read: torch.amp's signature when a device is given, cstorch.amp's otherwise.

``GradScaler("cuda", init_scale, growth_factor, backoff_factor, growth_interval, enabled)`` (or any call with
``device=``) is torch.amp's positional signature and defaults; ``GradScaler(loss_scale, init_scale,
steps_per_increase, min_loss_scale, max_loss_scale, overflow_tolerance, max_gradient_norm)`` is cstorch.amp's. Every
other knob is accepted by keyword in both. Each signature is derived from its dialect's ``ScalerSettings`` constructor
(declared once, there; the ``@overload``s of ``GradScaler.__init__`` are for type checkers). Unknown keywords are
Python's usual ``TypeError``; bad values are ``ValueError`` naming the argument (``dls.settings.SettingsError``).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from dls.settings import ScalerSettings

# Arguments of GradScaler that are not settings: where the scaler runs, and torch's name for the growth interval
# in the Cerebras dialect (and the reverse).
_RUNTIME = ("sync_free", "process_group", "gradients_sharded")
_RUNTIME_DEFAULTS: dict[str, Any] = {
    "enabled": True,
    "sync_free": False,
    "process_group": None,
    "gradients_sharded": None,
}


def _signature(settings_method: Any, positional: int, leading: list[str], alias: str) -> inspect.Signature:
    """GradScaler's signature in a dialect, derived from the dialect's ``ScalerSettings`` constructor (declared once,
    there): ``leading`` first (torch's ``device``), then that constructor's first ``positional`` parameters, then
    ``enabled``; everything else keyword-only, with ``alias`` (the other dialect's name of the growth interval)
    and the runtime arguments."""
    P = inspect.Parameter
    own = list(inspect.signature(settings_method).parameters.values())
    params = [P(name, P.POSITIONAL_OR_KEYWORD, default=None) for name in leading]
    params += [p.replace(kind=P.POSITIONAL_OR_KEYWORD) for p in own[:positional]]
    params.append(P("enabled", P.POSITIONAL_OR_KEYWORD, default=True))
    params += [p.replace(kind=P.KEYWORD_ONLY) for p in own[positional:]]
    params += [P(name, P.KEYWORD_ONLY, default=None) for name in (alias, "device") if name not in leading]
    params += [P(name, P.KEYWORD_ONLY, default=_RUNTIME_DEFAULTS[name]) for name in _RUNTIME]
    return inspect.Signature(params)


TORCH_SIGNATURE = _signature(ScalerSettings.torch, 4, ["device"], "steps_per_increase")
CEREBRAS_SIGNATURE = _signature(ScalerSettings.cerebras, 10, [], "growth_interval")


def read_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[ScalerSettings, dict[str, Any]]:
    """``(settings, runtime)``: the scaler's settings, and ``enabled``, ``device`` (a ``torch.device`` or ``None``),
    ``sync_free``, ``process_group``, ``gradients_sharded``."""
    if kwargs.get("device") is not None and args and not _is_device(args[0]):
        raise ValueError(
            f"device={kwargs['device']!r} selects torch.amp's arguments (device, init_scale, growth_factor, "
            f"backoff_factor, growth_interval, enabled), whose first is the device; got {args[0]!r} first: pass "
            "it by keyword (e.g. loss_scale='dynamic')"
        )
    is_torch = kwargs.get("device") is not None or bool(args and _is_device(args[0]))
    signature = TORCH_SIGNATURE if is_torch else CEREBRAS_SIGNATURE
    try:
        given = signature.bind(*args, **kwargs).arguments
    except TypeError as exc:
        raise TypeError(f"GradScaler(): {exc}") from None
    runtime = {name: given.pop(name, _RUNTIME_DEFAULTS[name]) for name in ("enabled", *_RUNTIME)}
    device = given.pop("device", None)
    runtime["device"] = parse_device(device) if is_torch else None
    own, other = ("growth_interval", "steps_per_increase") if is_torch else ("steps_per_increase", "growth_interval")
    interval = _one_of(given.get(own), given.pop(other, None))
    if interval is not None:
        given[own] = interval
    given = {k: v for k, v in given.items() if v is not None or k in _NONE_MEANS_SOMETHING}
    make = ScalerSettings.torch if is_torch else ScalerSettings.cerebras
    return make(**given), runtime


# Arguments where an explicit None is a choice, not "the default": a gradient norm of None clips nothing; the
# Cerebras loss_scale None is "dynamic unless bfloat16". Every other None takes the dialect's default.
_NONE_MEANS_SOMETHING = ("max_gradient_norm", "loss_scale")


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
