"""The store's one-statement turn bookkeeping (migration 3's triggers) on a real database:
SQLite and PostgreSQL alike (the `make_store` fixture runs each test on both)."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import asyncpg
import pytest

from gateway.config.schema import Config
from gateway.store.errors import StoreConflict, StoreFull
from gateway.store.sqlite import Store
from gateway.turns.usage import Usage, today
from gateway.types import Message
from tests.conftest import StoreFactory


async def test_a_stored_user_message_marks_its_event_running_with_the_turn(make_store: StoreFactory) -> None:
    store = await make_store()
    await store.ensure_session("web:ann", "web:ann", "web")
    assert await store.record_event("web", "e1", session_key="web:ann", inbound={"text": "hi"})

    await store.add_message("web:ann", Message(role="user", content="hi", turn=7), seq=0, event=("web", "e1"))
    await store.add_message("web:ann", Message(role="assistant", content="hello", turn=7), seq=1)
    pending = await store.pending_events()
    await store.close()

    assert [(e.event_id, e.status, e.turn) for e in pending] == [("e1", "running", 7)]


async def test_end_turn_sets_the_status_and_counts_usage_once_per_turn(make_store: StoreFactory) -> None:
    cfg = Config()
    store = await make_store()
    for event in ("e1", "e2", "e3"):
        await store.record_event("web", event, session_key="web:ann", inbound={"text": event})

    await store.end_turn("web", "e1", "answered", usage=("web:ann", today(cfg), 120))
    await store.end_turn("web", "e2", "undelivered", usage=("web:ann", today(cfg), 30))
    await store.end_turn("web", "e3", "answered")  # usage off: the status alone
    statuses = [await store.event_status("web", e) for e in ("e1", "e2", "e3")]
    counted = await Usage(store).get(cfg, "web:ann")
    await store.close()

    assert statuses == ["answered", "undelivered", "answered"]
    assert counted == (2, 150)


# -- group commit (gateway/store/group_commit.py) ---------------------------------------------


async def test_concurrent_messages_share_commits_and_each_caller_gets_its_own_row(make_store: StoreFactory) -> None:
    store = await make_store()
    keys = [f"web:u{i}" for i in range(40)]
    for key in keys:
        await store.ensure_session(key, key, "web")

    stored = await asyncio.gather(*(
        store.add_message(key, Message(role="user", content=f"hello from {key}", turn=1), seq=0) for key in keys
    ))
    flushes = store._messages.flushes
    by_id = {row[0]: row[1] for row in await store.run("SELECT id, content FROM messages")}
    await store.close()

    assert flushes < len(keys)  # rows went together
    assert len(by_id) == len(keys)
    for key, msg in zip(keys, stored, strict=True):
        assert msg.id is not None and by_id[msg.id] == f"hello from {key}"


async def test_rows_of_one_session_keep_their_order_across_commits(make_store: StoreFactory) -> None:
    store = await make_store()
    await store.ensure_session("web:ann", "web:ann", "web")
    await store.ensure_session("web:bob", "web:bob", "web")

    # Queued before any commit ran: one session's rows cannot share a batch, so they take
    # successive commits in the order they came.
    writes = [store.add_message(key, Message(role="user", content=f"{key} {n}", turn=n), seq=0)
              for n in range(1, 6) for key in ("web:ann", "web:bob")]
    stored = await asyncio.gather(*writes)
    ann = await store.messages("web:ann")
    await store.close()

    assert [m.content for m in ann] == [f"web:ann {n}" for n in range(1, 6)]
    ann_ids = [m.id for m in stored if m.content.startswith("web:ann")]
    assert ann_ids == sorted(set(ann_ids))  # distinct rows, in order


async def test_one_bad_row_fails_alone_and_its_neighbours_are_stored(make_store: StoreFactory) -> None:
    store = await make_store()
    good = [store.add_message(f"web:u{i}", Message(role="user", content=f"fine {i}", turn=1), seq=0)
            for i in range(5)]
    # NOT NULL on messages.content: the database refuses this row.
    bad = store.add_message("web:bad", Message(role="user", content=None, turn=1), seq=0)  # type: ignore[arg-type]
    results = await asyncio.gather(*good, bad, return_exceptions=True)
    counted = await store.count_messages()
    await store.close()

    assert all(isinstance(r, Message) for r in results[:5])
    assert isinstance(results[5], StoreConflict)  # the driver's own error, named alike on both backends
    assert isinstance(results[5].__cause__, (sqlite3.IntegrityError, asyncpg.NotNullViolationError))
    assert counted == 5


async def test_a_redelivered_event_in_the_same_batch_is_fresh_only_once(make_store: StoreFactory) -> None:
    store = await make_store()
    answers = await asyncio.gather(*(
        store.record_event("slack", event, session_key=None, inbound=None)
        for event in ("e1", "e2", "e1", "e3", "e1")
    ))
    await store.close()

    assert answers == [True, True, False, True, False]


async def test_a_cancelled_writer_still_gets_its_row_stored_and_close_waits_for_it(make_store: StoreFactory) -> None:
    store = await make_store()
    others = [asyncio.ensure_future(store.add_message(f"web:u{i}", Message(role="user", content="x", turn=1),
                                                      seq=0)) for i in range(10)]
    cancelled = asyncio.ensure_future(
        store.add_message("web:gone", Message(role="user", content="kept", turn=1), seq=0))
    await asyncio.sleep(0)  # queued, not yet committed
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    await asyncio.gather(*others)
    await store.close()  # drains whatever is still queued

    reopened = await make_store()
    kept = await reopened.messages("web:gone")
    await reopened.close()
    assert [m.content for m in kept] == ["kept"]


# -- WAL checkpoints off the chat's connection (gateway/store/checkpoints.py) ------------------


async def test_checkpoints_run_on_their_own_connection_and_keep_the_wal_bounded(tmp_path: Path) -> None:
    path = tmp_path / "gateway.db"
    store = await Store.open(path, checkpoint_interval_s=3600)  # the timer stays out of the way
    own = await store.run("PRAGMA wal_autocheckpoint")
    checkpointer = store._checkpointer
    assert checkpointer is not None

    async def write(batch: int) -> None:
        await asyncio.gather(*(store.add_message(f"web:u{batch}-{i}", Message(role="user", content="x" * 500,
                                                                              turn=1), seq=0) for i in range(100)))

    await write(1)
    await checkpointer.checkpoint_once()  # under the size limit: PASSIVE only
    copied, folds = checkpointer.wal_copied, checkpointer.folds
    await write(2)
    checkpointer.max_wal_bytes = 1  # over the limit: the WAL is restarted from the store's connection
    await checkpointer.checkpoint_once()
    await write(3)
    await store.close()

    assert own[0][0] == 0  # the chat's connection never checkpoints inside a commit
    assert copied > 0 and folds == 0
    assert checkpointer.folds == 1
    reopened = await Store.open(path, checkpoint_interval_s=None)
    assert await reopened.count_messages() == 300
    await reopened.close()


async def test_without_the_checkpointer_sqlite_checkpoints_as_usual(tmp_path: Path) -> None:
    store = await Store.open(tmp_path / "gateway.db", checkpoint_interval_s=None)
    own = await store.run("PRAGMA wal_autocheckpoint")
    await store.close()

    assert own[0][0] == 1000 and store._checkpointer is None


async def test_an_idle_store_makes_no_checkpoint_calls(tmp_path: Path) -> None:
    store = await Store.open(tmp_path / "gateway.db", checkpoint_interval_s=0.01)
    checkpointer = store._checkpointer
    assert checkpointer is not None
    await store.add_message("web:ann", Message(role="user", content="hello", turn=1), seq=0)
    async with asyncio.timeout(5):
        while checkpointer.runs == 0:  # noqa: ASYNC110 - the checkpointer runs on a timer
            await asyncio.sleep(0.01)
    ran = checkpointer.runs
    await asyncio.sleep(0.2)  # twenty timer ticks with nothing written
    idle_runs = checkpointer.runs - ran
    await store.add_message("web:ann", Message(role="assistant", content="hi", turn=1), seq=1)
    async with asyncio.timeout(5):
        while checkpointer.runs == ran + idle_runs:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    await store.close()

    assert idle_runs <= 1  # at most the one already due when the first write was seen


async def test_a_failed_write_counts_until_a_write_succeeds(store: Store) -> None:
    """/readyz reads `write_problem`: storage failures count, constraint errors do not."""
    await store.run("CREATE TABLE probe(x UNIQUE)")
    await store.run("INSERT INTO probe VALUES (1)")
    with pytest.raises(StoreConflict):
        await store.run("INSERT INTO probe VALUES (1)")
    assert await store.write_problem() is None

    pages = (await store.run("PRAGMA page_count"))[0][0]
    await store.run(f"PRAGMA max_page_count={pages}")  # a full disk, as in test_reliability_disk
    with pytest.raises(StoreFull, match="full"):
        await store.run("INSERT INTO probe VALUES (zeroblob(1000000))")
    assert await store.run("SELECT count(*) FROM probe")  # a read succeeds and changes nothing
    problem = await store.write_problem()
    assert problem is not None and problem.startswith("store: cannot write:") and "full" in problem

    await store.run("PRAGMA max_page_count=1073741823")
    await store.run("INSERT INTO probe VALUES (2)")
    assert await store.write_problem() is None
