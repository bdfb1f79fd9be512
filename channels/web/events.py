"""What reaches a web session while none of its requests waits — a scheduled task's
reply, one that came after its page stopped waiting, one answered after a restart —
pushed to the session's open pages as Server-Sent Events (`GET /api/events?session=NAME`,
channels/web/adapter.py).

Each event has an id, `<boot>-<n>`: a page that reconnects (EventSource does so by itself,
after the `retry` the stream announces) sends the last one it saw as `Last-Event-ID` and
gets what it missed from the few events kept per session; when they cannot say (another
process, or more were missed than are kept) it gets `resync` and reloads the history,
where every reply is stored anyway.

Everything is bounded: events kept per session and sessions kept, events waiting for a
page that does not read (it is dropped and reconnects), streams per address and in all."""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections import OrderedDict, deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from gateway.http.throttle import client_key

EVENTS_KEPT = 50  # per session, for a page that reconnects
SESSIONS_KEPT = 1000  # sessions whose recent events are kept (least recently used go first)
STREAMS_PER_ADDRESS = 8  # open event streams from one address (a browser's tabs)
STREAMS_MAX = 256  # open event streams in all
QUEUE_MAX = 50  # events waiting for one page; past this it is dropped and catches up on reconnect
RETRY_MS = 3000  # how long a page waits before it reconnects
STREAM_MAX_S = 1800.0  # a stream ends after this; the page reconnects (and shows what it missed)


@dataclass(frozen=True, slots=True)
class PushedEvent:
    number: int  # 0: not kept, sent without an id (`notify`)
    name: str
    data: dict[str, Any]


class Listener:
    """One open stream of a session: the events for it, until it is closed."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[PushedEvent] = asyncio.Queue(QUEUE_MAX)
        self.overflowed = False  # the page stopped reading: it ends, and reconnects

    def offer(self, event: PushedEvent) -> None:
        try:
            self.queue.put_nowait(event)
        except asyncio.QueueFull:
            self.overflowed = True


class StreamLimit(Exception):
    """Too many event streams, from this address or in all."""


class SessionEvents:
    def __init__(self) -> None:
        self.boot = uuid.uuid4().hex[:12]  # ids of an earlier process mean nothing here
        self._numbers = itertools.count(1)
        self.last_number = 0
        self._recent: OrderedDict[str, deque[PushedEvent]] = OrderedDict()
        self._lost: dict[str, int] = {}  # session → the newest number it dropped from its kept events
        self._forgotten = 0  # the newest number of a session whose kept events were dropped whole
        self._listeners: dict[str, set[Listener]] = {}
        self._per_address: dict[str, int] = {}
        self.streams = 0

    def event_id(self, number: int) -> str:
        return f"{self.boot}-{number}"

    def notify(self, session: str, name: str, data: dict[str, Any]) -> int:
        """Hand an event to the session's open pages only: not kept for reconnecting
        ones and without an id (news that is stale once missed); how many pages are open."""
        listeners = self._listeners.get(session)
        if not listeners:
            return 0
        event = PushedEvent(0, name, data)
        for listener in listeners:
            listener.offer(event)
        return len(listeners)

    def publish(self, session: str, name: str, data: dict[str, Any]) -> int:
        """Keep the event for reconnecting pages and hand it to the open ones; how many
        pages are open for the session."""
        self.last_number = number = next(self._numbers)
        event = PushedEvent(number, name, data)
        kept = self._recent.get(session)
        if kept is None:
            kept = self._recent[session] = deque(maxlen=EVENTS_KEPT)
            while len(self._recent) > SESSIONS_KEPT:
                old, events = self._recent.popitem(last=False)
                self._forgotten = max(self._forgotten, events[-1].number if events else 0)
                self._lost.pop(old, None)
        self._recent.move_to_end(session)
        if len(kept) == kept.maxlen:
            self._lost[session] = kept[0].number
        kept.append(event)
        listeners = self._listeners.get(session, set())
        for listener in listeners:
            listener.offer(event)
        return len(listeners)

    def missed(self, session: str, last_event_id: str | None) -> list[PushedEvent] | None:
        """The session's events after `last_event_id` (a page reconnecting); None when they
        are not all known here (the page reloads its history instead)."""
        if not last_event_id:
            return []
        boot, _, number_text = last_event_id.strip().partition("-")
        if boot != self.boot or not number_text.isdigit() or len(number_text) > 18:
            return None
        number = int(number_text)
        if number < self._lost.get(session, 0) or (number < self._forgotten and session not in self._recent):
            return None
        return [event for event in self._recent.get(session, ()) if event.number > number]

    def listeners(self, session: str) -> int:
        return len(self._listeners.get(session, ()))

    @contextmanager
    def listen(self, session: str, address: str | None) -> Iterator[Listener]:
        """A place for one stream; StreamLimit when the address or the server has no more."""
        who = client_key(address)
        if self.streams >= STREAMS_MAX or self._per_address.get(who, 0) >= STREAMS_PER_ADDRESS:
            raise StreamLimit(who)
        listener = Listener()
        self._listeners.setdefault(session, set()).add(listener)
        self._per_address[who] = self._per_address.get(who, 0) + 1
        self.streams += 1
        try:
            yield listener
        finally:
            self.streams -= 1
            left = self._per_address[who] - 1
            if left:
                self._per_address[who] = left
            else:
                del self._per_address[who]
            listeners = self._listeners[session]
            listeners.discard(listener)
            if not listeners:
                del self._listeners[session]
