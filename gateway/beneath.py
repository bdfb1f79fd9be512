"""Files beneath a directory, reached without ever following a link (SPEC §5.7).

A sandbox writes the workspace while the gateway uses it, and any number of sandboxes of
one workspace may run at once: between a check of a path and its use, a component can be
renamed or swapped for a symbolic link (renameat2 RENAME_EXCHANGE, in a loop). So nothing
here checks a path and then opens it by name. The root is opened once per operation, and
every path is opened relative to that descriptor, refusing any symbolic link on the way
(the last component included) and any way out: with openat2(2) and RESOLVE_BENEATH |
RESOLVE_NO_SYMLINKS where the kernel has it (Linux 5.6), else one component at a time with
O_NOFOLLOW. Whatever is swapped meanwhile, what gets opened is an entry of a real
directory beneath the root, and everything after (fstat, fchmod, writes, renameat,
unlinkat) acts on descriptors, never on the name again.

`..` is refused outright (no resolution happens, so none is needed); `.` and empty
components are dropped. A link or an escape raises PathNotAllowed; a missing file
FileNotFoundError, as `open` would.
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Literal

_SYS_OPENAT2 = 437  # one number on every architecture (the unified table, Linux 5.6)
_RESOLVE_NO_XDEV = 0x01  # not used: an operator may mount files/ from another disk
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
_RESOLVE = _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS
_RETRIES = 8  # openat2's EAGAIN (a rename raced the walk): asked again this often
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

FileMode = Literal["rb", "wb", "ab", "xb", "a+b"]
_FILE_FLAGS: dict[str, int] = {
    "rb": os.O_RDONLY,
    "wb": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
    "ab": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
    "xb": os.O_WRONLY | os.O_CREAT | os.O_EXCL,
    "a+b": os.O_RDWR | os.O_CREAT | os.O_APPEND,
}


class PathNotAllowed(ValueError):
    """A path that leaves the workspace (traversal, absolute path, symlink)."""


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc: ctypes.CDLL | None = None
# None: not asked yet. Tests set it False to take the component-by-component walk.
_use_openat2: bool | None = None


def _openat2(dir_fd: int, path: str, flags: int, mode: int) -> int:
    """openat2(dir_fd, path, {flags, mode, _RESOLVE}); OSError as os.open raises it."""
    assert _libc is not None
    how = _OpenHow(flags, mode if flags & os.O_CREAT else 0, _RESOLVE)  # a mode without O_CREAT is EINVAL
    encoded = os.fsencode(path)
    for _ in range(_RETRIES):
        fd = _libc.syscall(ctypes.c_long(_SYS_OPENAT2), ctypes.c_int(dir_fd), ctypes.c_char_p(encoded),
                           ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))
        if fd >= 0:
            return int(fd)
        err = ctypes.get_errno()
        if err != errno.EAGAIN:
            raise OSError(err, os.strerror(err), path)
    raise OSError(errno.EAGAIN, "the path kept changing while it was opened", path)


def openat2_available() -> bool:
    """Whether this kernel resolves paths for us (asked once): else the walk is used."""
    global _libc, _use_openat2
    if _use_openat2 is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.syscall.restype = ctypes.c_long
            probe = os.open("/", _DIR_FLAGS)
            try:
                os.close(_openat2(probe, ".", os.O_PATH | os.O_CLOEXEC, 0))
            finally:
                os.close(probe)
            _use_openat2 = True
        except (OSError, AttributeError):  # ENOSYS (before 5.6), EPERM (a seccomp filter), no libc
            _use_openat2 = False
    return _use_openat2


# -- names ---------------------------------------------------------------------------------


def split(relative: str) -> tuple[str, ...]:
    """The components of a path relative to a root, checked: no absolute path, no `..`,
    no NUL. `.` and empty components are dropped; () is the root itself."""
    if not isinstance(relative, str) or not relative.strip():
        raise PathNotAllowed("a path inside the workspace is required")
    if "\x00" in relative:
        raise PathNotAllowed("the path contains a NUL character")
    if relative.startswith("/"):
        raise PathNotAllowed("absolute paths are not allowed; use a path relative to the workspace")
    parts = tuple(part for part in relative.split("/") if part not in ("", "."))
    if ".." in parts:
        raise PathNotAllowed(f"{relative!r} is outside the workspace: '..' is not allowed in a path")
    return parts


def normalized(relative: str) -> str:
    """`relative` as checked and written the one way (`.` for the root)."""
    return "/".join(split(relative)) or "."


def _link_refused(relative: str) -> PathNotAllowed:
    return PathNotAllowed(f"{relative!r} is or goes through a symbolic link; links in the workspace are "
                          "not followed (one could lead outside the workspace)")


def _explain(dir_fd: int, parts: tuple[str, ...], relative: str, err: OSError, *,
             want_dir: bool) -> BaseException:
    """What an ENOTDIR or ELOOP meant: a link on the way (PathNotAllowed), or a file where
    a directory was expected (`err` itself). Only the message depends on this look; nothing
    is opened for use. When every component looks right by now, it changed meanwhile (a
    link swapped in and out): refused as a link."""
    if err.errno == errno.ELOOP:
        return _link_refused(relative)
    fd = os.dup(dir_fd)
    try:
        for i, name in enumerate(parts):
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except OSError:
                return err
            if stat.S_ISLNK(st.st_mode):
                return _link_refused(relative)
            if not stat.S_ISDIR(st.st_mode):  # as it said, unless only a directory was asked for last
                return err if i < len(parts) - 1 or want_dir else _link_refused(relative)
            try:
                child = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError:
                return err
            os.close(fd)
            fd = child
    finally:
        os.close(fd)
    return _link_refused(relative)


def _open_beneath(dir_fd: int, parts: tuple[str, ...], flags: int, mode: int, relative: str) -> int:
    """A new descriptor for `parts` beneath `dir_fd`, no link followed anywhere."""
    flags |= os.O_NOFOLLOW | os.O_CLOEXEC
    if not parts:
        return os.open(".", flags & ~(os.O_CREAT | os.O_EXCL | os.O_TRUNC | os.O_NOFOLLOW), dir_fd=dir_fd)
    try:
        if openat2_available():
            return _openat2(dir_fd, "/".join(parts), flags, mode)
        return _walk(dir_fd, parts, flags, mode)
    except OSError as err:
        if err.errno == errno.EXDEV:
            raise PathNotAllowed(f"{relative!r} is outside the workspace") from None
        if err.errno in (errno.ELOOP, errno.ENOTDIR):
            explained = _explain(dir_fd, parts, relative, err, want_dir=bool(flags & os.O_DIRECTORY))
            if explained is not err:
                raise explained from None
        err.filename = relative
        raise


def _walk(dir_fd: int, parts: tuple[str, ...], flags: int, mode: int) -> int:
    """The kernel without openat2: each directory opened O_NOFOLLOW relative to the one
    before, so a swap between two steps only changes which real directory is next."""
    fd = dir_fd
    try:
        for name in parts[:-1]:
            child = os.open(name, _DIR_FLAGS, dir_fd=fd)
            if fd != dir_fd:
                os.close(fd)
            fd = child
        return os.open(parts[-1], flags, mode, dir_fd=fd)
    finally:
        if fd != dir_fd:
            os.close(fd)


# -- a directory held open --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Entry:
    """A directory entry and its own stat (a link is a link, never its target)."""

    name: str
    stat: os.stat_result

    @property
    def is_file(self) -> bool:
        return stat.S_ISREG(self.stat.st_mode)

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.stat.st_mode)


class Dir:
    """A directory opened once; every path beneath it is reached through this descriptor
    without following a link. A context manager: it closes its descriptor."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd  # owned

    @classmethod
    def open(cls, root: Path | str) -> Dir:
        """`root` itself, which must be a directory and not a link. Its parents are the
        gateway's own (the data dir, `scopes/`), which no sandbox sees."""
        return cls(os.open(root, _DIR_FLAGS))

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)

    def __enter__(self) -> Dir:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # -- opening

    def open_fd(self, relative: str, flags: int, mode: int = 0o600) -> int:
        """A raw descriptor (O_NOFOLLOW and O_CLOEXEC added); the caller closes it."""
        return _open_beneath(self.fd, split(relative), flags, mode, relative)

    def subdir(self, relative: str, *, create: bool = False, mode: int = 0o700) -> Dir:
        """The directory at `relative`, made with its missing parents (each `mode`) when
        `create`."""
        parts = split(relative)
        if not create:
            return Dir(_open_beneath(self.fd, parts, _DIR_FLAGS, 0, relative))
        fd = os.dup(self.fd)
        try:
            for i, name in enumerate(parts):
                try:
                    os.mkdir(name, mode, dir_fd=fd)  # never follows: a link there is EEXIST
                except FileExistsError:
                    pass
                child = _open_beneath(fd, (name,), _DIR_FLAGS, 0, "/".join(parts[: i + 1]) or relative)
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return Dir(fd)

    def makedirs(self, relative: str, mode: int = 0o700) -> None:
        self.subdir(relative, create=True, mode=mode).close()

    def open_file(self, relative: str, how: FileMode = "rb", *, mode: int = 0o600,
                  parents: bool = False) -> BinaryIO:
        """A regular file at `relative` as a binary file object (`how` as for `open`);
        a directory raises IsADirectoryError, a FIFO, socket or device PathNotAllowed
        (opened without blocking: a FIFO planted where a file was expected holds nothing).
        `parents`: make missing parent directories first (0755 & umask, like mkdir -p)."""
        parts = split(relative)
        if parents and len(parts) > 1:
            self.subdir("/".join(parts[:-1]), create=True, mode=0o777).close()
        flags = _FILE_FLAGS[how] | os.O_NONBLOCK
        try:
            fd = _open_beneath(self.fd, parts, flags, mode, relative)
        except OSError as err:
            if err.errno == errno.ENXIO:  # a FIFO without a reader, opened to write
                raise PathNotAllowed(f"{relative!r} is not a regular file (a FIFO, socket or device "
                                     "is not used)") from None
            raise
        try:
            _require_file(fd, relative)
            os.set_blocking(fd, True)
            return os.fdopen(fd, how, buffering=0 if "a" in how else -1)  # type: ignore[return-value]
        except BaseException:
            os.close(fd)
            raise

    def read_bytes(self, relative: str, *, limit: int | None = None) -> bytes:
        """The file's bytes; with `limit`, an OSError(EFBIG) when it holds more."""
        with self.open_file(relative) as fh:
            data = fh.read() if limit is None else fh.read(limit + 1)
        if limit is not None and len(data) > limit:
            raise OSError(errno.EFBIG, f"larger than {limit} bytes", relative)
        return data

    def stat(self, relative: str) -> os.stat_result:
        """The entry's own stat; a link anywhere, the last component included, raises
        PathNotAllowed."""
        fd = _open_beneath(self.fd, split(relative), os.O_PATH, 0, relative)
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        if stat.S_ISLNK(st.st_mode):
            raise _link_refused(relative)
        return st

    def exists(self, relative: str) -> bool:
        """Whether an entry of any kind (a link too) is there."""
        parts = split(relative)
        if not parts:
            return True
        try:
            with self.subdir("/".join(parts[:-1]) or ".") as parent:
                os.stat(parts[-1], dir_fd=parent.fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def scandir(self, relative: str = ".") -> list[Entry]:
        """The entries of the directory at `relative` with their own stats (an entry
        that went away meanwhile is left out)."""
        with self.subdir(relative) as directory:
            out: list[Entry] = []
            with os.scandir(directory.fd) as entries:
                for entry in entries:
                    try:
                        out.append(Entry(entry.name, entry.stat(follow_symlinks=False)))
                    except FileNotFoundError:
                        continue
            return out

    # -- changing

    def replace(self, relative: str, data: bytes, *, mode: int = 0o600) -> os.stat_result:
        """Write `data` to `relative` atomically (temp file, fsync, renameat in the parent's
        descriptor, fsync of the parent), making missing parents. A regular file that was
        there keeps its mode; a new file gets `mode`. A link at that name is replaced, never
        followed. The new file's stat."""
        parts = split(relative)
        if not parts:
            raise IsADirectoryError(errno.EISDIR, "the workspace itself is a directory", relative)
        with self.subdir("/".join(parts[:-1]) or ".", create=True, mode=0o777) as parent:
            try:
                before: os.stat_result | None = os.stat(parts[-1], dir_fd=parent.fd, follow_symlinks=False)
            except FileNotFoundError:
                before = None
            if before is not None and not stat.S_ISREG(before.st_mode):
                before = None  # a link or something odd: replaced by a plain new file
            return write_replacing(parent.fd, parts[-1], data, like=before, mode=mode)

    def unlink(self, relative: str) -> None:
        """Remove the entry at `relative` (a link is removed itself: unlinkat never follows)."""
        parts = split(relative)
        if not parts:
            raise IsADirectoryError(errno.EISDIR, "the workspace itself is a directory", relative)
        with self.subdir("/".join(parts[:-1]) or ".") as parent:
            os.unlink(parts[-1], dir_fd=parent.fd)

    def chmod(self, relative: str, mode: int) -> None:
        """fchmod on the entry's own descriptor; a link is refused (PathNotAllowed)."""
        fd = _open_beneath(self.fd, split(relative), os.O_RDONLY | os.O_NONBLOCK, 0, relative)
        try:
            os.fchmod(fd, mode)
        finally:
            os.close(fd)


def _require_file(fd: int, relative: str) -> os.stat_result:
    st = os.fstat(fd)
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, "is a directory", relative)
    if not stat.S_ISREG(st.st_mode):
        raise PathNotAllowed(f"{relative!r} is not a regular file (a FIFO, socket or device is not used)")
    return st


def write_replacing(dir_fd: int, name: str, data: bytes, *, like: os.stat_result | None,
                    mode: int = 0o600) -> os.stat_result:
    """Atomically put `data` at `name` in the directory `dir_fd`: a temp file there
    (O_EXCL, 0600), fsync, renameat over `name`, fsync of the directory. With `like` (what
    was there) the file keeps its mode, and its owner and group where this user may set
    them; else it gets `mode`. The new file's stat."""
    tmp = f".{name[:64]}.{secrets.token_hex(6)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        try:
            if like is not None:
                os.fchmod(fd, stat.S_IMODE(like.st_mode))
                try:
                    os.fchown(fd, like.st_uid, like.st_gid)
                except PermissionError:  # not root: the new file is ours, as any edit would leave it
                    pass
            elif mode != 0o600:
                os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
            os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except FileNotFoundError:
                pass
            raise
        os.fsync(dir_fd)
        return os.fstat(fd)
    finally:
        os.close(fd)


# -- one operation on a root -------------------------------------------------------------------


def read_bytes(root: Path | str, relative: str, *, limit: int | None = None) -> bytes:
    with Dir.open(root) as directory:
        return directory.read_bytes(relative, limit=limit)


def replace(root: Path | str, relative: str, data: bytes, *, mode: int = 0o600) -> os.stat_result:
    with Dir.open(root) as directory:
        return directory.replace(relative, data, mode=mode)
