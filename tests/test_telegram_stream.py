"""Streamed Telegram replies (SPEC §5.1, `channels.telegram.streaming`: `edit`, and the
drafts of `auto` / `draft`): the real python-telegram-bot against the fake Bot API, which
enforces Telegram's flood control, size limit, "not modified" and "not found" rules, and
refuses drafts outside private chats."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from telegram import Bot
from telegram.error import BadRequest, RetryAfter

from channels.base import ReplyStream, StreamingChannel
from channels.telegram import stream as stream_module
from channels.telegram.adapter import TelegramChannel
from channels.telegram.format import TELEGRAM_TEXT_LIMIT, render_markdown, utf16_len
from gateway.config.schema import TelegramConfig
from gateway.types import Inbound
from tests.fakes.telegram_server import FakeTelegram

CHAT = 42
GROUP = -100777
FAST_S = 0.05  # the stream interval and the fake's edit rule in the fast tests


class Observed:
    """The stream events the channel reported (what /metrics counts)."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def __call__(self, event: str) -> None:
        self.events.append(event)

    def count(self, event: str) -> int:
        return self.events.count(event)


class Refs:
    """An `on_ref` sink: what the gateway would persist with the turn."""

    def __init__(self) -> None:
        self.refs: list[str] = []
        self._changed = asyncio.Event()

    async def __call__(self, ref: str) -> None:
        self.refs.append(ref)
        self._changed.set()

    async def wait_ids(self, n: int, timeout: float = 5) -> list[int]:
        """Wait until the last reference names `n` messages."""
        async with asyncio.timeout(timeout):
            while not self.refs or len(self.last_ids()) != n:
                self._changed.clear()
                await self._changed.wait()
        return self.last_ids()

    def last_ids(self) -> list[int]:
        return json.loads(self.refs[-1])["message_ids"]


async def no_router(inbound: Inbound) -> None:
    return None


Start = Callable[..., Awaitable[tuple[TelegramChannel, FakeTelegram, Observed]]]


@pytest.fixture
async def start(tmp_path: Path) -> AsyncIterator[Start]:
    fakes: list[FakeTelegram] = []
    channels: list[TelegramChannel] = []

    async def run(*, interval_s: float = FAST_S, edit_rule_s: float | None = FAST_S,
                  streaming: str = "edit", fake: FakeTelegram | None = None,
                  interval: Callable[[], float] | None = None, link_previews: bool = False,
                  ) -> tuple[TelegramChannel, FakeTelegram, Observed]:
        """A started channel; on a new fake Bot API unless `fake` is given (a restart)."""
        if fake is None:
            fake = FakeTelegram(edit_interval_s=edit_rule_s, draft_interval_s=edit_rule_s)
            await fake.start()
            fakes.append(fake)
        observed = Observed()
        cfg = TelegramConfig(enabled=True, token=fake.token, base_url=fake.base_url, poll_timeout_s=1,
                             streaming=streaming, link_previews=link_previews)
        channel = TelegramChannel(cfg, no_router, workspace_for=lambda inbound: tmp_path,
                                  stream_interval_s=interval_s, stream_interval=interval, observe=observed)
        await channel.start()
        channels.append(channel)
        return channel, fake, observed

    yield run
    for channel in channels:
        await channel.stop()
    for fake in fakes:
        await fake.stop()


def dm(message_id: int = 500) -> Inbound:
    return Inbound(channel="telegram", chat_id=str(CHAT), user_id=str(CHAT), text="hi", event_id="1",
                   message_id=str(message_id))


def in_topic(user: int, message_id: int, thread: int | None = 9) -> Inbound:
    return Inbound(channel="telegram", chat_id=str(GROUP), user_id=str(user), text="hi", event_id=str(message_id),
                   message_id=str(message_id), thread_id=str(thread) if thread else None, is_group=True)


def open_stream(channel: TelegramChannel, inbound: Inbound, **kwargs: Any) -> ReplyStream:
    stream = channel.stream(inbound, **kwargs)
    assert isinstance(stream, ReplyStream)
    return stream


def big_reply() -> str:
    """Over 10,000 characters of Markdown: prose with formatting, emoji and CJK, a short
    code block and one longer than a message."""
    prose = " ".join(f"Word{i} **bold{i}** 数据{i} _it{i}_ 🚀 終端." for i in range(110))
    short_code = "\n".join(f"x_{i} = {i}  # 短い" for i in range(30))
    long_code = "\n".join(f"    value_{i} = compute({i}, 'ü')  # 🧪 line {i}" for i in range(140))
    return (f"# Report\n\n{prose}\n\n```python\n{short_code}\n```\n\n{prose[:1800]}\n\n"
            f"```python\n{long_code}\n```\n\nThe end. 完了 ✅")


def pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


async def feed(stream: ReplyStream, text: str, *, size: int = 40, pause_every: int = 4,
               pause_s: float = 0.005) -> float:
    """Append `text` in small pieces over time, like a model; returns the slowest append."""
    slowest = 0.0
    for i, piece in enumerate(pieces(text, size)):
        started = time.perf_counter()
        await stream.append(piece)
        slowest = max(slowest, time.perf_counter() - started)
        if i % pause_every == 0:
            await asyncio.sleep(pause_s)
    return slowest


def final_texts(reply: str) -> list[str]:
    return [chunk.text for chunk in render_markdown(reply)]


def no_space(text: str) -> str:
    return re.sub(r"\s", "", text)


# ---------------------------------------------------------------------------- the contract


@pytest.mark.parametrize("previews", [False, True])
async def test_replies_show_no_link_previews_unless_turned_on(start: Start, previews: bool) -> None:
    """A URL the model was led to write is not fetched by Telegram's servers unclicked:
    every sendMessage and editMessageText of a reply turns previews off, unless
    `channels.telegram.link_previews` is on."""
    channel, fake, _ = await start(link_previews=previews)
    stream = open_stream(channel, dm())
    await stream.append("Read https://attacker.example/first ")
    await fake.wait_shown(CHAT, lambda shown: len(shown) == 1)
    await stream.append("and https://attacker.example/second")
    await fake.wait_shown(CHAT, lambda shown: shown[-1].endswith("second"))  # an edit
    await stream.finish("Read https://attacker.example/first and **https://attacker.example/second**")
    await channel.send(dm(501), "A whole reply: https://attacker.example/third")
    sends, edits = fake.calls_of("sendMessage"), fake.calls_of("editMessageText")
    assert len(sends) == 2 and len(edits) >= 2, (sends, edits)
    for params in sends + edits:
        if previews:
            assert "link_preview_options" not in params, params
        else:
            assert params["link_preview_options"] == {"is_disabled": True}, params


async def test_streaming_off_sends_whole_replies(start: Start) -> None:
    channel, _, _ = await start(streaming="off")
    assert isinstance(channel, StreamingChannel)
    assert channel.stream(dm()) is None


async def test_a_long_reply_streams_into_messages_and_ends_as_sends_chunks(start: Start) -> None:
    channel, fake, observed = await start()
    refs = Refs()
    stream = open_stream(channel, dm(), on_ref=refs)
    await feed(stream, "Let me look at your notes first. 🙂 ", size=6)
    await fake.wait_shown(CHAT, lambda shown: shown == ["Let me look at your notes first. 🙂"])
    await stream.status("reading notes.md…")
    assert await fake.wait_shown(CHAT, lambda shown: shown == ["⏳ reading notes.md…"])

    reply = big_reply()
    assert len(reply) > 10_000
    slowest = await feed(stream, reply, pause_s=0.01)
    assert slowest < 0.12, "appending never waits for Telegram"
    # Before the end: more than one message, each within the limit, all plain.
    streamed = await fake.wait_shown(CHAT, lambda shown: len(shown) >= 3)
    assert all(utf16_len(text) <= TELEGRAM_TEXT_LIMIT for text in streamed)
    edits_before_finish = len(fake.edits)
    assert edits_before_finish >= 4 and all("entities" not in e for e in fake.edits)
    # A message closed at the size limit keeps its text: once the next one exists, it is
    # not edited again until the end.
    streamed_history = list(fake.history)
    for i, (method, *_) in enumerate(streamed_history):
        if method == "sendMessage":
            earlier = {m for meth, _, m, _ in streamed_history[:i] if meth == "sendMessage"}
            later_edits = {m for meth, _, m, _ in streamed_history[i:] if meth == "editMessageText"}
            assert not earlier & later_edits

    await stream.finish(reply)
    chunks = render_markdown(reply)
    assert len(chunks) >= 3
    shown = fake.shown_parsed(CHAT)
    assert [m.text for m in shown] == [c.text for c in chunks]
    assert [m.entities for m in shown] == [list(c.entities) for c in chunks], "the end is formatted"
    assert any(e["type"] == "pre" for m in shown for e in m.entities)
    # Nothing sent twice: every message ever sent is visible now or was deleted.
    assert len(fake.sent) - len(fake.deleted) == len(chunks)
    assert fake.rate_limited == [], "never faster than Telegram allows"
    assert observed.count("reply") == 1 and observed.count("continued") == len(fake.sent) - 1
    assert observed.count("edit") == len(fake.edits)
    assert refs.last_ids() == fake.message_ids(CHAT)
    assert "reply_parameters" not in fake.sent[0], "DMs are answered without quoting (as send())"


async def test_status_first_then_the_answer_replaces_it_in_the_same_message(start: Start) -> None:
    channel, fake, observed = await start()
    stream = open_stream(channel, dm())
    await stream.status("searching the web…")
    assert await fake.wait_shown(CHAT, lambda shown: shown == ["⏳ searching the web…"])
    await stream.append("Found **it**")
    await fake.wait_shown(CHAT, lambda shown: shown == ["Found it"])
    await stream.finish("Found **it**: the answer.")
    [message] = fake.shown_parsed(CHAT)
    assert message.text == "Found it: the answer."
    assert message.entities == [{"type": "bold", "offset": 6, "length": 2}]
    assert len(fake.sent) == 1 and fake.deleted == []
    assert observed.count("reply") == 1 and observed.count("continued") == 0


async def test_a_short_reply_goes_out_formatted_in_one_message(start: Start) -> None:
    channel, fake, _ = await start()
    stream = open_stream(channel, in_topic(5, 77))
    await stream.finish("**Hi** there")
    [sent] = fake.sent
    assert sent["text"] == "Hi there" and sent["entities"] == [{"type": "bold", "offset": 0, "length": 2}]
    assert sent["message_thread_id"] == 9
    assert sent["reply_parameters"] == {"message_id": 77, "allow_sending_without_reply": True}
    assert fake.edits == []


async def test_the_final_text_shorter_than_the_streamed_one_removes_the_extra_messages(start: Start) -> None:
    channel, fake, _ = await start()
    stream = open_stream(channel, dm())
    draft = "\n\n".join(f"Paragraph {i}: " + "text 数据 🙂 " * 40 for i in range(40))
    await feed(stream, draft, size=200)
    await fake.wait_shown(CHAT, lambda shown: len(shown) >= 3)
    await stream.finish("Short in the end.")
    assert fake.shown(CHAT) == ["Short in the end."]
    assert len(fake.deleted) == len(fake.sent) - 1


async def test_a_status_replaces_everything_shown_before_it(start: Start) -> None:
    channel, fake, _ = await start()
    stream = open_stream(channel, dm())
    await feed(stream, "Thinking out loud. " * 600, size=300)  # over 11,000 characters
    await fake.wait_shown(CHAT, lambda shown: len(shown) >= 3)
    await stream.status("running a tool")
    assert await fake.wait_shown(CHAT, lambda shown: shown == ["⏳ running a tool"])
    await stream.append("The result.")
    await fake.wait_shown(CHAT, lambda shown: shown == ["The result."])
    await stream.finish("The result.")
    assert fake.shown(CHAT) == ["The result."]


# ---------------------------------------------------------------------------- flood control


async def test_a_429_storm_drops_nothing_and_repeats_nothing(start: Start) -> None:
    channel, fake, observed = await start()
    words = ["alpha", "数据", "🙂", "über", "naïve", "終端", "zeta", "🚀🚀"]
    text = " ".join(words[i % len(words)] + ("\n" if i % 13 == 12 else "") for i in range(2400))
    for _ in range(6):
        fake.fail_next("editMessageText", 429, retry_after=0.15)
    for _ in range(2):
        fake.fail_next("sendMessage", 429, retry_after=0.1)
    stream = open_stream(channel, dm())
    slowest = await feed(stream, text, size=25, pause_every=2, pause_s=0.004)
    assert slowest < 0.12  # below the 0.15 s retry_after: an append never waits one out
    await stream.finish(text)

    assert fake.shown(CHAT) == final_texts(text)
    assert fake.rate_limited == [], "no call before the retry_after Telegram gave"
    assert observed.count("rate_limited") == 8
    # At every moment the messages read as a beginning of the reply: nothing repeated,
    # nothing out of order, nothing lost on the way.
    whole = no_space(text)
    visible: dict[int, str] = {}
    for method, _, message_id, shown in fake.history:
        if method == "deleteMessage":
            visible.pop(message_id)
        else:
            visible[message_id] = shown
        assert whole.startswith(no_space("".join(visible[m] for m in sorted(visible))))
    assert len(fake.sent) - len(fake.deleted) == len(final_texts(text))


async def test_the_real_one_second_rule_is_kept_and_429s_are_waited_out(start: Start) -> None:
    channel, fake, observed = await start(interval_s=1.0, edit_rule_s=1.0)
    fake.fail_next("editMessageText", 429, retry_after=2)  # longer than the interval
    stream = open_stream(channel, dm())
    began = time.monotonic()
    text = "".join(f"Line {i}: 数据 🙂 step\n" for i in range(60))
    await feed(stream, text, size=8, pause_every=1, pause_s=0.02)  # about 3 s of typing
    await stream.finish(text)
    elapsed = time.monotonic() - began
    assert fake.shown(CHAT) == final_texts(text)
    assert fake.rate_limited == []
    assert observed.count("rate_limited") == 1
    edits = len(fake.edits)
    assert 1 <= edits <= elapsed + 1, "at most one edit a second"


async def test_the_interval_follows_the_running_config(start: Start) -> None:
    setting = [0.3]  # stream_interval_s as the gateway's config holds it now
    channel, fake, _ = await start(interval=lambda: setting[0], edit_rule_s=0.3)
    stream = open_stream(channel, dm())
    text = "step by step " * 80
    await feed(stream, text, size=20, pause_every=1, pause_s=0.01)
    await stream.finish(text)
    assert fake.shown(CHAT) == final_texts(text)
    assert fake.rate_limited == [], "the fixed 0.05 s was not used"


async def test_two_replies_in_one_chat_share_its_pace(start: Start) -> None:
    channel, fake, _ = await start()
    first, second = open_stream(channel, in_topic(5, 70, None)), open_stream(channel, in_topic(6, 71, None))
    text_a = "A says " + "alpha beta " * 300
    text_b = "B says " + "gamma delta " * 300
    await asyncio.gather(feed(first, text_a, size=11), feed(second, text_b, size=13))
    await asyncio.gather(first.finish(text_a), second.finish(text_b))
    assert sorted(fake.shown(GROUP)) == sorted(final_texts(text_a) + final_texts(text_b))
    assert fake.rate_limited == [], "one chat, one pace: two streams never edit too fast together"
    replies = [s.get("reply_parameters", {}).get("message_id") for s in fake.sent]
    assert sorted(r for r in replies if r) == [70, 71]


# ---------------------------------------------------------------------------- refusals


async def test_refused_formatting_at_the_end_falls_back_to_plain_text(start: Start) -> None:
    channel, fake, observed = await start()
    stream = open_stream(channel, dm())
    await stream.append("Some **bold** and a [link](https://example.org)")
    await fake.wait_shown(CHAT, lambda shown: shown == ["Some bold and a link"])
    fake.reject_formatting()
    await stream.finish("Some **bold** and a [link](https://example.org)")
    [message] = fake.shown_parsed(CHAT)
    assert (message.text, message.entities) == ("Some bold and a link", [])
    assert observed.count("plain_fallback") == 1


async def test_a_message_deleted_mid_stream_continues_in_a_new_one(start: Start) -> None:
    channel, fake, _ = await start()
    stream = open_stream(channel, dm())
    await stream.append("First part. ")
    await fake.wait_shown(CHAT, lambda shown: len(shown) == 1)
    [first_id] = fake.message_ids(CHAT)
    fake.delete_by_person(first_id)
    text = "First part. Second part."
    await stream.append("Second part.")
    await stream.finish(text)
    assert fake.shown(CHAT) == [text]
    assert fake.message_ids(CHAT) != [first_id]


async def test_unchanged_text_is_not_an_error(start: Start) -> None:
    channel, fake, _ = await start()
    stream = open_stream(channel, dm())
    await stream.append("Same text")
    await fake.wait_shown(CHAT, lambda shown: shown == ["Same text"])
    await stream.finish("Same text")  # the final edit would change nothing
    assert fake.shown(CHAT) == ["Same text"] and len(fake.sent) == 1


async def test_a_reply_that_cannot_be_shown_raises_from_finish(start: Start) -> None:
    channel, fake, _ = await start()
    fake.fail_next("sendMessage", 403, "Forbidden: bot was blocked by the user")
    stream = open_stream(channel, dm())
    await stream.append("hello")  # never raises into the agent
    with pytest.raises(Exception, match="blocked"):
        await stream.finish("hello")


# ---------------------------------------------------------------------------- crash recovery


async def test_a_resumed_reply_edits_the_messages_already_shown(start: Start) -> None:
    channel, fake, _ = await start()
    refs = Refs()
    before_crash = open_stream(channel, dm(), on_ref=refs)
    await feed(before_crash, "Half an answer " * 400, size=500)  # two messages
    await fake.wait_shown(CHAT, lambda shown: len(shown) == 2)
    shown_ids = fake.message_ids(CHAT)
    assert await refs.wait_ids(2) == shown_ids
    await channel.stop()  # the crash: the first stream's flusher is gone

    restarted, _, _ = await start(fake=fake)
    sent_before = len(fake.sent)
    resumed = open_stream(restarted, dm(), resume_ref=refs.refs[-1])
    await resumed.finish("The **whole** answer.")
    assert len(fake.sent) == sent_before, "no second reply: the one shown was edited"
    assert fake.message_ids(CHAT) == shown_ids[:1]
    assert fake.shown(CHAT) == ["The whole answer."]


async def test_a_resume_ref_for_another_chat_is_ignored(start: Start) -> None:
    channel, fake, _ = await start()
    stream = open_stream(channel, dm(), resume_ref=json.dumps({"chat_id": 1, "message_ids": [1]}))
    await stream.finish("fresh")
    assert fake.shown(CHAT) == ["fresh"] and len(fake.sent) == 1


async def test_stopping_the_channel_ends_its_streams(start: Start) -> None:
    channel, fake, _ = await start()
    fake.fail_next("sendMessage", 429, retry_after=30)  # the flusher is left waiting
    stream = open_stream(channel, dm())
    await stream.append("text")
    await fake.wait_call("sendMessage")
    assert channel._stream_tasks
    await asyncio.wait_for(channel.stop(), 3)
    assert not channel._stream_tasks
    with pytest.raises(RuntimeError, match="not started"):
        await asyncio.wait_for(stream.finish("text"), 1)


# ---------------------------------------------------------------------------- the fake


async def test_the_fake_enforces_telegram_limits() -> None:
    fake = FakeTelegram(edit_interval_s=1.0, send_burst=3, send_per_s=1.0)
    await fake.start()
    try:
        async with Bot(fake.token, base_url=fake.base_url) as bot:
            message = await bot.send_message(CHAT, "draft")
            await bot.edit_message_text("one", chat_id=CHAT, message_id=message.message_id)
            with pytest.raises(RetryAfter) as flood:
                await bot.edit_message_text("two", chat_id=CHAT, message_id=message.message_id)
            assert flood.value.retry_after == 1
            await bot.edit_message_text("other chat", chat_id=CHAT + 1,
                                        message_id=(await bot.send_message(CHAT + 1, "x")).message_id)
            await asyncio.sleep(1.0)
            with pytest.raises(BadRequest, match=r"(?i)not modified"):
                await bot.edit_message_text("one", chat_id=CHAT, message_id=message.message_id)
            with pytest.raises(BadRequest, match=r"(?i)message to edit not found"):
                await bot.edit_message_text("x", chat_id=CHAT, message_id=9999)
            with pytest.raises(BadRequest, match=r"(?i)can't parse entities"):
                await bot.edit_message_text("bad", chat_id=CHAT, message_id=message.message_id,
                                            entities=[{"type": "bold", "offset": 1, "length": 9}])
            with pytest.raises(BadRequest, match=r"(?i)too long"):
                await bot.edit_message_text("😀" * 2049, chat_id=CHAT, message_id=message.message_id)
            for n in (2, 3, 4):  # the bucket refilled while we slept: 3 at once
                await bot.send_message(CHAT, f"burst {n}")
            with pytest.raises(RetryAfter):
                await bot.send_message(CHAT, "burst 5")
            assert await bot.delete_message(CHAT, message.message_id)
            with pytest.raises(BadRequest, match=r"(?i)message to delete not found"):
                await bot.delete_message(CHAT, message.message_id)
        assert fake.rate_limited == ["editMessageText", "sendMessage"]
        assert fake.shown(CHAT) == ["burst 2", "burst 3", "burst 4"]
        assert fake.versions(message.message_id) == ["draft", "one"]
        fake.fail_next("editMessageText", 429, retry_after=2)
        async with aiohttp.ClientSession() as http:
            url = f"{fake.base_url}{fake.token}/editMessageText"
            for expected in (2, 2):  # the second call came too soon: refused again
                async with http.post(url, json={"chat_id": CHAT, "message_id": 1, "text": "y"}) as resp:
                    body = await resp.json()
                    assert resp.status == 429 and body["parameters"]["retry_after"] == expected
    finally:
        await fake.stop()


async def test_the_fake_takes_drafts_only_where_telegram_does() -> None:
    fake = FakeTelegram(draft_interval_s=1.0)
    await fake.start()
    try:
        async with Bot(fake.token, base_url=fake.base_url) as bot:
            assert await bot.send_message_draft(CHAT, 7, "Thinking about it")
            assert fake.draft(CHAT) == "Thinking about it"
            with pytest.raises(RetryAfter):  # one draft a second per chat, like edits
                await bot.send_message_draft(CHAT, 7, "Thinking about it more")
            with pytest.raises(BadRequest, match=r"(?i)textdraft_peer_invalid"):
                await bot.send_message_draft(GROUP, 7, "not in a group")
            with pytest.raises(BadRequest, match=r"(?i)draft_id_invalid"):
                await bot.send_message_draft(CHAT + 1, 0, "a draft needs an id")
            with pytest.raises(BadRequest, match=r"(?i)too long"):
                await bot.send_message_draft(CHAT + 2, 1, "😀" * 2049)
            with pytest.raises(BadRequest, match=r"(?i)can't parse entities"):
                await bot.send_message_draft(CHAT + 3, 1, "bad", entities=[{"type": "bold", "offset": 1, "length": 9}])
            assert fake.shown(CHAT) == [] and fake.sent == [], "a draft is not a message"
            await bot.send_message(CHAT, "The answer")
        assert fake.draft(CHAT) is None, "the message took the draft's place"
        assert fake.shown(CHAT) == ["The answer"]
        assert [d["text"] for d in fake.drafts] == ["Thinking about it"]
        assert fake.rate_limited == ["sendMessageDraft"]
        fake.fail_next("sendMessageDraft", 429, retry_after=2)
        async with aiohttp.ClientSession() as http:
            for method in ("sendMessageDraft", "sendMessage"):  # the wait holds for the chat's messages too
                async with http.post(f"{fake.base_url}{fake.token}/{method}",
                                     json={"chat_id": CHAT + 4, "draft_id": 1, "text": "y"}) as resp:
                    assert resp.status == 429
    finally:
        await fake.stop()


# ---------------------------------------------------------------------------- drafts and the first interval


def message_calls(fake: FakeTelegram) -> list[str]:
    """The reply's Bot API calls in order, drafts included (refused ones too)."""
    return fake.methods("sendMessageDraft", "sendMessage", "editMessageText", "deleteMessage")


async def test_auto_in_a_private_chat_grows_a_draft_then_sends_the_reply_once(start: Start) -> None:
    channel, fake, observed = await start(streaming="auto")
    refs = Refs()
    stream = open_stream(channel, dm(), on_ref=refs)
    await stream.append("Let me look ")
    await stream.append("at your notes.")
    await fake.wait_draft(CHAT, lambda text: text == "Let me look at your notes.")
    await stream.status("reading notes.md…")
    await fake.wait_draft(CHAT, lambda text: text == "⏳ reading notes.md…")
    answer = "Your notes say **three** things:\n\n- milk\n- eggs\n- `bread`"
    await feed(stream, answer, size=5)
    await fake.wait_draft(CHAT, lambda text: text == render_markdown(answer)[0].text)
    assert fake.sent == [] and refs.refs == [], "nothing is a message (nor a reference) before the end"

    await stream.finish(answer)
    calls = message_calls(fake)
    assert calls[-1] == "sendMessage" and set(calls[:-1]) == {"sendMessageDraft"}
    assert len(calls) >= 4  # text, status and answer drafts, then the message
    [message] = fake.shown_parsed(CHAT)
    [chunk] = render_markdown(answer)
    assert (message.text, message.entities) == (chunk.text, list(chunk.entities)), "sent finished, formatted"
    assert fake.edits == [] and fake.deleted == [] and fake.rate_limited == []
    assert fake.draft(CHAT) is None
    assert refs.refs and refs.last_ids() == fake.message_ids(CHAT)
    assert observed.count("reply") == 1 and observed.count("draft") == len(fake.drafts) - 1
    assert observed.count("edit") == 0 and observed.count("continued") == 0


@pytest.mark.parametrize("mode", ["auto", "draft"])
async def test_a_group_reply_still_grows_by_edits(start: Start, mode: str) -> None:
    channel, fake, _ = await start(streaming=mode)
    stream = open_stream(channel, in_topic(5, 77))
    await stream.append("First words")
    await fake.wait_shown(GROUP, lambda shown: shown == ["First words"])
    await stream.append(" and more.")
    await fake.wait_shown(GROUP, lambda shown: shown == ["First words and more."])
    await stream.finish("First words and **more**.")
    assert fake.calls_of("sendMessageDraft") == [], "Telegram has no drafts in groups"
    assert len(fake.sent) == 1 and len(fake.edits) == 2
    assert fake.sent[0]["reply_parameters"] == {"message_id": 77, "allow_sending_without_reply": True}


@pytest.mark.parametrize(("mode", "where"), [("auto", "dm"), ("draft", "dm"), ("edit", "dm"), ("auto", "group")])
async def test_a_reply_complete_within_the_first_interval_is_sent_once_at_once(
    start: Start, mode: str, where: str
) -> None:
    interval = 30.0  # an update before this would break the pace: anything the stream waited for is late
    channel, fake, observed = await start(streaming=mode, interval_s=interval, edit_rule_s=interval)
    chat, inbound = (CHAT, dm()) if where == "dm" else (GROUP, in_topic(5, 78))
    stream = open_stream(channel, inbound)
    began = time.monotonic()
    await stream.append("Sure, ")
    for _ in range(20):
        await asyncio.sleep(0)  # the stream's flusher runs between the model's pieces
    await stream.append("it is **done**.")
    await asyncio.wait_for(stream.finish("Sure, it is **done**."), 20)

    assert message_calls(fake) == ["sendMessage"], "one finished message: no draft, no edit"
    [message] = fake.shown_parsed(chat)
    assert (message.text, message.entities) == ("Sure, it is done.", [{"type": "bold", "offset": 12, "length": 4}])
    [sent_at] = fake.times_of("sendMessage")
    assert sent_at < began + interval, "sent before the stream's first update would have been allowed"
    assert observed.count("reply") == 1


async def test_the_first_words_of_a_long_reply_show_when_the_first_interval_ends(start: Start) -> None:
    channel, fake, _ = await start(streaming="edit", interval_s=0.3, edit_rule_s=0.3)
    stream = open_stream(channel, dm())
    began = time.monotonic()
    await stream.append("The first words")
    await fake.wait_shown(CHAT, lambda shown: shown == ["The first words"])
    [sent_at] = fake.times_of("sendMessage")
    assert sent_at >= began + 0.3, "held for the first interval: the reply might have been complete in it"
    await stream.append(", then the rest.")
    await stream.finish("The first words, then the rest.")
    assert fake.shown(CHAT) == ["The first words, then the rest."] and len(fake.edits) == 1


async def test_a_draft_reply_sends_its_final_text_without_waiting_for_the_next_draft(start: Start) -> None:
    setting = [FAST_S]  # stream_interval_s as the running config holds it
    channel, fake, _ = await start(streaming="auto", interval=lambda: setting[0], edit_rule_s=None)
    stream = open_stream(channel, dm())
    await stream.append("First words")
    await fake.wait_draft(CHAT, lambda text: text == "First words")
    setting[0] = 30.0  # from the next draft on, one per 30 s
    await stream.append(", more")
    await fake.wait_draft(CHAT, lambda text: text == "First words, more")
    await stream.append(" and the end.")  # the next draft is due in 30 s: the stream waits for it
    for _ in range(20):
        await asyncio.sleep(0)
    await asyncio.wait_for(stream.finish("First words, more and **the end**."), 20)
    last_draft_at = fake.times_of("sendMessageDraft")[-1]
    [sent_at] = fake.times_of("sendMessage")
    assert sent_at < last_draft_at + 30.0, "the message did not wait for the next draft's slot"
    assert fake.shown(CHAT) == ["First words, more and the end."] and fake.edits == []


async def test_a_draft_reply_past_the_size_limit_ends_as_two_messages(start: Start) -> None:
    channel, fake, observed = await start(streaming="auto")
    stream = open_stream(channel, dm())
    text = " ".join(f"word{i} 数据" for i in range(500))  # about 5,000 characters
    assert 4096 < len(text) < 8000
    await feed(stream, text, size=50)
    await fake.wait_draft(CHAT, lambda draft: draft.endswith("word499 数据"))
    await stream.finish(text)

    assert fake.shown(CHAT) == final_texts(text) and len(final_texts(text)) == 2
    assert message_calls(fake)[-2:] == ["sendMessage", "sendMessage"]
    assert fake.edits == [] and fake.deleted == [] and fake.rate_limited == []
    assert observed.count("update_fallback") == 0, "every draft fitted Telegram's limit"
    assert len({d["draft_id"] for d in fake.drafts}) == 2, "the second part grew in a draft of its own"
    assert observed.count("continued") == 1


async def test_a_429_on_a_draft_pauses_the_drafts_and_the_final_text_still_arrives(start: Start) -> None:
    channel, fake, observed = await start(streaming="auto")
    fake.fail_next("sendMessageDraft", 429, retry_after=0.3)
    stream = open_stream(channel, dm())
    await stream.append("First words.")
    await fake.wait_calls("sendMessageDraft", 1)  # refused
    await stream.append(" More words.")
    await fake.wait_draft(CHAT, lambda text: text == "First words. More words.")  # after the wait

    fake.fail_next("sendMessageDraft", 429, retry_after=0.3)
    await stream.append(" The end.")
    await fake.wait_calls("sendMessageDraft", 3)  # refused again
    fake.fail_next("sendMessage", 429, retry_after=0.3)  # and the final message once
    await stream.finish("First words. More words. **The end.**")  # waits out each retry_after

    assert fake.rate_limited == [], "no call of the chat before Telegram's retry_after"
    assert fake.shown(CHAT) == ["First words. More words. The end."]
    assert len(fake.sent) == 1 and fake.edits == []
    assert observed.count("rate_limited") == 3


@pytest.mark.parametrize("mode", ["auto", "draft"])
async def test_drafts_refused_in_a_private_chat_fall_back_to_edits(start: Start, mode: str) -> None:
    channel, fake, observed = await start(streaming=mode)
    fake.fail_next("sendMessageDraft", 400, "Bad Request: TEXTDRAFT_PEER_INVALID")
    first = open_stream(channel, dm())
    await first.append("Growing")
    await fake.wait_shown(CHAT, lambda shown: shown == ["Growing"])
    await first.append(" by edits.")
    await fake.wait_shown(CHAT, lambda shown: shown == ["Growing by edits."])
    await first.finish("Growing by **edits**.")
    assert fake.shown(CHAT) == ["Growing by edits."] and len(fake.sent) == 1
    assert observed.count("update_fallback") == 1

    drafts_before = len(fake.calls_of("sendMessageDraft"))
    second = open_stream(channel, dm(501))
    await second.append("The next reply")
    await fake.wait_shown(CHAT, lambda shown: len(shown) == 2) if mode == "auto" else await fake.wait_draft(
        CHAT, lambda text: text == "The next reply")
    await second.finish("The next reply.")
    tried_again = len(fake.calls_of("sendMessageDraft")) > drafts_before
    assert tried_again == (mode == "draft"), "auto remembers the chat that refused drafts; draft tries again"


async def test_an_unchanged_draft_is_sent_again_before_telegram_drops_it(
    start: Start, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stream_module, "DRAFT_REFRESH_S", 0.2)  # Telegram drops a draft after 30 s
    channel, fake, _ = await start(streaming="auto")
    stream = open_stream(channel, dm())
    await stream.status("running a long tool")
    await fake.wait_calls("sendMessageDraft", 3, timeout=15)  # a long tool run: the same status again
    assert {d["text"] for d in fake.drafts} == {"⏳ running a long tool"}
    await stream.finish("Done.")
    assert fake.shown(CHAT) == ["Done."] and fake.edits == []


async def test_a_resumed_draft_reply_edits_the_message_it_sent_never_a_draft(start: Start) -> None:
    channel, fake, _ = await start(streaming="auto")
    refs = Refs()
    before_crash = open_stream(channel, dm(), on_ref=refs)
    await before_crash.append("A draft that is never a message")
    await fake.wait_draft(CHAT, lambda text: text.startswith("A draft"))
    assert refs.refs == [], "a draft leaves no reference: a resumed turn has nothing to edit"
    await before_crash.finish("The answer.")
    [shown_id] = await refs.wait_ids(1)
    await channel.stop()  # a crash after the message went out, before the turn was marked answered

    restarted, _, _ = await start(fake=fake, streaming="auto")
    drafts_before = len(fake.calls_of("sendMessageDraft"))
    resumed = open_stream(restarted, dm(), resume_ref=refs.refs[-1])
    await resumed.append("The whole answer")
    await resumed.finish("The **whole** answer.")
    assert fake.message_ids(CHAT) == [shown_id] and len(fake.sent) == 1
    assert fake.shown(CHAT) == ["The whole answer."]
    assert len(fake.calls_of("sendMessageDraft")) == drafts_before, "the message is edited, not drafted over"
