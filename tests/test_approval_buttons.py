"""Approval cards with Allow and Deny buttons (SPEC §5.7) on Telegram, Slack and Discord,
end to end: the whole gateway, the real client libraries, the fakes of tests/fakes/ (which
check the platforms' own rules: keyboard shapes and callback data, Block Kit limits,
components, and that every press is answered, Discord's within 3 s). For each platform:
a press by someone who may not answer (refused, nothing changes), Allow, a double press
(the second finds it decided), Deny, no answer (a deny), a restart while waiting (the card
says so and its buttons are gone; a press from a client that had not seen that is
answered), and arguments too long for one message, shown whole. Then the card layouts
alone, and junk presses."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import discord
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from slack_sdk.errors import SlackApiError
from slack_sdk.web.async_client import AsyncWebClient
from telegram import Bot, InlineKeyboardButton, InlineKeyboardMarkup
from telegram.error import BadRequest

from channels.base import ApprovalCard, CardFile, visible
from channels.discord.approvals import card_content, components, file_messages
from channels.discord.format import DISCORD_TEXT_LIMIT
from channels.discord.transport import DiscordHttp, DiscordRest
from channels.slack.approvals import SECTION_LIMIT, card_blocks, code_pieces, unescape
from channels.slack.events import parse_block_action
from channels.telegram.approvals import CALLBACK_DATA_LIMIT, keyboard, render_card
from channels.telegram.format import TELEGRAM_TEXT_LIMIT, utf16_len
from channels.telegram.updates import parse_callback
from gateway.app import Gateway
from gateway.approvals import pretty_arguments
from gateway.keys import workspace_dir
from tests.approval_screenshots import NAMES, entities_html, take
from tests.conftest import GatewayFactory
from tests.fakes import discord_server, slack_server, telegram_server
from tests.fakes.discord_server import FakeDiscord
from tests.fakes.openai_server import FakeModel
from tests.fakes.slack_server import FakeSlack, event_callback, signed_event_request, signed_interaction_request
from tests.fakes.telegram_server import FakeTelegram
from tests.test_web_page import chromium_path  # noqa: F401  (a fixture)

fake_telegram = telegram_server.fake_telegram  # the fixtures
fake_slack = slack_server.fake_slack
fake_discord = discord_server.fake_discord

ASK = {"tools": {"current_time": "ask"}}
BERLIN = {"timezone": "Europe/Berlin"}
LONG = {"timezone": "Z" * 10_000}  # a 10,000-character argument


def tool_result(request: dict[str, Any]) -> str:
    return str([m for m in request["messages"] if m["role"] == "tool"][-1]["content"])


async def until(predicate: Callable[[], Any], timeout: float = 15) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.02)
    return value


async def decisions(gw: Gateway) -> list[tuple[Any, Any]]:
    assert gw.services is not None
    rows = await gw.services.store.run("SELECT decision, decided_by FROM approvals ORDER BY asked_at")
    return [(r["decision"], r["decided_by"]) for r in rows]


# ---------------------------------------------------------------------------- Telegram


def telegram_settings(fake: FakeTelegram, **approvals: Any) -> dict[str, Any]:
    return {"access": {"dm_policy": "open", "allow_from": ["*"]}, "admins": ["telegram:1"],
            "approvals": {**ASK, **approvals},
            "channels": {"telegram": {"enabled": True, "token": fake.token, "base_url": fake.base_url,
                                      "base_file_url": fake.base_file_url, "poll_timeout_s": 1}}}


async def telegram_card(fake: FakeTelegram, chat: int, after: int = 0) -> int:
    """The id of the first card with buttons in `chat` newer than message `after`."""
    found: list[int] = await until(lambda: [m for m in fake.message_ids(chat) if m > after and fake.buttons(m)])
    return found[0]


def card_text(fake: FakeTelegram, message_id: int) -> str:
    return next(p.text for mid, p in zip(fake.message_ids(), fake.shown_parsed(), strict=True) if mid == message_id)


async def test_telegram_a_stranger_is_refused_an_admin_allows_once(
        make_gateway: GatewayFactory, fake_model: FakeModel, fake_telegram: FakeTelegram) -> None:
    gw = await make_gateway(**telegram_settings(fake_telegram))
    fake_model.tool_call("current_time", BERLIN)
    fake_model.reply("It is noon.")
    bot = f"@{fake_telegram.bot_username}"
    fake_telegram.push_message(chat_id=-100, user_id=2, text=f"{bot} what time is it?", chat_type="supergroup",
                               entities=[{"type": "mention", "offset": 0, "length": len(bot)}])
    card = await telegram_card(fake_telegram, -100)
    assert fake_telegram.buttons(card) == ["Allow", "Deny"]
    shown = fake_telegram.shown_parsed(-100)[-1]
    assert shown.text.startswith("Approval needed (") and "current_time" in shown.text
    pre = next(e for e in shown.entities if e["type"] == "pre")
    assert json.loads(shown.text[pre["offset"]:pre["offset"] + pre["length"]]) == BERLIN
    (approval_id,) = await pending_ids(gw)
    sent = fake_telegram.calls_of("sendMessage")[-1]
    assert sent["reply_markup"]["inline_keyboard"][0][0]["callback_data"] == f"ap:{approval_id}:a"
    assert sent["reply_parameters"]["message_id"] > 0  # in a group it answers the person's message

    # The person who asked is no admin: refused, and nothing changes.
    refused = fake_telegram.push_callback(chat_id=-100, user_id=2, message_id=card, data=f"ap:{approval_id}:a")
    assert (await fake_telegram.wait_answer(refused))["text"] == "Only an admin can answer this."
    assert await decisions(gw) == [(None, None)] and len(fake_model.requests) == 1
    assert fake_telegram.buttons(card) == ["Allow", "Deny"]

    # An admin double-presses: Allow, then Deny before the buttons went away.
    first = fake_telegram.push_callback(chat_id=-100, user_id=1, message_id=card, data=f"ap:{approval_id}:a")
    second = fake_telegram.push_callback(chat_id=-100, user_id=1, message_id=card, data=f"ap:{approval_id}:d")
    assert (await fake_telegram.wait_answer(first))["text"] == "Allowed."
    assert "decided already: Allowed by telegram:1." in (await fake_telegram.wait_answer(second))["text"]
    await fake_telegram.wait_shown(-100, lambda texts: "It is noon." in texts, timeout=15)
    assert "CET" in tool_result(fake_model.requests[-1])  # it ran, once
    assert await decisions(gw) == [("allow", "telegram:1")]
    await until(lambda: card_text(fake_telegram, card).endswith("Allowed by telegram:1."))
    assert fake_telegram.buttons(card) == []  # nothing left to press
    assert fake_telegram.unanswered() == []


async def pending_ids(gw: Gateway) -> list[str]:
    assert gw.services is not None
    rows = await until_rows(gw, "SELECT id FROM approvals WHERE decision IS NULL")
    return [r["id"] for r in rows]


async def until_rows(gw: Gateway, sql: str) -> list[Any]:
    assert gw.services is not None
    deadline = time.monotonic() + 15
    while not (rows := await gw.services.store.run(sql)):
        assert time.monotonic() < deadline, "timed out waiting for " + sql
        await asyncio.sleep(0.05)
    return list(rows)


async def test_telegram_deny_then_no_answer(make_gateway: GatewayFactory, fake_model: FakeModel,
                                            fake_telegram: FakeTelegram) -> None:
    settings_ = telegram_settings(fake_telegram, timeout_s=60)
    gw = await make_gateway(**settings_)
    fake_model.tool_call("current_time", {})
    fake_model.reply("Fine, no time then.")
    fake_telegram.push_message(chat_id=1, user_id=1, text="time?")
    card = await telegram_card(fake_telegram, 1)
    (approval_id,) = await pending_ids(gw)
    query = fake_telegram.push_callback(chat_id=1, user_id=1, message_id=card, data=f"ap:{approval_id}:d")
    assert (await fake_telegram.wait_answer(query))["text"] == "Denied."
    await fake_telegram.wait_shown(1, lambda texts: "Fine, no time then." in texts, timeout=15)
    assert tool_result(fake_model.requests[-1]) == "error: the call was not run. Denied by telegram:1."
    await until(lambda: card_text(fake_telegram, card).endswith("Denied by telegram:1.") and
                not fake_telegram.buttons(card))
    await gw.stop(timeout=5)

    gw = await make_gateway(**{**settings_, "approvals": {**ASK, "timeout_s": 0.5}})
    fake_model.tool_call("current_time", {})
    fake_model.reply("Nobody answered.")
    fake_telegram.push_message(chat_id=1, user_id=1, text="time again?")
    second = await telegram_card(fake_telegram, 1, after=card)
    await until(lambda: card_text(fake_telegram, second).endswith("Denied: nobody answered within 0.5 s.")
                and not fake_telegram.buttons(second))
    await fake_telegram.wait_shown(1, lambda texts: "Nobody answered." in texts, timeout=15)
    assert "nobody answered within 0.5 s" in tool_result(fake_model.requests[-1])


async def test_telegram_a_restart_while_waiting_updates_the_card(
        make_gateway: GatewayFactory, fake_model: FakeModel, fake_telegram: FakeTelegram) -> None:
    gw = await make_gateway(**telegram_settings(fake_telegram))
    fake_model.tool_call("current_time", {})
    fake_telegram.push_message(chat_id=1, user_id=1, text="time please")
    card = await telegram_card(fake_telegram, 1)
    (approval_id,) = await pending_ids(gw)
    await gw.stop(timeout=0)  # the gateway goes while the turn waits

    fake_model.reply("Answered after the restart.")
    gw = await make_gateway(**telegram_settings(fake_telegram))
    await until(lambda: "restarted while this waited" in card_text(fake_telegram, card))
    assert fake_telegram.buttons(card) == []
    # A client that had not seen the edit yet presses Allow: answered from the id alone.
    late = fake_telegram.push_callback(chat_id=1, user_id=1, message_id=card, data=f"ap:{approval_id}:a",
                                       stale=True)
    notice = (await fake_telegram.wait_answer(late))["text"]
    assert notice.startswith(f"Approval {approval_id} was decided already: Denied: the gateway restarted")
    assert [d for d, _ in await decisions(gw)] == ["restart"]  # never a silent yes
    await fake_telegram.wait_shown(1, lambda texts: "Answered after the restart." in texts, timeout=15)


async def test_telegram_long_arguments_are_shown_whole(make_gateway: GatewayFactory, fake_model: FakeModel,
                                                       fake_telegram: FakeTelegram) -> None:
    gw = await make_gateway(**telegram_settings(fake_telegram))
    medium = {"timezone": "Y" * 2_000}
    fake_model.tool_call("current_time", LONG)
    fake_model.tool_call("current_time", medium)
    fake_model.reply("Both denied.")
    fake_telegram.push_message(chat_id=1, user_id=1, text="time, verbosely")
    card = await telegram_card(fake_telegram, 1)
    (approval_id,) = await pending_ids(gw)
    # Too long for a message: the whole arguments as a file, sent first; the card names it.
    ((method, name, data),) = fake_telegram.uploads
    assert (method, name) == ("sendDocument", f"approval-{approval_id}.json")
    assert data.decode() == pretty_arguments(json.dumps(LONG)) and json.loads(data) == LONG
    assert f"approval-{approval_id}.json" in card_text(fake_telegram, card)
    query = fake_telegram.push_callback(chat_id=1, user_id=1, message_id=card, data=f"ap:{approval_id}:d")
    await fake_telegram.wait_answer(query)

    # Long but within a message: one pre block holding all of it, never folded.
    second = await telegram_card(fake_telegram, 1, after=card)
    parsed = next(p for mid, p in zip(fake_telegram.message_ids(), fake_telegram.shown_parsed(), strict=True)
                  if mid == second)
    assert [e["type"] for e in parsed.entities] == ["bold", "code", "pre"]
    quote = parsed.entities[2]
    assert json.loads(parsed.text[quote["offset"]:quote["offset"] + quote["length"]]) == medium
    (approval_id,) = await pending_ids(gw)
    query = fake_telegram.push_callback(chat_id=1, user_id=1, message_id=second, data=f"ap:{approval_id}:d")
    await fake_telegram.wait_answer(query)
    await fake_telegram.wait_shown(1, lambda texts: "Both denied." in texts, timeout=15)
    assert len(fake_telegram.uploads) == 1


# A command the red team hid (issue 31), in the middle of 20 lines (Telegram folded 15+ lines).
HIDDEN_COMMAND = "\n".join([*(f"echo step {i}" for i in range(10)), "rm MEMORY.md\r\x1b[2Kls -la",
                             "echo \u202eok\u202c \u200brm\u2060", *(f"echo step {i}" for i in range(10, 18))])
EXEC = {"exec": {"enabled": True}}
FILLER = ("echo " + "f" * 32 + "\n") * 34


async def test_telegram_a_hidden_command_and_the_script_it_runs_are_shown(
        make_gateway: GatewayFactory, fake_model: FakeModel, fake_telegram: FakeTelegram) -> None:
    gw = await make_gateway(**telegram_settings(fake_telegram, tools={"exec": "ask"}), tools=EXEC)
    fake_model.tool_call("exec", {"command": HIDDEN_COMMAND})
    fake_model.reply("Not run.")
    fake_telegram.push_message(chat_id=1, user_id=1, text="tidy up")
    card = await telegram_card(fake_telegram, 1)
    parsed = next(p for mid, p in zip(fake_telegram.message_ids(), fake_telegram.shown_parsed(), strict=True)
                  if mid == card)
    assert [e["type"] for e in parsed.entities] == ["bold", "code", "pre"]  # one block, nothing folded
    pre = parsed.entities[2]
    shown = parsed.text[pre["offset"]:pre["offset"] + pre["length"]]
    assert shown == visible(HIDDEN_COMMAND) and shown.count("\n") == 19
    assert "rm MEMORY.md\\r\\x1b[2Kls -la" in shown and "echo \\u202eok\\u202c \\u200brm\\u2060" in shown
    assert RAW.search(parsed.text) is None and fake_telegram.uploads == []
    (approval_id,) = await pending_ids(gw)
    await fake_telegram.wait_answer(fake_telegram.push_callback(chat_id=1, user_id=1, message_id=card,
                                                                data=f"ap:{approval_id}:d"))
    await fake_telegram.wait_shown(1, lambda texts: "Not run." in texts, timeout=15)

    # A script staged in today's note with memory_write, then run with sh: the card shows it.
    assert gw.services is not None
    day = gw.services.memory.today()
    script = "echo hello\nrm -f MEMORY.md\x1b[1A\x1b[2K\n"
    fake_model.tool_call("memory_write", {"text": script, "target": "daily"})
    fake_model.tool_call("exec", {"command": f"sh memory/{day}.md"})
    fake_model.reply("Not run either.")
    fake_telegram.push_message(chat_id=1, user_id=1, text="run my note")
    second = await telegram_card(fake_telegram, 1, after=card)
    text = card_text(fake_telegram, second)
    assert f"memory/{day}.md (" in text and "rm -f MEMORY.md\\x1b[1A\\x1b[2K" in text, text
    assert RAW.search(text) is None
    (approval_id,) = await pending_ids(gw)
    await fake_telegram.wait_answer(fake_telegram.push_callback(chat_id=1, user_id=1, message_id=second,
                                                                data=f"ap:{approval_id}:d"))
    await fake_telegram.wait_shown(1, lambda texts: "Not run either." in texts, timeout=15)
    assert "rm -f MEMORY.md\\x1b[1A" in card_text(fake_telegram, second)  # the decided card keeps it

    # Named files too long together for the card: each a message of its own just before it.
    workspace = workspace_dir(gw.services.data_dir, "telegram:user:1")
    assert (workspace / "memory" / f"{day}.md").is_file()
    for name in ("a.sh", "b.sh", "c.sh"):
        (workspace / name).write_text(f"# {name}\n" + FILLER)  # 1,300 characters each, 35 lines
    fake_model.tool_call("exec", {"command": "sh a.sh; sh b.sh; sh c.sh"})
    fake_model.reply("Not run at all.")
    before = len(fake_telegram.message_ids(1))
    fake_telegram.push_message(chat_id=1, user_id=1, text="run the three")
    third = await telegram_card(fake_telegram, 1, after=second)
    ids = fake_telegram.message_ids(1)
    shown_before = [card_text(fake_telegram, m) for m in ids[before:ids.index(third)]]
    assert [t.split("\n")[1].split(" ")[0] for t in shown_before if t.startswith("A workspace file")] == \
        ["a.sh", "b.sh", "c.sh"]
    assert all(FILLER in t for t in shown_before if t.startswith("A workspace file"))
    assert "shown just above: a.sh, b.sh, c.sh" in card_text(fake_telegram, third)
    (approval_id,) = await pending_ids(gw)
    await fake_telegram.wait_answer(fake_telegram.push_callback(chat_id=1, user_id=1, message_id=third,
                                                                data=f"ap:{approval_id}:d"))
    await fake_telegram.wait_shown(1, lambda texts: "Not run at all." in texts, timeout=15)


async def test_telegram_presses_reach_a_webhook(make_gateway: GatewayFactory, fake_model: FakeModel,
                                               fake_telegram: FakeTelegram) -> None:
    secret = "hook-secret-0123456789"
    settings_ = telegram_settings(fake_telegram)
    settings_["channels"]["telegram"].update(mode="webhook", webhook_url="https://bot.example/telegram/webhook",
                                             webhook_secret=secret)
    gw = await make_gateway(**settings_)
    assert gw.http is not None and fake_telegram.webhook is not None
    assert "callback_query" in fake_telegram.webhook["allowed_updates"]  # else Telegram never sends presses
    fake_model.tool_call("current_time", {})
    fake_model.reply("Allowed, it ran.")
    message = {"message_id": 90, "date": int(time.time()), "text": "time?",
               "chat": {"id": 1, "type": "private", "first_name": "A"},
               "from": {"id": 1, "is_bot": False, "first_name": "A"}}
    url = f"http://127.0.0.1:{gw.http.port}/telegram/webhook"
    headers = {"X-Telegram-Bot-Api-Secret-Token": secret}
    async with aiohttp.ClientSession() as http:
        async with http.post(url, json={"update_id": 900, "message": message}, headers=headers) as resp:
            assert resp.status == 200
        card = await telegram_card(fake_telegram, 1)
        (approval_id,) = await pending_ids(gw)
        query, update = fake_telegram.callback_update(chat_id=1, user_id=1, message_id=card,
                                                      data=f"ap:{approval_id}:a")
        async with http.post(url, json={**update, "update_id": 901}, headers=headers) as resp:
            assert resp.status == 200
    assert (await fake_telegram.wait_answer(query))["text"] == "Allowed."
    await fake_telegram.wait_shown(1, lambda texts: "Allowed, it ran." in texts, timeout=15)


async def test_telegram_participants_answer_in_their_own_conversation(
        make_gateway: GatewayFactory, fake_model: FakeModel, fake_telegram: FakeTelegram) -> None:
    """`participants`: in a forum topic (one session for everyone in it) another member may
    answer; at a group's top level (a session per person) only the one who asked."""
    gw = await make_gateway(**telegram_settings(fake_telegram, approvers="participants"))
    bot = f"@{fake_telegram.bot_username}"
    mention = [{"type": "mention", "offset": 0, "length": len(bot)}]
    fake_model.tool_call("current_time", {})
    fake_model.reply("Topic answered.")
    fake_telegram.push_message(chat_id=-100, user_id=2, text=f"{bot} time?", chat_type="supergroup", thread_id=7,
                               entities=mention)
    card = await telegram_card(fake_telegram, -100)
    assert fake_telegram.calls_of("sendMessage")[-1]["message_thread_id"] == 7
    (approval_id,) = await pending_ids(gw)
    query = fake_telegram.push_callback(chat_id=-100, user_id=3, message_id=card, data=f"ap:{approval_id}:a")
    assert (await fake_telegram.wait_answer(query))["text"] == "Allowed."
    await fake_telegram.wait_shown(-100, lambda texts: "Topic answered." in texts, timeout=15)

    fake_model.tool_call("current_time", {})
    fake_model.reply("Top level answered.")
    fake_telegram.push_message(chat_id=-100, user_id=2, text=f"{bot} and now?", chat_type="supergroup",
                               entities=mention)
    second = await telegram_card(fake_telegram, -100, after=card)
    (approval_id,) = await pending_ids(gw)
    query = fake_telegram.push_callback(chat_id=-100, user_id=3, message_id=second, data=f"ap:{approval_id}:a")
    assert (await fake_telegram.wait_answer(query))["text"].startswith("Only someone in that conversation")
    query = fake_telegram.push_callback(chat_id=-100, user_id=2, message_id=second, data=f"ap:{approval_id}:a")
    assert (await fake_telegram.wait_answer(query))["text"] == "Allowed."
    await fake_telegram.wait_shown(-100, lambda texts: "Top level answered." in texts, timeout=15)
    assert await decisions(gw) == [("allow", "telegram:3"), ("allow", "telegram:2")]


async def test_telegram_a_deleted_card_gets_its_outcome_as_a_message(
        make_gateway: GatewayFactory, fake_model: FakeModel, fake_telegram: FakeTelegram) -> None:
    gw = await make_gateway(**telegram_settings(fake_telegram))
    fake_model.tool_call("current_time", {})
    fake_model.reply("Denied by text.")
    fake_telegram.push_message(chat_id=1, user_id=1, text="time?")
    card = await telegram_card(fake_telegram, 1)
    (approval_id,) = await pending_ids(gw)
    fake_telegram.delete_by_person(card)
    fake_telegram.push_message(chat_id=1, user_id=1, text=f"/deny {approval_id}")
    await fake_telegram.wait_shown(1, lambda texts: f"Approval {approval_id}: Denied by telegram:1." in texts,
                                   timeout=15)
    await fake_telegram.wait_shown(1, lambda texts: "Denied by text." in texts, timeout=15)


# ---------------------------------------------------------------------------- Slack


def slack_settings(fake: FakeSlack, **section: Any) -> dict[str, Any]:
    approvals = section.pop("approvals", {})
    return {"access": {"dm_policy": "open", "allow_from": ["slack:C1"]}, "admins": ["slack:U1"],
            "approvals": {**ASK, **approvals},
            "channels": {"slack": {"enabled": True, "bot_token": fake.bot_token, "app_token": fake.app_token,
                                   "base_url": fake.base_url, **section}}}


async def slack_card(fake: FakeSlack, channel: str, *, besides: str = "") -> slack_server.FakeMessage:
    """The card with buttons in `channel` (other than the one with ts `besides`)."""
    found = await until(lambda: [m for m in fake.messages.values()
                                 if m.channel == channel and m.buttons() and m.ts != besides])
    return found[0]


def slack_mention(fake: FakeSlack, user: str, ts: str, text: str) -> dict[str, Any]:
    return {"type": "app_mention", "user": user, "text": f"<@{fake.bot_user_id}> {text}", "ts": ts,
            "channel": "C1", "channel_type": "channel"}


async def test_slack_a_stranger_is_refused_an_admin_allows_once(
        make_gateway: GatewayFactory, fake_model: FakeModel, fake_slack: FakeSlack) -> None:
    gw = await make_gateway(**slack_settings(fake_slack))
    await fake_slack.wait_connected()
    fake_model.tool_call("current_time", BERLIN)
    fake_model.reply("It is noon.")
    await fake_slack.push_event(slack_mention(fake_slack, "U5", "100.1", "what time is it?"))
    card = await slack_card(fake_slack, "C1")
    assert card.thread_ts == "100.1"  # in the thread the mention opened
    (approval_id,) = await pending_ids(gw)
    assert [(b["action_id"], b["value"], b["text"]["text"]) for b in card.buttons()] == [
        ("approval_allow", approval_id, "Allow"), ("approval_deny", approval_id, "Deny")]
    assert json.loads(unescape(card.section_texts()[1]).strip("`")) == BERLIN

    # U5 asked, but only admins answer: an ephemeral notice to U5 alone, nothing changes.
    envelope = await fake_slack.push_block_action(user="U5", channel="C1", ts=card.ts, action_id="approval_allow")
    await fake_slack.wait_acked(envelope)
    await fake_slack.wait_for(lambda: len(fake_slack.responses) == 1)
    assert fake_slack.responses[0]["text"] == "Only an admin can answer this."
    assert fake_slack.responses[0]["response_type"] == "ephemeral"
    assert fake_slack.responses[0]["replace_original"] is False
    assert await decisions(gw) == [(None, None)] and len(fake_model.requests) == 1

    # The admin double-presses.
    await fake_slack.push_block_action(user="U1", channel="C1", ts=card.ts, action_id="approval_allow")
    await fake_slack.push_block_action(user="U1", channel="C1", ts=card.ts, action_id="approval_deny")
    await fake_slack.wait_for(lambda: len(fake_slack.responses) == 3)
    notices = sorted(r["text"] for r in fake_slack.responses[1:])
    assert notices[0] == "Allowed." and "decided already: Allowed by slack:U1." in notices[1]
    await fake_slack.wait_for(lambda: "It is noon." in fake_slack.visible("C1", "100.1"), timeout=15)
    assert "CET" in tool_result(fake_model.requests[-1])
    assert await decisions(gw) == [("allow", "slack:U1")]
    await until(lambda: not card.buttons() and "Allowed by slack:U1." in card.section_texts()[-1])


async def test_slack_http_mode_presses_are_signed(make_gateway: GatewayFactory, fake_model: FakeModel,
                                                  fake_slack: FakeSlack) -> None:
    secret = "signing-secret-xyz"
    gw = await make_gateway(**slack_settings(fake_slack, mode="http", signing_secret=secret))
    assert gw.http is not None
    url = f"http://127.0.0.1:{gw.http.port}/slack/events"
    fake_model.tool_call("current_time", {})
    fake_model.reply("Denied, fine.")
    event = {"type": "message", "channel_type": "im", "user": "U1", "text": "time?", "ts": "200.1",
             "channel": "D1"}
    async with aiohttp.ClientSession() as http:
        body, headers = signed_event_request(secret, event_callback(event))
        async with http.post(url, data=body, headers=headers) as resp:
            assert resp.status == 200
        card = await slack_card(fake_slack, "D1")
        payload = fake_slack.block_actions_payload(user="U1", channel="D1", ts=card.ts, action_id="approval_deny")
        body, headers = signed_interaction_request(secret, payload, forge=True)
        async with http.post(url, data=body, headers=headers) as resp:
            assert resp.status == 401  # not from Slack: nothing changes
        assert await decisions(gw) == [(None, None)]
        body, headers = signed_interaction_request(secret, payload)
        async with http.post(url, data=body, headers=headers) as resp:
            assert resp.status == 200
    await fake_slack.wait_for(lambda: "Denied, fine." in fake_slack.visible("D1"), timeout=15)
    assert await decisions(gw) == [("deny", "slack:U1")]
    assert tool_result(fake_model.requests[-1]) == "error: the call was not run. Denied by slack:U1."
    await until(lambda: not card.buttons() and "Denied by slack:U1." in card.section_texts()[-1])
    assert [r["text"] for r in fake_slack.responses] == ["Denied."]


async def test_slack_no_answer_and_a_restart(make_gateway: GatewayFactory, fake_model: FakeModel,
                                             fake_slack: FakeSlack) -> None:
    gw = await make_gateway(**slack_settings(fake_slack, approvals={"timeout_s": 0.5}))
    await fake_slack.wait_connected()
    fake_model.tool_call("current_time", {})
    fake_model.reply("Nobody answered.")
    await fake_slack.push_event({"type": "message", "channel_type": "im", "user": "U1", "text": "time?",
                                 "ts": "300.1", "channel": "D1"})
    card = await slack_card(fake_slack, "D1")
    await until(lambda: not card.buttons() and "nobody answered within 0.5 s" in card.section_texts()[-1])
    await fake_slack.wait_for(lambda: "Nobody answered." in fake_slack.visible("D1"), timeout=15)
    await gw.stop(timeout=5)

    settings_ = slack_settings(fake_slack)
    gw = await make_gateway(**settings_)
    await fake_slack.wait_connected()
    fake_model.tool_call("current_time", {})
    await fake_slack.push_event({"type": "message", "channel_type": "im", "user": "U1", "text": "time again?",
                                 "ts": "301.1", "channel": "D1"})
    second = await slack_card(fake_slack, "D1", besides=card.ts)
    (approval_id,) = await pending_ids(gw)
    await gw.stop(timeout=0)  # gone while the turn waits

    fake_model.reply("Answered after the restart.")
    gw = await make_gateway(**settings_)
    await until(lambda: not second.buttons() and "restarted while this waited" in second.section_texts()[-1])
    await fake_slack.wait_connected()
    # A client that had not seen the update presses Allow: told it was decided.
    await fake_slack.push_block_action(user="U1", channel="D1", ts=second.ts, action_id="approval_allow",
                                       stale=True)
    await fake_slack.wait_for(lambda: len(fake_slack.responses) == 1)
    assert fake_slack.responses[0]["text"].startswith(f"Approval {approval_id} was decided already: Denied: "
                                                      "the gateway restarted")
    assert (await decisions(gw))[-1][0] == "restart"
    await fake_slack.wait_for(lambda: "Answered after the restart." in fake_slack.visible("D1"), timeout=15)


async def test_slack_long_arguments_are_shown_whole(make_gateway: GatewayFactory, fake_model: FakeModel,
                                                    fake_slack: FakeSlack) -> None:
    gw = await make_gateway(**slack_settings(fake_slack))
    await fake_slack.wait_connected()
    fenced = {"timezone": "a ``` b & <c>"}
    fake_model.tool_call("current_time", LONG)
    fake_model.tool_call("current_time", fenced)
    fake_model.reply("Both denied.")
    await fake_slack.push_event({"type": "message", "channel_type": "im", "user": "U1", "text": "time?",
                                 "ts": "400.1", "channel": "D1"})
    card = await slack_card(fake_slack, "D1")
    (approval_id,) = await pending_ids(gw)
    sections = card.section_texts()
    code = [s for s in sections if s.startswith("```")]
    assert len(code) == 4 and all(len(s) <= SECTION_LIMIT for s in code)  # 3,000 characters a section
    assert json.loads("".join(unescape(s[3:-3]) for s in code)) == LONG  # every character, in order
    assert fake_slack.uploads == []
    await fake_slack.push_block_action(user="U1", channel="D1", ts=card.ts, action_id="approval_deny")

    # ``` would end a code block early: the arguments go as a file with the card.
    second = await slack_card(fake_slack, "D1", besides=card.ts)
    (approval_id,) = await pending_ids(gw)
    ((upload),) = fake_slack.uploads
    assert upload["name"] == f"approval-{approval_id}.txt" and json.loads(upload["data"]) == fenced
    assert f"approval-{approval_id}.txt" in second.section_texts()[0]
    await fake_slack.push_block_action(user="U1", channel="D1", ts=second.ts, action_id="approval_deny")
    await fake_slack.wait_for(lambda: "Both denied." in fake_slack.visible("D1"), timeout=15)


async def test_slack_a_hidden_command_is_shown_escaped(make_gateway: GatewayFactory, fake_model: FakeModel,
                                                     fake_slack: FakeSlack) -> None:
    settings_ = slack_settings(fake_slack, approvals={"tools": {"exec": "ask"}})
    gw = await make_gateway(**settings_, tools=EXEC)
    await fake_slack.wait_connected()
    fake_model.tool_call("exec", {"command": HIDDEN_COMMAND})
    fake_model.reply("Not run.")
    await fake_slack.push_event({"type": "message", "channel_type": "im", "user": "U1", "text": "tidy up",
                                 "ts": "700.1", "channel": "D1"})
    card = await slack_card(fake_slack, "D1")
    code = [unescape(s[3:-3]) for s in card.section_texts() if s.startswith("```")]
    assert code == [visible(HIDDEN_COMMAND)] and RAW.search("".join(card.section_texts())) is None
    assert "rm MEMORY.md\\r\\x1b[2Kls -la" in code[0]
    assert (await pending_ids(gw)) and fake_slack.uploads == []
    await fake_slack.push_block_action(user="U1", channel="D1", ts=card.ts, action_id="approval_deny")
    await fake_slack.wait_for(lambda: "Not run." in fake_slack.visible("D1"), timeout=15)


async def test_slack_participants_of_a_thread_answer(make_gateway: GatewayFactory, fake_model: FakeModel,
                                                      fake_slack: FakeSlack) -> None:
    gw = await make_gateway(**slack_settings(fake_slack, approvals={"approvers": "participants"}))
    await fake_slack.wait_connected()
    fake_model.tool_call("current_time", {})
    fake_model.reply("Thread answered.")
    await fake_slack.push_event(slack_mention(fake_slack, "U5", "500.1", "time?"))
    card = await slack_card(fake_slack, "C1")
    # U6 is in the thread the mention opened (a session everyone in it shares): may answer.
    await fake_slack.push_block_action(user="U6", channel="C1", ts=card.ts, action_id="approval_allow")
    await fake_slack.wait_for(lambda: "Thread answered." in fake_slack.visible("C1", "500.1"), timeout=15)
    assert await decisions(gw) == [("allow", "slack:U6")]


async def test_slack_a_deleted_card_gets_its_outcome_as_a_message(
        make_gateway: GatewayFactory, fake_model: FakeModel, fake_slack: FakeSlack) -> None:
    gw = await make_gateway(**slack_settings(fake_slack))
    await fake_slack.wait_connected()
    fake_model.tool_call("current_time", {})
    fake_model.reply("Denied by text.")
    await fake_slack.push_event({"type": "message", "channel_type": "im", "user": "U1", "text": "time?",
                                 "ts": "600.1", "channel": "D1"})
    card = await slack_card(fake_slack, "D1")
    (approval_id,) = await pending_ids(gw)
    card.deleted = True  # someone deleted it
    await fake_slack.push_event({"type": "message", "channel_type": "im", "user": "U1",
                                 "text": f"/deny {approval_id}", "ts": "600.2", "channel": "D1"})
    await fake_slack.wait_for(lambda: f"Approval {approval_id}: Denied by slack:U1." in fake_slack.visible("D1"),
                              timeout=15)
    await fake_slack.wait_for(lambda: "Denied by text." in fake_slack.visible("D1"), timeout=15)


# ---------------------------------------------------------------------------- Discord

PERSON, OTHER = 4242, 4343


def discord_settings(fake: FakeDiscord, **approvals: Any) -> dict[str, Any]:
    return {"access": {"dm_policy": "open", "allow_from": [f"discord:{fake.channel_id}"]},
            "admins": [f"discord:{PERSON}"], "approvals": {**ASK, **approvals},
            "channels": {"discord": {"enabled": True, "token": fake.token, "api_base": fake.api_base}}}


async def discord_gateway(make_gateway: GatewayFactory, fake: FakeDiscord, enabled: dict[str, Any] | None = None,
                          **approvals: Any) -> Gateway:
    gw = await make_gateway(**discord_settings(fake, **approvals), **({"tools": enabled} if enabled else {}))
    await fake.wait_connected()
    await until(lambda: gw.channels["discord"].is_ready())
    return gw


async def discord_card(fake: FakeDiscord, channel: int, after: int = 0) -> int:
    found: list[dict[str, Any]] = await until(
        lambda: [m for m in fake.bot_messages(channel) if m.get("components") and int(m["id"]) > after])
    return int(found[0]["id"])


async def test_discord_a_stranger_is_refused_an_admin_allows_once(
        make_gateway: GatewayFactory, fake_model: FakeModel, fake_discord: FakeDiscord) -> None:
    gw = await discord_gateway(make_gateway, fake_discord)
    fake_model.tool_call("current_time", BERLIN)
    fake_model.reply("It is noon.")
    channel = fake_discord.channel_id
    fake_discord.push_message(user_id=OTHER, content=f"<@{fake_discord.bot_id}> what time is it?",
                              mentions=(fake_discord.bot_id,))
    card = await discord_card(fake_discord, channel)
    (approval_id,) = await pending_ids(gw)
    assert [(c["label"], c["custom_id"]) for c in fake_discord.components(card)] == [
        ("Allow", f"ap:{approval_id}:a"), ("Deny", f"ap:{approval_id}:d")]
    content = fake_discord.messages[card]["content"]
    assert json.loads(content.split("```\n", 1)[1].split("\n```", 1)[0]) == BERLIN

    refused = fake_discord.push_click(user_id=OTHER, message_id=card, custom_id=f"ap:{approval_id}:a")
    answer = await fake_discord.wait_response(refused)
    assert answer["type"] == 4 and answer["data"]["flags"] == 64  # only the presser sees it
    assert answer["data"]["content"] == "Only an admin can answer this."
    assert await decisions(gw) == [(None, None)] and len(fake_model.requests) == 1

    first = fake_discord.push_click(user_id=PERSON, message_id=card, custom_id=f"ap:{approval_id}:a")
    second = fake_discord.push_click(user_id=PERSON, message_id=card, custom_id=f"ap:{approval_id}:d")
    assert (await fake_discord.wait_response(first))["data"]["content"] == "Allowed."
    assert "decided already: Allowed by discord:4242." in (await fake_discord.wait_response(second))["data"][
        "content"]
    await fake_discord.wait_visible(channel, lambda shown: "It is noon." in shown, timeout=15)
    assert "CET" in tool_result(fake_model.requests[-1])
    await until(lambda: fake_discord.messages[card]["content"].endswith("**Allowed by discord:4242.**")
                and fake_discord.components(card) == [])
    assert fake_discord.late_responses == []


async def test_discord_participants_of_a_thread_answer(make_gateway: GatewayFactory, fake_model: FakeModel,
                                                        fake_discord: FakeDiscord) -> None:
    gw = await discord_gateway(make_gateway, fake_discord, approvers="participants")
    thread = fake_discord.add_thread(fake_discord.channel_id)
    fake_model.tool_call("current_time", {})
    fake_model.reply("Thread answered.")
    fake_discord.push_message(user_id=OTHER, channel_id=thread, content=f"<@{fake_discord.bot_id}> time?",
                              mentions=(fake_discord.bot_id,))
    card = await discord_card(fake_discord, thread)
    (approval_id,) = await pending_ids(gw)
    press = fake_discord.push_click(user_id=4444, message_id=card, custom_id=f"ap:{approval_id}:a")
    assert (await fake_discord.wait_response(press))["data"]["content"] == "Allowed."
    await fake_discord.wait_visible(thread, lambda shown: "Thread answered." in shown, timeout=15)
    assert await decisions(gw) == [("allow", "discord:4444")]


async def test_discord_a_deleted_card_gets_its_outcome_as_a_message(
        make_gateway: GatewayFactory, fake_model: FakeModel, fake_discord: FakeDiscord) -> None:
    gw = await discord_gateway(make_gateway, fake_discord)
    dm = fake_discord.dm_channel(PERSON)
    fake_model.tool_call("current_time", {})
    fake_model.reply("Denied by text.")
    fake_discord.push_message(user_id=PERSON, content="time?", dm=True)
    card = await discord_card(fake_discord, dm)
    (approval_id,) = await pending_ids(gw)
    fake_discord.delete_by_someone(card)
    fake_discord.push_message(user_id=PERSON, content=f"/deny {approval_id}", dm=True)
    await fake_discord.wait_visible(dm, lambda shown: f"Approval {approval_id}: Denied by discord:4242." in shown,
                                    timeout=15)
    await fake_discord.wait_visible(dm, lambda shown: "Denied by text." in shown, timeout=15)


async def test_discord_deny_no_answer_and_a_restart(make_gateway: GatewayFactory, fake_model: FakeModel,
                                                    fake_discord: FakeDiscord) -> None:
    gw = await discord_gateway(make_gateway, fake_discord, timeout_s=60)
    dm = fake_discord.dm_channel(PERSON)
    fake_model.tool_call("current_time", {})
    fake_model.reply("Fine, no time then.")
    fake_discord.push_message(user_id=PERSON, content="time?", dm=True)
    card = await discord_card(fake_discord, dm)
    (approval_id,) = await pending_ids(gw)
    press = fake_discord.push_click(user_id=PERSON, message_id=card, custom_id=f"ap:{approval_id}:d")
    assert (await fake_discord.wait_response(press))["data"]["content"] == "Denied."
    await fake_discord.wait_visible(dm, lambda shown: "Fine, no time then." in shown, timeout=15)
    assert tool_result(fake_model.requests[-1]) == "error: the call was not run. Denied by discord:4242."
    await until(lambda: "Denied by discord:4242." in fake_discord.messages[card]["content"]
                and fake_discord.components(card) == [])
    await gw.stop(timeout=5)

    gw = await discord_gateway(make_gateway, fake_discord, timeout_s=0.5)
    fake_model.tool_call("current_time", {})
    fake_model.reply("Nobody answered.")
    fake_discord.push_message(user_id=PERSON, content="time again?", dm=True)
    second = await discord_card(fake_discord, dm, after=card)
    await until(lambda: "nobody answered within 0.5 s" in fake_discord.messages[second]["content"]
                and fake_discord.components(second) == [])
    await fake_discord.wait_visible(dm, lambda shown: "Nobody answered." in shown, timeout=15)
    await gw.stop(timeout=5)

    gw = await discord_gateway(make_gateway, fake_discord)
    fake_model.tool_call("current_time", {})
    fake_discord.push_message(user_id=PERSON, content="and now?", dm=True)
    third = await discord_card(fake_discord, dm, after=second)
    (approval_id,) = await pending_ids(gw)
    await gw.stop(timeout=0)  # gone while the turn waits
    fake_model.reply("Answered after the restart.")
    gw = await discord_gateway(make_gateway, fake_discord)
    await until(lambda: "restarted while this waited" in fake_discord.messages[third]["content"]
                and fake_discord.components(third) == [])
    late = fake_discord.push_click(user_id=PERSON, message_id=third, custom_id=f"ap:{approval_id}:a", stale=True)
    assert (await fake_discord.wait_response(late))["data"]["content"].startswith(
        f"Approval {approval_id} was decided already: Denied: the gateway restarted")
    assert fake_discord.late_responses == []


async def test_discord_long_arguments_are_shown_whole(make_gateway: GatewayFactory, fake_model: FakeModel,
                                                      fake_discord: FakeDiscord) -> None:
    gw = await discord_gateway(make_gateway, fake_discord)
    dm = fake_discord.dm_channel(PERSON)
    fake_model.tool_call("current_time", LONG)
    fake_model.reply("Denied.")
    fake_discord.push_message(user_id=PERSON, content="time?", dm=True)
    card = await discord_card(fake_discord, dm)
    (approval_id,) = await pending_ids(gw)
    ((channel, name, data),) = fake_discord.uploads
    assert (channel, name) == (dm, f"approval-{approval_id}.txt") and json.loads(data) == LONG
    assert f"approval-{approval_id}.txt" in fake_discord.messages[card]["content"]
    press = fake_discord.push_click(user_id=PERSON, message_id=card, custom_id=f"ap:{approval_id}:d")
    await fake_discord.wait_response(press)
    await fake_discord.wait_visible(dm, lambda shown: "Denied." in shown, timeout=15)


async def test_discord_a_hidden_command_is_shown_escaped(make_gateway: GatewayFactory, fake_model: FakeModel,
                                                       fake_discord: FakeDiscord) -> None:
    gw = await discord_gateway(make_gateway, fake_discord, EXEC, tools={"exec": "ask"})
    dm = fake_discord.dm_channel(PERSON)
    fake_model.tool_call("exec", {"command": HIDDEN_COMMAND})
    fake_model.reply("Not run.")
    fake_discord.push_message(user_id=PERSON, content="tidy up", dm=True)
    card = await discord_card(fake_discord, dm)
    content = fake_discord.messages[card]["content"]
    assert f"```sh\n{visible(HIDDEN_COMMAND)}\n```" in content and RAW.search(content) is None
    (approval_id,) = await pending_ids(gw)
    press = fake_discord.push_click(user_id=PERSON, message_id=card, custom_id=f"ap:{approval_id}:d")
    await fake_discord.wait_response(press)
    await fake_discord.wait_visible(dm, lambda shown: "Not run." in shown, timeout=15)


# ---------------------------------------------------------------------------- the layouts alone


def make_card(arguments: str, tool: str = "exec") -> ApprovalCard:
    return ApprovalCard(id="k3m9qa", tool=tool, arguments=arguments, who="an admin", timeout_s=300)


OUTCOMES = [None, "Denied: the gateway restarted while this waited for an answer (nothing was run).",
            "Allowed by telegram:123456789012."]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arguments=st.one_of(st.text(max_size=300), st.text(min_size=3000, max_size=5000),
                           st.integers(0, 12_000).map(lambda n: "é🙂x\n" * (n // 4))))
def test_every_card_shows_the_arguments_whole_within_the_limits(arguments: str) -> None:
    card = make_card(arguments)
    for outcome in OUTCOMES:
        message = render_card(card, outcome)
        assert utf16_len(message.text) <= TELEGRAM_TEXT_LIMIT
        shown = visible(arguments) if visible(arguments).strip() else "(no arguments)"
        if message.document is None and outcome is None:
            assert shown in message.text
        elif outcome is None:
            assert message.document[1] == shown.encode("utf-8", "backslashreplace")
        content = card_content(card, outcome)
        assert len(content) <= DISCORD_TEXT_LIMIT
        assert shown in content or f"approval-{card.id}.sh" in content
        blocks = card_blocks(card, outcome=outcome)
        assert all(len(b["text"]["text"]) <= SECTION_LIMIT for b in blocks if b["type"] == "section")
        pieces = code_pieces(shown)
        if pieces is not None:
            code = [b["text"]["text"] for b in blocks[1:1 + len(pieces)]]
            assert "".join(unescape(c[3:-3]) for c in code) == shown


def test_the_buttons_fit_the_platforms() -> None:
    card = make_card("ls", tool="exec")
    rows = keyboard(card).to_dict()["inline_keyboard"]
    assert all(len(b["callback_data"].encode()) <= CALLBACK_DATA_LIMIT for row in rows for b in row)
    assert [c["custom_id"] for c in components(card)[0]["components"]] == ["ap:k3m9qa:a", "ap:k3m9qa:d"]
    short = render_card(card)
    assert [e["type"] for e in short.entities] == ["bold", "code", "pre"]
    odd = render_card(make_card("printf 'a\x00b'"))  # a NUL cannot travel in a message: shown escaped
    assert odd.document is None and "printf 'a\\x00b'" in odd.text


# The red team's (issue 31): the terminal showed `ls -la`, and the call deleted MEMORY.md.
RED = "rm MEMORY.md\r\x1b[2Kls -la"
HIDDEN = [
    (RED, "rm MEMORY.md\\r\\x1b[2Kls -la"),
    ("ls -la #\u202e dm.YROMEM mr", "ls -la #\\u202e dm.YROMEM mr"),  # an override reads it backwards
    ("\u2066rm MEMORY.md\u2069\u200f ls", "\\u2066rm MEMORY.md\\u2069\\u200f ls"),  # isolates, a mark
    ("rm\u200b -rf\u2060 ~\ufeff/x\u200d", "rm\\u200b -rf\\u2060 ~\\ufeff/x\\u200d"),  # zero-width
    ("echo\u00ad ok\x9b2K\x7f\x08\x08\tx", "echo\\xad ok\\x9b2K\\x7f\\x08\\x08\\tx"),  # C1 CSI, DEL, BS
    ("x\U000e0072\U000e006d\u2028y", "x\\U000e0072\\U000e006d\\u2028y"),  # tags, line separator
    ("a\u0336\u0336\u0336\u0336b", "a\u0336\u0336\\u0336\\u0336b"),  # a stack of marks
]
# What no card may carry raw: C0 but the line break, DEL, C1, bidi, zero-width and tag characters.
RAW = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u00ad\u061c\u180e\u200b-\u200f\u2028-\u202e"
                 "\u2060-\u206f\ufeff\U000e0000-\U000e007f]")


def shown_everywhere(card: ApprovalCard) -> dict[str, str]:
    """Everything a person could read of the card on each platform, first shown and decided."""
    out: dict[str, str] = {"text": card.text()}
    for outcome in (None, "Denied by telegram:1."):
        telegram = render_card(card, outcome)
        out[f"telegram {outcome}"] = telegram.text + "".join(m.text for m in telegram.before) + (
            telegram.document[1].decode() if telegram.document else "")
        # (as Discord renders it: a Markdown character's escape shows as the character)
        out[f"discord {outcome}"] = re.sub(r"\\([\\*_~`|>#\-\[\]()<:@])", r"\1",
                                           card_content(card, outcome) + "".join(file_messages(card)))
        out[f"slack {outcome}"] = "\n".join(unescape(b["text"]["text"]) for b in card_blocks(card, outcome=outcome)
                                            if b["type"] == "section")
    return out


@pytest.mark.parametrize(("payload", "escaped"), HIDDEN)
def test_every_card_shows_hidden_characters_as_escapes(payload: str, escaped: str) -> None:
    assert visible(payload) == escaped and visible(escaped) == escaped
    card = ApprovalCard(id="k3m9qa", tool="exec", arguments=payload, who="an admin", timeout_s=300,
                        files=(CardFile("run\u202e.sh", 20, text=payload),))
    for where, text in shown_everywhere(card).items():
        assert escaped in text, where
        assert RAW.search(text.replace("\t", "")) is None, (where, RAW.search(text))
        assert "run\\u202e.sh" in text, where
    assert "\t" not in card.text()


def test_a_long_command_is_shown_whole_and_never_folded_on_telegram() -> None:
    command = "\n".join(f"echo step {i}" for i in range(19)) + "\n" + RED
    shown = render_card(make_card(command))
    assert shown.document is None
    assert [e["type"] for e in shown.entities] == ["bold", "code", "pre"]  # no (expandable) quote
    pre = next(e for e in shown.entities if e["type"] == "pre")
    assert shown.text[pre["offset"]:pre["offset"] + pre["length"]] == visible(command)
    longer = render_card(make_card("echo hi\n" * 300))  # still in one message: one pre block, no fold
    assert [e["type"] for e in longer.entities] == ["bold", "code", "pre"]


def test_named_files_show_on_the_card_or_just_before_it() -> None:
    script = "".join(f"echo this is line number {i:02} of the script\n" for i in range(34)) + RED + "\n"
    files = (CardFile("memory/2025-01-01.md", len(script), text=script), CardFile("big.bin", 90_000, note="not text"))
    card = ApprovalCard(id="k3m9qa", tool="exec", arguments="sh memory/2025-01-01.md", who="an admin",
                        timeout_s=300, files=files)
    telegram = render_card(card)
    assert not telegram.before and visible(script) in telegram.text and "big.bin (90,000 bytes; not text" in \
        telegram.text
    discord = card_content(card)  # Discord's 2,000 characters: the file goes as a message of its own first
    assert len(discord) <= DISCORD_TEXT_LIMIT and "shown just above: memory/2025\\-01\\-01.md, big.bin" in discord
    (first, second) = file_messages(card)
    assert visible(script) in first and len(first) <= DISCORD_TEXT_LIMIT and "big.bin" in second
    assert card_content(card, "Denied.").startswith(discord.rsplit("\n", 1)[0])  # the same layout once decided
    slack = "\n".join(unescape(b["text"]["text"]) for b in card_blocks(card) if b["type"] == "section")
    assert visible(script) in slack and "big.bin (90,000 bytes; not text" in slack
    # Many long files do not fit one Telegram message: each goes first, the card names them.
    many = ApprovalCard(id="k3m9qa", tool="exec", arguments="cat a b c", who="an admin", timeout_s=300,
                        files=tuple(CardFile(n, 1400, text="y" * 1400) for n in "abc"))
    crowded = render_card(many)
    assert len(crowded.before) == 3 and "y" * 1400 in crowded.before[0].text and "y" * 1400 not in crowded.text
    assert "shown just above: a, b, c" in crowded.text and render_card(many, "Denied.").before == ()


JUNK = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=80)),
                    lambda inner: st.one_of(st.lists(inner, max_size=4),
                                            st.dictionaries(st.text(max_size=12), inner, max_size=5)),
                    max_leaves=20)


@settings(max_examples=150, deadline=None)
@given(query=st.fixed_dictionaries({}, optional={
    "id": st.one_of(st.text(max_size=200), JUNK), "from": st.one_of(
        st.fixed_dictionaries({"id": st.integers(), "is_bot": st.booleans()}), JUNK),
    "data": st.one_of(st.text(max_size=100), st.sampled_from(["ap:k3m9qa:a", "ap:K3:x", "ap::a"]), JUNK),
    "message": st.one_of(st.fixed_dictionaries({"message_id": st.integers(), "chat": st.fixed_dictionaries(
        {"id": st.integers(), "type": st.sampled_from(["private", "supergroup", "x"])}),
        "message_thread_id": JUNK, "is_topic_message": JUNK}), JUNK)}))
def test_junk_telegram_presses_never_raise(query: dict[str, Any]) -> None:
    click = parse_callback({"update_id": 5, "callback_query": query})
    if click is not None:
        assert 0 < len(click.query_id) <= 128
        assert click.data is None or len(click.data.encode("utf-8", "surrogatepass")) <= CALLBACK_DATA_LIMIT


@settings(max_examples=150, deadline=None)
@given(payload=st.fixed_dictionaries({"type": st.sampled_from(["block_actions", "view_submission"])}, optional={
    "actions": st.one_of(st.lists(st.fixed_dictionaries({"action_id": st.sampled_from(
        ["approval_allow", "approval_deny", "x"])}, optional={"value": st.one_of(st.text(max_size=40), JUNK)}),
        max_size=2), JUNK),
    "user": st.one_of(st.fixed_dictionaries({"id": st.sampled_from(["U1", "", "../x"])}), JUNK),
    "channel": st.one_of(st.fixed_dictionaries({"id": st.sampled_from(["C1", "D1", " "])}), JUNK),
    "container": JUNK, "message": JUNK, "team": JUNK, "trigger_id": JUNK, "response_url": JUNK}))
def test_junk_slack_presses_never_raise(payload: dict[str, Any]) -> None:
    click = parse_block_action(payload)
    if click is not None:
        assert click.who.user_id == "U1" and click.who.chat_id in ("C1", "D1")
        assert click.approval_id.isalnum() and len(click.approval_id) <= 32


# ---------------------------------------------------------------------------- the fakes keep the rules


async def test_the_fake_bot_api_refuses_what_telegram_refuses() -> None:
    fake_telegram = FakeTelegram(edit_interval_s=None)  # edits back to back here
    await fake_telegram.start()
    try:
        await _refusals(fake_telegram)
    finally:
        await fake_telegram.stop()


async def _refusals(fake_telegram: FakeTelegram) -> None:
    bot = Bot(fake_telegram.token, base_url=fake_telegram.base_url)
    async with bot:
        for markup, error in [
            (InlineKeyboardMarkup([[InlineKeyboardButton("Allow", callback_data="x" * 65)]]), "BUTTON_DATA_INVALID"),
            (InlineKeyboardMarkup([[InlineKeyboardButton("Allow")]]), "Text buttons are unallowed"),
            (InlineKeyboardMarkup([[InlineKeyboardButton(str(i), callback_data=str(i)) for i in range(101)]]),
             "too many"),
        ]:
            with pytest.raises(BadRequest, match="(?i)" + error):
                await bot.send_message(chat_id=5, text="card", reply_markup=markup)
        ok = InlineKeyboardMarkup([[InlineKeyboardButton("Allow", callback_data="é" * 32)]])  # 64 bytes
        card = await bot.send_message(chat_id=5, text="card", reply_markup=ok)
        with pytest.raises(AssertionError, match="no button"):
            fake_telegram.push_callback(chat_id=5, user_id=5, message_id=card.message_id, data="other")
        query = fake_telegram.push_callback(chat_id=5, user_id=5, message_id=card.message_id, data="é" * 32)
        with pytest.raises(BadRequest, match="(?i)" + "MESSAGE_TOO_LONG"):
            await bot.answer_callback_query(query, text="x" * 201)
        await bot.answer_callback_query(query, text="Allowed.")
        with pytest.raises(BadRequest, match="(?i)" + "query is too old"):  # once only
            await bot.answer_callback_query(query, text="Allowed.")
        # An edit of the text without a keyboard removes it, as on Telegram.
        await bot.edit_message_text("card, decided", chat_id=5, message_id=card.message_id)
        assert fake_telegram.buttons(card.message_id) == []
        with pytest.raises(AssertionError, match="no button"):
            fake_telegram.push_callback(chat_id=5, user_id=5, message_id=card.message_id, data="é" * 32)
        with pytest.raises(BadRequest, match="(?i)" + "not modified"):
            await bot.edit_message_reply_markup(chat_id=5, message_id=card.message_id)
    slow = FakeTelegram(callback_answer_s=0.0)
    await slow.start()
    try:
        async with Bot(slow.token, base_url=slow.base_url) as late:
            card = await late.send_message(chat_id=5, text="card", reply_markup=ok)
            query = slow.push_callback(chat_id=5, user_id=5, message_id=card.message_id, data="é" * 32)
            with pytest.raises(BadRequest, match="(?i)" + "query is too old"):
                await late.answer_callback_query(query)
    finally:
        await slow.stop()


async def test_the_fake_slack_refuses_what_slack_refuses(fake_slack: FakeSlack) -> None:
    client = AsyncWebClient(token=fake_slack.bot_token, base_url=fake_slack.base_url)
    section = {"type": "section", "text": {"type": "mrkdwn", "text": "x"}}
    button = {"type": "button", "action_id": "approval_allow", "value": "k3m9qa",
              "text": {"type": "plain_text", "text": "Allow"}}
    for blocks, pointer in [
        ([{**section, "text": {"type": "mrkdwn", "text": "x" * 3001}}], "/blocks/0/text/text"),
        ([section] * 51, "/blocks"),
        ([{"type": "actions", "elements": [{**button, "text": {"type": "plain_text", "text": "y" * 76}}]}],
         "/blocks/0/elements/0/text/text"),
        ([{"type": "actions", "elements": [button, button]}], "/blocks/0/elements/1/action_id"),
        ([{"type": "actions", "elements": [{**button, "style": "green"}]}], "/blocks/0/elements/0/style"),
        ([{"type": "carousel"}], "/blocks/0/type"),
    ]:
        with pytest.raises(SlackApiError) as refused:
            await client.chat_postMessage(channel="D1", text="card", blocks=blocks)
        assert refused.value.response["error"] == "invalid_blocks"
        assert f"[json-pointer:{pointer}]" in refused.value.response["response_metadata"]["messages"][0]
    posted = await client.chat_postMessage(channel="D1", text="card", blocks=[section, {
        "type": "actions", "elements": [button]}])
    with pytest.raises(SlackApiError):
        await client.chat_update(channel="D1", ts=posted["ts"], text="card", blocks=[section] * 51)
    await client.chat_update(channel="D1", ts=posted["ts"], text="card", blocks=[section])
    with pytest.raises(AssertionError, match="no button"):
        fake_slack.block_actions_payload(user="U1", channel="D1", ts=posted["ts"], action_id="approval_allow")
    stale = fake_slack.block_actions_payload(user="U1", channel="D1", ts=posted["ts"], action_id="approval_allow",
                                             stale=True)
    assert stale["actions"][0]["value"] == "k3m9qa" and stale["message"]["blocks"][1]["type"] == "actions"


async def test_the_fake_discord_refuses_what_discord_refuses(fake_discord: FakeDiscord) -> None:
    rest = DiscordRest(DiscordHttp(fake_discord.api_base))
    await rest.login(fake_discord.token)
    try:
        channel = fake_discord.channel_id
        button = {"type": 2, "style": 3, "label": "Allow", "custom_id": "ap:k3m9qa:a"}
        for rows in ([{"type": 1, "components": [{**button, "custom_id": "x" * 101}]}],
                     [{"type": 1, "components": [button, button]}],
                     [{"type": 1, "components": [button] * 6}],
                     [{"type": 1, "components": [{**button, "label": "y" * 81}]}],
                     [button]):
            with pytest.raises(discord.HTTPException) as refused:
                await rest.post(channel, "card", components=rows)
            assert refused.value.status == 400
        card = await rest.post(channel, "card", components=[{"type": 1, "components": [button]}])
        interaction = fake_discord.push_click(user_id=PERSON, message_id=card, custom_id="ap:k3m9qa:a")
        token, _ = fake_discord._interactions[interaction]
        with pytest.raises(discord.NotFound):  # the token is the credential
            await rest.respond(interaction, token[:-1] + ("1" if token.endswith("0") else "0"), "Allowed.")
        await rest.respond(interaction, token, "Allowed.")
        with pytest.raises(discord.HTTPException) as twice:
            await rest.respond(interaction, token, "Allowed.")
        assert twice.value.code == 40060
        await rest.edit(channel, card, "card, decided", components=[])
        with pytest.raises(AssertionError, match="no button"):
            fake_discord.push_click(user_id=PERSON, message_id=card, custom_id="ap:k3m9qa:a")
        fake_discord.interaction_deadline_s = 0.0  # Discord's 3 s, run out
        late = fake_discord.push_click(user_id=PERSON, message_id=card, custom_id="ap:k3m9qa:a", stale=True)
        with pytest.raises(discord.NotFound):
            await rest.respond(late, fake_discord._interactions[late][0], "Allowed.")
        assert fake_discord.late_responses == [late]
    finally:
        await rest.close()


# ---------------------------------------------------------------------------- the README's pictures


def test_the_mock_up_draws_the_card_as_sent() -> None:
    card = render_card(make_card("a < b && 🙂 c"))
    drawn = entities_html(card.text, list(card.entities))
    assert "<b>Approval needed (k3m9qa)</b>" in drawn and "<code>exec</code>" in drawn
    assert "<pre>a &lt; b &amp;&amp; 🙂 c</pre>" in drawn


async def test_the_screenshot_script_still_works(chromium_path: str, tmp_path: Path) -> None:  # noqa: F811
    shots = await take(tmp_path, chromium_path)
    assert [p.name for p in shots] == list(NAMES)
    for shot in shots:
        assert shot.read_bytes().startswith(b"\x89PNG") and shot.stat().st_size > 20_000
