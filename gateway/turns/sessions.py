"""Per-session order (SPEC §3.4): one turn at a time per session key, FIFO, shared by
every producer; sessions run concurrently; a full queue gets a "busy" reply.

Live sessions are a bounded LRU cache over the store, restored lazily on first use
(SPEC §4.5).

A turn's reply streams when the channel gives a stream for it (SPEC §5.1): the agent
feeds it, this module ends it with the stored reply (`finish`, or `fail` for an error
reply) and keeps the stream's platform reference with the turn's event, so a turn
resumed after a crash edits the message already shown. Otherwise the reply goes out
whole with `send()` at the end. The typing indicator runs while the agent works; with a
stream, until the stream first shows something."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from context.engine import SessionContext, context_stats
from context.restore import restore_messages
from gateway.agents import agent_of_scope
from gateway.config.changes import is_secret_key
from gateway.keys import workspace_dir
from gateway.media import Intake, plain_intake, reply_files
from gateway.services import Services
from gateway.store.errors import StoreError, StoreUnavailable
from gateway.store.fence import FencedOut
from gateway.turns.agent import Agent, TurnResult
from gateway.turns.live import LiveSession, TurnStop
from gateway.turns.streaming import TypingUntilShown
from gateway.turns.usage import today
from gateway.types import Inbound, Message
from gateway.workspace import make_private_dir

if TYPE_CHECKING:
    from channels.base import ReplyStream

log = logging.getLogger("gateway.sessions")

SEND_FILES_TIMEOUT_S = 120.0  # for the files a reply names, all of them
# A command among the events a session worker took over (its gateway died deciding it):
# answered as a restart answers the commands it finds (the router's `answer_command`).
LeftoverCommand = Callable[[Inbound], Awaitable[None]]


# finish/fail are bounded by the channel; this only guards the turn against one that is not.
FINISH_TIMEOUT_S = 300.0
# How long /stop waits for the stopped turn to end (its reply stored and shown) before it
# answers; the stop goes on regardless.
STOP_WAIT_S = 10.0
StopOutcome = Literal["stopped", "idle", "pending", "unreached"]

CRASH_REPLY = "Something went wrong on our side while answering. Your message is saved; please try again."
STORAGE_REPLY = ("I could not save this conversation (the server's storage refused the write, "
                 "e.g. a full disk), so I could not answer. Please try again later.")
UNREACHABLE_REPLY = ("I could not reach my database just now, so I could not answer. Please send your "
                     "message again in a moment.")
TIMEOUT_REPLY = "Answering took too long and was stopped. Your message is saved; please try again."
RESEND_REPLY = "I restarted before I could answer your last message; please send it again."


@dataclass(frozen=True, slots=True)
class TurnJob:
    inbound: Inbound
    resume_turn: int | None = None  # set when re-running a turn accepted before a restart


@dataclass(frozen=True, slots=True)
class CommandJob:
    """A command that needs the session to itself (/compact, /context clear)."""

    inbound: Inbound
    run: Callable[[LiveSession], Awaitable[str]]
    fresh_context: bool = False  # it starts a fresh context (/new): the history shows a divider after it


Job = TurnJob | CommandJob


def shown_command(text: str) -> str:
    """A command as the history keeps it: a value given to a secret setting is masked
    (chat refuses to set it, and it stays out of the database too)."""
    parts = text.strip().split(maxsplit=2)
    if len(parts) == 3 and parts[0].split("@", 1)[0].lower() == "/config" and is_secret_key(parts[1]):
        return f"{parts[0]} {parts[1]} ***"
    return text.strip()


async def keep_command_answer(services: Services, key: str, inbound: Inbound, answer: str, *,
                              fresh_context: bool = False) -> None:
    """The command and its answer, kept for the chat's history before the answer goes out
    (a page reloaded at once finds it). Never in `messages`: no context or search sees it.
    Best effort: the answer is given either way."""
    try:
        await services.store.add_command_answer(key, shown_command(inbound.text), answer,
                                                fresh_context=fresh_context)
    except Exception as err:
        log.warning("a command's answer was not kept for the history", extra={"session": key,
                                                                            "error": str(err)[:300]})


def storage_reply(err: BaseException) -> str:
    """What the person is told when the store failed under their message."""
    return UNREACHABLE_REPLY if isinstance(err, StoreUnavailable) else STORAGE_REPLY


def _is_final_reply(msg: Message) -> bool:
    return msg.role == "assistant" and not msg.tool_calls


def _close_open_turn(messages: list[Message]) -> list[Message]:
    """Give every tool call of an interrupted turn a result, so requests stay well formed."""
    answered = {m.tool_call_id for m in messages if m.role == "tool"}
    out: list[Message] = []
    for m in messages:
        out.append(m)
        if m.role == "assistant" and m.tool_calls:
            for call in m.tool_calls:
                if call.id not in answered:
                    out.append(Message(role="tool", content="error: interrupted by a restart; not run",
                                       turn=m.turn, tool_call_id=call.id, tool_name=call.name))
    return out


def _last_turns(stored: list[Message], max_turns: int) -> list[Message]:
    """The messages of the last `max_turns` turns of `stored`, in order."""
    turns = sorted({m.turn for m in stored})[-max_turns:]
    return [m for m in stored if turns and m.turn >= turns[0]]


def _log_turn(live: LiveSession, started: float, outcome: str) -> None:
    """The one INFO line of a turn: what it cost and how it ended, never what was said."""
    log.info("turn ended", extra={
        "session": live.key, "channel": live.channel, "agent": live.agent, "model": live.last_model,
        "steps": live.turn_steps,
        "tokens_in": live.turn_tokens_in, "tokens_out": live.turn_tokens_out,
        "duration_s": round(time.monotonic() - started, 2), "outcome": outcome, "trims": list(live.turn_trims),
    })


class SessionManager:
    """Replies, streams, typing indicators and files go out through the services' channel
    hub (gateway/hub.py)."""

    def __init__(self, services: Services, agent: Agent) -> None:
        self.s = services
        self.hub = services.hub
        self.agent = agent
        self.live: OrderedDict[str, LiveSession] = OrderedDict()
        self._loading: dict[str, asyncio.Lock] = {}
        self._last_turns: dict[str, int] = {}
        self._stopping = False
        # Jobs queue from the start (turns resumed after a restart first, so they keep their
        # place before newer messages) but run only once the channels can deliver replies.
        self.open = asyncio.Event()

    def begin(self, leftover: LeftoverCommand) -> None:
        """The channels can deliver now: queued jobs start running. `leftover` answers a
        command found among events taken over from another gateway (none on one gateway)."""
        self.open.set()

    # -- live sessions ------------------------------------------------------------------

    async def get_live(self, key: str, scope: str, channel: str) -> LiveSession:
        live = self.live.get(key)
        if live is not None:
            self.live.move_to_end(key)
            return live
        lock = self._loading.setdefault(key, asyncio.Lock())
        async with lock:
            live = self.live.get(key)
            if live is None:
                live = await self._restore(key, scope, channel)
                self.live[key] = live
                self._evict()
        self._loading.pop(key, None)
        self.s.metrics.live_sessions.set(len(self.live))
        return live

    async def _restore(self, key: str, scope: str, channel: str) -> LiveSession:
        cfg = self.s.cfg
        store = self.s.store
        row = await store.ensure_session(key, scope, channel)
        start = row.context_start_turn
        summary = await store.latest_summary(key)
        whole = await self._handed_over(key)
        if whole:
            # Handed over by another gateway: the context as it was there, tool chains and
            # all — every turn its summary does not cover, up to the turn limit.
            if summary is not None and summary.upto_turn >= start:
                start_here = summary.upto_turn + 1
            else:
                start_here = start
            stored = await store.recent_messages(key, turns=cfg.agent_max_context_turns + 1, from_turn=start_here)
        else:
            keep = max(3, cfg.agent_max_context_turns // 6)
            stored = await store.recent_messages(key, turns=keep + 1, from_turn=start)
        # An interrupted turn (no final reply) comes back whole, to be resumed.
        open_turn: list[Message] = []
        if stored:
            last = stored[-1].turn
            tail = [m for m in stored if m.turn == last]
            if not _is_final_reply(tail[-1]):
                open_turn = _close_open_turn(tail)
                stored = [m for m in stored if m.turn != last]
        if whole:
            restored = _last_turns(stored, cfg.agent_max_context_turns) + open_turn
        else:
            restored = restore_messages(stored, cfg.agent_max_context_turns) + open_turn
        use_summary = summary is not None and summary.upto_turn >= start
        ctx = SessionContext(
            key, restored,
            summary=summary.text if use_summary and summary else None,
            summary_upto_turn=summary.upto_turn if use_summary and summary else 0,
        )
        workspace = workspace_dir(self.s.data_dir, scope)
        await asyncio.to_thread(make_private_dir, workspace)  # 0700, like the data dir (SPEC §9)
        live = LiveSession(key=key, scope=scope, channel=channel, workspace=workspace, ctx=ctx,
                           queue=asyncio.Queue(),  # bounded in submit(), by the live config
                           agent=agent_of_scope(scope), model_alias=row.model)
        live.context_start = start
        live.seq = len(open_turn)
        # The newest message is among those read (the last turns): the session's mark.
        live.last_message_id = max((m.id or 0 for m in stored + open_turn), default=0)
        self._last_turns[key] = await store.last_turn(key)
        # The turns before the restored ones left the context with the restart: those no
        # summary covers yet go to long-term memory in the background (SPEC §4.5).
        first_live = (restored or open_turn)[0].turn if restored or open_turn else None
        covered = max(summary.upto_turn if summary else 0, start - 1)
        if first_live is not None and first_live - 1 > covered:
            self.agent.summarizer.catch_up(live, first_live - 1)
        log.debug("session restored", extra={"session": key, "messages": len(restored)})
        return live

    async def _handed_over(self, key: str) -> bool:
        """Whether a session that is not cached here comes from another gateway that ran it
        (then its context comes back whole) rather than from a restart or an eviction (a
        few turns as text, SPEC §4.5). One gateway alone: never."""
        return False

    def _evict(self) -> None:
        limit = self.s.cfg.limits.max_live_sessions
        if len(self.live) <= limit:
            return
        for key in list(self.live):
            if len(self.live) <= limit:
                break
            live = self.live[key]
            if live.worker is None and live.queue.empty() and not live.summarizing:
                del self.live[key]
                self._last_turns.pop(key, None)

    def drop(self, key: str) -> None:
        """Forget the cached state (it is rebuilt from the store on next use)."""
        live = self.live.get(key)
        if live is not None and live.worker is None and live.queue.empty():
            del self.live[key]

    # -- queueing -----------------------------------------------------------------------

    async def submit(self, key: str, scope: str, job: Job) -> bool:
        """Queue a job for a session; False when its queue is full (the caller says busy)."""
        if self._stopping:
            return False
        live = await self.get_live(key, scope, job.inbound.channel)
        if live.scope != scope and live.worker is None and live.queue.empty():
            # The bindings changed: the session now has another agent, and its scope.
            self.drop(key)
            live = await self.get_live(key, scope, job.inbound.channel)
        if live.queue.qsize() >= self.s.cfg.limits.session_queue_size:
            self.s.metrics.busy.inc()
            return False
        live.queue.put_nowait(job)
        self.s.metrics.queue_depth.inc()
        if live.worker is None:
            live.worker = self.s.background.spawn(self._work(live), name=f"session:{key}")
        return True

    def queued(self) -> int:
        return sum(live.queue.qsize() for live in self.live.values())

    def worker_of(self, key: str) -> asyncio.Task[Any] | None:
        """The task running the session's jobs now, if any (the terminal waits for it)."""
        live = self.live.get(key)
        return live.worker if live is not None else None

    async def _work(self, live: LiveSession) -> None:
        try:
            await self.open.wait()
            while not live.queue.empty():
                job = live.queue.get_nowait()
                self.s.metrics.queue_depth.dec()
                await self._run_job(live, job)
        finally:
            live.worker = None

    async def _run_job(self, live: LiveSession, job: Job) -> None:
        """One job to its end; a failure is told to the person and logged, never raised
        (but a lost lease is: the gateway that took the session over answers)."""
        started = time.monotonic()
        outcome = "cut"  # a shutdown cancelled it; it resumes at the next start
        try:
            if isinstance(job, TurnJob):
                outcome = await self._turn(live, job)
            else:
                await self._command(live, job)
        except FencedOut:
            outcome = "fenced"
            raise
        except (StoreError, OSError) as err:
            # The database or disk refused a write: this job ends, the queue goes on. The
            # event stays where it was (accepted, running): a restart resumes it.
            outcome = "storage_error"
            log.error("job failed on storage", extra={"session": live.key, "error": str(err)[:300]})
            await self._send(job.inbound, storage_reply(err))
        except Exception:
            outcome = "crash"
            log.exception("job failed", extra={"session": live.key})
            await self._send(job.inbound, CRASH_REPLY)
        finally:
            if isinstance(job, TurnJob):
                self._settle_usage(live, counted=False)  # a turn that did not end in the store
                _log_turn(live, started, outcome)
                stop, live.stop = live.stop, None
                if stop is not None:
                    stop.ended.set()

    def _settle_usage(self, live: LiveSession, *, counted: bool) -> None:
        """The turn's tokens join the person's day in process (`counted`: the store counted
        the turn too); the next turn's checks see them."""
        charge, live.charge = live.charge, None
        if charge is not None and self.s.usage is not None:
            self.s.usage.close_turn(self.s.cfg, charge, counted=counted)

    async def _command(self, live: LiveSession, job: CommandJob) -> None:
        inbound = job.inbound
        fresh = job.fresh_context
        try:
            text = await job.run(live)
        except Exception:
            log.exception("command failed", extra={"session": live.key})
            text, fresh = CRASH_REPLY, False
        await keep_command_answer(self.s, live.key, inbound, text, fresh_context=fresh)
        await self._send(inbound, text)
        await self.s.store.mark_event(inbound.channel, inbound.event_id, "answered")

    async def _send(self, inbound: Inbound, text: str) -> bool:
        try:
            await self.hub.deliver(inbound, text)
            return True
        except Exception:
            log.exception("reply could not be delivered", extra={"channel": inbound.channel})
            return False

    async def _turn(self, live: LiveSession, job: TurnJob) -> str:
        """Run a turn to its reply; its outcome for the log line."""
        inbound = job.inbound
        live.turn_tokens_in = live.turn_tokens_out = live.turn_steps = 0
        live.turn_trims = []
        store = self.s.store
        cfg = self.s.cfg
        live.inbound = inbound
        if job.resume_turn is None and self._stored_unanswered(live, inbound.text):
            # A crash between storing this message and marking its event left the event
            # "accepted": continue the stored turn instead of storing the message twice.
            job = TurnJob(inbound, resume_turn=live.ctx.current_turn)
            await store.mark_event(inbound.channel, inbound.event_id, "running", turn=job.resume_turn)
        if job.resume_turn is None:
            # Files the person sent become the message's text and metadata (SPEC §5.4);
            # what could not be kept or heard is said first.
            intake = await self._intake(live, inbound)
            for notice in intake.notices:
                await self._send(inbound, notice)
            if not intake.run:
                # Nothing is left to answer (a voice note that could not be heard, files
                # all refused): the notices said why.
                await store.mark_event(inbound.channel, inbound.event_id, "answered")
                return "nothing_to_answer"
            turn = max(self._last_turns.get(live.key, 0), live.ctx.current_turn) + 1
            self._last_turns[live.key] = turn
            live.seq = 0
            # Stored before the model is called (SPEC §3 persistence order); the same
            # statement marks the event running with this turn.
            # A scheduled task's prompt keeps its origin: it starts the turn, no person wrote it.
            await self.agent.store(live, Message(role="user", content=intake.text, turn=turn,
                                                 origin=inbound.origin, attachments=intake.attachments),
                                   event=(inbound.channel, inbound.event_id))
        resume_ref: str | None = None
        if job.resume_turn is not None:
            turn = job.resume_turn
            # Where a stream showed this turn's reply before the restart, if it did.
            resume_ref = await store.reply_ref(inbound.channel, inbound.event_id)
            done = [m for m in live.ctx.messages if m.turn == turn]
            if done and _is_final_reply(done[-1]):
                # Answered before the restart but maybe not delivered: deliver it once now
                # (into the message already shown, when a stream showed one).
                await self._say(inbound, done[-1].content, resume_ref=resume_ref)
                await store.mark_event(inbound.channel, inbound.event_id, "answered")
                return "delivered_after_restart"
            if not done or turn != live.ctx.current_turn:
                # The turn fell out of the restored window, or a newer turn was stored after
                # it (the agent only ever continues the latest turn): ask for it again.
                await self._say(inbound, RESEND_REPLY, resume_ref=resume_ref, failed=True)
                await store.mark_event(inbound.channel, inbound.event_id, "answered")
                return "asked_to_resend"
        stream = self._stream(inbound, resume_ref)
        if self.s.usage is not None:
            live.charge = self.s.usage.open_turn(inbound.identity)
        result = await self._run_agent(live, inbound, cfg.limits.turn_timeout_s, stream)
        self.s.metrics.turns.labels(inbound.channel, result.outcome).inc()
        if stream is None:
            delivered = await self._send(inbound, result.text)
        else:
            delivered = await self._end_stream(inbound, stream, result.text,
                                               failed=result.outcome not in ("ok", "stopped"))
        if delivered and result.outcome == "ok":
            await self._send_named_files(live, inbound, result.text)
        # "undelivered" keeps a lost reply visible in the events table (the reply is stored).
        # The turn counts against the person's daily usage in the same statement.
        # The turn's tokens as charged call by call (a sub-turn a /stop cut short included).
        tokens = live.charge.tokens if live.charge is not None else live.turn_tokens
        usage = (inbound.identity, today(cfg), tokens) if self.s.usage is not None else None
        if live.charge is not None and usage is not None:
            self.s.usage.ending(cfg, live.charge)
        try:
            await store.end_turn(inbound.channel, inbound.event_id, "answered" if delivered else "undelivered",
                                 usage=usage)
            self._settle_usage(live, counted=usage is not None)
        except StoreError as err:
            if result.outcome != "storage_error":
                raise
            # The person was told already; the event stays open for a restart to resume.
            log.error("turn end not stored", extra={"session": live.key, "error": str(err)[:300]})
        return result.outcome if delivered else "undelivered"

    async def _send_named_files(self, live: LiveSession, inbound: Inbound, text: str) -> None:
        """The files under files/ the reply names, sent after its text where the channel can."""
        if "files/" not in text or not self.hub.sends_files(inbound.channel):
            return
        try:
            files = await asyncio.to_thread(reply_files, live.workspace, text)
            if files:
                async with asyncio.timeout(SEND_FILES_TIMEOUT_S):
                    await self.hub.send_files(inbound, files)
        except Exception:  # the text is delivered; a file that could not follow is only logged
            log.exception("files named in a reply could not be sent", extra={"channel": inbound.channel})

    async def _intake(self, live: LiveSession, inbound: Inbound) -> Intake:
        if not inbound.attachments:
            return Intake(inbound.text, (), (), True)
        media = self.s.media
        if media is None:
            return plain_intake(inbound)
        return await media.intake(inbound, live.workspace)

    @staticmethod
    def _stored_unanswered(live: LiveSession, text: str) -> bool:
        """The live context ends with an unanswered turn that holds exactly this user text."""
        turn = live.ctx.current_turn
        msgs = [m for m in live.ctx.messages if m.turn == turn]
        return bool(msgs) and msgs[0].role == "user" and msgs[0].content == text and not _is_final_reply(msgs[-1])

    def _stream(self, inbound: Inbound, resume_ref: str | None) -> ReplyStream | None:
        store = self.s.store

        async def keep_ref(ref: str) -> None:
            try:
                await store.set_reply_ref(inbound.channel, inbound.event_id, ref)
            except Exception as err:  # losing it costs at most a second message after a crash
                log.warning("could not keep a reply's reference",
                            extra={"channel": inbound.channel, "error": str(err)[:300]})

        return self.hub.stream(inbound, on_ref=keep_ref, resume_ref=resume_ref)

    async def _end_stream(self, inbound: Inbound, stream: ReplyStream, text: str, *, failed: bool) -> bool:
        """Make what the stream shows equal `text`; False when it could not be delivered."""
        try:
            async with asyncio.timeout(FINISH_TIMEOUT_S):
                if failed:
                    await stream.fail(text)
                else:
                    await stream.finish(text)
            return True
        except Exception:
            log.exception("streamed reply could not be delivered", extra={"channel": inbound.channel})
            return False

    async def _say(self, inbound: Inbound, text: str, *, resume_ref: str | None, failed: bool = False) -> bool:
        """A reply that needs no model (a turn resumed after a restart); into the streamed
        message already shown, if any. Through the channel's stream whenever it has one,
        so the platform's message is recorded as soon as it answers: another kill before
        the turn's end then leaves a reference, and this reply is not sent a third time."""
        stream = self._stream(inbound, resume_ref)
        if stream is None:
            return await self._send(inbound, text)
        return await self._end_stream(inbound, stream, text, failed=failed)

    async def _run_agent(self, live: LiveSession, inbound: Inbound, timeout: float,
                         stream: ReplyStream | None = None) -> TurnResult:
        try:
            if stream is None:
                async with self.hub.typing(inbound):
                    async with asyncio.timeout(timeout):
                        return await self._stoppable(live, None)
            async with TypingUntilShown(stream, self.hub.typing(inbound)) as shown:
                async with asyncio.timeout(timeout):
                    return await self._stoppable(live, shown)
        except TimeoutError:
            log.warning("turn timed out", extra={"session": live.key})
            return TurnResult(TIMEOUT_REPLY, "timeout")
        except (asyncio.CancelledError, FencedOut):
            raise  # a gateway that lost the session's lease says nothing more in it
        except StoreError as err:
            # A write of the turn failed (a full disk, a lost database): the person hears that.
            log.error("turn failed on storage", extra={"session": live.key, "error": str(err)[:300]})
            return TurnResult(storage_reply(err), "storage_error")
        except Exception:
            log.exception("turn failed", extra={"session": live.key})
            return TurnResult(CRASH_REPLY, "crash")

    async def _stoppable(self, live: LiveSession, stream: ReplyStream | None) -> TurnResult:
        """The agent's run of the turn in a task of its own, which a /stop cancels alone
        (SPEC §6): the model call and the tools end, and the turn is closed with what was
        shown. A cancellation of this job itself (a shutdown, the timeout) goes on up."""
        run = asyncio.ensure_future(self.agent.run_turn(live, stream))
        live.running = run
        try:
            return await run
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if live.stop is None or (me is not None and me.cancelling()):
                raise
            return await self.agent.stopped(live, live.stop.by)
        finally:
            live.running = None

    async def stop_turn(self, key: str, by: str, inbound: Inbound | None = None) -> StopOutcome:
        """/stop (SPEC §6): cancel the agent's run of the session's turn running now and
        wait (a little) for the turn to end: "stopped"; "idle" when no answer is being
        written; "pending" when it has not ended within STOP_WAIT_S; "unreached" when the
        gateway running it (another one) did not take the stop in that time."""
        stop = self._stop_here(key, by)
        if stop is None:
            return await self._stop_elsewhere(key, inbound)
        return await self._stopped(stop)

    def _stop_here(self, key: str, by: str) -> TurnStop | None:
        live = self.live.get(key)
        run = live.running if live is not None else None
        if live is None or run is None or run.done():
            return None
        if live.stop is None:
            live.stop = TurnStop(by)
            run.cancel()
        return live.stop

    async def _stop_elsewhere(self, key: str, inbound: Inbound | None) -> StopOutcome:
        """A turn of `key` running on another gateway (gateway/turns/leased_sessions.py); here: none."""
        return "idle"

    @staticmethod
    async def _stopped(stop: TurnStop) -> StopOutcome:
        try:
            async with asyncio.timeout(STOP_WAIT_S):
                await stop.ended.wait()
        except TimeoutError:
            return "pending"
        return "stopped"

    async def context_numbers(self, key: str) -> dict[str, Any] | None:
        """A session's /context numbers while it is live here (the admin page), else None."""
        live = self.live.get(key)
        if live is None:
            return None
        cfg = self.s.cfg
        plan = self.agent.step(live, cfg)
        stats = context_stats(live.ctx, system_prompt=await self.agent.system_prompt(live, cfg),
                              tools=self.agent.tool_schemas(plan.view), budget=cfg.context_budget(plan.model),
                              counter=self.s.counter_for(plan.model.name))
        last = stats.last_event
        return {"messages": stats.messages, "user": stats.user_messages, "assistant": stats.assistant_messages,
                "tool": stats.tool_messages, "tokens": stats.estimated_tokens, "budget": stats.budget_tokens,
                "turns": stats.turns, "max_turns": stats.max_turns, "summary": stats.summary_present,
                "model": plan.model.name, "last_model": live.last_model,
                "last_trim": None if last is None else {
                    "strategy": str(last.strategy), "tokens_before": last.tokens_before,
                    "tokens_after": last.tokens_after}}

    def live_tool_results(self) -> set[Path]:
        """The saved tool results the live contexts still point at: the purge keeps them."""
        refs: set[Path] = set()
        for live in self.live.values():
            for m in live.ctx.messages:
                if m.truncation is not None and m.truncation.saved:
                    refs.add(live.workspace / m.truncation.path)  # resolved by the purge, off the loop
        return refs

    def in_flight(self) -> int:
        """Turns and commands running or queued: the replies a graceful stop waits for."""
        running = sum(1 for live in self.live.values() if live.worker is not None)
        return running + self.queued()

    # -- restart and shutdown -------------------------------------------------------------

    async def stop(self, timeout: float) -> None:
        """Stop intake; let running turns finish within `timeout` (they are persisted
        step by step, so a turn cut here is resumed after the restart)."""
        self._stopping = True
        workers = [live.worker for live in self.live.values() if live.worker is not None]
        if workers:
            await asyncio.wait(workers, timeout=timeout)
