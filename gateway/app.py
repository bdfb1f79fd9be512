"""Builds a running gateway from a config snapshot; starts and stops its parts in order.

The wiring only wires: at run time a message, its reply and an approval's card go from
part to part (channel → router → sessions → agent → the channel hub) without passing
through here. What changes on a reload is handed to the part that owns it."""

from __future__ import annotations

import asyncio
import errno
import importlib
import inspect
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo

from channels.base import Channel, ChannelHooks
from context.tokens import TokenCounter
from gateway.access import Pairing
from gateway.agents import Places
from gateway.approvals import Approvals
from gateway.cluster.leases import Leases, open_leases
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
from gateway.hub import ChannelHub
from gateway.jobs.scheduler import Scheduler
from gateway.jobs.tasks import TaskScheduler
from gateway.keys import session_key
from gateway.media import Media
from gateway.memory.files import Memory
from gateway.model.clients import CurrentSummaryModel, Models, alias_counters, build_clients, client_settings
from gateway.model.slots import ModelSlots
from gateway.ops.admin import AdminApi, RecentErrors
from gateway.ops.admin_state import AdminState
from gateway.ops.logs import REDACTOR, set_log_level
from gateway.ops.metrics import Metrics
from gateway.services import Services
from gateway.skills.watcher import SkillWatcher
from gateway.store.api import StoreBackend
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
    from channels.base import StreamObserver
    from channels.web.adapter import HistoryItem

log = logging.getLogger("gateway.app")

SHUTDOWN_TIMEOUT_S = 20.0
CUT_WAIT_S = 5.0  # turns cut by a shutdown: how long they get to end

# The messaging platforms a gateway can run: `channels.<name>` of the config → the package
# under channels/ whose `from_config(section, hooks)` builds it. A new platform is one
# folder there and one line here.
PLATFORMS: dict[str, str] = {
    "telegram": "channels.telegram",
    "slack": "channels.slack",
    "discord": "channels.discord",
}


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
        self.places = Places(self.holder)  # where a message belongs: session key, scope, workspace
        self._own_channels: dict[str, Channel] = {}  # add_channel's, besides the configured ones
        self.hub: ChannelHub | None = None  # the running channels, from the start
        self.http: HttpServer | None = None
        self.services: Services | None = None
        self.scheduler: Scheduler | None = None
        self.watcher: ConfigWatcher | None = None
        self.chat_settings: ChatSettings | None = None  # /config changes kept in the database
        self.mcp: McpManager | None = None
        self.exec_tools: ExecTools | None = None
        self.tasks: TaskScheduler | None = None
        self.skill_watcher: SkillWatcher | None = None  # follows the skills' folders (SPEC §5.6)
        self.admin_state: AdminState | None = None  # what /readyz and the admin page show
        self._applied = config  # the snapshot apply_config last brought the running parts to
        self.recent_errors = RecentErrors()  # the admin page's last warnings and errors
        self.own_web_token: str | None = None  # the data dir's web token (gateway/http/web_token.py)

    @property
    def cfg(self) -> Config:
        return self.holder.current

    @property
    def channels(self) -> Mapping[str, Channel]:
        """The running channels by name (none before the start)."""
        return self.hub.channels if self.hub is not None else self._own_channels

    def add_channel(self, name: str, channel: Channel) -> None:
        """A channel to run besides the configured ones (`gateway chat`'s terminal), added
        before the start, so that its pending turns are resumed (and, without the configured
        channels, only its)."""
        assert self.hub is None, "before the start"
        self._own_channels[name] = channel

    def startup_problems(self, cfg: Config) -> list[str]:
        """What in `cfg` this gateway could not run with (its channels and HTTP server)."""
        return startup_problems(cfg, channels=self.enable_channels, http=self.serve_http)

    def workspace_for(self, inbound: Inbound) -> Path:
        return self.places.workspace_for(inbound)

    # -- start --------------------------------------------------------------------------

    async def start(self) -> None:
        problems = self.startup_problems(self.cfg)
        if problems:
            raise ConfigError(problems)
        store = await self._open_store()
        leases = await self._join_others(store)
        try:
            services = await self._build_services(store, leases)
        except BaseException:
            # Nothing of this is self.services yet, so stop() would not close it: the
            # store's worker thread left open kept the process from ever exiting.
            await leases.stop()
            await store.close()
            raise
        self.services, self.hub, self.mcp = services, services.hub, services.mcp
        self._build_message_path(services)
        self._build_channels_into(services.hub)
        if self.serve_http:
            await self._serve_http(services)
        # MCP servers connect in the background (readiness never waits for them); their
        # tools join the registry as each one is ready.
        await services.mcp.apply(self.cfg.mcp)
        await self._start_turns(services)
        await self._start_jobs(services)
        self._announce()
        await self._follow_changes()

    async def _open_store(self) -> StoreBackend:
        """The data dir checked, the web token made, the log's secrets set, the database open."""
        cfg, data_dir = self.cfg, self.holder.data_dir
        await asyncio.to_thread(check_data_dir, data_dir)
        if self.serve_http:
            try:  # the web API's token while channels.web.token is unset, made at the first start
                self.own_web_token = await asyncio.to_thread(web_token.load_or_create, data_dir)
            except OSError as err:
                raise StartupError(f"the web token: {err}") from None
        REDACTOR.set_secrets(self.secret_values(cfg))
        try:
            return await open_store(secret_text(cfg.store.url), data_dir)
        except StoreError as err:
            raise StartupError(str(err)) from None

    async def _join_others(self, store: StoreBackend) -> Leases:
        """The settings changed in chat (over this gateway's file, with other gateways) and
        the leases shared with them; the store is closed when that fails."""
        try:
            self.chat_settings = ChatSettings(store, self.holder, check=self.startup_problems, apply=self.apply_config)
            if await self.chat_settings.join():
                self._applied = self.cfg
            leases = open_leases(store)
            await leases.start()
        except (ValueError, OSError, TimeoutError, StoreError) as err:
            await store.close()
            raise StartupError(f"cannot join the other gateways on the database: {err}") from None
        return leases

    async def _build_services(self, store: StoreBackend, leases: Leases) -> Services:
        cfg, holder = self.cfg, self.holder
        metrics = Metrics()
        metrics.watch_store(store.write_stats)
        metrics.leases_held.set_function(leases.held)
        counter = await asyncio.to_thread(TokenCounter, cfg.model.name)
        counters = await asyncio.to_thread(alias_counters, cfg)
        models = Models(build_clients(cfg, metrics.model_call), counter, counters, client_settings(cfg))
        tools = ToolRegistry.default(cfg)
        tools.add_source(WebTools(holder.snapshot))  # follows reloads
        self.exec_tools = ExecTools(holder.snapshot)  # also follows reloads
        tools.add_source(self.exec_tools)
        await self.exec_tools.prepare()  # probes the sandbox when exec is on
        mcp = McpManager(base_dir=holder.base_dir, log_dir=holder.data_dir / "mcp", data_dir=holder.data_dir,
                         metrics=metrics)
        tools.add_source(mcp)
        # Found before the first turn; followed from the end of the start.
        self.skill_watcher = SkillWatcher(cfg.skills.paths(holder.base_dir))
        await self.skill_watcher.load()
        hub = ChannelHub(leases=leases, metrics=metrics, config=holder)
        usage = Usage(store)
        # People's scheduled tasks: a run is a turn in its session, answered where the task
        # was made; it runs only while that channel is up here.
        self.tasks = TaskScheduler(store, holder, metrics, usage, channels=hub)
        return Services(
            config=holder, data_dir=holder.data_dir, store=store, metrics=metrics, models=models,
            model_slots=ModelSlots(cfg.limits.max_concurrent_model_calls), tools=tools, mcp=mcp, hub=hub,
            approvals=Approvals(store, config=holder.snapshot, cards=hub), usage=usage,
            media=Media(holder.snapshot), memory=Memory(holder.data_dir, tz=_zone(cfg), store=store),
            tasks=self.tasks, skills=self.skill_watcher.skills, leases=leases)

    def _build_message_path(self, s: Services) -> None:
        self.agent = Agent(s, Summarizer(s))
        # On a shared database the session queue is the database and turns run under leases.
        self.sessions = ClusterSessionManager(s, self.agent, places=self.places) if s.leases.shared \
            else SessionManager(s, self.agent)
        self.pairing = Pairing(s.store, people=s.hub)  # approvals are told in the person's chat
        self.commands = Commands(s, self.sessions, self.pairing, replies=s.hub,
                                 on_config_change=self._apply_config_later, check=self.startup_problems,
                                 settings=self.chat_settings)
        self.router = Router(s, self.sessions, self.commands, self.pairing, places=self.places, replies=s.hub)
        self.scheduler = Scheduler(
            s.cfg, store=s.store, memory=s.memory, model=CurrentSummaryModel(s.models, s.model_slots),
            live_references=self.sessions.live_tool_results,
            metrics=s.metrics.job_run, leases=s.leases,
            remember=self.agent.summarizer.remember,
        )
        self.admin_state = AdminState(config=self.holder, store=s.store, metrics=s.metrics, leases=s.leases,
                                      channels=s.hub, sessions=self.sessions, tools=s.tools, servers=s.mcp,
                                      jobs=self.scheduler)

    def _build_channels_into(self, hub: ChannelHub) -> None:
        for name, channel in self._own_channels.items():
            hub.add(name, channel)
        if self.enable_channels:
            self._build_channels(self.cfg)

    async def _serve_http(self, s: Services) -> None:
        cfg, state = self.cfg, self.admin_state
        assert state is not None
        web = self.channels.get("web")
        extra = web.routes() if web is not None else []  # type: ignore[attr-defined]
        extra += self._admin(s, state).routes()
        extra += Hooks(s, self.sessions).routes()  # POST /hooks/<name> (SPEC §5.9)
        app = build_app(ready=state.ready, metrics=s.metrics.exposition,
                        channel=s.hub.webhook, extra_routes=extra, ready_details=state.ready_details)
        probes = build_probe_app(ready=state.ready, ready_details=state.ready_details) \
            if cfg.http.probe_port is not None else None
        self.http = HttpServer(app, cfg.http, probes=probes)
        try:
            await self.http.start()
        except OSError as err:
            (key, failed), self.http = self.http.binding, None
            self.services = None  # nothing else started yet: stop() has nothing left to do
            await s.leases.stop()
            await s.store.close()
            self.recent_errors.uninstall()
            raise StartupError(listen_problem(cfg.http.host, failed, err, key)) from None

    async def _start_turns(self, s: Services) -> None:
        # Turns accepted before a restart queue first, so they keep their place ahead of
        # messages arriving now; workers start once the channels can deliver replies.
        # With other gateways, their waiting turns are theirs: this one's sweep takes over
        # only sessions whose lease expired (gateway/turns/leased_sessions.py).
        pending_commands = [] if s.leases.shared else await self.router.resume_pending(set(s.hub.channels))
        await s.hub.start_all()
        self.sessions.begin(self.router.answer_command)
        await self.router.answer_commands(pending_commands)
        await s.approvals.start()  # waits a restart cut are denies, their cards updated

    async def _start_jobs(self, s: Services) -> None:
        assert self.scheduler is not None and self.tasks is not None
        await self.scheduler.start()
        await self.tasks.start(self.sessions, admits=self.router.admits)
        for client in s.models.clients():
            s.background.spawn(client.warm_up(), name="model-warm-up")

    def _announce(self) -> None:
        for line in self.startup_lines():
            log.info(line)
        for warning in config_warnings(self.cfg):
            log.warning(warning)

    async def _follow_changes(self) -> None:
        """The skills' folders, config.json and (on a shared store) the other gateways' /config."""
        assert self.skill_watcher is not None and self.chat_settings is not None
        await self.skill_watcher.start()
        if self.watch_config:
            self.watcher = self.config_watcher()
            await self.watcher.start()
        await self.chat_settings.start()

    def config_watcher(self) -> ConfigWatcher:
        """What follows edits of config.json for this gateway (SPEC §2 hot reload)."""
        assert self.chat_settings is not None and self.hub is not None, "started first"
        # With other gateways, the settings changed in chat stay on top of the file.
        return ConfigWatcher(self.holder, parse=self.chat_settings.from_text, check=self.startup_problems,
                             apply=self.apply_config, notify=self.hub.tell_admins)

    # -- the platforms: built, described --------------------------------------------------

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
        return web.token if web is not None else None  # type: ignore[attr-defined]

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

    def _admin(self, s: Services, state: AdminState) -> AdminApi:
        self.recent_errors.install()
        return AdminApi(config=self.holder.snapshot, store=s.store, pairing=self.pairing, ready=state.ready,
                        next_runs=state.next_runs, tool_sources=state.tool_sources, errors=self.recent_errors,
                        http_host=self.cfg.http.host, receiving=state.receiving, cluster=state.cluster,
                        throttle=self._auth_throttle("admin"), models=state.models,
                        session_context=state.session_context)

    def _auth_throttle(self, api: str) -> AuthThrottle:
        """Failed token checks of one API, per address, counted in gateway_auth_failures_total."""
        assert self.services is not None
        return AuthThrottle(api, on_failure=self.services.metrics.auth_failures.labels(api).inc)

    def _build_channels(self, cfg: Config) -> None:
        from channels.web.adapter import WebChannel

        assert self.services is not None
        hub = self.services.hub
        if cfg.channels.web.enabled and self.serve_http:
            hub.add("web", WebChannel(self.router.handle, http_host=cfg.http.host,
                                      history=self.web_history, decide=self.services.approvals.decide,
                                      throttle=self._auth_throttle("web"),
                                      **self._web_settings(cfg),
                                      **self.stream_settings(WebChannel, "web")))
        for name in PLATFORMS:
            channel = self._make_channel(name, cfg)
            if channel is not None:
                hub.add(name, channel)

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
        assert self.services is not None
        hub = self.services.hub
        hooks = ChannelHooks(handle=self.router.handle, admits=self.router.admits,
                             workspace_for=self.places.workspace_for, file_limit=hub.file_limit,
                             stream_interval=hub.stream_interval, observe=self.stream_observer(name),
                             commands=BOT_COMMANDS, decide=self.services.approvals.decide)
        return importlib.import_module(PLATFORMS[name]).from_config(section, hooks)

    def stream_observer(self, channel: str) -> StreamObserver:
        """Counts a channel's stream events in /metrics (gateway_stream_events_total)."""
        assert self.services is not None
        return self.services.metrics.stream_observer(channel)

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
            assert self.services is not None
            settings["stream_interval"] = self.services.hub.stream_interval
        return settings

    # -- reload ---------------------------------------------------------------------------

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
        cfg, old = self.cfg, self._applied
        self._applied = cfg
        later = [key for key in changed_keys(old, cfg) if change_effect(key) == "restart"]
        if later:
            log.warning("config change saved; these settings apply after a restart", extra={"keys": later})
        REDACTOR.set_secrets(self.secret_values(cfg))
        s.model_slots.resize(cfg.limits.max_concurrent_model_calls)
        self._apply_web(cfg)
        self._apply_logs_and_clock(s, old, cfg)
        await self._apply_models(s, old, cfg)
        await self._apply_parts(old, cfg)
        # A gateway started without the messaging channels (`gateway chat`) never starts one
        # on a reload: `gateway run` beside it on the same config owns them (a second
        # Telegram poller would fight it for the bot with 409s).
        for name in PLATFORMS if self.enable_channels else ():
            await self._apply_channel(s.hub, name, cfg)

    def _apply_web(self, cfg: Config) -> None:
        web = self.channels.get("web")
        if web is not None:
            # Requests check these per call: a rotated token locks the old one out at once.
            for name, value in self._web_settings(cfg).items():
                setattr(web, name, value)

    @staticmethod
    def _apply_logs_and_clock(s: Services, old: Config, cfg: Config) -> None:
        if cfg.log_level != old.log_level:
            set_log_level(cfg.log_level)
        if cfg.timezone != old.timezone:
            s.memory.set_timezone(_zone(cfg))

    @staticmethod
    async def _apply_models(s: Services, old: Config, cfg: Config) -> None:
        """A new `model.name` brings its tokenizer; changed model settings, new clients (and
        the aliases' tokenizers), swapped in whole."""
        if cfg.model.name != old.model.name:
            s.models.replace_counter(await asyncio.to_thread(TokenCounter, cfg.model.name))
        settings = client_settings(cfg)
        if settings == s.models.settings:
            return
        counters = await asyncio.to_thread(alias_counters, cfg)
        for client in s.models.replace(build_clients(cfg, s.metrics.model_call), counters, settings):
            # Turns already talking to the old client finish on it.
            s.background.spawn(client.close(grace_s=cfg.model.timeout_s), name="close-model")

    async def _apply_parts(self, old: Config, cfg: Config) -> None:
        """The jobs, the skills' folders, the sandbox and the MCP servers follow the change."""
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

    async def _apply_channel(self, hub: ChannelHub, name: str, cfg: Config) -> None:
        """The platform `name` restarts when its section changed (and starts or stops with `enabled`)."""
        section = getattr(cfg.channels, name)
        current = hub.channels.get(name)
        if current is not None and getattr(current, "cfg", None) == section:
            return
        if current is None and not section.enabled:
            return
        log.info("restarting channel after a config change", extra={"channel": name})
        await hub.remove(name)
        replacement = self._make_channel(name, cfg)
        if replacement is not None:
            hub.add(name, replacement)
            await hub.start(name)

    # -- shutdown -----------------------------------------------------------------------

    def replies_in_flight(self) -> int:
        """Turns and commands running or queued: the replies a graceful stop waits for."""
        return self.sessions.in_flight() if self.services is not None else 0

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
        await self._finish_turns(s, timeout, now)
        await s.hub.stop_all()
        if self.scheduler is not None:
            await self.scheduler.stop()
        await s.mcp.stop()  # calls still running are cancelled; server processes end
        if self.http is not None:
            await self.http.stop()
        self.recent_errors.uninstall()
        await s.background.close(timeout=5)
        for client in s.models.clients():
            await client.close()
        await s.media.close()
        await s.leases.stop()  # last before the store: other gateways take over from here
        await s.store.close()
        self.services = None

    async def _finish_turns(self, s: Services, timeout: float, now: asyncio.Event | None) -> None:
        """Wait for the turns in flight (at most `timeout`, or until `now` is set), then cut
        the rest, before the channels go: none of them delivers into a channel half stopped.
        What they stored stays; the next start resumes them. A turn waiting for an approval
        ends that wait as a deny, and its card says why."""
        waits: set[asyncio.Future[Any]] = {asyncio.ensure_future(self.sessions.stop(timeout))}
        if now is not None:
            waits.add(asyncio.ensure_future(now.wait()))
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in waits:
                waiting.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
        s.approvals.closing = True
        cut = [live.worker for live in self.sessions.live.values() if live.worker is not None]
        for worker in cut:
            worker.cancel()
        if cut:
            await asyncio.wait(cut, timeout=CUT_WAIT_S)
            log.warning("turns cut by the shutdown; they resume at the next start", extra={"count": len(cut)})


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


def _zone(cfg: Config) -> Any:
    """The configured time zone, else the machine's."""
    return ZoneInfo(cfg.timezone) if cfg.timezone else _local_tz()
