"""The examples in README.md and docs/*.md run as written, and their relative links resolve.

Every ```python block of a page runs, in page order, in one namespace per page (as a reader would paste
them into one session), from a temporary working directory so that files the examples write stay out
of the checkout. A block is skipped only when the line before its fence is `<!-- fragment -->`: a
snippet that shows a shape, not a program (few, and on purpose). Other languages (bash) are not run.
Each page's number of runnable python blocks is fixed below (RUNNABLE), so a parser that stops finding
blocks, or a python block labelled with another language, fails instead of passing with nothing run;
a fence's language must be one of LANGUAGES.

Links: every `[text](target)` or `[text](target "title")` outside code blocks that is not a URL must
name an existing file or folder relative to the page, and a `#anchor` must match a heading of the page
it points to (GitHub's rule: lowercase, punctuation dropped, spaces to hyphens).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FRAGMENT = "<!-- fragment -->"
MAX_FRAGMENTS = 4  # across all pages: a fragment is an example nobody checks
README_MAX_LINES = 180
# runnable (not fragment) python blocks per page; a page not named has none. Update with the pages.
RUNNABLE = {"README.md": 2, "docs/arguments.md": 1, "docs/design.md": 1, "docs/dropin.md": 2, "docs/scale-out.md": 2, "docs/speech.md": 1}
# the languages a fence may name ("" = none); any other, e.g. `python3`, would silently not run
LANGUAGES = {"python", "py", "bash", "sh", "console", "text", "json", ""}

FENCE = re.compile(r"^(`{3,})\s*([^`\s]*)[^`]*$")  # the language is the info string's first word
LINK = re.compile(r"""(?<!!)\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+(?:"[^"]*"|'[^']*'|\([^)]*\)))?\s*\)""")


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    fragment: bool


def blocks(page: Path) -> list[Block]:
    """Fenced code blocks of a page, with the language after the fence."""
    out, lines, i = [], page.read_text(encoding="utf-8").splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i].strip())
        if not m:
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and lines[i].strip() != m.group(1):
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise AssertionError(f"{page.name}:{start + 1}: code block never closed")
        before = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        out.append(Block(page, start + 1, m.group(2).lower(), "\n".join(body) + "\n", before == FRAGMENT))
        i += 1
    return out


def prose(page: Path) -> list[tuple[int, str]]:
    """(line number, line) of a page outside its code blocks."""
    out, inside = [], None
    for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1):
        m = FENCE.match(line.strip())
        if inside is None and m:
            inside = m.group(1)
        elif inside is not None and line.strip() == inside:
            inside = None
        elif inside is None:
            out.append((n, line))
    return out


def slug(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose(page):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            k = seen.get(base, 0)
            seen[base] = k + 1
            out.add(base if k == 0 else f"{base}-{k}")
    return out


def python_blocks(page: Path) -> list[Block]:
    return [b for b in blocks(page) if b.lang in ("python", "py")]


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_examples_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_thread) -> None:
    """One torch thread (conftest): on busy shared cores spear-tts's many small ops, which dropin.md
    runs for comparison, stall for seconds each with two threads."""
    runnable = [b for b in python_blocks(page) if not b.fragment]
    name = page.relative_to(ROOT).as_posix()
    assert len(runnable) == RUNNABLE.get(name, 0), (
        f"{name}: {len(runnable)} runnable python blocks, RUNNABLE says {RUNNABLE.get(name, 0)}")
    if not runnable:
        return
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__main__"}
    for block in runnable:
        where = f"{page.relative_to(ROOT).as_posix()}:{block.line}"
        try:
            exec(compile(block.code, where, "exec"), namespace)
        except Exception as e:  # name the block, keep the traceback
            raise AssertionError(f"the python block at {where} failed: {type(e).__name__}: {e}") from e


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_links_resolve(page: Path) -> None:
    bad = []
    for n, line in prose(page):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{page.name}:{n}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{page.name}:{n}: {target} (no heading #{anchor} in {dest.name})")
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_runnable_blocks_found() -> None:
    """Every page RUNNABLE names exists, and the examples checked are not vacuous."""
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    assert set(RUNNABLE) <= names, f"RUNNABLE names missing pages: {set(RUNNABLE) - names}"
    assert sum(RUNNABLE.values()) >= 8


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_fence_languages(page: Path) -> None:
    bad = [f"{page.name}:{b.line}: ```{b.lang}" for b in blocks(page) if b.lang not in LANGUAGES]
    assert not bad, f"code blocks in a language not in {sorted(LANGUAGES)}:\n" + "\n".join(bad)


def test_fragments_are_few() -> None:
    fragments = [f"{b.page.name}:{b.line}" for p in PAGES for b in python_blocks(p) if b.fragment]
    assert len(fragments) <= MAX_FRAGMENTS, f"python blocks marked as fragments: {fragments}"


def test_readme_is_short_and_runs_something() -> None:
    readme = ROOT / "README.md"
    assert len(readme.read_text(encoding="utf-8").splitlines()) <= README_MAX_LINES
    assert any(not b.fragment for b in python_blocks(readme))


def test_block_parsing(tmp_path: Path) -> None:
    """The parser finds fences, languages, fragment marks and links the way the pages use them."""
    page = tmp_path / "page.md"
    page.write_text(
        "# A title, with: punctuation\n\nSee [x](#a-title-with-punctuation).\n\n"
        "```python\nx = 1\n```\n\n<!-- fragment -->\n```python\nnot python\n```\n\n"
        "```bash\n[y](nowhere.md)\n```\n\n"
        'A [titled](other.md "Title") link and an ![image](pic.png).\n\n'
        "``` Python3 title=x\ny = 2\n```\n",
        encoding="utf-8",
    )
    found = blocks(page)
    assert [(b.lang, b.fragment, b.line) for b in found] == [("python", False, 5), ("python", True, 10),
                                                              ("bash", False, 14), ("python3", False, 20)]
    assert found[0].code == "x = 1\n"
    assert "a-title-with-punctuation" in anchors(page)
    assert [t for _, line in prose(page) for t in LINK.findall(line)] == ["#a-title-with-punctuation", "other.md"]
