"""Benchmark: start-up time with 0, 10,000 and 100,000 stored sessions.

    /work/venv/bin/python -m bench.startup [--sessions 0 10000 100000] [--repeat 3] [--refill]

Fills a database per size (20 messages per session: 2M messages for the largest; bulk
executemany in one transaction on the schema of gateway/store/migrations.py, the search index
rebuilt once at the end), copies it into a fresh data dir, and times
`python -m gateway run` from process start to the first `/readyz` 200. Also times the
first turn of a stored session (its lazy restore) and of a new one, and the RSS once
ready. Goal: ≤ 2 s and flat (restore is lazy). Filled databases are cached under
bench/out/startup-db/ for three days (`--refill` rebuilds them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import shutil
import sqlite3
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from bench._procs import PYTHON, ROOT, Child, child_env, gateway_config, start_fake_model, start_gateway, wait_ready
from gateway.store.migrations.sqlite import MIGRATIONS

OUT = ROOT / "bench" / "out"
CACHE = OUT / "startup-db"
MESSAGES_PER_SESSION = 20
CACHE_MAX_AGE_S = 3 * 86_400
GOAL_S = 2.0
# What `python -m gateway run` imports before it can serve (web only, as in this benchmark).
GATEWAY_IMPORTS = ("import gateway.__main__, gateway.app, gateway.config.reload, gateway.jobs.scheduler, "
                   "gateway.memory.files, channels.web.adapter")


@dataclass
class StartupResult:
    sessions: int
    messages: int
    db_mb: float
    ready_s: list[float]
    first_turn_stored_ms: float
    first_turn_new_ms: float
    rss_mb: float

    @property
    def median_s(self) -> float:
        return statistics.median(self.ready_s)


def fill(path: Path, sessions: int) -> None:
    """A database with `sessions` web sessions of MESSAGES_PER_SESSION messages each."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        stale.unlink(missing_ok=True)
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    for number, script in enumerate(MIGRATIONS, start=1):
        db.executescript(f"BEGIN;\n{script}\nPRAGMA user_version={number};\nCOMMIT;")
    db.execute("PRAGMA synchronous=OFF")
    db.execute("PRAGMA cache_size=-400000")
    now = time.time()
    per = MESSAGES_PER_SESSION
    db.execute("BEGIN")
    # One index rebuild at the end is ~8x faster than the trigger's per-row inserts.
    trigger = db.execute("SELECT sql FROM sqlite_master WHERE name='messages_fts_insert'").fetchone()[0]
    db.execute("DROP TRIGGER messages_fts_insert")
    db.executemany(
        "INSERT INTO sessions(key, scope, channel, created_at, updated_at) VALUES (?,?,?,?,?)",
        ((f"web:u{s}", f"web:u{s}", "web", now, now) for s in range(sessions)),
    )
    db.executemany(
        "INSERT INTO messages(session_key, turn, seq, role, content, token_count, created_at) "
        "VALUES (?,?,?,?,?,?,?)",
        (
            (f"web:u{i // per}", i % per // 2 + 1, i % 2, "user" if i % 2 == 0 else "assistant",
             f"message {i}: the weather in Porto is mild today, about 18 degrees", 16, now)
            for i in range(sessions * per)
        ),
    )
    db.execute(trigger)
    db.execute("INSERT INTO messages_fts(messages_fts) VALUES ('rebuild')")
    db.execute("COMMIT")
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()


def cached_db(sessions: int, refill: bool) -> Path:
    path = CACHE / f"{sessions}.sqlite3"
    fresh = path.exists() and time.time() - path.stat().st_mtime < CACHE_MAX_AGE_S
    if refill or not fresh:
        started = time.monotonic()
        fill(path, sessions)
        print(f"  filled {sessions:,} sessions / {sessions * MESSAGES_PER_SESSION:,} messages "
              f"in {time.monotonic() - started:.1f}s", flush=True)
    return path


def copy_synced(source: Path, target: Path) -> None:
    """Copy and fsync: otherwise the gateway's first checkpoint pays for writing the
    fresh copy back to disk, which a long-running server never would."""
    shutil.copyfile(source, target)
    fd = os.open(target, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def import_seconds(repeat: int = 3) -> tuple[float, float]:
    """(Python start + the gateway's imports, the openai package's share), in seconds."""
    walls = []
    for _ in range(repeat):
        started = time.monotonic()
        subprocess.run([PYTHON, "-c", GATEWAY_IMPORTS], cwd=ROOT, env=child_env(), check=True)
        walls.append(time.monotonic() - started)
    trace = subprocess.run([PYTHON, "-X", "importtime", "-c", GATEWAY_IMPORTS], cwd=ROOT, env=child_env(),
                           check=True, capture_output=True, text=True).stderr
    found = re.search(r"\|\s*(\d+) \|\s*openai$", trace, re.MULTILINE)
    openai_s = int(found.group(1)) / 1e6 if found else float("nan")
    return statistics.median(walls), openai_s


async def first_turn_ms(http: aiohttp.ClientSession, child: Child, session: str) -> float:
    started = time.perf_counter()
    async with http.post(child.url + "/api/chat", json={"session": session, "text": "hello again"},
                         headers=child.web_headers) as resp:
        body = await resp.json()
    if resp.status != 200:
        raise RuntimeError(f"first turn of {session}: HTTP {resp.status} {body}")
    return (time.perf_counter() - started) * 1000


async def measure(sessions: int, repeat: int, refill: bool, model_url: str, workdir: Path) -> StartupResult:
    source = cached_db(sessions, refill)
    ready: list[float] = []
    stored_ms = new_ms = rss = 0.0
    for attempt in range(repeat):
        run_dir = workdir / f"{sessions}-{attempt}"
        (run_dir / "data").mkdir(parents=True)
        copy_synced(source, run_dir / "data" / "gateway.sqlite3")
        config = gateway_config(run_dir, model_url)
        started = time.monotonic()
        child = await start_gateway(config, run_dir / "gateway.log")
        try:
            ready_at = await wait_ready(child.url)
            ready.append(ready_at - started)
            if attempt == repeat - 1:
                rss = child.rss_bytes() / 2**20
                async with aiohttp.ClientSession() as http:
                    if sessions:
                        stored_ms = await first_turn_ms(http, child, f"u{sessions // 2}")
                    new_ms = await first_turn_ms(http, child, "newcomer")
        finally:
            await child.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
    return StartupResult(sessions, sessions * MESSAGES_PER_SESSION, round(source.stat().st_size / 2**20, 1),
                         [round(s, 3) for s in ready], round(stored_ms, 1), round(new_ms, 1), round(rss, 1))


def chart(results: list[StartupResult], target: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    labels = [f"{r.sessions:,}" for r in results]
    ax.bar(labels, [r.median_s for r in results], color="#4c72b0")
    ax.axhline(GOAL_S, color="grey", linewidth=0.8, linestyle="--", label=f"goal {GOAL_S:g} s")
    ax.set_xlabel("stored sessions (20 messages each)")
    ax.set_ylabel("start to /readyz 200 (s)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(target, dpi=80)
    plt.close(fig)


async def main(sizes: list[int], repeat: int, refill: bool) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    results: list[StartupResult] = []
    with tempfile.TemporaryDirectory(prefix="gateway-startup-") as tmp:
        workdir = Path(tmp)
        model, _stats = await start_fake_model(workdir / "model.log")
        try:
            for n in sizes:
                results.append(await measure(n, repeat, refill, model.url, workdir))
        finally:
            await model.stop()
    print(f"{'sessions':>9} {'messages':>10} {'db':>8} {'ready (median)':>15} {'all runs':>22} "
          f"{'1st turn stored':>16} {'1st turn new':>13} {'RSS':>8}")
    for r in results:
        runs = ", ".join(f"{s:.2f}" for s in r.ready_s)
        print(f"{r.sessions:>9,} {r.messages:>10,} {r.db_mb:>6.0f}MB {r.median_s:>14.2f}s {runs:>22} "
              f"{r.first_turn_stored_ms:>14.1f}ms {r.first_turn_new_ms:>11.1f}ms {r.rss_mb:>6.1f}MB")
    imports, openai_s = import_seconds()
    openai_note = ("not imported at start (plain model calls do not need it)" if math.isnan(openai_s)
                   else f"{openai_s:.2f}s of it")
    print(f"\nof which Python start + imports (no I/O): {imports:.2f}s; the openai package: {openai_note}")
    worst = max(r.median_s for r in results)
    spread = worst - min(r.median_s for r in results)
    print(f"goal ≤ {GOAL_S:g} s and flat: worst median {worst:.2f}s, spread {spread:.2f}s → "
          f"{'met' if worst <= GOAL_S else 'MISSED'}")
    (OUT / "startup.json").write_text(json.dumps([asdict(r) for r in results], indent=2))
    chart(results, OUT / "startup.png")
    print(f"wrote {OUT / 'startup.json'} and {OUT / 'startup.png'}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, nargs="+", default=[0, 10_000, 100_000])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--refill", action="store_true", help="rebuild the cached databases")
    args = parser.parse_args()
    asyncio.run(main(args.sessions, args.repeat, args.refill))
