"""Counts a gateway's PostgreSQL round trips (bench/cluster.py puts this directory first on
the gateway's PYTHONPATH and names a file in PG_ROUND_TRIPS_FILE; Python imports a
`sitecustomize` module at start-up).

Every statement asyncpg sends is one round trip (fetch, fetchrow, fetchval, execute,
executemany: the protocol's bind and execute go in one exchange), a statement not yet in
the connection's cache costs one more (asyncpg prepares it first), and so does a pool's
reset of a connection it takes back (its reset query). The counts are written to the file
every half second as JSON: {"statements": n, "prepares": n, "resets": n, "by_statement":
{first words: n}}.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter

TARGET = os.environ.get("PG_ROUND_TRIPS_FILE")

if TARGET:
    import asyncpg.connection

    counts: Counter[str] = Counter()
    statements: Counter[str] = Counter()
    Connection = asyncpg.connection.Connection

    def _counting(name: str) -> None:
        original = getattr(Connection, name)

        async def counted(self: object, query: str, *args: object, **kwargs: object) -> object:
            counts["statements"] += 1
            statements[" ".join(str(query).split()[:4])[:60]] += 1
            return await original(self, query, *args, **kwargs)

        setattr(Connection, name, counted)

    for method in ("fetch", "fetchrow", "fetchval", "execute", "executemany"):
        _counting(method)

    original_get = Connection._get_statement

    async def get_statement(self: object, query: str, timeout: object, **kwargs: object) -> object:
        record_class = kwargs.get("record_class") or self._protocol.get_record_class()  # type: ignore[attr-defined]
        key = (query, record_class, kwargs.get("ignore_custom_codec", False))
        if kwargs.get("use_cache", True) and self._stmt_cache.get(key) is None:  # type: ignore[attr-defined]
            counts["prepares"] += 1
        return await original_get(self, query, timeout, **kwargs)

    Connection._get_statement = get_statement  # type: ignore[method-assign]

    original_reset = Connection.reset

    async def reset(self: object, *args: object, **kwargs: object) -> None:
        if self.get_reset_query():  # type: ignore[attr-defined]
            counts["resets"] += 1
        await original_reset(self, *args, **kwargs)

    Connection.reset = reset  # type: ignore[method-assign]

    def _write_forever() -> None:
        while True:
            time.sleep(0.5)
            data = {**counts, "by_statement": dict(statements.most_common(40))}
            tmp = f"{TARGET}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(data, f)
            os.replace(tmp, TARGET)

    threading.Thread(target=_write_forever, name="pg-round-trips", daemon=True).start()
