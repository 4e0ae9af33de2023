"""The code blocks of README.md and docs/: pytest-markdown-docs collects the Markdown files (and only those: its
``--markdown-docs`` flag would also import every ``.py`` under tests/, helper scripts included), and each block
starts in a fresh directory, as a reader's would, so that what it writes (runs/, audit.png) stays out of the
checkout."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    if file_path.suffix != ".md" or parent.config.option.markdowndocs:  # with the flag, the plugin collects them
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
