"""End to end through the web API: the real gateway, the real openai SDK, a fake model."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from gateway.app import Gateway
from gateway.turns.router import BUSY_REPLY
from tests.conftest import GatewayFactory, chat, post_chat, web_client
from tests.fakes.openai_server import FakeModel, Reply, ScriptedCall, last_user_text


def _texts(request: dict) -> list[str]:
    return [m.get("content") or "" for m in request["messages"]]


async def test_round_trip_reaches_the_model(make_gateway: GatewayFactory, fake_model: FakeModel) -> None:
    gw = await make_gateway()
    fake_model.reply("Hello, Alice!")
    assert await chat(gw, "alice", "hi there") == "Hello, Alice!"
    (request,) = await fake_model.wait_requests(1)
    assert request["messages"][0]["role"] == "system"
    assert request["messages"][-1] == {"role": "user", "content": "hi there"}
    assert {t["function"]["name"] for t in request["tools"]} >= {"read_file", "current_time"}


async def test_tool_calling_turn(make_gateway: GatewayFactory, fake_model: FakeModel) -> None:
    gw = await make_gateway()
    fake_model.tool_call("current_time", {}, call_id="call_t1")
    fake_model.reply("It is late.")
    assert await chat(gw, "bob", "what time is it?") == "It is late."
    _first, second = await fake_model.wait_requests(2)
    tool_msgs = [m for m in second["messages"] if m["role"] == "tool"]
    assert len(tool_msgs) == 1 and tool_msgs[0]["tool_call_id"] == "call_t1"
    assert "(" in tool_msgs[0]["content"]  # an ISO time with the weekday in brackets
    assistant = [m for m in second["messages"] if m["role"] == "assistant"]
    assert assistant[-1]["tool_calls"][0]["function"]["name"] == "current_time"


async def test_unknown_tool_and_bad_arguments_get_error_results(
    make_gateway: GatewayFactory, fake_model: FakeModel
) -> None:
    gw = await make_gateway()
    fake_model.tool_calls([("no_such_tool", {}), ("read_file", "{not json")])
    fake_model.reply("recovered")
    assert await chat(gw, "carol", "go") == "recovered"
    _, second = await fake_model.wait_requests(2)
    results = [m["content"] for m in second["messages"] if m["role"] == "tool"]
    assert results[0].startswith("error: there is no tool named 'no_such_tool'")
    assert results[1].startswith("error: the arguments are not a valid JSON object")


async def test_step_cap_lets_every_step_call_tools_then_asks_once_without_tools(
    make_gateway: GatewayFactory, fake_model: FakeModel
) -> None:
    gw = await make_gateway(agent_max_steps=3)

    def insist_on_tools(body: dict[str, Any]) -> Reply:
        # A model that always wants another tool, as long as it is offered any.
        if body.get("tools"):
            return Reply(tool_calls=(ScriptedCall("current_time", "{}", f"call_{len(fake_model.requests)}"),))
        return Reply(text="Here is what I found so far.")

    fake_model.respond_with(insist_on_tools)
    reply = await chat(gw, "dave", "loop forever")
    requests = fake_model.requests
    assert len(requests) == 4  # 3 tool-calling steps, then one answer-now call
    assert all(r.get("tools") for r in requests[:3])
    assert "tools" not in requests[3] and "tool_choice" not in requests[3]
    assert "step limit" in last_user_text(requests[3])  # the injected answer-now instruction
    assert sum(m["role"] == "tool" for m in requests[3]["messages"]) == 3  # all 3 steps' tools ran
    assert reply == "Here is what I found so far."
    assert gw.services is not None
    stored = await gw.services.store.messages("web:dave")
    assert stored[-1].role == "assistant" and stored[-1].content == reply and not stored[-1].tool_calls


async def test_step_cap_never_answers_with_a_placeholder(
    make_gateway: GatewayFactory, fake_model: FakeModel
) -> None:
    gw = await make_gateway(agent_max_steps=2)
    for _ in range(3):  # the third call has no tools; a provider that still sends no text
        fake_model.tool_call("current_time", {})
    reply = await chat(gw, "dora", "loop")
    assert len(fake_model.requests) == 3 and "tools" not in fake_model.requests[2]
    assert "empty answer" not in reply and "2 steps" in reply


async def test_rate_limit_then_success(make_gateway: GatewayFactory, fake_model: FakeModel) -> None:
    gw = await make_gateway()
    fake_model.error(429, {"error": {"message": "Rate limit reached", "type": "requests",
                                     "code": "rate_limit_exceeded"}}, headers={"Retry-After": "0"})
    fake_model.reply("after the wait")
    assert await chat(gw, "erin", "hello") == "after the wait"
    assert len(fake_model.requests) == 2


async def test_model_timeout_gives_a_clear_reply(make_gateway: GatewayFactory, fake_model: FakeModel) -> None:
    gw = await make_gateway(model=fake_model.model_settings(timeout_s=0.3, max_retries=0))
    fake_model.hang(5)
    reply = await chat(gw, "frank", "are you there?")
    assert "too long" in reply.lower()
    assert "Traceback" not in reply


async def test_missing_api_key_names_the_setting(make_gateway: GatewayFactory, fake_model: FakeModel) -> None:
    gw = await make_gateway(model=fake_model.model_settings(api_key="${SURELY_UNSET_GATEWAY_KEY}"))
    reply = await chat(gw, "gina", "hello?")
    assert "OPENAI_API_KEY" in reply or "model.api_key" in reply
    assert fake_model.requests == []


async def test_restart_keeps_messages_and_restores_context(
    make_gateway: GatewayFactory, fake_model: FakeModel, tmp_path
) -> None:
    gw = await make_gateway()
    fake_model.reply("Noted: your cat is Miso.")
    await chat(gw, "hana", "my cat is called Miso")
    await gw.stop()
    gw2 = await make_gateway()
    assert gw2.services is not None
    assert await gw2.services.store.count_messages("web:hana") == 2
    fake_model.reply("Miso!")
    assert await chat(gw2, "hana", "what is my cat called?") == "Miso!"
    last = fake_model.requests[-1]
    assert "my cat is called Miso" in " ".join(_texts(last))


async def test_bad_input_gets_clear_http_errors_and_leaves_session_intact(
    make_gateway: GatewayFactory, fake_model: FakeModel
) -> None:
    gw: Gateway = await make_gateway(channels={"web": {"token": "sekret-token"}})
    fake_model.reply("first answer")
    status, body = await post_chat(gw, {"session": "ivy", "text": "hello"}, token="sekret-token")
    assert status == 200 and body["reply"] == "first answer"
    assert gw.services is not None
    before = await gw.services.store.messages("web:ivy")

    cases = [
        ({"session": "ivy", "text": ""}, None, 400),
        ({"session": "ivy", "text": "x" * 1_000_000}, None, 413),
        ({"session": "../etc", "text": "hi"}, None, 400),
        ({"session": "ivy"}, None, 400),
        (None, b"{not json", 400),
        (None, b"[1, 2]", 400),
    ]
    for payload, raw, expected in cases:
        status, body = await post_chat(gw, payload, token="sekret-token", raw=raw)
        assert status == expected, (payload, raw, body)
        assert body["error"]
    status, body = await post_chat(gw, {"session": "ivy", "text": "hi"}, token="wrong")
    assert status == 401 and "token" in body["error"]
    status, body = await post_chat(gw, {"session": "ivy", "text": "hi"}, token="")
    assert status == 401

    assert await gw.services.store.messages("web:ivy") == before
    fake_model.reply("still here")
    status, body = await post_chat(gw, {"session": "ivy", "text": "again"}, token="sekret-token")
    assert status == 200 and body["reply"] == "still here"
    assert "hello" in " ".join(_texts(fake_model.requests[-1]))


async def test_health_ready_and_metrics(make_gateway: GatewayFactory, fake_model: FakeModel) -> None:
    gw = await make_gateway()
    fake_model.reply("ok")
    await chat(gw, "jo", "ping")
    assert gw.http is not None
    base = f"http://127.0.0.1:{gw.http.port}"
    async with aiohttp.ClientSession() as http:
        async with http.get(base + "/healthz") as resp:
            assert resp.status == 200
        async with http.get(base + "/readyz") as resp:
            body = await resp.json()
            assert resp.status == 200 and body["checks"]["database"] is True
        async with http.get(base + "/metrics") as resp:
            text = await resp.text()
    assert 'gateway_inbound_messages_total{channel="web"} 1.0' in text
    assert 'gateway_turns_total{channel="web",outcome="ok"} 1.0' in text
    # The turn's user message and reply, by group commit (one commit each: one session).
    assert 'gateway_db_rows_written_total{table="messages"} 2.0' in text
    assert 'gateway_db_commits_total{table="messages"} 2.0' in text
    assert "gateway_db_wal_checkpoints_total" in text
    assert "test-key" not in text


async def test_sessions_do_not_see_each_other(make_gateway: GatewayFactory, fake_model: FakeModel) -> None:
    gw = await make_gateway()
    fake_model.reply("one")
    fake_model.reply("two")
    await chat(gw, "kim", "secret of kim: 4242")
    await chat(gw, "lee", "hello")
    assert "4242" not in " ".join(_texts(fake_model.requests[1]))


async def test_a_repeated_request_id_is_answered_once(make_gateway: GatewayFactory, fake_model: FakeModel) -> None:
    gw = await make_gateway()
    fake_model.reply("answered once")
    status, body = await post_chat(gw, {"session": "rid", "text": "hello", "id": "req-1"})
    assert status == 200 and body["reply"] == "answered once"
    status, body = await post_chat(gw, {"session": "rid", "text": "hello", "id": "req-1"})
    assert status == 409 and "already received" in body["error"]
    assert len(fake_model.requests) == 1


@pytest.mark.parametrize("name", ["alice\n", "alice ", " alice", "al\tice", "al\x00ice", "a" * 65, "", "élise"])
async def test_session_names_are_validated(make_gateway: GatewayFactory, fake_model: FakeModel, name: str) -> None:
    gw = await make_gateway()
    status, body = await post_chat(gw, {"session": name, "text": "hi"})
    assert status == 400 and "session must be" in body["error"], (name, body)
    assert fake_model.requests == []
    assert gw.services is not None and await gw.services.store.count_sessions() == 0


async def test_a_message_refused_as_busy_can_be_retried_with_its_id(
    make_gateway: GatewayFactory, fake_model: FakeModel
) -> None:
    gw = await make_gateway(limits={"session_queue_size": 1})
    fake_model.reply("first answer", delay=0.5)
    first = asyncio.create_task(post_chat(gw, {"session": "busy", "text": "one", "id": "m1"}))
    await fake_model.wait_requests(1)  # "one" is running
    second = asyncio.create_task(post_chat(gw, {"session": "busy", "text": "two", "id": "m2"}))
    async with asyncio.timeout(5):
        while gw.sessions.queued() < 1:  # noqa: ASYNC110 - "two" waits in the (full) queue
            await asyncio.sleep(0.01)
    status, body = await post_chat(gw, {"session": "busy", "text": "three", "id": "m3"})
    assert status == 200 and body["reply"] == BUSY_REPLY
    assert [(await first)[1]["reply"], (await second)[1]["reply"]] == ["first answer", "echo: two"]

    status, body = await post_chat(gw, {"session": "busy", "text": "three", "id": "m3"})
    assert status == 200 and body["reply"] == "echo: three", body
    status, body = await post_chat(gw, {"session": "busy", "text": "three", "id": "m3"})
    assert status == 409 and "already received" in body["error"]  # answered now: a duplicate
    assert gw.services is not None
    stored = await gw.services.store.messages("web:busy")
    assert [m.content for m in stored if m.role == "user"] == ["one", "two", "three"]


async def test_a_long_session_s_history_comes_in_bounded_pages(make_gateway: GatewayFactory) -> None:
    """A 2.4 MB session: no history answer holds much more than a page of text, and a client
    reads all of it by following `before`."""
    from channels.web.adapter import HISTORY_MAX
    from gateway.types import Message

    page_bytes = 256_000 + 20_000  # a page's text (gateway.store.rows.HISTORY_PAGE_CHARS) and its JSON

    gw = await make_gateway()
    assert gw.services is not None and gw.http is not None
    store = gw.services.store
    await store.ensure_session("web:big", "web:big", "web")
    texts = []
    for turn in range(1, 61):  # 120 messages of 20,000 characters
        for seq, role in enumerate(("user", "assistant")):
            texts.append(f"{role} {turn} " + "x" * 20_000)
            await store.add_message("web:big", Message(role=role, content=texts[-1], turn=turn), seq=seq)
    got: list[str] = []
    sizes = []
    params = {"session": "big", "limit": str(HISTORY_MAX)}
    async with web_client(gw) as http:
        while True:
            async with http.get(f"http://127.0.0.1:{gw.http.port}/api/history", params=params) as resp:
                assert resp.status == 200
                raw = await resp.read()
                body = await resp.json()
            sizes.append(len(raw))
            got[:0] = [m["text"] for m in body["messages"]]
            if body.get("before") is None:
                break
            params["before"] = body["before"]
    assert max(sizes) <= page_bytes and len(sizes) >= 2_400_000 // page_bytes, sizes
    assert got == texts  # all of it, in order, once
