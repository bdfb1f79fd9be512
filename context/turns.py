"""Turns: segmenting messages, pairing tool calls with results, text-only compression.

A turn starts at a message a person sent (a user message that is not injected) and holds
everything up to the next one: assistant tool calls, tool results, the final reply
(SPEC §1). Messages before the first user message form a leading group of their own.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

from gateway.types import Message

MISSING_RESULT = "(no result: this tool call was interrupted before it returned)"


def starts_turn(msg: Message) -> bool:
    return msg.role == "user" and not msg.injected


def split_turns(messages: Iterable[Message]) -> list[list[Message]]:
    """Group messages into turns; a leading group without a user message stays separate."""
    turns: list[list[Message]] = []
    for msg in messages:
        if starts_turn(msg) or not turns:
            turns.append([msg])
        else:
            turns[-1].append(msg)
    return turns


def user_message(turn: Sequence[Message]) -> Message | None:
    return next((m for m in turn if starts_turn(m)), None)


def final_reply(turn: Sequence[Message]) -> Message | None:
    """The agent's last reply of a turn: its last assistant text without tool calls."""
    for msg in reversed(turn):
        if msg.role == "assistant" and not msg.tool_calls and msg.content.strip():
            return msg
    return None


def is_complete(turn: Sequence[Message]) -> bool:
    return user_message(turn) is not None and final_reply(turn) is not None


def text_only(turn: Sequence[Message]) -> list[Message]:
    """The turn reduced to the user's text and the agent's final reply (tool chains gone).

    When the agent never gave a plain reply, its last words that came with a tool call
    stand in (without the call), so the turn keeps what the agent said.
    """
    out: list[Message] = []
    user = user_message(turn)
    if user is not None:
        out.append(user)
    reply = final_reply(turn)
    if reply is None:
        spoken = [m for m in turn if m.role == "assistant" and m.content.strip()]
        if spoken:
            reply = replace(spoken[-1], tool_calls=())
    if reply is not None:
        out.append(reply)
    return out


def synthetic_result(call_id: str, turn: int) -> Message:
    return Message(
        role="tool", content=MISSING_RESULT, turn=turn, tool_call_id=call_id, injected=True, created_at=0.0
    )


def pair_tool_messages(turn: Sequence[Message]) -> list[Message]:
    """The messages with tool calls and results paired exactly, as providers require.

    Every assistant message with tool calls is followed by exactly one result per call,
    in call order: results found in the run of tool messages after it are used, a
    missing one is stood in for by a short injected result; a result that answers no
    call there (an orphan or a duplicate) is left out.
    """
    out: list[Message] = []
    i, n = 0, len(turn)
    while i < n:
        msg = turn[i]
        i += 1
        if msg.role == "tool":
            continue  # orphan: not in the run right after its call
        out.append(msg)
        if msg.role != "assistant" or not msg.tool_calls:
            continue
        found: dict[str, list[Message]] = {}
        while i < n and turn[i].role == "tool":
            result = turn[i]
            found.setdefault(result.tool_call_id or "", []).append(result)
            i += 1
        for call in msg.tool_calls:
            candidates = found.get(call.id)
            out.append(candidates.pop(0) if candidates else synthetic_result(call.id, msg.turn))
    return out


def is_paired(messages: Sequence[dict[str, Any]]) -> bool:
    """Check a request in OpenAI format: each tool-call message is followed by exactly its
    results, and no tool result appears anywhere else."""
    i, n = 0, len(messages)
    while i < n:
        msg = messages[i]
        i += 1
        if msg.get("role") == "tool":
            return False
        calls = msg.get("tool_calls") or []
        if msg.get("role") != "assistant" or not calls:
            continue
        expected = [c["id"] for c in calls]
        got = []
        while i < n and messages[i].get("role") == "tool":
            got.append(messages[i].get("tool_call_id"))
            i += 1
        if got != expected:
            return False
    return True


def to_openai(msg: Message, content: str | None = None) -> dict[str, Any]:
    """One message in OpenAI chat format; `content` replaces the stored text when given."""
    text = msg.content if content is None else content
    if msg.role == "tool":
        return {"role": "tool", "tool_call_id": msg.tool_call_id or "", "content": text}
    if msg.role == "assistant" and msg.tool_calls:
        return {
            "role": "assistant",
            "content": text or None,
            "tool_calls": [
                {"id": tc.id, "type": "function", "function": {"name": tc.name, "arguments": tc.arguments}}
                for tc in msg.tool_calls
            ],
        }
    return {"role": msg.role, "content": text}
