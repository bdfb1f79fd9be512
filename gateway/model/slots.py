"""Model-call slots: at most `limit` model calls in flight across all sessions
(`limits.max_concurrent_model_calls`). Unlike asyncio.Semaphore the limit can change while
calls run (a reload): raising it lets waiters in at once; lowering it lets the calls in
flight finish and admits new ones only below the new limit. Waiters are served in order."""

from __future__ import annotations

import asyncio
from collections import deque
from types import TracebackType


class ModelSlots:
    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("a slot limit is at least 1")
        self._limit = limit
        self._in_use = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def in_use(self) -> int:
        return self._in_use

    def resize(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("a slot limit is at least 1")
        self._limit = limit
        self._wake()

    async def __aenter__(self) -> None:
        if self._in_use < self._limit and not self._waiters:
            self._in_use += 1
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._release()  # granted just as we were cancelled: pass the slot on
            else:
                self._forget(waiter)
            raise

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self._release()

    def _forget(self, waiter: asyncio.Future[None]) -> None:
        try:
            self._waiters.remove(waiter)
        except ValueError:
            pass

    def _release(self) -> None:
        self._in_use -= 1
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self._in_use < self._limit:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self._in_use += 1
                waiter.set_result(None)
