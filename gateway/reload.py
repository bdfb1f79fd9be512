"""Hot reload of config.json (SPEC §2): watched with watchfiles, debounced, read whole,
validated; a valid file replaces the running snapshot, an invalid one is refused and
kept beside it as `config.json.rejected.<time>`."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import watchfiles

from gateway.config import ConfigError, atomic_write_text, changed_keys, parse_config_text

if TYPE_CHECKING:
    from gateway.app import Gateway

log = logging.getLogger("gateway.reload")

SETTLE_S = 0.3  # a file still changing after this is read again before it is judged


class ConfigWatcher:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        path = gateway.holder.path
        assert path is not None
        self.path: Path = path
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._last_text: str | None = None

    async def start(self) -> None:
        self._last_text = await asyncio.to_thread(self._read)
        self._task = asyncio.get_running_loop().create_task(self._watch(), name="config-watcher")

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

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
            # With other gateways, the settings changed in chat stay on top of the file.
            settings = self.gateway.chat_settings
            cfg = settings.from_text(text) if settings is not None else parse_config_text(text)
            # Valid alone is not enough: it must be a config this gateway can run (a channel
            # it would restart needs its secrets, a webhook a real secret).
            problems = self.gateway.startup_problems(cfg)
            if problems:
                raise ConfigError(problems)
        except ConfigError as err:
            rejected = self.path.with_name(f"{self.path.name}.rejected.{time.strftime('%Y%m%dT%H%M%S')}")
            await asyncio.to_thread(atomic_write_text, rejected, text)
            log.error("config change refused; the running config stays",
                      extra={"problems": err.problems, "saved_as": rejected.name})
            await self._tell_admins("Config change refused: " + "; ".join(err.problems))
            return False
        if cfg == self.gateway.cfg:
            return False
        changed = changed_keys(self.gateway.cfg, cfg)  # names only: values may be secrets
        self.gateway.holder.swap(cfg)
        await self.gateway.apply_config()
        log.info("config reloaded: %s", ", ".join(changed) or "no setting changed",
                 extra={"version": self.gateway.holder.version})
        return True

    async def _tell_admins(self, text: str) -> None:
        """Best effort: a DM to each admin whose channel is up (Telegram/Slack user ids)."""
        from gateway.types import Inbound

        for admin in self.gateway.cfg.admins:
            channel_name, _, user_id = admin.partition(":")
            channel = self.gateway.channels.get(channel_name)
            if channel is None or channel_name not in ("telegram", "slack") or not user_id:
                continue
            inbound = Inbound(channel=channel_name, chat_id=user_id, user_id=user_id, text="",
                              event_id=f"config-refused-{time.time()}")
            try:
                await asyncio.wait_for(channel.send(inbound, text), timeout=10)
            except Exception as err:
                log.warning("could not tell an admin", extra={"admin": admin, "error": str(err)[:200]})
