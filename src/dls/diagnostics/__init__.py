"""Diagnostics: where a step's gradients overflowed, and whether a format can hold a model at all.

* [`OverflowWatch`][dls.diagnostics.OverflowWatch] (``watch.py``): names a model's parameters and modules and records
  the order in which backward produces their gradients; after an overflow, ``build_report(loss)`` returns an
  [`OverflowReport`][dls.diagnostics.OverflowReport] (first module, parameters with inf/NaN gradients in backward order,
  whether the forward pass overflowed).
* [`audit`][dls.diagnostics.audit] (``auditing.py``): forward/backward passes under exact emulation of several formats,
  without touching the model's parameters, gradients or RNG states; returns per-format forward overflows, verdicts,
  recommended initial loss scales and a per-module table (``report.py`` renders it as text and as a PNG).
* ``Recorder`` (``record.py``, made by ``GradScaler.record``): a trace of the scaler's steps (JSON lines);
  ``read_trace`` (``trace.py``, the format's schema) reads and checks it. ``replay`` (``replaying.py``) runs every
  peer's loss-scaling policy (``policies.py``, the table of peers) over a trace with the scaler's own rule code,
  with bounds where the trace cannot decide; ``tune`` (``tuning.py``) searches their settings (``dls replay``,
  ``dls tune``).

Everything here needs torch alone; ``AuditResult.save_plot`` imports matplotlib when called.
"""

from dls.diagnostics.auditing import AuditResult, FormatAudit, ModuleStats, audit, recommend_exponent
from dls.diagnostics.policies import config_lines, parse_policy
from dls.diagnostics.record import Recorder
from dls.diagnostics.replaying import Replay, replay
from dls.diagnostics.trace import Trace, TraceError, read_trace
from dls.diagnostics.tuning import TuneResult, tune
from dls.diagnostics.watch import NonFiniteGradient, OverflowReport, OverflowWatch

__all__ = [
    "AuditResult",
    "FormatAudit",
    "ModuleStats",
    "NonFiniteGradient",
    "OverflowReport",
    "OverflowWatch",
    "Recorder",
    "Replay",
    "Trace",
    "TraceError",
    "TuneResult",
    "audit",
    "config_lines",
    "parse_policy",
    "read_trace",
    "recommend_exponent",
    "replay",
    "tune",
]
