"""The shared services a running gateway hands to its parts (one object, no globals)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.background import Background
from gateway.cluster import Leases, SoloLeases
from gateway.config import Config
from gateway.metrics import Metrics
from gateway.slots import ModelSlots
from gateway.store_api import StoreBackend
from gateway.tools.registry import ToolRegistry

if TYPE_CHECKING:
    from context.tokens import TokenCounter
    from gateway.model import ModelClient


class ConfigHolder:
    """The running config snapshot; replaced whole on reload, never mutated."""

    def __init__(self, config: Config, path: Path | None, base_dir: Path) -> None:
        self.current = config
        self.path = path
        self.base_dir = base_dir.absolute()
        # Fixed at start: data_dir is a restart-only key, so a reload never splits the data
        # between the old directory (the open database) and a new one.
        self.data_dir = config.data_path(self.base_dir)
        self.version = 1

    def swap(self, config: Config) -> None:
        self.current = config
        self.version += 1


@dataclass
class Services:
    config: ConfigHolder
    data_dir: Path
    store: StoreBackend
    metrics: Metrics
    counter: TokenCounter
    tools: ToolRegistry
    models: dict[str, ModelClient] = field(default_factory=dict)  # "main", "summary"
    memory: Any = None  # gateway.memory.Memory when available
    usage: Any = None  # gateway.usage.Usage
    mcp: Any = None  # gateway.tools.mcp.McpManager
    tasks: Any = None  # gateway.tasks.TaskScheduler
    media: Any = None  # gateway.media.Media: files people send (SPEC §5.4)
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
