"""Sub-agents (SPEC §5.8): `delegate(task, agent?)` runs a sub-turn with a fresh context, its
own step limit and budget, stored apart from the session's turns, its tokens counted to the
person; at most 3 at once per turn; a sub-turn cannot delegate further."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from gateway.turns.agent import SUB_TURN_MAX_STEPS
from tests.conftest import GatewayFactory, chat
from tests.fakes.openai_server import FakeModel, Reply, ScriptedCall

TASKS = ["count the otters", "count the beavers", "count the herons"]


def last_user(body: dict[str, Any]) -> str:
    return str([m for m in body["messages"] if m["role"] == "user"][-1]["content"])


def tool_names(body: dict[str, Any]) -> list[str]:
    return [t["function"]["name"] for t in body.get("tools", [])]


async def test_three_delegates_run_at_once_with_fresh_contexts(make_gateway: GatewayFactory,
                                                                fake_model: FakeModel) -> None:
    gw = await make_gateway(agents={"researcher": {"system_prompt": "You research."}})
    at_once, most = [0], [0]
    release = asyncio.Event()

    async def respond(body: dict[str, Any]) -> Any:
        text = last_user(body)
        if text in TASKS:  # a sub-turn's only message is its task
            assert [m["role"] for m in body["messages"]] == ["system", "user"]  # a fresh context
            assert "delegate" not in tool_names(body)  # no nesting
            at_once[0] += 1
            most[0] = max(most[0], at_once[0])
            if at_once[0] == 3:
                release.set()
            await asyncio.wait_for(release.wait(), 10)  # all three are running before any ends
            at_once[0] -= 1
            return Reply(text=f"{text}: 3", usage=(100, 10))
        if text == "survey the pond" and not any(m["role"] == "tool" for m in body["messages"]):
            calls = tuple(ScriptedCall(id=f"d{i}", name="delegate",
                                       arguments=json.dumps({"task": t, "agent": "researcher"}))
                          for i, t in enumerate(TASKS))
            return Reply(tool_calls=calls, usage=(500, 30))
        return Reply(text="The pond has 3 otters, 3 beavers and 3 herons.", usage=(700, 20))

    fake_model.respond_with(respond)
    assert await chat(gw, "ann", "survey the pond") == "The pond has 3 otters, 3 beavers and 3 herons."
    assert most[0] == 3
    final = fake_model.requests[-1]
    results = [m["content"] for m in final["messages"] if m["role"] == "tool"]
    assert results == [f"{t}: 3" for t in TASKS]  # in call order
    researcher = [r for r in fake_model.requests if last_user(r) in TASKS]
    assert all(r["messages"][0]["content"].startswith("You research.") for r in researcher)

    assert gw.services is not None
    store = gw.services.store
    # The session's own turns hold no sub-turn message; each sub-turn is stored on its own.
    own = await store.messages("web:ann")
    assert [m.role for m in own] == ["user", "assistant", "tool", "tool", "tool", "assistant"]
    rows = await store.run("SELECT key FROM sessions WHERE key LIKE 'web:ann#sub:%' ORDER BY key")
    assert len(rows) == 3
    stored_tasks = sorted([(await store.messages(r["key"]))[0].content for r in rows])
    assert stored_tasks == sorted(TASKS)
    # Their tokens count toward the person's use, and /context shows them.
    usage = await chat(gw, "ann", "/usage")
    assert "Today: 1 message, 1,580 tokens." in usage  # 530 + 720 own, 3 × 110 sub-turns
    context = await chat(gw, "ann", "/context")
    assert "Sub-turns: 3 since the session loaded, 330 tokens" in context


async def test_a_sub_turn_keeps_its_own_step_limit(make_gateway: GatewayFactory, fake_model: FakeModel) -> None:
    gw = await make_gateway(agent_max_steps=15)
    sub_requests: list[dict[str, Any]] = []

    def respond(body: dict[str, Any]) -> Any:
        if any(m["role"] == "user" and m["content"] == "loop forever" for m in body["messages"]):
            sub_requests.append(body)
            if body.get("tools"):
                return Reply(tool_calls=(ScriptedCall(id=f"t{len(sub_requests)}", name="current_time",
                                                      arguments="{}"),))
            return Reply(text="stopped at my limit")
        if last_user(body) == "delegate it" and not any(m["role"] == "tool" for m in body["messages"]):
            return Reply(tool_calls=(ScriptedCall(id="d", name="delegate",
                                                  arguments=json.dumps({"task": "loop forever"})),))
        return Reply(text="done")

    fake_model.respond_with(respond)
    assert await chat(gw, "bob", "delegate it") == "done"
    # Steps 1..SUB_TURN_MAX_STEPS with tools, then one without: never the session's 15.
    assert len(sub_requests) == SUB_TURN_MAX_STEPS + 1
    assert "tools" not in sub_requests[-1] or not sub_requests[-1]["tools"]
    final = fake_model.requests[-1]
    assert [m["content"] for m in final["messages"] if m["role"] == "tool"] == ["stopped at my limit"]


async def test_a_sub_turn_cannot_delegate_and_an_unknown_agent_is_refused(make_gateway: GatewayFactory,
                                                                        fake_model: FakeModel) -> None:
    gw = await make_gateway()
    fake_model.tool_call("delegate", {"task": "x", "agent": "nobody"})
    fake_model.reply("ok")
    await chat(gw, "cy", "try")
    result = [m["content"] for m in fake_model.requests[-1]["messages"] if m["role"] == "tool"][-1]
    assert result.startswith("error: there is no agent 'nobody'")
    # Inside a sub-turn the tool is not offered, and a call to it is refused.
    fake_model.tool_call("delegate", {"task": "the inner task"})
    fake_model.tool_call("delegate", {"task": "deeper"})
    fake_model.reply("inner done")
    fake_model.reply("outer done")
    assert await chat(gw, "cy", "please delegate") == "outer done"
    inner = [r for r in fake_model.requests if last_user(r) == "the inner task"]
    assert inner and "delegate" not in tool_names(inner[0])
    inner_result = [m["content"] for m in inner[-1]["messages"] if m["role"] == "tool"]
    assert inner_result and "no tool named 'delegate'" in inner_result[-1]
