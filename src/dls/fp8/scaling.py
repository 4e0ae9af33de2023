"""Exact FP8 scaling arithmetic: per-tensor scales from an amax, per-row casts, and MX block casts.

Everything here is elementwise torch ops and reductions (CPU or CUDA, no host sync, no Python loop over
elements or blocks). Rounding to float8 is [`dls.formats.FloatFormat.quantize`][dls.formats.FloatFormat.quantize], which
is bit-identical to torch's own casts to ``torch.float8_e4m3fn`` and ``torch.float8_e5m2`` (``tests/test_formats.py``).

Conventions. A *scale* multiplies values before the cast: ``payload = fp8(value * scale)``, and the cast is
undone by dividing by it (``payload / scale``, one float32 division, as torchao's ``emulate=True`` GEMMs do).
MX block scales are the other way round, as the OCP MX spec writes them: ``value ≈ payload * 2**(e - 127)``
with ``e`` the biased E8M0 exponent of the block.
"""

from __future__ import annotations

import math
import struct
from typing import NamedTuple

import torch

from dls import formats
from dls.checks import FLOAT32_MAX
from dls.formats import FloatFormat

__all__ = ["MX_BLOCK_SIZE", "MX_SCALE_MODES", "fp8_format", "mx_quantize", "scale_from_amax"]

MX_BLOCK_SIZE = 32
MX_SCALE_MODES = ("rceil", "floor")

_E4M3 = formats.float8_e4m3fn
_E5M2 = formats.float8_e5m2
# Casts that do not saturate: E5M2 overflows to inf (the built-in format already does), E4M3 (no inf) to NaN.
_E4M3_OVERFLOW_NAN = FloatFormat(4, 3, inf_nan="fn", name="float8_e4m3fn_nonsaturating", saturate=False)
_NON_SATURATING = {_E4M3: _E4M3_OVERFLOW_NAN, _E5M2: _E5M2}
_FP8_NAMES: dict[object, FloatFormat] = {
    torch.float8_e4m3fn: _E4M3,
    torch.float8_e5m2: _E5M2,
    "float8_e4m3fn": _E4M3,
    "float8_e5m2": _E5M2,
    "e4m3": _E4M3,
    "e5m2": _E5M2,
}
_MAX_MARGIN = 1000  # fp8_max * 2**-margin and the quotient below stay normal, finite float64 numbers


def fp8_format(value: object, arg: str = "fp8_dtype") -> FloatFormat:
    """The [`FloatFormat`][dls.formats.FloatFormat] of an FP8 dtype: ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``,
    their names, ``"e4m3"`` / ``"e5m2"``, or those two formats themselves.

    Raises:
        ValueError: anything else (the message names ``arg``).
    """
    if isinstance(value, FloatFormat) and value in (_E4M3, _E5M2):
        return value
    try:
        fmt = _FP8_NAMES.get(value)
    except TypeError:  # unhashable
        fmt = None
    if fmt is None:
        raise ValueError(
            f"{arg} must be torch.float8_e4m3fn, torch.float8_e5m2, 'float8_e4m3fn', 'float8_e5m2', 'e4m3' or "
            f"'e5m2'; got {value!r}"
        )
    return fmt


def _check_margin(margin: object) -> int:
    if isinstance(margin, bool) or not isinstance(margin, int) or abs(margin) > _MAX_MARGIN:
        raise ValueError(f"margin must be an int from -{_MAX_MARGIN} to {_MAX_MARGIN}; got {margin!r}")
    return margin


def check_eps(eps: object, arg: str) -> float:
    """``eps`` as a float, if it is a number from 0 to float32's max; else ValueError naming ``arg``."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps <= FLOAT32_MAX:
        raise ValueError(f"{arg} must be a float from 0 to float32's max (3.4e38); got {eps!r}")
    return float(eps)


def check_saved_state(history: object, scale: object, key: str, history_shape: tuple[int, ...]) -> None:
    """A delayed-scaling role's saved ``amax_history`` and ``scale`` (``key`` names their entry in the error).

    The scale multiplies every value the next cast sees, so it must be finite and > 0 (the handle never makes
    another: ``_scale_from_amax`` clamps to float32's max and keeps the old scale for a non-finite amax). A
    history may hold inf or NaN: it records the amax of an input that overflowed, and the handle saves it so.
    """
    if not isinstance(history, torch.Tensor) or tuple(history.shape) != history_shape:
        raise ValueError(f"{key}['amax_history'] must be a tensor of shape {history_shape}")
    if not history.is_floating_point():
        raise ValueError(f"{key}['amax_history'] must be a floating-point tensor; got dtype {history.dtype}")
    if not isinstance(scale, torch.Tensor) or scale.numel() != 1:
        raise ValueError(f"{key}['scale'] must be a 1-element tensor")
    if not scale.is_floating_point():
        raise ValueError(f"{key}['scale'] must be a floating-point tensor; got dtype {scale.dtype}")
    value = float(scale.detach().to(torch.float64).reshape(()))
    # float32's range: the handle keeps its scales in float32, where a larger value would load as inf.
    if not (0.0 < value <= FLOAT32_MAX and _to_float32(value) > 0.0):
        raise ValueError(f"{key}['scale'] must be finite and > 0 (a float32 value); got {value!r}")


def _to_float32(value: float) -> float:
    """``value`` rounded to the nearest float32 (ties to even), on the host."""
    result: float = struct.unpack("f", struct.pack("f", value))[0]
    return result


def floor_pow2(x: torch.Tensor) -> torch.Tensor:
    """The largest power of two ``<= x`` for positive float32 ``x`` (exact; subnormals included); ``+inf``,
    NaN and zero pass through. For a normal ``x`` this keeps the sign and exponent bits (``bits & 0xFF800000``);
    a subnormal is first moved into the normal range by an exact multiplication by ``2**64``."""
    mask = -(1 << 23)  # 0xFF800000 as an int32: sign and exponent bits
    normal = x.view(torch.int32).bitwise_and(mask).view(torch.float32)
    lifted = (x * 2.0**64).view(torch.int32).bitwise_and(mask).view(torch.float32) * 2.0**-64
    return torch.where(x < 2.0**-126, lifted, normal)


def scale_from_amax(
    amax: torch.Tensor | float,
    fp8_dtype: object,
    margin: int = 0,
    power_2: bool = False,
    eps: float = 0.0,
) -> torch.Tensor:
    """The current-scaling rule: the float32 scale that maps ``amax`` to the FP8 format's max, bit-exact.

    With ``a = max(amax, eps)`` (``eps`` rounded to float32 first):

    * ``a`` is 0, inf or NaN: the scale is 1;
    * otherwise ``(fp8_max * 2**-margin) / a`` as *one* round-to-nearest-even float32 division of the exact
      values (computed as a float64 division rounded to float32, which is the same number: a float32 quotient
      of these operands is never within float64's rounding error of a float32 rounding midpoint without being
      on it). A quotient that rounds to inf becomes float32's max;
    * ``power_2=True`` then rounds the scale down to a power of two exactly (keeps its sign and exponent bits).

    This is TransformerEngine's ``compute_scale_from_amax`` (current scaling) and, for ``eps`` equal to its
    ``EPS = 1e-12`` and amax finite, torchao's ``amax_to_scale`` without ``round_scales_to_power_of_2`` (torchao
    turns an inf/NaN amax into a scale of 0/NaN where this rule gives 1, and rounds to a power of two through
    ``exp2(floor(log2(scale)))`` in float32, which overshoots just below a power of two).

    Args:
        amax: absolute maxima (``>= 0``), a tensor of any shape or a number; float16/bfloat16 convert exactly,
            float64 is rounded to float32 first.
        fp8_dtype: ``torch.float8_e4m3fn`` (max 448) or ``torch.float8_e5m2`` (max 57344), or their names.
        margin: an int: the scale is divided by ``2**margin`` (headroom above the amax); |margin| <= 1000.
        power_2: round the scale down to a power of two.
        eps: lower bound on the amax (finite, ``>= 0``).

    Returns:
        float32 scales, shaped like ``amax``, on its device.

    Raises:
        ValueError: a bad ``fp8_dtype``, ``margin``, ``power_2`` or ``eps``; ``amax`` not floating point.
    """
    fmt = fp8_format(fp8_dtype)
    margin = _check_margin(margin)
    if not isinstance(power_2, bool):
        raise ValueError(f"power_2 must be True or False; got {power_2!r}")
    eps = check_eps(eps, "eps")
    return _scale_from_amax(_as_float32(amax, "amax"), fmt, margin, power_2, eps)


def _as_float32(value: torch.Tensor | float, arg: str) -> torch.Tensor:
    t = value if isinstance(value, torch.Tensor) else torch.tensor(value)
    if not t.is_floating_point():
        raise ValueError(f"{arg} must be a floating-point tensor or a number; got dtype {t.dtype}")
    return t.to(torch.float32)


def _scale_from_amax(amax: torch.Tensor, fmt: FloatFormat, margin: int, power_2: bool, eps: float) -> torch.Tensor:
    """``scale_from_amax`` after validation (``amax`` float32)."""
    a = amax
    eps32 = _to_float32(eps)
    if eps32 > 0.0:
        a = a.clamp(min=eps32)  # NaN stays NaN
    a64 = a.double()
    # A true division (``number / tensor`` would multiply by a rounded reciprocal).
    numerator = torch.full((), math.ldexp(fmt.max, -margin), dtype=torch.float64, device=a.device)
    scale = torch.div(numerator, a64).to(torch.float32).clamp_(max=FLOAT32_MAX)  # inf: float32's max
    if power_2:
        scale = floor_pow2(scale)
    regular = (a > 0) & (a < math.inf)  # False for 0, inf and NaN
    return torch.where(regular, scale, 1.0)


# ---------------------------------------------------------------------------------------------------------
# Casts
# ---------------------------------------------------------------------------------------------------------


def _next_up(value: float) -> float:
    return float(torch.tensor(value, dtype=torch.float32).nextafter(torch.tensor(math.inf)))


def _next_down(value: float) -> float:
    return float(torch.tensor(value, dtype=torch.float32).nextafter(torch.tensor(0.0)))


def _thresholds(fmt: FloatFormat) -> tuple[float, float, float, float]:
    """Float32 magnitudes ``(low, next after low, high, next after high)``: a scaled value survives the cast
    iff its magnitude is above ``low`` (half the smallest subnormal: that tie rounds to the even zero), and
    rounds above ``fmt.max`` iff its magnitude is above ``high`` (the midpoint between max and the next step,
    or just below it when that tie rounds up, as for E5M2)."""
    midpoint = fmt.max + math.ldexp(1.0, fmt.emax - fmt.mantissa_bits - 1)
    probe = _NON_SATURATING[fmt].quantize(torch.tensor([midpoint], dtype=torch.float32))
    ties_up = not bool(torch.isfinite(probe).all() and probe.abs().max() <= fmt.max)
    low, high = fmt.min_subnormal / 2, _next_down(midpoint) if ties_up else midpoint
    return low, _next_up(low), high, _next_up(high)


_THRESHOLDS = {fmt: _thresholds(fmt) for fmt in (_E4M3, _E5M2)}


def _sum(t: torch.Tensor) -> torch.Tensor:
    """NaN-ignoring sum, exact for the 0-or-constant terms summed here (float64 beyond ``2**24`` elements)."""
    return t.nansum(dtype=torch.float64 if t.numel() > 2**24 else None)


def cast_count_sums(scaled_abs: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Raw counts of a cast to ``fmt`` of values with magnitudes ``scaled_abs`` (already scaled): a
    3-element device tensor that `cast_counts` turns into ``(nonzero, saturated, flushed)`` (sums of
    them over several casts of the same format too).

    Float arithmetic only (CPU comparisons into bool tensors and ``count_nonzero`` are several times slower):
    clamping magnitudes to ``[t, next float after t]`` and subtracting ``t`` leaves 0 or one ulp per element,
    so the sum is the number of elements above ``t`` times that ulp, exactly; NaN counts nowhere."""
    low, low_up, high, high_up = _THRESHOLDS[fmt]
    return torch.stack(
        [
            _sum(scaled_abs.sign()),
            _sum(scaled_abs.clamp(high, high_up).sub_(high)),
            _sum(scaled_abs.clamp(low, low_up).sub_(low)),
        ]
    )


def cast_counts(sums: list[float], fmt: FloatFormat) -> tuple[float, float, float]:
    """``(nonzero, saturated, flushed)`` from `cast_count_sums`: values nonzero after scaling, those
    whose magnitude rounds above ``fmt.max`` (saturated, or inf/NaN without saturation; inf included) and
    those the cast flushed to zero."""
    low, low_up, high, high_up = _THRESHOLDS[fmt]
    nonzero, above_high, above_low = sums
    return nonzero, above_high / (high_up - high), nonzero - above_low / (low_up - low)


def round_scaled(scaled: torch.Tensor, fmt: FloatFormat, saturate: bool) -> torch.Tensor:
    """FP8 payload of values already multiplied by their scale, as float32 on the FP8 grid. ``saturate``:
    values beyond ``±fmt.max`` become ``±max`` (torchao's ``to_fp8_saturated``: clamp, then cast; NaN stays
    NaN, ±inf becomes ±max); otherwise inf (E5M2) or NaN (E4M3, which has no inf)."""
    if not saturate:
        return _NON_SATURATING[fmt].quantize(scaled)
    if fmt is _E4M3:  # the built-in E4M3 cast saturates after rounding: the same result as clamping first
        return fmt.quantize(scaled)
    return fmt.quantize(scaled.clamp(-fmt.max, fmt.max))


def cast_scaled(
    x: torch.Tensor, scale: torch.Tensor, fmt: FloatFormat, saturate: bool, count: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Quantize float32 ``x`` with positive ``scale`` (0-dim, or broadcastable: one per row) and dequantize:
    ``fp8(x * scale) / scale`` in float32. Returns it with `cast_count_sums` when ``count``."""
    scaled = x * scale
    dq = round_scaled(scaled, fmt, saturate).div_(scale)
    return dq, cast_count_sums(scaled.abs_(), fmt) if count else None


# ---------------------------------------------------------------------------------------------------------
# MX block scaling
# ---------------------------------------------------------------------------------------------------------

_F32_MIN_NORMAL = 2.0**-126


def mx_exponents(amax: torch.Tensor, fmt: FloatFormat, scale_mode: str) -> torch.Tensor:
    """Biased E8M0 exponents (int32, 0..255; 255 is NaN) of MX blocks with float32 absolute maxima ``amax``.

    * ``"rceil"``: ``amax / fmt.max`` (one float32 division) rounded *up* to a power of two, exactly (the rule
      of NVIDIA's ``cvt.rp.satfinite.ue8m0`` and TransformerEngine), clamped to ``2**-127 .. 2**127``; an
      infinite amax gives 254, NaN 255.
    * ``"floor"``: the OCP MX v1.0 rule, ``2**(floor(log2(amax)) - emax)`` with ``emax`` the exponent of the
      element format's largest binade (8 for E4M3, 15 for E5M2), clamped to ``2**-127 .. 2**128``; a NaN
      amax gives 255 (an infinite one 247 or 240).
    """
    if scale_mode == "rceil":
        quotient = amax / fmt.max
        # Adding 2**23 - 1 to the bits carries into the exponent field exactly when the mantissa is nonzero:
        # the exponent of the next power of two up, for normal quotients (inf gives 255, clamped to 254).
        # Subnormal ones round up to 2**-126 (exponent 1) above 2**-127 and clamp to 2**-127 (0) at or below.
        e = quotient.view(torch.int32).add((1 << 23) - 1).bitwise_right_shift_(23)
        e = torch.where(quotient <= 2.0**-127, 0, e).clamp_(max=254)
    else:
        field = amax.view(torch.int32).bitwise_right_shift(23).bitwise_and_(255)
        e = field.sub_(127 + fmt.emax).clamp_(-127, 128).add_(127)
    return torch.where(torch.isnan(amax), 255, e)


def mx_block_scale(e: torch.Tensor) -> torch.Tensor:
    """The float32 value ``2**(e - 127)`` of biased E8M0 exponents (int32; NaN for 255, ``2**-127`` for 0),
    built from the bits (exact)."""
    value = torch.where(e == 0, 2.0**-127, e.bitwise_left_shift(23).view(torch.float32))  # 255: inf
    return torch.where(e == 255, math.nan, value)


class MxCast(NamedTuple):
    """An MX cast (see `mx_cast`)."""

    exponents: torch.Tensor  # int32, x's shape with dim split into (blocks, 1)
    payload: torch.Tensor  # float32 on the FP8 grid, x's shape with dim split into (blocks, 32)
    scale: torch.Tensor  # float32 decode scale 2**(e - 127) per block (NaN for 255)
    amax: torch.Tensor  # float32 absolute maximum per block
    count_sums: torch.Tensor | None  # cast_count_sums, when asked for


def mx_cast(x: torch.Tensor, dim: int, fmt: FloatFormat, scale_mode: str, saturate: bool, count: bool) -> MxCast:
    """MX cast of float32 ``x`` in blocks of 32 along ``dim`` (a non-negative index whose size is a multiple of
    32), without copying ``x``. The values cast are computed as torchao's ``to_mx`` does: RCEIL multiplies by
    the reciprocal of the block scale (1.0 for exponent 0, NaN for 255), FLOOR divides by the scale clamped to
    at least ``2**-126`` (255: by inf)."""
    blocks = x.unflatten(dim, (x.shape[dim] // MX_BLOCK_SIZE, MX_BLOCK_SIZE))
    amax = blocks.abs().amax(dim + 1, keepdim=True)
    e = mx_exponents(amax, fmt, scale_mode)
    scale = mx_block_scale(e)
    if scale_mode == "rceil":
        scaled = blocks * torch.where(e == 0, 1.0, scale.reciprocal())  # 254: 2**-127, exactly
    else:
        scaled = blocks / e.bitwise_left_shift(23).view(torch.float32).clamp(min=_F32_MIN_NORMAL)
    payload = round_scaled(scaled, fmt, saturate)
    return MxCast(e, payload, scale, amax, cast_count_sums(scaled.abs_(), fmt) if count else None)


def mx_quantize(
    x: torch.Tensor, fp8_dtype: object, scale_mode: str = "rceil", *, dim: int = -1, saturate: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cast ``x`` to MXFP8: blocks of 32 consecutive elements along ``dim``, one E8M0 scale per block.

    Byte for byte what torchao's ``torchao.prototype.mx_formats.mx_tensor.to_mx(x, fp8_dtype, 32, mode)``
    returns (tested on a million values and on edge blocks: zeros, inf, NaN, subnormals, max), with one
    deliberate difference: for ``"rceil"`` torchao's CPU/eager code rounds ``amax / fp8_max`` up to a power
    of two through ``ceil(log2(.))`` in float32, which returns the power of two itself for quotients just above
    it (``2**k * (1 + 2**-23)`` for ``|k| >= 4``); this function rounds up exactly, as the hardware
    instruction torchao uses on GPUs does.

    Args:
        x: float32, float16 or bfloat16; its size along ``dim`` must be a multiple of 32.
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2`` (or their names).
        scale_mode: ``"rceil"`` or ``"floor"`` (see `mx_exponents`).
        dim: the axis the blocks run along (the GEMM's reduction axis).
        saturate: clamp scaled values to ``±max`` before the cast (as torchao); ``False`` lets FLOOR's
            overflow become inf/NaN.

    Returns:
        ``(exponents, payload)``: biased E8M0 exponents as uint8, shaped like ``x`` with ``dim`` divided by 32
        (view them as ``torch.float8_e8m0fnu`` for torch's type); the payload as float32 values on the FP8
        grid, shaped like ``x`` (``payload.to(fp8_dtype)`` is exact). Decoded: ``payload * 2**(e - 127)``.

    Raises:
        ValueError: bad ``fp8_dtype`` / ``scale_mode`` / ``dim`` / ``saturate``, or a size not divisible by 32.
    """
    fmt = fp8_format(fp8_dtype)
    if scale_mode not in MX_SCALE_MODES:
        raise ValueError(f"scale_mode must be 'rceil' or 'floor'; got {scale_mode!r}")
    if not isinstance(saturate, bool):
        raise ValueError(f"saturate must be True or False; got {saturate!r}")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() == 0:
        raise ValueError(f"x must be a floating-point tensor with at least one dimension; got {x!r:.80}")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must be an int in [-{x.dim()}, {x.dim()}); got {dim!r}")
    dim %= x.dim()
    if x.shape[dim] % MX_BLOCK_SIZE:
        raise ValueError(
            f"x's size along dim must be a multiple of {MX_BLOCK_SIZE}; got shape {tuple(x.shape)}, dim {dim}"
        )
    cast = mx_cast(x.to(torch.float32), dim, fmt, scale_mode, saturate, False)
    return cast.exponents.squeeze(dim + 1).to(torch.uint8), cast.payload.flatten(dim, dim + 1)
