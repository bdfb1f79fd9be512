"""Images, voice notes and files end to end (SPEC §5.4): the whole gateway with the real
python-telegram-bot and slack-bolt against the fake platforms, which serve real files (a
PNG and a JPEG made with Pillow, an Ogg Opus voice note, a PDF); the fake model records
the image parts it receives and the fake transcription endpoint the audio it gets."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from context.outside import unfence
from gateway.app import Gateway
from gateway.keys import workspace_dir
from tests.conftest import GatewayFactory
from tests.fakes import slack_server, telegram_server
from tests.fakes.media_files import make_image, make_ogg_opus, make_pdf
from tests.fakes.openai_server import FakeModel
from tests.fakes.slack_server import FakeSlack
from tests.fakes.telegram_server import FakeTelegram

fake_telegram = telegram_server.fake_telegram  # the fixtures
fake_slack = slack_server.fake_slack

ADMIN = 1


def telegram(fake: FakeTelegram) -> dict[str, Any]:
    return {"telegram": {"enabled": True, "token": fake.token, "base_url": fake.base_url,
                         "base_file_url": fake.base_file_url, "poll_timeout_s": 1}}


def slack(fake: FakeSlack) -> dict[str, Any]:
    return {"slack": {"enabled": True, "bot_token": fake.bot_token, "app_token": fake.app_token,
                      "base_url": fake.base_url}}


def vision_model(fake: FakeModel) -> dict[str, Any]:
    return fake.model_settings(max_retries=2, timeout_s=10, vision=True)


def last_user(request: dict[str, Any]) -> Any:
    return [m for m in request["messages"] if m["role"] == "user"][-1]["content"]


def photo_sizes(file_id: str, width: int, height: int, size: int) -> list[dict[str, Any]]:
    return [{"file_id": "thumb", "file_unique_id": "t", "width": 90, "height": 60, "file_size": 900},
            {"file_id": file_id, "file_unique_id": f"u{file_id}", "width": width, "height": height, "file_size": size}]


def workspace(gw: Gateway, scope: str) -> Path:
    assert gw.services is not None
    return workspace_dir(gw.services.data_dir, scope)


# -- Telegram ----------------------------------------------------------------------------------


async def test_a_telegram_photo_reaches_the_model_as_an_image(
    make_gateway: GatewayFactory, fake_model: FakeModel, fake_telegram: FakeTelegram
) -> None:
    gw = await make_gateway(access={"dm_policy": "open"}, channels=telegram(fake_telegram),
                            model=vision_model(fake_model))
    jpeg = make_image(2560, 1920, fmt="JPEG")
    fake_telegram.add_file("p1", jpeg, "photos/file_1.jpg")
    mid = fake_telegram._next_message_id
    fake_model.reply("A checkered square.")
    fake_telegram.push_message(chat_id=5, user_id=5, caption="what is this?",
                               photo=photo_sizes("p1", 2560, 1920, len(jpeg)))
    await fake_telegram.wait_shown(5, lambda shown: shown == ["A checkered square."])

    sent = last_user(fake_model.requests[-1])
    assert sent[0] == {"type": "text", "text": f"what is this?\n[image: files/photo_{mid}.jpg, 2560×1920]"}
    ((mime, data),) = fake_model.image_parts()
    with Image.open(io.BytesIO(data)) as img:  # scaled down to 1568 px on the longest side
        assert (mime, img.format, img.size) == ("image/jpeg", "JPEG", (1568, 1176))
    ws = workspace(gw, "telegram:user:5")
    assert (ws / f"files/photo_{mid}.jpg").read_bytes() == jpeg  # what the person sent, kept as it was

    # Stored as metadata, never as base64: the database row names the files and the size.
    assert gw.services is not None
    (stored, _) = await gw.services.store.messages("telegram:dm:5")
    assert stored.content == sent[0]["text"]
    (att,) = stored.attachments
    assert (att.kind, att.path, att.preview, att.width, att.height) == (
        "image", f"files/photo_{mid}.jpg", f"files/photo_{mid}.preview.jpg", 1568, 1176)
    rows = await gw.services.store.run("SELECT content, attachments FROM messages WHERE role='user'")
    assert all(len(r["content"]) + len(r["attachments"]) < 1000 for r in rows)

    # Two more turns still show it; the third one after it gets a placeholder instead.
    for n, expected in ((1, 1), (2, 1), (3, 0)):
        fake_telegram.push_message(chat_id=5, user_id=5, text=f"and then {n}?")
        await fake_telegram.wait_shown(5, lambda shown, n=n: shown[-1] == f"echo: and then {n}?")
        assert len(fake_model.image_parts()) == expected
    first = next(m for m in fake_model.requests[-1]["messages"] if m["role"] == "user")["content"]
    assert first.endswith(f"\n[earlier image, no longer shown: files/photo_{mid}.jpg]")


async def test_files_a_reply_names_are_sent_after_its_text(
    make_gateway: GatewayFactory, fake_model: FakeModel, fake_telegram: FakeTelegram
) -> None:
    gw = await make_gateway(access={"dm_policy": "open"}, channels=telegram(fake_telegram))
    files = workspace(gw, "telegram:user:5") / "files"
    files.mkdir(parents=True, exist_ok=True)
    png = make_image(64, 48, fmt="PNG")
    (files / "chart.png").write_bytes(png)
    (files / "notes.txt").write_bytes(b"the notes")
    (files / "huge.bin").write_bytes(b"\0" * (telegram_server.DOCUMENT_MAX_BYTES + 1))  # over Telegram's limit
    for n in range(4):
        (files / f"extra_{n}.txt").write_bytes(b"x")
    (files.parent / "MEMORY.md").write_text("private")  # in the workspace, but not under files/
    fake_model.reply("Here: files/../MEMORY.md, files/chart.png, files/missing.png, files/notes.txt and "
                     "files/huge.bin, files/chart.png again; files/extra_0.txt files/extra_1.txt.")
    fake_telegram.push_message(chat_id=5, user_id=5, text="the chart?")
    await fake_telegram.wait_call("sendDocument")
    assert [(m, name) for m, name, _ in fake_telegram.uploads] == [("sendPhoto", "chart.png"),
                                                                   ("sendDocument", "notes.txt")]
    assert fake_telegram.uploads[0][2] == png
    methods = [h[0] for h in fake_telegram.history]
    assert methods.index("sendPhoto") > methods.index("sendMessage")  # after the text
    # At most three files per reply: huge.bin took the third place and was skipped.
    fake_telegram.push_message(chat_id=5, user_id=5, text="thanks")
    await fake_telegram.wait_shown(5, lambda shown: shown[-1] == "echo: thanks")
    assert len(fake_telegram.uploads) == 2


async def test_without_vision_the_model_is_told_where_the_image_is(
    make_gateway: GatewayFactory, fake_model: FakeModel, fake_telegram: FakeTelegram
) -> None:
    await make_gateway(access={"dm_policy": "open"}, channels=telegram(fake_telegram))  # fake-model: no vision
    png = make_image(640, 480)
    fake_telegram.add_file("doc", png, "documents/file_3.png")
    fake_telegram.push_message(chat_id=5, user_id=5, document={
        "file_id": "doc", "file_unique_id": "d", "file_name": "chart.png", "mime_type": "image/png",
        "file_size": len(png)})
    await fake_telegram.wait_shown(5, lambda shown: len(shown) == 1)
    assert last_user(fake_model.requests[-1]) == "[image: files/chart.png, 640×480]"
    assert fake_model.image_parts() == []


async def test_a_telegram_voice_note_is_transcribed(
    make_gateway: GatewayFactory, fake_model: FakeModel, fake_telegram: FakeTelegram
) -> None:
    gw = await make_gateway(access={"dm_policy": "open"}, channels=telegram(fake_telegram))
    ogg = make_ogg_opus(12)
    fake_telegram.add_file("v1", ogg, "voice/file_4.oga")
    mid = fake_telegram._next_message_id
    fake_model.transcribe("remind me to water the plants")
    fake_telegram.push_message(chat_id=5, user_id=5, voice={
        "file_id": "v1", "file_unique_id": "uv1", "duration": 12, "mime_type": "audio/ogg", "file_size": len(ogg)})
    await fake_telegram.wait_shown(5, lambda shown: len(shown) == 1)

    (upload,) = fake_model.transcriptions
    assert upload["audio"] == ogg and upload["filename"] == f"voice_{mid}.ogg"
    assert (upload["model"], upload["content_type"]) == ("whisper-1", "audio/ogg")
    assert upload["headers"]["Authorization"] == "Bearer test-key"
    text = "[voice message, 0:12] remind me to water the plants"
    assert last_user(fake_model.requests[-1]) == text
    assert fake_telegram.shown(5) == [f"echo: {text}"]
    # Stored as the turn's text, and /context counts it like any text.
    assert gw.services is not None
    assert (await gw.services.store.messages("telegram:dm:5"))[0].content == text
    fake_telegram.push_message(chat_id=5, user_id=5, text="/context")
    await fake_telegram.wait_shown(5, lambda shown: len(shown) == 2)
    assert "Messages: 2" in fake_telegram.shown(5)[1]

    mp3 = b"ID3\x04\x00 an mp3 file"
    fake_telegram.add_file("a1", mp3, "music/file_5.mp3")
    fake_model.transcribe("the chorus goes la la la")
    fake_telegram.push_message(chat_id=5, user_id=5, caption="lyrics?", audio={
        "file_id": "a1", "file_unique_id": "ua1", "duration": 185, "mime_type": "audio/mpeg",
        "file_name": "tune.mp3", "file_size": len(mp3)})
    await fake_telegram.wait_shown(5, lambda shown: len(shown) == 3)
    assert fake_model.transcriptions[-1]["filename"] == "tune.mp3" and fake_model.transcriptions[-1]["audio"] == mp3
    assert last_user(fake_model.requests[-1]) == "lyrics?\n[audio: files/tune.mp3, 3:05] the chorus goes la la la"


async def test_a_voice_note_that_cannot_be_transcribed_gets_a_clear_reply(
    make_gateway: GatewayFactory, fake_model: FakeModel, fake_telegram: FakeTelegram,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="gateway.sessions")
    await make_gateway(access={"dm_policy": "open"}, channels=telegram(fake_telegram),
                       transcription={"timeout_s": 0.5})
    for n in (1, 2):
        fake_telegram.add_file(f"v{n}", make_ogg_opus(2), f"voice/file_{n}.oga")
    fake_model.transcribe(error=(404, "404 page not found"))  # a provider without speech to text
    fake_telegram.push_message(chat_id=5, user_id=5, voice={"file_id": "v1", "file_unique_id": "u1", "duration": 2})
    await fake_telegram.wait_shown(5, lambda shown: len(shown) == 1)
    assert fake_telegram.shown(5)[0] == (
        "I couldn't transcribe your voice message: the model provider has no speech-to-text endpoint "
        "(/audio/transcriptions); an admin can point transcription.base_url at one, or turn "
        "transcription.enabled off.")
    fake_model.transcribe(hang=5)
    fake_telegram.push_message(chat_id=5, user_id=5, caption="listen", voice={
        "file_id": "v2", "file_unique_id": "u2", "duration": 2})
    await fake_telegram.wait_shown(5, lambda shown: len(shown) == 3)
    assert "did not answer within 0.5 seconds" in fake_telegram.shown(5)[1]
    # With a caption there is still something to answer: the turn runs on the text.
    assert fake_telegram.shown(5)[2].startswith("echo: listen\n[voice message, not transcribed: ")
    assert len(fake_model.requests) == 1  # the first voice note alone never reached the model
    # The turn line says what became of it (the second turn ran after the first was logged).
    outcomes = [r.outcome for r in caplog.records if r.getMessage() == "turn ended"]  # type: ignore[attr-defined]
    assert outcomes[0] == "nothing_to_answer", outcomes


async def test_a_telegram_pdf_is_named_and_read_with_read_file(
    make_gateway: GatewayFactory, fake_model: FakeModel, fake_telegram: FakeTelegram
) -> None:
    await make_gateway(access={"dm_policy": "open"}, channels=telegram(fake_telegram))
    pdf = make_pdf(["Quarterly report", "Revenue: 1,234 otters"], "Q3", pages=2)
    fake_telegram.add_file("d1", pdf, "documents/file_5.pdf")
    fake_model.tool_call("read_file", {"path": "files/report.pdf"})
    fake_model.reply("Revenue was 1,234 otters.")
    fake_telegram.push_message(chat_id=5, user_id=5, caption="summarize this", document={
        "file_id": "d1", "file_unique_id": "ud1", "file_name": "report.pdf", "mime_type": "application/pdf",
        "file_size": len(pdf)})
    await fake_telegram.wait_shown(5, lambda shown: shown == ["Revenue was 1,234 otters."])
    first, second = fake_model.requests
    assert last_user(first) == f"summarize this\n[file: files/report.pdf, {len(pdf) // 1024} KB]"
    tool = unfence([m for m in second["messages"] if m["role"] == "tool"][-1]["content"])
    assert tool.startswith("--- page 1 of 2 ---\nQuarterly report (page 1)\nRevenue: 1,234 otters (page 1)")


async def test_an_oversized_telegram_file_is_refused_and_the_turn_runs_on_the_text(
    make_gateway: GatewayFactory, fake_model: FakeModel, fake_telegram: FakeTelegram
) -> None:
    await make_gateway(access={"dm_policy": "open"}, channels=telegram(fake_telegram),
                       limits={"max_inbound_file_mb": 0.05})  # 51 KB
    fake_telegram.add_file("big", b"x" * 80_000, "documents/file_6.bin")
    fake_telegram.add_file("liar", b"y" * 80_000, "documents/file_7.bin", reported_size=100)
    fake_telegram.push_message(chat_id=5, user_id=5, caption="here is the dump", document={
        "file_id": "big", "file_unique_id": "ub", "file_name": "dump.bin", "file_size": 80_000})
    await fake_telegram.wait_shown(5, lambda shown: len(shown) == 2)
    refusal, answer = fake_telegram.shown(5)
    assert refusal == ("I couldn't take dump.bin: it is larger than 51 KB, the most I accept "
                       "(limits.max_inbound_file_mb).")
    assert answer == ("echo: here is the dump\n[file: dump.bin, not saved: it is larger than 51 KB, the most I "
                      "accept (limits.max_inbound_file_mb)]")
    assert fake_telegram.calls_of("getFile") == []  # the size Telegram reported was enough

    fake_telegram.push_message(chat_id=5, user_id=5, document={  # says 100 bytes, is 80 KB
        "file_id": "liar", "file_unique_id": "ul", "file_name": "small.bin", "file_size": 100})
    await fake_telegram.wait_shown(5, lambda shown: len(shown) == 3)
    assert fake_telegram.shown(5)[2].startswith("I couldn't take small.bin: it is larger than 51 KB")
    assert len(fake_model.requests) == 1  # nothing else to answer: the refusal was the reply


async def test_a_strangers_photo_and_voice_are_never_fetched(
    make_gateway: GatewayFactory, fake_model: FakeModel, fake_telegram: FakeTelegram
) -> None:
    await make_gateway(admins=[f"telegram:{ADMIN}"], channels=telegram(fake_telegram))
    fake_telegram.add_file("sp", make_image(100, 100, fmt="JPEG"), "photos/file_8.jpg")
    fake_telegram.add_file("sv", make_ogg_opus(1), "voice/file_9.oga")
    fake_telegram.push_message(chat_id=77, user_id=77, photo=photo_sizes("sp", 100, 100, 800))
    fake_telegram.push_message(chat_id=77, user_id=77, voice={"file_id": "sv", "file_unique_id": "u", "duration": 1})
    (refusal,) = await fake_telegram.wait_sent(1)
    assert "pairing code" in refusal["text"]
    fake_telegram.push_message(chat_id=ADMIN, user_id=ADMIN, text="ping")
    await fake_telegram.wait_shown(ADMIN, lambda shown: len(shown) == 1)  # the strangers' updates are done
    assert fake_telegram.calls_of("getFile") == [] and fake_telegram.downloads == []
    assert fake_model.transcriptions == [] and len(fake_model.requests) == 1


async def test_the_dialog_archive_records_the_files_of_a_turn(
    make_gateway: GatewayFactory, fake_model: FakeModel, fake_telegram: FakeTelegram
) -> None:
    gw = await make_gateway(access={"dm_policy": "open"}, channels=telegram(fake_telegram))
    pdf = make_pdf(["notes"], "N")
    fake_telegram.add_file("d", pdf, "documents/file_1.pdf")
    fake_telegram.push_message(chat_id=5, user_id=5, caption="keep this", document={
        "file_id": "d", "file_unique_id": "ud", "file_name": "notes.pdf", "file_size": len(pdf)})
    fake_telegram.push_message(chat_id=5, user_id=5, text="second")
    fake_telegram.push_message(chat_id=5, user_id=5, text="third")
    await fake_telegram.wait_shown(5, lambda shown: len(shown) == 3)
    fake_telegram.push_message(chat_id=5, user_id=5, text="/compact")
    await fake_telegram.wait_shown(5, lambda shown: len(shown) == 4)
    assert gw.services is not None
    await gw.services.background.wait_idle(5)
    archive = next((workspace(gw, "telegram:user:5") / "dialog").glob("*.jsonl"))
    rows = [json.loads(line) for line in archive.read_text().splitlines()]
    (with_file,) = [r for r in rows if r.get("files")]
    assert with_file["content"].startswith("keep this\n[file: files/notes.pdf")
    assert with_file["files"] == [{"name": "notes.pdf", "path": "files/notes.pdf", "kind": "file",
                                   "size": len(pdf)}]


# -- Slack -------------------------------------------------------------------------------------


async def test_slack_files_images_and_voice_clips(
    make_gateway: GatewayFactory, fake_model: FakeModel, fake_slack: FakeSlack
) -> None:
    await make_gateway(access={"dm_policy": "open"}, channels=slack(fake_slack), model=vision_model(fake_model),
                       limits={"max_inbound_file_mb": 0.5})
    await fake_slack.wait_connected()
    png = make_image(800, 600)
    picture = fake_slack.add_file("Screen Shot.png", png, "image/png")
    fake_model.reply("A screenshot.")
    await fake_slack.push_event({"type": "message", "channel_type": "im", "user": "U5", "text": "what's this?",
                                 "ts": "100.1", "channel": "D5", "subtype": "file_share", "files": [picture]})
    await fake_slack.wait_for(lambda: fake_slack.visible("D5") == ["A screenshot."])
    sent = last_user(fake_model.requests[-1])
    assert sent[0]["text"] == "what's this?\n[image: files/Screen_Shot.png, 800×600]"
    assert fake_model.image_parts() == [("image/png", png)]  # small enough: sent as it came

    webm = b"\x1aE\xdf\xa3 a webm clip"
    clip = {**fake_slack.add_file("audio_message.webm", webm, "audio/webm"), "subtype": "slack_audio",
            "duration_ms": 65_000}
    fake_model.transcribe("let's meet at noon")
    await fake_slack.push_event({"type": "message", "channel_type": "im", "user": "U5", "text": "",
                                 "ts": "101.1", "channel": "D5", "subtype": "file_share", "files": [clip]})
    await fake_slack.wait_for(lambda: len(fake_slack.visible("D5")) == 2)
    (upload,) = fake_model.transcriptions
    assert (upload["audio"], upload["filename"], upload["content_type"]) == (webm, "audio_message.webm", "audio/webm")
    assert fake_slack.visible("D5")[1] == "echo: [voice message, 1:05] let's meet at noon"

    pdf = make_pdf(["minutes"], "M")
    doc = fake_slack.add_file("minutes.pdf", pdf, "application/pdf")
    big = fake_slack.add_file("video.mp4", b"v" * 600_000, "video/mp4")
    await fake_slack.push_event({"type": "message", "channel_type": "im", "user": "U5", "text": "two files",
                                 "ts": "102.1", "channel": "D5", "subtype": "file_share", "files": [doc, big]})
    await fake_slack.wait_for(lambda: len(fake_slack.visible("D5")) == 4)
    refusal, answer = fake_slack.visible("D5")[2:]
    assert refusal == ("I couldn't take video.mp4: it is larger than 512 KB, the most I accept "
                       "(limits.max_inbound_file_mb).")
    assert answer.startswith(f"echo: two files\n[file: files/minutes.pdf, {len(pdf)} bytes]\n"
                             "[file: video.mp4, not saved: it is larger than 512 KB")
    assert big["id"] not in fake_slack.downloads


async def test_slack_sends_files_a_reply_names_after_its_text(
    make_gateway: GatewayFactory, fake_model: FakeModel, fake_slack: FakeSlack
) -> None:
    gw = await make_gateway(access={"dm_policy": "open"}, channels=slack(fake_slack))
    await fake_slack.wait_connected()
    files = workspace(gw, "slack:user:U5") / "files"
    files.mkdir(parents=True, exist_ok=True)
    png = make_image(64, 48, fmt="PNG")
    (files / "chart.png").write_bytes(png)
    (files / "notes.txt").write_bytes(b"the notes")
    fake_model.reply("See files/chart.png and files/notes.txt.")
    await fake_slack.push_event({"type": "message", "channel_type": "im", "user": "U5", "text": "the chart?",
                                 "ts": "100.1", "channel": "D5"})
    await fake_slack.wait_for(lambda: len(fake_slack.uploads) == 2)
    assert [(u["channel"], u["name"], u["data"]) for u in fake_slack.uploads] == [
        ("D5", "chart.png", png), ("D5", "notes.txt", b"the notes")]
    assert fake_slack.visible("D5") == ["See files/chart.png and files/notes.txt."]


async def test_a_strangers_slack_clip_is_never_fetched(make_gateway: GatewayFactory, fake_model: FakeModel,
                                                      fake_slack: FakeSlack) -> None:
    await make_gateway(admins=["slack:U1"], access={"dm_policy": "allowlist"}, channels=slack(fake_slack))
    await fake_slack.wait_connected()
    clip = {**fake_slack.add_file("audio_message.webm", b"webm", "audio/webm"), "subtype": "slack_audio"}
    picture = fake_slack.add_file("p.png", make_image(10, 10), "image/png")
    await fake_slack.push_event({"type": "message", "channel_type": "im", "user": "U9", "text": "",
                                 "ts": "500.1", "channel": "D9", "subtype": "file_share", "files": [clip, picture]})
    (refusal,) = await fake_slack.wait_posted(1)
    assert refusal["channel"] == "D9" and "private" in refusal["text"]
    assert fake_slack.downloads == [] and fake_model.transcriptions == [] and fake_model.requests == []
