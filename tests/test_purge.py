"""The retention purge (SPEC §7): exactly what is past its time goes; memory stays."""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from gateway.config.schema import Config
from gateway.jobs.scheduler import JOB_PURGE, Scheduler
from gateway.memory.files import Memory
from gateway.memory.purge import purge
from gateway.store.sqlite import Store
from gateway.types import Message

NOW = datetime(2026, 11, 28, 12, 0, tzinfo=UTC)
DAY = 86_400.0


def ago(days: float) -> float:
    return (NOW - timedelta(days=days)).timestamp()


@pytest.fixture
def memory(tmp_path: Path, store: Store) -> Memory:
    return Memory(tmp_path / "data", tz=UTC, store=store, clock=lambda: NOW)


async def session(store: Store, key: str, scope: str, *, last_active_days: float, turns: int = 3) -> None:
    await store.ensure_session(key, scope, "telegram")
    for turn in range(1, turns + 1):
        when = ago(last_active_days + (turns - turn))
        await store.add_message(key, Message(role="user", content=f"{key} question {turn}", turn=turn,
                                             created_at=when), seq=2 * turn)
        await store.add_message(key, Message(role="assistant", content=f"{key} answer {turn}", turn=turn,
                                             created_at=when), seq=2 * turn + 1)
    await store.add_summary(key, scope, upto_turn=1, reason="turns", text=f"summary of {key}")


def aged(path: Path, text: str, days: float) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    os.utime(path, (ago(days), ago(days)))
    return path


async def event(store: Store, event_id: str, days: float) -> None:
    await store.record_event("telegram", event_id, session_key=None, inbound=None)
    await store.connection.execute("UPDATE events SET created_at=? WHERE event_id=?", (ago(days), event_id))
    await store.connection.commit()


async def test_purge_removes_exactly_what_is_past_retention(store: Store, memory: Memory) -> None:
    await session(store, "telegram:dm:old", "telegram:user:old", last_active_days=31)
    await session(store, "telegram:dm:recent", "telegram:user:recent", last_active_days=29)
    await event(store, "8-days", 8)
    await event(store, "6-days", 6)
    old_ws, recent_ws = memory.workspace("telegram:user:old"), memory.workspace("telegram:user:recent")
    stale = aged(old_ws / "tool_results" / "call_stale.txt", "old output", 8)
    referenced = aged(old_ws / "tool_results" / "call_live.txt", "still in a live context", 8)
    fresh = aged(recent_ws / "tool_results" / "call_fresh.txt", "new output", 6)
    keep = [
        aged(old_ws / "MEMORY.md", "- lasting fact", 400),
        aged(old_ws / "memory" / "2025-10-01.md", "# 2025-10-01\nnote", 400),
        aged(old_ws / "dialog" / "2025-10-01.jsonl", '{"turn": 1}\n', 400),
        aged(old_ws / "memory" / "backup" / "MEMORY-20251001T000000.md", "old", 400),
    ]

    report = await purge(store, memory.data_dir, now=NOW.timestamp(), session_retention_days=30,
                         tool_result_ttl_days=7, live_references=lambda: {referenced}, batch=2)

    # 6 of the expired session, and the turn of the active one older than 30 days (31 days)
    assert (report.sessions, report.messages, report.summaries, report.events, report.tool_results) == \
        (1, 8, 1, 1, 1)
    wal = Path(f"{store.path}-wal")
    assert not wal.exists() or wal.stat().st_size == 0  # checkpointed and truncated
    assert await store.get_session("telegram:dm:old") is None
    assert await store.count_messages("telegram:dm:old") == 0
    assert await store.latest_summary("telegram:dm:old") is None
    assert await store.get_session("telegram:dm:recent") is not None
    assert [m.turn for m in await store.messages("telegram:dm:recent")] == [2, 2, 3, 3]  # 30 and 29 days
    assert await store.latest_summary("telegram:dm:recent") is not None
    assert await store.event_status("telegram", "8-days") is None
    assert await store.event_status("telegram", "6-days") == "accepted"
    assert not stale.exists()
    assert referenced.exists() and fresh.exists()
    assert all(p.exists() for p in keep)


async def test_the_search_index_follows_the_purge(store: Store, memory: Memory) -> None:
    await session(store, "telegram:dm:old", "telegram:user:old", last_active_days=40, turns=4)
    await session(store, "telegram:dm:recent", "telegram:user:recent", last_active_days=1, turns=4)
    await purge(store, memory.data_dir, now=NOW.timestamp(), session_retention_days=30,
                tool_result_ttl_days=7, live_references=set)
    db = store.connection
    await db.execute("INSERT INTO messages_fts(messages_fts, rank) VALUES ('integrity-check', 1)")
    assert await memory.search("telegram:user:old", "telegram:dm:old", "question") == []
    hits = await memory.search("telegram:user:recent", "telegram:dm:recent", "question")
    assert hits and all(h.source.startswith("dialog turn") for h in hits)


async def test_a_session_active_again_is_kept(store: Store, memory: Memory) -> None:
    await session(store, "telegram:dm:back", "telegram:user:back", last_active_days=45)
    await store.add_message("telegram:dm:back", Message(role="user", content="I'm back", turn=4,
                                                         created_at=ago(0.1)), seq=20)
    report = await purge(store, memory.data_dir, now=NOW.timestamp(), session_retention_days=30,
                         tool_result_ttl_days=7, live_references=set)
    assert report.sessions == 0 and report.messages == 6  # the session stays; its old messages go
    assert [m.content for m in await store.messages("telegram:dm:back")] == ["I'm back"]
    assert await store.latest_summary("telegram:dm:back") is not None


async def test_the_scheduler_records_each_purge(store: Store, memory: Memory) -> None:
    await session(store, "telegram:dm:old", "telegram:user:old", last_active_days=31)
    seen: list[tuple[str, str]] = []
    sched = Scheduler(Config(timezone="UTC", session_retention_days=30), store=store, memory=memory,
                      model=None,  # type: ignore[arg-type]  (purge never calls the model)
                      live_references=set, clock=lambda: NOW,
                      metrics=lambda job, outcome: seen.append((job, outcome)))
    report = await sched.run_purge()
    assert report.sessions == 1 and report.messages == 6
    (run,) = await store.job_runs(JOB_PURGE)
    assert run.outcome == "ok" and run.detail is not None and "1 sessions, 6 messages" in run.detail
    assert seen == [(JOB_PURGE, "ok")]


async def test_files_people_sent_are_purged_with_their_messages(store: Store, memory: Memory,
                                                                tmp_path: Path) -> None:
    ws = memory.workspace("telegram:user:5")
    old = aged(ws / "files" / "photo_1.jpg", "old photo", 31)
    old_preview = aged(ws / "files" / "photo_1.preview.jpg", "its copy", 31)
    half_written = aged(ws / "files" / ".report.pdf.part", "left by a crash", 31)
    recent = aged(ws / "files" / "report.pdf", "recent file", 29)
    nested = aged(ws / "files" / "sub" / "deep.txt", "old, one level down", 40)
    outside = aged(tmp_path / "outside" / "precious.txt", "not the gateway's", 400)
    other = memory.workspace("telegram:user:6")
    other.mkdir(parents=True, exist_ok=True)
    if (other / "files").is_dir():
        (other / "files").rmdir()
    (other / "files").symlink_to(outside.parent)  # a planted link is never followed
    memory_file = aged(ws / "memory" / "2025-10-01.md", "# note", 400)

    report = await purge(store, memory.data_dir, now=NOW.timestamp(), session_retention_days=30,
                         tool_result_ttl_days=7, live_references=set)

    assert report.files == 4
    assert not any(p.exists() for p in (old, old_preview, half_written, nested))
    assert recent.exists() and outside.exists() and memory_file.exists()
    assert "4 sent files" in report.line()
