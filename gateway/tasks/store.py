"""Stored tasks and their runs: the `tasks` and `task_runs` tables, on either store backend."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from gateway.store.api import StoreBackend
from gateway.tasks.schedule import ORIGIN, PREVIEW_CHARS, Schedule, slot_key, task_text
from gateway.types import Inbound

# -- stored tasks --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Task:
    id: str
    scope: str
    session_key: str
    routing: dict[str, Any]
    prompt: str
    schedule: Schedule
    next_run: float | None
    created_by: str
    created_at: float
    ended_at: float | None = None
    end_reason: str | None = None  # done | cancelled | missed
    made_by_task: str | None = None  # the task whose run made this one (None: a person did)

    @property
    def active(self) -> bool:
        return self.ended_at is None

    def preview(self, limit: int = PREVIEW_CHARS) -> str:
        line = " ".join(self.prompt.split())
        return line if len(line) <= limit else line[: limit - 1] + "…"

    def inbound_for(self, slot: datetime) -> Inbound:
        """The turn's message: as if sent where the task was made, by the gateway."""
        r = self.routing
        return Inbound(
            channel=str(r["channel"]), chat_id=str(r["chat_id"]), user_id=str(r["user_id"]),
            text=task_text(self.id, self.prompt), event_id=f"task:{self.id}:{slot_key(slot)}",
            thread_id=r.get("thread_id"), is_group=bool(r.get("is_group")), mentioned=bool(r.get("mentioned")),
            reply_to_bot=bool(r.get("reply_to_bot")), user_name=r.get("user_name"),
            extra=dict(r.get("extra") or {}), origin=ORIGIN,
        )


@dataclass(frozen=True, slots=True)
class TaskRun:
    task_id: str
    slot: str
    started_at: float
    outcome: str  # running | queued | busy | refused | over_budget | no_channel | duplicate | missed | error
    reply_status: str | None  # the turn's event status (answered, undelivered, …) when it was queued


def _task(row: Any) -> Task:
    return Task(
        id=row["id"], scope=row["scope"], session_key=row["session_key"], routing=json.loads(row["routing"]),
        prompt=row["prompt"], schedule=Schedule(row["kind"], row["spec"], row["zone"], row["anchor"]),
        next_run=row["next_run"], created_by=row["created_by"], created_at=row["created_at"],
        ended_at=row["ended_at"], end_reason=row["end_reason"], made_by_task=row["made_by_task"],
    )


class TaskStore:
    """The `tasks` and `task_runs` tables; one statement per call."""

    def __init__(self, store: StoreBackend) -> None:
        self.store = store

    async def insert(self, task: Task, *, limit: int,
                     chained: tuple[float, int] | None = None) -> Literal["ok", "full", "chained", "taken"]:
        """Add `task` unless its scope has `limit` active tasks already, or, with `chained`
        (since, most), unless tasks' runs made `most` tasks in the scope since then. Both
        are checked in the same statement, so two runs cannot both take the last place."""
        s = task.schedule
        chain_check, chain_args = "", ()  # type: tuple[str, tuple[object, ...]]
        if chained is not None:
            chain_check = (" AND (SELECT count(*) FROM tasks WHERE scope=? AND made_by_task IS NOT NULL "
                           "AND created_at >= ?) < ?")
            chain_args = (task.scope, chained[0], chained[1])
        rows = await self.store.run(
            "INSERT INTO tasks(id, scope, session_key, routing, prompt, kind, spec, zone, anchor, next_run, "
            "created_by, created_at, made_by_task) SELECT ?,?,?,?,?,?,?,?,?,?,?,?,? "
            "WHERE (SELECT count(*) FROM tasks WHERE scope=? AND ended_at IS NULL) < ?" + chain_check +
            " ON CONFLICT(id) DO NOTHING RETURNING id",
            (task.id, task.scope, task.session_key, json.dumps(task.routing, ensure_ascii=False), task.prompt,
             s.kind, s.spec, s.zone, s.anchor, task.next_run, task.created_by, task.created_at, task.made_by_task,
             task.scope, limit, *chain_args),
        )
        if rows:
            return "ok"
        if await self.count_active(task.scope) >= limit:
            return "full"
        if chained is not None and await self.count_made_by_tasks(task.scope, since=chained[0]) >= chained[1]:
            return "chained"
        return "taken"

    async def count_made_by_tasks(self, scope: str, *, since: float) -> int:
        """Tasks that tasks' runs made in `scope` since `since` (ended ones too)."""
        rows = await self.store.run(
            "SELECT count(*) FROM tasks WHERE scope=? AND made_by_task IS NOT NULL AND created_at >= ?",
            (scope, since))
        return int(rows[0][0])

    async def count_active(self, scope: str) -> int:
        rows = await self.store.run("SELECT count(*) FROM tasks WHERE scope=? AND ended_at IS NULL", (scope,))
        return int(rows[0][0])

    async def active(self, scope: str | None = None) -> list[Task]:
        if scope is None:
            rows = await self.store.run("SELECT * FROM tasks WHERE ended_at IS NULL ORDER BY created_at")
        else:
            rows = await self.store.run(
                "SELECT * FROM tasks WHERE scope=? AND ended_at IS NULL ORDER BY created_at", (scope,))
        return [_task(r) for r in rows]

    async def get(self, task_id: str) -> Task | None:
        rows = await self.store.run("SELECT * FROM tasks WHERE id=?", (task_id,))
        return _task(rows[0]) if rows else None

    async def end(self, task_id: str, reason: str, *, by: str | None = None) -> bool:
        rows = await self.store.run(
            "UPDATE tasks SET ended_at=?, end_reason=?, ended_by=?, next_run=NULL "
            "WHERE id=? AND ended_at IS NULL RETURNING id", (time.time(), reason, by, task_id))
        return bool(rows)

    async def advance(self, task_id: str, following: datetime | None, *, reason: str = "done") -> None:
        """Move the task's next run on; with none left, the task has ended."""
        if following is None:
            await self.end(task_id, reason)
            return
        await self.store.run("UPDATE tasks SET next_run=? WHERE id=? AND ended_at IS NULL",
                             (following.timestamp(), task_id))

    async def claim_run(self, task_id: str, slot: str, *, outcome: str = "running") -> bool:
        """Claim a slot; False when it ran (or was recorded) already."""
        rows = await self.store.run(
            "INSERT INTO task_runs(task_id, slot, started_at, outcome) VALUES (?,?,?,?) "
            "ON CONFLICT DO NOTHING RETURNING 1",
            (task_id, slot, time.time(), outcome))
        return bool(rows)

    async def finish_run(self, task_id: str, slot: str, outcome: str,
                         event: tuple[str, str] | None = None) -> None:
        channel, event_id = event if event is not None else (None, None)
        await self.store.run(
            "UPDATE task_runs SET outcome=?, event_channel=?, event_id=? WHERE task_id=? AND slot=?",
            (outcome, channel, event_id, task_id, slot))

    async def runs(self, task_id: str, *, limit: int = 20) -> list[TaskRun]:
        """The task's latest runs, newest first, with what became of their turns."""
        rows = await self.store.run(
            "SELECT r.task_id, r.slot, r.started_at, r.outcome, e.status FROM task_runs r "
            "LEFT JOIN events e ON e.channel = r.event_channel AND e.event_id = r.event_id "
            "WHERE r.task_id=? ORDER BY r.id DESC LIMIT ?", (task_id, limit))
        return [TaskRun(r[0], r[1], r[2], r[3], r[4]) for r in rows]

    async def purge(self, before: float, *, limit: int) -> int:
        """Forget runs, and ended tasks, older than `before` (one batch; 0 when done)."""
        runs = await self.store.run(
            "DELETE FROM task_runs WHERE id IN (SELECT id FROM task_runs WHERE started_at < ? LIMIT ?) "
            "RETURNING 1", (before, limit))
        tasks = await self.store.run(
            "DELETE FROM tasks WHERE id IN (SELECT id FROM tasks WHERE ended_at < ? LIMIT ?) RETURNING 1",
            (before, limit))
        return len(runs) + len(tasks)


