"""Schema migrations, applied in order; `PRAGMA user_version` records how far we got.

Append new steps at the end; never edit a step that has shipped.
"""

from __future__ import annotations

MIGRATIONS: list[str] = [
    # 1: sessions, messages, dedup of platform events, summaries, job runs
    """
    CREATE TABLE sessions (
        key TEXT PRIMARY KEY,
        scope TEXT NOT NULL,
        channel TEXT NOT NULL,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL,
        context_start_turn INTEGER NOT NULL DEFAULT 1
    );
    CREATE INDEX sessions_updated ON sessions(updated_at);

    CREATE TABLE messages (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        session_key TEXT NOT NULL,
        turn INTEGER NOT NULL,
        seq INTEGER NOT NULL,
        role TEXT NOT NULL,
        content TEXT NOT NULL,
        tool_calls TEXT,
        tool_call_id TEXT,
        tool_name TEXT,
        truncation TEXT,
        injected INTEGER NOT NULL DEFAULT 0,
        token_count INTEGER,
        created_at REAL NOT NULL
    );
    CREATE INDEX messages_session_turn ON messages(session_key, turn, seq);
    CREATE INDEX messages_created ON messages(created_at);

    CREATE TABLE events (
        channel TEXT NOT NULL,
        event_id TEXT NOT NULL,
        session_key TEXT,
        status TEXT NOT NULL,
        turn INTEGER,
        inbound TEXT,
        created_at REAL NOT NULL,
        answered_at REAL,
        PRIMARY KEY (channel, event_id)
    ) WITHOUT ROWID;
    CREATE INDEX events_status ON events(status);
    CREATE INDEX events_created ON events(created_at);

    CREATE TABLE summaries (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        session_key TEXT NOT NULL,
        scope TEXT NOT NULL,
        upto_turn INTEGER NOT NULL,
        reason TEXT NOT NULL,
        text TEXT NOT NULL,
        created_at REAL NOT NULL
    );
    CREATE INDEX summaries_session ON summaries(session_key, id);

    CREATE TABLE job_runs (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        job TEXT NOT NULL,
        slot TEXT NOT NULL,
        started_at REAL NOT NULL,
        ended_at REAL,
        outcome TEXT NOT NULL DEFAULT 'running',
        detail TEXT,
        UNIQUE (job, slot)
    );
    """,
]
