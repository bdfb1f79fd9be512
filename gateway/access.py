"""Who may talk to the bot (SPEC §3.2, §6 access): DM policy, allowlist, pairing codes,
group allowlist and trigger. Decisions are pure; pairing state lives in the store."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from gateway.config.schema import Config
from gateway.store.api import StoreBackend
from gateway.types import HOOK_ORIGIN_PREFIX, Inbound

log = logging.getLogger("gateway.access")

PAIRING_TTL_S = 3600
PAIRING_MIN_INTERVAL_S = 60  # one new code per person per minute at most
LOCAL_CHANNELS = ("web", "terminal")  # loopback or token-protected: the operator's own
LOCAL_OPERATOR = "terminal:local"  # whoever runs `gateway chat` on the machine: its owner (SPEC §2 admins)
_CODE_ALPHABET = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"  # no look-alikes


@dataclass(frozen=True, slots=True)
class PairingCode:
    code: str
    identity: str
    created_at: float
    expires_at: float
    approved_at: float | None

    @property
    def channel(self) -> str:
        return self.identity.partition(":")[0]

    @property
    def user_id(self) -> str:
        return self.identity.partition(":")[2]


@dataclass(frozen=True, slots=True)
class ApprovedPerson:
    identity: str
    approved_by: str
    approved_at: float


@dataclass(frozen=True, slots=True)
class PairingOutcome:
    """What approving a code or revoking a person did, in words for the admin who asked."""

    ok: bool
    text: str
    identity: str | None = None
    told: bool = False  # the person got the "You're approved" notice in their chat


class PersonNotice(Protocol):
    """Tells one person something in their DM through their channel: whether it was
    delivered (gateway/hub.py's ChannelHub; the CLI runs no channel and passes none)."""

    async def tell_person(self, identity: str, text: str) -> bool: ...


@dataclass(frozen=True, slots=True)
class Decision:
    action: Literal["allow", "ignore", "refuse", "pair"]
    reason: str = ""


def is_admin(cfg: Config, identity: str) -> bool:
    if identity.startswith(HOOK_ORIGIN_PREFIX):
        return False  # a webhook's turn is a configured source, never an admin (even if listed)
    return identity == LOCAL_OPERATOR or identity in cfg.admins


def group_triggered(cfg: Config, inbound: Inbound) -> bool:
    trigger = cfg.access.group_trigger
    if trigger == "all":
        return True
    if trigger == "mention":
        return inbound.mentioned
    return inbound.mentioned or inbound.reply_to_bot


def decide(cfg: Config, inbound: Inbound, *, approved: bool) -> Decision:
    """`approved`: the person was approved through pairing earlier."""
    if inbound.channel in LOCAL_CHANNELS:
        return Decision("allow")
    allow = set(cfg.access.allow_from)
    if inbound.is_group:
        if not group_triggered(cfg, inbound):
            return Decision("ignore", "not addressed")
        if "*" in allow or f"{inbound.channel}:{inbound.chat_id}" in allow:
            return Decision("allow")
        return Decision("ignore", "group not allowed")
    identity = inbound.identity
    if is_admin(cfg, identity) or "*" in allow or identity in allow or approved:
        return Decision("allow")
    policy = cfg.access.dm_policy
    if policy == "open":
        return Decision("allow")
    if policy == "allowlist":
        return Decision("refuse", "not on the allowlist")
    return Decision("pair", "pairing required")


def new_code() -> str:
    return "".join(secrets.choice(_CODE_ALPHABET) for _ in range(8))


def allowed_without_pairing(cfg: Config, identity: str) -> str | None:
    """Why `identity` may chat whatever pairing says (an admin, on the allowlist), or None."""
    if is_admin(cfg, identity):
        return "they are an admin (admins)"
    if identity in cfg.access.allow_from or "*" in cfg.access.allow_from:
        return "access.allow_from lets them in"
    if cfg.access.dm_policy == "open":
        return "access.dm_policy is open"
    return None


class Pairing:
    def __init__(self, store: StoreBackend, clock: Callable[[], float] = time.time, *,
                 people: PersonNotice | None = None) -> None:
        self.store = store
        self.clock = clock  # wall-clock seconds; tests move it
        self.people = people  # None: nobody is told (the CLI runs no channel)

    async def is_approved(self, identity: str) -> bool:
        return bool(await self.store.run("SELECT 1 FROM approved_users WHERE identity=?", (identity,)))

    async def code_for(self, identity: str, now: float | None = None) -> tuple[str, bool]:
        """The person's live code (reused while valid) and whether it is new; rate limited.
        Only a new code is worth a message: a stranger who keeps writing gets one per hour."""
        now = self.clock() if now is None else now
        code = new_code()
        # One statement decides and inserts, so messages handled at the same time (Slack
        # delivers events concurrently) make one code and one reply, not one each.
        made = await self.store.run(
            "INSERT INTO pairing_codes(code, identity, created_at, expires_at) "
            "SELECT ?, ?, CAST(? AS DOUBLE PRECISION), CAST(? AS DOUBLE PRECISION) "
            "WHERE NOT EXISTS (SELECT 1 FROM pairing_codes WHERE identity=? "
            "AND ((approved_at IS NULL AND expires_at>?) OR created_at>?)) RETURNING code",
            (code, identity, now, now + PAIRING_TTL_S, identity, now, now - PAIRING_MIN_INTERVAL_S),
        )
        if made:
            channel, _, user_id = identity.partition(":")
            log.info("pairing requested: code sent", extra={"channel": channel, "user": user_id})
            return code, True
        live = await self.store.run(
            "SELECT code FROM pairing_codes WHERE identity=? AND approved_at IS NULL "
            "AND expires_at>? ORDER BY created_at DESC LIMIT 1", (identity, now),
        )
        return (str(live[0][0]), False) if live else ("", False)

    async def approve(self, code: str, approved_by: str, now: float | None = None) -> str | None:
        """Approve a code; returns the approved identity, or None for an unknown/expired code."""
        now = self.clock() if now is None else now
        code = code.strip().upper()
        # Claiming the code and reading its owner is one statement: a code approves once.
        rows = await self.store.run(
            "UPDATE pairing_codes SET approved_at=? WHERE code=? AND approved_at IS NULL AND expires_at>? "
            "RETURNING identity", (now, code, now),
        )
        if not rows:
            return None
        identity = str(rows[0][0])
        await self.store.run(
            "INSERT INTO approved_users(identity, approved_by, approved_at) VALUES (?,?,?) ON CONFLICT(identity) "
            "DO UPDATE SET approved_by=excluded.approved_by, approved_at=excluded.approved_at",
            (identity, approved_by, now),
        )
        return identity

    async def approve_code(self, code: str, *, by: str) -> PairingOutcome:
        """The one way a code gets approved: `/approve` in chat, the admin page and
        `gateway pairing approve`. The person is told in their chat when this process runs
        their channel; approval stands either way."""
        identity = await self.approve(code, approved_by=by)
        if identity is None:
            reason = await self.explain_failure(code)
            return PairingOutcome(False, reason)
        log.info("pairing approved", extra={"identity": identity, "by": by})
        told = False
        if self.people is not None:
            try:
                told = await self.people.tell_person(identity, APPROVED_NOTICE)
            except Exception as err:  # best effort: the approval is stored
                log.warning("could not tell an approved person", extra={"identity": identity,
                                                                        "error": str(err)[:200]})
        text = f"Approved {identity}." + ("" if told else " They can chat from their next message.")
        return PairingOutcome(True, text, identity, told)

    async def revoke(self, identity: str, *, by: str, cfg: Config | None = None) -> PairingOutcome:
        """Take a person's pairing approval back: from their next message they are a
        stranger and get a new code. Their old codes go too, so the one-code-a-minute
        limit does not leave them without an answer."""
        identity = identity.strip()
        rows = await self.store.run("DELETE FROM approved_users WHERE identity=? RETURNING identity", (identity,))
        if not rows:
            approved = [p.identity for p in await self.approved(limit=10)]
            known = ", ".join(approved) if approved else "nobody yet"
            return PairingOutcome(False, f"{identity} is not approved by pairing (approved: {known}).")
        await self.store.run("DELETE FROM pairing_codes WHERE identity=?", (identity,))
        log.info("pairing revoked", extra={"identity": identity, "by": by})
        text = f"Revoked {identity}: from their next message they are asked to pair again."
        still = allowed_without_pairing(cfg, identity) if cfg is not None else None
        if still is not None:
            text += f" They can still chat: {still}."
        return PairingOutcome(True, text, identity)

    async def approved(self, limit: int = 500) -> list[ApprovedPerson]:
        """The people approved by pairing, the latest first."""
        rows = await self.store.run(
            "SELECT identity, approved_by, approved_at FROM approved_users ORDER BY approved_at DESC, identity "
            "LIMIT ?", (limit,))
        return [ApprovedPerson(str(r[0]), str(r[1]), float(r[2])) for r in rows]

    async def find(self, code: str) -> PairingCode | None:
        """A code as stored (pending, approved or expired), for telling why approving failed."""
        rows = await self.store.run(
            "SELECT code, identity, created_at, expires_at, approved_at FROM pairing_codes WHERE code=?",
            (code.strip().upper(),),
        )
        return PairingCode(*rows[0]) if rows else None

    async def pending(self, now: float | None = None) -> list[PairingCode]:
        """Codes waiting for an admin, newest first."""
        now = self.clock() if now is None else now
        rows = await self.store.run(
            "SELECT code, identity, created_at, expires_at, approved_at FROM pairing_codes "
            "WHERE approved_at IS NULL AND expires_at>? ORDER BY created_at DESC", (now,),
        )
        return [PairingCode(*row) for row in rows]

    async def explain_failure(self, code: str, now: float | None = None) -> str:
        """Why `approve(code)` approved nobody, in words for the admin."""
        now = self.clock() if now is None else now
        found = await self.find(code)
        if found is not None and found.approved_at is not None:
            return f"That code was already approved: {found.identity} can chat."
        if found is not None and found.expires_at <= now:
            return (f"That code expired; {found.identity} gets a new one with their next message "
                    "(a code lasts 1 hour).")
        return "That code is unknown or expired."


APPROVED_NOTICE = "You're approved: you can chat with me now. Send /help to see the commands."
