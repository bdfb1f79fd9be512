"""Slack (slack-bolt in Socket Mode or over HTTP): the adapter, the streamed reply, and
Markdown as mrkdwn."""

from __future__ import annotations

from typing import TYPE_CHECKING

from channels.base import ChannelHooks
from gateway.config.schema import SlackConfig

if TYPE_CHECKING:
    from channels.slack.adapter import SlackChannel


def from_config(cfg: SlackConfig, hooks: ChannelHooks) -> SlackChannel:
    from channels.slack.adapter import SlackChannel

    return SlackChannel(cfg, hooks.handle, workspace_for=hooks.workspace_for, admits=hooks.admits,
                        file_limit=hooks.file_limit, observe=hooks.observe, stream_interval=hooks.stream_interval,
                        decide=hooks.decide)
