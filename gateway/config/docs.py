"""docs/configuration.md, generated from the config schema (`gateway.config.Config`).

Every key, its default, its allowed values (types, enums and the ranges of the Field
constraints) and how a change reaches a running gateway (`change_effect`) come from the
schema, so the page cannot drift from the code; only the one-line meanings are written by
hand, in MEANINGS below. tests/test_config_docs.py fails when the committed page is out of
date, when a key has no meaning, or when a meaning names a key that does not exist.

    python -m gateway.config.docs            # print the page
    python -m gateway.config.docs --write    # rewrite docs/configuration.md
    python -m gateway.config.docs --check    # exit 1 when docs/configuration.md is out of date
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from gateway.config.changes import change_effect, is_credential_destination, is_operator_only, is_secret_key
from gateway.config.schema import Config

ROOT = Path(__file__).resolve().parents[2]
DOC_PATH = ROOT / "docs" / "configuration.md"
SHIPPED_CONFIG = ROOT / "config.json"
REGENERATE = "python -m gateway.config.docs --write"

# One line per key: what it means to the person running the gateway. Rules the schema
# cannot express (formats checked by validators or at start) belong here or in ALLOWED.
MEANINGS: dict[str, str] = {
    "agent_max_context_tokens": "Token budget of one model request: system prompt, memory, summary, tool "
                                "schemas and messages together (the effective budget is also capped by the "
                                "model's window minus `model.max_output_tokens`).",
    "agent_max_context_turns": "Most turns kept in the live context; past it the earliest half is summarized "
                               "in the background and dropped.",
    "stream_interval_s": "Least seconds between two updates of one streamed message (Telegram edits, Slack "
                         "appends and updates).",
    "agent_max_steps": "Most tool-calling model calls in one turn; then one call without tools gives the answer.",
    "system_prompt": "The agent's instructions, at the start of every request.",
    "data_dir": "Where the database, the workspaces and the memory live; relative to the config file's directory.",
    "store.url": "The database: null is SQLite in `data_dir`; `postgresql://user:${PGPASSWORD}@host:5432/db` "
                 "selects PostgreSQL (a secret: a `${ENV}` reference keeps the password out of the file). "
                 "Read at start.",
    "timezone": "Zone of the daily note and archive file names, of `memory_consolidation_cron`, and of "
                "scheduled tasks' times (a task keeps the zone it was created in).",
    "session_retention_days": "Sessions and messages older than this are purged (memory files stay).",
    "tool_result_max_chars": "A tool result longer than this is cut when it is produced; the full text is saved "
                             "to `tool_results/` and the excerpt says how to read on.",
    "history_tool_result_max_chars": "Tool results in earlier turns are cut again to this size (head and tail "
                                     "kept, still pointing to the saved file).",
    "tool_result_ttl_days": "Saved full tool outputs older than this, and not referenced by a live context, "
                            "are deleted.",
    "memory_consolidation_cron": "When each scope's new daily notes are merged into its MEMORY.md by the model.",
    "memory_max_tokens": "Most tokens of MEMORY.md put in the system prompt (the rest is readable with "
                         "`read_file`); 0 leaves MEMORY.md out.",
    "summary_timeout_s": "How long one background summary may take before the extractive fallback stands in.",
    "admins": "Who may change settings and approve pairing codes: `\"telegram:<user id>\"`, "
              "`\"slack:<member id>\"`, `\"discord:<user id>\"`, `\"web:<session name>\"`; the terminal is "
              "always an admin.",
    "access.dm_policy": "Who may talk to the bot in a DM: everyone, only `allow_from` (and admins), or "
                        "strangers after an admin approves their one-time pairing code.",
    "access.allow_from": "Who may talk to the bot besides admins: `\"<channel>:<user id>\"` for a person, "
                         "`\"<channel>:<chat id>\"` for a group or channel, `\"*\"` for everyone. A group is "
                         "answered only when listed.",
    "access.group_trigger": "Which group messages the bot answers: a mention or a reply to the bot, a mention "
                            "only, or every message.",
    "group_session_scope": "In groups: one session and memory per person (`user`) or one shared by the "
                           "group (`group`). Topics and threads are always shared sessions of their own.",
    "model.name": "Model id sent to the provider.",
    "model.base_url": "An OpenAI-compatible API base such as `https://api.deepseek.com/v1`; `null` is OpenAI's.",
    "model.api_key": "The provider's API key.",
    "model.context_window": "The model's context window in tokens; `null` looks the model up in a table of "
                            "known models.",
    "model.max_output_tokens": "Tokens reserved for the model's answer.",
    "model.timeout_s": "Seconds one model request may take.",
    "model.max_retries": "Retries of a model call after a 429, a 5xx or a timeout (with backoff, honouring "
                         "Retry-After).",
    "model.temperature": "Sampling temperature sent to the provider; `null` leaves it to the provider.",
    "model.vision": "Whether images people send go to the model (scaled down, counted in the budget); `null` "
                    "looks the model up in a table of known vision models (GPT-4o/4.1/5, o3, o4-mini, Claude 3+, "
                    "Gemini, Qwen-VL, LLaVA …).",
    "summary_model": "An optional cheaper model for summaries and consolidation, with the same keys as "
                     "`model`; `null` uses `model`.",
    "summary_model.name": "Model id of the summary model.",
    "summary_model.base_url": "API base of the summary model; `null` is OpenAI's.",
    "summary_model.api_key": "API key of the summary model.",
    "summary_model.context_window": "Context window of the summary model; `null` looks it up.",
    "summary_model.max_output_tokens": "Tokens reserved for a summary.",
    "summary_model.timeout_s": "Seconds one summary request may take.",
    "summary_model.max_retries": "Retries of a summary call after a 429, a 5xx or a timeout.",
    "summary_model.temperature": "Sampling temperature of the summary model; `null` leaves it to the provider.",
    "summary_model.vision": "Not used: summaries are written from text (images are named by their files).",
    "model.fallbacks": "Aliases of `models` tried in order, in the same step, when a call to the model fails "
                       "after its retries with 429, 5xx, a timeout or a refused connection; never on a 4xx that "
                       "is the request's fault.",
    "models": "Named models that agents, fallbacks and `/model` refer to by alias; each has the shape of "
              "`model`, and a field left out is taken from `model`.",
    "models.<name>.name": "The model id sent to the provider; `null`: `model.name`.",
    "models.<name>.base_url": "Its OpenAI-compatible endpoint; `null`: `model.base_url`. An alias on another "
                              "server never gets `model.api_key`: give it its own `api_key` if that server "
                              "needs one.",
    "models.<name>.api_key": "Its API key (a `${ENV}` reference); `null`: `model.api_key` while the alias uses "
                             "`model`'s server, else none (its requests carry no key; check-config says so).",
    "models.<name>.context_window": "Its window in tokens; budgets follow the model a session uses.",
    "models.<name>.max_output_tokens": "Its output reserve; `null`: `model.max_output_tokens`.",
    "models.<name>.timeout_s": "Seconds one request may take; `null`: `model.timeout_s`.",
    "models.<name>.max_retries": "Retries of a transient failure before a fallback; `null`: `model.max_retries`.",
    "models.<name>.temperature": "Its sampling temperature; `null`: `model.temperature`.",
    "models.<name>.vision": "Whether it takes images; `null`: `model.vision`, else from the model's name.",
    "agents": "Agents besides `default` (the top level); which one answers a message is decided by `bindings`.",
    "agents.<name>.system_prompt": "Its instructions; `null`: `system_prompt_file`, else the top level's.",
    "agents.<name>.system_prompt_file": "A file holding its instructions (relative to the config file), read "
                                        "again when it changes.",
    "agents.<name>.model": "The alias of `models` it answers with; `null`: `model`.",
    "agents.<name>.fallbacks": "Aliases tried when its model fails; `null`: `model.fallbacks`.",
    "agents.<name>.tools": "The tools it may use (names, `*` patterns allowed, e.g. `\"web_*\"`); `null`: all.",
    "agents.<name>.skills": "The skills it may use (names), or `\"*\"` for all.",
    "agents.<name>.models": "The aliases its people may pick with `/model`; `null`: every alias of `models`.",
    "agents.<name>.delegates": "The agents it may hand work to with `delegate` (names, `*` patterns allowed); "
                               "itself always. `null`: only itself (the top-level agent `default` may reach "
                               "every agent). A sub-turn never has a tool or skill the delegating agent lacks.",
    "bindings": "Which agent answers where: a list of `{\"match\": {\"channel\", \"chat\", \"thread\", "
                "\"user\"}, \"agent\"}`; the first entry whose given fields all equal the message's (ids as "
                "strings) wins; none: `default`. In a shared session an entry naming a `user` never matches.",
    "channels.telegram.enabled": "Run the Telegram bot (setup: [telegram.md](telegram.md)).",
    "channels.telegram.token": "The bot token from @BotFather.",
    "channels.telegram.mode": "Long polling (no public address needed) or a webhook at "
                              "`POST /telegram/webhook` on the gateway's HTTP server.",
    "channels.telegram.base_url": "The Bot API server (python-telegram-bot's meaning); a self-hosted Bot API "
                                  "server works.",
    "channels.telegram.base_file_url": "Where files are downloaded from; `null` derives it from `base_url`.",
    "channels.telegram.webhook_url": "The public HTTPS address Telegram posts updates to (webhook mode); it "
                                     "must reach `POST /telegram/webhook`.",
    "channels.telegram.webhook_secret": "The secret Telegram sends with every webhook request (required in "
                                        "webhook mode), e.g. `openssl rand -hex 32`.",
    "channels.telegram.poll_timeout_s": "Seconds one long poll waits for updates (polling mode).",
    "channels.telegram.streaming": "`auto`: a reply grows as a draft in private chats and by editing its "
                                   "message in groups, then is sent once, finished; `draft`: the same, and a "
                                   "chat that refused a draft is still offered one next time; `edit`: a "
                                   "message that grows in place everywhere; `off`: sent whole at the end.",
    "channels.telegram.link_previews": "Let Telegram show link previews in replies. Off by default: Telegram's "
                                       "servers would fetch a URL in a reply before anyone clicks it.",
    "channels.slack.enabled": "Run the Slack app (setup: [slack.md](slack.md)).",
    "channels.slack.bot_token": "The Bot User OAuth Token (`xoxb-…`).",
    "channels.slack.app_token": "The app-level token (`xapp-…`, scope `connections:write`); needed in "
                                "Socket Mode.",
    "channels.slack.signing_secret": "The app's Signing Secret; needed in HTTP mode to check every request.",
    "channels.slack.mode": "Socket Mode (no public address needed) or HTTP events at `POST /slack/events` on "
                           "the gateway's HTTP server.",
    "channels.slack.base_url": "The Slack Web API base (slack_sdk's meaning).",
    "channels.slack.streaming": "`native`: Slack's streaming methods in the reply's thread (edits where Slack "
                                "refuses them); `update`: post, then edit at most once per `stream_interval_s`; "
                                "`off`: sent whole at the end.",
    "channels.slack.unfurl_links": "Let Slack unfurl links and media in replies (`chat.postMessage`). Off by "
                                   "default: Slack's servers would fetch a URL in a reply before anyone clicks it.",
    "channels.discord.enabled": "Run the Discord bot (setup: [discord.md](discord.md)).",
    "channels.discord.token": "The bot token from the Discord developer portal (Bot → Reset Token).",
    "channels.discord.api_base": "Discord's REST API base; the websocket address is what `GET /gateway/bot` "
                                 "on it returns, so a proxy or a test server can stand in.",
    "channels.discord.streaming": "`edit`: a reply grows in place as the model writes it; `off`: sent whole "
                                  "at the end.",
    "channels.slack.reply_to_mode": "`thread`: a top-level channel message that mentions the bot is answered in "
                                    "a thread under it, whose session starts with that message; `channel`: "
                                    "answered at the top level, in the channel's session. DMs are unchanged.",
    "channels.web.enabled": "Serve the local chat page at `/` and `POST /api/chat`.",
    "channels.web.token": "Bearer token of the web chat and API; required, at least 16 characters, when "
                          "`http.host` is not a loopback address. `null`: the token the gateway made in "
                          "`data_dir/web-token` (on loopback too, the API answers only with a token; the "
                          "page signs in with the link `run` and `web-link` print). Wrong tokens are answered "
                          "ever more slowly per address.",
    "channels.terminal.enabled": "Allow `python -m gateway chat`.",
    "http.host": "Address the HTTP server listens on (web chat, health, metrics, webhooks).",
    "tools.web_fetch.enabled": "Offer the `web_fetch` tool (a page as readable text; private addresses refused).",
    "tools.web_fetch.max_bytes": "Most bytes of one page that `web_fetch` reads.",
    "tools.web_fetch.timeout_s": "Seconds one `web_fetch` may take, redirects included.",
    "tools.web_fetch.allow_private_networks": "Let `web_fetch` reach loopback, private, link-local and reserved "
                                              "addresses (off: every address of every redirect hop is checked).",
    "tools.web_search.provider": "The search provider of the `web_search` tool; the tool exists only when set.",
    "tools.web_search.base_url": "The provider's address (required for `searxng`; overrides the others' "
                                 "default).",
    "tools.web_search.api_key": "The provider's API key (`brave`, `tavily`).",
    "tools.delegate.max_per_step": "Most `delegate` calls (sub-turns) one model reply may start; those past it "
                                   "get a result saying so and never run.",
    "tools.delegate.max_per_turn": "Most `delegate` calls one message may start over all its steps; those past "
                                   "it get a result saying so and never run.",
    "tools.exec.enabled": "Offer the `exec` tool: shell commands in a bubblewrap sandbox that sees the scope's "
                          "workspace and the system read-only, nothing else (needs `bwrap`).",
    "tools.exec.network": "Let `exec` commands use the network, through a network of their own (pasta or "
                          "slirp4netns) that never reaches this machine's loopback (off: no network at all).",
    "tools.exec.timeout_s": "Seconds one `exec` command may run; then it and everything it started are killed.",
    "tools.exec.memory_mb": "Address space of each process an `exec` command starts, in MB; also the size of its "
                            "private `/tmp`.",
    "tools.exec.disk_mb": "What one scope's workspace may hold on disk, in MB; a command that grows it past that "
                          "is killed, and the disk's last 5 % (256 MB to 4 GB) is never the sandbox's.",
    "mcp.servers": "MCP tool servers by name; their tools are offered as `<name>__<tool>`.",
    "mcp.servers.<name>.command": "The program of a stdio server (give this or `url`).",
    "mcp.servers.<name>.args": "Its arguments.",
    "mcp.servers.<name>.env": "Extra environment of a stdio server (values may be `${ENV}` references); the "
                              "gateway's own environment is not passed on.",
    "mcp.servers.<name>.cwd": "Working directory of a stdio server (relative to the config file).",
    "mcp.servers.<name>.url": "The endpoint of a streamable-HTTP server (give this or `command`).",
    "mcp.servers.<name>.headers": "HTTP headers sent to it (values may be `${ENV}` references).",
    "mcp.servers.<name>.tools": "Only these of the server's tools are offered; `null`: all.",
    "mcp.servers.<name>.timeout_s": "Seconds one call may take.",
    "mcp.servers.<name>.enabled": "Connect this server.",
    "mcp.servers.<name>.sandbox": "Run this stdio server in the `exec` sandbox: it sees its `cwd` (or "
                                  "`data/mcp/<name>/`) read-write, the system and `read_only_paths` read-only, "
                                  "not the gateway's files or environment.",
    "mcp.servers.<name>.network": "With `sandbox`: whether the server may use the network (as `exec`'s: never "
                                  "this machine's loopback).",
    "mcp.servers.<name>.read_only_paths": "With `sandbox`: more paths the server may read, at the same path (its "
                                          "virtualenv, `node_modules`); relative to the config file.",
    "tasks.max_per_scope": "Most scheduled tasks one scope (a person's chats, or a group) may have at once; "
                           "0 stops new ones.",
    "tasks.min_interval_s": "Shortest period of a repeating task (`every`), and least time between two runs "
                            "of a `cron` task.",
    "tasks.misfire_grace_s": "A task run missed while the gateway was down runs once after the start if it is "
                             "at most this many seconds late; later ones are skipped (and recorded as missed).",
    "skills.dirs": "Folders whose subfolders each hold a skill (a `SKILL.md` with `name` and `description`), "
                   "relative to the config file's directory (at most 16); a name found twice is the first "
                   "folder's. Set in config.json only; changes, and edits of the skills, apply from the next "
                   "request.",
    "http.admin_token": "Bearer token of the admin page at `/admin` (off while unset); at least 16 characters, "
                        "not the web chat's token.",
    "http.port": "Port of the HTTP server.",
    "http.probe_port": "A second port, on `http.host`, that answers only `/healthz` and `/readyz` (null: off; 0: "
                       "any free port). Point the orchestrator's probes at it: no crowd of connections to "
                       "`http.port` can make them fail. Its connections have short deadlines and the longest idle "
                       "one makes way for a newcomer when it is full.",
    "http.header_timeout_s": "Seconds from connecting (or a request's first byte) to the request's complete "
                             "head; slower connections are closed.",
    "http.body_timeout_s": "Seconds a request body may take (else 408).",
    "http.keepalive_timeout_s": "Seconds an idle connection stays open between requests.",
    "http.max_connections_per_client": "Open connections allowed from one address (more get a 503); raise it "
                                       "behind a reverse proxy.",
    "http.max_connections": "Open connections in all (null: from the open-files limit, leaving the rest of the "
                            "gateway its descriptors); past it, new connections may only ask `/healthz` and "
                            "`/readyz`, everything else gets a 503.",
    "limits.max_concurrent_model_calls": "Model calls in flight across all sessions.",
    "limits.session_queue_size": "Messages waiting in one session's queue; one more gets a short \"busy\" "
                                 "reply.",
    "limits.max_inbound_chars": "Longest message accepted; a longer one is answered with the limit.",
    "limits.max_live_sessions": "Sessions kept in memory; idle ones past this are let go and restored from the "
                                "database when they are written in again.",
    "limits.tokens_per_user_per_day": "Tokens one person may use per day (admins are exempt), sub-turns "
                                      "included; checked before every model call: a call whose request and a "
                                      "minimal answer do not fit what is left is not made. `null` is no limit.",
    "limits.turns_per_user_per_day": "Messages one person may have answered per day (admins are exempt); "
                                     "`null` is no limit.",
    "limits.turn_timeout_s": "Seconds one turn may take before it is stopped and the person told.",
    "limits.max_inbound_file_mb": "Largest file downloaded from a platform (photos, documents, voice notes); a "
                                  "larger one is refused with a reply, by the size the platform reports and "
                                  "again while downloading. Telegram's cloud Bot API serves at most 20 MB.",
    "transcription.enabled": "Transcribe voice notes and audio files into the turn's text (off: the person is "
                             "told that voice messages cannot be heard).",
    "transcription.model": "Speech-to-text model sent to `/audio/transcriptions`.",
    "transcription.base_url": "An OpenAI-compatible API base with `/audio/transcriptions`; `null` uses "
                              "`model.base_url`.",
    "transcription.api_key": "Its API key; `null` uses `model.api_key`, unless `base_url` names another "
                             "server (that one never gets the model's key).",
    "transcription.timeout_s": "Seconds one transcription may take before the person is told it failed.",
    "log_level": "Least severe log lines written.",
    "approvals.tools": "Tools that wait for a person's yes before each call (`\"ask\"`; `\"allow\"` runs one "
                       "without asking); a given object replaces the default, so `{}` means no tool asks.",
    "approvals.approvers": "Who may answer: `admins`, or `participants` (anyone whose messages go into the "
                           "session) and admins.",
    "approvals.timeout_s": "Seconds a call waits for an answer; none in time is a deny.",
    "hooks": "Inbound webhooks by name: a signed `POST /hooks/<name>` starts a turn whose reply goes to a chat "
             "(README, \"Webhooks\").",
    "hooks.<name>.secret": "Key of the `X-Hub-Signature-256` HMAC (GitHub's webhook secret); at least 16 "
                           "characters, required.",
    "hooks.<name>.session": "Session key the turns run in, e.g. `\"telegram:dm:123\"`, "
                            "`\"slack:channel:C123:thread:1712.55\"`, `\"web:alice\"`.",
    "hooks.<name>.deliver_to": "Where the reply goes: `<channel>:<chat id>[:<thread>]`, e.g. "
                               "`\"telegram:-1001234:5\"` (a topic) or `\"slack:C123:1712.55\"` (a thread).",
    "hooks.<name>.template": "The turn's text; `{body}` is replaced by the request's body (JSON pretty-printed), "
                             "cut to `limits.max_inbound_chars`.",
}

# Allowed values that validators check and the schema cannot show.
ALLOWED: dict[str, str] = {
    "timezone": "an IANA zone name such as `\"Europe/Berlin\"`, or `null` (the system's zone)",
    "memory_consolidation_cron": "five cron fields (minute hour day month weekday), read in `timezone`",
    "channels.telegram.webhook_secret": "secret: 16–256 characters of `A-Z a-z 0-9 _ -`, or `null`",
    "hooks.<name>.secret": "secret: at least 16 characters",
    "hooks.<name>.session": "a session key (required)",
    "hooks.<name>.deliver_to": "`<channel>:<chat id>[:<thread>]` of a messaging channel (required)",
    "hooks.<name>.template": "text containing `{body}`",
}

Effect = Literal["live", "channel", "restart"]
EFFECT_TEXT: dict[str, str] = {"live": "live", "channel": "restarts the channel", "restart": "after a restart"}


@dataclass(frozen=True, slots=True)
class KeyDoc:
    """One documented key: a leaf setting, or a section that may be `null`."""

    key: str  # dotted path; `<name>` stands for the entries of a mapping
    section: str  # the dotted path of the table it is listed in ("" for the top level)
    default: Any  # as JSON would hold it
    allowed: str
    effect: Effect
    chat: bool  # settable with `/config KEY VALUE` (secrets and their destinations are not)


def config_keys() -> list[KeyDoc]:
    """Every key of the config schema, in the schema's order."""
    return list(_walk(Config, Config(), "", ""))


def _walk(model: type[BaseModel], instance: BaseModel | None, prefix: str, section: str) -> Iterator[KeyDoc]:
    later: list[tuple[type[BaseModel], BaseModel | None, str]] = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        default = getattr(instance, name) if instance is not None else _field_default(field)
        nested, nullable = _nested_model(field.annotation)
        if nested is not None and not nullable:
            later.append((nested, default, key))  # a section: its keys get a table of their own
            continue
        entry = _mapping_of_models(field.annotation)
        yield KeyDoc(
            key=key,
            section=section,
            default=_jsonable(default),
            allowed=ALLOWED.get(key) or _allowed(field.annotation, field.metadata),
            effect=change_effect(key),
            chat=not (is_secret_key(key) or is_credential_destination(key) or is_operator_only(key)),
        )
        if nested is not None:  # a section that may be null: its keys as they are when it is set
            later.append((nested, None, key))
        elif entry is not None:  # a mapping of named sections, e.g. servers by name
            later.append((entry, None, f"{key}.<name>"))
    for nested, value, key in later:
        yield from _walk(nested, value, f"{key}.", key)


def _field_default(field: FieldInfo) -> Any:
    if field.default is not PydanticUndefined:
        return field.default
    if field.default_factory is not None:
        return field.default_factory()  # type: ignore[call-arg]
    return None


def _strip_optional(annotation: Any) -> tuple[Any, bool]:
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        nullable = len(args) < len(get_args(annotation))
        return (args[0] if len(args) == 1 else Union[tuple(args)]), nullable  # noqa: UP007
    return annotation, False


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _nested_model(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    inner, nullable = _strip_optional(annotation)
    return (inner, nullable) if _is_model(inner) else (None, nullable)


def _mapping_of_models(annotation: Any) -> type[BaseModel] | None:
    inner, _ = _strip_optional(annotation)
    if get_origin(inner) is dict:
        args = get_args(inner)
        if len(args) == 2 and _is_model(args[1]):
            return args[1]  # type: ignore[no-any-return]
    return None


def _jsonable(value: Any) -> Any:
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, BaseModel):
        return {name: _jsonable(getattr(value, name)) for name in type(value).model_fields}
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return value


def _bounds(metadata: list[Any]) -> str:
    """The Field constraints as text: `≥ 1`, `> 0`, `0–65535`."""
    ge = gt = le = lt = None
    for item in metadata:
        if isinstance(item, annotated_types.Ge):
            ge = item.ge
        elif isinstance(item, annotated_types.Gt):
            gt = item.gt
        elif isinstance(item, annotated_types.Le):
            le = item.le
        elif isinstance(item, annotated_types.Lt):
            lt = item.lt
    if ge is not None and le is not None:
        return f"{ge}–{le}"
    parts = [f"{sign} {value}" for sign, value in (("≥", ge), (">", gt), ("≤", le), ("<", lt)) if value is not None]
    return ", ".join(parts)


def _allowed(annotation: Any, metadata: list[Any]) -> str:
    inner, nullable = _strip_optional(annotation)
    text = _type_text(inner, metadata)
    return f"{text}, or `null`" if nullable else text


def _type_text(annotation: Any, metadata: list[Any]) -> str:
    origin = get_origin(annotation)
    if origin is Literal:
        return " / ".join(f"`{json.dumps(v)}`" for v in get_args(annotation))
    if annotation is bool:
        return "`true` / `false`"
    if annotation in (int, float):
        kind = "integer" if annotation is int else "number"
        bounds = _bounds(metadata)
        return f"{kind} {bounds}" if bounds else kind
    if annotation is str:
        return "text"
    if annotation is SecretStr:
        return "secret text"
    if origin in (tuple, list):
        args = [a for a in get_args(annotation) if a is not Ellipsis]
        item = _type_text(args[0], []) if args else "values"
        return f"list of {item}"
    if origin is dict:
        entry = _mapping_of_models(annotation)
        return "object of named entries (keys below)" if entry is not None else "object"
    if _is_model(annotation):
        return "object (keys below)"
    return f"`{annotation}`"


# -- rendering -------------------------------------------------------------------------------


def _shipped_values() -> dict[str, Any]:
    """The repository's config.json, flattened to dotted keys ({} when it is absent)."""
    try:
        raw = json.loads(SHIPPED_CONFIG.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}

    def flat(data: Any, prefix: str) -> Iterator[tuple[str, Any]]:
        if isinstance(data, dict) and data:
            for k, v in data.items():
                yield from flat(v, f"{prefix}{k}.")
        else:
            yield prefix[:-1], data

    return dict(flat(raw, "")) if isinstance(raw, dict) else {}


def _code(value: Any) -> str:
    return f"`{json.dumps(value, ensure_ascii=False)}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


INTRO = f"""\
# Configuration reference

<!-- Generated from gateway/config/schema.py by `{REGENERATE}`; do not edit by hand. -->

The gateway reads `config.json` from the directory it is started in, or the file given with
`--config PATH`. A key that is not in the file takes its default; an unknown key is refused
with its path and a "did you mean" hint. `python -m gateway check-config [PATH]` checks a file
as `run` would. The repository's `config.json` lists every key with its default and no
secrets.

Secrets (keys marked *secret text*) may be written as `"${{NAME}}"`: the environment variable
is read when the file is loaded. Nothing else is expanded, and nothing set from chat is. A
reference to an unset variable stops `run` when the feature that needs it is enabled.

**Changes.** The file is watched; a valid change is applied, an invalid one is refused and
the running settings stay. The *change* column says how a change reaches a running gateway:

- **live**: applies from the next model call, request or job (turns already running finish
  with the settings they started with);
- **restarts the channel**: that channel alone reconnects with its new settings;
- **after a restart**: saved and logged, applied when the gateway next starts.

Admins can also change a key from chat with `/config KEY VALUE` (e.g.
`/config agent_max_context_tokens 80000`); keys marked **file only** (secrets, the
addresses secrets are sent to, MCP servers, `tools.exec` and `approvals`) can be changed in the file only.

**Several gateways on one PostgreSQL** (`store.url`): a `/config` change is written to the
config file of the gateway that took it and recorded in the database; every gateway puts the
latest chat change of each key over its own file, at start, when its file is reloaded and
within about 2 seconds of the change. A chat change wins over the files for its key until
`python -m gateway config-reset KEY` gives the key back to the files (without KEY it lists the
chat changes in effect). `data_dir`, `http.host`, `http.port` and `http.probe_port` stay each gateway's own, and
a change a gateway cannot run (a feature whose secret it lacks) is left out there, logged. A
lone gateway on SQLite records its chat changes but runs its file only.

Setting up the platforms: [telegram.md](telegram.md), [slack.md](slack.md), [discord.md](discord.md). Where
`data_dir` keeps memory and how to back it up: [memory.md](memory.md).
"""


def render() -> str:
    shipped = _shipped_values()
    docs = config_keys()
    sections: dict[str, list[KeyDoc]] = {}
    for doc in docs:
        sections.setdefault(doc.section, []).append(doc)
    out = [INTRO]
    for section, rows in sections.items():
        title = f"`{section}`" if section else "Top level"
        parent = next((d for d in docs if d.key == section), None)
        out.append(f"\n## {title}\n")
        if parent is not None:
            out.append(f"\nThese keys apply when `{section}` is set (it is `null` by default).\n")
        out.append("\n| key | default | allowed | change | meaning |\n|---|---|---|---|---|\n")
        for doc in rows:
            default = _code(doc.default)
            if doc.key in shipped and shipped[doc.key] != doc.default:
                default += f" (config.json: {_code(shipped[doc.key])})"
            change = EFFECT_TEXT[doc.effect] + ("" if doc.chat else ", file only")
            meaning = MEANINGS.get(doc.key, "")
            cells = (f"`{doc.key}`", default, doc.allowed, change, meaning)
            out.append("| " + " | ".join(_cell(c) for c in cells) + " |\n")
    return "".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway.config.docs", description=__doc__.splitlines()[0])
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", action="store_true", help=f"rewrite {DOC_PATH.relative_to(ROOT)}")
    action.add_argument("--check", action="store_true", help="exit 1 when the page is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        DOC_PATH.write_text(text, encoding="utf-8")
        print(f"wrote {DOC_PATH.relative_to(ROOT)}")
        return 0
    if args.check:
        current = DOC_PATH.read_text(encoding="utf-8") if DOC_PATH.exists() else ""
        if current != text:
            print(f"{DOC_PATH.relative_to(ROOT)} is out of date: run `{REGENERATE}`", file=sys.stderr)
            return 1
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
