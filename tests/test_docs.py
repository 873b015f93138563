"""The README and docs/ hold together: every relative link points at a file that exists, every `#anchor` at a
heading of its target (GitHub's slugs), the README stays a front door (under 250 lines), and no user document reads
like a lab notebook (issue numbers, work sessions, who was lent what).

Knows Markdown's fenced code blocks, inline code spans, ATX headings and inline links. Does not know reference-style
links, HTML anchors or setext headings (the docs use none), and never fetches a URL."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250
# NOTE: history belongs in git; a user's docs say what is, with a date where a figure needs one
NOTEBOOK_WORDS = re.compile(r"\bissues? \d+|\bsessions?\b|\blent\b", re.IGNORECASE)
LINK = re.compile(r"\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def documents() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def prose_lines(text: str) -> list[tuple[int, str]]:
    """The lines outside fenced code blocks, numbered from 1."""
    lines, fence = [], None
    for number, line in enumerate(text.split("\n"), 1):
        marker = re.match(r"^\s*(`{3,}|~{3,})", line)
        if marker and (fence is None or marker.group(1)[0] == fence[0] and len(marker.group(1)) >= len(fence)):
            fence = None if fence else marker.group(1)
            continue
        if fence is None:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: markup dropped, lowercase, punctuation other than '-' and '_' dropped,
    each space a '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a Markdown file, repeated headings numbered as GitHub numbers them (-1, -2)."""
    found, seen = set(), Counter()
    for _, line in prose_lines(path.read_text()):
        heading = HEADING.match(line)
        if heading:
            base = slug(heading.group(2))
            found.add(base if seen[base] == 0 else f"{base}-{seen[base]}")
            seen[base] += 1
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every inline link in a file's prose; code spans and code blocks are not prose."""
    return [(number, match.group(2)) for number, line in prose_lines(path.read_text())
            for match in LINK.finditer(CODE_SPAN.sub("", line))]


def broken_links(path: Path, root: Path = REPO) -> list[str]:
    """Each link of a file that points at no file, or at no heading of a Markdown file, named with its line."""
    broken = []
    for number, target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ... are not checked
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(root)}:{number}: {target}"
        if not linked.exists():
            broken.append(f"{where} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{where} (no heading with that anchor in {linked.relative_to(root)})")
        elif anchor and linked.suffix != ".md":
            broken.append(f"{where} (an anchor into a file that is not Markdown)")
    return broken


@pytest.mark.parametrize("path", documents(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_points_at_a_file_and_a_heading(path: Path) -> None:
    assert broken_links(path) == []


def test_the_readme_is_a_front_door() -> None:
    assert len((REPO / "README.md").read_text().split("\n")) < README_MAX_LINES


@pytest.mark.parametrize("path", documents(), ids=lambda p: p.name)
def test_no_user_document_reads_like_a_lab_notebook(path: Path) -> None:
    found = [f"{path.name}:{n}: {m.group(0)!r}" for n, line in enumerate(path.read_text().split("\n"), 1)
             for m in NOTEBOOK_WORDS.finditer(line)]
    assert found == []


def test_the_notebook_words_are_found_and_plain_words_are_not() -> None:
    assert [m.group(0) for m in NOTEBOOK_WORDS.finditer("issue 35; Issues 9; the session before; no GPU was lent")] \
        == ["issue 35", "Issues 9", "session", "lent"]
    assert NOTEBOOK_WORDS.search("an issue; the lentils; sessionless; relentless") is None


def test_every_doc_is_linked_from_the_readme() -> None:
    linked = {(REPO / target.partition("#")[0]).resolve() for _, target in links(REPO / "README.md")}
    assert [p.name for p in documents()[1:] if p.resolve() not in linked] == []


def test_a_broken_link_and_a_broken_anchor_are_found(tmp_path: Path) -> None:
    (tmp_path / "target.md").write_text(
        "# A title\n\n## Fields: honoured, or refused by name\n\n## Fields\n\n## Fields\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](target.md#fields-honoured-or-refused-by-name) [ok](target.md#fields-1) [ok](#a-link)\n"
                    "## A [link](target.md)\n"
                    "`[not a link](nowhere.md)`\n```\n[not a link](nowhere.md)\n```\n"
                    "[gone](missing.md) [bad anchor](target.md#fields-2) [web](https://example.com/x#y)\n")
    assert [target for _, target in links(page)][-3:] == ["missing.md", "target.md#fields-2", "https://example.com/x#y"]
    assert broken_links(page, root=tmp_path) == [
        "page.md:7: missing.md (no such file)",
        "page.md:7: target.md#fields-2 (no heading with that anchor in target.md)"]


def test_slugs_follow_github() -> None:
    assert slug("Serving configs (`configs/*.yaml`)") == "serving-configs-configsyaml"
    assert slug("servelab's int4 kernel") == "servelabs-int4-kernel"
    assert slug("On each CPU kind: a measured `auto`") == "on-each-cpu-kind-a-measured-auto"
