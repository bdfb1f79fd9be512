"""The red team's findings H1, H2 and M1 (SPEC §9, §5.2, §5.4), reproduced through a whole
gateway: a page, a PDF and an image that are cheap to send and expensive to parse. Each is
read in a child process under limits (gateway.parsing); the tool answers with a clear
error, the person's image is kept as a file, and meanwhile other people are answered.

The hostile files are made here (tests/fakes/hostile_files.py); the limits are made small
so a test spends about a second of a child's CPU, not the real twenty."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from gateway.keys import workspace_dir
from gateway.parsing import jobs
from tests.conftest import GatewayFactory, chat
from tests.fakes import telegram_server, web_server
from tests.fakes.hostile_files import declared_huge_png, shared_stream_pdf, spinning_table_html
from tests.fakes.openai_server import FakeModel, Reply, ScriptedCall, last_user_text
from tests.fakes.telegram_server import FakeTelegram
from tests.fakes.web_server import FakeWeb

fake_web = web_server.fake_web  # the fixtures
fake_telegram = telegram_server.fake_telegram

CPU_S = 1  # a child's CPU in these tests: the hostile files need minutes
BUSY = "the gateway is busy reading other files"


@pytest.fixture
def small_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    for kind, limits in list(jobs.LIMITS.items()):
        monkeypatch.setitem(jobs.LIMITS, kind, replace(limits, cpu_s=CPU_S, wall_s=60))
    monkeypatch.setattr(jobs, "QUEUE_WAIT_S", 60.0)  # every job runs: none is turned away as busy


def reader_model(fake: FakeModel) -> None:
    """The model of these tests: "fetch URL" calls web_fetch, "read PATH" calls read_file,
    a tool's result is answered with that result, anything else is echoed."""
    ids = itertools.count(1)

    def answer(body: dict[str, Any]) -> Reply | None:
        last = body["messages"][-1]
        if last["role"] == "tool":
            return Reply(text=f"tool: {last['content']}")
        text = last_user_text(body)
        for verb, tool, key in (("fetch ", "web_fetch", "url"), ("read ", "read_file", "path")):
            if text.startswith(verb):
                call = ScriptedCall(tool, json.dumps({key: text[len(verb):]}), f"call_{next(ids)}")
                return Reply(tool_calls=(call,))
        return None

    fake.respond_with(answer)


async def eventually(check: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, f"not within {timeout} s: {what}"
        await asyncio.sleep(0.05)


def too_long(what: str) -> str:
    return f"tool: error: {what} took too long to read (over {CPU_S} s of CPU); it may be malformed"


# -- H1: a page that keeps the HTML extractor busy ---------------------------------------------


async def test_h1_a_spinning_page_is_stopped_and_the_gateway_keeps_answering(
        make_gateway: GatewayFactory, fake_model: FakeModel, fake_web: FakeWeb, small_limits: None) -> None:
    gw = await make_gateway(tools={"web_fetch": {"allow_private_networks": True}})
    reader_model(fake_model)
    url = fake_web.page("/tables.html", spinning_table_html(300))  # 14 KB; ~40 s of CPU in-process
    # Six at once: as many as the event loop's thread pool has threads on two cores.
    readers = [asyncio.create_task(chat(gw, f"reader{i}", f"fetch {url}")) for i in range(6)]
    await eventually(lambda: fake_web.paths().count("/tables.html") == 6, "all six pages fetched")
    # A new person is answered while the pages are being read.
    async with asyncio.timeout(30):
        assert await chat(gw, "newcomer", "hello") == "echo: hello"
    async with asyncio.timeout(120):
        replies = await asyncio.gather(*readers)
    assert replies == [too_long("the page")] * 6


# -- H2: a PDF whose pages share one heavy content stream --------------------------------------


async def test_h2_a_pdf_of_one_shared_stream_is_stopped_by_read_file_and_web_fetch(
        make_gateway: GatewayFactory, fake_model: FakeModel, fake_web: FakeWeb, small_limits: None) -> None:
    gw = await make_gateway(tools={"web_fetch": {"allow_private_networks": True}})
    assert gw.services is not None
    reader_model(fake_model)
    pdf = shared_stream_pdf(40, 100_000)  # 12 KB; ~100 s of CPU in-process
    url = fake_web.page("/report.pdf", pdf, content_type="application/pdf")
    for i in range(3):
        files = workspace_dir(gw.services.data_dir, f"web:filer{i}") / "files"
        files.mkdir(parents=True)
        (files / "report.pdf").write_bytes(pdf)
    readers = [asyncio.create_task(chat(gw, f"filer{i}", "read files/report.pdf")) for i in range(3)]
    readers += [asyncio.create_task(chat(gw, f"fetcher{i}", f"fetch {url}")) for i in range(3)]
    await eventually(lambda: fake_web.paths().count("/report.pdf") == 3, "the PDF fetched three times")
    async with asyncio.timeout(30):
        assert await chat(gw, "newcomer", "hello") == "echo: hello"
    async with asyncio.timeout(120):
        replies = await asyncio.gather(*readers)
    assert replies == [too_long("the PDF")] * 6


# -- M1: a small PNG that declares a huge size -------------------------------------------------


def peak_rss_kb() -> int:
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1))  # type: ignore[union-attr]


async def test_m1_a_png_declaring_a_huge_size_is_kept_as_a_file_without_being_decoded(
        make_gateway: GatewayFactory, fake_model: FakeModel, fake_telegram: FakeTelegram,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gateway.parsing")
    gw = await make_gateway(access={"dm_policy": "open"}, model=fake_model.model_settings(vision=True),
                            channels={"telegram": {"enabled": True, "token": fake_telegram.token,
                                                   "base_url": fake_telegram.base_url,
                                                   "base_file_url": fake_telegram.base_file_url,
                                                   "poll_timeout_s": 1}})
    assert gw.services is not None
    png = declared_huge_png(7745)  # ~190 KB; 180 MB of pixels once decoded
    fake_telegram.add_file("big", png, "documents/file_1.png")
    Path("/proc/self/clear_refs").write_text("5")  # from here VmHWM is this test's peak
    before = peak_rss_kb()
    fake_telegram.push_message(chat_id=5, user_id=5, caption="what is this?", document={
        "file_id": "big", "file_unique_id": "ub", "file_name": "wall.png", "mime_type": "image/png",
        "file_size": len(png)})
    shown = await fake_telegram.wait_shown(5, lambda shown: len(shown) == 2, timeout=30)
    grown_mb = (peak_rss_kb() - before) / 1024

    reason = "at 7745×7745 it has more pixels than I open (at most 16.8 million, as in 4096×4096)"
    assert shown[0] == f"I couldn't look at wall.png as an image: {reason}. It is saved as a file."
    note = f"what is this?\n[file: files/wall.png, {len(png) // 1024} KB; not shown as an image: {reason}]"
    assert shown[1] == f"echo: {note}"  # the turn went on
    assert fake_model.image_parts() == []
    # The (echoed) reply names files/wall.png, so the file follows it, as it is.
    await eventually(lambda: fake_telegram.uploads, "the file sent after the reply")
    assert [(name, data) for _, name, data in fake_telegram.uploads] == [("wall.png", png)]
    ws = workspace_dir(gw.services.data_dir, "telegram:user:5")
    assert (ws / "files/wall.png").read_bytes() == png
    assert sorted(p.name for p in (ws / "files").iterdir()) == ["wall.png"]  # no preview was made
    # The child refused it from the header, before decoding: it never held the pixels …
    (job,) = [r for r in caplog.records if getattr(r, "kind", None) == "image"]
    assert job.outcome == "refused" and job.peak_mb < 120, job.__dict__
    # … and the gateway's own process did not decode it either (180 MB, 897 MB at the red team's).
    assert grown_mb < 100, grown_mb
