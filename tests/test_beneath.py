"""gateway.beneath: files beneath a directory, never through a link (SPEC §5.7).

Every test runs twice: with openat2 (RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS), and with the
component-by-component O_NOFOLLOW walk a kernel without openat2 gets; each run proves the
other way was not taken. A link is planted at every component of a path, pointing at a
copy of the tree outside, so that following it would find a file to read or write."""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gateway import beneath
from gateway.beneath import Dir, PathNotAllowed

OUTSIDE = "outside, never to be read or written\n"


@pytest.fixture(params=["openat2", "walk"])
def resolver(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which way paths are resolved: the other one fails the test if it is taken."""

    def not_this_way(*_args: Any) -> int:
        raise AssertionError(f"the {request.param} run took the other way")

    if request.param == "openat2":
        monkeypatch.setattr(beneath, "_use_openat2", None)
        if not beneath.openat2_available():
            if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
                pytest.fail("openat2 (Linux 5.6) is expected on the CI kernel", pytrace=False)
            pytest.skip("this kernel has no openat2 (Linux 5.6): the walk is all it uses")
        monkeypatch.setattr(beneath, "_walk", not_this_way)
    else:
        monkeypatch.setattr(beneath, "_use_openat2", False)
        monkeypatch.setattr(beneath, "_openat2", not_this_way)
    return str(request.param)


def tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def snapshot(top: Path) -> dict[str, tuple[int, bytes]]:
    out: dict[str, tuple[int, bytes]] = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            st = path.lstat()
            out[str(path.relative_to(top))] = (st.st_mode, path.read_bytes() if stat.S_ISREG(st.st_mode) else b"")
    return out


def plant(root: Path, outside: Path, rel: str, at: int) -> None:
    """Replace component `at` of `rel` (and what is under it) with a link to a copy outside."""
    parts = rel.split("/")
    copy = outside / f"copy{at}" / "/".join(parts[at:])
    copy.parent.mkdir(parents=True, exist_ok=True)
    copy.write_text(OUTSIDE)
    entry = root.joinpath(*parts[: at + 1])
    if entry.is_dir() and not entry.is_symlink():
        for sub in sorted(entry.rglob("*"), reverse=True):
            sub.unlink() if not sub.is_dir() or sub.is_symlink() else sub.rmdir()
        entry.rmdir()
    elif entry.exists() or entry.is_symlink():
        entry.unlink()
    entry.parent.mkdir(parents=True, exist_ok=True)
    entry.symlink_to(outside / f"copy{at}" / parts[at])


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "ws"
    tree(path, {"a/b/c.txt": "inside\n", "MEMORY.md": "memory\n"})
    return path


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    path = tmp_path / "outside"
    path.mkdir()
    return path


# -- names ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["", "  ", "/etc/passwd", "..", "a/../b", "a/b/..", "a\x00b", "../ws/a"])
def test_a_path_that_could_leave_is_refused_before_anything_is_opened(bad: str) -> None:
    with pytest.raises(PathNotAllowed):
        beneath.split(bad)


def test_dots_and_empty_components_are_dropped() -> None:
    assert beneath.split("./a//b/") == ("a", "b")
    assert beneath.split(".") == ()
    assert beneath.normalized("memory/./2026-11-28.md") == "memory/2026-11-28.md"
    assert beneath.normalized("./") == "."


# -- what works ---------------------------------------------------------------------------------------


def test_files_are_read_written_appended_and_made_as_asked(resolver: str, root: Path) -> None:
    with Dir.open(root) as ws:
        assert ws.read_bytes("a/b/c.txt") == b"inside\n"
        with ws.open_file("a/b/c.txt", "ab") as fh:
            fh.write(b"more\n")
        assert (root / "a/b/c.txt").read_text() == "inside\nmore\n"
        with ws.open_file("new/deeper/n.txt", "xb", mode=0o600, parents=True) as fh:
            fh.write(b"new")
        assert stat.S_IMODE((root / "new/deeper/n.txt").stat().st_mode) == 0o600
        with pytest.raises(FileExistsError):
            ws.open_file("new/deeper/n.txt", "xb")
        with pytest.raises(FileNotFoundError):
            ws.read_bytes("a/missing.txt")
        with pytest.raises(FileNotFoundError):
            ws.open_file("nowhere/x.txt", "ab")  # no parents made unless asked
        with pytest.raises(IsADirectoryError):
            ws.read_bytes("a/b")
        with pytest.raises(NotADirectoryError):
            ws.read_bytes("MEMORY.md/x")
        with pytest.raises(OSError, match="larger than 3 bytes"):
            ws.read_bytes("MEMORY.md", limit=3)
        assert ws.stat("a/b/c.txt").st_size == len("inside\nmore\n")
        assert stat.S_ISDIR(ws.stat(".").st_mode)
        assert sorted(e.name for e in ws.scandir("a/b")) == ["c.txt"]
        assert ws.exists("a/b/c.txt") and not ws.exists("a/b/none")


def test_replace_is_atomic_keeps_the_mode_and_leaves_no_temp_file(resolver: str, root: Path) -> None:
    (root / "MEMORY.md").chmod(0o640)
    with Dir.open(root) as ws:
        st = ws.replace("MEMORY.md", b"rewritten\n")
        assert st.st_size == len(b"rewritten\n") and stat.S_IMODE(st.st_mode) == 0o640
        ws.replace("tool_results/out.txt", b"saved")  # parents made
        with pytest.raises(IsADirectoryError):
            ws.replace("a/b", b"over a directory")
    assert (root / "MEMORY.md").read_text() == "rewritten\n"
    assert stat.S_IMODE((root / "tool_results/out.txt").stat().st_mode) == 0o600
    assert sorted(p.name for p in root.iterdir()) == ["MEMORY.md", "a", "tool_results"]
    assert sorted(p.name for p in (root / "a").iterdir()) == ["b"]


def test_directories_are_made_with_their_mode_and_entries_unlinked(resolver: str, root: Path) -> None:
    with Dir.open(root) as ws:
        ws.makedirs("files/sub", mode=0o700)
        assert stat.S_IMODE((root / "files" / "sub").stat().st_mode) == 0o700
        with ws.subdir("files", create=True) as files:
            assert files.scandir() == [e for e in files.scandir() if e.name == "sub"]
        ws.unlink("a/b/c.txt")
        with pytest.raises(FileNotFoundError):
            ws.unlink("a/b/c.txt")
        ws.chmod("MEMORY.md", 0o600)
    assert not (root / "a/b/c.txt").exists()
    assert stat.S_IMODE((root / "MEMORY.md").stat().st_mode) == 0o600


def test_the_root_must_be_a_real_directory(tmp_path: Path, root: Path) -> None:
    (tmp_path / "link").symlink_to(root)
    with pytest.raises(OSError):
        Dir.open(tmp_path / "link")
    with pytest.raises(NotADirectoryError):
        Dir.open(root / "MEMORY.md")


async def test_a_fifo_is_refused_without_waiting_for_a_writer(resolver: str, root: Path) -> None:
    os.mkfifo(root / "a" / "pipe")

    def read() -> None:
        with Dir.open(root) as ws:
            ws.read_bytes("a/pipe")

    with pytest.raises(PathNotAllowed, match="not a regular file"):
        await asyncio.wait_for(asyncio.to_thread(read), 10)

    def append() -> None:
        with Dir.open(root) as ws:
            ws.open_file("a/pipe", "ab")

    with pytest.raises(PathNotAllowed, match="not a regular file"):
        await asyncio.wait_for(asyncio.to_thread(append), 10)


# -- links, wherever they are ----------------------------------------------------------------------------

Act = Callable[[Dir, str], object]
ACTS: dict[str, Act] = {
    "read": lambda ws, rel: ws.read_bytes(rel),
    "append": lambda ws, rel: ws.open_file(rel, "ab").close(),
    "create": lambda ws, rel: ws.open_file(rel, "xb", parents=True).close(),
    "write": lambda ws, rel: ws.open_file(rel, "wb").close(),
    "stat": lambda ws, rel: ws.stat(rel),
    "chmod": lambda ws, rel: ws.chmod(rel, 0o777),
    "open_fd": lambda ws, rel: os.close(ws.open_fd(rel, os.O_RDONLY)),
    "makedirs": lambda ws, rel: ws.makedirs(f"{rel}/more"),
    "scandir": lambda ws, rel: ws.scandir(rel.rsplit("/", 1)[0]),
}


# (scandir lists a/b: a link in place of c.txt is listed as a link, below.)
@pytest.mark.parametrize(("act", "at"), [(act, at) for act in ACTS for at in (0, 1, 2)
                                         if (act, at) != ("scandir", 2)])
def test_a_link_at_any_component_is_refused(resolver: str, root: Path, outside: Path, act: str, at: int) -> None:
    rel = "a/b/c.txt"
    plant(root, outside, rel, at)
    before = snapshot(outside)
    # O_EXCL over a link: it exists, and it is not followed.
    refusal = pytest.raises(FileExistsError) if (act, at) == ("create", 2) else \
        pytest.raises(PathNotAllowed, match="symbolic link")
    with Dir.open(root) as ws, refusal:
        ACTS[act](ws, rel)
    assert snapshot(outside) == before


@pytest.mark.parametrize("at", [0, 1, 2])
def test_replace_and_unlink_act_on_a_link_never_through_it(resolver: str, root: Path, outside: Path,
                                                           at: int) -> None:
    rel = "a/b/c.txt"
    plant(root, outside, rel, at)
    before = snapshot(outside)
    with Dir.open(root) as ws:
        if at < 2:
            for act in (lambda: ws.replace(rel, b"x"), lambda: ws.unlink(rel)):
                with pytest.raises(PathNotAllowed, match="symbolic link"):
                    act()
        else:  # the last component: the link itself is replaced, or removed
            assert [e.name for e in ws.scandir("a/b") if stat.S_ISLNK(e.stat.st_mode)] == ["c.txt"]
            ws.replace(rel, b"x")
            assert (root / rel).read_bytes() == b"x" and not (root / rel).is_symlink()
            (root / rel).unlink()
            (root / rel).symlink_to(outside / "copy2" / "c.txt")
            ws.unlink(rel)
            assert not (root / rel).exists() and not (root / rel).is_symlink()
    assert snapshot(outside) == before


def test_a_link_that_stays_inside_is_refused_too(resolver: str, root: Path) -> None:
    (root / "alias").symlink_to(root / "a")
    (root / "self.md").symlink_to("MEMORY.md")
    with Dir.open(root) as ws:
        for rel in ("alias/b/c.txt", "self.md"):
            with pytest.raises(PathNotAllowed, match="outside the workspace"):
                ws.read_bytes(rel)
