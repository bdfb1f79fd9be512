"""The shell's side of images, voice and files (SPEC §5.4): downloads capped while they
stream, images measured and scaled with Pillow, voice transcribed through the fake
OpenAI-compatible endpoint, image parts turned into data URLs, PDFs read by read_file."""

from __future__ import annotations

import asyncio
import base64
import io
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from PIL import Image

from gateway.config.load import parse_config
from gateway.config.schema import Config
from gateway.media import FileRefused, Media, prepare_image, save_download
from gateway.model.errors import ModelError
from gateway.model.transcribe import Transcriber, TranscriptionSettings
from gateway.tools.base import ToolContext, ToolError
from gateway.tools.read_file import ReadFile
from gateway.types import Attachment, Inbound
from tests.fakes.media_files import make_image, make_ogg_opus, make_pdf, ogg_pages
from tests.fakes.openai_server import FakeModel


async def chunks_of(data: bytes, size: int = 7000) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        await asyncio.sleep(0)
        yield data[i:i + size]


# -- downloads -------------------------------------------------------------------------------


async def test_a_download_gets_a_safe_unique_name(tmp_path: Path) -> None:
    first = await save_download(chunks_of(b"one"), tmp_path, "../../etc/report 1.pdf", limit=100)
    second = await save_download(chunks_of(b"two"), tmp_path, "report 1.pdf", limit=100)
    assert first == ("files/report_1.pdf", 3) and second == ("files/report_1-2.pdf", 3)
    assert (tmp_path / "files" / "report_1.pdf").read_bytes() == b"one"
    assert oct((tmp_path / "files" / "report_1-2.pdf").stat().st_mode & 0o777) == "0o600"
    assert oct((tmp_path / "files").stat().st_mode & 0o777) == "0o700"


async def test_a_download_is_cut_off_at_the_limit_and_leaves_nothing(tmp_path: Path) -> None:
    read = 0

    async def endless() -> AsyncIterator[bytes]:
        nonlocal read
        while True:
            read += 4096
            yield b"x" * 4096

    with pytest.raises(FileRefused, match="larger than 20 KB"):
        await save_download(endless(), tmp_path, "big.bin", limit=20 * 1024)
    assert read <= 24 * 1024  # it stopped reading right after the limit
    assert list((tmp_path / "files").iterdir()) == []


async def test_a_download_cancelled_at_any_point_leaves_no_file_and_no_descriptor(tmp_path: Path) -> None:
    async def slow() -> AsyncIterator[bytes]:
        while True:
            await asyncio.sleep(0)
            yield b"x" * 100

    await save_download(chunks_of(b"warm"), tmp_path, "warm.txt", limit=100)  # files/ exists; threads started
    (tmp_path / "files" / "warm.txt").unlink()
    descriptors = len(os.listdir("/proc/self/fd"))
    for ticks in range(12):  # cancelled while files/ is opened and the name reserved, or while it streams
        task = asyncio.ensure_future(save_download(slow(), tmp_path, "doc.txt", limit=1 << 30))
        for _ in range(ticks):
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert list((tmp_path / "files").iterdir()) == []
    assert len(os.listdir("/proc/self/fd")) == descriptors


async def test_a_download_into_a_planted_link_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "files").symlink_to(outside)
    with pytest.raises(ValueError, match="outside the workspace"):
        await save_download(chunks_of(b"data"), ws, "a.txt", limit=100)
    assert list(outside.iterdir()) == []


# -- images ----------------------------------------------------------------------------------


def saved(ws: Path, name: str, data: bytes) -> str:
    (ws / "files").mkdir(parents=True, exist_ok=True)
    (ws / "files" / name).write_bytes(data)
    return f"files/{name}"


def test_a_large_image_gets_a_scaled_copy(tmp_path: Path) -> None:
    rel = saved(tmp_path, "big.png", make_image(3000, 2000))
    info = prepare_image(tmp_path, rel)
    assert info is not None
    assert (info.width, info.height, info.original_width, info.original_height) == (1568, 1045, 3000, 2000)
    assert info.preview == "files/big.preview.jpg"
    with Image.open(tmp_path / info.preview) as copy:
        assert (copy.format, copy.size) == ("JPEG", (1568, 1045))
    assert (tmp_path / rel).read_bytes() == make_image(3000, 2000)  # the person's file is untouched


def test_a_small_image_is_sent_as_it_is(tmp_path: Path) -> None:
    rel = saved(tmp_path, "small.jpg", make_image(640, 480, fmt="JPEG"))
    info = prepare_image(tmp_path, rel)
    assert info is not None and (info.preview, info.width, info.height) == (rel, 640, 480)
    assert sorted(p.name for p in (tmp_path / "files").iterdir()) == ["small.jpg"]


def test_a_turned_photo_is_sent_upright_and_transparency_stays(tmp_path: Path) -> None:
    rel = saved(tmp_path, "turned.jpg", make_image(400, 300, fmt="JPEG", exif_orientation=6))
    info = prepare_image(tmp_path, rel)
    assert info is not None and (info.width, info.height) == (300, 400)  # rotated by its EXIF tag
    assert (info.original_width, info.original_height) == (300, 400)
    rel = saved(tmp_path, "logo.webp", make_image(2000, 1000, fmt="WEBP", alpha=True))
    info = prepare_image(tmp_path, rel)
    assert info is not None and info.preview.endswith(".preview.png")
    with Image.open(tmp_path / info.preview) as copy:
        assert copy.mode == "RGBA" and copy.size == (1568, 784)
    bmp = saved(tmp_path, "scan.bmp", make_image(50, 40, fmt="BMP"))  # a format providers do not take
    info = prepare_image(tmp_path, bmp)
    assert info is not None and info.preview == "files/scan.preview.jpg"


def test_what_is_not_an_image_is_none(tmp_path: Path) -> None:
    assert prepare_image(tmp_path, saved(tmp_path, "fake.jpg", b"\xff\xd8\xff not really")) is None
    assert prepare_image(tmp_path, saved(tmp_path, "text.png", b"hello")) is None


# -- intake and transcription ----------------------------------------------------------------


def config(fake: FakeModel, **transcription: object) -> Config:
    return parse_config({"model": fake.model_settings(), "transcription": transcription}, environ={})


def inbound(*attachments: Attachment, text: str = "") -> Inbound:
    return Inbound(channel="telegram", chat_id="5", user_id="5", text=text, event_id="1", attachments=attachments)


async def test_a_voice_note_becomes_the_turns_text(fake_model: FakeModel, tmp_path: Path) -> None:
    ogg = make_ogg_opus(12)
    assert next(flags for flags, _, _ in ogg_pages(ogg)) == 2  # a real Ogg stream, CRCs checked
    rel = saved(tmp_path, "voice_7.ogg", ogg)
    fake_model.transcribe("  please   call me back  ")
    media = Media(lambda: config(fake_model))
    try:
        voice = Attachment(name="voice_7.ogg", path=rel, mime="audio/ogg", size=len(ogg), kind="voice",
                           duration_s=12)
        got = await media.intake(inbound(voice), tmp_path)
    finally:
        await media.close()
    assert got.text == "[voice message, 0:12] please call me back" and got.run and got.notices == ()
    (upload,) = fake_model.transcriptions
    assert (upload["model"], upload["filename"], upload["content_type"]) == ("whisper-1", "voice_7.ogg", "audio/ogg")
    assert upload["audio"] == ogg
    assert upload["headers"]["Authorization"] == "Bearer test-key"  # the model's key, by default


@pytest.mark.parametrize(("script", "settings", "reason"), [
    ({"error": (404, "404 page not found")}, {}, "has no speech-to-text endpoint"),
    ({"error": (400, {"error": {"message": "Audio file is too short"}})}, {}, "refused the audio (HTTP 400)"),
    ({"error": (401, {"error": {"message": "bad key"}})}, {}, "refused the API key"),
    ({"hang": 5}, {"timeout_s": 0.3}, "did not answer within 0.3 seconds"),
    ({"text": "   "}, {}, "no words could be made out"),
    (None, {"enabled": False}, "speech to text is turned off here"),
])
async def test_a_voice_note_that_cannot_be_heard_is_said_so(fake_model: FakeModel, tmp_path: Path,
                                                            script: dict | None, settings: dict, reason: str) -> None:
    rel = saved(tmp_path, "voice_7.ogg", make_ogg_opus(2))
    if script is not None:
        fake_model.transcribe(**script)  # for the note alone,
        fake_model.transcribe(**script)  # and with a text
    media = Media(lambda: config(fake_model, **settings))
    voice = Attachment(name="voice_7.ogg", path=rel, mime="audio/ogg", size=10, kind="voice", duration_s=2)
    try:
        alone = await media.intake(inbound(voice), tmp_path)
        with_text = await media.intake(inbound(voice, text="see the voice note"), tmp_path)
    finally:
        await media.close()
    (notice,) = alone.notices
    assert notice.startswith("I couldn't transcribe your voice message: ") and reason in notice
    assert not alone.run  # nothing else to answer: the notice is the reply
    assert with_text.run and with_text.text.startswith("see the voice note\n[voice message, not transcribed: ")


async def test_no_transcription_key_is_said_so(fake_model: FakeModel, tmp_path: Path) -> None:
    cfg = parse_config({"model": {**fake_model.model_settings(), "api_key": "${UNSET_KEY}"}}, environ={})
    rel = saved(tmp_path, "a.ogg", make_ogg_opus(1))
    media = Media(lambda: cfg)
    try:
        got = await media.intake(inbound(Attachment(name="a.ogg", path=rel, kind="voice")), tmp_path)
    finally:
        await media.close()
    assert "no API key" in got.notices[0] and fake_model.transcriptions == []


async def test_a_transcription_endpoint_of_its_own(fake_model: FakeModel, tmp_path: Path) -> None:
    transcriber = Transcriber()
    settings = TranscriptionSettings(base_url=fake_model.base_url, api_key="stt-key", model="whisper-large",
                                     timeout_s=5)
    try:
        fake_model.transcribe("hello")
        assert await transcriber.transcribe(settings, b"RIFF wav", filename="a.wav", mime="audio/wav") == "hello"
        with pytest.raises(ModelError) as caught:  # the fake, like OpenAI, wants a known file format
            await transcriber.transcribe(settings, b"data", filename="a.xyz", mime="audio/x-unknown")
        assert caught.value.kind == "bad_request" and "Invalid file format" in caught.value.detail
        fake_model.transcribe(error=(503, {"error": {"message": "overloaded"}}))
        fake_model.transcribe("after a retry")
        assert await transcriber.transcribe(settings, b"RIFF", filename="b.wav", mime="audio/wav") == "after a retry"
    finally:
        await transcriber.close()
    assert [t["model"] for t in fake_model.transcriptions] == ["whisper-large"] * 4
    assert fake_model.transcriptions[0]["headers"]["Authorization"] == "Bearer stt-key"


async def test_images_and_files_in_the_turns_text(fake_model: FakeModel, tmp_path: Path) -> None:
    photo = saved(tmp_path, "photo_3.jpg", make_image(2000, 1500, fmt="JPEG"))
    pdf = saved(tmp_path, "report.pdf", make_pdf(["hello"], "R"))
    media = Media(lambda: config(fake_model))
    got = await media.intake(inbound(
        Attachment(name="photo_3.jpg", path=photo, size=5, kind="image", mime="image/jpeg"),
        Attachment(name="report.pdf", path=pdf, size=1300, mime="application/pdf"),
        Attachment(name="big.iso", path="", size=10**9, error="it is larger than 20 MB"),
        text="look"), tmp_path)
    await media.close()
    assert got.text == ("look\n[image: files/photo_3.jpg, 2000×1500]\n[file: files/report.pdf, 1 KB]\n"
                        "[file: big.iso, not saved: it is larger than 20 MB]")
    assert got.notices == ("I couldn't take big.iso: it is larger than 20 MB.",)
    image = got.attachments[0]
    assert (image.width, image.height, image.preview) == (1568, 1176, "files/photo_3.preview.jpg")


async def test_image_parts_become_data_urls(tmp_path: Path) -> None:
    rel = saved(tmp_path, "p.png", make_image(30, 20))
    media = Media(lambda: Config())
    part = {"type": "image_url", "image_url": {"url": f"workspace:{rel}", "detail": "high"}, "width": 30,
            "height": 20}
    gone = {**part, "image_url": {"url": "workspace:files/gone.jpg", "detail": "high"}}
    engine_msgs = [{"role": "system", "content": "s"},
                   {"role": "user", "content": [{"type": "text", "text": "hi"}, part, gone]}]
    out = await media.resolve_images(engine_msgs, tmp_path)
    text, image, missing = out[1]["content"]
    assert text == {"type": "text", "text": "hi"}
    assert set(image) == {"type", "image_url"} and image["image_url"]["detail"] == "high"
    head, _, data = image["image_url"]["url"].partition(",")
    assert head == "data:image/png;base64" and base64.b64decode(data) == (tmp_path / rel).read_bytes()
    assert missing == {"type": "text", "text": "[image files/gone.jpg is no longer available]"}
    assert engine_msgs[1]["content"][1] is part and part["image_url"]["url"].startswith("workspace:")  # untouched
    assert out[0] is engine_msgs[0]
    plain = [{"role": "user", "content": "no images"}]
    assert await media.resolve_images(plain, tmp_path) is plain
    await media.close()


# -- read_file -------------------------------------------------------------------------------


def tool_context(ws: Path) -> ToolContext:
    return ToolContext(session_key="telegram:dm:5", scope="telegram:user:5", workspace=ws, config=Config())


async def test_read_file_reads_a_pdf_page_by_page(tmp_path: Path) -> None:
    saved(tmp_path, "report.pdf", make_pdf(["Stones collected: 1234", "Otters: 7"], "Report", pages=3))
    out = await ReadFile().run({"path": "files/report.pdf"}, tool_context(tmp_path))
    assert out.text.startswith("--- page 1 of 3 ---\nStones collected: 1234 (page 1)\nOtters: 7 (page 1)\n\n")
    assert "--- page 3 of 3 ---\nStones collected: 1234 (page 3)" in out.text
    at = out.text.index("--- page 2")
    more = await ReadFile().run({"path": "files/report.pdf", "offset": at}, tool_context(tmp_path))
    assert more.text == out.text[at:]  # offsets count in the PDF's text
    assert out.file_ref is not None and out.file_ref.path == "files/report.pdf"


async def test_read_file_refuses_images_and_binaries(tmp_path: Path) -> None:
    saved(tmp_path, "p.png", make_image(10, 10))
    saved(tmp_path, "v.ogg", make_ogg_opus(1))
    saved(tmp_path, "broken.pdf", b"%PDF-1.4 not really a pdf")
    with pytest.raises(ToolError, match="is an image; read_file reads text and PDF files"):
        await ReadFile().run({"path": "files/p.png"}, tool_context(tmp_path))
    with pytest.raises(ToolError, match="is a binary file"):
        await ReadFile().run({"path": "files/v.ogg"}, tool_context(tmp_path))
    with pytest.raises(ToolError, match="the PDF could not be read"):
        await ReadFile().run({"path": "files/broken.pdf"}, tool_context(tmp_path))


def test_the_pdf_helper_makes_real_pages() -> None:
    from pypdf import PdfReader

    reader = PdfReader(io.BytesIO(make_pdf(["a line"], "T", pages=2)))
    assert [p.extract_text() for p in reader.pages] == ["a line (page 1)", "a line (page 2)"]


def test_a_transcription_error_is_classified_like_a_model_error_but_never_as_overflow() -> None:
    from gateway.model.transcribe import transcript_from_response
    from gateway.model.transport import RawResponse

    too_large = RawResponse(413, {}, b'{"error": {"message": "Maximum content size limit exceeded", '
                                     b'"type": "invalid_request_error"}}')
    with pytest.raises(ModelError) as caught:
        transcript_from_response(too_large)
    assert caught.value.kind == "bad_request" and caught.value.status == 413  # no context to trim
    limited = RawResponse(429, {"Retry-After": "3"}, b'{"error": {"message": "slow down"}}')
    with pytest.raises(ModelError) as caught:
        transcript_from_response(limited)
    assert caught.value.kind == "rate_limit" and caught.value.retry_after == 3
    assert transcript_from_response(RawResponse(200, {}, b'{"text": " hello "}')) == "hello"
