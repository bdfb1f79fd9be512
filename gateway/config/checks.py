"""What a command needs before it starts: secrets set for what it runs, webhook and admin
tokens that are real secrets, an HTTP server reachable only as safe as its tokens."""

from __future__ import annotations

from pydantic import (
    SecretStr,
)

from gateway.config.changes import SECRET_KEYS
from gateway.config.schema import (
    ADMIN_TOKEN_MIN,
    HOOK_SECRET_MIN,
    LOOPBACK_HOSTS,
    WEB_TOKEN_MIN,
    WEBHOOK_SECRET,
    WEBHOOK_SECRET_MAX,
    WEBHOOK_SECRET_MIN,
    Config,
    TelegramConfig,
    secret_text,
)


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


def hook_secret_problem(value: str | None) -> str | None:
    """Why `value` cannot sign a hook's requests, or None when it can."""
    rule = f"at least {HOOK_SECRET_MIN} random characters (e.g. the output of `openssl rand -hex 32`)"
    if not value:
        return f"required: {rule}, the same as the sender's webhook secret"
    if len(value) < HOOK_SECRET_MIN:
        return f"too short ({len(value)} characters); use {rule}"
    return None


def usable_hook_secret(value: SecretStr | None) -> str | None:
    """The hook's secret when it passes hook_secret_problem, else None (the hook then
    refuses every request)."""
    text = secret_text(value)
    return text if hook_secret_problem(text) is None else None


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
        dc = cfg.channels.discord
        if dc.enabled:
            need("channels.discord.token", dc.token, "when channels.discord.enabled is true")
    search = cfg.tools.web_search
    if search.provider in ("brave", "tavily"):
        need("tools.web_search.api_key", search.api_key, f"while tools.web_search.provider is {search.provider!r}")
    web = cfg.channels.web
    if http and web.enabled:
        if "channels.web.token" in unset:
            problems.append(not_set("channels.web.token", "while channels.web.enabled is true"))
        elif cfg.http.host not in LOOPBACK_HOSTS:
            token = secret_text(web.token)
            if token is None:
                problems.append("channels.web.token: required when http.host is not a loopback address")
            elif len(token) < WEB_TOKEN_MIN:
                # Reachable from the network, it gives a chat as `web:<any name>`, admins' too.
                problems.append(f"channels.web.token: too short ({len(token)} characters); use at least "
                                f"{WEB_TOKEN_MIN} random ones when http.host is not a loopback address "
                                "(e.g. `openssl rand -hex 32`)")
    if http:
        problem = admin_token_problem(cfg, unset.get("http.admin_token"))
        if problem is not None:
            problems.append(problem)
        # Hooks arrive over the HTTP server: each needs a secret that can sign.
        for name, hook in cfg.hooks.items():
            path = f"hooks.{name}.secret"
            if path in unset:
                problems.append(not_set(path, f"while the hook {name} is configured"))
            elif (problem := hook_secret_problem(secret_text(hook.secret))) is not None:
                problems.append(f"{path}: {problem}")
    for path in unset:
        if path.startswith("hooks."):
            continue  # above: needed where the HTTP server runs
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
    """Worth saying, not worth refusing: the first run works without a model key; an alias
    on a server of its own gets no key it was not given; a hook may answer in a channel
    that is off (its turns run, their replies are not delivered)."""
    warnings = [f"{path}: the environment variable {var} is not set; every chat answers with what to set "
                "until it is" for path, var in cfg.unset_env if path == "model.api_key"]
    if not warnings and cfg.model.key_value() is None:  # said once, whichever way the key is missing
        warnings.append("model.api_key: not set; every chat answers with what to set until it is (a local "
                        "model's server takes any placeholder key)")
    for alias in sorted(cfg.models):
        if cfg.model_for(alias).keyless:
            warnings.append(f"models.{alias}.api_key: not set, and models.{alias}.base_url names a server other "
                            "than model.base_url: its requests go without an API key (model.api_key is never "
                            f"sent to another server); set models.{alias}.api_key if that server needs one")
    t = cfg.transcription
    if t.enabled and t.api_key is None and t.base_url is not None and cfg.transcription_endpoint()[1] is None \
            and cfg.model.key_value() is not None:
        warnings.append("transcription.api_key: not set, and transcription.base_url names a server other than "
                        "model.base_url: voice notes are not transcribed until it is set (model.api_key is never "
                        "sent to another server; a local server takes any placeholder key)")
    for name, hook in cfg.hooks.items():
        channel = hook.deliver_to.partition(":")[0]
        section = getattr(cfg.channels, channel, None)
        if section is not None and not section.enabled:
            warnings.append(f"hooks.{name}.deliver_to: channels.{channel} is not enabled; the hook's turns run "
                            "but their replies are not delivered")
    return warnings
