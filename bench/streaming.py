"""Benchmark: streamed Telegram replies (SPEC §5.1) at 100 concurrent sessions.

    python -m bench.streaming [--sessions 100] [--rounds 3] [--chunks 50] [--seconds 5] [--interval 1.0] \
                              [--mode auto|edit]

The gateway runs as its own process (`python -m gateway run`, Telegram polling,
`streaming: --mode`: `auto`, the default, shows these private chats' replies as drafts;
`edit` edits a message); this process hosts the fake Bot API (Telegram's one edit and
one draft a second per chat enforced) and a fake model that streams every reply in
`--chunks` pieces spread evenly over `--seconds`. Each round, `--sessions` new chats send
one message at once.

- **first visible delay**: when the fake Bot API received the chat's first draft or
  sendMessage, minus when the fake model wrote the reply's first chunk (both stamped in
  this process, on one clock).
- **past the first interval**: the same arrival minus the earliest moment the stream may
  show anything (SPEC §5.1: nothing in the first `stream_interval_s`, so that a reply
  complete within it is sent once, finished): the model's first chunk + the interval with
  edits; with drafts the later of the first chunk and the model request's arrival + the
  interval (the stream opens just before the request, so this slightly overstates what
  the gateway adds). What the gateway adds before a person sees the first words.
- **baseline**: the same model, the same number of concurrent streams, read by a bare
  aiohttp client in this process: first chunk read minus first chunk written. It is the
  floor of that measurement (loopback and this process's own event loop), no gateway.
- **platform calls per reply**: sendMessageDraft + sendMessage + editMessageText +
  deleteMessage calls for the chat (refused ones included), against the bound reply
  seconds / stream_interval_s + 2 (one update per interval while the model writes, the
  first one, the formatted end).
- **final delay**: final text (formatting included) visible minus the model's last chunk:
  with edits the pace holds the last update back by up to one interval; a draft reply's
  message does not wait.
- **gateway CPU per reply**: the gateway process's utime + stime over the measured
  rounds / replies.

Goal: first visible p99 ≤ 50 ms past the first interval; calls per reply within the
bound; no 429. Writes bench/out/streaming.{json,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from bench._procs import ROOT, Child, gateway_config, start_gateway, telegram_section
from channels.telegram.format import render_markdown
from tests.fakes.telegram_server import FakeTelegram

OUT = ROOT / "bench" / "out"
GOAL_P99_MS = 50.0
ROUND_TIMEOUT_S = 60.0
MESSAGE_METHODS = ("sendmessagedraft", "sendmessage", "editmessagetext", "deletemessage")


def chunk_text(k: int) -> str:
    """The k-th piece of every reply: prose with formatting, CJK and emoji (~50 chars)."""
    return f"Part {k} of the answer, with **bold {k}**, 数据 and 🙂. "


def reply_text(chunks: int) -> str:
    return "".join(chunk_text(k) for k in range(chunks))


# ---------------------------------------------------------------------------- the fake model


class StreamingModel:
    """An OpenAI-compatible chat-completions server that streams every reply in `chunks`
    pieces over `seconds`, stamping when it wrote each reply's first and last piece (keyed
    by the request's last user text)."""

    def __init__(self, chunks: int, seconds: float) -> None:
        self.chunks = chunks
        self.step = seconds / chunks
        self.requested: dict[str, float] = {}  # when the reply's (first) request arrived
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.written: dict[str, list[tuple[float, int]]] = {}  # per reply: (time, characters written so far)
        self.base_url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.base_url = f"http://127.0.0.1:{self._runner.addresses[0][1]}/v1"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        users = [m for m in body.get("messages", []) if m.get("role") == "user"]
        tag = str(users[-1].get("content", "")) if users else ""
        self.requested.setdefault(tag, time.monotonic())
        text = reply_text(self.chunks)
        if not body.get("stream"):
            return web.json_response({
                "id": "cmpl-bench", "object": "chat.completion", "created": int(time.time()), "model": "fake-model",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 100, "completion_tokens": len(text) // 4, "total_tokens": 100},
            })
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)

        async def send(delta: dict[str, Any], finish: str | None = None) -> None:
            chunk = {"id": "cmpl-bench", "object": "chat.completion.chunk", "created": 0, "model": "fake-model",
                     "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
            await response.write(f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n".encode())

        await send({"role": "assistant", "content": ""})
        loop = asyncio.get_running_loop()
        began = loop.time()
        written = self.written.setdefault(tag, [])
        size = 0
        for k in range(self.chunks):
            # On a fixed schedule: a late wake-up does not push every later piece back.
            await asyncio.sleep(max(0.0, began + (k + 1) * self.step - loop.time()))
            await send({"content": chunk_text(k)})
            size += len(chunk_text(k))
            written.append((time.monotonic(), size))
            if k == 0:
                self.first[tag] = written[0][0]
        self.last[tag] = time.monotonic()
        await send({}, "stop")
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": 100, "completion_tokens": len(text) // 4, "total_tokens": 100 + len(text) // 4}
            await response.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


# ---------------------------------------------------------------------------- the fake Bot API


class StampedTelegram(FakeTelegram):
    """The fake Bot API (Telegram's flood control on) stamping each chat's first draft or
    sendMessage and the moment it shows the whole reply, formatting included."""

    def __init__(self, expected: list[tuple[str, list[dict[str, Any]]]]) -> None:
        super().__init__(edit_interval_s=1.0)
        self.expected = expected
        self.first_send: dict[int, float] = {}
        self.done_at: dict[int, float] = {}
        self.chat_messages: dict[int, list[int]] = {}
        self.all_done = asyncio.Event()
        self.waiting_for: set[int] = set()
        self.visible: dict[int, list[tuple[float, int]]] = {}  # per chat: (time, characters shown)
        self.outcomes: dict[int, list[tuple[float, str, int]]] = {}  # per chat: (time, method, HTTP status)


    async def _api_sendmessagedraft(self, params: dict[str, Any]) -> web.Response:
        arrived = time.monotonic()
        response = await super()._api_sendmessagedraft(params)
        self._outcome(params, "draft", response)
        if response.status == 200:
            chat = int(params["chat_id"])
            self.first_send.setdefault(chat, arrived)
            self.visible.setdefault(chat, []).append((time.monotonic(), len(self.draft(chat) or "")))
        return response

    async def _api_sendmessage(self, params: dict[str, Any]) -> web.Response:
        self.first_send.setdefault(int(params["chat_id"]), time.monotonic())
        response = await super()._api_sendmessage(params)
        self._outcome(params, "send", response)
        if response.status == 200:
            message_id = json.loads(response.text or "{}")["result"]["message_id"]
            self.chat_messages.setdefault(int(params["chat_id"]), []).append(message_id)
            self._check(int(params["chat_id"]))
        return response

    async def _api_editmessagetext(self, params: dict[str, Any]) -> web.Response:
        response = await super()._api_editmessagetext(params)
        self._outcome(params, "edit" if "entities" not in params else "edit+format", response)
        if response.status == 200:
            self._check(int(params["chat_id"]))
        return response

    async def _api_deletemessage(self, params: dict[str, Any]) -> web.Response:
        response = await super()._api_deletemessage(params)
        self._outcome(params, "delete", response)
        if response.status == 200:
            self._check(int(params["chat_id"]))
        return response

    def _outcome(self, params: dict[str, Any], what: str, response: web.Response) -> None:
        self.outcomes.setdefault(int(params["chat_id"]), []).append((time.monotonic(), what, response.status))

    def shows(self, chat: int) -> list[tuple[str, list[dict[str, Any]]]]:
        shown = (self._shown.get(m) for m in self.chat_messages.get(chat, []))
        return [(s[1].text, s[1].entities) for s in shown if s is not None]

    def _check(self, chat: int) -> None:
        shows = self.shows(chat)
        self.visible.setdefault(chat, []).append((time.monotonic(), sum(len(text) for text, _ in shows)))
        if chat in self.done_at or shows != self.expected:
            return
        self.done_at[chat] = time.monotonic()
        self.waiting_for.discard(chat)
        if not self.waiting_for:
            self.all_done.set()

    def message_calls(self, chat: int) -> int:
        return sum(1 for name, p in self.calls
                   if name.lower() in MESSAGE_METHODS and str(p.get("chat_id")) == str(chat))


# ---------------------------------------------------------------------------- measuring


@dataclass
class Results:
    sessions: int
    rounds: int
    chunks: int
    seconds: float
    interval_s: float
    mode: str = "auto"
    first_visible_ms: list[float] = field(default_factory=list)
    past_interval_ms: list[float] = field(default_factory=list)
    baseline_ms: list[float] = field(default_factory=list)
    final_ms: list[float] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)
    bounds: list[float] = field(default_factory=list)
    cpu_ms_per_reply: float = 0.0  # the gateway process's utime + stime over the measured rounds / replies
    load_average: list[float] = field(default_factory=list)  # 1-minute load at the start and the end
    # One reply (the median first visible delay of the last round) as it grew: seconds
    # after the model's first chunk → characters written by the model / shown in Telegram.
    sample_written: list[tuple[float, int]] = field(default_factory=list)
    sample_shown: list[tuple[float, int]] = field(default_factory=list)
    sample_calls: int = 0
    over_bound: list[str] = field(default_factory=list)  # the calls of replies over the bound, described
    rate_limited: int = 0
    chat_actions: int = 0
    missing: int = 0
    errors: list[str] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


async def gateway_round(telegram: StampedTelegram, model: StreamingModel, chats: list[int], res: Results,
                        *, measured: bool) -> None:
    telegram.waiting_for = set(chats)
    telegram.all_done.clear()
    for chat in chats:
        telegram.push_message(chat_id=chat, user_id=chat, text=f"bench-{chat}")
    try:
        await asyncio.wait_for(telegram.all_done.wait(), ROUND_TIMEOUT_S)
    except TimeoutError:
        res.errors.append(f"{len(telegram.waiting_for)} chats did not show the whole reply in {ROUND_TIMEOUT_S:.0f} s")
    if not measured:
        return
    done = [c for c in chats if c in telegram.done_at and f"bench-{c}" in model.first]
    if done:
        done.sort(key=lambda c: telegram.first_send[c] - model.first[f"bench-{c}"])
        sample = done[len(done) // 2]
        zero = model.first[f"bench-{sample}"]
        res.sample_written = [(t - zero, n) for t, n in model.written[f"bench-{sample}"]]
        res.sample_shown = [(t - zero, n) for t, n in telegram.visible[sample]]
        res.sample_calls = telegram.message_calls(sample)
    for chat in chats:
        tag = f"bench-{chat}"
        if chat not in telegram.done_at or tag not in model.first:
            res.missing += 1
            continue
        res.first_visible_ms.append((telegram.first_send[chat] - model.first[tag]) * 1000)
        opens = model.requested[tag] if res.mode != "edit" else model.first[tag]  # the first interval's start
        allowed = max(model.first[tag], opens + res.interval_s)
        res.past_interval_ms.append((telegram.first_send[chat] - allowed) * 1000)
        res.final_ms.append((telegram.done_at[chat] - model.last[tag]) * 1000)
        res.calls.append(telegram.message_calls(chat))
        res.bounds.append((model.last[tag] - model.first[tag]) / res.interval_s + 2)
        if res.calls[-1] > res.bounds[-1]:
            zero = model.first[tag]
            steps = ", ".join(f"{what}@{t - zero:.2f}s" + ("" if status == 200 else f"={status}")
                              for t, what, status in telegram.outcomes.get(chat, []))
            res.over_bound.append(f"reply written {model.last[tag] - zero:.2f}s: {steps}")


async def baseline_round(http: aiohttp.ClientSession, model: StreamingModel, sessions: int, round_no: int,
                         res: Results) -> None:
    """The same concurrent streams read by a bare client: the measurement's own floor."""

    async def one(i: int) -> None:
        tag = f"baseline-{round_no}-{i}"
        body = {"model": "fake-model", "stream": True, "messages": [{"role": "user", "content": tag}]}
        seen: float | None = None
        async with http.post(model.base_url + "/chat/completions", json=body) as resp:
            async for line in resp.content:
                if seen is None and line.startswith(b"data: {"):
                    choices = json.loads(line[6:]).get("choices") or [{}]
                    if choices[0].get("delta", {}).get("content"):
                        seen = time.monotonic()
        if seen is not None and tag in model.first:
            res.baseline_ms.append((seen - model.first[tag]) * 1000)

    await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(sessions))), ROUND_TIMEOUT_S)


async def run(sessions: int, rounds: int, chunks: int, seconds: float, interval_s: float, mode: str) -> Results:
    res = Results(sessions, rounds, chunks, seconds, interval_s, mode)
    res.load_average.append(os.getloadavg()[0])
    expected = [(c.text, list(c.entities)) for c in render_markdown(reply_text(chunks))]
    model = StreamingModel(chunks, seconds)
    telegram = StampedTelegram(expected)
    await model.start()
    await telegram.start()
    child: Child | None = None
    try:
        with tempfile.TemporaryDirectory(prefix="bench-streaming-") as tmp:
            config = gateway_config(Path(tmp), model.base_url, stream_interval_s=interval_s,
                                    telegram=telegram_section(telegram.base_url, telegram.base_file_url,
                                                              telegram.token, poll_timeout_s=10)
                                    | {"streaming": mode},
                                    limits={"max_concurrent_model_calls": 4 * sessions})
            child = await start_gateway(config, Path(tmp) / "gateway.log")
            await telegram.wait_call("getUpdates", timeout=30)
            # A smaller warm-up round first (imports, caches, connection pools), not measured.
            await gateway_round(telegram, model, [10_000 + i for i in range(max(1, sessions // 5))], res,
                                measured=False)
            telegram.rate_limited.clear()
            cpu_before = child.cpu_seconds()
            for r in range(rounds):
                chats = [100_000 * (r + 1) + i for i in range(sessions)]
                await gateway_round(telegram, model, chats, res, measured=True)
                print(f"  gateway round {r + 1}/{rounds}: {len(res.first_visible_ms)} replies so far", flush=True)
            res.cpu_ms_per_reply = (child.cpu_seconds() - cpu_before) * 1000 / max(1, len(res.calls))
            res.rate_limited = len(telegram.rate_limited)
            res.chat_actions = len(telegram.chat_actions)
            await child.stop()
            errors = [line for line in child.log_text().splitlines() if " ERROR " in line]
            res.errors += [f"gateway log: {line[:200]}" for line in errors[:5]]
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            for r in range(rounds):
                await baseline_round(http, model, sessions, r, res)
                print(f"  baseline round {r + 1}/{rounds}", flush=True)
    finally:
        if child is not None and child.returncode is None:
            await child.kill()
        await telegram.stop()
        await model.stop()
    res.load_average.append(os.getloadavg()[0])
    return res


# ---------------------------------------------------------------------------- report


def report(res: Results) -> list[str]:
    def row(name: str, values: list[float]) -> str:
        return (f"{name:34} {len(values):>6} {percentile(values, 0.5):>9.1f} {percentile(values, 0.95):>9.1f} "
                f"{percentile(values, 0.99):>9.1f} {max(values, default=float('nan')):>9.1f}")

    over = [c for c, b in zip(res.calls, res.bounds, strict=True) if c > b]
    lines = [
        f"{res.sessions} concurrent sessions × {res.rounds} rounds; each reply {res.chunks} chunks over "
        f"{res.seconds:g} s; streaming {res.mode}; stream_interval_s {res.interval_s:g}; "
        f"Telegram's 1 edit and 1 draft a second per chat enforced; "
        f"load average {' → '.join(f'{x:.1f}' for x in res.load_average)} on {os.cpu_count()} CPUs",
        "",
        f"{'ms':34} {'n':>6} {'p50':>9} {'p95':>9} {'p99':>9} {'max':>9}",
        row("first visible (gateway)", res.first_visible_ms),
        row("  past the first interval", res.past_interval_ms),
        row("first chunk read (bare client)", res.baseline_ms),
        row("final text after the last chunk", res.final_ms),
        "",
        f"platform calls per reply: mean {sum(res.calls) / max(1, len(res.calls)):.2f}, "
        f"max {max(res.calls, default=0)}; "
        f"bound (reply s / interval + 2): mean {sum(res.bounds) / max(1, len(res.bounds)):.2f}; "
        f"replies over the bound: {len(over)}",
        f"429s from the fake Bot API: {res.rate_limited}; typing calls: {res.chat_actions}; "
        f"replies missing: {res.missing}; gateway CPU per reply: {res.cpu_ms_per_reply:.1f} ms",
        "",
        f"first visible p99 ≤ {GOAL_P99_MS:g} ms past the first interval: "
        f"{percentile(res.past_interval_ms, 0.99):.1f} ms → "
        f"{'met' if percentile(res.past_interval_ms, 0.99) <= GOAL_P99_MS else 'MISSED'}",
        f"calls per reply within the bound, no 429: "
        f"{'met' if not over and res.rate_limited == 0 and res.missing == 0 else 'MISSED'}",
    ]
    lines += [f"over the bound: {o}" for o in res.over_bound[:3]]
    lines += [f"error: {e}" for e in res.errors]
    return lines


def chart(res: Results, target: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.6))
    for name, values, style in (("gateway: first draft or message", res.first_visible_ms, "-"),
                                ("bare client: first chunk read", res.baseline_ms, "--")):
        ordered = sorted(values)
        left.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], style, label=name)
    left.axvline(res.interval_s * 1000, color="grey", linewidth=0.8)  # the first interval: nothing shown before
    left.set_xscale("log")
    left.set_xlabel("ms after the model's first chunk")
    left.set_ylabel("share of replies")
    left.set_title(f"first visible text, {res.sessions} concurrent streams")
    left.legend(fontsize=8)
    left.grid(alpha=0.3)
    if res.sample_written:
        right.plot(*zip(*res.sample_written, strict=True), label="written by the model", color="tab:orange")
        times, sizes = zip(*res.sample_shown, strict=True)
        right.step(times, sizes, where="post", label="shown in Telegram (rendered)", color="tab:blue")
        right.plot(times, sizes, "o", color="tab:blue", markersize=4)
    right.set_title(f"one reply as it grows ({res.sample_calls} Bot API calls, interval {res.interval_s:g} s)")
    right.set_xlabel("seconds after the model's first chunk")
    right.set_ylabel("characters")
    right.legend(fontsize=8)
    right.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(target, dpi=80)
    plt.close(fig)


async def main(args: argparse.Namespace) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)  # a stopped gateway drops its long poll
    res = await run(args.sessions, args.rounds, args.chunks, args.seconds, args.interval, args.mode)
    print()
    for line in report(res):
        print(line)
    (OUT / "streaming.json").write_text(json.dumps(asdict(res), indent=2))
    chart(res, OUT / "streaming.png")
    print(f"\nwrote {OUT / 'streaming.json'} and {OUT / 'streaming.png'}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=100, help="concurrent sessions per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chunks", type=int, default=50, help="pieces per streamed reply")
    parser.add_argument("--seconds", type=float, default=5.0, help="how long the model takes to stream a reply")
    parser.add_argument("--interval", type=float, default=1.0, help="the gateway's stream_interval_s")
    parser.add_argument("--mode", choices=["auto", "edit"], default="auto",
                        help="channels.telegram.streaming (auto: drafts in these private chats)")
    started = time.monotonic()
    asyncio.run(main(parser.parse_args()))
    print(f"total {time.monotonic() - started:.0f}s")
