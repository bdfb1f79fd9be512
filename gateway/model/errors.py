"""What a failed model call is (SPEC §4.4, §5): the error kinds, the person's message for
each, and the pure classifier that recognizes context overflow in every provider's wording
(so the agent can recover) and never mistakes another 400 for one; and when the provider
says to try again."""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC
from email.utils import parsedate_to_datetime
from typing import Literal, get_args

import aiohttp

ErrorKind = Literal["overflow", "rate_limit", "timeout", "server", "connection", "auth",
                    "bad_request", "invalid_response", "not_configured"]

RETRYABLE_KINDS: frozenset[str] = frozenset({"rate_limit", "timeout", "server", "connection"})

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
    r"(sk-[A-Za-z0-9_\-*]{6,}|(?:Bearer|Basic)\s+\S+"
    r"|(?:api[_ -]?key|token|secret|password|passwd)[\"']?\s*[:=]\s*[\"']?[^\s\"',}]+)",
    re.IGNORECASE,
)


def redact(text: str) -> str:
    """Provider texts (and MCP servers' errors) sometimes echo (part of) a key; never show
    anything shaped like one: `sk-…`, a bearer or basic credential, `api_key=…`, `token: …`."""
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
# When to try again


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


# ----------------------------------------------------------------------------------------
# Failures without a usable response


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


def error_detail(body: object, message: str) -> str:
    if isinstance(body, Mapping):
        inner = body.get("error", body)
        if isinstance(inner, Mapping) and isinstance(inner.get("message"), str):
            return inner["message"]
        if isinstance(inner, str):
            return inner
    if isinstance(body, str) and body.strip():
        return body.strip()[:500]
    return message


def error_code(body: object) -> str | None:
    if isinstance(body, Mapping):
        inner = body.get("error", body)
        if isinstance(inner, Mapping):
            for key in ("code", "type"):
                if isinstance(inner.get(key), str):
                    return inner[key]
    return None


def transport_error(exc: BaseException) -> ModelError:
    """What an exception from the aiohttp endpoint means (no HTTP response arrived)."""
    if _refused(exc):
        return ModelError("connection", str(exc) or type(exc).__name__)
    if isinstance(exc, TimeoutError):  # aiohttp's read and connect timeouts are TimeoutErrors
        return ModelError("timeout", "the request timed out")
    return ModelError("connection", f"{type(exc).__name__}: {exc}"[:500])


def stream_error(error: object) -> ModelError:
    """An error event inside a stream (OpenRouter and others send one mid-answer): no
    HTTP status, so its body alone says what it is."""
    message = error.get("message") if isinstance(error, Mapping) else None
    message = message if isinstance(message, str) and message else "An error occurred during streaming"
    kind, limit = classify_error(None, error, message)
    return ModelError(kind, error_detail(error, message), provider_limit=limit, code=error_code(error))


def iter_error_kinds() -> Iterator[str]:
    """Every ErrorKind, e.g. to pre-register metric labels."""
    yield from get_args(ErrorKind)
