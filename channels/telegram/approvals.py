"""An approval card as Telegram shows it (SPEC §5.7). Pure, no I/O.

The card is one message: a bold title, the tool, its whole arguments and, under it, an
inline keyboard with Allow and Deny. The arguments are never cut nor folded (no
expandable blockquote: a person would see a few lines and allow the rest unread): they
are one `pre` block, or, when they do not fit Telegram's 4,096 UTF-16 units, a file sent
just before the card, which then names the file. The workspace files the command names
follow, each a heading and a `pre` block; when they do not fit on the card they go as
messages of their own just before it. Everything is `visible()` already (the card made
it so): an escape sequence or a bidi control reads as `\x1b` or `\u202e`. Each button
carries `ap:<id>:a` or `ap:<id>:d` (at most 64 bytes, Telegram's limit), so a click is
answered from the data alone, also after a restart.

Once decided the card is edited: the last line gives the outcome and the keyboard is gone.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any

from telegram import InlineKeyboardButton, InlineKeyboardMarkup

from channels.base import ApprovalCard, CardFile
from channels.telegram.format import TELEGRAM_TEXT_LIMIT, utf16_len

CALLBACK_DATA_LIMIT = 64  # bytes of a button's callback_data
# Room kept for the card's last line: who may answer, and later the outcome in its place.
FOOTER_RESERVE = 512
_CALLBACK = re.compile(r"ap:([a-z0-9]{1,32}):([ad])")


@dataclass(frozen=True, slots=True)
class CardMessage:
    text: str
    entities: tuple[dict[str, Any], ...]
    document: tuple[str, bytes] | None = None  # (file name, bytes) sent before the card
    before: tuple[CardMessage, ...] = ()  # the named workspace files that did not fit: sent first


def callback_data(approval_id: str, allow: bool) -> str:
    return f"ap:{approval_id}:{'a' if allow else 'd'}"


def parse_callback_data(data: Any) -> tuple[str, bool] | None:
    """(approval id, allow) of one of our buttons, or None for anything else."""
    if not isinstance(data, str) or len(data) > CALLBACK_DATA_LIMIT:
        return None
    match = _CALLBACK.fullmatch(data)
    if match is None:
        return None
    return match.group(1), match.group(2) == "a"


def keyboard(card: ApprovalCard) -> InlineKeyboardMarkup:
    return InlineKeyboardMarkup([[
        InlineKeyboardButton("Allow", callback_data=callback_data(card.id, True)),
        InlineKeyboardButton("Deny", callback_data=callback_data(card.id, False)),
    ]])


def file_name(card: ApprovalCard) -> str:
    """The name the arguments go under when they are sent as a file: a command as a shell
    script, JSON as JSON."""
    try:
        json.loads(card.arguments)
        return f"approval-{card.id}.json"
    except ValueError:
        return f"approval-{card.id}.{'sh' if card.tool == 'exec' else 'txt'}"


class _Text:
    """Text and its entities, offsets in UTF-16 units as Telegram counts them."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.length = 0
        self.entities: list[dict[str, Any]] = []

    def add(self, piece: str, kind: str | None = None, **extra: Any) -> None:
        units = utf16_len(piece)
        if kind is not None and units > 0:
            self.entities.append({"type": kind, "offset": self.length, "length": units, **extra})
        self.parts.append(piece)
        self.length += units

    def message(self, document: tuple[str, bytes] | None = None) -> CardMessage:
        return CardMessage("".join(self.parts), tuple(self.entities), document)


def render_card(card: ApprovalCard, outcome: str | None = None) -> CardMessage:
    """The card as first shown (`outcome` None: who may answer on the last line), or as
    it reads once decided (the outcome in that line's place). The same card always takes
    the same form, so a decided card keeps the layout people saw."""
    arguments = card.arguments if card.arguments.strip() else "(no arguments)"
    out = _Text()
    out.add(f"Approval needed ({card.id})", "bold")
    out.add("\nThe assistant wants to run ")
    out.add(card.tool, "code")
    document: tuple[str, bytes] | None = None
    if out.length + utf16_len(arguments) + FOOTER_RESERVE <= TELEGRAM_TEXT_LIMIT:
        out.add(" with:\n")
        out.add(arguments, "pre", **({"language": "sh"} if card.tool == "exec" else {}))
    else:
        name = file_name(card)
        out.add(f". Its arguments ({len(arguments):,} characters) are in the file ")
        out.add(name, "code")
        out.add(", sent with this card.")
        if outcome is None:
            document = (name, arguments.encode("utf-8", "backslashreplace"))
    before: tuple[CardMessage, ...] = ()
    if card.files:
        inline = _Text()
        _add_files(inline, card.files)
        if out.length + inline.length + FOOTER_RESERVE <= TELEGRAM_TEXT_LIMIT:
            out.add("\n\nThe command names these workspace files:")
            _add_files(out, card.files)
        else:
            out.add("\n\nThe workspace files the command names are shown just above: "
                    + ", ".join(f.name for f in card.files)[:FOOTER_RESERVE] + ".")
            before = tuple(_file_message(f) for f in card.files)
    out.add("\n\n")
    if outcome is None:
        out.add(f"{card.who.capitalize() or 'An approver'} can answer with the buttons below, or with "
                f"/allow {card.id} or /deny {card.id}. No answer in {card.timeout_s:g} s is a deny.")
    else:
        out.add(outcome[:FOOTER_RESERVE - 16], "bold")
    return dataclasses.replace(out.message(document), before=before if outcome is None else ())


def _add_files(out: _Text, files: tuple[CardFile, ...]) -> None:
    for file in files:
        out.add("\n")
        out.add(file.heading(), "italic")
        if file.text:
            out.add("\n")
            out.add(file.text, "pre")


def _file_message(file: CardFile) -> CardMessage:
    """One named file as a message of its own, before the card."""
    out = _Text()
    out.add("A workspace file the command on the next card names:")
    shown = file if file.text is None or utf16_len(file.heading() + file.text) + 100 <= TELEGRAM_TEXT_LIMIT \
        else dataclasses.replace(file, text=None, note="too long for a message")
    _add_files(out, (shown,))
    return out.message()
