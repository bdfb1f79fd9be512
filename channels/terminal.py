"""`python -m gateway chat`: a terminal chat on the same engine, with readline editing
and a visible "thinking…" state."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

from gateway.config import Config
from gateway.types import Inbound

try:  # line editing and history where the platform has it
    import readline  # noqa: F401
except ImportError:  # pragma: no cover
    pass

PROMPT = "you> "


class TerminalChannel:
    name = "terminal"

    def __init__(self) -> None:
        self.replies: asyncio.Queue[str] = asyncio.Queue()

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def is_ready(self) -> bool:
        return True

    async def send(self, inbound: Inbound, text: str) -> None:
        await self.replies.put(text)

    @contextlib.asynccontextmanager
    async def typing(self, inbound: Inbound) -> AsyncIterator[None]:
        task = asyncio.get_running_loop().create_task(_spinner())
        try:
            yield
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            sys.stdout.write("\r\033[K")
            sys.stdout.flush()


async def _spinner() -> None:
    frames = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"
    i = 0
    while True:
        sys.stdout.write(f"\r{frames[i % len(frames)]} thinking…")
        sys.stdout.flush()
        i += 1
        await asyncio.sleep(0.1)


async def run_terminal(cfg: Config, cfg_path: Path | None) -> int:
    from gateway.app import Gateway, StartupError

    gateway = Gateway(cfg, config_path=cfg_path, serve_http=False, enable_channels=False, watch_config=True)
    try:
        await gateway.start()
    except StartupError as err:
        print(f"cannot start: {err}", file=sys.stderr)
        return 2
    terminal = TerminalChannel()
    gateway.channels["terminal"] = terminal
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
            reply = await asyncio.wait_for(terminal.replies.get(), timeout=cfg.limits.turn_timeout_s + 30)
            print(f"bot> {reply}\n")
    except (KeyboardInterrupt, asyncio.CancelledError):
        print()
    finally:
        await gateway.stop()
    return 0
