"""Diagnostics: where a step's gradients overflowed, and whether a format can hold a model at all.

* [`OverflowWatch`][dls.diagnostics.OverflowWatch] (``watch.py``): names a model's parameters and modules and records
  the order in which backward produces their gradients; after an overflow, ``build_report(loss)`` returns an
  [`OverflowReport`][dls.diagnostics.OverflowReport] (first module, parameters with inf/NaN gradients in backward order,
  whether the forward pass overflowed).
* [`audit`][dls.diagnostics.audit] (``auditing.py``): forward/backward passes under exact emulation of several formats,
  without touching the model's parameters, gradients or RNG states; returns per-format forward overflows, verdicts,
  recommended initial loss scales and a per-module table (``report.py`` renders it as text and as a PNG).

Everything here needs torch alone; ``AuditResult.save_plot`` imports matplotlib when called.
"""

from dls.diagnostics.auditing import AuditResult, FormatAudit, ModuleStats, audit, recommend_exponent
from dls.diagnostics.watch import NonFiniteGradient, OverflowReport, OverflowWatch

__all__ = [
    "AuditResult",
    "FormatAudit",
    "ModuleStats",
    "NonFiniteGradient",
    "OverflowReport",
    "OverflowWatch",
    "audit",
    "recommend_exponent",
]
