"""What [`audit`][dls.diagnostics.audit] returns, and its renderings: a text table and a PNG.

The PNG has one panel per format: a row per module, a column per binade (``floor(log2 |gradient|)``), the colour
the share of the module's nonzero gradient values in that binade. Vertical lines mark the format's range for
unscaled gradients (solid: values left of the flush line round to zero, values right of the overflow line
overflow) and for gradients multiplied by the recommended scale (dashed: the same limits shifted left by its
exponent). matplotlib is imported only inside [`AuditResult.save_plot`][dls.diagnostics.AuditResult.save_plot], on its
Agg canvas (no display, no global backend change).
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Mapping
from pathlib import Path

from dls.diagnostics.scales import (
    HIST_BINS,
    HIST_LOW,
    count_flushed,
    count_overflowed,
    flush_limit,
    module_label,
    percent,
    pow2,
    scale_exponent,
)
from dls.formats import FloatFormat

__all__ = ["AuditResult", "FormatAudit", "ModuleStats", "format_table", "render_text", "save_plot"]


@dataclasses.dataclass(frozen=True)
class ModuleStats:
    """What one module did in the audited passes of one format.

    Attributes:
        name: qualified module name (``""`` is the root module); ``type``: its class name.
        calls: forward calls recorded.
        max_activation: largest ``|output|`` over its floating-point outputs, before emulation rounded them
            (``inf`` if an output was infinite; NaN values are ignored).
        max_grad: largest finite ``|gradient|`` flowing into its outputs (exact float32, loss scale 1), or
            ``None`` if no gradient reached them.
        max_param_grad: largest finite ``|gradient|`` of the parameters it owns, or ``None``.
        histogram: nonzero finite gradient values (output and own-parameter gradients) per binade: bin ``i``
            counts ``2**(HIST_LOW + i) <= |g| < 2**(HIST_LOW + i + 1)``.
        nonfinite_grads: inf/NaN gradient values among them.
    """

    name: str
    type: str
    calls: int
    max_activation: float | None
    max_grad: float | None
    max_param_grad: float | None
    histogram: tuple[int, ...]
    nonfinite_grads: int

    @property
    def nonzero(self) -> int:
        """Nonzero finite gradient values counted."""
        return sum(self.histogram)

    def underflow(self, fmt: FloatFormat, scale: float = 1.0) -> float:
        """Share of the nonzero gradient values that ``fmt`` flushes to zero at loss scale ``scale`` (a power of
        two), 0.0 if there are none.

        Args:
            fmt: the format.
            scale: the loss scale (a power of two).
        """
        n = self.nonzero
        return count_flushed(self.histogram, fmt, scale_exponent(scale)) / n if n else 0.0

    def overflow(self, fmt: FloatFormat, scale: float = 1.0) -> float:
        """Share of the nonzero gradient values that overflow ``fmt`` at loss scale ``scale`` (a power of two).

        Args:
            fmt: the format.
            scale: the loss scale (a power of two).
        """
        n = self.nonzero
        return count_overflowed(self.histogram, fmt, scale_exponent(scale)) / n if n else 0.0


@dataclasses.dataclass(frozen=True)
class FormatAudit:
    """The audit of one format.

    Attributes:
        format: the [`FloatFormat`][dls.formats.FloatFormat].
        modules: per-module statistics, in the order their outputs were first produced.
        forward_overflow: the first module whose output exceeded the format's max, in the order outputs are
            produced (so the innermost module, never a parent that merely returns it), or ``None``.
        forward_overflow_value: its largest ``|output|`` then.
        forward_nan: the first module whose output held NaN while no output had overflowed, or ``None``.
        recommended_init_scale: ``2**k`` from [`recommend_exponent`][dls.diagnostics.recommend_exponent]; ``None``
            when the forward pass overflows or produces NaN, when gradients are inf/NaN, or when no nonzero gradient
            was seen.
        verdict: one sentence (starts with the format's name).
        measured: ``EmulationStats.as_dict()`` of one more pass at the recommended scale with the gradients
            rounded too (flushed values then also zero what flows upstream of them), or ``None``.
    """

    format: FloatFormat
    modules: tuple[ModuleStats, ...]
    forward_overflow: str | None
    forward_overflow_value: float | None
    forward_nan: str | None
    recommended_init_scale: float | None
    verdict: str
    measured: Mapping[str, float] | None

    @property
    def histogram(self) -> tuple[int, ...]:
        """All modules' histograms summed (a value shared by a parent and its child is counted in both)."""
        return tuple(sum(column) for column in zip(*(m.histogram for m in self.modules))) or (0,) * HIST_BINS

    @property
    def max_grad(self) -> float | None:
        values = [v for m in self.modules for v in (m.max_grad, m.max_param_grad) if v is not None]
        return max(values) if values else None

    def underflow(self, scale: float = 1.0) -> float:
        """Share of all nonzero gradient values flushed at loss scale ``scale``.

        Args:
            scale: the loss scale (a power of two).
        """
        hist = self.histogram
        n = sum(hist)
        return count_flushed(hist, self.format, scale_exponent(scale)) / n if n else 0.0

    def overflow(self, scale: float = 1.0) -> float:
        """Share of all nonzero gradient values overflowing at loss scale ``scale``.

        Args:
            scale: the loss scale (a power of two).
        """
        hist = self.histogram
        n = sum(hist)
        return count_overflowed(hist, self.format, scale_exponent(scale)) / n if n else 0.0


@dataclasses.dataclass(frozen=True)
class AuditResult:
    """What [`audit`][dls.diagnostics.audit] returns (immutable). ``str(result)`` is
    [`to_text`][dls.diagnostics.AuditResult.to_text].

    Attributes:
        audits: one [`FormatAudit`][dls.diagnostics.FormatAudit] per format name, in the order given.
        steps: forward/backward passes per format.
        underflow_tolerance: the tolerance the recommendations used.
        keep_in_float32: per format name, the modules to keep in float32 (``dls.keep_in_float32``) so that the
            forward pass fits the format: ``[]`` when it fits already, ``None`` when nothing found within the bound
            of rounds fits (see [`audit`][dls.diagnostics.audit]).
    """

    audits: Mapping[str, FormatAudit]
    steps: int
    underflow_tolerance: float
    keep_in_float32: Mapping[str, list[str] | None] = dataclasses.field(
        default_factory=lambda: types.MappingProxyType({})
    )

    @property
    def forward_overflow(self) -> Mapping[str, str | None]:
        """Per format: the first module whose output exceeds the format (innermost), or ``None``."""
        return types.MappingProxyType({k: a.forward_overflow for k, a in self.audits.items()})

    @property
    def verdicts(self) -> Mapping[str, str]:
        """Per format: one sentence."""
        return types.MappingProxyType({k: a.verdict for k, a in self.audits.items()})

    @property
    def recommended_init_scale(self) -> Mapping[str, float | None]:
        """Per format: a power of two to start loss scaling at (see
        [`recommend_exponent`][dls.diagnostics.recommend_exponent]), or ``None``."""
        return types.MappingProxyType({k: a.recommended_init_scale for k, a in self.audits.items()})

    def to_text(self) -> str:
        """The verdicts, then one table per format: max |activation|, max |grad|, % underflow, % overflow."""
        return render_text(self)

    def __str__(self) -> str:
        return self.to_text()

    def save_plot(self, path: str | Path) -> Path:
        """Write a PNG: per format, per module, the distribution of gradient exponents against the format's range
        at scale 1 and at the recommended scale. Needs matplotlib (imported here, Agg canvas).

        Args:
            path: the PNG file to write.

        Returns:
            ``path``, as a ``Path``.
        """
        return save_plot(self, path)


_WINDOW = 48  # binades shown beyond the observed gradients at most, so that wide formats do not squash the data


def _number(value: float | None) -> str:
    if value is None:
        return "-"
    if math.isinf(value):
        return "inf"
    return f"{value:.3g}" if value == 0 or 1e-3 <= abs(value) < 1e5 else f"{value:.2e}"


def format_table(fa: FormatAudit) -> str:
    """The per-module table of one format: max |activation|, max |output grad|, max |param grad|, and the shares
    of gradient values that underflow / overflow at scale 1 (and underflow at the recommended scale)."""
    fmt = fa.format
    scale = fa.recommended_init_scale
    header = ["module", "type", "calls", "max|act|", "max|grad|", "max|param grad|", "underflow@1", "overflow@1"]
    if scale is not None and scale != 1.0:
        header.append(f"underflow@{pow2(scale)}")
    rows = []
    for m in fa.modules:
        row = [
            module_label(m.name),
            m.type,
            str(m.calls),
            _number(m.max_activation),
            _number(m.max_grad),
            _number(m.max_param_grad),
            percent(m.underflow(fmt)) if m.nonzero else "-",
            percent(m.overflow(fmt)) if m.nonzero else "-",
        ]
        if len(header) > len(row):
            row.append(percent(m.underflow(fmt, scale)) if m.nonzero and scale else "-")
        if m.name == fa.forward_overflow and fa.forward_overflow is not None:
            row[0] += "  <- forward overflow"
        rows.append(row)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = []
    for row in [header, *rows]:
        cells = [c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def keep_lines(result: AuditResult) -> list[str]:
    """One sentence per format whose forward pass overflows: what to keep in float32 so that it fits."""
    lines = []
    for name, names in result.keep_in_float32.items():
        if names is None:
            lines.append(
                f"{name}: keeping modules in float32 does not make the forward pass fit (no module found, a float32 "
                "overflow, or still overflowing after the bound of rounds); use a wider format"
            )
        elif names:
            listed = ", ".join(repr(n) for n in names)
            lines.append(
                f"{name}: the forward pass fits with {listed} kept in float32 (dls.keep_in_float32(model, [{listed}]), "
                "or precision.keep_in_float32 in a config)"
            )
    return lines


def render_text(result: AuditResult) -> str:
    """Verdicts first, then per format a summary line and its table."""
    lines = [f"dls audit: {result.steps} forward/backward passes per format, emulated exactly"]
    lines += [f"  {v}" for v in result.verdicts.values()]
    lines += [f"  {line}" for line in keep_lines(result)]
    for name, fa in result.audits.items():
        fmt = fa.format
        lines.append("")
        summary = f"{name}: max {fmt.max:.6g}, smallest nonzero {fmt.min_subnormal:.3g}"
        if fa.recommended_init_scale is not None:
            summary += f"; recommended init_scale {pow2(fa.recommended_init_scale)}"
            if fa.measured is not None:
                summary += (
                    f" (one emulated pass there: {percent(fa.measured['underflow_fraction'])} of gradient values "
                    f"flushed, {int(fa.measured['overflowed'])} overflowed)"
                )
        lines.append(summary)
        lines.append(format_table(fa))
    lines.append("")
    lines.append(
        "max|act|: largest |output| before rounding; max|grad|: largest gradient flowing into the outputs, "
        "max|param grad|: of the module's own parameters (exact, loss scale 1). underflow/overflow: share of the "
        "nonzero values of both that the format flushes to zero / overflows at that loss scale, each value "
        "taken alone (in a real run a flushed value also zeroes what flows upstream of it)."
    )
    return "\n".join(lines)


def save_plot(result: AuditResult, path: str | Path) -> Path:
    """Write the gradient-exponent heat maps of ``result`` to ``path`` (PNG); returns the path."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:  # pragma: no cover - matplotlib is part of the train and dev extras
        raise ImportError("save_plot needs matplotlib: pip install matplotlib (or dls[train])") from error
    import numpy as np  # matplotlib depends on it

    audits = list(result.audits.values())
    rows = max((len([m for m in fa.modules if m.nonzero]) for fa in audits), default=1) or 1
    fig = Figure(figsize=(5.0 * len(audits), min(60.0, 1.8 + 0.28 * rows)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(audits), squeeze=False)[0]
    for ax, fa in zip(axes, audits):
        modules = [m for m in fa.modules if m.nonzero]
        fmt = fa.format
        title = fmt.name
        if fa.recommended_init_scale is not None:
            title += f"  (recommended scale {pow2(fa.recommended_init_scale)})"
        elif fa.forward_overflow is not None:
            title += f"  (forward overflow at {module_label(fa.forward_overflow)})"
        ax.set_title(title, fontsize=10)
        if not modules:
            ax.text(0.5, 0.5, "no nonzero gradients", ha="center", va="center", transform=ax.transAxes)
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        data = np.array([m.histogram for m in modules], dtype=float)
        data /= data.sum(axis=1, keepdims=True)
        used = np.nonzero(data.sum(axis=0))[0]
        lo, hi = HIST_LOW + int(used[0]), HIST_LOW + int(used[-1]) + 1
        k = 0 if fa.recommended_init_scale is None else int(math.log2(fa.recommended_init_scale))
        marks = [
            (flush_limit(fmt), "-", "tab:red", "flush, scale 1"),
            (fmt.emax + 1, "-", "tab:orange", "overflow, scale 1"),
        ]
        if k:
            marks += [
                (flush_limit(fmt) - k, "--", "tab:red", f"flush, scale {pow2(2.0**k)}"),
                (fmt.emax + 1 - k, "--", "tab:orange", f"overflow, scale {pow2(2.0**k)}"),
            ]
        # Lines far from the data (bfloat16's range seen from float16 gradients) would squash it: leave them out.
        near = [mark for mark in marks if lo - _WINDOW <= mark[0] <= hi + _WINDOW]
        left = min([lo, *(x for x, *_ in near)]) - 2
        right = max([hi, *(x for x, *_ in near)]) + 2
        first = left - HIST_LOW
        shown = np.ma.masked_equal(data[:, max(first, 0) : right - HIST_LOW], 0.0)
        image = ax.imshow(
            shown,
            aspect="auto",
            interpolation="nearest",
            cmap="viridis",
            extent=(max(left, HIST_LOW), right, len(modules) - 0.5, -0.5),
        )
        for x, style, color, label in near:
            ax.axvline(x, linestyle=style, color=color, lw=1.4, label=label)
        far = [f"{mark[3]} at 2^{mark[0]}" for mark in marks if mark not in near]
        ax.set_yticks(range(len(modules)))
        ax.set_yticklabels([module_label(m.name) for m in modules], fontsize=7 if len(modules) > 20 else 8)
        note = f"\n(off the chart: {'; '.join(far)})" if far else ""
        ax.set_xlabel("binary exponent of |gradient| (log2)" + note, fontsize=9)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="lower left", fontsize=7)
        fig.colorbar(image, ax=ax, shrink=0.6, label="share of the module's gradient values")
    fig.suptitle(
        "Gradient exponents per module against each format's range (left of a flush line: rounds to zero)",
        fontsize=11,
    )
    out = Path(path)
    fig.savefig(out, dpi=100)
    return out
