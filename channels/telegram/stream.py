"""A reply streamed into Telegram (SPEC §5.1): by editing messages
(`channels.telegram.streaming: "edit"`, and `"auto"` outside private chats) or as a draft
(`"draft"` and `"auto"` in private chats, the only ones where Telegram shows drafts).

The writer, its pace (one update per `stream_interval_s` per chat) and the reconciling of
shown messages with the reply are `channels.edited`'s; what follows is Telegram's.

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

from telegram.error import (
    BadRequest,
    ChatMigrated,
    NetworkError,
    RetryAfter,
    TelegramError,
)

from channels.base import ReplyRefSink, StreamObserver
from channels.edited import IDLE_EXIT_S, Call, EditedReplyStream, Pace, Paces, Shown, ref_ids
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


ChatPace = Pace  # when the next Bot API call of a stream to one chat may go out


class ChatPaces(Paces):
    """One `ChatPace` per chat, for a channel's streams."""

    def for_chat(self, chat: int | str) -> ChatPace:
        return self.of(chat)


# ---------------------------------------------------------------------------- refs


def reply_ref(chat: int | str, message_ids: list[int]) -> str:
    """The opaque reference a stream reports: the chat and its messages, in order."""
    return json.dumps({"chat_id": chat, "message_ids": message_ids}, separators=(",", ":"))


def parse_reply_ref(ref: str | None, chat: int | str) -> list[int]:
    """The message ids of a reference reported by an earlier stream to the same chat
    (a resumed turn); [] when there is none or it does not fit."""
    ids = ref_ids(ref, key="chat_id", place=chat, platform="telegram", log=log)
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


# ---------------------------------------------------------------------------- the stream


class TelegramReplyStream(EditedReplyStream[Chunk]):
    """One reply as it grows, shown by editing Telegram messages or as a draft
    (implements `ReplyStream`)."""

    platform = "telegram"
    log = log
    network_errors = (NetworkError,)

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
        super().__init__(alive=bot, pace=pace, interval=interval, tasks=tasks, on_ref=on_ref,
                         resume_ids=resume_ids, observe=observe, limit=limit, clean=sanitize_text,
                         render=render_markdown, status_view=Chunk)
        self._bot = bot  # looked up per call: raises once the channel has stopped
        self._chat = chat
        self._thread = thread
        self._reply_to = reply_to  # quoted by the stream's first message only (as send() does)
        self._link_preview = link_preview  # sent with every message and edit (None: Telegram's default)
        self._open_memo: tuple[str, str] | None = None  # the open message's Markdown → its plain text
        # Drafts: only before any message exists; a resumed reply edits what it showed.
        self._drafting = drafts and not self._shown
        self._on_drafts_refused = on_drafts_refused
        self._draft_base = secrets.randbelow(DRAFT_ID_SPAN) + 1  # new each stream: a resumed turn's draft is new
        self._drafted: tuple[int, Chunk] | None = None  # (part, text) the draft shows now
        self._drafted_at = 0.0  # loop time of the last draft
        self._opened_at = asyncio.get_running_loop().time()  # the turn's start
        self._shows_from: float | None = None  # the end of the first interval (loop time)
        self._changed_at = 0.0  # loop time of the last append/status

    # ------------------------------------------------------------ the platform

    def _where(self) -> int | str:
        return self._chat

    def _ref(self, message_ids: list[int]) -> str:
        return reply_ref(self._chat, message_ids)

    def _streamed(self, answer: str) -> list[Chunk]:
        """The answer cut into messages of at most `limit` units, each shown as plain text."""
        while utf16_len(answer[self._cuts[-1]:]) > self._limit:
            cut = _cut(answer, self._cuts[-1], self._limit)
            self._closed.append(Chunk(_plain(answer[self._cuts[-1]:cut], self._limit)))
            self._cuts.append(cut)
        chunks = [*self._closed, Chunk(self._plain_open(answer[self._cuts[-1]:]))]
        return [chunk for chunk in chunks if chunk.text]

    def _plain_open(self, markdown: str) -> str:
        """`_plain` of the open message, remembered: the view is computed before and
        after each wait for the chat's pace, often of the same text."""
        if self._open_memo is None or self._open_memo[0] != markdown:
            self._open_memo = (markdown, _plain(markdown, self._limit))
        return self._open_memo[1]

    # ------------------------------------------------------------ the first interval, drafts

    def _changed(self) -> None:
        if self._failure is None:
            now = asyncio.get_running_loop().time()
            self._changed_at = now
            if self._shows_from is None and not self._started:
                # A reply complete within the first interval is sent once, finished, when
                # `finish` comes. Edits count it from the first text: their last edit would
                # wait for the pace. A draft reply's message never waits, so only the turn's
                # first interval is held (the first words of a slow model are not).
                start = self._opened_at if self._drafting else now
                self._shows_from = start + self._interval()
        super()._changed()

    def _next_call(self) -> Call[Chunk] | None:
        if self._drafting and self._final is None and not self._orphans:
            return self._next_draft()
        return super()._next_call()

    def _next_draft(self) -> Call[Chunk] | None:
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
        """Until the writer's idle exit, or until a draft is due again (Telegram drops one
        after 30 s)."""
        now = asyncio.get_running_loop().time()
        wait = self._changed_at + IDLE_EXIT_S - now
        if self._drafting and self._drafted is not None:
            wait = min(wait, self._drafted_at + DRAFT_REFRESH_S - now)
        return max(wait, 0.0)

    def _idle_timed_out(self) -> bool:
        if self._abandoned() or not self._drafting or self._drafted is None:
            return False  # append/status/finish start a new writer
        self._drafted = None  # the draft is due again, unchanged
        return True

    def _abandoned(self) -> bool:
        """Nothing came for `IDLE_EXIT_S` (a second's slack: timers may fire a little early)."""
        return asyncio.get_running_loop().time() - self._changed_at >= IDLE_EXIT_S - 1.0

    def _gives_way(self) -> asyncio.Event | None:
        # A draft waiting for its slot gives way to the final text at once.
        return self._finished if self._drafting else None

    async def _turn(self) -> None:
        if self._drafting and self._final is not None:
            # A draft reply's final messages: nothing to pace (no message was updated),
            # only Telegram's own waits are kept.
            await self._pace.wait_turn(paced=False)
            await self._make_next()
        else:
            await super()._turn()

    # ------------------------------------------------------------ the calls

    async def _make(self, call: Call[Chunk]) -> None:
        kind, index, chunk = call
        try:
            if kind == "draft":
                assert chunk is not None
                await self._draft(index, chunk)
            else:
                await self._call(call)
            self._made()
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
            self._network_failed(exc)
        except TelegramError as exc:  # Forbidden, InvalidToken …: nothing more can be shown
            if kind == "draft":
                # Perhaps only drafts (a Bot API server without them): a message decides.
                self._drafts_refused(exc)
                return
            self._stopped(exc)

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
            self._not_removed(index, None if _gone(exc) else exc)  # index is the message id here
        elif chunk is not None and chunk.entities and is_format_error(exc):
            log.info("telegram: formatting rejected (%s); showing plain text", exc)
            self._observe("plain_fallback")
            assert self._final is not None  # only the final text carries entities
            self._final = [Chunk(c.text) if c == chunk else c for c in self._final]
        elif kind == "edit" and _not_modified(exc):
            self._shown[index].shows = chunk
        elif kind == "edit":
            self._cannot_edit(index, exc, delete=not _gone(exc))
        else:
            self._send_refused(exc)

    async def _draft(self, part: int, chunk: Chunk) -> None:
        await self._bot().call("sendMessageDraft", {
            "chat_id": self._chat, "draft_id": self._draft_base + part, "text": chunk.text,
            "message_thread_id": self._thread,
        }, timeout=CALL_TIMEOUT_S)
        first = self._drafted_at == 0.0
        self._drafted = (part, chunk)
        self._drafted_at = asyncio.get_running_loop().time()
        self._observe("reply" if first else "draft")

    async def _send(self, want: Chunk) -> None:
        first = not self._started
        reply = ({"message_id": self._reply_to, "allow_sending_without_reply": True}
                 if first and self._reply_to is not None else None)
        sent = await self._bot().send_text({
            "chat_id": self._chat, "text": want.text, "entities": list(want.entities) or None,
            "message_thread_id": self._thread, "reply_parameters": reply,
            "link_preview_options": self._link_preview,
        }, timeout=CALL_TIMEOUT_S)
        self._shown.append(Shown(sent, want))
        self._started = True
        if not first:
            self._observe("continued")
        elif self._drafted_at == 0.0:  # a reply shown by drafts began with its first one
            self._observe("reply")

    async def _edit_message(self, message_id: int, want: Chunk) -> None:
        await self._bot().call("editMessageText", {
            "chat_id": self._chat, "message_id": message_id, "text": want.text,
            "entities": list(want.entities) or None, "link_preview_options": self._link_preview,
        }, timeout=CALL_TIMEOUT_S)

    async def _delete_message(self, message_id: int) -> None:
        await self._bot().call("deleteMessage", {"chat_id": self._chat, "message_id": message_id},
                               timeout=CALL_TIMEOUT_S)
