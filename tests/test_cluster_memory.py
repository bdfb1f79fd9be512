"""Memory files on a data dir that several gateways share (SPEC §10): writes to one
scope's files are serialized across gateways, not only within one process."""

from __future__ import annotations

import asyncio
from datetime import UTC
from pathlib import Path

from gateway.memory.files import MEMORY_FILE, Memory
from gateway.store.postgres import PgStore
from tests.pg import PgServer, create_database


async def test_two_gateways_adding_to_one_scopes_memory_lose_nothing(tmp_path: Path, pg_server: PgServer) -> None:
    url = await create_database(pg_server)
    stores = [await PgStore.open(url) for _ in range(2)]
    try:
        memories = [Memory(tmp_path, tz=UTC, store=store) for store in stores]
        writes = [memories[i % 2].append_memory_md("telegram:7", f"fact number {i}") for i in range(24)]
        await asyncio.gather(*writes)
        text = (memories[0].workspace("telegram:7") / MEMORY_FILE).read_text(encoding="utf-8")
        assert sorted(line for line in text.splitlines() if line) == sorted(f"fact number {i}" for i in range(24))
    finally:
        for store in stores:
            await store.close()


async def test_a_scope_lock_waits_for_the_other_gateway_and_not_for_other_scopes(
        pg_server: PgServer) -> None:
    url = await create_database(pg_server)
    a, b = await PgStore.open(url), await PgStore.open(url)
    try:
        order: list[str] = []
        async with a.scope_lock("telegram:7"):
            waiting = asyncio.ensure_future(_take(b, "telegram:7", order))
            async with asyncio.timeout(5):
                async with b.scope_lock("telegram:8"):  # another scope is not held up
                    order.append("other scope")
            await asyncio.sleep(0.3)
            order.append("first released")
        await asyncio.wait_for(waiting, 5)
        assert order == ["other scope", "first released", "second taken"]
    finally:
        await a.close()
        await b.close()


async def _take(store: PgStore, scope: str, order: list[str]) -> None:
    async with store.scope_lock(scope):
        order.append("second taken")
