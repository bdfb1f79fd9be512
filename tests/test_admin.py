"""Admin and operations: /config (read, refused, written and applied live), hot reload
(valid, invalid, half-written), secrets kept out of /config, logs and metrics, SIGTERM."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import stat
import sys
from pathlib import Path

import aiohttp
import pytest

from gateway.app import Gateway
from gateway.config.load import ConfigError
from tests.conftest import GatewayFactory, banner_link, chat, write_config
from tests.fakes import telegram_server
from tests.fakes.openai_server import FakeModel
from tests.fakes.telegram_server import FakeTelegram

fake_telegram = telegram_server.fake_telegram  # the fixture


def _tg(fake: FakeTelegram) -> dict:
    return {"telegram": {"enabled": True, "token": fake.token, "base_url": fake.base_url,
                         "base_file_url": fake.base_file_url, "poll_timeout_s": 1}}


async def test_config_read_refused_and_written(make_gateway: GatewayFactory, fake_model: FakeModel,
                                               fake_telegram: FakeTelegram, tmp_path: Path) -> None:
    gw = await make_gateway(admins=["telegram:1"], access={"dm_policy": "open"}, channels=_tg(fake_telegram))
    path = tmp_path / "config.json"
    before = path.read_text()

    fake_telegram.push_message(chat_id=2, user_id=2, text="/config agent_max_context_tokens 80000")
    (refusal,) = await fake_telegram.wait_sent(1)
    assert "Only admins" in refusal["text"] and "admins" in refusal["text"]
    assert path.read_text() == before and gw.cfg.agent_max_context_tokens == 50_000

    fake_telegram.push_message(chat_id=2, user_id=2, text="/config")
    listing = (await fake_telegram.wait_sent(2))[1]["text"]
    assert "agent_max_context_tokens" in listing and fake_telegram.token not in listing
    # A person's /config is the budgets and limits: no secrets, masked or not.
    assert "test-key" not in listing and "api_key" not in listing
    fake_telegram.push_message(chat_id=1, user_id=1, text="/config")
    listing = (await fake_telegram.wait_sent(3))[2]["text"]
    assert 'model.api_key = "***"' in listing and "test-key" not in listing

    fake_telegram.push_message(chat_id=1, user_id=1, text="/config model.api_key sk-stolen")
    assert "secret" in (await fake_telegram.wait_sent(4))[3]["text"]
    fake_telegram.push_message(chat_id=1, user_id=1, text="/config agent_max_context_turns zero")
    assert "Not changed" in (await fake_telegram.wait_sent(5))[4]["text"]
    assert path.read_text() == before

    fake_model.reply("first")
    fake_telegram.push_message(chat_id=3, user_id=3, text="hello")
    await fake_telegram.wait_sent(6)
    fake_telegram.push_message(chat_id=1, user_id=1, text="/config agent_max_steps 1")
    assert "saved" in (await fake_telegram.wait_sent(7))[6]["text"]
    written = json.loads(path.read_text())
    assert written["agent_max_steps"] == 1 and written["model"]["api_key"] == "test-key"
    assert gw.cfg.agent_max_steps == 1
    # Applied to the live session's next turn: after one tool-calling step the next
    # request offers no tools (with the default 15 it would).
    fake_model.tool_call("current_time", {})
    fake_model.reply("second")
    fake_telegram.push_message(chat_id=3, user_id=3, text="again")
    await fake_telegram.wait_sent(8)
    assert fake_model.requests[-2].get("tools") and not fake_model.requests[-1].get("tools")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".config.json")] == []


async def test_hot_reload_valid_invalid_and_half_written(make_gateway: GatewayFactory, fake_model: FakeModel,
                                                         tmp_path: Path) -> None:
    gw = await make_gateway()
    watcher = gw.config_watcher()
    await watcher.start()
    try:
        path = tmp_path / "config.json"
        raw = json.loads(path.read_text())
        raw["agent_max_context_turns"] = 7
        path.write_text(json.dumps(raw))
        assert await watcher.reload() is True
        assert gw.cfg.agent_max_context_turns == 7

        path.write_text(json.dumps({**raw, "agent_max_context_turns": -1, "typo_key": 1}))
        assert await watcher.reload() is False
        assert gw.cfg.agent_max_context_turns == 7  # the running config stays
        rejected = [p for p in tmp_path.iterdir() if p.name.startswith("config.json.rejected.")]
        assert len(rejected) == 1 and "typo_key" in rejected[0].read_text()

        half = json.dumps({**raw, "agent_max_context_turns": 9})[:40]
        path.write_text(half)
        assert await watcher.reload() is False
        assert gw.cfg.agent_max_context_turns == 7  # a half-written file is never applied
        fake_model.reply("still serving")
        assert await chat(gw, "zed", "hi") == "still serving"

        # The watcher itself notices a finished save.
        path.write_text(json.dumps({**raw, "agent_max_context_turns": 11}))
        for _ in range(100):
            if gw.cfg.agent_max_context_turns == 11:
                break
            await asyncio.sleep(0.05)
        assert gw.cfg.agent_max_context_turns == 11
    finally:
        await watcher.stop()


async def test_a_save_made_while_the_watch_starts_is_applied(make_gateway: GatewayFactory, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # A save that lands after the watcher read the file but before its watch exists raises
    # no file event; the watcher must still notice it (a `gateway chat` started just before
    # an edit kept the old settings until the next save).
    gw = await make_gateway()
    watcher = gw.config_watcher()
    path = tmp_path / "config.json"
    raw = json.loads(path.read_text())
    first_read = watcher._read

    def read_then_someone_saves() -> str | None:
        text = first_read()
        monkeypatch.setattr(watcher, "_read", first_read)
        path.write_text(json.dumps({**raw, "agent_max_context_turns": 13}))
        return text

    monkeypatch.setattr(watcher, "_read", read_then_someone_saves)
    await watcher.start()
    try:
        for _ in range(200):
            if gw.cfg.agent_max_context_turns == 13:
                break
            await asyncio.sleep(0.05)
        assert gw.cfg.agent_max_context_turns == 13
    finally:
        await watcher.stop()


async def test_secrets_stay_out_of_logs_and_metrics(make_gateway: GatewayFactory, fake_model: FakeModel,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    from gateway.ops.logs import REDACTOR, LineFormatter

    gw = await make_gateway(channels={"web": {"token": "web-token-abcdef"}})
    fake_model.error(401, {"error": {"message": "Incorrect API key provided: test-key", "code": "invalid_api_key"}})
    caplog.set_level(logging.INFO)
    async with aiohttp.ClientSession() as http:
        assert gw.http is not None
        async with http.post(f"http://127.0.0.1:{gw.http.port}/api/chat", json={"session": "s", "text": "hi"},
                             headers={"Authorization": "Bearer web-token-abcdef"}) as resp:
            body = await resp.json()
        async with http.get(f"http://127.0.0.1:{gw.http.port}/metrics") as resp:
            metrics = await resp.text()
    assert "test-key" not in body["reply"]
    formatter = LineFormatter(REDACTOR)
    lines = [formatter.format(r) for r in caplog.records]
    logging.getLogger("gateway.test").warning("leak test-key and web-token-abcdef")
    lines.append(formatter.format(caplog.records[-1]))
    for line in lines:
        assert "test-key" not in line and "web-token-abcdef" not in line
    assert "***" in lines[-1]
    assert "test-key" not in metrics and "web-token-abcdef" not in metrics


async def test_sigterm_during_a_turn_loses_nothing(fake_model: FakeModel, tmp_path: Path) -> None:
    path = write_config(tmp_path, fake_model, http={"host": "127.0.0.1", "port": 0})
    fake_model.reply("slow answer", delay=1.0)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "run", "--config", str(path),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=tmp_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        port, auth = banner_link((await asyncio.wait_for(proc.stdout.readline(), timeout=60)).decode())
        async with aiohttp.ClientSession(headers=auth) as http:
            request = asyncio.ensure_future(http.post(f"http://127.0.0.1:{port}/api/chat",
                                                      json={"session": "t", "text": "question"}))
            await fake_model.wait_requests(1, timeout=30)
            proc.send_signal(signal.SIGTERM)
            resp = await asyncio.wait_for(request, timeout=30)
            assert resp.status == 200 and (await resp.json())["reply"] == "slow answer"
        assert await asyncio.wait_for(proc.wait(), timeout=30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    from gateway.store.sqlite import Store

    store = await Store.open(tmp_path / "data" / "gateway.sqlite3")
    try:
        rows = await store.messages("web:t")
        assert [(m.role, m.content) for m in rows] == [("user", "question"), ("assistant", "slow answer")]
        assert await store.pending_events() == []
    finally:
        await store.close()


async def test_a_model_change_in_the_file_reaches_the_next_request(make_gateway: GatewayFactory,
                                                                   fake_model: FakeModel, tmp_path: Path) -> None:
    gw = await make_gateway()
    await chat(gw, "mo", "before")
    watcher = gw.config_watcher()
    await watcher.start()
    try:
        path = tmp_path / "config.json"
        raw = json.loads(path.read_text())
        raw["model"]["name"] = "another-model"
        path.write_text(json.dumps(raw))
        assert await watcher.reload() is True
        assert gw.services is not None
        await gw.services.background.wait_idle(5)
        await chat(gw, "mo", "after")
    finally:
        await watcher.stop()
    assert [r["model"] for r in fake_model.requests] == ["fake-model", "another-model"]


# -- hardening: forged webhooks, secrets through chat, file mode, cron on reload --------------

HOOK_SECRET = "hook-secret-0123456789abcdef"


def _forged_update(update_id: int, text: str, user: int) -> dict:
    return {"update_id": update_id, "message": {
        "message_id": update_id, "date": 1_700_000_000, "text": text,
        "chat": {"id": user, "type": "private", "first_name": "A"},
        "from": {"id": user, "is_bot": False, "first_name": "A"}}}


async def _post_webhook(gw: Gateway, update: dict, headers: dict[str, str]) -> int:
    assert gw.http is not None
    async with aiohttp.ClientSession() as http:
        async with http.post(f"http://127.0.0.1:{gw.http.port}/telegram/webhook", data=json.dumps(update),
                             headers={"Content-Type": "application/json", **headers}) as resp:
            return resp.status


async def test_a_webhook_without_a_usable_secret_never_runs(make_gateway: GatewayFactory, tmp_path: Path,
                                                            fake_telegram: FakeTelegram,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    hook = {"mode": "webhook", "webhook_url": "https://bot.example/telegram/webhook"}
    # The shipped reference with its variable unset (it used to become the literal text).
    monkeypatch.delenv("TELEGRAM_WEBHOOK_SECRET", raising=False)
    shipped = {"telegram": {**_tg(fake_telegram)["telegram"], **hook,
                            "webhook_secret": "${TELEGRAM_WEBHOOK_SECRET}"}}
    with pytest.raises(ConfigError) as err:
        await make_gateway(admins=["telegram:1"], channels=shipped)
    assert err.value.problems == ["channels.telegram.webhook_secret: the environment variable "
                                  "TELEGRAM_WEBHOOK_SECRET is not set (needed in webhook mode)"]
    # What docker compose passed when it was unset: an empty value (it used to disable the check).
    monkeypatch.setenv("TELEGRAM_WEBHOOK_SECRET", "")
    with pytest.raises(ConfigError, match=r"channels\.telegram\.webhook_secret: required in webhook mode"):
        await make_gateway(admins=["telegram:1"], channels=shipped)
    assert fake_telegram.webhook is None  # nothing was ever registered with Telegram

    # A running webhook gateway refuses a reload that would drop its secret, and a forged
    # update from an admin's id changes nothing.
    monkeypatch.setenv("TELEGRAM_WEBHOOK_SECRET", HOOK_SECRET)
    gw = await make_gateway(admins=["telegram:1"], channels=shipped)
    assert fake_telegram.webhook is not None and fake_telegram.webhook["secret_token"] == HOOK_SECRET
    watcher = gw.config_watcher()
    await watcher.start()
    try:
        path = tmp_path / "config.json"
        raw = json.loads(path.read_text())
        raw["channels"]["telegram"]["webhook_secret"] = ""
        path.write_text(json.dumps(raw))
        assert await watcher.reload() is False
    finally:
        await watcher.stop()
    forged = _forged_update(900, "/config access.dm_policy open", user=1)
    assert await _post_webhook(gw, forged, {}) == 403
    assert await _post_webhook(gw, forged, {"X-Telegram-Bot-Api-Secret-Token": ""}) == 403
    assert await _post_webhook(gw, forged, {"X-Telegram-Bot-Api-Secret-Token": "${TELEGRAM_WEBHOOK_SECRET}"}) == 403
    assert gw.cfg.access.dm_policy == "pairing"
    assert json.loads((tmp_path / "config.json").read_text()).get("access") is None


async def test_the_channel_refuses_every_webhook_request_without_a_usable_secret(
        fake_telegram: FakeTelegram) -> None:
    from aiohttp.test_utils import TestClient, TestServer

    from channels.telegram.adapter import TelegramChannel
    from gateway.config.schema import TelegramConfig

    async def never(_inbound: object) -> None:
        raise AssertionError("a forged update reached the router")

    for secret in (None, "", "too-short"):
        cfg = TelegramConfig(enabled=True, token=fake_telegram.token, base_url=fake_telegram.base_url,
                             mode="webhook", webhook_url="https://bot.example/tg", webhook_secret=secret)
        channel = TelegramChannel(cfg, never, workspace_for=lambda _i: Path("/nonexistent"))
        with pytest.raises(ValueError, match="webhook_secret"):
            await channel.start()  # it never registers a webhook without a secret
        assert fake_telegram.webhook is None
        channel._me = object()  # type: ignore[assignment]  # as if connected: only the secret may refuse
        app = aiohttp.web.Application()
        app.router.add_post(channel.webhook_path, channel.handle_webhook)
        client = TestClient(TestServer(app, host="127.0.0.1", port=0))
        await client.start_server()
        try:
            for headers in ({}, {"X-Telegram-Bot-Api-Secret-Token": secret or ""}):
                resp = await client.post(channel.webhook_path, data=json.dumps(_forged_update(1, "hi", 1)),
                                         headers=headers)
                assert resp.status == 403
        finally:
            await client.close()
            await channel.stop()


async def test_nothing_set_in_chat_expands_a_secret(make_gateway: GatewayFactory, fake_model: FakeModel,
                                                    tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_TEST_SECRET", "sk-never-leaves-0123")
    gw = await make_gateway(admins=["web:boss"])
    path = tmp_path / "config.json"
    reply = await chat(gw, "boss", '/config system_prompt "Answer briefly. ${GATEWAY_TEST_SECRET}"')
    assert "saved" in reply and "sk-never-leaves" not in reply
    assert "${GATEWAY_TEST_SECRET}" in json.loads(path.read_text())["system_prompt"]  # stored as typed
    fake_model.reply("ok")
    await chat(gw, "boss", "hello")
    system = fake_model.requests[-1]["messages"][0]["content"]
    assert "Answer briefly. ${GATEWAY_TEST_SECRET}" in system and "sk-never-leaves" not in system
    assert "sk-never-leaves" not in await chat(gw, "boss", "/config system_prompt")

    before = path.read_text()
    for command, why in [
        ('/config summary_model {"name": "m", "base_url": "http://127.0.0.1:9/v1", '
         '"api_key": "${GATEWAY_TEST_SECRET}"}', "summary_model.base_url decides where credentials are sent"),
        ('/config summary_model {"name": "m", "api_key": "${GATEWAY_TEST_SECRET}"}',
         "summary_model.api_key is a secret"),
        ("/config model.base_url http://127.0.0.1:9/v1", "model.base_url decides where credentials are sent"),
        ("/config channels.telegram.base_url http://127.0.0.1:9/bot", "decides where credentials are sent"),
        ("/config channels.web.token ${GATEWAY_TEST_SECRET}", "channels.web.token is a secret"),
    ]:
        answer = await chat(gw, "boss", command)
        assert why in answer, answer
    assert path.read_text() == before
    assert gw.cfg.summary_model is None and gw.cfg.model.base_url == fake_model.base_url


async def test_config_in_chat_keeps_the_file_mode(make_gateway: GatewayFactory, tmp_path: Path) -> None:
    gw = await make_gateway(admins=["web:boss"])
    path = tmp_path / "config.json"
    os.chmod(path, 0o640)  # the operator's choice: readable by a group, say
    assert "saved" in await chat(gw, "boss", "/config agent_max_steps 4")
    assert json.loads(path.read_text())["agent_max_steps"] == 4
    assert stat.S_IMODE(path.stat().st_mode) == 0o640


async def test_a_reload_with_a_bad_cron_is_refused(make_gateway: GatewayFactory, tmp_path: Path,
                                                   fake_telegram: FakeTelegram) -> None:
    gw = await make_gateway(admins=["telegram:1"], channels=_tg(fake_telegram), timezone="UTC")
    assert gw.scheduler is not None
    next_run = gw.scheduler.next_consolidation()
    watcher = gw.config_watcher()
    await watcher.start()
    try:
        path = tmp_path / "config.json"
        raw = json.loads(path.read_text())
        raw["memory_consolidation_cron"] = "99 * * * *"
        path.write_text(json.dumps(raw))
        assert await watcher.reload() is False
    finally:
        await watcher.stop()
    assert gw.cfg.memory_consolidation_cron == "0 0 * * *"
    assert gw.scheduler.next_consolidation() == next_run
    (told,) = await fake_telegram.wait_sent(1)
    assert told["chat_id"] == 1 and "memory_consolidation_cron: '99 * * * *'" in told["text"]
    assert [p for p in tmp_path.iterdir() if p.name.startswith("config.json.rejected.")]
