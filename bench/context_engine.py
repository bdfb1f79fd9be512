"""How the cost of prepare() grows with a session's size.

    python bench/context_engine.py

For sessions of 10 / 100 / 1,000 / 5,000 messages (a turn is a user message, a tool
call, its result and a reply; every fourth result is a large one, cut at stage 1), it
times prepare() with warm caches, alone and as a decision step (append a tool call and
its result, prepare), against a naive full re-tokenization of the same request in the
same run, and prints a table. The budget is so large that nothing is dropped: every
message stays in the request (stage 2 still applies to historical turns).
"""

from __future__ import annotations

import statistics
import time

from context import Budget, SessionContext, TokenCounter, cut_tool_result, prepare
from context.tokens import REQUEST_OVERHEAD
from gateway.types import Message, ToolCall

SIZES = (10, 100, 1_000, 5_000)
REPEATS = 15
SYSTEM = "You are a helpful assistant in a chat. Answer concisely. Use tools when they help."
TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a workspace file.",
                                      "parameters": {"type": "object",
                                                     "properties": {"path": {"type": "string"}}}}},
]
BUDGET = Budget(10**9, 10**6, None, 4096, 50_000, 20_000)


def tool_output(i: int) -> str:
    line = f"{i:06d} worker[{i % 7}] handled request for session gateway token budget\n"
    size = 60_000 if i % 4 == 0 else 2_000
    return (line * (size // len(line) + 1))[:size]


def build(n_messages: int) -> SessionContext:
    ctx = SessionContext("bench:1")
    turn = 0
    while len(ctx.messages) < n_messages - 1:
        turn += 1
        cid = f"call_{turn}"
        ctx.append(Message("user", f"Please check the logs for problem {turn}.", turn=turn))
        ctx.append(Message("assistant", "", turn=turn, tool_calls=(ToolCall(cid, "read_file", '{"path": "x"}'),)))
        cut = cut_tool_result(tool_output(turn), call_id=cid, limit=BUDGET.tool_result_max_chars,
                              save_over=BUDGET.history_tool_result_max_chars)
        ctx.append(Message("tool", cut.content, turn=turn, tool_call_id=cid, truncation=cut.truncation))
        ctx.append(Message("assistant", f"Problem {turn} came from a retry loop; fixed.", turn=turn))
    ctx.append(Message("user", "And now?", turn=turn + 1))
    return ctx


def naive_tokens(counter: TokenCounter, messages: list[dict], tools: list[dict]) -> int:
    """Tokenize the whole request again, exactly, as an engine without caches would."""
    total = REQUEST_OVERHEAD + counter.count_exact(str(tools))
    for msg in messages:
        total += 4 + counter.count_exact(msg.get("content") or "")
        for call in msg.get("tool_calls") or ():
            total += counter.count_exact(call["function"]["arguments"])
    return total


def main() -> None:
    counter = TokenCounter("gpt-4o-mini")
    rows = []
    for size in SIZES:
        steps = min(REPEATS, max(3, size // 4))
        ctx = build(size - 2 * steps)  # the steps bring it to `size` messages
        prepare(ctx, system_prompt=SYSTEM, tools=TOOLS, budget=BUDGET, counter=counter)  # warm
        warm_times, step_times = [], []
        for step in range(1, steps + 1):
            start = time.perf_counter()
            prepare(ctx, system_prompt=SYSTEM, tools=TOOLS, budget=BUDGET, counter=counter)
            warm_times.append(time.perf_counter() - start)
            cid = f"step_{step}"
            ctx.append(Message("assistant", "", turn=ctx.current_turn,
                               tool_calls=(ToolCall(cid, "read_file", '{"path": "y"}'),)))
            ctx.append(Message("tool", f"small result {step}", turn=ctx.current_turn, tool_call_id=cid))
            start = time.perf_counter()
            prepared = prepare(ctx, system_prompt=SYSTEM, tools=TOOLS, budget=BUDGET, counter=counter)
            step_times.append(time.perf_counter() - start)
        naive_times = []
        for _ in range(3):
            start = time.perf_counter()
            naive_tokens(counter, prepared.messages, TOOLS)
            naive_times.append(time.perf_counter() - start)
        chars = sum(len(m.get("content") or "") for m in prepared.messages)
        warm = statistics.median(warm_times) * 1000
        stepped = statistics.median(step_times) * 1000
        naive = statistics.median(naive_times) * 1000
        rows.append((len(prepared.messages) - 1, chars, warm, stepped, naive, naive / stepped))
    print(f"{'messages':>9} {'request chars':>14} {'warm ms':>8} {'step ms':>8} {'naive ms':>9} {'speed-up':>9}")
    for n, chars, warm, stepped, naive, ratio in rows:
        print(f"{n:>9,} {chars:>14,} {warm:>8.3f} {stepped:>8.3f} {naive:>9.1f} {ratio:>8.0f}x")
    print("warm: prepare() again with nothing new; step: append a tool call and its result, then "
          "prepare() (medians);")
    print(f"naive: exact tiktoken of every message of the same request (median of 3); encoding "
          f"{counter.encoding_name}; speed-up = naive / step")


if __name__ == "__main__":
    main()
