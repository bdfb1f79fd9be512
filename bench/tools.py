"""Benchmark: real tools — MCP round trips through the gateway, and the long workload
replayed with its tool results served by a real MCP server and by web_fetch.

    python -m bench.tools [--calls 500] [--rounds 4] [--turns 300] [--repeat 2] [--quick]

1. MCP round trip. A FastMCP server (`bench/_mcp_server.py`) over stdio and over
   streamable HTTP (a child process on 127.0.0.1); its `echo` tool is called `--calls`
   times one after another and again from 8 tasks at once, through the gateway's
   `McpManager` (`McpTool.run`: inbox, the server's owned task, `result_text`) and, as the
   baseline in this process, through the SDK's own `ClientSession` on a connection of its
   own to the same server (stdio: its own process of the same script). Cells alternate
   over `--rounds` rounds; p50 / p99 per call and calls/s, the manager's ratios to the SDK.

2. The workload replayed with real tools. The engine is driven exactly as
   `bench/context_cost.py` drives it (its `replaying`), at 50k tokens / 20 turns; only
   each tool result comes from actually running a tool: memory_search and read_file
   calls from the `workload` MCP server through `McpManager` (it returns the recorded
   text of that call id), web_fetch calls from the `web_fetch` tool against a local
   aiohttp site serving each recorded page as an HTML document (so the model gets
   trafilatura's Markdown, not the raw HTML). Tool results then take the agent's path:
   no file reference (MCP and web_fetch give none), stage-1 cuts at 50,000 characters.
   The plain replay (recorded results) runs in this process as the baseline, alternating
   with the real one; engine time per turn (prepare + stage-1 cuts, tool time excluded)
   is each turn's minimum over `--repeat` replays.

Everything binds 127.0.0.1 and stops at the end. Tables on stdout; bench/out/tools.json
and bench/out/tools.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mcp import ClientSession, StdioServerParameters, types
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client
from yarl import URL

from bench._procs import ROOT, Child
from bench.context_cost import (
    SETUPS,
    WORKLOAD,
    Answer,
    Result,
    keep_fastest,
    load_conversation,
    replay,
    replaying,
)
from gateway.config.load import parse_config
from gateway.config.schema import Config, McpConfig, McpServerConfig
from gateway.tools.base import Tool, ToolContext, ToolError, schema
from gateway.tools.current_time import CurrentTime
from gateway.tools.mcp import McpManager, McpTool
from gateway.tools.web_fetch import WebFetch
from gateway.turns.agent import TOOL_TIMEOUT_S
from tests.fakes.web_server import FakeWeb

OUT = ROOT / "bench" / "out"
DOCS_IMG = ROOT / "docs" / "img"
SERVER = ROOT / "bench" / "_mcp_server.py"
CONCURRENCY = (1, 8)
WARM_CALLS = 50
START_TIMEOUT_S = 30.0
CALL_TIMEOUT_S = 30.0
SETUP = SETUPS[0]  # 50k tokens / 20 turns / 15 steps
SUMMARY_DELAY = 2  # as context_cost's default
TRANSPORTS = ("stdio", "http")

Call = Callable[[str], Awaitable[str]]  # one echo round trip: the text back


def ms(seconds: float) -> float:
    return seconds * 1000


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


# ---------------------------------------------------------------------------- servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@asynccontextmanager
async def http_server(workdir: Path) -> AsyncIterator[str]:
    """The bench MCP server over streamable HTTP in a child process; yields its URL."""
    port = free_port()
    log_path = workdir / "mcp-http.log"
    with log_path.open("ab") as log_file:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(SERVER), "--http", str(port), cwd=str(ROOT), stdin=asyncio.subprocess.DEVNULL,
            stdout=log_file, stderr=log_file, start_new_session=True)
    child = Child(proc, f"http://127.0.0.1:{port}/mcp", log_path)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:  # uvicorn says nothing on stdout at WARNING: the open port is the sign
            try:
                _reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 2)
            except (OSError, TimeoutError):
                if proc.returncode is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the HTTP MCP server did not start:\n{child.log_text()[-2000:]}") from None
                await asyncio.sleep(0.05)
                continue
            writer.close()
            await writer.wait_closed()
            break
        yield child.url
    finally:
        await child.stop(timeout=5)


def stdio_params(*extra: str) -> StdioServerParameters:
    return StdioServerParameters(command=sys.executable, args=[str(SERVER), *extra], cwd=str(ROOT))


def server_config(*, url: str | None = None, args: tuple[str, ...] = ()) -> McpServerConfig:
    if url is not None:
        return McpServerConfig(url=url, timeout_s=CALL_TIMEOUT_S)
    return McpServerConfig(command=sys.executable, args=(str(SERVER), *args), cwd=str(ROOT), timeout_s=CALL_TIMEOUT_S)


@asynccontextmanager
async def manager(workdir: Path, servers: dict[str, McpServerConfig]) -> AsyncIterator[McpManager]:
    """An McpManager with `servers`, connecting in the background (see `until_ready`)."""
    mgr = McpManager(base_dir=workdir, log_dir=workdir / "mcp")
    await mgr.apply(McpConfig(servers=servers))
    try:
        yield mgr
    finally:
        await mgr.stop()


async def until_ready(mgr: McpManager) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not all(s.state == "ready" for s in mgr.statuses()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"MCP servers not ready: {[(s.name, s.describe()) for s in mgr.statuses()]}")
        await asyncio.sleep(0.02)  # the manager connects in the background; readiness is polled


def tool_of(mgr: McpManager, server: str, remote: str) -> McpTool:
    return next(t for t in mgr.tools() if t.server == server and t.remote == remote)


def bench_config() -> Config:
    # web_fetch refuses loopback addresses unless told otherwise; the site is local.
    return parse_config({"tools": {"web_fetch": {"allow_private_networks": True}}})


def tool_context(workdir: Path, cfg: Config) -> ToolContext:
    return ToolContext(session_key="bench:tools", scope="bench", workspace=workdir, config=cfg)


# ---------------------------------------------------------------------------- 1. round trips


@dataclass
class Cell:
    transport: str
    concurrency: int
    client: str  # sdk | manager
    latencies_ms: list[float] = field(default_factory=list)
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # this process's CPU time during the calls (the servers run elsewhere)
    errors: int = 0
    first_error: str | None = None

    @property
    def calls_per_s(self) -> float:
        return len(self.latencies_ms) / self.seconds if self.seconds else 0.0

    @property
    def cpu_us_per_call(self) -> float:
        return self.cpu_seconds * 1e6 / len(self.latencies_ms) if self.latencies_ms else float("nan")

    def p(self, q: float) -> float:
        return percentile(self.latencies_ms, q) if self.latencies_ms else float("nan")


async def run_calls(call: Call, calls: int, concurrency: int, cell: Cell | None) -> None:
    """`calls` echo round trips from `concurrency` tasks; recorded in `cell` (None: warm-up)."""
    left = calls
    latencies: list[float] = []

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            text = f"ping {left}"
            started = time.perf_counter()
            try:
                got = await asyncio.wait_for(call(text), CALL_TIMEOUT_S)
            except Exception as err:  # a bench reports failed calls; it does not stop on them
                if cell is not None:
                    cell.errors += 1
                    cell.first_error = cell.first_error or f"{type(err).__name__}: {err}"
                continue
            latencies.append(ms(time.perf_counter() - started))
            if got != text and cell is not None:
                cell.errors += 1
                cell.first_error = cell.first_error or f"answer {got[:60]!r} for {text!r}"

    started, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    if cell is not None:
        cell.seconds += time.perf_counter() - started
        cell.cpu_seconds += time.process_time() - cpu
        cell.latencies_ms += latencies


def sdk_call(session: ClientSession) -> Call:
    async def call(text: str) -> str:
        result = await session.call_tool("echo", {"text": text})
        first = result.content[0] if result.content else None
        if result.isError or not isinstance(first, types.TextContent):
            raise RuntimeError(f"echo failed: {result.content!r:.200}")
        return first.text

    return call


def manager_call(tool: McpTool, ctx: ToolContext) -> Call:
    async def call(text: str) -> str:
        return (await tool.run({"text": text}, ctx)).text

    return call


async def open_sdk(stack: AsyncExitStack, transport: str, url: str, errlog: Any) -> ClientSession:
    """The baseline: the SDK's own client session, nothing of the gateway in between."""
    if transport == "stdio":
        read, write = await stack.enter_async_context(stdio_client(stdio_params(), errlog=errlog))
    else:
        read, write, _session_id = await stack.enter_async_context(streamable_http_client(url))
    session = await stack.enter_async_context(ClientSession(read, write))
    await session.initialize()
    return session


async def round_trips(workdir: Path, *, calls: int, rounds: int,
                      transports: tuple[str, ...] = TRANSPORTS) -> list[Cell]:
    cfg = bench_config()
    ctx = tool_context(workdir, cfg)
    cells = {(t, c, client): Cell(t, c, client) for t in transports for c in CONCURRENCY
             for client in ("sdk", "manager")}
    async with AsyncExitStack() as stack:
        url = await stack.enter_async_context(http_server(workdir)) if "http" in transports else ""
        servers = {t: server_config(url=url if t == "http" else None) for t in transports}
        mgr = await stack.enter_async_context(manager(workdir, servers))
        errlog = stack.enter_context((workdir / "mcp-sdk-stdio.log").open("w", encoding="utf-8"))
        callers: dict[tuple[str, str], Call] = {}
        for t in transports:  # while the manager connects its own
            callers[(t, "sdk")] = sdk_call(await open_sdk(stack, t, url, errlog))
        await until_ready(mgr)
        for t in transports:
            callers[(t, "manager")] = manager_call(tool_of(mgr, t, "echo"), ctx)
        for call in callers.values():  # connections warm, first-call imports done
            await run_calls(call, min(WARM_CALLS, calls), 1, None)
        for _ in range(rounds):
            for (t, c, client), cell in cells.items():
                await run_calls(callers[(t, client)], calls, c, cell)
    return list(cells.values())


def round_trip_table(cells: list[Cell]) -> str:
    lines = [f"{'transport':<9} {'conc':>4} {'client':<8} {'calls':>6} {'errors':>6} {'p50 ms':>7} {'p99 ms':>7} "
             f"{'calls/s':>8} {'CPU µs/call':>11}   {'p50 ×':>6} {'p99 ×':>6} {'calls/s ×':>9} {'CPU ×':>6}"]
    sdk = {(c.transport, c.concurrency): c for c in cells if c.client == "sdk"}
    for c in cells:
        line = (f"{c.transport:<9} {c.concurrency:>4} {c.client:<8} {len(c.latencies_ms):>6} {c.errors:>6} "
                f"{c.p(0.5):>7.2f} {c.p(0.99):>7.2f} {c.calls_per_s:>8.0f} {c.cpu_us_per_call:>11.0f}")
        base = sdk[(c.transport, c.concurrency)]
        if c.client == "manager":
            line += (f"   {c.p(0.5) / base.p(0.5):>6.2f} {c.p(0.99) / base.p(0.99):>6.2f} "
                     f"{c.calls_per_s / base.calls_per_s:>9.2f} {c.cpu_us_per_call / base.cpu_us_per_call:>6.2f}")
        lines.append(line)
    for c in cells:
        if c.first_error:
            lines.append(f"{c.transport} c={c.concurrency} {c.client}: first error: {c.first_error[:200]}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- 2. the workload, real tools


@dataclass
class ToolStats:
    tool: str  # the workload's tool name
    served_by: str
    calls: int = 0
    errors: int = 0
    identical: int = 0  # results equal to the recorded text
    recorded_chars: int = 0
    real_chars: int = 0
    over_limit: int = 0  # real results longer than the stage-1 limit (cut before the engine keeps them)
    seconds: list[float] = field(default_factory=list)
    first_error: str | None = None


class RealTools:
    """Answers the replay's tool calls by running the tools: the workload MCP server
    through McpManager, web_fetch against the local site."""

    def __init__(self, mgr: McpManager, site: FakeWeb, ctx: ToolContext,
                 conversation: list[dict[str, Any]]) -> None:
        self.ctx = ctx
        self.mcp = {remote: tool_of(mgr, "workload", remote) for remote in ("memory_search", "read_file")}
        self.web_fetch = WebFetch()
        offered: list[Tool] = [*self.mcp.values(), self.web_fetch, CurrentTime()]
        self.schemas = [schema(tool) for tool in offered]
        self.names = {remote: tool.name for remote, tool in self.mcp.items()}
        self.stats: dict[str, ToolStats] = {}
        self.seconds = 0.0  # in the tools, over the current replay
        self.reset()
        self.urls: dict[str, str] = {}
        for record in conversation:
            for index, step in enumerate(record["steps"]):
                if step["tool"] == "web_fetch":
                    path = f"/{record['turn']}_{index}{URL(step['args']['url']).path}"
                    self.urls[f"{record['turn']}_{index}"] = site.page(path, page_html(step))

    def reset(self) -> None:
        """Statistics start afresh: they describe one replay."""
        self.stats = {name: ToolStats(name, "web_fetch, local site" if name == "web_fetch" else "MCP, stdio")
                      for name in ("memory_search", "read_file", "web_fetch")}
        self.seconds = 0.0

    async def answer(self, turn: int, index: int, step: dict[str, Any]) -> Answer:
        call = f"{turn}_{index}"
        stats = self.stats[step["tool"]]
        if step["tool"] == "web_fetch":
            tool: Tool = self.web_fetch
            args: dict[str, Any] = {"url": self.urls[call]}
        else:
            tool, args = self.mcp[step["tool"]], {**step["args"], "call": call}
        started = time.perf_counter()
        try:  # as the agent runs a tool (gateway/turns/agent.py: _execute)
            output = await asyncio.wait_for(tool.run(args, self.ctx), TOOL_TIMEOUT_S)
            text, ref = output.text, output.file_ref
        except (ToolError, TimeoutError) as err:
            text, ref = f"error: {err}", None
            stats.errors += 1
            stats.first_error = stats.first_error or text[:300]
        spent = time.perf_counter() - started
        self.seconds += spent
        stats.seconds.append(spent)
        stats.calls += 1
        stats.identical += text == step["result"]
        stats.recorded_chars += len(step["result"])
        stats.real_chars += len(text)
        stats.over_limit += len(text) > SETUP.budget.tool_result_max_chars
        return text, ref


def page_html(step: dict[str, Any]) -> str:
    """A recorded web_fetch result (rows of HTML) as the page a site would serve."""
    title = URL(step["args"]["url"]).path.strip("/") or "page"
    return (f"<!doctype html><html><head><meta charset=\"utf-8\"><title>{title}</title></head>"
            f"<body><main><h1>{title}</h1>\n{step['result']}\n</main></body></html>")


async def replay_real(tools: RealTools, conversation: list[dict[str, Any]]) -> Result:
    """context_cost's replay, each tool result from running the tool (outside the timed parts)."""
    tools.reset()
    run = replaying(SETUP, conversation, SUMMARY_DELAY, tools=tools.schemas, names=tools.names)
    try:
        ask = next(run)
        while True:
            ask = run.send(await tools.answer(*ask))
    except StopIteration as done:
        return done.value


@dataclass
class Replays:
    plain: Result
    real: Result
    tools: list[ToolStats]
    tool_seconds: float  # in the tools, one replay


async def workload_replay(workdir: Path, conversation: list[dict[str, Any]], *, repeat: int) -> Replays:
    results = {f"{r['turn']}_{i}": s for r in conversation for i, s in enumerate(r["steps"])
               if s["tool"] != "web_fetch"}
    results_path = workdir / "workload-results.json"
    results_path.write_text(json.dumps(results, ensure_ascii=False), encoding="utf-8")
    site = FakeWeb()
    await site.start()
    try:
        servers = {"workload": server_config(args=("--results", str(results_path)))}
        async with manager(workdir, servers) as mgr:
            await until_ready(mgr)
            tools = RealTools(mgr, site, tool_context(workdir, bench_config()), conversation)
            replay(SETUP, conversation[:5], SUMMARY_DELAY)  # warm-up: the encoder loads, first-use imports
            plain = replay(SETUP, conversation, SUMMARY_DELAY)
            real = await replay_real(tools, conversation)
            for _ in range(repeat - 1):  # alternating, so both see the same machine
                keep_fastest(plain, replay(SETUP, conversation, SUMMARY_DELAY))
                keep_fastest(real, await replay_real(tools, conversation))
            return Replays(plain, real, list(tools.stats.values()), tools.seconds)
    finally:
        await site.stop()


def replay_table(r: Replays, turns: int) -> str:
    lines = [f"{'tool results':<22} {'requests':>8} {'over':>5} {'mean tok':>9} {'max tok':>8} {'billed':>11} "
             f"{'reuse':>6} {'reuse/w':>7} {'ms/turn':>8} {'p99 ms':>7} {'tools ms/turn':>13}"]
    rows = (("recorded (baseline)", r.plain, None), ("real tools", r.real, r.tool_seconds))
    for label, res, tool_s in rows:
        lines.append(
            f"{label:<22} {len(res.tokens):>8} {res.over / len(res.tokens):>5.0%} {statistics.mean(res.tokens):>9,.0f} "
            f"{max(res.tokens):>8,} {sum(res.tokens):>11,} {statistics.mean(res.reuse):>6.1%} "
            f"{res.reused_chars / res.total_chars:>7.1%} {statistics.mean(res.turn_ms):>8.3f} "
            f"{percentile(res.turn_ms, 0.99):>7.3f} " + (f"{ms(tool_s) / turns:>13.2f}" if tool_s is not None else
                                                            f"{'-':>13}"))
    p, q = r.plain, r.real
    lines.append(
        f"{'real / recorded':<22} {'':>8} {'':>5} {statistics.mean(q.tokens) / statistics.mean(p.tokens):>9.2f} "
        f"{max(q.tokens) / max(p.tokens):>8.2f} {sum(q.tokens) / sum(p.tokens):>11.2f} "
        f"{(statistics.mean(q.reuse) - statistics.mean(p.reuse)) * 100:>+4.1f}pt "
        f"{(q.reused_chars / q.total_chars - p.reused_chars / p.total_chars) * 100:>+5.1f}pt "
        f"{statistics.mean(q.turn_ms) / statistics.mean(p.turn_ms):>8.2f} "
        f"{percentile(q.turn_ms, 0.99) / percentile(p.turn_ms, 0.99):>7.2f}")
    lines.append("")
    lines.append(f"{'tool':<14} {'served by':<22} {'calls':>5} {'errors':>6} {'as recorded':>11} "
                 f"{'recorded chars':>14} {'real chars':>11} {'> 50k':>5} {'p50 ms':>7} {'p99 ms':>7}")
    for s in r.tools:
        if not s.calls:
            continue
        times = [ms(t) for t in s.seconds]
        lines.append(f"{s.tool:<14} {s.served_by:<22} {s.calls:>5} {s.errors:>6} {s.identical:>11} "
                     f"{s.recorded_chars:>14,} {s.real_chars:>11,} {s.over_limit:>5} "
                     f"{percentile(times, 0.5):>7.2f} {percentile(times, 0.99):>7.2f}")
    for s in r.tools:
        if s.first_error:
            lines.append(f"{s.tool}: first error: {s.first_error}")
    for label, res in (("recorded", r.plain), ("real tools", r.real)):
        trims = ", ".join(f"{k} {v}" for k, v in sorted(res.events.items())) or "none"
        sums = ", ".join(f"{k} {v}" for k, v in sorted(res.summaries.items())) or "none"
        lines.append(f"{label}: engine count vs exact recount: {res.differ} of {len(res.tokens)} differ; "
                     f"rules fired: {trims}; summaries asked: {sums}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- report


@dataclass
class Report:
    cells: list[Cell]
    replays: Replays
    turns: int
    seconds: float


async def measure(conversation: list[dict[str, Any]], *, calls: int, rounds: int, repeat: int,
                  transports: tuple[str, ...] = TRANSPORTS) -> Report:
    """Both parts, each with its servers started and stopped here."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-tools-") as tmp:
        workdir = Path(tmp)
        cells = await round_trips(workdir, calls=calls, rounds=rounds, transports=transports)
        replays = await workload_replay(workdir, conversation, repeat=repeat)
    return Report(cells, replays, len(conversation), time.monotonic() - started)


def as_json(report: Report) -> dict[str, Any]:
    def result(res: Result) -> dict[str, Any]:
        return {"requests": len(res.tokens), "over": res.over, "mean_tokens": statistics.mean(res.tokens),
                "max_tokens": max(res.tokens), "billed": sum(res.tokens), "reuse": statistics.mean(res.reuse),
                "reuse_weighted": res.reused_chars / res.total_chars, "ms_per_turn": statistics.mean(res.turn_ms),
                "p99_ms": percentile(res.turn_ms, 0.99), "events": dict(res.events),
                "summaries": dict(res.summaries)}

    return {
        "round_trips": [{"transport": c.transport, "concurrency": c.concurrency, "client": c.client,
                         "calls": len(c.latencies_ms), "errors": c.errors, "p50_ms": c.p(0.5), "p99_ms": c.p(0.99),
                         "calls_per_s": c.calls_per_s, "cpu_us_per_call": c.cpu_us_per_call} for c in report.cells],
        "replay": {"turns": report.turns, "setup": SETUP.label, "recorded": result(report.replays.plain),
                   "real": result(report.replays.real), "tool_seconds": report.replays.tool_seconds,
                   "tools": [{k: v for k, v in asdict(s).items() if k != "seconds"} for s in report.replays.tools]},
        "seconds": report.seconds,
    }


def chart(report: Report, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, grid = plt.subplots(2, 2, figsize=(12, 7.2))
    axes = list(grid.flat)
    groups = sorted({(c.transport, c.concurrency) for c in report.cells}, key=lambda g: (g[0] != "stdio", g[1]))
    by = {(c.transport, c.concurrency, c.client): c for c in report.cells}
    xs = range(len(groups))
    width = 0.38
    panels: list[tuple[str, Callable[[Cell], float]]] = [
        ("MCP call latency, ms (bars p50, ticks p99; log)", lambda c: c.p(0.5)),
        ("MCP calls/s", lambda c: c.calls_per_s),
        ("CPU of the calling process, µs per call", lambda c: c.cpu_us_per_call),
    ]
    for ax, (title, value) in zip(axes, panels, strict=False):
        for k, client in enumerate(("sdk", "manager")):
            pos = [x + (k - 0.5) * width for x in xs]
            cells = [by[(t, c, client)] for t, c in groups]
            label = "SDK ClientSession (baseline)" if client == "sdk" else "gateway McpManager"
            bars = ax.bar(pos, [value(c) for c in cells], width, label=label)
            if ax is axes[0]:
                ax.scatter(pos, [c.p(0.99) for c in cells], marker="_", s=300, color=bars[0].get_facecolor(),
                           zorder=3)
            if client == "manager":
                for bar, cell, (t, c) in zip(bars, cells, groups, strict=True):
                    ax.annotate(f"×{value(cell) / value(by[(t, c, 'sdk')]):.2f}",
                                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                                ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(xs), [f"{t}, {c} at once" if c > 1 else f"{t}, sequential" for t, c in groups],
                      fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=8, loc="upper left")
    ax = axes[3]
    for label, res in (("recorded results", report.replays.plain), ("real tools", report.replays.real)):
        ordered = sorted(res.turn_ms)
        ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))],
                label=f"{label}: mean {statistics.mean(ordered):.2f} ms, reuse {statistics.mean(res.reuse):.1%}")
    ax.set_xscale("log")
    ax.set_xlabel("engine ms per turn (prepare + stage-1 cuts)", fontsize=9)
    ax.set_ylabel("share of turns", fontsize=9)
    ax.set_title(f"{report.turns}-turn replay at {SETUP.label.split(' / 15')[0]}: engine time per turn",
                 fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=85)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500, help="echo calls per cell and round")
    parser.add_argument("--rounds", type=int, default=4, help="rounds over all cells (they alternate)")
    parser.add_argument("--turns", type=int, default=300, help="turns of the workload to replay")
    parser.add_argument("--repeat", type=int, default=2, help="replays of each kind; engine time is the minimum")
    parser.add_argument("--workload", type=Path, default=WORKLOAD)
    parser.add_argument("--quick", action="store_true", help="a short run (under 30 s): 100 calls, 1 round, 40 turns")
    parser.add_argument("--no-chart", action="store_true", help="skip the PNG")
    args = parser.parse_args()
    if args.quick:
        args.calls, args.rounds, args.turns, args.repeat = 100, 1, 40, 1
    # The manager logs servers starting and stopping; the tables are what matters here.
    logging.basicConfig(level=logging.WARNING)
    conversation = load_conversation(args.turns, 7, args.workload)
    report = asyncio.run(measure(conversation, calls=args.calls, rounds=args.rounds, repeat=args.repeat))
    print(f"MCP round trips: echo tool, {args.calls} calls per cell and round, {args.rounds} round(s); "
          f"ratios: gateway McpManager / SDK ClientSession")
    print(round_trip_table(report.cells))
    print(f"\nworkload replay: {report.turns} turns, {SETUP.label}, summaries {SUMMARY_DELAY} requests late, "
          f"engine time the minimum of {args.repeat} replay(s)")
    print(replay_table(report.replays, report.turns))
    print("reuse: as bench/context_cost.py (common prefix with the previous request); ms/turn: the engine's own "
          "time (prepare + stage-1 cuts); tools ms/turn: time in the tools, not counted in ms/turn")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "tools.json").write_text(json.dumps(as_json(report), indent=2), encoding="utf-8")
    if not args.no_chart:
        chart(report, OUT / "tools.png")
        if args.quick:  # the docs show a full run
            print(f"chart written to {OUT / 'tools.png'}")
        else:
            DOCS_IMG.mkdir(parents=True, exist_ok=True)
            shutil.copy(OUT / "tools.png", DOCS_IMG / "tools.png")
            print(f"chart written to {OUT / 'tools.png'} and copied to docs/img/")
    print(f"done in {report.seconds:.0f} s")


if __name__ == "__main__":
    main()
