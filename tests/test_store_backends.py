"""`store.url`: the gateway on SQLite and on PostgreSQL alike (a throw-away server from
tests/pg.py): web chats, a restart that restores the sessions, memory_search over stored
messages and memory notes, the purge's statements, and the URL as a secret."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from gateway.app import Gateway
from gateway.config.checks import startup_problems
from gateway.config.load import ConfigError, load_config, parse_config
from gateway.config.schema import Config
from gateway.memory.purge import purge
from gateway.store.postgres import PgStore, to_postgres
from gateway.store.sqlite import Store
from gateway.types import Message
from tests.conftest import StoreFactory, chat, write_config
from tests.fakes.openai_server import FakeModel


async def _start(tmp_path: Path, fake: FakeModel, store_url: str | None) -> Gateway:
    path = write_config(tmp_path, fake, store={"url": store_url})
    gw = Gateway(load_config(path), config_path=path)
    await gw.start()
    return gw


async def test_a_gateway_chats_restarts_and_searches_on_its_configured_store(
        tmp_path: Path, fake_model: FakeModel, store_url: str | None, store_backend: str) -> None:
    gw = await _start(tmp_path, fake_model, store_url)
    try:
        assert gw.services is not None
        assert isinstance(gw.services.store, PgStore if store_backend == "postgres" else Store)
        fake_model.reply("Noted: the zebra is called Ziggy.")
        assert await chat(gw, "ann", "remember: my zebra is called Ziggy") == "Noted: the zebra is called Ziggy."
        fake_model.reply("Sure.")
        await chat(gw, "ann", "and my cat is Tom")
    finally:
        await gw.stop(timeout=5)

    gw = await _start(tmp_path, fake_model, store_url)  # a restart: the session comes back from the store
    try:
        assert gw.services is not None and gw.services.memory is not None
        root = gw.services.memory.workspace("web:ann")
        (root / "MEMORY.md").write_text("## Pets\n\nThe zebra lives in the garden.\n", encoding="utf-8")
        fake_model.tool_call("memory_search", {"query": "zebra", "limit": 10})
        fake_model.reply("Ziggy, in the garden.")
        assert await chat(gw, "ann", "what is my zebra called?") == "Ziggy, in the garden."
        stored = await gw.services.store.messages("web:ann")
        history = [m["content"] for m in fake_model.requests[-2]["messages"] if m["role"] == "user"]
    finally:
        await gw.stop(timeout=5)

    assert history[:2] == ["remember: my zebra is called Ziggy", "and my cat is Tom"]  # restored
    assert [m.turn for m in stored if m.role == "user"] == [1, 2, 3]
    (found,) = [m.content for m in stored if m.role == "tool"]
    assert "dialog turn 1" in found and "Ziggy" in found  # the stored message
    assert "MEMORY.md" in found and "garden" in found  # the memory note
    assert "cat is Tom" not in found


async def test_search_matches_substrings_case_insensitively_and_cjk(make_store: StoreFactory) -> None:
    store = await make_store()
    await store.ensure_session("web:ann", "web:ann", "web")
    texts = ["We saw a ZEBRA crossing", "苹果香蕉很好吃", "nothing here", "zebra and giraffe together"]
    for turn, text in enumerate(texts, start=1):
        await store.add_message("web:ann", Message(role="user", content=text, turn=turn), seq=0)
    await store.add_message("web:ann", Message(role="user", content="now", turn=9), seq=0)

    zebra = await store.search_session_messages("web:ann", match='"zebra" OR "giraffe"', phrases=("zebra", "giraffe"),
                                                short_terms=(), limit=10)
    cjk = await store.search_session_messages("web:ann", match='"果香蕉"', phrases=("果香蕉",), short_terms=(),
                                              limit=10)
    short = await store.search_session_messages("web:ann", match=None, phrases=(), short_terms=("苹果",), limit=10)

    assert zebra[0][1] == 4  # both phrases: ranked first
    assert sorted(r[1] for r in zebra) == [1, 4]
    assert [r[1] for r in cjk] == [2] and [r[1] for r in short] == [2]


async def test_search_results_name_who_wrote_a_message_no_person_wrote(make_store: StoreFactory) -> None:
    store = await make_store()
    await store.ensure_session("web:ann", "web:ann", "web")
    rows = [Message(role="user", content="deploy of release 7 finished", turn=1, origin="hook:deploys"),
            Message(role="assistant", content="release 7 is live", turn=1),
            Message(role="user", content="[Scheduled task ab12: check release 7]", turn=2, origin="task"),
            Message(role="user", content="now", turn=3)]
    for seq, msg in enumerate(rows):
        await store.add_message("web:ann", msg, seq=seq)
    for kwargs in ({"match": '"release"', "phrases": ("release",), "short_terms": ()},
                   {"match": None, "phrases": (), "short_terms": ("7",)}):
        found = await store.search_session_messages("web:ann", limit=10, **kwargs)
        assert sorted(r[2] for r in found) == ["assistant", "user (hook:deploys)", "user (task)"], kwargs


async def test_the_chat_history_keeps_people_and_final_replies_only(make_store: StoreFactory) -> None:
    store = await make_store()
    await store.ensure_session("web:ann", "web:ann", "web")
    rows = [Message(role="user", content="hello", turn=1),
            Message(role="assistant", content="hi there", turn=1),
            Message(role="user", content="[Scheduled task ab12 is due now]", turn=2, origin="task"),
            Message(role="assistant", content="time to stretch", turn=2),
            Message(role="user", content="injected summary", turn=3, injected=True)]
    for seq, msg in enumerate(rows):
        await store.add_message("web:ann", msg, seq=seq)
    history = await store.chat_history("web:ann", limit=10)
    assert [(m.role, m.content) for m in history] == [
        ("user", "hello"), ("assistant", "hi there"), ("assistant", "time to stretch")]
    stored = await store.messages("web:ann")
    assert [m.origin for m in stored] == [None, None, "task", None, None]


async def test_purge_deletes_expired_sessions_on_either_backend(make_store: StoreFactory, tmp_path: Path) -> None:
    store = await make_store()
    for key in ("web:old", "web:new"):
        await store.ensure_session(key, key, "web")
        await store.add_message(key, Message(role="user", content="hi", turn=1, created_at=time.time()), seq=0)
    await store.run("UPDATE sessions SET updated_at=? WHERE key=?", (time.time() - 90 * 86400, "web:old"))
    await store.run("UPDATE messages SET created_at=? WHERE session_key=?", (time.time() - 90 * 86400, "web:old"))

    report = await purge(store, tmp_path, now=time.time(), session_retention_days=30, tool_result_ttl_days=7,
                         live_references=set, batch=1)

    assert report.sessions == 1 and report.messages == 1
    assert await store.get_session("web:old") is None and await store.count_messages("web:old") == 0
    assert await store.count_messages("web:new") == 1
    assert await store.write_problem() is None


def test_store_url_is_a_secret_with_env_expansion() -> None:
    raw = json.dumps({"store": {"url": "postgresql://gw:${PG_TEST_PASSWORD_X}@db/gw"}})
    unset = parse_config(json.loads(raw), environ={})
    assert "store.url: the environment variable PG_TEST_PASSWORD_X is not set" in " ".join(
        startup_problems(unset, channels=False, http=False))
    cfg = parse_config(json.loads(raw), environ={"PG_TEST_PASSWORD_X": "s3cret"})
    assert cfg.store.url is not None and cfg.store.url.get_secret_value() == "postgresql://gw:s3cret@db/gw"
    assert "s3cret" not in repr(cfg.store)
    assert Config().store.url is None
    with pytest.raises(ConfigError, match="sqlite:///"):
        parse_config({"store": {"url": "mysql://x"}}, environ={})


def test_placeholders_are_numbered_for_postgres() -> None:
    assert to_postgres("SELECT ?, ? WHERE a = ANY(?::text[])") == "SELECT $1, $2 WHERE a = ANY($3::text[])"


async def test_text_a_backend_cannot_hold_is_stored_as_replacement_characters(make_store: StoreFactory,
                                                                              store_backend: str) -> None:
    """A tool result, a file or a model's answer can carry NUL (PostgreSQL's TEXT cannot
    hold it) or a lone surrogate from a JSON escape (not UTF-8 at all): the write succeeds,
    with U+FFFD in their place where the backend needs it."""
    store = await make_store()
    await store.ensure_session("web:ann", "web:ann", "web")
    fetched = "page\x00with a NUL byte"
    await store.add_message("web:ann", Message(role="user", content="fetch it", turn=1), seq=0)
    await store.add_message("web:ann", Message(role="tool", content=fetched, turn=1, tool_call_id="c1",
                                               tool_name="web_fetch"), seq=1)
    await store.add_message("web:ann", Message(role="assistant", content="odd \ud83d text", turn=1), seq=2)
    await store.add_summary("web:ann", "web:ann", upto_turn=1, reason="overflow", text="sum\x00mary")
    await store.run_many("INSERT INTO memory_chunks(scope, path, date, content) VALUES (?,?,?,?)",
                         [("web:ann", "memory/x.md", "2026-01-01", "note\x00 with \udc80 both")])
    await store.add_message("web:ann", Message(role="user", content="next", turn=2), seq=0)

    stored = [m.content for m in await store.messages("web:ann")]
    summary = await store.latest_summary("web:ann")
    chunk = (await store.run("SELECT content FROM memory_chunks"))[0][0]
    if store_backend == "postgres":
        assert stored[1] == "page\ufffdwith a NUL byte" and summary.text == "sum\ufffdmary"  # type: ignore[union-attr]
        assert chunk == "note\ufffd with \ufffd both"
    else:  # SQLite keeps NUL as it is
        assert stored[1] == fetched and summary.text == "sum\x00mary"  # type: ignore[union-attr]
        assert chunk == "note\x00 with \ufffd both"
    assert stored[2] == "odd \ufffd text"
    found = await store.search_session_messages("web:ann", match='"page"', phrases=("page",), short_terms=(),
                                                limit=5)
    assert [(r[1], r[2]) for r in found] == [(1, "tool")]


async def test_the_chat_history_is_read_in_pages_of_bounded_size(make_store: StoreFactory) -> None:
    store = await make_store()
    await store.ensure_session("web:big", "web:big", "web")
    texts = []
    for turn in range(1, 31):  # 60 shown messages of 20,000 characters: 1.2 MB in all
        for seq, role in enumerate(("user", "assistant")):
            text = f"{role} {turn} " + chr(ord("a") + turn % 26) * 20_000
            texts.append(text)
            await store.add_message("web:big", Message(role=role, content=text, turn=turn), seq=seq)
        await store.add_message("web:big", Message(role="tool", content="x" * 50_000, turn=turn, tool_call_id="c",
                                                   tool_name="read_file"), seq=5)  # never shown, never read
    pages = []
    before = None
    while True:
        page = await store.chat_history_page("web:big", limit=200, before=before, max_chars=100_000)
        assert sum(len(m.content) for m in page.messages) <= 100_000
        pages.append([m.content for m in page.messages])
        if page.older is None:
            break
        before = page.older
    assert len(pages) == 15 and all(len(p) == 4 for p in pages)  # 4 × 20,000 characters fit in each
    assert [text for p in reversed(pages) for text in p] == texts  # all of it, in order, once
    assert [m.content for m in await store.chat_history("web:big", limit=3)] == texts[-3:]
    # A message longer than a page still comes, alone, so a reader always gets on.
    lone = await store.chat_history_page("web:big", limit=5, max_chars=1000)
    assert [m.content for m in lone.messages] == texts[-1:] and lone.older is not None


async def test_command_answers_take_their_places_in_the_history_pages(make_store: StoreFactory) -> None:
    """The web page's history with the commands' answers (SQLite's migration 11), on both
    backends: each after the turn it followed, paged by the same cursor, purged with age."""
    from gateway.store.rows import CommandAnswer

    store = await make_store()
    key = "web:cmd"
    await store.ensure_session(key, key, "web")
    await store.add_command_answer(key, "/help", "commands…")  # before any turn: turn 0
    expected: list[str] = ["/help"]
    for turn in range(1, 4):
        for seq, role in enumerate(("user", "assistant")):
            await store.add_message(key, Message(role=role, content=f"{role} {turn}", turn=turn), seq=seq)
            expected.append(f"{role} {turn}")
        await store.add_command_answer(key, f"/context {turn}", "stats", fresh_context=turn == 2)
        expected.append(f"/context {turn}")
    await store.add_message(key, Message(role="user", content="user 4", turn=4), seq=0)
    expected.append("user 4")

    def label(entry: Message | CommandAnswer) -> str:
        return entry.command if isinstance(entry, CommandAnswer) else entry.content

    whole = await store.conversation_page(key, limit=50)
    assert [label(e) for e in whole.entries] == expected and whole.older is None
    fresh = [e for e in whole.entries if isinstance(e, CommandAnswer) and e.fresh_context]
    assert [(e.command, e.turn) for e in fresh] == [("/context 2", 2)]
    pages: list[list[str]] = []
    before = None
    while True:
        page = await store.conversation_page(key, limit=3, before=before)
        pages.insert(0, [label(e) for e in page.entries])
        if page.older is None:
            break
        before = page.older
    assert [text for page in pages for text in page] == expected
    # Sizes bound a page as they do the messages'.
    big = await store.conversation_page(key, limit=50, max_chars=20)
    assert len(big.entries) < len(expected) and big.older is not None
    # Never among the messages the context and restore read.
    assert all(m.content != "stats" for m in await store.messages(key))
    assert await store.delete_command_answers_before(time.time() + 1, limit=2) == 2
    assert await store.delete_command_answers_before(time.time() + 1, limit=10) == 2
    assert [label(e) for e in (await store.conversation_page(key, limit=50)).entries] == [
        e for e in expected if not e.startswith("/")]
