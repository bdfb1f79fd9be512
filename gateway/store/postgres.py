"""The PostgreSQL store (asyncpg, a connection pool): the same interface and semantics as
gateway/store/sqlite.py's SQLite Store, for a database several gateways can share.

Statements are written once, with SQLite's `?` placeholders, and numbered here (`$1`...),
so modules with their own tables (pairing, usage, memory) run the same portable SQL on
either backend. The turn bookkeeping of SQLite's migration 3 is kept: a stored user
message marks its event running in the same statement (a PL/pgSQL trigger), and one
insert into the `turn_ends` view closes a turn (event status and daily usage together).
Full-text search uses pg_trgm (substring matches, like SQLite's trigram FTS5, so CJK
text works); without the extension the same ILIKE queries run unindexed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import re
import secrets
import socket
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg

from gateway.store.errors import POSTGRES_ERRORS, StoreError, from_postgres
from gateway.store.fence import FENCE, FencedOut
from gateway.store.group_commit import GroupInsert
from gateway.store.migrations.postgres import MIGRATIONS
from gateway.store.rows import (
    HISTORY_PAGE_CHARS,
    HISTORY_SHOWN,
    SEARCH_ROLE_SQL,
    HistoryPage,
    JobRun,
    PendingEvent,
    PendingPairing,
    SessionSummary,
    StoreStats,
    attachments_to_json,
    count_noun,
    history_cut,
    like_pattern,
    row_to_message,
    storable_args,
    truncation_to_json,
)
from gateway.store.sqlite import REPLY_REFS_AFTER, REPLY_REFS_SQL, Store
from gateway.types import Message

log = logging.getLogger("gateway.store")

CONNECT_TIMEOUT_S = 10
STATEMENT_TIMEOUT_S = 30
POOL_MAX = 10
LOCK_POOL_MAX = 4
SCOPE_LOCK_TIMEOUT_S = 60  # a memory write waits this long for another gateway's
WRITES = ("INSERT", "UPDATE", "DELETE")
QUEUED = ("accepted", "queued", "running")  # an event whose turn is not over yet


@dataclass(frozen=True, slots=True)
class QueuedEvent:
    """An event of a session whose turn has not ended, in arrival order (SPEC §10)."""

    channel: str
    event_id: str
    status: str
    turn: int | None
    inbound: dict[str, Any] | None
    age_s: float  # since it was accepted, by the database's clock
    instance: str | None  # the gateway that accepted it


def instance_name() -> str:
    """This process among the cluster's: readable in pg_stat_activity and the leases table."""
    return f"{socket.gethostname()[:40]}-{os.getpid()}-{secrets.token_hex(3)}"


# Trigram indexes for memory_search, when pg_trgm can be installed (a trusted extension
# since PostgreSQL 13: the database's owner may create it).
TRIGRAM_INDEXES = (
    "CREATE INDEX IF NOT EXISTS messages_content_trgm ON messages USING gin (content gin_trgm_ops)",
    "CREATE INDEX IF NOT EXISTS memory_chunks_content_trgm ON memory_chunks USING gin (content gin_trgm_ops)",
)

_MARK = re.compile(r"\?")


@functools.lru_cache(maxsize=512)
def to_postgres(sql: str) -> str:
    """SQLite's `?` placeholders numbered for PostgreSQL. The gateway's statements never
    carry a literal `?` inside quotes."""
    counter = iter(range(1, 1_000_000))
    return _MARK.sub(lambda _m: f"${next(counter)}", sql)


class StatementConnection(asyncpg.Connection):  # type: ignore[misc]
    """A pooled connection that runs statements only. asyncpg's pool sends a reset query
    (unlock advisory locks, close cursors, unlisten, reset settings) each time it takes a
    connection back: one more round trip for every statement, a third of all of them per
    turn (bench/cluster.py counts them). The store's statements leave none of that behind:
    no session settings, cursors or LISTEN, and advisory locks only per transaction; the
    one session-level lock (scope_lock) has a pool of its own with the usual reset. An
    open transaction is still rolled back on release (asyncpg does that without a query
    when there is none)."""

    def get_reset_query(self) -> str:
        return ""


def _storage_error(err: BaseException) -> bool:
    """A failure that says the database cannot take writes (full, read-only, unreachable),
    not that one statement was wrong (a constraint, bad data)."""
    if isinstance(err, (OSError, asyncpg.InterfaceError, asyncio.TimeoutError)):
        return True
    code = getattr(err, "sqlstate", None) or ""
    return code[:2] in ("08", "53", "57", "58") or code == "25006"


class PgStore:
    """Same public methods as gateway.store.Store, on PostgreSQL."""

    shared = True  # several gateways may use this database at once (SPEC §10)

    def __init__(self, pool: asyncpg.Pool, url: str, instance: str) -> None:
        self._pool = pool
        self.url = url
        self.instance = instance
        self._lock_pool: asyncpg.Pool | None = None  # for scope_lock, made on first use
        self.path: Path | None = None  # no file: a server
        self.write_failure: str | None = None
        self.trigram = False  # whether pg_trgm indexes back memory_search
        self._messages = GroupInsert(
            self._rows,
            "INSERT INTO messages(session_key, turn, seq, role, content, tool_calls, tool_call_id, "
            "tool_name, truncation, injected, token_count, created_at, event_channel, event_id, origin, "
            "attachments, fence) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            returning="id, session_key", key_of=lambda r: r[1],
        )
        self._events = GroupInsert(
            self._rows,
            "INSERT INTO events(channel, event_id, session_key, status, inbound, created_at) "
            "VALUES (?,?,?,?,?,?)",
            returning="channel, event_id", key_of=lambda r: (r[0], r[1]),
            conflict="ON CONFLICT DO NOTHING",
        )
        self._turn_ends = GroupInsert(
            self._rows,
            "INSERT INTO turn_ends(channel, event_id, status, at, identity, day, tokens) VALUES (?,?,?,?,?,?,?)",
        )
        self._reply_refs = GroupInsert(self._rows, REPLY_REFS_SQL, after=REPLY_REFS_AFTER)

    @classmethod
    async def open(cls, url: str, *, migrate: bool = True, pool_max: int = POOL_MAX) -> PgStore:
        """Connect (a pool) and, with `migrate`, create or upgrade the schema."""
        instance = instance_name()
        try:
            # The connection's application_name names this gateway: events it accepts
            # default their `instance` to it.
            pool = await asyncpg.create_pool(
                url, min_size=1, max_size=pool_max, timeout=CONNECT_TIMEOUT_S,
                command_timeout=STATEMENT_TIMEOUT_S, server_settings={"application_name": instance},
                connection_class=StatementConnection,
            )
        except (TimeoutError, OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as err:
            raise StoreError(f"cannot open the database {_safe(url)}: {err}") from err
        store = cls(pool, url, instance)
        try:
            if migrate:
                await store._setup()
            else:
                store.trigram = bool(await store._rows(
                    "SELECT 1 FROM pg_extension WHERE extname='pg_trgm'"))
        except (*POSTGRES_ERRORS, StoreError) as err:
            await pool.close()
            raise StoreError(f"cannot initialise the database {_safe(url)}: {err}") from err
        return store

    async def _setup(self) -> None:
        async with self._pool.acquire() as conn, conn.transaction():
            # One gateway migrates at a time; the others wait here, then see it done.
            await conn.execute("SELECT pg_advisory_xact_lock(7313001)")
            await conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version BIGINT NOT NULL)")
            row = await conn.fetchrow("SELECT max(version) FROM schema_version")
            version = int(row[0]) if row and row[0] is not None else 0
            for number, script in enumerate(MIGRATIONS, start=1):
                if number <= version:
                    continue
                await conn.execute(script)
                await conn.execute("INSERT INTO schema_version(version) VALUES ($1)", number)
        try:
            async with self._pool.acquire() as conn:
                await conn.execute("CREATE EXTENSION IF NOT EXISTS pg_trgm")
                for sql in TRIGRAM_INDEXES:
                    await conn.execute(sql)
            self.trigram = True
        except asyncpg.PostgresError as err:
            log.warning("pg_trgm unavailable: memory_search scans without an index", extra={"error": str(err)[:200]})

    def write_stats(self) -> StoreStats:
        return StoreStats(
            rows={name: g.rows for name, g in self._grouped()},
            commits={name: g.flushes for name, g in self._grouped()},
            checkpoints=0, wal_frames=0, wal_restarts=0,
        )

    # Statements that read the same on both databases (`_rows` numbers the placeholders):
    # the SQLite store's own methods serve here too.
    _grouped = Store._grouped
    run = Store.run
    run_many = Store.run_many
    ensure_session = Store.ensure_session
    get_session = Store.get_session
    set_session_model = Store.set_session_model
    set_context_start = Store.set_context_start
    count_sessions = Store.count_sessions
    messages = Store.messages
    recent_messages = Store.recent_messages
    turn_messages = Store.turn_messages
    last_turn = Store.last_turn
    add_command_answer = Store.add_command_answer
    conversation_page = Store.conversation_page
    old_message_turns = Store.old_message_turns
    record_event = Store.record_event
    retry_busy_event = Store.retry_busy_event
    end_turn = Store.end_turn
    set_reply_ref = Store.set_reply_ref
    reply_ref = Store.reply_ref
    event_status = Store.event_status
    add_summary = Store.add_summary
    latest_summary = Store.latest_summary
    finish_job_run = Store.finish_job_run
    forget_job_run = Store.forget_job_run
    usage_since = Store.usage_since
    record_config_change = Store.record_config_change
    config_changes = Store.config_changes
    last_config_change = Store.last_config_change

    @asynccontextmanager
    async def scope_lock(self, scope: str) -> AsyncIterator[None]:
        """One writer of a scope's memory files at a time across gateways: an advisory lock,
        on a connection from a small pool of its own (a holder that writes the search index
        meanwhile never waits for a connection held by another holder). A gateway that dies
        holding it loses its connection, and the lock with it."""
        try:
            if self._lock_pool is None:
                self._lock_pool = await asyncpg.create_pool(
                    self.url, min_size=0, max_size=LOCK_POOL_MAX, timeout=CONNECT_TIMEOUT_S,
                    command_timeout=STATEMENT_TIMEOUT_S, server_settings={"application_name": self.instance},
                )
            pool = self._lock_pool
            conn = await pool.acquire(timeout=CONNECT_TIMEOUT_S)
        except POSTGRES_ERRORS as err:
            raise from_postgres(err) from err
        try:
            try:
                async with asyncio.timeout(SCOPE_LOCK_TIMEOUT_S):
                    await conn.execute("SELECT pg_advisory_lock(hashtextextended($1, 7313))", scope)
            except POSTGRES_ERRORS as err:
                raise from_postgres(err) from err
            try:
                yield
            finally:
                try:
                    await conn.execute("SELECT pg_advisory_unlock(hashtextextended($1, 7313))", scope)
                except POSTGRES_ERRORS as err:  # a lost connection took the lock with it
                    log.warning("scope lock not released", extra={"scope": scope, "error": str(err)[:200]})
        finally:
            await pool.release(conn)

    async def close(self) -> None:
        if self._lock_pool is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._lock_pool.close(), timeout=5)
        done: list[str] = []
        for name, batched in self._grouped():
            await batched.close()
            if batched.flushes:
                done.append(f"{name} {count_noun(batched.rows, 'row')} in {count_noun(batched.flushes, 'commit')}")
        if done:
            log.info("group commits since start: %s", ", ".join(done))
        try:
            await asyncio.wait_for(self._pool.close(), timeout=10)
        except TimeoutError:
            self._pool.terminate()

    async def _rows(self, sql: str, args: tuple[Any, ...] = ()) -> list[asyncpg.Record]:
        """One statement on a pooled connection (its own transaction)."""
        try:
            async with self._pool.acquire(timeout=CONNECT_TIMEOUT_S) as conn:
                # Text from tools, files and models may hold NUL, which TEXT cannot.
                rows = await conn.fetch(to_postgres(sql), *storable_args(args, nul=True))
        except POSTGRES_ERRORS as err:
            self._wrote(sql, err)
            raise from_postgres(err) from err
        self._wrote(sql, None)
        return list(rows)

    def _wrote(self, sql: str, err: BaseException | None) -> None:
        if sql.lstrip()[:6].upper() not in WRITES:
            return
        if err is None:
            self.write_failure = None
        elif _storage_error(err):
            self.write_failure = str(err) or type(err).__name__

    async def schema_version(self) -> int:
        rows = await self._rows(
            "SELECT CASE WHEN to_regclass('schema_version') IS NULL THEN 0 "
            "ELSE (SELECT coalesce(max(version), 0) FROM schema_version) END")
        return int(rows[0][0]) if rows else 0

    async def write_problem(self) -> str | None:
        """Why the store cannot take writes now, or None: the server answers, is not a
        read-only standby, and the last write did not fail for want of storage."""
        try:
            rows = await self._rows("SELECT pg_is_in_recovery() OR current_setting('transaction_read_only') = 'on'")
        except StoreError as err:
            return f"store: cannot write: {err}"
        if rows and rows[0][0]:
            return "store: cannot write: the database is read-only"
        if self.write_failure is not None:
            return f"store: cannot write: {self.write_failure}"
        return None

    # -- sessions ---------------------------------------------------------------------

    # -- messages ---------------------------------------------------------------------

    async def add_message(self, key: str, msg: Message, *, seq: int, token_count: int | None = None,
                          event: tuple[str, str] | None = None) -> Message:
        calls = (
            json.dumps([{"id": c.id, "name": c.name, "arguments": c.arguments} for c in msg.tool_calls],
                       ensure_ascii=False)
            if msg.tool_calls else None
        )
        event_channel, event_id = event if event is not None else (None, None)
        fence = FENCE.get()
        token = fence[1] if fence is not None and fence[0] == key else None
        stored = await self._messages.submit(key, (
            key, msg.turn, seq, msg.role, msg.content, calls, msg.tool_call_id, msg.tool_name,
            truncation_to_json(msg.truncation), int(msg.injected), token_count, float(msg.created_at),
            event_channel, event_id, msg.origin, attachments_to_json(msg.attachments), token,
        ))
        if stored is None:
            if token is not None:
                raise FencedOut(key, token)
            raise StoreError(f"the message of session {key} was not stored")
        return Message(
            role=msg.role, content=msg.content, turn=msg.turn, tool_calls=msg.tool_calls,
            tool_call_id=msg.tool_call_id, tool_name=msg.tool_name, truncation=msg.truncation,
            injected=msg.injected, origin=msg.origin, id=int(stored[0]), created_at=msg.created_at,
            attachments=msg.attachments,
        )

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

    async def count_messages(self, key: str | None = None) -> int:
        if key is None:
            rows = await self._rows("SELECT count(*) FROM messages")
        else:
            rows = await self._rows("SELECT count(*) FROM messages WHERE session_key=?", (key,))
        return int(rows[0][0]) if rows else 0

    # -- platform events (dedup, exactly once) ------------------------------------------

    async def mark_event(self, channel: str, event_id: str, status: str, *, turn: int | None = None) -> None:
        await self._rows(
            "UPDATE events SET status=?, answered_at=?, turn=coalesce(CAST(? AS BIGINT), turn) "
            "WHERE channel=? AND event_id=?",
            (status, time.time(), turn, channel, event_id),
        )

    async def pending_events(self, statuses: Iterable[str] = ("accepted", "running")) -> list[PendingEvent]:
        rows = await self._rows("SELECT * FROM events WHERE status = ANY(?::text[]) ORDER BY created_at",
                                (list(statuses),))
        return [PendingEvent(
            channel=r["channel"], event_id=r["event_id"], session_key=r["session_key"],
            inbound=json.loads(r["inbound"]), created_at=r["created_at"], status=r["status"], turn=r["turn"],
        ) for r in rows if r["inbound"]]

    async def queue_event(self, channel: str, event_id: str, *, session_key: str, limit: int) -> bool:
        """Mark an accepted event `queued` unless `limit` events of its session already wait
        to run (accepted or queued, itself aside): one statement, the busy check and the
        mark together. False: the session is busy."""
        rows = await self._rows(
            "UPDATE events SET status='queued', answered_at=? WHERE channel=? AND event_id=? AND "
            "(SELECT count(*) FROM events w WHERE w.session_key=? AND w.status IN ('accepted', 'queued') "
            "AND NOT (w.channel=? AND w.event_id=?)) < ? RETURNING 1",
            (time.time(), channel, event_id, session_key, channel, event_id, limit),
        )
        return bool(rows)

    async def session_events(self, key: str, *, limit: int = 100) -> list[QueuedEvent]:
        """The session's events whose turns have not ended, oldest arrival first."""
        rows = await self._rows(
            "SELECT channel, event_id, status, turn, inbound, instance, "
            "extract(epoch FROM now()) - created_at AS age FROM events "
            "WHERE session_key=? AND status IN ('accepted', 'queued', 'running') ORDER BY arrival LIMIT ?",
            (key, limit),
        )
        return [QueuedEvent(
            channel=r["channel"], event_id=r["event_id"], status=r["status"], turn=r["turn"],
            inbound=json.loads(r["inbound"]) if r["inbound"] else None, age_s=float(r["age"]),
            instance=r["instance"],
        ) for r in rows]

    async def session_mark(self, key: str) -> tuple[int, int]:
        """(last message id, context start): changes whenever any gateway writes the session."""
        rows = await self._rows(
            "SELECT coalesce((SELECT max(id) FROM messages WHERE session_key=?), 0), "
            "coalesce((SELECT context_start_turn FROM sessions WHERE key=?), 0)", (key, key))
        return (int(rows[0][0]), int(rows[0][1])) if rows else (0, 0)

    async def unleased_sessions(self, *, settle_s: float, decide_limit_s: float, limit: int = 200) -> list[str]:
        """Sessions with turns waiting and no live lease: their holder died, or released
        the lease just as a message came. An event still only accepted is its gateway's to
        decide: it counts once older than `settle_s` if that gateway is gone, and once
        older than `decide_limit_s` in any case (stuck)."""
        rows = await self._rows(
            "SELECT DISTINCT e.session_key FROM events e "
            "WHERE e.session_key IS NOT NULL AND (e.status IN ('queued', 'running') OR "
            "(e.status = 'accepted' AND e.created_at < extract(epoch FROM now()) - ? AND ("
            " e.instance IS NULL OR e.created_at < extract(epoch FROM now()) - ? OR "
            " NOT EXISTS (SELECT 1 FROM leases i WHERE i.name = 'instance:' || e.instance "
            " AND i.expires_at > now())))) "
            "AND NOT EXISTS (SELECT 1 FROM leases l WHERE l.name = 'session:' || e.session_key "
            "AND l.expires_at > now()) LIMIT ?",
            (settle_s, decide_limit_s, limit),
        )
        return [r[0] for r in rows]

    # -- leases (gateway/cluster/leases.py) ----------------------------------------------------

    async def lease_acquire(self, name: str, holder: str, ttl_s: float) -> int | None:
        """A new fencing token when `name` is free, expired or already `holder`'s; else None."""
        rows = await self._rows(
            "INSERT INTO leases(name, holder, token, expires_at) "
            "VALUES (?, ?, nextval('lease_tokens'), now() + make_interval(secs => ?)) "
            "ON CONFLICT (name) DO UPDATE SET holder = excluded.holder, token = excluded.token, "
            "expires_at = excluded.expires_at "
            "WHERE leases.expires_at < now() OR leases.holder = excluded.holder RETURNING token",
            (name, holder, ttl_s),
        )
        return int(rows[0][0]) if rows else None

    async def lease_acquire_session(self, name: str, holder: str, ttl_s: float,
                                    key: str) -> tuple[int, tuple[int, int]] | None:
        """`lease_acquire`, and the session's mark (`session_mark`) in the same statement."""
        rows = await self._rows(
            "WITH got AS (INSERT INTO leases(name, holder, token, expires_at) "
            "VALUES (?, ?, nextval('lease_tokens'), now() + make_interval(secs => ?)) "
            "ON CONFLICT (name) DO UPDATE SET holder = excluded.holder, token = excluded.token, "
            "expires_at = excluded.expires_at "
            "WHERE leases.expires_at < now() OR leases.holder = excluded.holder RETURNING token) "
            "SELECT got.token, coalesce((SELECT max(id) FROM messages WHERE session_key=?), 0), "
            "coalesce((SELECT context_start_turn FROM sessions WHERE key=?), 0) FROM got",
            (name, holder, ttl_s, key, key),
        )
        return (int(rows[0][0]), (int(rows[0][1]), int(rows[0][2]))) if rows else None

    async def lease_renew(self, holder: str, ttl_s: float) -> dict[str, int]:
        """Extend every lease `holder` still has; name → token of those."""
        rows = await self._rows(
            "UPDATE leases SET expires_at = now() + make_interval(secs => ?) WHERE holder = ? "
            "RETURNING name, token",
            (ttl_s, holder),
        )
        return {r[0]: int(r[1]) for r in rows}

    async def lease_release(self, name: str, token: int) -> None:
        await self._rows("DELETE FROM leases WHERE name=? AND token=?", (name, token))

    async def lease_release_all(self, holder: str) -> None:
        await self._rows("DELETE FROM leases WHERE holder=?", (holder,))

    async def lease_holders(self, prefix: str) -> dict[str, str]:
        """Live leases whose names start with `prefix`: name → holder."""
        rows = await self._rows(
            "SELECT name, holder FROM leases WHERE starts_with(name, ?) AND expires_at > now()", (prefix,))
        return {r[0]: r[1] for r in rows}

    # -- summaries ----------------------------------------------------------------------

    # -- job runs -----------------------------------------------------------------------

    async def start_job_run(self, job: str, slot: str) -> bool:
        rows = await self._rows(
            "INSERT INTO job_runs(job, slot, started_at) VALUES (?,?,?) ON CONFLICT DO NOTHING RETURNING 1",
            (job, slot, time.time()),
        )
        return len(rows) == 1

    async def job_runs(self, job: str | None = None, limit: int = 10) -> list[JobRun]:
        sql = "SELECT * FROM job_runs" + (" WHERE job=?" if job else "") + " ORDER BY id DESC LIMIT ?"
        args: tuple[Any, ...] = (job, limit) if job else (limit,)
        return [_job_run(r) for r in await self._rows(sql, args)]

    async def job_run(self, job: str, slot: str) -> JobRun | None:
        rows = await self._rows("SELECT * FROM job_runs WHERE job=? AND slot=?", (job, slot))
        return _job_run(rows[0]) if rows else None

    # -- the admin page -----------------------------------------------------------------

    async def recent_sessions(self, *, limit: int, day_start: float,
                              before: tuple[float, str] | None = None) -> list[SessionSummary]:
        after_clause, args = "", ()
        if before is not None:
            after_clause, args = "WHERE (s.updated_at, s.key) < (CAST(? AS DOUBLE PRECISION), CAST(? AS TEXT))", before
        rows = await self._rows(
            "SELECT s.key, s.channel, s.updated_at, s.scope, s.model, "
            "(SELECT coalesce(max(turn), 0) FROM messages WHERE session_key = s.key) AS turns, "
            "(SELECT coalesce(sum(token_count), 0) FROM messages WHERE session_key = s.key AND created_at >= ?) "
            f"AS tokens_today FROM sessions s {after_clause} ORDER BY s.updated_at DESC, s.key DESC LIMIT ?",
            (float(day_start), *args, limit),
        )
        return [SessionSummary(key=r["key"], channel=r["channel"], updated_at=r["updated_at"],
                               turns=int(r["turns"]), tokens_today=int(r["tokens_today"]), scope=r["scope"],
                               model=r["model"]) for r in rows]

    async def pending_pairings(self, now: float, *, limit: int = 100) -> list[PendingPairing]:
        rows = await self._rows(
            "SELECT code, identity, created_at, expires_at FROM pairing_codes "
            "WHERE approved_at IS NULL AND expires_at > ? ORDER BY created_at DESC LIMIT ?", (float(now), limit))
        return [PendingPairing(code=r["code"], identity=r["identity"], created_at=r["created_at"],
                               expires_at=r["expires_at"]) for r in rows]

    # -- purge (SPEC §7): small statements, each its own transaction -------------------

    async def expired_session_keys(self, before: float, *, limit: int) -> list[str]:
        rows = await self._rows("SELECT key FROM sessions WHERE updated_at < ? ORDER BY updated_at LIMIT ?",
                                (float(before), limit))
        return [r[0] for r in rows]

    async def _delete(self, sql: str, args: Iterable[Any]) -> int:
        try:
            async with self._pool.acquire(timeout=CONNECT_TIMEOUT_S) as conn:
                status = await conn.execute(to_postgres(sql), *storable_args(args, nul=True))
        except POSTGRES_ERRORS as err:
            self._wrote(sql, err)
            raise from_postgres(err) from err
        self._wrote(sql, None)
        return int(status.rsplit(" ", 1)[-1]) if status.startswith("DELETE") else 0

    async def delete_session_messages(self, keys: list[str], *, before: float, limit: int) -> int:
        if not keys:
            return 0
        return await self._delete(
            "DELETE FROM messages WHERE id IN (SELECT id FROM messages WHERE session_key = ANY(?::text[]) "
            "AND created_at < ? LIMIT ?)", (list(keys), float(before), limit))

    async def first_message_id_since(self, at: float) -> int | None:
        rows = await self._rows("SELECT id FROM messages WHERE created_at >= ? ORDER BY created_at LIMIT 1",
                                (float(at),))
        return int(rows[0][0]) if rows else None

    async def delete_messages_before(self, before: float, *, below_id: int, limit: int) -> int:
        return await self._delete(
            "DELETE FROM messages WHERE id IN (SELECT id FROM messages WHERE id < ? AND created_at < ? "
            "ORDER BY id LIMIT ?)", (below_id, float(before), limit))

    async def delete_session_summaries(self, keys: list[str], *, limit: int) -> int:
        if not keys:
            return 0
        return await self._delete(
            "DELETE FROM summaries WHERE id IN (SELECT id FROM summaries WHERE session_key = ANY(?::text[]) "
            "LIMIT ?)", (list(keys), limit))

    async def delete_sessions(self, keys: list[str], *, before: float) -> int:
        if not keys:
            return 0
        return await self._delete("DELETE FROM sessions WHERE key = ANY(?::text[]) AND updated_at < ?",
                                  (list(keys), float(before)))

    async def delete_command_answers_before(self, before: float, *, limit: int) -> int:
        return await self._delete(
            "DELETE FROM command_answers WHERE id IN (SELECT id FROM command_answers WHERE created_at < ? "
            "ORDER BY created_at LIMIT ?)", (float(before), limit))

    async def delete_events_before(self, before: float, *, limit: int) -> int:
        return await self._delete(
            "DELETE FROM events WHERE (channel, event_id) IN "
            "(SELECT channel, event_id FROM events WHERE created_at < ? LIMIT ?)", (float(before), limit))

    async def checkpoint(self) -> None:
        """Nothing to fold: PostgreSQL manages its own WAL (kept for the purge's call)."""

    # -- full-text search ---------------------------------------------------------------

    async def search_memory_chunks(self, scope: str, *, match: str | None, phrases: Sequence[str],
                                   short_terms: Sequence[str], limit: int) -> list[tuple[float, str, str, str]]:
        """As Store.search_memory_chunks: any phrase as a case-insensitive substring (what
        FTS5's trigram tokenizer matches), more phrases found ranking first."""
        if phrases:
            hit, rank, args = _phrase_match("c.content", phrases)
            sql = (f"SELECT {rank}, c.path, c.date, c.content FROM memory_chunks c "
                   f"WHERE c.scope = ? AND ({hit}) ORDER BY 1, c.id DESC LIMIT ?")
            rows = await self._rows(sql, (*args, scope, *args, limit))
        else:
            likes = " AND ".join("c.content ILIKE ? ESCAPE '\\'" for _ in short_terms)
            sql = (f"SELECT 0.0, c.path, c.date, c.content FROM memory_chunks c "
                   f"WHERE c.scope = ? AND {likes} ORDER BY c.date DESC, c.id DESC LIMIT ?")
            rows = await self._rows(sql, (scope, *map(like_pattern, short_terms), limit))
        return [(float(r[0]), r[1], r[2], r[3]) for r in rows]

    async def search_session_messages(
        self, session_key: str, *, match: str | None, phrases: Sequence[str], short_terms: Sequence[str],
        limit: int,
    ) -> list[tuple[float, int, str, str, float]]:
        where = (
            "m.session_key = ? AND m.injected = 0 AND coalesce(m.tool_name, '') != 'memory_search' "
            "AND m.turn < (SELECT coalesce(max(turn), 0) FROM messages WHERE session_key = ?)"
        )
        if phrases:
            hit, rank, args = _phrase_match("m.content", phrases)
            sql = (f"SELECT {rank}, m.turn, {SEARCH_ROLE_SQL}, m.content, m.created_at FROM messages m "
                   f"WHERE {where} AND ({hit}) ORDER BY 1, m.id DESC LIMIT ?")
            rows = await self._rows(sql, (*args, session_key, session_key, *args, limit))
        else:
            likes = " AND ".join("m.content ILIKE ? ESCAPE '\\'" for _ in short_terms)
            sql = (f"SELECT 0.0, m.turn, {SEARCH_ROLE_SQL}, m.content, m.created_at FROM messages m "
                   f"WHERE {where} AND {likes} ORDER BY m.id DESC LIMIT ?")
            rows = await self._rows(sql, (session_key, session_key, *map(like_pattern, short_terms), limit))
        return [(float(r[0]), r[1], r[2], r[3], r[4]) for r in rows]


def _phrase_match(column: str, phrases: Sequence[str]) -> tuple[str, str, tuple[str, ...]]:
    """(any phrase found, rank: minus how many were found, the LIKE patterns)."""
    test = [f"{column} ILIKE ? ESCAPE '\\'" for _ in phrases]
    rank = "-(" + " + ".join(f"CAST({t} AS INTEGER)" for t in test) + ")::float8"
    return " OR ".join(test), rank, tuple(like_pattern(p) for p in phrases)


def _job_run(r: asyncpg.Record) -> JobRun:
    return JobRun(job=r["job"], slot=r["slot"], started_at=r["started_at"], ended_at=r["ended_at"],
                  outcome=r["outcome"], detail=r["detail"])


def _safe(url: str) -> str:
    """The URL without its password, for messages."""
    return re.sub(r"//([^:/@]+):[^@]*@", r"//\1:***@", url)
