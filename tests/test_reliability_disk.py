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
import os
import sqlite3
import stat
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import aiosqlite
import pytest

from bench._procs import PYTHON, ROOT, child_env
from gateway.app import Gateway
from tests.conftest import GatewayFactory, chat, post_chat
from tests.fakes.openai_server import FakeModel
from tests.test_reliability_faults import session_problems

PR_CAPBSET_DROP = 24
# CAP_CHOWN, CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER: what lets root ignore modes.
FILE_CAPABILITIES = (0, 1, 2, 3)
BIG_TEXT = "a message that needs fresh pages in the database " * 600


def _drop_file_capabilities() -> None:
    """Runs in the child before exec: root keeps uid 0 but loses its permission bypass."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in FILE_CAPABILITIES:
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")


def run_gateway(config: Path, *, unprivileged: bool = False) -> subprocess.CompletedProcess[str]:
    """`python -m gateway run --config` to completion (bounded), stdin closed."""
    extra: dict[str, Any] = {}
    if unprivileged and os.geteuid() == 0:
        extra["preexec_fn"] = _drop_file_capabilities
    return subprocess.run(
        [PYTHON, "-m", "gateway", "run", "--config", str(config)], cwd=ROOT, env=child_env(),
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60, check=False, **extra,
    )


def write_config(directory: Path, data_dir: str) -> Path:
    path = directory / "config.json"
    path.write_text(json.dumps({"data_dir": data_dir, "http": {"host": "127.0.0.1", "port": 0}}))
    return path


def assert_refused_start(result: subprocess.CompletedProcess[str], names: Path) -> str:
    """A clean refusal: exit code 2, nothing on stdout, one stderr line naming `names`."""
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "gateway running" not in result.stdout
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr[-2000:]
    assert str(names) in lines[0] and lines[0].startswith("cannot start:"), lines[0]
    assert "Traceback" not in result.stderr
    return lines[0]


def test_data_dir_under_a_regular_file_refuses_to_start(tmp_path: Path) -> None:
    (tmp_path / "not-a-dir").write_text("a file where a directory should be")
    line = assert_refused_start(run_gateway(write_config(tmp_path, "not-a-dir/data")),
                                tmp_path / "not-a-dir" / "data")
    assert "Not a directory" in line


def test_data_dir_that_is_a_file_refuses_to_start(tmp_path: Path) -> None:
    (tmp_path / "data").write_text("a file")
    assert_refused_start(run_gateway(write_config(tmp_path, "data")), tmp_path / "data")


def test_read_only_data_dir_refuses_to_start(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    data.chmod(0o500)
    try:
        line = assert_refused_start(run_gateway(write_config(tmp_path, "data"), unprivileged=True), data)
    finally:
        data.chmod(0o700)
    assert "not writable" in line
    assert list(data.iterdir()) == []  # nothing was written after all


def test_read_only_database_file_refuses_to_start(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    db_path = data / "gateway.sqlite3"
    with sqlite3.connect(db_path) as db:  # an existing database the gateway may not write
        db.execute("CREATE TABLE kept(x)")
    db_path.chmod(stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
    try:
        assert_refused_start(run_gateway(write_config(tmp_path, "data"), unprivileged=True), db_path)
    finally:
        db_path.chmod(0o600)


def test_database_path_that_is_a_directory_refuses_to_start(tmp_path: Path) -> None:
    (tmp_path / "data" / "gateway.sqlite3").mkdir(parents=True)
    assert_refused_start(run_gateway(write_config(tmp_path, "data")), tmp_path / "data" / "gateway.sqlite3")


def test_a_file_that_is_not_a_database_refuses_to_start(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "gateway.sqlite3").write_bytes(b"\x00garbage, not SQLite\xff" * 300)
    line = assert_refused_start(run_gateway(write_config(tmp_path, "data")), tmp_path / "data" / "gateway.sqlite3")
    assert "not a database" in line


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


async def test_a_full_disk_does_not_take_the_gateway_down(make_gateway: GatewayFactory,
                                                          fake_model: FakeModel) -> None:
    gw = await make_gateway()
    assert await chat(gw, "rae", "before") == "echo: before"
    await fill_disk(gw)

    status, _body = await post_chat(gw, {"session": "rae", "text": BIG_TEXT})
    assert status != 200 or "echo" not in str(_body)  # the message could not be stored, so no turn ran
    assert await _healthz(gw) == 200

    await free_disk(gw)
    assert await chat(gw, "rae", "after") == "echo: after"
    assert gw.services is not None
    stored = await gw.services.store.messages("web:rae")
    assert session_problems(stored) == []
    assert [m.content for m in stored if m.role == "user"] == ["before", "after"]


@pytest.mark.xfail(strict=True, reason=(
    "product bug: a storage error (SQLITE_FULL) in Router.handle → store.record_event escapes to "
    "channels/web.py api_chat, which answers HTTP 500 'Internal Server Error' with a traceback in the "
    "log instead of a clear reply; Telegram retries the update 3 times and drops it without a reply"))
async def test_a_turn_under_a_full_disk_gets_a_clear_reply(make_gateway: GatewayFactory,
                                                           fake_model: FakeModel) -> None:
    gw = await make_gateway()
    assert await chat(gw, "sol", "before") == "echo: before"
    await fill_disk(gw)
    assert gw.http is not None
    async with aiohttp.ClientSession() as http:
        async with http.post(f"http://127.0.0.1:{gw.http.port}/api/chat",
                             json={"session": "sol", "text": BIG_TEXT}) as resp:
            raw = await resp.text()
    body = json.loads(raw)  # a JSON answer (reply or error), not aiohttp's plain-text 500 page
    text = str(body.get("reply") or body.get("error") or "")
    assert any(word in text.lower() for word in ("disk", "storage", "full", "save")), text
    assert "Traceback" not in text
