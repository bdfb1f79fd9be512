"""Session keys and memory scopes (SPEC §1): shared sessions always use the group's scope,
a person's own scope only where only that person writes."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.keys import GroupScope, memory_scope, session_key
from gateway.types import Inbound


def _msg(channel: str, chat: str, user: str, *, thread: str | None = None, group: bool = True,
         ts: str | None = "100.1") -> Inbound:
    return Inbound(channel=channel, chat_id=chat, user_id=user, text="hi", event_id=f"{chat}:{ts}",
                   message_id=ts, thread_id=thread, is_group=group)


@pytest.mark.parametrize("mode", ["user", "group"])
def test_topics_and_threads_use_the_groups_scope_whoever_writes(mode: GroupScope) -> None:
    for channel, chat, thread in (("telegram", "-100", "5"), ("slack", "C1", "1712.55")):
        alice, bob = _msg(channel, chat, "A", thread=thread), _msg(channel, chat, "B", thread=thread)
        assert session_key(alice, mode) == session_key(bob, mode)
        assert memory_scope(alice, mode) == memory_scope(bob, mode) == f"{channel}:group:{chat}"


def test_a_persons_own_scope_only_where_only_they_write() -> None:
    assert memory_scope(_msg("telegram", "7", "7", group=False)) == "telegram:user:7"
    assert memory_scope(_msg("slack", "D1", "U1", group=False)) == "slack:user:U1"
    assert memory_scope(_msg("telegram", "-100", "7")) == "telegram:group:-100:user:7"
    assert memory_scope(_msg("telegram", "-100", "7"), "group") == "telegram:group:-100"


def test_slack_top_level_messages_follow_group_session_scope() -> None:
    a1, a2 = _msg("slack", "C1", "U1", ts="1.1"), _msg("slack", "C1", "U1", ts="2.2")
    b = _msg("slack", "C1", "U2", ts="3.3")
    # "user": one session per (channel, person), whatever message it is.
    assert session_key(a1) == session_key(a2) == "slack:channel:C1:user:U1"
    assert session_key(b) == "slack:channel:C1:user:U2"
    assert memory_scope(a1) == "slack:group:C1:user:U1"
    # "group": the channel's top level is one shared session.
    assert session_key(a1, "group") == session_key(b, "group") == "slack:channel:C1"
    assert memory_scope(a1, "group") == memory_scope(b, "group") == "slack:group:C1"
    # A thread is its own session, apart from the top level.
    reply = _msg("slack", "C1", "U1", thread="1.1", ts="4.4")
    assert session_key(reply) == session_key(reply, "group") == "slack:channel:C1:thread:1.1"
    # Slash commands (no ts) land in the top-level session.
    command = _msg("slack", "C1", "U1", ts=None)
    assert session_key(command) == "slack:channel:C1:user:U1"
    assert session_key(command, "group") == "slack:channel:C1"


_ids = st.sampled_from(["1", "2", "-100", "C1", "D1", "U1", "U2", "5", "1.1"])
_inbounds = st.builds(
    _msg, st.sampled_from(["telegram", "slack", "discord", "web", "terminal"]), _ids, _ids,
    thread=st.one_of(st.none(), _ids), group=st.booleans(), ts=st.one_of(st.none(), _ids),
)


@settings(max_examples=300, deadline=None)
@given(pair=st.tuples(_inbounds, _inbounds), mode=st.sampled_from(["user", "group"]),
       other_mode=st.sampled_from(["user", "group"]))
def test_the_scope_is_a_function_of_the_session_key(pair: tuple[Inbound, Inbound], mode: Any,
                                                    other_mode: Any) -> None:
    """Whoever writes in a session and whatever the setting was when it started, one key
    always gets one scope: a stored session never keeps a person's scope for others.
    (Slack DMs are keyed by the DM channel, which belongs to one person.)"""
    first, second = pair
    if first.channel == second.channel == "slack" and not first.is_group and not second.is_group \
            and first.chat_id == second.chat_id:
        second = _msg("slack", second.chat_id, first.user_id, group=False)
    if session_key(first, mode) == session_key(second, other_mode):
        assert memory_scope(first, mode) == memory_scope(second, other_mode)


def test_discord_keys_and_scopes() -> None:
    dm = _msg("discord", "42", "42", group=False)
    assert session_key(dm) == "discord:dm:42" and memory_scope(dm) == "discord:user:42"
    alone = _msg("discord", "77", "42")
    assert session_key(alone) == "discord:channel:77:user:42"
    assert memory_scope(alone) == "discord:group:77:user:42"
    assert session_key(alone, "group") == "discord:channel:77"
    assert memory_scope(alone, "group") == "discord:group:77"
    # A thread is a shared session under its parent channel, whoever writes and whatever the setting.
    for user in ("42", "43"):
        in_thread = _msg("discord", "77", user, thread="91")
        for mode in ("user", "group"):
            assert session_key(in_thread, mode) == "discord:channel:77:thread:91"
            assert memory_scope(in_thread, mode) == "discord:group:77"


def test_the_other_channels_keys_are_unchanged() -> None:
    """The spelling every stored session already has (SPEC §1)."""
    cases = [
        (_msg("telegram", "123", "123", group=False), "user", "telegram:dm:123", "telegram:user:123"),
        (_msg("telegram", "-100", "7"), "user", "telegram:group:-100:user:7", "telegram:group:-100:user:7"),
        (_msg("telegram", "-100", "7"), "group", "telegram:group:-100", "telegram:group:-100"),
        (_msg("telegram", "-100", "7", thread="5"), "user", "telegram:group:-100:topic:5", "telegram:group:-100"),
        (_msg("slack", "D1", "U1", group=False), "user", "slack:dm:D1", "slack:user:U1"),
        (_msg("slack", "C1", "U1"), "user", "slack:channel:C1:user:U1", "slack:group:C1:user:U1"),
        (_msg("slack", "C1", "U1"), "group", "slack:channel:C1", "slack:group:C1"),
        (_msg("slack", "C1", "U1", thread="1712.55"), "user", "slack:channel:C1:thread:1712.55", "slack:group:C1"),
        (_msg("web", "alice", "alice", group=False), "user", "web:alice", "web:alice"),
        (_msg("terminal", "local", "local", group=False), "group", "terminal:local", "terminal:local"),
    ]
    for inbound, mode, key, scope in cases:
        assert (session_key(inbound, mode), memory_scope(inbound, mode)) == (key, scope)
