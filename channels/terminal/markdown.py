"""Replies as Markdown for a terminal (rich), one top-level block at a time.

A reply is split into its top-level blocks (paragraphs, lists, code blocks, tables …, as
markdown-it parses them) and each is rendered alone: a reply that grows re-renders only
its last block, and a block that scrolled off the window is never rendered again
(channels/terminal/live.py). The blocks are joined by one blank line, as rich would.

What differs from rich's defaults, for a terminal chat:
- single line breaks are kept (as on the web page and in Telegram: one item per line);
- links show their address, `text (https://…)`: rich's terminal hyperlinks are invisible
  where the terminal does not support them, and the address is what a person copies;
- code lines are never re-flowed: each stays one line, in the terminal's own colours
  (readable on light and dark backgrounds). At the top level a line wider than the
  window is left to the terminal, which soft-wraps it (copied, it is one line again);
  inside a list it is cut at the window's edge."""

from __future__ import annotations

import io
import re
import textwrap
from collections.abc import Iterable

from markdown_it import MarkdownIt
from markdown_it.token import Token
from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderResult
from rich.markdown import CodeBlock, Markdown
from rich.segment import Segment
from rich.syntax import Syntax

CODE_THEME = "ansi_dark"  # ANSI colours: the terminal's palette decides how they look
_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)")


def _parser() -> MarkdownIt:
    return MarkdownIt("commonmark", {"breaks": True}).enable(["strikethrough", "table"])


class UnwrappedCode(CodeBlock):
    """A code block whose lines stay as written: highlighted, never wrapped by rich."""

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        code = str(self.text).rstrip("\n")
        syntax = Syntax(code, self.lexer_name, theme=CODE_THEME, background_color="default", word_wrap=False)
        for line in syntax.highlight(code).split("\n", allow_blank=True):
            yield from line.render(console)
            yield Segment.line()


class TerminalMarkdown(Markdown):
    elements = {**Markdown.elements, "fence": UnwrappedCode, "code_block": UnwrappedCode}


def _plain_autolinks(tokens: Iterable[Token]) -> None:
    """A link whose text is its address (`<https://…>`) is shown once, as text: rich would
    print the address twice."""
    for token in tokens:
        children = token.children
        if not children:
            continue
        keep: list[Token] = []
        i = 0
        while i < len(children):
            child = children[i]
            if child.type == "link_open":
                end = next((j for j in range(i + 1, len(children)) if children[j].type == "link_close"), None)
                href = str(child.attrs.get("href", ""))
                inner = children[i + 1:end] if end is not None else []
                label = "".join(t.content for t in inner)
                if end is not None and all(t.type == "text" for t in inner) and label in (
                        href, href.removeprefix("mailto:")):
                    keep.extend(inner)
                    i = end + 1
                    continue
            keep.append(child)
            i += 1
        token.children = keep


def visible_width(line: str) -> int:
    """Terminal cells a rendered line takes (escape sequences take none)."""
    return cell_len(_ESCAPE.sub("", line))


def block_starts(source: str) -> list[int]:
    """Where each top-level block of `source` starts (character offsets, the first is 0).
    A block runs to the next one's start."""
    line_starts = [0] + [m.end() for m in re.finditer("\n", source)]
    starts = []
    for token in _parser().parse(source):
        if token.level == 0 and token.nesting >= 0 and token.map is not None and token.type != "inline":
            starts.append(line_starts[min(token.map[0], len(line_starts) - 1)])
    if not starts or starts[0] != 0:
        starts.insert(0, 0)
    return sorted(set(starts))


def render_block(source: str, width: int, colors: str | None) -> list[str]:
    """One block as terminal lines (ANSI styles, no trailing blank lines)."""
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, color_system=colors,  # type: ignore[arg-type]
                      width=width, legacy_windows=False)
    markdown = TerminalMarkdown(source, code_theme=CODE_THEME, hyperlinks=False)
    markdown.parsed = _parser().parse(source)
    _plain_autolinks(markdown.parsed)
    try:
        console.print(markdown, crop=False)
        # rich pads lines to the width with spaces: without them a narrowed window does
        # not wrap the reply into a staircase.
        lines = [line.rstrip(" ") for line in buffer.getvalue().split("\n")]
    except Exception:  # a renderer's bug never costs the reply: shown as written, wrapped
        lines = [part for line in source.split("\n") for part in (textwrap.wrap(line, width) or [""])]
    while lines and not visible_width(lines[-1]):
        lines.pop()
    while lines and not visible_width(lines[0]):  # blocks are set apart by the caller
        lines.pop(0)
    return lines


def render_document(source: str, width: int, colors: str | None) -> list[str]:
    """All of `source`, block by block, joined by one blank line."""
    lines: list[str] = []
    starts = block_starts(source)
    for start, end in zip(starts, [*starts[1:], len(source)], strict=True):
        block = render_block(source[start:end], width, colors)
        if not block:
            continue
        if lines:
            lines.append("")
        lines.extend(block)
    return lines
