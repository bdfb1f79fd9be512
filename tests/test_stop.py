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

import aiohttp

from gateway.app import Gateway
from gateway.turns.agent import STOPPED_RESULT
from gateway.turns.commands import HELP, STOP_ANSWERS
from gateway.turns.streaming import STOPPED_MARK, stopped_reply
from tests.conftest import GatewayFactory, chat, post_chat
from tests.fakes.openai_server import FakeModel
from tests.test_exec import NO_ASKING, marker, processes_with, until
from tests.test_web_api import Events, open_stream

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
    async with aiohttp.ClientSession() as http:
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
    async with aiohttp.ClientSession() as http:
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
