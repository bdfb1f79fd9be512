"""Operator commands that read the database and the data dir: `pairing list|approve`,
`sessions`, `usage`, `memory`. They need no channel secrets and work while the gateway
runs (SQLite WAL: readers never block the writer); only `pairing approve` writes."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from gateway.access import Pairing
from gateway.config.cron import zone
from gateway.config.schema import Config, secret_text
from gateway.keys import KEY_WORDS, workspace_dir
from gateway.memory.files import DIALOG_DIR, MEMORY_FILE, NOTES_DIR
from gateway.store.backends import is_postgres_url, open_store, sqlite_path
from gateway.store.errors import StoreError
from gateway.store.migrations.postgres import MIGRATIONS as PG_MIGRATIONS
from gateway.store.migrations.sqlite import MIGRATIONS
from gateway.store.postgres import PgStore
from gateway.store.sqlite import Store

DB_NAME = "gateway.sqlite3"


class CliError(Exception):
    """A problem worth one line on stderr and exit code 1."""


# -- output ---------------------------------------------------------------------------------


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], *, right: Sequence[int] = ()) -> str:
    """Columns aligned under their headers; numbers (and the `right` columns) right-aligned."""
    cells = [[str(c) for c in headers], *[[_cell(c) for c in row] for row in rows]]
    numeric = [i in right or (bool(rows) and all(isinstance(row[i], int | float) for row in rows))
               for i in range(len(headers))]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for r in cells:
        parts = [r[i].rjust(widths[i]) if numeric[i] else r[i].ljust(widths[i]) for i in range(len(headers))]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def _cell(value: object) -> str:
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def ago(seconds: float) -> str:
    """A duration as people say it: 45 s, 12 min, 3 h, 2 d."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds // 60:.0f} min"
    if seconds < 86_400:
        return f"{seconds / 3600:.1f} h".replace(".0 h", " h")
    return f"{seconds / 86_400:.1f} d".replace(".0 d", " d")


def size_text(size: int) -> str:
    value = float(size)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1024 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size} B"  # not reached


# -- the database ---------------------------------------------------------------------------


def configured_url(cfg: Config) -> str | None:
    """`store.url` as usable text (None: SQLite in the data dir)."""
    return secret_text(cfg.store.url)


def database_path(cfg: Config, base: Path) -> Path:
    url = configured_url(cfg)
    if url and url.startswith("sqlite:///"):
        path = sqlite_path(url)
        return (path if path.is_absolute() else cfg.data_path(base) / path).absolute()
    return (cfg.data_path(base) / DB_NAME).absolute()


@asynccontextmanager
async def read_store(path: Path, url: str | None = None) -> AsyncIterator[Any]:
    """The store on a read-only connection: never creates, migrates or writes anything."""
    if is_postgres_url(url):
        assert url is not None
        try:
            pg = await PgStore.open(url, migrate=False, pool_max=2)
        except StoreError as err:
            raise CliError(str(err)) from None
        try:
            version = await pg.schema_version()
            if version < len(PG_MIGRATIONS):
                raise CliError("the database is from an older version: start the gateway once to upgrade it")
            if version > len(PG_MIGRATIONS):
                raise CliError("the database is from a newer version of the gateway than this one")
            yield pg
        finally:
            await pg.close()
        return
    if not await asyncio.to_thread(path.exists):
        raise CliError(f"no database at {path}: the gateway has not run with this config yet")
    try:
        store = await Store.open_read_only(path)
    except StoreError as err:
        raise CliError(str(err)) from None
    try:
        version = await store.schema_version()
        if version < len(MIGRATIONS):
            raise CliError(f"the database {path} is from an older version: start the gateway once to upgrade it")
        if version > len(MIGRATIONS):
            raise CliError(f"the database {path} is from a newer version of the gateway than this one")
        yield store
    finally:
        await store.close()


def _local(cfg: Config, at: float) -> datetime:
    return datetime.fromtimestamp(at, zone(cfg.timezone))


def who(scope: str) -> str:
    """The person (or group) a memory scope belongs to, named as everywhere else for
    operators (`admins`, `allow_from`, usage, pairing): `telegram:7`, `slack:U1`,
    `web:alice`, a group `telegram:-100`; a person's own session in a group is
    `telegram:7 in telegram:-100`. Another agent's scope (`coder/…`) names the same."""
    scope = scope.partition("/")[2] or scope
    parts = scope.split(":")
    if len(parts) == 3 and parts[1] in ("user", "group"):  # telegram:user:7, telegram:group:-100
        return f"{parts[0]}:{parts[2]}"
    if len(parts) == 5 and parts[1] == "group" and parts[3] == "user":  # telegram:group:-100:user:7
        return f"{parts[0]}:{parts[4]} in {parts[0]}:{parts[2]}"
    return scope  # web:alice, terminal:local


def scope_of_person(identity: str) -> str | None:
    """The memory scope of a person's DM (`telegram:7` → `telegram:user:7`), or None when
    `identity` is not a person's name."""
    channel, sep, user = identity.partition(":")
    if not sep or not user or ":" in user or channel not in KEY_WORDS:
        return None
    return f"{channel}:user:{user}"


# -- commands -------------------------------------------------------------------------------


async def pairing_list(cfg: Config, base: Path) -> str:
    async with read_store(database_path(cfg, base), configured_url(cfg)) as store:
        pairing = Pairing(store)
        codes = await pairing.pending()
        people = await pairing.approved()
    now = time.time()
    if codes:
        rows = [(c.identity, c.code, ago(now - c.created_at), ago(c.expires_at - now)) for c in codes]
        waiting = table(("WHO", "CODE", "AGE", "EXPIRES IN"), rows)
    else:
        waiting = "No pairing codes are waiting."
    if not people:
        return waiting
    approved = table(("WHO", "APPROVED", "BY"),
                     [(p.identity, f"{ago(now - p.approved_at)} ago", p.approved_by) for p in people])
    return f"{waiting}\n\nApproved by pairing (`gateway pairing revoke WHO` takes one back):\n{approved}"


@dataclass(frozen=True, slots=True)
class Approval:
    ok: bool
    text: str


@asynccontextmanager
async def write_store(cfg: Config, base: Path) -> AsyncIterator[Any]:
    """The store proper (migrated, busy timeout), without a checkpoint connection: for the
    commands that write."""
    path, url = database_path(cfg, base), configured_url(cfg)
    if not is_postgres_url(url) and not await asyncio.to_thread(path.exists):
        raise CliError(f"no database at {path}: the gateway has not run with this config yet")
    try:
        store = await open_store(url, path.parent, checkpoint_interval_s=None) if is_postgres_url(url) \
            else await Store.open(path, checkpoint_interval_s=None)
    except StoreError as err:
        raise CliError(str(err)) from None
    try:
        yield store
    finally:
        await store.close()


async def pairing_approve(cfg: Config, base: Path, code: str) -> Approval:
    async with write_store(cfg, base) as store:
        # The same path as /approve in chat and the admin page; this process runs no
        # channel, so the person is not told (a gateway answers their next message).
        outcome = await Pairing(store).approve_code(code, by="cli")
    if not outcome.ok:
        return Approval("already approved" in outcome.text, outcome.text)
    return Approval(True, f"{outcome.text} (A running gateway answers their next message; the \"You're approved\" "
                          "notice is sent by /approve in chat and the admin page.)")


async def pairing_revoke(cfg: Config, base: Path, identity: str) -> Approval:
    async with write_store(cfg, base) as store:
        outcome = await Pairing(store).revoke(identity, by="cli", cfg=cfg)
    return Approval(outcome.ok, outcome.text)


async def sessions(cfg: Config, base: Path, limit: int) -> str:
    tz = zone(cfg.timezone)
    midnight = datetime.now(tz).replace(hour=0, minute=0, second=0, microsecond=0).timestamp()
    async with read_store(database_path(cfg, base), configured_url(cfg)) as store:
        rows = await store.run(
            "SELECT s.key, s.scope, s.updated_at, "
            " (SELECT MAX(turn) FROM messages m WHERE m.session_key = s.key) AS turns, "
            " (SELECT COALESCE(SUM(token_count), 0) FROM messages m "
            "   WHERE m.session_key = s.key AND m.created_at >= ?) AS tokens "
            "FROM sessions s ORDER BY s.updated_at DESC LIMIT ?", (midnight, limit),
        )
        total = (await store.run("SELECT count(*) FROM sessions"))[0][0]
    if not rows:
        return "No sessions yet."
    now = time.time()
    out = table(("SESSION", "WHO", "LAST ACTIVITY", "TURNS", "TOKENS TODAY"),
                [(r["key"], who(r["scope"]),
                  f"{_local(cfg, r['updated_at']):%Y-%m-%d %H:%M} ({ago(now - r['updated_at'])} ago)",
                  int(r["turns"] or 0), int(r["tokens"])) for r in rows])
    more = f"\n({len(rows)} of {total} sessions; --limit N shows more)" if total > len(rows) else ""
    return out + more + "\n(tokens today: of the messages stored today; what the model counted: gateway usage)"


async def usage(cfg: Config, base: Path, days: int) -> str:
    today = datetime.now(zone(cfg.timezone)).date()
    first = (today - timedelta(days=days - 1)).isoformat()
    async with read_store(database_path(cfg, base), configured_url(cfg)) as store:
        rows = await store.run(
            "SELECT day, identity, turns, tokens FROM usage WHERE day >= ? ORDER BY day DESC, tokens DESC, identity",
            (first,),
        )
    span = "today" if days == 1 else f"the last {days} days"
    if not rows:
        return f"No usage in {span}."
    body = [(r["day"], r["identity"], int(r["turns"]), int(r["tokens"])) for r in rows]
    body.append(("total", "", sum(r[2] for r in body), sum(r[3] for r in body)))
    return f"Tokens the model counted, per day and person ({span}):\n" + table(
        ("DAY", "WHO", "TURNS", "TOKENS"), body)


async def memory(cfg: Config, base: Path, scope: str | None) -> str:
    data_dir = cfg.data_path(base)
    known = await _known_scopes(cfg, base)
    if scope is None:
        if not known:
            return f"No memory scopes yet (they live under {data_dir / 'scopes'})."
        rows = await asyncio.to_thread(
            lambda: [(s, who(s), str(d), size_text(_tree_size(d))) for s, d in known.items()])
        return table(("SCOPE", "WHO", "WORKSPACE", "SIZE"), rows, right=(3,))
    if scope not in known:
        # A session key, or a person as usage and sessions name them (`telegram:7`).
        mapped = await _scope_of_session(cfg, base, scope) or scope_of_person(scope)
        scope = mapped or scope
    root = workspace_dir(data_dir, scope)
    if not await asyncio.to_thread(root.is_dir):
        names = ", ".join(sorted(known)[:10]) or "none yet"
        raise CliError(f"no memory for scope {scope!r} (it would live in {root}); known scopes: {names}")
    rows = await asyncio.to_thread(_memory_rows, root)
    named = who(scope)
    title = f"scope {scope}" + (f" ({named})" if named != scope else "")
    return f"{title}\n" + table(("WHAT", "PATH", "SIZE", "FILES"), rows, right=(2,))


def _memory_rows(root: Path) -> list[tuple[str, str, str, str]]:
    rows: list[tuple[str, str, str, str]] = []
    md = root / MEMORY_FILE
    rows.append(("curated memory", str(md), size_text(md.stat().st_size) if md.is_file() else "-",
                 "" if md.is_file() else "not written yet"))
    for label, name, suffix in (("daily notes", NOTES_DIR, ".md"), ("dialog archive", DIALOG_DIR, ".jsonl")):
        folder = root / name
        files = sorted(p for p in folder.glob(f"*{suffix}") if p.is_file()) if folder.is_dir() else []
        span = f"{len(files)}: {files[0].stem} … {files[-1].stem}" if len(files) > 1 else (
            f"1: {files[0].stem}" if files else "none yet")
        rows.append((label, f"{folder}{os.sep}", size_text(sum(p.stat().st_size for p in files)), span))
    rows.append(("whole workspace", f"{root}{os.sep}", size_text(_tree_size(root)), ""))
    return rows


def _tree_size(root: Path) -> int:
    total = 0
    for folder, _dirs, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass  # removed meanwhile
    return total


async def _known_scopes(cfg: Config, base: Path) -> dict[str, Path]:
    """Scope → workspace, from the database's register of scopes with memory."""
    data_dir = cfg.data_path(base)
    try:
        async with read_store(database_path(cfg, base), configured_url(cfg)) as store:
            rows = await store.run("SELECT scope FROM memory_scopes ORDER BY scope")
            rows += await store.run("SELECT DISTINCT scope FROM sessions ORDER BY scope")
    except CliError:
        return {}
    scopes = {str(r[0]): workspace_dir(data_dir, str(r[0])) for r in rows}
    present = await asyncio.to_thread(lambda: {s for s, d in scopes.items() if d.is_dir()})
    return {s: d for s, d in sorted(scopes.items()) if s in present}


async def _scope_of_session(cfg: Config, base: Path, key: str) -> str | None:
    """A session key given for a scope: the scope that session uses."""
    try:
        async with read_store(database_path(cfg, base), configured_url(cfg)) as store:
            rows = await store.run("SELECT scope FROM sessions WHERE key=?", (key,))
    except CliError:
        return None
    return str(rows[0][0]) if rows else None


# -- settings changed in chat (SPEC §10) ---------------------------------------------------------


async def config_reset(cfg: Config, base: Path, key: str | None) -> str:
    """`config-reset KEY`: give a key changed with `/config` back to the gateways' config
    files (a change with no value, which every gateway on the database follows within
    seconds); without KEY, the keys whose chat change is in effect."""
    url = configured_url(cfg)
    if not is_postgres_url(url):
        raise CliError("a lone gateway on SQLite keeps settings changed in chat in its config.json only: "
                       "edit the file (the gateway follows it)")
    assert url is not None
    if key is None:
        async with read_store(database_path(cfg, base), url) as store:
            changes = [c for c in await store.config_changes() if c.value_json is not None]
        if not changes:
            return "No setting changed in chat is in effect: the config files decide every key."
        now = time.time()
        rows = [(c.key, c.value_json, f"{ago(now - c.changed_at)} ago", c.changed_by or "") for c in changes]
        return ("Settings changed in chat, over every gateway's config file (`gateway config-reset KEY` gives "
                "one back to the files):\n" + table(("KEY", "VALUE", "CHANGED", "BY"), rows))
    try:
        store = await PgStore.open(url, pool_max=2)
    except StoreError as err:
        raise CliError(str(err)) from None
    try:
        current = {c.key: c for c in await store.config_changes()}
        change = current.get(key)
        if change is None or change.value_json is None:
            raise CliError(f"{key} has no change made in chat: the config files decide it")
        await store.record_config_change(key, None, "cli")
    finally:
        await store.close()
    return (f"{key} is back to each gateway's config file (the chat value was {change.value_json}); running "
            "gateways follow within a few seconds. The gateway that took the /config command wrote the value "
            "into its own config.json as well: edit that file if it should not keep it.")
