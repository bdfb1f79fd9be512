"""Markdown as Discord shows it, in messages of at most 2,000 characters. Pure, no I/O.

Discord renders most of what the agent writes itself: bold, italics, strikethrough,
inline code, fenced code blocks with a language, block quotes, lists, `#`-`###`
headings and masked links. What it does not render is rewritten (`to_discord`): a pipe
table becomes a code block with aligned columns, a `####`+ heading a bold line, an image
a link. Code blocks are never touched.

`split_message` cuts the text into messages within the limit (Discord counts code
points): at a blank line in the second half of a message when there is one, else at a
line end, else at a space, and inside an over-long word never between a character and
what joins it (combining marks, emoji modifiers, zero-width joiners, flag pairs). A
message cut inside a code fence closes it, and the next one reopens it with the same
language, so every message renders on its own. The stream (`stream.py`) cuts its
growing text with the same `next_cut` / `shown` pair.
"""

from __future__ import annotations

import bisect
import re
import unicodedata
from dataclasses import dataclass

DISCORD_TEXT_LIMIT = 2000  # characters of one message's content
FENCE = "```"
_CLOSER = "\n" + FENCE
_LANG = re.compile(r"[\w+#.\-]{1,20}")
_DELIMITER_ROW = re.compile(r"^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)+\|?\s*$|^\s*\|\s*:?-+:?\s*\|\s*$")
_DEEP_HEADING = re.compile(r"^ {0,3}#{4,6}\s+(.+?)\s*#*\s*$")
_IMAGE = re.compile(r"!\[([^\]\n]*)\]\(\s*(<[^>\n]*>|[^)\s]+)(?:\s+\"[^\"\n]*\")?\s*\)")
_LINK = re.compile(r"\[([^\]\n]*)\]\(\s*(<[^>\n]*>|[^)\s]+)\s*\)")
_CELL_MARKS = re.compile(r"(\*\*|__|~~|`)")


def clean_text(text: object) -> str:
    """Any value → a str that is valid UTF-8 (lone surrogates replaced) and has no NUL."""
    if not isinstance(text, str):
        return ""
    return text.encode("utf-8", "replace").decode("utf-8").replace("\x00", "")


def render_markdown(markdown: str, limit: int = DISCORD_TEXT_LIMIT) -> list[str]:
    """What `send()` posts for a reply: the messages, in order ([] for an empty reply)."""
    return split_message(to_discord(clean_text(markdown)), limit)


# ---------------------------------------------------------------------------- Markdown


def _fence_toggle(line: str) -> str | None:
    """The language of a line that opens or closes a ``` fence ("" when it has none),
    or None when the line does not toggle one (```code``` on one line does not)."""
    stripped = line.lstrip(" ")
    if len(line) - len(stripped) > 3 or not stripped.startswith(FENCE) or stripped.count(FENCE) % 2 == 0:
        return None
    lang = _LANG.match(stripped[3:].strip())
    return lang.group(0) if lang else ""


def to_discord(markdown: str) -> str:
    """Rewrite what Discord does not render (tables, deep headings, images); fenced code
    is left as it is."""
    lines = markdown.split("\n")
    out: list[str] = []
    in_fence = False
    i = 0
    while i < len(lines):
        line = lines[i]
        if _fence_toggle(line) is not None:
            in_fence = not in_fence
            out.append(line)
            i += 1
            continue
        if in_fence:
            out.append(line)
            i += 1
            continue
        if "|" in line and i + 1 < len(lines) and _DELIMITER_ROW.match(lines[i + 1]):
            rows = [_cells(line)]
            i += 2
            while i < len(lines) and "|" in lines[i] and lines[i].strip():
                rows.append(_cells(lines[i]))
                i += 1
            out.extend(_table_block(rows))
            continue
        heading = _DEEP_HEADING.match(line)
        if heading:
            line = f"**{heading.group(1)}**"
        out.append(_IMAGE.sub(_image_link, line))
        i += 1
    return "\n".join(out)


def _image_link(match: re.Match[str]) -> str:
    alt, url = match.group(1).strip(), match.group(2).strip("<>")
    return f"[{alt}]({url})" if alt else url


def _cells(line: str) -> list[str]:
    row = line.strip()
    if row.startswith("|"):
        row = row[1:]
    if row.endswith("|") and not row.endswith("\\|"):
        row = row[:-1]
    cells = re.split(r"(?<!\\)\|", row)
    return [_plain_cell(cell) for cell in cells]


def _plain_cell(cell: str) -> str:
    """A cell as text (a code block shows no formatting): marks dropped, links spelled out."""
    text = cell.strip().replace("\\|", "|")
    text = _LINK.sub(lambda m: f"{m.group(1)} ({m.group(2).strip('<>')})" if m.group(1) else m.group(2), text)
    return _CELL_MARKS.sub("", text).replace(FENCE, "'''")


def _width(text: str) -> int:
    """Columns a monospace font gives `text` (wide East Asian characters take two)."""
    return sum(2 if unicodedata.east_asian_width(ch) in "WF" else 0 if unicodedata.combining(ch) else 1
               for ch in text)


def _table_block(rows: list[list[str]]) -> list[str]:
    columns = max(len(row) for row in rows)
    rows = [row + [""] * (columns - len(row)) for row in rows]
    widths = [max(_width(row[c]) for row in rows) for c in range(columns)]

    def line(row: list[str]) -> str:
        return " | ".join(cell + " " * (widths[c] - _width(cell)) for c, cell in enumerate(row)).rstrip()

    rule = "-+-".join("-" * w for w in widths)
    return [FENCE, line(rows[0]), rule, *(line(row) for row in rows[1:]), FENCE]


# ---------------------------------------------------------------------------- messages


@dataclass(frozen=True, slots=True)
class Fences:
    """Where a text's code fences open and close, to tell whether a position is inside one."""

    ends: tuple[int, ...]  # offset just past each toggling line
    langs: tuple[str, ...]  # the language each toggling line names

    @classmethod
    def of(cls, text: str) -> Fences:
        ends: list[int] = []
        langs: list[str] = []
        pos = 0
        for line in text.split("\n"):
            lang = _fence_toggle(line)
            pos += len(line) + 1
            if lang is not None:
                ends.append(min(pos, len(text)))
                langs.append(lang)
        return cls(tuple(ends), tuple(langs))

    def opener_at(self, pos: int) -> str | None:
        """The fence line to reopen a message that starts at `pos` with ("```py"), or
        None when `pos` is outside every code block."""
        toggles = bisect.bisect_right(self.ends, pos)
        if toggles % 2 == 0:
            return None
        return FENCE + self.langs[toggles - 1]


def shown(text: str, start: int, end: int, fences: Fences | None = None) -> str:
    """The message that shows `text[start:end]`: trimmed, a code block it starts inside
    reopened, one it ends inside closed."""
    fences = fences or Fences.of(text)
    opener = fences.opener_at(start)
    body = text[start:end].strip("\n").rstrip()
    if opener is None:
        body = body.lstrip()
    elif body:
        body = f"{opener}\n{body}"
    if body and fences.opener_at(end) is not None:
        body += _CLOSER
    return body


def next_cut(text: str, start: int, limit: int = DISCORD_TEXT_LIMIT, fences: Fences | None = None) -> int:
    """Where the message that begins at `start` ends, so that `shown` of it fits `limit`."""
    fences = fences or Fences.of(text)
    if len(shown(text, start, len(text), fences)) <= limit:
        return len(text)
    opener = fences.opener_at(start)
    budget = max(limit - (len(opener) + 1 if opener else 0) - len(_CLOSER), 16)
    end = min(len(text), start + budget)
    floor = start + budget // 2
    for separator in ("\n\n", "\n", " "):
        at = text.rfind(separator, floor, end)
        if at >= 0:
            return at + len(separator)
    return _joined_back(text, end, start + 1)


def split_message(text: str, limit: int = DISCORD_TEXT_LIMIT) -> list[str]:
    """Discord-ready Markdown → messages of at most `limit` characters, in order."""
    text = text.strip()
    fences = Fences.of(text)
    chunks: list[str] = []
    start = 0
    while start < len(text):
        end = next_cut(text, start, limit, fences)
        chunk = shown(text, start, end, fences)
        if chunk:
            chunks.append(chunk)
        start = end
    return chunks


def _joins(text: str, i: int) -> bool:
    """Whether a cut before `text[i]` would split one visible character."""
    ch, before = text[i], text[i - 1]
    code = ord(ch)
    if before == "\u200d" or ch == "\u200d" or (before == "\r" and ch == "\n"):
        return True
    if unicodedata.category(ch) in ("Mn", "Me", "Mc"):
        return True
    if 0xFE00 <= code <= 0xFE0F or 0x1F3FB <= code <= 0x1F3FF or 0xE0020 <= code <= 0xE007F \
            or 0xE0100 <= code <= 0xE01EF:
        return True
    if _regional(ch) and _regional(before):
        run = 0  # flags are pairs: cut only between two of them
        while i - run - 1 >= 0 and _regional(text[i - run - 1]):
            run += 1
        return run % 2 == 1
    return False


def _regional(ch: str) -> bool:
    return 0x1F1E6 <= ord(ch) <= 0x1F1FF


def _joined_back(text: str, end: int, floor: int) -> int:
    """`end`, moved back until it does not split a visible character (never below `floor`)."""
    cut = end
    while cut < len(text) and _joins(text, cut):
        if cut == floor:
            return end  # one "character" longer than a message: it is cut all the same
        cut -= 1
    return cut
