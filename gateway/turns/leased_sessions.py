"""Per-session order across gateways (SPEC §10).

On a shared database any gateway may accept a message, but a session's turns still run
one at a time, in arrival order, cluster-wide. The database is the queue: the router
records each event (with its arrival number) and, once it is a turn, marks it `queued`.
A gateway that holds the lease `session:<key>` runs the session's waiting events oldest
first, whichever gateway accepted them (replies to Telegram and Slack go out from any
gateway), with every message it writes fenced by the lease's token. Before running it
rebuilds the session from the store: another gateway may have run turns since.

A web or terminal message is answered into the request that brought it, so only the
gateway that accepted it runs it while that gateway lives; the others stop there and
let it take the lease. Commands that need the session to themselves (/compact) queue
locally and run under the lease too.

Nothing is lost between gateways: after releasing a lease a worker looks again, so an
event that arrived while the lease was held is never left behind, and every gateway
sweeps about once a second for sessions with waiting events and no live lease — the
sessions of a gateway that died, taken over once its leases expire and resumed like
after a restart (a turn that was running continues from what it stored)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING, Any

from gateway.access import LOCAL_CHANNELS
from gateway.agents import Places
from gateway.services import Services
from gateway.store.errors import StoreError
from gateway.store.fence import FENCE, FencedOut
from gateway.turns.agent import Agent
from gateway.turns.commands import parse_command
from gateway.turns.sessions import (
    STOP_WAIT_S,
    CommandJob,
    Job,
    LeftoverCommand,
    SessionManager,
    StopOutcome,
    TurnJob,
)
from gateway.types import Inbound, inbound_from_dict

if TYPE_CHECKING:
    from channels.base import ReplyStream
    from gateway.store.postgres import QueuedEvent
    from gateway.turns.agent import TurnResult
    from gateway.turns.live import LiveSession, TurnStop

log = logging.getLogger("gateway.cluster")

SWEEP_INTERVAL_S = 1.0
# An event still only "accepted" is being decided on by the gateway that took it (access,
# command, queue). Past SETTLE_S it is the leftover of a gateway that died deciding, once
# that gateway is gone; a live one is given until DECIDE_LIMIT_S (an inline command whose
# reply waits out a platform's rate limit), after which it is taken as stuck.
SETTLE_S = 10.0
DECIDE_LIMIT_S = 120.0
SETTLE_POLL_S = 0.05
SLOW_POLL_S = 0.5
LEASE_RETRY_S = 0.2  # waiting for another gateway to finish a session this one must run
STOP_POLL_S = 0.5
# /stop for a turn another gateway runs (SPEC §6): the /stop event is marked STOP_ASKED with
# the turn it stops; the running gateway looks every TURN_STOP_POLL_S, takes it (STOP_TAKEN),
# stops the turn and marks it STOP_DONE once the turn has ended; the asking gateway reads
# that every STOP_ANSWER_POLL_S, for at most STOP_WAIT_S.
STOP_ASKED, STOP_TAKEN, STOP_DONE = "stop", "stop_taken", "stop_done"
TURN_STOP_POLL_S = 0.5
STOP_ANSWER_POLL_S = 0.1


class ClusterSessionManager(SessionManager):
    """SessionManager whose queue is the shared database and whose turns run under a lease."""

    def __init__(self, services: Services, agent: Agent, *, places: Places) -> None:
        super().__init__(services, agent)
        self.leases = self.s.leases
        self.places = places  # where an event taken over belongs (session key, scope)
        self._leftover: LeftoverCommand | None = None
        self._workers: dict[str, asyncio.Task[Any]] = {}
        self._commands: dict[str, list[CommandJob]] = {}
        self._wake_again: set[str] = set()
        self._sweeper: asyncio.Task[None] | None = None
        self._alive: tuple[float, set[str]] = (0.0, set())
        # What the session looked like in the store when this gateway last let it go: the
        # cached session is still good when nobody wrote to it since.
        self._left_at: dict[str, tuple[int, int]] = {}

    async def _handed_over(self, key: str) -> bool:
        # With another gateway alive, the session may have run there since this one last
        # had it: its context comes back whole, as that gateway had it. Alone on the
        # database, a session not cached here comes back from a restart (or from a gateway
        # that died: resumed like after a restart) — a few turns, as on SQLite (SPEC §4.5).
        return bool(await self._alive_instances(fresh=True) - {self.leases.instance})

    # -- intake -------------------------------------------------------------------------

    async def submit(self, key: str, scope: str, job: Job) -> bool:
        if self._stopping:
            return False
        store = self.s.store
        inbound = job.inbound
        if isinstance(job, CommandJob):
            # Runs here (its closure lives here); "command" keeps other gateways off it.
            await store.mark_event(inbound.channel, inbound.event_id, "command")
            self._commands.setdefault(key, []).append(job)
        elif job.resume_turn is None:
            # "Queue it unless the session is busy" is one statement (one round trip).
            if not await store.queue_event(inbound.channel, inbound.event_id, session_key=key,
                                           limit=self.s.cfg.limits.session_queue_size):
                self.s.metrics.busy.inc()
                return False
        self.wake(key, scope, inbound.channel)
        return True

    def wake(self, key: str, scope: str | None = None, channel: str | None = None) -> None:
        """Make sure a worker looks at the session (it may find another gateway on it)."""
        if key in self._workers:
            self._wake_again.add(key)
            return
        task = self.s.background.spawn(self._work_cluster(key, scope, channel), name=f"session:{key}")
        if task is not None:
            self._workers[key] = task

    def worker_of(self, key: str) -> asyncio.Task[Any] | None:
        # From the moment a message is queued: the worker may still wait for the lease.
        return self._workers.get(key)

    def queued(self) -> int:
        return sum(len(jobs) for jobs in self._commands.values()) + len(self._workers)

    # -- the worker -------------------------------------------------------------------------

    async def _work_cluster(self, key: str, scope: str | None, channel: str | None) -> None:
        name = f"session:{key}"
        try:
            await self.open.wait()
            while not self._stopping:
                self._wake_again.discard(key)
                events = await self.s.store.session_events(key)
                mine = self._must_run_here(events) or bool(self._commands.get(key))
                if not events and not mine:
                    if key in self._wake_again:
                        continue
                    return
                if not mine and not await self._may_run(events[0]):
                    return  # the next turn is for another gateway to run
                got = await self.leases.acquire_session(name, key)
                if got is None:
                    if not mine:
                        return  # the holder runs them, and looks again before letting go
                    await asyncio.sleep(LEASE_RETRY_S)
                    continue
                token, mark = got
                try:
                    progressed = await self._hold(key, scope, channel, name, token, events, mark)
                    self._left_at[key] = self._local_mark(key)
                except FencedOut:
                    # This gateway stalled and another took the session over: it runs the rest.
                    log.warning("session handed over while running", extra={"session": key})
                    progressed = True
                finally:
                    await self.leases.release(name)
                if not progressed and key not in self._wake_again:
                    # Only another live gateway's web/terminal events wait: theirs to run.
                    # A command queued here waits for them (no sweep would wake it).
                    if not self._commands.get(key):
                        return
                    await asyncio.sleep(LEASE_RETRY_S)
        except StoreError as err:
            # The database went away between turns (a turn's own failure is told in
            # _run_job): what waits stays queued there, and the sweep wakes it again.
            log.warning("session worker stopped: the database failed", extra={"session": key,
                                                                              "error": str(err)[:200]})
        finally:
            self._workers.pop(key, None)
            live = self.live.get(key)
            if live is not None and live.worker is asyncio.current_task():
                live.worker = None

    def _local_mark(self, key: str) -> tuple[int, int]:
        """The session's mark (last message id, context start) as this gateway leaves it:
        known here, since every message it wrote came back with its id (no round trip).
        (0, 0) when it holds no live state: the next hold rebuilds it anyway."""
        live = self.live.get(key)
        return (live.last_message_id, live.context_start) if live is not None else (0, 0)

    def _must_run_here(self, events: list[QueuedEvent]) -> bool:
        """Whether this gateway must run some of them itself (it accepted a web or terminal
        message of the session), so it waits for the lease instead of leaving them."""
        return any(ev.channel in LOCAL_CHANNELS and ev.instance == self.leases.instance for ev in events)

    async def _hold(self, key: str, scope: str | None, channel: str | None, name: str, token: int,
                    events: list[QueuedEvent], mark: tuple[int, int] | None = None) -> bool:
        """Run what waits while holding the lease; whether anything ran. `mark`: the
        session's mark read with the lease (None: read it now)."""
        first = events[0] if events else None
        if scope is None or channel is None:
            scope, channel = await self._scope_of(key, first)
        # Another gateway may have run turns since this one last did: then rebuild.
        if mark is None:
            mark = await self.s.store.session_mark(key)
        if key not in self.live or self._left_at.pop(key, None) != mark:
            self._forget(key)
        live = await self.get_live(key, scope, channel)
        live.worker = asyncio.current_task()
        FENCE.set((key, token))
        lost = self.leases.lost(name)
        ran = False
        tried: set[tuple[str, str]] = set()
        while not self._stopping:
            events = await self.s.store.session_events(key)
            if not events:
                commands = self._commands.pop(key, [])
                for job in commands:
                    await self._guarded(live, job, lost)
                    ran = True
                if not commands:
                    return ran
                continue
            ev = events[0]
            if ev.status == "accepted" and not await self._left_undecided(ev):
                # Its gateway is still deciding what it is.
                await asyncio.sleep(SETTLE_POLL_S if ev.age_s < SETTLE_S else SLOW_POLL_S)
                continue
            if not await self._may_run(ev):
                return ran
            if (ev.channel, ev.event_id) in tried:
                # It ran and its turn did not end (a crash or a storage error, already told
                # to the person): do not run it again and again; a restart would not either.
                log.error("turn did not end; marked failed", extra={"session": key, "event": ev.event_id})
                await self.s.store.mark_event(ev.channel, ev.event_id, "failed")
                continue
            tried.add((ev.channel, ev.event_id))
            job = await self._job_for(ev)
            if job is None:
                ran = True
                continue
            await self._guarded(live, job, lost)
            ran = True
        return ran

    async def _guarded(self, live: LiveSession, job: Job, lost: asyncio.Event) -> None:
        """One job, cut short when the lease is lost (its writes would be refused anyway)."""
        run = asyncio.ensure_future(self._run_job(live, job))
        watch = asyncio.ensure_future(lost.wait())
        try:
            await asyncio.wait({run, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if not run.done():
            run.cancel()
            await asyncio.wait({run}, timeout=5)
            log.warning("turn stopped: the session's lease was lost to another gateway", extra={"session": live.key})
            raise FencedOut(live.key, -1)
        run.result()

    async def _may_run(self, ev: QueuedEvent) -> bool:
        if not self.hub.can_deliver(ev.channel):
            return False  # a gateway running that channel answers it (`gateway chat` runs the terminal only)
        if ev.channel not in LOCAL_CHANNELS or ev.instance == self.leases.instance:
            return True
        # Another gateway's web/terminal message: its request waits there, unless that
        # gateway is gone (then the reply is kept for the history, as after a restart).
        return ev.instance not in await self._alive_instances()

    async def _left_undecided(self, ev: QueuedEvent) -> bool:
        """Whether an event still only accepted was left by its gateway, so this one decides it."""
        if ev.age_s < SETTLE_S:
            return False
        if ev.age_s >= DECIDE_LIMIT_S or ev.instance is None:
            return True
        return ev.instance not in await self._alive_instances(fresh=True)

    async def _alive_instances(self, *, fresh: bool = False) -> set[str]:
        at, alive = self._alive
        if fresh or time.monotonic() - at > SWEEP_INTERVAL_S:
            alive = await self.leases.alive_instances()
            self._alive = (time.monotonic(), alive)
        return alive

    async def _job_for(self, ev: QueuedEvent) -> TurnJob | None:
        store = self.s.store
        try:
            inbound = inbound_from_dict(ev.inbound or {})
        except (KeyError, TypeError, ValueError):
            log.warning("unreadable waiting event", extra={"event": ev.event_id})
            await store.mark_event(ev.channel, ev.event_id, "failed")
            return None
        # Asked afresh (a rare path): a list cached before its gateway stalled would miss the takeover.
        if ev.instance not in (None, self.leases.instance) and ev.instance not in await self._alive_instances(
                fresh=True):
            self.s.metrics.takeovers.inc()  # its gateway died or stalled with the turn waiting
        if ev.status == "running":
            return TurnJob(inbound, resume_turn=ev.turn)
        if ev.status == "accepted":
            # The gateway that accepted it died before deciding; decide as a restart would.
            log.info("taking over an event its gateway never queued", extra={"event": ev.event_id})
            if inbound.origin is None and parse_command(inbound.text) is not None:  # a person's command
                if self._leftover is not None:
                    await self._leftover(inbound)
                await store.mark_event(ev.channel, ev.event_id, "answered")
                return None
        return TurnJob(inbound)

    async def _scope_of(self, key: str, ev: QueuedEvent | None) -> tuple[str, str]:
        row = await self.s.store.get_session(key)
        if row is not None:
            return row.scope, row.channel
        if ev is not None and ev.inbound:
            inbound = inbound_from_dict(ev.inbound)
            return self.places.keys(inbound)[1], inbound.channel
        raise RuntimeError(f"session {key} has no stored scope")

    def _forget(self, key: str) -> None:
        self.live.pop(key, None)
        self._last_turns.pop(key, None)
        self._left_at.pop(key, None)

    # -- /stop across gateways -----------------------------------------------------------------

    async def _stop_elsewhere(self, key: str, inbound: Inbound | None) -> StopOutcome:
        """The session's turn runs on another gateway: ask it through the database, and
        wait (at most STOP_WAIT_S) for it to say the turn has ended."""
        store = self.s.store
        running = [ev for ev in await store.session_events(key) if ev.status == "running" and ev.turn is not None]
        if inbound is None or not running:
            return "idle"
        turn = running[0].turn
        await store.mark_event(inbound.channel, inbound.event_id, STOP_ASKED, turn=turn)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + STOP_WAIT_S
        while loop.time() < deadline:
            await asyncio.sleep(STOP_ANSWER_POLL_S)
            status = await store.event_status(inbound.channel, inbound.event_id)
            if status == STOP_DONE:
                return "stopped"
            if status == STOP_ASKED and not any(
                    ev.status == "running" and ev.turn == turn for ev in await store.session_events(key)):
                # The turn ended before any gateway took the stop: nothing was stopped.
                if await self._withdraw_stop(inbound):
                    return "idle"
        # Never taken: withdrawn, so that it cannot stop a later turn. Taken: on its way.
        return "unreached" if await self._withdraw_stop(inbound) else "pending"

    async def _withdraw_stop(self, inbound: Inbound) -> bool:
        rows = await self.s.store.run("UPDATE events SET status='answered' WHERE channel=? AND event_id=? AND status=? "
                                      "RETURNING event_id", (inbound.channel, inbound.event_id, STOP_ASKED))
        return bool(rows)

    async def _stoppable(self, live: LiveSession, stream: ReplyStream | None) -> TurnResult:
        watch = asyncio.ensure_future(self._watch_stops(live))
        try:
            return await super()._stoppable(live, stream)
        finally:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)

    async def _watch_stops(self, live: LiveSession) -> None:
        """While this gateway runs the session's turn: a /stop another gateway took for it."""
        turn = live.ctx.current_turn
        while True:
            await asyncio.sleep(TURN_STOP_POLL_S)
            try:
                rows = await self.s.store.run(
                    "UPDATE events SET status=? WHERE session_key=? AND status=? AND turn=? "
                    "RETURNING channel, event_id, inbound", (STOP_TAKEN, live.key, STOP_ASKED, turn))
            except Exception as err:  # the database hiccuped: the turn goes on, the next look may find it
                log.warning("could not look for a /stop from another gateway",
                            extra={"session": live.key, "error": str(err)[:200]})
                continue
            if not rows:
                continue
            try:
                by = inbound_from_dict(json.loads(rows[0]["inbound"] or "{}")).identity
            except (KeyError, TypeError, ValueError):
                by = "another gateway"
            stop = self._stop_here(live.key, by)
            events = [(row["channel"], row["event_id"]) for row in rows]
            if stop is not None:
                self.s.background.spawn(self._stop_through(stop, events), name=f"stop:{live.key}")
            return

    async def _stop_through(self, stop: TurnStop, events: list[tuple[str, str]]) -> None:
        """Tell the gateways that asked: the stopped turn has ended."""
        try:
            async with asyncio.timeout(STOP_WAIT_S):
                await stop.ended.wait()
        except TimeoutError:
            return  # the asking gateway has answered "pending" by now
        for channel, event_id in events:
            await self.s.store.run("UPDATE events SET status=? WHERE channel=? AND event_id=? AND status=?",
                                   (STOP_DONE, channel, event_id, STOP_TAKEN))

    # -- sweeping and stopping ----------------------------------------------------------------

    def begin(self, leftover: LeftoverCommand) -> None:
        """Workers run from now, and every gateway sweeps for sessions nobody runs."""
        self._leftover = leftover
        super().begin(leftover)
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever(), name="sessions:sweep")

    async def _sweep_forever(self) -> None:
        await self.open.wait()
        while not self._stopping:
            try:
                async with asyncio.timeout(SWEEP_INTERVAL_S * 5):
                    keys = await self.s.store.unleased_sessions(settle_s=SETTLE_S,
                                                                decide_limit_s=DECIDE_LIMIT_S)
                for key in keys:
                    if key not in self._workers:
                        self.wake(key)
            except (TimeoutError, StoreError) as err:
                log.warning("sweep for waiting sessions failed", extra={"error": str(err)[:200]})
            except Exception:
                log.exception("sweep for waiting sessions failed")
            await asyncio.sleep(SWEEP_INTERVAL_S)

    async def stop(self, timeout: float) -> None:
        self._stopping = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.wait({self._sweeper}, timeout=STOP_POLL_S * 4)
            self._sweeper = None
        workers = set(self._workers.values())
        if workers:
            await asyncio.wait(workers, timeout=timeout)
