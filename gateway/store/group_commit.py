"""Group commit for the inserts every turn makes (messages, platform events, turn ends).

With one autocommit statement per row, SQLite pays a transaction per row (the WAL frames,
the full-text index's new segment) and aiosqlite a thread hand-off per row; under load
that was most of the gateway's CPU. Here the rows queued while one insert runs go
together, as one multi-row `INSERT ... VALUES` (one statement: one transaction, one hop).
An idle gateway sees no delay: the first row starts a flush at once.

Each caller still resumes only once its own row is committed, so the persistence order
of a session (SPEC §3) is unchanged. A flush holds at most one row per batch key (a
session, an event): later rows of the same key wait for the next flush, which keeps
their order and lets RETURNING rows be matched back to callers by key.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("gateway.store")

RunSql = Callable[[str, tuple[Any, ...]], Awaitable[Sequence[Any]]]


@dataclass(slots=True)
class _Row:
    key: Hashable
    values: tuple[Any, ...]
    done: asyncio.Future[Any] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class GroupInsert:
    """`INSERT ... VALUES (?, ...)` shared by concurrent callers.

    `returning` names the columns to return; `key_of` maps a returned row to its batch key
    (required with `returning`). `submit` answers that row, or None without `returning`.
    """

    def __init__(self, run: RunSql, insert: str, *, returning: str | None = None,
                 key_of: Callable[[Any], Hashable] | None = None, max_rows: int = 64,
                 conflict: str = "", after: str = "") -> None:
        """`after`: SQL that follows the VALUES list (an `UPDATE ... FROM (VALUES ...) AS v
        WHERE ...` is batched like an insert: the statement then ends with `) AS v WHERE ...`)."""
        head, found, values = insert.rpartition("VALUES")
        if not found or not values.strip().startswith("("):
            raise ValueError("GroupInsert needs an INSERT ... VALUES (...) statement")
        if returning is not None and key_of is None:
            raise ValueError("RETURNING rows are matched to callers by key: key_of is required")
        self._run = run
        self._head = f"{head}VALUES "
        self._values = values.strip()
        # e.g. "ON CONFLICT DO NOTHING" (PostgreSQL's INSERT OR IGNORE), before RETURNING
        self._conflict = f"{after} {conflict}" if conflict else after
        self._returning = f" RETURNING {returning}" if returning else ""
        self._key_of = key_of
        self._max_rows = max_rows
        self._pending: list[_Row] = []
        self._flusher: asyncio.Task[None] | None = None
        self.flushes = 0
        self.rows = 0

    async def submit(self, key: Hashable, values: tuple[Any, ...]) -> Any:
        row = _Row(key, values)
        self._pending.append(row)
        if self._flusher is None:
            self._flusher = asyncio.get_running_loop().create_task(self._drain(), name="group-insert")
        # The row is written even if this caller is cancelled (as with a plain statement
        # already handed to the database thread): a cancel only cancels `done`, which the
        # flush then leaves alone (no shield: one future less per row).
        return await row.done

    async def close(self, timeout: float = 10.0) -> None:
        """Let queued rows reach the database; past `timeout` the rest fail as cancelled."""
        flusher = self._flusher
        if flusher is None:
            return
        await asyncio.wait([flusher], timeout=timeout)
        if not flusher.done():
            flusher.cancel()
            await asyncio.wait([flusher], timeout=timeout)

    def _take(self) -> list[_Row]:
        batch: list[_Row] = []
        keys: set[Hashable] = set()
        for row in self._pending:
            if row.key not in keys:
                keys.add(row.key)
                batch.append(row)
        # Batch sizes are powers of two: each size is a prepared statement kept in the
        # connection's cache (about 2 KB per row of it), so few sizes keep memory flat.
        size = 1 << (min(len(batch), self._max_rows).bit_length() - 1)
        taken = {id(row) for row in batch[:size]}
        self._pending = [row for row in self._pending if id(row) not in taken]
        return batch[:size]

    async def _drain(self) -> None:
        try:
            while self._pending:
                batch = self._take()
                try:
                    await self._flush(batch)
                except BaseException as err:
                    for row in batch:
                        _fail(row, err)
                    if isinstance(err, asyncio.CancelledError):
                        raise
        except asyncio.CancelledError:
            for row in self._pending:
                _fail(row, asyncio.CancelledError())
            self._pending = []
            raise
        finally:
            self._flusher = None

    async def _flush(self, batch: list[_Row]) -> None:
        try:
            found = await self._insert(batch)
        except Exception as err:
            if len(batch) == 1:
                _fail(batch[0], err)
                return
            # One bad row must not fail its neighbours: each row alone, with its own error.
            log.debug("group insert failed; retrying row by row", extra={"error": str(err)[:200]})
            for row in batch:
                try:
                    found = await self._insert([row])
                except Exception as row_err:
                    _fail(row, row_err)
                else:
                    _answer(row, found.get(row.key))
            return
        self.flushes += 1
        self.rows += len(batch)
        for row in batch:
            _answer(row, found.get(row.key))

    async def _insert(self, batch: list[_Row]) -> dict[Hashable, Any]:
        sql = self._head + ", ".join([self._values] * len(batch)) + self._conflict + self._returning
        result = await self._run(sql, tuple(v for row in batch for v in row.values))
        if self._key_of is None:
            return {}
        return {self._key_of(r): r for r in result}


def _answer(row: _Row, value: Any) -> None:
    if not row.done.done():
        row.done.set_result(value)


def _fail(row: _Row, err: BaseException) -> None:
    if not row.done.done():
        if isinstance(err, asyncio.CancelledError):
            row.done.cancel()
        else:
            row.done.set_exception(err)
