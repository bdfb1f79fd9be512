"""The sandbox that `exec` (SPEC §5.7) and sandboxed MCP servers run in: bubblewrap.

What a command sees: one working directory of the host (read-write, at a path of our
choosing), the system's programs and libraries read-only (/usr, and /bin, /sbin, /lib*
as links or read-only directories), the few /etc files programs need, a private /tmp and
/dev/shm (tmpfs, bounded in size), a /proc of its own PID namespace and a minimal /dev.
Nothing else of the host: no data dir, no other scope, no config file, no gateway
environment (`--clearenv`), no network unless asked. Every namespace is new, and so is
the session (nothing can be typed into the gateway's terminal).

Limits, without cgroups:
- memory: RLIMIT_AS of each process; the OOM killer picks the sandbox first (oom_score_adj 1000);
- CPU: exec's commands run SCHED_IDLE, behind every other process of the machine;
- processes: RLIMIT_NPROC, set inside the sandbox's own user namespace, where the kernel
  counts the sandbox's tasks alone (the gateway's user keeps its own count). The kernel
  does not enforce it for uid 0, and a gateway run as root makes the sandbox's user root
  outside; there the PID namespace's own pid_max (Linux 6.14 and later) is set before the
  command starts (bwrap waits on --block-fd meanwhile). A watchdog also counts the tasks
  of the PID namespace and kills the sandbox past the cap, whatever held it;
- files: RLIMIT_FSIZE; no core dumps; /tmp and /dev/shm hold at most their size;
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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("gateway.sandbox")

SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin"
WORKDIR = "/workspace"  # where exec's workspace appears: the host's path never shows
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
TIDY_MAX_ENTRIES = 200_000  # a workspace is walked after each run up to this many entries

# Top-level system paths: symlinks into /usr on merged-/usr systems, directories elsewhere.
SYSTEM_DIRS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
# /etc is bound file by file: a process in the sandbox runs as the gateway's user outside,
# so any file of that user (as root: /etc/shadow, /etc/ssl/private) would be readable.
ETC_ALWAYS = ("ld.so.cache", "alternatives", "localtime")
ETC_NETWORK = ("resolv.conf", "hosts", "nsswitch.conf", "gai.conf", "host.conf", "services", "protocols",
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


@dataclass(frozen=True, slots=True)
class Limits:
    memory_mb: int | None  # RLIMIT_AS of each process; None: none (an MCP server's runtime decides)
    tmp_mb: int = 512  # size of /tmp
    tasks: int = MAX_TASKS
    file_bytes: int = FILE_MAX_BYTES


@dataclass(frozen=True, slots=True)
class Box:
    """One sandbox: the host directory it works in and what else it gets."""

    workdir: Path  # on the host, bound read-write
    inside: str = WORKDIR  # where it appears, and the working directory
    network: bool = False
    limits: Limits = Limits(memory_mb=512)
    read_only: tuple[Path, ...] = ()  # more host paths, read-only at the same path
    clear_env: bool = True  # False: the sandbox keeps bwrap's environment (given to it as a process)
    # Set inside the sandbox. These are on bwrap's command line, which any local user can
    # read: never a secret here (an MCP server's secrets come through bwrap's environment).
    setenv: Mapping[str, str] = field(default_factory=dict)
    unsetenv: tuple[str, ...] = ()
    # SCHED_IDLE: the sandbox runs only when nothing else wants the CPU, so a busy loop or a
    # fork bomb cannot starve the gateway (nor its watchdog); it cannot leave that policy.
    idle: bool = False


def exec_environment() -> dict[str, str]:
    """All that a command run by `exec` finds in its environment."""
    return {"PATH": SANDBOX_PATH, "HOME": "/tmp", "LANG": "C.UTF-8", "USER": USER, "LOGNAME": USER}


def command_line(tools: Tools, box: Box, argv: Sequence[str], *, info_fd: int | None = None,
                 block_fd: int | None = None, identity_fds: tuple[int, int] | None = None) -> list[str]:
    """The bwrap command line that runs `argv` in `box`."""
    args = [tools.bwrap,
            "--unshare-all",  # new user, mount, PID, IPC, UTS, cgroup and network namespaces
            "--unshare-user",  # always (--unshare-all only tries): the sandbox's own users, none of them root
            "--disable-userns",  # no nested user namespaces: less of the kernel in reach
            ]
    if box.network:
        args.append("--share-net")
    args += ["--uid", str(UID), "--gid", str(GID), "--hostname", USER,
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
    # Inside: limits set in the sandbox's user namespace (see the module's docstring).
    args += ["--", tools.prlimit, f"--nproc={limits.tasks}:{limits.tasks}",
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


_checked: dict[Tools, Availability] = {}
_probing: dict[Tools, asyncio.Future[Availability]] = {}


async def availability() -> Availability:
    """Whether a sandbox can be made here: the programs exist and a real one runs (once
    per bwrap; a missing program is looked for again next time)."""
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
    return known


def _find_tools() -> Tools | str:
    """The programs, or which one is missing."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return "bwrap (bubblewrap) is not installed"
    found: dict[str, str] = {}
    for name, package in HELPERS.items():
        path = shutil.which(name, path=SANDBOX_PATH)  # the sandbox sees the same /usr
        if path is None:
            return f"{name} ({package}) is not installed"
        found[name] = path
    return Tools(bwrap, **found, nsenter=shutil.which("nsenter", path=SANDBOX_PATH))


async def _probe(tools: Tools) -> Availability:
    scratch = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="gateway-sandbox-check-"))
    try:
        outcome = await run(tools, Box(scratch, limits=Limits(memory_mb=256, tmp_mb=1), setenv=exec_environment(),
                                       idle=True), ["/bin/sh", "-c", "echo sandbox-ok"], timeout_s=PROBE_TIMEOUT_S)
    except SandboxError as err:
        return Availability(None, str(err))
    finally:
        await asyncio.to_thread(shutil.rmtree, scratch, True)
    if outcome.returncode == 0 and bytes(outcome.stdout.data) == b"sandbox-ok\n":
        return Availability(tools)
    lines = [line.strip() for line in bytes(outcome.stderr.data).decode("utf-8", "replace").splitlines()]
    last = next((line for line in reversed(lines) if line), "")
    if outcome.timed_out:
        return Availability(None, f"the sandbox check did not finish within {PROBE_TIMEOUT_S:g} s", final=False)
    why = last.removeprefix("bwrap: ")[:300] or f"exit code {outcome.returncode}"
    return Availability(None, f"bwrap cannot make a sandbox here: {why}")


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

    @property
    def killed(self) -> bool:
        return self.timed_out or self.too_many_tasks


def _identity_pipes() -> tuple[int, int]:
    """/etc/passwd and /etc/group of the sandbox (one user, and nobody for every uid that is
    not mapped), as pipes bwrap reads them from."""
    passwd = f"{USER}:x:{UID}:{GID}:{USER}:/tmp:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
    group = f"{USER}:x:{GID}:\nnogroup:x:65534:\n"
    fds: list[int] = []
    for text in (passwd, group):
        read, write = os.pipe()
        try:
            os.write(write, text.encode())  # far below a pipe's buffer
        finally:
            os.close(write)
        fds.append(read)
    return fds[0], fds[1]


async def run(tools: Tools, box: Box, argv: Sequence[str], *, stdin: bytes | None = None,
              timeout_s: float) -> Outcome:
    """Run `argv` in `box` for at most `timeout_s`, its output captured (capped). Cancelling
    the caller kills the sandbox and everything in it before this returns."""
    info_read, info_write = os.pipe()
    block_read, block_write = os.pipe()
    given = [info_write, block_read]  # bwrap's ends: closed here once it has them
    try:
        identity = _identity_pipes()
        given += identity
        cmd = command_line(tools, box, argv, info_fd=info_write, block_fd=block_read, identity_fds=identity)
        # Cancelled while starting, asyncio kills bwrap, and --die-with-parent the rest.
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            pass_fds=tuple(given), env={}, start_new_session=True)
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
    return await _Sandbox(proc, info_read, block_write, box.limits.tasks, pid_cap).finish(stdin, timeout_s)


def _pid_max_per_namespace() -> bool:
    """Whether each PID namespace has a pid_max of its own (Linux 6.14). Before that the
    setting is the machine's: never written then."""
    try:
        major, minor = (int(part) for part in os.uname().release.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (6, 14)


class _Sandbox:
    """One running sandbox: its output, its watchdog, and the way to kill it."""

    def __init__(self, proc: asyncio.subprocess.Process, info_fd: int, block_fd: int, max_tasks: int,
                 nsenter: str | None) -> None:
        self.proc = proc
        self.info_fd: int | None = info_fd
        self.block_fd: int | None = block_fd  # writing to it lets the command start
        self.max_tasks = max_tasks
        self.nsenter = nsenter  # set: cap the PID namespace's pid_max before the command starts
        self.pidfd: int | None = None  # of the PID namespace's first process
        self.outcome = Outcome(None, Captured(), Captured())

    async def finish(self, stdin: bytes | None, timeout_s: float) -> Outcome:
        proc = self.proc
        assert proc.stdout is not None and proc.stderr is not None
        helpers = [asyncio.create_task(self._watch(), name=f"sandbox-watch:{proc.pid}")]
        if stdin is not None:
            helpers.append(asyncio.create_task(_feed(proc, stdin), name=f"sandbox-stdin:{proc.pid}"))
        ended = asyncio.create_task(self._ended(), name=f"sandbox-wait:{proc.pid}")
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.shield(ended)
        except TimeoutError:
            self.outcome.timed_out = True
        finally:
            # Ended, timed out, or the call was cancelled: nothing of it outlives the call.
            self.kill()
            for task in helpers:
                task.cancel()
            try:
                if not ended.done():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(asyncio.shield(ended), KILL_WAIT_S)
                if not ended.done():
                    ended.cancel()
                    log.error("a killed sandbox did not end", extra={"pid": proc.pid})
                await asyncio.gather(ended, *helpers, return_exceptions=True)
            finally:
                self._close()
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

    def _close(self) -> None:
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

    async def _cap_pids(self, init_pid: int) -> None:
        """pid_max of the sandbox's PID namespace, set from inside its user namespace (so
        that on a kernel without per-namespace pid_max the write cannot reach the machine's):
        no more tasks than that can exist in it, whoever the kernel thinks they are."""
        assert self.nsenter is not None
        value = max(self.max_tasks + 2, PID_MAX_MIN)  # pids 1 and 2 are bwrap's and the command's
        machine = await asyncio.to_thread(_read_pid_max)
        # The user namespace that owns the PID namespace: bwrap's first process moves on to
        # a nested one (--disable-userns), where pid_max is not the sandbox's to set.
        pid_ns = os.open(f"/proc/{init_pid}/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        try:
            owner = fcntl.ioctl(pid_ns, NS_GET_USERNS)
        finally:
            os.close(pid_ns)
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

    async def _watch(self) -> None:
        """Learn the PID namespace's first process from bwrap (and cap its pid_max), let the
        command start, then count the namespace's tasks and kill the sandbox past the cap."""
        try:
            init_pid = await self._prepare()
        except Exception:  # the command still runs, under its rlimits and timeout
            log.exception("cannot watch the sandbox")
            init_pid = None
        finally:
            self._start_command()
        if init_pid is None:
            return
        while True:
            count = await asyncio.to_thread(_tasks_in, init_pid, self.max_tasks)
            if count > self.max_tasks:
                self.outcome.too_many_tasks = True
                log.warning("sandbox killed: too many processes", extra={"tasks": count})
                self.kill()
                return
            await asyncio.sleep(WATCH_INTERVAL_S)

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
        if self.nsenter is not None:
            try:
                await self._cap_pids(init_pid)
            except (OSError, TimeoutError) as err:
                log.warning("cannot cap the sandbox's pid_max", extra={"error": repr(err)})
        return init_pid

    async def _info(self) -> dict[str, Any]:
        """What bwrap tells of the sandbox once it made it (child-pid, pid-namespace, …)."""
        fd = self.info_fd
        assert fd is not None
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=INFO_MAX_BYTES)
        pipe = os.fdopen(fd, "rb", buffering=0)
        self.info_fd = None  # the pipe object owns it now, then the transport
        try:
            transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
        except BaseException:
            pipe.close()
            raise
        try:
            raw = b""
            while len(raw) < INFO_MAX_BYTES:
                chunk = await reader.read(4096)
                if not chunk:
                    return {}  # bwrap ended before it said
                raw += chunk
                try:
                    info = json.loads(raw)
                except ValueError:
                    continue  # bwrap writes it whole, but a pipe may hand it over in parts
                return info if isinstance(info, dict) else {}
            return {}
        finally:
            transport.close()


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


async def _capture(stream: asyncio.StreamReader, into: Captured) -> None:
    while chunk := await stream.read(65_536):
        room = OUTPUT_MAX_BYTES - len(into.data)
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
