"""The web tools as a `ToolSource` that follows the running config: `web_fetch` while
`tools.web_fetch.enabled`, `web_search` while `tools.web_search.provider` is set. A reload
that switches one on or off changes the tool list from the next decision step; their
other settings are read from each step's snapshot when they run."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gateway.config.schema import Config
from gateway.tools.base import Tool
from gateway.tools.web_fetch import WebFetch
from gateway.tools.web_search import WebSearch


class WebTools:
    name = "web"

    def __init__(self, config: Callable[[], Config]) -> None:
        self._config = config
        self._fetch = WebFetch()
        self._search = WebSearch()
        self._shape: tuple[bool, bool] | None = None
        self._tools: list[Tool] = []
        self._version = 0

    @property
    def version(self) -> int:
        cfg = self._config().tools
        shape = (cfg.web_fetch.enabled, cfg.web_search.provider is not None)
        if shape != self._shape:
            self._shape = shape
            # The same objects in the same order each time: a tool that comes back keeps its place.
            self._tools = [t for t, on in ((self._fetch, shape[0]), (self._search, shape[1])) if on]
            self._version += 1
        return self._version

    def tools(self) -> Sequence[Tool]:
        _ = self.version  # brought up to date with the config, also when asked first
        return list(self._tools)
