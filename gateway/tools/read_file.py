"""`read_file`: a workspace file from a line or a character offset (SPEC §4.1, §5).

Results are cut by stage 1 like any tool result, but the notice points at the file
itself (no copy is saved), so every notice can be followed with another read_file call.
Paths under `skills/` read the skills this agent may use (SPEC §5.6), read-only, never
out of a skill's folder; the rest is the session's workspace.
A PDF (a file people sent, say: SPEC §5.4) is read as its text, page by page, and its
offsets count in that text; other binary files are refused with what they are. The PDF is
read by a child process under CPU, memory and time limits (gateway.parsing, SPEC §9);
its text is kept here for the next call that continues it.
"""

from __future__ import annotations

import asyncio
import os
import stat
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from context.truncate import read_window
from gateway.beneath import Dir, PathNotAllowed, normalized
from gateway.media import FILES_DIR
from gateway.parsing.jobs import ParseError
from gateway.parsing.readers import read_pdf
from gateway.skills.catalog import NO_SKILLS, is_skill_path, skill_file
from gateway.tools.base import FileRef, ToolArgumentError, ToolContext, ToolError, ToolOutput, check_arguments, shown

MAX_FILE_BYTES = 50 * 1024 * 1024
MAX_PATH_CHARS = 1024  # far beyond any real workspace path, well under the system's limit
SNIFF_BYTES = 8192
_IMAGE_HEADS = (b"\x89PNG", b"\xff\xd8\xff", b"GIF8", b"RIFF")  # PNG, JPEG, GIF, WebP (RIFF)


PDF_CACHE_ENTRIES = 4  # PDFs whose text is kept for the next read_file call that continues one


@dataclass(frozen=True, slots=True)
class _Pdf:
    """A PDF to read: the open file (a child process reads it) and its cache key."""

    file: IO[bytes]
    key: tuple[str, int, int]  # path, mtime_ns, size


def _read_workspace(root: Path, rel: str, key: str) -> str | _Pdf:
    """A workspace file's text, or the open PDF, opened beneath the workspace without
    following a link (a sandbox may swap names meanwhile: gateway.beneath). Runs in a
    worker thread."""
    try:
        with Dir.open(root) as ws:
            fd = ws.open_fd(rel, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO planted here holds nothing
    except PathNotAllowed as err:
        raise ToolError(str(err)) from None
    except (FileNotFoundError, NotADirectoryError):
        raise ToolError("no such file (paths are relative to your workspace)") from None
    except OSError as err:
        raise ToolError(f"cannot read the path {shown(rel)}: {err.strerror or type(err).__name__}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise ToolError(f"{shown(rel)} is a directory, not a file")
        if not stat.S_ISREG(st.st_mode):
            raise ToolError("no such file (paths are relative to your workspace)")
        os.set_blocking(fd, True)
        fh = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    return _read_open(fh, st, key, rel)


def _read_skill(path: Path, rel: str) -> str | _Pdf:
    """A skill's file (a folder no sandbox writes: gateway.skills checks it). Runs in a
    worker thread."""
    try:
        if path.is_dir():
            raise ToolError(f"{shown(rel)} is a directory, not a file")
        if not path.is_file():
            raise ToolError("no such file (paths are relative to your workspace)")
        fh = path.open("rb")
        st = os.fstat(fh.fileno())
    except OSError as err:
        raise ToolError(f"cannot read the path {shown(rel)}: {err.strerror or type(err).__name__}") from None
    return _read_open(fh, st, str(path), rel)


def _read_open(fh: IO[bytes], st: os.stat_result, key: str, rel: str) -> str | _Pdf:
    """The text of the open file, or the PDF (the caller then owns `fh`); else `fh` is closed."""
    try:
        if st.st_size > MAX_FILE_BYTES:
            raise ToolError(f"the file is larger than {MAX_FILE_BYTES // (1024 * 1024)} MB")
        head = fh.read(SNIFF_BYTES)
        if head.startswith(b"%PDF-"):
            fh.seek(0)
            return _Pdf(fh, (key, st.st_mtime_ns, st.st_size))  # the caller closes it
        if b"\x00" in head:
            what = "an image" if head.startswith(_IMAGE_HEADS) else "a binary file"
            raise ToolError(f"{shown(rel)} is {what}; read_file reads text and PDF files")
        # Bytes decoded whole: CRLF stays as it is, so offsets match the bytes on disk. What
        # grew past the limit since the stat is not read.
        data = head + fh.read(MAX_FILE_BYTES + 1 - len(head))
        if len(data) > MAX_FILE_BYTES:
            raise ToolError(f"the file is larger than {MAX_FILE_BYTES // (1024 * 1024)} MB")
        fh.close()
        return data.decode("utf-8", errors="replace")
    except OSError as err:
        fh.close()
        # A permission, an I/O error: the model's path, not our bug.
        raise ToolError(f"cannot read the path {shown(rel)}: {err.strerror or type(err).__name__}") from None
    except BaseException:
        fh.close()
        raise


_pdf_texts: OrderedDict[tuple[str, int, int], str] = OrderedDict()


async def _pdf_text(pdf: _Pdf) -> str:
    """A PDF's text, page by page under a `--- page N of M ---` line; kept for the next
    read_file call that continues it (keyed by path, mtime and size)."""
    try:
        cached = _pdf_texts.get(pdf.key)
        if cached is None:
            _title, pages = await read_pdf(file=pdf.file)
            count = len(pages)
            cached = "\n\n".join(f"--- page {n} of {count} ---\n{text}" for n, text in enumerate(pages, start=1)) + "\n"
            _pdf_texts[pdf.key] = cached
            while len(_pdf_texts) > PDF_CACHE_ENTRIES:
                _pdf_texts.popitem(last=False)
        _pdf_texts.move_to_end(pdf.key)
        return cached
    except ParseError as err:
        raise ToolError(str(err)) from None
    finally:
        await asyncio.to_thread(pdf.file.close)


class ReadFile:
    name = "read_file"
    description = (
        "Read a text or PDF file in your workspace (saved tool results in tool_results/, notes in memory/, "
        "archived conversation in dialog/, files people sent in files/), or a skill's files (skills/<name>/SKILL.md "
        "and the rest of its folder, read-only). Long results are cut with a notice that gives the exact read_file "
        "call to continue. Use start_line (1-based) or offset (character offset) to continue."
    )
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {
            "path": {"type": "string", "description": "path relative to the workspace"},
            "start_line": {"type": "integer", "minimum": 1},
            "offset": {"type": "integer", "minimum": 0},
        },
        "required": ["path"],
        "additionalProperties": False,
    }

    async def run(self, args: dict[str, Any], ctx: ToolContext) -> ToolOutput:
        check_arguments(self.parameters, args)
        rel: str = args["path"]
        offset, start_line = args.get("offset"), args.get("start_line")
        if offset is not None and start_line is not None:
            raise ToolArgumentError("give either offset or start_line, not both")
        if len(rel) > MAX_PATH_CHARS:
            raise ToolArgumentError(f"the path is {len(rel):,} characters long; paths in the workspace "
                                    f"are at most {MAX_PATH_CHARS:,}")
        try:
            if is_skill_path(rel):
                target, rel_path = await asyncio.to_thread(skill_file, ctx.skills or NO_SKILLS, rel)
                found = await asyncio.to_thread(_read_skill, target, rel)
            else:
                rel_path = normalized(rel)
                key = str(Path(ctx.workspace) / rel_path)
                found = await asyncio.to_thread(_read_workspace, Path(ctx.workspace), rel_path, key)
        except PathNotAllowed as err:
            raise ToolError(str(err)) from None
        text = found if isinstance(found, str) else await _pdf_text(found)
        window, start_offset, first_line = read_window(text, offset=offset, start_line=start_line)
        ref = FileRef(path=rel_path, start_offset=start_offset, start_line=first_line,
                      protected=rel_path.lower().endswith(".md"))
        # What people send is outside content like a web page (SPEC §5.7); notes, archives and
        # saved tool outputs are the gateway's own.
        sent = rel_path.startswith(f"{FILES_DIR}/")
        return ToolOutput(window, file_ref=ref, source=f"file {rel_path} that a person sent" if sent else None)
