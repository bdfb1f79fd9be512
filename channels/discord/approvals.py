"""An approval card as Discord shows it (SPEC §5.7). Pure, no I/O.

One message: the tool, its whole arguments in a code block, and an action row with Allow
and Deny buttons (custom ids `ap:<id>:a` / `ap:<id>:d`, so a press is answered from the
id alone, also after a restart). Arguments that do not fit Discord's 2,000 characters
with the rest of the card, or that hold ``` (which would end the code block early), go
as a file posted just before the card, which then names it: never cut. Once decided the
card is edited: the outcome in place of its last line, and no components.
"""

from __future__ import annotations

import re
from typing import Any

from channels.base import ApprovalCard
from channels.discord.format import DISCORD_TEXT_LIMIT, FENCE

FOOTER_RESERVE = 400  # characters kept for the last line: who may answer, later the outcome
_CUSTOM_ID = re.compile(r"ap:([a-z0-9]{1,32}):([ad])")
PRIMARY, SUCCESS, DANGER = 1, 3, 4  # Discord's button styles


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
    (`outcome` there). The arguments keep the same form either way."""
    arguments = _arguments(card)
    if in_file(card):
        body = (f"{_head(card)}. Its arguments ({len(arguments):,} characters) are in the file "
                f"`{file_name(card)}` sent with this card.")
    else:
        body = f"{_head(card)} with:\n{_code(card, arguments)}"
    if outcome is not None:
        return f"{body}\n**{outcome[:FOOTER_RESERVE - 8]}**"
    how = "with the buttons, or " if buttons else ""
    return (f"{body}\n{card.who.capitalize() or 'An approver'} can answer {how}with /allow {card.id} or "
            f"/deny {card.id}. No answer in {card.timeout_s:g} s is a deny.")


def _arguments(card: ApprovalCard) -> str:
    return card.arguments if card.arguments.strip() else "(no arguments)"


def _head(card: ApprovalCard) -> str:
    return f"**Approval needed** (`{card.id}`): the assistant wants to run `{card.tool}`"


def _code(card: ApprovalCard, arguments: str) -> str:
    return f"{FENCE}{'sh' if card.tool == 'exec' else ''}\n{arguments}\n{FENCE}"
