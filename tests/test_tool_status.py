"""What the agent takes from a tool itself: the status line a person sees while it runs
(its own `status(args)`, else the built-in table) and how long a call may take (its own
`timeout_s`, bounded, else the fixed default)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from gateway.tools.base import Tool, ToolContext, ToolOutput
from gateway.tools.current_time import CurrentTime
from gateway.tools.mcp import CALL_GUARD_S
from gateway.tools.read_file import ReadFile
from gateway.tools.registry import ToolRegistry
from gateway.tools.status import tool_status
from gateway.tools.web_fetch import WebFetch
from gateway.tools.web_search import WebSearch
from gateway.turns.agent import TOOL_TIMEOUT_GRACE_S, TOOL_TIMEOUT_MAX_S, TOOL_TIMEOUT_S, tool_timeout
from gateway.types import ToolCall
from tests.conftest import GatewayFactory, chat
from tests.fakes.openai_server import FakeModel
from tests.test_mcp import ready, stdio, tool_results


def call(name: str, arguments: str = "{}") -> ToolCall:
    return ToolCall(id="c", name=name, arguments=arguments)


class Hangs:
    """A tool that says how long it may take, then never finishes."""

    name = "hangs"
    description = "waits forever"
    parameters: dict[str, Any] = {"type": "object", "properties": {}}

    def __init__(self, timeout_s: Any) -> None:
        self.timeout_s = timeout_s
        self.cancelled = asyncio.Event()

    def status(self, args: dict[str, Any]) -> str:
        raise ValueError("a status that fails must not break the turn")

    async def run(self, args: dict[str, Any], ctx: ToolContext) -> ToolOutput:
        try:
            await asyncio.Event().wait()
        finally:
            self.cancelled.set()
        raise AssertionError("unreachable")


class OneTool:
    """A ToolSource with one tool (the way MCP servers and the web tools join the registry)."""

    name = "test"
    version = 1

    def __init__(self, tool: Tool) -> None:
        self._tools = [tool]

    def tools(self) -> Sequence[Tool]:
        return self._tools


def test_a_tools_own_status_wins_over_the_table() -> None:
    registry = ToolRegistry([ReadFile(), CurrentTime(), WebFetch(), WebSearch()])
    fetch = call("web_fetch", '{"url": "https://example.com/a?b=c"}')
    assert tool_status([fetch], registry.get) == "fetching example.com…"
    assert tool_status([call("web_search", '{"query": "sea otters"}')], registry.get) == \
        "searching the web for “sea otters”…"
    # Built-ins without a status method keep the table's line; unknown tools the generic one.
    assert tool_status([call("read_file", '{"path": "notes.md"}'), fetch], registry.get) == \
        "reading notes.md, fetching example.com…"
    assert tool_status([call("current_time")], registry.get) == "checking the time…"
    assert tool_status([call("nobody__knows", "not json")], registry.get) == "running nobody__knows…"
    # A status method that fails falls back to the generic line.
    assert tool_status([call("hangs")], ToolRegistry([Hangs(1)]).get) == "running hangs…"


def test_a_tools_own_timeout_is_used_within_bounds() -> None:
    assert tool_timeout(CurrentTime()) == TOOL_TIMEOUT_S
    assert tool_timeout(Hangs(120)) == 120 + TOOL_TIMEOUT_GRACE_S
    assert tool_timeout(Hangs(0.5)) == 0.5 + TOOL_TIMEOUT_GRACE_S
    assert tool_timeout(Hangs(10**6)) == TOOL_TIMEOUT_MAX_S
    for odd in (None, 0, -3, float("nan"), float("inf"), True, "30"):
        assert tool_timeout(Hangs(odd)) == TOOL_TIMEOUT_S, odd


async def test_the_agent_stops_a_tool_at_its_own_timeout(make_gateway: GatewayFactory, fake_model: FakeModel) -> None:
    gw = await make_gateway()
    assert gw.services is not None
    hangs = Hangs(0.2)
    gw.services.tools.add_source(OneTool(hangs))
    fake_model.tool_call("hangs", {})
    fake_model.reply("it hung")
    started = time.monotonic()
    # Before tools had their own timeout this waited the fixed 60 s.
    assert await asyncio.wait_for(chat(gw, "ann", "go"), 10) == "it hung"
    assert time.monotonic() - started < 0.2 + TOOL_TIMEOUT_GRACE_S + 2
    bound = 0.2 + TOOL_TIMEOUT_GRACE_S
    assert tool_results(fake_model.requests[-1]) == [f"error: hangs did not finish within {bound:g} s"]
    assert hangs.cancelled.is_set()


async def test_an_mcp_tool_takes_its_servers_timeout(make_gateway: GatewayFactory) -> None:
    gw = await make_gateway(mcp={"servers": {"echo": stdio(timeout_s=120)}})
    await ready(gw, "echo")
    assert gw.services is not None
    tool = gw.services.tools.get("echo__slow")
    assert tool is not None
    # Longer than the fixed 60 s: the server's own timeout answers first, with its own words.
    assert tool_timeout(tool) == 120 + CALL_GUARD_S + TOOL_TIMEOUT_GRACE_S
    assert tool_status([call("echo__slow")], gw.services.tools.get) == "running echo slow…"
