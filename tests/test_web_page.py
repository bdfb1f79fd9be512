"""The chat page in a real headless browser (Debian's Chromium, driven by Playwright)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from playwright.async_api import Browser, BrowserContext, Page, async_playwright, expect

from gateway.app import Gateway
from tests.conftest import GatewayFactory, chat, web_page_url
from tests.fakes.openai_server import FakeModel
from tests.test_web_api import TOKEN, Served, served, stream_for  # noqa: F401  (fixture)
from tests.web_screenshots import CHROMIUM, CHROMIUM_ARGS, SIZES, take

HOSTILE = ("Look:\n\n<script>window.__pwned = 1</script>\n\n<img src=x onerror=\"window.__pwned = 2\">\n\n"
           "[harmless](javascript:window.__pwned=3) and <a href=\"https://example.org\" onclick=\"window.__pwned=4\">"
           "a site</a>\n\n<iframe src=\"javascript:parent.__pwned=5\"></iframe>")
RICH = ("Steps:\n\n1. first\n2. second\n\n```python\nprint('hi <b>')\n```\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n"
        "See [the docs](https://example.org/docs).")


@pytest.fixture
def chromium_path() -> str:
    if not os.path.exists(CHROMIUM):
        pytest.skip("Debian's chromium is not installed (bash .ci/run installs it)")
    return CHROMIUM


@pytest_asyncio.fixture
async def browser(chromium_path: str) -> AsyncIterator[Browser]:
    async with async_playwright() as pw:
        b = await pw.chromium.launch(executable_path=chromium_path, args=CHROMIUM_ARGS, headless=True)
        try:
            yield b
        finally:
            await b.close()


async def open_page(browser: Browser | BrowserContext, url: str) -> tuple[Page, list[str]]:
    page = await browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda err: errors.append(str(err)))
    await page.goto(url)
    return page, errors


async def test_chat_round_trip_renders_markdown(make_gateway: GatewayFactory, fake_model: FakeModel,
                                                browser: Browser) -> None:
    gw = await make_gateway()
    assert gw.http is not None
    fake_model.reply(RICH, delay=1.6)
    page, errors = await open_page(browser, web_page_url(gw))
    assert await page.evaluate("document.activeElement.id") == "text"  # ready to type
    assert "web-user" in (await page.text_content("#welcome") or "")
    await page.fill("#text", "hi from the browser")
    await page.press("#text", "Enter")
    # The working state shows, counting seconds, while the agent works.
    await page.wait_for_selector("#working:not([hidden])", timeout=5000)
    assert await page.is_disabled("#send")
    await expect(page.locator("#working-text")).to_have_text("working… 1 s", timeout=5000)
    bot = page.locator(".msg.bot:not([hidden])")
    await bot.first.wait_for(timeout=10_000)
    await page.wait_for_selector("#working", state="hidden", timeout=5000)
    assert await page.locator(".msg.user").first.text_content() == "hi from the browser"
    assert await bot.locator("pre code").text_content() == "print('hi <b>')\n"
    assert await bot.locator("b").count() == 0  # code is text, never markup
    assert await bot.locator("pre").evaluate("e => getComputedStyle(e).fontFamily.includes('monospace')")
    assert await bot.locator(".code button.copy").count() == 1
    assert await bot.locator("ol li").count() == 2
    assert await bot.locator("table td").all_text_contents() == ["1", "2"]
    link = bot.locator("a", has_text="the docs")
    assert await link.get_attribute("target") == "_blank"
    assert "noopener" in (await link.get_attribute("rel") or "")
    assert await page.evaluate("document.activeElement.id") == "text"
    assert not await page.is_disabled("#send")
    assert errors == []
    assert fake_model.requests[-1]["messages"][-1]["content"] == "hi from the browser"
    assert gw.services is not None
    assert await gw.services.store.count_messages("web:web-user") == 2


async def test_hostile_replies_never_run(make_gateway: GatewayFactory, fake_model: FakeModel,
                                         browser: Browser) -> None:
    gw = await make_gateway()
    assert gw.http is not None
    fake_model.reply(HOSTILE)
    page, errors = await open_page(browser, web_page_url(gw))
    await page.fill("#text", "show me something")
    await page.click("#send")
    bot = page.locator(".msg.bot:not([hidden])")
    await bot.first.wait_for(timeout=10_000)
    assert "Look:" in (await bot.text_content() or "")
    # The sanitizer removed everything that could run (the page's CSP would block it too).
    assert await bot.locator("script, iframe, [onerror], [onclick]").count() == 0
    assert await bot.locator("a[href^='javascript']").count() == 0
    await bot.locator("a", has_text="harmless").click()
    await page.wait_for_timeout(300)
    assert await page.evaluate("typeof window.__pwned") == "undefined"
    # Reloaded from the history, the same reply is just as harmless.
    await page.reload()
    await page.locator(".msg.bot").first.wait_for(timeout=5000)
    await page.wait_for_timeout(300)
    assert await page.evaluate("typeof window.__pwned") == "undefined"
    assert await page.locator(".msg.bot script, .msg.bot [onerror]").count() == 0
    assert errors == []


async def test_history_appears_on_reload(make_gateway: GatewayFactory, fake_model: FakeModel,
                                         browser: Browser) -> None:
    gw = await make_gateway()
    assert gw.http is not None
    url = web_page_url(gw)
    context = await browser.new_context()  # one browser profile: its localStorage persists
    page, _ = await open_page(context, url)
    await page.click("#settings-toggle")
    await page.fill("#session", "reloader")
    await page.press("#session", "Tab")  # "change": saved, and that session's history shown
    assert await page.text_content("#who") == "session: reloader"
    fake_model.reply("Here:\n\n```\ncode kept\n```")
    await page.fill("#text", "first visit")
    await page.press("#text", "Enter")
    await page.locator(".msg.bot pre").wait_for(timeout=10_000)
    # While the page is closed, another reply arrives in the same session.
    await page.close()
    fake_model.reply("sent while you were away")
    assert await chat(gw, "reloader", "from elsewhere") == "sent while you were away"
    page, errors = await open_page(context, url)
    await page.locator(".msg.bot").nth(1).wait_for(timeout=5000)
    assert await page.locator(".msg.user").all_text_contents() == ["first visit", "from elsewhere"]
    assert await page.locator(".msg.bot pre").text_content() == "code kept\n"
    assert (await page.locator(".msg.bot").nth(1).text_content() or "").strip() == "sent while you were away"
    assert await page.text_content("#who") == "session: reloader"  # remembered by the browser
    assert errors == []


async def test_stop_stops_the_turn_keeps_what_was_shown_and_the_next_message_goes_on(
        make_gateway: GatewayFactory, fake_model: FakeModel, browser: Browser) -> None:
    gw = await make_gateway()
    assert gw.http is not None and gw.services is not None
    chunks = [f"word{i} " for i in range(100_000)]  # streams for longer than the test runs
    fake_model.reply("".join(chunks), chunks=chunks, chunk_delay=0.02)
    page, errors = await open_page(browser, web_page_url(gw))
    await page.fill("#text", "tell me everything")
    await page.press("#text", "Enter")
    live = page.locator(".msg.bot.pending")
    await live.filter(has_text="word5").wait_for(timeout=10_000)
    await page.click("#stop")
    await page.wait_for_selector("#working", state="hidden", timeout=15_000)
    # What was shown stays, marked; it is what the gateway stored as the reply.
    stopped = page.locator(".msg.bot.stopped")
    assert await stopped.count() == 1
    shown = await stopped.inner_text()
    rows = await gw.services.store.messages("web:web-user")
    assert [m.role for m in rows] == ["user", "assistant"]
    assert rows[1].content.endswith("\n\n[stopped]") and rows[1].content.startswith("word0 word1 word2 word3 word4")
    assert shown.split() == rows[1].content.split()
    assert await page.locator(".note").count() == 0  # not the "stopped waiting" fallback
    assert await fake_model.wait_disconnects(1) == [0]  # the model's stream was closed
    # The session is free: the next message is answered, after the stopped one.
    await page.fill("#text", "and then?")
    await page.press("#text", "Enter")
    await page.locator(".msg.bot", has_text="echo: and then?").wait_for(timeout=10_000)
    assert [m["messages"][-1]["content"] for m in fake_model.requests] == ["tell me everything", "and then?"]
    assert errors == []


async def test_a_stop_that_cannot_reach_the_gateway_stops_reading(make_gateway: GatewayFactory,
                                                                   fake_model: FakeModel, browser: Browser) -> None:
    """The page's /stop request fails (here the browser drops it): the page stops reading the
    reply instead, and the turn's reply shows in the history later."""
    gw = await make_gateway()
    assert gw.http is not None
    fake_model.reply("worth the wait", delay=0.6)
    page, _ = await open_page(browser, web_page_url(gw))
    await page.route("**/api/chat", lambda route: route.abort() if "/stop" in (route.request.post_data or "")
                     else route.continue_())
    await page.fill("#text", "slow question")
    await page.press("#text", "Enter")
    await page.wait_for_selector("#working:not([hidden])", timeout=5000)
    await page.click("#stop")
    await page.wait_for_selector("#working", state="hidden", timeout=5000)
    assert "Stopped waiting" in (await page.locator(".note").last.text_content() or "")
    # The turn went on in the gateway; its reply comes to the page by itself (the
    # session's event stream), and the history button shows it too, once.
    await page.locator(".msg.bot", has_text="worth the wait").wait_for(timeout=10_000)
    assert gw.services is not None
    assert await gw.services.store.count_messages("web:web-user") == 2
    await page.click("#refresh")
    await page.locator(".msg.bot", has_text="worth the wait").wait_for(timeout=5000)
    await expect(page.locator(".msg.bot")).to_have_count(1)


async def test_a_reply_that_crossed_the_pages_stop_shows_from_the_history(
        make_gateway: GatewayFactory, fake_model: FakeModel, browser: Browser) -> None:
    """The reply reaches its request just as the page stops reading it (here the browser
    holds the finished response until the page has given up): no push follows, since the
    gateway gave it to the request; its `answered` notice makes the page show it from the
    history, once."""
    from channels.web.adapter import WebChannel

    gw = await make_gateway()
    assert gw.http is not None
    channel = gw.channels["web"]
    assert isinstance(channel, WebChannel)
    fake_model.reply("crossed on the way", delay=0.3)
    page, errors = await open_page(browser, web_page_url(gw))
    for _ in range(200):  # the page's event stream is open
        if channel.events.listeners("web-user"):
            break
        await asyncio.sleep(0.05)
    answered, released = asyncio.Event(), asyncio.Event()

    async def hold(route: Any) -> None:
        if "/stop" in (route.request.post_data or ""):
            await route.abort()  # the gateway never hears the Stop
            return
        response = await route.fetch()  # the whole reply, written to the request
        answered.set()
        await released.wait()
        with contextlib.suppress(Exception):  # the page stopped reading meanwhile
            await route.fulfill(response=response)

    await page.route("**/api/chat", hold)
    await page.fill("#text", "a quick one")
    await page.press("#text", "Enter")
    await asyncio.wait_for(answered.wait(), 10)
    await page.click("#stop")
    try:
        await page.locator(".msg.bot", has_text="crossed on the way").wait_for(timeout=10_000)
        await expect(page.locator(".msg.bot")).to_have_count(1)
    finally:
        released.set()
    assert errors == []


async def test_a_token_gateway_takes_it_in_the_settings(make_gateway: GatewayFactory, fake_model: FakeModel,
                                                       browser: Browser) -> None:
    gw = await make_gateway(channels={"web": {"token": "page-token"}})
    assert gw.http is not None and gw.web_link() is None  # a configured token is never printed
    page, _ = await open_page(browser, f"http://127.0.0.1:{gw.http.port}/")
    assert "channels.web.token" in (await page.locator(".msg.error").text_content(timeout=5000) or "")
    await page.click("#settings-toggle")
    await page.fill("#token", "page-token")
    await page.press("#token", "Enter")
    await expect(page.locator(".msg.error")).to_have_count(0, timeout=5000)
    fake_model.reply("authorized")
    await page.fill("#text", "hello")
    await page.press("#text", "Enter")
    await page.locator(".msg.bot", has_text="authorized").wait_for(timeout=10_000)
    assert await page.evaluate("localStorage.getItem('gw.token')") == "page-token"


async def test_streamed_reply_grows_on_the_page(served: Served, browser: Browser) -> None:  # noqa: F811
    page, errors = await open_page(browser, served.base + "/?token=" + TOKEN)
    await page.locator(".msg.bot").first.wait_for(timeout=5000)  # the fixture's history
    await page.fill("#text", "stream please")
    await page.press("#text", "Enter")
    stream = stream_for(served, await served.next_inbound())
    live = page.locator(".msg.bot.pending")
    await stream.append("Working on **it")
    await stream.append("**, one moment")
    await live.locator("strong", has_text="it").wait_for(timeout=5000)  # Markdown while it grows
    assert await page.is_visible("#working")
    await stream.status("reading notes.md…")
    await live.locator(".status", has_text="reading notes.md…").wait_for(timeout=5000)
    assert "one moment" not in (await live.text_content() or "")  # the status replaced it
    for word in ("Found ", "it:\n\n", "```\n", "line one\n"):
        await stream.append(word)
        await asyncio.sleep(0.03)
    await live.locator("pre").wait_for(timeout=5000)  # an unclosed code block already shows
    assert await page.is_visible("#working")
    final = "Found it:\n\n```\nline one\nline two\n```"
    await stream.append("line two\n```")
    await stream.finish(final)
    await page.wait_for_selector("#working", state="hidden", timeout=5000)
    last = page.locator(".msg.bot").last
    assert await last.locator("pre").text_content() == "line one\nline two\n"
    assert await page.locator(".msg.bot.pending").count() == 0
    assert errors == []


async def test_the_gateway_streams_into_the_page(make_gateway: GatewayFactory, fake_model: FakeModel,
                                                 browser: Browser) -> None:
    if not hasattr(Gateway, "stream") or "chunk_delay" not in inspect.signature(FakeModel.reply).parameters:
        pytest.skip("needs the agent's streaming (g-stream-core): Gateway.stream and a slow streaming fake model")
    gw = await make_gateway()
    assert gw.http is not None
    chunks = ["Counting: **one**", ", two", ", three.\n\n```\ndone\n```"]
    fake_model.reply("".join(chunks), chunks=chunks, chunk_delay=0.4)  # type: ignore[call-arg]
    page, errors = await open_page(browser, web_page_url(gw))
    await page.fill("#text", "count slowly")
    await page.press("#text", "Enter")
    live = page.locator(".msg.bot.pending")
    await live.locator("strong", has_text="one").wait_for(timeout=5000)  # before the reply is complete
    assert "three" not in (await live.text_content() or "")
    assert await page.is_visible("#working")
    await page.wait_for_selector("#working", state="hidden", timeout=10_000)
    assert await page.locator(".msg.bot").last.locator("pre").text_content() == "done\n"
    assert errors == []


async def test_screenshots_script_still_works(chromium_path: str, tmp_path: Path) -> None:
    saved = await take(tmp_path, chromium_path)
    assert [p.name for p in saved] == list(SIZES)
    for shot in saved:
        assert shot.read_bytes().startswith(b"\x89PNG") and shot.stat().st_size > 20_000


async def test_an_approval_card_is_answered_with_a_click(make_gateway: GatewayFactory, fake_model: FakeModel,
                                                         browser: Browser) -> None:
    gw = await make_gateway(admins=["web:web-user"], approvals={"tools": {"current_time": "ask"}})
    assert gw.http is not None
    fake_model.tool_call("current_time", {"timezone": "Asia/Tokyo"})
    fake_model.reply("It is morning in Tokyo.")
    page, errors = await open_page(browser, web_page_url(gw))
    await page.fill("#text", "what time is it in Tokyo?")
    await page.press("#text", "Enter")
    card = page.locator(".msg.approval")
    await card.wait_for(timeout=10_000)
    await expect(card.locator(".approval-title")).to_have_text("Approval needed: current_time")
    assert '"timezone": "Asia/Tokyo"' in (await card.locator(".approval-args").text_content() or "")
    assert len(fake_model.requests) == 1  # nothing runs before the click
    await card.locator("button.allow").click()
    await expect(page.locator(".msg.bot:not([hidden])").last).to_have_text("It is morning in Tokyo.", timeout=10_000)
    await expect(card).to_have_class(re.compile(r"\bdecided\b"), timeout=5000)
    assert await card.locator("button").evaluate_all("bs => bs.every(b => b.disabled)")
    await expect(card.locator(".approval-note")).to_have_text("Allowed by web:web-user.")
    assert "JST" in str(fake_model.requests[-1]["messages"][-1]["content"])
    assert errors == []


async def test_the_printed_link_signs_the_browser_in_and_leaves_no_token_behind(
        make_gateway: GatewayFactory, fake_model: FakeModel, browser: Browser) -> None:
    """SPEC §9, issue 31: the page needs the token on loopback too. Opened bare, it says how
    to get in; the link `gateway run` prints sets an HttpOnly cookie and sends the browser
    on to the page without the token; chat and reload then work on the cookie alone."""
    gw = await make_gateway()
    assert gw.http is not None and gw.web_token is not None
    bare = f"http://127.0.0.1:{gw.http.port}/"
    context = await browser.new_context()
    page, errors = await open_page(context, bare)
    how = page.locator(".msg.signin")
    await expect(how).to_contain_text("python -m gateway web-link", timeout=5000)
    await expect(how).to_contain_text(bare + "?token=\u2026")
    assert await page.locator(".msg.bot, .msg.user").count() == 0 and await context.cookies() == []

    link = gw.web_link()
    assert link is not None
    await page.goto(link)
    assert page.url == bare  # the token is in no address bar, history entry or screenshot
    (cookie,) = await context.cookies()
    assert (cookie["httpOnly"], cookie["sameSite"], cookie["path"]) == (True, "Strict", "/")
    assert gw.web_token not in cookie["value"]
    assert await page.evaluate("document.cookie") == ""  # no script of the page can read it
    await expect(page.locator(".msg.signin")).to_have_count(0)
    fake_model.reply("Signed in and answered.")
    await page.fill("#text", "hello with a cookie")
    await page.press("#text", "Enter")
    await page.locator(".msg.bot", has_text="Signed in and answered.").wait_for(timeout=10_000)
    await page.reload()
    await page.locator(".msg.bot", has_text="Signed in and answered.").wait_for(timeout=10_000)
    assert await page.locator(".msg.user").all_text_contents() == ["hello with a cookie"]
    assert page.url == bare and gw.web_token not in await page.content()
    assert errors == []


async def test_an_approval_card_shows_a_hidden_command_and_its_script_whole(
        make_gateway: GatewayFactory, fake_model: FakeModel, browser: Browser) -> None:
    """Issue 31: the card shows escapes for what would hide (never the raw characters), the
    script a command runs, and all of it, nothing folded or scrolled out of sight."""
    gw = await make_gateway(admins=["web:web-user"], tools={"exec": {"enabled": True}},
                            approvals={"tools": {"exec": "ask"}})
    assert gw.http is not None and gw.services is not None
    day = gw.services.memory.today()
    command = "\n".join([*(f"echo step {i}" for i in range(18)), "rm MEMORY.md\r\x1b[2Kls -la",
                         f"sh memory/{day}.md \u202e\u200b"])
    fake_model.tool_call("memory_write", {"text": "rm -rf /workspace/*\u2066", "target": "daily"})
    fake_model.tool_call("exec", {"command": command})
    fake_model.reply("Not run.")
    page, errors = await open_page(browser, web_page_url(gw))
    await page.fill("#text", "tidy up")
    await page.press("#text", "Enter")
    card = page.locator(".msg.approval")
    await card.wait_for(timeout=10_000)
    shown = await card.locator(".approval-args").first.inner_text()
    assert "rm MEMORY.md\\r\\x1b[2Kls -la" in shown and f"sh memory/{day}.md \\u202e\\u200b" in shown
    assert not any(ch in shown for ch in "\r\x1b\u202e\u200b") and shown.count("\n") >= 19
    script = await card.locator(".approval-args").nth(1).inner_text()
    assert "rm -rf /workspace/*\\u2066" in script and "\u2066" not in script
    assert f"memory/{day}.md (" in await card.locator(".approval-file").inner_text()
    # Whole on the page: no box cuts it to a few lines with a scroll bar.
    assert await card.locator(".approval-args").first.evaluate("e => e.scrollHeight <= e.clientHeight + 1")
    await card.locator("button", has_text="Deny").click()
    await expect(page.locator(".msg.bot:not([hidden])").last).to_have_text("Not run.", timeout=10_000)
    assert errors == []
