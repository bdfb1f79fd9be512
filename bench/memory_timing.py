"""Benchmark: does a long chat ever lose a turn without its summary? (SPEC §4.2 "timing")

    python -m bench.memory_timing [--speeds 0,1,3,6] [--turns 300] [--step-ms 40]

The 300-turn workload (/work/shared/workloads/make_conversation.py 300 7) is driven
through a running gateway (built in this process as the tests' `make_gateway` does: a
temporary data dir, the web API on 127.0.0.1), one person writing back to back: each
turn is posted to `POST /api/chat` as soon as the previous reply is in. The model is the
tests' fake OpenAI server (tests/fakes/openai_server.py). It replays the workload: each
decision step answers with the tool call the workload made at that step, or with its
final reply, after `--step-ms`; the gateway runs the tool (a stand-in with the recorded
result; read_file ones point at their file like the real tool) and cuts and stores the
result as usual. It reports the exact prompt size as `usage.prompt_tokens`, so
calibration stays 1. Summary requests are answered by the same fake after N× a decision
step (N from `--speeds`; the step is the running mean of the time between two decision
requests, so gateway overhead counts as part of a step), with a summary of a real one's
size that names the last turn it covers.

From the requests the fake received it reports, per speed:
- hole: a decision request in which some earlier turn is no longer present and is not
  covered by the injected summary (the request lacks both the turn and its summary);
- trims: requests whose first kept turn moved forward; "with summary": those whose
  injected summary covers every turn no longer present;
- summaries asked (summary model calls) and shown (distinct summaries that some request
  injected), asked per trim;
- summary tokens per trim: the summary calls' prompt + completion tokens (tiktoken) / trims;
- over budget (by an exact tiktoken recount), prefix reuse (as bench/context_cost.py).

Targets at 6×: 0 requests with a hole, ≥ 95 % of trims with their summary, ≤ 1.1
summaries asked per trim. Judged in words ("met" / "MISSED"). JSON in bench/out/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import aiohttp

from bench.context_cost import WORKLOAD, common_prefix, exact_counter, load_conversation, serialize
from context.tokens import TokenCounter
from context.truncate import FileRef
from gateway.app import Gateway
from gateway.config.load import load_config
from gateway.tools.base import ToolContext, ToolOutput
from gateway.tools.registry import ToolRegistry
from tests.fakes.openai_server import FakeModel, Reply, ScriptedCall

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
SUMMARY_MARK = "You keep the working memory of a long chat"
INJECTED = "[Summary of the earlier conversation"
USER_FOLLOWS = "The user's message follows.]\n\n"
FOLD_SPAN = re.compile(r"Conversation to fold into the summary \(turns? (\d+)(?:–(\d+))?\)")
COVERS = re.compile(r"SUMMARY-COVERS-TURNS-1-(\d+)")
BUDGET_TOKENS = 50_000
BUDGET_TURNS = 20
TURN_TIMEOUT_S = 120.0
SUMMARY_BODY = "\n".join(
    f"## {section}\n- " + "; ".join(f"{section.lower()} item {i} with a few specific words" for i in range(4))
    for section in ("Goal", "Constraints & Preferences", "Progress", "Key Decisions", "Next Steps",
                    "Critical Context")
)  # ~1,300 characters, the six sections the summary prompt asks for
TOOL_DESCRIPTIONS = {
    "read_file": "Read a workspace file from a start line or character offset.",
    "memory_search": "Search long-term memory and this chat's history.",
    "web_fetch": "Fetch a web page as text.",
    "current_time": "The current date and time.",
}


class ReplayTool:
    """A tool of the workload: returns what the workload recorded for the call the fake
    model made last (one person, one call at a time)."""

    def __init__(self, name: str, replay: Replay) -> None:
        self.name = name
        self.description = TOOL_DESCRIPTIONS.get(name, name)
        self.parameters: dict[str, Any] = {"type": "object", "properties": {}}
        self._replay = replay

    async def run(self, args: dict[str, Any], ctx: ToolContext) -> ToolOutput:
        text, ref = self._replay.results[self._replay.called]
        return ToolOutput(text, file_ref=ref)


@dataclass
class Run:
    speed: float
    turns: int = 0
    requests: int = 0
    holes: int = 0
    hole_turns: list[int] = field(default_factory=list)
    trims: int = 0
    trims_with_summary: int = 0
    asked: int = 0
    shown: int = 0
    summary_tokens: int = 0
    over: int = 0
    reuse: float = 0.0
    step_ms: float = 0.0
    summary_ms: float = 0.0
    seconds: float = 0.0

    def asked_per_trim(self) -> float:
        return self.asked / self.trims if self.trims else 0.0


class Replay:
    """The fake model's side: which turn and step a request is at, what to answer, and
    what each request shows (observed as it arrives, so no request is kept)."""

    def __init__(self, conversation: list[dict[str, Any]], speed: float, step_s: float, encoding: str) -> None:
        self.conversation = conversation
        self.results = recorded_results(conversation)
        self.by_text = {str(r["user"]).strip(): int(r["turn"]) for r in conversation}  # the web API strips
        self.speed = speed
        self.step_s = step_s
        self.count = exact_counter(encoding)
        self.called = ""  # "turn/step" of the tool call answered last
        self.last_decision: float | None = None
        self.intervals: list[float] = []
        self.summary_delays: list[float] = []
        self.run = Run(speed)
        self._first: int | None = None
        self._previous = ""
        self._shown: set[int] = set()
        self._reuse: list[float] = []

    def turn_of(self, text: str) -> int | None:
        if text.startswith(INJECTED):
            text = text.split(USER_FOLLOWS, 1)[-1]
        return self.by_text.get(text.strip())

    def step_time(self) -> float:
        """The running mean time of a decision step (model + gateway), never below the model's."""
        recent = self.intervals[-50:]
        return max(self.step_s, statistics.mean(recent)) if recent else self.step_s

    def respond(self, body: dict[str, Any]) -> Reply:
        messages = body["messages"]
        tools = body.get("tools") or []
        prompt = self.count(messages, tools)
        if SUMMARY_MARK in str(messages[0].get("content", "")):
            return self.summary(body, prompt)
        now = time.monotonic()
        if self.last_decision is not None:
            self.intervals.append(now - self.last_decision)
        self.last_decision = now
        turn = self.observe(messages, tools, prompt)
        last_user = max(i for i, m in enumerate(messages)
                        if m["role"] == "user" and isinstance(m["content"], str) and self.turn_of(m["content"]))
        record = self.conversation[turn - 1]
        step = sum(1 for m in messages[last_user:] if m["role"] == "tool")
        steps = record["steps"]
        if step < len(steps):
            call = steps[step]
            self.called = f"{turn}/{step}"
            scripted = ScriptedCall(call["tool"], json.dumps(call["args"], ensure_ascii=False), f"call_{turn}_{step}")
            return Reply(tool_calls=(scripted,), usage=(prompt, 20), delay=self.step_s)
        return Reply(text=str(record["reply"]), usage=(prompt, 60), delay=self.step_s)

    def summary(self, body: dict[str, Any], prompt: int) -> Reply:
        text = str(body["messages"][1]["content"])
        span = FOLD_SPAN.search(text)
        upto = int(span.group(2) or span.group(1)) if span else 0
        delay = self.speed * self.step_time()
        self.summary_delays.append(delay)
        summary = f"SUMMARY-COVERS-TURNS-1-{upto}\n{SUMMARY_BODY}"
        completion = self.count([{"role": "assistant", "content": summary}], [])
        self.run.asked += 1
        self.run.summary_tokens += prompt + completion
        return Reply(text=summary, usage=(prompt, completion), delay=delay)

    def observe(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], prompt: int) -> int:
        """Count what this decision request shows; its turn."""
        run = self.run
        run.requests += 1
        if prompt > BUDGET_TOKENS:
            run.over += 1
        present: list[int] = []
        covered = 0
        for m in messages:
            if m["role"] != "user" or not isinstance(m["content"], str):
                continue
            turn = self.turn_of(m["content"])
            if turn is None:
                continue
            present.append(turn)
            if m["content"].startswith(INJECTED):
                found = COVERS.search(m["content"])
                covered = int(found.group(1)) if found else 0
        current = max(present)
        gone = set(range(1, current)) - set(present)
        hole = any(t > covered for t in gone)
        if covered:
            self._shown.add(covered)
        if hole:
            run.holes += 1
            run.hole_turns.append(current)
        first = min(present)
        if self._first is not None and first > self._first:
            run.trims += 1
            run.trims_with_summary += 0 if hole else 1
        self._first = first
        text = serialize(messages, tools)
        if self._previous:
            self._reuse.append(common_prefix(self._previous, text) / len(text))
        self._previous = text
        run.shown = len(self._shown)
        run.reuse = statistics.mean(self._reuse) if self._reuse else 0.0
        return current


def recorded_results(conversation: list[dict[str, Any]]) -> dict[str, tuple[str, FileRef | None]]:
    """Each step's recorded result by "turn/step"; read_file ones point at their file
    (Markdown protected), as bench/context_cost.py replays them."""
    out: dict[str, tuple[str, FileRef | None]] = {}
    for record in conversation:
        for index, step in enumerate(record["steps"]):
            ref = None
            if step["tool"] == "read_file":
                path = str(step["args"]["path"])
                ref = FileRef(path, 0, 1, protected=path.endswith(".md"))
            out[f"{record['turn']}/{index}"] = (str(step["result"]), ref)
    return out


def write_config(directory: Path, fake: FakeModel) -> Path:
    raw = {
        "data_dir": "data",
        "http": {"host": "127.0.0.1", "port": 0},
        "model": fake.model_settings(max_retries=2, timeout_s=120, context_window=128_000, max_output_tokens=4096),
        "summary_timeout_s": 600,
        "agent_max_context_tokens": BUDGET_TOKENS,
        "agent_max_context_turns": BUDGET_TURNS,
        "limits": {"turn_timeout_s": 600},
    }
    path = directory / "config.json"
    path.write_text(json.dumps(raw, indent=2), encoding="utf-8")
    return path


async def drive(conversation: list[dict[str, Any]], speed: float, step_s: float) -> Run:
    """One run with summaries answered after `speed`× a decision step."""
    replay = Replay(conversation, speed, step_s, TokenCounter("fake-model").encoding_name)
    run = replay.run
    async with FakeModel() as fake:

        def respond(body: dict[str, Any]) -> Reply:
            fake.requests.clear()  # observed as they come: 600 requests of ~50k tokens need not stay
            fake.request_headers.clear()
            return replay.respond(body)

        fake.respond_with(respond)
        with tempfile.TemporaryDirectory(prefix="memory-timing-") as tmp:
            path = write_config(Path(tmp), fake)
            gw = Gateway(load_config(path), config_path=path)
            names = sorted({s["tool"] for r in conversation for s in r["steps"]})
            # The recorded conversation's tools, in place of the gateway's own (and of its sources).
            replayed = classmethod(lambda cls, _cfg: cls([ReplayTool(n, replay) for n in names]))
            with mock.patch.object(ToolRegistry, "default", replayed):
                await gw.start()
            try:
                assert gw.services is not None and gw.http is not None
                for source in gw.services.tools.sources:
                    gw.services.tools.remove_source(source)
                url = f"http://127.0.0.1:{gw.http.port}/api/chat"
                started = time.monotonic()
                timeout = aiohttp.ClientTimeout(total=TURN_TIMEOUT_S)
                auth = {"Authorization": f"Bearer {gw.web_token}"}  # the web API's token (SPEC §9)
                async with aiohttp.ClientSession(timeout=timeout, headers=auth) as http:
                    for record in conversation:
                        async with http.post(url, json={"session": "bench", "text": record["user"]}) as resp:
                            body = await resp.json(content_type=None)
                            if resp.status != 200 or str(body.get("reply")).strip() != str(record["reply"]).strip():
                                raise RuntimeError(f"turn {record['turn']}: {resp.status} {str(body)[:300]}")
                        run.turns += 1
                run.seconds = time.monotonic() - started
                await gw.services.background.wait_idle(60)
            finally:
                await gw.stop(timeout=10)
    run.step_ms = replay.step_time() * 1000
    run.summary_ms = statistics.mean(replay.summary_delays) * 1000 if replay.summary_delays else 0.0
    return run


def table(runs: list[Run]) -> str:
    head = (f"{'summary after':>13} {'requests':>8} {'holes':>5} {'trims':>5} {'w/ summary':>10} "
            f"{'asked':>5} {'shown':>5} {'asked/trim':>10} {'sum tok/trim':>12} {'over':>4} {'reuse':>6} "
            f"{'step ms':>7} {'summary ms':>10}")
    lines = [head]
    for r in runs:
        speed = "instant" if r.speed == 0 else f"{r.speed:g}× a step"
        with_summary = f"{r.trims_with_summary}/{r.trims}"
        per_trim = r.summary_tokens / r.trims if r.trims else 0
        lines.append(
            f"{speed:>13} {r.requests:>8} {r.holes:>5} {r.trims:>5} {with_summary:>10} {r.asked:>5} {r.shown:>5} "
            f"{r.asked_per_trim():>10.2f} {per_trim:>12,.0f} {r.over:>4} {r.reuse:>6.1%} "
            f"{r.step_ms:>7.1f} {r.summary_ms:>10.1f}")
    return "\n".join(lines)


def verdicts(runs: list[Run]) -> list[str]:
    out = []
    for r in runs:
        if r.speed != 6:
            continue
        share = r.trims_with_summary / r.trims if r.trims else 1.0
        out.append(f"0 requests with a hole at 6×: {r.holes} → {'met' if r.holes == 0 else 'MISSED'}")
        out.append(f"≥ 95 % of trims with their summary at 6×: {share:.0%} → {'met' if share >= 0.95 else 'MISSED'}")
        out.append(f"≤ 1.1 summaries asked per trim at 6×: {r.asked_per_trim():.2f} → "
                   f"{'met' if r.asked_per_trim() <= 1.1 else 'MISSED'}")
    return out


async def main_async(args: argparse.Namespace) -> None:
    conversation = load_conversation(args.turns, args.seed, args.workload)
    speeds = [float(s) for s in args.speeds.split(",") if s.strip()]
    runs: list[Run] = []
    for speed in speeds:
        run = await drive(conversation, speed, args.step_ms / 1000)
        print(f"summaries after {speed:g}× a step: {run.turns} turns in {run.seconds:.1f}s", file=sys.stderr)
        runs.append(run)
    load = os.getloadavg()
    print(f"workload: {len(conversation)} turns through the gateway, one person back to back; "
          f"budget {BUDGET_TOKENS:,} tokens / {BUDGET_TURNS} turns; decision step {args.step_ms:g} ms at the model; "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(table(runs))
    for line in verdicts(runs):
        print(line)
    for r in runs:
        if r.hole_turns:
            print(f"{r.speed:g}×: holes in turns {sorted(set(r.hole_turns))}")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "memory_timing.json").write_text(json.dumps([asdict(r) for r in runs], indent=2), encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speeds", default="0,1,3,6", help="summary delays, in decision steps (comma-separated)")
    parser.add_argument("--turns", type=int, default=300)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--workload", type=Path, default=WORKLOAD)
    parser.add_argument("--step-ms", type=float, default=40.0, help="the model's time for one decision step")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
