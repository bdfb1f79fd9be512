"""The turn loop (SPEC §5): ask context/ for the request, call the model, run the tools,
store every message as it is produced, repeat up to `agent_max_steps`, recover once from
a context overflow.

Given a `ReplyStream` (SPEC §5.1), every model call of the turn streams into it: the text
as it comes (reasoning removed, gateway/turns/streaming.py), a status line in its place when
the step turns out to call tools. The caller ends the stream with the returned text.
Without one, calls take the plain (faster) non-streamed path."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import secrets
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from context.budget import Budget
from context.effects import Prepared
from context.engine import SessionContext, prepare, recover_overflow
from context.outside import OUTSIDE_PREFIX
from context.outside import SYSTEM_NOTE as OUTSIDE_NOTE
from context.truncate import cut_tool_result
from gateway import beneath
from gateway.agents import DEFAULT as DEFAULT_AGENT
from gateway.agents import AgentView, PromptFiles, agent_view, model_chain, system_prompt_text
from gateway.beneath import PathNotAllowed
from gateway.clock import local_day
from gateway.config.schema import Config, ModelConfig
from gateway.keys import sub_turn_key
from gateway.media import FileRefused, save_tool_image
from gateway.model.errors import RETRYABLE_KINDS, ModelError
from gateway.model.replies import ModelReply
from gateway.services import Services
from gateway.skills.catalog import ALL, Skills, allowed_skills, prompt_section
from gateway.tools.base import Tool, ToolContext, ToolError, ToolOutput, files_named
from gateway.tools.delegate import Delegate
from gateway.tools.status import tool_status
from gateway.turns.live import LiveSession, SubTurn
from gateway.turns.streaming import StepFeed, clean_reply, stopped_reply
from gateway.turns.summaries import Summarizer
from gateway.types import Attachment, Message, ToolCall

if TYPE_CHECKING:
    from channels.base import ReplyStream

log = logging.getLogger("gateway.agent")

TOOL_TIMEOUT_S = 60.0  # for a tool that names no `timeout_s` of its own
TOOL_TIMEOUT_MAX_S = 600.0  # however long a tool says it may take (the turn's default timeout)
# Past a tool's own timeout: the tool's own, clearer error ("timeout_s of the MCP server
# x") comes first; this bound only catches a tool that does not keep its word.
TOOL_TIMEOUT_GRACE_S = 1.0
COUNT_OFF_LOOP_CHARS = 8192  # texts this long are counted in a worker thread
DELEGATE = "delegate"  # the tool that runs a sub-turn (SPEC §5.8)
DELEGATES_AT_ONCE = 3  # sub-turns of one step running at the same time
SUB_TURN_MAX_STEPS = 8  # a sub-turn's own step limit (at most agent_max_steps)
SUB_TURN_MAX_TOKENS = 32_000  # and its own request budget (at most agent_max_context_tokens)
SUB_TURNS_KEPT = 20  # sub-turns /context lists per session
MAX_STEP_PLANS = 256  # (agent, model) pairs whose plan is kept for the running config

OVERFLOW_CLEARED = (
    "This conversation grew larger than the model can read, even after trimming it. "
    "I have cleared the live context (everything is still stored and searchable) — "
    "please send your last message again."
)


EMPTY_REPLY = "(The model returned an empty answer. Please try again or rephrase.)"
# The result of a tool call a /stop cut short, as the model reads it next turn.
STOPPED_RESULT = "the person stopped the turn (/stop) before this call finished; it may have done part of its work"


def step_limit_reply(max_steps: int) -> str:
    """Said when even the answer-now call after the step limit gave no text."""
    return (f"I used all {max_steps} steps I may take for one message without reaching an answer. "
            "Tell me to continue, or narrow the question down.")


def tool_timeout(tool: Tool) -> float:
    """How long one call of `tool` may run: its own `timeout_s` (an MCP server's, say) plus
    a little grace, at most TOOL_TIMEOUT_MAX_S; TOOL_TIMEOUT_S when it names none."""
    own = getattr(tool, "timeout_s", None)
    if isinstance(own, bool) or not isinstance(own, int | float) or not math.isfinite(own) or own <= 0:
        return TOOL_TIMEOUT_S
    return min(float(own) + TOOL_TIMEOUT_GRACE_S, TOOL_TIMEOUT_MAX_S)


class OverBudget(Exception):
    """A model call the person's daily budget does not cover: not made; the text says
    what is left and when it resets."""


@dataclass(frozen=True, slots=True)
class TurnResult:
    text: str
    outcome: str  # ok | model_error | overflow_cleared | notice | timeout | crash | stopped | over_budget
    tokens: int = 0  # prompt + completion tokens the provider reported for this turn


def today_line(cfg: Config) -> str:
    # Only the date: a finer clock would change the prompt every call and defeat prompt caches.
    day, zone = local_day(cfg.timezone)
    return f"Today is {day} ({zone})."


def skill_names(view: AgentView, parent: AgentView | None = None) -> tuple[str, ...] | None:
    """The skills `view`'s agent may use (None: all); in a sub-turn, of those only the ones
    its delegating agent `parent` may use too."""
    names = view.skill_names()
    theirs = parent.skill_names() if parent is not None else None
    if theirs is None:
        return names
    return theirs if names is None else tuple(n for n in names if n in theirs)


@dataclass(frozen=True, slots=True)
class Step:
    """What one decision step of a session works with: its agent, the models it tries and
    the budget of the first (SPEC §5.5: budgets follow the session's model's window)."""

    view: AgentView
    chain: list[tuple[str | None, ModelConfig]]  # (alias, settings): the first, then fallbacks
    budget: Budget

    @property
    def model(self) -> ModelConfig:
        return self.chain[0][1]


class Agent:
    def __init__(self, services: Services, summarizer: Summarizer) -> None:
        self.s = services
        self.summarizer = summarizer
        self.prompt_files = PromptFiles(services.config.base_dir)
        self._steps: dict[tuple[str, str | None], tuple[Config, Step]] = {}  # (agent, model) → (snapshot, plan)
        # agent (a sub-turn's: "<agent><<parent>") → (snapshot, what its prompt is made of,
        # the prompt up to MEMORY.md)
        self._prompt_heads: dict[str, tuple[Config, tuple[Any, ...], str]] = {}
        self._prompt_with_memory: tuple[str, str, str] | None = None
        self._parents: dict[str, tuple[Config, AgentView]] = {}  # a sub-turn's delegating agent, per snapshot
        # (agent, a sub-turn's parent agent, nested) → (the registry's list, the views it was
        # made for, that agent's tools): one list per registry list and config, so token counts
        # and providers' prompt caches see the same list step after step.
        self._tool_lists: dict[tuple[str, str | None, bool], tuple[
            list[dict[str, Any]], AgentView, AgentView | None, list[dict[str, Any]]]] = {}

    def step(self, live: LiveSession, cfg: Config) -> Step:
        """The session's agent, models and budget under `cfg`: made once per config
        snapshot (a reload brings a new one), not at every decision step of every turn."""
        key = (live.agent, live.model_alias)
        known = self._steps.get(key)
        if known is not None and known[0] is cfg:
            return known[1]
        if len(self._steps) >= MAX_STEP_PLANS or (known is not None and known[0] is not cfg):
            self._steps.clear()  # a new snapshot: the plans made under the old one go
        view = agent_view(cfg, live.agent)
        chain = model_chain(cfg, view, live.model_alias)
        step = Step(view, chain, cfg.context_budget(chain[0][1]))
        self._steps[key] = (cfg, step)
        return step

    def step_parent(self, live: LiveSession, cfg: Config) -> AgentView | None:
        """A sub-turn's delegating agent under `cfg` (made once per snapshot); None for a
        session's own turn."""
        name = live.parent_agent
        if name is None:
            return None
        known = self._parents.get(name)
        if known is not None and known[0] is cfg:
            return known[1]
        if len(self._parents) >= MAX_STEP_PLANS:
            self._parents.clear()
        view = agent_view(cfg, name)
        self._parents[name] = (cfg, view)
        return view

    def _reply_tokens(self, cfg: Config, reply: ModelReply, prepared: Prepared) -> int:
        """What a call cost: the provider's count, else (a provider that reports no usage)
        the engine's count of the request, and of the answer where a daily token budget
        applies (counting it costs a tokenizer pass per step), so no budget is free."""
        prompt = reply.prompt_tokens if reply.prompt_tokens is not None else prepared.tokens
        completion = reply.completion_tokens
        if completion is None:
            completion = 0
            if cfg.limits.tokens_per_user_per_day is not None:
                written = (reply.content or "") + "".join(c.name + (c.arguments or "") for c in reply.tool_calls)
                completion = self.s.counter.count_text(written) if written else 0
        return prompt + completion

    def tool_schemas(self, view: AgentView, *, nested: bool = False,
                     parent: AgentView | None = None) -> list[dict[str, Any]]:
        """The tools `view`'s agent may use, in the registry's order (SPEC §5.5). In a
        sub-turn (`nested`) only those its delegating agent `parent` may use too, never
        `delegate` (SPEC §5.8, §5.12). `delegate` names the agents it may hand work to."""
        everything = self.s.tools.schemas()
        plain_delegate = view.name == DEFAULT_AGENT and view.delegates_to == (DEFAULT_AGENT,)
        if view.settings.tools is None and not nested and plain_delegate:
            return everything
        key = (view.name, parent.name if parent is not None else None, nested)
        cached = self._tool_lists.get(key)
        if cached is not None and cached[0] is everything and (cached[1] is view or cached[1] == view) \
                and (cached[2] is parent or cached[2] == parent):
            return cached[3]
        mine = []
        for entry in everything:
            name = str(entry.get("function", {}).get("name", ""))
            if not self._offered(view, name, nested, parent):
                continue
            if name == DELEGATE and not plain_delegate:
                entry = Delegate.schema_for(view.name, view.delegates_to)
            mine.append(entry)
        if len(self._tool_lists) >= MAX_STEP_PLANS:
            self._tool_lists.clear()
        self._tool_lists[key] = (everything, view, parent, mine)
        return mine

    @staticmethod
    def _offered(view: AgentView, tool: str, nested: bool, parent: AgentView | None = None) -> bool:
        if nested and (tool == DELEGATE or (parent is not None and not parent.tool_allowed(tool))):
            return False
        return view.tool_allowed(tool)

    def usable_skills(self, cfg: Config, agent: str, parent: str | None = None) -> Skills:
        """The skills `agent` may use (SPEC §5.6; `agents.<name>.skills`): listed in its
        prompt, readable with read_file, shown by /skills. In a sub-turn, only those its
        delegating agent `parent` may use too."""
        names = skill_names(agent_view(cfg, agent), agent_view(cfg, parent) if parent is not None else None)
        return allowed_skills(self.s.skills(), ALL if names is None else names)

    async def system_prompt(self, live: LiveSession, cfg: Config) -> str:
        view = self.step(live, cfg).view
        if view.settings.system_prompt_file is not None and view.settings.system_prompt is None:
            own = await asyncio.to_thread(system_prompt_text, cfg, view, self.prompt_files)
        else:
            own = system_prompt_text(cfg, view, self.prompt_files)
        today = today_line(cfg)
        skills = self.s.skills()
        head_key = (own, today, skill_names(view, self.step_parent(live, cfg)), skills)
        heads = live.agent if live.parent_agent is None else f"{live.agent}<{live.parent_agent}"
        known = self._prompt_heads.get(heads)
        if known is not None and known[0] is cfg and known[1] == head_key:
            head = known[2]
        else:
            parts = [own.strip(), today]
            parts.append(
                "Your workspace holds memory/ (daily notes), dialog/ (archived conversation), "
                "tool_results/ (full tool outputs) and files/ (files people sent); read them with read_file."
            )
            parts.append(OUTSIDE_NOTE)
            # Before MEMORY.md: skills change far less often, so the cached prefix lasts longer.
            section = prompt_section(self.usable_skills(cfg, live.agent, live.parent_agent))
            if section:
                parts.append(section)
            head = "\n\n".join(parts)
            if len(self._prompt_heads) >= MAX_STEP_PLANS:
                self._prompt_heads.clear()
            self._prompt_heads[heads] = (cfg, head_key, head)
        memory = self.s.memory
        if memory is not None and cfg.memory_max_tokens > 0:
            text = await memory.read_memory_md(
                live.scope, max_tokens=cfg.memory_max_tokens, count=self.s.counter.count_text
            )
            if text.strip():
                return self._with_memory(head, text)
        return head

    def _with_memory(self, head: str, text: str) -> str:
        """`head` and the scope's MEMORY.md: the same string object while neither changes, so
        the request's system message (and its JSON) is reused step after step."""
        known = self._prompt_with_memory
        if known is not None and known[0] is head and known[1] is text:
            return known[2]
        prompt = head + "\n\n## Long-term memory (MEMORY.md)\n" + text.strip()
        self._prompt_with_memory = (head, text, prompt)
        return prompt

    async def store(self, live: LiveSession, msg: Message, *, event: tuple[str, str] | None = None) -> Message:
        counter = self.s.counter
        if len(msg.content) >= COUNT_OFF_LOOP_CHARS:
            # Exact counting of a long text takes milliseconds; tiktoken releases the GIL, so
            # a worker thread keeps the loop free, and the count it caches serves prepare().
            tokens = await asyncio.to_thread(counter.count_message, msg)
        else:
            tokens = counter.count_message(msg)
        write = asyncio.ensure_future(
            self.s.store.add_message(live.key, msg, seq=live.seq, token_count=tokens, event=event))
        try:
            stored = await asyncio.shield(write)
        except asyncio.CancelledError:
            # A /stop (or a shutdown) cancels the turn: a write under way still lands, and
            # the live context takes it too, so the two agree when the stop closes the turn.
            await asyncio.wait({write})
            if not write.cancelled() and write.exception() is None:
                self._kept(live, write.result())
            raise
        self._kept(live, stored)
        return stored

    @staticmethod
    def _kept(live: LiveSession, stored: Message) -> None:
        live.last_message_id = max(live.last_message_id, stored.id or 0)
        live.seq += 1
        live.ctx.append(stored)

    async def stopped(self, live: LiveSession, by: str) -> TurnResult:
        """Close the current turn after a /stop cancelled it (SPEC §6): every tool call gets
        a result, and what the stream showed of the answer, marked, is the stored reply.
        A reply stored before the stop landed stands as it is."""
        turn = live.ctx.current_turn
        mine = [m for m in live.ctx.messages if m.turn == turn]
        if mine and mine[-1].role == "assistant" and not mine[-1].tool_calls:
            return TurnResult(mine[-1].content, "ok")
        answered = {m.tool_call_id for m in mine if m.role == "tool"}
        for m in mine:
            for call in m.tool_calls if m.role == "assistant" else ():
                if call.id not in answered:
                    await self.store(live, Message(
                        role="tool", content=f"error: {STOPPED_RESULT}", turn=turn, tool_call_id=call.id,
                        tool_name=call.name))
        shown = live.feed.shown_text if live.feed is not None else ""
        if live.step_tokens_in:
            # The provider reports no usage for a call cut short: the person's budget counts
            # what was sent and what was shown, so stopping is no way around it.
            self._charge(live, self.s.cfg, live.step_tokens_in + self.s.counter.count_text(shown))
            live.step_tokens_in = 0
        text = stopped_reply(shown)
        await self.store(live, Message(role="assistant", content=text, turn=turn))
        log.info("turn stopped", extra={"session": live.key, "by": by})
        return TurnResult(text, "stopped")

    def _apply(self, live: LiveSession, prepared: Prepared) -> None:
        for event in prepared.events:
            live.last_event = event
            live.turn_trims.append(event.strategy)
            self.s.metrics.trims.labels(event.strategy).inc()
            log.debug(  # the turn's INFO line lists the rules that fired (gateway/turns/sessions.py)
                "context rule fired",
                extra={"session": live.key, "strategy": event.strategy,
                       "tokens_before": event.tokens_before, "tokens_after": event.tokens_after},
            )
        for effect in prepared.effects:
            self.summarizer.submit(live, effect)

    def _charge(self, live: LiveSession, cfg: Config, tokens: int) -> None:
        """Tokens a call of this turn (or sub-turn) used: the turn's tally, and the person's
        day at once (SPEC §5.13: the next check sees them, a sub-turn's too)."""
        live.turn_tokens += tokens
        usage = self.s.usage
        if live.charge is not None and usage is not None:
            usage.charge(cfg, live.charge, tokens)

    async def _call_model(self, live: LiveSession, cfg: Config, step: Step, prepared: Prepared,
                          tools: list[dict[str, Any]] | None, feed: StepFeed | None = None) -> ModelReply:
        """One model call of the turn, made only when the person's budget covers it
        (raises OverBudget; gateway/turns/usage.py says what "covers" means)."""
        usage = self.s.usage
        if usage is None or live.inbound is None:
            return await self._call_chain(live, step, prepared, tools, feed)
        hold = await usage.hold(cfg, live.inbound.identity, prompt_tokens=prepared.tokens,
                                max_output_tokens=step.model.max_output_tokens)
        if hold.refusal is not None:
            raise OverBudget(hold.refusal)
        try:
            return await self._call_chain(live, step, prepared, tools, feed)
        finally:
            usage.release(cfg, hold)

    async def _call_chain(self, live: LiveSession, step: Step, prepared: Prepared,
                          tools: list[dict[str, Any]] | None, feed: StepFeed | None = None) -> ModelReply:
        """One decision step's model call: the session's model, then each fallback in turn
        when a call fails after its retries with 429, 5xx, a timeout or a refused
        connection (SPEC §5.5); streamed the same way. Never on an error that is the
        request's (a 4xx, an overflow: §4.4 handles that)."""
        messages = prepared.messages
        if self.s.media is not None:
            # The engine names image files; their bytes go in only now (SPEC §5.4).
            messages = await self.s.media.resolve_images(messages, live.workspace)
        for i, (alias, settings) in enumerate(step.chain):
            client = self.s.client_for(alias)
            try:
                async with self.s.model_slots:
                    if feed is None:
                        reply = await client.complete(messages, tools=tools or None)
                    else:
                        feed.next_step()
                        reply = await client.complete(messages, tools=tools or None,
                                                      on_text=feed.text, on_retry=feed.retry)
            except ModelError as err:
                if i + 1 >= len(step.chain) or err.kind not in RETRYABLE_KINDS:
                    raise
                following = step.chain[i + 1][1].name
                self.s.metrics.model_fallbacks.labels(settings.name, following).inc()
                log.warning("model failed; trying the fallback", extra={
                    "session": live.key, "model": settings.name, "fallback": following, "kind": err.kind})
                if feed is not None:
                    await feed.retry()  # what the failed model showed goes; the fallback's comes
                continue
            live.last_model = settings.name
            return reply
        raise AssertionError("a model chain is never empty")

    async def run_turn(self, live: LiveSession, stream: ReplyStream | None = None) -> TurnResult:
        """Run the current turn (its user message is already stored) to a final reply.
        With `stream`, the reply is shown as it is produced (append/status only: the
        caller finishes or fails the stream with the result's text). A call the person's
        budget cannot cover is not made: the turn ends saying what is left (SPEC §5.13)."""
        feed = live.feed = StepFeed(stream) if stream is not None else None
        live.turn_tokens = live.turn_tokens_in = live.turn_tokens_out = live.turn_steps = 0
        live.step_tokens_in = live.turn_delegates = 0
        live.turn_trims = []
        try:
            return await self._decide(live, feed)
        except OverBudget as stop:
            live.step_tokens_in = 0
            log.info("model call refused: over the daily budget", extra={"session": live.key})
            return TurnResult(str(stop), "over_budget")

    async def _decide(self, live: LiveSession, feed: StepFeed | None) -> TurnResult:
        recovered = False
        step = 0
        while True:
            cfg = self.s.cfg  # the snapshot of this decision step (hot reload applies here)
            step += 1
            live.turn_steps = step
            # Steps 1..agent_max_steps may call tools; when the last of them still asked
            # for one, this extra step has no tools and must answer (SPEC §1, §5).
            max_steps = cfg.agent_max_steps if live.sub_limits is None else live.sub_limits[0]
            final = step > max_steps
            plan = self.step(live, cfg)
            nested = live.sub_limits is not None
            parent = self.step_parent(live, cfg)
            tools = [] if final else self.tool_schemas(plan.view, nested=nested, parent=parent)
            budget = plan.budget  # the session's model's window (SPEC §5.5)
            if live.sub_limits is not None:  # a sub-turn's own budget (SPEC §5.8)
                budget = replace(budget, max_tokens=min(budget.max_tokens, live.sub_limits[1]))
            counter = self.s.counter_for(plan.model.name)
            system = await self.system_prompt(live, cfg)
            prepared = prepare(live.ctx, system_prompt=system, tools=tools, budget=budget,
                               counter=counter, final=final)
            self._apply(live, prepared)
            if prepared.user_notice:
                return TurnResult(prepared.user_notice, "notice")
            live.step_tokens_in = prepared.tokens
            try:
                reply = await self._call_model(live, cfg, plan, prepared, tools, feed)
            except ModelError as err:
                if err.kind != "overflow":
                    log.warning("model error", extra={"session": live.key, "kind": err.kind,
                                                      "detail": err.detail[:300]})
                    return TurnResult(err.user_message(), "model_error")
                if recovered:
                    return await self._clear_after_overflow(live)
                recovered = True
                outcome = await self._recover(live, cfg, plan, system, tools, err, feed)
                if outcome is None:
                    return await self._clear_after_overflow(live)
                if isinstance(outcome, ModelError):
                    # The retry failed for another reason (rate limit, outage…): say that one.
                    log.warning("model error on the overflow retry", extra={
                        "session": live.key, "kind": outcome.kind, "detail": outcome.detail[:300]})
                    return TurnResult(outcome.user_message(), "model_error")
                reply, prepared = outcome
            live.step_tokens_in = 0
            self._charge(live, cfg, self._reply_tokens(cfg, reply, prepared))
            live.turn_tokens_in += reply.prompt_tokens or 0
            live.turn_tokens_out += reply.completion_tokens or 0
            if reply.prompt_tokens:
                live.ctx.calibrate(prepared.tokens, reply.prompt_tokens)
                self.s.metrics.tokens.labels("in").inc(reply.prompt_tokens)
            if reply.completion_tokens:
                self.s.metrics.tokens.labels("out").inc(reply.completion_tokens)
            calls = () if final else reply.tool_calls
            if not calls:
                # Exactly what the stream showed of this step: the same filter, whole.
                text = clean_reply(reply.content)
                if feed is not None:
                    await feed.end()
                if not text:
                    text = step_limit_reply(max_steps) if final else EMPTY_REPLY
                await self.store(live, Message(role="assistant", content=text, turn=live.ctx.current_turn))
                return TurnResult(text, "ok")
            if feed is not None:
                # The step's text was not the answer: the person sees what runs instead.
                await feed.status(tool_status(calls, self.s.tools.get))
            # Kept as the model wrote it (reasoning included): models that think between
            # tool calls expect to read their thoughts back within the turn.
            await self.store(live, Message(role="assistant", content=reply.content or "", turn=live.ctx.current_turn,
                                           tool_calls=tuple(calls)))
            await self._run_tools(live, cfg, calls)

    async def _recover(
        self, live: LiveSession, cfg: Config, plan: Step, system: str, tools: list[dict[str, Any]],
        err: ModelError, feed: StepFeed | None = None,
    ) -> tuple[ModelReply, Prepared] | ModelError | None:
        """SPEC §4.4: summarize all to memory, trim aggressively, retry the step once.
        None when the retry overflows again; the error when it fails otherwise."""
        log.warning("context overflow; recovering", extra={"session": live.key,
                                                          "provider_limit": err.provider_limit})
        prepared = recover_overflow(live.ctx, system_prompt=system, tools=tools,
                                    budget=cfg.context_budget(plan.model),
                                    counter=self.s.counter_for(plan.model.name), provider_limit=err.provider_limit)
        self._apply(live, prepared)
        try:
            reply = await self._call_model(live, cfg, plan, prepared, tools, feed)
        except ModelError as again:
            if again.kind == "overflow":
                self.s.metrics.overflow_recoveries.labels("cleared").inc()
                return None
            return again
        self.s.metrics.overflow_recoveries.labels("recovered").inc()
        return reply, prepared

    async def _clear_after_overflow(self, live: LiveSession) -> TurnResult:
        turn = live.ctx.current_turn
        live.ctx.clear()
        # The next turn starts a fresh live context, also after a restart.
        live.context_start = turn + 1
        await self.s.store.set_context_start(live.key, turn + 1)
        await self.store(live, Message(role="assistant", content=OVERFLOW_CLEARED, turn=turn))
        return TurnResult(OVERFLOW_CLEARED, "overflow_cleared")

    async def _run_tools(self, live: LiveSession, cfg: Config, calls: tuple[ToolCall, ...]) -> None:
        """One step's tool calls, their results stored in call order. `delegate` calls run at
        the same time, at most DELEGATES_AT_ONCE (SPEC §5.8); the others one after another."""
        slots = asyncio.Semaphore(DELEGATES_AT_ONCE)

        async def delegated(call: ToolCall) -> tuple[ToolOutput, str]:
            async with slots:
                return await self._execute(live, cfg, call)

        done = self._past_delegate_caps(live, cfg, calls)
        running = {i: asyncio.ensure_future(delegated(call)) for i, call in enumerate(calls)
                   if call.name == DELEGATE and live.sub_limits is None and i not in done}
        try:
            for i, call in enumerate(calls):
                if i not in running and i not in done:
                    done[i] = await self._execute(live, cfg, call)
            for i, task in running.items():
                done[i] = await task
        finally:
            for task in running.values():
                task.cancel()  # a stopped turn stops its sub-turns too
            await asyncio.gather(*running.values(), return_exceptions=True)
        for i, call in enumerate(calls):
            await self._record_tool(live, cfg, call, *done[i])

    def _past_delegate_caps(self, live: LiveSession, cfg: Config,
                            calls: tuple[ToolCall, ...]) -> dict[int, tuple[ToolOutput, str]]:
        """The results of this step's `delegate` calls past `tools.delegate.max_per_step` or
        past the turn's `max_per_turn`: never run (each sub-turn is a turn's worth of calls)."""
        if live.sub_limits is not None or not any(call.name == DELEGATE for call in calls) \
                or not self.step(live, cfg).view.tool_allowed(DELEGATE):
            return {}
        caps = cfg.tools.delegate
        refused: dict[int, tuple[ToolOutput, str]] = {}
        in_step = 0
        for i, call in enumerate(calls):
            if call.name != DELEGATE:
                continue
            if live.turn_delegates >= caps.max_per_turn:
                why = (f"this message has run {caps.max_per_turn} delegate calls, the most one message may "
                       "(tools.delegate.max_per_turn); do the rest yourself")
            elif in_step >= caps.max_per_step:
                why = (f"at most {caps.max_per_step} delegate calls run in one step (tools.delegate.max_per_step); "
                       "ask for this one again in a later step")
            else:
                in_step += 1
                live.turn_delegates += 1
                continue
            refused[i] = (ToolOutput(f"error: not run: {why}"), "capped")
        return refused

    async def _record_tool(self, live: LiveSession, cfg: Config, call: ToolCall, output: ToolOutput,
                           outcome: str) -> None:
        saved = await self._save_images(live, cfg, output)
        self.s.metrics.tool_calls.labels(call.name if self.s.tools.get(call.name) else "unknown", outcome).inc()
        # Providers reuse ids like "call_0"; the saved file name must stay unique in the scope.
        file_id = f"{hashlib.sha1(live.key.encode()).hexdigest()[:8]}_t{live.ctx.current_turn}_{call.id}"
        text = "\n".join(t for t in (output.text, *(line for _, line in saved)) if t)
        cut = cut_tool_result(text, call_id=file_id, limit=cfg.tool_result_max_chars,
                              file_ref=output.file_ref, save_over=cfg.history_tool_result_max_chars)
        if cut.save is not None:
            try:
                await asyncio.to_thread(beneath.replace, live.workspace, cut.save.path,
                                        cut.save.text.encode("utf-8"))
            except (OSError, PathNotAllowed) as err:
                log.error("cannot save a tool result", extra={"session": live.key, "error": str(err)})
        await self.store(live, Message(role="tool", content=cut.content, turn=live.ctx.current_turn,
                                       tool_call_id=call.id, tool_name=call.name, truncation=cut.truncation,
                                       attachments=tuple(att for att, _ in saved if att is not None),
                                       origin=f"{OUTSIDE_PREFIX}{output.source}" if output.source else None))

    async def _save_images(self, live: LiveSession, cfg: Config,
                           output: ToolOutput) -> list[tuple[Attachment | None, str]]:
        """Each image the tool returned, saved under files/ (SPEC §5.2): the attachment
        (shown to a model with vision, context/images.py) and the line naming the file."""
        out: list[tuple[Attachment | None, str]] = []
        for image in output.images:
            try:
                att, line = await save_tool_image(live.workspace, image.name, image.mime, image.data,
                                                  cfg.limits.max_inbound_file_bytes)
            except (FileRefused, PathNotAllowed, OSError) as err:
                out.append((None, f"[image from the tool, not saved: {err}]"))
                continue
            out.append((att if att.is_image else None, line))
        return out

    async def delegate(self, parent: LiveSession, task: str, agent: str | None) -> ToolOutput:
        """A sub-turn (SPEC §5.8): a fresh context holding only `task`, the named agent's tools
        and skills (default: the parent's agent) without `delegate`, its own step limit and
        token budget. Its messages are stored under `<session key>#sub:<n>`, apart from the
        session's turns; its tokens count toward the person's budget as its calls are made.
        It has none of the tools (and skills) the parent's agent lacks, and goes only to an
        agent the parent's agent may hand work to (`agents.<name>.delegates`, SPEC §5.12)."""
        cfg = self.s.cfg
        name = agent or parent.agent
        mine = self.step(parent, cfg).view
        if name != "default" and name not in cfg.agents:
            raise ToolError(f"there is no agent {name!r}; you may hand work to: {', '.join(mine.delegates_to)}")
        if name not in mine.delegates_to:
            raise ToolError(f"agent {parent.agent!r} may not hand work to {name!r} "
                            f"(agents.{parent.agent}.delegates); you may hand work to: {', '.join(mine.delegates_to)}")
        # Unique per call, also across restarts; the parent's turn names where it came from.
        key = sub_turn_key(parent.key, parent.ctx.current_turn, secrets.token_hex(4))
        await self.s.store.ensure_session(key, parent.scope, parent.channel)
        sub = LiveSession(key=key, scope=parent.scope, channel=parent.channel, workspace=parent.workspace,
                          ctx=SessionContext(key), agent=name, inbound=parent.inbound,
                          sub_limits=(min(cfg.agent_max_steps, SUB_TURN_MAX_STEPS),
                                      min(cfg.agent_max_context_tokens, SUB_TURN_MAX_TOKENS)),
                          parent_agent=parent.agent, charge=parent.charge)
        await self.store(sub, Message(role="user", content=task, turn=sub.ctx.next_turn_number(), origin=DELEGATE))
        try:
            result = await self.run_turn(sub)
        except asyncio.CancelledError:
            if sub.step_tokens_in:  # a call cut short (a /stop): what was sent counts too
                self._charge(sub, cfg, sub.step_tokens_in)
            parent.turn_tokens += sub.turn_tokens
            raise
        parent.turn_tokens += sub.turn_tokens
        parent.turn_tokens_in += sub.turn_tokens_in
        parent.turn_tokens_out += sub.turn_tokens_out
        parent.sub_turns.append(SubTurn(key=key, task=task, agent=name, steps=sub.turn_steps,
                                        tokens=sub.turn_tokens, outcome=result.outcome))
        del parent.sub_turns[:-SUB_TURNS_KEPT]
        log.info("sub-turn ended", extra={"session": parent.key, "sub": key, "agent": name,
                                           "steps": sub.turn_steps, "tokens": sub.turn_tokens,
                                           "outcome": result.outcome})
        if result.outcome != "ok":
            raise ToolError(f"the sub-agent did not finish ({result.outcome}): {result.text}")
        return ToolOutput(result.text)

    async def _execute(self, live: LiveSession, cfg: Config, call: ToolCall) -> tuple[ToolOutput, str]:
        view = self.step(live, cfg).view
        nested = live.sub_limits is not None
        parent = self.step_parent(live, cfg)
        allowed = self._offered(view, call.name, nested, parent)
        tool = self.s.tools.get(call.name) if allowed else None
        if tool is None:
            known = ", ".join(name for name in self.s.tools.names if self._offered(view, name, nested, parent))
            return ToolOutput(f"error: there is no tool named {call.name!r}; available: {known}"), "unknown"
        try:
            args = json.loads(call.arguments or "{}")
            if not isinstance(args, dict):
                raise ValueError("arguments must be a JSON object")
        except (ValueError, TypeError) as err:
            return ToolOutput(f"error: the arguments are not a valid JSON object ({err}); call the tool again"), \
                "bad_arguments"
        approvals = self.s.approvals
        if approvals is not None and live.inbound is not None and approvals.needed(cfg, call.name):
            # Asked before each call, outside the tool's own timeout: a person takes what it takes.
            verdict = await approvals.ask(session=live.key, turn=live.ctx.current_turn, inbound=live.inbound,
                                          tool=call.name, arguments=call.arguments, workspace=live.workspace,
                                          names=files_named(tool, args))
            if not verdict.allowed:
                return ToolOutput(f"error: the call was not run. {verdict.note}"), "denied"
        async def delegate(task: str, agent: str | None) -> ToolOutput:
            return await self.delegate(live, task, agent)

        ctx = ToolContext(session_key=live.key, scope=live.scope, workspace=live.workspace, config=cfg,
                          memory=self.s.memory, tasks=self.s.tasks, inbound=live.inbound,
                          skills=self.usable_skills(cfg, live.agent, live.parent_agent),
                          delegate=delegate if not nested else None)
        timeout = tool_timeout(tool)
        try:
            out = await asyncio.wait_for(tool.run(args, ctx), timeout=timeout)
            return out, "ok"
        except ToolError as err:
            return ToolOutput(f"error: {err}"), "error"
        except TimeoutError:
            return ToolOutput(f"error: {call.name} did not finish within {timeout:g} s"), "timeout"
        except Exception:
            log.exception("tool failed", extra={"session": live.key, "tool": call.name})
            return ToolOutput(f"error: {call.name} failed unexpectedly"), "crash"
