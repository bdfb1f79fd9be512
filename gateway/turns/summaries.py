"""Background summaries of dropped turns (SPEC §4.2, §4.5, §7): never delays a reply; a
failure or timeout falls back to an extractive note; nothing is lost.

A session's turns go into long-term memory by *folds*, one at a time per session (a
lock), each starting where the last one stopped: the database's latest summary says up to
which turn the session is in memory (`upto_turn`), and a fold reads the turns after it
from the store (full tool chains, also of turns a restart reduced to text). So racing
summaries, a trim and a restore's catch-up never summarize or archive a turn twice, also
across restarts. A fold appends to the daily note only what it added to the cumulative
summary (the database keeps the whole), archives the raw messages to dialog/ with tool
outputs in full, and records its coverage last: a crash in between repeats that fold
rather than losing it.

A fold's summary goes to the live context the moment it is there (the next decision step
uses it); asks that queue up behind a running fold are folded together in one call. The
purge folds the turns it is about to delete that no summary covers yet (`remember`).
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from context.effects import SummarizeTurns, SummaryReason
from context.summary import extractive_summary, summary_request
from gateway import beneath
from gateway.beneath import PathNotAllowed
from gateway.keys import workspace_dir
from gateway.model.errors import ModelError
from gateway.services import Services
from gateway.turns.live import LiveSession
from gateway.types import Message

log = logging.getLogger("gateway.summarizer")

FOLD_MAX_TURNS = 50  # turns per summary request when a long history is caught up
CATCH_UP_CONCURRENCY = 4  # sessions catching up at once after a restart (each one model call at a time)
_EMPTY_LINES = {"(none)", "- (none)", "none"}


def dialog_row(session_key: str, msg: Message, content: str, excerpt_of: str | None) -> dict[str, Any]:
    """One line of dialog/YYYY-MM-DD.jsonl."""
    row: dict[str, Any] = {
        "session_key": session_key,
        "turn": msg.turn,
        "role": msg.role,
        "content": content,
        "tool_call_ids": [c.id for c in msg.tool_calls] or ([msg.tool_call_id] if msg.tool_call_id else []),
        "tool_calls": [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in msg.tool_calls],
        "time": datetime.fromtimestamp(msg.created_at).astimezone().isoformat(timespec="seconds"),
    }
    if msg.tool_name:
        row["tool_name"] = msg.tool_name
    if msg.origin:
        row["origin"] = msg.origin  # e.g. "task": a scheduled task's prompt, not a person's words
    if msg.attachments:  # the files the person sent with it (SPEC §5.4), where they were saved
        row["files"] = [
            {"name": a.name, "path": a.path, "kind": a.kind, "size": a.size, **({"error": a.error} if a.error else {})}
            for a in msg.attachments
        ]
    if excerpt_of:
        row["excerpt_of"] = excerpt_of  # content is an excerpt of this workspace file
    return row


def _heading_level(line: str) -> int:
    level = len(line) - len(line.lstrip("#"))
    return level if 0 < level <= 6 and line[level:level + 1] == " " else 0


def summary_delta(previous: str | None, current: str) -> str:
    """The lines of `current` that `previous` lacks, under their section headings: what
    the newly folded turns added or changed. Empty when nothing is new."""
    if not previous or not previous.strip():
        return current.strip()
    known = {line.strip() for line in previous.splitlines() if line.strip()}
    out: list[str] = []
    pending: list[tuple[int, str]] = []  # headings above the next new line, not written yet
    for line in current.splitlines():
        stripped = line.strip()
        if not stripped:
            continue
        level = _heading_level(stripped)
        if level:
            pending = [h for h in pending if h[0] < level] + [(level, stripped)]
            continue
        if stripped in known or stripped.lower() in _EMPTY_LINES:
            continue
        for lvl, heading in pending:
            if out and lvl <= 2:
                out.append("")
            out.append(heading)
        pending = []
        out.append(line.rstrip())
    return "\n".join(out).strip()


@dataclass(frozen=True, slots=True)
class _Folding:
    """Whose turns a fold takes into memory, and who is told when it is done."""

    key: str
    scope: str
    workspace: Path
    offer: Callable[[str, int], None] | None = None  # the live context's offer_summary


class Summarizer:
    def __init__(self, services: Services) -> None:
        self.s = services
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        self._catch_up_slots = asyncio.Semaphore(CATCH_UP_CONCURRENCY)

    def submit(self, live: LiveSession, effect: SummarizeTurns) -> None:
        """Fold the turns up to `effect.upto_turn` into long-term memory, in the background."""
        self._spawn(live, effect.upto_turn, effect.reason)

    def catch_up(self, live: LiveSession, upto_turn: int) -> None:
        """After a restore: the turns up to `upto_turn` left the live context with the
        restart; fold those no summary covers yet, as a trim would have done (SPEC §4.5)."""
        self._spawn(live, upto_turn, "restore")

    def _spawn(self, live: LiveSession, upto: int, reason: SummaryReason) -> None:
        if upto in live.summarizing:
            return
        live.summarizing.add(upto)  # keeps the session cached (not evicted) meanwhile
        # The context start is taken now: a fold asked before a /context clear still
        # covers the turns it was asked for.
        start = live.context_start
        self.s.background.spawn(self._run(live, upto, reason, start), name=f"summary:{live.key}:{upto}")

    def _lock(self, key: str) -> asyncio.Lock:
        lock = self._locks.get(key)
        if lock is None:
            lock = asyncio.Lock()
            self._locks[key] = lock
        return lock

    async def _run(self, live: LiveSession, asked: int, reason: SummaryReason, start: int) -> None:
        upto = asked
        try:
            # The session lock first (folds run in the order they were asked), then a slot:
            # after a restart many sessions catch up at once, and replies must not starve.
            slots: AbstractAsyncContextManager[Any] = (
                self._catch_up_slots if reason == "restore" else nullcontext()
            )
            async with self._lock(live.key), slots:
                if start == live.context_start:
                    # Asks that queued up behind a running fold go in the same call: one
                    # summary of the whole range, as soon as this one would have come.
                    upto = max(upto, *live.summarizing)
                target = _Folding(live.key, live.scope, live.workspace, live.ctx.offer_summary)
                while await self._fold(target, upto, reason, start):
                    pass
        finally:
            live.summarizing.discard(asked)

    async def remember(self, sessions: Sequence[tuple[str, int]]) -> int:
        """Before the purge deletes turns up to `upto` of each (session key, upto): fold
        those no summary covers yet into long-term memory (SPEC §7), a few sessions at a
        time; how many sessions needed it. Turns a /context clear left are folded on their
        own first, so the context after the clear never shows a summary of what came
        before it. When the model is down a fold archives the raw turns and writes the
        extractive note. Raises when memory cannot be written: the purge then stops."""
        store = self.s.store
        slots = asyncio.Semaphore(CATCH_UP_CONCURRENCY)

        async def one(key: str, upto: int) -> bool:
            row = await store.get_session(key)
            latest = await store.latest_summary(key)
            if row is None or upto <= 0 or (latest is not None and latest.upto_turn >= upto):
                return False  # in memory already (most sessions), or nothing to say whose it was
            target = _Folding(key, row.scope, workspace_dir(self.s.data_dir, row.scope))
            start = row.context_start_turn
            async with slots, self._lock(key):
                if start > 1:
                    while await self._fold(target, min(upto, start - 1), "purge", 1):
                        pass
                while await self._fold(target, upto, "purge", start):
                    pass
            return True

        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one(key, upto)) for key, upto in sessions]
        return sum(1 for task in tasks if task.result())

    async def _fold(self, target: _Folding, upto: int, reason: SummaryReason, start: int) -> bool:
        """Fold the next piece of turns after the covered ones, up to `upto`; True when
        more remains."""
        store = self.s.store
        latest = await store.latest_summary(target.key)
        covered = latest.upto_turn if latest is not None else 0
        first = max(covered, start - 1) + 1  # turns before the context start were cleared
        if first > upto:
            # A fold asked elsewhere (a restore's catch-up, the purge, another ask) covers
            # these turns already: the live context gets that summary.
            if latest is not None and latest.upto_turn >= start and target.offer is not None:
                target.offer(latest.text, latest.upto_turn)
            return False
        messages = await store.turn_messages(target.key, from_turn=first, to_turn=upto, max_turns=FOLD_MAX_TURNS)
        if not messages:
            return False
        turns = sorted({m.turn for m in messages})
        last = upto if len(turns) < FOLD_MAX_TURNS else turns[-1]
        # A summary from before the context start belongs to cleared turns: start afresh.
        previous = latest.text if latest is not None and latest.upto_turn >= start else None
        effect = SummarizeTurns(session_key=target.key, messages=tuple(messages), previous_summary=previous,
                                upto_turn=last, reason=reason, new_from_turn=first)
        text = await self._model_summary(effect)
        if text is None:
            self.s.metrics.summary_failures.inc()
            text = extractive_summary(effect)
        memory = self.s.memory
        if memory is not None:
            note = summary_delta(previous, text)
            if not note:  # the model found nothing new: still note what these turns were
                note = extractive_summary(SummarizeTurns(target.key, effect.messages, None, last, reason))
            span = f"turn {turns[0]}" if turns[0] == turns[-1] else f"turns {turns[0]}–{turns[-1]}"
            await memory.append_daily(target.scope, note, heading=f"{target.key}, {span} ({reason})")
            rows = await self._dialog_rows(target, messages)
            if rows:
                await memory.archive_dialog(target.scope, rows)
        # Recorded last: it is what tells later folds (and restarts) these turns are done.
        await store.add_summary(target.key, target.scope, upto_turn=last, reason=reason, text=text)
        self.s.metrics.compactions.labels(reason).inc()
        if target.offer is not None:
            target.offer(text, last)
        return last < upto

    async def _model_summary(self, effect: SummarizeTurns) -> str | None:
        try:
            async with asyncio.timeout(self.s.cfg.summary_timeout_s):
                async with self.s.model_slots:
                    reply = await self.s.summary_model.complete(summary_request(effect))
        except (ModelError, TimeoutError) as err:
            log.warning("summary failed; using the extractive note",
                        extra={"session": effect.session_key, "error": str(err)[:200]})
            return None
        text = (reply.content or "").strip()
        return text or None

    async def _dialog_rows(self, target: _Folding, messages: list[Message]) -> list[dict[str, Any]]:
        """The raw messages as archived: a tool output cut at stage 1 is archived whole,
        from the file it was saved to; a read_file window names the file it came from."""
        rows: list[dict[str, Any]] = []
        for msg in messages:
            if msg.injected:
                continue
            content, excerpt_of = msg.content, None
            cut = msg.truncation if msg.role == "tool" else None
            if cut is not None:
                full = await self._saved_output(target, cut.path, cut.total_chars) if cut.saved else None
                if full is not None:
                    content = full
                else:
                    excerpt_of = cut.path
            rows.append(dialog_row(target.key, msg, content, excerpt_of))
        return rows

    async def _saved_output(self, target: _Folding, path: str, total_chars: int) -> str | None:
        def read() -> str:
            # Bytes, not text mode: universal newlines would turn CRLF into LF.
            return beneath.read_bytes(target.workspace, path).decode("utf-8", errors="replace")

        try:
            text = await asyncio.to_thread(read)
        except FileNotFoundError:
            return None  # purged (tool_result_ttl_days): the excerpt with its notice is what is left
        except (OSError, PathNotAllowed) as err:
            log.warning("saved tool output unreadable; archiving the excerpt",
                        extra={"session": target.key, "path": path, "error": str(err)[:200]})
            return None
        return text if len(text) == total_chars else None  # replaced meanwhile: not this output
