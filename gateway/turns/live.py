"""The in-memory state of one session: a cache over the store, rebuilt at will."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from context.effects import TrimEvent
    from context.engine import SessionContext
    from gateway.turns.streaming import StepFeed
    from gateway.turns.usage import TurnCharge
    from gateway.types import Inbound


@dataclass(frozen=True, slots=True)
class SubTurn:
    """What one sub-turn did, for /context: its task, agent, decision steps and tokens."""

    key: str  # where its messages are stored: `<session key>#sub:<n>`
    task: str
    agent: str
    steps: int
    tokens: int
    outcome: str


@dataclass
class TurnStop:
    """A /stop of the turn running now (SPEC §6): who asked, and set once that turn has
    ended (its stopped reply stored and delivered)."""

    by: str
    ended: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class LiveSession:
    key: str
    scope: str
    channel: str
    workspace: Path
    ctx: SessionContext
    queue: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    worker: asyncio.Task[Any] | None = None
    seq: int = 0  # order of the next message within the current turn
    context_start: int = 1  # first turn after the last /context clear (turns before it are cleared)
    summarizing: set[int] = field(default_factory=set)  # upto_turn of summaries in flight
    last_event: TrimEvent | None = None
    turn_tokens: int = 0  # provider-reported tokens of the turn running now
    step_tokens_in: int = 0  # the counted prompt of the model call under way (charged if a /stop cuts it)
    inbound: Inbound | None = None  # the message of the turn running now (tools reply where it came from)
    # The rest of the turn's tally, for its log line: tokens in and out, decision steps
    # (model calls), and the context rules that fired.
    turn_tokens_in: int = 0
    turn_tokens_out: int = 0
    turn_steps: int = 0
    turn_trims: list[str] = field(default_factory=list)
    agent: str = "default"  # the agent that answers here (SPEC §5.5; gateway/agents.py)
    model_alias: str | None = None  # picked with /model; None: the agent's own model
    last_model: str | None = None  # the model that answered the last step (a fallback, maybe)
    # A sub-turn's own limits (SPEC §5.8): (most decision steps, most request tokens); None
    # for a session's own turns. A sub-turn cannot delegate further.
    sub_limits: tuple[int, int] | None = None
    parent_agent: str | None = None  # a sub-turn's delegating agent: it has none of the tools that one lacks
    sub_turns: list[SubTurn] = field(default_factory=list)  # the sub-turns this session ran (for /context)
    turn_delegates: int = 0  # delegate calls the turn running now has run (tools.delegate.max_per_turn)
    # What the turn running now has cost the person (SPEC §5.13), its sub-turns' calls
    # included as they are made: the budget check before each call reads it.
    charge: TurnCharge | None = None
    # The agent's run of the turn running now (what /stop cancels), the feed of its
    # stream (what was shown), and the stop asked for it, if any.
    running: asyncio.Task[Any] | None = None
    feed: StepFeed | None = None
    stop: TurnStop | None = None
    # The id of the newest message of this session this process stored or restored: with
    # `context_start`, the session's mark as this gateway left it (gateway/turns/leased_sessions.py).
    last_message_id: int = 0
