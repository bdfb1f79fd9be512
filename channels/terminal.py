"""`python -m gateway chat`: a terminal chat on the same engine, with readline editing,
a visible "thinking…" state and the reply printed as it streams in (SPEC §5.1)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import shutil
import sys
import unicodedata
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TextIO

from channels.base import ReplyRefSink, StreamObserver
from gateway.config import Config
from gateway.types import Inbound

try:  # line editing and history where the platform has it
    import readline  # noqa: F401
except ImportError:  # pragma: no cover
    pass

PROMPT = "you> "
BOT = "bot> "


class TerminalChannel:
    """Replies go to `out` (stdout). On a terminal, status lines and text that turned out
    not to be the answer are erased in place; into a pipe or file every line stays, and
    the reply is printed whole at the end when it differs from what was streamed."""

    name = "terminal"

    def __init__(self, *, out: TextIO | None = None, tty: bool | None = None,
                 observe: StreamObserver | None = None) -> None:
        self.out = out or sys.stdout
        self.tty = self.out.isatty() if tty is None else tty
        self.observe = observe
        # (reply, already printed by its stream): the chat loop prints the others.
        self.replies: asyncio.Queue[tuple[str, bool]] = asyncio.Queue()

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def is_ready(self) -> bool:
        return True

    async def send(self, inbound: Inbound, text: str) -> None:
        if inbound.origin is not None:
            # A scheduled task's reply: no prompt waits for it, so it is printed as it comes.
            self.out.write(f"\n{BOT}{text}\n\n")
            self.out.flush()
            return
        await self.replies.put((text, False))

    def stream(self, inbound: Inbound, *, on_ref: ReplyRefSink | None = None,
               resume_ref: str | None = None) -> TerminalStream:
        # Nothing printed before a restart can be edited: `on_ref`/`resume_ref` go unused.
        return TerminalStream(self, awaited=inbound.origin is None)

    @contextlib.asynccontextmanager
    async def typing(self, inbound: Inbound) -> AsyncIterator[None]:
        if not self.tty:
            yield
            return
        task = asyncio.get_running_loop().create_task(_spinner(self.out))
        try:
            yield
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            self.out.write("\r\033[K")
            self.out.flush()


class TerminalStream:
    """One reply printed as it grows; a ReplyStream (channels/base.py)."""

    def __init__(self, channel: TerminalChannel, *, awaited: bool = True) -> None:
        self.channel = channel
        self.out = channel.out
        self.awaited = awaited  # the chat loop waits for this reply (not so a scheduled task's)
        self.printed = ""  # answer text on screen since the last status
        self.status_shown = False
        self.started = False

    def _observe(self, event: str) -> None:
        if self.channel.observe is not None:
            self.channel.observe(event)

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    def _clear_status(self) -> None:
        if self.status_shown and self.channel.tty:
            self._write("\r\033[K")
        self.status_shown = False

    def _take_back_text(self) -> None:
        """Remove the printed answer text: erased on a terminal, the line ended elsewhere."""
        if not self.printed:
            return
        if self.channel.tty:
            rows = _rows(BOT + self.printed, shutil.get_terminal_size().columns)
            self._write("\r" + (f"\033[{rows - 1}A" if rows > 1 else "") + "\033[J")
        else:
            self._write("\n")
        self.printed = ""

    async def append(self, delta: str) -> None:
        if not self.started:
            self.started = True
            self._observe("reply")
        self._clear_status()
        if not self.printed:
            self._write(BOT)
        self._write(delta)
        self.printed += delta

    async def status(self, line: str) -> None:
        self._take_back_text()
        self._clear_status()
        self._write(f"\r\033[K\033[2m{line}\033[0m" if self.channel.tty else f"{line}\n")
        self.status_shown = True

    async def finish(self, text: str) -> None:
        self._end(text)

    async def fail(self, text: str) -> None:
        self._end(text)

    def _end(self, text: str) -> None:
        self._clear_status()
        if self.printed != text:
            self._take_back_text()
            self._write(BOT + text)
        self._write("\n\n")
        self.printed = ""
        if self.awaited:
            self.channel.replies.put_nowait((text, True))


def _rows(text: str, columns: int) -> int:
    """Terminal rows `text` takes at this width (wide CJK characters count twice)."""
    columns = max(1, columns)
    rows = 0
    for line in text.split("\n"):
        width = sum(0 if unicodedata.combining(ch) else 2 if unicodedata.east_asian_width(ch) in "WF" else 1
                    for ch in line)
        rows += max(1, math.ceil(width / columns))
    return rows


async def _spinner(out: TextIO) -> None:
    frames = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"
    i = 0
    while True:
        out.write(f"\r{frames[i % len(frames)]} thinking…")
        out.flush()
        i += 1
        await asyncio.sleep(0.1)


async def run_terminal(cfg: Config, cfg_path: Path | None) -> int:
    from gateway.app import Gateway, StartupError

    gateway = Gateway(cfg, config_path=cfg_path, serve_http=False, enable_channels=False,
                      watch_config=True)
    # Attached before the start: a scheduled task due at start finds its channel up.
    terminal = TerminalChannel()
    gateway.channels["terminal"] = terminal
    try:
        await gateway.start()
    except StartupError as err:
        print(f"cannot start: {err}", file=sys.stderr)
        return 2
    terminal.observe = gateway.stream_observer("terminal")
    print("Terminal chat (session terminal:local). /help for commands, Ctrl+D to quit.")
    try:
        while True:
            try:
                line = await asyncio.to_thread(input, PROMPT)
            except EOFError:
                print()
                break
            if not line.strip():
                continue
            inbound = Inbound(channel="terminal", chat_id="local", user_id="local", text=line,
                              event_id=uuid.uuid4().hex)
            await gateway.router.handle(inbound)
            reply, printed = await asyncio.wait_for(terminal.replies.get(), timeout=cfg.limits.turn_timeout_s + 30)
            if not printed:  # a command's answer, or a reply that was not streamed
                print(f"{BOT}{reply}\n")
    except (KeyboardInterrupt, asyncio.CancelledError):
        print()
    finally:
        await gateway.stop()
    return 0
