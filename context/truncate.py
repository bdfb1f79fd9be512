"""Two-stage truncation of tool results with offload (SPEC §4.1).

Stage 1 (`cut_tool_result`) runs when a tool result is produced: a result over the cap
keeps its head and a notice; the full text is saved once as `tool_results/<id>.txt`, or,
for `read_file`, the notice points at the file itself. The real end of the text is kept
out of band (`Truncation.tail`). Stage 2 (`shorten`) runs in every request for historical
turns: the kept excerpt is cut again to its head plus the end of the whole text (that
tail, or the excerpt's own end when stage 1 cut nothing), with a notice naming the same
file and the offsets of what is omitted.

What was cut lives out of band in `Truncation` (gateway.types); nothing here ever looks
for a marker in the text. Offsets are character offsets (Python str indexes), so a cut
never splits a character; lines are counted by "\\n" ("\\r\\n" ends a line too, a lone
"\\r" does not). Following the notices with `read_window` reconstructs the text exactly.
"""

from __future__ import annotations

import json
import re
import unicodedata
from dataclasses import dataclass, replace
from typing import Literal

from gateway.types import Truncation

NOTICE_SEPARATOR = "\n\n"
RESULTS_DIR = "tool_results"
# A cut moves back to a line boundary when one lies within the last fifth of the excerpt.
LINE_SNAP_SHARE = 0.2
# Stage 2 keeps this share of its limit from the head, the rest from the tail.
HEAD_SHARE = 0.6
_MAX_JOIN_BACKTRACK = 16
_ZWJ = "\u200d"
_SAFE_ID = re.compile(r"[^A-Za-z0-9_.-]+")

Kind = Literal["history", "budget", "user"]


@dataclass(frozen=True, slots=True)
class FileRef:
    """A tool result that is a window of an existing workspace file (read_file):
    stage-1 truncation points at the file itself instead of saving a copy."""

    path: str  # workspace-relative
    start_offset: int  # char offset of the window in the file
    start_line: int  # line number (1-based) where the window starts
    protected: bool = False  # Markdown: doubled limits (SPEC §4.1)


@dataclass(frozen=True, slots=True)
class SaveFile:
    """Effect: write this full text to the session workspace at `path` (once)."""

    path: str  # "tool_results/<id>.txt", workspace-relative
    text: str


@dataclass(frozen=True, slots=True)
class CutResult:
    content: str  # what goes into the context: the text itself, or excerpt + notice
    truncation: Truncation | None  # store it on the Message
    save: SaveFile | None  # write it before the message is used


# -- small text helpers -------------------------------------------------------------------


def count_lines(text: str) -> int:
    if not text:
        return 0
    return text.count("\n") + (0 if text.endswith("\n") else 1)


def utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def result_path(call_id: str) -> str:
    """Where the full output of one tool call is saved (a safe file name from the id)."""
    safe = _SAFE_ID.sub("_", call_id).strip("._")[:120]
    return f"{RESULTS_DIR}/{safe or 'result'}.txt"


def _joins_previous(ch: str) -> bool:
    """Characters that belong to the character before them (marks, ZWJ, modifiers)."""
    code = ord(ch)
    return (
        unicodedata.combining(ch) != 0
        or ch == _ZWJ
        or 0xFE00 <= code <= 0xFE0F  # variation selectors
        or 0x1F3FB <= code <= 0x1F3FF  # skin tones
        or 0xE0020 <= code <= 0xE007F  # tag characters (flag sequences)
    )


def _clean_cut(text: str, pos: int) -> int:
    """Move a cut back so it does not split CRLF or a character from its marks/joiners."""
    p = pos
    for _ in range(_MAX_JOIN_BACKTRACK):
        if p <= 1 or p >= len(text):
            break
        prev, nxt = text[p - 1], text[p]
        if (prev == "\r" and nxt == "\n") or prev == _ZWJ or _joins_previous(nxt):
            p -= 1
            continue
        return p
    return p if 0 < p < len(text) else pos


def _head_cut(text: str, limit: int) -> int:
    """The end of a head excerpt of at most `limit` chars, on a line boundary if close."""
    limit = max(1, min(limit, len(text)))
    low = limit - int(limit * LINE_SNAP_SHARE)
    newline = text.rfind("\n", low, limit)
    if newline >= 0:
        return newline + 1
    return _clean_cut(text, limit)


def _tail_cut(text: str, size: int, floor: int) -> int:
    """The start of a tail excerpt of about `size` chars, on a line boundary if close."""
    start = max(floor, len(text) - max(0, size))
    if start >= len(text):
        return len(text)
    if start > 0 and text[start - 1] != "\n":
        newline = text.find("\n", start, start + int(size * LINE_SNAP_SHARE) + 1)
        if 0 <= newline < len(text) - 1:
            return newline + 1
    return max(floor, _clean_cut(text, start))


def _literal(path: str) -> str:
    return json.dumps(path, ensure_ascii=False)


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def _span(start: int, end: int) -> str:
    return f"{start}-{end - 1}"


# -- stage 1 ------------------------------------------------------------------------------


def cut_tool_result(
    text: str,
    *,
    call_id: str,
    limit: int,
    file_ref: FileRef | None = None,
    save_over: int | None = None,
) -> CutResult:
    """Stage 1 for a tool result just produced.

    `limit` is `tool_result_max_chars` (doubled for protected Markdown reads). Without
    `file_ref` a cut result is saved as `tool_results/<call_id>.txt`; pass
    `save_over=history_tool_result_max_chars` so that results stage 2 may cut later are
    saved too (their content stays whole until then). With `file_ref` (read_file)
    nothing is saved: the notice points at the file, with absolute offsets and lines, and
    the metadata is always recorded so stage 2 can point there as well.
    """
    protected = file_ref is not None and file_ref.protected
    cap = max(1, limit) * (2 if protected else 1)
    n = len(text)
    cut = _head_cut(text, cap) if n > cap else None
    wants_file = file_ref is None and save_over is not None and n > save_over
    if cut is None and file_ref is None and not wants_file:
        return CutResult(text, None, None)
    truncation = Truncation(
        path=file_ref.path if file_ref is not None else result_path(call_id),
        total_chars=n,
        total_lines=count_lines(text),
        total_bytes=utf8_len(text),
        shown=((0, n if cut is None else cut),),
        saved=file_ref is None,
        protected=protected,
        start_offset=file_ref.start_offset if file_ref is not None else 0,
        start_line=file_ref.start_line if file_ref is not None else 1,
    )
    save = SaveFile(truncation.path, text) if file_ref is None else None
    if cut is None:
        return CutResult(text, truncation, save)
    # The end a later cut shows: as much as stage 2 keeps of a tail (its limit less its
    # head share), from a line start when one is close, never overlapping the excerpt.
    keep = max(1, int((save_over if save_over is not None else cap) * (1 - HEAD_SHARE)))
    tail = text[_tail_cut(text, keep, cut):]
    truncation = replace(truncation, tail=tail)
    content = text[:cut] + NOTICE_SEPARATOR + _stage1_notice(text, cut, truncation)
    return CutResult(content, truncation, save)


def _source(t: Truncation) -> str:
    sizes = (
        f"{_plural(t.total_chars, 'character')}, {_plural(t.total_lines, 'line')}, "
        f"{_plural(t.total_bytes, 'byte')}"
    )
    if t.saved:
        return f"The full output is saved as {t.path}: {sizes}."
    if t.start_offset == 0:
        return f"The file {t.path} has {sizes}."
    return (
        f"From offset {t.start_offset} (line {t.start_line}) to its end the file {t.path} "
        f"holds {sizes}; the file has {t.start_offset + t.total_chars} characters in all."
    )


def _continue_call(t: Truncation, text: str, pos: int) -> str:
    """The exact read_file call(s) that continue from local position `pos` of `text`."""
    path = _literal(t.path)
    call = f"read_file(path={path}, offset={t.start_offset + pos})"
    if pos > 0 and text[pos - 1] == "\n":
        line = t.start_line + text.count("\n", 0, pos)
        call += f" or read_file(path={path}, start_line={line})"
    return call


def _lines_of(t: Truncation, text: str, start: int, end: int) -> str:
    """`lines a-b` for the chars [start, end) of `text` (the full text from its start)."""
    first = t.start_line + text.count("\n", 0, start)
    last = t.start_line + text.count("\n", 0, end - 1)
    lines = f"line {first}" if first == last else f"lines {first}-{last}"
    cut = text[end - 1] != "\n" and end < len(text)
    return lines + (", cut inside the last one" if cut and first != last else ", cut inside it" if cut else "")


def _stage1_notice(text: str, cut: int, t: Truncation) -> str:
    what = "Output" if t.saved else "File content"
    start = t.start_offset
    return (
        f"[{what} truncated. {_source(t)} Shown above: characters {_span(start, start + cut)} "
        f"({_lines_of(t, text, 0, cut)}). Continue with {_continue_call(t, text, cut)}.]"
    )


# -- stage 2 and budget cuts --------------------------------------------------------------


def excerpt_length(content: str, truncation: Truncation | None) -> int:
    """How many chars at the start of `content` are the original text (not a notice)."""
    if truncation is None:
        return len(content)
    shown = sum(end - start for start, end in truncation.shown)
    return shown if shown <= len(content) else len(content)


def _usable(content: str, truncation: Truncation | None) -> Truncation | None:
    # Metadata that cannot describe this content is ignored: the content is then plain.
    if truncation is None or not truncation.shown:
        return None
    if sum(end - start for start, end in truncation.shown) > len(content):
        return None
    return truncation


def _to_full(shown: tuple[tuple[int, int], ...], start: int, end: int) -> list[tuple[int, int]]:
    """Map the local excerpt chars [start, end) to ranges of the full text."""
    out: list[tuple[int, int]] = []
    offset = 0
    for lo, hi in shown:
        size = hi - lo
        a, b = max(start, offset), min(end, offset + size)
        if a < b:
            out.append((lo + a - offset, lo + b - offset))
        offset += size
    return out


def _complement(kept: list[tuple[int, int]], total: int) -> list[tuple[int, int]]:
    out, pos = [], 0
    for lo, hi in sorted(kept):
        if lo > pos:
            out.append((pos, lo))
        pos = max(pos, hi)
    if pos < total:
        out.append((pos, total))
    return out


def shorten(content: str, truncation: Truncation | None, limit: int, *, kind: Kind = "history") -> str:
    """Cut `content` to head + tail of at most `limit` original chars, with a notice.

    The tail is the end of the whole text: the excerpt's own end, or, when stage 1 cut
    the end off, the real end it kept out of band. Returns `content` itself (the same
    object) when nothing needs cutting. A pure function of its arguments, so a message
    cut once reads the same in every request. `kind` says why: "history" (stage 2),
    "budget" (the current turn or an overflow recovery must fit), "user" (the user's own
    message is over the budget).
    """
    truncation = _usable(content, truncation)
    excerpt = content[: excerpt_length(content, truncation)]
    limit = max(1, limit)
    if len(excerpt) <= limit:
        return content
    end = _real_end(truncation, len(excerpt))
    if end is not None:
        return _head_and_real_end(excerpt, truncation, end, limit, kind)
    head_end = _head_cut(excerpt, max(1, int(limit * HEAD_SHARE)))
    tail_start = _tail_cut(excerpt, limit - head_end, head_end)
    if tail_start <= head_end:  # tiny limits: keep the head only
        tail_start = len(excerpt)
    head, tail = excerpt[:head_end], excerpt[tail_start:]
    notice = _middle_notice(excerpt, head_end, tail_start, truncation, kind)
    return head + NOTICE_SEPARATOR + notice + (NOTICE_SEPARATOR + tail if tail else "")


def _real_end(t: Truncation | None, excerpt_chars: int) -> str | None:
    """The text's real end kept by stage 1, when the excerpt (from the start) lacks it."""
    if t is None or not t.tail or len(t.shown) != 1 or t.shown[0] != (0, excerpt_chars):
        return None
    if len(t.tail) > t.total_chars - excerpt_chars:
        return None  # metadata that cannot describe this cut: the excerpt alone then
    return t.tail


def _head_and_real_end(excerpt: str, t: Truncation, end: str, limit: int, kind: Kind) -> str:
    """The excerpt's head and the end of the whole text (which stage 1 left out of the
    content), with the notice of what lies between."""
    head_end = _head_cut(excerpt, max(1, int(limit * HEAD_SHARE)))
    tail_start = _tail_cut(end, limit - head_end, 0)  # local to `end`
    tail = end[tail_start:]
    from_char = t.total_chars - len(tail)  # in the full text
    if not tail:
        from_char = t.total_chars
    base = t.start_offset
    omitted_chars = from_char - head_end
    why = "to keep older turns small" if kind == "history" else "to fit the context budget"
    shown = _span(base, base + head_end) + (f" and {_span(base + from_char, base + t.total_chars)}" if tail else "")
    first_line = t.start_line + excerpt.count("\n", 0, head_end)
    notice = (
        f"[{omitted_chars} characters omitted here (characters {_span(base + head_end, base + from_char)}, "
        f"from line {first_line}) {why}. {_source(t)} "
        f"This message shows characters {shown}, the end of the output included. "
        f"Read the omitted part with {_continue_call(t, excerpt, head_end)}.]"
    )
    return excerpt[:head_end] + NOTICE_SEPARATOR + notice + (NOTICE_SEPARATOR + tail if tail else "")


def _middle_notice(
    excerpt: str, head_end: int, tail_start: int, t: Truncation | None, kind: Kind
) -> str:
    omitted_chars = tail_start - head_end
    why = "to keep older turns small" if kind == "history" else "to fit the context budget"
    if t is None:
        where = f"characters {_span(head_end, tail_start)} of {len(excerpt)}"
        if kind == "user":
            return (
                f"[The user's message is too long for the context: {omitted_chars} of its "
                f"characters ({where}) are omitted here.]"
            )
        return f"[{omitted_chars} characters omitted here ({where}) {why}; the full text was not saved.]"
    base = t.start_offset
    kept = _to_full(t.shown, 0, head_end) + _to_full(t.shown, tail_start, len(excerpt))
    omitted = _complement(kept, t.total_chars)
    middle = _to_full(t.shown, head_end, tail_start)
    middle_txt = " and ".join(_span(base + a, base + b) for a, b in middle)
    if len(t.shown) == 1 and t.shown[0][0] == 0:  # the excerpt is the text from its start
        middle_txt += f", {_lines_of(t, excerpt, head_end, tail_start)}"
        call = _continue_call(t, excerpt, head_end)
    else:
        call = f"read_file(path={_literal(t.path)}, offset={base + middle[0][0]})"
    shown_txt = " and ".join(_span(base + a, base + b) for a, b in kept)
    omitted_txt = " and ".join(_span(base + a, base + b) for a, b in omitted)
    return (
        f"[{omitted_chars} characters omitted here (characters {middle_txt}) {why}. {_source(t)} "
        f"This message shows characters {shown_txt}; omitted: {omitted_txt}. "
        f"Read the omitted part with {call}.]"
    )


# -- read_file's pure core ----------------------------------------------------------------


def read_window(
    full_text: str, *, offset: int | None = None, start_line: int | None = None
) -> tuple[str, int, int]:
    """The text from a char `offset` or a 1-based `start_line` to the end.

    Returns (window, start_offset, start_line) where start_line is the line holding
    start_offset. Past the end gives an empty window at the end. Raises ValueError for
    negative positions or when both are given.
    """
    if offset is not None and start_line is not None:
        raise ValueError("give either offset or start_line, not both")
    if offset is not None:
        if offset < 0:
            raise ValueError("offset must be >= 0")
        start = min(offset, len(full_text))
    elif start_line is not None:
        if start_line < 1:
            raise ValueError("start_line must be >= 1")
        parts = full_text.split("\n", min(start_line - 1, len(full_text) + 1))
        start = len(full_text) - len(parts[-1]) if len(parts) == start_line else len(full_text)
    else:
        start = 0
    return full_text[start:], start, full_text.count("\n", 0, start) + 1
