"""A Discord message as the gateway's `Inbound`: who wrote, where (a DM, a guild channel, a
thread in one), whether the bot was addressed (a mention of it or of its role, a reply to
one of its messages), and the files it carries. Pure, no I/O: where a message was
written is resolved by the adapter first (`Place`), since a thread discord.py has not
seen yet takes a REST call to learn its parent.

Only a person's new message is a turn: the bot's own and other bots' messages, webhooks,
system messages (joins, pins, thread notices) and edits (never passed here) are not.

A press of an approval card's button (an INTERACTION_CREATE of a message component) is
read by `parse_click`: who pressed it, in the conversation the card is in.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, Literal

import discord

from channels.discord.approvals import parse_custom_id
from channels.discord.format import clean_text
from gateway.media import kind_of
from gateway.types import AttachmentKind, Inbound

log = logging.getLogger("channels.discord")

MAX_FILES = 10  # Discord's own limit per message
ANSWERED_TYPES = frozenset({discord.MessageType.default, discord.MessageType.reply})
THREAD_TYPES = frozenset({10, 11, 12})  # announcement, public and private threads
DM_TYPES = frozenset({1})

_USER_MENTION = re.compile(r"<@!?(\d{1,20})>")
_ROLE_MENTION = re.compile(r"<@&(\d{1,20})>")
_CHANNEL_MENTION = re.compile(r"<#(\d{1,20})>")
_CUSTOM_EMOJI = re.compile(r"<a?:(\w{1,32}):\d{1,20}>")


@dataclass(frozen=True, slots=True)
class BotIdentity:
    """Who we are (`GET /users/@me`): needed to see mentions, replies and our own messages."""

    id: int
    name: str


@dataclass(frozen=True, slots=True)
class Place:
    """Where a message was written: `channel_id` is the message's own channel (a DM
    channel, a guild channel or a thread); `parent_id` is a thread's channel."""

    kind: Literal["dm", "channel", "thread"]
    channel_id: int
    parent_id: int | None = None


def place_of_channel(channel: Any) -> Place | None:
    """The place of a channel discord.py knows; None when it does not know its kind (a
    thread created before the bot connected): `place_of_payload` of `GET /channels/{id}`."""
    if isinstance(channel, discord.DMChannel):
        return Place("dm", channel.id)
    if isinstance(channel, discord.Thread):
        return Place("thread", channel.id, channel.parent_id)
    if isinstance(channel, discord.abc.GuildChannel):
        return Place("channel", channel.id)
    return None


def place_of_payload(data: Any) -> Place | None:
    """The place of a channel as the REST API describes it, or None when it is unusable."""
    if not isinstance(data, dict):
        return None
    channel_id, kind, parent = _snowflake(data.get("id")), data.get("type"), _snowflake(data.get("parent_id"))
    if channel_id is None or not isinstance(kind, int):
        return None
    if kind in DM_TYPES:
        return Place("dm", channel_id)
    if kind in THREAD_TYPES:
        return Place("thread", channel_id, parent) if parent is not None else None
    return Place("channel", channel_id)


@dataclass(frozen=True, slots=True)
class PendingFile:
    """A file of a message still on Discord's CDN."""

    id: int
    name: str
    url: str
    mime: str | None
    size: int  # as Discord reports it
    kind: AttachmentKind
    duration_s: float | None = None


@dataclass(frozen=True, slots=True)
class ParsedMessage:
    inbound: Inbound  # attachments are added after the download
    files: tuple[PendingFile, ...] = ()


def parse_message(message: discord.Message, me: BotIdentity, place: Place) -> ParsedMessage | None:
    """A person's new message as a normalized one, or None when it is not a turn (logged at
    debug). Never raises."""
    try:
        return _parse(message, me, place)
    except Exception as exc:  # hostile or malformed input: drop, never crash
        return _dropped(getattr(message, "id", None), f"unparsable ({type(exc).__name__}: {exc})")


def _parse(message: discord.Message, me: BotIdentity, place: Place) -> ParsedMessage | None:
    author = message.author
    if author.bot or author.system or author.id == me.id or message.webhook_id is not None:
        return _dropped(message.id, "sent by a bot, a webhook or the system")
    if message.type not in ANSWERED_TYPES:
        return _dropped(message.id, f"message type {message.type}")
    text, mentioned = readable_text(message, me)
    files = pending_files(message)
    if not text and not files:
        return _dropped(message.id, "no text and no file")  # stickers, polls, embeds only
    resolved = message.reference.resolved if message.reference is not None else None
    reply_to_bot = isinstance(resolved, discord.Message) and resolved.author.id == me.id
    user_id = str(author.id)
    extra: dict[str, Any] = {"channel_id": str(place.channel_id)}
    if message.guild is not None:
        extra["guild_id"] = str(message.guild.id)
    if place.kind == "dm":
        chat_id, thread_id = user_id, None  # a DM's chat is the person, as in Telegram
    elif place.kind == "thread" and place.parent_id is not None:
        chat_id, thread_id = str(place.parent_id), str(place.channel_id)
    else:
        chat_id, thread_id = str(place.channel_id), None
    inbound = Inbound(
        channel="discord",
        chat_id=chat_id,
        user_id=user_id,
        text=text,
        event_id=str(message.id),  # a redelivered message (a RESUME replays) is the same event
        message_id=str(message.id),
        thread_id=thread_id,
        is_group=place.kind != "dm",
        mentioned=mentioned,
        reply_to_bot=reply_to_bot,
        user_name=_display_name(author),
        extra=extra,
    )
    return ParsedMessage(inbound, files)


@dataclass(frozen=True, slots=True)
class ParsedClick:
    approval_id: str
    allow: bool
    who: Inbound  # the presser, in the card's conversation, without text


def parse_click(interaction: discord.Interaction, place: Place) -> ParsedClick | None:
    """A press of Allow or Deny on an approval card, or None for any other interaction
    (logged at debug). Never raises."""
    try:
        data = interaction.data if isinstance(interaction.data, dict) else {}
        wanted = parse_custom_id(data.get("custom_id"))
        user = interaction.user
        if interaction.type != discord.InteractionType.component or wanted is None:
            return _dropped(interaction.id, "not a press of an approval card's button")
        if user is None or getattr(user, "bot", True):
            return _dropped(interaction.id, "pressed by no person")
    except Exception as exc:  # hostile or malformed input: drop, never crash
        return _dropped(getattr(interaction, "id", None), f"unparsable interaction ({type(exc).__name__})")
    user_id = str(user.id)
    if place.kind == "dm":
        chat_id, thread_id = user_id, None  # as for messages: a DM's chat is the person
    elif place.kind == "thread" and place.parent_id is not None:
        chat_id, thread_id = str(place.parent_id), str(place.channel_id)
    else:
        chat_id, thread_id = str(place.channel_id), None
    message = interaction.message
    who = Inbound(
        channel="discord",
        chat_id=chat_id,
        user_id=user_id,
        text="",
        event_id=f"interaction:{interaction.id}",
        message_id=str(message.id) if message is not None else None,
        thread_id=thread_id,
        is_group=place.kind != "dm",
        user_name=_display_name(user),
        extra={"channel_id": str(place.channel_id)},
    )
    return ParsedClick(wanted[0], wanted[1], who)


def readable_text(message: discord.Message, me: BotIdentity) -> tuple[str, bool]:
    """The text the agent reads, and whether the bot was mentioned (by name or by its own
    role). The bot's mentions are removed, so "@bot /help" is the command `/help`; other
    mentions and custom emoji read as names."""
    text = clean_text(message.content)
    our_roles = {str(role.id) for role in message.role_mentions
                 if role.tags is not None and role.tags.bot_id == me.id}
    mentioned = False

    def drop_ours(match: re.Match[str]) -> str:
        nonlocal mentioned
        mentioned = True
        return " "

    text = re.sub(rf"\s*<@!?{me.id}>\s*", drop_ours, text)
    if our_roles:
        text = re.sub(r"\s*<@&(?:" + "|".join(our_roles) + r")>\s*", drop_ours, text)
    users = {str(user.id): user for user in message.mentions}
    roles = {str(role.id): role.name for role in message.role_mentions}
    channels = {str(channel.id): getattr(channel, "name", None) for channel in message.channel_mentions}
    text = _USER_MENTION.sub(lambda m: "@" + (_display_name(users[m.group(1)]) or m.group(1))
                             if m.group(1) in users else m.group(0), text)
    text = _ROLE_MENTION.sub(lambda m: "@" + roles[m.group(1)] if m.group(1) in roles else m.group(0), text)
    text = _CHANNEL_MENTION.sub(lambda m: "#" + str(channels[m.group(1)]) if channels.get(m.group(1))
                                else m.group(0), text)
    text = _CUSTOM_EMOJI.sub(r":\1:", text)
    return text.strip(), mentioned


def pending_files(message: discord.Message) -> tuple[PendingFile, ...]:
    """The message's attachments (at most MAX_FILES): images, voice messages, audio, files."""
    voice_message = message.flags.voice
    found: list[PendingFile] = []
    for attachment in message.attachments[:MAX_FILES]:
        url = attachment.url
        if not isinstance(url, str) or not url.startswith(("https://", "http://")):
            continue
        mime = attachment.content_type.split(";")[0].strip() if attachment.content_type else None
        name = attachment.filename or f"file_{attachment.id}"
        voice = voice_message or attachment.is_voice_message()
        kind: AttachmentKind = "voice" if voice else kind_of(mime, name)
        duration = attachment.duration if isinstance(attachment.duration, int | float) else None
        found.append(PendingFile(attachment.id, name, url, mime, max(int(attachment.size or 0), 0), kind,
                                 float(duration) if duration is not None and duration >= 0 else None))
    return tuple(found)


def _display_name(user: Any) -> str | None:
    name = getattr(user, "display_name", None)
    if not isinstance(name, str):
        return None
    name = " ".join(clean_text(name).split())[:128]
    return name or None


def _snowflake(value: Any) -> int | None:
    if isinstance(value, str) and value.isdigit() and len(value) <= 20:
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def _dropped(message_id: Any, reason: str) -> None:
    log.debug("discord message %s ignored: %s", message_id, reason)
    return None
