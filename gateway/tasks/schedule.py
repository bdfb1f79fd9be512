"""A task's schedule (SPEC §5.3): `at` once, `every` period or `cron` in a zone, parsed from
what the model or a person wrote, checked against `tasks.min_interval_s`; pure."""

from __future__ import annotations

import itertools
import math
import re
import secrets
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta, tzinfo
from typing import Any, Literal

from apscheduler.triggers.base import BaseTrigger
from apscheduler.triggers.date import DateTrigger
from apscheduler.triggers.interval import IntervalTrigger

from gateway.config.cron import cron_trigger, last_fire_time, zone
from gateway.types import Inbound

Kind = Literal["at", "every", "cron"]
ORIGIN = "task"  # Message.origin / Inbound.origin of what a task wrote

ID_ALPHABET = "23456789abcdefghjkmnpqrstuvwxyz"  # no look-alikes (0/o, 1/l/i)
ID_LENGTH = 4
MAX_PROMPT_CHARS = 4000
MAX_AHEAD = timedelta(days=5 * 366)  # `at` and `every` beyond this are surely mistakes
CRON_CHECKED_RUNS = 60  # the closest two of a cron's next runs must respect min_interval_s
PREVIEW_CHARS = 60
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

    def not_before(self, earliest: datetime) -> Schedule:
        """This schedule with no run before `earliest` (a cron keeps its expression: the
        scheduler starts it from its first run at or after `earliest`)."""
        if self.kind == "at":
            run = datetime.fromisoformat(self.spec)
            return self if run >= earliest else replace(self, spec=earliest.astimezone(run.tzinfo).isoformat())
        if self.kind == "every":
            return self if self._anchor >= earliest.timestamp() else replace(self, anchor=earliest.timestamp())
        return self

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


def run_of(inbound: Inbound) -> tuple[str, datetime] | None:
    """(task id, slot) of the task run `inbound` is the turn of; None for a person's message.
    The slot is read back from the run's event id (`task:<id>:<slot key>`), whole seconds."""
    if inbound.origin != ORIGIN:
        return None
    head, _, rest = inbound.event_id.partition(":")
    task_id, _, key = rest.partition(":")
    if head != "task" or not task_id or not key:
        return None
    try:
        slot = datetime.fromisoformat(key)
    except ValueError:
        return None
    return task_id, slot if slot.tzinfo is not None else slot.replace(tzinfo=UTC)

