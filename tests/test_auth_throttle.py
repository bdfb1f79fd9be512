"""Guessing a bearer token (SPEC §9): the web chat's token is long enough off loopback, and
wrong tokens for the chat API and the admin API are counted per address and answered ever
more slowly (gateway/http/throttle.py), with a metric and a log line that is not one per
attempt. The throttle alone on a hand-moved clock, then a running gateway on the wire."""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

import aiohttp
import pytest

import gateway.http.throttle as throttle_module
from gateway.app import Gateway
from gateway.config.checks import startup_problems
from gateway.config.load import parse_config
from gateway.http.throttle import HALF_LIFE_S, HELD_MAX, AuthThrottle, client_key
from tests.conftest import GatewayFactory, web_auth, web_cookie

WEB_TOKEN = "web-token-0123456789"
ADMIN_TOKEN = "admin-token-0123456789"


class Ticks:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# -- the token's length ------------------------------------------------------------------------


def test_a_short_web_token_is_refused_off_loopback_only() -> None:
    def problems(host: str, token: str) -> list[str]:
        cfg = parse_config({"http": {"host": host}, "channels": {"web": {"token": token}}}, environ={})
        return startup_problems(cfg)

    (problem,) = problems("0.0.0.0", "x")
    assert problem.startswith("channels.web.token: too short (1 characters); use at least 16")
    assert problems("0.0.0.0", "a" * 15) and problems("192.168.1.5", "a" * 15)
    assert problems("0.0.0.0", "a" * 16) == []
    assert problems("127.0.0.1", "x") == []  # on loopback only this machine can guess


# -- the throttle, on a clock moved by hand ------------------------------------------------------


def test_failures_past_the_free_ones_wait_longer_up_to_the_cap_and_decay(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(throttle_module, "MAX_DELAY_S", 8.0)
    clock = Ticks()
    counted: list[str] = []
    throttle = AuthThrottle("web", on_failure=lambda: counted.append("x"), clock=clock)
    delays = []
    for _ in range(10):
        delays.append(throttle.record_failure("10.0.0.1"))
        clock.now += 1  # each answered and gone before the next
    assert delays[:5] == [0.0] * 5  # a mistyped token costs nothing
    assert delays[5:] == [1.0, 2.0, 4.0, 8.0, 8.0]  # then doubling, capped
    assert len(counted) == 10
    assert throttle.next_delay("10.0.0.2") == 0.0  # another address is not slowed
    # Failures fade: after two half-lives a quarter of them is left.
    before = throttle.failures("10.0.0.1")
    clock.now += 2 * HALF_LIFE_S
    assert throttle.failures("10.0.0.1") == pytest.approx(before / 4)
    assert throttle.next_delay("10.0.0.1") == 0.0


def test_an_address_gets_at_most_its_held_places_however_many_connections() -> None:
    clock = Ticks()
    throttle = AuthThrottle("web", clock=clock)
    for _ in range(5):
        throttle.record_failure("10.0.0.1")
    assert throttle.refusal("10.0.0.1") is None
    for _ in range(HELD_MAX):  # sent at once: each held for its delay, even if the client hangs up
        assert throttle.record_failure("10.0.0.1") > 0
    wait = throttle.refusal("10.0.0.1")
    assert wait == pytest.approx(1.0)  # the shortest held delay
    assert throttle.refusal("10.0.0.2") is None
    clock.now += 1.0
    assert throttle.refusal("10.0.0.1") is None  # a place is free again: one more check


def test_the_table_is_bounded_and_an_ipv6_network_counts_as_one(monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(throttle_module, "MAX_ADDRESSES", 50)
    clock = Ticks()
    throttle = AuthThrottle("admin", clock=clock)
    with caplog.at_level(logging.WARNING, logger="gateway.auth"):
        for n in range(1000):
            throttle.record_failure(f"10.{n // 250}.{n % 250}.1")
        assert len(throttle) == 50
        # One machine rotating through its IPv6 /64 is one address.
        for n in range(20):
            throttle.record_failure(f"2001:db8:1:2::{n:x}")
        assert client_key("2001:db8:1:2::7") == "2001:db8:1:2::/64"
        assert throttle.failures("2001:db8:1:2:ffff::1") == 20
        assert client_key("::ffff:10.0.0.9") == "10.0.0.9"
        # A log line per address and minute, not per attempt.
        lines = [r for r in caplog.records if r.getMessage() == "failed token checks"]
        assert len(lines) == 1000 + 1
        clock.now += throttle_module.LOG_EVERY_S
        throttle.record_failure("2001:db8:1:2::1")
    last = [r for r in caplog.records if r.getMessage() == "failed token checks"][-1]
    assert last.__dict__["failures"] == 20 and last.__dict__["client"] == "2001:db8:1:2::/64"  # the 19 unlogged + 1


# -- a running gateway --------------------------------------------------------------------------


def auth_failures(gw: Gateway, api: str) -> float:
    assert gw.services is not None
    found = re.search(rf'^gateway_auth_failures_total{{api="{api}"}} (\S+)$', gw.services.metrics.render().decode(),
                      re.M)
    return float(found.group(1)) if found else 0.0


async def call(gw: Gateway, path: str, token: str, source: str) -> tuple[int, dict[str, str], Any]:
    assert gw.http is not None
    connector = aiohttp.TCPConnector(local_addr=(source, 0))
    async with aiohttp.ClientSession(connector=connector) as http:
        url = f"http://127.0.0.1:{gw.http.port}{path}"
        headers = {"Authorization": f"Bearer {token}"}
        if path == "/api/chat":
            resp = await http.post(url, json={"session": "alice", "text": "hi"}, headers=headers)
        else:
            resp = await http.get(url, headers=headers)
        async with resp:
            return resp.status, dict(resp.headers), await resp.json()


async def test_wrong_tokens_get_slower_per_address_and_a_right_one_works_at_once(
    make_gateway: GatewayFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(throttle_module, "BASE_DELAY_S", 0.05)  # the real ones are 1 s … 30 s
    monkeypatch.setattr(throttle_module, "MAX_DELAY_S", 2.0)
    gw = await make_gateway(channels={"web": {"token": WEB_TOKEN}}, http={"admin_token": ADMIN_TOKEN})
    web = gw.channels["web"].throttle  # type: ignore[attr-defined]

    # One address guessing, one request at a time: each wrong token is counted and the next waits longer.
    delays = []
    for n in range(10):
        status, headers, body = await call(gw, "/api/chat" if n % 2 else "/api/history", f"guess-{n}", "127.0.0.2")
        assert status == 401 and "Authorization: Bearer" in body["error"] and headers["Cache-Control"] == "no-store"
        delays.append(web.next_delay("127.0.0.2"))
    assert delays == [0.0] * 4 + [0.05, 0.1, 0.2, 0.4, 0.8, 1.6]
    assert auth_failures(gw, "web") == 10

    # Another address with the right token is answered at once; so is the guesser, whose
    # failures were each answered before the next: a right token is never made to wait.
    status, _, body = await call(gw, "/api/chat", WEB_TOKEN, "127.0.0.3")
    assert status == 200 and body["reply"] == "echo: hi"
    assert (await call(gw, "/api/history?session=alice", WEB_TOKEN, "127.0.0.2"))[0] == 200
    assert auth_failures(gw, "web") == 10 and web.failures("127.0.0.3") == 0

    # Many wrong tokens at once from the guesser: only its held places are checked (answered
    # after their delays); the rest are refused unchecked, with when to come back. (Longer
    # delays here, so the burst surely arrives while the places are held.)
    monkeypatch.setattr(throttle_module, "BASE_DELAY_S", 0.5)
    monkeypatch.setattr(throttle_module, "MAX_DELAY_S", 4.0)
    answers = await asyncio.gather(*(call(gw, "/api/history", f"burst-{n}", "127.0.0.2") for n in range(HELD_MAX + 3)))
    statuses = sorted(status for status, _, _ in answers)
    assert statuses == [401] * HELD_MAX + [429] * 3, statuses
    assert all(int(h["Retry-After"]) >= 1 for status, h, _ in answers if status == 429)
    assert auth_failures(gw, "web") == 10 + HELD_MAX

    # The admin API counts its own, under its own label.
    for n in range(6):
        status, _, _ = await call(gw, "/admin/api/status", f"admin-guess-{n}", "127.0.0.4")
        assert status == 401
    assert auth_failures(gw, "admin") == 6 and auth_failures(gw, "web") == 10 + HELD_MAX
    assert (await call(gw, "/admin/api/status", ADMIN_TOKEN, "127.0.0.5"))[0] == 200
    # The admin API's views (sessions and their text among them) are never kept by a cache either.
    status, headers, _ = await call(gw, "/admin/api/sessions", ADMIN_TOKEN, "127.0.0.5")
    assert status == 200 and headers["Cache-Control"] == "no-store"


async def test_the_data_dir_s_token_is_guarded_the_same_by_header_cookie_and_link(
    make_gateway: GatewayFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without channels.web.token the API wants the data dir's token: guessing it by bearer
    header, by cookie or by `/?token=` link costs the same places; a request that sends no
    token at all guesses nothing and is answered at once, uncounted."""
    monkeypatch.setattr(throttle_module, "BASE_DELAY_S", 0.05)
    gw = await make_gateway()
    web = gw.channels["web"].throttle  # type: ignore[attr-defined]
    assert gw.http is not None and gw.web_token is not None
    base = f"http://127.0.0.1:{gw.http.port}"
    cookie = web_cookie(gw)["Cookie"].split("=")[0]
    connector = aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))
    async with aiohttp.ClientSession(connector=connector) as http:
        for _ in range(3):
            async with http.get(base + "/api/history?session=a") as resp:
                assert resp.status == 401
        assert web.failures("127.0.0.2") == 0 and auth_failures(gw, "web") == 0
        guesses = [({"Authorization": "Bearer guess"}, "/api/history?session=a"),
                   ({"Cookie": f"{cookie}=guess"}, "/api/history?session=a"),
                   ({}, "/?token=guess")]
        for headers, path in guesses * 2:
            async with http.get(base + path, headers=headers, allow_redirects=False) as resp:
                assert resp.status == 401, path
        assert auth_failures(gw, "web") == 6 and web.next_delay("127.0.0.2") > 0
    async with aiohttp.ClientSession(headers=web_auth(gw)) as http:  # another address is not slowed
        async with http.get(base + "/api/history?session=a") as resp:
            assert resp.status == 200
