"""Access rules (pure) and pairing codes (stored)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from gateway.access import PAIRING_TTL_S, Pairing, decide
from gateway.config.load import parse_config
from gateway.store.sqlite import Store
from gateway.types import Inbound


def _dm(user: str = "7", channel: str = "telegram") -> Inbound:
    return Inbound(channel=channel, chat_id=user, user_id=user, text="hi", event_id="1")


def _group(mentioned: bool = False, reply: bool = False, chat: str = "-100") -> Inbound:
    return Inbound(channel="telegram", chat_id=chat, user_id="7", text="hi", event_id="1", is_group=True,
                   mentioned=mentioned, reply_to_bot=reply)


def test_dm_policies() -> None:
    pairing = parse_config({}, environ={})
    assert decide(pairing, _dm(), approved=False).action == "pair"
    assert decide(pairing, _dm(), approved=True).action == "allow"
    admin = parse_config({"admins": ["telegram:7"]}, environ={})
    assert decide(admin, _dm(), approved=False).action == "allow"
    allow = parse_config({"access": {"dm_policy": "allowlist", "allow_from": ["slack:U1"]}}, environ={})
    assert decide(allow, _dm(), approved=False).action == "refuse"
    assert decide(allow, _dm("U1", "slack"), approved=False).action == "allow"
    assert decide(parse_config({"access": {"dm_policy": "open"}}, environ={}), _dm(), approved=False).action \
        == "allow"
    # The operator's local channels are always allowed.
    assert decide(pairing, _dm("alice", "web"), approved=False).action == "allow"


def test_groups_need_listing_and_a_trigger() -> None:
    listed = parse_config({"access": {"allow_from": ["telegram:-100"]}}, environ={})
    assert decide(listed, _group(), approved=False).action == "ignore"
    assert decide(listed, _group(mentioned=True), approved=False).action == "allow"
    assert decide(listed, _group(reply=True), approved=False).action == "allow"
    assert decide(listed, _group(mentioned=True, chat="-200"), approved=False).action == "ignore"
    mention_only = parse_config({"access": {"allow_from": ["*"], "group_trigger": "mention"}}, environ={})
    assert decide(mention_only, _group(reply=True), approved=False).action == "ignore"
    everything = parse_config({"access": {"allow_from": ["*"], "group_trigger": "all"}}, environ={})
    assert decide(everything, _group(), approved=False).action == "allow"


async def test_pairing_codes(tmp_path: Path) -> None:
    store = await Store.open(tmp_path / "db.sqlite3")
    try:
        pairing = Pairing(store)
        code, new = await pairing.code_for("telegram:7", now=1000)
        assert new and len(code) == 8
        assert await pairing.code_for("telegram:7", now=1010) == (code, False)  # reused while valid
        assert await pairing.approve("WRONG123", "telegram:1", now=1020) is None
        assert not await pairing.is_approved("telegram:7")
        assert await pairing.approve(code.lower(), "telegram:1", now=1030) == "telegram:7"
        assert await pairing.is_approved("telegram:7")
        assert await pairing.approve(code, "telegram:1", now=1040) is None  # one-time

        late, _ = await pairing.code_for("slack:U9", now=5000)
        assert await pairing.approve(late, "telegram:1", now=5000 + PAIRING_TTL_S + 1) is None
        fresh, new = await pairing.code_for("slack:U9", now=5000 + PAIRING_TTL_S + 2)
        assert new and fresh != late  # an expired code is never handed out again
        assert await pairing.approve(fresh, "telegram:1", now=5000 + PAIRING_TTL_S + 3) == "slack:U9"
        # Rate limited: no new code within a minute of the last one.
        assert (await pairing.code_for("slack:U9", now=5000 + PAIRING_TTL_S + 10))[0] == ""
    finally:
        await store.close()


async def test_messages_at_the_same_time_make_one_code(tmp_path: Path) -> None:
    store = await Store.open(tmp_path / "db.sqlite3")
    try:
        pairing = Pairing(store, clock=lambda: 1000.0)
        results = await asyncio.gather(*(pairing.code_for("slack:U9") for _ in range(20)))
        assert sum(new for _, new in results) == 1  # one reply, whichever message came first
        assert len({code for code, _ in results}) == 1
        rows = await store.run("SELECT count(*) FROM pairing_codes WHERE identity='slack:U9'")
        assert rows[0][0] == 1
    finally:
        await store.close()


def test_discord_people_and_channels() -> None:
    cfg = parse_config({"admins": ["discord:42"], "access": {"dm_policy": "allowlist",
                                                             "allow_from": ["discord:43", "discord:77"]}}, environ={})
    assert decide(cfg, _dm("42", "discord"), approved=False).action == "allow"  # an admin
    assert decide(cfg, _dm("43", "discord"), approved=False).action == "allow"
    assert decide(cfg, _dm("44", "discord"), approved=False).action == "refuse"
    assert decide(cfg, _dm("43", "telegram"), approved=False).action == "refuse"  # ids are per platform

    def in_channel(chat: str, *, thread: str | None = None, mentioned: bool = True) -> Inbound:
        return Inbound(channel="discord", chat_id=chat, user_id="44", text="hi", event_id="1", is_group=True,
                       thread_id=thread, mentioned=mentioned)

    assert decide(cfg, in_channel("77"), approved=False).action == "allow"
    assert decide(cfg, in_channel("77", thread="91"), approved=False).action == "allow"  # a thread of a listed channel
    assert decide(cfg, in_channel("77", mentioned=False), approved=False).action == "ignore"
    assert decide(cfg, in_channel("78"), approved=False).action == "ignore"
