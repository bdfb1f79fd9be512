"""Failed token checks, per client address (SPEC §9): guessing a bearer token gets slow.

Each address (an IPv6 one by its /64, which one machine usually holds whole) has a count
of failed checks that halves every `HALF_LIFE_S`. The first `FREE_FAILURES` cost
nothing (a mistyped token); each further one is answered after a delay that doubles from
`BASE_DELAY_S` up to `MAX_DELAY_S`. A failure keeps one of the address's `HELD_MAX` places
for its whole delay, even when the client hangs up at once; while they are all taken, the
address's requests are answered 429 without their token being looked at. So an address
gets at most `HELD_MAX` guesses per delay however many connections it opens, while a
right token from an address that is not guessing is answered at once.

The table keeps at most `MAX_ADDRESSES` addresses (the least recently failed ones go
first). A warning is logged per address at most once per `LOG_EVERY_S`, with the count
since the last one, never once per attempt.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("gateway.auth")

FREE_FAILURES = 5
BASE_DELAY_S = 1.0
MAX_DELAY_S = 30.0
HALF_LIFE_S = 600.0
HELD_MAX = 4
MAX_ADDRESSES = 4096
LOG_EVERY_S = 60.0


@dataclass
class _Address:
    score: float = 0.0  # failures, decayed
    at: float = 0.0  # when `score` was last brought up to date
    held: list[float] = field(default_factory=list)  # when each held failure's delay ends
    logged_at: float = -math.inf
    unlogged: int = 0  # failures since the last log line


def client_key(address: str | None) -> str:
    """The address failures are counted under: an IPv4 address, an IPv6 /64."""
    if not address:
        return "?"
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address[:64]
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class AuthThrottle:
    """The failed token checks of one API ("web", "admin")."""

    def __init__(self, api: str, *, on_failure: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.api = api
        self._on_failure = on_failure
        self._clock = clock
        self._table: OrderedDict[str, _Address] = OrderedDict()

    def __len__(self) -> int:
        return len(self._table)

    def _current(self, key: str, now: float) -> _Address | None:
        entry = self._table.get(key)
        if entry is None:
            return None
        entry.score *= 0.5 ** ((now - entry.at) / HALF_LIFE_S)
        entry.at = now
        entry.held = [end for end in entry.held if end > now]
        return entry

    def failures(self, address: str | None) -> float:
        """The address's failed checks now (decayed)."""
        entry = self._current(client_key(address), self._clock())
        return entry.score if entry is not None else 0.0

    def next_delay(self, address: str | None) -> float:
        """What the address's next failure would wait, in seconds."""
        return self._delay(self.failures(address) + 1)

    @staticmethod
    def _delay(score: float) -> float:
        over = score - FREE_FAILURES
        if over <= 0:
            return 0.0
        return min(MAX_DELAY_S, BASE_DELAY_S * 2 ** (math.ceil(over) - 1))

    def refusal(self, address: str | None) -> float | None:
        """Seconds until the address may try again when all its places are held (answer
        429 without looking at the token), else None (check the token)."""
        now = self._clock()
        entry = self._current(client_key(address), now)
        if entry is None or len(entry.held) < HELD_MAX:
            return None
        return max(0.0, min(entry.held) - now)

    def record_failure(self, address: str | None) -> float:
        """Count a failed check; the delay its answer waits (the place stays held for it)."""
        key, now = client_key(address), self._clock()
        entry = self._current(key, now)
        if entry is None:
            entry = self._table[key] = _Address(at=now)
            while len(self._table) > MAX_ADDRESSES:
                self._table.popitem(last=False)
        self._table.move_to_end(key)
        entry.score += 1
        delay = self._delay(entry.score)
        if delay > 0:
            entry.held.append(now + delay)
        entry.unlogged += 1
        if now - entry.logged_at >= LOG_EVERY_S:
            log.warning("failed token checks", extra={"api": self.api, "client": key, "failures": entry.unlogged,
                                                      "delay_s": delay})
            entry.logged_at, entry.unlogged = now, 0
        if self._on_failure is not None:
            self._on_failure()
        return delay

    async def failed(self, address: str | None) -> float:
        """`record_failure`, then wait its delay (the caller answers 401 after it)."""
        delay = self.record_failure(address)
        if delay > 0:
            await asyncio.sleep(delay)
        return delay
