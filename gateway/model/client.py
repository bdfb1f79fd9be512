"""The model client: chat completions with retries, streaming and error kinds (SPEC §4.4, §5).

One `ModelClient.complete()` is one decision step's model call. Transient failures
(429, 5xx, timeouts, lost connections) are retried here with exponential backoff that
honours Retry-After; everything else surfaces as a `ModelError` (gateway/model/errors.py)
whose `kind` tells the agent what to do.

Transport: gateway/model/transport.py, straight over aiohttp (the openai SDK's request and
response handling cost more CPU than the rest of a turn, and ~70 µs per streamed chunk).
A plain call is one JSON POST; a streamed one reads Server-Sent Events. Both end in the
same ModelReply / ModelError kinds, with the meanings the SDK's exceptions had.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from gateway.config.schema import ModelConfig
from gateway.model.errors import ModelError, stream_error, transport_error
from gateway.model.replies import ModelReply, StreamAssembly, reply_from_response
from gateway.model.transport import CompletionsEndpoint, RawResponse, SseReader

log = logging.getLogger("gateway.model")

MAX_RETRY_WAIT_S = 60.0  # a longer Retry-After fails now instead of stalling the turn
BACKOFF_BASE_S = 0.5


@dataclass(frozen=True, slots=True)
class CallRecord:
    """One HTTP attempt, for metrics."""

    model: str
    seconds: float
    outcome: str  # "ok" or an ErrorKind
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    status: int | None = None
    attempt: int = 0  # 0 for the first try, 1.. for retries
    stream: bool = False
    detail: str | None = None  # a failure's description (the provider's message), for the admin page


def retry_delay(attempt: int, retry_after: float | None, jitter: float) -> float | None:
    """Wait before retry number `attempt + 1`; None when the provider asks for too long.

    Exponential (0.5 s, 1 s, 2 s, … capped) scaled by 50–100 % so that many sessions hit
    by the same outage do not come back in lockstep."""
    if retry_after is not None:
        return retry_after if retry_after <= MAX_RETRY_WAIT_S else None
    step = min(MAX_RETRY_WAIT_S, BACKOFF_BASE_S * 2 ** attempt)
    return step * (0.5 + jitter / 2)


@dataclass(slots=True)
class _Attempt:
    streamed_text: bool = False  # text already went to on_text: a retry would repeat it


class ModelClient:
    """Calls one configured model. Create one per ModelConfig snapshot; close() it when done."""

    def __init__(self, cfg: ModelConfig, *, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 on_call: Callable[[CallRecord], None] | None = None) -> None:
        self._cfg = cfg
        self._sleep = sleep
        self._on_call = on_call
        self._random = random.Random()
        self._endpoint: CompletionsEndpoint | None = None  # see gateway.model.transport
        self._closed = False
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        # Request shape learned from the provider's 400s (each flips at most once).
        self._stream_usage = True
        self._max_tokens_key = "max_tokens"
        self._send_temperature = True

    @property
    def config(self) -> ModelConfig:
        return self._cfg

    @property
    def configured(self) -> bool:
        """It has a key, or is meant to go without one (an alias on a server of its own)."""
        return self._cfg.key_value() is not None or self._cfg.keyless

    async def warm_up(self) -> None:
        """Open the HTTP pool now (CA certificates load in a worker thread), so the first
        chat does not wait for it. Errors surface on the first real call instead."""
        if self.configured:
            try:
                await (await self._ensure_endpoint()).open()
            except (ModelError, aiohttp.ClientError, OSError) as err:  # e.g. an unreadable CA bundle
                log.debug("model warm-up failed: %s", err)

    async def close(self, grace_s: float = 0) -> None:
        """Close the connections, after letting calls in flight finish for up to grace_s
        (a reload swaps clients under running turns). Calls after this fail at once."""
        self._closed = True
        try:
            if self._in_flight and grace_s > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(grace_s):
                        await self._idle.wait()
        finally:  # also when shutdown cancels the wait: the pool must not outlive the loop
            if self._endpoint is not None:
                endpoint, self._endpoint = self._endpoint, None
                await endpoint.close()

    async def complete(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                       on_text: Callable[[str], Awaitable[None]] | None = None,
                       on_retry: Callable[[], Awaitable[None]] | None = None,
                       max_tokens: int | None = None) -> ModelReply:
        """One model call, retried on transient failures.

        With on_text the reply is streamed and every text delta is passed on as it comes.
        A failure after text was passed on is raised, not retried (the text would come
        twice), unless on_retry is given: it is awaited before such a retry, so the
        caller can take back what the failed attempt showed."""
        if not self.configured:
            raise ModelError("not_configured", "no API key: set model.api_key or OPENAI_API_KEY")
        self._in_flight += 1
        self._idle.clear()
        try:
            return await self._complete(messages, tools, on_text, on_retry, max_tokens)
        finally:
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.set()

    async def _complete(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                        on_text: Callable[[str], Awaitable[None]] | None,
                        on_retry: Callable[[], Awaitable[None]] | None, max_tokens: int | None) -> ModelReply:
        retries = 0
        while True:
            if self._closed:
                raise ModelError("connection", "the model client was replaced by a config change; try again")
            attempt = _Attempt()
            started = time.monotonic()
            try:
                reply = await self._call(messages, tools, on_text, max_tokens, attempt)
            except ModelError as err:
                self._record(started, err.kind, retries, on_text is not None, status=err.status,
                             detail=err.detail)
                repeats = attempt.streamed_text and on_retry is None
                if not repeats and self._adapt(err, streaming=on_text is not None):
                    if attempt.streamed_text and on_retry is not None:
                        await on_retry()
                    continue
                if not err.retryable or retries >= self._cfg.max_retries or repeats:
                    raise
                delay = retry_delay(retries, err.retry_after, self._random.random())
                if delay is None:
                    raise
                got = f"HTTP {err.status}" if err.status else "no HTTP response"  # a connection error has no status
                log.warning("model call failed (%s, %s); retry %d/%d in %.1fs", err.kind,
                            got, retries + 1, self._cfg.max_retries, delay)
                retries += 1
                if attempt.streamed_text and on_retry is not None:
                    await on_retry()  # before the wait: the person sees why nothing moves
                await self._sleep(delay)
                continue
            self._record(started, "ok", retries, on_text is not None,
                         prompt=reply.prompt_tokens, completion=reply.completion_tokens)
            return reply

    # -- one attempt -------------------------------------------------------------------------

    async def _call(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    on_text: Callable[[str], Awaitable[None]] | None, max_tokens: int | None,
                    attempt: _Attempt) -> ModelReply:
        body: dict[str, Any] = {"model": self._cfg.name, "messages": messages,
                                self._max_tokens_key: max_tokens or self._cfg.max_output_tokens}
        if tools:
            body["tools"] = tools
        if self._cfg.temperature is not None and self._send_temperature:
            body["temperature"] = self._cfg.temperature
        if on_text is None:
            endpoint = await self._ensure_endpoint()
            try:
                # The transport's timeouts cover silence; this one covers a slow trickle.
                async with asyncio.timeout(self._cfg.timeout_s):
                    raw = await endpoint.post(body)
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                raise transport_error(exc) from exc
            return reply_from_response(raw)

        body["stream"] = True
        if self._stream_usage:
            body["stream_options"] = {"include_usage": True}
        endpoint = await self._ensure_endpoint()
        try:
            async with endpoint.stream(body) as response:
                if response.status >= 400 or response.content_type == "application/json":
                    # An error, or a provider that ignored `stream`: one whole body.
                    raw = RawResponse(status=response.status, headers=response.headers, body=await response.read())
                    reply = reply_from_response(raw)
                    if reply.content:
                        attempt.streamed_text = True
                        await on_text(reply.content)
                    return reply
                return await self._read_stream(SseReader(response.content), on_text, attempt)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            # The transport's timeouts cover silence (sock_read): a reply may take long to stream.
            raise transport_error(exc) from exc

    async def _read_stream(self, events: SseReader, on_text: Callable[[str], Awaitable[None]],
                           attempt: _Attempt) -> ModelReply:
        assembly = StreamAssembly()
        while True:
            try:
                event, data = await anext(events)
                if data.startswith("[DONE]"):
                    break
                chunk = json.loads(data)
            except StopAsyncIteration:
                break
            except ValueError as exc:  # not JSON, or an event beyond any sane size
                raise ModelError("invalid_response", f"the stream is not valid: {exc}"[:500]) from exc
            if not isinstance(chunk, dict):
                continue
            if chunk.get("error") and event in ("", "error"):
                raise stream_error(chunk["error"])
            if event not in ("", "message"):
                continue  # not a completion chunk
            text = assembly.add(chunk)
            if text:
                attempt.streamed_text = True
                await on_text(text)
        return assembly.reply()

    def _adapt(self, err: ModelError, *, streaming: bool) -> bool:
        """Drop what a provider says it does not support, once; True to resend at once."""
        if err.kind != "bad_request":
            return False
        detail = err.detail.lower()
        if streaming and self._stream_usage and "stream_options" in detail:
            self._stream_usage = False
            log.info("provider rejects stream_options; streaming without usage")
            return True
        if self._max_tokens_key == "max_tokens" and "max_completion_tokens" in detail and (
            "unsupported" in detail or "not supported" in detail
        ):
            self._max_tokens_key = "max_completion_tokens"
            log.info("provider wants max_completion_tokens instead of max_tokens")
            return True
        if self._send_temperature and self._cfg.temperature is not None and "temperature" in detail and (
            "unsupported" in detail or "not support" in detail or "only the default" in detail
        ):
            self._send_temperature = False
            log.info("provider rejects temperature; using its default")
            return True
        return False

    # -- plumbing ------------------------------------------------------------------------------

    async def _ensure_endpoint(self) -> CompletionsEndpoint:
        if self._endpoint is None:
            key = self._cfg.key_value()
            assert key is not None or self._cfg.keyless  # complete() checked `configured`
            try:
                self._endpoint = CompletionsEndpoint(self._cfg.base_url, key, self._cfg.timeout_s)
            except ValueError as exc:
                raise ModelError("connection", f"cannot use model.base_url: {exc}") from exc
        return self._endpoint

    def _record(self, started: float, outcome: str, attempt: int, stream: bool, *,
                status: int | None = None, prompt: int | None = None,
                completion: int | None = None, detail: str | None = None) -> None:
        if self._on_call is None:
            return
        record = CallRecord(model=self._cfg.name, seconds=time.monotonic() - started, outcome=outcome,
                            prompt_tokens=prompt, completion_tokens=completion, status=status,
                            attempt=attempt, stream=stream, detail=detail[:300] if detail else None)
        try:
            self._on_call(record)
        except Exception:  # metrics must never break a turn
            log.exception("on_call hook failed")


