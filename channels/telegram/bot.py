"""python-telegram-bot's `Bot`, plus the calls the message path makes with raw results.

PTB turns every answer into its objects: `sendMessage` and `editMessageText` answer with
a `Message`, whose `de_json` (the chat, the sender, dates, entities) cost about 0.4 ms per
call under load (bench/gateway_load.py with `--profile`), more than a web turn's whole
store work; and `Bot.get_updates` parses a whole batch at once, so one malformed update
would fail every poll. The replies only need the new message's id and the poll the
decoded JSON, so these calls take the library's request path (its parameters, its
transport, its errors: `RetryAfter`, `BadRequest`, `ChatMigrated`, `NetworkError`...)
and return what Telegram answered, decoded but not parsed.
"""

from __future__ import annotations

from typing import Any

from telegram import Bot
from telegram.error import TelegramError

from channels.telegram.updates import is_int

# Edits, channel posts, reactions … are not turns; callback queries are presses of a card's buttons.
ALLOWED_UPDATES = ("message", "callback_query")
POLL_READ_SLACK_S = 10.0  # HTTP read timeout beyond the long-poll timeout


class RawBot(Bot):
    async def fetch_raw_updates(self, *, offset: int, wait_s: int) -> list[Any]:
        data = {"offset": offset or None, "timeout": wait_s, "allowed_updates": list(ALLOWED_UPDATES)}
        result = await self._post("getUpdates", data, read_timeout=wait_s + POLL_READ_SLACK_S)
        return result if isinstance(result, list) else []

    async def call(self, method: str, params: dict[str, Any], *, timeout: float | None = None) -> Any:
        """One Bot API call; Telegram's `result`, decoded JSON. None values are left out
        (as PTB does); dicts and lists go as JSON."""
        timeouts: dict[str, Any] = {}
        if timeout is not None:
            timeouts = {"read_timeout": timeout, "write_timeout": timeout, "connect_timeout": timeout}
        return await self._post(method, params, **timeouts)

    async def send_text(self, params: dict[str, Any], *, timeout: float | None = None) -> int:
        """`sendMessage`; the new message's id."""
        return message_id(await self.call("sendMessage", params, timeout=timeout))


def message_id(result: Any) -> int:
    """The id of the message a call answered with; TelegramError when the answer has none."""
    if isinstance(result, dict) and is_int(result.get("message_id")):
        return int(result["message_id"])
    raise TelegramError(f"Telegram answered without a message id: {str(result)[:200]}")
