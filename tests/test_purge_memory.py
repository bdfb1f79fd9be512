"""Nothing leaves the database before it reached long-term memory (SPEC §7): the purge
first summarizes into the daily note and archives to dialog/ the turns no summary covers
yet — a quiet chat that never reached a trim — through the running gateway, with the
model answering or down."""

from __future__ import annotations

import json
import time
from typing import Any

from gateway.app import Gateway
from gateway.store.sqlite import Store
from tests.conftest import GatewayFactory, chat
from tests.fakes.openai_server import ErrorReply, FakeModel
from tests.test_e2e_context import chat_requests, is_summary_request, user_texts
from tests.test_e2e_long_term_memory import scope_files

DAY = 86_400.0
QUIET_SUMMARY = "## Goal\n- plan the kumquat harvest\n\n## Critical Context\n- orchard row 7"


async def age(gw: Gateway, key: str, days: float, *, turns: tuple[int, int] | None = None) -> None:
    """Move a session's messages (all, or those of turns [first, last]) `days` back, and
    the session's last activity with them when all of it moved."""
    assert gw.services is not None
    store = gw.services.store
    assert isinstance(store, Store)
    when = time.time() - days * DAY
    db = store.connection
    if turns is None:
        await db.execute("UPDATE messages SET created_at=? WHERE session_key=?", (when, key))
        await db.execute("UPDATE sessions SET updated_at=? WHERE key=?", (when, key))
    else:
        await db.execute("UPDATE messages SET created_at=? WHERE session_key=? AND turn BETWEEN ? AND ?",
                         (when, key, *turns))
    await db.commit()


async def quiet_chat(gw: Gateway, fake: FakeModel, key: str) -> None:
    """Three turns, one with a tool call: far below any trim, so no summary is ever asked."""
    fake.reply("Row 7 ripens first.")
    await chat(gw, key, "when do the kumquats in row 7 ripen?")
    fake.tool_call("current_time", {})
    fake.reply("It is harvest week.")
    await chat(gw, key, "what week is it?")
    fake.reply("Noted.")
    await chat(gw, key, "remember the crates are blue")


def summarizes(fake: FakeModel, text: str | ErrorReply) -> None:
    fake.respond_with(lambda body: text if is_summary_request(body) else None)


async def scope_of(gw: Gateway, key: str) -> str:
    assert gw.services is not None
    row = await gw.services.store.get_session(key)
    assert row is not None
    return row.scope


def files_of(gw: Gateway, scope: str) -> tuple[str, list[dict[str, Any]]]:
    """Today's daily note and dialog archive of a scope (its session may be gone)."""
    assert gw.services is not None and gw.services.memory is not None
    memory = gw.services.memory
    root, day = memory.workspace(scope), memory.today()
    note, dialog = root / "memory" / f"{day}.md", root / "dialog" / f"{day}.jsonl"
    rows = [json.loads(line) for line in dialog.read_text(encoding="utf-8").splitlines()] if dialog.exists() else []
    return (note.read_text(encoding="utf-8") if note.exists() else ""), rows


async def purged(gw: Gateway) -> Any:
    assert gw.scheduler is not None
    assert await gw.scheduler.wait_idle(15)  # the start's own purge is done
    return await gw.scheduler.run_purge()


async def test_a_quiet_chat_past_retention_is_summarized_and_archived_before_it_is_purged(
        make_gateway: GatewayFactory, fake_model: FakeModel) -> None:
    gw = await make_gateway()
    await quiet_chat(gw, fake_model, "quiet")
    assert gw.services is not None
    assert await gw.services.store.latest_summary("web:quiet") is None  # it never trimmed
    await age(gw, "web:quiet", 40)
    summarizes(fake_model, QUIET_SUMMARY)
    scope = await scope_of(gw, "web:quiet")

    report = await purged(gw)

    assert report.sessions == 1 and report.remembered == 1 and report.messages == 8
    assert "1 summarized into memory first" in report.line()
    assert await gw.services.store.count_messages("web:quiet") == 0
    assert await gw.services.store.get_session("web:quiet") is None
    note, rows = files_of(gw, scope)
    assert "web:quiet, turns 1–3 (purge)" in note and "plan the kumquat harvest" in note
    # The raw turns, the tool call and its result included, in the dialog archive.
    assert [(r["turn"], r["role"]) for r in rows] == [
        (1, "user"), (1, "assistant"), (2, "user"), (2, "assistant"), (2, "tool"), (2, "assistant"),
        (3, "user"), (3, "assistant")]
    assert rows[0]["content"] == "when do the kumquats in row 7 ripen?"
    # memory_search still finds what was said (the daily note is indexed; dialog/ is read).
    memory = gw.services.memory
    assert memory is not None
    hits = await memory.search(scope, "web:quiet", "kumquat harvest")
    assert hits and all(h.source.startswith("memory/") for h in hits)
    [summary_request] = [r for r in fake_model.requests if is_summary_request(r)]
    assert "remember the crates are blue" in summary_request["messages"][-1]["content"]


async def test_with_the_model_down_the_purge_archives_raw_turns_and_writes_the_extractive_note(
        make_gateway: GatewayFactory, fake_model: FakeModel) -> None:
    gw = await make_gateway()
    await quiet_chat(gw, fake_model, "down")
    await age(gw, "web:down", 40)
    summarizes(fake_model, ErrorReply(503, {"error": {"message": "overloaded", "type": "server_error"}}))
    scope = await scope_of(gw, "web:down")

    report = await purged(gw)

    assert report.sessions == 1 and report.remembered == 1
    note, rows = files_of(gw, scope)
    assert "Notes on turns 1–3 (extracted" in note
    assert "the user wrote “remember the crates are blue”" in note
    assert len(rows) == 8 and rows[-1]["content"] == "Noted."
    assert gw.services is not None and gw.services.memory is not None
    assert await gw.services.memory.search(scope, "web:down", "crates")


async def test_the_old_turns_of_a_chat_still_in_use_reach_memory_before_they_go(
        make_gateway: GatewayFactory, fake_model: FakeModel) -> None:
    """A chat under the turn limit for over 30 days: its first turns pass the retention
    while the session is active, and were never summarized."""
    gw = await make_gateway(agent_max_context_turns=4)
    await quiet_chat(gw, fake_model, "slow")  # turns 1-3; turn 3 asked for the summary of 1-2
    assert gw.services is not None
    await gw.services.background.wait_idle(10)
    fake_model.requests.clear()
    await age(gw, "web:slow", 40, turns=(1, 1))
    summarizes(fake_model, QUIET_SUMMARY)
    store = gw.services.store
    await store.run("DELETE FROM summaries WHERE session_key=?", ("web:slow",))  # as if never summarized

    report = await purged(gw)

    assert report.sessions == 0 and report.remembered == 1 and report.messages == 2
    assert [m.turn for m in await store.messages("web:slow")] == [2, 2, 2, 2, 3, 3]
    latest = await store.latest_summary("web:slow")
    assert latest is not None and latest.upto_turn == 1 and latest.reason == "purge"
    note, rows = await scope_files(gw, "web:slow")
    assert "web:slow, turn 1 (purge)" in note
    assert any(r["content"] == "when do the kumquats in row 7 ripen?" for r in rows)


async def test_a_summary_the_purge_made_reaches_the_live_context(
        make_gateway: GatewayFactory, fake_model: FakeModel) -> None:
    """The purge took turns 1-2 into memory before the engine asked for them: the fold the
    engine asks for finds them covered and hands that summary to the live context, which
    injects it when they leave."""
    gw = await make_gateway(agent_max_context_turns=4)
    fake_model.reply("first")
    await chat(gw, "live", "turn one about kumquats")
    fake_model.reply("second")
    await chat(gw, "live", "turn two about crates")
    await age(gw, "web:live", 40, turns=(1, 2))
    summarizes(fake_model, QUIET_SUMMARY)
    await chat(gw, "other", "a newer message elsewhere")  # the old front of the table ends here
    report = await purged(gw)
    assert report.remembered == 1
    for n in (3, 4, 5):  # turn 3 asks for 1-2 (covered); turn 5 drops them
        await chat(gw, "live", f"turn {n}")
        assert gw.services is not None
        await gw.services.background.wait_idle(10)
    last = chat_requests(fake_model)[-1]
    first = user_texts(last)[0]
    assert "plan the kumquat harvest" in first and first.endswith("turn 3")
