"""The training loop as a client of dls: reads of the device per step, one gradient-norm pass, an LR schedule that
follows applied steps, runconfig.num_threads, and checkpoints of the previous format (written by an earlier dls)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import OpLog, from_dls, host_reads
from dls.train import checkpoint as ckpt
from dls.train.cli import main
from dls.train.trainer import Trainer, learning_rate_at
from test_train import assert_bit_identical, load_into, make_trainer, metrics, tiny

FORMAT1 = Path(__file__).resolve().parent / "data" / "format1" / "checkpoint_6.mdl"


def steady(model_dir: Path, steps: int = 10, **changes: dict[str, Any]) -> dict[str, Any]:
    """The tiny config at a scale that never overflows by itself (growth never reached), logging every 5 steps."""
    raw = tiny(model_dir, runconfig={"max_steps": steps, "log_steps": 5, "checkpoint_steps": 0})
    raw["optimizer"].update(initial_loss_scale=2.0**4, steps_per_increase=10_000)
    for section, body in changes.items():
        raw[section].update(body)
    return raw


def inject_overflows(trainer: Trainer, steps: set[int]) -> None:
    """An inf in the first parameter's gradient during backward of each step in ``steps`` (before any check)."""
    param = next(trainer.model.parameters())

    def hook(p: torch.Tensor) -> None:
        if trainer.global_step + 1 in steps:
            assert p.grad is not None
            p.grad.view(-1)[0] = float("inf")

    param.register_post_accumulate_grad_hook(hook)


def reads_per_step(trainer: Trainer) -> tuple[list[int], list[int]]:
    """Train, counting the reads of a tensor's value back to the host made by dls's code (trainer included) in
    each iteration of the loop (its step, metrics, checks and checkpoints): ``(all reads, reads by dls)`` for
    steps 1 .. max_steps - 1 (the last iteration runs into the end of training)."""
    marks: list[tuple[int, int]] = []
    original: Callable[..., Any] = trainer._step

    def step(*args: Any, **kwargs: Any) -> Any:
        marks.append((len(calls), len(from_dls(calls))))
        return original(*args, **kwargs)

    trainer._step = step  # type: ignore[method-assign]
    with host_reads() as calls:
        trainer.train()
    every = [b[0] - a[0] for a, b in itertools.pairwise(marks)]
    ours = [b[1] - a[1] for a, b in itertools.pairwise(marks)]
    return every, ours


# ---------------------------------------------------------------------- reads of the device
def _fused(cfg: Any, model: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1.0, weight_decay=cfg.optimizer.weight_decay, fused=True)


@pytest.mark.parametrize(
    ("case", "changes", "fused"),
    [
        ("float16 + DLS, AdamW, max_gradient_norm", {}, False),
        ("float16 + DLS, AdamW, max_gradient_value", {"optimizer": {"max_gradient_norm": None}}, False),
        ("float16 + DLS, fused AdamW, max_gradient_norm", {}, True),
        ("float32 (no loss scaling), AdamW", {"precision": {"mixed_precision": False}}, False),
        ("float16 parameters + float32 masters, AdamW", {"precision": {"half_params": True}}, False),
        ("float16 + DLS, FP8 delayed scaling", {"precision": {"fp8": {"recipe": "delayed"}}}, False),
    ],
)
def test_steps_that_are_not_logged_read_the_device_at_most_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str, changes: dict[str, Any], fused: bool
) -> None:
    """The default path reads the overflow flag the scaler's step decides on; a fused optimizer skips inside its
    kernel, and the one read is the scaler's step reading that flag for its overflow watch (which the skip-aware
    LR schedule then reuses); a run without loss scaling reads the flag of its guard against inf/NaN gradients.
    Master weights and FP8's device-side scales and statistics add none. Every run watches its model for overflow
    provenance, which reads only on overflowing steps. Logged steps (1, 5, 10) read what they log."""
    raw = steady(tmp_path / "run", **changes)
    if "max_gradient_norm" in changes.get("optimizer", {}):
        raw["optimizer"].pop("max_gradient_norm")
        raw["optimizer"]["max_gradient_value"] = 100.0
    if fused:
        monkeypatch.setattr("dls.train.trainer.build_optimizer", _fused)
    trainer = make_trainer(raw)[0]
    assert bool(trainer.optimizer.defaults.get("fused")) is fused and trainer.watch.active
    every, ours = reads_per_step(trainer)
    logged = {1, 5}
    quiet = [n for step, n in enumerate(ours, start=1) if step not in logged]
    print(f"\nhost reads per step, {case}: steps not logged {quiet}; logged steps 1 and 5: {ours[0]}, {ours[4]}")
    print(f"  (with torch's own reads, e.g. Adam's step counter on the CPU: {every})")
    assert len(quiet) == 7 and max(quiet) <= 1
    assert quiet == [1] * 7  # exactly the one flag, every step


# ---------------------------------------------------------------------- one norm pass
def test_clipping_by_norm_computes_the_norm_once_per_step(tmp_path: Path) -> None:
    """The logged norm comes from the clipping pass: one ``_foreach_norm`` per step (one dtype group), logged or
    not; clipping by value computes it on logged steps only."""
    for name, optimizer, expected in (
        ("norm", {}, 10),
        ("value", {"max_gradient_norm": None, "max_gradient_value": 100.0}, 3),  # steps 1, 5, 10
    ):
        raw = steady(tmp_path / name)
        raw["optimizer"].update(optimizer)
        raw["optimizer"] = {k: v for k, v in raw["optimizer"].items() if v is not None}
        trainer = make_trainer(raw)[0]
        with OpLog() as log:
            trainer.train()
        assert log.names().count("_foreach_norm") == expected, name
        rows = metrics(tmp_path / name)
        assert all(r["grad_norm"] is not None and r["grad_norm"] > 0 for r in rows)


# ---------------------------------------------------------------------- the LR schedule follows applied steps
def test_the_lr_schedule_advances_on_applied_steps_only(tmp_path: Path) -> None:
    raw = steady(tmp_path / "run", runconfig={"log_steps": 1})
    skipped = {2, 3, 7}
    trainer = make_trainer(raw)[0]
    inject_overflows(trainer, skipped)
    trainer.train()
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows if r["skipped"]] == sorted(skipped)
    applied = 10 - len(skipped)
    assert trainer.scheduler.last_epoch == applied  # LambdaLR's position: the updates the weights received
    schedule = trainer.cfg.optimizer.learning_rate
    updates_before = [sum(1 for s in range(1, r["step"]) if s not in skipped) for r in rows]
    assert [r["lr"] for r in rows] == [learning_rate_at(schedule, n) for n in updates_before]
    saved = ckpt.load_checkpoint(tmp_path / "run" / "checkpoint_10.mdl")
    assert saved["format_version"] == ckpt.FORMAT_VERSION == 2
    assert saved["lr_scheduler"]["last_epoch"] == applied and saved["grad_scaler"]["num_skipped_steps"] == 3


def test_a_resumed_run_keeps_following_applied_steps(tmp_path: Path) -> None:
    straight = make_trainer(steady(tmp_path / "straight"))[0]
    inject_overflows(straight, {2, 7})
    straight.train()
    raw = steady(tmp_path / "split", steps=5)
    first = make_trainer(raw)[0]
    inject_overflows(first, {2, 7})
    first.train()
    raw["runconfig"]["max_steps"] = 10
    second = make_trainer(raw)[0]
    inject_overflows(second, {2, 7})
    second.train(resume=tmp_path / "split")
    assert second.scheduler.last_epoch == straight.scheduler.last_epoch == 8
    assert_bit_identical(straight.model.state_dict(), second.model.state_dict())


# ---------------------------------------------------------------------- runconfig.num_threads
def test_num_threads_holds_during_the_run_and_is_restored(tmp_path: Path) -> None:
    torch.set_num_threads(2)  # the one_thread fixture restores the count it found
    raw = steady(tmp_path / "run", steps=2, runconfig={"num_threads": 1})
    trainer = make_trainer(raw)[0]
    seen: list[int] = []
    trainer.optimizer.register_step_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
    trainer.train()
    assert seen == [1, 1] and torch.get_num_threads() == 2
    default = make_trainer(steady(tmp_path / "default", steps=1))[0]
    default.optimizer.register_step_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
    default.train()
    assert seen[-1] == 2  # null: torch's setting is left alone


# ---------------------------------------------------------------------- checkpoints of format 1
def test_a_format_1_checkpoint_loads_and_resumes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A checkpoint written by dls before format 2 (see tests/data/format1/config.yaml): its schedule counted the
    two skipped steps too (position 6 after 4 updates); it goes on from there, on applied steps only."""
    saved = ckpt.load_checkpoint(FORMAT1)
    assert saved["format_version"] == 1 and saved["global_step"] == 6
    assert saved["lr_scheduler"]["last_epoch"] == 6 and saved["grad_scaler"]["num_skipped_steps"] == 2
    config = ckpt.load_checkpoint(FORMAT1)["config"]
    raw = {**config, "runconfig": {**config["runconfig"], "model_dir": str(tmp_path / "loaded")}}
    trainer = make_trainer(raw)[0]
    load_into(trainer, FORMAT1)
    assert_bit_identical(saved["model"], trainer.model.state_dict())
    assert trainer.scaler.state_dict()["loss_scale"] == saved["grad_scaler"]["loss_scale"] == 2.0**17
    assert trainer.global_step == 6 and trainer.scheduler.last_epoch == 6

    fork = tmp_path / "fork"
    args = ["train", "--resume", str(FORMAT1), "--no_progress", "-o", f"runconfig.model_dir={fork}"]
    assert main([*args, "runconfig.max_steps=8"]) == 0
    assert "has checkpoint format 1, whose LR schedule advanced on skipped steps too" in capsys.readouterr().out
    rows = metrics(fork)
    assert [r["step"] for r in rows] == [7, 8]
    resumed = ckpt.load_checkpoint(fork / "checkpoint_8.mdl")
    assert resumed["format_version"] == 2 and resumed["global_step"] == 8
    applied = sum(1 for r in rows if not r["skipped"])
    assert resumed["lr_scheduler"]["last_epoch"] == 6 + applied


def test_a_checkpoint_of_a_later_format_is_refused_naming_both_versions(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint_1.mdl"
    torch.save({"format": "dls-checkpoint", "format_version": 99, "model": {}, "global_step": 1}, path)
    with pytest.raises(ckpt.CheckpointError, match="format version 99; this dls reads versions 1 to 2"):
        ckpt.load_checkpoint(path)


# ---------------------------------------------------------------------- Model Zoo loop keys
def test_gradient_accumulation_equals_one_larger_batch(tmp_path: Path) -> None:
    """grad_accum_steps micro-batches make one step with the gradient of their mean loss."""
    base = {"shuffle": False, "batch_size": 16}
    one = tiny(tmp_path / "a", precision={"mixed_precision": False}, runconfig={"max_steps": 1})
    one["data"].update(base, batch_size=32)
    one["model"]["dropout"] = 0.0
    two = tiny(tmp_path / "b", precision={"mixed_precision": False}, runconfig={"max_steps": 1, "grad_accum_steps": 2})
    two["data"].update(base)
    two["model"]["dropout"] = 0.0
    a, _ = make_trainer(one)
    b, _ = make_trainer(two)
    a.train()
    b.train()
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert b.batches.position == 2  # two micro-batches taken for the one step


@pytest.mark.parametrize(("frequency", "expected"), [(2, [2, 4, 6]), (0.5, [3, 6])])
def test_eval_frequency_int_is_every_n_steps_float_a_fraction(tmp_path: Path, frequency: Any, expected: list) -> None:
    raw = tiny(tmp_path / "run", runconfig={"max_steps": 6, "eval_frequency": frequency, "checkpoint_steps": 0})
    trainer, _ = make_trainer(raw)
    trainer.train()
    rows = [r for r in metrics(tmp_path / "run") if "eval_loss" in r]
    assert [r["step"] for r in rows] == expected and all(r["eval_loss"] > 0 for r in rows)


def test_num_epochs_sets_the_steps_when_max_steps_is_not_given(tmp_path: Path) -> None:
    raw = tiny(tmp_path / "run", runconfig={"num_epochs": 2, "grad_accum_steps": 2})
    raw["runconfig"].pop("max_steps")
    trainer, _ = make_trainer(raw)
    assert trainer.max_steps == 2 * (64 // 16) // 2


class _ZooModel(torch.nn.Module):
    def __init__(self, params: dict[str, Any]) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.lin(batch["x"]).float(), batch["y"].float())


def test_model_zoo_names_dispatch_to_dls_train_modelzoo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The interface: build_model(name, params) and build_loader(processor, params, split=, seed=, rank=,
    world_size=, prefix=) returning resumable batches."""
    import dls.train.modelzoo
    from dls.train.data import BatchIterator, DataInfo, Dataset

    calls: list[tuple[str, dict[str, Any], str]] = []

    class Pairs(Dataset):
        def __init__(self, seed: int) -> None:
            self.x = torch.randn(32, 4, generator=torch.Generator().manual_seed(seed))
            self.info = DataInfo()

        def __len__(self) -> int:
            return len(self.x)

        def batch(self, indices: torch.Tensor, epoch: int) -> dict[str, torch.Tensor]:
            return {"x": self.x[indices], "y": self.x[indices].sum(-1, keepdim=True)}

    def build_loader(
        processor: str, params: dict[str, Any], *, split: str, seed: int, prefix: str, **ranks: int
    ) -> Any:
        assert prefix == {"train": "train_input", "val": "eval_input"}[split]  # the section as written
        calls.append((processor, params, split))
        return BatchIterator(Pairs(seed), params["batch_size"], False, seed, **ranks)

    monkeypatch.setattr(dls.train.modelzoo, "build_model", lambda name, params: _ZooModel(params))
    monkeypatch.setattr(dls.train.modelzoo, "build_loader", build_loader)
    monkeypatch.setattr("dls.train.data.missing_paths", lambda cfg: [])  # no files: the loaders are fakes
    raw = {
        "train_input": {"data_processor": "GptHDF5DataProcessor", "data_dir": str(tmp_path), "batch_size": 4},
        "eval_input": {"data_dir": str(tmp_path), "batch_size": 2, "shuffle": False, "num_workers": 2},
        "model": {"name": "gpt2", "hidden_size": 8, "num_heads": 2, "vocab_size": 16, "mixed_precision": True,
                  "fp16_type": "float16"},
        "optimizer": {"optimizer_type": "SGD", "learning_rate": 0.05, "loss_scaling_factor": "dynamic"},
        "runconfig": {"max_steps": 12, "eval_frequency": 6, "eval_steps": 2, "model_dir": str(tmp_path / "run")},
    }  # fmt: skip
    trainer, out = make_trainer(raw)
    result = trainer.train()
    assert [c[0] for c in calls] == ["GptHDF5DataProcessor", "GptHDF5DataProcessor"]
    assert calls[0][1]["data_dir"] == str(tmp_path) and calls[0][1]["batch_size"] == 4
    assert [c[2] for c in calls] == ["train", "val"] and "num_workers" not in calls[1][1]
    rows = metrics(tmp_path / "run")
    losses = [r["loss"] for r in rows if "loss" in r]
    assert losses[-1] < losses[0] and result.eval_loss is not None
    assert [r["step"] for r in rows if "eval_loss" in r] == [6, 12]
    raw["runconfig"].update(eval_frequency=None, model_dir=str(tmp_path / "again"))
    make_trainer(raw)[0].train()
    assert [r["step"] for r in metrics(tmp_path / "again") if "eval_loss" in r] == [12]  # a val loader: at the end
    assert "ignored on this hardware (Cerebras only): eval_input.num_workers" in out.getvalue()
    calls.clear()
    del raw["eval_input"]
    raw["runconfig"].update(eval_frequency=4, model_dir=str(tmp_path / "no_eval_input"))
    make_trainer(raw)[0].train()
    assert [r["step"] for r in metrics(tmp_path / "no_eval_input") if "eval_loss" in r] == [4, 8, 12]
    assert [c[2] for c in calls] == ["train", "train"]  # evaluation's reader of the training data: built once


# ---------------------------------------------------------------------- where a run starts from (issue 20 item 6)
def test_checkpoint_path_with_load_checkpoint_states_model_starts_a_new_run(tmp_path: Path) -> None:
    first, _ = make_trainer(tiny(tmp_path / "a", runconfig={"max_steps": 4}))
    first.train()
    raw = tiny(tmp_path / "b", runconfig={"max_steps": 1})
    raw["runconfig"].update(checkpoint_path=str(tmp_path / "a" / "checkpoint_4.mdl"), load_checkpoint_states="model")
    raw["optimizer"]["learning_rate"] = 0.0
    second, _ = make_trainer(raw)
    second.train()
    assert second.global_step == 1  # global_step was not loaded: a new run from the trained model
    for p, q in zip(first.model.parameters(), second.model.parameters()):
        torch.testing.assert_close(p, q)


def test_autoload_last_checkpoint_continues_in_place_even_with_load_checkpoint_states(tmp_path: Path) -> None:
    raw = tiny(tmp_path / "run", runconfig={"max_steps": 4})
    first, _ = make_trainer(raw)
    first.train()
    raw["runconfig"].update(max_steps=6, autoload_last_checkpoint=True, load_checkpoint_states="model")
    again, _ = make_trainer(raw)
    result = again.train()  # the same command again: the run's own checkpoint loads whole
    assert (result.global_step, result.steps_run) == (6, 2)
    assert [r["step"] for r in metrics(tmp_path / "run") if "loss" in r][-1] == 6


CURRENT_LAYOUT = """
trainer:
  init:
    model_dir: {model_dir}
    seed: 3
    backend: {{backend_type: CPU}}
    model: {{name: mlp, hidden_size: 16, depth: 2}}
    optimizer:
      AdamW: {{betas: [0.9, 0.95], weight_decay: 0.01, correct_bias: true}}
    schedulers:
    - SequentialLR:
        schedulers:
        - LinearLR: {{initial_learning_rate: 0.0, end_learning_rate: 0.01, total_iters: 4}}
        - ConstantLR: {{learning_rate: 0.01}}
    precision: {{enabled: true, fp16_type: float16, loss_scaling_factor: dynamic, max_gradient_norm: 1.0}}
    loop: {{max_steps: 8, eval_frequency: 4, grad_accum_steps: 2}}
    checkpoint: {{steps: 4}}
    logging: {{log_steps: 2}}
    callbacks: [{{ComputeNorm: {{}}}}]
  fit:
    train_dataloader: &loader {{dataset: teacher_regression, batch_size: 8, num_samples: 64, num_workers: 2}}
    val_dataloader: *loader
"""


def test_a_current_layout_config_trains_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "params.yaml"
    config.write_text(CURRENT_LAYOUT.format(model_dir=tmp_path / "run"))
    assert main(["train", str(config), "--no_progress"]) == 0
    rows = metrics(tmp_path / "run")
    assert all(r["params_norm"] > 0 for r in rows if "loss" in r)  # ComputeNorm: Model Zoo's log_summaries
    assert [r["step"] for r in rows if "eval_loss" in r] == [4, 8]
    assert [r["lr"] for r in rows if r.get("step") in (1, 8) and "lr" in r] == pytest.approx([0.0, 0.01])
    assert all(r["loss_scale"] > 0 for r in rows if "loss" in r)
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint_*.mdl")) == [
        "checkpoint_4.mdl",
        "checkpoint_8.mdl",
    ]
    # The same command again: autoload_last_checkpoint (Model Zoo's default in this layout) continues the run.
    config.write_text(CURRENT_LAYOUT.format(model_dir=tmp_path / "run").replace("max_steps: 8", "max_steps: 10"))
    assert main(["train", str(config), "--no_progress"]) == 0
    assert [r["step"] for r in metrics(tmp_path / "run") if "loss" in r][-1] == 10


def test_num_steps_is_the_steps_of_this_run(tmp_path: Path) -> None:
    raw = tiny(tmp_path / "run", runconfig={"max_steps": 5, "num_steps": 3})
    first, _ = make_trainer(raw)
    assert first.train().global_step == 3
    again, _ = make_trainer(raw)
    result = again.train(resume=tmp_path / "run")
    assert (result.global_step, result.steps_run) == (5, 2)  # three more, but never beyond max_steps


# ---------------------------------------------------------------------- dls-only precision keys (issues 19, 21)
def test_consecutive_hysteresis_reaches_the_scaler(tmp_path: Path) -> None:
    raw = tiny(tmp_path / "run")
    raw["optimizer"].update(hysteresis=2, consecutive_hysteresis=True)
    trainer, _ = make_trainer(raw)
    assert not [n for n in trainer.cfg.notes if "not supported" in n]
    assert trainer.scaler.settings.consecutive_hysteresis and trainer.scaler.settings.hysteresis == 2


def test_keep_in_float32_and_fallback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    raw = tiny(tmp_path / "run", runconfig={"max_steps": 3})
    raw["precision"]["keep_in_float32"] = ["net.0"]
    trainer, _ = make_trainer(raw)
    assert (
        list(trainer.watch.kept_in_float32) == ["net.0"] and trainer.watch.fallback is not None
    )  # float16: default on
    trainer.train()
    assert trainer.global_step == 3 and "kept_in_float32" in trainer.scaler.state_dict()
    for fp16, on in (("bfloat16", False), ("cbfloat16", True)):
        raw = tiny(tmp_path / fp16, precision={"mixed_precision": True, "fp16_type": fp16})
        assert (make_trainer(raw)[0].watch.fallback is not None) is on
    raw = tiny(tmp_path / "off", precision={"mixed_precision": True, "fp16_type": "float16", "fallback": False})
    assert make_trainer(raw)[0].watch.fallback is None
    raw = tiny(tmp_path / "bad")
    raw["precision"]["keep_in_float32"] = ["net.9"]
    config = tmp_path / "bad.yaml"
    config.write_text(__import__("yaml").safe_dump(raw))
    assert main(["train", str(config), "--no_progress"]) == 2
    err = capsys.readouterr().err
    assert "precision.keep_in_float32" in err and "net.9" in err


def test_the_floor_stop_says_what_the_fallback_tried(tmp_path: Path) -> None:
    from dls.train.errors import TrainingStopped

    raw = tiny(
        tmp_path / "run",
        data={"noise_std": 1e30},  # the float32 loss is inf: every step overflows at any scale, in no module
        optimizer={"initial_loss_scale": 1.0, "min_loss_scale": 0.25},
        runconfig={"max_steps": 50, "max_overflows_at_min_loss_scale": 3},
    )
    raw["precision"]["keep_in_float32"] = ["net.2"]
    with pytest.raises(TrainingStopped) as info, pytest.warns(UserWarning, match="found no module to keep"):
        make_trainer(raw)[0].train()
    assert "the float32 fallback kept 'net.2' in float32 (disarmed after finding nothing)" in str(info.value)
