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
    models: dict[str, ModelClient] = field(default_factory=dict)  # "main", "summary"
    memory: Any = None  # gateway.memory.files.Memory when available
    usage: Any = None  # gateway.turns.usage.Usage
    mcp: Any = None  # gateway.tools.mcp.McpManager
    tasks: Any = None  # gateway.jobs.tasks.TaskScheduler
    media: Any = None  # gateway.media.Media: files people send (SPEC §5.4)
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
