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
    CREATE TRIGGER messages_touch_session AFTER INSERT ON messages BEGIN
        UPDATE sessions SET updated_at = new.created_at WHERE key = new.session_key;
    END;

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

    CREATE TABLE pairing_codes (
        code TEXT PRIMARY KEY,
        identity TEXT NOT NULL,
        created_at REAL NOT NULL,
        expires_at REAL NOT NULL,
        approved_at REAL
    );
    CREATE INDEX pairing_identity ON pairing_codes(identity);

    CREATE TABLE approved_users (
        identity TEXT PRIMARY KEY,
        approved_by TEXT NOT NULL,
        approved_at REAL NOT NULL
    );

    CREATE TABLE usage (
        identity TEXT NOT NULL,
        day TEXT NOT NULL,
        turns INTEGER NOT NULL DEFAULT 0,
        tokens INTEGER NOT NULL DEFAULT 0,
        PRIMARY KEY (identity, day)
    ) WITHOUT ROWID;
    """,
    # 2: full-text search (SPEC §4.6, §5 memory_search): the session's stored messages
    # (external content + triggers, so the index follows every insert and purge) and each
    # scope's memory files in chunks; the scopes known to have memory; consolidation
    # watermarks. Trigram tokenizer: substring matches that work for CJK text too.
    """
    CREATE VIRTUAL TABLE messages_fts USING fts5(
        content, content='messages', content_rowid='id', tokenize='trigram'
    );
    CREATE TRIGGER messages_fts_insert AFTER INSERT ON messages BEGIN
        INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content);
    END;
    CREATE TRIGGER messages_fts_delete AFTER DELETE ON messages BEGIN
        INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.id, old.content);
    END;
    CREATE TRIGGER messages_fts_update AFTER UPDATE OF content ON messages BEGIN
        INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.id, old.content);
        INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content);
    END;
    INSERT INTO messages_fts(messages_fts) VALUES ('rebuild');

    CREATE TABLE memory_scopes (
        scope TEXT PRIMARY KEY,
        dirname TEXT NOT NULL
    );

    CREATE TABLE memory_files (
        scope TEXT NOT NULL,
        path TEXT NOT NULL,
        mtime_ns INTEGER NOT NULL,
        size INTEGER NOT NULL,
        PRIMARY KEY (scope, path)
    ) WITHOUT ROWID;

    CREATE TABLE memory_chunks (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        scope TEXT NOT NULL,
        path TEXT NOT NULL,
        date TEXT NOT NULL,
        content TEXT NOT NULL
    );
    CREATE INDEX memory_chunks_file ON memory_chunks(scope, path);
    CREATE VIRTUAL TABLE memory_fts USING fts5(
        content, content='memory_chunks', content_rowid='id', tokenize='trigram'
    );
    CREATE TRIGGER memory_fts_insert AFTER INSERT ON memory_chunks BEGIN
        INSERT INTO memory_fts(rowid, content) VALUES (new.id, new.content);
    END;
    CREATE TRIGGER memory_fts_delete AFTER DELETE ON memory_chunks BEGIN
        INSERT INTO memory_fts(memory_fts, rowid, content) VALUES ('delete', old.id, old.content);
    END;

    CREATE TABLE memory_watermarks (
        scope TEXT NOT NULL,
        note TEXT NOT NULL,
        chars INTEGER NOT NULL,
        digest TEXT NOT NULL,
        size INTEGER NOT NULL,
        mtime_ns INTEGER NOT NULL,
        updated_at REAL NOT NULL,
        PRIMARY KEY (scope, note)
    ) WITHOUT ROWID;
    """,
    # 3: fewer round trips per turn. A user message stored with the platform event that
    # brought it marks that event running in the same statement (a trigger), so a crash can
    # no longer fall between the two; and one insert into `turn_ends` closes a turn: the
    # event's final status and the person's daily usage together.
    """
    ALTER TABLE messages ADD COLUMN event_channel TEXT;
    ALTER TABLE messages ADD COLUMN event_id TEXT;
    CREATE TRIGGER messages_start_turn AFTER INSERT ON messages WHEN new.event_id IS NOT NULL BEGIN
        UPDATE events SET status = 'running', answered_at = new.created_at, turn = new.turn
         WHERE channel = new.event_channel AND event_id = new.event_id;
    END;

    CREATE VIEW turn_ends(channel, event_id, status, at, identity, day, tokens) AS
        SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL WHERE 0;
    CREATE TRIGGER turn_ends_insert INSTEAD OF INSERT ON turn_ends BEGIN
        UPDATE events SET status = new.status, answered_at = new.at
         WHERE channel = new.channel AND event_id = new.event_id;
        INSERT INTO usage(identity, day, turns, tokens)
            SELECT new.identity, new.day, 1, new.tokens WHERE new.identity IS NOT NULL
            ON CONFLICT(identity, day) DO UPDATE SET turns = turns + 1, tokens = tokens + excluded.tokens;
    END;
    """,
    # 4: where a streamed reply is shown (SPEC §5.1): the channel's reference to the
    # platform message(s) of the turn's reply, so a turn resumed after a crash edits them
    # instead of posting the reply a second time.
    """
    ALTER TABLE events ADD COLUMN reply_ref TEXT;
    """,
    # 5: tasks people schedule in chat (SPEC §5.3). A task keeps the routing data of the
    # message that created it (to reply without anyone writing first) and its next run; a
    # run is claimed under its slot (the scheduled fire time), so a slot runs once, also
    # across restarts, and names the turn's event. A user message a task wrote is marked
    # with its origin: it starts a turn, but no person wrote it.
    """
    CREATE TABLE tasks (
        id TEXT PRIMARY KEY,
        scope TEXT NOT NULL,
        session_key TEXT NOT NULL,
        routing TEXT NOT NULL,
        prompt TEXT NOT NULL,
        kind TEXT NOT NULL,
        spec TEXT NOT NULL,
        zone TEXT,
        anchor REAL,
        next_run REAL,
        created_by TEXT NOT NULL,
        created_at REAL NOT NULL,
        ended_at REAL,
        end_reason TEXT,
        ended_by TEXT
    );
    CREATE INDEX tasks_active_scope ON tasks(scope) WHERE ended_at IS NULL;
    CREATE INDEX tasks_ended ON tasks(ended_at);

    CREATE TABLE task_runs (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        task_id TEXT NOT NULL,
        slot TEXT NOT NULL,
        started_at REAL NOT NULL,
        outcome TEXT NOT NULL DEFAULT 'running',
        event_channel TEXT,
        event_id TEXT,
        UNIQUE (task_id, slot)
    );
    CREATE INDEX task_runs_started ON task_runs(started_at);

    ALTER TABLE messages ADD COLUMN origin TEXT;
    """,
    # 6: the files a person sent with a message (SPEC §5.4), as JSON metadata: path,
    # kind, size, an image's dimensions and the copy the model is shown. Never the bytes.
    """
    ALTER TABLE messages ADD COLUMN attachments TEXT;
    """,
    # 7: settings changed with `/config` in chat (SPEC §10), one row per change, newest
    # last; a NULL value gives the key back to the config file. On PostgreSQL the gateways
    # sharing the database put these over their own files; SQLite keeps them as the record
    # of who changed what (the file holds the setting itself).
    """
    CREATE TABLE config_changes (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        key TEXT NOT NULL,
        value_json TEXT,
        changed_at REAL NOT NULL,
        changed_by TEXT
    );
    CREATE INDEX config_changes_key ON config_changes(key, id);
    """,
    # 8: the model a session uses (SPEC §5.5): an alias of `models` picked with /model,
    # kept across restarts; NULL is its agent's model.
    """
    ALTER TABLE sessions ADD COLUMN model TEXT;
    """,
    # 9: approvals (SPEC §5.7): a tool call waiting for a person's yes, and the decision,
    # stored with the session and turn that asked.
    """
    CREATE TABLE approvals (
        id TEXT PRIMARY KEY,
        session_key TEXT NOT NULL,
        turn INTEGER NOT NULL,
        tool TEXT NOT NULL,
        arguments TEXT NOT NULL,
        asked_by TEXT,
        asked_at REAL NOT NULL,
        expires_at REAL NOT NULL,
        decision TEXT,
        decided_by TEXT,
        decided_at REAL,
        inbound TEXT,
        ref TEXT
    );
    CREATE INDEX approvals_session ON approvals(session_key, asked_at);
    """,
    # 10: a task made during another task's run names that task, so the tasks that tasks
    # make can be counted per scope and hour (an unattended chain is rate-limited).
    """
    ALTER TABLE tasks ADD COLUMN made_by_task TEXT;
    CREATE INDEX tasks_made_by_task ON tasks(scope, created_at) WHERE made_by_task IS NOT NULL;
    """,
    # 11: the answers of in-chat commands (SPEC §6), kept for the chat's history (the web
    # page shows them after a reload). A table of their own: the context engine, restore
    # and memory search read `messages` only, so a command never reaches the model. `turn`
    # is the session's last turn when it was answered: the history places it after it.
    """
    CREATE TABLE command_answers (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        session_key TEXT NOT NULL,
        turn INTEGER NOT NULL,
        command TEXT NOT NULL,
        answer TEXT NOT NULL,
        fresh_context INTEGER NOT NULL DEFAULT 0,
        created_at REAL NOT NULL
    );
    CREATE INDEX command_answers_session ON command_answers(session_key, turn, id);
    CREATE INDEX command_answers_created ON command_answers(created_at);
    """,
]
