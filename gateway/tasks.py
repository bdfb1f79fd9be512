"""Tasks people schedule in chat (SPEC §5.3): store rows ↔ APScheduler jobs ↔ session FIFO.

A task is a prompt with a schedule (`at` once, `every` period, `cron` in a zone), made by
the `schedule_task` tool in a session and owned by that session's scope. Each active task
is one APScheduler job. At start every active task is scheduled again from its row with
its stored next run, so a run missed while the gateway was down is caught up once
(coalesced) when it is at most `tasks.misfire_grace_s` late, and recorded as missed
otherwise.

A firing claims its slot (the scheduled fire time) in `task_runs`, so a slot runs once,
also across restarts. Several gateways on one database (SPEC §10) each schedule every
active task, and sync their jobs with the table every SYNC_INTERVAL_S: a task made on
another gateway is picked up, one ended there is dropped, and whichever gateway claims a
slot first runs it, so a task goes on when the gateway that made it dies.

The run becomes a turn in the session that created the task, queued in the same FIFO as
people's messages: an inbound rebuilt from the creating message's routing data, whose
text is the task's prompt marked as the gateway's, stored as a user message with origin
"task" (it starts a turn, but no person wrote it), under an event of its own
(`task:<id>:<slot>`), so a turn cut by a crash is resumed like any other. The reply goes
where the creating message was answered: the same chat, topic or thread.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, tzinfo
from typing import Any, Literal

from apscheduler.events import EVENT_JOB_MISSED, JobExecutionEvent
from apscheduler.schedulers.asyncio import AsyncIOScheduler
from apscheduler.triggers.base import BaseTrigger
from apscheduler.triggers.date import DateTrigger
from apscheduler.triggers.interval import IntervalTrigger

from gateway.access import is_admin
from gateway.background import Background
from gateway.config import Config
from gateway.cron import cron_trigger, last_fire_time, zone
from gateway.services import Services
from gateway.sessions import SessionManager, TurnJob
from gateway.store_api import StoreBackend
from gateway.types import Inbound, inbound_to_dict

log = logging.getLogger("gateway.tasks")

Kind = Literal["at", "every", "cron"]
ORIGIN = "task"  # Message.origin / Inbound.origin of what a task wrote

ID_ALPHABET = "23456789abcdefghjkmnpqrstuvwxyz"  # no look-alikes (0/o, 1/l/i)
ID_LENGTH = 4
MAX_PROMPT_CHARS = 4000
MAX_AHEAD = timedelta(days=5 * 366)  # `at` and `every` beyond this are surely mistakes
CRON_CHECKED_RUNS = 60  # the closest two of a cron's next runs must respect min_interval_s
PREVIEW_CHARS = 60
# A session whose queue is full: try again a few times before the run is recorded "busy".
BUSY_RETRIES = 6
BUSY_RETRY_S = 10.0
SYNC_INTERVAL_S = 12.0  # shared database: how often the jobs follow tasks made or ended elsewhere
SYNC_TIMEOUT_S = 30.0
SAME_RUN_S = 1.0  # a job and its row disagree on the next run by more than this: follow the row
# Routing data a task must not keep: a slash command's reply path is single-use.
_DROPPED_EXTRA = frozenset({"command", "response_url"})

_UNITS = {
    "s": 1, "sec": 1, "secs": 1, "second": 1, "seconds": 1,
    "m": 60, "min": 60, "mins": 60, "minute": 60, "minutes": 60,
    "h": 3600, "hr": 3600, "hrs": 3600, "hour": 3600, "hours": 3600,
    "d": 86400, "day": 86400, "days": 86400,
    "w": 604800, "week": 604800, "weeks": 604800,
}
_DURATION = re.compile(r"(?:\d+(?:\.\d+)?\s*[a-z]+\s*)+")
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)\s*([a-z]+)")


class TaskError(ValueError):
    """A request about tasks that cannot be done; the message says why, for the person."""


# -- schedules (pure) ----------------------------------------------------------------------


def parse_duration(text: str) -> float | None:
    """'20m', '1d 3h', '2 hours and 5 minutes' → seconds; None when it is not one."""
    words = re.sub(r"\s*(?:,|\band\b)\s*", " ", text.strip().lower())
    if not words or not _DURATION.fullmatch(words):
        return None
    total = 0.0
    for number, unit in _DURATION_PART.findall(words):
        if unit not in _UNITS:
            return None
        total += float(number) * _UNITS[unit]
    return total


def format_period(seconds: float) -> str:
    """7200 → '2h', 97200 → '1d 3h', 90 → '1m 30s'."""
    left = round(seconds)
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if left >= size:
            parts.append(f"{left // size}{unit}")
            left %= size
    return " ".join(parts) or "0s"


def format_time(when: datetime, tz: tzinfo) -> str:
    local = when.astimezone(tz)
    return f"{local:%Y-%m-%d %H:%M} {local.tzname()}"


@dataclass(frozen=True, slots=True)
class Schedule:
    kind: Kind
    spec: str  # at: the time (ISO 8601 with its offset); every: seconds; cron: the expression
    zone: str | None  # IANA zone it was read in (None: the system's)
    anchor: float | None = None  # every: the first run (unix time); the later ones follow it

    @property
    def tz(self) -> tzinfo:
        return zone(self.zone)

    def trigger(self) -> BaseTrigger:
        if self.kind == "at":
            return DateTrigger(run_date=datetime.fromisoformat(self.spec))
        if self.kind == "every":
            # In UTC: the runs are exactly `spec` seconds apart, across DST changes too.
            return IntervalTrigger(seconds=int(self.spec), start_date=datetime.fromtimestamp(self._anchor, UTC),
                                   timezone=UTC)
        return cron_trigger(self.spec, self.tz)

    @property
    def _anchor(self) -> float:
        assert self.anchor is not None, "an `every` schedule has an anchor"
        return self.anchor

    def slot_at(self, now: datetime) -> datetime | None:
        """The latest run at or before `now` (None: none yet)."""
        if self.kind == "at":
            run = datetime.fromisoformat(self.spec)
            return run if run <= now else None
        if self.kind == "every":
            period, since = int(self.spec), now.timestamp() - self._anchor
            if since < 0:
                return None
            return datetime.fromtimestamp(self._anchor + math.floor(since / period) * period, UTC)
        trigger = cron_trigger(self.spec, self.tz)
        return last_fire_time(trigger, now.astimezone(self.tz))

    def next_after(self, now: datetime) -> datetime | None:
        """The first run after `now` (None: no more)."""
        if self.kind == "at":
            run = datetime.fromisoformat(self.spec)
            return run if run > now else None
        if self.kind == "every":
            period, since = int(self.spec), now.timestamp() - self._anchor
            if since < 0:
                return datetime.fromtimestamp(self._anchor, UTC)
            return datetime.fromtimestamp(self._anchor + (math.floor(since / period) + 1) * period, UTC)
        trigger = cron_trigger(self.spec, self.tz)
        return trigger.get_next_fire_time(None, now.astimezone(self.tz) + timedelta(microseconds=1))

    def describe(self, tz: tzinfo) -> str:
        if self.kind == "at":
            return f"once at {format_time(datetime.fromisoformat(self.spec), tz)}"
        if self.kind == "every":
            return f"every {format_period(int(self.spec))}"
        return f"cron `{self.spec}` ({self.zone or 'system time'})"


def parse_schedule(*, at: str | None, every: str | None, cron: str | None, now: datetime,
                   zone_name: str | None, min_interval_s: int) -> Schedule:
    """The schedule `schedule_task` was given; TaskError with a clear reason otherwise."""
    given = [name for name, value in (("at", at), ("every", every), ("cron", cron))
             if value is not None and str(value).strip()]
    if not given:
        raise TaskError("give one of at (a time such as 2026-05-01T09:30 or a delay such as 'in 20m'), "
                        "every (a period such as '2h') or cron (five fields such as '0 9 * * 1-5')")
    if len(given) > 1:
        raise TaskError(f"give only one of at, every and cron (got {' and '.join(given)})")
    tz = zone(zone_name)
    if at is not None and at.strip():
        return Schedule("at", _parse_at(at.strip(), now.astimezone(tz), tz).isoformat(), zone_name)
    if every is not None and every.strip():
        seconds = _parse_every(every.strip(), min_interval_s)
        return Schedule("every", str(seconds), zone_name, anchor=now.timestamp() + seconds)
    assert cron is not None
    _check_cron(cron.strip(), tz, now, min_interval_s)
    return Schedule("cron", " ".join(cron.split()), zone_name)


def _parse_at(text: str, now: datetime, tz: tzinfo) -> datetime:
    lowered = text.lower()
    delay = parse_duration(lowered.removeprefix("in ")) if lowered.startswith("in ") else None
    if delay is None and not lowered.startswith("in "):
        try:
            when = datetime.fromisoformat(text)
        except ValueError:
            when = None
        if when is not None:
            if when.tzinfo is None:
                when = when.replace(tzinfo=tz)  # a wall-clock time in the configured zone
            if when <= now:
                raise TaskError(f"at: {text} is in the past (it is now {format_time(now, tz)}); give a "
                                "future time or a delay such as 'in 20m'")
            if when - now > MAX_AHEAD:
                raise TaskError(f"at: {text} is more than 5 years ahead")
            return when
        delay = parse_duration(lowered)  # "20m" without "in"
    if delay is None:
        raise TaskError(f"at: {text!r} is neither an ISO 8601 time (such as 2026-05-01T09:30, read in "
                        f"{getattr(tz, 'key', tz)}) nor a delay such as 'in 20m', 'in 2h' or 'in 1d 3h'")
    if delay <= 0:
        raise TaskError("at: the delay must be more than 0 seconds")
    if delay > MAX_AHEAD.total_seconds():
        raise TaskError(f"at: {text} is more than 5 years ahead")
    return now + timedelta(seconds=delay)


def _parse_every(text: str, min_interval_s: int) -> int:
    words = text.lower().removeprefix("every ").strip()
    seconds = float(words) if re.fullmatch(r"\d+(?:\.\d+)?", words) else parse_duration(words)
    if seconds is None:
        raise TaskError(f"every: {text!r} is not a period; write it like '30m', '2h' or '1d 12h'")
    whole = round(seconds)
    if whole < min_interval_s:
        raise TaskError(f"every {text}: too frequent; a task may repeat at most every "
                        f"{format_period(min_interval_s)} (tasks.min_interval_s)")
    if whole > MAX_AHEAD.total_seconds():
        raise TaskError(f"every {text}: more than 5 years")
    return whole


def _check_cron(expr: str, tz: tzinfo, now: datetime, min_interval_s: int) -> None:
    try:
        trigger = cron_trigger(expr, tz)
    except ValueError as err:
        reason = str(err) if str(err).startswith(repr(expr)) else f"{expr!r} is not a valid cron expression: {err}"
        raise TaskError(f"cron: {reason}; write five fields (minute hour day month weekday) such as "
                        "'0 9 * * 1-5'") from None
    runs: list[datetime] = []
    previous: datetime | None = None
    start = now.astimezone(tz)
    for _ in range(CRON_CHECKED_RUNS):
        run = trigger.get_next_fire_time(previous, start if previous is None else previous + timedelta(microseconds=1))
        if run is None:
            break
        runs.append(run)
        previous = run
    if not runs:
        raise TaskError(f"cron: {expr!r} never runs (no such date)")
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(runs)]
    if gaps and min(gaps) < min_interval_s:
        raise TaskError(f"cron: {expr!r} runs too often; two runs must be at least "
                        f"{format_period(min_interval_s)} apart (tasks.min_interval_s)")


def task_text(task_id: str, prompt: str) -> str:
    """What the model reads when a task runs: plainly the gateway's, not a person's words."""
    return f"[Scheduled task {task_id} is due now. Its instructions: {prompt}]"


def routing_of(inbound: Inbound) -> dict[str, Any]:
    """What a reply to `inbound` needs, kept with a task to answer without a new message."""
    return {
        "channel": inbound.channel, "chat_id": inbound.chat_id, "user_id": inbound.user_id,
        "thread_id": inbound.thread_id, "is_group": inbound.is_group, "mentioned": inbound.mentioned,
        "reply_to_bot": inbound.reply_to_bot, "user_name": inbound.user_name,
        "extra": {k: v for k, v in inbound.extra.items() if k not in _DROPPED_EXTRA},
    }


def new_task_id(length: int = ID_LENGTH) -> str:
    return "".join(secrets.choice(ID_ALPHABET) for _ in range(length))


def clean_task_id(text: str) -> str:
    return text.strip().strip("`'\"").lower()


def slot_key(slot: datetime) -> str:
    return slot.astimezone(UTC).isoformat(timespec="seconds")


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
        ended_at=row["ended_at"], end_reason=row["end_reason"],
    )


class TaskStore:
    """The `tasks` and `task_runs` tables; one statement per call."""

    def __init__(self, store: StoreBackend) -> None:
        self.store = store

    async def insert(self, task: Task, *, limit: int) -> Literal["ok", "full", "taken"]:
        """Add `task` unless its scope has `limit` active tasks already (checked in the
        same statement, so two sessions of a scope cannot both take the last place)."""
        s = task.schedule
        rows = await self.store.run(
            "INSERT INTO tasks(id, scope, session_key, routing, prompt, kind, spec, zone, anchor, next_run, "
            "created_by, created_at) SELECT ?,?,?,?,?,?,?,?,?,?,?,? "
            "WHERE (SELECT count(*) FROM tasks WHERE scope=? AND ended_at IS NULL) < ? "
            "ON CONFLICT(id) DO NOTHING RETURNING id",
            (task.id, task.scope, task.session_key, json.dumps(task.routing, ensure_ascii=False), task.prompt,
             s.kind, s.spec, s.zone, s.anchor, task.next_run, task.created_by, task.created_at, task.scope, limit),
        )
        if rows:
            return "ok"
        return "full" if await self.count_active(task.scope) >= limit else "taken"

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


# -- the running part ----------------------------------------------------------------------

Admits = Callable[[Inbound], Awaitable[bool]]


def _job_id(task_id: str) -> str:
    return f"task:{task_id}"


class TaskScheduler:
    """Owns the task jobs of one gateway: creates, lists, cancels and runs tasks."""

    def __init__(self, services: Services, sessions: SessionManager, *, admits: Admits,
                 can_deliver: Callable[[str], bool], clock: Callable[[], datetime] | None = None,
                 sync_s: float | None = None) -> None:
        self.s = services
        self.sessions = sessions
        self.db = TaskStore(services.store)
        self._admits = admits
        self._can_deliver = can_deliver
        self._clock = clock or (lambda: datetime.now(UTC))
        self._aps: AsyncIOScheduler | None = None
        self._work = Background("tasks")
        self._grace = services.cfg.tasks.misfire_grace_s
        # Only a database other gateways share can change under us; a lone gateway's jobs
        # change only here.
        self._sync_every = sync_s if sync_s is not None else (
            SYNC_INTERVAL_S if getattr(services.store, "shared", False) else None)
        self._syncer: asyncio.Task[None] | None = None
        self._running: set[str] = set()  # tasks with a run_due in progress here

    # -- lifecycle

    async def start(self) -> None:
        """Schedule every active task again, each from its stored next run."""
        aps = AsyncIOScheduler(timezone=UTC, event_loop=asyncio.get_running_loop(),
                               job_defaults={"coalesce": True, "max_instances": 1})
        aps.add_listener(self._on_missed, EVENT_JOB_MISSED)
        aps.start()
        self._aps = aps
        restored = 0
        for task in await self.db.active():
            try:
                self._schedule(task)
                restored += 1
            except Exception:  # one unreadable row must not keep the others from running
                log.exception("task could not be scheduled", extra={"task": task.id})
        if restored:
            log.info("scheduled tasks restored", extra={"count": restored})
        if self._sync_every is not None:
            self._syncer = asyncio.get_running_loop().create_task(self._sync_loop(self._sync_every),
                                                                  name="tasks:sync")

    async def _sync_loop(self, every: float) -> None:
        while True:
            await asyncio.sleep(every)
            try:
                await asyncio.wait_for(self.sync(), SYNC_TIMEOUT_S)
            except (asyncio.CancelledError, KeyboardInterrupt):
                raise
            except Exception as err:  # the database is away for a moment: the next sync retries
                log.warning("tasks sync failed", extra={"error": str(err)[:200]})

    async def sync(self) -> tuple[int, int]:
        """Make this gateway's jobs match the active tasks in the database: schedule the
        ones made elsewhere, drop those ended elsewhere, follow a next run moved elsewhere.
        (added or moved, removed)."""
        aps = self._aps
        if aps is None or not aps.running:
            return 0, 0
        # Jobs that existed before the read: one made here while it runs is not dropped
        # for missing from a snapshot taken before its row was written.
        before = {job.id for job in aps.get_jobs()}
        tasks = await self.db.active()
        if self._aps is not aps or not aps.running:
            return 0, 0
        now = self._now().timestamp()
        active = {_job_id(t.id) for t in tasks}
        changed = removed = 0
        for task in tasks:
            job = aps.get_job(_job_id(task.id))
            if task.next_run is None or task.id in self._running:
                continue  # a run here moves it on itself
            if job is None:
                if _job_id(task.id) in before:
                    continue  # gone since the read: ended or fired here (a one-shot's job ends)
            elif job.next_run_time is not None and (
                    abs(job.next_run_time.timestamp() - task.next_run) <= SAME_RUN_S or task.next_run <= now):
                # In step, or the row still names the slot firing now (its run advances it).
                continue
            try:
                self._schedule(task)
                changed += 1
            except Exception:
                log.exception("task could not be scheduled", extra={"task": task.id})
        for job_id in before - active:
            if aps.get_job(job_id) is not None:
                aps.remove_job(job_id)
                removed += 1
        if changed or removed:
            log.info("tasks synced with the database", extra={"scheduled": changed, "removed": removed})
        return changed, removed

    async def stop(self) -> None:
        if self._syncer is not None:
            self._syncer.cancel()
            await asyncio.wait({self._syncer}, timeout=5)
            self._syncer = None
        if self._aps is not None and self._aps.running:
            self._aps.shutdown(wait=False)
            await asyncio.sleep(0)  # APScheduler shuts down in a loop callback; let it run
        self._aps = None
        # A run waiting for a busy session is cut here: its event stays accepted and the
        # turn is resumed after the restart (Router.resume_pending).
        await self._work.close()

    async def wait_idle(self, timeout: float) -> bool:
        return await self._work.wait_idle(timeout)

    def update_config(self, cfg: Config) -> None:
        """A new misfire grace applies to every job at once; the other keys are read per use."""
        grace = cfg.tasks.misfire_grace_s
        if grace == self._grace:
            return
        self._grace = grace
        if self._aps is not None and self._aps.running:
            for job in self._aps.get_jobs():
                job.modify(misfire_grace_time=grace)

    def job_grace(self, task_id: str) -> int | None:
        """The misfire grace the task's job runs with now (None: no job)."""
        job = self._aps.get_job(_job_id(task_id)) if self._aps is not None else None
        return job.misfire_grace_time if job is not None else None

    def job_next_run(self, task_id: str) -> datetime | None:
        """When the task's job fires next here (None: no job)."""
        job = self._aps.get_job(_job_id(task_id)) if self._aps is not None else None
        return job.next_run_time if job is not None else None

    def _now(self) -> datetime:
        return self._clock().astimezone(UTC)

    def _schedule(self, task: Task) -> None:
        if self._aps is None or task.next_run is None:
            return
        self._aps.add_job(
            self._fire, task.schedule.trigger(), args=[task.id], id=_job_id(task.id), name=f"task {task.id}",
            next_run_time=datetime.fromtimestamp(task.next_run, UTC), misfire_grace_time=self._grace,
            replace_existing=True,
        )

    def _unschedule(self, task_id: str) -> None:
        if self._aps is not None and self._aps.get_job(_job_id(task_id)) is not None:
            self._aps.remove_job(_job_id(task_id))

    # -- what people do (tools and /tasks)

    async def create(self, *, scope: str, session_key: str, inbound: Inbound, prompt: str, at: str | None,
                     every: str | None, cron: str | None, cfg: Config) -> Task:
        text = prompt.strip()
        if not text:
            raise TaskError("prompt is empty; say what should happen when the task runs")
        if len(text) > MAX_PROMPT_CHARS:
            raise TaskError(f"prompt is {len(text):,} characters; keep it under {MAX_PROMPT_CHARS:,}")
        limit = cfg.tasks.max_per_scope
        if await self.db.count_active(scope) >= limit:
            raise TaskError(self._full(limit))
        now = self._now()
        schedule = parse_schedule(at=at, every=every, cron=cron, now=now, zone_name=cfg.timezone,
                                  min_interval_s=cfg.tasks.min_interval_s)
        first = schedule.next_after(now)
        if first is None:  # cannot happen for a schedule that parsed; guards the invariant
            raise TaskError("that schedule never runs")
        for attempt in range(12):
            task = Task(id=new_task_id(ID_LENGTH if attempt < 8 else ID_LENGTH + 2), scope=scope,
                        session_key=session_key, routing=routing_of(inbound), prompt=text, schedule=schedule,
                        next_run=first.timestamp(), created_by=inbound.identity, created_at=time.time())
            result = await self.db.insert(task, limit=limit)
            if result == "full":
                raise TaskError(self._full(limit))
            if result == "ok":
                self._schedule(task)
                log.info("task scheduled", extra={"task": task.id, "session": session_key, "kind": schedule.kind})
                return task
        raise TaskError("could not find a free task id; please try again")

    @staticmethod
    def _full(limit: int) -> str:
        if limit == 0:
            return "scheduling tasks is switched off (tasks.max_per_scope is 0)"
        return (f"this chat has {limit} scheduled task{'s' if limit != 1 else ''} already, the most allowed "
                "(tasks.max_per_scope); cancel one first")

    async def visible(self, scope: str, *, everything: bool = False) -> list[Task]:
        return await self.db.active(None if everything else scope)

    async def cancel(self, task_id: str, *, scope: str, identity: str, cfg: Config) -> Task:
        """Cancel a task of `scope` (any task, for an admin); TaskError otherwise. Another
        scope's task is reported as unknown: its existence is not that scope's to learn."""
        wanted = clean_task_id(task_id)
        task = await self.db.get(wanted) if wanted else None
        if task is None or (task.scope != scope and not is_admin(cfg, identity)):
            raise TaskError(f"there is no task {wanted!r} here; list them with /tasks")
        if not task.active:
            raise TaskError(f"task {task.id} has ended already ({task.end_reason})")
        await self.db.end(task.id, "cancelled", by=identity)
        self._unschedule(task.id)
        log.info("task cancelled", extra={"task": task.id, "by": identity})
        return task

    def describe(self, tasks: list[Task], cfg: Config, *, with_scope: bool = False) -> list[str]:
        tz = zone(cfg.timezone)
        lines = []
        for task in tasks:
            when = (f"next {format_time(datetime.fromtimestamp(task.next_run, UTC), tz)}"
                    if task.next_run is not None else "no next run")
            where = f" [{task.scope}]" if with_scope else ""
            lines.append(f"- `{task.id}`{where} {task.schedule.describe(tz)}; {when}: {task.preview()}")
        return lines

    # -- runs

    async def _fire(self, task_id: str) -> None:
        # Runs in APScheduler's executor: hand over to a task we own (cancelled on stop).
        self._work.spawn(self.run_due(task_id), name=task_id)

    def _on_missed(self, event: JobExecutionEvent) -> None:
        task_id = str(event.job_id).removeprefix("task:")
        self._work.spawn(self._missed(task_id, event.scheduled_run_time), name=f"{task_id}:missed")

    async def _missed(self, task_id: str, slot: datetime) -> None:
        task = await self.db.get(task_id)
        if task is None or not task.active:
            return
        claimed = await self.db.claim_run(task.id, slot_key(slot), outcome="missed")
        await self.db.advance(task.id, task.schedule.next_after(self._now()), reason="missed")
        if claimed:
            self._count("missed")
            log.warning("task run missed by more than tasks.misfire_grace_s",
                        extra={"task": task.id, "slot": slot_key(slot)})

    async def run_due(self, task_id: str) -> str | None:
        """Run the task's slot that is due now, once; the run's outcome (None: nothing ran)."""
        self._running.add(task_id)
        try:
            return await self._run_due(task_id)
        finally:
            self._running.discard(task_id)

    async def _run_due(self, task_id: str) -> str | None:
        task = await self.db.get(task_id)
        if task is None or not task.active:
            self._unschedule(task_id)
            return None
        now = self._now()
        slot = task.schedule.slot_at(now)
        if slot is None:
            return None
        key = slot_key(slot)
        claimed = await self.db.claim_run(task.id, key)
        await self.db.advance(task.id, task.schedule.next_after(now))
        if not claimed:
            log.info("task slot ran already", extra={"task": task.id, "slot": key})
            return None
        inbound = task.inbound_for(slot)
        event = (inbound.channel, inbound.event_id)
        try:
            outcome = await self._start_turn(task, inbound)
        except (asyncio.CancelledError, KeyboardInterrupt):
            raise
        except Exception:
            log.exception("task run failed", extra={"task": task.id})
            outcome = "error"
        await self.db.finish_run(task.id, key, outcome, event if outcome in ("queued", "busy") else None)
        self._count(outcome)
        log.info("task run", extra={"task": task.id, "slot": key, "outcome": outcome})
        return outcome

    async def _start_turn(self, task: Task, inbound: Inbound) -> str:
        cfg = self.s.cfg
        if not self._can_deliver(inbound.channel):
            return "no_channel"
        # The creator's access is checked again: someone removed since cannot keep a bot talking.
        if not await self._admits(inbound):
            return "refused"
        if self.s.usage is not None and await self.s.usage.refusal(cfg, inbound.identity) is not None:
            return "over_budget"
        store = self.s.store
        if not await store.record_event(inbound.channel, inbound.event_id, session_key=task.session_key,
                                        inbound=inbound_to_dict(inbound)):
            return "duplicate"
        for attempt in range(BUSY_RETRIES + 1):
            if await self.sessions.submit(task.session_key, task.scope, TurnJob(inbound)):
                return "queued"
            if attempt < BUSY_RETRIES:
                await asyncio.sleep(BUSY_RETRY_S)
        await store.mark_event(inbound.channel, inbound.event_id, "busy")
        return "busy"

    def _count(self, outcome: str) -> None:
        self.s.metrics.task_runs.labels(outcome).inc()
