"""The image job: measure an image and, when the model cannot be sent it as it is (too large,
turned by EXIF, animated, or in a format providers do not take), make a scaled copy
(JPEG, or PNG when it has transparency). Runs in the child process
(gateway.parsing.child); the parent saves the copy.

Memory is bounded by the pixels decoded, never by the size a file declares: a JPEG is
decoded at a reduced scale (`draft`: 1/2, 1/4 or 1/8, chosen from the copy's size), any
other format is refused above DECODE_PIXELS, and nothing is opened above MAX_PIXELS.
Pillow's own decompression-bomb limits stay as they are, and the child's memory limit
(gateway.parsing.jobs) is the last defence.
"""

from __future__ import annotations

import io
import math
from typing import Any, BinaryIO

# Nothing larger is opened, whatever its format (60 MP: a 7745×7745 square; phone
# cameras make 12-50 MP). Pillow refuses 179 MP and more itself.
MAX_PIXELS = 60_000_000
# The most pixels one decode may produce: 4096×4096, 64 MB at 4 bytes a pixel (RGBA, CMYK,
# 32-bit modes); with the decoded image, the upright copy and the scaled one, a job stays
# far below the image lane's memory limit. Camera JPEGs fit after `draft`; a PNG or WebP
# this large is a poster, a scan or a bomb, and is kept as a file.
DECODE_PIXELS = 4096 * 4096
JPEG_QUALITY = 85
SENDABLE = frozenset({"JPEG", "PNG", "WEBP", "GIF"})  # formats providers take as they are
_JPEG_SCALES = (8, 4, 2)


def too_many_pixels(width: int, height: int, limit: int) -> str:
    side = math.isqrt(limit)
    return (f"at {width}×{height} it has more pixels than I open "
            f"(at most {limit / 1_000_000:.1f} million, as in {side}×{side})")


def _thumb_size(width: int, height: int, max_side: int) -> tuple[int, int]:
    scale = max_side / max(width, height)
    return max(1, round(width * scale)), max(1, round(height * scale))


def _draft_request(width: int, height: int, max_side: int, budget: int) -> tuple[int, int]:
    """The size to ask a JPEG's `draft` for: (max_side, max_side) as always, unless the
    reduction Pillow picks from it would still decode more than `budget` pixels (a long
    panorama), then the copy's own size, which lets it reduce by up to 8."""
    scale = min(width // max_side, height // max_side)
    reduce = next((s for s in _JPEG_SCALES if s <= scale), 1)
    if math.ceil(width / reduce) * math.ceil(height / reduce) <= budget:
        return max_side, max_side
    return _thumb_size(width, height, max_side)


def scale_image(source: BinaryIO, max_side: int, max_pixels: int = MAX_PIXELS,
                decode_pixels: int = DECODE_PIXELS) -> tuple[dict[str, Any], bytes]:
    """(what was found, the scaled copy's bytes or b"").

    `{"image": "not_image"}`; `{"image": "too_large", "reason", "width", "height"}`;
    `{"image": "as_is", "width", "height"}` when the file itself can be sent; or
    `{"image": "scaled", "width", "height", "original_width", "original_height",
    "format"}` with the copy."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    try:
        with Image.open(source) as img:
            width, height = img.size
            if width <= 0 or height <= 0:
                return {"image": "not_image"}, b""
            if width * height > max_pixels:
                return {"image": "too_large", "reason": too_many_pixels(width, height, max_pixels),
                        "width": width, "height": height}, b""
            if img.format == "JPEG":
                img.draft("RGB", _draft_request(width, height, max_side, decode_pixels))  # decode reduced
            # Before anything that may decode: a PNG's EXIF can follow its pixels, so
            # getexif() loads them, and so do a GIF's frames.
            if img.size[0] * img.size[1] > decode_pixels:
                return {"image": "too_large", "reason": too_many_pixels(width, height, decode_pixels),
                        "width": width, "height": height}, b""
            orientation = img.getexif().get(0x0112, 1)
            upright = (height, width) if orientation in (5, 6, 7, 8) else (width, height)
            animated = bool(getattr(img, "is_animated", False))
            if img.format in SENDABLE and max(width, height) <= max_side and orientation == 1 and not animated:
                return {"image": "as_is", "width": width, "height": height}, b""
            img.load()
            shown = ImageOps.exif_transpose(img) or img
            shown.thumbnail((max_side, max_side), Image.Resampling.LANCZOS)
            alpha = shown.mode in ("RGBA", "LA", "PA") or (shown.mode == "P" and "transparency" in shown.info)
            out = io.BytesIO()
            if alpha:
                shown.convert("RGBA").save(out, "PNG")
            else:
                shown.convert("RGB").save(out, "JPEG", quality=JPEG_QUALITY)
            return {"image": "scaled", "width": shown.width, "height": shown.height, "original_width": upright[0],
                    "original_height": upright[1], "format": "PNG" if alpha else "JPEG"}, out.getvalue()
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError, SyntaxError):
        return {"image": "not_image"}, b""


def job(source: BinaryIO, options: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
    return scale_image(source, int(options["max_side"]), int(options["max_pixels"]), int(options["decode_pixels"]))
