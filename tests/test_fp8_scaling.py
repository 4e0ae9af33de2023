"""dls.fp8.scale_from_amax and dls.fp8.mx_quantize, bit for bit against independent references.

scale_from_amax: numpy float32 arithmetic (IEEE division, frexp for the power of two) on a million random
float32 bit patterns covering the whole range (subnormals, inf, NaN included) plus hand-picked edges, and
exact rational arithmetic (fractions) for margins far beyond float32's range. mx_quantize: torchao's ``to_mx``
(a pinned dev dependency) byte for byte, and the exact power-of-two rounding where torchao's CPU code deviates.
"""

from __future__ import annotations

import math
import warnings
from fractions import Fraction

import numpy as np
import pytest
import torch

import dls.fp8
from dls.fp8 import scaling

with warnings.catch_warnings():  # torchao warns about its CUDA-only extensions on import
    warnings.simplefilter("ignore")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx

FLT_MAX = float(np.finfo(np.float32).max)
FP8 = {"e4m3": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0)}


def random_amax(n: int, seed: int) -> np.ndarray:
    """``n`` non-negative float32 values: uniform random bit patterns (every exponent equally likely, so
    subnormals, huge values, inf and NaN all occur) followed by hand-picked edges."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2**31, size=n, dtype=np.uint32)
    edges = np.array(
        [0.0, np.inf, np.nan, FLT_MAX, 2.0**-126, 2.0**-149, 3 * 2.0**-149, 2.0**-127, 1.0, 448.0, 57344.0,
         448.0 / FLT_MAX, 57344.0 / FLT_MAX, 448.0 / FLT_MAX / 2, 2.0**-140 * 1.5, 1e-12, 0.75, 1e30, 3.0],
        dtype=np.float32,
    )  # fmt: skip
    with np.errstate(over="ignore"):
        up, down = np.nextafter(edges[3:], np.float32(np.inf)), np.nextafter(edges[3:], np.float32(0))
    return np.concatenate([bits.view(np.float32), edges, up, down])


def numpy_reference(amax: np.ndarray, fp8_max: float, margin: int, power_2: bool, eps: float) -> np.ndarray:
    with np.errstate(all="ignore"):
        a = np.maximum(amax, np.float32(eps))  # NaN propagates
        numerator = np.float32(fp8_max * 2.0**-margin)  # exact for the margins used with this reference
        scale = numerator / a  # one IEEE float32 division
        scale = np.where(np.isinf(scale), np.float32(FLT_MAX), scale).astype(np.float32)
        if power_2:
            _, exponent = np.frexp(scale)  # scale = mantissa * 2**exponent, 0.5 <= mantissa < 1
            scale = np.where(scale > 0, np.ldexp(np.float32(0.5), exponent), scale).astype(np.float32)
        special = (a == 0) | ~np.isfinite(a)
        return np.where(special, np.float32(1.0), scale).astype(np.float32)


@pytest.fixture(scope="module")
def amax() -> np.ndarray:
    return random_amax(1 << 20, seed=0)


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("power_2", [False, True])
def test_scale_from_amax_is_bitwise_the_float32_rule(amax: np.ndarray, fmt: str, power_2: bool) -> None:
    dtype, fp8_max = FP8[fmt]
    t = torch.from_numpy(amax)
    for margin in (0, 2, -3):
        for eps in (0.0, 1e-12, 0.75):
            got = dls.fp8.scale_from_amax(t, dtype, margin=margin, power_2=power_2, eps=eps).numpy()
            want = numpy_reference(amax, fp8_max, margin, power_2, eps)
            bad = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
            assert bad.size == 0, (margin, eps, amax[bad[:5]], got[bad[:5]], want[bad[:5]])


def round_to_float32(q: Fraction) -> float:
    """The float32 nearest to the positive rational ``q`` (ties to even), as a float; inf on overflow."""
    e = q.numerator.bit_length() - q.denominator.bit_length()
    if Fraction(2) ** e > q:
        e -= 1  # now 2**e <= q < 2**(e + 1)
    ulp = Fraction(2) ** (max(e, -126) - 23)
    k, rest = divmod(q, ulp)
    k = int(k) + (rest > ulp / 2 or (rest == ulp / 2 and int(k) % 2 == 1))
    value = k * ulp
    return math.inf if value >= 2**128 else float(value)


def exact_reference(amax: float, fp8_max: float, margin: int, power_2: bool) -> float:
    if amax == 0 or not math.isfinite(amax):
        return 1.0
    scale = round_to_float32(Fraction(fp8_max) * Fraction(2) ** -margin / Fraction(amax))
    scale = FLT_MAX if math.isinf(scale) else scale
    if power_2 and scale > 0:
        scale = math.ldexp(0.5, math.frexp(scale)[1])
    return scale


@pytest.mark.parametrize("fmt", FP8)
def test_scale_from_amax_matches_exact_rational_arithmetic_for_any_margin(fmt: str) -> None:
    dtype, fp8_max = FP8[fmt]
    values = random_amax(600, seed=1)
    values = values[np.isfinite(values)]
    for margin in (0, 7, 140, -120, 1000, -1000):
        for power_2 in (False, True):
            got = dls.fp8.scale_from_amax(torch.from_numpy(values), dtype, margin=margin, power_2=power_2)
            want = [exact_reference(float(a), fp8_max, margin, power_2) for a in values]
            assert got.tolist() == want, (margin, power_2)


def test_scale_from_amax_special_values_follow_transformer_engine() -> None:
    amax = torch.tensor([0.0, math.inf, math.nan, 448.0 / FLT_MAX / 2, 2.0])
    scale = dls.fp8.scale_from_amax(amax, torch.float8_e4m3fn)
    assert scale.tolist() == [1.0, 1.0, 1.0, FLT_MAX, 224.0]
    assert scale.dtype == torch.float32
    # eps lifts a zero amax: the scale is then fp8_max / eps (eps rounded to float32 first)
    assert dls.fp8.scale_from_amax(0.0, "e5m2", eps=0.5).item() == 57344.0 * 2
    assert dls.fp8.scale_from_amax(torch.tensor(3.0, dtype=torch.float64), "float8_e4m3fn").dtype == torch.float32


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"fp8_dtype": torch.float16}, "fp8_dtype"),
        ({"fp8_dtype": "e4m3fnuz"}, "fp8_dtype"),
        ({"margin": 1.5}, "margin"),
        ({"margin": True}, "margin"),
        ({"margin": 1001}, "margin"),
        ({"power_2": 1}, "power_2"),
        ({"eps": -1.0}, "eps"),
        ({"eps": math.inf}, "eps"),
        ({"eps": 1e39}, "eps"),
        ({"amax": torch.tensor([1, 2])}, "amax"),
    ],
)
def test_scale_from_amax_rejects_bad_arguments_by_name(kwargs: dict[str, object], name: str) -> None:
    args: dict[str, object] = {"amax": torch.tensor(1.0), "fp8_dtype": torch.float8_e4m3fn, **kwargs}
    with pytest.raises(ValueError, match=name):
        dls.fp8.scale_from_amax(**args)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------------- MXFP8
MODES = {"rceil": ScaleCalculationMode.RCEIL, "floor": ScaleCalculationMode.FLOOR}


def exact_rceil_exponents(blocks: torch.Tensor, fp8_max: float) -> list[int]:
    """RCEIL's biased exponents from exact arithmetic: ceil(log2(amax / fp8_max)) (the quotient one float32
    division, here numpy's), clamped to -127..127; 254 for inf, 255 for NaN."""
    out = []
    with np.errstate(invalid="ignore"):
        quotients = np.abs(blocks.numpy()).max(-1) / np.float32(fp8_max)
    for d in quotients.tolist():
        if math.isnan(d):
            out.append(255)
        elif math.isinf(d):
            out.append(254)
        elif d == 0:
            out.append(0)
        else:
            m, e = math.frexp(d)  # d = m * 2**e, 0.5 <= m < 1
            out.append(min(max(e - 1 if m == 0.5 else e, -127), 127) + 127)
    return out


def torchao_bytes(x: torch.Tensor, dtype: torch.dtype, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    scale, data = to_mx(x, dtype, 32, MODES[mode])
    return scale.view(torch.uint8), data.view(torch.uint8)


def dls_bytes(x: torch.Tensor, dtype: torch.dtype, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    e, payload = dls.fp8.mx_quantize(x, dtype, mode)
    return e, payload.to(dtype).view(torch.uint8)  # the payload is on the FP8 grid: this cast is exact


@pytest.fixture(scope="module")
def mx_values() -> torch.Tensor:
    """A million float32 values in blocks of 32 whose magnitudes span float32's range (2**-140 .. 2**124)."""
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randn(1 << 15, 32, generator=gen)
    return (blocks * torch.exp2(torch.randint(-140, 125, (1 << 15, 1), generator=gen).float())).reshape(-1, 256)


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("mode", MODES)
def test_mx_quantize_equals_torchao_to_mx_on_a_million_values(mx_values: torch.Tensor, fmt: str, mode: str) -> None:
    dtype, fp8_max = FP8[fmt]
    e, data = dls_bytes(mx_values, dtype, mode)
    e_ref, data_ref = torchao_bytes(mx_values, dtype, mode)
    assert e.shape == (mx_values.shape[0], mx_values.shape[1] // 32)
    assert torch.equal(e, e_ref)
    assert torch.equal(data, data_ref)
    if mode == "rceil":
        assert e.flatten().tolist() == exact_rceil_exponents(mx_values.reshape(-1, 32), fp8_max)


def edge_blocks() -> torch.Tensor:
    gen = torch.Generator().manual_seed(2)
    rows = []
    for v in [0.0, -0.0, math.inf, -math.inf, math.nan, 448.0, -57344.0, FLT_MAX, 2.0**-149, 2.0**-126,
              1.5 * 2.0**-127, 1e-40, 6e-36, 2.0**-118]:  # fmt: skip
        one = torch.zeros(32)
        one[3], one[7] = v, 1.0
        rows += [one, torch.full((32,), v), torch.cat([torch.tensor([v]), torch.randn(31, generator=gen) * 1e-38])]
    mixed = torch.randn(32, generator=gen)
    mixed[0], mixed[1] = math.inf, -math.nan
    rows.append(mixed)
    return torch.stack(rows)


def just_above_powers_of_two(fp8_max: float) -> torch.Tensor:
    """Blocks whose amax / fp8_max is 2**k * (1 + 2**-23): RCEIL must round up to 2**(k + 1)."""
    rows = []
    for k in range(-120, 110, 9):
        quotient = torch.tensor(math.ldexp(1 + 2**-23, k), dtype=torch.float32)
        amax = quotient * fp8_max
        if (amax / fp8_max).item() != quotient.item():  # keep the blocks where the division lands on it
            continue
        block = torch.linspace(-1, 1, 32) * amax
        rows.append(block)
    return torch.stack(rows)


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("mode", MODES)
def test_mx_quantize_edge_blocks(fmt: str, mode: str) -> None:
    """Zeros, inf, NaN, subnormals and extremes: equal to torchao. Quotients just above a power of two: RCEIL
    is the exact round-up (the hardware rule), where torchao's CPU fallback ``ceil(log2(.))`` in float32 gives
    the power of two itself from ``|k| >= 4`` on; that deviation is the only one."""
    dtype, fp8_max = FP8[fmt]
    edges = edge_blocks()
    e, data = dls_bytes(edges, dtype, mode)
    e_ref, data_ref = torchao_bytes(edges, dtype, mode)
    assert torch.equal(e, e_ref)
    assert torch.equal(data, data_ref)
    if mode == "rceil":
        assert e.flatten().tolist() == exact_rceil_exponents(edges, fp8_max)
        near = just_above_powers_of_two(fp8_max)
        e, _ = dls_bytes(near, dtype, mode)
        e_ref, _ = torchao_bytes(near, dtype, mode)
        exact = exact_rceil_exponents(near, fp8_max)
        assert e.flatten().tolist() == exact
        deviating = [i for i, (a, b) in enumerate(zip(e_ref.flatten().tolist(), exact)) if a != b]
        assert deviating and all(e_ref.flatten()[i] == exact[i] - 1 for i in deviating)


def test_mx_quantize_blocks_along_any_dim_and_decodes() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 40, generator=gen)
    e0, p0 = dls.fp8.mx_quantize(x, torch.float8_e4m3fn, dim=0)
    e1, p1 = dls.fp8.mx_quantize(x.t().contiguous(), torch.float8_e4m3fn)
    assert e0.shape == (2, 40) and p0.shape == x.shape
    assert torch.equal(e0, e1.t()) and torch.equal(p0, p1.t())
    decoded = p0 * scaling.mx_block_scale(e0.to(torch.int32)).repeat_interleave(32, 0)
    assert ((decoded - x).abs() <= x.abs() * 2**-3 + 2.0**-9 * decoded.abs().max()).all()
    e16, p16 = dls.fp8.mx_quantize(x.to(torch.bfloat16), "e5m2", "floor", dim=0)
    assert e16.dtype == torch.uint8 and p16.dtype == torch.float32


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"fp8_dtype": torch.bfloat16}, "fp8_dtype"),
        ({"scale_mode": "ceil"}, "scale_mode"),
        ({"dim": 2}, "dim"),
        ({"dim": 0}, "multiple of 32"),
        ({"saturate": None}, "saturate"),
        ({"x": torch.zeros(32, dtype=torch.int32)}, "x"),
    ],
)
def test_mx_quantize_rejects_bad_arguments_by_name(kwargs: dict[str, object], name: str) -> None:
    args: dict[str, object] = {"x": torch.zeros(3, 64), "fp8_dtype": torch.float8_e4m3fn, **kwargs}
    with pytest.raises(ValueError, match=name):
        dls.fp8.mx_quantize(**args)  # type: ignore[arg-type]
