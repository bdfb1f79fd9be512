"""Benchmark: the whole gateway under N concurrent sessions, web API and Telegram.

    /work/venv/bin/python -m bench.gateway_load [--sessions 10 100 1000] [--seconds 8] [--paced 100 50]

Three processes: the gateway (`python -m gateway run --config` a temp config), a fake
model that answers at once (`python -m bench._procs model`), and this one, which drives
the load with an aiohttp client and hosts the fake Telegram Bot API. Every session sends
turns back to back for a fixed time, through `POST /api/chat` or as Telegram updates
(timed until the reply is shown: sent whole, after a draft, or edited into place as it
streams; these chats are private, so `streaming: "auto"` uses drafts). One
more run per path paces 100 sessions to 50 turns/s in total (one message every 2 s from
each, far busier than people chat): the latency below saturation. Back to back, latency
is N / throughput by Little's law, so it measures throughput again, not added latency;
the bare server's own b2b rows show that (about 80 ms p50 at 100 sessions). The same
load against a bare aiohttp echo server in front of the same model (`python -m
bench._procs echo`) is the ceiling.

Per N and path: turns/s; gateway CPU ms per turn (utime+stime from /proc, from the
start of the load until the process is idle again, so background work the turns caused
counts); p50/p99 added latency (end to end minus the model server's own handler time for
that turn); RSS per live session (RSS growth / N, measured idle after the load; a
warm-up of 50 other sessions for 4 s first fills the process-wide caches, such as SQLite's
2 MB page cache and the request JSON cache, so they are not charged to the measured
sessions).
Goals: ≥ 300 turns/s through the web API, p99 added latency ≤ 50 ms at 100 sessions
(judged on the paced runs), ≤ 100 KB RSS per idle live session. Writes bench/out/gateway_load.{json,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import tempfile
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from bench._procs import (
    PYTHON,
    ROOT,
    Child,
    cpu_seconds,
    gateway_config,
    model_times,
    start_echo,
    start_fake_model,
    start_gateway,
    telegram_section,
    thread_cpu_seconds,
)
from tests.fakes.telegram_server import FakeTelegram

OUT = ROOT / "bench" / "out"
TURN_TIMEOUT_S = 60.0
SETTLE_TIMEOUT_S = 30.0
GOAL_TURNS_PER_S = 300
GOAL_P99_ADDED_MS = 50
GOAL_RSS_KB = 100
WARM_SESSIONS = 50
WARM_SECONDS = 4.0


class LoadTelegram(FakeTelegram):
    """The fake Bot API with a future per chat for the reply it expects there: resolved
    when a message shows exactly that text, whether sent whole (after a draft, SPEC
    §5.1) or sent with the first words and edited until complete (edits)."""

    def __init__(self) -> None:
        # No flood control: the load comes from many turns per chat back to back.
        super().__init__(edit_interval_s=None, draft_interval_s=None, send_per_s=None)
        self.waiters: dict[int, tuple[str, asyncio.Future[str]]] = {}
        self.last_text: dict[int, str] = {}  # what each chat was last shown (for error reports)

    def expect(self, chat_id: int, text: str) -> asyncio.Future[str]:
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.waiters[chat_id] = (text, fut)
        return fut

    def _shown_to(self, params: dict[str, Any], response: web.Response) -> None:
        if response.status != 200:
            return
        chat_id, text = int(params["chat_id"]), str(params.get("text", ""))
        self.last_text[chat_id] = text
        waiter = self.waiters.get(chat_id)
        if waiter is not None and waiter[0] == text:
            del self.waiters[chat_id]
            if not waiter[1].done():
                waiter[1].set_result(text)

    async def _api_sendmessage(self, params: dict[str, Any]) -> web.Response:
        response = await super()._api_sendmessage(params)
        self._shown_to(params, response)
        return response

    async def _api_editmessagetext(self, params: dict[str, Any]) -> web.Response:
        response = await super()._api_editmessagetext(params)
        self._shown_to(params, response)
        return response

    def forget_history(self) -> None:
        """The recorded calls are not needed here; keep this process small."""
        self.calls.clear()
        self.call_times.clear()
        self.drafts.clear()
        self.sent.clear()
        self.edits.clear()
        self.history.clear()
        self.chat_actions.clear()


@dataclass
class Sample:
    tag: str
    seconds: float


@dataclass
class RunResult:
    target: str  # gateway | ceiling
    path: str  # web | telegram
    sessions: int
    offered: float | None  # total turns/s offered when paced; None: back to back
    seconds: float
    turns: int
    errors: int
    turns_per_s: float
    cpu_ms_per_turn: float
    model_cpu_ms_per_turn: float  # the fake model's process: the requests the target sends cost there too
    loop_cpu_ms_per_turn: float  # of cpu_ms_per_turn, the main thread's (the event loop); the rest: worker threads
    p50_added_ms: float
    p99_added_ms: float
    p50_e2e_ms: float
    p99_e2e_ms: float
    rss_per_session_kb: float
    rss_mb: float
    notes: list[str] = field(default_factory=list)
    load_average: list[float] = field(default_factory=list)  # 1-minute load at the start and the end (shared machine)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


# ---------------------------------------------------------------------------- one session


async def pace(interval: float, next_start: float, deadline: float) -> float:
    """With an interval, wait for this session's next slot (a person's think time; never
    past the deadline); returns the slot after it."""
    if interval <= 0:
        return next_start
    delay = min(next_start, deadline) - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
    return next_start + interval


Turn = Callable[[str], Awaitable[str | None]]  # sends one tagged turn: an error text, or None


async def session(turn: Turn, prefix: str, deadline: float, samples: list[Sample], errors: list[str], *,
                  interval: float = 0.0, phase: float = 0.0) -> None:
    """One session: turns tagged `prefix-N` until the deadline, back to back or paced."""
    n = 0
    slot = time.monotonic() + phase
    while time.monotonic() < deadline:
        slot = await pace(interval, slot, deadline)
        if time.monotonic() >= deadline:
            break
        tag = f"{prefix}-{n}"
        n += 1
        started = time.perf_counter()
        error = await turn(tag)
        if error is not None:
            errors.append(error)
            continue
        samples.append(Sample(tag, time.perf_counter() - started))


def web_turn(http: aiohttp.ClientSession, child: Child, name: str) -> Turn:
    async def turn(tag: str) -> str | None:
        try:
            async with http.post(child.url + "/api/chat", json={"session": name, "text": tag},
                                 headers=child.web_headers,
                                 timeout=aiohttp.ClientTimeout(total=TURN_TIMEOUT_S)) as resp:
                body = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as err:
            return f"{name}: {type(err).__name__}"
        if resp.status != 200 or body.get("reply") != f"echo: {tag}":
            return f"{name}: HTTP {resp.status} {str(body)[:80]}"
        return None

    return turn


def telegram_turn(fake: LoadTelegram, chat_id: int) -> Turn:
    async def turn(tag: str) -> str | None:
        reply = fake.expect(chat_id, f"echo: {tag}")
        fake.push_message(chat_id=chat_id, user_id=chat_id, text=tag)
        try:
            await asyncio.wait_for(reply, TURN_TIMEOUT_S)
        except TimeoutError:
            last = fake.last_text.get(chat_id, "")
            return f"chat {chat_id}: no reply in {TURN_TIMEOUT_S:.0f}s (last shown: {last[:80]!r})"
        return None

    return turn


# ---------------------------------------------------------------------------- one run


async def settle(child: Child, timeout: float = SETTLE_TIMEOUT_S) -> None:
    """Wait until the process stops using CPU (its background work is done)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    quiet = 0
    last = child.cpu_seconds()
    while quiet < 3 and loop.time() < deadline:
        await asyncio.sleep(0.2)  # sampling /proc: there is no event for "idle"
        now = child.cpu_seconds()
        quiet = quiet + 1 if now - last <= 0.01 else 0
        last = now


async def start_profiler(pid: int, seconds: float, target: Path) -> asyncio.subprocess.Process:
    """py-spy sampling `pid` (GIL-holding stacks only: what costs the event loop) for
    `seconds`, as collapsed stacks in `target` (`python -m bench.profile_top` reads them)."""
    return await asyncio.create_subprocess_exec(
        str(Path(PYTHON).with_name("py-spy")), "record", "--pid", str(pid), "--rate", "200", "--gil",
        "--format", "raw", "--duration", str(max(1, round(seconds))), "--output", str(target),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )


async def run_once(target: str, path: str, sessions: int, seconds: float, *, model_url: str,
                   stats_url: str, workdir: Path, rate: float | None = None,
                   profile: Path | None = None, baseline_root: Path = ROOT,
                   model_pid: int | None = None) -> RunResult:
    """One measured run on a fresh process; `rate` paces the sessions (total turns/s)."""
    load_at_start = os.getloadavg()[0]
    fake = LoadTelegram()
    await fake.start()
    run_dir = Path(tempfile.mkdtemp(prefix=f"{target}-{path}-{sessions}-", dir=workdir))
    log = run_dir / "process.log"
    if target in ("gateway", "baseline"):
        tg = telegram_section(fake.base_url, fake.base_file_url, fake.token)
        config = gateway_config(run_dir, model_url, telegram=tg,
                                limits={"max_live_sessions": max(1000, sessions + 10)})
        child = await start_gateway(config, log, root=baseline_root if target == "baseline" else ROOT)
    else:
        child = await start_echo(log, model_url=model_url, telegram_base=f"{fake.base_url}{fake.token}")
    notes: list[str] = []
    try:
        await fake.wait_call("getUpdates", timeout=30)  # the channel is polling
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            warm_samples: list[Sample] = []
            warm_errors: list[str] = []
            # Other sessions than the measured ones, long enough to fill the process-wide
            # caches (SQLite's page cache, the token-count cache, prepared statements): the
            # RSS growth measured after them is what the measured sessions hold.
            warm_deadline = time.monotonic() + WARM_SECONDS
            warm = [web_turn(http, child, f"warm{i}") if path == "web" else telegram_turn(fake, 1 + i)
                    for i in range(WARM_SESSIONS)]
            await asyncio.gather(*(session(turn, f"bench-warm-{i}", warm_deadline, warm_samples, warm_errors)
                                   for i, turn in enumerate(warm)))
            if warm_errors:
                raise RuntimeError(f"warm-up failed: {warm_errors[:3]}\n{child.log_text()[-2000:]}")
            await settle(child)
            await model_times(stats_url)  # forget the warm-up's
            fake.forget_history()
            rss_before = child.rss_bytes()
            cpu_before = child.cpu_seconds()
            model_cpu_before = cpu_seconds(model_pid) if model_pid else 0.0
            loop_cpu_before = thread_cpu_seconds(child.pid).get(child.pid, 0.0)

            samples: list[Sample] = []
            errors: list[str] = []
            spy = None
            if profile is not None:
                profile.mkdir(parents=True, exist_ok=True)
                name = f"{target}-{path}-{sessions}-{'paced' if rate else 'b2b'}.txt"
                spy = await start_profiler(child.pid, seconds, profile / name)
            started = time.monotonic()
            deadline = started + seconds
            interval = sessions / rate if rate else 0.0
            turns = ([web_turn(http, child, f"s{i}") for i in range(sessions)] if path == "web"
                     else [telegram_turn(fake, 100_000 + i) for i in range(sessions)])
            await asyncio.gather(*(session(turn, f"bench-{i}", deadline, samples, errors, interval=interval,
                                           phase=i * interval / sessions) for i, turn in enumerate(turns)))
            elapsed = time.monotonic() - started
            if spy is not None:
                await asyncio.wait_for(spy.wait(), 30)
            fake.forget_history()
            await settle(child)
            cpu = child.cpu_seconds() - cpu_before
            model_cpu = cpu_seconds(model_pid) - model_cpu_before if model_pid else float("nan")
            loop_cpu = thread_cpu_seconds(child.pid).get(child.pid, 0.0) - loop_cpu_before
            rss_after = child.rss_bytes()
        times = await model_times(stats_url)
    finally:
        code = await child.stop()
        await fake.stop()
    if code not in (0, -15):
        notes.append(f"exit code {code}")
    error_lines = [line for line in child.log_text().splitlines() if " ERROR " in line]
    if error_lines:
        notes.append(f"{len(error_lines)} ERROR log lines, e.g. {error_lines[0][20:140]!r}")
    added = [s.seconds - times[s.tag] for s in samples if s.tag in times]
    if len(added) < len(samples):
        notes.append(f"{len(samples) - len(added)} turns without a model time")
    e2e = [s.seconds for s in samples]
    if errors:
        notes.append(f"{len(errors)} errors, e.g. {errors[0]}")
    turns = len(samples)
    return RunResult(
        target=target, path=path, sessions=sessions, offered=rate, seconds=round(elapsed, 2), turns=turns,
        errors=len(errors), turns_per_s=round(turns / elapsed, 1),
        cpu_ms_per_turn=round(cpu * 1000 / turns, 2) if turns else float("nan"),
        model_cpu_ms_per_turn=round(model_cpu * 1000 / turns, 2) if turns else float("nan"),
        loop_cpu_ms_per_turn=round(loop_cpu * 1000 / turns, 2) if turns else float("nan"),
        p50_added_ms=round(percentile(added, 0.5) * 1000, 2), p99_added_ms=round(percentile(added, 0.99) * 1000, 2),
        p50_e2e_ms=round(percentile(e2e, 0.5) * 1000, 2), p99_e2e_ms=round(percentile(e2e, 0.99) * 1000, 2),
        rss_per_session_kb=round((rss_after - rss_before) / 1024 / sessions, 1),
        rss_mb=round(rss_after / 2**20, 1), notes=notes,
        load_average=[round(load_at_start, 1), round(os.getloadavg()[0], 1)],
    )


# ---------------------------------------------------------------------------- report


HEADER = (f"{'target':8} {'path':9} {'N':>5} {'load':>9} {'turns':>6} {'turns/s':>8} {'CPU ms/turn':>11} "
          f"{'loop':>5} {'model':>6} "
          f"{'p50 added':>10} {'p99 added':>10} {'p99 e2e':>9} {'RSS/session':>12} {'RSS':>8}  notes")


def load_label(r: RunResult) -> str:
    return f"{r.offered:g}/s" if r.offered else "b2b"


def row(r: RunResult) -> str:
    return (f"{r.target:8} {r.path:9} {r.sessions:>5} {load_label(r):>9} {r.turns:>6} {r.turns_per_s:>8.1f} "
            f"{r.cpu_ms_per_turn:>11.2f} {r.loop_cpu_ms_per_turn:>5.2f} {r.model_cpu_ms_per_turn:>6.2f} "
            f"{r.p50_added_ms:>8.1f}ms "
            f"{r.p99_added_ms:>8.1f}ms {r.p99_e2e_ms:>7.1f}ms "
            f"{r.rss_per_session_kb:>9.1f} KB {r.rss_mb:>6.1f}MB  "
            f"{'; '.join([f'load {r.load_average[0]:g} → {r.load_average[-1]:g}', *r.notes])}")


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def goals(results: list[RunResult]) -> list[str]:
    gw = [r for r in results if r.target == "gateway"]
    lines = []
    web = [r for r in gw if r.path == "web" and r.offered is None]
    if web:
        best = max(r.turns_per_s for r in web)
        lines.append(f"web API ≥ {GOAL_TURNS_PER_S} turns/s: best {best:.0f} → {verdict(best >= GOAL_TURNS_PER_S)}")
    for r in gw:
        if r.sessions == 100 and r.offered:
            lines.append(f"p99 added ≤ {GOAL_P99_ADDED_MS} ms at 100 sessions ({r.path}, {load_label(r)}): "
                         f"{r.p99_added_ms:.1f} ms → {verdict(r.p99_added_ms <= GOAL_P99_ADDED_MS)}")
    for r in gw:
        if r.sessions == 100 and not r.offered:
            bare = next((c for c in results if c.target == "ceiling" and c.path == r.path
                         and c.sessions == 100 and not c.offered), None)
            versus = f"; the bare server: {bare.p99_added_ms:.0f} ms" if bare else ""
            lines.append(f"(p99 at 100 sessions back to back, {r.path}: {r.p99_added_ms:.0f} ms — saturation, "
                         f"≈ 100 / {r.turns_per_s:.0f} turns/s{versus})")
    idle = [r for r in gw if r.sessions >= 100 and r.offered is None]
    if idle:
        worst = max(r.rss_per_session_kb for r in idle)
        lines.append(f"≤ {GOAL_RSS_KB} KB RSS per idle live session (N ≥ 100): worst {worst:.1f} KB → "
                     f"{verdict(worst <= GOAL_RSS_KB)}")
    return lines


def chart(results: list[RunResult], target: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[tuple[str, str], list[RunResult]] = defaultdict(list)
    for r in results:
        if r.offered is None:  # the paced runs are a table of their own
            series[(r.target, r.path)].append(r)
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    panels: list[tuple[str, Callable[[RunResult], float]]] = [
        ("turns/s", lambda r: r.turns_per_s),
        ("p99 added latency (ms)", lambda r: r.p99_added_ms),
        ("CPU ms per turn", lambda r: r.cpu_ms_per_turn),
    ]
    for ax, (title, value) in zip(axes, panels, strict=True):
        for (tgt, path), runs in sorted(series.items()):
            runs.sort(key=lambda r: r.sessions)
            ax.plot([r.sessions for r in runs], [value(r) for r in runs], marker="o",
                    linestyle="-" if tgt == "gateway" else "--", label=f"{tgt} {path}")
        ax.set_xscale("log")
        ax.set_xlabel("concurrent sessions")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].axhline(GOAL_TURNS_PER_S, color="grey", linewidth=0.8)
    axes[1].axhline(GOAL_P99_ADDED_MS, color="grey", linewidth=0.8)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(target, dpi=80)
    plt.close(fig)


async def main(sessions: list[int], seconds: float, paths: list[str], targets: list[str],
               paced: tuple[int, float] | None, profile: Path | None = None,
               baseline_root: Path = ROOT) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    # A stopped gateway drops its long poll mid-request: the fake Bot API's "Connection lost"
    # tracebacks are expected here, not findings.
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory(prefix="gateway-load-") as tmp:
        workdir = Path(tmp)
        model, stats_url = await start_fake_model(workdir / "model.log")
        results: list[RunResult] = []
        print(HEADER, flush=True)
        try:
            # The targets of one row run one after another (not target by target): on a shared
            # machine the rows they are compared in see the same load.
            runs: list[tuple[int, float | None]] = [(n, None) for n in sessions]
            if paced is not None:
                runs.append(paced)
            for path in paths:
                for n, rate in runs:
                    for target in targets:
                        result = await run_once(target, path, n, seconds, model_url=model.url,
                                                stats_url=stats_url, workdir=workdir, rate=rate,
                                                profile=profile, baseline_root=baseline_root,
                                                model_pid=model.pid)
                        results.append(result)
                        print(row(result), flush=True)
        except Exception:
            if model.returncode is not None:  # say why, not just "connection refused"
                print(f"the fake model exited ({model.returncode}):\n{model.log_text()[-3000:]}", flush=True)
            raise
        finally:
            await model.stop()
    print()
    for line in goals(results):
        print(line)
    (OUT / "gateway_load.json").write_text(json.dumps([asdict(r) for r in results], indent=2))
    chart(results, OUT / "gateway_load.png")
    print(f"\nwrote {OUT / 'gateway_load.json'} and {OUT / 'gateway_load.png'}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--seconds", type=float, default=8.0, help="load time per run")
    parser.add_argument("--paths", nargs="+", choices=["web", "telegram"], default=["web", "telegram"])
    parser.add_argument("--targets", nargs="+", choices=["gateway", "ceiling", "baseline"],
                        default=["gateway", "ceiling"],
                        help="baseline: the gateway of another checkout (--baseline-root), for before/after "
                             "in one run")
    parser.add_argument("--baseline-root", type=Path, default=ROOT,
                        help="the checkout the baseline target runs, e.g. a `git worktree add` of the commit before")
    parser.add_argument("--paced", type=float, nargs=2, metavar=("SESSIONS", "RATE"), default=[100, 50],
                        help="one more run per path with SESSIONS sessions offering RATE turns/s in total "
                             "(latency below saturation); RATE 0 skips it")
    parser.add_argument("--profile", type=Path, default=None, metavar="DIR",
                        help="py-spy (pip install py-spy) samples each measured run's server process into "
                             "DIR/<target>-<path>-<N>-<load>.txt; python -m bench.profile_top DIR/... reads one")
    args = parser.parse_args()
    started = time.monotonic()
    paced = (int(args.paced[0]), float(args.paced[1])) if args.paced[1] > 0 else None
    asyncio.run(main(args.sessions, args.seconds, args.paths, args.targets, paced, args.profile,
                     args.baseline_root.resolve()))
    print(f"total {time.monotonic() - started:.0f}s")
