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
