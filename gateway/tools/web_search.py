"""`web_search(query, count)`: title, URL and snippet per result from the configured
provider (SPEC §5.2): a SearXNG server, Brave Search or Tavily.

The provider is the operator's choice (`tools.web_search.*`), so the web_fetch guard does
not apply to it: a SearXNG server on the LAN is the usual setup. Its requests honour the
environment's proxy like the model client's.
"""

from __future__ import annotations

import asyncio
import html
import json
import re
from dataclasses import dataclass
from typing import Any

import aiohttp
from yarl import URL

from gateway.config.schema import WebSearchConfig, secret_text
from gateway.http.proxy import env_proxy
from gateway.tools.base import ToolArgumentError, ToolContext, ToolError, ToolOutput, check_arguments

DEFAULT_BASE_URLS = {"brave": "https://api.search.brave.com", "tavily": "https://api.tavily.com"}
PROVIDER_NAMES = {"searxng": "SearXNG", "brave": "Brave Search", "tavily": "Tavily"}
DEFAULT_COUNT = 5
MAX_COUNT = 10
MAX_QUERY_CHARS = 400  # Brave's limit, and far beyond a useful query elsewhere
SEARCH_TIMEOUT_S = 20.0
MAX_ANSWER_BYTES = 2_000_000
MAX_SNIPPET_CHARS = 500
_TAG = re.compile(r"<[^>]{0,200}>")  # Brave marks matches with <strong>; snippets are text


@dataclass(frozen=True, slots=True)
class Result:
    title: str
    url: str
    snippet: str


class SearchFailed(ToolError):
    pass


def _clean(text: Any, limit: int = MAX_SNIPPET_CHARS) -> str:
    plain = " ".join(html.unescape(_TAG.sub("", str(text or ""))).split())
    return plain if len(plain) <= limit else plain[: limit - 1].rstrip() + "…"


def _endpoint(cfg: WebSearchConfig) -> URL:
    provider = cfg.provider or ""
    base = (cfg.base_url or DEFAULT_BASE_URLS.get(provider) or "").rstrip("/")
    path = "/res/v1/web/search" if provider == "brave" else "/search"
    return URL(base + path)


def _problem(provider: str, status: int, body: bytes) -> str:
    """The provider's own words for a failed request, short."""
    name = PROVIDER_NAMES[provider]
    detail = ""
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if isinstance(data, dict):
        error = data.get("error") if "error" in data else data.get("detail")
        if isinstance(error, dict):
            error = error.get("detail") or error.get("error") or error.get("message") or error.get("code")
        detail = str(error or data.get("message") or "")
    elif body:
        detail = body.decode("utf-8", errors="replace")
    detail = _clean(detail, 200)
    if provider == "searxng" and status == 403:
        detail = "the server does not allow JSON results: add json to search.formats in its settings.yml"
    elif status in (401, 403):
        detail = f"the API key was refused (tools.web_search.api_key){': ' + detail if detail else ''}"
    elif status == 429:
        detail = f"rate limited, try again later{': ' + detail if detail else ''}"
    return f"{name} answered HTTP {status}" + (f": {detail}" if detail else "")


def _results(provider: str, data: Any) -> list[Result]:
    if not isinstance(data, dict):
        raise SearchFailed(f"{PROVIDER_NAMES[provider]} sent an answer that is not a JSON object")
    if provider == "brave":
        web = data.get("web")
        items = web.get("results") if isinstance(web, dict) else []
        snippet_key = "description"
    else:
        items = data.get("results")
        snippet_key = "content"
    if not isinstance(items, list):
        raise SearchFailed(f"{PROVIDER_NAMES[provider]} sent no result list")
    out: list[Result] = []
    for item in items:
        if isinstance(item, dict) and item.get("url"):
            out.append(Result(title=_clean(item.get("title"), 200) or "(no title)", url=str(item["url"]),
                              snippet=_clean(item.get(snippet_key))))
    return out


async def _read_all(response: aiohttp.ClientResponse, name: str) -> bytes:
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.content.iter_chunked(64 * 1024):
        size += len(chunk)
        if size > MAX_ANSWER_BYTES:
            raise SearchFailed(f"{name} sent an answer larger than {MAX_ANSWER_BYTES:,} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def search(cfg: WebSearchConfig, query: str, count: int) -> list[Result]:
    provider = cfg.provider
    if provider is None:
        raise ToolError("web search is not configured (tools.web_search.provider is not set)")
    endpoint = _endpoint(cfg)
    key = secret_text(cfg.api_key)
    if provider != "searxng" and key is None:
        raise ToolError(f"tools.web_search.api_key is not set; {PROVIDER_NAMES[provider]} needs it")
    headers = {"Accept": "application/json"}
    params: dict[str, str] = {}
    body: dict[str, Any] | None = None
    if provider == "searxng":
        params = {"q": query, "format": "json", "pageno": "1"}
    elif provider == "brave":
        params = {"q": query, "count": str(count)}
        headers["X-Subscription-Token"] = key or ""
    else:
        body = {"query": query, "max_results": count}
        headers["Authorization"] = f"Bearer {key}"
    proxy, proxy_auth = await asyncio.to_thread(env_proxy, endpoint)  # reads the environment and .netrc
    timeout = aiohttp.ClientTimeout(total=SEARCH_TIMEOUT_S)
    name = PROVIDER_NAMES[provider]
    try:
        async with aiohttp.ClientSession(timeout=timeout) as http, http.request(
                "POST" if body is not None else "GET", endpoint, params=params or None, json=body,
                headers=headers, proxy=proxy, proxy_auth=proxy_auth, allow_redirects=False) as response:
            if 300 <= response.status < 400:  # not followed: the key must not travel to another address
                raise SearchFailed(f"{name} answered HTTP {response.status}, a redirect to "
                                   f"{response.headers.get('Location', '(nowhere)')}: set tools.web_search.base_url "
                                   "to the address it points to")
            raw = await _read_all(response, name)
            if response.status != 200:
                raise SearchFailed(_problem(provider, response.status, raw))
    except TimeoutError:
        raise SearchFailed(f"{name} did not answer within {SEARCH_TIMEOUT_S:g} s") from None
    except aiohttp.ClientError as err:
        raise SearchFailed(f"cannot reach {name} at {endpoint.origin()}: {type(err).__name__}: "
                           f"{str(err)[:200]}") from None
    try:
        data = json.loads(raw)
    except ValueError:
        raise SearchFailed(f"{name} sent an answer that is not JSON") from None
    return _results(provider, data)[:count]


def format_results(query: str, results: list[Result]) -> str:
    if not results:
        return f"No results for {query!r}."
    blocks = []
    for number, result in enumerate(results, 1):
        lines = [f"{number}. {result.title}", f"   {result.url}"]
        if result.snippet:
            lines.append(f"   {result.snippet}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


class WebSearch:
    name = "web_search"
    description = (
        "Search the web. Returns a numbered list of results, each with title, URL and snippet; "
        "read a result in full with web_fetch."
    )
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {
            "query": {"type": "string", "description": "what to search for"},
            "count": {"type": "integer", "minimum": 1, "maximum": MAX_COUNT,
                      "description": f"how many results (default {DEFAULT_COUNT})"},
        },
        "required": ["query"],
        "additionalProperties": False,
    }

    def status(self, args: dict[str, Any]) -> str:
        query = " ".join(str(args.get("query", "")).split())
        if not query:
            return "searching the web…"
        return f"searching the web for “{query if len(query) <= 60 else query[:59] + '…'}”…"

    async def run(self, args: dict[str, Any], ctx: ToolContext) -> ToolOutput:
        check_arguments(self.parameters, args)
        query = " ".join(str(args["query"]).split())
        if not query:
            raise ToolArgumentError("the query is empty; say what to search for")
        if len(query) > MAX_QUERY_CHARS:
            raise ToolArgumentError(f"the query is {len(query):,} characters long; at most {MAX_QUERY_CHARS}")
        count = int(args.get("count") or DEFAULT_COUNT)
        results = await search(ctx.config.tools.web_search, query, count)
        return ToolOutput(format_results(query, results), source=f"web search results for {query!r}")
