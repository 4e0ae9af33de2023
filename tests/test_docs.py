"""The documentation: README.md's size and links, the `dls` commands of every page, the API reference's coverage.

Python code blocks run through pytest-markdown-docs (collected by the root conftest.py). Here, the ``sh`` blocks
of every page run in reading order, as a reader would type them, in one fresh directory holding only ``configs/``
(a clone's root after ``make demo`` and ``source .venv/bin/activate``). A block that cannot run here (make, pip,
torchrun) is fenced ``sh notest`` (``{.sh notest}`` under docs/, for mkdocs) and says why.
"""

from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

import pytest

import dls
from dls.train.cli import main

ROOT = Path(__file__).resolve().parents[1]
# The reading order: README.md, the home page, getting started, then the rest.
PAGES = [ROOT / "README.md", ROOT / "docs" / "index.md", ROOT / "docs" / "getting-started.md"]
PAGES += sorted(set((ROOT / "docs").rglob("*.md")) - set(PAGES))
FENCE = re.compile(r"^```(?P<info>[^\n]*)\n(?P<body>.*?)^```\s*$", re.MULTILINE | re.DOTALL)


def fence_words(info: str) -> list[str]:
    """``sh notest`` and ``{.sh notest}`` both give ``["sh", "notest"]``."""
    return [word.lstrip(".") for word in info.strip().strip("{}").split()]


def commands(page: Path) -> list[str]:
    """The commands of ``page``'s runnable shell blocks, in order (continuation lines joined, comments dropped)."""
    found = []
    for block in FENCE.finditer(page.read_text()):
        words = fence_words(block["info"])
        if not words or words[0] not in ("sh", "bash", "console") or "notest" in words:
            continue
        for line in block["body"].replace("\\\n", " ").splitlines():
            command = shlex.join(shlex.split(line, comments=True))
            if command:
                found.append(command)
    return found


def test_readme_is_short_and_its_links_exist() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert any(link.startswith("docs/") for link in local)
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


def test_shell_commands_run_as_written_in_reading_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every page's commands, README.md first, in one directory: a page may not collide with an earlier one."""
    (tmp_path / "configs").symlink_to(ROOT / "configs", target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    ran = 0
    for page in PAGES:
        for command in commands(page):
            program, *argv = shlex.split(command)
            assert program == "dls", f"{page.name}: {command!r} is not a dls command: fence its block as notest"
            status = main(argv)
            out, err = capsys.readouterr()
            assert status == 0, f"{page.name}: {command!r} exited {status}:\n{err}"
            lines = (out + err).splitlines()
            warnings = [line for line in lines if line.lower().startswith(("warning", "# warning"))]
            assert not warnings, f"{page.name}: {command!r} warned: {warnings}"
            ran += 1
    assert ran >= 10


def test_api_reference_covers_every_public_name(tmp_path: Path) -> None:
    mkdocs_config = pytest.importorskip("mkdocs.config")
    from mkdocs.commands.build import build

    config = mkdocs_config.load_config(str(ROOT / "mkdocs.yml"), site_dir=str(tmp_path))
    build(config)
    html = "".join(p.read_text() for p in (tmp_path / "reference").rglob("*.html"))
    anchors = set(re.findall(r'id="(dls[\w.]*)"', html))
    missing = []
    for module_name in ["dls", "dls.fp8", "dls.diagnostics", "dls.integrations"]:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            value = getattr(module, name)
            if isinstance(value, type(dls)):
                documented = (ROOT / "docs" / "reference" / f"{value.__name__.removeprefix('dls.')}.md").exists()
                documented = documented or value.__name__ in anchors
            else:
                canonical = f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', name)}"
                documented = f"{module_name}.{name}" in anchors or canonical in anchors
            if not documented:
                missing.append(f"{module_name}.{name}")
    assert not missing, f"not in the API reference: {missing}"
