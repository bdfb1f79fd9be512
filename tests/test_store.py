"""The store's one-statement turn bookkeeping (migration 3's triggers) on a real database."""

from __future__ import annotations

from pathlib import Path

from gateway.config import Config
from gateway.store import Store
from gateway.types import Message
from gateway.usage import Usage, today


async def test_a_stored_user_message_marks_its_event_running_with_the_turn(tmp_path: Path) -> None:
    store = await Store.open(tmp_path / "gateway.db")
    await store.ensure_session("web:ann", "web:ann", "web")
    assert await store.record_event("web", "e1", session_key="web:ann", inbound={"text": "hi"})

    await store.add_message("web:ann", Message(role="user", content="hi", turn=7), seq=0, event=("web", "e1"))
    await store.add_message("web:ann", Message(role="assistant", content="hello", turn=7), seq=1)
    pending = await store.pending_events()
    await store.close()

    assert [(e.event_id, e.status, e.turn) for e in pending] == [("e1", "running", 7)]


async def test_end_turn_sets_the_status_and_counts_usage_once_per_turn(tmp_path: Path) -> None:
    cfg = Config()
    store = await Store.open(tmp_path / "gateway.db")
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
