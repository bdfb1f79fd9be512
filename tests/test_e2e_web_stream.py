"""The web API's streamed answers and history through the whole gateway (fake model).

Until the gateway asks channels for a ReplyStream (`Gateway.stream`, beside `deliver`), a
streamed request gets the whole reply as its `done` event; once it does, deltas must
come first, and they spell the reply."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from gateway.app import Gateway
from tests.conftest import GatewayFactory, chat, web_client
from tests.fakes.openai_server import FakeModel
from tests.test_web_api import Events


def _base(gw: Gateway) -> str:
    assert gw.http is not None
    return f"http://127.0.0.1:{gw.http.port}"


async def history(gw: Gateway, session: str, *, token: str | None = None, **params: str) -> tuple[int, Any]:
    """GET /api/history with the gateway's token (or `token`; "" sends none)."""
    token = gw.web_token if token is None else token
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as http:
        async with http.get(_base(gw) + "/api/history", params={"session": session, **params},
                            headers=headers) as resp:
            return resp.status, await resp.json()


async def test_a_streamed_request_ends_with_the_whole_reply(make_gateway: GatewayFactory,
                                                           fake_model: FakeModel) -> None:
    gw = await make_gateway()
    reply = "Here you go:\n\n```sh\nls -la\n```\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n猫 🐈"
    fake_model.reply(reply, delay=0.2)
    async with web_client(gw) as http:
        async with http.post(_base(gw) + "/api/chat",
                             json={"session": "sse-e2e", "text": "show me", "stream": True}) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            events = await Events(resp).rest()
    assert events[-1] == ("done", {"reply": reply})
    deltas = [data["text"] for event, data in events if event == "delta"]
    if hasattr(Gateway, "stream"):  # the gateway asks channels for streams (SPEC §5.1)
        assert deltas, "a streaming gateway sent no deltas to a request that asked for them"
    assert not deltas or "".join(deltas) == reply
    assert {event for event, _ in events} <= {"delta", "status", "done"}
    assert fake_model.requests[-1]["messages"][-1]["content"] == "show me"


async def test_history_shows_what_was_said_without_tool_traffic(make_gateway: GatewayFactory,
                                                               fake_model: FakeModel) -> None:
    gw = await make_gateway(channels={"web": {"token": "sekret-token"}})
    fake_model.tool_call("current_time", {})
    fake_model.reply("It is late.")
    fake_model.reply("Good night!")
    async with aiohttp.ClientSession() as http:
        for text in ("what time is it?", "then good night"):
            async with http.post(_base(gw) + "/api/chat", json={"session": "hist", "text": text},
                                 headers={"Authorization": "Bearer sekret-token"}) as resp:
                assert resp.status == 200
    status, body = await history(gw, "hist", token="sekret-token")
    assert status == 200
    assert [(m["role"], m["text"]) for m in body["messages"]] == [
        ("user", "what time is it?"), ("assistant", "It is late."),
        ("user", "then good night"), ("assistant", "Good night!")]
    assert all(isinstance(m["at"], float) for m in body["messages"])
    status, body = await history(gw, "hist", token="sekret-token", limit="2")
    assert [m["text"] for m in body["messages"]] == ["then good night", "Good night!"]
    assert (await history(gw, "hist", token=""))[0] == 401
    assert (await history(gw, "someone-else", token="sekret-token"))[1]["messages"] == []


async def test_a_reply_that_comes_after_the_page_left_is_in_the_history(make_gateway: GatewayFactory,
                                                                       fake_model: FakeModel) -> None:
    gw = await make_gateway()
    fake_model.reply("Sorry for the wait.", delay=0.5)
    async with web_client(gw) as http:
        resp = await http.post(_base(gw) + "/api/chat", json={"session": "left", "text": "hello?", "stream": True})
        assert resp.status == 200
        resp.close()  # the tab was closed while the agent worked
    async with asyncio.timeout(10):
        while True:
            _, body = await history(gw, "left")
            if len(body["messages"]) == 2:
                break
            await asyncio.sleep(0.1)
    assert [(m["role"], m["text"]) for m in body["messages"]] == [
        ("user", "hello?"), ("assistant", "Sorry for the wait.")]
    # The session goes on normally.
    fake_model.reply("Welcome back.")
    assert await chat(gw, "left", "back") == "Welcome back."
