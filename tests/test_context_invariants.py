"""The engine's invariants on random sessions (SPEC §4.3): whatever happens, prepare()
returns a request within budget (unless it says it cannot), with tool calls and results
paired exactly, the latest user message present verbatim (or cut with a notice), and
between steps the request only grows at its end unless a rule fired."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from context import (
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
from context.engine import Prepared
from gateway.tools.base import FileRef
from gateway.types import Message, ToolCall

COUNTER = TokenCounter("gpt-4o-mini")
SYSTEM = "You are a helpful assistant in a chat."
TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file.",
                                      "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}
]

KINDS = ("ascii", "cjk", "lines", "emoji", "crlf")


def make_text(kind: str, size: int, seed: int) -> str:
    unit = {
        "ascii": f"word{seed} and more words ",
        "cjk": "上下文窗口被塞满了工具调用返回了一大段日志。",
        "lines": f"{seed:04d} a log line with some detail\n",
        "emoji": "😀👍🏽 mixed 👩‍💻 text ",
        "crlf": f"row {seed}\r\n",
    }[kind]
    return (unit * (size // len(unit) + 1))[: max(1, size)]


TEXT = st.tuples(st.sampled_from(KINDS), st.sampled_from([5, 60, 900, 4000, 30_000, 120_000]), st.integers(0, 99))

BUDGET = st.builds(
    lambda tokens, turns, window, t1, t2: Budget(tokens, turns, window, 500, t1, t2),
    tokens=st.sampled_from([300, 1200, 4000, 12_000, 50_000, 400_000]),
    turns=st.integers(1, 12),
    window=st.sampled_from([None, None, 8192, 32_000]),
    t1=st.sampled_from([1000, 8000, 50_000]),
    t2=st.sampled_from([500, 4000, 20_000]),
)

OP = st.one_of(
    st.tuples(st.just("user"), TEXT),
    st.tuples(st.just("tools"), st.lists(TEXT, min_size=1, max_size=3), st.booleans()),
    st.tuples(st.just("reply"), TEXT),
    st.tuples(st.just("deliver")),
    st.tuples(st.just("overflow"), st.sampled_from([None, 3000, 20_000])),
    st.tuples(st.just("compact")),
    st.tuples(st.just("clear")),
)


@dataclass
class Driver:
    ctx: SessionContext
    turn: int = 0
    calls: int = 0
    pending: list = None  # effects not yet delivered
    previous: tuple[Prepared, Budget, int, str | None] | None = None

    def check(self, p: Prepared, budget: Budget, final: bool, tools: list[dict]) -> None:
        ctx = self.ctx
        assert p.messages[0] == {"role": "system", "content": SYSTEM}
        assert is_paired(p.messages)
        recount = COUNTER.count_request(p.messages, tools)
        assert p.tokens == math.ceil(recount * ctx.calibration)
        if p.user_notice is None:
            assert p.tokens <= ctx._effective_tokens(budget)
            latest = next((m for m in reversed(ctx.messages) if m.role == "user" and not m.injected), None)
            if latest is not None:
                assert any(self._is_latest(m["content"], latest.content) for m in p.messages if m["role"] == "user")
        self.pending.extend(p.effects)
        key = (ctx.current_turn, ctx.summary)
        if self.previous is not None:
            prev, prev_budget, prev_turn, prev_summary = self.previous
            same = (prev_turn, prev_summary) == key and prev_budget == budget
            if same and not p.events and not p.effects and not final:
                assert p.messages[: len(prev.messages)] == prev.messages, "prefix changed without a rule"
        self.previous = None if final else (p, budget, *key)

    def _is_latest(self, sent: str, content: str) -> bool:
        """`sent` is the user's message verbatim, or its head plus our cut notice (after
        the summary block when one is injected)."""
        if self.ctx.summary:
            sent = sent.removeprefix(injection_text(self.ctx.summary) + "\n\n")
        if sent == content:
            return True
        head, marker, _ = sent.partition("\n\n[The user's message is too long for the context")
        return bool(marker) and content.startswith(head)

    def step(self, budget: Budget, final: bool) -> None:
        tools = [] if final else TOOLS
        p = prepare(self.ctx, system_prompt=SYSTEM, tools=tools, budget=budget, counter=COUNTER, final=final)
        self.check(p, budget, final, tools)
        if final:
            assert p.messages[-1]["role"] == "user"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(ops=st.lists(st.tuples(OP, BUDGET, st.booleans()), min_size=1, max_size=40))
def test_random_sessions_keep_the_invariants(ops: list) -> None:
    driver = Driver(SessionContext("prop:1"), pending=[])
    ctx = driver.ctx
    for op, budget, final in ops:
        kind = op[0]
        if kind == "user":
            driver.turn = ctx.next_turn_number()
            ctx.append(Message("user", make_text(*op[1]), turn=driver.turn))
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
            driver.previous = None
        elif kind == "clear":
            ctx.clear()
            driver.pending.clear()
            driver.previous = None
        if ctx.messages:
            driver.step(budget, final)


@pytest.mark.parametrize("tokens", [12_000, 6000, 3000])
def test_summary_changes_mid_turn_only_with_a_trim(tokens: int) -> None:
    budget = Budget(tokens, 20, None, 500, 50_000, 2_000)
    ctx = SessionContext("prop:2")
    pending = []
    changes = 0
    for turn in range(1, 16):
        ctx.append(Message("user", f"q{turn}", turn=turn))
        injected = None
        for step in range(4):
            p = prepare(ctx, system_prompt=SYSTEM, tools=[], budget=budget, counter=COUNTER)
            pending.extend(p.effects)
            if pending and step == 1:
                effect = pending.pop(0)
                ctx.offer_summary(extractive_summary(effect), effect.upto_turn)
            first = next(m["content"] for m in p.messages if m["role"] == "user")
            now = ctx.summary if ctx.summary and first.startswith(injection_text(ctx.summary)) else None
            if step and now != injected:
                changes += 1
                assert any(e.strategy in {"turn_budget", "token_budget_halve"} for e in p.events)
            injected = now
            cid = f"c{turn}_{step}"
            ctx.append(Message("assistant", "", turn=turn, tool_calls=(ToolCall(cid, "read_file", "{}"),)))
            ctx.append(Message("tool", f"result {turn}/{step}\n" * 40, turn=turn, tool_call_id=cid))
        ctx.append(Message("assistant", f"a{turn}", turn=turn))
    assert ctx.summary is not None and changes > 0  # mid-turn halvings did bring summaries
