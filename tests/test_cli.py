"""The CLI as a person uses it: the terminal chat, and a clear error for a bad config."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

from tests.conftest import write_config
from tests.fakes.openai_server import FakeModel


async def _run_cli(args: list[str], cwd: Path, stdin: bytes = b"") -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", *args, cwd=cwd, stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    out, err = await asyncio.wait_for(proc.communicate(stdin), timeout=120)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_terminal_chat_round_trip(fake_model: FakeModel, tmp_path: Path) -> None:
    path = write_config(tmp_path, fake_model)
    fake_model.reply("Hello from the terminal model")
    code, out, err = await _run_cli(["chat", "--config", str(path)], tmp_path, b"hi there\n/help\n")
    assert code == 0, err
    assert "bot> Hello from the terminal model" in out
    assert "/context clear" in out  # /help answered without the model
    assert len(fake_model.requests) == 1
    assert fake_model.requests[0]["messages"][-1]["content"] == "hi there"


async def test_run_refuses_a_bad_config_with_the_key(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"agent_max_context_tokens": "lots", "http": {"prot": 1}}))
    code, _out, err = await _run_cli(["run", "--config", str(path)], tmp_path)
    assert code == 2
    assert "agent_max_context_tokens" in err and "http.prot: unknown key (did you mean 'http.port'?)" in err
    assert "Traceback" not in err


async def test_a_short_web_token_off_loopback_stops_check_config_and_run(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"http": {"host": "0.0.0.0", "port": 0}, "channels": {"web": {"token": "x"}}}))
    for args in (["check-config", str(path)], ["run", "--config", str(path)]):
        code, _out, err = await _run_cli(args, tmp_path)
        assert code == 2, (args, err)
        assert "channels.web.token: too short (1 characters); use at least 16" in err, err
