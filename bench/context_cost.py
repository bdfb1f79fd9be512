"""Replay a long conversation through the context engine and report what it costs.

    python bench/context_cost.py [--chart context.png] [--summary-delay 2] [--breakdown]

The conversation is /work/shared/workloads/make_conversation.py 300 7 (run with this
Python; see its README): 300 turns, 312 tool calls, some huge results, a fifth in
Chinese. It is replayed as the agent would: one request per decision step (one per tool
call plus the final reply), tool results cut at stage 1 as they are produced (read_file
results point at their file, Markdown ones protected), and every SummarizeTurns effect
answered `--summary-delay` requests later with the extractive summary standing in for
the summary model.

Per budget it prints: requests, % over budget (by an exact recount: every request's texts
encoded again by tiktoken itself, plus the framing constants of context/tokens.py), mean /
max prompt tokens, total tokens billed, prefix reuse (common prefix of the serialized request — tools, then messages as
JSON — with the previous request, in characters: the mean of the per-request ratio, and
weighted by size), trims and summaries fired, and the engine's own time per turn
(prepare() plus stage-1 cuts; mean and p99; each turn's minimum over `--repeat` replays).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Generator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tiktoken

from context import (
    Budget,
    FileRef,
    SessionContext,
    SummarizeTurns,
    TokenCounter,
    cut_tool_result,
    extractive_summary,
    prepare,
)
from context.tokens import (
    MESSAGE_OVERHEAD,
    REQUEST_OVERHEAD,
    TOOL_CALL_OVERHEAD,
    TOOL_RESULT_OVERHEAD,
    TOOL_SCHEMA_OVERHEAD,
)
from gateway.types import Message, ToolCall

WORKLOAD = Path("/work/shared/workloads/make_conversation.py")
SYSTEM = (
    "You are a helpful assistant in a chat. Answer concisely. Use tools when they help; earlier "
    "conversation can be searched with memory_search."
)
TOOLS = [
    {"type": "function", "function": {"name": name, "description": desc,
                                      "parameters": {"type": "object", "properties": props}}}
    for name, desc, props in (
        ("read_file", "Read a workspace file from a start line or character offset.",
         {"path": {"type": "string"}, "offset": {"type": "integer"}, "start_line": {"type": "integer"}}),
        ("memory_search", "Search long-term memory and this chat's history.", {"query": {"type": "string"}}),
        ("web_fetch", "Fetch a web page as text.", {"url": {"type": "string"}}),
        ("current_time", "The current date and time.", {}),
    )
]


@dataclass(frozen=True)
class Setup:
    label: str
    budget: Budget
    max_steps: int


SETUPS = (
    Setup("50k tokens / 20 turns / 15 steps", Budget(50_000, 20, 128_000, 4096, 50_000, 20_000), 15),
    Setup("16k tokens / 10 turns / 15 steps", Budget(16_000, 10, 128_000, 4096, 50_000, 20_000), 15),
    Setup("120k tokens / 40 turns / 15 steps", Budget(120_000, 40, 128_000, 4096, 50_000, 20_000), 15),
)


@dataclass
class Result:
    setup: Setup
    tokens: list[int] = field(default_factory=list)
    x: list[float] = field(default_factory=list)  # turn + step fraction, for the chart
    over: int = 0  # by the exact recount
    differ: int = 0  # requests whose engine count is not the exact recount
    under: int = 0  # largest amount the engine counted below the exact recount
    reuse: list[float] = field(default_factory=list)
    reused_chars: int = 0
    total_chars: int = 0
    events: Counter[str] = field(default_factory=Counter)
    summaries: Counter[str] = field(default_factory=Counter)
    turn_ms: list[float] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)  # what happened in each request


def load_conversation(turns: int, seed: int, workload: Path) -> list[dict[str, Any]]:
    out = subprocess.run(
        [sys.executable, str(workload), str(turns), str(seed)], check=True, capture_output=True, text=True
    ).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def common_prefix(a: str, b: str) -> int:
    """Length of the common prefix (binary search on slice equality: C speed)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def serialize(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> str:
    return json.dumps(tools, ensure_ascii=False) + "".join(json.dumps(m, ensure_ascii=False) for m in messages)


Ask = tuple[int, int, dict[str, Any]]  # a tool result is wanted: turn, step index, the workload's step
Answer = tuple[str, FileRef | None]  # the tool's text, and the file it points at (read_file)


def recorded(step: dict[str, Any]) -> Answer:
    """The workload's own result of a step: read_file results point at their file,
    Markdown ones protected."""
    ref = None
    if step["tool"] == "read_file":
        path = str(step["args"]["path"])
        ref = FileRef(path, 0, 1, protected=path.endswith(".md"))
    return str(step["result"]), ref


def replaying(setup: Setup, conversation: list[dict[str, Any]], delay: int, *,
              tools: list[dict[str, Any]] = TOOLS,
              names: Mapping[str, str] | None = None) -> Generator[Ask, Answer, Result]:
    """The replay, asking its driver for each tool result (so a driver may run real
    tools between the engine's steps, outside the timed parts). `tools` are the schemas
    sent with each request; `names` renames the workload's tools in the tool calls."""
    budget = setup.budget
    counter = TokenCounter("gpt-4o-mini")
    ctx = SessionContext("bench:cost")
    result = Result(setup)
    pending: list[tuple[int, SummarizeTurns]] = []
    sent: list[tuple[list[dict[str, Any]], list[dict[str, Any]]]] = []
    noticed: list[bool] = []
    requests = 0
    last_summary: str | None = None

    def request(turn: int, step: int, final: bool) -> float:
        nonlocal requests, last_summary
        while pending and pending[0][0] <= requests:
            effect = pending.pop(0)[1]
            ctx.offer_summary(extractive_summary(effect), effect.upto_turn)
        offered = [] if final else tools
        start = time.perf_counter()
        prepared = prepare(ctx, system_prompt=SYSTEM, tools=offered, budget=budget, counter=counter, final=final)
        spent = time.perf_counter() - start
        requests += 1
        result.tokens.append(prepared.tokens)
        result.x.append(turn + step / 4)
        noticed.append(prepared.user_notice is not None)
        rules = sorted({e.strategy for e in prepared.events})
        kind = "+".join(rules) if rules else ("turn start" if step == 0 else "step")
        if ctx.summary is not last_summary:
            kind += ", summary changed"
            last_summary = ctx.summary
        result.kinds.append(kind)
        for event in prepared.events:
            result.events[event.strategy] += 1
        for effect in prepared.effects:
            result.summaries[effect.reason] += 1
            pending.append((requests + delay, effect))
        sent.append((prepared.messages, offered))  # serialized after the replay: timing stays clean
        return spent

    for record in conversation:
        turn = int(record["turn"])
        spent = 0.0
        ctx.append(Message("user", record["user"], turn=turn))
        steps = record["steps"][: setup.max_steps - 1]
        for index, step in enumerate(steps):
            spent += request(turn, index, final=False)
            call_id = f"call_{turn}_{index}"
            name = names.get(step["tool"], step["tool"]) if names else step["tool"]
            args = json.dumps(step["args"], ensure_ascii=False)
            ctx.append(Message("assistant", "", turn=turn, tool_calls=(ToolCall(call_id, name, args),)))
            text, ref = yield turn, index, step
            start = time.perf_counter()
            cut = cut_tool_result(text, call_id=call_id, limit=budget.tool_result_max_chars,
                                  file_ref=ref, save_over=budget.history_tool_result_max_chars)
            spent += time.perf_counter() - start
            ctx.append(Message("tool", cut.content, turn=turn, tool_call_id=call_id, tool_name=name,
                               truncation=cut.truncation))
        capped = len(record["steps"]) >= setup.max_steps
        spent += request(turn, len(steps), final=capped)
        ctx.append(Message("assistant", record["reply"], turn=turn))
        result.turn_ms.append(spent * 1000)
    recount(result, sent, noticed, counter.encoding_name, budget.effective_tokens)
    return result


def recount(result: Result, sent: list[tuple[list[dict[str, Any]], list[dict[str, Any]]]], noticed: list[bool],
            encoding_name: str, limit: int) -> None:
    """After a replay: each request recounted exactly (over budget, engine count vs
    recount) and its prefix reuse against the previous request."""
    exact_tokens = exact_counter(encoding_name)
    for (messages, tools), engine_tokens, notice in zip(sent, result.tokens, noticed, strict=True):
        exact = exact_tokens(messages, tools)  # the replay never calibrates: the factor stays 1
        if notice or exact > limit:
            result.over += 1
        if engine_tokens != exact:
            result.differ += 1
            result.under = max(result.under, exact - engine_tokens)
    previous = ""
    for messages, tools in sent:
        text = serialize(messages, tools)
        if previous:
            shared = common_prefix(previous, text)
            result.reuse.append(shared / len(text))
            result.reused_chars += shared
            result.total_chars += len(text)
        previous = text


def replay(setup: Setup, conversation: list[dict[str, Any]], delay: int) -> Result:
    """The replay with the workload's recorded tool results."""
    run = replaying(setup, conversation, delay)
    try:
        ask = next(run)
        while True:
            ask = run.send(recorded(ask[2]))
    except StopIteration as done:
        return done.value


def exact_counter(encoding_name: str) -> Any:
    """An independent count of a whole request: tiktoken run over every text of it (no
    engine code, no estimate), plus the framing constants of context/tokens.py."""
    encoding = tiktoken.get_encoding(encoding_name)

    @functools.lru_cache(maxsize=20_000)
    def text_tokens(text: str) -> int:
        return len(encoding.encode_ordinary(text)) if text else 0

    def request_tokens(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> int:
        total = REQUEST_OVERHEAD
        for msg in messages:
            total += MESSAGE_OVERHEAD + text_tokens(msg.get("content") or "")
            for call in msg.get("tool_calls") or ():
                fn = call["function"]
                total += TOOL_CALL_OVERHEAD + text_tokens(call["id"]) + text_tokens(fn["name"])
                total += text_tokens(fn["arguments"])
            if msg.get("tool_call_id") is not None:
                total += TOOL_RESULT_OVERHEAD + text_tokens(msg["tool_call_id"])
        if tools:
            schema = json.dumps(tools, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
            total += text_tokens(schema) + TOOL_SCHEMA_OVERHEAD * len(tools)
        return total

    return request_tokens


def timed(setup: Setup, conversation: list[dict[str, Any]], delay: int, repeat: int) -> Result:
    """Replay `repeat` times (the replay is deterministic); each turn's engine time is
    its minimum over the replays, which filters out noise from other processes."""
    first = replay(setup, conversation, delay)
    for _ in range(repeat - 1):
        keep_fastest(first, replay(setup, conversation, delay))
    return first


def keep_fastest(first: Result, again: Result) -> None:
    """Each turn's engine time in `first` becomes its minimum over both replays."""
    first.turn_ms = [min(a, b) for a, b in zip(first.turn_ms, again.turn_ms, strict=True)]


def breakdown(r: Result) -> str:
    """Where prefix reuse is lost: share of all requests lost per kind of request."""
    loss: Counter[str] = Counter()
    count: Counter[str] = Counter()
    for kind, ratio in zip(r.kinds[1:], r.reuse, strict=True):
        loss[kind] += 1 - ratio
        count[kind] += 1
    lines = [f"{'request kind':<48} {'requests':>8} {'reuse lost':>10}"]
    for kind, lost in loss.most_common():
        lines.append(f"{kind:<48} {count[kind]:>8} {lost / len(r.reuse):>10.1%}")
    return "\n".join(lines)


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


def report(results: list[Result]) -> str:
    lines = []
    head = (f"{'budget':<36} {'requests':>8} {'over':>5} {'mean tok':>9} {'max tok':>8} {'billed':>11} "
            f"{'reuse':>6} {'reuse/w':>7} {'ms/turn':>8} {'p99 ms':>7}")
    lines.append(head)
    for r in results:
        lines.append(
            f"{r.setup.label:<36} {len(r.tokens):>8} {r.over / len(r.tokens):>5.0%} "
            f"{statistics.mean(r.tokens):>9,.0f} {max(r.tokens):>8,} {sum(r.tokens):>11,} "
            f"{statistics.mean(r.reuse):>6.1%} {r.reused_chars / r.total_chars:>7.1%} "
            f"{statistics.mean(r.turn_ms):>8.3f} {p99(r.turn_ms):>7.3f}"
        )
    lines.append("")
    for r in results:
        lines.append(f"{r.setup.label}: engine count vs exact tiktoken recount: {r.differ} of {len(r.tokens)} "
                     f"requests differ, largest under-count {r.under}")
    for r in results:
        trims = ", ".join(f"{k} {v}" for k, v in sorted(r.events.items())) or "none"
        sums = ", ".join(f"{k} {v}" for k, v in sorted(r.summaries.items())) or "none"
        lines.append(f"{r.setup.label}: rules fired: {trims}; summaries asked: {sums}")
    return "\n".join(lines)


def chart(results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 5))
    for r in results:
        line = ax.plot(r.x, r.tokens, linewidth=0.8, label=r.setup.label)[0]
        ax.axhline(r.setup.budget.effective_tokens, color=line.get_color(), linestyle=":", linewidth=0.8)
    ax.set_xlabel("turn")
    ax.set_ylabel("prompt tokens per request")
    ax.set_title("Context size over the replayed conversation (dotted: effective budget)")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=300)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--workload", type=Path, default=WORKLOAD)
    parser.add_argument("--summary-delay", type=int, default=2, help="requests until a summary arrives")
    parser.add_argument("--delays", default="0,1,4",
                        help="other summary delays to replay the first budget with (comma-separated)")
    parser.add_argument("--chart", type=Path, help="write a PNG of context size over turns")
    parser.add_argument("--breakdown", action="store_true",
                        help="show where the first budget loses prefix reuse, by kind of request")
    parser.add_argument("--repeat", type=int, default=2,
                        help="replays per budget; engine time per turn is the minimum over them")
    args = parser.parse_args()
    conversation = load_conversation(args.turns, args.seed, args.workload)
    chars = sum(len(r["user"]) + len(r["reply"]) + sum(len(s["result"]) for s in r["steps"]) for r in conversation)
    print(f"workload: {len(conversation)} turns, {sum(len(r['steps']) for r in conversation)} tool calls, "
          f"{chars:,} characters; summaries delivered {args.summary_delay} requests after they are asked")
    results = [timed(setup, conversation, args.summary_delay, args.repeat) for setup in SETUPS]
    print(report(results))
    print("reuse: mean over requests of common-prefix chars / request chars of the serialized request vs the "
          "previous one; reuse/w: the same weighted by request size")
    if args.breakdown:
        print(f"\n{SETUPS[0].label}: prefix reuse lost, by request kind")
        print(breakdown(results[0]))
    delays = [int(d) for d in args.delays.split(",") if d.strip()]
    if delays:
        print(f"\n{SETUPS[0].label}, by summary delay (requests until a summary arrives):")
        print(f"{'delay':>6} {'over':>5} {'reuse':>6} {'reuse/w':>7} {'rules':>6} {'summaries':>9}")
        for delay in sorted({*delays, args.summary_delay}):
            r = results[0] if delay == args.summary_delay else replay(SETUPS[0], conversation, delay)
            print(f"{delay:>6} {r.over / len(r.tokens):>5.0%} {statistics.mean(r.reuse):>6.1%} "
                  f"{r.reused_chars / r.total_chars:>7.1%} {sum(r.events.values()):>6} "
                  f"{sum(r.summaries.values()):>9}")
    if args.chart:
        chart(results, args.chart)
        print(f"chart written to {args.chart}")


if __name__ == "__main__":
    main()
