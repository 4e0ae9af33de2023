"""The scaler's checkpoint format: what ``GradScaler.state_dict()`` writes and ``load_state_dict()`` accepts.

One dict serves both libraries. dls's own keys — ``loss_scale``, ``steps_since_rescale``,
``overflows_since_rescale``, ``num_skipped_steps`` (cstorch.amp's names), ``hysteresis_tracker`` (Megatron-LM's: the
hysteresis budget left) and ``format_version`` — and torch.amp's — ``scale``, ``_growth_tracker`` (the same two
values again) and the three settings ``growth_factor``, ``backoff_factor``, ``growth_interval`` — so
``torch.amp.GradScaler.load_state_dict`` reads a dls checkpoint and follows the same trajectory to the next growth
(a Cerebras- or DeepSpeed-dialect scaler writes ``growth_interval = steps_per_increase + 1``, see ``dls.policy``),
and dls reads torch's. Loading applies torch's three settings, as torch does; the other settings stay the
constructor's. Keys that appear twice must agree. Every value is checked before anything changes; a problem is a
``ValueError`` naming the key, an unknown key is named with the closest known one.

The peers' states load as they save them:

* Megatron-LM's ``DynamicGradScaler.state_dict()``: ``scale`` (a 1-element tensor), ``growth_tracker`` (torch's
  ``_growth_tracker`` under Megatron's name) and ``hysteresis_tracker``, which Megatron lowers without a floor
  (``-= 1`` at every overflow): a tracker of 0 or below means "back off at the next overflow", the budget 1.
* DeepSpeed's ``DynamicLossScaler``, as the dict of its attributes (``vars(loss_scaler)``): ``cur_scale``,
  ``cur_iter`` and ``last_overflow_iter`` (given together), ``cur_hysteresis``, and the settings it holds
  (``scale_factor``, ``scale_window``, ``min_scale``, ``delayed_shift``, ``consecutive_hysteresis``, ``dynamic``),
  which must be this scaler's; ``raise_error_at_min_scale`` and ``dtype`` are read and not used. Only a
  DeepSpeed-dialect scaler (``GradScaler.from_deepspeed``) takes it: its ``steps_since_rescale`` is DeepSpeed's
  ``cur_iter - last_overflow_iter - 1`` taken modulo the window into ``1..loss_scale_window`` once positive, so the
  run goes on where DeepSpeed left it. Back to DeepSpeed: ``last_overflow_iter = cur_iter - 1 -
  steps_since_rescale``.

``hysteresis_tracker`` is brought into ``[1, hysteresis]``. ``steps_since_rescale`` and ``overflows_since_rescale``
load as saved (torch's own tests read a seeded tracker back) and are clamped to ``growth_interval - 1`` at the next
update, before the rule runs: the next clean update grows, and no counter wraps. Every state dict a scaler writes
loads back unchanged.

Format 2 (this one) replaced format 1's ``hysteresis_hits`` (hits since the last back-off; loaded as
``hysteresis_tracker = hysteresis - hits``). An older dls refuses format 2 by its unknown keys; this one refuses a
newer ``format_version``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import torch

from dls.checks import INT32_MAX, INT64_MAX, SHOWN_AT_MOST, did_you_mean, listed, python_number, scale_problem, shown
from dls.policy import ScaleState
from dls.settings import ScalerSettings, SettingsError, interval_name

FORMAT_VERSION = 2
# The dynamic and static rules' state under its own names (non_clamped_scale is the scale as loaded, not saved).
STATE_KEYS = tuple(name for name in ScaleState._fields if name != "non_clamped_scale")
TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
OLD_KEYS = ("hysteresis_hits",)  # format 1
MEGATRON_KEYS = ("growth_tracker",)  # besides scale and hysteresis_tracker, which torch and dls write too
# torch's and Megatron's names → dls's, for the values written under several names.
SAME_VALUE = {"scale": "loss_scale", "_growth_tracker": "steps_since_rescale", "growth_tracker": "steps_since_rescale"}
# DeepSpeed's DynamicLossScaler attributes: its state, the settings it holds (this scaler's, by DeepSpeed's name),
# and attributes read but not used.
DEEPSPEED_STATE = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
DEEPSPEED_SETTINGS = ("scale_factor", "scale_window", "min_scale", "delayed_shift", "consecutive_hysteresis", "dynamic")
DEEPSPEED_UNUSED = ("raise_error_at_min_scale", "dtype")
DEEPSPEED_KEYS = (*DEEPSPEED_STATE, *DEEPSPEED_SETTINGS, *DEEPSPEED_UNUSED)
# Smallest value of each counter as loaded (0 unless listed): Megatron's tracker has no floor; MXNet's decided
# rescale is -1, 0 or +1.
COUNTER_MIN = {"hysteresis_tracker": -INT64_MAX - 1, "next_rescale": -1}
# Largest value of each counter as stored: steps_since_rescale is int32 (torch's growth tracker), the others int64.
COUNTER_MAX = {
    "steps_since_rescale": INT32_MAX,
    "overflows_since_rescale": INT64_MAX,
    "num_skipped_steps": INT64_MAX,
    "hysteresis_tracker": INT32_MAX,
    "hysteresis_hits": INT32_MAX,
    "iterations_since_rescale": INT64_MAX,  # fairseq's
    "next_rescale": 1,  # MXNet's
}


def state_keys(settings: ScalerSettings) -> tuple[str, ...]:
    """The keys of the rule's own state in a state dict: the fields of its state (``dls.policy``), but the
    non-clamped scale, which loads as the scale."""
    return tuple(name for name in settings.rule().State._fields if name != "non_clamped_scale")


def to_state_dict(values: dict[str, Any], settings: ScalerSettings) -> dict[str, Any]:
    """The checkpoint of a scaler whose state holds ``values`` (``state_keys``, as Python numbers)."""
    out = {
        **values,
        "format_version": FORMAT_VERSION,
        "scale": values["loss_scale"],
        "growth_factor": settings.growth_factor,
        "backoff_factor": settings.backoff_factor,
        "growth_interval": settings.growth_interval,
    }
    if "steps_since_rescale" in values:  # torch's growth tracker
        out["_growth_tracker"] = values["steps_since_rescale"]
    return out


@dataclass(frozen=True)
class Loaded:
    """A validated checkpoint: ``values`` (the state keys present, ``loss_scale`` already within the bounds),
    ``settings`` (with torch's settings applied) and ``clamped`` (the scale as saved, when it was outside the
    bounds and had to be clamped; else ``None``)."""

    values: dict[str, float | int]
    settings: ScalerSettings
    clamped: float | None
    extra: dict[str, Any] = field(default_factory=dict)


def parse_state_dict(
    state_dict: Any,
    settings: ScalerSettings,
    *,
    apply_settings: bool = True,
    label: Callable[[str], str] = lambda key: f"state_dict[{key!r}]",
    extra: Collection[str] = (),
    own_names_first: bool = False,
) -> Loaded:
    """Check a dls (format 1 or 2) or torch.amp state dict against ``settings`` without changing anything.

    ``apply_settings=False``: torch's three settings keys are ignored and ``settings`` stay as given (the trainer's
    config defines them). ``label(key)`` names a key in error messages. ``extra``: keys registered with
    ``GradScaler.register_state`` (state of other objects kept in the scaler's checkpoint), returned unchecked in
    ``Loaded.extra`` for their owners to check and load. ``own_names_first``: torch's ``scale`` and
    ``_growth_tracker`` are read only where dls's names are absent (the trainer's rule), instead of having to agree."""
    if not isinstance(state_dict, dict):
        raise ValueError(f"state_dict must be a dict; got {type(state_dict).__name__}")
    if not state_dict:
        raise RuntimeError("The source state dict is empty, possibly because it was saved from a disabled GradScaler.")
    own = (*state_keys(settings), "format_version", *TORCH_KEYS, *OLD_KEYS, *MEGATRON_KEYS, *extra)
    state_dict = _from_saved(state_dict, settings, label, own)
    if not apply_settings:
        state_dict = {
            k: v for k, v in state_dict.items() if k not in ("growth_factor", "backoff_factor", "growth_interval")
        }
    extras = {key: state_dict[key] for key in extra if key in state_dict}
    numbers = {key: _number(key, value, label) for key, value in state_dict.items() if key not in extras}
    version = numbers.pop("format_version", 1)
    if not (_integral(version) and version >= 1):
        raise ValueError(
            f"{label('format_version')} must be an integer from 1 to {FORMAT_VERSION}; got {shown(version)}"
        )
    if version > FORMAT_VERSION:
        raise ValueError(
            f"{label('format_version')} is {version!r}: written by a newer dls; this dls reads formats 1 to "
            f"{FORMAT_VERSION} (upgrade dls to load it)"
        )
    if "hysteresis_hits" in numbers and "hysteresis_tracker" in numbers:
        raise ValueError("state_dict has both 'hysteresis_hits' (format 1) and 'hysteresis_tracker'; give one")
    # Each value on its own first, so that a value no scaler could hold is named as such, not as a disagreement.
    for key, number in numbers.items():
        ours = SAME_VALUE.get(key, key)
        if ours == "loss_scale":
            _check_scale(label(key), number)
        elif ours in COUNTER_MAX:
            _check_counter(key, ours, number, label)
    for theirs, ours in SAME_VALUE.items():
        if own_names_first and ours in numbers:
            numbers.pop(theirs, None)
        if theirs in numbers and ours in numbers and numbers[theirs] != numbers[ours]:
            raise ValueError(
                f"{label(theirs)} ({numbers[theirs]!r}) and {label(ours)} ({numbers[ours]!r}) hold the "
                "same value and must agree"
            )
        if theirs in numbers:
            numbers[ours] = numbers.pop(theirs)
    settings = _with_torch_settings(settings, numbers, label)
    values: dict[str, float | int] = {}
    clamped = None
    for key, number in numbers.items():
        if key == "loss_scale":
            values[key], clamped = _scale(number, settings, label)
        else:
            values[key] = int(number)
    if "hysteresis_hits" in values:
        values["hysteresis_tracker"] = settings.hysteresis - int(values.pop("hysteresis_hits"))
    if "hysteresis_tracker" in values:
        values["hysteresis_tracker"] = min(max(int(values["hysteresis_tracker"]), 1), settings.hysteresis)
    return Loaded(values, settings, clamped, extras)


def _from_saved(
    state_dict: dict[Any, Any], settings: ScalerSettings, label: Callable[[str], str], own: tuple[str, ...]
) -> dict[str, Any]:
    """``state_dict`` with a peer's own saved state (``SAVED_FORMATS``) read into dls's keys; unknown keys refused.
    The scaler's own peer's format is tried first: Apex fp16_utils' attributes are a subset of DeepSpeed's names."""
    _check_keys(state_dict, (*own, *(key for keys, _ in SAVED_FORMATS.values() for key in keys)))
    for _, (keys, read) in sorted(SAVED_FORMATS.items(), key=lambda item: item[0] != settings.dialect):
        if any(key in keys for key in state_dict):
            return read(state_dict, settings, label, own)
    return state_dict


def _check_keys(state_dict: dict[Any, Any], allowed: tuple[str, ...]) -> None:
    unknown = sorted(str(k) for k in state_dict if k not in allowed)
    if unknown:
        hints = [f"{shown(key)}{hint}" for key in unknown[:SHOWN_AT_MOST] if (hint := did_you_mean(key, allowed))]
        said = f"; {', '.join(hints)}" if hints else ""
        raise ValueError(f"state_dict has unknown keys [{listed(unknown)}]{said}; allowed keys: {', '.join(allowed)}")


def _check_counter(key: str, ours: str, number: float, label: Callable[[str], str]) -> None:
    low, high = COUNTER_MIN.get(ours, 0), COUNTER_MAX[ours]
    if not (_integral(number) and low <= number <= high):
        lowest = "-2**63" if low else "0"
        limit = "2**31 - 1" if high == INT32_MAX else "2**63 - 1"
        raise ValueError(f"{label(key)} must be an integer from {lowest} to {limit}; got {shown(number)}")


def _from_deepspeed(
    state_dict: dict[str, Any], settings: ScalerSettings, label: Callable[[str], str], own: tuple[str, ...]
) -> dict[str, Any]:
    """DeepSpeed's ``DynamicLossScaler`` attributes as dls's keys (module docstring), after checking that the
    settings it holds are ``settings``."""
    mixed = sorted(key for key in state_dict if key in own)
    if mixed:
        raise ValueError(
            f"state_dict mixes DeepSpeed's loss scaler attributes with dls's or torch's keys {mixed}: give one or "
            "the other"
        )
    if settings.dialect != "deepspeed":
        raise ValueError(
            "state_dict holds DeepSpeed's loss scaler attributes, which only a scaler built with "
            f"GradScaler.from_deepspeed(...) can continue (this one speaks the {settings.dialect} dialect); to carry "
            "the scale alone, load {'loss_scale': cur_scale}"
        )
    dynamic = settings.mode == "dynamic"
    expected = {
        "scale_factor": 2.0,
        "scale_window": settings.steps_per_increase,
        "min_scale": settings.min_loss_scale,
        "delayed_shift": settings.hysteresis,
        "consecutive_hysteresis": settings.consecutive_hysteresis,
        "dynamic": dynamic,
    }
    names = {"scale_window": interval_name("deepspeed"), "min_scale": "min_loss_scale", "delayed_shift": "hysteresis"}
    for key, want in expected.items():
        if key not in state_dict:
            continue
        value = state_dict[key]
        if isinstance(want, bool):
            same = isinstance(value, bool) and value == want
        else:
            number = python_number(value)
            same = number is not None and number == want
        if not same:
            raise ValueError(
                f"{label(key)} is {value!r}, this scaler's {names.get(key, key)} is {want!r}: build the scaler from "
                "the run's fp16 config (GradScaler.from_deepspeed)"
            )
    out: dict[str, Any] = {}
    if "cur_scale" in state_dict:  # checked here, to be named as given
        out["loss_scale"] = _positive_scale("cur_scale", state_dict["cur_scale"], label)
    if "cur_hysteresis" in state_dict:
        out["hysteresis_tracker"] = budget = _number("cur_hysteresis", state_dict["cur_hysteresis"], label)
        _check_counter("cur_hysteresis", "hysteresis_tracker", budget, label)
    given = [key for key in ("cur_iter", "last_overflow_iter") if key in state_dict]
    if len(given) == 1:
        missing = "last_overflow_iter" if given[0] == "cur_iter" else "cur_iter"
        raise ValueError(
            f"state_dict has {given[0]!r} without {missing!r}: give both (DeepSpeed counts the clean steps since the "
            "last overflow from their difference)"
        )
    if given:
        cur, last = (_number(key, state_dict[key], label) for key in ("cur_iter", "last_overflow_iter"))
        for key, number in (("cur_iter", cur), ("last_overflow_iter", last)):
            if not (_integral(number) and -1 <= number < 2**63):
                raise ValueError(f"{label(key)} must be an integer from -1 to 2**63 - 1; got {shown(number)}")
        if dynamic:
            clean = int(cur) - int(last) - 1  # DeepSpeed's stable_interval at the next update
            if clean < 0:
                raise ValueError(
                    f"{label('last_overflow_iter')} ({last!r}) must be below {label('cur_iter')} ({cur!r})"
                )
            window = settings.steps_per_increase
            out["steps_since_rescale"] = 0 if clean == 0 else (clean - 1) % window + 1
    return out


def _only_for(settings: ScalerSettings, dialect: str, what: str) -> None:
    """A peer's counters mean what they mean under its own rule: only a scaler of ``dialect`` continues them."""
    if settings.dialect != dialect:
        raise ValueError(
            f"state_dict holds {what}, which only a scaler built with GradScaler.like({dialect!r}, ...) can continue "
            f"(this one speaks the {settings.dialect} dialect); to carry the scale alone, load {{'loss_scale': ...}}"
        )


def _only_keys(state_dict: dict[str, Any], allowed: tuple[str, ...], what: str) -> None:
    other = sorted(str(key) for key in state_dict if key not in allowed)
    if other:
        raise ValueError(
            f"state_dict mixes {what} ({', '.join(allowed)}) with other keys {other}: give one or the other"
        )


def _plain_number(key: str, value: Any, label: Callable[[str], str]) -> float:
    """A number a peer saved: a Python or NumPy number, a 1-element tensor, or an array of another library with
    shape ``()`` and ``item()`` (a jax or Keras value)."""
    if not isinstance(value, torch.Tensor) and getattr(value, "shape", None) == () and hasattr(value, "item"):
        value = value.item()
    return _number(key, value, label)


def _counter(key: str, value: Any, label: Callable[[str], str], ours: str = "steps_since_rescale") -> int:
    number = _plain_number(key, value, label)
    _check_counter(key, ours, number, label)
    return int(number)


def _positive_scale(key: str, value: Any, label: Callable[[str], str]) -> float:
    """A peer's saved scale, as every scale: a normal float32 (``dls.checks.scale_problem``), named as given."""
    scale = _plain_number(key, value, label)
    _check_scale(label(key), scale)
    return scale


APEX_KEYS = ("loss_scale", "unskipped")


def _from_apex(
    state_dict: dict[str, Any], settings: ScalerSettings, label: Callable[[str], str], own: tuple[str, ...]
) -> dict[str, Any]:
    """Apex amp's loss scaler state as ``amp.state_dict()`` saves it (``{'loss_scaler0': {'loss_scale': ...,
    'unskipped': ...}}``, apex/amp/frontend.py:365-374 at tag 25.05) or that inner dict: its ``unskipped`` is the
    count of clean steps towards growth (``steps_since_rescale``)."""
    if "loss_scaler0" in state_dict:
        _only_keys(state_dict, ("loss_scaler0",), "amp.state_dict()'s loss scaler entry")
        inner = state_dict["loss_scaler0"]
        if not isinstance(inner, dict):
            raise ValueError(
                f"{label('loss_scaler0')} must be a dict of 'loss_scale' and 'unskipped'; got {shown(inner)}"
            )
        state_dict = inner

        def label(key: str) -> str:
            return f"state_dict['loss_scaler0'][{key!r}]"

    _only_keys(state_dict, APEX_KEYS, "Apex amp's loss scaler state")
    _only_for(settings, "apex", "Apex amp's loss scaler state ('unskipped')")
    out: dict[str, Any] = {}
    if "loss_scale" in state_dict:
        out["loss_scale"] = _positive_scale("loss_scale", state_dict["loss_scale"], label)
    if "unskipped" in state_dict:
        out["steps_since_rescale"] = _counter("unskipped", state_dict["unskipped"], label)
    return out


APEX_FP16_UTILS_KEYS = ("cur_scale", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window")


def _from_apex_fp16_utils(
    state_dict: dict[str, Any], settings: ScalerSettings, label: Callable[[str], str], own: tuple[str, ...]
) -> dict[str, Any]:
    """Apex fp16_utils' ``DynamicLossScaler`` as the dict of its attributes (``vars(loss_scaler)``): it grows when
    ``(cur_iter - last_overflow_iter) % scale_window == 0``, so ``steps_since_rescale`` is ``(cur_iter -
    last_overflow_iter - 1) % scale_window``; the settings it holds must be this scaler's."""
    _only_keys(state_dict, APEX_FP16_UTILS_KEYS, "Apex fp16_utils' DynamicLossScaler attributes")
    for key, want in (("scale_factor", settings.growth_factor), ("scale_window", settings.steps_per_increase)):
        if key in state_dict and python_number(state_dict[key]) != want:
            raise ValueError(
                f"{label(key)} is {state_dict[key]!r}, this scaler's {key} is {want!r}: build the scaler with "
                "GradScaler.like('apex_fp16_utils', ...) as the run's DynamicLossScaler was"
            )
    out: dict[str, Any] = {}
    if "cur_scale" in state_dict:
        out["loss_scale"] = _positive_scale("cur_scale", state_dict["cur_scale"], label)
    given = [key for key in ("cur_iter", "last_overflow_iter") if key in state_dict]
    if len(given) == 1:
        raise ValueError(f"state_dict has {given[0]!r} alone: give cur_iter and last_overflow_iter together")
    if given:
        cur, last = (_plain_number(key, state_dict[key], label) for key in ("cur_iter", "last_overflow_iter"))
        for key, number in (("cur_iter", cur), ("last_overflow_iter", last)):
            if not (_integral(number) and -1 <= number < 2**63):
                raise ValueError(f"{label(key)} must be an integer from -1 to 2**63 - 1; got {shown(number)}")
        if last >= cur:
            raise ValueError(f"{label('last_overflow_iter')} ({last!r}) must be below {label('cur_iter')} ({cur!r})")
        out["steps_since_rescale"] = (int(cur) - int(last) - 1) % settings.steps_per_increase
    return out


COLOSSALAI_KEYS = ("hysteresis",)  # with torch's names scale, growth_factor, backoff_factor


def _from_colossalai(
    state_dict: dict[str, Any], settings: ScalerSettings, label: Callable[[str], str], own: tuple[str, ...]
) -> dict[str, Any]:
    """ColossalAI's ``DynamicGradScaler.state_dict()``: ``scale`` (a 1-element float32 tensor), ``growth_factor``,
    ``backoff_factor`` and ``hysteresis`` (no counters: they start afresh, as in ColossalAI's ``load_state_dict``).
    The factors apply, as there (rounded to float32, as it holds them); the hysteresis must be this scaler's."""
    _only_keys(state_dict, ("scale", "growth_factor", "backoff_factor", "hysteresis"), "ColossalAI's state_dict")
    _only_for(settings, "colossalai", "ColossalAI's DynamicGradScaler state ('hysteresis')")
    given = _plain_number("hysteresis", state_dict["hysteresis"], label)
    if not (_integral(given) and given >= 0):
        raise ValueError(f"{label('hysteresis')} must be an integer from 0 (which acts as 1); got {shown(given)}")
    if max(int(given), 1) != settings.hysteresis:
        raise ValueError(
            f"{label('hysteresis')} is {given!r}, this scaler's hysteresis is {settings.hysteresis!r}: build the "
            "scaler with GradScaler.like('colossalai', hysteresis=...) as the run's DynamicGradScaler was"
        )
    out: dict[str, Any] = {}
    if "scale" in state_dict:
        out["loss_scale"] = _positive_scale("scale", state_dict["scale"], label)
    for key in ("growth_factor", "backoff_factor"):
        if key in state_dict:
            factor = _plain_number(key, state_dict[key], label)
            out[key] = float(torch.tensor(float(factor), dtype=torch.float32)) if _finite(factor) else factor
    return out


JMP_KEYS = ("counter",)  # with loss_scale


def _from_jmp(
    state_dict: dict[str, Any], settings: ScalerSettings, label: Callable[[str], str], own: tuple[str, ...]
) -> dict[str, Any]:
    """jmp's ``DynamicLossScale`` as its pytree leaves: ``loss_scale`` and ``counter`` (jax arrays or numbers; jmp
    saves nothing else: its ``min_loss_scale`` is not a leaf). ``counter`` counts towards the next growth, which
    comes when it is ``period - 1``: it must be below ``period``."""
    _only_keys(state_dict, ("loss_scale", "counter"), "jmp's DynamicLossScale leaves")
    _only_for(settings, "jmp", "jmp's DynamicLossScale counter")
    out: dict[str, Any] = {}
    if "loss_scale" in state_dict:
        out["loss_scale"] = _positive_scale("loss_scale", state_dict["loss_scale"], label)
    if "counter" in state_dict:
        counter = _counter("counter", state_dict["counter"], label)
        if counter >= settings.steps_per_increase:
            raise ValueError(
                f"{label('counter')} must be below this scaler's period ({settings.steps_per_increase}); got {counter}"
            )
        out["steps_since_rescale"] = counter
    return out


KERAS_KEYS = ("dynamic_scale", "step_counter")


def _from_keras(
    state_dict: dict[str, Any], settings: ScalerSettings, label: Callable[[str], str], own: tuple[str, ...]
) -> dict[str, Any]:
    """Keras' ``LossScaleOptimizer`` variables ``dynamic_scale`` and ``step_counter`` (their values: NumPy or
    backend scalars), as its saved optimizer variables hold them."""
    _only_keys(state_dict, KERAS_KEYS, "Keras' LossScaleOptimizer variables")
    _only_for(settings, "keras", "Keras' LossScaleOptimizer variables")
    out: dict[str, Any] = {}
    if "dynamic_scale" in state_dict:
        out["loss_scale"] = _positive_scale("dynamic_scale", state_dict["dynamic_scale"], label)
    if "step_counter" in state_dict:
        out["steps_since_rescale"] = _counter("step_counter", state_dict["step_counter"], label)
    return out


# The peers' own saved states, read as they save them: the keys that tell each apart, and its reader into dls's keys
# (checked against the scaler's settings, named as given). Megatron-LM's is dls's under other names (SAME_VALUE);
# fairseq saves its scale alone, as dls's loss_scale (FP16Optimizer.state_dict()["loss_scale"]); MXNet saves nothing.
SAVED_FORMATS: dict[str, tuple[tuple[str, ...], Callable[..., dict[str, Any]]]] = {
    "deepspeed": (DEEPSPEED_KEYS, _from_deepspeed),
    "apex": (("unskipped", "loss_scaler0"), _from_apex),
    "apex_fp16_utils": (APEX_FP16_UTILS_KEYS, _from_apex_fp16_utils),
    "colossalai": (COLOSSALAI_KEYS, _from_colossalai),
    "jmp": (JMP_KEYS, _from_jmp),
    "keras": (KERAS_KEYS, _from_keras),
}


def _with_torch_settings(
    settings: ScalerSettings, numbers: dict[str, float], label: Callable[[str], str]
) -> ScalerSettings:
    """``settings`` with torch's three settings of the state dict applied (popped from ``numbers``)."""
    changes: dict[str, Any] = {}
    for key in ("growth_factor", "backoff_factor"):
        if key in numbers:
            changes[key] = numbers.pop(key)
    if "growth_interval" in numbers:
        interval = numbers.pop("growth_interval")
        offset = settings.growth_offset
        if offset and settings.mode != "dynamic" and interval == 1:
            interval = 2  # torch's interval 1 has no equivalent with an offset; a fixed scale never grows anyway
        # An int, as the constructor's (dls.checks.count_problem): torch stores 10.0 and fails at its next update.
        if not (isinstance(interval, int) and 1 + offset <= interval <= INT32_MAX):
            low = (
                f"2 (a {settings.dialect}-dialect scaler grows after {interval_name(settings.dialect)} + 1 updates)"
                if offset
                else "1"
            )
            raise ValueError(
                f"{label('growth_interval')} must be an integer from {low} to 2**31 - 1 (a count: an int, not a "
                f"float such as 10.0, as the constructor's growth_interval); got {shown(interval)}"
            )
        changes["steps_per_increase"] = int(interval) - offset
    try:
        return settings.replace(**changes)
    except SettingsError as exc:
        field = exc.problems[0][0]
        key = "growth_interval" if field == "steps_per_increase" else field
        raise ValueError(f"{label(key)}: {exc.problems[0][1]}") from None


def _scale(number: float, settings: ScalerSettings, label: Callable[[str], str]) -> tuple[float, float | None]:
    """The loaded scale, brought into a dynamic scaler's bounds, and the saved value when it had to be.

    The rule (the guarantees page's): a scale no scaler can hold — not a normal float32 — is a ``ValueError``
    naming the key, the value and the range, as the constructor's ``init_scale``; a normal float32 outside this
    dynamic scaler's ``[min_loss_scale, max_loss_scale]`` is clamped into them, as the constructor clamps
    ``init_scale`` to ``max_loss_scale``, and the caller says so (a warning; the trainer's log). Clamping, not
    refusing: those bounds are this scaler's settings, not a property of the saved value, and torch.amp's own state
    (its scale starts at 2**16 and has no bound) must load into a scaler with a lower ``max_loss_scale``."""
    _check_scale(label("loss_scale"), number)
    scale = float(number)
    if settings.mode == "dynamic":  # a scale from elsewhere is brought into this scaler's bounds
        bounded = min(max(scale, settings.min_loss_scale), settings.max_loss_scale)
        return bounded, (scale if bounded != scale else None)
    return scale, None


def _check_scale(name: str, number: float) -> None:
    """A loaded scale is a normal float32, as every scale a scaler holds (``dls.checks.scale_problem``)."""
    if not (_finite(number) and number > 0):
        raise ValueError(f"{name} must be a positive finite number; got {shown(number)}")
    if problem := scale_problem(name, number):
        raise ValueError(problem)


def _finite(number: float) -> bool:
    return (isinstance(number, int) and abs(number) < 2**1000) or (isinstance(number, float) and math.isfinite(number))


def _integral(number: float) -> bool:
    return isinstance(number, int) or (isinstance(number, float) and number.is_integer())


def _number(key: str, value: Any, label: Callable[[str], str]) -> float:
    """A number of a state dict: a ``numbers.Real`` (``dls.checks.python_number``: Python's, NumPy's, a
    ``Fraction``) or a 1-element real tensor (Megatron saves its scale as one) on a real device; ``ValueError``
    naming ``key`` for anything else, a meta tensor included (its value is unknown)."""
    if isinstance(value, torch.Tensor):
        bad = (
            "on the meta device (it holds no value)"
            if value.is_meta
            else f"of layout {value.layout}"
            if value.layout != torch.strided
            else f"of dtype {value.dtype} (a bool is not a number)"
            if value.dtype == torch.bool
            else f"of dtype {value.dtype}"
            if value.is_complex() or value.is_quantized
            else f"of shape {tuple(value.shape)}"
            if value.numel() != 1
            else None
        )
        if bad is not None:
            raise ValueError(f"{label(key)} must be a number or a 1-element real tensor; got a tensor {bad}")
        value = value.detach().reshape(())
    number = python_number(value)
    if number is None:
        raise ValueError(f"{label(key)} must be a number; got {shown(value)}")
    return number
