"""Issue 31: a sandbox swaps names under the gateway (SPEC §5.7), attacked for real.

A real bwrap sandbox of the workspace runs a program that loops renameat2(RENAME_EXCHANGE),
swapping a real directory or file of the workspace with a symlink to a victim outside it:
another person's MEMORY.md, notes and archive, a stand-in config.json (0600) and a
stand-in authorized_keys. Meanwhile the gateway's side (memory_write, read_file, the dialog
archive, saved tool outputs, the post-exec tidy, reply files, downloads, the purge) runs
again and again, bounded by a count. Every victim must come out untouched (content, mode,
its directory's entries) and nothing of a victim may come back; each operation either
worked inside the workspace or was refused. Each scenario also shows that the race ran:
the attacker swapped all along, and the gateway's side met both states (it worked, and
it was refused).

As root, and through `setpriv` as nobody: a gateway run as an ordinary user owns its
config, its other scopes and its ~/.ssh, so the victims are in reach either way. The one
place where the user changes what the gateway can do is the tidy's fchmod of a set-user-ID
file its owner may not read (root reads anything): tested on its own, as both.

`python -m tests.test_workspace_race DIR NAME…` runs scenarios in this process (that is
how the nobody runs go) and prints one JSON report a line.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import shutil
import stat
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import pytest

from gateway import beneath
from gateway.config.schema import Config
from gateway.media import Media, discard_saved, reply_files, save_download
from gateway.memory.files import Memory
from gateway.memory.purge import purge_sent_files, purge_tool_results
from gateway.store.sqlite import Store
from gateway.tools import sandbox
from gateway.tools.base import ToolContext, ToolError
from gateway.tools.memory_write import MemoryWrite
from gateway.tools.read_file import ReadFile
from gateway.types import Attachment, Inbound
from gateway.workspace import PathNotAllowed
from tests.test_beneath import plant, resolver  # noqa: F401 (a fixture)

ROOT = Path(__file__).resolve().parent.parent
NOW = datetime(2026, 11, 28, 10, 0, tzinfo=UTC)
TODAY = NOW.strftime("%Y-%m-%d")
SECRET = "s3cr3t-config-9d1f"
KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOwnerKey owner@host\n"
BOB_SECRET = "his sister is called Ada"
INJECTED = "ssh-ed25519 AAAAinjected attacker@evil"
MIN_ROUNDS = 250  # the gateway's side runs at least this often,
MIN_FLIPS = 20  # and on until its outcome changed (worked / refused) this often,
MAX_ROUNDS = 10_000  # but never more than this
ATTACK_TIMEOUT_S = 120.0
OLD = 1000.0  # the purge's cut-off in these tests: files written in 1970 are past it
NOBODY = 65534
REFUSALS = (PathNotAllowed, FileNotFoundError, NotADirectoryError, ToolError)

# The attacker, run by python3 in the sandbox: argv = a b [plant…]. It exchanges the names a
# and b (a real entry and a symlink) until a file `stop` appears, and keeps replanting what
# the gateway's side removes, in the real directory a (wherever it is named at the moment):
# `suid:NAME` a file of mode 04777, `fifo:NAME` a FIFO, `old:NAME` a file last written in 1970.
# It swaps at random lengths: flat out, the attacker and the gateway (both waiting on the
# directory's lock) could fall into step, and one state be all the gateway meets.
ATTACKER = r"""
import ctypes, os, random, sys
libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD, RENAME_EXCHANGE = -100, 2
a, b = sys.argv[1].encode(), sys.argv[2].encode()
real = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY) if os.path.isdir(sys.argv[1]) else None
plants = [p.split(":", 1) for p in sys.argv[3:]]

def plant():
    for kind, name in plants:
        try:
            if kind == "suid":
                os.close(os.open(name, os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=real))
                os.chmod(name, 0o4777, dir_fd=real)
            elif kind == "fifo":
                os.mkfifo(name, dir_fd=real)
            elif kind == "old":
                os.close(os.open(name, os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=real))
                os.utime(name, (0, 0), dir_fd=real)
        except OSError:
            pass

plant()
open("ready", "w").close()
swaps = 0
while not os.path.exists("stop"):
    batch = random.randrange(1, 128)  # odd batches too: the pause between two is either state
    for _ in range(batch):
        if libc.renameat2(AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE) != 0:
            sys.exit("renameat2: " + os.strerror(ctypes.get_errno()))
        for _ in range(random.randrange(24)):  # and each state lasts a moment, at random
            pass
    swaps += batch
    if real is not None:
        plant()
print(swaps)
"""


@dataclass(frozen=True, slots=True)
class Report:
    name: str
    worked: int  # operations that did their job inside the workspace
    refused: int  # operations refused (a link on the way, the entry gone meanwhile)
    swaps: int  # exchanges the attacker made meanwhile
    harm: list[str]  # what reached a victim, or came back from one: must stay empty


Op = Callable[[], Awaitable[bool]]  # one operation of the gateway's side: True when it worked


async def race(ws: Path, swap: tuple[str, str], op: Op, *, plants: tuple[str, ...] = (),
               min_flips: int = MIN_FLIPS) -> tuple[int, int, int]:
    """Run `op` while a sandbox of `ws` exchanges the names `swap`: (worked, refused, swaps)."""
    found = await sandbox.availability()
    assert found.tools is not None, f"the race needs the real sandbox: {found.reason}"
    box = sandbox.Box(ws, limits=sandbox.Limits(memory_mb=256, tmp_mb=1))
    argv = ["/usr/bin/python3", "-c", ATTACKER, *swap, *plants]
    attack = asyncio.ensure_future(sandbox.run(found.tools, box, argv, timeout_s=ATTACK_TIMEOUT_S))
    worked = refused = flips = 0
    try:
        deadline = time.monotonic() + 60
        while not (ws / "ready").exists():
            assert not attack.done(), f"the attacker did not start: {attack.result()}"
            assert time.monotonic() < deadline, "the attacker did not start within 60 s"
            await asyncio.sleep(0.01)
        last: bool | None = None
        for rounds in range(1, MAX_ROUNDS + 1):
            try:
                ok = await op()
            except REFUSALS:
                ok = False
            worked, refused = worked + ok, refused + (not ok)
            flips += last is not None and ok != last
            last = ok
            if rounds >= MIN_ROUNDS and flips >= min_flips:
                break
            if rounds % 100 == 0 and flips < min_flips:
                await asyncio.sleep(0.005)  # a loaded machine: let the attacker have a core a moment
        assert not attack.done(), "the attacker stopped before the gateway's side was done"
    finally:
        (ws / "stop").touch()
        outcome = await asyncio.wait_for(asyncio.shield(attack), ATTACK_TIMEOUT_S + 10)
    out = bytes(outcome.stdout.data).decode()
    assert outcome.returncode == 0, (outcome.returncode, out, bytes(outcome.stderr.data).decode())
    for name in ("ready", "stop"):
        (ws / name).unlink()
    return worked, refused, int(out.strip())


# -- the world: two people's workspaces and the victims -------------------------------------------


@dataclass
class World:
    base: Path
    memory: Memory
    store: Store
    ws: Path  # Alice's workspace: the one the sandbox writes
    bob: Path  # Bob's workspace
    etc: Path  # holds a stand-in config.json (0600) and a few more files of the gateway's user
    ssh: Path  # holds a stand-in authorized_keys
    before: dict[str, tuple[int, bytes]]

    ALICE = "telegram:user:1"
    BOB = "telegram:user:2"

    def ctx(self) -> ToolContext:
        return ToolContext(session_key="telegram:dm:1", scope=self.ALICE, workspace=self.ws, config=Config(),
                           memory=self.memory)

    def victims(self) -> dict[str, tuple[int, bytes]]:
        """Every file of the victims' trees: path → (mode, content); directories as (mode, b"")."""
        found: dict[str, tuple[int, bytes]] = {}
        for top in (self.etc, self.ssh.parent, self.bob):
            for dirpath, dirnames, filenames in os.walk(top):
                for name in dirnames + filenames:
                    path = Path(dirpath, name)
                    st = path.lstat()
                    data = path.read_bytes() if stat.S_ISREG(st.st_mode) else b""
                    found[str(path)] = (st.st_mode, data)
        return found

    def harm(self) -> list[str]:
        now = self.victims()
        changed = [f"changed: {p}" for p in self.before if p in now and now[p] != self.before[p]]
        gone = [f"gone: {p}" for p in self.before if p not in now]
        added = [f"added: {p}" for p in now if p not in self.before]
        return changed + gone + added


@asynccontextmanager
async def world(base: Path) -> AsyncIterator[World]:
    base.mkdir(parents=True, exist_ok=True)
    store = await Store.open(base / "gateway.db")
    try:
        memory = Memory(base / "data", tz=UTC, store=store, clock=lambda: NOW)
        ws, bob = memory.workspace(World.ALICE), memory.workspace(World.BOB)
        (bob / "MEMORY.md").write_text(f"Bob's memory: {BOB_SECRET}.\n")
        (bob / "memory" / f"{TODAY}.md").write_text(f"# {TODAY}\n\nBob's note: {BOB_SECRET}.\n")
        (bob / "dialog" / f"{TODAY}.jsonl").write_text(json.dumps({"content": BOB_SECRET}) + "\n")
        (bob / "tool_results" / "recent.txt").write_text("Bob's tool output\n")
        etc = base / "etc"
        etc.mkdir()
        for name, text in (("config.json", json.dumps({"model": {"api_key": SECRET}})), ("doc.txt", SECRET),
                           ("out.txt", SECRET), ("pipe", "not a FIFO, and the gateway's")):
            (etc / name).write_text(text)
            (etc / name).chmod(0o600)
        (etc / "old.txt").write_text(SECRET)
        os.utime(etc / "old.txt", (0, 0))  # as old as the purge's own candidates
        ssh = base / "home" / ".ssh"
        ssh.mkdir(parents=True, mode=0o700)
        (ssh / "authorized_keys").write_text(KEY)
        (ssh / "authorized_keys").chmod(0o600)
        w = World(base, memory, store, ws, bob, etc, ssh, {})
        w.before = w.victims()
        yield w
    finally:
        await store.close()


# -- the scenarios ----------------------------------------------------------------------------------


def swap_with_link(ws: Path, rel: str, target: Path) -> tuple[str, str]:
    """The real entry `rel` and a symlink beside it to `target`: the two names exchanged."""
    link = ws / f"{rel}.swap"
    link.symlink_to(target)
    return rel, f"{rel}.swap"


async def daily_note_into_keys(w: World) -> tuple[int, int, int]:
    """memory_write (daily) while today's note is swapped with a link to authorized_keys."""
    await w.memory.append_daily(w.ALICE, "the note exists")
    swap = swap_with_link(w.ws, f"memory/{TODAY}.md", w.ssh / "authorized_keys")
    ctx, tool = w.ctx(), MemoryWrite()
    return await race(w.ws, swap, lambda: _ran(tool.run({"text": INJECTED, "target": "daily"}, ctx)))


async def daily_note_into_bobs_memory(w: World) -> tuple[int, int, int]:
    """memory_write (daily) while today's note is swapped with a link to Bob's MEMORY.md,
    which is his system prompt."""
    await w.memory.append_daily(w.ALICE, "the note exists")
    swap = swap_with_link(w.ws, f"memory/{TODAY}.md", w.bob / "MEMORY.md")
    ctx, tool = w.ctx(), MemoryWrite()
    return await race(w.ws, swap, lambda: _ran(tool.run({"text": INJECTED, "target": "daily"}, ctx)))


async def notes_dir_into_bobs_notes(w: World) -> tuple[int, int, int]:
    """memory_write (daily) while memory/ is swapped with a link to Bob's memory/."""
    swap = swap_with_link(w.ws, "memory", w.bob / "memory")
    ctx, tool = w.ctx(), MemoryWrite()
    return await race(w.ws, swap, lambda: _ran(tool.run({"text": INJECTED, "target": "daily"}, ctx)))


async def prompt_from_bobs_memory(w: World) -> tuple[int, int, int]:
    """MEMORY.md read for Alice's system prompt while it is swapped with a link to Bob's."""
    (w.ws / "MEMORY.md").write_text("Alice's memory.\n")
    swap = swap_with_link(w.ws, "MEMORY.md", w.bob / "MEMORY.md")
    budgets = iter(range(1000, 1000 + MAX_ROUNDS + 1))  # a new budget each time: never the cached text

    async def op() -> bool:
        text = await w.memory.read_memory_md(w.ALICE, max_tokens=next(budgets), count=lambda t: len(t.split()))
        leaked.extend(t for t in (BOB_SECRET,) if t in text)
        return bool(text)

    return await race(w.ws, swap, op)


async def read_file_of_config(w: World) -> tuple[int, int, int]:
    """read_file of d/config.json while d/ is swapped with a link to the config's directory."""
    (w.ws / "d").mkdir()
    (w.ws / "d" / "config.json").write_text("{}\n")
    return await race(w.ws, swap_with_link(w.ws, "d", w.etc), _reader(w, "d/config.json"))


async def read_file_of_bobs_memory(w: World) -> tuple[int, int, int]:
    """read_file of notes/MEMORY.md while notes/ is swapped with a link to Bob's workspace."""
    (w.ws / "notes").mkdir()
    (w.ws / "notes" / "MEMORY.md").write_text("Alice's own notes\n")
    return await race(w.ws, swap_with_link(w.ws, "notes", w.bob), _reader(w, "notes/MEMORY.md"))


def _reader(w: World, rel: str) -> Op:
    ctx, tool = w.ctx(), ReadFile()

    async def op() -> bool:
        text = (await tool.run({"path": rel}, ctx)).text
        leaked.extend(t for t in (SECRET, BOB_SECRET) if t in text)
        return True

    return op


async def tidy_after_exec(w: World) -> tuple[int, int, int]:
    """The post-exec tidy while sub/ (holding a set-user-ID config.json and a FIFO named
    pipe) is swapped with a link to the config's directory: its chmod and its unlink must
    never reach the config (0600) or the file named pipe there."""
    (w.ws / "sub").mkdir()
    swap = swap_with_link(w.ws, "sub", w.etc)

    async def op() -> bool:
        return await asyncio.to_thread(sandbox.tidy, w.ws) > 0

    # Its window is the shortest (a stat, then the chmod): more meetings of the swap.
    return await race(w.ws, swap, op, plants=("suid:config.json", "fifo:pipe"), min_flips=4 * MIN_FLIPS)


async def dialog_into_bobs_archive(w: World) -> tuple[int, int, int]:
    """The dialog archive appended while dialog/ is swapped with a link to Bob's."""
    swap = swap_with_link(w.ws, "dialog", w.bob / "dialog")
    rows = [{"turn": 1, "role": "user", "content": INJECTED}]
    return await race(w.ws, swap, lambda: _ran(w.memory.archive_dialog(w.ALICE, rows)))


async def tool_output_over_a_file_outside(w: World) -> tuple[int, int, int]:
    """A saved tool output written (atomically) while tool_results/ is swapped with a link."""
    swap = swap_with_link(w.ws, "tool_results", w.etc)
    return await race(w.ws, swap, lambda: _ran(w.memory.save_text(w.ALICE, "tool_results/out.txt", INJECTED)))


async def reply_file_from_outside(w: World) -> tuple[int, int, int]:
    """A reply naming files/doc.txt, its bytes read as a channel uploads them, while files/
    is swapped with a link to the config's directory (which holds a doc.txt too)."""
    (w.ws / "files" / "doc.txt").write_text("Alice's document\n")
    swap = swap_with_link(w.ws, "files", w.etc)

    async def op() -> bool:
        found = await asyncio.to_thread(reply_files, w.ws, "Here it is: files/doc.txt.")
        for file in found:
            data = await asyncio.to_thread(file.read_bytes)
            leaked.extend(t for t in (SECRET,) if t.encode() in data)
        return bool(found)

    return await race(w.ws, swap, op)


async def download_into_ssh(w: World) -> tuple[int, int, int]:
    """A file someone sends, named authorized_keys, saved while files/ is swapped with a
    link to ~/.ssh."""
    swap = swap_with_link(w.ws, "files", w.ssh)

    async def chunks() -> AsyncIterator[bytes]:
        await asyncio.sleep(0)
        yield INJECTED.encode()

    return await race(w.ws, swap, lambda: _ran(save_download(chunks(), w.ws, "authorized_keys", limit=4096)))


async def purge_of_tool_outputs(w: World) -> tuple[int, int, int]:
    """The purge of old tool outputs while tool_results/ is swapped with a link to a
    directory holding an old .txt."""
    swap = swap_with_link(w.ws, "tool_results", w.etc)

    async def op() -> bool:
        return await purge_tool_results(w.memory.data_dir, before=OLD, live_references=set) > 0

    return await race(w.ws, swap, op, plants=("old:old.txt",))


async def purge_of_sent_files(w: World) -> tuple[int, int, int]:
    """The purge of old sent files while files/ is swapped with a link to the config's
    directory."""
    swap = swap_with_link(w.ws, "files", w.etc)

    async def op() -> bool:
        return await purge_sent_files(w.memory.data_dir, before=OLD) > 0

    return await race(w.ws, swap, op, plants=("old:old.txt",))


async def _ran(call: Awaitable[object]) -> bool:
    await call
    return True


leaked: list[str] = []  # what a read brought back from a victim (the scenario running now)

SCENARIOS: dict[str, Callable[[World], Awaitable[tuple[int, int, int]]]] = {
    f.__name__: f for f in (
        daily_note_into_keys, daily_note_into_bobs_memory, notes_dir_into_bobs_notes, prompt_from_bobs_memory,
        read_file_of_config, read_file_of_bobs_memory, tidy_after_exec, dialog_into_bobs_archive,
        tool_output_over_a_file_outside, reply_file_from_outside, download_into_ssh, purge_of_tool_outputs,
        purge_of_sent_files,
    )
}


async def run_scenario(base: Path, name: str) -> Report:
    leaked.clear()
    async with world(base) as w:
        worked, refused, swaps = await SCENARIOS[name](w)
        harm = w.harm() + [f"read back: {t}" for t in dict.fromkeys(leaked)]
    return Report(name, worked, refused, swaps, harm)


def check(report: Report) -> None:
    assert report.harm == [], report
    # The race ran: the attacker swapped all along, and the gateway met both states.
    assert report.swaps > 0 and report.worked > 0 and report.refused > 0, report


@pytest.mark.parametrize("name", list(SCENARIOS))
async def test_a_sandbox_swapping_names_never_leads_the_gateway_out(name: str, tmp_path: Path) -> None:
    check(await run_scenario(tmp_path / "w", name))


WALKED = ("daily_note_into_keys", "read_file_of_config", "tool_output_over_a_file_outside", "download_into_ssh")


@pytest.mark.parametrize("name", WALKED)
async def test_without_openat2_the_walk_holds_against_the_same_races(
        name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel before 5.6: each component opened O_NOFOLLOW from the one before (appends,
    reads, atomic replaces, downloads: each way files are opened)."""
    monkeypatch.setattr(beneath, "_use_openat2", False)
    monkeypatch.setattr(beneath, "_openat2", None)  # called, it would fail the test
    check(await run_scenario(tmp_path / "w", name))


# -- every access path, a link planted at each component (no race) --------------------------------------


@dataclass(frozen=True, slots=True)
class Access:
    rel: str  # the workspace path the operation uses
    run: Callable[[World], Awaitable[object]]  # raises a refusal, or returns what it brought back
    memory_md: bool = False  # Alice has a MEMORY.md already


def _tool(args: dict[str, str], tool: MemoryWrite | ReadFile) -> Callable[[World], Awaitable[object]]:
    async def run(w: World) -> object:
        return (await tool.run(args, w.ctx())).text
    return run


async def _reply_bytes(w: World) -> object:
    found = await asyncio.to_thread(reply_files, w.ws, "see files/doc.txt")
    return [await asyncio.to_thread(f.read_bytes) for f in found]


async def _image_url(w: World) -> object:
    part = {"type": "image_url", "image_url": {"url": "workspace:files/pic.png"}}
    return await Media(lambda: Config()).resolve_images([{"role": "user", "content": [part]}], w.ws)


async def _discard(w: World) -> object:
    inbound = Inbound(channel="telegram", chat_id="1", user_id="1", text="", event_id="e",
                      attachments=(Attachment(name="doc.txt", path="files/doc.txt", kind="file"),))
    await discard_saved(w.ws, inbound)
    return None


async def _chunks() -> AsyncIterator[bytes]:
    yield INJECTED.encode()


ACCESSES: dict[str, Access] = {
    "memory_write daily": Access(f"memory/{TODAY}.md", _tool({"text": INJECTED, "target": "daily"}, MemoryWrite())),
    "memory_write memory": Access("MEMORY.md", _tool({"text": INJECTED, "target": "memory"}, MemoryWrite()),
                                  memory_md=True),
    "system prompt": Access("MEMORY.md", lambda w: w.memory.read_memory_md(w.ALICE, max_tokens=500,
                                                                            count=lambda t: len(t.split())),
                            memory_md=True),
    "dialog archive": Access(f"dialog/{TODAY}.jsonl", lambda w: w.memory.archive_dialog(w.ALICE, [{"x": INJECTED}])),
    "saved tool output": Access("tool_results/out.txt", lambda w: w.memory.save_text(w.ALICE, "tool_results/out.txt",
                                                                                       INJECTED)),
    "memory backup": Access("memory/backup/MEMORY-20261128T100000.md",
                            lambda w: w.memory.replace_memory_md(w.ALICE, expected="", new_text=INJECTED),
                            memory_md=True),
    "read_text": Access("memory/notes.md", lambda w: w.memory.read_text(w.ALICE, "memory/notes.md")),
    "read_file": Access("d/config.json", _tool({"path": "d/config.json"}, ReadFile())),
    "reply files": Access("files/doc.txt", _reply_bytes),
    "download": Access("files/doc.txt", lambda w: save_download(_chunks(), w.ws, "doc.txt", limit=4096)),
    "image for the model": Access("files/pic.png", _image_url),
    "discarded download": Access("files/doc.txt", _discard),
    "purge of tool outputs": Access("tool_results/old.txt", lambda w: purge_tool_results(
        w.memory.data_dir, before=OLD, live_references=set)),
    "purge of sent files": Access("files/old.txt", lambda w: purge_sent_files(w.memory.data_dir, before=OLD)),
    "tidy": Access("sub/tool", lambda w: asyncio.to_thread(sandbox.tidy, w.ws)),
}


@pytest.mark.parametrize(("name", "at"), [(name, at) for name, access in ACCESSES.items()
                                          for at in range(len(access.rel.split("/")))])
@pytest.mark.usefixtures("resolver")  # openat2, and the walk
async def test_a_link_planted_anywhere_on_an_access_path_is_not_followed(name: str, at: int, tmp_path: Path) -> None:
    async with world(tmp_path / "w") as w:
        access = ACCESSES[name]
        (w.ws / access.rel).parent.mkdir(parents=True, exist_ok=True)
        (w.ws / access.rel).write_text("Alice's own\n")
        if access.memory_md:
            (w.ws / "MEMORY.md").write_text("Alice's memory\n")
        outside = w.etc / "planted"
        plant(w.ws, outside, access.rel, at)
        for path in outside.rglob("*"):
            if path.is_file():
                path.write_text(SECRET)
                path.chmod(0o4755 if name == "tidy" else 0o600)
                os.utime(path, (0, 0))
        w.before = w.victims()
        try:
            got = await access.run(w)
        except REFUSALS:
            got = None
        assert w.harm() == []
        shown = repr(got)
        assert SECRET not in shown and base64.b64encode(SECRET.encode()).decode()[:16] not in shown
        copied = [p for p in w.ws.rglob("*") if not p.is_symlink() and p.is_file() and SECRET in p.read_text()]
        assert copied == []  # nor was it read into a file of the workspace (MEMORY.md rewritten, say)


# -- as an ordinary user ------------------------------------------------------------------------------

AS_NOBODY = ("daily_note_into_keys", "read_file_of_config", "tidy_after_exec", "download_into_ssh",
             "tool_output_over_a_file_outside", "tidy_of_an_unreadable_setuid_file")


async def tidy_of_an_unreadable_setuid_file(base: Path) -> Report:
    """A set-user-ID file whose owner may not read or write it (04111): root opens it
    anyway, an ordinary user only by O_PATH; the tidy takes the bit off either way."""
    base.mkdir(parents=True, exist_ok=True)
    ws = base / "ws"
    (ws / "deep").mkdir(parents=True)
    target = ws / "deep" / "tool"
    target.write_bytes(b"\x7fELF")
    target.chmod(0o4111)
    changed = await asyncio.to_thread(sandbox.tidy, ws)
    mode = stat.S_IMODE(target.lstat().st_mode)
    harm = [] if mode == 0o111 else [f"still mode {mode:o}"]
    return Report("tidy_of_an_unreadable_setuid_file", changed, 1, 1, harm)


async def test_a_setuid_file_its_owner_cannot_read_loses_its_bit(tmp_path: Path) -> None:
    check(await tidy_of_an_unreadable_setuid_file(tmp_path / "w"))


async def test_the_races_as_an_ordinary_user() -> None:
    """The same attacks with the gateway (and so its sandbox) run as nobody: its own files
    are its victims then."""
    if os.geteuid() != 0:
        pytest.skip("the suite runs as an ordinary user already: every race above ran as one")
    base = Path(tempfile.mkdtemp(prefix="gateway-race-"))  # under /tmp: nobody can reach it
    try:
        os.chown(base, NOBODY, NOBODY)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONDONTWRITEBYTECODE": "1",
               "HOME": str(base), "TMPDIR": str(base)}
        proc = await asyncio.create_subprocess_exec(
            "setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable,
            "-m", "tests.test_workspace_race", str(base), *AS_NOBODY,
            cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 300)
        assert proc.returncode == 0, err.decode()[-4000:]
        reports = [Report(**json.loads(line)) for line in out.decode().splitlines() if line.startswith("{")]
        assert [r.name for r in reports] == list(AS_NOBODY), out.decode()
        for report in reports:
            check(report)
    finally:
        shutil.rmtree(base, ignore_errors=True)


async def _main(base: Path, names: list[str]) -> None:
    for i, name in enumerate(names):
        where = base / f"{i}-{name}"
        if name == "tidy_of_an_unreadable_setuid_file":
            report = await tidy_of_an_unreadable_setuid_file(where)
        else:
            report = await run_scenario(where, name)
        print(json.dumps(asdict(report)), flush=True)


if __name__ == "__main__":
    logging.disable(logging.WARNING)  # the refusals' warnings; the reports are what counts
    asyncio.run(_main(Path(sys.argv[1]), sys.argv[2:]))
