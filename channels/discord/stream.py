"""A reply streamed into Discord by editing messages (`channels.discord.streaming: "edit"`,
SPEC §5.1).

The writer, its pace (the first message as soon as there is text, then at most one edit
per `stream_interval_s` per channel) and the reconciling of shown messages with the reply
are `channels.edited`'s. Discord's rate limits are kept by discord.py's HTTP client (it
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
import json
import logging
from collections.abc import Callable

import aiohttp
import discord

from channels.base import ReplyRefSink, StreamObserver
from channels.discord.format import DISCORD_TEXT_LIMIT, Fences, clean_text, next_cut, render_markdown, shown
from channels.discord.transport import RATE_LIMITED, DiscordRest, new_nonce
from channels.edited import Call, EditedReplyStream, Pace, Paces, Shown, ref_ids

log = logging.getLogger(__name__)

MAX_RETRY_WAIT_S = 60.0  # longest rate-limit pause honoured in one go
MAX_RATE_LIMIT_PAUSE_S = 5.0  # after discord.py gave up on a bucket that stays exhausted
CALL_TIMEOUT_S = 60.0  # one REST call of a stream, discord.py's own rate-limit waits included

_NETWORK_ERRORS = (discord.DiscordServerError, aiohttp.ClientError, OSError, TimeoutError)


# ---------------------------------------------------------------------------- pacing


ChannelPace = Pace  # when the next REST call of a stream into one channel may go out


class ChannelPaces(Paces):
    """One `ChannelPace` per Discord channel (a thread is a channel of its own)."""

    def for_channel(self, channel_id: int) -> ChannelPace:
        return self.of(channel_id)


# ---------------------------------------------------------------------------- refs


def reply_ref(channel_id: int, message_ids: list[int]) -> str:
    """The opaque reference a stream reports: the channel and its messages, in order."""
    return json.dumps({"channel_id": str(channel_id), "message_ids": [str(i) for i in message_ids]},
                      separators=(",", ":"))


def parse_reply_ref(ref: str | None, channel_id: int) -> list[int]:
    """The message ids an earlier stream of the same turn reported, when it streamed into
    the same channel; [] otherwise."""
    ids = ref_ids(ref, key="channel_id", place=channel_id, platform="discord", log=log)
    return [int(i) for i in ids if isinstance(i, str) and i.isdigit() and 0 < int(i) < 1 << 64]


# ---------------------------------------------------------------------------- the stream


class DiscordReplyStream(EditedReplyStream[str]):
    """One reply as it grows, shown by editing Discord messages (implements `ReplyStream`)."""

    platform = "discord"
    log = log
    network_errors = _NETWORK_ERRORS

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
        super().__init__(alive=rest, pace=pace, interval=interval, tasks=tasks, on_ref=on_ref,
                         resume_ids=resume_ids, observe=observe, limit=limit, clean=clean_text,
                         render=lambda text: render_markdown(text, limit), status_view=str)
        self._rest = rest  # looked up per call: raises once the channel has stopped
        self._channel = channel_id
        self._reply_to = reply_to  # referenced by the stream's first message only (as send() does)
        self._post_nonce: str | None = None  # of a post whose answer was lost: reused by its retry

    # ------------------------------------------------------------ the platform

    def _where(self) -> int:
        return self._channel

    def _ref(self, message_ids: list[int]) -> str:
        return reply_ref(self._channel, message_ids)

    def _streamed(self, answer: str) -> list[str]:
        """The answer as Discord renders it, cut into messages (a cut code block closed
        and reopened)."""
        raw = answer.lstrip()
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

    async def _flush_forever(self) -> None:
        RATE_LIMITED.set(self._rate_limited)  # this task's requests: discord.py's 429 retries are counted
        await super()._flush_forever()

    # ------------------------------------------------------------ the calls

    async def _make(self, call: Call[str]) -> None:
        kind, index, _ = call
        try:
            async with asyncio.timeout(CALL_TIMEOUT_S):
                await self._call(call)
            self._made()
        except discord.RateLimited as exc:  # a wait longer than discord.py takes on itself
            wait = min(max(float(exc.retry_after), 0.0), MAX_RETRY_WAIT_S)
            log.info("discord: rate limited in %s; the reply's calls pause %.1f s", self._channel, wait)
            self._pace.after(max(wait, self._interval()))
        except discord.NotFound as exc:
            self._pace.after(self._interval())
            self._gone(kind, index, exc)
        except discord.Forbidden as exc:
            self._stopped(exc)
        except _NETWORK_ERRORS as exc:
            self._network_failed(exc)
        except discord.HTTPException as exc:
            self._pace.after(self._interval())
            if exc.status == 429:  # still limited after discord.py's own retries
                self._pace.after(MAX_RATE_LIMIT_PAUSE_S)
            elif kind == "edit":
                self._gone(kind, index, exc)  # refused for good: go on in a new message
            elif kind == "delete":
                self._not_removed(index, exc)
            else:
                self._send_refused(exc)

    def _gone(self, kind: str, index: int, exc: Exception) -> None:
        """A message of the reply cannot be changed (deleted by someone, or refused)."""
        if kind == "delete":
            self._not_removed(index, None)  # index is the message id here: already gone
        elif kind == "edit":
            self._cannot_edit(index, exc, delete=False)
        else:
            log.warning("discord: cannot post to %s: %s", self._channel, exc)
            self._failure = exc

    async def _send(self, want: str) -> None:
        first = not self._started
        retried = self._post_nonce is not None
        nonce = self._post_nonce = self._post_nonce or new_nonce()
        message_id = await self._rest().post(self._channel, want, nonce=nonce,
                                             reply_to=self._reply_to if first else None)
        self._post_nonce = None
        # A retried post may have returned the first attempt's message, showing older text.
        self._shown.append(Shown(message_id, None if retried else want))
        self._started = True
        self._observe("reply" if first else "continued")

    async def _edit_message(self, message_id: int, want: str) -> None:
        await self._rest().edit(self._channel, message_id, want)

    async def _delete_message(self, message_id: int) -> None:
        await self._rest().delete(self._channel, message_id)

    def _rate_limited(self) -> None:
        self._observe("rate_limited")
