"""A crash mid-stream (SPEC §5.1): `python -m gateway run` is SIGKILLed while a long reply
is growing in a Telegram message, then started again. The turn is answered once: the
message already shown is edited to the final text (no second message), and what the
person sees is exactly the stored final reply.

The gateway runs as a child process (bench/_procs.py), the fake Bot API and the fake model
in this process; the kill comes from inside the fake's editMessageText handler, after the
edit was applied and before the gateway hears back."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from aiohttp import web

from bench._procs import Child, gateway_config, start_gateway, telegram_section
from channels.telegram.format import render_markdown
from gateway.store.sqlite import Store
from tests.fakes.openai_server import FakeModel, Reply
from tests.test_reliability_crash import CrashTelegram, Killer
from tests.test_telegram_stream import pieces

CHAT = 9
INTERVAL_S = 0.2  # stream_interval_s, and the fake's edit rule per chat to match
REPLY = "\n\n".join(
    f"## Part {n} 🚀\n\nSome **bold** words, `code {n}`, 日本語のテキスト {n} and emoji 🎉: "
    + " ".join(f"word{n}_{k}" for k in range(30))
    for n in range(8)
)  # about 2,600 characters: one Telegram message, streamed over about 1.2 s


class EditKillTelegram(CrashTelegram):
    """The crash tests' fake Bot API with one more kill point: an applied edit."""

    def __init__(self, killer: Killer) -> None:
        super().__init__(killer)
        self.edit_interval_s = INTERVAL_S

    async def _api_editmessagetext(self, params: dict[str, Any]) -> web.Response:
        response = await super()._api_editmessagetext(params)
        if response.status == 200:
            self.killer.hit("edit")  # shown; the gateway never learns that it was
        return response


async def _start(config: Path, log: Path, telegram: EditKillTelegram) -> Child:
    polls = len(telegram.calls_of("getUpdates"))
    child = await start_gateway(config, log)
    await telegram.wait_until(lambda: len(telegram.calls_of("getUpdates")) > polls, 30, "the first poll")
    return child


async def test_a_reply_killed_mid_stream_is_finished_in_the_message_already_shown(tmp_path: Path) -> None:
    assert len(REPLY) < 4000 and len(render_markdown(REPLY)) == 1
    killer = Killer()
    telegram = EditKillTelegram(killer)
    model = FakeModel()
    server_log = logging.getLogger("aiohttp.server")  # a killed client leaves "Connection lost"
    level = server_log.level
    server_log.setLevel(logging.CRITICAL)
    await telegram.start()
    await model.start()
    # Every call streams the same long reply: the first is cut by the kill, the resumed
    # turn asks again.
    model.respond_with(lambda body: Reply(text=REPLY, chunks=tuple(pieces(REPLY, 65)), chunk_delay=0.03))
    config = gateway_config(tmp_path, model.base_url, stream_interval_s=INTERVAL_S,
                            telegram=telegram_section(telegram.base_url, telegram.base_file_url, telegram.token,
                                                      poll_timeout_s=1) | {"streaming": "edit"})
    child: Child | None = None
    try:
        telegram.push_message(chat_id=CHAT, user_id=CHAT, text="tell me everything")
        child = await _start(config, tmp_path / "gateway-1.log", telegram)
        fired = killer.arm(child.pid, "edit", 2)
        await asyncio.wait_for(fired, 30)
        await child.kill()
        [shown_id] = telegram.message_ids(CHAT)
        [partial] = telegram.shown(CHAT)
        assert 0 < len(partial) < len(render_markdown(REPLY)[0].text), "killed while the reply was growing"
        assert len(model.requests) == 1

        child = await _start(config, tmp_path / "gateway-2.log", telegram)
        final = render_markdown(REPLY)[0].text
        await telegram.wait_until(lambda: final in telegram.shown(CHAT), 30, "the final text")
        assert await child.stop(timeout=30) == 0
    finally:
        killer.disarm()
        if child is not None and child.returncode is None:
            await child.kill()
        await telegram.stop()
        await model.stop()
        server_log.setLevel(level)

    # Answered once: the message shown before the kill is the one that holds the reply.
    assert telegram.shown(CHAT) == [final]
    assert len(telegram.sent) == 1 and telegram.deleted == []
    assert telegram.message_ids(CHAT) == [shown_id]
    assert len(model.requests) == 2  # the resumed turn asked the model again
    store = await Store.open(tmp_path / "data" / "gateway.sqlite3")
    try:
        rows = await store.messages(f"telegram:dm:{CHAT}")
        assert [m.role for m in rows] == ["user", "assistant"]
        chunks = render_markdown(rows[-1].content)
        [message] = telegram.shown_parsed(CHAT)
        assert [(message.text, message.entities)] == [(c.text, list(c.entities)) for c in chunks]
        async with store.connection.execute("SELECT status FROM events") as cur:
            assert [row[0] for row in await cur.fetchall()] == ["answered"]
    finally:
        await store.close()
