"""Long-term memory per scope (SPEC §4.6): the workspace files and full-text search.

Each scope owns `<data_dir>/scopes/<scope_dirname>/`: MEMORY.md (curated, shown in the
system prompt), memory/YYYY-MM-DD.md (daily notes), dialog/YYYY-MM-DD.jsonl (archived raw
turns), tool_results/ (full tool outputs) and files/ (files people sent). The workspace
is the sandbox's too (exec binds it read-write, and several sandboxes of one scope may run
while these files are written), so every file is reached through gateway.beneath: opened
relative to the workspace's descriptor, never following a symlink, refusing `..`. A link
planted or swapped in at any moment is refused (PathNotAllowed), never followed out.

Writes to one scope are serialized by an asyncio.Lock; Markdown files are rewritten
atomically (temp + fsync + rename), the dialog archive is appended with O_APPEND + fsync.
File I/O runs in threads; SQL goes through the store (either backend).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import stat
import time
import weakref
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager, nullcontext
from dataclasses import dataclass
from datetime import datetime, tzinfo
from pathlib import Path
from typing import Any

from gateway.beneath import Dir, PathNotAllowed, normalized
from gateway.keys import scope_dirname, workspace_dir
from gateway.store.api import StoreBackend
from gateway.workspace import make_private_dir

log = logging.getLogger("gateway.memory")

MEMORY_FILE = "MEMORY.md"
NOTES_DIR = "memory"
DIALOG_DIR = "dialog"
SUBDIRS = (NOTES_DIR, DIALOG_DIR, "tool_results", "files")
_NOTE_NAME = re.compile(r"^\d{4}-\d{2}-\d{2}\.md$")

# Search: the trigram tokenizer needs 3 characters; shorter terms use LIKE.
_TERM = re.compile(r"\w+")
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]")
MAX_PHRASES = 32
MAX_SHORT_TERMS = 5
CHUNK_CHARS = 800  # memory files are indexed in chunks of about this size
SNIPPET_BEFORE = 80
SNIPPET_AFTER = 200
PROMPT_CACHE_SCOPES = 1024  # MEMORY.md texts kept for the system prompt (LRU)
INDEXED_STAMPS_MAX = 10_000
RECHECK_S = 10.0  # how stale the cached MEMORY.md may be before its mtime is checked again (a hand edit)


@dataclass(frozen=True, slots=True)
class SearchHit:
    date: str  # YYYY-MM-DD
    source: str  # "MEMORY.md" | "memory/2026-11-28.md" | "dialog turn 12"
    snippet: str


@dataclass(frozen=True, slots=True)
class NoteFile:
    """A daily note on disk, for consolidation."""

    path: str  # workspace-relative, memory/YYYY-MM-DD.md
    size: int
    mtime_ns: int


@dataclass(frozen=True, slots=True)
class SearchQuery:
    """Model-supplied query text turned into safe FTS5 syntax (never passed through raw)."""

    match: str | None  # FTS5 expression of quoted phrases, OR-ed
    phrases: tuple[str, ...]  # those phrases as text (PostgreSQL matches them itself)
    short_terms: tuple[str, ...]  # used with LIKE when no term is long enough for trigrams
    terms: tuple[str, ...]  # everything, to place snippets

    @property
    def empty(self) -> bool:
        return self.match is None and not self.short_terms


def _quote(term: str) -> str:
    return '"' + term.replace('"', '""') + '"'


def parse_query(text: str) -> SearchQuery:
    phrases: list[str] = []
    short: list[str] = []
    for term in _TERM.findall(text or ""):
        if len(term) < 3:
            short.append(term)
        elif _CJK.search(term) and len(term) > 3:
            # CJK has no spaces: a run is matched by its overlapping 3-character windows,
            # and bm25 ranks notes sharing more of them first.
            phrases.extend(term[i : i + 3] for i in range(len(term) - 2))
        else:
            phrases.append(term)
    unique = list(dict.fromkeys(p.lower() for p in phrases))[:MAX_PHRASES]
    shorts = tuple(dict.fromkeys(short))[:MAX_SHORT_TERMS]
    match = " OR ".join(_quote(p) for p in unique) if unique else None
    return SearchQuery(match=match, phrases=tuple(unique), short_terms=() if match else shorts,
                       terms=(*unique, *shorts))


def make_snippet(content: str, terms: Sequence[str]) -> str:
    """A window of `content` around the first matching term, whitespace collapsed."""
    start = 0
    if terms:
        found = re.search("|".join(re.escape(t) for t in terms), content, re.IGNORECASE)
        if found:
            start = found.start()
    lo = max(0, start - SNIPPET_BEFORE)
    hi = min(len(content), start + SNIPPET_AFTER)
    text = " ".join(content[lo:hi].split())
    return ("…" if lo > 0 else "") + text + ("…" if hi < len(content) else "")


def chunk_text(text: str, size: int = CHUNK_CHARS) -> list[str]:
    """Split a Markdown file into chunks: a heading starts a new chunk, paragraphs are
    gathered until `size` characters."""
    chunks: list[str] = []
    current: list[str] = []
    length = 0
    for para in re.split(r"\n\s*\n", text):
        para = para.strip()
        if not para:
            continue
        if current and (para.startswith("#") or length + len(para) > size):
            chunks.append("\n\n".join(current))
            current, length = [], 0
        current.append(para)
        length += len(para)
    if current:
        chunks.append("\n\n".join(current))
    return chunks


# -- blocking helpers (run in threads) ---------------------------------------------------


def _stat(root: Path, relative: str) -> os.stat_result | None:
    """The regular file's stat, None when there is none (PathNotAllowed for a link)."""
    try:
        with Dir.open(root) as ws:
            st = ws.stat(relative)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return st if stat.S_ISREG(st.st_mode) else None


def _read_in(ws: Dir, relative: str) -> str:
    try:
        return ws.read_bytes(relative).decode("utf-8", errors="replace")
    except (FileNotFoundError, NotADirectoryError):
        return ""


def _read(root: Path, relative: str) -> str:
    """A text file of the workspace, "" when absent."""
    with Dir.open(root) as ws:
        return _read_in(ws, relative)


def _rewrite(root: Path, relative: str, make: Callable[[str], str]) -> tuple[str, os.stat_result]:
    with Dir.open(root) as ws:
        new = make(_read_in(ws, relative))
        return new, ws.replace(relative, new.encode("utf-8"))


def _write(root: Path, relative: str, text: str) -> os.stat_result:
    with Dir.open(root) as ws:
        return ws.replace(relative, text.encode("utf-8"))


def _append_lines(root: Path, relative: str, data: str) -> None:
    with Dir.open(root) as ws, ws.open_file(relative, "a+b", mode=0o644, parents=True) as fh:
        fd = fh.fileno()
        size = os.fstat(fd).st_size
        # A crash mid-append can leave a torn last line: start ours on a fresh line.
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = "\n" + data
        payload = data.encode("utf-8")
        while payload:
            written = os.write(fd, payload)
            payload = payload[written:]
        os.fsync(fd)


def _append_note(root: Path, relative: str, header: str,
                 block: str) -> tuple[tuple[int, int] | None, os.stat_result]:
    """Append `block` to a daily note, starting a new one with `header`. Returns the note's
    (mtime_ns, size) before (None when it was empty) and its stat after."""
    with Dir.open(root) as ws, ws.open_file(relative, "a+b", mode=0o644, parents=True) as fh:
        fd = fh.fileno()
        st = os.fstat(fd)
        if st.st_size == 0:
            before, data = None, header + block
        else:
            before = (st.st_mtime_ns, st.st_size)
            tail = os.pread(fd, 2, max(0, st.st_size - 2))
            # One blank line between blocks, also after a torn or hand-edited end.
            data = ("" if tail.endswith(b"\n\n") else "\n" if tail.endswith(b"\n") else "\n\n") + block
        payload = data.encode("utf-8")
        while payload:
            payload = payload[os.write(fd, payload):]
        os.fsync(fd)
        return before, os.fstat(fd)


def _scan_memory_files(root: Path) -> dict[str, tuple[int, int]]:
    """MEMORY.md and memory/*.md that really live in the workspace (regular files, no
    links): rel -> (mtime_ns, size)."""
    out: dict[str, tuple[int, int]] = {}
    with Dir.open(root) as ws:
        try:
            st = ws.stat(MEMORY_FILE)
            if stat.S_ISREG(st.st_mode):
                out[MEMORY_FILE] = (st.st_mtime_ns, st.st_size)
        except (FileNotFoundError, NotADirectoryError):
            pass
        except PathNotAllowed:
            log.warning("memory file leaves the workspace; ignored", extra={"path": str(root / MEMORY_FILE)})
        try:
            notes = ws.scandir(NOTES_DIR)
        except (FileNotFoundError, NotADirectoryError):
            notes = []
        except PathNotAllowed:
            log.warning("memory file leaves the workspace; ignored", extra={"path": str(root / NOTES_DIR)})
            notes = []
    for entry in sorted(notes, key=lambda e: e.name):
        if not entry.name.endswith(".md"):
            continue
        if stat.S_ISLNK(entry.stat.st_mode):
            log.warning("memory file leaves the workspace; ignored",
                        extra={"path": str(root / NOTES_DIR / entry.name)})
        elif entry.is_file:
            out[f"{NOTES_DIR}/{entry.name}"] = (entry.stat.st_mtime_ns, entry.stat.st_size)
    return out


def _backup(root: Path, name_stem: str, text: str, keep: int) -> None:
    """Keep `text` as memory/backup/<name_stem>.md (or -2, -3, …), and only the newest
    `keep` backups."""
    with Dir.open(root) as ws, ws.subdir(f"{NOTES_DIR}/backup", create=True, mode=0o777) as backups:
        name, n = f"{name_stem}.md", 1
        while backups.exists(name):
            n += 1
            name = f"{name_stem}-{n}.md"
        backups.replace(name, text.encode("utf-8"))
        olds = sorted((e for e in backups.scandir() if e.is_file and e.name.startswith("MEMORY-")
                       and e.name.endswith(".md")), key=lambda e: e.stat.st_mtime_ns)
        for old in olds[: max(0, len(olds) - keep)]:
            try:
                backups.unlink(old.name)
            except FileNotFoundError:
                pass


def _cut_to_budget(text: str, max_tokens: int, count: Callable[[str], int]) -> str:
    """Keep the beginning of `text` within `max_tokens`, cut on a line boundary, with a
    notice naming the file and the read_file call that continues it."""
    if count(text) <= max_tokens:
        return text
    lines = text.splitlines(keepends=True)

    def notice(kept: int) -> str:
        return (
            f"\n[{MEMORY_FILE} is longer than its {max_tokens}-token budget: lines 1-{kept} of "
            f"{len(lines)} shown. Read the rest with read_file(path=\"{MEMORY_FILE}\", "
            f"start_line={kept + 1}).]\n"
        )

    lo, hi = 0, len(lines)  # largest kept line count whose text + notice fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count("".join(lines[:mid]) + notice(mid)) <= max_tokens:
            lo = mid
        else:
            hi = mid - 1
    return "".join(lines[:lo]) + notice(lo)


# -- the service -------------------------------------------------------------------------


class Memory:
    """Per-scope workspaces, their memory files and their full-text index."""

    def __init__(
        self, data_dir: Path, *, tz: tzinfo, store: StoreBackend, clock: Callable[[], datetime] | None = None
    ) -> None:
        self._data_dir = data_dir
        self._tz = tz
        self._store = store
        self._clock = clock or (lambda: datetime.now(tz))
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        self._ready: set[str] = set()
        self._registered: set[str] = set()
        # scope -> ((mtime_ns, size, max_tokens), text): the system prompt stays byte-identical
        self._prompt_cache: OrderedDict[str, tuple[tuple[int, int, int], str]] = OrderedDict()
        self._prompt_checked: dict[str, float] = {}  # scope -> monotonic time of the last stat
        # (scope, path) -> the (mtime_ns, size) the search index holds for it, as written by us
        self._indexed: dict[tuple[str, str], tuple[int, int]] = {}

    @property
    def data_dir(self) -> Path:
        return self._data_dir

    @property
    def tz(self) -> tzinfo:
        return self._tz

    def set_timezone(self, tz: tzinfo) -> None:
        """A reload changed `timezone`: daily files are dated in the new zone from now on."""
        self._tz = tz

    def now(self) -> datetime:
        return self._clock().astimezone(self._tz)

    def today(self) -> str:
        return self.now().strftime("%Y-%m-%d")

    @asynccontextmanager
    async def lock(self, scope: str) -> AsyncIterator[None]:
        """Serializes writes to one scope's memory: in this process, and across gateways
        sharing the data dir when the store offers a lock of its own (PostgreSQL)."""
        lock = self._locks.get(scope)
        if lock is None:
            lock = asyncio.Lock()
            self._locks[scope] = lock
        shared = getattr(self._store, "scope_lock", None)
        async with lock, (shared(scope) if shared is not None else nullcontext()):
            yield

    def workspace(self, scope: str) -> Path:
        root = workspace_dir(self._data_dir, scope)
        if scope not in self._ready:
            try:
                make_private_dir(root)  # 0700, like the data dir (SPEC §9)
            except OSError as err:
                log.warning("cannot create workspace dir", extra={"scope": scope, "error": str(err)})
            for sub in SUBDIRS:
                try:
                    (root / sub).mkdir(parents=True, exist_ok=True)
                except OSError as err:  # e.g. a planted dangling symlink; writes are refused later
                    log.warning("cannot create workspace dir", extra={"scope": scope, "error": str(err)})
            self._ready.add(scope)
        return root

    @staticmethod
    def _checked(relative: str) -> str:
        """`relative` checked and written the one way; PathNotAllowed when it would leave
        (an absolute path, `..`). Links are refused when it is opened."""
        return normalized(relative)

    async def _register(self, scope: str) -> None:
        """Remember that this scope has memory (consolidation walks the registered scopes)."""
        if scope in self._registered:
            return
        await self._store.run(
            "INSERT INTO memory_scopes(scope, dirname) VALUES (?, ?) ON CONFLICT(scope) DO NOTHING",
            (scope, scope_dirname(scope)),
        )
        self._registered.add(scope)

    async def scopes(self) -> list[str]:
        return [row[0] for row in await self._store.run("SELECT scope FROM memory_scopes ORDER BY scope")]

    # -- MEMORY.md for the system prompt -------------------------------------------------

    async def read_memory_md(self, scope: str, *, max_tokens: int, count: Callable[[str], int]) -> str:
        cached = self._prompt_cache.get(scope)
        now = time.monotonic()
        if cached is not None and cached[0][2] == max_tokens and now - self._prompt_checked.get(scope, 0) < RECHECK_S:
            # Our own writes drop the cache; a person's edit is seen within RECHECK_S.
            return cached[1]
        self._prompt_checked[scope] = now
        root = self.workspace(scope)
        try:  # one thread hop: this runs for every session every RECHECK_S
            st = await asyncio.to_thread(_stat, root, MEMORY_FILE)
        except PathNotAllowed:
            log.warning("MEMORY.md leaves the workspace; not loaded", extra={"scope": scope})
            return ""
        if st is None:
            self._prompt_cache[scope] = ((0, 0, max_tokens), "")  # no file yet: remembered too
            return ""
        key = (st.st_mtime_ns, st.st_size, max_tokens)
        cached = self._prompt_cache.get(scope)
        if cached is not None and cached[0] == key:
            self._prompt_cache.move_to_end(scope)
            return cached[1]
        try:
            text = await asyncio.to_thread(lambda: _cut_to_budget(_read(root, MEMORY_FILE), max_tokens, count))
        except PathNotAllowed:  # swapped for a link since the stat
            log.warning("MEMORY.md leaves the workspace; not loaded", extra={"scope": scope})
            return ""
        self._prompt_cache[scope] = (key, text)
        self._prompt_cache.move_to_end(scope)
        while len(self._prompt_cache) > PROMPT_CACHE_SCOPES:
            evicted, _ = self._prompt_cache.popitem(last=False)
            self._prompt_checked.pop(evicted, None)
        return text

    # -- writes ----------------------------------------------------------------------------

    async def _rewrite_md(self, scope: str, relative: str, make: Callable[[str], str]) -> Path:
        rel = self._checked(relative)
        await self._register(scope)
        async with self.lock(scope):
            root = self.workspace(scope)
            text, st = await asyncio.to_thread(_rewrite, root, rel, make)
            self._prompt_checked.pop(scope, None)
            await self._index_file(scope, relative, text, st.st_mtime_ns, st.st_size)
        return root / rel

    async def append_daily(self, scope: str, text: str, *, heading: str | None = None) -> Path:
        """Append a block to today's note. Appended, not rewritten, and only the new block
        is indexed: a busy scope's note grows all day, and redoing the whole file on every
        summary made each one slower than the last."""
        day = self.today()
        relative = f"{NOTES_DIR}/{day}.md"
        block = (f"## {heading.strip()}\n\n" if heading and heading.strip() else "") + text.strip() + "\n"
        await self._register(scope)
        async with self.lock(scope):
            root = self.workspace(scope)
            before, st = await asyncio.to_thread(_append_note, root, relative, f"# {day}\n\n", block)
            stamp = (st.st_mtime_ns, st.st_size)
            if before is not None and self._indexed.get((scope, relative)) == before:
                await self._index_more(scope, relative, block, stamp)
            else:  # new file, edited by hand, or not indexed by this process yet
                whole = await asyncio.to_thread(_read, root, relative)
                await self._index_file(scope, relative, whole, *stamp)
        return root / relative

    async def append_memory_md(self, scope: str, text: str) -> None:
        def make(old: str) -> str:
            if not old.strip():
                return text.strip() + "\n"
            return old.rstrip("\n") + "\n\n" + text.strip() + "\n"

        await self._rewrite_md(scope, MEMORY_FILE, make)

    async def archive_dialog(self, scope: str, rows: Sequence[dict[str, Any]]) -> Path:
        data = "".join(json.dumps(row, ensure_ascii=False, default=str) + "\n" for row in rows)
        await self._register(scope)
        async with self.lock(scope):
            root, relative = self.workspace(scope), f"{DIALOG_DIR}/{self.today()}.jsonl"
            if data:
                await asyncio.to_thread(_append_lines, root, relative, data)
        return root / relative

    async def save_text(self, scope: str, relative: str, text: str) -> Path:
        """Write a workspace file atomically (e.g. tool_results/<id>.txt); refuses paths
        that leave the workspace."""
        if relative == MEMORY_FILE or _is_note(relative):
            return await self._rewrite_md(scope, relative, lambda _old: text)
        rel = self._checked(relative)
        await self._register(scope)
        async with self.lock(scope):
            root = self.workspace(scope)
            await asyncio.to_thread(_write, root, rel, text)
        return root / rel

    # -- consolidation primitives ----------------------------------------------------------

    async def daily_notes(self, scope: str) -> list[NoteFile]:
        files = await asyncio.to_thread(_scan_memory_files, self.workspace(scope))
        return [
            NoteFile(path=rel, mtime_ns=mtime, size=size)
            for rel, (mtime, size) in sorted(files.items())
            if _is_note(rel)
        ]

    async def read_text(self, scope: str, relative: str) -> str:
        """A workspace text file ("" when absent); refuses paths that leave the workspace."""
        rel = self._checked(relative)
        return await asyncio.to_thread(_read, self.workspace(scope), rel)

    async def replace_memory_md(
        self, scope: str, *, expected: str, new_text: str, keep_backups: int = 30
    ) -> bool:
        """Replace MEMORY.md with `new_text` if it still holds `expected` (text appended to
        it meanwhile is carried over); the previous version is kept in memory/backup/.
        False when MEMORY.md was rewritten meanwhile: nothing changes."""
        async with self.lock(scope):
            root = self.workspace(scope)
            current = await asyncio.to_thread(_read, root, MEMORY_FILE)
            if not current.startswith(expected):
                return False
            appended = current[len(expected):].strip()
            final = new_text.rstrip("\n") + "\n" + (f"\n{appended}\n" if appended else "")
            if current:
                await self._backup(scope, current, keep_backups)
            st = await asyncio.to_thread(_write, root, MEMORY_FILE, final)
            self._prompt_checked.pop(scope, None)
            await self._index_file(scope, MEMORY_FILE, final, st.st_mtime_ns, st.st_size)
        await self._register(scope)
        return True

    async def _backup(self, scope: str, text: str, keep: int) -> None:
        stamp = self.now().strftime("%Y%m%dT%H%M%S")
        await asyncio.to_thread(_backup, self.workspace(scope), f"MEMORY-{stamp}", text, keep)

    # -- full-text index -----------------------------------------------------------------

    def _file_date(self, relative: str, mtime_ns: int) -> str:
        if _is_note(relative):
            return Path(relative).stem
        return datetime.fromtimestamp(mtime_ns / 1e9, self._tz).strftime("%Y-%m-%d")

    async def _index_file(self, scope: str, relative: str, text: str, mtime_ns: int, size: int) -> None:
        # memory_files is written last: if we stop half-way, the next search re-indexes.
        self._indexed.pop((scope, relative), None)
        await self._store.run("DELETE FROM memory_chunks WHERE scope=? AND path=?", (scope, relative))
        await self._index_more(scope, relative, text, (mtime_ns, size))

    async def _index_more(self, scope: str, relative: str, text: str, stamp: tuple[int, int]) -> None:
        """Index `text` as more chunks of the file, then record the file's new stamp."""
        date = self._file_date(relative, stamp[0])
        rows = [(scope, relative, date, chunk) for chunk in chunk_text(text)]
        store = self._store
        await store.run_many("INSERT INTO memory_chunks(scope, path, date, content) VALUES (?,?,?,?)", rows)
        await store.run(
            "INSERT INTO memory_files(scope, path, mtime_ns, size) VALUES (?,?,?,?) "
            "ON CONFLICT(scope, path) DO UPDATE SET mtime_ns=excluded.mtime_ns, size=excluded.size",
            (scope, relative, *stamp),
        )
        if len(self._indexed) >= INDEXED_STAMPS_MAX:  # a cache: a miss costs one full re-index
            self._indexed.clear()
        self._indexed[(scope, relative)] = stamp

    async def _refresh_index(self, scope: str) -> None:
        """Re-index the scope's memory files that changed on disk (e.g. edited by a person)."""
        root = self.workspace(scope)
        async with self.lock(scope):
            on_disk = await asyncio.to_thread(_scan_memory_files, root)
            sql = "SELECT path, mtime_ns, size FROM memory_files WHERE scope=?"
            indexed = {row[0]: (row[1], row[2]) for row in await self._store.run(sql, (scope,))}
            for rel in indexed.keys() - on_disk.keys():
                self._indexed.pop((scope, rel), None)
                await self._store.run("DELETE FROM memory_chunks WHERE scope=? AND path=?", (scope, rel))
                await self._store.run("DELETE FROM memory_files WHERE scope=? AND path=?", (scope, rel))
            for rel, stamp in on_disk.items():
                if indexed.get(rel) == stamp:
                    continue
                try:
                    text = await self.read_text(scope, rel)
                except PathNotAllowed:
                    continue
                await self._index_file(scope, rel, text, *stamp)

    async def search(self, scope: str, session_key: str, query: str, *, limit: int = 8) -> list[SearchHit]:
        """Full text over this scope's MEMORY.md and daily notes and this session's stored
        messages (earlier turns), best matches first."""
        q = parse_query(query)
        if q.empty or limit <= 0:
            return []
        await self._refresh_index(scope)
        scored: list[tuple[float, float, SearchHit]] = []  # (rank, -recency, hit)
        for rank, path, date, content in await self._search_chunks(scope, q, limit):
            source = path
            scored.append((rank, -_date_key(date), SearchHit(date, source, make_snippet(content, q.terms))))
        for rank, turn, role, content, created in await self._search_messages(session_key, q, limit):
            date = datetime.fromtimestamp(created, self._tz).strftime("%Y-%m-%d")
            snippet = f"{role}: {make_snippet(content, q.terms)}"
            scored.append((rank, -created, SearchHit(date, f"dialog turn {turn}", snippet)))
        scored.sort(key=lambda item: (item[0], item[1]))
        return [hit for _, _, hit in scored[:limit]]

    async def _search_chunks(
        self, scope: str, q: SearchQuery, limit: int
    ) -> list[tuple[float, str, str, str]]:
        return await self._store.search_memory_chunks(
            scope, match=q.match, phrases=q.phrases, short_terms=q.short_terms, limit=limit)

    async def _search_messages(
        self, session_key: str, q: SearchQuery, limit: int
    ) -> list[tuple[float, int, str, str, float]]:
        return await self._store.search_session_messages(
            session_key, match=q.match, phrases=q.phrases, short_terms=q.short_terms, limit=limit)


def _is_note(relative: str) -> bool:
    parts = relative.split("/")
    return len(parts) == 2 and parts[0] == NOTES_DIR and bool(_NOTE_NAME.match(parts[1]))


def _date_key(date: str) -> float:
    try:
        return datetime.strptime(date, "%Y-%m-%d").timestamp()
    except ValueError:
        return 0.0
