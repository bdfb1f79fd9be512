"""Admin and operations: /config (read, refused, written and applied live), hot reload
(valid, invalid, half-written), secrets kept out of /config, logs and metrics, SIGTERM."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path

import aiohttp
import pytest

from gateway.reload import ConfigWatcher
from tests.conftest import GatewayFactory, chat, write_config
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
    assert "test-key" not in listing and "***" in listing

    fake_telegram.push_message(chat_id=1, user_id=1, text="/config model.api_key sk-stolen")
    assert "secret" in (await fake_telegram.wait_sent(3))[2]["text"]
    fake_telegram.push_message(chat_id=1, user_id=1, text="/config agent_max_context_turns zero")
    assert "Not changed" in (await fake_telegram.wait_sent(4))[3]["text"]
    assert path.read_text() == before

    fake_model.reply("first")
    fake_telegram.push_message(chat_id=3, user_id=3, text="hello")
    await fake_telegram.wait_sent(5)
    fake_telegram.push_message(chat_id=1, user_id=1, text="/config agent_max_steps 1")
    assert "saved" in (await fake_telegram.wait_sent(6))[5]["text"]
    written = json.loads(path.read_text())
    assert written["agent_max_steps"] == 1 and written["model"]["api_key"] == "test-key"
    assert gw.cfg.agent_max_steps == 1
    # Applied to the live session's next turn: after one tool-calling step the next
    # request offers no tools (with the default 15 it would).
    fake_model.tool_call("current_time", {})
    fake_model.reply("second")
    fake_telegram.push_message(chat_id=3, user_id=3, text="again")
    await fake_telegram.wait_sent(7)
    assert fake_model.requests[-2].get("tools") and not fake_model.requests[-1].get("tools")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".config.json")] == []


async def test_hot_reload_valid_invalid_and_half_written(make_gateway: GatewayFactory, fake_model: FakeModel,
                                                         tmp_path: Path) -> None:
    gw = await make_gateway()
    watcher = ConfigWatcher(gw)
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


async def test_secrets_stay_out_of_logs_and_metrics(make_gateway: GatewayFactory, fake_model: FakeModel,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    from gateway.logs import REDACTOR, LineFormatter

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
        line = (await asyncio.wait_for(proc.stdout.readline(), timeout=60)).decode()
        port = int(line.rsplit(":", 1)[1].split("/")[0])
        async with aiohttp.ClientSession() as http:
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
    from gateway.store import Store

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
    watcher = ConfigWatcher(gw)
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
