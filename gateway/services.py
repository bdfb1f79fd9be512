"""The shared services a running gateway hands to its parts (one object, no globals)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.background import Background
from gateway.cluster.leases import Leases, SoloLeases
from gateway.config.holder import ConfigHolder
from gateway.config.schema import Config
from gateway.model.slots import ModelSlots
from gateway.ops.metrics import Metrics
from gateway.skills.catalog import NO_SKILLS, Skills
from gateway.store.api import StoreBackend
from gateway.tools.registry import ToolRegistry

if TYPE_CHECKING:
    from context.tokens import TokenCounter
    from gateway.model.client import ModelClient


@dataclass
class Services:
    config: ConfigHolder
    data_dir: Path
    store: StoreBackend
    metrics: Metrics
    counter: TokenCounter
    tools: ToolRegistry
    # "main" (`model`), "summary" (`summary_model`), "alias:<name>" (each `models.<name>`).
    models: dict[str, ModelClient] = field(default_factory=dict)
    counters: dict[str, TokenCounter] = field(default_factory=dict)  # by model name, besides `counter`
    memory: Any = None  # gateway.memory.files.Memory when available
    usage: Any = None  # gateway.turns.usage.Usage
    mcp: Any = None  # gateway.tools.mcp.McpManager
    tasks: Any = None  # gateway.jobs.tasks.TaskScheduler
    media: Any = None  # gateway.media.Media: files people send (SPEC §5.4)
    approvals: Any = None  # gateway.approvals.Approvals: tools that wait for a person's yes (SPEC §5.7)
    # The skills found now (SPEC §5.6); the wiring passes its watcher's, which follows edits.
    skills: Callable[[], Skills] = field(default=lambda: NO_SKILLS)
    background: Background = field(default_factory=lambda: Background("gateway"))
    model_slots: ModelSlots = field(default_factory=lambda: ModelSlots(32))
    # Shared with other gateways on PostgreSQL (SPEC §10); a lone gateway holds every lease.
    leases: Leases = field(default_factory=SoloLeases)

    @property
    def cfg(self) -> Config:
        return self.config.current

    @property
    def model(self) -> ModelClient:
        return self.models["main"]

    @property
    def summary_model(self) -> ModelClient:
        return self.models.get("summary") or self.models["main"]

    def client_for(self, alias: str | None) -> ModelClient:
        """The client of model `alias` (`model` for None); `model`'s when a reload took it away."""
        if alias is None:
            return self.model
        return self.models.get(f"alias:{alias}") or self.model

    def counter_for(self, model_name: str) -> TokenCounter:
        """The tokenizer of `model_name`: a session's budgets follow its model (SPEC §5.5)."""
        if model_name == self.cfg.model.name:
            return self.counter
        return self.counters.get(model_name, self.counter)
