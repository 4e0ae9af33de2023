"""The ``dls`` command's exit statuses: 1 only when loss scaling cannot help, 2 bad input (config, checkpoint
fields, missing extras), 3 the environment (model_dir not a directory, file too large), 4 internal error with
the traceback in a file, 143 SIGTERM after a checkpoint. Every failure is one line, without a traceback, and
leaves what was written before intact."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from dls.train import checkpoint as ckpt
from dls.train import rundir
from dls.train.cli import main
from dls.train.trainer import Trainer
from test_train import metrics, tiny

ROOT = Path(__file__).resolve().parent.parent
MLP = str(ROOT / "configs" / "mlp_fp16_dls.yaml")


def write_config(path: Path, raw: dict[str, Any]) -> str:
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def run_of(tmp_path: Path, steps: int = 4) -> tuple[Path, str]:
    """A finished tiny run (checkpoints at 2 and 4) and its config file."""
    run = tmp_path / "run"
    config = write_config(tmp_path / "c.yaml", tiny(run, runconfig={"max_steps": steps, "checkpoint_steps": 2}))
    assert main(["train", config, "--no_progress"]) == 0
    return run, config


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def one_error_line(err: str) -> str:
    assert err.startswith("dls: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def python(script: str, *args: str, **kwargs: Any) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT, **kwargs,
    )  # fmt: skip


CLI = "import sys; from dls.train.cli import main; sys.exit(main(sys.argv[1:]))"


# ---------------------------------------------------------------------- 2: checkpoint fields
def _global_step(state: dict[str, Any]) -> None:
    state["global_step"] = "abc"


def _rng(state: dict[str, Any]) -> None:
    state["rng"]["torch"] = torch.zeros(3, dtype=torch.uint8)


def _optimizer_shape(state: dict[str, Any]) -> None:
    entry = state["optimizer"]["state"][0]
    entry["exp_avg"] = torch.zeros(7)


def _optimizer_garbage(state: dict[str, Any]) -> None:
    state["optimizer"] = {"state": "x", "param_groups": 3}


def _step_minus_5(state: dict[str, Any]) -> None:
    state["optimizer"]["state"][0]["step"] = torch.tensor(-5.0)


def _zero_dim_exp_avg(state: dict[str, Any]) -> None:
    state["optimizer"]["state"][0]["exp_avg"] = torch.tensor(0.5)


def _nan_exp_avg(state: dict[str, Any]) -> None:
    state["optimizer"]["state"][1]["exp_avg"][0] = float("nan")


def _integer_exp_avg_sq(state: dict[str, Any]) -> None:
    entry = state["optimizer"]["state"][0]
    entry["exp_avg_sq"] = entry["exp_avg_sq"].to(torch.int64)


def _nan_lr(state: dict[str, Any]) -> None:
    state["optimizer"]["param_groups"][0]["lr"] = float("nan")


def _inf_beta(state: dict[str, Any]) -> None:
    state["optimizer"]["param_groups"][0]["betas"] = (0.9, float("inf"))


def _no_betas(state: dict[str, Any]) -> None:  # groups of SGD's kind, while the saved config says AdamW
    del state["optimizer"]["param_groups"][0]["betas"]


def _nan_weight(state: dict[str, Any]) -> None:
    next(iter(state["model"].values()))[0] = float("nan")


def _dataloader(state: dict[str, Any]) -> None:
    state["dataloader"]["epoch"] = -1


def _scheduler(state: dict[str, Any]) -> None:
    state["lr_scheduler"]["base_lrs"] = ["abc"]


def _scaler(state: dict[str, Any]) -> None:
    state["grad_scaler"]["loss_scale"] = float("nan")


OPTIMIZER = "cannot load the optimizer state of {path}: "
SCALER = "cannot load the grad_scaler state of {path}: "


@pytest.mark.parametrize(
    ("craft", "needle"),
    [
        (_global_step, "cannot load the global_step state of {path}: global_step must be an integer >= 0; got 'abc'"),
        (_rng, "cannot load the rng state of {path}"),
        (_optimizer_shape, OPTIMIZER + "optimizer.state[0].exp_avg is a torch.float32 tensor of shape (7,)"),
        (_optimizer_garbage, OPTIMIZER + "it is not an optimizer state dict"),
        (_step_minus_5, OPTIMIZER + "optimizer.state[0].step must be a number >= 0; got -5.0"),
        (_zero_dim_exp_avg, OPTIMIZER + "optimizer.state[0].exp_avg is a torch.float32 tensor of shape ()"),
        (_nan_exp_avg, OPTIMIZER + "optimizer.state[1].exp_avg holds inf/NaN values"),
        (_integer_exp_avg_sq, OPTIMIZER + "optimizer.state[0].exp_avg_sq is a torch.int64 tensor"),
        (_nan_lr, OPTIMIZER + "optimizer.param_groups[0].lr must be finite; got nan"),
        (_inf_beta, OPTIMIZER + "optimizer.param_groups[0].betas must be finite; got (0.9, inf)"),
        (_no_betas, OPTIMIZER + "its param_groups are SGD's and optimizer.optimizer_type is AdamW now"),
        (_nan_weight, "the model in {path} holds inf/NaN values"),
        (_dataloader, "cannot load the dataloader state of {path}: epoch must be an integer >= 0; got -1"),
        (_scheduler, "cannot load the lr_scheduler state of {path}: base_lrs must be a list of 1 finite numbers"),
        (_scaler, SCALER + "grad_scaler.loss_scale must be a positive finite number; got nan"),
    ],
)
def test_crafted_checkpoint_fields_exit_2_naming_the_field(
    tmp_path: Path, craft: Any, needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    run, config = run_of(tmp_path)
    path = run / "checkpoint_4.mdl"
    state = ckpt.load_checkpoint(path)
    craft(state)
    torch.save(state, path)
    before = snapshot(run)
    capsys.readouterr()
    assert main(["train", config, "--resume", str(run), "--no_progress", "-o", "runconfig.max_steps=6"]) == 2
    assert needle.format(path=path) in one_error_line(capsys.readouterr().err)
    assert snapshot(run) == before


def test_switching_the_optimizer_type_on_resume_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run, config = run_of(tmp_path)
    before = snapshot(run)
    capsys.readouterr()
    raw = yaml.safe_load(Path(config).read_text())
    raw["optimizer"]["optimizer_type"] = "SGD"
    sgd = write_config(tmp_path / "sgd.yaml", raw)
    assert main(["train", sgd, "--resume", str(run), "--no_progress", "-o", "runconfig.max_steps=6"]) == 2
    err = one_error_line(capsys.readouterr().err)
    assert f"cannot load the optimizer state of {run / 'checkpoint_4.mdl'}: its param_groups are AdamW's" in err
    assert "and optimizer.optimizer_type is SGD now" in err
    assert snapshot(run) == before


# ---------------------------------------------------------------------- 2: config
def test_bad_loss_scales_exit_2_before_training(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    for override in ("optimizer.loss_scaling_factor=1e-300", "optimizer.steps_per_increase=1e10"):
        for command in ("train", "validate"):
            assert main([command, MLP, "-o", override, f"runconfig.model_dir={run}"]) == 2, (command, override)
            err = capsys.readouterr().err
            assert override.split("=")[0] in err and "Traceback" not in err
    assert not run.exists()


def test_validate_rejects_what_training_rejects(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["-o", "data.batch_size=5000", f"runconfig.model_dir={tmp_path / 'run'}"]
    assert main(["train", MLP, *args]) == 2
    train_err = capsys.readouterr().err
    assert main(["validate", MLP, *args]) == 2
    assert capsys.readouterr().err == train_err and "data.batch_size (5000) is larger than the data set" in train_err


def test_a_config_that_is_not_utf8_names_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "latin1.yaml"
    config.write_bytes("model:\n  name: mlp  # caf\u00e9\n".encode("latin-1"))
    assert main(["train", str(config)]) == 2
    err = one_error_line(capsys.readouterr().err)
    assert f"invalid config in {config}: not UTF-8 text (byte 0xe9" in err


# ---------------------------------------------------------------------- 3: the environment
def test_a_model_dir_that_is_a_file_exits_3(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("not a directory")
    for model_dir in (tmp_path / "file", tmp_path / "file" / "run"):
        config = write_config(tmp_path / "c.yaml", tiny(model_dir, runconfig={"max_steps": 2}))
        assert main(["train", config, "--no_progress"]) == 3
        assert str(tmp_path / "file") in one_error_line(capsys.readouterr().err)
    assert (tmp_path / "file").read_text() == "not a directory"


def test_file_too_large_exits_3_and_keeps_what_was_written(tmp_path: Path) -> None:
    """``ulimit -f``: writing past the limit fails with EFBIG (Python ignores SIGXFSZ), as a full disk fails with
    ENOSPC: the checkpoint at step 6 cannot be written."""
    run, config = run_of(tmp_path)
    assert os.path.getsize(run / "checkpoint_4.mdl") > 16 * 1024  # larger than the limit below
    script = f"import resource; resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024, 16 * 1024)); {CLI}"
    proc = python(script, "train", config, "--resume", str(run), "--no_progress", "-o", "runconfig.max_steps=6")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, err
    assert err == f"dls: error: {run / 'checkpoint_6.mdl'}: File too large (free some space or choose another " \
        "runconfig.model_dir, then --resume)\n"  # fmt: skip
    assert [s for s, _ in rundir.list_checkpoints(run)] == [2, 4]
    assert ckpt.load_checkpoint(run / "checkpoint_4.mdl")["global_step"] == 4
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4, 5, 6]
    assert not [n for n in os.listdir(run) if n.endswith(".tmp") or n == ".dls.lock"]


# ---------------------------------------------------------------------- 4: internal errors
def test_an_internal_error_exits_4_with_the_traceback_in_model_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run, config = run_of(tmp_path)

    def broken(self: Trainer, *args: Any, **kwargs: Any) -> None:
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(Trainer, "_step", broken)
    assert main(["train", config, "--resume", str(run), "--no_progress", "-o", "runconfig.max_steps=6"]) == 4
    err = capsys.readouterr().err
    assert err.startswith("dls: internal error: ZeroDivisionError: a bug (the traceback is in ")
    assert err.count("\n") == 1
    (report,) = run.glob("dls-crash-*.txt")
    assert str(report) in err
    text = report.read_text()
    assert "Traceback" in text and "ZeroDivisionError: a bug" in text
    assert [s for s, _ in rundir.list_checkpoints(run)] == [2, 4]


def test_ctrl_c_exits_130(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    run, config = run_of(tmp_path)

    def interrupted(self: Trainer, *args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt  # as a second Ctrl-C does, in the middle of a step

    monkeypatch.setattr(Trainer, "_step", interrupted)
    capsys.readouterr()
    assert main(["train", config, "--resume", str(run), "--no_progress", "-o", "runconfig.max_steps=6"]) == 130
    assert capsys.readouterr().err == "dls: interrupted\n"
    assert [s for s, _ in rundir.list_checkpoints(run)] == [2, 4] and not (run / ".dls.lock").exists()


# ---------------------------------------------------------------------- 143: SIGTERM
def test_sigterm_checkpoints_the_last_step_then_exits_143(tmp_path: Path) -> None:
    run = tmp_path / "run"
    config = write_config(tmp_path / "c.yaml", tiny(run, runconfig={"max_steps": 100_000, "checkpoint_steps": 0}))
    proc = python(CLI, "train", config, "--no_progress")
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (run / "metrics.jsonl").exists():
            time.sleep(0.05)
        while time.monotonic() < deadline and (run / "metrics.jsonl").stat().st_size < 500:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert err == "dls: terminated (SIGTERM)\n"
    ((step, path),) = rundir.list_checkpoints(run)
    assert ckpt.load_checkpoint(path)["global_step"] == step == metrics(run)[-1]["step"]


# ---------------------------------------------------------------------- 2: missing extras
def test_every_command_without_the_train_extra_says_how_to_install_it() -> None:
    """torch alone: the imports of PyYAML, NumPy, rich and matplotlib fail (a meta-path finder refuses them)."""
    script = """
        import importlib.abc, json, sys

        class Missing(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {"yaml", "numpy", "rich", "matplotlib"}:
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
                return None

        sys.meta_path.insert(0, Missing())
        from dls.train.cli import main
        commands = [["train", "x.yaml"], ["validate", "x.yaml"], ["keys"], ["demo", "--steps", "1"]]
        commands.append(["audit", "x.yaml"])
        print(json.dumps([main(c) for c in commands]))
        """
    proc = python(script)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert out.strip() == "[2, 2, 2, 2, 2]"
    lines = [line for line in err.splitlines() if line.startswith("dls:")]  # torch warns without NumPy
    assert len(lines) == 5 and "Traceback" not in err
    for line in lines:
        assert "pip install 'dls[train]'" in line and "missing: PyYAML, numpy, rich, matplotlib" in line
