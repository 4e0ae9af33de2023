"""What the ``dls`` command prints to a newcomer: its help, ``dls keys``, ``dls init``'s list (with the extras each
config really needs), and the error for a config path that does not exist."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dls.train.cli import EXTRA_OF, build_parser, config_imports, main, shipped_configs

ROOT = Path(__file__).resolve().parents[1]


def test_the_help_starts_a_newcomer_with_dls_init_and_fits_a_pipe(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "dls init" in out and "dls demo" in out
    commands = out[out.index("COMMAND\n") : out.index("options:")].splitlines()[1:]
    # one line per command: none wrapped onto a second line (argparse wraps at 80 columns when not a terminal)
    names = [line.split()[0] for line in commands if line.strip()]
    assert names == list(next(a for a in build_parser()._actions if a.dest == "command").choices)


def test_dls_keys_lists_every_key_within_100_columns(capsys: pytest.CaptureFixture[str]) -> None:
    from dls.train.config import SECTION_CLASSES

    assert main(["keys"]) == 0
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) <= 100
    listed = {line.split()[0] for line in out.splitlines() if line.startswith("  ") and not line.startswith("   ")}
    assert listed == {key for cls in SECTION_CLASSES.values() for key in cls.model_fields}


def test_a_mistyped_config_path_gets_the_nearest_file_and_dls_init(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(ROOT)
    for command in ("train", "validate", "audit"):
        assert main([command, "configs/mlp_fp16_dsl.yaml"]) == 2
        err = capsys.readouterr().err
        assert "no config file configs/mlp_fp16_dsl.yaml" in err and "did you mean configs/mlp_fp16_dls.yaml?" in err
    monkeypatch.chdir(tmp_path)  # a wheel's user: no configs/ here
    assert main(["train", "configs/mlp_fp16_dls.yaml"]) == 2
    assert "`dls init mlp_fp16_dls DIR` copies it into DIR" in capsys.readouterr().err


def test_dls_init_lists_each_config_with_a_whole_sentence(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["init"]) == 0
    out = capsys.readouterr().out
    entries = out.split("\n\n")[1:]
    assert len(entries) == len(shipped_configs())
    for entry in entries:
        head, *text = entry.strip("\n").splitlines()
        assert head.startswith("  ") and "(needs dls[train" in head
        assert max(map(len, text)) <= 100 and " ".join(line.strip() for line in text).endswith(".")


# Runs in a fresh interpreter: blocks the imports of the extras a config is not listed as needing, copies the config
# out with dls init, trains it one step, and reports which extras' modules were imported.
PROBE = r"""
import json, sys
for name in filter(None, sys.argv[1].split(",")):
    sys.modules[name] = None  # as if not installed: import raises ModuleNotFoundError, find_spec says None
from dls.train.cli import EXTRA_OF, main
status = main(["init", sys.argv[2], "copy"])
if status == 0:
    status = main(["train", sys.argv[3], "--no_progress", "-o", *sys.argv[4:]])
print(json.dumps({"status": status, "imported": sorted(m for m in EXTRA_OF if sys.modules.get(m) is not None)}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(shipped_configs()))
def test_dls_init_lists_the_extras_a_config_really_imports(name: str, tmp_path: Path) -> None:
    pytest.importorskip("h5py")
    pytest.importorskip("transformers")
    text = shipped_configs()[name].read_text()
    needed = config_imports(text)
    prefix = "trainer.init.loop." if "\ntrainer:" in f"\n{text}" else "runconfig."
    where = "trainer.init." if prefix.startswith("trainer") else "runconfig."
    overrides = [f"{prefix}max_steps=1", f"{where}model_dir=run", f"{where}num_threads=1"]
    copy = f"copy/{name.rsplit('/', 1)[-1]}.yaml"
    blocked = ",".join(sorted(set(EXTRA_OF) - needed))
    run = subprocess.run(
        [sys.executable, "-c", PROBE, blocked, name, copy, *overrides],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["status"] == 0, run.stderr[-2000:]  # trains without the extras it is not listed as needing
    assert set(result["imported"]) == needed  # and imports every one it is listed as needing


def test_the_run_summary_keeps_paths_whole_when_not_on_a_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = tmp_path / ("a-directory-name-long-enough-to-overflow-a-table-cell" * 2) / "run"
    overrides = ["runconfig.max_steps=2", f"runconfig.model_dir={model_dir}"]
    assert main(["train", str(ROOT / "configs" / "mlp_fp16_dls.yaml"), "--no_progress", "-o", *overrides]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.split() == ["checkpoint", str(model_dir / "checkpoint_2.mdl")] for line in lines)
    assert any(line.split() == ["metrics", str(model_dir / "metrics.jsonl")] for line in lines)
