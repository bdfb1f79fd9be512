"""A throw-away PostgreSQL server for the tests (or an existing one from PG_TEST_URL).

initdb into a temporary directory (as the `postgres` user when the tests run as root:
PostgreSQL refuses to run as root), listening on 127.0.0.1 only, on a free port, with
its socket in that directory; fsync off, since the data is thrown away. Each test gets a
database of its own, so tests never see each other's rows.

Without PostgreSQL the tests that need it skip locally; in CI (CI=true) they fail, so a
missing server is never mistaken for a pass.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

START_TIMEOUT_S = 60


@dataclass(frozen=True, slots=True)
class PgServer:
    url: str  # postgresql://user@127.0.0.1:port/postgres (an admin database)

    def database_url(self, name: str) -> str:
        base, _, _ = self.url.rpartition("/")
        return f"{base}/{name}"


def _tool(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for version in ("17", "16", "15", "14", "13"):  # Debian keeps them off PATH
        candidate = Path(f"/usr/lib/postgresql/{version}/bin/{name}")
        if candidate.is_file():
            return str(candidate)
    return None


def _unavailable(reason: str) -> None:
    if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
        pytest.fail(f"PostgreSQL is required in CI: {reason}", pytrace=False)
    pytest.skip(f"PostgreSQL not available: {reason} (install postgresql or set PG_TEST_URL)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def pg_server() -> Iterator[PgServer]:
    existing = os.environ.get("PG_TEST_URL")
    if existing:
        yield PgServer(existing)
        return
    initdb, pg_ctl = _tool("initdb"), _tool("pg_ctl")
    if initdb is None or pg_ctl is None:
        _unavailable("initdb/pg_ctl not found")
        return
    as_root = os.geteuid() == 0
    user = "postgres" if as_root else pwd.getpwuid(os.geteuid()).pw_name
    prefix: list[str] = []
    root = Path(tempfile.mkdtemp(prefix="gateway-pg-"))
    if as_root:
        try:
            entry = pwd.getpwnam("postgres")
        except KeyError:
            shutil.rmtree(root, ignore_errors=True)
            _unavailable("running as root and there is no postgres user to run the server")
            return
        os.chown(root, entry.pw_uid, entry.pw_gid)
        prefix = ["runuser", "-u", "postgres", "--"]
    data, log = root / "data", root / "server.log"
    port = _free_port()
    started = False
    try:
        subprocess.run([*prefix, initdb, "-D", str(data), "-U", user, "-A", "trust", "-E", "UTF8",
                        "--no-sync", "--locale=C"], check=True, capture_output=True, timeout=START_TIMEOUT_S)
        options = f"-c listen_addresses=127.0.0.1 -p {port} -k {root} -c fsync=off " \
                  "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
        subprocess.run([*prefix, pg_ctl, "-D", str(data), "-l", str(log), "-o", options, "-w",
                        "-t", str(START_TIMEOUT_S), "start"], check=True, capture_output=True,
                       timeout=START_TIMEOUT_S + 10)
        started = True
        yield PgServer(f"postgresql://{user}@127.0.0.1:{port}/postgres")
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as err:
        detail = getattr(err, "stderr", b"") or b""
        with contextlib.suppress(OSError):
            detail += log.read_bytes()[-2000:]
        _unavailable(f"the test server did not start: {err}: {detail.decode(errors='replace')[-800:]}")
    finally:
        if started:
            subprocess.run([*prefix, pg_ctl, "-D", str(data), "-m", "fast", "-w", "-t", "30", "stop"],
                           capture_output=True, timeout=40, check=False)
        shutil.rmtree(root, ignore_errors=True)


async def create_database(server: PgServer) -> str:
    """A new empty database on the server; its URL."""
    import asyncpg

    name = f"t_{uuid.uuid4().hex[:12]}"
    conn = await asyncpg.connect(server.url, timeout=10)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close(timeout=5)
    return server.database_url(name)

