"""Streamed replies through the whole gateway (SPEC §5.1): a person's message arrives from
the fake platform, the agent streams the fake model's reply into the channel the gateway
built from config (the real python-telegram-bot / slack_sdk), and the fakes show what
people see, enforcing the platforms' limits (Telegram: edits per chat, 4096 UTF-16 units,
malformed entities; Slack: tier rate limits, stream rules, 12,000 characters per call).

Each test reads the end state: the visible text of every message equals what `send()`
would have shown for the stored final reply, the number of messages is what that needs,
and every message ever posted is either one of them or was deleted (nothing twice).
/metrics counts what the streams did (gateway_stream_events_total)."""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

import aiohttp

from channels.slack.format import clean_text, split_message, to_mrkdwn
from channels.telegram.format import TELEGRAM_TEXT_LIMIT, render_markdown, utf16_len
from gateway.app import Gateway
from gateway.config.schema import ModelConfig
from gateway.model.client import ModelClient
from tests.conftest import GatewayFactory
from tests.fakes import slack_server
from tests.fakes.openai_server import FakeModel, Reply
from tests.fakes.slack_server import FakeSlack
from tests.fakes.telegram_server import FakeTelegram
from tests.test_e2e_slack import _mention, slack_section
from tests.test_slack_stream import long_reply
from tests.test_telegram_stream import big_reply, pieces

fake_slack = slack_server.fake_slack  # the fixture

CHAT = 42
FAST_S = 0.05  # stream_interval_s in the fast tests, and the fakes' edit rule to match
SLACK_SCALE = 1 / FAST_S  # the fake Slack's clock: one of its seconds is one interval here


# ---------------------------------------------------------------------------- helpers


async def answered(gw: Gateway, channel: str, event_id: str, timeout: float = 20) -> None:
    """Wait until the turn of `event_id` is marked answered (its reply delivered)."""
    assert gw.services is not None
    store = gw.services.store
    for _ in range(int(timeout / 0.02)):
        if await store.event_status(channel, event_id) == "answered":
            return
        await asyncio.sleep(0.02)  # the store has no event to wait on
    raise TimeoutError(f"{channel} event {event_id} not answered within {timeout:g} s")


async def stored_reply(gw: Gateway, key: str) -> str:
    assert gw.services is not None
    rows = await gw.services.store.messages(key)
    assert rows[-1].role == "assistant"
    return rows[-1].content


async def stream_events(gw: Gateway) -> dict[tuple[str, str], float]:
    """gateway_stream_events_total from GET /metrics, by (channel, event)."""
    assert gw.http is not None
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{gw.http.port}/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    pattern = r'^gateway_stream_events_total\{channel="([^"]+)",event="([^"]+)"\} (\S+)$'
    return {(m[1], m[2]): float(m[3]) for m in re.finditer(pattern, text, re.M)}


def telegram_section(fake: FakeTelegram, **extra: Any) -> dict[str, Any]:
    return {"telegram": {"enabled": True, "token": fake.token, "base_url": fake.base_url,
                         "base_file_url": fake.base_file_url, "poll_timeout_s": 1, **extra}}


async def telegram_gateway(make_gateway: GatewayFactory, fake: FakeTelegram, interval_s: float,
                           streaming: str | None = "edit") -> Gateway:
    """A gateway on the fake Bot API; `streaming` None keeps the default (`auto`)."""
    extra = {} if streaming is None else {"streaming": streaming}
    return await make_gateway(access={"dm_policy": "open"}, channels=telegram_section(fake, **extra),
                              stream_interval_s=interval_s)


def sent_once(fake: FakeTelegram, chat: int) -> None:
    """Every message sent is visible now or was deleted, never both, none twice."""
    sent = [mid for method, chat_id, mid, _ in fake.history if method == "sendMessage" and chat_id == chat]
    visible = fake.message_ids(chat)
    assert len(set(sent)) == len(sent) == len(fake.sent)
    assert sorted(sent) == sorted(visible + [mid for mid in fake.deleted if mid in sent])
    assert not set(visible) & set(fake.deleted)


def shows_the_reply(fake: FakeTelegram, chat: int, reply: str) -> None:
    """The chat shows exactly what send() would have sent for `reply`: its chunks, formatted."""
    chunks = render_markdown(reply)
    shown = fake.shown_parsed(chat)
    assert [m.text for m in shown] == [c.text for c in chunks]
    assert [m.entities for m in shown] == [list(c.entities) for c in chunks]


# ---------------------------------------------------------------------------- Telegram


async def test_telegram_streams_a_long_reply_by_editing_and_ends_as_send_would(
    make_gateway: GatewayFactory, fake_model: FakeModel
) -> None:
    fake = FakeTelegram(edit_interval_s=FAST_S)
    await fake.start()
    try:
        gw = await telegram_gateway(make_gateway, fake, FAST_S)
        reply = big_reply()  # > 10,000 characters: code blocks, emoji, CJK
        assert len(reply) > 10_000
        # A tool step first: its text, then the tool's own status line, then the answer.
        fake_model.tool_call("web_fetch", {"url": "http://127.0.0.1:9/report"}, text="Let me fetch that.")
        fake_model.reply(reply, chunks=pieces(reply, 60), chunk_delay=0.004, delay=0.3)
        fake.fail_next("editMessageText", 429, retry_after=0.1)  # flood control once, mid-stream
        update = fake.push_message(chat_id=CHAT, user_id=CHAT, text="write the report")
        await answered(gw, "telegram", str(update))

        stored = await stored_reply(gw, f"telegram:dm:{CHAT}")
        assert stored == reply.strip()
        shows_the_reply(fake, CHAT, stored)
        chunks = render_markdown(stored)
        assert len(chunks) >= 3 and all(utf16_len(c.text) <= TELEGRAM_TEXT_LIMIT for c in chunks)
        assert any(e["type"] == "pre" for m in fake.shown_parsed(CHAT) for e in m.entities)
        sent_once(fake, CHAT)
        assert len(fake.sent) == len(chunks), "each message was posted once and edited, never reposted"
        # It grew in place: while the tool ran the first message showed the tool's own
        # status (web_fetch names the host), then the answer replaced it, edit by edit.
        first = fake.versions(fake.message_ids(CHAT)[0])
        assert "⏳ fetching 127.0.0.1…" in first[:2]
        assert not any("Let me fetch that." in text for text in fake.shown(CHAT))
        assert len(fake.edits) >= 8
        assert fake.rate_limited == [], "no call before Telegram allowed it"

        events = await stream_events(gw)
        assert events[("telegram", "reply")] == 1
        assert events[("telegram", "continued")] == len(fake.sent) - 1
        assert events[("telegram", "edit")] == len(fake.edits)
        assert events[("telegram", "rate_limited")] == 1
    finally:
        await fake.stop()


async def test_telegram_at_the_real_one_second_edit_rule(make_gateway: GatewayFactory, fake_model: FakeModel) -> None:
    fake = FakeTelegram(edit_interval_s=1.0)  # Telegram's own rule: one edit a second per chat
    await fake.start()
    try:
        gw = await telegram_gateway(make_gateway, fake, 1.0)
        reply = "".join(f"Step {i}: 数据 🙂 **done** `x{i}`\n" for i in range(70))
        fake_model.reply(reply, chunks=pieces(reply, 40), chunk_delay=0.05)  # about 2.5 s of writing
        began = time.monotonic()
        update = fake.push_message(chat_id=CHAT, user_id=CHAT, text="go step by step")
        await answered(gw, "telegram", str(update))
        elapsed = time.monotonic() - began

        stored = await stored_reply(gw, f"telegram:dm:{CHAT}")
        shows_the_reply(fake, CHAT, stored)
        sent_once(fake, CHAT)
        # Two messages: 140 formatting entities are more than Telegram takes in one.
        assert len(fake.sent) == len(render_markdown(stored)) == 2
        assert fake.rate_limited == [], "never faster than one edit a second"
        assert 2 <= len(fake.edits) <= elapsed + 1
        events = await stream_events(gw)
        assert events[("telegram", "reply")] == 1 and events[("telegram", "edit")] == len(fake.edits)
        assert ("telegram", "rate_limited") not in events
    finally:
        await fake.stop()


async def test_telegram_refused_formatting_falls_back_to_plain_text(
    make_gateway: GatewayFactory, fake_model: FakeModel
) -> None:
    fake = FakeTelegram(edit_interval_s=FAST_S)
    await fake.start()
    try:
        gw = await telegram_gateway(make_gateway, fake, FAST_S)
        reply = "Some **bold**, `code` and a [link](https://example.org) — 完了 ✅"
        fake_model.reply(reply, chunks=pieces(reply, 7), chunk_delay=0.01)
        fake.reject_formatting()  # only the final text carries formatting: that call is refused
        update = fake.push_message(chat_id=CHAT, user_id=CHAT, text="format it")
        await answered(gw, "telegram", str(update))

        [chunk] = render_markdown(await stored_reply(gw, f"telegram:dm:{CHAT}"))
        assert chunk.entities, "the reply has formatting to refuse"
        [message] = fake.shown_parsed(CHAT)
        assert (message.text, message.entities) == (chunk.text, [])
        sent_once(fake, CHAT)
        events = await stream_events(gw)
        assert events[("telegram", "plain_fallback")] == 1
    finally:
        await fake.stop()


async def test_telegram_private_chat_reply_grows_as_a_draft_and_is_sent_once(
    make_gateway: GatewayFactory, fake_model: FakeModel
) -> None:
    fake = FakeTelegram(edit_interval_s=FAST_S, draft_interval_s=FAST_S)
    await fake.start()
    try:
        gw = await telegram_gateway(make_gateway, fake, FAST_S, streaming=None)  # auto: drafts in a DM
        reply = big_reply()
        fake_model.tool_call("web_fetch", {"url": "http://127.0.0.1:9/report"}, text="Let me fetch that.")
        fake_model.reply(reply, chunks=pieces(reply, 60), chunk_delay=0.004, delay=0.3)
        update = fake.push_message(chat_id=CHAT, user_id=CHAT, text="write the report")
        await answered(gw, "telegram", str(update))

        stored = await stored_reply(gw, f"telegram:dm:{CHAT}")
        shows_the_reply(fake, CHAT, stored)
        sent_once(fake, CHAT)
        chunks = len(render_markdown(stored))
        calls = fake.methods("sendMessageDraft", "sendMessage", "editMessageText", "deleteMessage")
        assert calls[-chunks:] == ["sendMessage"] * chunks, "the finished reply, once, at the end"
        assert set(calls[:-chunks]) == {"sendMessageDraft"}, "before it only drafts: no edit, no delete"
        assert "⏳ fetching 127.0.0.1…" in [d["text"] for d in fake.drafts], "the tool's status in the draft"
        assert fake.rate_limited == []
        events = await stream_events(gw)
        assert events[("telegram", "reply")] == 1 and events[("telegram", "draft")] == len(fake.drafts) - 1
        assert events[("telegram", "continued")] == chunks - 1
        assert ("telegram", "edit") not in events
    finally:
        await fake.stop()


async def test_telegram_a_crash_while_a_draft_grows_leaves_one_final_message(
    make_gateway: GatewayFactory, fake_model: FakeModel
) -> None:
    fake = FakeTelegram(edit_interval_s=FAST_S, draft_interval_s=FAST_S)
    await fake.start()
    try:
        gw = await telegram_gateway(make_gateway, fake, FAST_S, streaming=None)
        slow = "A reply that is still being written, word by word. " * 40
        fake_model.reply(slow, chunks=pieces(slow, 10), chunk_delay=0.1)  # about 20 s of writing
        update = fake.push_message(chat_id=CHAT, user_id=CHAT, text="a long answer please")
        await fake.wait_draft(CHAT, lambda text: len(text) > 60, timeout=20)
        await gw.stop(timeout=0)  # the crash: the turn is cut while its draft grows
        assert fake.sent == [] and fake.edits == [], "a draft is not a message: nothing is left behind"

        fake_model.reply("The **whole** answer, after the restart.")
        gw2 = await telegram_gateway(make_gateway, fake, FAST_S, streaming=None)
        await answered(gw2, "telegram", str(update))
        stored = await stored_reply(gw2, f"telegram:dm:{CHAT}")
        assert stored == "The **whole** answer, after the restart."
        shows_the_reply(fake, CHAT, stored)
        assert len(fake.sent) == 1 and fake.edits == [] and fake.deleted == [], "one final message, nothing else"
        assert len(fake_model.requests) == 2
    finally:
        await fake.stop()


# ---------------------------------------------------------------------------- Slack


async def slack_gateway(make_gateway: GatewayFactory, fake: FakeSlack, **slack: Any) -> Gateway:
    # Slack's limits on the fake's clock, which runs SLACK_SCALE times faster: the
    # interval is one of its seconds, as the default 1 s is one of Slack's.
    fake.rate_scale = SLACK_SCALE
    gw = await make_gateway(access={"dm_policy": "open", "allow_from": ["slack:C1"]},
                            channels=slack_section(fake, **slack), stream_interval_s=FAST_S)
    await fake.wait_connected()
    return gw


def slack_messages_once(fake: FakeSlack, channel: str, thread_ts: str | None, wanted: list[str]) -> None:
    """The place shows exactly `wanted`; every message posted there is one of them or was
    deleted: nothing shown twice."""
    assert fake.visible(channel, thread_ts) == wanted
    posted = [m for m in fake.messages.values() if m.channel == channel and m.thread_ts == thread_ts]
    assert len(posted) - sum(m.deleted for m in posted) == len(wanted)
    assert not any(m.streaming for m in posted), "every stream was stopped"
    assert fake.violations == [], "no call came back before Slack's Retry-After"


async def test_slack_native_stream_in_a_thread(make_gateway: GatewayFactory, fake_model: FakeModel,
                                               fake_slack: FakeSlack) -> None:
    gw = await slack_gateway(make_gateway, fake_slack)
    reply = long_reply()
    assert len(reply) > 10_000
    fake_model.reply(reply, chunks=pieces(reply, 80), chunk_delay=0.003)
    await fake_slack.push_event(_mention(fake_slack, "301.1", "a long answer please", thread_ts="300.1"))
    await answered(gw, "slack", "C1:301.1")

    stored = await stored_reply(gw, "slack:channel:C1:thread:300.1")
    # Native messages hold the reply's own Markdown, split where send() splits it.
    wanted = split_message(clean_text(stored))
    assert len(wanted) >= 3
    slack_messages_once(fake_slack, "C1", "300.1", wanted)
    starts = fake_slack.method_calls("chat.startStream")
    assert len(starts) == len(wanted) and all(s["recipient_user_id"] == "U5" for s in starts)
    assert len(fake_slack.method_calls("chat.appendStream")) >= 3, "it grew while the model wrote"
    events = await stream_events(gw)
    assert events[("slack", "reply")] == 1 and events[("slack", "continued")] == len(wanted) - 1
    assert events[("slack", "edit")] >= 3


async def test_slack_top_level_replies_update_and_equal_send(make_gateway: GatewayFactory, fake_model: FakeModel,
                                                             fake_slack: FakeSlack) -> None:
    gw = await slack_gateway(make_gateway, fake_slack, reply_to_mode="channel")  # answered at the top level
    reply = long_reply()
    fake_model.reply(reply, chunks=pieces(reply, 80), chunk_delay=0.003)
    await fake_slack.push_event(_mention(fake_slack, "200.1", "a long answer please"))
    await answered(gw, "slack", "C1:200.1")

    stored = await stored_reply(gw, "slack:channel:C1:user:U5")
    wanted = split_message(to_mrkdwn(stored))  # exactly what send() posts
    assert len(wanted) >= 3
    slack_messages_once(fake_slack, "C1", None, wanted)
    assert fake_slack.method_calls("chat.startStream") == []
    assert len(fake_slack.method_calls("chat.update")) >= 3
    events = await stream_events(gw)
    assert events[("slack", "reply")] == 1 and events[("slack", "edit")] >= 3


async def test_slack_refused_native_streams_fall_back_to_updates(make_gateway: GatewayFactory,
                                                                 fake_model: FakeModel, fake_slack: FakeSlack) -> None:
    gw = await slack_gateway(make_gateway, fake_slack)
    fake_slack.native_refusal = "not_allowed_token_type"  # an older workspace or token type
    reply = "Here is **the** answer, 日本語 🎉, in `one` message.\n\n" + "more words " * 60
    fake_model.reply(reply, chunks=pieces(reply, 25), chunk_delay=0.01)
    await fake_slack.push_event(_mention(fake_slack, "401.1", "hello", thread_ts="400.1"))
    await answered(gw, "slack", "C1:401.1")

    stored = await stored_reply(gw, "slack:channel:C1:thread:400.1")
    slack_messages_once(fake_slack, "C1", "400.1", split_message(to_mrkdwn(stored)))
    events = await stream_events(gw)
    assert events[("slack", "update_fallback")] == 1 and events[("slack", "reply")] == 1


# ---------------------------------------------------------------------------- many at once


async def test_more_concurrent_streams_than_a_fixed_pool_all_start_at_once(fake_model: FakeModel) -> None:
    """A streamed reply holds its model connection for as long as the model writes: the
    client's pool must not cap streams below limits.max_concurrent_model_calls (it held
    the 65th stream back until another reply ended)."""
    client = ModelClient(ModelConfig(**fake_model.model_settings(timeout_s=10)))
    fake_model.respond_with(lambda body: Reply(text="a reply that takes a while", delay=1.5))
    shown: list[str] = []

    async def on_text(delta: str) -> None:
        shown.append(delta)

    calls = [asyncio.create_task(client.complete([{"role": "user", "content": f"q{i}"}], on_text=on_text))
             for i in range(80)]
    try:
        await fake_model.wait_requests(80, timeout=1.2)  # all in flight before the first ends
        replies = await asyncio.wait_for(asyncio.gather(*calls), 10)
        assert {r.content for r in replies} == {"a reply that takes a while"}
    finally:
        for task in calls:
            task.cancel()
        await asyncio.wait(calls, timeout=5)
        await client.close()
