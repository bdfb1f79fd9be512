"""The sandboxed `exec` tool (SPEC §5.7), run for real under bubblewrap.

Written the way an attacker would try: read the gateway's config, database, other scopes
and environment; reach the network; write outside the workspace; exhaust processes, memory,
disk space in RAM and time; outlive the call. Where a test shows that something is out of
reach, it also shows (outside the sandbox) that the thing is there, so a wrong path cannot
make it pass."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from context.outside import unfence
from gateway.config.load import ConfigError, parse_config
from gateway.config.schema import Config
from gateway.tools import sandbox
from gateway.tools.base import ToolContext, ToolError
from gateway.tools.exec import Exec, ExecTools
from gateway.tools.read_file import ReadFile
from gateway.turns.sessions import TIMEOUT_REPLY
from gateway.types import Inbound
from tests.conftest import GatewayFactory, chat
from tests.fakes.openai_server import FakeModel, Reply, ScriptedCall

SECRET = "s3cr3t-7c41e9a2"  # planted wherever the sandbox must not reach

# The sandbox is under test here, not approvals (tests/test_approvals.py): exec runs without asking.
NO_ASKING = {"tools": {}}


def exec_config(**settings: Any) -> Config:
    return parse_config({"tools": {"exec": {"enabled": True, **settings}}}, environ={})


async def sh(workspace: Path, command: str, *, stdin: str | None = None, **settings: Any) -> str:
    """The tool's result for `command`, run in `workspace` with these tools.exec settings."""
    cfg = exec_config(**settings)
    ctx = ToolContext(session_key="web:dm:t", scope="web:t", workspace=workspace, config=cfg)
    args: dict[str, Any] = {"command": command}
    if stdin is not None:
        args["stdin"] = stdin
    return (await Exec(lambda: cfg).run(args, ctx)).text


def section(text: str, name: str) -> str:
    """One stream of a result: what follows its `--- name ---` line, up to the next one."""
    match = re.search(rf"^--- {name}[^\n]*---\n(.*?)(?=^--- |^\(sandbox limits|\Z)", text, re.S | re.M)
    return match.group(1).removesuffix("\n") if match else ""


def marker() -> str:
    """A number no other process on the machine has on its command line."""
    return str(random.randint(10**11, 10**12))


def processes_with(mark: str) -> list[int]:
    """Processes whose command line holds `mark` (the host sees every sandbox's processes)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = Path(entry.path, "cmdline").read_bytes()
            except OSError:
                continue
            if mark.encode() in cmdline:
                found.append(int(entry.name))
    return found


def processes_in(directory: Path) -> list[int]:
    """Processes whose working directory is `directory`."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(f"{entry.path}/cwd") == str(directory):
                    found.append(int(entry.name))
    return found


async def until(predicate: Callable[[], Any], timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def host_sh(script: str) -> str:
    """The same script run outside the sandbox: what is there to be found."""
    proc = await asyncio.create_subprocess_exec("/bin/sh", "-c", script, stdout=asyncio.subprocess.PIPE)
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    return out.decode()


def tool_results(request: dict[str, Any]) -> list[str]:
    return [unfence(str(m["content"])) for m in request["messages"] if m["role"] == "tool"]


def tool_names(request: dict[str, Any]) -> list[str]:
    return [t["function"]["name"] for t in request.get("tools", [])]


# -- what a command sees -----------------------------------------------------------------------


async def test_a_command_runs_in_its_workspace_with_nothing_of_the_gateways_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_FAKE_SECRET", SECRET)  # in the gateway's environment now
    text = await sh(tmp_path, "pwd; id -un; env | sort; ls /etc; echo oops >&2; exit 3")
    assert text.startswith("exit code 3\n--- stdout ---\n/workspace\nsandbox\n")
    env = [line for line in section(text, "stdout").splitlines() if "=" in line]
    assert env == ["HOME=/tmp", "LANG=C.UTF-8", "LOGNAME=sandbox", f"PATH={sandbox.SANDBOX_PATH}",
                   "PWD=/workspace", "USER=sandbox"]
    # /etc holds what programs need, not the host's /etc (no shadow, no hosts, no ssl/private).
    listed = section(text, "stdout").split("USER=sandbox\n", 1)[1].split()
    assert listed == ["alternatives", "group", "ld.so.cache", "localtime", "passwd"], listed
    assert section(text, "stderr") == "oops"
    assert SECRET not in text and "(sandbox limits: 512 MB of memory per process" in text
    assert await sh(tmp_path, "wc -c; cat >> got.txt", stdin="hello ünï") == "exit code 0\n--- stdout ---\n11"
    assert (tmp_path / "got.txt").read_text() == ""  # wc read it all
    assert await sh(tmp_path, "true") == "exit code 0\n(no output)"


async def test_the_gateways_files_are_out_of_reach(make_gateway: GatewayFactory, fake_model: FakeModel,
                                                  tmp_path: Path) -> None:
    gw = await make_gateway(system_prompt=f"You help. {SECRET}", tools={"exec": {"enabled": True}}, approvals=NO_ASKING)
    assert gw.services is not None
    assert await chat(gw, "bob", f"remember {SECRET}") == f"echo: remember {SECRET}"  # into the database
    bob = gw.workspace_for(Inbound(channel="web", chat_id="bob", user_id="bob", text="", event_id="x"))
    (bob / "notes.txt").write_text(f"bob's {SECRET}")
    ann = gw.workspace_for(Inbound(channel="web", chat_id="ann", user_id="ann", text="", event_id="y"))
    data_dir = gw.services.data_dir.resolve()
    targets = [tmp_path / "config.json", data_dir / "gateway.sqlite3", bob / "notes.txt",
               f"/proc/{os.getpid()}/environ", f"/proc/{os.getpid()}/cmdline", "/etc/shadow", "/etc/gshadow"]
    probe = "".join(f'if cat "{t}" >/dev/null 2>&1; then echo "READ {t}"; else echo "DENIED {t}"; fi\n'
                    for t in targets)
    # Outside: everything is there (the paths are right).
    outside = await host_sh(probe)
    for target in targets[:5]:
        assert f"READ {target}" in outside
    probe += f'ls "{data_dir}" "{bob}" "{ann}" /workspace/.. 2>&1\n'
    probe += f"grep -rlaF {SECRET} / --exclude-dir=proc --exclude-dir=usr --exclude-dir=dev 2>/dev/null\n"
    probe += "echo searched\n"
    ctx = ToolContext(session_key="web:dm:ann", scope="web:ann", workspace=ann, config=gw.cfg)
    inside = (await Exec(lambda: gw.cfg).run({"command": probe}, ctx)).text
    for target in targets:
        assert f"DENIED {target}" in inside, inside
    assert "READ" not in inside and SECRET not in inside
    # Only the sandbox's own root: no data dir, no other scope; the search found nothing.
    assert "/workspace/..:\nbin\ndev\netc\nlib\nlib64\nproc\nsbin\ntmp\nusr\nworkspace\n" in inside
    assert section(inside, "stdout").endswith("searched")
    assert inside.count("No such file or directory") >= 3


async def test_the_network_is_off_unless_tools_exec_network(tmp_path: Path, fake_model: FakeModel) -> None:
    port = int(fake_model.base_url.rsplit(":", 1)[1].split("/")[0])
    client = (
        "import socket\n"
        "for host, port in (('127.0.0.1', PORT), ('192.0.2.1', 80)):\n"
        "    try:\n"
        "        socket.create_connection((host, port), timeout=3).close(); print(host, 'connected')\n"
        "    except OSError as err: print(host, 'refused:', err.strerror)\n"
        "    if NETWORK: break  # the outside world is not the test's to call\n"
        "import os; path = '/etc/resolv.conf'\n"
        "print(open(path).read().strip() if os.path.exists(path) else 'no resolver')\n"
    ).replace("PORT", str(port))
    off = await sh(tmp_path, f"python3 -c \"{client.replace('NETWORK', 'False')}\"")
    assert section(off, "stdout") == ("127.0.0.1 refused: Connection refused\n"
                                      "192.0.2.1 refused: Network is unreachable\nno resolver"), off
    # On, the network is the sandbox's own: the host's loopback (the model's port here) is
    # not its loopback (tests/test_sandbox.py tries every way there).
    on = await sh(tmp_path, f"python3 -c \"{client.replace('NETWORK', 'True')}\"", network=True)
    assert section(on, "stdout").startswith("127.0.0.1 refused: Connection refused\nnameserver "), on


async def test_nothing_outside_the_workspace_can_be_written(tmp_path: Path) -> None:
    workspace, data = tmp_path / "ws", tmp_path / "data"
    data.mkdir()
    mark = marker()
    attempts = ["/usr/x", "/etc/x", "/x", "/bin/x", "/dev/x", "/proc/x", f"{data}/x", f"{tmp_path}/x"]
    script = "".join(f'if touch "{p}" 2>/dev/null; then echo "WROTE {p}"; else echo "REFUSED {p}"; fi\n'
                     for p in attempts)
    # A kernel setting, written back as it is (harmless even if it got through).
    script += ('v=$(cat /proc/sys/kernel/printk_ratelimit); if echo "$v" > /proc/sys/kernel/printk_ratelimit; '
               'then echo "WROTE sysctl"; else echo "REFUSED sysctl"; fi\n')
    script += f"echo private > /tmp/{mark}; cat /tmp/{mark}; echo made > made.txt; ln -s {tmp_path}/secret.txt leak\n"
    (tmp_path / "secret.txt").write_text(SECRET)
    text = await sh(workspace, script)
    for path in attempts:
        assert f"REFUSED {path}" in text, text
    assert "REFUSED sysctl" in text and "Read-only file system" in text
    assert "WROTE" not in text and section(text, "stdout").endswith("\nprivate")
    assert not (data / "x").exists() and not (tmp_path / "x").exists() and not Path(f"/tmp/{mark}").exists()
    # What it made in the workspace is there for read_file; a symlink it planted leads nowhere.
    ctx = ToolContext(session_key="web:dm:t", scope="web:t", workspace=workspace, config=exec_config())
    assert (await ReadFile().run({"path": "made.txt"}, ctx)).text == "made\n"
    with pytest.raises(ToolError, match="outside the workspace"):
        await ReadFile().run({"path": "leak"}, ctx)
    # The workspace is the gateway's user's, and private.
    assert (workspace / "made.txt").stat().st_uid == os.getuid()
    assert stat.S_IMODE(workspace.stat().st_mode) == 0o700


async def test_what_a_command_leaves_behind_cannot_hurt_the_gateway(make_gateway: GatewayFactory,
                                                                   fake_model: FakeModel) -> None:
    # A FIFO where the gateway later reads a file (an image in files/, MEMORY.md) would hold
    # the reading thread; a set-user-ID file is owned, outside, by the gateway's user (root here).
    gw = await make_gateway(tools={"exec": {"enabled": True}}, approvals=NO_ASKING, limits={"turn_timeout_s": 10})
    plant = ("mkdir -p files && mkfifo MEMORY.md files/photo.jpg && cp /bin/true suid && chmod 6755 suid && "
             "python3 -c \"import socket; socket.socket(socket.AF_UNIX).bind('sock')\" && ls -l . files")
    fake_model.tool_call("exec", {"command": plant})
    fake_model.reply("planted")
    assert await chat(gw, "mallory", "plant") == "planted"
    listing = tool_results(fake_model.requests[-1])[-1]
    assert listing.count("prw-") == 2 and "-rwsr-sr-x" in listing and "srwx" in listing, listing  # made inside
    workspace = gw.workspace_for(Inbound(channel="web", chat_id="mallory", user_id="mallory", text="", event_id="m"))
    for gone in ("MEMORY.md", "files/photo.jpg", "sock"):
        assert not os.path.lexists(workspace / gone), gone
    assert stat.S_IMODE((workspace / "suid").stat().st_mode) == 0o755
    assert await chat(gw, "mallory", "are you there?") == "echo: are you there?"


# -- limits ------------------------------------------------------------------------------------


async def test_the_limits_are_in_force_inside(tmp_path: Path) -> None:
    text = await sh(tmp_path, "cat /proc/self/limits; cat /proc/self/oom_score_adj; chrt -p $$", memory_mb=64)
    limits = {line[:26].strip(): line[26:].split()[:2] for line in section(text, "stdout").splitlines()[1:17]}
    assert limits["Max processes"] == ["256", "256"]
    assert limits["Max address space"] == [str(64 << 20)] * 2
    assert limits["Max file size"] == [str(1 << 30)] * 2
    assert limits["Max core file size"] == ["0", "0"]
    assert limits["Max nice priority"] == ["0", "0"]
    # The OOM killer's first pick; it runs when nothing else wants the CPU.
    tail = section(text, "stdout").splitlines()[-3:]
    assert tail[0] == "1000" and re.fullmatch(r"pid \d+'s current scheduling policy: SCHED_IDLE", tail[1]), tail
    # A process may lower its limits and its place in the queue, never raise them.
    raised = await sh(tmp_path, "prlimit --pid $$ --nproc=100000:100000 && echo raised; chrt -o -p 0 $$ && echo back")
    assert "raised" not in raised and "back" not in raised and raised.count("Operation not permitted") == 2, raised


async def test_a_memory_hog_fails_alone(tmp_path: Path) -> None:
    # 2 GB in one allocation; then filling /tmp and /dev/shm, which live in RAM.
    text = await sh(tmp_path, "python3 -c 'b = bytearray(2 * 1024**3)'")
    assert text.startswith("exit code 1\n--- stderr ---\n") and "MemoryError" in text
    filled = await sh(tmp_path, "head -c 100M /dev/zero > /tmp/f; head -c 100M /dev/zero > /dev/shm/f; "
                                "du -sm /tmp/f /dev/shm/f", memory_mb=64)
    assert filled.count("No space left on device") == 2, filled
    sizes = [int(line.split()[0]) for line in section(filled, "stdout").splitlines()]
    assert sizes == [64, 64]


async def test_a_fork_bomb_is_killed_and_the_gateway_keeps_answering(make_gateway: GatewayFactory,
                                                                     fake_model: FakeModel) -> None:
    gw = await make_gateway(tools={"exec": {"enabled": True, "timeout_s": 5}}, approvals=NO_ASKING)
    mark = marker()
    bomb = f"b() {{ b | b & }}; b; sleep {mark}"

    def respond(body: dict[str, Any]) -> Reply:
        last = body["messages"][-1]
        if last["role"] == "tool":
            return Reply(text="the bomb is gone")
        if "bomb" in str(last["content"]):
            return Reply(tool_calls=(ScriptedCall("exec", json.dumps({"command": bomb}), "call_bomb"),))
        return Reply(text=f"still here: {last['content']}")

    fake_model.respond_with(respond)
    bombing = asyncio.ensure_future(chat(gw, "mallory", "bomb"))
    calm = [await chat(gw, "carol", f"hello {i}") for i in range(3)]
    assert calm == [f"still here: hello {i}" for i in range(3)]
    assert await asyncio.wait_for(bombing, 60) == "the bomb is gone"
    (result,) = [r for req in fake_model.requests for r in tool_results(req)]
    # The watchdog kills it once it sees more than the cap; when the kernel's cap keeps it
    # below (and it gets little CPU: SCHED_IDLE), timeout_s ends it.
    assert result.startswith((f"killed: more than {sandbox.MAX_TASKS} processes and threads in the sandbox",
                              "timed out after 5 s (tools.exec.timeout_s)")), result
    assert processes_with(mark) == []
    assert await chat(gw, "carol", "after") == "still here: after"


async def test_the_kernel_caps_the_processes_without_the_watchdog(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # RLIMIT_NPROC in the sandbox's user namespace; for a gateway run as root (uid 0 is
    # exempt from it), the PID namespace's own pid_max. The watchdog is blinded here.
    if os.geteuid() == 0 and not sandbox._pid_max_per_namespace():
        pytest.skip("as root on Linux before 6.14 only the watchdog caps the processes")
    monkeypatch.setattr(sandbox, "_tasks_in", lambda init_pid, cap: 0)
    forker = ("import os, time\n"
              "made = 0\n"
              "for _ in range(400):\n"
              "    try:\n"
              "        pid = os.fork()\n"
              "    except OSError as err:\n"
              "        print('refused:', err.strerror)\n"
              "        break\n"
              "    if pid == 0:\n"
              "        time.sleep(30)\n"
              "        os._exit(0)\n"
              "    made += 1\n"
              "print(made, sum(name.isdigit() for name in os.listdir('/proc')))\n")
    (tmp_path / "forker.py").write_text(forker)
    text = await sh(tmp_path, "python3 forker.py", timeout_s=20)
    lines = section(text, "stdout").splitlines()
    assert len(lines) == 2, text
    refused, counts = lines
    made, present = map(int, counts.split())
    assert refused == "refused: Resource temporarily unavailable", text
    assert 200 < made < present <= sandbox.PID_MAX_MIN, text


async def test_a_command_past_timeout_s_is_killed_with_everything_it_started(tmp_path: Path) -> None:
    mark = marker()
    call = asyncio.ensure_future(sh(tmp_path, f"sleep {mark} & (setsid sleep {mark} &); "
                                              f"nohup sleep {mark} >/dev/null 2>&1 & echo started; sleep {mark}",
                                    timeout_s=3))
    # bwrap (outside, and the namespace's first process), sh and four sleeps carry the mark.
    await until(lambda: len(processes_with(mark)) >= 7 or call.done(), what="the command to start")
    text = await asyncio.wait_for(call, 30)
    assert text.startswith("timed out after 3 s (tools.exec.timeout_s): the command and everything it "
                           "started were killed\n--- stdout ---\nstarted\n"), text
    assert processes_with(mark) == []  # killed before the result came


async def test_a_cancelled_call_leaves_no_process_behind(tmp_path: Path) -> None:
    mark = marker()
    call = asyncio.ensure_future(sh(tmp_path, f"sleep {mark} & (setsid sleep {mark} &); sleep {mark}"))
    # bwrap (outside, and the namespace's first process), sh and three sleeps carry the mark.
    await until(lambda: len(processes_with(mark)) >= 6, what="the command to start")
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    # Killed before the cancellation returns: nothing is left to reap or kill.
    assert processes_with(mark) == []


async def test_the_turn_timeout_kills_the_sandbox(make_gateway: GatewayFactory, fake_model: FakeModel) -> None:
    gw = await make_gateway(tools={"exec": {"enabled": True, "timeout_s": 300}}, approvals=NO_ASKING,
                            limits={"turn_timeout_s": 2})
    mark = marker()
    fake_model.tool_call("exec", {"command": f"sleep {mark} & sleep {mark}"})
    assert await chat(gw, "ann", "wait a long time") == TIMEOUT_REPLY
    assert processes_with(mark) == []


# -- through the agent ---------------------------------------------------------------------------


async def test_e2e_the_model_runs_a_command_and_reads_what_it_wrote(make_gateway: GatewayFactory,
                                                                   fake_model: FakeModel) -> None:
    gw = await make_gateway(tools={"exec": {"enabled": True}}, approvals=NO_ASKING)
    assert gw.services is not None
    command = "seq 1 30000 > numbers.txt; wc -l numbers.txt; cat numbers.txt"  # 168,894 characters
    fake_model.tool_call("exec", {"command": command})
    fake_model.reply("counted")
    assert await chat(gw, "ann", "count to 30000") == "counted"
    first, second = fake_model.requests[-2:]
    assert "exec" in tool_names(first)
    (result,) = tool_results(second)
    assert result.startswith("exit code 0\n--- stdout ---\n30000 numbers.txt\n1\n2\n3\n")
    # Stage 1 cut it (§4.1): the whole result is saved, and the excerpt says where.
    notice = re.search(r"The full output is saved as (tool_results/[^:]+\.txt)", result)
    assert notice and len(result) < 52_000, result[-400:]
    ann = gw.workspace_for(Inbound(channel="web", chat_id="ann", user_id="ann", text="", event_id="z"))
    saved = (ann / notice.group(1)).read_text()
    assert saved.endswith("29999\n30000") and len(saved) > 160_000
    fake_model.tool_call("read_file", {"path": "numbers.txt", "start_line": 29999})
    fake_model.reply("read")
    await chat(gw, "ann", "read the end")
    assert tool_results(fake_model.requests[-1])[-1].endswith("29999\n30000\n")


async def test_exec_is_off_by_default_and_tools_says_why(make_gateway: GatewayFactory, fake_model: FakeModel) -> None:
    gw = await make_gateway(admins=["web:boss"])
    await chat(gw, "ann", "hi")
    assert "exec" not in tool_names(fake_model.requests[-1])
    assert "exec: not offered: tools.exec.enabled is false" in await chat(gw, "ann", "/tools")
    refused = await chat(gw, "boss", "/config tools.exec.enabled true")
    assert "not in chat" in refused and gw.cfg.tools.exec.enabled is False


async def test_without_a_working_bwrap_exec_is_not_offered(make_gateway: GatewayFactory, fake_model: FakeModel,
                                                         tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    gw = await make_gateway(tools={"exec": {"enabled": True}}, approvals=NO_ASKING)
    await chat(gw, "ann", "hi")
    assert "exec" not in tool_names(fake_model.requests[-1])
    assert "exec: not offered: bwrap (bubblewrap) is not installed" in await chat(gw, "ann", "/tools")
    ctx = ToolContext(session_key="k", scope="s", workspace=tmp_path / "ws", config=gw.cfg)
    with pytest.raises(ToolError, match=r"exec cannot run here: bwrap \(bubblewrap\) is not installed"):
        await Exec(lambda: gw.cfg).run({"command": "true"}, ctx)
    # A bwrap that cannot make namespaces here (a container without user namespaces, say).
    broken = tmp_path / "broken-bin"
    broken.mkdir()
    (broken / "bwrap").write_text("#!/bin/sh\necho 'bwrap: No permissions to create a new namespace' >&2\nexit 1\n")
    (broken / "bwrap").chmod(0o755)
    monkeypatch.setenv("PATH", str(broken))
    source = ExecTools(lambda: gw.cfg)
    await source.prepare()
    assert source.tools() == [] and source.state == "unavailable"
    assert source.detail == "not offered: bwrap cannot make a sandbox here: No permissions to create a new namespace"


async def test_the_tool_follows_the_config_snapshot(tmp_path: Path) -> None:
    cfg = {"now": parse_config({}, environ={})}
    source = ExecTools(lambda: cfg["now"])
    assert source.tools() == [] and source.state == "off"
    version = source.version
    cfg["now"] = exec_config()
    assert source.tools() == [] and source.state == "checking"  # not probed yet
    await source.prepare()
    assert [t.name for t in source.tools()] == ["exec"] and source.detail is None
    assert source.version != version
    on = source.version
    cfg["now"] = exec_config(timeout_s=5)
    assert source.version == on  # other settings are read when it runs
    assert source.tools()[0].timeout_s == 5 + 5  # type: ignore[attr-defined]


def test_config_keys_defaults_and_ranges() -> None:
    cfg = parse_config({}, environ={}).tools.exec
    assert (cfg.enabled, cfg.network, cfg.timeout_s, cfg.memory_mb) == (False, False, 30, 512)
    for bad in ({"timeout_s": 0}, {"timeout_s": 601}, {"memory_mb": 32}, {"memory_mb": 100_000}, {"shell": "bash"}):
        with pytest.raises(ConfigError):
            parse_config({"tools": {"exec": bad}}, environ={})


def test_the_command_line() -> None:
    """The bwrap command line, as the README's section describes it."""
    tools = sandbox.Tools("/usr/bin/bwrap", "/usr/bin/prlimit", "/usr/bin/choom", "/usr/bin/chrt")
    box = sandbox.Box(Path("/data/scopes/x"), setenv={"PATH": "/usr/bin"}, idle=True)
    line = sandbox.command_line(tools, box, ["/bin/sh", "-c", "ls"], info_fd=5, identity_fds=(6, 7))
    text = " ".join(line)
    assert line[:4] == ["/usr/bin/bwrap", "--unshare-all", "--unshare-user", "--disable-userns"]
    assert "--share-net" not in line and "--die-with-parent --new-session --clearenv --setenv PATH /usr/bin" in text
    assert "--ro-bind /usr /usr" in text and "--ro-bind-try /etc/ld.so.cache /etc/ld.so.cache" in text
    assert "/etc/resolv.conf" not in text and "--ro-bind-data 6 /etc/passwd --ro-bind-data 7 /etc/group" in text
    assert "--bind /data/scopes/x /workspace --chdir /workspace --remount-ro / --info-fd 5 --" in text
    assert "--proc /proc --ro-bind-try /proc/sys /proc/sys" in text
    assert text.endswith("-- /usr/bin/prlimit --nproc=256:256 --fsize=1073741824:1073741824 --core=0:0 --nice=0:0 "
                         "--as=536870912:536870912 -- /usr/bin/choom -n 1000 -- /usr/bin/chrt --idle 0 /bin/sh -c ls")
    networked = " ".join(sandbox.command_line(tools, sandbox.Box(Path("/w"), network=True), ["true"], resolv_fd=8,
                                              seccomp_fd=9))
    # The network is the sandbox's own (never --share-net), its resolver the network stack's.
    assert "--share-net" not in networked and "--ro-bind-data 8 /etc/resolv.conf" in networked
    assert "--ro-bind-try /etc/resolv.conf" not in networked and "--seccomp 9 --" in networked
    assert "/etc/ssl/private" not in networked and "--ro-bind-try /etc/ssl/certs /etc/ssl/certs" in networked


async def test_a_read_only_path_below_tmp_shows_inside(tmp_path: Path) -> None:
    # The private /tmp must not hide what is bound below it: a checkout or a virtualenv under
    # /tmp (as in CI) holds the Python a sandboxed MCP server runs.
    assert str(tmp_path).startswith("/tmp/")
    shared = tmp_path / "venv"
    shared.mkdir()
    (shared / "marker.txt").write_text("visible")
    workdir = tmp_path / "work"
    workdir.mkdir()
    bwrap = shutil.which("bwrap")
    assert bwrap is not None
    tools = sandbox.Tools(bwrap, "/usr/bin/prlimit", "/usr/bin/choom", "/usr/bin/chrt")
    box = sandbox.Box(workdir, inside=str(workdir), read_only=(shared,))
    line = sandbox.command_line(tools, box, ["/bin/cat", str(shared / "marker.txt")])
    proc = await asyncio.create_subprocess_exec(*line, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert (proc.returncode, out) == (0, b"visible"), err


# -- MCP servers in the sandbox ------------------------------------------------------------------

SNOOP = Path(__file__).resolve().parent / "mcp_servers" / "snoop_server.py"


def python_paths() -> list[str]:
    """What the test's Python needs to run in a sandbox: its virtualenv and its installation."""
    import sys
    return sorted({sys.prefix, sys.base_prefix} - {"/usr"})


def snoop_servers(tmp_path: Path) -> dict[str, Any]:
    """The same server twice: `open` as MCP servers run by default, `boxed` in the sandbox
    without network, in a directory of its own holding a copy of its script."""
    import sys
    home = tmp_path / "boxed-home"
    home.mkdir(exist_ok=True)
    (home / "snoop_server.py").write_bytes(SNOOP.read_bytes())
    env = {"SNOOP_TOKEN": "${SNOOP_TEST_TOKEN}"}
    return {"open": {"command": sys.executable, "args": [str(SNOOP)], "env": env},
            "boxed": {"command": sys.executable, "args": ["snoop_server.py"], "env": env, "cwd": str(home),
                      "sandbox": True, "network": False, "read_only_paths": python_paths()}}


async def mcp_ready(gw: Any, *servers: str) -> None:
    def ready() -> bool:
        return all(s.state == "ready" for s in gw.mcp.statuses() if s.name in servers)

    try:
        await until(ready, timeout=30)
    except AssertionError:
        raise AssertionError([s.describe() for s in gw.mcp.statuses()]) from None


async def call_tools(gw: Any, fake_model: FakeModel, calls: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """What the model saw after asking for these tool calls in one step."""
    fake_model.tool_calls(calls)
    fake_model.reply("done")
    assert await chat(gw, "ann", "snoop") == "done"
    return tool_results(fake_model.requests[-1])[-len(calls):]


async def test_a_sandboxed_mcp_server_works_and_cannot_read_the_gateways_files(
        make_gateway: GatewayFactory, fake_model: FakeModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SNOOP_TEST_TOKEN", "token-for-the-server")
    gw = await make_gateway(system_prompt=f"You help. {SECRET}", mcp={"servers": snoop_servers(tmp_path)})
    await mcp_ready(gw, "open", "boxed")
    port = int(fake_model.base_url.rsplit(":", 1)[1].split("/")[0])
    config = str(tmp_path / "config.json")
    results = await call_tools(gw, fake_model, [
        ("open__read", {"path": config}), ("boxed__read", {"path": config}),
        ("open__environ", {"pid": os.getpid()}), ("boxed__environ", {"pid": os.getpid()}),
        ("open__connect", {"port": port}), ("boxed__connect", {"port": port}),
        ("boxed__getenv", {"variable": "SNOOP_TOKEN"}), ("boxed__getenv", {"variable": "HOME"}),
        ("boxed__write", {"name": "out.txt", "text": "from inside"}),
    ])
    # Outside the sandbox a server reads the config and the gateway's environment, and
    # reaches the model's port; inside it does none of that, and still works.
    assert SECRET in results[0] and results[1] == "unreadable: No such file or directory"
    assert "PATH=" in results[2] and results[3] == "unreadable: No such file or directory"
    assert results[4] == "connected" and results[5] == "cannot connect: Connection refused"
    assert results[6] == "token-for-the-server"  # its env reaches it, as outside
    home = tmp_path / "boxed-home"
    assert results[7] == str(home) and results[8] == f"wrote {home}/out.txt"
    assert (home / "out.txt").read_text() == "from inside"
    assert processes_in(home)  # the server runs in its directory
    await gw.stop(timeout=5)
    assert processes_in(home) == []  # the sandbox went with the gateway


async def test_a_sandboxed_mcp_server_is_never_shown_the_config_or_data_dir(
        make_gateway: GatewayFactory, tmp_path: Path) -> None:
    import sys
    servers = {
        "here": {"command": sys.executable, "args": [str(SNOOP)], "cwd": ".", "sandbox": True},
        "data": {"command": sys.executable, "args": [str(SNOOP)], "sandbox": True, "read_only_paths": ["data"]},
        "root": {"command": sys.executable, "args": [str(SNOOP)], "sandbox": True, "read_only_paths": ["/"]},
    }
    gw = await make_gateway(mcp={"servers": servers})
    assert gw.mcp is not None
    await until(lambda: all(s.error for s in gw.mcp.statuses()), what="all three refused")
    errors = {s.name: s.error for s in gw.mcp.statuses()}
    assert errors["here"] == ("sandbox: cwd '.' holds the config file's directory; give the server a directory "
                              "of its own")
    assert errors["data"] == ("sandbox: read_only_paths entry 'data' would show the gateway's data dir; give the "
                              "server a directory of its own")
    assert errors["root"] is not None and errors["root"].startswith("sandbox: read_only_paths entry '/' holds")


def test_mcp_sandbox_keys_are_validated() -> None:
    def problem(server: dict[str, Any]) -> str:
        with pytest.raises(ConfigError) as caught:
            parse_config({"mcp": {"servers": {"s": server}}}, environ={})
        return str(caught.value)

    assert "only with sandbox: true" in problem({"command": "x", "network": False})
    assert "only with sandbox: true" in problem({"command": "x", "read_only_paths": ["/opt"]})
    assert "only for a command" in problem({"url": "https://mcp.example/", "sandbox": True})
    ok = parse_config({"mcp": {"servers": {"s": {"command": "x", "sandbox": True}}}}, environ={})
    assert ok.mcp.servers["s"].network is True  # on by default: most servers call an API


# -- the gateway's own process ---------------------------------------------------------------------


async def test_the_gateway_processs_environment_is_out_of_reach(tmp_path: Path, fake_model: FakeModel) -> None:
    """A real gateway process with a secret in its environment: `exec` and a sandboxed MCP
    server cannot read it from /proc; an MCP server outside the sandbox can."""
    from bench._procs import GATEWAY_ANNOUNCE, PYTHON, child_env, spawn
    from tests.conftest import write_config

    path = write_config(tmp_path, fake_model, tools={"exec": {"enabled": True}}, approvals=NO_ASKING,
                        mcp={"servers": snoop_servers(tmp_path)})
    env = child_env({"GATEWAY_TEST_SECRET": SECRET, "SNOOP_TEST_TOKEN": "t"})
    child = await spawn([PYTHON, "-m", "gateway", "run", "--config", str(path)], announce=GATEWAY_ANNOUNCE,
                        log_path=tmp_path / "gateway.log", env=env)
    try:
        base = child.url.rstrip("/")
        import aiohttp
        async with aiohttp.ClientSession(headers=child.web_headers) as http:
            deadline = time.monotonic() + 30
            while True:  # both MCP servers up
                async with http.get(base + "/readyz") as resp:
                    states = {k: v["state"] for k, v in (await resp.json()).get("mcp", {}).items()}
                if states == {"open": "up", "boxed": "up"}:  # /readyz shows states only
                    break
                assert time.monotonic() < deadline, states
                await asyncio.sleep(0.1)
            environ = f"/proc/{child.pid}/environ"
            assert SECRET in Path(environ).read_text(errors="replace")  # it is there to be stolen
            fake_model.tool_calls([("exec", {"command": f"cat {environ}; cat /proc/[0-9]*/environ"}),
                                   ("open__environ", {"pid": child.pid}), ("boxed__environ", {"pid": child.pid})])
            fake_model.reply("done")
            async with http.post(base + "/api/chat", json={"session": "eve", "text": "steal"}) as resp:
                assert resp.status == 200, await resp.text()
        ran, outside, boxed = tool_results(fake_model.requests[-1])
        assert f"cat: {environ}: No such file or directory" in ran
        assert SECRET not in ran and "HOME=/tmp\ufffdLANG=C.UTF-8" in ran  # all it finds: its own, clean
        assert f"GATEWAY_TEST_SECRET={SECRET}" in outside
        assert boxed == "unreadable: No such file or directory"
    finally:
        await child.stop(timeout=10)
