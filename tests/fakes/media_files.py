"""Real files for the fakes to serve (SPEC §5.4): a PNG or JPEG made with Pillow, an
Ogg Opus voice note, a one-page PDF with text. Each is a valid file of its kind, built
here without the network.

The voice note: Pillow has no audio, and no Opus encoder is installed here, so
`make_ogg_opus` writes the Ogg container by hand (RFC 3533 pages with their CRC, an
`OpusHead` and an `OpusTags` header as RFC 7845 asks) holding Opus packets of 20 ms of
silence (a TOC byte and an empty frame, which RFC 6716 allows). A player plays it as
silence; the fake transcription endpoint only records the bytes it gets.
"""

from __future__ import annotations

import io
import struct


def make_image(width: int, height: int, *, fmt: str = "PNG", color: tuple[int, int, int] = (200, 80, 40),
               alpha: bool = False, exif_orientation: int | None = None) -> bytes:
    """An image of `width` x `height` with a pattern (so it does not compress to nothing)."""
    from PIL import Image

    mode = "RGBA" if alpha else "RGB"
    img = Image.new(mode, (width, height), (*color, 128) if alpha else color)
    step = max(1, min(width, height) // 8)
    for x in range(0, width, step):
        for y in range(0, height, step):
            if (x // step + y // step) % 2:
                img.putpixel((x, y), (255, 255, 255, 255) if alpha else (255, 255, 255))
    out = io.BytesIO()
    if exif_orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = exif_orientation
        img.save(out, fmt, exif=exif.tobytes())
    else:
        img.save(out, fmt)
    return out.getvalue()


# -- Ogg Opus ---------------------------------------------------------------------------------

def _ogg_crc(data: bytes) -> int:
    """Ogg's CRC-32: polynomial 0x04C11DB7, not reflected, initial value 0."""
    crc = 0
    for byte in data:
        crc ^= byte << 24
        for _ in range(8):
            crc = ((crc << 1) ^ 0x04C11DB7) if crc & 0x80000000 else crc << 1
            crc &= 0xFFFFFFFF
    return crc


def _ogg_page(packets: list[bytes], *, serial: int, sequence: int, granule: int, flags: int) -> bytes:
    lacing = b""
    for packet in packets:
        lacing += b"\xff" * (len(packet) // 255) + bytes([len(packet) % 255])
    assert len(lacing) <= 255
    header = struct.pack("<4sBBqIIIB", b"OggS", 0, flags, granule, serial, sequence, 0, len(lacing))
    page = header + lacing + b"".join(packets)
    crc = _ogg_crc(page)
    return page[:22] + struct.pack("<I", crc) + page[26:]


def make_ogg_opus(seconds: float, *, serial: int = 0x5EC0DE) -> bytes:
    """A mono Ogg Opus stream of `seconds` of silence (see the module docstring)."""
    pre_skip = 312
    head = b"OpusHead" + struct.pack("<BBHIhB", 1, 1, pre_skip, 48_000, 0, 0)
    vendor = b"chat-gateway tests"
    tags = b"OpusTags" + struct.pack("<I", len(vendor)) + vendor + struct.pack("<I", 0)
    pages = [
        _ogg_page([head], serial=serial, sequence=0, granule=0, flags=0x02),
        _ogg_page([tags], serial=serial, sequence=1, granule=0, flags=0x00),
    ]
    frames = max(1, round(seconds * 50))  # 20 ms each
    silence = bytes([31 << 3])  # TOC: CELT fullband 20 ms, mono, one frame; the frame is empty
    sequence, done = 2, 0
    while done < frames:
        batch = min(50, frames - done)
        done += batch
        last = done == frames
        pages.append(_ogg_page([silence] * batch, serial=serial, sequence=sequence,
                               granule=pre_skip + done * 960, flags=0x04 if last else 0x00))
        sequence += 1
    return b"".join(pages)


def ogg_pages(data: bytes) -> list[tuple[int, int, bytes]]:
    """(flags, granule, payload) of each page, checking capture patterns and CRCs."""
    pages = []
    pos = 0
    while pos < len(data):
        magic, version, flags, granule, _serial, _seq, crc, count = struct.unpack_from("<4sBBqIIIB", data, pos)
        assert magic == b"OggS" and version == 0
        lacing = data[pos + 27:pos + 27 + count]
        size = sum(lacing)
        end = pos + 27 + count + size
        page = data[pos:end]
        assert _ogg_crc(page[:22] + b"\0\0\0\0" + page[26:]) == crc, "bad Ogg CRC"
        pages.append((flags, granule, page[27 + count:]))
        pos = end
    return pages


# -- PDF --------------------------------------------------------------------------------------

def make_pdf(lines: list[str], title: str, *, pages: int = 1) -> bytes:
    """A minimal PDF with Helvetica text, built by hand (xref offsets included); with
    `pages` > 1 every page carries the lines, numbered."""
    objects: list[bytes] = [b"<< /Type /Catalog /Pages 2 0 R >>", b""]
    kids = []
    for page in range(pages):
        ops = ["BT /F1 12 Tf 72 720 Td"]
        for i, line in enumerate(lines):
            text = line if pages == 1 else f"{line} (page {page + 1})"
            ops.append(("" if i == 0 else "0 -18 Td ") + f"({text}) Tj")
        ops.append("ET")
        content = "\n".join(ops).encode()
        page_number = len(objects) + 1
        kids.append(f"{page_number} 0 R")
        objects.append(f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents {page_number + 1} 0 R "
                       f"/Resources << /Font << /F1 FONT 0 R >> >> >>".encode())
        objects.append(b"<< /Length %d >>\nstream\n" % len(content) + content + b"\nendstream")
    font = len(objects) + 1
    objects = [o.replace(b"FONT", str(font).encode()) for o in objects]
    objects.append(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>")
    objects.append(f"<< /Title ({title}) >>".encode())
    objects[1] = f"<< /Type /Pages /Kids [{' '.join(kids)}] /Count {pages} >>".encode()
    out = b"%PDF-1.4\n"
    offsets = []
    for number, obj in enumerate(objects, 1):
        offsets.append(len(out))
        out += f"{number} 0 obj\n".encode() + obj + b"\nendobj\n"
    xref = len(out)
    out += f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode()
    out += b"".join(f"{offset:010d} 00000 n \n".encode() for offset in offsets)
    out += (f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R /Info {len(objects)} 0 R >>\n"
            f"startxref\n{xref}\n%%EOF\n").encode()
    return out
