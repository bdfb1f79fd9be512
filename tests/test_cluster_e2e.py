"""Several gateways on one PostgreSQL (SPEC §10), end to end: 3 `gateway run` processes
behind a round-robin proxy, 100 sessions on Telegram (webhook) and Slack (Events API over
HTTP), one gateway SIGKILLed mid-run.

This process plays everything around the gateways (bench/_cluster.py): the proxy, the
fake Bot API, the fake Slack, the fake model (it echoes each message, some slowly, so
turns are in flight when the kill lands), and the platforms' senders with their retry
rules: Telegram redelivers an update until it gets a 2xx, Slack retries a failed delivery
up to three times with X-Slack-Retry-Num. Every session sends 3 messages a little apart
without waiting for replies.

Checked: every message a gateway accepted (2xx through the proxy) is answered, once,
save the known window of a kill between a platform's send and the "answered" mark
(counted and bounded as in tests/test_reliability_crash.py); each session's replies come
in the order of its messages; the database agrees (no event left waiting, each user
message stored once); and scheduled jobs ran once per slot across the cluster, on both
paths a slot takes: caught up at start (the database says a gateway ran before the last
slot; the first gateway is still consolidating, slowly, when the other two start and
look at the same slot), and fired by the cron (every minute here; the test lasts past
one) on all three at once. Each daily note written before either slot reached the model
exactly once.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from pydantic import SecretStr

from bench._cluster import (
    TOKEN,
    ChatSession,
    Cluster,
    Delivery,
    LoggedSlack,
    LoggedTelegram,
    ReplyLog,
    Senders,
    chat_sessions,
    instance_pid,
    lease_holder_pids,
    served_by,
)
from gateway.cluster.leases import ClusterLeases
from gateway.config.schema import Config, ModelConfig
from gateway.jobs.scheduler import Scheduler
from gateway.memory.consolidate import SYSTEM_PROMPT
from gateway.memory.files import Memory
from gateway.model.client import ModelClient
from gateway.store.postgres import PgStore
from tests.fakes.openai_server import FakeModel, Reply, last_user_text
from tests.pg import PgServer, create_database

pytestmark = pytest.mark.cluster  # several processes on PostgreSQL: `-m cluster` / `-m "not cluster"`

GATEWAYS = 3
MESSAGES = 3
CONCURRENT_MODEL_CALLS = 8  # per gateway: bounds the turns a kill can catch mid-send
SEEDED_SCOPES = 6  # sessions with a daily note waiting for each consolidation slot
# Each consolidation call's time: with 6 scopes, 2 at a time, a run lasts about three of
# these, long enough for the other gateways to start during the first one's catch-up.
CONSOLIDATION_DELAY_S = 1.0
# The catch-up ends before the next whole minute, so the cron slot finds notes of its own
# (two slots' runs at once now wait for each other: the last test below).
LATEST_START_SECOND = 45
EARLIER_START = "start:{}:seeded"  # the purge slot of a gateway that ran an hour ago
CONSOLIDATION_PROMPT = SYSTEM_PROMPT.partition("\n")[0]  # how a consolidation request begins
WAITING = ("accepted", "queued", "running")


@dataclass
class ClusterReport:
    deliveries: list[Delivery] = field(default_factory=list)
    killed_pid: int = 0
    killed_at: float = 0.0
    taken_over: list[str] = field(default_factory=list)  # messages the killed gateway left waiting
    not_accepted: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    duplicate_replies: int = 0
    unexpected: list[str] = field(default_factory=list)
    out_of_order: list[str] = field(default_factory=list)
    waiting_events: list[str] = field(default_factory=list)
    duplicate_user_messages: list[str] = field(default_factory=list)
    unstored: list[str] = field(default_factory=list)
    job_rows: list[tuple[str, str, int, str]] = field(default_factory=list)  # job, slot, rows, outcome
    consolidation_slots: list[str] = field(default_factory=list)
    start_purges: int = 0  # purge rows of this run's gateway starts
    consolidation_calls: Counter[str] = field(default_factory=Counter)  # seeded marker → model calls
    exit_codes: list[int] = field(default_factory=list)
    error_lines: list[str] = field(default_factory=list)
    bad_gateway: int = 0
    seconds: float = 0.0

    def line(self) -> str:
        accepted = sum(d.accepted for d in self.deliveries)
        return (f"{len(self.deliveries)} messages, {accepted} accepted ({self.bad_gateway} proxy 502s), "
                f"{len(self.taken_over)} left waiting by the killed gateway, "
                f"{len(self.missing)} missing, {self.duplicate_replies} duplicate replies, "
                f"{len(self.unexpected)} unexpected, {len(self.out_of_order)} out of order, "
                f"{len(self.waiting_events)} events waiting, {len(self.duplicate_user_messages)} duplicate "
                f"user messages, consolidation slots {self.consolidation_slots}, {self.seconds:.0f}s")


def _responder(calls: Counter[str], markers: list[str], rng: random.Random) -> Any:
    """Echo every message, half of them slowly; count the consolidation requests that
    carry each seeded note."""
    def respond(body: dict[str, Any]) -> Reply | None:
        first = str(body.get("messages", [{}])[0].get("content", ""))
        if first.startswith(CONSOLIDATION_PROMPT):
            text = str(body["messages"])
            calls.update(m for m in markers if m in text)
            return Reply(text=f"echo: {last_user_text(body)}", delay=CONSOLIDATION_DELAY_S)
        text = last_user_text(body)
        return Reply(text=f"echo: {text}", delay=1.5 if rng.random() < 0.5 else 0.05)
    return respond


async def _seed_notes(store_url: str, data_dir: Path, sessions: list[ChatSession], *,
                      ran_before: bool = False) -> list[str]:
    """A daily note in each of some sessions' scopes, as the summarizer would have left
    them, for the consolidation to merge; returns the marker word of each. With
    `ran_before`, also the purge record of a gateway that started an hour ago, so the
    last consolidation slot counts as missed and every gateway catches it up at start."""
    store = await PgStore.open(store_url)
    try:
        if ran_before:
            slot = EARLIER_START.format((datetime.now(UTC) - timedelta(hours=1)).isoformat())
            assert await store.start_job_run("purge", slot)
            await store.finish_job_run("purge", slot, "ok")
        memory = Memory(data_dir, tz=UTC, store=store)
        markers = []
        for session in sessions:
            marker = f"seeded{secrets.token_hex(4)}"
            await memory.append_daily(session.scope, f"- {session.user} likes {marker}", heading="Notes")
            markers.append(marker)
        return markers
    finally:
        await store.close()


def _until_clear_of_minute_boundary(now: float, margin: float = 1.5) -> float:
    """Seconds until `now` is not right at a whole minute, when the cron fires and one
    gateway takes the consolidation's lease (the victim is picked among the others)."""
    second = now % 60
    if second >= 60 - margin:
        return 60 - second + margin
    return max(0.0, margin - second)


async def run_cluster_scenario(workdir: Path, server: PgServer, *, telegram_sessions: int = 50,
                               slack_dms: int = 25, slack_channels: int = 25, seed: int = 17,
                               settle_timeout: float = 45) -> ClusterReport:
    started = time.monotonic()
    wall_start = time.time()
    rng = random.Random(seed)
    report = ClusterReport()
    server_log = logging.getLogger("aiohttp.server")
    server_level = server_log.level
    server_log.setLevel(logging.CRITICAL)  # a killed gateway leaves the fakes' handlers mid-request

    store_url = await create_database(server)
    sessions = chat_sessions(telegram_sessions, slack_dms, slack_channels)
    data_dir = workdir / "data"
    markers = await _seed_notes(store_url, data_dir, sessions[:SEEDED_SCOPES], ran_before=True)
    log = ReplyLog()
    telegram, slack, model = LoggedTelegram(log), LoggedSlack(log), FakeModel()
    await telegram.start()
    await slack.start()
    await model.start()
    model.respond_with(_responder(report.consolidation_calls, markers, rng))
    cluster = Cluster(workdir, size=GATEWAYS, store_url=store_url, model_url=model.base_url, telegram=telegram,
                      slack=slack, sessions=sessions, timezone="UTC", memory_consolidation_cron="* * * * *",
                      limits={"max_concurrent_model_calls": CONCURRENT_MODEL_CALLS})
    senders: Senders | None = None
    salt = secrets.token_hex(3)
    owned: list[asyncio.Task[Any]] = []
    try:
        if time.time() % 60 > LATEST_START_SECOND:
            await asyncio.sleep(61 - time.time() % 60)
        await cluster.start()
        senders = Senders(cluster.proxy.url, telegram_give_up_s=60)

        async def notes_for_the_cron() -> frozenset[str]:
            """Once the catch-up took the first notes, more for the cron's slot."""
            caught_up = await _wait_consolidation(store_url, wall_start, report, markers, timeout=30)
            markers.extend(await _seed_notes(store_url, data_dir, sessions[SEEDED_SCOPES:2 * SEEDED_SCOPES]))
            return caught_up

        async def converse(session: ChatSession, delay: float) -> list[Delivery]:
            await asyncio.sleep(delay)
            out = []
            for m in range(MESSAGES):
                assert senders is not None
                out.append(await senders.send(session, session.token(m, salt)))
                await asyncio.sleep(rng.uniform(0.2, 1.2))  # people type; nobody waits for the bot
            return out

        talks = [asyncio.create_task(converse(s, i * 0.04)) for i, s in enumerate(sessions)]
        seeding = asyncio.create_task(notes_for_the_cron())
        owned += [*talks, seeding]
        # The kill: once a sixth of the replies are out, of a gateway that is not running a
        # scheduled job (a run cut by a kill stays unfinished, by design, until a restart).
        await log.wait(lambda: len(log.replies) >= len(sessions) * MESSAGES // 6, settle_timeout)
        await asyncio.sleep(_until_clear_of_minute_boundary(time.time()))
        busy = await lease_holder_pids(store_url, "job:")
        index = next(i for i in (1, 2, 0) if cluster.gateways[i].pid not in busy)
        serving = await served_by(store_url, cluster.gateways[index].pid)
        victim = await cluster.kill(index)
        report.killed_pid, report.killed_at = victim.pid, time.monotonic()
        answered = {found.group(0) for r in log.replies if (found := TOKEN.search(r.text))}
        report.taken_over = sorted(t for tokens in serving.values() for t in tokens - answered)
        for talk in await asyncio.gather(*talks):
            report.deliveries += talk
        accepted = {d.token for d in report.deliveries if d.accepted}
        await log.wait(lambda: accepted <= {m.group(0) for r in log.replies if (m := TOKEN.search(r.text))},
                       settle_timeout)
        # A slot the cron fired during the run (every minute) takes the second notes.
        await _wait_consolidation(store_url, wall_start, report, markers, timeout=80, after=await seeding)
        report.exit_codes = await cluster.stop()
        report.bad_gateway = cluster.proxy.bad_gateway
    finally:
        for task in owned:
            task.cancel()
        if owned:
            await asyncio.wait(owned, timeout=5)
        await cluster.tear_down(senders, model, slack, telegram)
        server_log.setLevel(server_level)

    _check_replies(report, log)
    await _check_database(report, store_url, sessions, wall_start)
    killed_log = f"gateway-{cluster.gateways.index(cluster.killed[0])}.log" if cluster.killed else ""
    report.error_lines = [line for line in cluster.error_lines() if not line.startswith(killed_log or "-")]
    report.seconds = time.monotonic() - started
    return report


async def _wait_consolidation(store_url: str, since: float, report: ClusterReport, markers: list[str],
                              timeout: float, after: frozenset[str] = frozenset()) -> frozenset[str]:
    """Wait until a consolidation slot other than `after` has finished and every marker
    reached the model; returns the finished slots (all there are when it times out)."""
    conn = await asyncpg.connect(store_url, timeout=10)
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            done = frozenset(r["slot"] for r in await conn.fetch(
                "SELECT slot FROM job_runs WHERE job='memory_consolidation' AND started_at >= $1 "
                "AND ended_at IS NOT NULL", since))
            if (done - after and all(report.consolidation_calls[m] for m in markers)) or loop.time() > deadline:
                return done
            await asyncio.sleep(0.5)  # nothing to wait on but the table
    finally:
        await conn.close(timeout=5)


def _check_replies(report: ClusterReport, log: ReplyLog) -> None:
    by_token = {d.token: d for d in report.deliveries}
    seen: Counter[str] = Counter()
    first_order: dict[str, list[int]] = defaultdict(list)  # chat → message numbers, by first reply
    for reply in log.replies:
        found = TOKEN.search(reply.text)
        delivery = by_token.get(found.group(0)) if found else None
        if delivery is None or delivery.session.chat != reply.chat:
            report.unexpected.append(f"{reply.chat}: {reply.text[:100]!r}")
            continue
        seen[delivery.token] += 1
        if seen[delivery.token] == 1:
            first_order[reply.chat].append(int(delivery.token.split("-m")[1].split("-")[0]))
    report.duplicate_replies = sum(n - 1 for n in seen.values())
    for d in report.deliveries:
        if not d.accepted:
            report.not_accepted.append(f"{d.token}: {d.statuses}")
        elif seen[d.token] == 0:
            report.missing.append(f"{d.session.key}: {d.token} (statuses {d.statuses})")
    for chat, numbers in first_order.items():
        if numbers != sorted(numbers):
            report.out_of_order.append(f"{chat}: replies to messages {numbers}")


async def _check_database(report: ClusterReport, store_url: str, sessions: list[ChatSession],
                          since: float) -> None:
    conn = await asyncpg.connect(store_url, timeout=10)
    try:
        rows = await conn.fetch("SELECT session_key, event_id, status, instance FROM events WHERE status = ANY($1)",
                                list(WAITING))
        report.waiting_events = [f"{r['session_key']} {r['event_id']} {r['status']} "
                                 f"(accepted by pid {instance_pid(r['instance'])})" for r in rows]
        rows = await conn.fetch("SELECT session_key, content, count(*) AS n FROM messages WHERE role='user' "
                                "GROUP BY session_key, content HAVING count(*) > 1")
        report.duplicate_user_messages = [f"{r['session_key']}: {r['content'][:60]!r} ×{r['n']}" for r in rows]
        stored = {(r["session_key"], m.group(0)) for r in await conn.fetch(
            "SELECT session_key, content FROM messages WHERE role='user'") if (m := TOKEN.search(r["content"]))}
        report.unstored = [f"{d.session.key}: {d.token}" for d in report.deliveries
                           if d.accepted and (d.session.key, d.token) not in stored]
        rows = await conn.fetch("SELECT job, slot, count(*) AS n, min(outcome) AS outcome, "
                                "bool_and(ended_at IS NOT NULL) AS ended FROM job_runs "
                                "WHERE started_at >= $1 GROUP BY job, slot ORDER BY job, slot", since)
        report.job_rows = [(r["job"], r["slot"], r["n"], r["outcome"] if r["ended"] else "unfinished")
                           for r in rows]
        report.consolidation_slots = [r["slot"] for r in rows if r["job"] == "memory_consolidation"]
        report.start_purges = sum(1 for r in rows if r["job"] == "purge" and r["slot"].startswith("start:")
                                     and not r["slot"].endswith(":seeded"))
    finally:
        await conn.close(timeout=5)


async def test_three_gateways_one_killed_answer_every_message_once_in_order(
    tmp_path: Path, pg_server: PgServer
) -> None:
    report = await run_cluster_scenario(tmp_path, pg_server)
    print("\ncluster:", report.line())  # shown with -s
    assert sum(d.accepted for d in report.deliveries) >= len(report.deliveries) * 0.95, report.not_accepted[:10]
    assert report.taken_over, "the killed gateway had nothing waiting: the kill proved nothing"
    assert report.missing == []
    assert report.unexpected == []
    assert report.out_of_order == []
    # The known window (killed between the platform's send and the "answered" mark)
    # may repeat a reply: at most the turns the killed gateway had in flight.
    assert report.duplicate_replies <= CONCURRENT_MODEL_CALLS
    assert report.waiting_events == []
    assert report.duplicate_user_messages == []
    assert report.unstored == []
    # Jobs: one row per (job, slot), each finished; purge runs once per gateway start.
    assert all(n == 1 for _, _, n, _ in report.job_rows), report.job_rows
    assert all(outcome in ("ok", "partial") for _, _, _, outcome in report.job_rows), report.job_rows
    assert len(report.consolidation_slots) >= 2, "the caught-up slot and a cron slot should both have run"
    assert sorted(report.consolidation_calls.values()) == [1] * 2 * SEEDED_SCOPES, report.consolidation_calls
    assert report.start_purges == GATEWAYS
    assert report.exit_codes == [0] * (GATEWAYS - 1)
    assert report.error_lines == []


async def test_two_slots_consolidating_at_once_on_two_gateways_merge_a_note_once(
    tmp_path: Path, pg_server: PgServer, fake_model: FakeModel
) -> None:
    """What the scenario above once hit on a loaded machine: gateway A still catching up
    the 12:00 slot when the cron fires the 12:01 slot on gateway B. Each slot ran once,
    but both runs read the note before either marked it merged; now the second waits."""
    url = await create_database(pg_server)
    model = ModelClient(ModelConfig(name="fake", base_url=fake_model.base_url, api_key=SecretStr("k"),
                                    max_retries=0))
    fake_model.respond_with(lambda body: Reply(text="- Alice has a cat named Miso", delay=1.0))
    nodes: list[tuple[PgStore, ClusterLeases, Scheduler]] = []
    try:
        for _ in range(2):
            store = await PgStore.open(url)
            leases = ClusterLeases(store)
            await leases.start()
            memory = Memory(tmp_path / "data", tz=UTC, store=store)
            cfg = Config(timezone="UTC", memory_consolidation_cron="* * * * *")
            nodes.append((store, leases, Scheduler(cfg, store=store, memory=memory, model=model,
                                                   live_references=set, leases=leases)))
        await Memory(tmp_path / "data", tz=UTC, store=nodes[0][0]).append_daily("web:alice", "Alice adopted Miso.")
        (_, _, a), (_, _, b) = nodes
        await asyncio.gather(a.run_consolidation("2026-11-30T12:00:00+00:00"),
                             b.run_consolidation("2026-11-30T12:01:00+00:00"))
        assert len(fake_model.requests) == 1  # the note reached the model once
    finally:
        for store, leases, _ in nodes:
            await leases.stop()
            await store.close()
        await model.close()
