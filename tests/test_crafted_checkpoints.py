"""Issue 30: every field of a checkpoint checked before anything is written. Tensors are judged as they will be
held (after conversion to the dtype they are loaded into: finite, representable; complex by both parts; float8
through a float32 view); the optimizer's hyperparameters against the config's optimizer; the LR schedule's state
only for the keys the scheduler has; the trainer's counters and the generators' states by field. Each crafted file
is exit 2 naming the field and the file, with the run directory unchanged and no crash report."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from dls.train import checkpoint as ckpt
from dls.train import rundir
from dls.train.cli import main
from dls.train.trainer import Trainer
from test_train import tiny

Craft = Callable[[dict[str, Any]], None]


def write_config(path: Path, raw: dict[str, Any]) -> str:
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def one_error_line(err: str) -> str:
    assert err.startswith("dls: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


RUNS = {  # finished tiny runs (checkpoints at steps 2 and 4), one per optimizer and precision
    "adamw": {},
    "sgd": {"optimizer": {"optimizer_type": "SGD", "momentum": 0.9}},
    "half": {"precision": {"mixed_precision": True, "fp16_type": "float16", "half_params": True}},
}


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each of RUNS trained, copied by each test that changes it."""
    base, runs = tmp_path_factory.mktemp("crafted"), {}
    for name, changes in RUNS.items():
        raw = tiny(base / name, runconfig={"max_steps": 4, "checkpoint_steps": 2})
        for section, body in changes.items():
            raw[section].update(body)
        config = write_config(base / f"{name}.yaml", raw)
        assert main(["train", config, "--no_progress"]) == 0
        runs[name] = base / name
    return runs


def crafted(finished: dict[str, Path], kind: str, tmp_path: Path, craft: Craft) -> Path:
    """A copy of the ``kind`` run whose newest checkpoint ``craft`` changed."""
    source = finished[kind]
    run = Path(shutil.copytree(source, tmp_path / "run"))
    path = run / "checkpoint_4.mdl"
    state = ckpt.load_checkpoint(path)
    craft(state)
    torch.save(state, path)
    return run


def resume(run: Path, steps: int = 6, *more: str) -> int:
    """``dls train --resume RUN`` (the config saved in the checkpoint) to ``steps``."""
    return main(["train", "--resume", str(run), "--no_progress", "-o", f"runconfig.max_steps={steps}", *more])


def first_weight(state: dict[str, Any]) -> str:
    return next(iter(state["model"]))


def _weight_beyond_float32(state: dict[str, Any]) -> None:  # float64 1e300: finite as saved, inf in float32
    key = first_weight(state)
    state["model"][key] = state["model"][key].double().fill_(1e300)


def _complex_weight_with_nan(state: dict[str, Any]) -> None:  # NaN in the part the real parameter would not see
    key = first_weight(state)
    state["model"][key] = torch.complex(state["model"][key], torch.full_like(state["model"][key], float("nan")))


def _float8_weight_with_nan(state: dict[str, Any]) -> None:  # isfinite has no float8 kernel
    key = first_weight(state)
    weight = state["model"][key].clone()
    weight[0, 0] = float("nan")
    state["model"][key] = weight.to(torch.float8_e4m3fn)


def _weight_of_10_12_elements(state: dict[str, Any]) -> None:  # a view: costs nothing until its values are read
    state["model"][first_weight(state)] = torch.zeros(1).expand(10**12)


def _exp_avg_sq_beyond_float32(state: dict[str, Any]) -> None:
    entry = state["optimizer"]["state"][0]
    entry["exp_avg_sq"] = entry["exp_avg_sq"].double().fill_(1e300)


def _master_beyond_float16(state: dict[str, Any]) -> None:  # finite in float32; float16's largest is 65504
    masters = state["optimizer"]["master_weights"]
    masters[0] = masters[0].clone().fill_(1e5)


def _group(key: str, value: Any) -> Craft:
    def craft(state: dict[str, Any]) -> None:
        state["optimizer"]["param_groups"][0][key] = value

    craft.__name__ = f"group_{key}"
    return craft


def _decay_beyond_float32(state: dict[str, Any]) -> None:  # each finite; the step's decay 1 - 1e40 is not
    state["optimizer"]["param_groups"][0].update(lr=1e20, weight_decay=1e20)


def _adam_groups(state: dict[str, Any]) -> None:  # Adam's groups, for this AdamW config
    state["optimizer"]["param_groups"][0]["decoupled_weight_decay"] = False


def _unknown_state(state: dict[str, Any]) -> None:
    state["optimizer"]["state"][0]["max_exp_avg_sq"] = torch.zeros(16, 8)


def _step_of_10_12_elements(state: dict[str, Any]) -> None:
    state["optimizer"]["state"][0]["step"] = torch.zeros(1).expand(10**12)


def _scheduler(key: str, value: Any) -> Craft:
    def craft(state: dict[str, Any]) -> None:
        state["lr_scheduler"][key] = value

    craft.__name__ = f"scheduler_{key}"
    return craft


def _elapsed_beyond_float(state: dict[str, Any]) -> None:
    state["trainer"]["elapsed"] = 10**400


def _rng(value: Any, part: str | None = None) -> Craft:
    def craft(state: dict[str, Any]) -> None:
        if part is None:
            state["rng"] = value
        else:
            state["rng"][part] = value

    craft.__name__ = f"rng_{part or 'whole'}"
    return craft


def _format_version_float(state: dict[str, Any]) -> None:
    state["format_version"] = 2.0


MODEL_UNFIT = "the model in {path} does not fit model: in this config: model.net.0.weight "
OPTIMIZER = "cannot load the optimizer state of {path}: "
GROUP = OPTIMIZER + "optimizer.param_groups[0]."
FLAG = "; this config's AdamW has {key}={value}, and a flag of the optimizer is the config's"
SCHEDULER = "cannot load the lr_scheduler state of {path}: "
RNG = "cannot load the rng state of {path}: "


@pytest.mark.parametrize(
    ("kind", "craft", "needle"),
    [
        ("adamw", _weight_beyond_float32, MODEL_UNFIT + "holds values beyond float32's range (largest |value| 1e+300)"),
        ("adamw", _complex_weight_with_nan, MODEL_UNFIT + "is complex (torch.complex64); it loads into float32"),
        ("adamw", _float8_weight_with_nan, "the model in {path} holds inf/NaN values (net.0.weight)"),
        ("adamw", _weight_of_10_12_elements, MODEL_UNFIT + "is a tensor of shape (1000000000000,); this run's needs"),
        (
            "adamw",
            _exp_avg_sq_beyond_float32,
            OPTIMIZER + "optimizer.state[0].exp_avg_sq holds values beyond float32's range (largest |value| 1e+300)",
        ),
        (
            "half",
            _master_beyond_float16,
            OPTIMIZER + "state_dict['master_weights'][0] holds values beyond float16's range (largest |value| 100000)",
        ),
        ("adamw", _group("amsgrad", True), GROUP + "amsgrad is True" + FLAG.format(key="amsgrad", value=False)),
        (
            "adamw",
            _group("capturable", True),
            GROUP + "capturable is True" + FLAG.format(key="capturable", value=False),
        ),
        ("adamw", _group("maximize", True), GROUP + "maximize is True" + FLAG.format(key="maximize", value=False)),
        ("adamw", _group("fused", True), GROUP + "fused is True" + FLAG.format(key="fused", value=None)),
        ("sgd", _group("nesterov", True), GROUP + "nesterov is True; this config's SGD has nesterov=False"),
        ("adamw", _group("lr", "0.1"), GROUP + "lr must be of type float as in this config's AdamW"),
        ("adamw", _group("lr", torch.zeros(1).expand(10**12)), GROUP + "lr must be of type float"),
        ("adamw", _group("lr", -1.0), GROUP[:-1] + " holds hyperparameters AdamW refuses: Invalid learning rate"),
        ("adamw", _group("betas", (1.5, 0.9)), GROUP + "betas.0 must be less than 1, as optimizer.betas.0 in a config"),
        ("adamw", _group("eps", 0.0), GROUP + "eps must be greater than 0, as optimizer.eps in a config; got 0.0"),
        ("sgd", _group("momentum", -0.5), GROUP + "momentum must be greater than or equal to 0, as optimizer.momentum"),
        ("adamw", _group("lr", 1e300), GROUP[:-1] + " holds hyperparameters AdamW refuses: value cannot be converted"),
        (
            "adamw",
            _decay_beyond_float32,
            GROUP[:-1] + " holds hyperparameters with which a step of AdamW gives inf/NaN",
        ),
        ("adamw", _adam_groups, OPTIMIZER + "its param_groups are Adam's and optimizer.optimizer_type is AdamW now"),
        ("adamw", _unknown_state, OPTIMIZER + "optimizer.state[0] holds 'max_exp_avg_sq', which is not state of"),
        ("adamw", _step_of_10_12_elements, OPTIMIZER + "optimizer.state[0].step must be a number >= 0; got a torch"),
        (
            "adamw",
            _scheduler("_step_count", "x"),
            SCHEDULER + "_step_count must be of type int as in this run's LambdaLR",
        ),
        ("adamw", _scheduler("lr_lambdas", [{"__call__": 1}]), SCHEDULER + "lr_lambdas must be of type list"),
        ("adamw", _scheduler("_is_initial", 1), SCHEDULER + "_is_initial must be of type bool"),
        (
            "adamw",
            _elapsed_beyond_float,
            "cannot load the global_step state of {path}: trainer.elapsed must be a number >= 0; got 1000000000",
        ),
        ("adamw", _rng("abc"), RNG + "rng must be a mapping with torch, python and numpy generator states; got 'abc'"),
        ("adamw", _rng("abc", "python"), RNG + "rng.python is not a state of python's generator"),
        ("adamw", _rng(("MT19937", [1, 2], 0, 0, 0.0), "numpy"), RNG + "rng.numpy is not a state of numpy's generator"),
        ("adamw", _rng(torch.zeros(1, dtype=torch.uint8).expand(10**12), "torch"), RNG + "rng.torch is not a state"),
        ("adamw", _format_version_float, "{path} has format_version 2.0; it must be an integer from 1 to 2"),
    ],
    ids=lambda v: v.__name__ if callable(v) else v if v in RUNS else "",
)
def test_a_crafted_field_exits_2_naming_it_and_nothing_is_written(
    finished: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    kind: str,
    craft: Craft,
    needle: str,
) -> None:
    run = crafted(finished, kind, tmp_path, craft)
    before = snapshot(run)
    capsys.readouterr()
    assert resume(run) == 2
    err = one_error_line(capsys.readouterr().err)
    assert needle.format(path=run / "checkpoint_4.mdl") in err
    assert snapshot(run) == before  # config.yaml not rewritten, no metrics row, no crash report


@pytest.mark.parametrize(
    "craft",
    [
        _scheduler("optimizer", None),  # not a key of the scheduler's state: never loaded (it was __dict__.update)
        _scheduler("verbose", True),  # an older torch's key
        _scheduler("_last_lr", None),
    ],
)
def test_scheduler_state_loads_only_the_schedulers_own_keys(
    finished: dict[str, Path], tmp_path: Path, craft: Craft
) -> None:
    run = crafted(finished, "adamw", tmp_path, craft)
    assert resume(run) == 0
    assert [step for step, _ in rundir.list_checkpoints(run)][-1] == 6


def test_optimizer_groups_load_only_the_optimizers_own_keys(finished: dict[str, Path], tmp_path: Path) -> None:
    """A key the config's optimizer does not hold in its groups (another optimizer's, a newer torch's) is left out,
    as the LR schedule's are: it would not be used."""
    run = crafted(finished, "adamw", tmp_path, _group("lookahead", 5))
    assert resume(run) == 0
    groups = ckpt.load_checkpoint(run / "checkpoint_6.mdl")["optimizer"]["param_groups"]
    assert "lookahead" not in groups[0] and groups[0]["betas"] == (0.9, 0.999)


def test_a_finite_float8_weight_loads_as_its_float32_value(finished: dict[str, Path], tmp_path: Path) -> None:
    state_of: dict[str, torch.Tensor] = {}

    def to_float8(state: dict[str, Any]) -> None:
        key = first_weight(state)
        state["model"][key] = state["model"][key].to(torch.float8_e4m3fn)
        state_of["weight"] = state["model"][key].float()

    run = crafted(finished, "adamw", tmp_path, to_float8)
    # At its step already: loaded and checked; a new directory gets it saved again (in place, a session never writes
    # a step the directory holds: issue 38, S2).
    new = tmp_path / "new"
    assert resume(run / "checkpoint_4.mdl", 4, f"runconfig.model_dir={new}") == 0
    assert torch.equal(ckpt.load_checkpoint(new / "checkpoint_4.mdl")["model"]["net.0.weight"], state_of["weight"])


@pytest.mark.parametrize(
    ("value", "like", "finite", "problem"),
    [
        (torch.tensor([1e5]), torch.zeros(1, dtype=torch.float16), True, "holds values beyond float16's range"),
        (torch.tensor([3e38]), torch.zeros(1, dtype=torch.bfloat16), True, None),  # bfloat16 reaches float32's max
        (torch.tensor([1e300], dtype=torch.float64), torch.zeros(1), False, "holds values beyond float32's range"),
        (torch.tensor([float("-inf")]), torch.zeros(1), False, None),  # a buffer may hold inf (masks)
        (torch.tensor([float("-inf")]), torch.zeros(1), True, "holds inf/NaN values"),
        (torch.tensor([complex(1, float("nan"))]), torch.zeros(1, dtype=torch.complex64), True, "holds inf/NaN values"),
        (
            torch.tensor([1.5]),
            torch.zeros(1, dtype=torch.int64),
            True,
            "is a torch.float32 tensor; it loads into int64",
        ),
        (torch.tensor([2**40]), torch.zeros(1, dtype=torch.int32), True, "holds values beyond int32's range"),
        (torch.tensor([7], dtype=torch.int64), torch.zeros(1, dtype=torch.int64), True, None),
        (torch.zeros(2, 2).to_sparse(), torch.zeros(2, 2), True, "is a torch.sparse_coo torch.float32 tensor"),
        (3.0, torch.zeros(()), True, "is 3.0, not a tensor"),
    ],
)
def test_tensor_problem_judges_values_as_they_will_be_held(
    value: Any, like: torch.Tensor, finite: bool, problem: str | None
) -> None:
    found = ckpt.tensor_problem(value, like, finite=finite)
    assert found == problem if problem is None else (found is not None and found.startswith(problem)), found


# ---------------------------------------------------------------------- the stop for inf/NaN weights (A3)
def break_weights_at(monkeypatch: pytest.MonkeyPatch, step: int) -> None:
    """An applied step that writes inf into a weight at ``step`` (as a diverging update would)."""
    real = Trainer._step

    def step_then_break(self: Trainer) -> None:
        real(self)
        if self.global_step == step:
            with torch.no_grad():
                next(self.model.parameters())[0] = float("inf")

    monkeypatch.setattr(Trainer, "_step", step_then_break)


def test_the_stop_for_broken_weights_names_the_checkpoints_that_exist(
    finished: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Resumed in place at step 4: the run has checkpoints (before, the message said it had none)."""
    run = Path(shutil.copytree(finished["adamw"], tmp_path / "run"))
    break_weights_at(monkeypatch, 6)
    assert resume(run) == 1
    err = capsys.readouterr().err
    assert "2 of this session's 2 steps were applied and one broke them" in err
    assert f"the newest checkpoint is {run / 'checkpoint_4.mdl'}" in err and "the run has no checkpoint" not in err
    assert f"then --resume {run}" in err
    assert [step for step, _ in rundir.list_checkpoints(run)] == [2, 4]  # no checkpoint of the broken weights


def test_the_stop_for_broken_weights_in_a_fork_names_where_it_started(
    finished: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    source, new = finished["adamw"], tmp_path / "fork"
    break_weights_at(monkeypatch, 6)
    assert resume(source / "checkpoint_4.mdl", 6, f"runconfig.model_dir={new}") == 1
    err = capsys.readouterr().err
    assert f"{new} holds no checkpoint; this run started from {source / 'checkpoint_4.mdl'}" in err
    assert "2 of this session's 2 steps were applied" in err and f"then start from {source / 'checkpoint_4.mdl'}" in err


def test_running_out_of_memory_while_reading_a_checkpoint_is_not_unreadable(
    finished: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The machine's limit (exit 3), not bytes that do not parse: the checkpoint is not renamed *.unreadable."""
    run = Path(shutil.copytree(finished["adamw"], tmp_path / "run"))
    before = snapshot(run)

    def no_memory(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 4000000000000 bytes")

    monkeypatch.setattr(torch, "load", no_memory)
    assert resume(run) == 3
    assert "out of memory" in one_error_line(capsys.readouterr().err)
    assert snapshot(run) == before


def test_the_seed_of_a_rank_at_a_late_step_fits_torchs_generator() -> None:
    """A rank's seed grows with the global step (seed + rank + 1_000_003 * step): beyond 2^64 torch refuses it."""
    ckpt.seed_everything(1_000_003 * (2**63 - 1) + 1)
    a = torch.rand(1)
    ckpt.seed_everything((1_000_003 * (2**63 - 1) + 1) % 2**64)
    assert torch.equal(torch.rand(1), a)
