"""Crontab expressions as APScheduler triggers, shared by config validation and the
scheduler, so an expression the config accepts is exactly one the scheduler can run."""

from __future__ import annotations

from datetime import datetime, timedelta, tzinfo
from zoneinfo import ZoneInfo

import tzlocal
from apscheduler.triggers.cron import CronTrigger

_DAYS = ("sun", "mon", "tue", "wed", "thu", "fri", "sat", "sun")
_ALIASES = {
    "@yearly": "0 0 1 1 *", "@annually": "0 0 1 1 *", "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0", "@daily": "0 0 * * *", "@midnight": "0 0 * * *", "@hourly": "0 * * * *",
}


def zone(name: str | None) -> tzinfo:
    """The named IANA zone, else the system's."""
    return ZoneInfo(name) if name else tzlocal.get_localzone()


def _day_number(token: str) -> int:
    name = token.strip().lower()[:3]
    number = _DAYS.index(name) if name in _DAYS else int(token)
    if not 0 <= number <= 7:
        raise ValueError(f"day of week {token!r} is out of range (0-7)")
    return number


def _day_of_week(field: str) -> str:
    """Crontab day-of-week (0 and 7 are Sunday) as APScheduler day names: APScheduler 3
    counts 0 as Monday, so numbers are never passed through."""
    if field in ("*", "?"):
        return "*"
    names: list[str] = []
    for part in field.split(","):
        span, _, step = part.partition("/")
        every = int(step) if step else 1
        if every < 1:
            raise ValueError(f"day of week step {step!r} must be 1 or more")
        if span == "*":
            lo, hi = 0, 6
        elif "-" in span:
            lo, hi = (_day_number(t) for t in span.split("-", 1))
        else:
            lo = _day_number(span)
            hi = 6 if step else lo
        names += [_DAYS[i] for i in range(lo, hi + 1, every)]
    if not names:
        raise ValueError(f"day of week {field!r} names no day")
    return ",".join(dict.fromkeys(names))


def cron_trigger(expr: str, tz: tzinfo) -> CronTrigger:
    """A CronTrigger with crontab's meaning (5 fields, or @daily and friends); APScheduler's
    own field parser judges each field. Raises ValueError."""
    fields = _ALIASES.get(expr.strip().lower(), expr).split()
    if len(fields) != 5:
        raise ValueError(f"{expr!r} is not a crontab expression (minute hour day month weekday)")
    minute, hour, day, month, weekday = fields
    return CronTrigger(minute=minute, hour=hour, day=day, month=month,
                       day_of_week=_day_of_week(weekday), timezone=tz)


def check_cron(expr: str, timezone: str | None) -> None:
    """Raise ValueError unless `expr` parses in `timezone` and fires at least once."""
    tz = zone(timezone)
    try:
        trigger = cron_trigger(expr, tz)
    except ValueError as err:
        raise ValueError(f"{expr!r} is not a valid cron expression: {err}") from None
    if trigger.get_next_fire_time(None, datetime.now(tz)) is None:
        raise ValueError(f"{expr!r} never fires (no such date)")


def last_fire_time(trigger: CronTrigger, now: datetime) -> datetime | None:
    """The most recent fire time at or before `now` (looking back up to about two years)."""
    for lookback in (timedelta(hours=2), timedelta(days=2), timedelta(days=40), timedelta(days=800)):
        fire = trigger.get_next_fire_time(None, now - lookback)
        if fire is None or fire > now:
            continue
        while True:
            following = trigger.get_next_fire_time(fire, fire + timedelta(microseconds=1))
            if following is None or following > now:
                return fire
            fire = following
    return None
