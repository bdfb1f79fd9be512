"""Small files that are expensive to parse (the red team's findings H1, H2 and M1), built in
the test that needs them: nothing large is committed, and each is a valid file of its kind.

- `spinning_table_html`: a table whose cells all say colspan=100 rowspan=100. trafilatura
  pads every row with the placeholder cells the spans above it leave, so each row holds
  about 10,000 cells: 200 rows (9 KB) take ~22 s of CPU and ~460 MB in-process; 400 rows
  (19 KB) ~51 s and ~1 GB. The red team's 1.5 MB page would take hours.
- `shared_stream_pdf`: many pages whose /Contents is one and the same stream of text
  operators; pypdf parses it again for each page: 10 pages of 100,000 operators (5 KB)
  take ~25 s of CPU.
- `declared_huge_png`: a one-colour RGB PNG that says it is side×side; at 7745×7745
  (under Pillow's bomb limit) it is ~180 KB on disk and 180 MB once decoded. Written by
  hand, a row at a time, so making it never holds the pixels.
"""

from __future__ import annotations

import io
import struct
import zlib


def spinning_table_html(rows: int) -> bytes:
    cell = '<tr><td colspan="100" rowspan="100">a</td></tr>'
    return (f"<!doctype html><html><head><title>Tables</title></head><body><article><table>"
            f"{cell * rows}</table></article></body></html>").encode()


def shared_stream_pdf(pages: int, operators: int) -> bytes:
    """A PDF of `pages` pages that all show one content stream of `operators` text operators."""
    from pypdf import PdfWriter
    from pypdf.generic import ContentStream, DictionaryObject, NameObject

    writer = PdfWriter()
    font = DictionaryObject({NameObject("/Type"): NameObject("/Font"), NameObject("/Subtype"): NameObject("/Type1"),
                             NameObject("/BaseFont"): NameObject("/Helvetica")})
    resources = DictionaryObject({NameObject("/Font"): DictionaryObject({NameObject("/F1"): font})})
    first = writer.add_blank_page(612, 792)
    first[NameObject("/Resources")] = resources
    stream = ContentStream(None, writer)
    stream.set_data(b"BT /F1 12 Tf 72 720 Td " + b"(a) Tj 1 0 Td " * operators + b"ET")
    first.replace_contents(stream)
    first.compress_content_streams()
    shared = first.raw_get("/Contents")  # the indirect reference: every page points at it
    for _ in range(pages - 1):
        page = writer.add_blank_page(612, 792)
        page[NameObject("/Resources")] = resources
        page[NameObject("/Contents")] = shared
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def declared_huge_png(side: int, color: tuple[int, int, int] = (30, 120, 200)) -> bytes:
    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)  # 8-bit RGB, not interlaced
    row = b"\x00" + bytes(color) * side  # filter type 0, then the pixels
    packer = zlib.compressobj(9)
    idat = b"".join(packer.compress(row) for _ in range(side)) + packer.flush()
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")
