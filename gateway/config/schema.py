"""The configuration's schema (SPEC §2): pydantic models, one per section, with the
defaults and limits of every key. Reading a file is gateway/config/load.py; what a key
is (a secret, set only in config.json) and how its change applies is
gateway/config/changes.py; what a command needs before it starts is gateway/config/checks.py.

A `Config` is an immutable snapshot; code receives one and never mutates it.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from context.budget import Budget
from gateway.config.cron import check_cron
from gateway.keys import parse_reply_place, parse_session_key

ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")

# Known context windows; `model.context_window` overrides. Prefix match on the model id.
CONTEXT_WINDOWS: dict[str, int] = {
    "gpt-4.1": 1_047_576,
    "gpt-4o": 128_000,
    "gpt-4-turbo": 128_000,
    "gpt-5": 400_000,
    "o3": 200_000,
    "o4-mini": 200_000,
    "deepseek-chat": 128_000,
    "deepseek-reasoner": 128_000,
    "qwen-max": 32_768,
    "qwen-plus": 131_072,
    "qwen-turbo": 1_000_000,
    "claude-": 200_000,
    "gemini-": 1_048_576,
}

# Model families that take images (SPEC §5.4); `model.vision` overrides. Matched against
# the model id without a router's "vendor/" prefix (OpenRouter's "openai/gpt-4o").
VISION_MODELS: tuple[str, ...] = (
    r"(chatgpt-)?gpt-4o.*", r"gpt-4\.1.*", r"gpt-4-turbo.*", r"gpt-4-vision.*", r"gpt-5.*",
    r"o1(-\d.*)?", r"o3(-pro)?(-\d.*)?", r"o4-mini.*",
    r"claude-(3|sonnet|opus|haiku).*", r"gemini-(1\.5|2|3|exp|flash|pro-vision).*",
    r"qwen.*-?vl.*", r"qvq.*", r"llava.*", r"bakllava.*", r"pixtral.*", r"llama-?3\.2.*vision.*", r"llama-?4.*",
    r"gemma-?3.*", r"mistral-(small|medium)-(3|2503|2505|latest).*", r"grok-(2-vision|4).*", r"minicpm-v.*",
    r"glm-4(\.\d)?v.*", r"internvl.*", r"moondream.*", r"kimi-vl.*",
)
# Variants of those families that take no images.
NOT_VISION_MODELS: tuple[str, ...] = (r".*(audio|tts|transcribe|realtime|search|embedding).*",)

LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}

# Telegram's rule for secret_token (1-256 of A-Z a-z 0-9 _ -), with a floor on length so a
# guessable word cannot stand in for a secret.
WEBHOOK_SECRET = re.compile(r"[A-Za-z0-9_-]+")
WEBHOOK_SECRET_MIN, WEBHOOK_SECRET_MAX = 16, 256
ADMIN_TOKEN_MIN = 16  # the admin API is reachable from the network: no guessable words
SKILL_DIRS_MAX = 16
WEB_TOKEN_MIN = 16  # the same for the chat API once it listens beyond loopback


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)




@functools.cache
def known_window(model_name: str) -> int | None:
    """The context window of a known model family (longest matching name prefix)."""
    for prefix, size in sorted(CONTEXT_WINDOWS.items(), key=lambda kv: -len(kv[0])):
        if model_name.startswith(prefix):
            return size
    return None


@functools.cache
def known_vision(model_name: str) -> bool:
    """Whether a model of this name takes images, from VISION_MODELS."""
    name = model_name.strip().lower().rsplit("/", 1)[-1]
    if any(re.fullmatch(p, name) for p in NOT_VISION_MODELS):
        return False
    return any(re.fullmatch(p, name) for p in VISION_MODELS)


class ModelConfig(_Strict):
    name: str = "gpt-4o-mini"
    base_url: str | None = None  # None: the SDK's default (OpenAI)
    api_key: SecretStr | None = SecretStr("${OPENAI_API_KEY}")
    context_window: int | None = Field(default=None, gt=0)
    max_output_tokens: int = Field(default=4096, gt=0)
    timeout_s: float = Field(default=120, gt=0)
    max_retries: int = Field(default=3, ge=0, le=10)
    temperature: float | None = None
    vision: bool | None = None  # None: from VISION_MODELS

    def window(self) -> int | None:
        return self.context_window if self.context_window is not None else known_window(self.name)

    def sees_images(self) -> bool:
        """Whether images a person sends go to this model (SPEC §5.4)."""
        return self.vision if self.vision is not None else known_vision(self.name)

    def key_value(self) -> str | None:
        """The usable API key, or None when unset or an unexpanded `${VAR}`."""
        return secret_text(self.api_key)

    @property
    def keyless(self) -> bool:
        """Called without any API key: an alias of `models` that names its own server and
        no key of its own (it inherits none: `model`'s key is for `model`'s server)."""
        return self._keyless

    _keyless: bool = PrivateAttr(default=False)


class MainModelConfig(ModelConfig):
    """`model`: the default agent's model, and the aliases tried when it fails (SPEC §5.5)."""

    fallbacks: tuple[str, ...] = ()


class ModelAlias(_Strict):
    """`models.<alias>`: the shape of `model`; a field left out is taken from `model`."""

    name: str | None = None
    base_url: str | None = None
    api_key: SecretStr | None = None
    context_window: int | None = Field(default=None, gt=0)
    max_output_tokens: int | None = Field(default=None, gt=0)
    timeout_s: float | None = Field(default=None, gt=0)
    max_retries: int | None = Field(default=None, ge=0, le=10)
    temperature: float | None = None
    vision: bool | None = None


def alias_names_own_server(alias: ModelAlias, model: ModelConfig) -> bool:
    """Whether `models.<alias>` sets a `base_url` other than `model.base_url` (a trailing
    slash aside): another server, which must not receive `model.api_key`."""
    if alias.base_url is None:
        return False
    main = (model.base_url or "").rstrip("/")
    return alias.base_url.strip().rstrip("/") != main


# An agent's name is part of its memory scopes (`<agent>/<scope>`) and of key paths.
AGENT_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}")


class AgentConfig(_Strict):
    """`agents.<name>` (SPEC §5.5); a field left unset comes from the top level (`default`)."""

    system_prompt: str | None = None
    system_prompt_file: str | None = None  # relative to the config file
    model: str | None = None  # an alias of `models`
    fallbacks: tuple[str, ...] | None = None  # aliases; else `model.fallbacks`
    tools: tuple[str, ...] | None = None  # tool names, `*` patterns allowed; else every tool
    skills: tuple[str, ...] | Literal["*"] = "*"
    models: tuple[str, ...] | None = None  # aliases its people may pick with /model; else every alias
    # Agents it may hand work to with `delegate` (names, `*` patterns allowed); itself always.
    # None: only itself (safe by default: a new agent reaches no other agent's prompt or skills).
    delegates: tuple[str, ...] | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> AgentConfig:
        if self.system_prompt is not None and self.system_prompt_file is not None:
            raise ValueError("give system_prompt or system_prompt_file, not both")
        return self


class BindingMatch(_Strict):
    """What a message must have for a binding to pick its agent: every given field equal
    (ids as the platform gives them, as strings). None of them: every message."""

    channel: str | None = None
    chat: str | None = None
    thread: str | None = None
    user: str | None = None


class Binding(_Strict):
    match: BindingMatch = BindingMatch()
    agent: str


class AccessConfig(_Strict):
    dm_policy: Literal["open", "allowlist", "pairing"] = "pairing"
    allow_from: tuple[str, ...] = ()
    group_trigger: Literal["mention_or_reply", "mention", "all"] = "mention_or_reply"


class TelegramConfig(_Strict):
    enabled: bool = False
    token: SecretStr | None = None
    mode: Literal["polling", "webhook"] = "polling"
    base_url: str = "https://api.telegram.org/bot"
    base_file_url: str | None = None
    webhook_url: str | None = None
    webhook_secret: SecretStr | None = None
    poll_timeout_s: int = Field(default=30, ge=0, le=60)
    # auto: drafts in private chats, edits elsewhere (SPEC §5.1)
    streaming: Literal["auto", "draft", "edit", "off"] = "auto"
    # Off: a link the model was led to write is not fetched by Telegram's servers unclicked.
    link_previews: bool = False


class SlackConfig(_Strict):
    enabled: bool = False
    bot_token: SecretStr | None = None
    app_token: SecretStr | None = None
    signing_secret: SecretStr | None = None
    mode: Literal["socket", "http"] = "socket"
    base_url: str = "https://slack.com/api/"
    streaming: Literal["native", "update", "off"] = "native"  # SPEC §5.1
    # Off: a link the model was led to write is not fetched by Slack's servers unclicked.
    unfurl_links: bool = False
    # thread: a top-level mention is answered in a thread under it, which is its session (SPEC §2).
    reply_to_mode: Literal["thread", "channel"] = "thread"


class DiscordConfig(_Strict):
    enabled: bool = False
    token: SecretStr | None = None
    # The REST base; the gateway's websocket address is what `GET {api_base}/gateway/bot` says.
    api_base: str = "https://discord.com/api/v10"
    streaming: Literal["edit", "off"] = "edit"  # SPEC §5.1


class WebConfig(_Strict):
    enabled: bool = True
    token: SecretStr | None = None


class TerminalConfig(_Strict):
    enabled: bool = True


class ChannelsConfig(_Strict):
    telegram: TelegramConfig = TelegramConfig()
    slack: SlackConfig = SlackConfig()
    discord: DiscordConfig = DiscordConfig()
    web: WebConfig = WebConfig()
    terminal: TerminalConfig = TerminalConfig()


class HttpConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    # Slow or idle connections are closed (SPEC §9); read when the server starts.
    header_timeout_s: float = Field(default=10, gt=0)  # connect (or first byte) → complete request head
    body_timeout_s: float = Field(default=30, gt=0)  # the whole request body
    keepalive_timeout_s: float = Field(default=15, gt=0)  # idle between requests
    max_connections_per_client: int = Field(default=64, ge=1)  # open connections from one address
    # Open connections in all (None: from the open-files limit, leaving the rest its descriptors).
    max_connections: int | None = Field(default=None, ge=8)
    # A listener of its own for /healthz and /readyz (None: off; 0: any free port), on `host`:
    # a crowd of connections to `port` never blinds the orchestrator's probes.
    probe_port: int | None = Field(default=None, ge=0, le=65535)
    # The admin page (/admin) is served only while this is set; its API needs it as a bearer token.
    admin_token: SecretStr | None = None

    @model_validator(mode="after")
    def _probe_port_is_another(self) -> HttpConfig:
        if self.probe_port is not None and self.probe_port != 0 and self.probe_port == self.port:
            raise ValueError("http.probe_port must differ from http.port (the probes' listener is a second one)")
        return self


class LimitsConfig(_Strict):
    max_concurrent_model_calls: int = Field(default=32, ge=1)  # providers rate-limit, not us: 429s are retried
    session_queue_size: int = Field(default=5, ge=1)
    max_inbound_chars: int = Field(default=100_000, ge=1)
    max_live_sessions: int = Field(default=1000, ge=1)
    tokens_per_user_per_day: int | None = Field(default=None, ge=1)
    turns_per_user_per_day: int | None = Field(default=None, ge=1)
    turn_timeout_s: float = Field(default=600, gt=0)
    # The largest file a person may send (SPEC §5.4): checked against the size the platform
    # reports, and again while downloading. Telegram's cloud Bot API serves at most 20 MB.
    max_inbound_file_mb: float = Field(default=20, gt=0, le=2000)

    @property
    def max_inbound_file_bytes(self) -> int:
        return int(self.max_inbound_file_mb * 1024 * 1024)


class TranscriptionConfig(_Strict):
    """Speech to text for voice notes and audio (SPEC §5.4), through an OpenAI-compatible
    `/audio/transcriptions` endpoint; `base_url` and `api_key` default to the model's (the
    key only while the server is the model's too)."""

    enabled: bool = True
    model: str = "whisper-1"
    base_url: str | None = None  # None: model.base_url
    api_key: SecretStr | None = None  # None: model.api_key on the model's own server, else none
    timeout_s: float = Field(default=60, gt=0, le=600)

    @field_validator("base_url")
    @classmethod
    def _base_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError(f"must be an http:// or https:// URL, not {value!r}")
        return value


class WebFetchConfig(_Strict):
    enabled: bool = True
    max_bytes: int = Field(default=5_000_000, ge=1000, le=50_000_000)  # of the decoded body; reading stops there
    # The whole fetch, redirects included; tools get 60 s at most (gateway.turns.agent.TOOL_TIMEOUT_S).
    timeout_s: float = Field(default=20, gt=0, le=60)
    allow_private_networks: bool = False


class WebSearchConfig(_Strict):
    provider: Literal["searxng", "brave", "tavily"] | None = None
    base_url: str | None = Field(default=None, validate_default=True)  # None: the provider's own
    api_key: SecretStr | None = Field(default=None, validate_default=True)

    @field_validator("base_url")
    @classmethod
    def _base_url(cls, value: str | None, info: ValidationInfo) -> str | None:
        if info.data.get("provider") == "searxng" and not (value or "").strip():
            raise ValueError("required when provider is 'searxng': your SearXNG server, e.g. http://localhost:8888")
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError(f"must be an http:// or https:// URL, not {value!r}")
        return value

    @field_validator("api_key")
    @classmethod
    def _api_key(cls, value: SecretStr | None, info: ValidationInfo) -> SecretStr | None:
        provider = info.data.get("provider")
        if provider in ("brave", "tavily") and (value is None or not value.get_secret_value().strip()):
            raise ValueError(f"required when provider is {provider!r} (e.g. \"${{{provider.upper()}_API_KEY}}\")")
        return value


class ExecConfig(_Strict):
    """The sandboxed `exec` tool (SPEC §5.7): off unless the operator turns it on."""

    enabled: bool = False
    network: bool = False
    # Wall clock of one command; the agent bounds a tool call at 600 s whatever it says.
    timeout_s: float = Field(default=30, gt=0, le=600)
    memory_mb: int = Field(default=512, ge=64, le=65_536)  # address space of each process in the sandbox
    # What one scope's workspace may hold on disk: room for a checkout, a virtualenv and
    # its data, like the 1 GB a single file may reach. The disk also keeps a reserve (5 %,
    # 256 MB to 4 GB) that no sandbox eats into, for the gateway's own data.
    disk_mb: int = Field(default=1024, ge=1, le=1_048_576)


class DelegateConfig(_Strict):
    """`delegate` (SPEC §5.8): how many sub-turns one message may start. Calls past a cap
    get a tool result saying so and never run."""

    max_per_step: int = Field(default=3, ge=1, le=20)  # of one model reply
    max_per_turn: int = Field(default=10, ge=1, le=100)  # of one message, all steps together


class ToolsConfig(_Strict):
    web_fetch: WebFetchConfig = WebFetchConfig()
    web_search: WebSearchConfig = WebSearchConfig()
    exec: ExecConfig = ExecConfig()
    delegate: DelegateConfig = DelegateConfig()


# An MCP server's name starts its tools' names (`<name>__<tool>`) and is a key path part:
# letters, digits, "-" and single inner "_" (no "__", no trailing "_"), so `<name>__` marks
# where the server's name ends and two servers' tool names never collide.
MCP_SERVER_NAME = re.compile(r"[A-Za-z0-9-]+(?:_[A-Za-z0-9-]+)*")
MCP_SERVER_NAME_MAX = 32


class McpServerConfig(_Strict):
    """One MCP server (SPEC §5.2): a program spoken to over stdio (`command`) or a
    streamable-HTTP endpoint (`url`). Values of `env` and `headers` are secrets: they may
    be `${ENV}` references, are shown as *** and cannot be set from chat."""

    command: str | None = None
    args: tuple[str, ...] = ()
    env: dict[str, SecretStr] = {}
    cwd: str | None = None  # relative to the config file's directory
    url: str | None = None
    headers: dict[str, SecretStr] = {}
    tools: tuple[str, ...] | None = None  # the server's tool names to offer; None: all
    timeout_s: float = Field(default=60, gt=0)
    enabled: bool = True
    # A stdio server run in the exec tool's sandbox (gateway/tools/sandbox.py): it sees its
    # working directory (read-write), the system and `read_only_paths`, nothing else.
    sandbox: bool = False
    network: bool = True  # with sandbox: false cuts the server off the network
    read_only_paths: tuple[str, ...] = ()  # with sandbox: e.g. its venv; relative to the config file

    @model_validator(mode="after")
    def _one_transport(self) -> McpServerConfig:
        if (self.command is None) == (self.url is None):
            raise ValueError("give exactly one of command (a program spoken to over stdio) "
                             "or url (a streamable-HTTP endpoint)")
        if self.command is not None and not self.command.strip():
            raise ValueError("command is empty")
        if self.url is not None:
            if not re.fullmatch(r"https?://[^/\s?#]+(?:[/?#]\S*)?", self.url):
                raise ValueError(f"url must be an http:// or https:// address, not {self.url!r}")
            stdio_only = [k for k in ("args", "env", "cwd", "sandbox", "read_only_paths") if getattr(self, k)]
            if stdio_only:
                raise ValueError(f"{', '.join(stdio_only)}: only for a command (stdio) server, not with url")
        elif self.headers:
            raise ValueError("headers: only for a url (streamable-HTTP) server, not with command")
        if not self.sandbox:
            sandbox_only = [k for k, on in (("network", not self.network), ("read_only_paths", self.read_only_paths))
                            if on]
            if sandbox_only:
                raise ValueError(f"{', '.join(sandbox_only)}: only with sandbox: true (a server outside "
                                 "the sandbox sees the whole network and file system)")
        return self


class McpConfig(_Strict):
    servers: dict[str, McpServerConfig] = {}

    @field_validator("servers")
    @classmethod
    def _names(cls, value: dict[str, McpServerConfig]) -> dict[str, McpServerConfig]:
        for name in value:
            if len(name) > MCP_SERVER_NAME_MAX or not MCP_SERVER_NAME.fullmatch(name):
                raise ValueError(f"server name {name!r}: use 1-{MCP_SERVER_NAME_MAX} letters, digits, '-' "
                                 "and single '_' inside (its tools are named <name>__<tool>)")
        return value


STORE_SCHEMES = ("sqlite:///", "postgresql://", "postgres://")


class StoreConfig(_Strict):
    # null: SQLite in data_dir; postgresql://user:${PGPASSWORD}@host/db: one database that
    # several gateways can share (a secret: the whole URL, password included).
    url: SecretStr | None = None

    @field_validator("url")
    @classmethod
    def _scheme(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None:
            return None
        text = value.get_secret_value().strip()
        if not text:
            return None
        # A `${NAME}` reference is checked once expanded (gateway/config/load.py).
        if not text.startswith((*STORE_SCHEMES, "${")):
            raise ValueError("must start with sqlite:/// or postgresql://")
        return value


class TasksConfig(_Strict):
    """Tasks people schedule in chat (SPEC §5.3); read at each use, so changes apply live."""

    max_per_scope: int = Field(default=20, ge=0)  # 0: nobody may schedule new tasks
    min_interval_s: int = Field(default=300, ge=1)  # the shortest `every`, and the closest two cron runs
    misfire_grace_s: int = Field(default=3600, ge=1)  # a run missed (gateway down) by more is skipped


class ApprovalsConfig(_Strict):
    """Tools that wait for a person's yes before each call (SPEC §5.7)."""

    # A given object replaces the default: `{}` means no tool asks ("allow" says so for one).
    tools: dict[str, Literal["ask", "allow"]] = {"exec": "ask"}
    approvers: Literal["admins", "participants"] = "admins"
    timeout_s: float = Field(default=300, gt=0, le=86_400)  # no answer in time is a Deny


class SkillsConfig(_Strict):
    """Where skills live (SPEC §5.6): folders whose subfolders hold a SKILL.md each."""

    dirs: tuple[str, ...] = Field(default=("skills",), max_length=SKILL_DIRS_MAX)

    @field_validator("dirs")
    @classmethod
    def _paths(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for path in value:
            if not path.strip() or "\x00" in path:
                raise ValueError(f"{path!r} is not a folder path")
        return value

    def paths(self, base: Path) -> list[Path]:
        """The folders, relative ones under `base` (the config file's directory)."""
        return [Path(d) if Path(d).is_absolute() else base / d for d in self.dirs]


# A hook's name is the last part of its URL (/hooks/<name>) and a key path part.
HOOK_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
HOOK_SECRET_MIN = 16  # the HMAC key anyone who knows it can sign with: no guessable words
# Channels a hook can answer in: the messaging platforms, which send without a request
# waiting (the web page and the terminal only answer their own requests).
_NOT_HOOK_CHANNELS = frozenset({"web", "terminal"})


class HookConfig(_Strict):
    """An inbound webhook (SPEC §5.9): `POST /hooks/<name>`, signed with `secret`, starts a
    turn in `session` whose reply goes to `deliver_to`."""

    secret: SecretStr | None = None  # required to run (gateway/config/checks.py)
    session: str
    deliver_to: str
    template: str = Field(default="{body}", min_length=1, max_length=20_000)

    @field_validator("session")
    @classmethod
    def _session(cls, value: str) -> str:
        if parse_session_key(value) is None:
            raise ValueError(f"{value!r} is not a session key: e.g. \"telegram:dm:123\", "
                             "\"telegram:group:-1001234:topic:5\", \"slack:channel:C123:thread:1712.55\", "
                             "\"web:alice\"")
        return value

    @field_validator("deliver_to")
    @classmethod
    def _deliver_to(cls, value: str) -> str:
        place = parse_reply_place(value)
        channels = sorted(set(ChannelsConfig.model_fields) - _NOT_HOOK_CHANNELS)
        if place is None or place.channel not in channels:
            raise ValueError(f"{value!r}: use <channel>:<chat id>[:<thread>] with a channel of "
                             f"{', '.join(channels)}, e.g. \"telegram:-1001234:5\" or \"slack:C123:1712.55\"")
        return value

    @field_validator("template")
    @classmethod
    def _template(cls, value: str) -> str:
        if "{body}" not in value:
            raise ValueError("must contain {body}, where the request's body goes")
        return value


def hook_names_problem(names: list[str]) -> str | None:
    """Why one of `names` cannot name a hook, or None."""
    bad = [name for name in names if not HOOK_NAME.fullmatch(name)]
    if bad:
        return (f"hook name {bad[0]!r}: use 1-64 letters, digits, '_' and '-' (starting with a letter or digit); "
                "it is the last part of the URL /hooks/<name>")
    return None


class Config(_Strict):
    agent_max_context_tokens: int = Field(default=50_000, ge=256)
    agent_max_context_turns: int = Field(default=20, ge=1)
    agent_max_steps: int = Field(default=15, ge=1)
    system_prompt: str = (
        "You are a helpful assistant in a chat. Answer concisely. Use tools when they help; "
        "earlier conversation can be searched with memory_search."
    )
    data_dir: str = "data"
    store: StoreConfig = StoreConfig()
    timezone: str | None = None
    session_retention_days: int = Field(default=30, ge=1)
    tool_result_max_chars: int = Field(default=50_000, ge=1000)
    history_tool_result_max_chars: int = Field(default=20_000, ge=500)
    tool_result_ttl_days: int = Field(default=7, ge=1)
    memory_consolidation_cron: str = "0 0 * * *"
    memory_max_tokens: int = Field(default=4000, ge=0)
    summary_timeout_s: float = Field(default=60, gt=0)
    admins: tuple[str, ...] = ()
    access: AccessConfig = AccessConfig()
    group_session_scope: Literal["user", "group"] = "user"
    model: MainModelConfig = MainModelConfig()
    summary_model: ModelConfig | None = None
    models: dict[str, ModelAlias] = {}
    agents: dict[str, AgentConfig] = {}
    bindings: tuple[Binding, ...] = ()
    channels: ChannelsConfig = ChannelsConfig()
    http: HttpConfig = HttpConfig()
    limits: LimitsConfig = LimitsConfig()
    # Least time between two updates of one streamed message (SPEC §5.1).
    stream_interval_s: float = Field(default=1.0, gt=0)
    tools: ToolsConfig = ToolsConfig()
    mcp: McpConfig = McpConfig()
    tasks: TasksConfig = TasksConfig()
    approvals: ApprovalsConfig = ApprovalsConfig()
    skills: SkillsConfig = SkillsConfig()
    hooks: dict[str, HookConfig] = {}  # inbound webhooks by name (SPEC §5.9)
    transcription: TranscriptionConfig = TranscriptionConfig()
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    # (key path, variable) of each secret whose `${VARIABLE}` is not set; set by parse_config.
    _unset_env: tuple[tuple[str, str], ...] = PrivateAttr(default=())

    @field_validator("timezone")
    @classmethod
    def _zone(cls, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"unknown time zone {value!r} (use an IANA name like 'Europe/Berlin')") from None
        return value

    @field_validator("hooks", mode="before")
    @classmethod
    def _hook_names(cls, value: object) -> object:
        # Before the entries: a bad name is reported along with their own problems.
        problem = hook_names_problem([str(k) for k in value]) if isinstance(value, dict) else None
        if problem is not None:
            raise ValueError(problem)
        return value

    @field_validator("memory_consolidation_cron")
    @classmethod
    def _cron(cls, value: str, info: ValidationInfo) -> str:
        # The scheduler's own parser, in the configured zone (validated before this field;
        # when it was refused, its own error is reported and the system zone is used here).
        check_cron(value, info.data.get("timezone"))
        return value

    @property
    def unset_env(self) -> tuple[tuple[str, str], ...]:
        """(key path, variable name) of every secret that references an unset variable."""
        return self._unset_env

    # The directory the config file lives in; data_dir is relative to it.
    def data_path(self, base: Path) -> Path:
        path = Path(self.data_dir)
        return path if path.is_absolute() else (base / path)

    def context_budget(self, model: ModelConfig | None = None) -> Budget:
        """The limits of one request for the context engine (SPEC §4.3), from this snapshot,
        for `model` (the session's; default `model`): budgets follow its window."""
        model = model or self.model
        return Budget(
            max_tokens=self.agent_max_context_tokens,
            max_turns=self.agent_max_context_turns,
            context_window=model.window(),
            max_output_tokens=model.max_output_tokens,
            tool_result_max_chars=self.tool_result_max_chars,
            history_tool_result_max_chars=self.history_tool_result_max_chars,
            vision=model.sees_images(),
        )

    def model_for(self, alias: str | None) -> ModelConfig:
        """The settings of model `alias` (`models.<alias>` over `model`); `model` for None.
        A field the alias leaves out is `model`'s, except the API key when the alias names
        a server of its own (SPEC §2): `model`'s key never goes to another host, and such an
        alias without `api_key` is called without one (`keyless`)."""
        if alias is None:
            return self.model
        given = self.models[alias]
        base = ModelConfig.model_validate(self.model.model_dump(exclude={"fallbacks"}))
        update = {name: getattr(given, name) for name in given.model_fields_set}
        own_host = alias_names_own_server(given, self.model)
        if own_host and "api_key" not in given.model_fields_set:
            update["api_key"] = None
        merged = base.model_copy(update=update)
        merged._keyless = own_host and given.api_key is None
        return merged

    def agent(self, name: str) -> AgentConfig:
        """`agents.<name>`; the top level (no overrides) for `default`."""
        return self.agents.get(name) or AgentConfig()

    def reference_problems(self) -> list[str]:
        """Names that point nowhere: an unknown agent in a binding, an unknown alias where
        an alias is expected (check-config reports them with their key paths)."""
        problems = []
        aliases = sorted(self.models)
        known = f" (models: {', '.join(aliases)})" if aliases else " (no models.<alias> is defined)"

        def alias_ok(path: str, alias: str) -> None:
            if alias not in self.models:
                problems.append(f"{path}: unknown model alias {alias!r}{known}")

        for i, alias in enumerate(self.model.fallbacks):
            alias_ok(f"model.fallbacks.{i}", alias)
        for name, agent in self.agents.items():
            if name == "default" or not AGENT_NAME.fullmatch(name):
                problems.append(f"agents.{name}: an agent's name is 1-32 lowercase letters, digits, '_' and '-', "
                                "and not 'default' (the top level is the agent default)")
            if agent.model is not None:
                alias_ok(f"agents.{name}.model", agent.model)
            for key in ("fallbacks", "models"):
                for i, alias in enumerate(getattr(agent, key) or ()):
                    alias_ok(f"agents.{name}.{key}.{i}", alias)
            for i, other in enumerate(agent.delegates or ()):
                if "*" not in other and "?" not in other and "[" not in other \
                        and other != "default" and other not in self.agents:
                    names = ", ".join(sorted(["default", *self.agents]))
                    problems.append(f"agents.{name}.delegates.{i}: unknown agent {other!r} (agents: {names})")
        agents = sorted(["default", *self.agents])
        for i, binding in enumerate(self.bindings):
            if binding.agent != "default" and binding.agent not in self.agents:
                problems.append(f"bindings.{i}.agent: unknown agent {binding.agent!r} (agents: {', '.join(agents)})")
        return problems

    def transcription_endpoint(self) -> tuple[str | None, str | None]:
        """(base URL, API key) of speech to text: `transcription`'s own, else the model's;
        never the model's key for a server other than the model's (then: no key)."""
        t = self.transcription
        own_host = t.base_url is not None and t.base_url.rstrip("/") != (self.model.base_url or "").rstrip("/")
        if t.api_key is not None:
            key = secret_text(t.api_key)
        else:
            key = None if own_host else self.model.key_value()
        return t.base_url or self.model.base_url, key


def secret_text(value: SecretStr | None) -> str | None:
    """The usable secret: set, not blank, and no `${VAR}` left unexpanded (a reference
    is public text in config.json, never a secret)."""
    if value is None:
        return None
    text = value.get_secret_value().strip()
    if not text or ENV_REF.search(text):
        return None
    return text
