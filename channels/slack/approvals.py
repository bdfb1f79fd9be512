"""An approval card as Slack shows it (SPEC §5.7): Block Kit. Pure, no I/O.

A section names the tool; the whole arguments follow in code blocks, as many sections as
Slack's 3,000 characters a section need (never cut: the pieces, read in order, are the
arguments exactly); an actions block holds Allow and Deny (`approval_allow` /
`approval_deny`, the approval id as their value). Arguments that would need more than
MAX_CODE_SECTIONS sections, or that hold ``` (which would end a code block early; a
backtick at a piece's edge too), go as a file uploaded with the card, and the card names
it. The workspace files the command names follow, each a heading and its text in code
blocks (a ``` in a file's text written with its last backtick as the escape `\x60`; a
file past the blocks Slack allows is named only). Everything is `visible()` already (the
card made it so): an escape sequence reads as `\x1b`, never folded or hidden. Once
decided the actions block gives way to the outcome.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from channels.base import ApprovalCard, CardFile

ALLOW_ACTION, DENY_ACTION = "approval_allow", "approval_deny"
ACTIONS = re.compile(r"approval_(allow|deny)")
SECTION_LIMIT = 3000  # characters of a section's text
FENCE = "```"
MAX_CODE_SECTIONS = 12  # past this (about 35,000 characters) the arguments go as a file
MAX_BLOCKS = 50  # of a message
_ESCAPES = {"&": "&amp;", "<": "&lt;", ">": "&gt;"}


def escape(text: str) -> str:
    """Text as mrkdwn shows it literally: Slack reads &, < and > as markup even in code."""
    return "".join(_ESCAPES.get(ch, ch) for ch in text)


def unescape(text: str) -> str:
    return text.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")


def code_pieces(arguments: str) -> list[str] | None:
    """The arguments cut into pieces that each fit a section as an escaped code block,
    preferably after a line break; None when they go as a file instead."""
    if FENCE in arguments:
        return None
    room = SECTION_LIMIT - 2 * len(FENCE)
    pieces: list[str] = []
    start = 0
    while start < len(arguments):
        size, end, last_break = 0, start, -1
        while end < len(arguments):
            cost = len(_ESCAPES.get(arguments[end], arguments[end]))
            if size + cost > room:
                break
            size += cost
            if arguments[end] == "\n":
                last_break = end
            end += 1
        if end < len(arguments) and last_break > start + (end - start) // 2:
            end = last_break + 1  # a long line-based text is cut after a line
        piece = arguments[start:end]
        if piece.startswith("`") or piece.endswith("`"):
            return None  # next to the fence it would read as part of it
        pieces.append(piece)
        start = end
        if len(pieces) > MAX_CODE_SECTIONS:
            return None
    return pieces


def file_name(card: ApprovalCard) -> str:
    return f"approval-{card.id}.{'sh' if card.tool == 'exec' else 'txt'}"


def summary(card: ApprovalCard, outcome: str | None = None) -> str:
    """The message's `text`: what notifications show (the blocks are the message)."""
    head = f"Approval needed ({card.id}): {card.tool}"
    return f"{head}: {outcome}" if outcome else head


def card_blocks(card: ApprovalCard, *, outcome: str | None = None, buttons: bool = True) -> list[dict[str, Any]]:
    """The card's blocks; with `outcome` the decided card (no buttons)."""
    arguments = card.arguments if card.arguments.strip() else "(no arguments)"
    pieces = code_pieces(arguments)
    title = f"*Approval needed* (`{card.id}`): the assistant wants to run `{escape(card.tool)}`"
    if pieces is None:
        title += (f". Its arguments ({len(arguments):,} characters) are in the file `{file_name(card)}` "
                  "sent with this card.")
    else:
        title += " with:"
    blocks: list[dict[str, Any]] = [_section(title)]
    for piece in pieces or ():
        blocks.append(_section(FENCE + escape(piece) + FENCE))
    blocks.extend(_file_blocks(card.files, room=MAX_BLOCKS - len(blocks) - 3))
    if outcome is not None:
        blocks.append(_section(f"*{escape(outcome)}*"[:SECTION_LIMIT]))
        return blocks
    who = card.who.capitalize() or "An approver"
    how = "with the buttons, or " if buttons else ""
    blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": escape(
        f"{who} can answer {how}with /allow {card.id} or /deny {card.id}. "
        f"No answer in {card.timeout_s:g} s is a deny.")}]})
    if buttons:
        blocks.append({"type": "actions", "block_id": f"approval:{card.id}", "elements": [
            _button("Allow", ALLOW_ACTION, card.id, "primary"),
            _button("Deny", DENY_ACTION, card.id, "danger"),
        ]})
    return blocks


def _file_blocks(files: tuple[CardFile, ...], room: int) -> list[dict[str, Any]]:
    """The named files: a heading each, then its text's code blocks while there is room."""
    if not files:
        return []
    blocks = [_section("The command names these workspace files:")]
    for index, file in enumerate(files):
        pieces = code_pieces(file.text.replace(FENCE, "``\\x60") or " ") if file.text is not None else None
        left = room - len(blocks) - (len(files) - index)  # a heading for each file still to come
        if file.text is not None and (pieces is None or len(pieces) + 1 > left):
            file = dataclasses.replace(file, text=None, note="too long for this card")
            pieces = None
        blocks.append(_section(f"_{escape(file.heading())}_"))
        blocks.extend(_section(FENCE + escape(piece) + FENCE) for piece in pieces or ())
    return blocks


def _section(text: str) -> dict[str, Any]:
    return {"type": "section", "text": {"type": "mrkdwn", "text": text}}


def _button(label: str, action_id: str, value: str, style: str) -> dict[str, Any]:
    return {"type": "button", "action_id": action_id, "value": value, "style": style,
            "text": {"type": "plain_text", "text": label}}
