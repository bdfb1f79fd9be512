"""Configuration: the pydantic schema of SPEC §2, `${ENV}` expansion in secrets, the
checks a command runs before it starts, load, atomic write.

A `Config` is an immutable snapshot; code receives one and never mutates it.
"""

from __future__ import annotations

import difflib
import functools
import json
import os
import re
import stat
import tempfile
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from context.budget import Budget
from gateway.config.cron import check_cron

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")

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


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


_M = TypeVar("_M", bound=BaseModel)


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
    streaming: Literal["edit", "off"] = "edit"  # edit: replies grow in place (SPEC §5.1)


class SlackConfig(_Strict):
    enabled: bool = False
    bot_token: SecretStr | None = None
    app_token: SecretStr | None = None
    signing_secret: SecretStr | None = None
    mode: Literal["socket", "http"] = "socket"
    base_url: str = "https://slack.com/api/"
    streaming: Literal["native", "update", "off"] = "native"  # SPEC §5.1


class WebConfig(_Strict):
    enabled: bool = True
    token: SecretStr | None = None


class TerminalConfig(_Strict):
    enabled: bool = True


class ChannelsConfig(_Strict):
    telegram: TelegramConfig = TelegramConfig()
    slack: SlackConfig = SlackConfig()
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
    # The admin page (/admin) is served only while this is set; its API needs it as a bearer token.
    admin_token: SecretStr | None = None


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
    `/audio/transcriptions` endpoint; `base_url` and `api_key` default to the model's."""

    enabled: bool = True
    model: str = "whisper-1"
    base_url: str | None = None  # None: model.base_url
    api_key: SecretStr | None = None  # None: model.api_key
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


class ToolsConfig(_Strict):
    web_fetch: WebFetchConfig = WebFetchConfig()
    web_search: WebSearchConfig = WebSearchConfig()


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
            stdio_only = [k for k in ("args", "env", "cwd") if getattr(self, k)]
            if stdio_only:
                raise ValueError(f"{', '.join(stdio_only)}: only for a command (stdio) server, not with url")
        elif self.headers:
            raise ValueError("headers: only for a url (streamable-HTTP) server, not with command")
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
        if not text.startswith(("sqlite:///", "postgresql://", "postgres://")):
            raise ValueError("must start with sqlite:/// or postgresql://")
        return value


class TasksConfig(_Strict):
    """Tasks people schedule in chat (SPEC §5.3); read at each use, so changes apply live."""

    max_per_scope: int = Field(default=20, ge=0)  # 0: nobody may schedule new tasks
    min_interval_s: int = Field(default=300, ge=1)  # the shortest `every`, and the closest two cron runs
    misfire_grace_s: int = Field(default=3600, ge=1)  # a run missed (gateway down) by more is skipped


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
    model: ModelConfig = ModelConfig()
    summary_model: ModelConfig | None = None
    channels: ChannelsConfig = ChannelsConfig()
    http: HttpConfig = HttpConfig()
    limits: LimitsConfig = LimitsConfig()
    # Least time between two updates of one streamed message (SPEC §5.1).
    stream_interval_s: float = Field(default=1.0, gt=0)
    tools: ToolsConfig = ToolsConfig()
    mcp: McpConfig = McpConfig()
    tasks: TasksConfig = TasksConfig()
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

    def context_budget(self) -> Budget:
        """The limits of one request for the context engine (SPEC §4.3), from this snapshot."""
        return Budget(
            max_tokens=self.agent_max_context_tokens,
            max_turns=self.agent_max_context_turns,
            context_window=self.model.window(),
            max_output_tokens=self.model.max_output_tokens,
            tool_result_max_chars=self.tool_result_max_chars,
            history_tool_result_max_chars=self.history_tool_result_max_chars,
            vision=self.model.sees_images(),
        )

    def transcription_endpoint(self) -> tuple[str | None, str | None]:
        """(base URL, API key) of speech to text: `transcription`'s own, else the model's."""
        t = self.transcription
        key = secret_text(t.api_key) if t.api_key is not None else self.model.key_value()
        return t.base_url or self.model.base_url, key


def secret_text(value: SecretStr | None) -> str | None:
    """The usable secret: set, not blank, and no `${VAR}` left unexpanded (a reference
    is public text in config.json, never a secret)."""
    if value is None:
        return None
    text = value.get_secret_value().strip()
    if not text or _ENV_REF.search(text):
        return None
    return text


class ConfigError(Exception):
    """A config that cannot be used; `problems` are `key.path: message` lines."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def _expand(text: str, env: Mapping[str, str]) -> tuple[str, list[str]]:
    """`text` with each `${NAME}` replaced, and the names that are not set."""
    missing = [m.group(1) for m in _ENV_REF.finditer(text) if m.group(1) not in env]
    return _ENV_REF.sub(lambda m: env.get(m.group(1), m.group(0)), text), missing


def _resolve_secrets(model: _M, prefix: str, env: Mapping[str, str], unset: list[tuple[str, str]]) -> _M:
    """Expand `${NAME}` in the secret fields only (SecretStr), defaults included; a secret
    whose variable is unset becomes None and is listed in `unset`. Other strings (prompts,
    URLs, anything an admin can set in chat) are never expanded."""
    updates: dict[str, Any] = {}
    for name in type(model).model_fields:
        value = getattr(model, name)
        path = f"{prefix}{name}"
        if isinstance(value, dict):  # named entries (mcp.servers) or secret values (env, headers)
            entries = {key: _resolved_value(item, f"{path}.{key}", env, unset) for key, item in value.items()}
            if any(entries[key] is not item for key, item in value.items()):
                updates[name] = entries
            continue
        resolved = _resolved_value(value, path, env, unset)
        if resolved is not value:
            updates[name] = resolved
    return model.model_copy(update=updates) if updates else model


def _resolved_value(value: Any, path: str, env: Mapping[str, str], unset: list[tuple[str, str]]) -> Any:
    if isinstance(value, SecretStr):
        text, missing = _expand(value.get_secret_value(), env)
        if missing:
            unset.extend((path, var) for var in missing)
            return None
        return SecretStr(text) if text != value.get_secret_value() else value
    if isinstance(value, BaseModel):
        return _resolve_secrets(value, f"{path}.", env, unset)
    return value


def _known_keys(model: type[BaseModel]) -> list[str]:
    return list(model.model_fields)


def _model_at(path: tuple[Any, ...]) -> type[BaseModel] | None:
    model: type[BaseModel] = Config
    named = False  # the next part is an entry's name (mcp.servers.<name>), not a field
    for part in path:
        if named:
            named = False
            continue
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        ann = field.annotation
        candidates = getattr(ann, "__args__", (ann,))
        nxt = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if nxt is None:
            return None
        named = typing.get_origin(ann) is dict
        model = nxt
    return model


def _format_errors(err: ValidationError) -> list[str]:
    problems = []
    for e in err.errors():
        loc = tuple(e["loc"])
        key = ".".join(str(p) for p in loc) or "(root)"
        if e["type"] == "extra_forbidden":
            parent = _model_at(loc[:-1])
            hint = ""
            if parent is not None:
                close = difflib.get_close_matches(str(loc[-1]), _known_keys(parent), n=1)
                if close:
                    hint = f" (did you mean {'.'.join([*map(str, loc[:-1]), close[0]])!r}?)"
            problems.append(f"{key}: unknown key{hint}")
        elif e["type"] == "tuple_type":
            # The schema's tuples are JSON arrays in the file: say so, not "a valid tuple".
            example = LIST_EXAMPLES.get(key, '["a", "b"]')
            problems.append(f"{key}: should be a list (a JSON array), e.g. {example}")
        else:
            msg = e["msg"].removeprefix("Value error, ").replace("Input should be", "should be")
            problems.append(f"{key}: {msg}")
    return problems


LIST_EXAMPLES = {"admins": '["telegram:123456789", "slack:U0123ABCD"]',
                 "access.allow_from": '["telegram:123456789", "telegram:-1001234567890"]'}


def json_problem(text: str, err: json.JSONDecodeError) -> str:
    """Where a JSON error really is. The decoder notices a missing comma only at the next
    value, which is often on the next line: name the line the comma belongs after."""
    before = text[: err.pos].rstrip()
    prev_line = before.count("\n") + 1
    last = before.splitlines()[-1].strip() if before else ""
    if err.msg == "Expecting ',' delimiter" and before and prev_line < err.lineno and text[err.pos] not in "}]":
        return f"invalid JSON: missing comma after line {prev_line} ({last[-60:]})"
    at = text[err.pos: err.pos + 1]
    if err.msg == "Expecting ',' delimiter" and at in ("}", "]"):
        return (f"invalid JSON at line {err.lineno} column {err.colno}: {at!r} closes the wrong bracket "
                "(a ']' or '}' missing before it?)")
    if before.endswith(",") and at in ("}", "]") and err.msg.startswith("Expecting"):
        return (f"invalid JSON: a trailing comma at the end of line {prev_line} ({last[-60:]}); "
                f"JSON allows no comma before {at!r}")
    if err.msg == "Expecting ',' delimiter":
        return f"invalid JSON at line {err.lineno} column {err.colno}: missing comma"
    return f"invalid JSON at line {err.lineno} column {err.colno}: {err.msg}"


def parse_config(raw: dict[str, Any], environ: dict[str, str] | None = None) -> Config:
    if not isinstance(raw, dict):
        raise ConfigError(["(root): the config must be a JSON object"])
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_errors(err)) from None
    unset: list[tuple[str, str]] = []
    cfg = _resolve_secrets(cfg, "", os.environ if environ is None else environ, unset)
    cfg._unset_env = tuple(unset)
    return cfg


def parse_config_text(text: str, environ: dict[str, str] | None = None) -> Config:
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError([f"(file): {json_problem(text, err)}"]) from None
    return parse_config(raw, environ)


def load_config(path: Path, environ: dict[str, str] | None = None) -> Config:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([f"(file): {path} does not exist"]) from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError([f"(file): cannot read {path}: {err}"]) from None
    return parse_config_text(text, environ)


def atomic_write_text(path: Path, text: str) -> None:
    """Write via temp file + fsync + rename, so readers see the old or the new file whole.

    A file that exists keeps its mode (and owner and group, where this user may set them:
    an operator's 0640 config.json stays readable by its group); a new file is 0600."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        before: os.stat_result | None = os.stat(path)
    except FileNotFoundError:
        before = None
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        if before is not None:
            os.fchmod(fd, stat.S_IMODE(before.st_mode))
            if hasattr(os, "fchown"):
                try:
                    os.fchown(fd, before.st_uid, before.st_gid)
                except PermissionError:  # not root: the new file is ours, as any edit would leave it
                    pass
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


SECRET_KEYS = {
    "model.api_key",
    "summary_model.api_key",
    "channels.telegram.token",
    "channels.telegram.webhook_secret",
    "channels.slack.bot_token",
    "channels.slack.app_token",
    "channels.slack.signing_secret",
    "channels.web.token",
    "http.admin_token",
    "tools.web_search.api_key",
    "store.url",
    "transcription.api_key",
}


def is_secret_key(path: str) -> bool:
    parts = path.split(".")
    if parts[:2] == ["mcp", "servers"] and len(parts) > 3 and parts[3] in ("env", "headers"):
        return True  # mcp.servers.<name>.env.<VAR>: what a server is given to authenticate
    return path in SECRET_KEYS or parts[-1] in {
        "api_key", "token", "bot_token", "app_token", "signing_secret", "webhook_secret",
    }


def is_operator_only(path: str) -> bool:
    """MCP servers are programs the gateway starts (command, args, env) and addresses it
    sends credentials to (url, headers): config.json only, never from chat."""
    return path == "mcp" or path.startswith("mcp.")


def is_credential_destination(path: str) -> bool:
    """Keys that decide where a secret is sent (a model's key goes to its base_url, the bot
    token to the Bot API server, the webhook secret to webhook_url): changing them from
    chat would hand the secret to any server, so they are set in config.json only."""
    return path.rsplit(".", 1)[-1] in {"base_url", "base_file_url", "webhook_url"}


# -- what a command needs before it starts ---------------------------------------------------


def webhook_secret_problem(value: str | None) -> str | None:
    """Why `value` cannot guard the Telegram webhook, or None when it can."""
    rule = (f"{WEBHOOK_SECRET_MIN}-{WEBHOOK_SECRET_MAX} characters of A-Z, a-z, 0-9, _ and - "
            "(e.g. the output of `openssl rand -hex 32`)")
    if not value:
        return f"required in webhook mode: {rule}"
    if not WEBHOOK_SECRET.fullmatch(value) or not WEBHOOK_SECRET_MIN <= len(value) <= WEBHOOK_SECRET_MAX:
        return f"not a usable webhook secret: use {rule}"
    return None


def usable_webhook_secret(cfg: TelegramConfig) -> str | None:
    """The webhook secret when it passes webhook_secret_problem, else None (the channel
    then refuses every webhook request)."""
    value = cfg.webhook_secret.get_secret_value() if cfg.webhook_secret is not None else None
    return value if value is not None and webhook_secret_problem(value) is None else None


def admin_token_problem(cfg: Config, unset_vars: list[str] | None = None) -> str | None:
    """Why `http.admin_token` cannot guard the admin page, or None (also when it is not
    set: the page is then off). `unset_vars`: the variables its `${...}` names that are unset."""
    if unset_vars:
        return (f"http.admin_token: the environment variable {', '.join(unset_vars)} is not set "
                "(needed for the admin page; remove the key to turn the page off)")
    token = secret_text(cfg.http.admin_token)
    if cfg.http.admin_token is not None and token is None:
        return ("http.admin_token: empty; set a long random value (e.g. `openssl rand -hex 32`), "
                "or null for no admin page")
    if token is None:
        return None
    if len(token) < ADMIN_TOKEN_MIN:
        return (f"http.admin_token: too short ({len(token)} characters); use at least {ADMIN_TOKEN_MIN} random ones "
                "(e.g. `openssl rand -hex 32`)")
    if token == secret_text(cfg.channels.web.token):
        return "http.admin_token: must differ from channels.web.token (the chat's token must not open the admin page)"
    return None


def startup_problems(cfg: Config, *, channels: bool = True, http: bool = True) -> list[str]:
    """What stops a command from starting the features it runs: `run` starts the enabled
    channels (`channels`) and the HTTP server with the web chat (`http`); `chat` starts
    neither. A secret whose `${VARIABLE}` is unset is a problem only where it is needed;
    model.api_key never is (see config_warnings)."""
    problems: list[str] = []
    unset: dict[str, list[str]] = {}
    for path, var in cfg.unset_env:
        unset.setdefault(path, []).append(var)

    def not_set(path: str, why: str) -> str:
        names = ", ".join(unset[path])
        return f"{path}: the environment variable {names} is not set (needed {why})"

    def need(path: str, value: SecretStr | None, why: str) -> None:
        if path in unset:
            problems.append(not_set(path, why))
        elif secret_text(value) is None:
            problems.append(f"{path}: required {why}")

    if "store.url" in unset:
        problems.append(not_set("store.url", "to open the database"))
    if cfg.summary_model is not None and "summary_model.api_key" in unset:
        problems.append(not_set("summary_model.api_key", "while summary_model is set"))
    if cfg.transcription.enabled and "transcription.api_key" in unset:
        problems.append(not_set("transcription.api_key", "while transcription.enabled is true"))
    if channels:
        tg = cfg.channels.telegram
        if tg.enabled:
            need("channels.telegram.token", tg.token, "when channels.telegram.enabled is true")
            if tg.mode == "webhook":
                if not tg.webhook_url:
                    problems.append("channels.telegram.webhook_url: required in webhook mode")
                if "channels.telegram.webhook_secret" in unset:
                    problems.append(not_set("channels.telegram.webhook_secret", "in webhook mode"))
                else:
                    secret = tg.webhook_secret.get_secret_value() if tg.webhook_secret is not None else None
                    problem = webhook_secret_problem(secret)
                    if problem is not None:
                        problems.append(f"channels.telegram.webhook_secret: {problem}")
        sl = cfg.channels.slack
        if sl.enabled:
            need("channels.slack.bot_token", sl.bot_token, "when channels.slack.enabled is true")
            if sl.mode == "socket":
                need("channels.slack.app_token", sl.app_token, "in socket mode")
            else:
                need("channels.slack.signing_secret", sl.signing_secret, "in http mode")
    search = cfg.tools.web_search
    if search.provider in ("brave", "tavily"):
        need("tools.web_search.api_key", search.api_key, f"while tools.web_search.provider is {search.provider!r}")
    web = cfg.channels.web
    if http and web.enabled:
        if "channels.web.token" in unset:
            problems.append(not_set("channels.web.token", "while channels.web.enabled is true"))
        elif cfg.http.host not in LOOPBACK_HOSTS and secret_text(web.token) is None:
            problems.append("channels.web.token: required when http.host is not a loopback address")
    if http:
        problem = admin_token_problem(cfg, unset.get("http.admin_token"))
        if problem is not None:
            problems.append(problem)
    for path in unset:
        if path.startswith("mcp.servers."):
            name = path.split(".")[2]
            server = cfg.mcp.servers.get(name)
            if server is not None and server.enabled:
                problems.append(not_set(path, f"while the MCP server {name} is enabled"))
        elif path not in SECRET_KEYS:
            # A secret this function does not know yet: its reference must resolve.
            problems.append(not_set(path, "every secret reference must resolve"))
    return problems


def config_warnings(cfg: Config) -> list[str]:
    """Worth saying, not worth refusing: the first run works without a model key."""
    return [f"{path}: the environment variable {var} is not set; every chat answers with what to set "
            "until it is" for path, var in cfg.unset_env if path == "model.api_key"]


# -- how a change applies to a running gateway (README, "Live changes") ----------------------

# Read once at start: a change is saved but takes effect after a restart.
RESTART_KEYS = frozenset({"data_dir", "store.url", "http.host", "http.port", "http.header_timeout_s",
                          "http.body_timeout_s", "http.keepalive_timeout_s", "http.max_connections_per_client",
                          "channels.web.enabled", "channels.terminal.enabled"})
# A change restarts that channel alone (it reconnects with its new settings).
CHANNEL_SECTIONS = ("channels.telegram", "channels.slack")


def change_effect(path: str) -> Literal["live", "channel", "restart"]:
    if path in RESTART_KEYS:
        return "restart"
    if path.startswith(tuple(f"{section}." for section in CHANNEL_SECTIONS)):
        return "channel"
    return "live"


def changed_keys(old: Config, new: Config) -> list[str]:
    """The dotted keys whose values differ (a section that appears or goes counts as its key)."""
    def flat(data: Any, prefix: str = "") -> dict[str, Any]:
        if isinstance(data, dict):
            out: dict[str, Any] = {}
            for key, value in data.items():
                out.update(flat(value, f"{prefix}{key}."))
            return out
        return {prefix[:-1]: data}

    # Secrets compare by value (model_dump masks them).
    a, b = flat(_plain(old)), flat(_plain(new))
    return sorted(k for k in a.keys() | b.keys() if a.get(k, _MISSING) != b.get(k, _MISSING))


_MISSING = object()


def _plain(model: BaseModel) -> dict[str, Any]:
    def unwrap(value: Any) -> Any:
        if isinstance(value, SecretStr):
            return ("secret", value.get_secret_value())
        if isinstance(value, BaseModel):
            return {name: unwrap(getattr(value, name)) for name in type(value).model_fields}
        if isinstance(value, dict):
            return {key: unwrap(item) for key, item in value.items()}
        return value

    out = unwrap(model)
    assert isinstance(out, dict)
    return out
