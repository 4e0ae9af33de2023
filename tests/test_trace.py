"""The trace format's schema and its reader (``dls.diagnostics.trace``): every field of a crafted trace of the wrong
type or out of its range is refused naming the file, the line and the field; so are steps out of order, nesting
bombs, numbers past a float's range, long lines, binary garbage, and paths that are not regular files (read before
opening: a FIFO or /dev/zero would never end). The documentation's table of fields is the schema's."""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import dls
from dls.diagnostics import trace as trace_format
from dls.diagnostics.trace import HEADER, STEP, TraceError, kept_until, read_trace
from dls.settings import ScalerSettings
from test_record import fp16_loss, mlp

ROOT = Path(__file__).resolve().parent.parent


def header(**changes: Any) -> dict[str, Any]:
    settings = ScalerSettings.torch(init_scale=2.0**16, growth_interval=4)
    out: dict[str, Any] = {
        "format": "dls-trace", "version": 1, "dls_version": "0.1.0", "created": "2026-01-01T00:00:00+00:00",
        "start_step": 0, "settings": {f: getattr(settings, f) for f in settings.__dataclass_fields__},
        "state": {"loss_scale": 65536.0, "steps_since_rescale": 0, "overflows_since_rescale": 0,
                  "num_skipped_steps": 0, "hysteresis_tracker": 1},
        "histogram_every": 2, "modules": ["", "0"],
    }  # fmt: skip
    for key, value in changes.items():
        if value is _ABSENT:
            out.pop(key)
        else:
            out[key] = value
    return out


def step(number: int, **changes: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"step": number, "scale": 65536.0, "overflow": False, "grad_amax": 0.01}
    if number == 2:
        out["exponents"] = {"min": -20, "counts": [3, 0, 5]}
        out["module_overflow_scale"] = [1e9, None]
    for key, value in changes.items():
        if value is _ABSENT:
            out.pop(key)
        else:
            out[key] = value
    return out


_ABSENT = object()


def lines(*records: Any) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)


def with_settings(**changes: Any) -> dict[str, Any]:
    return header(settings={**header()["settings"], **changes})


def with_state(**changes: Any) -> dict[str, Any]:
    return header(state={**header()["state"], **changes})


def test_a_crafted_trace_reads_and_every_recorded_trace_passes_the_schema(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(lines(header(), step(1), step(2), step(3, overflow=True, grad_amax=None)))
    trace = read_trace(path)
    assert [r["step"] for r in trace.steps] == [1, 2, 3] and trace.half_dtype == "float16"
    minimal = {"format": "dls-trace", "version": 1, "start_step": 5, "settings": header()["settings"]}
    path.write_text(lines(minimal, {"step": 6, "scale": 1.0, "overflow": True}))
    (segment,) = read_trace(path).segments
    assert (
        segment.header["modules"] == [] and segment.header["state"] == {} and segment.header["histogram_every"] is None
    )
    # what the recorder writes, every field of it, passes: with the model hooks, float16 gradients, a histogram,
    # overflows, and a second segment
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = dls.GradScaler("cpu", init_scale=2.0**24, growth_interval=2, hysteresis=2)
    recorded = tmp_path / "recorded.jsonl"
    for start, append in ((0, False), (4, True)):
        with scaler.record(recorded, model=model, histogram_every=2, start_step=start, append=append):
            for i in range(4):
                scaler.scale(fp16_loss(model, i, 2.0**12 if i == 1 else 1.0)).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
    trace = read_trace(recorded)
    assert [r["step"] for r in trace.steps] == list(range(1, 9)) and len(trace.segments) == 2
    assert any(r["overflow"] for r in trace.steps) and any("exponents" in r for r in trace.steps)


def _cases() -> Iterator[tuple[str, list[Any], int, str]]:
    """(id, the trace's lines, the line refused, what the message says)."""
    # the header, field by field
    for value in (0, -1, True, "1", 1.5, None):
        yield f"version={value!r}", [header(version=value), step(1)], 1, "version: trace version"
    yield "version=2", [header(version=2)], 1, "version: trace version 2; this dls reads versions 1 to 1 (upgrade"
    yield "format", [header(format="dls-trace2")], 1, "format: 'dls-trace2', not 'dls-trace'"
    yield "no settings", [header(settings=_ABSENT)], 1, "'settings' is missing"
    yield "no start_step", [header(start_step=_ABSENT)], 1, "'start_step' is missing"
    for value in (-1, 1.5, "0", True, 1e30):
        yield f"start_step={value!r}", [header(start_step=value)], 1, "start_step: must be an integer"
    yield "settings list", [header(settings=[1])], 1, "settings: must be an object"
    yield "unknown dialect", [with_settings(dialect="no-such-peer")], 1, "settings.dialect: dialect must be one of"
    yield (
        "NaN init_scale",
        [json.dumps(header()).replace('65536.0, "min', 'NaN, "min')],
        1,
        ("settings.init_scale: must be a number, a string, true/false or null; got NaN"),
    )
    yield "min > max", [with_settings(min_loss_scale=2.0**20, max_loss_scale=2.0**10)], 1, "settings.min_loss_scale"
    yield "steps_per_increase -1", [with_settings(steps_per_increase=-1)], 1, "settings.steps_per_increase"
    yield "hysteresis 0", [with_settings(hysteresis=0)], 1, "settings.hysteresis: hysteresis must be an integer"
    yield "growth_factor 1e300", [with_settings(growth_factor=1e300)], 1, "settings.growth_factor"
    yield "mode off", [with_settings(mode="off")], 1, "settings.mode: 'off'"
    yield "unknown setting", [with_settings(bogus=1)], 1, "settings.bogus: not a field of ScalerSettings"
    settings_without_init = {k: v for k, v in header()["settings"].items() if k != "init_scale"}
    yield "init_scale missing", [header(settings=settings_without_init)], 1, "settings lacks init_scale"
    yield "a nested setting", [with_settings(half_dtype={"a": 1})], 1, "settings.half_dtype: must be a number"
    yield "a long string", [with_settings(mode="x" * 5000)], 1, "settings.mode: must be a number, a string"
    yield "state scale -1", [with_state(loss_scale=-1)], 1, "state.loss_scale must be a positive finite number"
    yield "state counter -1", [with_state(steps_since_rescale=-1)], 1, "state.steps_since_rescale must be an integer"
    yield "state counter 1.5", [with_state(num_skipped_steps=1.5)], 1, "state.num_skipped_steps must be an integer"
    yield "state unknown", [with_state(scale=2.0)], 1, "state.scale: not a state field"
    yield "state list", [header(state=[])], 1, "state: must be an object"
    yield "histogram_every 0", [header(histogram_every=0)], 1, "histogram_every: must be null or an integer"
    yield "modules ints", [header(modules=[1, 2])], 1, "modules: must be a list of module names"
    yield "unknown header field", [header(extra=1)], 1, "extra is not a field of a header line; allowed: format"
    yield "duplicate key", ['{"format": "dls-trace", "format": "dls-trace"}'], 1, "format given twice in one object"
    # a step, field by field
    for value in ("NaN", "Infinity", "-Infinity", "1e400"):
        yield (
            f"scale={value}",
            [header(), f'{{"step": 1, "scale": {value}, "overflow": false}}'],
            2,
            (f"scale: must be a number from 2**-126 to float32's max 3.4028e38 (a normal float32); got {value}"),
        )
    for value in (-1, 0, True, "1", 1e39, 2.0**-127, None, [1]):
        yield f"scale={value!r}", [header(), step(1, scale=value)], 2, "scale: must be a number from 2**-126"
    for value in ("true", 1, None, 0):
        yield f"overflow={value!r}", [header(), step(1, overflow=value)], 2, "overflow: must be true or false"
    yield (
        "grad_amax NaN",
        [header(), '{"step": 1, "scale": 1.0, "overflow": false, "grad_amax": NaN}'],
        2,
        ("grad_amax: must be null or a number from 0 to float32's max; got NaN"),
    )
    for value in (-5, "x", 1e39, True):
        yield f"grad_amax={value!r}", [header(), step(1, grad_amax=value)], 2, "grad_amax: must be null or a number"
    yield (
        "grad_amax_float16",
        [header(), step(1, grad_amax_float16=70000.0)],
        2,
        ("grad_amax_float16: must be null or a number from 0 to 65504"),
    )
    for value in (-3, 1.5, 1e30, "2", True, None):
        yield f"step={value!r}", [header(), step(1, step=value)], 2, "step: must be an integer"
    yield "step 0", [header(), step(0)], 2, "step: must be an integer from 1"
    yield "first step 2", [header(), step(2)], 2, "step 2 follows step 0: the steps of a segment are numbered"
    yield "duplicate step", [header(), step(1), step(1)], 3, "step 1 follows step 1"
    yield "backward step", [header(), step(1), step(2), step(1)], 4, "step 1 follows step 2"
    yield "a gap", [header(), step(1), step(3)], 3, "step 3 follows step 1"
    yield (
        "a segment before the last step",
        [header(), step(1), step(2), header(start_step=1)],
        4,
        ("start_step 1 comes before step 2"),
    )
    yield (
        "no scale",
        [header(), step(1, scale=_ABSENT)],
        2,
        ("a step line needs 'step', 'scale' and 'overflow'; 'scale' is missing"),
    )
    yield "unknown step field", [header(), step(1, loss=1.0)], 2, "loss is not a field of a step line"
    yield "step before header", [step(1)], 1, "a step line before any header line"
    yield (
        "5000 digits",
        [header(), '{"step": ' + "9" * 5000 + ', "scale": 1.0, "overflow": false}'],
        2,
        ("step: must be an integer from 1 to 2**63 - 1; got 999999999999999999999999... (5000 characters)"),
    )
    yield (
        "modules: wrong length",
        [header(), step(1, module_overflow_scale=[1.0])],
        2,
        ("module_overflow_scale holds 1 values; the header names 2 modules"),
    )
    yield (
        "modules: no modules",
        [header(modules=[]), step(1, module_overflow_scale=[1.0])],
        2,
        ("module_overflow_scale holds 1 values; the header names 0 modules"),
    )
    for value in (-1.0, 0, "x", True):
        yield (
            f"module scale {value!r}",
            [header(), step(1, module_overflow_scale=[1.0, value])],
            2,
            ("module_overflow_scale: [1] must be null or a number > 0"),
        )
    yield "modules: not a list", [header(), step(1, module_overflow_scale=1.0)], 2, "module_overflow_scale: must be"
    yield (
        "negative counts",
        [header(), step(1, exponents={"min": -20, "counts": [3, -1]})],
        2,
        ("exponents: counts must be a list of integers from 0 to 2**63 - 1"),
    )
    yield (
        "2e6 bins",
        [header(), step(1, exponents={"min": -126, "counts": [1] * 2_000_000})],
        2,
        ("exponents: counts holds 2000000 bins from 2**-126: past 2**127"),
    )
    yield (
        "bins past the top",
        [header(), step(1, exponents={"min": 100, "counts": [1] * 29})],
        2,
        ("counts holds 29 bins from 2**100"),
    )
    yield (
        "min -200",
        [header(), step(1, exponents={"min": -200, "counts": [1]})],
        2,
        ("exponents: min must be an integer from -126 to 127"),
    )
    yield "float counts", [header(), step(1, exponents={"min": 0, "counts": [1.5]})], 2, "exponents: counts must be"
    yield "exponents shape", [header(), step(1, exponents={"min": 0})], 2, 'exponents: must be an object {"min"'
    # what is not a trace line at all
    yield "nesting bomb", [header(), "[" * 100_000 + "]" * 100_000], 2, "nested deeper than the format's 3 levels"
    yield "deep object", [header(), step(1, x={"a": {"b": {"c": 1}}})], 2, "nested deeper than the format's 3 levels"
    yield "a bracket in a string", [header(modules=["[[[[[[", "{{{{"]), step(1)], 0, ""
    yield "not JSON", [header(), "not json", step(1)], 2, "not JSON (is this a dls trace?)"
    yield "an array", [header(), "[1, 2]"], 2, "not a JSON object (is this a dls trace?); got [1, 2]"
    yield "a number", ["3"], 1, "not a JSON object"


CASES = list(_cases())


@pytest.mark.parametrize(("records", "line", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_bad_line_is_refused_naming_the_file_the_line_and_the_field(
    tmp_path: Path, records: list[Any], line: int, message: str
) -> None:
    path = tmp_path / "crafted.jsonl"
    path.write_text(lines(*records))
    if not line:  # allowed
        read_trace(path)
        return
    with pytest.raises(TraceError) as caught:
        read_trace(path)
    text = str(caught.value)
    assert text.startswith(f"{path}, line {line}: "), text
    assert message in text, text
    assert "\n" not in text and len(text) < 400, text


def test_a_long_line_is_refused_without_reading_it_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert trace_format.MAX_LINE_BYTES == 16 * 2**20
    path = tmp_path / "long.jsonl"
    monkeypatch.setattr(trace_format, "MAX_LINE_BYTES", 1000)
    assert len(json.dumps(header())) < 1000
    path.write_text(lines(header(), step(1)) + '{"step": 2, "scale": 1.0, "overflow": false}' + " " * 1000)
    with pytest.raises(TraceError, match=rf"^{re.escape(str(path))}, line 3: longer than 1000 bytes"):
        read_trace(path)
    path.write_text(lines(header(modules=["x" * 1000])))
    with pytest.raises(TraceError, match="line 1: longer than 1000 bytes"):
        read_trace(path)
    monkeypatch.undo()
    path.write_bytes(b"\0" * (trace_format.MAX_LINE_BYTES + 10))  # a file of zeros, one line
    with pytest.raises(TraceError, match=f"line 1: longer than {trace_format.MAX_LINE_BYTES} bytes"):
        read_trace(path)


def test_read_trace_tolerates_a_cut_off_last_line_and_refuses_what_is_not_a_trace(tmp_path: Path) -> None:
    scaler = dls.GradScaler("cpu")
    path = tmp_path / "trace.jsonl"
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with scaler.record(path):
        for step in range(3):
            scaler.scale(fp16_loss(model, step)).backward()
            scaler.step(opt)
            scaler.update()
    text = path.read_text()
    path.write_text(text + '{"step": 4, "scale": 65')
    assert [r["step"] for r in read_trace(path).steps] == [1, 2, 3]
    bad = tmp_path / "bad.jsonl"
    first = json.dumps(header()) + "\n"  # a valid header (the format requires start_step and settings)
    for content, message in [
        ("", "holds no dls trace header"),
        ('{"step": 1, "scale": 1.0, "overflow": false}\n', "before any header"),
        ('{"format": "something-else", "version": 1}\n', "not 'dls-trace'"),
        ('{"format": "dls-trace", "version": 99}\n', "trace version 99; this dls reads versions 1 to 1"),
        (first + "not json\n" + '{"step": 1}\n', "line 2: not JSON"),
        (first + '{"step": 1}\n', "needs 'step', 'scale' and 'overflow'"),
    ]:
        bad.write_text(content)
        with pytest.raises(TraceError, match=message):
            read_trace(bad)
    with pytest.raises(TraceError, match="cannot read the trace"):
        read_trace(tmp_path / "missing.jsonl")
    path.write_bytes(b"\xef\xbb\xbf" + text.replace("\n", "\r\n").encode())  # as a Windows editor saves it
    assert [r["step"] for r in read_trace(path).steps] == [1, 2, 3]
    # only the last line may be cut off, and only where no newline ended it
    path.write_text(text + '{"step": 4, "scale": 65\n')
    with pytest.raises(TraceError, match="line 5: not JSON"):
        read_trace(path)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "holds no dls trace header (an empty file, or not a trace)"),
        (b"\n\n   \n", "holds no dls trace header"),
        (bytes(range(256)) * 64, "line 1: not JSON"),
        (b"\xff\xfe\x00garbage\n", "line 1: not UTF-8 text"),
        (b"\x7fELF\x02\x01\x01\x00" + b"\x00" * 40 + b"\n" + b"\xff" * 100, "line 1: not JSON"),
        (lines(header()).encode() + b'{"step": 1, "scale": "\xff\xfe", "overflow": false}\n', "line 2: not UTF-8"),
    ],
    ids=["empty", "blank", "binary", "not UTF-8", "an executable", "invalid UTF-8 in a string"],
)
def test_empty_files_and_binary_garbage_are_refused(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "garbage"
    path.write_bytes(content)
    with pytest.raises(TraceError, match=re.escape(message)):
        read_trace(path)


def _alarm(signum: int, frame: Any) -> None:
    raise TimeoutError("read_trace blocked")


def test_what_is_not_a_regular_file_is_refused_before_it_is_opened(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "dir").mkdir()
    (tmp_path / "zero").symlink_to("/dev/zero")
    (tmp_path / "fifo-link").symlink_to(fifo)
    trace = tmp_path / "trace.jsonl"
    trace.write_text(lines(header(), step(1)))
    (tmp_path / "link").symlink_to(trace)
    (tmp_path / "dangling").symlink_to(tmp_path / "nothing")
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(20)  # a FIFO that was opened would block here forever, /dev/zero would fill the memory
    try:
        for name, what in [
            ("fifo", "a FIFO"),
            ("fifo-link", "a FIFO"),
            ("dir", "a directory"),
            ("zero", "a device or socket"),
            ("/dev/null", "a device or socket"),
        ]:
            path = Path(name) if name.startswith("/") else tmp_path / name
            with pytest.raises(TraceError, match=re.escape(f"{path} is {what}, not a regular file")):
                read_trace(path)
        assert [r["step"] for r in read_trace(tmp_path / "link").steps] == [1]  # a link to a trace is read
        with pytest.raises(TraceError, match=r"cannot read the trace .*dangling: No such file"):
            read_trace(tmp_path / "dangling")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_the_guide_states_the_schema_field_by_field() -> None:
    guide = (ROOT / "docs" / "guides" / "policy-lab.md").read_text()
    for kind, schema in (("header", HEADER), ("step", STEP)):
        for name, spec in schema.items():
            row = f"| {kind} | `{name}` | {spec.type} | {'yes' if spec.required else 'no'} |"
            assert row in guide, row
    assert f"{trace_format.MAX_DEPTH} levels" in guide and "16 MiB" in guide


def test_kept_until_drops_the_steps_and_segments_after_the_checkpoint(tmp_path: Path) -> None:
    # moved from test_record.py (kept_for_resume, now the reader's kept_until), on headers the schema accepts
    records = [header(), *(step(s) for s in range(1, 6)), header(start_step=5), *(step(s) for s in range(6, 9))]
    path = tmp_path / "t.jsonl"
    path.write_bytes(lines(*records).encode() + b'{"step": 9, "sca')
    kept = [json.loads(line) for line in kept_until(path, 7).decode().splitlines()]
    assert kept == records[:9]
    kept = [json.loads(line) for line in kept_until(path, 5).decode().splitlines()]
    assert kept == records[:6]  # the segment that started at 5 goes: the resumed run writes its own
