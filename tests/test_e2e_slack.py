"""The whole gateway with the real slack-bolt against the fake Slack API: Socket Mode DMs,
threads as sessions, twins and retries answered once, signed HTTP events."""

from __future__ import annotations

import time
from typing import Any

import aiohttp

from gateway.app import Gateway
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
                            channels=slack_section(fake_slack))
    await fake_slack.wait_connected()
    fake_model.reply("dm answer")
    env = await fake_slack.push_event({"type": "message", "channel_type": "im", "user": "U5", "text": "hello",
                                       "ts": "100.1", "channel": "D5"})
    await fake_slack.wait_acked(env)
    (posted,) = await fake_slack.wait_posted(1)
    assert posted["channel"] == "D5" and posted["text"] == "dm answer"

    fake_model.reply("thread one")
    fake_model.reply("thread two")
    await fake_slack.push_event(_mention(fake_slack, "200.1", "first thread"))
    await fake_slack.wait_posted(2)
    await fake_slack.push_event(_mention(fake_slack, "300.1", "second thread"))
    posted = await fake_slack.wait_posted(3)
    assert posted[1]["thread_ts"] == "200.1" and posted[2]["thread_ts"] == "300.1"
    assert gw.services is not None
    store = gw.services.store
    assert await store.count_messages("slack:dm:D5") == 2
    assert await store.count_messages("slack:channel:C1:thread:200.1") == 2
    assert await store.count_messages("slack:channel:C1:thread:300.1") == 2
    # The second thread's request did not carry the first thread's words.
    assert "first thread" not in str(fake_model.requests[2]["messages"])


async def test_twins_and_retries_give_one_reply(make_gateway: GatewayFactory, fake_model: FakeModel,
                                                fake_slack: FakeSlack) -> None:
    gw = await make_gateway(access={"allow_from": ["slack:C1"]}, channels=slack_section(fake_slack))
    await fake_slack.wait_connected()
    fake_model.reply("once")
    await fake_slack.push_event(_mention(fake_slack, "400.1", "hi"), event_id="EvA")
    await fake_slack.push_event(_mention(fake_slack, "400.1", "hi", kind="message"), event_id="EvB")
    last = await fake_slack.push_event(_mention(fake_slack, "400.1", "hi"), event_id="EvA", retry_num=1)
    await fake_slack.wait_acked(last)
    await fake_slack.wait_posted(1)
    assert gw.services is not None
    await gw.services.background.wait_idle(5)
    assert [p["text"] for p in fake_slack.posted] == ["once"]
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
    (posted,) = await fake_slack.wait_posted(1)
    assert posted["text"] == "signed and answered" and posted["thread_ts"] == "500.1"
    assert gw.services is not None
    await gw.services.background.wait_idle(5)
    assert len(fake_slack.posted) == 1


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
