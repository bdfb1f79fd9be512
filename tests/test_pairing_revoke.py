"""Taking a pairing approval back, from chat (`/revoke ID`) and from the command line
(`gateway pairing revoke ID`), with the real python-telegram-bot on the fake Bot API: the
revoked person is a stranger from their next message and gets a new pairing code. And the
operator's commands name one person one way (`telegram:7`) in usage, sessions and memory."""

from __future__ import annotations

import asyncio
import os
import re
import sys
from pathlib import Path

from gateway.app import Gateway
from tests.conftest import GatewayFactory
from tests.fakes import telegram_server
from tests.fakes.openai_server import FakeModel
from tests.fakes.telegram_server import FakeTelegram
from tests.test_e2e_telegram import telegram_section

fake_telegram = telegram_server.fake_telegram  # the fixture

ADMIN = 1
PERSON = 7
CODE = re.compile(r"pairing code is ([A-Z0-9]{8})")


async def _cli(*args: str, cwd: Path) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", *args, "--config", str(cwd / "config.json"), cwd=cwd,
        env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def _pair(fake: FakeTelegram, gw: Gateway) -> str:
    """The person writes, gets a code, and the admin approves it in chat; returns the code."""
    before = len(fake.sent)
    fake.push_message(chat_id=PERSON, user_id=PERSON, text="hello?")
    asked = (await fake.wait_sent(before + 1, timeout=10))[before]
    found = CODE.search(asked["text"])
    assert asked["chat_id"] == PERSON and found is not None, asked
    fake.push_message(chat_id=ADMIN, user_id=ADMIN, text=f"/approve {found.group(1)}")
    await fake.wait_sent(before + 3, timeout=10)  # the admin's answer and the person's notice
    assert await gw.pairing.is_approved(f"telegram:{PERSON}")
    return found.group(1)


async def _stranger_again(fake: FakeTelegram, model: FakeModel, old_code: str) -> None:
    before, asked = len(fake.sent), len(model.requests)
    fake.push_message(chat_id=PERSON, user_id=PERSON, text="are you there?")
    reply = (await fake.wait_sent(before + 1, timeout=10))[before]
    fresh = CODE.search(reply["text"])
    assert reply["chat_id"] == PERSON and fresh is not None and fresh.group(1) != old_code, reply
    assert len(model.requests) == asked  # a stranger never reaches the model


async def test_revoke_in_chat_and_from_the_cli_makes_a_stranger_again(
        make_gateway: GatewayFactory, fake_model: FakeModel, fake_telegram: FakeTelegram, tmp_path: Path) -> None:
    gw = await make_gateway(admins=[f"telegram:{ADMIN}"], channels=telegram_section(fake_telegram))
    code = await _pair(fake_telegram, gw)
    fake_model.reply("Hi again!")
    fake_telegram.push_message(chat_id=PERSON, user_id=PERSON, text="I'm in")
    assert (await fake_telegram.wait_sent(4, timeout=10))[3]["text"] == "Hi again!"

    # A person who is not an admin cannot revoke anyone (themselves included).
    fake_telegram.push_message(chat_id=PERSON, user_id=PERSON, text=f"/revoke telegram:{PERSON}")
    assert (await fake_telegram.wait_sent(5, timeout=10))[4]["text"] == "Only admins can revoke an approval."
    fake_telegram.push_message(chat_id=ADMIN, user_id=ADMIN, text="/revoke telegram:99")
    assert (await fake_telegram.wait_sent(6, timeout=10))[5]["text"] == (
        f"telegram:99 is not approved by pairing (approved: telegram:{PERSON}).")
    fake_telegram.push_message(chat_id=ADMIN, user_id=ADMIN, text=f"/revoke telegram:{PERSON}")
    answer = (await fake_telegram.wait_sent(7, timeout=10))[6]
    assert answer["chat_id"] == ADMIN
    assert answer["text"] == f"Revoked telegram:{PERSON}: from their next message they are asked to pair again."
    await _stranger_again(fake_telegram, fake_model, code)

    # Approved again, then revoked by the operator while the gateway runs.
    fake_telegram.push_message(chat_id=ADMIN, user_id=ADMIN, text="/approve " + CODE.search(
        fake_telegram.sent[-1]["text"]).group(1))  # type: ignore[union-attr]
    await fake_telegram.wait_sent(10, timeout=10)
    assert await gw.pairing.is_approved(f"telegram:{PERSON}")
    rc, out, err = await _cli("pairing", "list", cwd=tmp_path)
    assert rc == 0 and re.search(rf"^telegram:{PERSON}\s+\d+ s ago\s+telegram:{ADMIN}$", out, re.M), out
    rc, out, err = await _cli("pairing", "revoke", f"telegram:{PERSON}", cwd=tmp_path)
    assert rc == 0, err
    assert out.strip() == f"Revoked telegram:{PERSON}: from their next message they are asked to pair again."
    rc, _out, err = await _cli("pairing", "revoke", f"telegram:{PERSON}", cwd=tmp_path)
    assert rc == 1 and "is not approved by pairing" in err
    await _stranger_again(fake_telegram, fake_model, code)


async def test_revoking_someone_the_allowlist_lets_in_says_so(
        make_gateway: GatewayFactory, fake_telegram: FakeTelegram) -> None:
    gw = await make_gateway(admins=[f"telegram:{ADMIN}"], access={"allow_from": [f"telegram:{PERSON}"]},
                            channels=telegram_section(fake_telegram))
    await gw.pairing.store.run("INSERT INTO approved_users(identity, approved_by, approved_at) VALUES (?,?,?)",
                               (f"telegram:{PERSON}", "cli", 1.0))
    outcome = await gw.pairing.revoke(f"telegram:{PERSON}", by="test", cfg=gw.cfg)
    assert outcome.ok and outcome.text.endswith("They can still chat: access.allow_from lets them in.")


async def test_one_person_has_one_name_in_usage_sessions_and_memory(
        make_gateway: GatewayFactory, fake_model: FakeModel, fake_telegram: FakeTelegram, tmp_path: Path) -> None:
    gw = await make_gateway(access={"allow_from": [f"telegram:{PERSON}"]}, channels=telegram_section(fake_telegram))
    fake_model.reply("noted", usage=(120, 8))
    fake_telegram.push_message(chat_id=PERSON, user_id=PERSON, text="remember: tea")
    await fake_telegram.wait_sent(1, timeout=10)
    assert gw.services is not None and gw.services.memory is not None
    await gw.services.memory.append_memory_md(f"telegram:user:{PERSON}", "- likes tea")
    name = f"telegram:{PERSON}"

    rc, usage, err = await _cli("usage", cwd=tmp_path)
    assert rc == 0, err
    assert usage.splitlines()[1].split()[1] == "WHO" and usage.splitlines()[2].split()[1] == name
    rc, sessions, err = await _cli("sessions", cwd=tmp_path)
    assert rc == 0, err
    header, row = sessions.splitlines()[:2]
    assert header.split()[:2] == ["SESSION", "WHO"] and row.split()[:2] == [f"telegram:dm:{PERSON}", name]
    rc, scopes, err = await _cli("memory", cwd=tmp_path)
    assert rc == 0, err
    header, row = scopes.splitlines()[:2]
    assert header.split()[:2] == ["SCOPE", "WHO"] and row.split()[:2] == [f"telegram:user:{PERSON}", name]
    # The person's name opens their memory like the scope does.
    rc, by_name, err = await _cli("memory", name, cwd=tmp_path)
    assert rc == 0, err
    assert by_name.splitlines()[0] == f"scope telegram:user:{PERSON} ({name})"
    assert "MEMORY.md" in by_name
