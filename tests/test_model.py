"""The model client against the fake OpenAI-compatible server, with the real `openai` SDK."""

from __future__ import annotations

import asyncio
import gc
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp import web
from pydantic import SecretStr

from gateway.config.schema import ModelConfig
from gateway.model.client import CallRecord, ModelClient, retry_delay
from gateway.model.errors import ModelError, classify_error, parse_retry_after
from gateway.model.replies import StreamAssembly
from tests.fakes.openai_server import FakeModel, fake_model  # noqa: F401  (the fixture)

ERRORS = Path(__file__).parent / "data" / "provider_errors"
USER = [{"role": "user", "content": "Hello there"}]


class Recorder:
    """Collects what the client reports: backoff waits and per-attempt call records."""

    def __init__(self) -> None:
        self.waits: list[float] = []
        self.calls: list[CallRecord] = []

    async def sleep(self, seconds: float) -> None:
        self.waits.append(seconds)

    @property
    def outcomes(self) -> list[str]:
        return [c.outcome for c in self.calls]


def make_client(fake: FakeModel, rec: Recorder | None = None, **cfg: Any) -> ModelClient:
    rec = rec or Recorder()
    settings = {"name": "fake-model", "base_url": fake.base_url, "api_key": SecretStr("test-key"),
                "timeout_s": 5, "max_retries": 2, **cfg}
    return ModelClient(ModelConfig(**settings), sleep=rec.sleep, on_call=rec.calls.append)


@pytest.fixture
async def rec() -> Recorder:
    return Recorder()


@pytest.fixture
async def client(fake_model: FakeModel, rec: Recorder) -> Any:  # noqa: F811
    model_client = make_client(fake_model, rec)
    yield model_client
    await model_client.close()


class Deltas:
    def __init__(self) -> None:
        self.parts: list[str] = []

    async def __call__(self, text: str) -> None:
        self.parts.append(text)


# ----------------------------------------------------------------------------------------
# Replies


async def test_plain_reply_with_usage(fake_model: FakeModel, client: ModelClient, rec: Recorder) -> None:  # noqa: F811
    fake_model.reply("Hi! How can I help?", usage=(12, 6))

    reply = await client.complete(USER)

    assert reply.content == "Hi! How can I help?"
    assert reply.tool_calls == ()
    assert (reply.prompt_tokens, reply.completion_tokens) == (12, 6)
    assert reply.finish_reason == "stop"
    assert reply.model == "fake-model"
    [sent] = await fake_model.wait_requests(1)
    assert sent["model"] == "fake-model"
    assert sent["messages"] == USER
    assert sent["max_tokens"] == 4096
    assert "stream" not in sent and "tools" not in sent
    assert fake_model.request_headers[0]["Authorization"] == "Bearer test-key"
    assert rec.outcomes == ["ok"]
    assert rec.calls[0].prompt_tokens == 12 and rec.calls[0].completion_tokens == 6


async def test_usage_is_estimated_when_not_scripted(fake_model: FakeModel, client: ModelClient) -> None:  # noqa: F811
    reply = await client.complete([{"role": "user", "content": "x" * 400}])

    assert reply.content == "echo: " + "x" * 400
    assert reply.prompt_tokens is not None and reply.prompt_tokens >= 100
    assert reply.completion_tokens is not None and reply.completion_tokens > 0


async def test_tools_and_max_tokens_are_sent(fake_model: FakeModel, client: ModelClient) -> None:  # noqa: F811
    tools = [{"type": "function", "function": {"name": "current_time", "parameters": {
        "type": "object", "properties": {}}}}]

    await client.complete(USER, tools=tools, max_tokens=100)

    [sent] = fake_model.requests
    assert sent["tools"] == tools
    assert sent["max_tokens"] == 100


async def test_streaming_reply_passes_deltas_as_they_come(
    fake_model: FakeModel, client: ModelClient, rec: Recorder,  # noqa: F811
) -> None:
    fake_model.reply("Streaming works in several small pieces.", usage=(30, 8))
    deltas = Deltas()

    reply = await client.complete(USER, on_text=deltas)

    assert len(deltas.parts) > 3
    assert "".join(deltas.parts) == reply.content == "Streaming works in several small pieces."
    assert (reply.prompt_tokens, reply.completion_tokens) == (30, 8)
    assert reply.finish_reason == "stop"
    [sent] = fake_model.requests
    assert sent["stream"] is True
    assert sent["stream_options"] == {"include_usage": True}
    assert rec.calls[0].stream is True


async def test_streamed_tool_call_is_assembled(fake_model: FakeModel, client: ModelClient) -> None:  # noqa: F811
    fake_model.tool_call("read_file", {"path": "notes/todo.md", "start_line": 40}, call_id="call_42")
    deltas = Deltas()

    reply = await client.complete(USER, on_text=deltas)

    assert deltas.parts == []
    assert reply.content is None
    assert reply.finish_reason == "tool_calls"
    [call] = reply.tool_calls
    assert (call.id, call.name) == ("call_42", "read_file")
    assert json.loads(call.arguments) == {"path": "notes/todo.md", "start_line": 40}


@pytest.mark.parametrize("streaming", [False, True], ids=["plain", "stream"])
async def test_parallel_tool_calls(fake_model: FakeModel, client: ModelClient, streaming: bool) -> None:  # noqa: F811
    fake_model.tool_calls([("current_time", {}), ("memory_search", {"query": "budget"})],
                          text="Let me check two things.")

    reply = await client.complete(USER, on_text=Deltas() if streaming else None)

    assert reply.content == "Let me check two things."
    assert [c.name for c in reply.tool_calls] == ["current_time", "memory_search"]
    assert [json.loads(c.arguments) for c in reply.tool_calls] == [{}, {"query": "budget"}]
    assert len({c.id for c in reply.tool_calls}) == 2


@pytest.mark.parametrize("streaming", [False, True], ids=["plain", "stream"])
async def test_invalid_tool_arguments_are_returned_as_is(
    fake_model: FakeModel, client: ModelClient, streaming: bool,  # noqa: F811
) -> None:
    fake_model.tool_call("read_file", '{"path": "a.md", ')

    reply = await client.complete(USER, on_text=Deltas() if streaming else None)

    assert reply.tool_calls[0].arguments == '{"path": "a.md", '


def test_stream_assembly_handles_providers_that_number_every_call_zero() -> None:
    assembly = StreamAssembly()
    for delta in (
        {"tool_calls": [{"index": 0, "id": "a", "function": {"name": "current_time", "arguments": "{}"}}]},
        {"tool_calls": [{"index": 0, "id": "b", "function": {"name": "read_file", "arguments": '{"pa'}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": 'th": "x"}'}}]},
    ):
        assembly.add({
            "id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": None}],
        })

    reply = assembly.reply()

    assert [(c.id, c.name, c.arguments) for c in reply.tool_calls] == [
        ("a", "current_time", "{}"), ("b", "read_file", '{"path": "x"}'),
    ]


# ----------------------------------------------------------------------------------------
# Retries


RATE_LIMITED = {"error": {"message": "Rate limit reached for requests", "type": "requests",
                          "param": None, "code": "rate_limit_exceeded"}}


@pytest.mark.parametrize(("headers", "expected"), [
    ({"Retry-After": "7"}, 7.0),
    ({"retry-after-ms": "1500", "Retry-After": "2"}, 1.5),
])
async def test_rate_limit_honours_retry_after(
    fake_model: FakeModel, client: ModelClient, rec: Recorder,  # noqa: F811
    headers: dict[str, str], expected: float,
) -> None:
    fake_model.error(429, RATE_LIMITED, headers=headers)
    fake_model.reply("made it")

    reply = await client.complete(USER)

    assert reply.content == "made it"
    assert rec.waits == [expected]
    assert rec.outcomes == ["rate_limit", "ok"]
    assert [c.attempt for c in rec.calls] == [0, 1]
    assert len(fake_model.requests) == 2


async def test_retry_after_beyond_the_cap_fails_at_once(
    fake_model: FakeModel, client: ModelClient, rec: Recorder,  # noqa: F811
) -> None:
    fake_model.error(429, RATE_LIMITED, headers={"Retry-After": "3600"})

    with pytest.raises(ModelError) as caught:
        await client.complete(USER)

    assert caught.value.kind == "rate_limit"
    assert caught.value.retry_after == 3600
    assert rec.waits == []
    assert "3600 seconds" in caught.value.user_message()


async def test_server_error_then_success(fake_model: FakeModel, client: ModelClient, rec: Recorder) -> None:  # noqa: F811
    fake_model.error(500, json.loads((ERRORS / "openai_server_error.json").read_text()))
    fake_model.error(502, (ERRORS / "http_502_bad_gateway.html").read_text())
    fake_model.reply("recovered")

    reply = await client.complete(USER)

    assert reply.content == "recovered"
    assert rec.outcomes == ["server", "server", "ok"]
    first, second = rec.waits
    assert 0.25 <= first <= 0.5 and 0.5 <= second <= 1.0  # exponential, jittered


async def test_timeout_after_retries(fake_model: FakeModel, rec: Recorder) -> None:  # noqa: F811
    client = make_client(fake_model, rec, timeout_s=0.2, max_retries=2)
    for _ in range(3):
        fake_model.hang(10)

    with pytest.raises(ModelError) as caught:
        await client.complete(USER)
    await client.close()

    assert caught.value.kind == "timeout"
    assert rec.outcomes == ["timeout"] * 3
    assert len(rec.waits) == 2
    assert len(fake_model.requests) == 3
    assert "too long" in caught.value.user_message()


async def test_stream_that_never_starts_times_out(fake_model: FakeModel, rec: Recorder) -> None:  # noqa: F811
    client = make_client(fake_model, rec, timeout_s=0.2, max_retries=0)
    fake_model.hang(10)

    with pytest.raises(ModelError) as caught:
        await client.complete(USER, on_text=Deltas())
    await client.close()

    assert caught.value.kind == "timeout"
    assert rec.outcomes == ["timeout"]


async def test_unreachable_provider_is_a_connection_error(fake_model: FakeModel, rec: Recorder) -> None:  # noqa: F811
    client = make_client(fake_model, rec, max_retries=1)
    await fake_model.stop()  # nothing listens on that port any more

    with pytest.raises(ModelError) as caught:
        await client.complete(USER)
    await client.close()

    assert caught.value.kind == "connection"
    assert rec.outcomes == ["connection", "connection"] and len(rec.waits) == 1
    assert "model.base_url" in caught.value.user_message()


@pytest.mark.parametrize(("status", "file", "kind"), [
    (400, "openai_context_length_exceeded.json", "overflow"),
    (401, "openai_invalid_api_key.json", "auth"),
    (400, "openai_invalid_tool_schema.json", "bad_request"),
    (429, "openai_insufficient_quota.json", "rate_limit"),
])
async def test_no_retry_where_waiting_cannot_help(
    fake_model: FakeModel, client: ModelClient, rec: Recorder,  # noqa: F811
    status: int, file: str, kind: str,
) -> None:
    fake_model.error(status, json.loads((ERRORS / file).read_text()))

    with pytest.raises(ModelError) as caught:
        await client.complete(USER)

    assert caught.value.kind == kind
    assert caught.value.status == status
    assert rec.waits == []
    assert len(fake_model.requests) == 1


async def test_stream_failure_after_text_is_not_retried(
    fake_model: FakeModel, client: ModelClient, rec: Recorder,  # noqa: F811
) -> None:
    fake_model.stream_error("Half an answer", {"error": {"message": "upstream died", "code": 502}})
    deltas = Deltas()

    with pytest.raises(ModelError) as caught:
        await client.complete(USER, on_text=deltas)

    assert caught.value.kind == "server"
    assert "".join(deltas.parts) == "Half an answer"
    assert len(fake_model.requests) == 1 and rec.waits == []


async def test_stream_options_rejection_is_learned(fake_model: FakeModel, client: ModelClient) -> None:  # noqa: F811
    fake_model.error(400, {"error": {"message": "Unrecognized request argument supplied: stream_options",
                                     "type": "invalid_request_error", "param": None, "code": None}})
    fake_model.reply("fine")

    reply = await client.complete(USER, on_text=Deltas())
    await client.complete(USER, on_text=Deltas())

    assert reply.content == "fine"
    assert [("stream_options" in r) for r in fake_model.requests] == [True, False, False]


async def test_a_provider_that_ignores_stream_still_answers(fake_model: FakeModel, client: ModelClient) -> None:  # noqa: F811
    fake_model.raw(200, json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "all at once"}, "finish_reason": "stop"}]}))
    deltas = Deltas()

    reply = await client.complete(USER, on_text=deltas)

    assert reply.content == "all at once" and deltas.parts == ["all at once"]


@asynccontextmanager
async def sse_server(pieces: list[bytes], *, hold_open_s: float = 0) -> AsyncIterator[str]:
    """A provider that writes its event stream in exactly these pieces (a short pause
    between them, so they arrive in separate reads), then keeps the response open for
    `hold_open_s` before ending it."""
    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for piece in pieces:
            await response.write(piece)
            await asyncio.sleep(0.01)
        await asyncio.sleep(hold_open_s)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
    finally:
        await runner.cleanup()


def sse_chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


async def test_server_sent_events_are_read_however_the_bytes_arrive() -> None:
    arguments = json.dumps({"path": "big.md", "pad": "x" * 300_000})  # one event far past a line buffer
    events = [
        b": keep-alive comment\r\n\r\n",
        b"data: " + json.dumps(sse_chunk({"role": "assistant", "content": "Hel"})).encode() + b"\r\n\r\n",
        b"event: message\ndata: " + json.dumps(sse_chunk({"content": "lo é漢"}), ensure_ascii=False).encode() + b"\n\n",
        b"data: " + json.dumps(sse_chunk({"tool_calls": [{"index": 0, "id": "call_1", "function": {
            "name": "read_file", "arguments": arguments}}]}, "tool_calls")).encode() + b"\n\n",
        b"data: [DONE]\n\n",
    ]
    stream = b"".join(events)
    # Cut everywhere that matters: inside "data:", inside a CRLF, inside a UTF-8 character.
    cuts = sorted({3, 20, stream.index(b"\r\n") + 1, stream.index("é".encode()) + 1, 1000, 200_000})
    pieces = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    async with sse_server(pieces) as base_url:
        client = ModelClient(ModelConfig(name="m", base_url=base_url, api_key=SecretStr("k"), timeout_s=5))
        deltas = Deltas()
        reply = await client.complete(USER, on_text=deltas)
        await client.close()

    assert "".join(deltas.parts) == reply.content == "Hello é漢"
    assert [(c.id, c.name, c.arguments) for c in reply.tool_calls] == [("call_1", "read_file", arguments)]


async def test_a_stream_held_open_after_done_does_not_hold_the_reply() -> None:
    done = [b"data: " + json.dumps(sse_chunk({"content": "ok"}, "stop")).encode() + b"\n\n", b"data: [DONE]\n\n"]
    async with sse_server(done, hold_open_s=10) as base_url:
        client = ModelClient(ModelConfig(name="m", base_url=base_url, api_key=SecretStr("k"), timeout_s=30))
        started = time.monotonic()
        reply = await client.complete(USER, on_text=Deltas())
        took = time.monotonic() - started
        await client.close()

    assert reply.content == "ok"
    assert took < 5


async def test_max_completion_tokens_is_used_when_max_tokens_is_refused(
    fake_model: FakeModel, client: ModelClient,  # noqa: F811
) -> None:
    fake_model.error(400, json.loads((ERRORS / "openai_unsupported_max_tokens.json").read_text()))

    await client.complete(USER)

    first, second = fake_model.requests
    assert first["max_tokens"] == 4096
    assert second["max_completion_tokens"] == 4096 and "max_tokens" not in second


# ----------------------------------------------------------------------------------------
# Unusable answers


@pytest.mark.parametrize(("status", "body", "content_type"), [
    (200, json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": []}),
     "application/json"),
    (200, '{"id": "chatcmpl-1", "object": "chat.completion", "choices": [{"index": 0, "mess',
     "application/json"),
    (200, "<html><body>Welcome to nginx!</body></html>", "text/html"),
    (200, json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": "m",
                      "choices": [{"index": 0, "finish_reason": "stop"}]}), "application/json"),
], ids=["empty-choices", "truncated-json", "html-page", "no-message"])
@pytest.mark.parametrize("streaming", [False, True], ids=["plain", "streamed"])
async def test_unusable_response_is_invalid_response(
    fake_model: FakeModel, client: ModelClient, rec: Recorder,  # noqa: F811
    status: int, body: str, content_type: str, streaming: bool,
) -> None:
    fake_model.raw(status, body, content_type)

    with pytest.raises(ModelError) as caught:
        await client.complete(USER, on_text=Deltas() if streaming else None)

    assert caught.value.kind == "invalid_response"
    assert rec.outcomes == ["invalid_response"]
    assert "model.base_url" in caught.value.user_message()


async def test_error_inside_a_200_body_is_classified(fake_model: FakeModel, client: ModelClient) -> None:  # noqa: F811
    fake_model.raw(200, (ERRORS / "openrouter_wrapped_anthropic.json").read_text())

    with pytest.raises(ModelError) as caught:
        await client.complete(USER)

    assert (caught.value.kind, caught.value.provider_limit) == ("overflow", 200_000)


async def test_413_is_overflow(fake_model: FakeModel, client: ModelClient) -> None:  # noqa: F811
    fake_model.error(413, (ERRORS / "http_413_nginx.html").read_text())

    with pytest.raises(ModelError) as caught:
        await client.complete(USER)

    assert caught.value.kind == "overflow"
    assert caught.value.provider_limit is None
    assert len(fake_model.requests) == 1


async def test_overflow_carries_the_provider_limit(fake_model: FakeModel, client: ModelClient) -> None:  # noqa: F811
    fake_model.overflow(limit=16385, requested=20000)

    with pytest.raises(ModelError) as caught:
        await client.complete(USER)

    assert (caught.value.kind, caught.value.provider_limit, caught.value.status) == ("overflow", 16385, 400)
    assert "context window" in caught.value.user_message()


@pytest.mark.parametrize("api_key", [None, "", "${OPENAI_API_KEY}"])
async def test_not_configured_never_calls_the_provider(fake_model: FakeModel, api_key: str | None) -> None:  # noqa: F811
    rec = Recorder()
    client = make_client(fake_model, rec, api_key=None if api_key is None else SecretStr(api_key))

    assert client.configured is False
    with pytest.raises(ModelError) as caught:
        await client.complete(USER)
    await client.close()

    assert caught.value.kind == "not_configured"
    message = caught.value.user_message()
    assert "model.api_key" in message and "OPENAI_API_KEY" in message
    assert fake_model.requests == [] and rec.calls == []


async def test_user_message_never_shows_the_key(fake_model: FakeModel, client: ModelClient) -> None:  # noqa: F811
    fake_model.error(400, {"error": {"message": "Bad header Authorization: Bearer sk-live-abcdef123456",
                                     "type": "invalid_request_error", "param": None, "code": None}})

    with pytest.raises(ModelError) as caught:
        await client.complete(USER)

    assert caught.value.kind == "bad_request"
    assert "sk-live" not in caught.value.user_message()
    assert "Traceback" not in caught.value.user_message()


# ----------------------------------------------------------------------------------------
# The classifier over real-shaped provider bodies

# file → (HTTP status, kind, provider limit)
CLASSIFIED: dict[str, tuple[int, str, int | None]] = {
    # context overflow, in every provider's wording
    "openai_context_length_exceeded.json": (400, "overflow", 8192),
    "openai_context_requested_completion.json": (400, "overflow", 128000),
    "openai_input_exceeds_context_window.json": (400, "overflow", None),
    "openai_429_request_too_large.json": (429, "overflow", 30000),
    "anthropic_prompt_too_long.json": (400, "overflow", 200000),
    "anthropic_input_and_max_tokens.json": (400, "overflow", 200000),
    "deepseek_context_length.json": (400, "overflow", 131072),
    "qwen_range_of_input_length.json": (400, "overflow", 30720),
    "dashscope_native_invalid_parameter.json": (400, "overflow", 6000),
    "gemini_input_token_count.json": (400, "overflow", 1048575),
    "vllm_context_length.json": (400, "overflow", 4096),
    "vllm_input_tokens.json": (400, "overflow", 32768),
    "vllm_max_tokens_sum.json": (400, "overflow", 8192),
    "llamacpp_exceed_context_size.json": (400, "overflow", 4096),
    "llamacpp_old_500.json": (500, "overflow", 8192),
    "ollama_prompt_too_long.json": (400, "overflow", None),
    "ollama_input_length.json": (400, "overflow", None),
    "mistral_too_large.json": (400, "overflow", 32768),
    "openrouter_wrapped_anthropic.json": (400, "overflow", 200000),
    "openrouter_endpoint_context.json": (400, "overflow", 163840),
    "groq_413_request_too_large.json": (413, "overflow", 6000),
    "http_413_nginx.html": (413, "overflow", None),
    "xai_prompt_length.json": (400, "overflow", 131072),
    "together_longer_than_context.json": (400, "overflow", 32768),
    "tgi_inputs_plus_max_new_tokens.json": (422, "overflow", 32769),
    "zhipu_chinese_overflow.json": (400, "overflow", None),
    "bedrock_input_too_long.json": (400, "overflow", None),
    # other 400s that must never be taken for overflow
    "openai_invalid_tool_schema.json": (400, "bad_request", None),
    "openai_model_not_found.json": (404, "bad_request", None),
    "azure_content_filter.json": (400, "bad_request", None),
    "openai_max_tokens_too_large.json": (400, "bad_request", None),
    "openai_invalid_image.json": (400, "bad_request", None),
    "openai_tool_call_pairing.json": (400, "bad_request", None),
    "openai_unsupported_max_tokens.json": (400, "bad_request", None),
    "openai_unsupported_temperature.json": (400, "bad_request", None),
    "qwen_data_inspection_failed.json": (400, "bad_request", None),
    "qwen_max_tokens_range.json": (400, "bad_request", None),
    "qwen_input_should_be_list.json": (400, "bad_request", None),
    "qwen_no_user_message.json": (400, "bad_request", None),
    "deepseek_max_tokens_range.json": (400, "bad_request", None),
    "deepseek_model_not_exist.json": (400, "bad_request", None),
    "anthropic_max_tokens_output.json": (400, "bad_request", None),
    "gemini_invalid_function_schema.json": (400, "bad_request", None),
    "vllm_max_tokens_over_window.json": (400, "bad_request", None),
    "vllm_old_completion_over_window.json": (400, "bad_request", None),
    "ollama_model_not_found.json": (404, "bad_request", None),
    # the rest of the family
    "openai_rate_limit_tpm.json": (429, "rate_limit", None),
    "openai_insufficient_quota.json": (429, "rate_limit", None),
    "openai_invalid_api_key.json": (401, "auth", None),
    "anthropic_overloaded.json": (529, "server", None),
    "openai_server_error.json": (500, "server", None),
    "http_502_bad_gateway.html": (502, "server", None),
}


def load_body(name: str) -> object:
    text = (ERRORS / name).read_text(encoding="utf-8")
    return json.loads(text) if name.endswith(".json") else text


def test_every_stored_body_is_in_the_table() -> None:
    assert sorted(p.name for p in ERRORS.iterdir()) == sorted(CLASSIFIED)
    non_overflow_400s = [n for n, (s, k, _) in CLASSIFIED.items() if k == "bad_request" and s == 400]
    assert len(non_overflow_400s) >= 8


@pytest.mark.parametrize("name", sorted(CLASSIFIED))
def test_classify_error(name: str) -> None:
    status, kind, limit = CLASSIFIED[name]
    body = load_body(name)

    assert classify_error(status, body) == (kind, limit)
    # the SDK hands over the inner `error` object; the verdict must not depend on the shape
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        assert classify_error(status, body["error"]) == (kind, limit)


@pytest.mark.parametrize("streaming", [False, True], ids=["direct", "sdk-stream"])
async def test_classify_error_over_http(fake_model: FakeModel, rec: Recorder, streaming: bool) -> None:  # noqa: F811
    """The same table, served over HTTP: read by the direct endpoint (plain calls) and
    raised by the real SDK (streamed calls). One client per path: fast."""
    client = make_client(fake_model, rec, max_retries=0)
    on_text = Deltas() if streaming else None
    wrong = []
    for name, (status, kind, limit) in sorted(CLASSIFIED.items()):
        for _ in range(2):  # twice: a body the client adapts to (max_tokens) is answered again
            fake_model.error(status, load_body(name))  # type: ignore[arg-type]
        try:
            await client.complete(USER, on_text=on_text)
        except ModelError as err:
            got = (err.kind, err.provider_limit, err.status, bool(err.detail))
        else:
            got = ("no error", None, None, False)
        if got != (kind, limit, status, True):
            wrong.append((name, got))
        fake_model.clear()  # the unused second copy
    await client.close()

    assert wrong == []


def test_classify_without_status_uses_the_body_code() -> None:
    assert classify_error(None, {"error": {"message": "slow down", "code": 429}}) == ("rate_limit", None)
    assert classify_error(None, {"message": "something broke"}) == ("server", None)
    assert classify_error(None, None, "This model's maximum context length is 2048 tokens.") == (
        "overflow", 2048)


# ----------------------------------------------------------------------------------------
# Retry timing helpers


def test_parse_retry_after() -> None:
    now = datetime(2025, 3, 1, 12, 0, 0, tzinfo=UTC)
    later = format_datetime(now + timedelta(seconds=30), usegmt=True)

    assert parse_retry_after({"Retry-After": "12"}) == 12
    assert parse_retry_after({"retry-after": "0.5"}) == 0.5
    assert parse_retry_after({"retry-after-ms": "250"}) == 0.25
    assert parse_retry_after({"Retry-After": later}, now=now.timestamp()) == 30
    assert parse_retry_after({"Retry-After": "soon"}) is None
    assert parse_retry_after({"Retry-After": "-3"}) == 0
    assert parse_retry_after({}) is None


def test_retry_delay_is_exponential_with_jitter_and_capped() -> None:
    assert retry_delay(0, None, 0.0) == 0.25 and retry_delay(0, None, 1.0) == 0.5
    assert retry_delay(3, None, 1.0) == 4.0
    assert retry_delay(20, None, 1.0) == 60.0
    assert retry_delay(0, 9.0, 0.3) == 9.0
    assert retry_delay(0, 61.0, 0.3) is None


# ----------------------------------------------------------------------------------------
# The fake server's own conveniences (every end-to-end test relies on them)


async def test_fake_rejects_unpaired_tool_calls(fake_model: FakeModel, client: ModelClient) -> None:  # noqa: F811
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "current_time", "arguments": "{}"}}]}]

    with pytest.raises(ModelError) as caught:
        await client.complete(messages)

    assert caught.value.kind == "bad_request"
    assert fake_model.violations and "call_1" in fake_model.violations[0]


async def test_fake_context_window_answers_with_overflow(fake_model: FakeModel, client: ModelClient) -> None:  # noqa: F811
    fake_model.context_window = 50
    fake_model.reply("kept for the next request that fits")

    with pytest.raises(ModelError) as caught:
        await client.complete([{"role": "user", "content": "word " * 200}])
    fake_model.context_window = None
    reply = await client.complete(USER)

    assert (caught.value.kind, caught.value.provider_limit) == ("overflow", 50)
    assert reply.content == "kept for the next request that fits"


async def test_fake_responder_and_default(fake_model: FakeModel, client: ModelClient) -> None:  # noqa: F811
    async def summarizer(body: dict[str, Any]) -> str | None:
        return "SUMMARY" if "summarize" in json.dumps(body["messages"]) else None

    fake_model.respond_with(summarizer)
    summary = await client.complete([{"role": "user", "content": "please summarize this"}])
    echoed = await client.complete(USER)
    fake_model.default = "always this"
    fixed = await client.complete(USER)

    assert (summary.content, echoed.content, fixed.content) == ("SUMMARY", "echo: Hello there", "always this")


async def test_fake_serves_models_and_counts_requests(fake_model: FakeModel) -> None:  # noqa: F811
    sdk = openai.AsyncOpenAI(api_key="k", base_url=fake_model.base_url, max_retries=0)
    models = await sdk.models.list()
    await sdk.close()

    assert [m.id for m in models.data] == ["fake-model"]
    with pytest.raises(TimeoutError, match="got 0 request"):
        await fake_model.wait_requests(1, timeout=0.05)


async def test_close_lets_a_call_in_flight_finish_and_refuses_later_calls(
    fake_model: FakeModel, rec: Recorder,  # noqa: F811
) -> None:
    """A reload swaps model clients under running turns: the old one finishes its calls."""
    client = make_client(fake_model, rec)
    fake_model.reply("slow answer", delay=0.3)
    call = asyncio.create_task(client.complete(USER))
    await fake_model.wait_requests(1, timeout=5)

    await client.close(grace_s=5)

    assert (await call).content == "slow answer"
    with pytest.raises(ModelError) as caught:
        await client.complete(USER)
    assert caught.value.kind == "connection"
    assert len(fake_model.requests) == 1


async def test_concurrent_first_calls_share_one_connection_pool(
    fake_model: FakeModel, caplog: pytest.LogCaptureFixture,  # noqa: F811
) -> None:
    client = make_client(fake_model)
    replies = await asyncio.gather(client.warm_up(), *(client.complete(USER) for _ in range(20)))
    await client.close()
    gc.collect()  # a second pool opened by a racing call would now be reported unclosed

    assert [r.content for r in replies[1:]] == ["echo: Hello there"] * 20
    assert not [r for r in caplog.records if "Unclosed" in r.getMessage()]


async def test_plain_calls_send_the_key_and_the_sdk_environment_headers(
    fake_model: FakeModel, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
) -> None:
    monkeypatch.setenv("OPENAI_ORG_ID", "org-123")
    monkeypatch.setenv("OPENAI_PROJECT_ID", "proj-9")
    client = make_client(fake_model)
    await client.complete(USER)
    await client.close()

    headers = {k.lower(): v for k, v in fake_model.request_headers[-1].items()}
    assert headers["authorization"] == "Bearer test-key"
    assert (headers["openai-organization"], headers["openai-project"]) == ("org-123", "proj-9")
    assert fake_model.requests[-1]["model"] == "fake-model"


@pytest.mark.parametrize("streamed", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("base_url", ["ftp://models.example/v1", "localhost:8000/v1",
                                      "{fake}?api-version=2024-06-01", "{fake}#v1"])
async def test_a_base_url_that_is_not_a_plain_http_base_is_a_clear_connection_error(
    fake_model: FakeModel, rec: Recorder, base_url: str, streamed: bool,  # noqa: F811
) -> None:
    client = make_client(fake_model, rec, base_url=base_url.format(fake=fake_model.base_url), max_retries=0)
    with pytest.raises(ModelError) as caught:
        await client.complete(USER, on_text=_ignore_text if streamed else None)
    await client.close()

    assert caught.value.kind == "connection" and "model.base_url" in str(caught.value)
    assert "model.base_url" in caught.value.user_message()
    assert fake_model.requests == []


async def _ignore_text(_text: str) -> None:
    return None
