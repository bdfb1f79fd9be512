"""Several gateways on one database (SPEC §10): leases and fencing tokens.

A lease names something only one gateway may do at a time: run a session's turns
(`session:<key>`), poll a channel (`leader:<channel>`), or be alive (`instance:<name>`).
The database grants it with a fresh fencing token and an expiry by its own clock; the
holder renews all its leases together every third of the time to live. A gateway that
dies, or stalls past the expiry, loses them within `LEASE_TTL_S`; one that stalled
learns it at its next renewal, and any message it still tries to write under the old
token is refused by the database (gateway/store/fence.py).

`ClusterLeases` is the PostgreSQL implementation; `SoloLeases` is the one process on
SQLite, which holds everything always, so code that asks for a lease reads the same on
both.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Protocol

from gateway.store.errors import StoreError

log = logging.getLogger("gateway.cluster")

LEASE_TTL_S = 6.0  # a dead gateway's sessions and polling move on within this
# Overrides LEASE_TTL_S for every gateway of a cluster (tests, operators who want a faster
# fail-over and can renew that often): seconds, 0.5 to 300. All gateways must agree.
LEASE_TTL_ENV = "GATEWAY_LEASE_TTL_S"
RENEW_TIMEOUT_S = 2.0


class LeaseStore(Protocol):
    """What the leases need from the store (gateway/store/postgres.py)."""

    instance: str

    async def lease_acquire(self, name: str, holder: str, ttl_s: float) -> int | None: ...
    async def lease_acquire_session(self, name: str, holder: str, ttl_s: float,
                                    key: str) -> tuple[int, tuple[int, int]] | None: ...
    async def lease_renew(self, holder: str, ttl_s: float) -> dict[str, int]: ...
    async def lease_release(self, name: str, token: int) -> None: ...
    async def lease_release_all(self, holder: str) -> None: ...
    async def lease_holders(self, prefix: str) -> dict[str, str]: ...


class Leases(Protocol):
    instance: str
    shared: bool  # whether other gateways compete for the same leases

    async def start(self) -> None: ...
    async def stop(self) -> None: ...
    async def acquire(self, name: str) -> int | None: ...
    async def acquire_session(self, name: str, key: str) -> tuple[int, tuple[int, int] | None] | None: ...
    async def release(self, name: str) -> None: ...
    def lost(self, name: str) -> asyncio.Event: ...
    def holds(self, name: str) -> bool: ...
    def held(self) -> int: ...
    def problem(self) -> str | None: ...
    async def alive_instances(self) -> set[str]: ...
    async def holders(self, prefix: str) -> dict[str, str]: ...


class SoloLeases:
    """One gateway alone on its database: every lease is its own, for good."""

    shared = False

    def __init__(self, instance: str = "solo") -> None:
        self.instance = instance
        self._lost: dict[str, asyncio.Event] = {}

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def acquire(self, name: str) -> int | None:
        self._lost.setdefault(name, asyncio.Event())
        return 0

    async def acquire_session(self, name: str, key: str) -> tuple[int, tuple[int, int] | None] | None:
        return await self.acquire(name) or 0, None  # the mark: nobody else writes here

    async def release(self, name: str) -> None:
        self._lost.pop(name, None)

    def lost(self, name: str) -> asyncio.Event:
        return self._lost.setdefault(name, asyncio.Event())

    def holds(self, name: str) -> bool:
        return name in self._lost

    def held(self) -> int:
        return len(self._lost)

    def problem(self) -> str | None:
        return None

    async def alive_instances(self) -> set[str]:
        return {self.instance}

    async def holders(self, prefix: str) -> dict[str, str]:
        return {name: self.instance for name in self._lost if name.startswith(prefix)}


class ClusterLeases:
    """Leases in the shared database, renewed together by one owned task."""

    shared = True

    def __init__(self, store: LeaseStore, *, ttl_s: float = LEASE_TTL_S) -> None:
        self.store = store
        self.instance = store.instance
        self.ttl_s = ttl_s
        self._held: dict[str, int] = {}  # name → token
        self._lost: dict[str, asyncio.Event] = {}
        self._renewer: asyncio.Task[None] | None = None
        self._renewed_at = 0.0  # monotonic time of the last renewal the database confirmed

    @property
    def alive_name(self) -> str:
        return f"instance:{self.instance}"

    async def start(self) -> None:
        token = await self.store.lease_acquire(self.alive_name, self.instance, self.ttl_s)
        if token is None:  # cannot happen with a fresh name; a clear error if it does
            raise RuntimeError(f"the instance name {self.instance} is taken")
        self._held[self.alive_name] = token
        self._renewed_at = time.monotonic()
        self._renewer = asyncio.get_running_loop().create_task(self._renew_forever(), name="leases:renew")

    async def stop(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            await asyncio.wait({self._renewer}, timeout=RENEW_TIMEOUT_S)
            self._renewer = None
        try:
            async with asyncio.timeout(RENEW_TIMEOUT_S):
                await self.store.lease_release_all(self.instance)
        except (TimeoutError, StoreError) as err:
            log.warning("leases not released; they expire on their own", extra={"error": str(err)[:200]})
        for name in list(self._held):
            self._drop(name)

    async def acquire(self, name: str) -> int | None:
        """A fencing token when this gateway now holds `name`; None when another does."""
        async with asyncio.timeout(RENEW_TIMEOUT_S):
            token = await self.store.lease_acquire(name, self.instance, self.ttl_s)
        if token is None:
            return None
        self._took(name, token)
        return token

    async def acquire_session(self, name: str, key: str) -> tuple[int, tuple[int, int] | None] | None:
        """`acquire` for a session's lease, with the session's mark (last message id,
        context start) as the database has it in the same statement: whether anyone wrote
        to it since this gateway last held it."""
        async with asyncio.timeout(RENEW_TIMEOUT_S):
            got = await self.store.lease_acquire_session(name, self.instance, self.ttl_s, key)
        if got is None:
            return None
        self._took(name, got[0])
        return got

    def _took(self, name: str, token: int) -> None:
        self._held[name] = token
        event = self._lost.get(name)
        if event is None or event.is_set():
            self._lost[name] = asyncio.Event()

    async def release(self, name: str) -> None:
        token = self._held.pop(name, None)
        self._lost.pop(name, None)
        if token is None:
            return
        try:
            async with asyncio.timeout(RENEW_TIMEOUT_S):
                await self.store.lease_release(name, token)
        except (TimeoutError, StoreError) as err:
            log.warning("lease not released; it expires on its own", extra={"lease": name, "error": str(err)[:200]})

    def lost(self, name: str) -> asyncio.Event:
        """Set when the lease `name` is lost (taken, expired or released)."""
        event = self._lost.get(name)
        if event is None:
            event = self._lost[name] = asyncio.Event()
            if name not in self._held:
                event.set()
        return event

    def holds(self, name: str) -> bool:
        return name in self._held

    def held(self) -> int:
        return len(self._held)

    def problem(self) -> str | None:
        """Why this gateway may no longer hold its leases (for /readyz), or None."""
        if self._renewer is None:
            return "cluster: not joined"
        late = time.monotonic() - self._renewed_at
        if late > self.ttl_s:
            return f"cluster: leases not renewed for {late:.0f} s; other gateways run this one's sessions"
        return None

    async def alive_instances(self) -> set[str]:
        holders = await self.store.lease_holders("instance:")
        return {name.removeprefix("instance:") for name in holders}

    async def holders(self, prefix: str) -> dict[str, str]:
        """Live leases of any gateway whose names start with `prefix`: name → instance."""
        return await self.store.lease_holders(prefix)

    def _drop(self, name: str) -> None:
        self._held.pop(name, None)
        event = self._lost.pop(name, None)
        if event is not None:
            event.set()

    async def _renew_forever(self) -> None:
        interval = self.ttl_s / 3
        while True:
            await asyncio.sleep(interval)
            try:
                async with asyncio.timeout(RENEW_TIMEOUT_S):
                    kept = await self.store.lease_renew(self.instance, self.ttl_s)
            except (TimeoutError, StoreError) as err:
                # Unconfirmed renewals: past the time to live another gateway may hold them.
                if time.monotonic() - self._renewed_at >= self.ttl_s - interval:
                    log.warning("leases lost: the database did not confirm a renewal in time",
                                extra={"error": str(err)[:200]})
                    for name in list(self._held):
                        self._drop(name)
                    # Stay alive to the others as soon as the database answers again.
                    await self._rejoin()
                continue
            self._renewed_at = time.monotonic()
            for name, token in list(self._held.items()):
                if kept.get(name) != token:
                    log.warning("lease lost", extra={"lease": name})
                    self._drop(name)
            if self.alive_name not in self._held:
                await self._rejoin()

    async def _rejoin(self) -> None:
        try:
            async with asyncio.timeout(RENEW_TIMEOUT_S):
                token = await self.store.lease_acquire(self.alive_name, self.instance, self.ttl_s)
        except (TimeoutError, StoreError):
            return
        if token is not None:
            self._held[self.alive_name] = token
            self._renewed_at = time.monotonic()


def lease_ttl() -> float:
    """LEASE_TTL_S, or GATEWAY_LEASE_TTL_S from the environment (tests shorten it; an
    operator may lengthen it for a database far away: renewals must fit in a third)."""
    raw = os.environ.get(LEASE_TTL_ENV, "").strip()
    if not raw:
        return LEASE_TTL_S
    try:
        ttl = float(raw)
    except ValueError:
        raise ValueError(f"{LEASE_TTL_ENV} must be a number of seconds, not {raw!r}") from None
    if not 0.5 <= ttl <= 300:
        raise ValueError(f"{LEASE_TTL_ENV} must be between 0.5 and 300 seconds, not {ttl}")
    return ttl


def open_leases(store: object) -> Leases:
    """The leases for `store`: shared ones on a database several gateways use."""
    if getattr(store, "shared", False):
        return ClusterLeases(store, ttl_s=lease_ttl())  # type: ignore[arg-type]
    return SoloLeases()
