"""What the engine hands back to the shell for each decision step: the request (`Prepared`),
the summaries to write (`SummarizeTurns`), and what each rule did (`TrimEvent`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from gateway.types import Message

SummaryReason = Literal["turn_budget", "token_budget", "prefetch", "compact", "overflow", "restore", "purge"]
Strategy = Literal[
    "turn_budget",
    "token_budget_halve",
    "compress_history",
    "cut_current_turn",
    "stage2",
    "overflow_trim",
    "compact",
]


@dataclass(frozen=True, slots=True)
class SummarizeTurns:
    """Effect: summarize these dropped turns in the background, then call
    `ctx.offer_summary(text, upto_turn)` (with `extractive_summary(effect)` on failure).

    `messages` are the raw messages of every dropped turn no delivered summary covers yet
    (all roles, full content), so each summary is complete on its own even when an
    earlier one is still running. Turns >= `new_from_turn` appear in no earlier effect:
    archive only those to dialog/ to avoid duplicates.
    """

    session_key: str
    messages: tuple[Message, ...]
    previous_summary: str | None
    upto_turn: int  # highest turn number covered
    reason: SummaryReason
    new_from_turn: int = 0


@dataclass(frozen=True, slots=True)
class TrimEvent:
    """What a rule did, for /context, logs and metrics."""

    strategy: Strategy
    tokens_before: int
    tokens_after: int
    turns_before: int
    turns_after: int


@dataclass(frozen=True, slots=True)
class Prepared:
    messages: list[dict[str, Any]]  # OpenAI chat format, system message first; read-only
    tokens: int  # the whole request's exact count (tools included) × the session's calibration
    effects: list[SummarizeTurns]
    events: list[TrimEvent]
    user_notice: str | None  # set only when the request cannot fit: do not send, tell the user
