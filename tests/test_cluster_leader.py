"""Telegram polling and Slack Socket Mode on one gateway of a cluster at a time (SPEC §10):
gateways on one PostgreSQL database elect the receiver through a lease, hand it over at
once on a clean stop, and within the lease's time to live when the receiver dies or
stalls. Real gateways against the fake Bot API / fake Slack; leases shortened through
GATEWAY_LEASE_TTL_S so a take-over takes seconds."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from gateway.app import Gateway
from gateway.cluster.leadership import GIVE_UP_TTLS, Leadership
from gateway.cluster.leases import ClusterLeases, SoloLeases
from gateway.config.load import load_config
from gateway.ops.admin_state import AdminState
from gateway.store.backends import open_store
from tests.conftest import write_config
from tests.fakes import slack_server
from tests.fakes.openai_server import FakeModel
from tests.fakes.slack_server import FakeSlack
from tests.fakes.telegram_server import FakeTelegram
from tests.pg import PgServer, create_database

fake_slack = slack_server.fake_slack  # the fixture

TTL_S = 1.5  # the leases' time to live here; a standby asks for the lead every TTL_S / 3


@pytest.fixture
def short_leases(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_LEASE_TTL_S", str(TTL_S))


@pytest.fixture
async def fake_telegram() -> AsyncIterator[FakeTelegram]:
    fake = FakeTelegram(send_per_s=None, edit_interval_s=None)
    await fake.start()
    try:
        yield fake
    finally:
        await fake.stop()


@pytest.fixture
async def db_url(pg_server: PgServer) -> str:
    return await create_database(pg_server)


Start = Callable[..., Any]


@pytest.fixture
async def start_gateway(tmp_path: Path, fake_model: FakeModel, db_url: str,
                        short_leases: None) -> AsyncIterator[Start]:
    """Gateways on one database and one data dir (a cluster in one process)."""
    running: list[Gateway] = []

    async def start(channels: dict[str, Any]) -> Gateway:
        path = write_config(tmp_path, fake_model, store={"url": db_url}, access={"allow_from": ["*"]},
                            channels=channels)
        gw = Gateway(load_config(path), config_path=path)
        await gw.start()
        running.append(gw)
        return gw

    yield start
    for gw in running:
        await gw.stop(timeout=5)


def telegram(fake: FakeTelegram) -> dict[str, Any]:
    return {"telegram": {"enabled": True, "token": fake.token, "base_url": fake.base_url,
                         "base_file_url": fake.base_file_url, "poll_timeout_s": 1, "streaming": "off"}}


def slack(fake: FakeSlack) -> dict[str, Any]:
    return {"slack": {"enabled": True, "bot_token": fake.bot_token, "app_token": fake.app_token,
                      "base_url": fake.base_url, "streaming": "off"}}


async def until(check: Callable[[], bool], within: float, what: str) -> float:
    """Seconds until `check()` holds; fails after `within`."""
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > within:
            raise AssertionError(f"not within {within} s: {what}")
        await asyncio.sleep(0.02)
    return time.monotonic() - started


def admin_state(gw: Gateway) -> AdminState:
    assert gw.admin_state is not None
    return gw.admin_state


def leads(gw: Gateway, role: str) -> bool:
    return gw.hub is not None and role in gw.hub.leaderships and gw.hub.leaderships[role].leading


def stall_renewals(gw: Gateway) -> ClusterLeases:
    """The gateway stops renewing its leases (the database hears nothing from it), as when
    its process froze or lost the database; everything else keeps running."""
    assert gw.services is not None
    leases = gw.services.leases
    assert isinstance(leases, ClusterLeases) and leases._renewer is not None
    leases._renewer.cancel()
    return leases


def resume_renewals(leases: ClusterLeases) -> None:
    leases._renewer = asyncio.get_running_loop().create_task(leases._renew_forever())


async def two_receivers(start_gateway: Start, role: str, channels: dict[str, Any]) -> tuple[Gateway, Gateway]:
    """Two gateways receiving one channel: (the one that leads, the one standing by)."""
    a = await start_gateway(channels)
    b = await start_gateway(channels)
    assert [leads(a, role), leads(b, role)].count(True) == 1
    return (a, b) if leads(a, role) else (b, a)


def texts_to(fake: FakeTelegram, chat_id: int) -> list[str]:
    return [m["text"] for m in fake.sent if m["chat_id"] == chat_id]


async def test_telegram_polls_on_one_gateway_and_a_clean_stop_hands_over_at_once(
        start_gateway: Start, fake_telegram: FakeTelegram, fake_model: FakeModel) -> None:
    leader, standby = await two_receivers(start_gateway, "telegram", telegram(fake_telegram))

    # Both are ready: standing by is not a problem; /readyz details and the metric say who receives.
    for gw in (leader, standby):
        await until(lambda gw=gw: gw.channels["telegram"].is_ready(), 5, "telegram ready")
        assert all(problem is None for problem in (await admin_state(gw).ready()).values())
    assert admin_state(leader).ready_details()["receiving"] == {"telegram": "leads"}
    assert admin_state(standby).ready_details()["receiving"] == {"telegram": "standby: another gateway receives"}
    assert leader.services is not None and standby.services is not None
    assert b'gateway_leader{role="telegram"} 1.0' in leader.services.metrics.render()
    assert b'gateway_leader{role="telegram"} 0.0' in standby.services.metrics.render()

    fake_model.reply("first answer")
    fake_telegram.push_message(chat_id=5, user_id=5, text="first")
    await fake_telegram.wait_sent(1)
    await asyncio.sleep(1.5)  # more than a long poll: a second poller would have cut one
    assert texts_to(fake_telegram, 5) == ["first answer"]
    assert fake_telegram.conflicts == []

    await leader.stop(timeout=5)
    took = await until(lambda: leads(standby, "telegram"), 1.5, "the standby leads")
    assert took <= TTL_S / 3 + 0.5, "released on stop, not left to expire"
    fake_model.reply("second answer")
    fake_telegram.push_message(chat_id=5, user_id=5, text="second")
    await fake_telegram.wait_sent(2)
    await asyncio.sleep(1.5)
    assert texts_to(fake_telegram, 5) == ["first answer", "second answer"]
    assert fake_telegram.conflicts == []


async def test_a_leader_that_cannot_reach_telegram_hands_the_lead_on(
        start_gateway: Start, fake_telegram: FakeTelegram, fake_model: FakeModel) -> None:
    # A's host reaches the database but not Telegram's getUpdates (a proxy answering 502).
    broken = FakeTelegram(token=fake_telegram.token)
    await broken.start()
    try:
        for _ in range(1000):
            broken.fail_next("getUpdates", 502, "Bad Gateway")
        started = time.monotonic()
        a = await start_gateway(telegram(broken))
        b = await start_gateway(telegram(fake_telegram))
        assert leads(a, "telegram") and not leads(b, "telegram")
        give_up = GIVE_UP_TTLS * TTL_S
        await until(lambda: leads(b, "telegram"), give_up + 10, "the other gateway leads")
        assert time.monotonic() - started >= give_up, "a leader is given its time before the lead moves"
        assert not leads(a, "telegram")
        problem = (await admin_state(a).ready())["channel:telegram"]
        assert problem is not None and "handed the lead on" in problem
        fake_model.reply("answered by the gateway that can poll")
        fake_telegram.push_message(chat_id=8, user_id=8, text="hello?")
        await fake_telegram.wait_sent(1, timeout=10)
        assert texts_to(fake_telegram, 8) == ["answered by the gateway that can poll"]
        # A rests, then sees B leading: it stands by, ready, and does not take the lead back.
        await until(lambda: a.hub is not None and a.hub.leaderships["telegram"].failure is None, give_up + 5,
                    "A sees B lead")
        assert all(problem is None for problem in (await admin_state(a).ready()).values())
        assert leads(b, "telegram") and not leads(a, "telegram")
    finally:
        await broken.stop()


async def two_pollers(start_gateway: Start, fake_telegram: FakeTelegram) -> tuple[Gateway, Gateway]:
    """Two gateways polling one bot: (the one that leads, the one standing by), once
    the leader's first getUpdates is in."""
    leader, standby = await two_receivers(start_gateway, "telegram", telegram(fake_telegram))
    await fake_telegram.wait_call("getUpdates")
    return leader, standby

async def test_a_dead_leaders_polling_moves_within_the_lease_ttl(
        start_gateway: Start, fake_telegram: FakeTelegram, fake_model: FakeModel) -> None:
    leader, standby = await two_pollers(start_gateway, fake_telegram)

    # The leader dies: it renews nothing and polls no more, and never releases the lead.
    leases = stall_renewals(leader)
    await leader.channels["telegram"].stop_receiving(lost=True)
    took = await until(lambda: leads(standby, "telegram"), TTL_S + 1.5, "the standby leads")
    assert took <= TTL_S + 1.0

    fake_model.reply("after the take-over")
    fake_telegram.push_message(chat_id=6, user_id=6, text="anyone there?")
    await fake_telegram.wait_sent(1)
    await asyncio.sleep(1.5)
    assert texts_to(fake_telegram, 6) == ["after the take-over"]
    assert fake_telegram.conflicts == []
    resume_renewals(leases)  # so its shutdown is clean


async def test_a_stalled_leader_stops_polling_when_it_learns_it_lost_the_lead(
        start_gateway: Start, fake_telegram: FakeTelegram, fake_model: FakeModel) -> None:
    leader, standby = await two_pollers(start_gateway, fake_telegram)

    # The database hears nothing from the leader, which keeps polling all the while.
    leases = stall_renewals(leader)
    await until(lambda: leads(standby, "telegram"), TTL_S + 1.5, "the standby leads")
    # Two pollers now: Telegram cuts one of them (409) at each turn, until the stall ends.
    resume_renewals(leases)
    await until(lambda: not leads(leader, "telegram"), TTL_S, "the stalled leader resigns")
    assert leader.services is not None
    assert b'gateway_leader{role="telegram"} 0.0' in leader.services.metrics.render()
    assert leader.channels["telegram"].is_ready(), "standing by is ready"

    settled = len(fake_telegram.conflicts)
    fake_model.reply("answered once")
    update_id = fake_telegram.push_message(chat_id=7, user_id=7, text="hello")
    await fake_telegram.wait_sent(1, timeout=10)
    await fake_telegram.wait_confirmed(update_id + 1, timeout=10)
    await asyncio.sleep(3.5)  # past the Bot API's 3 s hold on a 409 that was still due
    assert texts_to(fake_telegram, 7) == ["answered once"]
    # At most the 409 that was already due when the stalled poller stopped; none after.
    assert len(fake_telegram.conflicts) <= settled + 1
    late = len(fake_telegram.conflicts)
    await asyncio.sleep(1.5)
    assert len(fake_telegram.conflicts) == late


async def test_slack_socket_mode_runs_on_one_gateway_and_moves(
        start_gateway: Start, fake_slack: FakeSlack, fake_model: FakeModel) -> None:
    leader, standby = await two_receivers(start_gateway, "slack", slack(fake_slack))
    await fake_slack.wait_connected()
    assert fake_slack.open_sockets == 1 and fake_slack.sockets_opened == 1
    assert standby.channels["slack"].is_ready() and leader.channels["slack"].is_ready()
    assert leader.services is not None
    for gw in (leader, standby):  # the admin page's view: who receives Slack
        state = await admin_state(gw).cluster()
        assert state is not None and state["receivers"] == {"slack": leader.services.leases.instance}

    async def dm(ts: str, text: str, reply: str) -> None:
        fake_model.reply(reply)
        env = await fake_slack.push_event({"type": "message", "channel_type": "im", "user": "U5", "text": text,
                                           "ts": ts, "channel": "D5"})
        await fake_slack.wait_acked(env)

    await dm("100.1", "one", "answer one")
    await fake_slack.wait_for(lambda: fake_slack.visible("D5") == ["answer one"])

    await leader.stop(timeout=5)  # a clean stop hands the connection over at once
    await until(lambda: leads(standby, "slack"), 1.5, "the standby leads")
    await fake_slack.wait_connected()
    assert fake_slack.open_sockets == 1
    await dm("101.1", "two", "answer two")
    await fake_slack.wait_for(lambda: fake_slack.visible("D5") == ["answer one", "answer two"])

    # A third gateway joins and stands by; the one receiving now dies without letting go.
    c = await start_gateway(slack(fake_slack))
    assert not leads(c, "slack")
    leases = stall_renewals(standby)
    await standby.channels["slack"].stop_receiving(lost=True)
    await until(lambda: leads(c, "slack"), TTL_S + 1.5, "the new standby leads")
    await fake_slack.wait_connected()
    assert fake_slack.open_sockets == 1
    await dm("102.1", "three", "answer three")
    await fake_slack.wait_for(lambda: fake_slack.visible("D5") == ["answer one", "answer two", "answer three"])
    await asyncio.sleep(0.5)
    assert fake_slack.visible("D5") == ["answer one", "answer two", "answer three"]
    resume_renewals(leases)


# -- Leadership on the database's leases, two holders ---------------------------------------


class Role:
    """What a leader runs: counts its starts and stops; may refuse to start."""

    def __init__(self) -> None:
        self.running = False
        self.starts = 0
        self.stops = 0
        self.refuse = 0

    async def start(self) -> None:
        if self.refuse:
            self.refuse -= 1
            raise RuntimeError("cannot start here")
        self.starts += 1
        self.running = True

    async def stop(self) -> None:
        self.stops += 1
        self.running = False


@pytest.fixture
async def two_holders(db_url: str, tmp_path: Path) -> AsyncIterator[tuple[ClusterLeases, ClusterLeases]]:
    stores = [await open_store(db_url, tmp_path / name) for name in ("one", "two")]
    leases = [ClusterLeases(store, ttl_s=TTL_S) for store in stores]  # type: ignore[arg-type]
    for lease in leases:
        await lease.start()
    try:
        yield leases[0], leases[1]
    finally:
        for lease, store in zip(leases, stores, strict=True):
            await lease.stop()
            await store.close()


async def test_leadership_takes_over_after_expiry_and_the_old_leader_stops(
        two_holders: tuple[ClusterLeases, ClusterLeases]) -> None:
    one, two = two_holders
    first, second = Role(), Role()
    lead_one = Leadership(one, "poll", start=first.start, stop=first.stop)
    lead_two = Leadership(two, "poll", start=second.start, stop=second.stop)
    await lead_one.begin()
    await lead_two.begin()
    assert (lead_one.leading, lead_two.leading, first.running, second.running) == (True, False, True, False)

    one._renewer.cancel()  # type: ignore[union-attr]  # the leader stalls
    took = await until(lambda: lead_two.leading, TTL_S + 1.5, "the second leads")
    assert took >= TTL_S / 2, "not before the lease could have expired"
    assert second.running and first.running, "the stalled one has not learnt it yet"
    resume_renewals(one)
    await until(lambda: not lead_one.leading, TTL_S, "the first resigns")
    assert (first.running, first.stops, second.running) == (False, 1, True)
    await lead_one.end()
    await lead_two.end()
    # Each start has its one stop (on a loaded machine the second may have let a lease
    # lapse and led again meanwhile: that is two of each), and nothing runs after the end.
    assert second.stops == second.starts >= 1 and not second.running


async def test_leadership_end_releases_at_once(two_holders: tuple[ClusterLeases, ClusterLeases]) -> None:
    one, two = two_holders
    first, second = Role(), Role()
    lead_one = Leadership(one, "poll", start=first.start, stop=first.stop)
    lead_two = Leadership(two, "poll", start=second.start, stop=second.stop)
    await lead_one.begin()
    await lead_two.begin()
    await lead_one.end()
    assert not first.running and first.stops == 1
    took = await until(lambda: lead_two.leading, TTL_S, "the second leads")
    assert took <= TTL_S / 3 + 0.3, "taken at its next try, not after the lease's expiry"
    await lead_two.end()


async def test_a_leader_that_cannot_start_lets_the_other_lead(
        two_holders: tuple[ClusterLeases, ClusterLeases]) -> None:
    one, two = two_holders
    first, second = Role(), Role()
    first.refuse = 100
    lead_one = Leadership(one, "poll", start=first.start, stop=first.stop)
    lead_two = Leadership(two, "poll", start=second.start, stop=second.stop)
    await lead_one.begin()
    assert not lead_one.leading and not one.holds(lead_one.name)
    # Nobody receives: the one that tried says why, and the database shows no leader.
    assert lead_one.describe() == "standby: cannot receive here (could not start: RuntimeError: cannot start here)"
    assert await two.holders("leader:") == {}
    await lead_two.begin()
    assert lead_two.leading and second.running and lead_two.describe() == "leads"
    assert await one.holders("leader:") == {"leader:poll": two.instance}
    await asyncio.sleep(TTL_S)  # the first keeps trying, and never takes it from a live leader
    assert not lead_one.leading and first.starts == 0 and lead_two.leading
    assert lead_one.describe() == "standby: another gateway receives", "it has seen the other lead"
    await lead_one.end()
    await lead_two.end()


async def test_a_lone_gateway_keeps_the_lead_while_it_cannot_receive() -> None:
    # Nobody to hand it to: giving the lead up would only stop its polling for nothing.
    role = Role()
    lead = Leadership(SoloLeases(), "poll", start=role.start, stop=role.stop, retry_s=0.02,
                      healthy=lambda: False, give_up_s=0.05)
    await lead.begin()
    await asyncio.sleep(0.5)
    assert lead.leading and role.running and role.stops == 0 and lead.failure is None
    await lead.end()
