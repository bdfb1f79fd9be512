"""Config: defaults, ${ENV} expansion, validation messages with key paths, the CLI check."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.config import Config, ConfigError, atomic_write_text, load_config, parse_config

ROOT = Path(__file__).resolve().parents[1]


def test_shipped_config_has_every_contract_key_and_no_secret() -> None:
    raw = json.loads((ROOT / "config.json").read_text())
    cfg = parse_config(raw, environ={})
    assert cfg.agent_max_context_tokens == 50_000
    assert cfg.agent_max_context_turns == 20
    assert cfg.agent_max_steps == 15
    assert cfg.access.dm_policy == "pairing"
    assert cfg.channels.web.enabled and not cfg.channels.telegram.enabled
    assert raw["model"]["api_key"] == "${OPENAI_API_KEY}"
    for key in ("agent_max_context_tokens", "agent_max_context_turns", "agent_max_steps", "system_prompt",
                "data_dir", "timezone", "session_retention_days", "tool_result_max_chars",
                "history_tool_result_max_chars", "tool_result_ttl_days", "memory_consolidation_cron",
                "admins", "access", "group_session_scope", "model", "summary_model", "channels", "http"):
        assert key in raw
    # Parsing the shipped file gives exactly the embedded defaults.
    assert cfg == Config(model=cfg.model, channels=cfg.channels)


def test_env_expansion_and_unset_variables() -> None:
    cfg = parse_config({"model": {"api_key": "${MY_KEY}"}}, environ={"MY_KEY": "sk-123"})
    assert cfg.model.key_value() == "sk-123"
    unset = parse_config({"model": {"api_key": "${MY_KEY}"}}, environ={})
    assert unset.model.key_value() is None


def test_unknown_keys_are_refused_with_a_suggestion() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"agent_max_context_token": 1, "channels": {"telegram": {"tokn": "x"}}}, environ={})
    problems = err.value.problems
    assert any("agent_max_context_token: unknown key (did you mean 'agent_max_context_tokens'?)" in p
               for p in problems)
    assert any("channels.telegram.tokn: unknown key (did you mean 'channels.telegram.token'?)" in p
               for p in problems)


def test_rules_across_keys() -> None:
    with pytest.raises(ConfigError, match=r"channels\.web\.token is required"):
        parse_config({"http": {"host": "0.0.0.0"}}, environ={})
    with pytest.raises(ConfigError, match=r"telegram\.token"):
        parse_config({"channels": {"telegram": {"enabled": True, "token": "${TELEGRAM_BOT_TOKEN}"}}}, environ={})
    with pytest.raises(ConfigError, match="timezone"):
        parse_config({"timezone": "Mars/Olympus"}, environ={})
    with pytest.raises(ConfigError, match="agent_max_steps"):
        parse_config({"agent_max_steps": 0}, environ={})


def test_bad_json_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text('{\n  "agent_max_steps": 3,\n}')
    with pytest.raises(ConfigError, match="line 3"):
        load_config(path)


def test_atomic_write_replaces_whole(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    atomic_write_text(path, "one")
    atomic_write_text(path, "two")
    assert path.read_text() == "two"
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]


def test_check_config_cli_lists_every_problem(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"agent_max_context_turns": "many", "access": {"dm_policy": "everyone"}}))
    run = subprocess.run([sys.executable, "-m", "gateway", "check-config", str(bad)],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert run.returncode == 2
    assert "agent_max_context_turns" in run.stderr and "access.dm_policy" in run.stderr
    ok = subprocess.run([sys.executable, "-m", "gateway", "check-config", str(ROOT / "config.json")],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
