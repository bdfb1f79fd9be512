"""Inbound pipeline (SPEC §3): dedup → access → command or queue.

`handle` returns once the event is durably recorded and accepted (or refused), so the
adapter may then acknowledge it to the platform."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Collection

from gateway.access import LOCAL_CHANNELS, Decision, Pairing, decide
from gateway.agents import Places
from gateway.hub import Replies
from gateway.services import Services
from gateway.store.errors import StoreError
from gateway.turns.commands import Commands, parse_command
from gateway.turns.sessions import SessionManager, TurnJob, storage_reply
from gateway.types import Inbound, inbound_from_dict, inbound_to_dict

log = logging.getLogger("gateway.router")

REFUSAL_INTERVAL_S = 3600  # a stranger is told "private" once an hour, not once a message
_REFUSALS_KEPT = 10_000  # bounded: a crowd of strangers cannot grow it without end

# Where the sender picks the event id and retries a message refused as busy with the same
# one (the web API's `id`). Platforms redeliver only what was not acknowledged: a busy
# reply was an answer there, so a redelivery stays a duplicate.
RETRY_AFTER_BUSY = frozenset({"web"})

BUSY_REPLY = "I'm still working on your earlier messages; please wait for my answer before sending more."


def clean_text(text: str) -> str:
    """Platform text can carry lone surrogates or NULs; store only valid text."""
    return text.encode("utf-8", "replace").decode("utf-8").replace("\x00", "")


class Router:
    """Answers that need no turn (refusals, pairing codes, busy, storage notices) go out
    through `replies` (the channel hub)."""

    def __init__(self, services: Services, sessions: SessionManager, commands: Commands,
                 pairing: Pairing, *, places: Places, replies: Replies) -> None:
        self.s = services
        self.sessions = sessions
        self.commands = commands
        self.pairing = pairing
        self.places = places
        self.reply = replies.deliver
        self._refused: OrderedDict[str, float] = OrderedDict()  # identity → when last told
        # (channel, event id) of the messages resume_pending picked up: accepted before this
        # start (the terminal labels their answers with the question).
        self.resumed: set[tuple[str, str]] = set()

    async def handle(self, inbound: Inbound) -> bool:
        """False when the event was seen before (a redelivery): nothing more happens."""
        try:
            return await self._handle(inbound)
        except (StoreError, OSError) as err:
            # Disk full, read-only or unreachable database: say so instead of failing the
            # platform's delivery (which would bring the same message into the same failure).
            log.error("inbound message could not be stored",
                      extra={"channel": inbound.channel, "error": str(err)[:300]})
            try:
                await self.reply(inbound, storage_reply(err))
            except Exception:
                log.exception("storage notice could not be delivered", extra={"channel": inbound.channel})
            return True

    async def admits(self, inbound: Inbound) -> bool:
        """Whether `inbound` would be served (the access decision of `_handle`, without its
        side effects). Channels ask before downloading a message's files, so a stranger's
        upload is never fetched."""
        return (await self._decide(inbound)).action == "allow"

    async def _decide(self, inbound: Inbound) -> Decision:
        cfg = self.s.cfg
        decision = decide(cfg, inbound, approved=False)
        if decision.action in ("refuse", "pair") and not inbound.is_group and inbound.channel not in LOCAL_CHANNELS:
            # Only a person the config does not admit needs the pairing table: one statement
            # less per message from everyone it does.
            if await self.pairing.is_approved(inbound.identity):
                return decide(cfg, inbound, approved=True)
        return decision

    async def _handle(self, inbound: Inbound) -> bool:
        cfg = self.s.cfg
        self.s.metrics.inbound.labels(inbound.channel).inc()
        text = clean_text(inbound.text).strip()
        too_long = len(text) > cfg.limits.max_inbound_chars
        if text != inbound.text:
            inbound = _with_text(inbound, text)
        key, scope = self.places.keys(inbound)
        fresh = await self.s.store.record_event(
            inbound.channel, inbound.event_id, session_key=key, inbound=inbound_to_dict(inbound)
        )
        if not fresh and inbound.channel in RETRY_AFTER_BUSY:
            fresh = await self.s.store.retry_busy_event(inbound.channel, inbound.event_id, session_key=key,
                                                        inbound=inbound_to_dict(inbound))
        if not fresh:
            self.s.metrics.dedup_hits.labels(inbound.channel).inc()
            log.info("duplicate event dropped", extra={"session": key, "event": inbound.event_id})
            return False
        decision = await self._decide(inbound)
        if decision.action == "ignore":
            await self.s.store.mark_event(inbound.channel, inbound.event_id, "ignored")
            return True
        if decision.action in ("refuse", "pair"):
            self.s.metrics.refused.labels(inbound.channel, decision.reason).inc()
            await self.s.store.mark_event(inbound.channel, inbound.event_id, "refused")
            await self._refuse(inbound, decision.action)
            return True
        if not text and not inbound.attachments:
            await self.s.store.mark_event(inbound.channel, inbound.event_id, "ignored")
            return True
        if too_long:
            await self._answer(inbound, f"That message is too long ({len(text):,} characters; the limit is "
                                        f"{cfg.limits.max_inbound_chars:,}). Please send it as a file or shorten it.")
            return True
        if await self.commands.handle(inbound, key, scope):
            return True
        if self.s.usage is not None:
            over = await self.s.usage.refusal(cfg, inbound.identity)
            if over is not None:
                self.s.metrics.refused.labels(inbound.channel, "daily budget").inc()
                await self._answer(inbound, over, status="refused")
                return True
        if not await self.sessions.submit(key, scope, TurnJob(inbound)):
            await self._answer(inbound, BUSY_REPLY, status="busy")
        return True

    async def _answer(self, inbound: Inbound, text: str, status: str = "answered") -> None:
        await self.reply(inbound, text)
        await self.s.store.mark_event(inbound.channel, inbound.event_id, status)

    async def _refuse(self, inbound: Inbound, action: str) -> None:
        if action == "refuse":
            now, who = self.pairing.clock(), inbound.identity
            told = self._refused.get(who)
            if told is not None and now - told < REFUSAL_INTERVAL_S:
                return
            self._refused[who] = now
            self._refused.move_to_end(who)
            while len(self._refused) > _REFUSALS_KEPT:
                self._refused.popitem(last=False)
            await self.reply(inbound, "Sorry, this bot is private. Ask its admin to add you.")
            return
        code, new = await self.pairing.code_for(inbound.identity)
        if not new:
            return  # their code was sent when it was made and is still valid: no flood of replies
        await self.reply(
            inbound,
            f"Hi! This bot answers approved people only. Your pairing code is {code}. "
            f"Send it to the bot's admin, who can approve it with /approve {code}. It expires in 1 hour.",
        )

    async def resume_pending(self, channels: Collection[str]) -> list[Inbound]:
        """After a restart, before the channels start: queue every turn of `channels` (the
        ones this process runs) that was accepted but not answered, ahead of anything new.
        Other channels' events stay pending for the process that runs them (`gateway chat`
        runs only the terminal; `run` has no terminal): a reply delivered to no channel
        would count as answered and never be sent. Commands among them are returned, to
        be answered with `answer_commands` once the channels can deliver."""
        pending = [ev for ev in await self.s.store.pending_events() if ev.channel in channels]
        commands: list[Inbound] = []
        for ev in pending:
            try:
                inbound = inbound_from_dict(ev.inbound)
            except (KeyError, TypeError, ValueError):
                log.warning("unreadable pending event", extra={"event": ev.event_id})
                await self.s.store.mark_event(ev.channel, ev.event_id, "failed")
                continue
            key, scope = await self._resume_keys(inbound, ev.session_key)
            self.resumed.add((ev.channel, ev.event_id))
            resume = ev.turn if ev.status == "running" else None
            # Text the gateway made (a task's prompt, a webhook's body) is never a command.
            if resume is None and inbound.origin is None and parse_command(inbound.text) is not None:
                commands.append(inbound)
                continue
            if not await self.sessions.submit(key, scope, TurnJob(inbound, resume_turn=resume)):
                log.warning("queue full while resuming", extra={"session": key, "event": ev.event_id})
        if pending:
            log.info("resumed pending turns", extra={"count": len(pending)})
        return commands

    async def _resume_keys(self, inbound: Inbound, recorded: str | None) -> tuple[str, str]:
        """The session and scope a pending turn resumes in. A person's message is placed as
        when it arrived; a turn the gateway made (a task's, a webhook's) stays in the session
        it was recorded for, which need not be the one its reply's chat implies (a hook may
        run in `web:alice` and answer in Telegram), with that session's scope."""
        if inbound.origin is not None and recorded:
            row = await self.s.store.get_session(recorded)
            if row is not None:
                return recorded, row.scope
        return self.places.keys(inbound)

    async def answer_command(self, inbound: Inbound) -> None:
        """A command among the events another gateway left undecided (the sessions' leftover)."""
        await self.answer_commands([inbound])

    async def answer_commands(self, commands: list[Inbound]) -> None:
        for inbound in commands:
            key, scope = self.places.keys(inbound)
            try:
                await self.commands.handle(inbound, key, scope)
            except Exception:
                log.exception("a pending command could not be answered", extra={"session": key})


def _with_text(inbound: Inbound, text: str) -> Inbound:
    data = inbound_to_dict(inbound)
    data["text"] = text
    return inbound_from_dict(data)
