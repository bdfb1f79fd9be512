"""The channel hub (gateway/hub.py): what a channel can do is looked at once, when it is
added, and every outbound call finds its channel through those typed views; the path of a
message and of an approval press never passes through the wiring (gateway/app.py)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

import gateway.app
from channels.base import ApprovalCard, OutboundFile, ReplyRefSink, ReplyStream
from gateway import hub as hub_module
from gateway.cluster.leases import SoloLeases
from gateway.config.holder import ConfigHolder
from gateway.config.load import parse_config
from gateway.hub import ChannelHub
from gateway.ops.metrics import Metrics
from gateway.types import Inbound
from tests.conftest import GatewayFactory
from tests.fakes import telegram_server
from tests.fakes.openai_server import FakeModel
from tests.fakes.telegram_server import FakeTelegram

fake_telegram = telegram_server.fake_telegram  # the fixture

CARD = ApprovalCard(id="abc234", tool="current_time", arguments="{}", who="an admin", timeout_s=30)


def said(channel: str, text: str = "hi", origin: str | None = None) -> Inbound:
    return Inbound(channel=channel, chat_id="7", user_id="7", text=text, event_id="e1", origin=origin)


class Plain:
    """The `Channel` contract and nothing more."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.sent: list[tuple[str, str]] = []
        self.started = self.stopped = 0
        self.ready = True

    async def start(self) -> None:
        self.started += 1

    async def stop(self) -> None:
        self.stopped += 1

    def is_ready(self) -> bool:
        return self.ready

    async def send(self, inbound: Inbound, text: str) -> None:
        self.sent.append((inbound.chat_id, text))

    @contextlib.asynccontextmanager
    async def typing(self, inbound: Inbound) -> AsyncIterator[None]:
        yield


class Stream:
    def __init__(self) -> None:
        self.text = ""

    async def append(self, delta: str) -> None:
        self.text += delta

    async def status(self, line: str) -> None: ...

    async def finish(self, text: str) -> None:
        self.text = text

    async def fail(self, text: str) -> None:
        self.text = text


class Rich(Plain):
    """Every capability: streams, buttons, files, DMs, one receiver per cluster."""

    def __init__(self, name: str, *, exclusive: bool = True) -> None:
        super().__init__(name)
        self.exclusive_receiver = exclusive
        self.streams: list[Stream] = []
        self.cards: list[str] = []
        self.settled: list[str] = []
        self.files: list[str] = []
        self.direct: list[tuple[str, str]] = []
        self.sides: list[str] = []
        self.webhook_path = f"/{name}/webhook"

    def stream(self, inbound: Inbound, *, on_ref: ReplyRefSink | None = None,
               resume_ref: str | None = None) -> ReplyStream | None:
        self.streams.append(Stream())
        return self.streams[-1]

    async def ask_approval(self, inbound: Inbound, card: ApprovalCard) -> str | None:
        self.cards.append(card.id)
        return f"ref-{card.id}"

    async def settle_approval(self, inbound: Inbound, card: ApprovalCard, ref: str | None, outcome: str) -> None:
        self.settled.append(f"{ref}: {outcome}")

    async def send_files(self, inbound: Inbound, files: Sequence[OutboundFile]) -> None:
        self.files += [f.name for f in files]

    async def send_direct(self, user_id: str, text: str) -> None:
        self.direct.append((user_id, text))

    async def start_sending(self) -> None:
        self.sides.append("sending")

    async def start_receiving(self) -> None:
        self.sides.append("receiving")

    async def stop_receiving(self, *, lost: bool = False) -> None:
        self.sides.append(f"stopped receiving (lost={lost})")

    async def handle_webhook(self, request: Any) -> Any: ...


class NoStream(Rich):
    """A channel whose stream is switched off in the class (like a test's plain channel)."""

    stream = None  # type: ignore[assignment]


def make_hub(tmp_path: Path, **settings: Any) -> ChannelHub:
    holder = ConfigHolder(parse_config({"model": {"name": "m", "base_url": "http://127.0.0.1:9"}, **settings}),
                          None, tmp_path)
    return ChannelHub(leases=SoloLeases(), metrics=Metrics(), config=holder)


async def test_each_call_finds_the_channel_that_can_take_it(tmp_path: Path) -> None:
    hub = make_hub(tmp_path)
    rich, plain, off = Rich("rich"), Plain("plain"), NoStream("off")
    for channel in (rich, plain, off):
        hub.add(channel.name, channel)

    stream = hub.stream(said("rich"))
    assert isinstance(stream, Stream) and rich.streams == [stream]
    assert hub.stream(said("plain")) is None and hub.stream(said("off")) is None
    assert hub.stream(said("nowhere")) is None

    assert await hub.show_approval(said("rich"), CARD) == "ref-abc234"
    await hub.settle_approval(said("rich"), CARD, "ref-abc234", "Allowed by telegram:1.")
    assert rich.cards == ["abc234"] and rich.settled == ["ref-abc234: Allowed by telegram:1."] and rich.sent == []
    # Without buttons: the card as text, answered with /allow or /deny; its outcome as a message.
    assert await hub.show_approval(said("plain"), CARD) is None
    await hub.settle_approval(said("plain"), CARD, None, "Denied by telegram:1.")
    assert plain.sent[0][1].startswith("Approval needed (abc234)") and "/allow abc234" in plain.sent[0][1]
    assert plain.sent[1] == ("7", "Approval abc234: Denied by telegram:1.")

    assert hub.sends_files("rich") and not hub.sends_files("plain")
    await hub.send_files(said("plain"), [])  # nothing to send it with: nothing happens
    assert hub.webhook("rich") is rich and hub.webhook("plain") is None
    assert hub.can_deliver("plain") and not hub.can_deliver("nowhere")


async def test_a_channel_rebuilt_with_less_loses_what_it_no_longer_has(tmp_path: Path) -> None:
    hub = make_hub(tmp_path)
    hub.add("chat", Rich("chat", exclusive=False))
    await hub.start("chat")
    assert hub.stream(said("chat")) is not None and hub.sends_files("chat")
    plain = Plain("chat")
    await hub.replace("chat", plain)
    assert hub.channels["chat"] is plain and plain.started == 1
    # The old channel's views went with it: nothing streams or sends files into the new one.
    assert hub.stream(said("chat")) is None and not hub.sends_files("chat") and hub.webhook("chat") is None
    assert not await hub.tell_person("chat:7", "hello")
    await hub.replace("chat", None)
    assert "chat" not in hub.channels and not hub.can_deliver("chat")


async def test_what_is_no_channel_is_refused_when_added(tmp_path: Path) -> None:
    hub = make_hub(tmp_path)
    with pytest.raises(TypeError):
        hub.add("x", object())  # type: ignore[arg-type]
    hub.add("x", Plain("x"))
    with pytest.raises(ValueError):
        hub.add("x", Plain("x"))


async def test_a_reply_for_a_channel_not_running_here(tmp_path: Path) -> None:
    hub = make_hub(tmp_path)
    await hub.deliver(said("gone"), "hello")  # a person's message: nothing to answer it with, logged
    with pytest.raises(ConnectionError):  # a task's turn: recorded as undelivered
        await hub.deliver(said("gone", origin="task"), "hello")
    async with hub.typing(said("gone")):
        pass


async def test_a_person_is_told_only_where_a_dm_can_reach_them(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    hub = make_hub(tmp_path, admins=["rich:1", "plain:2", "rich:3", "nowhere:4"])
    rich, plain = Rich("rich"), Plain("plain")
    hub.add("rich", rich)
    hub.add("plain", plain)
    await hub.tell_admins("config refused")
    assert rich.direct == [("1", "config refused"), ("3", "config refused")]
    assert plain.sent == []  # no DM by user id: a chat channel is never guessed at
    assert not await hub.tell_person("rich:", "no id")

    async def fails(user_id: str, text: str) -> None:
        raise RuntimeError("blocked by the user")

    monkeypatch.setattr(rich, "send_direct", fails)
    assert not await hub.tell_person("rich:1", "hello")

    async def hangs(user_id: str, text: str) -> None:
        await asyncio.Event().wait()

    monkeypatch.setattr(rich, "send_direct", hangs)
    monkeypatch.setattr(hub_module, "TELL_TIMEOUT_S", 0.05)
    assert not await hub.tell_person("rich:1", "hello")


async def test_an_exclusive_receiver_receives_where_it_leads(tmp_path: Path) -> None:
    hub = make_hub(tmp_path)
    polled, hooked, broken = Rich("polled"), Rich("hooked", exclusive=False), Plain("broken")

    async def refuses() -> None:
        raise RuntimeError("bad token")

    broken.start = refuses  # type: ignore[method-assign]
    for channel in (broken, polled, hooked):
        hub.add(channel.name, channel)
    await hub.start_all()  # one channel that fails does not keep the others down
    assert polled.sides == ["sending", "receiving"] and polled.started == 0
    assert hooked.sides == [] and hooked.started == 1
    assert hub.leader_roles() == {"polled": "leads"} and hub.leader_leases() == {"polled": "leader:polled"}
    broken.ready = False
    assert hub.readiness() == {"channel:broken": "channel broken: not connected or not receiving yet",
                               "channel:polled": None, "channel:hooked": None}

    def raises() -> bool:
        raise OSError("gone")

    hooked.is_ready = raises  # type: ignore[method-assign]
    assert hub.readiness()["channel:hooked"] == "channel hooked: readiness check failed (OSError: gone)"

    async def stuck() -> None:
        raise RuntimeError("cannot stop")

    broken.stop = stuck  # type: ignore[method-assign]
    await hub.stop_all()  # the lead is let go of first; one channel failing to stop stops nobody else
    assert polled.sides[-1] == "stopped receiving (lost=False)" and polled.stopped == 1 and hooked.stopped == 1
    assert hub.leader_roles() == {}


# -- the wiring only wires -------------------------------------------------------------------


class WiringCalls:
    """Every call of code in gateway/app.py while on, seen by the interpreter's profile hook
    (a coroutine resumed counts as a call too)."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self._file = gateway.app.__file__

    def _watch(self, frame: FrameType, event: str, _arg: object) -> None:
        if event == "call" and frame.f_code.co_filename == self._file:
            self.seen.append(frame.f_code.co_qualname)

    def __enter__(self) -> WiringCalls:
        sys.setprofile(self._watch)
        return self

    def __exit__(self, *_exc: object) -> None:
        sys.setprofile(None)


async def until(predicate: Callable[[], Any], timeout: float = 15) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.02)
    return value


async def test_a_message_and_an_approval_press_never_pass_through_the_wiring(
        make_gateway: GatewayFactory, fake_model: FakeModel, fake_telegram: FakeTelegram) -> None:
    gw = await make_gateway(**{
        "admins": ["telegram:1"], "approvals": {"tools": {"current_time": "ask"}},
        "channels": {"telegram": {"enabled": True, "token": fake_telegram.token, "base_url": fake_telegram.base_url,
                                  "base_file_url": fake_telegram.base_file_url, "poll_timeout_s": 1}}})
    await until(lambda: gw.channels["telegram"].is_ready())
    fake_model.tool_call("current_time", {"timezone": "Europe/Berlin"})
    fake_model.reply("It is noon in Berlin.", chunks=["It is ", "noon ", "in Berlin."])
    with WiringCalls() as wiring:
        # Received, placed, recorded, queued, run; the model asks for a tool that waits for a yes.
        fake_telegram.push_message(chat_id=1, user_id=1, text="what time is it in Berlin?")
        card = (await until(lambda: [m for m in fake_telegram.message_ids(1) if fake_telegram.buttons(m)]))[0]
        assert gw.services is not None
        (row,) = await gw.services.store.run("SELECT id FROM approvals WHERE decision IS NULL")
        # The admin presses Allow: decided, the card settled, the tool run, the reply streamed.
        pressed = fake_telegram.push_callback(chat_id=1, user_id=1, message_id=card, data=f"ap:{row['id']}:a")
        assert (await fake_telegram.wait_answer(pressed))["text"] == "Allowed."
        await fake_telegram.wait_shown(1, lambda texts: "It is noon in Berlin." in texts, timeout=15)
        await until(lambda: fake_telegram.buttons(card) == [])
    assert wiring.seen == []


# -- the model clients a reload swaps (gateway/model/clients.py) ------------------------------


def test_a_reload_swaps_the_model_clients_whole() -> None:
    from gateway.model.clients import Models, build_clients, client_settings

    def config(**models: Any) -> Any:
        return parse_config({"model": {"name": "main-model", "base_url": "http://127.0.0.1:9"}, "models": models})

    before = config(fast={"name": "fast-model"})
    main_counter, fast_counter, new_counter = object(), object(), object()
    models = Models(build_clients(before, lambda _record: None), main_counter,  # type: ignore[arg-type]
                    {"fast-model": fast_counter}, client_settings(before))  # type: ignore[dict-item]
    fast = models.client_for("fast")
    assert fast is not models.main and models.summary is models.main  # no summary_model: the main one
    assert models.counter_for("fast-model", "main-model") is fast_counter
    assert models.counter_for("other", "main-model") is main_counter

    after = config()  # the alias went away
    assert client_settings(after) != models.settings
    old = models.replace(build_clients(after, lambda _record: None), {}, client_settings(after))
    assert fast in old and len(old) == 2  # the caller closes them once their turns are done
    assert models.client_for("fast") is models.main  # a session still naming it gets `model`
    assert models.settings == client_settings(after)
    models.replace_counter(new_counter)  # type: ignore[arg-type]
    assert models.counter is new_counter and models.counter_for("fast-model", "main-model") is new_counter
