"""`/stop` (SPEC §6) through the whole gateway: a turn stopped mid-answer closes the model's
stream (the fake model sees the client leave), cancels its tools (an MCP call the server
sees cancelled, an `exec` sandbox killed, an approval ended as "stopped"), keeps what was
shown, stored as the turn's reply with the mark, and frees the session for the next
message at once. Also the commands the model never sees: unknown `/words`, `/start`,
`/reset`.

The stopped replies stream without end (a reply of many thousand slow pieces): a session
that were not freed would never answer the next message, so each test shows the order of
events, never how long something took."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from channels.discord.format import render_markdown as discord_markdown
from channels.slack.format import clean_text, split_message, to_mrkdwn
from channels.telegram.format import render_markdown
from gateway.app import Gateway
from gateway.turns.agent import STOPPED_RESULT
from gateway.turns.commands import HELP, STOP_ANSWERS
from gateway.turns.streaming import STOPPED_MARK, stopped_reply
from tests.conftest import GatewayFactory, chat, post_chat, web_client
from tests.fakes import discord_server, slack_server
from tests.fakes.discord_server import FakeDiscord
from tests.fakes.openai_server import FakeModel, estimate_prompt_tokens, estimate_tokens
from tests.fakes.slack_server import FakeSlack
from tests.fakes.telegram_server import FakeTelegram
from tests.test_discord import PERSON, discord_gateway
from tests.test_e2e_slack import _mention
from tests.test_e2e_streaming import (
    CHAT,
    FAST_S,
    answered,
    sent_once,
    slack_gateway,
    telegram_gateway,
    telegram_section,
)
from tests.test_exec import NO_ASKING, marker, processes_with, until
from tests.test_web_api import Events, open_stream

fake_slack = slack_server.fake_slack  # the fixtures
fake_discord = discord_server.fake_discord

ENDLESS_PIECES = 100_000  # at PIECE_DELAY_S apart: longer than any test runs
PIECE_DELAY_S = 0.02
SLOW_MCP = Path(__file__).resolve().parent / "mcp_servers" / "slow_server.py"


def endless(fake: FakeModel, *, pieces: int = ENDLESS_PIECES) -> None:
    """Script a reply that streams for as long as any test runs: numbered words."""
    chunks = [f"word{i} " for i in range(pieces)]
    fake.reply("".join(chunks), chunks=chunks, chunk_delay=PIECE_DELAY_S)


def base(gw: Gateway) -> str:
    assert gw.http is not None
    return f"http://127.0.0.1:{gw.http.port}"


async def stored(gw: Gateway, key: str) -> list[tuple[str, str]]:
    """(role, content) of every stored message of the session, in order."""
    assert gw.services is not None
    return [(m.role, m.content) for m in await gw.services.store.messages(key)]


async def deltas_until(events: Events, enough: int) -> str:
    """Read delta events until `enough` have come; their text."""
    shown: list[str] = []
    while len(shown) < enough:
        event, data = await events.next(timeout=10)
        assert event == "delta", (event, data)
        shown.append(data["text"])
    return "".join(shown)


# -- the web API -----------------------------------------------------------------------------


async def test_web_stop_mid_stream_keeps_what_was_shown_and_the_next_message_goes_on(
        make_gateway: GatewayFactory, fake_model: FakeModel) -> None:
    gw = await make_gateway()
    endless(fake_model)
    async with web_client(gw) as http:
        resp = await open_stream(http, base(gw), {"session": "ann", "text": "tell me everything", "stream": True})
        events = Events(resp)
        seen = await deltas_until(events, 5)
        # A message sent meanwhile waits in the session's queue behind the running turn.
        queued = asyncio.ensure_future(chat(gw, "ann", "and then?"))
        await fake_model.wait_requests(1)
        status, body = await post_chat(gw, {"session": "ann", "text": "/stop"})
        assert (status, body["reply"]) == (200, STOP_ANSWERS["stopped"])
        rest = await events.rest()
        resp.close()
    shown = seen + "".join(data["text"] for event, data in rest if event == "delta")
    event, data = rest[-1]
    assert event == "done"
    assert data["reply"] == stopped_reply(shown) and data["reply"].endswith("\n\n" + STOPPED_MARK)
    assert shown.strip().startswith("word0 word1 word2 word3 word4")
    # The model's stream was closed, not left to run; the queued message was answered next.
    assert await fake_model.wait_disconnects(1) == [0]
    assert await asyncio.wait_for(queued, 20) == "echo: and then?"
    assert await stored(gw, "web:ann") == [
        ("user", "tell me everything"), ("assistant", data["reply"]),
        ("user", "and then?"), ("assistant", "echo: and then?")]
    # The second request carries the stopped reply as the first turn's answer.
    second = fake_model.requests[1]["messages"]
    assert [m["role"] for m in second[-3:]] == ["user", "assistant", "user"]
    assert second[-2]["content"] == data["reply"]
    # The provider reported no usage for the call cut short; the budget still counts it.
    assert gw.services is not None
    (day,) = await gw.services.store.usage_since("2000-01-01")
    assert (day.identity, day.turns) == ("web:ann", 2)
    second_turn = estimate_prompt_tokens(fake_model.requests[1]) + estimate_tokens("echo: and then?")
    assert day.tokens - second_turn > 100  # the stopped call's prompt (system prompt included) and text


async def test_stop_without_a_stream_stores_the_mark_alone(make_gateway: GatewayFactory,
                                                         fake_model: FakeModel) -> None:
    gw = await make_gateway()
    fake_model.hang(600)  # a model that takes its time; without a stream nothing is shown meanwhile
    waiting = asyncio.ensure_future(chat(gw, "bo", "a long one please"))
    await fake_model.wait_requests(1)
    assert await chat(gw, "bo", "/stop") == STOP_ANSWERS["stopped"]
    assert await asyncio.wait_for(waiting, 20) == STOPPED_MARK
    assert await fake_model.wait_disconnects(1) == [0]
    assert await stored(gw, "web:bo") == [("user", "a long one please"), ("assistant", STOPPED_MARK)]
    assert await chat(gw, "bo", "/stop") == STOP_ANSWERS["idle"]  # nothing runs now
    assert len(fake_model.requests) == 1  # no command reached the model


async def test_stop_stops_only_its_own_session(make_gateway: GatewayFactory, fake_model: FakeModel) -> None:
    gw = await make_gateway()
    fake_model.hang(600)
    waiting = asyncio.ensure_future(chat(gw, "cy", "go on and on"))
    await fake_model.wait_requests(1)
    assert await chat(gw, "dee", "/stop") == STOP_ANSWERS["idle"]
    assert not waiting.done() and fake_model.disconnects == []
    assert await chat(gw, "cy", "/stop") == STOP_ANSWERS["stopped"]
    assert await asyncio.wait_for(waiting, 20) == STOPPED_MARK


def test_the_stopped_reply_closes_an_open_code_block() -> None:
    assert stopped_reply("") == STOPPED_MARK
    assert stopped_reply("Hello \n") == f"Hello\n\n{STOPPED_MARK}"
    assert stopped_reply("Run:\n```sh\nls -") == f"Run:\n```sh\nls -\n```\n\n{STOPPED_MARK}"
    assert stopped_reply("```\na\n```\ndone") == f"```\na\n```\ndone\n\n{STOPPED_MARK}"


# -- commands that never reach the model -------------------------------------------------------


async def test_unknown_commands_start_and_reset_never_reach_the_model(make_gateway: GatewayFactory,
                                                                     fake_model: FakeModel) -> None:
    gw = await make_gateway()
    for text in ("/persona pirate", "/modle gpt", "/frobnicate", "/TMP", "/x@somebot now"):
        reply = await chat(gw, "eve", text)
        assert "unknown command" in reply and reply.endswith(HELP), (text, reply)
    assert (await chat(gw, "eve", "/persona pirate")).startswith("`/persona`: unknown command.")
    welcome = await chat(gw, "eve", "/start")
    assert welcome.startswith("Hi!") and "/help" in welcome and welcome.endswith(HELP)
    assert fake_model.requests == []
    # A `/` that is not a command word is ordinary text for the model.
    for text in ("/usr/bin is where programs live", "see /etc/hosts", "/día", "/ hello", "1/2 of it"):
        assert await chat(gw, "eve", text) == f"echo: {text}"
    assert len(fake_model.requests) == 5
    # /reset is /new: the next request starts from a fresh context.
    assert (await chat(gw, "eve", "/reset")).startswith("Started a fresh context.")
    await chat(gw, "eve", "hello again")
    assert [m["content"] for m in fake_model.requests[-1]["messages"] if m["role"] == "user"] == ["hello again"]
    assert "/stop" in HELP and "/reset" in HELP


# -- tools ------------------------------------------------------------------------------------


async def test_stop_cancels_a_running_mcp_call_on_the_server(make_gateway: GatewayFactory, fake_model: FakeModel,
                                                            tmp_path: Path) -> None:
    notes = tmp_path / "slow-notes.txt"
    gw = await make_gateway(mcp={"servers": {"slow": {"command": sys.executable, "args": [str(SLOW_MCP), str(notes)]}}})
    assert gw.mcp is not None
    await until(lambda: [s.state for s in gw.mcp.statuses()] == ["ready"], what="the MCP server ready")
    fake_model.tool_call("slow__wait", {"seconds": 300}, call_id="call_slow")
    waiting = asyncio.ensure_future(chat(gw, "fay", "wait for it"))
    await until(lambda: notes.exists() and notes.read_text() == "started\n", what="the call to start")
    assert await chat(gw, "fay", "/stop") == STOP_ANSWERS["stopped"]
    assert await asyncio.wait_for(waiting, 20) == STOPPED_MARK
    # The server was told (notifications/cancelled) and its tool ended there, unfinished.
    await until(lambda: notes.read_text() == "started\ncancelled\n", what="the server to cancel the call")
    assert [(role, content) for role, content in await stored(gw, "web:fay")] == [
        ("user", "wait for it"), ("assistant", ""), ("tool", f"error: {STOPPED_RESULT}"),
        ("assistant", STOPPED_MARK)]
    # The next turn's request is well formed (the fake model refuses unpaired tool calls).
    assert await chat(gw, "fay", "still there?") == "echo: still there?"
    assert fake_model.violations == []


async def test_stop_kills_a_running_exec(make_gateway: GatewayFactory, fake_model: FakeModel) -> None:
    gw = await make_gateway(tools={"exec": {"enabled": True, "timeout_s": 300}}, approvals=NO_ASKING)
    mark = marker()
    fake_model.tool_call("exec", {"command": f"sleep {mark} & sleep {mark}"})
    waiting = asyncio.ensure_future(chat(gw, "gus", "wait a long time"))
    await until(lambda: len(processes_with(mark)) >= 3, what="the command to start")
    assert await chat(gw, "gus", "/stop") == STOP_ANSWERS["stopped"]
    # Killed, everything it started with it, before the turn ended (and /stop answered).
    assert processes_with(mark) == []
    assert await asyncio.wait_for(waiting, 20) == STOPPED_MARK
    messages = await stored(gw, "web:gus")
    assert messages[2] == ("tool", f"error: {STOPPED_RESULT}") and messages[3] == ("assistant", STOPPED_MARK)
    assert await chat(gw, "gus", "and now?") == "echo: and now?"


async def test_stop_ends_a_pending_approval_as_stopped(make_gateway: GatewayFactory, fake_model: FakeModel) -> None:
    gw = await make_gateway(tools={"exec": {"enabled": True}}, admins=["web:hal"])  # exec asks first (the default)
    assert gw.services is not None
    mark = marker()
    fake_model.tool_call("exec", {"command": f"sleep {mark}"})
    async with web_client(gw) as http:
        resp = await open_stream(http, base(gw), {"session": "hal", "text": "run it", "stream": True})
        events = Events(resp)
        while (event := await events.next(timeout=10))[0] != "approval":
            pass
        card = event[1]
        assert await chat(gw, "hal", "/stop") == STOP_ANSWERS["stopped"]
        rest = await events.rest()
        resp.close()
    assert ("approval_done", {"id": card["id"], "outcome": "Denied: the turn was stopped."}) in rest
    assert rest[-1] == ("done", {"reply": STOPPED_MARK})
    rows = await gw.services.store.run("SELECT decision, decided_by FROM approvals WHERE id=?", (card["id"],))
    assert [(r["decision"], r["decided_by"]) for r in rows] == [("stopped", None)]
    assert processes_with(mark) == []  # never run
    # Decided: a late Allow changes nothing.
    reply = await chat(gw, "hal", f"/allow {card['id']}")
    assert "decided already" in reply
    assert processes_with(mark) == []


# -- the platforms ----------------------------------------------------------------------------


def prefix_of_the_endless_reply(text: str) -> bool:
    words = text.split()
    return bool(words) and words == [f"word{i}" for i in range(len(words))]


async def stopped_turn(gw: Gateway, key: str, question: str) -> str:
    """The stored reply of the session's first turn, checked to be a stopped one."""
    messages = await stored(gw, key)
    assert messages[0] == ("user", question)
    role, reply = messages[1]
    assert role == "assistant" and reply.endswith("\n\n" + STOPPED_MARK), reply[-200:]
    assert prefix_of_the_endless_reply(reply.removesuffix(STOPPED_MARK)), reply[:200]
    return reply


@pytest.mark.parametrize("streaming", ["edit", "auto"])  # a message edited as it grows; a draft
async def test_telegram_stop_mid_stream(make_gateway: GatewayFactory, fake_model: FakeModel, streaming: str) -> None:
    fake = FakeTelegram(edit_interval_s=FAST_S, draft_interval_s=FAST_S)
    await fake.start()
    try:
        gw = await telegram_gateway(make_gateway, fake, FAST_S, streaming=streaming)
        assert ("stop", "Stop the answer being written now") in [(c["command"], c["description"])
                                                                  for c in fake.commands]
        endless(fake_model)
        asked = fake.push_message(chat_id=CHAT, user_id=CHAT, text="tell me everything")
        if streaming == "edit":
            await fake.wait_shown(CHAT, lambda shown: any("word5" in text for text in shown), timeout=20)
        else:
            await fake.wait_draft(CHAT, lambda draft: "word5" in draft, timeout=20)
        queued = fake.push_message(chat_id=CHAT, user_id=CHAT, text="and then?")
        stop = fake.push_message(chat_id=CHAT, user_id=CHAT, text="/stop",
                                 entities=[{"type": "bot_command", "offset": 0, "length": 5}])
        await answered(gw, "telegram", str(stop))
        await answered(gw, "telegram", str(asked))
        await answered(gw, "telegram", str(queued))
        assert await fake_model.wait_disconnects(1) == [0]
        reply = await stopped_turn(gw, f"telegram:dm:{CHAT}", "tell me everything")
        # The message that grew shows what it showed, and the mark: as send() would show the reply.
        first = render_markdown(reply)
        assert fake.shown(CHAT)[:len(first)] == [chunk.text for chunk in first]
        assert sorted(fake.shown(CHAT)[len(first):]) == sorted([STOP_ANSWERS["stopped"], "echo: and then?"])
        sent_once(fake, CHAT)
        assert len(fake_model.requests) == 2  # "/stop" never reached the model
    finally:
        await fake.stop()


async def test_telegram_commands_unknown_start_and_the_bots_name(make_gateway: GatewayFactory,
                                                                 fake_model: FakeModel) -> None:
    fake = FakeTelegram(edit_interval_s=FAST_S)
    await fake.start()
    try:
        gw = await make_gateway(access={"allow_from": ["*"]}, channels=telegram_section(fake, streaming="edit"),
                                stream_interval_s=FAST_S)
        name = fake.bot_username
        for text in ("/start", "/persona pirate", f"/help@{name}", "/reset"):
            update = fake.push_message(chat_id=CHAT, user_id=CHAT, text=text,
                                       entities=[{"type": "bot_command", "offset": 0, "length": len(text.split()[0])}])
            await answered(gw, "telegram", str(update))
        welcome, unknown, listed, reset = fake.shown(CHAT)
        assert welcome.startswith("Hi!") and "/stop" in welcome
        assert unknown.startswith("/persona: unknown command.") and "/help" in unknown
        assert listed.startswith("Commands:") and "/stop" in listed
        assert reset.startswith("Started a fresh context.")
        # In a group: `/stop@thisbot` is this bot's.
        endless(fake_model)
        asked = fake.push_message(chat_id=-100, user_id=CHAT, text=f"@{name} go on", chat_type="group",
                                  entities=[{"type": "mention", "offset": 0, "length": len(name) + 1}])
        await fake_model.wait_requests(1)
        stop = fake.push_message(chat_id=-100, user_id=CHAT, text=f"/stop@{name}", chat_type="group",
                                 entities=[{"type": "bot_command", "offset": 0, "length": len(name) + 6}])
        await answered(gw, "telegram", str(stop))
        await answered(gw, "telegram", str(asked))
        assert fake.shown(-100)[-1] == STOP_ANSWERS["stopped"]
        assert len(fake_model.requests) == 1
    finally:
        await fake.stop()


async def test_slack_stop_with_the_slash_command_and_in_a_thread(make_gateway: GatewayFactory,
                                                                  fake_model: FakeModel,
                                                                  fake_slack: FakeSlack) -> None:
    gw = await slack_gateway(make_gateway, fake_slack)
    # A DM: Slack's composer makes "/stop" the slash command; the reply grows by updates.
    endless(fake_model)
    await fake_slack.push_event({"type": "message", "channel_type": "im", "user": "U5", "text": "tell me everything",
                                 "ts": "100.1", "channel": "D5"})
    await fake_slack.wait_for(lambda: any("word5" in t for t in fake_slack.visible("D5")), timeout=20)
    env = await fake_slack.push_slash_command("/stop", "", user="U5", channel="D5")
    await fake_slack.wait_acked(env)
    await answered(gw, "slack", "D5:100.1")
    await fake_slack.wait_for(lambda: fake_slack.responses or fake_slack.ephemeral)
    assert STOP_ANSWERS["stopped"] in str((fake_slack.responses or fake_slack.ephemeral)[0])
    reply = await stopped_turn(gw, "slack:dm:D5", "tell me everything")
    assert fake_slack.visible("D5") == split_message(to_mrkdwn(reply))
    assert await fake_model.wait_disconnects(1) == [0]
    # A thread (a shared session): someone else's mention-prefixed /stop stops the native stream.
    endless(fake_model)
    await fake_slack.push_event(_mention(fake_slack, "301.1", "and you?", thread_ts="300.1"))
    await fake_slack.wait_for(lambda: any("word5" in t for t in fake_slack.visible("C1", "300.1")), timeout=20)
    await fake_slack.push_event(_mention(fake_slack, "302.1", "/stop", user="U6", thread_ts="300.1"))
    await answered(gw, "slack", "C1:302.1")
    await answered(gw, "slack", "C1:301.1")
    assert await fake_model.wait_disconnects(2) == [0, 1]
    messages = await stored(gw, "slack:channel:C1:thread:300.1")
    reply = messages[1][1]
    assert reply.endswith("\n\n" + STOPPED_MARK) and prefix_of_the_endless_reply(reply.removesuffix(STOPPED_MARK))
    shown = fake_slack.visible_messages("C1", "300.1")
    assert not any(m.streaming for m in shown), "the native stream was stopped"
    assert [m.text for m in shown] == [*split_message(clean_text(reply)), STOP_ANSWERS["stopped"]]
    assert len(fake_model.requests) == 2


async def test_discord_stop_mid_stream(fake_discord: FakeDiscord, make_gateway: GatewayFactory,
                                       fake_model: FakeModel) -> None:
    gw = await discord_gateway(make_gateway, fake_discord, stream_interval_s=FAST_S)
    dm = fake_discord.dm_channel(PERSON)
    endless(fake_model)
    asked = fake_discord.push_message(user_id=PERSON, content="tell me everything", dm=True)
    await fake_discord.wait_visible(dm, lambda shown: any("word5" in t for t in shown), timeout=20)
    queued = fake_discord.push_message(user_id=PERSON, content="and then?", dm=True)
    stop = fake_discord.push_message(user_id=PERSON, content="/stop", dm=True)
    for mid in (stop, asked, queued):
        await answered(gw, "discord", str(mid))
    assert await fake_model.wait_disconnects(1) == [0]
    reply = await stopped_turn(gw, f"discord:dm:{PERSON}", "tell me everything")
    first = discord_markdown(reply)
    shown = fake_discord.visible(dm)
    assert shown[:len(first)] == first
    assert sorted(shown[len(first):]) == sorted([STOP_ANSWERS["stopped"], "echo: and then?"])
