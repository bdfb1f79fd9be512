"""The admin page in a real headless browser (Debian's Chromium, driven by Playwright):
the token prompt, a wrong token, the sessions after a chat, and a Telegram stranger
approved with a click who can then chat."""

from __future__ import annotations

import json
import re
from pathlib import Path

from playwright.async_api import Browser, expect

from tests.admin_screenshot import NAME, take
from tests.conftest import GatewayFactory, chat
from tests.fakes import telegram_server
from tests.fakes.openai_server import FakeModel
from tests.fakes.telegram_server import FakeTelegram
from tests.pg import PgServer, create_database
from tests.test_web_page import browser, chromium_path, open_page  # noqa: F401  (fixtures)

fake_telegram = telegram_server.fake_telegram  # the fixture
ADMIN = "admin-token-0123456789abcdef"
ROTATED = "admin-token-rotated-0123456789"


async def test_agents_their_bindings_and_each_sessions_agent_and_model(
        make_gateway: GatewayFactory, fake_model: FakeModel, browser: Browser) -> None:  # noqa: F811
    gw = await make_gateway(http={"admin_token": ADMIN}, models={"strong": {"name": "strong-model"}},
                            agents={"coder": {"model": "strong", "system_prompt": "You write code."}},
                            bindings=[{"match": {"channel": "web", "chat": "dev"}, "agent": "coder"}])
    assert gw.http is not None
    fake_model.respond_with(lambda body: "ok")
    await chat(gw, "dev", "fix it")
    await chat(gw, "alice", "hi")
    context = await browser.new_context()
    page, errors = await open_page(context, f"http://127.0.0.1:{gw.http.port}/admin")
    await page.fill("#token", ADMIN)
    await page.press("#token", "Enter")
    coder = page.locator("#agents tbody tr", has_text="coder")
    await coder.wait_for(timeout=5000)
    assert (await coder.locator("td").all_text_contents())[:4] == ["coder", "strong-model", "channel web, chat dev",
                                                                    "1"]
    default = await page.locator("#agents tbody tr", has_text="default").locator("td").all_text_contents()
    assert default[1] == fake_model.model_name and default[3] == "1"
    dev_row = page.locator("#sessions tbody tr", has_text="web:dev")
    await dev_row.wait_for(timeout=5000)  # the sessions table is fetched apart from the agents
    dev = await dev_row.locator("td").all_text_contents()
    assert dev[2:4] == ["coder", "strong-model"]
    assert errors == []
    await context.close()


async def test_the_token_prompt_then_sessions(make_gateway: GatewayFactory, fake_model: FakeModel,
                                              browser: Browser, tmp_path: Path) -> None:  # noqa: F811
    gw = await make_gateway(http={"admin_token": ADMIN})
    config_path = tmp_path / "config.json"
    assert gw.http is not None
    fake_model.reply("hello there")
    await chat(gw, "alice", "hi")
    context = await browser.new_context()
    page, errors = await open_page(context, f"http://127.0.0.1:{gw.http.port}/admin")
    await expect(page.locator("#login")).to_be_visible()
    assert await page.is_hidden("#dashboard")
    assert await page.evaluate("document.activeElement.id") == "token"

    await page.fill("#token", "not-the-token-0123456789")
    await page.press("#token", "Enter")
    await expect(page.locator("#login-error")).to_contain_text("did not accept that token", timeout=5000)
    assert await page.is_hidden("#dashboard")
    assert await page.evaluate("sessionStorage.getItem('gw.admin_token')") is None

    await page.fill("#token", ADMIN)
    await page.press("#token", "Enter")
    row = page.locator("#sessions tbody tr", has_text="web:alice")
    await row.wait_for(timeout=5000)
    cells = await row.locator("td").all_text_contents()
    assert cells[1] == "web" and cells[2] == "default" and cells[3] == fake_model.model_name
    assert cells[5] == "1" and int(cells[6]) > 0
    assert await page.locator("#sessions-total").text_content() == "(1)"
    await expect(page.locator("#channels")).to_contain_text("web")
    await expect(page.locator("#jobs tbody")).to_contain_text("purge")
    await expect(page.locator("#usage tbody")).to_contain_text("web:alice")
    assert await page.evaluate("sessionStorage.getItem('gw.admin_token')") == ADMIN

    # A new chat shows on refresh; a reload keeps the tab signed in.
    await chat(gw, "bob", "hello")
    await page.click("#refresh")
    await expect(page.locator("#sessions tbody tr").first).to_contain_text("web:bob", timeout=5000)
    await page.reload()
    await expect(page.locator("#sessions tbody tr")).to_have_count(2, timeout=5000)
    # The token is rotated under the page: the next request says so at the prompt.
    raw = json.loads(config_path.read_text())
    raw["http"]["admin_token"] = ROTATED
    config_path.write_text(json.dumps(raw))
    assert await gw.config_watcher().reload() is True
    await page.click("#refresh")
    await expect(page.locator("#login-error")).to_contain_text("did not accept that token", timeout=5000)
    assert await page.evaluate("sessionStorage.getItem('gw.admin_token')") is None
    await page.fill("#token", ROTATED)
    await page.press("#token", "Enter")
    await expect(page.locator("#sessions tbody tr")).to_have_count(2, timeout=5000)
    await page.click("#signout")
    await expect(page.locator("#login")).to_be_visible()
    assert await page.evaluate("sessionStorage.getItem('gw.admin_token')") is None
    assert errors == []


async def test_approving_a_stranger_by_click_tells_them_and_revoking_makes_them_a_stranger_again(
        make_gateway: GatewayFactory, fake_model: FakeModel, fake_telegram: FakeTelegram,
        browser: Browser) -> None:  # noqa: F811
    gw = await make_gateway(http={"admin_token": ADMIN}, channels={"telegram": {
        "enabled": True, "token": fake_telegram.token, "base_url": fake_telegram.base_url,
        "base_file_url": fake_telegram.base_file_url, "poll_timeout_s": 1}})
    assert gw.http is not None
    fake_telegram.push_message(chat_id=77, user_id=77, text="hello?")
    (refusal,) = await fake_telegram.wait_sent(1)
    code = re.search(r"pairing code is ([A-Z0-9]{8})", refusal["text"])
    assert code is not None and fake_model.requests == []

    page, errors = await open_page(browser, f"http://127.0.0.1:{gw.http.port}/admin")
    await page.fill("#token", ADMIN)
    await page.press("#token", "Enter")
    row = page.locator("#pairings tbody tr", has_text="telegram:77")
    await row.wait_for(timeout=5000)
    assert await row.locator("td").nth(1).text_content() == code.group(1)
    await expect(page.locator("#approved tbody")).to_contain_text("Nobody approved by pairing yet")
    await row.locator("button.approve").click()
    await expect(page.locator("#notice")).to_have_text("Approved telegram:77. They were told in their chat.",
                                                       timeout=5000)
    await expect(page.locator("#pairings tbody")).to_contain_text("No one is waiting", timeout=5000)
    # The person hears it in their chat, as with /approve.
    told = (await fake_telegram.wait_sent(2, timeout=10))[1]
    assert told["chat_id"] == 77 and told["text"].startswith("You're approved: you can chat with me now")

    fake_model.reply("Welcome aboard!")
    fake_telegram.push_message(chat_id=77, user_id=77, text="hello again")
    sent = await fake_telegram.wait_sent(3, timeout=10)
    assert sent[2]["chat_id"] == 77 and "Welcome aboard" in sent[2]["text"]
    assert fake_model.requests[-1]["messages"][-1]["content"] == "hello again"
    await page.click("#refresh")
    await expect(page.locator("#sessions tbody")).to_contain_text("telegram:dm:77", timeout=5000)
    await expect(page.locator("#channels")).to_contain_text("telegram")

    # Revoked on the page: their next message is a stranger's, answered with a new code.
    approved = page.locator("#approved tbody tr", has_text="telegram:77")
    assert (await approved.locator("td").all_text_contents())[2] == "admin-page"
    await approved.locator("button.revoke").click()
    await expect(page.locator("#notice")).to_contain_text("Revoked telegram:77", timeout=5000)
    await expect(page.locator("#approved tbody")).to_contain_text("Nobody approved by pairing yet", timeout=5000)
    asked = len(fake_model.requests)
    fake_telegram.push_message(chat_id=77, user_id=77, text="still there?")
    again = (await fake_telegram.wait_sent(4, timeout=10))[3]
    fresh = re.search(r"pairing code is ([A-Z0-9]{8})", again["text"])
    assert again["chat_id"] == 77 and fresh is not None and fresh.group(1) != code.group(1)
    assert len(fake_model.requests) == asked
    await page.click("#refresh")
    await expect(page.locator("#pairings tbody tr", has_text="telegram:77")).to_contain_text(fresh.group(1),
                                                                                         timeout=5000)
    assert errors == []


async def test_the_cluster_chip_names_who_receives_and_turns_red_without_anyone(
        make_gateway: GatewayFactory, fake_telegram: FakeTelegram, pg_server: PgServer,
        browser: Browser) -> None:  # noqa: F811
    gw = await make_gateway(http={"admin_token": ADMIN}, store={"url": await create_database(pg_server)},
                            channels={"telegram": {
                                "enabled": True, "token": fake_telegram.token, "base_url": fake_telegram.base_url,
                                "base_file_url": fake_telegram.base_file_url, "poll_timeout_s": 1}})
    assert gw.http is not None and gw.services is not None
    page, errors = await open_page(browser, f"http://127.0.0.1:{gw.http.port}/admin")
    await page.fill("#token", ADMIN)
    await page.press("#token", "Enter")
    chip = page.locator("#channels li", has_text="· this one ")
    await expect(chip).to_contain_text("1 gateway ·", timeout=5000)
    await expect(chip).to_contain_text("telegram received by this one")
    assert await chip.get_attribute("class") == "chip ok"
    # The lead's lease is gone from the database (as when the leader died and nobody took it).
    await gw.services.store.run("DELETE FROM leases WHERE name = 'leader:telegram'")  # type: ignore[attr-defined]
    await page.click("#refresh")
    await expect(chip).to_contain_text("nobody receives telegram", timeout=5000)
    assert await chip.get_attribute("class") == "chip bad"
    assert errors == []


async def test_the_page_is_off_without_a_token(make_gateway: GatewayFactory, browser: Browser) -> None:  # noqa: F811
    gw = await make_gateway()
    assert gw.http is not None
    page, _ = await open_page(browser, f"http://127.0.0.1:{gw.http.port}/admin")
    assert "set http.admin_token" in (await page.text_content("body") or "")


async def test_the_screenshot_script_still_works(chromium_path: str, tmp_path: Path) -> None:  # noqa: F811
    shot = await take(tmp_path, chromium_path)
    assert shot.name == NAME and shot.read_bytes().startswith(b"\x89PNG") and shot.stat().st_size > 30_000


async def test_a_session_opens_on_click_and_the_model_state_shows_errors_and_fallbacks(
        make_gateway: GatewayFactory, fake_model: FakeModel, browser: Browser) -> None:  # noqa: F811
    gw = await make_gateway(http={"admin_token": ADMIN}, model={"fallbacks": ["backup"], "max_retries": 0},
                            models={"backup": {"name": "backup-model"}})
    assert gw.http is not None
    fake_model.error(503, {"error": {"message": "the provider is overloaded"}})
    fake_model.reply("Answered by the backup")
    assert await chat(gw, "alice", "first question") == "Answered by the backup"
    fake_model.reply("Second answer")
    assert await chat(gw, "alice", "second question") == "Second answer"
    await chat(gw, "bob", "hello")

    context = await browser.new_context()
    page, errors = await open_page(context, f"http://127.0.0.1:{gw.http.port}/admin")
    await page.fill("#token", ADMIN)
    await page.press("#token", "Enter")
    # The model's state: its calls, its last error in words, the fallback it used.
    main = page.locator("#models li", has_text=fake_model.model_name)
    await expect(main).to_contain_text("3 calls · 1 failed", timeout=5000)
    await expect(main).to_contain_text("server error (HTTP 503): the provider is overloaded")
    assert await main.get_attribute("class") == "chip ok"  # it answered since
    await expect(page.locator("#models li", has_text="backup-model")).to_contain_text("1 calls · 0 failed")
    await expect(page.locator("#fallbacks")).to_have_text(
        f"Fallbacks used: {fake_model.model_name} → backup-model (1×)")
    # Tool sources in plain words.
    chips = await page.locator("#tool-sources li strong").all_text_contents()
    assert chips == ["Web tools", "Running commands (exec)"]

    await page.locator("#sessions tbody tr", has_text="web:alice").click()
    view = page.locator("#session-section")
    await expect(view).to_be_visible(timeout=5000)
    await expect(page.locator("#session-key")).to_have_text("web:alice")
    texts = await page.locator("#session-messages li .text").all_text_contents()
    assert texts == ["first question", "Answered by the backup", "second question", "Second answer"]
    numbers = await page.locator("#session-context div").all_text_contents()
    assert "turns2 of 20" in numbers and "summarynone" in numbers, numbers
    assert any(n.startswith("tokens") and "of 50,000" in n for n in numbers), numbers
    await expect(page.locator("#session-meta")).to_contain_text(f"model {fake_model.model_name}")
    # Another session replaces it; Close hides it.
    await page.locator("#sessions tbody tr button.open-session", has_text="web:bob").click()
    await expect(page.locator("#session-key")).to_have_text("web:bob", timeout=5000)
    assert (await page.locator("#session-messages li .text").all_text_contents())[0] == "hello"
    await page.click("#session-close")
    await expect(view).to_be_hidden()
    assert errors == []
    await context.close()
