"""Confinement of paths to a scope's workspace: tool arguments are untrusted (SPEC §9)."""

from __future__ import annotations

import os
from pathlib import Path


class PathNotAllowed(ValueError):
    """A path that leaves the workspace (traversal, absolute path, symlink)."""


def resolve_in_workspace(root: Path, relative: str) -> Path:
    """Resolve `relative` inside `root`, following symlinks, and refuse anything outside."""
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
