"""FP8 scaling recipes: small frozen descriptions of how each GEMM operand is scaled and cast.

A Linear layer runs three GEMMs, and each has two FP8 operands:

=============  ========================  ==============================
GEMM           operands                  reduction axis
=============  ========================  ==============================
output         input, weight             in_features
grad_input     grad_output, weight       out_features
grad_weight    grad_output, input        the batch (all leading dims)
=============  ========================  ==============================

Roles: ``"input"`` and ``"weight"`` are cast in the forward pass, ``"grad_output"`` (the gradient flowing
into the layer's output, already multiplied by the loss scale when a ``dls.GradScaler`` is used) in the
backward pass. ``fp8_format="hybrid"`` (default) casts inputs and weights to E4M3 (max 448, 3 mantissa bits)
and gradients to E5M2 (max 57344, more range); ``"e4m3"`` uses E4M3 for all three.

Per-tensor recipes ([`CurrentScaling`][dls.fp8.CurrentScaling] with ``granularity="tensor"``,
[`DelayedScaling`][dls.fp8.DelayedScaling], [`StaticScaling`][dls.fp8.StaticScaling]) cast each operand once and reuse
the forward casts of input and weight in backward. Per-row and per-block recipes (``granularity="row"``,
[`MXFP8`][dls.fp8.MXFP8]) scale along the reduction axis of each GEMM, so they cast an operand once per GEMM it enters,
from its high-precision values.

``saturate_gradients`` (every recipe) decides what happens to a gradient whose scaled value exceeds the
format's max. ``True`` (default, as TransformerEngine and torchao): it is clamped to ±max. The step then goes
on with a clipped gradient, and a ``dls.GradScaler`` does *not* see an overflow (the cast hid it).
``False``: it becomes inf (E5M2) or NaN (E4M3), which propagates into the parameter gradients, where
``GradScaler`` detects it, skips the step and lowers the loss scale. Forward casts always saturate.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from dls.fp8.scaling import MX_SCALE_MODES, check_eps

__all__ = ["FP8_FORMATS", "MXFP8", "ROLES", "CurrentScaling", "DelayedScaling", "Recipe", "StaticScaling"]

FP8_FORMATS = ("hybrid", "e4m3")
ROLES = ("input", "weight", "grad_output")
GRANULARITIES = ("tensor", "row")
AMAX_COMPUTE_ALGOS = ("max", "most_recent")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False; got {value!r}")


def _check_choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(repr(a) for a in allowed)}; got {value!r}")


class _Recipe:
    """Shared behaviour: the FP8 dtype of each role, and a plain-dict description (for checkpoints)."""

    fp8_format: str

    def dtype_name(self, role: str) -> str:
        """``"float8_e4m3fn"`` or ``"float8_e5m2"``: the format ``role`` is cast to."""
        return "float8_e5m2" if role == "grad_output" and self.fp8_format == "hybrid" else "float8_e4m3fn"

    def to_dict(self) -> dict[str, Any]:
        """``{"recipe": short name, **fields}`` (plain values): [`recipe_from_dict`][dls.fp8.recipe_from_dict] rebuilds
        it."""
        name = next(n for n, cls in RECIPE_NAMES.items() if cls is type(self))
        return {"recipe": name, **dataclasses.asdict(self)}  # type: ignore[call-overload]

    def describe(self) -> str:
        """``"delayed scaling, margin 2"``: the short name, then the fields that differ from the defaults."""
        fields, defaults = self.to_dict(), type(self)().to_dict()
        changed = [f"{key} {value}" for key, value in fields.items() if defaults[key] != value]
        return ", ".join([f"{fields['recipe']} scaling", *changed])


@dataclasses.dataclass(frozen=True)
class CurrentScaling(_Recipe):
    """Scale each tensor from its own amax, at the moment it is cast (dynamic, stateless).

    ``granularity="tensor"``: one scale per operand, [`dls.fp8.scale_from_amax`][dls.fp8.scale_from_amax] of the
    tensor's amax. With the defaults this is torchao's ``tensorwise`` recipe (``Float8LinearConfig()``), tested equal to
    ``convert_to_float8_training(..., Float8LinearConfig(emulate=True))``: same payloads and scales, outputs and
    gradients equal to float32 rounding. (torchao clamps the amax at 1e-12: ``amax_epsilon=1e-12`` reproduces
    it for tensors whose amax is below that, all-zero ones included.) TransformerEngine's
    ``Float8CurrentScaling`` is the same rule.

    ``granularity="row"``: one scale per row along each GEMM's reduction axis (torchao's ``axiswise`` /
    ``rowwise``: with ``power_2_scales=True, fp8_format="e4m3"`` this is its ``rowwise`` recipe, tested equal).

    A tensor (or row) whose amax is 0, inf or NaN is cast with scale 1, TransformerEngine's rule (torchao's
    scale would be 0 or NaN there): inf saturates to ±max in forward casts, NaN stays NaN.

    Args:
        power_2_scales: round every scale down to a power of two (exact; multiplying by it is then exact).
        amax_epsilon: lower bound on the amax a scale is computed from (finite, ``>= 0``).
        granularity: ``"tensor"`` or ``"row"``.
        fp8_format: ``"hybrid"`` (E4M3 forward, E5M2 gradients) or ``"e4m3"``.
        saturate_gradients: see the module docstring.
    """

    power_2_scales: bool = False
    amax_epsilon: float = 0.0
    granularity: str = "tensor"
    fp8_format: str = "hybrid"
    saturate_gradients: bool = True

    def __post_init__(self) -> None:
        _check_bool("power_2_scales", self.power_2_scales)
        object.__setattr__(self, "amax_epsilon", check_eps(self.amax_epsilon, "amax_epsilon"))
        _check_choice("granularity", self.granularity, GRANULARITIES)
        _check_choice("fp8_format", self.fp8_format, FP8_FORMATS)
        _check_bool("saturate_gradients", self.saturate_gradients)


@dataclasses.dataclass(frozen=True)
class DelayedScaling(_Recipe):
    """TransformerEngine's delayed scaling: each tensor role keeps a history of the amaxes of its casts and
    casts with a scale computed from the *earlier* ones.

    For every (module, role): the first cast uses scale 1. Each cast records the amax of its unscaled values
    (all-reduced with MAX across the process group given to [`dls.fp8.emulate_recipe`][dls.fp8.gemm.emulate_recipe] when
    ``torch.distributed`` is initialised) at the front of a rolling history of ``amax_history_len`` entries
    (zeros at first). The next cast's scale is [`dls.fp8.scale_from_amax`][dls.fp8.scale_from_amax] of the history's
    maximum (``"max"``) or of the latest amax (``"most_recent"``), with ``margin``; when that amax is 0, inf or NaN the
    previous scale is kept. With ``"max"`` an inf or NaN amax (an overflowed step) therefore freezes the
    role's scale until it leaves the history, ``amax_history_len`` casts later, as in TransformerEngine.

    The scale is ``(fp8_max * 2**-margin) / amax`` in one float32 division (TransformerEngine divides by the
    amax, then by ``2**margin``: the same number unless the first quotient overflows float32).

    Only casts with autograd enabled record an amax (evaluation under ``torch.no_grad()`` uses the current
    scales and leaves the state alone); recomputing a forward (activation checkpointing) records it twice.

    Args:
        margin: an int; scales are divided by ``2**margin`` (headroom for amaxes that grow).
        amax_history_len: length of the rolling history, >= 1.
        amax_compute_algo: ``"max"`` or ``"most_recent"``.
        fp8_format: ``"hybrid"`` (E4M3 forward, E5M2 gradients) or ``"e4m3"``.
        saturate_gradients: see the module docstring.
    """

    margin: int = 0
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    fp8_format: str = "hybrid"
    saturate_gradients: bool = True

    def __post_init__(self) -> None:
        m = self.margin
        if isinstance(m, bool) or not isinstance(m, int) or abs(m) > 1000:
            raise ValueError(f"margin must be an int from -1000 to 1000; got {m!r}")
        n = self.amax_history_len
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"amax_history_len must be an int >= 1; got {n!r}")
        _check_choice("amax_compute_algo", self.amax_compute_algo, AMAX_COMPUTE_ALGOS)
        _check_choice("fp8_format", self.fp8_format, FP8_FORMATS)
        _check_bool("saturate_gradients", self.saturate_gradients)


@dataclasses.dataclass(frozen=True)
class MXFP8(_Recipe):
    """OCP microscaling FP8: blocks of 32 consecutive values along each GEMM's reduction axis share one E8M0
    (power-of-two) scale; casts saturate. Byte for byte torchao's ``to_mx`` (see
    [`dls.fp8.mx_quantize`][dls.fp8.mx_quantize] for the one deliberate difference). A reduction axis whose length is
    not a multiple of 32 is padded with zeros (which change neither the block scales nor the GEMM).

    Args:
        scale_mode: ``"rceil"``: the block scale is ``amax / fp8_max`` rounded up to a power of two (NVIDIA's
            hardware rule, TransformerEngine's MXFP8); ``"floor"``: ``2**(floor(log2(amax)) - emax)`` (the OCP
            MX v1.0 spec; the largest values of a block can exceed the format's max and saturate).
        fp8_format: ``"hybrid"`` (E4M3 forward, E5M2 gradients) or ``"e4m3"``.
        saturate_gradients: see the module docstring.
    """

    scale_mode: str = "rceil"
    fp8_format: str = "hybrid"
    saturate_gradients: bool = True

    def __post_init__(self) -> None:
        _check_choice("scale_mode", self.scale_mode, MX_SCALE_MODES)
        _check_choice("fp8_format", self.fp8_format, FP8_FORMATS)
        _check_bool("saturate_gradients", self.saturate_gradients)


@dataclasses.dataclass(frozen=True)
class StaticScaling(_Recipe):
    """One fixed scale for every cast: FP8 without per-tensor scaling. ``scale=1.0`` casts the values as
    they are (small ones flush to zero, large ones saturate); the only scaling left is the loss scale, which
    reaches the gradients. The baseline the other recipes are measured against.

    Args:
        scale: a finite float > 0 (rounded to float32).
        fp8_format: ``"hybrid"`` (E4M3 forward, E5M2 gradients) or ``"e4m3"``.
        saturate_gradients: see the module docstring.
    """

    scale: float = 1.0
    fp8_format: str = "hybrid"
    saturate_gradients: bool = True

    def __post_init__(self) -> None:
        s = self.scale
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s <= 0:
            raise ValueError(f"scale must be a finite float > 0; got {s!r}")
        object.__setattr__(self, "scale", float(s))
        _check_choice("fp8_format", self.fp8_format, FP8_FORMATS)
        _check_bool("saturate_gradients", self.saturate_gradients)


Recipe = CurrentScaling | DelayedScaling | MXFP8 | StaticScaling
RECIPE_NAMES: dict[str, type[Any]] = {
    "current": CurrentScaling,
    "delayed": DelayedScaling,
    "mxfp8": MXFP8,
    "static": StaticScaling,
}
"""The short name of each recipe, as `to_dict` writes it and a config file would (``recipe: delayed``)."""


def recipe_from_dict(d: dict[str, Any]) -> Recipe:
    """Build a recipe from ``{"recipe": name, **fields}`` (`to_dict`'s output, or a config section
    such as ``{"recipe": "delayed", "margin": 0, "amax_history_len": 16}``); absent fields take defaults.

    Args:
        d: the mapping: ``recipe`` (``current``, ``delayed``, ``mxfp8`` or ``static``) and the recipe's fields.

    Raises:
        ValueError: an unknown ``recipe`` name or field, or a bad value (each message names the key).
    """
    if not isinstance(d, dict) or d.get("recipe") not in RECIPE_NAMES:
        got = d.get("recipe") if isinstance(d, dict) else d
        raise ValueError(f"recipe must be one of {', '.join(repr(n) for n in RECIPE_NAMES)}; got {got!r}")
    cls = RECIPE_NAMES[d["recipe"]]
    fields = {k: v for k, v in d.items() if k != "recipe"}
    allowed = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(fields) - set(allowed))
    if unknown:
        raise ValueError(
            f"unknown field(s) {', '.join(repr(k) for k in unknown)} for recipe {d['recipe']!r}; "
            f"allowed: {', '.join(allowed)}"
        )
    recipe: Recipe = cls(**fields)
    return recipe
