"""Which workspace files a shell command names (SPEC §5.7): an approval card for `exec`
shows them, so `sh memory/<day>.md` shows the script a `memory_write` staged, not only the
command line.

Best effort and pure: the command is split into words the way a shell would quote them
(never run, never expanded), and every word that could be a path inside the workspace is a
candidate: script arguments (`sh x`, `python3 x`, `. x`), redirections (`< x`), plain
operands, `NAME=x` and `--opt=x` values, words inside `sh -c '…'` and `$(…)`, paths under
`/workspace/`, and the same words under a directory `cd` names. Targets of output
redirections (`> x`) are written, not read, and left out. Whether a candidate is a file
is for the caller to find out (gateway/approvals.py reads them beneath the workspace).
"""

from __future__ import annotations

import posixpath
import re
import shlex

WORKSPACE = "/workspace"  # where the sandbox mounts the workspace (gateway/tools/sandbox.py)
MAX_NAMES = 64  # candidates kept from one command; the caller shows fewer
MAX_DEPTH = 3  # quoted words parsed again (`sh -c 'sh x'`), at most this deep
_WRITES = re.compile(r"\d*(>|>>|>\||&>|&>>)")  # output redirections: the next word is written to
_OPERATORS = set(";&|()<>")
_CHANGES_DIR = ("cd", "pushd")


def files_named(command: str) -> list[str]:
    """Workspace-relative paths the command names, first mention first, no duplicates."""
    found: list[str] = []
    _collect(command, found, depth=0)
    return found[:MAX_NAMES]


def _collect(command: str, found: list[str], *, depth: int) -> None:
    words = _words(command)
    dirs: list[str] = []
    written = False  # the word before was an output redirection
    for index, word in enumerate(words):
        if _WRITES.fullmatch(word):
            written = True
            continue
        if written:
            written = False
            continue
        if word and set(word) <= _OPERATORS:
            continue
        before = words[index - 1] if index else ""
        if before in _CHANGES_DIR:
            relative = _relative(word)
            if relative is not None:
                dirs.append(relative)
            continue
        for value in _values(word):
            relative = _relative(value)
            if relative is None:
                continue
            _add(found, relative)
            for directory in dirs:
                _add(found, posixpath.normpath(posixpath.join(directory, relative)))
        if depth < MAX_DEPTH and (any(ch.isspace() for ch in word) or "$(" in word or "`" in word):
            _collect(word.replace("`", " "), found, depth=depth + 1)


def _words(command: str) -> list[str]:
    """The command's words and operators; a command shlex cannot split (an open quote) is
    split at whitespace and operators instead, quotes left in."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=";&|()<>")
    lexer.whitespace_split = True
    lexer.commenters = ""  # a `#` inside a word is part of it; a comment naming a file is no harm
    try:
        return list(lexer)
    except ValueError:
        return [w for w in re.split(r"[\s;&|()<>]+", command) if w]


def _values(word: str) -> list[str]:
    """The word, and what follows `=` in it (`NAME=x`, `--file=x`)."""
    values = [word]
    if "=" in word:
        values.append(word.split("=", 1)[1])
    if word.startswith("$(") or word.startswith("<("):
        values.append(word[2:])
    return values


def _relative(word: str) -> str | None:
    """The workspace-relative path `word` would be in /workspace, or None when it cannot
    be one (an option, empty, outside the workspace, a variable, a glob)."""
    if not word or word.startswith("-") or "\x00" in word or "$" in word:
        return None
    if word.startswith("/"):
        if word != WORKSPACE and not word.startswith(WORKSPACE + "/"):
            return None
        word = word[len(WORKSPACE):].lstrip("/")
    if word.startswith("~"):
        return None
    normal = posixpath.normpath(word)
    if normal in (".", "") or normal == ".." or normal.startswith("../"):
        return None
    return normal


def _add(found: list[str], name: str) -> None:
    if name not in found and len(found) < MAX_NAMES:
        found.append(name)
