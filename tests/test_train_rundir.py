"""The run directory: one run at a time (a lock naming its holder, stale locks of killed runs taken over), no write
through a symbolic link planted in it, inputs never overwritten, an unreadable metrics file kept as it is."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from dls.train import checkpoint as ckpt
from dls.train import rundir
from dls.train.cli import main
from dls.train.errors import ModelDirError
from dls.train.rundir import LOCK_FILE, RunDir
from test_train import make_trainer, metrics, tiny


def small(model_dir: Path, steps: int = 2) -> dict[str, Any]:
    return tiny(model_dir, runconfig={"max_steps": steps, "checkpoint_steps": 2})


def write_config(path: Path, raw: dict[str, Any]) -> str:
    path.write_text(yaml.safe_dump(raw))
    return str(path)


# ---------------------------------------------------------------------- the lock
def test_a_second_run_on_a_locked_model_dir_exits_2_naming_the_holder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    config = write_config(tmp_path / "c.yaml", small(run))
    with RunDir(run):  # another run's lock (flock locks conflict between open files, even in one process)
        assert main(["train", config, "--no_progress"]) == 2
        err = capsys.readouterr().err
        assert f"is in use by another dls run: pid {os.getpid()} on host {socket.gethostname()}" in err
        assert sorted(os.listdir(run)) == [LOCK_FILE]  # nothing written
        with pytest.raises(ModelDirError, match="in use"):
            make_trainer(small(run))[0].train()
    assert main(["train", config, "--no_progress"]) == 0
    assert LOCK_FILE not in os.listdir(run)  # released and removed


def test_a_lock_held_by_another_process_then_left_by_its_kill(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run in another process holds model_dir; once killed (SIGKILL: no clean-up), its lock file is stale and the
    next run takes it over and resumes."""
    run = tmp_path / "run"
    raw = tiny(run, runconfig={"max_steps": 100_000, "checkpoint_steps": 5, "log_steps": 1})
    config = write_config(tmp_path / "c.yaml", raw)
    script = "import sys; from dls.train.cli import main; sys.exit(main(sys.argv[1:]))"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", script, "train", config, "--no_progress"], env=env)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(rundir.list_checkpoints(run)) < 1:
            time.sleep(0.05)
        assert main(["train", config, "--no_progress", "--resume", str(run)]) == 2
        assert f"in use by another dls run: pid {proc.pid} on host" in capsys.readouterr().err
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    assert (run / LOCK_FILE).exists()  # left behind by the killed run
    code = main(["train", config, "--no_progress", "--resume", str(run), "-o", "runconfig.max_steps=1"])
    assert code == 0
    assert f"Taking over the lock of pid {proc.pid}" in capsys.readouterr().out
    assert not (run / LOCK_FILE).exists()


# ---------------------------------------------------------------------- symbolic links
def test_links_planted_in_model_dir_are_replaced_never_written_through(tmp_path: Path) -> None:
    """A resumed run replaces links planted under the names it writes (a fresh run refuses them: see
    test_cli_reliability's earlier-run tests)."""
    run, outside = tmp_path / "run", tmp_path / "outside"
    make_trainer(small(run))[0].train()
    outside.mkdir()
    stale = [".checkpoint_2.mdl.tmp", ".metrics.jsonl.0123456789ab.tmp"]  # temporary names of a killed run
    names = ["plots.png", "config.yaml", "metrics.jsonl", "metrics.jsonl.tmp", *stale]
    for i, name in enumerate(names):
        (outside / f"target{i}").write_text(f"precious {i}\n")
        with contextlib.suppress(FileNotFoundError):
            (run / name).unlink()
        (run / name).symlink_to(outside / f"target{i}")
    trainer = make_trainer(small(run, 4))[0]
    trainer.write_plot = True
    trainer.train(resume=run)
    for i, name in enumerate(names):
        assert (outside / f"target{i}").read_text() == f"precious {i}\n", name
    for name in ("plots.png", "config.yaml", "metrics.jsonl", "checkpoint_4.mdl"):
        assert (run / name).is_file() and not (run / name).is_symlink(), name
    assert [r["step"] for r in metrics(run)] == [3, 4]  # the rows of a link are not read
    assert not any(os.path.lexists(run / name) for name in stale)  # removed (the links, not their targets)


def test_a_lock_file_that_is_a_link_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run, target = tmp_path / "run", tmp_path / "target"
    run.mkdir()
    target.write_text("precious\n")
    (run / LOCK_FILE).symlink_to(target)
    assert main(["train", write_config(tmp_path / "c.yaml", small(run)), "--no_progress"]) == 2
    assert "is a symbolic link" in capsys.readouterr().err
    assert target.read_text() == "precious\n" and sorted(os.listdir(run)) == [LOCK_FILE]


def test_a_symlinked_parent_directory_is_fine(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "runs").symlink_to(tmp_path / "real")
    result = make_trainer(small(tmp_path / "runs" / "run"))[0].train()
    assert result.model_dir == tmp_path / "real" / "run"  # resolved once
    assert (tmp_path / "real" / "run" / "checkpoint_2.mdl").is_file()


# ---------------------------------------------------------------------- inputs and existing outputs
def test_the_input_config_inside_model_dir_is_not_overwritten(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "config.yaml"
    raw = small(tmp_path / "ignored")
    raw["runconfig"]["model_dir"] = "."
    text = "# my experiment: keep this comment\n" + yaml.safe_dump(raw)
    config.write_text(text)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert main(["train", str(config), "--no_progress"]) == 0
    finally:
        os.chdir(cwd)
    assert config.read_text() == text
    assert "is the input config: left as it is" in capsys.readouterr().out
    assert (tmp_path / "checkpoint_2.mdl").exists()


@pytest.mark.parametrize(
    "garbage", [b"not json\n", b"\xff\xfe\x00binary\n", b"[1, 2]\n"], ids=["text", "bytes", "list"]
)
def test_an_unreadable_metrics_file_is_kept_and_the_resume_refused(
    tmp_path: Path, garbage: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    make_trainer(small(run))[0].train()
    lines = (run / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    corrupt = lines[0] + garbage + b"".join(lines[1:])
    (run / "metrics.jsonl").write_bytes(corrupt)
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    assert main(["train", "--resume", str(run), "--no_progress", "-o", "runconfig.max_steps=4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"{run / 'metrics.jsonl'} line 2 is not a metrics row" in err
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before


def test_a_last_metrics_line_cut_by_a_kill_is_dropped(tmp_path: Path) -> None:
    run = tmp_path / "run"
    make_trainer(small(run))[0].train()
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 3, "lo')  # the run died while writing step 3's row
    raw = small(run, steps=3)
    make_trainer(raw)[0].train(resume=run)
    assert [r["step"] for r in metrics(run)] == [1, 2, 3]


# ---------------------------------------------------------------------- a kill between write and rename
@pytest.mark.parametrize(
    "states",
    [None, ("model", "optimizer", "dataloader", "lr_scheduler", "global_step", "rng")],
    ids=["full resume", "partial-state resume"],
)
def test_kill_between_writing_and_renaming_a_checkpoint_leaves_the_run_resumable(
    tmp_path: Path, states: tuple[str, ...] | None
) -> None:
    """A resume (a plain one, or Model Zoo's in-place load of every state but grad_scaler) killed after writing a
    checkpoint (complete and fsync-ed) but before renaming it: the previous checkpoint stays the latest, the run
    continues from it, and the next save cleans the temporary file and the dead run's lock."""
    run = tmp_path / "run"
    raw = tiny(run, runconfig={"max_steps": 3, "checkpoint_steps": 3})
    make_trainer(raw)[0].train()
    script = textwrap.dedent(
        f"""
        import os, signal, torch
        from dls.train.config import parse_config
        from dls.train import Trainer
        torch.set_num_threads(1)
        raw = {raw!r}
        raw["runconfig"]["max_steps"] = 6
        raw["optimizer"]["initial_loss_scale"] = 2.0 ** 10
        real_replace = os.replace
        def replace(src, dst, *args, **kwargs):
            if os.path.basename(str(src)).startswith(".checkpoint_"):
                os.kill(os.getpid(), signal.SIGKILL)
            return real_replace(src, dst, *args, **kwargs)
        os.replace = replace
        trainer = Trainer(parse_config(raw), progress=False, summary=False, plot=False)
        trainer.train(resume={str(run)!r}, load_states={states!r})
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    names = os.listdir(run)
    assert any(n.startswith(".checkpoint_") and n.endswith(".tmp") for n in names) and LOCK_FILE in names
    assert ckpt.load_resume_checkpoint(run)[0].name == "checkpoint_3.mdl"
    assert ckpt.load_checkpoint(ckpt.load_resume_checkpoint(run)[0])["global_step"] == 3
    raw["runconfig"]["max_steps"] = 4
    result = make_trainer(raw)[0].train(resume=run, load_states=states)
    assert result.global_step == 4
    assert not [n for n in os.listdir(run) if n.endswith(".tmp") or n == LOCK_FILE]
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4]


# ---------------------------------------------------------------------- an earlier run's files (issue 30 A2)
def tree(directory: Path) -> dict[str, Any]:
    """Each entry's bytes (a directory's tree; a link: where it points)."""
    return {
        p.name: os.readlink(p) if p.is_symlink() else p.read_bytes() if p.is_file() else tree(p)
        for p in sorted(directory.iterdir())
    }


EARLIER = {  # what a run killed before its first checkpoint leaves, or a user's own files under dls's names
    "config.yaml": lambda run: (run / "config.yaml").write_text("mine: true\n"),
    "metrics.jsonl": lambda run: (run / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n'),
    "plots.png": lambda run: (run / "plots.png").write_bytes(b"\x89PNG mine"),
    "tensorboard": lambda run: (run / "tensorboard").mkdir(),
    "a link": lambda run: (run / "metrics.jsonl").symlink_to(run.parent / "elsewhere"),
}


@pytest.mark.parametrize("earlier", list(EARLIER))
def test_a_fresh_run_refuses_an_earlier_runs_files_naming_them_and_the_ways_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], earlier: str
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    EARLIER[earlier](run)
    before = tree(run)
    assert main(["train", write_config(tmp_path / "c.yaml", small(run)), "--no_progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"runconfig.model_dir {run} holds {os.listdir(run)[0]} of an earlier run" in err
    assert "-o runconfig.model_dir=NEW_DIR" in err and "--overwrite" in err and "nothing is deleted" in err
    assert tree(run) == before  # no lock file left, nothing replaced


def test_overwrite_renames_every_earlier_file_and_deletes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    config = write_config(tmp_path / "c.yaml", small(run))
    assert main(["train", config, "--no_progress"]) == 0
    (run / "tensorboard").mkdir()
    (run / "notes.txt").write_text("a user's own file: not dls's, left where it is\n")
    before = tree(run)
    assert main(["train", config, "--no_progress"]) == 2  # checkpoints: resume, another model_dir, or --overwrite
    assert "--overwrite" in capsys.readouterr().err and tree(run) == before
    assert main(["train", config, "--no_progress", "--overwrite"]) == 0
    out = capsys.readouterr().out
    after = tree(run)
    moved = {name: after[name] for name in after if ".old-" in name}
    assert sorted(name.split(".old-")[0] for name in moved) == sorted(set(before) - {"notes.txt"})
    for name, content in moved.items():
        assert content == before[name.split(".old-")[0]] and f"Renamed {name.split('.old-')[0]} to {name}" in out
    assert after["notes.txt"] == before["notes.txt"]
    assert [r["step"] for r in metrics(run)] == [1, 2] and (run / "checkpoint_2.mdl").is_file()  # the new run's


def test_overwrite_does_not_combine_with_a_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    config = write_config(tmp_path / "c.yaml", small(run))
    assert main(["train", config, "--no_progress"]) == 0
    before = tree(run)
    assert main(["train", config, "--no_progress", "--overwrite", "--resume", str(run)]) == 2
    assert "--overwrite starts a new run without a checkpoint" in capsys.readouterr().err
    with pytest.raises(ModelDirError, match="--overwrite starts a new run"):  # a checkpoint named by the config
        make_trainer({**small(run), "runconfig": {**small(run)["runconfig"], "checkpoint_path": str(run)}})[0].train(
            overwrite=True
        )
    assert tree(run) == before


def test_overwrite_starts_over_where_autoload_would_resume(tmp_path: Path) -> None:
    run = tmp_path / "run"
    raw = small(run)
    raw["runconfig"]["autoload_last_checkpoint"] = True
    make_trainer(raw)[0].train()
    assert make_trainer(raw)[0].train(overwrite=True).global_step == 2  # from step 0 again, not resumed at 2
    assert len([name for name in os.listdir(run) if name.startswith("checkpoint_2.mdl.old-")]) == 1


def test_a_fresh_run_takes_a_model_dir_with_other_files_and_its_own_input_config(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "README").write_text("not a name dls writes\n")
    (run / "checkpoint_2.mdl.unreadable").write_bytes(b"kept aside by an earlier resume")
    make_trainer(small(run))[0].train()
    assert (run / "README").read_text() == "not a name dls writes\n" and (run / "checkpoint_2.mdl").is_file()
