"""What a key is, and how a change to it applies: secrets, keys only config.json may set
(never chat), and whether a running gateway takes a change live, by restarting one
channel, or at its next start (README, "Live changes")."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    SecretStr,
)

from gateway.config.schema import Config

SECRET_KEYS = {
    "model.api_key",
    "summary_model.api_key",
    "channels.telegram.token",
    "channels.telegram.webhook_secret",
    "channels.slack.bot_token",
    "channels.slack.app_token",
    "channels.slack.signing_secret",
    "channels.discord.token",
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
    if parts[0] == "hooks" and len(parts) == 3 and parts[2] == "secret":
        return True  # hooks.<name>.secret: whoever knows it can start turns
    return path in SECRET_KEYS or parts[-1] in {
        "api_key", "token", "bot_token", "app_token", "signing_secret", "webhook_secret",
    }


OPERATOR_SECTIONS = ("mcp", "tools.exec", "approvals")


def is_operator_only(path: str) -> bool:
    """MCP servers are programs the gateway starts (command, args, env) and addresses it
    sends credentials to (url, headers); `exec` runs commands on this machine; `approvals`
    decides which tools wait for a person's yes and who gives it: config.json only, never
    from chat (an admin's account, or a session acting as one, must not wave its own
    tools through)."""
    return path in OPERATOR_SECTIONS or path.startswith(tuple(f"{section}." for section in OPERATOR_SECTIONS))


def is_host_folder(path: str) -> bool:
    """Keys naming folders of this machine whose files the agent may read (`skills.dirs`):
    set in config.json only, so no chat can point the agent at another folder."""
    return path == "skills" or path.startswith("skills.")


def is_credential_destination(path: str) -> bool:
    """Keys that decide where a secret is sent (a model's key goes to its base_url, the bot
    token to the Bot API server or Discord's api_base, the webhook secret to webhook_url): changing them from
    chat would hand the secret to any server, so they are set in config.json only."""
    return path.rsplit(".", 1)[-1] in {"base_url", "base_file_url", "webhook_url", "api_base"}


# -- how a change applies to a running gateway (README, "Live changes") ----------------------

# Read once at start: a change is saved but takes effect after a restart.
RESTART_KEYS = frozenset({"data_dir", "store.url", "http.host", "http.port", "http.header_timeout_s",
                          "http.body_timeout_s", "http.keepalive_timeout_s", "http.max_connections_per_client",
                          "http.max_connections", "http.probe_port",
                          "channels.web.enabled", "channels.terminal.enabled"})
# A change restarts that channel alone (it reconnects with its new settings).
CHANNEL_SECTIONS = ("channels.telegram", "channels.slack", "channels.discord")


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
