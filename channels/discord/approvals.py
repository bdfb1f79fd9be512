"""An approval card as Discord shows it (SPEC §5.7). Pure, no I/O.

One message: the tool, its whole arguments in a code block, and an action row with Allow
and Deny buttons (custom ids `ap:<id>:a` / `ap:<id>:d`, so a press is answered from the
id alone, also after a restart). Arguments that do not fit Discord's 2,000 characters
with the rest of the card, or that hold ``` (which would end the code block early), go
as a file posted just before the card, which then names it: never cut nor folded. The
workspace files the command names follow, each a heading and a code block; when they do
not fit with the card they go as messages of their own just before it. Everything is
`visible()` already (the card made it so): an escape sequence reads as `\x1b`. Once
decided the card is edited: the outcome in place of its last line, and no components.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from channels.base import ApprovalCard, CardFile
from channels.discord.format import DISCORD_TEXT_LIMIT, FENCE

FOOTER_RESERVE = 400  # characters kept for the last line: who may answer, later the outcome
_CUSTOM_ID = re.compile(r"ap:([a-z0-9]{1,32}):([ad])")
PRIMARY, SUCCESS, DANGER = 1, 3, 4  # Discord's button styles
_MARKDOWN = re.compile(r"([\\*_~`|>#\-\[\]()<:@])")


def custom_id(approval_id: str, allow: bool) -> str:
    return f"ap:{approval_id}:{'a' if allow else 'd'}"


def parse_custom_id(value: Any) -> tuple[str, bool] | None:
    """(approval id, allow) of one of our buttons, or None for anything else."""
    if not isinstance(value, str) or len(value) > 100:
        return None
    match = _CUSTOM_ID.fullmatch(value)
    return (match.group(1), match.group(2) == "a") if match else None


def components(card: ApprovalCard) -> list[dict[str, Any]]:
    return [{"type": 1, "components": [
        {"type": 2, "style": SUCCESS, "label": "Allow", "custom_id": custom_id(card.id, True)},
        {"type": 2, "style": DANGER, "label": "Deny", "custom_id": custom_id(card.id, False)},
    ]}]


def file_name(card: ApprovalCard) -> str:
    return f"approval-{card.id}.{'sh' if card.tool == 'exec' else 'txt'}"


def in_file(card: ApprovalCard) -> bool:
    """Whether the arguments go as a file: they would not fit, or would end the code block."""
    arguments = _arguments(card)
    return FENCE in arguments or \
        len(_head(card)) + len(_code(card, arguments)) + FOOTER_RESERVE > DISCORD_TEXT_LIMIT


def card_content(card: ApprovalCard, outcome: str | None = None, *, buttons: bool = True) -> str:
    """The card's text as first shown (who may answer on the last line), or once decided
    (`outcome` there). The arguments and files keep the same form either way."""
    arguments = _arguments(card)
    if in_file(card):
        body = (f"{_head(card)}. Its arguments ({len(arguments):,} characters) are in the file "
                f"`{file_name(card)}` sent with this card.")
    else:
        body = f"{_head(card)} with:\n{_code(card, arguments)}"
    if card.files:
        inline = _files(card.files)
        if len(body) + len(inline) + FOOTER_RESERVE <= DISCORD_TEXT_LIMIT:
            body += f"\nThe command names these workspace files:{inline}"
        else:
            names = _plain(", ".join(f.name for f in card.files))
            body += f"\nThe workspace files the command names are shown just above: {names[:FOOTER_RESERVE]}."
    if outcome is not None:
        return f"{body}\n**{outcome[:FOOTER_RESERVE - 8]}**"
    how = "with the buttons, or " if buttons else ""
    return (f"{body}\n{card.who.capitalize() or 'An approver'} can answer {how}with /allow {card.id} or "
            f"/deny {card.id}. No answer in {card.timeout_s:g} s is a deny.")


def file_messages(card: ApprovalCard) -> list[str]:
    """The named files as messages of their own, posted before the card, when they do not
    fit on it (else none): each file one message within Discord's limit."""
    if not card.files or "just above" not in card_content(card):
        return []
    messages = []
    for file in card.files:
        head = "A workspace file the command on the next card names:"
        text = head + _files((file,))
        if len(text) > DISCORD_TEXT_LIMIT:
            text = head + _files((dataclasses.replace(file, text=None, note="too long for a message"),))
        messages.append(text[:DISCORD_TEXT_LIMIT])
    return messages


def _files(files: tuple[CardFile, ...]) -> str:
    parts = []
    for file in files:
        parts.append(f"\n*{_plain(file.heading())}*")
        if file.text is not None:
            # ``` would end the block early: its last backtick written as the escape it is
            shown = file.text.replace(FENCE, "``\\x60")
            parts.append(f"\n{FENCE}\n{shown}\n{FENCE}")
    return "".join(parts)


def _plain(text: str) -> str:
    """Text Discord shows as it is: its Markdown characters escaped."""
    return _MARKDOWN.sub(r"\\\1", text)


def _arguments(card: ApprovalCard) -> str:
    return card.arguments if card.arguments.strip() else "(no arguments)"


def _head(card: ApprovalCard) -> str:
    return f"**Approval needed** (`{card.id}`): the assistant wants to run `{card.tool}`"


def _code(card: ApprovalCard, arguments: str) -> str:
    return f"{FENCE}{'sh' if card.tool == 'exec' else ''}\n{arguments}\n{FENCE}"
