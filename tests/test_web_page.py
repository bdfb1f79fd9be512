"""The chat page in a real headless browser (Debian's Chromium, driven by Playwright)."""

from __future__ import annotations

import os
import shutil

import pytest
from playwright.async_api import async_playwright

from tests.conftest import GatewayFactory
from tests.fakes.openai_server import FakeModel

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run", "--disable-quic"]


@pytest.fixture
def chromium_path() -> str:
    if not os.path.exists(CHROMIUM):
        pytest.skip("Debian's chromium is not installed (bash .ci/run installs it)")
    return CHROMIUM


async def test_chat_page_round_trip(make_gateway: GatewayFactory, fake_model: FakeModel, chromium_path: str) -> None:
    gw = await make_gateway()
    assert gw.http is not None
    fake_model.reply("Hello from the model <b>not bold</b>", delay=0.3)
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=chromium_path, args=ARGS, headless=True)
        try:
            page = await browser.new_page()
            await page.goto(f"http://127.0.0.1:{gw.http.port}/")
            await page.fill("#session", "browser-user")
            await page.fill("#text", "hi from the browser")
            await page.click("#send")
            await page.wait_for_selector("#thinking:not([hidden])", timeout=5000)
            bot = page.locator(".msg.bot")
            await bot.first.wait_for(timeout=10_000)
            assert await bot.first.text_content() == "Hello from the model <b>not bold</b>"
            assert await page.locator(".msg.bot b").count() == 0  # shown as text, never as HTML
            assert await page.locator(".msg.user").first.text_content() == "hi from the browser"
            assert await page.is_hidden("#thinking")
        finally:
            await browser.close()
    request = fake_model.requests[-1]
    assert request["messages"][-1]["content"] == "hi from the browser"
    assert gw.services is not None
    assert await gw.services.store.count_messages("web:browser-user") == 2
