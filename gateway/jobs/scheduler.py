"""Scheduled jobs (SPEC §7): memory consolidation and the retention purge, in process.

APScheduler 3 (AsyncIOScheduler on the gateway's loop) only says *when*; each firing is
handed to a task we own. Every run is recorded in `job_runs` under its slot (the
scheduled fire time, ISO), claimed before it starts, so a restart neither repeats a slot
nor skips one: at start, the most recent consolidation slot is caught up once when it has
no run, or when its run never finished (the process died during it).

Several gateways on one database (SPEC §10) all schedule both jobs; the claim in
`job_runs` lets one of them run each slot. A consolidation runs under the lease
`job:<job>:<slot>` as well, so a run that has not finished is taken over at start only
when no live gateway holds it (its gateway died), and by one gateway.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Callable
from datetime import datetime, tzinfo
from pathlib import Path
from typing import Any

from apscheduler.schedulers.asyncio import AsyncIOScheduler

from gateway.background import Background
from gateway.cluster.leases import Leases, SoloLeases
from gateway.config.cron import cron_trigger, last_fire_time, zone
from gateway.config.schema import Config
from gateway.memory.consolidate import CompletionModel, Consolidator
from gateway.memory.files import Memory
from gateway.memory.purge import PurgeReport, Remember, purge
from gateway.store.api import StoreBackend
from gateway.store.rows import slot_time, slot_words

log = logging.getLogger("gateway.scheduler")

JOB_CONSOLIDATION = "memory_consolidation"
JOB_PURGE = "purge"
CONSOLIDATION_LEASE = f"job:{JOB_CONSOLIDATION}"  # held by the one gateway consolidating now
CONSOLIDATION_WAIT_S = 3600  # a slot waits this long for another gateway's run to end
JOB_LEASE_RETRY_S = 1.0
PURGE_CRON = "30 3 * * *"  # daily, at a quiet hour
MISFIRE_GRACE_S = 6 * 3600  # a loop that was busy still runs the job late
CONSOLIDATION_CONCURRENCY = 2


def config_timezone(cfg: Config) -> tzinfo:
    """The configured zone, else the system's."""
    return zone(cfg.timezone)


class Scheduler:
    def __init__(
        self, cfg: Config, *, store: StoreBackend, memory: Memory, model: CompletionModel,
        live_references: Callable[[], set[Path]], clock: Callable[[], datetime] | None = None,
        metrics: Callable[[str, str], None] | None = None, leases: Leases | None = None,
        remember: Remember | None = None,
    ) -> None:
        self._cfg = cfg
        self._leases: Leases = leases if leases is not None else SoloLeases()
        self._store = store
        self._memory = memory
        self._live_references = live_references
        self._remember = remember  # the turns no summary covers go to memory before the purge
        self._tz = config_timezone(cfg)
        self._clock = clock or (lambda: datetime.now(self._tz))
        self._metrics = metrics
        self._trigger = cron_trigger(cfg.memory_consolidation_cron, self._tz)
        self._consolidator = Consolidator(
            memory, store, model, concurrency=CONSOLIDATION_CONCURRENCY,
            target_tokens=cfg.memory_max_tokens or 4000,
        )
        self._aps: AsyncIOScheduler | None = None
        self._tasks = Background("scheduler")
        self._consolidating = asyncio.Lock()  # one consolidation run at a time
        self._purging = asyncio.Lock()
        self._claimed: set[str] = set()  # slots this process claimed (still running or done)

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Schedule the jobs; purge once and catch up a missed consolidation, in the background."""
        aps = AsyncIOScheduler(
            timezone=self._tz, event_loop=asyncio.get_running_loop(),
            job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": MISFIRE_GRACE_S},
        )
        aps.add_job(self._fire, self._trigger, args=[JOB_CONSOLIDATION], id=JOB_CONSOLIDATION)
        aps.add_job(self._fire, cron_trigger(PURGE_CRON, self._tz), args=[JOB_PURGE], id=JOB_PURGE)
        aps.start()
        self._aps = aps
        self._tasks.spawn(self._startup(), name="startup")

    async def stop(self) -> None:
        if self._aps is not None and self._aps.running:
            self._aps.shutdown(wait=False)
            await asyncio.sleep(0)  # APScheduler shuts down in a loop callback; let it run
        self._aps = None
        await self._tasks.close()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until the jobs running now (startup work included) are done."""
        return await self._tasks.wait_idle(timeout)

    def update_config(self, cfg: Config) -> None:
        """Apply a reloaded config: a new cron or zone reschedules consolidation."""
        old, self._cfg = self._cfg, cfg
        self._consolidator.target_tokens = cfg.memory_max_tokens or 4000
        if (old.memory_consolidation_cron, old.timezone) == (cfg.memory_consolidation_cron, cfg.timezone):
            return
        self._tz = config_timezone(cfg)
        self._trigger = cron_trigger(cfg.memory_consolidation_cron, self._tz)
        if self._aps is not None and self._aps.running:
            self._aps.reschedule_job(JOB_CONSOLIDATION, trigger=self._trigger)

    def next_runs(self) -> dict[str, datetime | None]:
        """Each scheduled job's next fire time (the admin page shows them)."""
        if self._aps is None or not self._aps.running:
            return {}
        return {job.id: job.next_run_time for job in self._aps.get_jobs()}

    def next_consolidation(self) -> datetime | None:
        return self._trigger.get_next_fire_time(None, self._now())

    def _now(self) -> datetime:
        return self._clock().astimezone(self._tz)

    async def _fire(self, job: str) -> None:
        # Runs in APScheduler's executor: hand over to a task we own (cancelled on stop).
        if job == JOB_CONSOLIDATION:
            self._tasks.spawn(self._scheduled_consolidation(), name=job)
        else:
            self._tasks.spawn(self._scheduled_purge(), name=job)

    async def _startup(self) -> None:
        # Every start purges once: the slot names this start, not a schedule.
        await self._guard(self.run_purge(slot=f"start:{self._now().isoformat()}:{uuid.uuid4().hex[:8]}"),
                          JOB_PURGE)
        fire = last_fire_time(self._trigger, self._now())
        if fire is None:
            return
        slot = fire.isoformat()
        run = await self._store.job_run(JOB_CONSOLIDATION, slot)
        if run is not None and run.ended_at is None and slot not in self._claimed:
            await self._guard(self.run_consolidation(slot, unfinished=True), JOB_CONSOLIDATION)
        elif run is None and await self._ran_before(fire):
            log.info("catching up the missed consolidation of %s", slot_words(slot))
            await self._guard(self.run_consolidation(slot), JOB_CONSOLIDATION)

    async def _ran_before(self, fire: datetime) -> bool:
        """Whether this data dir had a gateway running before `fire`: only then was that
        slot missed (a fresh install has nothing to catch up). Every start records a
        purge, so the oldest purge run tells when the gateway first ran."""
        rows = await self._store.run("SELECT slot FROM job_runs WHERE job=? ORDER BY id LIMIT 1", (JOB_PURGE,))
        first = slot_time(str(rows[0][0])) if rows else None
        return first is not None and first < fire

    async def _scheduled_consolidation(self) -> None:
        fire = last_fire_time(self._trigger, self._now())
        slot = fire.isoformat() if fire else f"manual:{self._now().isoformat()}"
        await self._guard(self.run_consolidation(slot), JOB_CONSOLIDATION)

    async def _scheduled_purge(self) -> None:
        fire = last_fire_time(cron_trigger(PURGE_CRON, self._tz), self._now())
        slot = fire.isoformat() if fire else f"manual:{self._now().isoformat()}"
        await self._guard(self.run_purge(slot=slot), JOB_PURGE)

    async def _guard(self, work: Any, job: str) -> None:
        try:
            await work
        except asyncio.CancelledError:
            raise
        except Exception:  # recorded and logged; the next slot runs as usual
            log.exception("%s job failed", job)

    def _metric(self, job: str, outcome: str) -> None:
        if self._metrics is not None:
            self._metrics(job, outcome)

    # -- the jobs --------------------------------------------------------------------------

    async def run_consolidation(self, slot: str | None = None, *, unfinished: bool = False) -> dict[str, str]:
        """Consolidate every scope once for `slot`; {} when that slot already ran (or runs
        on another gateway). With `unfinished`, a run of the slot that never finished is
        run again, unless a live gateway is still running it."""
        slot = slot or f"manual:{self._now().isoformat()}"
        lease = f"job:{JOB_CONSOLIDATION}:{slot}"
        async with self._consolidating:
            # One run at a time across gateways too: two slots merging at once would both
            # read the same notes before either moved their watermarks.
            if not await self._wait_for_lease(CONSOLIDATION_LEASE, CONSOLIDATION_WAIT_S):
                log.warning("consolidation of %s skipped: another gateway's run lasted over %d s",
                            slot_words(slot), CONSOLIDATION_WAIT_S)
                return {}
            try:
                if await self._leases.acquire(lease) is None:
                    log.info("consolidation of %s runs on another gateway; skipped", slot_words(slot))
                    return {}
                try:
                    return await self._consolidate(slot, unfinished=unfinished)
                finally:
                    await self._leases.release(lease)
            finally:
                await self._leases.release(CONSOLIDATION_LEASE)

    async def _wait_for_lease(self, name: str, timeout: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while await self._leases.acquire(name) is None:
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(JOB_LEASE_RETRY_S)
        return True

    async def _consolidate(self, slot: str, *, unfinished: bool) -> dict[str, str]:
        if unfinished:
            # Read again under the lease: another gateway may have finished it meanwhile.
            run = await self._store.job_run(JOB_CONSOLIDATION, slot)
            if run is not None and run.ended_at is None:
                log.info("consolidation of %s never finished (its gateway stopped during the run); "
                         "running it again", slot_words(slot))
                await self._store.forget_job_run(JOB_CONSOLIDATION, slot)
        if not await self._store.start_job_run(JOB_CONSOLIDATION, slot):
            log.info("consolidation of %s already ran; skipped", slot_words(slot))
            return {}
        self._claimed.add(slot)
        try:
            outcomes = await self._consolidator.run()
        except asyncio.CancelledError:
            # Stopped mid-run (shutdown): release the slot so the next start catches it up.
            await self._store.forget_job_run(JOB_CONSOLIDATION, slot)
            raise
        except Exception as err:
            await self._store.finish_job_run(JOB_CONSOLIDATION, slot, "error", repr(err)[:500])
            self._metric(JOB_CONSOLIDATION, "error")
            raise
        failed = sorted(s for s, o in outcomes.items() if not o.startswith(("merged", "no new")))
        outcome = "partial" if failed else "ok"
        detail = json.dumps(outcomes, ensure_ascii=False)[:4000]
        await self._store.finish_job_run(JOB_CONSOLIDATION, slot, outcome, detail)
        self._metric(JOB_CONSOLIDATION, outcome)
        log.info("consolidation of %s: %s (%d scopes, %d to retry)",
                 slot_words(slot), outcome, len(outcomes), len(failed))
        return outcomes

    async def run_purge(self, slot: str | None = None) -> PurgeReport:
        slot = slot or f"manual:{self._now().isoformat()}"
        async with self._purging:
            if not await self._store.start_job_run(JOB_PURGE, slot):
                return PurgeReport()
            self._claimed.add(slot)
            cfg = self._cfg
            try:
                report = await purge(
                    self._store, self._memory.data_dir, now=self._now().timestamp(),
                    session_retention_days=cfg.session_retention_days,
                    tool_result_ttl_days=cfg.tool_result_ttl_days, live_references=self._live_references,
                    remember=self._remember,
                )
            except asyncio.CancelledError:
                await self._store.finish_job_run(JOB_PURGE, slot, "cancelled")
                raise
            except Exception as err:
                await self._store.finish_job_run(JOB_PURGE, slot, "error", repr(err)[:500])
                self._metric(JOB_PURGE, "error")
                raise
            await self._store.finish_job_run(JOB_PURGE, slot, "ok", report.line())
            self._metric(JOB_PURGE, "ok")
            log.info("purge %s: %s", slot_words(slot), report.line())
            return report
