"""mkdocs hook: the parts of pages that are generated, not written. A page marks each with an HTML comment,
``<!-- generated: NAME -->``, replaced by what ``GENERATORS[NAME]`` returns (Markdown) when the site is built; an
unknown name fails the build. The generators live in the package (``dls.train.reference``) or beside this file
(``figures.py``: the pictures and the tables printed with them)."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import figures  # beside this file

from dls.train.cli import commands_markdown
from dls.train.reference import config_keys_markdown

GENERATORS: dict[str, Callable[[Any], str]] = {
    "config-keys": lambda page: config_keys_markdown(),
    "commands": lambda page: commands_markdown(),
    **figures.GENERATORS,
}
MARK = re.compile(r"<!-- generated: ([\w-]+) -->")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """``markdown`` with each ``<!-- generated: NAME -->`` replaced."""

    def replace(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in GENERATORS:
            raise KeyError(f"{page.file.src_path}: no generator {name!r}; known: {', '.join(GENERATORS)}")
        return GENERATORS[name](page)

    return MARK.sub(replace, markdown)


def on_files(files: Any, config: Any) -> Any:
    """The generated pictures join the site's files (made first, or taken from the cache)."""
    for file in figures.files(config):
        files.append(file)
    return files
