"""``dls train`` records a trace into model_dir; ``dls replay`` and ``dls tune`` read it (and one recorded through
the library API): their tables, ``--json``, ``--plot``, and one-line errors with exit status 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import dls
from dls.diagnostics.record import read_trace
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
