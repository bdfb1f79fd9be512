"""Config: defaults, ${ENV} expansion, validation messages with key paths, the CLI check."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from gateway.config.checks import config_warnings, startup_problems, usable_webhook_secret
from gateway.config.load import ConfigError, atomic_write_text, load_config, parse_config
from tests.conftest import write_config
from tests.fakes.openai_server import FakeModel

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
    assert cfg.model_dump() == parse_config({}, environ={}).model_dump()


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
    # Rules about what a feature needs are checked for the command that starts it.
    open_web = parse_config({"http": {"host": "0.0.0.0"}}, environ={})
    assert startup_problems(open_web) == [
        "channels.web.token: required when http.host is not a loopback address"]
    assert startup_problems(open_web, channels=True, http=False) == []
    no_url = parse_config({"channels": {"telegram": {"enabled": True, "token": "1:x", "mode": "webhook",
                                                     "webhook_secret": "a" * 16}}}, environ={})
    assert startup_problems(no_url) == ["channels.telegram.webhook_url: required in webhook mode"]
    slack = parse_config({"channels": {"slack": {"enabled": True, "mode": "http", "bot_token": "xoxb-1"}}},
                         environ={})
    assert startup_problems(slack) == ["channels.slack.signing_secret: required in http mode"]
    with pytest.raises(ConfigError, match="timezone"):
        parse_config({"timezone": "Mars/Olympus"}, environ={})
    with pytest.raises(ConfigError, match="agent_max_steps"):
        parse_config({"agent_max_steps": 0}, environ={})


def test_bad_json_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text('{\n  "agent_max_steps": 3,\n}')
    with pytest.raises(ConfigError, match="trailing comma at the end of line 2"):  # where the comma is
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


# -- secrets: `${ENV}` only in secret keys; unset references are named problems --------------


def test_env_references_expand_in_secrets_only() -> None:
    env = {"K": "sk-live-123"}
    cfg = parse_config({
        "system_prompt": "Be brief. ${K}",
        "model": {"api_key": "${K}", "base_url": "http://${K}.example/v1"},
        "access": {"allow_from": ["telegram:${K}"]},
        "summary_model": {"name": "small", "api_key": "Bearer-${K}"},
    }, environ=env)
    assert cfg.model.key_value() == "sk-live-123"
    assert cfg.summary_model is not None and cfg.summary_model.key_value() == "Bearer-sk-live-123"
    # Anything that is not a secret stays as written, so no prompt or URL can carry a secret.
    assert cfg.system_prompt == "Be brief. ${K}"
    assert cfg.model.base_url == "http://${K}.example/v1"
    assert cfg.access.allow_from == ("telegram:${K}",)
    # Defaults are secrets too: model.api_key defaults to ${OPENAI_API_KEY}.
    assert parse_config({}, environ={"OPENAI_API_KEY": "sk-env"}).model.key_value() == "sk-env"


def test_an_unset_reference_names_the_key_and_the_variable_where_it_is_needed() -> None:
    raw = {"channels": {"telegram": {"enabled": True, "token": "${TG_TOKEN_FOR_TEST}",
                                     "webhook_secret": "${TG_HOOK_FOR_TEST}"}}}
    cfg = parse_config(raw, environ={})  # parses: `chat` and `pairing` do not start telegram
    assert cfg.channels.telegram.token is None  # never the literal text
    assert ("channels.telegram.token", "TG_TOKEN_FOR_TEST") in cfg.unset_env
    assert startup_problems(cfg) == [
        "channels.telegram.token: the environment variable TG_TOKEN_FOR_TEST is not set "
        "(needed when channels.telegram.enabled is true)"]  # the webhook secret: not in polling mode
    assert startup_problems(cfg, channels=False, http=False) == []  # what `chat` needs
    webhook = parse_config({"channels": {"telegram": {**raw["channels"]["telegram"], "mode": "webhook",
                                                      "webhook_url": "https://x.example/tg"}}},
                           environ={"TG_TOKEN_FOR_TEST": "1:abc"})
    assert startup_problems(webhook) == [
        "channels.telegram.webhook_secret: the environment variable TG_HOOK_FOR_TEST is not set "
        "(needed in webhook mode)"]
    # Discord's token, like Telegram's: needed only when the channel runs.
    discord = parse_config({"channels": {"discord": {"token": "${DC_TOKEN_FOR_TEST}"}}}, environ={})
    assert startup_problems(discord) == []
    discord = parse_config({"channels": {"discord": {"enabled": True, "token": "${DC_TOKEN_FOR_TEST}"}}}, environ={})
    assert startup_problems(discord) == [
        "channels.discord.token: the environment variable DC_TOKEN_FOR_TEST is not set "
        "(needed when channels.discord.enabled is true)"]
    assert startup_problems(parse_config({"channels": {"discord": {"enabled": True}}}, environ={})) == [
        "channels.discord.token: required when channels.discord.enabled is true"]
    # A web token reference that does not resolve never leaves the web chat open by accident.
    web = parse_config({"channels": {"web": {"token": "${WEB_TOKEN_FOR_TEST}"}}}, environ={})
    assert startup_problems(web) == [
        "channels.web.token: the environment variable WEB_TOKEN_FOR_TEST is not set "
        "(needed while channels.web.enabled is true)"]
    summary = parse_config({"summary_model": {"name": "s", "api_key": "${SUMMARY_KEY_FOR_TEST}"}}, environ={})
    assert startup_problems(summary, channels=False, http=False) == [
        "summary_model.api_key: the environment variable SUMMARY_KEY_FOR_TEST is not set "
        "(needed while summary_model is set)"]


def test_an_unset_model_key_is_only_a_warning() -> None:
    cfg = parse_config({}, environ={})
    assert startup_problems(cfg) == []
    assert config_warnings(cfg) == [
        "model.api_key: the environment variable OPENAI_API_KEY is not set; every chat answers with what "
        "to set until it is"]
    assert cfg.model.key_value() is None


@pytest.mark.parametrize(("secret", "usable"), [
    (None, False),
    ("", False),
    ("${TELEGRAM_WEBHOOK_SECRET}", False),  # the shipped text, were it ever left unexpanded
    ("sixteen-chars-ok", True),
    ("fifteen-chars-x", False),
    ("0123456789abcdef" * 16, True),  # 256, Telegram's maximum
    ("0123456789abcdef" * 16 + "x", False),
    ("has spaces in the middle!", False),  # Telegram refuses other characters
])
def test_webhook_secret_rules(secret: str | None, usable: bool) -> None:
    cfg = parse_config({"channels": {"telegram": {
        "enabled": True, "token": "1:abc", "mode": "webhook", "webhook_url": "https://x.example/tg",
        "webhook_secret": secret}}}, environ={})
    problems = startup_problems(cfg)
    assert (problems == []) is usable, problems
    assert (usable_webhook_secret(cfg.channels.telegram) is not None) is usable
    if not usable:
        assert problems[0].startswith("channels.telegram.webhook_secret: ")


# -- memory_consolidation_cron: the scheduler's own parser ------------------------------------


@pytest.mark.parametrize("cron", ["99 * * * *", "0 25 * * *", "*/0 * * * *", "0 0 31 2 *", "0 0 * * 8",
                                  "0 0 * *", "@sometimes"])
def test_bad_cron_is_refused_with_the_key(cron: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"memory_consolidation_cron": cron, "timezone": "Europe/Berlin"}, environ={})
    assert err.value.problems[0].startswith("memory_consolidation_cron: ")


@pytest.mark.parametrize("cron", ["0 0 * * *", "30 3 * * 7", "0 */6 * * mon-fri", "@daily", "15 2 29 2 *"])
def test_good_cron_passes(cron: str) -> None:
    assert parse_config({"memory_consolidation_cron": cron, "timezone": "Asia/Tokyo"},
                        environ={}).memory_consolidation_cron == cron


# -- the file's mode survives an atomic rewrite -------------------------------------------------


def test_atomic_write_keeps_the_mode_of_the_file_it_replaces(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text("{}")
    os.chmod(path, 0o640)
    atomic_write_text(path, "two")
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    os.chmod(path, 0o604)
    atomic_write_text(path, "three")
    assert stat.S_IMODE(path.stat().st_mode) == 0o604 and path.read_text() == "three"
    fresh = tmp_path / "new.txt"
    atomic_write_text(fresh, "x")
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o600  # a new file is private


# -- the CLI: check-config, run and chat ------------------------------------------------------


def _cli(args: list[str], cwd: Path, env_drop: tuple[str, ...] = (), stdin: str = "",
         timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in env_drop}
    return subprocess.run([sys.executable, "-m", "gateway", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=env, input=stdin)


def test_check_config_reports_unset_references_and_warns_about_the_model_key(tmp_path: Path) -> None:
    shipped = _cli(["check-config", str(ROOT / "config.json")], tmp_path, env_drop=("OPENAI_API_KEY",))
    assert shipped.returncode == 0, shipped.stderr
    assert "warning: model.api_key: the environment variable OPENAI_API_KEY is not set" in shipped.stderr

    raw = json.loads((ROOT / "config.json").read_text())
    raw["channels"]["telegram"].update(enabled=True, mode="webhook", webhook_url="https://bot.example/tg")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    run = _cli(["check-config", str(path)], tmp_path,
               env_drop=("TELEGRAM_BOT_TOKEN", "TELEGRAM_WEBHOOK_SECRET"))
    assert run.returncode == 2
    assert ("channels.telegram.token: the environment variable TELEGRAM_BOT_TOKEN is not set" in run.stderr
            and "channels.telegram.webhook_secret: the environment variable TELEGRAM_WEBHOOK_SECRET is not set"
            in run.stderr), run.stderr

    raw["memory_consolidation_cron"] = "99 * * * *"
    path.write_text(json.dumps(raw))
    cron = _cli(["check-config", str(path)], tmp_path)
    assert cron.returncode == 2 and "memory_consolidation_cron: '99 * * * *'" in cron.stderr, cron.stderr
    assert "Traceback" not in cron.stderr


def test_run_refuses_what_it_needs_and_chat_runs_without_it(fake_model: FakeModel, tmp_path: Path) -> None:
    path = write_config(tmp_path, fake_model, channels={"telegram": {
        "enabled": True, "token": "${TELEGRAM_BOT_TOKEN}", "base_url": "http://127.0.0.1:9/bot"}})
    run = _cli(["run", "--config", str(path)], tmp_path, env_drop=("TELEGRAM_BOT_TOKEN",), timeout=30)
    assert run.returncode == 2
    assert "channels.telegram.token: the environment variable TELEGRAM_BOT_TOKEN is not set" in run.stderr
    assert "Traceback" not in run.stderr
    # The terminal chat does not start telegram, so it does not need its token.
    chat = _cli(["chat", "--config", str(path)], tmp_path, env_drop=("TELEGRAM_BOT_TOKEN",), stdin="/help\n")
    assert chat.returncode == 0, chat.stderr
    assert "/context clear" in chat.stdout


def test_run_refuses_a_cron_the_scheduler_cannot_parse(fake_model: FakeModel, tmp_path: Path) -> None:
    # Before: check-config passed it, and `run` printed a traceback and hung.
    path = write_config(tmp_path, fake_model, memory_consolidation_cron="99 * * * *")
    run = _cli(["run", "--config", str(path)], tmp_path, timeout=30)
    assert run.returncode == 2, run.stderr
    assert "memory_consolidation_cron: '99 * * * *' is not a valid cron expression" in run.stderr
    assert "Traceback" not in run.stderr


def test_chat_honours_a_disabled_terminal(fake_model: FakeModel, tmp_path: Path) -> None:
    path = write_config(tmp_path, fake_model, channels={"terminal": {"enabled": False}})
    chat = _cli(["chat", "--config", str(path)], tmp_path, stdin="/help\n")
    assert chat.returncode == 2 and "channels.terminal.enabled" in chat.stderr


def test_compose_never_turns_an_unset_secret_into_an_empty_one() -> None:
    compose = (ROOT / "docker" / "compose.yaml").read_text()
    # `${VAR:-}` gave TELEGRAM_WEBHOOK_SECRET="" when unset, which used to switch the check off.
    assert not re.search(r"\$\{[A-Z_]+:-\}", compose)
    for name in ("OPENAI_API_KEY", "TELEGRAM_BOT_TOKEN", "TELEGRAM_WEBHOOK_SECRET", "SLACK_BOT_TOKEN",
                 "SLACK_APP_TOKEN", "SLACK_SIGNING_SECRET", "DISCORD_BOT_TOKEN"):
        assert re.search(rf"^\s+{name}:\s*$", compose, re.M), name  # passed through only when set
    assert "${WEB_TOKEN:?" in compose


def test_every_secret_field_is_a_secret_key() -> None:
    from pydantic import BaseModel, SecretStr

    from gateway.config.changes import is_secret_key
    from gateway.config.schema import Config

    def walk(model: type[BaseModel], prefix: str) -> list[tuple[str, bool]]:
        out = []
        for name, field in model.model_fields.items():
            args = getattr(field.annotation, "__args__", (field.annotation,))
            nested = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
            # A dict's entries sit one level down, under their names (mcp.servers.<name>, env.<VAR>).
            path = f"{prefix}{name}.*" if typing.get_origin(field.annotation) is dict else f"{prefix}{name}"
            if nested:
                out += walk(nested[0], f"{path}.")
            else:
                out.append((path, SecretStr in args))
        return out

    fields = walk(Config, "")
    assert len(fields) > 40
    assert ("mcp.servers.*.env.*", True) in fields and ("mcp.servers.*.headers.*", True) in fields
    for path, secret in fields:
        assert is_secret_key(path) is secret, path  # expanded iff masked iff refused in chat


def test_media_settings_and_the_transcription_key() -> None:
    from gateway.app import secret_values
    from gateway.config.changes import is_credential_destination, is_secret_key
    from gateway.config.schema import known_vision

    cfg = parse_config({}, environ={})
    assert (cfg.model.vision, cfg.model.sees_images()) == (None, True)  # gpt-4o-mini: from the table
    assert cfg.context_budget().vision
    assert not parse_config({"model": {"name": "deepseek-chat"}}, environ={}).context_budget().vision
    assert parse_config({"model": {"name": "my-local-llava", "vision": False}}, environ={}).context_budget().vision \
        is False
    assert parse_config({"model": {"name": "deepseek-chat", "vision": True}}, environ={}).model.sees_images()
    assert [known_vision(n) for n in ("openai/gpt-4.1-mini", "o3-mini", "claude-sonnet-4-5", "gpt-4o-transcribe",
                                      "qwen2.5-vl-7b-instruct", "llama3.1")] == [True, False, True, False, True, False]
    assert cfg.limits.max_inbound_file_bytes == 20 * 1024 * 1024
    assert cfg.transcription.enabled and cfg.transcription.model == "whisper-1"

    # The endpoint and key default to the model's; their own win when set.
    model = {"base_url": "https://llm.example/v1", "api_key": "sk-model"}
    assert parse_config({"model": model}, environ={}).transcription_endpoint() == (
        "https://llm.example/v1", "sk-model")
    own = parse_config({"model": model, "transcription": {"base_url": "https://stt.example/v1",
                                                           "api_key": "${STT_KEY_FOR_TEST}"}},
                       environ={"STT_KEY_FOR_TEST": "sk-stt"})
    assert own.transcription_endpoint() == ("https://stt.example/v1", "sk-stt")
    # A server of its own never gets the model's key (SPEC §2: a credential stays with its host).
    elsewhere = parse_config({"model": model, "transcription": {"base_url": "https://stt.example/v1"}}, environ={})
    assert elsewhere.transcription_endpoint() == ("https://stt.example/v1", None)
    same = parse_config({"model": model, "transcription": {"base_url": "https://llm.example/v1/"}}, environ={})
    assert same.transcription_endpoint() == ("https://llm.example/v1/", "sk-model")
    assert "sk-stt" in secret_values(own)  # redacted from logs like the other secrets
    assert is_secret_key("transcription.api_key") and is_credential_destination("transcription.base_url")
    assert is_secret_key("channels.discord.token") and is_credential_destination("channels.discord.api_base")
    with_discord = parse_config({"channels": {"discord": {"token": "dc-secret-token"}}}, environ={})
    assert "dc-secret-token" in secret_values(with_discord)
    unset = parse_config({"transcription": {"api_key": "${STT_KEY_FOR_TEST}"}}, environ={})
    assert startup_problems(unset, channels=False, http=False) == [
        "transcription.api_key: the environment variable STT_KEY_FOR_TEST is not set "
        "(needed while transcription.enabled is true)"]
    off = parse_config({"transcription": {"enabled": False, "api_key": "${STT_KEY_FOR_TEST}"}}, environ={})
    assert startup_problems(off, channels=False, http=False) == []
    with pytest.raises(ConfigError, match=r"transcription\.base_url: must be an http"):
        parse_config({"transcription": {"base_url": "ftp://x"}}, environ={})
    with pytest.raises(ConfigError, match=r"limits\.max_inbound_file_mb"):
        parse_config({"limits": {"max_inbound_file_mb": 0}}, environ={})


def test_a_store_url_from_the_environment_is_checked_once_expanded() -> None:
    """docker/config.cluster.json's `"url": "${GATEWAY_STORE_URL}"`: the reference passes
    the schema, its value must be a database URL, and an unset one stops `run`."""
    url = "postgresql://gateway:pw-0123@db:5432/gateway"
    cfg = parse_config({"store": {"url": "${STORE_URL_FOR_TEST}"}}, environ={"STORE_URL_FOR_TEST": url})
    assert cfg.store.url is not None and cfg.store.url.get_secret_value() == url
    with pytest.raises(ConfigError) as err:
        parse_config({"store": {"url": "${STORE_URL_FOR_TEST}"}}, environ={"STORE_URL_FOR_TEST": "mysql://u:pw@db"})
    assert err.value.problems == ["store.url: the environment variable it names must hold a sqlite:/// or "
                                  "postgresql:// URL"]
    unset = parse_config({"store": {"url": "${STORE_URL_FOR_TEST}"}}, environ={})
    assert startup_problems(unset, channels=False, http=False) == [
        "store.url: the environment variable STORE_URL_FOR_TEST is not set (needed to open the database)"]
    with pytest.raises(ConfigError):
        parse_config({"store": {"url": "mysql://u@db"}}, environ={})
