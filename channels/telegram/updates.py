"""A Telegram update as the gateway's `Inbound`: who wrote, where (chat, topic), whether the
bot was addressed (mention, reply, command), and the files it carries; and a press of one
of our inline buttons (`callback_query`): who pressed it, where, and its data. Pure, no I/O."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from telegram import Bot, MessageEntity, Update

from channels.telegram.format import sanitize_text, utf16_offsets
from gateway.media import (
    kind_of,
)
from gateway.types import AttachmentKind, Inbound

log = logging.getLogger("channels.telegram")

@dataclass(frozen=True, slots=True)
class BotIdentity:
    """Who we are, from getMe: needed to see mentions, replies and our own messages."""

    id: int
    username: str


@dataclass(frozen=True, slots=True)
class PendingFile:
    """A file of a message still on Telegram's servers."""

    file_id: str
    name: str
    mime: str | None = None
    size: int | None = None  # as Telegram reports it
    kind: AttachmentKind = "file"
    duration_s: float | None = None


@dataclass(frozen=True, slots=True)
class ParsedMessage:
    inbound: Inbound  # text without the file notes; attachments added after download
    file: PendingFile | None = None


@dataclass(frozen=True, slots=True)
class ParsedClick:
    """A press of an inline button: the query to answer, the button's data, and who pressed
    it where (an `Inbound` without text, in the chat and topic of the message it is under)."""

    query_id: str
    data: str | None  # None: no data, or more than Telegram allows
    who: Inbound | None  # None: not under a message of a chat (an inline message)


def parse_callback(raw: Any) -> ParsedClick | None:
    """A `callback_query` update, or None when it has no usable query id or presser (such a
    query cannot be answered or attributed). Never raises."""
    try:
        return _click(raw)
    except Exception as exc:  # hostile or malformed input: drop, never crash
        return _dropped(raw.get("update_id") if isinstance(raw, dict) else None,
                        f"unparsable callback ({type(exc).__name__})")


def _click(raw: Any) -> ParsedClick | None:
    if not isinstance(raw, dict) or not is_int(raw.get("update_id")):
        return None
    query = raw.get("callback_query")
    if not isinstance(query, dict):
        return None
    query_id, person = query.get("id"), query.get("from")
    if not isinstance(query_id, str) or not 0 < len(query_id) <= 128 or not isinstance(person, dict):
        return _dropped(raw["update_id"], "a callback without an id or a presser")
    user_id = person.get("id")
    if not is_int(user_id) or person.get("is_bot") is not False:
        return _dropped(raw["update_id"], "a callback from no person")
    data = query.get("data")
    if not isinstance(data, str) or len(data.encode("utf-8", "surrogatepass")) > 64:
        data = None
    message, who = query.get("message"), None
    chat = message.get("chat") if isinstance(message, dict) else None
    if isinstance(message, dict) and isinstance(chat, dict) and is_int(chat.get("id")) \
            and is_int(message.get("message_id")) and isinstance(chat.get("type"), str):
        chat_type = chat["type"]
        thread = message.get("message_thread_id")
        who = Inbound(
            channel="telegram",
            chat_id=str(chat["id"]),
            user_id=str(user_id),
            text="",
            event_id=f"callback:{raw['update_id']}",
            message_id=str(message["message_id"]),
            thread_id=str(thread) if message.get("is_topic_message") is True and is_int(thread) else None,
            is_group=chat_type != "private",
            user_name=_display_name(person.get("first_name"), person.get("last_name"), person.get("username")),
            extra={"chat_type": chat_type},
        )
    return ParsedClick(query_id, data, who)


def parse_update(raw: Any, me: BotIdentity, bot: Bot | None = None) -> ParsedMessage | None:
    """One Bot API update (decoded JSON) as a normalized message, or None when it is not a
    person's message we answer (logged at debug). Never raises."""
    if not isinstance(raw, dict):
        return _dropped(None, "not a JSON object")
    update_id = raw.get("update_id")
    if not is_int(update_id):
        return _dropped(None, "no update_id")
    message = raw.get("message")
    if not isinstance(message, dict):
        kinds = sorted(str(k) for k in raw if k != "update_id")[:3]
        return _dropped(update_id, f"ignored update kind {kinds}")
    try:
        plain = _plain_text_message(update_id, message, me)
        if plain is not None:
            return plain
        update = Update.de_json(raw, bot)
        return _from_message(update_id, update, me)
    except Exception as exc:  # hostile or malformed input: drop, never crash
        return _dropped(update_id, f"unparsable ({type(exc).__name__}: {exc})")


# The fields of the most common update, a person's text message, read straight from the
# decoded JSON: PTB's Update.de_json (objects for the chat, the sender, dates, entities)
# cost about 5 % of a Telegram turn's CPU under load. Anything else (a reply, a file, a
# caption, an entity with more than its type and place, an unknown field) takes PTB's path.
_PLAIN_MESSAGE = frozenset({"message_id", "date", "chat", "from", "text", "entities", "message_thread_id",
                            "is_topic_message"})
_PLAIN_CHAT = frozenset({"id", "type", "first_name", "last_name", "username", "title", "is_forum"})
_PLAIN_USER = frozenset({"id", "is_bot", "first_name", "last_name", "username", "language_code", "is_premium"})
_PLAIN_ENTITY = frozenset({"type", "offset", "length"})


def _plain_text_message(update_id: int, msg: dict[str, Any], me: BotIdentity) -> ParsedMessage | None:
    """The message as `_from_message` would read it, when it has the plain shape (else
    None: PTB's path decides, drops included)."""
    chat, user, text = msg.get("chat"), msg.get("from"), msg.get("text")
    if not (msg.keys() <= _PLAIN_MESSAGE and isinstance(chat, dict) and chat.keys() <= _PLAIN_CHAT
            and isinstance(user, dict) and user.keys() <= _PLAIN_USER and isinstance(text, str)
            and is_int(msg.get("message_id")) and is_int(msg.get("date")) and is_int(chat.get("id"))
            and isinstance(chat.get("type"), str) and is_int(user.get("id"))
            and isinstance(user.get("first_name"), str) and isinstance(user.get("is_bot"), bool)
            and all(isinstance(chat.get(k, ""), str) for k in ("first_name", "last_name", "username", "title"))
            and all(isinstance(user.get(k, ""), str) for k in ("last_name", "username"))):
        return None
    raw_entities = msg.get("entities", [])
    if not isinstance(raw_entities, list):
        return None
    spans: list[tuple[str, int, int, int | None]] = []
    for ent in raw_entities:
        if not (isinstance(ent, dict) and ent.keys() <= _PLAIN_ENTITY and isinstance(ent.get("type"), str)
                and is_int(ent.get("offset")) and is_int(ent.get("length"))):
            return None
        spans.append((ent["type"], ent["offset"], ent["length"], None))
    chat_type = chat["type"]
    if chat_type not in ("private", "group", "supergroup"):
        return None  # PTB's path drops it with its reason
    if user["is_bot"] is not False:
        return _dropped(update_id, "sent by a bot")
    clean, mentioned, for_other_bot = _address(sanitize_text(text), spans, me)
    if for_other_bot:
        return _dropped(update_id, "a command addressed to another bot")
    thread_id: str | None = None
    if msg.get("is_topic_message") is True and is_int(msg.get("message_thread_id")):
        thread_id = str(msg["message_thread_id"])
    inbound = Inbound(
        channel="telegram",
        chat_id=str(chat["id"]),
        user_id=str(user["id"]),
        text=clean,
        event_id=str(update_id),
        message_id=str(msg["message_id"]),
        thread_id=thread_id,
        is_group=chat_type != "private",
        mentioned=mentioned,
        reply_to_bot=False,
        user_name=_display_name(user.get("first_name"), user.get("last_name"), user.get("username")),
        extra={"chat_type": chat_type},
    )
    return ParsedMessage(inbound, None)


def _from_message(update_id: int, update: Update, me: BotIdentity) -> ParsedMessage | None:
    msg = update.message
    if msg is None:
        return _dropped(update_id, "no message")
    chat = msg.chat
    chat_type = str(chat.type)
    if chat_type not in ("private", "group", "supergroup"):
        return _dropped(update_id, f"chat type {chat_type!r}")
    user = msg.from_user
    if user is None or not is_int(user.id):
        return _dropped(update_id, "no sender")
    if user.is_bot is not False:  # ourselves, other bots, anonymous admins, channel relays
        return _dropped(update_id, "sent by a bot")
    if not is_int(msg.message_id) or not is_int(chat.id):
        return _dropped(update_id, "bad ids")

    text: str | None = msg.text if isinstance(msg.text, str) else None
    entities: Sequence[MessageEntity] = msg.entities or ()
    if text is None:
        text = msg.caption if isinstance(msg.caption, str) else None
        entities = msg.caption_entities or ()
    pending = _pending_file(msg)
    if text is None and pending is None:
        # stickers, polls, locations, service messages (joins, pins, topics …)
        return _dropped(update_id, "no text and no file")

    spans = [(str(e.type), e.offset, e.length, e.user.id if e.user is not None else None)
             for e in entities if isinstance(e, MessageEntity) and is_int(e.offset) and is_int(e.length)]
    clean, mentioned, for_other_bot = _address(sanitize_text(text or ""), spans, me)
    if for_other_bot:
        return _dropped(update_id, "a command addressed to another bot")

    thread_id: str | None = None
    if msg.is_topic_message is True and is_int(msg.message_thread_id):
        thread_id = str(msg.message_thread_id)

    reply_to_bot = False
    parent = msg.reply_to_message
    if parent is not None and parent.from_user is not None and parent.from_user.id == me.id:
        # In a forum topic every message "replies" to the topic's creation message.
        topic_root = parent.forum_topic_created is not None or (
            thread_id is not None and parent.message_id == msg.message_thread_id
        )
        reply_to_bot = not topic_root

    inbound = Inbound(
        channel="telegram",
        chat_id=str(chat.id),
        user_id=str(user.id),
        text=clean,
        event_id=str(update_id),
        message_id=str(msg.message_id),
        thread_id=thread_id,
        is_group=chat_type != "private",
        mentioned=mentioned,
        reply_to_bot=reply_to_bot,
        user_name=_display_name(user.first_name, user.last_name, user.username),
        extra={"chat_type": chat_type},
    )
    return ParsedMessage(inbound, pending)


def _address(text: str, spans: Sequence[tuple[str, int, int, int | None]],
             me: BotIdentity) -> tuple[str, bool, bool]:
    """Find mentions of us among the entities' `spans` (type, UTF-16 offset, length, the
    id of the user a text_mention names); returns (text without "@ourname", mentioned,
    for another bot).

    `/cmd@ourname args` becomes `/cmd args`; `/cmd@otherbot` is someone else's command."""
    if not spans:
        return text.strip(), False, False
    offsets = utf16_offsets(text)
    index = {u: i for i, u in enumerate(offsets)}
    ours = "@" + me.username.lower() if me.username else None
    mentioned = for_other_bot = False
    edits: list[tuple[int, int, str]] = []  # (start, end, replacement) in Python indices
    for kind, offset, length, user_id in spans:
        start, end = index.get(offset), index.get(offset + length)
        if start is None or end is None or end <= start:
            continue
        piece = text[start:end]
        if kind == "mention" and ours is not None and piece.lower() == ours:
            mentioned = True
            edits.append((start, end, ""))
        elif kind == "text_mention" and user_id == me.id:
            mentioned = True
        elif kind == "bot_command" and start == 0 and "@" in piece:
            command, _, target = piece.partition("@")
            if ours is not None and "@" + target.lower() == ours:
                mentioned = True
                edits.append((start, end, command))
            else:
                for_other_bot = True
    for start, end, replacement in sorted(edits, reverse=True):
        before, after = text[:start], text[end:]
        if not replacement and (not before or before[-1].isspace()) and after[:1] == " ":
            after = after[1:]  # "hi @bot there" → "hi there", not "hi  there"
        text = before + replacement + after
    return text.strip(), mentioned, for_other_bot


def _pending_file(msg: Any) -> PendingFile | None:
    """The message's file: the largest size of a photo, a voice note, a video note, an
    audio file or a document. Names are ours where Telegram gives none."""
    mid = msg.message_id
    photos = msg.photo
    if photos:
        best = max(photos, key=_photo_rank)
        if isinstance(best.file_id, str) and best.file_id:
            return PendingFile(best.file_id, f"photo_{mid}.jpg", "image/jpeg", _int_or(best.file_size, None), "image")
    for media, name, default_mime in ((msg.voice, f"voice_{mid}.ogg", "audio/ogg"),
                                      (msg.video_note, f"video_note_{mid}.mp4", "video/mp4")):
        if media is not None and isinstance(media.file_id, str) and media.file_id:
            mime = getattr(media, "mime_type", None)
            return PendingFile(media.file_id, name, mime if isinstance(mime, str) else default_mime,
                               _int_or(media.file_size, None), "voice", _duration(media))
    audio = msg.audio
    if audio is not None and isinstance(audio.file_id, str) and audio.file_id:
        mime = audio.mime_type if isinstance(audio.mime_type, str) else "audio/mpeg"
        name = audio.file_name if isinstance(audio.file_name, str) and audio.file_name else f"audio_{mid}.mp3"
        return PendingFile(audio.file_id, name, mime, _int_or(audio.file_size, None), "audio", _duration(audio))
    doc = msg.document
    if doc is not None and isinstance(doc.file_id, str) and doc.file_id:
        name = doc.file_name if isinstance(doc.file_name, str) and doc.file_name else "document"
        mime = doc.mime_type if isinstance(doc.mime_type, str) else None
        return PendingFile(doc.file_id, name, mime, _int_or(doc.file_size, None), kind_of(mime, name))
    return None


def _duration(media: Any) -> float | None:
    value = getattr(media, "duration", None)
    if is_int(value) and value >= 0:
        return float(value)
    if hasattr(value, "total_seconds"):  # PTB may hand a timedelta
        seconds = float(value.total_seconds())
        return seconds if seconds >= 0 else None
    return None


def _photo_rank(photo: Any) -> tuple[int, int]:
    return _int_or(photo.file_size, 0), _int_or(photo.width, 0) * _int_or(photo.height, 0)


def _display_name(first: Any, last: Any, username: Any) -> str | None:
    parts = [p for p in (first, last) if isinstance(p, str) and p.strip()]
    name = " ".join(parts) or (username if isinstance(username, str) else "")
    name = " ".join(sanitize_text(name).split())[:128]
    return name or None


def _dropped(update_id: Any, reason: str) -> None:
    log.debug("telegram update %s ignored: %s", update_id, reason)
    return None


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_or(value: Any, default: Any) -> Any:
    return value if is_int(value) else default
