"""`python -m gateway chat`: a terminal chat on the same engine, with readline editing,
a visible "thinking…" state and the reply printed as it streams in (SPEC §5.1).

Every answer follows its own question. The chat runs only the terminal channel: at start
it resumes only the terminal's pending turns (other channels' events stay pending for
`gateway run`), and answers a question left unanswered by an earlier Ctrl+C before the
first prompt, labelled with the question it answers. Lines typed while an answer comes
in wait in the terminal's input (not echoed over the answer) and are sent in order.

On a terminal, a reply streams as plain text; when it is complete it is shown again as
rendered Markdown (rich) in the same place, unless it grew taller than the window (the
plain text then stays, never shown twice). Into a pipe or file every line stays and
Markdown stays as written. Log lines never print over the prompt or an answer: the log
goes to `chat.log` in the data dir, and warnings are shown between answers."""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import math
import shutil
import signal
import sys
import threading
import unicodedata
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from channels.base import ReplyRefSink, StreamObserver
from gateway.config import Config
from gateway.types import Inbound

if TYPE_CHECKING:
    from gateway.app import Gateway
    from gateway.logs import HeldLines

try:  # line editing and history where the platform has it
    import readline  # noqa: F401

    HAVE_READLINE = True
except ImportError:  # pragma: no cover
    HAVE_READLINE = False

try:
    import termios
except ImportError:  # pragma: no cover  (not on Windows)
    termios = None  # type: ignore[assignment]

log = logging.getLogger("channels.terminal")

PROMPT = "you> "
BOT = "bot> "
EARLIER = "The chat stopped before answering this earlier question:"
STOPPED_MID_TURN = "Stopped mid-answer; your question is answered when the chat starts again."
QUOTE_CHARS = 300
LOG_FILE = "chat.log"
DIM, RESET = "\033[2m", "\033[0m"


class TerminalChannel:
    """Replies go to `out` (stdout). On a terminal, status lines and text that turned out
    not to be the answer are erased in place, and a finished reply is rendered as
    Markdown; into a pipe or file every line stays, and the reply is printed whole at
    the end when it differs from what was streamed.

    `earlier` tells which questions were asked before this chat started (resumed after
    a Ctrl+C or a crash): their answers are labelled with the question first."""

    name = "terminal"

    def __init__(self, *, out: TextIO | None = None, tty: bool | None = None,
                 observe: StreamObserver | None = None, earlier: Callable[[Inbound], bool] | None = None) -> None:
        self.out = out or sys.stdout
        self.tty = self.out.isatty() if tty is None else tty
        self.observe = observe
        self.earlier = earlier
        self._introduced: set[str] = set()
        self._colors: Any = None
        # (reply, already printed): every reply is printed by the channel itself.
        self.replies: asyncio.Queue[tuple[str, bool]] = asyncio.Queue()

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def is_ready(self) -> bool:
        return True

    async def send(self, inbound: Inbound, text: str) -> None:
        self.introduce(inbound)
        if inbound.origin is not None:
            # A scheduled task's reply: no question waits for it; it starts on a line of its own.
            self.write("\n")
        self.write((self.render(text) if self.tty else f"{BOT}{text}\n") + "\n")
        if inbound.origin is None:
            self.replies.put_nowait((text, True))

    def stream(self, inbound: Inbound, *, on_ref: ReplyRefSink | None = None,
               resume_ref: str | None = None) -> TerminalStream:
        # Nothing printed before a restart can be edited: `on_ref`/`resume_ref` go unused.
        return TerminalStream(self, inbound)

    @contextlib.asynccontextmanager
    async def typing(self, inbound: Inbound) -> AsyncIterator[None]:
        self.introduce(inbound)
        if not self.tty:
            yield
            return
        task = asyncio.get_running_loop().create_task(_spinner(self.out))
        try:
            yield
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            self.write("\r\033[K")

    # -- output -------------------------------------------------------------------------

    def write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    def introduce(self, inbound: Inbound) -> None:
        """Before the first output for a question from before this chat started: which
        question it answers."""
        if self.earlier is None or inbound.event_id in self._introduced or not self.earlier(inbound):
            return
        self._introduced.add(inbound.event_id)
        quote = " ".join(inbound.text.split())
        if len(quote) > QUOTE_CHARS:
            quote = quote[:QUOTE_CHARS - 1] + "…"
        label = f"{DIM}{EARLIER}{RESET}" if self.tty else EARLIER
        self.write(f"{label}\n{PROMPT}{quote}\n")

    def render(self, text: str) -> str:
        """`text` as Markdown for this terminal, after "bot> " and indented under it (as
        written, should rendering fail)."""
        try:
            return self._render(text)
        except Exception:
            log.exception("could not render a reply as Markdown; showing it as written")
            return f"{BOT}{text}\n"

    def _render(self, text: str) -> str:
        from markdown_it import MarkdownIt
        from rich.console import Console
        from rich.markdown import Markdown

        if self._colors is None:
            self._colors = Console(file=self.out).color_system or ""
        width = max(20, _columns() - len(BOT))
        buffer = io.StringIO()
        console = Console(file=buffer, force_terminal=True, color_system=self._colors or None, width=width)
        markdown = Markdown(text)
        # Single line breaks are kept, as on the web page (marked's `breaks`) and in
        # Telegram: replies and command answers put one item per line.
        markdown.parsed = MarkdownIt("commonmark", {"breaks": True}).enable(["strikethrough", "table"]).parse(text)
        console.print(markdown)
        lines = buffer.getvalue().rstrip("\n").split("\n")
        while len(lines) > 1 and not _visible(lines[0]):  # a leading blank line under "bot> "
            lines.pop(0)
        pad = " " * len(BOT)
        # Rich pads lines to the width with spaces: without them a narrowed window does not
        # wrap the reply into a staircase.
        return BOT + lines[0].rstrip(" ") + "\n" + "".join(f"{pad}{line}".rstrip(" ") + "\n" for line in lines[1:])


class TerminalStream:
    """One reply printed as it grows; a ReplyStream (channels/base.py)."""

    def __init__(self, channel: TerminalChannel, inbound: Inbound | None = None) -> None:
        self.channel = channel
        self.inbound = inbound
        self.out = channel.out
        self.printed = ""  # answer text on screen since the last status
        self.status_shown = False
        self.started = False

    def _observe(self, event: str) -> None:
        if self.channel.observe is not None:
            self.channel.observe(event)

    def _write(self, text: str) -> None:
        self.channel.write(text)

    def _introduce(self) -> None:
        if self.inbound is not None:
            self.channel.introduce(self.inbound)

    def _clear_status(self) -> None:
        if self.status_shown and self.channel.tty:
            self._write("\r\033[K")
        self.status_shown = False

    def _fits(self) -> bool:
        """Whether the printed text is all still on screen (it can be erased in place)."""
        size = shutil.get_terminal_size()
        return _rows(BOT + self.printed, size.columns) < size.lines

    def _take_back_text(self) -> None:
        """Remove the printed answer text: erased on a terminal, the line ended elsewhere
        (and where its top has scrolled out of the window)."""
        if not self.printed:
            return
        if self.channel.tty and self._fits():
            rows = _rows(BOT + self.printed, shutil.get_terminal_size().columns)
            self._write("\r" + (f"\033[{rows - 1}A" if rows > 1 else "") + "\033[J")
        else:
            self._write("\n")
        self.printed = ""

    async def append(self, delta: str) -> None:
        if not self.started:
            self.started = True
            self._observe("reply")
        self._introduce()
        self._clear_status()
        if not self.printed:
            self._write(BOT)
        self._write(delta)
        self.printed += delta

    async def status(self, line: str) -> None:
        self._introduce()
        self._take_back_text()
        self._clear_status()
        self._write(f"\r\033[K{DIM}{line}{RESET}" if self.channel.tty else f"{line}\n")
        self.status_shown = True

    async def finish(self, text: str) -> None:
        self._end(text, markdown=True)

    async def fail(self, text: str) -> None:
        self._end(text, markdown=False)

    def _end(self, text: str, *, markdown: bool) -> None:
        self._introduce()
        self._clear_status()
        if markdown and self.channel.tty and (not self.printed or self._fits()):
            # The whole reply is on screen: shown again, rendered, in its place.
            self._take_back_text()
            self._write(self.channel.render(text) + "\n")
        else:
            if self.printed != text:
                self._take_back_text()
                self._write(BOT + text)
            self._write("\n\n")
        self.printed = ""
        if self.inbound is None or self.inbound.origin is None:  # a task's reply answers no question
            self.channel.replies.put_nowait((text, True))


def _shown_path(path: Path) -> str:
    """`path` relative to the working directory when it is below it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _columns() -> int:
    return shutil.get_terminal_size().columns


def _visible(line: str) -> bool:
    """Whether a rendered line shows anything (escape sequences and spaces do not)."""
    plain, skip = [], False
    for ch in line:
        if ch == "\033":
            skip = True
        elif skip:
            skip = not ch.isalpha()
        else:
            plain.append(ch)
    return bool("".join(plain).strip())


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


# -- the chat loop ------------------------------------------------------------------------


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


def _read_line(loop: asyncio.AbstractEventLoop, keyboard: Keyboard) -> asyncio.Future[str | None]:
    """The next line typed after the prompt (None at end of input). input() blocks, so it
    runs in a daemon thread of its own: one still waiting when the chat ends does not
    hold the process. Echo goes off as soon as the line is in, before the answer starts."""
    future: asyncio.Future[str | None] = loop.create_future()

    def deliver(line: str | None) -> None:
        if not future.done():
            future.set_result(line)

    def read() -> None:
        try:
            line: str | None = input(PROMPT)
        except (EOFError, OSError, ValueError):  # Ctrl+D, or stdin went away
            line = None
        keyboard.echo(False)
        with contextlib.suppress(RuntimeError):  # the loop already closed
            loop.call_soon_threadsafe(deliver, line)

    threading.Thread(target=read, name="terminal-input", daemon=True).start()
    return future


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
        return self.gateway.router.keys(probe)[0]

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

    async def settle(self) -> bool:
        """Until the terminal session has nothing queued or running (its answers printed);
        False on Ctrl+C."""
        # One turn is bounded by turn_timeout_s, its delivery by FINISH_TIMEOUT_S.
        bound = self.gateway.cfg.limits.turn_timeout_s + 360
        while True:
            worker = self.gateway.sessions.worker_of(self.key)
            if worker is None:
                break
            if not await self._until_interrupted(worker, bound):
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
            reading = _read_line(loop, self.keyboard)
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
            if not await self._until_interrupted(self.handling, timeout=bound) or not await self.settle():
                return await self._stop(mid_turn=True)

    async def _stop(self, *, mid_turn: bool) -> int:
        if self.handling is not None and not self.handling.done():
            self.handling.cancel()  # recorded or not, the event is resumed or never was
            await asyncio.gather(self.handling, return_exceptions=True)
        if mid_turn:
            await self.gateway.stop(0)  # Ctrl+C: the turn is cut now and resumed at the next start
            self.terminal.write(f"\n{STOPPED_MID_TURN}\n")
        else:
            await self.gateway.stop()
        self.show_held_logs()
        return 0


async def run_terminal(cfg: Config, cfg_path: Path | None) -> int:
    from gateway.app import Gateway, StartupError, check_data_dir
    from gateway.logs import setup_chat_logging

    loop = asyncio.get_running_loop()
    gateway = Gateway(cfg, config_path=cfg_path, serve_http=False, enable_channels=False, watch_config=True)
    # The router exists once the gateway has started, before any reply is printed.
    terminal = TerminalChannel(earlier=lambda inbound: (inbound.channel, inbound.event_id) in gateway.router.resumed)
    # Registered before the start, so that the terminal's own pending turns are resumed
    # (and only they: no other channel runs here).
    gateway.channels["terminal"] = terminal
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
        terminal.observe = gateway.stream_observer("terminal")
        return await Chat(gateway, terminal, held, keyboard, interrupted).run()
    finally:
        keyboard.restore()
        with contextlib.suppress(NotImplementedError):
            loop.remove_signal_handler(signal.SIGINT)
