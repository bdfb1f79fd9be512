"""The admin page's API (`/admin/api/*`) on a running gateway: off without
`http.admin_token`, bearer-token only, refused cross-site, and its views (sessions,
pairings with approval, usage, jobs, channel and tool-source state, recent errors)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import aiohttp
import pytest

import gateway.http.throttle as throttle
from gateway.app import Gateway
from gateway.config.checks import startup_problems
from gateway.config.load import ConfigError, parse_config
from gateway.ops.admin import RecentErrors, describe_tool_sources
from gateway.ops.logs import Redactor
from gateway.tools.base import Tool
from gateway.tools.current_time import CurrentTime
from gateway.types import Inbound
from tests.conftest import GatewayFactory, chat, web_cookie
from tests.fakes.openai_server import FakeModel

ADMIN = "admin-token-0123456789abcdef"


async def call(gw: Gateway, path: str, *, token: str | None = ADMIN, json: Any = None,
               headers: dict[str, str] | None = None, data: bytes | None = None) -> tuple[int, Any]:
    assert gw.http is not None
    sent = {"Authorization": f"Bearer {token}"} if token is not None else {}
    sent.update(headers or {})
    url = f"http://127.0.0.1:{gw.http.port}{path}"
    async with aiohttp.ClientSession() as http:
        if json is not None or data is not None:
            resp = await http.post(url, json=json, data=data, headers=sent)
        else:
            resp = await http.get(url, headers=sent)
        async with resp:
            if resp.content_type == "application/json":
                return resp.status, await resp.json()
            return resp.status, await resp.text()


async def test_off_without_an_admin_token(make_gateway: GatewayFactory) -> None:
    gw = await make_gateway()
    status, text = await call(gw, "/admin", token=None)
    assert status == 404 and "set http.admin_token" in text
    for path in ("/admin/api/sessions", "/admin/api/status", "/admin/api/errors"):
        status, body = await call(gw, path)  # whatever token is sent: there is none to match
        assert status == 404 and "http.admin_token" in body["error"], path
    status, body = await call(gw, "/admin/api/pairings/approve", json={"code": "ABCD2345"})
    assert status == 404
    assert (await call(gw, "/admin/static/admin.js", token=None))[0] == 404


async def test_the_token_is_required(make_gateway: GatewayFactory) -> None:
    gw = await make_gateway(http={"admin_token": ADMIN})
    status, text = await call(gw, "/admin", token=None)  # the page itself holds no data
    assert status == 200 and 'id="login"' in text
    assert (await call(gw, "/admin/", token=None))[1] == text  # redirected
    for token in (None, "wrong-token-0123456789abcdef", ADMIN[:-1], ""):
        status, body = await call(gw, "/admin/api/sessions", token=token)
        assert status == 401 and "admin token" in body["error"], token
    status, body = await call(gw, "/admin/api/pairings/approve", token="nope", json={"code": "ABCD2345"})
    assert status == 401
    # Not the chat's token either, nor the chat's Basic/other schemes.
    status, _ = await call(gw, "/admin/api/sessions", token=None, headers={"Authorization": f"Token {ADMIN}"})
    assert status == 401
    status, body = await call(gw, "/admin/api/sessions")
    assert status == 200 and body["sessions"] == []


async def test_a_loopback_client_without_the_admin_token_reads_and_changes_nothing(
        make_gateway: GatewayFactory, fake_model: FakeModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 31: what a sandboxed curl sends (loopback, no Origin, its own Host) is no
    proof of being the owner here either; neither is the web chat's token or cookie."""
    monkeypatch.setattr(throttle, "BASE_DELAY_S", 0.001)  # many wrong tokens: none of the real waits
    monkeypatch.setattr(throttle, "MAX_DELAY_S", 0.001)
    gw = await make_gateway(http={"admin_token": ADMIN}, access={"dm_policy": "pairing"})
    await chat(gw, "ann", "PRIVATE-CHAT-TEXT")
    code, _ = await gw.pairing.code_for("telegram:77")
    assert gw.web_token is not None
    curl = {"User-Agent": "curl/8.5.0", "Accept": "*/*"}
    for token, extra in ((None, {}), (gw.web_token, {}), (None, web_cookie(gw))):
        for path in ("/admin/api/sessions", "/admin/api/session?key=web:ann", "/admin/api/status",
                     "/admin/api/errors", "/admin/api/pairings"):
            status, body = await call(gw, path, token=token, headers=curl | extra)
            assert status == 401 and "PRIVATE-CHAT-TEXT" not in str(body), (path, token, extra)
        status, _ = await call(gw, "/admin/api/pairings/approve", token=token, json={"code": code},
                               headers=curl | extra)
        assert status == 401
    assert await gw.pairing.approved() == []
    status, body = await call(gw, "/admin/api/session?key=web:ann", headers=curl)  # the admin token: yes
    assert status == 200 and "PRIVATE-CHAT-TEXT" in str(body)


async def test_cross_site_requests_are_refused(make_gateway: GatewayFactory) -> None:
    gw = await make_gateway(http={"admin_token": ADMIN})
    assert gw.http is not None
    port = gw.http.port
    refused = [
        {"Origin": "http://evil.example"},
        {"Origin": f"http://127.0.0.1:{port + 1}"},
        {"Host": f"evil.example:{port}"},  # DNS rebinding: a foreign name for 127.0.0.1
        {"Host": f"evil.example:{port}", "Origin": f"http://evil.example:{port}"},
        {"Sec-Fetch-Site": "cross-site"},
        {"Sec-Fetch-Site": "same-site"},
    ]
    for headers in refused:
        status, body = await call(gw, "/admin/api/sessions", headers=headers)  # even with the right token
        assert status == 403 and "refused" in body["error"], headers
        status, body = await call(gw, "/admin/api/pairings/approve", json={"code": "ABCD2345"}, headers=headers)
        assert status == 403 and "refused" in body["error"], headers
    for headers in ({"Origin": f"http://127.0.0.1:{port}"}, {"Host": f"localhost:{port}"},
                    {"Sec-Fetch-Site": "same-origin"}):
        assert (await call(gw, "/admin/api/sessions", headers=headers))[0] == 200, headers
    # A form post needs no preflight, so it is refused for not being JSON.
    status, _ = await call(gw, "/admin/api/pairings/approve", data=b"code=ABCD2345",
                              headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert status == 415
    # The page: a strict policy, never framed.
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/admin") as resp:
        csp = resp.headers["Content-Security-Policy"]
        assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp and "unsafe-inline" not in csp
        assert resp.headers["X-Frame-Options"] == "DENY"


async def test_sessions_newest_first_in_pages(make_gateway: GatewayFactory, fake_model: FakeModel) -> None:
    gw = await make_gateway(http={"admin_token": ADMIN})
    for name in ("ann", "bob", "cy"):
        await chat(gw, name, f"hello from {name}")
    await chat(gw, "ann", "again")  # ann is the most recent now
    status, first = await call(gw, "/admin/api/sessions?limit=2")
    assert status == 200 and first["total"] == 3
    assert [s["key"] for s in first["sessions"]] == ["web:ann", "web:cy"]
    ann = first["sessions"][0]
    assert ann["channel"] == "web" and ann["turns"] == 2 and ann["tokens_today"] > 0
    nxt = first["next"]
    status, second = await call(
        gw, f"/admin/api/sessions?limit=2&before_at={nxt['before_at']}&before_key={nxt['before_key']}")
    assert [s["key"] for s in second["sessions"]] == ["web:bob"] and second["next"] is None
    assert (await call(gw, "/admin/api/sessions?limit=0"))[0] == 400
    assert (await call(gw, "/admin/api/sessions?limit=201"))[0] == 400
    assert (await call(gw, "/admin/api/sessions?before_at=x&before_key=web:a"))[0] == 400
    assert (await call(gw, "/admin/api/sessions?before_at=1.5"))[0] == 400


async def test_a_pending_pairing_is_approved_like_the_command(make_gateway: GatewayFactory) -> None:
    gw = await make_gateway(http={"admin_token": ADMIN})
    code, new = await gw.pairing.code_for("telegram:77")  # what the router does for a stranger
    assert new
    stranger = Inbound(channel="telegram", chat_id="77", user_id="77", text="hi", event_id="e1")
    assert not await gw.router.admits(stranger)
    status, body = await call(gw, "/admin/api/pairings")
    assert status == 200 and [(p["identity"], p["code"]) for p in body["pending"]] == [("telegram:77", code)]
    status, body = await call(gw, "/admin/api/pairings/approve", json={"code": code.lower()})
    assert status == 200 and body["identity"] == "telegram:77" and "Approved telegram:77" in body["message"]
    assert await gw.router.admits(stranger)
    assert (await call(gw, "/admin/api/pairings"))[1]["pending"] == []
    status, body = await call(gw, "/admin/api/pairings/approve", json={"code": code})  # a code approves once
    assert status == 409 and body["error"] == "That code was already approved: telegram:77 can chat."
    status, body = await call(gw, "/admin/api/pairings/approve", json={"code": "NOPE2345"})
    assert status == 404 and body["error"] == "That code is unknown or expired."
    for bad in ({"code": ""}, {"code": 5}, {"nope": 1}, ["ABCD2345"]):
        assert (await call(gw, "/admin/api/pairings/approve", json=bad))[0] == 400, bad
    approved_by = await gw.services.store.run(  # type: ignore[union-attr]
        "SELECT approved_by FROM approved_users WHERE identity='telegram:77'")
    assert approved_by[0][0] == "admin-page"


async def test_usage_jobs_and_status(make_gateway: GatewayFactory, fake_model: FakeModel) -> None:
    gw = await make_gateway(http={"admin_token": ADMIN}, timezone="UTC")
    fake_model.reply("one", usage=(100, 20))
    await chat(gw, "ann", "hi")
    fake_model.reply("two", usage=(200, 30))
    await chat(gw, "ann", "hi again")
    assert gw.scheduler is not None and await gw.scheduler.wait_idle(10)  # the start's purge is recorded
    status, usage = await call(gw, "/admin/api/usage")
    assert status == 200 and len(usage["days"]) == 14 and usage["timezone"] == "UTC"
    (ann,) = usage["people"]
    assert ann["identity"] == "web:ann" and ann["turns"][-1] == 2 and ann["tokens"][-1] == 350
    assert ann["total_tokens"] == 350 and sum(ann["turns"][:-1]) == 0
    status, jobs = await call(gw, "/admin/api/jobs")
    by_name = {j["name"]: j for j in jobs["jobs"]}
    assert set(by_name) == {"purge", "memory_consolidation"}
    assert all(j["next_run"] is not None for j in jobs["jobs"])
    assert by_name["purge"]["last_run"]["outcome"] == "ok"
    assert any(r["job"] == "purge" and r["slot"].startswith("start:") for r in jobs["runs"])
    status, state = await call(gw, "/admin/api/status")
    assert {"name": "web", "ok": True, "detail": None} in state["channels"]
    assert {"name": "database", "ok": True, "detail": None} in state["checks"]
    # web_fetch is on by default (the web tools' source), exec is off; no other source is configured.
    web = {"name": "web", "label": "Web tools", "state": "ready", "tools": ["web_fetch"], "detail": None}
    exec_off = {"name": "exec", "label": "Running commands (exec)", "state": "off", "tools": [],
                "detail": "not offered: tools.exec.enabled is false"}
    assert gw.admin_state is not None
    assert state["tool_sources"] == [web, exec_off] == gw.admin_state.tool_sources()


class _Source:
    def __init__(self, name: str, tools: Sequence[Tool], **state: Any) -> None:
        self.name, self._tools, self.version = name, tools, 1
        self.__dict__.update(state)

    def tools(self) -> Sequence[Tool]:
        if self.name == "broken":
            raise RuntimeError("server went away")
        return self._tools


async def test_tool_sources_show_their_state(make_gateway: GatewayFactory) -> None:
    gw = await make_gateway(http={"admin_token": ADMIN})
    assert gw.services is not None
    gw.services.tools.add_source(_Source("clock", [CurrentTime()], state="connected"))
    gw.services.tools.add_source(_Source("slow", [], state="connecting", detail="starting npx"))
    status, state = await call(gw, "/admin/api/status")
    assert status == 200 and state["tool_sources"] == [
        {"name": "web", "label": "Web tools", "state": "ready", "tools": ["web_fetch"], "detail": None},
        {"name": "exec", "label": "Running commands (exec)", "state": "off", "tools": [],
         "detail": "not offered: tools.exec.enabled is false"},
        {"name": "clock", "label": "clock", "state": "connected", "tools": ["current_time"], "detail": None},
        {"name": "slow", "label": "slow", "state": "connecting", "tools": [], "detail": "starting npx"},
    ]
    (broken,) = describe_tool_sources([_Source("broken", [])])
    assert broken["state"] == "failed" and "server went away" in (broken["detail"] or "")


async def test_recent_errors_are_redacted_bounded_and_never_chat_text(make_gateway: GatewayFactory,
                                                                      fake_model: FakeModel) -> None:
    web_token = "web-token-0123456789"
    gw = await make_gateway(http={"admin_token": ADMIN}, channels={"web": {"token": web_token}},
                            model={"max_retries": 0})
    fake_model.error(400, {"error": {"message": "bad request", "type": "invalid_request_error"}})
    assert gw.http is not None
    async with aiohttp.ClientSession() as http:
        async with http.post(f"http://127.0.0.1:{gw.http.port}/api/chat",
                             json={"session": "ann", "text": "my PRIVATE-CHAT-TEXT here"},
                             headers={"Authorization": f"Bearer {web_token}"}) as resp:
            assert resp.status == 200
    logging.getLogger("gateway.test").warning("token %s leaked", web_token,
                                              extra={"session": "web:ann", "text": "PRIVATE-CHAT-TEXT"})
    logging.getLogger("gateway.test").info("not an error")
    status, body = await call(gw, "/admin/api/errors")
    assert status == 200
    errors = body["errors"]
    leaked, model_error = errors[0], errors[1]  # newest first
    assert leaked["message"] == "token *** leaked" and leaked["extra"] == {"session": "web:ann"}
    assert leaked["logger"] == "gateway.test" and leaked["level"] == "WARNING"
    assert model_error["message"] == "model error" and model_error["extra"]["session"] == "web:ann"
    assert "PRIVATE-CHAT-TEXT" not in str(body) and web_token not in str(body) and ADMIN not in str(body)
    assert all(e["level"] in ("WARNING", "ERROR", "CRITICAL") for e in errors)

    ring = RecentErrors(capacity=3, redactor=Redactor())
    ring.install()
    try:
        for i in range(5):
            logging.getLogger("gateway.test").error("error %d", i)
        await asyncio.to_thread(logging.getLogger("gateway.test").warning, "from a thread")
    finally:
        ring.uninstall()
    assert [e["message"] for e in ring.snapshot()] == ["from a thread", "error 4", "error 3"]


def test_the_admin_token_must_be_strong_distinct_and_resolved() -> None:
    def problems(http: dict[str, Any], env: dict[str, str] | None = None, **raw: Any) -> list[str]:
        return [p for p in startup_problems(parse_config({"http": http, **raw}, environ=env or {}))
                if p.startswith("http.admin_token")]

    assert problems({}) == []  # no token: the page is simply off
    assert problems({"admin_token": ADMIN}) == []
    assert "too short" in problems({"admin_token": "short-token"})[0]
    assert "empty" in problems({"admin_token": "  "})[0]
    same = problems({"admin_token": ADMIN}, channels={"web": {"token": ADMIN}})
    assert "must differ from channels.web.token" in same[0]
    unset = problems({"admin_token": "${GATEWAY_ADMIN_TOKEN}"})
    assert "GATEWAY_ADMIN_TOKEN is not set" in unset[0]
    assert problems({"admin_token": "${GATEWAY_ADMIN_TOKEN}"}, env={"GATEWAY_ADMIN_TOKEN": ADMIN}) == []
    # `chat` runs no HTTP server, so it needs no admin token.
    cfg = parse_config({"http": {"admin_token": "${GATEWAY_ADMIN_TOKEN}"}}, environ={})
    assert startup_problems(cfg, channels=False, http=False) == []


async def test_a_weak_token_stops_the_gateway(make_gateway: GatewayFactory) -> None:
    with pytest.raises(ConfigError, match="too short"):
        await make_gateway(http={"admin_token": "short"})


async def test_the_token_never_shows_in_config(make_gateway: GatewayFactory) -> None:
    gw = await make_gateway(http={"admin_token": ADMIN}, admins=["web:boss"])
    reply = await chat(gw, "boss", "/config http.admin_token")
    assert ADMIN not in reply and "***" in reply
    reply = await chat(gw, "boss", "/config http.admin_token another-token-0123456789")
    assert "secret" in reply and gw.cfg.http.admin_token is not None
    assert gw.cfg.http.admin_token.get_secret_value() == ADMIN


def test_a_source_of_several_servers_gets_a_row_per_server() -> None:
    from gateway.tools.mcp import ServerStatus

    class Servers(_Source):
        def statuses(self) -> list[ServerStatus]:
            return [ServerStatus("docs", "ready", tools=1),
                    ServerStatus("files", "failed", error="exited with code 1", retry_in_s=8)]

    tool = CurrentTime()
    tool.name = "docs__search"
    rows = describe_tool_sources([Servers("mcp", [tool])])
    assert rows == [
        {"name": "mcp:docs", "label": "MCP server docs", "state": "ready", "tools": ["docs__search"], "detail": None},
        {"name": "mcp:files", "label": "MCP server files", "state": "failed", "tools": [],
         "detail": "failed: exited with code 1; retry in 8 s"},
    ]


async def test_one_session_its_recent_messages_and_context_numbers(make_gateway: GatewayFactory,
                                                                  fake_model: FakeModel) -> None:
    model_key = "sk-model-key-0123456789abcdef"
    gw = await make_gateway(http={"admin_token": ADMIN}, model={"api_key": model_key})
    fake_model.reply(f"the key is {model_key}")  # a reply that repeats a secret is shown masked
    await chat(gw, "ann", "hi")
    fake_model.reply("x" * 5000)
    await chat(gw, "ann", "a long answer please")
    status, body = await call(gw, "/admin/api/session?key=web:ann")
    assert status == 200 and body["key"] == "web:ann" and body["channel"] == "web" and body["agent"] == "default"
    assert [(m["role"], m["turn"]) for m in body["messages"]] == [("user", 1), ("assistant", 1), ("user", 2),
                                                                  ("assistant", 2)]
    assert body["messages"][1]["text"] == "the key is ***" and model_key not in str(body)
    assert len(body["messages"][3]["text"]) == 4000 and body["messages"][3]["cut"] is True
    context = body["context"]
    assert context["turns"] == 2 and context["max_turns"] == 20 and context["messages"] == 4
    assert 0 < context["tokens"] < context["budget"] and context["model"] == fake_model.model_name
    assert (await call(gw, "/admin/api/session?key=web:nobody"))[0] == 404
    assert (await call(gw, "/admin/api/session"))[0] == 400
    assert (await call(gw, "/admin/api/session?key=web:ann", token="wrong-token-0123456789"))[0] == 401
    # Out of memory (evicted, or on another gateway): the messages still, the numbers not.
    gw.sessions.live.clear()
    status, body = await call(gw, "/admin/api/session?key=web:ann")
    assert status == 200 and body["context"] is None and len(body["messages"]) == 4
