"""The data dir's web token (gateway/http/web_token.py): made once, 0600, reused, the same
for gateways that start together on one data dir, never read through a symlink."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from gateway.app import Gateway
from gateway.config.load import load_config
from gateway.http import web_token
from tests.conftest import write_config
from tests.fakes.openai_server import FakeModel


def test_the_token_is_made_once_private_and_long(tmp_path: Path) -> None:
    token = web_token.load_or_create(tmp_path / "data")
    path = tmp_path / "data" / "web-token"
    assert path.stat().st_mode & 0o777 == 0o600
    assert len(token) >= 43 and web_token.TOKEN_SHAPE.fullmatch(token)  # 32 random bytes, URL-safe
    assert web_token.load_or_create(tmp_path / "data") == token == web_token.read(tmp_path / "data")
    assert os.listdir(tmp_path / "data") == ["web-token"]  # no scratch file left behind
    assert web_token.load_or_create(tmp_path / "other") != token


def test_gateways_starting_together_on_one_data_dir_share_one_token(tmp_path: Path) -> None:
    for attempt in range(5):
        data = tmp_path / f"d{attempt}"
        data.mkdir()
        start = threading.Barrier(8)
        got: list[str] = []

        def make(data: Path = data, start: threading.Barrier = start, got: list[str] = got) -> None:
            start.wait()
            got.append(web_token.load_or_create(data))

        threads = [threading.Thread(target=make) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert len(got) == 8 and len(set(got)) == 1, got
        assert os.listdir(data) == ["web-token"]


def test_a_symlink_or_a_file_without_a_token_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("x" * 50)
    data = tmp_path / "data"
    data.mkdir()
    (data / "web-token").symlink_to(elsewhere)
    with pytest.raises(web_token.WebTokenError, match="cannot read"):
        web_token.load_or_create(data)
    (data / "web-token").unlink()
    (data / "web-token").write_text("short\n")
    with pytest.raises(web_token.WebTokenError, match="delete it"):
        web_token.load_or_create(data)


def test_a_token_file_others_may_read_is_made_private(tmp_path: Path) -> None:
    token = web_token.load_or_create(tmp_path)
    (tmp_path / "web-token").chmod(0o644)
    assert web_token.load_or_create(tmp_path) == token
    assert (tmp_path / "web-token").stat().st_mode & 0o777 == 0o600


def test_the_link_and_the_cookie() -> None:
    assert web_token.link("0.0.0.0", 8080, "abc") == "http://127.0.0.1:8080/?token=abc"
    assert web_token.link("::1", 8080, "abc") == "http://[::1]:8080/?token=abc"
    assert web_token.link("127.0.0.1", 1, "a b/c") == "http://127.0.0.1:1/?token=a%20b%2Fc"
    one, two = "t" * 43, "u" * 43
    assert web_token.cookie_name(one) != web_token.cookie_name(two)
    assert web_token.cookie_value(one) != web_token.cookie_value(two)
    assert one not in web_token.cookie_value(one) and one not in web_token.cookie_name(one)


async def test_a_restarted_gateway_keeps_its_token_and_a_configured_one_wins(
        fake_model: FakeModel, tmp_path: Path) -> None:
    path = write_config(tmp_path, fake_model)
    tokens = []
    for _ in range(2):
        gw = Gateway(load_config(path), config_path=path)
        await gw.start()
        try:
            tokens.append(gw.web_token)
            assert gw.web_link() is not None and str(gw.web_token) in str(gw.web_link())
        finally:
            await gw.stop(timeout=5)
    assert tokens[0] == tokens[1] == web_token.read(tmp_path / "data")
    path = write_config(tmp_path, fake_model, channels={"web": {"token": "configured-token-0123456789"}})
    gw = Gateway(load_config(path), config_path=path)
    await gw.start()
    try:
        assert gw.web_token == "configured-token-0123456789" and gw.web_link() is None
    finally:
        await gw.stop(timeout=5)
