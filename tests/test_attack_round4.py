"""Issue 38's last item: a fresh attack on the policy lab and the trainer (the cases: /tmp/lab-attack/attack.py of
that session, its findings in CHANGELOG.md). Each test here failed before its fix. Also the recorder's side of the
trace format: one reader (``dls.diagnostics.trace``), its constants in one place, a segment appended without a
``start_step``, and the trace a resumed run keeps read with the reader's bounds."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import dls
from dls.diagnostics import record, trace
from dls.diagnostics.trace import TRACE_FILE, read_trace
from dls.train.cli import main
from dls.train.rundir import trace_to_keep
from test_record import fp16_loss, mlp
from test_train import tiny

SOURCE = Path(__file__).resolve().parent.parent / "src" / "dls"


def one_line(err: str) -> str:
    assert err.startswith("dls: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def record_steps(path: Path, steps: int, **options: Any) -> None:
    scaler = dls.GradScaler("cpu", init_scale=2.0**10)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with scaler.record(path, **options):
        for i in range(steps):
            scaler.scale(fp16_loss(model, i)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()


# ---------------------------------------------------------------------- one reader, one set of constants
def test_the_recorder_holds_no_second_trace_reader_and_imports_the_formats_constants() -> None:
    for name in ("read_trace", "Trace", "Segment", "TraceError", "kept_for_resume"):
        assert getattr(record, name, None) in (None, getattr(trace, name, object())), name
    assert not hasattr(record, "kept_for_resume") and not hasattr(record, "Segment")
    for name in ("TRACE_FORMAT", "TRACE_VERSION", "STATE_FIELDS"):
        assert getattr(record, name) is getattr(trace, name)  # imported, not defined twice
    tree = ast.parse((SOURCE / "diagnostics" / "record.py").read_text())
    assigned = {
        t.id for node in ast.walk(tree) if isinstance(node, ast.Assign) for t in node.targets if hasattr(t, "id")
    }
    assert not assigned & {"TRACE_FORMAT", "TRACE_VERSION", "STATE_FIELDS", "TRACE_FILE"}
    imports = [node.module for node in ast.walk(ast.parse((SOURCE / "diagnostics" / "trace.py").read_text()))
               if isinstance(node, ast.ImportFrom)]  # fmt: skip
    assert "dls.diagnostics.record" not in imports  # the format does not depend on its writer


# ---------------------------------------------------------------------- appending a segment
def test_a_segment_appended_without_start_step_continues_the_trace(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    record_steps(path, 3)
    record_steps(path, 2, append=True)  # before: start_step 0, a trace its own reader refused
    read = read_trace(path)
    assert [s.header["start_step"] for s in read.segments] == [0, 3]
    assert [r["step"] for r in read.steps] == [1, 2, 3, 4, 5]


def test_a_segment_appended_before_the_traces_last_step_is_refused_before_writing(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    record_steps(path, 3)
    before = path.read_bytes()
    with pytest.raises(ValueError, match=r"start_step 1 comes before step 3.*t\.jsonl"):
        record_steps(path, 2, append=True, start_step=1)
    assert path.read_bytes() == before
    record_steps(path, 1, append=True, start_step=10)  # a gap is allowed: a resumed run lost steps
    assert [r["step"] for r in read_trace(path).steps] == [1, 2, 3, 11]


@pytest.mark.parametrize("content", [b"not a trace\n", b'{"format": "dls-trace", "version": 9}\n', b"[" * 10**5])
def test_appending_to_a_file_that_is_not_a_trace_is_refused_before_writing(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=r"append=True: .*t\.jsonl"):
        record_steps(path, 1, append=True)
    assert path.read_bytes() == content


def test_appending_to_a_missing_or_empty_file_starts_at_step_0(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    record_steps(path, 2, append=True)
    path.write_bytes(b"")
    record_steps(path, 2, append=True)
    assert [r["step"] for r in read_trace(path).steps] == [1, 2]


# ---------------------------------------------------------------------- the trace a resumed run keeps
@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished tiny run (checkpoints at steps 2 and 4, a trace), copied by each test that changes it."""
    run = tmp_path_factory.mktemp("finished") / "run"
    (run.parent / "c.yaml").write_text(yaml.safe_dump(tiny(run, runconfig={"max_steps": 4, "checkpoint_steps": 2})))
    assert main(["train", str(run.parent / "c.yaml"), "--no_progress"]) == 0
    return run


def test_trace_to_keep_of_no_trace_keeps_nothing(tmp_path: Path) -> None:
    # moved from test_record.py (kept_for_resume(None, 3) == b"")
    assert trace_to_keep(None, tmp_path / TRACE_FILE, 3) == b""
    assert trace_to_keep(b"", tmp_path / TRACE_FILE, 3) == b""
    assert trace_to_keep(b'{"format": "dls-tr', tmp_path / TRACE_FILE, 3) == b""  # killed mid-header


@pytest.mark.parametrize(
    "tail",
    [b"[" * 100_000 + b"]" * 100_000 + b"\n", b'{"step": "5", "scale": 1.0, "overflow": false}\n', b"\xff\xfe\n"],
    ids=["nesting-bomb", "string-step", "binary"],
)
def test_a_resume_refuses_a_crafted_trace_before_anything_changes(
    finished: Path, tmp_path: Path, tail: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    run = Path(shutil.copytree(finished, tmp_path / "run"))
    (run / TRACE_FILE).write_bytes((run / TRACE_FILE).read_bytes() + tail)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    assert main(["train", "--resume", str(run), "-o", "runconfig.max_steps=6", "--no_progress"]) == 2
    err = one_line(capsys.readouterr().err)
    assert f"{run / TRACE_FILE}, line" in err and "move the file away" in err
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before  # nothing written


def test_a_resume_keeps_the_trace_up_to_its_checkpoint_and_the_result_reads(finished: Path, tmp_path: Path) -> None:
    run = Path(shutil.copytree(finished, tmp_path / "run"))
    (run / "checkpoint_4.mdl").unlink()  # resumed from step 2: the steps 3 and 4 recorded after it go
    assert main(["train", "--resume", str(run), "-o", "runconfig.max_steps=5", "--no_progress"]) == 0
    read = read_trace(run / TRACE_FILE)
    assert [s.header["start_step"] for s in read.segments] == [0, 2]
    assert [r["step"] for r in read.steps] == [1, 2, 3, 4, 5]
    assert json.loads((run / TRACE_FILE).read_text().splitlines()[0])["format"] == "dls-trace"


# ---------------------------------------------------------------------- a long trace replays in bounded work
def long_trace(path: Path, steps: int) -> Path:
    """``steps`` steps of a trace without model hooks, an overflow every 97th: every clean step is undecided above
    its scale, so that the bounds follow hundreds of states."""
    settings = dls.settings.ScalerSettings.torch(init_scale=2.0**15)
    head = {
        "format": "dls-trace", "version": 1, "start_step": 0,
        "settings": {f: getattr(settings, f) for f in settings.__dataclass_fields__},
    }  # fmt: skip
    rows = [
        {"step": i, "scale": 32768.0, "overflow": i % 97 == 0, "grad_amax": None if i % 97 == 0 else 1e-5}
        for i in range(1, steps + 1)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in [head, *rows]))
    return path


def test_the_bounds_of_a_long_trace_stop_at_a_budget_of_rule_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: the bounds followed up to 256 states for every step (50,000 steps: minutes per policy, `dls replay`
    # past a minute on its defaults); now they widen once MAX_BRANCH_STEPS rule steps were spent on them.
    from dls.diagnostics import replaying

    trace_ = read_trace(long_trace(tmp_path / "t.jsonl", 600))
    calls = 0
    advance = replaying._advance

    def counted(branches: list[Any], *args: Any) -> Any:
        nonlocal calls
        calls += len(branches)
        return advance(branches, *args)

    monkeypatch.setattr(replaying, "_advance", counted)
    (exact,) = replaying.replay(trace_, ["torch"])
    assert exact.bounds_exact and calls > 2_000  # the states the bounds follow without a budget
    monkeypatch.setattr(replaying, "MAX_BRANCH_STEPS", 2_000, raising=False)
    calls = 0
    (cut,) = replaying.replay(trace_, ["torch"])
    assert not cut.bounds_exact and calls <= 2_000 + replaying.MAX_BRANCHES
    assert cut.scales == exact.scales and cut.skipped[0] == exact.skipped[0]  # the estimate is the same
    assert cut.skipped[1] <= exact.skipped[1] <= exact.skipped[2] <= cut.skipped[2]  # looser, still bounds
    assert cut.scale_low[-1] is None  # undecided from the cut on


# ---------------------------------------------------------------------- dls replay's outputs
@pytest.fixture
def recorded(tmp_path: Path) -> Path:
    path = tmp_path / "t.jsonl"
    record_steps(path, 4, histogram_every=2)
    return path


def test_a_plot_onto_the_trace_itself_is_refused_and_the_trace_kept(
    recorded: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    before = recorded.read_bytes()
    monkeypatch.chdir(recorded.parent)
    for plot in (str(recorded), "./t.jsonl"):  # before: the PNG replaced the trace
        assert main(["replay", str(recorded), "--plot", plot]) == 2
        err = one_line(capsys.readouterr().err)
        assert f"--plot: {plot} is the trace being replayed" in err
    assert recorded.read_bytes() == before


def test_replay_without_a_standard_output_is_exit_3_naming_it(
    recorded: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sys.stdout", None)  # `dls replay T >&-`: Python has no sys.stdout (before: exit 4)
    for command in (
        ["replay", str(recorded)],
        ["tune", str(recorded), "--max-underflow", "none", "--policy", "static"],
    ):
        assert main(command) == 3
        assert "the standard output: it is closed" in one_line(capsys.readouterr().err)


# ---------------------------------------------------------------------- configs
@pytest.mark.parametrize(
    ("value", "said"),
    [("2001-13-45", "month must be in 1..12"), ("1" + "0" * 5000, "Exceeds the limit (4300 digits)")],
    ids=["date", "5000-digits"],
)
def test_a_value_yaml_cannot_construct_is_named_as_such(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str, said: str
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(f"model:\n  name: mlp\nrunconfig:\n  seed: {value}\n")
    assert main(["validate", str(config)]) == 2
    err = one_line(capsys.readouterr().err)
    assert f"in {config}: a value YAML cannot read: {said}" in err  # before: "the config expands to month must ..."
    assert "set_int_max_str_digits" not in err and "expands to" not in err


def test_replay_updates_a_clean_step_on_the_rules_known_clean_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As the scaler does when the host knows the step was clean (dls.loss_scale.LossScale.update): the fewest device
    # ops, the same scales (before: every replayed update took the full path, 2-5x the work of a long replay).
    from dls.diagnostics import replaying
    from dls.policy import DynamicRule

    trace_ = read_trace(long_trace(tmp_path / "t.jsonl", 300))
    full = DynamicRule.update_
    paths: list[bool] = []

    def counted(self: Any, state: Any, found_inf: torch.Tensor, **options: Any) -> None:
        paths.append(bool(options.get("known_clean")))
        full(self, state, found_inf, **options)

    monkeypatch.setattr(DynamicRule, "update_", counted)
    (result,) = replaying.replay(trace_, ["torch"])
    assert sum(paths) > len(paths) // 2  # most updates are of clean steps
    monkeypatch.setattr(replaying, "_update", lambda rule, state, overflow, *_: full(rule, state, _flag(overflow)))
    (reference,) = replaying.replay(trace_, ["torch"])
    assert (result.scales, result.skipped, result.scale_low, result.scale_high) == (
        reference.scales, reference.skipped, reference.scale_low, reference.scale_high,
    )  # fmt: skip


def _flag(overflow: bool) -> torch.Tensor:
    return torch.ones(()) if overflow else torch.zeros(())


def test_a_resume_refuses_a_nesting_bomb_in_metrics_naming_the_line(
    finished: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = Path(shutil.copytree(finished, tmp_path / "run"))
    metrics = run / "metrics.jsonl"
    lines = metrics.read_bytes().count(b"\n")
    metrics.write_bytes(metrics.read_bytes() + b"[" * 100_000 + b"]" * 100_000 + b"\n")
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    # before: json's RecursionError, exit 4
    assert main(["train", "--resume", str(run), "-o", "runconfig.max_steps=6", "--no_progress"]) == 2
    err = one_line(capsys.readouterr().err)
    assert f"{metrics} line {lines + 1} is not a metrics row (nested too deeply" in err
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before


def test_a_lock_file_holding_a_nesting_bomb_is_no_holder(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / ".dls.lock").write_text("[" * 4096)  # not a record dls wrote; before: RecursionError, every run exit 4
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(tiny(run, runconfig={"max_steps": 2, "checkpoint_steps": 2})))
    assert main(["train", str(tmp_path / "c.yaml"), "--no_progress"]) == 0
    assert (run / "checkpoint_2.mdl").is_file()


def test_tune_says_first_when_its_search_takes_minutes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from dls.train import lab

    path = long_trace(tmp_path / "t.jsonl", 50)
    monkeypatch.setattr(lab, "LONG_TUNE", 10, raising=False)  # before: silent for minutes on a long trace
    assert main(["tune", str(path), "--policy", "static", "--max-underflow", "none"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("dls tune: replaying ") and "over 50 steps takes a while" in err and "--policy" in err
    monkeypatch.setattr(lab, "LONG_TUNE", 10**9)
    assert main(["tune", str(path), "--policy", "static", "--max-underflow", "none"]) == 0
    assert capsys.readouterr().err == ""
