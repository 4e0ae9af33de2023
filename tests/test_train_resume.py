"""Resuming: a resumed run writes only into its own directory, forks need a new or empty one, partial-state loads
continue in place only in Model Zoo's case, unreadable newest checkpoints are skipped, and the config (not the
checkpoint) defines the loss scaling while the checkpoint contributes its scale and counters."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from dls.train import checkpoint as ckpt
from dls.train import rundir
from dls.train.cli import main
from dls.train.rundir import RunDir
from test_train import make_trainer, metrics, tiny

ALL_BUT_SCALER = "model,optimizer,dataloader,lr_scheduler,global_step,rng"


def write_config(path: Path, raw: dict[str, Any]) -> str:
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def config(model_dir: Path, steps: int = 4, seed: int = 3, **optimizer: Any) -> dict[str, Any]:
    """The tiny config of ``test_train`` (checkpoints every 2 steps) with ``optimizer`` keys changed (``None``:
    left out)."""
    raw = tiny(model_dir, runconfig={"max_steps": steps, "checkpoint_steps": 2, "seed": seed})
    raw["optimizer"].update(optimizer)
    raw["optimizer"] = {k: v for k, v in raw["optimizer"].items() if v is not None}
    return raw


def trained(tmp_path: Path, name: str, steps: int = 4, seed: int = 3, **optimizer: Any) -> Path:
    """A finished run of ``steps`` steps in ``tmp_path / name``."""
    make_trainer(config(tmp_path / name, steps, seed, **optimizer))[0].train()
    return tmp_path / name


# A static scale: the dynamic-only keys of the tiny config left out.
STATIC = {"initial_loss_scale": None, "max_loss_scale": None, "steps_per_increase": None}


# ---------------------------------------------------------------------- where a resumed run writes
def test_resuming_a_copy_writes_into_the_copy_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    original = trained(tmp_path, "original")
    before = snapshot(original)
    copy = tmp_path / "copy"
    shutil.copytree(original, copy)  # its checkpoints still name the original's model_dir
    assert main(["train", "--resume", str(copy), "--no_progress", "-o", "runconfig.max_steps=6"]) == 0
    assert snapshot(original) == before
    assert [s for s, _ in rundir.list_checkpoints(copy)] == [2, 4, 6]
    assert [r["step"] for r in metrics(copy)] == [1, 2, 3, 4, 5, 6]


def test_another_model_dir_is_a_fork_into_a_new_or_empty_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = trained(tmp_path, "source")
    before = snapshot(source)
    fork = tmp_path / "fork"
    args = ["train", "--resume", str(source), "--no_progress", "-o", "runconfig.max_steps=6"]
    assert main([*args, f"runconfig.model_dir={fork}"]) == 0
    assert snapshot(source) == before
    assert [r["step"] for r in metrics(fork)] == [5, 6]  # the step count continues
    assert [s for s, _ in rundir.list_checkpoints(fork)] == [6]

    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert main([*args, f"runconfig.model_dir={used}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dls: error:") and "new or empty directory" in err and str(used) in err
    assert snapshot(used) == {"notes.txt": b"mine"}
    assert snapshot(source) == before


def test_partial_load_into_another_run_is_refused_and_changes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = trained(tmp_path, "a")
    b = trained(tmp_path, "b", seed=7)
    before_a, before_b = snapshot(a), snapshot(b)
    path = write_config(tmp_path / "a.yaml", config(a))
    code = main(["train", path, "--resume", str(b), "--load_checkpoint_states", "model,optimizer", "--no_progress"])
    assert code == 2
    assert "new or empty directory" in capsys.readouterr().err
    assert snapshot(a) == before_a and snapshot(b) == before_b


def test_restarting_at_step_0_in_place_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = trained(tmp_path, "run")
    before = snapshot(run)
    assert main(["train", "--resume", str(run), "--load_checkpoint_states", "model,optimizer"]) == 2
    err = capsys.readouterr().err
    assert "without global_step restarts at step 0" in err and "runconfig.model_dir=NEW_DIR" in err
    assert snapshot(run) == before


def test_rewinding_in_place_is_refused_and_a_fork_from_an_older_checkpoint_works(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = trained(tmp_path, "run")
    before = snapshot(run)
    older = str(run / "checkpoint_2.mdl")
    assert main(["train", "--resume", older, "--no_progress"]) == 2
    assert "is not the latest checkpoint" in capsys.readouterr().err
    assert snapshot(run) == before
    branch = tmp_path / "branch"
    assert main(["train", "--resume", older, "--no_progress", "-o", f"runconfig.model_dir={branch}"]) == 0
    assert [r["step"] for r in metrics(branch)] == [3, 4]
    assert snapshot(run) == before


def test_switching_loss_scaling_on_in_place_continues_the_run(tmp_path: Path) -> None:
    """Model Zoo's case: every state but grad_scaler, in the run's own directory, with loss scaling changed."""
    run = trained(tmp_path, "run", loss_scaling_factor=1.0, **STATIC)
    code = main(
        ["train", "--resume", str(run), "--no_progress", "--load_checkpoint_states", ALL_BUT_SCALER,
         "-o", "runconfig.max_steps=6", "optimizer.loss_scaling_factor=dynamic", "optimizer.initial_loss_scale=256"]
    )  # fmt: skip
    assert code == 0
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["loss_scale"] for r in rows] == [1.0] * 4 + [256.0] * 2


# ---------------------------------------------------------------------- unreadable checkpoints
def test_an_unreadable_newest_checkpoint_of_a_directory_is_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = trained(tmp_path, "run", steps=6)
    newest = run / "checkpoint_6.mdl"
    truncated = newest.read_bytes()[:1000]
    newest.write_bytes(truncated)
    assert main(["train", "--resume", str(newest), "--no_progress"]) == 2  # a named file: no fallback
    assert "cannot read checkpoint" in capsys.readouterr().err
    (run / "checkpoint_6.mdl.unreadable").write_bytes(b"set aside before")
    assert main(["train", "--resume", str(run), "--no_progress", "-o", "runconfig.max_steps=8"]) == 0
    out = capsys.readouterr().out
    assert f"Skipping {newest}" in out and "checkpoint_4.mdl (step 4)" in out
    assert (run / "checkpoint_6.mdl.unreadable-2").read_bytes() == truncated  # kept, out of the way
    assert (run / "checkpoint_6.mdl.unreadable").read_bytes() == b"set aside before"
    assert [s for s, _ in rundir.list_checkpoints(run)] == [2, 4, 6, 8]
    assert ckpt.load_checkpoint(run / "checkpoint_6.mdl")["global_step"] == 6  # the new history's step 6
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4, 5, 6, 7, 8]


# ---------------------------------------------------------------------- loss-scaling state
def resumed(run: Path, **optimizer: Any) -> tuple[Any, str]:
    """A trainer of ``run``'s config with ``optimizer`` changes, the checkpoint loaded as ``train`` loads it."""
    trainer, log = make_trainer(config(run, **optimizer))
    from dls.train.config import CHECKPOINT_STATES

    path, state, _ = ckpt.load_resume_checkpoint(run)
    ckpt.restore(trainer, path, state, CHECKPOINT_STATES)
    return trainer, log.getvalue()


def save(state: dict[str, Any], path: Path) -> None:
    """Write ``state`` (as read) back to the checkpoint ``path``."""
    with RunDir(path.parent) as run_dir:
        ckpt.save_checkpoint(
            run_dir,
            {k: v for k, v in state.items() if k not in ("format", "format_version")},
            rundir.checkpoint_step(path.name),
        )


def edit_checkpoint(path: Path, **grad_scaler: Any) -> None:
    state = ckpt.load_checkpoint(path)
    state["grad_scaler"].update(grad_scaler)
    save(state, path)


def test_a_changed_static_scale_takes_effect(tmp_path: Path) -> None:
    run = trained(tmp_path, "run", loss_scaling_factor=2.0**15, **STATIC)
    edit_checkpoint(run / "checkpoint_4.mdl", num_skipped_steps=3)
    trainer, log = resumed(run, loss_scaling_factor=1024.0, **STATIC)
    assert trainer.scaler.get_scale() == 1024.0 and trainer.scaler.get_num_skipped_steps() == 3
    assert "static loss scale: 2^15 in the checkpoint, 2^10 now: 2^10 is used" in log
    path = write_config(tmp_path / "static.yaml", config(run, 6, loss_scaling_factor=1024.0, **STATIC))
    assert main(["train", path, "--resume", str(run), "--no_progress"]) == 0
    assert [r["loss_scale"] for r in metrics(run) if r["step"] > 4] == [1024.0, 1024.0]


def test_static_to_dynamic_starts_from_the_initial_scale_and_keeps_the_skipped_count(tmp_path: Path) -> None:
    run = trained(tmp_path, "run", loss_scaling_factor=8.0, **STATIC)
    edit_checkpoint(run / "checkpoint_4.mdl", num_skipped_steps=2)
    trainer, log = resumed(run, loss_scaling_factor="dynamic", initial_loss_scale=2.0**12)
    assert trainer.scaler.get_scale() == 2.0**12 and trainer.scaler.get_num_skipped_steps() == 2
    assert "static 2^3 in the checkpoint, dynamic now: the scale starts from the config's initial scale 2^12" in log


def test_dynamic_to_static_uses_the_static_scale(tmp_path: Path) -> None:
    run = trained(tmp_path, "run")
    saved = ckpt.load_checkpoint(run / "checkpoint_4.mdl")["grad_scaler"]
    trainer, log = resumed(run, loss_scaling_factor=64.0, **STATIC)
    assert trainer.scaler.get_scale() == 64.0
    assert trainer.scaler.get_num_skipped_steps() == saved["num_skipped_steps"]
    assert "dynamic in the checkpoint" in log and "static 2^6 now: the config's static scale is used" in log


def test_dynamic_resume_loads_the_scale_and_counters_but_not_the_settings(tmp_path: Path) -> None:
    run = trained(tmp_path, "run")
    # torch.amp's settings keys in the saved state must not replace the config's settings.
    edit_checkpoint(
        run / "checkpoint_4.mdl", loss_scale=2.0**9, steps_since_rescale=1, growth_factor=4.0, backoff_factor=0.125,
        growth_interval=99,
    )  # fmt: skip
    trainer, log = resumed(run, steps_per_increase=5)
    state = trainer.scaler.state_dict()
    assert state["loss_scale"] == 2.0**9 and state["steps_since_rescale"] == 1
    # growth_interval is torch's name for the Cerebras rule's steps_per_increase + 1 (the same trajectory).
    assert (state["growth_factor"], state["backoff_factor"], state["growth_interval"]) == (2.0, 0.5, 6)
    assert "optimizer.steps_per_increase: 3 in the checkpoint's config, 5 now: 5 is used" in log


def test_torch_names_are_read_when_the_dls_names_are_absent(tmp_path: Path) -> None:
    run = trained(tmp_path, "run")
    path = run / "checkpoint_4.mdl"
    state = ckpt.load_checkpoint(path)
    state["grad_scaler"] = {"scale": 2.0**11, "_growth_tracker": 2, "growth_factor": 3.0, "growth_interval": 7}
    save(state, path)
    trainer, _ = resumed(run)
    state = trainer.scaler.state_dict()
    assert (state["loss_scale"], state["steps_since_rescale"], state["growth_factor"]) == (2.0**11, 2, 2.0)


def test_a_checkpoint_scale_outside_the_configs_bounds_is_clamped_and_said(tmp_path: Path) -> None:
    run = trained(tmp_path, "run")
    edit_checkpoint(run / "checkpoint_4.mdl", loss_scale=2.0**22)
    trainer, log = resumed(run, max_loss_scale=2.0**20, initial_loss_scale=2.0**20)
    assert trainer.scaler.get_scale() == 2.0**20
    assert "loss scale 2^22 is outside [2^-14, 2^20]: it continues at optimizer.max_loss_scale (2^20)" in log
