"""`gateway chat` beside `gateway run` on one config: the chat runs the terminal only, also
after the config file changes. Were it to start the Telegram channel on a reload, it
would poll the same bot as `run`, and the Bot API would answer one of them with 409s."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from pathlib import Path

import pytest

from tests.conftest import write_config
from tests.fakes import telegram_server
from tests.fakes.openai_server import FakeModel
from tests.fakes.telegram_server import FakeTelegram
from tests.test_terminal_chat import Window

fake_telegram = telegram_server.fake_telegram  # the fixture


class Lines:
    """A subprocess's stderr, read as it comes (the pipe never fills up)."""

    def __init__(self, stream: asyncio.StreamReader) -> None:
        self.text = ""
        self.changed = asyncio.Event()
        self.task = asyncio.ensure_future(self._read(stream))

    async def _read(self, stream: asyncio.StreamReader) -> None:
        while line := await stream.readline():
            self.text += line.decode(errors="replace")
            self.changed.set()

    async def until(self, marker: str, timeout: float = 60) -> None:
        async with asyncio.timeout(timeout):
            while marker not in self.text:
                self.changed.clear()
                await self.changed.wait()


async def _file_says(path: Path, marker: str, timeout: float = 60) -> None:
    async with asyncio.timeout(timeout):
        while not path.exists() or marker not in path.read_text(encoding="utf-8", errors="replace"):  # noqa: ASYNC110 - another process writes it
            await asyncio.sleep(0.1)


async def test_chat_never_starts_telegram_on_a_reload_and_run_keeps_polling_alone(
        fake_model: FakeModel, fake_telegram: FakeTelegram, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Both processes have the token, as they would on one machine: only `run` may use it.
    monkeypatch.setenv("TELEGRAM_BOT_TOKEN", fake_telegram.token)
    config = write_config(tmp_path, fake_model, channels={"telegram": {
        "enabled": True, "token": "${TELEGRAM_BOT_TOKEN}", "base_url": fake_telegram.base_url,
        "base_file_url": fake_telegram.base_file_url, "poll_timeout_s": 1}})
    run = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "run", "--config", str(config), cwd=tmp_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE)
    assert run.stderr is not None
    run_log = Lines(run.stderr)
    chat = Window()
    try:
        await fake_telegram.wait_calls("getUpdates", 1, timeout=60)
        await chat.start(config, tmp_path)
        await chat.at_prompt()
        assert len(fake_telegram.calls_of("getMe")) == 1  # `run`'s, at its start

        raw = json.loads(config.read_text())
        raw["agent_max_context_turns"] = 30
        config.write_text(json.dumps(raw, indent=2))
        await run_log.until("config reloaded")
        await _file_says(tmp_path / "data" / "chat.log", "config reloaded")
        # A second poller's long poll would now meet `run`'s: two more polls of `run` show it.
        polls = len(fake_telegram.calls_of("getUpdates"))
        await fake_telegram.wait_calls("getUpdates", polls + 2, timeout=30)

        assert len(fake_telegram.calls_of("getMe")) == 1, "the chat process started the Telegram channel"
        assert fake_telegram.conflicts == []
        chat_log = (tmp_path / "data" / "chat.log").read_text()
        assert 'channel="telegram"' not in chat_log and "channel failed to start" not in chat_log
        assert "Conflict" not in run_log.text and "409" not in run_log.text

        chat.type("\x04")  # Ctrl+D
        assert await chat.exit_code() == 0
        run.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(run.wait(), timeout=60) == 0
    finally:
        await chat.close()
        if run.returncode is None:
            run.kill()
            await run.wait()
        run_log.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await run_log.task
