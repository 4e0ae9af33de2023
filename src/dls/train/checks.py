"""Checks of single config values: each takes a key's path (``optimizer.momentum``) and the value read from YAML,
and returns ``(parsed value, problem)``: ``problem`` is ``None``, one message, or a list of them (a learning-rate
schedule can have several), every message naming the key and what is allowed.

The loss-scaling keys are not range-checked here: ``dls.settings.ScalerSettings`` judges them (see
``dls.train.config``), so the config accepts exactly what ``GradScaler`` accepts. Their checks only bring YAML
values into the types the scaler takes (``1e3`` → ``1000`` for integer keys).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

Problem = str | list[str] | None
Check = Callable[[str, Any], tuple[Any, Problem]]

INT64_MAX = 2**63 - 1
MAX_SEED = 2**32 - 1  # NumPy's seeds are 32-bit
SCHEDULERS = ("Constant", "Linear", "CosineDecay")
_SCHEDULE_KEYS = {
    "Constant": ("learning_rate", "total_iters"),
    "Linear": ("initial_learning_rate", "end_learning_rate", "total_iters"),
    "CosineDecay": ("initial_learning_rate", "end_learning_rate", "total_iters"),
}


def type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def integer(minimum: int, nullable: bool = False, maximum: int = INT64_MAX) -> Check:
    """An integer in ``[minimum, maximum]`` (an integral float such as ``1e3`` counts). Every integer key has a
    maximum: the counters and seeds they feed are fixed-width integers in torch and NumPy."""
    allowed = f">= {minimum}" if maximum == INT64_MAX else f"in [{minimum}, {maximum}]"

    def check(key: str, value: Any) -> tuple[Any, Problem]:
        if value is None and nullable:
            return None, None
        value = integral(key, value)[0]
        null = " or null" if nullable else ""
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            return None, f"{key} must be an integer {allowed}{null}; got {value!r} ({type_name(value)})"
        if value > maximum:
            return None, f"{key} must be an integer in [{minimum}, {maximum}]{null}; got {value!r}"
        return value, None

    return check


def number(
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    nullable: bool = False,
) -> Check:
    """A finite number in the given range, as a float."""

    def describe() -> str:
        if low is not None and high is not None:
            return f"a number in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        if low is not None:
            return f"a number {'>' if low_open else '>='} {low:g}"
        return "a number"

    def check(key: str, value: Any) -> tuple[Any, Problem]:
        if value is None and nullable:
            return None, None
        null = " or null" if nullable else ""
        if not _is_number(value) or not math.isfinite(value):
            return None, f"{key} must be {describe()}{null}; got {value!r} ({type_name(value)})"
        v = float(value)
        bad_low = low is not None and (v <= low if low_open else v < low)
        bad_high = high is not None and (v >= high if high_open else v > high)
        if bad_low or bad_high:
            return None, f"{key} must be {describe()}{null}; got {value!r}"
        return v, None

    return check


def boolean(key: str, value: Any) -> tuple[Any, Problem]:
    if not isinstance(value, bool):
        return None, f"{key} must be true or false; got {value!r} ({type_name(value)})"
    return value, None


def text(key: str, value: Any) -> tuple[Any, Problem]:
    if not isinstance(value, str) or not value:
        return None, f"{key} must be a non-empty string; got {value!r} ({type_name(value)})"
    return value, None


class choice:
    """One of ``choices`` (``case_insensitive``: any case, returned as spelled in ``choices``)."""

    def __init__(self, choices: Sequence[str], case_insensitive: bool = False) -> None:
        self.choices = tuple(choices)
        self.case_insensitive = case_insensitive

    def __call__(self, key: str, value: Any) -> tuple[Any, Problem]:
        if isinstance(value, str):
            for c in self.choices:
                if value == c or (self.case_insensitive and value.lower() == c.lower()):
                    return c, None
        return None, f"{key} must be one of {', '.join(repr(c) for c in self.choices)}; got {value!r}"


def as_given(key: str, value: Any) -> tuple[Any, Problem]:
    """A loss-scaling value, judged by the scaler's settings (``dls.settings``), not here."""
    return value, None


def integral(key: str, value: Any) -> tuple[Any, Problem]:
    """An integral float (YAML's ``1e3``) as the integer it is; anything else as given."""
    if isinstance(value, float) and value.is_integer():
        return int(value), None
    return value, None


def loss_scaling_factor(key: str, value: Any) -> tuple[Any, Problem]:
    """``'dynamic'`` (any case), null, or a number: the number's range is the scaler's to judge."""
    if value is None or value == "dynamic":
        return value, None
    if isinstance(value, str) and value.lower() == "dynamic":
        return "dynamic", None
    if _is_number(value):
        try:
            return float(value), None
        except OverflowError:  # an integer beyond float's range: the scaler says what is allowed
            return value, None
    return None, f"{key} must be 'dynamic', null (the precision's default) or a number (a static scale); got {value!r}"


def betas(key: str, value: Any) -> tuple[Any, Problem]:
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(_is_number(b) and 0 <= b < 1 for b in value):
        return (float(value[0]), float(value[1])), None
    return None, f"{key} must be a list of two numbers in [0, 1), e.g. [0.9, 0.999]; got {value!r}"


def learning_rate(key: str, value: Any) -> tuple[Any, Problem]:
    """A number, one scheduler dict, or a list of them (run one after another, as Model Zoo's sequential LR)."""
    if not isinstance(value, (dict, list)):
        parsed, err = number(0.0)(key, value)
        if err:
            return None, (
                f"{key} must be a number >= 0 or a schedule (a dict with 'scheduler': one of "
                f"{', '.join(repr(s) for s in SCHEDULERS)}, or a list of them); got {value!r}"
            )
        return parsed, None
    items = [value] if isinstance(value, dict) else value
    if not items:
        return None, f"{key} must not be an empty list"
    errors: list[str] = []
    schedule: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        path = key if isinstance(value, dict) else f"{key}[{i}]"
        if not isinstance(item, dict):
            errors.append(f"{path} must be a scheduler dict; got {item!r}")
            continue
        name, e = choice(SCHEDULERS, case_insensitive=True)(f"{path}.scheduler", item.get("scheduler"))
        if isinstance(e, str):
            errors.append(e)
            continue
        allowed = _SCHEDULE_KEYS[name]
        entry: dict[str, Any] = {"scheduler": name}
        for k, v in item.items():
            if k == "scheduler":
                continue
            if k not in allowed:
                errors.append(unknown_key(f"{path}.{k}", k, allowed))
                continue
            parsed, e = (integer(1) if k == "total_iters" else number(0.0))(f"{path}.{k}", v)
            if isinstance(e, str):
                errors.append(e)
            entry[k] = parsed
        # total_iters may be left out only by a Constant at the end (it then lasts to the end of training).
        last = i == len(items) - 1
        required = [k for k in allowed if k != "total_iters" or not (last and name == "Constant")]
        errors.extend(f"{path}.{k} is required for scheduler {name!r}" for k in required if k not in item)
        schedule.append(entry)
    return (tuple(schedule) if not errors else None), errors or None


def unknown_key(path: str, key: str, allowed: Iterable[str], hint: str | None = None) -> str:
    """The message for an unknown key: ``hint`` (the key other frameworks' name stands for), else the closest
    allowed name, then every allowed name."""
    allowed = list(allowed)
    if hint is None:
        close = difflib.get_close_matches(key, allowed, n=1)
        hint = repr(close[0]) if close else None
    return f"unknown key {path}{f' (did you mean {hint}?)' if hint else ''}; allowed keys: {', '.join(allowed)}"


def fp8_recipe(key: str, value: Any) -> tuple[Any, Problem]:
    """null (no FP8), or ``{recipe: current | delayed | mxfp8 | static, <the recipe's fields>}``: the fields of
    :mod:`dls.fp8`'s recipe classes, each judged by the recipe itself and reported under ``key.<field>``. Returns the
    recipe's :meth:`~dls.fp8.recipes.CurrentScaling.to_dict` (every field, defaults filled in)."""
    if value is None:
        return None, None
    from dls.fp8 import RECIPE_NAMES, recipe_from_dict

    names = ", ".join(repr(n) for n in RECIPE_NAMES)
    if not isinstance(value, dict):
        shape = f"{{recipe: {' | '.join(RECIPE_NAMES)}, <the recipe's fields>}}"
        return None, f"{key} must be null (no FP8) or a mapping {shape}; got {value!r} ({type_name(value)})"
    name = value.get("recipe")
    if name not in RECIPE_NAMES:
        got = "nothing" if "recipe" not in value else repr(name)
        return None, f"{key}.recipe must be one of {names}; got {got}"
    cls = RECIPE_NAMES[name]
    types = {f.name: f.type for f in dataclasses.fields(cls)}
    fields: dict[str, Any] = {}
    problems: list[str] = []
    for k, v in value.items():
        if k == "recipe":
            continue
        if not isinstance(k, str) or k not in types:
            problems.append(unknown_key(f"{key}.{k}", str(k), ["recipe", *types]))
            continue
        if types[k] == "int":
            v = integral(k, v)[0]
        try:
            cls(**{k: v})  # each field alone, so that each problem names its own key
        except ValueError as exc:
            message = str(exc)
            problems.append(f"{key}.{message}" if message.startswith(f"{k} ") else f"{key}.{k}: {message}")
            continue
        fields[k] = v
    if problems:
        return None, problems
    return recipe_from_dict({"recipe": name, **fields}).to_dict(), None
