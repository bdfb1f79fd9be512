"""Screenshots of the web chat for the README: a real gateway on the fake model, a short
conversation, then the page in headless Chromium at 1280 and 390 px wide.

    .venv/bin/python -m tests.web_screenshots [OUT_DIR]     (default docs/img)

(`make screenshots` does the same.) tests/test_web_page.py runs it into a temporary
directory, so it keeps working."""

from __future__ import annotations

import asyncio
import shutil
import sys
import tempfile
from pathlib import Path

from playwright.async_api import async_playwright

from gateway.app import Gateway
from gateway.config.load import load_config
from tests.conftest import web_client, web_page_url, write_config
from tests.fakes.openai_server import FakeModel

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic", "--hide-scrollbars"]
SIZES = {"web_chat_1280.png": (1280, 800), "web_chat_390.png": (390, 844)}

CONVERSATION = [
    ("What did I note about the trip?",
     "From **notes.md**:\n\n- Flight **LH 123**, Friday 9:40 from Berlin\n- Hotel *Casa Azul*, three nights\n"
     "- Still to do: book the [museum tickets](https://example.org/museum)\n\nShall I remind you on Thursday?"),
    ("A one-liner to count the lines of all .py files?",
     "```sh\nfind . -name '*.py' -print0 | xargs -0 wc -l | tail -n 1\n```\n\n"
     "It prints the total on the last line."),
    ("SQLite or PostgreSQL for one small server?",
     "| | SQLite | PostgreSQL |\n|---|---|---|\n| setup | a file | a service |\n"
     "| several gateways | no | yes |\n\nFor **one** server, SQLite is plenty."),
]


async def take(out_dir: Path, chromium: str = CHROMIUM) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        async with FakeModel() as model:
            config = write_config(Path(tmp), model)
            gw = Gateway(load_config(config), config_path=config)
            await gw.start()
            try:
                assert gw.http is not None
                base = f"http://127.0.0.1:{gw.http.port}"
                async with web_client(gw) as http:
                    for question, answer in CONVERSATION:
                        model.reply(answer)
                        async with http.post(base + "/api/chat", json={"session": "web-user", "text": question}) as r:
                            assert r.status == 200, await r.text()
                return await _shoot(web_page_url(gw), out_dir, chromium)
            finally:
                await gw.stop(timeout=5)


async def _shoot(link: str, out_dir: Path, chromium: str) -> list[Path]:
    """`link`: the page's address with its token (the page signs in and drops it from the address)."""
    saved = []
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, headless=True)
        try:
            for name, (width, height) in SIZES.items():
                page = await browser.new_page(viewport={"width": width, "height": height}, color_scheme="light")
                await page.goto(link)
                await page.locator(".msg.bot table").wait_for(timeout=10_000)
                await page.fill("#text", "Thanks! Add the museum to my to-do list")
                path = out_dir / name
                await page.screenshot(path=str(path))
                saved.append(path)
                await page.close()
        finally:
            await browser.close()
    return saved


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("docs/img")
    for shot in asyncio.run(take(target)):
        print(shot)
