"""The scaler's checkpoint format: what ``GradScaler.state_dict()`` writes and ``load_state_dict()`` accepts.

One dict serves both libraries. dls's own keys — ``loss_scale``, ``steps_since_rescale``,
``overflows_since_rescale``, ``num_skipped_steps``, ``hysteresis_hits`` (cstorch.amp's names) — and torch.amp's —
``scale``, ``_growth_tracker`` (the same two values again) and the three settings ``growth_factor``,
``backoff_factor``, ``growth_interval`` — so ``torch.amp.GradScaler.load_state_dict`` reads a dls checkpoint and
dls reads torch's. Loading applies torch's three settings, as torch does; ``min_loss_scale``, ``max_loss_scale``,
``overflow_tolerance`` and ``hysteresis`` stay the constructor's. Keys that appear twice must agree. Every value is
checked before anything changes; a problem is a ``ValueError`` naming the key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from dls.policy import scale_problem
from dls.settings import ScalerSettings, SettingsError

STATE_KEYS = ("loss_scale", "steps_since_rescale", "overflows_since_rescale", "num_skipped_steps", "hysteresis_hits")
TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
# torch's name → dls's, for the two values both write.
SAME_VALUE = {"scale": "loss_scale", "_growth_tracker": "steps_since_rescale"}
# torch's settings → ScalerSettings fields.
SETTINGS = {
    "growth_factor": "growth_factor",
    "backoff_factor": "backoff_factor",
    "growth_interval": "steps_per_increase",
}
# Largest value of each counter: steps_since_rescale is int32 (torch's growth tracker), the others int64.
COUNTER_MAX = {key: 2**63 - 1 for key in STATE_KEYS[1:]} | {"steps_since_rescale": 2**31 - 1}


def to_state_dict(values: dict[str, Any], settings: ScalerSettings) -> dict[str, Any]:
    """The checkpoint of a scaler whose state holds ``values`` (the ``STATE_KEYS``, as Python numbers)."""
    return {
        **{key: values[key] for key in STATE_KEYS},
        "scale": values["loss_scale"],
        "growth_factor": settings.growth_factor,
        "backoff_factor": settings.backoff_factor,
        "growth_interval": settings.steps_per_increase,
        "_growth_tracker": values["steps_since_rescale"],
    }


@dataclass(frozen=True)
class Loaded:
    """A validated checkpoint: ``values`` (the state keys present, ``loss_scale`` already within the bounds),
    ``settings`` (with torch's settings applied) and ``clamped`` (the scale as saved, when it was outside the
    bounds and had to be clamped; else ``None``)."""

    values: dict[str, float | int]
    settings: ScalerSettings
    clamped: float | None


def parse_state_dict(state_dict: Any, settings: ScalerSettings) -> Loaded:
    """Check a dls or torch.amp state dict against ``settings`` without changing anything."""
    if not isinstance(state_dict, dict):
        raise ValueError(f"state_dict must be a dict; got {type(state_dict).__name__}")
    if not state_dict:
        raise RuntimeError("The source state dict is empty, possibly because it was saved from a disabled GradScaler.")
    allowed = (*STATE_KEYS, *TORCH_KEYS)
    unknown = sorted(str(k) for k in state_dict if k not in allowed)
    if unknown:
        raise ValueError(f"state_dict has unknown keys {unknown}; allowed keys: {', '.join(allowed)}")
    numbers = {key: _number(key, value) for key, value in state_dict.items()}
    for theirs, ours in SAME_VALUE.items():
        if theirs in numbers and ours in numbers and numbers[theirs] != numbers[ours]:
            raise ValueError(
                f"state_dict[{theirs!r}] ({numbers[theirs]!r}) and state_dict[{ours!r}] ({numbers[ours]!r}) hold the "
                "same value and must agree"
            )
        if theirs in numbers:
            numbers[ours] = numbers.pop(theirs)
    changes = {field: numbers.pop(key) for key, field in SETTINGS.items() if key in numbers}
    try:
        settings = settings.replace(
            **{k: int(v) if k == "steps_per_increase" and _integral(v) else v for k, v in changes.items()}
        )
    except SettingsError as exc:
        key = {field: key for key, field in SETTINGS.items()}.get(exc.problems[0][0], exc.problems[0][0])
        raise ValueError(f"state_dict[{key!r}]: {exc.problems[0][1]}") from None
    values: dict[str, float | int] = {}
    clamped = None
    for key, number in numbers.items():
        if key == "loss_scale":
            if not (_finite(number) and number > 0):
                raise ValueError(f"state_dict['loss_scale'] must be a positive finite number; got {number!r}")
            scale = float(number)
            if settings.mode == "dynamic":  # a scale from elsewhere is brought into this scaler's bounds
                bounded = min(max(scale, settings.min_loss_scale), settings.max_loss_scale)
                clamped = scale if bounded != scale else None
                scale = bounded
            elif problem := scale_problem("state_dict['loss_scale']", scale):
                raise ValueError(problem)
            values[key] = scale
        else:
            if not (_integral(number) and 0 <= number <= COUNTER_MAX[key]):
                limit = "2**31 - 1" if COUNTER_MAX[key] < 2**32 else "2**63 - 1"
                raise ValueError(f"state_dict[{key!r}] must be an integer from 0 to {limit}; got {number!r}")
            values[key] = int(number)
    return Loaded(values, settings, clamped)


def _finite(number: float) -> bool:
    return (isinstance(number, int) and abs(number) < 2**1000) or (isinstance(number, float) and math.isfinite(number))


def _integral(number: float) -> bool:
    return isinstance(number, int) or (isinstance(number, float) and number.is_integer())


def _number(key: str, value: Any) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"state_dict[{key!r}] must be a number; got a tensor of shape {tuple(value.shape)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"state_dict[{key!r}] must be a number; got {value!r}")
    return value
