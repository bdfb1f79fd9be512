"""The web channel's streamed replies (Server-Sent Events) and history, on the wire.

WebChannel is served by a real aiohttp server and read by a real aiohttp client. The
turn is played by the test the way the agent drives a ReplyStream (SPEC §5.1): appends
over time, a tool status that replaces what was shown, then finish or fail."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from channels.base import ReplyStream
from channels.web.adapter import HistoryItem, WebChannel
from gateway.store.sqlite import Store
from gateway.types import Inbound, Message, ToolCall

TOKEN = "test-web-token-0123456789abcdef0123456789"


def client() -> aiohttp.ClientSession:
    """A client with the channel's token (SPEC §9: needed on loopback too)."""
    return aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"})


@dataclass
class Served:
    channel: WebChannel
    base: str
    inbound: asyncio.Queue[Inbound] = field(default_factory=asyncio.Queue)
    history_calls: list[tuple[str, int]] = field(default_factory=list)
    observed: list[str] = field(default_factory=list)

    async def next_inbound(self) -> Inbound:
        async with asyncio.timeout(5):
            return await self.inbound.get()


@pytest_asyncio.fixture
async def served() -> AsyncIterator[Served]:
    holder: dict[str, Served] = {}

    async def accept(inbound: Inbound) -> bool:
        holder["s"].inbound.put_nowait(inbound)
        return True

    async def history(session: str, limit: int,
                      before: tuple[int, int] | None) -> tuple[list[HistoryItem], tuple[int, int] | None]:
        holder["s"].history_calls.append((session, limit))
        return [HistoryItem("user", f"hi from {session}", 1.0), HistoryItem("assistant", "**hello**", 2.0)], None

    channel = WebChannel(accept, token=TOKEN, max_chars=10_000, reply_timeout_s=5, history=history,
                         observe=lambda name: holder["s"].observed.append(name), heartbeat_s=0.05)
    app = web.Application()
    app.router.add_routes(channel.routes())
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    await channel.start()
    holder["s"] = Served(channel, f"http://127.0.0.1:{port}")
    try:
        yield holder["s"]
    finally:
        await channel.stop()
        await runner.cleanup()


class Events:
    """Reads Server-Sent Events off a response as they arrive; comments are counted."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self.resp = resp
        self.comments: list[str] = []

    async def next(self, timeout: float = 5) -> tuple[str, dict[str, Any]]:
        event, data = "message", []
        async with asyncio.timeout(timeout):
            while True:
                raw = await self.resp.content.readline()
                if not raw:
                    raise EOFError("the stream ended")
                line = raw.decode().rstrip("\n")
                if line.startswith(":"):
                    self.comments.append(line[1:].strip())
                elif line.startswith("event: "):
                    event = line[7:]
                elif line.startswith("data: "):
                    data.append(line[6:])
                elif line == "" and data:
                    return event, json.loads("\n".join(data))

    async def rest(self) -> list[tuple[str, dict[str, Any]]]:
        out = []
        while True:
            try:
                out.append(await self.next())
            except EOFError:
                return out


async def open_stream(http: aiohttp.ClientSession, base: str, payload: dict[str, Any],
                      headers: dict[str, str] | None = None) -> aiohttp.ClientResponse:
    resp = await http.post(base + "/api/chat", json=payload, headers=headers or {})
    assert resp.status == 200, await resp.text()
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    assert resp.headers["Cache-Control"].startswith("no-store")
    return resp


def stream_for(served: Served, inbound: Inbound) -> ReplyStream:
    stream = served.channel.stream(inbound, on_ref=None, resume_ref=None)
    assert stream is not None
    assert isinstance(stream, ReplyStream)
    return stream


async def test_deltas_and_a_status_reach_the_client_as_they_happen(served: Served) -> None:
    async with client() as http:
        resp = await open_stream(http, served.base, {"session": "sse", "text": "hi", "stream": True})
        events = Events(resp)
        inbound = await served.next_inbound()
        stream = stream_for(served, inbound)
        assert served.observed == ["reply"]
        # Each piece is on the wire before the next is produced: the page sees it grow.
        await stream.append("Let me ")
        assert await events.next() == ("delta", {"text": "Let me "})
        await stream.append("check.")
        assert await events.next() == ("delta", {"text": "check."})
        await stream.status("reading notes.md…")
        assert await events.next() == ("status", {"text": "reading notes.md…"})
        reply = "Your notes say:\n\n```python\nprint('<b>')\n```\n\n猫 🐈 " + "x" * 12_000
        for start in range(0, len(reply), 997):
            await stream.append(reply[start:start + 997])
        await stream.finish(reply)
        rest = await events.rest()
        resp.close()
    deltas = [data["text"] for event, data in rest if event == "delta"]
    assert "".join(deltas) == reply  # after the status, the deltas spell exactly the answer
    assert rest[-1] == ("done", {"reply": reply})
    assert [event for event, _ in rest] == ["delta"] * len(deltas) + ["done"]
    assert "accepted" in events.comments


async def test_accept_header_alone_asks_for_a_stream(served: Served) -> None:
    async with client() as http:
        resp = await open_stream(http, served.base, {"session": "sse", "text": "hi"},
                                 headers={"Accept": "text/event-stream"})
        inbound = await served.next_inbound()
        await stream_for(served, inbound).finish("whole")
        assert await Events(resp).rest() == [("done", {"reply": "whole"})]
        resp.close()


async def test_without_stream_the_json_answer_is_unchanged(served: Served) -> None:
    async with client() as http:
        request = asyncio.create_task(http.post(served.base + "/api/chat", json={"session": "js", "text": "hi"}))
        inbound = await served.next_inbound()
        assert served.channel.stream(inbound) is None  # the gateway then uses send()
        await served.channel.send(inbound, "plain reply")
        async with await request as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("application/json")
            body = await resp.json()
    assert body["reply"] == "plain reply"


async def test_a_reply_sent_whole_ends_a_stream_too(served: Served) -> None:
    # Command replies and the gateway before streaming lands come through send().
    async with client() as http:
        resp = await open_stream(http, served.base, {"session": "cmd", "text": "/help", "stream": True})
        inbound = await served.next_inbound()
        await served.channel.send(inbound, "Commands: …")
        assert await Events(resp).rest() == [("done", {"reply": "Commands: …"})]
        resp.close()


async def test_fail_ends_with_an_error_event(served: Served) -> None:
    async with client() as http:
        resp = await open_stream(http, served.base, {"session": "f", "text": "hi", "stream": True})
        stream = stream_for(served, await served.next_inbound())
        await stream.append("partial")
        await stream.fail("The model is unavailable right now.")
        await stream.append("late")  # after the end: ignored
        events = await Events(resp).rest()
        resp.close()
    assert events[-1] == ("error", {"error": "The model is unavailable right now."})
    assert ("delta", {"text": "late"}) not in events


async def test_a_client_that_leaves_does_not_break_the_turn(served: Served) -> None:
    async with client() as http:
        resp = await open_stream(http, served.base, {"session": "gone", "text": "hi", "stream": True})
        inbound = await served.next_inbound()
        stream = stream_for(served, inbound)
        await stream.append("first")
        assert await Events(resp).next() == ("delta", {"text": "first"})
        resp.close()  # the person closed the tab
    # The request notices within a heartbeat and lets go; the turn never waits on it.
    async with asyncio.timeout(5):
        while True:
            if not served.channel._waiters:
                break
            await asyncio.sleep(0.02)
    async with asyncio.timeout(1):
        for i in range(1000):
            await stream.append(f"piece {i} ")
        await stream.status("writing notes.md…")
        await stream.finish("the whole reply")
    assert served.channel.stream(inbound) is None  # nobody to stream to any more
    # The channel goes on serving.
    async with client() as http:
        resp = await open_stream(http, served.base, {"session": "gone", "text": "again", "stream": True})
        await stream_for(served, await served.next_inbound()).finish("still here")
        assert await Events(resp).rest() == [("done", {"reply": "still here"})]
        resp.close()


async def test_quiet_streams_get_heartbeats_and_the_wait_times_out(served: Served) -> None:
    served.channel.reply_timeout_s = 0.4
    async with client() as http:
        resp = await open_stream(http, served.base, {"session": "slow", "text": "hi", "stream": True})
        inbound = await served.next_inbound()
        events = Events(resp)
        (event, data), = await events.rest()
        resp.close()
    assert event == "error" and "no reply in time" in data["error"]
    assert events.comments.count("keep-alive") >= 3  # every 0.05 s while nothing happened
    # The reply that comes later is not lost on the channel's side: it is stored by the
    # gateway and shows in the history; here, nothing is left waiting for it.
    assert served.channel.stream(inbound) is None
    await served.channel.send(inbound, "late reply")


async def test_shutdown_ends_an_open_stream_with_an_error(served: Served) -> None:
    async with client() as http:
        resp = await open_stream(http, served.base, {"session": "bye", "text": "hi", "stream": True})
        await served.next_inbound()
        await served.channel.stop()
        events = await Events(resp).rest()
        resp.close()
    assert events == [("error", {"error": "the gateway is shutting down"})]


async def test_a_refused_message_gets_a_plain_json_error(served: Served) -> None:
    async with client() as http:
        async with http.post(served.base + "/api/chat", json={"session": "x", "text": "", "stream": True}) as resp:
            assert resp.status == 400
            assert "text" in (await resp.json())["error"]


async def test_history_endpoint(served: Served) -> None:
    async with client() as http:
        async with http.get(served.base + "/api/history", params={"session": "alice", "limit": "7"}) as resp:
            assert resp.status == 200
            body = await resp.json()
        assert body == {"session": "alice", "messages": [
            {"role": "user", "text": "hi from alice", "at": 1.0, "kind": "message"},
            {"role": "assistant", "text": "**hello**", "at": 2.0, "kind": "message"}], "before": None}
        assert served.history_calls == [("alice", 7)]
        for params in ({"session": "../etc"}, {"session": "alice\n"}, {"session": "a", "limit": "0"},
                       {"session": "a", "limit": "201"}, {"session": "a", "limit": "ten"},
                       {"session": "a", "before": "12"}, {"session": "a", "before": "1.2; drop"}):
            async with http.get(served.base + "/api/history", params=params) as resp:
                assert resp.status == 400, params
        served.channel.token = "sekret-rotated-0123456789abcdef0123"
        async with http.get(served.base + "/api/history", params={"session": "alice"}) as resp:
            assert resp.status == 401
        async with http.get(served.base + "/api/history", params={"session": "alice"},
                            headers={"Authorization": "Bearer sekret-rotated-0123456789abcdef0123"}) as resp:
            assert resp.status == 200
    assert served.history_calls == [("alice", 7), ("alice", 50)]


async def test_answers_that_carry_the_conversation_are_never_stored_by_a_cache(served: Served) -> None:
    async with client() as http:
        async with http.get(served.base + "/api/history", params={"session": "alice"}) as resp:
            assert resp.status == 200 and resp.headers["Cache-Control"] == "no-store"
        request = asyncio.create_task(http.post(served.base + "/api/chat", json={"session": "js", "text": "hi"}))
        await served.channel.send(await served.next_inbound(), "a private answer")
        async with await request as resp:
            assert resp.status == 200 and resp.headers["Cache-Control"] == "no-store"
        resp = await open_stream(http, served.base, {"session": "sse", "text": "hi", "stream": True})
        assert resp.headers["Cache-Control"].split(",")[0] == "no-store"
        await served.channel.send(await served.next_inbound(), "streamed")
        await Events(resp).rest()
        resp.close()
        async with http.get(served.base + "/api/history", params={"session": "a", "limit": "0"}) as resp:
            assert resp.status == 400 and resp.headers["Cache-Control"] == "no-store"  # errors too


async def test_page_and_its_files_are_served_with_a_strict_policy(served: Served) -> None:
    async with client() as http:
        async with http.get(served.base + "/") as resp:
            assert resp.status == 200
            csp = resp.headers["Content-Security-Policy"]
            page = await resp.text()
        assert "script-src 'self'" in csp and "unsafe-inline" not in csp.split("script-src")[1].split(";")[0]
        assert "<script>" not in page  # every script is a file, so the policy can forbid inline ones
        for path, kind in (("static/app.js", "text/javascript"), ("static/app.css", "text/css"),
                           ("static/favicon.svg", "image/svg+xml"), ("static/vendor/marked.umd.js", "text/javascript"),
                           ("static/vendor/purify.min.js", "text/javascript"),
                           ("static/vendor/marked.license.txt", "text/plain")):
            assert path in page or "license" in path
            async with http.get(f"{served.base}/{path}") as resp:
                assert resp.status == 200, path
                assert resp.headers["Content-Type"].startswith(kind)
                etag = resp.headers["ETag"]
            async with http.get(f"{served.base}/{path}", headers={"If-None-Match": etag}) as resp:
                assert resp.status == 304
        for path in ("static/vendor/..%2F..%2Fweb.py", "static/index.html", "static/vendor/README.md",
                     "static/nope.js"):
            async with http.get(f"{served.base}/{path}") as resp:
                assert resp.status == 404, path


async def test_store_chat_history_is_what_the_person_saw(store: Store) -> None:
    key = "web:hist"
    await store.ensure_session(key, key, "web")
    seq = 0

    async def add(msg: Message) -> None:
        nonlocal seq
        seq += 1
        await store.add_message(key, msg, seq=seq)

    for turn in range(1, 5):
        await add(Message(role="user", content=f"question {turn}", turn=turn))
        await add(Message(role="assistant", content="", turn=turn,
                          tool_calls=(ToolCall(id=f"c{turn}", name="read_file", arguments="{}"),)))
        await add(Message(role="tool", content="file text", turn=turn, tool_call_id=f"c{turn}", tool_name="read_file"))
        await add(Message(role="user", content="[gateway note]", turn=turn, injected=True))
        await add(Message(role="assistant", content=f"answer {turn}", turn=turn))
    await add(Message(role="user", content="question 5", turn=5))  # being answered
    await store.add_message("web:other", Message(role="user", content="not mine", turn=1), seq=1)

    everything = await store.chat_history(key, limit=100)
    assert [m.content for m in everything] == [
        "question 1", "answer 1", "question 2", "answer 2", "question 3", "answer 3",
        "question 4", "answer 4", "question 5"]
    latest = await store.chat_history(key, limit=3)
    assert [(m.role, m.content) for m in latest] == [
        ("user", "question 4"), ("assistant", "answer 4"), ("user", "question 5")]
    assert await store.chat_history("web:nobody", limit=5) == []


@pytest.mark.parametrize("payload", [{"stream": "yes"}, {"stream": 1}])
async def test_stream_must_be_true_to_ask(served: Served, payload: dict[str, Any]) -> None:
    async with client() as http:
        request = asyncio.create_task(http.post(served.base + "/api/chat",
                                                json={"session": "t", "text": "hi", **payload}))
        inbound = await served.next_inbound()
        assert served.channel.stream(inbound) is None
        await served.channel.send(inbound, "json")
        async with await request as resp:
            assert (await resp.json())["reply"] == "json"


async def test_a_client_that_stops_reading_is_dropped_in_time(served: Served) -> None:
    served.channel.reply_timeout_s = 0.3
    served.channel.stuck_write_s = 0.3
    async with client() as http:
        resp = await open_stream(http, served.base, {"session": "stuck", "text": "hi", "stream": True})
        stream = stream_for(served, await served.next_inbound())
        # Far more than the socket buffers hold, and the client never reads a byte.
        async with asyncio.timeout(10):
            for _ in range(64):
                await stream.append("x" * 1_000_000)
        # Dropped at the reply's deadline plus the stuck-write allowance (0.6 s here); the
        # bound below only guards against never.
        async with asyncio.timeout(15):
            while True:
                if not served.channel._waiters:
                    break
                await asyncio.sleep(0.05)
        await stream.finish("x" * 64_000_000)  # nobody is listening: a no-op, no error
        resp.close()


async def test_every_api_route_needs_the_token_and_the_page_s_shell_does_not(served: Served) -> None:
    """SPEC §9, issue 31: loopback and no foreign Origin prove nothing (a sandbox with the
    network on is on this machine too); every /api route, present or added later, wants the token."""
    api = [(route.method, route.path) for route in served.channel.routes() if route.path.startswith("/api/")]
    assert len(api) >= 4
    async with aiohttp.ClientSession() as http:
        for method, path in api:
            url = served.base + path.replace("{id}", "abcdef") + "?session=alice"
            async with http.request(method, url, json={"session": "alice", "text": "hi", "decision": "allow"}) as resp:
                assert resp.status == 401, (method, path)
                assert "web-link" in (await resp.json())["error"]
        async with http.get(served.base + "/") as resp:
            assert resp.status == 200 and "<script" in await resp.text()
    assert served.inbound.empty() and served.history_calls == []
    with pytest.raises(ValueError):
        WebChannel(served.channel.handler, token="", max_chars=10, reply_timeout_s=1)
