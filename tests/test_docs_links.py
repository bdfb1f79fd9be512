"""The README and docs/ send readers only to files that are in the repository."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_INLINE = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.MULTILINE)
_HTML = re.compile(r"""\b(?:href|src)\s*=\s*["']([^"']+)["']""", re.IGNORECASE)
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"`([^`\n]+)`")
_EXTERNAL = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|//)", re.IGNORECASE)  # https:, mailto:, //host


def link_targets(text: str) -> list[str]:
    """Every link and image target of a Markdown page (fenced code left out)."""
    prose = _FENCE.sub("", text)
    return [m.group(1) for pattern in (_INLINE, _REFERENCE, _HTML) for m in pattern.finditer(prose)]


def local_target(page: Path, target: str) -> Path | None:
    """The file a local link names (fragment and query dropped), or None for a web link or
    an anchor on the same page."""
    if _EXTERNAL.match(target) or target.startswith("#"):
        return None
    path = unquote(target.split("#", 1)[0].split("?", 1)[0])
    if not path:
        return None
    return (page.parent / path).resolve() if not path.startswith("/") else Path(path).resolve()


def link_problems(page: Path, text: str, root: Path) -> list[str]:
    problems = []
    for target in link_targets(text):
        resolved = local_target(page, target)
        if resolved is None:
            continue
        if target.startswith("/") or not resolved.is_relative_to(root):
            problems.append(f"{target}: outside the repository")
        elif not resolved.exists():
            problems.append(f"{target}: no such file in the repository")
    # A path written as code is still a place readers go: none may leave the repository.
    for span in _CODE_SPAN.findall(_FENCE.sub("", text)):
        if span.startswith("../") or "/../" in span:
            resolved = (page.parent / span.split()[0]).resolve()
            if not resolved.is_relative_to(root):
                problems.append(f"`{span}`: names a file outside the repository")
    return problems


def _ignored_by_git(paths: list[Path]) -> set[Path]:
    """Which of `paths` git ignores (data dirs, build output): not part of the repository.
    Empty when this is not a git checkout."""
    if not paths:
        return set()
    try:
        done = subprocess.run(["git", "check-ignore", "--stdin"], cwd=ROOT, capture_output=True, text=True,
                              input="\n".join(str(p) for p in paths), timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return set()
    if done.returncode not in (0, 1):  # 128: not a git checkout
        return set()
    return {Path(line).resolve() for line in done.stdout.splitlines() if line}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_local_links_resolve_to_files_in_the_repository(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    assert link_problems(page, text, ROOT) == []
    targets = [t for t in (local_target(page, x) for x in link_targets(text)) if t is not None]
    assert _ignored_by_git(targets) == set()


def test_readme_links_to_the_docs() -> None:
    readme = ROOT / "README.md"
    linked = {local_target(readme, t) for t in link_targets(readme.read_text(encoding="utf-8"))}
    for name in ("configuration.md", "telegram.md", "slack.md", "memory.md", "context.md", "benchmarks.md"):
        assert (ROOT / "docs" / name).resolve() in linked, f"README.md does not link docs/{name}"


def test_the_checker_catches_bad_links(tmp_path: Path) -> None:
    # The checks above pass on good pages; these show they would fail on bad ones.
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    (root / "docs" / "a.md").write_text("a\n")
    (tmp_path / "SPEC.md").write_text("outside\n")
    page = root / "README.md"
    text = (
        "[ok](docs/a.md#part) [web](https://example.org/x) [here](#top) ![img](docs/a.md)\n"
        "[gone](docs/missing.md) [out](../SPEC.md) [abs](/etc/passwd)\n"
        "see `../SPEC.md` §2 for more\n"
        "```sh\ncat ../not-a-link.md\n```\n"
        "[ref]: docs/nope.md\n"
        '<img src="docs/also-missing.png">\n'
    )
    assert link_problems(page, text, root) == [
        "docs/missing.md: no such file in the repository",
        "../SPEC.md: outside the repository",
        "/etc/passwd: outside the repository",
        "docs/nope.md: no such file in the repository",
        "docs/also-missing.png: no such file in the repository",
        "`../SPEC.md`: names a file outside the repository",
    ]


# Documents that live outside the repository (the product's spec, its design notes, the
# seed documents, the workspace it was written in): a reader of the repository has none.
_OUTSIDE = re.compile(r"\bSPEC(?:\.md|\s*§)|\bDESIGN\.md\b|\bseeds/|\.\./shared\b|(?<![\w.])/work/|\bshared/SPEC")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_cites_a_document_outside_the_repository(page: Path) -> None:
    lines = page.read_text(encoding="utf-8").splitlines()
    cited = [f"line {n}: {line.strip()[:100]}" for n, line in enumerate(lines, 1) if _OUTSIDE.search(line)]
    assert cited == []


def test_the_outside_pattern_finds_what_it_is_for() -> None:
    for text in ("the engine of SPEC §4", "see SPEC.md", "the seeds/ folder", "../shared/DESIGN.md",
                 "in /work/main", "shared/SPEC.md §2"):
        assert _OUTSIDE.search(text), text
    for text in ("mounted at `/workspace`", "a spectrum", "specification of the API"):
        assert not _OUTSIDE.search(text), text
