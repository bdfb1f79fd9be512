"""Long-term memory per scope: files, search, isolation, and the memory tools."""

from __future__ import annotations

import asyncio
import json
import os
from datetime import UTC, datetime
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from gateway.config.schema import Config
from gateway.memory.files import Memory, parse_query
from gateway.store.sqlite import Store
from gateway.tools.base import ToolContext, ToolError
from gateway.tools.memory_search import MemorySearch
from gateway.tools.memory_write import MemoryWrite
from gateway.types import Message
from gateway.workspace import PathNotAllowed
from tests.conftest import Clock

ALICE = ("telegram:dm:1", "telegram:user:1")
BOB = ("telegram:dm:2", "telegram:user:2")
GROUP = ("telegram:group:-100", "telegram:group:-100")


@pytest.fixture
def clock() -> Clock:
    return Clock(datetime(2026, 11, 28, 10, 0, tzinfo=UTC))


@pytest.fixture
def memory(tmp_path: Path, store: Store, clock: Clock) -> Memory:
    return Memory(tmp_path / "data", tz=UTC, store=store, clock=clock)


def words(text: str) -> int:
    return len(text.split())


EARLIER = datetime(2026, 11, 27, 9, 0, tzinfo=UTC).timestamp()


async def say(store: Store, who: tuple[str, str], turn: int, user: str, reply: str) -> None:
    key, scope = who
    await store.ensure_session(key, scope, "telegram")
    for seq, (role, text) in enumerate((("user", user), ("assistant", reply))):
        msg = Message(role=role, content=text, turn=turn, created_at=EARLIER)  # type: ignore[arg-type]
        await store.add_message(key, msg, seq=turn * 10 + seq)


def ctx_for(who: tuple[str, str], memory: Memory, store: Store) -> ToolContext:
    key, scope = who
    return ToolContext(session_key=key, scope=scope, workspace=memory.workspace(scope), config=Config(),
                       memory=memory)


# -- files ---------------------------------------------------------------------------------


async def test_daily_note_is_dated_in_the_configured_zone_and_appended(
    memory: Memory, clock: Clock, store: Store, tmp_path: Path
) -> None:
    path = await memory.append_daily("s", "first fact", heading="Summary of turns 1-4")
    await memory.append_daily("s", "second fact")
    assert path.name == "2026-11-28.md"
    text = path.read_text()
    assert text.startswith("# 2026-11-28\n")
    assert "## Summary of turns 1-4\n\nfirst fact" in text
    assert text.index("first fact") < text.index("second fact")
    clock.now = datetime(2026, 11, 28, 23, 30, tzinfo=UTC)
    tokyo = Memory(tmp_path / "data", tz=ZoneInfo("Asia/Tokyo"), store=store, clock=clock)
    assert (await tokyo.append_daily("s", "late")).name == "2026-11-29.md"


async def test_concurrent_writes_to_one_scope_all_land(memory: Memory) -> None:
    await asyncio.gather(*(memory.append_daily("s", f"fact number {i}") for i in range(25)))
    text = (memory.workspace("s") / "memory" / "2026-11-28.md").read_text()
    assert all(f"fact number {i}\n" in text for i in range(25))


async def test_memory_md_is_capped_on_a_line_with_a_notice_and_cached(memory: Memory) -> None:
    assert await memory.read_memory_md("s", max_tokens=100, count=words) == ""
    lines = [f"line {i} about something worth keeping" for i in range(60)]
    await memory.append_memory_md("s", "\n".join(lines))
    text = await memory.read_memory_md("s", max_tokens=100, count=words)
    assert words(text) <= 100
    assert text.startswith("line 0 about")
    assert "MEMORY.md" in text and "read_file" in text
    kept = [line for line in text.splitlines() if line.startswith("line ")]
    assert kept == lines[: len(kept)] and 0 < len(kept) < 60
    assert f"start_line={len(kept) + 1}" in text
    # Byte-identical until the file changes (prompt caches keep hitting).
    assert await memory.read_memory_md("s", max_tokens=100, count=words) is text
    await memory.append_memory_md("s", "new lasting preference")
    again = await memory.read_memory_md("s", max_tokens=10_000, count=words)
    assert again.rstrip().endswith("new lasting preference")


async def test_dialog_archive_is_jsonl_and_repairs_a_torn_line(memory: Memory) -> None:
    rows = [{"session_key": "k", "turn": 1, "role": "user", "content": "héllo\nworld"}]
    path = await memory.archive_dialog("s", rows)
    with path.open("a") as fh:
        fh.write('{"torn": ')  # a crash mid-append
    await memory.archive_dialog("s", [{"turn": 2, "role": "assistant", "content": "ok"}])
    lines = path.read_text().splitlines()
    assert path.name == "2026-11-28.jsonl"
    assert json.loads(lines[0])["content"] == "héllo\nworld"
    assert lines[1] == '{"torn": '
    assert json.loads(lines[2])["turn"] == 2


async def test_save_text_is_confined_to_the_workspace(memory: Memory, tmp_path: Path) -> None:
    saved = await memory.save_text("s", "tool_results/call_1.txt", "full output")
    assert saved.read_text() == "full output"
    outside = tmp_path / "outside"
    outside.mkdir()
    for bad in ("../escape.txt", "tool_results/../../escape.txt", str(outside / "abs.txt"), ""):
        with pytest.raises(PathNotAllowed):
            await memory.save_text("s", bad, "x")
    (memory.workspace("s") / "files" / "link").symlink_to(outside)
    with pytest.raises(PathNotAllowed):
        await memory.save_text("s", "files/link/planted.txt", "x")
    assert list(outside.iterdir()) == []


# -- search ----------------------------------------------------------------------------------


async def test_search_finds_an_earlier_turn_of_the_same_user_and_nothing_of_others(
    memory: Memory, store: Store
) -> None:
    await say(store, ALICE, 1, "My cat is called Pixelbeard.", "Nice name!")
    await say(store, BOB, 1, "My dog is called Pixelbeard too, and my PIN is 4321.", "Noted.")
    await say(store, GROUP, 1, "Group secret: the launch codeword is Pixelbeard.", "OK")
    await memory.append_daily(BOB[1], "Bob's favourite colour is ultramarine.")
    await memory.append_memory_md(GROUP[1], "The group meets on Thursdays at the ultramarine cafe.")
    await say(store, ALICE, 2, "What is my cat called?", "")  # the current turn

    hits = await memory.search(ALICE[1], ALICE[0], "pixelbeard")
    assert [h.source for h in hits] == ["dialog turn 1"]
    assert "cat is called Pixelbeard" in hits[0].snippet
    assert hits[0].date == "2026-11-27"
    assert await memory.search(ALICE[1], ALICE[0], "ultramarine") == []
    assert await memory.search(ALICE[1], ALICE[0], "4321") == []

    bob = await memory.search(BOB[1], BOB[0], "ultramarine colour")
    assert [h.source for h in bob] == ["memory/2026-11-28.md"]
    assert bob[0].date == "2026-11-28"
    group = await memory.search(GROUP[1], GROUP[0], "ultramarine")
    assert [h.source for h in group] == ["MEMORY.md"]
    # The current turn is in the context already; it is not returned.
    assert all("What is my cat" not in h.snippet for h in hits)


async def test_cjk_search_long_and_short_queries(memory: Memory, store: Store) -> None:
    await memory.append_daily("zh", "用户喜欢吃苹果和香蕉，不喜欢榴莲。")
    await say(store, ("web:zh", "zh"), 1, "我的猫叫小花，今年三岁。", "好的，记住了。")
    await say(store, ("web:zh", "zh"), 2, "它叫什么？", "")
    fruit = await memory.search("zh", "web:zh", "苹果")  # two characters: LIKE fallback
    assert [h.source for h in fruit] == ["memory/2026-11-28.md"]
    assert "苹果" in fruit[0].snippet
    cat = await memory.search("zh", "web:zh", "我的猫叫什么名字")  # trigram windows
    assert cat and cat[0].source == "dialog turn 1"
    assert "小花" in cat[0].snippet
    assert await memory.search("zh", "web:zh", "汽车") == []


@pytest.mark.parametrize("query", [
    '"unbalanced', "cat OR", "NEAR(cat dog)", "cat*", "-cat", "col:cat", "^cat", "a AND (b",
    "'; DROP TABLE x", "\x00", "   ", "..."])
async def test_model_query_text_cannot_break_fts_syntax(memory: Memory, query: str) -> None:
    await memory.append_daily("s", "the cat sat on the mat")
    await memory.search("s", "web:s", query)  # no exception


def test_parse_query_quotes_terms_and_splits_cjk() -> None:
    q = parse_query('cat "dog" 苹果香蕉 ab')
    assert q.match == '"cat" OR "dog" OR "苹果香" OR "果香蕉"'
    assert q.short_terms == ()
    assert parse_query("ab 苹果").short_terms == ("ab", "苹果")
    assert parse_query("!!!").empty


async def test_index_follows_edits_made_outside_the_gateway(memory: Memory) -> None:
    await memory.append_memory_md("s", "Favourite editor: vim")
    assert await memory.search("s", "web:s", "vim")
    path = memory.workspace("s") / "MEMORY.md"
    path.write_text("Favourite editor: emacs\n")
    os.utime(path, ns=(path.stat().st_mtime_ns + 10**9,) * 2)
    assert await memory.search("s", "web:s", "vim") == []
    assert await memory.search("s", "web:s", "emacs")
    path.unlink()
    assert await memory.search("s", "web:s", "emacs") == []


async def test_appended_notes_are_indexed_block_by_block_and_hand_edits_still_win(
    memory: Memory, store: Store,
) -> None:
    await memory.append_daily("s", "the first block mentions kumquats", heading="Turns 0")
    for i in range(1, 30):
        await memory.append_daily("s", f"summary block {i}: decided on plan-{i:03d}", heading=f"Turns {i}")
    rows = await store.run("SELECT count(*) FROM memory_chunks WHERE scope='s'")
    assert await memory.search("s", "web:s", "kumquats") and await memory.search("s", "web:s", "plan-029")
    text = (memory.workspace("s") / "memory" / "2026-11-28.md").read_text()
    assert text.startswith("# 2026-11-28\n\n## Turns 0\n\nthe first") and "\n\n## Turns 29\n\nsummary block 29" in text
    assert rows[0][0] >= 30  # one chunk per appended block: nothing was re-indexed twice

    path = memory.workspace("s") / "memory" / "2026-11-28.md"
    path.write_text("# 2026-11-28\n\nrewritten by hand: plan-777\n")  # a person's edit, then a new block
    await memory.append_daily("s", "after the edit: plan-888")
    assert await memory.search("s", "web:s", "kumquats") == []  # the whole note was indexed again
    assert await memory.search("s", "web:s", "plan-777") and await memory.search("s", "web:s", "plan-888")
    assert path.read_text() == "# 2026-11-28\n\nrewritten by hand: plan-777\n\nafter the edit: plan-888\n"


# -- tools and isolation -------------------------------------------------------------------


async def test_memory_tools_write_and_find_within_the_scope(memory: Memory, store: Store) -> None:
    write, search = MemoryWrite(), MemorySearch()
    alice, bob = ctx_for(ALICE, memory, store), ctx_for(BOB, memory, store)
    out = await write.run({"text": "Alice is allergic to peanuts", "target": "memory"}, alice)
    assert out.text == "Saved to MEMORY.md."
    out = await write.run({"text": "Alice flies to Lisbon on Friday", "target": "daily"}, alice)
    assert out.text == "Saved to memory/2026-11-28.md."
    found = await search.run({"query": "peanuts"}, alice)
    assert "MEMORY.md" in found.text and "allergic to peanuts" in found.text
    found = await search.run({"query": "Lisbon", "limit": 3}, alice)
    assert "[2026-11-28] memory/2026-11-28.md" in found.text
    nothing = await search.run({"query": "peanuts"}, bob)
    assert nothing.text.startswith("No results for 'peanuts'")
    assert not (memory.workspace(BOB[1]) / "MEMORY.md").exists()
    for bad in ({"text": "x", "target": "../../etc"}, {"text": "", "target": "daily"},
                {"text": "x" * 5000, "target": "daily"}):
        with pytest.raises(ToolError):
            await write.run(bad, alice)
    for bad_query in ({"query": ""}, {"query": "x", "limit": 0}, {"query": "x", "limit": "3"}):
        with pytest.raises(ToolError):
            await search.run(bad_query, alice)


async def test_planted_symlinks_in_a_workspace_are_refused(
    memory: Memory, store: Store, tmp_path: Path
) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "secret.md").write_text("the vault password is swordfish\n")
    ws = memory.workspace(BOB[1])
    (ws / "MEMORY.md").symlink_to(outside / "secret.md")
    (ws / "memory").rmdir()
    (ws / "memory").symlink_to(outside)
    ctx = ctx_for(BOB, memory, store)

    with pytest.raises(ToolError):
        await MemoryWrite().run({"text": "planted", "target": "daily"}, ctx)
    with pytest.raises(ToolError):
        await MemoryWrite().run({"text": "planted", "target": "memory"}, ctx)
    assert (outside / "secret.md").read_text() == "the vault password is swordfish\n"
    assert sorted(p.name for p in outside.iterdir()) == ["secret.md"]
    assert await memory.read_memory_md(BOB[1], max_tokens=1000, count=words) == ""
    found = await MemorySearch().run({"query": "swordfish"}, ctx)
    assert found.text.startswith("No results")
