"""Hot reload of config.json (SPEC §2): watched with watchfiles, debounced, read whole,
validated; a valid file replaces the running snapshot, an invalid one is refused and
kept beside it as `config.json.rejected.<time>`."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import watchfiles

from gateway.config.changes import changed_keys
from gateway.config.holder import ConfigHolder
from gateway.config.load import ConfigError, atomic_write_text
from gateway.config.schema import Config

Parse = Callable[[str], Config]  # the file's text → the config to run (chat changes on top)
Check = Callable[[Config], list[str]]  # what this gateway could not run
Apply = Callable[[], Awaitable[None]]  # brings the running parts to holder.current
Notify = Callable[[str], Awaitable[None]]  # tells the admins, best effort

log = logging.getLogger("gateway.reload")

SETTLE_S = 0.3  # a file still changing after this is read again before it is judged


class ConfigWatcher:
    def __init__(self, holder: ConfigHolder, *, parse: Parse, check: Check, apply: Apply, notify: Notify) -> None:
        self.holder = holder
        self.parse = parse
        self.check = check
        self.apply = apply
        self.notify = notify
        path = holder.path
        assert path is not None
        self.path: Path = path
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._catch_up: asyncio.Task[None] | None = None
        self._last_text: str | None = None

    async def start(self) -> None:
        self._last_text = await asyncio.to_thread(self._read)
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._watch(), name="config-watcher")
        # The watch is put in place by that task's first step; a change written before then
        # raised no event, so the file is read once more now that it is.
        await asyncio.sleep(0)
        if await asyncio.to_thread(self._read) != self._last_text:
            self._catch_up = loop.create_task(self._reload_logged(), name="config-catch-up")

    async def stop(self) -> None:
        self._stop.set()
        for task in (self._task, self._catch_up):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._task = self._catch_up = None

    def _read(self) -> str | None:
        try:
            return self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            return None

    def _is_ours(self, _change: watchfiles.Change, path: str) -> bool:
        return Path(path).name == self.path.name

    async def _watch(self) -> None:
        async for _changes in watchfiles.awatch(self.path.parent, watch_filter=self._is_ours, debounce=200,
                                                stop_event=self._stop, recursive=False):
            await self._reload_logged()

    async def _reload_logged(self) -> None:
        try:
            await self.reload()
        except Exception:
            log.exception("config reload failed")

    async def _settled_text(self) -> str | None:
        text = await asyncio.to_thread(self._read)
        for _ in range(5):
            await asyncio.sleep(SETTLE_S)
            again = await asyncio.to_thread(self._read)
            if again == text:
                return text
            text = again
        return text

    async def reload(self) -> bool:
        """Judge the file as it is now; True when a new config was applied."""
        text = await self._settled_text()
        if text is None or text == self._last_text:
            return False
        self._last_text = text
        try:
            cfg = self.parse(text)
            # Valid alone is not enough: it must be a config this gateway can run (a channel
            # it would restart needs its secrets, a webhook a real secret).
            problems = self.check(cfg)
            if problems:
                raise ConfigError(problems)
        except ConfigError as err:
            rejected = self.path.with_name(f"{self.path.name}.rejected.{time.strftime('%Y%m%dT%H%M%S')}")
            await asyncio.to_thread(atomic_write_text, rejected, text)
            log.error("config change refused; the running config stays",
                      extra={"problems": err.problems, "saved_as": rejected.name})
            await self.notify("Config change refused: " + "; ".join(err.problems))
            return False
        if cfg == self.holder.current:
            return False
        changed = changed_keys(self.holder.current, cfg)  # names only: values may be secrets
        self.holder.swap(cfg)
        await self.apply()
        log.info("config reloaded: %s", ", ".join(changed) or "no setting changed",
                 extra={"version": self.holder.version})
        return True
