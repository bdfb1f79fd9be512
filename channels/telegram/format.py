"""Markdown → Telegram text + entities, split into messages Telegram accepts (SPEC §3.5).

Telegram measures text and entity offsets in UTF-16 code units and refuses a message
over 4096 of them. A reply is converted once (telegramify-markdown gives plain text plus
`MessageEntity` ranges: no parse mode, so no MarkdownV2 or HTML escaping to get wrong, and
the text's length is the length Telegram counts) and then cut at the best place that
fits: a blank line outside any entity, then a line break, then a line break inside a
code block or quote (each part becomes its own closed block), then a space, and only as
a last resort anywhere. Pure functions, no I/O.

Raw HTML in a reply (`List<String>`, `a <b>c</b>`, a line holding only `<div>`) is text
to show, not markup: the converter would drop it, so its `<` is backslash-escaped first.
"""

from __future__ import annotations

import bisect
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import pyromark
from telegramify_markdown import convert

log = logging.getLogger("channels.telegram")

TELEGRAM_TEXT_LIMIT = 4096  # UTF-16 code units per message
MAX_ENTITIES = 100  # Telegram ignores formatting past this many entities in one message

# Entities that may be cut at a line break: each part stays a closed block of its own.
_SPLITTABLE = frozenset({"pre", "blockquote", "expandable_blockquote"})
_TRIM_LEADING = "\r\n"  # leading spaces may be code indentation: keep them

# The Markdown dialect telegramify-markdown parses (tables, ~~, task lists, $math$): the
# raw-HTML pre-pass must read the reply exactly as the converter will.
_MD_OPTIONS = (
    pyromark.Options.ENABLE_TABLES
    | pyromark.Options.ENABLE_STRIKETHROUGH
    | pyromark.Options.ENABLE_TASKLISTS
    | pyromark.Options.ENABLE_MATH
)
_SPOILER_TAG = "tg-spoiler>"  # the converter writes ||x|| as <tg-spoiler>x</tg-spoiler>
_MAX_ESCAPE_ROUNDS = 32  # each round escapes at least one `<`; past this, send plain text


@dataclass(frozen=True, slots=True)
class Chunk:
    """One message: text and Bot API `MessageEntity` dicts (offsets in UTF-16 units)."""

    text: str
    entities: tuple[dict[str, Any], ...] = ()


def sanitize_text(text: str) -> str:
    """Valid Unicode only: lone surrogates (from JSON escapes) become U+FFFD."""
    if not isinstance(text, str):
        text = str(text)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    return text


def utf16_len(text: str) -> int:
    if text.isascii():
        return len(text)
    return len(text.encode("utf-16-le", "surrogatepass")) // 2


def utf16_offsets(text: str) -> list[int]:
    """`table[i]` is the UTF-16 offset of `text[i]`; `table[len(text)]` the total length."""
    table = [0] * (len(text) + 1)
    pos = 0
    for i, ch in enumerate(text):
        table[i] = pos
        pos += 2 if ord(ch) > 0xFFFF else 1
    table[len(text)] = pos
    return table


def render_markdown(markdown: str, limit: int = TELEGRAM_TEXT_LIMIT) -> list[Chunk]:
    """A Markdown reply as the messages to send, in order. Never raises on odd input:
    Markdown the converter cannot handle is sent as it was written."""
    source = sanitize_text(markdown)
    try:
        text, entities = _convert(source)
        entity_dicts = [e.to_dict() for e in entities]
    except Exception:  # a converter bug must not cost the reply
        log.warning("markdown conversion failed; sending the reply unformatted", exc_info=True)
        text, entity_dicts = source, []
    return split_chunks(text, entity_dicts, limit)


def render_text(markdown: str) -> str:
    """The text `render_markdown` gives, whole and without formatting: what a streamed
    reply shows while it grows. Skips the cutting and the entities (several times
    cheaper: it runs at every update of every streamed message)."""
    source = sanitize_text(markdown)
    try:
        return _convert(source)[0]
    except Exception:  # logged when the final reply is rendered
        return source


def _convert(source: str) -> tuple[str, list[Any]]:
    prepared = escape_raw_html(source)
    text, entities = convert(prepared)
    if text.count(_SPOILER_TAG) > source.count(_SPOILER_TAG):
        # The converter's ||spoiler|| step put its tags where Markdown then read them
        # as text (a code span across two blocks): convert again without spoilers.
        text, entities = convert(_escape_double_bars(prepared))
    return text, list(entities)


class _TooTangled(ValueError):
    """Raw HTML that did not settle after _MAX_ESCAPE_ROUNDS rounds of escaping."""


def escape_raw_html(markdown: str) -> str:
    """`markdown` with every raw HTML tag, comment or HTML block turned into literal text.

    Telegram cannot show HTML from a Markdown reply and the converter drops it, which ate
    `<String>` out of `List<String> names` (and a whole paragraph after a line holding only
    a tag). A CommonMark backslash before the `<` makes it text. The reply is re-parsed
    until no HTML remains, because escaping an HTML block's first tag can turn the rest
    of it into inline tags. Code spans, code blocks, autolinks and link destinations are
    not HTML to the parser, so they are never touched.
    """
    if "<" not in markdown:
        return markdown
    for _ in range(_MAX_ESCAPE_ROUNDS):
        offsets = _raw_html_starts(markdown)
        if not offsets:
            return markdown
        markdown = _insert_backslashes(markdown, offsets)
    raise _TooTangled("raw HTML still present after escaping")


def _raw_html_starts(markdown: str) -> list[int]:
    """UTF-8 byte offsets to escape: the `<` opening each raw HTML piece, and the `$`
    pair of inline math the converter will read as two prices (closing `$` before a
    digit), since the converter then parses that math's content as Markdown."""
    source = markdown.encode("utf-8")
    offsets: set[int] = set()
    for payload, where in pyromark.events_with_range(markdown, options=_MD_OPTIONS):
        if not isinstance(payload, dict):
            continue
        start, end = where["start"], where["end"]
        if "InlineHtml" in payload or payload.get("Start") == "HtmlBlock":
            lt = source.find(b"<", start, end)
            if lt >= 0:
                offsets.add(lt)
        elif "InlineMath" in payload and source[end:end + 1].isdigit():
            offsets.update((start, end - 1))
    return sorted(offsets)


def _escape_double_bars(markdown: str) -> str:
    """Every `|` in a run of two or more, outside code, backslash-escaped: the converter
    then finds no `||spoiler||` to rewrite."""
    source = markdown.encode("utf-8")
    code: list[tuple[int, int]] = []
    for payload, where in pyromark.events_with_range(markdown, options=_MD_OPTIONS):
        if not isinstance(payload, dict):
            continue
        start = payload.get("Start")
        if (isinstance(start, dict) and "CodeBlock" in start) or any(
            key in payload for key in ("Code", "InlineMath", "DisplayMath")
        ):
            code.append((where["start"], where["end"]))
    offsets: list[int] = []
    for run in re.finditer(rb"\|{2,}", source):
        if not any(a <= run.start() < b for a, b in code):
            offsets += range(run.start(), run.end())
    return _insert_backslashes(markdown, offsets)


def _insert_backslashes(markdown: str, offsets: list[int]) -> str:
    source = markdown.encode("utf-8")
    bounds = [0, *offsets, len(source)]
    return b"\\".join(source[a:b] for a, b in pairwise(bounds)).decode("utf-8")


def split_plain(text: str, limit: int = TELEGRAM_TEXT_LIMIT) -> list[Chunk]:
    """Plain text (no formatting) cut into messages."""
    return split_chunks(sanitize_text(text), [], limit)


@dataclass(frozen=True, slots=True)
class _Span:
    start: int  # Python indices into the text
    end: int
    data: dict[str, Any]

    @property
    def splittable(self) -> bool:
        return self.data.get("type") in _SPLITTABLE


def split_chunks(
    text: str, entities: Sequence[dict[str, Any]], limit: int = TELEGRAM_TEXT_LIMIT
) -> list[Chunk]:
    """Cut `text` (with Bot API entities) into chunks of at most `limit` UTF-16 units and
    at most MAX_ENTITIES entities each; whitespace-only chunks are dropped."""
    if limit < 2:
        raise ValueError("limit must be at least 2 UTF-16 units")
    offsets = utf16_offsets(text)
    spans = _spans(offsets, entities)
    n = len(text)
    inside_any, inside_hard = _coverage(n, spans)
    starts = [s.start for s in spans]

    ranges: list[tuple[int, int]] = []
    start = 0
    while start < n:
        end = bisect.bisect_right(offsets, offsets[start] + limit) - 1
        end = min(end, _entity_cap(spans, starts, start, end))
        if end >= n:
            ranges.append((start, n))
            break
        end = max(end, start + 1)
        cut = _best_cut(text, offsets, start, end, limit, inside_any, inside_hard)
        ranges.append((start, cut))
        start = cut

    chunks: list[Chunk] = []
    for lo, hi in ranges:
        chunk = _make_chunk(text, offsets, spans, lo, hi)
        if chunk is not None:
            chunks.append(chunk)
    return chunks


def _spans(offsets: list[int], entities: Sequence[dict[str, Any]]) -> list[_Span]:
    total = offsets[-1]
    spans: list[_Span] = []
    for ent in entities:
        off, length = ent.get("offset"), ent.get("length")
        if not isinstance(off, int) or not isinstance(length, int) or length <= 0 or off < 0:
            continue
        end16 = min(off + length, total)
        # Snap to character boundaries (an offset inside a surrogate pair is invalid).
        lo = bisect.bisect_left(offsets, off)
        hi = bisect.bisect_left(offsets, end16)
        if hi > lo:
            spans.append(_Span(lo, hi, dict(ent)))
    spans.sort(key=lambda s: (s.start, -s.end))
    return spans


def _coverage(n: int, spans: list[_Span]) -> tuple[list[int], list[int]]:
    """For each cut position c: how many entities strictly contain it (start < c < end),
    all of them and only those that must not be split."""
    diff_any = [0] * (n + 2)
    diff_hard = [0] * (n + 2)
    for s in spans:
        if s.end - s.start < 2:
            continue
        diff_any[s.start + 1] += 1
        diff_any[s.end] -= 1
        if not s.splittable:
            diff_hard[s.start + 1] += 1
            diff_hard[s.end] -= 1
    inside_any, inside_hard = [0] * (n + 1), [0] * (n + 1)
    acc_any = acc_hard = 0
    for c in range(n + 1):
        acc_any += diff_any[c]
        acc_hard += diff_hard[c]
        inside_any[c], inside_hard[c] = acc_any, acc_hard
    return inside_any, inside_hard


def _entity_cap(spans: list[_Span], starts: list[int], start: int, end: int) -> int:
    """Move `end` back so that at most MAX_ENTITIES entities touch [start, end)."""
    carried = sum(1 for s in spans if s.start < start < s.end)
    first = bisect.bisect_left(starts, start)
    room = MAX_ENTITIES - carried
    if room <= 0:  # pathological nesting: cut right after the start
        return start + 1
    nxt = first + room
    if nxt < len(spans) and spans[nxt].start < end:
        return max(spans[nxt].start, start + 1)
    return end


def _best_cut(
    text: str,
    offsets: list[int],
    start: int,
    end: int,
    limit: int,
    inside_any: list[int],
    inside_hard: list[int],
) -> int:
    """The best position in (start, end] to end a chunk."""

    def after_blank(c: int) -> bool:
        return c >= 2 and text[c - 1] == "\n" and text[c - 2] == "\n"

    def after_newline(c: int) -> bool:
        return text[c - 1] == "\n"

    def after_space(c: int) -> bool:
        return text[c - 1].isspace()

    def free(c: int) -> bool:
        return inside_any[c] == 0

    def soft(c: int) -> bool:
        return inside_hard[c] == 0

    preferences: list[Callable[[int], bool]] = [
        lambda c: after_blank(c) and free(c),
        lambda c: after_newline(c) and free(c),
        lambda c: after_newline(c) and soft(c),
        lambda c: after_space(c) and free(c),
        lambda c: after_space(c) and soft(c),
        after_newline,
        after_space,
    ]
    # First try to keep chunks at least half full; then accept any position.
    half = bisect.bisect_left(offsets, offsets[start] + limit // 2)
    for floor in (max(half, start + 1), start + 1):
        for ok in preferences:
            for c in range(end, floor - 1, -1):
                if ok(c):
                    return c
    return end


def _make_chunk(text: str, offsets: list[int], spans: list[_Span], lo: int, hi: int) -> Chunk | None:
    while lo < hi and text[lo] in _TRIM_LEADING:
        lo += 1
    while hi > lo and text[hi - 1].isspace():
        hi -= 1
    if lo >= hi:
        return None
    base = offsets[lo]
    entities: list[dict[str, Any]] = []
    for s in spans:
        a, b = max(s.start, lo), min(s.end, hi)
        if b <= a:
            continue
        ent = dict(s.data)
        ent["offset"] = offsets[a] - base
        ent["length"] = offsets[b] - offsets[a]
        entities.append(ent)
    return Chunk(text[lo:hi], tuple(entities))
