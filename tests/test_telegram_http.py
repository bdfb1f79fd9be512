"""The aiohttp transport under python-telegram-bot (channels/telegram/transport.py), through the
library's own Bot against small local servers: uploads, timeouts, refused connections."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web
from telegram import Bot
from telegram.error import NetworkError, TimedOut

from channels.telegram.transport import AiohttpRequest

TOKEN = "123:abc"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def _serve(handler: Handler) -> AsyncIterator[str]:
    async def route(request: web.Request) -> web.StreamResponse:
        if request.match_info["method"] == "getMe":  # Bot.initialize asks who it is
            return web.json_response({"ok": True, "result": ME})
        return await handler(request)

    app = web.Application()
    app.router.add_route("*", "/bot{token}/{method}", route)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}/bot"
    finally:
        await runner.cleanup()


def _bot(base_url: str, **timeouts: float) -> Bot:
    return Bot(TOKEN, base_url=base_url, request=AiohttpRequest(pool_size=4, **timeouts))


ME = {"id": 1, "is_bot": True, "first_name": "b", "username": "b_bot"}
MESSAGE = {"message_id": 7, "date": 0, "chat": {"id": 5, "type": "private"}}


async def test_an_upload_arrives_as_multipart_with_its_fields() -> None:
    seen: dict[str, object] = {}

    async def handler(request: web.Request) -> web.Response:
        seen["method"] = request.match_info["method"]
        form = await request.post()
        for key, value in form.items():  # uploads are read here: their temp files close after
            seen[key] = (value.filename, value.file.read()) if isinstance(value, web.FileField) else value
        return web.json_response({"ok": True, "result": MESSAGE})

    async for base in _serve(handler):
        async with _bot(base) as bot:
            sent = await bot.send_document(chat_id=5, document=b"hello file", filename="note.txt", caption="cap")

    assert seen["method"] == "sendDocument" and seen["chat_id"] == "5" and seen["caption"] == "cap"
    assert seen["document"] == ("note.txt", b"hello file")
    assert sent.message_id == 7


async def test_plain_calls_send_their_parameters_and_read_the_answer() -> None:
    seen: dict[str, object] = {}

    async def handler(request: web.Request) -> web.Response:
        seen.update(await request.post())
        seen["agent"] = request.headers.get("User-Agent", "")
        return web.json_response({"ok": True, "result": MESSAGE})

    async for base in _serve(handler):
        async with _bot(base) as bot:
            sent = await bot.send_message(chat_id=5, text="héllo ✓")

    assert seen["text"] == "héllo ✓" and seen["chat_id"] == "5"
    assert "python-telegram-bot" in str(seen["agent"])
    assert sent.chat.id == 5


async def test_a_server_that_never_answers_is_timed_out() -> None:
    release = asyncio.Event()

    async def handler(request: web.Request) -> web.Response:
        await release.wait()  # holds the request until the test is done
        return web.json_response({"ok": True, "result": MESSAGE})

    async for base in _serve(handler):
        async with _bot(base) as bot:
            with pytest.raises(TimedOut):
                await bot.send_message(chat_id=5, text="hi", read_timeout=0.2, write_timeout=0.2)
        release.set()


async def test_a_refused_connection_is_a_network_error_not_a_timeout() -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    request = AiohttpRequest(pool_size=1)
    await request.initialize()
    try:
        with pytest.raises(NetworkError) as caught:
            await request.post(f"http://127.0.0.1:{port}/bot{TOKEN}/getMe")
    finally:
        await request.shutdown()
    assert not isinstance(caught.value, TimedOut)


async def test_the_environment_proxy_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    hosts: list[str] = []

    async def handler(request: web.Request) -> web.Response:
        hosts.append(request.host)
        return web.json_response({"ok": True, "result": MESSAGE})

    async for proxy in _serve(handler):
        monkeypatch.setenv("HTTP_PROXY", proxy.removesuffix("/bot"))
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        base = "http://api.telegram.test/bot"  # reachable only through the proxy
        bot = Bot(TOKEN, base_url=base, request=AiohttpRequest(pool_size=1, proxy_for=base))
        async with bot:
            await bot.send_message(chat_id=5, text="via the proxy")

    assert hosts == ["api.telegram.test"]  # getMe is answered by _serve's route itself
