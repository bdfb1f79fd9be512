"""A reply streamed into Telegram (SPEC §5.1): by editing messages
(`channels.telegram.streaming: "edit"`, and `"auto"` outside private chats) or as a draft
(`"draft"` and `"auto"` in private chats, the only ones where Telegram shows drafts).

The agent appends text; one flusher task per stream makes the Bot API calls: at most one
update per `stream_interval_s` per chat (every stream to that chat shares one pace), as
plain text. What the reply should show is recomputed from the whole reply right before
each call, so text that piled up while a call or a 429 wait was in progress goes out in
one update: nothing is dropped and nothing is sent twice.

The first interval: nothing is shown during the first `stream_interval_s`. A reply that
is complete by then (`finish` came) is sent at once as one finished, formatted message:
streaming never makes a short answer arrive later than sending it whole would. A longer
one shows what it has when the interval ends. With edits the interval starts with the
reply's first text (or status line), because their last edit waits for the pace: the
first words of a long reply show up to one interval later, with what followed them, as
the first edit would have shown them. With drafts the final message never waits, so the
interval starts with the turn: only what a quick model writes within it is held back.

Edits: the first `sendMessage`, then `editMessageText`. While streaming, the reply's
Markdown is cut into messages of at most 4096 UTF-16 units of the source; a cut message
is closed (its text no longer changes) and the reply goes on in a new one. Each message
shows its part rendered as plain text (the converter's text without the entities). On
`finish` the reply is cut exactly as `send()` cuts it (`render_markdown`), each message is
edited to its chunk with formatting (plain when Telegram refuses the entities), missing
ones are sent and left-over ones deleted.

Drafts: the part being written (past 4096 units, the next part in a draft of its own)
grows in an animated draft (`sendMessageDraft`), which is not a message. On `finish` the
final chunks go out with `sendMessage`, one after another, without waiting for the pace
(only a 429's retry_after is waited out), formatted (plain where Telegram refuses the
entities). The chat gets one message per chunk and no edit; a crash before them leaves
nothing behind (a draft is a 30-second preview), and no reference is reported through
`on_ref` before a message exists, so a resumed turn never looks for a draft. A draft
unchanged for `DRAFT_REFRESH_S` (a long tool run) is sent again so it does not expire.
Where Telegram refuses a draft, this reply is shown by edits instead (nothing was shown
yet). A resumed reply that has messages edits them, whatever the mode.

A status line ("⏳ reading notes.md…") is shown as the message's (or draft's) text and
replaced by the answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from telegram.error import (
    BadRequest,
    ChatMigrated,
    NetworkError,
    RetryAfter,
    TelegramError,
)

from channels.base import ReplyRefSink, StreamObserver
from channels.telegram.bot import RawBot
from channels.telegram.format import (
    TELEGRAM_TEXT_LIMIT,
    Chunk,
    render_markdown,
    render_text,
    sanitize_text,
    utf16_len,
)

log = logging.getLogger("channels.telegram")

MAX_RETRY_WAIT_S = 60.0  # longest flood-control wait honoured in one go
CALL_TIMEOUT_S = 15.0  # connect / write / read timeout of each Bot API call of a stream
REF_TIMEOUT_S = 10.0  # reporting the shown messages to the gateway
FINISH_TIMEOUT_S = 120.0  # the final text, however many messages and 429s it takes
IDLE_EXIT_S = 900.0  # a flusher with nothing to do for this long ends (a later call restarts it)
NETWORK_ATTEMPTS = 5  # consecutive transport failures before the stream gives up
STATUS_MARK = "⏳"
MAX_PACES = 1024  # chats whose pace is remembered; idle ones are forgotten beyond this
DRAFT_REFRESH_S = 20.0  # an unchanged draft is sent again after this (Telegram drops it after 30 s)
DRAFT_ID_SPAN = 2**31 - 2**20  # draft ids are 1 … this, plus the part number (Telegram's ints are 32-bit)


def retry_seconds(exc: RetryAfter) -> float:
    """How long Telegram asked us to wait, capped."""
    with warnings.catch_warnings():  # PTB warns that the int form is deprecated
        warnings.simplefilter("ignore")
        value = exc.retry_after
    seconds = value if isinstance(value, int | float) else value.total_seconds()
    return max(0.0, min(float(seconds), MAX_RETRY_WAIT_S))


def is_format_error(exc: BadRequest) -> bool:
    text = str(exc).lower()
    return "parse" in text or "entit" in text


def _not_modified(exc: BadRequest) -> bool:
    return "not modified" in str(exc).lower()


def _gone(exc: BadRequest) -> bool:
    """The message no longer exists (deleted by someone): nothing left to remove."""
    text = str(exc).lower()
    return "not found" in text or "message_id_invalid" in text


# ---------------------------------------------------------------------------- pacing


class ChatPace:
    """When the next Bot API call of a stream to one chat may go out. Shared by every
    stream to that chat; the lock makes their updates take turns."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.next_at = 0.0  # loop time: no update before (the interval after the last one)
        self.blocked_until = 0.0  # loop time: no call at all before (a 429's retry_after, a backoff)

    async def wait_turn(self, *, paced: bool = True, unless: asyncio.Event | None = None) -> bool:
        """Sleep until a call is allowed: an update waits for the interval too, a draft
        reply's final message only for a flood-control wait. Bounded by the interval or the
        capped wait that set the time; False when `unless` was set first (the wait was cut
        short: no call may go out yet)."""
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
        at = asyncio.get_running_loop().time() + seconds
        self.next_at = max(self.next_at, at)

    def block(self, seconds: float) -> None:
        """No call at all before `seconds` from now (Telegram said to wait)."""
        at = asyncio.get_running_loop().time() + seconds
        self.blocked_until = max(self.blocked_until, at)


class ChatPaces:
    """One `ChatPace` per chat, for a channel's streams."""

    def __init__(self) -> None:
        self._by_chat: dict[str, ChatPace] = {}

    def for_chat(self, chat: int | str) -> ChatPace:
        key = str(chat)
        pace = self._by_chat.get(key)
        if pace is None:
            if len(self._by_chat) >= MAX_PACES:
                self._forget_idle()
            pace = self._by_chat[key] = ChatPace()
        return pace

    def _forget_idle(self) -> None:
        now = asyncio.get_running_loop().time()
        for key, pace in list(self._by_chat.items()):
            if not pace.lock.locked() and max(pace.next_at, pace.blocked_until) <= now:
                del self._by_chat[key]


# ---------------------------------------------------------------------------- refs


def reply_ref(chat: int | str, message_ids: list[int]) -> str:
    """The opaque reference a stream reports: the chat and its messages, in order."""
    return json.dumps({"chat_id": chat, "message_ids": message_ids}, separators=(",", ":"))


def parse_reply_ref(ref: str | None, chat: int | str) -> list[int]:
    """The message ids of a reference reported by an earlier stream to the same chat
    (a resumed turn); [] when there is none or it does not fit."""
    if not ref:
        return []
    try:
        data = json.loads(ref)
    except ValueError:
        log.warning("telegram: unreadable stream reference ignored")
        return []
    if not isinstance(data, dict) or str(data.get("chat_id")) != str(chat):
        log.warning("telegram: stream reference for another chat ignored")
        return []
    ids = data.get("message_ids")
    if not isinstance(ids, list):
        return []
    return [i for i in ids if isinstance(i, int) and not isinstance(i, bool) and i > 0]


# ---------------------------------------------------------------------------- streaming view


def _cut(raw: str, start: int, limit: int) -> int:
    """Where a streamed message that begins at `start` ends: within `limit` UTF-16 units,
    after a blank line, a line break or a space in its second half if there is one."""
    units, end = 0, start
    for i in range(start, len(raw)):
        width = 2 if ord(raw[i]) > 0xFFFF else 1
        if units + width > limit:
            break
        units += width
        end = i + 1
    floor = start + (end - start) // 2
    for separator in ("\n\n", "\n", " "):
        at = raw.rfind(separator, floor, end)
        if at >= 0:
            return at + len(separator)
    return max(end, start + 1)


def _plain(markdown: str, limit: int) -> str:
    """A part of the reply as it reads rendered, without formatting; the source itself
    when the rendering would not fit one message."""
    text = render_text(markdown).strip()
    if text and utf16_len(text) <= limit:
        return text
    return markdown.strip()


@dataclass(slots=True)
class _Shown:
    message_id: int
    chunk: Chunk | None  # what it shows; None when unknown (a message of a resumed turn)


# ---------------------------------------------------------------------------- the stream


class TelegramReplyStream:
    """One reply as it grows, shown by editing Telegram messages or as a draft
    (implements `ReplyStream`)."""

    def __init__(
        self,
        *,
        bot: Callable[[], RawBot],
        chat: int | str,
        thread: int | None,
        reply_to: int | None,
        pace: ChatPace,
        interval: Callable[[], float],
        tasks: set[asyncio.Task[None]],
        on_ref: ReplyRefSink | None = None,
        resume_ids: list[int] | None = None,
        observe: StreamObserver | None = None,
        limit: int = TELEGRAM_TEXT_LIMIT,
        link_preview: dict[str, bool] | None = None,
        drafts: bool = False,
        on_drafts_refused: Callable[[], None] | None = None,
    ) -> None:
        self._bot = bot  # looked up per call: raises once the channel has stopped
        self._chat = chat
        self._thread = thread
        self._reply_to = reply_to  # quoted by the stream's first message only (as send() does)
        self._pace = pace
        self._interval_of = interval  # read at each update: a config reload applies at once
        self._tasks = tasks
        self._on_ref = on_ref
        self._observe_cb = observe
        self._limit = limit
        self._link_preview = link_preview  # sent with every message and edit (None: Telegram's default)

        self._parts: list[str] = []  # the answer's Markdown since the last status
        self._cuts: list[int] = [0]  # where each streamed message begins in the answer
        self._closed: list[str] = []  # what each closed streamed message shows, for good
        self._open_memo: tuple[str, str] | None = None  # the open message's Markdown → its plain text
        self._status: str | None = None
        self._final: list[Chunk] | None = None
        self._shown: list[_Shown] = [_Shown(i, None) for i in resume_ids or ()]
        self._orphans: list[int] = []  # messages no longer part of the reply: to delete
        self._reported: list[int] = [s.message_id for s in self._shown]
        self._started = bool(self._shown)  # a message of the reply exists (a resumed one has)
        # Drafts: only before any message exists; a resumed reply edits what it showed.
        self._drafting = drafts and not self._shown
        self._on_drafts_refused = on_drafts_refused
        self._draft_base = secrets.randbelow(DRAFT_ID_SPAN) + 1  # new each stream: a resumed turn's draft is new
        self._drafted: tuple[int, Chunk] | None = None  # (part, text) the draft shows now
        self._drafted_at = 0.0  # loop time of the last draft
        self._opened_at = asyncio.get_running_loop().time()  # the turn's start
        self._shows_from: float | None = None  # the end of the first interval (loop time)
        self._changed_at = 0.0  # loop time of the last append/status
        self._network_failures = 0
        self._failure: BaseException | None = None
        self._wake = asyncio.Event()
        self._finished = asyncio.Event()  # the final text came: a draft's wait for the pace ends
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------ ReplyStream

    async def append(self, delta: str) -> None:
        if self._final is not None or not delta:
            return
        self._parts.append(sanitize_text(delta))
        self._changed()

    async def status(self, line: str) -> None:
        if self._final is not None:
            return
        line = " ".join(sanitize_text(line).split())
        if line and not line.startswith(STATUS_MARK):
            line = f"{STATUS_MARK} {line}"
        # What a step wrote before it called tools is not part of the answer.
        self._parts, self._cuts, self._closed = [], [0], []
        self._status = line or None
        self._changed()

    async def finish(self, text: str) -> None:
        await self._deliver(text)

    async def fail(self, text: str) -> None:
        await self._deliver(text)

    # ------------------------------------------------------------ internals

    def _changed(self) -> None:
        if self._failure is not None:
            return
        now = asyncio.get_running_loop().time()
        self._changed_at = now
        if self._shows_from is None and not self._started:
            # A reply complete within the first interval is sent once, finished, when
            # `finish` comes. Edits count it from the first text: their last edit would
            # wait for the pace. A draft reply's message never waits, so only the turn's
            # first interval is held (the first words of a slow model are not).
            start = self._opened_at if self._drafting else now
            self._shows_from = start + self._interval()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._flush_forever(), name="telegram-stream")
            self._tasks.add(self._task)
            self._task.add_done_callback(self._tasks.discard)
        self._wake.set()

    async def _deliver(self, text: str) -> None:
        """Make the visible messages exactly `send()`'s chunks of `text`; raises when they
        could not be shown. Called again (a `fail` after a `finish` that raised), the
        new text replaces the old one."""
        self._final = render_markdown(text)
        self._finished.set()
        if isinstance(self._failure, NetworkError):
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
            raise TimeoutError(f"telegram: the reply was not shown within {FINISH_TIMEOUT_S:.0f} s")
        if task.cancelled():
            raise RuntimeError("telegram: the channel stopped while the reply was shown")
        if self._failure is not None:
            raise self._failure

    def _answer(self) -> str:
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def _view(self) -> list[Chunk]:
        """What the reply's messages should show now, in order."""
        if self._final is not None:
            return self._final
        raw = self._answer()
        if not raw.strip():
            return [Chunk(self._status[: self._limit // 2])] if self._status else []
        while utf16_len(raw[self._cuts[-1]:]) > self._limit:
            cut = _cut(raw, self._cuts[-1], self._limit)
            self._closed.append(_plain(raw[self._cuts[-1]:cut], self._limit))
            self._cuts.append(cut)
        texts = [*self._closed, self._plain_open(raw[self._cuts[-1]:])]
        return [Chunk(text) for text in texts if text]

    def _plain_open(self, markdown: str) -> str:
        """`_plain` of the open message, remembered: the view is computed before and
        after each wait for the chat's pace, often of the same text."""
        if self._open_memo is None or self._open_memo[0] != markdown:
            self._open_memo = (markdown, _plain(markdown, self._limit))
        return self._open_memo[1]

    def _next_call(self) -> tuple[str, int, Chunk | None] | None:
        """The one Bot API call that brings the messages closest to the view, or None."""
        if self._orphans:
            return ("delete", self._orphans[0], None)
        if self._drafting and self._final is None:
            return self._next_draft()
        view = self._view()
        if not view and self._final is None:
            return None  # nothing to show yet: keep what is there (a resumed reply's messages)
        for i, want in enumerate(view):
            if i >= len(self._shown):
                return ("send", i, want)
            if self._shown[i].chunk != want:
                return ("edit", i, want)
        if len(self._shown) > len(view):
            self._orphans += [s.message_id for s in self._shown[len(view):]]
            del self._shown[len(view):]
            return ("delete", self._orphans[0], None)
        return None

    def _next_draft(self) -> tuple[str, int, Chunk | None] | None:
        """The draft to show: the part being written (or the status line), when it changed."""
        view = self._view()
        if not view:
            return None
        part, want = len(view) - 1, view[-1]
        return None if self._drafted == (part, want) else ("draft", part, want)

    def _hold(self) -> float:
        """Seconds left of the first interval, while the reply is not complete."""
        if self._final is not None or self._shows_from is None or self._started or self._drafted:
            return 0.0
        return self._shows_from - asyncio.get_running_loop().time()

    def _idle_wait(self) -> float:
        """How long the flusher waits for more when it has nothing to do: until its idle
        exit, or until a draft is due again (Telegram drops one after 30 s)."""
        now = asyncio.get_running_loop().time()
        wait = self._changed_at + IDLE_EXIT_S - now
        if self._drafting and self._drafted is not None:
            wait = min(wait, self._drafted_at + DRAFT_REFRESH_S - now)
        return max(wait, 0.0)

    def _abandoned(self) -> bool:
        """Nothing came for `IDLE_EXIT_S` (a second's slack: timers may fire a little early)."""
        return asyncio.get_running_loop().time() - self._changed_at >= IDLE_EXIT_S - 1.0

    async def _flush_forever(self) -> None:
        """The stream's one flusher: makes every Bot API call, one at a time, paced."""
        try:
            while True:
                try:
                    self._bot()
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
                        if self._abandoned() or not self._drafting or self._drafted is None:
                            return  # append/status/finish start a new flusher
                        self._drafted = None  # the draft is due again, unchanged
                    continue
                if self._drafting and self._final is not None:
                    # A draft reply's final messages: nothing to pace (no message was
                    # updated), only Telegram's own waits are kept.
                    await self._pace.wait_turn(paced=False)
                    call = self._next_call()
                    if call is not None:
                        await self._make(call)
                else:
                    async with self._pace.lock:
                        # A draft waiting for its slot gives way to the final text at once.
                        if await self._pace.wait_turn(unless=self._finished if self._drafting else None):
                            call = self._next_call()  # what piled up while waiting goes out at once
                            if call is not None:
                                await self._make(call)
                await self._report_ref()
                if self._failure is not None:
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must not leave finish() waiting
            log.exception("telegram: reply stream to %s failed", self._chat)
            self._failure = exc

    async def _make(self, call: tuple[str, int, Chunk | None]) -> None:
        kind, index, chunk = call
        try:
            if kind == "delete":
                await self._delete(index)
            elif kind == "draft":
                assert chunk is not None
                await self._draft(index, chunk)
            elif kind == "send":
                assert chunk is not None
                await self._send(chunk)
            else:
                assert chunk is not None
                await self._edit(index, chunk)
            self._network_failures = 0
            self._pace.after(self._interval())
        except RetryAfter as exc:
            wait = retry_seconds(exc)
            log.info("telegram: flood control on %s; updates pause %.1f s", self._chat, wait)
            self._observe("rate_limited")
            self._pace.block(wait)
            self._pace.after(max(wait, self._interval()))
        except ChatMigrated as exc:
            # A group became a supergroup: the old messages stay behind in the old chat.
            self._chat = exc.new_chat_id
            self._shown, self._orphans = [], []
        except BadRequest as exc:
            if kind == "draft":
                self._drafts_refused(exc)  # nothing was shown: no pause needed
                return
            self._pace.after(self._interval())
            self._refused(kind, index, chunk, exc)
        except NetworkError as exc:
            self._network_failures += 1
            if self._network_failures >= NETWORK_ATTEMPTS:
                log.warning("telegram: reply stream to %s gave up: %s", self._chat, exc)
                self._failure = exc
            else:
                self._pace.block(min(2.0 ** (self._network_failures - 1), 30.0))
        except TelegramError as exc:  # Forbidden, InvalidToken …: nothing more can be shown
            if kind == "draft":
                # Perhaps only drafts (a Bot API server without them): a message decides.
                self._drafts_refused(exc)
                return
            log.warning("telegram: reply stream to %s stopped: %s", self._chat, exc)
            self._failure = exc

    def _drafts_refused(self, exc: TelegramError) -> None:
        log.info("telegram: drafts refused in %s (%s); this reply is shown by edits", self._chat, exc)
        self._drafting = False
        self._drafted = None
        self._observe("update_fallback")
        if self._on_drafts_refused is not None:
            with contextlib.suppress(Exception):
                self._on_drafts_refused()

    def _refused(self, kind: str, index: int, chunk: Chunk | None, exc: BadRequest) -> None:
        if kind == "delete":
            self._orphans.remove(index)  # index is the message id here
            if not _gone(exc):
                log.warning("telegram: message %s of a reply could not be removed: %s", index, exc)
        elif chunk is not None and chunk.entities and is_format_error(exc):
            log.info("telegram: formatting rejected (%s); showing plain text", exc)
            self._observe("plain_fallback")
            assert self._final is not None  # only the final text carries entities
            self._final = [Chunk(c.text) if c == chunk else c for c in self._final]
        elif kind == "edit" and _not_modified(exc):
            self._shown[index].chunk = chunk
        elif kind == "edit":
            # Deleted, too old, or refused for good: go on in new messages from here.
            log.info("telegram: message %s cannot be edited (%s); continuing in a new one",
                     self._shown[index].message_id, exc)
            lost = self._shown[index:]
            del self._shown[index:]
            self._orphans += [s.message_id for s in (lost[1:] if _gone(exc) else lost)]
        else:
            log.warning("telegram: message to %s refused: %s", self._chat, exc)
            self._failure = exc

    def _interval(self) -> float:
        try:
            return max(0.0, float(self._interval_of()))
        except Exception:  # a broken config source must not stop the reply
            return 1.0

    async def _draft(self, part: int, chunk: Chunk) -> None:
        await self._bot().call("sendMessageDraft", {
            "chat_id": self._chat, "draft_id": self._draft_base + part, "text": chunk.text,
            "message_thread_id": self._thread,
        }, timeout=CALL_TIMEOUT_S)
        first = self._drafted_at == 0.0
        self._drafted = (part, chunk)
        self._drafted_at = asyncio.get_running_loop().time()
        self._observe("reply" if first else "draft")

    async def _send(self, chunk: Chunk) -> None:
        first = not self._started
        reply = ({"message_id": self._reply_to, "allow_sending_without_reply": True}
                 if first and self._reply_to is not None else None)
        sent = await self._bot().send_text({
            "chat_id": self._chat, "text": chunk.text, "entities": list(chunk.entities) or None,
            "message_thread_id": self._thread, "reply_parameters": reply,
            "link_preview_options": self._link_preview,
        }, timeout=CALL_TIMEOUT_S)
        self._shown.append(_Shown(sent, chunk))
        self._started = True
        if not first:
            self._observe("continued")
        elif self._drafted_at == 0.0:  # a reply shown by drafts began with its first one
            self._observe("reply")

    async def _edit(self, index: int, chunk: Chunk) -> None:
        await self._bot().call("editMessageText", {
            "chat_id": self._chat, "message_id": self._shown[index].message_id, "text": chunk.text,
            "entities": list(chunk.entities) or None, "link_preview_options": self._link_preview,
        }, timeout=CALL_TIMEOUT_S)
        self._shown[index].chunk = chunk
        self._observe("edit")

    async def _delete(self, message_id: int) -> None:
        await self._bot().call("deleteMessage", {"chat_id": self._chat, "message_id": message_id},
                               timeout=CALL_TIMEOUT_S)
        self._orphans.remove(message_id)

    async def _report_ref(self) -> None:
        ids = [s.message_id for s in self._shown]
        if self._on_ref is None or ids == self._reported or not ids:
            return
        self._reported = ids
        try:
            await asyncio.wait_for(self._on_ref(reply_ref(self._chat, ids)), REF_TIMEOUT_S)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the reply goes on; only crash recovery loses precision
            log.warning("telegram: the stream's message reference was not recorded: %s", exc)

    def _observe(self, event: str) -> None:
        if self._observe_cb is not None:
            with contextlib.suppress(Exception):
                self._observe_cb(event)
