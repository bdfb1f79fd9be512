"""The model client: chat completions with retries, streaming and error kinds (SPEC §4.4, §5).

One `ModelClient.complete()` is one decision step's model call. Transient failures
(429, 5xx, timeouts, lost connections) are retried here with exponential backoff that
honours Retry-After; everything else surfaces as a `ModelError` whose `kind` tells the
agent what to do. `classify_error()` is the pure part: it recognizes context overflow in
every provider's wording (so the agent can recover, §4.4) and never mistakes another 400
for one.

Transport: `gateway.model_http`, straight over aiohttp (the openai SDK's request and
response handling cost more CPU than the rest of a turn, and ~70 µs per streamed chunk).
A plain call is one JSON POST; a streamed one reads Server-Sent Events. Both end in the
same ModelReply / ModelError kinds, with the meanings the SDK's exceptions had.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import random
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC
from email.utils import parsedate_to_datetime
from typing import Any, Literal, get_args

import aiohttp

from gateway.config import ModelConfig
from gateway.model_http import CompletionsEndpoint, RawResponse, SseReader, TranscriptionEndpoint
from gateway.types import ToolCall

log = logging.getLogger(__name__)

ErrorKind = Literal["overflow", "rate_limit", "timeout", "server", "connection", "auth",
                    "bad_request", "invalid_response", "not_configured"]

RETRYABLE_KINDS: frozenset[str] = frozenset({"rate_limit", "timeout", "server", "connection"})
MAX_RETRY_WAIT_S = 60.0  # a longer Retry-After fails now instead of stalling the turn
BACKOFF_BASE_S = 0.5


@dataclass(frozen=True, slots=True)
class ModelReply:
    content: str | None
    tool_calls: tuple[ToolCall, ...]  # arguments are the raw JSON text, valid or not
    prompt_tokens: int | None  # usage.prompt_tokens when the provider reports it
    completion_tokens: int | None
    finish_reason: str | None
    model: str | None


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


# ----------------------------------------------------------------------------------------
# Errors


class ModelError(Exception):
    """A model call that did not produce a reply. `detail` is the provider's text (logs)."""

    def __init__(self, kind: ErrorKind, detail: str = "", *, status: int | None = None,
                 provider_limit: int | None = None, retry_after: float | None = None,
                 code: str | None = None) -> None:
        shown = redact(detail)  # str(err) goes to logs
        super().__init__(f"{kind} (HTTP {status}): {shown}" if status else f"{kind}: {shown}")
        self.kind: ErrorKind = kind
        self.status = status
        self.provider_limit = provider_limit
        self.retry_after = retry_after
        self.detail = detail
        self.code = code  # the provider's error code or type, when it sent one

    @property
    def quota_exhausted(self) -> bool:
        """A 429 that waiting will not fix (billing, monthly quota)."""
        # Only OpenAI's code is unambiguous: Gemini says "quota" for per-minute limits too.
        return self.kind == "rate_limit" and "insufficient_quota" in f"{self.code} {self.detail}".lower()

    @property
    def retryable(self) -> bool:
        return self.kind in RETRYABLE_KINDS and not self.quota_exhausted

    def user_message(self) -> str:
        """What the person in the chat is told: no stack trace, no secrets."""
        http = f" (HTTP {self.status})" if self.status else ""
        match self.kind:
            case "not_configured":
                return ("The assistant has no model API key configured yet. An admin needs to set "
                        "`model.api_key` in config.json, or the OPENAI_API_KEY environment variable "
                        "(servers that need no key, like a local Ollama, accept any placeholder).")
            case "overflow":
                return ("This conversation no longer fits into the model's context window. "
                        "Send /new to start fresh, or /compact to summarize it.")
            case "rate_limit" if self.quota_exhausted:
                return ("The model provider's quota or billing limit is used up. An admin needs to "
                        "check the provider account.")
            case "rate_limit":
                wait = (f" in about {math.ceil(self.retry_after)} seconds"
                        if self.retry_after else " in a minute")
                return f"The model provider is rate-limiting requests right now. Please try again{wait}."
            case "timeout":
                return "The model took too long to answer. Please try again."
            case "server":
                return f"The model provider had an internal problem{http}. Please try again shortly."
            case "connection":
                return ("The model provider could not be reached. Please try again shortly; if it "
                        "keeps happening, an admin should check `model.base_url` and the network.")
            case "auth":
                return (f"The model provider refused the API key{http}. An admin needs to check "
                        "`model.api_key` (or the OPENAI_API_KEY environment variable).")
            case "invalid_response":
                return ("The model provider sent an answer that could not be understood. Please try "
                        "again; if it keeps happening, an admin should check `model.base_url`.")
        if _OUTPUT_LIMIT.search(self.detail):
            return ("The model rejected the configured answer length. An admin should lower "
                    "`model.max_output_tokens`.")
        reason = redact(self.detail)[:200]
        return f"The model provider rejected the request{http}: {reason}" if reason else (
            f"The model provider rejected the request{http}.")


_SECRET_SHAPES = re.compile(
    r"(sk-[A-Za-z0-9_\-*]{6,}|Bearer\s+\S+|(?:api[_-]?key|token)[\"']?\s*[:=]\s*[\"']?[^\s\"',}]+)",
    re.IGNORECASE,
)


def redact(text: str) -> str:
    """Provider texts sometimes echo (part of) the key; never show it."""
    return _SECRET_SHAPES.sub("***", text)


# ----------------------------------------------------------------------------------------
# The classifier (pure)

# Texts of one body are joined by newlines and `.` stops there: no match spans two fields.
_FLAGS = re.IGNORECASE
_N = r"(\d[\d,]*)"  # a token count, commas allowed

# Input + output over the window. Overflow, unless the requested output alone is
# already over the window: then no trim helps and it is an output-limit error.
_SUM_PATTERNS: tuple[tuple[re.Pattern[str], int, int], ...] = (  # (pattern, output group, limit group)
    # OpenAI (older models), DeepSeek, vLLM: "...(1000 in the messages, 4000 in the completion)"
    (re.compile(rf"maximum context length is {_N} tokens.*?{_N} in the messages, {_N} in the completion",
                _FLAGS), 3, 1),
    # vLLM ≥ 0.8: "'max_tokens' or 'max_completion_tokens' is too large: 4000. This model's
    # maximum context length is 4096 tokens and your request has 1000 input tokens"
    (re.compile(rf"max_completion_tokens'? is too large: {_N}.*?maximum context length is {_N}", _FLAGS),
     1, 2),
    # Anthropic: "input length and `max_tokens` exceed context limit: 197202 + 21333 > 200000"
    (re.compile(rf"exceed context limit: {_N} \+ {_N} > {_N}", _FLAGS), 2, 3),
    # Text Generation Inference: "`inputs` tokens + `max_new_tokens` must be <= 4096. Given: ..."
    (re.compile(rf"max_new_tokens`? must be <= {_N}\. given: {_N} `?inputs`? tokens and {_N}", _FLAGS),
     3, 1),
)

# The answer-length parameter is out of range: a config problem, not overflow.
_OUTPUT_LIMIT = re.compile(
    r"\b(?:max_tokens|max_completion_tokens|max_new_tokens|max_output_tokens|maxoutputtokens)\b"
    r".{0,80}?(?:too large|must be (?:less|smaller|at most|<=)|should be|valid range|range of|"
    r"maximum allowed number of output tokens|>\s*\d)"
    r"|supports at most \d[\d,]* completion tokens"
    r"|range of max_tokens",
    _FLAGS,
)

# Overflow wordings; the first group, when present, is the provider's context limit.
_OVERFLOW_PATTERNS: tuple[re.Pattern[str], ...] = tuple(re.compile(p, _FLAGS) for p in (
    rf"maximum context length is {_N}",  # OpenAI, DeepSeek, vLLM, OpenRouter, Groq
    r"prompt (?:is )?too long",  # Anthropic, Ollama ("prompt too long; exceeded max context …")
    rf"range of input length should be \[\d+, ?{_N}\]",  # Qwen / DashScope
    rf"input length should be \[\d+, ?{_N}\]",
    rf"input token count \(\d+\) exceeds the maximum number of tokens allowed \({_N}\)",  # Gemini
    rf"exceeds the available context size(?: \({_N} tokens\))?",  # llama.cpp
    r"exceeded max context length by \d+ tokens",  # Ollama
    r"input length exceeds the (?:maximum |model'?s? )?(?:context )?length",  # Ollama, Qwen
    rf"too large for model with {_N} maximum context length",  # Mistral
    rf"maximum prompt length is {_N}",  # xAI
    rf"longer than the model'?s context length \({_N} tokens\)",  # Together
    rf"exceeded model token limit: {_N}",  # Moonshot / Kimi
    r"(?:input|request|prompt|messages?)\b.{0,40}exceeds? the (?:model'?s )?context (?:window|limit|length)",
    r"context[_ ]length[_ ]exceeded|context[_ ]window[_ ]exceeded",
    r"maximum context length",  # the same wordings without a number
    r"input is too long for (?:the )?requested model",  # AWS Bedrock
    rf"`?inputs`? must have less than {_N} tokens",  # Text Generation Inference
    r"invalidparameter\b.{0,80}\binput\b.{0,30}\b(?:length|tokens?)\b.{0,40}(?:exceed|too long|should be)",
    r"超(?:过|出).{0,12}上下文",  # Chinese providers: "…超过模型最大上下文长度"
))
# llama.cpp's limit is reported twice: in the text and as `n_ctx`.
_PROMPT_TOO_LONG_LIMIT = re.compile(rf"prompt is too long: {_N} tokens > {_N}", _FLAGS)
# A request larger than the per-minute token limit (OpenAI 429, Groq 413): waiting never helps,
# a smaller request does.
_TOO_LARGE_FOR_RATE = re.compile(rf"request too large for .*?limit {_N}, requested {_N}", _FLAGS)

_OVERFLOW_CODES = frozenset({"context_length_exceeded", "model_context_window_exceeded",
                             "exceed_context_size_error", "context_window_exceeded"})


@dataclass(slots=True)
class _Facts:
    """What an error body says, whatever its shape (dict, list, nested JSON text)."""

    text: str = ""
    codes: set[str] = field(default_factory=set)
    numeric_code: int | None = None
    n_ctx: int | None = None


def _facts(body: object, message: str) -> _Facts:
    facts = _Facts()
    texts: list[str] = [" ".join(message.split())] if message else []

    def walk(value: object, key: str, depth: int) -> None:
        if depth > 6:
            return
        if isinstance(value, Mapping):
            for k, v in value.items():
                walk(v, str(k).lower(), depth + 1)
        elif isinstance(value, list | tuple):
            for v in value:
                walk(v, key, depth + 1)
        elif isinstance(value, bool):
            return
        elif isinstance(value, int):
            if key == "code" and 100 <= value <= 599 and facts.numeric_code is None:
                facts.numeric_code = value
            elif key == "n_ctx":
                facts.n_ctx = value
        elif isinstance(value, str):
            if value[:1] in "{[" and len(value) < 100_000:  # JSON inside text (OpenRouter's raw)
                try:
                    walk(json.loads(value), key, depth + 1)
                    return
                except ValueError:
                    pass
            texts.append(" ".join(value.split()))
            if key in {"code", "type", "status", "error"} and len(value) <= 80:
                facts.codes.add(value.strip().lower())

    walk(body, "", 0)
    facts.text = "\n".join(texts)
    return facts


def _count(text: str) -> int:
    return int(text.replace(",", ""))


def _context_verdict(facts: _Facts) -> tuple[Literal["overflow", "output_limit"] | None, int | None]:
    text = facts.text
    for pattern, output_group, limit_group in _SUM_PATTERNS:
        found = pattern.search(text)
        if found:
            output, limit = _count(found.group(output_group)), _count(found.group(limit_group))
            return ("output_limit", None) if output >= limit else ("overflow", limit)
    if _OUTPUT_LIMIT.search(text):
        return "output_limit", None
    too_large = _TOO_LARGE_FOR_RATE.search(text)
    if too_large and _count(too_large.group(2)) > _count(too_large.group(1)):
        return "overflow", _count(too_large.group(1))
    prompt_too_long = _PROMPT_TOO_LONG_LIMIT.search(text)
    if prompt_too_long:
        return "overflow", _count(prompt_too_long.group(2))
    for pattern in _OVERFLOW_PATTERNS:
        found = pattern.search(text)
        if found:
            limit = next((_count(g) for g in found.groups() if g), None)
            return "overflow", limit if limit is not None else facts.n_ctx
    if facts.codes & _OVERFLOW_CODES:
        return "overflow", facts.n_ctx
    return None, None


def classify_error(status: int | None, body: object, message: str = "") -> tuple[ErrorKind, int | None]:
    """The kind of a provider error, and the context limit it reported (when parseable).

    `body` is the error body in any shape the providers use (OpenAI's `{"error": {...}}`
    or its inner object, Gemini's list, plain text, HTML); `message` any extra text."""
    facts = _facts(body, message)
    if status is None:
        status = facts.numeric_code
    verdict, limit = _context_verdict(facts)
    if verdict == "overflow":
        return "overflow", limit
    if status == 413:
        return "overflow", None
    if verdict == "output_limit":
        return "bad_request", None
    if status in (401, 403):
        return "auth", None
    if status == 408:
        return "timeout", None
    if status == 429:
        return "rate_limit", None
    if status is None or status >= 500 or status == 409:  # 409: lock contention, transient
        return "server", None
    return "bad_request", None


# ----------------------------------------------------------------------------------------
# Retry timing


def parse_retry_after(headers: Mapping[str, str] | None, now: float | None = None) -> float | None:
    """Seconds to wait from `retry-after-ms`, or `retry-after` in seconds or as an HTTP date."""
    if not headers:
        return None
    lowered = {str(k).lower(): str(v) for k, v in headers.items()}
    millis = _finite(lowered.get("retry-after-ms"))
    if millis is not None:
        return max(0.0, millis / 1000)
    value = lowered.get("retry-after")
    if value is None:
        return None
    seconds = _finite(value)
    if seconds is not None:
        return max(0.0, seconds)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    current = time.time() if now is None else now
    return max(0.0, when.timestamp() - current)


def _finite(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        number = float(value.strip())
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def retry_delay(attempt: int, retry_after: float | None, jitter: float) -> float | None:
    """Wait before retry number `attempt + 1`; None when the provider asks for too long.

    Exponential (0.5 s, 1 s, 2 s, … capped) scaled by 50–100 % so that many sessions hit
    by the same outage do not come back in lockstep."""
    if retry_after is not None:
        return retry_after if retry_after <= MAX_RETRY_WAIT_S else None
    step = min(MAX_RETRY_WAIT_S, BACKOFF_BASE_S * 2 ** attempt)
    return step * (0.5 + jitter / 2)


# ----------------------------------------------------------------------------------------
# Turning responses (direct or from the SDK) into ModelReply


def _refused(exc: BaseException) -> bool:
    """A connection that could not be made, whatever the transport labelled it (the aiohttp
    transport reports a refused connection as a connect *timeout*)."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return False
        if isinstance(seen, aiohttp.ClientConnectorError | ConnectionRefusedError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _detail(body: object, message: str) -> str:
    if isinstance(body, Mapping):
        inner = body.get("error", body)
        if isinstance(inner, Mapping) and isinstance(inner.get("message"), str):
            return inner["message"]
        if isinstance(inner, str):
            return inner
    if isinstance(body, str) and body.strip():
        return body.strip()[:500]
    return message


def _code(body: object) -> str | None:
    if isinstance(body, Mapping):
        inner = body.get("error", body)
        if isinstance(inner, Mapping):
            for key in ("code", "type"):
                if isinstance(inner.get(key), str):
                    return inner[key]
    return None


def _new_call_id() -> str:
    # Some local servers omit ids; the tool result needs one to pair with.
    return f"call_{uuid.uuid4().hex[:24]}"


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def reply_from_json(data: object) -> ModelReply:
    """Validate a non-streamed chat.completion body (parsed JSON); anything unusable is an
    invalid_response."""
    if not isinstance(data, Mapping):
        snippet = " ".join(str(data).split())[:200]
        raise ModelError("invalid_response", f"not a chat.completion body: {snippet!r}")
    choices = data.get("choices")
    if not choices or not isinstance(choices, list):
        error = data.get("error")
        if error:  # some gateways answer errors with HTTP 200
            kind, limit = classify_error(None, error)
            raise ModelError(kind, _detail({"error": error}, ""), provider_limit=limit, code=_code(error))
        raise ModelError("invalid_response", "the response has no choices")
    choice = choices[0]
    message = choice.get("message") if isinstance(choice, Mapping) else None
    if not isinstance(message, Mapping):
        raise ModelError("invalid_response", "the response's choice has no message")
    calls = []
    raw_calls = message.get("tool_calls") or []
    if not isinstance(raw_calls, list):
        raise ModelError("invalid_response", "the message's tool_calls is not a list")
    for call in raw_calls:
        function = call.get("function") if isinstance(call, Mapping) else None
        name = function.get("name") if isinstance(function, Mapping) else None
        if not name or not isinstance(name, str):
            raise ModelError("invalid_response", "a tool call has no function name")
        arguments = function.get("arguments")  # type: ignore[union-attr]
        call_id = call.get("id")
        calls.append(ToolCall(id=call_id if isinstance(call_id, str) and call_id else _new_call_id(),
                              name=name, arguments=arguments if isinstance(arguments, str) else ""))
    content = message.get("content")
    usage = data.get("usage")
    usage = usage if isinstance(usage, Mapping) else {}
    finish, model = choice.get("finish_reason"), data.get("model")
    return ModelReply(content=(content or None) if isinstance(content, str) else None, tool_calls=tuple(calls),
                      prompt_tokens=_int_or_none(usage.get("prompt_tokens")),
                      completion_tokens=_int_or_none(usage.get("completion_tokens")),
                      finish_reason=finish if isinstance(finish, str) else None,
                      model=model if isinstance(model, str) else None)


def _decoded(raw: RawResponse) -> tuple[str, object]:
    """A response's text and JSON (None when it is not JSON); raises the ModelError an
    error status and its body stand for."""
    text = raw.body.decode("utf-8", errors="replace")
    try:
        data: object = json.loads(text)
    except ValueError:
        data = None
    if raw.status >= 400:
        body: object = data if data is not None else text.strip()[:2000]
        if isinstance(body, Mapping) and isinstance(body.get("error"), Mapping):
            body = body["error"]  # the inner object, as the SDK hands it over
        message = f"HTTP {raw.status}: {' '.join(text.split())[:500]}"
        kind, limit = classify_error(raw.status, body, message)
        raise ModelError(kind, _detail(body, message), status=raw.status, provider_limit=limit,
                         retry_after=parse_retry_after(raw.headers), code=_code(body))
    return text, data


def reply_from_response(raw: RawResponse) -> ModelReply:
    """A whole HTTP response of the completions endpoint: a reply, or the ModelError its
    status and body stand for (the same kinds the SDK's exceptions map to)."""
    text, data = _decoded(raw)
    if data is None:
        snippet = " ".join(text.split())[:200]
        raise ModelError("invalid_response", f"the response is not JSON: {snippet!r}")
    return reply_from_json(data)


def _transport_error(exc: BaseException) -> ModelError:
    """What an exception from the aiohttp endpoint means (no HTTP response arrived)."""
    if _refused(exc):
        return ModelError("connection", str(exc) or type(exc).__name__)
    if isinstance(exc, TimeoutError):  # aiohttp's read and connect timeouts are TimeoutErrors
        return ModelError("timeout", "the request timed out")
    return ModelError("connection", f"{type(exc).__name__}: {exc}"[:500])


def _stream_error(error: object) -> ModelError:
    """An error event inside a stream (OpenRouter and others send one mid-answer): no
    HTTP status, so its body alone says what it is."""
    message = error.get("message") if isinstance(error, Mapping) else None
    message = message if isinstance(message, str) and message else "An error occurred during streaming"
    kind, limit = classify_error(None, error, message)
    return ModelError(kind, _detail(error, message), provider_limit=limit, code=_code(error))


@dataclass(slots=True)
class _PartialCall:
    id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)


@dataclass(slots=True)
class StreamAssembly:
    """Accumulates streamed chunks into the same ModelReply a plain response gives."""

    text: list[str] = field(default_factory=list)
    calls: list[_PartialCall] = field(default_factory=list)
    by_index: dict[int, _PartialCall] = field(default_factory=dict)
    finish_reason: str | None = None
    model: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    saw_choice: bool = False

    def add(self, chunk: Mapping[str, Any]) -> str:
        """Take one chunk (a parsed `chat.completion.chunk`); returns the text it adds
        (possibly ""). Fields of the wrong shape are skipped, as the SDK did. Plain dict
        checks: this runs for every chunk, and ABC isinstance checks cost more than the rest."""
        model = chunk.get("model")
        if isinstance(model, str) and model:
            self.model = model
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.prompt_tokens = _int_or_none(usage.get("prompt_tokens"))
            self.completion_tokens = _int_or_none(usage.get("completion_tokens"))
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            return ""
        added = []
        for choice in choices:
            if not isinstance(choice, dict) or choice.get("index", 0) not in (0, None):
                continue  # we ask for one choice
            self.saw_choice = True
            delta = choice.get("delta")
            if isinstance(delta, dict):
                content = delta.get("content")  # reasoning_content and the like are not the answer
                if isinstance(content, str) and content:
                    added.append(content)
                calls = delta.get("tool_calls")
                for call in calls if isinstance(calls, list) else ():
                    if isinstance(call, dict):
                        self._merge(call)
            finish = choice.get("finish_reason")
            if isinstance(finish, str) and finish:
                self.finish_reason = finish
        text = "".join(added)
        if text:
            self.text.append(text)
        return text

    def _merge(self, delta: Mapping[str, Any]) -> None:
        index, call_id = _int_or_none(delta.get("index")), delta.get("id")
        call_id = call_id if isinstance(call_id, str) else None
        function = delta.get("function")
        function = function if isinstance(function, dict) else {}
        slot: _PartialCall | None
        if index is not None:
            slot = self.by_index.get(index)
        elif call_id:
            slot = next((c for c in self.calls if c.id == call_id), None)
        else:
            slot = self.calls[-1] if self.calls else None
        if slot is not None and call_id and slot.id and call_id != slot.id:
            slot = None  # some providers number every parallel call 0: a new id is a new call
        if slot is None:
            slot = _PartialCall()
            self.calls.append(slot)
            if index is not None:
                self.by_index[index] = slot
        if call_id:
            slot.id = call_id
        name = function.get("name")
        if isinstance(name, str) and name and name != slot.name:
            slot.name = name if not slot.name else slot.name + name
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            slot.arguments.append(arguments)

    def reply(self) -> ModelReply:
        if not self.saw_choice:
            raise ModelError("invalid_response", "the stream ended without any choice")
        calls = []
        for call in self.calls:
            if not call.name:
                raise ModelError("invalid_response", "a streamed tool call has no function name")
            calls.append(ToolCall(id=call.id or _new_call_id(), name=call.name,
                                  arguments="".join(call.arguments)))
        return ModelReply(content="".join(self.text) or None, tool_calls=tuple(calls),
                          prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                          finish_reason=self.finish_reason, model=self.model)


# ----------------------------------------------------------------------------------------
# The client


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
        self._endpoint: CompletionsEndpoint | None = None  # see gateway.model_http
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
        return self._cfg.key_value() is not None

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
                self._record(started, err.kind, retries, on_text is not None, status=err.status)
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
                raise _transport_error(exc) from exc
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
            raise _transport_error(exc) from exc

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
                raise _stream_error(chunk["error"])
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
            assert key is not None  # complete() checked `configured`
            try:
                self._endpoint = CompletionsEndpoint(self._cfg.base_url, key, self._cfg.timeout_s)
            except ValueError as exc:
                raise ModelError("connection", f"cannot use model.base_url: {exc}") from exc
        return self._endpoint

    def _record(self, started: float, outcome: str, attempt: int, stream: bool, *,
                status: int | None = None, prompt: int | None = None,
                completion: int | None = None) -> None:
        if self._on_call is None:
            return
        record = CallRecord(model=self._cfg.name, seconds=time.monotonic() - started, outcome=outcome,
                            prompt_tokens=prompt, completion_tokens=completion, status=status,
                            attempt=attempt, stream=stream)
        try:
            self._on_call(record)
        except Exception:  # metrics must never break a turn
            log.exception("on_call hook failed")


# ----------------------------------------------------------------------------------------
# Speech to text (SPEC §5.4)

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
        text, data = _decoded(raw)
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
                err = _transport_error(exc)
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


def iter_error_kinds() -> Iterator[str]:
    """Every ErrorKind, e.g. to pre-register metric labels."""
    yield from get_args(ErrorKind)
