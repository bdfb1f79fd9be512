"""Discord (discord.py: the gateway websocket for receiving, REST for sending): the
adapter, Discord messages as `Inbound`, the streamed reply, Markdown in Discord-sized
messages, and the transport aimed at `channels.discord.api_base`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from channels.base import ChannelHooks
from gateway.config.schema import DiscordConfig

if TYPE_CHECKING:
    from channels.discord.adapter import DiscordChannel


def from_config(cfg: DiscordConfig, hooks: ChannelHooks) -> DiscordChannel:
    from channels.discord.adapter import DiscordChannel

    return DiscordChannel(cfg, hooks)
