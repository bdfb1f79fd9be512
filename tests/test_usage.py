"""Daily budgets checked before every model call (SPEC §5.13, gateway/turns/usage.py): the
person's day is kept in process, charged call by call, read from the store once a turn
(or when it is older than STALE_S), never once a step."""

from __future__ import annotations

import asyncio
from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo

from gateway.config.schema import Config
from gateway.turns.usage import CALL_OUTPUT_RESERVE, Usage, resets_at, today
from tests.conftest import StoreFactory


class CountingStore:
    """The real store, with its statements counted (the check must not add round trips)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.statements = 0

    async def run(self, sql: str, args: tuple[Any, ...] = ()) -> list[Any]:
        self.statements += 1
        return await self.store.run(sql, args)


def budget(tokens: int | None = 10_000, turns: int | None = None, **more: Any) -> Config:
    return Config.model_validate({"limits": {"tokens_per_user_per_day": tokens, "turns_per_user_per_day": turns},
                                  **more})


async def test_calls_in_flight_hold_their_share_and_sub_turn_tokens_count_at_once(make_store: StoreFactory) -> None:
    store = await make_store()
    await store.end_turn("web", "e0", "answered", usage=("web:ann", today(budget()), 2_000))  # earlier today
    counted = CountingStore(store)
    usage = Usage(counted)  # type: ignore[arg-type]
    cfg = budget()
    assert await usage.refusal(cfg, "web:ann") is None  # the turn's start: one read
    reads = counted.statements
    charge = usage.open_turn("web:ann")
    # Three sub-turns call at once: each holds its prompt and a minimal answer.
    holds = [await usage.hold(cfg, "web:ann", prompt_tokens=2_000, max_output_tokens=4096) for _ in range(3)]
    assert [h.refusal for h in holds] == [None, None, None]
    assert all(h.tokens == 2_000 + CALL_OUTPUT_RESERVE for h in holds)
    fourth = await usage.hold(cfg, "web:ann", prompt_tokens=2_000, max_output_tokens=4096)
    assert fourth.refusal is not None and fourth.tokens == 0  # 8,000 - 3 × 2,256 left: not enough
    assert "only 1,232 of today's budget of 10,000 tokens are left" in fourth.refusal
    for hold in holds:
        usage.release(cfg, hold)
        usage.charge(cfg, charge, 2_100)  # what the provider reported for each
    # Charged as they happened: the next check sees 2,000 + 6,300 used, no store read needed.
    assert (await usage.hold(cfg, "web:ann", prompt_tokens=1_500, max_output_tokens=4096)).refusal is not None
    small = await usage.hold(cfg, "web:ann", prompt_tokens=1_000, max_output_tokens=200)
    assert small.refusal is None and small.tokens == 1_200
    usage.release(cfg, small)
    assert counted.statements == reads  # checks are arithmetic, never a round trip

    usage.ending(cfg, charge)
    await store.end_turn("web", "e1", "answered", usage=("web:ann", today(cfg), charge.tokens))
    usage.close_turn(cfg, charge, counted=True)
    assert await usage.get(cfg, "web:ann") == (2, 8_300)  # the store and the tally agree, nothing twice
    rows = await store.run("SELECT turns, tokens FROM usage WHERE identity='web:ann'")
    assert [tuple(r) for r in rows] == [(2, 8_300)]


async def test_a_read_that_a_turn_end_overlaps_counts_it_once(make_store: StoreFactory) -> None:
    store = await make_store()
    usage = Usage(store)
    cfg = budget()
    charge = usage.open_turn("web:bo")
    usage.charge(cfg, charge, 700)
    usage.ending(cfg, charge)
    written = asyncio.ensure_future(store.end_turn("web", "e1", "answered", usage=("web:bo", today(cfg), 700)))
    read = asyncio.ensure_future(usage.get(cfg, "web:bo"))  # while the end is being written
    await written
    assert not read.done()  # it waits for the end to be counted here
    usage.close_turn(cfg, charge, counted=True)
    assert await asyncio.wait_for(read, 10) == (1, 700)
    assert await usage.get(cfg, "web:bo") == (1, 700)


async def test_the_turn_limit_stops_calls_and_admins_are_exempt(make_store: StoreFactory) -> None:
    store = await make_store()
    cfg = budget(tokens=None, turns=2, admins=["web:boss"], timezone="Asia/Tokyo")
    usage = Usage(store)
    for event in ("e1", "e2"):
        await store.end_turn("web", event, "answered", usage=("web:cy", today(cfg), 10))
    hold = await usage.hold(cfg, "web:cy", prompt_tokens=10, max_output_tokens=100)
    assert hold.refusal is not None and "today's limit of 2 messages" in hold.refusal
    assert "resets at 00:00 JST (in " in hold.refusal  # in the configured zone
    assert (await usage.hold(cfg, "web:boss", prompt_tokens=10**9, max_output_tokens=100)).refusal is None


def test_the_reset_is_the_next_local_midnight() -> None:
    berlin = ZoneInfo("Europe/Berlin")
    cfg = budget(timezone="Europe/Berlin")
    assert resets_at(cfg, datetime(2024, 3, 30, 22, 30, tzinfo=berlin)) == "00:00 CET (in 1 h 30 min)"
    assert resets_at(cfg, datetime(2024, 10, 26, 23, 10, tzinfo=berlin)) == "00:00 CEST (in 50 min)"
    assert resets_at(cfg, datetime(2024, 10, 27, 12, 0, tzinfo=berlin)) == "00:00 CET (in 12 h 0 min)"
