"""The PDF job: a PDF's title and the text of each page through pypdf. Runs in the child
process (gateway.parsing.child)."""

from __future__ import annotations

import io
from typing import Any, BinaryIO

from gateway.parsing import Unreadable

MAX_TITLE_CHARS = 2000  # a title is a line; a file that says more is not giving a title


def pdf_pages(data: bytes) -> tuple[str | None, list[str]]:
    """(title, each page's text, stripped)."""
    from pypdf import PdfReader

    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted and not reader.decrypt(""):
            raise Unreadable("the PDF is encrypted")
        title = reader.metadata.title if reader.metadata is not None else None
        pages = [(page.extract_text() or "").strip() for page in reader.pages]
    except (Unreadable, MemoryError):
        raise
    except Exception as err:  # pypdf raises many kinds on damaged files
        raise Unreadable(f"the PDF could not be read ({type(err).__name__}: {str(err)[:200]})") from None
    title = str(title).strip()[:MAX_TITLE_CHARS] if title else None
    return title or None, pages


def job(source: BinaryIO, options: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The pages' texts one after the other; the header gives each one's length."""
    title, pages = pdf_pages(source.read())
    return {"title": title, "pages": [len(p) for p in pages]}, "".join(pages)
