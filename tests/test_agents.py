"""Agents, bindings, models by alias, fallbacks and the commands around them (SPEC §5.5):
the fake model records which model name and system prompt each request carried."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import pytest

from channels.terminal.channel import TerminalChannel
from gateway.agents import agent_scope, bound_agent
from gateway.app import Gateway
from gateway.config.checks import config_warnings
from gateway.config.load import ConfigError, parse_config
from gateway.types import Inbound
from tests.conftest import GatewayFactory, chat, write_config
from tests.fakes import slack_server, telegram_server
from tests.fakes.openai_server import ErrorReply, FakeModel, Hang, Reply
from tests.fakes.slack_server import FakeSlack
from tests.fakes.telegram_server import FakeTelegram

fake_telegram = telegram_server.fake_telegram  # the fixtures
fake_slack = slack_server.fake_slack

GROUP, TOPIC_GROUP, TOPIC = -100551, -100777, 5
CODER_PROMPT = "You are the coder agent."


def telegram_section(fake: FakeTelegram) -> dict[str, Any]:
    return {"telegram": {"enabled": True, "token": fake.token, "base_url": fake.base_url,
                         "base_file_url": fake.base_file_url, "poll_timeout_s": 1}}


def team(fake_model: FakeModel, fake: FakeTelegram, **extra: Any) -> dict[str, Any]:
    """The README's example: a Telegram group bound to a "coder" agent on a stronger model."""
    settings: dict[str, Any] = {
        "access": {"dm_policy": "open", "allow_from": ["*"], "group_trigger": "all"},
        "channels": telegram_section(fake),
        "models": {"strong": {"name": "strong-model", "context_window": 200_000},
                   "fast": {"name": "fast-model"}},
        "agents": {"coder": {"system_prompt": CODER_PROMPT, "model": "strong", "models": ["strong", "fast"]}},
        "bindings": [{"match": {"channel": "telegram", "chat": str(GROUP)}, "agent": "coder"},
                     {"match": {"channel": "telegram", "chat": str(TOPIC_GROUP), "thread": str(TOPIC)},
                      "agent": "coder"}],
    }
    settings.update(extra)
    return settings


def system_of(request: dict[str, Any]) -> str:
    return str(request["messages"][0]["content"])


async def telegram_turn(fake: FakeTelegram, fake_model: FakeModel, **message: Any) -> tuple[dict[str, Any], str]:
    """Push a message; (the model request it caused, the text sent back)."""
    before_sent, before_requests = len(fake.sent), len(fake_model.requests)
    fake.push_message(**message)
    sent = await fake.wait_sent(before_sent + 1)
    await fake_model.wait_requests(before_requests + 1)
    return fake_model.requests[before_requests], sent[before_sent]["text"]


async def telegram_command(fake: FakeTelegram, **message: Any) -> str:
    before = len(fake.sent)
    fake.push_message(**message)
    return str((await fake.wait_sent(before + 1))[before]["text"])


# -- bindings ----------------------------------------------------------------------------------


async def test_a_bound_group_and_topic_get_the_coder_and_a_dm_the_default(
        make_gateway: GatewayFactory, fake_model: FakeModel, fake_telegram: FakeTelegram) -> None:
    gw = await make_gateway(**team(fake_model, fake_telegram))
    fake_model.respond_with(lambda body: f"answered by {body['model']}")

    request, text = await telegram_turn(fake_telegram, fake_model, chat_id=GROUP, user_id=7, text="fix the bug",
                                        chat_type="supergroup")
    assert request["model"] == "strong-model" and text == "answered by strong-model"
    assert system_of(request).startswith(CODER_PROMPT)

    request, _ = await telegram_turn(fake_telegram, fake_model, chat_id=TOPIC_GROUP, user_id=8, text="in the topic",
                                     chat_type="supergroup", thread_id=TOPIC)
    assert request["model"] == "strong-model" and system_of(request).startswith(CODER_PROMPT)

    # The same group outside that topic is not bound; neither is a DM.
    request, _ = await telegram_turn(fake_telegram, fake_model, chat_id=TOPIC_GROUP, user_id=8, text="general",
                                     chat_type="supergroup", thread_id=99)
    assert request["model"] == fake_model.model_name and not system_of(request).startswith(CODER_PROMPT)
    request, _ = await telegram_turn(fake_telegram, fake_model, chat_id=7, user_id=7, text="hello")
    assert request["model"] == fake_model.model_name
    assert system_of(request).startswith(gw.cfg.system_prompt)

    # Budgets follow the chosen model's window: the coder's model has a window of its own.
    assert gw.cfg.context_budget(gw.cfg.model_for("strong")).context_window == 200_000


async def test_memory_written_under_one_agent_never_reaches_another(
        make_gateway: GatewayFactory, fake_model: FakeModel, fake_telegram: FakeTelegram) -> None:
    await make_gateway(**team(fake_model, fake_telegram, group_session_scope="group"))
    # The default agent keeps a fact in the group's memory (a group not bound to anyone).
    fake_model.tool_call("memory_write", {"text": "DEFAULT-AGENT-SECRET", "target": "memory"})
    fake_model.reply("kept")
    await telegram_turn(fake_telegram, fake_model, chat_id=-200, user_id=7, text="remember", chat_type="supergroup")
    # The coder keeps one in its group.
    fake_model.tool_call("memory_write", {"text": "CODER-AGENT-SECRET", "target": "memory"})
    fake_model.reply("kept")
    await telegram_turn(fake_telegram, fake_model, chat_id=GROUP, user_id=7, text="remember", chat_type="supergroup")

    fake_model.respond_with(lambda body: "ok")
    request, _ = await telegram_turn(fake_telegram, fake_model, chat_id=GROUP, user_id=7, text="what do you know",
                                     chat_type="supergroup")
    assert "CODER-AGENT-SECRET" in system_of(request) and "DEFAULT-AGENT-SECRET" not in str(request)
    request, _ = await telegram_turn(fake_telegram, fake_model, chat_id=-200, user_id=7, text="and you",
                                     chat_type="supergroup")
    assert "DEFAULT-AGENT-SECRET" in system_of(request) and "CODER-AGENT-SECRET" not in str(request)


def test_a_shared_session_is_never_bound_by_who_writes_first() -> None:
    cfg = parse_config({"agents": {"coder": {}},
                        "bindings": [{"match": {"user": "7"}, "agent": "coder"}], "group_session_scope": "user"})
    dm = Inbound(channel="telegram", chat_id="7", user_id="7", text="", event_id="1")
    own_group_session = Inbound(channel="telegram", chat_id="-1", user_id="7", text="", event_id="2", is_group=True)
    topic = Inbound(channel="telegram", chat_id="-1", user_id="7", text="", event_id="3", is_group=True,
                    thread_id="4")
    assert [bound_agent(cfg, m) for m in (dm, own_group_session, topic)] == ["coder", "coder", "default"]
    assert agent_scope("coder", "telegram:user:7") == "coder/telegram:user:7"
    assert agent_scope("default", "telegram:user:7") == "telegram:user:7"


@pytest.mark.parametrize(("config", "problem"), [
    ({"bindings": [{"match": {"chat": "1"}, "agent": "nobody"}]}, "bindings.0.agent: unknown agent 'nobody'"),
    ({"models": {"a": {}}, "model": {"fallbacks": ["a", "zzz"]}}, "model.fallbacks.1: unknown model alias 'zzz'"),
    ({"agents": {"coder": {"model": "big"}}}, "agents.coder.model: unknown model alias 'big'"),
    ({"agents": {"Coder!": {}}}, "agents.Coder!: an agent's name is"),
    ({"agents": {"coder": {"system_prompt": "a", "system_prompt_file": "b"}}}, "agents.coder: give system_prompt or"),
    ({"models": {"a": {"fallbacks": ["b"]}}}, "models.a.fallbacks: unknown key"),
    ({"agents": {"coder": {"delegates": ["resarcher"]}, "researcher": {}}},
     "agents.coder.delegates.0: unknown agent 'resarcher'"),
])
def test_a_binding_or_alias_that_points_nowhere_is_a_problem_with_its_key(config: dict[str, Any],
                                                                           problem: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(config)
    assert any(p.startswith(problem) for p in err.value.problems), err.value.problems


# -- /model ------------------------------------------------------------------------------------


async def test_two_people_in_one_group_pick_their_own_models(
        make_gateway: GatewayFactory, fake_model: FakeModel, fake_telegram: FakeTelegram) -> None:
    await make_gateway(**team(fake_model, fake_telegram))
    fake_model.respond_with(lambda body: "ok")
    shown = await telegram_command(fake_telegram, chat_id=GROUP, user_id=7, text="/model", chat_type="supergroup")
    assert "strong" in shown and "fast" in shown
    assert "fast-model" in await telegram_command(fake_telegram, chat_id=GROUP, user_id=7, text="/model fast",
                                                  chat_type="supergroup")
    request, _ = await telegram_turn(fake_telegram, fake_model, chat_id=GROUP, user_id=7, text="q",
                                     chat_type="supergroup")
    assert request["model"] == "fast-model"
    request, _ = await telegram_turn(fake_telegram, fake_model, chat_id=GROUP, user_id=8, text="q",
                                     chat_type="supergroup")
    assert request["model"] == "strong-model"  # the other person's session keeps the agent's model
    refused = await telegram_command(fake_telegram, chat_id=GROUP, user_id=8, text="/model huge",
                                     chat_type="supergroup")
    assert "no model 'huge'" in refused
    await telegram_command(fake_telegram, chat_id=GROUP, user_id=7, text="/model default", chat_type="supergroup")
    request, _ = await telegram_turn(fake_telegram, fake_model, chat_id=GROUP, user_id=7, text="q",
                                     chat_type="supergroup")
    assert request["model"] == "strong-model"


async def test_in_a_shared_topic_only_admins_pick_the_model(
        make_gateway: GatewayFactory, fake_model: FakeModel, fake_telegram: FakeTelegram) -> None:
    await make_gateway(**team(fake_model, fake_telegram, admins=["telegram:1"]))
    fake_model.respond_with(lambda body: "ok")
    where = {"chat_id": TOPIC_GROUP, "chat_type": "supergroup", "thread_id": TOPIC}
    refused = await telegram_command(fake_telegram, user_id=8, text="/model fast", **where)
    assert "only admins" in refused
    request, _ = await telegram_turn(fake_telegram, fake_model, user_id=8, text="q", **where)
    assert request["model"] == "strong-model"
    assert "fast-model" in await telegram_command(fake_telegram, user_id=1, text="/model fast", **where)
    request, _ = await telegram_turn(fake_telegram, fake_model, user_id=8, text="q", **where)
    assert request["model"] == "fast-model"  # the shared session changed for everyone


async def test_a_restart_keeps_each_sessions_agent_and_model(
        make_gateway: GatewayFactory, fake_model: FakeModel, fake_telegram: FakeTelegram) -> None:
    settings = team(fake_model, fake_telegram)
    gw = await make_gateway(**settings)
    fake_model.respond_with(lambda body: "ok")
    await telegram_command(fake_telegram, chat_id=GROUP, user_id=7, text="/model fast", chat_type="supergroup")
    await gw.stop(timeout=5)
    await make_gateway(**settings)
    request, _ = await telegram_turn(fake_telegram, fake_model, chat_id=GROUP, user_id=7, text="after the restart",
                                     chat_type="supergroup")
    assert request["model"] == "fast-model" and system_of(request).startswith(CODER_PROMPT)


# -- fallbacks ---------------------------------------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens once it is closed: connections are refused


FAILURES = {
    "500": lambda: ErrorReply(500, {"error": {"message": "boom", "type": "server_error"}}),
    "429": lambda: ErrorReply(429, {"error": {"message": "slow down", "type": "rate_limit"}},
                              headers={"Retry-After": "0"}),
    "timeout": lambda: Hang(5),
}


@pytest.mark.parametrize("failure", [*FAILURES, "refused"])
async def test_a_failing_model_hands_the_step_to_its_fallback(make_gateway: GatewayFactory, fake_model: FakeModel,
                                                              failure: str) -> None:
    main = fake_model.model_settings(max_retries=1, timeout_s=0.5)
    if failure == "refused":
        main["base_url"] = f"http://127.0.0.1:{_closed_port()}/v1"
    gw = await make_gateway(model={**main, "fallbacks": ["backup"]},
                            models={"backup": {"name": "backup-model", "base_url": fake_model.base_url,
                                               "timeout_s": 10}})

    def answer(body: dict[str, Any]) -> Any:
        if body["model"] == "backup-model":
            return Reply(text="the backup answered")
        return FAILURES[failure]() if failure in FAILURES else None

    fake_model.respond_with(answer)
    assert await chat(gw, "alice", "hi") == "the backup answered"
    models = [r["model"] for r in fake_model.requests]
    if failure != "refused":
        assert models[:2] == [fake_model.model_name] * 2  # the model's own retry came first
    assert models[-1] == "backup-model"
    assert gw.services is not None
    metrics = gw.services.metrics.render().decode()
    assert f'gateway_model_fallbacks_total{{from="{fake_model.model_name}",to="backup-model"}} 1.0' in metrics
    live = gw.sessions.live["web:alice"]
    assert live.last_model == "backup-model"  # what /context and the turn's log line report


async def test_a_fallback_on_another_server_never_gets_the_main_key(make_gateway: GatewayFactory,
                                                                    fake_model: FakeModel) -> None:
    """SPEC §2: an alias naming its own `base_url` inherits no `api_key`: on a fallback the
    conversation goes where the operator said, the main provider's key does not."""
    async with FakeModel(model_name="other-model") as other, FakeModel(model_name="keyed-model") as keyed:
        main = fake_model.model_settings(max_retries=0, api_key="sk-main-provider-secret")
        gw = await make_gateway(model={**main, "fallbacks": ["local", "keyed"]},
                                models={"local": {"name": "other-model", "base_url": other.base_url},
                                        "keyed": {"name": "keyed-model", "base_url": keyed.base_url,
                                                  "api_key": "sk-keyed-own"}})
        fake_model.respond_with(lambda body: ErrorReply(500, {"error": {"message": "boom", "type": "server_error"}}))
        other.respond_with(lambda body: Reply(text="the local server answered"))
        assert await chat(gw, "ivy", "hi") == "the local server answered"
        assert [h.get("Authorization") for h in fake_model.request_headers] == ["Bearer sk-main-provider-secret"]
        assert len(other.requests) == 1
        assert all("Authorization" not in h for h in other.request_headers), other.request_headers
        assert not any("sk-main-provider-secret" in value for h in other.request_headers for value in h.values())

        other.respond_with(lambda body: ErrorReply(503, {"error": {"message": "down", "type": "server_error"}}))
        keyed.respond_with(lambda body: Reply(text="the keyed server answered"))
        assert await chat(gw, "ivy", "again") == "the keyed server answered"
        assert [h.get("Authorization") for h in keyed.request_headers] == ["Bearer sk-keyed-own"]
        assert gw.services is not None
        # An alias on the main server (no base_url of its own) still shares the main key.
        cfg = gw.services.cfg
        assert cfg.model_for("keyed").key_value() == "sk-keyed-own"
        assert cfg.model_for("local").key_value() is None and cfg.model_for("local").keyless


def test_check_config_says_an_alias_on_its_own_server_gets_no_key() -> None:
    cfg = parse_config({"model": {"api_key": "sk-main", "base_url": "https://api.example.com/v1"},
                        "models": {"local": {"base_url": "http://127.0.0.1:11434/v1"},
                                   "same": {"base_url": "https://api.example.com/v1/", "name": "m2"},
                                   "mini": {"name": "gpt-4o-mini"}}})
    said = [w for w in config_warnings(cfg) if w.startswith("models.")]
    assert len(said) == 1 and said[0].startswith("models.local.api_key:") and "without an API key" in said[0]
    assert cfg.model_for("same").key_value() == "sk-main" and cfg.model_for("mini").key_value() == "sk-main"
    stt = parse_config({"model": {"api_key": "sk-main"}, "transcription": {"base_url": "http://127.0.0.1:9000/v1"}})
    assert stt.transcription_endpoint()[1] is None
    assert any(w.startswith("transcription.api_key: not set") for w in config_warnings(stt))


async def test_a_request_the_provider_refuses_is_never_handed_on(make_gateway: GatewayFactory,
                                                                 fake_model: FakeModel) -> None:
    gw = await make_gateway(model={**fake_model.model_settings(max_retries=0), "fallbacks": ["backup"]},
                            models={"backup": {"name": "backup-model"}})
    fake_model.respond_with(lambda body: Reply(text="backup") if body["model"] == "backup-model"
                            else ErrorReply(400, {"error": {"message": "invalid 'messages'", "type": "invalid"}}))
    reply = await chat(gw, "bob", "hi")
    assert "rejected the request" in reply
    assert [r["model"] for r in fake_model.requests] == [fake_model.model_name]


async def test_a_streamed_reply_moves_to_the_fallback_without_leftovers(
        make_gateway: GatewayFactory, fake_model: FakeModel, fake_telegram: FakeTelegram) -> None:
    await make_gateway(access={"dm_policy": "open"}, channels=telegram_section(fake_telegram),
                       model={**fake_model.model_settings(max_retries=0), "fallbacks": ["backup"]},
                       models={"backup": {"name": "backup-model"}})
    fake_model.respond_with(lambda body: Reply(text="the fallback's whole answer") if body["model"] == "backup-model"
                            else ErrorReply(502, {"error": {"message": "bad gateway"}}))
    fake_telegram.push_message(chat_id=9, user_id=9, text="hi")
    shown = await fake_telegram.wait_shown(9, lambda texts: "the fallback's whole answer" in texts, timeout=10)
    assert shown == ["the fallback's whole answer"]  # one message, nothing of the failed attempt left


# -- the commands on every channel -------------------------------------------------------------


async def test_usage_model_and_agent_answer_on_the_web(make_gateway: GatewayFactory, fake_model: FakeModel) -> None:
    gw = await make_gateway(models={"fast": {"name": "fast-model"}}, limits={"turns_per_user_per_day": 5})
    fake_model.reply("one", usage=(100, 20))
    await chat(gw, "carol", "first")
    usage = await chat(gw, "carol", "/usage")
    assert "Today: 1 message, 120 tokens." in usage and "This month: 1 message, 120 tokens." in usage
    assert "Left today: 4 of 5 messages" in usage
    assert "fast" in await chat(gw, "carol", "/model")
    agent = await chat(gw, "carol", "/agent")
    assert agent.startswith("Agent here: default.") and fake_model.model_name in agent
    assert len(fake_model.requests) == 1  # commands never reach the model


async def test_the_commands_answer_on_telegram_slack_and_the_terminal(
        tmp_path: Path, make_gateway: GatewayFactory, fake_model: FakeModel, fake_telegram: FakeTelegram,
        fake_slack: FakeSlack) -> None:
    await make_gateway(access={"dm_policy": "open"}, models={"fast": {"name": "fast-model"}},
                       channels={**telegram_section(fake_telegram),
                                 "slack": {"enabled": True, "bot_token": fake_slack.bot_token,
                                           "app_token": fake_slack.app_token, "base_url": fake_slack.base_url}})
    for command, expected in (("/usage", "This month"), ("/model", "You may pick: fast"), ("/agent", "Agent here")):
        assert expected in await telegram_command(fake_telegram, chat_id=3, user_id=3, text=command)
    await fake_slack.wait_connected()
    for n, (command, expected) in enumerate((("/usage", "This month"), ("/agent", "Agent here"))):
        await fake_slack.push_event({"type": "message", "channel_type": "im", "user": "U5", "text": command,
                                     "ts": f"10{n}.1", "channel": "D5"})
        await fake_slack.wait_for(lambda want=expected: any(want in t for t in fake_slack.visible("D5")))

    (tmp_path / "terminal").mkdir()
    path = write_config(tmp_path / "terminal", fake_model, models={"fast": {"name": "fast-model"}})
    from gateway.config.load import load_config

    terminal = TerminalChannel(tty=False, out=_Lines())
    gw = Gateway(load_config(path), config_path=path, serve_http=False, enable_channels=False)
    gw.add_channel("terminal", terminal)
    await gw.start()
    try:
        for n, command in enumerate(("/model", "/usage")):
            await gw.router.handle(Inbound(channel="terminal", chat_id="local", user_id="local", text=command,
                                           event_id=f"t{n}"))
            text, _ = await asyncio.wait_for(terminal.replies.get(), 10)
            assert ("fast" if command == "/model" else "This month") in text
    finally:
        await gw.stop(timeout=5)


class _Lines:
    """A non-terminal output that keeps what was written."""

    def __init__(self) -> None:
        self.text = ""

    def write(self, text: str) -> int:
        self.text += text
        return len(text)

    def flush(self) -> None: ...

    def isatty(self) -> bool:
        return False


def test_the_readme_example_is_a_valid_config() -> None:
    import json
    import re

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("### Several agents"):]
    found = re.search(r"```json\n(.*?)```", section, re.DOTALL)
    assert found is not None
    cfg = parse_config(json.loads(found.group(1)))
    telegram_group = Inbound(channel="telegram", chat_id="-1001234567890", user_id="7", text="", event_id="1",
                             is_group=True)
    assert bound_agent(cfg, telegram_group) == "coder"
    assert cfg.model_for("strong").name == "gpt-4.1"


async def test_an_agent_lists_only_its_own_skills(tmp_path: Path, make_gateway: GatewayFactory,
                                                  fake_model: FakeModel) -> None:
    for name in ("alpha", "beta"):
        folder = tmp_path / "skills" / name
        folder.mkdir(parents=True)
        (folder / "SKILL.md").write_text(f"---\nname: {name}\ndescription: The {name} skill for tests.\n---\nDo it.\n")
    gw = await make_gateway(agents={"coder": {"skills": ["alpha"]}},
                            bindings=[{"match": {"channel": "web", "chat": "dev"}, "agent": "coder"}])
    fake_model.respond_with(lambda body: "ok")
    await chat(gw, "dev", "hi")
    assert "The alpha skill" in system_of(fake_model.requests[-1])
    assert "The beta skill" not in system_of(fake_model.requests[-1])
    await chat(gw, "someone", "hi")
    assert "The beta skill" in system_of(fake_model.requests[-1])  # the default agent may use every skill
    assert "beta" not in await chat(gw, "dev", "/skills")
