"""Issue 38 (reliability, round 4), the trainer's and the CLI's items: ``dls demo`` run twice, a resume whose
checkpoint's step disagrees with its name, ``dls init`` / ``dls data`` creating files exclusively, half parameters
with modules kept in float32, impossible optimizer state, and the C items (a NUL byte in a config, crafted
weights and dataloader state, two Ctrl-C while a checkpoint is written, the lock's holder, the message of an old
format, ``dls data`` bounds, ``model_dir: /`` and a dangling link)."""

from __future__ import annotations

import contextlib
import copy
import math
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from dls.train import checkpoint as ckpt
from dls.train import rundir
from dls.train.cli import main
from dls.train.demo import RUNS
from dls.train.errors import ModelDirError
from test_train import tiny


def write_config(path: Path, raw: dict[str, Any]) -> str:
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def snapshot(directory: Path) -> dict[str, Any]:
    """Each entry's bytes (a directory's: its snapshot; a link: where it points)."""
    return {
        p.name: f"-> {os.readlink(p)}" if p.is_symlink() else p.read_bytes() if p.is_file() else snapshot(p)
        for p in sorted(directory.iterdir())
    }


def one_line(err: str) -> str:
    assert err.startswith("dls: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished tiny run (AdamW; checkpoints at steps 2 and 4), copied by each test that changes it."""
    run = tmp_path_factory.mktemp("finished") / "run"
    config = write_config(run.parent / "c.yaml", tiny(run, runconfig={"max_steps": 4, "checkpoint_steps": 2}))
    assert main(["train", config, "--no_progress"]) == 0
    return run


def copy_of(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "run"))


# ---------------------------------------------------------------------- S1: dls demo twice
def test_dls_demo_run_twice_replaces_its_own_output_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The README's first command is re-runnable: the second demo replaces the first's files (trace.jsonl
    included, which refused it before) and says so; files that are not a run's stay."""
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--steps", "1", "--no_progress"]) == 0
    assert (out / "float16_dls" / "trace.jsonl").is_file()
    (out / "float16_dls" / "my_notes.txt").write_text("mine")
    capsys.readouterr()
    assert main(["demo", "--out", str(out), "--steps", "1", "--no_progress"]) == 0
    said = capsys.readouterr().out
    assert f"Replacing the output of an earlier dls demo in {out} ({len(RUNS)} runs)" in " ".join(said.split())
    assert (out / "float16_dls" / "my_notes.txt").read_text() == "mine"
    assert sorted(p.name for p in (out / "float16_dls").iterdir()) == [
        "checkpoint_1.mdl", "config.yaml", "metrics.jsonl", "my_notes.txt", "trace.jsonl",
    ]  # fmt: skip


def test_dls_demo_refuses_an_out_dir_holding_another_runs_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run directory under a demo run's name that is not a demo's (its config.yaml is another config): refused
    before anything is deleted, naming it."""
    out = tmp_path / "demo"
    assert main(["train", write_config(tmp_path / "c.yaml", tiny(out / "float32")), "--no_progress"]) == 0
    before = snapshot(out)
    capsys.readouterr()
    assert main(["demo", "--out", str(out), "--steps", "1", "--no_progress"]) == 2
    err = one_line(capsys.readouterr().err)
    assert f"{out / 'float32'} holds" in err and "not an earlier dls demo's" in err and "another --out" in err
    assert snapshot(out) == before


# ---------------------------------------------------------------------- S2: a resume never rewinds in place
def resume(run: Path, steps: int = 6, *more: str) -> int:
    return main(["train", "--resume", str(run), "--no_progress", "-o", f"runconfig.max_steps={steps}", *more])


@pytest.mark.parametrize(
    ("step", "said"),
    [
        (None, "it holds no global_step (its file name says step 4)"),
        (2, "global_step is 2, but its file name says step 4: a checkpoint is resumed only at the step"),
        (0, "global_step is 0, but its file name says step 4"),
        (6, "global_step is 6, but its file name says step 4"),
        (4.0, "global_step must be an integer >= 0; got 4.0 (its file name says step 4)"),
        ("4", "global_step must be an integer >= 0; got '4' (its file name says step 4)"),
        (True, "global_step must be an integer >= 0; got True (its file name says step 4)"),
    ],
)
def test_a_checkpoint_whose_step_disagrees_with_its_name_is_refused_and_nothing_changes(
    finished: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], step: Any, said: str
) -> None:
    """checkpoint_4.mdl holding step 2 rewound the run in place ("steps 2->6") and rewrote checkpoint_4.mdl."""
    run = copy_of(finished, tmp_path)
    state = ckpt.load_checkpoint(run / "checkpoint_4.mdl")
    if step is None:
        del state["global_step"]
    else:
        state["global_step"] = step
    torch.save(state, run / "checkpoint_4.mdl")
    before = snapshot(run)
    capsys.readouterr()
    assert resume(run) == 2
    assert f"cannot load the global_step state of {run / 'checkpoint_4.mdl'}: {said}" in one_line(
        capsys.readouterr().err
    )
    assert snapshot(run) == before


def test_a_resume_at_its_checkpoints_step_does_not_write_that_checkpoint_again(finished: Path, tmp_path: Path) -> None:
    """Resumed in place where the run already is (max_steps reached): checkpoint_4.mdl stays the file it was."""
    run = copy_of(finished, tmp_path)
    before = (run / "checkpoint_4.mdl").read_bytes()
    assert resume(run, 4) == 0
    assert (run / "checkpoint_4.mdl").read_bytes() == before
    assert [step for step, _ in rundir.list_checkpoints(run)] == [2, 4]


def test_a_session_never_replaces_a_checkpoint_the_directory_held_when_it_opened(tmp_path: Path) -> None:
    """The run directory's own guard: a step the session found there is never written again."""
    run_dir = rundir.RunDir(tmp_path / "run")
    with run_dir:
        ckpt.save_checkpoint(run_dir, {"global_step": 3, "model": {}}, 3)
        run_dir.open(print, set_aside=[], step=3, config={}, config_file=None)
        with pytest.raises(ModelDirError, match=r"checkpoint_3\.mdl was there before this session"):
            ckpt.save_checkpoint(run_dir, {"global_step": 3, "model": {}}, 3)
        ckpt.save_checkpoint(run_dir, {"global_step": 4, "model": {}}, 4)
    assert [step for step, _ in rundir.list_checkpoints(tmp_path / "run")] == [3, 4]


# ---------------------------------------------------------------------- S3: dls init and dls data create files only
MNIST_IMAGES = "data/mnist/MNIST/raw/train-images-idx3-ubyte"


@pytest.mark.parametrize("planted", ["file", "link"])
def test_dls_init_never_replaces_a_file_or_writes_through_a_link(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], planted: str
) -> None:
    directory, outside = tmp_path / "dir", tmp_path / "outside.bin"
    outside.write_bytes(b"not yours")
    (directory / MNIST_IMAGES).parent.mkdir(parents=True)
    if planted == "file":
        (directory / MNIST_IMAGES).write_bytes(b"mine")
    else:
        (directory / MNIST_IMAGES).symlink_to(outside)
    before = snapshot(directory)
    assert main(["init", "modelzoo/fc_mnist", str(directory)]) == 2
    err = one_line(capsys.readouterr().err)
    assert f"{directory / MNIST_IMAGES} exists" in err and "nothing was written" in err
    assert snapshot(directory) == before and outside.read_bytes() == b"not yours"  # the config not written either


@pytest.mark.parametrize("planted", ["train/data_0.h5", "train"])
def test_dls_data_never_writes_through_a_link(tmp_path: Path, capsys: pytest.CaptureFixture[str], planted: str) -> None:
    """A link under a file's name, or where its directory goes: refused before anything is written."""
    pytest.importorskip("h5py")
    directory, outside = tmp_path / "dir", tmp_path / "outside"
    outside.mkdir()
    (outside / "data_0.h5").write_bytes(b"not yours")
    (directory / "train").mkdir(parents=True)
    if planted == "train":
        (directory / "train").rmdir()
        (directory / "train").symlink_to(outside)
    else:
        (directory / planted).symlink_to(outside / "data_0.h5")
    before = snapshot(directory)
    assert main(["data", "gpt", str(directory), "--train", "8", "--val", "4", "--msl", "8"]) == 2
    assert f"{directory / planted} exists (a symbolic link)" in one_line(capsys.readouterr().err)
    assert snapshot(directory) == before and snapshot(outside) == {"data_0.h5": b"not yours"}


def test_dls_data_into_a_directory_it_wrote_before_replaces_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = tmp_path / "mnist"
    assert main(["data", "mnist", str(directory), "--train", "8", "--val", "4"]) == 0
    before = snapshot(directory)
    assert main(["data", "mnist", str(directory), "--train", "8", "--val", "4", "--seed", "1"]) == 2
    assert f"{directory / 'MNIST' / 'raw' / 'train-images-idx3-ubyte'} exists" in one_line(capsys.readouterr().err)
    assert snapshot(directory) == before


@pytest.mark.parametrize(
    ("args", "status", "said"),
    [
        (["gpt", "--train", str(10**30)], 3, "out of memory: dls data gpt needs about"),
        (["mnist", "--val", str(10**30)], 3, "out of memory: dls data mnist needs about"),
        (["gpt", "--vocab", str(2**31 + 1)], 2, "--vocab must be at most 2147483648 (token ids are int32)"),
        (["gpt", "--files", "300"], 2, "--files must be at most 256"),
    ],
)
def test_dls_data_refuses_what_no_file_or_memory_holds_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], status: int, said: str
) -> None:
    """C13: `--train 10**30` was an internal error (exit 4)."""
    pytest.importorskip("h5py")
    if status == 2:  # argparse's usage error: its usage, then the line
        with pytest.raises(SystemExit) as exited:
            main(["data", args[0], str(tmp_path / "d"), *args[1:]])
        assert exited.value.code == 2 and said in capsys.readouterr().err.splitlines()[-1]
    else:
        assert main(["data", args[0], str(tmp_path / "d"), *args[1:]]) == status
        assert said in one_line(capsys.readouterr().err)
    assert not (tmp_path / "d").exists()


# ---------------------------------------------------------------------- S4: half parameters with kept modules
def test_a_kept_module_of_a_half_model_hands_back_its_neighbours_dtype() -> None:
    """Outside autocast (half parameters compute without it) a kept module gets float32 inputs and returns the
    half dtype it was called with (an embedding, called with integers: its parameters'); the model runs through."""
    import dls

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)
    ).half()
    seen: dict[str, torch.dtype] = {}
    model[1].register_forward_pre_hook(lambda _m, args: seen.__setitem__("kept input", args[0].dtype))
    reference = copy.deepcopy(model).float()
    ids = torch.tensor([[1, 2, 3]])
    with dls.keep_in_float32(model, ["0", "1"]):
        out = model(ids)
    assert seen["kept input"] == torch.float32 and out.dtype == torch.float16
    kept = reference[1](reference[0](ids)).half()  # what the two kept modules hand on, rounded once
    assert torch.equal(out, model[3](model[2](kept)))
    with torch.autocast("cpu", dtype=torch.bfloat16), dls.keep_in_float32(model, ["1"]):
        assert model[1](model[0](ids)).dtype == torch.float32  # inside autocast: float32, as before


@pytest.mark.parametrize("case", ["keep_in_float32", "fallback"])
def test_half_parameters_train_with_modules_kept_in_float32(tmp_path: Path, case: str) -> None:
    """`precision.half_params` with `keep_in_float32: [net.2]` was an internal error at the first step (`mat1 and
    mat2 must have the same dtype`); so was any forward overflow, the fallback being on by default."""
    from test_train import make_trainer

    precision = {"mixed_precision": True, "fp16_type": "float16", "half_params": True}
    if case == "keep_in_float32":
        precision["keep_in_float32"] = ["net.2"]
    raw = tiny(tmp_path / "run", model={"dropout": 0.0}, precision=precision, runconfig={"max_steps": 6})
    trainer, _ = make_trainer(raw)  # net: Linear, Tanh, Linear (net.2), Tanh, Linear (net.4)
    if case == "fallback":  # the last layer's float16 output overflows: a forward overflow the fallback sees
        with torch.no_grad():
            trainer.model.net[4].weight.fill_(60000.0)
    with pytest.warns(UserWarning, match="dls fallback") if case == "fallback" else contextlib.nullcontext():
        result = trainer.train()
    assert result.global_step == 6
    if case == "keep_in_float32":
        assert trainer.watch.kept_in_float32 == ("net.2",)
    else:  # kept, but its float32 output is beyond float16, which it hands back: every step skipped, no crash
        assert trainer.watch.kept_in_float32[0] == "net.4" and result.skipped_steps == 6


@pytest.mark.parametrize(
    ("changes", "said"),
    [
        ({"learning_rate": 1e38}, "optimizer.learning_rate: one step of AdamW at the learning rate 1e+38 on a weight"),
        (
            {"learning_rate": [{"scheduler": "Linear", "initial_learning_rate": 0, "end_learning_rate": 1e38,
                                "total_iters": 4}]},
            "optimizer.learning_rate: one step of AdamW at the learning rate 1e+38",
        ),
        ({"learning_rate": 1e37, "weight_decay": 1e10}, "optimizer.learning_rate with optimizer.weight_decay 1e+10"),
    ],
)  # fmt: skip
def test_a_learning_rate_no_optimizer_step_survives_is_refused_in_validation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], changes: dict[str, Any], said: str
) -> None:
    """`optimizer.learning_rate: 1e38` (within every float key's bound) was exit 4 at the first step: Adam's step
    size lr / (1 - beta1) is beyond float32."""
    config = write_config(tmp_path / "c.yaml", tiny(tmp_path / "run", optimizer=changes))
    for command in (["validate", config], ["train", config, "--no_progress"]):
        assert main(command) == 2
        assert said in one_line(capsys.readouterr().err)
    assert not (tmp_path / "run").exists()
    sgd = write_config(tmp_path / "sgd.yaml", tiny(tmp_path / "run", optimizer={"optimizer_type": "SGD", **changes}))
    assert main(["validate", sgd]) == (2 if "weight_decay" in changes else 0)  # SGD's step: 1 - lr, finite


# ---------------------------------------------------------------------- S5 and C8: crafted state in a checkpoint
def crafted_run(finished: Path, tmp_path: Path, craft: Any) -> Path:
    run = copy_of(finished, tmp_path)
    state = ckpt.load_checkpoint(run / "checkpoint_4.mdl")
    craft(state)
    torch.save(state, run / "checkpoint_4.mdl")
    return run


def _exp_avg_sq(value: float) -> Any:
    def craft(state: dict[str, Any]) -> None:
        state["optimizer"]["state"][0]["exp_avg_sq"][0, 0] = value

    return craft


def _set(path: str, value: Any) -> Any:
    def craft(state: dict[str, Any]) -> None:
        keys: list[Any] = [int(k) if k.isdigit() else k for k in path.split(".")]
        node = state
        for key in keys[:-1]:
            node = node[key]
        node[keys[-1]] = value

    return craft


def _model_weight(dtype: torch.dtype) -> Any:
    def craft(state: dict[str, Any]) -> None:
        state["model"]["net.0.weight"] = state["model"]["net.0.weight"].to(dtype)

    return craft


OPTIMIZER = "cannot load the optimizer state of {path}: optimizer."
DATALOADER = "cannot load the dataloader state of {path}: "


EXP_AVG = "optimizer.state.0.exp_avg"
FLOATING = "; its parameter needs a floating-point tensor of shape (16, 8)"
WEIGHT = "the model in {path} does not fit model: in this config: model.net.0.weight is a "


@pytest.mark.parametrize(
    ("craft", "said"),
    [
        (_exp_avg_sq(-1.0), OPTIMIZER + "state[0].exp_avg_sq holds negative values (as low as -1)"),
        (_exp_avg_sq(float("nan")), OPTIMIZER + "state[0].exp_avg_sq holds inf/NaN values"),
        (_set(EXP_AVG, torch.full((16, 8), math.nan)), OPTIMIZER + "state[0].exp_avg holds inf/NaN values"),
        (_set(EXP_AVG, torch.zeros(8, 16)), OPTIMIZER + "state[0].exp_avg is a torch.float32 tensor of shape (8, 16)"
            + FLOATING),
        (_set(EXP_AVG, torch.zeros(16, 8, dtype=torch.int64)), OPTIMIZER
            + "state[0].exp_avg is a torch.int64 tensor of shape (16, 8)" + FLOATING),
        (_set("optimizer.param_groups.0.params", [0, 0, 1, 2, 3, 4]), OPTIMIZER
            + "param_groups[0].params must be distinct integers"),
        (_set("optimizer.param_groups.0.lr", -1.0), OPTIMIZER + "param_groups[0] holds hyperparameters AdamW refuses: "
            "Invalid learning rate: -1.0 (in optimizer.param_groups[0]: lr = -1.0)"),
        (_model_weight(torch.int64), WEIGHT + "torch.int64 tensor; it loads into float32, which holds floating-point "
            "values"),
        (_model_weight(torch.bool), WEIGHT + "torch.bool tensor; it loads into float32"),
        (_set("dataloader.seed", "x"), DATALOADER + "seed must be an integer >= 0; got 'x'"),
        (_set("dataloader.batch_size", 0), DATALOADER + "batch_size must be an integer >= 1; got 0"),
    ],
)  # fmt: skip
def test_impossible_state_in_a_checkpoint_is_refused_naming_the_field_and_nothing_changes(
    finished: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], craft: Any, said: str
) -> None:
    """S5: Adam's exp_avg_sq = -1 (finite, impossible) loaded, and the first applied step made the weights NaN (the
    run then told the user to resume from that same file). C8: int64 / bool weights and a dataloader's seed "x" or
    batch_size 0 loaded; a refused hyperparameter was not named."""
    run = crafted_run(finished, tmp_path, craft)
    before = snapshot(run)
    capsys.readouterr()
    assert resume(run) == 2
    assert said.format(path=run / "checkpoint_4.mdl") in one_line(capsys.readouterr().err)
    assert snapshot(run) == before


def test_the_optimizer_state_check_is_the_cores_for_any_torch_optimizer() -> None:
    """dls.optimizer_state judges a state dict against the optimizer that loads it (torch only; master_weights can
    use it): every torch optimizer's own state after a step passes, and each impossible value is named."""
    from dls.optimizer_state import check_optimizer_state

    for cls in (torch.optim.Adam, torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.Adadelta,
                torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.ASGD, torch.optim.Rprop,
                torch.optim.Adafactor, torch.optim.SGD):  # fmt: skip
        params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
        optimizer = cls(params, **({"momentum": 0.9} if cls is torch.optim.SGD else {}))
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer.step()
        state = optimizer.state_dict()
        check_optimizer_state(optimizer, state)  # its own state loads
        key = next(k for k, v in state["state"][0].items() if isinstance(v, torch.Tensor) and v.dim() == 2)
        bad = {**state, "state": {**state["state"], 0: {**state["state"][0], key: state["state"][0][key] * math.nan}}}
        with pytest.raises(ValueError, match=rf"optimizer\.state\[0\]\.{key} holds inf/NaN values"):
            check_optimizer_state(optimizer, bad)
    with pytest.raises(ValueError, match=r"optimizer\.state\[0\]\.step must be a number >= 0; got -1"):
        check_optimizer_state(optimizer, {**state, "state": {0: {"step": -1, "momentum_buffer": None}}})


# ---------------------------------------------------------------------- C9: a signal once the command has ended
LATE_SIGNAL = """
import os, signal, sys, time
import dls.train.cli as cli
import dls_entry

class Late:  # freed while the interpreter exits, after the command returned its status
    def __del__(self, kill=os.kill, pid=os.getpid(), sig=signal.SIGINT, sleep=time.sleep):
        kill(pid, sig)
        sleep(0.2)

late = Late()
if sys.argv.pop(1) == "report":  # a Ctrl-C while the command's failure is reported
    real = cli._report
    def report(exc, crash_dir):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)
        return real(exc, crash_dir)
    cli._report = report
sys.argv = ["dls", "train", "/nonexistent/config.yaml"]
dls_entry.main()
"""


@pytest.mark.parametrize("when", ["report", "exit"])
def test_a_signal_after_the_command_ended_changes_nothing(tmp_path: Path, when: str) -> None:
    """Two Ctrl-C 50 ms apart while a checkpoint was written ended the process by the signal (status -2): the second
    came as the interpreter exited, after the command had said its line and decided its status."""
    import subprocess
    import sys

    script = tmp_path / "late.py"
    script.write_text(LATE_SIGNAL)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, str(script), when], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert one_line(proc.stderr).startswith("dls: error: no config file /nonexistent/config.yaml")


# ---------------------------------------------------------------------- C7, C10, C13, C14
@pytest.mark.parametrize("source", ["nul", "environ"])
def test_a_config_holding_a_nul_byte_is_exit_2_naming_the_file_and_the_position(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], source: str
) -> None:
    """C7: a ReaderError escaped as an internal error (exit 4)."""
    path = tmp_path / "nul.yaml"
    path.write_bytes(b"model:\n  name: mlp\x00\n")
    given = str(path) if source == "nul" else "/proc/self/environ"
    if source == "environ" and not Path(given).is_file():
        pytest.skip("no /proc/self/environ")
    for command in ("validate", "train"):
        assert main([command, given]) == 2
        err = one_line(capsys.readouterr().err)
        where = f"{given}:2:12: " if source == "nul" else f"{given}:"
        assert where in err and "character U+0000 ('\\x00') is not allowed in YAML" in err


def test_resuming_a_directory_another_run_holds_names_the_holder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """C10: it said "no checkpoint files" while a run that had written none yet held the directory."""
    run = tmp_path / "run"
    run.mkdir()
    with rundir.RunDir(rundir.resolve_model_dir(run)):
        assert main(["train", "--resume", str(run), "--no_progress"]) == 2
        err = one_line(capsys.readouterr().err)
        assert f"--resume: {run} is in use by another dls run: pid {os.getpid()} on host" in err
        assert "no checkpoint_<step>.mdl" not in err
    assert main(["train", "--resume", str(run), "--no_progress"]) == 2  # released: nothing to resume, as before
    assert f"--resume: no checkpoint_<step>.mdl files in {run}" in one_line(capsys.readouterr().err)


@pytest.mark.parametrize("version", [0, -1])
def test_a_format_version_no_dls_wrote_is_not_called_newer(
    finished: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], version: int
) -> None:
    """C13: format_version 0 was "written by a newer dls"."""
    run = crafted_run(finished, tmp_path, _set("format_version", version))
    before = snapshot(run)
    assert resume(run) == 2
    err = one_line(capsys.readouterr().err)
    assert f"{run / 'checkpoint_4.mdl'} has format_version {version}; it must be an integer from 1 to 2" in err
    assert "newer" not in err and snapshot(run) == before


@pytest.mark.parametrize("case", ["root", "dangling", "dangling_parent"])
def test_a_model_dir_that_is_the_root_or_through_a_dangling_link_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    """C14: `model_dir: /` was accepted without a word; a dangling link as model_dir created its target's whole path.
    Decision: both refused, naming them (a link to an existing directory stays fine)."""
    target = tmp_path / "elsewhere" / "deep" / "run"
    link = tmp_path / "link"
    link.symlink_to(target if case == "dangling" else target.parent)
    model_dir = {"root": "/", "dangling": str(link), "dangling_parent": str(link / "run")}[case]
    config = write_config(tmp_path / "c.yaml", tiny(Path(model_dir)))
    assert main(["train", config, "--no_progress"]) == 2
    err = one_line(capsys.readouterr().err)
    if case == "root":
        assert "runconfig.model_dir / is the file system's root" in err
    else:
        assert f"{link} is a symbolic link to {os.readlink(link)}, which does not exist" in err
    assert not (tmp_path / "elsewhere").exists()
    (tmp_path / "elsewhere" / "deep" / "run").mkdir(parents=True)  # the link's target exists: fine
    if case != "root":
        assert rundir.resolve_model_dir(model_dir) == Path(os.path.realpath(model_dir))


def test_a_key_given_twice_in_an_override_takes_the_last_with_a_note_as_in_a_file(tmp_path: Path) -> None:
    """C11: one rule per layout, the same in each (the guarantees page said errors): a value given twice takes the
    last with a note naming both lines; an override's value is read as a file is (it was silent)."""
    from dls.train.config import load_config

    path = Path(write_config(tmp_path / "c.yaml", tiny(tmp_path / "run")))
    cfg = load_config(path, ["precision.fp8={recipe: delayed, recipe: current}"])
    assert cfg.precision.fp8 is not None and cfg.precision.fp8["recipe"] == "current"
    (note,) = [n for n in cfg.notes if "given twice" in n]
    assert note == (
        "override 'precision.fp8={recipe: delayed, recipe: current}': 'recipe' is given twice (lines 1 and 1); the "
        "value of line 1 is used, as Model Zoo's YAML loader does"
    )


def test_dls_data_leaves_nothing_when_the_disk_fills_halfway(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """All or nothing: the files written before a full disk are removed again, and the directories made for them
    (a rerun found them and refused: they exist)."""
    import errno

    real, calls = rundir._write_new, []

    def full_on_the_third(dir_fd: int, name: str, data: Any) -> None:
        calls.append(name)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(dir_fd, name, data)

    monkeypatch.setattr(rundir, "_write_new", full_on_the_third)
    assert main(["data", "mnist", str(tmp_path / "d"), "--train", "8", "--val", "4"]) == 3
    err = one_line(capsys.readouterr().err)
    assert f"{tmp_path / 'd' / 'MNIST' / 'raw' / 't10k-images-idx3-ubyte'}: No space left on device" in err
    assert "write to another DIR" in err and not (tmp_path / "d").exists()


def test_each_step_has_one_checkpoint_name() -> None:
    """checkpoint_007.mdl is not step 7's checkpoint (checkpoint_7.mdl is): a session would have found step 7 there
    and then refused to write it."""
    assert [rundir.checkpoint_step(n) for n in ("checkpoint_7.mdl", "checkpoint_0.mdl", "checkpoint_007.mdl")] == [
        7, 0, -1,
    ]  # fmt: skip
    assert rundir.checkpoint_step(rundir.checkpoint_path("run", 70).name) == 70
