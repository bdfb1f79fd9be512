"""The contract between a platform adapter and the gateway.

An adapter turns platform events into `Inbound` and hands each to `InboundHandler`
(the router: dedup, access, commands, queue). The router answers through `send()`.
Adapters know the platform and nothing about the model.

`Channel` is what every channel does; what only some can (stream a reply, show an
approval card's buttons, send files, write to a person's DM, receive on one gateway of a
cluster, take webhooks) is a protocol of its own, which a channel implements by having its
methods. The gateway looks once, when it adds a channel, at which ones it implements.
"""

from __future__ import annotations

import time
import unicodedata
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from aiohttp import web

from gateway.types import Inbound

# Returns once the event is durably recorded (dedup) and accepted or refused; the
# adapter may acknowledge the platform event after it returns. The result is False for
# an event seen before (nothing more will happen for it), True or None otherwise.
InboundHandler = Callable[[Inbound], Awaitable[bool | None]]
# Whether the router would serve this message (no side effects): files are fetched only then.
AccessCheck = Callable[[Inbound], Awaitable[bool]]


@runtime_checkable
class Channel(Protocol):
    name: str

    async def start(self) -> None:
        """Connect and begin delivering inbound events. Returns once running."""

    async def stop(self) -> None:
        """Stop intake and close connections; idempotent; bounded by a timeout."""

    def is_ready(self) -> bool:
        """True while connected and receiving (for /readyz)."""

    async def send(self, inbound: Inbound, text: str) -> None:
        """Deliver a reply (Markdown) to where `inbound` came from, chunked and formatted
        for the platform; falls back to plain text when formatting is rejected."""

    def typing(self, inbound: Inbound) -> AbstractAsyncContextManager[None]:
        """Show a typing indicator while the body runs."""


# Called by a stream with an opaque reference to the platform message(s) it has shown
# (e.g. Telegram chat id + message ids, Slack channel + ts), so the gateway can persist it
# with the turn's event: after a crash mid-stream the resumed turn edits what the person
# already sees instead of posting the reply a second time (SPEC §5.1).
ReplyRefSink = Callable[[str], Awaitable[None]]


# Told of each noteworthy thing a stream does, by name: "reply" (a streamed reply
# started), "edit" (a platform message updated), "draft" (a draft updated), "rate_limited"
# (the platform said to wait), "plain_fallback" (formatting refused, sent as plain text),
# "update_fallback" (native streaming or drafts refused, edits used instead), "continued"
# (a new message past the size limit). The gateway counts them in /metrics
# (gateway_stream_events_total).
StreamObserver = Callable[[str], None]


@runtime_checkable
class ReplyStream(Protocol):
    """One reply as it grows, shown live on the platform (SPEC §5.1).

    The agent calls, in this order: any number of `append` / `status`, then exactly one
    of `finish` or `fail`. What the person sees at the end equals the text given to
    `finish` (or `fail`), exactly once, whatever was shown before.
    - `append(delta)`: new answer text (Markdown, arriving in pieces). The stream decides
      how often the platform is updated (at most once per `stream_interval_s`).
    - `status(line)`: a short line such as "reading notes.md…" while tools run; it
      replaces everything shown so far in this reply (text a step produced before it
      called tools is not part of the final answer).
    - `finish(text)`: the whole final reply; the stream renders formatting now and
      makes the visible text equal `text` (editing, continuing in new messages past the
      platform's size limit, or falling back to plain text).
    - `fail(text)`: the turn ended with an error message; shown like `finish`.
    Every method is bounded in time; platform errors are handled inside the stream (a
    stream that cannot edit any more falls back to sending the rest as new messages) and
    never raise into the agent, except `finish`/`fail`, which raise when the reply could
    not be delivered at all (so the turn is marked undelivered).
    """

    async def append(self, delta: str) -> None: ...

    async def status(self, line: str) -> None: ...

    async def finish(self, text: str) -> None: ...

    async def fail(self, text: str) -> None: ...


@runtime_checkable
class StreamingChannel(Protocol):
    """A channel that can show a reply as it grows. `stream()` returns None when streaming
    is off for this channel (config) or this conversation (the platform cannot show it);
    the gateway then sends the whole reply with `send()` at the end.

    `resume_ref` is the reference a stream of the same turn reported through `on_ref`
    before a crash; the new stream edits those messages instead of posting new ones."""

    def stream(self, inbound: Inbound, *, on_ref: ReplyRefSink | None = None,
               resume_ref: str | None = None) -> ReplyStream | None: ...


class OutboundFile(Protocol):
    """A file a reply sends along (gateway/media.py's ReplyFile): its name, its size when
    the reply named it (what a channel checks against the platform's limit), whether it is
    an image, and its bytes (blocking: read it in a worker thread)."""

    @property
    def name(self) -> str: ...

    @property
    def size(self) -> int: ...

    @property
    def is_image(self) -> bool: ...

    def read_bytes(self) -> bytes: ...


@runtime_checkable
class FileChannel(Protocol):
    """A channel that can send the files a reply names after its text (SPEC §5.2)."""

    async def send_files(self, inbound: Inbound, files: Sequence[OutboundFile]) -> None: ...


@runtime_checkable
class DirectChannel(Protocol):
    """A channel that can write to a person by their user id alone, in their DM (a pairing
    approved, a config change refused): the platform knows how a DM is addressed."""

    async def send_direct(self, user_id: str, text: str) -> None: ...


def direct_inbound(channel: str, user_id: str) -> Inbound:
    """Where a DM to `user_id` goes, as an `Inbound` a channel's `send` answers: a private
    chat addressed by the person's id (the chat id of a DM is the user id in Telegram; Slack
    and Discord open the DM for a user id)."""
    return Inbound(channel=channel, chat_id=user_id, user_id=user_id, text="", event_id=f"notice-{time.time()}")


@runtime_checkable
class ExclusiveReceiver(Protocol):
    """A channel whose receiving side can run apart from its sending side, so that where
    the platform allows one receiver only (Telegram polling, Slack Socket Mode, the Discord
    gateway) it receives on one gateway of a cluster at a time (SPEC §10) while every
    gateway sends. `exclusive_receiver` says whether its settings need that now."""

    @property
    def exclusive_receiver(self) -> bool: ...

    async def start_sending(self) -> None:
        """What replies need (sign in, connect), on every gateway."""

    async def start_receiving(self) -> None:
        """Begin receiving: this gateway holds the lead."""

    async def stop_receiving(self, *, lost: bool = False) -> None:
        """Stop receiving; `lost`: the lead went elsewhere (another gateway may receive already)."""


@runtime_checkable
class WebhookChannel(Protocol):
    """A channel that receives platform events over the gateway's HTTP server
    (Telegram webhook, Slack HTTP events). The route is registered once by
    gateway/http/server.py and dispatches to whichever instance is running now, so a channel
    can be restarted alone on a config change."""

    webhook_path: str  # e.g. "/telegram/webhook", "/slack/events"

    async def handle_webhook(self, request: web.Request) -> web.StreamResponse: ...


# Characters that draw nothing, or move, erase or reorder what is drawn, whatever their
# Unicode category says: variation selectors, the grapheme joiner, Hangul and Khmer
# fillers, Mongolian selectors, the blank Braille pattern.
_INVISIBLE = frozenset([0x034F, 0x115F, 0x1160, 0x17B4, 0x17B5, 0x180B, 0x180C, 0x180D, 0x180F, 0x2800,
                        0x3164, 0xFFA0, *range(0xFE00, 0xFE10), *range(0xE0100, 0xE01F0)])
# Categories shown escaped: controls (C0, DEL, C1), format characters (bidi controls,
# zero-width characters, the soft hyphen, tags), line and paragraph separators,
# surrogates, private use and unassigned code points, and spaces other than U+0020.
_ESCAPED_CATEGORIES = frozenset(["Cc", "Cf", "Zl", "Zp", "Zs", "Cs", "Co", "Cn"])
_NAMED = {"\r": "\\r", "\t": "\\t"}
MAX_MARKS = 2  # combining marks kept on one character; past that a stack could draw over lines


def visible(text: str) -> str:
    """`text` as an approval card shows it (SPEC §5.7): every character that could hide,
    move, erase or reorder what a person reads is written as a visible escape (`\\r`,
    `\\t`, `\\x1b`, `\\u202e`, `\\U000e0041`); line breaks stay line breaks. So
    `rm MEMORY.md\\r\\x1b[2Kls -la` reads as that, never as `ls -la`. A backslash is
    kept as it is: text that merely looks like an escape only ever looks more alarming
    than it is. Idempotent: what it returns contains nothing it would escape."""
    if text.isascii() and text.replace("\n", "").isprintable():
        return text  # the common case: a plain command
    out: list[str] = []
    marks = 0  # combining marks kept on the character before
    base = False  # whether the last character kept can carry a combining mark
    for ch in text:
        code = ord(ch)
        category = unicodedata.category(ch)
        mark = category in ("Mn", "Me")
        if ch in "\n " or not (mark or category in _ESCAPED_CATEGORIES or code in _INVISIBLE):
            out.append(ch)
            marks, base = 0, ch not in "\n "
        elif mark and category == "Mn" and code not in _INVISIBLE and base and marks < MAX_MARKS:
            out.append(ch)
            marks += 1
        else:
            out.append(_NAMED.get(ch) or (f"\\x{code:02x}" if code <= 0xFF else
                                         f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"))
            marks, base = 0, False
    return "".join(out)


@dataclass(frozen=True, slots=True)
class CardFile:
    """A file in the session's workspace that the command on a card names (SPEC §5.7:
    `sh memory/<day>.md` shows the script it runs): its workspace-relative name, its
    size, and its text when it is short text; else `note` says why it is only named."""

    name: str
    size: int
    text: str | None = None
    note: str = ""  # "too long to show", "not text", "a symbolic link to x, not followed here"

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", visible(self.name))
        object.__setattr__(self, "note", visible(self.note))
        if self.text is not None:
            object.__setattr__(self, "text", visible(self.text))

    def heading(self) -> str:
        """One line naming the file, and saying why its text is not shown when it is not."""
        size = f"{self.size:,} byte{'' if self.size == 1 else 's'}"
        if self.text is not None:
            return f"{self.name} ({size}):"
        return f"{self.name} ({size}; {self.note or 'not shown'}: read it before you allow)"


@dataclass(frozen=True, slots=True)
class ApprovalCard:
    """A tool call waiting for a person's yes (SPEC §5.7), as a channel shows it: the tool
    and its whole arguments (never cut or folded: a channel that cannot show them in one
    message sends them as a file), the workspace files the call names, and Allow and Deny.
    Every text on it is `visible()`: made so at construction, whoever builds the card."""

    id: str  # what `/allow ID` and `/deny ID` name, and the buttons carry
    tool: str
    arguments: str  # the whole arguments, pretty-printed JSON (a command as it will run)
    who: str  # who may answer, in words ("an admin", "anyone here")
    timeout_s: float
    files: tuple[CardFile, ...] = ()  # workspace files the arguments name (exec's command)

    def __post_init__(self) -> None:
        for name in ("tool", "arguments", "who"):
            object.__setattr__(self, name, visible(getattr(self, name)))

    def files_text(self) -> str:
        """The files the call names, as plain text ("" when none): each heading, then its text."""
        if not self.files:
            return ""
        parts = ["The command names these workspace files:"]
        for file in self.files:
            parts.append(f"- {file.heading()}" + (f"\n{file.text}" if file.text is not None else ""))
        return "\n".join(parts) + "\n"

    def text(self) -> str:
        """The card as plain text (channels without buttons, logs)."""
        return (f"Approval needed ({self.id}): the assistant wants to run {self.tool} with:\n{self.arguments}\n"
                f"{self.files_text()}"
                f"{self.who.capitalize()} can answer /allow {self.id} or /deny {self.id} "
                f"(no answer in {self.timeout_s:g} s is a deny).")


@runtime_checkable
class ApprovalChannel(Protocol):
    """A channel that shows Allow/Deny on a card (buttons, or y/n in the terminal) and
    reports a click through `ChannelHooks.decide`. Others get the card as text and people
    answer with /allow ID or /deny ID."""

    async def ask_approval(self, inbound: Inbound, card: ApprovalCard) -> str | None:
        """Show the card where `inbound` came from; an opaque reference to it (or None)."""

    async def settle_approval(self, inbound: Inbound, card: ApprovalCard, ref: str | None, outcome: str) -> None:
        """The card is decided: disable its buttons and show `outcome` in their place."""


# A click on a card's button: (approval id, who clicked (channel, chat, user as an
# Inbound), allow?) → a short notice for the clicker ("Allowed.", "Only admins can answer this.").
Decide = Callable[[str, Inbound, bool], Awaitable[str]]


@dataclass(frozen=True, slots=True)
class ChannelHooks:
    """What the gateway hands a messaging platform's channel when it builds one (each
    package under channels/ has `from_config(section, hooks)`): where inbound messages go,
    and the running settings it reads per use, so a reload applies without a restart."""

    handle: InboundHandler
    admits: AccessCheck
    workspace_for: Callable[[Inbound], Path]  # where a person's files go (no mkdir: the caller makes it off the loop)
    file_limit: Callable[[], int]  # bytes: `limits.max_inbound_file_mb` now
    stream_interval: Callable[[], float]  # `stream_interval_s` now
    observe: StreamObserver  # counts this channel's stream events
    commands: Sequence[tuple[str, str]] = ()  # the command menu a platform shows (name, description)
    decide: Decide | None = None  # a click on an approval card's Allow or Deny (SPEC §5.7)
