"""Settings changed with `/config` in chat, shared by the gateways on one database (SPEC §10).

An admin's `/config KEY VALUE` is written to this gateway's config.json (as on a lone
gateway) and recorded in the database's `config_changes`. A gateway on a shared store
(PostgreSQL) runs its own config file with the latest chat change of each key on top: at
start, at every reload of its file, and within about POLL_S of a change made through any
other gateway. Chat changes win for the keys they set; `gateway config-reset KEY` (a row
with no value) gives a key back to the files.

A lone gateway on SQLite records the changes too (who changed what, when) but never puts
them over its file: the file already holds them, and an edit of the file must keep
winning there, as it always has.

A change this gateway cannot run (a channel it has no secret for, say) is left out here,
with a log line, and kept by the others; the rest apply.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.config.changes import changed_keys, is_credential_destination, is_operator_only, is_secret_key
from gateway.config.holder import ConfigHolder
from gateway.config.load import ConfigError, json_problem, parse_config
from gateway.config.schema import Config

log = logging.getLogger("gateway.chat_settings")

POLL_S = 2.0  # how often a gateway on a shared store looks for other gateways' changes
QUERY_TIMEOUT_S = 5.0

# Each gateway's own: where it finds the shared data (relative to its own file) and where it
# listens (two gateways on one host need two ports). Set in chat, they change the config file
# of the gateway that took the command, and only that one.
INSTANCE_KEYS = frozenset({"data_dir", "http.host", "http.port", "http.probe_port"})

Check = Callable[[Config], list[str]]
Apply = Callable[[], Awaitable[None]]


def _paths(key: str, value: Any) -> Iterator[str]:
    """`key` and, for a section given whole, every key inside it."""
    yield key
    if isinstance(value, dict):
        for name, inner in value.items():
            yield from _paths(f"{key}.{name}", inner)


def unshareable(key: str, value: Any) -> str | None:
    """Why a change may not go through the database, or None. Secrets, the addresses
    secrets are sent to and MCP servers (programs and their credentials) belong to the
    environment and config.json: the shared database never carries them, nor hands them
    to a gateway that reads it."""
    for path in _paths(key, value):
        if is_secret_key(path):
            return f"{path} is a secret"
        if is_credential_destination(path):
            return f"{path} decides where credentials are sent"
        if is_operator_only(path):
            return f"{path} is the operator's (config.json only)"
    if key in INSTANCE_KEYS or (key == "http" and isinstance(value, dict)):
        return f"{key} is each gateway's own"
    return None


def set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    """Set `a.b.c` in a config dict, creating the sections on the way."""
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


@dataclass(frozen=True, slots=True)
class Setting:
    """The latest chat change of one key, as this gateway applies it."""
    id: int
    key: str
    value: Any
    reset: bool  # back to the file: nothing to put on top


@dataclass(frozen=True, slots=True)
class ConfigChange:
    """A setting changed with `/config` in chat; `value_json` None gives it back to the file."""
    id: int
    key: str
    value_json: str | None
    changed_at: float
    changed_by: str | None


class ChangeLog(Protocol):
    """Where chat changes are kept: the store (gateway/store/api.py's StoreBackend)."""

    shared: bool

    async def record_config_change(self, key: str, value_json: str | None, changed_by: str | None) -> int: ...

    async def config_changes(self) -> list[ConfigChange]: ...

    async def last_config_change(self) -> int: ...


class ChatSettings:
    def __init__(self, store: ChangeLog, holder: ConfigHolder, *, check: Check, apply: Apply) -> None:
        self.store = store
        self.holder = holder
        self.check = check  # what this gateway could not run (Gateway.startup_problems)
        self.apply = apply  # brings the running parts to holder.current (Gateway.apply_config)
        self.shared = bool(getattr(store, "shared", False))
        self.settings: dict[str, Setting] = {}  # key → latest change, in the order they apply
        self.seen = 0  # the newest change id loaded
        self.lock = asyncio.Lock()  # one change of the running config at a time
        self._file: dict[str, Any] | None = None  # the config file as last accepted
        self._refused: set[int] = set()  # changes already logged as not runnable here
        self._task: asyncio.Task[None] | None = None

    # -- the running config: the file, then the chat changes ---------------------------------

    async def join(self) -> bool:
        """At start, on a shared store: put the recorded chat changes over the config file.
        True when that changed the running config."""
        if not self.shared or self.holder.path is None:
            return False
        await self._load()
        try:
            text = await asyncio.to_thread(self.holder.path.read_text, encoding="utf-8")
            cfg = self.from_text(text)
        except (OSError, UnicodeDecodeError, ConfigError) as err:
            log.error("settings changed in chat not applied: the config file cannot be read again",
                      extra={"error": str(err)[:300]})
            return False
        if cfg == self.holder.current:
            return False
        changed = changed_keys(self.holder.current, cfg)
        self.holder.swap(cfg)
        log.info("settings changed in chat applied over the config file: %s", ", ".join(changed))
        return True

    def from_text(self, text: str) -> Config:
        """The config to run for this file text: with the chat changes on top when shared.
        ConfigError when the file itself is invalid or could not run here."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError([f"(file): {json_problem(text, err)}"]) from None
        if not self.shared:
            return parse_config(raw)
        cfg = self.build(raw)
        self._file = raw
        return cfg

    def build(self, raw: Any, extra: Setting | None = None) -> Config:
        """`raw` (a config file) with every chat change on top, `extra` last. A change that
        makes a config this gateway cannot run is left out (logged once); ConfigError when
        the file alone cannot run, or `extra` is the change left out."""
        base = parse_config(raw)
        problems = self.check(base)
        if problems:
            raise ConfigError(problems)
        changes = [s for s in self.settings.values() if not s.reset and (extra is None or s.key != extra.key)]
        if extra is not None:
            changes.append(extra)
        if not changes:
            return base
        try:
            return self._with(raw, changes)
        except ConfigError:
            pass
        # One by one, in the order they were made: each one that this gateway can run stays.
        kept: list[Setting] = []
        cfg = base
        for change in changes:
            try:
                cfg = self._with(raw, [*kept, change])
            except ConfigError as err:
                if change is extra:
                    raise
                self._refuse(change, err.problems)
                continue
            kept.append(change)
        return cfg

    def _with(self, raw: Any, changes: list[Setting]) -> Config:
        merged = copy.deepcopy(raw)
        for change in changes:
            set_dotted(merged, change.key, copy.deepcopy(change.value))
        cfg = parse_config(merged)
        problems = self.check(cfg)
        if problems:
            raise ConfigError(problems)
        return cfg

    def _refuse(self, change: Setting, problems: list[str]) -> None:
        if change.id in self._refused:
            return
        self._refused.add(change.id)
        log.warning("a setting changed in chat is not applied on this gateway (the others keep it)",
                    extra={"key": change.key, "problems": problems})

    # -- the command ------------------------------------------------------------------------

    def stage(self, raw: dict[str, Any], key: str, value: Any) -> Config:
        """The config this gateway runs once `/config KEY VALUE` is made: `raw` is its
        config file with the key set. ConfigError when it cannot run."""
        if not self.shared:
            cfg = parse_config(raw)
            problems = self.check(cfg)
            if problems:
                raise ConfigError(problems)
            return cfg
        extra = None if unshareable(key, value) else Setting(id=0, key=key, value=value, reset=False)
        return self.build(raw, extra)

    async def record(self, key: str, value: Any, *, by: str, file: dict[str, Any]) -> None:
        """Keep a change made in chat. On a shared store it must reach the database (the
        error propagates: the command then changes nothing); a lone gateway's file already
        holds it, so a failed record there is only logged."""
        if unshareable(key, value) is not None:
            # Each gateway's own keys (http.port…) stay in its file; secrets never get here
            # (the command refuses them) and the store would refuse them too.
            return
        text = json.dumps(value, ensure_ascii=False)
        try:
            change_id = await asyncio.wait_for(self.store.record_config_change(key, text, by), QUERY_TIMEOUT_S)
        except Exception as err:
            if self.shared:
                raise
            log.warning("a setting changed in chat was not recorded in the database",
                        extra={"key": key, "error": str(err)[:200]})
            return
        if self.shared:
            # The file watcher may see this gateway's own write before the next poll.
            self.settings.pop(key, None)
            self.settings[key] = Setting(id=change_id, key=key, value=value, reset=False)
            self._file = file

    # -- following the other gateways -------------------------------------------------------

    async def start(self) -> None:
        if self.shared and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._follow(), name="chat-settings")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _load(self) -> None:
        rows = await asyncio.wait_for(self.store.config_changes(), QUERY_TIMEOUT_S)
        settings: dict[str, Setting] = {}
        for row in rows:
            value = None if row.value_json is None else json.loads(row.value_json)
            refusal = unshareable(row.key, value)
            if refusal is not None:  # written by hand, or by something other than /config
                if row.id not in self._refused:
                    self._refused.add(row.id)
                    log.warning("a setting in the database is ignored", extra={"key": row.key, "why": refusal})
                continue
            settings[row.key] = Setting(id=row.id, key=row.key, value=value, reset=row.value_json is None)
        self.settings = settings
        self.seen = max((row.id for row in rows), default=0)

    async def _follow(self) -> None:
        failing = False
        while True:
            await asyncio.sleep(POLL_S)
            try:
                latest = await asyncio.wait_for(self.store.last_config_change(), QUERY_TIMEOUT_S)
                if latest != self.seen:
                    await self.catch_up()
            except asyncio.CancelledError:
                raise
            except Exception as err:
                if not failing:
                    log.warning("cannot look for settings changed on other gateways; retrying",
                                extra={"error": str(err)[:200]})
                failing = True
                continue
            if failing:
                log.info("looking for settings changed on other gateways again")
            failing = False

    async def catch_up(self) -> bool:
        """Load the chat changes and run the config they make with this gateway's file;
        True when the running config changed."""
        async with self.lock:
            await self._load()
            if self._file is None:
                return False
            try:
                cfg = self.build(self._file)
            except ConfigError as err:  # the file alone ran when it was accepted: not expected
                log.error("settings changed in chat not applied", extra={"problems": err.problems})
                return False
            if cfg == self.holder.current:
                return False
            changed = changed_keys(self.holder.current, cfg)  # names only: values may be secrets
            self.holder.swap(cfg)
        await self.apply()
        log.info("settings changed in chat on another gateway applied: %s", ", ".join(changed),
                 extra={"version": self.holder.version})
        return True
