"""Speech to text (SPEC §5.4) through an OpenAI-compatible `/audio/transcriptions` endpoint."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import aiohttp

from gateway.model.client import BACKOFF_BASE_S, retry_delay
from gateway.model.errors import ModelError, redact, transport_error
from gateway.model.replies import decoded
from gateway.model.transport import RawResponse, TranscriptionEndpoint

TRANSCRIPTION_RETRIES = 1  # a 5xx or a lost connection is tried once more; a timeout is not


@dataclass(frozen=True, slots=True)
class TranscriptionSettings:
    """Where and how audio is transcribed: `transcription`, with the model's endpoint and
    key filled in where it gives none (gateway.config.Config.transcription_endpoint)."""

    base_url: str | None
    api_key: str | None
    model: str
    timeout_s: float


def transcript_from_response(raw: RawResponse) -> str:
    """The text of an `/audio/transcriptions` answer, or the ModelError it stands for."""
    try:
        text, data = decoded(raw)
    except ModelError as err:
        if err.kind != "overflow":
            raise
        # An audio file too large for the service: there is no context to trim.
        raise ModelError("bad_request", err.detail, status=err.status, retry_after=err.retry_after,
                         code=err.code) from None
    if isinstance(data, Mapping) and isinstance(data.get("text"), str):
        return data["text"].strip()
    if data is None and text.strip() and raw.headers.get("Content-Type", "").startswith("text/plain"):
        return text.strip()  # response_format "text" answered by a server that ignores ours
    raise ModelError("invalid_response", f"no transcript in the answer: {' '.join(text.split())[:200]!r}")


def transcription_failure(err: ModelError, timeout_s: float) -> str:
    """Why a voice message could not be transcribed, for the person who sent it."""
    match err.kind:
        case "not_configured":
            return ("speech to text has no API key; an admin can set transcription.api_key "
                    "(or model.api_key)")
        case "timeout":
            return f"the speech-to-text service did not answer within {timeout_s:g} seconds"
        case "auth":
            return "the speech-to-text service refused the API key (transcription.api_key)"
        case "rate_limit":
            return "the speech-to-text service is rate-limiting requests; please try again in a minute"
        case "connection":
            return ("the speech-to-text service could not be reached; an admin should check "
                    "transcription.base_url")
        case "server":
            return f"the speech-to-text service had an internal problem (HTTP {err.status})" if err.status else (
                "the speech-to-text service had an internal problem")
        case "invalid_response":
            return "the speech-to-text service sent an answer that could not be understood"
    if err.status in (404, 405):
        return ("the model provider has no speech-to-text endpoint (/audio/transcriptions); an admin can "
                "point transcription.base_url at one, or turn transcription.enabled off")
    reason = redact(err.detail)[:200]
    return f"the speech-to-text service refused the audio (HTTP {err.status}): {reason}" if err.status else (
        f"the speech-to-text service refused the audio: {reason}")


class Transcriber:
    """Transcribes audio through an OpenAI-compatible `/audio/transcriptions` endpoint.
    One pooled endpoint for the current settings; a change of endpoint, key or timeout
    replaces it (and closes the old one). close() when done."""

    def __init__(self, *, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self._sleep = sleep
        self._endpoint: tuple[tuple[str | None, str, float], TranscriptionEndpoint] | None = None
        self._retired: set[asyncio.Task[None]] = set()
        self._closed = False

    async def transcribe(self, settings: TranscriptionSettings, audio: bytes, *, filename: str,
                         mime: str) -> str:
        """The transcript (may be empty: no speech). Raises ModelError."""
        if not settings.api_key:
            raise ModelError("not_configured", "no API key for transcription")
        endpoint = self._endpoint_for(settings)
        retries = 0
        while True:
            try:
                async with asyncio.timeout(settings.timeout_s):
                    raw = await endpoint.post(audio, filename=filename, mime=mime, model=settings.model)
                return transcript_from_response(raw)
            except ModelError as err:
                if err.kind not in ("server", "connection") or retries >= TRANSCRIPTION_RETRIES:
                    raise
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                err = transport_error(exc)
                if err.kind != "connection" or retries >= TRANSCRIPTION_RETRIES:
                    raise err from exc
            retries += 1
            await self._sleep(retry_delay(retries - 1, None, random.random()) or BACKOFF_BASE_S)

    def _endpoint_for(self, settings: TranscriptionSettings) -> TranscriptionEndpoint:
        if self._closed:
            raise ModelError("connection", "the gateway is shutting down")
        assert settings.api_key is not None
        key = (settings.base_url, settings.api_key, settings.timeout_s)
        if self._endpoint is not None and self._endpoint[0] == key:
            return self._endpoint[1]
        try:
            endpoint = TranscriptionEndpoint(settings.base_url, settings.api_key, settings.timeout_s)
        except ValueError as exc:
            raise ModelError("connection", f"cannot use transcription.base_url: {exc}") from exc
        old, self._endpoint = self._endpoint, (key, endpoint)
        if old is not None:  # uploads in flight on it finish (or time out) first
            task = asyncio.get_running_loop().create_task(self._close_later(old[1], settings.timeout_s))
            self._retired.add(task)
            task.add_done_callback(self._retired.discard)
        return endpoint

    @staticmethod
    async def _close_later(endpoint: TranscriptionEndpoint, after_s: float) -> None:
        try:
            await asyncio.sleep(after_s)
        finally:  # also when close() cancels the wait
            await endpoint.close()

    async def close(self) -> None:
        self._closed = True
        for task in list(self._retired):
            task.cancel()
        if self._endpoint is not None:
            endpoint, self._endpoint = self._endpoint[1], None
            await endpoint.close()
        # A retired endpoint closes now instead of when its uploads would have timed out.
        for task in list(self._retired):
            with contextlib.suppress(asyncio.CancelledError):
                await task


