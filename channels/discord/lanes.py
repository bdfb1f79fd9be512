"""Received messages handled beside the receiving, one lane per chat and person (issue 31:
one message with ten large files held every other Discord user for 102 s).

Each lane handles its messages one after another, in the order they arrived, so a turn
sees its own files and a person's next message comes after it; lanes run side by side, so
a slow download holds up nobody else's messages. A lane's task ends when it has nothing
left and a new one starts with the next message. `backlog` bounds the messages waiting in
all lanes: `put` waits for room, and the receiving's own inbox takes the pressure (it
drops past its size, as before). Each person also has a bound on files fetched at once
(`PersonFiles`), whatever chats they write in.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

Item = TypeVar("Item")


@dataclass(slots=True)
class _Lane(Generic[Item]):
    waiting: deque[Item] = field(default_factory=deque)
    task: asyncio.Task[None] | None = None


class Lanes(Generic[Item]):
    def __init__(self, run: Callable[[Item], Awaitable[None]], *, backlog: int, name: str = "lane") -> None:
        self._run = run
        self._room = asyncio.Semaphore(backlog)
        self._lanes: dict[Hashable, _Lane[Item]] = {}
        self._name = name
        self._idle = asyncio.Event()
        self._idle.set()
        self._closed = False

    async def put(self, key: Hashable, item: Item) -> None:
        """Queue `item` at the end of `key`'s lane (waiting for room in the backlog)."""
        await self._room.acquire()
        if self._closed:
            self._room.release()
            return
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = _Lane()
        lane.waiting.append(item)
        self._idle.clear()
        if lane.task is None:
            lane.task = asyncio.get_running_loop().create_task(self._drain(key, lane), name=self._name)

    async def _drain(self, key: Hashable, lane: _Lane[Item]) -> None:
        try:
            while lane.waiting:
                item = lane.waiting[0]
                try:
                    await self._run(item)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("a received message could not be handled")
                finally:
                    lane.waiting.popleft()
                    self._room.release()
        finally:
            lane.task = None
            if not lane.waiting and self._lanes.get(key) is lane:
                del self._lanes[key]
            if not self._lanes:
                self._idle.set()

    def __len__(self) -> int:
        """Messages waiting or being handled, in all lanes."""
        return sum(len(lane.waiting) for lane in self._lanes.values())

    async def join(self, timeout: float) -> bool:
        """Until every lane is done (True), or `timeout` seconds (False)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        return False

    async def close(self, timeout: float) -> None:
        """Cancel what is left (each lane's task), waiting at most `timeout` seconds."""
        self._closed = True
        tasks = [lane.task for lane in self._lanes.values() if lane.task is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
        self._lanes.clear()
        self._idle.set()

    def reopen(self) -> None:
        self._closed = False


class PersonFiles:
    """Per person: at most `at_once` files downloading, and at most `queued` waiting (in
    messages not handled yet); what is past the second is refused, said in the turn."""

    def __init__(self, *, at_once: int, queued: int) -> None:
        self.at_once, self.queued = at_once, queued
        self._slots: dict[Hashable, tuple[asyncio.Semaphore, int]] = {}
        self._waiting: dict[Hashable, int] = {}

    def take(self, person: Hashable, files: int) -> bool:
        """Count `files` as waiting for `person`; False (nothing counted) past the bound."""
        now = self._waiting.get(person, 0)
        if files and now + files > self.queued:
            return False
        if files:
            self._waiting[person] = now + files
        return True

    def done(self, person: Hashable, files: int) -> None:
        left = self._waiting.get(person, 0) - files
        if left > 0:
            self._waiting[person] = left
        else:
            self._waiting.pop(person, None)

    @contextlib.asynccontextmanager
    async def slot(self, person: Hashable) -> AsyncIterator[None]:
        """One of the person's download places, for one file."""
        semaphore, users = self._slots.get(person) or (asyncio.Semaphore(self.at_once), 0)
        self._slots[person] = (semaphore, users + 1)
        try:
            async with semaphore:
                yield
        finally:
            semaphore, users = self._slots[person]
            if users <= 1:
                del self._slots[person]
            else:
                self._slots[person] = (semaphore, users - 1)
