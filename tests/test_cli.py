"""The ``dls`` command: smoke runs of a few steps, exit codes, error messages without tracebacks."""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path

import pytest

from dls.train.cli import main

ROOT = Path(__file__).resolve().parent.parent
MLP = str(ROOT / "configs" / "mlp_fp16_dls.yaml")


def short(model_dir: Path, steps: int = 4) -> list[str]:
    return [
        "--override",
        f"runconfig.max_steps={steps}",
        "runconfig.checkpoint_steps=2",
        f"runconfig.model_dir={model_dir}",
    ]


# ---------------------------------------------------------------------- help
def test_help_for_newcomers(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for text in ("dls demo", "dls init mlp_fp16_dls", "configs/mlp_fp16_dls.yaml", "dls keys", "loss_scaling_factor"):
        assert text in out


def test_the_dls_command_is_the_entry_module() -> None:
    """The console script is ``dls_entry.main`` (it installs the signal handler before the heavy imports)."""
    import dls_entry

    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "dls"]
    assert script.load() is dls_entry.main


def test_train_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["train", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for text in ("--override", "--resume", "--load_checkpoint_states", "examples:", "metrics.jsonl"):
        assert text in out


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    assert "dls demo" in capsys.readouterr().out


def test_keys(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["keys"]) == 0
    out = capsys.readouterr().out
    assert "loss_scaling_factor" in out and "max_overflows_at_min_loss_scale" in out
    words = " ".join(out.split())  # the help is wrapped under its column
    assert "num_threads null torch CPU threads" in words and "faster with 1 thread than 2" in words


# ---------------------------------------------------------------------- train
def test_train_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", MLP, *short(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "final loss scale" in out and "skipped steps" in out
    for name in ("checkpoint_2.mdl", "checkpoint_4.mdl", "metrics.jsonl", "plots.png", "config.yaml"):
        assert (tmp_path / "run" / name).exists(), name


@pytest.mark.parametrize(
    "config",
    ["transformer_lm_fp16_dls.yaml", "mlp_cbfloat16_dls.yaml", "mlp_fp16_params_dls.yaml", "mlp_fp8_delayed_dls.yaml"],
)
def test_other_shipped_configs_run(tmp_path: Path, config: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(ROOT / "configs" / config)
    assert main(["train", path, *short(tmp_path / "run", steps=2), "runconfig.log_steps=1"]) == 0
    assert (tmp_path / "run" / "checkpoint_2.mdl").exists()


def test_resume_from_the_saved_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", MLP, *short(tmp_path / "run")]) == 0
    assert main(["train", "--resume", str(tmp_path / "run"), "--override", "runconfig.max_steps=6"]) == 0
    out = capsys.readouterr().out
    assert "checkpoint_4.mdl (step 4)" in out
    assert (tmp_path / "run" / "checkpoint_6.mdl").exists()
    assert main(["train", MLP, *short(tmp_path / "run", 7), "--resume", str(tmp_path / "run"),
                 "--load_checkpoint_states", "model,optimizer,global_step"]) == 0  # fmt: skip
    assert "Not loaded (fresh from the config): dataloader, grad_scaler, lr_scheduler, rng" in capsys.readouterr().out


def test_bad_config_exits_2_without_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  name: mlp\noptimizer:\n  loss_scaling_factor: dynamc\n  growth_interval: 10\n")
    assert main(["train", str(bad)]) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in err and out == ""
    assert "dls: error: invalid config in" in err
    assert "optimizer.loss_scaling_factor must be 'dynamic'" in err
    assert "optimizer.growth_interval" in err and "steps_per_increase" in err


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["train", "missing.yaml"], "no config file missing.yaml"),
        (["train", MLP, "--override", "runconfig.max_steps"], "must look like section.key=value"),
        (["train", MLP, "--override", "runconfig.max_steps=0"], "runconfig.max_steps must be an integer >= 1"),
        (["train", MLP, "--load_checkpoint_states", "model"], "needs a checkpoint to load from: --resume"),
        (["train", MLP, "--resume", "nowhere", "--load_checkpoint_states", "model,weights"], "unknown checkpoint"),
        (["train", MLP, "--resume", "nowhere"], "nowhere does not exist"),
        (["train", "--resume", "nowhere"], "nowhere does not exist"),
        (["validate", "missing.yaml"], "no config file missing.yaml"),
        (["train"], "give a YAML config"),
    ],
)
def test_usage_errors_exit_2(args: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("dls: error:") and needle in err


def test_existing_model_dir_needs_resume(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", MLP, *short(tmp_path / "run", 2)]) == 0
    assert main(["train", MLP, *short(tmp_path / "run", 2)]) == 2
    assert "already holds checkpoints" in capsys.readouterr().err


# The float16 fallback (on by default) says what it kept or that it gave up: expected here, not the subject.
@pytest.mark.filterwarnings("ignore:dls fallback:UserWarning")
def test_training_stopped_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = [*short(tmp_path / "run", 200), "data.noise_std=1e30", "optimizer.min_loss_scale=1.0"]
    args += ["optimizer.initial_loss_scale=4", "runconfig.max_overflows_at_min_loss_scale=2"]
    assert main(["train", MLP, *args]) == 1
    err = capsys.readouterr().err
    assert "dls: training stopped: Stopped at step 4" in err and "min_loss_scale" in err
    assert (tmp_path / "run" / "checkpoint_4.mdl").exists()


def test_validate(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", MLP, "--override", "optimizer.loss_scaling_factor=1024"]) == 0
    out = capsys.readouterr().out
    assert "loss_scaling_factor: 1024.0" in out and "OK" in out
    assert "note: optimizer.initial_loss_scale is ignored" in out
    assert "# loss scaling: dls.GradScaler.from_settings(ScalerSettings(mode='static', init_scale=1024.0" in out


def test_validate_accepts_exactly_what_the_scaler_accepts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", MLP, "-o", "optimizer.max_loss_scale=1e39"]) == 2
    assert "optimizer.max_loss_scale must be a number from 2**-126 to float32's max" in capsys.readouterr().err
    static = ["optimizer.loss_scaling_factor=3.402e38"]  # the dynamic-only keys of the file are ignored (warned)
    assert main(["validate", MLP, "-o", *static]) == 0
    assert "init_scale=3.402e+38" in capsys.readouterr().out


# ---------------------------------------------------------------------- demo
def test_demo_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--out", str(tmp_path), "--steps", "3", "--no_progress"]) == 0
    out = capsys.readouterr().out
    labels = [
        "float32", "fp16, no scaling", "fp16, static 2^8", "fp16 + DLS", "cbfloat16 + DLS", "fp16 params, no masters",
        "fp16 params + masters", "fp8, scale 1", "fp8 delayed", "fp8 current",
    ]  # fmt: skip
    assert "underflow" in out and "Total wall time" in out
    table = out[out.index("dls demo (3 steps each)") :].splitlines()
    assert [line.split("  ")[0].strip() for line in table[4:14]] == labels  # every run's row, labels not truncated
    assert (tmp_path / "demo.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["demo", "--steps", "0"]) == 2
