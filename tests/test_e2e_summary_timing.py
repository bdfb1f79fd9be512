"""When summaries are asked and used, through the running gateway (SPEC §4.2 timing): a
summary that arrives during a turn is used by that turn's next decision step, and asks
that queue up behind a running summary go to the model as one call."""

from __future__ import annotations

import asyncio
from typing import Any

from context.effects import SummarizeTurns
from gateway.app import Gateway
from tests.conftest import GatewayFactory, chat
from tests.fakes.openai_server import FakeModel, Reply, ScriptedCall, last_user_text
from tests.test_e2e_context import chat_requests, is_summary_request, user_texts

SUMMARY = "## Goal\n- SUMMARY-OF-THE-EARLY-TURNS"
WAIT_S = 10.0


async def until(condition: Any, timeout: float = WAIT_S) -> None:
    """Wait for a condition the gateway's own tasks make true (checked every 10 ms)."""
    for _ in range(int(timeout / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise TimeoutError("the condition did not come true")


def summaries(fake: FakeModel) -> list[dict[str, Any]]:
    return [r for r in fake.requests if is_summary_request(r)]


async def test_a_summary_arriving_mid_turn_is_used_by_the_next_step_of_that_turn(
        make_gateway: GatewayFactory, fake_model: FakeModel) -> None:
    gw = await make_gateway(agent_max_context_turns=4)
    release = asyncio.Event()
    key = "web:mid"

    async def respond(body: dict[str, Any]) -> Reply | str | None:
        if is_summary_request(body):
            await release.wait()  # the summary model is slow: it answers when told
            return SUMMARY
        if last_user_text(body) == "m5" and not any(m["role"] == "tool" for m in body["messages"]):
            # Turn 5's first step: the trim drops turns 1-2, their summary is not there yet.
            # It arrives while this step runs, before the step asks for a tool.
            release.set()
            live = gw.sessions.live[key]
            await until(lambda: live.ctx.summary_pending)
            return Reply(tool_calls=(ScriptedCall("current_time", "{}", "call_t5"),))
        return None

    fake_model.respond_with(respond)
    for n in range(1, 5):
        await chat(gw, "mid", f"m{n}")
    assert summaries(fake_model), "turns 1-2 were asked for ahead of their trim"
    await chat(gw, "mid", "m5")
    first, second = chat_requests(fake_model)[-2:]
    assert user_texts(first)[0] == "m3"  # 1-2 dropped, no summary yet
    # The next decision step of the same turn carries the summary.
    assert "SUMMARY-OF-THE-EARLY-TURNS" in user_texts(second)[0] and user_texts(second)[0].endswith("m3")


async def test_asks_queued_behind_a_running_summary_go_as_one_call(
        make_gateway: GatewayFactory, fake_model: FakeModel) -> None:
    gw: Gateway = await make_gateway()
    release = asyncio.Event()

    async def respond(body: dict[str, Any]) -> str | None:
        if is_summary_request(body):
            await release.wait()
            return SUMMARY
        return None

    fake_model.respond_with(respond)
    for n in range(1, 7):
        await chat(gw, "queue", f"q{n}")
    live = gw.sessions.live["web:queue"]
    summarizer = gw.agent.summarizer

    def ask(upto: int) -> None:
        summarizer.submit(live, SummarizeTurns("web:queue", (), None, upto, "prefetch"))

    ask(2)
    await until(lambda: len(summaries(fake_model)) == 1)  # 1-2 are being summarized
    ask(4)
    ask(6)
    release.set()
    assert gw.services is not None
    assert await gw.services.background.wait_idle(WAIT_S)
    calls = summaries(fake_model)
    assert len(calls) == 2  # 1-2, then 3-6 at once: not 3-4 and 5-6 apart
    assert "(turns 3–6)" in calls[1]["messages"][-1]["content"]
    latest = await gw.services.store.latest_summary("web:queue")
    assert latest is not None and latest.upto_turn == 6
