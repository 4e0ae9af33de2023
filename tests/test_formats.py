"""dls.formats: FloatFormat constants, validation, registry, and bit-exact quantize.

Exactness is checked three ways: against torch's own casts (float16, bfloat16, float8_e4m3fn, float8_e5m2),
against a slow reference that decodes every bit pattern of the format and rounds with Python Fractions
(cbfloat16, and random formats from hypothesis), and against an independent numpy frexp/round/ldexp
reference on 10 million random values (cbfloat16).

torch's casts to float8_e4m3fn changed between releases where a value rounds above 448: torch 2.11 returns NaN,
torch 2.13 saturates to ±448 (``test_torch_float8_e4m3fn_overflow_by_release``). dls's ``float8_e4m3fn`` saturates
on every release, and its ``saturate=False`` twin gives NaN: ``torch_cast`` states that contract, taking torch's
cast everywhere else and checking that torch did one of the two at overflow.
"""

from __future__ import annotations

import bisect
import itertools
import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dls
from dls import formats
from dls.formats import FloatFormat

TORCH_FORMATS = [
    (formats.float16, torch.float16),
    (formats.bfloat16, torch.bfloat16),
    (formats.float8_e4m3fn, torch.float8_e4m3fn),
    (formats.float8_e5m2, torch.float8_e5m2),
]
TORCH_IDS = [f.name for f, _ in TORCH_FORMATS]
E4M3_NAN_ON_OVERFLOW = FloatFormat(4, 3, inf_nan="fn", saturate=False)  # torch 2.11's float8_e4m3fn cast
E4M3_OVERFLOW = 464.0  # magnitudes above it round past 448 in E4M3 (464 itself ties to 448, the even code)


# ------------------------------------------------------------------------------------------ helpers
def bits_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    """Assert a and b (float32, same shape) are bit-identical, NaN matching NaN of any payload."""
    assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    same = (a.view(torch.int32) == b.view(torch.int32)) & (nan_a == nan_b) | (nan_a & nan_b)
    if not bool(same.all()):
        bad = torch.nonzero(~same).flatten()[:5]
        raise AssertionError(f"{int((~same).sum())} mismatches; got {a[bad].tolist()}, expected {b[bad].tolist()}")


def torch_cast(x: torch.Tensor, dtype: torch.dtype, *, saturate: bool = True) -> torch.Tensor:
    """torch's cast ``x.to(dtype).to(x.dtype)``, except where ``dtype`` is float8_e4m3fn and ``x`` rounds above
    448 (±inf included): there ±448 (``saturate``) or NaN, whichever torch's release gives, after checking that
    torch gave one of the two (NaN on torch 2.11, ±448 on 2.13). The reference of dls's formats on every release."""
    cast = x.to(dtype).to(x.dtype)
    if dtype != torch.float8_e4m3fn:
        return cast
    over = x.double().abs() > E4M3_OVERFLOW  # False for NaN
    torch_gave = cast[over].double()
    limit = torch.full_like(torch_gave, 448.0).copysign(x[over].double())
    assert bool(torch.isnan(torch_gave).all()) or torch.equal(torch_gave, limit), "torch's E4M3 overflow changed"
    wanted = torch.full_like(x, 448.0).copysign(x) if saturate else torch.full_like(x, math.nan)
    return torch.where(over, wanted, cast)


def same_floats(got: list[float], expected: list[float]) -> bool:
    """Equal value and sign (so 0.0 != -0.0), NaN equal to NaN."""
    return all(
        (g != g and e != e) or (g == e and math.copysign(1, g) == math.copysign(1, e)) for g, e in zip(got, expected)
    )


def all_codes(dtype: torch.dtype) -> torch.Tensor:
    """Every bit pattern of a 16- or 8-bit torch float dtype, decoded to float32."""
    if dtype.itemsize == 2:
        return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype).float()
    return torch.arange(0, 256, dtype=torch.int32).to(torch.uint8).view(dtype).float()


def structured_inputs(finite_values: list[float], fmt_max: float, top_gap: float) -> torch.Tensor:
    """Every finite value, every midpoint between neighbours, the overflow boundary, their float32 neighbours,
    both signs, plus zeros, infinities, NaN and float32 extremes (float32 tensor)."""
    pos = sorted({abs(v) for v in finite_values})
    mids = [(lo + hi) / 2 for lo, hi in itertools.pairwise(pos)]
    boundary = fmt_max + top_gap / 2
    big = [v for v in (boundary, fmt_max + top_gap, 2 * fmt_max) if v < 2.0**128]
    base = torch.tensor([*pos, *mids, *big], dtype=torch.float64)
    base32 = base.float()
    assert torch.equal(base32.double(), base), "test values must be exact in float32"
    up = torch.nextafter(base32, torch.full_like(base32, math.inf))
    down = torch.nextafter(base32, torch.zeros_like(base32))
    extras = torch.tensor(
        [0.0, math.inf, math.nan, 3.4028234663852886e38, 1.1754943508222875e-38, 1.401298464324817e-45]
    )
    everything = torch.cat([base32, up, down, extras])
    return torch.cat([everything, -everything])


def decode(code: int, fmt: FloatFormat) -> Fraction | str:
    """Reference decoder: the value of a bit pattern of fmt ("inf", "nan" or an exact Fraction, sign
    applied). Written from the encoding rules, independent of FloatFormat's arithmetic."""
    e_bits, m_bits = fmt.exponent_bits, fmt.mantissa_bits
    sign = -1 if code >> (e_bits + m_bits) & 1 else 1
    ef = code >> m_bits & (2**e_bits - 1)
    frac = code & (2**m_bits - 1)
    top = 2**e_bits - 1
    if fmt.inf_nan == "ieee" and ef == top:
        return "nan" if frac else "inf"
    if fmt.inf_nan == "fn" and ef == top and frac == 2**m_bits - 1:
        return "nan"
    if ef == 0:
        if not fmt.subnormals:
            return Fraction(0)
        return sign * Fraction(frac, 2**m_bits) * Fraction(2) ** (1 - fmt.bias)
    return sign * (1 + Fraction(frac, 2**m_bits)) * Fraction(2) ** (ef - fmt.bias)


SHIFT = 1200  # every float64 is an integer multiple of 2**-1074


def to_units(a: Fraction | float) -> int:
    """|a| as an exact integer count of 2**-SHIFT (a is a float or a dyadic Fraction)."""
    n, d = abs(a).as_integer_ratio()
    return n << (SHIFT - d.bit_length() + 1)


class TableReference:
    """Round to nearest by searching the sorted table of all decoded values (ties: the even code), in exact
    integer arithmetic on multiples of 2**-SHIFT."""

    def __init__(self, fmt: FloatFormat) -> None:
        self.fmt = fmt
        by_value: dict[Fraction, int] = {}
        for code in range(2 ** (fmt.exponent_bits + fmt.mantissa_bits)):  # non-negative codes
            v = decode(code, fmt)
            if isinstance(v, Fraction):
                by_value.setdefault(v, code)
        self.values = sorted(by_value)
        self.units = [to_units(v) for v in self.values]
        self.codes = [by_value[v] for v in self.values]
        self.max = self.values[-1]
        top_binade = Fraction(2) ** math.floor(math.log2(self.max))
        self.gap = top_binade / 2**fmt.mantissa_bits
        self.boundary = to_units(self.max + self.gap / 2)
        self.has_inf = fmt.inf_nan == "ieee"

    def __call__(self, x: float) -> float:
        if math.isnan(x):
            return math.nan
        a = to_units(x) if math.isfinite(x) else None
        if a is None or a > self.boundary or (a == self.boundary and self.codes[-1] % 2):
            if (a is None and self.has_inf) or not self.fmt.saturate:
                r = math.inf if self.has_inf else math.nan
            else:
                r = float(self.max)
            return math.copysign(r, x)
        i = bisect.bisect_left(self.units, a)
        if i < len(self.units) and self.units[i] == a:
            return math.copysign(float(self.values[i]), x)
        # Between two values (above max but at most the boundary counts as below max + gap: rounds down).
        lo = self.units[i - 1]
        hi = self.units[i] if i < len(self.units) else to_units(self.max + self.gap)
        tie = a - lo == hi - a
        down = self.codes[i - 1] % 2 == 0 if tie else a - lo < hi - a
        return math.copysign(float(self.values[i - 1] if down else self.values[i]), x)


def round_fraction(x: float, fmt: FloatFormat) -> Fraction:
    """|x| (finite) rounded to fmt's grid with Fractions, binade by binade, ignoring overflow: round half to
    even, flush-after-rounding when the format has no subnormals."""
    a = Fraction(abs(x))
    if a == 0:
        return a
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    emin = 1 - fmt.bias
    ulp = Fraction(2) ** ((max(e, emin) if fmt.subnormals else e) - fmt.mantissa_bits)
    q = a / ulp
    n = math.floor(q)
    if q - n > Fraction(1, 2) or (q - n == Fraction(1, 2) and n % 2):  # ties to the even significand
        n += 1
    r = n * ulp
    if not fmt.subnormals and r < Fraction(2) ** emin:
        r = Fraction(0)
    return r


def rounds_above_max(x: float, fmt: FloatFormat) -> bool:
    return round_fraction(x, fmt) > Fraction(fmt.max)


def arithmetic_reference(x: float, fmt: FloatFormat) -> float:
    """Round x to fmt with Fractions; overflow by fmt.saturate / fmt.inf_nan."""
    if math.isnan(x):
        return math.nan
    has_inf = fmt.inf_nan == "ieee"
    if math.isinf(x):
        return x if has_inf else (math.copysign(fmt.max, x) if fmt.saturate else math.nan)
    r = round_fraction(x, fmt)
    if r > Fraction(fmt.max):
        if fmt.saturate:
            return math.copysign(fmt.max, x)
        return math.copysign(math.inf, x) if has_inf else math.nan
    return math.copysign(float(r), x)


def numpy_reference(x: np.ndarray, fmt: FloatFormat) -> np.ndarray:
    """Vectorised reference for IEEE-style formats with subnormals: frexp, np.round (half to even), ldexp, all
    in float64 (exact for float32 inputs)."""
    a = np.abs(x.astype(np.float64))
    _, ex = np.frexp(a)
    e = np.maximum(ex - 1, 1 - fmt.bias)
    r = np.ldexp(np.round(np.ldexp(a, fmt.mantissa_bits - e)), e - fmt.mantissa_bits)
    r = np.where(r > fmt.max, np.inf, r)
    r = np.where(np.isnan(a), np.nan, np.where(np.isinf(a), np.inf, r))
    return np.copysign(r, x.astype(np.float64)).astype(np.float32)


# ------------------------------------------------------------------------------------------ constants
@pytest.mark.parametrize(("fmt", "dtype"), TORCH_FORMATS, ids=TORCH_IDS)
def test_constants_match_torch_finfo(fmt: FloatFormat, dtype: torch.dtype) -> None:
    fi = torch.finfo(dtype)
    assert fmt.max == fi.max
    assert fmt.min_normal == fi.smallest_normal
    assert fmt.eps == fi.eps
    assert fmt.bits == fi.bits
    codes = all_codes(dtype)
    positive = codes[(codes > 0) & torch.isfinite(codes)]
    assert fmt.min_subnormal == positive.min().item()
    assert fmt.max == positive.max().item()


def test_cbfloat16_constants_and_assumptions() -> None:
    cb = formats.get("cbfloat16")
    assert cb is formats.cbfloat16
    assert (cb.exponent_bits, cb.mantissa_bits, cb.bias, cb.subnormals, cb.inf_nan) == (6, 9, 31, True, "ieee")
    assert cb.saturate is False
    assert cb.max == (2 - 2**-9) * 2.0**31
    assert cb.min_normal == 2.0**-30
    assert cb.min_subnormal == 2.0**-39
    assert cb.eps == 2.0**-9
    ref = TableReference(cb)
    assert float(ref.max) == cb.max
    assert float(ref.values[1]) == cb.min_subnormal


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"exponent_bits": 4, "mantissa_bits": 3, "inf_nan": "fn"}, (448.0, 2.0**-6, 2.0**-9)),
        ({"exponent_bits": 4, "mantissa_bits": 3, "inf_nan": "none"}, (480.0, 2.0**-6, 2.0**-9)),
        ({"exponent_bits": 4, "mantissa_bits": 3}, (240.0, 2.0**-6, 2.0**-9)),
        ({"exponent_bits": 5, "mantissa_bits": 10, "subnormals": False}, (65504.0, 2.0**-14, 2.0**-14)),
        ({"exponent_bits": 3, "mantissa_bits": 0, "inf_nan": "fn"}, (8.0, 2.0**-2, 2.0**-2)),
        ({"exponent_bits": 5, "mantissa_bits": 2, "bias": 16}, (28672.0, 2.0**-15, 2.0**-17)),
    ],
)
def test_constants_of_custom_formats(kwargs: dict, expected: tuple[float, float, float]) -> None:
    fmt = FloatFormat(**kwargs)
    assert (fmt.max, fmt.min_normal, fmt.min_subnormal) == expected
    ref = TableReference(fmt)
    assert float(ref.max) == fmt.max
    assert float(ref.values[1]) == fmt.min_subnormal


def test_defaults_and_repr() -> None:
    fmt = FloatFormat(6, 9)
    assert fmt.bias == 31 and fmt.name == "e6m9" and fmt.subnormals and fmt.inf_nan == "ieee"
    assert fmt == FloatFormat(6, 9, 31)
    assert hash(fmt) == hash(FloatFormat(6, 9, 31))
    assert "exponent_bits=6" in repr(fmt)
    with pytest.raises(AttributeError):
        fmt.mantissa_bits = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"exponent_bits": 0, "mantissa_bits": 3}, "exponent_bits"),
        ({"exponent_bits": 12, "mantissa_bits": 3}, "exponent_bits"),
        ({"exponent_bits": 4.0, "mantissa_bits": 3}, "exponent_bits"),
        ({"exponent_bits": True, "mantissa_bits": 3}, "exponent_bits"),
        ({"exponent_bits": 4, "mantissa_bits": -1}, "mantissa_bits"),
        ({"exponent_bits": 4, "mantissa_bits": 52}, "mantissa_bits"),
        ({"exponent_bits": 4, "mantissa_bits": 3, "inf_nan": "IEEE"}, "inf_nan must be one of 'ieee', 'fn'"),
        ({"exponent_bits": 4, "mantissa_bits": 3, "bias": 2.5}, "bias"),
        ({"exponent_bits": 4, "mantissa_bits": 3, "subnormals": 1}, "subnormals"),
        ({"exponent_bits": 4, "mantissa_bits": 3, "saturate": "yes"}, "saturate"),
        ({"exponent_bits": 4, "mantissa_bits": 3, "inf_nan": "none", "saturate": False}, "saturate"),
        ({"exponent_bits": 1, "mantissa_bits": 3}, "exponent_bits=1"),
        ({"exponent_bits": 11, "mantissa_bits": 3, "bias": 0}, "bias"),
        ({"exponent_bits": 11, "mantissa_bits": 10}, "float64"),
    ],
)
def test_invalid_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FloatFormat(**kwargs)


# ------------------------------------------------------------------------------------------ registry
def test_get_by_name_dtype_and_format() -> None:
    for fmt in formats.BUILTIN_FORMATS:
        assert formats.get(fmt.name) is fmt
    assert formats.get(torch.float16) is formats.float16
    assert formats.get(torch.float8_e4m3fn) is formats.float8_e4m3fn
    custom = FloatFormat(3, 4)
    assert formats.get(custom) is custom
    assert set(formats.names()) >= {"float16", "bfloat16", "cbfloat16", "float8_e4m3fn", "float8_e5m2"}


@pytest.mark.parametrize("bad", ["cbfloat32", "", torch.float32, 16])
def test_get_unknown_lists_names(bad: object) -> None:
    with pytest.raises(ValueError, match=r"name_or_format must be .*'cbfloat16'.*'float8_e5m2'"):
        formats.get(bad)  # type: ignore[arg-type]


def test_register_overrides_cbfloat16_and_restores() -> None:
    variant = FloatFormat(6, 9, subnormals=False, name="cbfloat16")
    previous = formats.register(variant)
    try:
        assert previous is formats.cbfloat16
        assert formats.get("cbfloat16") is variant
        assert variant.quantize(torch.tensor([2.0**-35])).item() == 0.0
    finally:
        formats.register(formats.cbfloat16)
    assert formats.get("cbfloat16") is formats.cbfloat16
    assert formats.cbfloat16.quantize(torch.tensor([2.0**-35])).item() == 2.0**-35
    with pytest.raises(ValueError, match="fmt must be a FloatFormat"):
        formats.register("cbfloat16")  # type: ignore[arg-type]


def test_get_half_format_follows_set_half_dtype() -> None:
    before = dls.get_half_dtype_str()
    try:
        for name in ("float16", "bfloat16", "cbfloat16"):
            dls.set_half_dtype(name)
            assert dls.get_half_format() is formats.get(name)
            assert formats.get_half_format() is formats.get(name)
        assert dls.set_half_dtype("cbfloat16") == torch.float16  # unchanged behaviour of set_half_dtype
    finally:
        dls.set_half_dtype(before)


# ------------------------------------------------------------------------------------------ exactness vs torch
@pytest.mark.parametrize(("fmt", "dtype"), TORCH_FORMATS, ids=TORCH_IDS)
def test_structured_values_match_torch_cast(fmt: FloatFormat, dtype: torch.dtype) -> None:
    codes = all_codes(dtype)
    finite = codes[torch.isfinite(codes)].double().tolist()
    top_gap = fmt.max - max(v for v in finite if v < fmt.max)
    x = structured_inputs(finite, fmt.max, top_gap)
    for quantize in (fmt.quantize, fmt._quantize_generic):  # the cast fast path and the arithmetic
        bits_equal(quantize(x), torch_cast(x, dtype))
        bits_equal(quantize(codes), codes)  # every value (and NaN/inf) of the format maps to itself
    if dtype == torch.float8_e4m3fn:
        bits_equal(E4M3_NAN_ON_OVERFLOW.quantize(x), torch_cast(x, dtype, saturate=False))


@pytest.mark.parametrize(("fmt", "dtype"), TORCH_FORMATS, ids=TORCH_IDS)
def test_overflow_boundary(fmt: FloatFormat, dtype: torch.dtype) -> None:
    below = torch.tensor([fmt.max]).to(dtype).float()
    x = torch.tensor([fmt.max, fmt.max * 1.1, 1e30, math.inf, -math.inf, math.nan])
    q = fmt._quantize_generic(x)
    bits_equal(q, torch_cast(x, dtype))
    bits_equal(fmt.quantize(x), q)
    assert q[0] == below[0]
    if fmt.inf_nan == "ieee":
        assert q[1] == math.inf and q[4] == -math.inf
    else:  # dls's float8_e4m3fn saturates finite overflow and inf, on every torch release
        assert q[1] == fmt.max and q[3] == fmt.max and q[4] == -fmt.max
        assert torch.isnan(E4M3_NAN_ON_OVERFLOW.quantize(x)[1:]).all()
    assert math.isnan(q[5])


def test_torch_float8_e4m3fn_overflow_by_release() -> None:
    # What the docs say of torch's own cast (dls's format does not depend on it): NaN up to torch 2.11,
    # saturation from 2.13 on (pytorch PR 178817); 2.12 is not pinned here.
    x = torch.tensor([465.0, 1e6, math.inf, -math.inf])
    cast = x.to(torch.float8_e4m3fn).float()
    saturated = cast.tolist() == [448.0, 448.0, 448.0, -448.0]
    if torch.__version__ < (2, 12):  # type: ignore[operator]
        assert torch.isnan(cast).all()
    elif torch.__version__ >= (2, 13):  # type: ignore[operator]
        assert saturated
    else:
        assert saturated or bool(torch.isnan(cast).all())


def test_ten_million_random_float32_match_torch_casts() -> None:
    gen = torch.Generator().manual_seed(1234)
    # Uniform bit patterns: every exponent of float32, subnormals, inf and NaN included.
    x = torch.randint(-(2**31), 2**31, (10_000_000,), generator=gen, dtype=torch.int64).to(torch.int32)
    x = x.view(torch.float32)
    for fmt, dtype in TORCH_FORMATS:
        bits_equal(fmt._quantize_generic(x), torch_cast(x, dtype))
        # Plus 1M values concentrated on the format's own exponent range, where rounding matters most.
        exps = torch.randint(fmt.emin - fmt.mantissa_bits - 3, fmt.emax + 3, (1_000_000,), generator=gen)
        mant = torch.rand(1_000_000, generator=gen, dtype=torch.float64) + 1.0
        y = (mant * torch.pow(2.0, exps.double())).float() * torch.where(exps % 2 == 0, 1.0, -1.0)
        bits_equal(fmt._quantize_generic(y), torch_cast(y, dtype))


@pytest.mark.parametrize("in_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("fmt", "dtype"), TORCH_FORMATS, ids=TORCH_IDS)
def test_every_half_input_matches_torch_cast(in_dtype: torch.dtype, fmt: FloatFormat, dtype: torch.dtype) -> None:
    x = all_codes(in_dtype).to(in_dtype)
    q = fmt._quantize_generic(x)
    assert q.dtype == in_dtype
    bits_equal(q.float(), torch_cast(x, dtype).float())
    bits_equal(fmt.quantize(x).float(), q.float())


def test_float8_input_keeps_dtype() -> None:
    x = all_codes(torch.float8_e5m2).to(torch.float8_e5m2)
    q = formats.float16.quantize(x)
    assert q.dtype == torch.float8_e5m2
    bits_equal(q.float(), x.float())  # e5m2 values are float16 values
    bits_equal(formats.float8_e4m3fn.quantize(x).float(), torch_cast(x.float(), torch.float8_e4m3fn))
    # Rounding a float8 tensor to a coarser format: the result is rounded back to the tensor's own format by dls,
    # not by torch's cast (E4M3's 448 rounds to 512 in E5M1, which an E4M3 tensor holds as 448 on every release).
    e4m3 = all_codes(torch.float8_e4m3fn).to(torch.float8_e4m3fn)
    coarse = FloatFormat(5, 1)
    q = coarse.quantize(e4m3)
    assert q.dtype == torch.float8_e4m3fn
    bits_equal(q.float(), formats.float8_e4m3fn.quantize(coarse.quantize(e4m3.float())))
    assert coarse.quantize(torch.tensor([448.0])).item() == 512.0 and q.float().nan_to_num().abs().max() == 448.0


def test_float64_input_is_rounded_once_correctly() -> None:
    # A double within 2**-40 of a float16 midpoint: torch's cast rounds to float32 first (landing on the
    # midpoint) and then ties to even; the correct rounding goes the other way.
    x = torch.tensor([1 + 2**-11 + 2**-40, -(1 + 2**-11 + 2**-40), 1 + 3 * 2**-11 - 2**-40], dtype=torch.float64)
    q = formats.float16.quantize(x)
    assert q.dtype == torch.float64
    assert q.tolist() == [1 + 2**-10, -(1 + 2**-10), 1 + 2**-10]
    assert x[0].to(torch.float16).item() == 1.0  # torch double-rounds; dls does not
    # Against the Fraction reference on midpoints +- a few float64 ulps, for every torch format and cbfloat16.
    gen = torch.Generator().manual_seed(7)
    for fmt in formats.BUILTIN_FORMATS:
        ref = TableReference(fmt) if fmt.bits == 8 else None
        vals = torch.rand(300, generator=gen, dtype=torch.float64) * 2 + 1
        scale = torch.pow(2.0, torch.randint(fmt.emin - fmt.mantissa_bits, fmt.emax + 1, (300,), generator=gen))
        q = fmt.quantize(vals * scale)
        _, ex = torch.frexp(q)
        ulp = torch.clamp(torch.ldexp(torch.ones_like(q), ex - 1) * fmt.eps, min=fmt.min_subnormal)
        mids = q + ulp / 2
        x = torch.cat([mids, torch.nextafter(mids, mids * 2), torch.nextafter(mids, mids * 0), vals * scale])
        got = fmt.quantize(x).tolist()
        assert same_floats(got, [arithmetic_reference(v, fmt) for v in x.tolist()]), fmt.name
        if ref is not None:
            assert same_floats(got, [ref(v) for v in x.tolist()]), fmt.name
    # Doubles that are exact float32 values agree with torch's casts.
    for fmt, dtype in TORCH_FORMATS:
        y = torch.randn(10_000, generator=gen).double() * 100
        bits_equal(fmt.quantize(y).float(), torch_cast(y, dtype).float())


# ------------------------------------------------------------------------------------------ cbfloat16
@pytest.fixture(scope="module")
def cb_reference() -> TableReference:
    return TableReference(formats.cbfloat16)


def test_cbfloat16_structured_values_match_fraction_reference(cb_reference: TableReference) -> None:
    fmt = formats.cbfloat16
    finite = [float(v) for v in cb_reference.values]
    x = structured_inputs(finite, fmt.max, float(cb_reference.gap))
    got = fmt.quantize(x).tolist()
    expected = [cb_reference(v) for v in x.tolist()]
    mismatches = [(v, g, e) for v, g, e in zip(x.tolist(), got, expected) if not same_floats([g], [e])]
    assert not mismatches, mismatches[:5]
    # Signs of zeros and of tiny results are kept.
    z = fmt.quantize(torch.tensor([-0.0, 0.0, -(2.0**-41), 2.0**-41]))
    assert torch.equal(torch.signbit(z), torch.tensor([True, False, True, False])) and (z == 0).all()
    # Every cbfloat16 value maps to itself.
    v = torch.tensor(finite)
    assert torch.equal(fmt.quantize(v), v) and torch.equal(fmt.quantize(-v), -v)


def test_cbfloat16_random_values_match_references(cb_reference: TableReference) -> None:
    fmt = formats.cbfloat16
    gen = torch.Generator().manual_seed(99)
    x = torch.randint(-(2**31), 2**31, (8_000_000,), generator=gen, dtype=torch.int64).to(torch.int32)
    x = x.view(torch.float32)
    exps = torch.randint(fmt.emin - fmt.mantissa_bits - 3, fmt.emax + 3, (1_000_000,), generator=gen)
    y = ((torch.rand(1_000_000, generator=gen, dtype=torch.float64) + 1) * torch.pow(2.0, exps.double())).float()
    x = torch.cat([x, y, -y])  # 10 million
    with np.errstate(invalid="ignore"):  # signalling NaN bit patterns
        expected = torch.from_numpy(numpy_reference(x.numpy(), fmt))
    bits_equal(fmt.quantize(x), expected)
    sample = torch.cat([x[:5_000], y[:20_000]]).tolist()
    got = fmt.quantize(torch.tensor(sample)).tolist()
    assert same_floats(got, [cb_reference(v) for v in sample])


# ------------------------------------------------------------------------------------------ any format
@st.composite
def format_and_values(draw: st.DrawFn) -> tuple[FloatFormat, list[float]]:
    e = draw(st.integers(2, 8))
    m = draw(st.integers(0, 12))
    bias = 2 ** (e - 1) - 1 + draw(st.integers(-3, 3))
    inf_nan = draw(st.sampled_from(formats.INF_NAN_MODES))
    saturate = True if inf_nan == "none" else draw(st.sampled_from([None, True, False]))
    try:
        fmt = FloatFormat(e, m, bias, draw(st.booleans()), inf_nan, saturate=saturate)
    except ValueError:
        fmt = FloatFormat(e + 1, m, None, True, inf_nan, saturate=saturate)
    near = st.builds(
        lambda mant, ex, neg: (-1 if neg else 1) * math.ldexp(mant, ex - 24),
        st.integers(2**23, 2**24 - 1),
        st.integers(fmt.emin - fmt.mantissa_bits - 3, fmt.emax + 2),
        st.booleans(),
    )
    values = draw(st.lists(st.one_of(near, st.floats(width=32)), min_size=1, max_size=40))
    return fmt, values


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(format_and_values())
def test_random_formats_match_fraction_reference(case: tuple[FloatFormat, list[float]]) -> None:
    fmt, values = case
    x = torch.tensor(values, dtype=torch.float32)
    got = fmt.quantize(x)
    expected = torch.tensor([arithmetic_reference(v, fmt) for v in x.tolist()], dtype=torch.float32)
    bits_equal(got, expected)
    got64 = fmt.quantize(x.double())  # the float64 path agrees on float32 inputs
    bits_equal(got64.float(), expected)
    _, nonzero, under, over = fmt.quantize_and_count(x)
    finite = [v for v in x.tolist() if math.isfinite(v) and v != 0]
    assert nonzero.item() == len(finite)
    assert under.item() == sum(arithmetic_reference(v, fmt) == 0 for v in finite)
    assert over.item() == sum(rounds_above_max(v, fmt) for v in finite)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(formats.BUILTIN_FORMATS), st.lists(st.floats(width=32, allow_nan=False), min_size=2))
def test_quantize_properties(fmt: FloatFormat, values: list[float]) -> None:
    x = torch.tensor(sorted(values), dtype=torch.float32)
    q = fmt.quantize(x)
    assert torch.equal(fmt.quantize(q), q)  # idempotent
    assert torch.equal(fmt.quantize(-x), -q)  # odd
    assert bool((q[1:] >= q[:-1]).all())  # monotone
    finite = torch.isfinite(q) & (x.abs() <= fmt.max)
    err = (q - x).double().abs()[finite]
    ulp = torch.clamp(x.double().abs()[finite] * fmt.eps, min=fmt.min_subnormal)
    assert bool((err <= ulp).all())


# ------------------------------------------------------------------------------------------ semantics
def test_subnormals_false_flushes_after_rounding() -> None:
    fmt = FloatFormat(5, 10, subnormals=False)
    mn = fmt.min_normal
    x = torch.tensor([mn, mn * (1 - 2**-12), mn * (1 - 2**-10), mn / 2, -mn / 4, 2.0**-24])
    q = fmt.quantize(x)
    assert q.tolist() == [mn, mn, 0.0, 0.0, -0.0, 0.0]
    assert torch.signbit(q[4])


def test_overflow_modes() -> None:
    x = torch.tensor([470.0, 1e6, math.inf, -math.inf, math.nan])
    fn_sat = FloatFormat(4, 3, inf_nan="fn")
    assert fn_sat.quantize(x)[:4].tolist() == [448.0, 448.0, 448.0, -448.0]
    fn_nan = FloatFormat(4, 3, inf_nan="fn", saturate=False)
    assert torch.isnan(fn_nan.quantize(x)).all()
    assert fn_nan.quantize(torch.tensor([464.0])).item() == 448.0  # tie to even stays finite
    none = FloatFormat(4, 3, inf_nan="none")
    assert none.quantize(x)[:4].tolist() == [480.0, 480.0, 480.0, -480.0]
    ieee_sat = FloatFormat(5, 10, saturate=True)
    assert ieee_sat.quantize(torch.tensor([1e6, -1e6, math.inf, -math.inf])).tolist() == [
        65504.0,
        -65504.0,
        math.inf,
        -math.inf,
    ]


def test_wide_format_uses_float64_and_stays_exact() -> None:
    fmt = FloatFormat(8, 23, name="float32-like")  # one bit too wide for float32 arithmetic
    assert fmt._lim.compute == torch.float64
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(3)) * 1e20
    bits_equal(fmt.quantize(x), x)
    wide = FloatFormat(10, 30)
    y = torch.randn(1000, dtype=torch.float64, generator=torch.Generator().manual_seed(4)) * 1e38
    assert fmt.quantize(y).tolist() == y.float().double().tolist()
    assert wide.quantize(y).tolist() == [arithmetic_reference(v, wide) for v in y.tolist()]


def test_dtype_shape_and_layout() -> None:
    x = torch.randn(7, 5, dtype=torch.float64)
    for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
        q = formats.cbfloat16.quantize(x.to(dtype))
        assert q.dtype == dtype and q.shape == x.shape
    t = x.float().t()
    assert torch.equal(formats.float16.quantize(t), formats.float16.quantize(x.float()).t())
    assert formats.float16.quantize(torch.empty(0)).shape == (0,)
    with pytest.raises(TypeError, match="floating-point"):
        formats.float16.quantize(torch.arange(3))
    # 65504 ties to 65536 in cbfloat16, which a float16 result cannot hold.
    assert formats.cbfloat16.quantize(torch.tensor([65504.0])).item() == 65536.0
    assert formats.cbfloat16.quantize(torch.tensor([65504.0], dtype=torch.float16)).item() == math.inf


def test_result_is_a_new_tensor() -> None:
    for x in (torch.ones(3, dtype=torch.float16), torch.ones(3), torch.ones(3, dtype=torch.bfloat16)):
        for fmt in formats.BUILTIN_FORMATS:
            q = fmt.quantize(x)
            assert q.data_ptr() != x.data_ptr() and torch.equal(q, x)


def test_straight_through_gradient() -> None:
    x = torch.tensor([0.1, 1e-9, 70000.0], requires_grad=True)
    y = formats.float16.quantize(x, straight_through=True)
    assert y.requires_grad
    assert torch.equal(y.detach(), formats.float16.quantize(x.detach()))
    (y * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    assert x.grad is not None and x.grad.tolist() == [1.0, 2.0, 3.0]
    plain = formats.float16.quantize(x)
    assert not plain.requires_grad


def test_fractions_and_counts() -> None:
    fmt = formats.float16
    x = torch.tensor([0.0, 1.0, 1e-9, -1e-10, 1e5, -7e4, math.inf, math.nan, 3e-8, 65519.0])
    # nonzero finite: 1, 1e-9, -1e-10, 1e5, -7e4, 3e-8, 65519; flushed: 1e-9, -1e-10 (3e-8 > 2**-25 rounds up);
    # overflowing: 1e5 and -7e4 (65519 rounds down to 65504).
    nonzero, under, over = fmt.count_underflow_overflow(x)
    assert (nonzero.item(), under.item(), over.item()) == (7, 2, 2)
    assert fmt.fraction_underflow(x) == pytest.approx(2 / 7)
    assert fmt.fraction_overflow(x) == pytest.approx(2 / 7)
    assert fmt.fraction_underflow(torch.zeros(3)) == 0.0
    assert formats.float8_e4m3fn.fraction_overflow(torch.tensor([500.0, 400.0])) == 0.5  # saturated counts
    assert formats.cbfloat16.fraction_underflow(torch.tensor([1e-9, 1e-13])) == 0.5


def test_torch_dtype_is_decided_by_numerics() -> None:
    for fmt, dtype in TORCH_FORMATS:
        assert fmt.torch_dtype == dtype
    assert FloatFormat(5, 10, name="half").torch_dtype == torch.float16
    assert FloatFormat(4, 3, inf_nan="fn", saturate=False).torch_dtype is None
    assert FloatFormat(5, 10, subnormals=False).torch_dtype is None
    assert formats.cbfloat16.torch_dtype is None


@pytest.mark.parametrize("fmt", formats.BUILTIN_FORMATS, ids=lambda f: f.name)
def test_overflow_count_matches_non_saturating_rounding(fmt: FloatFormat) -> None:
    # An element overflows when it rounds above max; a non-saturating twin shows that as inf or NaN.
    twin = FloatFormat(fmt.exponent_bits, fmt.mantissa_bits, fmt.bias, fmt.subnormals, fmt.inf_nan, saturate=False)
    top = fmt.max
    x = torch.tensor([top * (1 + k * fmt.eps / 8) for k in range(-4, 20)] + [math.inf, math.nan, 0.0, 1.0])
    x = torch.cat([x, torch.nextafter(x, x * 2), torch.nextafter(x, x * 0)]).float()
    x = torch.cat([x, -x])
    q, nonzero, under, over = fmt.quantize_and_count(x)
    bits_equal(q, fmt.quantize(x))
    finite = torch.isfinite(x)
    assert over.item() == int((finite & ~torch.isfinite(twin.quantize(x))).sum()) > 0
    assert nonzero.item() == int((finite & (x != 0)).sum())
    assert under.item() == 0


@pytest.mark.cuda
def test_cuda_matches_cpu_and_torch() -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randint(-(2**31), 2**31, (2_000_000,), generator=gen, dtype=torch.int64).to(torch.int32)
    x = x.view(torch.float32)
    xc = x.cuda()
    for fmt, dtype in TORCH_FORMATS:
        bits_equal(fmt._quantize_generic(xc).cpu(), torch_cast(xc, dtype).cpu())
    for fmt in formats.BUILTIN_FORMATS:
        bits_equal(fmt._quantize_generic(xc).cpu(), fmt._quantize_generic(x))
        bits_equal(fmt.quantize(xc).cpu(), fmt.quantize(x))
        assert fmt.quantize(xc.half()).device == xc.device
