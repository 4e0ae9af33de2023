"""``dls train`` records a trace into model_dir; ``dls replay`` and ``dls tune`` read it (and one recorded through
the library API): their tables, ``--json``, ``--plot`` (every policy in every form, on the default trace and on a
``record_trace: model`` one: an undecidable figure is null / "-", never NaN), one-line errors with exit status 2
(a key or policy given twice, absurd specs, FIFOs, devices), and a plot that cannot be written: exit 3 naming it,
no file left."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dls
from dls.diagnostics.trace import read_trace
from dls.train.cli import main
from test_record import fp16_loss, mlp

ROOT = Path(__file__).resolve().parent.parent
MLP = str(ROOT / "configs" / "mlp_fp16_dls.yaml")


def train(model_dir: Path, steps: int, *extra: str, resume: bool = False) -> None:
    overrides = [f"runconfig.max_steps={steps}", "runconfig.checkpoint_steps=10", f"runconfig.model_dir={model_dir}"]
    # a small max_loss_scale and a short interval: the run grows into overflows
    overrides += ["optimizer.steps_per_increase=4", "optimizer.initial_loss_scale=4194304", *extra]
    argv = ["train", "--resume", str(model_dir)] if resume else ["train", MLP]
    assert main([*argv, "--no_progress", "-o", *overrides]) == 0


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_dir = tmp_path_factory.mktemp("lab") / "mlp"
    train(model_dir, 20, "runconfig.record_trace=model", "model.loss_weight=1.0")
    train(model_dir, 30, resume=True)
    return model_dir


def test_train_records_a_trace_by_default_and_a_resumed_run_continues_it(run_dir: Path) -> None:
    trace = read_trace(run_dir / "trace.jsonl")
    assert [segment.header["start_step"] for segment in trace.segments] == [0, 20]
    assert [row["step"] for row in trace.steps] == list(range(1, 31))
    assert all(segment.header["modules"] for segment in trace.segments)  # record_trace: model, in the saved config
    assert [r["step"] for r in trace.steps if "exponents" in r] == [10, 20, 30]  # every log_steps
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = {row["step"]: row for row in metrics if "loss_scale" in row}
    for row in trace.steps:
        if row["step"] in logged:
            assert (row["scale"], row["overflow"]) == (
                logged[row["step"]]["loss_scale"],
                logged[row["step"]]["skipped"],
            )


def test_record_trace_false_writes_none(tmp_path: Path) -> None:
    train(tmp_path / "off", 3, "runconfig.record_trace=false")
    assert not (tmp_path / "off" / "trace.jsonl").exists()


def test_replay_prints_each_policy_and_reproduces_the_recorded_run(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(["replay", str(run_dir / "trace.jsonl"), "--policy", "recorded", "--policy", "torch:growth_interval=5"])
        == 0
    )
    out = capsys.readouterr().out
    assert "recorded: the replay reproduces the recorded scales and skips at every step" in out
    assert "torch:growth_interval=5" in out and "skipped" in out


def test_replay_json_and_plot(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "plots" / "replay.png"
    assert main(["replay", str(run_dir / "trace.jsonl"), "--json", "--plot", str(png)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["steps"] == 30 and data["plot"] == str(png)
    names = [p["policy"] for p in data["policies"]]
    assert names[:4] == ["recorded", "torch", "cerebras", "megatron"]
    recorded = data["policies"][0]
    assert recorded["first_departure"] is None and len(recorded["scales"]) == 30
    assert png.read_bytes().startswith(b"\x89PNG")


def test_replay_and_tune_read_a_trace_recorded_through_the_library(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = dls.GradScaler("cpu", init_scale=2.0**20, growth_interval=3)
    path = tmp_path / "trace.jsonl"
    with scaler.record(path, model=model, histogram_every=2):
        for step in range(12):
            scaler.scale(fp16_loss(model, step)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    assert main(["replay", str(path)]) == 0
    assert "recorded: the replay reproduces" in capsys.readouterr().out
    assert main(["tune", str(path), "--policy", "torch", "--policy", "megatron", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert (
        "torch: grid init_scale in {2^8, 2^12, 2^16, 2^20, 2^24}, growth_interval in {100, 250, 500, 1000, 2000}" in out
    )
    assert "torch.amp:" in out and "Megatron flags:" in out and "Model Zoo YAML:" in out
    assert main(["tune", str(path), "--json", "--max-underflow", "none", "--policy", "static"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["max_underflow"] is None and "static" in data["best"] and data["best"]["static"]["config"]["dls"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["replay", "{trace}", "--policy", "torch:growth_intervl=5"], "--policy: policy 'torch' has no key"),
        (["replay", "{trace}", "--policy", "bogus"], "--policy: unknown policy 'bogus'"),
        (["replay", "{trace}", "--format", "float17"], "--format: format must be one of"),
        (["replay", "{missing}"], "cannot read the trace"),
        (["replay", "{config}"], "not JSON (is this a dls trace?)"),
        (["tune", "{trace}", "--max-underflow", "lots"], "--max-underflow must be a fraction in [0, 1] or none"),
        (["tune", "{trace}", "--max-underflow", "2"], "max_underflow must be a number in [0, 1]"),
        (["tune", "{trace}", "--top", "0"], "--top must be >= 1"),
        (["tune", "{trace}", "--policy", "torh"], "unknown policy 'torh' (did you mean 'torch'?)"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    run_dir: Path, tmp_path: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = {"trace": str(run_dir / "trace.jsonl"), "missing": str(tmp_path / "nope.jsonl"), "config": MLP}
    assert main([arg.format(**paths) for arg in argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("dls: error: ") and message in err


# ---------------------------------------------------------------------------------------------- every output form
@pytest.fixture(scope="module")
def default_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of the shipped config as it is, with dls train's default trace (runconfig.record_trace: true, no model
    hooks): clean steps at 2^15, which decide nothing above it."""
    model_dir = tmp_path_factory.mktemp("lab") / "default"
    overrides = ["runconfig.max_steps=30", f"runconfig.model_dir={model_dir}"]
    assert main(["train", MLP, "--no_progress", "-o", *overrides]) == 0
    return model_dir


def _no_nan(token: str) -> None:
    raise AssertionError(f"{token} in the JSON: an undecidable figure must be null")


POLICIES = ["recorded", "torch", "cerebras", "megatron", "deepspeed", "static"]


@pytest.mark.parametrize("which", ["default", "model"])
@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_in_every_output_form_on_both_kinds_of_trace(
    which: str, policy: str, run_dir: Path, default_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = str((default_dir if which == "default" else run_dir) / "trace.jsonl")
    assert main(["replay", trace, "--policy", policy, "--json"]) == 0, capsys.readouterr().err
    data = json.loads(capsys.readouterr().out, parse_constant=_no_nan)
    (result,) = data["policies"]
    assert len(result["scales"]) == len(result["scale_low"]) == data["steps"] == 30
    if not result["bounds_exact"]:  # past MAX_BRANCHES states: the scales a step may take are undecidable
        assert None in result["scale_high"]
    assert main(["replay", trace, "--policy", policy]) == 0
    table = capsys.readouterr().out
    assert f"\n{policy} " in table and "nan" not in table.lower()
    png = tmp_path / "replay.png"
    assert main(["replay", trace, "--policy", policy, "--plot", str(png)]) == 0
    assert f"Plot: {png}" in capsys.readouterr().out and png.read_bytes().startswith(b"\x89PNG")


def test_an_undecidable_figure_is_null_in_json_and_a_dash_in_the_table(
    default_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = str(default_dir / "trace.jsonl")
    assert main(["replay", trace, "--policy", "megatron", "--json"]) == 0  # from 2**32: every step undecided
    (megatron,) = json.loads(capsys.readouterr().out, parse_constant=_no_nan)["policies"]
    assert megatron["bounds_exact"] is False and megatron["scale_low"][-1] is None
    data = read_trace(default_dir / "trace.jsonl")
    for segment in data.segments:
        segment.steps = [{k: v for k, v in row.items() if k != "exponents"} for row in segment.steps]
    from dls.diagnostics.replaying import replay

    (plain,) = replay(data, ["torch"])
    assert plain.underflow is None and plain.to_dict()["underflow"] is None  # no histograms: undecidable
    from dls.train.lab import _replay_text

    row = next(line for line in _replay_text(data, [plain]).splitlines() if line.startswith("torch "))
    assert row.split()[-3] == "-"  # the underflow column


# ---------------------------------------------------------------------------------------------- argument errors
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["replay", "{trace}", "--policy", "torch:init_scale=1,init_scale=2"], "key 'init_scale' is given twice"),
        (["replay", "{trace}", "--policy", "torch", "--policy", "torch"], "--policy 'torch' is given twice"),
        (["replay", "{trace}", "--format", ""], "--format: format must be one of float16, bfloat16"),
        (["tune", "{trace}", "--format", ""], "--format: format must be one of"),
        (["tune", "{trace}", "--policy", "torch", "--policy", "torch"], "policy 'torch' is given twice"),
        (["replay", "{trace}", "--plot", ""], "--plot is empty"),
        (["replay", "{trace}", "--plot", "{dir}"], "is not a regular file"),
        (["replay", "{trace}", "--policy", "torch:init_scale=2**100000"], "'2**100000' is not a number"),
        (["replay", "{trace}", "--policy", "torch:init_scale=2**5000"], "'2**5000' is past a float's range"),
        (["replay", "{trace}", "--policy", "torch:init_scale=" + "9" * 5000], "is not a number"),
        (["replay", "{trace}", "--policy", "torch:init_scale=1e400"], "init_scale must be a number from 2**-126"),
        (["replay", "{trace}", "--policy", "torch:init_scale=nan"], "'nan' is not a number"),
        (["replay", "{trace}", "--policy", "torch:growth_interval=1e3"], "growth_interval must be an integer"),
        (["replay", "{trace}", "--policy", "x" * 100_000], "unknown policy 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"),
        (["replay", "{trace}", "--policy", "torch:" + "a=1," * 10_000], "policy 'torch' has no key 'a'"),
        (["replay", "{trace}", "--policy", "torch:init_scale=1\n2"], "'1\\n2' is not a number"),
        (["replay", "{trace}", "--policy", "recorded:" + "x" * 10_000], "policy 'recorded' takes no settings"),
        (["replay", "{trace}", "--policy", ":"], "unknown policy ''"),
        (["tune", "{trace}", "--policy", "torch:init_scale=2"], "unknown policy 'torch:init_scale=2'"),
        (["tune", "{trace}", "--max-underflow", "nan"], "max_underflow must be a number in [0, 1]"),
        (["tune", "{trace}", "--max-underflow=-inf"], "max_underflow must be a number in [0, 1]"),
        (["replay", "{fifo}"], "is a FIFO, not a regular file"),
        (["replay", "/dev/zero"], "/dev/zero is a device or socket, not a regular file"),
        (["replay", "{dir}"], "is a directory, not a regular file"),
        (["replay", "{empty}"], "holds no dls trace header"),
    ],
)
def test_bad_policies_formats_and_paths_are_one_line_and_exit_2(
    run_dir: Path, tmp_path: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "empty").write_bytes(b"")
    paths = {"trace": str(run_dir / "trace.jsonl"), "fifo": str(tmp_path / "fifo"), "dir": str(tmp_path)}
    paths["empty"] = str(tmp_path / "empty")
    assert main([arg.format(**paths) if arg.startswith("{") else arg for arg in argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("dls: error: ") and message in err, err
    assert len(err) < 500, err


# ---------------------------------------------------------------------------------------------- the plot's path
CLI = "import sys; from dls.train.cli import main; sys.exit(main(sys.argv[1:]))"


def test_a_plot_on_a_full_disk_names_its_path_and_leaves_no_file(run_dir: Path, tmp_path: Path) -> None:
    """``ulimit -f`` (EFBIG, as a full disk's ENOSPC): the PNG cannot be written."""
    out = tmp_path / "plots"
    out.mkdir()
    png = out / "replay.png"
    script = f"import resource; resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096)); {CLI}"
    proc = subprocess.run(
        [sys.executable, "-c", script, "replay", str(run_dir / "trace.jsonl"), "--plot", str(png)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr == f"dls: error: {png}: File too large (free some space or give another --plot path)\n"
    assert os.listdir(out) == []  # no partial file, no temporary


def test_a_plot_replaces_a_file_but_never_follows_a_link(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = str(run_dir / "trace.jsonl")
    png = tmp_path / "replay.png"
    png.write_bytes(b"an older plot")
    assert main(["replay", trace, "--policy", "torch", "--plot", str(png)]) == 0
    assert png.read_bytes().startswith(b"\x89PNG")
    target = tmp_path / "elsewhere.txt"
    target.write_text("not to be clobbered")
    (tmp_path / "link.png").symlink_to(target)
    (tmp_path / "dangling.png").symlink_to(tmp_path / "nothing")
    for name in ("link.png", "dangling.png"):
        assert main(["replay", trace, "--policy", "torch", "--plot", str(tmp_path / name)]) == 2
        assert "is a link, which dls does not follow" in capsys.readouterr().err
    assert target.read_text() == "not to be clobbered" and not (tmp_path / "nothing").exists()
    (tmp_path / "file").write_text("x")  # a parent that is a file: exit 3 naming the plot
    assert main(["replay", trace, "--policy", "torch", "--plot", str(tmp_path / "file" / "p.png")]) == 3
    assert capsys.readouterr().err.startswith(f"dls: error: {tmp_path / 'file' / 'p.png'}: ")
    assert sorted(os.listdir(tmp_path)) == ["dangling.png", "elsewhere.txt", "file", "link.png", "replay.png"]


def test_a_full_standard_output_and_a_trace_larger_than_memory_are_named_as_such(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = str(run_dir / "trace.jsonl")
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [sys.executable, "-c", CLI, "replay", trace, "--policy", "torch", "--json"],
            stdout=full, stderr=subprocess.PIPE, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
    assert proc.returncode == 3
    assert proc.stderr == (
        "dls: error: the standard output: No space left on device (free some space or send the output elsewhere)\n"
    )

    def too_large(path: str) -> None:
        raise MemoryError

    monkeypatch.setattr("dls.diagnostics.trace.read_trace", too_large)
    assert main(["replay", trace]) == 3
    err = capsys.readouterr().err
    assert err == f"dls: error: out of memory: reading the trace {trace}; replay a part of it (a header line, then " \
        "the step lines that follow it)\n"  # fmt: skip
