"""Approvals (SPEC §5.7): a tool marked `ask` waits for an approver's yes before each call.
Any tool can be marked; these tests mark `current_time`, which every gateway has, so they
run where the exec sandbox cannot."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from gateway.app import Gateway
from tests.conftest import GatewayFactory, chat
from tests.fakes import telegram_server
from tests.fakes.openai_server import FakeModel
from tests.fakes.telegram_server import FakeTelegram
from tests.test_web_api import Events

fake_telegram = telegram_server.fake_telegram  # the fixture

ASK = {"tools": {"current_time": "ask"}}


def _base(gw: Gateway) -> str:
    assert gw.http is not None
    return f"http://127.0.0.1:{gw.http.port}"


def tool_result(request: dict[str, Any]) -> str:
    return str([m for m in request["messages"] if m["role"] == "tool"][-1]["content"])


async def answer(gw: Gateway, approval: str, session: str, decision: str) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{_base(gw)}/api/approvals/{approval}",
                             json={"session": session, "decision": decision}) as resp:
            return resp.status, await resp.json()


async def test_the_web_card_is_answered_by_an_approver_once(make_gateway: GatewayFactory,
                                                            fake_model: FakeModel) -> None:
    gw = await make_gateway(admins=["web:boss"], approvals=ASK)
    fake_model.tool_call("current_time", {"timezone": "Europe/Berlin"})
    fake_model.reply("It is noon.")
    async with aiohttp.ClientSession() as http:
        async with http.post(_base(gw) + "/api/chat",
                             json={"session": "boss", "text": "what time?", "stream": True}) as resp:
            events = Events(resp)
            event, card = await events.next(timeout=10)
            while event != "approval":
                event, card = await events.next(timeout=10)
            assert card["tool"] == "current_time" and '"timezone": "Europe/Berlin"' in card["arguments"]
            assert len(fake_model.requests) == 1  # nothing ran yet
            # Someone who is not an approver is refused and changes nothing.
            status, body = await answer(gw, card["id"], "eve", "allow")
            assert status == 200 and body["notice"] == "Only an admin can answer this."
            status, body = await answer(gw, card["id"], "boss", "allow")
            assert body["notice"] == "Allowed."
            status, body = await answer(gw, card["id"], "boss", "deny")  # a double click
            assert "decided already: Allowed by web:boss." in body["notice"]
            rest = await events.rest()
    assert ("approval_done", {"id": card["id"], "outcome": "Allowed by web:boss."}) in rest
    assert rest[-1] == ("done", {"reply": "It is noon."})
    assert "CET" in tool_result(fake_model.requests[-1])  # it ran, in the zone asked for
    assert gw.services is not None
    rows = await gw.services.store.run("SELECT decision, decided_by, session_key, tool FROM approvals")
    assert [tuple(r) for r in rows] == [("allow", "web:boss", "web:boss", "current_time")]


async def test_deny_by_text_and_a_timeout_reach_the_model_as_the_result(make_gateway: GatewayFactory,
                                                                       fake_model: FakeModel) -> None:
    gw = await make_gateway(admins=["web:boss"], approvals={**ASK, "timeout_s": 30})
    fake_model.tool_call("current_time", {})
    fake_model.reply("Fine, no time then.")
    asking = asyncio.ensure_future(chat(gw, "alice", "what time?"))
    assert gw.services is not None
    rows: list[Any] = []
    for _ in range(200):
        rows = await gw.services.store.run("SELECT id FROM approvals WHERE decision IS NULL")
        if rows:
            break
        await asyncio.sleep(0.05)
    (pending,) = rows
    assert "Only an admin" in await chat(gw, "alice", f"/deny {pending['id']}")  # not hers to answer
    assert await chat(gw, "boss", f"/deny {pending['id']}") == "Denied."
    assert await asyncio.wait_for(asking, 10) == "Fine, no time then."
    assert tool_result(fake_model.requests[-1]) == "error: the call was not run. Denied by web:boss."

    await gw.stop(timeout=5)
    gw = await make_gateway(admins=["web:boss"], approvals={**ASK, "timeout_s": 0.3})
    fake_model.tool_call("current_time", {})
    fake_model.reply("Nobody answered.")
    assert await chat(gw, "alice", "time?") == "Nobody answered."
    assert tool_result(fake_model.requests[-1]) == ("error: the call was not run. Denied: nobody answered "
                                                    "within 0.3 s.")


async def test_participants_answer_in_their_own_session(make_gateway: GatewayFactory, fake_model: FakeModel) -> None:
    gw = await make_gateway(approvals={**ASK, "approvers": "participants"})
    fake_model.tool_call("current_time", {})
    fake_model.reply("done")
    asking = asyncio.ensure_future(chat(gw, "carol", "time?"))
    assert gw.services is not None
    for _ in range(200):
        rows = await gw.services.store.run("SELECT id FROM approvals WHERE decision IS NULL")
        if rows:
            break
        await asyncio.sleep(0.05)
    approval = rows[0]["id"]
    assert (await answer(gw, approval, "mallory", "allow"))[1]["notice"].startswith("Only someone in that")
    assert (await answer(gw, approval, "carol", "allow"))[1]["notice"] == "Allowed."
    assert await asyncio.wait_for(asking, 10) == "done"


async def test_participants_of_the_delegating_session_answer_a_sub_turns_card(
        make_gateway: GatewayFactory, fake_model: FakeModel) -> None:
    """SPEC §5.7: a sub-turn's card (its session is `web:dora#sub:…`) is answered by the
    participants of the session that delegated, and by nobody else but an admin."""
    gw = await make_gateway(approvals={**ASK, "approvers": "participants"})
    fake_model.tool_call("delegate", {"task": "look at the clock"})
    fake_model.tool_call("current_time", {})  # the sub-turn's call: it asks
    fake_model.reply("the sub-turn saw the time")
    fake_model.reply("done")
    async with aiohttp.ClientSession() as http:
        async with http.post(_base(gw) + "/api/chat",
                             json={"session": "dora", "text": "time?", "stream": True}) as resp:
            events = Events(resp)
            event, card = await events.next(timeout=10)
            while event != "approval":
                event, card = await events.next(timeout=10)
            assert gw.services is not None
            rows = await gw.services.store.run("SELECT session_key FROM approvals WHERE id=?", (card["id"],))
            assert rows[0]["session_key"].startswith("web:dora#sub:")
            _, body = await answer(gw, card["id"], "mallory", "allow")
            assert body["notice"].startswith("Only someone in that")
            _, body = await answer(gw, card["id"], "dora", "allow")
            assert body["notice"] == "Allowed."
            rest = await events.rest()
    assert rest[-1] == ("done", {"reply": "done"})
    sub = [r for r in fake_model.requests if r["messages"][-1]["role"] == "tool"
           and r["messages"][1]["content"] == "look at the clock"]
    assert sub and not tool_result(sub[-1]).startswith("error:")  # the call ran, allowed by the delegator


async def test_a_restart_while_waiting_is_a_deny_and_the_card_says_so(
        make_gateway: GatewayFactory, fake_model: FakeModel, fake_telegram: FakeTelegram) -> None:
    section = {"telegram": {"enabled": True, "token": fake_telegram.token, "base_url": fake_telegram.base_url,
                            "base_file_url": fake_telegram.base_file_url, "poll_timeout_s": 1}}
    settings: dict[str, Any] = {"access": {"dm_policy": "open"}, "channels": section, "approvals": ASK,
                                "admins": ["telegram:1"]}
    gw = await make_gateway(**settings)
    fake_model.tool_call("current_time", {})
    fake_telegram.push_message(chat_id=5, user_id=5, text="time please")
    shown = await fake_telegram.wait_shown(5, lambda texts: any("Approval needed" in t for t in texts), timeout=10)
    card = next(t for t in shown if "Approval needed" in t)
    assert "/allow" in card and "current_time" in card
    await gw.stop(timeout=0)  # the gateway goes while the turn waits

    fake_model.reply("Answered after the restart.")
    gw = await make_gateway(**settings)
    await fake_telegram.wait_shown(5, lambda texts: any("restarted while this waited" in t for t in texts),
                                   timeout=10)
    assert gw.services is not None
    rows = await gw.services.store.run("SELECT decision FROM approvals")
    assert [r["decision"] for r in rows] == ["restart"]  # never a silent yes
    await fake_telegram.wait_shown(5, lambda texts: "Answered after the restart." in texts, timeout=10)
    assert "not run" in tool_result(fake_model.requests[-1])
