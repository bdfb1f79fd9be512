"""Nightly consolidation (SPEC §4.6): each scope's new daily notes merged into MEMORY.md.

What counts as new is kept per scope and note in the database (a watermark: how many
characters of the note were merged, a digest of them, and the file's size and mtime), so
a second run with nothing new changes nothing and calls no model, a note that grew is
merged from where the last run stopped, and a note edited by hand is taken whole again.

A scope whose model call fails keeps its MEMORY.md and its watermarks: it is retried next
run, and it never blocks the other scopes (bounded concurrency, one task per scope).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.memory.files import MEMORY_FILE, Memory, NoteFile
from gateway.store.api import StoreBackend

log = logging.getLogger("gateway.consolidate")

MAX_INPUT_CHARS = 120_000  # new notes per model call (about 30k tokens)
MAX_ROUNDS = 4  # model calls per scope per run, when the backlog exceeds one call

SYSTEM_PROMPT = """\
You maintain MEMORY.md, the long-term memory of an assistant for one person or one group.
Merge the new daily notes into the current MEMORY.md and answer with the complete new
MEMORY.md, nothing else.

Keep: lasting facts about the people, their preferences and constraints, decisions and
their reasons, ongoing projects and where they stand, lessons from failed attempts, and
exact names, paths, numbers and errors that will matter later.
Drop: small talk, finished one-off details, duplicates. When a note contradicts the memory,
the newer note wins. Write short Markdown sections with bullet points. Stay under about
{target_tokens} tokens."""


class CompletionModel(Protocol):
    """What consolidation needs of gateway.model.ModelClient."""

    async def complete(self, messages: list[dict[str, Any]]) -> Any: ...


class ConsolidationError(Exception):
    """The model's answer cannot replace MEMORY.md (e.g. it is empty)."""


@dataclass(frozen=True, slots=True)
class Watermark:
    note: str
    chars: int  # characters of the note already merged
    digest: str  # sha256 of those characters
    size: int  # file size and mtime when read, to skip unchanged files without reading
    mtime_ns: int


@dataclass(frozen=True, slots=True)
class NoteDelta:
    note: NoteFile
    text: str  # the note's full text when read
    start: int  # merged up to here before this run
    end: int  # merged up to here after this run

    @property
    def new_text(self) -> str:
        return self.text[self.start : self.end]

    def watermark(self) -> Watermark:
        # A note merged only in part must be read again next time: no size to skip it by.
        size = self.note.size if self.end == len(self.text) else -1
        return Watermark(self.note.path, self.end, _digest(self.text[: self.end]), size, self.note.mtime_ns)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def consolidation_messages(
    memory_md: str, deltas: Sequence[NoteDelta], *, target_tokens: int
) -> list[dict[str, Any]]:
    notes = "\n\n".join(f"### {d.note.path}\n{d.new_text.strip()}" for d in deltas)
    user = (
        f"Current MEMORY.md:\n<memory>\n{memory_md.strip() or '(empty)'}\n</memory>\n\n"
        f"New daily notes, oldest first:\n<notes>\n{notes}\n</notes>"
    )
    return [
        {"role": "system", "content": SYSTEM_PROMPT.format(target_tokens=target_tokens)},
        {"role": "user", "content": user},
    ]


_FENCE = re.compile(r"^```[\w-]*\n(.*)\n```$", re.S)


def clean_reply(text: str | None) -> str:
    """The new MEMORY.md from the model's answer (without a wrapping code fence)."""
    body = (text or "").strip()
    fenced = _FENCE.match(body)
    return fenced.group(1).strip() if fenced else body


def take_within_budget(pending: Sequence[NoteDelta], budget: int) -> list[NoteDelta]:
    """The oldest new text that fits `budget` characters; a note that does not fit whole is
    cut on a line boundary (the rest waits for the next call)."""
    taken: list[NoteDelta] = []
    left = budget
    for delta in pending:
        size = delta.end - delta.start
        if size <= left:
            taken.append(delta)
            left -= size
            continue
        if left > 0:
            window = delta.text[delta.start : delta.start + left]
            cut = window.rfind("\n") + 1 or len(window)
            taken.append(NoteDelta(delta.note, delta.text, delta.start, delta.start + cut))
        break
    return taken


class Consolidator:
    def __init__(
        self, memory: Memory, store: StoreBackend, model: CompletionModel, *, concurrency: int = 2,
        target_tokens: int = 4000, timeout_s: float = 300, max_input_chars: int = MAX_INPUT_CHARS,
    ) -> None:
        self._memory = memory
        self._store = store
        self._model = model
        self._slots = asyncio.Semaphore(max(1, concurrency))
        self.target_tokens = target_tokens  # a reload may change it between runs
        self._timeout_s = timeout_s
        self._max_input_chars = max_input_chars

    async def run(self) -> dict[str, str]:
        """Consolidate every scope with memory; scope -> outcome."""
        scopes = await self._memory.scopes()
        outcomes = await asyncio.gather(*(self._guarded(scope) for scope in scopes))
        return dict(zip(scopes, outcomes, strict=True))

    async def _guarded(self, scope: str) -> str:
        async with self._slots:
            try:
                return await self.consolidate(scope)
            except asyncio.CancelledError:
                raise
            except Exception as err:  # one scope failing never stops the others
                log.warning("consolidation failed; retried next run",
                            extra={"scope": scope, "error": f"{type(err).__name__}: {err}"[:300]})
                return f"failed: {type(err).__name__}: {str(err)[:200]}"

    async def consolidate(self, scope: str) -> str:
        merged: set[str] = set()
        for _ in range(MAX_ROUNDS):
            pending = await self._pending(scope)
            if not pending:
                break
            batch = take_within_budget(pending, self._max_input_chars)
            if any(d.new_text.strip() for d in batch):
                snapshot = await self._memory.read_text(scope, MEMORY_FILE)
                new_text = await self._ask_model(snapshot, batch)
                if not await self._memory.replace_memory_md(scope, expected=snapshot, new_text=new_text):
                    return "retry: MEMORY.md was rewritten during the run"
                merged.update(d.note.path for d in batch if d.new_text.strip())
            await self._save_watermarks(scope, [d.watermark() for d in batch])
            if len(batch) == len(pending) and batch[-1].end == len(batch[-1].text):
                break
        return f"merged {len(merged)} note{'s' if len(merged) != 1 else ''}" if merged else "no new notes"

    async def _ask_model(self, memory_md: str, batch: Sequence[NoteDelta]) -> str:
        messages = consolidation_messages(memory_md, batch, target_tokens=self.target_tokens)
        async with asyncio.timeout(self._timeout_s):
            reply = await self._model.complete(messages)
        text = clean_reply(getattr(reply, "content", None))
        if not text:
            raise ConsolidationError("the model returned an empty MEMORY.md")
        return text

    async def _pending(self, scope: str) -> list[NoteDelta]:
        marks = await self._watermarks(scope)
        pending = []
        for note in await self._memory.daily_notes(scope):
            mark = marks.get(note.path)
            if mark is not None and (mark.size, mark.mtime_ns) == (note.size, note.mtime_ns):
                continue
            text = await self._memory.read_text(scope, note.path)
            start = 0
            if mark is not None and len(text) >= mark.chars and _digest(text[: mark.chars]) == mark.digest:
                start = mark.chars  # appended since: merge only the rest
            pending.append(NoteDelta(note, text, start, len(text)))
        return pending

    async def _watermarks(self, scope: str) -> dict[str, Watermark]:
        rows = await self._store.run(
            "SELECT note, chars, digest, size, mtime_ns FROM memory_watermarks WHERE scope=?", (scope,))
        return {r[0]: Watermark(r[0], r[1], r[2], r[3], r[4]) for r in rows}

    async def _save_watermarks(self, scope: str, marks: Sequence[Watermark]) -> None:
        now = time.time()
        sql = ("INSERT INTO memory_watermarks(scope, note, chars, digest, size, mtime_ns, updated_at) "
               "VALUES (?,?,?,?,?,?,?) ON CONFLICT(scope, note) DO UPDATE SET "
               "chars=excluded.chars, digest=excluded.digest, size=excluded.size, "
               "mtime_ns=excluded.mtime_ns, updated_at=excluded.updated_at")
        for m in marks:
            await self._store.run(sql, (scope, m.note, m.chars, m.digest, m.size, m.mtime_ns, now))
