"""Slack text in both directions: Markdown → mrkdwn chunks out, Slack markup → plain text in.

Pure functions, no I/O: the adapter (channels/slack/adapter.py) calls them.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from slackify_markdown import slackify_markdown

log = logging.getLogger("channels.slack")

# Slack truncates `text` far later (40k), but recommends 4,000 and renders long
# messages poorly; 3,900 leaves room for the fence we may add or reopen.
MESSAGE_LIMIT = 3900
_FENCE = "```"
_FENCE_OPEN = _FENCE + "\n"
_FENCE_CLOSE = "\n" + _FENCE


def clean_text(text: object) -> str:
    """Any value → a str that is valid UTF-8 (lone surrogates replaced) and has no NUL."""
    if not isinstance(text, str):
        return ""
    return text.encode("utf-8", "replace").decode("utf-8").replace("\x00", "")


def escape_mrkdwn(text: str) -> str:
    """The three characters Slack wants escaped in plain text."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def to_mrkdwn(markdown: str) -> str:
    """Markdown (what the agent writes) → Slack mrkdwn; plain escaped text if conversion fails."""
    text = clean_text(markdown)
    try:
        return slackify_markdown(text).strip("\n")
    except Exception:  # the converter is third-party; a bad reply must still go out
        log.warning("slack: mrkdwn conversion failed; sending plain text", exc_info=True)
        return escape_mrkdwn(text).strip("\n")


# ---------------------------------------------------------------------------- chunks


@dataclass(frozen=True, slots=True)
class _Piece:
    text: str
    open_before: bool  # inside a code fence when this piece starts
    open_after: bool


def split_message(text: str, limit: int = MESSAGE_LIMIT) -> list[str]:
    """Split mrkdwn into messages of at most `limit` chars, in order.

    Breaks at a paragraph (blank line) when one is in the second half of a chunk, else
    at a line end, else inside an over-long line (at a space, never inside `&amp;` or
    `<url|label>`). A chunk cut inside a code fence is closed and the next reopens it,
    so every chunk renders on its own.
    """
    text = text.strip("\n")
    if not text.strip():
        return []
    if len(text) <= limit:
        return [text]
    budget = max(limit - len(_FENCE_OPEN) - len(_FENCE_CLOSE), 16)
    pieces = _pieces(text, budget)
    chunks: list[str] = []
    start = 0
    while start < len(pieces):
        end = _take(pieces, start, budget)
        chunk = _render(pieces[start:end])
        if chunk.strip():
            chunks.append(chunk)
        start = end
    return chunks


def ends_in_code_block(text: str) -> bool:
    """Whether `text` ends inside a ``` fence (by split_message's rule), i.e. the last
    chunk split_message makes of it gets a closing fence the text does not have yet."""
    in_fence = False
    for line in text.splitlines():
        if _toggles(line):
            in_fence = not in_fence
    return in_fence


def _toggles(line: str) -> bool:
    # A line with an odd number of fences toggles (```code``` on one line does not).
    return line.lstrip().startswith(_FENCE) and line.count(_FENCE) % 2 == 1


def _pieces(text: str, budget: int) -> list[_Piece]:
    pieces: list[_Piece] = []
    in_fence = False
    for line in text.splitlines(keepends=True):
        before = in_fence
        if _toggles(line):
            in_fence = not in_fence
        parts = _hard_split(line, budget) if len(line) > budget else [line]
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            pieces.append(_Piece(part, before, in_fence if last else before))
    return pieces


def _hard_split(line: str, budget: int) -> list[str]:
    parts: list[str] = []
    rest = line
    while len(rest) > budget:
        cut = _cut_point(rest, budget)
        parts.append(rest[:cut])
        rest = rest[cut:]
    if rest:
        parts.append(rest)
    return parts


def _cut_point(text: str, budget: int) -> int:
    window = text[:budget]
    cut = budget
    space = window.rfind(" ", budget // 2)
    if space > 0:
        cut = space + 1
    # Never split an entity (&amp;) or a link/mention (<...>): move the cut before it.
    lt = window.rfind("<", 0, cut)
    if lt > budget // 2 and window.find(">", lt, cut) == -1:
        cut = lt
    amp = window.rfind("&", max(0, cut - 8), cut)
    if amp > 0 and window.find(";", amp, cut) == -1:
        cut = amp
    return max(cut, 1)


def _take(pieces: list[_Piece], start: int, budget: int) -> int:
    total = 0
    end = start
    paragraph_end: int | None = None
    while end < len(pieces) and total + len(pieces[end].text) <= budget:
        total += len(pieces[end].text)
        end += 1
        if not pieces[end - 1].text.strip() and total >= budget // 2:
            paragraph_end = end
    if end == len(pieces):
        return end
    if paragraph_end is not None:
        return paragraph_end
    return max(end, start + 1)


def _render(pieces: list[_Piece]) -> str:
    body = "".join(p.text for p in pieces)
    opened = pieces[0].open_before
    still_open = pieces[-1].open_after
    body = body.rstrip("\n") if still_open else body.strip("\n")
    if opened:
        body = _FENCE_OPEN + body
    if still_open:
        body = body + _FENCE_CLOSE
    return body


# ---------------------------------------------------------------------------- inbound

_ANGLE = re.compile(r"<([^<>]*)>")
_ENTITIES = (("&lt;", "<"), ("&gt;", ">"), ("&amp;", "&"))


def mention_pattern(bot_user_id: str) -> re.Pattern[str]:
    return re.compile(r"<@" + re.escape(bot_user_id) + r"(?:\|[^<>]*)?>")


def slack_to_text(text: str, bot_user_id: str | None) -> tuple[str, bool]:
    """Slack message markup → the plain text the agent reads, and whether the bot was
    mentioned. The bot's own mention is removed; other markup becomes readable text."""
    text = clean_text(text)
    mentioned = False
    if bot_user_id:
        pattern = mention_pattern(bot_user_id)
        text, count = pattern.subn("", text)
        mentioned = count > 0
    text = _ANGLE.sub(_readable, text)
    for entity, char in _ENTITIES:
        text = text.replace(entity, char)
    return text.strip(), mentioned


def _readable(match: re.Match[str]) -> str:
    inner = match.group(1)
    target, _, label = inner.partition("|")
    if target.startswith("@"):  # user: <@U123> or <@U123|name>
        return "@" + (label or target[1:])
    if target.startswith("#"):  # channel
        return "#" + (label or target[1:])
    if target.startswith("!"):  # <!here>, <!subteam^ID|@team>, <!date^...|fallback>
        if label:
            return label
        return "@" + target[1:].split("^", 1)[0]
    if label and label != target:
        return f"{label} ({target})"
    return target
