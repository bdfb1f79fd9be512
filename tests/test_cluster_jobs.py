"""Jobs once per cluster (SPEC §10): two gateways in one process on one PostgreSQL
database (tests/pg.py). Every gateway schedules every active task and follows the tasks
table (a sync every SYNC_INTERVAL_S): a task made on one gateway runs once per slot while
both run, goes on from the other when its maker stops, and a task cancelled on one is
dropped by the other. Purge and consolidation claim their slot in `job_runs`: of two
gateways racing for one slot, exactly one does the work."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

import gateway.jobs.tasks
from gateway.app import Gateway
from gateway.cluster.leases import ClusterLeases
from gateway.config.schema import Config, ModelConfig
from gateway.jobs.scheduler import Scheduler
from gateway.memory.files import Memory
from gateway.model.client import ModelClient
from gateway.store.postgres import PgStore
from gateway.tasks.schedule import task_text
from tests.conftest import Clock, GatewayFactory, chat
from tests.fakes.openai_server import FakeModel, last_user_text
from tests.pg import PgServer, create_database
from tests.test_tasks import runs as task_runs
from tests.test_tasks import services, until

SYNC_S = 0.3


def tasks_of(gw: Gateway) -> Any:
    assert gw.tasks is not None
    return gw.tasks


def asked(fake: FakeModel, text: str) -> int:
    return sum(1 for r in fake.requests if last_user_text(r) == text)


@pytest.fixture
async def cluster_url(pg_server: PgServer, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(gateway.jobs.tasks, "SYNC_INTERVAL_S", SYNC_S)
    return await create_database(pg_server)


async def test_a_task_runs_once_per_slot_on_two_gateways_and_outlives_its_maker(
        make_gateway: GatewayFactory, fake_model: FakeModel, cluster_url: str) -> None:
    section: dict[str, Any] = {"store": {"url": cluster_url}, "tasks": {"min_interval_s": 1}}
    a = await make_gateway(**section)
    b = await make_gateway(**section)  # started before the tasks exist: it learns of them by syncing
    fake_model.tool_calls([("schedule_task", {"prompt": "Count sheep", "every": "1s"}),
                           ("schedule_task", {"prompt": "Water the plants", "every": "1d"})])
    fake_model.reply("Scheduled.")
    assert await chat(a, "alice", "two tasks please") == "Scheduled."
    rows = await services(a).store.run("SELECT id, prompt FROM tasks")
    ids = {r[1]: r[0] for r in rows}
    sheep, plants = ids["Count sheep"], ids["Water the plants"]
    await until(lambda: tasks_of(b).job_grace(sheep) is not None and tasks_of(b).job_grace(plants) is not None,
                what="B scheduling A's tasks")
    # B follows A's next run, not a run of its own making.
    plants_row = await services(b).tasks.db.get(plants)
    assert tasks_of(b).job_next_run(plants) == datetime.fromtimestamp(plants_row.next_run, UTC)

    # Cancelled on A: dropped by B at its next sync.
    assert f"Cancelled task {plants}" in await chat(a, "alice", f"/tasks cancel {plants}")
    await until(lambda: tasks_of(b).job_grace(plants) is None, what="B dropping the cancelled task")

    # Both fire every slot; one of them runs it.
    await until(lambda: asked(fake_model, task_text(sheep, "Count sheep")) >= 3, what="three runs on two gateways")
    done = len(await task_runs(a, sheep))
    await until(lambda: asked(fake_model, task_text(sheep, "Count sheep")) >= done, what="the last claimed turn")
    assert await tasks_of(a).wait_idle(5) and await tasks_of(b).wait_idle(5)
    await a.stop()
    by_a = len(await task_runs(b, sheep))

    # A is gone: B runs the next slots by itself.
    await until(lambda: asked(fake_model, task_text(sheep, "Count sheep")) >= by_a + 2, what="B's runs")
    await b.stop()
    store = await PgStore.open(cluster_url)
    try:
        rows = await store.run("SELECT slot, outcome FROM task_runs WHERE task_id=? ORDER BY id", (sheep,))
        events = await store.run("SELECT count(*) FROM events WHERE event_id LIKE ?", (f"task:{sheep}:%",))
    finally:
        await store.close()
    slots = [r[0] for r in rows]
    assert len(slots) >= by_a + 2 and {r[1] for r in rows} == {"queued"}
    # Once per slot: one turn, one event and one model request for each claimed slot.
    assert asked(fake_model, task_text(sheep, "Count sheep")) == len(slots) == events[0][0]
    gaps = [datetime.fromisoformat(y).timestamp() - datetime.fromisoformat(x).timestamp()
            for x, y in itertools.pairwise(slots)]
    assert all(g >= 1 for g in gaps)


# -- purge and consolidation: one run per slot ------------------------------------------------

ALICE = "web:alice"
SLOT = "2026-11-28T00:00:00+00:00"


@pytest.fixture
async def model(fake_model: FakeModel) -> AsyncIterator[ModelClient]:
    client = ModelClient(ModelConfig(name="fake", base_url=fake_model.base_url, api_key=SecretStr("k"),
                                     max_retries=0))
    yield client
    await client.close()


class Node:
    """One gateway's part in the race: its own pool on the shared database, its leases, its
    scheduler; the data dir is shared."""

    def __init__(self, store: PgStore, leases: ClusterLeases, scheduler: Scheduler) -> None:
        self.store, self.leases, self.scheduler = store, leases, scheduler

    async def close(self) -> None:
        await self.scheduler.stop()
        await self.leases.stop()
        await self.store.close()


@pytest.fixture
async def make_node(cluster_url: str, tmp_path: Path, model: ModelClient) -> AsyncIterator[Callable[..., Any]]:
    nodes: list[Node] = []
    clock = Clock(datetime(2026, 11, 28, 1, 0, tzinfo=UTC))

    async def make() -> Node:
        store = await PgStore.open(cluster_url)
        leases = ClusterLeases(store)
        await leases.start()
        memory = Memory(tmp_path / "data", tz=UTC, store=store, clock=clock)
        cfg = Config(timezone="UTC", memory_consolidation_cron="0 0 * * *")
        node = Node(store, leases, Scheduler(cfg, store=store, memory=memory, model=model, live_references=set,
                                             clock=clock, leases=leases))
        nodes.append(node)
        return node

    yield make
    for node in nodes:
        await node.close()


async def test_two_gateways_racing_for_a_slot_run_it_once(make_node: Callable[..., Any],
                                                          fake_model: FakeModel) -> None:
    a, b = await make_node(), await make_node()
    memory = a.scheduler._memory
    await memory.append_daily(ALICE, "Alice adopted a cat named Miso.")
    fake_model.default = "# Alice\n- cat: Miso"
    results = await asyncio.gather(a.scheduler.run_consolidation(SLOT), b.scheduler.run_consolidation(SLOT))
    assert sorted(map(len, results)) == [0, 1]  # one ran every scope, the other skipped the slot
    assert len(fake_model.requests) == 1
    assert len(await b.store.job_runs("memory_consolidation")) == 1

    # The purge: the effect once (one expired session deleted, by one of them), one record.
    for key in ("web:old1", "web:old2"):
        await a.store.ensure_session(key, key, "web")
    await a.store.run("UPDATE sessions SET updated_at=?", (time.time() - 90 * 86400,))
    reports = await asyncio.gather(a.scheduler.run_purge(SLOT), b.scheduler.run_purge(SLOT))
    assert sorted(r.sessions for r in reports) == [0, 2]
    (run,) = await a.store.job_runs("purge")
    assert run.outcome == "ok" and run.detail is not None and run.detail.startswith("2 sessions")


async def test_an_unfinished_consolidation_is_taken_over_only_from_a_dead_gateway(
        make_node: Callable[..., Any], fake_model: FakeModel) -> None:
    fake_model.default = "- merged"
    a = await make_node()
    await a.scheduler._memory.append_daily(ALICE, "a note")
    # A is consolidating the 28th's slot now: it holds the slot's lease and its run is open.
    assert await a.leases.acquire(f"job:memory_consolidation:{SLOT}") is not None
    assert await a.store.start_job_run("memory_consolidation", SLOT)

    b = await make_node()
    await b.scheduler.start()  # B starts: the open run is A's, alive; it is left alone
    assert await b.scheduler.wait_idle(5)
    await b.scheduler.stop()
    assert fake_model.requests == []
    run = await b.store.job_run("memory_consolidation", SLOT)
    assert run is not None and run.ended_at is None

    await a.leases.stop()  # A dies (its leases go); the next start takes the run over, once
    starts = [await make_node(), await make_node()]
    await asyncio.gather(*(n.scheduler.start() for n in starts))
    assert all([await n.scheduler.wait_idle(5) for n in starts])
    assert len(fake_model.requests) == 1
    run = await b.store.job_run("memory_consolidation", SLOT)
    assert run is not None and run.outcome == "ok" and run.ended_at is not None
