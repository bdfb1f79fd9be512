"""Session keys and memory scopes (SPEC §1): pure functions of an `Inbound`."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gateway.types import Inbound

GroupScope = Literal["user", "group"]

_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True, slots=True)
class KeyWords:
    """How a messaging platform's session keys are spelled (SPEC §1)."""

    room: str = "group"  # a group chat: `telegram:group:-100`, `slack:channel:C1`
    thread: str = "topic"  # a conversation inside one: `…:topic:5`, `…:thread:1712.55`
    dm_by_chat: bool = False  # a DM keyed by its chat (Slack's D… channel) rather than the person


KEY_WORDS: dict[str, KeyWords] = {
    "telegram": KeyWords(),
    "slack": KeyWords(room="channel", thread="thread", dm_by_chat=True),
    # A Discord thread's chat is its parent channel: `discord:channel:77:thread:91`.
    "discord": KeyWords(room="channel", thread="thread"),
}
LOCAL = ("web", "terminal")  # one session per chat id, never a group

# A sub-turn's messages are stored under `<session key>#sub:<turn>:<tag>` (SPEC §5.8); no
# session key holds a "#" otherwise (platform ids, web names: channels/web SESSION_NAME).
_SUB_TURN = re.compile(r"(?P<parent>[^#]+)#sub:\d+:[0-9a-f]+")


def sub_turn_key(parent: str, turn: int, tag: str) -> str:
    """Where a sub-turn that the turn `turn` of session `parent` delegated is stored."""
    return f"{parent}#sub:{turn}:{tag}"


def delegating_session(key: str) -> str:
    """The session whose turn a sub-turn's key belongs to; `key` itself for a session's own."""
    found = _SUB_TURN.fullmatch(key)
    return found.group("parent") if found else key


def session_key(inbound: Inbound, group_scope: GroupScope = "user") -> str:
    """`channel:scope` text; keys never collide across channels."""
    ch = inbound.channel
    if ch in LOCAL:
        return f"{ch}:{inbound.chat_id}"
    words = KEY_WORDS.get(ch, KeyWords())
    if not inbound.is_group:
        return f"{ch}:dm:{inbound.chat_id if words.dm_by_chat else inbound.user_id}"
    if inbound.thread_id:
        # A Telegram topic, a Slack or Discord thread is a conversation of its own.
        return f"{ch}:{words.room}:{inbound.chat_id}:{words.thread}:{inbound.thread_id}"
    if group_scope == "group":
        return f"{ch}:{words.room}:{inbound.chat_id}"
    return f"{ch}:{words.room}:{inbound.chat_id}:user:{inbound.user_id}"


def is_shared(inbound: Inbound, group_scope: GroupScope = "user") -> bool:
    """Whether several people can write in the message's session (SPEC §1, shared session):
    a group session in "group" mode, every Telegram topic, every Slack or Discord thread."""
    if inbound.channel in LOCAL or not inbound.is_group:
        return False
    return bool(inbound.thread_id) or group_scope == "group"


def memory_scope(inbound: Inbound, group_scope: GroupScope = "user") -> str:
    """Whose long-term memory the session reads and writes. A shared session always uses
    the group's scope, never the scope of whoever wrote first: one person's MEMORY.md,
    notes and files never reach a turn another person's message caused. The scope is a
    function of the session key alone, so a session keeps one scope whoever writes."""
    ch = inbound.channel
    if ch in LOCAL:
        return f"{ch}:{inbound.chat_id}"
    if not inbound.is_group:
        return f"{ch}:user:{inbound.user_id}"
    if is_shared(inbound, group_scope):
        return f"{ch}:group:{inbound.chat_id}"
    return f"{ch}:group:{inbound.chat_id}:user:{inbound.user_id}"


def scope_dirname(scope: str) -> str:
    """A filesystem-safe, collision-free directory name for a scope."""
    readable = _SAFE.sub("_", scope)[:80]
    digest = hashlib.sha256(scope.encode()).hexdigest()[:10]
    return f"{readable}-{digest}"


def workspace_dir(data_dir: Path, scope: str) -> Path:
    return data_dir / "scopes" / scope_dirname(scope)


# -- reading a session key back (hooks name the session their turns run in) ----------------

_TELEGRAM_ID = r"-?[0-9]{1,20}"
_SLACK_ID = r"[A-Za-z0-9]{1,32}"
_SLACK_TS = r"[0-9]{1,20}(?:\.[0-9]{1,10})?"
_WEB_NAME = r"[A-Za-z0-9_.@-]{1,64}"  # the web page's session names (channels/web SESSION_NAME)
# Each channel's keys as session_key() writes them (DMs, groups per person or shared, topics,
# threads; web sessions by name). A key that matches none is not a session of this gateway.
_KEY_SHAPES: tuple[tuple[re.Pattern[str], str, bool, GroupScope], ...] = tuple(
    (re.compile(pattern), channel, group, mode) for pattern, channel, group, mode in (
        (rf"telegram:dm:(?P<user>{_TELEGRAM_ID})", "telegram", False, "user"),
        (rf"telegram:group:(?P<chat>{_TELEGRAM_ID})", "telegram", True, "group"),
        (rf"telegram:group:(?P<chat>{_TELEGRAM_ID}):user:(?P<user>{_TELEGRAM_ID})", "telegram", True, "user"),
        (rf"telegram:group:(?P<chat>{_TELEGRAM_ID}):topic:(?P<thread>[0-9]{{1,20}})", "telegram", True, "user"),
        (rf"slack:dm:(?P<chat>{_SLACK_ID})", "slack", False, "user"),
        (rf"slack:channel:(?P<chat>{_SLACK_ID})", "slack", True, "group"),
        (rf"slack:channel:(?P<chat>{_SLACK_ID}):user:(?P<user>{_SLACK_ID})", "slack", True, "user"),
        (rf"slack:channel:(?P<chat>{_SLACK_ID}):thread:(?P<thread>{_SLACK_TS})", "slack", True, "user"),
        (rf"web:(?P<chat>{_WEB_NAME})", "web", False, "user"),
    )
)


@dataclass(frozen=True, slots=True)
class SessionPlace:
    """Where a session key says its session is: enough to rebuild the key and its scope.

    `user_id` is None where the key does not name a person: a shared session, and a Slack
    DM (its key holds the DM's id, not the member's)."""

    key: str
    channel: str
    chat_id: str
    user_id: str | None
    thread_id: str | None
    is_group: bool
    group_scope: GroupScope  # the group_session_scope the key was written under

    def probe(self, user_id: str | None = None) -> Inbound:
        """A message of this session (no text) for the functions above and the bindings."""
        return Inbound(channel=self.channel, chat_id=self.chat_id, user_id=user_id or self.user_id or "",
                       text="", event_id="", thread_id=self.thread_id, is_group=self.is_group)

    def memory_scope(self) -> str | None:
        """The session's memory scope, or None where the key cannot say (a Slack DM)."""
        if self.channel == "slack" and not self.is_group:
            return None
        return memory_scope(self.probe(), self.group_scope)


def parse_session_key(key: str) -> SessionPlace | None:
    """The place a session key names, or None when the key has no known shape.
    `session_key(place.probe(), place.group_scope) == key` for every key it accepts."""
    for pattern, channel, group, mode in _KEY_SHAPES:
        found = pattern.fullmatch(key)
        if found is None:
            continue
        parts = found.groupdict()
        user = parts.get("user")
        chat = parts.get("chat") or user or ""
        return SessionPlace(key=key, channel=channel, chat_id=chat, user_id=user if channel != "web" else chat,
                            thread_id=parts.get("thread"), is_group=group, group_scope=mode)
    return None


@dataclass(frozen=True, slots=True)
class ReplyPlace:
    """A chat (and thread) a reply can be sent to: `<channel>:<chat id>[:<thread>]`."""

    channel: str
    chat_id: str
    thread_id: str | None

    @property
    def is_group(self) -> bool:
        """A group, channel or topic rather than one person's DM (Telegram: negative ids;
        Slack: DM ids start with D)."""
        if self.channel == "telegram":
            return self.chat_id.startswith("-")
        if self.channel == "slack":
            return not self.chat_id.startswith("D")
        return True


_REPLY_SHAPES = {
    "telegram": re.compile(rf"(?P<chat>{_TELEGRAM_ID})(?::(?P<thread>[0-9]{{1,20}}))?"),
    "slack": re.compile(rf"(?P<chat>{_SLACK_ID})(?::(?P<thread>{_SLACK_TS}))?"),
}
_OTHER_REPLY_SHAPE = re.compile(r"(?P<chat>[A-Za-z0-9_.@-]{1,64})(?::(?P<thread>[A-Za-z0-9_.-]{1,64}))?")


def parse_reply_place(text: str) -> ReplyPlace | None:
    """`telegram:-1001234:5` (a topic), `slack:C123:1712.55` (a thread), `telegram:42` …;
    None when it is not one."""
    channel, sep, rest = text.partition(":")
    if not sep or not re.fullmatch(r"[a-z][a-z0-9_]{0,31}", channel):
        return None
    found = _REPLY_SHAPES.get(channel, _OTHER_REPLY_SHAPE).fullmatch(rest)
    if found is None:
        return None
    return ReplyPlace(channel=channel, chat_id=found.group("chat"), thread_id=found.group("thread"))
