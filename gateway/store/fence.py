"""Fencing (SPEC §10): a turn's writes carry the token of the session lease it runs
under, so a gateway that stalled past its lease cannot write after another took over.

The token travels in a context variable: it is set by the worker that holds the lease
and read by the store where it writes a message. One process on SQLite never sets it."""

from __future__ import annotations

from contextvars import ContextVar

# (session key, fencing token) of the lease the current turn runs under.
FENCE: ContextVar[tuple[str, int] | None] = ContextVar("fence", default=None)


class FencedOut(Exception):
    """A write under a session lease this gateway no longer holds; nothing was written."""

    def __init__(self, session_key: str, token: int) -> None:
        super().__init__(f"the lease of session {session_key} (token {token}) was lost; the write was refused")
        self.session_key = session_key
        self.token = token
