"""The CLI as a person uses it: the terminal chat, and a clear error for a bad config."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import sys
from pathlib import Path

from tests.conftest import banner_link, write_config
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


async def test_chat_says_which_config_and_data_dir_and_the_missing_key_once(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "chat", cwd=tmp_path, stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env={**env, "PYTHONUNBUFFERED": "1"})
    out, err = await asyncio.wait_for(proc.communicate(b"/help\n"), timeout=120)
    assert proc.returncode == 0, err
    text = out.decode()
    assert text.splitlines()[0] == f"no config.json here: defaults; data in {tmp_path.resolve() / 'data'}"
    said = (text + err.decode()).count("model.api_key")
    assert said == 1, text + err.decode()


async def test_run_says_which_config_and_data_dir_and_the_missing_key_once(
        fake_model: FakeModel, tmp_path: Path) -> None:
    path = write_config(tmp_path, fake_model, model={"api_key": "${OPENAI_API_KEY}"})
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "run", "--config", str(path), cwd=tmp_path,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env={**env, "PYTHONUNBUFFERED": "1"})
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), timeout=60)
        assert line.startswith(b"gateway running")
        # The web chat's link carries the data dir's token (SPEC §9: the page needs it on loopback too).
        _port, auth = banner_link(line.decode())
        token_file = tmp_path / "data" / "web-token"
        assert auth == {"Authorization": f"Bearer {token_file.read_text().strip()}"}
        assert token_file.stat().st_mode & 0o777 == 0o600
        banner = await asyncio.wait_for(proc.stdout.readline(), timeout=60)
        assert banner.decode().rstrip("\n") == f"config {path.resolve()}; data in {tmp_path.resolve() / 'data'}"
        proc.send_signal(signal.SIGINT)
        _out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    lines = err.decode().splitlines()
    assert sum("model.api_key" in line or "API key" in line for line in lines) == 1, lines


async def test_a_bad_config_read_by_default_is_named_and_check_config_takes_config(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"http": {"prot": 1}}))
    code, _out, err = await _run_cli(["run"], tmp_path)  # ./config.json, read without --config
    assert code == 2
    assert err.splitlines()[0] == f"config {path.resolve()} has 1 problem(s):", err
    for args in (["check-config", "--config", str(path)], ["check-config", str(path)], ["check-config"]):
        code, _out, err = await _run_cli(args, tmp_path)
        assert code == 2, (args, err)
        assert err.splitlines()[0] == f"config {path.resolve()} has 1 problem(s):", (args, err)
    path.write_text(json.dumps({"http": {"port": 0}}))
    code, out, err = await _run_cli(["check-config", "--config", "config.json"], tmp_path)
    assert code == 0 and out.strip() == "config.json: OK", err


def _every_parser(parser: argparse.ArgumentParser, name: str = "gateway") -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(name, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                found += _every_parser(sub, f"{name} {sub_name}")
    return found


def test_every_command_and_option_says_what_it_does() -> None:
    from gateway.__main__ import build_parser

    parsers = _every_parser(build_parser())
    assert {name for name, _ in parsers} >= {
        "gateway run", "gateway chat", "gateway check-config", "gateway pairing list", "gateway pairing approve",
        "gateway pairing revoke", "gateway sessions", "gateway usage", "gateway memory", "gateway config-reset"}
    for name, parser in parsers:
        assert parser.description, f"{name}: no description"
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for choice in action._choices_actions:
                    assert choice.help, f"{name} {choice.dest}: no help"
                continue
            assert action.help and action.help != argparse.SUPPRESS, f"{name} {action.option_strings or action.dest}"


async def test_the_readmes_local_model_configs_pass_check_config_without_a_key(tmp_path: Path) -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    section = readme.split("### Try it without a key", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```json\n(.*?)```", section, re.S)
    assert len(blocks) == 2
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    for n, block in enumerate(blocks):
        path = tmp_path / f"local-{n}.json"
        path.write_text(block)
        assert json.loads(block)["model"]["base_url"] in ("http://localhost:11434/v1", "http://localhost:8081/v1")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway", "check-config", "--config", str(path), cwd=tmp_path,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env)
        out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
        assert proc.returncode == 0 and out.decode().strip() == f"{path}: OK", err.decode()
        assert err.decode() == ""  # not even a warning: the placeholder key counts as a key


async def test_web_link_prints_the_link_with_the_data_dir_s_token(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model": {"name": "demo"}, "http": {"port": 8123}}))
    code, out, err = await _run_cli(["web-link", "--config", str(path)], tmp_path)
    assert code == 0, err
    token = (tmp_path / "data" / "web-token").read_text().strip()  # made now: `run` will use this one
    assert out == f"http://127.0.0.1:8123/?token={token}\n"
    assert (await _run_cli(["web-link", "--config", str(path)], tmp_path))[1] == out  # the same one again
    path.write_text(json.dumps({"model": {"name": "demo"}, "channels": {"web": {"enabled": False}}}))
    code, _, err = await _run_cli(["web-link", "--config", str(path)], tmp_path)
    assert code == 1 and "disabled" in err
