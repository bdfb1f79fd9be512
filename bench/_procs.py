"""Shared helpers for the benchmarks and the crash tests: child processes (the gateway,
a fake model, a bare echo server), /proc readings, and the gateway config they run on.

Entry points for child processes (everything binds 127.0.0.1 on an ephemeral port and
announces its URL on the first stdout line):

    python -m bench._procs model [--delay-ms N]      # fake model; per-turn server times
    python -m bench._procs echo --model URL [--telegram BASE_URL]   # the ceiling

The fake model records, per turn tag, how long its own handler took, so a benchmark can
subtract the model's time from the end-to-end time ("added latency"). A turn tag is a
user text of the form `bench-<anything without spaces>`; GET <stats url>/times returns
and forgets `{tag: seconds}`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
TAG = re.compile(r"bench-\S+")
# The web chat's address, and the token its link carries (the web API needs it, SPEC §9;
# an older gateway, a baseline, printed none and needed none on loopback).
GATEWAY_ANNOUNCE = re.compile(r"gateway running: web chat on (http://[^/\s]+)/?(?:\?token=([\w-]+))?\s")


# ---------------------------------------------------------------------------- /proc


def cpu_seconds(pid: int) -> float:
    """User + system CPU time the process has used so far (from /proc/<pid>/stat)."""
    return cpu_seconds_of(Path(f"/proc/{pid}/stat"))


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    """User + system CPU time of each thread of the process so far, by thread id (the main
    thread's id is the pid): the event loop against the database's and other workers."""
    out: dict[int, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(task.name)] = cpu_seconds_of(task / "stat")
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue  # a thread that ended meanwhile
    return out


def cpu_seconds_of(stat_path: Path) -> float:
    raw = stat_path.read_text()
    fields = raw[raw.rindex(")") + 2:].split()  # the command name may hold spaces
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def rss_bytes(pid: int) -> int:
    """Resident set size now (from /proc/<pid>/statm)."""
    resident = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    return resident * PAGE_SIZE


# ---------------------------------------------------------------------------- children


def child_env(extra: dict[str, str] | None = None, *, root: Path = ROOT) -> dict[str, str]:
    """The environment of a child process: `root`'s packages first on the path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("OPENAI_API_KEY", None)  # the config names its own key
    env.update(extra or {})
    return env


@dataclass
class Child:
    """A child process whose first matching stdout line announced its URL. stderr goes to
    `log_path`; stdout is drained by an owned task so the child never blocks on it."""

    proc: asyncio.subprocess.Process
    url: str
    log_path: Path
    lines: list[str] = field(default_factory=list)
    _drain: asyncio.Task[None] | None = None
    token: str | None = None  # a gateway's web token, from its link

    @property
    def web_headers(self) -> dict[str, str]:
        """What a request to its web API sends along (nothing to a child without a token)."""
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.pid)

    def rss_bytes(self) -> int:
        return rss_bytes(self.pid)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    async def kill(self) -> int:
        """SIGKILL: no shutdown code runs (a crash)."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        code = await asyncio.wait_for(self.proc.wait(), 10)
        await self._stop_drain()
        return code

    async def stop(self, timeout: float = 30) -> int:
        """SIGTERM (graceful), then SIGKILL if it does not exit within `timeout`."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), timeout)
            except TimeoutError:
                return await self.kill()
        await self._stop_drain()
        assert self.proc.returncode is not None
        return self.proc.returncode

    async def _stop_drain(self) -> None:
        if self._drain is not None:
            self._drain.cancel()
            await asyncio.wait({self._drain}, timeout=2)
            self._drain = None


async def spawn(argv: Sequence[str], *, announce: re.Pattern[str], log_path: Path,
                timeout: float = 60, env: dict[str, str] | None = None, root: Path = ROOT) -> Child:
    """Start `argv` in `root` (a checkout) and wait (bounded) for the stdout line that
    gives its URL (group 1) and, for a gateway, its web token (group 2, when printed)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log_file:
        proc = await asyncio.create_subprocess_exec(
            *argv, cwd=str(root), env=env or child_env(root=root), stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=log_file, start_new_session=True,
        )
    lines: list[str] = []
    found: asyncio.Future[re.Match[str]] = asyncio.get_running_loop().create_future()

    async def drain() -> None:
        assert proc.stdout is not None
        while line := await proc.stdout.readline():
            text = line.decode("utf-8", "replace")
            lines.append(text)
            match = announce.search(text)
            if match and not found.done():
                found.set_result(match)
        if not found.done():
            found.set_exception(RuntimeError(f"{argv[2:4]} exited before it was ready"))

    task = asyncio.create_task(drain(), name=f"drain:{proc.pid}")
    child = Child(proc, "", log_path, lines, task)
    try:
        match = await asyncio.wait_for(asyncio.shield(found), timeout)
    except (TimeoutError, RuntimeError) as err:
        await child.kill()
        tail = child.log_text()[-3000:]
        raise RuntimeError(f"{' '.join(argv[1:5])} did not start: {err}\n--- its log ---\n{tail}") from None
    child.url = match.group(1)
    child.token = match.group(2) if announce.groups >= 2 else None
    return child


async def start_gateway(config_path: Path, log_path: Path, timeout: float = 60, *, root: Path = ROOT,
                        env: dict[str, str] | None = None) -> Child:
    """`python -m gateway run --config PATH`, ready once it prints its URL. `root` is the
    checkout whose code runs (another one: a baseline in the same benchmark run); `env`
    adds to the environment (a PYTHONPATH given there goes in front of the checkout's)."""
    extra = dict(env or {})
    full = child_env(extra, root=root)
    if "PYTHONPATH" in extra:
        full["PYTHONPATH"] = os.pathsep.join([extra["PYTHONPATH"], child_env(root=root)["PYTHONPATH"]])
    return await spawn([PYTHON, "-m", "gateway", "run", "--config", str(config_path)],
                       announce=GATEWAY_ANNOUNCE, log_path=log_path, timeout=timeout, root=root, env=full)


async def start_fake_model(log_path: Path, *, delay_ms: float = 0) -> tuple[Child, str]:
    """The fake model in its own process; returns (child, stats URL). child.url is the
    OpenAI base URL (".../v1")."""
    child = await spawn([PYTHON, "-m", "bench._procs", "model", "--delay-ms", str(delay_ms)],
                        announce=re.compile(r"^model (\S+)"), log_path=log_path)
    stats = next(re.search(r"stats (\S+)", line) for line in child.lines if line.startswith("model "))
    assert stats is not None
    return child, stats.group(1)


async def start_echo(log_path: Path, *, model_url: str, telegram_base: str | None = None) -> Child:
    argv = [PYTHON, "-m", "bench._procs", "echo", "--model", model_url]
    if telegram_base:
        argv += ["--telegram", telegram_base]
    return await spawn(argv, announce=re.compile(r"^echo (\S+)"), log_path=log_path)


async def wait_ready(base_url: str, timeout: float = 60, interval: float = 0.005) -> float:
    """Poll GET /readyz until it answers 200; returns the monotonic time it did."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    async with aiohttp.ClientSession() as http:
        while True:
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(base_url + "/readyz") as resp:
                    if resp.status == 200:
                        return time.monotonic()
            if loop.time() > deadline:
                raise TimeoutError(f"{base_url}/readyz not 200 within {timeout}s")
            await asyncio.sleep(interval)  # nothing to wait on but the endpoint itself


async def model_times(stats_url: str) -> dict[str, float]:
    """The fake model's own handler time per turn tag (and forget them)."""
    async with aiohttp.ClientSession() as http, http.get(stats_url + "/times") as resp:
        data: dict[str, float] = await resp.json()
        return data


# ---------------------------------------------------------------------------- gateway config


def gateway_config(directory: Path, model_url: str, *, telegram: dict[str, Any] | None = None,
                   **overrides: Any) -> Path:
    """A config file in `directory` (data under directory/data): web on port 0, open DMs,
    the fake model, and the given Telegram section."""
    raw: dict[str, Any] = {
        "data_dir": str(directory / "data"),
        # Every load session connects from this one address: lift the per-address cap.
        "http": {"host": "127.0.0.1", "port": 0, "max_connections_per_client": 4096},
        "access": {"dm_policy": "open"},
        "model": {"name": "fake-model", "base_url": model_url, "api_key": "bench-key", "timeout_s": 30},
        "channels": {"telegram": telegram} if telegram else {},
    }
    raw.update(overrides)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "config.json"
    path.write_text(json.dumps(raw, indent=2), encoding="utf-8")
    return path


def telegram_section(base_url: str, base_file_url: str, token: str, *, poll_timeout_s: int = 10) -> dict[str, Any]:
    return {"enabled": True, "token": token, "base_url": base_url, "base_file_url": base_file_url,
            "poll_timeout_s": poll_timeout_s}


# ---------------------------------------------------------------------------- fake model process


BENCH_SUMMARY = "\n".join(
    f"## {section}\n- " + "; ".join(f"{section.lower()} item {i} with a few specific words" for i in range(4))
    for section in ("Goal", "Constraints & Preferences", "Progress", "Key Decisions", "Next Steps",
                    "Critical Context")
)  # ~1,300 characters, the six sections the summary prompt asks for


def _is_summary_request(body: Any) -> bool:
    try:
        return str(body["messages"][0]["content"]).startswith("You keep the working memory of a long chat")
    except (KeyError, IndexError, TypeError):
        return False


def _stamped_model_class() -> type:
    """FakeModel plus a per-turn record of its own handler time (imported lazily: the
    parent process of a benchmark does not need the test fakes)."""
    from tests.fakes.openai_server import FakeModel, Reply, last_user_text

    class StampedModel(FakeModel):  # type: ignore[misc]
        def __init__(self, delay_s: float) -> None:
            super().__init__()
            self.times: dict[str, float] = {}
            self._stats: web.AppRunner | None = None
            self.stats_url = ""
            if delay_s > 0:
                self.default = lambda body: Reply(text=f"echo: {last_user_text(body)}", delay=delay_s)
            # A summary request gets a summary of a real one's size: an echo of the prompt
            # (previous summary + transcript) would grow with every summary and bloat requests.
            self.respond_with(lambda body: Reply(text=BENCH_SUMMARY, delay=delay_s) if _is_summary_request(body)
                              else None)

        async def start(self) -> None:
            await super().start()
            app = web.Application()
            app.router.add_get("/times", self._times)
            self._stats = web.AppRunner(app, access_log=None, handle_signals=False)
            await self._stats.setup()
            await web.TCPSite(self._stats, "127.0.0.1", 0).start()
            self.stats_url = f"http://127.0.0.1:{self._stats.addresses[0][1]}"

        async def stop(self) -> None:
            await super().stop()
            if self._stats is not None:
                await self._stats.cleanup()

        async def _chat(self, request: web.Request) -> web.StreamResponse:
            started = time.perf_counter()
            response = await super()._chat(request)
            took = time.perf_counter() - started
            body = await request.json()  # cached by aiohttp: no second read
            tag = last_user_text(body) if isinstance(body, dict) else ""
            if TAG.fullmatch(tag):
                self.times[tag] = took
            # Nothing waits on the request log here; keep the process small.
            self.requests.clear()
            self.request_headers.clear()
            return response

        async def _times(self, _request: web.Request) -> web.Response:
            times, self.times = self.times, {}
            return web.json_response(times)

    return StampedModel


async def _serve_model(delay_ms: float) -> None:
    model = _stamped_model_class()(delay_ms / 1000)
    await model.start()
    print(f"model {model.base_url} stats {model.stats_url}", flush=True)
    try:
        await _until_terminated()
    finally:
        await model.stop()


# ---------------------------------------------------------------------------- the ceiling


class EchoServer:
    """The least a gateway can do: take a message, ask the model once, send the answer.
    `POST /api/chat` like the gateway's web API; with a Telegram base URL, also long-poll
    getUpdates and answer each message with sendMessage."""

    def __init__(self, model_url: str, telegram_base: str | None) -> None:
        self.model_url = model_url.rstrip("/") + "/chat/completions"
        self.telegram_base = telegram_base
        self.http: aiohttp.ClientSession | None = None
        self.runner: web.AppRunner | None = None
        self.tasks: set[asyncio.Task[Any]] = set()
        self.url = ""

    async def start(self) -> None:
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        app = web.Application()
        app.router.add_post("/api/chat", self.chat)
        app.router.add_get("/readyz", lambda _r: web.json_response({"ready": True}))
        self.runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        if self.telegram_base:
            self._own(self.poll())

    async def stop(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=5)
        if self.runner is not None:
            await self.runner.cleanup()
        if self.http is not None:
            await self.http.close()

    def _own(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def ask(self, text: str) -> str:
        assert self.http is not None
        body = {"model": "fake-model", "messages": [{"role": "user", "content": text}]}
        async with self.http.post(self.model_url, json=body,
                                  headers={"Authorization": "Bearer bench-key"}) as resp:
            data = await resp.json()
        return str(data["choices"][0]["message"]["content"])

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"reply": await self.ask(str(body["text"]))})

    async def poll(self) -> None:
        assert self.http is not None and self.telegram_base is not None
        offset = 0
        while True:
            params = {"offset": offset, "timeout": 10}
            try:
                async with self.http.post(f"{self.telegram_base}/getUpdates", json=params) as resp:
                    updates = (await resp.json())["result"]
            except (aiohttp.ClientError, ValueError, KeyError):
                await asyncio.sleep(0.5)  # the fake is restarting between runs
                continue
            for update in updates:
                offset = max(offset, int(update["update_id"]) + 1)
                self._own(self.answer(update["message"]))

    async def answer(self, message: dict[str, Any]) -> None:
        assert self.http is not None
        reply = await self.ask(str(message.get("text", "")))
        payload = {"chat_id": message["chat"]["id"], "text": reply}
        async with self.http.post(f"{self.telegram_base}/sendMessage", json=payload) as resp:
            await resp.read()


async def _serve_echo(model_url: str, telegram_base: str | None) -> None:
    server = EchoServer(model_url, telegram_base)
    await server.start()
    print(f"echo {server.url}", flush=True)
    try:
        await _until_terminated()
    finally:
        await server.stop()


async def _until_terminated() -> None:
    """Serve until SIGTERM or SIGINT; logs who sent it (a bench server that vanishes
    mid-run should say why)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    wanted = {signal.SIGTERM, signal.SIGINT}

    def wait_for_signal() -> None:
        info = signal.sigwaitinfo(wanted)
        print(f"stopping on signal {info.si_signo} from pid {info.si_pid}", file=sys.stderr, flush=True)
        loop.call_soon_threadsafe(stop.set)

    # Blocked here, received by the waiting thread (siginfo carries the sender's pid).
    signal.pthread_sigmask(signal.SIG_BLOCK, wanted)
    waiter = threading.Thread(target=wait_for_signal, name="signals", daemon=True)
    waiter.start()
    await stop.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench._procs")
    sub = parser.add_subparsers(dest="command", required=True)
    model = sub.add_parser("model", help="the fake model, reporting its own time per turn")
    model.add_argument("--delay-ms", type=float, default=0)
    echo = sub.add_parser("echo", help="a bare aiohttp echo server in front of the model (the ceiling)")
    echo.add_argument("--model", required=True)
    echo.add_argument("--telegram", default=None, help="Bot API base URL with the token, e.g. http://…/bot<TOKEN>")
    args = parser.parse_args(argv)
    if args.command == "model":
        asyncio.run(_serve_model(args.delay_ms))
    else:
        asyncio.run(_serve_echo(args.model, args.telegram))
    return 0


if __name__ == "__main__":
    sys.exit(main())
