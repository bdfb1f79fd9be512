"""What both store backends read and write: row types, and the conversions between a
stored row and the message vocabulary (text made storable, truncation and attachments
as JSON)."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from gateway.types import Attachment, Message, ToolCall, Truncation, attachment_from_dict, attachment_to_dict

log = logging.getLogger("gateway.store")

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")

# A session message's role as search results name it: a user message no person wrote says
# whose it is ("user (task)", "user (hook:github)"). SQL both backends run on `messages m`.
SEARCH_ROLE_SQL = "(CASE WHEN m.origin IS NULL THEN m.role ELSE m.role || ' (' || m.origin || ')' END)"


def storable_text(text: str, *, nul: bool) -> str:
    """`text` as UTF-8 can carry it: a lone surrogate (from a JSON escape in a model's or
    an MCP server's answer) becomes U+FFFD, and with `nul` so does NUL (PostgreSQL's TEXT
    cannot hold it; SQLite's can)."""
    if nul and "\x00" in text:
        text = text.replace("\x00", "\ufffd")
    if not text.isascii():
        text = _LONE_SURROGATE.sub("\ufffd", text)
    return text


def storable_args(args: Iterable[Any], *, nul: bool) -> tuple[Any, ...]:
    """Statement arguments with every text (also inside a list argument) storable."""
    out: list[Any] = []
    for value in args:
        if isinstance(value, str):
            value = storable_text(value, nul=nul)
        elif isinstance(value, list):
            value = [storable_text(v, nul=nul) if isinstance(v, str) else v for v in value]
        out.append(value)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class SessionRow:
    key: str
    scope: str
    channel: str
    created_at: float
    updated_at: float
    context_start_turn: int
    model: str | None = None  # the model alias picked with /model (SPEC §5.5); None: the agent's


@dataclass(frozen=True, slots=True)
class PendingEvent:
    channel: str
    event_id: str
    session_key: str | None
    inbound: dict[str, Any]
    created_at: float
    status: str = "accepted"
    turn: int | None = None


@dataclass(frozen=True, slots=True)
class StoredSummary:
    text: str
    upto_turn: int
    reason: str
    created_at: float


@dataclass(frozen=True, slots=True)
class JobRun:
    job: str
    slot: str
    started_at: float
    ended_at: float | None
    outcome: str
    detail: str | None


def slot_time(slot: str) -> datetime | None:
    """When a run's slot was: `start:<iso>:<id>` (a start), `manual:<iso>`, or the fire time."""
    text = slot
    if slot.startswith("start:"):
        text = slot.removeprefix("start:").rsplit(":", 1)[0]
    elif slot.startswith("manual:"):
        text = slot.removeprefix("manual:")
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        return None


def slot_words(slot: str) -> str:
    """A slot as people read it: "at start 2026-11-30 20:09", "2026-11-30 00:00"."""
    at = slot_time(slot)
    when = at.strftime("%Y-%m-%d %H:%M") if at is not None else slot
    if slot.startswith("start:"):
        return f"at start {when}"
    if slot.startswith("manual:"):
        return f"run by hand {when}"
    return when


@dataclass(frozen=True, slots=True)
class SessionSummary:
    """One row of the admin page's sessions list."""
    key: str
    channel: str
    updated_at: float
    turns: int
    tokens_today: int  # tokenizer counts of the messages stored since `day_start`
    scope: str = ""  # its memory scope: `<agent>/<scope>` for agents other than default
    model: str | None = None  # the alias picked with /model; None: the agent's model


@dataclass(frozen=True, slots=True)
class PendingPairing:
    code: str
    identity: str
    created_at: float
    expires_at: float


@dataclass(frozen=True, slots=True)
class UsageDay:
    identity: str
    day: str
    turns: int
    tokens: int


# A chat's history as the person saw it: what they wrote and the final replies (no tool
# traffic, no gateway notices, no scheduled task's prompt: only its reply was shown).
HISTORY_SHOWN = ("session_key=? AND injected=0 "
                 "AND ((role='user' AND origin IS NULL) OR (role='assistant' AND tool_calls IS NULL))")
HISTORY_PAGE_CHARS = 256_000  # text per page of history, however large the messages


@dataclass(frozen=True, slots=True)
class HistoryPage:
    """Some of a chat's history, oldest first, and where the page before it ends."""

    messages: list[Message]
    older: tuple[int, int] | None  # (turn, seq) to read on from (`before`); None: nothing older


# Where a command's answer stands in the history: after every message of its turn (their
# seq is small), in the order answers were stored. Part of the history's cursor.
COMMAND_SEQ = 1_000_000_000


@dataclass(frozen=True, slots=True)
class CommandAnswer:
    """An in-chat command and its answer, as the chat showed them (never in the context)."""

    command: str
    answer: str
    turn: int  # the session's last turn when it was answered
    fresh_context: bool  # it started a fresh context (/new, /context clear)
    created_at: float


@dataclass(frozen=True, slots=True)
class ConversationPage:
    """Some of a chat's history with its command answers, oldest first, and where the page
    before it ends (a (turn, seq) cursor; None: nothing older)."""

    entries: list[Message | CommandAnswer]
    older: tuple[int, int] | None


def command_answer(row: Any) -> CommandAnswer:
    return CommandAnswer(command=row["command"], answer=row["answer"], turn=int(row["turn"]),
                         fresh_context=bool(row["fresh_context"]), created_at=float(row["created_at"]))


def history_cut(sizes: Sequence[int], *, limit: int, max_chars: int) -> int:
    """How many of the newest messages (their sizes, newest first) one page holds: at
    most `limit`, with at most `max_chars` of text together, and always one (a single
    message longer than that still comes whole, so a reader never stalls)."""
    total = taken = 0
    for size in sizes[:limit]:
        if taken and total + size > max_chars:
            break
        total += size
        taken += 1
    return taken


def count_noun(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def like_pattern(term: str) -> str:
    """`term` anywhere in the text, for LIKE ... ESCAPE '\\' (its own % and _ literal)."""
    escaped = term.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


def truncation_to_json(t: Truncation | None) -> str | None:
    if t is None:
        return None
    return json.dumps(
        {name: getattr(t, name) for name in t.__dataclass_fields__}, ensure_ascii=False
    )


def truncation_from_json(text: str | None) -> Truncation | None:
    if not text:
        return None
    data = json.loads(text)
    known = {k: v for k, v in data.items() if k in Truncation.__dataclass_fields__}
    if "shown" in known:
        known["shown"] = tuple(tuple(r) for r in known["shown"])
    return Truncation(**known)


def attachments_to_json(attachments: tuple[Attachment, ...]) -> str | None:
    """The files a message carried (metadata only: paths, sizes, an image's dimensions)."""
    if not attachments:
        return None
    return json.dumps([attachment_to_dict(a) for a in attachments], ensure_ascii=False)


def attachments_from_json(text: str | None) -> tuple[Attachment, ...]:
    if not text:
        return ()
    try:
        data = json.loads(text)
        return tuple(attachment_from_dict(a) for a in data if isinstance(a, dict))
    except (ValueError, TypeError):
        log.warning("unreadable attachments of a stored message ignored")
        return ()


def session_row(row: Any) -> SessionRow:
    return SessionRow(
        key=row["key"], scope=row["scope"], channel=row["channel"], created_at=row["created_at"],
        updated_at=row["updated_at"], context_start_turn=row["context_start_turn"], model=row["model"],
    )


def row_to_message(row: Any) -> Message:
    calls = tuple(ToolCall(**c) for c in json.loads(row["tool_calls"])) if row["tool_calls"] else ()
    return Message(
        role=row["role"],
        content=row["content"],
        turn=row["turn"],
        tool_calls=calls,
        tool_call_id=row["tool_call_id"],
        tool_name=row["tool_name"],
        truncation=truncation_from_json(row["truncation"]),
        injected=bool(row["injected"]),
        origin=row["origin"],
        id=row["id"],
        created_at=row["created_at"],
        attachments=attachments_from_json(row["attachments"]),
    )


@dataclass(frozen=True, slots=True)
class StoreStats:
    rows: dict[str, int]  # rows written by group commit, by table
    commits: dict[str, int]  # the commits (multi-row statements) they took
    checkpoints: int
    wal_frames: int  # frames in the WAL when last checked
    wal_restarts: int

