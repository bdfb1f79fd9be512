"""The engine's invariants on random sessions (SPEC §4.3): whatever happens, prepare()
returns a request within budget (unless it says it cannot) — recounted with tiktoken
directly, not with the engine's counter, and images by OpenAI's tile rule written out
again here —, with tool calls and results paired exactly, the latest user message
present verbatim (or cut with a notice), every halving dropping exactly the earliest half
of the complete turns, images shown only in the current and the last two historical
turns (placeholders elsewhere, SPEC §5.4), and between steps the request only grows at
its end unless a rule fired."""

from __future__ import annotations

import base64
import functools
import json
import math
import random
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import pytest
import tiktoken
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from context import (
    FINAL_INSTRUCTION,
    Budget,
    SessionContext,
    TokenCounter,
    compact,
    cut_tool_result,
    extractive_summary,
    injection_text,
    is_paired,
    prepare,
    recover_overflow,
)
from context.budget import framing_margin
from context.effects import Prepared
from context.tokens import (
    IMAGE_TOKENS,
    MESSAGE_OVERHEAD,
    OFFLINE_ENCODING,
    REQUEST_OVERHEAD,
    TOOL_CALL_OVERHEAD,
    TOOL_RESULT_OVERHEAD,
    TOOL_SCHEMA_OVERHEAD,
)
from context.truncate import FileRef
from gateway.types import Attachment, Message, ToolCall

COUNTER = TokenCounter("gpt-4o-mini")
SYSTEM = "You are a helpful assistant in a chat."
TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file.",
                                      "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}
]

# -- texts: English, Chinese, code, base64, emoji, random Unicode, and mixes of them -------

KINDS = ("english", "chinese", "code", "base64", "emoji", "unicode", "crlf", "mixed", "patchy", "patchy")
_WORDS = ("the", "deploy", "failed", "because", "token", "budget", "of", "session", "gateway", "retry",
          "error:", "path/to/file.py", "and", "then", "we", "fixed", "it", "quickly", "summary")
_EMOJI = ("😀", "👍🏽", "👩‍💻", "🇯🇵", "🎉", "❤️", "👨‍👩‍👧‍👦", "🙂", "✅", " ", "\n")
_PIECES = ("english", "chinese", "code", "base64", "emoji", "unicode")


def _piece(kind: str, size: int, rng: random.Random) -> str:
    if kind == "english":
        out = " ".join(rng.choice(_WORDS) for _ in range(size // 4 + 1))
        return out.replace(" then ", ". Then ").replace(" and ", ",\nand ")
    if kind == "chinese":
        # Random CJK ideographs (dense: often 2+ tokens each), with some punctuation.
        return "".join("，" if rng.random() < 0.05 else chr(rng.randint(0x4E00, 0x9FA5)) for _ in range(size))
    if kind == "code":
        lines = [f"    x{rng.randint(0, 999)} = call_{rng.randint(0, 99)}(arg, {rng.random():.6f})  # step"
                 for _ in range(size // 50 + 1)]
        return "def handler(arg):\n" + "\n".join(lines)
    if kind == "base64":
        return base64.b64encode(rng.randbytes(size * 3 // 4 + 3)).decode()
    if kind == "emoji":
        return "".join(rng.choice(_EMOJI) for _ in range(size // 2 + 1))
    if kind == "unicode":
        # Any scalar value (no surrogates: a str from a channel is valid Unicode).
        chars = []
        while len(chars) < size:
            cp = rng.randint(0x20, 0x10FFFF) if rng.random() < 0.7 else rng.randint(0x20, 0x2FFF)
            if not 0xD800 <= cp <= 0xDFFF:
                chars.append(chr(cp))
        return "".join(chars)
    raise ValueError(kind)


@functools.lru_cache(maxsize=512)
def make_text(kind: str, size: int, seed: int) -> str:
    """A deterministic text of about `size` chars (cached: hypothesis asks for the same ones)."""
    size = max(1, size)
    rng = random.Random(f"{kind}/{size}/{seed}")
    if kind == "crlf":
        return "".join(f"row {i} 数据 ✅\r\n" for i in range(size // 12 + 1))[:size]
    if kind == "patchy":
        # English prose with dense patches (Chinese, random Unicode, emoji) at random
        # places: what a sampled estimate misses when its windows fall between them.
        parts = []
        left = size
        while left > 0:
            n = min(left, rng.randint(20, 1500))
            dense = rng.random() < 0.35
            parts.append(_piece(rng.choice(("chinese", "unicode", "emoji")) if dense else "english", n, rng)[:n])
            left -= n
        return "".join(parts)
    if kind != "mixed":
        return _piece(kind, size, rng)[:size]
    # Segments of random kinds and lengths: token density changes along the text.
    parts: list[str] = []
    left = size
    while left > 0:
        n = min(left, rng.choice((1, 40, 300, 2000, 9000)))
        parts.append(_piece(rng.choice(_PIECES), n, rng)[:n])
        left -= n
    return "".join(parts)


TEXT = st.tuples(st.sampled_from(KINDS), st.sampled_from([5, 60, 900, 2049, 4000, 30_000, 120_000]),
                 st.integers(0, 40))

# -- the oracle: tiktoken run directly over the whole request -------------------------------

ENCODING = tiktoken.get_encoding(OFFLINE_ENCODING)
assert COUNTER.encoding_name == OFFLINE_ENCODING  # the encoder the engine must count with here


@functools.lru_cache(maxsize=1024)
def exact(text: str) -> int:
    return len(ENCODING.encode_ordinary(text))


def oracle_image_tokens(width: int, height: int) -> int:
    """OpenAI's published rule for an image at high detail, in exact arithmetic: fit in
    2048 x 2048, shrink until the short side is 768, then 85 + 170 per 512-px tile."""
    w, h = Fraction(width), Fraction(height)
    longest = max(w, h)
    if longest > 2048:
        w, h = w * 2048 / longest, h * 2048 / longest
    shortest = min(w, h)
    if shortest > 768:
        w, h = w * 768 / shortest, h * 768 / shortest
    return 85 + 170 * math.ceil(w / 512) * math.ceil(h / 512)


def exact_request(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> int:
    """The request's exact token count: every text encoded by tiktoken itself, plus the
    framing constants documented in context/tokens.py (and docs/context.md), and each
    image by the tile rule (a part without a size: the flat IMAGE_TOKENS)."""
    total = REQUEST_OVERHEAD
    for msg in messages:
        content = msg.get("content") or ""
        if isinstance(content, list):
            for part in content:
                if part.get("type") == "text":
                    continue
                sized = "width" in part and "height" in part
                total += oracle_image_tokens(part["width"], part["height"]) if sized else IMAGE_TOKENS
            content = "".join(str(part.get("text", "")) for part in content if part.get("type") == "text")
        total += MESSAGE_OVERHEAD + exact(content)
        for call in msg.get("tool_calls") or ():
            fn = call["function"]
            total += TOOL_CALL_OVERHEAD + exact(call["id"]) + exact(fn["name"]) + exact(fn["arguments"])
        if msg.get("tool_call_id") is not None:
            total += TOOL_RESULT_OVERHEAD + exact(msg["tool_call_id"])
    if tools:
        schema = json.dumps(tools, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
        total += exact(schema) + TOOL_SCHEMA_OVERHEAD * len(tools)
    return total


BUDGET = st.builds(
    lambda tokens, turns, window, t1, t2, vision: Budget(tokens, turns, window, 500, t1, t2, vision=vision),
    tokens=st.sampled_from([300, 1200, 4000, 12_000, 50_000, 400_000]),
    turns=st.integers(1, 12),
    window=st.sampled_from([None, None, 8192, 32_000]),
    t1=st.sampled_from([1000, 8000, 50_000]),
    t2=st.sampled_from([500, 4000, 20_000]),
    vision=st.booleans(),
)

# Images a person sends with a message: sizes of the copies the gateway makes (at most
# 1568 px on the longest side), odd ones included.
IMAGE_SIZE = st.tuples(st.sampled_from([1, 300, 512, 513, 768, 1000, 1568]),
                       st.sampled_from([1, 200, 511, 768, 1176, 1568]))

OP = st.one_of(
    st.tuples(st.just("user"), TEXT),
    st.tuples(st.just("photo"), TEXT, st.lists(IMAGE_SIZE, min_size=1, max_size=3)),
    st.tuples(st.just("tools"), st.lists(TEXT, min_size=1, max_size=3), st.booleans()),
    st.tuples(st.just("reply"), TEXT),
    st.tuples(st.just("deliver")),
    st.tuples(st.just("overflow"), st.sampled_from([None, 3000, 20_000])),
    st.tuples(st.just("compact")),
    st.tuples(st.just("clear")),
    st.tuples(st.just("calibrate"), st.sampled_from([0.6, 0.9, 1.3, 1.8])),
)


def halved(turns: int, current_live: bool) -> int:
    """How many turns a halving drops: the earliest half of the complete turns, rounded up
    (the current turn, when live, is never complete nor dropped)."""
    return math.ceil((turns - (1 if current_live else 0)) / 2)


@dataclass
class Driver:
    ctx: SessionContext
    turn: int = 0
    calls: int = 0
    vision: bool = False  # the budget of the step being checked
    pending: list = None  # effects not yet delivered
    previous: tuple[Prepared, Budget, int, str | None] | None = None
    last_tokens: int = 0
    asked_upto: int = 0  # the highest turn any summary effect asked for so far

    def check(self, p: Prepared, budget: Budget, final: bool, tools: list[dict]) -> None:
        ctx = self.ctx
        assert p.messages[0] == {"role": "system", "content": SYSTEM}
        assert is_paired(p.messages)
        # Recounted exactly by tiktoken itself, scaled by the session's calibration: the
        # engine never counts lower, and (it counts exactly) not higher either.
        truth = math.ceil(exact_request(p.messages, tools) * ctx.calibration)
        assert p.tokens >= truth, f"the engine under-counted: {p.tokens} < exact {truth}"
        assert p.tokens == truth
        if p.user_notice is None:
            assert truth <= ctx._effective_tokens(budget)
            # …and leaves the framing margin free (a provider's framing differs a little).
            limit = ctx._effective_tokens(budget)
            assert truth <= limit - framing_margin(limit)
            # Uncalibrated too: calibration only ever scales counts up.
            assert exact_request(p.messages, tools) <= ctx._effective_tokens(budget)
            latest = next((m for m in reversed(ctx.messages) if m.role == "user" and not m.injected), None)
            if latest is not None:
                assert any(self._is_latest(m["content"], latest) for m in p.messages if m["role"] == "user")
        self._check_images(p, budget)
        # A delivered summary is used at once: no request lacks a dropped turn's summary
        # once one covering it has arrived, and every dropped turn has been asked for.
        known = max(ctx.summary_upto_turn, ctx._pending[1] if ctx._pending else 0)
        assert ctx.summary_upto_turn >= min(ctx._dropped_upto, known)
        asked = max([e.upto_turn for e in p.effects] + [self.asked_upto])
        assert asked >= ctx._dropped_upto or ctx._dropped_upto <= ctx._cleared_upto
        self.asked_upto = asked
        live_current = ctx._current() is not None  # the engine's current turn: never dropped
        for event in p.events:
            if event.strategy == "token_budget_halve":  # one halving per event
                assert event.turns_after == event.turns_before - halved(event.turns_before, live_current)
            elif event.strategy == "turn_budget":  # halvings until within the turn limit
                n = event.turns_before
                while n > max(1, budget.max_turns):
                    n -= halved(n, live_current)
                assert event.turns_after == n
        self.last_tokens = p.tokens
        self.pending.extend(p.effects)
        key = (ctx.current_turn, ctx.summary)
        if self.previous is not None:
            prev, prev_budget, prev_turn, prev_summary = self.previous
            same = (prev_turn, prev_summary) == key and prev_budget == budget
            if same and not p.events and not p.effects and not final:
                assert p.messages[: len(prev.messages)] == prev.messages, "prefix changed without a rule"
        self.previous = None if final else (p, budget, *key)

    def _is_latest(self, sent: str | list[dict[str, Any]], latest: Message) -> bool:
        """`sent` is the user's message verbatim, or its head plus our cut notice (after
        the summary block when one is injected); its images as parts, or as placeholder
        lines after the text when they did not fit."""
        content = latest.content
        if isinstance(sent, list):
            refs = [p["image_url"]["url"] for p in sent[1:]]
            if refs != [f"workspace:{a.preview}" for a in latest.attachments]:
                return False
            sent = sent[0]["text"]
        elif latest.attachments and self.vision:
            lines = "".join(f"\n[earlier image, no longer shown: {a.path}]" for a in latest.attachments)
            if not sent.endswith(lines):
                return False
            sent = sent[: len(sent) - len(lines)]
        if self.ctx.summary:
            sent = sent.removeprefix(injection_text(self.ctx.summary) + "\n\n")
        if sent == content:
            return True
        head, marker, _ = sent.partition("\n\n[The user's message is too long for the context")
        return bool(marker) and content.startswith(head)

    def _check_images(self, p: Prepared, budget: Budget) -> None:
        """Image parts only with vision, only in the current and the last two historical
        turns, and each one an image of its message; older images stand as placeholders."""
        users = [m for m in p.messages if m["role"] == "user" and m["content"] != FINAL_INSTRUCTION]
        with_parts = [i for i, m in enumerate(users) if isinstance(m["content"], list)]
        if not budget.vision:
            assert not with_parts
            return
        for i in with_parts:
            assert i >= len(users) - 3, "an image part outside the last three turns"
            for part in users[i]["content"][1:]:
                assert part["image_url"]["url"].startswith("workspace:files/img_")
        for msg in users[:-3]:
            assert isinstance(msg["content"], str)
            if "[image: files/img_" in msg["content"]:
                assert "[earlier image, no longer shown: files/img_" in msg["content"]

    def step(self, budget: Budget, final: bool) -> None:
        self.vision = budget.vision
        tools = [] if final else TOOLS
        p = prepare(self.ctx, system_prompt=SYSTEM, tools=tools, budget=budget, counter=COUNTER, final=final)
        self.check(p, budget, final, tools)
        if final:
            assert p.messages[-1]["role"] == "user"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(ops=st.lists(st.tuples(OP, BUDGET, st.booleans()), min_size=1, max_size=40))
def test_random_sessions_keep_the_invariants(ops: list) -> None:
    run_session(ops)


# Sessions where people mostly send pictures to a model with vision: long enough, and with
# budgets roomy enough, that several turns with images stay live.
PHOTO_OP = st.one_of(
    st.tuples(st.just("photo"), st.tuples(st.sampled_from(KINDS), st.sampled_from([5, 60, 900]), st.integers(0, 5)),
              st.lists(IMAGE_SIZE, min_size=1, max_size=2)),
    st.tuples(st.just("reply"), st.tuples(st.just("english"), st.sampled_from([5, 200]), st.integers(0, 5))),
    st.tuples(st.just("user"), st.tuples(st.just("english"), st.just(60), st.integers(0, 5))),
    st.tuples(st.just("tools"), st.lists(TEXT, min_size=1, max_size=2), st.booleans()),
    st.tuples(st.just("deliver")),
    st.tuples(st.just("compact")),
)
VISION_BUDGET = st.builds(
    lambda tokens, turns, vision: Budget(tokens, turns, None, 500, 8000, 4000, vision=vision),
    tokens=st.sampled_from([1500, 6000, 50_000, 400_000]),
    turns=st.integers(2, 12),
    vision=st.sampled_from([True, True, True, False]),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(ops=st.lists(st.tuples(PHOTO_OP, VISION_BUDGET, st.booleans()), min_size=4, max_size=30))
def test_random_sessions_with_images_keep_the_invariants(ops: list) -> None:
    run_session(ops)


def run_session(ops: list) -> None:
    driver = Driver(SessionContext("prop:1"), pending=[])
    ctx = driver.ctx
    for op, budget, final in ops:
        kind = op[0]
        if kind == "user":
            driver.turn = ctx.next_turn_number()
            ctx.append(Message("user", make_text(*op[1]), turn=driver.turn))
        elif kind == "photo":
            driver.turn = ctx.next_turn_number()
            images = tuple(
                Attachment(name=f"img_{driver.turn}_{i}.jpg", path=f"files/img_{driver.turn}_{i}.jpg", kind="image",
                           width=w, height=h, preview=f"files/img_{driver.turn}_{i}.jpg", size=1)
                for i, (w, h) in enumerate(op[2]))
            notes = "".join(f"\n[image: {a.path}, {a.width}×{a.height}]" for a in images)
            ctx.append(Message("user", make_text(*op[1]) + notes, turn=driver.turn, attachments=images))
        elif kind == "tools" and driver.turn:
            calls = []
            for _spec in op[1]:
                driver.calls += 1
                calls.append(ToolCall(f"call_{driver.calls}", "read_file", '{"path": "x.md"}'))
            ctx.append(Message("assistant", "", turn=driver.turn, tool_calls=tuple(calls)))
            for tc, spec in zip(calls, op[1], strict=True):
                text = make_text(*spec)
                ref = FileRef("notes/x.md", 0, 1, protected=True) if op[2] else None
                cut = cut_tool_result(text, call_id=tc.id, limit=budget.tool_result_max_chars, file_ref=ref,
                                      save_over=budget.history_tool_result_max_chars)
                ctx.append(Message("tool", cut.content, turn=driver.turn, tool_call_id=tc.id,
                                   truncation=cut.truncation))
        elif kind == "reply" and driver.turn:
            ctx.append(Message("assistant", make_text(*op[1]), turn=driver.turn))
        elif kind == "deliver" and driver.pending:
            effect = driver.pending.pop(0)
            ctx.offer_summary(extractive_summary(effect), effect.upto_turn)
        elif kind == "overflow" and ctx.messages:
            driver.vision = budget.vision
            p = recover_overflow(ctx, system_prompt=SYSTEM, tools=TOOLS, budget=budget, counter=COUNTER,
                                 provider_limit=op[1])
            driver.previous = None
            driver.check(p, budget, False, TOOLS)
            driver.previous = None
            continue
        elif kind == "compact":
            effect = compact(ctx, keep_turns=2)
            if effect is not None:
                driver.pending.append(effect)
                driver.asked_upto = max(driver.asked_upto, effect.upto_turn)
            driver.previous = None
        elif kind == "calibrate" and driver.last_tokens:
            # The provider reported a different prompt size for the last request.
            ctx.calibrate(driver.last_tokens, max(1, round(driver.last_tokens * op[1])))
            driver.previous = None
        elif kind == "clear":
            ctx.clear()
            driver.pending.clear()
            driver.previous = None
        if ctx.messages:
            driver.step(budget, final)


@pytest.mark.parametrize("tokens", [12_000, 6000, 3000])
def test_summary_changes_mid_turn_only_with_a_trim_or_to_fill_a_gap(tokens: int) -> None:
    """Mid-turn the injected summary changes only with a trim, or when the request before
    lacked a summary of some dropped turn (the summary then lands at the next step)."""
    budget = Budget(tokens, 20, None, 500, 50_000, 2_000)
    ctx = SessionContext("prop:2")
    pending = []
    for turn in range(1, 16):
        ctx.append(Message("user", f"q{turn}", turn=turn))
        injected = None
        gap = False
        for step in range(4):
            p = prepare(ctx, system_prompt=SYSTEM, tools=[], budget=budget, counter=COUNTER)
            pending.extend(p.effects)
            if pending and step == 1:
                effect = pending.pop(0)
                ctx.offer_summary(extractive_summary(effect), effect.upto_turn)
            first = next(m["content"] for m in p.messages if m["role"] == "user")
            now = ctx.summary if ctx.summary and first.startswith(injection_text(ctx.summary)) else None
            if step and now != injected:
                trimmed = any(e.strategy in {"turn_budget", "token_budget_halve"} for e in p.events)
                assert trimmed or gap, "the summary changed mid-turn with no trim and no gap to fill"
            injected = now
            gap = ctx._dropped_upto > ctx.summary_upto_turn
            cid = f"c{turn}_{step}"
            ctx.append(Message("assistant", "", turn=turn, tool_calls=(ToolCall(cid, "read_file", "{}"),)))
            ctx.append(Message("tool", f"result {turn}/{step}\n" * 40, turn=turn, tool_call_id=cid))
        ctx.append(Message("assistant", f"a{turn}", turn=turn))
    assert ctx.summary is not None  # summaries were used (mid-turn or with the trims)
