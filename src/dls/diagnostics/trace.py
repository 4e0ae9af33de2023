"""The trace format (``dls-trace``, the file ``scaler.record`` and ``dls train`` write), its schema, and its reader.

A trace is JSON lines: a **header** line opens it and every resumed session (a *segment*), one **step** line per
rule step follows. ``HEADER`` and ``STEP`` below are the schema, field by field: each field's type and range,
whether it is required, and the check that enforces it; the policy lab's guide prints the same table
(``docs/guides/policy-lab.md``, a test keeps the two equal). Beyond the fields, a trace

* starts with a header; a header's ``settings`` are the ``dls.settings.ScalerSettings`` of the recording scaler,
  validated by that class as its constructor validates them (a recorded scaler has a loss scale: ``mode`` dynamic
  or static), and its ``state`` is checked as ``GradScaler.load_state_dict`` checks a state against those settings;
* numbers its steps consecutively within a segment, from the header's ``start_step`` + 1; a later segment starts
  at or after the last step before it (a resumed run may have lost the steps its predecessor had not yet written);
* holds only the fields below (no unknown field, no field twice in one object, nothing nested deeper than the
  format's ``MAX_DEPTH`` levels), finite JSON numbers (no ``NaN``, ``Infinity``, nor ``1e400``, which is past a
  float's range) and lines of at most ``MAX_LINE_BYTES`` bytes of UTF-8.

``read_trace`` enforces all of it: a file that breaks a rule raises ``TraceError`` naming the file, the line and
the field (``dls replay`` and ``dls tune`` exit 2 with that line). It reads line by line, holding one line at a
time (a line of more than ``MAX_LINE_BYTES`` is refused, not read on), and refuses a path that is not a regular
file (a directory, a FIFO, a device such as ``/dev/zero``, also through a symbolic link) before opening it. A last
line cut off mid-way (no newline at its end and not JSON: a run killed while writing) is left out; a UTF-8
byte-order mark before the first line is allowed.

The schema is written with the standard library, not pydantic (the trainer's config schema): ``read_trace`` is
part of the library (``dls.diagnostics.read_trace``), which needs torch alone; pydantic is the ``train`` extra's.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import stat
from collections.abc import Callable, Iterator
from dataclasses import MISSING, dataclass, field, fields
from typing import IO, Any

from dls.checks import FLOAT32_MAX, FLOAT32_TINY, INT64_MAX, shown
from dls.scaler_state import parse_state_dict
from dls.settings import ScalerSettings, SettingsError

__all__ = [
    "HEADER",
    "MAX_DEPTH",
    "MAX_LINE_BYTES",
    "STATE_FIELDS",
    "STEP",
    "TRACE_FILE",
    "TRACE_FORMAT",
    "TRACE_VERSION",
    "Field",
    "Segment",
    "Trace",
    "TraceError",
    "kept_until",
    "read_trace",
    "settings_of",
]

TRACE_FORMAT = "dls-trace"
TRACE_VERSION = 1  # the newest version this dls writes and reads
TRACE_FILE = "trace.jsonl"  # its name in a dls train model_dir
STATE_FIELDS = (  # what a header's "state" may hold: the fields of every rule's state (dls.policy)
    "loss_scale",
    "steps_since_rescale",
    "overflows_since_rescale",
    "num_skipped_steps",
    "hysteresis_tracker",
    "iterations_since_rescale",  # fairseq's rule (dls.policy.FairseqRule)
    "next_rescale",  # MXNet's rule: the rescale it commits at the next update
)

MAX_LINE_BYTES = 16 * 2**20  # a header naming 100,000 modules is about 4 MB; a step line of as many, 2.5 MB
MAX_DEPTH = 3  # the deepest the format nests: a step line > its "exponents" > their "counts"
FLOAT16_MAX = 65504.0
HISTOGRAM_BINS = 254  # float32's normal binades, 2**-126 up to 2**127
MIN_EXPONENT, MAX_EXPONENT = -126, 127
STRING_MAX = 200  # the longest string the format's own fields hold (a version, a time)


class TraceError(ValueError):
    """A file that is not a readable dls trace; the message names the file, the line and the field."""


# ---------------------------------------------------------------------------------------------------- the schema
Check = Callable[[Any], "str | None"]  # a field's value -> what is wrong with it (None: nothing)


@dataclass(frozen=True)
class Field:
    """One field of a trace line.

    Attributes:
        type: its type and range, as the documentation states them.
        check: ``value -> None`` when allowed, else what is wrong (the reader prefixes the field's name).
        required: whether every line of its kind holds it (else it may be absent; ``default`` then).
        default: the value an absent field stands for.
    """

    type: str
    check: Check
    required: bool = True
    default: Any = None


class _Unreadable:
    """A JSON token no Python number stands for exactly (``NaN``, ``Infinity``, ``1e400``, a 5,000-digit
    integer): kept as its text, so that the field holding it is named and every type check refuses it."""

    def __init__(self, text: str) -> None:
        self.text = text if len(text) <= 40 else f"{text[:24]}... ({len(text)} characters)"

    def __repr__(self) -> str:
        return self.text


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:  # JSON numbers only: every float the reader keeps is finite
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _integer(low: int, high: int, text: str) -> Check:
    def check(value: Any) -> str | None:
        return None if _is_int(value) and low <= value <= high else f"must be an integer {text}; got {shown(value)}"

    return check


def _number(low: float, high: float, text: str, *, above_low: bool = False) -> Check:
    def check(value: Any) -> str | None:
        if _is_number(value) and (low < value if above_low else low <= value) and value <= high:
            return None
        return f"must be a number {text}; got {shown(value)}"

    return check


def _optional(check: Check) -> Check:
    def optional(value: Any) -> str | None:
        problem = check(value)
        return None if value is None else problem and problem.replace("must be", "must be null or", 1)

    return optional


def _boolean(value: Any) -> str | None:
    return None if isinstance(value, bool) else f"must be true or false; got {shown(value)}"


def _string(value: Any) -> str | None:
    if isinstance(value, str) and len(value) <= STRING_MAX:
        return None
    return f"must be a string of at most {STRING_MAX} characters; got {shown(value)}"


def _format(value: Any) -> str | None:
    return None if value == TRACE_FORMAT else f"{shown(value)}, not {TRACE_FORMAT!r} (is this a dls trace?)"


def _version(value: Any) -> str | None:
    if _is_int(value) and 1 <= value <= TRACE_VERSION:
        return None
    newer = " (upgrade dls to read it)" if _is_int(value) and value > TRACE_VERSION else " (an integer)"
    return f"trace version {shown(value)}; this dls reads versions 1 to {TRACE_VERSION}{newer}"


def _object(value: Any) -> str | None:  # the header's settings and state: checked whole by _check_header
    return None if isinstance(value, dict) else f"must be an object; got {shown(value)}"


def _names(value: Any) -> str | None:
    if isinstance(value, list) and all(isinstance(name, str) for name in value):
        return None
    return f"must be a list of module names (strings); got {shown(value)}"


def _exponents(value: Any) -> str | None:
    if not isinstance(value, dict) or set(value) != {"min", "counts"}:
        return f'must be an object {{"min": exponent, "counts": [...]}}; got {shown(value)}'
    low, counts = value["min"], value["counts"]
    if not _is_int(low) or not MIN_EXPONENT <= low <= MAX_EXPONENT:
        return f"min must be an integer from {MIN_EXPONENT} to {MAX_EXPONENT}; got {shown(low)}"
    if isinstance(counts, list) and len(counts) > MAX_EXPONENT + 1 - low:
        return (
            f"counts holds {len(counts)} bins from 2**{low}: past 2**{MAX_EXPONENT}, float32's largest binade (at "
            f"most {HISTOGRAM_BINS} bins in all)"
        )
    if not isinstance(counts, list) or not all(_is_int(c) and 0 <= c <= INT64_MAX for c in counts):
        return f"counts must be a list of integers {COUNT}; got {shown(counts)}"
    return None


_overflow_scale = _number(0.0, math.inf, "> 0", above_low=True)


def _overflow_scales(value: Any) -> str | None:
    if not isinstance(value, list):
        return f"must be a list (one value per module of the header); got {shown(value)}"
    for j, item in enumerate(value):
        if item is not None and (problem := _overflow_scale(item)):
            return f"[{j}] {problem.replace('must be', 'must be null or', 1)}"
    return None


NORMAL = "from 2**-126 to float32's max 3.4028e38 (a normal float32)"
COUNT = "from 0 to 2**63 - 1"
# The documentation's wording of the types (the guide's table, which writes powers as 2^k)
NORMAL_TYPE = "a number from 2^-126 to float32's max 3.4028e38 (a normal float32)"
COUNT_TYPE = "an integer from 0 to 2^63 - 1"
HEADER: dict[str, Field] = {
    "format": Field(f'"{TRACE_FORMAT}"', _format),
    "version": Field(f"an integer, 1 to {TRACE_VERSION}: the newest format this dls reads", _version),
    "dls_version": Field(f"a string of at most {STRING_MAX} characters", _string, required=False),
    "created": Field("a string: when the segment started (ISO 8601)", _string, required=False),
    "start_step": Field(f"{COUNT_TYPE}: the step before the segment's first", _integer(0, INT64_MAX, COUNT)),
    "settings": Field(
        "an object: `ScalerSettings`' fields, as its constructor validates them (`mode` dynamic or static)", _object
    ),
    "state": Field(
        "an object: the scaler's state at the start (`loss_scale` and its counters), as `load_state_dict` checks it",
        _object,
        required=False,
        default={},
    ),
    "histogram_every": Field(
        "null or an integer from 1 to 2^63 - 1",
        _optional(_integer(1, INT64_MAX, "from 1 to 2**63 - 1")),
        required=False,
    ),
    "modules": Field("a list of strings: the modules of `module_overflow_scale`", _names, required=False, default=[]),
}
STEP: dict[str, Field] = {
    "step": Field(
        "an integer: the segment's `start_step` + 1, then one more per line",
        _integer(1, INT64_MAX, "from 1 to 2**63 - 1"),
    ),
    "scale": Field(f"{NORMAL_TYPE}: the scale the step used", _number(FLOAT32_TINY, FLOAT32_MAX, NORMAL)),
    "overflow": Field("true or false: the step overflowed (was skipped)", _boolean),
    "grad_amax": Field(
        "null or a number from 0 to float32's max: the largest unscaled gradient",
        _optional(_number(0.0, FLOAT32_MAX, "from 0 to float32's max")),
        required=False,
    ),
    "grad_amax_float16": Field(
        "null or a number from 0 to 65504: the same over the float16 gradients",
        _optional(_number(0.0, FLOAT16_MAX, "from 0 to 65504")),
        required=False,
    ),
    "exponents": Field(
        f'an object `{{"min": m, "counts": [...]}}`: `m` an integer from {MIN_EXPONENT} to {MAX_EXPONENT}, the '
        f"counts integers from 0 to 2^63 - 1 of the binades from 2^m up to at most 2^{MAX_EXPONENT}",
        _exponents,
        required=False,
    ),
    "module_overflow_scale": Field(
        "a list, one value per name of the header's `modules`: null or a number > 0",
        _overflow_scales,
        required=False,
    ),
}


# ---------------------------------------------------------------------------------------------------- what is read
@dataclass
class Segment:
    """One header of a trace and the steps recorded under it (a resumed run adds a segment)."""

    header: dict[str, Any]
    steps: list[dict[str, Any]] = field(default_factory=list)

    @property
    def settings(self) -> dict[str, Any]:
        """The recording scaler's settings (``ScalerSettings``' fields)."""
        return dict(self.header["settings"])


@dataclass
class Trace:
    """A trace as read by ``read_trace``: its segments in file order; ``steps`` all their steps."""

    path: str
    segments: list[Segment]

    @property
    def steps(self) -> list[dict[str, Any]]:
        """Every step line, in file order."""
        return [row for segment in self.segments for row in segment.steps]

    @property
    def half_dtype(self) -> str:
        """The format the recorded run trained in (its scaler's ``half_dtype``)."""
        return str(self.segments[0].header["settings"].get("half_dtype", "float16"))


def settings_of(header: dict[str, Any]) -> ScalerSettings:
    """The ``ScalerSettings`` a header's ``settings`` hold, validated as the constructor validates them.

    Args:
        header: a header line (``Segment.header``).

    Raises:
        ValueError: a field that is not ``ScalerSettings``', a missing one, or a value it refuses, named as
            ``settings.NAME``; a scaler without a loss scale (``mode`` off).
    """
    values = header.get("settings")
    if not isinstance(values, dict):
        raise ValueError(f"settings must be an object; got {shown(values)}")
    known = [f.name for f in fields(ScalerSettings)]
    unknown = [key for key in values if key not in known]
    if unknown:
        raise ValueError(f"settings.{_name(unknown[0])}: not a field of ScalerSettings; allowed: {', '.join(known)}")
    for key, value in values.items():
        if isinstance(value, (dict, list, _Unreadable)) or (isinstance(value, str) and len(value) > STRING_MAX):
            raise ValueError(f"settings.{key}: must be a number, a string, true/false or null; got {shown(value)}")
    missing = [f.name for f in fields(ScalerSettings) if f.default is MISSING and f.name not in values]
    if missing:
        raise ValueError(f"settings lacks {', '.join(missing)} (ScalerSettings' fields without a default)")
    try:
        settings = ScalerSettings(**values)
    except SettingsError as exc:
        argument, message = exc.problems[0]
        raise ValueError(f"settings.{argument}: {message}") from None
    if settings.mode == "off":
        raise ValueError("settings.mode: 'off', a scaler without a loss scale, records no trace (dynamic or static)")
    return settings


def _check_state(header: dict[str, Any], settings: ScalerSettings) -> None:
    """The header's state, checked as ``GradScaler.load_state_dict`` checks a state (``parse_state_dict``)."""
    state = header.get("state") or {}
    unknown = [key for key in state if key not in STATE_FIELDS]
    if unknown:
        raise ValueError(f"state.{_name(unknown[0])}: not a state field; allowed: {', '.join(STATE_FIELDS)}")
    if state:
        try:
            parse_state_dict(dict(state), settings, apply_settings=False, label=lambda key: f"state.{key}")
        except (ValueError, RuntimeError) as exc:
            raise ValueError(str(exc)) from None


def _name(key: str) -> str:
    """A key as an error message names it: as written, cut short."""
    return key if len(key) <= 40 and key.isprintable() else shown(key)


def _check_fields(record: dict[str, Any], schema: dict[str, Field], kind: str) -> str | None:
    for name, spec in schema.items():
        if name not in record:
            if spec.required:
                needed = [repr(key) for key, field_ in schema.items() if field_.required]
                listed = f"{', '.join(needed[:-1])} and {needed[-1]}"
                return f"a {kind} line needs {listed}; {name!r} is missing ({name}: {spec.type})"
        elif problem := spec.check(record[name]):
            return f"{name}: {problem}"
    unknown = [key for key in record if key not in schema]
    if unknown:
        return f"{_name(unknown[0])} is not a field of a {kind} line; allowed: {', '.join(schema)}"
    return None


# ---------------------------------------------------------------------------------------------------- the reader
class _Duplicate(ValueError):
    pass


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Duplicate(f"{_name(key)} given twice in one object")
        out[key] = value
    return out


def _int(text: str) -> int | _Unreadable:
    return int(text) if len(text) <= 20 else _Unreadable(text)  # Python refuses to convert 4,300 digits and more


def _float(text: str) -> float | _Unreadable:
    value = float(text)
    return value if math.isfinite(value) else _Unreadable(text)


_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"')
_NOT_BRACKETS = re.compile(rb"[^\[\]{}]")
_INNERMOST = re.compile(rb"\[\]|\{\}")


def _too_deep(line: bytes) -> bool:
    """Whether ``line`` nests deeper than ``MAX_DEPTH`` (checked before parsing: a nesting bomb is not parsed)."""
    if line.count(b"[") + line.count(b"{") <= MAX_DEPTH:
        return False
    brackets = _NOT_BRACKETS.sub(b"", _STRINGS.sub(b"", line))
    for _ in range(MAX_DEPTH):
        brackets = _INNERMOST.sub(b"", brackets)
    return bool(brackets)


def _parse(line: bytes) -> Any:
    """One line as JSON, or a ``ValueError`` saying why not."""
    if _too_deep(line):
        raise ValueError(f"nested deeper than the format's {MAX_DEPTH} levels (not a dls trace)")
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text (is this a dls trace?)") from None
    try:
        return json.loads(
            text, object_pairs_hook=_pairs, parse_int=_int, parse_float=_float, parse_constant=_Unreadable
        )
    except _Duplicate as exc:
        raise ValueError(str(exc)) from None
    except ValueError:
        raise ValueError("not JSON (is this a dls trace?)") from None


def _lines(file: IO[bytes]) -> Iterator[tuple[int, bytes, bool]]:
    """The file's lines, numbered from 1, without their newline, and whether each ended with one; a line longer
    than ``MAX_LINE_BYTES`` raises ``TraceError`` naming it, without being read further."""
    number = 0
    while True:
        line = file.readline(MAX_LINE_BYTES + 1)
        number += 1
        if not isinstance(line, bytes):
            raise TypeError("a trace is read from a path or a binary file object (opened 'rb')")
        if not line:
            return
        if number == 1 and line.startswith(b"\xef\xbb\xbf"):  # a byte-order mark, as some editors save UTF-8
            line = line[3:]
        ended = line.endswith(b"\n")
        if len(line) - ended > MAX_LINE_BYTES:
            raise _LineError(number, f"longer than {MAX_LINE_BYTES} bytes (a trace's lines are far shorter)")
        yield number, line[:-1] if ended else line, ended


class _LineError(ValueError):
    def __init__(self, number: int, message: str) -> None:
        super().__init__(message)
        self.number = number


def _open(path: str | os.PathLike[str]) -> IO[bytes]:
    """``path`` opened for reading, refused unless a regular file (a FIFO would block, a device never end)."""
    name = os.fspath(path)
    if not name:
        raise TraceError("the trace's path is empty; give the trace file (e.g. model_dir/trace.jsonl)")
    try:
        kind = os.stat(name).st_mode  # through links: a link to a trace is read, one to /dev/zero is not
        if stat.S_ISREG(kind):
            fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
            kind = os.fstat(fd).st_mode  # what was opened, should the name have changed since
            if stat.S_ISREG(kind):
                return os.fdopen(fd, "rb")
            os.close(fd)
    except OSError as exc:
        raise TraceError(f"cannot read the trace {name}: {exc.strerror or exc}") from None
    what = "a directory" if stat.S_ISDIR(kind) else "a FIFO" if stat.S_ISFIFO(kind) else "a device or socket"
    raise TraceError(f"{name} is {what}, not a regular file: give the trace file (e.g. model_dir/trace.jsonl)")


def read_trace(path: str | os.PathLike[str] | IO[bytes]) -> Trace:
    """Read a trace written by a ``Recorder`` (``scaler.record`` or ``dls train``), checking every line against
    the format (the module docstring).

    Args:
        path: the trace's path, or a binary file object to read it from.

    Raises:
        TraceError: a path that is not a readable regular file, or a file that breaks the format; the message
            names the file, the line and the field.
    """
    return _read_from(path)


def kept_until(path: str | os.PathLike[str] | IO[bytes], step: int) -> bytes:
    """The trace's lines as written, without the steps after ``step`` nor the segments that start at or after it
    (a run resumed from the checkpoint of ``step``: what its predecessor recorded after that checkpoint is not its
    history), nor a cut-off last line; the whole trace is checked as ``read_trace`` checks it, with its bounds. A
    file without a complete line (a run killed before its header was written) keeps nothing.

    Args:
        path: the trace's path, or a binary file object to read it from.
        step: the step of the checkpoint the run resumes from.

    Raises:
        TraceError: as ``read_trace``.
    """
    lines: list[tuple[bytes, dict[str, Any]]] = []
    _read_from(path, lines)
    kept = [
        line + b"\n"
        for line, record in lines
        if (record["start_step"] < step if "format" in record else record["step"] <= step)
    ]
    return b"".join(kept)


def _read_from(
    path: str | os.PathLike[str] | IO[bytes], lines: list[tuple[bytes, dict[str, Any]]] | None = None
) -> Trace:
    """``_read`` of a path (opened as ``_open`` allows) or of a binary file object (named by its ``name``)."""
    if isinstance(path, (str, os.PathLike)):
        with _open(path) as file:
            return _read(file, os.fspath(path), lines)
    return _read(path, str(getattr(path, "name", "<file>")), lines)


def _read(file: IO[bytes], name: str, lines: list[tuple[bytes, dict[str, Any]]] | None = None) -> Trace:
    """The trace in ``file`` (named ``name`` in errors), checked; with ``lines``, each line read is added to it as
    written (without its newline), beside its record."""
    segments: list[Segment] = []
    number = 0
    last = 0  # the last step read
    modules = 0  # the module count of the segment read
    try:
        for number, line, ended in _lines(file):  # noqa: B007  # number: named by the errors below
            if not line.strip():
                continue
            try:
                record = _parse(line)
            except ValueError:
                if not ended:  # the last line, cut off by a killed writer
                    break
                raise
            if not isinstance(record, dict):
                raise ValueError(f"not a JSON object (is this a dls trace?); got {shown(record)}")
            if "format" in record:
                if problem := _check_fields(record, HEADER, "header"):
                    raise ValueError(problem)
                settings = settings_of(record)
                _check_state(record, settings)
                start = record["start_step"]
                if segments and start < last:
                    raise ValueError(
                        f"start_step {start} comes before step {last}, the last one above it: a segment continues "
                        f"the trace at or after its last step (scaler.record(path, append=True, start_step={last}))"
                    )
                absent = {name: copy.copy(spec.default) for name, spec in HEADER.items() if name not in record}
                record = {**record, **absent}
                segments.append(Segment(record))
                last, modules = start, len(record["modules"])
                if lines is not None:
                    lines.append((line, record))
                continue
            if not segments:
                raise ValueError("a step line before any header line (is this a dls trace?)")
            if problem := _check_fields(record, STEP, "step"):
                raise ValueError(problem)
            if record["step"] != last + 1:
                raise ValueError(
                    f"step {record['step']} follows step {last}: the steps of a segment are numbered one after "
                    f"another from its header's start_step + 1 ({segments[-1].header['start_step'] + 1})"
                )
            scales = record.get("module_overflow_scale")
            if scales is not None and len(scales) != modules:
                raise ValueError(
                    f"module_overflow_scale holds {len(scales)} values; the header names {modules} modules"
                )
            last = record["step"]
            segments[-1].steps.append(record)
            if lines is not None:
                lines.append((line, record))
    except ValueError as exc:
        raise TraceError(f"{name}, line {getattr(exc, 'number', number)}: {exc}") from None
    except TypeError as exc:
        raise TraceError(f"{name}: {exc}") from None
    except OSError as exc:
        raise TraceError(f"cannot read the trace {name}: {exc.strerror or exc}") from None
    if not segments and lines is None:  # kept_until: nothing complete was written, no history to keep
        raise TraceError(f"{name} holds no dls trace header (an empty file, or not a trace)")
    return Trace(name, segments)
