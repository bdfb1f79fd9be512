"""Images a person sent, in the request (SPEC §5.4): where they are shown, where a
one-line placeholder stands in, and how much they cost.

The engine stays pure: it never reads an image. It places an image part that names the
file (`"url": "workspace:<path>"`, with the image's size for counting), and the shell
turns that reference into the provider's data URL just before sending
(`gateway.media.resolve_images`). The stored message keeps only metadata (path, size).

Images a tool returned (an MCP server's) are stored with the tool message and shown the
same way, as a user message right after that step's tool results (`tool_images_message`).

The rule, like stage 2 for tool results: images are shown in the current turn and the
last `IMAGE_HISTORY_TURNS` historical turns when the model has vision; in older turns
each image becomes a placeholder line naming its file. Without vision nothing is added:
the stored text already says that an image came and where it lives.
"""

from __future__ import annotations

from typing import Any

from gateway.types import Attachment, Message

from .tokens import image_tokens

IMAGE_HISTORY_TURNS = 2  # historical turns, besides the current one, whose images are shown
IMAGE_REF_PREFIX = "workspace:"  # an image part's url before the shell resolves it
IMAGE_DETAIL = "high"


TOOL_IMAGES_TEXT = "The images the tool results above returned:"


def images_of(msg: Message) -> tuple[Attachment, ...]:
    """The images of a user message or a tool result that can be shown (saved and measured)."""
    if msg.role not in ("user", "tool") or not msg.attachments:
        return ()
    return tuple(a for a in msg.attachments if a.is_image)


def tool_images_message(images: tuple[Attachment, ...]) -> dict[str, Any]:
    """The images of one step's tool results as a user message placed right after those
    results: OpenAI chat format takes image parts only in user messages, and a message
    after the last result keeps every call paired with its result."""
    return {"role": "user", "content": with_images(TOOL_IMAGES_TEXT, images)}


def image_part(att: Attachment) -> dict[str, Any]:
    """An OpenAI `image_url` part that names the file; `width`/`height` are for counting
    and are dropped by the shell with the reference."""
    assert att.preview and att.width and att.height
    return {
        "type": "image_url",
        "image_url": {"url": IMAGE_REF_PREFIX + att.preview, "detail": IMAGE_DETAIL},
        "width": att.width,
        "height": att.height,
    }


def image_reference(part: dict[str, Any]) -> str | None:
    """The workspace path an image part still refers to, or None (text, a data URL)."""
    if part.get("type") != "image_url":
        return None
    url = (part.get("image_url") or {}).get("url")
    if isinstance(url, str) and url.startswith(IMAGE_REF_PREFIX):
        return url[len(IMAGE_REF_PREFIX):]
    return None


def placeholder(att: Attachment) -> str:
    """The line that stands in for an image no longer shown."""
    return f"[earlier image, no longer shown: {att.path}]"


def with_placeholders(text: str, images: tuple[Attachment, ...]) -> str:
    return "\n".join([text, *(placeholder(a) for a in images)]) if text else "\n".join(
        placeholder(a) for a in images)


def with_images(text: str, images: tuple[Attachment, ...]) -> list[dict[str, Any]]:
    """Content parts: the message's text first (so a summary can go in front of it), then
    its images."""
    return [{"type": "text", "text": text}, *(image_part(a) for a in images)]


def images_tokens(images: tuple[Attachment, ...]) -> int:
    return sum(image_tokens(a.width or 0, a.height or 0) for a in images)
