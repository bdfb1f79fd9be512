"""Settings changed with `/config` in chat live in the database (SPEC §10): two gateways on
one PostgreSQL, each with its own config file, one data dir. A change made through one
reaches the other within seconds, survives its restart and its file reloads; a change it
cannot run is left out there alone; secrets never go through the database; a lone
gateway on SQLite keeps its file-only behaviour."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from gateway.app import Gateway
from gateway.config.load import load_config
from gateway.ops import cli as cli_ops
from gateway.turns import commands
from tests.conftest import StoreFactory, chat, deep_merge, write_config
from tests.fakes.openai_server import FakeModel
from tests.pg import PgServer, create_database

FOLLOW_S = 8.0  # "within a few seconds": the poll is every 2 s


async def eventually(check: Callable[[], bool], timeout: float = FOLLOW_S) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "not within the time allowed"
        await asyncio.sleep(0.05)


class Cluster:
    """Gateways on one database, each with its own directory and config file."""

    def __init__(self, root: Path, fake: FakeModel, url: str) -> None:
        self.root = root
        self.fake = fake
        self.url = url
        self.running: list[Gateway] = []

    def config(self, name: str, **overrides: Any) -> Path:
        home = self.root / name
        home.mkdir(exist_ok=True)
        shared = {"store": {"url": self.url}, "data_dir": str(self.root / "shared-data")}
        return write_config(home, self.fake, **deep_merge(shared, overrides))

    async def start(self, path: Path, *, watch: bool = False) -> Gateway:
        gw = Gateway(load_config(path), config_path=path, watch_config=watch)
        await gw.start()
        self.running.append(gw)
        return gw

    async def stop(self, gw: Gateway) -> None:
        self.running.remove(gw)
        await gw.stop(timeout=5)


@pytest_asyncio.fixture
async def cluster(tmp_path: Path, fake_model: FakeModel, pg_server: PgServer) -> AsyncIterator[Cluster]:
    group = Cluster(tmp_path, fake_model, await create_database(pg_server))
    yield group
    for gw in list(group.running):
        await group.stop(gw)


def file_value(path: Path, *keys: str) -> Any:
    node: Any = json.loads(path.read_text(encoding="utf-8"))
    for key in keys:
        node = node.get(key) if isinstance(node, dict) else None
    return node


async def test_a_change_made_through_one_gateway_reaches_the_other_and_survives_its_restart(
        cluster: Cluster) -> None:
    path_a = cluster.config("a", admins=["web:boss"])
    path_b = cluster.config("b", limits={"session_queue_size": 3})
    a = await cluster.start(path_a)
    b = await cluster.start(path_b, watch=True)
    assert b.cfg.limits.session_queue_size == 3

    reply = await chat(a, "boss", "/config limits.session_queue_size 7")
    assert "saved" in reply, reply
    assert a.cfg.limits.session_queue_size == 7
    assert file_value(path_a, "limits", "session_queue_size") == 7  # written to A's file, as ever
    await eventually(lambda: b.cfg.limits.session_queue_size == 7)
    assert file_value(path_b, "limits", "session_queue_size") == 3  # B's file is B's

    # B's own file is reloaded (another key edited): the chat change stays on top of it.
    raw = json.loads(path_b.read_text())
    raw["agent_max_steps"] = 9
    path_b.write_text(json.dumps(raw), encoding="utf-8")
    assert b.watcher is not None
    assert await b.watcher.reload()
    assert (b.cfg.agent_max_steps, b.cfg.limits.session_queue_size) == (9, 7)

    # Restarted, B runs its file with the chat change on top from the start.
    await cluster.stop(b)
    b = await cluster.start(path_b)
    assert (b.cfg.agent_max_steps, b.cfg.limits.session_queue_size) == (9, 7)
    assert b.services is not None and b.services.cfg.limits.session_queue_size == 7

    # The operator gives the key back to the files: B follows its own file again.
    said = await cli_ops.config_reset(load_config(path_b), path_b.parent, "limits.session_queue_size")
    assert "back to each gateway's config file" in said
    await eventually(lambda: b.cfg.limits.session_queue_size == 3)
    assert a.cfg.limits.session_queue_size == 7  # A wrote 7 into its own file when it took the command
    with pytest.raises(cli_ops.CliError, match="no change made in chat"):
        await cli_ops.config_reset(load_config(path_b), path_b.parent, "limits.session_queue_size")


async def test_a_live_change_applies_through_the_reload_path_on_the_other_gateway(cluster: Cluster) -> None:
    a = await cluster.start(cluster.config("a", admins=["web:boss"], timezone="UTC"))
    b = await cluster.start(cluster.config("b", timezone="UTC"))
    assert b.services is not None and b.services.memory is not None
    version = b.holder.version
    assert "saved" in await chat(a, "boss", "/config timezone Asia/Tokyo")
    await eventually(lambda: b.cfg.timezone == "Asia/Tokyo")
    assert b.holder.version == version + 1
    # apply_config ran: the parts that hold the zone have it (the memory's daily files).
    await eventually(lambda: str(b.services.memory.tz) == "Asia/Tokyo")  # type: ignore[union-attr]
    listed = await cli_ops.config_reset(load_config(cluster.root / "b" / "config.json"), cluster.root / "b", None)
    assert "timezone" in listed and "web:boss" in listed


async def test_a_change_one_gateway_cannot_run_is_left_out_there_and_kept_by_the_others(
        cluster: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    # A has a Brave key, B has none: B cannot run the brave search provider.
    a = await cluster.start(cluster.config("a", admins=["web:boss"],
                                           tools={"web_search": {"api_key": "brave-key-of-a"}}))
    b = await cluster.start(cluster.config("b"))
    caplog.set_level(logging.WARNING, logger="gateway.chat_settings")
    assert "saved" in await chat(a, "boss", "/config tools.web_search.provider brave")
    assert "saved" in await chat(a, "boss", "/config agent_max_steps 4")
    await eventually(lambda: b.cfg.agent_max_steps == 4)
    assert a.cfg.tools.web_search.provider == "brave"
    assert b.cfg.tools.web_search.provider is None
    assert any(getattr(r, "key", None) == "tools.web_search.provider" and "not applied on this gateway" in r.message
               for r in caplog.records)
    # A restart of B leaves it out again and still starts.
    path_b = b.holder.path
    assert path_b is not None
    await cluster.stop(b)
    b = await cluster.start(path_b)
    assert (b.cfg.agent_max_steps, b.cfg.tools.web_search.provider) == (4, None)


async def test_secrets_and_where_they_are_sent_never_go_through_the_database(cluster: Cluster) -> None:
    a = await cluster.start(cluster.config("a", admins=["web:boss"]))
    b = await cluster.start(cluster.config("b"))
    assert a.services is not None and b.services is not None
    for command in ("/config channels.web.token sk-from-chat-0123456789",
                    "/config model.base_url http://127.0.0.1:9/v1",
                    '/config summary_model {"name": "m", "api_key": "sk-from-chat"}'):
        assert "saved" not in await chat(a, "boss", command)
    store = a.services.store
    assert await store.config_changes() == []
    # The store refuses them whoever asks …
    for key, value in (("model.api_key", "sk-x"), ("channels.telegram.webhook_url", "https://evil.example/"),
                       ("summary_model", {"name": "m", "api_key": "sk-x"}), ("mcp.servers", {})):
        with pytest.raises(ValueError, match="not stored"):
            await store.record_config_change(key, json.dumps(value), "web:boss")
    assert await store.config_changes() == []
    # … and a row written into the database by hand is not applied.
    await store.run("INSERT INTO config_changes(key, value_json, changed_at, changed_by) VALUES (?,?,?,?)",
                    ("model.base_url", json.dumps("http://127.0.0.1:9/v1"), 0.0, "someone"))
    assert "saved" in await chat(a, "boss", "/config agent_max_steps 6")
    await eventually(lambda: b.cfg.agent_max_steps == 6)
    assert b.cfg.model.base_url == a.cfg.model.base_url != "http://127.0.0.1:9/v1"


async def test_each_gateways_own_address_stays_its_own(cluster: Cluster, fake_model: FakeModel) -> None:
    path_a = cluster.config("a", admins=["web:boss"])
    a = await cluster.start(path_a)
    b = await cluster.start(cluster.config("b"))
    assert a.services is not None
    reply = await chat(a, "boss", "/config http.port 18081")
    assert "after the gateway restarts" in reply
    assert file_value(path_a, "http", "port") == 18081
    assert "saved" in await chat(a, "boss", "/config agent_max_steps 5")
    await eventually(lambda: b.cfg.agent_max_steps == 5)
    assert b.cfg.http.port == 0
    assert [c.key for c in await a.services.store.config_changes()] == ["agent_max_steps"]


async def test_a_change_the_database_does_not_take_changes_nothing(cluster: Cluster) -> None:
    path_a = cluster.config("a", admins=["web:boss"])
    a = await cluster.start(path_a)
    assert a.services is not None
    before = path_a.read_text()
    await a.services.store.run("ALTER TABLE config_changes RENAME TO config_changes_gone")  # a real failure
    reply = await chat(a, "boss", "/config agent_max_steps 3")
    assert reply.startswith("Not changed: the database did not take it"), reply
    assert path_a.read_text() == before and a.cfg.agent_max_steps != 3
    await a.services.store.run("ALTER TABLE config_changes_gone RENAME TO config_changes")
    assert "saved" in await chat(a, "boss", "/config agent_max_steps 3")


async def test_a_lone_sqlite_gateway_keeps_its_file_only_behaviour(
        tmp_path: Path, fake_model: FakeModel) -> None:
    path = write_config(tmp_path, fake_model, admins=["web:boss"])
    gw = Gateway(load_config(path), config_path=path)
    await gw.start()
    try:
        assert gw.services is not None and not getattr(gw.services.store, "shared", False)
        assert "saved" in await chat(gw, "boss", "/config agent_max_steps 4")
        assert gw.cfg.agent_max_steps == 4 and file_value(path, "agent_max_steps") == 4
        # Recorded (who changed what), never put over the file.
        [change] = await gw.services.store.config_changes()
        assert (change.key, change.value_json, change.changed_by) == ("agent_max_steps", "4", "web:boss")
        assert gw.chat_settings is not None and gw.chat_settings._task is None  # no polling alone
    finally:
        await gw.stop(timeout=5)
    # The operator edits the file while it is stopped: the file wins at the next start.
    raw = json.loads(path.read_text())
    raw["agent_max_steps"] = 9
    path.write_text(json.dumps(raw), encoding="utf-8")
    gw = Gateway(load_config(path), config_path=path)
    await gw.start()
    try:
        assert gw.cfg.agent_max_steps == 9
    finally:
        await gw.stop(timeout=5)
    with pytest.raises(cli_ops.CliError, match="SQLite"):
        await cli_ops.config_reset(load_config(path), tmp_path, "agent_max_steps")


# -- the store, on both backends -------------------------------------------------------------


async def test_the_store_keeps_the_latest_change_of_each_key(make_store: StoreFactory) -> None:
    store = await make_store()
    assert await store.last_config_change() == 0
    assert await store.config_changes() == []
    first = await store.record_config_change("agent_max_steps", "4", "web:boss")
    second = await store.record_config_change("timezone", '"UTC"', "telegram:1")
    third = await store.record_config_change("agent_max_steps", "6", "web:boss")
    assert first < second < third
    assert await store.last_config_change() == third
    latest = await store.config_changes()
    assert [(c.key, c.value_json, c.changed_by) for c in latest] == [
        ("timezone", '"UTC"', "telegram:1"), ("agent_max_steps", "6", "web:boss")]
    reset = await store.record_config_change("timezone", None, "cli")
    assert await store.last_config_change() == reset
    assert [(c.key, c.value_json) for c in await store.config_changes()] == [
        ("agent_max_steps", "6"), ("timezone", None)]
    with pytest.raises(ValueError, match="not stored"):
        await store.record_config_change("channels.slack.bot_token", '"xoxb-1"', "web:boss")
    assert await store.last_config_change() == reset


async def test_a_read_only_config_file_still_takes_a_change_through_the_database(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """The compose cluster profile mounts each gateway's config read-only."""
    path_a = cluster.config("a", admins=["web:boss"])
    a = await cluster.start(path_a)
    b = await cluster.start(cluster.config("b"))
    before = path_a.read_text(encoding="utf-8")

    def read_only(path: Path, _text: str) -> None:
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(commands, "atomic_write_text", read_only)
    reply = await chat(a, "boss", "/config limits.session_queue_size 6")
    assert "saved" in reply, reply
    assert a.cfg.limits.session_queue_size == 6
    await eventually(lambda: b.cfg.limits.session_queue_size == 6)
    assert path_a.read_text(encoding="utf-8") == before


async def test_a_lone_gateway_says_when_its_config_file_cannot_be_written(
        tmp_path: Path, fake_model: FakeModel, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_config(tmp_path, fake_model, admins=["web:boss"])
    gw = Gateway(load_config(path), config_path=path)
    await gw.start()
    try:
        def read_only(p: Path, _text: str) -> None:
            raise OSError(errno.EROFS, "Read-only file system", str(p))

        monkeypatch.setattr(commands, "atomic_write_text", read_only)
        reply = await chat(gw, "boss", "/config limits.session_queue_size 6")
        assert reply.startswith("Not changed: cannot write config.json"), reply
        assert gw.cfg.limits.session_queue_size == 5
    finally:
        await gw.stop(timeout=5)
