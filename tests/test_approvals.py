"""Approvals (SPEC §5.7): a tool marked `ask` waits for an approver's yes before each call.
Any tool can be marked; these tests mark `current_time`, which every gateway has, so they
run where the exec sandbox cannot."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from gateway.app import Gateway
from gateway.approvals import card_files
from gateway.tools.command_files import files_named
from tests.conftest import GatewayFactory, chat, web_client
from tests.fakes import telegram_server
from tests.fakes.openai_server import FakeModel
from tests.fakes.telegram_server import FakeTelegram
from tests.test_web_api import Events

fake_telegram = telegram_server.fake_telegram  # the fixture

ASK = {"tools": {"current_time": "ask"}}


def _base(gw: Gateway) -> str:
    assert gw.http is not None
    return f"http://127.0.0.1:{gw.http.port}"


def tool_result(request: dict[str, Any]) -> str:
    return str([m for m in request["messages"] if m["role"] == "tool"][-1]["content"])


async def answer(gw: Gateway, approval: str, session: str, decision: str) -> tuple[int, dict[str, Any]]:
    async with web_client(gw) as http:
        async with http.post(f"{_base(gw)}/api/approvals/{approval}",
                             json={"session": session, "decision": decision}) as resp:
            return resp.status, await resp.json()


async def test_the_web_card_is_answered_by_an_approver_once(make_gateway: GatewayFactory,
                                                            fake_model: FakeModel) -> None:
    gw = await make_gateway(admins=["web:boss"], approvals=ASK)
    fake_model.tool_call("current_time", {"timezone": "Europe/Berlin"})
    fake_model.reply("It is noon.")
    async with web_client(gw) as http:
        async with http.post(_base(gw) + "/api/chat",
                             json={"session": "boss", "text": "what time?", "stream": True}) as resp:
            events = Events(resp)
            event, card = await events.next(timeout=10)
            while event != "approval":
                event, card = await events.next(timeout=10)
            assert card["tool"] == "current_time" and '"timezone": "Europe/Berlin"' in card["arguments"]
            assert len(fake_model.requests) == 1  # nothing ran yet
            # Someone who is not an approver is refused and changes nothing.
            status, body = await answer(gw, card["id"], "eve", "allow")
            assert status == 200 and body["notice"] == "Only an admin can answer this."
            status, body = await answer(gw, card["id"], "boss", "allow")
            assert body["notice"] == "Allowed."
            status, body = await answer(gw, card["id"], "boss", "deny")  # a double click
            assert "decided already: Allowed by web:boss." in body["notice"]
            rest = await events.rest()
    assert ("approval_done", {"id": card["id"], "outcome": "Allowed by web:boss."}) in rest
    assert rest[-1] == ("done", {"reply": "It is noon."})
    assert "CET" in tool_result(fake_model.requests[-1])  # it ran, in the zone asked for
    assert gw.services is not None
    rows = await gw.services.store.run("SELECT decision, decided_by, session_key, tool FROM approvals")
    assert [tuple(r) for r in rows] == [("allow", "web:boss", "web:boss", "current_time")]


async def test_deny_by_text_and_a_timeout_reach_the_model_as_the_result(make_gateway: GatewayFactory,
                                                                       fake_model: FakeModel) -> None:
    gw = await make_gateway(admins=["web:boss"], approvals={**ASK, "timeout_s": 30})
    fake_model.tool_call("current_time", {})
    fake_model.reply("Fine, no time then.")
    asking = asyncio.ensure_future(chat(gw, "alice", "what time?"))
    assert gw.services is not None
    rows: list[Any] = []
    for _ in range(200):
        rows = await gw.services.store.run("SELECT id FROM approvals WHERE decision IS NULL")
        if rows:
            break
        await asyncio.sleep(0.05)
    (pending,) = rows
    assert "Only an admin" in await chat(gw, "alice", f"/deny {pending['id']}")  # not hers to answer
    assert await chat(gw, "boss", f"/deny {pending['id']}") == "Denied."
    assert await asyncio.wait_for(asking, 10) == "Fine, no time then."
    assert tool_result(fake_model.requests[-1]) == "error: the call was not run. Denied by web:boss."

    await gw.stop(timeout=5)
    gw = await make_gateway(admins=["web:boss"], approvals={**ASK, "timeout_s": 0.3})
    fake_model.tool_call("current_time", {})
    fake_model.reply("Nobody answered.")
    assert await chat(gw, "alice", "time?") == "Nobody answered."
    assert tool_result(fake_model.requests[-1]) == ("error: the call was not run. Denied: nobody answered "
                                                    "within 0.3 s.")


async def test_participants_answer_in_their_own_session(make_gateway: GatewayFactory, fake_model: FakeModel) -> None:
    gw = await make_gateway(approvals={**ASK, "approvers": "participants"})
    fake_model.tool_call("current_time", {})
    fake_model.reply("done")
    asking = asyncio.ensure_future(chat(gw, "carol", "time?"))
    assert gw.services is not None
    for _ in range(200):
        rows = await gw.services.store.run("SELECT id FROM approvals WHERE decision IS NULL")
        if rows:
            break
        await asyncio.sleep(0.05)
    approval = rows[0]["id"]
    assert (await answer(gw, approval, "mallory", "allow"))[1]["notice"].startswith("Only someone in that")
    assert (await answer(gw, approval, "carol", "allow"))[1]["notice"] == "Allowed."
    assert await asyncio.wait_for(asking, 10) == "done"


async def test_participants_of_the_delegating_session_answer_a_sub_turns_card(
        make_gateway: GatewayFactory, fake_model: FakeModel) -> None:
    """SPEC §5.7: a sub-turn's card (its session is `web:dora#sub:…`) is answered by the
    participants of the session that delegated, and by nobody else but an admin."""
    gw = await make_gateway(approvals={**ASK, "approvers": "participants"})
    fake_model.tool_call("delegate", {"task": "look at the clock"})
    fake_model.tool_call("current_time", {})  # the sub-turn's call: it asks
    fake_model.reply("the sub-turn saw the time")
    fake_model.reply("done")
    async with web_client(gw) as http:
        async with http.post(_base(gw) + "/api/chat",
                             json={"session": "dora", "text": "time?", "stream": True}) as resp:
            events = Events(resp)
            event, card = await events.next(timeout=10)
            while event != "approval":
                event, card = await events.next(timeout=10)
            assert gw.services is not None
            rows = await gw.services.store.run("SELECT session_key FROM approvals WHERE id=?", (card["id"],))
            assert rows[0]["session_key"].startswith("web:dora#sub:")
            _, body = await answer(gw, card["id"], "mallory", "allow")
            assert body["notice"].startswith("Only someone in that")
            _, body = await answer(gw, card["id"], "dora", "allow")
            assert body["notice"] == "Allowed."
            rest = await events.rest()
    assert rest[-1] == ("done", {"reply": "done"})
    sub = [r for r in fake_model.requests if r["messages"][-1]["role"] == "tool"
           and r["messages"][1]["content"] == "look at the clock"]
    assert sub and not tool_result(sub[-1]).startswith("error:")  # the call ran, allowed by the delegator


async def test_a_restart_while_waiting_is_a_deny_and_the_card_says_so(
        make_gateway: GatewayFactory, fake_model: FakeModel, fake_telegram: FakeTelegram) -> None:
    section = {"telegram": {"enabled": True, "token": fake_telegram.token, "base_url": fake_telegram.base_url,
                            "base_file_url": fake_telegram.base_file_url, "poll_timeout_s": 1}}
    settings: dict[str, Any] = {"access": {"dm_policy": "open"}, "channels": section, "approvals": ASK,
                                "admins": ["telegram:1"]}
    gw = await make_gateway(**settings)
    fake_model.tool_call("current_time", {})
    fake_telegram.push_message(chat_id=5, user_id=5, text="time please")
    shown = await fake_telegram.wait_shown(5, lambda texts: any("Approval needed" in t for t in texts), timeout=10)
    card = next(t for t in shown if "Approval needed" in t)
    assert "/allow" in card and "current_time" in card
    await gw.stop(timeout=0)  # the gateway goes while the turn waits

    fake_model.reply("Answered after the restart.")
    gw = await make_gateway(**settings)
    await fake_telegram.wait_shown(5, lambda texts: any("restarted while this waited" in t for t in texts),
                                   timeout=10)
    assert gw.services is not None
    rows = await gw.services.store.run("SELECT decision FROM approvals")
    assert [r["decision"] for r in rows] == ["restart"]  # never a silent yes
    await fake_telegram.wait_shown(5, lambda texts: "Answered after the restart." in texts, timeout=10)
    assert "not run" in tool_result(fake_model.requests[-1])


async def test_approvals_are_config_json_s_alone_never_chat_s(make_gateway: GatewayFactory, tmp_path: Path) -> None:
    """Issue 31: `approvals.*` decides who must approve what the agent does. An admin's
    account in chat (or a session acting as one) must not wave its own tools through."""
    gw = await make_gateway(admins=["web:boss"], approvals={"tools": {"exec": "ask"}})
    before = (tmp_path / "config.json").read_text()
    for change in ("approvals.tools.exec allow", 'approvals.tools {}', 'approvals {"tools": {}}',
                   "approvals.approvers participants", "approvals.timeout_s 99999",
                   "approvals.tools.web_fetch allow", "approvals.after_outside_content []",
                   "approvals.route approvers"):
        answer = await chat(gw, "boss", f"/config {change}")
        assert "operator's decision; change it in config.json, not in chat" in answer, (change, answer)
    assert (tmp_path / "config.json").read_text() == before
    assert gw.cfg.approvals.tools == {"exec": "ask"} and gw.cfg.approvals.approvers == "admins"
    assert "approvals.tools.exec" in await chat(gw, "boss", "/config approvals.tools.exec")  # still shown


# -- the workspace files a command names (issue 31: `sh memory/<day>.md` ran a staged script)


def test_the_files_a_command_names_are_found_without_running_it() -> None:
    assert files_named("sh memory/2025-01-01.md")[-1] == "memory/2025-01-01.md"
    assert {"a.sh", "b.py", "c.txt", "d.env", "e.sh", "f.md", "g.csv"} <= set(files_named(
        "bash ./a.sh && python3 b.py < c.txt; . d.env; source e.sh | cat /workspace/f.md --in=g.csv"))
    assert "out.txt" not in files_named("cat a > out.txt") and "log" not in files_named("x 2>> log")
    assert "run.sh" in files_named("sh -c 'bash run.sh'") and "k" in files_named("echo $(cat k)")
    assert "memory/day.md" in files_named("cd memory && sh day.md")
    assert "memory/x.md" in files_named("F=memory/x.md; sh $F")
    assert files_named("cat ../../etc/passwd /etc/shadow ~/.ssh/id_rsa") == ["cat"]
    assert files_named("sh 'unclosed") == ["sh", "'unclosed"]  # an unbalanced quote: still words
    assert len(files_named(" ".join(f"f{i}" for i in range(1000)))) == 64


def test_card_files_are_read_beneath_the_workspace_and_shown_when_short(tmp_path: Path) -> None:
    root = tmp_path / "ws"
    (root / "memory").mkdir(parents=True)
    (root / "memory" / "2025-01-01.md").write_text("# 2025-01-01\n\nrm -f MEMORY.md\x1b[2K\n")
    (root / "long.sh").write_text("echo hi\n" * 41)  # over 40 lines
    (root / "huge.sh").write_text("x" * 100_000)
    (root / "blob").write_bytes(b"\x7fELF\x00\x01")
    (tmp_path / "secret").write_text("the other scope's secret")
    (root / "link").symlink_to(tmp_path / "secret")
    (root / "hop").symlink_to(tmp_path)  # a directory symlink on the way
    os.mkfifo(root / "fifo")  # opening it must not wait for a writer
    names = ["sh", "memory/2025-01-01.md", "long.sh", "huge.sh", "blob", "link", "hop/secret", "fifo", "memory",
             "../secret", "missing", "memory/*.md"]
    files = {f.name: f for f in card_files(root, names)}
    assert list(files) == ["memory/2025-01-01.md", "long.sh", "huge.sh", "blob", "link", "fifo"]
    note = files["memory/2025-01-01.md"]
    assert note.text == "# 2025-01-01\n\nrm -f MEMORY.md\\x1b[2K\n" and note.size == 34  # escaped, like the command
    assert files["long.sh"].text is None and files["long.sh"].note == "too long to show"
    assert files["huge.sh"].text is None and files["huge.sh"].size == 100_000
    assert files["blob"].note == "not text" and files["fifo"].note == "not a regular file"
    assert files["link"].text is None and str(tmp_path / "secret") in files["link"].note  # named, never read
    assert all("secret" not in (f.text or "") for f in files.values())
    assert [f.name for f in card_files(root, ["memory/*.md"])] == ["memory/2025-01-01.md"]  # a glob's matches
    assert card_files(tmp_path / "none", ["x"]) == ()
