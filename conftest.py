"""Code blocks of README.md and docs/ (run by pytest-markdown-docs) start in a fresh directory, as a reader's would,
so that what they write (runs/, audit.png) never lands in the checkout."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _code_blocks_run_in_a_fresh_directory(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    if request.node.get_closest_marker("markdown-docs") is not None:
        monkeypatch.chdir(tmp_path_factory.mktemp("code_block"))
    yield
