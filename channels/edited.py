"""What the edited reply streams of the platforms share (Telegram's, Discord's).

The agent appends text or sets a status line; one writer task per stream makes the
platform calls, one at a time, paced per chat (`Pace`). Right before each call the
messages the reply should show are recomputed from the whole reply (`_view`) and the one
call that brings the shown ones closest is made (`_next_call`), so text that piled up
while a call or a rate-limit wait was in progress goes out in one update: nothing is
dropped and nothing is sent twice. A subclass is the platform: how the reply is cut into
messages, how one is sent, edited and deleted, and what its errors mean.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Generic, TypeVar

from channels.base import ReplyRefSink, StreamObserver

REF_TIMEOUT_S = 10.0  # reporting the shown messages to the gateway
FINISH_TIMEOUT_S = 120.0  # the final text, however many messages and 429s it takes
IDLE_EXIT_S = 900.0  # a writer with nothing to do for this long ends (a later call restarts it)
NETWORK_ATTEMPTS = 5  # consecutive transport failures before the stream gives up
STATUS_MARK = "⏳"
MAX_PACES = 1024  # chats whose pace is remembered; idle ones are forgotten beyond this

T = TypeVar("T")  # what one message shows, as the platform renders it


class Pace:
    """When the next call of a stream to one chat may go out. Shared by every stream to
    that chat; the lock makes their updates take turns."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.next_at = 0.0  # loop time: no update before (the interval after the last one)
        self.blocked_until = 0.0  # loop time: no call at all before (a 429's retry_after, a backoff)

    async def wait_turn(self, *, paced: bool = True, unless: asyncio.Event | None = None) -> bool:
        """Sleep until a call is allowed: an update waits for the interval too, an unpaced
        call only for a flood-control wait. Bounded by the interval or the capped wait that
        set the time; False when `unless` was set first (no call may go out yet)."""
        at = max(self.next_at, self.blocked_until) if paced else self.blocked_until
        delay = at - asyncio.get_running_loop().time()
        if delay <= 0:
            return True
        if unless is None:
            await asyncio.sleep(delay)
            return True
        try:
            await asyncio.wait_for(unless.wait(), delay)
        except TimeoutError:
            return True
        return False

    def after(self, seconds: float) -> None:
        """No update before `seconds` from now (a call just ended)."""
        self.next_at = max(self.next_at, asyncio.get_running_loop().time() + seconds)

    def block(self, seconds: float) -> None:
        """No call at all before `seconds` from now (the platform said to wait)."""
        self.blocked_until = max(self.blocked_until, asyncio.get_running_loop().time() + seconds)


class Paces:
    """One `Pace` per chat, for a channel's streams."""

    def __init__(self) -> None:
        self._by_chat: dict[str, Pace] = {}

    def of(self, chat: int | str) -> Pace:
        key = str(chat)
        pace = self._by_chat.get(key)
        if pace is None:
            if len(self._by_chat) >= MAX_PACES:
                now = asyncio.get_running_loop().time()
                for idle, old in list(self._by_chat.items()):
                    if not old.lock.locked() and max(old.next_at, old.blocked_until) <= now:
                        del self._by_chat[idle]
            pace = self._by_chat[key] = Pace()
        return pace


def ref_ids(ref: str | None, *, key: str, place: int | str, platform: str, log: logging.Logger) -> list[object]:
    """The message ids (unchecked) of a reference an earlier stream of the turn reported
    (`{key: place, "message_ids": […]}`), when it was to the same place; [] otherwise."""
    if not ref:
        return []
    try:
        data = json.loads(ref)
    except ValueError:
        log.warning("%s: unreadable stream reference ignored", platform)
        return []
    if not isinstance(data, dict) or str(data.get(key)) != str(place):
        log.warning("%s: stream reference for another %s ignored", platform, key.removesuffix("_id"))
        return []
    ids = data.get("message_ids")
    return ids if isinstance(ids, list) else []


@dataclass(slots=True)
class Shown(Generic[T]):
    message_id: int
    shows: T | None  # None when unknown (a resumed turn's message, a retried send's)


Call = tuple[str, int, T | None]  # "send" / "edit" (message index), "delete" (message id), a platform's own


class EditedReplyStream(ABC, Generic[T]):
    """One reply as it grows, shown by editing messages (implements `ReplyStream`)."""

    platform: ClassVar[str]  # in logs and errors: "telegram"
    log: ClassVar[logging.Logger]
    network_errors: ClassVar[tuple[type[BaseException], ...]]  # failures the final text tries again

    def __init__(
        self, *, alive: Callable[[], object], pace: Pace, interval: Callable[[], float],
        tasks: set[asyncio.Task[None]], on_ref: ReplyRefSink | None, resume_ids: list[int] | None,
        observe: StreamObserver | None, limit: int, clean: Callable[[str], str],
        render: Callable[[str], list[T]], status_view: Callable[[str], T],
    ) -> None:
        self._alive = alive  # raises RuntimeError once the channel has stopped
        self._pace = pace
        self._interval_of = interval  # read at each update: a config reload applies at once
        self._tasks = tasks
        self._on_ref = on_ref
        self._observe_cb = observe
        self._limit = limit
        self._clean = clean  # text from the agent made safe to show
        self._render = render  # the final text cut exactly as `send()` cuts it
        self._status_view = status_view

        self._parts: list[str] = []  # the answer's Markdown since the last status
        self._cuts: list[int] = [0]  # where each streamed message begins in the answer
        self._closed: list[T] = []  # what each closed streamed message shows, for good
        self._status: str | None = None
        self._final: list[T] | None = None
        self._shown: list[Shown[T]] = [Shown(i, None) for i in resume_ids or ()]
        self._orphans: list[int] = []  # messages no longer part of the reply: to delete
        self._reported: list[int] = [s.message_id for s in self._shown]
        self._started = bool(self._shown)  # a message of the reply exists (a resumed one has)
        self._network_failures = 0
        self._failure: BaseException | None = None
        self._wake = asyncio.Event()
        self._finished = asyncio.Event()  # the final text came
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------ the platform's part

    @abstractmethod
    def _where(self) -> int | str: ...  # the chat, for logs

    @abstractmethod
    def _ref(self, message_ids: list[int]) -> str: ...  # reported through `on_ref`

    @abstractmethod
    def _streamed(self, answer: str) -> list[T]: ...  # the answer so far in messages; cut ones closed

    @abstractmethod
    async def _send(self, want: T) -> None: ...  # the next message, appended to `_shown`

    @abstractmethod
    async def _edit_message(self, message_id: int, want: T) -> None: ...

    @abstractmethod
    async def _delete_message(self, message_id: int) -> None: ...

    @abstractmethod
    async def _make(self, call: Call[T]) -> None: ...  # `_call` then `_made`, the platform's errors handled

    # ------------------------------------------------------------ ReplyStream

    async def append(self, delta: str) -> None:
        if self._final is not None or not delta:
            return
        self._parts.append(self._clean(delta))
        self._changed()

    async def status(self, line: str) -> None:
        if self._final is not None:
            return
        line = " ".join(self._clean(line).split())
        if line and not line.startswith(STATUS_MARK):
            line = f"{STATUS_MARK} {line}"
        # What a step wrote before it called tools is not part of the answer.
        self._parts, self._cuts, self._closed = [], [0], []
        self._status = line[: self._limit // 2] or None
        self._changed()

    async def finish(self, text: str) -> None:
        await self._deliver(text)

    async def fail(self, text: str) -> None:
        await self._deliver(text)

    # ------------------------------------------------------------ the writer

    def _changed(self) -> None:
        if self._failure is not None:
            return
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._flush_forever(), name=f"{self.platform}-stream")
            self._tasks.add(self._task)
            self._task.add_done_callback(self._tasks.discard)
        self._wake.set()

    async def _deliver(self, text: str) -> None:
        """Make the visible messages exactly `send()`'s messages of `text`; raises when
        they could not be shown. Called again (a `fail` after a `finish` that raised),
        the new text replaces the old one."""
        self._final = self._render(text)
        self._finished.set()
        if isinstance(self._failure, self.network_errors):
            # The connection may be back: the final text gets a fresh set of attempts.
            self._failure, self._network_failures = None, 0
        if self._failure is not None:
            raise self._failure
        self._changed()
        task = self._task
        assert task is not None
        done, _ = await asyncio.wait({task}, timeout=FINISH_TIMEOUT_S)
        if not done:
            task.cancel()
            await asyncio.wait({task}, timeout=1)
            raise TimeoutError(f"{self.platform}: the reply was not shown within {FINISH_TIMEOUT_S:.0f} s")
        if task.cancelled():
            raise RuntimeError(f"{self.platform}: the channel stopped while the reply was shown")
        if self._failure is not None:
            raise self._failure

    def _answer(self) -> str:
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def _view(self) -> list[T]:
        """What the reply's messages should show now, in order."""
        if self._final is not None:
            return self._final
        answer = self._answer()
        if not answer.strip():
            return [self._status_view(self._status)] if self._status else []
        return self._streamed(answer)

    def _next_call(self) -> Call[T] | None:
        """The one call that brings the messages closest to the view, or None."""
        if self._orphans:
            return ("delete", self._orphans[0], None)
        view = self._view()
        if not view and self._final is None:
            return None  # nothing to show yet: keep what is there (a resumed reply's messages)
        for i, want in enumerate(view):
            if i >= len(self._shown):
                return ("send", i, want)
            if self._shown[i].shows != want:
                return ("edit", i, want)
        if len(self._shown) > len(view):
            self._orphans += [s.message_id for s in self._shown[len(view):]]
            del self._shown[len(view):]
            return ("delete", self._orphans[0], None)
        return None

    def _hold(self) -> float:
        return 0.0  # seconds before anything may be shown

    def _idle_wait(self) -> float:
        return IDLE_EXIT_S

    def _idle_timed_out(self) -> bool:
        return False  # the writer ends; append/status/finish start a new one

    def _gives_way(self) -> asyncio.Event | None:
        return None  # an event that cuts a wait for the pace short

    async def _flush_forever(self) -> None:
        """The stream's one writer: makes every platform call, one at a time, paced."""
        try:
            while True:
                try:
                    self._alive()
                except RuntimeError as exc:  # the channel stopped: nothing more can be shown
                    self._failure = exc
                    return
                self._wake.clear()
                hold = self._hold()
                if hold > 0:  # the first interval: `finish` (or its end) wakes us
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), hold)
                    continue
                if self._next_call() is None:
                    if self._final is not None:
                        return
                    try:
                        await asyncio.wait_for(self._wake.wait(), self._idle_wait())
                    except TimeoutError:
                        if not self._idle_timed_out():
                            return
                    continue
                await self._turn()
                await self._report_ref()
                if self._failure is not None:
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must not leave finish() waiting
            self.log.exception("%s: reply stream to %s failed", self.platform, self._where())
            self._failure = exc

    async def _turn(self) -> None:
        async with self._pace.lock:
            if await self._pace.wait_turn(unless=self._gives_way()):
                await self._make_next()

    async def _make_next(self) -> None:
        call = self._next_call()  # what piled up while waiting goes out at once
        if call is not None:
            await self._make(call)

    async def _call(self, call: Call[T]) -> None:
        kind, index, want = call
        if kind == "delete":
            await self._delete_message(index)
            self._orphans.remove(index)
        elif kind == "send":
            assert want is not None
            await self._send(want)
        else:
            assert want is not None
            await self._edit_message(self._shown[index].message_id, want)
            self._shown[index].shows = want
            self._observe("edit")

    # ------------------------------------------------------------ outcomes

    def _made(self) -> None:
        self._network_failures = 0
        self._pace.after(self._interval())

    def _network_failed(self, exc: BaseException) -> None:
        self._network_failures += 1
        if self._network_failures >= NETWORK_ATTEMPTS:
            self.log.warning("%s: reply stream to %s gave up: %s", self.platform, self._where(), exc)
            self._failure = exc
        else:
            self._pace.block(min(2.0 ** (self._network_failures - 1), 30.0))

    def _stopped(self, exc: BaseException) -> None:  # no access, a bad token …
        self.log.warning("%s: reply stream to %s stopped: %s", self.platform, self._where(), exc)
        self._failure = exc

    def _send_refused(self, exc: BaseException) -> None:
        self.log.warning("%s: message to %s refused: %s", self.platform, self._where(), exc)
        self._failure = exc

    def _not_removed(self, message_id: int, exc: BaseException | None) -> None:
        """A left-over message was not deleted (`exc` None: it is gone already)."""
        self._orphans.remove(message_id)
        if exc is not None:
            self.log.warning("%s: message %s of a reply could not be removed: %s", self.platform, message_id, exc)

    def _cannot_edit(self, index: int, exc: BaseException, *, delete: bool) -> None:
        """Deleted, too old, or refused for good: the reply goes on in new messages from
        `index`; the ones after it are deleted, and it too when `delete`."""
        self.log.info("%s: message %s cannot be edited (%s); continuing in a new one",
                      self.platform, self._shown[index].message_id, exc)
        lost = self._shown[index:]
        del self._shown[index:]
        self._orphans += [s.message_id for s in (lost if delete else lost[1:])]

    def _interval(self) -> float:
        try:
            return max(0.0, float(self._interval_of()))
        except Exception:  # a broken config source must not stop the reply
            return 1.0

    async def _report_ref(self) -> None:
        ids = [s.message_id for s in self._shown]
        if self._on_ref is None or ids == self._reported or not ids:
            return
        self._reported = ids
        try:
            await asyncio.wait_for(self._on_ref(self._ref(ids)), REF_TIMEOUT_S)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the reply goes on; only crash recovery loses precision
            self.log.warning("%s: the stream's message reference was not recorded: %s", self.platform, exc)

    def _observe(self, event: str) -> None:
        if self._observe_cb is not None:
            with contextlib.suppress(Exception):
                self._observe_cb(event)
