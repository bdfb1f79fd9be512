"""web_fetch and web_search (SPEC §5.2, §9): real aiohttp, trafilatura and pypdf against
local servers (tests/fakes/web_server.py, tests/fakes/search_server.py); the SSRF guard's
refusals never reach the network (they are decided before any connection)."""

from __future__ import annotations

import ipaddress
import re
import time
from pathlib import Path
from typing import Any

import pytest

from context.outside import unfence
from gateway.app import secret_values
from gateway.config.checks import startup_problems
from gateway.config.load import ConfigError, parse_config
from gateway.keys import workspace_dir
from gateway.tools import ssrf
from gateway.tools.base import ToolContext, ToolError, status_line
from gateway.tools.current_time import CurrentTime
from gateway.tools.web import WebTools
from gateway.tools.web_fetch import WebFetch
from gateway.tools.web_search import WebSearch
from tests.conftest import GatewayFactory, chat
from tests.fakes import search_server, web_server
from tests.fakes.media_files import make_pdf
from tests.fakes.openai_server import FakeModel
from tests.fakes.search_server import FakeSearch
from tests.fakes.web_server import ENDLESS_CAP, FakeWeb

fake_web = web_server.fake_web  # the fixtures
fake_search = search_server.fake_search

ALLOW = "(tools.web_fetch.allow_private_networks is false)"

ARTICLE = """<!doctype html>
<html><head><title>Otters | The Daily Example</title>
<style>.x { color: red } STYLEJUNK</style>
<script>var tracking = "SCRIPTJUNK";</script></head>
<body>
<nav><a href="/">Home</a> <a href="/about">NAVJUNK About us</a> <a href="/contact">Contact</a></nav>
<main><article>
<h1>Sea otters use tools</h1>
<p>Sea otters are among the few mammals that use tools: they crack shellfish open with stones
they carry in a pouch of loose skin under their forelimbs, a habit researchers have followed for decades.</p>
<p>Young otters learn the technique from their mothers, and <b>some families</b> prefer particular
stones for years; see <a href="https://example.org/otter-study">the long-term study</a> for details.</p>
<ul><li>Stones as anvils</li><li>Stones as hammers</li></ul>
</article></main>
<footer>FOOTERJUNK Copyright the Daily Example, all rights reserved.</footer>
</body></html>"""


def context(tmp_path: Path, **tools: Any) -> ToolContext:
    cfg = parse_config({"tools": tools}, environ={})
    return ToolContext(session_key="web:dm:t", scope="web:t", workspace=tmp_path, config=cfg)


async def fetch(tmp_path: Path, url: str, **settings: Any) -> str:
    settings.setdefault("allow_private_networks", True)
    out = await WebFetch().run({"url": url}, context(tmp_path, web_fetch=settings))
    return out.text


async def refused(tmp_path: Path, url: str, **settings: Any) -> str:
    with pytest.raises(ToolError) as caught:
        await fetch(tmp_path, url, **settings)
    return str(caught.value)


# -- web_fetch: reading pages ----------------------------------------------------------------


async def test_html_becomes_markdown_of_the_article(fake_web: FakeWeb, tmp_path: Path) -> None:
    url = fake_web.page("/otters", ARTICLE)
    text = await fetch(tmp_path, url)
    head, _, body = text.partition("\n\n")
    assert head == f"Title: Sea otters use tools\nURL: {url}"
    assert "crack shellfish open with stones" in body and "Young otters learn the technique" in body
    assert "**some families**" in body and "[the long-term study](https://example.org/otter-study)" in body
    assert "- Stones as anvils" in body
    for junk in ("NAVJUNK", "SCRIPTJUNK", "STYLEJUNK", "FOOTERJUNK", "tracking", "<p>"):
        assert junk not in text, junk
    assert fake_web.seen[0].headers["User-Agent"].startswith("Mozilla/5.0 (compatible; chat-gateway")


async def test_html_in_a_declared_legacy_charset(fake_web: FakeWeb, tmp_path: Path) -> None:
    page = ARTICLE.replace("Sea otters are among", "Café owners say sea otters are among")
    url = fake_web.page("/latin1", page.encode("cp1252"), content_type="text/html; charset=windows-1252")
    assert "Café owners say" in await fetch(tmp_path, url)


async def test_pdf_becomes_text(fake_web: FakeWeb, tmp_path: Path) -> None:
    pdf = make_pdf(["Quarterly report of the otter society", "Stones collected: 1234"], "Otter Report")
    url = fake_web.page("/report.pdf", pdf, content_type="application/pdf")
    text = await fetch(tmp_path, url)
    assert text.startswith(f"Title: Otter Report\nURL: {url}\n\n")
    assert "Quarterly report of the otter society" in text and "Stones collected: 1234" in text
    # Without a usable Content-Type the first bytes decide.
    untyped = fake_web.page("/download", pdf, content_type="application/octet-stream")
    assert "Stones collected: 1234" in await fetch(tmp_path, untyped)


async def test_text_and_json_come_as_they_are(fake_web: FakeWeb, tmp_path: Path) -> None:
    plain = fake_web.page("/notes.txt", "line one\n  <b>not html</b>\n", content_type="text/plain; charset=utf-8")
    assert await fetch(tmp_path, plain) == f"URL: {plain}\n\nline one\n  <b>not html</b>\n"
    data = fake_web.page("/api", '{"otters": [1, 2]}', content_type="application/json")
    assert (await fetch(tmp_path, data)).endswith('\n\n{"otters": [1, 2]}')


async def test_other_types_and_http_errors_are_refused_clearly(fake_web: FakeWeb, tmp_path: Path) -> None:
    image = fake_web.page("/cat.png", b"\x89PNG\r\n\x1a\n....", content_type="image/png")
    assert "is image/png; web_fetch reads HTML, PDF, plain text and JSON" in await refused(tmp_path, image)
    blob = fake_web.page("/blob", b"\x00\x01\x02 binary", content_type="application/octet-stream")
    assert "no recognisable type" in await refused(tmp_path, blob)
    assert f"{fake_web.base_url}/missing answered HTTP 404 Not Found" in await refused(
        tmp_path, fake_web.base_url + "/missing")


async def test_the_body_is_read_only_up_to_max_bytes(fake_web: FakeWeb, tmp_path: Path) -> None:
    url = fake_web.page("/endless", "0123456789abcdef", content_type="text/plain", endless=True)
    started = time.monotonic()
    text = await fetch(tmp_path, url, max_bytes=100_000)
    assert time.monotonic() - started < 5
    head, _, body = text.partition("\n\n")
    assert "only the first 100,000 bytes were read: tools.web_fetch.max_bytes" in head
    assert len(body) == 100_000 and body.startswith("0123456789abcdef")
    # web_fetch hung up: the server could not send its 64 MB.
    assert fake_web.sent_bytes["/endless"] < ENDLESS_CAP // 2
    pdf = fake_web.page("/huge.pdf", b"%PDF-1.4 " * 10, content_type="application/pdf", endless=True)
    assert "a PDF cannot be read in part" in await refused(tmp_path, pdf, max_bytes=10_000)


async def test_a_slow_site_times_out(fake_web: FakeWeb, tmp_path: Path) -> None:
    url = fake_web.page("/slow", ARTICLE, delay=5)
    started = time.monotonic()
    message = await refused(tmp_path, url, timeout_s=0.3)
    assert time.monotonic() - started < 2
    assert message == f"{url} did not answer within 0.3 s (tools.web_fetch.timeout_s)"


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://127.0.0.1/pub", "javascript:alert(1)",
                                 "gopher://127.0.0.1:70/1"])
async def test_only_http_and_https_are_fetched(tmp_path: Path, url: str) -> None:
    assert "refused: only http:// and https:// URLs can be fetched, not" in await refused(tmp_path, url)


async def test_a_url_without_a_scheme_is_a_bad_argument(tmp_path: Path) -> None:
    assert "not a full URL; start it with https://" in await refused(tmp_path, "example.com/page")


async def test_redirects_are_followed_and_bounded(fake_web: FakeWeb, tmp_path: Path) -> None:
    start = fake_web.redirect("/old", "/new")
    new = fake_web.page("/new", "moved here", content_type="text/plain")
    assert await fetch(tmp_path, start) == f"URL: {new}\n(redirected from {start})\n\nmoved here"
    loop = fake_web.redirect("/loop", "/loop", status=301)
    assert "too many redirects (more than 5)" in await refused(tmp_path, loop)
    assert fake_web.paths().count("/loop") == 6


# -- web_fetch: the guard -------------------------------------------------------------------


@pytest.mark.parametrize(("url", "says"), [
    ("http://127.0.0.1:{port}/otters", "refused: 127.0.0.1 is a loopback address"),
    ("http://10.0.0.1/", "refused: 10.0.0.1 is a private address"),
    ("http://192.168.1.1/admin", "refused: 192.168.1.1 is a private address"),
    ("http://169.254.169.254/latest/meta-data/", "refused: 169.254.169.254 is a link-local address"),
    ("http://[::1]:{port}/otters", "refused: ::1 is a loopback address"),
    ("http://[::ffff:127.0.0.1]:{port}/otters", "refused: ::ffff:7f00:1 is a loopback address (IPv4-mapped 127.0.0.1)"),
    ("http://[fd00::1]/", "refused: fd00::1 is a private address"),
    ("http://0.0.0.0:{port}/otters", "refused: 0.0.0.0 is an unspecified address"),
    ("http://[2002:7f00:1::]/", "refused: 2002:7f00:1:: is a loopback address (6to4 127.0.0.1)"),
    ("http://100.100.100.200/latest/meta-data/", "refused: 100.100.100.200 is a non-public address"),
    ("http://localhost:{port}/otters", "refused: localhost resolves to"),
    ("http://2130706433:{port}/otters", "refused: 2130706433 resolves to 127.0.0.1, which is a loopback address"),
])
async def test_private_addresses_are_refused(fake_web: FakeWeb, tmp_path: Path, url: str, says: str) -> None:
    fake_web.page("/otters", ARTICLE)
    message = await refused(tmp_path, url.format(port=fake_web.port), allow_private_networks=False)
    assert message.startswith(says) and message.endswith(ALLOW), message
    assert fake_web.seen == []  # refused before any connection


async def test_the_refusal_reads_as_the_brief_says(tmp_path: Path) -> None:
    assert await refused(tmp_path, "http://10.0.0.5/", allow_private_networks=False) == (
        "refused: 10.0.0.5 is a private address (tools.web_fetch.allow_private_networks is false)")


async def test_a_public_looking_name_that_resolves_privately_is_refused(
        fake_web: FakeWeb, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    answers = {"news.example.com": ["127.0.0.1"], "mixed.example.com": ["93.184.215.14", "10.0.0.5"]}

    async def resolve(host: str, port: int) -> list[str]:
        return answers[host]

    monkeypatch.setattr(ssrf, "resolve_host", resolve)
    message = await refused(tmp_path, f"http://news.example.com:{fake_web.port}/", allow_private_networks=False)
    assert message == f"refused: news.example.com resolves to 127.0.0.1, which is a loopback address {ALLOW}"
    # Any one bad address is enough: the client could pick it.
    message = await refused(tmp_path, "https://mixed.example.com/", allow_private_networks=False)
    assert message.startswith("refused: mixed.example.com resolves to 10.0.0.5, which is a private address")
    assert fake_web.seen == []


def allow_only_the_test_site(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard treats 127.0.0.1 (the test site) as public and judges the rest as usual."""
    real = ssrf.address_problem

    def problem(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
        return None if str(address) == "127.0.0.1" else real(address)

    monkeypatch.setattr(ssrf, "address_problem", problem)


@pytest.mark.parametrize(("target", "says"), [
    ("http://169.254.169.254/latest/meta-data/", "refused: 169.254.169.254 is a link-local address"),
    ("http://10.0.0.1:8080/admin", "refused: 10.0.0.1 is a private address"),
    ("http://[::1]/", "refused: ::1 is a loopback address"),
])
async def test_every_redirect_hop_is_checked(fake_web: FakeWeb, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             target: str, says: str) -> None:
    allow_only_the_test_site(monkeypatch)
    fake_web.page("/fine", "the first hop is allowed", content_type="text/plain")
    assert "the first hop is allowed" in await fetch(tmp_path, fake_web.base_url + "/fine",
                                                      allow_private_networks=False)
    start = fake_web.redirect("/start", target)
    message = await refused(tmp_path, start, allow_private_networks=False)
    assert message == f"{says} {ALLOW}"
    assert fake_web.paths() == ["/fine", "/start"]


async def test_a_redirect_to_another_scheme_is_refused(fake_web: FakeWeb, tmp_path: Path) -> None:
    start = fake_web.redirect("/start", "file:///etc/passwd")
    message = await refused(tmp_path, start)
    assert message == f"refused: only http:// and https:// URLs can be fetched (redirected from {start}), not file:"


async def test_the_connection_goes_to_the_checked_address(fake_web: FakeWeb, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """One lookup per hop, by the guard; the client connects to what it checked, never to
    what a second lookup (here: a rebinding answer) would say."""
    allow_only_the_test_site(monkeypatch)
    lookups: list[str] = []

    async def rebinding(host: str, port: int) -> list[str]:
        lookups.append(host)
        return ["127.0.0.1"] if len(lookups) == 1 else ["10.255.255.1"]

    monkeypatch.setattr(ssrf, "resolve_host", rebinding)
    fake_web.page("/otters", ARTICLE)
    # .invalid never resolves (RFC 6761): the page arrives only through the pinned address.
    text = await fetch(tmp_path, f"http://otters.invalid:{fake_web.port}/otters", allow_private_networks=False)
    assert "crack shellfish open with stones" in text
    assert lookups == ["otters.invalid"]
    assert fake_web.seen[0].host == f"otters.invalid:{fake_web.port}"  # the Host header keeps the name
    # The same name on the next fetch: the guard looks it up again and refuses the new answer.
    message = await refused(tmp_path, f"http://otters.invalid:{fake_web.port}/otters", allow_private_networks=False)
    assert message.startswith("refused: otters.invalid resolves to 10.255.255.1, which is a private address")
    assert len(fake_web.seen) == 1


def test_embedded_ipv4_forms_are_judged_by_their_ipv4_address() -> None:
    cases = {
        "::ffff:8.8.8.8": None,
        "64:ff9b::808:808": None,  # NAT64 to a public address: fine
        "64:ff9b::a00:1": "a private address (NAT64 10.0.0.1)",
        "::ffff:169.254.169.254": "a link-local address (IPv4-mapped 169.254.169.254)",
        "2001:0:4136:e378:8000:63bf:3fff:fdd2": "a private address (Teredo client 192.0.2.45)",
        "fe80::1": "a link-local address",
        "ff02::1": "a multicast address",
        "2606:4700:4700::1111": None,
        "93.184.215.14": None,
        "240.0.0.1": "a private address",
        "224.0.0.251": "a multicast address",
    }
    for text, expected in cases.items():
        assert ssrf.address_problem(ipaddress.ip_address(text)) == expected, text


# -- web_search -----------------------------------------------------------------------------


async def search(tmp_path: Path, args: dict[str, Any], **settings: Any) -> str:
    out = await WebSearch().run(args, context(tmp_path, web_search=settings))
    return out.text


async def test_searxng(fake_search: FakeSearch, tmp_path: Path) -> None:
    text = await search(tmp_path, {"query": "sea otters", "count": 3}, provider="searxng",
                        base_url=fake_search.base_url)
    assert text == ("1. Result 1\n   https://example.org/1\n   snippet number 1\n\n"
                    "2. Result 2\n   https://example.org/2\n   snippet number 2\n\n"
                    "3. Result 3\n   https://example.org/3\n   snippet number 3")
    sent = fake_search.requests[-1]
    assert sent["provider"] == "searxng" and sent["query"]["q"] == "sea otters" and sent["query"]["format"] == "json"
    fake_search.json_enabled = False
    with pytest.raises(ToolError, match=r"SearXNG answered HTTP 403: .*add json to search\.formats"):
        await search(tmp_path, {"query": "otters"}, provider="searxng", base_url=fake_search.base_url)


async def test_brave(fake_search: FakeSearch, tmp_path: Path) -> None:
    text = await search(tmp_path, {"query": "sea otters", "count": 2}, provider="brave",
                        base_url=fake_search.base_url, api_key=fake_search.brave_token)
    assert text == ("1. Result 1\n   https://example.org/1\n   snippet number 1 & more\n\n"
                    "2. Result 2\n   https://example.org/2\n   snippet number 2 & more")
    sent = fake_search.requests[-1]
    assert sent["provider"] == "brave" and sent["query"] == {"q": "sea otters", "count": "2"}
    assert (await search(tmp_path, {"query": "otters"}, provider="brave", base_url=fake_search.base_url,
                            api_key=fake_search.brave_token)).count("\n\n") == 4  # five by default
    with pytest.raises(ToolError) as caught:
        await search(tmp_path, {"query": "otters"}, provider="brave", base_url=fake_search.base_url,
                     api_key="wrong-key")
    assert str(caught.value) == ("Brave Search answered HTTP 401: the API key was refused (tools.web_search.api_key): "
                                 "The provided subscription token is invalid.")
    assert "wrong-key" not in str(caught.value)


async def test_tavily(fake_search: FakeSearch, tmp_path: Path) -> None:
    text = await search(tmp_path, {"query": "sea otters", "count": 10}, provider="tavily",
                        base_url=fake_search.base_url, api_key=fake_search.tavily_key)
    assert text.startswith("1. Result 1\n   https://example.org/1\n   snippet number 1\n\n2. Result 2")
    assert "10. Result 10\n" in text and "11. " not in text
    sent = fake_search.requests[-1]
    assert sent["method"] == "POST" and sent["body"] == {"query": "sea otters", "max_results": 10}
    assert sent["headers"]["Authorization"] == f"Bearer {fake_search.tavily_key}"
    with pytest.raises(ToolError, match=r"^Tavily answered HTTP 401: the API key was refused .*invalid API key"):
        await search(tmp_path, {"query": "otters"}, provider="tavily", base_url=fake_search.base_url,
                     api_key="tvly-wrong")


@pytest.mark.parametrize(("args", "says"), [
    ({"query": "otters", "count": 0}, "count must be 1 or more"),
    ({"query": "otters", "count": 11}, "count must be 10 or less"),
    ({"query": "   "}, "the query is empty"),
    ({"query": "otter " * 100}, "at most 400"),
    ({}, "'query' is required"),
])
async def test_search_arguments_are_bounded(fake_search: FakeSearch, tmp_path: Path, args: dict[str, Any],
                                            says: str) -> None:
    with pytest.raises(ToolError, match=re.escape(says)):
        await search(tmp_path, args, provider="searxng", base_url=fake_search.base_url)
    assert fake_search.requests == []


async def test_an_unreachable_provider_is_a_clear_error(fake_search: FakeSearch, tmp_path: Path) -> None:
    url = fake_search.base_url
    await fake_search.stop()
    with pytest.raises(ToolError, match=f"^cannot reach SearXNG at {re.escape(url)}: Client"):
        await search(tmp_path, {"query": "otters"}, provider="searxng", base_url=url)


def test_search_settings_are_checked() -> None:
    def problems(search: dict[str, Any]) -> list[str]:
        with pytest.raises(ConfigError) as caught:
            parse_config({"tools": {"web_search": search}}, environ={})
        return caught.value.problems

    assert problems({"provider": "searxng"}) == [
        "tools.web_search.base_url: required when provider is 'searxng': your SearXNG server, "
        "e.g. http://localhost:8888"]
    assert problems({"provider": "brave"}) == [
        "tools.web_search.api_key: required when provider is 'brave' (e.g. \"${BRAVE_API_KEY}\")"]
    assert problems({"provider": "tavily", "api_key": " "})[0].startswith("tools.web_search.api_key: required")
    assert problems({"provider": "bing"})[0].startswith("tools.web_search.provider:")
    assert problems({"provider": "searxng", "base_url": "searx.local"}) == [
        "tools.web_search.base_url: must be an http:// or https:// URL, not 'searx.local'"]
    # The key is a secret: `${VAR}` expands, an unset one stops a start that needs it, and it is redacted.
    cfg = parse_config({"tools": {"web_search": {"provider": "brave", "api_key": "${BRAVE_KEY}"}}},
                       environ={"BRAVE_KEY": "bk-123"})
    assert cfg.tools.web_search.api_key is not None and cfg.tools.web_search.api_key.get_secret_value() == "bk-123"
    assert "bk-123" in secret_values(cfg)
    unset = parse_config({"tools": {"web_search": {"provider": "brave", "api_key": "${BRAVE_KEY}"}}}, environ={})
    assert startup_problems(unset, channels=False, http=False) == [
        "tools.web_search.api_key: the environment variable BRAVE_KEY is not set "
        "(needed while tools.web_search.provider is 'brave')"]
    idle = parse_config({"tools": {"web_search": {"api_key": "${BRAVE_KEY}"}}}, environ={})
    assert startup_problems(idle, channels=False, http=False) == []


# -- the tool list follows the config; status lines -----------------------------------------


def test_the_web_tools_follow_the_config_snapshot() -> None:
    cfg = {"now": parse_config({}, environ={})}
    source = WebTools(lambda: cfg["now"])
    assert [t.name for t in source.tools()] == ["web_fetch"]
    version = source.version
    assert source.version == version  # nothing changed: no new version
    cfg["now"] = parse_config({"tools": {"web_search": {"provider": "searxng", "base_url": "http://s.local"}}},
                              environ={})
    assert source.version == version + 1 and [t.name for t in source.tools()] == ["web_fetch", "web_search"]
    cfg["now"] = parse_config({"tools": {"web_fetch": {"enabled": False, "max_bytes": 2000}}}, environ={})
    assert source.version == version + 2 and source.tools() == []
    cfg["now"] = parse_config({"tools": {"web_fetch": {"enabled": False, "timeout_s": 3}}}, environ={})
    assert source.version == version + 2  # other settings are read when a tool runs


def test_status_lines() -> None:
    assert status_line(WebFetch(), {"url": "https://example.com/a/b?c=d"}) == "fetching example.com…"
    assert status_line(WebFetch(), {"url": 5}) == "fetching a web page…"
    assert status_line(WebSearch(), {"query": "sea  otters\ntools"}) == "searching the web for “sea otters tools”…"
    assert status_line(CurrentTime(), {}) == "running current_time…"


# -- through the gateway ----------------------------------------------------------------------


def tool_names(request: dict[str, Any]) -> list[str]:
    return [t["function"]["name"] for t in request.get("tools", [])]


async def test_e2e_the_model_fetches_a_page(make_gateway: GatewayFactory, fake_model: FakeModel,
                                            fake_web: FakeWeb) -> None:
    gw = await make_gateway(tools={"web_fetch": {"allow_private_networks": True}})
    url = fake_web.page("/otters", ARTICLE)
    fake_model.tool_call("web_fetch", {"url": url})
    fake_model.reply("Otters use stones.")
    assert await chat(gw, "ann", "what do otters do?") == "Otters use stones."
    first, second = fake_model.requests[-2:]
    assert "web_fetch" in tool_names(first) and "web_search" not in tool_names(first)
    result = unfence([m for m in second["messages"] if m["role"] == "tool"][-1]["content"])
    assert f"URL: {url}" in result and "crack shellfish open with stones" in result and "NAVJUNK" not in result


async def test_e2e_a_refusal_reaches_the_model_as_an_error(make_gateway: GatewayFactory,
                                                           fake_model: FakeModel) -> None:
    gw = await make_gateway()
    fake_model.tool_call("web_fetch", {"url": "http://169.254.169.254/latest/meta-data/"})
    fake_model.reply("I may not fetch that.")
    assert await chat(gw, "ann", "read the metadata") == "I may not fetch that."
    result = unfence([m for m in fake_model.requests[-1]["messages"] if m["role"] == "tool"][-1]["content"])
    assert result == f"error: refused: 169.254.169.254 is a link-local address {ALLOW}"


async def test_e2e_a_large_page_is_cut_and_read_on_byte_exact(make_gateway: GatewayFactory, fake_model: FakeModel,
                                                             fake_web: FakeWeb) -> None:
    gw = await make_gateway(tools={"web_fetch": {"allow_private_networks": True}})
    assert gw.services is not None
    page = "".join(f"{i:06d} ünïcödé line of a long page 🦦\n" for i in range(5600))
    assert len(page) >= 200_000
    url = fake_web.page("/long.txt", page.encode(), content_type="text/plain; charset=utf-8")
    full = f"URL: {url}\n\n{page}"
    fake_model.tool_call("web_fetch", {"url": url})
    fake_model.reply("it is long")
    await chat(gw, "bea", "fetch the long page")
    result = unfence([m for m in fake_model.requests[-1]["messages"] if m["role"] == "tool"][-1]["content"])
    assert len(result) < 52_000  # tool_result_max_chars 50,000 plus the notice
    notice = re.search(r'The full output is saved as (tool_results/[^:]+\.txt): ([\d,]+) characters.*'
                       r'Continue with read_file\(path="([^"]+)", offset=(\d+)\)', result)
    assert notice, result[-600:]
    saved, total, path, offset = notice.group(1), int(notice.group(2).replace(",", "")), notice.group(3), \
        int(notice.group(4))
    assert saved == path and total == len(full)
    assert result.startswith(full[:offset])
    workspace = workspace_dir(gw.services.data_dir, "web:bea")
    assert (workspace / saved).read_bytes() == full.encode()
    collected = full[:offset]
    for _ in range(10):
        fake_model.tool_call("read_file", {"path": path, "offset": offset})
        fake_model.reply("more")
        await chat(gw, "bea", "continue")
        part = unfence([m for m in fake_model.requests[-1]["messages"] if m["role"] == "tool"][-1]["content"])
        nxt = re.search(rf'Continue with read_file\(path="{re.escape(path)}", offset=(\d+)\)', part)
        if nxt is None:
            collected += part
            break
        end = int(nxt.group(1))
        assert part.startswith(full[offset:end])
        collected += full[offset:end]
        offset = end
    assert collected.encode() == full.encode()
