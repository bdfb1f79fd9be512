"""MCP servers as tools (SPEC §5.2), through the official `mcp` SDK.

`McpManager` is a `ToolSource` named "mcp". Each configured server gets one owned task
that runs its whole client lifecycle (transport, `ClientSession`, the calls) inside itself:
the SDK's transports are anyio task groups, which must be entered and left by the same
task, so nothing about a connection is ever touched from another task except through
that task's inbox. A server that dies (its process exits, its HTTP endpoint fails, it stops
answering pings) is reconnected with exponential backoff; meanwhile only its tools are
missing. Servers connect in the background: readiness never waits for them.

Prompt stability (SPEC §5): tools are listed by (server, tool), their schemas are
normalized (keys sorted), and the same tools come back as the same objects, so a server
that reconnects with the same tools leaves the tool list, and `version`, as they were.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal

import anyio

from gateway.config.schema import McpConfig, McpServerConfig
from gateway.ops.logs import REDACTOR
from gateway.tools import sandbox
from gateway.tools.base import ToolContext, ToolError, ToolImage, ToolOutput
from gateway.tools.sandbox import SandboxError
from gateway.workspace import make_private_dir

if TYPE_CHECKING:
    from anyio.abc import TaskGroup
    from mcp import ClientSession, McpError, types

    from gateway.ops.metrics import Metrics

log = logging.getLogger("gateway.mcp")

BACKOFF_MIN_S = 1.0  # first retry after a failure; doubles up to BACKOFF_MAX_S
BACKOFF_MAX_S = 60.0
STABLE_S = 60.0  # a connection that stayed up this long starts the backoff over
PING_INTERVAL_S = 30.0  # an idle connection is pinged this often: a hung or vanished server is noticed
PING_TIMEOUT_S = 20.0
STOP_GRACE_S = 6.0  # for a server to close by itself (stdio: stdin closed, then SIGTERM after 2 s)
STOP_KILL_S = 3.0  # after the task is cancelled (the SDK kills the process)
HTTP_CONNECT_TIMEOUT_S = 15.0
CALL_GUARD_S = 5.0  # past a server's timeout_s, a call that its connection never answered is given up
CANCEL_NOTICE_S = 5.0  # telling a server that a call it runs was cancelled
STDERR_LOG_MAX_BYTES = 1_000_000  # a server's stderr log is started afresh past this
REASON_MAX_CHARS = 300
STDERR_TAIL_BYTES = 4096  # how much of a server's stderr log is read for its last line
STDERR_SHOWN_CHARS = 200
SANDBOX_START_S = 30.0  # for a sandboxed server's sandbox to be made (its network connected)
STDIO_EXIT_S = 2.0  # for a sandboxed server to exit once its stdin is closed (then it is killed)
MESSAGE_MAX_BYTES = 64 << 20  # one message from a sandboxed server

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's (and most providers') rule for function names
_NOT_IN_NAME = re.compile(r"[^A-Za-z0-9_-]")
# What a server started over stdio inherits from the gateway's environment; nothing else
# (API keys, tokens) reaches it unless its `env` lists it.
SAFE_ENV = ("HOME", "LOGNAME", "PATH", "SHELL", "TERM", "USER", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR")

State = Literal["connecting", "ready", "failed", "disabled"]


# -- names and schemas ---------------------------------------------------------------------


def fitted_name(server: str, tool: str) -> str:
    """`<server>__<tool>` when providers accept it as is; otherwise the offending characters
    become "_" and a short hash of the original keeps it unique within 64 characters."""
    plain = f"{server}__{tool}"
    if TOOL_NAME.fullmatch(plain):
        return plain
    digest = hashlib.sha1(f"{server}\0{tool}".encode()).hexdigest()[:8]
    return f"{_NOT_IN_NAME.sub('_', plain)[:55]}_{digest}"


def normalized_schema(schema: Mapping[str, Any] | None) -> dict[str, Any]:
    """The server's input schema with its keys in a stable order (the same schema given in
    another key order is byte-identical in the request), as an object schema."""
    data: dict[str, Any] = json.loads(json.dumps(dict(schema or {}), sort_keys=True, ensure_ascii=False))
    data.setdefault("type", "object")
    if data["type"] == "object":
        data.setdefault("properties", {})
    return dict(sorted(data.items()))


@dataclass(frozen=True, slots=True)
class RemoteTool:
    """A tool as one server offers it, normalized."""

    name: str
    description: str
    schema_json: str  # normalized_schema, serialized: the identity used to compare

    @classmethod
    def of(cls, tool: types.Tool) -> RemoteTool:
        description = (tool.description or tool.title or "").strip()
        return cls(tool.name, description, json.dumps(normalized_schema(tool.inputSchema), ensure_ascii=False))


class McpTool:
    """One server's tool as the agent sees it. It names its server, not a connection: the
    same object keeps working across reconnects."""

    def __init__(self, manager: McpManager, server: str, remote: RemoteTool, name: str) -> None:
        self._manager = manager
        self.server = server
        self.remote = remote.name
        self.name = name
        self.description = remote.description or f"The {remote.name} tool of the MCP server {server}."
        self.parameters: dict[str, Any] = json.loads(remote.schema_json)

    async def run(self, args: dict[str, Any], ctx: ToolContext) -> ToolOutput:
        return await self._manager.call(self.server, self.remote, self.name, args)

    def status(self, args: dict[str, Any]) -> str:
        """The line a person sees while this tool runs (SPEC §5.1)."""
        return f"running {self.server} {self.remote}…"

    @property
    def timeout_s(self) -> float | None:
        """The longest a call may take: the server's `timeout_s` as configured now (the agent
        bounds the call by it instead of its fixed default)."""
        return self._manager.call_timeout(self.server)


# -- results --------------------------------------------------------------------------------


def _size(data: str) -> str:
    n = len(data) * 3 // 4  # base64
    return f"{n:,} bytes"


_IMAGE_EXT = {"image/png": ".png", "image/jpeg": ".jpg", "image/webp": ".webp", "image/gif": ".gif"}


def result_text(result: types.CallToolResult, tool: str) -> str:
    """A tool result as text alone (images as placeholder lines)."""
    return result_output(result, tool).text


def result_output(result: types.CallToolResult, tool: str, server: str = "", remote: str = "") -> ToolOutput:
    """A tool result for the model: text content as is, other content as readable lines,
    images handed on to be saved (the agent adds a line naming each saved file). An
    `isError` result raises ToolError (the model reads "error: …")."""
    from mcp import types  # the SDK loads with the first server, not at start
    parts: list[str] = []
    images: list[ToolImage] = []
    for item in result.content:
        if isinstance(item, types.TextContent):
            parts.append(item.text)
        elif isinstance(item, types.ImageContent):
            ext = _IMAGE_EXT.get(item.mimeType.lower())
            if ext is None or not server:
                parts.append(f"[image from {tool}: {item.mimeType}, {_size(item.data)}]")
            else:
                stem = _NOT_IN_NAME.sub("_", f"mcp_{server}_{remote}")[:80]
                images.append(ToolImage(f"{stem}_{len(images) + 1}{ext}", item.mimeType, item.data))
        elif isinstance(item, types.AudioContent):
            parts.append(f"[audio from {tool}: {item.mimeType}, {_size(item.data)}]")
        elif isinstance(item, types.EmbeddedResource):
            res = item.resource
            if isinstance(res, types.TextResourceContents):
                parts.append(f"[resource {res.uri}]\n{res.text}")
            else:
                parts.append(f"[resource {res.uri}: {res.mimeType or 'binary'}, {_size(res.blob)}]")
        elif isinstance(item, types.ResourceLink):
            label = item.title or item.name
            parts.append(f"[resource link: {label} {item.uri}]")
    if not parts and result.structuredContent is not None:
        parts.append(json.dumps(result.structuredContent, ensure_ascii=False, indent=2))
    text = "\n".join(parts)
    if result.isError:
        raise ToolError(REDACTOR.redact_shown(text) or f"{tool} reported an error without saying which")
    return ToolOutput(text or ("" if images else "(no output)"), images=tuple(images),
                      source=f"MCP server {server}, tool {remote}" if server else f"MCP tool {tool}")


# -- one server ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ServerStatus:
    name: str
    state: State
    tools: int = 0
    error: str | None = None
    retry_in_s: float | None = None
    transport: Literal["stdio", "http"] = "stdio"

    def describe(self, *, details: bool = True) -> str:
        """One line for /tools and the admin page; without `details` (people who are not
        admins) a failure says when it is retried, not the server's words."""
        if self.state == "ready":
            return f"ready, {self.tools} tool{'s' if self.tools != 1 else ''}"
        if self.state == "failed":
            retry = f"; retry in {self.retry_in_s:.0f} s" if self.retry_in_s is not None else ""
            return f"failed: {self.error}{retry}" if details else f"failed{retry}"
        return self.state

    @property
    def public_state(self) -> str:
        """All an unauthenticated caller (/readyz) learns: up, starting, down or disabled."""
        return {"ready": "up", "connecting": "starting", "failed": "down"}.get(self.state, str(self.state))


class ConnectionLost(Exception):
    """The server's side of the connection ended (its process exited, its stream closed)."""


# What the transport raises when the other end is gone (anyio's streams, the OS's pipes).
CLOSED_ERRORS: tuple[type[BaseException], ...] = (
    anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream, BrokenPipeError, ConnectionResetError,
)


@dataclass(eq=False)
class _Call:
    remote: str
    shown: str
    args: dict[str, Any]
    future: asyncio.Future[ToolOutput]
    scope: anyio.CancelScope | None = None
    abandoned: bool = False

    def settle(self, result: ToolOutput | BaseException) -> None:
        if self.future.done():
            return
        if isinstance(result, BaseException):
            self.future.set_exception(result)
        else:
            self.future.set_result(result)

    def abandon(self) -> None:
        """The caller stopped waiting (timeout, its turn cancelled): stop the work too."""
        self.abandoned = True
        if self.scope is not None:
            self.scope.cancel()


_STOP = "stop"
_RELIST = "relist"


class _Server:
    """One configured server: its owned task connects, serves calls from its inbox, and
    reconnects with backoff until stopped."""

    def __init__(self, manager: McpManager, name: str, cfg: McpServerConfig) -> None:
        self.manager = manager
        self.name = name
        self.cfg = cfg
        self.state: State = "connecting"
        self.error: str | None = None
        self.retry_at: float | None = None
        self.remote: tuple[RemoteTool, ...] = ()  # what it offers now (empty while down)
        self._inbox: asyncio.Queue[_Call | str] = asyncio.Queue()
        self._stopping = asyncio.Event()
        self._in_flight = 0
        self._stderr_path: Path | None = None
        self._stderr_mark = 0  # the log's size when this connection's process started
        self._killed_for: str | None = None  # why the sandbox's watchdog killed the server, if it did
        self.task: asyncio.Task[None] | None = None

    @property
    def transport(self) -> Literal["stdio", "http"]:
        return "stdio" if self.cfg.command is not None else "http"

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._supervise(), name=f"mcp:{self.name}")
        self.task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.state, self.error = "failed", f"stopped after an unexpected error: {task.exception()!r}"[:300]
            log.error("MCP server supervisor failed", extra={"server": self.name}, exc_info=task.exception())

    def request_stop(self) -> None:
        self._stopping.set()
        self._inbox.put_nowait(_STOP)

    def status(self) -> ServerStatus:
        retry = max(0.0, self.retry_at - time.monotonic()) if self.retry_at is not None else None
        # Redacted here too: a secret added by a reload is hidden from an older error as well.
        error = REDACTOR.redact_shown(self.error) if self.error is not None else None
        return ServerStatus(self.name, self.state, len(self.remote), error,
                            retry if self.state == "failed" else None, self.transport)

    # -- calls (from any task) --

    async def call(self, remote: str, shown: str, args: dict[str, Any]) -> ToolOutput:
        if self._stopping.is_set():
            raise ToolError(f"the MCP server {self.name} is stopping (removed, changed or the gateway stops)")
        if self.state != "ready":
            raise ToolError(f"the MCP server {self.name} is not connected ({self.status().describe()}); "
                            f"{shown} is unavailable until it is back")
        call = _Call(remote, shown, args, asyncio.get_running_loop().create_future())
        self._inbox.put_nowait(call)
        try:
            # The server's own read timeout answers first; this only guards the inbox.
            return await asyncio.wait_for(call.future, self.cfg.timeout_s + CALL_GUARD_S)
        except TimeoutError:
            raise ToolError(self._too_slow(shown)) from None
        finally:
            if call.future.cancelled():  # timed out, or the caller's turn was cancelled
                call.abandon()

    def _too_slow(self, shown: str) -> str:
        return f"{shown} did not finish within {self.cfg.timeout_s:g} s (timeout_s of the MCP server {self.name})"

    # -- the owned task --

    async def _supervise(self) -> None:
        delay = self.manager.backoff_min_s
        try:
            while not self._stopping.is_set():
                self.state, self.error, self.retry_at = "connecting", None, None
                up_since: list[float] = []
                try:
                    await self._connection(up_since)
                except Exception as err:  # any way a connection ends; the reason is shown
                    reason = await self._reason(err, started=not up_since)
                else:
                    break  # stopped
                finally:
                    self._down()
                if self._stopping.is_set():
                    break
                if up_since and time.monotonic() - up_since[0] >= STABLE_S:
                    delay = self.manager.backoff_min_s
                self.state, self.error = "failed", reason
                self.retry_at = time.monotonic() + delay
                self.manager.server_failed(self, reason, delay)
                try:
                    await asyncio.wait_for(self._stopping.wait(), delay)
                except TimeoutError:
                    pass
                delay = min(delay * 2, self.manager.backoff_max_s)
        finally:
            self._down()
            self._fail_waiting("the gateway is stopping")

    def _down(self) -> None:
        if self.remote:
            self.remote = ()
            self.manager.publish()
        self.manager.server_up(self.name, False)
        self._fail_waiting(f"the MCP server {self.name} went away during the call")

    def _fail_waiting(self, why: str) -> None:
        while not self._inbox.empty():
            item = self._inbox.get_nowait()
            if isinstance(item, _Call):
                item.settle(ToolError(why))
            elif item == _STOP:
                self._stopping.set()

    async def _connection(self, up_since: list[float]) -> None:
        """One connection, start to end; returns only when asked to stop."""
        from mcp import ClientSession, types
        from mcp.shared.message import SessionMessage
        async with AsyncExitStack() as stack:
            read, write = await self._open_transport(stack)
            # The session reads through this relay, so the end of the server's stream is
            # noticed here (the SDK's session just stops reading).
            relay_in, relay_out = anyio.create_memory_object_stream[SessionMessage | Exception](0)
            session = await stack.enter_async_context(ClientSession(
                relay_out, write, message_handler=self._on_message,
                client_info=types.Implementation(name="chat-gateway", version="1")))
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._relay, read, relay_in)
                with anyio.fail_after(self.cfg.timeout_s):
                    await session.initialize()
                    offered = await self._list_tools(session)
                self._ready(offered)
                up_since.append(time.monotonic())
                tg.start_soon(self._ping, session)
                await self._serve(session, tg)
                tg.cancel_scope.cancel()

    async def _open_transport(self, stack: AsyncExitStack) -> tuple[Any, Any]:
        import httpx
        from mcp import StdioServerParameters
        from mcp.client.stdio import stdio_client
        from mcp.client.streamable_http import streamable_http_client
        cfg = self.cfg
        if cfg.command is not None:
            errlog = await self._stderr_log()
            stack.push_async_callback(asyncio.to_thread, errlog.close)
            if cfg.sandbox:
                return await stack.enter_async_context(self._sandboxed(errlog))
            params = StdioServerParameters(command=cfg.command, args=list(cfg.args), env=self._environment(),
                                           cwd=self._cwd())
            read, write = await stack.enter_async_context(stdio_client(params, errlog=errlog))
            return read, write
        assert cfg.url is not None
        headers = {k: v.get_secret_value() for k, v in cfg.headers.items() if v is not None}
        client = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(
            HTTP_CONNECT_TIMEOUT_S, read=max(300.0, cfg.timeout_s + 5)))
        await stack.enter_async_context(client)
        read, write, _session_id = await stack.enter_async_context(streamable_http_client(cfg.url, http_client=client))
        return read, write

    def _environment(self) -> dict[str, str]:
        env = {key: os.environ[key] for key in SAFE_ENV if key in os.environ}
        env.update({k: v.get_secret_value() for k, v in self.cfg.env.items() if v is not None})
        return env

    def _cwd(self) -> str | None:
        if self.cfg.cwd is None:
            return None
        path = Path(self.cfg.cwd)
        return str(path if path.is_absolute() else self.manager.base_dir / path)

    @asynccontextmanager
    async def _sandboxed(self, errlog: IO[str]) -> AsyncIterator[tuple[Any, Any]]:
        """The server in the sandbox, spoken to over its stdin and stdout as the SDK's
        stdio client does (which cannot start a sandbox: bwrap needs file descriptors
        passed, and the sandbox a watchdog for its whole life). It sees its working
        directory (`cwd`, or a directory of its own under data/mcp/) read-write at the same
        path, the system and `read_only_paths` read-only, the network as `network` says. Its
        environment is what it would get outside (SAFE_ENV and its `env`), handed to bwrap
        as a process environment, never on a command line. It has exec's process cap and
        watchdog, also under a root gateway."""
        from mcp import types
        from mcp.shared.message import SessionMessage
        found = await sandbox.availability()
        refused = found.refusal(self.cfg.network)
        if refused is not None:
            raise SandboxError(f"sandbox: {refused}" + (" (network is true)" if found.tools else ""))
        assert found.tools is not None
        workdir, read_only = await asyncio.to_thread(self._sandbox_paths)
        box = sandbox.Box(workdir, inside=str(workdir), network=self.cfg.network,
                          limits=sandbox.Limits(memory_mb=None), read_only=read_only, clear_env=False,
                          setenv={"HOME": str(workdir)}, unsetenv=("TMPDIR",), disk=sandbox.Disk(None))
        self._killed_for = None
        running = await sandbox.start(found.tools, box, [self.cfg.command or "", *self.cfg.args],
                                      stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=errlog,
                                      env=self._environment())
        try:
            await running.until_started(SANDBOX_START_S)
            to_session, from_server = anyio.create_memory_object_stream[SessionMessage | Exception](0)
            to_server, from_session = anyio.create_memory_object_stream[SessionMessage](0)
            proc = running.proc
            assert proc.stdin is not None and proc.stdout is not None

            async def read_server() -> None:
                assert proc.stdout is not None
                async with to_session:
                    buffer = b""
                    while chunk := await proc.stdout.read(65_536):
                        *lines, buffer = (buffer + chunk).split(b"\n")
                        if len(buffer) > MESSAGE_MAX_BYTES:
                            raise ConnectionLost(f"the server sent a message of more than {MESSAGE_MAX_BYTES:,} bytes")
                        for line in lines:
                            if not line.strip():
                                continue
                            try:
                                message = types.JSONRPCMessage.model_validate_json(line)
                            except Exception as err:  # the session reports it (as the SDK's client does)
                                await to_session.send(err)
                                continue
                            await to_session.send(SessionMessage(message))
                    self._killed_for = running.killed_for

            async def write_server() -> None:
                assert proc.stdin is not None
                async with from_session:
                    async for outgoing in from_session:
                        proc.stdin.write(outgoing.message.model_dump_json(by_alias=True, exclude_none=True).encode()
                                         + b"\n")
                        await proc.stdin.drain()

            async with anyio.create_task_group() as tg:
                tg.start_soon(read_server)
                tg.start_soon(write_server)
                try:
                    yield from_server, to_server
                finally:
                    # As the SDK's stdio client: stdin closed, a moment to exit, then killed.
                    with contextlib.suppress(OSError):
                        proc.stdin.close()
                    with anyio.move_on_after(STDIO_EXIT_S, shield=True):
                        await proc.wait()
                    tg.cancel_scope.cancel()
                    for end in (from_server, to_server):
                        await end.aclose()
        finally:
            with anyio.CancelScope(shield=True):
                await running.close()
            if self._killed_for is None:
                self._killed_for = running.killed_for

    def _sandbox_paths(self) -> tuple[Path, tuple[Path, ...]]:
        """The server's working directory (made if missing) and its read-only paths, each
        refused when it would show the gateway's own files: the config file's directory
        (a path that holds it), the data dir (a path that holds it, or one inside it other
        than the server's own directory)."""
        manager = self.manager
        own = self._cwd()
        data = Path(os.path.realpath(manager.data_dir)) if manager.data_dir is not None else None
        if own is not None:
            workdir = Path(os.path.realpath(own))
        elif data is not None:
            workdir = data / "mcp" / self.name
        else:
            raise SandboxError("sandbox: the server needs a cwd (there is no data dir to give it one)")
        config_dir = Path(os.path.realpath(manager.base_dir))
        read_only: list[Path] = []
        for entry in (None, *self.cfg.read_only_paths):
            if entry is None:
                real, what = workdir, f"cwd {self.cfg.cwd!r}" if own is not None else "its directory"
            else:
                path = Path(entry)
                real = Path(os.path.realpath(path if path.is_absolute() else manager.base_dir / path))
                what = f"read_only_paths entry {entry!r}"
            if config_dir.is_relative_to(real):
                raise SandboxError(f"sandbox: {what} holds the config file's directory; give the server a "
                                   "directory of its own")
            theirs = entry is None and own is None
            if data is not None and (data.is_relative_to(real) or (real.is_relative_to(data) and not theirs)):
                raise SandboxError(f"sandbox: {what} would show the gateway's data dir; give the server a "
                                   "directory of its own")
            if entry is not None:
                if not real.exists():
                    raise SandboxError(f"sandbox: {what} does not exist")
                read_only.append(real)
        if own is None:
            make_private_dir(workdir)
        elif not workdir.is_dir():
            raise SandboxError(f"sandbox: cwd {self.cfg.cwd!r} is not a directory")
        return workdir, tuple(read_only)

    async def _stderr_log(self) -> IO[str]:
        """The server's stderr goes to data/mcp/<name>.stderr.log (a failure quotes its last line)."""
        directory = self.manager.log_dir
        if directory is None:
            return await asyncio.to_thread(open, os.devnull, "w")
        path = self._stderr_path = directory / f"{self.name}.stderr.log"

        def open_log() -> IO[str]:
            directory.mkdir(parents=True, exist_ok=True)
            fresh = not path.exists() or path.stat().st_size > STDERR_LOG_MAX_BYTES
            fh = open(path, "w" if fresh else "a", encoding="utf-8")  # closed by the exit stack
            self._stderr_mark = fh.tell()
            return fh

        return await asyncio.to_thread(open_log)

    async def _relay(self, source: Any, sink: Any) -> None:
        async with sink:
            async for message in source:
                await sink.send(message)
        raise ConnectionLost("the server closed the connection")

    async def _list_tools(self, session: ClientSession) -> tuple[RemoteTool, ...]:
        from mcp import types
        offered: dict[str, RemoteTool] = {}
        cursor: str | None = None
        for _ in range(100):  # pages; a server that never stops paging is cut off
            page = await session.list_tools(params=types.PaginatedRequestParams(cursor=cursor) if cursor else None)
            for tool in page.tools:
                offered[tool.name] = RemoteTool.of(tool)
            cursor = page.nextCursor
            if not cursor:
                break
        allow = self.cfg.tools
        if allow is not None:
            missing = sorted(set(allow) - set(offered))
            if missing:
                log.warning("MCP server does not offer some allowed tools",
                            extra={"server": self.name, "tools": missing})
            offered = {name: tool for name, tool in offered.items() if name in allow}
        return tuple(offered[name] for name in sorted(offered))

    def _ready(self, offered: tuple[RemoteTool, ...]) -> None:
        self.state, self.error, self.retry_at = "ready", None, None
        self.remote = offered
        self.manager.server_up(self.name, True)
        self.manager.publish()
        log.info("MCP server ready", extra={"server": self.name, "tools": len(offered)})

    async def _on_message(self, message: Any) -> None:
        from mcp import types
        # Runs inside the session's reader: only queue work here, never wait on the session.
        if isinstance(message, types.ServerNotification) and isinstance(message.root,
                                                                         types.ToolListChangedNotification):
            self._inbox.put_nowait(_RELIST)
        elif isinstance(message, Exception):
            log.debug("MCP server sent something unreadable", extra={"server": self.name, "error": str(message)})

    async def _ping(self, session: ClientSession) -> None:
        while True:
            await anyio.sleep(self.manager.ping_interval_s)
            if self._in_flight:
                continue  # its calls have their own timeouts; a busy server may answer pings late
            try:
                with anyio.fail_after(PING_TIMEOUT_S):
                    await session.send_ping()
            except TimeoutError:
                raise ConnectionLost(f"no answer to a ping within {PING_TIMEOUT_S:g} s") from None

    async def _serve(self, session: ClientSession, tg: TaskGroup) -> None:
        while True:
            item = await self._inbox.get()
            if item == _STOP:
                return
            if item == _RELIST:
                tg.start_soon(self._relist, session)
            elif isinstance(item, _Call):
                tg.start_soon(self._perform, session, item)

    async def _relist(self, session: ClientSession) -> None:
        with anyio.fail_after(self.cfg.timeout_s):
            offered = await self._list_tools(session)
        if offered != self.remote:
            self.remote = offered
            self.manager.publish()
            log.info("MCP server changed its tools", extra={"server": self.name, "tools": len(offered)})

    async def _perform(self, session: ClientSession, call: _Call) -> None:
        from mcp import McpError
        if call.abandoned:
            return
        self._in_flight += 1
        try:
            with anyio.CancelScope() as scope:
                call.scope = scope
                # The id the SDK gives this request (it takes the next one as the call
                # starts, with nothing run in between): needed to tell the server to stop.
                request_id = getattr(session, "_request_id", None)
                try:
                    result = await session.call_tool(call.remote, call.args,
                                                     read_timeout_seconds=timedelta(seconds=self.cfg.timeout_s))
                    call.settle(result_output(result, call.shown, self.name, call.remote))
                except ToolError as err:
                    call.settle(err)
                except McpError as err:
                    call.settle(ToolError(self._refused(call, err)))
                except Exception as err:  # a malformed answer must not end the connection
                    reason = REDACTOR.redact_shown(str(err))[:REASON_MAX_CHARS]
                    call.settle(ToolError(f"{call.shown} failed: {type(err).__name__}: {reason}"))
            if scope.cancelled_caught and isinstance(request_id, int):
                await self._tell_cancelled(session, request_id)
        finally:
            self._in_flight -= 1
            # Still unsettled: the connection ended under it (or the caller left).
            call.settle(ToolError(f"the MCP server {self.name} went away during the call"))

    async def _tell_cancelled(self, session: ClientSession, request_id: int) -> None:
        """The caller left (a /stop, a timeout): the server is told, as MCP defines it
        (`notifications/cancelled`), so the work stops there too. Best effort, bounded."""
        from mcp import types
        notice = types.ClientNotification(types.CancelledNotification(
            params=types.CancelledNotificationParams(requestId=request_id, reason="the caller stopped the call")))
        with anyio.move_on_after(CANCEL_NOTICE_S):
            try:
                await session.send_notification(notice)
            except Exception as err:  # the connection may be going away as well
                log.debug("could not tell an MCP server a call was cancelled",
                          extra={"server": self.name, "error": str(err)[:200]})

    def _refused(self, call: _Call, err: McpError) -> str:
        import httpx
        from mcp import types
        code = err.error.code
        if code == httpx.codes.REQUEST_TIMEOUT:
            return self._too_slow(call.shown)
        if code == types.CONNECTION_CLOSED:
            return f"the MCP server {self.name} went away during the call"
        reason = REDACTOR.redact_shown(err.error.message)[:REASON_MAX_CHARS]
        return f"the MCP server {self.name} refused the call: {reason}"

    async def _reason(self, err: BaseException, *, started: bool) -> str:
        """Why the connection ended, for /tools and the log; a server that failed while
        starting also gets the last line it wrote to stderr (usually the actual cause)."""
        import httpx
        from mcp import McpError
        leaf = _first_cause(err)
        if isinstance(leaf, CLOSED_ERRORS):
            # A server that exits breaks the pipe the client writes to: whichever side
            # notices first, it is the same event.
            leaf = ConnectionLost("the server closed the connection")
        cfg = self.cfg
        if isinstance(leaf, TimeoutError):
            text = f"no answer within {cfg.timeout_s:g} s"
        elif isinstance(leaf, FileNotFoundError) and cfg.command is not None:
            text = f"cannot start {cfg.command!r}: {leaf.strerror or leaf}"
        elif isinstance(leaf, PermissionError) and cfg.command is not None:
            text = f"cannot start {cfg.command!r}: permission denied"
        elif isinstance(leaf, httpx.HTTPStatusError):
            text = f"HTTP {leaf.response.status_code} from {cfg.url}"
        elif isinstance(leaf, httpx.TransportError):
            text = f"cannot reach {cfg.url}: {type(leaf).__name__}" + (f": {leaf}" if str(leaf) else "")
        elif isinstance(leaf, McpError):
            text = leaf.error.message
        elif isinstance(leaf, ConnectionLost | SandboxError):
            text = str(leaf)
        else:
            text = f"{type(leaf).__name__}: {leaf}"
        if self._killed_for is not None:  # whatever the client noticed first, the watchdog's kill is why
            text, leaf = f"the sandbox was killed: {self._killed_for}", ConnectionLost()
        if started and self._stderr_path is not None and isinstance(leaf, (ConnectionLost, TimeoutError, McpError)):
            last = await asyncio.to_thread(_last_line, self._stderr_path, self._stderr_mark)
            if last:
                text += f" (stderr: {last[:STDERR_SHOWN_CHARS]})"
        # Servers print keys on auth errors: redacted before it is cut, so no piece of one stays.
        return REDACTOR.redact_shown(text)[:REASON_MAX_CHARS]


def _first_cause(err: BaseException) -> BaseException:
    """The first error in a (nested) exception group that is not a cancellation."""
    if isinstance(err, BaseExceptionGroup):
        for inner in err.exceptions:
            found = _first_cause(inner)
            if not isinstance(found, asyncio.CancelledError):
                return found
        return err.exceptions[0]
    return err


def _last_line(path: Path, since: int) -> str:
    """The last non-empty line written to `path` after offset `since`, redacted (a line
    longer than the tail read is left out rather than shown from its middle, where a
    key's end would not be recognized)."""
    try:
        with open(path, "rb") as fh:
            start = max(since, fh.seek(0, os.SEEK_END) - STDERR_TAIL_BYTES)
            fh.seek(start)
            tail = fh.read().decode("utf-8", "replace")
    except OSError:
        return ""
    lines = tail.splitlines()
    if start > since and lines:
        lines = lines[1:]  # began mid-line
    lines = [line.strip() for line in lines if line.strip()]
    return REDACTOR.redact_shown(lines[-1]) if lines else ""


# -- the source ------------------------------------------------------------------------------


_ToolKey = tuple[str, str, str, str, str]  # name, server, the server's name for it, description, schema


@dataclass(frozen=True)
class _Published:
    version: int = 0
    tools: list[McpTool] = field(default_factory=list)


class McpManager:
    """The configured MCP servers' tools, as a ToolSource (gateway/tools/registry.py)."""

    name = "mcp"

    def __init__(self, *, base_dir: Path, log_dir: Path | None = None, data_dir: Path | None = None,
                 metrics: Metrics | None = None,
                 backoff_min_s: float | None = None, backoff_max_s: float | None = None,
                 ping_interval_s: float | None = None) -> None:
        self.base_dir = base_dir
        self.log_dir = log_dir
        self.data_dir = data_dir  # kept out of sandboxed servers' sight
        self.metrics = metrics
        self.backoff_min_s = BACKOFF_MIN_S if backoff_min_s is None else backoff_min_s
        self.backoff_max_s = BACKOFF_MAX_S if backoff_max_s is None else backoff_max_s
        self.ping_interval_s = PING_INTERVAL_S if ping_interval_s is None else ping_interval_s
        self._configs: dict[str, McpServerConfig] = {}
        self._servers: dict[str, _Server] = {}
        self._published = _Published()

    # -- ToolSource --

    @property
    def version(self) -> int:
        return self._published.version

    def tools(self) -> Sequence[McpTool]:
        return self._published.tools

    def publish(self) -> None:
        """Rebuild the tool list from what the servers offer now. The version is derived
        from the content, so the same tools give the same version whatever happened in
        between (a server that reconnects with the same tools leaves the registry's list,
        the very same object, untouched)."""
        taken: set[str] = set()
        listed: list[tuple[_ToolKey, RemoteTool]] = []
        for server in sorted(self._servers):
            for remote in self._servers[server].remote:
                name = fitted_name(server, remote.name)
                while name in taken:  # two fitted names met: the later one (in stable order) moves aside
                    name = fitted_name(server, name + "~")
                taken.add(name)
                listed.append(((name, server, remote.name, remote.description, remote.schema_json), remote))
        digest = hashlib.sha1(json.dumps([key for key, _ in listed], ensure_ascii=False).encode()).digest()
        version = int.from_bytes(digest[:8], "big")
        if version != self._published.version:
            tools = [McpTool(self, key[1], remote, key[0]) for key, remote in listed]
            self._published = _Published(version, tools)

    # -- lifecycle --

    async def apply(self, cfg: McpConfig) -> None:
        """Start, stop or restart the servers whose entries changed; others are untouched."""
        wanted = dict(cfg.servers)
        stale = [name for name, server in self._configs.items() if wanted.get(name) != server]
        await self._stop_servers([self._servers[n] for n in stale if n in self._servers])
        for name in stale:
            self._servers.pop(name, None)
            self._configs.pop(name, None)
            if name not in wanted and self.metrics is not None:
                _forget_label(self.metrics, name)
        for name, server_cfg in sorted(wanted.items()):
            if name in self._configs:
                continue
            self._configs[name] = server_cfg
            if not server_cfg.enabled:
                self.server_up(name, False)
                continue
            server = _Server(self, name, server_cfg)
            self._servers[name] = server
            server.start()
            log.info("MCP server starting", extra={"server": name, "transport": server.transport})
        self.publish()

    async def stop(self) -> None:
        """Stop every server within a bound: stdio processes are ended and reaped."""
        servers = list(self._servers.values())
        self._servers.clear()
        self._configs.clear()
        await self._stop_servers(servers)
        self.publish()

    async def _stop_servers(self, servers: list[_Server]) -> None:
        tasks = [s.task for s in servers if s.task is not None]
        for server in servers:
            server.request_stop()
        if not tasks:
            return
        _done, pending = await asyncio.wait(tasks, timeout=STOP_GRACE_S)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=STOP_KILL_S)
            log.warning("MCP servers did not stop in time and were cancelled",
                        extra={"servers": [t.get_name() for t in pending]})

    # -- state --

    def statuses(self) -> list[ServerStatus]:
        out: list[ServerStatus] = []
        for name, server_cfg in sorted(self._configs.items()):
            server = self._servers.get(name)
            if server is None:
                out.append(ServerStatus(name, "disabled", transport="stdio" if server_cfg.command else "http"))
            else:
                out.append(server.status())
        return out

    def server_up(self, name: str, up: bool) -> None:
        if self.metrics is not None:
            self.metrics.mcp_server_up.labels(name).set(1 if up else 0)

    def server_failed(self, server: _Server, reason: str, retry_in_s: float) -> None:
        if self.metrics is not None:
            self.metrics.mcp_restarts.labels(server.name).inc()
        log.warning("MCP server is down; reconnecting with backoff",
                    extra={"server": server.name, "error": reason, "retry_in_s": retry_in_s})

    def call_timeout(self, server: str) -> float | None:
        """How long a call to `server` may take at most (None: not configured)."""
        cfg = self._configs.get(server)
        return cfg.timeout_s + CALL_GUARD_S if cfg is not None else None

    async def call(self, server: str, remote: str, shown: str, args: dict[str, Any]) -> ToolOutput:
        runner = self._servers.get(server)
        if runner is None:
            raise ToolError(f"the MCP server {server} is not running (removed or disabled in config.json)")
        return await runner.call(remote, shown, args)


def _forget_label(metrics: Metrics, server: str) -> None:
    for metric in (metrics.mcp_server_up, metrics.mcp_restarts):
        try:
            metric.remove(server)
        except KeyError:
            pass
