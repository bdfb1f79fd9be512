"""`python -m gateway chat`: the prompt loop of a terminal chat on the same engine (SPEC §8).

Every answer follows its own question. Ctrl+C during an answer is /stop: the answer ends
with what was shown, marked, and the prompt comes back; at the prompt, or a second time
while an answer is being stopped, it quits. The chat runs only the terminal channel: at
start it resumes only the terminal's pending turns (other channels' events stay pending
for `gateway run`), and answers a question left unanswered by a crash or a quit mid-answer
before the first prompt, labelled with the question it answers. Lines typed while an answer comes
in wait in the terminal's input (not echoed over the answer) and are sent in order. Log
lines never print over the prompt or an answer: the log goes to `chat.log` in the data
dir, and warnings are shown between answers."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import uuid
from pathlib import Path
from typing import Any

from channels.terminal.channel import DIM, RESET, TerminalChannel
from channels.terminal.keyboard import Keyboard, read_line
from gateway.app import Gateway, StartupError, check_data_dir
from gateway.config.schema import Config
from gateway.ops.logs import HeldLines, setup_chat_logging
from gateway.types import Inbound

STOPPED_MID_TURN = "Stopped mid-answer; your question is answered when the chat starts again."
LOG_FILE = "chat.log"


def _shown_path(path: Path) -> str:
    """`path` relative to the working directory when it is below it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


class Chat:
    """The prompt loop: one question at a time, each answer after its question."""

    def __init__(self, gateway: Gateway, terminal: TerminalChannel, held: HeldLines | None,
                 keyboard: Keyboard, interrupted: asyncio.Event) -> None:
        self.gateway = gateway
        self.terminal = terminal
        self.held = held
        self.keyboard = keyboard
        self.interrupted = interrupted  # set by Ctrl+C
        self.handling: asyncio.Future[Any] | None = None

    @property
    def key(self) -> str:
        probe = Inbound(channel="terminal", chat_id="local", user_id="local", text="", event_id="")
        return self.gateway.places.keys(probe)[0]

    def show_held_logs(self) -> None:
        if self.held is None:
            return
        lines = self.held.take()
        if lines:
            sys.stdout.flush()
            dim, reset = (DIM, RESET) if self.terminal.tty else ("", "")
            sys.stderr.write("".join(f"{dim}{line}{reset}\n" for line in lines))
            sys.stderr.flush()

    async def _until_interrupted(self, waited: asyncio.Future[Any], timeout: float | None) -> bool:
        """Wait for `waited` (at most `timeout`; None: a person typing takes what it
        takes); False when Ctrl+C came first."""
        stop = asyncio.ensure_future(self.interrupted.wait())
        try:
            await asyncio.wait({waited, stop}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            await asyncio.gather(stop, return_exceptions=True)
        return not self.interrupted.is_set()

    async def _answered(self, waited: asyncio.Future[Any], timeout: float) -> bool:
        """Wait for `waited` (at most `timeout`). A Ctrl+C meanwhile is /stop (SPEC §6): the
        answer ends with what was shown, and the wait goes on for the rest; a second Ctrl+C
        before the first one's stop is through is False: the chat quits now."""
        if await self._until_interrupted(waited, timeout):
            return True
        self.interrupted.clear()
        stop = asyncio.ensure_future(self.gateway.sessions.stop_turn(self.key, "terminal:local"))
        try:
            if not await self._until_interrupted(stop, timeout=None):
                return False
        finally:
            stop.cancel()
            await asyncio.gather(stop, return_exceptions=True)
        return await self._until_interrupted(waited, timeout)

    async def settle(self) -> bool:
        """Until the terminal session has nothing queued or running (its answers printed);
        False on a Ctrl+C that quits."""
        # One turn is bounded by turn_timeout_s, its delivery by FINISH_TIMEOUT_S.
        bound = self.gateway.cfg.limits.turn_timeout_s + 360
        while True:
            worker = self.gateway.sessions.worker_of(self.key)
            if worker is None:
                break
            if not await self._answered(worker, bound):
                return False
        while not self.terminal.replies.empty():  # printed already; the queue is for tests
            self.terminal.replies.get_nowait()
        return True

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        if not await self.settle():  # questions from before (a Ctrl+C) are answered first
            return await self._stop(mid_turn=True)
        while True:
            self.show_held_logs()
            self.keyboard.echo(True)
            reading = read_line(loop, self.keyboard)
            if not await self._until_interrupted(reading, timeout=None) or reading.result() is None:
                self.terminal.write("\n")
                return await self._stop(mid_turn=False)
            line = reading.result() or ""
            if not line.strip():
                continue
            inbound = Inbound(channel="terminal", chat_id="local", user_id="local", text=line,
                              event_id=uuid.uuid4().hex)
            self.handling = asyncio.ensure_future(self.gateway.router.handle(inbound))
            bound = self.gateway.cfg.limits.turn_timeout_s
            if not await self._answered(self.handling, timeout=bound) or not await self.settle():
                return await self._stop(mid_turn=True)

    async def _stop(self, *, mid_turn: bool) -> int:
        if self.handling is not None and not self.handling.done():
            self.handling.cancel()  # recorded or not, the event is resumed or never was
            await asyncio.gather(self.handling, return_exceptions=True)
        if mid_turn:
            await self.gateway.stop(0)  # a second Ctrl+C: the turn is cut now and resumed at the next start
            self.terminal.write(f"\n{STOPPED_MID_TURN}\n")
        else:
            await self.gateway.stop()
        self.show_held_logs()
        return 0


async def run_terminal(cfg: Config, cfg_path: Path | None) -> int:
    loop = asyncio.get_running_loop()
    gateway = Gateway(cfg, config_path=cfg_path, serve_http=False, enable_channels=False, watch_config=True)
    # The router exists once the gateway has started, before any reply is printed.
    terminal = TerminalChannel(earlier=lambda inbound: (inbound.channel, inbound.event_id) in gateway.router.resumed)
    # Registered before the start, so that the terminal's own pending turns are resumed
    # (and only they: no other channel runs here).
    gateway.add_channel("terminal", terminal)
    keyboard = Keyboard(sys.stdin)
    interrupted = asyncio.Event()
    with contextlib.suppress(NotImplementedError):
        loop.add_signal_handler(signal.SIGINT, interrupted.set)
    try:
        try:
            await asyncio.to_thread(check_data_dir, gateway.holder.data_dir)
        except StartupError as err:
            print(f"cannot start: {err}", file=sys.stderr)
            return 2
        held = setup_chat_logging(cfg.log_level, gateway.holder.data_dir / LOG_FILE)
        print("Terminal chat (session terminal:local). /help for commands, Ctrl+D to quit.")
        print(f"(the log is in {_shown_path(gateway.holder.data_dir / LOG_FILE)}; warnings also show here)")
        try:
            await gateway.start()
        except StartupError as err:
            await gateway.stop()
            for line in held.take():
                print(line, file=sys.stderr)
            print(f"cannot start: {err}", file=sys.stderr)
            return 2
        assert gateway.services is not None
        terminal.observe = gateway.stream_observer("terminal")
        terminal.decide = gateway.services.approvals.decide  # y/n for a tool that waits for a yes (SPEC §5.7)

        async def ask_line(prompt: str) -> str | None:
            keyboard.echo(True)
            return await read_line(loop, keyboard, prompt)

        terminal.ask_line = ask_line
        return await Chat(gateway, terminal, held, keyboard, interrupted).run()
    finally:
        keyboard.restore()
        with contextlib.suppress(NotImplementedError):
            loop.remove_signal_handler(signal.SIGINT)
