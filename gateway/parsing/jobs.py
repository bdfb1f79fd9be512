"""One parse job in a child process, bounded in every way an untrusted file could exhaust the
gateway (SPEC §9; the red team's H1, H2, M1).

`run(kind, …)` starts `python -m gateway.parsing.child` for each job: a fresh interpreter
with an empty environment (no secret reaches it), its own session (killed as a group),
no inherited descriptors but stdin (a file the gateway opened, or a pipe it writes),
stdout and stderr. The child limits its own CPU seconds and address space before it
reads its input (child.py); the gateway kills it (SIGKILL) at its wall-clock limit, or
when the caller gives up (a cancelled tool), and always waits for it, so no job outlives
its call, as a zombie or otherwise. The answer is read up to a cap. Jobs wait for a
slot in their lane (two for documents, two for images): a burst of pages queues instead
of starting fifty processes, and a page never delays a person's photo. Every failure is
a ParseError whose text is for the model or the person; nothing else is raised.

A process per job, not a pool of warm ones: each job starts clean (one hostile file
cannot leave state for the next), is limited and killed on its own, and pays only its
own imports. Measured on the 2-core box, start to answer for a tiny input: 0.06 s for an
image (Pillow), 0.11 s for a PDF (pypdf), 0.28 s for a page (trafilatura; 0.03 s warm,
in-process); a 4000×3000 photo scaled takes 0.27 s against 0.28 s of decoding in-process.
A warm fork server would save the page's quarter second, next to a fetch and a model call
that take seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

log = logging.getLogger("gateway.parsing")


@dataclass(frozen=True, slots=True)
class Limits:
    cpu_s: int  # the child's RLIMIT_CPU: SIGXCPU there, SIGKILL a second later
    wall_s: float  # the gateway kills it after this long, CPU or not (a child starved on a busy box, a hang)
    memory_mb: int  # the child's RLIMIT_AS (address space: the interpreter and its libraries count)
    output_mb: int  # the most of its answer the gateway reads back


# How they were chosen (2-core box, pypdf 7, trafilatura 2.3, Pillow 12):
# - html: a real 4.4 MB page (the Rust reference, print view) takes 9.8 s of CPU and 350 MB
#   of address space, a 1.9 MB one 4.9 s and 200 MB; most pages well under a second. 20 s
#   is twice the largest; 1 GB three times its memory. H1's crafted table (1.4 MB) would
#   take over an hour and tens of GB (400 rows of it, 19 KB: 51 s and 1 GB).
# - pdf: pypdf reads ~50 text pages a second (36 pages: 0.7 s, 57 MB); 30 s is a book.
#   H2's 85 KB PDF needs 452 s (ten pages sharing a stream of 100,000 operators: 25 s).
# - image: decoding is bounded by DECODE_PIXELS (image_scale.py): at 4096×4096 a job peaks
#   at 250 MB of address space (RGBA PNG, EXIF-turned too), 330-390 MB (WebP, RGB and
#   RGBA), 200 MB (CMYK or float TIFF); a 4000×3000 camera JPEG at 145 MB. 768 MB is
#   twice the worst; 10 s of CPU is ten times the slowest (0.8 s).
# wall_s leaves room for a box whose two cores are busy; with QUEUE_WAIT_S a document's
# read stays inside the 60 s the agent gives a tool (gateway.turns.agent.TOOL_TIMEOUT_S).
LIMITS: dict[str, Limits] = {
    "html": Limits(cpu_s=20, wall_s=30, memory_mb=1024, output_mb=32),
    "pdf": Limits(cpu_s=30, wall_s=40, memory_mb=1024, output_mb=32),
    "image": Limits(cpu_s=10, wall_s=20, memory_mb=768, output_mb=16),
}
LANE_OF = {"html": "documents", "pdf": "documents", "image": "images"}
# Jobs running at once per lane: a job is CPU-bound, the box has two cores, and the gateway
# needs one too. Worst case 2 × 1 GB + 2 × 768 MB of children.
LANE_JOBS = {"documents": 2, "images": 2}
QUEUE_WAIT_S = 10.0  # waiting longer for a slot means the gateway is busy: said, not queued forever
HEADER_MAX_BYTES = 1 << 20  # the answer's JSON line (a PDF's page lengths: ~6 bytes a page)
STDERR_TAIL_BYTES = 2000  # what a crashed child said, for the log
FEED_BLOCK = 1 << 20

CHILD_MODULE = "gateway.parsing.child"
# -E -s: no PYTHON* variables, no user site; -B: no bytecode written (the child may write no file).
CHILD_FLAGS = ("-E", "-s", "-B", "-X", "utf8", "-m", CHILD_MODULE)
ROOT = Path(__file__).resolve().parents[2]  # holds the gateway package: `-m` finds it from here
BUSY = "the gateway is busy reading other files; try again in a minute"


class ParseError(Exception):
    """A job that gave no result; `str(exc)` says why, in words for the model or the person."""


@dataclass(frozen=True, slots=True)
class Answer:
    header: dict[str, Any]
    payload: bytes

    def text(self, what: str) -> str:
        try:
            return self.payload.decode("utf-8", "surrogatepass")  # as the child encoded it
        except UnicodeDecodeError:
            raise ParseError(f"{what} could not be read: the reader gave a malformed answer") from None


class _TooLarge(Exception):
    pass


_lanes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, asyncio.Semaphore]] = \
    weakref.WeakKeyDictionary()


def _lane(name: str) -> asyncio.Semaphore:
    """The lane's slots on the running loop (a semaphore belongs to one loop)."""
    lanes = _lanes.setdefault(asyncio.get_running_loop(), {})
    if name not in lanes:
        lanes[name] = asyncio.Semaphore(LANE_JOBS[name])
    return lanes[name]


async def run(kind: str, *, what: str, options: dict[str, Any] | None = None, data: bytes | None = None,
              file: BinaryIO | None = None, within_s: float | None = None) -> Answer:
    """Run one `kind` job (html, pdf, image) on `data` (sent through a pipe) or `file` (an
    open file, given as the child's stdin). `what` names the input in errors ("the page").
    `within_s` bounds the wait for a slot and the job together. Raises ParseError."""
    if (data is None) == (file is None):
        raise ValueError("give data or file")
    limits = LIMITS[kind]
    loop = asyncio.get_running_loop()
    deadline = None if within_s is None else loop.time() + within_s
    wait = QUEUE_WAIT_S if deadline is None else max(0.0, min(QUEUE_WAIT_S, deadline - loop.time()))
    lane = _lane(LANE_OF[kind])
    try:
        async with asyncio.timeout(wait):
            await lane.acquire()
    except TimeoutError:
        _log(kind, "busy", logging.WARNING)
        raise ParseError(f"{what} was not read: {BUSY}") from None
    try:
        wall = limits.wall_s if deadline is None else max(1.0, min(limits.wall_s, deadline - loop.time()))
        return await _run_child(kind, limits, wall, options or {}, data, file, what)
    finally:
        lane.release()


async def _run_child(kind: str, limits: Limits, wall_s: float, options: dict[str, Any], data: bytes | None,
                     file: BinaryIO | None, what: str) -> Answer:
    settings = {"cpu_s": limits.cpu_s, "memory_bytes": limits.memory_mb << 20, "parent": os.getpid(),
                "options": options}
    started = asyncio.get_running_loop().time()
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, *CHILD_FLAGS, kind, json.dumps(settings),
            stdin=file if file is not None else asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env={}, cwd=ROOT, start_new_session=True)
    except OSError as err:  # out of processes or descriptors
        log.error("a parse job could not start", extra={"kind": kind, "error": str(err)})
        raise ParseError(f"{what} was not read: {BUSY}") from None
    feeder = asyncio.create_task(_feed(proc.stdin, data)) if data is not None and proc.stdin else None
    tail = asyncio.create_task(_tail(proc.stderr))
    timed_out = too_large = False
    out = b""
    try:
        async with asyncio.timeout(wall_s):
            out = await _read_capped(proc.stdout, HEADER_MAX_BYTES + (limits.output_mb << 20))
            await proc.wait()
    except TimeoutError:
        timed_out = True
    except _TooLarge:
        too_large = True
    finally:
        await _reap(proc)
        for task in (feeder, tail):
            if task is not None and not task.done():
                task.cancel()
        said = b""
        with contextlib.suppress(asyncio.CancelledError):
            said = await tail
        if feeder is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await feeder
    seconds = round(asyncio.get_running_loop().time() - started, 2)
    if timed_out:
        _log(kind, "wall", logging.WARNING, pid=proc.pid, seconds=seconds)
        raise ParseError(f"{what} took too long to read (over {wall_s:g} s); it may be malformed")
    if too_large:
        _log(kind, "too_large", logging.WARNING, pid=proc.pid, seconds=seconds)
        raise ParseError(f"{what} could not be read: what it holds is larger than {limits.output_mb} MB")
    return _answer(kind, limits, proc.returncode, out, said, what, pid=proc.pid, seconds=seconds)


def _answer(kind: str, limits: Limits, code: int | None, out: bytes, said: bytes, what: str, *,
            pid: int, seconds: float) -> Answer:
    """The child's answer, or the ParseError its end means."""
    if code in (-signal.SIGXCPU, -signal.SIGKILL):  # the soft CPU limit, or the hard one a second later
        _log(kind, "cpu", logging.WARNING, pid=pid, seconds=seconds)
        raise ParseError(f"{what} took too long to read (over {limits.cpu_s} s of CPU); it may be malformed")
    line, newline, payload = out.partition(b"\n")
    header: Any = None
    if code == 0 and newline and len(line) <= HEADER_MAX_BYTES:  # parsed on the loop: kept small
        with contextlib.suppress(ValueError):
            header = json.loads(line)
    if not isinstance(header, dict):
        _log(kind, "crash", logging.WARNING, pid=pid, seconds=seconds, code=code,
             stderr=said[-STDERR_TAIL_BYTES:].decode("utf-8", "replace"))
        if code == 0:
            raise ParseError(f"{what} could not be read: the reader gave a malformed answer")
        why = _signal_name(-code) if code is not None and code < 0 else f"exit status {code}"
        raise ParseError(f"{what} could not be read: the reader stopped ({why}); it may be malformed")
    usage = {"pid": pid, "seconds": seconds, "cpu_s": header.get("cpu_s"), "peak_mb": header.get("peak_mb")}
    error = header.get("error")
    if error == "memory":
        _log(kind, "memory", logging.WARNING, **usage)
        raise ParseError(f"{what} needs more memory to read than allowed (over {limits.memory_mb} MB); "
                         "it may be malformed")
    if error == "unreadable":
        _log(kind, "unreadable", logging.INFO, **usage)
        raise ParseError(str(header.get("message") or f"{what} could not be read"))
    if error is not None:
        _log(kind, "failed", logging.WARNING, detail=header.get("message"), **usage)
        raise ParseError(f"{what} could not be read ({header.get('message')})")
    refused = header.get("image") == "too_large"
    _log(kind, "refused" if refused else "ok", logging.INFO if refused else logging.DEBUG, **usage)
    return Answer(header, payload)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _log(kind: str, outcome: str, level: int, **extra: Any) -> None:
    log.log(level, "parse job %s: %s", kind, outcome, extra={"kind": kind, "outcome": outcome, **extra})


async def _feed(stdin: asyncio.StreamWriter, data: bytes) -> None:
    """Write `data` to the child, a block at a time; a child that stopped reading (it
    refused the input, or was killed) ends it quietly."""
    view = memoryview(data)
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        for start in range(0, len(view), FEED_BLOCK):
            stdin.write(view[start:start + FEED_BLOCK])
            await stdin.drain()
        stdin.close()


async def _read_capped(stdout: asyncio.StreamReader | None, cap: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while stdout is not None and (chunk := await stdout.read(1 << 16)):
        size += len(chunk)
        if size > cap:
            raise _TooLarge
        chunks.append(chunk)
    return b"".join(chunks)


async def _tail(stderr: asyncio.StreamReader | None) -> bytes:
    """The last STDERR_TAIL_BYTES the child wrote to stderr (read to the end, kept short)."""
    kept = b""
    while stderr is not None and (chunk := await stderr.read(1 << 16)):
        kept = (kept + chunk)[-STDERR_TAIL_BYTES:]
    return kept


async def _reap(proc: asyncio.subprocess.Process) -> None:
    """Kill the child's process group unless it ended, and wait for it: never a zombie."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: a process it started goes too
    await asyncio.shield(proc.wait())
