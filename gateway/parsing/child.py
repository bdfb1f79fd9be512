"""The child process of one parse job: `python -m gateway.parsing.child KIND SETTINGS`.

Before it reads a byte of its input it limits itself (CPU seconds, address space, no core
dump, no file written) and, on Linux, asks to be killed when the gateway dies. Its input
is stdin (a file the gateway opened, or a pipe); its answer is one JSON header line, then
the payload (text as UTF-8, or an image's bytes), on what was stdout. Whatever a library
prints goes to stderr. The gateway (gateway.parsing.jobs) starts it with an empty
environment, and reads the answer up to a cap.
"""

from __future__ import annotations

import io
import json
import os
import resource
import signal
import sys
from typing import Any, BinaryIO

from gateway.parsing import Unreadable

MAX_PIPE_INPUT = 64 << 20  # the gateway sends at most tools.web_fetch.max_bytes (≤ 50 MB) through a pipe


def _cap(limit: int, value: int) -> None:
    """Lower `limit` to `value` (never above a hard limit already set)."""
    _soft, hard = resource.getrlimit(limit)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(limit, (value, value))


def confine(settings: dict[str, Any]) -> None:
    _cap(resource.RLIMIT_CORE, 0)
    _cap(resource.RLIMIT_FSIZE, 0)  # it writes no files (and -B: no bytecode either)
    _cap(resource.RLIMIT_AS, int(settings["memory_bytes"]))
    cpu = int(settings["cpu_s"])
    # SIGXCPU at the soft limit ends it; the hard one, a second later, is a SIGKILL.
    _soft, hard = resource.getrlimit(resource.RLIMIT_CPU)
    top = cpu + 1 if hard == resource.RLIM_INFINITY else min(hard, cpu + 1)
    resource.setrlimit(resource.RLIMIT_CPU, (min(cpu, top), top))
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != int(settings["parent"]):  # the gateway died before the line above
        os._exit(1)


def _input() -> BinaryIO:
    source = open(0, "rb", closefd=False)  # stdin, open until the process ends
    if source.seekable():  # a file: read as the job needs it
        return source
    data = source.read(MAX_PIPE_INPUT + 1)
    if len(data) > MAX_PIPE_INPUT:
        raise Unreadable(f"the input is larger than {MAX_PIPE_INPUT >> 20} MB")
    return io.BytesIO(data)


def run(kind: str, options: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
    """The job's header and payload; its failures become a header with `error`."""
    try:
        source = _input()
        if kind == "html":
            from gateway.parsing import html_text as module
        elif kind == "pdf":
            from gateway.parsing import pdf_text as module
        elif kind == "image":
            from gateway.parsing import image_scale as module
        else:
            return {"error": "failed", "message": f"no job of kind {kind!r}"}, b""
        header, payload = module.job(source, options)  # type: ignore[attr-defined]
    except MemoryError:
        return {"error": "memory"}, b""
    except Unreadable as err:
        return {"error": "unreadable", "message": str(err)}, b""
    except Exception as err:  # a library's bug on a strange input: said, not raised
        return {"error": "failed", "message": f"{type(err).__name__}: {str(err)[:200]}"}, b""
    if isinstance(payload, str):
        payload = payload.encode("utf-8", "surrogatepass")  # the gateway decodes it the same way
    return header, payload


def peak_mb() -> float | None:
    """This process's peak resident memory. Not ru_maxrss: Linux keeps that across exec,
    so it would report the gateway's own size at the fork."""
    try:
        with open("/proc/self/status", "rb") as status:
            for line in status:
                if line.startswith(b"VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)  # kB
    except OSError:
        pass
    return None


def main() -> None:
    kind, settings = sys.argv[1], json.loads(sys.argv[2])
    answer = os.dup(1)
    os.dup2(2, 1)  # a library's print() goes to stderr, never into the answer
    confine(settings)
    header, payload = run(kind, settings.get("options") or {})
    usage = resource.getrusage(resource.RUSAGE_SELF)
    header["cpu_s"] = round(usage.ru_utime + usage.ru_stime, 3)
    header["peak_mb"] = peak_mb()
    with os.fdopen(answer, "wb") as out:
        out.write(json.dumps(header).encode() + b"\n")
        out.write(payload)
    os._exit(0)  # no teardown of a large parsed tree: the process ends here


if __name__ == "__main__":
    main()
