"""The long reliability soak: many SIGKILLs of a loaded gateway, then a long hunt for bad
input. Minutes, not seconds, so it is not part of the test suite.

    /work/venv/bin/python -m bench.soak [--rounds 3] [--sessions 200] [--messages 5] [--kills 8]
                                        [--input-examples 500]

Each round runs tests/test_reliability_crash.py's scenario with its own seed: waves of
one Telegram message per session, the gateway SIGKILLed at random points (mid model call,
inside sendMessage, at a poll) and restarted, then every reply and the database checked.
A reply may come twice only when a kill lands inside its platform send (Telegram took it,
the gateway had not yet recorded the message: it has no idempotency key); the soak reports
duplicates per kill split by that, and the sends in flight at each kill, read from the
database the kill left. Then the hypothesis input suite runs with many more
examples. Exit code 1 when any round lost a reply, sent something unexpected, left an
event pending or a session unreadable, or the input hunt failed.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench._procs import PYTHON, ROOT, child_env
from tests.test_reliability_crash import CrashReport, run_crash_scenario


def problems(report: CrashReport) -> list[str]:
    found = [f"missing: {m}" for m in report.missing[:5]] + [f"unexpected: {u}" for u in report.unexpected[:5]]
    found += report.session_problems[:5] + report.error_lines[:5]
    if report.pending_events:
        found.append(f"{report.pending_events} events left pending")
    if report.integrity != "ok":
        found.append(f"integrity_check: {report.integrity}")
    return found


async def crash_rounds(rounds: int, sessions: int, messages: int, kills: int) -> list[CrashReport]:
    reports = []
    for seed in range(1, rounds + 1):
        with tempfile.TemporaryDirectory(prefix="gateway-soak-") as tmp:
            report = await run_crash_scenario(Path(tmp), sessions=sessions, messages_per_session=messages,
                                              kills=kills, seed=seed, settle_timeout=300)
        reports.append(report)
        print(f"round {seed}: {report.line()}", flush=True)
        for line in problems(report):
            print(f"    {line}", flush=True)
    return reports


def duplicate_split(reports: list[CrashReport]) -> list[str]:
    """Duplicates per kill, by where the kill landed. A kill lands inside a platform send
    when Telegram had taken a reply whose message the gateway had not yet recorded (the
    kill's own sendMessage, or another turn's in flight): such a reply may come twice,
    since Telegram has no idempotency key. Every other reply must come exactly once."""
    inside = [(kill, len(flying)) for r in reports for kill, flying in zip(r.kills, r.in_flight, strict=False)
              if flying]
    outside = [kill for r in reports for kill, flying in zip(r.kills, r.in_flight, strict=False) if not flying]
    in_sends = sum(r.duplicates_inside_sends for r in reports)
    elsewhere = sum(r.duplicates_outside_sends for r in reports)
    flying = sum(n for _, n in inside)
    by_kind = ", ".join(f"{kind} {sum(1 for k, _ in inside if k.startswith(kind))}"
                        for kind in ("send", "model", "poll", "idle"))
    return [
        f"  kills inside a platform send: {len(inside)} ({by_kind}), {flying} sends in flight at them: "
        f"{in_sends} duplicates ({in_sends / max(1, len(inside)):.2f} per kill, "
        f"{in_sends / max(1, flying):.2f} per send in flight)",
        f"  kills anywhere else: {len(outside)}: {elsewhere} duplicates of replies already recorded "
        f"({elsewhere / max(1, len(outside) + len(inside)):.2f} per kill)",
    ]


def input_hunt(examples: int) -> int:
    print(f"\ninput hunt: tests/test_reliability_input.py with {examples} examples per property", flush=True)
    started = time.monotonic()
    result = subprocess.run(
        [PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_reliability_input.py"],
        cwd=ROOT, env=child_env({"RELIABILITY_EXAMPLES": str(examples)}), check=False,
    )
    print(f"input hunt: exit code {result.returncode} in {time.monotonic() - started:.0f}s", flush=True)
    return result.returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--messages", type=int, default=5, help="messages per session (one wave each)")
    parser.add_argument("--kills", type=int, default=8, help="SIGKILLs per round")
    parser.add_argument("--input-examples", type=int, default=500, help="0 skips the input hunt")
    args = parser.parse_args()

    started = time.monotonic()
    reports = asyncio.run(crash_rounds(args.rounds, args.sessions, args.messages, args.kills))
    updates = sum(r.updates for r in reports)
    kills = sum(len(r.kills) for r in reports)
    duplicates = sum(r.duplicate_replies for r in reports)
    print(f"\ncrash soak: {updates} updates, {kills} kills, {duplicates} duplicate replies "
          f"({duplicates / max(1, kills):.2f} per kill, {100 * duplicates / max(1, updates):.2f}% of updates), "
          f"{sum(r.duplicate_user_messages for r in reports)} duplicate user messages, "
          f"{sum(r.resend_notices for r in reports)} resend notices")
    for line in duplicate_split(reports):
        print(line)
    failed = any(problems(r) for r in reports)
    if any(r.duplicates_outside_sends for r in reports):
        failed = True  # a reply the gateway had recorded came again
    if args.input_examples > 0 and input_hunt(args.input_examples) != 0:
        failed = True
    print(f"\nsoak {'FAILED' if failed else 'passed'} in {time.monotonic() - started:.0f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
