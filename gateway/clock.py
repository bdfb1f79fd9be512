"""The local date in the configured timezone, read at most once a second (it is asked for
several times per turn; zone lookup and formatting are not free at hundreds of turns/s)."""

from __future__ import annotations

import time
from datetime import datetime
from zoneinfo import ZoneInfo

_CACHE_S = 1.0
_cache: dict[str | None, tuple[float, str, str]] = {}


def local_day(timezone: str | None) -> tuple[str, str]:
    """(YYYY-MM-DD, zone abbreviation) now, in `timezone` or the machine's zone."""
    now_mono = time.monotonic()
    hit = _cache.get(timezone)
    if hit is not None and now_mono - hit[0] < _CACHE_S:
        return hit[1], hit[2]
    now = datetime.now(ZoneInfo(timezone)) if timezone else datetime.now().astimezone()
    day, zone = f"{now:%Y-%m-%d}", now.tzname() or ""
    _cache[timezone] = (now_mono, day, zone)
    return day, zone
