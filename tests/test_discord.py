"""Discord end to end: the whole gateway, with discord.py itself signed in to the fake
Discord (tests/fakes/discord_server.py: REST, the gateway websocket, the CDN, Discord's
size and rate limits), answering DMs, guild mentions and threads; exactly once across a
redelivery and a dropped websocket; streamed replies through a 429; long replies split;
images to the model; pairing; /readyz. Then the channel alone, against the same fake."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import discord
import pytest

from channels.base import ChannelHooks, ReplyStream
from channels.discord.adapter import DiscordChannel
from channels.discord.format import render_markdown
from gateway.app import Gateway
from gateway.config.schema import DiscordConfig
from gateway.keys import memory_scope, scope_dirname, workspace_dir
from gateway.types import Inbound
from tests.conftest import GatewayFactory
from tests.fakes import discord_server
from tests.fakes.discord_server import FakeDiscord
from tests.fakes.media_files import make_image
from tests.fakes.openai_server import FakeModel
from tests.test_e2e_streaming import answered, stored_reply, stream_events
from tests.test_telegram_stream import pieces

fake_discord = discord_server.fake_discord  # the fixture

PERSON, OTHER, STRANGER = 4242, 4343, 4444
FAST_S = 0.05


def discord_section(fake: FakeDiscord, **extra: Any) -> dict[str, Any]:
    return {"discord": {"enabled": True, "token": fake.token, "api_base": fake.api_base, **extra}}


async def discord_gateway(make_gateway: GatewayFactory, fake: FakeDiscord, *, section: dict[str, Any] | None = None,
                          **overrides: Any) -> Gateway:
    overrides.setdefault("access", {"dm_policy": "open"})
    gw = await make_gateway(channels=discord_section(fake, **(section or {})), **overrides)
    await fake.wait_connected()
    await until(lambda: gw.channels["discord"].is_ready())
    return gw


async def until(predicate: Callable[[], Any], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.02)


async def readyz(gw: Gateway) -> tuple[int, dict[str, Any]]:
    assert gw.http is not None
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{gw.http.port}/readyz") as resp:
        return resp.status, await resp.json(content_type=None)


def squeeze(text: str) -> str:
    return re.sub(r"\s", "", text)


def mention(fake: FakeDiscord, text: str) -> str:
    return f"<@{fake.bot_id}> {text}"


# ---------------------------------------------------------------------------- the gateway


async def test_a_dm_is_answered(fake_discord: FakeDiscord, make_gateway: GatewayFactory,
                                fake_model: FakeModel) -> None:
    gw = await discord_gateway(make_gateway, fake_discord)
    (identify,) = fake_discord.identifies
    wanted = discord.Intents(dm_messages=True, guild_messages=True, message_content=True)
    assert identify["intents"] & wanted.value == wanted.value
    assert identify["token"] == fake_discord.token

    fake_model.reply("Hello **there**!")
    mid = fake_discord.push_message(user_id=PERSON, content="hi bot", dm=True)
    dm = fake_discord.dm_channel(PERSON)
    assert await fake_discord.wait_visible(dm, lambda shown: shown == ["Hello **there**!"])
    await answered(gw, "discord", str(mid))
    assert fake_model.requests[-1]["messages"][-1]["content"] == "hi bot"
    assert gw.services is not None
    assert await gw.services.store.count_messages(f"discord:dm:{PERSON}") == 2
    (sent,) = fake_discord.sent
    assert "message_reference" not in sent, "a DM is answered without quoting"
    assert sent["allowed_mentions"] == {"parse": [], "replied_user": True}
    assert len(fake_model.requests) == 1, "the bot's own message, dispatched back, is no turn"


async def test_a_guild_mention_is_answered_and_an_unmentioned_message_ignored(
    fake_discord: FakeDiscord, make_gateway: GatewayFactory, fake_model: FakeModel
) -> None:
    channel = fake_discord.channel_id
    gw = await discord_gateway(make_gateway, fake_discord,
                               access={"allow_from": [f"discord:{channel}"]})
    quiet = fake_discord.push_message(user_id=PERSON, content="just chatting with friends")
    other_bot = fake_discord.push_message(user_id=77, content=mention(fake_discord, "ping"), bot=True,
                                          mentions=(fake_discord.bot_id,))
    fake_model.reply("Hi from the bot")
    asked = fake_discord.push_message(user_id=PERSON, content=mention(fake_discord, "what's up?"),
                                      mentions=(fake_discord.bot_id,))
    await fake_discord.wait_visible(channel, lambda shown: shown == ["Hi from the bot"])
    await answered(gw, "discord", str(asked))
    assert len(fake_model.requests) == 1  # neither the unaddressed message nor the other bot's
    assert fake_model.requests[0]["messages"][-1]["content"] == "what's up?"  # mention removed
    (reply,) = fake_discord.sent
    assert reply["message_reference"]["message_id"] == str(asked), "the reply quotes the person's message"
    assert gw.services is not None
    store = gw.services.store
    assert await store.event_status("discord", str(quiet)) in (None, "ignored")
    assert await store.event_status("discord", str(other_bot)) is None

    # A reply to one of the bot's messages addresses it too; a command after a mention is a command.
    fake_model.reply("Following up")
    followup = fake_discord.push_message(user_id=PERSON, content="and then?", reply_to=int(reply["id"]))
    await answered(gw, "discord", str(followup))
    fake_discord.push_message(user_id=OTHER, content=mention(fake_discord, "/help"), mentions=(fake_discord.bot_id,))
    shown = await fake_discord.wait_visible(channel, lambda shown: len(shown) == 3)
    assert "/context" in shown[2] and len(fake_model.requests) == 2
    assert await store.count_messages(f"discord:channel:{channel}:user:{PERSON}") == 4


async def test_a_thread_is_a_shared_session(
    fake_discord: FakeDiscord, make_gateway: GatewayFactory, fake_model: FakeModel
) -> None:
    channel = fake_discord.channel_id
    gw = await discord_gateway(make_gateway, fake_discord, access={"allow_from": [f"discord:{channel}"]})
    thread = fake_discord.add_thread(channel, name="planning")
    fake_model.reply("first answer")
    fake_model.reply("second answer")
    first = fake_discord.push_message(user_id=PERSON, channel_id=thread, content=mention(fake_discord, "plan A?"),
                                      mentions=(fake_discord.bot_id,))
    await answered(gw, "discord", str(first))
    second = fake_discord.push_message(user_id=OTHER, channel_id=thread, content=mention(fake_discord, "plan B?"),
                                       mentions=(fake_discord.bot_id,))
    await answered(gw, "discord", str(second))
    assert fake_discord.visible(thread) == ["first answer", "second answer"]
    assert fake_discord.visible(channel) == []
    key = f"discord:channel:{channel}:thread:{thread}"
    assert gw.services is not None
    assert await gw.services.store.count_messages(key) == 4  # both people, one session
    second_request = fake_model.requests[1]["messages"]
    assert "plan A?" in json.dumps(second_request), "the second person sees the thread's history"
    probe = Inbound(channel="discord", chat_id=str(channel), user_id=str(OTHER), text="", event_id="p",
                    thread_id=str(thread), is_group=True)
    assert memory_scope(probe) == f"discord:group:{channel}"

    # A thread discord.py was never told about is looked up (GET /channels/{id}) once.
    hidden = fake_discord.add_thread(channel, name="old", announce=False)
    fake_model.reply("found it")
    third = fake_discord.push_message(user_id=PERSON, channel_id=hidden, content=mention(fake_discord, "here?"),
                                      mentions=(fake_discord.bot_id,))
    await answered(gw, "discord", str(third))
    assert fake_discord.visible(hidden) == ["found it"]
    assert ("GET", f"/channels/{hidden}") in fake_discord.calls
    assert await gw.services.store.count_messages(f"discord:channel:{channel}:thread:{hidden}") == 2


async def test_a_redelivered_message_is_answered_once(
    fake_discord: FakeDiscord, make_gateway: GatewayFactory, fake_model: FakeModel
) -> None:
    gw = await discord_gateway(make_gateway, fake_discord)
    fake_model.reply("only once")
    mid = fake_discord.push_message(user_id=PERSON, content="hello", dm=True)
    await answered(gw, "discord", str(mid))
    fake_discord.redeliver(mid)
    assert gw.services is not None
    metrics = gw.services.metrics
    await until(lambda: 'gateway_dedup_hits_total{channel="discord"} 1.0' in metrics.render().decode())
    await gw.services.background.wait_idle(5)
    assert fake_discord.visible(fake_discord.dm_channel(PERSON)) == ["only once"]
    assert len(fake_model.requests) == 1


async def test_a_dropped_websocket_resumes_and_what_was_missed_is_answered_once(
    fake_discord: FakeDiscord, make_gateway: GatewayFactory, fake_model: FakeModel
) -> None:
    gw = await discord_gateway(make_gateway, fake_discord)
    fake_model.reply("before the drop")
    before = fake_discord.push_message(user_id=PERSON, content="one", dm=True)
    await answered(gw, "discord", str(before))

    fake_discord.close_gateway()  # an outage: the reconnect waits
    await fake_discord.drop_connections()
    channel = gw.channels["discord"]
    await until(lambda: not channel.is_ready())
    status, body = await readyz(gw)
    assert status == 503 and "channel discord" in json.dumps(body)
    fake_model.reply("after the drop")
    missed = fake_discord.push_message(user_id=PERSON, content="two, sent while disconnected", dm=True)
    fake_discord.open_gateway()

    await answered(gw, "discord", str(missed))
    await until(lambda: channel.is_ready())
    assert len(fake_discord.identifies) == 1, "the session was resumed, not started again"
    (resume,) = fake_discord.resumes
    assert resume["seq"] >= 3 and resume["session_id"]
    assert gw.services is not None
    await gw.services.background.wait_idle(5)
    assert fake_discord.visible(fake_discord.dm_channel(PERSON)) == ["before the drop", "after the drop"]
    assert len(fake_model.requests) == 2
    assert (await readyz(gw))[0] == 200


async def test_a_429_on_an_edit_mid_stream_drops_nothing_and_repeats_nothing(
    fake_discord: FakeDiscord, make_gateway: GatewayFactory, fake_model: FakeModel
) -> None:
    gw = await discord_gateway(make_gateway, fake_discord, stream_interval_s=0.2)
    reply = " ".join(f"word{i} 数据 🙂" for i in range(700))  # about 9,000 characters
    fake_model.reply(reply, chunks=pieces(reply, 80), chunk_delay=0.025)
    for _ in range(2):
        fake_discord.rate_limit_next("edit", 0.3)
    mid = fake_discord.push_message(user_id=PERSON, content="write a lot", dm=True)
    await answered(gw, "discord", str(mid), timeout=60)

    dm = fake_discord.dm_channel(PERSON)
    stored = await stored_reply(gw, f"discord:dm:{PERSON}")
    assert stored == reply
    assert fake_discord.visible(dm) == render_markdown(stored), "the end shows exactly the stored reply"
    assert squeeze("".join(fake_discord.visible(dm))) == squeeze(reply)
    assert fake_discord.scripted_429s == ["edit", "edit"]
    assert fake_discord.rate_limited == [], "no call before Discord allowed it"
    # At every moment the messages read as a beginning of the reply: nothing repeated.
    visible: dict[int, str] = {}
    for what, channel, message_id, text in fake_discord.history:
        if channel != dm:
            continue
        if what == "delete":
            visible.pop(message_id)
        else:
            visible[message_id] = text
        assert squeeze(reply).startswith(squeeze("".join(visible[m] for m in sorted(visible))))
    posted = [m for what, channel, m, _ in fake_discord.history if what == "post" and channel == dm]
    assert len(posted) == len(render_markdown(stored)), "each message posted once, then edited"
    events = await stream_events(gw)
    assert events[("discord", "rate_limited")] == 2
    assert events[("discord", "edit")] == len(fake_discord.edits) >= 3


async def test_a_long_answer_is_split_into_discord_sized_messages(
    fake_discord: FakeDiscord, make_gateway: GatewayFactory, fake_model: FakeModel
) -> None:
    gw = await discord_gateway(make_gateway, fake_discord, section={"streaming": "off"})
    code = "\n".join(f"    total += item_{i}  # step {i}" for i in range(20))
    prose = [" ".join(f"sentence {p}.{i} with some words" for i in range(80 - 10 * p)) for p in range(2)]
    reply = f"{prose[0]}\n\n```python\n{code}\n```\n\n{prose[1]}"  # long lines: cuts land near the limit
    assert 4_800 <= len(reply) <= 5_200
    fake_model.reply(reply)
    mid = fake_discord.push_message(user_id=PERSON, content="tell me everything", dm=True)
    await answered(gw, "discord", str(mid))
    shown = fake_discord.visible(fake_discord.dm_channel(PERSON))
    assert len(shown) >= 3 and all(len(text) <= 2000 for text in shown)
    assert shown == render_markdown(reply)
    assert all(text.count("```") % 2 == 0 for text in shown), "every message closes its code block"
    assert squeeze("".join(shown)).replace("```python", "").replace("```", "") == \
        squeeze(reply).replace("```python", "").replace("```", "")
    assert fake_discord.edits == []


async def test_an_image_reaches_the_model_as_an_image(
    fake_discord: FakeDiscord, make_gateway: GatewayFactory, fake_model: FakeModel
) -> None:
    gw = await discord_gateway(make_gateway, fake_discord,
                               model=fake_model.model_settings(max_retries=2, timeout_s=10, vision=True))
    png = make_image(800, 600)
    picture = fake_discord.add_file("screen shot.png", png, "image/png", width=800, height=600)
    fake_model.reply("A screenshot.")
    mid = fake_discord.push_message(user_id=PERSON, content="what is this?", dm=True, attachments=[picture])
    await answered(gw, "discord", str(mid))
    user = [m for m in fake_model.requests[-1]["messages"] if m["role"] == "user"][-1]["content"]
    assert user[0] == {"type": "text", "text": "what is this?\n[image: files/screen_shot.png, 800×600]"}
    assert fake_model.image_parts() == [("image/png", png)]
    assert gw.services is not None
    saved = workspace_dir(gw.services.data_dir, f"discord:user:{PERSON}") / "files" / "screen_shot.png"
    assert saved.read_bytes() == png


async def test_one_persons_large_files_never_hold_up_anyone_elses_message(
    fake_discord: FakeDiscord, make_gateway: GatewayFactory, fake_model: FakeModel
) -> None:
    """Issue 31: one message with ten large files held every other Discord user for 102 s.
    The downloads now run beside the receiving, per chat and person, a few at a time each."""
    gw = await discord_gateway(make_gateway, fake_discord)
    release = fake_discord.hold_downloads()  # every file sends 64 KB, then waits for the test
    big = [fake_discord.add_file(f"part{i}.bin", bytes([i]) * 300_000, "application/octet-stream")
           for i in range(10)]  # Discord's most attachments in one message
    files = fake_discord.push_message(user_id=PERSON, content="here are my files", dm=True, attachments=big)
    await until(lambda: fake_discord.downloads_held >= 1)
    later = fake_discord.push_message(user_id=PERSON, content="and did you get them?", dm=True)  # waits its turn
    fake_model.reply("Hello other.")
    other = fake_discord.push_message(user_id=OTHER, content="hi", dm=True)
    await answered(gw, "discord", str(other))  # while every one of the ten is still held
    assert fake_discord.downloads_held >= 1 and len(fake_model.requests) == 1
    assert "hi" in json.dumps(fake_model.requests[0]["messages"][-1])
    assert fake_discord.downloads_held <= 2 and len(fake_discord.downloads) <= 2  # a few at a time per person
    fake_model.reply("Got ten.")
    fake_model.reply("Yes.")
    release.set()
    await answered(gw, "discord", str(files))
    await answered(gw, "discord", str(later))
    first = json.dumps(fake_model.requests[1]["messages"][-1])
    assert "here are my files" in first and all(f"files/part{i}.bin" in first for i in range(10)), first
    assert "and did you get them?" in json.dumps(fake_model.requests[2]["messages"][-1])  # in its order
    assert gw.services is not None
    saved = workspace_dir(gw.services.data_dir, f"discord:user:{PERSON}") / "files"
    assert sorted(p.name for p in saved.iterdir()) == sorted(f"part{i}.bin" for i in range(10))


async def test_a_strangers_dm_gets_the_pairing_reply_and_their_file_is_never_fetched(
    fake_discord: FakeDiscord, make_gateway: GatewayFactory, fake_model: FakeModel
) -> None:
    await discord_gateway(make_gateway, fake_discord, access={"dm_policy": "pairing"}, admins=[f"discord:{PERSON}"])
    picture = fake_discord.add_file("me.png", make_image(10, 10), "image/png")
    fake_discord.push_message(user_id=STRANGER, content="hello?", dm=True, attachments=[picture])
    shown = await fake_discord.wait_visible(fake_discord.dm_channel(STRANGER), lambda shown: len(shown) == 1)
    code = re.search(r"pairing code is ([A-Z0-9]{8})", shown[0])
    assert code, shown
    assert fake_model.requests == [] and fake_discord.downloads == []

    # The admin approves; the stranger is told in their DM, opened from the user id alone.
    fake_discord.push_message(user_id=PERSON, content=f"/approve {code.group(1)}", dm=True)
    told = await fake_discord.wait_visible(fake_discord.dm_channel(STRANGER), lambda shown: len(shown) == 2)
    assert told[1].startswith("You're approved")


async def test_readyz_follows_the_websocket(
    fake_discord: FakeDiscord, make_gateway: GatewayFactory, fake_model: FakeModel
) -> None:
    fake_discord.close_gateway()  # Discord unreachable at start: signed in over REST, no websocket yet
    gw = await make_gateway(channels=discord_section(fake_discord))
    status, body = await readyz(gw)
    assert status == 503 and body["checks"]["channel:discord"] is False
    fake_discord.open_gateway()
    await fake_discord.wait_connected()
    await until(lambda: gw.channels["discord"].is_ready())
    assert (await readyz(gw))[0] == 200


# ---------------------------------------------------------------------------- the channel alone


class Router:
    """The in-test router: records every Inbound."""

    def __init__(self) -> None:
        self.inbounds: list[Inbound] = []

    async def __call__(self, inbound: Inbound) -> bool:
        self.inbounds.append(inbound)
        return True


Start = Callable[..., Awaitable[tuple[DiscordChannel, Router, list[str]]]]


@pytest.fixture
async def start(fake_discord: FakeDiscord, tmp_path: Path) -> AsyncIterator[Start]:
    channels: list[DiscordChannel] = []

    async def run(*, interval_s: float = FAST_S, **cfg: Any) -> tuple[DiscordChannel, Router, list[str]]:
        router, observed = Router(), []

        async def admits(inbound: Inbound) -> bool:
            return True

        hooks = ChannelHooks(handle=router, admits=admits,
                             workspace_for=lambda inbound: tmp_path / scope_dirname(memory_scope(inbound)),
                             file_limit=lambda: 1 << 20, stream_interval=lambda: interval_s,
                             observe=observed.append)
        values: dict[str, Any] = {"enabled": True, "token": fake_discord.token, "api_base": fake_discord.api_base}
        channel = DiscordChannel(DiscordConfig(**{**values, **cfg}), hooks)
        channels.append(channel)
        await channel.start()
        return channel, router, observed

    yield run
    for channel in channels:
        await channel.stop()


def dm_inbound(fake: FakeDiscord, user: int = PERSON) -> Inbound:
    return Inbound(channel="discord", chat_id=str(user), user_id=str(user), text="hi", event_id="1",
                   extra={"channel_id": str(fake.dm_channel(user))})


def open_stream(channel: DiscordChannel, inbound: Inbound, **kwargs: Any) -> ReplyStream:
    stream = channel.stream(inbound, **kwargs)
    assert isinstance(stream, ReplyStream)
    return stream


async def test_a_bad_token_is_refused_at_start(fake_discord: FakeDiscord, start: Start) -> None:
    with pytest.raises(discord.LoginFailure):
        await start(token="not-the-token")
    assert ("GET", "/users/@me") in fake_discord.calls
    assert fake_discord.identifies == []


async def test_discords_process_wide_base_is_left_alone(fake_discord: FakeDiscord, start: Start) -> None:
    before = discord.http.Route.BASE
    await start()
    await fake_discord.wait_connected()
    assert discord.http.Route.BASE == before == "https://discord.com/api/v10"
    assert ("GET", "/gateway/bot") in fake_discord.calls  # the websocket address came from api_base


async def test_refused_intents_are_said_and_leave_the_channel_unready(
    fake_discord: FakeDiscord, start: Start, caplog: pytest.LogCaptureFixture
) -> None:
    fake_discord.granted_intents = 0  # Message Content not switched on in the portal
    channel, _, _ = await start()
    await fake_discord.wait_for(lambda: fake_discord.identifies)
    await until(lambda: "Message Content intent" in caplog.text)
    assert not channel.is_ready()


async def test_send_carries_components_on_the_last_message(fake_discord: FakeDiscord, start: Start) -> None:
    channel, _, _ = await start()
    buttons = [{"type": 1, "components": [
        {"type": 2, "style": 3, "label": "Allow", "custom_id": "approve:1"},
        {"type": 2, "style": 4, "label": "Deny", "custom_id": "deny:1"}]}]
    await channel.send(dm_inbound(fake_discord), "word " * 500, components=buttons)
    first, last = fake_discord.sent
    assert first["components"] == [] and last["components"] == buttons


async def test_send_files_uploads_them(fake_discord: FakeDiscord, start: Start, tmp_path: Path) -> None:
    from gateway.media import ReplyFile

    channel, _, _ = await start()
    path = tmp_path / "files" / "chart.png"
    path.parent.mkdir()
    path.write_bytes(make_image(20, 20))
    await channel.send_files(dm_inbound(fake_discord),
                             [ReplyFile(tmp_path, "files/chart.png", "chart.png", path.stat().st_size, True)])
    assert fake_discord.uploads == [(fake_discord.dm_channel(PERSON), "chart.png", path.read_bytes())]


async def test_a_429_storm_on_a_stream_drops_nothing(fake_discord: FakeDiscord, start: Start) -> None:
    channel, _, observed = await start()
    words = ["alpha", "数据", "🙂", "über", "naïve", "終端", "zeta", "🚀🚀"]
    text = " ".join(words[i % 8] + ("\n" if i % 13 == 12 else "") for i in range(1600))
    for _ in range(4):
        fake_discord.rate_limit_next("edit", 0.15)
    fake_discord.rate_limit_next("post", 0.1)
    stream = open_stream(channel, dm_inbound(fake_discord))
    for i, piece in enumerate(pieces(text, 25)):
        await stream.append(piece)
        if i % 3 == 0:
            await asyncio.sleep(0.004)
    await stream.finish(text)
    dm = fake_discord.dm_channel(PERSON)
    assert fake_discord.visible(dm) == render_markdown(text)
    assert fake_discord.rate_limited == []
    assert observed.count("rate_limited") == 5
    posted = [m for what, _, m, _ in fake_discord.history if what == "post"]
    assert len(posted) - len([m for m in fake_discord.deleted if m in posted]) == len(render_markdown(text))


async def test_a_status_then_the_answer_in_the_same_message(fake_discord: FakeDiscord, start: Start) -> None:
    channel, _, observed = await start()
    stream = open_stream(channel, dm_inbound(fake_discord))
    dm = fake_discord.dm_channel(PERSON)
    await stream.status("reading notes.md…")
    assert await fake_discord.wait_visible(dm, lambda shown: shown == ["⏳ reading notes.md…"])
    await stream.append("Found | it")
    await stream.finish("| a | b |\n|---|---|\n| 1 | 2 |")
    assert fake_discord.visible(dm) == ["```\na | b\n--+--\n1 | 2\n```"]
    assert len(fake_discord.sent) == 1 and observed.count("reply") == 1


async def test_a_resumed_reply_edits_the_messages_already_shown(fake_discord: FakeDiscord, start: Start) -> None:
    channel, _, _ = await start()
    refs: list[str] = []

    async def on_ref(ref: str) -> None:
        refs.append(ref)

    first = open_stream(channel, dm_inbound(fake_discord), on_ref=on_ref)
    await first.append("partial answer before a crash")
    dm = fake_discord.dm_channel(PERSON)
    await fake_discord.wait_visible(dm, lambda shown: len(shown) == 1)
    await until(lambda: refs)
    again = open_stream(channel, dm_inbound(fake_discord), resume_ref=refs[-1])
    await again.finish("the whole answer")
    assert fake_discord.visible(dm) == ["the whole answer"]
    assert len(fake_discord.sent) == 1


async def test_a_message_deleted_mid_stream_continues_in_a_new_one(fake_discord: FakeDiscord, start: Start) -> None:
    channel, _, _ = await start()
    stream = open_stream(channel, dm_inbound(fake_discord))
    await stream.append("first words")
    dm = fake_discord.dm_channel(PERSON)
    await fake_discord.wait_visible(dm, lambda shown: shown == ["first words"])
    fake_discord.delete_by_someone(int(fake_discord.sent[0]["id"]))
    await stream.finish("first words, and the rest")
    assert fake_discord.visible(dm) == ["first words, and the rest"]


async def test_the_fake_enforces_discords_limits(fake_discord: FakeDiscord) -> None:
    headers = {"Authorization": f"Bot {fake_discord.token}", "Content-Type": "application/json"}
    url = f"{fake_discord.api_base}/channels/{fake_discord.channel_id}/messages"
    async with aiohttp.ClientSession() as http:
        async with http.post(url, json={"content": "hi"}, headers={"Authorization": "Bot wrong"}) as resp:
            assert resp.status == 401
        async with http.post(url, json={"content": "x" * 2001}, headers=headers) as resp:
            assert resp.status == 400 and (await resp.json())["code"] == 50035
        async with http.post(url, json={"content": "x" * 2000}, headers=headers) as resp:
            assert resp.status == 200
        statuses = []
        for _ in range(4):
            async with http.post(url, json={"content": "hi"}, headers=headers) as resp:
                statuses.append(resp.status)
                last = resp, await resp.json()
        assert statuses == [200] * 3 + [429]  # five calls per five seconds, the refused one included
        response, body = last
        assert body["retry_after"] > 0 and body["global"] is False
        assert response.headers["X-RateLimit-Remaining"] == "0" and int(response.headers["Retry-After"]) >= 1
        assert fake_discord.rate_limited == ["post"]
        async with http.patch(f"{url}/1", json={"content": "x"}, headers=headers) as resp:
            assert resp.status == 404 and (await resp.json())["code"] == 10008


async def test_a_notice_to_someone_known_by_id_alone_opens_their_dm(fake_discord: FakeDiscord, start: Start) -> None:
    channel, _, _ = await start()
    admin = Inbound(channel="discord", chat_id=str(OTHER), user_id=str(OTHER), text="", event_id="notice")
    assert channel.stream(admin) is None  # no DM channel known yet: the reply goes whole through send()
    await channel.send(admin, "config change refused")
    await channel.send(admin, "and another")
    assert fake_discord.visible(fake_discord.dm_channel(OTHER)) == ["config change refused", "and another"]
    assert fake_discord.calls.count(("POST", "/users/@me/channels")) == 1  # remembered after the first


async def test_lanes_keep_each_chats_order_and_run_side_by_side() -> None:
    from channels.discord.lanes import Lanes, PersonFiles

    gates = {key: asyncio.Event() for key in ("a", "b")}
    done: list[tuple[str, int]] = []

    async def run(item: tuple[str, int]) -> None:
        key, n = item
        if n == 0 and key in gates:
            await gates[key].wait()
        if n == 2 and key == "a":
            raise RuntimeError("one message failing is logged; the lane goes on")
        done.append(item)

    lanes: Lanes[tuple[str, int]] = Lanes(run, backlog=5)
    for n in range(3):
        await lanes.put("a", ("a", n))
    await lanes.put("b", ("b", 0))
    await lanes.put("b", ("b", 1))
    putting = asyncio.ensure_future(lanes.put("c", ("c", 0)))  # the backlog is full: it waits
    await asyncio.sleep(0.05)
    assert not putting.done() and len(lanes) == 5
    gates["b"].set()  # b goes on while a is held
    await until(lambda: ("c", 0) in done)
    assert done[:2] == [("b", 0), ("b", 1)] and not any(key == "a" for key, _ in done)
    gates["a"].set()
    assert await lanes.join(5)
    assert [item for item in done if item[0] == "a"] == [("a", 0), ("a", 1)]
    await lanes.close(1)

    limits = PersonFiles(at_once=2, queued=10)
    assert limits.take(1, 10) and not limits.take(1, 1) and limits.take(2, 10)
    limits.done(1, 10)
    assert limits.take(1, 1)
    inside = 0
    most = 0

    async def fetch() -> None:
        nonlocal inside, most
        async with limits.slot(1):
            inside += 1
            most = max(most, inside)
            await asyncio.sleep(0.01)
            inside -= 1

    await asyncio.gather(*(fetch() for _ in range(8)))
    assert most == 2 and limits._slots == {}
