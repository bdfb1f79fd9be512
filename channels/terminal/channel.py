"""The terminal as a channel (`python -m gateway chat`): replies printed as they stream in,
with a visible "thinking…" state (SPEC §5.1). The prompt loop that reads the questions is
gateway/chat.py; reading a line is channels/terminal/keyboard.py.

On a terminal, a reply is shown as rendered Markdown while it streams (rich, wrapped at
word boundaries; the last screenful is drawn again as it grows, what scrolled above it
stays: channels/terminal/live.py), links with their address, code lines never
re-flowed (channels/terminal/markdown.py). Into a pipe or file every line stays and
Markdown stays as written."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TextIO

from channels.base import ApprovalCard, Decide, ReplyRefSink, StreamObserver
from channels.terminal.live import BOT, LiveReply, layout
from channels.terminal.markdown import render_document
from gateway.types import Inbound

log = logging.getLogger("channels.terminal")

PROMPT = "you> "
FRAME_S = 0.08  # least time between two frames of a growing reply (more when rendering takes longer)
EARLIER = "The chat stopped before answering this earlier question:"
QUOTE_CHARS = 300
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
        # Approvals (SPEC §5.7), set by the chat loop: how to read the person's y/n, and
        # where the answer goes. Without them the card says to answer /allow or /deny.
        self.ask_line: Callable[[str], Awaitable[str | None]] | None = None
        self.decide: Decide | None = None
        self._asking: dict[str, asyncio.Task[None]] = {}
        self._cards: set[str] = set()  # cards on screen: the "thinking…" spinner keeps quiet meanwhile

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
        task = asyncio.get_running_loop().create_task(_spinner(self.out, lambda: bool(self._cards)))
        try:
            yield
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            self.write("\r\033[K")

    # -- approvals (SPEC §5.7) ------------------------------------------------------------

    async def ask_approval(self, inbound: Inbound, card: ApprovalCard) -> str | None:
        """The card, whole, and a y/n question; the answer is read in the background (the
        gateway only shows the card here and waits for the decision)."""
        self._cards.add(card.id)
        rule = "-" * 40
        # Everything on the card is visible() (the card made it so): an escape sequence in the
        # arguments is printed as `\x1b`, never sent to this terminal to erase what precedes it.
        self.write(f"\r\033[K\n{rule}\nApproval needed ({card.id}): {card.tool} wants to run:\n"
                   f"{card.arguments}\n{card.files_text()}{rule}\n")
        if self.ask_line is None or self.decide is None:
            self.write(f"Answer /allow {card.id} or /deny {card.id}.\n")
        else:
            self._asking[card.id] = asyncio.get_running_loop().create_task(self._answer(card))
        return card.id

    async def _answer(self, card: ApprovalCard) -> None:
        assert self.ask_line is not None and self.decide is not None
        line = await self.ask_line(f"Allow {card.tool}? [y/N] ")
        allow = (line or "").strip().lower() in ("y", "yes")
        me = Inbound(channel="terminal", chat_id="local", user_id="local", text="", event_id=f"approval:{card.id}")
        self.write(await self.decide(card.id, me, allow) + "\n")

    async def settle_approval(self, inbound: Inbound, card: ApprovalCard, ref: str | None, outcome: str) -> None:
        asking = self._asking.pop(card.id, None)
        if asking is not None and not asking.done():
            asking.cancel()  # decided elsewhere, or timed out: the question is over
            await asyncio.gather(asking, return_exceptions=True)
            self.write("\n")
        self._cards.discard(card.id)
        self.write(f"Approval {card.id}: {outcome}\n")

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

    def colors(self) -> str | None:
        """This terminal's colour system (rich's word for it), found once."""
        if self._colors is None:
            from rich.console import Console

            self._colors = Console(file=self.out).color_system or ""
        return self._colors or None

    def _render(self, text: str) -> str:
        lines = render_document(text, layout()[1], self.colors()) or [""]
        pad = " " * len(BOT)
        return BOT + lines[0] + "\n" + "".join(f"{pad}{line}".rstrip(" ") + "\n" for line in lines[1:])


class TerminalStream:
    """One reply shown as it grows; a ReplyStream (channels/base.py). On a terminal it is
    rendered Markdown redrawn in frames (LiveReply); elsewhere the text as it comes."""

    def __init__(self, channel: TerminalChannel, inbound: Inbound | None = None) -> None:
        self.channel = channel
        self.inbound = inbound
        self.out = channel.out
        self.printed = ""  # answer text on screen since the last status (not a terminal)
        self.status_shown = False
        self.started = False
        self.live = LiveReply(channel.write, channel.colors()) if channel.tty else None
        self._frame: asyncio.TimerHandle | None = None
        self._next_frame = 0.0

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

    def _take_back_text(self) -> None:
        """Remove the answer text shown so far: on a terminal its live part is erased (what
        scrolled above stays); elsewhere the line is ended."""
        self._cancel_frame()
        if self.live is not None:
            self.live.take_back()
        elif self.printed:
            self._write("\n")
        self.printed = ""

    # -- frames (a terminal) ------------------------------------------------------------

    def _schedule_frame(self) -> None:
        """A frame now when the last one was long enough ago (the first words show at
        once), else one when it is due."""
        if self._frame is not None:
            return
        loop = asyncio.get_running_loop()
        if loop.time() >= self._next_frame:
            self._draw()
        else:
            self._frame = loop.call_at(self._next_frame, self._draw)

    def _cancel_frame(self) -> None:
        if self._frame is not None:
            self._frame.cancel()
            self._frame = None

    def _draw(self) -> None:
        self._frame = None
        assert self.live is not None
        started = time.monotonic()
        try:
            self.live.frame()
        except Exception:  # the final text is shown all the same (finish)
            log.exception("could not draw a frame of a reply")
        # A long last block takes longer to render: frames come less often, never hog the loop.
        spent = time.monotonic() - started
        self._next_frame = asyncio.get_running_loop().time() + max(FRAME_S, 3 * spent)

    # -- ReplyStream ----------------------------------------------------------------------

    async def append(self, delta: str) -> None:
        if not self.started:
            self.started = True
            self._observe("reply")
        self._introduce()
        self._clear_status()
        if self.live is not None:
            if delta:
                self.live.source += delta
                self._schedule_frame()
            return
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
        self._cancel_frame()
        live = self.live
        if live is not None:
            if markdown and text.startswith(live.source[:live.frozen_at]):
                # The last frame, whole: what scrolled away is the start of this text.
                live.source = text
                try:
                    live.frame(final=True)
                except Exception:
                    log.exception("could not render a reply as Markdown; showing it as written")
                    live.take_back()
                    self._write(f"{BOT}{text}")
                self._write("\n\n")
            else:
                live.take_back()
                self._write((self.channel.render(text) + "\n") if markdown else f"{BOT}{text}\n\n")
        else:
            if self.printed != text:
                self._take_back_text()
                self._write(BOT + text)
            self._write("\n\n")
        self.printed = ""
        if self.inbound is None or self.inbound.origin is None:  # a task's reply answers no question
            self.channel.replies.put_nowait((text, True))


async def _spinner(out: TextIO, quiet: Callable[[], bool]) -> None:
    frames = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"
    i = 0
    while True:
        if quiet():  # a question is on the screen: the spinner would overwrite it
            await asyncio.sleep(0.1)
            continue
        out.write(f"\r{frames[i % len(frames)]} thinking…")
        out.flush()
        i += 1
        await asyncio.sleep(0.1)


