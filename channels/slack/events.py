"""A Slack event or slash command as the gateway's `Inbound`, a press of an approval card's
button (`block_actions`), and the request signature check (SPEC §9). Pure, no I/O."""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
from dataclasses import dataclass
from typing import Any, Literal

from channels.slack.format import clean_text, slack_to_text
from gateway.media import (
    kind_of,
)
from gateway.types import AttachmentKind, Inbound

log = logging.getLogger("channels.slack")

SIGNATURE_MAX_AGE_S = 300  # Slack's own bound: older (or future) timestamps are replays
# Message subtypes that are a person's new post; every other subtype (edits, deletes,
# joins, bot messages, …) is not something to answer.
_ANSWERED_SUBTYPES = frozenset({None, "file_share", "thread_broadcast"})
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_COMMAND = re.compile(r"/[a-z0-9_.-]{1,32}")
ReplyToMode = Literal["thread", "channel"]  # channels.slack.reply_to_mode

@dataclass(frozen=True, slots=True)
class SlackFile:
    """A file shared with a message, as Slack describes it (downloaded later)."""

    id: str
    name: str
    url: str
    size: int
    mime: str | None
    kind: AttachmentKind = "file"
    duration_s: float | None = None  # audio clips recorded in Slack carry it


@dataclass(frozen=True, slots=True)
class ParsedEvent:
    inbound: Inbound
    files: tuple[SlackFile, ...] = ()


def slack_id(value: Any) -> str | None:
    """A Slack id or timestamp, or None for anything else (junk never reaches keys or paths)."""
    if isinstance(value, str) and _ID.fullmatch(value):
        return value
    return None


def profile_name(profile: Any) -> str | None:
    if not isinstance(profile, dict):
        return None
    for key in ("display_name", "real_name", "name"):
        value = profile.get(key)
        if isinstance(value, str) and value.strip():
            return clean_text(value.strip())[:80]
    return None


def _files(raw: Any) -> tuple[SlackFile, ...]:
    if not isinstance(raw, list):
        return ()
    found = []
    for item in raw[:20]:
        if not isinstance(item, dict) or item.get("mode") in ("tombstone", "hidden_by_limit"):
            continue
        file_id = slack_id(item.get("id"))
        url = item.get("url_private_download") or item.get("url_private")
        if file_id is None or not isinstance(url, str):
            continue
        name = item.get("name")
        size = item.get("size")
        mime = item.get("mimetype") if isinstance(item.get("mimetype"), str) else None
        # One line: a name must not be able to fake another "[file: …]" note.
        shown = " ".join(clean_text(name).split())[:200] if isinstance(name, str) and name.strip() else file_id
        kind = kind_of(mime, shown)
        if kind == "audio" and item.get("subtype") == "slack_audio":
            kind = "voice"  # a clip recorded in Slack: a voice message
        duration = item.get("duration_ms")
        found.append(
            SlackFile(
                id=file_id,
                name=shown,
                url=url,
                size=size if isinstance(size, int) and size >= 0 else 0,
                mime=mime,
                kind=kind,
                duration_s=duration / 1000 if isinstance(duration, int) and duration >= 0 else None,
            )
        )
    return tuple(found)


def parse_event(
    event: Any, *, bot_user_id: str | None, bot_id: str | None = None, team_id: str | None = None,
    reply_to_mode: ReplyToMode = "thread",
) -> ParsedEvent | None:
    """One Events API `event` → what the router gets, or None when it is not a person's
    new message to us (the caller logs and acknowledges). `team_id` is the envelope's.
    `reply_to_mode` is `channels.slack.reply_to_mode`: in "thread", a top-level channel
    message that mentions the bot opens a thread under itself (its own ts), which is then
    its session and where it is answered."""
    if not isinstance(event, dict):
        return None
    kind = event.get("type")
    if kind not in ("message", "app_mention"):
        return None
    subtype = event.get("subtype")
    if not (subtype is None or (isinstance(subtype, str) and subtype in _ANSWERED_SUBTYPES)):
        return None
    if event.get("bot_id") or event.get("bot_profile"):
        return None  # any bot, ours included
    user, channel, ts = slack_id(event.get("user")), slack_id(event.get("channel")), slack_id(event.get("ts"))
    if user is None or channel is None or ts is None:
        return None
    if user in (bot_user_id, bot_id):
        return None
    raw_text = event.get("text")
    text, mentioned = slack_to_text(raw_text if isinstance(raw_text, str) else "", bot_user_id)
    files = _files(event.get("files"))
    if not text and not files:
        return None
    channel_type = event.get("channel_type")
    is_dm = channel_type == "im" or (channel_type is None and channel.startswith("D"))
    parent_user = event.get("parent_user_id")
    thread = slack_id(event.get("thread_ts"))
    if thread == ts:
        thread = None  # a thread's parent may carry its own ts as thread_ts: still top-level
    mentioned = mentioned or kind == "app_mention"
    if thread is None and not is_dm and mentioned and reply_to_mode == "thread":
        # Answered in a thread under the mention, the way Slack bots reply: the thread's
        # session starts with this message, so a follow-up in the thread continues it.
        thread = ts
    inbound = Inbound(
        channel="slack",
        chat_id=channel,
        user_id=user,
        text=text,
        # Not Slack's event_id: the `message` and `app_mention` twins of one post have
        # different event ids, but the same channel and ts.
        event_id=f"{channel}:{ts}",
        message_id=ts,
        thread_id=thread,
        is_group=not is_dm,
        mentioned=mentioned,
        reply_to_bot=bool(bot_user_id) and parent_user == bot_user_id,
        user_name=profile_name(event.get("user_profile")),
        # The person's team: a native stream in a channel names its recipient (SPEC §5.1).
        extra=_team_extra(event, team_id),
    )
    return ParsedEvent(inbound, files)


def _team_extra(event: dict[str, Any], team_id: str | None) -> dict[str, Any]:
    team = slack_id(event.get("user_team")) or slack_id(event.get("team")) or slack_id(team_id)
    return {"team_id": team} if team else {}


def parse_command(payload: Any) -> Inbound | None:
    """A slash-command payload → an Inbound whose text is `/command args`."""
    if not isinstance(payload, dict):
        return None
    command = payload.get("command")
    user, channel = slack_id(payload.get("user_id")), slack_id(payload.get("channel_id"))
    trigger = payload.get("trigger_id")
    if not isinstance(command, str) or not _COMMAND.fullmatch(command):
        return None
    if user is None or channel is None or not isinstance(trigger, str) or not trigger:
        return None
    raw_args = payload.get("text")
    args, _ = slack_to_text(raw_args if isinstance(raw_args, str) else "", None)
    extra: dict[str, Any] = {"command": command}
    response_url = payload.get("response_url")
    if isinstance(response_url, str) and response_url.startswith(("https://", "http://")):
        extra["response_url"] = response_url
    user_name = payload.get("user_name")
    return Inbound(
        channel="slack",
        chat_id=channel,
        user_id=user,
        text=f"{command} {args}".strip(),
        event_id="cmd:" + clean_text(trigger)[:100],
        is_group=not channel.startswith("D"),
        mentioned=True,  # a slash command is addressed to the bot by definition
        user_name=clean_text(user_name)[:80] if isinstance(user_name, str) and user_name else None,
        extra=extra,
    )


@dataclass(frozen=True, slots=True)
class ParsedClick:
    """A press of Allow or Deny on an approval card: who pressed it where (an `Inbound`
    without text, in the conversation the card is in), and where a notice to them goes."""

    approval_id: str
    allow: bool
    who: Inbound
    response_url: str | None


_APPROVAL_ID = re.compile(r"[a-z0-9]{1,32}")


def parse_block_action(payload: Any) -> ParsedClick | None:
    """A `block_actions` payload whose first action is one of the card's buttons, or None.
    Never raises."""
    if not isinstance(payload, dict) or payload.get("type") != "block_actions":
        return None
    actions = payload.get("actions")
    action = actions[0] if isinstance(actions, list) and actions else None
    if not isinstance(action, dict) or action.get("action_id") not in ("approval_allow", "approval_deny"):
        return None
    value = action.get("value")
    if not isinstance(value, str) or not _APPROVAL_ID.fullmatch(value):
        return None
    user = _field(payload, "user")
    container = _field(payload, "container")
    message = _field(payload, "message")
    user_id = slack_id(user.get("id"))
    channel = slack_id(_field(payload, "channel").get("id")) or slack_id(container.get("channel_id"))
    if user_id is None or channel is None:
        return None
    ts = slack_id(container.get("message_ts")) or slack_id(message.get("ts"))
    thread = slack_id(container.get("thread_ts")) or slack_id(message.get("thread_ts"))
    if thread == ts:
        thread = None  # a thread's parent: the card is at the top level
    trigger = payload.get("trigger_id")
    name = user.get("name") or user.get("username")
    response_url = payload.get("response_url")
    who = Inbound(
        channel="slack",
        chat_id=channel,
        user_id=user_id,
        text="",
        event_id="action:" + (clean_text(trigger)[:100] if isinstance(trigger, str) else f"{channel}:{ts}"),
        message_id=ts,
        thread_id=thread,
        is_group=not channel.startswith("D"),
        user_name=clean_text(name)[:80] if isinstance(name, str) and name else None,
        extra=_team_extra({"team": user.get("team_id")}, slack_id(_field(payload, "team").get("id"))),
    )
    return ParsedClick(value, action["action_id"] == "approval_allow", who,
                       response_url if isinstance(response_url, str) and response_url.startswith(
                           ("https://", "http://")) else None)


def _field(payload: dict[str, Any], key: str) -> dict[str, Any]:
    value = payload.get(key)
    return value if isinstance(value, dict) else {}


def verify_signature(
    secret: str, body: bytes, timestamp: str | None, signature: str | None, *, now: float,
    max_age: float = SIGNATURE_MAX_AGE_S,
) -> bool:
    """Slack's request signature: `v0=` HMAC-SHA256 of `v0:{timestamp}:{body}`."""
    if not secret or not timestamp or not signature:
        return False
    try:
        sent_at = int(timestamp)
    except ValueError:
        return False
    if abs(now - sent_at) > max_age:
        return False
    base = b"v0:" + timestamp.encode() + b":" + body
    expected = "v0=" + hmac.new(secret.encode(), base, hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected.encode(), signature.encode("utf-8", "replace"))


def reply_thread(inbound: Inbound) -> str | None:
    """Where a reply goes: the message's thread, which is its session. A thread someone
    wrote in keeps the reply there; a top-level mention in `reply_to_mode: "thread"` came
    with its own ts as the thread (parse_event), so the reply opens a thread under it and
    the thread's session already holds the question; any other top-level message belongs
    to the channel's top-level session (per person or shared, `group_session_scope`) and is
    answered at the top level."""
    return inbound.thread_id
