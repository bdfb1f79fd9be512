"""The HTML job: a page as Markdown through trafilatura (the article, not menus and
scripts). Runs in the child process (gateway.parsing.child)."""

from __future__ import annotations

from typing import Any, BinaryIO

MAX_TITLE_CHARS = 2000  # a title is a line; a page that says more is not giving a title


def decode_text(body: bytes, charset: str | None) -> str:
    """`body` in its declared charset (UTF-8 when it names none Python knows)."""
    try:
        return body.decode(charset or "utf-8", errors="replace")
    except LookupError:  # a charset Python does not know
        return body.decode("utf-8", errors="replace")


def html_to_markdown(body: bytes, charset: str | None) -> tuple[str | None, str]:
    """(title, Markdown) of an HTML page: the main content, without navigation, scripts and
    boilerplate; the page's whole text when no main content stands out."""
    import trafilatura

    html: str | bytes = decode_text(body, charset) if charset else body  # bytes: trafilatura detects the encoding
    tree = trafilatura.load_html(html)
    if tree is None:
        return None, ""
    meta = trafilatura.extract_metadata(tree)
    text = trafilatura.extract(tree, output_format="markdown", include_comments=False, include_tables=True,
                               include_links=True, include_formatting=True)
    if not text:
        text = trafilatura.html2txt(html)
    title = meta.title if meta is not None and meta.title else None
    return title[:MAX_TITLE_CHARS] if title else None, (text or "").strip()


def job(source: BinaryIO, options: dict[str, Any]) -> tuple[dict[str, Any], str]:
    charset = options.get("charset")
    title, text = html_to_markdown(source.read(), charset if isinstance(charset, str) else None)
    return {"title": title}, text
