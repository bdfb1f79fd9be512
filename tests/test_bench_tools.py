"""bench/tools.py's core, once and small: the MCP round trips through McpManager and the
SDK on both transports, and a short conversation replayed with its tool results served
by the bench's MCP server and by web_fetch against a local site."""

from __future__ import annotations

from typing import Any

from bench.tools import measure


def rows(prefix: str, count: int) -> str:
    return "\n".join(f'<div class="row-{i}"><span>{prefix} sentence number {i}.</span>'
                     f'<a href="/p/{i}">link {i}</a></div>' for i in range(count))


CONVERSATION: list[dict[str, Any]] = [
    {"turn": 1, "user": "what did we say about deploys?",
     "steps": [{"tool": "memory_search", "args": {"query": "deploy"}, "result": "    1  Deploy on Fridays, never."}],
     "reply": "Never on Fridays."},
    {"turn": 2, "user": "read the log and the page",
     "steps": [{"tool": "read_file", "args": {"path": "logs/service.log"}, "result": "INFO worker ok\n" * 4000},
               {"tool": "web_fetch", "args": {"url": "https://example.org/deploy"}, "result": rows("Deploy", 300)}],
     "reply": "The log is fine and the page lists the steps."},
    {"turn": 3, "user": "thanks", "steps": [], "reply": "You are welcome."},
]


async def test_quick_core_runs_real_tools() -> None:
    report = await measure(CONVERSATION, calls=20, rounds=1, repeat=1)
    assert {(c.transport, c.concurrency, c.client) for c in report.cells} == {
        (t, n, client) for t in ("stdio", "http") for n in (1, 8) for client in ("sdk", "manager")}
    for cell in report.cells:
        assert cell.errors == 0, cell.first_error
        assert len(cell.latencies_ms) == 20 and cell.calls_per_s > 0
    stats = {s.tool: s for s in report.replays.tools}
    for tool in ("memory_search", "read_file"):  # the MCP server returned the recorded text
        assert stats[tool].errors == 0, stats[tool].first_error
        assert stats[tool].calls == stats[tool].identical == 1
    assert stats["read_file"].over_limit == 1  # 60,000 characters: cut at stage 1 like any tool result
    fetched = stats["web_fetch"]
    assert fetched.errors == 0, fetched.first_error
    # The page went through web_fetch's HTML extraction: text, not the recorded HTML rows.
    assert fetched.calls == 1 and fetched.identical == 0 and 0 < fetched.real_chars < fetched.recorded_chars
    plain, real = report.replays.plain, report.replays.real
    assert len(plain.tokens) == len(real.tokens) == 6  # one request per tool call and one per turn to answer
    assert len(real.turn_ms) == 3 and real.over == 0
