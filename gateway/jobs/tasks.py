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
import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta

from apscheduler.events import EVENT_JOB_MISSED, JobExecutionEvent
from apscheduler.schedulers.asyncio import AsyncIOScheduler

from gateway.access import is_admin
from gateway.background import Background
from gateway.config.cron import zone
from gateway.config.holder import ConfigHolder
from gateway.config.schema import Config
from gateway.hub import Reach
from gateway.ops.metrics import Metrics
from gateway.store.api import StoreBackend
from gateway.tasks.schedule import (
    ID_LENGTH,
    MAX_PROMPT_CHARS,
    TaskError,
    clean_task_id,
    format_time,
    new_task_id,
    parse_schedule,
    routing_of,
    run_of,
    slot_key,
)
from gateway.tasks.store import Task, TaskStore
from gateway.turns.sessions import SessionManager, TurnJob
from gateway.turns.usage import Usage
from gateway.types import Inbound, inbound_to_dict

log = logging.getLogger("gateway.tasks")

# A session whose queue is full: try again a few times before the run is recorded "busy".
BUSY_RETRIES = 6
BUSY_RETRY_S = 10.0
SYNC_INTERVAL_S = 12.0  # shared database: how often the jobs follow tasks made or ended elsewhere
SYNC_TIMEOUT_S = 30.0
SAME_RUN_S = 1.0  # a job and its row disagree on the next run by more than this: follow the row
# Tasks that tasks' runs may make per scope in CHAIN_WINDOW_S (an unattended chain or fan-out;
# a legitimate "check again in 10 minutes" chain makes 6 an hour).
CHAINED_PER_HOUR = 12
CHAIN_WINDOW_S = 3600.0

# -- the running part ----------------------------------------------------------------------

Admits = Callable[[Inbound], Awaitable[bool]]


def _job_id(task_id: str) -> str:
    return f"task:{task_id}"


class TaskScheduler:
    """Owns the task jobs of one gateway: creates, lists, cancels and runs tasks.

    Built with the services (the task tools and /tasks talk to it as a `TaskBook`); its
    runs become turns from `start` on, in the sessions it is given then."""

    def __init__(self, store: StoreBackend, config: ConfigHolder, metrics: Metrics, usage: Usage, *,
                 channels: Reach, clock: Callable[[], datetime] | None = None, sync_s: float | None = None) -> None:
        self.store = store
        self.config = config
        self.metrics = metrics
        self.usage = usage
        self.db = TaskStore(store)
        self._channels = channels  # a run's reply must have its channel here
        self._turns: tuple[SessionManager, Admits] | None = None  # from start(): where runs go
        self._clock = clock or (lambda: datetime.now(UTC))
        self._aps: AsyncIOScheduler | None = None
        self._work = Background("tasks")
        self._grace = config.current.tasks.misfire_grace_s
        # Only a database other gateways share can change under us; a lone gateway's jobs
        # change only here.
        self._sync_every = sync_s if sync_s is not None else (
            SYNC_INTERVAL_S if getattr(store, "shared", False) else None)
        self._syncer: asyncio.Task[None] | None = None
        self._running: set[str] = set()  # tasks with a run_due in progress here

    # -- lifecycle

    async def start(self, sessions: SessionManager, *, admits: Admits) -> None:
        """Schedule every active task again, each from its stored next run; a run is a turn
        queued in `sessions`, for a creator `admits` still lets in."""
        self._turns = (sessions, admits)
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
        # A task made by a task's run is a link of a chain no person watches: it runs no
        # sooner than tasks.min_interval_s after the run that made it (the slot is read back
        # in whole seconds: one more second keeps the gap whole), and the scope may get at
        # most CHAINED_PER_HOUR of them an hour, so a chain or a fan-out cannot loop fast.
        made_by = run_of(inbound)
        chained: tuple[float, int] | None = None
        since = now
        if made_by is not None:
            earliest = made_by[1] + timedelta(seconds=cfg.tasks.min_interval_s + 1)
            schedule = schedule.not_before(earliest)
            since = max(now, earliest - timedelta(microseconds=1))
            chained = (now.timestamp() - CHAIN_WINDOW_S, CHAINED_PER_HOUR)
        first = schedule.next_after(since)
        if first is None:  # cannot happen for a schedule that parsed; guards the invariant
            raise TaskError("that schedule never runs")
        for attempt in range(12):
            task = Task(id=new_task_id(ID_LENGTH if attempt < 8 else ID_LENGTH + 2), scope=scope,
                        session_key=session_key, routing=routing_of(inbound), prompt=text, schedule=schedule,
                        next_run=first.timestamp(), created_by=inbound.identity, created_at=now.timestamp(),
                        made_by_task=made_by[0] if made_by is not None else None)
            result = await self.db.insert(task, limit=limit, chained=chained)
            if result == "full":
                raise TaskError(self._full(limit))
            if result == "chained":
                log.warning("task refused: too many tasks made by tasks", extra={
                    "session": session_key, "by_task": task.made_by_task, "limit": CHAINED_PER_HOUR})
                raise TaskError(f"scheduled tasks have made {CHAINED_PER_HOUR} tasks in this chat in the last hour, "
                                "the most allowed; a task may not schedule another now (a person still can)")
            if result == "ok":
                self._schedule(task)
                log.info("task scheduled", extra={"task": task.id, "session": session_key, "kind": schedule.kind,
                                                  "by_task": task.made_by_task})
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
        cfg = self.config.current
        assert self._turns is not None, "runs fire only once started"
        sessions, admits = self._turns
        if not self._channels.can_deliver(inbound.channel):
            return "no_channel"
        # The creator's access is checked again: someone removed since cannot keep a bot talking.
        if not await admits(inbound):
            return "refused"
        if await self.usage.refusal(cfg, inbound.identity) is not None:
            return "over_budget"
        store = self.store
        if not await store.record_event(inbound.channel, inbound.event_id, session_key=task.session_key,
                                        inbound=inbound_to_dict(inbound)):
            return "duplicate"
        for attempt in range(BUSY_RETRIES + 1):
            if await sessions.submit(task.session_key, task.scope, TurnJob(inbound)):
                return "queued"
            if attempt < BUSY_RETRIES:
                await asyncio.sleep(BUSY_RETRY_S)
        await store.mark_event(inbound.channel, inbound.event_id, "busy")
        return "busy"

    def _count(self, outcome: str) -> None:
        self.metrics.task_runs.labels(outcome).inc()
