"""Every config key, changed in config.json under a running gateway: it applies live, it
restarts its channel alone, or it is saved and applies after a restart (README, "Live
changes"). One table; each row edits the file, reloads, and checks the behaviour that the
key controls on the running gateway (real model, Telegram and Slack fakes), then restores
the file. A key without a row fails the test, so a new key must say how it applies."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from zoneinfo import ZoneInfo

import aiohttp
import pytest

import gateway.config.reload
from context.outside import unfence
from gateway.app import Gateway
from gateway.config.changes import change_effect
from gateway.config.reload import ConfigWatcher
from gateway.config.schema import Config
from gateway.turns.commands import flatten
from gateway.turns.sessions import TIMEOUT_REPLY
from gateway.types import Inbound, Message
from tests.conftest import GatewayFactory
from tests.fakes import discord_server, search_server, slack_server, telegram_server, web_server
from tests.fakes.discord_server import FakeDiscord
from tests.fakes.media_files import make_image, make_ogg_opus
from tests.fakes.openai_server import ErrorReply, FakeModel, Reply, ScriptedCall
from tests.fakes.search_server import FakeSearch
from tests.fakes.slack_server import FakeSlack
from tests.fakes.telegram_server import FakeTelegram
from tests.fakes.web_server import FakeWeb

fake_telegram = telegram_server.fake_telegram  # the fixtures
fake_slack = slack_server.fake_slack
fake_web = web_server.fake_web
fake_search = search_server.fake_search
fake_discord = discord_server.fake_discord

Effect = Literal["live", "channel", "restart"]
WEB_TOKEN = "web-token-before-0123"
HOOK_SECRET = "hook-secret-0123456789abcdef"
BIG = "".join(f"line {i:04d} of a long file\n" for i in range(200))  # 5,200 characters
MEMORY = "MEMORY-MARKER-START\n" + "".join(f"remembered fact number {i}\n" for i in range(150)) + "MEMORY-MARKER-END\n"
DAY = 86_400.0
ECHO_SERVER = Path(__file__).resolve().parent / "mcp_servers" / "echo_server.py"


@dataclass
class Rig:
    gw: Gateway
    model: FakeModel
    tg: FakeTelegram
    slack: FakeSlack
    path: Path
    base_text: str
    watcher: ConfigWatcher
    web: FakeWeb
    search: FakeSearch
    discord: FakeDiscord | None = None
    base_task: str = ""  # a task scheduled at the base values

    @property
    def port(self) -> int:
        assert self.gw.http is not None
        return self.gw.http.port

    async def post(self, session: str, text: str, token: str | None = None,
                   port: int | None = None) -> tuple[int, dict[str, Any]]:
        if token is None:
            current = self.gw.cfg.channels.web.token
            token = current.get_secret_value() if current is not None else WEB_TOKEN
        async with aiohttp.ClientSession() as http:
            async with http.post(f"http://127.0.0.1:{port or self.port}/api/chat",
                                 json={"session": session, "text": text},
                                 headers={"Authorization": f"Bearer {token}"}) as resp:
                return resp.status, await resp.json(content_type=None)

    async def say(self, session: str, text: str) -> str:
        status, body = await self.post(session, text)
        assert status == 200, body
        return str(body["reply"])

    def inbound(self, session: str) -> Inbound:
        return Inbound(channel="web", chat_id=session, user_id=session, text="", event_id="probe")

    def workspace(self, session: str) -> Path:
        return self.gw.workspace_for(self.inbound(session))

    @property
    def services(self) -> Any:
        assert self.gw.services is not None
        return self.gw.services

    async def tool_result(self, session: str, name: str, args: dict[str, Any]) -> str:
        """What the model saw after asking for one tool call."""
        self.model.tool_call(name, args)
        self.model.reply("used it")
        await self.say(session, f"use {name}")
        return unfence(str([m for m in self.model.requests[-1]["messages"] if m["role"] == "tool"][-1]["content"]))

    def system(self) -> str:
        return str(self.model.requests[-1]["messages"][0]["content"])

    async def tg_reply(self, **message: Any) -> dict[str, Any]:
        """Push a Telegram message and return the bot's answer to it."""
        before = len(self.tg.sent)
        self.tg.push_message(**message)
        return (await self.tg.wait_sent(before + 1))[before]

    async def old_session(self, key: str, days: float) -> None:
        store = self.services.store
        await store.ensure_session(key, f"telegram:user:{key}", "telegram")
        await store.add_message(key, Message(role="user", content="old", turn=1,
                                             created_at=time.time() - days * DAY), seq=1)

    def aged_tool_result(self, name: str, days: float) -> Path:
        path = self.workspace("ttl") / "tool_results" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("saved output")
        when = time.time() - days * DAY
        os.utime(path, (when, when))
        return path

    async def blocked_model(self) -> tuple[asyncio.Event, list[int]]:
        """The model holds every request until the event is set; the list counts requests in flight."""
        release, in_flight = asyncio.Event(), [0]

        async def held(_body: dict[str, Any]) -> str:
            in_flight[0] += 1
            try:
                await asyncio.wait_for(release.wait(), 10)
            finally:
                in_flight[0] -= 1
            return "released"

        self.model.respond_with(held)
        return release, in_flight


async def until(predicate: Callable[[], Any], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.02)


def summary_failures(r: Rig) -> float:
    text = r.services.metrics.render().decode()
    match = re.search(r"^gateway_summary_failures_total (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


# -- probes: each shows the new value at work on the running gateway --------------------------


async def p_context_tokens(r: Rig) -> None:
    assert "of 40,000" in await r.say("ctx", "/context")


async def p_context_turns(r: Rig) -> None:
    assert re.search(r"Turns: \d+ of 7\b", await r.say("ctx", "/context"))


async def p_stream_interval(r: Rig) -> None:
    # Channels read the interval at each update: the running ones see the new value.
    for name in ("telegram", "slack"):
        assert r.gw.channels[name]._stream_interval() == 0.25


async def p_steps(r: Rig) -> None:
    def insist_on_tools(body: dict[str, Any]) -> Reply:
        if body.get("tools"):
            return Reply(tool_calls=(ScriptedCall("current_time", "{}", f"call_{len(r.model.requests)}"),))
        return Reply(text="done")

    r.model.respond_with(insist_on_tools)
    try:
        before = len(r.model.requests)
        await r.say("steps", "hi")
        sent = r.model.requests[before:]
    finally:
        r.model.respond_with(None)
    # One tool-calling step, then the answer-now call without tools.
    assert len(sent) == 2 and sent[0].get("tools") and not sent[1].get("tools")


async def p_system_prompt(r: Rig) -> None:
    await r.say("prompt", "hi")
    assert r.system().startswith("You are the table test bot.")


async def p_fallbacks(r: Rig) -> None:
    r.model.respond_with(lambda body: Reply(text="from backup") if body["model"] == "backup-model"
                         else ErrorReply(503, {"error": {"message": "overloaded", "type": "server_error"}}))
    assert await r.say("fallback", "hi") == "from backup"
    counted = f'gateway_model_fallbacks_total{{from="{r.gw.cfg.model.name}",to="backup-model"}} 1.0'
    assert counted in r.services.metrics.render().decode()


async def p_models(r: Rig) -> None:
    assert "strong" in await r.say("pick", "/model")
    assert "strong-model" in await r.say("pick", "/model strong")
    await r.say("pick", "hi")
    assert r.model.requests[-1]["model"] == "strong-model"


async def p_agents(r: Rig) -> None:
    await r.say("bound", "hi")
    assert r.system().startswith("Row helper prompt.")


async def p_bindings(r: Rig) -> None:
    await r.say("rebound", "hi")
    assert r.system().startswith("Base helper prompt.")
    await r.say("bound", "hi")  # bound no more: the top level answers there now
    assert not r.system().startswith("Base helper prompt.")


async def p_exec_unasked(r: Rig) -> None:
    assert not r.services.approvals.needed(r.gw.cfg, "exec")  # the agent consults this before each call
    assert r.services.approvals.needed(r.gw.cfg.model_copy(update={"approvals": type(r.gw.cfg.approvals)()}), "exec")


async def p_approval_tools(r: Rig) -> None:
    r.model.tool_call("current_time", {})
    r.model.reply("after the approval")
    asking = asyncio.ensure_future(r.say("approver", "what time is it?"))
    await until(lambda: bool(r.services.approvals._waiting), timeout=10)
    (approval,) = list(r.services.approvals._waiting)
    assert await r.say("boss", f"/allow {approval}") == "Allowed."
    assert await asyncio.wait_for(asking, 10) == "after the approval"


def _web_person(name: str) -> Inbound:
    return Inbound(channel="web", chat_id=name, user_id=name, text="", event_id=f"probe-{name}")


async def p_approvers(r: Rig) -> None:
    # A participant of the session may answer now, not only an admin.
    assert r.services.approvals.may_answer(r.gw.cfg, "web:helper", _web_person("helper"))
    assert not r.services.approvals.may_answer(r.gw.cfg, "web:helper", _web_person("mallory"))


async def p_approval_timeout(r: Rig) -> None:
    verdict = await r.services.approvals.ask(session="web:waiting", turn=1, inbound=_web_person("waiting"),
                                             tool="exec", arguments='{"command": "true"}')
    assert not verdict.allowed and verdict.note == "Denied: nobody answered within 0.3 s."


async def p_timezone(r: Rig) -> None:
    await r.say("zone", "hi")
    assert "(JST)" in r.system()
    assert r.services.memory.tz == ZoneInfo("Asia/Tokyo")
    assert r.gw.scheduler.next_consolidation().utcoffset().total_seconds() == 9 * 3600


async def p_retention(r: Rig) -> None:
    await r.old_session("telegram:dm:retention", days=10)
    report = await r.gw.scheduler.run_purge()
    assert report.sessions >= 1 and await r.services.store.count_messages("telegram:dm:retention") == 0


async def p_tool_result_cap(r: Rig) -> None:
    r.model.tool_call("read_file", {"path": "big.txt"})
    r.model.reply("read it")
    await r.say("tools2", "read the file")
    tool = [m for m in r.model.requests[-1]["messages"] if m["role"] == "tool"][-1]
    assert len(tool["content"]) < 2000  # cut at 1,000 plus the notice


async def p_history_cap(r: Rig) -> None:
    await r.say("tools", "and now?")
    tool = [m for m in r.model.requests[-1]["messages"] if m["role"] == "tool"][-1]
    assert len(tool["content"]) < 2000  # the earlier turn's 5,200 characters, cut for history


async def p_ttl(r: Rig) -> None:
    path = r.aged_tool_result("three-days.txt", days=3)
    await r.gw.scheduler.run_purge()
    assert not path.exists()


async def p_cron(r: Rig) -> None:
    nxt = r.gw.scheduler.next_consolidation()
    assert (nxt.hour, nxt.minute) == (4, 15)


async def p_memory_tokens(r: Rig) -> None:
    await r.say("mem", "hi")
    assert "MEMORY-MARKER-START" in r.system() and "MEMORY-MARKER-END" not in r.system()
    assert r.gw.scheduler._consolidator.target_tokens == 50


async def p_summary_timeout(r: Rig) -> None:
    for i in range(3):
        await r.say("compact", f"turn {i}")
    failures = summary_failures(r)
    r.model.hang(5)
    assert "Compacted" in await r.say("compact", "/compact")
    await until(lambda: summary_failures(r) > failures, timeout=3)  # 0.3 s, not the base 10 s


async def p_admins(r: Rig) -> None:
    assert "saved" in await r.say("eve", "/config agent_max_steps 14")


async def p_dm_policy(r: Rig) -> None:
    r.model.reply("welcome, stranger")
    assert (await r.tg_reply(chat_id=42, user_id=42, text="hello"))["text"] == "welcome, stranger"


async def p_allow_from(r: Rig) -> None:
    r.model.reply("welcome, listed")
    assert (await r.tg_reply(chat_id=43, user_id=43, text="hello"))["text"] == "welcome, listed"


async def p_group_trigger(r: Rig) -> None:
    r.model.reply("heard you")
    sent = await r.tg_reply(chat_id=-100, user_id=5, text="no mention here", chat_type="supergroup")
    assert sent["text"] == "heard you"


async def p_group_scope(r: Rig) -> None:
    r.model.reply("one session for the group")
    await r.tg_reply(chat_id=-100, user_id=6, text="hi bot", chat_type="supergroup", reply_to_bot=True)
    assert await r.services.store.count_messages("telegram:group:-100") == 2


async def p_model_name(r: Rig) -> None:
    await r.say("model", "hi")
    assert r.model.requests[-1]["model"] == "renamed-model"


async def p_model_base_url(r: Rig) -> None:
    await r.say("model", "hi")
    assert r.model.request_headers[-1]["Host"] == f"localhost:{r.model.base_url.rsplit(':', 1)[1].split('/')[0]}"


async def p_model_key(r: Rig) -> None:
    await r.say("model", "hi")
    assert r.model.request_headers[-1]["Authorization"] == "Bearer rotated-model-key"


async def p_context_window(r: Rig) -> None:
    assert f"of {10_000 - 4096:,}" in await r.say("ctx", "/context")  # window minus the output reserve


async def p_max_output(r: Rig) -> None:
    await r.say("model", "hi")
    assert r.model.requests[-1]["max_tokens"] == 1000


async def p_model_timeout(r: Rig) -> None:
    before = len(r.model.requests)
    r.model.hang(5)
    started = time.monotonic()
    await r.say("model", "hi")  # the first attempt times out at 0.3 s, the retry answers
    assert time.monotonic() - started < 3 and len(r.model.requests) == before + 2


async def p_max_retries(r: Rig) -> None:
    before = len(r.model.requests)
    r.model.error(503, {"error": {"message": "overloaded", "type": "server_error"}})
    reply = await r.say("model", "hi")
    assert len(r.model.requests) == before + 1, reply  # no retry


async def p_temperature(r: Rig) -> None:
    await r.say("model", "hi")
    assert r.model.requests[-1]["temperature"] == 0.5


async def p_summary_model(r: Rig) -> None:
    for i in range(3):
        await r.say("sum", f"turn {i}")
    assert "Compacted" in await r.say("sum", "/compact")
    await until(lambda: any(q["model"] == "summary-x" for q in r.model.requests))


async def p_model_slots(r: Rig) -> None:
    release, in_flight = await r.blocked_model()
    try:
        calls = [asyncio.ensure_future(r.say(f"slot{i}", "hi")) for i in range(2)]
        await until(lambda: in_flight[0] == 2, timeout=3)  # two at once: the new limit
    finally:
        release.set()
        r.model.respond_with(None)
    await asyncio.gather(*calls)


async def p_queue_size(r: Rig) -> None:
    release, in_flight = await r.blocked_model()
    try:
        first = asyncio.ensure_future(r.say("queue", "one"))
        await until(lambda: in_flight[0] == 1)
        second = asyncio.ensure_future(r.say("queue", "two"))  # waits in the queue (size 1)
        await until(lambda: r.gw.sessions.queued() == 1)
        assert "still working" in await r.say("queue", "three")  # the queue is full
    finally:
        release.set()
        r.model.respond_with(None)
    await asyncio.gather(first, second)


async def p_inbound_chars(r: Rig) -> None:
    status, body = await r.post("chars", "x" * 60)
    assert status == 413, body


async def p_live_sessions(r: Rig) -> None:
    for name in ("lv1", "lv2", "lv3"):
        await r.say(name, "hi")
    assert len(r.gw.sessions.live) <= 2


async def p_tokens_per_day(r: Rig) -> None:
    assert "budget of 1 tokens" in await r.say("quota", "more")


async def p_turns_per_day(r: Rig) -> None:
    assert "limit of 1 messages" in await r.say("quota", "more")


async def p_turn_timeout(r: Rig) -> None:
    r.model.hang(5)
    started = time.monotonic()
    assert await r.say("slow", "hi") == TIMEOUT_REPLY
    assert time.monotonic() - started < 3


async def p_mcp_servers(r: Rig) -> None:
    # The new server starts in the background; once it is ready the model can call it.
    await until(lambda: "live__echo" in r.services.tools.names, timeout=15)
    r.model.tool_call("live__echo", {"text": "from a live change"})
    r.model.reply("called")
    await r.say("mcp", "use it")
    tool = [m for m in r.model.requests[-1]["messages"] if m["role"] == "tool"][-1]
    assert unfence(tool["content"]) == "echo: from a live change"


async def scheduled(r: Rig, session: str, *calls: dict[str, str]) -> list[str]:
    """The results of these schedule_task calls, made in one turn of `session`."""
    r.model.tool_calls([("schedule_task", args) for args in calls])
    r.model.reply("scheduled")
    await r.say(session, "schedule these")
    return [unfence(m["content"]) for m in r.model.requests[-1]["messages"] if m["role"] == "tool"][-len(calls):]


async def p_tasks_per_scope(r: Rig) -> None:
    first, second = await scheduled(r, "tasklimit", {"prompt": "one", "at": "in 5h"},
                                    {"prompt": "two", "at": "in 6h"})
    assert first.startswith("Scheduled task") and "has 1 scheduled task already" in second


async def p_task_interval(r: Rig) -> None:
    (result,) = await scheduled(r, "taskinterval", {"prompt": "often", "every": "2m"})
    assert result.startswith("Scheduled task"), result  # refused at the base 300 s


async def p_task_grace(r: Rig) -> None:
    assert r.gw.tasks is not None and r.gw.tasks.job_grace(r.base_task) == 120  # the running job's grace


def more_skills(r: Rig) -> None:
    folder = r.path.parent / "more-skills" / "extra"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "SKILL.md").write_text("---\nname: extra\ndescription: A skill from the other folder.\n---\n")


async def p_skill_dirs(r: Rig) -> None:
    assert "- extra: A skill from the other folder." in await r.say("skills", "/skills")


async def p_log_level(r: Rig) -> None:
    assert logging.getLogger().level == logging.DEBUG


# Files people send (SPEC §5.4), from the admin's Telegram DM (user 1).

_media_ids = iter(range(1, 1000))


async def send_file(r: Rig, kind: str, content: bytes, **fields: Any) -> str:
    """Push a message with one file of `kind` (photo, voice, document); the bot's answer."""
    file_id = f"media{next(_media_ids)}"
    r.tg.add_file(file_id, content, f"{kind}s/{file_id}")
    if kind == "photo":
        fields["photo"] = [{"file_id": file_id, "file_unique_id": file_id, "width": 64, "height": 48,
                            "file_size": len(content)}]
    else:
        fields[kind] = {"file_id": file_id, "file_unique_id": file_id, "file_size": len(content),
                        **fields.pop("extra", {})}
    return str((await r.tg_reply(chat_id=1, user_id=1, **fields))["text"])


async def send_voice(r: Rig) -> str:
    return await send_file(r, "voice", make_ogg_opus(1), extra={"duration": 1, "mime_type": "audio/ogg"})


async def p_vision(r: Rig) -> None:
    await send_file(r, "photo", make_image(64, 48, fmt="JPEG"), caption="look")
    assert [mime for mime, _ in r.model.image_parts()] == ["image/jpeg"]


async def p_transcription_off(r: Rig) -> None:
    before = len(r.model.transcriptions)
    assert "speech to text is turned off here" in await send_voice(r)
    assert len(r.model.transcriptions) == before


async def p_transcription_model(r: Rig) -> None:
    assert (await send_voice(r)).startswith("echo: [voice message, 0:01]")
    assert r.model.transcriptions[-1]["model"] == "whisper-large-v3"


async def p_transcription_base_url(r: Rig) -> None:
    await send_voice(r)
    port = r.model.base_url.rsplit(":", 1)[1].split("/")[0]
    assert r.model.transcriptions[-1]["headers"]["Host"] == f"localhost:{port}"
    assert r.model.transcriptions[-1]["headers"]["Authorization"] == "Bearer base-stt-key"


async def p_transcription_key(r: Rig) -> None:
    await send_voice(r)
    assert r.model.transcriptions[-1]["headers"]["Authorization"] == "Bearer rotated-stt-key"


async def p_transcription_timeout(r: Rig) -> None:
    r.model.transcribe(hang=5)
    started = time.monotonic()
    assert "did not answer within 0.3 seconds" in await send_voice(r)
    assert time.monotonic() - started < 3


async def p_file_limit(r: Rig) -> None:
    answer = await send_file(r, "document", b"z" * 5000, extra={"file_name": "five.bin"})
    assert answer == "I couldn't take five.bin: it is larger than 1 KB, the most I accept (limits.max_inbound_file_mb)."


async def p_web_token(r: Rig) -> None:
    assert (await r.post("tok", "hi", token=WEB_TOKEN))[0] == 401  # the old token stops working at once
    assert (await r.post("tok", "hi", token="web-token-after-4567"))[0] == 200


async def p_admin_token(r: Rig) -> None:
    url = f"http://127.0.0.1:{r.port}/admin/api/status"
    async with aiohttp.ClientSession() as http:
        async with http.get(url, headers={"Authorization": "Bearer admin-token-after-0123456789"}) as resp:
            assert resp.status == 200  # the page was off at start: on at once
        async with http.get(url, headers={"Authorization": f"Bearer {WEB_TOKEN}"}) as resp:
            assert resp.status == 401


async def p_no_web_fetch(r: Rig) -> None:
    await r.say("web", "hi")
    names = [t["function"]["name"] for t in r.model.requests[-1]["tools"]]
    assert "web_fetch" not in names and "web_search" in names


async def p_fetch_max_bytes(r: Rig) -> None:
    result = await r.tool_result("web", "web_fetch", {"url": r.web.base_url + "/big.txt"})
    assert "only the first 2,000 bytes were read" in result and len(result) < 2500


async def p_fetch_timeout(r: Rig) -> None:
    result = await r.tool_result("web", "web_fetch", {"url": r.web.base_url + "/slow"})
    assert result.endswith("did not answer within 0.3 s (tools.web_fetch.timeout_s)"), result


async def p_fetch_private(r: Rig) -> None:
    result = await r.tool_result("web", "web_fetch", {"url": r.web.base_url + "/big.txt"})
    assert result.startswith("error: refused: 127.0.0.1 is a loopback address"), result


async def p_search_provider(r: Rig) -> None:
    result = await r.tool_result("web", "web_search", {"query": "otters", "count": 2})
    assert r.search.requests[-1]["provider"] == "tavily" and result.startswith("1. Result 1"), result


async def p_search_base_url(r: Rig) -> None:
    result = await r.tool_result("web", "web_search", {"query": "otters"})
    assert r.search.requests[-1]["headers"]["Host"] == r.search.base_url.replace("http://127.0.0.1", "localhost")
    assert result.startswith("1. Result 1"), result


async def p_search_key(r: Rig) -> None:
    result = await r.tool_result("web", "web_search", {"query": "otters"})
    assert r.search.requests[-1]["headers"]["X-Subscription-Token"] == "rotated-search-key"
    assert result.startswith("1. Result 1"), result


async def p_no_exec(r: Rig) -> None:
    await r.say("exec", "hi")
    assert "exec" not in [t["function"]["name"] for t in r.model.requests[-1]["tools"]]


async def p_exec_network(r: Rig) -> None:
    # On, the sandbox has a network of its own (an interface the network stack connects);
    # the host's loopback stays out of reach (tests/test_sandbox.py).
    probe = "python3 -c \"print(open('/proc/net/dev').read().count('eth0:'))\""
    result = await r.tool_result("exec", "exec", {"command": probe})
    assert result == "exit code 0\n--- stdout ---\n1", result


async def p_exec_timeout(r: Rig) -> None:
    result = await r.tool_result("exec", "exec", {"command": "sleep 30"})
    assert result.startswith("timed out after 0.5 s (tools.exec.timeout_s)"), result


async def p_exec_memory(r: Rig) -> None:
    result = await r.tool_result("exec", "exec", {"command": "grep 'Max address space' /proc/self/limits"})
    assert f"Max address space         {64 << 20}" in result, result


async def p_exec_disk(r: Rig) -> None:
    result = await r.tool_result("exec", "exec", {"command": "grep 'Max file size' /proc/self/limits"})
    found = re.search(r"Max file size\s+(\d+)", result)
    assert found and 0 < int(found.group(1)) <= 2 << 20, result  # what is left of the 2 MB


async def p_delegate_per_step(r: Rig) -> None:
    r.model.tool_calls([("delegate", {"task": "one"}), ("delegate", {"task": "two"})])
    r.model.reply("sub done")
    r.model.reply("used it")
    await r.say("delegates", "go")
    results = [unfence(str(m["content"])) for m in r.model.requests[-1]["messages"] if m["role"] == "tool"]
    assert results[-2] == "sub done" and results[-1].startswith("error: not run: at most 1 delegate calls"), results


async def p_delegate_per_turn(r: Rig) -> None:
    r.model.tool_call("delegate", {"task": "one"})
    r.model.reply("sub done")
    r.model.tool_call("delegate", {"task": "two"})
    r.model.reply("used it")
    await r.say("delegates_turn", "go")
    results = [unfence(str(m["content"])) for m in r.model.requests[-1]["messages"] if m["role"] == "tool"]
    assert results[-2] == "sub done" and results[-1].startswith("error: not run: this message has run 1"), results


# Restart-only keys: the running gateway keeps the value it started with.

async def p_data_dir(r: Rig) -> None:
    await r.say("dd", "hi")
    assert r.services.data_dir == r.path.parent / "data"
    assert r.workspace("dd").is_relative_to(r.path.parent / "data")
    assert not (r.path.parent / "data-elsewhere").exists()


async def p_store_url(r: Rig) -> None:
    # The running gateway keeps its database (SQLite here) until it restarts.
    assert await r.say("dburl", "hi")
    assert r.services.store.path == r.path.parent / "data" / "gateway.sqlite3"


async def p_still_serving(r: Rig) -> None:
    assert await r.say("serving", "hi")


async def p_nothing_to_see(r: Rig) -> None:
    pass  # read only when `gateway chat` starts (tests/test_config.py checks it refuses)


# Channel keys: the channel was restarted with the new settings (checked for every row).

async def p_tg_gone(r: Rig) -> None:
    assert "telegram" not in r.gw.channels


async def p_slack_gone(r: Rig) -> None:
    assert "slack" not in r.gw.channels


async def p_tg_webhook(r: Rig) -> None:
    await until(lambda: r.tg.webhook is not None)
    assert r.tg.webhook is not None and r.tg.webhook["secret_token"] == HOOK_SECRET


async def p_tg_poll_timeout(r: Rig) -> None:
    await until(lambda: any(str(c.get("timeout")) == "2" for c in r.tg.calls_of("getUpdates")))


async def p_tg_receives(r: Rig) -> None:
    polls = len(r.tg.calls_of("getUpdates"))
    await until(lambda: len(r.tg.calls_of("getUpdates")) > polls)  # polling with the new settings


async def p_slack_receives(r: Rig) -> None:
    await until(lambda: r.gw.channels["slack"].is_ready())  # signed in (and its socket up) with the new settings


async def p_discord_gone(r: Rig) -> None:
    assert "discord" not in r.gw.channels


async def p_discord_receives(r: Rig) -> None:
    assert r.discord is not None
    # Signed in and its websocket up again with the new settings: a new IDENTIFY.
    await until(lambda: r.gw.channels["discord"].is_ready() and r.discord is not None and r.discord.connected() == 1)
    assert r.discord.identifies[-1]["token"] == r.gw.cfg.channels.discord.token.get_secret_value()


async def p_discord_streaming_off(r: Rig) -> None:
    await p_discord_receives(r)
    probe = Inbound(channel="discord", chat_id="1", user_id="1", text="", event_id="probe", extra={"channel_id": "5"})
    assert r.gw.channels["discord"].stream(probe) is None


async def p_slack_reply_to_mode(r: Rig) -> None:
    await p_slack_receives(r)
    ts = f"{time.time():.6f}"
    await r.slack.push_event({"type": "app_mention", "user": "U5", "text": f"<@{r.slack.bot_user_id}> hi",
                              "ts": ts, "channel": "C9", "channel_type": "channel"})
    # Recorded (then ignored: C9 is not allowed) in the channel's top-level session, not a thread of its own.
    deadline = time.monotonic() + 5
    while not (rows := await r.services.store.run("SELECT session_key FROM events WHERE channel='slack' "
                                                  "AND event_id=?", (f"C9:{ts}",))):
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.02)
    assert rows[0][0] == "slack:channel:C9:user:U5"


async def p_hooks(r: Rig) -> None:
    from gateway.hooks import sign

    body = b"build 12 passed"
    before = len(r.tg.sent)
    async with aiohttp.ClientSession() as http:
        async with http.post(f"http://127.0.0.1:{r.port}/hooks/ci", data=body,
                             headers={"X-Hub-Signature-256": sign(HOOK_SECRET, body), "X-Request-Id": "row-1",
                                      "Content-Type": "text/plain"}) as resp:
            assert resp.status == 202, await resp.text()
    sent = (await r.tg.wait_sent(before + 1))[before]
    assert sent["chat_id"] == 43 and sent["text"].startswith("echo: CI says: <<<OUTSIDE ")
    assert unfence(sent["text"].removeprefix("echo: CI says: ")) == "build 12 passed"


def rotate(fake: str, attribute: str, value: str) -> tuple[Callable[[Rig], None], Callable[[Rig], None]]:
    """The platform accepts only the new credential while the row runs."""
    saved: list[str] = []

    def arrange(r: Rig) -> None:
        server = getattr(r, fake)
        saved.append(getattr(server, attribute))
        setattr(server, attribute, value)

    def undo(r: Rig) -> None:
        setattr(getattr(r, fake), attribute, saved.pop())

    return arrange, undo


def localhost(url: str) -> str:
    return url.replace("127.0.0.1", "localhost")


@dataclass
class Row:
    key: str
    value: Any  # or a function of the rig
    effect: Effect
    probe: Callable[[Rig], Awaitable[None]]
    around: tuple[Callable[[Rig], None], Callable[[Rig], None]] | None = None  # before the change, after the restore


ROWS = [
    Row("agent_max_context_tokens", 40_000, "live", p_context_tokens),
    Row("agent_max_context_turns", 7, "live", p_context_turns),
    Row("agent_max_steps", 1, "live", p_steps),
    Row("stream_interval_s", 0.25, "live", p_stream_interval),
    Row("system_prompt", "You are the table test bot.", "live", p_system_prompt),
    Row("data_dir", "data-elsewhere", "restart", p_data_dir),
    Row("store.url", "postgresql://gateway:secret@127.0.0.1:1/gateway", "restart", p_store_url),
    Row("timezone", "Asia/Tokyo", "live", p_timezone),
    Row("session_retention_days", 5, "live", p_retention),
    Row("tool_result_max_chars", 1000, "live", p_tool_result_cap),
    Row("history_tool_result_max_chars", 1000, "live", p_history_cap),
    Row("tool_result_ttl_days", 1, "live", p_ttl),
    Row("memory_consolidation_cron", "15 4 * * *", "live", p_cron),
    Row("memory_max_tokens", 50, "live", p_memory_tokens),
    Row("summary_timeout_s", 0.3, "live", p_summary_timeout),
    Row("admins", ["web:boss", "telegram:1", "web:eve"], "live", p_admins),
    Row("access.dm_policy", "open", "live", p_dm_policy),
    Row("access.allow_from", ["telegram:-100", "telegram:43"], "live", p_allow_from),
    Row("access.group_trigger", "all", "live", p_group_trigger),
    Row("group_session_scope", "group", "live", p_group_scope),
    Row("model.name", "renamed-model", "live", p_model_name),
    Row("model.base_url", lambda r: localhost(r.model.base_url), "live", p_model_base_url),
    Row("model.api_key", "rotated-model-key", "live", p_model_key),
    Row("model.context_window", 10_000, "live", p_context_window),
    Row("model.max_output_tokens", 1000, "live", p_max_output),
    Row("model.timeout_s", 0.3, "live", p_model_timeout),
    Row("model.max_retries", 0, "live", p_max_retries),
    Row("model.temperature", 0.5, "live", p_temperature),
    Row("model.vision", True, "live", p_vision),
    Row("model.fallbacks", ["backup"], "live", p_fallbacks),
    Row("approvals.tools.exec", "allow", "live", p_exec_unasked),
    Row("approvals.approvers", "participants", "live", p_approvers),
    Row("approvals.timeout_s", 0.3, "live", p_approval_timeout),
    Row("models", {"backup": {"name": "backup-model"}, "strong": {"name": "strong-model"}}, "live", p_models),
    Row("agents", {"helper": {"system_prompt": "Row helper prompt."}}, "live", p_agents),
    Row("bindings", [{"match": {"channel": "web", "chat": "rebound"}, "agent": "helper"}], "live", p_bindings),
    Row("summary_model", lambda r: {"name": "summary-x", "base_url": r.model.base_url, "api_key": "sk-summary"},
        "live", p_summary_model),
    Row("channels.telegram.enabled", False, "channel", p_tg_gone),
    Row("channels.telegram.token", "999:other-token", "channel", p_tg_receives,
        rotate("tg", "token", "999:other-token")),
    Row("channels.telegram.mode", "webhook", "channel", p_tg_webhook),
    Row("channels.telegram.base_url", lambda r: localhost(r.tg.base_url), "channel", p_tg_receives),
    Row("channels.telegram.base_file_url", lambda r: localhost(r.tg.base_file_url), "channel", p_tg_receives),
    Row("channels.telegram.webhook_url", "https://bot.example/other", "channel", p_tg_receives),
    Row("channels.telegram.webhook_secret", "another-secret-0123456789", "channel", p_tg_receives),
    Row("channels.telegram.poll_timeout_s", 2, "channel", p_tg_poll_timeout),
    Row("channels.telegram.streaming", "off", "channel", p_tg_receives),
    Row("channels.telegram.link_previews", True, "channel", p_tg_receives),
    Row("channels.slack.enabled", False, "channel", p_slack_gone),
    Row("channels.slack.bot_token", "xoxb-other", "channel", p_slack_receives,
        rotate("slack", "bot_token", "xoxb-other")),
    Row("channels.slack.app_token", "xapp-other", "channel", p_slack_receives,
        rotate("slack", "app_token", "xapp-other")),
    Row("channels.slack.signing_secret", "another-signing-secret", "channel", p_slack_receives),
    Row("channels.slack.mode", "http", "channel", p_slack_receives),
    Row("channels.slack.base_url", lambda r: localhost(r.slack.base_url), "channel", p_slack_receives),
    Row("channels.slack.streaming", "update", "channel", p_slack_receives),
    Row("channels.slack.unfurl_links", True, "channel", p_slack_receives),
    Row("channels.discord.enabled", False, "channel", p_discord_gone),
    Row("channels.discord.token", "other-discord-token", "channel", p_discord_receives,
        rotate("discord", "token", "other-discord-token")),
    Row("channels.discord.api_base", lambda r: localhost(r.discord.api_base), "channel", p_discord_receives),
    Row("channels.discord.streaming", "off", "channel", p_discord_streaming_off),
    Row("channels.slack.reply_to_mode", "channel", "channel", p_slack_reply_to_mode),
    Row("channels.web.enabled", False, "restart", p_still_serving),
    Row("channels.web.token", "web-token-after-4567", "live", p_web_token),
    Row("channels.terminal.enabled", False, "restart", p_nothing_to_see),
    Row("http.host", "localhost", "restart", p_still_serving),
    Row("http.port", 18_089, "restart", p_still_serving),
    Row("http.header_timeout_s", 3, "restart", p_still_serving),
    Row("http.body_timeout_s", 3, "restart", p_still_serving),
    Row("http.keepalive_timeout_s", 3, "restart", p_still_serving),
    Row("http.max_connections_per_client", 8, "restart", p_still_serving),
    Row("http.max_connections", 100, "restart", p_still_serving),
    Row("http.probe_port", 18_090, "restart", p_still_serving),
    Row("http.admin_token", "admin-token-after-0123456789", "live", p_admin_token),
    Row("limits.max_concurrent_model_calls", 2, "live", p_model_slots),
    Row("limits.session_queue_size", 1, "live", p_queue_size),
    Row("limits.max_inbound_chars", 50, "live", p_inbound_chars),
    Row("limits.max_live_sessions", 1, "live", p_live_sessions),
    Row("limits.tokens_per_user_per_day", 1, "live", p_tokens_per_day),
    Row("limits.turns_per_user_per_day", 1, "live", p_turns_per_day),
    Row("limits.turn_timeout_s", 0.5, "live", p_turn_timeout),
    Row("limits.max_inbound_file_mb", 0.001, "live", p_file_limit),
    Row("transcription.enabled", False, "live", p_transcription_off),
    Row("transcription.model", "whisper-large-v3", "live", p_transcription_model),
    Row("transcription.base_url", lambda r: localhost(r.model.base_url), "live", p_transcription_base_url),
    Row("transcription.api_key", "rotated-stt-key", "live", p_transcription_key),
    Row("transcription.timeout_s", 0.3, "live", p_transcription_timeout),
    Row("mcp.servers", {"live": {"command": sys.executable, "args": [str(ECHO_SERVER)]}}, "live", p_mcp_servers),
    Row("log_level", "DEBUG", "live", p_log_level),
    Row("skills.dirs", ["more-skills"], "live", p_skill_dirs, (more_skills, lambda r: None)),
    Row("hooks", {"ci": {"secret": HOOK_SECRET, "session": "telegram:dm:43", "deliver_to": "telegram:43",
                         "template": "CI says: {body}"}}, "live", p_hooks),
    Row("tasks.max_per_scope", 1, "live", p_tasks_per_scope),
    Row("tasks.min_interval_s", 60, "live", p_task_interval),
    Row("tasks.misfire_grace_s", 120, "live", p_task_grace),
    Row("tools.web_fetch.enabled", False, "live", p_no_web_fetch),
    Row("tools.web_fetch.max_bytes", 2000, "live", p_fetch_max_bytes),
    Row("tools.web_fetch.timeout_s", 0.3, "live", p_fetch_timeout),
    Row("tools.web_fetch.allow_private_networks", False, "live", p_fetch_private),
    Row("tools.web_search.provider", "tavily", "live", p_search_provider),
    Row("tools.web_search.base_url", lambda r: localhost(r.search.base_url), "live", p_search_base_url),
    Row("tools.web_search.api_key", "rotated-search-key", "live", p_search_key,
        rotate("search", "brave_token", "rotated-search-key")),
    Row("tools.exec.enabled", False, "live", p_no_exec),
    Row("tools.exec.network", True, "live", p_exec_network),
    Row("tools.exec.timeout_s", 0.5, "live", p_exec_timeout),
    Row("tools.exec.memory_mb", 64, "live", p_exec_memory),
    Row("tools.exec.disk_mb", 2, "live", p_exec_disk),
    Row("tools.delegate.max_per_step", 1, "live", p_delegate_per_step),
    Row("tools.delegate.max_per_turn", 1, "live", p_delegate_per_turn),
]


def set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    *parents, last = key.split(".")
    for part in parents:
        raw = raw.setdefault(part, {})
    raw[last] = value


@pytest.fixture
def restore_logging() -> Any:
    levels = {name: logging.getLogger(name).level for name in
              ("", "httpx", "httpcore", "openai", "telegram", "slack_sdk", "slack_bolt", "apscheduler", "aiosqlite")}
    yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


async def _setup(r: Rig) -> None:
    """What the probes build on, checked at the base values where that is cheap."""
    for session in ("tools", "tools2"):
        r.workspace(session).mkdir(parents=True, exist_ok=True)
        (r.workspace(session) / "big.txt").write_text(BIG)
    r.model.tool_call("read_file", {"path": "big.txt"})
    r.model.reply("read")
    await r.say("tools", "read big.txt")
    assert len([m for m in r.model.requests[-1]["messages"] if m["role"] == "tool"][-1]["content"]) >= len(BIG)
    r.workspace("mem").mkdir(parents=True, exist_ok=True)
    (r.workspace("mem") / "MEMORY.md").write_text(MEMORY)
    await r.say("mem", "hi")
    assert "MEMORY-MARKER-END" in r.system()
    r.web.page("/big.txt", "x" * 10_000, content_type="text/plain")
    r.web.page("/slow", "late", content_type="text/plain", delay=3)
    assert len(await r.tool_result("web", "web_fetch", {"url": r.web.base_url + "/big.txt"})) > 10_000
    assert (await r.tool_result("web", "web_search", {"query": "otters"})).startswith("1. Result 1")
    assert r.search.requests[-1]["provider"] == "brave"
    port = r.model.base_url.rsplit(":", 1)[1].split("/")[0]
    unreached = await r.tool_result("exec", "exec", {
        "command": f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=5)\"; "
                   "grep 'Max address space' /proc/self/limits"})
    assert "Connection refused" in unreached and f"Max address space         {512 << 20}" in unreached, unreached
    (made,) = await scheduled(r, "tasks", {"prompt": "daily", "every": "1d"})
    r.base_task = made.split()[2].rstrip(":")
    assert r.gw.tasks is not None and r.gw.tasks.job_grace(r.base_task) == 3600
    (refused,) = await scheduled(r, "tasks", {"prompt": "often", "every": "2m"})
    assert "too frequent" in refused
    await r.say("quota", "first")  # a turn and some tokens for the daily budgets
    await r.say("queue", "warm")  # live before its queue size changes
    assert "Only admins" in await r.say("eve", "/config agent_max_steps 14")
    assert "pairing code" in (await r.tg_reply(chat_id=41, user_id=41, text="hello"))["text"]
    await send_file(r, "photo", make_image(64, 48, fmt="JPEG"), caption="look")
    assert r.model.image_parts() == []  # fake-model: no vision from the table
    assert (await send_voice(r)).startswith("echo: [voice message, 0:01] this is what the fake heard")
    upload = r.model.transcriptions[-1]
    assert (upload["model"], upload["headers"]["Authorization"]) == ("whisper-1", "Bearer base-stt-key")
    assert "larger than" not in await send_file(r, "document", b"z" * 5000, extra={"file_name": "five.bin"})
    kept = r.aged_tool_result("base.txt", days=3)
    await r.old_session("telegram:dm:kept", days=10)
    report = await r.gw.scheduler.run_purge()
    assert kept.exists() and report.sessions == 0
    release, in_flight = await r.blocked_model()
    try:
        calls = [asyncio.ensure_future(r.say(f"base{i}", "hi")) for i in range(2)]
        await until(lambda: in_flight[0] == 1)
        await asyncio.sleep(0.2)
        assert in_flight[0] == 1  # limit 1 at start
    finally:
        release.set()
        r.model.respond_with(None)
    await asyncio.gather(*calls)


async def _ready(r: Rig, polls_before: int = -1,
                 channels: tuple[str, ...] = ("telegram", "slack", "discord")) -> None:
    """The channels receive again: Telegram polls (after `polls_before` getUpdates calls), Slack's socket
    and Discord's websocket are up."""
    if "telegram" in channels:
        await until(lambda: len(r.tg.calls_of("getUpdates")) > polls_before, timeout=10)
    if "slack" in channels:
        await until(lambda: "slack" in r.gw.channels and r.gw.channels["slack"].is_ready(), timeout=10)
    if "discord" in channels:
        await until(lambda: "discord" in r.gw.channels and r.gw.channels["discord"].is_ready(), timeout=10)


async def test_every_key_applies_as_documented(fake_discord: FakeDiscord, make_gateway: GatewayFactory,
                                               fake_model: FakeModel,
                                               fake_telegram: FakeTelegram, fake_slack: FakeSlack, fake_web: FakeWeb,
                                               fake_search: FakeSearch, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                                               restore_logging: Any) -> None:
    leaves = set(flatten(Config().model_dump(mode="json")))
    assert {row.key for row in ROWS} == leaves, "every key needs a row: how does it apply?"
    monkeypatch.setattr(gateway.config.reload, "SETTLE_S", 0.01)
    gw = await make_gateway(
        admins=["web:boss", "telegram:1"], timezone="UTC",
        access={"dm_policy": "pairing", "allow_from": ["telegram:-100"]},
        channels={
            "telegram": {"enabled": True, "token": fake_telegram.token, "base_url": fake_telegram.base_url,
                         "base_file_url": fake_telegram.base_file_url, "poll_timeout_s": 1,
                         "webhook_url": "https://bot.example/tg", "webhook_secret": HOOK_SECRET},
            "slack": {"enabled": True, "bot_token": fake_slack.bot_token, "app_token": fake_slack.app_token,
                      "base_url": fake_slack.base_url, "signing_secret": "slack-signing-secret"},
            "discord": {"enabled": True, "token": fake_discord.token, "api_base": fake_discord.api_base},
            "web": {"token": WEB_TOKEN},
        },
        limits={"max_concurrent_model_calls": 1},
        models={"backup": {"name": "backup-model"}},
        approvals={"tools": {}},  # the exec rows run commands; asking is approvals.tools.exec's row
        agents={"helper": {"system_prompt": "Base helper prompt."}},
        bindings=[{"match": {"channel": "web", "chat": "bound"}, "agent": "helper"}],
        # Its own key: moved to another server (the base_url row), it never takes the model's.
        transcription={"api_key": "base-stt-key"},
        tools={"web_fetch": {"allow_private_networks": True},
               "web_search": {"provider": "brave", "base_url": fake_search.base_url,
                              "api_key": fake_search.brave_token},
               "exec": {"enabled": True}},
    )
    fake_search.tavily_key = fake_search.brave_token  # the same key works for the provider row
    path = tmp_path / "config.json"
    watcher = gw.config_watcher()  # its reload path, called directly: no file-event race with the test
    rig = Rig(gw, fake_model, fake_telegram, fake_slack, path, path.read_text(), watcher, fake_web, fake_search,
              discord=fake_discord)
    failures: list[str] = []
    await _ready(rig)
    await _setup(rig)
    for row in ROWS:
        value = row.value(rig) if callable(row.value) else row.value
        raw = json.loads(rig.base_text)
        set_dotted(raw, row.key, value)
        before = {name: gw.channels.get(name) for name in ("telegram", "slack", "discord")}
        caplog.clear()
        if row.around is not None:
            row.around[0](rig)
        try:
            path.write_text(json.dumps(raw, indent=2))
            assert await watcher.reload() is True, "the change was not applied"
            assert change_effect(row.key) == row.effect, "the gateway's own table disagrees"
            later = [k for rec in caplog.records for k in getattr(rec, "keys", ())]
            assert (row.key in later) is (row.effect == "restart"), later
            for name, channel in before.items():
                restarted = gw.channels.get(name) is not channel
                assert restarted is (row.effect == "channel" and row.key.startswith(f"channels.{name}.")), name
                if restarted and name in gw.channels:
                    section = getattr(gw.cfg.channels, name)
                    assert gw.channels[name].cfg == section
            await row.probe(rig)
        except Exception as err:  # collect every key that misbehaves, not just the first
            failures.append(f"{row.key}: {type(err).__name__}: {err}")
        finally:
            fake_model.respond_with(None)
            fake_model.clear()
            if row.around is not None:
                row.around[1](rig)
            path.write_text(rig.base_text)
            polls = len(fake_telegram.calls_of("getUpdates"))
            if await watcher.reload() and row.effect == "channel":
                await _ready(rig, polls, channels=(row.key.split(".")[1],))
    assert not failures, "\n".join(failures)


def test_the_readme_lists_how_keys_apply() -> None:
    from gateway.config.changes import CHANNEL_SECTIONS, RESTART_KEYS

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    rows = {line.split("|")[2].strip(): set(re.findall(r"`([a-z_.*]+)`", line.split("|")[1]))
            for line in readme.splitlines() if line.startswith("| `")}
    assert rows["restarts that channel alone"] == {f"{s}.*" for s in CHANNEL_SECTIONS}
    assert rows["is saved and logged; applies after a restart"] == set(RESTART_KEYS)
    assert {row.key for row in ROWS if row.effect == "restart"} == set(RESTART_KEYS)


async def test_model_slots_follow_a_new_limit_and_never_leak() -> None:
    from gateway.model.slots import ModelSlots

    slots = ModelSlots(1)
    entered: list[str] = []
    gates = {name: asyncio.Event() for name in ("a", "b", "c", "d")}

    async def call(name: str) -> None:
        async with slots:
            entered.append(name)
            await asyncio.wait_for(gates[name].wait(), 5)

    a = asyncio.ensure_future(call("a"))
    b = asyncio.ensure_future(call("b"))
    await until(lambda: entered == ["a"])
    await asyncio.sleep(0.05)
    assert entered == ["a"]  # b waits for the one slot
    slots.resize(2)
    await until(lambda: entered == ["a", "b"])  # a bigger limit lets the waiter in at once
    slots.resize(1)  # lower than what is in flight: both finish, nobody new enters
    c = asyncio.ensure_future(call("c"))
    d = asyncio.ensure_future(call("d"))
    await asyncio.sleep(0.05)
    c.cancel()  # a waiter that gives up takes no slot with it
    gates["a"].set()
    await asyncio.sleep(0.05)
    assert entered == ["a", "b"] and slots.in_use == 1
    gates["b"].set()
    await until(lambda: entered == ["a", "b", "d"])
    gates["d"].set()
    await asyncio.gather(a, b, d)
    assert c.cancelled() and slots.in_use == 0
