"""`web_fetch(url)`: a web page as readable text (SPEC §5.2).

HTML becomes Markdown through trafilatura (the article, not menus and scripts), PDFs
become text through pypdf, plain text and JSON come as they are. Both extractors run in a
child process under CPU, memory and time limits (gateway.parsing, SPEC §9): a page built
to keep them busy costs one bounded process, never the gateway's threads. Every hop
(redirects are followed here, one by one) goes through the guard in `gateway.tools.ssrf`.
The body is read up to `max_bytes` and the whole fetch is bounded by `timeout_s`. A long
result is cut by stage 1 like any tool result (§4.1).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import aiohttp
from yarl import URL

from gateway.config.schema import WebFetchConfig
from gateway.parsing.html_text import decode_text
from gateway.parsing.jobs import ParseError
from gateway.parsing.readers import read_html, read_pdf
from gateway.tools.base import ToolArgumentError, ToolContext, ToolError, ToolOutput, check_arguments, shown
from gateway.tools.ssrf import PinnedResolver, checked_addresses

log = logging.getLogger("gateway.tools.web_fetch")

MAX_URL_CHARS = 8192
MAX_REDIRECTS = 5
READ_CHUNK = 64 * 1024
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
# The agent gives a tool 60 s (gateway.turns.agent.TOOL_TIMEOUT_S): reading a page ends
# before that, with its own error, whatever the fetch took (READ_MIN_S at least).
TOOL_WINDOW_S = 57.0
READ_MIN_S = 5.0
USER_AGENT = "Mozilla/5.0 (compatible; chat-gateway web_fetch)"
ACCEPT = "text/html,application/xhtml+xml,application/pdf;q=0.9,text/plain;q=0.9,application/json;q=0.9,*/*;q=0.1"

HTML_TYPES = frozenset({"text/html", "application/xhtml+xml"})
TEXT_TYPES = frozenset({"text/plain", "text/markdown", "text/csv", "application/json", "text/json"})
UNTYPED = frozenset({"", "application/octet-stream", "binary/octet-stream"})  # decided by the first bytes


@dataclass(frozen=True, slots=True)
class Page:
    url: URL  # after redirects
    kind: str  # html | pdf | text
    body: bytes
    charset: str | None
    cut: bool  # the body was longer than max_bytes


def _kind_of(mime: str) -> str | None:
    if mime in HTML_TYPES:
        return "html"
    if mime == "application/pdf":
        return "pdf"
    if mime in TEXT_TYPES or mime.endswith("+json"):
        return "text"
    return None


def _sniff(head: bytes) -> str | None:
    start = head.lstrip()[:256].lower()
    if start.startswith(b"%pdf-"):
        return "pdf"
    if start.startswith((b"<!doctype html", b"<html")):
        return "html"
    return None


def _target(url: URL, via: str) -> tuple[str, int]:
    """The host and port of `url` if web_fetch may try it at all (the scheme and the shape;
    the addresses are the guard's job)."""
    if not url.scheme:
        raise ToolArgumentError(f"{shown(str(url))} is not a full URL{via}; start it with https:// or http://")
    if url.scheme not in ("http", "https"):
        raise ToolError(f"refused: only http:// and https:// URLs can be fetched{via}, not {url.scheme}:")
    if not url.raw_host:
        raise ToolError(f"{shown(str(url))} has no host name{via}")
    port = url.port
    if port is None:
        raise ToolError(f"{shown(str(url))} has no usable port{via}")
    return url.raw_host, port


async def _read(response: aiohttp.ClientResponse, limit: int) -> tuple[bytes, bool]:
    """At most `limit` bytes of the body; True when there was more (the rest is never read)."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.content.iter_chunked(READ_CHUNK):
        room = limit - size
        if len(chunk) > room:
            chunks.append(chunk[:room])
            return b"".join(chunks), True
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks), False


async def fetch(url: URL, cfg: WebFetchConfig) -> Page:
    """GET `url`, following redirects by hand so the guard sees every hop."""
    resolver = PinnedResolver()
    connector = aiohttp.TCPConnector(resolver=resolver, use_dns_cache=False, limit=4)
    headers = {"User-Agent": USER_AGENT, "Accept": ACCEPT}
    async with aiohttp.ClientSession(connector=connector, headers=headers, trust_env=False) as http:
        current, via = url, ""
        for _hop in range(MAX_REDIRECTS + 1):
            host, port = _target(current, via)
            resolver.pin(host, await checked_addresses(host, port, allow_private=cfg.allow_private_networks))
            async with http.get(current, allow_redirects=False) as response:
                if response.status in REDIRECT_STATUSES:
                    location = response.headers.get("Location")
                    if not location:
                        raise ToolError(f"{current} answered {response.status} without a Location to go to")
                    try:
                        current = current.join(URL(location))
                    except ValueError:
                        raise ToolError(f"{current} redirected to an invalid URL {shown(location)}") from None
                    via = f" (redirected from {url})"
                    continue
                if response.status >= 400:
                    raise ToolError(f"{current} answered HTTP {response.status} {response.reason or ''}".rstrip())
                if response.status != 200:
                    raise ToolError(f"{current} answered HTTP {response.status}, which is not a page")
                return await _page(current, response, cfg)
        raise ToolError(f"too many redirects (more than {MAX_REDIRECTS}) from {url}")


async def _page(url: URL, response: aiohttp.ClientResponse, cfg: WebFetchConfig) -> Page:
    header = response.headers.get("Content-Type", "")
    mime = header.split(";", 1)[0].strip().lower()
    kind = _kind_of(mime)
    if kind is None and mime not in UNTYPED:
        raise ToolError(f"refused: {url} is {mime}; web_fetch reads HTML, PDF, plain text and JSON")
    if kind == "pdf" and (response.content_length or 0) > cfg.max_bytes:
        raise ToolError(_pdf_too_big(response.content_length or 0, cfg))
    body, cut = await _read(response, cfg.max_bytes)
    if kind is None:
        kind = _sniff(body[:1024])
        if kind is None:
            raise ToolError(f"refused: {url} has no recognisable type ({mime or 'no Content-Type'}); "
                            "web_fetch reads HTML, PDF, plain text and JSON")
    if kind == "pdf" and cut:
        raise ToolError(_pdf_too_big(None, cfg))
    return Page(url=url, kind=kind, body=body, charset=response.charset, cut=cut)


def _pdf_too_big(size: int | None, cfg: WebFetchConfig) -> str:
    what = f"{size:,} bytes" if size else "larger"
    return (f"the PDF is {what}, over tools.web_fetch.max_bytes ({cfg.max_bytes:,} bytes); "
            "a PDF cannot be read in part")


async def render(page: Page, within_s: float | None = None) -> tuple[str | None, str]:
    """(title, text) of a fetched page; HTML and PDFs are read by a bounded child process."""
    try:
        if page.kind == "html":
            return await read_html(page.body, page.charset, within_s=within_s)
        if page.kind == "pdf":
            title, pages = await read_pdf(data=page.body, within_s=within_s)
            return title, "\n\n".join(p for p in pages if p)
    except ParseError as err:
        raise ToolError(str(err)) from None
    return None, decode_text(page.body, page.charset)


class WebFetch:
    name = "web_fetch"
    description = (
        "Fetch a web page by URL (http or https) and read it as text: HTML as Markdown (the main "
        "content, without menus and scripts), PDFs as text, plain text and JSON as they are. Long "
        "pages are cut with a notice that gives the read_file call to continue."
    )
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {"url": {"type": "string", "description": "the page's full http:// or https:// URL"}},
        "required": ["url"],
        "additionalProperties": False,
    }

    def status(self, args: dict[str, Any]) -> str:
        host = URL(str(args.get("url", ""))).host
        return f"fetching {host}…" if host else "fetching a web page…"

    async def run(self, args: dict[str, Any], ctx: ToolContext) -> ToolOutput:
        check_arguments(self.parameters, args)
        cfg = ctx.config.tools.web_fetch
        if not cfg.enabled:
            raise ToolError("web_fetch is switched off (tools.web_fetch.enabled is false)")
        text: str = args["url"].strip()
        if len(text) > MAX_URL_CHARS:
            raise ToolArgumentError(f"the URL is {len(text):,} characters long; at most {MAX_URL_CHARS:,}")
        try:
            url = URL(text)
        except (ValueError, TypeError):
            raise ToolArgumentError(f"{shown(text)} is not a URL; give a full http:// or https:// URL") from None
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            async with asyncio.timeout(cfg.timeout_s):
                page = await fetch(url, cfg)
        except TimeoutError:
            raise ToolError(f"{url} did not answer within {cfg.timeout_s:g} s (tools.web_fetch.timeout_s)") from None
        except aiohttp.ClientError as err:
            raise ToolError(f"cannot fetch {url}: {type(err).__name__}: {str(err)[:300]}") from None
        title, content = await render(page, within_s=max(READ_MIN_S, TOOL_WINDOW_S - (loop.time() - started)))
        lines = [f"Title: {title}" if title else None, f"URL: {page.url}"]
        if page.url != url:
            lines.append(f"(redirected from {url})")
        if page.cut:
            lines.append(f"(only the first {ctx.config.tools.web_fetch.max_bytes:,} bytes were read: "
                         "tools.web_fetch.max_bytes)")
        head = "\n".join(line for line in lines if line)
        return ToolOutput(f"{head}\n\n{content or '(no readable text on this page)'}", source=f"web page {page.url}")
