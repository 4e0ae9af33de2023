"""The trainer's diagnostics: skipped steps name the module where the overflow started, the stops say which modules
and whether the forward pass overflowed, and runconfig.tensorboard writes the metrics as TensorBoard events inside
model_dir (or refuses to start without the extra)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from dls.train import TrainingStopped
from dls.train.cli import main
from dls.train.errors import ModelDirError
from dls.train.rundir import TENSORBOARD_DIR
from dls.train.trainer import Trainer
from test_train import make_trainer, metrics, tiny


def overflow_into(trainer: Trainer, module: str, steps: set[int] | None = None) -> None:
    """An inf in the gradient arriving at ``module``'s output (a backward pre-hook) on ``steps`` (default: every
    step): ``module``'s parameters and everything before it in the forward pass get inf/NaN gradients."""

    def hook(m: torch.nn.Module, grad_output: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        if steps is not None and trainer.global_step + 1 not in steps:
            return grad_output
        g = grad_output[0].clone()
        g.view(-1)[0] = float("inf")
        return (g,)

    trainer.model.get_submodule(module).register_full_backward_pre_hook(hook)


def overflow_forward(trainer: Trainer, module: str) -> None:
    """``module``'s float16 output times 1e7: beyond float16's range (65504) wherever it exceeds 0.0066."""
    trainer.model.get_submodule(module).register_forward_hook(lambda m, args, out: out * 1e7)


# ---------------------------------------------------------------------- skipped rows
@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # net.0's input needs no gradient: fine here
@pytest.mark.parametrize("module", ["net.0", "net.2", "net.4"])
def test_a_skipped_row_names_the_first_module_of_the_overflow(tmp_path: Path, module: str) -> None:
    raw = tiny(tmp_path / "run", model={"dropout": 0.0}, runconfig={"max_steps": 4, "log_steps": 2})
    raw["optimizer"]["initial_loss_scale"] = 2.0**8  # no overflow of its own
    trainer = make_trainer(raw)[0]
    overflow_into(trainer, module, steps={3})
    trainer.train()
    rows = metrics(tmp_path / "run")
    (skipped,) = [r for r in rows if r["skipped"]]
    assert skipped["step"] == 3
    assert skipped["overflow_module"] == module and skipped["forward_overflow"] is False
    assert all("overflow_module" not in r for r in rows if not r["skipped"])


def test_a_forward_overflow_is_said_in_the_row_and_in_the_stop(tmp_path: Path) -> None:
    raw = tiny(
        tmp_path / "run",
        model={"dropout": 0.0},
        optimizer={"initial_loss_scale": 1.0, "min_loss_scale": 0.5},
        runconfig={"max_steps": 20, "max_overflows_at_min_loss_scale": 2},
    )
    raw["precision"]["fallback"] = False  # the diagnosis alone (the fallback would keep net.4 in float32)
    trainer = make_trainer(raw)[0]
    overflow_forward(trainer, "net.4")  # the output layer: float16 inf reaches the loss
    with pytest.raises(TrainingStopped) as info:
        trainer.train()
    rows = metrics(tmp_path / "run")
    assert all(r["skipped"] and r["forward_overflow"] is True for r in rows)
    assert {r["overflow_module"] for r in rows} == {"net.4"}
    message = str(info.value)
    assert "First module with inf/NaN gradients, in backward order: net.4 (Linear) in 2 of the 2 steps" in message
    assert "The loss was already inf/NaN before scaling in 2 of the 2 steps" in message
    assert "loss scaling cannot fix that" in message and "use bfloat16 or cbfloat16" in message
    assert "dls audit" in message and "parameters already hold inf/NaN" not in message
    result = info.value.result
    assert result is not None and result.global_step == trainer.global_step == 3 and result.skipped_steps == 3


def test_a_backward_overflow_at_the_floor_names_its_modules(tmp_path: Path) -> None:
    raw = tiny(
        tmp_path / "run",
        model={"dropout": 0.0},
        optimizer={"initial_loss_scale": 1.0, "min_loss_scale": 1.0},
        runconfig={"max_steps": 20, "max_overflows_at_min_loss_scale": 3},
    )
    trainer = make_trainer(raw)[0]
    overflow_into(trainer, "net.2")
    with pytest.raises(TrainingStopped) as info:
        trainer.train()
    message = str(info.value)
    assert "net.2 (Linear) in 3 of the 3 steps; modules with inf/NaN gradients: net.2, net.0." in message
    assert "The loss was finite every time: the overflow arose in backward." in message
    assert "lower optimizer.learning_rate" in message and "min_loss_scale" in message


def test_a_run_without_loss_scaling_names_the_module_when_it_stops(tmp_path: Path) -> None:
    raw = tiny(tmp_path / "run", model={"dropout": 0.0}, precision={"mixed_precision": False})
    raw["optimizer"] = {"learning_rate": 1e-3}
    trainer = make_trainer(raw)[0]
    overflow_into(trainer, "net.4", steps={2})
    with pytest.raises(TrainingStopped, match="at step 2: the gradients are inf/NaN") as info:
        trainer.train()
    assert "First module with inf/NaN gradients, in backward order: net.4 (Linear) in 1 of 1 step" in str(info.value)
    assert "modules with inf/NaN gradients: net.4, net.2, net.0" in str(info.value)


def test_the_watch_is_installed_and_costs_clean_steps_nothing(tmp_path: Path) -> None:
    """Clean steps build no report; the hooks are the watch's Python-only ones."""
    raw = tiny(tmp_path / "run", runconfig={"max_steps": 3})
    raw["optimizer"]["initial_loss_scale"] = 2.0**8
    trainer = make_trainer(raw)[0]
    built: list[Any] = []
    original = trainer.watch.build_report
    trainer.watch.build_report = lambda *a, **k: built.append(1) or original(*a, **k)  # type: ignore[method-assign]
    trainer.train()
    assert trainer.watch.active and built == []
    assert not any(r["skipped"] for r in metrics(tmp_path / "run"))


# ---------------------------------------------------------------------- TensorBoard
def scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the event files of ``directory`` as TensorBoard reads them (purged events left out)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_tensorboard_events_hold_the_logged_rows(tmp_path: Path) -> None:
    run = tmp_path / "run"
    raw = tiny(run, precision={"log_underflow": True}, runconfig={"max_steps": 4, "log_steps": 2, "tensorboard": True})
    make_trainer(raw)[0].train()
    rows = metrics(run)
    (event_file,) = (run / TENSORBOARD_DIR).iterdir()
    assert event_file.name.startswith("events.out.tfevents.") and not event_file.is_symlink()
    seen = scalars(run / TENSORBOARD_DIR)
    for key in ("loss", "loss_scale", "skipped", "grad_norm", "grad_underflow", "lr"):
        expected = [(r["step"], float(r[key])) for r in rows if r.get(key) is not None]
        assert [s for s, _ in seen[key]] == [s for s, _ in expected], key
        assert [v for _, v in seen[key]] == pytest.approx([v for _, v in expected], rel=1e-6), key

    # Resumed after a crash that lost the last checkpoint: the crashed session's step 4 is hidden, the new one shown.
    (run / "checkpoint_4.mdl").unlink()
    raw["runconfig"]["max_steps"] = 5
    make_trainer(raw)[0].train(resume=run)
    assert len(list((run / TENSORBOARD_DIR).iterdir())) == 2
    steps = [s for s, _ in scalars(run / TENSORBOARD_DIR)["loss"]]
    assert steps == [r["step"] for r in metrics(run)] == [1, 2, 4, 5]


def test_tensorboard_refuses_a_link_in_model_dir(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run = tmp_path / "run"
    make_trainer(tiny(run, runconfig={"max_steps": 2}))[0].train()
    os.symlink(elsewhere, run / TENSORBOARD_DIR)  # in a run resumed in place (a fresh run refuses any earlier file)
    raw = tiny(run, runconfig={"max_steps": 4, "tensorboard": True})
    with pytest.raises(ModelDirError, match="is not a directory \\(or is a symbolic link"):
        make_trainer(raw)[0].train(resume=run)
    assert list(elsewhere.iterdir()) == []


def test_tensorboard_without_the_extra_exits_2_before_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("tensorboard", "tensorboard.summary.writer.record_writer", "torch.utils.tensorboard.summary"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails
    run = tmp_path / "run"
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(tiny(run, runconfig={"max_steps": 2, "tensorboard": True})))
    assert main(["train", str(config), "--no_progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dls: error: runconfig.tensorboard needs the 'tensorboard' extra")
    assert "pip install 'dls[tensorboard]'" in err and not run.exists()
