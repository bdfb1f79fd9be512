"""Reading the person's lines: the prompt, readline editing, and echo off while an answer
comes in."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any, TextIO

try:  # line editing and history where the platform has it
    import readline  # noqa: F401

    HAVE_READLINE = True
except ImportError:  # pragma: no cover
    HAVE_READLINE = False

try:
    import termios
except ImportError:  # pragma: no cover  (not on Windows)
    termios = None  # type: ignore[assignment]

from channels.terminal.channel import PROMPT


class Keyboard:
    """The terminal's input settings. While an answer comes in, what is typed is not
    echoed (it would land inside the answer); it waits in the terminal's input and
    readline shows it after the next prompt. Restored at exit, also when readline was
    interrupted in the middle of a line."""

    def __init__(self, stream: TextIO) -> None:
        self.fd = -1
        self.saved: list[Any] | None = None
        if termios is None or not HAVE_READLINE:
            return
        try:
            if stream.isatty():
                self.fd = stream.fileno()
                self.saved = termios.tcgetattr(self.fd)
        except (OSError, ValueError, termios.error):
            self.saved = None

    def echo(self, on: bool) -> None:
        if self.saved is None:
            return
        with contextlib.suppress(termios.error, OSError):
            attrs = termios.tcgetattr(self.fd)
            attrs[3] = attrs[3] | termios.ECHO if on else attrs[3] & ~termios.ECHO
            termios.tcsetattr(self.fd, termios.TCSANOW, attrs)

    def restore(self) -> None:
        if self.saved is not None:
            with contextlib.suppress(termios.error, OSError):
                termios.tcsetattr(self.fd, termios.TCSANOW, self.saved)


def read_line(loop: asyncio.AbstractEventLoop, keyboard: Keyboard, prompt: str = PROMPT) -> asyncio.Future[str | None]:
    """The next line typed after the prompt (None at end of input). input() blocks, so it
    runs in a daemon thread of its own: one still waiting when the chat ends does not
    hold the process. Echo goes off as soon as the line is in, before the answer starts."""
    future: asyncio.Future[str | None] = loop.create_future()

    def deliver(line: str | None) -> None:
        if not future.done():
            future.set_result(line)

    def read() -> None:
        try:
            line: str | None = input(prompt)
        except (EOFError, OSError, ValueError):  # Ctrl+D, or stdin went away
            line = None
        keyboard.echo(False)
        with contextlib.suppress(RuntimeError):  # the loop already closed
            loop.call_soon_threadsafe(deliver, line)

    threading.Thread(target=read, name="terminal-input", daemon=True).start()
    return future


