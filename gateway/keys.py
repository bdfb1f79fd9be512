"""Session keys and memory scopes (SPEC §1): pure functions of an `Inbound`."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Literal

from gateway.types import Inbound

GroupScope = Literal["user", "group"]

_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


def session_key(inbound: Inbound, group_scope: GroupScope = "user") -> str:
    """`channel:scope` text; keys never collide across channels."""
    ch = inbound.channel
    if ch in ("web", "terminal"):
        return f"{ch}:{inbound.chat_id}"
    if not inbound.is_group:
        return f"{ch}:dm:{inbound.chat_id if ch == 'slack' else inbound.user_id}"
    if ch == "slack":
        # Every Slack conversation in a channel lives in a thread (ours or the person's).
        thread = inbound.thread_id or inbound.message_id
        if thread is None:  # slash commands in a channel: no thread to belong to
            return f"slack:channel:{inbound.chat_id}:user:{inbound.user_id}"
        return f"slack:channel:{inbound.chat_id}:thread:{thread}"
    if inbound.thread_id:
        return f"{ch}:group:{inbound.chat_id}:topic:{inbound.thread_id}"
    if group_scope == "group":
        return f"{ch}:group:{inbound.chat_id}"
    return f"{ch}:group:{inbound.chat_id}:user:{inbound.user_id}"


def memory_scope(inbound: Inbound, group_scope: GroupScope = "user") -> str:
    """Whose long-term memory the session reads and writes."""
    ch = inbound.channel
    if ch in ("web", "terminal"):
        return f"{ch}:{inbound.chat_id}"
    if not inbound.is_group:
        return f"{ch}:user:{inbound.user_id}"
    if group_scope == "group":
        return f"{ch}:group:{inbound.chat_id}"
    return f"{ch}:group:{inbound.chat_id}:user:{inbound.user_id}"


def scope_dirname(scope: str) -> str:
    """A filesystem-safe, collision-free directory name for a scope."""
    readable = _SAFE.sub("_", scope)[:80]
    digest = hashlib.sha256(scope.encode()).hexdigest()[:10]
    return f"{readable}-{digest}"


def workspace_dir(data_dir: Path, scope: str) -> Path:
    return data_dir / "scopes" / scope_dirname(scope)
