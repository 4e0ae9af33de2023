"""The code blocks of README.md and docs/: pytest-markdown-docs collects the Markdown files (and only those: its
``--markdown-docs`` flag would also import every ``.py`` under tests/, helper scripts included), and each block
starts in a fresh directory, as a reader's would, so that what it writes (runs/, audit.png) stays out of the
checkout."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest


def pytest_addoption(parser: pytest.Parser, pluginmanager: pytest.PytestPluginManager) -> None:
    if not pluginmanager.has_plugin("pytest_markdown_docs"):
        # pyproject.toml's addopts name the plugin's option: accepted (and ignored) where the plugin is not installed,
        # as under a plain python3 with pytest alone (the GPU machine), so that the test files still run there.
        parser.addoption("--markdown-docs-syntax", help="pytest-markdown-docs's option; the plugin is not installed")


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    # With the plugin's flag the plugin collects them; without the plugin (the option is missing) nothing can.
    if file_path.suffix != ".md" or getattr(parent.config.option, "markdowndocs", True):
        return None
    from pytest_markdown_docs.plugin import MarkdownTextFile

    return MarkdownTextFile.from_parent(parent, path=file_path)  # type: ignore[no-any-return]


@pytest.fixture(autouse=True)
def _code_blocks_run_in_a_fresh_directory(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    if request.node.get_closest_marker("markdown-docs") is not None:
        monkeypatch.chdir(tmp_path_factory.mktemp("code_block"))
        # The plugin runs each block with pytest's capture suspended: a block's prints, progress bars and log lines
        # would land in `pytest -q`'s output. Keep capturing, as for any test (shown when the block fails).
        capture = request.config.pluginmanager.getplugin("capturemanager")
        monkeypatch.setattr(capture, "global_and_fixture_disabled", contextlib.nullcontext)
    yield
