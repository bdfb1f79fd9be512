"""Images, voice notes and files people send (SPEC §5.4): the shell's side.

Channels download a message's files (only for senders the router admits) with
`save_download`, which caps the size while the bytes arrive and keeps safe, unique names
under the scope's `files/`. When the turn starts, `Media.intake` turns them into the
user message: an image is measured and, when it is larger than the model needs, a
scaled copy is made (Pillow, in a child process under limits: gateway.parsing; an
image with more pixels than that decodes is kept as a file, and the person told); a
voice note or audio file is transcribed (gateway.model.Transcriber); any other file is
named with its size. What could not be kept or heard is said to the person in a notice.
The stored message holds the text and the files' metadata, never their bytes.

Before each model call, `Media.resolve_images` turns the image parts the context engine
placed (`workspace:<path>`, context/images.py) into base64 data URLs.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import re
import stat
import unicodedata
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any

from context.images import image_reference
from gateway.beneath import Dir, PathNotAllowed, normalized
from gateway.config.schema import Config
from gateway.model.errors import ModelError
from gateway.model.transcribe import Transcriber, TranscriptionSettings, transcription_failure
from gateway.parsing.readers import ImageRefused, read_image
from gateway.types import Attachment, AttachmentKind, Inbound
from gateway.workspace import make_private_dir

log = logging.getLogger("gateway.media")

FILES_DIR = "files"
MAX_IMAGE_SIDE = 1568  # longest side of the copy a model is shown (more costs tokens, adds little)
WRITE_BLOCK = 1 << 20  # downloads are written in blocks of this size, off the loop
DATA_URL_CACHE_CHARS = 48 << 20  # base64 of recently sent images, kept across steps
_MIME_OF_EXT = {".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".png": "image/png", ".webp": "image/webp",
                ".gif": "image/gif"}
_UNSAFE = re.compile(r"[^\w.\-]+")


class FileRefused(Exception):
    """A file that is not kept; `str(exc)` says why, in words for the person."""


# ---------------------------------------------------------------------------- names and sizes


def safe_file_name(name: str, limit: int = 100) -> str:
    """A file name that is safe on any filesystem and cannot leave its directory."""
    if not isinstance(name, str):
        name = str(name)
    name = name.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    name = unicodedata.normalize("NFC", name).replace("\\", "/").rsplit("/", 1)[-1]
    name = _UNSAFE.sub("_", name).strip("._") or "file"
    if len(name) > limit:
        root, ext = os.path.splitext(name)
        ext = ext[:16]
        name = root[: limit - len(ext)] + ext
    return name


def describe_size(size: int) -> str:
    """`1.2 MB`, `340 KB`, `12 bytes`."""
    if size >= 1 << 20:
        megabytes = size / (1 << 20)
        return f"{megabytes:.0f} MB" if megabytes == int(megabytes) else f"{megabytes:.1f} MB"
    if size >= 1 << 10:
        return f"{size / (1 << 10):.0f} KB"
    return f"{size} bytes"


def too_large(limit: int) -> FileRefused:
    return FileRefused(f"it is larger than {describe_size(limit)}, the most I accept (limits.max_inbound_file_mb)")


def describe_duration(seconds: float | None) -> str | None:
    if seconds is None or seconds < 0:
        return None
    total = round(seconds)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _files_dir(workspace: Path) -> Dir:
    """The workspace's files/, made (0700) when missing, private when it was not. Opened
    without following a link: the sandbox may swap names in the workspace at any moment."""
    make_private_dir(workspace)  # the workspace itself: the gateway's own path (data dir/scopes/…)
    with Dir.open(workspace) as ws:
        files = ws.subdir(FILES_DIR, create=True, mode=0o700)
    try:
        mode = stat.S_IMODE(os.fstat(files.fd).st_mode)
        if mode & 0o077:
            os.fchmod(files.fd, mode & 0o700)
    except OSError as err:  # not the owner: say so, the file is still saved
        log.warning("cannot make %s private: %s", workspace / FILES_DIR, err.strerror or err)
    except BaseException:
        files.close()
        raise
    return files


def _claim(files: Dir, name: str) -> tuple[str, str]:
    """Reserve a new, unused name for `name` in files/ (created 0600, empty): `name`,
    else `stem-2.ext`, `stem-3.ext`, …; (its name, its workspace path). Runs in a worker thread."""
    stem, ext = os.path.splitext(safe_file_name(name))
    for n in range(1, 10_000):
        candidate = f"{stem}{'' if n == 1 else f'-{n}'}{ext}"
        try:  # O_EXCL: whatever is there already, a link included, is left alone
            fd = files.open_fd(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            continue
        os.close(fd)
        return candidate, f"{FILES_DIR}/{candidate}"
    raise FileRefused("there are too many files of that name already")


@dataclass(slots=True)
class _Saving:
    """A file being saved under files/: its directory held open, the partial file beside
    the reserved name, renamed over it when complete."""

    files: Dir
    name: str
    fh: IO[bytes] | None = None

    @property
    def part(self) -> str:
        return f".{self.name}.part"

    def open(self) -> None:
        self.fh = self.files.open_file(self.part, "wb", mode=0o600)

    def write(self, data: bytes) -> None:
        assert self.fh is not None
        self.fh.write(data)

    def finish(self) -> None:
        assert self.fh is not None
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()
        os.rename(self.part, self.name, src_dir_fd=self.files.fd, dst_dir_fd=self.files.fd)

    def discard(self) -> None:
        if self.fh is not None:
            self.fh.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.part, dir_fd=self.files.fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.name, dir_fd=self.files.fd)

    def close(self) -> None:
        self.files.close()


def _start_saving(workspace: Path, name: str) -> tuple[_Saving, str]:
    files = _files_dir(workspace)
    try:
        saved, rel = _claim(files, name)
        saving = _Saving(files, saved)
        saving.open()
    except BaseException:
        files.close()
        raise
    return saving, rel


def _end_saving(saving: _Saving, ok: bool) -> None:
    """Rename the complete file into place (`ok`), else leave nothing behind; then let go
    of files/."""
    try:
        if ok:
            try:
                saving.finish()
                return
            except BaseException:
                saving.discard()
                raise
        saving.discard()
    finally:
        saving.close()


async def save_download(chunks: AsyncIterator[bytes], workspace: Path, name: str, *, limit: int) -> tuple[str, int]:
    """Write a download under the workspace's files/ with a safe, unique name, refusing it
    once it grows past `limit` bytes (whatever size the platform announced). Returns
    (workspace-relative path, size). Nothing is left behind when it fails."""
    starting = asyncio.ensure_future(asyncio.to_thread(_start_saving, workspace, name))
    try:
        saving, rel = await asyncio.shield(starting)
    except asyncio.CancelledError:
        # The thread goes on for a few system calls; what it reserves is removed after it.
        with contextlib.suppress(Exception):
            begun, _ = await starting
            await asyncio.to_thread(_end_saving, begun, False)
        raise
    try:
        size = 0
        block = bytearray()
        async for chunk in chunks:
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            block += chunk
            if len(block) >= WRITE_BLOCK:
                await asyncio.to_thread(saving.write, bytes(block))
                block.clear()
        if block:
            await asyncio.to_thread(saving.write, bytes(block))
    except BaseException:
        await asyncio.shield(asyncio.to_thread(_end_saving, saving, False))
        raise
    await asyncio.shield(asyncio.to_thread(_end_saving, saving, True))
    return rel, size


async def local_chunks(path: Path, block: int = WRITE_BLOCK) -> AsyncIterator[bytes]:
    """A local file as download chunks (a self-hosted Bot API server in --local mode)."""
    fh = await asyncio.to_thread(open, path, "rb")
    try:
        while data := await asyncio.to_thread(fh.read, block):
            yield data
    finally:
        await asyncio.to_thread(fh.close)


def _unlink_saved(workspace: Path, paths: list[str]) -> None:
    with Dir.open(workspace) as ws:
        for rel in paths:
            try:
                ws.unlink(rel)  # unlinkat: a link is removed itself, never what it names
            except (FileNotFoundError, NotADirectoryError, PathNotAllowed):
                pass


async def discard_saved(workspace: Path, inbound: Inbound) -> None:
    """Delete the files a channel saved for `inbound` when the router did not take it (a
    redelivery it had already seen, or a failure the platform will deliver again): the
    message that counts has its own copies."""
    paths = [a.path for a in inbound.attachments if a.path]
    if paths:
        try:
            await asyncio.to_thread(_unlink_saved, workspace, paths)
        except OSError as err:
            log.warning("files of a message not taken were not deleted: %s", err)


def kind_of(mime: str | None, name: str = "") -> AttachmentKind:
    """image / audio / file, from a file's type (channels know better for voice notes)."""
    mime = (mime or "").lower()
    if mime.startswith("image/"):
        return "image"
    if mime.startswith("audio/"):
        return "audio"
    ext = os.path.splitext(name.lower())[1]
    if not mime or mime == "application/octet-stream":
        if ext in _MIME_OF_EXT:
            return "image"
        if ext in (".ogg", ".oga", ".opus", ".mp3", ".m4a", ".wav", ".flac", ".webm"):
            return "audio"
    return "file"


# ---------------------------------------------------------------------------- images


@dataclass(frozen=True, slots=True)
class ImageInfo:
    width: int  # of the copy the model is shown
    height: int
    preview: str  # workspace-relative path of that copy (the file itself when it fits)
    original_width: int  # the file's own size, upright
    original_height: int


async def image_for_model(workspace: Path, rel: str,
                          max_side: int = MAX_IMAGE_SIDE) -> ImageInfo | ImageRefused | None:
    """Measure an image and, when it is too large, turned by EXIF or in a format providers
    do not take, save a scaled copy next to it (JPEG, or PNG when it has transparency).
    Pillow reads it in a child process under limits (gateway.parsing.readers). An
    ImageRefused when it is kept as a file only (too many pixels to decode, or it could
    not be read in time); None when it is not an image Pillow can read."""
    try:
        fh = await asyncio.to_thread(_open_in, workspace, rel)
    except OSError as err:
        log.info("not an image the model can be shown: %s (%s)", rel, err)
        return None
    try:
        seen = await read_image(fh, max_side)
    finally:
        await asyncio.to_thread(fh.close)
    if seen is None:
        log.info("not an image the model can be shown: %s", rel)
        return None
    if isinstance(seen, ImageRefused):
        return seen
    if seen.copy is None:
        return ImageInfo(seen.width, seen.height, rel, seen.width, seen.height)
    ext = ".png" if seen.copy_format == "PNG" else ".jpg"
    preview = await asyncio.to_thread(_save_copy, workspace, rel, ext, seen.copy)
    return ImageInfo(seen.width, seen.height, preview, seen.original_width, seen.original_height)


def _open_in(workspace: Path, rel: str) -> IO[bytes]:
    with Dir.open(workspace) as ws:
        return ws.open_file(rel)


def _save_whole(workspace: Path, name: str, data: bytes) -> str:
    """Save `data` under files/ with a safe, unique name like `name`; its workspace path.
    Runs in a worker thread."""
    saving, rel = _start_saving(workspace, name)
    ok = False
    try:
        saving.write(data)
        ok = True
    finally:
        _end_saving(saving, ok)
    return rel


def _save_copy(workspace: Path, rel: str, ext: str, data: bytes) -> str:
    """Save a scaled copy as `<stem>.preview<ext>` beside the file; its workspace path.
    Runs in a worker thread."""
    stem = os.path.splitext(os.path.basename(rel))[0]
    return _save_whole(workspace, f"{stem}.preview{ext}", data)


def prepare_image(workspace: Path, rel: str, max_side: int = MAX_IMAGE_SIDE) -> ImageInfo | None:
    """`image_for_model` for a caller with no event loop running (a script, a test): the
    image as the model is shown it, or None when it is kept as a file only."""
    seen = asyncio.run(image_for_model(workspace, rel, max_side))
    return seen if isinstance(seen, ImageInfo) else None


def _save_tool_file(workspace: Path, name: str, data: str, limit: int) -> tuple[str, int]:
    """Decode an image a tool returned (base64) and save it under files/: (path, size).
    Raises FileRefused (too large, not base64). Runs in a worker thread."""
    if len(data) * 3 // 4 > limit + 3:  # checked before decoding: base64 is 4/3 of the bytes
        raise too_large(limit)
    try:
        raw = base64.b64decode(data, validate=True)
    except ValueError:
        raise FileRefused("it is not valid base64") from None
    if len(raw) > limit:
        raise too_large(limit)
    return _save_whole(workspace, name, raw), len(raw)


async def save_tool_image(workspace: Path, name: str, mime: str, data: str, limit: int) -> tuple[Attachment, str]:
    """Save an image a tool returned under files/ and measure it like a person's (a scaled
    copy when too large). The attachment and the line the tool result gets. Raises
    FileRefused (too large, not base64)."""
    rel, size = await asyncio.to_thread(_save_tool_file, workspace, name, data, limit)
    att = Attachment(name=name, path=rel, mime=mime, size=size, kind="image")
    seen = await image_for_model(workspace, rel)
    if isinstance(seen, ImageInfo):
        att = replace(att, width=seen.width, height=seen.height, preview=seen.preview)
        return att, image_note(att, seen)
    why = f"not shown as an image: {seen.reason}" if seen is not None else "not an image"
    return replace(att, kind="file"), f"[file from the tool: {rel}, {describe_size(size)}, {why}]"


REPLY_FILES_MAX = 3  # files a reply may send along
_REPLY_FILE = re.compile(r"(?<![\w/.])files/[\w.\-/]+")


@dataclass(frozen=True, slots=True)
class ReplyFile:
    """A file under files/ that a reply names, to be sent after its text. Its bytes are
    read with `read_bytes` (blocking), beneath the workspace, never through a link."""

    workspace: Path
    rel: str  # files/…
    name: str
    size: int  # when the reply named it: what a channel checks against its limits
    is_image: bool

    @property
    def path(self) -> Path:
        """Where it is, for logs (never opened by this name)."""
        return self.workspace / self.rel

    def read_bytes(self) -> bytes:
        """The file's bytes, at most `size` of them (an OSError when it grew since: a
        channel checked that size against its limit)."""
        with Dir.open(self.workspace) as ws:
            return ws.read_bytes(self.rel, limit=self.size)


def reply_files(workspace: Path, text: str) -> list[ReplyFile]:
    """The files under the scope's files/ that `text` names and that exist, in order,
    at most REPLY_FILES_MAX. Runs in a worker thread."""
    out: list[ReplyFile] = []
    seen: set[str] = set()
    try:
        ws = Dir.open(workspace)
    except OSError:
        return out
    with ws:
        for found in _REPLY_FILE.finditer(text):
            try:
                # Only what lies under files/ ("files/../memory/…" is refused: no `..`).
                rel = normalized(found.group(0).rstrip("."))  # a sentence's full stop is not part of the name
                if rel in seen or not rel.startswith(f"{FILES_DIR}/"):
                    continue
                st = ws.stat(rel)
            except (PathNotAllowed, OSError):
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            seen.add(rel)
            name = rel.rsplit("/", 1)[-1]
            out.append(ReplyFile(workspace, rel, name, st.st_size, os.path.splitext(name)[1].lower() in _MIME_OF_EXT))
            if len(out) == REPLY_FILES_MAX:
                break
    return out


# ---------------------------------------------------------------------------- the turn's text


@dataclass(frozen=True, slots=True)
class Intake:
    """A person's message made ready to store: its text (caption, notes, transcripts), the
    files' metadata, notices for the person, and whether there is anything to answer."""

    text: str
    attachments: tuple[Attachment, ...]
    notices: tuple[str, ...]
    run: bool


def file_note(att: Attachment) -> str:
    return f"[file: {att.path}, {describe_size(att.size)}]"


def refused_note(att: Attachment) -> str:
    what = "voice message" if att.kind == "voice" else f"file: {att.name}"
    return f"[{what}, not saved: {att.error}]"


def refused_notice(att: Attachment) -> str:
    what = "your voice message" if att.kind == "voice" else f"{att.name}"
    return f"I couldn't take {what}: {att.error}."


def unshown_note(att: Attachment, reason: str) -> str:
    return f"[file: {att.path}, {describe_size(att.size)}; not shown as an image: {reason}]"


def image_note(att: Attachment, info: ImageInfo) -> str:
    return f"[image: {att.path}, {info.original_width}×{info.original_height}]"


def voice_note(att: Attachment, transcript: str) -> str:
    length = describe_duration(att.duration_s)
    if att.kind == "voice":
        head = f"[voice message, {length}]" if length else "[voice message]"
    else:
        head = f"[audio: {att.path}, {length}]" if length else f"[audio: {att.path}]"
    return f"{head} {transcript}"


def plain_intake(inbound: Inbound) -> Intake:
    """Without the media service (tests of other parts): files named, nothing transcribed."""
    notes = [refused_note(a) if a.error else file_note(a) for a in inbound.attachments]
    text = "\n".join([t for t in (inbound.text, *notes) if t])
    return Intake(text, inbound.attachments, (), bool(text))


class Media:
    """The media service of a running gateway: intake of a turn's files, image parts for
    model calls, transcription. One per gateway; close() it on shutdown."""

    def __init__(self, config: Callable[[], Config], *, transcriber: Transcriber | None = None) -> None:
        self._config = config
        self.transcriber = transcriber or Transcriber()
        self._data_urls: OrderedDict[tuple[str, int, int], str] = OrderedDict()
        self._data_url_chars = 0

    async def close(self) -> None:
        await self.transcriber.close()

    # -- intake --------------------------------------------------------------------------

    async def intake(self, inbound: Inbound, workspace: Path) -> Intake:
        """The user message for `inbound` (files already saved by its channel)."""
        if not inbound.attachments:
            return Intake(inbound.text, (), (), bool(inbound.text))
        cfg = self._config()
        texts = [inbound.text] if inbound.text else []
        notices: list[str] = []
        kept: list[Attachment] = []
        answerable = bool(inbound.text)
        for att in inbound.attachments:
            if att.error or not att.path:
                texts.append(refused_note(att))
                notices.append(refused_notice(att))
                kept.append(att)
                continue
            if att.kind == "image":
                seen = await self._image(workspace, att.path)
                if isinstance(seen, ImageInfo):
                    att = replace(att, width=seen.width, height=seen.height, preview=seen.preview)
                    texts.append(image_note(att, seen))
                    kept.append(att)
                    answerable = True
                    continue
                att = replace(att, kind="file")
                if seen is not None:  # an image kept as a file only: the person and the model are told why
                    texts.append(unshown_note(att, seen.reason))
                    notices.append(f"I couldn't look at {att.name} as an image: {seen.reason}. It is saved as a file.")
                    kept.append(att)
                    answerable = True
                    continue
            if att.kind in ("voice", "audio"):
                heard, problem = await self._transcribe(cfg, workspace, att)
                kept.append(att)
                if heard:
                    texts.append(voice_note(att, heard))
                    answerable = True
                else:
                    texts.append(f"[{'voice message' if att.kind == 'voice' else 'audio: ' + att.path}, "
                                 f"not transcribed: {problem}]")
                    what = "your voice message" if att.kind == "voice" else att.name
                    notices.append(f"I couldn't transcribe {what}: {problem}.")
                continue
            texts.append(file_note(att))
            kept.append(att)
            answerable = True
        return Intake("\n".join(texts), tuple(kept), tuple(notices), answerable)

    @staticmethod
    async def _image(workspace: Path, rel: str) -> ImageInfo | ImageRefused | None:
        try:
            return await image_for_model(workspace, rel)
        except (PathNotAllowed, OSError, FileRefused) as err:
            log.warning("image %s not prepared: %s", rel, err)
            return None

    async def _transcribe(self, cfg: Config, workspace: Path, att: Attachment) -> tuple[str | None, str]:
        """(transcript, "") or (None, why not)."""
        t = cfg.transcription
        if not t.enabled:
            return None, "speech to text is turned off here (transcription.enabled)"
        base_url, key = cfg.transcription_endpoint()
        settings = TranscriptionSettings(base_url=base_url, api_key=key, model=t.model, timeout_s=t.timeout_s)
        try:
            audio = await asyncio.to_thread(_read_file, workspace, att.path)
        except (OSError, PathNotAllowed) as err:
            log.warning("audio %s unreadable: %s", att.path, err)
            return None, "the saved file could not be read"
        name = os.path.basename(att.path)
        try:
            text = await self.transcriber.transcribe(settings, audio, filename=name,
                                                     mime=att.mime or "application/octet-stream")
        except ModelError as err:
            log.warning("transcription failed", extra={"kind": err.kind, "status": err.status,
                                                       "detail": err.detail[:300]})
            return None, transcription_failure(err, t.timeout_s)
        if not text.strip():
            return None, "no words could be made out in it"
        return " ".join(text.split()) if "\n" not in text else text.strip(), ""

    # -- images in requests --------------------------------------------------------------

    async def resolve_images(self, messages: list[dict[str, Any]], workspace: Path) -> list[dict[str, Any]]:
        """`messages` with each `workspace:` image part replaced by a base64 data URL (a
        short text part when the file is gone). The engine's dicts are never changed: the
        messages with images are copied."""
        out: list[dict[str, Any]] | None = None
        for index, msg in enumerate(messages):
            content = msg.get("content")
            if not isinstance(content, list) or not any(image_reference(p) for p in content):
                continue
            parts: list[dict[str, Any]] = []
            for part in content:
                ref = image_reference(part)
                if ref is None:
                    parts.append(part)
                    continue
                url = await self._data_url(workspace, ref)
                if url is None:
                    parts.append({"type": "text", "text": f"[image {ref} is no longer available]"})
                else:
                    detail = (part.get("image_url") or {}).get("detail") or "auto"
                    parts.append({"type": "image_url", "image_url": {"url": url, "detail": detail}})
            if out is None:
                out = list(messages)
            out[index] = {**msg, "content": parts}
        return messages if out is None else out

    async def _data_url(self, workspace: Path, rel: str) -> str | None:
        try:
            stamp = await asyncio.to_thread(_stamp, workspace, rel)
        except (OSError, PathNotAllowed):
            return None
        cached = self._data_urls.get(stamp)
        if cached is not None:
            self._data_urls.move_to_end(stamp)
            return cached
        try:
            url = await asyncio.to_thread(_encode, workspace, rel)
        except (OSError, PathNotAllowed):
            return None
        self._data_urls[stamp] = url
        self._data_url_chars += len(url)
        while self._data_url_chars > DATA_URL_CACHE_CHARS and len(self._data_urls) > 1:
            _, old = self._data_urls.popitem(last=False)
            self._data_url_chars -= len(old)
        return url


def _read_file(workspace: Path, rel: str) -> bytes:
    with Dir.open(workspace) as ws:
        return ws.read_bytes(rel)


def _stamp(workspace: Path, rel: str) -> tuple[str, int, int]:
    with Dir.open(workspace) as ws:
        st = ws.stat(rel)
    return str(workspace / normalized(rel)), st.st_mtime_ns, st.st_size


def _encode(workspace: Path, rel: str) -> str:
    mime = _MIME_OF_EXT.get(os.path.splitext(rel)[1].lower(), "image/jpeg")
    with Dir.open(workspace) as ws:
        data = ws.read_bytes(rel)
    return f"data:{mime};base64," + base64.b64encode(data).decode("ascii")
