"""Half-precision dtypes: which one the run trains in, and exact emulation of each format.

``set_half_dtype`` mirrors ``cstorch.amp.set_half_dtype``: it records the half format the run uses and returns
the torch dtype that stands in for it. cbfloat16 has no torch dtype; its proxy is ``torch.float16`` (as on
Cerebras) and its numerics come from emulation.

Emulation: a [`FloatFormat`][dls.formats.FloatFormat] describes a binary floating-point format (sign, ``exponent_bits``,
``mantissa_bits``, bias, subnormals, inf/NaN encodings) and rounds tensors to it with
[`FloatFormat.quantize`][dls.formats.FloatFormat.quantize], using elementwise torch ops only (CPU and CUDA alike). Built
in: ``float16``, ``bfloat16``, ``cbfloat16``, ``float8_e4m3fn`` and ``float8_e5m2``; [`get`][dls.formats.get] looks a
format up by name, [`register`][dls.formats.register] adds or replaces one,
[`get_half_format`][dls.formats.get_half_format] returns the format of the run's half dtype.

Exactness contract of ``quantize`` (tested in ``tests/test_formats.py``): for every format the result is the
correctly rounded value (round to nearest, ties to even; overflow as ``saturate`` / ``inf_nan`` say), computed by
dls's own arithmetic, so it is the same on every supported torch and device. For float32, float16 and bfloat16
inputs it equals, bit for bit, torch's own cast ``x.to(dtype).to(x.dtype)`` for the formats torch has (float16,
bfloat16, float8_e4m3fn, float8_e5m2; NaN compared as NaN, any payload), with one exception that is torch's:
``float8_e4m3fn`` saturates values that round above 448 (and ±inf) to ±448, as torch 2.13's cast does, while
torch 2.11's cast turns them into NaN, which ``saturate=False`` reproduces. float64 inputs are rounded once,
correctly, from the float64 value; torch's casts from float64 round twice (to float32 first) and can differ from
it by one unit in the last place on inputs within ``2**-24`` relative of a rounding midpoint.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch

HALF_DTYPE_NAMES = ("float16", "bfloat16", "cbfloat16")

_PROXY_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "cbfloat16": torch.float16,
}

_half_dtype_str = "float16"


def half_dtype_name(value: str | torch.dtype) -> str:
    """The name (``"float16"``, ``"bfloat16"``, ``"cbfloat16"``) of a half dtype given by name or torch dtype;
    ``ValueError`` naming the allowed values otherwise.

    Args:
        value: a half dtype's name or torch dtype.
    """
    if isinstance(value, torch.dtype):
        for name in ("float16", "bfloat16"):
            if value == _PROXY_DTYPES[name]:
                return name
    elif isinstance(value, str) and value in _PROXY_DTYPES:
        return value
    raise ValueError(
        f"half_dtype must be one of {', '.join(repr(n) for n in HALF_DTYPE_NAMES)}, "
        f"torch.float16 or torch.bfloat16; got {value!r}"
    )


def set_half_dtype(value: str | torch.dtype) -> torch.dtype:
    """Choose the half format of the run; returns the torch dtype that computes in it (cbfloat16 → float16).

    Args:
        value: ``"float16"``, ``"bfloat16"``, ``"cbfloat16"``, ``torch.float16`` or ``torch.bfloat16``.

    Returns:
        The torch dtype that computes in that format.

    Raises:
        ValueError: any other value (the message lists the allowed ones).
    """
    global _half_dtype_str
    _half_dtype_str = half_dtype_name(value)
    return _PROXY_DTYPES[_half_dtype_str]


def get_half_dtype() -> torch.dtype:
    """The torch dtype that stands in for the chosen half format."""
    return _PROXY_DTYPES[_half_dtype_str]


def get_half_dtype_str() -> str:
    """The chosen half format's name: ``"float16"``, ``"bfloat16"`` or ``"cbfloat16"``."""
    return _half_dtype_str


# ---------------------------------------------------------------------------------------------------------
# Float formats
# ---------------------------------------------------------------------------------------------------------

INF_NAN_MODES = ("ieee", "fn", "none")


class _Limits(NamedTuple):
    """Constants derived once per format (plain Python numbers; every one exact in float64)."""

    bias: int
    emin: int  # exponent of min_normal
    emax: int  # exponent of the largest binade that holds finite values
    max: float
    min_normal: float
    min_subnormal: float
    saturate: bool
    compute: torch.dtype  # float32 when every value of the format and every rounding step fits in it
    overflow_threshold: float  # max + half the top binade's gap: beyond it (or at it, see next) values overflow
    tie_overflows: bool  # whether the tie at overflow_threshold rounds up (max has an odd encoding)
    torch_dtype: torch.dtype | None  # torch dtype whose casts are exactly this format, if any


# (exponent_bits, mantissa_bits, bias, subnormals, inf_nan, saturate) of formats torch casts to natively.
_NATIVE: dict[tuple[int, int, int, bool, str, bool], torch.dtype] = {
    (5, 10, 15, True, "ieee", False): torch.float16,
    (8, 7, 127, True, "ieee", False): torch.bfloat16,
    (4, 3, 7, True, "fn", True): torch.float8_e4m3fn,
    (5, 2, 15, True, "ieee", False): torch.float8_e5m2,
}
# Formats quantize() rounds with torch's own cast. float8 is left out: its casts are slower than the arithmetic
# on CPU (they are bit-identical to it, as the tests check).
_FAST_CASTS = (torch.float16, torch.bfloat16)
_NATIVE_INPUTS = (torch.float32, torch.float16, torch.bfloat16)


def _fits(emin: int, emax: int, mantissa_bits: int, subnormals: bool, dtype: torch.dtype) -> bool:
    """Whether ``FloatFormat._round`` is exact in ``dtype`` for the format. It needs a bit of ``dtype`` below
    the format's last fraction bit; ``min_normal`` a normal of ``dtype`` (exponents are read from the bit
    pattern); and every rounding constant ``C = 2**(e + nmant - mantissa_bits)`` normal and finite, for ``e``
    from ``emin`` (``emin - 1`` without subnormals) to ``emax + 1``."""
    nmant, emin_d, emax_d = (23, -126, 127) if dtype == torch.float32 else (52, -1022, 1023)
    lowest = emin if subnormals else emin - 1
    return (
        mantissa_bits < nmant
        and emin >= emin_d
        and lowest + nmant - mantissa_bits >= emin_d
        and emax + 1 + nmant - mantissa_bits <= emax_d
    )


@dataclasses.dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format: 1 sign bit, ``exponent_bits``, ``mantissa_bits`` (explicit fraction
    bits), with round-to-nearest-even emulation on torch tensors.

    Args:
        exponent_bits: width of the exponent field, 1 to 11 (the format's range must fit well inside
            float64's: 11 bits need a larger bias than the IEEE one).
        mantissa_bits: fraction bits after the implicit leading 1, 0 to 51.
        bias: exponent bias; ``None`` (default) means the IEEE value ``2**(exponent_bits - 1) - 1``. After
            construction ``bias`` always holds the int in use.
        subnormals: ``True`` for gradual underflow (exponent field 0 encodes ``0.f * 2**(1 - bias)``);
            ``False`` flushes results below ``min_normal`` to a zero of the same sign (after rounding).
        inf_nan: which encodings are reserved:

            * ``"ieee"``: the all-ones exponent holds ±inf and NaN (float16, bfloat16, float8_e5m2).
            * ``"fn"`` ("finite, NaN"): no infinities; only the all-ones exponent *and* all-ones mantissa is
              NaN, the rest of the top binade holds finite values (float8_e4m3fn).
            * ``"none"``: every encoding is finite (no inf, no NaN); NaN inputs still come out NaN, since the
              emulation has nothing better to return.
        name: label used by [`get`][dls.formats.get] / [`register`][dls.formats.register] and in ``repr``;
            default ``"e{E}m{M}"``.
        saturate: what rounds above ``max``. ``True``: finite values clamp to ``±max``, and infinite inputs
            too when the format has no infinities (an IEEE format keeps ±inf). ``False``: ±inf for
            ``"ieee"``, NaN for ``"fn"``. Default: ``False`` for ``"ieee"`` (IEEE overflow), ``True`` for
            ``"fn"`` and ``"none"``. The default for ``"fn"`` is the saturating conversion of OCP FP8, which
            torch's ``x.to(torch.float8_e4m3fn)`` has from torch 2.13 on (finite overflow and ±inf to ±448, CPU
            and CUDA); torch 2.11's cast returns NaN there, which ``saturate=False`` reproduces. dls rounds with
            its own arithmetic, so the result does not depend on the torch release. ``"none"`` requires
            ``saturate=True``.

    Rounding is to nearest, ties to the even significand (with ``mantissa_bits=0`` every normal significand
    is 1, and a tie between two powers of two goes to the larger one).

    Derived (read-only): ``max``, ``min_normal``, ``min_subnormal`` (equals ``min_normal`` without
    subnormals), ``eps`` (``2**-mantissa_bits``, the gap between 1 and the next value), ``emin``, ``emax``.

    Instances are immutable and hashable; two formats are equal when all fields (the name included) are.
    """

    exponent_bits: int
    mantissa_bits: int
    bias: int | None = None
    subnormals: bool = True
    inf_nan: str = "ieee"
    name: str = ""
    saturate: bool | None = dataclasses.field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        e, m = self.exponent_bits, self.mantissa_bits
        if isinstance(e, bool) or not isinstance(e, int) or not 1 <= e <= 11:
            raise ValueError(f"exponent_bits must be an int from 1 to 11; got {e!r}")
        if isinstance(m, bool) or not isinstance(m, int) or not 0 <= m <= 51:
            raise ValueError(f"mantissa_bits must be an int from 0 to 51; got {m!r}")
        if self.inf_nan not in INF_NAN_MODES:
            raise ValueError(
                f"inf_nan must be one of {', '.join(repr(v) for v in INF_NAN_MODES)}; got {self.inf_nan!r}"
            )
        if not isinstance(self.subnormals, bool):
            raise ValueError(f"subnormals must be True or False; got {self.subnormals!r}")
        if self.saturate is not None and not isinstance(self.saturate, bool):
            raise ValueError(f"saturate must be True, False or None; got {self.saturate!r}")
        if self.inf_nan == "none" and self.saturate is False:
            raise ValueError("saturate must be True or None when inf_nan='none' (no inf or NaN to overflow to)")
        bias = 2 ** (e - 1) - 1 if self.bias is None else self.bias
        if isinstance(bias, bool) or not isinstance(bias, int):
            raise ValueError(f"bias must be an int or None; got {self.bias!r}")
        if not isinstance(self.name, str):
            raise ValueError(f"name must be a str; got {self.name!r}")
        object.__setattr__(self, "bias", bias)
        if not self.name:
            object.__setattr__(self, "name", f"e{e}m{m}")
        saturate = self.inf_nan != "ieee" if self.saturate is None else self.saturate
        object.__setattr__(self, "saturate", saturate)

        emin = 1 - bias
        top = 2**e - 1  # all-ones exponent field
        if self.inf_nan == "ieee":
            emax, max_mant = top - 1 - bias, 2.0 - 2.0**-m
        elif self.inf_nan == "fn" and m == 0:
            emax, max_mant = top - 1 - bias, 1.0  # the top binade's only code is NaN
        elif self.inf_nan == "fn":
            emax, max_mant = top - bias, 2.0 - 2.0 ** (1 - m)  # all-ones mantissa is NaN
        else:
            emax, max_mant = top - bias, 2.0 - 2.0**-m
        if emax < emin:
            raise ValueError(
                f"exponent_bits={e} with inf_nan={self.inf_nan!r} leaves no normal binade; use more exponent bits"
            )
        if not _fits(emin, emax, m, self.subnormals, torch.float64):
            raise ValueError(
                f"bias={bias} puts the format (exponents {emin - m}..{emax}) outside what float64 can emulate"
            )
        compute = torch.float32 if _fits(emin, emax, m, self.subnormals, torch.float32) else torch.float64
        # Whether max's significand is odd, so that the tie above it rounds up (overflows): fraction all ones
        # (odd), but all ones minus one for "fn" (even); with no fraction bits the significand is 1 (odd).
        max_code_odd = m == 0 or self.inf_nan != "fn"
        native_key = (e, m, bias, self.subnormals, self.inf_nan, saturate)
        limits = _Limits(
            bias=bias,
            emin=emin,
            emax=emax,
            max=math.ldexp(max_mant, emax),
            min_normal=math.ldexp(1.0, emin),
            min_subnormal=math.ldexp(1.0, emin - m if self.subnormals else emin),
            saturate=saturate,
            compute=compute,
            overflow_threshold=math.ldexp(max_mant + 2.0**-m / 2, emax),
            tie_overflows=max_code_odd,
            torch_dtype=_NATIVE.get(native_key),
        )
        object.__setattr__(self, "_limits", limits)

    # ------------------------------------------------------------------ constants
    @property
    def max(self) -> float:
        """Largest finite value."""
        return self._lim.max

    @property
    def min_normal(self) -> float:
        """Smallest positive normal value, ``2**(1 - bias)``."""
        return self._lim.min_normal

    @property
    def min_subnormal(self) -> float:
        """Smallest positive value: ``2**(1 - bias - mantissa_bits)``, or ``min_normal`` without subnormals."""
        return self._lim.min_subnormal

    @property
    def eps(self) -> float:
        """Machine epsilon, ``2**-mantissa_bits``: the gap between 1.0 and the next larger value."""
        return math.ldexp(1.0, -self.mantissa_bits)

    @property
    def emin(self) -> int:
        """Exponent of ``min_normal``."""
        return self._lim.emin

    @property
    def emax(self) -> int:
        """Exponent of the largest binade holding finite values (``max < 2**(emax + 1)``)."""
        return self._lim.emax

    @property
    def bits(self) -> int:
        """Total width: ``1 + exponent_bits + mantissa_bits``."""
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def _lim(self) -> _Limits:
        limits: _Limits = self.__dict__["_limits"]
        return limits

    def __repr__(self) -> str:
        return (
            f"FloatFormat(exponent_bits={self.exponent_bits}, mantissa_bits={self.mantissa_bits}, "
            f"bias={self.bias}, subnormals={self.subnormals}, inf_nan={self.inf_nan!r}, name={self.name!r}, "
            f"saturate={self.saturate})"
        )

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The torch dtype whose casts round exactly like this format (float16, bfloat16, float8_e4m3fn,
        float8_e5m2), or ``None``. Only the numerics count, not the name. float8_e4m3fn is the saturating format,
        as torch 2.13's cast (torch 2.11's cast overflows to NaN: see the module docstring)."""
        return self._lim.torch_dtype

    # ------------------------------------------------------------------ rounding
    def quantize(self, x: torch.Tensor, *, straight_through: bool = False) -> torch.Tensor:
        """Round ``x`` to the nearest value of this format (ties to even); returns a tensor of ``x``'s dtype,
        shape and device.

        Signed zeros keep their sign, NaN stays NaN, overflow follows ``saturate`` / ``inf_nan``. The work is
        about ten elementwise torch ops in float32 (float64 for float64 inputs, or for formats wider than
        float32 can round exactly); float16, bfloat16 and float8 inputs are upcast exactly and the result
        cast back to their dtype, so values beyond the input dtype's own range or precision are then rounded
        again to that dtype (e.g. cbfloat16 rounds 65504 to 65536, which a float16 tensor holds as inf; a
        float8 tensor's values are rounded by dls's format of its dtype, the same on every torch release). For
        the float16 and bfloat16 formats and float32/float16/bfloat16 inputs, the result is computed as
        torch's cast ``x.to(torch_dtype).to(x.dtype)``, which the tests show to be bit-identical to the
        arithmetic.

        Args:
            x: any floating-point tensor (float64, float32, float16, bfloat16, float8).
            straight_through: ``False`` (default): the result is a plain tensor outside autograd (rounding has
                zero derivative almost everywhere). ``True``: the result stays in the graph and its gradient
                reaches ``x`` unchanged (the straight-through estimator).

        Raises:
            TypeError: ``x`` is not a floating-point tensor.
        """
        if straight_through and x.requires_grad:
            out: torch.Tensor = _StraightThrough.apply(x, self)
            return out
        with torch.no_grad():
            native = self._lim.torch_dtype
            if native in _FAST_CASTS and x.dtype in _NATIVE_INPUTS:
                return x.clone() if x.dtype == native else x.to(native).to(x.dtype)  # always a new tensor
            return self._quantize_generic(x)

    def fraction_underflow(self, x: torch.Tensor) -> float:
        """Fraction of the nonzero finite elements of ``x`` that ``quantize`` flushes to zero (0.0 if none).

        Args:
            x: a floating-point tensor, on any device.
        """
        nonzero, under, _ = self.count_underflow_overflow(x)
        n = int(nonzero.item())
        return int(under.item()) / n if n else 0.0

    def fraction_overflow(self, x: torch.Tensor) -> float:
        """Fraction of the nonzero finite elements of ``x`` that round above ``max`` (to inf, NaN or a
        saturated ``±max``, by ``saturate`` / ``inf_nan``); 0.0 if there are none.

        Args:
            x: a floating-point tensor, on any device.
        """
        nonzero, _, over = self.count_underflow_overflow(x)
        n = int(nonzero.item())
        return int(over.item()) / n if n else 0.0

    def count_underflow_overflow(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(nonzero, underflow, overflow)`` element counts of ``x`` as int64 0-dim tensors on ``x``'s device
        (no host sync): nonzero finite elements, those of them that round to zero, and those that round above
        ``max``. The building block of the ``fraction_*`` methods.

        Args:
            x: a floating-point tensor, on any device.
        """
        _, nonzero, under, over = self.quantize_and_count(x)
        return nonzero, under, over

    def quantize_and_count(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``quantize(x)`` together with ``count_underflow_overflow(x)``: ``(q, nonzero, underflow, overflow)``
        (no host sync, no autograd).

        Args:
            x: a floating-point tensor, on any device.
        """
        q = self.quantize(x)
        with torch.no_grad():
            a = (x if x.dtype in (torch.float32, torch.float64) else x.float()).abs()  # thresholds exact in a
            finite = torch.nan_to_num(a, nan=0.0, posinf=0.0)
            lim = self._lim
            beyond = finite >= lim.overflow_threshold if lim.tie_overflows else finite > lim.overflow_threshold
            # q is zero exactly where x is zero or underflows (NaN and inf never round to zero).
            underflow = torch.count_nonzero(a) - torch.count_nonzero(q)
            return q, torch.count_nonzero(finite), underflow, torch.count_nonzero(beyond)

    # ------------------------------------------------------------------ implementation
    def _quantize_generic(self, x: torch.Tensor) -> torch.Tensor:
        """``quantize`` by arithmetic alone (no cast to a torch format dtype), for any format."""
        if not x.is_floating_point():
            raise TypeError(f"x must be a floating-point tensor; got dtype {x.dtype}")
        compute = torch.float64 if x.dtype == torch.float64 else self._lim.compute
        with torch.no_grad():
            out = self._round(x.to(compute))
            back = _FLOAT8_DTYPE_FORMATS.get(x.dtype)
            if back is not None and back != self:
                # Rounded to the float8 dtype by dls (torch's own cast of values past 448 differs by release).
                out = back._round(out)
            return out.to(x.dtype)

    def _round(self, xc: torch.Tensor) -> torch.Tensor:
        """Round ``xc`` (float32 or float64, as ``_fits`` allows) to the format.

        ``r = (a + C) - C`` with ``a = |xc|`` and ``C = 2**(e + nmant - mantissa_bits)``, where ``e`` is the
        exponent of ``a`` clamped to ``[emin, emax + 1]`` (``nmant`` = 23 or 52). ``a + C`` lands in
        ``[C, 2C]``, where the spacing of the compute dtype is exactly the format's ulp at ``e``, so the FPU's
        round-to-nearest-even does the rounding (a carry to the next binade included) and the subtraction is
        exact. Clamping ``e`` at ``emin`` gives the subnormal spacing (without subnormals, at ``emin - 1``, and
        results below ``min_normal`` are then flushed: rounding comes first); clamping at ``emax + 1`` keeps
        ``C`` finite while anything that big still lands above ``max``. ``C`` comes from the exponent bits of
        ``a`` (an and, a clamp, an add). NaN and inf pass through unchanged. Then overflow, then the sign of
        ``xc`` (so signed zeros survive). Ties go to the even significand; with ``mantissa_bits=0``, where
        every normal significand is 1, a tie between two powers of two goes to the larger one.
        """
        lim = self._lim
        m = self.mantissa_bits
        compute = xc.dtype
        if compute == torch.float32:
            itype, nmant, bias_d, exp_mask, emax_d = torch.int32, 23, 127, 0x7F800000, 127
        else:
            itype, nmant, bias_d, exp_mask, emax_d = torch.int64, 52, 1023, 0x7FF0000000000000, 1023
        lowest = lim.emin if self.subnormals else lim.emin - 1
        a = xc.abs()
        c_bits = a.view(itype).bitwise_and(exp_mask)
        c_bits.clamp_((lowest + bias_d) << nmant, (lim.emax + 1 + bias_d) << nmant).add_((nmant - m) << nmant)
        c = c_bits.view(compute)
        r = (a + c).sub_(c)
        if not self.subnormals:
            r.masked_fill_(r < lim.min_normal, 0.0)
        if lim.saturate:
            if self.inf_nan == "ieee":
                r = torch.where(torch.isinf(a), a, r.clamp_(max=lim.max))
            else:
                r.clamp_(max=lim.max)  # inf becomes max, NaN stays NaN
        elif self.inf_nan == "ieee" and emax_d - lim.emax <= emax_d - 1:
            # Above max means at least 2**(emax + 1) (the grid's next point): scaling by 2**(emax_d - emax)
            # sends exactly those to inf, and scaling back is exact for the rest.
            j = emax_d - lim.emax
            r.mul_(2.0**j).mul_(2.0**-j)
        else:
            r.masked_fill_(r > lim.max, math.inf if self.inf_nan == "ieee" else math.nan)
        return r.copysign_(xc)


class _StraightThrough(torch.autograd.Function):
    """Forward: ``fmt.quantize(x)``; backward: the gradient passes to ``x`` unchanged."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
        return fmt.quantize(x)

    @staticmethod
    def backward(ctx: object, *grads: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grads[0], None


# ---------------------------------------------------------------------------------------------------------
# Built-in formats
# ---------------------------------------------------------------------------------------------------------

float16 = FloatFormat(5, 10, name="float16")
"""IEEE 754 binary16: max 65504, min normal ``2**-14``, min subnormal ``2**-24``."""

bfloat16 = FloatFormat(8, 7, name="bfloat16")
"""bfloat16: float32's exponent range with 7 fraction bits; max ≈ 3.39e38."""

float8_e4m3fn = FloatFormat(4, 3, inf_nan="fn", name="float8_e4m3fn")
"""OCP FP8 E4M3 (``torch.float8_e4m3fn``): max 448, no inf, saturating (as torch's cast from torch 2.13 on;
torch 2.11's gives NaN on overflow)."""

float8_e5m2 = FloatFormat(5, 2, name="float8_e5m2")
"""OCP FP8 E5M2 (``torch.float8_e5m2``): IEEE-style, max 57344, overflow to inf (as torch's cast)."""

# ---------------------------------------------------------------------------------------------------------
# ASSUMPTIONS: cbfloat16
#
# Cerebras documents cbfloat16 as a 16-bit format with 1 sign bit, a 6-bit exponent and a 9-bit mantissa; it
# does not publish the remaining details. dls assumes, here and nowhere else:
#
#   1. bias 31, the IEEE convention 2**(6-1) - 1: min normal 2**-30 ≈ 9.3e-10;
#   2. subnormals (gradual underflow): min subnormal 2**-39 ≈ 1.8e-12;
#   3. IEEE inf/NaN: the all-ones exponent is reserved, so max = (2 - 2**-9) * 2**31 ≈ 4.29e9, and overflow
#      rounds to ±inf (which is what dynamic loss scaling detects);
#   4. round to nearest, ties to even.
#
# To change them, build your own format and install it under the same name, e.g. a variant that flushes
# subnormals:
#
#     dls.formats.register(dls.formats.FloatFormat(6, 9, subnormals=False, name="cbfloat16"))
#
# After that ``get("cbfloat16")``, ``get_half_format()`` and ``dls.emulate(model, "cbfloat16")`` use it;
# ``register(dls.formats.cbfloat16)`` restores the default.
# ---------------------------------------------------------------------------------------------------------
cbfloat16 = FloatFormat(6, 9, bias=31, subnormals=True, inf_nan="ieee", name="cbfloat16")
"""Cerebras cbfloat16 (1-6-9) under the ASSUMPTIONS above: max ≈ 4.29e9, min normal ``2**-30``."""

BUILTIN_FORMATS: tuple[FloatFormat, ...] = (float16, bfloat16, cbfloat16, float8_e4m3fn, float8_e5m2)
_FLOAT8_DTYPE_FORMATS: dict[torch.dtype, FloatFormat] = {
    torch.float8_e4m3fn: float8_e4m3fn,
    torch.float8_e5m2: float8_e5m2,
}

_TORCH_DTYPES: dict[torch.dtype, str] = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
}

_registry: dict[str, FloatFormat] = {fmt.name: fmt for fmt in BUILTIN_FORMATS}


def register(fmt: FloatFormat) -> FloatFormat | None:
    """Make ``fmt`` the format [`get`][dls.formats.get] returns for ``fmt.name``, replacing any format of that name (the
    built-ins included: this is how the cbfloat16 ASSUMPTIONS are overridden). Returns the replaced format, or
    ``None``, so a caller can put it back with ``register(previous)``.

    Args:
        fmt: the format to register under its ``name``.
    """
    if not isinstance(fmt, FloatFormat):
        raise ValueError(f"fmt must be a FloatFormat; got {fmt!r}")
    previous = _registry.get(fmt.name)
    _registry[fmt.name] = fmt
    return previous


def names() -> tuple[str, ...]:
    """Names [`get`][dls.formats.get] accepts, in registration order."""
    return tuple(_registry)


def get(name_or_format: str | FloatFormat | torch.dtype) -> FloatFormat:
    """The registered format of that name (e.g. ``"cbfloat16"``); a ``FloatFormat`` is returned as is, and a
    torch dtype (float16, bfloat16, float8_e4m3fn, float8_e5m2) gives the registered format of its name.

    Args:
        name_or_format: a registered name, a ``FloatFormat``, or a torch dtype.

    Raises:
        ValueError: unknown name or dtype (the message lists the allowed names).
    """
    if isinstance(name_or_format, FloatFormat):
        return name_or_format
    key: object = name_or_format
    if isinstance(name_or_format, torch.dtype):
        key = _TORCH_DTYPES.get(name_or_format, name_or_format)
    if isinstance(key, str) and key in _registry:
        return _registry[key]
    raise ValueError(
        f"name_or_format must be a FloatFormat, a torch float16/bfloat16/float8 dtype or one of "
        f"{', '.join(repr(n) for n in _registry)}; got {name_or_format!r}"
    )


def get_half_format() -> FloatFormat:
    """The (registered) format of the half dtype chosen by [`set_half_dtype`][dls.formats.set_half_dtype]."""
    return get(get_half_dtype_str())
