"""Long-term memory through the running gateway (SPEC §4.2, §4.5, §6): turns that leave the
context — by a trim, /compact or a restart — reach memory/ and dialog/ exactly once, the
daily note records what each summary added, dialog/ keeps tool outputs whole."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

from gateway.app import Gateway
from gateway.store.sqlite import Store
from gateway.turns.summaries import FOLD_MAX_TURNS, summary_delta
from gateway.types import Message
from tests.conftest import GatewayFactory, chat
from tests.fakes.openai_server import ErrorReply, FakeModel, Reply, ScriptedCall, last_user_text, overflow_error
from tests.test_e2e_context import chat_requests, is_summary_request, script_chat, user_texts

_PREVIOUS = re.compile(r"Previous summary:\n(.*?)\n\nConversation to fold", re.S)


def cumulative_summary(body: dict[str, Any]) -> str:
    """What a summarizer that updates the previous summary answers: the previous summary
    with one line added for each user message of the turns being folded."""
    prompt = body["messages"][-1]["content"]
    found = _PREVIOUS.search(prompt)
    previous = found.group(1).strip() if found else ""
    if not previous or previous == "(none yet)":
        previous = "## Goal\n- test the gateway\n\n## Critical Context"
    added = [f"- the user said: {text}" for text in re.findall(r"^User: (.*)$", prompt, re.M)]
    return "\n".join([previous, *added])


def fold_with_cumulative_summaries(fake: FakeModel) -> None:
    fake.respond_with(lambda body: cumulative_summary(body) if is_summary_request(body) else None)


async def scope_files(gw: Gateway, key: str) -> tuple[str, list[dict[str, Any]]]:
    """Today's daily note and today's dialog archive of the session's scope."""
    assert gw.services is not None and gw.services.memory is not None
    row = await gw.services.store.get_session(key)
    assert row is not None
    memory = gw.services.memory
    root = memory.workspace(row.scope)
    day = memory.today()
    note = root / "memory" / f"{day}.md"
    dialog = root / "dialog" / f"{day}.jsonl"
    rows = [json.loads(line) for line in dialog.read_text(encoding="utf-8").splitlines()] if dialog.exists() else []
    return (note.read_text(encoding="utf-8") if note.exists() else ""), rows


async def settle(gw: Gateway) -> None:
    assert gw.services is not None
    assert await gw.services.background.wait_idle(15)


async def test_turns_a_restart_left_out_are_summarized_and_archived_once(
    make_gateway: GatewayFactory, fake_model: FakeModel, tmp_path: Path
) -> None:
    gw = await make_gateway()  # 20 turns: a restore keeps max(3, 20 // 6) = 3 of them

    def answer(body: dict[str, Any]) -> Reply | str:
        if is_summary_request(body):
            return cumulative_summary(body)
        n = int(last_user_text(body).split()[-1])
        if n % 4 == 0 and body["messages"][-1]["role"] != "tool":
            return Reply(tool_calls=(ScriptedCall("current_time", "{}", f"call_{n}"),))
        return f"reply {n}"

    fake_model.respond_with(answer)
    for n in range(1, 16):  # no trim; turns 1-10 are summarized ahead of theirs (at turn 11)
        await chat(gw, "ana", f"message {n}")
    await settle(gw)
    await gw.stop()

    gw = await make_gateway()
    fold_with_cumulative_summaries(fake_model)
    await chat(gw, "ana", "message 16")  # restores turns 13-15; turns 1-12 go to memory
    await settle(gw)
    note, rows = await scope_files(gw, "web:ana")
    for n in range(1, 13):
        assert note.count(f"the user said: message {n}\n") == 1, note
    assert "message 13" not in note
    user_rows = Counter(r["content"] for r in rows if r["role"] == "user")
    assert user_rows == Counter(f"message {n}" for n in range(1, 13))
    assert all(r["session_key"] == "web:ana" and r["turn"] <= 12 for r in rows)
    # Whole turns, tool chains included, although the restore kept only text.
    turn4 = [r["role"] for r in rows if r["turn"] == 4]
    assert turn4 == ["user", "assistant", "tool", "assistant"]
    assert gw.services is not None
    latest = await gw.services.store.latest_summary("web:ana")
    assert latest is not None and latest.upto_turn == 12 and latest.reason == "restore"
    # The next turn carries that summary in front of the kept turns.
    await chat(gw, "ana", "message 17")
    first_kept = user_texts(chat_requests(fake_model)[-1])[0]
    assert "the user said: message 1\n" in first_kept and first_kept.endswith("message 13")

    # Two more restarts: only turns that newly left the context are added, never again the old ones.
    for n in (18, 19):
        await gw.stop()
        gw = await make_gateway()
        fold_with_cumulative_summaries(fake_model)
        await chat(gw, "ana", f"message {n}")
        await settle(gw)
    note, rows = await scope_files(gw, "web:ana")
    user_rows = Counter(r["content"] for r in rows if r["role"] == "user")
    assert user_rows == Counter(f"message {n}" for n in range(1, 16))  # 16-19 are live
    assert Counter((r["turn"], r["role"], r["content"]) for r in rows).most_common(1)[0][1] == 1
    for n in range(1, 16):
        assert note.count(f"the user said: message {n}\n") == 1, note
    latest = await gw.services.store.latest_summary("web:ana")
    assert latest is not None and latest.upto_turn == 15
    assert all(f"the user said: message {n}\n" in latest.text + "\n" for n in range(1, 16))


async def test_the_daily_note_gets_what_each_summary_added_and_the_database_the_whole(
    make_gateway: GatewayFactory, fake_model: FakeModel
) -> None:
    gw = await make_gateway(agent_max_context_turns=4)
    fold_with_cumulative_summaries(fake_model)
    for n in range(1, 9):  # folds of turns 1-2, 3-4 and 5-6 (prefetched, then trimmed)
        await chat(gw, "bo", f"message {n}")
        await settle(gw)
    note, _ = await scope_files(gw, "web:bo")
    assert note.count("- test the gateway") == 1, note
    for n in range(1, 7):
        assert note.count(f"the user said: message {n}\n") == 1, note
    assert len(re.findall(r"^## web:bo, turns ", note, re.M)) == 3
    assert gw.services is not None
    latest = await gw.services.store.latest_summary("web:bo")
    assert latest is not None and latest.upto_turn == 6
    assert "- test the gateway" in latest.text
    assert all(f"the user said: message {n}" in latest.text for n in range(1, 7))


async def test_dialog_archive_keeps_a_cut_tool_output_whole(
    make_gateway: GatewayFactory, fake_model: FakeModel
) -> None:
    gw = await make_gateway(agent_max_context_turns=4, tool_result_max_chars=1000,
                            history_tool_result_max_chars=500)
    assert gw.services is not None and gw.services.memory is not None
    root = gw.services.memory.workspace("web:cy")
    sections = "\n\n".join(f"## Note {i}\n\nzebra sighting number {i} " + "stripes " * 40 for i in range(20))
    (root / "MEMORY.md").write_text(sections, encoding="utf-8")
    fold_with_cumulative_summaries(fake_model)
    fake_model.tool_call("memory_search", {"query": "zebra", "limit": 20})
    fake_model.reply("found many zebras")
    await chat(gw, "cy", "search the zebras")
    (tool,) = [m for m in await gw.services.store.messages("web:cy") if m.role == "tool"]
    assert tool.truncation is not None and tool.truncation.saved  # cut at stage 1, saved whole
    full = (root / tool.truncation.path).read_text(encoding="utf-8")
    assert len(full) == tool.truncation.total_chars > 1000 and tool.content != full
    for n in range(2, 6):  # turn 1 leaves the context
        await chat(gw, "cy", f"message {n}")
        await settle(gw)
    _, rows = await scope_files(gw, "web:cy")
    (archived,) = [r for r in rows if r["role"] == "tool"]
    assert archived["content"] == full
    assert archived["tool_name"] == "memory_search" and archived["tool_call_ids"] == [tool.tool_call_id]
    assert "excerpt_of" not in archived


async def test_compact_compacts_when_a_prefetched_summary_already_covers_the_turns(
    make_gateway: GatewayFactory, fake_model: FakeModel
) -> None:
    gw = await make_gateway(agent_max_context_turns=4)
    fold_with_cumulative_summaries(fake_model)
    for n in range(1, 5):  # at 4 turns the summary of turns 1-2 is prepared ahead
        await chat(gw, "dan", f"message {n}")
    await settle(gw)
    assert [r for r in fake_model.requests if is_summary_request(r)]
    answer = await chat(gw, "dan", "/compact")
    assert answer.startswith("Compacted: 2 earlier turns"), answer
    await chat(gw, "dan", "message 5")
    texts = user_texts(chat_requests(fake_model)[-1])
    assert len(texts) == 3 and texts[1:] == ["message 4", "message 5"]
    assert "the user said: message 1" in texts[0] and texts[0].endswith("message 3")
    assert (await chat(gw, "dan", "/compact")).startswith("Compacted: 1 earlier turn ")
    assert (await chat(gw, "dan", "/compact")).startswith("Nothing to compact yet")


async def test_another_error_on_the_overflow_retry_gets_its_own_message(
    make_gateway: GatewayFactory, fake_model: FakeModel
) -> None:
    gw = await make_gateway()
    for n in range(1, 4):
        await chat(gw, "eve", f"turn {n}")
    refused = ErrorReply(401, {"error": {"message": "Incorrect API key provided", "type": "invalid_request_error",
                                         "code": "invalid_api_key"}})
    script_chat(fake_model, overflow_error(limit=4000), refused)
    reply = await chat(gw, "eve", "one more")
    assert "refused the API key (HTTP 401)" in reply and "model.api_key" in reply
    assert "went wrong" not in reply



async def test_a_long_history_is_caught_up_in_bounded_pieces_after_a_restart(
    make_gateway: GatewayFactory, fake_model: FakeModel, tmp_path: Path
) -> None:
    # A session from an older version: 120 answered turns, no summary, nothing in memory/.
    # Turns 31-32 are missing (purged): the pieces count stored turns, not numbers.
    store = await Store.open(tmp_path / "data" / "gateway.sqlite3")
    await store.ensure_session("web:gus", "web:gus", "web")
    turns = [n for n in range(1, 121) if n not in (31, 32)]
    for n in turns:
        await store.add_message("web:gus", Message(role="user", content=f"message {n}", turn=n), seq=0)
        await store.add_message("web:gus", Message(role="assistant", content=f"reply {n}", turn=n), seq=1)
    await store.close()

    gw = await make_gateway()
    fold_with_cumulative_summaries(fake_model)
    await chat(gw, "gus", "message 121")  # restores turns 118-120; 1-117 are caught up
    await settle(gw)
    asked = [r for r in fake_model.requests if is_summary_request(r)]
    pieces = [sorted(int(n) for n in re.findall(r"^User: message (\d+)$", r["messages"][-1]["content"], re.M))
              for r in asked]
    assert [len(p) for p in pieces] == [FOLD_MAX_TURNS, FOLD_MAX_TURNS, 115 - 2 * FOLD_MAX_TURNS]
    assert [n for p in pieces for n in p] == [n for n in turns if n <= 117]  # in order, each once
    note, rows = await scope_files(gw, "web:gus")
    assert Counter(r["content"] for r in rows if r["role"] == "user") == Counter(
        f"message {n}" for n in turns if n <= 117)
    assert all(note.count(f"the user said: message {n}\n") == 1 for n in turns if n <= 117)
    assert gw.services is not None
    latest = await gw.services.store.latest_summary("web:gus")
    assert latest is not None and latest.upto_turn == 117


def test_summary_delta_keeps_only_new_or_changed_lines_under_their_headings() -> None:
    previous = "## Goal\n- ship v2\n\n## Progress\n### Done\n- tests\n### Blocked\n(none)\n\n## Next Steps\n- docs"
    current = ("## Goal\n- ship v2\n\n## Progress\n### Done\n- tests\n- release notes\n### Blocked\n- CI is red\n\n"
               "## Next Steps\n- docs\n\n## Critical Context\n(none)")
    assert summary_delta(previous, current) == (
        "## Progress\n### Done\n- release notes\n### Blocked\n- CI is red")
    assert summary_delta(None, current) == current
    assert summary_delta(current, current) == ""
