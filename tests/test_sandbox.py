"""The sandbox (gateway/tools/sandbox.py) attacked the ways issue 31's red team did, for
real: from a sandbox with the network on, the gateway's own API and every other service on
the host's loopback; the kernel's keyrings between two sandboxes; a workspace filling the
disk; a sandboxed MCP server forking past the cap; the workspace's host path in /proc.
Each attack is run where it succeeded (as root, and as an ordinary user where the machine
lets one make sandboxes), and each test also shows the target is there to be hit."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web

from gateway.config.load import ConfigError
from gateway.tools import sandbox, seccomp, usernet
from gateway.tools.base import ToolContext, ToolError
from tests.conftest import GatewayFactory, chat, web_client
from tests.fakes.openai_server import FakeModel
from tests.test_exec import (
    NO_ASKING,
    SECRET,
    call_tools,
    exec_config,
    host_sh,
    mcp_ready,
    python_paths,
    section,
    sh,
    snoop_servers,
    tool_results,
    until,
)

ROOT = Path(__file__).resolve().parent.parent
NOBODY = 65534
STACKS = [kind for kind in ("pasta", "slirp4netns") if shutil.which(kind, path=usernet.SEARCH_PATH)]


def host_address(family: int) -> str | None:
    """An address of this machine that is not a loopback one (the route to the outside's source)."""
    probe = "192.0.2.1" if family == socket.AF_INET else "2001:db8::1"
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((probe, 9))  # no packet is sent: this only picks the route
            address = str(s.getsockname()[0])
    except OSError:
        return None
    return None if address.startswith(("127.", "::1")) else address


def default_gateway6() -> str | None:
    found = re.search(r"default via (\S+)", subprocess.run(["ip", "-6", "route", "show", "default"],
                                                           capture_output=True, text=True).stdout)
    return found.group(1) if found else None


# -- running a sandbox in a child process, as root or as nobody -------------------------------

CHILD = r"""
import asyncio, json, sys
from pathlib import Path
from gateway.tools import sandbox, usernet
spec = json.loads(sys.argv[1])
async def main():
    tools = await asyncio.to_thread(sandbox._find_tools)
    assert not isinstance(tools, str), tools
    if spec["stack"]:
        stack = usernet.find((spec["stack"],))
        assert not isinstance(stack, str), stack
        tools = sandbox.Tools(tools.bwrap, tools.prlimit, tools.choom, tools.chrt, tools.nsenter, stack)
    disk = sandbox.Disk(spec["quota"]) if spec["disk"] else None
    box = sandbox.Box(Path(spec["workdir"]), network=spec["network"], setenv=sandbox.exec_environment(),
                      idle=True, disk=disk)
    try:
        out = await sandbox.run(tools, box, ["/bin/sh", "-c", spec["command"]], timeout_s=spec["timeout"])
    except sandbox.SandboxError as err:
        print(json.dumps({"error": str(err)}))
        return
    print(json.dumps({"code": out.returncode, "stdout": out.stdout.data.decode(errors="replace"),
                      "stderr": out.stderr.data.decode(errors="replace"), "killed_for": out.killed_for}))
asyncio.run(main())
"""


class Runner:
    """Runs sandboxes from a child process as `user` ("root" or "nobody")."""

    def __init__(self, user: str, code_dir: Path, python: str) -> None:
        self.user, self.code_dir, self.python = user, code_dir, python

    def workdir(self) -> Path:
        path = Path(tempfile.mkdtemp(prefix="gateway-sandbox-test-"))
        path.chmod(0o700)
        if self.user == "nobody":
            os.chown(path, NOBODY, NOBODY)
        return path

    async def run(self, workdir: Path, command: str, *, network: bool = False, stack: str | None = None,
                  disk: bool = False, quota: int | None = None, timeout: float = 30,
                  wrap: tuple[str, ...] = ()) -> dict[str, Any]:
        spec = json.dumps({"workdir": str(workdir), "command": command, "network": network, "stack": stack,
                           "disk": disk, "quota": quota, "timeout": timeout})
        prefix = [] if self.user == "root" else ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}",
                                                 "--clear-groups"]
        proc = await asyncio.create_subprocess_exec(
            *wrap, *prefix, self.python, "-c", CHILD, spec, cwd=self.code_dir, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env={"PATH": os.environ.get("PATH", usernet.SEARCH_PATH),
                                                 "PYTHONPATH": str(self.code_dir)})
        out, err = await asyncio.wait_for(proc.communicate(), timeout + 60)
        assert proc.returncode == 0 and out, err.decode()
        result: dict[str, Any] = json.loads(out.decode().splitlines()[-1])
        return result


def _copy_code(into: Path) -> None:
    """The sandbox's modules (stdlib only) where nobody can read them."""
    for name in ("gateway/__init__.py", "gateway/tools/__init__.py", "gateway/tools/sandbox.py",
                 "gateway/tools/seccomp.py", "gateway/tools/usernet.py"):
        target = into / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / name, target)
    for path in [into, *into.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)


def _python_for_nobody() -> str | None:
    for python in (sys.executable, "/usr/bin/python3"):
        probe = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", python,
                                "-c", "import asyncio, json"], capture_output=True, cwd="/")
        if probe.returncode == 0:
            return python
    return None


@pytest.fixture(params=["root", "nobody"])
def runner(request: pytest.FixtureRequest) -> Iterator[Runner]:
    user = str(request.param)
    if os.geteuid() != 0:
        if user == "root":
            pytest.skip("the tests run as an ordinary user: only that one is tried")
        user = "self"
    code = Path(tempfile.mkdtemp(prefix="gateway-sandbox-code-"))
    try:
        _copy_code(code)
        python = sys.executable
        if user == "nobody":
            found = _python_for_nobody()
            if found is None:
                pytest.skip("no Python here that nobody may run")
            python = found
            probe = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                                    "bwrap", "--unshare-all", "--ro-bind", "/", "/", "true"], capture_output=True)
            if probe.returncode != 0:
                pytest.skip(f"bwrap cannot make a sandbox as an ordinary user here: {probe.stderr.decode()[-200:]}")
        yield Runner("root" if user in ("root", "self") else "nobody", code, python)
    finally:
        shutil.rmtree(code, ignore_errors=True)


# -- the network: never the host's loopback ------------------------------------------------------


@pytest_asyncio.fixture
async def host_services() -> AsyncIterator[dict[str, tuple[str, int]]]:
    """HTTP servers on this host that answer a secret: on 127.0.0.1, on ::1, and on an
    address of the machine that is not loopback (when it has one)."""
    async def secret(request: web.Request) -> web.Response:
        return web.Response(text=f"HOST {SECRET}")

    app = web.Application()
    app.router.add_get("/", secret)
    runner = web.AppRunner(app)
    await runner.setup()
    found: dict[str, tuple[str, int]] = {}
    try:
        for name, host in (("v4", "127.0.0.1"), ("v6", "::1"), ("outside", host_address(socket.AF_INET))):
            if host is None:
                continue
            site = web.TCPSite(runner, host, 0)
            await site.start()
            assert site._server is not None and site._server.sockets  # type: ignore[attr-defined]
            found[name] = (host, site._server.sockets[0].getsockname()[1])  # type: ignore[attr-defined]
        yield found
    finally:
        await runner.cleanup()


def connect_script(targets: list[tuple[str, int]]) -> str:
    """Python run inside: an HTTP GET of each target at once (3 s each), one line a target."""
    return ("import socket, threading\n"
            f"targets = {targets!r}\n"
            "out = {}\n"
            "def get(host, port):\n"
            "    try:\n"
            "        with socket.create_connection((host, port), timeout=3) as s:\n"
            "            s.settimeout(3); s.sendall(b'GET / HTTP/1.0\\r\\n\\r\\n'); data = b''\n"
            "            while chunk := s.recv(4096): data += chunk\n"
            "        out[(host, port)] = 'got ' + data.decode(errors='replace').rsplit('\\n', 1)[-1]\n"
            "    except OSError as err: out[(host, port)] = 'failed: ' + str(err.strerror or err)\n"
            "threads = [threading.Thread(target=get, args=t) for t in targets]\n"
            "[t.start() for t in threads]; [t.join() for t in threads]\n"
            "for host, port in targets: print(host, port, out[(host, port)])\n")


def loopback_doors(services: dict[str, tuple[str, int]]) -> list[tuple[str, int]]:
    """Every way a sandbox might reach the host's loopback servers: its own loopback, the
    network stack's gateway (which pasta and slirp4netns map to the host's loopback unless
    told not to), its resolver address, and the host's IPv6 gateway (pasta maps it too)."""
    _, v4 = services["v4"]
    _, v6 = services["v6"]
    doors = [("127.0.0.1", v4), ("::1", v6), ("0.0.0.0", v4), (usernet.GATEWAY, v4), (usernet.RESOLVER, v4),
             ("::ffff:127.0.0.1", v4)]
    gateway6 = default_gateway6()
    if gateway6 is not None:
        doors.append((gateway6, v6))
    return doors


@pytest.mark.parametrize("stack", STACKS or [pytest.param(None, marks=pytest.mark.skip("no network stack"))])
async def test_a_sandbox_with_the_network_on_never_reaches_the_hosts_loopback(
        runner: Runner, stack: str, host_services: dict[str, tuple[str, int]]) -> None:
    doors = loopback_doors(host_services)
    outside = [host_services["outside"]] if "outside" in host_services else []
    script = connect_script(doors + outside)
    # From the host, each server answers (the ports are right).
    seen = await host_sh(f"python3 -c \"{script}\"")
    for host, port in [("127.0.0.1", host_services["v4"][1]), ("::1", host_services["v6"][1]), *outside]:
        assert f"{host} {port} got HOST {SECRET}" in seen, seen
    workdir = runner.workdir()
    try:
        (workdir / "probe.py").write_text(script)
        os.chmod(workdir / "probe.py", 0o644)
        result = await runner.run(workdir, "python3 probe.py; cat /etc/resolv.conf; ip -4 -o addr 2>/dev/null",
                                  network=True, stack=stack)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    assert "error" not in result, result
    out = result["stdout"]
    for host, port in doors:
        line = next(line for line in out.splitlines() if line.startswith(f"{host} {port} "))
        assert " failed: " in line and SECRET not in line, out
    assert SECRET not in out.replace(f"got HOST {SECRET}", "", len(outside))
    if outside:  # the network does work: an address of this machine that is not loopback
        host, port = outside[0]
        assert f"{host} {port} got HOST {SECRET}" in out, out
    else:  # nothing to reach on this machine: the interface and the resolver are set at least
        assert usernet.ADDRESS in out, out
    assert "nameserver" in out or "loopback" in out, out


async def test_exec_with_the_network_on_cannot_use_the_gateways_own_api(make_gateway: GatewayFactory,
                                                                        fake_model: FakeModel) -> None:
    """The red team's attack: read another person's history from the web API on 127.0.0.1.
    The attacker is even given the web token, so only the network's door is tested here."""
    if not STACKS:
        pytest.skip("no network stack")
    gw = await make_gateway(tools={"exec": {"enabled": True, "network": True}}, approvals=NO_ASKING)
    assert gw.http is not None
    assert await chat(gw, "victim", f"my secret is {SECRET}") == f"echo: my secret is {SECRET}"
    api = f"http://127.0.0.1:{gw.http.port}/api/history?session=victim"
    async with web_client(gw) as http, http.get(api) as resp:  # it is there, from the host
        assert resp.status == 200 and SECRET in await resp.text()
    steal = (f"python3 -c \"import urllib.request as u\nfor h in ('127.0.0.1', '{usernet.GATEWAY}'):\n"
             f"  try: print(u.urlopen(u.Request('http://' + h + ':{gw.http.port}/api/history?session=victim', "
             f"headers={{'Authorization': 'Bearer {gw.web_token}'}}), "
             "timeout=4).read()[:300])\n  except OSError as e: print(h, 'failed:', e)\"")
    fake_model.tool_call("exec", {"command": steal})
    fake_model.reply("tried")
    assert await chat(gw, "mallory", "steal") == "tried"
    (result,) = tool_results(fake_model.requests[-1])
    assert SECRET not in result and result.count("failed:") == 2, result


async def test_without_a_network_stack_the_network_on_is_refused_and_tools_says_why(
        make_gateway: GatewayFactory, fake_model: FakeModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(usernet, "find", lambda prefer=(): "neither pasta nor slirp4netns is installed")
    sandbox._checked.clear()
    try:
        gw = await make_gateway(tools={"exec": {"enabled": True, "network": True}}, approvals=NO_ASKING,
                                admins=["web:boss"])
        shown = await chat(gw, "boss", "/tools")
        assert ("exec: not offered: the network cannot be on: neither pasta nor slirp4netns is installed "
                "(tools.exec.network is true)") in shown, shown
        with pytest.raises(ToolError, match="the network cannot be on: neither pasta"):
            await sh(tmp_path, "true", network=True)
        assert await sh(tmp_path, "echo fine") == "exit code 0\n--- stdout ---\nfine"  # without the network: as ever
    finally:
        sandbox._checked.clear()


# -- the system-call filter ----------------------------------------------------------------------

KEYS = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
ADD_KEY, KEYCTL = {add_key}, {keyctl}
def result(r):
    return f"ok" if r >= 0 else os.strerror(ctypes.get_errno())
secret = sys.argv[2].encode()
if sys.argv[1] == "put":  # into its user keyring, readable by anyone who finds it
    key = libc.syscall(ADD_KEY, b"user", b"gateway-test-leak", secret, len(secret), -4)
    print("add_key:", result(key))
    if key >= 0:
        print("setperm:", result(libc.syscall(KEYCTL, 5, key, 0x3f3f3f3f)))
else:  # every key of the same user shows in /proc/keys, and is read by its serial number
    for line in open("/proc/keys"):
        if "gateway-test-leak" in line:
            key = int(line.split()[0], 16)
            buf = ctypes.create_string_buffer(256)
            n = libc.syscall(KEYCTL, 11, key, buf, 256)  # KEYCTL_READ
            print("read:", buf.raw[:n].decode() if n >= 0 else result(n))
            libc.syscall(KEYCTL, 21, key)  # KEYCTL_INVALIDATE: leave nothing behind
    print("searched")
"""


async def test_two_sandboxes_cannot_pass_data_through_the_kernels_keyrings(tmp_path: Path) -> None:
    numbers = seccomp.MACHINES[seccomp.machine()].numbers
    (tmp_path / "keys.py").write_text(KEYS.format(add_key=numbers["add_key"], keyctl=numbers["keyctl"]))
    put = await sh(tmp_path / "a", f"python3 /dev/stdin put {SECRET}", stdin=(tmp_path / "keys.py").read_text())
    got = await sh(tmp_path / "b", "python3 /dev/stdin get -", stdin=(tmp_path / "keys.py").read_text())
    assert SECRET not in got and section(got, "stdout").endswith("searched"), got
    assert section(put, "stdout") == "add_key: Operation not permitted", put
    assert set(section(got, "stdout").splitlines()[:-1]) <= {"read: Operation not permitted"}, got


async def test_the_filter_refuses_namespaces_and_terminal_input_and_leaves_the_rest(tmp_path: Path) -> None:
    n = seccomp.MACHINES[seccomp.machine()].numbers
    script = (
        "import ctypes, fcntl, os, threading, subprocess\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "def call(name, *args):\n"
        "    r = libc.syscall(*args)\n"
        "    print(name, 'ok' if r >= 0 else os.strerror(ctypes.get_errno()))\n"
        f"call('unshare', {n['unshare']}, 0)\n"  # no flags at all: allowed by the kernel, refused by the filter
        f"call('personality', {n['personality']}, 0x0040000)\n"  # ADDR_NO_RANDOMIZE
        f"call('personality?', {n['personality']}, 0xffffffff)\n"
        f"call('bpf', {n['bpf']}, 0, 0, 0)\n"
        f"call('userfaultfd', {n['userfaultfd']}, 0)\n"
        f"call('io_uring', {n['io_uring_setup']}, 1, 0)\n"
        "try: fcntl.ioctl(0, 0x5412, b'x'); print('TIOCSTI ok')\n"
        "except OSError as e: print('TIOCSTI', e.strerror)\n"
        "t = threading.Thread(target=lambda: print('a thread ran')); t.start(); t.join()\n"
        "print(subprocess.run('echo piped | tr a-z A-Z', shell=True, capture_output=True, text=True).stdout.strip())\n"
    )
    (tmp_path / "calls.py").write_text(script)
    text = await sh(tmp_path, "python3 calls.py < /dev/null; unshare -r true || echo unshare refused; "
                              "setarch -R true || echo setarch refused")
    assert section(text, "stdout").splitlines() == [
        "unshare Operation not permitted", "personality Operation not permitted", "personality? ok",
        "bpf Operation not permitted", "userfaultfd Operation not permitted", "io_uring Operation not permitted",
        "TIOCSTI Operation not permitted", "a thread ran", "PIPED", "unshare refused", "setarch refused"], text


def _run_filter(program: bytes, data: bytes) -> int:
    """What a classic BPF seccomp program returns for one struct seccomp_data (the kernel's
    semantics for the instructions the filter uses)."""
    code = [struct.unpack("=HBBI", program[i:i + 8]) for i in range(0, len(program), 8)]
    a, pc = 0, 0
    while True:
        op, jt, jf, k = code[pc]
        pc += 1
        if op == seccomp.LD_ABS_W:
            a = struct.unpack_from("=I", data, k)[0]
        elif op == seccomp.RET:
            return k
        elif op in (seccomp.JEQ, seccomp.JGE, seccomp.JSET):
            hit = a == k if op == seccomp.JEQ else a >= k if op == seccomp.JGE else bool(a & k)
            pc += jt if hit else jf
        else:
            raise AssertionError(f"unexpected instruction {op:#x}")


def seccomp_data(nr: int, arch: int, *args: int) -> bytes:
    return struct.pack("=iIQ6Q", nr, arch, 0, *(list(args) + [0] * (6 - len(args))))


@pytest.mark.parametrize("machine", sorted(seccomp.MACHINES))
def test_the_filter_of_each_machine(machine: str) -> None:
    spec = seccomp.MACHINES[machine]
    program = seccomp.program(machine)
    eperm, enosys = seccomp.RET_ERRNO | seccomp.EPERM, seccomp.RET_ERRNO | seccomp.ENOSYS
    for call in seccomp.REFUSED:
        if call in spec.numbers:
            assert _run_filter(program, seccomp_data(spec.numbers[call], spec.audit_arch)) == eperm, call
    assert _run_filter(program, seccomp_data(0, spec.audit_arch)) == seccomp.RET_ALLOW  # read / io_setup
    assert _run_filter(program, seccomp_data(spec.numbers["clone3"], spec.audit_arch)) == enosys
    clone = spec.numbers["clone"]
    assert _run_filter(program, seccomp_data(clone, spec.audit_arch, 0x01200011)) == seccomp.RET_ALLOW  # fork()
    assert _run_filter(program, seccomp_data(clone, spec.audit_arch, 0x10000000 | 17)) == eperm  # CLONE_NEWUSER
    ioctl = spec.numbers["ioctl"]
    assert _run_filter(program, seccomp_data(ioctl, spec.audit_arch, 0, 0x5412)) == eperm
    assert _run_filter(program, seccomp_data(ioctl, spec.audit_arch, 0, (1 << 32) | 0x5412)) == eperm  # high bits
    assert _run_filter(program, seccomp_data(ioctl, spec.audit_arch, 0, 0x5401)) == seccomp.RET_ALLOW  # TCGETS
    # Calls of another ABI have other numbers: none gets through.
    for arch in (0x40000003, 0x40000028):  # i386, arm
        assert _run_filter(program, seccomp_data(spec.numbers["add_key"], arch)) == enosys
    if spec.x32:
        assert _run_filter(program, seccomp_data(0x40000000 | spec.numbers["add_key"], spec.audit_arch)) == enosys


def test_the_filters_numbers_are_the_kernels() -> None:
    headers = {"x86_64": Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h"),
               "aarch64": Path("/usr/include/asm-generic/unistd.h")}
    checked = 0
    for machine, header in headers.items():
        if not header.exists():
            continue
        text = header.read_text()
        for call, number in seccomp.MACHINES[machine].numbers.items():
            found = re.search(rf"#define __NR(?:3264)?_{call}\s+(\d+)", text)
            assert found and int(found.group(1)) == number, (machine, call)
            checked += 1
    if not checked:
        pytest.skip("no kernel headers here (linux-libc-dev)")


# -- processes: a sandboxed MCP server keeps exec's cap ------------------------------------------

FORKER = '''
import os, time
from mcp.server.fastmcp import FastMCP
server = FastMCP("forker", log_level="WARNING")

@server.tool()
def fork(count: int) -> str:
    """Start `count` processes that sleep."""
    made = 0
    for _ in range(count):
        try:
            pid = os.fork()
        except OSError as err:
            return f"made {made}, then: {err.strerror}"
        if pid == 0:
            time.sleep(600)
            os._exit(0)
        made += 1
    return f"made {made}"

@server.tool()
def ping() -> str:
    """Answers pong."""
    return "pong"

server.run("stdio")
'''


async def test_a_sandboxed_mcp_server_that_forks_past_the_cap_is_killed_and_restarted(
        make_gateway: GatewayFactory, fake_model: FakeModel, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("the attack is a root gateway's (an ordinary user's sandbox has RLIMIT_NPROC)")
    home = tmp_path / "forker-home"
    home.mkdir()
    (home / "forker.py").write_text(FORKER)
    servers = {"forker": {"command": sys.executable, "args": ["forker.py"], "cwd": str(home), "sandbox": True,
                          "network": False, "read_only_paths": python_paths()}}
    gw = await make_gateway(mcp={"servers": servers})
    assert gw.mcp is not None
    gw.mcp.backoff_min_s = 0.2
    await until(lambda: gw.mcp is not None and gw.mcp.statuses()[0].state == "ready", timeout=30)
    fake_model.tool_call("forker__fork", {"count": 600})
    fake_model.reply("forked")
    assert await chat(gw, "ann", "fork") == "forked"
    (result,) = tool_results(fake_model.requests[-1])
    assert not result.startswith("made 600"), result
    # The watchdog killed it (or the kernel's pid_max stopped it first, and then the watchdog).
    await until(lambda: gw.mcp is not None and (gw.mcp.statuses()[0].error or "").startswith(
        "the sandbox was killed: more than 256 processes"), timeout=30, what="the reason")
    # Restarted after its backoff, like any dead server, and nothing of the old one is left.
    await until(lambda: gw.mcp is not None and gw.mcp.statuses()[0].state == "ready", timeout=30, what="restart")
    assert len([p for p in os.listdir("/proc") if p.isdigit() and _cwd_is(p, home)]) < 10
    fake_model.tool_call("forker__ping", {})
    fake_model.reply("pinged")
    assert await chat(gw, "ann", "ping") == "pinged"
    assert tool_results(fake_model.requests[-1])[-1] == "pong"


def _cwd_is(pid: str, directory: Path) -> bool:
    try:
        return os.readlink(f"/proc/{pid}/cwd") == str(directory)
    except OSError:
        return False


# -- the disk ------------------------------------------------------------------------------------

QUOTA_MB = 20


async def test_a_command_cannot_fill_the_disk_and_the_gateway_keeps_answering(make_gateway: GatewayFactory,
                                                                             fake_model: FakeModel) -> None:
    gw = await make_gateway(tools={"exec": {"enabled": True, "disk_mb": QUOTA_MB, "timeout_s": 60}},
                            approvals=NO_ASKING)
    many = "mkdir -p many; i=0; while head -c 262144 /dev/zero > many/f$i; do i=$((i+1)); done; echo stopped"
    big = "head -c 200M /dev/zero > big.bin; echo $?; ls -s --block-size=1M big.bin"
    for command in (many, "rm -rf many", big, "ls", "rm big.bin", "echo room again"):
        fake_model.tool_calls([("exec", {"command": command})])
    fake_model.reply("filled")
    assert await chat(gw, "mallory", "fill the disk") == "filled"
    killed, emptied, one, refused, deleted, again = tool_results(fake_model.requests[-1])[-6:]
    # Many small files are killed by the watchdog, one large file stops at the quota (RLIMIT_FSIZE).
    assert killed.startswith(f"killed: the workspace grew past its {QUOTA_MB} MB (tools.exec.disk_mb)"), killed
    assert emptied.startswith("exit code 0"), emptied
    assert section(one, "stdout").splitlines()[0] == "153" and "File size limit exceeded" in one, one
    assert int(section(one, "stdout").splitlines()[1].split()[0]) <= QUOTA_MB, one
    # Full now: only deleting runs, and the refusal says what holds the most.
    assert refused.startswith("error: the workspace uses 2") and f"of its {QUOTA_MB:,} MB (tools.exec.disk_mb): no " \
           "command runs in it until files are deleted. Largest: big.bin (" in refused, refused
    assert deleted.startswith("exit code 0"), deleted
    assert again == "exit code 0\n--- stdout ---\nroom again", again
    # And the gateway stores and answers.
    assert await chat(gw, "carol", "still there?") == "echo: still there?"


async def test_the_workspace_ends_at_its_quota(tmp_path: Path) -> None:
    text = await sh(tmp_path, "i=0; while head -c 1048576 /dev/zero > f$i; do i=$((i+1)); done", disk_mb=QUOTA_MB,
                    timeout_s=60)
    assert text.startswith(f"killed: the workspace grew past its {QUOTA_MB} MB"), text
    held = sandbox.usage(tmp_path).used_bytes >> 20
    assert QUOTA_MB <= held <= QUOTA_MB + 256, held  # past it by what a few hundred ms of writing adds


async def test_a_sandbox_never_eats_into_the_disks_reserve(runner: Runner, tmp_path: Path) -> None:
    """On a small disk of its own (a tmpfs in a mount namespace of the child's), a sandbox
    without a quota fills it: it is killed when the free space reaches the reserve."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small file system needs root")
    workdir = runner.workdir()
    try:
        size = sandbox.DISK_RESERVE_MIN + (48 << 20)
        mount = (f"mount -t tmpfs -o size={size},mode=0700,uid={os.stat(workdir).st_uid},"
                 f"gid={os.stat(workdir).st_gid} none {workdir} && exec \"$@\"")
        fill = "i=0; while head -c 1048576 /dev/zero > f$i; do i=$((i+1)); done; df -m . | tail -1"
        result = await runner.run(workdir, fill, disk=True, quota=None,
                                  wrap=("unshare", "-m", "--propagation", "private", "sh", "-c", mount, "-"))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    assert "error" not in result, result
    assert (result["killed_for"] or "").startswith("the disk holding the workspace has"), result
    assert "MB are kept for the gateway's own data" in result["killed_for"], result


def chat_inbound(chat_id: str) -> Any:
    from gateway.types import Inbound
    return Inbound(channel="web", chat_id=chat_id, user_id=chat_id, text="", event_id="e")


# -- the host's paths ----------------------------------------------------------------------------


async def test_no_process_in_the_sandbox_shows_the_workspaces_host_path(make_gateway: GatewayFactory,
                                                                        fake_model: FakeModel) -> None:
    gw = await make_gateway(tools={"exec": {"enabled": True, "network": bool(STACKS)}}, approvals=NO_ASKING)
    assert gw.services is not None
    data_dir = str(gw.services.data_dir.resolve())
    workspace = gw.workspace_for(chat_inbound("ann"))
    look = ("sleep 30 & for p in /proc/[0-9]*; do echo \"== $p\"; tr '\\0' ' ' < $p/cmdline; echo; "
            "tr '\\0' ' ' < $p/environ; echo; done; grep -c . /proc/self/mountinfo; kill $!")
    ctx = ToolContext(session_key="web:dm:ann", scope="web:ann", workspace=workspace, config=gw.cfg)
    from gateway.tools.exec import Exec
    text = (await Exec(lambda: gw.cfg).run({"command": look}, ctx)).text
    shown = section(text, "stdout")
    assert shown.count("== /proc/") >= 3 and "sleep 30" in shown, text  # bwrap, the shell, sleep
    assert "bwrap --args" in shown, text  # bwrap's own command line: its options came through a file descriptor
    listing = shown.rsplit("\n", 1)[0]
    assert data_dir not in listing and str(workspace) not in listing, text


def test_the_command_line_names_no_host_path_through_args(tmp_path: Path) -> None:
    tools = sandbox.Tools("/usr/bin/bwrap", "/usr/bin/prlimit", "/usr/bin/choom", "/usr/bin/chrt")
    box = sandbox.Box(tmp_path / "scopes" / "web_ann")
    options = sandbox.bwrap_options(tools, box)
    assert f"{tmp_path}/scopes/web_ann" in options  # the bind is in the options…
    inside = sandbox.inside_command(tools, box, ["/bin/sh", "-c", "ls"])
    assert not [arg for arg in inside if str(tmp_path) in arg]  # …and never on the command line


async def test_exec_is_refused_when_the_workspace_is_over_quota_and_may_delete(tmp_path: Path) -> None:
    (tmp_path / "junk").mkdir()
    with open(tmp_path / "junk" / "blob", "wb") as fh:
        fh.write(os.urandom(3 << 20))
    with pytest.raises(ToolError, match=r"the workspace uses 3\.\d MB of its 2 MB \(tools\.exec\.disk_mb\): no "
                                        r"command runs in it until files are deleted\. Largest: junk \(3\.\d MB\)"):
        await sh(tmp_path, "echo hi", disk_mb=2)
    # rm alone runs (nothing it starts can grow a file), then anything does again.
    assert (await sh(tmp_path, "rm -rf junk", disk_mb=2)).startswith("exit code 0")
    assert await sh(tmp_path, "echo hi", disk_mb=2) == "exit code 0\n--- stdout ---\nhi"
    with pytest.raises(ConfigError):
        exec_config(disk_mb=0)
    assert exec_config().tools.exec.disk_mb == 1024


async def test_a_sandboxed_mcp_server_with_the_network_on_cannot_reach_the_hosts_loopback(
        make_gateway: GatewayFactory, fake_model: FakeModel, tmp_path: Path) -> None:
    if not STACKS:
        pytest.skip("no network stack")
    servers = snoop_servers(tmp_path)
    servers["boxed"]["network"] = True
    servers["boxed"]["env"] = {}
    servers["open"]["env"] = {}
    gw = await make_gateway(mcp={"servers": servers})
    await mcp_ready(gw, "open", "boxed")
    assert gw.http is not None
    results = await call_tools(gw, fake_model, [("open__connect", {"port": gw.http.port}),
                                                ("boxed__connect", {"port": gw.http.port})])
    # Outside the sandbox a server reaches the gateway's own API; inside, with the network on, not.
    assert results == ["connected", "cannot connect: Connection refused"], results


async def test_a_sandboxed_mcp_server_with_the_network_on_is_refused_without_a_stack(
        make_gateway: GatewayFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(usernet, "find", lambda prefer=(): "neither pasta nor slirp4netns is installed")
    sandbox._checked.clear()
    try:
        servers = snoop_servers(tmp_path)
        servers["boxed"]["network"] = True
        servers["boxed"]["env"] = {}
        del servers["open"]
        gw = await make_gateway(mcp={"servers": servers}, admins=["web:boss"])
        assert gw.mcp is not None
        await until(lambda: gw.mcp is not None and gw.mcp.statuses()[0].error is not None, what="refused")
        assert "- boxed: failed: sandbox: the network cannot be on: neither pasta nor slirp4netns is installed " \
               "(network is true)" in await chat(gw, "boss", "/tools")
    finally:
        sandbox._checked.clear()
