"""The web chat as a conversation a newcomer follows: command answers stay in the history
(and never reach the model), a fresh context shows as a divider, replies nobody's request
waits for (a task's) arrive in the open page by themselves, code is highlighted and table
columns keep their alignment. In Chromium (Playwright) against a real gateway on the
fake model, and on the wire for the event stream."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from playwright.async_api import Browser, expect

from channels.web.adapter import PAGE_CSP, HistoryItem, WebChannel, with_dividers
from gateway.app import Gateway
from gateway.http.web_token import cookie_name, cookie_value
from gateway.turns.commands import HELP
from tests.conftest import GatewayFactory, chat, web_client, web_page_url
from tests.fakes.openai_server import FakeModel
from tests.test_web_api import TOKEN, Events, Served, client, served  # noqa: F401  (fixture)
from tests.test_web_page import browser, chromium_path, open_page  # noqa: F401  (fixtures)

# What a browser signed in to the page (the `served` channel's) sends along.
PAGE_COOKIE = {"Cookie": f"{cookie_name(TOKEN)}={cookie_value(TOKEN)}"}


def base(gw: Gateway) -> str:
    assert gw.http is not None
    return f"http://127.0.0.1:{gw.http.port}"


def web(gw: Gateway) -> WebChannel:
    channel = gw.channels["web"]
    assert isinstance(channel, WebChannel)
    return channel


async def until(check: Callable[[], Awaitable[bool] | bool], what: str, timeout: float = 10) -> None:
    async with asyncio.timeout(timeout):
        while True:
            result = check()
            if await result if isinstance(result, Awaitable) else result:
                return
            await asyncio.sleep(0.05)


async def history(gw: Gateway, session: str, **params: str) -> dict[str, Any]:
    async with web_client(gw) as http:
        async with http.get(base(gw) + "/api/history", params={"session": session, **params}) as resp:
            assert resp.status == 200, await resp.text()
            return dict(await resp.json())


def sent_texts(fake_model: FakeModel) -> list[str]:
    """Every message text the model was ever sent."""
    return [str(m.get("content")) for request in fake_model.requests for m in request["messages"]]


# -- command answers and dividers in the history ------------------------------------------


async def test_command_answers_stay_in_the_history_and_never_reach_the_model(
        make_gateway: GatewayFactory, fake_model: FakeModel) -> None:
    gw = await make_gateway()
    fake_model.reply("Hello!")
    assert await chat(gw, "ann", "hi") == "Hello!"
    assert await chat(gw, "ann", "/help") == HELP
    stats = await chat(gw, "ann", "/context")
    assert "Turns: 1 of" in stats
    fake_model.reply("Still here.")
    assert await chat(gw, "ann", "are you there?") == "Still here."

    shown = (await history(gw, "ann"))["messages"]
    assert [(m["kind"], m["role"], m["text"]) for m in shown] == [
        ("message", "user", "hi"), ("message", "assistant", "Hello!"),
        ("command", "user", "/help"), ("command", "assistant", HELP),
        ("command", "user", "/context"), ("command", "assistant", stats),
        ("message", "user", "are you there?"), ("message", "assistant", "Still here.")]

    # Neither the commands nor their answers ever reached the model, also after the
    # session is restored from the store.
    assert gw.services is not None
    gw.sessions.drop("web:ann")
    fake_model.reply("Restored.")
    assert await chat(gw, "ann", "after a restore") == "Restored."
    texts = sent_texts(fake_model)
    assert "after a restore" in texts and "are you there?" in texts
    assert not any("/help" in t or "/context" in t or "Commands:" in t or "Turns: 1 of" in t for t in texts)
    assert await gw.services.store.count_messages("web:ann") == 6  # the three turns alone


async def test_a_secret_given_to_config_is_not_kept_in_the_history(
        make_gateway: GatewayFactory, fake_model: FakeModel) -> None:
    gw = await make_gateway(admins=["web:root"])
    answer = await chat(gw, "root", "/config model.api_key sk-do-not-keep")
    assert "secret" in answer
    shown = (await history(gw, "root"))["messages"]
    assert [m["text"] for m in shown] == ["/config model.api_key ***", answer]
    assert gw.services is not None
    rows = await gw.services.store.run("SELECT command, answer FROM command_answers")
    assert not any("sk-do-not-keep" in str(value) for row in rows for value in row)


async def test_a_fresh_context_is_a_divider_in_the_history(make_gateway: GatewayFactory,
                                                           fake_model: FakeModel) -> None:
    gw = await make_gateway()
    await chat(gw, "bo", "first")
    cleared = await chat(gw, "bo", "/new")
    assert cleared.startswith("Started a fresh context")
    await chat(gw, "bo", "second")
    await chat(gw, "bo", "/context clear")
    kinds = [(m["kind"], m["text"]) for m in (await history(gw, "bo"))["messages"]]
    assert kinds == [
        ("message", "first"), ("message", "echo: first"),
        ("command", "/new"), ("command", cleared), ("divider", "new conversation"),
        ("message", "second"), ("message", "echo: second"),
        ("command", "/context clear"), ("command", cleared), ("divider", "new conversation")]
    # The model saw the second turn alone: the divider is where its context started.
    assert [m["content"] for m in fake_model.requests[-1]["messages"] if m["role"] != "system"] == ["second"]


async def test_a_context_start_without_a_kept_command_still_shows_its_divider(
        make_gateway: GatewayFactory, fake_model: FakeModel) -> None:
    """A session cleared before commands were kept: the session's context start turn
    places the divider."""
    gw = await make_gateway()
    for text in ("one", "two"):
        await chat(gw, "cy", text)
    assert gw.services is not None
    await gw.services.store.set_context_start("web:cy", 2)
    shown = [(m["kind"], m["text"]) for m in (await history(gw, "cy"))["messages"]]
    assert shown == [("message", "one"), ("message", "echo: one"), ("divider", "new conversation"),
                     ("message", "two"), ("message", "echo: two")]
    await gw.services.store.set_context_start("web:cy", 3)  # cleared after the last turn
    shown = [m["kind"] for m in (await history(gw, "cy"))["messages"]]
    assert shown == ["message"] * 4 + ["divider"]


def test_dividers_are_placed_once() -> None:
    items = [HistoryItem("user", "a", 1, turn=1), HistoryItem("assistant", "b", 2, turn=1),
             HistoryItem("user", "/new", 3, "command", 1), HistoryItem("assistant", "ok", 3, "command", 1, True),
             HistoryItem("user", "c", 4, turn=2)]
    placed = with_dividers(items, 2, newest=True)
    assert [item.kind for item in placed] == ["message", "message", "command", "command", "divider", "message"]
    assert with_dividers(items[:2], 1, newest=True) == items[:2]


async def test_a_long_history_with_commands_reads_page_by_page(make_gateway: GatewayFactory,
                                                               fake_model: FakeModel) -> None:
    gw = await make_gateway()
    for n in range(3):
        await chat(gw, "dee", f"q{n}")
        await chat(gw, "dee", "/help")
    everything = [m["text"] for m in (await history(gw, "dee", limit="200"))["messages"]]
    assert len(everything) == 12
    pages: list[list[str]] = []
    cursor: str | None = None
    while True:
        params = {"limit": "3", **({"before": cursor} if cursor else {})}
        page = await history(gw, "dee", **params)
        pages.insert(0, [m["text"] for m in page["messages"]])
        cursor = page["before"]
        if cursor is None:
            break
    # A command's place is a cursor too (its seq is past the messages'); nothing twice, nothing lost.
    assert [text for page in pages for text in page] == everything


# -- pushed replies: the event stream -----------------------------------------------------


async def test_pushed_events_replay_what_a_reconnecting_page_missed(served: Served) -> None:  # noqa: F811
    channel = served.channel
    url = served.base + "/api/events"
    async with client() as http:
        resp = await http.get(url, params={"session": "eve"})
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        assert resp.headers["Cache-Control"].startswith("no-store")
        assert await resp.content.readline() == b"retry: 3000\n"
        await until(lambda: channel.events.listeners("eve") == 1, "listening")
        assert channel.push_reply("eve", "first", failed=False) == 1
        channel.push_reply("someone-else", "not for eve", failed=False)
        ids: list[str] = []
        event, data = await read_event(resp, ids)
        assert (event, data["text"], data["failed"]) == ("reply", "first", False)
        resp.close()
        await until(lambda: channel.events.listeners("eve") == 0, "closed")
        channel.push_reply("eve", "while away", failed=False)

        # Reconnecting with the last id seen: what came meanwhile, then live again.
        resp = await http.get(url, params={"session": "eve"}, headers={"Last-Event-ID": ids[0]})
        await resp.content.readline()
        event, data = await read_event(resp, ids)
        assert data["text"] == "while away"
        # Heartbeats keep a quiet stream open.
        events = Events(resp)
        push = asyncio.get_running_loop().call_later(
            0.3, lambda: channel.push_reply("eve", "later", failed=False))
        assert (await events.next())[1]["text"] == "later"
        push.cancel()
        assert "keep-alive" in events.comments
        resp.close()

        # An id from another process (a restart): the page is told to reload its history.
        resp = await http.get(url, params={"session": "eve"}, headers={"Last-Event-ID": "0123456789ab-1"})
        await resp.content.readline()
        event, _ = await read_event(resp, ids)
        assert event == "resync"
        resp.close()


async def read_event(resp: aiohttp.ClientResponse, ids: list[str]) -> tuple[str, dict[str, Any]]:
    event, data = "message", ""
    async with asyncio.timeout(5):
        while True:
            line = (await resp.content.readline()).decode().rstrip("\n")
            if line.startswith("id: "):
                ids.append(line[4:])
            elif line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
            elif line == "" and data:
                return event, json.loads(data)


@pytest.mark.parametrize("pieces", [1, 3])
async def test_a_reply_that_ends_after_its_page_left_goes_to_the_open_pages(
        make_gateway: GatewayFactory, fake_model: FakeModel, pieces: int) -> None:
    """The page stops reading its streamed reply (Stop, a closed tab) while the model still
    thinks: the session's open pages get the reply, with the id of the message it answers."""
    gw = await make_gateway()
    channel = web(gw)
    text = "an answer after you left"
    cut = [text[:9], text[9:18], text[18:]] if pieces == 3 else [text]
    fake_model.reply(text, delay=0.8, chunks=cut, chunk_delay=0.1)
    async with web_client(gw) as http:
        events = await http.get(base(gw) + "/api/events", params={"session": "web-user"})
        await events.content.readline()
        await until(lambda: channel.events.listeners("web-user") == 1, "listening")
        asked = await http.post(base(gw) + "/api/chat",
                                json={"session": "web-user", "text": "slow one", "stream": True, "id": "m-1"})
        assert await asked.content.readline() == b": accepted\n"
        asked.close()  # the page left
        event, data = await read_event(events, [])
        assert (event, data["text"], data["id"]) == ("reply", text, "m-1")
        events.close()
    assert [r["messages"][-1]["content"] for r in fake_model.requests] == ["slow one"]


async def test_open_pages_hear_that_a_reply_went_to_its_request(
        make_gateway: GatewayFactory, fake_model: FakeModel) -> None:
    """A reply given to the request that asked is announced to the session's open pages as
    `answered` (no text, no id of its own: not kept for reconnecting pages), so a page that
    stopped reading that request just as the reply came knows the history has it."""
    gw = await make_gateway()
    channel = web(gw)
    async with web_client(gw) as http:
        events = await http.get(base(gw) + "/api/events", params={"session": "web-user"})
        await events.content.readline()
        await until(lambda: channel.events.listeners("web-user") == 1, "listening")
        for stream in (False, True):
            fake_model.reply("the answer")
            async with http.post(base(gw) + "/api/chat", json={"session": "web-user", "text": "hi",
                                                               "stream": stream, "id": f"m-{stream}"}) as resp:
                assert "the answer" in await resp.text()
            ids: list[str] = []
            event, data = await read_event(events, ids)
            assert (event, data, ids) == ("answered", {"id": f"m-{stream}"}, [])
        events.close()
    assert channel.events.missed("web-user", channel.events.event_id(0)) == []  # nothing kept


async def test_event_streams_are_checked_and_bounded(served: Served) -> None:  # noqa: F811
    channel = served.channel
    url = served.base + "/api/events"
    async with aiohttp.ClientSession(headers=PAGE_COOKIE) as http:
        for params, headers, status in (
                ({"session": "../x"}, {}, 400),
                ({"session": "eve"}, {"Origin": "http://evil.example"}, 403),
                ({"session": "eve"}, {"Host": "evil.example"}, 403)):
            async with http.get(url, params=params, headers=headers) as resp:
                assert resp.status == status, (params, headers)
        # At most a few streams from one address; the next is refused until one closes.
        open_ones = [await http.get(url, params={"session": f"tab{n}"}) for n in range(8)]
        assert all(resp.status == 200 for resp in open_ones)
        async with http.get(url, params={"session": "tab8"}) as resp:
            assert resp.status == 429 and "Retry-After" in resp.headers
        open_ones.pop().close()
        await until(lambda: channel.events.streams == 7, "one closed")
        open_ones.append(await http.get(url, params={"session": "tab8"}))
        assert open_ones[-1].status == 200

        # A token changed later locks every open stream out (and new ones need the new one).
        channel.token = "sekret-rotated-0123456789abcdef0123"
        await until(lambda: channel.events.streams == 0, "streams ended", timeout=5)
        for resp in open_ones:
            resp.close()
        async with http.get(url, params={"session": "eve"}) as resp:
            assert resp.status == 401
        resp = await http.get(url, params={"session": "eve"},
                              headers={"Authorization": "Bearer sekret-rotated-0123456789abcdef0123"})
        assert resp.status == 200
        await until(lambda: channel.events.streams == 1, "open")
        # Stopping the channel ends the stream (nothing is left waiting on shutdown).
        await channel.stop()
        async with asyncio.timeout(5):
            assert await resp.content.read() is not None
        assert channel.events.streams == 0
        resp.close()


# -- in the browser ------------------------------------------------------------------------


async def test_a_task_reply_appears_in_the_open_page_without_a_click(
        make_gateway: GatewayFactory, fake_model: FakeModel, browser: Browser) -> None:  # noqa: F811
    gw = await make_gateway()
    page, errors = await open_page(browser, web_page_url(gw))
    await until(lambda: web(gw).events.listeners("web-user") == 1, "the page listens")
    fake_model.tool_call("schedule_task", {"prompt": "Remind them to stretch", "at": "in 2s"})
    fake_model.reply("I will remind you in 2 seconds.")
    await page.fill("#text", "remind me to stretch in 2 seconds")
    await page.press("#text", "Enter")
    await page.locator(".msg.bot", has_text="I will remind you").wait_for(timeout=10_000)
    fake_model.reply("Time to **stretch**!")
    reminder = page.locator(".msg.bot", has_text="Time to stretch!")
    await reminder.wait_for(timeout=15_000)  # no reload, no click
    assert await reminder.locator("strong").text_content() == "stretch"
    assert await page.locator(".msg.bot").count() == 2
    assert errors == []


async def test_the_page_reconnects_and_gets_what_it_missed(
        make_gateway: GatewayFactory, fake_model: FakeModel, browser: Browser, monkeypatch: Any) -> None:  # noqa: F811
    # Streams end after a second and pages come back half a second later (EventSource's
    # retry, announced by the stream), asking for what came after the last event they saw.
    monkeypatch.setattr("channels.web.adapter.STREAM_MAX_S", 1.0)
    monkeypatch.setattr("channels.web.adapter.RETRY_MS", 500)
    gw = await make_gateway()
    channel = web(gw)
    page, errors = await open_page(browser, web_page_url(gw))
    await until(lambda: channel.events.listeners("web-user") == 1, "the page listens")
    channel.push_reply("web-user", "one", failed=False)
    await page.locator(".msg.bot", has_text="one").wait_for(timeout=5000)
    await until(lambda: channel.events.listeners("web-user") == 0, "the stream ended")
    channel.push_reply("web-user", "two, while it was away", failed=False)  # no page listens
    await page.locator(".msg.bot", has_text="two, while it was away").wait_for(timeout=10_000)
    await until(lambda: channel.events.listeners("web-user") == 1, "back")
    shown = await page.locator(".msg.bot").all_text_contents()
    assert [text.strip() for text in shown] == ["one", "two, while it was away"]  # each once
    assert errors == []


async def test_a_page_with_a_token_gets_pushed_replies(make_gateway: GatewayFactory, fake_model: FakeModel,
                                                       browser: Browser) -> None:  # noqa: F811
    gw = await make_gateway(channels={"web": {"token": "page-token"}})
    context = await browser.new_context()
    await context.add_init_script("localStorage.setItem('gw.token', 'page-token')")
    page, errors = await open_page(context, base(gw) + "/")  # no cookie: the settings' token alone
    await until(lambda: web(gw).events.listeners("web-user") == 1, "the page listens")
    web(gw).push_reply("web-user", "pushed with a token", failed=False)
    await page.locator(".msg.bot", has_text="pushed with a token").wait_for(timeout=5000)
    assert errors == []


async def test_new_chat_shows_a_divider_and_the_history_keeps_commands(
        make_gateway: GatewayFactory, fake_model: FakeModel, browser: Browser) -> None:  # noqa: F811
    gw = await make_gateway()
    page, errors = await open_page(browser, web_page_url(gw))
    fake_model.reply("First answer.")
    await page.fill("#text", "first question")
    await page.press("#text", "Enter")
    await page.locator(".msg.bot", has_text="First answer.").wait_for(timeout=10_000)
    await page.fill("#text", "/help")
    await page.press("#text", "Enter")
    await page.locator(".msg.bot.command", has_text="/context clear").wait_for(timeout=10_000)
    await page.fill("#text", "half-typed")  # the button keeps what is being typed
    await page.click("#new-chat")
    divider = page.locator("#log .divider")
    await expect(divider).to_have_text("new conversation", timeout=10_000)
    assert await page.input_value("#text") == "half-typed"
    fake_model.reply("Fresh answer.")
    await page.fill("#text", "second question")
    await page.press("#text", "Enter")
    await page.locator(".msg.bot", has_text="Fresh answer.").wait_for(timeout=10_000)
    # The model saw the new conversation alone.
    assert [m["content"] for m in fake_model.requests[-1]["messages"] if m["role"] != "system"] == [
        "second question"]

    await page.reload()
    await page.locator(".msg.bot", has_text="Fresh answer.").wait_for(timeout=10_000)
    entries = await page.locator("#log > .msg, #log > .divider").evaluate_all(
        "els => els.map(e => [e.className, e.textContent.trim().slice(0, 20)])")
    assert entries == [
        ["msg user", "first question"], ["msg bot", "First answer."],
        ["msg user command", "/help"], ["msg bot command", "Commands:/stop: stop"],
        ["msg user command", "/new"], ["msg bot command", "Started a fresh cont"],
        ["divider", "new conversation"],
        ["msg user", "second question"], ["msg bot", "Fresh answer."]]
    assert errors == []


TABLE = "| left | middle | right |\n|:--|:-:|--:|\n| a | b | c |\n| longer text | x | 12.50 |"
CODE = "Here:\n\n```python\ndef greet(name):\n    return f\"hi {name}\"  # <img src=x onerror=alert(1)>\n```"


async def test_code_is_highlighted_under_the_strict_policy(
        make_gateway: GatewayFactory, fake_model: FakeModel, browser: Browser) -> None:  # noqa: F811
    gw = await make_gateway()
    async with aiohttp.ClientSession() as http:
        async with http.get(base(gw) + "/") as resp:
            assert resp.headers["Content-Security-Policy"] == PAGE_CSP
    assert "'unsafe-inline'" not in PAGE_CSP and "style-src 'self'" in PAGE_CSP
    page, errors = await open_page(browser, web_page_url(gw))
    violations: list[str] = []
    page.on("console", lambda msg: violations.append(msg.text) if "Content Security Policy" in msg.text else None)
    fake_model.reply(CODE)
    await page.fill("#text", "show me")
    await page.press("#text", "Enter")
    bot = page.locator(".msg.bot:not(.pending)")
    await bot.locator("pre code").wait_for(timeout=10_000)
    code = bot.locator("pre code")
    assert await code.locator("span.hljs-keyword", has_text="def").count() == 1
    assert await code.locator("span.hljs-comment").count() == 1
    # The text is the same, character for character, and nothing in it became markup.
    assert await code.text_content() == 'def greet(name):\n    return f"hi {name}"  # <img src=x onerror=alert(1)>\n'
    assert await bot.locator("img, [onerror]").count() == 0
    assert await code.evaluate("e => getComputedStyle(e.querySelector('.hljs-keyword')).color") != \
        await code.evaluate("e => getComputedStyle(e).color")
    assert errors == [] and violations == []


async def test_table_columns_keep_their_alignment(make_gateway: GatewayFactory, fake_model: FakeModel,
                                                  browser: Browser) -> None:  # noqa: F811
    gw = await make_gateway()
    page, errors = await open_page(browser, web_page_url(gw))
    fake_model.reply(TABLE)
    await page.fill("#text", "a table")
    await page.press("#text", "Enter")
    bot = page.locator(".msg.bot:not(.pending)")
    await bot.locator("table").wait_for(timeout=10_000)
    aligns = await bot.locator("table tr").evaluate_all(
        "rows => rows.map(r => [...r.children].map(c => getComputedStyle(c).textAlign))")
    assert aligns == [["left", "center", "right"]] * 3
    assert errors == []
