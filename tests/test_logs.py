"""Logs that tell a story: one INFO line per turn with what it cost and how it ended,
never what people wrote; a start banner that says what runs."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

import pytest

from gateway.ops.logs import REDACTOR, LineFormatter
from tests.conftest import GatewayFactory, chat
from tests.fakes.openai_server import FakeModel
from tests.fakes.telegram_server import FakeTelegram, fake_telegram  # noqa: F401  (fixture)

SECRET = "hunter2-Zq81-PASSWORD"  # what a person might paste into a chat
ECHO = Path(__file__).resolve().parent / "mcp_servers" / "echo_server.py"


async def _turn_lines(caplog: pytest.LogCaptureFixture, n: int) -> list[logging.LogRecord]:
    """The "turn ended" records, once there are n (a reply is sent before its turn is closed)."""
    for _ in range(200):
        lines = [r for r in caplog.records if r.getMessage() == "turn ended"]
        if len(lines) >= n:
            return lines
        await asyncio.sleep(0.02)
    return lines


async def test_one_info_line_per_turn_with_its_cost_and_never_what_was_said(
        make_gateway: GatewayFactory, fake_model: FakeModel, caplog: pytest.LogCaptureFixture) -> None:
    # Two turns kept in the context: the third turn trims the oldest (turn_budget).
    gw = await make_gateway(agent_max_context_turns=2)
    caplog.set_level(logging.DEBUG)
    fake_model.tool_call("memory_search", {"query": SECRET}, usage=(900, 20))
    fake_model.reply(f"Your password {SECRET} is not in my notes.", usage=(1000, 30))
    assert SECRET in await chat(gw, "alice", f"do you remember {SECRET}?")
    fake_model.reply(f"Noted: {SECRET}.", usage=(1100, 5))
    await chat(gw, "alice", f"it is still {SECRET}")
    fake_model.reply("Third.", usage=(1200, 2))
    await chat(gw, "alice", f"and a third time {SECRET}")

    first, second, third = await _turn_lines(caplog, 3)
    assert {key: getattr(first, key) for key in ("session", "channel", "steps", "tokens_in", "tokens_out",
                                                  "outcome", "trims")} == {
        "session": "web:alice", "channel": "web", "steps": 2, "tokens_in": 1900, "tokens_out": 50,
        "outcome": "ok", "trims": []}
    assert isinstance(first.duration_s, float) and first.duration_s >= 0
    assert (second.steps, second.tokens_in, second.tokens_out, second.trims) == (1, 1100, 5, [])
    assert third.trims == ["turn_budget"]
    assert all(r.levelno == logging.INFO for r in (first, second, third))

    formatter = LineFormatter(REDACTOR)
    info = [formatter.format(r) for r in caplog.records if r.levelno >= logging.INFO]
    assert any("turn ended" in line and 'outcome="ok"' in line and "tokens_in=1900" in line for line in info)
    leaks = [line for line in info if SECRET in line]
    assert leaks == []
    # The secret did reach the model and the store, so the check above could have failed.
    assert any(SECRET in str(request["messages"]) for request in fake_model.requests)


async def test_a_failed_turn_has_its_line_too(make_gateway: GatewayFactory, fake_model: FakeModel,
                                              caplog: pytest.LogCaptureFixture) -> None:
    gw = await make_gateway()
    caplog.set_level(logging.INFO)
    fake_model.error(400, {"error": {"message": "nope"}})
    await chat(gw, "bob", "hello")
    (line,) = await _turn_lines(caplog, 1)
    assert (line.session, line.outcome, line.steps, line.tokens_in) == ("web:bob", "model_error", 1, 0)


async def test_the_start_banner_says_what_runs(make_gateway: GatewayFactory, fake_model: FakeModel,
                                               fake_telegram: FakeTelegram,  # noqa: F811
                                               caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    gw = await make_gateway(
        channels={"telegram": {"enabled": True, "token": fake_telegram.token, "base_url": fake_telegram.base_url,
                               "base_file_url": fake_telegram.base_file_url, "poll_timeout_s": 1}},
        mcp={"servers": {"echo": {"command": sys.executable, "args": [str(ECHO)]},
                         "off": {"command": sys.executable, "args": [str(ECHO)], "enabled": False}}},
    )
    assert gw.http is not None
    banner = [r.getMessage() for r in caplog.records if r.name == "gateway.app" and r.levelno == logging.INFO]
    assert banner == [
        f"web chat on http://127.0.0.1:{gw.http.port}/",
        f"telegram: polling as @{fake_telegram.bot_username}",
        "slack: off",
        "discord: off",
        "MCP servers: 1 (connecting in the background)",
    ]


async def test_the_banner_of_a_gateway_without_channels(make_gateway: GatewayFactory,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    await make_gateway(channels={"web": {"enabled": False}})
    banner = [r.getMessage() for r in caplog.records if r.name == "gateway.app" and r.levelno == logging.INFO]
    assert banner == ["web chat: off", "telegram: off", "slack: off", "discord: off", "MCP servers: none"]
