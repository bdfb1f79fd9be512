"""Telegram (python-telegram-bot's Bot API client, our own update loop): the adapter, the
streamed reply, Markdown as Telegram entities, and the HTTP transport."""

from __future__ import annotations

from typing import TYPE_CHECKING

from channels.base import ChannelHooks
from gateway.config.schema import TelegramConfig

if TYPE_CHECKING:
    from channels.telegram.adapter import TelegramChannel


def from_config(cfg: TelegramConfig, hooks: ChannelHooks) -> TelegramChannel:
    from channels.telegram.adapter import TelegramChannel

    return TelegramChannel(cfg, hooks.handle, workspace_for=hooks.workspace_for, commands=hooks.commands,
                           admits=hooks.admits, file_limit=hooks.file_limit, observe=hooks.observe,
                           stream_interval=hooks.stream_interval, decide=hooks.decide)
