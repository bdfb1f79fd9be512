"""The in-memory state of one session: a cache over the store, rebuilt at will."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from context.effects import TrimEvent
    from context.engine import SessionContext
    from gateway.types import Inbound


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
    # The id of the newest message of this session this process stored or restored: with
    # `context_start`, the session's mark as this gateway left it (gateway/turns/leased_sessions.py).
    last_message_id: int = 0
