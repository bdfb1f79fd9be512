"""What people and admins see: a short /config for people, "did you mean" for a mistyped
key, /context without the operator's internals, pairing that tells the approved person;
and the wording of the operator's logs and config errors."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import SecretStr

from gateway.config.load import ConfigError, parse_config, parse_config_text
from gateway.config.schema import ModelConfig
from gateway.model.client import ModelClient
from gateway.model.errors import ModelError
from tests.conftest import GatewayFactory, chat
from tests.fakes import telegram_server
from tests.fakes.openai_server import FakeModel
from tests.fakes.telegram_server import FakeTelegram

fake_telegram = telegram_server.fake_telegram  # the fixture

ROOT = Path(__file__).resolve().parent.parent


async def test_people_see_budgets_and_limits_admins_everything(make_gateway: GatewayFactory) -> None:
    gw = await make_gateway(admins=["web:boss"], system_prompt="Secret sauce: be brief.")
    short = await chat(gw, "pat", "/config")
    assert "agent_max_context_tokens = 50000" in short and "limits.turn_timeout_s" in short
    assert short.startswith("Budgets and limits (admins see every setting):")
    for private in ("admins =", "system_prompt", "Secret sauce", "base_url", "***", "channels."):
        assert private not in short, private
    for key in ("admins", "system_prompt", "model.base_url", "channels.web.token"):
        assert await chat(gw, "pat", f"/config {key}") == f"{key} is shown to admins only."
    assert "limits.max_inbound_chars" in await chat(gw, "pat", "/config limits")  # a section by its name

    full = await chat(gw, "boss", "/config")
    assert "Secret sauce" in full and 'admins = ["web:boss"]' in full and "model.api_key = \"***\"" in full


async def test_people_see_the_time_zone_task_limits_and_the_model_answering_them(
        make_gateway: GatewayFactory, fake_model: FakeModel) -> None:
    gw = await make_gateway(timezone="Europe/Berlin", tasks={"max_per_scope": 5},
                            models={"eyes": {"name": "gpt-4o", "api_key": "sk-eyes-0123456789abcdef"}},
                            tools={"web_search": {"provider": "brave", "api_key": "search-key-0123456789"}})
    short = await chat(gw, "pat", "/config")
    for line in ('timezone = "Europe/Berlin"', "tasks.max_per_scope = 5", "tasks.min_interval_s = 300",
                 f'model.name = "{fake_model.model_name}"', "model.vision = false"):
        assert line in short, (line, short)
    assert short.endswith(f"Here: model {fake_model.model_name} (it sees no images); time zone Europe/Berlin.")
    # The session's own model, once picked with /model, not the config's `model`.
    assert "gpt-4o" in await chat(gw, "pat", "/model eyes")
    short = await chat(gw, "pat", "/config")
    assert 'model.name = "gpt-4o"' in short and "model.vision = true" in short
    assert short.endswith("Here: model gpt-4o (images go to it); time zone Europe/Berlin.")
    assert await chat(gw, "pat", "/config model.name") == 'model.name = "gpt-4o"'
    assert await chat(gw, "pat", "/config model.vision") == "model.vision = true"
    assert await chat(gw, "pat", "/config tasks") == "```\ntasks.max_per_scope = 5\ntasks.min_interval_s = 300\n" \
                                                     "tasks.misfire_grace_s = 3600\n```"
    # Secrets never: no key, no masked key, no address keys are sent to.
    for private in ("***", "api_key", "sk-eyes", "search-key", "base_url", "models.eyes"):
        assert private not in short, private
    for key in ("model.api_key", "models.eyes.api_key", "tools.web_search.api_key", "model.base_url"):
        assert await chat(gw, "pat", f"/config {key}") == f"{key} is shown to admins only."
    assert "sk-eyes" not in await chat(gw, "pat", "/config models")


async def test_a_mistyped_config_key_gets_did_you_mean(make_gateway: GatewayFactory) -> None:
    gw = await make_gateway(admins=["web:boss"])
    reply = await chat(gw, "pat", "/config agent_max_context_token")
    assert reply == ("There is no setting 'agent_max_context_token'. Did you mean agent_max_context_tokens? "
                     "Send /config to list them.")
    assert "Did you mean http.port?" in await chat(gw, "boss", "/config port 9000")
    assert "Did you mean" not in await chat(gw, "boss", "/config zzzz")


async def test_context_shows_internals_to_admins_only(make_gateway: GatewayFactory, fake_model: FakeModel) -> None:
    gw = await make_gateway(admins=["web:boss"])
    assert gw.scheduler is not None and await gw.scheduler.wait_idle(5)  # the purge at start ran
    for who in ("pat", "boss"):
        fake_model.reply("hi", usage=(9000, 3))  # far from the local estimate: calibrates
        await chat(gw, who, "hello")
    person = await chat(gw, "pat", "/context")
    assert "Turns: 1 of 20" in person
    assert "Last jobs" not in person and "calibrated" not in person and "start:" not in person
    admin = await chat(gw, "boss", "/context")
    assert re.search(r"Last jobs: purge at start \d{4}-\d\d-\d\d \d\d:\d\d: ok", admin), admin
    assert "calibrated ×" in admin and "start:" not in admin


async def test_pairing_is_logged_and_the_approved_person_is_told(
        make_gateway: GatewayFactory, fake_telegram: FakeTelegram, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    await make_gateway(admins=["telegram:1"], channels={"telegram": {
        "enabled": True, "token": fake_telegram.token, "base_url": fake_telegram.base_url,
        "base_file_url": fake_telegram.base_file_url, "poll_timeout_s": 1}})
    fake_telegram.push_message(chat_id=7, user_id=7, text="my private words")
    (refusal,) = await fake_telegram.wait_sent(1)
    code = re.search(r"pairing code is ([A-Z0-9]{8})", refusal["text"])
    assert code
    (logged,) = [r for r in caplog.records if r.getMessage().startswith("pairing requested")]
    assert (logged.__dict__["channel"], logged.__dict__["user"]) == ("telegram", "7")
    assert not any("my private words" in r.getMessage() or "my private words" in str(r.__dict__)
                   for r in caplog.records)

    fake_telegram.push_message(chat_id=1, user_id=1, text=f"/approve {code.group(1)}")
    sent = await fake_telegram.wait_sent(3)
    told = next(m for m in sent[1:] if m["chat_id"] == 7)
    assert told["text"].startswith("You're approved: you can chat with me now")
    assert next(m for m in sent[1:] if m["chat_id"] == 1)["text"] == "Approved telegram:7."

    fake_telegram.push_message(chat_id=1, user_id=1, text=f"/approve {code.group(1)}")
    again = (await fake_telegram.wait_sent(4))[3]
    assert again["chat_id"] == 1 and again["text"] == "That code was already approved: telegram:7 can chat."


# -- the operator's words ---------------------------------------------------------------------


def test_json_errors_point_at_the_line_with_the_problem() -> None:
    text = '{\n  "agent_max_steps": 3\n  "timezone": "UTC"\n}\n'
    with pytest.raises(ConfigError) as missing:
        parse_config_text(text, environ={})
    assert missing.value.problems == ['(file): invalid JSON: missing comma after line 2 ("agent_max_steps": 3)']
    with pytest.raises(ConfigError) as trailing:
        parse_config_text('{\n  "agent_max_steps": 3,\n}\n', environ={})
    assert trailing.value.problems == ["(file): invalid JSON: a trailing comma at the end of line 2 "
                                       '("agent_max_steps": 3,); JSON allows no comma before \'}\'']


def test_a_list_setting_given_as_text_says_list() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"admins": "telegram:1", "access": {"allow_from": "*"}}, environ={})
    assert err.value.problems == [
        'admins: should be a list (a JSON array), e.g. ["telegram:123456789", "slack:U0123ABCD"]',
        'access.allow_from: should be a list (a JSON array), e.g. ["telegram:123456789", "telegram:-1001234567890"]',
    ]


async def test_a_fresh_start_logs_plain_words(make_gateway: GatewayFactory, fake_model: FakeModel,
                                              caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    gw = await make_gateway()
    assert gw.scheduler is not None and await gw.scheduler.wait_idle(5)
    await chat(gw, "ann", "hi")
    await gw.stop(timeout=5)
    said = [r.getMessage() for r in caplog.records]
    assert not [m for m in said if "catching up" in m]  # nothing was ever missed on a fresh install
    (purge,) = [m for m in said if m.startswith("purge ")]
    assert re.fullmatch(r"purge at start \d{4}-\d\d-\d\d \d\d:\d\d: 0 sessions, .*", purge), purge
    (commits,) = [m for m in said if m.startswith("group commits")]
    assert commits.startswith("group commits since start: messages 2 rows in 2 commits, events 1 row in 1 commit")


async def test_a_reload_logs_which_settings_changed(make_gateway: GatewayFactory, tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    gw = await make_gateway()
    watcher = gw.config_watcher()
    await watcher.start()
    try:
        path = tmp_path / "config.json"
        raw = json.loads(path.read_text())
        path.write_text(json.dumps({**raw, "agent_max_context_turns": 7, "limits": {"turn_timeout_s": 99}}))
        assert await watcher.reload()
    finally:
        await watcher.stop()
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("config reloaded")]
    assert line == "config reloaded: agent_max_context_turns, limits.turn_timeout_s"


async def test_a_retry_after_a_connection_error_names_no_http_status(
        fake_model: FakeModel, caplog: pytest.LogCaptureFixture) -> None:
    async def no_wait(_seconds: float) -> None:
        return None

    client = ModelClient(ModelConfig(name="m", base_url=fake_model.base_url, api_key=SecretStr("k"),
                                     max_retries=1), sleep=no_wait)
    await fake_model.stop()  # nothing listens any more
    caplog.set_level(logging.WARNING)
    with pytest.raises(ModelError):
        await client.complete([{"role": "user", "content": "hi"}])
    await client.close()
    (line,) = [r.getMessage() for r in caplog.records if "retry" in r.getMessage()]
    assert "HTTP None" not in line and "(connection, no HTTP response)" in line


def test_every_log_record_is_one_line_and_file_watching_is_quiet() -> None:
    script = (
        "import logging, warnings\n"
        "from gateway.ops.logs import setup_logging\n"
        "setup_logging('INFO')\n"
        "logging.getLogger('watchfiles.main').info('1 change detected')\n"
        "warnings.warn('a library complains')\n"
        "logging.getLogger('gateway.test').info('still here')\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT)
    lines = run.stderr.splitlines()
    assert all(re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d [A-Z]+ ", line) for line in lines), lines
    assert "1 change detected" not in run.stderr
    assert any("WARNING py.warnings" in x and "a library complains" in x for x in lines), lines
    assert any("still here" in x for x in lines)


def test_ci_keeps_the_readme_venv() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert "rm -rf .venv\n" not in ci and "python3 -m venv .venv-ci" in ci
    assert ".venv-ci/" in (ROOT / ".gitignore").read_text().splitlines()


async def test_approve_from_chat_of_an_expired_code_says_expired(make_gateway: GatewayFactory) -> None:
    gw = await make_gateway()
    code, _ = await gw.pairing.code_for("telegram:9", now=1000.0)
    assert gw.pairing.clock() > 1000.0 + 3600
    reply = await chat(gw, "local", f"/approve {code}")  # web:local is not the terminal owner
    assert reply == "Only admins can approve pairing codes."
    assert (await gw.pairing.explain_failure(code)).startswith("That code expired")
