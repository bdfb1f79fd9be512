"""Which backend a `store.url` names (SPEC §10), and opening it: PostgreSQL for a
postgresql:// URL, else the embedded SQLite file in the data dir."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gateway.store.postgres import PgStore
from gateway.store.sqlite import Store

DB_FILE = "gateway.sqlite3"


def is_postgres_url(url: str | None) -> bool:
    return bool(url) and str(url).startswith(("postgresql://", "postgres://"))


def sqlite_path(url: str) -> Path:
    """The file of a sqlite:/// URL (sqlite:////abs/path or sqlite:///relative)."""
    return Path(url.removeprefix("sqlite:///"))


async def open_store(url: str | None, data_dir: Path, **sqlite_options: Any) -> Store | PgStore:
    """The configured store (`store.url`): PostgreSQL for a postgresql:// URL, else SQLite
    (by default `<data_dir>/gateway.sqlite3`). Raises StoreError."""
    if url and is_postgres_url(url):
        return await PgStore.open(url)
    path = data_dir / DB_FILE
    if url:
        path = sqlite_path(url)
        if not path.is_absolute():
            path = data_dir / path
    return await Store.open(path, **sqlite_options)
