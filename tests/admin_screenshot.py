"""A screenshot of the admin page for the README: a real gateway on the fake model and the
fake Telegram Bot API, a few chats, a stranger waiting for approval and one approved, a
model error, then the page in headless Chromium at 1280 px wide, one session opened.

    .venv/bin/python -m tests.admin_screenshot [OUT_DIR]     (default docs/img)

(`make screenshots` runs it too.) tests/test_admin_page.py runs it into a temporary
directory, so it keeps working."""

from __future__ import annotations

import asyncio
import sys
import tempfile
from datetime import UTC, datetime, timedelta
from pathlib import Path

from playwright.async_api import async_playwright

from gateway.app import Gateway
from gateway.config.load import load_config
from tests.conftest import chat, write_config
from tests.fakes.openai_server import FakeModel
from tests.fakes.telegram_server import FakeTelegram
from tests.web_screenshots import CHROMIUM, CHROMIUM_ARGS

TOKEN = "admin-screenshot-token-0123456789"
NAME = "admin_1280.png"
WEB_CHATS = [("alice", ["Plan my week", "Move the dentist to Friday", "Thanks!"]),
             ("bob", ["Summarize notes.md"]), ("carol", ["What's the time in Tokyo?", "And in Lima?"])]


async def take(out_dir: Path, chromium: str = CHROMIUM) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        async with FakeModel() as model:
            telegram = FakeTelegram()
            await telegram.start()
            config = write_config(Path(tmp), model, timezone="UTC", admins=["telegram:1"],
                                  http={"host": "127.0.0.1", "port": 0, "admin_token": TOKEN},
                                  model=model.model_settings(max_retries=0, timeout_s=10),
                                  channels={"telegram": {"enabled": True, "token": telegram.token,
                                                         "base_url": telegram.base_url,
                                                         "base_file_url": telegram.base_file_url,
                                                         "poll_timeout_s": 1}})
            gw = Gateway(load_config(config), config_path=config)
            await gw.start()
            try:
                await _stage(gw, model, telegram)
                assert gw.http is not None
                return await _shoot(f"http://127.0.0.1:{gw.http.port}/admin", out_dir / NAME, chromium)
            finally:
                await gw.stop(timeout=5)
                await telegram.stop()


async def _stage(gw: Gateway, model: FakeModel, telegram: FakeTelegram) -> None:
    for name, lines in WEB_CHATS:
        for line in lines:
            model.reply("Done.", usage=(900 + 40 * len(line), 60))
            await chat(gw, name, line)
    model.reply("Hello!", usage=(1200, 80))
    telegram.push_message(chat_id=1, user_id=1, text="hi from Telegram")
    telegram.push_message(chat_id=48213, user_id=48213, text="hello?")  # a stranger: gets a pairing code
    await telegram.wait_sent(2, timeout=10)
    code, _ = await gw.pairing.code_for("telegram:50017")  # approved earlier: listed with Revoke
    await gw.pairing.approve_code(code, by="telegram:1")
    model.error(503, {"error": {"message": "overloaded", "type": "server_error"}})
    await chat(gw, "bob", "And the tasks?")  # answered with the model's error: a warning in the log
    # Earlier days of usage, written the way a finished turn writes it.
    assert gw.services is not None
    today = datetime.now(UTC).date()  # the config's zone
    for back in range(1, 14):
        day = f"{today - timedelta(days=back):%Y-%m-%d}"
        for identity, scale in (("web:alice", 3), ("telegram:1", 2), ("web:carol", 1)):
            if (back * scale) % 4 == 0:
                continue
            turns = 1 + (back * scale) % 5
            await gw.services.store.end_turn("web", f"staged-{identity}-{back}", "answered",
                                             usage=(identity, day, turns * (700 + 90 * ((back + scale) % 7))))


async def _shoot(url: str, path: Path, chromium: str) -> Path:
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, headless=True)
        try:
            page = await browser.new_page(viewport={"width": 1280, "height": 900}, color_scheme="light")
            await page.goto(url)
            await page.fill("#token", TOKEN)
            await page.press("#token", "Enter")
            await page.locator("#sessions tbody tr").nth(3).wait_for(timeout=10_000)
            await page.locator("#pairings button.approve").wait_for(timeout=10_000)
            await page.locator("#errors li.warning").first.wait_for(timeout=10_000)
            await page.locator("#approved button.revoke").wait_for(timeout=10_000)
            await page.locator("#sessions tbody tr", has_text="web:alice").click()  # its messages and context
            await page.locator("#session-messages li").nth(5).wait_for(timeout=10_000)
            await page.evaluate("window.scrollTo(0, 0)")  # the sticky header back on top
            await page.screenshot(path=str(path), full_page=True)
        finally:
            await browser.close()
    return path


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("docs/img")
    print(asyncio.run(take(target)))
