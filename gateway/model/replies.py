"""A model's reply: from a whole chat.completion body, or assembled from a stream's
chunks; anything unusable is an `invalid_response`."""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.model.errors import ModelError, classify_error, error_code, error_detail, parse_retry_after
from gateway.model.transport import RawResponse
from gateway.types import ToolCall


@dataclass(frozen=True, slots=True)
class ModelReply:
    content: str | None
    tool_calls: tuple[ToolCall, ...]  # arguments are the raw JSON text, valid or not
    prompt_tokens: int | None  # usage.prompt_tokens when the provider reports it
    completion_tokens: int | None
    finish_reason: str | None
    model: str | None


def _new_call_id() -> str:
    # Some local servers omit ids; the tool result needs one to pair with.
    return f"call_{uuid.uuid4().hex[:24]}"


def int_or_none(value: object) -> int | None:
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
            raise ModelError(kind, error_detail({"error": error}, ""), provider_limit=limit, code=error_code(error))
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
                      prompt_tokens=int_or_none(usage.get("prompt_tokens")),
                      completion_tokens=int_or_none(usage.get("completion_tokens")),
                      finish_reason=finish if isinstance(finish, str) else None,
                      model=model if isinstance(model, str) else None)


def decoded(raw: RawResponse) -> tuple[str, object]:
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
        raise ModelError(kind, error_detail(body, message), status=raw.status, provider_limit=limit,
                         retry_after=parse_retry_after(raw.headers), code=error_code(body))
    return text, data


def reply_from_response(raw: RawResponse) -> ModelReply:
    """A whole HTTP response of the completions endpoint: a reply, or the ModelError its
    status and body stand for (the same kinds the SDK's exceptions map to)."""
    text, data = decoded(raw)
    if data is None:
        snippet = " ".join(text.split())[:200]
        raise ModelError("invalid_response", f"the response is not JSON: {snippet!r}")
    return reply_from_json(data)


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
            self.prompt_tokens = int_or_none(usage.get("prompt_tokens"))
            self.completion_tokens = int_or_none(usage.get("completion_tokens"))
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
        index, call_id = int_or_none(delta.get("index")), delta.get("id")
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


