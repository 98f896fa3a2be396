"""The README stays short, its Python examples run, and every relative link in it and in docs/
points at something that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
MAX_README_LINES = 250
NO_TEST = "<!-- no-test -->"

# ```python ... ``` with the line right above it (to see a `<!-- no-test -->` mark).
PYTHON_BLOCK = re.compile(r"(?:^|\n)([^\n]*)\n```python\n(.*?)\n```", re.S)
# [text](target) and ![alt](target); the target ends at whitespace or the closing bracket.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"```.*?```", re.S)


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(line number, code) of each ```python block not marked `<!-- no-test -->`."""
    blocks = []
    for m in PYTHON_BLOCK.finditer(text):
        if m.group(1).strip() == NO_TEST:
            continue
        line = text.count("\n", 0, m.start(2)) + 1
        blocks.append((line, m.group(2)))
    return blocks


def relative_links(text: str) -> list[str]:
    """Link targets outside code blocks that are neither URLs nor in-page anchors."""
    prose = FENCE.sub("", text)
    prose = re.sub(r"`[^`\n]*`", "", prose)  # inline code is not a link
    return [t for t in LINK.findall(prose) if not re.match(r"[a-z][a-z0-9+.-]*:|#", t)]


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def test_readme_is_at_most_250_lines():
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines; move detail to docs/"


def test_readme_has_the_examples():
    assert len(python_blocks(README.read_text())) >= 3


@pytest.mark.parametrize("line,code", python_blocks(README.read_text()), ids=lambda x: str(x)[:12])
def test_readme_python_block_runs(line, code):
    # Line numbers in a traceback point into README.md.
    exec(compile("\n" * (line - 1) + code, str(README), "exec"), {"__name__": "readme"})


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page):
    broken = []
    for target in relative_links(page.read_text()):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page.name}: broken links {broken}"


def test_pages_link_something():
    # The link pattern must see links at all, or the check above would pass vacuously.
    assert len(relative_links(README.read_text())) >= 8
    for page in PAGES[1:]:
        assert relative_links(page.read_text()), f"{page.name} links nothing"


def test_link_checker_catches_a_broken_link(tmp_path):
    text = "[ok](README.md) [gone](no/such/file.md) [web](https://example.org) `[x](y)`"
    assert relative_links(text) == ["README.md", "no/such/file.md"]
    assert slug("Byte-level LMs (`structattn lm`)") == "byte-level-lms-structattn-lm"


def test_no_test_mark_skips_a_block():
    text = "a\n```python\nx = 1\n```\n<!-- no-test -->\n```python\nraise SystemExit\n```\n"
    assert python_blocks(text) == [(3, "x = 1")]


def test_readme_names_the_two_commands_and_makefile_has_them():
    text = README.read_text()
    assert "make reproduce" in text and "make test" in text
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^reproduce:", makefile, flags=re.M)
    assert re.search(r"^test:", makefile, flags=re.M)
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_readme_make_targets_exist():
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][\w-]*):", makefile, flags=re.M))
    named = set(re.findall(r"`make ([a-z][\w-]*)", README.read_text()))
    assert named and named <= targets, f"README names missing targets {named - targets}"


def test_make_clean_keeps_committed_results():
    clean = re.search(r"^clean:.*\n((?:\t.*\n?)+)", (ROOT / "Makefile").read_text(), re.M)
    assert clean
    for word in clean.group(1).split():
        assert word.rstrip("/") != "results", "make clean must not delete results/"
