"""A Slack reply shown as it grows (SPEC §5.1), behind `SlackChannel.stream()`.

`native` (in a thread): the reply is a Slack stream: `chat.startStream` with the first
text, `chat.appendStream` with what came since (at most once per interval),
`chat.stopStream` at the end. The Markdown goes to Slack as `markdown_text`, which Slack
renders itself, so the final messages hold the reply's own Markdown, split where send()
would split it. A stream only grows: when what is shown cannot grow into what must be
shown (a status line replaces earlier text, a message is cut at the size limit), the
stream is stopped and the message edited with `chat.update` instead. A status line
before any text goes to `assistant.threads.setStatus` (best effort; the hourglass
reaction shows work where Slack refuses it), so no message ever shows a line that is not
part of the reply. Where Slack refuses `chat.startStream` (older workspaces, token types,
missing recipient, …), this reply falls back to `update`.

`update` (top level, DMs without a thread, or configured): `chat.postMessage` with the
first text, then `chat.update` at most once per interval, rendered exactly as send()
renders; long replies continue in new messages; at the end the messages equal what
send() would have posted (messages no longer needed are deleted).

Nothing is posted in the first interval (counted from the first text or status): a reply
complete by then is posted once, finished, at once, instead of posted and then updated
an interval later (SPEC §5.1: streaming never makes a short answer arrive later).

One flusher task per stream makes every platform call; append/status only record and
wake it, so the agent never waits on Slack. A 429 pauses the flusher for Retry-After and
what arrived meanwhile goes out in the next pass: nothing is dropped, and a refused call
changed nothing, so nothing is sent twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
from slack_sdk.errors import SlackApiError
from slack_sdk.web.async_client import AsyncWebClient
from slack_sdk.web.async_slack_response import AsyncSlackResponse

from channels.base import ReplyRefSink, StreamObserver
from channels.slack.format import clean_text, ends_in_code_block, escape_mrkdwn, split_message, to_mrkdwn

log = logging.getLogger("channels.slack")

Format = Literal["markdown", "mrkdwn"]  # native messages hold Markdown, update ones mrkdwn
Sleep = Callable[[float], Awaitable[None]]
Spawn = Callable[[Coroutine[Any, Any, None], str], "asyncio.Future[None]"]

CALL_TIMEOUT_S = 20.0  # one Web API call (the client's own HTTP timeout is shorter)
FINISH_TIMEOUT_S = 300.0  # finish/fail: the last pass, rate-limit pauses included
IDLE_WAIT_S = 30.0
MAX_FAILURES = 8  # refused or lost calls (429s not counted) before the stream gives up
MAX_RETRY_AFTER_S = 60.0
STATUS_MAX_CHARS = 200
RENDER_IN_THREAD_CHARS = 8000  # mrkdwn conversion of long texts runs off the event loop

# Nothing posted can ever get through: the reply is not deliverable by any means.
_FATAL = frozenset({
    "channel_not_found", "not_in_channel", "is_archived", "invalid_auth", "not_authed",
    "token_revoked", "account_inactive", "missing_scope", "restricted_action",
})


@dataclass
class _Message:
    ts: str
    shown: str | None  # None: not known (shown before a restart, or a call that got lost)
    streaming: bool  # an open native stream: it can only grow until stopped


class _RateLimited(Exception):
    def __init__(self, delay: float) -> None:
        super().__init__(delay)
        self.delay = delay


class _Redo(Exception):
    """The messages changed under the pass (fallback, lost call): render and pass again."""


class _Broken(Exception):
    """The reply cannot be shown any more."""


class _Lost(Exception):
    """A call whose outcome is unknown (timeout, connection error)."""


class SlackReplyStream:
    """One streamed reply; implements channels.base.ReplyStream."""

    def __init__(
        self,
        client: AsyncWebClient,
        *,
        channel: str,
        thread_ts: str | None,
        native: bool,
        recipient: dict[str, str],
        interval_s: float,
        sleep: Sleep,
        spawn: Spawn,
        name: str,
        observe: StreamObserver | None = None,
        on_ref: ReplyRefSink | None = None,
        resume_ref: str | None = None,
        unfurl: dict[str, bool] | None = None,
    ) -> None:
        self._client = client
        self._unfurl = unfurl or {"unfurl_links": False, "unfurl_media": False}  # with each chat.postMessage
        self._channel = channel
        self._thread_ts = thread_ts
        self._native = native and thread_ts is not None  # Slack streams only in threads
        self._format: Format = "markdown" if self._native else "mrkdwn"
        self._recipient = recipient  # recipient_team_id / _user_id: required in channels
        self._interval = max(interval_s, 0.0)
        self._sleep = sleep
        self._spawn = spawn
        self._name = name
        self._observe = observe
        self._on_ref = on_ref
        self._messages: list[_Message] = []
        self._reported: list[str] = []
        self._text = ""
        self._status: str | None = None
        self._final: str | None = None
        self._thread_status = ""  # what assistant.threads.setStatus shows now
        self._status_api = True
        self._wake = asyncio.Event()
        self._task: asyncio.Future[None] | None = None
        self._last_pass = -math.inf
        # The first interval: nothing is posted before the first text (or status) is one
        # interval old, so a reply complete by then is posted once, finished, at once
        # (its last update would otherwise wait for the pace).
        self._shows_from: float | None = None
        self._ended = asyncio.Event()
        self._failures = 0
        self._error: BaseException | None = None
        if resume_ref:
            self._resume(resume_ref)

    # -- what the agent calls: record and wake the flusher, never wait on Slack

    async def append(self, delta: str) -> None:
        if not delta or self._final is not None:
            return
        self._text += delta
        self._status = None
        self._kick()

    async def status(self, line: str) -> None:
        if self._final is not None:
            return
        self._status = " ".join(clean_text(line).split())[:STATUS_MAX_CHARS] or "working…"
        self._text = ""  # what came before the tools ran is not part of the answer
        self._kick()

    async def finish(self, text: str) -> None:
        await self._end(text)

    async def fail(self, text: str) -> None:
        await self._end(text)

    async def _end(self, text: str) -> None:
        if self._final is None:
            self._final = clean_text(text)
        self._ended.set()
        self._kick()
        task = self._task
        assert task is not None
        try:
            async with asyncio.timeout(FINISH_TIMEOUT_S):
                await asyncio.shield(task)  # the flusher owns the last pass, even if we go
        except TimeoutError:
            task.cancel()
            raise RuntimeError("slack: streamed reply not shown in time") from None
        except asyncio.CancelledError:
            if not task.cancelled():
                raise  # we are cancelled ourselves
            raise RuntimeError("slack: channel stopped before the reply was shown") from None
        if self._error is not None:
            raise RuntimeError(f"slack: streamed reply not delivered: {describe(self._error)}") from self._error

    def _kick(self) -> None:
        if self._shows_from is None and not self._messages:
            self._shows_from = asyncio.get_running_loop().time() + self._interval
        self._wake.set()
        if self._task is None:
            self._task = self._spawn(self._run(), self._name)

    # -- the flusher

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        me = asyncio.current_task()
        while True:
            if me is not None and me.cancelling():
                # A cancel some library swallowed (a call that finished as it came): honour it.
                raise asyncio.CancelledError
            if self._final is None and not self._wake.is_set():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(IDLE_WAIT_S):
                        await self._wake.wait()
                continue
            hold = self._hold(loop.time())
            if hold > 0:  # the first interval: the end of the reply (or of the interval) wakes us
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(hold):
                        await self._ended.wait()
                continue
            pause = self._last_pass + self._interval - loop.time()
            if pause > 0:
                await asyncio.sleep(pause)  # what arrives meanwhile joins this pass
            self._wake.clear()
            final = self._final is not None
            try:
                await self._pass(final)
            except _RateLimited as limited:
                self._note("rate_limited")
                log.info("slack: rate limited while streaming; pausing %.1fs", limited.delay)
                await self._sleep(limited.delay)
                self._last_pass = -math.inf
                self._wake.set()
                continue
            except _Redo:
                self._last_pass = -math.inf
                self._wake.set()
                continue
            except _Broken:
                if self._error is None:
                    self._error = RuntimeError("Slack answered without a message to edit")
                return
            except Exception as err:  # a bug must not leave finish() waiting
                log.exception("slack: streamed reply failed")
                self._error = err
                return
            if final:
                return
            # Counted from the end of a pass: no message is touched twice within an interval.
            self._last_pass = loop.time()

    def _hold(self, now: float) -> float:
        """Seconds left of the first interval, while nothing is posted and the reply is
        not complete."""
        if self._final is not None or self._messages or self._shows_from is None:
            return 0.0
        return self._shows_from - now

    async def _pass(self, final: bool) -> None:
        """One reconciliation: make Slack show what the reply is now (or finally)."""
        status = None if final else self._status
        if status is not None and self._format == "markdown" and not self._messages:
            await self._show_thread_status(status)
            return
        if status is not None:
            wanted = [escape_mrkdwn(status) if self._format == "mrkdwn" else status]
        else:
            wanted = await self._render(self._final if final else self._text, final)
        if final and not wanted and self._thread_status:
            await self._show_thread_status("")
        for i, want in enumerate(wanted):
            complete = final or i < len(wanted) - 1
            if i < len(self._messages):
                await self._sync(self._messages[i], want, complete)
            else:
                await self._create(i, want, complete)
        while len(self._messages) > len(wanted):
            await self._remove(self._messages[-1])

    async def _render(self, text: str | None, final: bool) -> list[str]:
        if not text:
            return []
        if self._format == "mrkdwn":
            def render() -> list[str]:
                return split_message(to_mrkdwn(text))  # exactly what send() posts
        else:
            def render() -> list[str]:
                chunks = split_message(clean_text(text))
                if not final and len(chunks) > 1 and ends_in_code_block(text):
                    # The fence split_message closes the last chunk with would be followed
                    # by more code: a stream could not take it back. It comes at the end.
                    chunks[-1] = chunks[-1].removesuffix("\n```")
                return chunks
        if len(text) > RENDER_IN_THREAD_CHARS:
            return await asyncio.to_thread(render)
        return render()

    # -- one message

    async def _sync(self, msg: _Message, want: str, complete: bool) -> None:
        if msg.streaming:
            if msg.shown is not None and want.startswith(msg.shown):
                delta = want[len(msg.shown):]
                if complete:
                    await self._stream_call("chat_stopStream", msg, delta)
                    msg.streaming = False
                elif delta:
                    await self._stream_call("chat_appendStream", msg, delta)
                msg.shown = want
                return
            await self._stop(msg)  # a stream cannot take text back: end it, then edit
        if msg.shown != want:
            await self._update(msg, want)

    async def _stream_call(self, method: str, msg: _Message, delta: str) -> None:
        params: dict[str, Any] = {"channel": self._channel, "ts": msg.ts}
        if delta:
            params["markdown_text"] = delta
        try:
            await self._api(method, **params)
        except SlackApiError as err:
            # Expired, or refused: the message is edited from now on (nothing was added).
            self._failed(err)
            if error_code(err) != "message_not_in_streaming_state":
                await self._stop(msg)
            msg.streaming = False
            raise _Redo from None
        except _Lost as lost:
            self._failed(lost)
            await self._stop(msg)
            msg.streaming = False
            msg.shown = None  # the text may or may not have been added: edit it whole
            raise _Redo from None
        if delta:
            self._note("edit")

    async def _stop(self, msg: _Message) -> None:
        try:
            await self._api("chat_stopStream", channel=self._channel, ts=msg.ts)
        except SlackApiError as err:
            if error_code(err) != "message_not_in_streaming_state":
                log.info("slack: chat.stopStream: %s", error_code(err))
        except _Lost as lost:
            log.info("slack: chat.stopStream: %s", lost)
        msg.streaming = False

    async def _update(self, msg: _Message, want: str) -> None:
        params: dict[str, Any] = {"channel": self._channel, "ts": msg.ts}
        params["markdown_text" if self._format == "markdown" else "text"] = want
        try:
            await self._api("chat_update", **params)
        except SlackApiError as err:
            # Cannot edit this one any more (deleted, edit window, …): the rest goes to new messages.
            self._failed(err)
            log.info("slack: chat.update refused (%s); continuing in a new message", error_code(err))
            await self._remove(msg)
            raise _Redo from None
        except _Lost as lost:
            self._failed(lost)
            msg.shown = None
            raise _Redo from None
        msg.shown = want
        self._note("edit")

    async def _create(self, index: int, want: str, complete: bool) -> None:
        if self._format == "markdown" and self._native:
            ts = await self._start_stream(want)
            msg = _Message(ts, want, streaming=True)
        else:
            params: dict[str, Any] = {"channel": self._channel, **self._unfurl}
            if self._thread_ts:
                params["thread_ts"] = self._thread_ts
            params["markdown_text" if self._format == "markdown" else "text"] = want
            try:
                resp = await self._api("chat_postMessage", **params)
            except SlackApiError as err:
                if error_code(err) in _FATAL:
                    self._error = err
                    raise _Broken from None
                self._failed(err)
                raise _Redo from None
            except _Lost as lost:
                # Posting again may show it twice, but not posting may show nothing.
                self._failed(lost)
                raise _Redo from None
            msg = _Message(_ts_of(resp), want, streaming=False)
        self._messages.append(msg)
        self._thread_status = ""  # Slack clears a thread's status when the app replies
        self._note("reply" if index == 0 else "continued")
        await self._report_ref()
        if complete and msg.streaming:
            await self._sync(msg, want, complete)

    async def _start_stream(self, want: str) -> str:
        assert self._thread_ts is not None
        try:
            resp = await self._api(
                "chat_startStream", channel=self._channel, thread_ts=self._thread_ts, markdown_text=want,
                **self._recipient,
            )
        except (SlackApiError, _Lost) as err:
            # Not available here (old workspace, token type, recipient, …): edits instead.
            code = error_code(err) if isinstance(err, SlackApiError) else str(err)
            log.info("slack: chat.startStream refused (%s); using chat.update for this reply", code)
            self._native = False
            if not self._messages:
                self._format = "mrkdwn"  # nothing shown yet: exactly as send() would show it
            self._note("update_fallback")
            if isinstance(err, _Lost):
                self._failed(err)
            raise _Redo from None
        return _ts_of(resp)

    async def _remove(self, msg: _Message) -> None:
        with contextlib.suppress(ValueError):
            self._messages.remove(msg)
        try:
            if msg.streaming:
                await self._stop(msg)
            await self._api("chat_delete", channel=self._channel, ts=msg.ts)
        except (SlackApiError, _Lost, _RateLimited) as err:
            log.info("slack: could not delete a message of a streamed reply: %s", describe(err))
        await self._report_ref()

    async def _show_thread_status(self, status: str) -> None:
        if not self._status_api or status == self._thread_status or self._thread_ts is None:
            return
        try:
            await self._api(
                "assistant_threads_setStatus", channel_id=self._channel, thread_ts=self._thread_ts, status=status
            )
        except (SlackApiError, _Lost) as err:
            # Not an assistant thread (or no such API here): the typing reaction shows work.
            log.debug("slack: assistant.threads.setStatus: %s", describe(err))
            self._status_api = False
            return
        self._thread_status = status

    # -- plumbing

    async def _api(self, method: str, **params: Any) -> AsyncSlackResponse:
        call = getattr(self._client, method)
        try:
            async with asyncio.timeout(CALL_TIMEOUT_S):  # unlike wait_for, never eats a cancel
                return await call(**params)
        except SlackApiError as err:
            if err.response.status_code == 429 or error_code(err) == "ratelimited":
                raise _RateLimited(retry_after(err.response.headers)) from None
            raise
        except (TimeoutError, aiohttp.ClientError) as err:
            raise _Lost(f"{method}: {type(err).__name__}") from None

    def _failed(self, err: BaseException) -> None:
        self._failures += 1
        log.info("slack: streamed reply: %s", describe(err))
        if self._failures > MAX_FAILURES:
            self._error = err
            raise _Broken from None

    async def _report_ref(self) -> None:
        ts_list = [m.ts for m in self._messages]
        if self._on_ref is None or ts_list == self._reported:
            return
        self._reported = ts_list
        ref = json.dumps({
            "channel": self._channel, "thread_ts": self._thread_ts, "ts": ts_list,
            "mode": "native" if self._format == "markdown" else "update",
        })
        try:
            async with asyncio.timeout(CALL_TIMEOUT_S):
                await self._on_ref(ref)
        except Exception:  # the reply goes on; only a crash-resume would miss it
            log.warning("slack: could not record the streamed reply's messages", exc_info=True)

    def _resume(self, ref: str) -> None:
        """Take over the messages a stream of this turn showed before a restart."""
        try:
            data = json.loads(ref)
        except ValueError:
            log.warning("slack: ignored an unreadable reply ref")
            return
        if not isinstance(data, dict) or data.get("channel") != self._channel:
            return
        ts_list = data.get("ts")
        if not isinstance(ts_list, list) or not all(isinstance(t, str) and t for t in ts_list):
            return
        native = data.get("mode") == "native"
        self._format = "markdown" if native else "mrkdwn"
        self._native = self._native and native
        # A native one may still be an open stream: stopped before it is edited.
        self._messages = [_Message(ts, None, streaming=native) for ts in ts_list]
        self._reported = list(ts_list)

    def _note(self, event: str) -> None:
        if self._observe is not None:
            try:
                self._observe(event)
            except Exception:
                log.debug("slack: stream observer failed", exc_info=True)


def _ts_of(resp: AsyncSlackResponse) -> str:
    ts = resp.get("ts")
    if not isinstance(ts, str) or not ts:
        raise _Broken  # Slack said ok without a message: nothing we could ever edit
    return ts


def retry_after(headers: Any) -> float:
    """Seconds to wait from a 429's Retry-After (1 when missing or odd), capped."""
    value = None
    if headers is not None:
        with contextlib.suppress(Exception):
            value = headers.get("Retry-After") or headers.get("retry-after")
    try:
        delay = float(value) if value is not None else 1.0
    except (TypeError, ValueError):
        delay = 1.0
    return min(max(delay, 0.0), MAX_RETRY_AFTER_S)


def error_code(err: SlackApiError) -> str:
    with contextlib.suppress(Exception):
        code = err.response.get("error")
        if isinstance(code, str):
            return code
    return "unknown"


def describe(err: BaseException) -> str:
    if isinstance(err, SlackApiError):
        return f"Slack error {error_code(err)}"
    return f"{type(err).__name__}: {err}"[:300]
