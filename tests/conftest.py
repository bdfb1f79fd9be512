"""Shared fixtures: the fake model server and a gateway factory on top of it."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import pytest
import pytest_asyncio

from gateway.app import Gateway
from gateway.config.load import load_config
from gateway.http.web_token import cookie_name, cookie_value
from gateway.store.backends import open_store
from gateway.store.sqlite import Store
from tests.fakes.openai_server import FakeModel, fake_model  # noqa: F401  (fixture)
from tests.pg import PgServer, create_database
from tests.pg import pg_server as start_pg_server

GatewayFactory = Callable[..., Awaitable[Gateway]]


class Clock:
    """A clock tests move by hand: `clock.now = ...`."""

    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


@pytest_asyncio.fixture
async def store(tmp_path: Path) -> AsyncIterator[Store]:
    """An opened, migrated store in a temporary directory."""
    s = await Store.open(tmp_path / "gateway.db")
    yield s
    await s.close()


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def write_config(tmp_path: Path, fake: FakeModel, **overrides: Any) -> Path:
    raw: dict[str, Any] = {
        "data_dir": "data",
        "http": {"host": "127.0.0.1", "port": 0},
        "model": fake.model_settings(max_retries=2, timeout_s=10),
        "summary_timeout_s": 10,
    }
    raw = deep_merge(raw, overrides)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw, indent=2), encoding="utf-8")
    return path


@pytest_asyncio.fixture
async def make_gateway(tmp_path: Path, fake_model: FakeModel) -> AsyncIterator[GatewayFactory]:  # noqa: F811
    """Start gateways on the fake model; `await make_gateway(**config_overrides)`."""
    running: list[Gateway] = []

    async def make(**overrides: Any) -> Gateway:
        path = write_config(tmp_path, fake_model, **overrides)
        gw = Gateway(load_config(path), config_path=path)
        await gw.start()
        running.append(gw)
        return gw

    yield make
    for gw in running:
        await gw.stop(timeout=5)


def web_auth(gw: Gateway) -> dict[str, str]:
    """The header the web API asks for (SPEC §9: its token, on loopback too)."""
    assert gw.web_token is not None, "the web chat is off"
    return {"Authorization": f"Bearer {gw.web_token}"}


def web_cookie(gw: Gateway) -> dict[str, str]:
    """The header of a browser signed in to the page (by the link: test_http_edge.py)."""
    assert gw.web_token is not None, "the web chat is off"
    return {"Cookie": f"{cookie_name(gw.web_token)}={cookie_value(gw.web_token)}"}


def web_page_url(gw: Gateway) -> str:
    """The page's address with the token, as `gateway run` prints it: opening it signs the
    browser in (it is sent on to the page without the token)."""
    assert gw.http is not None and gw.web_token is not None, "the web chat is off"
    return f"http://127.0.0.1:{gw.http.port}/?token={quote(gw.web_token, safe='')}"


def web_client(gw: Gateway, **kwargs: Any) -> aiohttp.ClientSession:
    """An HTTP client that sends the web API's token with every request."""
    return aiohttp.ClientSession(**({"headers": web_auth(gw)} | kwargs))


BANNER_LINK = re.compile(r"gateway running: web chat on http://127\.0\.0\.1:(\d+)/\?token=([\w-]+)\s")


def banner_link(line: str) -> tuple[int, dict[str, str]]:
    """The port and the web API's header from the line `gateway run` starts with."""
    found = BANNER_LINK.search(line)
    assert found, line
    return int(found.group(1)), {"Authorization": f"Bearer {found.group(2)}"}


async def post_chat(gw: Gateway, payload: Any, *, token: str | None = None,
                    raw: bytes | None = None) -> tuple[int, dict[str, Any]]:
    """POST /api/chat with the gateway's token (or `token`; "" sends none)."""
    assert gw.http is not None
    url = f"http://127.0.0.1:{gw.http.port}/api/chat"
    token = gw.web_token if token is None else token
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as http:
        if raw is not None:
            headers["Content-Type"] = "application/json"
            resp = await http.post(url, data=raw, headers=headers)
        else:
            resp = await http.post(url, json=payload, headers=headers)
        async with resp:
            return resp.status, await resp.json(content_type=None)


async def chat(gw: Gateway, session: str, text: str) -> str:
    status, body = await post_chat(gw, {"session": session, "text": text})
    assert status == 200, body
    return str(body["reply"])


# -- the store on each backend (SQLite, PostgreSQL: tests/pg.py) --------------------------

StoreFactory = Callable[[], Awaitable[Any]]


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    """A throw-away PostgreSQL server for the session (skips locally, fails in CI, without one)."""
    with start_pg_server() as server:
        yield server


@pytest.fixture(params=["sqlite", "postgres"])
def store_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest_asyncio.fixture
async def store_url(store_backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> str | None:
    """`store.url` for this test's own, empty database: None (SQLite in the data dir) or a
    new database on the test PostgreSQL server."""
    if store_backend == "sqlite":
        return None
    server: PgServer = request.getfixturevalue("pg_server")
    return await create_database(server)


@pytest_asyncio.fixture
async def make_store(store_url: str | None, tmp_path: Path) -> AsyncIterator[StoreFactory]:
    """Open the test's store (again: every call opens the same database); all closed at the end."""
    opened: list[Any] = []

    async def make() -> Any:
        s = await open_store(store_url, tmp_path)
        opened.append(s)
        return s

    yield make
    for s in opened:
        with contextlib.suppress(Exception):  # a test may have closed it already
            await s.close()


# -- order: the longest tests first ---------------------------------------------------------
# The suite runs in several processes (pytest-xdist, `--dist worksteal`), which hand out tests
# in collection order: a long test collected last keeps one process busy after the others
# are done. These take several seconds each (`pytest --durations`); they start first.
LONG_FIRST = (
    "tests/test_cluster_e2e.py",
    "tests/test_reliability_crash.py",
    "tests/test_cluster_leader.py",
    "tests/test_live_config.py",
    "tests/test_model.py::test_a_stream_held_open_after_done_does_not_hold_the_reply",
    "tests/test_e2e_parsing.py",
    "tests/test_terminal_chat.py",
    "tests/test_cluster_sessions.py",
    "tests/test_reliability_disk.py",
    "tests/test_cli_ops.py",
    "tests/test_mcp.py",
    "tests/test_exec.py",
    "tests/test_tasks.py",
    "tests/test_cluster_jobs.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        for i, prefix in enumerate(LONG_FIRST):
            if item.nodeid.startswith(prefix):
                return i
        return len(LONG_FIRST)

    items.sort(key=rank)  # stable: the rest keeps its order
