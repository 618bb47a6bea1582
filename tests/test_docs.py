"""The documentation stays inside the repository: every relative link in README.md and
docs/*.md resolves to a file here (and a `#anchor` to a heading of the page it names), nothing
points outside the checkout, and the docs that code comments cite exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE_DIRS = ("pdecomp", "launcher", "hydra_plugins", "scripts", "tests", "bench")
OUTSIDE = "../" + "shared"  # split, so this file does not match its own check

_FENCE = re.compile(r"^(```|~~~)")
_INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_REF_LINK = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)")
_CODE_SPAN = re.compile(r"`[^`]*`")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
_DOC_NAME = re.compile(r"[\w./-]*\.md\b")


def _prose_lines(text: str) -> list[str]:
    """The lines of a markdown page outside fenced code blocks, code spans removed."""
    out, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append(_CODE_SPAN.sub("", line))
    return out


def links(page: Path) -> list[str]:
    found = []
    for line in _prose_lines(page.read_text()):
        found += _INLINE_LINK.findall(line)
        found += _REF_LINK.findall(line)
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    out, fenced = set(), False
    for line in page.read_text().splitlines():
        if _FENCE.match(line.strip()):
            fenced = not fenced
        elif not fenced and (m := _HEADING.match(line)):
            out.add(slug(m.group(1)))
    return out


def relative_links() -> list[tuple[str, str]]:
    return [(page.relative_to(ROOT).as_posix(), link) for page in PAGES for link in links(page)
            if not re.match(r"^[a-z][a-z0-9+.-]*:", link)]  # http:, https:, mailto:, ...


def test_the_docs_exist_and_link_to_each_other():
    names = {p.name for p in PAGES}
    assert {"index.md", "method.md", "memory_gate.md", "config.md", "slurm.md",
            "data.md"} <= names
    assert ("README.md", "docs/index.md") in relative_links()


@pytest.mark.parametrize("page,link", relative_links())
def test_relative_link_resolves_inside_the_repository(page, link):
    path, _, anchor = link.partition("#")
    source = ROOT / page
    target = (source.parent / path).resolve() if path else source
    assert target.is_relative_to(ROOT), f"{page}: {link} points outside the repository"
    assert target.exists(), f"{page}: {link} names no file or directory"
    if anchor and target.suffix == ".md":
        assert anchor in anchors(target), f"{page}: {link}: no heading #{anchor}"


def test_nothing_points_outside_the_repository():
    files = [*PAGES, *(p for d in ("pdecomp", "launcher") for p in (ROOT / d).rglob("*")
                       if p.is_file() and p.suffix in (".py", ".md", ".yaml", ".sh"))]
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in files
            for i, line in enumerate(p.read_text().splitlines(), 1) if OUTSIDE in line]
    assert not hits, hits


def test_docs_cited_in_code_exist():
    here = Path(__file__).resolve()
    missing = []
    for d in CODE_DIRS:
        for p in sorted((ROOT / d).rglob("*")):
            if p.suffix not in (".py", ".sh") or p.resolve() == here:
                continue
            for i, line in enumerate(p.read_text().splitlines(), 1):
                for name in _DOC_NAME.findall(line):
                    if not (ROOT / name).exists() and not (ROOT / "docs" / name).exists():
                        missing.append(f"{p.relative_to(ROOT)}:{i}: {name}")
    assert not missing, missing


def test_every_exit_code_is_in_the_one_table():
    from pdecomp.core.exits import EXIT_CODES

    text = (ROOT / "docs" / "cli.md").read_text()
    table = [line for line in text.splitlines() if re.match(r"^\| \d+ \|", line)]
    assert sorted(int(line.split("|")[1]) for line in table) == sorted(EXIT_CODES)


def test_every_option_of_every_config_group_is_documented():
    """Each YAML option a user can pick (`group=option`, `+experiment=option`) is named, in
    backticks, on a page of docs/."""
    docs = "\n".join(p.read_text() for p in PAGES)
    conf = ROOT / "launcher" / "conf"
    missing = [f"{f.parent.name}={f.stem}" for f in sorted(conf.glob("*/*.yaml"))
               if f"`{f.stem}`" not in docs]
    assert not missing, missing


def test_the_results_page_holds_current_figures_only():
    """bench/RESULTS.md is a results page: the current figure for each question, at most
    200 lines (how a number moved belongs in commit messages)."""
    lines = (ROOT / "bench" / "RESULTS.md").read_text().splitlines()
    assert len(lines) <= 200, len(lines)
