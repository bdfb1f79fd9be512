"""Streamed Slack replies (SPEC §5.1): the real slack_sdk AsyncWebClient inside a started
SlackChannel against the fake Slack, driven the way the agent drives a ReplyStream (many
small appends over time, status lines, one finish)."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from slack_sdk.errors import SlackApiError
from slack_sdk.web.async_client import AsyncWebClient

from channels.base import ReplyStream, StreamingChannel
from channels.slack.adapter import SlackChannel
from channels.slack.events import parse_event
from channels.slack.format import MESSAGE_LIMIT, clean_text, split_message, to_mrkdwn
from gateway.config.schema import SlackConfig
from gateway.keys import memory_scope, scope_dirname
from gateway.types import Inbound
from tests.fakes import slack_server
from tests.fakes.slack_server import APP_TOKEN, BOT_TOKEN, BOT_USER_ID, TEAM_ID, FakeSlack, RateLimit

fake_slack = slack_server.fake_slack  # the fixture

# The fake's clock runs this much faster than Slack's: its "1 call a second" is 20 a real
# second, its Retry-After seconds are 1/20 s here, and so is the stream interval.
SCALE = 20.0
INTERVAL = 1.0 / SCALE

_ts = iter(range(1, 10**6))


def next_ts() -> str:
    return f"1713000000.{next(_ts):06d}"


async def scaled_sleep(delay: float) -> None:
    await asyncio.sleep(delay / SCALE)


def long_reply(parts: int = 12) -> str:
    """Markdown with headings, bold, inline and fenced code, links, emoji and CJK."""
    blocks = []
    for n in range(parts):
        blocks.append(
            f"## Part {n} 🚀\n\nSome **bold** words, `inline code`, 日本語のテキスト、中文字符 {n}, "
            f"emoji 🎉👍🏽 and a [link](https://example.com/{n}).\n\n"
            + " ".join(f"word{n}_{k}" for k in range(80))
        )
        if n % 4 == 1:
            body = "\n".join(f"def f_{n}_{k}(x):  # 注释 {k} ✅\n    return x * {k}" for k in range(40))
            blocks.append(f"```python\n{body}\n```")
    return "\n\n".join(blocks)


def native_chunks(reply: str) -> list[str]:
    """What a native reply finally shows: its own Markdown, split where send() splits."""
    return split_message(clean_text(reply))


def update_chunks(reply: str) -> list[str]:
    """What send() posts for the reply."""
    return split_message(to_mrkdwn(reply))


async def drive(stream: ReplyStream, text: str, *, seed: int = 7) -> None:
    """The agent's pattern: small pieces (1-40 chars) as the model produces them, over time."""
    rng = random.Random(seed)
    i = n = 0
    while i < len(text):
        size = rng.randint(1, 40)
        await stream.append(text[i:i + size])
        i += size
        n += 1
        if n % 10 == 0:
            await asyncio.sleep(0.01)


class Inbox:
    """The router stand-in: keeps every Inbound (the stream tests answer themselves)."""

    def __init__(self) -> None:
        self.inbounds: list[Inbound] = []
        self._changed = asyncio.Condition()

    async def __call__(self, inbound: Inbound) -> None:
        self.inbounds.append(inbound)
        async with self._changed:
            self._changed.notify_all()

    async def wait(self, n: int) -> Inbound:
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(lambda: len(self.inbounds) >= n), 5)
        return self.inbounds[n - 1]


class Rig:
    def __init__(self, fake: FakeSlack, tmp_path: Path) -> None:
        self.fake = fake
        self.tmp_path = tmp_path
        self.events: list[str] = []
        self.channels: list[SlackChannel] = []
        self.inbox = Inbox()

    async def channel(self, streaming: str = "native", interval: float = INTERVAL, *,
                      unfurl_links: bool = False) -> SlackChannel:
        # "channel": a mention made with thread=False stays at the top level, where these tests want it.
        cfg = SlackConfig(enabled=True, bot_token=BOT_TOKEN, app_token=APP_TOKEN, base_url=self.fake.base_url,
                          streaming=streaming, unfurl_links=unfurl_links, reply_to_mode="channel")
        channel = SlackChannel(
            cfg, self.inbox,
            workspace_for=lambda inbound: self.tmp_path / scope_dirname(memory_scope(inbound)),
            sleep=scaled_sleep, start_timeout_s=5, stream_interval_s=interval, observe=self.events.append,
        )
        await channel.start()
        self.channels.append(channel)
        return channel

    async def inbound(self, *, channel: str = "C1", thread: bool = True, user: str = "U1") -> Inbound:
        """A person's message through Socket Mode, as the router would get it."""
        ts, seen = next_ts(), len(self.inbox.inbounds)
        if channel.startswith("D"):
            event: dict[str, Any] = {"type": "message", "channel_type": "im", "channel": channel, "user": user,
                                     "text": "question", "ts": ts}
        else:
            event = {"type": "app_mention", "channel": channel, "user": user,
                     "text": f"<@{BOT_USER_ID}> question", "ts": ts}
        if thread:
            event["thread_ts"] = next_ts()
        await self.fake.wait_acked(await self.fake.push_event(event))
        return await self.inbox.wait(seen + 1)


@pytest.fixture
async def rig(fake_slack: FakeSlack, tmp_path: Path) -> AsyncIterator[Rig]:
    fake_slack.rate_scale = SCALE
    fake_slack.set_limit("chat.postMessage", slack_server.POST_LIMIT)
    made = Rig(fake_slack, tmp_path)
    yield made
    for channel in made.channels:
        await channel.stop()


def open_stream(channel: SlackChannel, inbound: Inbound, refs: list[str] | None = None,
                resume_ref: str | None = None) -> ReplyStream:
    async def on_ref(ref: str) -> None:
        if refs is not None:
            refs.append(ref)

    stream = channel.stream(inbound, on_ref=on_ref, resume_ref=resume_ref)
    assert stream is not None
    return stream


def assert_paced(fake: FakeSlack, method: str) -> None:
    """Calls on one message at most once per stream interval (a little slack for the clock)."""
    by_message: dict[str, list[float]] = {}
    for at, params in fake.timed_calls(method):
        by_message.setdefault(str(params.get("ts")), []).append(at)
    for times in by_message.values():
        gaps = [b - a for a, b in itertools.pairwise(times)]
        assert all(gap >= INTERVAL * 0.8 for gap in gaps), gaps


# ---------------------------------------------------------------------------- links


@pytest.mark.parametrize("unfurl", [False, True])
async def test_replies_unfurl_no_links_unless_turned_on(rig: Rig, unfurl: bool) -> None:
    """A URL the model was led to write is not fetched by Slack's servers unclicked: every
    chat.postMessage of a reply (streamed by update, or sent whole) says so, unless
    `channels.slack.unfurl_links` is on."""
    channel = await rig.channel("update", unfurl_links=unfurl)
    inbound = await rig.inbound(channel="C1", thread=False)
    stream = open_stream(channel, inbound)
    await drive(stream, "Read https://attacker.example/first and <https://attacker.example/second|this>.")
    await stream.finish("Read https://attacker.example/first and <https://attacker.example/second|this>.")
    await channel.send(inbound, "A whole reply: https://attacker.example/third " + "x" * 5000)
    posts = rig.fake.method_calls("chat.postMessage")
    assert len(posts) >= 2 and rig.fake.violations == []
    for params in posts:
        assert (params["unfurl_links"], params["unfurl_media"]) == (unfurl, unfurl), params


# ---------------------------------------------------------------------------- native


@pytest.mark.parametrize("where", ["C1", "D1"])
async def test_native_stream_in_a_thread(rig: Rig, where: str) -> None:
    channel = await rig.channel("native")
    assert isinstance(channel, StreamingChannel)
    inbound = await rig.inbound(channel=where)
    reply = long_reply(30)
    assert len(reply) > 25_000
    refs: list[str] = []
    stream = open_stream(channel, inbound, refs)
    await drive(stream, reply)
    await stream.finish(reply)

    fake = rig.fake
    shown = fake.visible_messages(where, inbound.thread_id)
    expected = native_chunks(reply)
    assert len(expected) >= 7 and all(len(c) <= MESSAGE_LIMIT for c in expected)
    assert [m.text for m in shown] == expected  # the reply's Markdown, exactly once
    assert all(m.format == "markdown" and not m.streaming for m in shown)
    assert fake.visible(where) == []  # nothing outside the thread
    starts = fake.method_calls("chat.startStream")
    assert len(starts) == len(expected) and all(s["thread_ts"] == inbound.thread_id for s in starts)
    if where == "C1":  # a stream in a channel names its recipient
        assert all(s["recipient_team_id"] == TEAM_ID and s["recipient_user_id"] == "U1" for s in starts)
    assert len(fake.method_calls("chat.appendStream")) >= 5  # shown as it grew
    assert fake.method_calls("chat.postMessage") == []
    # Streamed, not edited: at most one edit where a message is cut at the size limit.
    assert len(fake.method_calls("chat.update")) < len(expected)
    assert_paced(fake, "chat.appendStream")
    assert fake.violations == []
    assert "update_fallback" not in rig.events
    assert rig.events.count("reply") == 1 and rig.events.count("continued") == len(expected) - 1
    ref = json.loads(refs[-1])
    assert ref == {"channel": where, "thread_ts": inbound.thread_id, "ts": [m.ts for m in shown],
                   "mode": "native"}
    assert json.loads(refs[0])["ts"] == [shown[0].ts]  # reported as soon as the first existed


async def test_native_status_lines(rig: Rig) -> None:
    channel = await rig.channel("native")
    inbound = await rig.inbound()
    fake, thread = rig.fake, inbound.thread_id
    assert thread is not None
    stream = open_stream(channel, inbound)

    # Before any text: the thread's status, no message.
    await stream.status("reading notes.md…")
    await fake.wait_for(lambda: fake.thread_status.get(("C1", thread)) == "reading notes.md…")
    assert fake.visible("C1", thread) == []

    # Text starts the stream (Slack clears the status); a later status replaces that text.
    await drive(stream, "Let me check one more file.")
    await fake.wait_for(lambda: fake.visible("C1", thread) == ["Let me check one more file."])
    assert ("C1", thread) not in fake.thread_status
    await stream.status("searching memory…")
    await fake.wait_for(lambda: fake.visible("C1", thread) == ["searching memory…"])

    answer = "Found it: **42** 🎯 (見つかった)\n\n```\nanswer = 42\n```"
    await drive(stream, answer)
    await stream.finish(answer)
    [message] = fake.visible_messages("C1", thread)
    assert message.text == answer and message.format == "markdown" and not message.streaming
    assert "searching memory…" in message.history and "Let me check one more file." in message.history


@pytest.mark.parametrize("refusal", ["unknown_method", "not_allowed_token_type"])
async def test_native_refused_falls_back_to_updates(rig: Rig, refusal: str) -> None:
    rig.fake.native_refusal = refusal  # an older workspace or token
    channel = await rig.channel("native")
    inbound = await rig.inbound()
    reply = long_reply(10)
    stream = open_stream(channel, inbound)
    await stream.status("thinking…")
    await drive(stream, reply)
    await stream.finish(reply)

    shown = rig.fake.visible_messages("C1", inbound.thread_id)
    assert [m.text for m in shown] == update_chunks(reply)  # what send() would post
    assert all(m.format == "mrkdwn" for m in shown)
    assert rig.events.count("update_fallback") == 1
    assert len(rig.fake.method_calls("chat.startStream")) == 1  # asked once per reply


# ---------------------------------------------------------------------------- the first interval


@pytest.mark.parametrize(("mode", "thread"), [("update", False), ("update", True), ("native", True)])
async def test_a_reply_complete_within_the_first_interval_is_posted_once_at_once(
    rig: Rig, mode: str, thread: bool
) -> None:
    interval = 30.0  # an update before this would break the pace: anything the stream waited for is late
    channel = await rig.channel(mode, interval=interval)
    inbound = await rig.inbound(thread=thread)
    stream = open_stream(channel, inbound)
    began = time.monotonic()
    await stream.append("Sure, ")
    for _ in range(20):
        await asyncio.sleep(0)  # the stream's flusher runs between the model's pieces
    await stream.append("it is **done**.")
    await asyncio.wait_for(stream.finish("Sure, it is **done**."), 20)

    fake = rig.fake
    [shown] = fake.visible_messages("C1", inbound.thread_id)
    if mode == "native":
        assert shown.text == "Sure, it is **done**." and not shown.streaming
        assert [len(fake.method_calls(m)) for m in ("chat.startStream", "chat.appendStream", "chat.stopStream")] \
            == [1, 0, 1], "started with the whole reply and stopped at once"
        [(posted_at, _)] = fake.timed_calls("chat.startStream")
    else:
        assert shown.text == "Sure, it is *done*."
        [(posted_at, _)] = fake.timed_calls("chat.postMessage")
    assert fake.method_calls("chat.update") == [], "posted finished: never edited"
    assert posted_at < began + interval, "posted before the stream's first update would have been allowed"


# ---------------------------------------------------------------------------- update


async def test_top_level_replies_use_updates_and_equal_send(rig: Rig) -> None:
    channel = await rig.channel("native")
    inbound = await rig.inbound(thread=False)  # top level: no thread to stream in
    reply = long_reply(10)
    assert len(reply) > 10_000
    stream = open_stream(channel, inbound)
    await drive(stream, reply)
    await stream.finish(reply)

    fake = rig.fake
    streamed = fake.visible_messages("C1")
    assert fake.method_calls("chat.startStream") == []
    assert len(fake.method_calls("chat.update")) >= 5
    assert_paced(fake, "chat.update")
    # The same reply through send() in another channel: the very same messages.
    await channel.send(Inbound(channel="slack", chat_id="C2", user_id="U1", text="q", event_id="x"), reply)
    assert [m.text for m in streamed] == fake.visible("C2") == update_chunks(reply)
    assert len(streamed) >= 3 and all(m.format == "mrkdwn" for m in streamed)
    assert fake.violations == []


async def test_status_replaces_earlier_text_and_extra_messages_go(rig: Rig) -> None:
    channel = await rig.channel("update")
    inbound = await rig.inbound(thread=True)  # "update" is used in threads too
    fake, thread = rig.fake, inbound.thread_id
    preamble = long_reply(5)
    stream = open_stream(channel, inbound)
    await drive(stream, preamble)
    await fake.wait_for(lambda: fake.visible("C1", thread) == update_chunks(preamble))
    assert len(update_chunks(preamble)) >= 2

    await stream.status("reading <notes.md> & more…")
    await fake.wait_for(lambda: fake.visible("C1", thread) == ["reading &lt;notes.md&gt; &amp; more…"])
    answer = "The notes say *hi* 👋 — 你好"
    await drive(stream, answer)
    await stream.finish(answer)
    assert fake.visible("C1", thread) == update_chunks(answer) == ["The notes say _hi_ 👋 — 你好"]
    assert fake.method_calls("chat.startStream") == []


async def test_update_mode_in_a_dm(rig: Rig) -> None:
    channel = await rig.channel("native")
    inbound = await rig.inbound(channel="D1", thread=False)
    stream = open_stream(channel, inbound)
    await drive(stream, "**short** answer")
    await stream.finish("**short** answer")
    assert rig.fake.visible("D1") == ["*short* answer"]
    assert rig.events.count("reply") == 1


# ---------------------------------------------------------------------------- rate limits


@pytest.mark.parametrize("mode", ["native", "update"])
async def test_rate_limits_are_honoured_nothing_dropped_or_repeated(rig: Rig, mode: str) -> None:
    fake = rig.fake
    # Far stricter than the stream interval: one call per 3 (Slack) seconds.
    fake.set_limit("chat.appendStream", RateLimit(1 / 3, 1))
    fake.set_limit("chat.update", RateLimit(1 / 3, 1, "message"))
    fake.set_limit("chat.postMessage", RateLimit(1 / 3, 1, "channel"))
    channel = await rig.channel(mode)
    inbound = await rig.inbound()
    reply = long_reply(8)
    stream = open_stream(channel, inbound)
    await drive(stream, reply)
    await stream.finish(reply)

    expected = native_chunks(reply) if mode == "native" else update_chunks(reply)
    assert fake.visible("C1", inbound.thread_id) == expected
    if mode == "native":
        # Appends only add: a message never edited shows each appended piece exactly once.
        edited = {p["ts"] for p in fake.method_calls("chat.update")}
        assert len(edited) < len(expected)
    assert fake.rate_limited, "the limits were never reached"
    assert "rate_limited" in rig.events
    assert fake.violations == []  # never back before Retry-After


async def test_a_429_on_start_is_waited_out_not_a_refusal(rig: Rig) -> None:
    rig.fake.fail_next("chat.startStream", 429, {"Retry-After": "1"})
    channel = await rig.channel("native")
    inbound = await rig.inbound()
    stream = open_stream(channel, inbound)
    await drive(stream, "hello 🌍")
    await stream.finish("hello 🌍")
    assert rig.fake.visible("C1", inbound.thread_id) == ["hello 🌍"]
    assert len(rig.fake.method_calls("chat.startStream")) == 2
    assert "update_fallback" not in rig.events and "rate_limited" in rig.events


async def test_appends_never_wait_for_slack(rig: Rig) -> None:
    rig.fake.latency["chat.appendStream"] = 0.3
    channel = await rig.channel("native")
    inbound = await rig.inbound()
    reply = long_reply(2)
    stream = open_stream(channel, inbound)
    slowest = 0.0
    for i in range(0, len(reply), 20):
        started = time.monotonic()
        await stream.append(reply[i:i + 20])
        slowest = max(slowest, time.monotonic() - started)
        if i % 400 == 0:
            await asyncio.sleep(0.02)
    assert slowest < 0.12
    await stream.finish(reply)
    assert rig.fake.visible("C1", inbound.thread_id) == native_chunks(reply)


# ---------------------------------------------------------------------------- resume, off


@pytest.mark.parametrize("mode", ["native", "update"])
async def test_resume_edits_the_messages_already_shown(rig: Rig, mode: str) -> None:
    fake = rig.fake
    first = await rig.channel(mode)
    inbound = await rig.inbound(thread=mode == "native")
    thread = inbound.thread_id
    refs: list[str] = []
    stream = open_stream(first, inbound, refs)
    partial = long_reply(5)
    await drive(stream, partial)
    await fake.wait_for(lambda: len(fake.visible("C1", thread)) >= 2 and len(json.loads(refs[-1])["ts"]) >= 2)
    await first.stop()  # the process dies mid-stream: no finish
    before = fake.visible_messages("C1", thread)
    posts = len(fake.method_calls("chat.postMessage")) + len(fake.method_calls("chat.startStream"))

    second = await rig.channel(mode)
    final = "The whole answer, at last: **done** ✅"
    resumed = open_stream(second, inbound, resume_ref=refs[-1])
    await resumed.finish(final)

    shown = fake.visible_messages("C1", thread)
    assert [m.text for m in shown] == (native_chunks(final) if mode == "native" else update_chunks(final))
    assert shown[0].ts == before[0].ts == json.loads(refs[-1])["ts"][0]  # edited, not posted again
    assert len(fake.method_calls("chat.postMessage")) + len(fake.method_calls("chat.startStream")) == posts
    assert not shown[0].streaming


async def test_stopping_the_channel_mid_stream_fails_finish_cleanly(rig: Rig) -> None:
    channel = await rig.channel("update")
    inbound = await rig.inbound(thread=False)
    stream = open_stream(channel, inbound)
    await drive(stream, "partial answer")
    await rig.fake.wait_for(lambda: rig.fake.visible("C1") == ["partial answer"])
    started = time.monotonic()
    await channel.stop()  # e.g. a config change restarts the channel
    assert time.monotonic() - started < 2  # the flusher went at once
    with pytest.raises(RuntimeError):  # undelivered, not a CancelledError into the agent
        await asyncio.wait_for(stream.finish("partial answer, done"), 5)


async def test_fail_shows_the_error_text(rig: Rig) -> None:
    channel = await rig.channel("native")
    inbound = await rig.inbound()
    stream = open_stream(channel, inbound)
    await drive(stream, "Half an answer")
    await stream.fail("Sorry, the model is unreachable.")
    assert rig.fake.visible("C1", inbound.thread_id) == ["Sorry, the model is unreachable."]


async def test_native_status_without_assistant_threads(rig: Rig) -> None:
    rig.fake.status_refusal = "not_allowed"  # not an assistant thread: the reaction shows work
    channel = await rig.channel("native")
    inbound = await rig.inbound()
    stream = open_stream(channel, inbound)
    await stream.status("reading notes.md…")
    await rig.fake.wait_calls("assistant.threads.setStatus")
    await stream.status("reading todo.md…")
    await asyncio.sleep(INTERVAL * 3)
    await drive(stream, "done ✔")
    await stream.finish("done ✔")
    assert rig.fake.visible("C1", inbound.thread_id) == ["done ✔"]
    assert len(rig.fake.method_calls("assistant.threads.setStatus")) == 1  # not asked again
    assert "update_fallback" not in rig.events


def test_the_persons_team_is_kept_for_native_streams() -> None:
    event = {"type": "app_mention", "channel": "C1", "user": "U1", "text": "hi", "ts": "1.1"}
    parsed = parse_event(event, bot_user_id=BOT_USER_ID, team_id="T1")
    assert parsed is not None and parsed.inbound.extra == {"team_id": "T1"}
    # Slack Connect: the person's own team, not the workspace the event came through.
    parsed = parse_event({**event, "user_team": "T9", "team": "T8"}, bot_user_id=BOT_USER_ID, team_id="T1")
    assert parsed is not None and parsed.inbound.extra == {"team_id": "T9"}


async def test_streaming_off_and_slash_commands_give_none(rig: Rig) -> None:
    off = await rig.channel("off")
    inbound = await rig.inbound()
    assert off.stream(inbound) is None  # the gateway sends the whole reply with send()
    on = await rig.channel("native")
    command = Inbound(channel="slack", chat_id="D1", user_id="U1", text="/context", event_id="cmd:1",
                      extra={"command": "/context"})
    assert on.stream(command) is None  # ephemeral answers cannot be edited


async def test_empty_reply_leaves_nothing_behind(rig: Rig) -> None:
    channel = await rig.channel("update")
    inbound = await rig.inbound(thread=False)
    stream = open_stream(channel, inbound)
    await stream.status("working on it…")
    await rig.fake.wait_for(lambda: rig.fake.visible("C1") == ["working on it…"])
    await stream.finish("")
    assert rig.fake.visible("C1") == []


async def test_finish_raises_when_nothing_can_be_posted(rig: Rig) -> None:
    channel = await rig.channel("update")
    inbound = await rig.inbound(thread=False)
    rig.fake.fail_next("chat.postMessage", 200, body={"ok": False, "error": "channel_not_found"})
    stream = open_stream(channel, inbound)
    with pytest.raises(RuntimeError, match="not delivered"):
        await stream.finish("hello")


# ---------------------------------------------------------------------------- the fake's rules


async def _refused(call: Callable[[], Awaitable[Any]]) -> tuple[int, str]:
    with pytest.raises(SlackApiError) as caught:
        await call()
    return caught.value.response.status_code, str(caught.value.response.get("error"))


async def test_fake_enforces_slacks_stream_rules(fake_slack: FakeSlack) -> None:
    client = AsyncWebClient(token=BOT_TOKEN, base_url=fake_slack.base_url)
    assert await _refused(lambda: client.chat_startStream(channel="C1", thread_ts="", markdown_text="x")) == (
        200, "invalid_arguments")
    assert (await _refused(lambda: client.chat_startStream(channel="C1", thread_ts="1.1", markdown_text="x")))[1] \
        == "missing_recipient_team_id"
    started = await client.chat_startStream(channel="D1", thread_ts="1.1", markdown_text="a")
    ts = started["ts"]
    assert (await _refused(lambda: client.chat_update(channel="D1", ts=ts, text="b")))[1] == "cant_update_message"
    big = "x" * 12_001
    assert (await _refused(lambda: client.chat_appendStream(channel="D1", ts=ts, markdown_text=big)))[1] \
        == "msg_too_long"
    await client.chat_appendStream(channel="D1", ts=ts, markdown_text="b")
    await client.chat_stopStream(channel="D1", ts=ts, markdown_text="c")
    assert fake_slack.visible("D1", "1.1") == ["abc"]
    assert (await _refused(lambda: client.chat_appendStream(channel="D1", ts=ts, markdown_text="d")))[1] \
        == "message_not_in_streaming_state"
    assert (await _refused(lambda: client.chat_update(channel="D1", ts=ts, text="y" * 40_001)))[1] == "msg_too_long"
    posted = await client.chat_postMessage(channel="D1", text="z" * 40_500)
    assert len(fake_slack.messages[("D1", posted["ts"])].text) == 40_000  # Slack cuts, does not refuse
    # Edits of one message past ~1/s: 429 with a whole-second Retry-After.
    fresh = (await client.chat_postMessage(channel="D2", text="new"))["ts"]
    statuses = []
    for n in range(4):
        try:
            await client.chat_update(channel="D2", ts=fresh, text=f"edit {n}")
            statuses.append(200)
        except SlackApiError as err:
            statuses.append(err.response.status_code)
            assert err.response.headers["Retry-After"] == "1"
    assert statuses[:2] == [200, 200] and 429 in statuses[2:]
    fake_slack.native_refusal = "unknown_method"
    assert (await _refused(lambda: client.chat_startStream(channel="D1", thread_ts="1.1", markdown_text="x")))[1] \
        == "unknown_method"
