"""Issue 18, the trainer's runtime: a newer checkpoint format and crafted checkpoints are refused with nothing
changed, the trainer never makes a checkpoint of non-finite weights its newest, CPU out-of-memory is exit 3,
Ctrl-C / SIGTERM from the entry point's first line is one line and 130 / 143, ``dls demo --out`` respects the
lock, the messages name paths and keys, and a full disk leaves no temporary file."""

from __future__ import annotations

import errno
import functools
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from dls.train import checkpoint as ckpt
from dls.train import rundir
from dls.train.cli import main
from dls.train.demo import DLS, FP16, base_config
from dls.train.trainer import Trainer
from test_train import tiny

ROOT = Path(__file__).resolve().parent.parent


def write_config(path: Path, raw: dict[str, Any]) -> str:
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def snapshot(directory: Path) -> dict[str, Any]:
    """Each entry's bytes (a directory's: its snapshot)."""
    return {p.name: p.read_bytes() if p.is_file() else snapshot(p) for p in sorted(directory.iterdir())}


def one_line(err: str) -> str:
    assert err.count("\n") == 1 and "Traceback" not in err and "Warning" not in err, err
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


# ---------------------------------------------------------------------- item 8: a newer checkpoint format
def test_a_newer_checkpoint_format_is_refused_and_nothing_changes(
    finished: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = copy_of(finished, tmp_path)
    newest = run / "checkpoint_4.mdl"
    torch.save({**ckpt.load_checkpoint(newest), "format_version": ckpt.FORMAT_VERSION + 1}, newest)
    before = snapshot(run)
    assert main(["train", "--resume", str(run), "--no_progress", "-o", "runconfig.max_steps=6"]) == 2
    err = one_line(capsys.readouterr().err)
    assert str(newest) in err and f"version {ckpt.FORMAT_VERSION + 1};" in err and f"1 to {ckpt.FORMAT_VERSION}" in err
    assert snapshot(run) == before  # not renamed *.unreadable, no rewind, metrics untouched


# ---------------------------------------------------------------------- item 9: crafted checkpoints
# (the crafted optimizer states are among test_cli_exit_codes' crafted checkpoint fields)
def test_unparseable_bytes_are_set_aside_as_before(
    finished: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = copy_of(finished, tmp_path)
    (run / "checkpoint_4.mdl").write_bytes(b"\x80\x05garbage")
    assert main(["train", "--resume", str(run), "--no_progress", "-o", "runconfig.max_steps=6"]) == 0
    assert (run / "checkpoint_4.mdl.unreadable").read_bytes() == b"\x80\x05garbage"
    assert "Detected pickle protocol" not in capsys.readouterr().err


def test_weights_turned_non_finite_are_never_the_newest_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """float16 parameters without master weights: Adam's float16 state breaks the weights within a few steps.
    The run stops (exit 1), the newest checkpoint is the last finite one, and the advice names what can work."""
    raw = base_config(20, tmp_path / "run")
    raw["data"]["num_samples"] = 512
    raw["precision"].update({**FP16, "half_params": True, "master_weights": False})
    raw["optimizer"].update(DLS)
    raw["runconfig"].update(checkpoint_steps=4, keep_checkpoint_max=5)
    assert main(["train", write_config(tmp_path / "c.yaml", raw), "--no_progress"]) == 1
    err = capsys.readouterr().err
    found = rundir.list_checkpoints(tmp_path / "run")
    assert found, "a checkpoint was written before the weights broke"
    for _, path in found:
        assert all(torch.isfinite(t).all() for t in ckpt.load_checkpoint(path)["model"].values()), path
    assert "inf/NaN" in err and str(found[-1][1]) in err and "precision.master_weights: true" in err
    assert f"--resume {tmp_path / 'run'}" in err


# ---------------------------------------------------------------------- item 10: out of memory
def test_cpu_out_of_memory_during_a_run_is_exit_3(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def allocate(self: Trainer, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: can't allocate memory: you tried to "
            "allocate 80000000000 bytes. Error code 12 (Cannot allocate memory)"
        )

    monkeypatch.setattr(Trainer, "_step", allocate)
    config = write_config(tmp_path / "c.yaml", tiny(tmp_path / "run"))
    assert main(["train", config, "--no_progress"]) == 3
    err = one_line(capsys.readouterr().err)
    assert err.startswith("dls: error: out of memory") and "80000000000 bytes" in err
    assert not list(tmp_path.glob("dls-crash-*")) and not list((tmp_path / "run").glob("dls-crash-*"))


# ---------------------------------------------------------------------- item 11: Ctrl-C from the first line
SIGNAL_AT_IMPORT = """
import os, signal, sys
import dls_entry

class SignalAtImport:  # sends the signal the moment MODULE starts being imported
    module, signum = sys.argv[1], getattr(signal, sys.argv[2])

    def find_spec(self, name, path=None, target=None):
        if name == self.module:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), self.signum)
        return None

sys.meta_path.insert(0, SignalAtImport())
sys.argv = ["dls", *sys.argv[3:]]
dls_entry.main()
"""


@pytest.mark.parametrize(
    ("module", "name", "status", "line"),
    [
        ("torch", "SIGINT", 130, "dls: interrupted"),  # while the command starts: imports
        ("torch", "SIGTERM", 143, "dls: terminated (SIGTERM)"),
        ("dls.train.trainer", "SIGINT", 130, "dls: interrupted"),  # inside the command, before training
    ],
)
def test_a_signal_at_any_moment_from_the_entry_point_is_one_line(
    tmp_path: Path, module: str, name: str, status: int, line: str
) -> None:
    config = write_config(tmp_path / "c.yaml", tiny(tmp_path / "run"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SIGNAL_AT_IMPORT), module, name, "train", config, "--no_progress"],
        capture_output=True, text=True, env=env, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == status and proc.stderr == line + "\n", proc.stderr
    assert not (tmp_path / "run").exists()


def test_the_console_script_is_the_entry_module() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    assert 'dls = "dls_entry:main"' in text


# ---------------------------------------------------------------------- item 12: dls demo and the lock
def test_demo_refuses_an_out_dir_another_run_holds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    with rundir.RunDir(rundir.resolve_model_dir(out)):
        assert main(["demo", "--out", str(out), "--steps", "1", "--no_progress"]) == 2
        assert os.listdir(out) == [rundir.LOCK_FILE]
    err = one_line(capsys.readouterr().err)
    assert "--out" in err and "in use" in err and "runconfig.model_dir" not in err


# ---------------------------------------------------------------------- item 13: messages
def test_a_directory_named_metrics_jsonl_is_named_by_its_path(
    finished: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = copy_of(finished, tmp_path)
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").mkdir()
    assert main(["train", "--resume", str(run), "--no_progress", "-o", "runconfig.max_steps=6"]) == 3
    err = one_line(capsys.readouterr().err)
    assert f"{run / 'metrics.jsonl'}: Is a directory" in err


@pytest.mark.parametrize("content", [b"hello", b"pickled"])
def test_resume_from_a_file_that_is_not_a_checkpoint_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes
) -> None:
    path = tmp_path / "notes.mdl"
    if content == b"pickled":  # protocol 5: torch warns about it, and its weights_only refusal is paragraphs long
        torch.save({"model": {}}, path, pickle_protocol=5)
    else:
        path.write_bytes(content)
    config = write_config(tmp_path / "c.yaml", tiny(tmp_path / "run"))
    assert main(["train", config, "--resume", str(path), "--no_progress"]) == 2
    err = one_line(capsys.readouterr().err)
    assert str(path) in err and "weights_only" not in err and "pickle protocol" not in err


def test_a_nul_in_model_dir_names_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(tiny(tmp_path / "run")).replace(str(tmp_path / "run"), "runs/a\\0b"))
    config.write_text(config.read_text().replace("model_dir: runs/a\\0b", 'model_dir: "runs/a\\0b"'))
    assert main(["train", str(config), "--no_progress"]) == 2
    assert "runconfig.model_dir" in one_line(capsys.readouterr().err)


def test_audit_out_names_the_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("")
    config = write_config(tmp_path / "c.yaml", tiny(tmp_path / "run"))
    assert main(["audit", config, "--steps", "1", "--formats", "float16", "--out", str(tmp_path / "file")]) == 3
    err = capsys.readouterr().err.splitlines()[-1]
    assert "--out" in err and "runconfig.model_dir" not in err


def test_taking_over_a_stale_lock_does_not_say_it_is_still_held(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(ended.stdout)
    run = tmp_path / "run"
    run.mkdir()
    import json
    import socket

    (run / rundir.LOCK_FILE).write_text(json.dumps({"pid": pid, "host": socket.gethostname()}))
    assert main(["train", write_config(tmp_path / "c.yaml", tiny(run)), "--no_progress"]) == 0
    out = capsys.readouterr().out
    assert f"Taking over the lock of pid {pid}" in out and "still holds it" not in out


# ---------------------------------------------------------------------- item 16: a full disk
class FullDisk:
    """A file whose writes fail for lack of space, and whose close() fails again (it flushes again)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def write(self, data: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def close(self) -> None:
        os.close(self.fd)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("name", ["config.yaml", "metrics.jsonl"])
def test_a_full_disk_leaves_no_temporary_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    with rundir.RunDir(tmp_path) as run_dir:
        monkeypatch.setattr(os, "fdopen", lambda fd, *args, **kwargs: FullDisk(fd))
        with pytest.raises(OSError) as info:
            if name == "metrics.jsonl":  # the session's first write
                run_dir.open(print, set_aside=[], step=0, config={}, config_file=None)
            else:
                run_dir.replace(name, b"x: 1\n")
        monkeypatch.undo()
        assert info.value.errno == errno.ENOSPC and info.value.filename == str(tmp_path / name)
        assert sorted(os.listdir(tmp_path)) == [rundir.LOCK_FILE]


# ---------------------------------------------------------------------- adversarial: read-only media
def test_a_run_on_read_only_media_is_exit_3_naming_the_path_and_changes_nothing(
    finished: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Resuming in place on a read-only file system (EROFS; root ignores permission bits, so the file system's
    answer is simulated): exit 3 naming the path, and the run is as it was."""
    run = copy_of(finished, tmp_path)
    before = snapshot(run)
    real_open = os.open

    def read_only(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
    assert main(["train", "--resume", str(run), "--no_progress", "-o", "runconfig.max_steps=6"]) == 3
    err = one_line(capsys.readouterr().err)
    assert f"{run / rundir.LOCK_FILE}: Read-only file system" in err
    monkeypatch.undo()
    assert snapshot(run) == before


# ---------------------------------------------------------------------- TensorBoard through SummaryWriter
def test_tensorboard_refuses_a_directory_others_can_write(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Others could plant a link where SummaryWriter reopens its event file: refused before anything is written
    (exit 2, naming the directory)."""
    run, events = tmp_path / "run", tmp_path / "run" / "tensorboard"
    config = write_config(tmp_path / "c.yaml", tiny(run, runconfig={"max_steps": 2, "tensorboard": True}))
    assert main(["train", config, "--no_progress"]) == 0
    events.chmod(0o777)
    before = snapshot(run)
    capsys.readouterr()
    assert main(["train", config, "--resume", str(run), "--no_progress", "-o", "runconfig.max_steps=4"]) == 2
    assert str(events) in one_line(capsys.readouterr().err)
    assert snapshot(run) == before


def test_a_link_named_like_a_checkpoint_is_never_resumed_from(
    finished: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A planted ``checkpoint_99.mdl`` link to another run's checkpoint would make the resume load that run."""
    other = tmp_path / "other.mdl"
    state = ckpt.load_checkpoint(finished / "checkpoint_4.mdl")
    torch.save({**state, "global_step": 99}, other)
    run = copy_of(finished, tmp_path)
    (run / "checkpoint_99.mdl").symlink_to(other)
    args = ["train", "--resume", str(run), "--no_progress", "-o", "runconfig.max_steps=8"]
    assert main([*args, "runconfig.keep_checkpoint_max=2"]) == 0
    assert "Loading " + str(run / "checkpoint_4.mdl") in capsys.readouterr().out
    assert [s for s, _ in rundir.list_checkpoints(run)] == [6, 8]  # rotation counts real checkpoints only
    assert ckpt.load_checkpoint(other)["global_step"] == 99  # the link's target is untouched


# ---------------------------------------------------------------------- issue 30: command-line values
def data_dirs(value: Any) -> list[Any]:
    """Every data_dir value in a parsed config."""
    if isinstance(value, dict):
        return [v for k, v in value.items() if k == "data_dir"] + [d for v in value.values() for d in data_dirs(v)]
    return [d for v in value for d in data_dirs(v)] if isinstance(value, list) else []


@pytest.mark.parametrize("name", ["it's", 'say "hi"', "back\\slash", "tab\there", "new\nline", "plain: #x"])
def test_dls_init_writes_data_dir_as_yaml_whatever_the_directory_is_called(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    """C7: the value is written by the YAML library (quoted as YAML needs), and the config reads back the path."""
    monkeypatch.chdir(tmp_path)
    assert main(["init", "modelzoo/fc_mnist", name]) == 0
    config = Path(name) / "fc_mnist.yaml"
    text = config.read_text()
    found = data_dirs(yaml.safe_load(text))
    assert found and all(d == str(Path(name) / "data" / "mnist") for d in found)
    assert "# Model Zoo's own params.yaml reads the same data" in text  # the comments are kept
    capsys.readouterr()
    assert main(["validate", str(config)]) == 0
    assert "on this machine" not in capsys.readouterr().out  # the data is where data_dir says


def test_an_empty_directory_argument_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["data", "mnist", ""]) == 2
    assert "dls data: an argument is empty" in one_line(capsys.readouterr().err)
    assert main(["init", "mlp_fp16_dls", ""]) == 2
    assert "DIR is empty" in one_line(capsys.readouterr().err)
    for command in (["demo", "--steps", "1"], ["audit", str(ROOT / "configs" / "mlp_fp16_dls.yaml")]):
        assert main([*command, "--out", ""]) == 2
        assert "--out is empty" in one_line(capsys.readouterr().err)
    assert main(["train", str(ROOT / "configs" / "mlp_fp16_dls.yaml"), "--resume", ""]) == 2
    assert "--resume is empty" in one_line(capsys.readouterr().err)
    assert os.listdir(tmp_path) == []  # nothing written into the current directory


def test_out_of_memory_in_dls_data_names_its_own_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """C8: `dls data gpt DIR --train 1000000000000` runs out of memory in NumPy (simulated here: a machine that
    overcommits memory would try); the advice names dls data's options, not a config key."""
    from dls.train.modelzoo import data as modelzoo

    @functools.wraps(modelzoo.write_tiny_data)  # its signature: dls data's defaults come from it
    def write(**kwargs: Any) -> list[Path]:
        assert kwargs["train_samples"] == 10**12
        raise MemoryError("Unable to allocate 7.28 TiB for an array with shape (1000000000000,) and data type int64")

    monkeypatch.setattr(modelzoo, "write_tiny_data", write)
    assert main(["data", "gpt", str(tmp_path / "d"), "--train", str(10**12)]) == 3
    err = one_line(capsys.readouterr().err)
    assert err.startswith("dls: error: out of memory: Unable to allocate 7.28 TiB") and "lower --train" in err
    assert "data.num_samples" not in err and "--resume" not in err


def test_a_full_disk_in_dls_data_gives_its_own_advice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not the trainer's (another runconfig.model_dir, then --resume): dls data has neither."""
    from dls.train.modelzoo import data as modelzoo

    @functools.wraps(modelzoo.write_tiny_data)
    def write(**kwargs: Any) -> list[Path]:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "d" / "train.h5"))

    monkeypatch.setattr(modelzoo, "write_tiny_data", write)
    assert main(["data", "gpt", str(tmp_path / "d")]) == 3
    err = one_line(capsys.readouterr().err)
    assert err == f"dls: error: {tmp_path / 'd' / 'train.h5'}: No space left on device (free some space or write to " \
        "another DIR)\n"  # fmt: skip


@pytest.mark.parametrize("existing", [False, True])
def test_a_full_disk_while_taking_the_lock_names_the_lock_file_and_leaves_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], existing: bool
) -> None:
    """C8: the lock's record cannot be written (ENOSPC): exit 3 naming the path; no empty .dls.lock is left, and a
    model_dir the run created is removed again."""
    run = tmp_path / "run"
    if existing:
        run.mkdir()
    config = write_config(tmp_path / "c.yaml", tiny(run))

    def no_space(*args: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwrite", no_space)
    assert main(["train", config, "--no_progress"]) == 3
    monkeypatch.undo()
    err = one_line(capsys.readouterr().err)
    assert err.startswith(f"dls: error: {run / rundir.LOCK_FILE}: No space left on device")
    assert (os.listdir(run) == []) if existing else not run.exists()


def test_dls_audit_steps_has_an_upper_bound(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """C9: --steps runs that many passes per format; a number no audit needs is refused before anything runs."""
    from dls.train.cli import MAX_AUDIT_STEPS

    config = str(ROOT / "configs" / "mlp_fp16_dls.yaml")
    for steps in (MAX_AUDIT_STEPS + 1, 10**18):
        assert main(["audit", config, "--steps", str(steps), "--out", str(tmp_path / "a")]) == 2
        assert f"--steps must be at most {MAX_AUDIT_STEPS}; got {steps}" in one_line(capsys.readouterr().err)
    assert not (tmp_path / "a").exists()


def test_dls_demo_steps_has_an_upper_bound(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dls.train.cli import MAX_DEMO_STEPS

    for steps in (MAX_DEMO_STEPS + 1, 10**18):
        assert main(["demo", "--steps", str(steps), "--out", str(tmp_path / "d"), "--no_progress"]) == 2
        assert f"--steps must be at most {MAX_DEMO_STEPS} (runs of" in one_line(capsys.readouterr().err)
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("kind", ["gpt", "mnist"])
def test_dls_data_out_of_memory_leaves_no_empty_directory(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The arrays are built before a directory is made: running out of memory (simulated at NumPy's generator)
    leaves nothing behind."""
    import numpy as np

    class NoMemory:  # a generator whose first large draw fails as NumPy's does
        def __init__(self, seed: int) -> None:
            self.rng = real(seed)

        def integers(self, *args: Any, **kwargs: Any) -> Any:
            raise MemoryError(
                "Unable to allocate 7.28 TiB for an array with shape (1000000000000,) and data type int64"
            )

        def __getattr__(self, name: str) -> Any:
            return getattr(self.rng, name)

    real = np.random.default_rng
    monkeypatch.setattr(np.random, "default_rng", NoMemory)
    assert main(["data", kind, str(tmp_path / "d"), "--train", str(10**12)]) == 3
    assert "out of memory" in one_line(capsys.readouterr().err)
    assert not (tmp_path / "d").exists()


def test_an_empty_config_path_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("train", "validate"):
        assert main([command, ""]) == 2
        assert "the config path is empty ('')" in one_line(capsys.readouterr().err)
