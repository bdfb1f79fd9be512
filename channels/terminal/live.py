"""A reply drawn on a terminal as rendered Markdown while it grows (SPEC §5.1).

What is on screen is two parts. Above, lines written for good: the window scrolls them
away and they are never drawn again. Below, the live part, at most a screenful: erased
and drawn again at each frame (cursor up, clear to the end of the screen), so it can
change as the text grows (a list item gets its bullet, a code block closes). When the
live part would be taller than the window, its first lines are written for good; once
a whole top-level block is, it leaves the text that is rendered again (a long reply
costs a frame no more than its last screenful).

Everything is wrapped by rich at word boundaries, so no word is cut at the window's
edge; code lines are not re-flowed (channels/terminal/markdown.py)."""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable

from channels.terminal.markdown import block_starts, render_block, visible_width

BOT = "bot> "
MIN_WIDTH = 10  # rich needs some room; a narrower window wraps what it gets


def layout() -> tuple[int, int, int]:
    """(the window's columns, the text's width after "bot> ", rows the live part may take)."""
    size = shutil.get_terminal_size()
    columns = max(1, size.columns)
    return columns, max(MIN_WIDTH, columns - len(BOT)), max(3, size.lines - 2)


class LiveReply:
    def __init__(self, write: Callable[[str], None], colors: str | None) -> None:
        self.write = write
        self.colors = colors
        self.source = ""  # the reply so far
        self.frozen_at = 0  # the text before this offset is on screen for good, never rendered again
        self.committed = 0  # lines of the live part's rendering that are on screen for good
        self.frozen_lines = 0  # lines the frozen text took (the first of all gets "bot> ")
        self.tail_rows = 0  # rows the rest of it takes on screen now
        self._cache: dict[tuple[str, int], list[str]] = {}

    @property
    def shown(self) -> bool:
        return bool(self.frozen_lines or self.committed or self.tail_rows)

    def _block(self, source: str, width: int) -> list[str]:
        key = (source, width)
        lines = self._cache.get(key)
        if lines is None:
            lines = self._cache[key] = render_block(source, width, self.colors)
        return lines

    def frame(self, *, final: bool = False) -> None:
        """Draw the live part again from `source`; with `final`, write all of it for good
        (the cursor stays at the end of its last line)."""
        columns, width, budget = layout()
        live = self.source[self.frozen_at:]
        starts = block_starts(live) if live else []
        ends = [*starts[1:], len(live)]
        blocks = [self._block(live[a:b], width) for a, b in zip(starts, ends, strict=True)]
        # Only this frame's blocks stay cached: the next frame differs in its last one at most.
        self._cache = {(live[a:b], width): block for a, b, block in zip(starts, ends, blocks, strict=True)}
        lines: list[str] = []
        block_ends: list[int] = []  # for each block, the index after its lines and the blank after them
        for i, block in enumerate(blocks):
            lines.extend(block)
            if i < len(blocks) - 1 and block:
                lines.append("")
            block_ends.append(len(lines))

        def shown(i: int) -> str:
            return (BOT if self.frozen_lines == 0 and i == 0 else " " * len(BOT)) + lines[i]

        def rows(i: int) -> int:
            return max(1, math.ceil(visible_width(shown(i)) / columns))

        done = len(lines)
        if not final:
            # Lines above the last screenful go for good; the last line never does (the
            # cursor stays on it, and it may still change).
            done = self.committed
            left = sum(rows(i) for i in range(done, len(lines)))
            while left > budget and done < len(lines) - 1:
                left -= rows(done)
                done += 1
        done = max(done, self.committed)
        out = [self._erase()]
        drawn = [shown(i) for i in range(self.committed, len(lines))]
        out.append("\n".join(drawn))
        self.tail_rows = 0 if final else sum(rows(i) for i in range(done, len(lines)))
        self.committed = done
        self.write("".join(out))
        # Blocks whose lines are all written for good are never rendered again.
        while len(starts) >= 2 and block_ends[0] <= self.committed:
            self.frozen_at += starts[1]
            self.frozen_lines += block_ends[0]
            self.committed -= block_ends[0]
            block_ends = [end - block_ends[0] for end in block_ends[1:]]
            starts = [start - starts[1] for start in starts[1:]]

    def _erase(self) -> str:
        """Back to the first row of the live part, cleared to the end of the screen."""
        if not self.tail_rows:
            return ""
        up = f"\033[{self.tail_rows - 1}A" if self.tail_rows > 1 else ""
        return "\r" + up + "\033[J"

    def take_back(self) -> None:
        """Erase the live part (what was written for good stays) and start over."""
        self.write(self._erase())
        self.source = ""
        self.frozen_at = self.frozen_lines = self.committed = self.tail_rows = 0
        self._cache.clear()
