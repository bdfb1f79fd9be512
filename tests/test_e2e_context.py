"""The context engine wired into the running gateway: halving with a background summary,
summary injection, overflow recovery, clearing, restore after restart, tool-result offload."""

from __future__ import annotations

import re
from typing import Any

from context import injection_text
from context.outside import unfence
from tests.conftest import GatewayFactory, chat
from tests.fakes.openai_server import ErrorReply, FakeModel, overflow_error

SUMMARY_MARK = "working memory of a long chat"


def is_summary_request(body: dict[str, Any]) -> bool:
    return SUMMARY_MARK in str(body["messages"][0].get("content", ""))


def chat_requests(fake: FakeModel) -> list[dict[str, Any]]:
    return [r for r in fake.requests if not is_summary_request(r)]


def install_summarizer(fake: FakeModel, text: str = "## Goal\nSUMMARY-OF-EARLY-TURNS") -> None:
    fake.respond_with(lambda body: text if is_summary_request(body) else None)


def script_chat(fake: FakeModel, *answers: str | ErrorReply) -> None:
    """Answer the next chat requests with `answers` in order, summary requests with a
    summary: a background summary can never take an answer meant for the chat."""
    queue = list(answers)

    def respond(body: dict[str, Any]) -> str | ErrorReply | None:
        if is_summary_request(body):
            return "## Goal\nSUMMARY-OF-EARLY-TURNS"
        return queue.pop(0) if queue else None

    fake.respond_with(respond)


def user_texts(body: dict[str, Any]) -> list[str]:
    return [m["content"] for m in body["messages"] if m["role"] == "user"]


async def test_turn_budget_halves_and_injects_the_summary(make_gateway: GatewayFactory,
                                                          fake_model: FakeModel) -> None:
    gw = await make_gateway(agent_max_context_turns=20)
    install_summarizer(fake_model)
    for n in range(1, 21):
        assert await chat(gw, "ana", f"message {n}") == f"echo: message {n}"
    first20 = chat_requests(fake_model)[-1]
    assert user_texts(first20)[0] == "message 1" and len(user_texts(first20)) == 20

    await chat(gw, "ana", "message 21")  # the 21st turn: over the limit
    assert gw.services is not None
    await gw.services.background.wait_idle(10)
    summaries = [r for r in fake_model.requests if is_summary_request(r)]
    assert summaries, "a background summary request was made"
    assert "message 1" in str(summaries[0]["messages"])

    await chat(gw, "ana", "message 22")
    last = chat_requests(fake_model)[-1]
    texts = user_texts(last)
    # Turn 21 dropped the earliest half of the 20 complete turns: 11..22 are live now.
    assert texts[1:] == [f"message {n}" for n in range(12, 23)]
    # The summary sits in front of the first kept user message, whose own text follows
    # verbatim (injected in the request only).
    summary = await gw.services.store.latest_summary("web:ana")
    assert summary is not None and "SUMMARY-OF-EARLY-TURNS" in summary.text
    assert texts[0] == injection_text(summary.text) + "\n\nmessage 11"
    stored = await gw.services.store.messages("web:ana")
    assert len(stored) == 44  # nothing was deleted: 22 turns, user + reply each
    assert all("SUMMARY-OF-EARLY-TURNS" not in m.content for m in stored)  # never rewritten


async def test_overflow_recovery_then_clearing(make_gateway: GatewayFactory, fake_model: FakeModel) -> None:
    gw = await make_gateway()
    install_summarizer(fake_model)
    for n in range(1, 8):
        await chat(gw, "ben", f"turn {n} " + "x" * 200)
    script_chat(fake_model, overflow_error(limit=4000), "recovered answer")
    assert await chat(gw, "ben", "after overflow") == "recovered answer"
    retry = chat_requests(fake_model)[-1]
    assert user_texts(retry)[-1] == "after overflow"
    assert len(user_texts(retry)) <= 5  # at most the last 5 turns

    script_chat(fake_model, overflow_error(limit=4000), overflow_error(limit=4000), "fresh start")
    reply = await chat(gw, "ben", "overflow twice")
    assert "cleared" in reply.lower()
    assert await chat(gw, "ben", "next") == "fresh start"
    fresh = chat_requests(fake_model)[-1]
    assert user_texts(fresh) == ["next"]
    assert gw.services is not None
    assert await gw.services.store.count_messages("web:ben") == 2 * 10  # everything kept


async def test_restart_restores_text_only_recent_turns(make_gateway: GatewayFactory,
                                                       fake_model: FakeModel) -> None:
    gw = await make_gateway(agent_max_context_turns=24)  # restore keeps max(3, 24 // 6) = 4 turns
    for n in range(1, 7):
        fake_model.tool_call("current_time", {})
        fake_model.reply(f"reply {n}")
        await chat(gw, "cy", f"question {n}")
    await gw.stop()
    gw2 = await make_gateway(agent_max_context_turns=24)
    script_chat(fake_model, "restored")  # turns 1-2 are summarized meanwhile (SPEC §4.5)
    await chat(gw2, "cy", "question 7")
    last = chat_requests(fake_model)[-1]
    assert user_texts(last) == ["question 3", "question 4", "question 5", "question 6", "question 7"]
    assert not any(m["role"] == "tool" or m.get("tool_calls") for m in last["messages"])
    assert [m["content"] for m in last["messages"] if m["role"] == "assistant"] == [
        "reply 3", "reply 4", "reply 5", "reply 6"]


async def test_a_restart_restores_a_few_turns_on_either_backend(
        make_gateway: GatewayFactory, fake_model: FakeModel, store_url: str | None) -> None:
    """A lone gateway on PostgreSQL that restarts is not a hand-over: like on SQLite, the
    last max(3, 24 // 6) = 4 turns come back as text (SPEC §4.5), the rest goes to memory."""
    store = {"url": store_url} if store_url else {}
    gw = await make_gateway(agent_max_context_turns=24, store=store)
    for n in range(1, 7):
        fake_model.tool_call("current_time", {})
        fake_model.reply(f"reply {n}")
        await chat(gw, "pg", f"question {n}")
    await gw.stop()
    gw2 = await make_gateway(agent_max_context_turns=24, store=store)
    script_chat(fake_model, "restored")
    await chat(gw2, "pg", "question 7")
    last = chat_requests(fake_model)[-1]
    # (The summary of turns 1-2 may already stand in front of the first kept one.)
    texts = [t.rpartition("The user's message follows.]\n\n")[2] for t in user_texts(last)]
    assert texts == ["question 3", "question 4", "question 5", "question 6", "question 7"]
    assert not any(m["role"] == "tool" or m.get("tool_calls") for m in last["messages"])


async def test_clear_and_context_commands(make_gateway: GatewayFactory, fake_model: FakeModel) -> None:
    gw = await make_gateway()
    await chat(gw, "dee", "remember 77")
    stats = await chat(gw, "dee", "/context")
    assert "token" in stats.lower() and "turn" in stats.lower()
    assert "fresh context" in (await chat(gw, "dee", "/context clear")).lower()
    await chat(gw, "dee", "after clear")
    assert user_texts(fake_model.requests[-1]) == ["after clear"]
    await gw.stop()
    gw2 = await make_gateway()
    await chat(gw2, "dee", "after restart")
    assert user_texts(fake_model.requests[-1]) == ["after clear", "after restart"]


async def test_huge_tool_output_is_offloaded_and_can_be_followed(make_gateway: GatewayFactory,
                                                                 fake_model: FakeModel) -> None:
    gw = await make_gateway(tool_result_max_chars=2000, history_tool_result_max_chars=1000)
    assert gw.services is not None
    lines = "".join(f"line {i:05d} 日本語 🙂\r\n" for i in range(600))
    from gateway.keys import workspace_dir

    ws = workspace_dir(gw.services.data_dir, "web:eve")
    (ws / "files").mkdir(parents=True, exist_ok=True)
    (ws / "files" / "big.log").write_text(lines, encoding="utf-8", newline="")
    fake_model.tool_call("read_file", {"path": "files/big.log"})
    fake_model.reply("read it")
    await chat(gw, "eve", "read the log")
    result = unfence(next(m for m in fake_model.requests[-1]["messages"] if m["role"] == "tool")["content"])
    follow = re.search(r'read_file\(path="files/big.log", offset=(\d+)\)', result)
    assert follow, result[-600:]
    assert result.startswith(lines[: int(follow.group(1))])
    assert "tool_results/" not in result  # a file already in the workspace is not copied
    # Follow the notices with real read_file calls until the whole file has been seen.
    collected = ""
    offset = 0
    for _ in range(10):
        fake_model.tool_call("read_file", {"path": "files/big.log", "offset": offset})
        fake_model.reply("ok")
        await chat(gw, "eve", f"continue from {offset}")
        tool_msg = unfence([m for m in fake_model.requests[-1]["messages"] if m["role"] == "tool"][-1]["content"])
        nxt = re.search(r'read_file\(path="files/big.log", offset=(\d+)\)', tool_msg)
        if nxt is None:
            collected += tool_msg
            break
        end = int(nxt.group(1))
        collected += lines[offset:end]
        assert tool_msg.startswith(lines[offset:end])
        offset = end
    assert collected == lines
