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


# Runs in a fresh interpreter: makes the extras' modules that the given configs are not listed as needing impossible to
# import, copies each config out with dls init, trains it one step, and reports which extras' modules were imported.
PROBE = r"""
import json, sys
blocked, runs = json.loads(sys.argv[1]), json.loads(sys.argv[2])
for name in blocked:
    sys.modules[name] = None  # as if not installed: import raises ModuleNotFoundError, find_spec says None
from dls.train.cli import EXTRA_OF, main
for i, (name, copy, overrides) in enumerate(runs):
    status = main(["init", name, f"copy{i}"]) or main(["train", f"copy{i}/{copy}", "--no_progress", "-o", *overrides])
    print(json.dumps({"name": name, "status": status}))
print(json.dumps({"imported": sorted(m for m in EXTRA_OF if sys.modules.get(m) is not None)}))
"""


def _needs() -> dict[tuple[str, ...], list[str]]:
    """The shipped configs grouped by the modules beyond the train extra each is listed as needing."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for name, path in shipped_configs().items():
        groups.setdefault(tuple(sorted(config_imports(path.read_text()))), []).append(name)
    return groups


@pytest.mark.slow
@pytest.mark.parametrize("needed", sorted(_needs()), ids=lambda needed: "+".join(needed) or "train-alone")
def test_dls_init_lists_the_extras_each_config_really_imports(needed: tuple[str, ...], tmp_path: Path) -> None:
    """Every config of a group trains one step with the other extras missing, and imports each one it needs."""
    pytest.importorskip("h5py")
    pytest.importorskip("transformers")
    runs = []
    for name in _needs()[needed]:
        current = "\ntrainer:" in "\n" + shipped_configs()[name].read_text()
        loop, run = ("trainer.init.loop.", "trainer.init.") if current else ("runconfig.", "runconfig.")
        overrides = [f"{loop}max_steps=1", f"{run}model_dir=run-{len(runs)}", f"{run}num_threads=1"]
        runs.append((name, name.rsplit("/", 1)[-1] + ".yaml", overrides))
    blocked = sorted(set(EXTRA_OF) - set(needed))
    argv = [sys.executable, "-c", PROBE, json.dumps(blocked), json.dumps(runs)]
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    *statuses, imported = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"')]
    assert [s["status"] for s in statuses] == [0] * len(runs), done.stderr[-2000:]  # no other extra needed
    assert imported["imported"] == sorted(needed)  # and each listed one is imported
