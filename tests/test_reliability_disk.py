"""Reliability: a data dir the gateway cannot use stops `python -m gateway run` with one
clear line and a non-zero code; a full disk gets a clear reply and the process keeps
serving.

CI runs as root, and root ignores permission bits, so a chmod alone proves nothing
there. What really fails for root, and is used here:
- a data_dir whose parent is a regular file (mkdir → ENOTDIR), or that is a file itself;
- a read-only directory for a gateway that runs without CAP_DAC_OVERRIDE: the child
  drops it (and the other file-permission capabilities) from its bounding set before it
  starts, which needs no privilege beyond what root has, so permissions apply to it like
  to any service user (chmod is enough when the tests do not run as root);
- a database path that is a directory, or a file that is not a database;
- "disk full": SQLite's `PRAGMA max_page_count` pinned to the current size after the
  free space inside the file is used up (a tiny tmpfs would need mount rights). SQLite
  fills partly used pages first, so a small write may still fit; a message that needs
  new pages fails with SQLITE_FULL, exactly as on a full disk.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import sqlite3
import stat
import subprocess
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import aiosqlite
import asyncpg
import pytest
import pytest_asyncio

from bench._procs import PYTHON, ROOT, child_env
from gateway.app import Gateway
from gateway.store.sqlite import Store, StoreError
from gateway.turns.sessions import STORAGE_REPLY, UNREACHABLE_REPLY
from tests.conftest import GatewayFactory, chat, web_client
from tests.fakes import telegram_server
from tests.fakes.openai_server import FakeModel, Reply
from tests.fakes.tcp_proxy import TcpProxy
from tests.fakes.telegram_server import FakeTelegram
from tests.test_reliability_faults import session_problems

fake_telegram = telegram_server.fake_telegram  # the fixture

PR_CAPBSET_DROP = 24
# CAP_CHOWN, CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER: what lets root ignore modes.
FILE_CAPABILITIES = (0, 1, 2, 3)
BIG_TEXT = "a message that needs fresh pages in the database " * 600
TELEGRAM_SIZED_TEXT = BIG_TEXT[:4000]  # Telegram's own limit is 4096


def _drop_file_capabilities() -> None:
    """Runs in the child before exec: root keeps uid 0 but loses its permission bypass."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in FILE_CAPABILITIES:
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")


@dataclass
class StartCase:
    """One refused start: how to break the data dir, what the error line must name."""

    prepare: Callable[[Path], Path]  # builds the case under a directory; returns the path to name
    unprivileged: bool = False
    expect: str = ""  # a phrase of the error line
    restore: Callable[[Path], None] = lambda _base: None  # undo modes so tmp_path can be removed


def _under_a_file(base: Path) -> Path:
    (base / "not-a-dir").write_text("a file where a directory should be")
    return base / "not-a-dir" / "data"


def _a_file(base: Path) -> Path:
    (base / "data").write_text("a file")
    return base / "data"


def _read_only_dir(base: Path) -> Path:
    (base / "data").mkdir()
    (base / "data").chmod(0o500)
    return base / "data"


def _read_only_db(base: Path) -> Path:
    (base / "data").mkdir()
    db_path = base / "data" / "gateway.sqlite3"
    with sqlite3.connect(db_path) as db:  # an existing database the gateway may not write
        db.execute("CREATE TABLE kept(x)")
    db_path.chmod(stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
    return db_path


def _db_is_a_dir(base: Path) -> Path:
    (base / "data" / "gateway.sqlite3").mkdir(parents=True)
    return base / "data" / "gateway.sqlite3"


def _not_a_db(base: Path) -> Path:
    (base / "data").mkdir()
    (base / "data" / "gateway.sqlite3").write_bytes(b"\x00garbage, not SQLite\xff" * 300)
    return base / "data" / "gateway.sqlite3"


START_CASES = {
    "data_dir under a regular file": StartCase(_under_a_file, expect="Not a directory"),
    "data_dir is a file": StartCase(_a_file),
    "read-only data dir": StartCase(_read_only_dir, unprivileged=True, expect="not writable",
                                    restore=lambda base: (base / "data").chmod(0o700)),
    "read-only database file": StartCase(_read_only_db, unprivileged=True,
                                         restore=lambda base: (base / "data" / "gateway.sqlite3").chmod(0o600)),
    "database path is a directory": StartCase(_db_is_a_dir),
    "a file that is not a database": StartCase(_not_a_db, expect="not a database"),
}


@pytest.fixture(scope="module")
def refused_starts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[Path, Result]]]:
    """Every case's `python -m gateway run`, started together (each spends ~2 s importing)."""
    running: dict[str, tuple[Path, Path, subprocess.Popen[str]]] = {}
    for name, case in START_CASES.items():
        base = tmp_path_factory.mktemp("start")
        named = case.prepare(base)
        config = base / "config.json"
        data_dir = os.path.relpath(named.parent if named.name == "gateway.sqlite3" else named, base)
        config.write_text(json.dumps({"data_dir": data_dir, "http": {"host": "127.0.0.1", "port": 0}}))
        extra: dict[str, Any] = {}
        if case.unprivileged and os.geteuid() == 0:
            extra["preexec_fn"] = _drop_file_capabilities
        proc = subprocess.Popen(
            [PYTHON, "-m", "gateway", "run", "--config", str(config)], cwd=ROOT, env=child_env(),
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **extra,
        )
        running[name] = (base, named, proc)
    results: dict[str, tuple[Path, Result]] = {}
    try:
        for name, (_base, named, proc) in running.items():
            out, err = proc.communicate(timeout=60)
            results[name] = (named, Result(proc.returncode, out, err))
        yield results
    finally:
        for name, (base, _named, proc) in running.items():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            START_CASES[name].restore(base)


@dataclass(frozen=True)
class Result:
    returncode: int
    stdout: str
    stderr: str


@pytest.mark.parametrize("case", list(START_CASES))
def test_unusable_data_dir_refuses_to_start_with_one_clear_line(
    refused_starts: dict[str, tuple[Path, Result]], case: str
) -> None:
    named, result = refused_starts[case]
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "gateway running" not in result.stdout
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr[-2000:]
    assert lines[0].startswith("cannot start:") and str(named) in lines[0], lines[0]
    assert START_CASES[case].expect in lines[0]
    assert "Traceback" not in result.stderr


async def test_a_failed_database_open_leaves_no_thread_behind(tmp_path: Path) -> None:
    (tmp_path / "gateway.sqlite3").mkdir()
    before = set(threading.enumerate())
    with pytest.raises(StoreError):
        await Store.open(tmp_path / "gateway.sqlite3")
    left = [t for t in threading.enumerate() if t not in before and t.is_alive()]
    assert left == [], f"{len(left)} database thread(s) still running after the failed open"


def test_a_read_only_data_dir_stays_untouched(refused_starts: dict[str, tuple[Path, Result]]) -> None:
    named, _result = refused_starts["read-only data dir"]
    assert list(named.iterdir()) == []


# ---------------------------------------------------------------------------- disk full


async def fill_disk(gw: Gateway) -> None:
    """Use up the free space inside the database file, then forbid it to grow."""
    assert gw.services is not None
    db = gw.services.store.connection
    await db.execute("CREATE TABLE disk_filler(x BLOB)")
    await db.commit()
    async with db.execute("PRAGMA page_count") as cur:
        row = await cur.fetchone()
    assert row is not None
    await db.execute(f"PRAGMA max_page_count={int(row[0])}")
    for size in (4096, 512, 64, 8, 1):
        for _ in range(10_000):  # bounded: a few pages' worth at most
            try:
                await db.execute("INSERT INTO disk_filler VALUES (zeroblob(?))", (size,))
                await db.commit()
            except aiosqlite.OperationalError as err:
                assert "full" in str(err)
                await db.rollback()
                break


async def free_disk(gw: Gateway) -> None:
    assert gw.services is not None
    await gw.services.store.connection.execute("PRAGMA max_page_count=1073741823")


async def _healthz(gw: Gateway) -> int:
    assert gw.http is not None
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{gw.http.port}/healthz") as resp:
        return resp.status


async def post_raw(gw: Gateway, session: str, text: str) -> tuple[int, str]:
    """POST /api/chat and return the body as text, whatever its content type."""
    assert gw.http is not None
    async with web_client(gw) as http, http.post(
        f"http://127.0.0.1:{gw.http.port}/api/chat", json={"session": session, "text": text}
    ) as resp:
        return resp.status, await resp.text()


async def test_a_full_disk_does_not_take_the_gateway_down(make_gateway: GatewayFactory,
                                                          fake_model: FakeModel) -> None:
    gw = await make_gateway()
    assert await chat(gw, "rae", "before") == "echo: before"
    await fill_disk(gw)

    _status, body = await post_raw(gw, "rae", BIG_TEXT)
    assert "echo: a message" not in body  # it could not be stored, so no turn ran
    assert await _healthz(gw) == 200

    await free_disk(gw)
    assert await chat(gw, "rae", "after") == "echo: after"
    assert gw.services is not None
    stored = await gw.services.store.messages("web:rae")
    assert session_problems(stored) == []
    assert [m.content for m in stored if m.role == "user"] == ["before", "after"]


async def test_a_web_turn_under_a_full_disk_gets_a_clear_error(make_gateway: GatewayFactory,
                                                               fake_model: FakeModel) -> None:
    gw = await make_gateway()
    assert await chat(gw, "sol", "before") == "echo: before"
    await fill_disk(gw)
    status, raw = await post_raw(gw, "sol", BIG_TEXT)
    body = json.loads(raw)  # a JSON answer (reply or error), not aiohttp's plain-text 500 page
    text = str(body.get("reply") or body.get("error") or "")
    assert status in (200, 503, 507), (status, text)
    assert any(word in text.lower() for word in ("disk", "storage", "full", "save")), text
    assert "Traceback" not in text


async def test_a_telegram_turn_under_a_full_disk_gets_a_clear_reply(
    make_gateway: GatewayFactory, fake_model: FakeModel, fake_telegram: FakeTelegram
) -> None:
    gw = await make_gateway(access={"dm_policy": "open"}, channels={"telegram": {
        "enabled": True, "token": fake_telegram.token, "base_url": fake_telegram.base_url,
        "base_file_url": fake_telegram.base_file_url, "poll_timeout_s": 1}})
    fake_telegram.push_message(chat_id=41, user_id=41, text="before")
    assert [m["text"] for m in await fake_telegram.wait_sent(1)] == ["echo: before"]
    await fill_disk(gw)
    update_id = fake_telegram.push_message(chat_id=41, user_id=41, text=TELEGRAM_SIZED_TEXT)
    await fake_telegram.wait_confirmed(update_id + 1, timeout=10)  # handled or given up on
    assert gw.services is not None
    await gw.services.background.wait_idle(5)
    replies = [m["text"] for m in fake_telegram.sent[1:]]
    assert replies, "no reply to a message that could not be saved"
    assert any(word in replies[0].lower() for word in ("disk", "storage", "full", "save")), replies


async def _readyz(gw: Gateway) -> tuple[int, dict[str, Any]]:
    assert gw.http is not None
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{gw.http.port}/readyz") as resp:
        return resp.status, await resp.json()


async def test_readyz_reports_a_store_that_cannot_write(make_gateway: GatewayFactory, fake_model: FakeModel) -> None:
    """Taking the write lock still works on a full disk; the failed writes tell the truth."""
    gw = await make_gateway()
    assert await chat(gw, "ray", "before") == "echo: before"
    assert (await _readyz(gw))[0] == 200
    await fill_disk(gw)
    await post_raw(gw, "ray", BIG_TEXT)  # cannot be stored
    status, body = await _readyz(gw)
    assert status == 503 and body["checks"]["database"] is False, body
    assert any(r.startswith("store: cannot write:") and "full" in r for r in body["reasons"]), body

    await free_disk(gw)
    assert await chat(gw, "ray", "after") == "echo: after"
    status, body = await _readyz(gw)
    assert status == 200 and body["reasons"] == [], body


# ---------------------------------------------------------------------------- private files


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


async def test_data_dir_and_database_are_private_whatever_the_umask(
    make_gateway: GatewayFactory, fake_model: FakeModel, tmp_path: Path
) -> None:
    old = os.umask(0)  # the most permissive: nothing may rely on the umask
    try:
        gw = await make_gateway()
        assert await chat(gw, "pia", "hello") == "echo: hello"
    finally:
        os.umask(old)
    data = tmp_path / "data"
    assert _mode(data) == 0o700
    scopes = data / "scopes"
    assert _mode(scopes) == 0o700
    assert [_mode(d) for d in scopes.iterdir()] == [0o700]  # web:pia's workspace
    for name in ("gateway.sqlite3", "gateway.sqlite3-wal", "gateway.sqlite3-shm"):
        assert _mode(data / name) == 0o600, name


async def test_an_existing_world_readable_data_dir_is_made_private(
    make_gateway: GatewayFactory, fake_model: FakeModel, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    (data / "scopes").mkdir(parents=True)
    with sqlite3.connect(data / "gateway.sqlite3") as db:
        db.execute("PRAGMA journal_mode=WAL")
    for path, mode in ((data, 0o755), (data / "scopes", 0o775), (data / "gateway.sqlite3", 0o644)):
        path.chmod(mode)
    await make_gateway()
    assert (_mode(data), _mode(data / "scopes"), _mode(data / "gateway.sqlite3")) == (0o700, 0o700, 0o600)


# ---------------------------------------------------------------------------- the database failing mid-turn


class Breakage:
    """The store failing under a running turn, on either backend, the way it fails for real:
    - full: SQLite out of pages (SQLITE_FULL, as fill_disk); PostgreSQL's disk_full (53100),
      raised by the server itself for the turn's next write (a trigger: a full tablespace
      needs a filesystem the tests cannot mount);
    - unreachable: SQLite locked by another process past the store's wait (SQLITE_BUSY);
      PostgreSQL's connections cut at the network (tests/fakes/tcp_proxy.py), new ones
      refused until mended."""

    def __init__(self, gw: Gateway, backend: str, failure: str, url: str | None, proxy: TcpProxy | None) -> None:
        self.gw, self.backend, self.failure, self.url, self.proxy = gw, backend, failure, url, proxy
        self._locker: sqlite3.Connection | None = None
        self.done = False  # once: a turn resumed on PostgreSQL calls the model again

    async def __call__(self) -> None:
        assert self.gw.services is not None
        self.done = True
        if self.backend == "sqlite" and self.failure == "full":
            await fill_disk(self.gw)
        elif self.backend == "sqlite":
            await self.gw.services.store.connection.execute("PRAGMA busy_timeout=0")
            self._locker = sqlite3.connect(self.gw.services.store.path, isolation_level=None)
            self._locker.execute("BEGIN EXCLUSIVE")
        elif self.failure == "full":
            await self._pg("CREATE FUNCTION no_room() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                           "RAISE EXCEPTION 'could not extend file: No space left on device' "
                           "USING ERRCODE = 'disk_full'; END $$; "
                           "CREATE TRIGGER no_room BEFORE INSERT ON messages FOR EACH ROW "
                           "WHEN (NEW.role = 'assistant') EXECUTE FUNCTION no_room()")
        else:
            assert self.proxy is not None
            self.proxy.cut()

    async def mend(self) -> None:
        assert self.gw.services is not None
        if self.backend == "sqlite" and self.failure == "full":
            await free_disk(self.gw)
        elif self.backend == "sqlite":
            assert self._locker is not None
            self._locker.execute("ROLLBACK")
            self._locker.close()
            await self.gw.services.store.connection.execute("PRAGMA busy_timeout=5000")
        elif self.failure == "full":
            await self._pg("DROP TRIGGER no_room ON messages; DROP FUNCTION no_room()")
        else:
            assert self.proxy is not None
            self.proxy.restore()

    async def _pg(self, sql: str) -> None:
        assert self.url is not None
        conn = await asyncpg.connect(self.url, timeout=10)
        try:
            await conn.execute(sql)
        finally:
            await conn.close(timeout=5)


@pytest_asyncio.fixture
async def pg_proxy(store_url: str | None) -> AsyncIterator[TcpProxy | None]:
    """A cuttable link to the test's PostgreSQL database (None on SQLite). Requested before
    make_gateway, it closes after the gateway has stopped."""
    if store_url is None:
        yield None
        return
    async with TcpProxy.for_url(store_url) as proxy:
        yield proxy


@pytest.mark.parametrize("failure", ["full", "unreachable"])
async def test_the_database_failing_mid_turn_gets_a_clear_reply_on_both_backends(
        pg_proxy: TcpProxy | None, make_gateway: GatewayFactory, fake_model: FakeModel, store_backend: str,
        store_url: str | None, failure: str, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 31: storage errors were caught as sqlite3.Error only: on PostgreSQL a full disk
    or a lost connection crashed the turn. Both backends raise StoreError now, and the
    person is told what happened; the gateway goes on serving once the database is back."""
    caplog.set_level(logging.INFO, logger="gateway.sessions")
    url = pg_proxy.url(store_url) if pg_proxy is not None and store_url is not None else None
    gw = await (make_gateway(store={"url": url}) if url else make_gateway())
    assert await chat(gw, "rae", "before") == "echo: before"
    breakage = Breakage(gw, store_backend, failure, store_url, pg_proxy)

    async def respond(body: dict[str, Any]) -> Any:
        if body["messages"][-1]["content"] == "during" and not breakage.done:
            await breakage()  # after the message was stored, before the answer is
            return Reply(text=BIG_TEXT)
        return None

    fake_model.respond_with(respond)
    reply = await chat(gw, "rae", "during")
    assert reply == (STORAGE_REPLY if failure == "full" else UNREACHABLE_REPLY)
    if failure == "unreachable":  # a message that cannot even be recorded is told so too
        assert await chat(gw, "rae", "while it is down") == UNREACHABLE_REPLY
    await breakage.mend()
    # (On PostgreSQL the turn left open is resumed first, as after any failure.)
    assert await chat(gw, "rae", "after") == "echo: after"
    outcomes = [r.outcome for r in caplog.records if r.getMessage() == "turn ended"]  # type: ignore[attr-defined]
    assert "storage_error" in outcomes and "crash" not in outcomes, outcomes
    ours = [r for r in caplog.records if r.exc_info and r.name.startswith(("gateway", "channels"))]
    assert not ours, "a storage failure is no crash: no traceback"
    if pg_proxy is not None and failure == "unreachable":
        assert pg_proxy.refused > 0  # the store did try again while the database was away
