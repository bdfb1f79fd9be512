"""Benchmark: several gateways on one PostgreSQL against one gateway on SQLite.

    python -m bench.cluster [--instances 1 2 3] [--sessions 60] [--seconds 10] [--rate 40]
                            [--failover-sessions 45] [--failover-delay-ms 2000] [--no-sqlite]

In one run, the same workload through the same round-robin proxy (bench/_cluster.py)
against: 1 gateway on SQLite (the baseline), then 1, 2 and 3 gateways on one throw-away
PostgreSQL (tests/pg.py) sharing one data dir. Telegram (webhook) and Slack (Events API
over HTTP) traffic from this process, replies to the fakes in this process; the model is
the fake model in its own process (`python -m bench._procs model`), which answers at once
and records its own handler time per turn.

Per configuration:
- **turns/s**: N sessions each send a message and wait for its reply, back to back, for
  `--seconds`; turns answered / wall time.
- **added latency** (p50/p99): a paced run (`--rate` turns/s in total, below saturation):
  from the platform's POST to the reply reaching the fake, minus the fake model's own
  time for that turn (so: proxy + gateway + database).
- **CPU ms/turn**: utime+stime of each gateway process (/proc/<pid>/stat) over the
  back-to-back run until idle, / turns; summed over the instances, and the busiest
  instance's share. PostgreSQL's own CPU (the postmaster and its backends) separately.

Fail-over: 3 gateways, the model slowed to `--failover-delay-ms`; every session sends two
messages, and while they wait one gateway is SIGKILLed. The sessions it was serving (it
accepted their waiting messages, or it held their lease) are timed from the kill to their
next reply: median and max.

Prints a table (ratios against the SQLite baseline), writes bench/out/cluster.{json,png}.
The machine is shared: numbers move between runs; compare within a run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import secrets
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench._cluster import (
    TOKEN,
    ChatSession,
    Cluster,
    Delivery,
    LoggedSlack,
    LoggedTelegram,
    ReplyLog,
    SeenReply,
    Senders,
    chat_sessions,
    served_by,
)
from bench._procs import CLOCK_TICKS, ROOT, cpu_seconds, model_times, start_fake_model
from bench.gateway_load import percentile

OUT = ROOT / "bench" / "out"
TURN_TIMEOUT_S = 30.0
IDLE_SETTLE_S = 1.0
FAILOVER_TIMEOUT_S = 40.0


@dataclass
class ConfigResult:
    label: str
    store: str  # sqlite | postgres
    instances: int
    turns: int
    seconds: float
    turns_per_s: float
    errors: int
    paced_turns: int
    p50_added_ms: float
    p99_added_ms: float
    p90_added_ms: float
    max_added_ms: float
    p99_e2e_ms: float
    cpu_ms_per_turn: float  # all gateway processes together
    cpu_ms_per_turn_instances: list[float]  # each instance's own
    db_cpu_ms_per_turn: float | None
    driver_cpu_ms_per_turn: float  # this process: proxy, fakes and senders
    # PostgreSQL round trips per turn over the back-to-back run, all gateways together
    # (bench/probes/pg_round_trips): statements, prepares and pool resets; None on SQLite.
    round_trips_per_turn: float | None = None
    round_trips: dict[str, float] = field(default_factory=dict)  # by kind, per turn
    top_statements: dict[str, float] = field(default_factory=dict)  # per turn, the most frequent
    notes: list[str] = field(default_factory=list)


@dataclass
class FailoverResult:
    sessions: int  # sessions the killed gateway was serving
    answered: int
    median_s: float
    max_s: float
    delay_ms: float
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------- /proc for PostgreSQL


def _postmaster_pid(port: int) -> int | None:
    """The PostgreSQL server listening on `port` (our throw-away one), by its command line."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if argv and argv[0].endswith(b"postgres") and str(port).encode() in argv:
                return int(entry.name)
    return None


def db_cpu_seconds(postmaster: int) -> float:
    """The server's CPU so far: the postmaster, its live backends and the exited ones it reaped."""
    total = 0.0
    raw = Path(f"/proc/{postmaster}/stat").read_text()
    fields = raw[raw.rindex(")") + 2:].split()
    total += (int(fields[13]) + int(fields[14])) / CLOCK_TICKS  # cutime + cstime: reaped children
    total += cpu_seconds(postmaster)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = (entry / "stat").read_text()
            if int(stat[stat.rindex(")") + 2:].split()[1]) == postmaster:
                total += cpu_seconds(int(entry.name))
    return total


# ---------------------------------------------------------------------------- waiting for replies


class Awaited:
    """A future per message token, resolved when a reply carrying it reaches a fake."""

    def __init__(self, log: ReplyLog) -> None:
        self.futures: dict[str, asyncio.Future[SeenReply]] = {}
        log.listeners.append(self._seen)

    def expect(self, token: str) -> asyncio.Future[SeenReply]:
        fut: asyncio.Future[SeenReply] = asyncio.get_running_loop().create_future()
        self.futures[token] = fut
        return fut

    def _seen(self, reply: SeenReply) -> None:
        found = TOKEN.search(reply.text)
        fut = self.futures.pop(found.group(0), None) if found else None
        if fut is not None and not fut.done():
            fut.set_result(reply)


@dataclass
class Timed:
    tag: str  # the whole message text, which the fake model times under
    e2e_s: float


async def one_turn(senders: Senders, awaited: Awaited, session: ChatSession, salt: str,
                   n: int) -> Timed | None:
    token = session.token(n, salt)
    tag = f"bench-{token}"
    fut = awaited.expect(token)
    delivery: Delivery = await senders.send(session, token, tag)
    if not delivery.accepted:
        awaited.futures.pop(token, None)
        return None
    try:
        reply = await asyncio.wait_for(fut, TURN_TIMEOUT_S)
    except TimeoutError:
        return None
    return Timed(tag, reply.at - delivery.sent_at)


# ---------------------------------------------------------------------------- one configuration


async def run_config(label: str, *, instances: int, store_url: str | None, workdir: Path, model_url: str,
                     stats_url: str, sessions: list[ChatSession], seconds: float, rate: float,
                     postmaster: int | None) -> ConfigResult:
    log = ReplyLog()
    telegram = LoggedTelegram(log, edit_interval_s=None, send_per_s=None)  # many turns per chat
    slack = LoggedSlack(log)
    await telegram.start()
    await slack.start()
    slug = f"{instances}-{'pg' if store_url else 'sqlite'}"
    cluster = Cluster(workdir / slug, size=instances, store_url=store_url, model_url=model_url,
                      telegram=telegram, slack=slack, sessions=sessions,
                      limits={"max_concurrent_model_calls": 256, "session_queue_size": 50})
    senders: Senders | None = None
    salt = secrets.token_hex(3)
    counter = iter(range(10**9))
    notes: list[str] = []
    try:
        await cluster.start()
        senders = Senders(cluster.proxy.url)
        awaited = Awaited(log)
        # Warm-up: every session once (sessions created, caches and pools filled).
        await asyncio.gather(*(one_turn(senders, awaited, s, salt, next(counter)) for s in sessions))
        await model_times(stats_url)  # forget the warm-up's

        # Back to back, for throughput and CPU.
        trips0 = await read_round_trips(cluster) if store_url else None
        cpu0 = [g.cpu_seconds() for g in cluster.gateways]
        db0 = db_cpu_seconds(postmaster) if postmaster else None
        driver0 = cpu_seconds(os.getpid())
        started = time.monotonic()
        deadline = started + seconds
        done: list[Timed] = []
        errors = 0

        async def loop(session: ChatSession) -> None:
            nonlocal errors
            assert senders is not None
            while time.monotonic() < deadline:
                timed = await one_turn(senders, awaited, session, salt, next(counter))
                if timed is None:
                    errors += 1
                else:
                    done.append(timed)

        await asyncio.gather(*(loop(s) for s in sessions))
        elapsed = time.monotonic() - started
        await asyncio.sleep(IDLE_SETTLE_S)  # background work the turns caused counts too
        trips1 = await read_round_trips(cluster) if store_url else None
        cpu1 = [g.cpu_seconds() for g in cluster.gateways]
        db1 = db_cpu_seconds(postmaster) if postmaster else None
        driver1 = cpu_seconds(os.getpid())
        turns = len(done)
        await model_times(stats_url)

        # Paced, below saturation, for the added latency.
        paced: list[Timed] = []
        interval = len(sessions) / rate
        paced_deadline = time.monotonic() + seconds

        async def paced_session(session: ChatSession, phase: float) -> None:
            assert senders is not None
            await asyncio.sleep(phase)
            turns_left: set[asyncio.Task[Timed | None]] = set()
            while time.monotonic() < paced_deadline:
                task = asyncio.create_task(one_turn(senders, awaited, session, salt, next(counter)))
                turns_left.add(task)
                await asyncio.sleep(interval)
            for result in await asyncio.gather(*turns_left):
                if result is not None:
                    paced.append(result)

        await asyncio.gather(*(paced_session(s, i * interval / len(sessions)) for i, s in enumerate(sessions)))
        model = await model_times(stats_url)
        added = [(t.e2e_s - model[t.tag]) * 1000 for t in paced if t.tag in model]
        if len(added) < len(paced):
            notes.append(f"{len(paced) - len(added)} paced turns without a model time")
        codes = await cluster.stop()
        if any(codes):
            notes.append(f"exit codes {codes}")
        errors_in_logs = cluster.error_lines()
        if errors_in_logs:
            notes.append(f"{len(errors_in_logs)} ERROR log lines, first: {errors_in_logs[0]}")
    finally:
        await cluster.tear_down(senders, slack, telegram)
    per_instance = [(b - a) * 1000 / max(1, turns) for a, b in zip(cpu0, cpu1, strict=True)]
    trips: dict[str, float] = {}
    top: dict[str, float] = {}
    if trips0 is not None and trips1 is not None:
        for kind in ("statements", "prepares", "resets"):
            trips[kind] = (trips1.get(kind, 0) - trips0.get(kind, 0)) / max(1, turns)
        before = trips0.get("by_statement", {})
        grown = {k: (v - before.get(k, 0)) / max(1, turns) for k, v in trips1.get("by_statement", {}).items()}
        top = dict(sorted(grown.items(), key=lambda kv: -kv[1])[:12])
    return ConfigResult(
        label=label, store="postgres" if store_url else "sqlite", instances=instances, turns=turns,
        seconds=elapsed, turns_per_s=turns / elapsed, errors=errors, paced_turns=len(paced),
        p50_added_ms=percentile(added, 0.5), p99_added_ms=percentile(added, 0.99),
        p90_added_ms=percentile(added, 0.9), max_added_ms=max(added, default=float("nan")),
        p99_e2e_ms=percentile([t.e2e_s * 1000 for t in paced], 0.99),
        cpu_ms_per_turn=sum(per_instance), cpu_ms_per_turn_instances=per_instance,
        db_cpu_ms_per_turn=(db1 - db0) * 1000 / max(1, turns) if db0 is not None and db1 is not None else None,
        driver_cpu_ms_per_turn=(driver1 - driver0) * 1000 / max(1, turns), notes=notes,
        round_trips_per_turn=sum(trips.values()) if trips else None, round_trips=trips, top_statements=top,
    )


async def read_round_trips(cluster: Cluster) -> dict[str, Any]:
    """The gateways' round-trip counts so far, summed (each probe writes its file every
    half second: wait for a fresh write first)."""
    await asyncio.sleep(0.7)
    total: dict[str, Any] = {"by_statement": {}}
    for i in range(cluster.size):
        path = cluster.round_trips_file(i)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        for kind, value in data.items():
            if kind == "by_statement":
                for text, n in value.items():
                    total["by_statement"][text] = total["by_statement"].get(text, 0) + n
            else:
                total[kind] = total.get(kind, 0) + value
    return total


# ---------------------------------------------------------------------------- fail-over


async def run_failover(workdir: Path, *, store_url: str, sessions: list[ChatSession],
                       delay_ms: float) -> FailoverResult:
    from tests.fakes.openai_server import FakeModel, Reply, last_user_text

    log = ReplyLog()
    telegram = LoggedTelegram(log, edit_interval_s=None, send_per_s=None)
    slack = LoggedSlack(log)
    model = FakeModel()
    await telegram.start()
    await slack.start()
    await model.start()
    delay = delay_ms / 1000
    model.respond_with(lambda body: Reply(text=f"echo: {last_user_text(body)}", delay=delay))
    cluster = Cluster(workdir / "failover", size=3, store_url=store_url, model_url=model.base_url,
                      telegram=telegram, slack=slack, sessions=sessions,
                      limits={"max_concurrent_model_calls": 256})
    senders: Senders | None = None
    salt = secrets.token_hex(3)
    notes: list[str] = []
    try:
        await cluster.start()
        senders = Senders(cluster.proxy.url)

        async def two(session: ChatSession) -> None:
            assert senders is not None
            await senders.send(session, session.token(0, salt))
            await asyncio.sleep(0.1)
            await senders.send(session, session.token(1, salt))

        await asyncio.gather(*(two(s) for s in sessions))
        await asyncio.sleep(min(0.5, delay / 3))  # first turns are with the model now
        victim = cluster.gateways[1]
        serving = await served_by(store_url, victim.pid)
        await cluster.kill(1)
        killed_at = time.monotonic()
        # The victim's messages answered before the kill (a race with the query) do not count.
        answered = {found.group(0) for r in log.replies if (found := TOKEN.search(r.text))}
        waiting = {key: tokens - answered for key, tokens in serving.items() if tokens - answered}
        chats = {s.chat: waiting[s.key] for s in sessions if s.key in waiting}
        answered_at: dict[str, float] = {}

        def seen(reply: SeenReply) -> None:
            # A session answers again when one of the messages the victim had of it is answered.
            found = TOKEN.search(reply.text)
            if found and reply.chat in chats and found.group(0) in chats[reply.chat] and reply.chat not in answered_at:
                answered_at[reply.chat] = reply.at

        log.listeners.append(seen)
        await log.wait(lambda: len(answered_at) == len(chats), FAILOVER_TIMEOUT_S)
        waits = sorted(answered_at[c] - killed_at for c in answered_at)
        if len(answered_at) < len(chats):
            notes.append(f"{len(chats) - len(answered_at)} of {len(chats)} sessions not answered within "
                         f"{FAILOVER_TIMEOUT_S:.0f}s")
        await cluster.stop()
    finally:
        await cluster.tear_down(senders, model, slack, telegram)
    return FailoverResult(sessions=len(chats), answered=len(waits),
                          median_s=statistics.median(waits) if waits else float("nan"),
                          max_s=max(waits) if waits else float("nan"), delay_ms=delay_ms, notes=notes)


# ---------------------------------------------------------------------------- report


HEADER = (f"{'config':<16}{'turns/s':>9}{'×base':>7}{'p50 added':>11}{'p99 added':>11}{'×base':>7}"
          f"{'CPU ms/turn':>13}{'×base':>7}  {'per instance':<20}{'PG ms/turn':>11}{'PG RT/turn':>11}"
          f"{'driver':>8}  notes")


def row(r: ConfigResult, base: ConfigResult | None) -> str:
    def ratio(a: float, b: float | None) -> str:
        return f"{a / b:.2f}" if b else "-"

    db = f"{r.db_cpu_ms_per_turn:.2f}" if r.db_cpu_ms_per_turn is not None else "-"
    trips = f"{r.round_trips_per_turn:.1f}" if r.round_trips_per_turn is not None else "-"
    each = " ".join(f"{c:.2f}" for c in r.cpu_ms_per_turn_instances)
    return (f"{r.label:<16}{r.turns_per_s:>9.1f}{ratio(r.turns_per_s, base and base.turns_per_s):>7}"
            f"{r.p50_added_ms:>9.1f}ms{r.p99_added_ms:>9.1f}ms{ratio(r.p99_added_ms, base and base.p99_added_ms):>7}"
            f"{r.cpu_ms_per_turn:>13.2f}{ratio(r.cpu_ms_per_turn, base and base.cpu_ms_per_turn):>7}  "
            f"{each:<20}{db:>11}{trips:>11}{r.driver_cpu_ms_per_turn:>8.2f}  {'; '.join(r.notes)}")


def round_trip_lines(results: list[ConfigResult]) -> list[str]:
    """Each PostgreSQL configuration's round trips per turn, by kind and by statement."""
    lines = []
    for r in results:
        if r.round_trips_per_turn is None:
            continue
        kinds = ", ".join(f"{kind} {value:.2f}" for kind, value in r.round_trips.items())
        lines.append(f"{r.label}: {r.round_trips_per_turn:.2f} round trips per turn ({kinds}); statements:")
        lines += [f"    {value:5.2f}  {text}" for text, value in r.top_statements.items() if value >= 0.05]
    return lines


def failover_line(f: FailoverResult) -> str:
    model_s = f.delay_ms / 1000
    line = (f"fail-over: 1 of 3 gateways SIGKILLed with {f.sessions} of its sessions waiting (model "
            f"{f.delay_ms:.0f} ms a turn): answered again after {f.median_s:.2f} s median, {f.max_s:.2f} s max "
            f"({f.answered}/{f.sessions}); without the model's {model_s:.1f} s for the resumed turn: "
            f"{f.median_s - model_s:.2f} s median, {f.max_s - model_s:.2f} s max")
    return line + "".join(f"; {note}" for note in f.notes)


def chart(results: list[ConfigResult], failover: FailoverResult | None, target: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r.label.replace("PostgreSQL", "PG") for r in results]
    colors = ["#888888" if r.store == "sqlite" else "#3b6ea8" for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    panels = [
        ("turns/s (back to back)", [r.turns_per_s for r in results], None),
        ("added latency p99 (ms, paced)", [r.p99_added_ms for r in results], [r.p50_added_ms for r in results]),
        ("CPU ms per turn: gateways (+ PostgreSQL)", [r.cpu_ms_per_turn for r in results], None),
    ]
    for ax, (title, values, inner) in zip(axes, panels, strict=True):
        ax.bar(labels, values, color=colors)
        if inner is not None:
            ax.bar(labels, inner, color="white", alpha=0.45, label="p50")
            ax.legend(fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(axis="y", alpha=0.3)
    db = [r.db_cpu_ms_per_turn or 0.0 for r in results]
    if any(db):
        axes[2].bar(labels, db, bottom=[r.cpu_ms_per_turn for r in results], color="#e0a040", label="PostgreSQL")
        axes[2].legend(fontsize=8)
    if failover is not None and failover.answered:
        fig.suptitle(f"fail-over (1 of 3 killed): its sessions answered again after {failover.median_s:.1f} s "
                     f"median, {failover.max_s:.1f} s max", fontsize=10)
    fig.tight_layout()
    fig.savefig(target, dpi=80)
    plt.close(fig)


# ---------------------------------------------------------------------------- main


async def run(args: argparse.Namespace, server: Any) -> tuple[list[ConfigResult], FailoverResult | None]:
    from tests.pg import create_database

    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)  # killed gateways drop requests
    third = args.sessions // 3
    sessions = chat_sessions(args.sessions - 2 * third, third, third)
    port = int(server.url.rsplit(":", 1)[1].split("/")[0])
    postmaster = _postmaster_pid(port)
    results: list[ConfigResult] = []
    failover: FailoverResult | None = None
    with tempfile.TemporaryDirectory(prefix="gateway-cluster-") as tmp:
        workdir = Path(tmp)
        model, stats_url = await start_fake_model(workdir / "model.log")
        try:
            configs: list[tuple[str, int, str | None]] = []
            if not args.no_sqlite:
                configs.append(("1 × SQLite", 1, None))
            configs += [(f"{n} × PostgreSQL", n, "pg") for n in args.instances]
            print(HEADER, flush=True)
            for label, n, kind in configs:
                url = await create_database(server) if kind else None
                result = await run_config(label, instances=n, store_url=url, workdir=workdir, model_url=model.url,
                                          stats_url=stats_url, sessions=sessions, seconds=args.seconds,
                                          rate=args.rate, postmaster=postmaster if url else None)
                results.append(result)
                base = results[0] if results[0].store == "sqlite" else None
                print(row(result, base), flush=True)
            for line in round_trip_lines(results):
                print(line, flush=True)
            if args.failover_sessions > 0:
                fo_third = args.failover_sessions // 3
                fo_sessions = chat_sessions(args.failover_sessions - 2 * fo_third, fo_third, fo_third)
                failover = await run_failover(workdir, store_url=await create_database(server),
                                              sessions=fo_sessions, delay_ms=args.failover_delay_ms)
                print("\n" + failover_line(failover), flush=True)
        finally:
            await model.stop()
    return results, failover


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, nargs="+", default=[1, 2, 3], help="PostgreSQL cluster sizes")
    parser.add_argument("--sessions", type=int, default=60, help="sessions (1/3 Telegram, 1/3 Slack DMs, "
                        "1/3 Slack channels)")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each timed run")
    parser.add_argument("--rate", type=float, default=40.0, help="turns/s in total in the paced run")
    parser.add_argument("--failover-sessions", type=int, default=45, help="0 skips the fail-over run")
    parser.add_argument("--failover-delay-ms", type=float, default=2000.0, help="the model's time per turn there")
    parser.add_argument("--no-sqlite", action="store_true", help="skip the SQLite baseline")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    from tests.pg import pg_server

    started = time.monotonic()
    try:
        with pg_server() as server:
            results, failover = asyncio.run(run(args, server))
    except BaseException as err:  # tests/pg.py skips (a pytest outcome) without PostgreSQL
        if type(err).__name__ in ("Skipped", "Failed"):
            print(f"no PostgreSQL: {err}", file=sys.stderr)
            return 1
        raise
    (OUT / "cluster.json").write_text(json.dumps(
        {"configs": [asdict(r) for r in results], "failover": asdict(failover) if failover else None,
         "cpus": os.cpu_count()}, indent=2))
    chart(results, failover, OUT / "cluster.png")
    print(f"\nwrote {OUT / 'cluster.json'} and {OUT / 'cluster.png'}; total {time.monotonic() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
