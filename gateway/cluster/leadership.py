"""One receiver at a time (SPEC §10): the channels that poll a platform (Telegram polling,
Slack Socket Mode) receive on the one gateway holding their `leader:<channel>` lease."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from gateway.cluster.leases import LEASE_TTL_S, RENEW_TIMEOUT_S, Leases
from gateway.store.errors import StoreError

log = logging.getLogger("gateway.cluster")

GIVE_UP_TTLS = 5  # a leader not receiving for this many lease TTLs hands the lead on


class Leadership:
    """Run `lead` on exactly one gateway of the cluster at a time (Telegram polling, Slack
    Socket Mode): try for the lease every third of its time to live, start `lead` when
    it is granted, stop it when the lease is lost, and let go on `stop()`.

    A leader that is alive but cannot receive (`healthy` false for `give_up_s`: its host
    cannot reach Telegram or Slack) hands the lead on and rests as long before asking
    again, so another gateway gets to try; a lone gateway has nobody to hand it to."""

    def __init__(self, leases: Leases, role: str, *, start: Callable[[], Awaitable[None]],
                 stop: Callable[[], Awaitable[None]], retry_s: float | None = None,
                 healthy: Callable[[], bool] | None = None, give_up_s: float | None = None) -> None:
        self.leases = leases
        self.name = f"leader:{role}"
        self._start = start
        self._stop = stop
        ttl = getattr(leases, "ttl_s", LEASE_TTL_S)
        self._retry_s = retry_s if retry_s is not None else ttl / 3
        self._healthy = healthy
        self._give_up_s = give_up_s if give_up_s is not None else ttl * GIVE_UP_TTLS
        self._rest_until = 0.0
        self._task: asyncio.Task[None] | None = None
        self.leading = False
        # Why this gateway, granted the lead, could not receive; None once it leads or
        # finds another gateway leading. Every gateway failing is nobody receiving.
        self.failure: str | None = None
        self.changed = asyncio.Event()  # set on every change of `leading` (tests wait on it)

    async def begin(self) -> None:
        """Take the lead now when it is free (so a lone gateway starts its channel before
        returning), and keep trying in the background."""
        await self._try()
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"leadership:{self.name}")

    async def end(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=RENEW_TIMEOUT_S * 2)
            self._task = None
        if self.leading:
            await self._resign()
        await self.leases.release(self.name)

    async def _try(self) -> None:
        try:
            token = await self.leases.acquire(self.name)
        except (TimeoutError, StoreError) as err:
            log.warning("could not ask for the lead", extra={"lease": self.name, "error": str(err)[:200]})
            return
        if token is None:
            self.failure = None  # another gateway leads
            return
        if self.leading:
            return
        log.info("leading", extra={"lease": self.name})
        try:
            await self._start()
        except Exception as err:  # let another gateway lead; try again later
            log.exception("could not start leading", extra={"lease": self.name})
            self.failure = f"could not start: {type(err).__name__}: {err}"[:300]
            await self.leases.release(self.name)
            return
        self.failure = None
        self.leading = True
        self.changed.set()

    def describe(self) -> str:
        """This gateway's part in receiving, for /readyz and the admin page."""
        if self.leading:
            return "leads"
        if self.failure is not None:
            return f"standby: cannot receive here ({self.failure})"
        return "standby: another gateway receives"

    async def _resign(self) -> None:
        self.leading = False
        self.changed.set()
        try:
            await self._stop()
        except Exception:
            log.exception("stopping after losing the lead failed", extra={"lease": self.name})

    async def _run(self) -> None:
        while True:
            if self.leading:
                await self._lead()
            else:
                await asyncio.sleep(self._retry_s)
                if time.monotonic() >= self._rest_until:
                    await self._try()

    async def _lead(self) -> None:
        """While leading: resign when the lease is lost, or hand the lead on when this
        gateway has not been receiving for `give_up_s`."""
        lost = self.leases.lost(self.name)
        failing_since: float | None = None
        while not lost.is_set():
            try:
                await asyncio.wait_for(lost.wait(), timeout=self._retry_s)
            except TimeoutError:
                pass
            if lost.is_set() or self._healthy is None or not self.leases.shared:
                continue
            if self._receives():
                failing_since = None
                continue
            now = time.monotonic()
            failing_since = failing_since if failing_since is not None else now
            if now - failing_since >= self._give_up_s:
                log.warning("not receiving here; handing the lead to another gateway",
                            extra={"lease": self.name, "seconds": round(now - failing_since)})
                await self._resign()
                await self.leases.release(self.name)
                self.failure = f"not receiving for {now - failing_since:.0f} s; handed the lead on"
                self._rest_until = time.monotonic() + self._give_up_s
                return
        log.warning("lead lost", extra={"lease": self.name})
        await self._resign()

    def _receives(self) -> bool:
        assert self._healthy is not None
        try:
            return bool(self._healthy())
        except Exception:  # a broken check counts as not receiving, like /readyz
            log.exception("receiving check failed", extra={"lease": self.name})
            return False
