"""The whole gateway with the real slack-bolt against the fake Slack API: Socket Mode DMs,
top-level and thread sessions, memory scopes of shared threads, twins and retries
answered once, signed HTTP events."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import aiohttp

from gateway.app import Gateway
from gateway.keys import workspace_dir
from gateway.types import Inbound
from tests.conftest import GatewayFactory
from tests.fakes import slack_server
from tests.fakes.openai_server import FakeModel
from tests.fakes.slack_server import FakeSlack, event_callback, signed_event_request

fake_slack = slack_server.fake_slack  # the fixture

SIGNING = "signing-secret-xyz"


def slack_section(fake: FakeSlack, **extra: Any) -> dict[str, Any]:
    return {"slack": {"enabled": True, "bot_token": fake.bot_token, "app_token": fake.app_token,
                      "base_url": fake.base_url, **extra}}


def _mention(fake: FakeSlack, ts: str, text: str, *, user: str = "U5", thread_ts: str | None = None,
             kind: str = "app_mention") -> dict[str, Any]:
    event = {"type": kind, "user": user, "text": f"<@{fake.bot_user_id}> {text}", "ts": ts, "channel": "C1",
             "channel_type": "channel"}
    if thread_ts:
        event["thread_ts"] = thread_ts
    return event


async def test_dm_and_threads_over_socket_mode(make_gateway: GatewayFactory, fake_model: FakeModel,
                                               fake_slack: FakeSlack) -> None:
    gw = await make_gateway(access={"dm_policy": "open", "allow_from": ["slack:C1"]},
                            channels=slack_section(fake_slack, reply_to_mode="channel"))
    await fake_slack.wait_connected()
    fake_model.reply("dm answer")
    env = await fake_slack.push_event({"type": "message", "channel_type": "im", "user": "U5", "text": "hello",
                                       "ts": "100.1", "channel": "D5"})
    await fake_slack.wait_acked(env)
    # Replies stream (update mode at the top level, native in threads): wait for what people see.
    await fake_slack.wait_for(lambda: fake_slack.visible("D5") == ["dm answer"])

    # Top-level mentions: one session per (channel, person), answered where they were asked.
    fake_model.reply("top one")
    fake_model.reply("top two")
    await fake_slack.push_event(_mention(fake_slack, "200.1", "first question"))
    await fake_slack.wait_for(lambda: fake_slack.visible("C1") == ["top one"])
    await fake_slack.push_event(_mention(fake_slack, "300.1", "second question"))
    await fake_slack.wait_for(lambda: fake_slack.visible("C1") == ["top one", "top two"])  # at the top level
    assert "first question" in str(fake_model.requests[2]["messages"])  # the same conversation
    # A thread is a conversation of its own, answered in the thread.
    fake_model.reply("in the thread")
    await fake_slack.push_event(_mention(fake_slack, "301.1", "a side question", thread_ts="300.1"))
    await fake_slack.wait_for(lambda: fake_slack.visible("C1", "300.1") == ["in the thread"])
    assert "first question" not in str(fake_model.requests[3]["messages"])
    assert gw.services is not None
    store = gw.services.store
    assert await store.count_messages("slack:dm:D5") == 2
    assert await store.count_messages("slack:channel:C1:user:U5") == 4
    assert await store.count_messages("slack:channel:C1:thread:300.1") == 2


async def test_a_mention_is_answered_in_its_thread_which_continues_it(
        make_gateway: GatewayFactory, fake_model: FakeModel, fake_slack: FakeSlack) -> None:
    """`reply_to_mode: "thread"` (the default): a top-level mention is answered in a thread
    under it, streamed there, and opens that thread's session; a follow-up in the thread sees
    the first exchange; another mention opens another thread with a fresh session."""
    gw = await make_gateway(access={"allow_from": ["slack:C1"]}, channels=slack_section(fake_slack))
    await fake_slack.wait_connected()
    fake_model.reply("Nice to meet you, Ada.")
    await fake_slack.push_event(_mention(fake_slack, "200.1", "my name is Ada"))
    await fake_slack.wait_for(lambda: fake_slack.visible("C1", "200.1") == ["Nice to meet you, Ada."])
    assert fake_slack.visible("C1") == []  # nothing at the top level
    (stream,) = fake_slack.method_calls("chat.startStream")  # native streaming, in the thread
    assert stream["thread_ts"] == "200.1" and stream["recipient_user_id"] == "U5"

    fake_model.reply("You are Ada.")
    await fake_slack.push_event(_mention(fake_slack, "201.1", "what is my name?", user="U6", thread_ts="200.1"))
    await fake_slack.wait_for(lambda: fake_slack.visible("C1", "200.1") == ["Nice to meet you, Ada.", "You are Ada."])
    follow_up = json.dumps(fake_model.requests[1]["messages"])
    assert "my name is Ada" in follow_up and "Nice to meet you, Ada." in follow_up

    fake_model.reply("Hello, stranger.")
    await fake_slack.push_event(_mention(fake_slack, "300.1", "who am I?"))
    await fake_slack.wait_for(lambda: fake_slack.visible("C1", "300.1") == ["Hello, stranger."])
    assert "Ada" not in json.dumps(fake_model.requests[2]["messages"])
    assert gw.services is not None
    store = gw.services.store
    assert await store.count_messages("slack:channel:C1:thread:200.1") == 4
    assert await store.count_messages("slack:channel:C1:thread:300.1") == 2
    assert await store.count_messages("slack:channel:C1:user:U5") == 0


async def test_a_mention_accepted_before_the_upgrade_is_answered_where_it_was_asked(
        make_gateway: GatewayFactory, fake_model: FakeModel, fake_slack: FakeSlack, tmp_path: Path) -> None:
    """A top-level mention stored (accepted, unanswered) by a gateway that answered at the
    top level still belongs to the channel's session after the upgrade: it is answered
    there, and that session's history is kept."""
    from gateway.store.sqlite import Store
    from gateway.types import Message, inbound_to_dict

    store = await Store.open(tmp_path / "data" / "gateway.sqlite3")
    key = "slack:channel:C1:user:U5"
    await store.ensure_session(key, "slack:group:C1:user:U5", "slack")
    await store.add_message(key, Message(role="user", content="the code word is tangerine", turn=1), seq=0)
    await store.add_message(key, Message(role="assistant", content="noted", turn=1), seq=1)
    old = Inbound(channel="slack", chat_id="C1", user_id="U5", text="what is the code word?", event_id="C1:150.1",
                  message_id="150.1", is_group=True, mentioned=True)
    await store.record_event("slack", "C1:150.1", session_key=key, inbound=inbound_to_dict(old))
    await store.close()

    fake_model.reply("tangerine")
    await make_gateway(access={"allow_from": ["slack:C1"]}, channels=slack_section(fake_slack))
    await fake_slack.wait_for(lambda: fake_slack.visible("C1") == ["tangerine"])
    assert "the code word is tangerine" in json.dumps(fake_model.requests[0]["messages"])


async def test_group_mode_shares_the_channels_top_level(make_gateway: GatewayFactory, fake_model: FakeModel,
                                                        fake_slack: FakeSlack) -> None:
    gw = await make_gateway(access={"allow_from": ["slack:C1"]}, group_session_scope="group",
                            channels=slack_section(fake_slack, reply_to_mode="channel"))
    await fake_slack.wait_connected()
    await fake_slack.push_event(_mention(fake_slack, "200.1", "the plan is blue", user="U5"))
    await fake_slack.wait_posted(1)
    await fake_slack.push_event(_mention(fake_slack, "210.1", "what is the plan?", user="U6"))
    posted = await fake_slack.wait_posted(2)
    assert "the plan is blue" in str(fake_model.requests[1]["messages"])
    assert all("thread_ts" not in p for p in posted)
    assert gw.services is not None
    assert await gw.services.store.count_messages("slack:channel:C1") == 4


A_SECRET = "Alice's locker code is 4312"
B_FACT = "Bob prefers tea"


async def test_a_thread_never_uses_one_persons_memory(make_gateway: GatewayFactory, fake_model: FakeModel,
                                                      fake_slack: FakeSlack) -> None:
    """Alice (U5) keeps a secret from the channel's top level, then talks in a thread on her
    message; Bob (U6) joins the thread. Bob's turns never see Alice's MEMORY.md (prompt or
    read_file) and his memory_write lands in the channel's scope (SPEC §1, shared session)."""
    gw = await make_gateway(access={"allow_from": ["slack:C1"]},
                            channels=slack_section(fake_slack, reply_to_mode="channel"))
    assert gw.services is not None
    await fake_slack.wait_connected()
    fake_model.tool_call("memory_write", {"text": A_SECRET, "target": "memory"})
    fake_model.reply("noted")
    await fake_slack.push_event(_mention(fake_slack, "200.1", "remember my locker code", user="U5"))
    await fake_slack.wait_for(lambda: fake_slack.visible("C1") == ["noted"])
    fake_model.reply("hi Alice")
    await fake_slack.push_event(_mention(fake_slack, "201.1", "hello thread", user="U5", thread_ts="200.1"))
    await fake_slack.wait_for(lambda: fake_slack.visible("C1", "200.1") == ["hi Alice"])
    mark = len(fake_model.requests)
    fake_model.tool_call("read_file", {"path": "MEMORY.md"})
    fake_model.tool_call("memory_write", {"text": B_FACT, "target": "memory"})
    fake_model.reply("done")
    await fake_slack.push_event(_mention(fake_slack, "202.1", "what do you know?", user="U6", thread_ts="200.1"))
    await fake_slack.wait_for(lambda: fake_slack.visible("C1", "200.1") == ["hi Alice", "done"])

    bobs = fake_model.requests[mark:]
    assert len(bobs) == 3
    # Requests 0-1 are Alice's own top-level session; from 2 on the thread's (hers, then Bob's).
    assert "4312" in json.dumps(fake_model.requests[1])
    for request in fake_model.requests[2:]:
        assert "4312" not in json.dumps(request), "Alice's memory reached a shared session"
    read_result = [m for m in bobs[1]["messages"] if m["role"] == "tool"][-1]["content"]
    assert "4312" not in read_result

    data_dir = gw.services.data_dir
    alices = (workspace_dir(data_dir, "slack:group:C1:user:U5") / "MEMORY.md").read_text()
    channels = (workspace_dir(data_dir, "slack:group:C1") / "MEMORY.md").read_text()
    assert A_SECRET in alices and B_FACT not in alices
    assert B_FACT in channels and A_SECRET not in channels


async def test_twins_and_retries_give_one_reply(make_gateway: GatewayFactory, fake_model: FakeModel,
                                                fake_slack: FakeSlack) -> None:
    gw = await make_gateway(access={"allow_from": ["slack:C1"]}, channels=slack_section(fake_slack))
    await fake_slack.wait_connected()
    fake_model.reply("once")
    await fake_slack.push_event(_mention(fake_slack, "400.1", "hi"), event_id="EvA")
    await fake_slack.push_event(_mention(fake_slack, "400.1", "hi", kind="message"), event_id="EvB")
    last = await fake_slack.push_event(_mention(fake_slack, "400.1", "hi"), event_id="EvA", retry_num=1)
    await fake_slack.wait_acked(last)
    await fake_slack.wait_for(lambda: fake_slack.visible("C1", "400.1") == ["once"])  # in the mention's thread
    assert gw.services is not None
    await gw.services.background.wait_idle(5)
    assert fake_slack.visible("C1", "400.1") == ["once"] and fake_slack.visible("C1") == []
    assert len(fake_model.requests) == 1


async def _post_events(gw: Gateway, body: bytes, headers: dict[str, str]) -> int:
    assert gw.http is not None
    async with aiohttp.ClientSession() as http:
        async with http.post(f"http://127.0.0.1:{gw.http.port}/slack/events", data=body, headers=headers) as r:
            return r.status


async def test_http_events_are_signature_checked(make_gateway: GatewayFactory, fake_model: FakeModel,
                                                 fake_slack: FakeSlack) -> None:
    gw = await make_gateway(access={"allow_from": ["slack:C1"]},
                            channels=slack_section(fake_slack, mode="http", signing_secret=SIGNING))
    fake_model.reply("signed and answered")
    event = event_callback(_mention(fake_slack, "500.1", "over http"))
    assert await _post_events(gw, *signed_event_request(SIGNING, event, forge=True)) == 401
    stale = int(time.time()) - 600
    assert await _post_events(gw, *signed_event_request(SIGNING, event, timestamp=stale)) == 401
    assert fake_model.requests == []
    assert await _post_events(gw, *signed_event_request(SIGNING, event)) == 200
    assert await _post_events(gw, *signed_event_request(SIGNING, event, retry_num=1)) == 200
    await fake_slack.wait_for(lambda: fake_slack.visible("C1", "500.1") == ["signed and answered"])
    assert gw.services is not None
    await gw.services.background.wait_idle(5)
    assert len(fake_slack.messages) == 1


async def test_slash_command_context(make_gateway: GatewayFactory, fake_model: FakeModel,
                                     fake_slack: FakeSlack) -> None:
    await make_gateway(access={"dm_policy": "open"}, channels=slack_section(fake_slack))
    await fake_slack.wait_connected()
    env = await fake_slack.push_slash_command("/context", "", user="U5", channel="D5")
    await fake_slack.wait_acked(env)
    await fake_slack.wait_for(lambda: fake_slack.responses or fake_slack.ephemeral)
    answer = (fake_slack.responses or fake_slack.ephemeral)[0]
    assert "token" in str(answer).lower()
    assert fake_model.requests == []  # commands never call the model


async def test_a_strangers_file_is_never_downloaded(make_gateway: GatewayFactory, fake_model: FakeModel,
                                                    fake_slack: FakeSlack) -> None:
    await make_gateway(admins=["slack:U1"], access={"dm_policy": "allowlist"},
                       channels=slack_section(fake_slack))
    await fake_slack.wait_connected()
    strangers = fake_slack.add_file("payload.bin", b"a stranger's upload")
    admins = fake_slack.add_file("notes.txt", b"the admin's notes")
    await fake_slack.push_event({"type": "message", "channel_type": "im", "user": "U9", "text": "take this",
                                 "ts": "500.1", "channel": "D9", "files": [strangers]})
    (refusal,) = await fake_slack.wait_posted(1)
    assert refusal["channel"] == "D9" and "private" in refusal["text"]

    await fake_slack.push_event({"type": "message", "channel_type": "im", "user": "U1", "text": "my notes",
                                 "ts": "600.1", "channel": "D1", "files": [admins]})
    await fake_slack.wait_posted(2)

    assert fake_slack.downloads == [admins["id"]]  # the admin's file was fetched, the stranger's never
    assert "notes.txt" in fake_model.requests[-1]["messages"][-1]["content"]


async def test_the_gateways_slack_channel_streams_replies(make_gateway: GatewayFactory, fake_slack: FakeSlack) -> None:
    """The channel the gateway builds from config streams (native by default) at the real
    interval; the agent's side of the wiring is tested with the core (sessions.py)."""
    gw = await make_gateway(access={"dm_policy": "open"}, channels=slack_section(fake_slack))
    slack = gw.channels["slack"]
    assert slack.cfg.streaming == "native"
    inbound = Inbound(channel="slack", chat_id="D5", user_id="U5", text="q", event_id="D5:2.1", thread_id="1.1")
    stream = slack.stream(inbound)
    assert stream is not None
    await stream.append("hello")
    await fake_slack.wait_for(lambda: fake_slack.visible("D5", "1.1") == ["hello"])
    await stream.finish("hello **there** 👋")
    assert fake_slack.visible("D5", "1.1") == ["hello **there** 👋"]
    assert len(fake_slack.method_calls("chat.startStream")) == 1
