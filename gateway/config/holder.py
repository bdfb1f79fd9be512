"""The running config: one immutable snapshot, replaced whole on reload, with where it came from."""

from __future__ import annotations

from pathlib import Path

from gateway.config.schema import Config


class ConfigHolder:
    """The running config snapshot; replaced whole on reload, never mutated."""

    def __init__(self, config: Config, path: Path | None, base_dir: Path) -> None:
        self.current = config
        self.path = path
        self.base_dir = base_dir.absolute()
        # Fixed at start: data_dir is a restart-only key, so a reload never splits the data
        # between the old directory (the open database) and a new one.
        self.data_dir = config.data_path(self.base_dir)
        self.version = 1

    def snapshot(self) -> Config:
        """The running snapshot, for parts that read it per use (a `Callable[[], Config]`)."""
        return self.current

    def swap(self, config: Config) -> None:
        self.current = config
        self.version += 1
