"""The proxy the environment chooses for a URL, as httpx and the openai SDK honour it
(HTTPS_PROXY / HTTP_PROXY / NO_PROXY, and .netrc for its credentials).

It reads the environment and files: call it once, off the event loop (aiohttp's own
`trust_env` would look it up in a worker thread on every request)."""

from __future__ import annotations

import aiohttp
from aiohttp.helpers import get_env_proxy_for_url
from yarl import URL


def env_proxy(url: URL) -> tuple[URL | None, aiohttp.BasicAuth | None]:
    try:
        return get_env_proxy_for_url(url)
    except LookupError:  # no proxy for this URL
        return None, None
