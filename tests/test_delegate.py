"""Sub-agents (SPEC §5.8): `delegate(task, agent?)` runs a sub-turn with a fresh context, its
own step limit and budget, stored apart from the session's turns, its tokens counted to the
person; at most 3 at once per turn; a sub-turn cannot delegate further."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from gateway.app import Gateway
from gateway.config.schema import ModelConfig
from gateway.turns.agent import SUB_TURN_MAX_STEPS
from gateway.turns.usage import CALL_OUTPUT_RESERVE
from tests.conftest import GatewayFactory, chat
from tests.fakes.openai_server import FakeModel, Reply, ScriptedCall

TASKS = ["count the otters", "count the beavers", "count the herons"]
DEFAULT_MAX_OUTPUT = ModelConfig().max_output_tokens


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


# -- issue 31: what one message may spend, and what a sub-turn may do --------------------------


async def _usage_row(gw: Gateway, identity: str) -> tuple[int, int]:
    """(turns, tokens) of today in the store, once the turn's end is written there."""
    assert gw.services is not None
    for _ in range(500):
        rows = await gw.services.store.run("SELECT turns, tokens FROM usage WHERE identity=?", (identity,))
        if rows:
            return int(rows[0][0]), int(rows[0][1])
        await asyncio.sleep(0.02)
    raise AssertionError(f"no usage stored for {identity}")


def delegate_results(body: dict[str, Any]) -> list[str]:
    return [str(m["content"]) for m in body["messages"] if m["role"] == "tool"]


async def test_sixty_delegates_in_one_message_stay_within_the_daily_budget(make_gateway: GatewayFactory,
                                                                           fake_model: FakeModel) -> None:
    """Issue 31: one message asking for 60 sub-turns used 54 times a 10,000-token daily
    budget. Now past `tools.delegate.max_per_step` (3) and `max_per_turn` (10) a call is
    refused unrun, and before every model call (sub-turns' too) the budget must cover the
    request and a minimal answer (gateway/turns/usage.py): the day stays within budget,
    but for what the calls in flight write past their reserve (CALL_OUTPUT_RESERVE)."""
    budget = 10_000
    gw = await make_gateway(limits={"tokens_per_user_per_day": budget})
    sub_calls = [0]

    def respond(body: dict[str, Any]) -> Any:
        if body["messages"][1]["content"].startswith("count to "):  # a sub-turn: its task only
            sub_calls[0] += 1
            return Reply(text="counted")  # usage as the fake estimates it (about 4 characters a token)
        done = sum(1 for r in delegate_results(body) if r == "counted")
        if done >= 30 or not body.get("tools"):  # enough answers (or no tools left): the reply
            return Reply(text="all counted")
        calls = tuple(ScriptedCall(id=f"d{len(body['messages'])}_{i}", name="delegate",
                                   arguments=json.dumps({"task": f"count to {i}"})) for i in range(60))
        return Reply(tool_calls=calls)

    fake_model.respond_with(respond)
    reply = await chat(gw, "una", "count everything")
    turns, tokens = await _usage_row(gw, "web:una")
    # Within budget, but for what one call may write past its reserve (usage.py's docstring).
    assert tokens <= budget + DEFAULT_MAX_OUTPUT - CALL_OUTPUT_RESERVE, (tokens, reply)
    assert turns == 1 and sub_calls[0] <= 10  # at most max_per_turn sub-turns ran, each one call here
    assert "today's budget of 10,000 tokens" in reply and "resets at 00:00" in reply
    assert gw.services is not None
    results = [m.content for m in await gw.services.store.messages("web:una") if m.role == "tool"]
    assert len(results) % 60 == 0 and results[:3] == ["counted"] * 3  # every call got a result, in order
    assert all(r.startswith("error: not run: at most 3 delegate calls run in one step") for r in results[3:60])
    # The next message is refused before any model call: today's budget is spent.
    before = len(fake_model.requests)
    over = await chat(gw, "una", "more")
    assert len(fake_model.requests) == before and "today's budget" in over


async def test_a_turn_of_delegates_is_capped_per_message(make_gateway: GatewayFactory,
                                                         fake_model: FakeModel) -> None:
    gw = await make_gateway(tools={"delegate": {"max_per_step": 4, "max_per_turn": 6}})

    def respond(body: dict[str, Any]) -> Any:
        if body["messages"][1]["content"] == "a sub-task":
            return Reply(text="sub done")
        step = sum(1 for m in body["messages"] if m["role"] == "assistant")
        if step < 3:
            return Reply(tool_calls=tuple(ScriptedCall(id=f"s{step}c{i}", name="delegate",
                                                       arguments=json.dumps({"task": "a sub-task"}))
                                          for i in range(5)))
        return Reply(text="finished")

    fake_model.respond_with(respond)
    assert await chat(gw, "vic", "go") == "finished"
    results = delegate_results(fake_model.requests[-1])
    assert len(results) == 15 and results.count("sub done") == 6  # 4 in the first step, 2 in the second
    assert results[4].startswith("error: not run: at most 4 delegate calls run in one step")
    assert all(r.startswith("error: not run: this message has run 6 delegate calls") for r in results[7:])


async def test_a_sub_turn_never_has_a_tool_its_parent_lacks(make_gateway: GatewayFactory,
                                                            fake_model: FakeModel) -> None:
    """Issue 31: an agent allowed only current_time and delegate wrote MEMORY.md through
    another agent. A sub-turn's tools are the named agent's and the parent's together; and
    it goes only to agents the parent's `agents.<name>.delegates` lists."""
    gw = await make_gateway(
        agents={"clock": {"tools": ["current_time", "delegate"], "delegates": ["wri*"]},
                "writer": {"tools": ["memory_write", "current_time"], "system_prompt": "You write notes."},
                "solo": {"tools": ["current_time", "delegate"]}},
        bindings=[{"match": {"channel": "web", "chat": "wes"}, "agent": "clock"},
                  {"match": {"channel": "web", "chat": "sol"}, "agent": "solo"}])
    assert gw.services is not None
    data_dir = gw.services.data_dir

    def memory_files() -> dict[str, str]:
        return {str(p): p.read_text(encoding="utf-8") for p in data_dir.rglob("MEMORY.md")}

    before = memory_files()

    def respond(body: dict[str, Any]) -> Any:
        if body["messages"][1]["content"] == "write the secret plan to MEMORY.md":  # the sub-turn
            if not delegate_results(body):
                return Reply(tool_calls=(ScriptedCall(id="w", name="memory_write", arguments=json.dumps(
                    {"text": "the secret plan", "target": "memory"})),))
            return Reply(text="tried")
        if not delegate_results(body):
            return Reply(tool_calls=(ScriptedCall(id="d", name="delegate", arguments=json.dumps(
                {"task": "write the secret plan to MEMORY.md", "agent": "writer"})),))
        return Reply(text="handed over")

    fake_model.respond_with(respond)
    assert await chat(gw, "wes", "remember the plan") == "handed over"
    sub = [r for r in fake_model.requests if r["messages"][1]["content"].startswith("write the secret")]
    assert sub and sub[0]["messages"][0]["content"].startswith("You write notes.")  # the writer's prompt
    assert all(set(tool_names(r)) <= {"current_time"} for r in sub)  # writer's ∩ clock's, no delegate
    assert "no tool named 'memory_write'" in delegate_results(sub[-1])[0]
    assert memory_files() == before  # nowhere, in no scope
    # The parent sees the agents it may hand work to, and only those.
    offered = next(t for t in fake_model.requests[0]["tools"] if t["function"]["name"] == "delegate")
    assert offered["function"]["parameters"]["properties"]["agent"]["enum"] == ["clock", "writer"]
    assert "solo" not in offered["function"]["description"]

    # An agent with no `delegates` hands work to itself only.
    fake_model.respond_with(None)
    fake_model.tool_call("delegate", {"task": "write the secret plan to MEMORY.md", "agent": "writer"})
    fake_model.reply("refused, as it should be")
    assert await chat(gw, "sol", "try the writer") == "refused, as it should be"
    refused = delegate_results(fake_model.requests[-1])[-1]
    assert refused.startswith("error: agent 'solo' may not hand work to 'writer'") and refused.endswith(
        "you may hand work to: solo")
    offered = next(t for t in fake_model.requests[-2]["tools"] if t["function"]["name"] == "delegate")
    assert offered["function"]["parameters"]["properties"]["agent"]["enum"] == ["solo"]
    assert not [r for r in fake_model.requests if r["messages"][1]["content"].startswith("write the secret")
                and r["messages"][0]["content"].startswith("You write notes.")][len(sub):]
