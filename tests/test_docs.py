"""The documentation: README.md's size and links, the `dls` commands of every page, and the built site.

Python code blocks run through pytest-markdown-docs (collected by the root conftest.py). Here, the ``sh`` blocks
of every page run in reading order, as a reader would type them, in one fresh directory holding only ``configs/``
(a clone's root after ``make demo`` and ``source .venv/bin/activate``). A block that cannot run here (make, pip,
torchrun) is fenced ``sh notest`` (``{.sh notest}`` under docs/, for mkdocs) and the line just above it says why, in
an HTML comment that neither GitHub nor the site shows: ``<!-- notest: needs torchrun -->``.

The site is built once (``mkdocs build --strict``, with its generated pages and pictures) and its HTML read back: no
Sphinx role left as text, no list or docstring section rendered as a paragraph, no emphasis inside a word, every
public name in the API reference with its signature and an argument table for every parameter.
"""

from __future__ import annotations

import importlib
import re
import shlex
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

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


# ---------------------------------------------------------------------- the Markdown sources
NOTEST_REASON = re.compile(r"<!-- notest: (?P<why>[^>]*\S[^>]*) -->\s*$")


def notest_blocks(page: Path) -> list[tuple[int, str, str]]:
    """``(line, reason or "", first line of the block)`` for each ``notest`` block of ``page``."""
    text = page.read_text()
    found = []
    for block in FENCE.finditer(text):
        if "notest" in fence_words(block["info"]):
            before = text[: block.start()].rstrip("\n").rsplit("\n", 1)[-1]
            reason = NOTEST_REASON.match(before.strip())
            found.append((text.count("\n", 0, block.start()) + 1, reason["why"] if reason else "", block["body"]))
    return found


def test_every_notest_block_says_why_outside_the_block() -> None:
    """The reason a block is not run is an HTML comment above it: readers see the command, not notes for tests."""
    problems = []
    for page in PAGES:
        for line, reason, body in notest_blocks(page):
            if not reason:
                problems.append(f"{page.name}:{line}: no '<!-- notest: why -->' line above the block")
            if "docs tests" in body:
                problems.append(f"{page.name}:{line}: a note for the tests inside the block")
    assert not problems, "\n".join(problems)


def markdown_defects(text: str) -> list[str]:
    """What Python-Markdown (mkdocs) renders other than it reads: a nested list or a block inside a list item
    indented by fewer than 4 spaces (it flattens, or ends the list), and a list with no blank line above it."""
    found = []
    in_list = fence = False
    previous = ""
    for number, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith("```"):
            fence = not fence
        if fence or line.lstrip().startswith("```"):
            previous = line
            continue
        stripped = line.lstrip(" ")
        indent = len(line) - len(stripped)
        marker = re.match(r"([-*+]|\d+\.) ", stripped)
        opens_a_list = marker and indent == 0 and not in_list
        under_text = previous.strip() and not re.match(r"\s*([-*+]|\d+\.) |\||<!--|#", previous)
        if opens_a_list and under_text:
            found.append(f"line {number}: a list right under a paragraph (add a blank line above it)")
        if marker and 0 < indent < 4 and in_list:
            found.append(f"line {number}: a nested list item indented {indent} spaces (4 are needed)")
        if not marker and stripped and 0 < indent < 4 and in_list and not previous.strip():
            found.append(f"line {number}: a block inside a list item indented {indent} spaces (4 are needed)")
        if marker and indent == 0:
            in_list = True
        elif stripped and indent == 0 and not marker:
            in_list = False
        previous = line
    return found


def test_markdown_defects_are_found() -> None:
    assert markdown_defects("Not promised:\n- a\n- b\n")  # the list reads as the paragraph's text
    assert markdown_defects("- a\n  - nested, two spaces\n")
    assert markdown_defects("- a\n\n  | table | in the item |\n")
    assert not markdown_defects("Promised:\n\n- a\n    - nested\n\n    a paragraph of the item\n- b\n  more of b\n")


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_lists_are_written_so_that_they_render_as_lists(page: Path) -> None:
    assert not markdown_defects(page.read_text()), f"{page.name}: {markdown_defects(page.read_text())}"


# ---------------------------------------------------------------------- the built site
SPHINX_ROLE = re.compile(r":(?:py:)?(?:meth|class|func|attr|mod|data|exc|obj|ref|const|term):")
LIST_IN_TEXT = re.compile(r"\n\s*(?:[-*+]|\d+\.)\s+\S")
SECTION_IN_TEXT = re.compile(
    r"^\s*(?:Args|Arguments|Parameters|Returns|Raises|Yields|Attributes|Examples?)\b[^\n]{0,60}:\s*\n"
)


class _Blocks(HTMLParser):
    """The text of each ``<p>``, ``<li>``, ``<td>`` outside ``<pre>``, with ``<strong>``/``<em>`` kept as tags and
    inline ``<code>`` as ```...```` (a role written in code is about roles, not one)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.pre = self.code = 0
        self.open: list[list[str]] = []
        self.blocks: list[tuple[str, str]] = []

    def handle_starttag(self, tag: str, attrs: Any) -> None:
        self.pre += tag == "pre"
        if tag in ("p", "li", "td") and not self.pre:
            self.open.append([tag])
        elif tag in ("strong", "em") and self.open:
            self.open[-1].append(f"<{tag}>")
        self.code += tag == "code"

    def handle_endtag(self, tag: str) -> None:
        self.pre -= tag == "pre"
        self.code -= tag == "code"
        if tag in ("strong", "em") and self.open:
            self.open[-1].append(f"</{tag}>")
        elif tag in ("p", "li", "td") and not self.pre and self.open:
            tag, *parts = self.open.pop()
            self.blocks.append((tag, "".join(parts)))

    def handle_data(self, data: str) -> None:
        if self.open and not self.pre:
            self.open[-1].append("`code`" if self.code else data)


def html_defects(html: str) -> list[str]:
    """Markdown that did not render: a Sphinx role left as text, a list or a docstring section that became a
    paragraph, emphasis that starts or ends inside a word (``2**15, or 2**31``)."""
    parser = _Blocks()
    parser.feed(html)
    found = []
    for tag, text in parser.blocks:
        if role := SPHINX_ROLE.search(text):
            found.append(f"Sphinx role {role.group()} in <{tag}>: {text[:100]!r}")
        if tag == "p" and LIST_IN_TEXT.search(text):
            found.append(f"a list rendered as a paragraph: {text[:100]!r}")
        if tag == "p" and SECTION_IN_TEXT.search(text):
            found.append(f"a docstring section rendered as a paragraph: {text[:100]!r}")
        if stray := re.search(r"\w<(strong|em)>|</(strong|em)>\w", text):
            found.append(f"emphasis inside a word: {text[max(0, stray.start() - 30) : stray.end() + 30]!r}")
    return found


def test_html_defects_are_found() -> None:
    assert html_defects("<p>Build it with :meth:<code>cerebras</code>.</p>")
    assert html_defects("<p>Not promised:\n- a\n- b</p>")
    assert html_defects("<p>Args (both dialects):\n    loss_scale: a number</p>")
    assert html_defects("<p>max 2<strong>15, or 2</strong>31</p>")
    assert not html_defects("<p>A <strong>bold</strong> word and <code>:meth:</code> in code</p><pre>- a\n- b</pre>")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site as ``make docs-check`` builds it (strict: a warning fails), into a temporary directory."""
    mkdocs_config = pytest.importorskip("mkdocs.config")
    from mkdocs.commands.build import build

    out = tmp_path_factory.mktemp("site")
    build(mkdocs_config.load_config(str(ROOT / "mkdocs.yml"), site_dir=str(out), strict=True))
    return out


def test_the_site_has_no_markdown_left_unrendered(site: Path) -> None:
    problems = [
        f"{page.relative_to(site)}: {d}"
        for page in sorted(site.rglob("*.html"))
        for d in html_defects(page.read_text())
    ]
    assert not problems, "\n".join(problems)


def anchors(site: Path) -> list[str]:
    html = "".join(p.read_text() for p in sorted((site / "reference").rglob("*.html")))
    return list(dict.fromkeys(re.findall(r'id="(dls[\w.]*)"', html)))


def resolve(path: str) -> Any:
    """The object a dotted path names (``dls.fp8.gemm.emulate_recipe``), or ``None``."""
    parts = path.split(".")
    for split in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            value = getattr(value, name, None)
        return value
    return None


def test_api_reference_covers_every_public_name(site: Path) -> None:
    documented = {id(resolve(a)) for a in anchors(site)}
    missing = []
    for module_name in ["dls", "dls.fp8", "dls.diagnostics", "dls.integrations", "dls.formats", "dls.settings"]:
        module = importlib.import_module(module_name)
        public = getattr(module, "__all__", None) or [
            name
            for name, value in vars(module).items()
            if not name.startswith("_") and getattr(value, "__module__", None) == module_name and callable(value)
        ]
        for name in public:
            value = getattr(module, name)
            if not isinstance(value, type(dls)) and id(value) not in documented:
                missing.append(f"{module_name}.{name}")
    assert not missing, f"not in the API reference: {missing}"


def test_the_dls_page_leads_with_the_scaler_and_shows_its_signature_and_arguments(site: Path) -> None:
    html = (site / "reference" / "dls" / "index.html").read_text()
    objects = re.findall(r'<h2 id="(dls\.[\w.]+)"', html)
    assert (
        objects[:3] == ["dls.GradScaler", "dls.optimizer_step", "dls.StepResult"]
        and "dls.set_half_dtype" in objects[:5]
    )
    scaler = html[html.index('id="dls.GradScaler"') : html.index('id="dls.optimizer_step"')]
    assert scaler.count('class="doc-signature') >= 2  # both dialects' signatures (the overloads)
    table = scaler[scaler.index("Parameters:") :]
    table = table[: table.index("</table>")]
    for argument in ("loss_scale", "init_scale", "growth_interval", "steps_per_increase", "device", "half_dtype"):
        assert f"<code>{argument}</code>" in table


def test_every_rendered_function_documents_every_parameter(site: Path) -> None:
    """Each function and method on the reference pages has an Args entry per parameter (griffe parses them as
    mkdocstrings does)."""
    griffe = pytest.importorskip("griffe")
    loader = griffe.GriffeLoader(search_paths=[str(ROOT / "src")], docstring_parser=griffe.Parser.google)
    package = loader.load("dls")
    loader.resolve_aliases(implicit=True, external=False)
    problems = []
    for anchor in anchors(site):
        try:
            obj = package[anchor.removeprefix("dls.")] if anchor != "dls" else package
            obj = obj.final_target if obj.is_alias else obj
        except (KeyError, griffe.AliasResolutionError):
            continue
        if not obj.is_function:
            continue
        variadic = ("variadic positional", "variadic keyword")
        wanted = [p.name for p in obj.parameters if p.name not in ("self", "cls") and p.kind.value not in variadic]
        documented = {
            p.name
            for section in (obj.docstring.parse(griffe.Parser.google) if obj.docstring else [])
            if section.kind is griffe.DocstringSectionKind.parameters
            for p in section.value
        }
        if missing := [name for name in wanted if name not in documented]:
            problems.append(f"{anchor}: {missing}")
    assert not problems, "parameters without an Args entry:\n" + "\n".join(problems)


def test_the_config_key_reference_lists_every_key_of_the_schema(site: Path) -> None:
    from dls.train.config import SECTION_CLASSES

    html = (site / "reference" / "trainer" / "index.html").read_text()
    keys = {key for cls in SECTION_CLASSES.values() for key in cls.model_fields}
    missing = [key for key in keys if f"<code>{key}</code>" not in html]
    assert not missing, f"config keys not in the generated table: {missing}"
    assert "<code>trainer.init.precision.loss_scaling_factor</code>" in html  # the current layout's path
    assert "<code>dls train</code>" in html and "usage: dls train" in html  # the commands' help


def test_the_pictures_are_made_by_the_build_and_shown(site: Path) -> None:
    for name, page in (
        ("demo.png", "guides/trainer"),
        ("burst.png", "guides/scaler"),
        ("audit.png", "guides/diagnostics"),
    ):
        assert (site / "assets" / "generated" / name).read_bytes()[:4] == b"\x89PNG"
        assert f"assets/generated/{name}" in (site / page / "index.html").read_text()
    trainer = (site / "guides" / "trainer" / "index.html").read_text()
    assert "fp16 params, no masters" in trainer and "stopped@" in trainer  # the demo's table, as dls demo printed it
    diagnostics = (site / "guides" / "diagnostics" / "index.html").read_text()
    assert "Recommended initial loss scales" in diagnostics  # dls audit's output


def test_code_lines_fit_the_page() -> None:
    """Python and shell blocks keep to 120 characters (the sources' limit), which the site's width shows whole."""
    long = [
        f"{page.name}: {line[:60]}..."
        for page in PAGES
        for block in FENCE.finditer(page.read_text())
        if fence_words(block["info"])[:1] in (["python"], ["sh"])
        for line in block["body"].splitlines()
        if len(line) > 120
    ]
    assert not long, long
