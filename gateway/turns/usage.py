"""Per-person daily budgets (`limits.turns_per_user_per_day`, `limits.tokens_per_user_per_day`),
checked before every model call (SPEC §5.13), not only when a turn starts.

The store counts a turn and its tokens when the turn ends (`Store.end_turn`). Between two
such writes the person's day is kept here, in process: what the store said when it was
last read, the turns ended here since, the tokens of turns still running (sub-turns'
included, charged call by call as the provider reports them) and the tokens held for the
calls in flight. A check before a call is then arithmetic, never a database round trip.

"Would pass the budget": a call is not made when its request, as the context engine
counts it, plus a minimal answer (CALL_OUTPUT_RESERVE tokens, or the model's whole output
limit when smaller) is more than what is left after the calls already in flight hold
theirs. A call that is made may still overshoot by what it writes beyond that reserve
(at most `max_output_tokens` − CALL_OUTPUT_RESERVE) and by what the engine undercounted of
its prompt; calls in flight at once (the sub-turns of one step, a person's other sessions)
can each do so once. Turns: a call is not made once the person's answered turns reach the
limit (the running turn itself is counted when it ends).

Several gateways on one database (or `gateway chat` beside `run` on one SQLite file):
each keeps its own tally, and reads the store's count again when a turn of that person
is accepted (the check made before the turn, as before) and before a call when the count
it has is older than STALE_S. What another gateway's turns spend is in the store when
they end: a person running turns on two gateways at once can go over by what the other
spends before its turn ends. Admins are exempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

from gateway.access import is_admin
from gateway.clock import local_day
from gateway.config.schema import Config
from gateway.store.api import StoreBackend

CALL_OUTPUT_RESERVE = 256  # tokens of answer a call must be able to afford besides its prompt
STALE_S = 10.0  # a person's count older than this is read from the store again before a call
TALLIES_KEPT = 10_000  # people whose day is kept in process; idle ones past this are read again


def today(cfg: Config) -> str:
    return local_day(cfg.timezone)[0]


def resets_at(cfg: Config, now: datetime | None = None) -> str:
    """When the daily budgets start again, in the configured zone: "00:00 CET (in 3 h 5 min)"."""
    zone = ZoneInfo(cfg.timezone) if cfg.timezone else None
    now = now or (datetime.now(zone) if zone else datetime.now().astimezone())
    midnight = datetime.combine(now.date() + timedelta(days=1), datetime.min.time(), tzinfo=now.tzinfo)
    if zone is not None:
        midnight = midnight.replace(tzinfo=zone)  # the zone's own offset that night (DST)
    minutes = max(1, int((midnight - now).total_seconds() // 60))
    hours, minutes = divmod(minutes, 60)
    wait = f"{hours} h {minutes} min" if hours else f"{minutes} min"
    return f"00:00 {midnight.tzname() or ''}".rstrip() + f" (in {wait})"


@dataclass(slots=True)
class TurnCharge:
    """What one turn (with its sub-turns) has cost the person so far; `Usage` moves it into
    the day's count when the turn ends."""

    identity: str
    tokens: int = 0
    ending: bool = False  # its count is being written to the store
    closed: bool = False


@dataclass(slots=True)
class CallHold:
    """The tokens a model call holds while in flight, or why it may not be made."""

    identity: str
    tokens: int = 0
    refusal: str | None = None


@dataclass(slots=True)
class _Day:
    day: str
    turns: int = 0  # answered turns in the store: as last read, and those ended here since
    tokens: int = 0  # their tokens
    unstored: int = 0  # tokens of turns that ended here without their count stored (a failure)
    running: int = 0  # tokens of turns still running here
    held: int = 0  # tokens held by model calls in flight
    ending: int = 0  # turns whose count is being written now
    ends: int = 0  # turn ends begun, ever (a read overlapping one is read again)
    loaded: bool = False  # read from the store today
    read_at: float = 0.0  # when (time.monotonic)
    settled: asyncio.Event | None = None  # set while no turn end is being written

    async def wait_settled(self) -> None:
        """Until the turn ends being written now are counted here (bounded)."""
        if self.ending and self.settled is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(SETTLE_WAIT_S):
                    await self.settled.wait()

    @property
    def used(self) -> int:
        return self.tokens + self.unstored + self.running


READ_TRIES = 3  # reads of a person's count while turn ends keep overlapping them
SETTLE_WAIT_S = 5.0  # a read waits this long at most for a turn end being written


class Usage:
    """The day's counts per person; `refusal` at a turn's start, `hold` before each call."""

    def __init__(self, store: StoreBackend) -> None:
        self.store = store
        self._days: OrderedDict[str, _Day] = OrderedDict()

    # -- the in-process tally -----------------------------------------------------------------

    def _day(self, cfg: Config, identity: str) -> _Day:
        day = today(cfg)
        tally = self._days.get(identity)
        if tally is None:
            tally = self._days[identity] = _Day(day)
            self._forget_idle()
        elif tally.day != day:
            # A new day: what ended yesterday counts there; turns still running count today.
            tally.day, tally.turns, tally.tokens, tally.unstored, tally.loaded = day, 0, 0, 0, False
        self._days.move_to_end(identity)
        return tally

    def _forget_idle(self) -> None:
        for identity in list(self._days):
            if len(self._days) <= TALLIES_KEPT:
                return
            tally = self._days[identity]
            if not tally.running and not tally.held and not tally.ending:
                del self._days[identity]

    async def _read(self, cfg: Config, identity: str) -> _Day:
        """The store's count of today (every gateway's), with what runs here now. A read
        that a turn end here overlaps may or may not hold it: it is read again."""
        tally = self._day(cfg, identity)
        for _ in range(READ_TRIES):
            await tally.wait_settled()
            day, ends, clear = tally.day, tally.ends, not tally.ending
            rows = await self.store.run("SELECT turns, tokens FROM usage WHERE identity=? AND day=?",
                                        (identity, day))
            turns, tokens = (int(rows[0][0]), int(rows[0][1])) if rows else (0, 0)
            tally = self._day(cfg, identity)
            if tally.day != day:
                return tally
            if clear and tally.ends == ends:  # exactly what the store holds
                tally.turns, tally.tokens = turns, tokens
                break
        else:  # ends kept overlapping (a busy person): what this process counted stands
            tally.turns, tally.tokens = max(tally.turns, turns), max(tally.tokens, tokens)
        tally.loaded, tally.read_at = True, time.monotonic()
        return tally

    def open_turn(self, identity: str) -> TurnCharge:
        return TurnCharge(identity)

    def charge(self, cfg: Config, charge: TurnCharge, tokens: int) -> None:
        """Tokens a call of the turn (or of one of its sub-turns) used, as they are reported."""
        if tokens <= 0 or charge.closed:
            return
        charge.tokens += tokens
        self._day(cfg, charge.identity).running += tokens

    def ending(self, cfg: Config, charge: TurnCharge) -> None:
        """The turn's count goes to the store now (`Store.end_turn`); `close_turn` follows."""
        if not charge.ending and not charge.closed:
            charge.ending = True
            tally = self._day(cfg, charge.identity)
            tally.ending += 1
            tally.ends += 1
            if tally.settled is None:
                tally.settled = asyncio.Event()
            tally.settled.clear()

    def close_turn(self, cfg: Config, charge: TurnCharge, *, counted: bool) -> None:
        """The turn ended: its tokens (and, when `counted`, the turn: the store has counted
        both) move into the day's count."""
        if charge.closed:
            return
        charge.closed = True
        tally = self._day(cfg, charge.identity)
        if charge.ending:
            tally.ending = max(0, tally.ending - 1)
            if not tally.ending and tally.settled is not None:
                tally.settled.set()
        tally.running = max(0, tally.running - charge.tokens)
        if counted:
            tally.turns += 1
            tally.tokens += charge.tokens
        else:
            tally.unstored += charge.tokens

    async def hold(self, cfg: Config, identity: str, *, prompt_tokens: int, max_output_tokens: int) -> CallHold:
        """Before a model call: hold what it needs, or say why it may not be made (then
        nothing is held). `release` the hold when the call is over."""
        limits = cfg.limits
        if (limits.tokens_per_user_per_day is None and limits.turns_per_user_per_day is None) \
                or is_admin(cfg, identity):
            return CallHold(identity)
        tally = self._day(cfg, identity)
        if not tally.loaded or time.monotonic() - tally.read_at > STALE_S:
            # Rarely: what other gateways (or `gateway chat`) counted since comes in too.
            tally = await self._read(cfg, identity)
        if limits.turns_per_user_per_day is not None and tally.turns >= limits.turns_per_user_per_day:
            return CallHold(identity, refusal=(
                f"I have to stop here: you have reached today's limit of {limits.turns_per_user_per_day} "
                f"messages. It resets at {resets_at(cfg)}."))
        if limits.tokens_per_user_per_day is None:
            return CallHold(identity)
        need = max(0, prompt_tokens) + min(max_output_tokens, CALL_OUTPUT_RESERVE)
        left = limits.tokens_per_user_per_day - tally.used - tally.held
        if need > left:
            # Enough for a short exchange: a fresh context (/new) may still fit.
            hint = " A fresh conversation (/new) sends much less." if left >= 4 * CALL_OUTPUT_RESERVE else ""
            return CallHold(identity, refusal=(
                f"I have to stop here: the next step needs about {need:,} tokens and only {max(0, left):,} of "
                f"today's budget of {limits.tokens_per_user_per_day:,} tokens are left. It resets at "
                f"{resets_at(cfg)}.{hint}"))
        tally.held += need
        return CallHold(identity, tokens=need)

    def release(self, cfg: Config, hold: CallHold) -> None:
        if hold.tokens:
            tally = self._day(cfg, hold.identity)
            tally.held = max(0, tally.held - hold.tokens)
            hold.tokens = 0

    # -- at a turn's start, and for /usage --------------------------------------------------

    async def get(self, cfg: Config, identity: str) -> tuple[int, int]:
        """(turns, tokens) of today: the store's count and what runs here now."""
        tally = await self._read(cfg, identity)
        return tally.turns, tally.used

    async def refusal(self, cfg: Config, identity: str) -> str | None:
        """A polite reply when the person used up today's budget; None when within it."""
        limits = cfg.limits
        if limits.turns_per_user_per_day is None and limits.tokens_per_user_per_day is None:
            return None
        if is_admin(cfg, identity):
            return None
        turns, tokens = await self.get(cfg, identity)
        if limits.turns_per_user_per_day is not None and turns >= limits.turns_per_user_per_day:
            return (f"You have reached today's limit of {limits.turns_per_user_per_day} messages. "
                    f"It resets at {resets_at(cfg)}; see you then!")
        if limits.tokens_per_user_per_day is not None and tokens >= limits.tokens_per_user_per_day:
            return (f"You have used today's budget of {limits.tokens_per_user_per_day:,} tokens. "
                    f"It resets at {resets_at(cfg)}; see you then!")
        return None

    async def month(self, cfg: Config, identity: str) -> tuple[int, int]:
        """(turns, tokens) of this calendar month so far, in the configured zone."""
        first = today(cfg)[:8] + "01"
        rows = await self.store.run(
            "SELECT coalesce(sum(turns), 0), coalesce(sum(tokens), 0) FROM usage WHERE identity=? AND day >= ?",
            (identity, first))
        return (int(rows[0][0]), int(rows[0][1])) if rows else (0, 0)

    async def report(self, cfg: Config, identity: str) -> str:
        """/usage (SPEC §6): today and this month, and what the daily budgets leave."""
        turns, tokens = await self.get(cfg, identity)
        month_turns, month_tokens = await self.month(cfg, identity)
        lines = [f"Today: {turns} message{'s' if turns != 1 else ''}, {tokens:,} tokens.",
                 f"This month: {month_turns} message{'s' if month_turns != 1 else ''}, {month_tokens:,} tokens."]
        limits = cfg.limits
        if is_admin(cfg, identity):
            lines.append("Daily budgets do not apply to admins.")
        elif limits.turns_per_user_per_day is None and limits.tokens_per_user_per_day is None:
            lines.append("There is no daily budget here.")
        else:
            left = []
            if limits.turns_per_user_per_day is not None:
                left.append(f"{max(0, limits.turns_per_user_per_day - turns)} of {limits.turns_per_user_per_day} "
                            "messages")
            if limits.tokens_per_user_per_day is not None:
                left.append(f"{max(0, limits.tokens_per_user_per_day - tokens):,} of "
                            f"{limits.tokens_per_user_per_day:,} tokens")
            lines.append("Left today: " + " and ".join(left) + f" (it resets at {resets_at(cfg)}).")
        return "\n".join(lines)

    async def describe(self, cfg: Config, identity: str) -> str:
        turns, tokens = await self.get(cfg, identity)
        limits = cfg.limits
        t_lim = f" of {limits.turns_per_user_per_day}" if limits.turns_per_user_per_day else ""
        k_lim = f" of {limits.tokens_per_user_per_day:,}" if limits.tokens_per_user_per_day else ""
        return f"Your usage today: {turns}{t_lim} messages, {tokens:,}{k_lim} tokens."
