"""Which messages come back after a restart (SPEC §4.5)."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.types import Message

from .turns import final_reply, split_turns, user_message

MIN_RESTORED_TURNS = 3


def restored_turn_count(max_turns: int) -> int:
    return max(MIN_RESTORED_TURNS, max_turns // 6)


def restore_messages(stored: Sequence[Message], max_turns: int) -> list[Message]:
    """The most recent max(3, max_turns // 6) complete turns, each reduced to the user's
    text and the agent's final reply (tool chains removed).

    `stored` are the session's messages from its context start, in order. A turn counts
    as complete when it has both; an unanswered last turn is left to the caller (it is
    answered or the user is asked to resend it).
    """
    complete: list[list[Message]] = []
    for turn in split_turns(stored):
        user, reply = user_message(turn), final_reply(turn)
        if user is not None and reply is not None:
            complete.append([user, reply])
    keep = restored_turn_count(max_turns)
    return [msg for pair in complete[-keep:] for msg in pair]
