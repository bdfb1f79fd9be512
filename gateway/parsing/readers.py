"""What tools and media call: a page's Markdown, a PDF's pages, an image measured and
scaled for the model, each read by a bounded child process (gateway.parsing.jobs). A
job that fails raises ParseError (images: an ImageRefused), with words for the model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, BinaryIO

from gateway.parsing import image_scale, jobs
from gateway.parsing.jobs import ParseError

CHARSET_MAX_CHARS = 64  # a charset name from a server's header; real ones are under 20


def _title(header: dict[str, Any]) -> str | None:
    title = header.get("title")
    return title if isinstance(title, str) and title else None


async def read_html(body: bytes, charset: str | None, *, within_s: float | None = None) -> tuple[str | None, str]:
    """(title, Markdown) of an HTML page (gateway.parsing.html_text)."""
    answer = await jobs.run("html", what="the page", data=body, within_s=within_s,
                            options={"charset": charset[:CHARSET_MAX_CHARS] if charset else None})
    return _title(answer.header), answer.text("the page")


async def read_pdf(*, data: bytes | None = None, file: BinaryIO | None = None,
                   within_s: float | None = None) -> tuple[str | None, list[str]]:
    """(title, each page's text) of a PDF (gateway.parsing.pdf_text), from bytes or an
    open file."""
    answer = await jobs.run("pdf", what="the PDF", data=data, file=file, within_s=within_s)
    text, lengths = answer.text("the PDF"), answer.header.get("pages")
    if not isinstance(lengths, list) or not all(isinstance(n, int) and n >= 0 for n in lengths) \
            or sum(lengths) != len(text):
        raise ParseError("the PDF could not be read: the reader gave a malformed answer")
    pages, start = [], 0
    for length in lengths:
        pages.append(text[start:start + length])
        start += length
    return _title(answer.header), pages


@dataclass(frozen=True, slots=True)
class ScaledImage:
    """An image as the model is shown it: the file itself (`copy` None) or a scaled copy."""

    width: int  # of what the model is shown
    height: int
    original_width: int  # the file's own size, upright
    original_height: int
    copy: bytes | None = None  # the scaled copy, to be saved next to the file
    copy_format: str | None = None  # JPEG | PNG


@dataclass(frozen=True, slots=True)
class ImageRefused:
    """An image kept as a file only; `reason` completes "I couldn't look at it: …"."""

    reason: str


def _size(header: dict[str, Any], *keys: str) -> tuple[int, ...]:
    values = tuple(header.get(k) for k in keys)
    if not all(isinstance(v, int) and v > 0 for v in values):
        raise ParseError("it could not be read: the reader gave a malformed answer")
    return values  # type: ignore[return-value]


async def read_image(file: BinaryIO, max_side: int) -> ScaledImage | ImageRefused | None:
    """Measure the image in `file` and, when the model cannot be sent it as it is, scale a
    copy to at most `max_side` pixels a side (gateway.parsing.image_scale). None when it
    is not an image Pillow reads."""
    options = {"max_side": max_side, "max_pixels": image_scale.MAX_PIXELS,
               "decode_pixels": image_scale.DECODE_PIXELS}
    try:
        answer = await jobs.run("image", what="it", file=file, options=options)
        found = answer.header.get("image")
        if found == "not_image":
            return None
        if found == "too_large":
            return ImageRefused(str(answer.header.get("reason") or "it is too large"))
        if found == "as_is":
            width, height = _size(answer.header, "width", "height")
            return ScaledImage(width, height, width, height)
        if found == "scaled" and answer.header.get("format") in ("JPEG", "PNG") and answer.payload:
            width, height, original_width, original_height = _size(
                answer.header, "width", "height", "original_width", "original_height")
            return ScaledImage(width, height, original_width, original_height, answer.payload,
                               answer.header["format"])
        raise ParseError("it could not be read: the reader gave a malformed answer")
    except ParseError as err:
        return ImageRefused(str(err))
