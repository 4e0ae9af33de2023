"""What a value may be: the numeric limits of the scaler and the validators that name the argument.

Each validator returns ``None`` when ``value`` is allowed, else one message that names the argument and says what is
allowed, so that every caller (the scaler's arguments, ``dls.settings``, the rules, the trainer's YAML config, the
diagnostics) refuses a bad value with the same words before anything changes.

What counts as what (``python_number``, ``python_flag``), decided against what ``torch.amp.GradScaler`` takes:

* a *number* is any ``numbers.Real`` — a Python ``int`` or ``float``, a ``fractions.Fraction``, a NumPy integer or
  floating scalar or 0-dim array — or a 0-dim real tensor; an integer (``numbers.Integral``: ``operator.index``
  gives it) stays an ``int``, anything else becomes the nearest ``float``. torch takes NumPy's numbers and 0-dim
  tensors; it takes a ``Fraction`` in its constructor and then fails with a ``TypeError`` at the first ``scale`` or
  ``update``: dls takes it as the real number it is. ``decimal.Decimal`` and ``complex`` are not ``numbers.Real``
  and are refused;
* a *count* (a growth interval, a hysteresis) is a number that is integral by type — ``Fraction(3)`` and ``3.0``
  are not, as torch's ``_amp_update_scale_`` refuses them;
* a *flag* is ``True`` or ``False``, Python's or NumPy's (``numpy.bool_``, which torch takes for ``enabled``). torch
  takes any truthy value there (``enabled=1``); dls does not: a number is not a flag;
* a bool is never a number, NumPy's and torch's neither (``init_scale=True`` is refused, where torch takes it as 1).
"""

from __future__ import annotations

import difflib
import math
import numbers
import operator
from collections.abc import Iterable

import torch

FLOAT32_MAX = torch.finfo(torch.float32).max
FLOAT32_TINY = torch.finfo(torch.float32).tiny  # 2**-126, the smallest normal float32
INT32_MAX = 2**31 - 1  # steps_since_rescale is int32, as torch's growth tracker
INT64_MAX = 2**63 - 1


def shown(value: object) -> str:
    """``value`` for an error message: a tensor by its dtype and shape, anything else by its ``repr``, cut short
    (a 400-digit integer or a long list would bury the message)."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}... ({len(text)} characters)"


def python_number(value: object) -> int | float | None:
    """The Python ``int`` or ``float`` that ``value`` stands for (the module docstring): a ``numbers.Real`` (an
    integer as an ``int``, any other as the nearest ``float``), a NumPy scalar or 0-dim array, or a 0-dim tensor of
    a real dtype; ``None`` for anything else, and for a real number beyond float's range. A bool is a flag, never a
    number, and so are NumPy's and torch's bools."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.dtype == torch.bool or value.is_complex() or value.is_meta:
            return None
        value = value.item()
    elif type(value).__module__ == "numpy" and getattr(value, "shape", None) == ():
        value = value.item()  # type: ignore[attr-defined]  # NumPy scalars and 0-dim arrays: a Python number
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    if isinstance(value, numbers.Integral):
        return operator.index(value)
    if isinstance(value, float):
        return value
    try:
        return float(value)  # a Fraction: the nearest float
    except (OverflowError, ValueError, TypeError):
        return None


def python_flag(value: object) -> bool | None:
    """``value`` as a Python bool when it is ``True`` or ``False``, Python's or NumPy's; ``None`` for anything else
    (a number is not a flag)."""
    if isinstance(value, bool):
        return value
    if type(value).__module__ == "numpy" and type(value).__name__ == "bool" and getattr(value, "shape", None) == ():
        return bool(value)
    return None


def _real(value: object) -> float | None:
    """``value`` as a float when it is a real number (``python_number``) that a float can hold, else ``None``."""
    number = python_number(value)
    if number is None:
        return None
    try:
        return float(number)
    except OverflowError:  # an int beyond float's range
        return None


def scale_problem(name: str, value: object) -> str | None:
    """A loss scale must be a normal float32 (2**-126 to float32's max): its inverse is then finite too, so
    unscaling never multiplies by inf (0 * inf would turn every gradient into NaN)."""
    v = _real(value)
    if v is not None and FLOAT32_TINY <= v <= FLOAT32_MAX:
        return None
    return f"{name} must be a number from 2**-126 to float32's max 3.4028e38 (a normal float32); got {shown(value)}"


def factor_problem(name: str, value: object, above_one: bool) -> str | None:
    """``growth_factor`` (``above_one``) must be in (1, float32 max]; ``backoff_factor`` in (0, 1)."""
    v = _real(value)
    if v is not None and (1 < v <= FLOAT32_MAX if above_one else 0 < v < 1):
        return None
    allowed = "a number > 1" if above_one else "a number in (0, 1)"
    return f"{name} must be {allowed}; got {shown(value)}"


def count_problem(name: str, value: object, maximum: int = INT32_MAX) -> str | None:
    """A count (a growth interval, a hysteresis) is a positive integer — a Python int, a NumPy integer or a 0-dim
    integer tensor, never a float such as ``100.0`` — that fits the int32 counters it is compared with. The one
    statement of this rule: the scaler's arguments and the trainer's config both use it."""
    number = python_number(value)
    if isinstance(number, int) and 1 <= number <= maximum:
        return None
    limit = "2**31 - 1" if maximum == INT32_MAX else f"2**31 - {INT32_MAX + 1 - maximum}"
    return (
        f"{name} must be an integer from 1 to {limit} (a count: an int, not a float such as 100.0; the counters "
        f"are int32, as torch's); got {shown(value)}"
    )


def flag_problem(name: str, value: object) -> str | None:
    """A flag is ``True`` or ``False`` (``python_flag``: NumPy's bools too), never a number."""
    if python_flag(value) is not None:
        return None
    return f"{name} must be True or False; got {shown(value)}"


def limit_problem(name: str, value: object) -> str | None:
    """A gradient limit (``max_gradient_norm``, ``max_gradient_value``): a positive finite number (never a bool) or
    ``None``."""
    v = _real(value)
    if value is None or (v is not None and 0 < v < math.inf):
        return None
    return f"{name} must be a positive finite number or None; got {shown(value)}"


def tolerance_problem(name: str, value: object) -> str | None:
    v = _real(value)
    if v is not None and 0 <= v < 1:
        return None
    return f"{name} must be a number in [0, 1); got {shown(value)}"


SHOWN_AT_MOST = 5  # how many names a message lists before "and N more"


def listed(names: Iterable[object], at_most: int = SHOWN_AT_MOST) -> str:
    """``names`` for an error message: the first ``at_most`` (each by ``shown``: its ``repr``, cut short), then
    how many more (``'a', 'b', 'c', 'd', 'e' and 99,995 more``): the one way every list of unknown keys is printed,
    so that a state dict of 100,000 unknown keys is refused in one line, not 22 MB."""
    items = list(names)
    head = ", ".join(shown(item) for item in items[:at_most])
    rest = len(items) - at_most
    return f"{head} and {rest:,} more" if rest > 0 else head


PROBLEMS_SHOWN_AT_MOST = 20  # how many problems a message lists, one a line, before "and N more"


def bulleted(problems: Iterable[str], at_most: int = PROBLEMS_SHOWN_AT_MOST) -> str:
    """``problems`` one a line (``\n  - ...``), the first ``at_most`` (every problem of a config a person wrote),
    then how many more: 40,000 unknown keys are not 40,000 lines."""
    items = list(problems)
    lines = [f"\n  - {p}" for p in items[:at_most]]
    if len(items) > at_most:
        lines.append(f"\n  - and {len(items) - at_most:,} more")
    return "".join(lines)


def did_you_mean(word: object, allowed: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` with the closest of ``allowed`` (the same word in other case first), or ``""``."""
    names = [str(name) for name in allowed]
    text = str(word)
    if len(text) > 200:  # a hint for a 1 MB key name is not worth difflib's time
        return ""
    same = [name for name in names if name.lower() == text.lower()]
    close = same or difflib.get_close_matches(text, names, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def unknown_names(unknown: Iterable[object], allowed: Iterable[str], at_most: int = SHOWN_AT_MOST) -> str:
    """The first ``at_most`` of ``unknown``, each with its closest name among ``allowed``, then how many more (the
    hints are looked for only for the names shown)."""
    items, names = list(unknown), list(allowed)
    head = ", ".join(f"{shown(item)}{did_you_mean(item, names)}" for item in items[:at_most])
    rest = len(items) - at_most
    return f"{head} and {rest:,} more" if rest > 0 else head


def raise_first(*problems: str | None) -> None:
    """``ValueError`` with the first problem that is not ``None``."""
    for problem in problems:
        if problem is not None:
            raise ValueError(problem)


class SettingsError(ValueError):
    """Invalid scaler settings. ``problems`` lists ``(argument, message)`` pairs, every message naming its
    argument, so a caller with other names for the arguments (the YAML config) can re-label them."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = list(problems)
        if len(self.problems) == 1:
            message = self.problems[0][1]
        else:
            message = "invalid GradScaler settings:" + bulleted(m for _, m in self.problems)
        super().__init__(message)
