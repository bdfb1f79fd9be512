"""Paths confined to a directory: tool arguments are untrusted (SPEC §9); private modes
for the data dir, workspaces and database files.

A scope's workspace is written by its sandboxes while the gateway uses it, so every access
to it goes through gateway.beneath (opened relative to a descriptor, no link followed).
`resolve_in_workspace` is for trees no sandbox writes (the skills' folders)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from gateway.beneath import PathNotAllowed

__all__ = ["PathNotAllowed", "make_private_dir", "resolve_in_workspace", "restrict_mode"]

log = logging.getLogger("gateway.workspace")


def resolve_in_workspace(root: Path, relative: str) -> Path:
    """Resolve `relative` inside `root`, following symlinks, and refuse anything outside.
    Checked, then used by name: only for a tree nothing else changes meanwhile (a skill's
    folder), never a scope's workspace (gateway.beneath)."""
    if not isinstance(relative, str) or not relative.strip():
        raise PathNotAllowed("a path inside the workspace is required")
    if "\x00" in relative:
        raise PathNotAllowed("the path contains a NUL character")
    candidate = Path(relative)
    if candidate.is_absolute():
        raise PathNotAllowed("absolute paths are not allowed; use a path relative to the workspace")
    root_real = Path(os.path.realpath(root))
    target = Path(os.path.realpath(root_real / candidate))
    if target != root_real and root_real not in target.parents:
        raise PathNotAllowed(f"{relative!r} is outside the workspace")
    return target


def make_private_dir(path: Path) -> None:
    """`mkdir -p` where every directory it creates is 0700 (mkdir's mode only loses bits
    to the umask, it never gains any; `parents=True` would make the parents 0777 & ~umask).
    An existing `path` loses group and other permissions (an adapter may have made it)."""
    missing: list[Path] = []
    current = path
    while not current.exists() and current != current.parent:
        missing.append(current)
        current = current.parent
    for directory in reversed(missing):
        directory.mkdir(mode=0o700, exist_ok=True)
    if not missing:
        restrict_mode(path)


def restrict_mode(path: Path) -> None:
    """Take group and other permissions away from an existing file or directory (never
    adds any: a read-only database stays read-only). Missing paths are left alone."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    if mode & 0o077:
        try:
            os.chmod(path, mode & 0o700)
        except OSError as err:  # not the owner: say so, the gateway still works
            log.warning("cannot make %s private: %s", path, err.strerror or err)
