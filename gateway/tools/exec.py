"""`exec(command, stdin?)`: a shell command in the sandbox (SPEC §5.7).

The command runs with `/bin/sh -c` in gateway/tools/sandbox.py's sandbox: the scope's
workspace read-write at /workspace (its working directory), the system read-only, no
network unless `tools.exec.network` (then one of its own, never the host's loopback),
`timeout_s`, `memory_mb` and the workspace's `disk_mb` as limits. The result
(exit code, stdout, stderr) is text like any tool's, so a long one is cut by stage 1
(§4.1) and saved whole under tool_results/.

`ExecTools` offers the tool while `tools.exec.enabled` is true and the sandbox works here
(probed once); otherwise its `detail` says why, for `/tools` and the admin page.
"""

from __future__ import annotations

import asyncio
import logging
import re
import signal
from collections.abc import Callable, Sequence
from typing import Any

from gateway.config.schema import Config, ExecConfig
from gateway.tools import command_files, sandbox
from gateway.tools.base import Tool, ToolArgumentError, ToolContext, ToolError, ToolOutput, check_arguments
from gateway.workspace import make_private_dir

log = logging.getLogger("gateway.tools.exec")

MAX_COMMAND_CHARS = 100_000
MAX_STDIN_BYTES = 1_000_000
KILL_GRACE_S = 5.0  # past timeout_s: the sandbox's own "timed out" result comes before the agent's bound
STATUS_CHARS = 60
# What a workspace over its quota may still run: deleting, and nothing else.
DELETE_ONLY = re.compile(r"\s*rm(?:\s+[-\w./@%+=:,*?\[\]]+)+\s*")


def _text(data: bytes) -> str:
    # NUL cannot be stored in PostgreSQL text, and means nothing to the model.
    return data.decode("utf-8", "replace").replace("\x00", "\ufffd")


def _ending(outcome: sandbox.Outcome, cfg: ExecConfig) -> str:
    if outcome.timed_out:
        return (f"timed out after {cfg.timeout_s:g} s (tools.exec.timeout_s): the command and everything it "
                "started were killed")
    if outcome.killed_for is not None:
        return f"killed: {outcome.killed_for}"
    code = outcome.returncode
    if code is None:
        return "ended without an exit code"
    if code > 128:
        try:
            name = signal.Signals(code - 128).name
        except ValueError:
            return f"exit code {code}"
        if name == "SIGKILL":
            return f"exit code {code} (killed by SIGKILL: out of memory, or killed from inside the sandbox)"
        return f"exit code {code} (killed by {name})"
    return f"exit code {code}"


def result_text(outcome: sandbox.Outcome, cfg: ExecConfig) -> str:
    """What the model reads: how it ended, then each stream that said something."""
    parts = [_ending(outcome, cfg)]
    for name, captured in (("stdout", outcome.stdout), ("stderr", outcome.stderr)):
        if not captured.data and not captured.dropped:
            continue
        if captured.dropped:
            parts.append(f"--- {name} (the first {sandbox.OUTPUT_MAX_BYTES:,} bytes; {captured.dropped:,} more "
                         "bytes were dropped) ---")
        else:
            parts.append(f"--- {name} ---")
        parts.append(_text(bytes(captured.data)).removesuffix("\n"))  # the parts are joined by newlines
    if len(parts) == 1:
        parts.append("(no output)")
    if outcome.killed or outcome.returncode != 0:
        network = "network on" if cfg.network else "no network"
        parts.append(f"(sandbox limits: {cfg.memory_mb} MB of memory per process, {sandbox.MAX_TASKS} processes "
                     f"and threads, files up to {sandbox.FILE_MAX_BYTES >> 30} GB, the workspace {cfg.disk_mb:,} MB, "
                     f"/tmp {cfg.memory_mb} MB, {cfg.timeout_s:g} s; {network})")
    return "\n".join(parts)


def box_for(ctx: ToolContext, cfg: ExecConfig, *, file_bytes: int = sandbox.FILE_MAX_BYTES,
            quota_bytes: int | None = None) -> sandbox.Box:
    return sandbox.Box(ctx.workspace, network=cfg.network,
                       limits=sandbox.Limits(memory_mb=cfg.memory_mb, tmp_mb=cfg.memory_mb, file_bytes=file_bytes),
                       setenv=sandbox.exec_environment(), idle=True,
                       disk=sandbox.Disk(cfg.disk_mb << 20 if quota_bytes is None else quota_bytes))


def _over_quota(held: sandbox.Usage, cfg: ExecConfig, top: list[tuple[str, int]]) -> str:
    if held.entries > sandbox.DISK_MAX_ENTRIES:
        what = f"holds more than {sandbox.DISK_MAX_ENTRIES:,} files and directories"
    else:
        what = f"uses {held.used_bytes / (1 << 20):,.1f} MB of its {cfg.disk_mb:,} MB (tools.exec.disk_mb)"
    listed = ", ".join(f"{name} ({size / (1 << 20):,.1f} MB)" for name, size in top) or "nothing listable"
    return (f"the workspace {what}: no command runs in it until files are deleted. Largest: {listed}. Until then "
            "exec runs a command that only deletes, `rm` and its arguments alone (e.g. `rm -rf build old.tar`)")


async def _disk_box(ctx: ToolContext, cfg: ExecConfig, command: str) -> sandbox.Box:
    """The sandbox for a command in this workspace, as far as its disk allows (ToolError
    when nothing may run: the disk is down to its reserve, or the workspace is over its quota
    and the command does more than delete)."""
    quota = cfg.disk_mb << 20

    def measure() -> tuple[int, sandbox.Usage, list[tuple[str, int]]]:
        room = sandbox.disk_room(ctx.workspace)
        held = sandbox.usage(ctx.workspace)
        over = held.used_bytes >= quota or held.entries > sandbox.DISK_MAX_ENTRIES
        return room, held, sandbox.largest(ctx.workspace) if over else []

    try:
        room, held, top = await asyncio.to_thread(measure)
    except sandbox.SandboxError as err:
        raise ToolError(str(err)) from None
    if held.used_bytes < quota and held.entries <= sandbox.DISK_MAX_ENTRIES:
        return box_for(ctx, cfg, file_bytes=min(room, quota - held.used_bytes))
    if DELETE_ONLY.fullmatch(command) is None:
        raise ToolError(_over_quota(held, cfg, top))
    # Deleting: no file may grow, nor the workspace past what it holds now.
    return box_for(ctx, cfg, file_bytes=0, quota_bytes=max(quota, held.used_bytes))


class Exec:
    name = "exec"
    description = (
        "Run a shell command (/bin/sh -c) in a sandbox. The working directory is /workspace: your "
        "workspace, read-write (the files read_file reads). The system's programs are there read-only; "
        "/tmp is private and empty each time; nothing else of the machine is visible. Each call has a "
        "time and memory limit and no network unless the operator allowed it. Returns the exit code, "
        "stdout and stderr."
    )
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {
            "command": {"type": "string", "description": "The command line, run with /bin/sh -c in /workspace."},
            "stdin": {"type": "string", "description": "Text given to the command on its standard input."},
        },
        "required": ["command"],
        "additionalProperties": False,
    }

    def __init__(self, config: Callable[[], Config]) -> None:
        self._config = config

    @property
    def timeout_s(self) -> float:
        """The agent's bound for one call: the command's own limit and time to kill it."""
        return self._config().tools.exec.timeout_s + KILL_GRACE_S

    def status(self, args: dict[str, Any]) -> str:
        command = args.get("command")
        if not isinstance(command, str) or not command.strip():
            return "running a command…"
        line = " ".join(command.split())
        shown = line if len(line) <= STATUS_CHARS else line[:STATUS_CHARS - 1] + "…"
        return f"running `{shown}`…"

    def files_named(self, args: dict[str, Any]) -> list[str]:
        """What the command names in the workspace, for its approval card (a script it runs)."""
        command = args.get("command")
        return command_files.files_named(command) if isinstance(command, str) else []

    async def run(self, args: dict[str, Any], ctx: ToolContext) -> ToolOutput:
        check_arguments(self.parameters, args)
        command: str = args["command"]
        if not command.strip():
            raise ToolArgumentError("command is empty")
        if len(command) > MAX_COMMAND_CHARS:
            raise ToolArgumentError(f"command is longer than {MAX_COMMAND_CHARS:,} characters; write a script "
                                    "to a file in the workspace and run that")
        if "\x00" in command:
            raise ToolArgumentError("command contains a NUL character")
        text_in = args.get("stdin")
        stdin = text_in.encode("utf-8", "surrogatepass") if isinstance(text_in, str) else None
        if stdin is not None and len(stdin) > MAX_STDIN_BYTES:
            raise ToolArgumentError(f"stdin is larger than {MAX_STDIN_BYTES:,} bytes; write it to a file in the "
                                    "workspace instead")
        cfg = ctx.config.tools.exec
        if not cfg.enabled:
            raise ToolError("exec is switched off (tools.exec.enabled is false)")
        found = await sandbox.availability()
        refused = found.refusal(cfg.network)
        if refused is not None:
            raise ToolError(f"exec cannot run here: {refused}" + (" (tools.exec.network is true)" if found.tools
                                                                  else ""))
        assert found.tools is not None
        await asyncio.to_thread(make_private_dir, ctx.workspace)
        box = await _disk_box(ctx, cfg, command)
        try:
            outcome = await sandbox.run(found.tools, box, ["/bin/sh", "-c", command], stdin=stdin,
                                        timeout_s=cfg.timeout_s)
        except sandbox.SandboxError as err:
            raise ToolError(str(err)) from None
        finally:
            # Also when the call was cancelled: the sandbox is dead by now, its files stay.
            await asyncio.shield(asyncio.to_thread(sandbox.tidy, ctx.workspace))
        return ToolOutput(result_text(outcome, cfg))


class ExecTools:
    """`exec` as a ToolSource that follows the running config and the sandbox's probe."""

    name = "exec"

    def __init__(self, config: Callable[[], Config]) -> None:
        self._config = config
        self._tool = Exec(config)
        self._found: sandbox.Availability | None = None
        self._shape: tuple[bool, bool] | None = None
        self._version = 0

    async def prepare(self) -> None:
        """Probe the sandbox once it is wanted (at start, and when a reload turns exec on)."""
        if self._config().tools.exec.enabled and (self._found is None or self._found.tools is None):
            try:
                self._found = await sandbox.availability()
            except Exception as err:  # whatever the machine does, the gateway starts without exec
                log.exception("cannot check the sandbox")
                self._found = sandbox.Availability(None, f"the sandbox check failed: {type(err).__name__}: {err}")

    def _offered(self) -> bool:
        cfg = self._config().tools.exec
        return cfg.enabled and self._found is not None and self._found.refusal(cfg.network) is None

    @property
    def version(self) -> int:
        shape = (self._config().tools.exec.enabled, self._offered())
        if shape != self._shape:
            self._shape = shape
            self._version += 1
        return self._version

    def tools(self) -> Sequence[Tool]:
        return [self._tool] if self._offered() else []

    @property
    def state(self) -> str:
        if not self._config().tools.exec.enabled:
            return "off"
        if self._found is None:
            return "checking"
        return "ready" if self._found.refusal(self._config().tools.exec.network) is None else "unavailable"

    @property
    def detail(self) -> str | None:
        """Why exec is not offered (None while it is)."""
        state = self.state
        if state == "off":
            return "not offered: tools.exec.enabled is false"
        if state == "checking":
            return "not offered yet: checking that the sandbox works"
        if state == "unavailable":
            assert self._found is not None
            network = self._config().tools.exec.network
            why = self._found.refusal(network)
            return f"not offered: {why}" + (" (tools.exec.network is true)" if network and self._found.tools else "")
        return None
