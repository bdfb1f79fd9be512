"""What `/context` shows (SPEC §6): the numbers and their Markdown reply."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .effects import TrimEvent

_STRATEGY_WORDS = {
    "turn_budget": "turn budget: dropped the earliest half of the turns",
    "token_budget_halve": "token budget: dropped the earliest half of the turns",
    "compress_history": "token budget: reduced earlier turns to their text",
    "cut_current_turn": "token budget: cut large items of the current turn",
    "stage2": "shortened tool results of earlier turns",
    "overflow_trim": "overflow recovery: aggressive trim",
    "compact": "/compact: summarized all but the last turns",
}


@dataclass(frozen=True, slots=True)
class ContextStats:
    session_key: str
    messages: int
    user_messages: int
    assistant_messages: int
    tool_messages: int
    total_chars: int
    estimated_tokens: int  # the request as it would be sent now, calibrated
    budget_tokens: int  # the effective token budget
    turns: int
    max_turns: int
    summary_present: bool
    summary_upto_turn: int
    summary_pending: bool  # a summary arrived and is injected from the next turn
    calibration: float
    encoding: str
    last_event: TrimEvent | None
    task_messages: int = 0  # of the user messages: prompts of scheduled tasks (no person wrote them)
    hook_messages: int = 0  # of the user messages: inbound webhooks' (no person wrote them)


def _n(value: int) -> str:
    return f"{value:,}"


def format_context_stats(stats: ContextStats, *, details: bool = True) -> str:
    """The /context reply (Markdown). `details`: the strategy's name and the token
    calibration, for the operator."""
    share = f" ({stats.estimated_tokens * 100 // stats.budget_tokens}%)" if stats.budget_tokens > 0 else ""
    tokens = "unknown" if stats.estimated_tokens < 0 else _n(stats.estimated_tokens)
    origins = [f"{_n(count)} from {what}" for count, what in ((stats.task_messages, "scheduled tasks"),
                                                              (stats.hook_messages, "webhooks")) if count]
    tasks = f" ({', '.join(origins)})" if origins else ""
    lines = [
        "**Context of this chat**",
        f"- Messages: {_n(stats.messages)} (user {_n(stats.user_messages)}{tasks}, "
        f"assistant {_n(stats.assistant_messages)}, tool {_n(stats.tool_messages)})",
        f"- Characters: {_n(stats.total_chars)}",
        f"- Estimated tokens: {tokens} of {_n(stats.budget_tokens)}{share}",
        f"- Turns: {stats.turns} of {stats.max_turns}",
    ]
    if stats.summary_present:
        summary = f"yes, covering turns up to {stats.summary_upto_turn}"
    else:
        summary = "none"
    if stats.summary_pending:
        summary += " (a newer one is used from the next turn)"
    lines.append(f"- Summary of earlier turns: {summary}")
    event = stats.last_event
    if event is None:
        lines.append("- Last trim: none")
    else:
        words = _STRATEGY_WORDS.get(event.strategy, event.strategy)
        name = f" (`{event.strategy}`)" if details else ""
        lines.append(
            f"- Last trim: {words}{name}: tokens {_n(event.tokens_before)} → "
            f"{_n(event.tokens_after)}, turns {event.turns_before} → {event.turns_after}"
        )
    if details and abs(stats.calibration - 1.0) >= 0.01:
        lines.append(f"- Token estimates calibrated ×{stats.calibration:.2f} from the provider's counts")
    return "\n".join(lines)
