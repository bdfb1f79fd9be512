"""Builds a running gateway from a config snapshot; starts and stops its parts in order."""

from __future__ import annotations

import asyncio
import errno
import importlib
import inspect
import logging
import os
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo

from channels.base import ApprovalCard, ApprovalChannel, ChannelHooks
from context.engine import context_stats
from context.tokens import TokenCounter
from gateway.access import Pairing
from gateway.approvals import Approvals
from gateway.cluster.leadership import Leadership
from gateway.cluster.leases import open_leases
from gateway.config.changes import change_effect, changed_keys
from gateway.config.chat import ChatSettings
from gateway.config.checks import config_warnings, startup_problems
from gateway.config.holder import ConfigHolder
from gateway.config.load import ConfigError
from gateway.config.reload import ConfigWatcher
from gateway.config.schema import Config, secret_text
from gateway.hooks import Hooks
from gateway.http import web_token
from gateway.http.server import HttpServer, build_app, build_probe_app
from gateway.http.throttle import AuthThrottle
from gateway.jobs.tasks import TaskScheduler
from gateway.keys import session_key, workspace_dir
from gateway.media import Media, ReplyFile
from gateway.model.client import ModelClient
from gateway.model.slots import ModelSlots
from gateway.ops.admin import AdminApi, RecentErrors, ToolSourceState, describe_tool_sources
from gateway.ops.logs import REDACTOR, set_log_level
from gateway.ops.metrics import Metrics
from gateway.services import Services
from gateway.skills.watcher import SkillWatcher
from gateway.store.backends import open_store
from gateway.store.errors import StoreError
from gateway.tools.exec import ExecTools
from gateway.tools.mcp import McpManager
from gateway.tools.registry import ToolRegistry
from gateway.tools.web import WebTools
from gateway.turns.agent import Agent
from gateway.turns.commands import BOT_COMMANDS, Commands
from gateway.turns.leased_sessions import ClusterSessionManager
from gateway.turns.router import Router
from gateway.turns.sessions import SessionManager
from gateway.turns.summaries import Summarizer
from gateway.turns.usage import Usage
from gateway.types import Inbound, Message
from gateway.workspace import restrict_mode

if TYPE_CHECKING:
    from channels.base import ReplyRefSink, ReplyStream, StreamObserver
    from channels.web.adapter import HistoryItem

log = logging.getLogger("gateway.app")

SHUTDOWN_TIMEOUT_S = 20.0

# The messaging platforms a gateway can run: `channels.<name>` of the config → the package
# under channels/ whose `from_config(section, hooks)` builds it. A new platform is one
# folder there and one line here.
PLATFORMS: dict[str, str] = {
    "telegram": "channels.telegram",
    "slack": "channels.slack",
    "discord": "channels.discord",
}


class CurrentSummaryModel:
    """The summary model of the running config, also after a reload swapped the clients."""

    def __init__(self, services: Services) -> None:
        self.services = services

    async def complete(self, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
        async with self.services.model_slots:
            return await self.services.summary_model.complete(messages, **kwargs)


class StartupError(Exception):
    """A problem that makes starting pointless (bad data dir, unreadable database)."""


def secret_values(cfg: Config) -> list[str]:
    values: list[str | None] = []
    for model in (cfg.model, cfg.summary_model):
        if model is not None:
            values.append(model.key_value())
    t, s, w = cfg.channels.telegram, cfg.channels.slack, cfg.channels.web
    for alias in cfg.models:  # every alias's key, also one that inherits `model`'s
        values.append(cfg.model_for(alias).key_value())
    for secret in (t.token, t.webhook_secret, s.bot_token, s.app_token, s.signing_secret, w.token,
                   cfg.channels.discord.token,
                   cfg.http.admin_token, cfg.tools.web_search.api_key, cfg.transcription.api_key):
        if secret is not None:
            values.append(secret.get_secret_value())
    for hook in cfg.hooks.values():
        if hook.secret is not None:
            values.append(hook.secret.get_secret_value())
    for server in cfg.mcp.servers.values():  # what MCP servers are given to authenticate
        for secret in (*server.env.values(), *server.headers.values()):
            if secret is not None:
                values.append(secret.get_secret_value())
    return [v for v in values if v]


def check_data_dir(path: Path) -> None:
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as err:
        raise StartupError(f"cannot create the data directory {path}: {err.strerror or err}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise StartupError(f"the data directory {path} is not writable by this user; fix its permissions "
                           "or set data_dir in config.json")
    # Conversations and memory are private to the service's user, also in an older data dir.
    for private in (path, path / "scopes"):
        restrict_mode(private)


class Gateway:
    def __init__(self, config: Config, *, config_path: Path | None, base_dir: Path | None = None,
                 serve_http: bool = True, enable_channels: bool = True, watch_config: bool = False) -> None:
        base = base_dir or (config_path.parent if config_path else Path.cwd())
        self.holder = ConfigHolder(config, config_path, base)
        self.serve_http = serve_http
        self.enable_channels = enable_channels
        # `run` and `chat` follow edits of config.json (SPEC §2 hot reload); tests opt in.
        self.watch_config = watch_config and config_path is not None
        self.channels: dict[str, Any] = {}
        # Channels whose receiving side runs on one gateway of a cluster at a time.
        self.leaderships: dict[str, Leadership] = {}
        self.http: HttpServer | None = None
        self.services: Services | None = None
        self.scheduler: Any = None
        self.watcher: Any = None
        self.chat_settings: ChatSettings | None = None  # /config changes kept in the database
        self.mcp: McpManager | None = None
        self.exec_tools: ExecTools | None = None
        self.tasks: TaskScheduler | None = None
        self.skill_watcher: SkillWatcher | None = None  # follows the skills' folders (SPEC §5.6)
        self._model_cfgs: tuple[Any, ...] = self._model_settings(config)  # the clients' settings
        self._applied = config  # the snapshot apply_config last brought the running parts to
        self.recent_errors = RecentErrors()  # the admin page's last warnings and errors
        self.own_web_token: str | None = None  # the data dir's web token (gateway/http/web_token.py)

    # -- wiring ------------------------------------------------------------------------

    @property
    def cfg(self) -> Config:
        return self.holder.current

    def _models(self, cfg: Config, metrics: Metrics) -> dict[str, ModelClient]:
        def on_call(record: Any) -> None:
            metrics.model_calls.labels(getattr(record, "outcome", "ok")).inc()
            metrics.model_health.record(record.model, record.outcome, record.status, record.detail)
            seconds = getattr(record, "seconds", None)
            if seconds is not None:
                metrics.model_latency.observe(seconds)

        models = {"main": ModelClient(cfg.model, on_call=on_call)}
        if cfg.summary_model is not None:
            models["summary"] = ModelClient(cfg.summary_model, on_call=on_call)
        for alias in cfg.models:
            models[f"alias:{alias}"] = ModelClient(cfg.model_for(alias), on_call=on_call)
        return models

    @staticmethod
    def _model_settings(cfg: Config) -> tuple[Any, ...]:
        """What the model clients are built from: a change rebuilds them."""
        return (cfg.model, cfg.summary_model, tuple(sorted((a, cfg.model_for(a)) for a in cfg.models)))

    @staticmethod
    def _counters(cfg: Config) -> dict[str, TokenCounter]:
        """A tokenizer per model name the aliases use (loading one takes a while: off the loop)."""
        names = {cfg.model_for(alias).name for alias in cfg.models} - {cfg.model.name}
        return {name: TokenCounter(name) for name in names}

    def startup_problems(self, cfg: Config) -> list[str]:
        """What in `cfg` this gateway could not run with (its channels and HTTP server)."""
        return startup_problems(cfg, channels=self.enable_channels, http=self.serve_http)

    async def start(self) -> None:
        cfg = self.cfg
        problems = self.startup_problems(cfg)
        if problems:
            raise ConfigError(problems)
        data_dir = self.holder.data_dir
        await asyncio.to_thread(check_data_dir, data_dir)
        if self.serve_http:
            try:  # the web API's token while channels.web.token is unset, made at the first start
                self.own_web_token = await asyncio.to_thread(web_token.load_or_create, data_dir)
            except OSError as err:
                raise StartupError(f"the web token: {err}") from None
        REDACTOR.set_secrets(self.secret_values(cfg))
        try:
            store = await open_store(secret_text(cfg.store.url), data_dir)
        except StoreError as err:
            raise StartupError(str(err)) from None
        try:
            # With other gateways, the settings changed in chat go over this gateway's file.
            self.chat_settings = ChatSettings(store, self.holder, check=self.startup_problems, apply=self.apply_config)
            if await self.chat_settings.join():
                cfg = self._applied = self.cfg
                self._model_cfgs = self._model_settings(cfg)
            leases = open_leases(store)
            await leases.start()
        except (ValueError, OSError, TimeoutError, StoreError) as err:
            await store.close()
            raise StartupError(f"cannot join the other gateways on the database: {err}") from None
        try:
            metrics = Metrics()
            metrics.watch_store(store.write_stats)
            metrics.leases_held.set_function(leases.held)
            counter = await asyncio.to_thread(TokenCounter, cfg.model.name)
            counters = await asyncio.to_thread(self._counters, cfg)
            services = Services(
                config=self.holder, data_dir=data_dir, store=store, metrics=metrics, counter=counter,
                tools=ToolRegistry.default(cfg), models=self._models(cfg, metrics),
                model_slots=ModelSlots(cfg.limits.max_concurrent_model_calls), leases=leases, counters=counters,
            )
            services.tools.add_source(WebTools(lambda: self.holder.current))  # follows reloads
            self.exec_tools = ExecTools(lambda: self.holder.current)  # also follows reloads
            services.tools.add_source(self.exec_tools)
            await self.exec_tools.prepare()  # probes the sandbox when exec is on
            services.memory = self._memory(services)
            services.usage = Usage(store)
            services.media = Media(lambda: self.holder.current)
            # Found before the first turn; followed from the end of the start (below).
            self.skill_watcher = SkillWatcher(cfg.skills.paths(self.holder.base_dir))
            await self.skill_watcher.load()
        except BaseException:
            # Nothing of this is self.services yet, so stop() would not close it: the
            # store's worker thread left open kept the process from ever exiting.
            await leases.stop()
            await store.close()
            raise
        services.skills = self.skill_watcher.skills
        self.services = services
        summarizer = Summarizer(services)
        self.agent = Agent(services, summarizer)
        # On a shared database the session queue is the database and turns run under leases.
        if leases.shared:
            self.sessions = ClusterSessionManager(services, self.agent, deliver=self.deliver, typing=self.typing,
                                                  stream=self.stream, send_files=self.send_files,
                                                  keys=lambda inbound: self.router.keys(inbound),
                                                  can_deliver=lambda channel: channel in self.channels)
        else:
            self.sessions = SessionManager(services, self.agent, deliver=self.deliver, typing=self.typing,
                                           stream=self.stream, send_files=self.send_files)
        services.approvals = Approvals(store, config=lambda: self.holder.current, show=self.show_approval,
                                       settle=self.settle_approval)
        self.pairing = Pairing(store, notify=self.tell_person)  # approvals are told in the person's chat
        self.commands = Commands(services, self.sessions, self.pairing, reply=self.deliver,
                                 on_config_change=self._apply_config_later, check=self.startup_problems,
                                 settings=self.chat_settings)
        self.router = Router(services, self.sessions, self.commands, self.pairing, reply=self.deliver)
        # People's scheduled tasks: a run is a turn in its session, answered where the
        # task was made; it runs only while that channel is up here.
        self.tasks = services.tasks = TaskScheduler(services, self.sessions, admits=self.router.admits,
                                                    can_deliver=lambda channel: channel in self.channels)

        if self.enable_channels:
            self._build_channels(cfg)
        if self.serve_http:
            extra = self.channels["web"].routes() if "web" in self.channels else []
            extra += self._admin(services).routes()
            extra += Hooks(services, self.sessions).routes()  # POST /hooks/<name> (SPEC §5.9)
            app = build_app(ready=self.ready, metrics=lambda: (metrics.render(), metrics.content_type),
                            channel=self.channels.get, extra_routes=extra, ready_details=self.ready_details)
            probes = build_probe_app(ready=self.ready, ready_details=self.ready_details) \
                if cfg.http.probe_port is not None else None
            self.http = HttpServer(app, cfg.http, probes=probes)
            try:
                await self.http.start()
            except OSError as err:
                (key, failed), self.http = self.http.binding, None
                self.services = None  # nothing else started yet: stop() has nothing left to do
                await leases.stop()
                await store.close()
                self.recent_errors.uninstall()
                raise StartupError(listen_problem(cfg.http.host, failed, err, key)) from None
        # MCP servers connect in the background (readiness never waits for them); their
        # tools join the registry as each one is ready.
        self.mcp = services.mcp = McpManager(base_dir=self.holder.base_dir, log_dir=data_dir / "mcp",
                                                data_dir=data_dir, metrics=metrics)
        services.tools.add_source(self.mcp)
        await self.mcp.apply(cfg.mcp)
        # Turns accepted before a restart queue first, so they keep their place ahead of
        # messages arriving now; workers start once the channels can deliver replies.
        # With other gateways, their waiting turns are theirs: this one's sweep takes over
        # only sessions whose lease expired (gateway/turns/leased_sessions.py).
        pending_commands = [] if leases.shared else await self.router.resume_pending(set(self.channels))
        for name, channel in list(self.channels.items()):
            await self._start_channel(name, channel)
        self.sessions.open.set()
        if isinstance(self.sessions, ClusterSessionManager):
            self.sessions.on_leftover_command = lambda inbound: self.router.answer_commands([inbound])
            self.sessions.start_sweeping()
        await self.router.answer_commands(pending_commands)
        await services.approvals.start()  # waits a restart cut are denies, their cards updated
        await self._start_scheduler()
        await self.tasks.start()
        for client in services.models.values():
            services.background.spawn(client.warm_up(), name="model-warm-up")
        for line in self.startup_lines():
            log.info(line)
        for warning in config_warnings(cfg):
            log.warning(warning)
        await self.skill_watcher.start()
        if self.watch_config:
            self.watcher = self.config_watcher()
            await self.watcher.start()
        await self.chat_settings.start()  # on a shared store: follows the other gateways' /config

    def config_watcher(self) -> ConfigWatcher:
        """What follows edits of config.json for this gateway (SPEC §2 hot reload)."""
        assert self.chat_settings is not None, "started first"
        # With other gateways, the settings changed in chat stay on top of the file.
        return ConfigWatcher(self.holder, parse=self.chat_settings.from_text, check=self.startup_problems,
                             apply=self.apply_config, notify=self.tell_admins)

    def secret_values(self, cfg: Config) -> list[str]:
        """What the log masks: the config's secrets and the data dir's web token."""
        return [*secret_values(cfg), *([self.own_web_token] if self.own_web_token else [])]

    def _web_settings(self, cfg: Config) -> dict[str, Any]:
        configured = secret_text(cfg.channels.web.token)
        return {"token": configured or self.own_web_token, "max_chars": cfg.limits.max_inbound_chars,
                "reply_timeout_s": cfg.limits.turn_timeout_s + 15}

    @property
    def web_token(self) -> str | None:
        """The token the web API asks for now (None: no web chat here)."""
        web = self.channels.get("web")
        return web.token if web is not None else None

    def web_link(self) -> str | None:
        """The address that signs a browser in to the web chat, when the token is the data
        dir's own (a configured token is the operator's to hand out: never printed)."""
        if self.http is None or "web" not in self.channels or self.web_token != self.own_web_token:
            return None
        assert self.own_web_token is not None
        return web_token.link(self.cfg.http.host, self.http.port, self.own_web_token)

    def startup_lines(self) -> list[str]:
        """The start banner: each channel and what it is doing, the MCP servers."""
        cfg = self.cfg
        lines = []
        if "web" in self.channels and self.http is not None:
            lines.append(f"web chat on http://{cfg.http.host}:{self.http.port}/")
        else:
            lines.append("web chat: off")
        if self.http is not None and self.http.probe_port is not None:
            lines.append(f"probes on http://{cfg.http.host}:{self.http.probe_port}/healthz and /readyz")
        telegram = self.channels.get("telegram")
        if telegram is None:
            lines.append("telegram: off")
        else:
            me = getattr(telegram, "identity", None)
            lines.append(f"telegram: {cfg.channels.telegram.mode} as @{me.username}" if me is not None
                         else "telegram: not connected (see the error above; /readyz tells when it is)")
        slack = self.channels.get("slack")
        if slack is None:
            lines.append("slack: off")
        else:
            who = getattr(slack, "bot_user_id", None)
            mode = "socket mode" if cfg.channels.slack.mode == "socket" else "events over HTTP"
            lines.append(f"slack: {mode} as {who}" if who
                         else "slack: not connected (see the error above; /readyz tells when it is)")
        discord = self.channels.get("discord")
        if discord is None:
            lines.append("discord: off")
        else:
            bot = getattr(discord, "identity", None)
            lines.append(f"discord: gateway websocket as {bot.name} ({bot.id})" if bot is not None
                         else "discord: not connected (see the error above; /readyz tells when it is)")
        if "terminal" in self.channels:
            lines.append("terminal chat: this terminal (session terminal:local)")
        servers = sum(1 for server in cfg.mcp.servers.values() if server.enabled)
        lines.append(f"MCP servers: {servers} (connecting in the background)" if servers else "MCP servers: none")
        return lines

    def _admin(self, services: Services) -> AdminApi:
        self.recent_errors.install()
        return AdminApi(config=lambda: self.cfg, store=services.store, pairing=self.pairing, ready=self.ready,
                        next_runs=lambda: self.scheduler.next_runs() if self.scheduler is not None else {},
                        tool_sources=self.tool_sources_state, errors=self.recent_errors,
                        http_host=self.cfg.http.host, receiving=self.leader_roles, cluster=self.cluster_state,
                        throttle=self._auth_throttle("admin"), models=self.model_state,
                        session_context=self.session_context)

    def model_state(self) -> dict[str, Any]:
        """The admin page's model state: each configured model's calls, last success and
        last error since the start, and the fallbacks used (gateway_model_fallbacks_total)."""
        if self.services is None:
            return {"models": [], "fallbacks": []}
        cfg, metrics = self.cfg, self.services.metrics
        roles: list[tuple[str, Any]] = [("model", cfg.model), *((f"models.{a}", cfg.model_for(a)) for a in cfg.models)]
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
        live = self.sessions.live.get(key) if self.services is not None else None
        if live is None or self.services is None:
            return None
        cfg = self.cfg
        plan = self.agent.step(live, cfg)
        stats = context_stats(live.ctx, system_prompt=await self.agent.system_prompt(live, cfg),
                              tools=self.agent.tool_schemas(plan.view), budget=cfg.context_budget(plan.model),
                              counter=self.services.counter_for(plan.model.name))
        last = stats.last_event
        return {"messages": stats.messages, "user": stats.user_messages, "assistant": stats.assistant_messages,
                "tool": stats.tool_messages, "tokens": stats.estimated_tokens, "budget": stats.budget_tokens,
                "turns": stats.turns, "max_turns": stats.max_turns, "summary": stats.summary_present,
                "model": plan.model.name, "last_model": live.last_model,
                "last_trim": None if last is None else {
                    "strategy": str(last.strategy), "tokens_before": last.tokens_before,
                    "tokens_after": last.tokens_after}}

    def _auth_throttle(self, api: str) -> AuthThrottle:
        """Failed token checks of one API, per address, counted in gateway_auth_failures_total."""
        assert self.services is not None
        return AuthThrottle(api, on_failure=self.services.metrics.auth_failures.labels(api).inc)

    async def cluster_state(self) -> dict[str, Any] | None:
        """The gateways sharing the database (admin page), or None for a lone gateway."""
        if self.services is None or not self.services.leases.shared:
            return None
        leases = self.services.leases
        leaders = await leases.holders("leader:")
        # Who receives each channel that one gateway at a time receives; None: nobody does.
        receivers = {name: leaders.get(lead.name) for name, lead in self.leaderships.items()}
        return {"instance": leases.instance, "gateways": sorted(await leases.alive_instances()),
                "leases": leases.held(), "receivers": receivers}

    def tool_sources_state(self) -> list[ToolSourceState]:
        """Each tool source's state (MCP servers and the like) for the admin page."""
        return describe_tool_sources(self.services.tools.sources) if self.services is not None else []

    def _memory(self, services: Services) -> Any:
        try:
            from gateway.memory.files import Memory
        except ImportError:
            return None
        tz = ZoneInfo(services.cfg.timezone) if services.cfg.timezone else None
        return Memory(services.data_dir, tz=tz or _local_tz(), store=services.store)

    async def _start_scheduler(self) -> None:
        assert self.services is not None
        try:
            from gateway.jobs.scheduler import Scheduler
        except ImportError:
            return
        s = self.services
        self.scheduler = Scheduler(
            s.cfg, store=s.store, memory=s.memory, model=CurrentSummaryModel(s),
            live_references=self.live_tool_results,
            metrics=lambda job, outcome: s.metrics.job_runs.labels(job, outcome).inc(), leases=s.leases,
            remember=self.agent.summarizer.remember,
        )
        await self.scheduler.start()

    def live_tool_results(self) -> set[Path]:
        refs: set[Path] = set()
        for live in self.sessions.live.values():
            for m in live.ctx.messages:
                if m.truncation is not None and m.truncation.saved:
                    refs.add(live.workspace / m.truncation.path)  # resolved by the purge, off the loop
        return refs

    def workspace_for(self, inbound: Inbound) -> Path:
        # No mkdir here (it runs on the loop): adapters create directories off the loop.
        return workspace_dir(self.holder.data_dir, self.router.keys(inbound)[1])  # the bound agent's scope

    def _build_channels(self, cfg: Config) -> None:
        from channels.web.adapter import WebChannel

        if cfg.channels.web.enabled and self.serve_http:
            self.channels["web"] = WebChannel(self.router.handle, http_host=cfg.http.host,
                                              history=self.web_history, decide=self.decide_approval,
                                              throttle=self._auth_throttle("web"),
                                              **self._web_settings(cfg),
                                              **self.stream_settings(WebChannel, "web"))
        for name in PLATFORMS:
            channel = self._make_channel(name, cfg)
            if channel is not None:
                self.channels[name] = channel

    async def web_history(self, session: str, limit: int,
                          before: tuple[int, int] | None) -> tuple[list[HistoryItem], tuple[int, int] | None]:
        """A page of the web page's view of a session: what was said and the commands'
        answers, oldest first, a divider where a fresh context started (bounded in size:
        the store reads no more than the page holds)."""
        from channels.web.adapter import HistoryItem, with_dividers

        assert self.services is not None
        store = self.services.store
        key = session_key(Inbound(channel="web", chat_id=session, user_id=session, text="", event_id=""))
        page = await store.conversation_page(key, limit=limit, before=before)
        row = await store.get_session(key)
        items: list[HistoryItem] = []
        for entry in page.entries:
            if isinstance(entry, Message):
                items.append(HistoryItem(entry.role, entry.content, entry.created_at, turn=entry.turn))
            else:
                items += [HistoryItem("user", entry.command, entry.created_at, "command", entry.turn),
                          HistoryItem("assistant", entry.answer, entry.created_at, "command", entry.turn,
                                      entry.fresh_context)]
        context_start = row.context_start_turn if row is not None else 1
        return with_dividers(items, context_start, newest=before is None), page.older

    def _make_channel(self, name: str, cfg: Config) -> Any:
        section = getattr(cfg.channels, name)
        if not section.enabled:
            return None
        hooks = ChannelHooks(handle=self.router.handle, admits=self.router.admits, workspace_for=self.workspace_for,
                             file_limit=self.file_limit, stream_interval=self.stream_interval,
                             observe=self.stream_observer(name), commands=BOT_COMMANDS,
                             decide=self.decide_approval)
        return importlib.import_module(PLATFORMS[name]).from_config(section, hooks)

    def stream_observer(self, channel: str) -> StreamObserver:
        """Counts a channel's stream events in /metrics (gateway_stream_events_total)."""
        assert self.services is not None
        return self.services.metrics.stream_observer(channel)

    def file_limit(self) -> int:
        """`limits.max_inbound_file_mb` of the running config, in bytes: channels read it
        per file, so a reload applies without restarting them."""
        return self.cfg.limits.max_inbound_file_bytes

    def stream_interval(self) -> float:
        """`stream_interval_s` of the running config: channels read it per update, so a
        reload applies to the next update without restarting them."""
        return self.cfg.stream_interval_s

    def stream_settings(self, factory: Callable[..., Any], channel: str) -> dict[str, Any]:
        """The streaming keyword arguments a channel's constructor takes: `observe`
        (a StreamObserver for this channel) and `stream_interval` (a callable returning
        the current `stream_interval_s`)."""
        try:
            accepted = inspect.signature(factory).parameters
        except (TypeError, ValueError):
            return {}
        settings: dict[str, Any] = {}
        if "observe" in accepted:
            settings["observe"] = self.stream_observer(channel)
        if "stream_interval" in accepted:
            settings["stream_interval"] = self.stream_interval
        return settings

    async def _start_channel(self, name: str, channel: Any) -> None:
        try:
            if getattr(channel, "exclusive_receiver", False) and self.services is not None:
                # Replies may go out from any gateway; receiving runs where the lead is.
                await asyncio.wait_for(channel.start_sending(), timeout=60)
                await self._lead(name, channel)
            else:
                await asyncio.wait_for(channel.start(), timeout=60)
        except Exception as err:
            # One broken channel must not take the others down; /readyz shows it.
            log.error("channel failed to start", extra={"channel": name, "error": str(err)[:300]})

    async def _lead(self, name: str, channel: Any) -> None:
        """Receive for `name` (Telegram polling, Slack Socket Mode) on one gateway of the
        cluster at a time (SPEC §10); a gateway alone leads at once."""
        assert self.services is not None
        leases, gauge = self.services.leases, self.services.metrics.leader.labels(name)

        async def start() -> None:
            await asyncio.wait_for(channel.start_receiving(), timeout=60)
            gauge.set(1)

        async def stop() -> None:
            gauge.set(0)
            # Still held: a shutdown or restart hands over cleanly. Lost: another gateway
            # may receive already.
            await channel.stop_receiving(lost=not leases.holds(leadership.name))

        leadership = Leadership(leases, name, start=start, stop=stop, healthy=channel.is_ready)
        gauge.set(0)
        self.leaderships[name] = leadership
        await leadership.begin()

    async def _stop_channel(self, name: str, channel: Any) -> None:
        """Let go of the lead first (another gateway takes over at once), then stop."""
        leadership = self.leaderships.pop(name, None)
        if leadership is not None:
            await leadership.end()
        await channel.stop()

    def leader_roles(self) -> dict[str, str]:
        """For each channel received on one gateway at a time: whether this one does."""
        return {name: lead.describe() for name, lead in self.leaderships.items()}

    async def _apply_config_later(self) -> None:
        # Not inline: the change may come from a command inside a channel's own handler,
        # and restarting that channel must not wait on itself.
        if self.services is not None:
            self.services.background.spawn(self.apply_config(), name="apply-config")

    async def apply_config(self) -> None:
        """Apply a new config snapshot: budgets apply by themselves at the next step;
        model clients and channels whose settings changed are rebuilt alone."""
        s = self.services
        if s is None:
            return
        cfg = self.cfg
        old, self._applied = self._applied, cfg
        later = [key for key in changed_keys(old, cfg) if change_effect(key) == "restart"]
        if later:
            log.warning("config change saved; these settings apply after a restart", extra={"keys": later})
        REDACTOR.set_secrets(self.secret_values(cfg))
        s.model_slots.resize(cfg.limits.max_concurrent_model_calls)
        web = self.channels.get("web")
        if web is not None:
            # Requests check these per call: a rotated token locks the old one out at once.
            for name, value in self._web_settings(cfg).items():
                setattr(web, name, value)
        if cfg.log_level != old.log_level:
            set_log_level(cfg.log_level)
        if cfg.timezone != old.timezone and s.memory is not None:
            s.memory.set_timezone(ZoneInfo(cfg.timezone) if cfg.timezone else _local_tz())
        if cfg.model.name != old.model.name:
            s.counter = await asyncio.to_thread(TokenCounter, cfg.model.name)  # its tokenizer
        old_models = s.models
        if self._model_settings(cfg) != self._model_cfgs:
            s.counters = await asyncio.to_thread(self._counters, cfg)
            s.models = self._models(cfg, s.metrics)
            self._model_cfgs = self._model_settings(cfg)
            for client in old_models.values():
                # Turns already talking to the old client finish on it.
                s.background.spawn(client.close(grace_s=cfg.model.timeout_s), name="close-model")
        if self.scheduler is not None:
            self.scheduler.update_config(cfg)
        if self.tasks is not None:
            self.tasks.update_config(cfg)
        if self.skill_watcher is not None and cfg.skills != old.skills:
            await self.skill_watcher.set_dirs(cfg.skills.paths(self.holder.base_dir))
        if self.exec_tools is not None:
            await self.exec_tools.prepare()
        if self.mcp is not None:
            await self.mcp.apply(cfg.mcp)  # only the servers whose entries changed restart
        # A gateway started without the messaging channels (`gateway chat`) never starts one
        # on a reload: `gateway run` beside it on the same config owns them (a second
        # Telegram poller would fight it for the bot with 409s).
        for name in PLATFORMS if self.enable_channels else ():
            section = getattr(cfg.channels, name)
            current = self.channels.get(name)
            if current is not None and getattr(current, "cfg", None) == section:
                continue
            if current is None and not section.enabled:
                continue
            log.info("restarting channel after a config change", extra={"channel": name})
            if current is not None:
                await self._stop_channel(name, current)
                del self.channels[name]
            replacement = self._make_channel(name, cfg)
            if replacement is not None:
                self.channels[name] = replacement
                await self._start_channel(name, replacement)

    async def tell_admins(self, text: str) -> None:
        """Best effort: a DM to each admin whose channel is up (Telegram/Slack user ids)."""
        for admin in self.cfg.admins:
            await self.tell_person(admin, text)

    async def tell_person(self, identity: str, text: str) -> bool:
        """A DM to one person (`telegram:7`) through their channel when it runs here (the
        chat id of a DM is the user id in Telegram and Discord; Slack opens the app's DM
        for a user id). False when it could not be sent."""
        channel_name, _, user_id = identity.partition(":")
        channel = self.channels.get(channel_name)
        if channel is None or channel_name not in PLATFORMS or not user_id:
            return False
        person = Inbound(channel=channel_name, chat_id=user_id, user_id=user_id, text="",
                         event_id=f"notice-{time.time()}")
        try:
            await asyncio.wait_for(channel.send(person, text), timeout=15)
        except Exception as err:
            log.warning("could not tell a person", extra={"identity": identity, "error": str(err)[:200]})
            return False
        return True

    # -- replies ------------------------------------------------------------------------

    async def deliver(self, inbound: Inbound, text: str) -> None:
        channel = self.channels.get(inbound.channel)
        if channel is None:
            log.warning("reply for a channel that is not running", extra={"channel": inbound.channel})
            if inbound.origin is not None:
                # No person's message waits here (a task's or a webhook's turn): the turn is
                # stored and recorded as undelivered rather than answered.
                raise ConnectionError(f"channel {inbound.channel} is not running")
            return
        await channel.send(inbound, text)

    async def show_approval(self, inbound: Inbound, card: ApprovalCard) -> str | None:
        """The approval card where the turn's message came from: buttons where the channel
        has them (ApprovalChannel), else the card as text answered with /allow or /deny."""
        channel = self.channels.get(inbound.channel)
        if channel is None:
            return None
        if isinstance(channel, ApprovalChannel):
            return await channel.ask_approval(inbound, card)
        await channel.send(inbound, card.text())
        return None

    async def settle_approval(self, inbound: Inbound, card: ApprovalCard, ref: str | None, outcome: str) -> None:
        channel = self.channels.get(inbound.channel)
        if channel is None:
            return
        if isinstance(channel, ApprovalChannel):
            await channel.settle_approval(inbound, card, ref, outcome)
        else:
            await channel.send(inbound, f"Approval {card.id}: {outcome}")

    async def decide_approval(self, approval_id: str, who: Inbound, allow: bool) -> str:
        """A click on a card's Allow or Deny (ChannelHooks.decide)."""
        if self.services is None or self.services.approvals is None:
            return "The gateway is shutting down; try again in a moment."
        return str(await self.services.approvals.decide(approval_id, who, allow))

    async def send_files(self, inbound: Inbound, files: list[ReplyFile]) -> None:
        """Files a reply names, through the channel when it can send files (else nothing)."""
        channel = self.channels.get(inbound.channel)
        send = getattr(channel, "send_files", None)
        if send is not None:
            await send(inbound, files)

    def stream(self, inbound: Inbound, *, on_ref: ReplyRefSink | None = None,
               resume_ref: str | None = None) -> ReplyStream | None:
        """The channel's stream for the reply to `inbound` (SPEC §5.1), or None: the
        channel cannot stream (no `stream`), streaming is off, or opening one failed; the
        reply then goes out whole through `deliver`."""
        channel = self.channels.get(inbound.channel)
        open_stream = getattr(channel, "stream", None)
        if open_stream is None:
            return None
        try:
            return open_stream(inbound, on_ref=on_ref, resume_ref=resume_ref)  # type: ignore[no-any-return]
        except Exception:
            log.exception("could not open a reply stream; sending the reply whole",
                          extra={"channel": inbound.channel})
            return None

    def typing(self, inbound: Inbound) -> AbstractAsyncContextManager[Any]:
        channel = self.channels.get(inbound.channel)
        if channel is None:
            return nullcontext()
        return channel.typing(inbound)  # type: ignore[no-any-return]

    def ready_details(self) -> dict[str, Any]:
        """What /readyz shows besides its checks: MCP servers' states, which never make the
        gateway unready (a server that is down only removes its tools)."""
        details: dict[str, Any] = {}
        if self.services is not None and self.services.leases.shared:
            leases = self.services.leases
            details["cluster"] = {"instance": leases.instance, "leases": leases.held()}
        if self.leaderships:
            details["receiving"] = self.leader_roles()  # standby is never "not ready"
        if self.mcp is not None:  # /readyz needs no token: a state per server, never its error text
            details["mcp"] = {status.name: {"state": status.public_state} for status in self.mcp.statuses()}
        return details

    async def ready(self) -> dict[str, str | None]:
        """Each check's problem (None when fine), for /readyz."""
        checks: dict[str, str | None] = {}
        if self.services is not None:
            checks["database"] = await self.services.store.write_problem()
            if self.services.leases.shared:
                checks["cluster"] = self.services.leases.problem()
        for name, channel in list(self.channels.items()):
            try:
                ok = bool(channel.is_ready())
            except Exception as err:  # a broken check says "not ready", it does not fail the probe
                log.warning("readiness check failed", extra={"channel": name, "error": repr(err)[:300]})
                checks[f"channel:{name}"] = f"channel {name}: readiness check failed ({type(err).__name__}: {err})"
                continue
            lead = self.leaderships.get(name)
            if ok and lead is not None and lead.failure is not None:
                # Granted the lead and could not receive: when every gateway says so, nobody does.
                checks[f"channel:{name}"] = f"channel {name}: cannot receive here ({lead.failure})"
                continue
            checks[f"channel:{name}"] = None if ok else f"channel {name}: not connected or not receiving yet"
        return checks

    # -- shutdown -----------------------------------------------------------------------

    def replies_in_flight(self) -> int:
        """Turns and commands running or queued: the replies a graceful stop waits for."""
        if self.services is None:
            return 0
        running = sum(1 for live in self.sessions.live.values() if live.worker is not None)
        return running + self.sessions.queued()

    async def stop(self, timeout: float = SHUTDOWN_TIMEOUT_S, *, now: asyncio.Event | None = None) -> None:
        """Stop intake, let in-flight turns finish (they are persisted step by step and
        resumed after a restart otherwise), close channels, flush the database. Setting
        `now` ends the wait for in-flight turns early (a second Ctrl+C)."""
        if self.services is None:
            return
        s = self.services
        if self.watcher is not None:
            await self.watcher.stop()
        if self.skill_watcher is not None:
            await self.skill_watcher.stop()
        if self.chat_settings is not None:
            await self.chat_settings.stop()
        if self.tasks is not None:
            await self.tasks.stop()  # first: a task firing now must not meet a closing queue
        waits: set[asyncio.Future[Any]] = {asyncio.ensure_future(self.sessions.stop(timeout))}
        if now is not None:
            waits.add(asyncio.ensure_future(now.wait()))
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in waits:
                waiting.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
        # Turns still running are cut now, before the channels go: none of them delivers
        # into a channel half stopped. What they stored stays; the next start resumes them.
        # A turn waiting for an approval ends that wait as a deny, and its card says why.
        if s.approvals is not None:
            s.approvals.closing = True
        cut = [live.worker for live in self.sessions.live.values() if live.worker is not None]
        for worker in cut:
            worker.cancel()
        if cut:
            await asyncio.wait(cut, timeout=5)
            log.warning("turns cut by the shutdown; they resume at the next start", extra={"count": len(cut)})
        for name, channel in list(self.channels.items()):
            try:
                await asyncio.wait_for(self._stop_channel(name, channel), timeout=10)
            except Exception as err:
                log.warning("channel did not stop cleanly", extra={"channel": name, "error": str(err)[:200]})
        if self.scheduler is not None:
            await self.scheduler.stop()
        if self.mcp is not None:
            await self.mcp.stop()  # calls still running are cancelled; server processes end
        if self.http is not None:
            await self.http.stop()
        self.recent_errors.uninstall()
        await s.background.close(timeout=5)
        for client in s.models.values():
            await client.close()
        await s.media.close()
        await s.leases.stop()  # last before the store: other gateways take over from here
        await s.store.close()
        self.services = None


def listen_problem(host: str, port: int, err: OSError, key: str = "http.port") -> str:
    """One line for a port that cannot be bound (aiohttp's own message repeats the address);
    `key` is the setting that names it."""
    if err.errno == errno.EADDRINUSE:
        return (f"cannot listen on {host}:{port}: the port is already in use (another gateway running?); "
                f"stop it or set {key} in config.json")
    if err.errno == errno.EACCES:
        return f"cannot listen on {host}:{port}: permission denied (ports below 1024 need privileges); set {key}"
    if err.errno == errno.EADDRNOTAVAIL:
        return f"cannot listen on {host}:{port}: {host} is not an address of this machine; check http.host"
    return f"cannot listen on {host}:{port}: {err.strerror or err}"




def _local_tz() -> Any:
    from datetime import datetime

    return datetime.now().astimezone().tzinfo
