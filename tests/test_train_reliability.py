"""Issue 38 (reliability, round 4), the trainer's and the CLI's items: ``dls demo`` run twice, a resume whose
checkpoint's step disagrees with its name, ``dls init`` / ``dls data`` creating files exclusively, half parameters
with modules kept in float32, impossible optimizer state, and the C items (a NUL byte in a config, crafted
weights and dataloader state, two Ctrl-C while a checkpoint is written, the lock's holder, the message of an old
format, ``dls data`` bounds, ``model_dir: /`` and a dangling link)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from dls.train import checkpoint as ckpt
from dls.train.cli import main
from dls.train.demo import RUNS
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
