"""Streamed replies through the whole gateway (SPEC §5.1): the agent streams every model
call of the fake model into the channel's ReplyStream, reasoning never reaches it, tool
steps show a status, a retried call is not shown twice, and a turn resumed after a crash
hands the stream the reference kept in the database.

The channel here is a recording one: it stands in for a platform (it shows what it is
given the way a platform would) and is not what these tests test."""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyte
import pytest
from hypothesis import given
from hypothesis import strategies as st

from channels.base import ReplyRefSink, ReplyStream, StreamingChannel
from channels.terminal.channel import BOT, TerminalChannel
from gateway.app import Gateway
from gateway.cluster.leases import SoloLeases
from gateway.config.load import load_config
from gateway.hub import ChannelHub
from gateway.ops.metrics import Metrics
from gateway.store.sqlite import Store
from gateway.tools.status import tool_status
from gateway.turns.agent import EMPTY_REPLY
from gateway.turns.streaming import RETRYING_STATUS, StepFeed, clean_reply
from gateway.types import Inbound, Message, ToolCall, inbound_to_dict
from tests.conftest import write_config
from tests.fakes.openai_server import FakeModel, StreamError

KEY = "terminal:local"


class RecordingStream:
    """Shows what it is given as a platform would: appends grow the text, a status
    replaces it (and is replaced by the next text), finish/fail set the final text."""

    def __init__(self, channel: RecordingChannel, on_ref: ReplyRefSink | None) -> None:
        self.channel = channel
        self.on_ref = on_ref
        self.events: list[tuple[str, str, float]] = []
        self.visible = ""
        self.status_shown = False
        self.ended = asyncio.get_running_loop().create_future()

    async def append(self, delta: str) -> None:
        if not self.events and self.on_ref is not None:
            await self.on_ref(f"msg-{len(self.channel.streams)}")
        self.events.append(("append", delta, time.monotonic()))
        if self.status_shown:
            self.visible, self.status_shown = "", False
        self.visible += delta

    async def status(self, line: str) -> None:
        self.events.append(("status", line, time.monotonic()))
        self.visible, self.status_shown = line, True

    async def finish(self, text: str) -> None:
        self.events.append(("finish", text, time.monotonic()))
        self.shown_before_end = "" if self.status_shown else self.visible
        self.visible = text
        self.ended.set_result(("finish", text))
        self.channel.changed.set()

    async def fail(self, text: str) -> None:
        self.events.append(("fail", text, time.monotonic()))
        self.visible = text
        self.ended.set_result(("fail", text))
        self.channel.changed.set()

    def of(self, kind: str) -> list[str]:
        return [text for k, text, _ in self.events if k == kind]


class RecordingChannel:
    name = "terminal"

    def __init__(self) -> None:
        self.streams: list[RecordingStream] = []
        self.stream_calls: list[dict[str, Any]] = []
        self.sent: list[str] = []
        self.typing_spans: list[tuple[float, float]] = []
        self.changed = asyncio.Event()  # a stream opened or ended, or a reply sent

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def is_ready(self) -> bool:
        return True

    async def send(self, inbound: Inbound, text: str) -> None:
        self.sent.append(text)
        self.changed.set()

    @asynccontextmanager
    async def typing(self, inbound: Inbound) -> AsyncIterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            self.typing_spans.append((started, time.monotonic()))

    def stream(self, inbound: Inbound, *, on_ref: ReplyRefSink | None = None,
               resume_ref: str | None = None) -> ReplyStream | None:
        self.stream_calls.append({"event": inbound.event_id, "resume_ref": resume_ref})
        stream = RecordingStream(self, on_ref)
        self.streams.append(stream)
        self.changed.set()
        return stream


class PlainChannel(RecordingChannel):
    """A channel without streaming (like Telegram with streaming "off")."""

    stream = None  # type: ignore[assignment]


async def start_gateway(tmp_path: Path, fake: FakeModel, channel: Any, **overrides: Any) -> Gateway:
    path = write_config(tmp_path, fake, **overrides)
    gw = Gateway(load_config(path), config_path=path, serve_http=False, enable_channels=False)
    gw.add_channel("terminal", channel)
    await gw.start()
    return gw


@pytest.fixture
async def gateway_with(tmp_path: Path, fake_model: FakeModel) -> AsyncIterator[Any]:
    running: list[Gateway] = []

    async def start(channel: Any, **overrides: Any) -> Gateway:
        gw = await start_gateway(tmp_path, fake_model, channel, **overrides)
        running.append(gw)
        return gw

    yield start
    for gw in running:
        await gw.stop(timeout=5)


def said(text: str, event_id: str = "e1") -> Inbound:
    return Inbound(channel="terminal", chat_id="local", user_id="local", text=text, event_id=event_id)


async def ended(stream: RecordingStream) -> tuple[str, str]:
    return await asyncio.wait_for(asyncio.shield(stream.ended), 10)


async def stored_reply(gw: Gateway) -> str:
    assert gw.services is not None
    rows = await gw.services.store.messages(KEY)
    return rows[-1].content


# -- the agent streams --------------------------------------------------------------------


async def test_text_streams_while_the_model_is_still_writing(fake_model: FakeModel, gateway_with: Any) -> None:
    channel = RecordingChannel()
    gw = await gateway_with(channel)
    chunks = ["The ", "answer ", "comes ", "in ", "six ", "pieces."]
    fake_model.reply("".join(chunks), chunks=chunks, chunk_delay=0.15)

    await gw.router.handle(said("tell me"))
    stream = await _first_stream(channel)
    assert await ended(stream) == ("finish", "The answer comes in six pieces.")

    appends = [(text, at) for kind, text, at in stream.events if kind == "append"]
    finished_at = stream.events[-1][2]
    # The first words were shown while the model was still sending the rest (5 × 0.15 s).
    assert finished_at - appends[0][1] > 0.5
    assert len(appends) >= 4
    # The pieces add up to exactly the stored reply, which is what finish() was given.
    reply = await stored_reply(gw)
    assert "".join(text for text, _ in appends) == reply == stream.shown_before_end == stream.visible
    assert channel.sent == []  # delivered once, through the stream
    assert fake_model.requests[0]["stream"] is True
    # Typing ran until the first text was shown, not after it.
    (span,) = channel.typing_spans
    assert span[1] <= appends[0][1]
    # The stream's reference was kept with the turn's event.
    assert gw.services is not None
    assert await gw.services.store.reply_ref("terminal", "e1") == "msg-1"


async def test_without_a_stream_the_reply_is_sent_whole_on_the_plain_path(
    fake_model: FakeModel, gateway_with: Any
) -> None:
    channel = PlainChannel()
    gw = await gateway_with(channel)
    fake_model.reply("<think>private musing</think>\n\nPlain answer")

    await gw.router.handle(said("hello"))
    await asyncio.wait_for(_until(channel, lambda: channel.sent), 10)

    assert channel.sent == ["Plain answer"]  # reasoning never reaches the person
    assert await stored_reply(gw) == "Plain answer"
    assert not fake_model.requests[0].get("stream")  # the fast non-streamed transport


async def test_a_tool_step_shows_a_status_in_place_of_its_text(fake_model: FakeModel, gateway_with: Any) -> None:
    channel = RecordingChannel()
    gw = await gateway_with(channel)
    fake_model.tool_call("read_file", {"path": "notes.md"}, text="Let me look at your notes.")
    fake_model.reply("Your notes are empty.")

    await gw.router.handle(said("what is in notes.md?"))
    stream = await _first_stream(channel)
    assert await ended(stream) == ("finish", "Your notes are empty.")

    kinds = [kind for kind, _, _ in stream.events]
    status_at = kinds.index("status")
    assert stream.of("status") == ["reading notes.md…"]
    # The tool step's text was shown first, then replaced by the status, then the answer.
    assert "".join(t for k, t, _ in stream.events[:status_at] if k == "append") == "Let me look at your notes."
    after = "".join(t for k, t, _ in stream.events[status_at:] if k == "append")
    assert after == await stored_reply(gw) == stream.shown_before_end


async def test_the_answer_after_the_step_limit_streams_too(fake_model: FakeModel, gateway_with: Any) -> None:
    channel = RecordingChannel()
    gw = await gateway_with(channel, agent_max_steps=1)
    fake_model.tool_call("current_time", {})
    fake_model.reply("It is late; here is my answer.")

    await gw.router.handle(said("what time is it?"))
    stream = await _first_stream(channel)
    assert await ended(stream) == ("finish", "It is late; here is my answer.")

    assert stream.of("status") == ["checking the time…"]
    assert stream.shown_before_end == "It is late; here is my answer."
    last = fake_model.requests[-1]
    assert last["stream"] is True and not last.get("tools")


async def test_reasoning_never_reaches_the_stream_or_the_store(fake_model: FakeModel, gateway_with: Any) -> None:
    channel = RecordingChannel()
    gw = await gateway_with(channel)
    chunks = ["<", "thi", "nk>the secret ", "plan</th", "ink", ">\n\nVisible", " answer <", "3"]
    fake_model.reply("".join(chunks), chunks=chunks, reasoning="provider reasoning channel")

    await gw.router.handle(said("think hard"))
    stream = await _first_stream(channel)
    assert await ended(stream) == ("finish", "Visible answer <3")

    shown = stream.of("append") + stream.of("status")
    assert shown and not any("secret" in t or "plan" in t or "think" in t or "provider" in t for t in shown)
    assert "".join(stream.of("append")) == await stored_reply(gw) == "Visible answer <3"


async def test_a_reply_that_never_closes_its_reasoning_shows_nothing_of_it(
    fake_model: FakeModel, gateway_with: Any
) -> None:
    channel = RecordingChannel()
    gw = await gateway_with(channel)
    chunks = ["<think>", "I ran out ", "of tokens while thi", "nking"]
    fake_model.reply("".join(chunks), chunks=chunks, finish_reason="length")

    await gw.router.handle(said("a hard one"))
    stream = await _first_stream(channel)
    assert await ended(stream) == ("finish", EMPTY_REPLY)

    assert stream.of("append") == []
    assert await stored_reply(gw) == EMPTY_REPLY


async def test_a_retried_stream_is_not_shown_twice(fake_model: FakeModel, gateway_with: Any) -> None:
    channel = RecordingChannel()
    gw = await gateway_with(channel)
    fake_model.script(StreamError("Half an", {"error": {"message": "upstream died", "code": 502}}))
    fake_model.reply("Half an answer, then the whole one.")

    await gw.router.handle(said("go"))
    stream = await _first_stream(channel)
    assert await ended(stream) == ("finish", "Half an answer, then the whole one.")

    assert len(fake_model.requests) == 2
    assert stream.of("status") == [RETRYING_STATUS]
    # The platform never shows the first attempt's text next to the second's.
    assert stream.shown_before_end == "Half an answer, then the whole one." == await stored_reply(gw)


async def test_an_error_reply_fails_the_stream(fake_model: FakeModel, gateway_with: Any) -> None:
    channel = RecordingChannel()
    gw = await gateway_with(channel, model=fake_model.model_settings(max_retries=0, timeout_s=10))
    fake_model.script(StreamError("Some words", {"error": {"message": "upstream died", "code": 502}}))

    await gw.router.handle(said("go"))
    stream = await _first_stream(channel)
    kind, text = await ended(stream)

    assert kind == "fail" and "internal problem" in text
    assert "".join(stream.of("append")) == "Some words" and stream.of("finish") == []
    assert channel.sent == []


# -- a turn resumed after a crash ---------------------------------------------------------


async def crashed_turn(tmp_path: Path, *, reply: str | None, ref: str | None) -> None:
    """The database as a kill mid-turn left it: event running, user message stored (and
    the final reply, when given), the stream's reference kept."""
    store = await Store.open(tmp_path / "data" / "gateway.sqlite3")
    inbound = said("are you there?", "e9")
    await store.ensure_session(KEY, KEY, "terminal")
    await store.record_event("terminal", "e9", session_key=KEY, inbound=inbound_to_dict(inbound))
    await store.add_message(KEY, Message(role="user", content="are you there?", turn=1), seq=0,
                            event=("terminal", "e9"))
    if reply is not None:
        await store.add_message(KEY, Message(role="assistant", content=reply, turn=1), seq=1)
    if ref is not None:
        await store.set_reply_ref("terminal", "e9", ref)
    await store.close()


async def test_a_resumed_turn_streams_into_the_message_already_shown(
    tmp_path: Path, fake_model: FakeModel, gateway_with: Any
) -> None:
    await crashed_turn(tmp_path, reply=None, ref="msg-41")
    channel = RecordingChannel()
    gw = await gateway_with(channel)
    stream = await _first_stream(channel)

    assert await ended(stream) == ("finish", "echo: are you there?")
    assert channel.stream_calls == [{"event": "e9", "resume_ref": "msg-41"}]
    assert channel.sent == []
    assert gw.services is not None
    store = gw.services.store
    # The event is marked answered just after the stream ends, in the turn's own task.
    for _ in range(500):
        if await store.event_status("terminal", "e9") == "answered":
            break
        await asyncio.sleep(0.01)
    assert await store.event_status("terminal", "e9") == "answered"


@pytest.mark.parametrize("ref", ["msg-42", None])
async def test_a_reply_stored_before_the_crash_is_delivered_once(
    tmp_path: Path, fake_model: FakeModel, gateway_with: Any, ref: str | None
) -> None:
    await crashed_turn(tmp_path, reply="the stored answer", ref=ref)
    channel = RecordingChannel()
    gw = await gateway_with(channel)
    assert gw.services is not None
    answered = lambda: channel.sent or (channel.streams and channel.streams[0].ended.done())  # noqa: E731
    await asyncio.wait_for(_until(channel, answered), 10)

    # Through the channel's stream either way, so the platform's message is recorded as
    # soon as it answers; into the message already shown when there is one.
    stream = await _first_stream(channel)
    assert channel.stream_calls == [{"event": "e9", "resume_ref": ref}]
    assert stream.events[-1][:2] == ("finish", "the stored answer") and channel.sent == []
    assert fake_model.requests == []


# -- the terminal -------------------------------------------------------------------------


class SlowWriter:
    """stdout for the terminal channel, remembering when each piece was written."""

    def __init__(self) -> None:
        self.writes: list[tuple[str, float]] = []

    def write(self, text: str) -> int:
        self.writes.append((text, time.monotonic()))
        return len(text)

    def flush(self) -> None: ...

    def isatty(self) -> bool:
        return False

    @property
    def text(self) -> str:
        return "".join(t for t, _ in self.writes)


async def test_the_terminal_prints_as_it_comes_and_the_answer_once(
    fake_model: FakeModel, gateway_with: Any
) -> None:
    out = SlowWriter()
    terminal = TerminalChannel(out=out)  # type: ignore[arg-type]
    assert isinstance(terminal, StreamingChannel)
    gw = await gateway_with(terminal)
    terminal.observe = gw.stream_observer("terminal")
    fake_model.tool_call("memory_search", {"query": "cats"}, text="Checking.")
    chunks = ["Cats ", "are ", "mentioned ", "twice."]
    fake_model.reply("".join(chunks), chunks=chunks, chunk_delay=0.15)

    await gw.router.handle(said("cats?"))
    reply, printed = await asyncio.wait_for(terminal.replies.get(), 10)

    assert (reply, printed) == ("Cats are mentioned twice.", True)
    assert out.text.count("Cats are mentioned twice.") == 1
    assert "searching memory…\n" in out.text
    assert out.text.endswith(f"{BOT}Cats are mentioned twice.\n\n")
    first = next(at for text, at in out.writes if "Cats" in text)
    last = next(at for text, at in out.writes if "twice" in text)
    assert last - first > 0.3  # printed as it came
    assert gw.services is not None
    assert b'gateway_stream_events_total{channel="terminal",event="reply"} 1.0' in gw.services.metrics.render()


# -- the pure parts -----------------------------------------------------------------------


class Collect:
    """The visible text of a stream, the way a platform keeps it."""

    def __init__(self) -> None:
        self.text = ""

    async def append(self, delta: str) -> None:
        self.text += delta

    async def status(self, line: str) -> None:
        self.text = ""  # replaced; the next text starts afresh


def _now(coro: Any) -> None:
    """Run a coroutine that never waits (Collect's methods) to its end."""
    try:
        coro.send(None)
    except StopIteration:
        return
    raise AssertionError("the coroutine waited")


@given(st.lists(st.sampled_from(["<think>", "</think>", "<", "think", ">", "/", "a", " ", "\n", "é", "<th", "k>"]),
                max_size=16),
       st.lists(st.integers(min_value=0, max_value=60), max_size=8))
def test_streamed_text_adds_up_to_the_stored_reply_however_it_is_split(pieces: list[str], cuts: list[int]) -> None:
    text = "".join(pieces)
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    shown = Collect()
    feed = StepFeed(shown)  # type: ignore[arg-type]
    for start, end in itertools.pairwise(bounds):
        _now(feed.text(text[start:end]))
    _now(feed.end())
    assert shown.text == clean_reply(text)
    assert "<think>" not in shown.text


def test_tool_status_lines() -> None:
    def call(name: str, arguments: str) -> ToolCall:
        return ToolCall(id="c", name=name, arguments=arguments)

    assert tool_status([call("read_file", '{"path": "notes.md"}')]) == "reading notes.md…"
    assert tool_status([call("read_file", '{"path": "a.md"}'), call("memory_search", "{}")]) == \
        "reading a.md, searching memory…"
    assert tool_status([call("weather__forecast", "not json")]) == "running weather__forecast…"
    assert tool_status([call("read_file", '{"path": "' + "d/" * 100 + 'x.md"}')]) == "reading x.md…"


def test_channels_get_the_stream_settings_they_accept(tmp_path: Path, fake_model: FakeModel) -> None:
    gw = Gateway(load_config(write_config(tmp_path, fake_model, stream_interval_s=0.25)),
                 config_path=tmp_path / "config.json")

    class Old:
        def __init__(self, handler: object) -> None: ...

    class New:
        def __init__(self, handler: object, *, observe: Any = None, stream_interval: Any = None) -> None: ...

    metrics = Metrics()
    hub = ChannelHub(leases=SoloLeases(), metrics=metrics, config=gw.holder)
    gw.services = SimpleNamespace(metrics=metrics, hub=hub)  # type: ignore[assignment]
    assert gw.stream_settings(Old, "slack") == {}
    settings = gw.stream_settings(New, "slack")
    assert settings["stream_interval"]() == 0.25
    settings["observe"]("edit")
    assert b'gateway_stream_events_total{channel="slack",event="edit"} 1.0' in gw.services.metrics.render()
    gw.services = None


# -- helpers ------------------------------------------------------------------------------


async def _until(channel: RecordingChannel, check: Any) -> None:
    while not check():
        channel.changed.clear()
        await channel.changed.wait()


async def _first_stream(channel: RecordingChannel) -> RecordingStream:
    await asyncio.wait_for(_until(channel, lambda: channel.streams), 10)
    return channel.streams[0]


async def test_the_terminal_erases_what_a_status_replaces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("shutil.get_terminal_size", lambda *a, **k: os.terminal_size((20, 24)))
    out = SlowWriter()
    terminal = TerminalChannel(out=out, tty=True)  # type: ignore[arg-type]
    stream = terminal.stream(said("x"))

    # Wrapped at words in the 15 columns after "bot> ": "Let me look" / "that up in your" /
    # "notes, one" / "moment", 4 rows.
    await stream.append("Let me look that up in your notes, one moment")
    await stream.status("reading notes.md…")
    await stream.append("Found it.")
    await stream.finish("Found it.")

    screen = out.text
    erase = "\r\033[3A\033[J"  # back to the first of the 4 rows, clear to the end of the screen
    assert screen.index(erase) < screen.index("reading notes.md…") < screen.index("Found it.")
    # What the window shows at the end: the answer once (the streamed text was replaced by
    # its rendering in place), nothing of what came before it.
    window = pyte.Screen(20, 24)
    pyte.Stream(window).feed(screen.replace("\n", "\r\n"))  # the tty's ONLCR
    assert [line.rstrip() for line in window.display if line.strip()] == ["bot> Found it."]
    assert screen.endswith("\n\n")
    assert await terminal.replies.get() == ("Found it.", True)
