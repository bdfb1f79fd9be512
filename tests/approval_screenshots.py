"""Screenshots of an approval card for the README (SPEC §5.7): a real gateway on the fake
model and the fake Telegram Bot API, the agent asking to run a command, then

- Telegram: there is no Telegram client here, so the card is drawn exactly as the Bot API
  was asked to show it (the sendMessage's text, entities and inline keyboard) in a small
  HTML mock-up of a chat, in headless Chromium;
- the web page: the card in the reply, in headless Chromium.

    .venv/bin/python -m tests.approval_screenshots [OUT_DIR]     (default docs/img)

(`make screenshots` runs it too.) tests/test_approval_buttons.py runs it into a temporary
directory, so it keeps working. The command is `exec`'s when the sandbox is available,
else the card asks for `current_time`; both are denied, so nothing runs."""

from __future__ import annotations

import asyncio
import html
import sys
import tempfile
from pathlib import Path
from typing import Any

from playwright.async_api import async_playwright

from gateway.app import Gateway
from gateway.config.load import load_config
from tests.conftest import web_page_url, write_config
from tests.fakes.openai_server import FakeModel
from tests.fakes.telegram_server import FakeTelegram
from tests.web_screenshots import CHROMIUM, CHROMIUM_ARGS

NAMES = ("approval_telegram.png", "approval_web.png")
QUESTION = "What takes the most space in my workspace?"
COMMAND = "du -sh /workspace/* 2>/dev/null | sort -h | tail -n 5"


async def take(out_dir: Path, chromium: str = CHROMIUM) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        async with FakeModel() as model:
            telegram = FakeTelegram()
            await telegram.start()
            config = write_config(
                Path(tmp), model, admins=["telegram:1", "web:web-user"], access={"dm_policy": "open"},
                tools={"exec": {"enabled": True}},
                approvals={"tools": {"exec": "ask", "current_time": "ask"}},
                channels={"telegram": {"enabled": True, "token": telegram.token, "base_url": telegram.base_url,
                                       "base_file_url": telegram.base_file_url, "poll_timeout_s": 1}})
            gw = Gateway(load_config(config), config_path=config)
            await gw.start()
            try:
                assert gw.services is not None and gw.http is not None
                call = ("exec", {"command": COMMAND}) if gw.services.tools.get("exec") is not None \
                    else ("current_time", {"timezone": "Asia/Tokyo"})
                sent = await _telegram_card(model, telegram, call)
                return [await _shoot_html(_telegram_page(sent, telegram.bot_username), out_dir / NAMES[0],
                                          chromium),
                        await _shoot_web(web_page_url(gw), model, call, out_dir / NAMES[1],
                                         chromium)]
            finally:
                await gw.stop(timeout=5)
                await telegram.stop()


async def _telegram_card(model: FakeModel, telegram: FakeTelegram, call: tuple[str, dict[str, Any]]) -> dict[str, Any]:
    """The sendMessage that showed the card; the card is then denied (nothing runs)."""
    model.tool_call(*call)
    model.reply("All right, I won't run it.")
    telegram.push_message(chat_id=1, user_id=1, text=QUESTION)
    await telegram.wait_calls("sendMessage", 1, timeout=15)
    sent = telegram.calls_of("sendMessage")[0]
    card = next(m for m in telegram.message_ids(1) if telegram.buttons(m))
    data = sent["reply_markup"]["inline_keyboard"][0][1]["callback_data"]
    await telegram.wait_answer(telegram.push_callback(chat_id=1, user_id=1, message_id=card, data=data))
    await telegram.wait_shown(1, lambda texts: "All right, I won't run it." in texts, timeout=15)
    return sent


def entities_html(text: str, entities: list[dict[str, Any]]) -> str:
    """Telegram text with its entities as HTML (offsets in UTF-16 units)."""
    index: dict[int, int] = {}
    units = 0
    for i, ch in enumerate(text):
        index[units] = i
        units += 2 if ord(ch) > 0xFFFF else 1
    index[units] = len(text)
    tags = {"bold": ("<b>", "</b>"), "code": ("<code>", "</code>"), "pre": ("<pre>", "</pre>"),
            "expandable_blockquote": ("<blockquote class=fold>", "</blockquote>"),
            "blockquote": ("<blockquote>", "</blockquote>")}
    opens: dict[int, list[str]] = {}
    closes: dict[int, list[str]] = {}
    for ent in entities:
        start, end = index[ent["offset"]], index[ent["offset"] + ent["length"]]
        tag = tags.get(ent["type"], ("<span>", "</span>"))
        opens.setdefault(start, []).append(tag[0])
        closes.setdefault(end, []).insert(0, tag[1])
    out: list[str] = []
    for i in range(len(text) + 1):
        out.extend(closes.get(i, []))
        out.extend(opens.get(i, []))
        if i < len(text):
            out.append(html.escape(text[i]))
    return "".join(out).replace("\n", "<br>").replace("<pre><br>", "<pre>")


def _telegram_page(sent: dict[str, Any], bot: str) -> str:
    rows = sent["reply_markup"]["inline_keyboard"]
    keyboard = "".join("<div class=row>" + "".join(f"<button>{html.escape(b['text'])}</button>" for b in row)
                       + "</div>" for row in rows)
    card = entities_html(sent["text"], sent.get("entities") or [])
    return f"""<!doctype html><meta charset=utf-8><style>
body {{ margin: 0; font: 15px/1.38 -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif;
  background: #b9d2a8 linear-gradient(160deg, #cfe0b4, #9fc3a0); width: 560px; }}
.top {{ background: #fff; padding: 10px 16px; border-bottom: 1px solid #dcdcdc; }}
.top b {{ display: block; }} .top span {{ color: #8a8a8a; font-size: 13px; }}
.chat {{ padding: 14px 12px 18px; display: flex; flex-direction: column; gap: 8px; }}
.me {{ align-self: flex-end; background: #effdde; border-radius: 12px 12px 4px 12px; padding: 7px 11px;
  max-width: 78%; box-shadow: 0 1px 1px rgba(0,0,0,.12); }}
.bot {{ align-self: flex-start; max-width: 86%; }}
.bubble {{ background: #fff; border-radius: 12px 12px 12px 4px; padding: 7px 11px;
  box-shadow: 0 1px 1px rgba(0,0,0,.12); word-wrap: break-word; }}
pre {{ background: #f2f4f7; border-left: 3px solid #3a8bd1; border-radius: 6px; padding: 6px 8px; margin: 4px 0;
  font: 13px/1.4 ui-monospace, Menlo, Consolas, monospace; white-space: pre-wrap; }}
code {{ font: 13px ui-monospace, Menlo, Consolas, monospace; color: #c4324b; }}
pre + br, blockquote + br {{ display: none; }}  /* a block ends its own line */
blockquote {{ border-left: 3px solid #3a8bd1; margin: 4px 0; padding: 2px 8px; background: #f2f7fc; }}
.row {{ display: flex; gap: 4px; margin-top: 4px; }}
.row button {{ flex: 1; border: 0; border-radius: 8px; padding: 9px; font: 600 14px inherit; color: #fff;
  background: rgba(60, 90, 70, .55); }}
</style>
<div class=top><b>Gateway</b><span>@{html.escape(bot)} · bot</span></div>
<div class=chat>
  <div class=me>{html.escape(QUESTION)}</div>
  <div class=bot><div class=bubble>{card}</div>{keyboard}</div>
</div>"""


async def _shoot_html(page_html: str, path: Path, chromium: str) -> Path:
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, headless=True)
        try:
            page = await browser.new_page(viewport={"width": 560, "height": 200}, device_scale_factor=2,
                                          color_scheme="light")
            await page.set_content(page_html)
            await page.screenshot(path=str(path), full_page=True)
        finally:
            await browser.close()
    return path


async def _shoot_web(url: str, model: FakeModel, call: tuple[str, dict[str, Any]], path: Path,
                     chromium: str) -> Path:
    model.tool_call(*call)
    model.reply("All right, I won't run it.")
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, headless=True)
        try:
            page = await browser.new_page(viewport={"width": 900, "height": 560}, color_scheme="light")
            await page.goto(url)
            await page.fill("#text", QUESTION)
            await page.press("#text", "Enter")
            card = page.locator(".msg.approval")
            await card.wait_for(timeout=15_000)
            await page.screenshot(path=str(path))
            await card.get_by_role("button", name="Deny").click()  # nothing runs
            await page.locator(".msg.approval.decided").wait_for(timeout=15_000)
        finally:
            await browser.close()
    return path


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("docs/img")
    for shot in asyncio.run(take(target)):
        print(shot)
