"""The sandbox that `exec` (SPEC §5.7) and sandboxed MCP servers run in: bubblewrap.

What a command sees: one working directory of the host (read-write, at a path of our
choosing), the system's programs and libraries read-only (/usr, and /bin, /sbin, /lib*
as links or read-only directories), the few /etc files programs need, a private /tmp and
/dev/shm (tmpfs, bounded in size), a /proc of its own PID namespace and a minimal /dev.
Nothing else of the host: no data dir, no other scope, no config file, no gateway
environment (`--clearenv`). Every namespace is new, the network's too, and so is the
session (nothing can be typed into the gateway's terminal). bwrap reads its arguments from
a file descriptor (`--args`), so no process of the sandbox shows the host paths it binds on
its command line. With the network on, a user-mode network stack (gateway/tools/usernet.py)
connects the sandbox's own network namespace to the outside, never to the host's loopback.
A system-call filter (gateway/tools/seccomp.py) refuses the kernel's keyrings, new
namespaces and mounts, and the other calls Docker's default profile refuses.

Limits, without cgroups:
- memory: RLIMIT_AS of each process; the OOM killer picks the sandbox first (oom_score_adj 1000);
- CPU: exec's commands run SCHED_IDLE, behind every other process of the machine;
- processes: RLIMIT_NPROC, set inside the sandbox's own user namespace, where the kernel
  counts the sandbox's tasks alone (the gateway's user keeps its own count). The kernel
  does not enforce it for uid 0, and a gateway run as root makes the sandbox's user root
  outside; there the PID namespace's own pid_max (Linux 6.14 and later) is set before the
  command starts (bwrap waits on --block-fd meanwhile). A watchdog also counts the tasks
  of the PID namespace and kills the sandbox past the cap, whatever held it, for as long
  as the sandbox lives (an MCP server's whole life);
- disk: RLIMIT_FSIZE (at most what is left of the workspace's quota and of the disk above
  the reserve); the watchdog sums the workspace's allocated blocks and reads the disk's
  free space, and kills the sandbox past the quota or when the disk's free space falls
  to the reserve kept for the gateway's own data (DISK_RESERVE_*); no core dumps; /tmp and
  /dev/shm hold at most their size;
- time: the caller's wall clock. Killing is SIGKILL to bwrap and to the PID namespace's
  first process: when that one dies, the kernel kills every process in the namespace
  (bwrap's `--die-with-parent` does the same if the gateway itself dies).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import shutil
import signal
import stat
import tempfile
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from gateway.tools import seccomp, usernet

log = logging.getLogger("gateway.sandbox")

SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin"
WORKDIR = "/workspace"  # where exec's workspace appears
UID = GID = 1000  # the sandbox's user; outside it is the gateway's own user
USER = "sandbox"
MAX_TASKS = 256  # processes and threads in one sandbox
FILE_MAX_BYTES = 1 << 30  # the largest file a sandboxed process may write
SHM_MB = 64
OOM_SCORE_ADJ = 1000  # the OOM killer takes the sandbox before anything else
OUTPUT_MAX_BYTES = 1_000_000  # kept of each of stdout and stderr; the rest is read and dropped
WATCH_INTERVAL_S = 0.05
KILL_WAIT_S = 5.0  # for the killed sandbox to be reaped and its pipes to close
PROBE_TIMEOUT_S = 15.0
PID_CAP_TIMEOUT_S = 10.0
PID_CAP_ATTEMPTS = 20
PID_CAP_RETRY_S = 0.02
PID_MAX_MIN = 301  # the kernel's least pid_max
NS_GET_USERNS = 0xB701  # ioctl: the user namespace that owns a namespace (linux/nsfs.h)
INFO_MAX_BYTES = 65_536
NETWORK_START_TIMEOUT_S = 15.0  # for the network stack to connect the sandbox
NETWORK_LOG_BYTES = 4096  # kept of the network stack's stderr
# The disk under the workspace keeps this much free for the gateway's own data (the
# database, its journal, files people send): 5 % of it, at least 256 MB, at most 4 GB.
DISK_RESERVE_MIN = 256 << 20
DISK_RESERVE_MAX = 4 << 30
DISK_RESERVE_SHARE = 0.05
INODE_RESERVE_MIN = 2_000  # and these many free inodes (where the file system counts them)
DISK_MAX_ENTRIES = 100_000  # files and directories a workspace may hold
DISK_WALK_MIN_S = 0.25  # the workspace is summed at most this often (and at most 1/4 of the time)
TIDY_MAX_ENTRIES = 200_000  # a workspace is walked after each run up to this many entries

# Top-level system paths: symlinks into /usr on merged-/usr systems, directories elsewhere.
SYSTEM_DIRS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
# /etc is bound file by file: a process in the sandbox runs as the gateway's user outside,
# so any file of that user (as root: /etc/shadow, /etc/ssl/private) would be readable.
ETC_ALWAYS = ("ld.so.cache", "alternatives", "localtime")
# With the network on (resolv.conf is the sandbox's own: its resolver is the network stack's).
ETC_NETWORK = ("hosts", "nsswitch.conf", "gai.conf", "host.conf", "services", "protocols",
               "ssl/certs", "ssl/openssl.cnf", "ca-certificates", "pki/tls/certs", "pki/tls/cert.pem",
               "pki/ca-trust/extracted", "crypto-policies")
PROC_READ_ONLY = ("sys", "sysrq-trigger", "mtrr", "pressure")
HELPERS = {"prlimit": "util-linux", "choom": "util-linux", "chrt": "util-linux"}


class SandboxError(Exception):
    """The sandbox cannot run here; the message says why (for /tools, logs and the model)."""


@dataclass(frozen=True, slots=True)
class Tools:
    """The programs a sandbox is made with (absolute paths; the helpers run inside it)."""

    bwrap: str
    prlimit: str
    choom: str
    chrt: str
    nsenter: str | None = None  # sets a root gateway's sandbox's pid_max; without it, the watchdog alone
    network: usernet.Stack | None = None  # connects a sandbox with the network on; without it, none runs


@dataclass(frozen=True, slots=True)
class Limits:
    memory_mb: int | None  # RLIMIT_AS of each process; None: none (an MCP server's runtime decides)
    tmp_mb: int = 512  # size of /tmp
    tasks: int = MAX_TASKS
    file_bytes: int = FILE_MAX_BYTES


@dataclass(frozen=True, slots=True)
class Disk:
    """What the watchdog holds the sandbox's working directory to."""

    quota_bytes: int | None  # allocated bytes under it; None: only the disk's reserve


@dataclass(frozen=True, slots=True)
class Box:
    """One sandbox: the host directory it works in and what else it gets."""

    workdir: Path  # on the host, bound read-write
    inside: str = WORKDIR  # where it appears, and the working directory
    network: bool = False
    limits: Limits = Limits(memory_mb=512)
    read_only: tuple[Path, ...] = ()  # more host paths, read-only at the same path
    clear_env: bool = True  # False: the sandbox keeps bwrap's environment (given to it as a process)
    # Set inside the sandbox; never a secret (an MCP server's secrets come through bwrap's environment).
    setenv: Mapping[str, str] = field(default_factory=dict)
    unsetenv: tuple[str, ...] = ()
    # SCHED_IDLE: the sandbox runs only when nothing else wants the CPU, so a busy loop or a
    # fork bomb cannot starve the gateway (nor its watchdog); it cannot leave that policy.
    idle: bool = False
    disk: Disk | None = None


def exec_environment() -> dict[str, str]:
    """All that a command run by `exec` finds in its environment."""
    return {"PATH": SANDBOX_PATH, "HOME": "/tmp", "LANG": "C.UTF-8", "USER": USER, "LOGNAME": USER}


def command_line(tools: Tools, box: Box, argv: Sequence[str], *, info_fd: int | None = None,
                 block_fd: int | None = None, identity_fds: tuple[int, int] | None = None,
                 seccomp_fd: int | None = None, resolv_fd: int | None = None) -> list[str]:
    """The bwrap command line that runs `argv` in `box` (start() hands bwrap its options
    through `--args` instead, and the command after them)."""
    options = bwrap_options(tools, box, info_fd=info_fd, block_fd=block_fd, identity_fds=identity_fds,
                            seccomp_fd=seccomp_fd, resolv_fd=resolv_fd)
    return [tools.bwrap, *options, "--", *inside_command(tools, box, argv)]


def bwrap_options(tools: Tools, box: Box, *, info_fd: int | None = None, block_fd: int | None = None,
                  identity_fds: tuple[int, int] | None = None, seccomp_fd: int | None = None,
                  resolv_fd: int | None = None) -> list[str]:
    """bwrap's options that make `box` (all that names the host's paths)."""
    args = ["--unshare-all",  # new user, mount, PID, IPC, UTS, cgroup and network namespaces
            "--unshare-user",  # always (--unshare-all only tries): the sandbox's own users, none of them root
            "--disable-userns",  # no nested user namespaces: less of the kernel in reach
            "--uid", str(UID), "--gid", str(GID), "--hostname", USER,
            "--die-with-parent",  # the gateway dies: so does the sandbox
            "--new-session"]  # no controlling terminal to push keystrokes into (TIOCSTI)
    if box.clear_env:
        args.append("--clearenv")
    for key, value in box.setenv.items():
        args += ["--setenv", key, value]
    for key in box.unsetenv:
        args += ["--unsetenv", key]
    args += ["--ro-bind", "/usr", "/usr"]
    for name in SYSTEM_DIRS:
        path = Path("/", name)
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args += ["--ro-bind", str(path), str(path)]
    for name in ETC_ALWAYS + (ETC_NETWORK if box.network else ()):
        args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    if identity_fds is not None:
        args += ["--ro-bind-data", str(identity_fds[0]), "/etc/passwd",
                 "--ro-bind-data", str(identity_fds[1]), "/etc/group"]
    if resolv_fd is not None:
        args += ["--ro-bind-data", str(resolv_fd), "/etc/resolv.conf"]
    limits = box.limits
    args += ["--proc", "/proc"]
    # Kernel settings are guarded by uid 0 alone, and the sandbox's user is root outside when
    # the gateway is: those files read-only (bwrap covers them only when the directory is writable).
    for name in PROC_READ_ONLY:
        args += ["--ro-bind-try", f"/proc/{name}", f"/proc/{name}"]
    args += ["--dev", "/dev",
             "--size", str(SHM_MB << 20), "--tmpfs", "/dev/shm",
             "--remount-ro", "/dev",  # device nodes still work; no files in /dev's own tmpfs
             "--size", str(limits.tmp_mb << 20), "--tmpfs", "/tmp"]
    # After the private /tmp, so a path below /tmp (a checkout or a virtualenv there) shows.
    for path in box.read_only:
        args += ["--ro-bind", str(path), str(path)]
    args += ["--bind", str(box.workdir), box.inside, "--chdir", box.inside,
             "--remount-ro", "/"]  # the sandbox's root tmpfs: nothing written there either
    if info_fd is not None:
        args += ["--info-fd", str(info_fd)]  # tells us the PID namespace's first process
    if block_fd is not None:
        args += ["--block-fd", str(block_fd)]  # the command waits until we wrote to it (or closed it)
    if seccomp_fd is not None:
        args += ["--seccomp", str(seccomp_fd)]  # loaded after bwrap's own set-up, before the command
    return args


def inside_command(tools: Tools, box: Box, argv: Sequence[str]) -> list[str]:
    """What bwrap runs in `box`: `argv` under the limits set inside the sandbox's user
    namespace (see the module's docstring)."""
    limits = box.limits
    args = [tools.prlimit, f"--nproc={limits.tasks}:{limits.tasks}",
            f"--fsize={limits.file_bytes}:{limits.file_bytes}", "--core=0:0", "--nice=0:0"]
    if limits.memory_mb is not None:
        size = limits.memory_mb << 20
        args.append(f"--as={size}:{size}")
    args += ["--", tools.choom, "-n", str(OOM_SCORE_ADJ), "--"]
    if box.idle:
        args += [tools.chrt, "--idle", "0"]
    return args + list(argv)


# -- availability: probed once ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Availability:
    tools: Tools | None
    reason: str | None = None  # why not, when tools is None
    final: bool = True  # False: a machine too busy to answer in time; asked again next time
    network_reason: str | None = None  # why a sandbox with the network on cannot run here (None: it can)

    def refusal(self, network: bool) -> str | None:
        """Why a sandbox (with the network on, if so) cannot run here, or None."""
        if self.tools is None:
            return self.reason or "the sandbox cannot run here"
        if network and self.network_reason is not None:
            return f"the network cannot be on: {self.network_reason}"
        return None


_checked: dict[Tools, Availability] = {}
_probing: dict[Tools, asyncio.Future[Availability]] = {}


async def availability() -> Availability:
    """Whether a sandbox can be made here: the programs exist and a real one runs, with the
    network on too (once per set of programs; a missing program is looked for again next time)."""
    tools = await asyncio.to_thread(_find_tools)
    if isinstance(tools, str):
        return Availability(None, tools)
    known = _checked.get(tools)
    if known is not None:
        return known
    probing = _probing.get(tools)
    if probing is None or probing.get_loop() is not asyncio.get_running_loop():
        probing = _probing[tools] = asyncio.ensure_future(_probe(tools))  # the first caller's; the others wait
    try:
        known = await asyncio.shield(probing)
    finally:
        if probing.done():
            _probing.pop(tools, None)
    if tools not in _checked and known.final:
        _checked[tools] = known
        if known.reason is not None:
            log.warning("the sandbox cannot run here", extra={"error": known.reason})
        elif known.network_reason is not None:
            log.warning("a sandbox with the network on cannot run here", extra={"error": known.network_reason})
    return known


def _find_tools() -> Tools | str:
    """The programs, or which one is missing."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return "bwrap (bubblewrap) is not installed"
    unsupported = seccomp.supported()
    if unsupported is not None:
        return unsupported
    found: dict[str, str] = {}
    for name, package in HELPERS.items():
        path = shutil.which(name, path=SANDBOX_PATH)  # the sandbox sees the same /usr
        if path is None:
            return f"{name} ({package}) is not installed"
        found[name] = path
    stack = usernet.find()
    return Tools(bwrap, **found, nsenter=shutil.which("nsenter", path=SANDBOX_PATH),
                 network=stack if isinstance(stack, usernet.Stack) else None)


async def _probe(tools: Tools) -> Availability:
    scratch = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="gateway-sandbox-check-"))
    try:
        outcome = await run(tools, _probe_box(scratch, network=False), ["/bin/sh", "-c", "echo sandbox-ok"],
                            timeout_s=PROBE_TIMEOUT_S)
        failed = _probe_failure(outcome)
        if failed is not None:
            return failed
        if tools.network is None:
            found = usernet.find()
            return Availability(tools, network_reason=found if isinstance(found, str) else "no network stack")
        try:
            outcome = await run(tools, _probe_box(scratch, network=True), ["/bin/sh", "-c", "echo sandbox-ok"],
                                timeout_s=PROBE_TIMEOUT_S)
        except SandboxError as err:
            return Availability(tools, network_reason=str(err))
        failed = _probe_failure(outcome)
        if failed is not None:
            return Availability(tools, network_reason=failed.reason, final=failed.final)
        return Availability(tools)
    except SandboxError as err:
        return Availability(None, str(err))
    finally:
        await asyncio.to_thread(shutil.rmtree, scratch, True)


def _probe_box(scratch: Path, *, network: bool) -> Box:
    return Box(scratch, network=network, limits=Limits(memory_mb=256, tmp_mb=1), setenv=exec_environment(),
               idle=True)


def _probe_failure(outcome: Outcome) -> Availability | None:
    if outcome.returncode == 0 and bytes(outcome.stdout.data) == b"sandbox-ok\n":
        return None
    lines = [line.strip() for line in bytes(outcome.stderr.data).decode("utf-8", "replace").splitlines()]
    last = next((line for line in reversed(lines) if line), "")
    if outcome.timed_out:
        return Availability(None, f"the sandbox check did not finish within {PROBE_TIMEOUT_S:g} s", final=False)
    why = last.removeprefix("bwrap: ")[:300] or f"exit code {outcome.returncode}"
    return Availability(None, f"bwrap cannot make a sandbox here: {why}")


# -- the disk ----------------------------------------------------------------------------------


def disk_reserve(total_bytes: int) -> int:
    """The free space a sandbox leaves on a file system of `total_bytes`."""
    return max(DISK_RESERVE_MIN, min(DISK_RESERVE_MAX, int(total_bytes * DISK_RESERVE_SHARE)))


@dataclass(frozen=True, slots=True)
class Usage:
    used_bytes: int  # allocated under the directory (each inode once)
    entries: int  # files and directories under it (counting stops past DISK_MAX_ENTRIES)


def usage(root: Path, max_entries: int = DISK_MAX_ENTRIES) -> Usage:
    """What a working directory holds, without following links (blocking: run it off the loop)."""
    used = entries = 0
    seen: set[tuple[int, int]] = set()
    pending = [str(root)]
    while pending:
        try:
            listing = os.scandir(pending.pop())
        except OSError:
            continue
        with listing:
            for entry in listing:
                entries += 1
                if entries > max_entries:
                    return Usage(used, entries)
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue  # removed meanwhile
                if stat.S_ISDIR(st.st_mode):
                    pending.append(entry.path)
                if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
                    if (st.st_dev, st.st_ino) in seen:
                        continue
                    seen.add((st.st_dev, st.st_ino))
                used += st.st_blocks * 512
    return Usage(used, entries)


def disk_low(path: Path) -> str | None:
    """Why the disk under `path` has no room left for a sandbox, or None."""
    try:
        fs = os.statvfs(path)
    except OSError:
        return None
    total, free = fs.f_blocks * fs.f_frsize, fs.f_bavail * fs.f_frsize
    reserve = disk_reserve(total)
    if free <= reserve:
        return (f"the disk holding the workspace has {free >> 20:,} MB free, and {reserve >> 20:,} MB are kept "
                "for the gateway's own data")
    if fs.f_files > 0 and fs.f_favail <= max(INODE_RESERVE_MIN, fs.f_files // 100):
        return f"the disk holding the workspace has only {fs.f_favail:,} free inodes, kept for the gateway's own data"
    return None


def disk_room(workdir: Path) -> int:
    """The largest file a sandbox in `workdir` may write now as far as the disk goes (what
    is left above the reserve, at most FILE_MAX_BYTES); SandboxError when the disk is down
    to its reserve. Blocking: run it off the loop."""
    low = disk_low(workdir)
    if low is not None:
        raise SandboxError(f"{low}: nothing can run in a sandbox until there is room")
    fs = os.statvfs(workdir)
    return max(1, min(FILE_MAX_BYTES, fs.f_bavail * fs.f_frsize - disk_reserve(fs.f_blocks * fs.f_frsize)))


def largest(root: Path, count: int = 5) -> list[tuple[str, int]]:
    """The `count` entries directly under `root` that hold the most (name, bytes), largest first."""
    sizes: list[tuple[str, int]] = []
    budget = DISK_MAX_ENTRIES
    try:
        names = sorted(os.listdir(root))[:1000]
    except OSError:
        return []
    for name in names:
        path = root / name
        try:
            st = path.lstat()
        except OSError:
            continue
        held = usage(path, budget) if stat.S_ISDIR(st.st_mode) else Usage(st.st_blocks * 512, 0)
        budget = max(1, budget - held.entries)
        sizes.append((name, held.used_bytes + (st.st_blocks * 512 if stat.S_ISDIR(st.st_mode) else 0)))
    return sorted(sizes, key=lambda item: -item[1])[:count]


# -- running ---------------------------------------------------------------------------------


@dataclass(slots=True)
class Captured:
    data: bytearray = field(default_factory=bytearray)
    dropped: int = 0  # bytes read past OUTPUT_MAX_BYTES and thrown away


@dataclass(slots=True)
class Outcome:
    returncode: int | None  # bwrap's: the command's exit code, or 128 + the signal that ended it
    stdout: Captured
    stderr: Captured
    timed_out: bool = False
    too_many_tasks: bool = False  # the watchdog killed it
    disk_full: str | None = None  # why the watchdog killed it for the disk

    @property
    def killed(self) -> bool:
        return self.timed_out or self.too_many_tasks or self.disk_full is not None

    @property
    def killed_for(self) -> str | None:
        """Why the watchdog killed it, or None."""
        if self.too_many_tasks:
            return f"more than {MAX_TASKS} processes and threads in the sandbox"
        return self.disk_full


def _identity_files() -> tuple[str, str]:
    """/etc/passwd and /etc/group of the sandbox: one user, and nobody for every uid that
    is not mapped."""
    passwd = f"{USER}:x:{UID}:{GID}:{USER}:/tmp:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
    group = f"{USER}:x:{GID}:\nnogroup:x:65534:\n"
    return passwd, group


def _data_fd(name: str, data: bytes) -> int:
    """A file descriptor bwrap reads `data` from (a memfd: any size, never blocks the writer)."""
    fd = os.memfd_create(f"gateway-sandbox-{name}")
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


async def start(tools: Tools, box: Box, argv: Sequence[str], *, stdin: int | IO[Any] | None = None,
                stdout: int | IO[Any] | None = None, stderr: int | IO[Any] | None = None,
                env: Mapping[str, str] | None = None) -> Running:
    """Start `argv` in `box`; the returned sandbox is made, then (network connected, pid_max
    capped) its command let go by its watchdog. `stdin`/`stdout`/`stderr` are as for
    asyncio.create_subprocess_exec (DEVNULL and two pipes by default); `env` is bwrap's
    environment (what the command gets unless `box.clear_env`). The caller owns the result:
    `close()` it, also when cancelled."""
    if box.network and tools.network is None:
        raise SandboxError("the network cannot be on: " + str(usernet.find()))
    info_read, info_write = os.pipe()
    block_read, block_write = os.pipe()
    given = [info_write, block_read]  # bwrap's ends: closed here once it has them
    try:
        passwd, group = _identity_files()
        identity = (_data_fd("passwd", passwd.encode()), _data_fd("group", group.encode()))
        given += identity
        given.append(seccomp_fd := _data_fd("seccomp", seccomp.program()))
        resolv_fd = None
        if box.network:
            assert tools.network is not None
            given.append(resolv_fd := _data_fd("resolv", tools.network.resolv_conf().encode()))
        options = bwrap_options(tools, box, info_fd=info_write, block_fd=block_read, identity_fds=identity,
                                seccomp_fd=seccomp_fd, resolv_fd=resolv_fd)
        given.append(args_fd := _data_fd("args", b"".join(arg.encode() + b"\0" for arg in options)))
        # Cancelled while starting, asyncio kills bwrap, and --die-with-parent the rest.
        proc = await asyncio.create_subprocess_exec(
            tools.bwrap, "--args", str(args_fd), "--", *inside_command(tools, box, argv),
            stdin=asyncio.subprocess.DEVNULL if stdin is None else stdin,
            stdout=asyncio.subprocess.PIPE if stdout is None else stdout,
            stderr=asyncio.subprocess.PIPE if stderr is None else stderr,
            pass_fds=tuple(given), env=dict(env or {}), start_new_session=True)
    except BaseException as err:
        os.close(info_read)
        os.close(block_write)
        if isinstance(err, OSError):
            raise SandboxError(f"cannot start bwrap: {err.strerror or err}") from None
        raise
    finally:
        for fd in given:
            os.close(fd)
    pid_cap = tools.nsenter if os.geteuid() == 0 and _pid_max_per_namespace() else None
    return Running(proc, info_read, block_write, box, tools.network if box.network else None, pid_cap)


async def run(tools: Tools, box: Box, argv: Sequence[str], *, stdin: bytes | None = None,
              timeout_s: float) -> Outcome:
    """Run `argv` in `box` for at most `timeout_s`, its output captured (capped). Cancelling
    the caller kills the sandbox and everything in it before this returns."""
    running = await start(tools, box, argv, stdin=asyncio.subprocess.PIPE if stdin is not None else None)
    outcome = await running.finish(stdin, timeout_s)
    if running.failure is not None:
        raise SandboxError(running.failure)
    return outcome


def _pid_max_per_namespace() -> bool:
    """Whether each PID namespace has a pid_max of its own (Linux 6.14). Before that the
    setting is the machine's: never written then."""
    try:
        major, minor = (int(part) for part in os.uname().release.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (6, 14)


class Running:
    """One running sandbox: its watchdog (which lets the command start), its network stack,
    and the way to kill it."""

    def __init__(self, proc: asyncio.subprocess.Process, info_fd: int, block_fd: int, box: Box,
                 network: usernet.Stack | None, nsenter: str | None) -> None:
        self.proc = proc
        self.info_fd: int | None = info_fd
        self.block_fd: int | None = block_fd  # writing to it lets the command start
        self.max_tasks = box.limits.tasks
        self.box = box
        self.network = network
        self.nsenter = nsenter  # set: cap the PID namespace's pid_max before the command starts
        self.pidfd: int | None = None  # of the PID namespace's first process
        self.outcome = Outcome(None, Captured(), Captured())
        self.failure: str | None = None  # why the sandbox was not let run (SandboxError's text)
        self.stack: asyncio.subprocess.Process | None = None  # the network stack's process
        self.stack_log = Captured()
        self.started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # Its error is read here, so one nobody awaits is never reported as unretrieved.
        self.started.add_done_callback(lambda f: f.exception() if not f.cancelled() else None)
        self._helpers = [asyncio.create_task(self._watch(), name=f"sandbox-watch:{proc.pid}")]
        self._closed = False

    @property
    def killed_for(self) -> str | None:
        return self.outcome.killed_for

    async def until_started(self, timeout_s: float) -> None:
        """Wait until the command was let go; SandboxError if it never will be."""
        try:
            await asyncio.wait_for(asyncio.shield(self.started), timeout_s)
        except TimeoutError:
            raise SandboxError(f"the sandbox was not ready within {timeout_s:g} s") from None

    async def finish(self, stdin: bytes | None, timeout_s: float) -> Outcome:
        """Capture the output until the sandbox ends or `timeout_s` passed; then nothing of it is left."""
        proc = self.proc
        assert proc.stdout is not None and proc.stderr is not None
        if stdin is not None:
            self._helpers.append(asyncio.create_task(_feed(proc, stdin), name=f"sandbox-stdin:{proc.pid}"))
        ended = asyncio.create_task(self._ended(), name=f"sandbox-wait:{proc.pid}")
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.shield(ended)
        except TimeoutError:
            self.outcome.timed_out = True
        finally:
            # Ended, timed out, or the call was cancelled: nothing of it outlives the call.
            self.kill()
            try:
                if not ended.done():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(asyncio.shield(ended), KILL_WAIT_S)
                if not ended.done():
                    ended.cancel()
                    log.error("a killed sandbox did not end", extra={"pid": proc.pid})
                await asyncio.gather(ended, return_exceptions=True)
            finally:
                await self.close()
        self.outcome.returncode = proc.returncode
        return self.outcome

    async def _ended(self) -> None:
        proc = self.proc
        assert proc.stdout is not None and proc.stderr is not None
        await asyncio.gather(_capture(proc.stdout, self.outcome.stdout), _capture(proc.stderr, self.outcome.stderr))
        await proc.wait()

    def kill(self) -> None:
        if self.pidfd is not None:
            with contextlib.suppress(OSError):  # already gone
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
        if self.proc.returncode is None:  # not reaped: its process group cannot be someone else's yet
            with contextlib.suppress(OSError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        if self.stack is not None and self.stack.returncode is None:
            with contextlib.suppress(OSError):
                os.killpg(self.stack.pid, signal.SIGKILL)

    async def close(self) -> None:
        """Kill what is left of it, reap it and its network stack, stop the watchdog. Safe
        to call more than once; cancelled, it still kills and stops everything (the reaping
        goes on by itself)."""
        if self._closed:
            return
        self._closed = True
        self.kill()
        waits = [self.proc.wait(), self._until_init_ended()] + ([self.stack.wait()] if self.stack is not None else [])
        reaping = asyncio.ensure_future(asyncio.gather(*waits, return_exceptions=True))
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(reaping), KILL_WAIT_S)
        finally:
            for task in self._helpers:
                task.cancel()
            await asyncio.gather(*self._helpers, return_exceptions=True)
            if not self.started.done():
                self.started.set_exception(SandboxError(self.failure or "the sandbox ended before its command started"))
            self._close_fds()

    async def _until_init_ended(self) -> None:
        """Wait for the PID namespace's first process to end: the kernel ends it only once
        every other process of the namespace is gone (bwrap itself may be reaped before)."""
        if self.pidfd is None:
            return
        loop = asyncio.get_running_loop()
        ended = loop.create_future()
        fd = self.pidfd
        loop.add_reader(fd, lambda: ended.done() or ended.set_result(None))  # a pidfd is readable once it ended
        try:
            await ended
        finally:
            loop.remove_reader(fd)

    def _close_fds(self) -> None:
        for fd in (self.pidfd, self.info_fd, self.block_fd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.pidfd = self.info_fd = self.block_fd = None

    def _start_command(self) -> None:
        fd, self.block_fd = self.block_fd, None
        if fd is not None:
            with contextlib.suppress(OSError):  # bwrap already gone
                os.write(fd, b"go")
            os.close(fd)

    def _fail(self, why: str) -> None:
        """The command must not run: say why, and kill the sandbox."""
        self.failure = why
        log.warning("sandbox not started", extra={"error": why})
        if not self.started.done():
            self.started.set_exception(SandboxError(why))
        self.kill()

    async def _cap_pids(self, init_pid: int) -> None:
        """pid_max of the sandbox's PID namespace, set from inside its user namespace (so
        that on a kernel without per-namespace pid_max the write cannot reach the machine's):
        no more tasks than that can exist in it, whoever the kernel thinks they are."""
        assert self.nsenter is not None
        value = max(self.max_tasks + 2, PID_MAX_MIN)  # pids 1 and 2 are bwrap's and the command's
        machine = await asyncio.to_thread(_read_pid_max)
        # The user namespace that owns the PID namespace: bwrap's first process moves on to
        # a nested one (--disable-userns), where pid_max is not the sandbox's to set.
        owner = _owner_of(f"/proc/{init_pid}/ns/pid")
        try:
            error = ""
            for _ in range(PID_CAP_ATTEMPTS):  # bwrap may not have written the namespace's uid map yet
                error = await self._write_pid_max(owner, init_pid, value)
                if not error:
                    break
                await asyncio.sleep(PID_CAP_RETRY_S)
            else:
                log.warning("cannot cap the sandbox's pid_max (%s); the watchdog alone counts its processes", error)
        finally:
            os.close(owner)
        after = await asyncio.to_thread(_read_pid_max)
        if machine is not None and after != machine:  # never: the kernel said otherwise
            await asyncio.to_thread(_write_pid_max, machine)
            log.error("writing the sandbox's pid_max changed the machine's; put back", extra={"value": machine})

    async def _write_pid_max(self, owner: int, init_pid: int, value: int) -> str:
        """One attempt; what went wrong, or ""."""
        assert self.nsenter is not None
        proc = await asyncio.create_subprocess_exec(
            self.nsenter, f"--user=/proc/self/fd/{owner}", f"--pid=/proc/{init_pid}/ns/pid",
            "--preserve-credentials", "--", "/bin/sh", "-c", f"echo {value} > /proc/sys/kernel/pid_max",
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
            pass_fds=(owner,), env={}, start_new_session=True)
        try:
            async with asyncio.timeout(PID_CAP_TIMEOUT_S):
                _, err = await proc.communicate()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        if proc.returncode == 0:
            return ""
        return err.decode("utf-8", "replace").strip()[-300:] or f"exit code {proc.returncode}"

    async def _connect(self, init_pid: int) -> None:
        """Start the network stack against the sandbox's network namespace and wait until
        it has connected it (SandboxError if it does not within NETWORK_START_TIMEOUT_S)."""
        stack = self.network
        assert stack is not None
        netns = os.open(f"/proc/{init_pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        owner: int | None = None
        ready_read, ready_write = os.pipe()
        try:
            owner = _owner_of(f"/proc/self/fd/{netns}")
            argv = stack.argv(f"/proc/self/fd/{netns}", f"/proc/self/fd/{owner}", ready_write)
            try:
                self.stack = await asyncio.create_subprocess_exec(
                    *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                    stderr=asyncio.subprocess.PIPE, pass_fds=(netns, owner, ready_write), env={},
                    start_new_session=True)
            except OSError as err:
                raise SandboxError(f"cannot start {stack.kind}: {err.strerror or err}") from None
        finally:
            for fd in (netns, owner, ready_write):
                if fd is not None:
                    os.close(fd)
        assert self.stack.stderr is not None
        self._helpers.append(asyncio.create_task(_capture(self.stack.stderr, self.stack_log, NETWORK_LOG_BYTES),
                                                 name=f"sandbox-network-log:{self.proc.pid}"))
        try:
            ready = await asyncio.wait_for(_read_all(ready_read, 64), NETWORK_START_TIMEOUT_S)
        except TimeoutError:
            self.kill()
            raise SandboxError(f"{stack.kind} did not connect the sandbox to the network within "
                               f"{NETWORK_START_TIMEOUT_S:g} s") from None
        if not ready:  # it ended, or closed the pipe, without saying it was ready
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stack.wait(), KILL_WAIT_S)
            text = bytes(self.stack_log.data).decode("utf-8", "replace")
            last = next((ln.strip() for ln in reversed(text.splitlines()) if ln.strip()
                         and "syslog" not in ln), "")
            raise SandboxError(f"{stack.kind} could not connect the sandbox to the network: "
                               f"{last[:300] or f'exit code {self.stack.returncode}'}")

    async def _watch(self) -> None:
        """Learn the PID namespace's first process from bwrap (cap its pid_max, connect its
        network), let the command start, then count the namespace's tasks and watch the disk,
        and kill the sandbox past the caps."""
        try:
            init_pid = await self._prepare()
        except SandboxError as err:
            self._fail(str(err))
            return
        except Exception as err:
            log.exception("cannot watch the sandbox")
            self._fail(f"cannot watch the sandbox: {type(err).__name__}: {err}")
            return
        if init_pid is None:  # bwrap ended before it made the sandbox (its stderr says why)
            self._start_command()
            if not self.started.done():
                self.started.set_exception(SandboxError("bwrap ended before the sandbox was made"))
            return
        self._start_command()
        if not self.started.done():
            self.started.set_result(None)
        disk = self.box.disk
        next_walk = time.monotonic()
        while True:
            count, low = await asyncio.to_thread(_check, init_pid, self.max_tasks, self.box.workdir if disk else None)
            if count > self.max_tasks:
                self.outcome.too_many_tasks = True
                log.warning("sandbox killed: too many processes", extra={"tasks": count})
                self.kill()
                return
            if low is not None:
                self._kill_for_disk(f"{low}: the sandbox was killed before it filled the disk")
                return
            if disk is not None and disk.quota_bytes is not None and time.monotonic() >= next_walk:
                began = time.monotonic()
                held = await asyncio.to_thread(usage, self.box.workdir)
                took = time.monotonic() - began
                next_walk = time.monotonic() + max(DISK_WALK_MIN_S, 3 * took)
                if held.entries > DISK_MAX_ENTRIES:
                    self._kill_for_disk(f"more than {DISK_MAX_ENTRIES:,} files and directories in the workspace")
                    return
                if held.used_bytes > disk.quota_bytes:
                    self._kill_for_disk(f"the workspace grew past its {disk.quota_bytes >> 20:,} MB "
                                        "(tools.exec.disk_mb)")
                    return
            await asyncio.sleep(WATCH_INTERVAL_S)

    def _kill_for_disk(self, why: str) -> None:
        self.outcome.disk_full = why
        log.warning("sandbox killed for the disk", extra={"error": why})
        self.kill()

    async def _prepare(self) -> int | None:
        info = await self._info()
        init_pid, pid_ns = info.get("child-pid"), info.get("pid-namespace")
        if not isinstance(init_pid, int) or init_pid <= 0:
            return None
        with contextlib.suppress(OSError):  # no pidfds, or no look at it: SIGKILL to bwrap still ends it
            pidfd = os.pidfd_open(init_pid)
            # Still the sandbox's (not a process that got its number since): then the pidfd is.
            if os.stat(f"/proc/{init_pid}/ns/pid").st_ino == pid_ns:
                self.pidfd = pidfd
            else:
                os.close(pidfd)
        if self.pidfd is None:
            raise SandboxError("cannot hold the sandbox's first process (no pidfd): its processes could not be "
                               "counted")
        if self.nsenter is not None:
            try:
                await self._cap_pids(init_pid)
            except (OSError, TimeoutError) as err:
                log.warning("cannot cap the sandbox's pid_max", extra={"error": repr(err)})
        if self.network is not None:
            await self._connect(init_pid)
        return init_pid

    async def _info(self) -> dict[str, Any]:
        """What bwrap tells of the sandbox once it made it (child-pid, pid-namespace, …)."""
        fd = self.info_fd
        assert fd is not None
        self.info_fd = None  # _chunks owns it now
        raw = b""
        async with contextlib.aclosing(_chunks(fd)) as chunks:
            async for chunk in chunks:
                raw += chunk
                if len(raw) > INFO_MAX_BYTES:
                    return {}
                try:
                    info = json.loads(raw)
                except ValueError:
                    continue  # bwrap writes it whole, but a pipe may hand it over in parts
                return info if isinstance(info, dict) else {}
        return {}  # bwrap ended before it said


def _owner_of(namespace: str) -> int:
    """A file descriptor of the user namespace that owns `namespace` (a path to one)."""
    fd = os.open(namespace, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return fcntl.ioctl(fd, NS_GET_USERNS)
    finally:
        os.close(fd)


async def _chunks(fd: int) -> AsyncIterator[bytes]:
    """What a pipe's read end gives, chunk by chunk, until its writers closed it (`fd` is
    closed at the end)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=INFO_MAX_BYTES)
    pipe = os.fdopen(fd, "rb", buffering=0)
    try:
        transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
    except BaseException:
        pipe.close()
        raise
    try:
        while chunk := await reader.read(4096):
            yield chunk
    finally:
        transport.close()


async def _read_all(fd: int, limit: int) -> bytes:
    """The first bytes written to a pipe (up to `limit`), or b"" once its writers closed it."""
    async with contextlib.aclosing(_chunks(fd)) as chunks:
        async for chunk in chunks:
            return chunk[:limit]
    return b""


def _check(init_pid: int, cap: int, workdir: Path | None) -> tuple[int, str | None]:
    """One look of the watchdog: the sandbox's tasks, and whether the disk is low."""
    return _tasks_in(init_pid, cap), disk_low(workdir) if workdir is not None else None


def _read_pid_max() -> int | None:
    try:
        return int(Path("/proc/sys/kernel/pid_max").read_text())
    except (OSError, ValueError):
        return None


def _write_pid_max(value: int) -> None:
    with contextlib.suppress(OSError):
        Path("/proc/sys/kernel/pid_max").write_text(f"{value}\n")


def _tasks_in(init_pid: int, cap: int) -> int:
    """Processes and threads in the PID namespace whose first process is `init_pid`, read
    from the sandbox's own /proc (which lists that namespace alone). Stops counting past `cap`."""
    proc = f"/proc/{init_pid}/root/proc"
    total = 0
    try:
        # While bwrap sets up, that process's root is still ours, and its /proc lists the
        # whole machine: only a procfs other than ours is the sandbox's.
        if os.stat(proc).st_dev == os.stat("/proc").st_dev:
            return 0
        entries = [e.name for e in os.scandir(proc) if e.name.isdigit()]
    except OSError:
        return 0  # not mounted yet, or already gone
    if len(entries) > cap:
        return len(entries)
    for name in entries:
        try:
            with open(f"{proc}/{name}/stat", "rb") as fh:
                line = fh.read()
            total += int(line[line.rindex(b")") + 2:].split()[17])  # num_threads
        except (OSError, ValueError, IndexError):
            continue  # it ended meanwhile
        if total > cap:
            break
    return total


async def _capture(stream: asyncio.StreamReader, into: Captured, limit: int = OUTPUT_MAX_BYTES) -> None:
    while chunk := await stream.read(65_536):
        room = limit - len(into.data)
        if room > 0:
            into.data += chunk[:room]
        into.dropped += max(0, len(chunk) - max(room, 0))


async def _feed(proc: asyncio.subprocess.Process, data: bytes) -> None:
    assert proc.stdin is not None
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # it did not read it all
        proc.stdin.write(data)
        await proc.stdin.drain()
    with contextlib.suppress(OSError):
        proc.stdin.close()


TIDY_MAX_DEPTH = 256  # directories deep: the walk holds one descriptor a level
_TIDY_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_SET_ID = stat.S_ISUID | stat.S_ISGID


def tidy(root: Path) -> int:
    """After a run: take set-user-ID and set-group-ID bits off the files the command left
    (outside, its user is the gateway's, which may be root), and remove FIFOs and sockets (a
    FIFO where the gateway later reads a file, an image in files/ say, would hold the
    reading thread). Returns how many entries it changed.

    Another sandbox of the same workspace may still run and swap names meanwhile, so nothing
    is done by path: each directory is opened O_NOFOLLOW relative to its parent's
    descriptor, a file's bits are read with fstat on the descriptor that is then fchmod-ed,
    and a FIFO goes with unlinkat in its directory's descriptor. A name swapped for a link
    is skipped, never followed."""
    try:
        top = os.open(root, _TIDY_DIR)
    except OSError:
        return 0
    changed = seen = 0
    stack: list[tuple[int, list[str]]] = []  # (a directory, its subdirectories still to walk)
    current: int | None = top
    try:
        while current is not None or stack:
            if current is not None:
                subdirs: list[str] = []
                try:
                    with os.scandir(current) as entries:
                        for entry in entries:
                            seen += 1
                            if seen > TIDY_MAX_ENTRIES:
                                log.warning("workspace too large to tidy after exec", extra={"entries": seen})
                                return changed
                            try:
                                mode = entry.stat(follow_symlinks=False).st_mode
                            except OSError:
                                continue
                            if stat.S_ISDIR(mode):
                                subdirs.append(entry.name)
                            elif stat.S_ISREG(mode):
                                if mode & _SET_ID:
                                    changed += _drop_set_id(current, entry.name)
                            elif not stat.S_ISLNK(mode):  # FIFO, socket (devices cannot be made in it)
                                with contextlib.suppress(OSError):
                                    os.unlink(entry.name, dir_fd=current)
                                    changed += 1
                except OSError:
                    pass
                if subdirs and len(stack) >= TIDY_MAX_DEPTH:
                    log.warning("workspace too deep to tidy after exec", extra={"depth": len(stack)})
                    subdirs = []
                stack.append((current, subdirs))
                current = None
            parent, pending = stack[-1]
            if not pending:
                os.close(stack.pop()[0])
                continue
            try:
                current = os.open(pending.pop(), _TIDY_DIR, dir_fd=parent)
            except OSError:  # gone, or swapped for a link meanwhile: not followed
                current = None
    finally:
        if current is not None:
            os.close(current)
        for fd, _ in stack:
            os.close(fd)
    return changed


def _drop_set_id(dir_fd: int, name: str) -> int:
    """Take the set-ID bits off the regular file `name` in `dir_fd`, judged by fstat of the
    very descriptor that is changed (1 when it was). A file its owner may not read is
    opened O_PATH and changed through /proc/self/fd, which names that inode (fchmod
    refuses an O_PATH descriptor)."""
    by_path = False
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except PermissionError:
        try:
            fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        except OSError:
            return 0
        by_path = True
    except OSError:
        return 0
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or not st.st_mode & _SET_ID:
            return 0
        mode = stat.S_IMODE(st.st_mode) & ~_SET_ID
        if by_path:
            os.chmod(f"/proc/self/fd/{fd}", mode)
        else:
            os.fchmod(fd, mode)
        return 1
    except OSError:
        return 0
    finally:
        os.close(fd)
