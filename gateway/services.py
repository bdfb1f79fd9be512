"""The shared services a running gateway hands to its parts (one object, no globals).

Built once by the wiring, after every part it holds, and never changed after: what a reload
changes inside a part (the model clients, a channel) that part swaps itself. What sits above
this layer (the jobs' task scheduler) is held as the small protocol its users need."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from context.tokens import TokenCounter
from gateway.approvals import Approvals
from gateway.background import Background
from gateway.cluster.leases import Leases
from gateway.config.holder import ConfigHolder
from gateway.config.schema import Config
from gateway.hub import ChannelHub
from gateway.media import Media
from gateway.memory.files import Memory
from gateway.model.client import ModelClient
from gateway.model.clients import Models
from gateway.model.slots import ModelSlots
from gateway.ops.metrics import Metrics
from gateway.skills.catalog import Skills
from gateway.store.api import StoreBackend
from gateway.tools.mcp import McpManager
from gateway.tools.registry import ToolRegistry
from gateway.tools.tasks import TaskBook
from gateway.turns.usage import Usage


@dataclass(frozen=True, slots=True)
class Services:
    config: ConfigHolder
    data_dir: Path
    store: StoreBackend
    metrics: Metrics
    models: Models  # the model clients and tokenizers; a reload swaps them inside
    model_slots: ModelSlots  # the cap on concurrent model calls
    tools: ToolRegistry
    mcp: McpManager  # MCP servers (SPEC §5.2), one tool source of `tools`
    hub: ChannelHub  # the running channels and every reply, stream, card and DM into them
    approvals: Approvals  # tools that wait for a person's yes (SPEC §5.7)
    usage: Usage  # per-person daily budgets, kept in process
    media: Media  # files people send (SPEC §5.4)
    memory: Memory  # long-term memory per scope
    tasks: TaskBook  # people's scheduled tasks (gateway/jobs/tasks.py's TaskScheduler)
    skills: Callable[[], Skills]  # the skills found now (SPEC §5.6): the watcher's, which follows edits
    # Shared with other gateways on PostgreSQL (SPEC §10); a lone gateway holds every lease.
    leases: Leases
    background: Background = field(default_factory=lambda: Background("gateway"))

    @property
    def cfg(self) -> Config:
        return self.config.current

    @property
    def model(self) -> ModelClient:
        return self.models.main

    @property
    def summary_model(self) -> ModelClient:
        return self.models.summary

    @property
    def counter(self) -> TokenCounter:
        """`model`'s tokenizer."""
        return self.models.counter

    def client_for(self, alias: str | None) -> ModelClient:
        """The client of model `alias` (`model` for None); `model`'s when a reload took it away."""
        return self.models.client_for(alias)

    def counter_for(self, model_name: str) -> TokenCounter:
        """The tokenizer of `model_name`: a session's budgets follow its model (SPEC §5.5)."""
        return self.models.counter_for(model_name, self.config.current.model.name)
