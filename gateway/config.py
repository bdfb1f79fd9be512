"""Configuration: the pydantic schema of SPEC §2, `${ENV}` expansion, load, atomic write.

A `Config` is an immutable snapshot; code receives one and never mutates it.
"""

from __future__ import annotations

import difflib
import functools
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

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

LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


@functools.cache
def known_window(model_name: str) -> int | None:
    """The context window of a known model family (longest matching name prefix)."""
    for prefix, size in sorted(CONTEXT_WINDOWS.items(), key=lambda kv: -len(kv[0])):
        if model_name.startswith(prefix):
            return size
    return None


class ModelConfig(_Strict):
    name: str = "gpt-4o-mini"
    base_url: str | None = None  # None: the SDK's default (OpenAI)
    api_key: SecretStr | None = SecretStr("${OPENAI_API_KEY}")
    context_window: int | None = Field(default=None, gt=0)
    max_output_tokens: int = Field(default=4096, gt=0)
    timeout_s: float = Field(default=120, gt=0)
    max_retries: int = Field(default=3, ge=0, le=10)
    temperature: float | None = None

    def window(self) -> int | None:
        return self.context_window if self.context_window is not None else known_window(self.name)

    def key_value(self) -> str | None:
        """The usable API key, or None when unset or an unexpanded `${VAR}`."""
        if self.api_key is None:
            return None
        value = self.api_key.get_secret_value().strip()
        if not value or _ENV_REF.fullmatch(value):
            return None
        return value


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

    @model_validator(mode="after")
    def _check(self) -> TelegramConfig:
        if self.enabled and not _secret(self.token):
            raise ValueError("channels.telegram.token is required when telegram is enabled")
        if self.enabled and self.mode == "webhook" and not self.webhook_url:
            raise ValueError("channels.telegram.webhook_url is required in webhook mode")
        return self


class SlackConfig(_Strict):
    enabled: bool = False
    bot_token: SecretStr | None = None
    app_token: SecretStr | None = None
    signing_secret: SecretStr | None = None
    mode: Literal["socket", "http"] = "socket"
    base_url: str = "https://slack.com/api/"

    @model_validator(mode="after")
    def _check(self) -> SlackConfig:
        if not self.enabled:
            return self
        if not _secret(self.bot_token):
            raise ValueError("channels.slack.bot_token is required when slack is enabled")
        if self.mode == "socket" and not _secret(self.app_token):
            raise ValueError("channels.slack.app_token is required in socket mode")
        if self.mode == "http" and not _secret(self.signing_secret):
            raise ValueError("channels.slack.signing_secret is required in http mode")
        return self


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


class LimitsConfig(_Strict):
    max_concurrent_model_calls: int = Field(default=32, ge=1)  # providers rate-limit, not us: 429s are retried
    session_queue_size: int = Field(default=5, ge=1)
    max_inbound_chars: int = Field(default=100_000, ge=1)
    max_live_sessions: int = Field(default=1000, ge=1)
    tokens_per_user_per_day: int | None = Field(default=None, ge=1)
    turns_per_user_per_day: int | None = Field(default=None, ge=1)
    turn_timeout_s: float = Field(default=600, gt=0)


class Config(_Strict):
    agent_max_context_tokens: int = Field(default=50_000, ge=256)
    agent_max_context_turns: int = Field(default=20, ge=1)
    agent_max_steps: int = Field(default=15, ge=1)
    system_prompt: str = (
        "You are a helpful assistant in a chat. Answer concisely. Use tools when they help; "
        "earlier conversation can be searched with memory_search."
    )
    data_dir: str = "data"
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
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"

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
    def _cron(cls, value: str) -> str:
        if len(value.split()) != 5:
            raise ValueError("a cron expression needs 5 fields: minute hour day month weekday")
        return value

    @model_validator(mode="after")
    def _check(self) -> Config:
        web = self.channels.web
        if web.enabled and self.http.host not in LOOPBACK_HOSTS and not _secret(web.token):
            raise ValueError(
                "channels.web.token is required when http.host is not a loopback address"
            )
        return self

    # The directory the config file lives in; data_dir is relative to it.
    def data_path(self, base: Path) -> Path:
        path = Path(self.data_dir)
        return path if path.is_absolute() else (base / path)


def _secret(value: SecretStr | None) -> bool:
    """Set, non-empty, and not an unexpanded `${VAR}` (an unset environment variable)."""
    if value is None:
        return False
    text = value.get_secret_value().strip()
    return bool(text) and not _ENV_REF.fullmatch(text)


class ConfigError(Exception):
    """A config that cannot be used; `problems` are `key.path: message` lines."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def expand_env(value: Any, environ: dict[str, str] | None = None) -> Any:
    """Replace `${NAME}` in every string; unset variables stay as written (so a missing
    secret is visible as such, never silently empty)."""
    env = os.environ if environ is None else environ
    if isinstance(value, str):
        return _ENV_REF.sub(lambda m: env.get(m.group(1), m.group(0)), value)
    if isinstance(value, list):
        return [expand_env(v, env) for v in value]
    if isinstance(value, dict):
        return {k: expand_env(v, env) for k, v in value.items()}
    return value


def _known_keys(model: type[BaseModel]) -> list[str]:
    return list(model.model_fields)


def _model_at(path: tuple[Any, ...]) -> type[BaseModel] | None:
    model: type[BaseModel] = Config
    for part in path:
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        ann = field.annotation
        candidates = getattr(ann, "__args__", (ann,))
        nxt = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if nxt is None:
            return None
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
        else:
            msg = e["msg"].removeprefix("Value error, ")
            problems.append(f"{key}: {msg}")
    return problems


def parse_config(raw: dict[str, Any], environ: dict[str, str] | None = None) -> Config:
    if not isinstance(raw, dict):
        raise ConfigError(["(root): the config must be a JSON object"])
    try:
        return Config.model_validate(expand_env(raw, environ))
    except ValidationError as err:
        raise ConfigError(_format_errors(err)) from None


def parse_config_text(text: str, environ: dict[str, str] | None = None) -> Config:
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError([f"(file): invalid JSON at line {err.lineno} column {err.colno}: {err.msg}"]) from None
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
    """Write via temp file + fsync + rename, so readers see the old or the new file whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
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


def default_config_dict() -> dict[str, Any]:
    """Every key with its default, secrets as `${ENV}` references (the shipped config.json)."""
    data = Config().model_dump(mode="json")
    data["model"]["api_key"] = "${OPENAI_API_KEY}"
    return data


SECRET_KEYS = {
    "model.api_key",
    "summary_model.api_key",
    "channels.telegram.token",
    "channels.telegram.webhook_secret",
    "channels.slack.bot_token",
    "channels.slack.app_token",
    "channels.slack.signing_secret",
    "channels.web.token",
}


def is_secret_key(path: str) -> bool:
    return path in SECRET_KEYS or path.rsplit(".", 1)[-1] in {
        "api_key", "token", "bot_token", "app_token", "signing_secret", "webhook_secret",
    }
