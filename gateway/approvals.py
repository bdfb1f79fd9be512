"""Approvals (SPEC §5.7): a tool listed as `ask` in `approvals.tools` waits, before each
call, for a yes from an approver.

The card shows the tool and its whole arguments where the turn's message came from (Allow
and Deny buttons on channels that have them, the card as text with `/allow ID` and `/deny
ID` elsewhere). Approvers are the admins or, with `participants`, anyone whose messages
go into the session. Anyone else's answer is refused and changes nothing. Each approval is
decided once, in the database (a second click finds it decided); the buttons are disabled
then. No answer within `approvals.timeout_s` is a deny; a stopped turn ends its wait; a
restart while waiting turns the wait into a deny, and the card says so, never a silent yes.
On a database several gateways share, a click that reaches another gateway is recorded
there and the waiting gateway reads it within POLL_S.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from channels.base import ApprovalCard
from gateway.access import is_admin
from gateway.config.schema import Config
from gateway.keys import delegating_session, session_key
from gateway.store.api import StoreBackend
from gateway.types import Inbound, inbound_from_dict, inbound_to_dict

log = logging.getLogger("gateway.approvals")

ID_ALPHABET = "23456789abcdefghjkmnpqrstuvwxyz"  # no look-alikes: people type it after /allow
ID_LENGTH = 6
POLL_S = 1.0  # a shared database: how often a waiting turn looks for a decision made elsewhere
SHOW_TIMEOUT_S = 30.0  # showing or settling a card; the wait itself is approvals.timeout_s

# How a wait ended, as stored: a person's allow or deny, or the gateway's deny.
ALLOW, DENY, TIMEOUT, RESTART, STOPPED = "allow", "deny", "timeout", "restart", "stopped"

Show = Callable[[Inbound, ApprovalCard], Awaitable[str | None]]
Settle = Callable[[Inbound, ApprovalCard, str | None, str], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Verdict:
    allowed: bool
    note: str  # for the tool's result when denied ("denied by telegram:1"), and the card


@dataclass(slots=True)
class _Waiting:
    card: ApprovalCard
    session: str
    inbound: Inbound
    decided: asyncio.Future[tuple[str, str | None]]
    ref: str | None = None


def pretty_arguments(arguments: str) -> str:
    """The arguments as a person reads them: a lone command as it will run, else
    indented JSON; never shortened."""
    try:
        parsed = json.loads(arguments or "{}")
    except ValueError:
        return arguments
    if isinstance(parsed, dict) and set(parsed) == {"command"} and isinstance(parsed["command"], str):
        return parsed["command"]
    return json.dumps(parsed, indent=2, ensure_ascii=False)


def outcome_text(decision: str, by: str | None, timeout_s: float) -> str:
    match decision:
        case "allow":
            return f"Allowed by {by}."
        case "deny":
            return f"Denied by {by}."
        case "timeout":
            return f"Denied: nobody answered within {timeout_s:g} s."
        case "restart":
            return "Denied: the gateway restarted while this waited for an answer (nothing was run)."
        case _:
            return "Denied: the turn was stopped."


class Approvals:
    def __init__(self, store: StoreBackend, *, config: Callable[[], Config], show: Show, settle: Settle) -> None:
        self.store = store
        self.config = config
        self.show = show
        self.settle = settle
        self.shared = bool(getattr(store, "shared", False))
        self._waiting: dict[str, _Waiting] = {}
        self.closing = False  # set by a shutdown: a wait it cuts is a restart's deny, not a stop

    def needed(self, cfg: Config, tool: str) -> bool:
        return cfg.approvals.tools.get(tool) == "ask"

    async def start(self) -> None:
        """Waits cut by a restart are denies, and their cards say so (channels are up)."""
        if self.shared:
            return  # another gateway may be waiting on them; their own timeout ends them
        rows = await self.store.run(
            "UPDATE approvals SET decision=?, decided_by='gateway', decided_at=? WHERE decision IS NULL "
            "RETURNING id, tool, arguments, inbound, ref", (RESTART, time.time()))
        cfg = self.config()
        for row in rows:
            card = ApprovalCard(id=row["id"], tool=row["tool"], arguments=row["arguments"], who="",
                                timeout_s=cfg.approvals.timeout_s)
            try:
                inbound = inbound_from_dict(json.loads(row["inbound"] or "{}"))
                async with asyncio.timeout(SHOW_TIMEOUT_S):
                    await self.settle(inbound, card, row["ref"], outcome_text(RESTART, None, 0))
            except Exception as err:  # a card that cannot be updated stays as it was
                log.warning("could not update the card of an approval cut by a restart",
                            extra={"approval": row["id"], "error": str(err)[:200]})
            log.warning("approval denied: the gateway restarted while it waited", extra={"approval": row["id"]})

    async def ask(self, *, session: str, turn: int, inbound: Inbound, tool: str, arguments: str) -> Verdict:
        """Show the card and wait for the answer (at most `approvals.timeout_s`)."""
        cfg = self.config()
        timeout_s = cfg.approvals.timeout_s
        who = "an admin" if cfg.approvals.approvers == "admins" else "anyone in this conversation"
        card = ApprovalCard(id=await self._new_id(), tool=tool, arguments=pretty_arguments(arguments), who=who,
                            timeout_s=timeout_s)
        now = time.time()
        await self.store.run(
            "INSERT INTO approvals(id, session_key, turn, tool, arguments, asked_by, asked_at, expires_at, inbound) "
            "VALUES (?,?,?,?,?,?,?,?,?)",
            (card.id, session, turn, tool, card.arguments, inbound.identity, now, now + timeout_s,
             json.dumps(inbound_to_dict(inbound), ensure_ascii=False)))
        waiting = _Waiting(card, session, inbound, asyncio.get_running_loop().create_future())
        self._waiting[card.id] = waiting
        log.info("approval asked", extra={"approval": card.id, "session": session, "tool": tool})
        decision: str = TIMEOUT
        by: str | None = None
        try:
            try:
                async with asyncio.timeout(SHOW_TIMEOUT_S):
                    waiting.ref = await self.show(inbound, card)
            except Exception as err:  # /allow and /deny still answer it; the timeout still ends it
                log.warning("could not show an approval card", extra={"approval": card.id, "error": str(err)[:200]})
            if waiting.ref is not None:
                await self.store.run("UPDATE approvals SET ref=? WHERE id=?", (waiting.ref, card.id))
            decision, by = await self._wait(waiting, now + timeout_s)
        except asyncio.CancelledError:
            decision = RESTART if self.closing else STOPPED
            raise
        finally:
            self._waiting.pop(card.id, None)
            if decision in (TIMEOUT, STOPPED, RESTART):
                # Recorded unless a person's answer got there first (then that answer stands).
                rows = await asyncio.shield(self._record(card.id, decision, None))
                if not rows:
                    decision, by = await self._stored(card.id)
            text = outcome_text(decision, by, timeout_s)
            await asyncio.shield(self._settle(waiting, text))
            log.info("approval decided", extra={"approval": card.id, "session": session, "tool": tool,
                                                "decision": decision, "by": by})
        return Verdict(decision == ALLOW, text)

    async def _wait(self, waiting: _Waiting, deadline: float) -> tuple[str, str | None]:
        while True:
            left = deadline - time.time()
            if left <= 0:
                return TIMEOUT, None
            try:
                return await asyncio.wait_for(asyncio.shield(waiting.decided), min(left, POLL_S) if self.shared
                                              else left)
            except TimeoutError:
                if self.shared:  # decided through another gateway?
                    decision, by = await self._stored(waiting.card.id)
                    if decision is not None:
                        return decision, by

    async def _stored(self, approval_id: str) -> tuple[Any, Any]:
        rows = await self.store.run("SELECT decision, decided_by FROM approvals WHERE id=?", (approval_id,))
        return (rows[0]["decision"], rows[0]["decided_by"]) if rows else (None, None)

    async def _record(self, approval_id: str, decision: str, by: str | None) -> list[Any]:
        return await self.store.run(
            "UPDATE approvals SET decision=?, decided_by=?, decided_at=? WHERE id=? AND decision IS NULL "
            "RETURNING id", (decision, by, time.time(), approval_id))

    async def _settle(self, waiting: _Waiting, text: str) -> None:
        try:
            async with asyncio.timeout(SHOW_TIMEOUT_S):
                await self.settle(waiting.inbound, waiting.card, waiting.ref, text)
        except Exception as err:
            log.warning("could not update an approval card", extra={"approval": waiting.card.id,
                                                                   "error": str(err)[:200]})

    async def _new_id(self) -> str:
        for _ in range(10):
            candidate = "".join(secrets.choice(ID_ALPHABET) for _ in range(ID_LENGTH))
            if not await self.store.run("SELECT 1 FROM approvals WHERE id=?", (candidate,)):
                return candidate
        raise RuntimeError("no free approval id")

    def may_answer(self, cfg: Config, session: str, who: Inbound) -> bool:
        """Admins always; with `participants`, anyone whose messages go into the session
        (for a sub-turn's call: the session that delegated it, SPEC §5.7)."""
        if is_admin(cfg, who.identity):
            return True
        return cfg.approvals.approvers == "participants" and \
            session_key(who, cfg.group_session_scope) == delegating_session(session)

    async def decide(self, approval_id: str, who: Inbound, allow: bool) -> str:
        """A person's answer (a button, /allow, /deny): a short notice for them."""
        cfg = self.config()
        wanted = approval_id.strip().strip("`'\"").lower()
        rows = await self.store.run("SELECT session_key, decision, decided_by FROM approvals WHERE id=?", (wanted,))
        if not rows:
            return f"There is no approval {wanted!r}."
        session, decided, decided_by = rows[0]["session_key"], rows[0]["decision"], rows[0]["decided_by"]
        if not self.may_answer(cfg, session, who):
            log.warning("approval answer refused: not an approver",
                        extra={"approval": wanted, "who": who.identity})
            return ("Only an admin can answer this." if cfg.approvals.approvers == "admins"
                    else "Only someone in that conversation or an admin can answer this.")
        timeout_s = cfg.approvals.timeout_s
        if decided is not None:
            return f"Approval {wanted} was decided already: {outcome_text(decided, decided_by, timeout_s)}"
        decision = ALLOW if allow else DENY
        if not await self._record(wanted, decision, who.identity):
            decided, decided_by = await self._stored(wanted)
            return f"Approval {wanted} was decided already: {outcome_text(decided, decided_by, timeout_s)}"
        waiting = self._waiting.get(wanted)
        if waiting is not None and not waiting.decided.done():
            waiting.decided.set_result((decision, who.identity))
        return "Allowed." if allow else "Denied."
