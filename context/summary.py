"""Summaries of dropped turns: the model request, the fallback and the injected block
(SPEC §4.2, §4.6)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from gateway.types import HOOK_ORIGIN_PREFIX, Message

from .turns import final_reply, split_turns, user_message

if TYPE_CHECKING:
    from .effects import SummarizeTurns

SUMMARY_SECTIONS = (
    "Goal",
    "Constraints & Preferences",
    "Progress",
    "Key Decisions",
    "Next Steps",
    "Critical Context",
)

# The extractive fallback stays this small however long the session runs.
EXTRACTIVE_MAX_CHARS = 6000
_EXTRACT_USER_CHARS = 200
_EXTRACT_REPLY_CHARS = 300
_MIN_MESSAGE_CHARS = 200
_CALL_ARGS_CHARS = 300

_INSTRUCTIONS = f"""You keep the working memory of a long chat between a user and an AI assistant.
Older turns of the chat are being moved out of the assistant's context window; the summary
you write is all the assistant will remember of them (the raw messages stay searchable).

Update the previous summary, if there is one, with the conversation below: keep what is still
true and useful, correct what changed, add what is new. Do not start over and do not drop
facts that still matter. Write in the language the user writes in.

Use exactly these Markdown sections, in this order:
## {SUMMARY_SECTIONS[0]}
What the user is trying to achieve.
## {SUMMARY_SECTIONS[1]}
Requirements, limits and lasting preferences of the user (style, language, tools, people,
schedules) worth remembering beyond this conversation.
## {SUMMARY_SECTIONS[2]}
### Done
### In progress
### Blocked
## {SUMMARY_SECTIONS[3]}
Decisions taken and why, and lessons from failed attempts (what did not work, and why).
## {SUMMARY_SECTIONS[4]}
## {SUMMARY_SECTIONS[5]}
Exact names, file paths, identifiers, numbers, commands, URLs and error messages, verbatim.

Write "(none)" under a section with nothing to say. Do not invent anything. Stay under about
700 words. Reply with the summary only."""


def _clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    head = limit * 2 // 3
    tail = limit - head
    omitted = len(text) - head - tail
    return f"{text[:head]}\n[… {omitted} characters omitted …]\n{text[len(text) - tail:]}"


def _author(origin: str | None) -> str:
    """Who wrote a user message, as the summary model is told."""
    if origin == "task":
        return "Scheduled task"
    if origin is not None and origin.startswith(HOOK_ORIGIN_PREFIX):
        return f"Webhook {origin.removeprefix(HOOK_ORIGIN_PREFIX)}"
    return "User"


def _render(messages: Sequence[Message], text_cap: int, tool_cap: int) -> str:
    lines: list[str] = []
    turn = None
    for msg in messages:
        if msg.turn and msg.turn != turn:
            turn = msg.turn
            lines.append(f"\n### Turn {turn}")
        if msg.role == "user":
            who = "Gateway note" if msg.injected else _author(msg.origin)
            lines.append(f"{who}: {_clip(msg.content, text_cap)}")
        elif msg.role == "assistant":
            if msg.content.strip():
                lines.append(f"Assistant: {_clip(msg.content, text_cap)}")
            for call in msg.tool_calls:
                lines.append(f"Assistant called {call.name}({_clip(call.arguments, _CALL_ARGS_CHARS)})")
        elif msg.role == "tool":
            name = msg.tool_name or "tool"
            lines.append(f"Result of {name}: {_clip(msg.content, tool_cap)}")
        else:
            lines.append(f"{msg.role.capitalize()}: {_clip(msg.content, text_cap)}")
    return "\n".join(lines).strip()


def summary_request(
    effect: SummarizeTurns, max_chars_per_message: int = 4000, max_total_chars: int = 80_000
) -> list[dict[str, Any]]:
    """The chat messages to send to the summary model for one SummarizeTurns effect.

    Messages are rendered compactly: each text is clipped to `max_chars_per_message`
    (tool results to half of it), and all caps shrink until the transcript fits
    `max_total_chars`, so a summary request stays small whatever was dropped.
    """
    text_cap = max(_MIN_MESSAGE_CHARS, max_chars_per_message)
    tool_cap = max(_MIN_MESSAGE_CHARS, max_chars_per_message // 2)
    transcript = _render(effect.messages, text_cap, tool_cap)
    while len(transcript) > max_total_chars and max(text_cap, tool_cap) > _MIN_MESSAGE_CHARS:
        text_cap = max(_MIN_MESSAGE_CHARS, text_cap // 2)
        tool_cap = max(_MIN_MESSAGE_CHARS, tool_cap // 2)
        transcript = _render(effect.messages, text_cap, tool_cap)
    transcript = _clip(transcript, max_total_chars)
    previous = effect.previous_summary.strip() if effect.previous_summary else ""
    turns = sorted({m.turn for m in effect.messages if m.turn})
    span = f"turns {turns[0]}–{turns[-1]}" if turns else "earlier turns"
    user = (
        f"Previous summary:\n{previous or '(none yet)'}\n\n"
        f"Conversation to fold into the summary ({span}):\n{transcript or '(no messages)'}"
    )
    return [{"role": "system", "content": _INSTRUCTIONS}, {"role": "user", "content": user}]


def _first_line(text: str, limit: int) -> str:
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line if len(line) <= limit else line[: limit - 1] + "…"


def extractive_summary(effect: SummarizeTurns) -> str:
    """A deterministic stand-in when the summary model fails: the previous summary kept,
    plus the first user line and the final reply of each dropped turn. Bounded in size:
    the newest notes win, and a long previous summary keeps its start and end."""
    notes: list[str] = []
    for turn in split_turns(effect.messages):
        user = user_message(turn)
        reply = final_reply(turn)
        number = (user or turn[0]).turn
        asked = _first_line(user.content, _EXTRACT_USER_CHARS) if user else "(no user message)"
        answered = _first_line(reply.content, _EXTRACT_REPLY_CHARS) if reply else "(no final reply)"
        notes.append(f"- Turn {number}: the user wrote “{asked}” — the assistant replied “{answered}”")
    numbers = [m.turn for m in effect.messages if m.turn]
    span = f"{min(numbers)}–{max(numbers)}" if numbers else "?"
    header = f"## Notes on turns {span} (extracted; the summarizer was unavailable)"
    body = "\n".join(notes)
    room = EXTRACTIVE_MAX_CHARS - len(header) - 2
    if len(body) > room:
        kept: list[str] = []
        size = 0
        for line in reversed(notes):
            if size + len(line) + 1 > room // 2 and kept:
                break
            kept.append(line)
            size += len(line) + 1
        body = "- (older turns omitted)\n" + "\n".join(reversed(kept))
    section = f"{header}\n{body}"
    previous = (effect.previous_summary or "").strip()
    if not previous:
        return section
    room = EXTRACTIVE_MAX_CHARS - len(section) - 2
    if len(previous) > room:
        previous = _clip(previous, max(_MIN_MESSAGE_CHARS, room - 40))
    return f"{previous}\n\n{section}"


def injection_text(summary: str) -> str:
    """The block put before the first kept user message of the request (never stored)."""
    return (
        "[Summary of the earlier conversation: older turns were moved out of the context]\n"
        f"{summary.strip()}\n"
        "[The full earlier conversation can be searched with memory_search and read in "
        "dialog/YYYY-MM-DD.jsonl (one JSON object per message, the newest at the end of each "
        "file). The user's message follows.]"
    )
