"""Inbound webhooks (SPEC §5.9): a signed POST /hooks/<name> becomes a turn in the hook's
session, answered in its chat through the real channel (python-telegram-bot and slack-bolt
against their fakes); unsigned, unknown, oversized and replayed requests are refused or
absorbed, also across a restart."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest

from context.outside import unfence
from gateway.access import is_admin
from gateway.app import Gateway, secret_values
from gateway.config.checks import config_warnings, startup_problems
from gateway.config.load import ConfigError, parse_config
from gateway.hooks import MAX_BODY_BYTES, body_text, delivery_of, sign, signature_valid, turn_text
from gateway.http.server import JsonTooDeep
from tests.conftest import GatewayFactory, chat
from tests.fakes import slack_server, telegram_server
from tests.fakes.openai_server import FakeModel
from tests.fakes.slack_server import FakeSlack
from tests.fakes.telegram_server import FakeTelegram

fake_telegram = telegram_server.fake_telegram  # the fixtures
fake_slack = slack_server.fake_slack

SECRET = "gh-hook-secret-0123456789abcdef"
GROUP, TOPIC = -1001234, 5
TOPIC_SESSION = f"telegram:group:{GROUP}:topic:{TOPIC}"
PUSH = {"ref": "refs/heads/main", "pusher": {"name": "octocat"},
        "commits": [{"id": "a1b2c3", "message": "Fix the flaky login test"}]}
TEMPLATE = "Summarize this GitHub push for the team: {body}"


def telegram_section(fake: FakeTelegram) -> dict[str, Any]:
    return {"telegram": {"enabled": True, "token": fake.token, "base_url": fake.base_url,
                         "base_file_url": fake.base_file_url, "poll_timeout_s": 1}}


def hook(session: str = TOPIC_SESSION, deliver_to: str = f"telegram:{GROUP}:{TOPIC}", **extra: Any) -> dict[str, Any]:
    return {"secret": SECRET, "session": session, "deliver_to": deliver_to, "template": TEMPLATE, **extra}


async def post_hook(gw: Gateway, name: str, body: bytes | dict[str, Any], *, secret: str | None = SECRET,
                    delivery: str | None = None, content_type: str = "application/json",
                    headers: dict[str, str] | None = None, method: str = "POST") -> tuple[int, dict[str, Any]]:
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    sent = {"Content-Type": content_type, **(headers or {})}
    if secret is not None:
        sent["X-Hub-Signature-256"] = sign(secret, data)
    if delivery is not None:
        sent["X-GitHub-Delivery"] = delivery
    assert gw.http is not None
    async with aiohttp.ClientSession() as http:
        async with http.request(method, f"http://127.0.0.1:{gw.http.port}/hooks/{name}", data=data,
                                headers=sent) as resp:
            text = await resp.text()
            try:
                return resp.status, json.loads(text)
            except ValueError:
                return resp.status, {"text": text}


async def until(predicate: Any, timeout: float = 10) -> None:
    """Wait for an async condition on the database (it has nothing to wait on but polling)."""
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.02)


# -- end to end -----------------------------------------------------------------------------


async def test_a_signed_push_is_summarized_into_the_telegram_topic_once(
    make_gateway: GatewayFactory, fake_model: FakeModel, fake_telegram: FakeTelegram
) -> None:
    config: dict[str, Any] = {"channels": telegram_section(fake_telegram), "hooks": {"github": hook()}}
    gw = await make_gateway(**config)
    fake_model.reply("main got one fix: the flaky login test")
    status, answer = await post_hook(gw, "github", PUSH, delivery="72d3162e-cc78-11e3-81ab-4c9367dc0958")
    assert (status, answer) == (202, {"status": "queued"})

    shown = await fake_telegram.wait_shown(GROUP, lambda s: s == ["main got one fix: the flaky login test"])
    assert shown
    assert {m.get("message_thread_id") for m in fake_telegram.sent} == {TOPIC}  # in the topic, nowhere else
    (request,) = fake_model.requests
    prompt = request["messages"][-1]["content"]
    # The operator's template, then the body fenced as outside content (SPEC §5.7).
    instruction, _, fenced = prompt.partition(": ")
    assert instruction == "Summarize this GitHub push for the team"
    assert fenced.startswith("<<<OUTSIDE ") and "source: webhook github\n" in fenced
    assert '\n  "ref": "refs/heads/main",' in prompt and json.loads(unfence(fenced)) == PUSH

    assert gw.services is not None
    store = gw.services.store
    stored = await store.messages(TOPIC_SESSION)
    assert [(m.role, m.origin) for m in stored] == [("user", "hook:github"), ("assistant", None)]
    await until(lambda: _status_is(gw, "telegram", "hook:github:72d3162e-cc78-11e3-81ab-4c9367dc0958", "answered"))

    # GitHub's "Redeliver" sends the same delivery id: answered, never run again.
    again = await post_hook(gw, "github", PUSH, delivery="72d3162e-cc78-11e3-81ab-4c9367dc0958")
    assert again == (200, {"status": "duplicate"})
    # ... also by the next gateway on the same data.
    await gw.stop()
    gw2 = await make_gateway(**config)
    assert await post_hook(gw2, "github", PUSH, delivery="72d3162e-cc78-11e3-81ab-4c9367dc0958") == (
        200, {"status": "duplicate"})
    assert gw2.services is not None
    await gw2.services.background.wait_idle(5)
    assert len(fake_model.requests) == 1 and len(fake_telegram.sent) == 1
    # A new delivery is a new turn in the same session.
    assert (await post_hook(gw2, "github", PUSH, delivery="second-delivery"))[0] == 202
    await fake_telegram.wait_shown(GROUP, lambda s: len(s) == 2)
    assert "main got one fix" in json.dumps(fake_model.requests[-1]["messages"])  # the topic's history


async def test_the_turn_is_the_hooks_own_shown_as_such(
    make_gateway: GatewayFactory, fake_model: FakeModel, fake_telegram: FakeTelegram,
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hook may run in a web session and answer in a Telegram DM; its message is marked
    `hook:<name>` in /context and search results, nothing in it is expanded, and it runs
    as `hook:<name>`: never an admin, with a budget of its own."""
    monkeypatch.setenv("HOOK_TEST_LEAK", "do-not-leak-0123")
    gw = await make_gateway(
        admins=["hook:deploys"], channels=telegram_section(fake_telegram),
        limits={"turns_per_user_per_day": 2},
        hooks={"deploys": hook(session="web:alice", deliver_to="telegram:42", template="Deploy report: {body}")},
    )
    body = b"release 1.2 is out; token ${HOOK_TEST_LEAK}"
    status, _ = await post_hook(gw, "deploys", body, content_type="text/plain", delivery="d-1")
    assert status == 202
    (reply,) = await fake_telegram.wait_sent(1)
    assert reply["chat_id"] == 42 and reply["text"].startswith("echo: Deploy report: <<<OUTSIDE ")
    assert "\nrelease 1.2 is out; token" in reply["text"]
    assert "${HOOK_TEST_LEAK}" in reply["text"] and "do-not-leak" not in json.dumps(fake_model.requests)

    # Alice's own chat is that session: /context counts the hook's message as a webhook's.
    context = await chat(gw, "alice", "/context")
    assert "user 1 (1 from webhooks)" in context
    fake_model.tool_call("memory_search", {"query": "release"})
    fake_model.reply("found it")
    await chat(gw, "alice", "what was released?")
    found = [m for m in fake_model.requests[-1]["messages"] if m["role"] == "tool"][-1]["content"]
    assert "user (hook:deploys): Deploy report: <<<OUTSIDE " in found and "release 1.2 is out" in found

    # Its budget is its own (alice's turn does not count), and listing it in admins changes nothing.
    assert not is_admin(gw.cfg, "hook:deploys")
    await until(lambda: _turns_of(gw, "hook:deploys", 1))
    assert await _turns_of(gw, "web:alice", 1)
    assert (await post_hook(gw, "deploys", b"second", content_type="text/plain", delivery="d-2"))[0] == 202
    await until(lambda: _turns_of(gw, "hook:deploys", 2))
    status, answer = await post_hook(gw, "deploys", b"third", content_type="text/plain", delivery="d-3")
    assert status == 429 and "hook:deploys" in answer["error"]
    assert len(fake_telegram.sent) == 2


async def _turns_of(gw: Gateway, identity: str, turns: int) -> bool:
    assert gw.services is not None
    return bool((await gw.services.usage.get(gw.cfg, identity))[0] == turns)


async def test_refused_requests_store_nothing(make_gateway: GatewayFactory, fake_model: FakeModel,
                                              fake_telegram: FakeTelegram) -> None:
    gw = await make_gateway(channels=telegram_section(fake_telegram), hooks={"github": hook()})
    assert gw.services is not None
    store = gw.services.store
    body = json.dumps(PUSH).encode()
    assert (await post_hook(gw, "github", body, secret=None))[0] == 401  # unsigned
    assert (await post_hook(gw, "github", body, secret="another-secret-0123456789"))[0] == 401  # wrong key
    forged = {"X-Hub-Signature-256": sign(SECRET, b"something else")}
    assert (await post_hook(gw, "github", body, secret=None, headers=forged))[0] == 401  # another body's
    sha1 = {"X-Hub-Signature-256": sign(SECRET, body).replace("sha256=", "sha1=")}
    assert (await post_hook(gw, "github", body, secret=None, headers=sha1))[0] == 401
    assert (await post_hook(gw, "gitlab", body))[0] == 404  # unknown hook
    assert (await post_hook(gw, "github", body, method="GET"))[0] == 405
    huge = json.dumps({"blob": "x" * (MAX_BODY_BYTES + 10)}).encode()
    assert (await post_hook(gw, "github", huge))[0] == 413
    status, answer = await post_hook(gw, "github", b'{"ref": "main"', delivery="broken")
    assert status == 400 and "not valid JSON" in answer["error"]
    deep = ("[" * 200 + "]" * 200).encode()
    assert (await post_hook(gw, "github", deep, delivery="deep"))[0] == 400
    assert (await post_hook(gw, "github", body, headers={"X-Request-Id": "a b/c"}))[0] == 400
    # GitHub's ping when the webhook is saved: answered, no turn.
    assert await post_hook(gw, "github", {"zen": "Keep it logically awesome."}, delivery="ping-1",
                           headers={"X-GitHub-Event": "ping"}) == (200, {"status": "ping"})
    await asyncio.sleep(0.1)  # a turn wrongly queued would have reached the model by now
    assert fake_model.requests == [] and fake_telegram.sent == []
    assert await store.count_messages() == 0
    assert await store.pending_events() == []
    metrics = gw.services.metrics.render().decode()
    assert 'gateway_hook_requests_total{outcome="unsigned"} 4.0' in metrics
    assert 'gateway_hook_requests_total{outcome="ping"} 1.0' in metrics


async def test_a_long_body_is_cut_to_the_message_limit(make_gateway: GatewayFactory, fake_model: FakeModel,
                                                       fake_telegram: FakeTelegram) -> None:
    gw = await make_gateway(channels=telegram_section(fake_telegram), limits={"max_inbound_chars": 2000},
                            hooks={"github": hook()})
    commits = [{"id": f"{i:040x}", "message": f"commit number {i}"} for i in range(200)]
    assert (await post_hook(gw, "github", {"commits": commits}, delivery="big"))[0] == 202
    (request,) = await fake_model.wait_requests(1, timeout=10)
    prompt = request["messages"][-1]["content"]
    assert len(prompt) <= 2000 and prompt.startswith("Summarize this GitHub push")
    assert "[… the body was cut here" in prompt and "limits.max_inbound_chars" in prompt


async def test_without_a_delivery_id_a_retried_body_runs_once(make_gateway: GatewayFactory, fake_model: FakeModel,
                                                               fake_telegram: FakeTelegram) -> None:
    gw = await make_gateway(channels=telegram_section(fake_telegram), hooks={"alerts": hook(template="{body}")})
    assert (await post_hook(gw, "alerts", b"disk 91% full", content_type="text/plain"))[0] == 202
    assert await post_hook(gw, "alerts", b"disk 91% full", content_type="text/plain") == (200, {"status": "duplicate"})
    assert (await post_hook(gw, "alerts", b"disk 95% full", content_type="text/plain"))[0] == 202
    await fake_telegram.wait_shown(GROUP, lambda s: len(s) == 2)
    assert gw.services is not None
    await gw.services.background.wait_idle(5)
    assert [unfence(r["messages"][-1]["content"]) for r in fake_model.requests] == ["disk 91% full", "disk 95% full"]


async def test_a_reply_for_a_channel_that_is_off_is_stored_undelivered(
    make_gateway: GatewayFactory, fake_model: FakeModel, fake_telegram: FakeTelegram
) -> None:
    gw = await make_gateway(channels=telegram_section(fake_telegram),
                            hooks={"tickets": hook(session="slack:channel:C1:thread:1712.55",
                                                   deliver_to="slack:C1:1712.55")})
    assert (await post_hook(gw, "tickets", b"ticket 7 opened", content_type="text/plain", delivery="t-7"))[0] == 202
    assert gw.services is not None
    store = gw.services.store
    await until(lambda: _status_is(gw, "slack", "hook:tickets:t-7", "undelivered"))
    stored = await store.messages("slack:channel:C1:thread:1712.55")
    assert [(m.role, m.origin) for m in stored] == [("user", "hook:tickets"), ("assistant", None)]
    row = await store.get_session("slack:channel:C1:thread:1712.55")
    assert row is not None and row.scope == "slack:group:C1"  # a thread's shared scope


async def _status_is(gw: Gateway, channel: str, event: str, status: str) -> bool:
    assert gw.services is not None
    return await gw.services.store.event_status(channel, event) == status


async def test_a_hook_answers_in_a_slack_thread(make_gateway: GatewayFactory, fake_model: FakeModel,
                                                fake_slack: FakeSlack) -> None:
    """No member started the turn, so there is no recipient for a native stream: the reply
    is posted and edited in the thread (Slack refuses a channel stream without one)."""
    gw = await make_gateway(
        channels={"slack": {"enabled": True, "bot_token": fake_slack.bot_token, "app_token": fake_slack.app_token,
                            "base_url": fake_slack.base_url}},
        hooks={"tickets": hook(session="slack:channel:C1:thread:1712.55", deliver_to="slack:C1:1712.55")},
    )
    await fake_slack.wait_connected()
    fake_model.reply("Ticket 7: the printer is on fire.")
    assert (await post_hook(gw, "tickets", b"ticket 7 opened", content_type="text/plain", delivery="t-7"))[0] == 202
    await fake_slack.wait_for(lambda: fake_slack.visible("C1", "1712.55") == ["Ticket 7: the printer is on fire."])
    assert fake_slack.visible("C1") == []  # nothing at the top level
    assert fake_slack.method_calls("chat.startStream") == []


async def test_hook_turns_cut_by_a_restart_resume_in_their_own_session(
    make_gateway: GatewayFactory, fake_model: FakeModel, fake_telegram: FakeTelegram
) -> None:
    """The session (web:alice) is not the one the reply's chat implies (telegram:dm:42), and
    the second body looks like a command: after the restart the running turn and the one
    queued behind it are answered once each, in Telegram, stored in alice's session, and
    `/context clear` is text for the model, not a command."""
    config: dict[str, Any] = {"channels": telegram_section(fake_telegram),
                              "hooks": {"ops": hook(session="web:alice", deliver_to="telegram:42",
                                                    template="{body}")}}
    gw = await make_gateway(**config)
    fake_model.hang(30)
    assert (await post_hook(gw, "ops", b"first report", content_type="text/plain", delivery="o-1"))[0] == 202
    await fake_model.wait_requests(1)
    assert (await post_hook(gw, "ops", b"/context clear", content_type="text/plain", delivery="o-2"))[0] == 202
    await gw.stop(timeout=0)  # cut mid-call, the second still waiting

    fake_model.reply("noted: the first report")
    fake_model.reply("noted: context clear requested by ops")
    gw2 = await make_gateway(**config)
    sent = await fake_telegram.wait_sent(2)
    assert [(m["chat_id"], m["text"]) for m in sent] == [
        (42, "noted: the first report"), (42, "noted: context clear requested by ops")]
    assert gw2.services is not None
    await gw2.services.background.wait_idle(5)
    stored = await gw2.services.store.messages("web:alice")
    assert [(m.role, unfence(m.content), m.origin) for m in stored] == [
        ("user", "first report", "hook:ops"), ("assistant", "noted: the first report", None),
        ("user", "/context clear", "hook:ops"), ("assistant", "noted: context clear requested by ops", None)]
    assert await gw2.services.store.count_messages("telegram:dm:42") == 0
    assert len(fake_telegram.sent) == 2


# -- configuration ----------------------------------------------------------------------------


def test_hook_settings_are_checked() -> None:
    good = {"secret": SECRET, "session": "telegram:dm:123", "deliver_to": "telegram:123"}
    cfg = parse_config({"hooks": {"github": good}}, environ={})
    assert cfg.hooks["github"].template == "{body}"
    for name, entry, problem in (
        ("git hub", good, "hook name 'git hub'"),
        ("github", {**good, "session": "telegram:123"}, "hooks.github.session: 'telegram:123' is not a session key"),
        ("github", {**good, "session": "terminal:local"}, "is not a session key"),
        ("github", {**good, "deliver_to": "web:alice"}, "hooks.github.deliver_to: 'web:alice'"),
        ("github", {**good, "deliver_to": "telegram:-100:topic"}, "hooks.github.deliver_to"),
        ("github", {**good, "deliver_to": "slack:C1:12:34"}, "hooks.github.deliver_to"),
        ("github", {**good, "template": "no placeholder"}, "hooks.github.template: must contain {body}"),
        ("github", {k: v for k, v in good.items() if k != "session"}, "hooks.github.session: Field required"),
    ):
        with pytest.raises(ConfigError) as err:
            parse_config({"hooks": {name: entry}}, environ={})
        assert any(problem in p for p in err.value.problems), err.value.problems
    for session in ("telegram:group:-100", "telegram:group:-100:user:7", "slack:dm:D1", "slack:channel:C1",
                    "slack:channel:C1:user:U1", "web:alice"):
        assert parse_config({"hooks": {"h": {**good, "session": session}}}, environ={}).hooks["h"].session == session


def test_a_hook_without_a_usable_secret_stops_run() -> None:
    base = {"session": "telegram:dm:123", "deliver_to": "telegram:123"}
    missing = parse_config({"hooks": {"github": base}}, environ={})
    assert startup_problems(missing, channels=False) == [
        "hooks.github.secret: required: at least 16 random characters (e.g. the output of `openssl rand -hex 32`), "
        "the same as the sender's webhook secret"]
    short = parse_config({"hooks": {"github": {**base, "secret": "hunter2"}}}, environ={})
    assert "hooks.github.secret: too short (7 characters)" in startup_problems(short, channels=False)[0]
    unset = parse_config({"hooks": {"github": {**base, "secret": "${GITHUB_HOOK_SECRET}"}}}, environ={})
    assert startup_problems(unset, channels=False) == [
        "hooks.github.secret: the environment variable GITHUB_HOOK_SECRET is not set "
        "(needed while the hook github is configured)"]
    assert startup_problems(unset, channels=False, http=False) == []  # `gateway chat` serves no hooks
    ok = parse_config({"hooks": {"github": {**base, "secret": "${GITHUB_HOOK_SECRET}"}}},
                      environ={"GITHUB_HOOK_SECRET": SECRET})
    assert startup_problems(ok, channels=False) == []
    assert ok.hooks["github"].secret is not None and ok.hooks["github"].secret.get_secret_value() == SECRET
    assert SECRET in secret_values(ok)  # redacted from logs like the other secrets
    # Answering in a channel that is off is allowed, and said.
    assert config_warnings(ok)[-1] == ("hooks.github.deliver_to: channels.telegram is not enabled; the hook's "
                                       "turns run but their replies are not delivered")


async def test_a_hook_without_a_usable_secret_never_starts(make_gateway: GatewayFactory) -> None:
    with pytest.raises(ConfigError) as err:
        await make_gateway(hooks={"github": {"session": "web:alice", "deliver_to": "telegram:1"}})
    assert any(p.startswith("hooks.github.secret: required") for p in err.value.problems)


async def test_the_secret_is_masked_and_never_set_from_chat(make_gateway: GatewayFactory,
                                                             fake_model: FakeModel) -> None:
    gw = await make_gateway(admins=["web:boss"], hooks={"github": hook(session="web:boss",
                                                                        deliver_to="telegram:1")})
    shown = await chat(gw, "boss", "/config")
    assert SECRET not in shown and "hooks.github.secret" in shown
    refused = await chat(gw, "boss", '/config hooks.github.secret "another-secret-0123456789"')
    assert "is a secret" in refused
    assert gw.cfg.hooks["github"].secret is not None
    assert gw.cfg.hooks["github"].secret.get_secret_value() == SECRET


# -- the pure parts -----------------------------------------------------------------------------


def test_signatures_in_githubs_form() -> None:
    body = b'{"zen": "Design for failure."}'
    good = sign(SECRET, body)
    assert good.startswith("sha256=") and len(good) == 7 + 64
    assert signature_valid(SECRET, body, good)
    assert signature_valid(SECRET, body, good.upper().replace("SHA256=", "sha256="))  # hex case
    assert not signature_valid(SECRET, body + b" ", good)
    assert not signature_valid(SECRET + "x", body, good)
    for header in (None, "", "sha256=", good.removeprefix("sha256="), "sha1=" + good[7:], good[:-1], good + "0"):
        assert not signature_valid(SECRET, body, header), header
    assert not signature_valid("", body, sign("", body))  # an empty key signs nothing


def test_delivery_ids() -> None:
    assert delivery_of({"X-GitHub-Delivery": " 72d3162e-cc78 "}, b"x", 0) == "72d3162e-cc78"
    assert delivery_of({"X-Request-Id": "req:42"}, b"x", 0) == "req:42"
    same = delivery_of({}, b"body", 1000.0)
    assert same == delivery_of({}, b"body", 1001.0) != delivery_of({}, b"other", 1000.0)
    assert same != delivery_of({}, b"body", 1000.0 + 3600)  # the same body later is a new turn
    for bad in ("", "a" * 129, "a/b", "a\nb", "é"):
        with pytest.raises(Exception, match="X-GitHub-Delivery"):
            delivery_of({"X-GitHub-Delivery": bad}, b"x", 0)


async def test_bodies_become_text() -> None:
    assert await body_text(b'{"a": [1, {"b": "\\u00e9"}]}', "application/json") == \
        '{\n  "a": [\n    1,\n    {\n      "b": "é"\n    }\n  ]\n}'
    form = b"payload=%7B%22ref%22%3A%22main%22%7D"  # GitHub's form encoding
    assert await body_text(form, "application/x-www-form-urlencoded") == '{\n  "ref": "main"\n}'
    assert await body_text(b"plain \x00text \xff", "text/plain") == "plain text \ufffd"
    with pytest.raises(JsonTooDeep):
        await body_text(b"[" * 100 + b"]" * 100, "application/json")


def test_turn_text_is_capped() -> None:
    assert turn_text("Summarize: {body}", "abc", 100) == "Summarize: abc"
    assert turn_text("{body} / {body}", "ab", 100) == "ab / ab"
    cut = turn_text("Summarize: {body}", "x" * 10_000, 500)
    assert len(cut) <= 500 and cut.startswith("Summarize: xxx") and "10,000 characters" in cut
    assert len(turn_text("{body}", "y" * 10_000, 50)) <= 50
