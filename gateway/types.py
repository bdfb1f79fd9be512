"""The shared vocabulary: every layer speaks in these types (SPEC §1, §3)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["system", "user", "assistant", "tool"]
HOOK_ORIGIN_PREFIX = "hook:"  # Message.origin / Inbound.origin of an inbound webhook's turn
AttachmentKind = Literal["image", "voice", "audio", "file"]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One tool call the model asked for; `arguments` is the raw JSON text."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class Truncation:
    """Out-of-band state of a cut text (SPEC §4.1). Never parsed back out of content.

    `path` is workspace-relative: `tool_results/<id>.txt` for saved tool output, or the
    file itself for `read_file`. Offsets are character offsets into the full text.
    """

    path: str
    total_chars: int
    total_lines: int
    total_bytes: int
    shown: tuple[tuple[int, int], ...]  # [start, end) character ranges kept in content
    saved: bool  # True when the full text was saved by us (tool_results/)
    protected: bool = False  # Markdown read with read_file: doubled limits
    start_offset: int = 0  # char offset in the file where the full text begins
    start_line: int = 1  # line number in the file where the full text begins
    # The end of the full text when stage 1 cut it off (not in content): a later cut
    # (stage 2, the budget) shows the head and this real end, not the excerpt's end.
    tail: str = ""


@dataclass(frozen=True, slots=True)
class Message:
    """One stored message of a session. `turn` groups it with its turn (SPEC §1)."""

    role: Role
    content: str
    turn: int = 0
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    tool_name: str | None = None
    truncation: Truncation | None = None
    injected: bool = False  # text the gateway added: never a user turn
    # Who wrote a user message when no person did: "task" for a scheduled task's prompt
    # (SPEC §5.3), "hook:<name>" for an inbound webhook's (§5.9). It starts a turn like a
    # person's message; None for everything else.
    origin: str | None = None
    id: int | None = None  # database row id; gives the order
    created_at: float = field(default_factory=time.time)
    attachments: tuple[Attachment, ...] = ()  # files the person sent with a user message


@dataclass(frozen=True, slots=True)
class Attachment:
    """A file a person sent (SPEC §5.4), saved in the scope's workspace under `files/`.

    Channels fill in what the platform says (kind, name, mime, size, duration); the shell
    adds what it learns from the file (an image's size, the copy the model is shown). Stored
    with the user message as metadata: never the bytes."""

    name: str
    path: str  # workspace-relative; "" when the file was not saved (see `error`)
    mime: str | None = None
    size: int = 0
    kind: AttachmentKind = "file"
    duration_s: float | None = None  # voice and audio, as the platform reports it
    width: int | None = None  # images: of `preview`, the copy the model is shown
    height: int | None = None
    preview: str | None = None  # images: workspace-relative path of that copy
    error: str | None = None  # why the file was not saved (too large, download failed)

    @property
    def is_image(self) -> bool:
        """An image the model can be shown: saved, measured, with its copy."""
        return self.kind == "image" and bool(self.preview) and bool(self.width) and bool(self.height)


def attachment_to_dict(att: Attachment) -> dict[str, Any]:
    """The attachment as plain JSON data, without the fields left at their defaults."""
    out: dict[str, Any] = {"name": att.name, "path": att.path}
    for name in ("mime", "size", "kind", "duration_s", "width", "height", "preview", "error"):
        value = getattr(att, name)
        if value is not None and value != Attachment.__dataclass_fields__[name].default:
            out[name] = value
    return out


def attachment_from_dict(data: dict[str, Any]) -> Attachment:
    known = {k: v for k, v in data.items() if k in Attachment.__dataclass_fields__}
    return Attachment(**known)


@dataclass(frozen=True, slots=True)
class Inbound:
    """A platform message normalized by a channel adapter (SPEC §3)."""

    channel: str  # telegram | slack | web | terminal
    chat_id: str
    user_id: str
    text: str
    event_id: str  # platform event id, the dedup key with `channel`
    message_id: str | None = None
    thread_id: str | None = None  # Telegram forum topic id, Slack thread_ts
    is_group: bool = False
    mentioned: bool = False
    reply_to_bot: bool = False
    user_name: str | None = None
    attachments: tuple[Attachment, ...] = ()
    received_at: float = field(default_factory=time.time)
    extra: dict[str, Any] = field(default_factory=dict)  # adapter-private routing data
    # Made by the gateway, not sent by a person: "task" for a scheduled task, "hook:<name>"
    # for an inbound webhook (SPEC §5.9).
    origin: str | None = None

    @property
    def identity(self) -> str:
        """`<channel>:<user id>`, as written in `admins` and `access.allow_from`; a hook's
        turn is its hook's (`hook:<name>`), whatever channel it answers in: no person of
        that channel wrote it."""
        if self.origin is not None and self.origin.startswith(HOOK_ORIGIN_PREFIX):
            return self.origin
        return f"{self.channel}:{self.user_id}"


def inbound_to_dict(inbound: Inbound) -> dict[str, Any]:
    return {
        "channel": inbound.channel,
        "chat_id": inbound.chat_id,
        "user_id": inbound.user_id,
        "text": inbound.text,
        "event_id": inbound.event_id,
        "message_id": inbound.message_id,
        "thread_id": inbound.thread_id,
        "is_group": inbound.is_group,
        "mentioned": inbound.mentioned,
        "reply_to_bot": inbound.reply_to_bot,
        "user_name": inbound.user_name,
        "attachments": [attachment_to_dict(a) for a in inbound.attachments],
        "received_at": inbound.received_at,
        "extra": inbound.extra,
        "origin": inbound.origin,
    }


def inbound_from_dict(data: dict[str, Any]) -> Inbound:
    return Inbound(
        channel=str(data["channel"]),
        chat_id=str(data["chat_id"]),
        user_id=str(data["user_id"]),
        text=str(data.get("text", "")),
        event_id=str(data["event_id"]),
        message_id=data.get("message_id"),
        thread_id=data.get("thread_id"),
        is_group=bool(data.get("is_group", False)),
        mentioned=bool(data.get("mentioned", False)),
        reply_to_bot=bool(data.get("reply_to_bot", False)),
        user_name=data.get("user_name"),
        attachments=tuple(attachment_from_dict(a) for a in data.get("attachments", [])),
        received_at=float(data.get("received_at", time.time())),
        extra=dict(data.get("extra", {})),
        origin=data.get("origin"),
    )
