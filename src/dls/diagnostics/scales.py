"""Power-of-two loss scales against a format's range, from histograms of gradient exponents.

A histogram counts nonzero finite gradient values per binade: bin ``i`` holds ``2**(HIST_LOW + i) <= |g| <
2**(HIST_LOW + i + 1)``. Multiplying by a loss scale ``2**k`` moves every value ``k`` binades up, so the values a
format flushes to zero or overflows at any power-of-two scale follow from the histogram without another pass.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from dls.formats import FloatFormat

__all__ = [
    "HIST_BINS",
    "HIST_LOW",
    "OVERFLOW_HEADROOM",
    "UNDERFLOW_MARGIN",
    "count_flushed",
    "count_overflowed",
    "flush_limit",
    "module_label",
    "percent",
    "pow2",
    "recommend_exponent",
    "scale_exponent",
]

HIST_LOW = -160
"""Binary exponent (``floor(log2 |g|)``) of the first histogram bin; smaller values are counted in it."""
HIST_BINS = 320
"""Histogram bins, one per binade from ``2**HIST_LOW``; larger values are counted in the last one."""
UNDERFLOW_MARGIN = 3
"""Binades added above the smallest scale that meets the underflow tolerance (gradients shrink as loss falls)."""
OVERFLOW_HEADROOM = 1
"""Binades kept free between the largest scaled gradient and the format's max."""


# ------------------------------------------------------------------------------------------- binade arithmetic
def flush_limit(fmt: FloatFormat) -> int:
    """Binades ``E < limit`` (values in ``[2**E, 2**(E+1))``) round to zero: below half the smallest subnormal,
    or, without subnormals, below ``min_normal``."""
    return fmt.emin - fmt.mantissa_bits - 1 if fmt.subnormals else fmt.emin


def count_flushed(histogram: Sequence[int], fmt: FloatFormat, exponent: int = 0) -> int:
    """How many of the values counted in ``histogram`` (bin ``i`` = binade ``HIST_LOW + i``) rounding to ``fmt``
    flushes to zero once multiplied by ``2**exponent``. Exact except for values exactly at the flush threshold
    (ties, which round to zero) and, without subnormals, a sliver just below ``min_normal`` (which rounds up)."""
    stop = flush_limit(fmt) - exponent - HIST_LOW
    return sum(histogram[: max(0, min(stop, len(histogram)))])


def count_overflowed(histogram: Sequence[int], fmt: FloatFormat, exponent: int = 0) -> int:
    """How many of the values counted in ``histogram`` overflow ``fmt`` once multiplied by ``2**exponent``:
    every value of a binade above the format's top one (exact except for the sliver of the top binade above
    ``max`` + half a unit, which also overflows)."""
    start = fmt.emax + 1 - exponent - HIST_LOW
    return sum(histogram[max(0, start) :])


def recommend_exponent(
    histogram: Sequence[int], max_gradient: float, fmt: FloatFormat, underflow_tolerance: float
) -> int | None:
    """The exponent ``k`` of the recommended initial loss scale ``2**k`` for gradients with this ``histogram``
    and largest magnitude ``max_gradient``; ``None`` when there is no nonzero finite gradient.

    The rule:

    1. ``k_hi``: the largest ``k`` with ``max_gradient * 2**k <= fmt.max / 2**OVERFLOW_HEADROOM``: no gradient
       overflows, and the largest one may still double before it would.
    2. ``k_lo``: the smallest ``k`` at which at most ``underflow_tolerance`` of the nonzero gradient values are
       flushed to zero (`count_flushed`).
    3. If ``k_lo + UNDERFLOW_MARGIN <= k_hi``: the ``k`` of ``[k_lo + UNDERFLOW_MARGIN, k_hi]`` closest to 0
       (no scaling when 1 already fits with the margins; otherwise the least scaling that leaves gradients room to
       shrink by ``2**UNDERFLOW_MARGIN`` before they flush).
    4. Otherwise ``k_hi``: the margins do not both fit (or, if ``k_lo > k_hi``, no scale holds the gradients),
       and the largest scale that does not overflow flushes the fewest values. An overflow costs a dynamic scaler
       one skipped step; a flushed gradient is lost silently.

    Args:
        histogram: counts of nonzero finite gradient values per binade, from ``2**HIST_LOW`` up.
        max_gradient: the largest gradient magnitude.
        fmt: the format the gradients are cast to.
        underflow_tolerance: the share of nonzero values that may flush to zero, in ``[0, 1)``.
    """
    total = sum(histogram)
    if total == 0 or not max_gradient > 0 or not math.isfinite(max_gradient):
        return None
    limit = fmt.max / 2.0**OVERFLOW_HEADROOM
    k_hi = math.floor(math.log2(limit / max_gradient))
    while math.ldexp(max_gradient, k_hi) > limit:
        k_hi -= 1
    while math.ldexp(max_gradient, k_hi + 1) <= limit:
        k_hi += 1
    # count_flushed(k) counts the binades E < flush_limit - k: find the largest cut t = flush_limit - k whose
    # count stays within the tolerance.
    allowed = underflow_tolerance * total
    cut, below = HIST_LOW, 0
    for i, count in enumerate(histogram):
        if below + count > allowed:
            break
        below += count
        cut = HIST_LOW + i + 1
    k_lo = flush_limit(fmt) - cut
    lower = k_lo + UNDERFLOW_MARGIN
    if lower <= k_hi:
        return min(max(0, lower), k_hi)
    return k_hi


def scale_exponent(scale: float) -> int:
    """``k`` of a power-of-two ``scale = 2**k``; ``ValueError`` for anything else."""
    mantissa, exponent = math.frexp(scale)
    if mantissa != 0.5:
        raise ValueError(f"scale must be a power of two; got {scale!r}")
    return exponent - 1


# ------------------------------------------------------------------------------------------- display
def module_label(name: str) -> str:
    """A module's qualified name for people: the root module (named ``""``) reads ``(root)``."""
    return name if name else "(root)"


def percent(fraction: float) -> str:
    """A share as a percentage with the digits that matter: ``38%``, ``2.5%``, ``0.0056%``."""
    if fraction == 0:
        return "0%"
    if fraction >= 0.1:
        return f"{100 * fraction:.0f}%"
    if fraction >= 0.001:
        return f"{100 * fraction:.1f}%"
    return f"{100 * fraction:.2g}%"


def pow2(value: float) -> str:
    """``2^k`` for powers of two other than 1, else the number."""
    mantissa, exponent = math.frexp(value)
    return f"2^{exponent - 1}" if mantissa == 0.5 and exponent != 1 else f"{value:g}"
