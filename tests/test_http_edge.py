"""The HTTP edge of a running gateway (SPEC §9): slow and idle connections are closed, one
client address cannot hold every connection, /api requests need the token on loopback too
and those a browser's cookie carries are refused from other sites, JSON nested too deeply
is a 400 everywhere, and /readyz is a 503 with reasons, never a 500. Raw sockets where
aiohttp's client would hide what the server does."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import resource
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

import gateway.http.server as server_module
from gateway.app import Gateway
from gateway.config.schema import HttpConfig
from gateway.http.server import HttpServer, build_app
from tests.conftest import GatewayFactory, post_chat, web_auth, web_cookie, write_config
from tests.fakes import slack_server, telegram_server
from tests.fakes.openai_server import FakeModel
from tests.fakes.slack_server import BOT_TOKEN, SIGNING_SECRET, FakeSlack, signed_request
from tests.fakes.telegram_server import FakeTelegram

fake_telegram = telegram_server.fake_telegram  # fixtures
fake_slack = slack_server.fake_slack

# Short deadlines keep these tests fast; the defaults are 10 / 30 / 15 s.
FAST = {"header_timeout_s": 0.5, "body_timeout_s": 0.5, "keepalive_timeout_s": 0.5}
WEBHOOK_SECRET = "edge-webhook-secret"


def port_of(gw: Gateway) -> int:
    assert gw.http is not None
    return gw.http.port


async def connect(gw: Gateway, source: str = "127.0.0.1") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port_of(gw), local_addr=(source, 0))


async def read_until_closed(reader: asyncio.StreamReader, within: float) -> bytes:
    """Everything the server sends until it closes; fails when it is still open after `within`."""
    data = b""
    async with asyncio.timeout(within):
        with contextlib.suppress(ConnectionResetError):
            while chunk := await reader.read(65536):
                data += chunk
    return data


def close(writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError):
        writer.close()


# ---------------------------------------------------------------------------- slow and idle connections


async def test_a_request_head_sent_byte_by_byte_is_cut_off(make_gateway: GatewayFactory) -> None:
    gw = await make_gateway(http=FAST)
    reader, writer = await connect(gw)
    head = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 200

    async def trickle() -> None:
        with contextlib.suppress(OSError):
            for byte in head:  # 10 s worth of bytes, each one well inside any idle limit
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(0.05)

    sender = asyncio.create_task(trickle())
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        assert await read_until_closed(reader, within=3) == b""
        assert loop.time() - started < 1.5  # the head deadline, not an idle timer restarted by each byte
    finally:
        sender.cancel()
        close(writer)


async def test_a_silent_connection_is_closed(make_gateway: GatewayFactory) -> None:
    gw = await make_gateway(http=FAST)
    reader, writer = await connect(gw)
    try:
        assert await read_until_closed(reader, within=3) == b""
    finally:
        close(writer)


async def test_an_idle_keep_alive_connection_is_closed(make_gateway: GatewayFactory) -> None:
    gw = await make_gateway(http=FAST)
    reader, writer = await connect(gw)
    try:
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        data = await read_until_closed(reader, within=3)
        assert data.startswith(b"HTTP/1.1 200"), data[:200]
        assert b'"ok"' in data
    finally:
        close(writer)


async def test_timely_requests_share_a_keep_alive_connection(make_gateway: GatewayFactory) -> None:
    gw = await make_gateway(http=FAST)
    reader, writer = await connect(gw)
    port = port_of(gw)
    try:
        for _ in range(3):  # each head in pieces, within its deadline; each pause within the idle one
            for piece in (b"GET /healthz HTTP/1.1\r\n", f"Host: 127.0.0.1:{port}\r\n".encode(), b"\r\n"):
                writer.write(piece)
                await asyncio.sleep(0.1)
            async with asyncio.timeout(2):
                status = await reader.readline()
                assert status.startswith(b"HTTP/1.1 200"), status
                length = 0
                while (line := await reader.readline()) != b"\r\n":
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
        body = json.dumps({"session": "kept", "text": "hi"}).encode()
        writer.write(f"POST /api/chat HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                     f"Authorization: Bearer {gw.web_token}\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        data = await read_until_closed(reader, within=5)
        assert data.startswith(b"HTTP/1.1 200") and b"echo: hi" in data, data[:300]
    finally:
        close(writer)


@pytest.mark.parametrize("path", ["/api/chat", "/telegram/webhook"])
async def test_a_body_that_never_arrives_gets_408_and_is_closed(make_gateway: GatewayFactory, path: str) -> None:
    gw = await make_gateway(http=FAST)
    reader, writer = await connect(gw)
    try:
        writer.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port_of(gw)}\r\nContent-Type: application/json\r\n"
                     "Content-Length: 500\r\n\r\n{\"session\": ".encode())
        data = await read_until_closed(reader, within=4)
        assert data.startswith(b"HTTP/1.1 408"), data[:200]
        assert b"did not arrive" in data
    finally:
        close(writer)


async def test_one_address_cannot_hold_every_connection(make_gateway: GatewayFactory) -> None:
    """100 slow connections from 127.0.0.2: 10 are held (until their deadline), the rest
    get a 503 and are closed; /healthz still answers a fresh connection meanwhile."""
    gw = await make_gateway(http=FAST | {"header_timeout_s": 2, "max_connections_per_client": 10})
    conns = []
    for _ in range(100):
        reader, writer = await connect(gw, source="127.0.0.2")
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and never the blank line
        conns.append((reader, writer))
    try:
        async def first_bytes(reader: asyncio.StreamReader) -> bytes | None:
            try:
                return await read_until_closed(reader, within=0.7)
            except TimeoutError:
                return None  # still open: held

        answers = await asyncio.gather(*(first_bytes(r) for r, _ in conns))
        held = [i for i, a in enumerate(answers) if a is None]
        refused = [a for a in answers if a is not None]
        assert len(held) == 10, answers
        assert all(a.startswith(b"HTTP/1.1 503") and b"too many connections" in a for a in refused), refused[:3]

        async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port_of(gw)}/healthz") as resp:
            assert resp.status == 200
        # The held ones end at their head deadline; then the address may connect again.
        for i in held:
            assert await read_until_closed(conns[i][0], within=3) == b""
        reader, writer = await connect(gw, source="127.0.0.2")
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        assert (await read_until_closed(reader, within=3)).startswith(b"HTTP/1.1 200")
        close(writer)
    finally:
        for _, writer in conns:
            close(writer)


async def get(gw: Gateway, path: str, source: str, port: int | None = None) -> bytes:
    """One request on a fresh connection from `source` (to `port`, else the main one);
    everything the server sent."""
    port = port or port_of(gw)
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n".encode())
        with contextlib.suppress(ConnectionResetError):
            await writer.drain()
        return await read_until_closed(reader, within=5)
    finally:
        close(writer)


async def until_open(gw: Gateway, count: int) -> None:
    assert gw.http is not None
    watch = gw.http.watch
    deadline = asyncio.get_running_loop().time() + 10
    while watch.open != count:
        assert asyncio.get_running_loop().time() < deadline, f"{watch.open} connections open, not {count}"
        await asyncio.sleep(0.02)


async def test_many_addresses_cannot_take_every_connection_nor_blind_the_probes(
    make_gateway: GatewayFactory, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Idle connections from six addresses, each well under its own cap, fill the server's
    (24 here; derived from the open-files limit by default): it holds no more, anything but
    a probe gets a 503, /healthz and /readyz are answered every time, and once the crowd
    leaves everything is served again."""
    gw = await make_gateway(http={"max_connections": 24, "header_timeout_s": 60})
    assert gw.http is not None
    watch = gw.http.watch
    crowd = []
    try:
        monkeypatch.setattr(server_module, "PROBE_GRACE_S", 60.0)
        for n in range(30):
            crowd.append(await connect(gw, source=f"127.0.0.{2 + n % 6}"))  # and never a byte
        # (The server accepts in arrival order: each request below comes after the whole crowd.)
        # A place is not taken from a connection that just came: its request may be on its way.
        refused = await get(gw, "/healthz", source="127.0.0.19")
        assert refused.startswith(b"HTTP/1.1 503") and b"too many connections" in refused, refused[:200]
        monkeypatch.setattr(server_module, "PROBE_GRACE_S", 0.2)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while not all(loop.time() - c.opened_at >= 0.2 for c in watch.probes):
            assert loop.time() < deadline
            await asyncio.sleep(0.05)
        for attempt in range(7):
            health = await get(gw, "/healthz", source=f"127.0.0.{20 + attempt}")
            assert health.startswith(b"HTTP/1.1 200") and b'"ok"' in health, health[:200]
            page = await get(gw, "/", source=f"127.0.0.{30 + attempt}")
            assert page.startswith(b"HTTP/1.1 503") and b"connection limit" in page, page[:200]
            ready = await get(gw, "/readyz", source="127.0.0.40")
            assert ready.startswith(b"HTTP/1.1 200"), ready[:200]
            assert watch.open <= 24 + 1  # a place given up is counted until its connection is gone
        # The crowd still holds every general place; what it held of the probes' it gave up.
        assert watch.probe_places == 2
        assert watch.open - len(watch.probes) == 22 and watch.open <= 24
    finally:
        for _, writer in crowd:
            close(writer)
    await until_open(gw, 0)
    page = await get(gw, "/", source="127.0.0.2")
    assert page.startswith(b"HTTP/1.1 200"), page[:200]


class Crowd:
    """Idle connections from many addresses that come back the moment the server closes
    one (issue 31's attack: 40 addresses; the probes' places past the cap went to whoever
    reconnected first, and /healthz failed 5 of 7 times)."""

    def __init__(self, port: int, sources: list[str], per_source: int) -> None:
        self.port, self.sources, self.per_source = port, sources, per_source
        self.stopping = asyncio.Event()
        self.connected = 0  # connections made, reconnections included
        self.tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        for source in self.sources:
            for _ in range(self.per_source):
                self.tasks.append(asyncio.get_running_loop().create_task(self._hold(source)))

    async def _hold(self, source: str) -> None:
        while not self.stopping.is_set():
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", self.port, local_addr=(source, 0))
            except OSError:
                await asyncio.sleep(0.01)
                continue
            self.connected += 1
            try:
                with contextlib.suppress(OSError):
                    while await reader.read(65536):  # never a byte sent; back as soon as it is closed
                        pass
            finally:
                close(writer)
            await asyncio.sleep(0.005)  # (the same loop serves the test: leave it some time)

    async def stop(self) -> None:
        self.stopping.set()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def test_the_probe_port_answers_whatever_crowd_holds_the_main_port(make_gateway: GatewayFactory) -> None:
    gw = await make_gateway(http={"max_connections": 24, "header_timeout_s": 60, "probe_port": 0})
    assert gw.http is not None and gw.http.probe_port
    probe_port = gw.http.probe_port
    crowd = Crowd(port_of(gw), [f"127.0.0.{2 + n}" for n in range(40)], per_source=1)
    crowd.start()
    try:
        deadline = asyncio.get_running_loop().time() + 20
        while gw.http.watch.open < 24:  # every place held, the probes' too
            assert asyncio.get_running_loop().time() < deadline, gw.http.watch.open
            await asyncio.sleep(0.02)
        for attempt in range(7):
            health = await get(gw, "/healthz", source=f"127.0.1.{attempt + 1}", port=probe_port)
            assert health.startswith(b"HTTP/1.1 200") and b'"ok"' in health, health[:200]
            ready = await get(gw, "/readyz", source=f"127.0.1.{attempt + 1}", port=probe_port)
            assert ready.startswith(b"HTTP/1.1 200") and b'"ready": true' in ready, ready[:300]
        # The probes' port serves nothing else.
        assert (await get(gw, "/", source="127.0.1.9", port=probe_port)).startswith(b"HTTP/1.1 404")
        assert (await get(gw, "/metrics", source="127.0.1.9", port=probe_port)).startswith(b"HTTP/1.1 404")
    finally:
        await crowd.stop()


async def test_a_crowd_on_the_probe_port_itself_makes_way_for_the_probes(make_gateway: GatewayFactory,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_module, "PROBE_CONNECTIONS_MAX", 64)
    gw = await make_gateway(http={"probe_port": 0})
    assert gw.http is not None and gw.http.probe_port
    watch = gw.http.probe_watch
    crowd = Crowd(gw.http.probe_port, [f"127.0.0.{2 + n}" for n in range(40)], per_source=8)  # 320 > 64
    crowd.start()
    try:
        deadline = asyncio.get_running_loop().time() + 20
        while crowd.connected < 320:  # each address at its 8, and then some reconnected after making way
            assert asyncio.get_running_loop().time() < deadline, crowd.connected
            await asyncio.sleep(0.02)
        for attempt in range(7):
            health = await get(gw, "/healthz", source=f"127.0.1.{attempt + 1}", port=gw.http.probe_port)
            assert health.startswith(b"HTTP/1.1 200") and b'"ok"' in health, health[:200]
            assert watch.open <= 64
        assert max(watch.per_client.values()) <= server_module.PROBE_PER_CLIENT
    finally:
        await crowd.stop()


def test_the_probe_port_is_not_the_main_one() -> None:
    with pytest.raises(ValueError, match="probe_port must differ"):
        HttpConfig(port=8080, probe_port=8080)
    assert HttpConfig(port=0, probe_port=0).probe_port == 0 and HttpConfig().probe_port is None


async def test_run_raises_the_open_files_limit_and_derives_the_cap_from_it(fake_model: FakeModel,
                                                                          tmp_path: Path) -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 512:
        pytest.skip("the hard open-files limit leaves nothing to raise")
    path = write_config(tmp_path, fake_model)

    def low_soft_limit() -> None:  # what most systems give a process: 1,024 or less
        resource.setrlimit(resource.RLIMIT_NOFILE, (512, hard))

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "run", "--config", str(path), cwd=tmp_path,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, preexec_fn=low_soft_limit,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert proc.stdout is not None and proc.stderr is not None
        async with asyncio.timeout(60):
            while b"gateway running" not in (line := await proc.stdout.readline()):
                assert line, (await proc.stderr.read()).decode()[-2000:]
        limits = Path(f"/proc/{proc.pid}/limits").read_text()
        row = next(r for r in limits.splitlines() if r.startswith("Max open files")).split()
        assert row[3] == row[4] != "512", row  # soft raised to the hard limit
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    listening = next(line for line in err.decode().splitlines() if "http server listening" in line)
    cap = int(re.search(r"max_connections=(\d+)", listening).group(1))  # type: ignore[union-attr]
    raised = int(row[3]) if row[3] != "unlimited" else 1 << 20
    assert 512 < cap <= raised - 320, (cap, raised)


# ---------------------------------------------------------------------------- cross-site requests


async def post_api(gw: Gateway, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as http, http.post(
        f"http://127.0.0.1:{port_of(gw)}/api/chat", data=body, headers=headers
    ) as resp:
        return resp.status, await resp.json(content_type=None)


async def test_a_cross_site_text_post_cannot_change_config(make_gateway: GatewayFactory,
                                                          fake_model: FakeModel) -> None:
    """The attack: a page on evil.example POSTs text/plain (no CORS preflight) to the local
    gateway, by DNS rebinding with its own name in Host, as the admin's web session, in a
    browser signed in to the page (its cookie goes along)."""
    gw = await make_gateway(admins=["web:root"])
    body = json.dumps({"session": "root", "text": "/config agent_max_steps 3"}).encode()
    status, answer = await post_api(gw, body, web_cookie(gw) | {
        "Content-Type": "text/plain", "Origin": "http://evil.example", "Host": f"evil.example:{port_of(gw)}"})
    assert status == 403, answer
    assert gw.cfg.agent_max_steps == 15
    assert fake_model.requests == []


async def test_on_loopback_without_the_token_nothing_is_read_or_said(make_gateway: GatewayFactory,
                                                                     fake_model: FakeModel, tmp_path: Path) -> None:
    """The attack (issue 31): a sandboxed command with the network on shares the host's
    loopback and sends what curl sends, no Origin, its own Host, JSON. It must learn no
    session's history, speak in none (not as the admin's: `/config` from there set
    approvals.tools.exec to allow), nor follow one; with the token the same requests work."""
    gw = await make_gateway(admins=["web:root"], approvals={"tools": {"exec": "ask"}})
    config_before = (tmp_path / "config.json").read_text()
    fake_model.reply("the root's secret plan")
    assert (await post_chat(gw, {"session": "root", "text": "remember my plan"}))[0] == 200
    base = f"http://127.0.0.1:{port_of(gw)}"
    curl = {"User-Agent": "curl/8.5.0", "Accept": "*/*"}
    async with aiohttp.ClientSession(headers=curl) as http:
        for path in ("/api/history?session=root", "/api/events?session=root"):
            async with http.get(base + path) as resp:
                assert resp.status == 401, path
                assert "secret plan" not in await resp.text()
        for payload in ({"session": "root", "text": "/config approvals.tools.exec allow"},
                        {"session": "root", "text": "/config agent_max_steps 3"}):
            async with http.post(base + "/api/chat", json=payload) as resp:
                assert resp.status == 401 and "token" in (await resp.json())["error"]
        async with http.post(base + "/api/approvals/abcdef", json={"session": "root", "decision": "allow"}) as resp:
            assert resp.status == 401
        # A guessed cookie or bearer token gets no further.
        async with http.get(base + "/api/history?session=root",
                            headers={"Cookie": web_cookie(gw)["Cookie"].split("=")[0] + "=guess"}) as resp:
            assert resp.status == 401
        async with http.get(base + "/api/history?session=root", headers={"Authorization": "Bearer guess"}) as resp:
            assert resp.status == 401
    assert (tmp_path / "config.json").read_text() == config_before
    assert gw.cfg.approvals.tools == {"exec": "ask"} and gw.cfg.agent_max_steps == 15
    assert len(fake_model.requests) == 1
    async with aiohttp.ClientSession(headers=curl | web_auth(gw)) as http:
        async with http.get(base + "/api/history?session=root") as resp:
            assert resp.status == 200 and "secret plan" in await resp.text()


async def test_the_link_signs_a_browser_in_with_a_strict_cookie(make_gateway: GatewayFactory) -> None:
    gw = await make_gateway()
    assert gw.web_token is not None and gw.web_link() == f"http://127.0.0.1:{port_of(gw)}/?token={gw.web_token}"
    base = f"http://127.0.0.1:{port_of(gw)}"
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
        async with http.get(base + "/api/history?session=me") as resp:
            assert resp.status == 401 and "web-link" in (await resp.json())["error"]
        async with http.get(base + "/", params={"token": gw.web_token, "session": "me"},
                            allow_redirects=False) as resp:
            assert resp.status == 303 and resp.headers["Location"] == "./?session=me"  # the token left behind
            assert resp.headers["Cache-Control"] == "no-store"
            cookie = resp.cookies[web_cookie(gw)["Cookie"].split("=")[0]]
        assert cookie["httponly"] and cookie["samesite"] == "Strict" and cookie["path"] == "/"
        assert gw.web_token not in cookie.value  # the browser keeps a value derived from it
        async with http.get(base + "/api/history?session=me") as resp:
            assert resp.status == 200
        # A wrong link signs nobody in, and counts as a wrong token.
        async with aiohttp.ClientSession() as other, other.get(base + "/", params={"token": "old-link"},
                                                                allow_redirects=False) as resp:
            assert resp.status == 401 and "web-link" in await resp.text() and "Set-Cookie" not in resp.headers
        assert round(gw.channels["web"].throttle.failures("127.0.0.1")) == 1  # type: ignore[attr-defined]


@pytest.mark.parametrize(("host", "origin", "content_type", "expected"), [
    ("evil.example:{port}", None, "application/json", 403),  # DNS rebinding
    ("127.0.0.1:{port}", "http://evil.example", "application/json", 403),
    ("127.0.0.1:{port}", "null", "application/json", 403),
    ("127.0.0.1:{port}", "http://127.0.0.1:1", "application/json", 403),  # another local port is another site
    ("127.0.0.1:1", None, "application/json", 403),
    ("127.0.0.1:{port}", None, "text/plain", 415),
    ("127.0.0.1:{port}", None, "application/x-www-form-urlencoded", 415),
    ("127.0.0.1:{port}", "http://127.0.0.1:{port}", "application/json", 200),  # the chat page itself
    ("localhost:{port}", "http://localhost:{port}", "application/json; charset=utf-8", 200),
    ("[::1]:{port}", None, "application/json", 200),
])
async def test_the_signed_in_page_s_requests_must_come_from_this_server(
    make_gateway: GatewayFactory, fake_model: FakeModel, host: str, origin: str | None, content_type: str,
    expected: int,
) -> None:
    """The cookie goes with whatever the browser sends here, so it is not enough."""
    gw = await make_gateway()
    port = port_of(gw)
    headers = web_cookie(gw) | {"Host": host.format(port=port), "Content-Type": content_type}
    if origin is not None:
        headers["Origin"] = origin.format(port=port)
    status, answer = await post_api(gw, json.dumps({"session": "site", "text": "hi"}).encode(), headers)
    assert status == expected, answer
    if expected == 200:
        assert answer["reply"] == "echo: hi"
    else:
        assert answer["error"] and fake_model.requests == []


async def test_with_a_token_the_token_decides_but_the_body_must_be_json(make_gateway: GatewayFactory) -> None:
    # Behind a reverse proxy Host and Origin are the proxy's business; a browser never
    # sends the bearer token cross-site.
    gw = await make_gateway(channels={"web": {"token": "edge-token"}})
    body = json.dumps({"session": "tok", "text": "hi"}).encode()
    auth = {"Authorization": "Bearer edge-token", "Host": "chat.example.org", "Origin": "https://chat.example.org"}
    status, answer = await post_api(gw, body, auth | {"Content-Type": "application/json"})
    assert status == 200 and answer["reply"] == "echo: hi"
    status, _ = await post_api(gw, body, auth | {"Content-Type": "text/plain"})
    assert status == 415


async def test_health_and_metrics_answer_any_host(make_gateway: GatewayFactory) -> None:
    gw = await make_gateway()
    async with aiohttp.ClientSession() as http:
        for path in ("/healthz", "/readyz", "/metrics"):
            async with http.get(f"http://127.0.0.1:{port_of(gw)}{path}",
                                headers={"Host": "monitor.example", "Origin": "http://evil.example"}) as resp:
                assert resp.status == 200, path


# ---------------------------------------------------------------------------- JSON nesting


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("depth", [100_000, 100])
async def test_web_api_refuses_json_nested_too_deeply(make_gateway: GatewayFactory, fake_model: FakeModel,
                                                      depth: int) -> None:
    gw = await make_gateway()
    body = '{"session": "deep", "text": "hi", "extra": ' + nested(depth) + "}"
    status, answer = await post_api(gw, body.encode(), web_auth(gw) | {"Content-Type": "application/json"})
    assert status == 400, answer
    assert "nested too deeply" in answer["error"]
    assert fake_model.requests == []


@pytest.fixture
async def webhook_gateway(make_gateway: GatewayFactory, fake_telegram: FakeTelegram,
                          fake_slack: FakeSlack) -> Gateway:
    gw = await make_gateway(access={"dm_policy": "open"}, channels={
        "telegram": {"enabled": True, "token": fake_telegram.token, "base_url": fake_telegram.base_url,
                     "base_file_url": fake_telegram.base_file_url, "mode": "webhook",
                     "webhook_url": "https://bot.example.org/telegram/webhook", "webhook_secret": WEBHOOK_SECRET},
        "slack": {"enabled": True, "mode": "http", "bot_token": BOT_TOKEN, "signing_secret": SIGNING_SECRET,
                  "base_url": fake_slack.base_url},
    })
    return gw


async def post_webhook(gw: Gateway, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, str]:
    async with aiohttp.ClientSession() as http, http.post(
        f"http://127.0.0.1:{port_of(gw)}{path}", data=body, headers=headers
    ) as resp:
        return resp.status, await resp.text()


async def test_telegram_webhook_refuses_json_nested_too_deeply(webhook_gateway: Gateway) -> None:
    headers = {"X-Telegram-Bot-Api-Secret-Token": WEBHOOK_SECRET, "Content-Type": "application/json"}
    for depth in (100_000, 100):
        body = '{"update_id": 1, "message": ' + nested(depth) + "}"
        status, text = await post_webhook(webhook_gateway, "/telegram/webhook", body.encode(), headers)
        assert status == 400 and "nested too deeply" in text, (depth, status, text[:300])


@pytest.mark.parametrize("form", [False, True], ids=["json", "form payload"])
async def test_slack_events_refuse_json_nested_too_deeply(webhook_gateway: Gateway, form: bool) -> None:
    deep = '{"type": "event_callback", "event_id": "Ev1", "event": ' + nested(100_000) + "}"
    if form:
        from urllib.parse import urlencode
        raw, headers = signed_request(SIGNING_SECRET, urlencode({"payload": deep}).encode(),
                                      "application/x-www-form-urlencoded")
    else:
        raw, headers = signed_request(SIGNING_SECRET, deep.encode(), "application/json")
    status, text = await post_webhook(webhook_gateway, "/slack/events", raw, headers)
    assert status == 400 and "nested too deeply" in text, (status, text[:300])


# ---------------------------------------------------------------------------- /readyz


async def get_ready(gw: Gateway) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port_of(gw)}/readyz") as resp:
        return resp.status, await resp.json(content_type=None)


async def test_readyz_is_503_with_a_reason_while_telegram_connects(make_gateway: GatewayFactory,
                                                                   fake_telegram: FakeTelegram) -> None:
    fake_telegram.fail_next("getUpdates", 502, "Bad Gateway")  # the first poll fails: 1 s until the next
    gw = await make_gateway(channels={"telegram": {
        "enabled": True, "token": fake_telegram.token, "base_url": fake_telegram.base_url,
        "base_file_url": fake_telegram.base_file_url, "poll_timeout_s": 1}})
    await fake_telegram.wait_call("getUpdates")
    status, body = await get_ready(gw)
    assert status == 503, body
    assert body["ready"] is False and body["checks"]["channel:telegram"] is False
    assert any("telegram" in reason for reason in body["reasons"]), body
    async with asyncio.timeout(6):  # the next poll succeeds: ready
        while (await get_ready(gw))[0] != 200:  # noqa: ASYNC110 - a probe polls
            await asyncio.sleep(0.1)


async def test_readyz_never_answers_500() -> None:
    async def broken() -> dict[str, str | None]:
        raise RuntimeError("the check itself broke")

    server = HttpServer(build_app(ready=broken, metrics=lambda: (b"", "text/plain"), channel=lambda _name: None),
                        HttpConfig(port=0))
    await server.start()
    try:
        async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{server.port}/readyz") as resp:
            body = await resp.json()
            assert resp.status == 503
        assert body["ready"] is False and "the check itself broke" in body["reasons"][0]
    finally:
        await server.stop()


async def test_a_rebinding_page_cannot_read_the_history(make_gateway: GatewayFactory, fake_model: FakeModel) -> None:
    gw = await make_gateway()
    port = port_of(gw)
    await post_api(gw, json.dumps({"session": "hist", "text": "my secret plan"}).encode(),
                   web_auth(gw) | {"Content-Type": "application/json"})
    url = f"http://127.0.0.1:{port}/api/history?session=hist"
    async with aiohttp.ClientSession(headers=web_cookie(gw)) as http:  # a browser signed in to the page
        async with http.get(url, headers={"Host": f"evil.example:{port}"}) as resp:
            assert resp.status == 403
            assert "my secret plan" not in await resp.text()
        async with http.get(url, headers={"Origin": "http://evil.example"}) as resp:
            assert resp.status == 403
        async with http.get(url) as resp:  # the page itself
            assert resp.status == 200
            assert "my secret plan" in await resp.text()
