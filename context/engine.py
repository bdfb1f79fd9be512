"""The context engine: the exact request for each decision step (SPEC §4.1–4.4).

`SessionContext` is the live context of one session, a cache rebuildable from the store.
`prepare()` runs before every decision step and applies, in order: stage-2 truncation of
historical tool results, the turn budget, summary injection, the token budget (compress,
halve, cut the current turn), then asks for the summaries of the turns the next drop
will take (ahead of it), and returns the request plus the effects the shell performs
(summaries to write). Rules change the context only forward: dropped turns never come
back, compressed turns stay compressed, and every cut is a pure function of the message,
so between two steps a request changes only at its end unless a rule fires, or a summary
arrives for turns that already left (SPEC §4.2, §5).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from gateway.types import HOOK_ORIGIN_PREFIX, Attachment, Message

from .budget import Budget, framing_margin
from .effects import Prepared, Strategy, SummarizeTurns, SummaryReason, TrimEvent
from .images import (
    IMAGE_HISTORY_TURNS,
    images_of,
    images_tokens,
    tool_images_message,
    with_images,
    with_placeholders,
)
from .outside import outside_block, outside_source
from .stats import ContextStats
from .summary import injection_text
from .tokens import MESSAGE_OVERHEAD, REQUEST_OVERHEAD, TokenCounter
from .truncate import Kind, excerpt_length, shorten
from .turns import pair_tool_messages, starts_turn, text_only, to_openai

log = logging.getLogger(__name__)

__all__ = [
    "Prepared",
    "SessionContext",
    "SummarizeTurns",
    "TrimEvent",
    "compact",
    "context_stats",
    "prepare",
    "recover_overflow",
]

HALVING_MIN_TURNS = 5  # below this the token budget compresses instead of halving (§4.3)
# Past this share of the budget a token halving is near: the summary of the turns it can
# drop is asked now, so that it is ready when the halving fires (SPEC §4.2 timing).
HIGH_WATER_SHARE = 0.75
# An ask ahead of a drop covers at least this many new turns; a smaller range waits (a
# later ask covers it too) unless the turn budget is about to drop it or it left already.
MIN_SUMMARY_TURNS = 3
OVERFLOW_TOOL_CHARS = 10_000  # §4.4 aggressive trim
OVERFLOW_USER_CHARS = 10_000
OVERFLOW_TURNS = 5
MIN_CUT_TOKENS = 250  # the current turn's items keep at least this many tokens…
MIN_CUT_TOKENS_FLOOR = 40  # …or a quarter of a tiny budget, down to this
FALLBACK_USER_CHARS = 1000
NOTICE_ALLOWANCE_CHARS = 700  # a cut adds a notice of about this size
MAX_CUT_ROUNDS = 200
# Never below 1: a provider that counts fewer tokens than tiktoken must not let a request
# grow past the budget by tiktoken's exact count (SPEC §4.3's invariant).
CALIBRATION_MIN = 1.0
CALIBRATION_MAX = 2.0
CALIBRATION_WEIGHT = 0.5  # smoothing: half old factor, half the new observation
UNDELIVERED_MAX_TURNS = 100  # dropped turns kept for their summary; the store has them anyway
ImageMode = Literal["parts", "placeholders", "text"]  # how a turn's images are sent (SPEC §5.4)

FINAL_INSTRUCTION = (
    "[Gateway: this turn has reached its step limit. Do not call any tools now. Give your "
    "final answer to the user with what you have, and say what is still missing, if anything.]"
)


@dataclass(slots=True)
class _Rendered:
    dicts: list[dict[str, Any]]
    tokens: int
    saved: int  # tokens stage 2 removed


@dataclass(slots=True, eq=False)
class _Turn:
    number: int
    messages: list[Message]  # as sent (text-only once compressed)
    has_user: bool
    original: list[Message] | None = None  # the full turn, kept for its summary once compressed
    hist_key: tuple[int, int, int, str] | None = None
    hist: _Rendered | None = None
    # (id(msg), limit, kind, image mode) -> (msg, dict, tokens); the msg pins the id while cached
    cache: dict[tuple[int, int | None, str, str], tuple[Message, dict[str, Any], int]] = field(
        default_factory=dict
    )
    stage2_seen: bool = False
    images: bool = False  # its user message or a tool result carries images (SPEC §5.4)

    @property
    def raw(self) -> list[Message]:
        return self.original if self.original is not None else self.messages

    def changed(self) -> None:
        self.hist_key = None
        self.hist = None


class SessionContext:
    """Live context of one session: a cache rebuildable from the store. Holds the live
    messages (from the context start, minus dropped turns), the current summary, the
    per-session calibration, and caches that make prepare() incremental."""

    def __init__(
        self,
        session_key: str,
        messages: Sequence[Message] = (),
        summary: str | None = None,
        summary_upto_turn: int = 0,
        *,
        last_turn: int = 0,
    ) -> None:
        self.session_key = session_key
        self.summary = summary
        self.summary_upto_turn = summary_upto_turn if summary else 0
        self.last_event: TrimEvent | None = None
        self._turns: list[_Turn] = []
        self._view: list[Message] | None = []
        self._last_number = max(last_turn, self.summary_upto_turn)
        self._max_seen = self._last_number
        self._pending: tuple[str, int] | None = None
        self._requested_upto = self.summary_upto_turn  # highest turn any effect covers
        self._high_water_drop = -1  # _dropped_upto when the token high-water mark last asked
        self._undelivered: list[_Turn] = []  # dropped turns no delivered summary covers
        self._caps: dict[int, tuple[Message, int]] = {}  # id(msg) -> (msg, kept chars)
        self._caps_version = 0
        self._calibration = 1.0
        self._provider_limit: tuple[int, int | None] | None = None
        self._inject_cache: tuple[str, dict[str, Any], dict[str, Any], int] | None = None
        self._system: dict[str, Any] | None = None  # the last request's system message
        self._dropped_upto = 0  # highest turn number no longer live
        self._cleared_upto = 0  # turns up to this were cleared (/context clear, overflow)
        self._version = 0  # bumped by every change that can alter a request
        for msg in messages:
            self.append(msg)
        first = next((t.number for t in self._turns if t.has_user), None)
        self._dropped_upto = max(self.summary_upto_turn, (first - 1) if first else 0)

    # -- the live messages --------------------------------------------------------------

    @property
    def messages(self) -> list[Message]:
        if self._view is None:
            self._view = [m for t in self._turns for m in t.messages]
        return self._view

    def append(self, msg: Message) -> None:
        """Add a message as the agent produced and stored it."""
        self._version += 1
        self._max_seen = max(self._max_seen, msg.turn)
        if starts_turn(msg):
            number = msg.turn if msg.turn > self._last_number else self._last_number + 1
            self._last_number = number
            self._turns.append(_Turn(number, [msg], True, images=bool(images_of(msg))))
        elif not self._turns:
            self._turns.append(_Turn(msg.turn or self._last_number, [msg], False))
        else:
            turn = self._turns[-1]
            turn.messages.append(msg)
            turn.images = turn.images or bool(images_of(msg))
            if turn.original is not None:
                turn.original.append(msg)
            turn.changed()
        if self._view is not None:
            self._view.append(msg)

    @property
    def current_turn(self) -> int:
        """Turn number of the latest user message (0 if none)."""
        turn = self._current()
        return turn.number if turn is not None else 0

    def next_turn_number(self) -> int:
        return max(self._last_number, self._max_seen) + 1

    @property
    def turn_count(self) -> int:
        return len(self._turns)

    @property
    def calibration(self) -> float:
        return self._calibration

    @property
    def summary_pending(self) -> bool:
        return self._pending is not None

    def _current(self) -> _Turn | None:
        if self._turns and self._turns[-1].has_user:
            return self._turns[-1]
        return None

    def _dirty(self) -> None:
        self._view = None
        self._version += 1

    # -- summaries ----------------------------------------------------------------------

    def offer_summary(self, text: str, upto_turn: int) -> None:
        """A background summary of turns <= upto_turn is ready. It is injected by the next
        prepare() that lacks a summary of some dropped turn — the next decision step, in
        the middle of a turn too: a request without a dropped turn and its summary is the
        one thing worse than a changed prefix. While every dropped turn is covered it waits
        for the trim that drops the turns it covers, and lands in the same request.
        Dropped turns stay dropped. Stale offers (covering no more than what is already
        known) are ignored."""
        known = max(self.summary_upto_turn, self._cleared_upto, self._pending[1] if self._pending else 0)
        if upto_turn <= known or not text.strip():
            return
        self._pending = (text, upto_turn)
        self._undelivered = [t for t in self._undelivered if t.number > upto_turn]

    def _delivered_upto(self) -> int:
        return max(self.summary_upto_turn, self._pending[1] if self._pending else 0)

    def _latest_summary(self) -> str | None:
        return self._pending[0] if self._pending else self.summary

    def _activate_pending(self) -> bool:
        """Put a delivered summary in place when turns were dropped that the current one
        does not cover (a request would lack them and their summary otherwise)."""
        if self._pending is None or self._dropped_upto <= self.summary_upto_turn:
            return False
        self.summary, self.summary_upto_turn = self._pending
        self._pending = None
        self._version += 1
        return True

    def _drop(self, count: int) -> list[_Turn]:
        """Drop the earliest `count` turns (never the current one); they are kept for
        their summary until one covers them."""
        keep_current = 1 if self._current() is not None else 0
        count = max(0, min(count, len(self._turns) - keep_current))
        dropped = self._turns[:count]
        if not dropped:
            return []
        del self._turns[:count]
        delivered = self._delivered_upto()
        for turn in dropped:
            for msg in turn.messages:
                self._caps.pop(id(msg), None)
            turn.cache.clear()
            turn.changed()
            if turn.number > delivered:
                self._undelivered.append(turn)
        del self._undelivered[:-UNDELIVERED_MAX_TURNS]
        self._dropped_upto = max(self._dropped_upto, *(t.number for t in dropped))
        self._dirty()
        return dropped

    def _compress(self, turn: _Turn) -> None:
        """Reduce a historical turn to its user text and final reply, for good; the full
        turn is kept for its summary."""
        turn.original = list(turn.messages)
        turn.messages = text_only(turn.messages)
        kept = {id(m) for m in turn.messages}
        for msg in turn.original:
            if id(msg) not in kept:
                self._caps.pop(id(msg), None)
        turn.cache.clear()
        turn.changed()

    def _effect(self, reason: SummaryReason, upto: int, *, force: bool = False) -> SummarizeTurns | None:
        """A SummarizeTurns for everything not yet delivered up to `upto`, dropped turns and
        live ones (asked ahead of their drop, or an overflow). None when an earlier effect
        already asked for it."""
        if upto <= self._requested_upto and not force:
            return None
        delivered = self._delivered_upto()
        live = [t for t in self._turns if delivered < t.number <= upto]
        turns = [t for t in self._undelivered if t.number <= upto] + live
        messages = tuple(m for t in turns for m in t.raw)
        if not messages:
            return None
        new_from = self._requested_upto + 1
        self._requested_upto = max(self._requested_upto, upto)
        return SummarizeTurns(
            session_key=self.session_key,
            messages=messages,
            previous_summary=self._latest_summary(),
            upto_turn=upto,
            reason=reason,
            new_from_turn=new_from,
        )

    # -- lifecycle ----------------------------------------------------------------------

    def clear(self) -> None:
        """/context clear, /new, a second overflow: empty live context, no summary."""
        self._turns.clear()
        self._view = []
        self.summary = None
        self.summary_upto_turn = 0
        self._pending = None
        self._undelivered.clear()
        self._caps.clear()
        self._caps_version += 1
        self._inject_cache = None
        top = max(self._last_number, self._max_seen)
        self._requested_upto = self._dropped_upto = top
        self._cleared_upto = top  # a summary still on its way covers cleared turns: ignore it
        self.last_event = None
        self._version += 1

    def calibrate(self, estimated_tokens: int, reported_prompt_tokens: int) -> None:
        """The provider's usage.prompt_tokens for a request we counted (pass
        Prepared.tokens). Later counts are scaled by a smoothed, bounded factor: the
        budget is in the provider's tokens, and its tokenizer may differ from ours."""
        if estimated_tokens <= 0 or reported_prompt_tokens <= 0:
            return
        raw = estimated_tokens / self._calibration
        target = min(CALIBRATION_MAX, max(CALIBRATION_MIN, reported_prompt_tokens / raw))
        factor = self._calibration + CALIBRATION_WEIGHT * (target - self._calibration)
        self._calibration = min(CALIBRATION_MAX, max(CALIBRATION_MIN, factor))

    def _effective_tokens(self, budget: Budget) -> int:
        limit = budget.effective_tokens
        if self._provider_limit is not None:
            reported, window = self._provider_limit
            if window == budget.context_window:
                room = reported - budget.max_output_tokens
                limit = min(limit, room if room > 0 else max(1, reported * 3 // 4))
        return limit

    def _cap_of(self, msg: Message) -> int | None:
        entry = self._caps.get(id(msg))
        return entry[1] if entry is not None and entry[0] is msg else None

    def _set_cap(self, msg: Message, chars: int) -> None:
        old = self._cap_of(msg)
        if old is None or chars < old:
            self._caps[id(msg)] = (msg, chars)
            self._version += 1


class _Request:
    """One request being built: rendering, counting and the rules of §4."""

    def __init__(
        self,
        ctx: SessionContext,
        system_prompt: str,
        tools: list[dict[str, Any]],
        budget: Budget,
        counter: TokenCounter,
        final: bool,
    ) -> None:
        self.ctx = ctx
        self.system_prompt = system_prompt
        self.tools = tools
        self.budget = budget
        self.counter = counter
        self.final = final
        self.budget_tokens = ctx._effective_tokens(budget)
        self.limit = self.budget_tokens - framing_margin(self.budget_tokens)  # what requests fill
        self.omit_injection = False
        self.omit_current_images = False  # the current turn's images did not fit: placeholders
        self.stage2_saved = 0
        self._memo: tuple[tuple[int, bool, bool, float], int] | None = None
        self.fixed = (
            REQUEST_OVERHEAD
            + MESSAGE_OVERHEAD
            + counter.count_text(system_prompt)
            + counter.count_tools(tools)
            + (counter.count_dict(_final_message()) if final else 0)
        )

    # -- rendering ----------------------------------------------------------------------

    def _stage2_limit(self, msg: Message) -> int:
        history = self.budget.history_tool_result_max_chars
        trunc = msg.truncation
        if trunc is not None and trunc.protected:
            # Markdown read with read_file: doubled, and never below stage 1's cap.
            return max(2 * history, 2 * self.budget.tool_result_max_chars)
        return history

    def image_mode(self, turn: _Turn) -> ImageMode:
        """How `turn` shows its images (SPEC §5.4): as parts with vision, in the current
        turn and the last IMAGE_HISTORY_TURNS historical ones; as placeholders elsewhere
        with vision; as the stored text alone without it."""
        if not self.budget.vision or not turn.images:
            return "text"  # a turn without images renders (and caches) the same either way
        turns = self.ctx._turns
        cur = self.ctx._current()
        if turn is cur:
            return "placeholders" if self.omit_current_images else "parts"
        recent = turns[-(IMAGE_HISTORY_TURNS + (1 if cur is not None else 0)):]
        return "parts" if any(t is turn for t in recent) else "placeholders"

    def _message(self, turn: _Turn, msg: Message, historical: bool, show: ImageMode) -> tuple[dict[str, Any], int]:
        limit: int | None = None
        kind: Kind = "history"
        if msg.role == "tool" and not msg.injected:
            cap = self.ctx._cap_of(msg)
            if historical:
                limit = self._stage2_limit(msg)
            if cap is not None and (limit is None or cap < limit):
                limit, kind = cap, "budget"
        elif starts_turn(msg):
            limit = self.ctx._cap_of(msg)
            kind = "user"
        elif msg.role == "assistant":
            limit = self.ctx._cap_of(msg)
            kind = "budget"
        key = (id(msg), limit, kind, show)
        hit = turn.cache.get(key)
        if hit is not None and hit[0] is msg:
            return hit[1], hit[2]
        content = msg.content
        if limit is not None:
            trunc = msg.truncation if msg.role == "tool" else None
            content = shorten(msg.content, trunc, limit, kind=kind)
        images = images_of(msg) if show != "text" else ()
        if images and show == "placeholders":
            content = with_placeholders(content, images)
        source = outside_source(msg.origin) if msg.role == "tool" else None
        if source is not None:
            content = outside_block(source, content)
        shown = msg if content is msg.content else replace(msg, content=content)
        d, tokens = to_openai(msg, content), self.counter.count_message(shown)
        if images and show == "parts" and msg.role == "user":  # a tool's images follow its step's results
            d["content"] = with_images(content, images)
            tokens += images_tokens(images)
        rendered = (d, tokens)
        if not msg.injected:  # stand-in results are new objects each time: not cached
            turn.cache[key] = (msg, *rendered)
        return rendered

    def render(self, turn: _Turn, historical: bool) -> _Rendered:
        show = self.image_mode(turn)
        if historical:
            key = (
                self.budget.history_tool_result_max_chars,
                self.budget.tool_result_max_chars,
                self.ctx._caps_version,
                show,
            )
            if turn.hist_key == key and turn.hist is not None:
                return turn.hist
        dicts: list[dict[str, Any]] = []
        tokens = saved = 0
        shown: list[Attachment] = []  # images of this step's tool results, sent after the last one
        for msg in pair_tool_messages(turn.messages):
            if shown and msg.role != "tool":
                tokens += self._tool_images(dicts, shown)
            d, t = self._message(turn, msg, historical, show)
            dicts.append(d)
            tokens += t
            if historical and d["content"] is not msg.content and msg.role == "tool":
                saved += self._message(turn, msg, False, show)[1] - t
            if show == "parts" and msg.role == "tool":
                shown.extend(images_of(msg))
        if shown:
            tokens += self._tool_images(dicts, shown)
        rendered = _Rendered(dicts, tokens, saved)
        if historical:
            turn.hist_key, turn.hist = key, rendered
            turn.cache.clear()  # the turn is final now: its per-message entries are done
            if not turn.stage2_seen:
                turn.stage2_seen = True
                self.stage2_saved += saved
        return rendered

    def _tool_images(self, dicts: list[dict[str, Any]], images: list[Attachment]) -> int:
        """Append the user message showing `images` (emptied after); its tokens."""
        d = tool_images_message(tuple(images))
        images.clear()
        dicts.append(d)
        return self.counter.count_dict(d)

    def _injection(self, first: dict[str, Any]) -> tuple[dict[str, Any], int]:
        """The first kept user message with the summary in front, and the extra tokens."""
        summary = self.ctx.summary or ""
        cached = self.ctx._inject_cache
        if cached is not None and cached[0] is summary and cached[1] is first:
            return cached[2], cached[3]
        block = injection_text(summary) + "\n\n"
        content = first.get("content")
        if isinstance(content, list):  # text first, then images (context/images.py)
            parts = [{**content[0], "text": block + str(content[0].get("text", ""))}, *content[1:]]
            injected = {**first, "content": parts}
        else:
            injected = {**first, "content": block + (content or "")}
        extra = self.counter.count_dict(injected) - self.counter.count_dict(first)
        self.ctx._inject_cache = (summary, first, injected, extra)
        return injected, extra

    def _first_user(self) -> dict[str, Any] | None:
        if not self.ctx.summary or self.omit_injection:
            return None
        cur = self.ctx._current()
        for turn in self.ctx._turns:
            for d in self.render(turn, turn is not cur).dicts:
                if d["role"] == "user":
                    return d
        return None

    def raw_tokens(self) -> int:
        cur = self.ctx._current()
        total = self.fixed
        for turn in self.ctx._turns:
            total += self.render(turn, turn is not cur).tokens
        first = self._first_user()
        if first is not None:
            total += self._injection(first)[1]
        return total

    def total(self) -> int:
        """The request as it stands: exact count × calibration, rounded up (memoized per state)."""
        key = (self.ctx._version, self.omit_injection, self.omit_current_images, self.ctx._calibration)
        if self._memo is not None and self._memo[0] == key:
            return self._memo[1]
        total = math.ceil(self.raw_tokens() * self.ctx._calibration)
        self._memo = (key, total)
        return total

    def assemble(self) -> list[dict[str, Any]]:
        system = self.ctx._system
        if system is None or system["content"] != self.system_prompt:
            # The same dict while the prompt stays the same: callers may remember what
            # they made of a message by its identity (its JSON, gateway/model/transport.py).
            system = self.ctx._system = {"role": "system", "content": self.system_prompt}
        out: list[dict[str, Any]] = [system]
        cur = self.ctx._current()
        for turn in self.ctx._turns:
            out.extend(self.render(turn, turn is not cur).dicts)
        first = self._first_user()
        if first is not None:
            injected = self._injection(first)[0]
            index = next(i for i, d in enumerate(out) if d is first)
            out[index] = injected
        if self.final:
            out.append(_final_message())
        return out

    # -- rules --------------------------------------------------------------------------

    def _halving_count(self) -> int:
        """How many of the earliest turns a halving drops: exactly the earliest half of
        the complete turns, rounded up — n // 2 of n turns while the current turn (never
        complete, never dropped) is live, (n + 1) // 2 otherwise. Whole turns go, so
        tool-call chains stay whole. A prefetched summary lands with the halving when it
        covers these same turns; when it covers fewer (asked at a smaller turn count), the
        halving still drops its half and the rest is asked for (SPEC §4.2)."""
        ctx = self.ctx
        complete = len(ctx._turns) - (1 if ctx._current() is not None else 0)
        return (complete + 1) // 2

    def turn_budget(self, events: list[TrimEvent]) -> bool:
        max_turns = max(1, self.budget.max_turns)
        ctx = self.ctx
        if len(ctx._turns) <= max_turns:
            return False
        before, turns_before = self.total(), len(ctx._turns)
        while len(ctx._turns) > max_turns and ctx._drop(self._halving_count()):
            pass
        ctx._activate_pending()  # the prefix changes anyway: a ready summary lands now
        events.append(TrimEvent("turn_budget", before, self.total(), turns_before, len(ctx._turns)))
        return True

    def ask_ahead(self, effects: list[SummarizeTurns]) -> None:
        """Ask for the summary of turns as soon as they are certain to be dropped, so it is
        there when they go (SPEC §4.2 timing).

        No single halving drops more than the earliest K = ceil(max_turns / 2) complete
        turns (the turn budget drops exactly those when the session passes its limit; a
        token halving, with at most max_turns − 1 complete turns, never more). Once those
        K are complete they are asked for at once — the turn budget drops them many turns
        later, and any token halving before that drops a part of them. Before they are
        complete (early in a session, or after a token halving left fewer), the request
        passing HIGH_WATER_SHARE of the budget says a token halving is near: every complete
        turn among them is asked for then, once per drop (a halving up to twice as many
        turns later still drops only covered ones). A summary that covers a turn still live
        costs nothing in the request: the turn is shown twice until it goes.

        Ranges stay worth a call: an ask covers at least MIN_SUMMARY_TURNS new turns,
        except for the turns the turn budget drops next."""
        ctx = self.ctx
        reach = (max(1, self.budget.max_turns) + 1) // 2
        # The open turn, if any, is the last one; turns are in ascending order, so the new
        # ones are a tail (counted from the end: this runs on every request).
        complete = ctx._turns[: min(reach, len(ctx._turns) - (ctx._current() is not None))]
        if not complete:
            return
        upto = complete[-1].number
        new = 0
        for t in reversed(complete):
            if t.number <= ctx._requested_upto:
                break
            new += 1
        if len(complete) == reach:
            ready = new > 0  # the turn budget drops these next: asked however few are new
        else:
            ready = (
                new >= MIN_SUMMARY_TURNS
                and len(ctx._turns) >= HALVING_MIN_TURNS
                and ctx._high_water_drop != ctx._dropped_upto  # once per drop
                and self.total() > HIGH_WATER_SHARE * self.limit
            )
        if ready:
            effect = ctx._effect("prefetch", upto)
            if effect is not None:
                if len(complete) < reach:
                    ctx._high_water_drop = ctx._dropped_upto
                effects.append(effect)

    def token_budget(self, events: list[TrimEvent]) -> bool:
        """Shrink until the request fits; True when something was dropped."""
        ctx = self.ctx
        dropped = False
        total = self.total()
        while total > self.limit:
            n = len(ctx._turns)
            cur = ctx._current()
            history = [t for t in ctx._turns if t is not cur]
            squeezable = [t for t in history if len(text_only(t.messages)) < len(t.messages)]
            if n >= HALVING_MIN_TURNS or (history and not squeezable):
                if not ctx._drop(self._halving_count()):
                    return dropped
                dropped = True
                ctx._activate_pending()
                strategy: Strategy = "token_budget_halve"
            elif squeezable:
                for turn in squeezable:
                    ctx._compress(turn)
                ctx._dirty()
                strategy = "compress_history"
            else:
                return dropped
            after = self.total()
            events.append(TrimEvent(strategy, total, after, n, len(ctx._turns)))
            total = after
        return dropped

    def cut_current_turn(self, events: list[TrimEvent]) -> bool:
        """The current turn alone is over: cut its largest tool results, then the agent's
        own long texts, then leave out the summary, then its images (placeholders stand
        in), then cut the user's text. True when it fits in the end."""
        ctx = self.ctx
        cur = ctx._current()
        before = total = self.total()
        if cur is None or self.fixed * ctx._calibration > self.limit:
            return total <= self.limit
        for _ in range(MAX_CUT_ROUNDS):
            if total <= self.limit:
                break
            target = self._largest_cuttable(cur)
            if target is None:
                if ctx.summary and not self.omit_injection:
                    self.omit_injection = True
                    total = self.total()
                    continue
                if self._current_images_shown(cur):
                    self.omit_current_images = True
                    total = self.total()
                    continue
                break
            msg, kept, tokens, floor = target
            excess_raw = (total - self.limit) / ctx._calibration
            need = math.ceil(excess_raw * kept / max(1, tokens) * 1.1) + NOTICE_ALLOWANCE_CHARS
            ctx._set_cap(msg, max(floor, kept - need))
            total = self.total()
        if total != before:
            events.append(TrimEvent("cut_current_turn", before, total, 1, 1))
        return total <= self.limit

    def _current_images_shown(self, cur: _Turn) -> bool:
        return self.image_mode(cur) == "parts" and any(images_of(m) for m in cur.messages)

    def _kept_chars(self, msg: Message) -> int:
        kept = excerpt_length(msg.content, msg.truncation if msg.role == "tool" else None)
        cap = self.ctx._cap_of(msg)
        return min(kept, cap) if cap is not None else kept

    def _largest_cuttable(self, cur: _Turn) -> tuple[Message, int, int, int] | None:
        """(message, kept chars, tokens, floor chars) of the item to cut next, largest
        first within: tool results, the agent's texts, then (summary and images left out)
        the user's."""
        floor_tokens = max(MIN_CUT_TOKENS_FLOOR, min(MIN_CUT_TOKENS, self.limit // 4))
        groups: list[list[Message]] = [[], [], []]
        for msg in cur.messages:
            if msg.injected:
                continue
            if msg.role == "tool":
                groups[0].append(msg)
            elif msg.role == "assistant" and msg.content:
                groups[1].append(msg)
            elif starts_turn(msg):
                groups[2].append(msg)
        for index, group in enumerate(groups):
            if index == 2 and (
                (self.ctx.summary and not self.omit_injection) or self._current_images_shown(cur)
            ):
                return None
            best: tuple[Message, int, int, int] | None = None
            for msg in group:
                kept = self._kept_chars(msg)
                tokens = self._message(cur, msg, False, self.image_mode(cur))[1]
                floor = max(1, math.ceil(floor_tokens * kept / max(1, tokens)))
                if kept > floor and (best is None or tokens > best[2]):
                    best = (msg, kept, tokens, floor)
            if best is not None:
                return best
        return None


def _final_message() -> dict[str, Any]:
    return {"role": "user", "content": FINAL_INSTRUCTION}


def _too_big_notice(tokens: int, limit: int, fixed: int) -> str:
    if fixed > limit:
        return (
            f"I can't answer right now: my instructions and tools alone take about {fixed} tokens, "
            f"more than this chat's context budget of {limit} tokens. An admin needs to raise "
            "agent_max_context_tokens (or shorten the system prompt)."
        )
    return (
        f"Your message is too long for me to handle: even cut down it needs about {tokens} tokens, "
        f"more than this chat's context budget of {limit} tokens. Please send a shorter message "
        "(or split it), or ask an admin to raise agent_max_context_tokens."
    )


def _run(req: _Request) -> Prepared:
    ctx = req.ctx
    events: list[TrimEvent] = []
    effects: list[SummarizeTurns] = []
    turns_now = len(ctx._turns)
    first_total = req.total()  # renders historical turns: stage 2 applies here
    if req.stage2_saved:
        saved = math.ceil(req.stage2_saved * ctx._calibration)
        events.append(TrimEvent("stage2", first_total + saved, first_total, turns_now, turns_now))
    reason: SummaryReason | None = None
    if req.turn_budget(events):
        reason = "turn_budget"
    # A summary delivered since the last step fills a gap now, at any step of a turn.
    ctx._activate_pending()
    if req.token_budget(events) and reason is None:
        reason = "token_budget"
    fits = req.total() <= req.limit or req.cut_current_turn(events)
    if ctx._dropped_upto > ctx._requested_upto:
        # Turns left that no summary was asked for (no ask was in time, or a restore): now.
        effect = ctx._effect(reason or "restore", ctx._dropped_upto)
        if effect is not None:
            effects.append(effect)
    req.ask_ahead(effects)
    tokens = req.total()
    notice = None if fits else _too_big_notice(tokens, req.limit, math.ceil(req.fixed * ctx._calibration))
    if events:
        ctx.last_event = events[-1]
    return Prepared(req.assemble(), tokens, effects, events, notice)


def _fallback(
    ctx: SessionContext,
    system_prompt: str,
    tools: list[dict[str, Any]],
    budget: Budget,
    counter: TokenCounter,
) -> Prepared:
    """Last resort after an internal error: the system prompt and the latest user text."""
    try:
        limit = ctx._effective_tokens(budget)
        user = next((m for m in reversed(ctx.messages) if starts_turn(m)), None)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system_prompt}]
        if user is not None:
            text = user.content
            chars = max(FALLBACK_USER_CHARS, limit * 2)
            messages.append({"role": "user", "content": shorten(text, None, chars, kind="user")})
        tokens = math.ceil(counter.count_request(messages, tools) * ctx._calibration)
        notice = None if tokens <= limit else _too_big_notice(tokens, limit, tokens)
        return Prepared(messages, tokens, [], [], notice)
    except Exception:
        log.exception("context engine fallback failed for %s", ctx.session_key)
        return Prepared(
            [{"role": "system", "content": system_prompt}], 0, [], [],
            "Something went wrong while preparing this conversation; please try again.",
        )


def prepare(
    ctx: SessionContext,
    *,
    system_prompt: str,
    tools: list[dict[str, Any]],
    budget: Budget,
    counter: TokenCounter,
    final: bool = False,
) -> Prepared:
    """The request for the next decision step. Never raises.

    final=True: the step cap was reached; pass tools=[]: a short instruction asking for
    the final answer is appended to the request (never stored).
    """
    try:
        return _run(_Request(ctx, system_prompt, tools, budget, counter, final))
    except Exception:
        log.exception("context engine failed for %s; sending the latest user message only", ctx.session_key)
        return _fallback(ctx, system_prompt, tools, budget, counter)


def recover_overflow(
    ctx: SessionContext,
    *,
    system_prompt: str,
    tools: list[dict[str, Any]],
    budget: Budget,
    counter: TokenCounter,
    provider_limit: int | None = None,
) -> Prepared:
    """SPEC §4.4 (1)+(2): summarize all current messages, trim aggressively (tool results
    and user text <= 10,000 chars, the last 5 turns), and rebuild the request. A
    provider-reported limit replaces the budget (for this and later requests while the
    model's window is unchanged). The caller retries once; on a second overflow it calls
    ctx.clear() and tells the user."""
    try:
        req = _Request(ctx, system_prompt, tools, budget, counter, False)
        before, turns_before = req.total(), len(ctx._turns)
        upto = max([t.number for t in ctx._turns] + [ctx._dropped_upto])
        effect = ctx._effect("overflow", upto, force=True)
        if provider_limit is not None and provider_limit > 0:
            ctx._provider_limit = (provider_limit, budget.context_window)
        if len(ctx._turns) > OVERFLOW_TURNS:
            ctx._drop(len(ctx._turns) - OVERFLOW_TURNS)
        for turn in ctx._turns:
            for msg in turn.messages:
                if msg.role == "tool" and excerpt_length(msg.content, msg.truncation) > OVERFLOW_TOOL_CHARS:
                    ctx._set_cap(msg, OVERFLOW_TOOL_CHARS)
                elif starts_turn(msg) and len(msg.content) > OVERFLOW_USER_CHARS:
                    ctx._set_cap(msg, OVERFLOW_USER_CHARS)
            turn.changed()
        ctx._caps_version += 1
        ctx._version += 1
        trimmed = _Request(ctx, system_prompt, tools, budget, counter, False)
        event = TrimEvent("overflow_trim", before, trimmed.total(), turns_before, len(ctx._turns))
        ctx.last_event = event
        result = prepare(ctx, system_prompt=system_prompt, tools=tools, budget=budget, counter=counter)
        effects = ([effect] if effect is not None else []) + result.effects
        return Prepared(result.messages, result.tokens, effects, [event, *result.events], result.user_notice)
    except Exception:
        log.exception("overflow recovery failed for %s", ctx.session_key)
        return _fallback(ctx, system_prompt, tools, budget, counter)


def compact(
    ctx: SessionContext, *, keep_turns: int = 2, counter: TokenCounter | None = None
) -> SummarizeTurns | None:
    """/compact: drop all but the last `keep_turns` turns now and summarize them. The
    summary is injected from the next turn on. None when there is nothing to compact.
    With `counter` the event's token figures are counted, else estimated from chars."""
    keep_turns = max(0, keep_turns)
    if len(ctx._turns) <= keep_turns:
        return None

    def size() -> int:
        if counter is None:
            return sum(len(m.content) for m in ctx.messages) // 4
        return sum(counter.count_message(m) for m in ctx.messages)

    before, turns_before = size(), len(ctx._turns)
    ctx._drop(len(ctx._turns) - keep_turns)
    effect = ctx._effect("compact", ctx._dropped_upto, force=True)
    ctx.last_event = TrimEvent("compact", before, size(), turns_before, len(ctx._turns))
    return effect


def context_stats(
    ctx: SessionContext,
    *,
    system_prompt: str,
    tools: list[dict[str, Any]],
    budget: Budget,
    counter: TokenCounter,
) -> ContextStats:
    """What /context shows; changes nothing in the context."""
    msgs = ctx.messages
    roles = {"user": 0, "assistant": 0, "tool": 0}
    for msg in msgs:
        if msg.role in roles:
            roles[msg.role] += 1
    try:
        tokens = _Request(ctx, system_prompt, tools, budget, counter, False).total()
    except Exception:
        log.exception("context stats failed for %s", ctx.session_key)
        tokens = -1
    return ContextStats(
        session_key=ctx.session_key,
        messages=len(msgs),
        user_messages=roles["user"],
        assistant_messages=roles["assistant"],
        tool_messages=roles["tool"],
        total_chars=sum(len(m.content) for m in msgs),
        estimated_tokens=tokens,
        budget_tokens=ctx._effective_tokens(budget),
        turns=len(ctx._turns),
        max_turns=budget.max_turns,
        summary_present=bool(ctx.summary),
        summary_upto_turn=ctx.summary_upto_turn,
        summary_pending=ctx.summary_pending,
        calibration=ctx.calibration,
        encoding=counter.encoding_name,
        last_event=ctx.last_event,
        task_messages=sum(1 for m in msgs if m.role == "user" and m.origin == "task"),
        hook_messages=sum(1 for m in msgs if m.role == "user" and (m.origin or "").startswith(HOOK_ORIGIN_PREFIX)),
    )
