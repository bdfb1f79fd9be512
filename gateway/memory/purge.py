"""The retention purge (SPEC §7): what is past its time goes, in small batches.

Sessions whose last activity is older than `session_retention_days` go with their
messages and summaries, and so do the older messages (and command answers) of sessions
still in use; files
people sent (files/, SPEC §5.4) older than that go too, as their messages do; dedup
records of platform events older than 7 days go; so do scheduled tasks' run records, and
tasks that ended, past the session retention; saved tool outputs
(tool_results/*.txt) older than `tool_result_ttl_days` go unless a live context still
points at them. Long-term memory (MEMORY.md, memory/, dialog/) stays.

Nothing leaves the database before it reached long-term memory: before a session's turns
go, `remember` (the summarizer's folds, gateway/turns/summaries.py) takes the turns no
summary covers yet — a quiet chat that never reached a trim — into the daily note and the
`dialog/` archive, a batch of sessions at a time.

Every statement deletes at most one batch and commits, and the loop yields between
batches, so a chat's write never waits behind the whole purge.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from gateway.beneath import Dir, PathNotAllowed
from gateway.store.api import StoreBackend
from gateway.store.errors import StoreUnavailable
from gateway.tasks.store import TaskStore

log = logging.getLogger("gateway.purge")

DAY = 86_400.0
DEDUP_DAYS = 7
ROW_BATCH = 250  # rows per statement: keeps a chat's write from waiting long behind one
SESSION_BATCH = 50
FILE_BATCH = 200
READ_BATCH = 2000  # old messages read per statement to find the turns to remember
TOOL_RESULTS = "tool_results"  # a workspace's saved tool outputs (gateway.memory.files)
FILES_DIR = "files"  # and the files people sent (gateway.media)

# (session key, highest turn that goes) → those turns are in long-term memory; how many
# sessions needed a fold. Raises when memory cannot be written: nothing more is deleted.
Remember = Callable[[list[tuple[str, int]]], Awaitable[int]]


@dataclass(frozen=True, slots=True)
class PurgeReport:
    sessions: int = 0
    messages: int = 0
    summaries: int = 0
    events: int = 0
    tool_results: int = 0
    seconds: float = 0.0
    task_records: int = 0  # task runs and ended tasks
    files: int = 0  # files people sent, past retention
    command_answers: int = 0  # in-chat commands and their answers, kept for the history
    remembered: int = 0  # sessions whose unsummarized turns were taken into memory first

    def line(self) -> str:
        tasks = f"{self.task_records} task records, " if self.task_records else ""
        files = f", {self.files} sent files" if self.files else ""
        commands = f"{self.command_answers} command answers, " if self.command_answers else ""
        remembered = f" ({self.remembered} summarized into memory first)" if self.remembered else ""
        return (
            f"{self.sessions} sessions, {self.messages} messages{remembered}, {commands}{self.summaries} summaries, "
            f"{self.events} dedup records, {tasks}{self.tool_results} tool outputs{files} "
            f"in {self.seconds:.2f}s"
        )


async def purge(
    store: StoreBackend, data_dir: Path, *, now: float, session_retention_days: int, tool_result_ttl_days: int,
    live_references: Callable[[], set[Path]], batch: int = ROW_BATCH, remember: Remember | None = None,
) -> PurgeReport:
    started = time.monotonic()
    before = now - session_retention_days * DAY
    sessions, messages, summaries, remembered = await _purge_sessions(store, before=before, batch=batch,
                                                                      remember=remember)
    old, more = await _purge_old_messages(store, before=before, batch=batch, remember=remember)
    messages += old
    remembered += more
    command_answers = 0
    while (n := await store.delete_command_answers_before(before, limit=batch)) > 0:
        command_answers += n
        await asyncio.sleep(0)
    events = 0
    while (n := await store.delete_events_before(now - DEDUP_DAYS * DAY, limit=batch)) > 0:
        events += n
        await asyncio.sleep(0)
    task_records = 0
    tasks = TaskStore(store)
    while (n := await tasks.purge(before, limit=batch)) > 0:
        task_records += n
        await asyncio.sleep(0)
    files = await purge_tool_results(data_dir, before=now - tool_result_ttl_days * DAY,
                                     live_references=live_references)
    sent = await purge_sent_files(data_dir, before=before)
    await _checkpoint(store)
    return PurgeReport(sessions, messages, summaries, events, files, time.monotonic() - started, task_records,
                       sent, command_answers, remembered)


async def _checkpoint(store: StoreBackend, attempts: int = 5) -> None:
    """Truncate the WAL; a chat's write caught between its statement and its commit makes
    the checkpoint fail ("table is locked"), so try again a moment later."""
    for attempt in range(1, attempts + 1):
        try:
            await store.checkpoint()
            return
        except StoreUnavailable as err:
            if attempt == attempts:
                log.warning("WAL checkpoint skipped after the purge: %s", err)
                return
            await asyncio.sleep(0.01 * attempt)


async def _purge_sessions(store: StoreBackend, *, before: float, batch: int,
                          remember: Remember | None) -> tuple[int, int, int, int]:
    sessions = messages = summaries = remembered = 0
    while keys := await store.expired_session_keys(before, limit=SESSION_BATCH):
        if remember is not None:
            remembered += await remember([(key, await store.last_turn(key)) for key in keys])
        while (n := await store.delete_session_messages(keys, before=before, limit=batch)) > 0:
            messages += n
            await asyncio.sleep(0)  # let queued chat writes in between batches
        while (n := await store.delete_session_summaries(keys, limit=batch)) > 0:
            summaries += n
        gone = await store.delete_sessions(keys, before=before)
        sessions += gone
        if gone == 0:
            break  # every one of them became active again meanwhile: nothing more is expired
        await asyncio.sleep(0)
    return sessions, messages, summaries, remembered


async def _purge_old_messages(store: StoreBackend, *, before: float, batch: int,
                              remember: Remember | None) -> tuple[int, int]:
    """Messages past retention in sessions that are still active (SPEC §4.5 purges both).
    Only the old front of the table is walked: ids below the first newer message."""
    newest_kept = await store.first_message_id_since(before)
    if newest_kept is None:
        return 0, 0  # nothing newer: every old message belonged to an expired session
    remembered = 0
    if remember is not None:
        remembered = await _remember_old_turns(store, remember, before=before, below_id=newest_kept)
    deleted = 0
    while (n := await store.delete_messages_before(before, below_id=newest_kept, limit=batch)) > 0:
        deleted += n
        await asyncio.sleep(0)  # let queued chat writes in between batches
    return deleted, remembered


async def _remember_old_turns(store: StoreBackend, remember: Remember, *, before: float, below_id: int) -> int:
    """The old turns of sessions still in use (a quiet chat that never trimmed keeps its
    first turns live for weeks) go into memory before their messages go."""
    upto: dict[str, int] = {}
    after = 0
    while True:
        turns, last = await store.old_message_turns(before, after_id=after, below_id=below_id, limit=READ_BATCH)
        if last is None:
            break
        for key, turn in turns.items():
            upto[key] = max(upto.get(key, 0), turn)
        after = last
        await asyncio.sleep(0)
    sessions = sorted(upto.items())
    remembered = 0
    for i in range(0, len(sessions), SESSION_BATCH):
        remembered += await remember(sessions[i : i + SESSION_BATCH])
    return remembered


# A file to delete: (the scope's workspace, its path there). Found and deleted through
# descriptors, never by a path string: a sandbox of that workspace may swap names meanwhile.
Doomed = tuple[Path, str]


def _workspaces(data_dir: Path) -> list[Path]:
    """Each scope's workspace (real directories only; scopes/ is the gateway's own)."""
    scopes = data_dir / "scopes"
    try:
        with os.scandir(scopes) as entries:
            return [scopes / e.name for e in entries if e.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        return []


def _expired_tool_results(data_dir: Path, before: float) -> list[Doomed]:
    found: list[Doomed] = []
    for ws_path in _workspaces(data_dir):
        try:
            with Dir.open(ws_path) as ws:
                entries = ws.scandir(TOOL_RESULTS)
        except (OSError, PathNotAllowed):
            continue  # none, or a planted link: never walked out of the workspace
        found += [(ws_path, f"{TOOL_RESULTS}/{e.name}") for e in entries
                  if e.is_file and e.name.endswith(".txt") and e.stat.st_mtime < before]
    return found


def _expired_sent_files(data_dir: Path, before: float) -> list[Doomed]:
    """Files under each scope's files/ (previews and left-over partial downloads
    included) last written before `before`; never through a link."""
    found: list[Doomed] = []
    for ws_path in _workspaces(data_dir):
        try:
            ws = Dir.open(ws_path)
        except OSError:
            continue
        with ws:
            pending = [FILES_DIR]
            while pending:
                directory = pending.pop()
                try:
                    entries = ws.scandir(directory)
                except (OSError, PathNotAllowed):
                    continue
                for entry in entries:
                    rel = f"{directory}/{entry.name}"
                    if entry.is_dir:
                        pending.append(rel)
                    elif entry.stat.st_mtime < before:
                        found.append((ws_path, rel))
    return found


async def purge_sent_files(data_dir: Path, *, before: float) -> int:
    """Delete files people sent that are past `session_retention_days` (SPEC §5.4)."""
    doomed = await asyncio.to_thread(_expired_sent_files, data_dir, before)
    deleted = 0
    for i in range(0, len(doomed), FILE_BATCH):
        deleted += await asyncio.to_thread(_delete_files, doomed[i : i + FILE_BATCH])
    return deleted


def _delete_files(doomed: Iterable[Doomed]) -> int:
    count = 0
    opened: dict[Path, Dir] = {}
    try:
        for ws_path, rel in doomed:
            try:
                ws = opened.get(ws_path) or opened.setdefault(ws_path, Dir.open(ws_path))
                ws.unlink(rel)  # unlinkat in a directory opened without following a link
                count += 1
            except (FileNotFoundError, NotADirectoryError, PathNotAllowed):
                pass
    finally:
        for ws in opened.values():
            ws.close()
    return count


async def purge_tool_results(
    data_dir: Path, *, before: float, live_references: Callable[[], set[Path]]
) -> int:
    candidates = await asyncio.to_thread(_expired_tool_results, data_dir, before)
    if not candidates:
        return 0
    live = live_references()
    # Compared as written (absolute, normalized), never by following links: a link would
    # only let a sandbox choose what is kept.
    keep = await asyncio.to_thread(lambda: {os.path.abspath(p) for p in live})
    doomed = await asyncio.to_thread(lambda: [d for d in candidates if os.path.abspath(d[0] / d[1]) not in keep])
    deleted = 0
    for i in range(0, len(doomed), FILE_BATCH):
        deleted += await asyncio.to_thread(_delete_files, doomed[i : i + FILE_BATCH])
    return deleted
