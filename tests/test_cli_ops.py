"""The CLI as an operator uses it, in real subprocesses: Ctrl+C (once, twice, with the
output piped to a process that exits), a port already taken, the terminal chat as the
machine's owner, and the commands that read the database while the gateway runs."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import aiohttp

from gateway.access import Pairing
from gateway.store.sqlite import Store
from tests.conftest import GatewayFactory, banner_link, chat, write_config
from tests.fakes.openai_server import FakeModel

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


async def _start(path: Path, cwd: Path, **pipes: Any) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "run", "--config", str(path), cwd=cwd, env=ENV,
        stdout=pipes.get("stdout", asyncio.subprocess.PIPE), stderr=pipes.get("stderr", asyncio.subprocess.PIPE),
    )


async def _port(proc: asyncio.subprocess.Process) -> tuple[int, dict[str, str]]:
    """The port and the web API's header, from the line the gateway starts with."""
    assert proc.stdout is not None
    return banner_link((await asyncio.wait_for(proc.stdout.readline(), timeout=60)).decode())


async def _read_until(stream: asyncio.StreamReader, marker: str, timeout: float = 30) -> str:
    seen = ""
    async with asyncio.timeout(timeout):
        while marker not in seen:
            chunk = await stream.readline()
            if not chunk:
                break
            seen += chunk.decode()
    return seen


async def _kill(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.kill()
        await proc.wait()


async def test_ctrl_c_says_what_it_waits_for_a_second_stops_now_and_the_turn_resumes(
        fake_model: FakeModel, tmp_path: Path) -> None:
    path = write_config(tmp_path, fake_model)
    fake_model.hang(60)  # the model never answers in time
    proc = await _start(path, tmp_path)
    try:
        port, auth = await _port(proc)
        async with aiohttp.ClientSession(headers=auth) as http:
            request = asyncio.ensure_future(http.post(f"http://127.0.0.1:{port}/api/chat",
                                                      json={"session": "t", "text": "a long question"}))
            await fake_model.wait_requests(1, timeout=30)
            proc.send_signal(signal.SIGINT)
            assert proc.stderr is not None
            said = await _read_until(proc.stderr, "Ctrl+C again")
            assert "stopping: waiting up to 20 s for 1 reply in flight; Ctrl+C again to stop now" in said
            proc.send_signal(signal.SIGINT)
            # At once, not after the 20 s: the turn is cut where it got to.
            assert await asyncio.wait_for(proc.wait(), timeout=15) == 130
            request.cancel()
        rest = (await proc.stderr.read()).decode()
        assert "stopping now" in rest and "Traceback" not in rest
    finally:
        await _kill(proc)

    # The cut turn was stored as far as it got and runs again at the next start.
    fake_model.clear()
    fake_model.reply("the answer, after all")
    again = await _start(path, tmp_path)
    try:
        await _port(again)
        requests = await fake_model.wait_requests(2, timeout=30)
        assert requests[1]["messages"][-1]["content"] == "a long question"
        for _ in range(100):
            store = await Store.open(tmp_path / "data" / "gateway.sqlite3", checkpoint_interval_s=None)
            try:
                rows = [(m.role, m.content) for m in await store.messages("web:t")]
            finally:
                await store.close()
            if len(rows) == 2:
                break
            await asyncio.sleep(0.1)
        assert rows == [("user", "a long question"), ("assistant", "the answer, after all")]
        again.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(again.wait(), timeout=30) == 0
    finally:
        await _kill(again)


async def test_ctrl_c_with_the_output_piped_to_a_process_that_exits(fake_model: FakeModel, tmp_path: Path) -> None:
    """`gateway run 2>&1 | tee log`, Ctrl+C: tee dies too and every write of ours breaks.
    The shutdown still runs to the end: the process exits and the database is closed."""
    path = write_config(tmp_path, fake_model, log_level="INFO")
    read_end, write_end = os.pipe()
    # The reader: passes the first line on, then exits like tee on SIGINT.
    reader = await asyncio.create_subprocess_exec("head", "-n", "1", stdin=read_end,
                                                  stdout=asyncio.subprocess.PIPE)
    os.close(read_end)
    proc = await _start(path, tmp_path, stdout=write_end, stderr=write_end)
    os.close(write_end)
    try:
        assert reader.stdout is not None
        first = await asyncio.wait_for(reader.stdout.readline(), timeout=60)
        assert first  # the gateway is up and writing
        assert await asyncio.wait_for(reader.wait(), timeout=10) == 0  # nobody reads any more
        proc.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(proc.wait(), timeout=30) == 0
    finally:
        await _kill(proc)
        await _kill(reader)
    # A clean close of the last connection folds the WAL back and removes it.
    assert not (tmp_path / "data" / "gateway.sqlite3-wal").exists()


async def test_a_port_in_use_is_one_line_and_exit_code_2(fake_model: FakeModel, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        path = write_config(tmp_path, fake_model, http={"port": port})
        proc = await _start(path, tmp_path)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
        finally:
            await _kill(proc)
    errors = err.decode()
    assert proc.returncode == 2, errors
    assert "Traceback" not in errors
    (line,) = [x for x in errors.splitlines() if "cannot" in x]
    assert line == (f"cannot start: cannot listen on 127.0.0.1:{port}: the port is already in use "
                    "(another gateway running?); stop it or set http.port in config.json")
    assert out == b""


class Terminal:
    """`gateway chat` driven line by line."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.out = ""

    async def say(self, text: str, expect: str) -> re.Match[str]:
        """Send a line; the first match of `expect` in what the chat prints after it."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        start = len(self.out)
        self.proc.stdin.write(text.encode() + b"\n")
        await self.proc.stdin.drain()
        async with asyncio.timeout(30):
            while (found := re.search(expect, self.out[start:])) is None:
                chunk = await self.proc.stdout.read(4096)
                assert chunk, self.out
                self.out += chunk.decode()
        return found


async def test_the_terminal_chat_is_the_owner_and_follows_config_edits(fake_model: FakeModel,
                                                                        tmp_path: Path) -> None:
    path = write_config(tmp_path, fake_model)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "chat", "--config", str(path), cwd=tmp_path, env=ENV,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    term = Terminal(proc)
    try:
        # terminal:local is an admin without being listed in `admins` (the README's example).
        said = await term.say("/config agent_max_context_tokens 80000",
                              r"agent_max_context_tokens = 80000 \(saved|Only admins[^\n]*")
        assert said.group(0).endswith("saved"), said.group(0)
        assert json.loads(path.read_text())["agent_max_context_tokens"] == 80000
        await term.say("/config", r"system_prompt = ")  # the admin's full view

        raw = json.loads(path.read_text())
        raw["agent_max_steps"] = 9
        path.write_text(json.dumps(raw, indent=2))
        shown = ""
        for _ in range(40):  # the watcher settles a save in about half a second
            shown = (await term.say("/config agent_max_steps", r"agent_max_steps = (\d+)\n")).group(1)
            if shown == "9":
                break
            await asyncio.sleep(0.25)
        assert shown == "9"
        assert proc.stdin is not None
        proc.stdin.close()
        assert await asyncio.wait_for(proc.wait(), timeout=30) == 0
    finally:
        await _kill(proc)


async def _cli(args: list[str], cwd: Path, env: dict[str, str]) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", *args, cwd=cwd, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_operator_commands_read_the_database_while_the_gateway_runs(
        make_gateway: GatewayFactory, fake_model: FakeModel, tmp_path: Path) -> None:
    gw = await make_gateway()
    fake_model.reply("noted", usage=(1200, 34))
    assert await chat(gw, "alice", "remember: tea, no sugar") == "noted"
    assert gw.services is not None
    code, new = await Pairing(gw.services.store).code_for("telegram:4242")
    assert new
    assert gw.services.memory is not None
    await gw.services.memory.append_memory_md("web:alice", "- likes tea without sugar")

    # Telegram enabled with its token unset: none of these start Telegram, none need it.
    path = tmp_path / "config.json"
    raw = json.loads(path.read_text())
    raw["channels"] = {"telegram": {"enabled": True, "token": "${TELEGRAM_BOT_TOKEN}"}}
    path.write_text(json.dumps(raw))
    env = {k: v for k, v in ENV.items() if k != "TELEGRAM_BOT_TOKEN"}
    conf = ["--config", str(path)]
    results = await asyncio.gather(*(_cli(args, tmp_path, env) for args in (
        ["pairing", "list", *conf], ["sessions", *conf], ["usage", "--days", "3", *conf],
        ["memory", "web:alice", *conf], ["memory", "web:nobody", *conf], ["--version"])))
    (pending, sessions, usage, memory, unknown, version) = results
    for rc, _out, err in (pending, sessions, usage, memory, version):
        assert rc == 0 and "Traceback" not in err, err

    header, row = pending[1].splitlines()
    assert header.split() == ["WHO", "CODE", "AGE", "EXPIRES", "IN"]
    assert row.split()[:2] == ["telegram:4242", code]
    assert header.index("CODE") == row.index(code)  # aligned under its header

    header, row = sessions[1].splitlines()[:2]
    assert header.split()[:3] == ["SESSION", "WHO", "LAST"] and row.split()[:2] == ["web:alice", "web:alice"]
    assert re.search(r"\(\d+ s ago\)\s+1\s+\d+$", row), row  # turns 1, tokens of today's messages

    lines = usage[1].splitlines()
    assert lines[1].split() == ["DAY", "WHO", "TURNS", "TOKENS"]
    assert lines[2].split()[1:] == ["web:alice", "1", "1,234"]  # what the provider counted

    workspace = gw.services.memory.workspace("web:alice")
    listing = memory[1]
    assert f"{workspace / 'MEMORY.md'}" in listing and f"{workspace / 'memory'}{os.sep}" in listing
    assert f"{workspace / 'dialog'}{os.sep}" in listing
    assert re.search(r"MEMORY\.md\s+\d+ B", listing), listing
    assert unknown[0] == 1 and "no memory for scope 'web:nobody'" in unknown[2] and "web:alice" in unknown[2]
    assert re.fullmatch(r"gateway \d+\.\d+\.\d+\S*\n", version[1])

    rc, out, err = await _cli(["pairing", "approve", code.lower(), *conf], tmp_path, env)
    assert rc == 0 and out.startswith("Approved telegram:4242"), err
    assert await gw.pairing.is_approved("telegram:4242")  # the running gateway sees it at once
    rc, out, err = await _cli(["pairing", "approve", code, *conf], tmp_path, env)
    assert rc == 0 and "already approved" in out, err
    rc, _out, err = await _cli(["pairing", "approve", "NOPE2345", *conf], tmp_path, env)
    assert rc == 1 and "unknown or expired" in err
    rc, out, _err = await _cli(["pairing", "list", *conf], tmp_path, env)
    waiting, _, approved = out.strip().partition("\n\n")
    assert waiting == "No pairing codes are waiting."
    assert approved.splitlines()[1].split() == ["WHO", "APPROVED", "BY"]
    assert approved.splitlines()[2].split()[0] == "telegram:4242" and approved.endswith(" cli")


async def test_operator_commands_without_a_database_say_so(tmp_path: Path, fake_model: FakeModel) -> None:
    path = write_config(tmp_path, fake_model)
    rc, out, err = await _cli(["sessions", "--config", str(path)], tmp_path, ENV)
    assert rc == 1 and out == ""
    assert err.strip() == (f"no database at {tmp_path / 'data' / 'gateway.sqlite3'}: "
                           "the gateway has not run with this config yet")
    assert not (tmp_path / "data").exists()  # reading never creates anything
