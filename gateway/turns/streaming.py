"""The agent's side of a streamed reply (SPEC §5.1): what of the model's text reaches a
`ReplyStream`, and when.

- `ThinkFilter` removes `<think>…</think>` reasoning as it streams (tags may be split
  across deltas; a block that never closes hides everything after it). The same filter
  cleans the stored final reply (`clean_reply`), so what was streamed and what is stored
  cannot disagree.
- `StepFeed` passes one decision step's visible text on, without the leading and
  trailing whitespace the stored reply is stripped of, and withdraws it (with a status
  line) when a retry will stream the step again.
- `TypingUntilShown` keeps a channel's typing indicator up until the stream shows
  something.
- `stopped_reply` is what a turn stopped with /stop leaves (SPEC §6): the answer text the
  stream was given, as it stood, and a short mark.
"""

from __future__ import annotations

import logging
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from channels.base import ReplyStream

log = logging.getLogger("gateway.streaming")

OPEN_TAG = "<think>"
CLOSE_TAG = "</think>"

# Shown in place of text that turned out not to be the answer.
RETRYING_STATUS = "the connection to the model dropped; retrying…"
THINKING_STATUS = "thinking…"
STOPPED_MARK = "[stopped]"
FENCE = "```"


def _held_prefix(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that could be the start of one of `tags`."""
    longest = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), longest, -1):
            if text.endswith(tag[:n]):
                longest = n
                break
    return longest


class ThinkFilter:
    """Drops reasoning from text that arrives in pieces; `feed` returns what may be shown.

    Reasoning is any `<think>…</think>` block, wherever it starts, and everything after a
    `<think>` that never closes. Some chat templates open the block in the prompt, so the
    reply only closes it: a `</think>` before any `<think>` means everything before it was
    reasoning. Text already returned cannot be taken back, so `feed` sets `retracted`
    then (the caller withdraws what it showed) and returns only what follows the tag."""

    def __init__(self) -> None:
        self._inside = False
        self._seen_open = False
        self._held = ""  # the end of the text so far that may be the start of a tag
        self.retracted = False

    def feed(self, delta: str) -> str:
        if not self._inside and not self._held and "<" not in delta:
            return delta  # nearly every delta: no tag can start in it
        text = self._held + delta
        self._held = ""
        out: list[str] = []
        while text:
            if self._inside:
                end = text.find(CLOSE_TAG)
                if end < 0:
                    keep = _held_prefix(text, (CLOSE_TAG,))
                    self._held = text[len(text) - keep:] if keep else ""
                    return "".join(out)
                self._inside = False
                text = text[end + len(CLOSE_TAG):]
                continue
            start = text.find(OPEN_TAG)
            lone = -1 if self._seen_open else text.find(CLOSE_TAG)
            if lone >= 0 and (start < 0 or lone < start):
                # Only a template-opened block closes without opening: all so far was reasoning.
                self._seen_open = True
                self.retracted = True
                out.clear()
                text = text[lone + len(CLOSE_TAG):]
                continue
            if start < 0:
                tags = (OPEN_TAG,) if self._seen_open else (OPEN_TAG, CLOSE_TAG)
                keep = _held_prefix(text, tags)
                out.append(text[:len(text) - keep])
                self._held = text[len(text) - keep:] if keep else ""
                return "".join(out)
            out.append(text[:start])
            self._inside = self._seen_open = True
            text = text[start + len(OPEN_TAG):]
        return "".join(out)

    def flush(self) -> str:
        """The end of the reply: a held piece that never became a tag is text, unless it
        sits inside a block that never closed."""
        held, self._held = self._held, ""
        return "" if self._inside else held


def clean_reply(content: str | None) -> str:
    """A whole reply as the person sees it and the store keeps it: reasoning removed,
    surrounding whitespace stripped."""
    think = ThinkFilter()
    return (think.feed(content or "") + think.flush()).strip()


def stopped_reply(shown: str) -> str:
    """The reply of a stopped turn: what was shown of the answer, then the mark. A code
    block left open mid-stream is closed first, so the mark is not shown as code."""
    text = shown.rstrip()
    if not text:
        return STOPPED_MARK
    if sum(1 for line in text.splitlines() if line.lstrip().startswith(FENCE)) % 2:
        text += "\n" + FENCE
    return f"{text}\n\n{STOPPED_MARK}"


class _Trim:
    """Leading and trailing whitespace held back from a growing text, so the pieces add up
    to `text.strip()` (which is what gets stored)."""

    def __init__(self) -> None:
        self.started = False
        self._space = ""

    def feed(self, text: str) -> str:
        if not self.started:
            text = text.lstrip()
            if not text:
                return ""
            self.started = True
        body = text.rstrip()
        if not body:
            self._space += text
            return ""
        out = self._space + body
        self._space = text[len(body):]
        return out


class StepFeed:
    """One decision step's text on its way to the stream.

    `text` is the model client's `on_text`, `retry` its `on_retry`. When the step ends in
    tool calls its text is not the answer: the agent replaces it with `status()`;
    otherwise `end()` passes on the last held piece. A stream that raises (it should not:
    platform errors stay inside it) is not fed again this turn, so the turn still ends
    with a stored reply and the stream's `finish`."""

    def __init__(self, stream: ReplyStream) -> None:
        self.stream = stream
        self.broken = False
        self._start()

    def _start(self) -> None:
        self._think = ThinkFilter()
        self._trim = _Trim()
        self.shown = False  # this step's text reached the stream
        self._pieces: list[str] = []  # that text: what a /stop keeps (`shown_text`)

    @property
    def shown_text(self) -> str:
        """The answer text the stream shows now (nothing while a status line stands)."""
        return "".join(self._pieces)

    def next_step(self) -> None:
        self._start()

    async def text(self, delta: str) -> None:
        visible = self._think.feed(delta)
        if self._think.retracted:
            self._think.retracted = False
            self._trim = _Trim()
            if self.shown:
                self.shown = False
                await self.status(THINKING_STATUS)
        await self._append(self._trim.feed(visible))

    async def retry(self) -> None:
        """The model call is sent again: what this attempt streamed will come again."""
        shown = self.shown
        self._start()
        if shown:
            await self.status(RETRYING_STATUS)

    async def end(self) -> None:
        await self._append(self._trim.feed(self._think.flush()))

    async def status(self, line: str) -> None:
        self._pieces = []  # the status replaces what was shown
        if self.broken:
            return
        try:
            await self.stream.status(line)
        except Exception:
            self._broke()

    async def _append(self, visible: str) -> None:
        if not visible or self.broken:
            return
        self.shown = True
        self._pieces.append(visible)
        try:
            await self.stream.append(visible)
        except Exception:
            self._broke()

    def _broke(self) -> None:
        self.broken = True
        log.exception("a reply stream failed; the rest of the turn is not streamed")


class TypingUntilShown:
    """A ReplyStream wrapper that holds the channel's typing indicator until the stream
    first shows something (text or a status): from then on the growing message itself
    shows that the agent is working, and the platform is not asked for both."""

    def __init__(self, stream: ReplyStream, typing: AbstractAsyncContextManager[Any]) -> None:
        self.stream = stream
        self._typing: AbstractAsyncContextManager[Any] | None = typing

    async def __aenter__(self) -> TypingUntilShown:
        if self._typing is not None:
            await self._typing.__aenter__()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self._stop_typing(exc_type, exc, tb)

    async def _stop_typing(self, exc_type: type[BaseException] | None = None, exc: BaseException | None = None,
                           tb: TracebackType | None = None) -> None:
        typing, self._typing = self._typing, None
        if typing is not None:
            await typing.__aexit__(exc_type, exc, tb)

    async def append(self, delta: str) -> None:
        await self._stop_typing()
        await self.stream.append(delta)

    async def status(self, line: str) -> None:
        await self._stop_typing()
        await self.stream.status(line)

    async def finish(self, text: str) -> None:
        await self._stop_typing()
        await self.stream.finish(text)

    async def fail(self, text: str) -> None:
        await self._stop_typing()
        await self.stream.fail(text)
