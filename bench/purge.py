"""Benchmark: purge a million expired messages while chats keep writing.

    /work/venv/bin/python bench/purge.py [--messages 1000000] [--sessions 10000]

Fills a fresh database (bulk insert on a side connection, the search index kept by the
triggers as in production), then runs the purge while a probe measures event-loop stalls
(a 5 ms sleep loop recording how late it wakes) and a fake chat keeps doing small store
writes. Goal: no stall over 50 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

from gateway.memory.purge import purge
from gateway.store.sqlite import Store
from gateway.types import Message

DAY = 86_400.0
PROBE_S = 0.005


def fill(path: Path, messages: int, sessions: int) -> None:
    """Bulk insert; the search index is built once at the end ('rebuild'), which is much
    faster than a million trigger runs and gives the same index content."""
    old = time.time() - 45 * DAY
    db = sqlite3.connect(path)
    db.execute("PRAGMA synchronous=OFF")
    db.execute("PRAGMA cache_size=-262144")
    (trigger,) = db.execute("SELECT sql FROM sqlite_master WHERE name='messages_fts_insert'").fetchone()
    per_session = max(1, messages // sessions)
    with db:
        db.execute("DROP TRIGGER messages_fts_insert")
        db.executemany(
            "INSERT INTO sessions(key, scope, channel, created_at, updated_at) VALUES (?,?,?,?,?)",
            ((f"telegram:dm:{s}", f"telegram:user:{s}", "telegram", old, old) for s in range(sessions)),
        )
        db.executemany(
            "INSERT INTO messages(session_key, turn, seq, role, content, created_at) VALUES (?,?,?,?,?,?)",
            (
                (f"telegram:dm:{i // per_session}", i % per_session // 2 + 1, i % per_session,
                 "user" if i % 2 == 0 else "assistant", f"message {i}: the weather in Porto is mild", old)
                for i in range(messages)
            ),
        )
        db.execute("INSERT INTO messages_fts(messages_fts) VALUES ('rebuild')")
        db.execute(trigger)
    db.close()


async def probe_stalls(stop: asyncio.Event, stalls: list[float]) -> None:
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        started = loop.time()
        await asyncio.sleep(PROBE_S)
        stalls.append(loop.time() - started - PROBE_S)


async def chat(store: Store, stop: asyncio.Event, latencies: list[float]) -> None:
    key = "web:bench"
    await store.ensure_session(key, "web:bench", "web")
    seq = 0
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        started = loop.time()
        await store.add_message(key, Message(role="user", content=f"hello {seq}", turn=seq // 2 + 1), seq=seq)
        latencies.append(loop.time() - started)
        seq += 1
        await asyncio.sleep(0.01)  # a busy chat: a hundred writes a second at most


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


async def main(messages: int, sessions: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "gateway.db"
        await (await Store.open(path)).close()  # schema
        started = time.monotonic()
        fill(path, messages, sessions)
        print(f"filled {messages:,} messages in {sessions:,} sessions in {time.monotonic() - started:.1f}s")

        store = await Store.open(path)
        stop = asyncio.Event()
        stalls: list[float] = []
        writes: list[float] = []
        probes = [asyncio.create_task(probe_stalls(stop, stalls)),
                  asyncio.create_task(chat(store, stop, writes))]
        report = await purge(store, Path(tmp) / "data", now=time.time(), session_retention_days=30,
                             tool_result_ttl_days=7, live_references=set)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*probes), timeout=10)
        await store.close()

    stalls.sort()
    writes.sort()
    print(f"purged: {report.line()}")
    print(f"total time        {report.seconds:.1f}s")
    print(f"longest stall     {ms(stalls[-1])}")
    print(f"p99 stall         {ms(stalls[int(len(stalls) * 0.99) - 1])}")
    print(f"stalls over 50 ms {sum(1 for s in stalls if s > 0.050)} of {len(stalls)} probes")
    print(f"chat writes       {len(writes)} completed; p50 {ms(statistics.median(writes))}, "
          f"p99 {ms(writes[int(len(writes) * 0.99) - 1])}, max {ms(writes[-1])}")
    print("goal (no stall over 50 ms):", "met" if stalls[-1] <= 0.050 else "MISSED")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--sessions", type=int, default=10_000)
    args = parser.parse_args()
    asyncio.run(main(args.messages, args.sessions))
