"""``dls init``: the shipped configs, copying one out (with Model Zoo data), and the wheel carrying them."""

from __future__ import annotations

import shutil
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest

from dls.train.cli import main, shipped_configs

ROOT = Path(__file__).resolve().parents[1]


def test_lists_every_config_in_the_repository_with_its_extras(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["init"]) == 0
    out = capsys.readouterr().out
    in_repo = sorted(p.relative_to(ROOT / "configs").with_suffix("").as_posix() for p in ROOT.glob("configs/**/*.yaml"))
    assert in_repo and sorted(shipped_configs()) == in_repo
    for name in in_repo:
        assert f"  {name} " in out
    assert "dls[train]" in out


def test_copies_a_config_that_trains_as_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["init", "mlp_fp16_dls", str(tmp_path / "new")]) == 0
    copy = tmp_path / "new" / "mlp_fp16_dls.yaml"
    assert copy.read_bytes() == (ROOT / "configs" / "mlp_fp16_dls.yaml").read_bytes()
    assert f"dls train {copy}" in capsys.readouterr().out
    assert main(["validate", str(copy)]) == 0


def test_refuses_to_overwrite_and_unknown_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "mlp_fp16_dls.yaml").write_text("mine")
    assert main(["init", "mlp_fp16_dls", str(tmp_path)]) == 2
    assert (tmp_path / "mlp_fp16_dls.yaml").read_text() == "mine"
    assert "exists" in capsys.readouterr().err
    assert main(["init", "no_such_config", str(tmp_path)]) == 2
    assert "mlp_fp16_dls" in capsys.readouterr().err  # the message lists what is shipped
    assert main(["init", "mlp_fp16_dls"]) == 2
    assert "DIR" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["modelzoo/fc_mnist", "modelzoo/cerebras_gpt", "modelzoo/llama"])
def test_a_modelzoo_config_is_copied_with_its_data_and_validates(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("h5py")
    monkeypatch.chdir(tmp_path)
    assert main(["init", name, "new"]) == 0
    needs = "dls[train]" if name == "modelzoo/fc_mnist" else "dls[train,modelzoo]"  # fc_mnist: torch and numpy only
    assert f"(needs {needs})" in capsys.readouterr().out
    config = Path("new") / (name.split("/")[1] + ".yaml")
    data_dirs = [line for line in config.read_text().splitlines() if "data_dir:" in line and "#" not in line]
    assert data_dirs and all(str(Path("new") / "data") in line for line in data_dirs)  # at the data just written
    assert main(["validate", str(config)]) == 0
    assert "on this machine" not in capsys.readouterr().out  # the data is there, in the expected layout


def test_the_copied_fc_mnist_trains(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["init", "modelzoo/fc_mnist", "new"]) == 0
    overrides = ["runconfig.max_steps=3", "runconfig.model_dir=run", "runconfig.checkpoint_steps=3"]
    assert main(["train", "new/fc_mnist.yaml", "--no_progress", "-o", *overrides]) == 0
    assert (tmp_path / "run" / "checkpoint_3.mdl").is_file()


def test_without_a_data_writer_nothing_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "dls.train.modelzoo", types.ModuleType("dls.train.modelzoo"))
    assert main(["init", "modelzoo/fc_mnist", str(tmp_path / "other")]) == 2
    assert "write_tiny_data is missing" in capsys.readouterr().err
    assert not (tmp_path / "other").exists()  # nothing written before the error


def test_without_h5py_nothing_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "h5py", None)  # import h5py fails
    assert main(["init", "modelzoo/cerebras_gpt", str(tmp_path / "other")]) == 2
    assert "pip install 'dls[modelzoo]'" in capsys.readouterr().err
    assert not (tmp_path / "other").exists()  # checked before anything is written, the directory included


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git to list the tracked files")
def test_wheel_carries_the_configs(tmp_path: Path) -> None:
    pytest.importorskip("setuptools")  # the dev extra installs it: the build runs without network
    tree = tmp_path / "tree"
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for name in tracked.split():
        if name.startswith(("src/", "configs/")) or name in ("pyproject.toml", "README.md", "LICENSE"):
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / name, tree / name, follow_symlinks=False)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), "."],
        cwd=tree,
        check=True,
    )
    (wheel,) = tmp_path.glob("dls-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for config in ROOT.glob("configs/**/*.yaml"):
        assert f"dls/train/configs/{config.relative_to(ROOT / 'configs').as_posix()}" in names
