"""WAL checkpoints off the path of the chat's writes.

SQLite's automatic checkpoint runs inside whichever commit pushes the WAL over its
threshold, on the connection that committed: there it copies pages into the database
file and fsyncs it, and every statement queued behind it on that connection waits. Under
load that was a 15-20 ms stall every few hundred milliseconds for all turns in flight
(bench/gateway_load.py, paced runs). So the store's connection never checkpoints; this
one, with a connection and a thread of its own, runs a PASSIVE checkpoint every
`interval_s`: it copies the WAL into the database without blocking the writer.

A PASSIVE checkpoint never rewinds the WAL: the next commit does, but only when nothing
was appended since. Under steady writes that moment never comes and the WAL would grow
without end, so once it is over `max_wal_bytes`, `fold` runs a RESTART checkpoint on
the store's own connection (2-5 ms): the PASSIVE pass just before left it little to
copy, and on the writer's own connection it waits for no lock. From this connection it
would hold the writer back, and SQLite's busy handler retries in sleeps of up to 100 ms;
TRUNCATE instead of RESTART cost ~45 ms (cutting a 32 MB file).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiosqlite

log = logging.getLogger("gateway.store")

Connect = Callable[[Path], Awaitable[aiosqlite.Connection]]
Fold = Callable[[], Awaitable[object]]

MAX_WAL_BYTES = 32 * 2**20


class Checkpointer:
    def __init__(self, db: aiosqlite.Connection, interval_s: float, max_wal_bytes: int, fold: Fold,
                 writes: Callable[[], int]) -> None:
        self._db = db
        self._fold = fold
        self._writes = writes
        self.interval_s = interval_s
        self.max_wal_bytes = max_wal_bytes
        self._task: asyncio.Task[None] | None = None
        self._seen: int | None = None  # `writes` before the last checkpoint that went through
        self._page_size = 4096
        self.runs = 0
        self.wal_frames = 0  # frames in the WAL at the last checkpoint
        self.wal_copied = 0  # of those, copied into the database file
        self.folds = 0  # times the WAL was over the limit and `fold` ran

    @classmethod
    async def start(cls, path: Path, interval_s: float, connect: Connect, fold: Fold, *,
                    writes: Callable[[], int], max_wal_bytes: int = MAX_WAL_BYTES) -> Checkpointer:
        """`writes` counts the store's statements: while it stands still there is nothing
        new to copy, and an idle gateway makes no checkpoint calls."""
        db = await connect(path)
        checkpointer = cls(db, interval_s, max_wal_bytes, fold, writes)
        try:
            rows = list(await db.execute_fetchall("PRAGMA page_size"))
        except BaseException:
            await db.close()
            raise
        checkpointer._page_size = int(rows[0][0]) if rows else 4096
        checkpointer._task = asyncio.get_running_loop().create_task(checkpointer._run(), name="wal-checkpoint")
        return checkpointer

    async def _run(self) -> None:
        failed = False
        while True:
            await asyncio.sleep(self.interval_s)
            mark = self._writes()
            if mark == self._seen:
                continue
            try:
                await self.checkpoint_once()
            except asyncio.CancelledError:
                raise
            except Exception as err:
                if not failed:  # once per failure streak: a broken disk must not flood the log
                    log.warning("WAL checkpoint failed", extra={"error": str(err)[:200]})
                failed = True
                continue
            failed = False
            self._seen = mark

    async def checkpoint_once(self) -> None:
        rows = list(await self._db.execute_fetchall("PRAGMA wal_checkpoint(PASSIVE)"))
        self.runs += 1
        if not rows or rows[0][1] is None or rows[0][1] < 0:
            return  # not in WAL mode
        frames, copied = int(rows[0][1]), int(rows[0][2])
        self.wal_frames, self.wal_copied = frames, max(0, copied)
        if frames * self._page_size > self.max_wal_bytes:
            await self._fold()
            self.folds += 1

    async def close(self, timeout: float = 5.0) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait([task], timeout=timeout)
        await self._db.close()
