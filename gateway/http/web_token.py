"""The gateway's own web token (SPEC §9): what the web page's API asks for while
`channels.web.token` is not set.

Being on loopback proves nothing about who is asking: a sandboxed command with the network
on, or any other program of the machine, reaches 127.0.0.1 as well as the person at the
browser does. So the API always wants a token, and without a configured one it is this:
made once per data dir (random, `TOKEN_BYTES` bytes, URL-safe, in a 0600 file), kept
across restarts and shared by the gateways of one data dir. The person gets it from the
link `gateway run` prints (`http://127.0.0.1:8080/?token=…`, as notebook servers do) or
`gateway web-link`; opening the link trades it for a cookie (channels/web/adapter.py).
Nothing of a sandbox sees the data dir, so nothing there can read it.

Everything here touches files: call it off the event loop (asyncio.to_thread)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import os
import re
import secrets
import stat
from pathlib import Path
from urllib.parse import quote

TOKEN_FILE = "web-token"
TOKEN_BYTES = 32
TOKEN_SHAPE = re.compile(r"[A-Za-z0-9_-]{32,200}")  # what the file may hold (urlsafe base64, a person's own)
WILDCARD_HOSTS = {"0.0.0.0", "::", ""}


class WebTokenError(OSError):
    """The token file exists but holds no token, or cannot be read or written."""


def token_path(data_dir: Path) -> Path:
    return data_dir / TOKEN_FILE


def load_or_create(data_dir: Path) -> str:
    """The data dir's token, made now when there is none. Two gateways starting at once
    on one data dir get the same one: the file appears whole (a hard link of a written
    file), and whoever comes second reads the first one's."""
    path = token_path(data_dir)
    found = _read(path)
    if found is not None:
        return found
    data_dir.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(TOKEN_BYTES)
    scratch = data_dir / f".{TOKEN_FILE}.{secrets.token_hex(8)}"
    fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as out:
            out.write(token + "\n")
            out.flush()
            os.fsync(out.fileno())
        try:
            try:
                os.link(scratch, path)
            except FileExistsError:
                raise
            except OSError:  # a file system without hard links: created in place instead
                _create_in_place(path, token)
        except FileExistsError:  # another gateway made it first: theirs is the one
            found = _read(path)
            if found is None:
                raise WebTokenError(f"{path} appeared but holds no token") from None
            return found
    finally:
        with contextlib.suppress(FileNotFoundError):
            scratch.unlink()
    return token


def _create_in_place(path: Path, token: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as out:
        out.write(token + "\n")
        out.flush()
        os.fsync(out.fileno())


def read(data_dir: Path) -> str | None:
    """The data dir's token, or None when it has none yet."""
    return _read(token_path(data_dir))


def _read(path: Path) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as err:  # a symlink (ELOOP), no permission
        raise WebTokenError(f"cannot read {path}: {err.strerror or err}") from None
    with os.fdopen(fd, "r", encoding="ascii", errors="replace") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise WebTokenError(f"{path} is not a file")
        if info.st_mode & 0o077:  # readable by others: made so by hand; only its owner should
            os.fchmod(file.fileno(), 0o600)
        text = file.read(1024).strip()
    if not TOKEN_SHAPE.fullmatch(text):
        raise WebTokenError(f"{path} does not hold a token (32 or more letters, digits, - or _); "
                            "delete it and a new one is made at the next start")
    return text


def link(host: str, port: int, token: str) -> str:
    """The page's address with the token, for the person to open (a wildcard address is
    opened as 127.0.0.1)."""
    shown = "127.0.0.1" if host in WILDCARD_HOSTS else host
    if ":" in shown:
        shown = f"[{shown}]"
    return f"http://{shown}:{port}/?token={quote(token, safe='')}"


@functools.lru_cache(maxsize=8)  # asked on every request; the token rarely changes
def cookie_name(token: str) -> str:
    """The cookie a signed-in page carries. Named after the token, so gateways of one data
    dir (one token) share it and gateways of other installs on this machine (cookies do
    not tell ports apart) keep theirs."""
    return "gateway_web_" + hmac.new(token.encode(), b"cookie name", hashlib.sha256).hexdigest()[:12]


@functools.lru_cache(maxsize=8)
def cookie_value(token: str) -> str:
    """What the cookie holds: derived from the token (the token itself stays out of the
    browser's cookie store); it changes when the token does."""
    return hmac.new(token.encode(), b"web page cookie", hashlib.sha256).hexdigest()
