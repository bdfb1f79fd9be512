"""A reply streamed into Discord by editing messages (`channels.discord.streaming: "edit"`,
SPEC §5.1).

The agent appends text; one flusher task per stream makes the REST calls: the first
message as soon as there is text, then edits of it at most once per `stream_interval_s`
per channel (every stream into one channel shares its pace). What a message should show
is recomputed from the whole reply right before each call, so text that piled up while a
call or a rate-limit wait was in progress goes out in one edit: nothing is dropped and
nothing is sent twice. Discord's rate limits are kept by discord.py's HTTP client (it
waits out a 429's `retry_after` and sends the same edit again); a wait longer than it
accepts pauses the stream's calls instead.

Discord renders Markdown itself, so the growing reply is shown as it is, cut into
messages of at most 2,000 characters (`format.next_cut`: a code block cut in two is
closed and reopened). A message that was cut is closed (its text no longer changes) and
the reply goes on in a new one. On `finish` the reply is cut exactly as `send()` cuts it
(`render_markdown`: tables as code blocks), each message is edited to its part, missing
ones are posted and left-over ones deleted.

A status line ("⏳ reading notes.md…") is shown as the message text and replaced by the
answer; before any text it posts the first message, so the person sees what is happening
at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import discord

from channels.base import ReplyRefSink, StreamObserver
from channels.discord.format import DISCORD_TEXT_LIMIT, Fences, clean_text, next_cut, render_markdown, shown
from channels.discord.transport import RATE_LIMITED, DiscordRest, new_nonce

log = logging.getLogger(__name__)

MAX_RETRY_WAIT_S = 60.0  # longest rate-limit pause honoured in one go
MAX_RATE_LIMIT_PAUSE_S = 5.0  # after discord.py gave up on a bucket that stays exhausted
CALL_TIMEOUT_S = 60.0  # one REST call of a stream, discord.py's own rate-limit waits included
REF_TIMEOUT_S = 10.0  # reporting the shown messages to the gateway
FINISH_TIMEOUT_S = 120.0  # the final text, however many messages and 429s it takes
IDLE_EXIT_S = 900.0  # a flusher with nothing to do for this long ends (a later call restarts it)
NETWORK_ATTEMPTS = 5  # consecutive transport failures before the stream gives up
STATUS_MARK = "⏳"
MAX_PACES = 1024  # channels whose pace is remembered; idle ones are forgotten beyond this

_NETWORK_ERRORS = (discord.DiscordServerError, aiohttp.ClientError, OSError, TimeoutError)


# ---------------------------------------------------------------------------- pacing


class ChannelPace:
    """When the next REST call of a stream into one channel may go out. Shared by every
    stream into that channel; the lock makes them take turns."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.next_at = 0.0  # loop time

    async def wait_turn(self) -> None:
        delay = self.next_at - asyncio.get_running_loop().time()
        if delay > 0:
            await asyncio.sleep(delay)

    def after(self, seconds: float) -> None:
        """No call before `seconds` from now (a call just ended, or Discord said to wait)."""
        at = asyncio.get_running_loop().time() + seconds
        self.next_at = max(self.next_at, at)


class ChannelPaces:
    """One `ChannelPace` per Discord channel (a thread is a channel of its own)."""

    def __init__(self) -> None:
        self._by_channel: dict[int, ChannelPace] = {}

    def for_channel(self, channel_id: int) -> ChannelPace:
        pace = self._by_channel.get(channel_id)
        if pace is None:
            if len(self._by_channel) >= MAX_PACES:
                now = asyncio.get_running_loop().time()
                for key, idle in list(self._by_channel.items()):
                    if not idle.lock.locked() and idle.next_at <= now:
                        del self._by_channel[key]
            pace = self._by_channel[channel_id] = ChannelPace()
        return pace


# ---------------------------------------------------------------------------- refs


def reply_ref(channel_id: int, message_ids: list[int]) -> str:
    """The opaque reference a stream reports: the channel and its messages, in order."""
    return json.dumps({"channel_id": str(channel_id), "message_ids": [str(i) for i in message_ids]},
                      separators=(",", ":"))


def parse_reply_ref(ref: str | None, channel_id: int) -> list[int]:
    """The message ids an earlier stream of the same turn reported, when it streamed into
    the same channel; [] otherwise."""
    if not ref:
        return []
    try:
        data = json.loads(ref)
    except ValueError:
        log.warning("discord: unreadable stream reference ignored")
        return []
    if not isinstance(data, dict) or str(data.get("channel_id")) != str(channel_id):
        log.warning("discord: stream reference for another channel ignored")
        return []
    ids = data.get("message_ids")
    if not isinstance(ids, list):
        return []
    return [int(i) for i in ids if isinstance(i, str) and i.isdigit() and 0 < int(i) < 1 << 64]


@dataclass(slots=True)
class _Shown:
    message_id: int
    text: str | None  # what it shows; None when unknown (a resumed turn's, a retried post's)


# ---------------------------------------------------------------------------- the stream


class DiscordReplyStream:
    """One reply as it grows, shown by editing Discord messages (implements `ReplyStream`)."""

    def __init__(
        self,
        *,
        rest: Callable[[], DiscordRest],
        channel_id: int,
        reply_to: int | None,
        pace: ChannelPace,
        interval: Callable[[], float],
        tasks: set[asyncio.Task[None]],
        on_ref: ReplyRefSink | None = None,
        resume_ids: list[int] | None = None,
        observe: StreamObserver | None = None,
        limit: int = DISCORD_TEXT_LIMIT,
    ) -> None:
        self._rest = rest  # looked up per call: raises once the channel has stopped
        self._channel = channel_id
        self._reply_to = reply_to  # referenced by the stream's first message only (as send() does)
        self._pace = pace
        self._interval_of = interval
        self._tasks = tasks
        self._on_ref = on_ref
        self._observe_cb = observe
        self._limit = limit

        self._parts: list[str] = []  # the answer's Markdown since the last status
        self._cuts: list[int] = [0]  # where each streamed message begins in the answer
        self._closed: list[str] = []  # what each closed streamed message shows, for good
        self._status: str | None = None
        self._final: list[str] | None = None
        self._shown: list[_Shown] = [_Shown(i, None) for i in resume_ids or ()]
        self._orphans: list[int] = []  # messages no longer part of the reply: to delete
        self._reported: list[int] = [s.message_id for s in self._shown]
        self._started = bool(self._shown)
        self._post_nonce: str | None = None  # of a post whose answer was lost: reused by its retry
        self._network_failures = 0
        self._failure: BaseException | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------ ReplyStream

    async def append(self, delta: str) -> None:
        if self._final is not None or not delta:
            return
        self._parts.append(clean_text(delta))
        self._changed()

    async def status(self, line: str) -> None:
        if self._final is not None:
            return
        line = " ".join(clean_text(line).split())
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

    # ------------------------------------------------------------ internals

    def _changed(self) -> None:
        if self._failure is not None:
            return
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._flush_forever(), name="discord-stream")
            self._tasks.add(self._task)
            self._task.add_done_callback(self._tasks.discard)
        self._wake.set()

    async def _deliver(self, text: str) -> None:
        """Make the visible messages exactly `send()`'s messages of `text`; raises when
        they could not be shown. A second call (a `fail` after a `finish` that raised)
        replaces the text."""
        self._final = render_markdown(text, self._limit)
        if isinstance(self._failure, _NETWORK_ERRORS):
            self._failure, self._network_failures = None, 0  # the connection may be back
        if self._failure is not None:
            raise self._failure
        self._changed()
        task = self._task
        assert task is not None
        done, _ = await asyncio.wait({task}, timeout=FINISH_TIMEOUT_S)
        if not done:
            task.cancel()
            await asyncio.wait({task}, timeout=1)
            raise TimeoutError(f"discord: the reply was not shown within {FINISH_TIMEOUT_S:.0f} s")
        if task.cancelled():
            raise RuntimeError("discord: the channel stopped while the reply was shown")
        if self._failure is not None:
            raise self._failure

    def _answer(self) -> str:
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def _view(self) -> list[str]:
        """What the reply's messages should show now, in order."""
        if self._final is not None:
            return self._final
        raw = self._answer().lstrip()
        if not raw.strip():
            return [self._status] if self._status else []
        fences = Fences.of(raw)
        while True:
            start = self._cuts[-1]
            end = next_cut(raw, start, self._limit, fences)
            if end >= len(raw):
                break
            self._closed.append(shown(raw, start, end, fences))
            self._cuts.append(end)
        texts = [*self._closed, shown(raw, self._cuts[-1], len(raw), fences)]
        return [text for text in texts if text]

    def _next_call(self) -> tuple[str, int, str | None] | None:
        """The one REST call that brings the messages closest to the view, or None."""
        if self._orphans:
            return ("delete", self._orphans[0], None)
        view = self._view()
        if not view and self._final is None:
            return None  # nothing to show yet: keep what is there (a resumed reply's messages)
        for i, want in enumerate(view):
            if i >= len(self._shown):
                return ("post", i, want)
            if self._shown[i].text != want:
                return ("edit", i, want)
        if len(self._shown) > len(view):
            self._orphans += [s.message_id for s in self._shown[len(view):]]
            del self._shown[len(view):]
            return ("delete", self._orphans[0], None)
        return None

    async def _flush_forever(self) -> None:
        """The stream's one flusher: makes every REST call, one at a time, paced."""
        RATE_LIMITED.set(self._rate_limited)  # this task's requests: discord.py's 429 retries are counted
        try:
            while True:
                try:
                    self._rest()
                except RuntimeError as exc:  # the channel stopped: nothing more can be shown
                    self._failure = exc
                    return
                self._wake.clear()
                if self._next_call() is None:
                    if self._final is not None:
                        return
                    try:
                        await asyncio.wait_for(self._wake.wait(), IDLE_EXIT_S)
                    except TimeoutError:
                        return  # abandoned; append/status/finish start a new flusher
                    continue
                async with self._pace.lock:
                    await self._pace.wait_turn()
                    call = self._next_call()  # what piled up while waiting goes out at once
                    if call is not None:
                        await self._make(call)
                await self._report_ref()
                if self._failure is not None:
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must not leave finish() waiting
            log.exception("discord: reply stream to %s failed", self._channel)
            self._failure = exc

    async def _make(self, call: tuple[str, int, str | None]) -> None:
        kind, index, text = call
        try:
            async with asyncio.timeout(CALL_TIMEOUT_S):
                if kind == "delete":
                    await self._rest().delete(self._channel, index)
                    self._orphans.remove(index)
                elif kind == "post":
                    assert text is not None
                    await self._post(text)
                else:
                    assert text is not None
                    await self._rest().edit(self._channel, self._shown[index].message_id, text)
                    self._shown[index].text = text
                    self._observe("edit")
            self._network_failures = 0
            self._pace.after(self._interval())
        except discord.RateLimited as exc:  # a wait longer than discord.py takes on itself
            wait = min(max(float(exc.retry_after), 0.0), MAX_RETRY_WAIT_S)
            log.info("discord: rate limited in %s; the reply's calls pause %.1f s", self._channel, wait)
            self._pace.after(max(wait, self._interval()))
        except discord.NotFound as exc:
            self._pace.after(self._interval())
            self._gone(kind, index, exc)
        except discord.Forbidden as exc:
            log.warning("discord: reply stream to %s stopped: %s", self._channel, exc)
            self._failure = exc
        except _NETWORK_ERRORS as exc:
            self._network_failures += 1
            if self._network_failures >= NETWORK_ATTEMPTS:
                log.warning("discord: reply stream to %s gave up: %s", self._channel, exc)
                self._failure = exc
            else:
                self._pace.after(min(2.0 ** (self._network_failures - 1), 30.0))
        except discord.HTTPException as exc:
            self._pace.after(self._interval())
            if exc.status == 429:  # still limited after discord.py's own retries
                self._pace.after(MAX_RATE_LIMIT_PAUSE_S)
            elif kind == "edit":
                self._gone(kind, index, exc)  # refused for good: go on in a new message
            elif kind == "delete":
                self._orphans.remove(index)
                log.warning("discord: message %s of a reply could not be removed: %s", index, exc)
            else:
                log.warning("discord: message to %s refused: %s", self._channel, exc)
                self._failure = exc

    def _gone(self, kind: str, index: int, exc: Exception) -> None:
        """A message of the reply cannot be changed (deleted by someone, or refused)."""
        if kind == "delete":
            self._orphans.remove(index)  # index is the message id here: already gone
        elif kind == "edit":
            log.info("discord: message %s cannot be edited (%s); continuing in a new one",
                     self._shown[index].message_id, exc)
            lost = self._shown[index:]
            del self._shown[index:]
            self._orphans += [s.message_id for s in lost[1:]]
        else:
            log.warning("discord: cannot post to %s: %s", self._channel, exc)
            self._failure = exc

    async def _post(self, text: str) -> None:
        first = not self._started
        retried = self._post_nonce is not None
        nonce = self._post_nonce = self._post_nonce or new_nonce()
        message_id = await self._rest().post(self._channel, text, nonce=nonce,
                                             reply_to=self._reply_to if first else None)
        self._post_nonce = None
        # A retried post may have returned the first attempt's message, showing older text.
        self._shown.append(_Shown(message_id, None if retried else text))
        self._started = True
        self._observe("reply" if first else "continued")

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
            await asyncio.wait_for(self._on_ref(reply_ref(self._channel, ids)), REF_TIMEOUT_S)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the reply goes on; only crash recovery loses precision
            log.warning("discord: the stream's message reference was not recorded: %s", exc)

    def _rate_limited(self) -> None:
        self._observe("rate_limited")

    def _observe(self, event: str) -> None:
        if self._observe_cb is not None:
            with contextlib.suppress(Exception):
                self._observe_cb(event)
