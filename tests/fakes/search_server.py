"""Local stand-ins for the three web search APIs, on one server:

- SearXNG: `GET /search?q=…&format=json` (403 unless JSON output is enabled, as a stock
  SearXNG answers; `q` required).
- Brave Search: `GET /res/v1/web/search?q=…&count=…` with `X-Subscription-Token`
  (401 for a wrong token; `count` 1-20, `q` at most 400 characters and 50 words, else 422).
- Tavily: `POST /search` with `Authorization: Bearer <key>` and a JSON body `{query,
  max_results}` (401 without the key; `max_results` 0-20, else 400).

Results come from `results` (title, url, snippet), in that order. Binds 127.0.0.1 only.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest_asyncio
from aiohttp import web

BRAVE_MAX_COUNT = 20
BRAVE_MAX_QUERY_CHARS = 400
BRAVE_MAX_QUERY_WORDS = 50
TAVILY_MAX_RESULTS = 20


@dataclass
class Hit:
    title: str
    url: str
    snippet: str


@dataclass
class FakeSearch:
    brave_token: str = "brave-test-key"
    tavily_key: str = "tvly-test-key"
    json_enabled: bool = True  # SearXNG's search.formats includes json
    results: list[Hit] = field(default_factory=lambda: [
        Hit(f"Result {i}", f"https://example.org/{i}", f"snippet number {i}") for i in range(1, 31)])
    requests: list[dict[str, Any]] = field(default_factory=list)  # provider, method, query, headers, body
    base_url: str = ""
    _runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/search", self._searxng)
        app.router.add_post("/search", self._tavily)
        app.router.add_get("/res/v1/web/search", self._brave)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.base_url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _record(self, provider: str, request: web.Request, body: Any = None) -> None:
        self.requests.append({"provider": provider, "method": request.method, "query": dict(request.query),
                              "headers": dict(request.headers), "body": body})

    async def _searxng(self, request: web.Request) -> web.Response:
        self._record("searxng", request)
        if request.query.get("format") == "json" and not self.json_enabled:
            return web.Response(status=403, text="403 Forbidden")
        query = request.query.get("q", "")
        if not query:
            return web.Response(status=400, text="q is required")
        results = [{"title": h.title, "url": h.url, "content": h.snippet, "engine": "fake"} for h in self.results]
        return web.json_response({"query": query, "number_of_results": len(results), "results": results})

    async def _brave(self, request: web.Request) -> web.Response:
        self._record("brave", request)
        if request.headers.get("X-Subscription-Token") != self.brave_token:
            return web.json_response({"type": "ErrorResponse", "error": {
                "status": 401, "code": "SUBSCRIPTION_TOKEN_INVALID",
                "detail": "The provided subscription token is invalid."}}, status=401)
        query = request.query.get("q", "")
        try:
            count = int(request.query.get("count", "20"))
        except ValueError:
            count = -1
        if (not query or len(query) > BRAVE_MAX_QUERY_CHARS or len(query.split()) > BRAVE_MAX_QUERY_WORDS
                or not 1 <= count <= BRAVE_MAX_COUNT):
            return web.json_response({"type": "ErrorResponse", "error": {
                "status": 422, "code": "VALIDATION", "detail": "Unable to validate request parameter(s)"}},
                status=422)
        results = [{"title": h.title, "url": h.url, "description": f"<strong>{h.snippet}</strong> &amp; more"}
                   for h in self.results[:count]]
        return web.json_response({"type": "search", "query": {"original": query}, "web": {"results": results}})

    async def _tavily(self, request: web.Request) -> web.Response:
        try:
            body = json.loads(await request.read())
        except ValueError:
            body = None
        self._record("tavily", request, body)
        if request.headers.get("Authorization") != f"Bearer {self.tavily_key}":
            return web.json_response({"detail": {"error": "Unauthorized: missing or invalid API key."}}, status=401)
        if not isinstance(body, dict) or not body.get("query"):
            return web.json_response({"detail": {"error": "query is required"}}, status=400)
        count = body.get("max_results", 5)
        if not isinstance(count, int) or not 0 <= count <= TAVILY_MAX_RESULTS:
            return web.json_response({"detail": {"error": "max_results must be between 0 and 20"}}, status=400)
        results = [{"title": h.title, "url": h.url, "content": h.snippet, "score": 0.9} for h in self.results[:count]]
        return web.json_response({"query": body["query"], "results": results, "response_time": 0.1})


@pytest_asyncio.fixture
async def fake_search() -> AsyncIterator[FakeSearch]:
    server = FakeSearch()
    await server.start()
    yield server
    await server.stop()
