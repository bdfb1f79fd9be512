"""Tasks people schedule in chat (SPEC §5.3): the schedule parser, and the whole gateway
with the real python-telegram-bot / slack-bolt against the fakes: a task made in a chat
runs as a turn in that chat's session and is answered there without anyone writing first,
once per slot, across restarts; missed runs within the grace run once after the start;
scopes own their tasks."""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import re
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import aiohttp
import pytest

import gateway.jobs.tasks
from channels.terminal.channel import TerminalChannel
from gateway.app import Gateway
from gateway.memory.purge import purge
from gateway.store.sqlite import Store
from gateway.tasks.schedule import Schedule, TaskError, parse_duration, parse_schedule, task_text
from gateway.tasks.store import Task, TaskStore
from gateway.types import Inbound
from tests.conftest import GatewayFactory, StoreFactory, chat
from tests.fakes import slack_server, telegram_server
from tests.fakes.openai_server import FakeModel, last_user_text
from tests.fakes.slack_server import FakeSlack, event_callback, signed_event_request
from tests.fakes.telegram_server import FakeTelegram

fake_telegram = telegram_server.fake_telegram  # the fixtures
fake_slack = slack_server.fake_slack

SIGNING = "signing-secret-xyz"
PARIS = ZoneInfo("Europe/Paris")
NOW = datetime(2026, 3, 27, 10, 0, tzinfo=UTC)  # a Friday, two days before DST starts in Paris


async def until(predicate: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def services(gw: Gateway) -> Any:
    assert gw.services is not None
    return gw.services


async def runs(gw: Gateway, task_id: str) -> list[tuple[str, str]]:
    rows = await services(gw).store.run("SELECT slot, outcome FROM task_runs WHERE task_id=? ORDER BY id",
                                        (task_id,))
    return [(r[0], r[1]) for r in rows]


async def only_task_id(gw: Gateway) -> str:
    rows = await services(gw).store.run("SELECT id FROM tasks")
    assert len(rows) == 1, rows
    return str(rows[0][0])


def task_runs_metric(gw: Gateway, outcome: str) -> float:
    text = services(gw).metrics.render().decode()
    found = re.search(rf'^gateway_task_runs_total{{outcome="{outcome}"}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def telegram_section(fake: FakeTelegram) -> dict[str, Any]:
    return {"telegram": {"enabled": True, "token": fake.token, "base_url": fake.base_url,
                         "base_file_url": fake.base_file_url, "poll_timeout_s": 1}}


def slack_section(fake: FakeSlack, **extra: Any) -> dict[str, Any]:
    return {"slack": {"enabled": True, "bot_token": fake.bot_token, "app_token": fake.app_token,
                      "base_url": fake.base_url, **extra}}


async def post_slack_event(gw: Gateway, event: dict[str, Any]) -> None:
    assert gw.http is not None
    body, headers = signed_event_request(SIGNING, event_callback(event))
    async with aiohttp.ClientSession() as http:
        async with http.post(f"http://127.0.0.1:{gw.http.port}/slack/events", data=body, headers=headers) as resp:
            assert resp.status == 200


def schedule(**given: str) -> Schedule:
    return parse_schedule(at=given.get("at"), every=given.get("every"), cron=given.get("cron"), now=NOW,
                          zone_name=given.get("zone", "Europe/Paris"), min_interval_s=300)


# -- the parser and next-run computation (pure) ----------------------------------------------


def test_delays_and_iso_times() -> None:
    assert parse_duration("20m") == 1200 and parse_duration("1d 3h") == 97200
    assert parse_duration("2 hours and 5 minutes") == 7500 and parse_duration("soon") is None
    assert schedule(at="in 20m").next_after(NOW) == NOW + timedelta(minutes=20)
    assert schedule(at="in 1d 3h").next_after(NOW) == NOW + timedelta(days=1, hours=3)
    # A naive time is wall-clock time in the configured zone (Paris is UTC+1 in March).
    assert schedule(at="2026-03-27T14:30").next_after(NOW) == datetime(2026, 3, 27, 13, 30, tzinfo=UTC)
    assert schedule(at="2026-03-27T14:30+00:00").next_after(NOW) == datetime(2026, 3, 27, 14, 30, tzinfo=UTC)
    once = schedule(at="in 20m")
    assert once.slot_at(NOW) is None and once.slot_at(NOW + timedelta(minutes=21)) == NOW + timedelta(minutes=20)
    assert once.next_after(NOW + timedelta(minutes=20)) is None  # an `at` task runs once


@pytest.mark.parametrize(("given", "reason"), [
    ({}, "give one of at"),
    ({"at": "in 5m", "every": "1h"}, "only one of at, every and cron (got at and every)"),
    ({"at": "2026-03-27T09:00"}, "is in the past"),  # 08:00 UTC: before NOW
    ({"at": "tomorrowish"}, "neither an ISO 8601 time"),
    ({"at": "in 0m"}, "more than 0 seconds"),
    ({"every": "2m"}, "too frequent"),
    ({"every": "often"}, "not a period"),
    ({"cron": "0 9 * *"}, "not a crontab expression"),
    ({"cron": "0 25 * * *"}, "not a valid cron expression"),
    ({"cron": "*/2 * * * *"}, "runs too often"),
    ({"cron": "0,1 9 * * *"}, "runs too often"),  # one minute apart once a day is still too often
    ({"cron": "0 0 31 2 *"}, "never runs"),
])
def test_bad_schedules_are_refused_with_a_reason(given: dict[str, str], reason: str) -> None:
    with pytest.raises(TaskError, match=re.escape(reason)):
        schedule(**given)


def test_cron_runs_in_the_task_zone_across_dst() -> None:
    weekdays = schedule(cron="0 9 * * 1-5")
    assert weekdays.zone == "Europe/Paris"
    first = weekdays.next_after(NOW)  # Friday 10:00 UTC is 11:00 in Paris: next is Monday 09:00
    assert first == datetime(2026, 3, 30, 9, 0, tzinfo=PARIS) == datetime(2026, 3, 30, 7, 0, tzinfo=UTC)
    assert first.astimezone(PARIS).weekday() == 0  # crontab's 1 is Monday (APScheduler counts from 0)
    # The Friday before at 09:00 Paris (08:00 UTC, winter time) was the latest run.
    assert weekdays.slot_at(NOW) == datetime(2026, 3, 27, 8, 0, tzinfo=UTC)
    sundays = schedule(cron="30 8 * * 0")
    assert sundays.next_after(NOW) == datetime(2026, 3, 29, 6, 30, tzinfo=UTC)  # summer time: UTC+2


def test_every_keeps_its_phase_from_the_first_run() -> None:
    every = schedule(every="2h")
    assert every.anchor == (NOW + timedelta(hours=2)).timestamp()
    assert every.slot_at(NOW) is None and every.next_after(NOW) == NOW + timedelta(hours=2)
    later = NOW + timedelta(hours=7, minutes=1)
    assert every.slot_at(later) == NOW + timedelta(hours=6)
    assert every.next_after(later) == NOW + timedelta(hours=8)
    assert every.next_after(NOW + timedelta(hours=6)) == NOW + timedelta(hours=8)  # strictly after
    trigger = every.trigger()  # APScheduler agrees on the runs
    assert trigger.get_next_fire_time(None, later) == NOW + timedelta(hours=8)


def test_a_task_reply_in_the_terminal_is_printed_without_taking_the_prompt_s_place() -> None:
    out = io.StringIO()
    terminal = TerminalChannel(out=out, tty=False)
    task = Inbound(channel="terminal", chat_id="local", user_id="local", text=task_text("ab12", "x"),
                   event_id="task:ab12:t", origin="task")
    person = Inbound(channel="terminal", chat_id="local", user_id="local", text="hi", event_id="e1")

    async def scenario() -> None:
        await terminal.send(task, "time to stretch")
        stream = terminal.stream(task)
        await stream.append("streamed ")
        await stream.finish("streamed task reply")
        await terminal.send(person, "the answer to hi")

    asyncio.run(scenario())
    assert "time to stretch" in out.getvalue() and "streamed task reply" in out.getvalue()
    # The chat loop waits for the reply to what was typed: only that one is queued for it.
    assert terminal.replies.qsize() == 1 and terminal.replies.get_nowait() == ("the answer to hi", True)


def stored_task(task_id: str, *, scope: str = "web:alice", next_run: float | None = None) -> Task:
    return Task(id=task_id, scope=scope, session_key=scope, routing={"channel": "web", "chat_id": "alice",
                "user_id": "alice"}, prompt="p", schedule=schedule(every="1h"),
                next_run=next_run if next_run is not None else time.time() + 60, created_by=scope,
                created_at=time.time())


async def test_the_task_store_on_either_backend(make_store: StoreFactory) -> None:
    db = TaskStore(await make_store())
    assert await db.insert(stored_task("aa11"), limit=2) == "ok"
    assert await db.insert(stored_task("aa11"), limit=2) == "taken"  # the id is someone's already
    assert await db.insert(stored_task("bb22"), limit=2) == "ok"
    assert await db.insert(stored_task("cc33"), limit=2) == "full"
    assert await db.insert(stored_task("cc33", scope="web:bob"), limit=2) == "ok"  # a scope of its own
    assert await db.count_active("web:alice") == 2 and [t.id for t in await db.active("web:bob")] == ["cc33"]
    got = await db.get("aa11")
    assert got is not None and got.schedule == stored_task("aa11").schedule and got.routing["chat_id"] == "alice"

    # A slot is claimed once; its outcome and its turn's event are kept with it.
    assert await db.claim_run("aa11", "slot-1") and not await db.claim_run("aa11", "slot-1")
    assert await db.claim_run("aa11", "slot-2", outcome="missed")
    await db.finish_run("aa11", "slot-1", "queued", ("web", "task:aa11:slot-1"))
    assert [(r.slot, r.outcome, r.reply_status) for r in await db.runs("aa11")] == [
        ("slot-2", "missed", None), ("slot-1", "queued", None)]

    following = datetime(2030, 1, 1, tzinfo=UTC)
    await db.advance("aa11", following)
    assert (await db.get("aa11")).next_run == following.timestamp()  # type: ignore[union-attr]
    await db.advance("bb22", None)  # no run left: done
    assert await db.end("cc33", "cancelled", by="web:bob") and not await db.end("cc33", "cancelled")
    ended = await db.get("bb22")
    assert ended is not None and ended.end_reason == "done" and ended.next_run is None
    assert [t.id for t in await db.active()] == ["aa11"]


async def test_the_purge_forgets_old_runs_and_ended_tasks_only(make_store: StoreFactory, tmp_path: Path) -> None:
    store = await make_store()
    db = TaskStore(store)
    routing = {"channel": "web", "chat_id": "alice", "user_id": "alice"}
    for task_id in ("old1", "old2", "new1"):
        task = Task(id=task_id, scope="web:alice", session_key="web:alice", routing=routing, prompt="p",
                    schedule=schedule(every="1h"), next_run=time.time() + 60, created_by="web:alice",
                    created_at=time.time() - 90 * 86400)
        assert await db.insert(task, limit=10) == "ok"
        assert await db.claim_run(task_id, "slot-1")
    await db.end("old1", "cancelled")
    await db.end("new1", "done")
    long_ago = time.time() - 40 * 86400
    await store.run("UPDATE tasks SET ended_at=? WHERE id='old1'", (long_ago,))
    await store.run("UPDATE task_runs SET started_at=? WHERE task_id IN ('old1', 'old2')", (long_ago,))
    report = await purge(store, tmp_path, now=time.time(), session_retention_days=30, tool_result_ttl_days=7,
                         live_references=set)
    assert report.task_records == 3 and "3 task records" in report.line()
    # Still active, however old: kept; ended recently: kept; their recent runs: kept.
    assert [t.id for t in await db.active()] == ["old2"]
    assert await db.get("new1") is not None and await db.get("old1") is None
    assert [r.task_id for r in await db.runs("new1")] == ["new1"] and await db.runs("old2") == []


# -- the whole gateway ---------------------------------------------------------------------------


async def test_a_task_made_in_telegram_answers_there_once_without_a_new_message(
    make_gateway: GatewayFactory, fake_model: FakeModel, fake_telegram: FakeTelegram
) -> None:
    gw = await make_gateway(access={"dm_policy": "open", "allow_from": ["telegram:-100"]},
                            channels=telegram_section(fake_telegram))
    fake_model.tool_call("schedule_task", {"prompt": "Remind them to stretch", "at": "in 2s"})
    fake_model.reply("I will remind you in 2 seconds.")
    fake_telegram.push_message(chat_id=7, user_id=7, text="remind me to stretch in 2 seconds")
    await fake_telegram.wait_shown(7, lambda shown: shown == ["I will remind you in 2 seconds."])
    task_id = await only_task_id(gw)
    assert f"Scheduled task {task_id}" in fake_model.requests[-1]["messages"][-1]["content"]  # the tool's result

    fake_model.reply("Time to stretch!")
    shown = await fake_telegram.wait_shown(7, lambda shown: len(shown) == 2, timeout=8)
    assert shown == ["I will remind you in 2 seconds.", "Time to stretch!"]
    assert last_user_text(fake_model.requests[-1]) == task_text(task_id, "Remind them to stretch")
    await asyncio.sleep(1)  # nothing more comes: it ran once
    assert len(fake_telegram.shown()) == 2 and len(fake_model.requests) == 3
    (run,) = await runs(gw, task_id)
    assert run[1] == "queued" and task_runs_metric(gw, "queued") == 1.0
    rows = await services(gw).store.run("SELECT end_reason FROM tasks WHERE id=?", (task_id,))
    assert rows[0][0] == "done"  # a one-shot task has finished

    # Stored as a turn the gateway started: a user-role row marked with its origin, never
    # as the person's words (the web page's history leaves it out; /context counts it).
    stored = await services(gw).store.messages("telegram:dm:7")
    prompt = [m for m in stored if m.content.startswith("[Scheduled task")]
    assert len(prompt) == 1 and prompt[0].role == "user" and prompt[0].origin == "task" and not prompt[0].injected
    assert [m.origin for m in stored if m.role == "user"] == [None, "task"]
    history = await services(gw).store.chat_history("telegram:dm:7", limit=10)
    assert [m.content for m in history] == ["remind me to stretch in 2 seconds", "I will remind you in 2 seconds.",
                                            "Time to stretch!"]
    fake_telegram.push_message(chat_id=7, user_id=7, text="/context")
    shown = await fake_telegram.wait_shown(7, lambda shown: len(shown) == 3)
    assert "user 2 (1 from scheduled tasks)" in shown[2] and "Turns: 2 of" in shown[2]

    # In a forum topic the reply goes to the topic, and quotes nobody.
    fake_model.tool_call("schedule_task", {"prompt": "Say the topic's task ran", "at": "in 1s"})
    fake_model.reply("Scheduled here.")
    fake_telegram.push_message(chat_id=-100, user_id=7, text="@" + fake_telegram.bot_username + " later please",
                               chat_type="supergroup", thread_id=55,
                               entities=[{"type": "mention", "offset": 0,
                                          "length": len(fake_telegram.bot_username) + 1}])
    await fake_telegram.wait_shown(-100, lambda shown: shown == ["Scheduled here."])
    fake_model.reply("The topic's task ran.")
    await fake_telegram.wait_shown(-100, lambda shown: len(shown) == 2, timeout=8)
    task_reply = [c for c in fake_telegram.calls_of("sendMessage") if str(c.get("chat_id")) == "-100"][-1]
    assert str(task_reply["message_thread_id"]) == "55" and not task_reply.get("reply_parameters")


async def test_every_runs_repeatedly_until_cancelled(make_gateway: GatewayFactory, fake_model: FakeModel) -> None:
    gw = await make_gateway(tasks={"min_interval_s": 1})
    fake_model.tool_call("schedule_task", {"prompt": "Count sheep", "every": "1s"})
    fake_model.reply("Counting every second.")
    assert await chat(gw, "alice", "count sheep every second") == "Counting every second."
    task_id = await only_task_id(gw)
    await until(lambda: len(fake_model.requests) >= 5, what="three runs")  # 2 requests, then one per run
    # Each run is a turn of alice's web session, answered (the page's history shows it).
    history = await services(gw).store.chat_history("web:alice", limit=20)
    assert [m.content for m in history][:3] == ["count sheep every second", "Counting every second.",
                                                f"echo: {task_text(task_id, 'Count sheep')}"]
    assert "Count sheep" in await chat(gw, "alice", "/tasks")
    assert f"Cancelled task {task_id}" in await chat(gw, "alice", f"/tasks cancel {task_id.upper()}")
    await services(gw).tasks.wait_idle(5)
    await services(gw).background.wait_idle(5)
    count = len(fake_model.requests)
    await asyncio.sleep(1.5)
    assert len(fake_model.requests) == count  # no run after the cancel
    done = await runs(gw, task_id)
    assert len(done) >= 3 and {outcome for _, outcome in done} == {"queued"}
    assert len({slot for slot, _ in done}) == len(done)  # one run per slot
    statuses = await services(gw).store.run(
        "SELECT e.status FROM task_runs r JOIN events e ON e.channel=r.event_channel AND e.event_id=r.event_id")
    assert {r[0] for r in statuses} == {"answered"}


async def test_a_restart_between_scheduling_and_firing_fires_once_after_it(
    make_gateway: GatewayFactory, fake_model: FakeModel, fake_telegram: FakeTelegram
) -> None:
    section = {"access": {"dm_policy": "open"}, "channels": telegram_section(fake_telegram)}
    gw = await make_gateway(**section)
    fake_model.tool_call("schedule_task", {"prompt": "Say good morning", "at": "in 2s"})
    fake_model.reply("Scheduled.")
    fake_telegram.push_message(chat_id=8, user_id=8, text="greet me in 2 seconds")
    await fake_telegram.wait_shown(8, lambda shown: shown == ["Scheduled."])
    task_id = await only_task_id(gw)
    await gw.stop()

    fake_model.reply("Good morning!")
    gw2 = await make_gateway(**section)  # a new gateway on the same data dir
    await fake_telegram.wait_shown(8, lambda shown: len(shown) == 2, timeout=8)
    assert fake_telegram.shown(8) == ["Scheduled.", "Good morning!"]
    await asyncio.sleep(1)
    assert len(fake_telegram.shown(8)) == 2 and len(await runs(gw2, task_id)) == 1


async def _shift_task(data: Path, task_id: str, *, first_run: float) -> None:
    """The gateway was down since before `first_run` (a time in the past): the task's first
    run and its stored next run move there, as if it had been scheduled that much earlier."""
    store = await Store.open(data / "gateway.sqlite3")
    try:
        rows = await store.run("SELECT kind FROM tasks WHERE id=?", (task_id,))
        spec = datetime.fromtimestamp(first_run, UTC).isoformat()
        await store.run("UPDATE tasks SET anchor=?, next_run=?, spec=CASE WHEN kind='at' THEN ? ELSE spec END "
                        "WHERE id=?", (first_run, first_run, spec, task_id))
        assert rows
    finally:
        await store.close()


async def _make_tasks(gw: Gateway, fake_model: FakeModel, session: str, *calls: dict[str, str]) -> list[str]:
    for args in calls:
        fake_model.tool_call("schedule_task", args)
    fake_model.reply("Scheduled.")
    await chat(gw, session, "schedule them")
    rows = await services(gw).store.run("SELECT id FROM tasks ORDER BY created_at")
    return [str(r[0]) for r in rows]


async def test_a_missed_run_within_the_grace_runs_once_after_the_start(
    make_gateway: GatewayFactory, fake_model: FakeModel, tmp_path: Path
) -> None:
    gw = await make_gateway()
    hourly, once = await _make_tasks(gw, fake_model, "alice", {"prompt": "Hourly check", "every": "1h"},
                                     {"prompt": "One reminder", "at": "in 1h"})
    await gw.stop()
    before = len(fake_model.requests)
    now = time.time()
    await _shift_task(tmp_path / "data", hourly, first_run=now - 3.5 * 3600)  # slots -3.5h … -0.5h missed
    await _shift_task(tmp_path / "data", once, first_run=now - 1800)

    gw2 = await make_gateway()
    await until(lambda: len(fake_model.requests) >= before + 2, what="the two caught-up runs")
    await asyncio.sleep(1)
    assert len(fake_model.requests) == before + 2  # once each: the hourly task's missed runs coalesced
    asked = sorted(last_user_text(r) for r in fake_model.requests[before:])
    assert asked == sorted([task_text(hourly, "Hourly check"), task_text(once, "One reminder")])
    (run,) = await runs(gw2, hourly)
    assert run[1] == "queued"
    assert datetime.fromisoformat(run[0]).timestamp() == pytest.approx(now - 1800, abs=2)  # the latest slot
    rows = await services(gw2).store.run("SELECT id, next_run, end_reason FROM tasks ORDER BY created_at")
    assert rows[0][1] == pytest.approx(now + 1800, abs=2) and rows[0][2] is None  # still hourly, in phase
    assert rows[1][2] == "done"


async def test_a_run_missed_beyond_the_grace_is_recorded_and_skipped(
    make_gateway: GatewayFactory, fake_model: FakeModel, tmp_path: Path
) -> None:
    gw = await make_gateway(tasks={"misfire_grace_s": 600})
    hourly, once = await _make_tasks(gw, fake_model, "alice", {"prompt": "Hourly check", "every": "1h"},
                                     {"prompt": "One reminder", "at": "in 1h"})
    await gw.stop()
    before = len(fake_model.requests)
    now = time.time()
    await _shift_task(tmp_path / "data", hourly, first_run=now - 3.5 * 3600)  # the latest slot is 30 min late
    await _shift_task(tmp_path / "data", once, first_run=now - 1800)

    gw2 = await make_gateway(tasks={"misfire_grace_s": 600})
    await until(lambda: task_runs_metric(gw2, "missed") == 2, what="two missed runs")
    await asyncio.sleep(0.5)
    assert len(fake_model.requests) == before  # no turn ran for either
    assert [o for _, o in await runs(gw2, hourly)] == ["missed"]
    assert [o for _, o in await runs(gw2, once)] == ["missed"]
    rows = await services(gw2).store.run("SELECT next_run, end_reason FROM tasks ORDER BY created_at")
    assert rows[0][0] == pytest.approx(now + 1800, abs=2) and rows[0][1] is None  # goes on at its next slot
    assert rows[1][1] == "missed"


async def test_a_task_made_in_a_slack_thread_answers_in_that_thread(
    make_gateway: GatewayFactory, fake_model: FakeModel, fake_slack: FakeSlack
) -> None:
    gw = await make_gateway(access={"allow_from": ["slack:C1"]},
                            channels=slack_section(fake_slack, mode="http", signing_secret=SIGNING,
                                                   reply_to_mode="channel"))
    fake_model.reply("top level answer")
    await post_slack_event(gw, {"type": "app_mention", "user": "U5", "text": f"<@{fake_slack.bot_user_id}> hi",
                                "ts": "300.1", "channel": "C1", "channel_type": "channel"})
    await fake_slack.wait_for(lambda: fake_slack.visible("C1") == ["top level answer"])
    fake_model.tool_call("schedule_task", {"prompt": "Post the standup reminder", "at": "in 1s"})
    fake_model.reply("Will do, in this thread.")
    await post_slack_event(gw, {"type": "app_mention", "user": "U5", "ts": "301.1", "channel": "C1",
                                "text": f"<@{fake_slack.bot_user_id}> remind the thread", "thread_ts": "300.1",
                                "channel_type": "channel"})
    await fake_slack.wait_for(lambda: fake_slack.visible("C1", "300.1") == ["Will do, in this thread."])
    fake_model.reply("Standup in 5 minutes!")
    await fake_slack.wait_for(lambda: len(fake_slack.visible("C1", "300.1")) == 2, timeout=8)
    assert fake_slack.visible("C1", "300.1") == ["Will do, in this thread.", "Standup in 5 minutes!"]
    assert fake_slack.visible("C1") == ["top level answer"]  # nothing new at the top level
    # The thread's session, with the thread's history in the request.
    assert "remind the thread" in str(fake_model.requests[-1]["messages"])
    assert "hi" not in [m.get("content") for m in fake_model.requests[-1]["messages"]]
    assert await services(gw).background.wait_idle(5)  # the stream has ended before the fake stops


async def test_a_scope_owns_its_tasks_and_admins_see_all(make_gateway: GatewayFactory,
                                                         fake_model: FakeModel) -> None:
    gw = await make_gateway(admins=["web:boss"])
    (task_id,) = await _make_tasks(gw, fake_model, "alice", {"prompt": "Water the plants", "every": "1d"})
    assert f"`{task_id}`" in await chat(gw, "alice", "/tasks")

    # Another scope neither sees nor cancels it, by command or by tool.
    assert "No scheduled tasks in this chat" in await chat(gw, "mallory", "/tasks")
    assert "no task" in await chat(gw, "mallory", f"/tasks cancel {task_id}")
    assert "Only admins" in await chat(gw, "mallory", "/tasks all")
    fake_model.tool_call("list_tasks", {})
    fake_model.tool_call("list_tasks", {"all": True})
    fake_model.tool_call("cancel_task", {"id": task_id})
    fake_model.reply("could not")
    await chat(gw, "mallory", "cancel alice's task")
    results = [m["content"] for m in fake_model.requests[-1]["messages"] if m["role"] == "tool"]
    assert results[0] == "No scheduled tasks in this chat."
    assert results[1].startswith("error: only admins")
    assert results[2].startswith(f"error: there is no task '{task_id}' here")
    rows = await services(gw).store.run("SELECT ended_at FROM tasks WHERE id=?", (task_id,))
    assert rows[0][0] is None

    # An admin lists every scope's tasks and cancels any of them.
    listing = await chat(gw, "boss", "/tasks all")
    assert f"`{task_id}` [web:alice]" in listing and "Water the plants" in listing
    fake_model.tool_call("cancel_task", {"id": task_id})
    fake_model.reply("cancelled")
    await chat(gw, "boss", "cancel it")
    assert [m["content"] for m in fake_model.requests[-1]["messages"] if m["role"] == "tool"] == [
        f"Cancelled task {task_id} (Water the plants)."]
    assert "No scheduled tasks in this chat" in await chat(gw, "alice", "/tasks")
    assert services(gw).tasks.job_grace(task_id) is None  # its job is gone too


async def test_at_most_max_per_scope_tasks(make_gateway: GatewayFactory, fake_model: FakeModel) -> None:
    gw = await make_gateway(tasks={"max_per_scope": 2})
    fake_model.tool_calls([("schedule_task", {"prompt": f"task {i}", "at": f"in {i + 1}h"}) for i in range(3)])
    fake_model.reply("done")
    await chat(gw, "alice", "three tasks please")
    results = [m["content"] for m in fake_model.requests[-1]["messages"] if m["role"] == "tool"]
    assert results[0].startswith("Scheduled task") and results[1].startswith("Scheduled task")
    assert results[2] == ("error: this chat has 2 scheduled tasks already, the most allowed "
                          "(tasks.max_per_scope); cancel one first")
    # Another scope has its own allowance.
    fake_model.tool_call("schedule_task", {"prompt": "mine", "at": "in 1h"})
    fake_model.reply("done")
    await chat(gw, "bob", "one task")
    assert next(m["content"] for m in fake_model.requests[-1]["messages"] if m["role"] == "tool").startswith(
        "Scheduled task")
    rows = await services(gw).store.run("SELECT scope, count(*) FROM tasks GROUP BY scope ORDER BY scope")
    assert [(r[0], r[1]) for r in rows] == [("web:alice", 2), ("web:bob", 1)]


async def test_bad_arguments_reach_the_model_as_clear_errors(make_gateway: GatewayFactory,
                                                            fake_model: FakeModel) -> None:
    gw = await make_gateway()
    fake_model.tool_calls([
        ("schedule_task", {"prompt": "x", "at": "in 5m", "cron": "0 9 * * *"}),
        ("schedule_task", {"prompt": "x", "every": "1m"}),
        ("schedule_task", {"prompt": "x", "at": "2020-01-01T09:00"}),
        ("schedule_task", {"prompt": "x", "cron": "61 * * * *"}),
        ("schedule_task", {"prompt": "  ", "at": "in 5m"}),
    ])
    fake_model.reply("sorted out")
    await chat(gw, "alice", "do things")
    results = [m["content"] for m in fake_model.requests[-1]["messages"] if m["role"] == "tool"]
    assert results[0] == "error: give only one of at, every and cron (got at and cron)"
    assert results[1].startswith("error: every 1m: too frequent; a task may repeat at most every 5m")
    assert results[2].startswith("error: at: 2020-01-01T09:00 is in the past")
    assert results[3].startswith("error: cron: '61 * * * *' is not a valid cron expression")
    assert results[4].startswith("error: prompt is empty")
    assert (await services(gw).store.run("SELECT count(*) FROM tasks"))[0][0] == 0


async def test_a_busy_session_is_retried_then_recorded_busy(make_gateway: GatewayFactory, fake_model: FakeModel,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gateway.jobs.tasks, "BUSY_RETRY_S", 0.1)
    monkeypatch.setattr(gateway.jobs.tasks, "BUSY_RETRIES", 2)
    gw = await make_gateway(limits={"session_queue_size": 1})
    (task_id,) = await _make_tasks(gw, fake_model, "alice", {"prompt": "Ping", "at": "in 1s"})
    release = asyncio.Event()

    async def held(_body: dict[str, Any]) -> str:
        await asyncio.wait_for(release.wait(), 10)
        return "released"

    fake_model.respond_with(held)
    first = asyncio.ensure_future(chat(gw, "alice", "a long question"))  # runs, held by the model
    await until(lambda: len(fake_model.requests) == 3, what="the held turn")
    second = asyncio.ensure_future(chat(gw, "alice", "and another"))  # fills the queue
    await until(lambda: gw.sessions.queued() == 1, what="a full queue")
    await until(lambda: task_runs_metric(gw, "busy") == 1, what="the busy run")
    release.set()
    await asyncio.gather(first, second)
    ((_, outcome),) = await runs(gw, task_id)
    assert outcome == "busy"
    status = await services(gw).store.run("SELECT status FROM events WHERE event_id LIKE ?", (f"task:{task_id}:%",))
    assert status[0][0] == "busy"
    assert len(fake_model.requests) == 4  # the task never reached the model


async def test_a_creator_whose_access_was_withdrawn_gets_no_more_runs(
    make_gateway: GatewayFactory, fake_model: FakeModel, fake_telegram: FakeTelegram
) -> None:
    gw = await make_gateway(access={"dm_policy": "allowlist", "allow_from": ["telegram:9"]},
                            channels=telegram_section(fake_telegram))
    fake_model.tool_call("schedule_task", {"prompt": "Nag me", "at": "in 1s"})
    fake_model.reply("Scheduled.")
    fake_telegram.push_message(chat_id=9, user_id=9, text="nag me soon")
    await fake_telegram.wait_shown(9, lambda shown: shown == ["Scheduled."])
    task_id = await only_task_id(gw)
    cfg = gw.cfg.model_copy(update={"access": gw.cfg.access.model_copy(update={"allow_from": ()})})
    gw.holder.swap(cfg)  # the admin removed them
    await until(lambda: task_runs_metric(gw, "refused") == 1, what="the refused run")
    assert [o for _, o in await runs(gw, task_id)] == ["refused"]
    assert len(fake_model.requests) == 2 and fake_telegram.shown(9) == ["Scheduled."]


async def test_a_task_turn_cut_by_a_crash_is_answered_once_after_the_restart(
    make_gateway: GatewayFactory, fake_model: FakeModel, fake_telegram: FakeTelegram
) -> None:
    section = {"access": {"dm_policy": "open"}, "channels": telegram_section(fake_telegram)}
    gw = await make_gateway(**section)
    fake_model.tool_call("schedule_task", {"prompt": "Report the weather", "at": "in 1s"})
    fake_model.reply("Scheduled.")
    fake_telegram.push_message(chat_id=10, user_id=10, text="weather report in a second")
    await fake_telegram.wait_shown(10, lambda shown: shown == ["Scheduled."])
    fake_model.hang(30)  # the task's turn is cut mid-call
    await fake_model.wait_requests(3, timeout=8)
    await gw.stop(timeout=0)

    fake_model.reply("Sunny, 21 degrees.")
    gw2 = await make_gateway(**section)
    await fake_telegram.wait_shown(10, lambda shown: len(shown) == 2, timeout=8)
    assert fake_telegram.shown(10) == ["Scheduled.", "Sunny, 21 degrees."]
    stored = await services(gw2).store.messages("telegram:dm:10")
    assert [(m.role, m.origin) for m in stored if m.role == "user"] == [("user", None), ("user", "task")]
    task_id = await only_task_id(gw2)
    assert len(await runs(gw2, task_id)) == 1
    assert json.loads((await services(gw2).store.run(
        "SELECT inbound FROM events WHERE event_id LIKE 'task:%'"))[0][0])["origin"] == "task"


# -- tasks that tasks make (an unattended chain) ---------------------------------------------


def test_a_schedule_moved_to_a_later_first_run() -> None:
    later = NOW + timedelta(minutes=10)
    assert schedule(at="in 1m").not_before(later).next_after(NOW) == later
    assert schedule(at="in 1h").not_before(later).next_after(NOW) == NOW + timedelta(hours=1)  # already later
    every = schedule(every="5m").not_before(later)
    assert every.next_after(NOW) == later and every.next_after(later) == later + timedelta(minutes=5)
    hourly = schedule(cron="0 * * * *")  # keeps its expression; the first run is the one at or after `later`
    assert hourly.not_before(later) == hourly
    assert hourly.next_after(later - timedelta(microseconds=1)) == datetime(2026, 3, 27, 11, 0, tzinfo=UTC)


async def test_a_task_that_schedules_itself_in_1s_runs_no_more_often_than_the_minimum(
    make_gateway: GatewayFactory, fake_model: FakeModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gateway.jobs.tasks, "CHAINED_PER_HOUR", 2)
    gw = await make_gateway(tasks={"min_interval_s": 2})
    for _ in range(5):  # the person's turn, then every run: "schedule the next one in 1s"
        fake_model.tool_call("schedule_task", {"prompt": "Do it again", "at": "in 1s"})
        fake_model.reply("again")
    await chat(gw, "alice", "start the loop")
    refusal = "error: scheduled tasks have made 2 tasks in this chat in the last hour"

    def tool_results() -> list[str]:
        return [m["content"] for r in fake_model.requests for m in r["messages"][-1:] if m["role"] == "tool"]

    async def task_count() -> int:
        return int((await services(gw).store.run("SELECT count(*) FROM tasks"))[0][0])

    deadline = time.monotonic() + 30
    while not any(r.startswith(refusal) for r in tool_results()) and await task_count() <= 3:
        assert time.monotonic() < deadline, "timed out waiting for the chain to be refused"
        await asyncio.sleep(0.05)
    chain = [str(r[0]) for r in await services(gw).store.run("SELECT id FROM tasks ORDER BY created_at")]
    slots = [datetime.fromisoformat(slot) for task_id in chain for slot, _ in await runs(gw, task_id)]
    # Each link ran at least tasks.min_interval_s after the run that made it, though it asked for 1s.
    assert all((b - a).total_seconds() >= 2 for a, b in itertools.pairwise(slots)), slots
    # The person's task, then one made by each run until the scope's allowance was spent.
    assert len(chain) == 3, chain
    made_by = await services(gw).store.run("SELECT made_by_task FROM tasks ORDER BY created_at")
    assert [r[0] for r in made_by] == [None, chain[0], chain[1]]
    assert "after that run: tasks.min_interval_s" in tool_results()[1]
    await until(lambda: len(fake_model.requests) == 8, what="the last run's reply")  # 4 turns of 2 calls
    assert sum(r.startswith(refusal) for r in tool_results()) == 1
    active = await services(gw).store.run("SELECT count(*) FROM tasks WHERE ended_at IS NULL")
    assert active[0][0] == 0  # nothing is left to run: the chain has ended
    # A person in the chat may still schedule: the allowance is for tasks made by tasks.
    fake_model.tool_call("schedule_task", {"prompt": "Mine", "at": "in 1h"})
    fake_model.reply("ok")
    await chat(gw, "alice", "one for me")
    assert tool_results()[-1].startswith("Scheduled task")
