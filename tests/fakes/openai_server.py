"""A fake OpenAI-compatible chat-completions server for tests (aiohttp, 127.0.0.1:0).

Script what the "model" answers, point the real `openai` SDK (or the gateway) at
`fake.base_url`, then look at what was sent in `fake.requests`:

    async with FakeModel() as fake:
        fake.reply("Hello!", usage=(12, 3))
        fake.tool_call("read_file", {"path": "notes.md"})
        ...                                   # run the code under test
        first, second = await fake.wait_requests(2)

Scripted replies are consumed first in, first out. When the script is empty, the
responder set with `respond_with()` answers, and when it has nothing to say (returns
None) the `default` does: an echo of the last user text ("echo: <text>").

Every reply works for `stream=True` too: text is streamed in several deltas (or the exact
`chunks` given, `chunk_delay` apart), tool call arguments in pieces, and a usage chunk is
sent when `stream_options.include_usage` is set. An answer the client leaves before its end
(a stream it closes, a hang it gives up on) is recorded in `disconnects`
(`wait_disconnects(n)`), as a provider sees it: the connection is gone.
Usage that a test does not give is estimated (about 4 characters per token), so code
that calibrates token counts always sees numbers.

The fake is strict the way real providers are: a request whose tool calls and tool
results do not pair up is answered with a 400 (set `strict = False` to allow it), and
with `context_window` set, a request estimated above it gets OpenAI's overflow error.
Image parts must be what OpenAI takes: an `image_url` whose url is an http(s) or
`data:image/...;base64,` URL with nothing else in the part (else 400); `image_parts()`
lists those received, decoded.

Speech to text: `POST /v1/audio/transcriptions` takes OpenAI's multipart form (`file`,
`model`, `response_format`) with its limits (25 MB, the file formats it names; else a
400 or 413 as OpenAI words them) and records each upload in `transcriptions`. It answers
what `transcribe()` scripted (a text, an error, a hang), else `default_transcript`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import inspect
import itertools
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest_asyncio
from aiohttp import web

# ----------------------------------------------------------------------------------------
# Scripted replies


@dataclass(frozen=True, slots=True)
class ScriptedCall:
    """One tool call the fake model makes; `arguments` is sent verbatim (raw JSON text)."""

    name: str
    arguments: str
    id: str


@dataclass(frozen=True, slots=True)
class Reply:
    """An assistant answer: text and/or tool calls."""

    text: str | None = None
    tool_calls: tuple[ScriptedCall, ...] = ()
    usage: tuple[int, int] | None = None  # (prompt_tokens, completion_tokens)
    delay: float = 0.0
    finish_reason: str | None = None  # None: "tool_calls" when calls, else "stop"
    # Streaming only: the text in exactly these deltas (else word-sized ones), a pause
    # before each delta (a slow provider), and reasoning sent first as
    # `reasoning_content` deltas the way DeepSeek and vLLM's reasoning parsers do.
    chunks: tuple[str, ...] | None = None
    chunk_delay: float = 0.0
    reasoning: str | None = None


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """An HTTP error with a JSON (dict) or text (str) body."""

    status: int
    body: dict[str, Any] | str
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RawReply:
    """Any bytes with any status: truncated JSON, HTML from a proxy, …"""

    status: int
    body: str
    content_type: str = "application/json"


@dataclass(frozen=True, slots=True)
class Hang:
    """Wait `seconds` before answering (with `then`, or the default), to trigger timeouts."""

    seconds: float
    then: Reply | None = None


@dataclass(frozen=True, slots=True)
class StreamError:
    """Streams `text_before`, then an in-stream error event (as OpenRouter and others do).

    A non-streaming request gets the same body as an HTTP 500."""

    text_before: str
    body: dict[str, Any]


Scripted = Reply | ErrorReply | RawReply | Hang | StreamError
ResponderResult = Scripted | str | dict[str, Any] | None
Responder = Callable[[dict[str, Any]], Awaitable[ResponderResult] | ResponderResult]


def last_user_text(request: dict[str, Any]) -> str:
    """The text of the last user message of a chat-completions request body."""
    for message in reversed(request.get("messages") or []):
        if isinstance(message, dict) and message.get("role") == "user":
            return _content_text(message.get("content"))
    return ""


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: keep the text ones
        return "".join(
            str(part.get("text", "")) for part in content
            if isinstance(part, dict) and part.get("type") == "text"
        )
    return ""


def echo_reply(request: dict[str, Any]) -> Reply:
    return Reply(text=f"echo: {last_user_text(request)}")


def estimate_tokens(text: str) -> int:
    return max(1, len(text) // 4)


def estimate_prompt_tokens(request: dict[str, Any]) -> int:
    sent = json.dumps([request.get("messages"), request.get("tools")], ensure_ascii=False)
    return estimate_tokens(sent)


# ----------------------------------------------------------------------------------------
# The server


class FakeModel:
    """The fake server; see the module docstring. Start with `async with` or start()/stop()."""

    def __init__(self, *, model_name: str = "fake-model") -> None:
        self.model_name = model_name
        self.base_url = ""  # set by start(): "http://127.0.0.1:PORT/v1"
        self.requests: list[dict[str, Any]] = []  # every request body received, in order
        self.request_headers: list[dict[str, str]] = []
        self.violations: list[str] = []  # strict-mode complaints sent back as 400s
        # Answers the client left before their end (a stream it closed, a hang it gave up
        # on): the index of each one's request in `requests` (a stopped turn closes its call).
        self.disconnects: list[int] = []
        self.strict = True
        self.context_window: int | None = None  # estimated prompt tokens above it → overflow
        # Used when the script is empty and respond_with() gives nothing: a str is a fixed
        # text reply, a callable gets the request body.
        self.default: str | Responder = echo_reply
        self._script: list[Scripted] = []
        self._responder: Responder | None = None
        self.transcriptions: list[dict[str, Any]] = []  # every upload: model, filename, audio, headers
        self.default_transcript = "this is what the fake heard"
        self._stt_script: list[Reply | ErrorReply | Hang] = []
        self._ids = itertools.count(1)
        self._arrived = asyncio.Condition()
        self._stopping = asyncio.Event()
        self._runner: web.AppRunner | None = None

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/audio/transcriptions", self._transcription)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.base_url = f"http://{host}:{port}/v1"

    async def stop(self) -> None:
        self._stopping.set()  # wakes every delayed or hanging handler at once
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> FakeModel:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def model_settings(self, **overrides: Any) -> dict[str, Any]:
        """The `model` section of a gateway config pointing at this fake."""
        return {"name": self.model_name, "base_url": self.base_url, "api_key": "test-key", **overrides}

    # -- scripting ---------------------------------------------------------------------------

    def reply(self, text: str, *, usage: tuple[int, int] | None = None, delay: float = 0,
              finish_reason: str = "stop", chunks: list[str] | None = None, chunk_delay: float = 0,
              reasoning: str | None = None) -> None:
        """A text answer. With `chunks`, it is streamed in exactly those deltas (and `text`
        must be their concatenation)."""
        if chunks is not None and "".join(chunks) != text:
            raise ValueError("the chunks must add up to the text")
        self._script.append(Reply(text=text, usage=usage, delay=delay, finish_reason=finish_reason,
                                  chunks=tuple(chunks) if chunks is not None else None,
                                  chunk_delay=chunk_delay, reasoning=reasoning))

    def tool_call(self, name: str, arguments: dict[str, Any] | str, *, call_id: str | None = None,
                  text: str | None = None, usage: tuple[int, int] | None = None) -> None:
        call = ScriptedCall(name, _arguments_text(arguments), call_id or self._call_id())
        self._script.append(Reply(text=text, tool_calls=(call,), usage=usage))

    def tool_calls(self, calls: list[tuple[str, dict[str, Any] | str]], *, text: str | None = None,
                   usage: tuple[int, int] | None = None) -> None:
        """Parallel tool calls in one reply."""
        scripted = tuple(ScriptedCall(n, _arguments_text(a), self._call_id()) for n, a in calls)
        self._script.append(Reply(text=text, tool_calls=scripted, usage=usage))

    def error(self, status: int, body: dict[str, Any] | str, *,
              headers: dict[str, str] | None = None) -> None:
        self._script.append(ErrorReply(status, body, dict(headers or {})))

    def overflow(self, limit: int = 8192, requested: int | None = None) -> None:
        """OpenAI's context-length error, as sent when a request exceeds the window."""
        self._script.append(overflow_error(limit, requested))

    def hang(self, seconds: float) -> None:
        self._script.append(Hang(seconds))

    def raw(self, status: int, body: str, content_type: str = "application/json") -> None:
        self._script.append(RawReply(status, body, content_type))

    def stream_error(self, text_before: str, body: dict[str, Any]) -> None:
        self._script.append(StreamError(text_before, body))

    def script(self, *replies: Scripted) -> None:
        """Append ready-made scripted objects."""
        self._script.extend(replies)

    def respond_with(self, fn: Responder | None) -> None:
        """Answer with fn(request_body) whenever the script is empty (None: remove it).

        fn may be async; it returns a scripted object, a str (text reply), a dict (a whole
        chat.completion body, sent as is) or None (let `default` answer)."""
        self._responder = fn

    def transcribe(self, text: str | None = None, *, error: tuple[int, dict[str, Any] | str] | None = None,
                   hang: float | None = None) -> None:
        """Script the next transcription: a text, an (HTTP status, body) error, or a hang
        of `hang` seconds (then the default transcript)."""
        if hang is not None:
            self._stt_script.append(Hang(hang))
        elif error is not None:
            self._stt_script.append(ErrorReply(error[0], error[1]))
        else:
            self._stt_script.append(Reply(text=text or ""))

    def image_parts(self, request: dict[str, Any] | None = None) -> list[tuple[str, bytes]]:
        """(mime, decoded bytes) of every data-URL image part of `request` (default: the
        last one), in order."""
        body = request if request is not None else self.requests[-1]
        found = []
        for message in body.get("messages") or []:
            content = message.get("content") if isinstance(message, dict) else None
            for part in content if isinstance(content, list) else ():
                if isinstance(part, dict) and part.get("type") == "image_url":
                    url = part["image_url"]["url"]
                    head, _, data = url.partition(",")
                    found.append((head.removeprefix("data:").removesuffix(";base64"), base64.b64decode(data)))
        return found

    def clear(self) -> None:
        """Forget the scripted replies not consumed yet."""
        self._script.clear()
        self._stt_script.clear()

    @property
    def pending(self) -> int:
        """Scripted replies not consumed yet."""
        return len(self._script)

    async def wait_requests(self, n: int, timeout: float = 5) -> list[dict[str, Any]]:
        """The first n requests, once they have arrived."""
        async with self._arrived:
            try:
                await asyncio.wait_for(self._arrived.wait_for(lambda: len(self.requests) >= n), timeout)
            except TimeoutError:
                raise TimeoutError(
                    f"fake model got {len(self.requests)} request(s), expected {n} within {timeout}s"
                ) from None
        return self.requests[:n]

    # -- handlers --------------------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({
            "object": "list",
            "data": [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "fake"}],
        })

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            return _error_response(400, "We could not parse the JSON body of your request.")
        if not isinstance(body, dict):
            return _error_response(400, "The request body must be a JSON object.")
        async with self._arrived:
            request[REQUEST_INDEX] = len(self.requests)
            self.requests.append(body)
            self.request_headers.append(dict(request.headers))
            self._arrived.notify_all()

        problem = self._check(body)
        if problem is not None:
            self.violations.append(problem)
            return _error_response(400, problem, param="messages")
        if self.context_window is not None:
            estimated = estimate_prompt_tokens(body)
            if estimated > self.context_window:
                return web.json_response(_overflow_body(self.context_window, estimated), status=400)

        answer = await self._next(body)
        while isinstance(answer, Hang):
            if not await self._hang(request, answer.seconds):
                await self._client_left(request)
                return web.Response()  # never sent: the client has gone
            answer = answer.then or await self._fallback(body)
        return await self._send(request, body, answer)

    async def _hang(self, request: web.Request, seconds: float) -> bool:
        """Wait `seconds` (or until the server stops); False when the client left first."""
        loop = asyncio.get_running_loop()
        end = loop.time() + seconds
        while loop.time() < end and not self._stopping.is_set():
            if request.transport is None or request.transport.is_closing():
                return False
            await self._pause(min(0.02, end - loop.time()))
        return True

    async def _client_left(self, request: web.Request) -> None:
        async with self._arrived:
            self.disconnects.append(request[REQUEST_INDEX])
            self._arrived.notify_all()

    async def _next(self, body: dict[str, Any]) -> Scripted | dict[str, Any]:
        if self._script:
            return self._script.pop(0)
        if self._responder is not None:
            produced = await _call(self._responder, body)
            if produced is not None:
                return _as_answer(produced)
        return await self._fallback(body)

    async def _fallback(self, body: dict[str, Any]) -> Scripted | dict[str, Any]:
        if isinstance(self.default, str):
            return Reply(text=self.default)
        produced = await _call(self.default, body)
        return _as_answer(produced if produced is not None else echo_reply(body))

    async def _send(self, request: web.Request, body: dict[str, Any],
                    answer: Reply | ErrorReply | RawReply | StreamError | dict[str, Any],
                    ) -> web.StreamResponse:
        streaming = bool(body.get("stream"))
        if isinstance(answer, ErrorReply):
            if isinstance(answer.body, str):
                return web.Response(status=answer.status, text=answer.body, headers=answer.headers)
            return web.json_response(answer.body, status=answer.status, headers=answer.headers)
        if isinstance(answer, RawReply):
            return web.Response(status=answer.status, body=answer.body.encode(),
                                content_type=answer.content_type)
        if isinstance(answer, StreamError):
            if not streaming:
                return web.json_response(answer.body, status=500)
            return await self._stream(request, body, Reply(text=answer.text_before), error=answer.body)
        if isinstance(answer, dict):
            if not streaming:
                return web.json_response(answer)
            return await self._stream(request, body, _reply_from_completion(answer))
        if answer.delay:
            await self._pause(answer.delay)
        if streaming:
            return await self._stream(request, body, answer)
        return web.json_response(self._completion(body, answer))

    async def _transcription(self, request: web.Request) -> web.Response:
        if not request.content_type.startswith("multipart/form-data"):
            return _error_response(400, "Expected a multipart/form-data request.")
        if request.content_length is not None and request.content_length > TRANSCRIPTION_MAX_BYTES + 65536:
            return _error_response(413, "Maximum content size limit (26214400) exceeded.")
        fields: dict[str, Any] = {}
        reader = await request.multipart()
        while (part := await reader.next()) is not None:
            if part.name == "file":
                fields["file"] = (part.filename or "", part.headers.get("Content-Type", ""), await part.read())
            elif part.name:
                fields[part.name] = await part.text()
        upload = fields.get("file")
        record = {"model": fields.get("model"), "response_format": fields.get("response_format"),
                  "filename": upload[0] if upload else None, "content_type": upload[1] if upload else None,
                  "audio": upload[2] if upload else b"", "headers": dict(request.headers)}
        async with self._arrived:
            self.transcriptions.append(record)
            self._arrived.notify_all()
        if not fields.get("model"):
            return _error_response(400, "you must provide a model parameter", param="model")
        if upload is None:
            return _error_response(400, "you must provide a file parameter", param="file")
        if len(upload[2]) > TRANSCRIPTION_MAX_BYTES:
            return _error_response(413, "Maximum content size limit (26214400) exceeded.")
        extension = upload[0].rsplit(".", 1)[-1].lower() if "." in upload[0] else ""
        if extension not in TRANSCRIPTION_FORMATS:
            return _error_response(400, f"Invalid file format. Supported formats: {sorted(TRANSCRIPTION_FORMATS)}",
                                   param="file")
        answer: Reply | ErrorReply | Hang = self._stt_script.pop(0) if self._stt_script else Reply(
            text=self.default_transcript)
        if isinstance(answer, Hang):
            await self._pause(answer.seconds)
            answer = Reply(text=self.default_transcript)
        if isinstance(answer, ErrorReply):
            if isinstance(answer.body, str):
                return web.Response(status=answer.status, text=answer.body)
            return web.json_response(answer.body, status=answer.status)
        return web.json_response({"text": answer.text or ""})

    async def wait_transcriptions(self, n: int, timeout: float = 5) -> list[dict[str, Any]]:
        async with self._arrived:
            await asyncio.wait_for(self._arrived.wait_for(lambda: len(self.transcriptions) >= n), timeout)
        return self.transcriptions[:n]

    # -- bodies ----------------------------------------------------------------------------

    def _usage(self, body: dict[str, Any], reply: Reply) -> dict[str, int]:
        if reply.usage is not None:
            prompt, completion = reply.usage
        else:
            produced = (reply.text or "") + "".join(c.name + c.arguments for c in reply.tool_calls)
            prompt, completion = estimate_prompt_tokens(body), estimate_tokens(produced)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def _completion(self, body: dict[str, Any], reply: Reply) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": reply.text}
        if reply.reasoning is not None:
            message["reasoning_content"] = reply.reasoning
        if reply.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in reply.tool_calls
            ]
        return {
            "id": f"chatcmpl-fake-{next(self._ids)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model") or self.model_name,
            "choices": [{"index": 0, "message": message, "finish_reason": _finish(reply),
                         "logprobs": None}],
            "usage": self._usage(body, reply),
        }

    async def wait_disconnects(self, n: int, timeout: float = 10) -> list[int]:
        """The first n answers the client left early, once it has left them."""
        async with self._arrived:
            try:
                await asyncio.wait_for(self._arrived.wait_for(lambda: len(self.disconnects) >= n), timeout)
            except TimeoutError:
                raise TimeoutError(f"{len(self.disconnects)} stream(s) closed by the client, expected {n} "
                                   f"within {timeout}s") from None
        return self.disconnects[:n]

    async def _stream(self, request: web.Request, body: dict[str, Any], reply: Reply,
                      error: dict[str, Any] | None = None) -> web.StreamResponse:
        try:
            return await self._stream_events(request, body, reply, error)
        except ConnectionResetError:  # aiohttp's "cannot write to closing transport"
            await self._client_left(request)
            return web.Response()  # never sent: the client has gone

    async def _stream_events(self, request: web.Request, body: dict[str, Any], reply: Reply,
                             error: dict[str, Any] | None = None) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        base = {"id": f"chatcmpl-fake-{next(self._ids)}", "object": "chat.completion.chunk",
                "created": int(time.time()), "model": body.get("model") or self.model_name}

        async def send(delta: dict[str, Any], finish: str | None = None) -> None:
            chunk = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
            if include_usage:
                chunk["usage"] = None
            await _sse(response, chunk)

        await send({"role": "assistant", "content": ""})
        for piece in _pieces(reply.reasoning or ""):
            await send({"reasoning_content": piece})
        for piece in reply.chunks if reply.chunks is not None else _pieces(reply.text or ""):
            if reply.chunk_delay:
                await self._pause(reply.chunk_delay)
            await send({"content": piece})
        if error is not None:
            await _sse(response, {"error": error})
            await response.write_eof()
            return response
        for index, call in enumerate(reply.tool_calls):
            await send({"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                        "function": {"name": call.name, "arguments": ""}}]})
            for piece in _halves(call.arguments):
                await send({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
        await send({}, _finish(reply))
        if include_usage:
            await _sse(response, {**base, "choices": [], "usage": self._usage(body, reply)})
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    # -- helpers ---------------------------------------------------------------------------

    def _call_id(self) -> str:
        return f"call_fake_{next(self._ids)}"

    async def _pause(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._stopping.wait(), seconds)
        except TimeoutError:
            pass

    def _check(self, body: dict[str, Any]) -> str | None:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return "'messages' must be a non-empty array."
        image_problem = _image_problem(messages)
        if image_problem is not None:
            return image_problem
        if not self.strict:
            return None
        return _pairing_problem(messages)


# ----------------------------------------------------------------------------------------
# Module helpers


def _arguments_text(arguments: dict[str, Any] | str) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _finish(reply: Reply) -> str:
    if reply.finish_reason is not None:
        return reply.finish_reason
    return "tool_calls" if reply.tool_calls else "stop"


def _pieces(text: str) -> list[str]:
    """Text split into word-sized deltas, as providers stream it."""
    return re.findall(r"\s*\S+\s*|\s+", text) if text else []


def _halves(text: str) -> list[str]:
    middle = len(text) // 2
    return [part for part in (text[:middle], text[middle:]) if part]


async def _sse(response: web.StreamResponse, payload: dict[str, Any]) -> None:
    await response.write(f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode())


async def _call(fn: Responder, body: dict[str, Any]) -> ResponderResult:
    produced = fn(body)
    if inspect.isawaitable(produced):
        produced = await produced
    return produced


def _as_answer(produced: Scripted | str | dict[str, Any]) -> Scripted | dict[str, Any]:
    return Reply(text=produced) if isinstance(produced, str) else produced


def _reply_from_completion(completion: dict[str, Any]) -> Reply:
    """A whole chat.completion dict turned back into a Reply, to stream it."""
    choice = (completion.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    calls = tuple(
        ScriptedCall(c["function"]["name"], c["function"].get("arguments", ""), c.get("id", ""))
        for c in message.get("tool_calls") or []
    )
    usage = completion.get("usage")
    return Reply(
        text=message.get("content"),
        tool_calls=calls,
        usage=(usage["prompt_tokens"], usage["completion_tokens"]) if usage else None,
        finish_reason=choice.get("finish_reason"),
    )


def _error_response(status: int, message: str, *, param: str | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "invalid_request_error",
                                         "param": param, "code": None}}, status=status)


def overflow_error(limit: int = 8192, requested: int | None = None) -> ErrorReply:
    """OpenAI's context-length error as a scripted answer (e.g. for a responder)."""
    return ErrorReply(400, _overflow_body(limit, requested or limit + 1000))


def _overflow_body(limit: int, requested: int) -> dict[str, Any]:
    return {"error": {
        "message": (f"This model's maximum context length is {limit} tokens. However, your messages "
                    f"resulted in {requested} tokens. Please reduce the length of the messages."),
        "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded",
    }}


REQUEST_INDEX = web.RequestKey("index", int)  # a request's place in `FakeModel.requests`
TRANSCRIPTION_MAX_BYTES = 25 * 1024 * 1024  # OpenAI's limit for one audio file
TRANSCRIPTION_FORMATS = frozenset({"flac", "m4a", "mp3", "mp4", "mpeg", "mpga", "oga", "ogg", "wav", "webm"})
_IMAGE_PART_KEYS = frozenset({"type", "image_url"})


def _image_problem(messages: list[Any]) -> str | None:
    """Image parts as OpenAI takes them: nothing but `type` and `image_url`, whose `url` is
    an http(s) URL or a base64 `data:image/...` URL that decodes."""
    for position, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for index, part in enumerate(content):
            where = f"messages[{position}].content[{index}]"
            if not isinstance(part, dict) or part.get("type") not in ("text", "image_url"):
                return f"Invalid content part at {where}."
            if part["type"] == "text":
                if set(part) != {"type", "text"} or not isinstance(part["text"], str):
                    return f"Invalid text part at {where}."
                continue
            if set(part) - _IMAGE_PART_KEYS:
                return f"Unrecognized parameters in {where}: {sorted(set(part) - _IMAGE_PART_KEYS)}."
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else None
            if not isinstance(url, str):
                return f"Missing image_url.url at {where}."
            if url.startswith(("http://", "https://")):
                continue
            head, _, data = url.partition(",")
            if not (head.startswith("data:image/") and head.endswith(";base64")):
                return f"Invalid image URL at {where}: expected a base64-encoded data URL with an image MIME type."
            try:
                base64.b64decode(data, validate=True)
            except (binascii.Error, ValueError):
                return f"Invalid base64 image data at {where}."
    return None


def _pairing_problem(messages: list[Any]) -> str | None:
    """Tool calls and tool results must pair up, as real providers require."""
    open_calls: list[str] = []
    for position, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in {
            "system", "developer", "user", "assistant", "tool",
        }:
            return f"messages[{position}]: invalid message or role."
        role = message["role"]
        if role == "tool":
            call_id = message.get("tool_call_id")
            if call_id not in open_calls:
                return (f"messages[{position}]: a 'tool' message must answer a tool call of the "
                        f"assistant message before it (unknown tool_call_id {call_id!r}).")
            open_calls.remove(call_id)
            continue
        if open_calls:
            return (f"messages[{position}]: the tool calls {open_calls} of an earlier assistant "
                    "message have no tool result messages.")
        if role == "assistant":
            open_calls = [c.get("id") for c in message.get("tool_calls") or [] if isinstance(c, dict)]
    if open_calls:
        return f"the tool calls {open_calls} of the last assistant message have no tool results."
    return None


@pytest_asyncio.fixture
async def fake_model() -> AsyncIterator[FakeModel]:
    """A started FakeModel, stopped after the test."""
    async with FakeModel() as fake:
        yield fake
