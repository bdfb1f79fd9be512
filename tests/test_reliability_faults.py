"""Reliability: every way the model server can fail ends the turn with a reply or a clear
error text (never a stack trace), and the session stays usable and well formed."""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from gateway.app import Gateway
from gateway.types import Message, ToolCall
from tests.conftest import GatewayFactory, chat
from tests.fakes.openai_server import ErrorReply, FakeModel, RawReply

NO_WAIT = {"Retry-After": "0"}  # retries without backoff: the test stays fast
ROLES = {"user", "assistant", "tool"}


def session_problems(messages: list[Message]) -> list[str]:
    """What is wrong with a stored session: invalid roles, tool calls without exactly one
    result each, results without a call, stack traces in content, text that is not valid
    UTF-8. Empty when the session is well formed."""
    problems: list[str] = []
    open_calls: dict[str, int] = {}
    for i, m in enumerate(messages):
        where = f"message {i} (turn {m.turn}, {m.role})"
        if m.role not in ROLES:
            problems.append(f"{where}: invalid role")
        try:
            m.content.encode("utf-8")
        except UnicodeEncodeError:
            problems.append(f"{where}: content is not valid UTF-8")
        if "Traceback (most recent call last)" in m.content:
            problems.append(f"{where}: a stack trace in the content")
        if m.role == "tool":
            if m.tool_call_id not in open_calls:
                problems.append(f"{where}: result {m.tool_call_id!r} answers no open tool call")
            else:
                del open_calls[m.tool_call_id]
            continue
        if open_calls:
            problems.append(f"{where}: tool calls {sorted(open_calls)} before it have no results")
        open_calls = {}
        if m.role == "assistant":
            ids = [c.id for c in m.tool_calls]
            if len(set(ids)) != len(ids):
                problems.append(f"{where}: duplicate tool call ids")
            open_calls = dict.fromkeys(ids, m.turn)
    if open_calls:
        problems.append(f"the last tool calls {sorted(open_calls)} have no results")
    return problems


def assert_clear_text(reply: str) -> None:
    assert reply.strip(), "empty reply"
    for trace_mark in ("Traceback", 'File "', "Exception:", "Error:"):
        assert trace_mark not in reply, f"internal error text in the reply: {reply!r}"


def overflow_error(limit: int = 8192) -> ErrorReply:
    return ErrorReply(400, {"error": {
        "message": (f"This model's maximum context length is {limit} tokens. However, your messages "
                    f"resulted in {limit + 2000} tokens. Please reduce the length of the messages."),
        "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded",
    }})


def overflow_turn_calls(times: int) -> Callable[[dict[str, Any]], ErrorReply | None]:
    """Overflow the first `times` decision steps (requests with tools); summaries (no
    tools) and later steps get the default echo. Scripted replies would race: the overflow
    summary and the retried step are sent concurrently."""
    left = [times]

    def respond(body: dict[str, Any]) -> ErrorReply | None:
        if body.get("tools") and left[0] > 0:
            left[0] -= 1
            return overflow_error()
        return None

    return respond


@dataclass(frozen=True)
class Fault:
    name: str
    script: Callable[[FakeModel], None]
    expect: str  # a substring of the reply (case-insensitive)
    model: dict[str, Any] | None = None  # model settings overrides


def _times(n: int, action: Callable[[FakeModel], None]) -> Callable[[FakeModel], None]:
    def script(fake: FakeModel) -> None:
        for _ in range(n):
            action(fake)
    return script


RATE_LIMIT = {"error": {"message": "Rate limit reached for requests", "type": "requests",
                        "code": "rate_limit_exceeded"}}
SERVER_ERROR = {"error": {"message": "The server had an error while processing your request.",
                          "type": "server_error", "code": None}}
TRUNCATED = '{"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "fake-model", "choi'
NO_CHOICES = '{"id": "chatcmpl-2", "object": "chat.completion", "created": 1, "model": "fake-model", "choices": []}'
NAMELESS_CALL = (
    '{"id": "chatcmpl-3", "object": "chat.completion", "created": 1, "model": "fake-model", "choices": '
    '[{"index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant", "content": null, '
    '"tool_calls": [{"id": "call_x", "type": "function", "function": {"name": "", "arguments": "{}"}}]}}]}'
)

FAULTS = [
    Fault("429 with Retry-After, then an answer",
          lambda f: f.error(429, RATE_LIMIT, headers=NO_WAIT), "echo: question"),
    Fault("429 on every retry", _times(3, lambda f: f.error(429, RATE_LIMIT, headers=NO_WAIT)), "rate-limiting"),
    Fault("500, then an answer", lambda f: f.error(500, SERVER_ERROR, headers=NO_WAIT), "echo: question"),
    Fault("500 on every retry", _times(3, lambda f: f.error(500, SERVER_ERROR, headers=NO_WAIT)),
          "internal problem"),
    Fault("an HTML 502 from a proxy",
          _times(3, lambda f: f.error(502, "<html><body>502 Bad Gateway</body></html>", headers=NO_WAIT)),
          "internal problem"),
    Fault("a timeout, then an answer", lambda f: f.hang(5), "echo: question",
          {"timeout_s": 0.3, "max_retries": 1}),
    Fault("a timeout on every retry", _times(2, lambda f: f.hang(5)), "too long",
          {"timeout_s": 0.3, "max_retries": 1}),
    Fault("truncated JSON", lambda f: f.script(RawReply(200, TRUNCATED)), "could not be understood"),
    Fault("empty choices", lambda f: f.script(RawReply(200, NO_CHOICES)), "could not be understood"),
    Fault("a tool call without a name", lambda f: f.script(RawReply(200, NAMELESS_CALL)),
          "could not be understood"),
    Fault("an unknown tool and bad JSON arguments",
          lambda f: f.tool_calls([("no_such_tool", {}), ("read_file", "{not json")]), "echo: question"),
    Fault("a tool call, then a 500 in the next step",
          lambda f: (f.tool_call("current_time", {}),
                     _times(3, lambda g: g.error(500, SERVER_ERROR, headers=NO_WAIT))(f)),
          "internal problem"),
    Fault("a context overflow", lambda f: f.respond_with(overflow_turn_calls(1)), "echo: question"),
    Fault("a second overflow", lambda f: f.respond_with(overflow_turn_calls(2)), "cleared the live context"),
]


async def _stored(gw: Gateway, key: str) -> list[Message]:
    assert gw.services is not None
    return await gw.services.store.messages(key)


@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
async def test_model_fault_gives_a_clear_reply_and_the_session_stays_usable(
    make_gateway: GatewayFactory, fake_model: FakeModel, fault: Fault
) -> None:
    gw = await make_gateway(model=fake_model.model_settings(**{"max_retries": 2, "timeout_s": 10,
                                                               **(fault.model or {})}))
    assert await chat(gw, "pat", "hello") == "echo: hello"  # an earlier turn to keep
    fault.script(fake_model)

    reply = await chat(gw, "pat", "question")
    assert fault.expect.lower() in reply.lower(), reply
    assert_clear_text(reply)

    fake_model.clear()
    fake_model.respond_with(None)
    assert await chat(gw, "pat", "next") == "echo: next"  # the session still works
    assert gw.services is not None
    await gw.services.background.wait_idle(5)
    stored = await _stored(gw, "web:pat")
    assert session_problems(stored) == []
    assert [m.content for m in stored if m.role == "user"] == ["hello", "question", "next"]
    assert fake_model.violations == []  # every request the gateway sent was well formed


async def test_model_server_down_gives_a_clear_reply(make_gateway: GatewayFactory, fake_model: FakeModel) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    gw = await make_gateway(model=fake_model.model_settings(base_url=f"http://127.0.0.1:{port}/v1", max_retries=0))
    reply = await chat(gw, "quinn", "anyone there?")
    assert "could not be reached" in reply
    assert_clear_text(reply)
    assert session_problems(await _stored(gw, "web:quinn")) == []


def test_the_session_check_sees_broken_sessions() -> None:
    call = ToolCall(id="c1", name="current_time", arguments="{}")
    good = [Message("user", "hi", 1), Message("assistant", "", 1, tool_calls=(call,)),
            Message("tool", "12:00", 1, tool_call_id="c1"), Message("assistant", "noon", 1)]
    assert session_problems(good) == []
    assert session_problems(good[:2] + good[3:])  # a call without its result
    assert session_problems([good[0], good[2]])  # a result without its call
    assert session_problems([Message("system", "x", 1)])  # type: ignore[arg-type]
    assert session_problems([Message("user", "bad \ud800", 1)])
    assert session_problems([Message("assistant", "Traceback (most recent call last):\n ...", 1)])
