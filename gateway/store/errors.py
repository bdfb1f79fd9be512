"""What a store's failure means, whichever database raised it (SPEC §10).

Both backends turn their driver's exceptions (sqlite3/aiosqlite, asyncpg, a socket's
OSError, a pool's timeout) into one family at their boundary, so code outside
gateway/store/ catches `StoreError` and never imports a driver to handle a failure:

- `StoreFull`: no room for the write (SQLITE_FULL; PostgreSQL's disk_full, 53100);
- `StoreUnavailable`: the database cannot be used now: a lost or refused connection, a
  server shutting down, a lock held past the wait, an I/O error, a read-only file or
  standby, a statement cut by its timeout, a transient lack of resources (out of memory,
  too many connections);
- `StoreConflict`: the write breaks a constraint (a duplicate key, a missing NOT NULL);
- `StoreError` itself: anything else the database refused (a corrupt file, a bug in a
  statement).

The driver's exception stays reachable as `__cause__`.
"""

from __future__ import annotations

import asyncio
import sqlite3

import asyncpg


class StoreError(Exception):
    """The database cannot be opened, read or written (read-only dir, disk full, corrupt)."""


class StoreFull(StoreError):
    """The write needs room the disk (or the database's quota) does not have."""


class StoreUnavailable(StoreError):
    """The database cannot be reached or used now; the same statement may work later."""


class StoreConflict(StoreError):
    """The write contradicts a constraint of the schema; retrying it changes nothing."""


# SQLite's primary result codes (https://sqlite.org/rescode.html), the low byte of an
# extended code.
_SQLITE_BUSY, _SQLITE_LOCKED, _SQLITE_READONLY, _SQLITE_IOERR = 5, 6, 8, 10
_SQLITE_FULL, _SQLITE_CANTOPEN, _SQLITE_CONSTRAINT = 13, 14, 19
_SQLITE_UNAVAILABLE = frozenset({_SQLITE_BUSY, _SQLITE_LOCKED, _SQLITE_READONLY, _SQLITE_IOERR, _SQLITE_CANTOPEN})


def from_sqlite(err: sqlite3.Error) -> StoreError:
    """The family member that says what `err` (raised by sqlite3 or aiosqlite) means."""
    code = getattr(err, "sqlite_errorcode", None)
    primary = code & 0xFF if isinstance(code, int) else None
    text = str(err) or type(err).__name__
    if primary == _SQLITE_FULL:
        return StoreFull(text)
    if primary == _SQLITE_CONSTRAINT or isinstance(err, sqlite3.IntegrityError):
        return StoreConflict(text)
    if primary in _SQLITE_UNAVAILABLE:
        return StoreUnavailable(text)
    if isinstance(err, sqlite3.ProgrammingError) and "closed" in text.lower():
        return StoreUnavailable(text)  # the connection went (a shutdown): not the statement's fault
    return StoreError(text)


# PostgreSQL's SQLSTATE classes (https://www.postgresql.org/docs/current/errcodes-appendix.html).
_PG_DISK_FULL = "53100"
# 08 connection, 53 insufficient resources (but disk_full), 57 operator intervention
# (shutdown, statement timeout), 58 system error (I/O), 40 serialization failure and
# deadlock (retried, the transaction is gone), 25006 read-only transaction (a standby).
_PG_UNAVAILABLE_CLASSES = frozenset({"08", "53", "57", "58", "40"})
_PG_READ_ONLY = "25006"
_PG_CONSTRAINT_CLASS = "23"


def from_postgres(err: BaseException) -> StoreError:
    """The family member for an asyncpg error, a socket's OSError or a pool's timeout."""
    text = str(err) or type(err).__name__
    if isinstance(err, (OSError, asyncpg.InterfaceError, asyncio.TimeoutError)):
        return StoreUnavailable(text)  # refused, reset, closed mid-statement, no connection in time
    code = str(getattr(err, "sqlstate", None) or "")
    if code == _PG_DISK_FULL:
        return StoreFull(text)
    if code[:2] == _PG_CONSTRAINT_CLASS:
        return StoreConflict(text)
    if code[:2] in _PG_UNAVAILABLE_CLASSES or code == _PG_READ_ONLY:
        return StoreUnavailable(text)
    return StoreError(text)


# What each backend wraps at its boundary.
POSTGRES_ERRORS: tuple[type[BaseException], ...] = (
    TimeoutError, OSError, asyncpg.PostgresError, asyncpg.InterfaceError)
SQLITE_ERRORS: tuple[type[BaseException], ...] = (sqlite3.Error,)
