"""The SQLite store (aiosqlite, WAL): the source of truth for sessions and messages.

One connection, so one writer: aiosqlite runs every statement on its own thread, in
order, and nothing blocks the event loop. The connection is in autocommit mode and the
hot paths are one statement each (RETURNING, triggers), because every aiosqlite call is a
round trip to that thread: a turn costs a handful of them, not dozens. Behind this small
interface a PostgreSQL store could join later.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import aiosqlite

from gateway.config.chat import ConfigChange, unshareable
from gateway.store.checkpoints import Checkpointer
from gateway.store.errors import StoreError, from_sqlite
from gateway.store.group_commit import GroupInsert
from gateway.store.migrations.sqlite import MIGRATIONS
from gateway.store.rows import (
    COMMAND_SEQ,
    HISTORY_PAGE_CHARS,
    HISTORY_SHOWN,
    SEARCH_ROLE_SQL,
    CommandAnswer,
    ConversationPage,
    HistoryPage,
    JobRun,
    PendingEvent,
    PendingPairing,
    SessionRow,
    SessionSummary,
    StoredSummary,
    StoreStats,
    UsageDay,
    attachments_to_json,
    command_answer,
    count_noun,
    history_cut,
    like_pattern,
    row_to_message,
    session_row,
    storable_args,
    truncation_to_json,
)
from gateway.types import Message
from gateway.workspace import make_private_dir, restrict_mode

log = logging.getLogger("gateway.store")

CHECKPOINT_INTERVAL_S = 0.2
# Reply refs of several events in one statement (both backends: UPDATE ... FROM a VALUES
# list, whose columns are column1, column2 ... on SQLite and PostgreSQL alike).
REPLY_REFS_SQL = "UPDATE events SET reply_ref = v.column3 FROM (VALUES (?,?,?)"
REPLY_REFS_AFTER = ") AS v WHERE events.channel = v.column1 AND events.event_id = v.column2"
WRITES = ("INSERT", "UPDATE", "DELETE", "REPLAC")  # how a statement that changes rows starts


async def _connect(path: Path) -> aiosqlite.Connection:
    """An autocommit connection with rows by name. Raises OSError or aiosqlite.Error."""
    connecting = aiosqlite.connect(str(path), timeout=10, isolation_level=None)
    try:
        db = await connecting
    except (OSError, aiosqlite.Error):
        # aiosqlite stops its worker thread without waiting; wait here, or the thread
        # reports to an event loop that may be closed by then.
        worker = getattr(connecting, "_thread", connecting)
        if isinstance(worker, threading.Thread) and worker.ident is not None:
            for _ in range(200):  # it ends within milliseconds; bounded all the same
                if not worker.is_alive():
                    break
                await asyncio.sleep(0.005)
        raise
    db.row_factory = aiosqlite.Row
    return db


def _prepare_files(path: Path) -> None:
    """The data dir 0700 when created here, the database 0600 whatever the umask (SQLite
    gives its -wal and -shm files the database file's mode); existing ones are made private."""
    make_private_dir(path.parent)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # SQLite takes an empty file as new
    except FileExistsError:
        pass
    else:
        try:
            os.fchmod(fd, 0o600)  # the umask may have taken more than group and other bits
        finally:
            os.close(fd)
    for name in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        restrict_mode(name)


class Store:
    def __init__(self, db: aiosqlite.Connection, path: Path) -> None:
        self._db = db
        self.path = path
        self._checkpointer: Checkpointer | None = None
        self._statements = 0  # through _rows; the checkpointer skips its turn while it stands still
        self._read_only = False  # opened by open_read_only
        # The error of the last write that failed (disk full, I/O error), until one succeeds
        # again: /readyz reports it.
        self.write_failure: str | None = None
        # The three inserts of every turn, group-committed (gateway/store/group_commit.py).
        self._messages = GroupInsert(
            self._rows,
            "INSERT INTO messages(session_key, turn, seq, role, content, tool_calls, tool_call_id, "
            "tool_name, truncation, injected, token_count, created_at, event_channel, event_id, origin, "
            "attachments) "
            "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            returning="id, session_key", key_of=lambda r: r[1],
        )
        self._events = GroupInsert(
            self._rows,
            "INSERT OR IGNORE INTO events(channel, event_id, session_key, status, inbound, created_at) "
            "VALUES (?,?,?,?,?,?)",
            returning="channel, event_id", key_of=lambda r: (r[0], r[1]),
        )
        self._turn_ends = GroupInsert(
            self._rows,
            "INSERT INTO turn_ends(channel, event_id, status, at, identity, day, tokens) VALUES (?,?,?,?,?,?,?)",
        )
        # Where a reply shows, written as soon as the platform answered: its own statement,
        # shared only by refs that came while the last one was written (REPLY_REFS_SQL).
        self._reply_refs = GroupInsert(self._rows, REPLY_REFS_SQL, after=REPLY_REFS_AFTER)

    @classmethod
    async def open(cls, path: Path, *, checkpoint_interval_s: float | None = CHECKPOINT_INTERVAL_S) -> Store:
        """Open (creating and migrating) the database. With `checkpoint_interval_s`, WAL
        checkpoints run from a connection of their own (gateway/store/checkpoints.py)."""
        try:
            _prepare_files(path)  # a few system calls, once (a thread here would outlive a failed open)
        except OSError as err:
            raise StoreError(f"cannot open the database {path}: {err}") from err
        try:
            db = await _connect(path)
        except (OSError, aiosqlite.Error) as err:
            raise StoreError(f"cannot open the database {path}: {err}") from err
        store = cls(db, path)
        try:
            await store._setup()
        except (OSError, aiosqlite.Error, StoreError) as err:
            await db.close()
            raise StoreError(f"cannot initialise the database {path}: {err}") from err
        if checkpoint_interval_s is not None:
            await store._start_checkpointer(checkpoint_interval_s)
        return store

    @classmethod
    async def open_read_only(cls, path: Path) -> Store:
        """The existing database on a read-only connection (the operators' commands): never
        creates, migrates or writes anything (close() makes no checkpoint either)."""
        try:
            db = await aiosqlite.connect(path.as_uri() + "?mode=ro", uri=True, timeout=10)
        except (OSError, aiosqlite.Error) as err:
            raise StoreError(f"cannot open the database {path}: {err}") from err
        db.row_factory = aiosqlite.Row
        store = cls(db, path)
        store._read_only = True
        return store

    async def _setup(self) -> None:
        for pragma in ("journal_mode=WAL", "synchronous=NORMAL", "foreign_keys=ON", "busy_timeout=5000"):
            await self._db.execute_fetchall(f"PRAGMA {pragma}")
        version = await self.schema_version()
        for number, script in enumerate(MIGRATIONS, start=1):
            if number <= version:
                continue
            await self._db.executescript(f"BEGIN;\n{script}\nPRAGMA user_version={number};\nCOMMIT;")

    async def _start_checkpointer(self, interval_s: float) -> None:
        try:
            self._checkpointer = await Checkpointer.start(self.path, interval_s, _connect, self._restart_wal,
                                                          writes=lambda: self._statements)
        except (OSError, aiosqlite.Error) as err:
            # SQLite's own checkpoints (in the committing statement) stay on: slower, not wrong.
            log.warning("no separate WAL checkpoint connection", extra={"error": str(err)[:200]})
            return
        await self._db.execute_fetchall("PRAGMA wal_autocheckpoint=0")

    def write_stats(self) -> StoreStats:
        """Counters since open, for /metrics: how well writes batch, how checkpoints go."""
        ck = self._checkpointer
        return StoreStats(
            rows={name: g.rows for name, g in self._grouped()},
            commits={name: g.flushes for name, g in self._grouped()},
            checkpoints=ck.runs if ck else 0, wal_frames=ck.wal_frames if ck else 0,
            wal_restarts=ck.folds if ck else 0,
        )

    def _grouped(self) -> tuple[tuple[str, GroupInsert], ...]:
        return (("messages", self._messages), ("events", self._events), ("turn_ends", self._turn_ends),
                ("reply_refs", self._reply_refs))

    async def _restart_wal(self) -> None:
        """Checkpoint on this connection so that the next commit writes the WAL from its
        start (RESTART: the file keeps its size and is reused; truncating it costs more)."""
        await self._rows("PRAGMA wal_checkpoint(RESTART)")

    async def close(self) -> None:
        checkpointer, self._checkpointer = self._checkpointer, None
        if checkpointer is not None:
            await checkpointer.close()
        done: list[str] = []
        for name, batched in self._grouped():
            await batched.close()
            if batched.flushes:
                done.append(f"{name} {count_noun(batched.rows, 'row')} in {count_noun(batched.flushes, 'commit')}")
        if done:  # the numbers in the text: readable whatever prints the record
            log.info("group commits since start: %s", ", ".join(done))
        if not self._read_only:
            with contextlib.suppress(StoreError):
                await self.checkpoint()
        await self._db.close()

    @property
    def connection(self) -> aiosqlite.Connection:
        """For modules with their own tables (memory search, jobs); same single writer."""
        return self._db

    async def _rows(self, sql: str, args: tuple[Any, ...] = ()) -> list[aiosqlite.Row]:
        """One statement, one round trip; the rows (or RETURNING rows) come back whole.

        Every statement goes through here (or `run_many`): a cursor left open would be
        finalized by the garbage collector on the event loop's thread while aiosqlite's
        thread uses the connection ("bad parameter or other API misuse")."""
        self._statements += 1
        try:
            try:
                rows = list(await self._db.execute_fetchall(sql, args))
            except UnicodeEncodeError:
                # A lone surrogate cannot be bound as UTF-8: store U+FFFD in its place
                # (rare, so only this path pays for the scan).
                rows = list(await self._db.execute_fetchall(sql, storable_args(args, nul=False)))
        except sqlite3.Error as err:
            self._wrote(sql, err)
            raise from_sqlite(err) from err
        self._wrote(sql, None)
        return rows

    def _wrote(self, sql: str, err: sqlite3.Error | None) -> None:
        """Remember whether the last write failed for want of storage (full, I/O error,
        read-only, corrupt); a failed read or a constraint says nothing about the disk."""
        if sql.lstrip()[:6].upper() not in WRITES:
            return
        if err is None:
            self.write_failure = None
        elif isinstance(err, sqlite3.OperationalError) or type(err) is sqlite3.DatabaseError:
            self.write_failure = str(err) or type(err).__name__

    async def run(self, sql: str, args: tuple[Any, ...] = ()) -> list[aiosqlite.Row]:
        """For modules with their own tables (memory, pairing, usage): one statement."""
        return await self._rows(sql, args)

    async def run_many(self, insert_sql: str, rows: list[tuple[Any, ...]], *, batch: int = 200) -> None:
        """`INSERT ... VALUES (?,..)` for many rows: one multi-row statement per batch, so
        each batch is atomic and costs one round trip."""
        head, _, values = insert_sql.rpartition("VALUES")
        if not head or not rows:
            if rows:
                raise ValueError("run_many needs an INSERT ... VALUES (...) statement")
            return
        for start in range(0, len(rows), batch):
            chunk = rows[start:start + batch]
            sql = f"{head}VALUES " + ", ".join([values.strip()] * len(chunk))
            await self._rows(sql, tuple(v for row in chunk for v in row))

    async def schema_version(self) -> int:
        rows = await self._rows("PRAGMA user_version")
        return int(rows[0][0]) if rows else 0

    async def write_problem(self) -> str | None:
        """Why the store cannot take writes now, or None. Taking the write lock proves the
        file is writable, not that there is room: a write that failed on a full disk counts
        until a later one succeeds."""
        try:
            # One script, one round trip: no other task's statement can land inside it.
            await self._db.executescript("BEGIN IMMEDIATE; ROLLBACK;")
        except aiosqlite.Error as err:
            return f"store: cannot write: {err}"
        if self.write_failure is not None:
            return f"store: cannot write: {self.write_failure}"
        return None

    # -- sessions ---------------------------------------------------------------------

    async def ensure_session(self, key: str, scope: str, channel: str) -> SessionRow:
        """The session's row, created on first use. `scope` always wins over the stored one:
        a row from an older version may carry the scope of the person who wrote first."""
        now = time.time()
        rows = await self._rows(
            "INSERT INTO sessions(key, scope, channel, created_at, updated_at) VALUES (?,?,?,?,?) "
            "ON CONFLICT(key) DO UPDATE SET updated_at=excluded.updated_at, scope=excluded.scope RETURNING *",
            (key, scope, channel, now, now),
        )
        return session_row(rows[0])

    async def get_session(self, key: str) -> SessionRow | None:
        rows = await self._rows("SELECT * FROM sessions WHERE key=?", (key,))
        return session_row(rows[0]) if rows else None

    async def set_context_start(self, key: str, turn: int) -> None:
        await self._rows(
            "UPDATE sessions SET context_start_turn=?, updated_at=? WHERE key=?", (turn, time.time(), key)
        )

    async def set_session_model(self, key: str, alias: str | None) -> None:
        """The model alias the session uses from its next step (None: its agent's)."""
        await self._rows("UPDATE sessions SET model=?, updated_at=? WHERE key=?", (alias, time.time(), key))

    async def count_sessions(self) -> int:
        rows = await self._rows("SELECT count(*) FROM sessions")
        return int(rows[0][0]) if rows else 0

    # -- messages ---------------------------------------------------------------------

    async def add_message(self, key: str, msg: Message, *, seq: int, token_count: int | None = None,
                          event: tuple[str, str] | None = None) -> Message:
        """Store one message. With `event` (channel, event id), the platform event that
        brought this user message is marked running with its turn in the same statement."""
        calls = (
            json.dumps([{"id": c.id, "name": c.name, "arguments": c.arguments} for c in msg.tool_calls],
                       ensure_ascii=False)
            if msg.tool_calls else None
        )
        event_channel, event_id = event if event is not None else (None, None)
        # One row of a group-committed insert: triggers keep sessions.updated_at, the search
        # index and the event.
        stored = await self._messages.submit(key, (
            key, msg.turn, seq, msg.role, msg.content, calls, msg.tool_call_id, msg.tool_name,
            truncation_to_json(msg.truncation), int(msg.injected), token_count, msg.created_at,
            event_channel, event_id, msg.origin, attachments_to_json(msg.attachments),
        ))
        if stored is None:
            raise StoreError(f"the message of session {key} was not stored")
        row_id = int(stored[0])
        return Message(
            role=msg.role, content=msg.content, turn=msg.turn, tool_calls=msg.tool_calls,
            tool_call_id=msg.tool_call_id, tool_name=msg.tool_name, truncation=msg.truncation,
            injected=msg.injected, origin=msg.origin, id=row_id, created_at=msg.created_at,
            attachments=msg.attachments,
        )

    async def messages(self, key: str, *, from_turn: int = 1) -> list[Message]:
        rows = await self._rows(
            "SELECT * FROM messages WHERE session_key=? AND turn>=? ORDER BY turn, seq, id", (key, from_turn)
        )
        return [row_to_message(r) for r in rows]

    async def turn_messages(self, key: str, *, from_turn: int, to_turn: int, max_turns: int) -> list[Message]:
        """Messages of the first `max_turns` stored turns in [from_turn, to_turn] (catch-up
        summaries read a long history in bounded pieces)."""
        rows = await self._rows(
            "SELECT * FROM messages WHERE session_key=? AND turn>=? AND turn<=(SELECT coalesce(max(turn), -1) "
            "FROM (SELECT DISTINCT turn FROM messages WHERE session_key=? AND turn BETWEEN ? AND ? "
            "ORDER BY turn LIMIT ?) t) ORDER BY turn, seq, id",
            (key, from_turn, key, from_turn, to_turn, max_turns),
        )
        return [row_to_message(r) for r in rows]

    async def recent_messages(self, key: str, *, turns: int, from_turn: int = 1) -> list[Message]:
        """Messages of the last `turns` turns at or after `from_turn` (for restore)."""
        found = [r[0] for r in await self._rows(
            "SELECT DISTINCT turn FROM messages WHERE session_key=? AND turn>=? ORDER BY turn DESC LIMIT ?",
            (key, from_turn, turns),
        )]
        if not found:
            return []
        return await self.messages(key, from_turn=min(found))

    async def chat_history_page(self, key: str, *, limit: int, before: tuple[int, int] | None = None,
                                max_chars: int = HISTORY_PAGE_CHARS) -> HistoryPage:
        """Up to `limit` messages the person saw in the chat (HISTORY_SHOWN) older than
        `before` (turn, seq), oldest first, with at most `max_chars` of text (history_cut).
        The sizes are read first, so a page never reads more than it returns."""
        older_than = " AND (turn, seq) < (?, ?)" if before is not None else ""
        sizes = await self._rows(
            f"SELECT turn, seq, length(content) FROM messages WHERE {HISTORY_SHOWN}{older_than} "
            "ORDER BY turn DESC, seq DESC LIMIT ?", (key, *(before or ()), limit + 1))
        take = history_cut([int(r[2] or 0) for r in sizes], limit=limit, max_chars=max_chars)
        if take == 0:
            return HistoryPage([], None)
        newest, oldest = sizes[0], sizes[take - 1]
        rows = await self._rows(
            f"SELECT * FROM messages WHERE {HISTORY_SHOWN} AND (turn, seq) >= (?, ?) AND (turn, seq) <= (?, ?) "
            "ORDER BY turn, seq", (key, oldest[0], oldest[1], newest[0], newest[1]))
        older = (int(oldest[0]), int(oldest[1])) if len(sizes) > take else None
        return HistoryPage([row_to_message(r) for r in rows], older)

    async def chat_history(self, key: str, *, limit: int, max_chars: int = HISTORY_PAGE_CHARS) -> list[Message]:
        """The latest page of what the person saw in the chat (chat_history_page), oldest first."""
        return (await self.chat_history_page(key, limit=limit, max_chars=max_chars)).messages

    # -- command answers: the chat's history, never the context -------------------------

    async def add_command_answer(self, key: str, command: str, answer: str, *, fresh_context: bool = False) -> None:
        """Keep an in-chat command and its answer for the chat's history, placed after the
        session's last turn (one statement: the turn is read where it is written)."""
        await self._rows(
            "INSERT INTO command_answers(session_key, turn, command, answer, fresh_context, created_at) "
            "VALUES (?, (SELECT coalesce(max(turn), 0) FROM messages WHERE session_key=?), ?, ?, ?, ?)",
            (key, key, command, answer, int(fresh_context), time.time()))

    async def conversation_page(self, key: str, *, limit: int, before: tuple[int, int] | None = None,
                                max_chars: int = HISTORY_PAGE_CHARS) -> ConversationPage:
        """chat_history_page with the session's command answers in their places: up to
        `limit` entries older than `before`, oldest first. Each side reads at most a page
        (an index walk each), and the sizes come first, so no more is read than returned."""
        older = " AND (turn, seq) < (?, ?)" if before is not None else ""
        older_answer = f" AND (turn, {COMMAND_SEQ} + id) < (?, ?)" if before is not None else ""
        cursor = before or ()
        sizes = await self._rows(
            "SELECT turn, seq, size FROM ("
            f"SELECT * FROM (SELECT turn, seq, length(content) AS size FROM messages WHERE {HISTORY_SHOWN}{older} "
            "ORDER BY turn DESC, seq DESC LIMIT ?) m UNION ALL "
            f"SELECT * FROM (SELECT turn, {COMMAND_SEQ} + id AS seq, length(command) + length(answer) AS size "
            f"FROM command_answers WHERE session_key=?{older_answer} ORDER BY turn DESC, id DESC LIMIT ?) c"
            ") h ORDER BY turn DESC, seq DESC LIMIT ?",
            (key, *cursor, limit + 1, key, *cursor, limit + 1, limit + 1))
        take = history_cut([int(r[2] or 0) for r in sizes], limit=limit, max_chars=max_chars)
        if take == 0:
            return ConversationPage([], None)
        newest = (int(sizes[0][0]), int(sizes[0][1]))
        oldest = (int(sizes[take - 1][0]), int(sizes[take - 1][1]))
        kinds = {int(r[1]) >= COMMAND_SEQ for r in sizes[:take]}
        placed: list[tuple[tuple[int, int], Message | CommandAnswer]] = []
        if False in kinds:
            rows = await self._rows(
                f"SELECT * FROM messages WHERE {HISTORY_SHOWN} AND (turn, seq) >= (?, ?) AND (turn, seq) <= (?, ?) "
                "ORDER BY turn, seq", (key, *oldest, *newest))
            placed += [((int(r["turn"]), int(r["seq"])), row_to_message(r)) for r in rows]
        if True in kinds:
            rows = await self._rows(
                f"SELECT * FROM command_answers WHERE session_key=? AND (turn, {COMMAND_SEQ} + id) >= (?, ?) "
                f"AND (turn, {COMMAND_SEQ} + id) <= (?, ?) ORDER BY turn, id", (key, *oldest, *newest))
            placed += [((int(r["turn"]), COMMAND_SEQ + int(r["id"])), command_answer(r)) for r in rows]
        placed.sort(key=lambda item: item[0])
        return ConversationPage([entry for _, entry in placed], oldest if len(sizes) > take else None)

    async def last_turn(self, key: str) -> int:
        rows = await self._rows("SELECT max(turn) FROM messages WHERE session_key=?", (key,))
        return int(rows[0][0]) if rows and rows[0][0] is not None else 0

    async def count_messages(self, key: str | None = None) -> int:
        if key is None:
            sql, args = "SELECT count(*) FROM messages", ()
        else:
            sql, args = "SELECT count(*) FROM messages WHERE session_key=?", (key,)
        rows = await self._rows(sql, args)
        return int(rows[0][0]) if rows else 0

    # -- platform events (dedup, exactly once) ------------------------------------------

    async def record_event(
        self, channel: str, event_id: str, *, session_key: str | None, inbound: dict[str, Any] | None,
        status: str = "accepted",
    ) -> bool:
        """Record a platform event; False when it was seen before (a redelivery)."""
        fresh = await self._events.submit((channel, event_id), (
            channel, event_id, session_key, status,
            json.dumps(inbound, ensure_ascii=False) if inbound is not None else None, time.time(),
        ))
        return fresh is not None

    async def retry_busy_event(self, channel: str, event_id: str, *, session_key: str,
                               inbound: dict[str, Any]) -> bool:
        """Accept again an event that was refused as busy (it was never stored nor answered,
        so a retry is a new attempt); False when it was not busy. Atomic: of two retries,
        one wins."""
        rows = await self._rows(
            "UPDATE events SET status='accepted', session_key=?, inbound=?, created_at=?, answered_at=NULL "
            "WHERE channel=? AND event_id=? AND status='busy' RETURNING 1",
            (session_key, json.dumps(inbound, ensure_ascii=False), time.time(), channel, event_id),
        )
        return bool(rows)

    async def mark_event(self, channel: str, event_id: str, status: str, *, turn: int | None = None) -> None:
        await self._rows(
            "UPDATE events SET status=?, answered_at=?, turn=coalesce(?, turn) WHERE channel=? AND event_id=?",
            (status, time.time(), turn, channel, event_id),
        )

    async def end_turn(self, channel: str, event_id: str, status: str, *,
                       usage: tuple[str, str, int] | None = None) -> None:
        """The event's final status and, with `usage` (identity, day, tokens), one more turn
        on that person's daily usage: one statement (the `turn_ends` trigger)."""
        identity, day, tokens = usage if usage is not None else (None, None, 0)
        await self._turn_ends.submit((channel, event_id),
                                     (channel, event_id, status, time.time(), identity, day, tokens))

    async def set_reply_ref(self, channel: str, event_id: str, ref: str) -> None:
        """Remember where the reply to this event is being shown (a stream's reference),
        durably before returning: called right after the platform answered, so a turn
        resumed after a crash edits that message instead of sending the reply again."""
        await self._reply_refs.submit((channel, event_id), (channel, event_id, ref))

    async def reply_ref(self, channel: str, event_id: str) -> str | None:
        rows = await self._rows("SELECT reply_ref FROM events WHERE channel=? AND event_id=?", (channel, event_id))
        return rows[0][0] if rows else None

    async def event_status(self, channel: str, event_id: str) -> str | None:
        rows = await self._rows("SELECT status FROM events WHERE channel=? AND event_id=?", (channel, event_id))
        return rows[0][0] if rows else None

    async def pending_events(self, statuses: Iterable[str] = ("accepted", "running")) -> list[PendingEvent]:
        wanted = tuple(statuses)
        marks = ",".join("?" * len(wanted))
        rows = await self._rows(f"SELECT * FROM events WHERE status IN ({marks}) ORDER BY created_at", wanted)
        out = []
        for r in rows:
            if not r["inbound"]:
                continue
            out.append(PendingEvent(
                channel=r["channel"], event_id=r["event_id"], session_key=r["session_key"],
                inbound=json.loads(r["inbound"]), created_at=r["created_at"],
                status=r["status"], turn=r["turn"],
            ))
        return out

    # -- summaries ----------------------------------------------------------------------

    async def add_summary(self, key: str, scope: str, *, upto_turn: int, reason: str, text: str) -> None:
        await self._rows(
            "INSERT INTO summaries(session_key, scope, upto_turn, reason, text, created_at) VALUES (?,?,?,?,?,?)",
            (key, scope, upto_turn, reason, text, time.time()),
        )

    async def latest_summary(self, key: str) -> StoredSummary | None:
        """The summary that covers the most turns (its `upto_turn` is how far the session's
        long-term memory and dialog/ archive reach)."""
        rows = await self._rows(
            "SELECT * FROM summaries WHERE session_key=? ORDER BY upto_turn DESC, id DESC LIMIT 1", (key,)
        )
        if not rows:
            return None
        row = rows[0]
        return StoredSummary(text=row["text"], upto_turn=row["upto_turn"], reason=row["reason"],
                             created_at=row["created_at"])

    # -- job runs -----------------------------------------------------------------------

    async def start_job_run(self, job: str, slot: str) -> bool:
        """Claim a (job, slot); False when that slot already ran (or runs)."""
        rows = await self._rows(
            "INSERT OR IGNORE INTO job_runs(job, slot, started_at) VALUES (?,?,?) RETURNING 1",
            (job, slot, time.time()),
        )
        return len(rows) == 1

    async def finish_job_run(self, job: str, slot: str, outcome: str, detail: str | None = None) -> None:
        await self._rows(
            "UPDATE job_runs SET ended_at=?, outcome=?, detail=? WHERE job=? AND slot=?",
            (time.time(), outcome, detail, job, slot),
        )

    async def forget_job_run(self, job: str, slot: str) -> None:
        """Release a slot whose run failed, so the next run retries it."""
        await self._rows("DELETE FROM job_runs WHERE job=? AND slot=?", (job, slot))

    async def job_runs(self, job: str | None = None, limit: int = 10) -> list[JobRun]:
        sql = "SELECT * FROM job_runs" + (" WHERE job=?" if job else "") + " ORDER BY id DESC LIMIT ?"
        args: tuple[Any, ...] = (job, limit) if job else (limit,)
        rows = await self._rows(sql, args)
        return [JobRun(job=r["job"], slot=r["slot"], started_at=r["started_at"], ended_at=r["ended_at"],
                       outcome=r["outcome"], detail=r["detail"]) for r in rows]

    async def job_run(self, job: str, slot: str) -> JobRun | None:
        rows = await self._rows("SELECT * FROM job_runs WHERE job=? AND slot=?", (job, slot))
        if not rows:
            return None
        r = rows[0]
        return JobRun(job=r["job"], slot=r["slot"], started_at=r["started_at"], ended_at=r["ended_at"],
                      outcome=r["outcome"], detail=r["detail"])

    # -- the admin page (read-only views, each bounded) -----------------------------------

    async def recent_sessions(self, *, limit: int, day_start: float,
                              before: tuple[float, str] | None = None) -> list[SessionSummary]:
        """Sessions by last activity, newest first, `limit` of them after the cursor
        `before` (the last row's (updated_at, key)). Turns and today's tokens are looked
        up per listed session in the (session_key, turn) index, never over all messages."""
        after_clause, args = "", ()
        if before is not None:
            after_clause, args = "WHERE (s.updated_at, s.key) < (?, ?)", before
        rows = await self._rows(
            "SELECT s.key, s.channel, s.updated_at, s.scope, s.model, "
            "(SELECT coalesce(max(turn), 0) FROM messages WHERE session_key = s.key) AS turns, "
            "(SELECT coalesce(sum(token_count), 0) FROM messages WHERE session_key = s.key AND created_at >= ?) "
            f"AS tokens_today FROM sessions s {after_clause} ORDER BY s.updated_at DESC, s.key DESC LIMIT ?",
            (day_start, *args, limit),
        )
        return [SessionSummary(key=r["key"], channel=r["channel"], updated_at=r["updated_at"],
                               turns=int(r["turns"]), tokens_today=int(r["tokens_today"]), scope=r["scope"],
                               model=r["model"]) for r in rows]

    async def pending_pairings(self, now: float, *, limit: int = 100) -> list[PendingPairing]:
        """Codes still waiting for an admin (not approved, not expired), newest first."""
        rows = await self._rows(
            "SELECT code, identity, created_at, expires_at FROM pairing_codes "
            "WHERE approved_at IS NULL AND expires_at > ? ORDER BY created_at DESC LIMIT ?", (now, limit))
        return [PendingPairing(code=r["code"], identity=r["identity"], created_at=r["created_at"],
                               expires_at=r["expires_at"]) for r in rows]

    async def usage_since(self, first_day: str, *, limit: int = 5000) -> list[UsageDay]:
        """Daily usage rows from `first_day` (YYYY-MM-DD) on, newest day first."""
        rows = await self._rows(
            "SELECT identity, day, turns, tokens FROM usage WHERE day >= ? ORDER BY day DESC, tokens DESC LIMIT ?",
            (first_day, limit))
        return [UsageDay(identity=r["identity"], day=r["day"], turns=int(r["turns"]), tokens=int(r["tokens"]))
                for r in rows]

    # -- settings changed in chat (SPEC §10) ---------------------------------------------

    async def record_config_change(self, key: str, value_json: str | None, changed_by: str | None) -> int:
        """Keep a `/config` change (None: the key goes back to the config file); its id.
        Never a secret or where one is sent: the database is shared and read by every
        gateway, the environment and config.json are the operator's."""
        refusal = unshareable(key, None if value_json is None else json.loads(value_json))
        if refusal is not None:
            raise ValueError(f"not stored: {refusal}")
        rows = await self._rows(
            "INSERT INTO config_changes(key, value_json, changed_at, changed_by) VALUES (?,?,?,?) RETURNING id",
            (key, value_json, time.time(), changed_by))
        return int(rows[0][0])

    async def config_changes(self) -> list[ConfigChange]:
        """The latest change of each key, oldest first (the order they apply in)."""
        rows = await self._rows(
            "SELECT id, key, value_json, changed_at, changed_by FROM config_changes "
            "WHERE id IN (SELECT max(id) FROM config_changes GROUP BY key) ORDER BY id")
        return [ConfigChange(id=int(r["id"]), key=r["key"], value_json=r["value_json"],
                             changed_at=float(r["changed_at"]), changed_by=r["changed_by"]) for r in rows]

    async def last_config_change(self) -> int:
        """The newest change's id (0: none): one cheap look for "anything new?"."""
        rows = await self._rows("SELECT coalesce(max(id), 0) FROM config_changes")
        return int(rows[0][0]) if rows else 0

    # -- purge (SPEC §7): small statements, each its own commit, so a chat's write waits
    # -- for one batch at most, never for the whole purge --------------------------------

    async def expired_session_keys(self, before: float, *, limit: int) -> list[str]:
        """Sessions whose last activity is before `before` (oldest first)."""
        rows = await self._rows("SELECT key FROM sessions WHERE updated_at < ? ORDER BY updated_at LIMIT ?",
                                (before, limit))
        return [r[0] for r in rows]

    async def _delete(self, sql: str, args: Iterable[Any]) -> int:
        self._statements += 1
        try:
            cur = await self._db.execute(sql, tuple(args))
            count = cur.rowcount
            await cur.close()
            await self._db.commit()
        except sqlite3.Error as err:
            self._wrote(sql, err)
            raise from_sqlite(err) from err
        self._wrote(sql, None)
        return max(count, 0)

    async def delete_session_messages(self, keys: list[str], *, before: float, limit: int) -> int:
        """Delete up to `limit` messages (created before `before`) of these sessions."""
        if not keys:
            return 0
        marks = ",".join("?" * len(keys))
        return await self._delete(
            f"DELETE FROM messages WHERE id IN (SELECT id FROM messages WHERE session_key IN ({marks}) "
            "AND created_at < ? LIMIT ?)",
            (*keys, before, limit),
        )

    async def first_message_id_since(self, at: float) -> int | None:
        """The id of the first message created at or after `at`: one seek in the
        created_at index. (`ORDER BY id` made SQLite sort every newer message: 0.2 s of the
        database thread at 2M messages, on every start's purge.) Messages are stored in
        time order, so older ones are in front of it; a clock that went back only leaves
        some old rows for a later purge, it never puts a newer one in front."""
        rows = await self._rows("SELECT id FROM messages WHERE created_at >= ? ORDER BY created_at LIMIT 1",
                                (at,))
        return int(rows[0][0]) if rows else None

    async def old_message_turns(self, before: float, *, after_id: int, below_id: int,
                                limit: int) -> tuple[dict[str, int], int | None]:
        """The next `limit` messages (by id, after `after_id`, below `below_id`) created
        before `before`: each session's highest turn among them, and the last id read
        (None when there were none). The purge walks the old front of the table with it."""
        rows = await self._rows(
            "SELECT session_key, turn, id FROM messages WHERE id > ? AND id < ? AND created_at < ? "
            "ORDER BY id LIMIT ?", (after_id, below_id, float(before), limit))
        turns: dict[str, int] = {}
        for key, turn, _id in rows:
            turns[key] = max(turns.get(key, 0), int(turn))
        return turns, (int(rows[-1][2]) if rows else None)

    async def delete_messages_before(self, before: float, *, below_id: int, limit: int) -> int:
        """Delete up to `limit` messages created before `before` among ids below `below_id`."""
        return await self._delete(
            "DELETE FROM messages WHERE id IN (SELECT id FROM messages WHERE id < ? AND created_at < ? "
            "ORDER BY id LIMIT ?)",
            (below_id, before, limit),
        )

    async def delete_session_summaries(self, keys: list[str], *, limit: int) -> int:
        if not keys:
            return 0
        marks = ",".join("?" * len(keys))
        return await self._delete(
            f"DELETE FROM summaries WHERE id IN (SELECT id FROM summaries WHERE session_key IN ({marks}) "
            "LIMIT ?)",
            (*keys, limit),
        )

    async def delete_sessions(self, keys: list[str], *, before: float) -> int:
        """Delete these sessions unless they became active again meanwhile."""
        if not keys:
            return 0
        marks = ",".join("?" * len(keys))
        return await self._delete(
            f"DELETE FROM sessions WHERE key IN ({marks}) AND updated_at < ?", (*keys, before)
        )

    async def delete_command_answers_before(self, before: float, *, limit: int) -> int:
        """Command answers past retention go like the messages around them."""
        return await self._delete(
            "DELETE FROM command_answers WHERE id IN (SELECT id FROM command_answers WHERE created_at < ? "
            "ORDER BY created_at LIMIT ?)", (before, limit))

    async def delete_events_before(self, before: float, *, limit: int) -> int:
        """Forget dedup records of platform events older than `before`."""
        return await self._delete(
            "DELETE FROM events WHERE (channel, event_id) IN "
            "(SELECT channel, event_id FROM events WHERE created_at < ? LIMIT ?)",
            (before, limit),
        )

    # -- full-text search (memory_search): the SQL behind Store so each backend uses its own
    # -- index (FTS5 trigram here, pg_trgm on PostgreSQL) ------------------------------

    async def search_memory_chunks(self, scope: str, *, match: str | None, phrases: Sequence[str],
                                   short_terms: Sequence[str], limit: int) -> list[tuple[float, str, str, str]]:
        """(rank, path, date, content) of the scope's memory chunks that match, best (lowest
        rank) first: `match` is the FTS5 expression of `phrases` (OR-ed); without it every
        one of `short_terms` must occur (LIKE), newest first."""
        if match is not None:
            sql = (
                "SELECT bm25(memory_fts), c.path, c.date, c.content FROM memory_fts "
                "JOIN memory_chunks c ON c.id = memory_fts.rowid "
                "WHERE memory_fts MATCH ? AND c.scope = ? ORDER BY 1 LIMIT ?"
            )
            args: tuple[Any, ...] = (match, scope, limit)
        else:
            likes = " AND ".join("c.content LIKE ? ESCAPE '\\'" for _ in short_terms)
            sql = (
                f"SELECT 0.0, c.path, c.date, c.content FROM memory_chunks c "
                f"WHERE c.scope = ? AND {likes} ORDER BY c.date DESC, c.id DESC LIMIT ?"
            )
            args = (scope, *map(like_pattern, short_terms), limit)
        return [(r[0], r[1], r[2], r[3]) for r in await self._rows(sql, args)]

    async def search_session_messages(
        self, session_key: str, *, match: str | None, phrases: Sequence[str], short_terms: Sequence[str],
        limit: int,
    ) -> list[tuple[float, int, str, str, float]]:
        """(rank, turn, role, content, created_at) of the session's earlier messages that
        match (as in `search_memory_chunks`); the role names a message's origin
        (SEARCH_ROLE_SQL)."""
        # Earlier turns only (the current one is in the context already), no gateway
        # notices, and no earlier search results (they would echo back).
        where = (
            "m.session_key = ? AND m.injected = 0 AND coalesce(m.tool_name, '') != 'memory_search' "
            "AND m.turn < (SELECT coalesce(max(turn), 0) FROM messages WHERE session_key = ?)"
        )
        if match is not None:
            sql = (
                f"SELECT bm25(messages_fts), m.turn, {SEARCH_ROLE_SQL}, m.content, m.created_at FROM messages_fts "
                f"JOIN messages m ON m.id = messages_fts.rowid WHERE messages_fts MATCH ? AND {where} "
                "ORDER BY 1 LIMIT ?"
            )
            args: tuple[Any, ...] = (match, session_key, session_key, limit)
        else:
            likes = " AND ".join("m.content LIKE ? ESCAPE '\\'" for _ in short_terms)
            sql = (
                f"SELECT 0.0, m.turn, {SEARCH_ROLE_SQL}, m.content, m.created_at FROM messages m "
                f"WHERE {where} AND {likes} ORDER BY m.id DESC LIMIT ?"
            )
            args = (session_key, session_key, *map(like_pattern, short_terms), limit)
        return [(r[0], r[1], r[2], r[3], r[4]) for r in await self._rows(sql, args)]

    async def checkpoint(self) -> None:
        """Fold the WAL back into the database file and truncate it (after a purge).
        Raises StoreUnavailable while another write on this connection is between its
        statement and its commit."""
        await self._rows("PRAGMA wal_checkpoint(TRUNCATE)")
