"""Per-session order across gateways on one PostgreSQL (SPEC §10), in one process: two
real `Gateway`s with Telegram in webhook mode against the fake Bot API, a message posted
to either one. Order, take-over of a dead gateway's turn and fencing of a stalled one
are judged by what Telegram shows and what the database holds."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from gateway.app import Gateway, StartupError
from gateway.cluster.leases import ClusterLeases
from gateway.config.load import load_config
from gateway.turns.commands import STOP_ANSWERS
from gateway.turns.streaming import STOPPED_MARK
from gateway.types import Inbound, inbound_to_dict
from tests.conftest import chat, write_config
from tests.fakes import telegram_server
from tests.fakes.openai_server import FakeModel, Reply, last_user_text
from tests.fakes.telegram_server import FakeTelegram
from tests.pg import PgServer, create_database

fake_telegram = telegram_server.fake_telegram  # the fixture

SECRET = "cluster-secret-0123456789"
ADMIN = "admin-token-0123456789abcdef"
TTL_S = 1.5


@pytest_asyncio.fixture
async def pair(tmp_path: Path, fake_model: FakeModel, fake_telegram: FakeTelegram, pg_server: PgServer,
               monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[Gateway, Gateway]]:
    """Two gateways on one database and one data dir, Telegram by webhook."""
    monkeypatch.setenv("GATEWAY_LEASE_TTL_S", str(TTL_S))
    url = await create_database(pg_server)
    path = write_config(
        tmp_path, fake_model, store={"url": url}, access={"allow_from": ["*"]}, http={"admin_token": ADMIN},
        channels={"telegram": {"enabled": True, "token": fake_telegram.token, "base_url": fake_telegram.base_url,
                               "base_file_url": fake_telegram.base_file_url, "mode": "webhook",
                               "webhook_url": "https://bot.example/telegram/webhook",
                               "webhook_secret": SECRET, "streaming": "off"}},
    )
    gateways = [Gateway(load_config(path), config_path=path) for _ in range(2)]
    for gw in gateways:
        await gw.start()
    yield gateways[0], gateways[1]
    for gw in gateways:
        await gw.stop(timeout=5)


async def post_update(gw: Gateway, update_id: int, text: str, chat: int = 7) -> int:
    assert gw.http is not None
    update = {"update_id": update_id, "message": {
        "message_id": update_id, "date": 1_700_000_000, "text": text,
        "chat": {"id": chat, "type": "private"}, "from": {"id": chat, "is_bot": False, "first_name": "P"}}}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"http://127.0.0.1:{gw.http.port}/telegram/webhook", data=json.dumps(update),
                             headers={"X-Telegram-Bot-Api-Secret-Token": SECRET,
                                      "Content-Type": "application/json"}) as resp:
            return resp.status


async def session_let_go(gw: Gateway, timeout: float = 5) -> None:
    """Wait until no gateway holds a session lease (the next message may go anywhere)."""
    assert gw.services is not None
    store: Any = gw.services.store
    async with asyncio.timeout(timeout):
        while True:
            if not await store.lease_holders("session:"):
                return
            await asyncio.sleep(0.02)


async def admin_call(gw: Gateway, path: str) -> tuple[int, Any]:
    assert gw.http is not None
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{gw.http.port}{path}",
                            headers={"Authorization": f"Bearer {ADMIN}"}) as resp:
            return resp.status, await resp.json()


def history_of(request: dict[str, Any]) -> list[str]:
    return [str(m.get("content")) for m in request["messages"] if m.get("role") == "user"]


async def test_one_sessions_turns_run_in_arrival_order_whichever_gateway_took_them(
        pair: tuple[Gateway, Gateway], fake_model: FakeModel, fake_telegram: FakeTelegram) -> None:
    a, b = pair

    def slow_echo(body: dict[str, Any]) -> Any:
        return Reply(text=f"echo {last_user_text(body)}", delay=0.15)

    fake_model.respond_with(slow_echo)
    # As many as a session queues (limits.session_queue_size, 5): on a slow machine none
    # may have started when the last arrives, and a sixth would be told to wait.
    texts = [f"m{i}" for i in range(5)]
    for i, text in enumerate(texts):
        assert await post_update(a if i % 2 == 0 else b, 100 + i, text) == 200
    sent = await fake_telegram.wait_sent(5, timeout=30)
    assert [s["text"] for s in sent] == [f"echo {t}" for t in texts]
    # Each turn saw every earlier one, in order: one conversation, not two interleaved.
    requests = fake_model.requests
    assert [history_of(r)[-1] for r in requests] == texts
    for i, r in enumerate(requests):
        assert history_of(r) == texts[: i + 1]
    assert a.services is not None
    await session_let_go(a)  # the last turn's event is closed just after its reply is sent
    assert await a.services.store.count_messages("telegram:dm:7") == 10
    assert await a.services.store.pending_events() == []


def stalled_first_call(late: str, answer: str) -> tuple[Any, asyncio.Event]:
    """A responder whose first call (the stalled gateway's) answers `late` only once the
    returned event is set, and every later one `answer` at once: the stall lasts until the
    test has seen the takeover, however slow the machine."""
    wake = asyncio.Event()
    calls = 0

    async def respond(_body: dict[str, Any]) -> Reply:
        nonlocal calls
        calls += 1
        if calls > 1:
            return Reply(text=answer)
        await asyncio.wait_for(wake.wait(), 120)
        return Reply(text=late)

    return respond, wake


async def test_a_stalled_gateways_turn_is_taken_over_and_its_late_reply_is_refused(
        pair: tuple[Gateway, Gateway], fake_model: FakeModel, fake_telegram: FakeTelegram) -> None:
    a, b = pair
    assert a.services is not None and b.services is not None
    leases_a = a.services.leases
    assert isinstance(leases_a, ClusterLeases)
    # A takes the turn, then freezes: its model call hangs and it stops renewing its leases
    # (as a process paused by the OS or a long GC would).
    respond, wake = stalled_first_call("late reply from the stalled gateway", "reply from the gateway that took over")
    fake_model.respond_with(respond)
    try:
        assert await post_update(a, 300, "are you there?") == 200
        await fake_model.wait_requests(1, timeout=10)
        assert leases_a._renewer is not None
        leases_a._renewer.cancel()
        # B's sweep finds the session without a live lease, takes it and answers once.
        sent = await fake_telegram.wait_sent(1, timeout=60)
        assert sent[0]["text"] == "reply from the gateway that took over"
        await session_let_go(b, timeout=30)  # B's turn has ended and its reply is stored
    finally:
        wake.set()
    # A wakes up with its model answer: the database refuses what it writes under the old
    # token, so it neither stores nor sends it.
    await asyncio.sleep(TTL_S * 2)
    assert [s["text"] for s in fake_telegram.sent] == ["reply from the gateway that took over"]
    rows = await b.services.store.messages("telegram:dm:7")
    assert [(m.role, m.content) for m in rows] == [
        ("user", "are you there?"), ("assistant", "reply from the gateway that took over")]
    assert await b.services.store.pending_events() == []


async def test_a_message_taken_while_another_gateway_holds_the_session_is_not_left_behind(
        pair: tuple[Gateway, Gateway], fake_model: FakeModel, fake_telegram: FakeTelegram) -> None:
    a, b = pair
    fake_model.reply("first", delay=0.5)
    fake_model.reply("second")
    assert await post_update(a, 400, "one") == 200
    await fake_model.wait_requests(1, timeout=10)
    assert await post_update(b, 401, "two") == 200  # A holds the session: B leaves it to A
    sent = await fake_telegram.wait_sent(2, timeout=10)
    assert [s["text"] for s in sent] == ["first", "second"]


async def test_a_session_handed_between_gateways_keeps_its_whole_context(
        pair: tuple[Gateway, Gateway], fake_model: FakeModel, fake_telegram: FakeTelegram) -> None:
    a, b = pair
    fake_model.respond_with(lambda body: Reply(text=f"echo {last_user_text(body)}"))
    texts = [f"turn {i}" for i in range(7)]
    for i, text in enumerate(texts):
        # One message at a time, each to the other gateway: every turn is a hand-over.
        assert await post_update(b if i % 2 else a, 500 + i, text) == 200
        await fake_telegram.wait_sent(i + 1, timeout=10)
        await session_let_go(a)
    # The last turn saw all six before it, not the few turns a restart brings back.
    assert history_of(fake_model.requests[-1]) == texts
    assistant = [m["content"] for m in fake_model.requests[-1]["messages"] if m["role"] == "assistant"]
    assert assistant == [f"echo {t}" for t in texts[:-1]]


async def test_web_chat_is_answered_by_the_gateway_that_holds_the_request(
        pair: tuple[Gateway, Gateway], fake_model: FakeModel) -> None:
    a, b = pair
    fake_model.respond_with(lambda body: Reply(text=f"echo {last_user_text(body)}", delay=0.1))
    # The same web session through both gateways at once: each request gets its own
    # answer (it waits where it was sent), and the turns still run one at a time.
    replies = await asyncio.gather(*(chat(a if i % 2 == 0 else b, "alice", f"w{i}") for i in range(4)))
    assert replies == [f"echo w{i}" for i in range(4)]
    users = [history_of(r)[-1] for r in fake_model.requests]
    assert sorted(users) == [f"w{i}" for i in range(4)]
    for i, r in enumerate(fake_model.requests):
        assert history_of(r) == users[: i + 1]  # one conversation, in the order it ran


async def test_a_gateway_whose_leases_lapsed_is_not_ready_and_counts_what_it_took_over(
        pair: tuple[Gateway, Gateway], fake_model: FakeModel, fake_telegram: FakeTelegram) -> None:
    a, b = pair
    assert a.services is not None and b.services is not None and a.http is not None
    respond, wake = stalled_first_call("stalled", "taken over")
    fake_model.respond_with(respond)
    try:
        assert await post_update(a, 600, "hello") == 200
        await fake_model.wait_requests(1, timeout=10)
        leases_a = a.services.leases
        assert isinstance(leases_a, ClusterLeases) and leases_a._renewer is not None
        leases_a._renewer.cancel()
        assert (await fake_telegram.wait_sent(1, timeout=60))[0]["text"] == "taken over"
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{a.http.port}/readyz") as resp:
                body = await resp.json()
                assert resp.status == 503 and "leases not renewed" in body["reasons"][0]
            assert b.http is not None
            async with http.get(f"http://127.0.0.1:{b.http.port}/readyz") as resp:
                assert resp.status == 200
            await session_let_go(b)
            async with http.get(f"http://127.0.0.1:{b.http.port}/metrics") as resp:
                metrics = await resp.text()
    finally:
        wake.set()
    assert "gateway_turns_taken_over_total 1.0" in metrics
    assert "gateway_leases_held 1.0" in metrics  # its own liveness; the session is let go


async def test_a_turn_that_cannot_be_closed_is_not_run_again_and_again(
        pair: tuple[Gateway, Gateway], fake_model: FakeModel, fake_telegram: FakeTelegram,
        monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = pair
    assert a.services is not None and b.services is not None

    async def disk_full(*_args: Any, **_kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    for gw in (a, b):  # the write that ends the turn fails, wherever it runs
        assert gw.services is not None
        monkeypatch.setattr(gw.services.store, "end_turn", disk_full)
    fake_model.reply("the answer")
    assert await post_update(a, 700, "question") == 200
    await fake_telegram.wait_sent(2, timeout=10)
    await asyncio.sleep(2.5)  # a sweep or two later: nothing more is sent
    texts = [s["text"] for s in fake_telegram.sent]
    assert texts[0] == "the answer" and "could not save" in texts[1] and len(texts) == 2
    assert len(fake_model.requests) == 1
    assert await a.services.store.event_status("telegram", "700") == "failed"


async def test_a_gateway_without_the_channel_leaves_its_sessions_alone(
        tmp_path: Path, fake_model: FakeModel, fake_telegram: FakeTelegram, pg_server: PgServer,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_LEASE_TTL_S", str(TTL_S))
    url = await create_database(pg_server)
    telegram = {"telegram": {"enabled": True, "token": fake_telegram.token, "base_url": fake_telegram.base_url,
                             "base_file_url": fake_telegram.base_file_url, "mode": "webhook",
                             "webhook_url": "https://bot.example/telegram/webhook", "webhook_secret": SECRET,
                             "streaming": "off"}}
    (tmp_path / "a").mkdir()
    (tmp_path / "c").mkdir()
    data = str(tmp_path / "data")
    path_a = write_config(tmp_path / "a", fake_model, store={"url": url}, data_dir=data,
                          access={"allow_from": ["*"]}, channels=telegram)
    path_c = write_config(tmp_path / "c", fake_model, store={"url": url}, data_dir=data)  # web only
    a = Gateway(load_config(path_a), config_path=path_a)
    c = Gateway(load_config(path_c), config_path=path_c)
    await a.start()
    await c.start()
    try:
        fake_model.hang(30)
        assert await post_update(a, 800, "hello") == 200
        await fake_model.wait_requests(1, timeout=10)
        await a.stop(timeout=0.2)  # the turn is cut; it waits for a gateway that runs Telegram
        await asyncio.sleep(TTL_S * 2)
        assert c.services is not None
        assert [ev.event_id for ev in await c.services.store.pending_events()] == ["800"]
        assert len(fake_model.requests) == 1 and fake_telegram.sent == []
    finally:
        await a.stop(timeout=1)
        await c.stop(timeout=1)


async def test_the_admin_page_shows_the_gateways_sharing_the_database(
        pair: tuple[Gateway, Gateway], fake_model: FakeModel) -> None:
    a, b = pair
    assert a.services is not None and b.services is not None
    status, body = await admin_call(a, "/admin/api/status")
    assert status == 200
    cluster = body["cluster"]
    assert cluster["instance"] == a.services.leases.instance
    assert cluster["gateways"] == sorted([a.services.leases.instance, b.services.leases.instance])
    assert {c["name"]: c["ok"] for c in body["checks"]}["cluster"] is True


async def test_a_command_waiting_behind_another_gateways_web_message_still_runs(
        pair: tuple[Gateway, Gateway]) -> None:
    a, _ = pair
    assert a.services is not None
    store: Any = a.services.store
    # Another live gateway accepted a web message of this session and has not run it yet.
    assert await store.lease_acquire("instance:ghost", "ghost", 60) is not None
    ghost = Inbound(channel="web", chat_id="alice", user_id="alice", text="from the other page", event_id="g-1")
    await store.record_event("web", "g-1", session_key="web:alice", inbound=inbound_to_dict(ghost))
    await store.run("UPDATE events SET status='queued', instance='ghost' WHERE event_id='g-1'")
    compact = asyncio.ensure_future(chat(a, "alice", "/compact"))
    await asyncio.sleep(1.5)
    assert not compact.done()  # the session's earlier message comes first
    await store.mark_event("web", "g-1", "answered")  # the other gateway answered it
    reply = await asyncio.wait_for(compact, 5)
    assert reply


async def test_an_event_a_live_gateway_is_slow_to_decide_is_left_to_it(
        pair: tuple[Gateway, Gateway], fake_model: FakeModel, fake_telegram: FakeTelegram) -> None:
    a, _ = pair
    assert a.services is not None
    store: Any = a.services.store
    fake_model.respond_with(lambda body: Reply(text=f"echo {last_user_text(body)}"))
    # A live gateway accepted a message 30 s ago and is still deciding what it is (an inline
    # command whose reply waits out a rate limit): nobody else may answer it meanwhile.
    assert await store.lease_acquire("instance:ghost", "ghost", 60) is not None

    async def accepted_long_ago(update_id: int, text: str) -> None:
        inbound = Inbound(channel="telegram", chat_id="7", user_id="7", text=text, event_id=str(update_id),
                          message_id=str(update_id), extra={"chat_type": "private"})
        await store.record_event("telegram", str(update_id), session_key="telegram:dm:7",
                                 inbound=inbound_to_dict(inbound))
        await store.run("UPDATE events SET instance='ghost', created_at=created_at-30 WHERE event_id=?",
                        (str(update_id),))

    await accepted_long_ago(500, "slow one")
    assert await post_update(a, 501, "behind it") == 200
    await asyncio.sleep(2)
    assert fake_telegram.sent == [] and fake_model.requests == []
    [ev, _] = await store.session_events("telegram:dm:7")
    assert (ev.event_id, ev.status) == ("500", "accepted")
    await store.mark_event("telegram", "500", "queued")  # the other gateway decided: a turn
    sent = await fake_telegram.wait_sent(2, timeout=10)
    assert [s["text"] for s in sent] == ["echo slow one", "echo behind it"]
    # Once that gateway is gone, what it left undecided is taken over without the long wait.
    await session_let_go(a)
    await accepted_long_ago(502, "left by the dead")
    await store.lease_release_all("ghost")
    sent = await fake_telegram.wait_sent(3, timeout=10)
    assert sent[2]["text"] == "echo left by the dead"
    await session_let_go(a)
    assert await store.pending_events() == []


@pytest.mark.parametrize("ttl", ["soon", "0.1", "nan"])
async def test_an_unusable_lease_ttl_stops_the_start_with_its_name(
        tmp_path: Path, fake_model: FakeModel, pg_server: PgServer, monkeypatch: pytest.MonkeyPatch,
        ttl: str) -> None:
    monkeypatch.setenv("GATEWAY_LEASE_TTL_S", ttl)
    path = write_config(tmp_path, fake_model, store={"url": await create_database(pg_server)})
    gw = Gateway(load_config(path), config_path=path)
    with pytest.raises(StartupError, match="GATEWAY_LEASE_TTL_S must be"):
        await gw.start()


async def test_a_stop_sent_to_another_gateway_stops_the_turn(pair: tuple[Gateway, Gateway],
                                                             fake_model: FakeModel) -> None:
    a, b = pair
    assert a.services is not None
    fake_model.hang(600)
    waiting = asyncio.ensure_future(chat(a, "ann", "a long one"))  # a web message runs where it came in
    await fake_model.wait_requests(1)
    live = a.sessions.live.get("web:ann")
    assert live is not None and live.running is not None
    assert await chat(b, "ann", "/stop") == STOP_ANSWERS["stopped"]
    assert await asyncio.wait_for(waiting, 20) == STOPPED_MARK
    assert await fake_model.wait_disconnects(1) == [0]
    rows = await a.services.store.messages("web:ann")
    assert [(m.role, m.content) for m in rows] == [("user", "a long one"), ("assistant", STOPPED_MARK)]
    assert await chat(b, "ann", "/stop") == STOP_ANSWERS["idle"]  # nothing runs now, anywhere
    assert await chat(a, "ann", "and now?") == "echo: and now?"
    # On the gateway that runs it, under the session's lease, too.
    fake_model.hang(600)
    waiting = asyncio.ensure_future(chat(a, "ann", "another long one"))
    await fake_model.wait_requests(3)
    assert await chat(a, "ann", "/stop") == STOP_ANSWERS["stopped"]
    assert await asyncio.wait_for(waiting, 20) == STOPPED_MARK
    assert len(fake_model.requests) == 3


async def test_a_turn_on_postgresql_costs_few_round_trips(
        tmp_path: Path, fake_model: FakeModel, fake_telegram: FakeTelegram, pg_server: PgServer,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every statement is a round trip to the database: a turn used to cost ~20 (a pool
    reset after each statement, the busy check apart from the queueing, the session's
    mark read twice per lease, the pairing table for people the config admits). Counted
    at asyncpg's connection, one turn after another in one session (no batching to help)."""
    import asyncpg.connection

    counted: list[str] = []
    connection = asyncpg.connection.Connection
    for method in ("fetch", "fetchrow", "fetchval", "execute", "executemany"):
        original = getattr(connection, method)

        def counting(original: Any = original) -> Any:
            async def call(self: Any, query: str, *args: Any, **kwargs: Any) -> Any:
                counted.append(query)
                return await original(self, query, *args, **kwargs)
            return call

        monkeypatch.setattr(connection, method, counting())
    url = await create_database(pg_server)
    path = write_config(
        tmp_path, fake_model, store={"url": url}, access={"dm_policy": "allowlist", "allow_from": ["telegram:7"]},
        channels={"telegram": {"enabled": True, "token": fake_telegram.token, "base_url": fake_telegram.base_url,
                               "base_file_url": fake_telegram.base_file_url, "mode": "webhook",
                               "webhook_url": "https://bot.example/telegram/webhook",
                               "webhook_secret": SECRET, "streaming": "off"}},
    )
    gw = Gateway(load_config(path), config_path=path)
    await gw.start()
    try:
        assert await post_update(gw, 100, "first") == 200
        await fake_telegram.wait_sent(1, timeout=30)
        await session_let_go(gw)
        turns = 6
        before = len(counted)
        for i in range(turns):
            assert await post_update(gw, 101 + i, f"m{i}") == 200
            await fake_telegram.wait_sent(2 + i, timeout=30)
            await session_let_go(gw)
        # This test's own look at the leases (session_let_go) is not the turn's.
        turn_statements = [q for q in counted[before:] if "starts_with(name" not in q]
        per_turn = len(turn_statements) / turns
    finally:
        await gw.stop(timeout=5)
    assert [s["text"] for s in fake_telegram.sent][-1] == "echo: m5"
    resets = sum(1 for q in counted if "pg_advisory_unlock_all" in q)
    assert resets == 0, "the pool reset a connection after a statement"
    assert per_turn <= 12, f"{per_turn:.1f} round trips per turn"
