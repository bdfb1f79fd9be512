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
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest

import gateway.tasks
from gateway.app import Gateway
from gateway.store_pg import PgStore
from gateway.tasks import task_text
from tests.conftest import GatewayFactory, chat
from tests.fakes.openai_server import FakeModel, last_user_text
from tests.pg import PgServer, create_database

SYNC_S = 0.3


async def until(predicate: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def services(gw: Gateway) -> Any:
    assert gw.services is not None
    return gw.services


def tasks_of(gw: Gateway) -> Any:
    assert gw.tasks is not None
    return gw.tasks


async def task_runs(gw: Gateway, task_id: str) -> list[tuple[str, str]]:
    rows = await services(gw).store.run("SELECT slot, outcome FROM task_runs WHERE task_id=? ORDER BY id",
                                        (task_id,))
    return [(r[0], r[1]) for r in rows]


def asked(fake: FakeModel, text: str) -> int:
    return sum(1 for r in fake.requests if last_user_text(r) == text)


@pytest.fixture
async def cluster_url(pg_server: PgServer, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(gateway.tasks, "SYNC_INTERVAL_S", SYNC_S)
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
