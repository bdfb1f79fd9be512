"""MCP servers as tools (SPEC §5.2), against real servers written with the SDK's FastMCP
(tests/mcp_servers/echo_server.py): over stdio as child processes and over streamable
HTTP on 127.0.0.1. The fake model calls their tools through the running gateway."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

import gateway.config.reload
import gateway.tools.mcp as mcp_module
from context.outside import unfence
from gateway.app import Gateway
from gateway.config.checks import startup_problems
from gateway.config.load import ConfigError, parse_config
from gateway.keys import workspace_dir
from gateway.tools.base import ToolContext, ToolError
from gateway.tools.mcp import TOOL_NAME, fitted_name, normalized_schema
from tests.conftest import GatewayFactory, chat, post_chat
from tests.fakes.openai_server import FakeModel
from tests.mcp_servers.echo_server import PNG, big_text
from tests.mcp_servers.refused_key_server import FALLBACK_KEY

ECHO = Path(__file__).resolve().parent / "mcp_servers" / "echo_server.py"
REFUSED = ECHO.with_name("refused_key_server.py")
ADMIN_TOKEN = "admin-token-0123456789abcdef"
ECHO_TOOLS = ["announce", "big", "crash", "document", "echo", "fail", "getenv", "header", "odd.name/with spaces",
              "picture", "pid", "record", "slow"]


def stdio(**extra: Any) -> dict[str, Any]:
    return {"command": sys.executable, "args": [str(ECHO)], **extra}


async def until(predicate: Callable[[], Any], timeout: float = 40.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def state(gw: Gateway, server: str) -> str:
    assert gw.mcp is not None
    return next(s.state for s in gw.mcp.statuses() if s.name == server)


async def ready(gw: Gateway, *servers: str) -> None:
    await until(lambda: all(state(gw, s) == "ready" for s in servers), what=f"{servers} ready")


async def call(gw: Gateway, tool: str, **args: Any) -> str:
    """A direct call of a registered tool (the model's path is tested separately)."""
    assert gw.services is not None
    found = gw.services.tools.get(tool)
    assert found is not None, tool
    ctx = ToolContext(session_key="test", scope="test", workspace=Path("."), config=gw.cfg, memory=gw.services.memory,
                      tasks=gw.services.tasks)
    return (await found.run(args, ctx)).text


def tool_results(request: dict[str, Any]) -> list[str]:
    return [unfence(m["content"]) for m in request["messages"] if m["role"] == "tool"]


def children() -> dict[int, tuple[str, str]]:
    """This process's child processes: pid → (state letter, command line). Zombies included."""
    out: dict[int, tuple[str, str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == os.getpid():
            out[int(entry.name)] = (fields[0], cmdline)
    return out


def stdio_servers() -> dict[int, tuple[str, str]]:
    return {pid: c for pid, c in children().items() if "echo_server.py" in c[1] and "--http" not in c[1]}


def metric(gw: Gateway, name: str, **labels: str) -> float:
    assert gw.services is not None
    text = gw.services.metrics.render().decode()
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            found = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0])) if "{" in line else {}
            if found == labels:
                return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture(autouse=True)
def fast_reconnects(monkeypatch: pytest.MonkeyPatch) -> None:
    """Backoff and pings in tenths of a second instead of seconds."""
    monkeypatch.setattr(mcp_module, "BACKOFF_MIN_S", 0.1)
    monkeypatch.setattr(mcp_module, "BACKOFF_MAX_S", 0.4)
    monkeypatch.setattr(mcp_module, "PING_INTERVAL_S", 0.3)
    monkeypatch.setattr(gateway.config.reload, "SETTLE_S", 0.01)


@dataclass
class HttpServer:
    port: int
    process: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    async def start(self) -> None:
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, str(ECHO), "--http", str(self.port), "--name", "web",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                _reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
            except OSError:
                assert time.monotonic() < deadline, "the HTTP MCP server did not start"
                await asyncio.sleep(0.05)
                continue
            writer.close()
            await writer.wait_closed()
            return

    async def stop(self) -> None:
        if self.process is None or self.process.returncode is not None:
            return
        self.process.kill()
        await asyncio.wait_for(self.process.wait(), 10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest_asyncio.fixture
async def http_server() -> AsyncIterator[HttpServer]:
    server = HttpServer(free_port())
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


# -- through the gateway ----------------------------------------------------------------------


async def test_stdio_and_http_tools_end_to_end(make_gateway: GatewayFactory, fake_model: FakeModel,
                                              http_server: HttpServer, monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    monkeypatch.setenv("ECHO_TEST_TOKEN", "tok-123")
    monkeypatch.setenv("WEB_TEST_KEY", "key-456")
    monkeypatch.setenv("GATEWAY_ONLY_SECRET", "must-not-leak")
    gw = await make_gateway(admins=["web:boss"], mcp={"servers": {
        "echo": stdio(env={"ECHO_TOKEN": "${ECHO_TEST_TOKEN}"}, timeout_s=1),
        "web": {"url": http_server.url, "headers": {"X-Api-Key": "${WEB_TEST_KEY}"}, "tools": ["echo", "header"]},
    }})
    assert gw.http is not None and gw.services is not None
    # Readiness never waits for MCP servers; /readyz names them.
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{gw.http.port}/readyz") as resp:
            body = await resp.json()
    assert resp.status == 200 and body["ready"] is True and set(body["mcp"]) == {"echo", "web"}
    await ready(gw, "echo", "web")

    names = gw.services.tools.names
    # Built-ins first, then by (server, tool); "web" offers only its allowlist.
    assert [n for n in names if "__" in n] == [fitted_name("echo", t) for t in sorted(ECHO_TOOLS)] + [
        "web__echo", "web__header"]
    assert all(TOOL_NAME.fullmatch(n) for n in names)
    odd = fitted_name("echo", "odd.name/with spaces")
    # The line a streamed reply shows while the tool runs names the server and its own tool name.
    assert gw.services.tools.get(odd).status({}) == "running echo odd.name/with spaces…"  # type: ignore[union-attr]

    fake_model.tool_calls([
        ("echo__echo", {"text": "hi"}),
        ("echo__getenv", {"variable": "ECHO_TOKEN"}),
        ("echo__getenv", {"variable": "GATEWAY_ONLY_SECRET"}),
        ("echo__fail", {"message": "boom"}),
        ("echo__picture", {}),
        ("echo__record", {"city": "Paris"}),
        ("echo__document", {}),
        (odd, {}),
        ("web__echo", {"text": "over http"}),
        ("web__header", {"header_name": "x-api-key"}),
        ("echo__slow", {"seconds": 5}),
    ])
    fake_model.reply("done")
    started = time.monotonic()
    assert await chat(gw, "eve", "use the tools") == "done"
    assert time.monotonic() - started < 4  # the slow call was cut at the server's timeout_s (1 s)
    results = tool_results(fake_model.requests[-1])
    assert results[0] == "echo: hi"
    assert results[1] == "tok-123"  # a ${ENV} reference in env, expanded
    assert results[2] == "<unset>"  # nothing of the gateway's environment leaks to a server
    assert results[3] == "error: Error executing tool fail: boom"
    assert results[4] == "[image: files/mcp_echo_picture_1.png, 1×1]"  # saved; this model has no vision
    assert not any(isinstance(m["content"], list) for m in fake_model.requests[-1]["messages"])
    assert json.loads(results[5]) == {"city": "Paris", "population": 1234, "tags": ["a", "b"]}
    assert results[6] == "[resource file:///notes/readme.txt]\nthe resource's text"
    assert results[7] == "odd"
    assert results[8] == "echo: over http"
    assert results[9] == "key-456"  # headers are sent, their ${ENV} expanded
    assert results[10] == "error: echo__slow did not finish within 1 s (timeout_s of the MCP server echo)"
    # A timed-out call leaves the connection usable.
    assert await call(gw, "echo__echo", text="still here") == "echo: still here"

    tools = await chat(gw, "eve", "/tools")
    assert "built-in: read_file, current_time" in tools
    assert "- echo: ready, 13 tools" in tools and "- web: ready, 2 tools" in tools
    assert "web__echo, web__header" in tools
    assert metric(gw, "gateway_tool_calls_total", outcome="ok", tool="echo__echo") == 1
    assert metric(gw, "gateway_tool_calls_total", outcome="error", tool="echo__fail") == 1
    assert metric(gw, "gateway_mcp_server_up", server="web") == 1

    # Secrets of MCP servers are masked, and no MCP setting is changed from chat.
    shown = await chat(gw, "boss", "/config")
    assert '"tok-123"' not in shown and "key-456" not in shown
    assert 'mcp.servers.echo.env.ECHO_TOKEN = "***"' in shown and 'mcp.servers.web.headers.X-Api-Key = "***"' in shown
    refused = await chat(gw, "boss", '/config mcp.servers {"evil": {"command": "rm"}}')
    assert "not in chat" in refused
    assert "evil" not in json.loads((tmp_path / "config.json").read_text())["mcp"]["servers"]
    assert "not in chat" in await chat(gw, "boss", "/config mcp.servers.echo.command /bin/sh")


async def test_a_tools_image_is_saved_and_shown_to_a_model_with_vision(make_gateway: GatewayFactory,
                                                                       fake_model: FakeModel) -> None:
    gw = await make_gateway(mcp={"servers": {"echo": stdio()}},
                            model=fake_model.model_settings(max_retries=2, timeout_s=10, vision=True))
    await ready(gw, "echo")
    fake_model.tool_calls([("echo__picture", {}), ("echo__echo", {"text": "hi"})])
    fake_model.reply("a dot")
    assert await chat(gw, "eve", "draw") == "a dot"
    sent = fake_model.requests[-1]["messages"]
    roles = [m["role"] for m in sent]
    assert roles[-4:] == ["assistant", "tool", "tool", "user"]  # the image after the step's results
    assert unfence(sent[-3]["content"]) == "[image: files/mcp_echo_picture_1.png, 1×1]"
    parts = sent[-1]["content"]
    assert parts[1]["type"] == "image_url"
    assert parts[1]["image_url"]["url"] == "data:image/png;base64," + base64.b64encode(PNG).decode()
    assert gw.services is not None
    saved = list(gw.services.data_dir.rglob("files/mcp_echo_picture_1.png"))
    assert len(saved) == 1 and saved[0].read_bytes() == PNG


async def test_a_server_that_dies_comes_back_with_the_same_tools(make_gateway: GatewayFactory,
                                                                 fake_model: FakeModel) -> None:
    gw = await make_gateway(mcp={"servers": {"echo": stdio()}})
    assert gw.services is not None and gw.mcp is not None
    await ready(gw, "echo")
    registry = gw.services.tools
    schemas, version = registry.schemas(), gw.mcp.version
    echo_tool = registry.get("echo__echo")
    first_pid = int(await call(gw, "echo__pid"))

    # Killed from outside; nobody asks for the tools until it is back: the same version,
    # the same tool objects and the very same schema list (prompt caches keep hitting).
    os.kill(first_pid, signal.SIGKILL)
    await until(lambda: metric(gw, "gateway_mcp_restarts_total", server="echo") == 1, what="the death noticed")
    await ready(gw, "echo")
    assert gw.mcp.version == version and registry.get("echo__echo") is echo_tool  # not rebuilt
    assert registry.schemas() is schemas
    second_pid = int(await call(gw, "echo__pid"))
    assert second_pid != first_pid and not Path(f"/proc/{first_pid}").exists()

    # Mid-conversation it dies while the model's call runs: the call fails at once, the turn
    # goes on, only its tools leave (and /tools says why and when it retries) and come back identical.
    fake_model.tool_call("echo__crash", {})
    fake_model.reply("it crashed")
    started = time.monotonic()
    assert await chat(gw, "eve", "crash it") == "it crashed"
    assert time.monotonic() - started < 5
    assert tool_results(fake_model.requests[-1]) == ["error: the MCP server echo went away during the call"]
    await until(lambda: metric(gw, "gateway_mcp_restarts_total", server="echo") == 2, what="the crash noticed")
    assert state(gw, "echo") in ("failed", "connecting")  # a restart takes far longer than one poll
    assert "echo__echo" not in registry.names and "read_file" in registry.names
    assert re.search(r"- echo: (failed; retry in \d+ s|connecting)\n",  # not an admin: no details
                     await chat(gw, "eve", "/tools") + "\n")
    await ready(gw, "echo")
    assert json.dumps(registry.schemas()) == json.dumps(schemas) and gw.mcp.version == version
    fake_model.tool_call("echo__echo", {"text": "again"})
    fake_model.reply("fine")
    assert await chat(gw, "eve", "and now?") == "fine"
    assert tool_results(fake_model.requests[-1])[-1] == "echo: again"


async def test_a_changed_tool_list_is_taken_only_when_it_differs(make_gateway: GatewayFactory) -> None:
    gw = await make_gateway(mcp={"servers": {"echo": stdio()}})
    assert gw.services is not None and gw.mcp is not None
    await ready(gw, "echo")
    registry = gw.services.tools
    schemas, version = registry.schemas(), gw.mcp.version
    # notifications/tools/list_changed with the same tools: listed again, nothing changes.
    assert await call(gw, "echo__announce", add=False) == "announced"
    await asyncio.sleep(0.5)  # the re-list has long finished (a few ms)
    assert gw.mcp.version == version and registry.schemas() is schemas
    # With a new tool: it appears, in its place in the order.
    assert await call(gw, "echo__announce", add=True) == "announced"
    await until(lambda: "echo__added" in registry.names, what="the new tool")
    assert [n for n in registry.names if "__" in n][:3] == ["echo__added", "echo__announce", "echo__big"]
    assert await call(gw, "echo__added") == "added"


async def test_http_server_that_dies_is_reconnected(make_gateway: GatewayFactory, http_server: HttpServer) -> None:
    gw = await make_gateway(mcp={"servers": {"web": {"url": http_server.url, "tools": ["echo"]}}})
    assert gw.mcp is not None
    await ready(gw, "web")
    version = gw.mcp.version
    await http_server.stop()
    await until(lambda: state(gw, "web") == "failed", what="web failed")  # noticed by a ping
    status = gw.mcp.statuses()[0]
    assert status.error is not None and "cannot reach" in status.error and not gw.mcp.tools()
    with pytest.raises(ToolError, match=r"web is not connected \(failed: cannot reach .*web__echo is unavailable"):
        await gw.mcp.call("web", "echo", "web__echo", {"text": "x"})
    await http_server.start()
    await ready(gw, "web")
    assert gw.mcp.version == version
    assert await call(gw, "web__echo", text="back") == "echo: back"


async def test_a_200k_result_is_cut_and_read_back_byte_exact(make_gateway: GatewayFactory,
                                                             fake_model: FakeModel) -> None:
    gw = await make_gateway(mcp={"servers": {"echo": stdio()}})
    assert gw.services is not None
    await ready(gw, "echo")
    full = big_text(200_000)
    fake_model.tool_call("echo__big", {"chars": 200_000})
    fake_model.reply("long")
    await chat(gw, "eve", "get the big text")
    first = tool_results(fake_model.requests[-1])[-1]
    assert len(first) < 52_000  # stage 1: tool_result_max_chars (50,000) plus the notice
    notice = re.search(r'read_file\(path="(tool_results/[^"]+)", offset=(\d+)\)', first)
    assert notice, first[-500:]
    path, offset = notice.group(1), int(notice.group(2))
    saved = workspace_dir(gw.services.data_dir, "web:eve") / path
    assert saved.read_bytes() == full.encode()
    collected = full[:offset]
    assert first.startswith(collected)
    for _ in range(10):
        fake_model.tool_call("read_file", {"path": path, "offset": offset})
        fake_model.reply("ok")
        await chat(gw, "eve", f"continue at {offset}")
        window = tool_results(fake_model.requests[-1])[-1]
        nxt = re.search(r'read_file\(path="' + re.escape(path) + r'", offset=(\d+)\)', window)
        if nxt is None:
            collected += window
            break
        end = int(nxt.group(1))
        assert window.startswith(full[offset:end])
        collected += full[offset:end]
        offset = end
    assert collected.encode() == full.encode()


async def test_hot_reload_touches_only_the_changed_server(make_gateway: GatewayFactory, tmp_path: Path) -> None:
    gw = await make_gateway(mcp={"servers": {"a": stdio()}})
    assert gw.mcp is not None and gw.services is not None
    await ready(gw, "a")
    a_pid = int(await call(gw, "a__pid"))
    path = tmp_path / "config.json"
    watcher = gw.config_watcher()

    async def rewrite(servers: dict[str, Any]) -> None:
        raw = json.loads(path.read_text())
        raw["mcp"] = {"servers": servers}
        path.write_text(json.dumps(raw))
        assert await watcher.reload()

    await rewrite({"a": stdio(), "b": stdio()})  # add b
    await ready(gw, "b")
    b_pid = int(await call(gw, "b__pid"))
    await rewrite({"a": stdio(), "b": stdio(args=[str(ECHO), "--extra"])})  # change b
    await until(lambda: gw.services is not None and "b__added" in gw.services.tools.names, what="b restarted")
    new_b_pid = int(await call(gw, "b__pid"))
    assert new_b_pid != b_pid and not Path(f"/proc/{b_pid}").exists()
    await rewrite({"a": stdio()})  # remove b
    assert not [n for n in gw.services.tools.names if n.startswith("b__")]
    assert [s.name for s in gw.mcp.statuses()] == ["a"]
    assert not Path(f"/proc/{new_b_pid}").exists()  # stopped and reaped
    # a was never restarted: same process, no reconnects.
    assert int(await call(gw, "a__pid")) == a_pid
    assert metric(gw, "gateway_mcp_restarts_total", server="a") == 0
    await rewrite({"a": stdio(enabled=False)})
    assert gw.mcp.statuses()[0].describe() == "disabled" and not gw.mcp.tools()
    assert "- a: disabled" in gw.commands.tools()


async def test_shutdown_cancels_calls_and_leaves_no_child_processes(make_gateway: GatewayFactory) -> None:
    gw = await make_gateway(mcp={"servers": {"one": stdio(), "two": stdio()}})
    await ready(gw, "one", "two")
    pids = {int(await call(gw, "one__pid")), int(await call(gw, "two__pid"))}
    assert pids <= set(stdio_servers())
    running = asyncio.ensure_future(call(gw, "one__slow", seconds=30))
    await asyncio.sleep(0.3)
    started = time.monotonic()
    await gw.stop(timeout=5)
    assert time.monotonic() - started < 10
    with pytest.raises(ToolError):
        await asyncio.wait_for(running, 2)  # cancelled with the gateway, not left waiting 30 s
    assert not stdio_servers(), stdio_servers()  # no process left, no zombie either
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)


async def test_a_server_that_cannot_start_says_why_and_never_blocks_readiness(make_gateway: GatewayFactory) -> None:
    broken = {"command": sys.executable,
              "args": ["-c", "import sys; sys.stderr.write('boom: missing dependency\\n'); sys.exit(1)"]}
    gw = await make_gateway(admins=["web:x"],
                            mcp={"servers": {"broken": broken, "nowhere": {"command": "/nonexistent/mcp-server"}}})
    assert gw.http is not None and gw.mcp is not None
    await until(lambda: all(s.error for s in gw.mcp.statuses()), what="both failed")
    status, body = await post_chat(gw, {"session": "x", "text": "/tools"})  # an admin: why, in detail
    assert status == 200
    reply = body["reply"]
    assert re.search(r"- broken: failed: the server closed the connection \(stderr: boom: missing dependency\); "
                     r"retry in \d+ s", reply), reply
    assert "- nowhere: failed: cannot start '/nonexistent/mcp-server': No such file or directory" in reply
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{gw.http.port}/readyz") as resp:
            ready_body = await resp.json()
    assert resp.status == 200 and ready_body["ready"] is True
    assert ready_body["mcp"]["broken"] in ({"state": "down"}, {"state": "starting"})
    assert "mcp" not in ready_body["checks"]
    logged = (gw.holder.data_dir / "mcp" / "broken.stderr.log").read_text()
    assert "boom: missing dependency" in logged


async def test_a_failing_server_s_keys_are_shown_to_nobody(make_gateway: GatewayFactory,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # The server prints the key it was given (a configured secret) and one the gateway never
    # saw (shaped like a key) on stderr as it fails: neither may reach a chat or /readyz.
    configured = "upstream-key-4242-abcd"
    monkeypatch.setenv("REFUSED_UPSTREAM_KEY", configured)
    server = {"command": sys.executable, "args": [str(REFUSED)], "env": {"UPSTREAM_KEY": "${REFUSED_UPSTREAM_KEY}"}}
    gw = await make_gateway(admins=["web:boss"], http={"admin_token": ADMIN_TOKEN},
                            mcp={"servers": {"refused": server}})
    assert gw.http is not None and gw.mcp is not None
    await until(lambda: "stderr" in (gw.mcp.statuses()[0].error or ""), what="the failure and its stderr line")
    keys = (configured, FALLBACK_KEY, FALLBACK_KEY[3:])

    # An admin learns why, with the keys masked.
    shown = await chat(gw, "boss", "/tools")
    assert "- refused: failed: the server closed the connection (stderr: ERROR upstream: upstream refused the " \
           "key *** with HTTP 401; the fallback *** too)" in shown, shown
    # Anyone else learns that it failed, not the server's words.
    other = await chat(gw, "alice", "/tools")
    assert re.search(r"- refused: failed; retry in \d+ s", other) and "upstream" not in other, other
    async with aiohttp.ClientSession() as http:
        base = f"http://127.0.0.1:{gw.http.port}"
        async with http.get(f"{base}/readyz") as resp:  # no token: one state per server
            ready_text = await resp.text()
        async with http.get(f"{base}/admin/api/status", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as resp:
            assert resp.status == 200
            admin_text = await resp.text()
    assert json.loads(ready_text)["mcp"] in ({"refused": {"state": "down"}}, {"refused": {"state": "starting"}})
    assert "upstream refused" in admin_text  # the admin page shows why, masked too
    for text in (shown, other, ready_text, admin_text):
        assert not any(key in text for key in keys), text
    # The server's own stderr log keeps its words for the operator on the machine.
    assert configured in (gw.holder.data_dir / "mcp" / "refused.stderr.log").read_text()


# -- configuration ----------------------------------------------------------------------------


def test_config_validates_servers() -> None:
    def problems(servers: dict[str, Any]) -> list[str]:
        with pytest.raises(ConfigError) as err:
            parse_config({"mcp": {"servers": servers}}, environ={})
        return err.value.problems

    assert "exactly one of command" in problems({"x": {"command": "a", "url": "http://h/mcp"}})[0]
    assert "exactly one of command" in problems({"x": {}})[0]
    assert problems({"x": {"url": "file:///etc/passwd"}})[0].startswith("mcp.servers.x: url must be an http")
    assert "server name 'a.b'" in problems({"a.b": {"command": "a"}})[0]
    assert "server name 'a__b'" in problems({"a__b": {"command": "a"}})[0]
    assert problems({"x": {"command": "a", "headers": {"A": "b"}}})[0].startswith("mcp.servers.x: headers")
    assert "did you mean 'mcp.servers.x.command'" in problems({"x": {"comand": "a"}})[0]
    assert problems({"x": {"command": "a", "timeout_s": 0}})[0].startswith("mcp.servers.x.timeout_s")


def test_env_references_expand_only_in_env_and_headers() -> None:
    cfg = parse_config({"mcp": {"servers": {
        "s": {"command": "${CMD}", "args": ["${TOKEN}"], "env": {"T": "${TOKEN}"}},
        "h": {"url": "https://example.invalid/${TOKEN}", "headers": {"Authorization": "Bearer ${TOKEN}"}},
    }}}, environ={"TOKEN": "sekret", "CMD": "/bin/evil"})
    s, h = cfg.mcp.servers["s"], cfg.mcp.servers["h"]
    assert s.command == "${CMD}" and s.args == ("${TOKEN}",) and s.env["T"].get_secret_value() == "sekret"
    assert h.url == "https://example.invalid/${TOKEN}"
    assert h.headers["Authorization"].get_secret_value() == "Bearer sekret"


def test_an_unset_reference_stops_run_only_for_an_enabled_server() -> None:
    cfg = parse_config({"mcp": {"servers": {
        "on": {"command": "a", "env": {"T": "${MISSING_ONE}"}},
        "off": {"command": "a", "env": {"T": "${MISSING_TWO}"}, "enabled": False},
    }}}, environ={"OPENAI_API_KEY": "k"})
    problems = startup_problems(cfg, channels=False, http=False)
    assert problems == ["mcp.servers.on.env.T: the environment variable MISSING_ONE is not set "
                        "(needed while the MCP server on is enabled)"]


def test_server_secrets_are_redacted_from_logs() -> None:
    from gateway.app import secret_values

    cfg = parse_config({"mcp": {"servers": {
        "s": {"command": "a", "env": {"T": "${TOKEN}"}},
        "h": {"url": "https://example.invalid/mcp", "headers": {"Authorization": "Bearer ${TOKEN}"}},
    }}}, environ={"TOKEN": "sekret-value"})
    assert {"sekret-value", "Bearer sekret-value"} <= set(secret_values(cfg))


def test_the_readme_examples_are_valid_config() -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("### MCP servers", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    examples = re.findall(r"```json\n(.*?)```", section, re.S)
    assert len(examples) == 3
    transports = []
    for example in examples:
        cfg = parse_config(json.loads("{" + example + "}"), environ={"GITHUB_TOKEN": "t", "SEARCH_MCP_TOKEN": "t"})
        transports += [("stdio" if s.command else "http") + (" sandboxed" if s.sandbox else "")
                       for s in cfg.mcp.servers.values()]
    assert transports == ["stdio", "http", "stdio sandboxed"]


# -- names and schemas ---------------------------------------------------------------------------


def test_names_fit_provider_rules_and_stay_unique() -> None:
    assert fitted_name("github", "create_issue") == "github__create_issue"
    long_a, long_b = "x" * 70 + "a", "x" * 70 + "b"
    fitted = {fitted_name("srv", n) for n in (long_a, long_b, "a.b", "a/b", "a b")}
    assert len(fitted) == 5 and all(TOOL_NAME.fullmatch(n) for n in fitted)
    assert fitted_name("srv", "a.b") == fitted_name("srv", "a.b")  # stable across runs


def test_schemas_are_normalized_whatever_the_key_order() -> None:
    a = {"type": "object", "properties": {"b": {"type": "string", "title": "B"}, "a": {"type": "integer"}},
         "required": ["b"]}
    b = {"required": ["b"], "properties": {"a": {"type": "integer"}, "b": {"title": "B", "type": "string"}},
         "type": "object"}
    assert json.dumps(normalized_schema(a)) == json.dumps(normalized_schema(b))
    assert normalized_schema(None) == {"properties": {}, "type": "object"}


@pytest.mark.parametrize("closed", ["broken pipe", "end of stream"])
async def test_a_server_gone_reads_the_same_whichever_side_noticed_first(tmp_path: Path, closed: str) -> None:
    """A stdio server that exits while the client writes breaks the pipe before the reader
    sees the end of its output (seen on a loaded machine): /tools says the same either way,
    with the server's last stderr line."""
    import anyio

    from gateway.config.schema import McpServerConfig

    manager = mcp_module.McpManager(base_dir=tmp_path, log_dir=tmp_path)
    server = mcp_module._Server(manager, "broken", McpServerConfig(command=sys.executable))
    log_path = tmp_path / "broken.stderr.log"
    log_path.write_text("boom: missing dependency\n")
    server._stderr_path, server._stderr_mark = log_path, 0
    leaf = anyio.BrokenResourceError() if closed == "broken pipe" else anyio.EndOfStream()
    reason = await server._reason(BaseExceptionGroup("task group", [ExceptionGroup("inner", [leaf])]), started=True)
    assert reason == "the server closed the connection (stderr: boom: missing dependency)"
