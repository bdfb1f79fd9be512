"""Restore after a restart (SPEC §4.5) and the summary texts (SPEC §4.2, §4.6)."""

from __future__ import annotations

import pytest

from context import (
    SUMMARY_SECTIONS,
    SessionContext,
    SummarizeTurns,
    extractive_summary,
    injection_text,
    restore_messages,
    summary_request,
)
from context.summary import EXTRACTIVE_MAX_CHARS
from gateway.types import Message, ToolCall


def stored_turn(turn: int, *, reply: bool = True) -> list[Message]:
    msgs = [
        Message("user", f"question {turn}\nsecond line", turn=turn),
        Message("assistant", "let me look", turn=turn, tool_calls=(ToolCall(f"c{turn}", "read_file", "{}"),)),
        Message("tool", f"tool output {turn}", turn=turn, tool_call_id=f"c{turn}"),
        Message("user", "gateway nudge", turn=turn, injected=True),
    ]
    if reply:
        msgs.append(Message("assistant", f"answer {turn}", turn=turn))
    return msgs


@pytest.mark.parametrize(("max_turns", "kept"), [(20, 3), (6, 3), (30, 5), (60, 10), (1, 3)])
def test_restore_keeps_max_3_or_a_sixth_of_the_turn_limit_as_text(max_turns: int, kept: int) -> None:
    stored = [m for t in range(1, 41) for m in stored_turn(t)]
    restored = restore_messages(stored, max_turns)
    expected = []
    for t in range(41 - kept, 41):
        expected += [("user", f"question {t}\nsecond line"), ("assistant", f"answer {t}")]
    assert [(m.role, m.content) for m in restored] == expected
    assert all(not m.tool_calls for m in restored)


def test_restore_skips_an_unanswered_turn_and_short_sessions() -> None:
    stored = [m for t in range(1, 5) for m in stored_turn(t)] + stored_turn(5, reply=False)
    assert [m.turn for m in restore_messages(stored, 20)] == [2, 2, 3, 3, 4, 4]
    assert restore_messages(stored_turn(1), 20)[-1].content == "answer 1"
    assert restore_messages([], 20) == []


def test_restored_context_continues_numbering_and_keeps_summary() -> None:
    stored = [m for t in range(1, 11) for m in stored_turn(t)]
    ctx = SessionContext("s", restore_messages(stored, 20), summary="S", summary_upto_turn=6)
    assert ctx.current_turn == 10 and ctx.next_turn_number() == 11
    assert ctx.summary == "S" and ctx.turn_count == 3


def effect(messages: list[Message], previous: str | None = None) -> SummarizeTurns:
    return SummarizeTurns("s", tuple(messages), previous, max(m.turn for m in messages), "turn_budget")


def test_summary_request_has_template_update_and_lasting_memory_instructions() -> None:
    msgs = [m for t in range(1, 4) for m in stored_turn(t)]
    msgs[2] = Message("tool", "L" * 50_000, turn=1, tool_call_id="c1", tool_name="read_file")
    request = summary_request(effect(msgs, previous="## Goal\nold goal"), max_chars_per_message=4000)
    assert [m["role"] for m in request] == ["system", "user"]
    system, user = request[0]["content"], request[1]["content"]
    for section in SUMMARY_SECTIONS:
        assert f"## {section}" in system
    assert "Update the previous summary" in system
    assert "lasting preferences" in system and "failed attempts" in system
    assert "old goal" in user and "turns 1–3" in user
    assert "Result of read_file" in user and len(user) < 6000  # the 50k result is clipped
    assert "Assistant called read_file" in user


def test_summary_request_stays_within_total_size() -> None:
    msgs = [Message("tool", "x" * 20_000, turn=t, tool_call_id="c") for t in range(1, 200)]
    request = summary_request(effect(msgs), max_total_chars=30_000)
    assert len(request[1]["content"]) < 31_000


def test_extractive_summary_keeps_previous_and_first_lines_and_replies() -> None:
    text = extractive_summary(effect([m for t in range(3, 6) for m in stored_turn(t)], previous="PREVIOUS"))
    assert text.startswith("PREVIOUS")
    assert "question 3" in text and "second line" not in text and "answer 5" in text
    assert "turns 3–5" in text


def test_extractive_summary_is_bounded_over_a_long_session() -> None:
    summary = None
    for start in range(1, 300, 10):
        msgs = [m for t in range(start, start + 10) for m in stored_turn(t)]
        summary = extractive_summary(effect(msgs, previous=summary))
    assert summary is not None and len(summary) <= EXTRACTIVE_MAX_CHARS + 100
    assert "answer 300" in summary  # the newest notes are kept


def test_injection_text_points_to_memory_search_and_dialog() -> None:
    text = injection_text("  the summary  ")
    assert "the summary" in text and "memory_search" in text and "dialog/" in text and "newest at the end" in text
