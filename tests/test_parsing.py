"""Parse jobs in child processes (gateway.parsing, SPEC §9): every limit is tried by a file
built to exhaust it, and the child is looked at from outside through /proc (its
environment, its limits, whether it is gone). The limits are made small so a test spends a
second or two of a child's CPU."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import textwrap
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from gateway.config.load import parse_config
from gateway.media import ImageInfo, image_for_model, save_tool_image
from gateway.parsing import jobs
from gateway.parsing.jobs import ParseError
from gateway.parsing.readers import ImageRefused, read_html, read_pdf
from gateway.tools.base import ToolContext, ToolError
from gateway.tools.read_file import ReadFile
from gateway.tools.web_fetch import WebFetch
from tests.fakes import web_server
from tests.fakes.hostile_files import declared_huge_png, shared_stream_pdf, spinning_table_html
from tests.fakes.media_files import make_image, make_pdf
from tests.fakes.web_server import FakeWeb

fake_web = web_server.fake_web  # the fixture

SPINNING = spinning_table_html(300)  # ~40 s of CPU, ~700 MB in-process
ARTICLE = ("<!doctype html><html><head><title>Otters</title></head><body><article><h1>Otters</h1>"
           + "".join(f"<p>Otter fact {i}: sea otters crack shellfish open with stones.</p>" for i in range(60))
           + "</article></body></html>")


def set_limits(monkeypatch: pytest.MonkeyPatch, kind: str, **changes: Any) -> jobs.Limits:
    limits = replace(jobs.LIMITS[kind], **changes)
    monkeypatch.setitem(jobs.LIMITS, kind, limits)
    return limits


def parse_children() -> list[int]:
    """This process's children that are parse jobs (a zombie has no command line: it
    shows in `children_states`)."""
    found = []
    for pid in children_states():
        try:
            if b"gateway.parsing.child" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            pass
    return found


def children_states() -> dict[int, str]:
    """pid → state letter of every child of this process (Z: a zombie)."""
    me = os.getpid()
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == me:
            out[int(entry.name)] = state
    return out


def gone(pid: int) -> bool:
    """Not running: no such process, or a zombie nobody reaped (judged by its state)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


async def eventually(check: Callable[[], Any], what: str, timeout: float = 30) -> Any:
    deadline = asyncio.get_running_loop().time() + timeout
    while not (found := check()):
        assert asyncio.get_running_loop().time() < deadline, f"not within {timeout} s: {what}"
        await asyncio.sleep(0.02)
    return found


def cpu_ticks(pid: int) -> int:
    """The CPU a process used, in clock ticks (utime + stime of /proc/PID/stat); 0 once gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])


def limits_of(pid: int) -> dict[str, tuple[str, str]]:
    """/proc/PID/limits: name → (soft, hard)."""
    out = {}
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines()[1:]:
        name, soft, hard = line[:26].strip(), *line[26:].split()[:2]
        out[name] = (soft, hard)
    return out


# -- the child's confinement -------------------------------------------------------------------


async def test_a_child_starts_with_no_environment_and_its_limits_and_goes_when_the_call_is_cancelled(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_TEST_SECRET", "s3cret-token")  # in the gateway's environment …
    limits = set_limits(monkeypatch, "html", cpu_s=30, wall_s=60)
    reading = asyncio.create_task(read_html(SPINNING, None))
    (pid,) = await eventually(parse_children, "the child started")
    assert Path(f"/proc/{pid}/environ").read_bytes() == b""  # … never in the child's
    expected = {"Max cpu time": ("30", "31"), "Max address space": (str(limits.memory_mb << 20),) * 2,
                "Max core file size": ("0", "0"), "Max file size": ("0", "0")}
    # The child sets them itself, before it reads its input.
    await eventually(lambda: all(limits_of(pid).get(k) == v for k, v in expected.items()), "the child's limits")
    reading.cancel()  # the agent gave up on the tool
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(20):  # a kill takes milliseconds; left alone, the page takes ~40 s of CPU
            await reading
    assert not Path(f"/proc/{pid}").exists()  # killed and reaped before the call returned
    assert children_states() == {}


async def test_a_child_over_its_cpu_time_is_stopped_with_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    set_limits(monkeypatch, "html", cpu_s=1, wall_s=60)
    with pytest.raises(ParseError) as caught:
        await read_html(SPINNING, None)
    assert str(caught.value) == "the page took too long to read (over 1 s of CPU); it may be malformed"
    assert children_states() == {}


async def test_a_child_past_its_wall_clock_is_killed_and_reaped(monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gateway.parsing")
    set_limits(monkeypatch, "pdf", cpu_s=60, wall_s=1)
    with pytest.raises(ParseError) as caught:
        await read_pdf(data=shared_stream_pdf(40, 100_000))
    assert str(caught.value) == "the PDF took too long to read (over 1 s); it may be malformed"
    (job,) = [r for r in caplog.records if getattr(r, "outcome", None) == "wall"]
    assert not Path(f"/proc/{job.pid}").exists()  # no zombie, no orphan still spinning
    assert children_states() == {}


async def test_a_child_over_its_memory_is_stopped_with_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    set_limits(monkeypatch, "html", cpu_s=60, wall_s=120, memory_mb=120)  # trafilatura alone needs ~80 MB
    with pytest.raises(ParseError) as caught:
        await read_html(spinning_table_html(400), None)  # ~1 GB in-process
    assert str(caught.value) == ("the page needs more memory to read than allowed (over 120 MB); "
                                 "it may be malformed")
    assert children_states() == {}


async def test_a_reader_that_dies_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    set_limits(monkeypatch, "pdf", memory_mb=1)  # the interpreter cannot go on once it limits itself
    with pytest.raises(ParseError) as caught:
        await read_pdf(data=make_pdf(["hello"], "T"))
    assert str(caught.value) == "the PDF could not be read: the reader stopped (exit status 1); it may be malformed"
    assert children_states() == {}


async def test_an_answer_over_its_cap_is_not_read(monkeypatch: pytest.MonkeyPatch) -> None:
    set_limits(monkeypatch, "html", output_mb=0)
    monkeypatch.setattr(jobs, "HEADER_MAX_BYTES", 1000)  # the page's text is ~3,500 characters
    with pytest.raises(ParseError, match=r"^the page could not be read: what it holds is larger than"):
        await read_html(ARTICLE.encode(), "utf-8")
    assert children_states() == {}


async def test_a_burst_of_jobs_runs_a_few_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    set_limits(monkeypatch, "html", cpu_s=1, wall_s=60)
    monkeypatch.setattr(jobs, "QUEUE_WAIT_S", 0.3)  # far less than a job's second of CPU
    most = 0
    done = asyncio.Event()

    async def watch() -> None:
        nonlocal most
        while not done.is_set():
            most = max(most, len(parse_children()))
            await asyncio.sleep(0.01)

    watcher = asyncio.create_task(watch())
    results = await asyncio.gather(*(read_html(SPINNING, None) for _ in range(5)), return_exceptions=True)
    done.set()
    await watcher
    messages = sorted(str(r) for r in results)
    busy = f"the page was not read: {jobs.BUSY}"
    too_long = "the page took too long to read (over 1 s of CPU); it may be malformed"
    assert messages == sorted([busy] * 3 + [too_long] * 2)
    assert 1 <= most <= jobs.LANE_JOBS["documents"] == 2


async def test_a_gateway_that_dies_takes_its_parse_jobs_with_it(tmp_path: Path) -> None:
    script = textwrap.dedent("""
        import asyncio, dataclasses, sys
        from gateway.parsing import jobs, readers
        from tests.fakes.hostile_files import spinning_table_html
        jobs.LIMITS["html"] = dataclasses.replace(jobs.LIMITS["html"], cpu_s=120, wall_s=240)
        asyncio.run(readers.read_html(spinning_table_html(300), None))
    """)
    gateway = await asyncio.create_subprocess_exec(sys.executable, "-c", script, cwd=jobs.ROOT,
                                                   stdout=asyncio.subprocess.DEVNULL)
    child = None
    try:
        def its_job() -> int | None:
            for entry in Path("/proc").iterdir():
                try:
                    if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) \
                            == gateway.pid and b"gateway.parsing.child" in (entry / "cmdline").read_bytes():
                        return int(entry.name)
                except OSError:
                    continue
            return None

        child = await eventually(its_job, "the gateway's parse job started")
        await eventually(lambda: cpu_ticks(child) >= 50, "the parse job busy with the page")  # past its start
        gateway.kill()
        await gateway.wait()
        # Without PR_SET_PDEATHSIG it would spin on for its two minutes of CPU.
        await eventually(lambda: gone(child), "the orphaned parse job ended", timeout=20)
    finally:
        if gateway.returncode is None:
            gateway.kill()
            await gateway.wait()
        if child is not None and not gone(child):  # the test failed: leave nothing spinning
            os.kill(child, signal.SIGKILL)


# -- the event loop's threads ------------------------------------------------------------------

PARSER_DIRS = tuple(str(Path(m.__file__).parent) for m in (__import__("trafilatura"), __import__("pypdf"),
                                                            __import__("PIL"), __import__("lxml")))


class WatchedPool(ThreadPoolExecutor):
    """The loop's default executor, noting every call into a parser library on its threads."""

    def __init__(self) -> None:
        super().__init__(max_workers=4)
        self.parsers_seen: set[str] = set()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        def watched() -> Any:
            def profile(frame: Any, event: str, _arg: Any) -> None:
                if event == "call" and frame.f_code.co_filename.startswith(PARSER_DIRS):
                    self.parsers_seen.add(frame.f_code.co_filename)

            sys.setprofile(profile)
            try:
                return fn(*args, **kwargs)
            finally:
                sys.setprofile(None)

        return super().submit(watched)


async def test_the_event_loops_threads_never_run_a_parser(fake_web: FakeWeb, tmp_path: Path) -> None:
    pool = WatchedPool()
    asyncio.get_running_loop().set_default_executor(pool)
    assert threading.current_thread() is threading.main_thread()
    cfg = parse_config({"tools": {"web_fetch": {"allow_private_networks": True}}}, environ={})
    ctx = ToolContext(session_key="web:dm:t", scope="web:t", workspace=tmp_path, config=cfg)
    page = fake_web.page("/otters.html", ARTICLE)
    pdf = make_pdf(["Quarterly report", "Stones: 1234"], "Report", pages=2)
    doc = fake_web.page("/report.pdf", pdf, content_type="application/pdf")
    assert "Otter fact 59: sea otters crack shellfish" in (await WebFetch().run({"url": page}, ctx)).text
    assert "Stones: 1234" in (await WebFetch().run({"url": doc}, ctx)).text
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "report.pdf").write_bytes(pdf)
    assert "--- page 2 of 2 ---" in (await ReadFile().run({"path": "files/report.pdf"}, ctx)).text
    (tmp_path / "files" / "photo.png").write_bytes(make_image(2000, 1500))
    info = await image_for_model(tmp_path, "files/photo.png")
    assert isinstance(info, ImageInfo) and (info.width, info.height) == (1568, 1176)
    assert pool.parsers_seen == set()
    pool.shutdown(wait=True)


# -- images: memory bounded by what is decoded -------------------------------------------------


def saved(ws: Path, name: str, data: bytes) -> str:
    (ws / "files").mkdir(parents=True, exist_ok=True)
    (ws / "files" / name).write_bytes(data)
    return f"files/{name}"


async def test_a_large_jpeg_is_decoded_at_a_reduced_scale(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="gateway.parsing")
    rel = saved(tmp_path, "camera.jpg", make_image(6000, 4000, fmt="JPEG"))  # 24 MP: over the budget in full
    info = await image_for_model(tmp_path, rel)
    assert isinstance(info, ImageInfo) and (info.width, info.height) == (1568, 1045)
    assert (info.original_width, info.original_height) == (6000, 4000)
    (job,) = [r for r in caplog.records if getattr(r, "kind", None) == "image"]
    assert job.outcome == "ok" and job.peak_mb < 100  # decoded at 3000×2000: 18 MB, not 72
    rel = saved(tmp_path, "pano.jpg", make_image(18000, 1000, fmt="JPEG"))  # a panorama: one side is short
    info = await image_for_model(tmp_path, rel)
    assert isinstance(info, ImageInfo) and (info.width, info.height) == (1568, 87)


async def test_other_formats_over_the_budget_are_kept_as_files(tmp_path: Path) -> None:
    rel = saved(tmp_path, "scan.png", declared_huge_png(4200))  # 17.6 MP
    seen = await image_for_model(tmp_path, rel)
    assert seen == ImageRefused("at 4200×4200 it has more pixels than I open (at most 16.8 million, as in 4096×4096)")
    rel = saved(tmp_path, "huge.png", declared_huge_png(8000))  # 64 MP: not even opened, JPEG or not
    seen = await image_for_model(tmp_path, rel)
    assert seen == ImageRefused("at 8000×8000 it has more pixels than I open (at most 60.0 million, as in 7745×7745)")
    assert sorted(p.name for p in (tmp_path / "files").iterdir()) == ["huge.png", "scan.png"]  # no copies


async def test_a_tools_huge_image_is_kept_as_a_file_with_a_line_that_says_why(tmp_path: Path) -> None:
    import base64

    data = base64.b64encode(declared_huge_png(7745)).decode()
    att, line = await save_tool_image(tmp_path, "chart.png", "image/png", data, 20 << 20)
    assert att.kind == "file" and att.path == "files/chart.png"
    assert line == (f"[file from the tool: files/chart.png, {att.size // 1024} KB, not shown as an image: "
                    "at 7745×7745 it has more pixels than I open (at most 16.8 million, as in 4096×4096)]")


async def test_an_image_job_that_fails_keeps_the_file_and_says_why(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    set_limits(monkeypatch, "image", memory_mb=60)  # Pillow loaded (~30 MB) and 3000×3000 decoded (27 MB) do not fit
    rel = saved(tmp_path, "poster.png", make_image(3000, 3000))
    seen = await image_for_model(tmp_path, rel)
    assert seen == ImageRefused("it needs more memory to read than allowed (over 60 MB); it may be malformed")
    with Image.open(tmp_path / rel) as img:
        assert img.size == (3000, 3000)
    assert sorted(p.name for p in (tmp_path / "files").iterdir()) == ["poster.png"]


# -- read_file keeps a PDF's text --------------------------------------------------------------


async def test_read_file_reads_a_pdf_once_and_continues_from_its_text(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="gateway.parsing")
    cfg = parse_config({}, environ={})
    ctx = ToolContext(session_key="web:dm:t", scope="web:t", workspace=tmp_path, config=cfg)
    (tmp_path / "report.pdf").write_bytes(make_pdf(["Quarterly report"], "Q", pages=3))
    first = await ReadFile().run({"path": "report.pdf"}, ctx)
    again = await ReadFile().run({"path": "report.pdf", "offset": 10}, ctx)
    assert first.text.startswith("--- page 1 of 3 ---\nQuarterly report (page 1)")
    assert again.text == first.text[10:]
    assert len([r for r in caplog.records if getattr(r, "kind", None) == "pdf"]) == 1  # one child, then the cache
    (tmp_path / "broken.pdf").write_bytes(b"%PDF-1.4\n" + b"\x00garbage" * 100)
    with pytest.raises(ToolError, match=r"^the PDF could not be read \("):
        await ReadFile().run({"path": "broken.pdf"}, ctx)
