"""What the operator's views show of the running gateway: /readyz's checks and details, and
the admin page's channel, model, cluster, job, tool-source and live-session state.

Built by the wiring from the parts it reads; the parts above this layer (the channel hub,
the sessions, the tools, the jobs) are the small protocols below, which they satisfy."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, Protocol

from gateway.cluster.leases import Leases
from gateway.config.holder import ConfigHolder
from gateway.config.schema import ModelConfig
from gateway.ops.admin import ToolSourceState, describe_tool_sources
from gateway.ops.metrics import Metrics
from gateway.store.api import StoreBackend


class ChannelStates(Protocol):
    """The running channels (gateway/hub.py's ChannelHub)."""

    def readiness(self) -> dict[str, str | None]: ...

    def leader_roles(self) -> dict[str, str]: ...

    def leader_leases(self) -> dict[str, str]: ...


class LiveContexts(Protocol):
    """The sessions live on this gateway (gateway/turns/sessions.py's SessionManager)."""

    async def context_numbers(self, key: str) -> dict[str, Any] | None: ...


class ToolSources(Protocol):
    """The tool registry (gateway/tools/registry.py)."""

    @property
    def sources(self) -> Sequence[object]: ...


class ServerState(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def public_state(self) -> str: ...


class ToolServers(Protocol):
    """The MCP servers (gateway/tools/mcp.py's McpManager)."""

    def statuses(self) -> Sequence[ServerState]: ...


class JobClock(Protocol):
    """The scheduled jobs (gateway/jobs/scheduler.py's Scheduler)."""

    def next_runs(self) -> dict[str, datetime | None]: ...


class AdminState:
    def __init__(self, *, config: ConfigHolder, store: StoreBackend, metrics: Metrics, leases: Leases,
                 channels: ChannelStates, sessions: LiveContexts, tools: ToolSources, servers: ToolServers,
                 jobs: JobClock) -> None:
        self.config = config
        self.store = store
        self.metrics = metrics
        self.leases = leases
        self.channels = channels
        self.sessions = sessions
        self.tools = tools
        self.servers = servers
        self.jobs = jobs

    async def ready(self) -> dict[str, str | None]:
        """Each check's problem (None when fine), for /readyz and the admin page."""
        checks: dict[str, str | None] = {"database": await self.store.write_problem()}
        if self.leases.shared:
            checks["cluster"] = self.leases.problem()
        checks.update(self.channels.readiness())
        return checks

    def ready_details(self) -> dict[str, Any]:
        """What /readyz shows besides its checks: MCP servers' states, which never make the
        gateway unready (a server that is down only removes its tools)."""
        details: dict[str, Any] = {}
        if self.leases.shared:
            details["cluster"] = {"instance": self.leases.instance, "leases": self.leases.held()}
        roles = self.channels.leader_roles()
        if roles:
            details["receiving"] = roles  # standby is never "not ready"
        # /readyz needs no token: a state per server, never its error text.
        details["mcp"] = {status.name: {"state": status.public_state} for status in self.servers.statuses()}
        return details

    def receiving(self) -> dict[str, str]:
        """For each channel received on one gateway at a time: whether this one does."""
        return self.channels.leader_roles()

    def next_runs(self) -> dict[str, datetime | None]:
        return self.jobs.next_runs()

    def tool_sources(self) -> list[ToolSourceState]:
        """Each tool source's state (MCP servers and the like)."""
        return describe_tool_sources(self.tools.sources)

    def models(self) -> dict[str, Any]:
        """Each configured model's calls, last success and last error since the start, and
        the fallbacks used (gateway_model_fallbacks_total)."""
        cfg, metrics = self.config.current, self.metrics
        roles: list[tuple[str, ModelConfig]] = [("model", cfg.model),
                                                 *((f"models.{a}", cfg.model_for(a)) for a in cfg.models)]
        if cfg.summary_model is not None:
            roles.append(("summary_model", cfg.summary_model))
        models = []
        for role, settings in roles:
            calls = metrics.model_health.get(settings.name)
            models.append({"role": role, "name": settings.name, "has_key": settings.key_value() is not None,
                           "calls": calls.calls, "failures": dict(calls.failures), "last_ok_at": calls.last_ok_at,
                           "last_error": calls.last_error})
        fallbacks = [{"from": a, "to": b, "times": n} for a, b, n in metrics.fallbacks_used()]
        return {"models": models, "fallbacks": fallbacks}

    async def session_context(self, key: str) -> dict[str, Any] | None:
        """A session's /context numbers while it is live on this gateway (else None)."""
        return await self.sessions.context_numbers(key)

    async def cluster(self) -> dict[str, Any] | None:
        """The gateways sharing the database, or None for a lone gateway."""
        leases = self.leases
        if not leases.shared:
            return None
        leaders = await leases.holders("leader:")
        # Who receives each channel that one gateway at a time receives; None: nobody does.
        receivers = {name: leaders.get(lease) for name, lease in self.channels.leader_leases().items()}
        return {"instance": leases.instance, "gateways": sorted(await leases.alive_instances()),
                "leases": leases.held(), "receivers": receivers}
