"""`current_time`: the date and time in the configured (or a requested) time zone."""

from __future__ import annotations

from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from gateway.tools.base import ToolContext, ToolError, ToolOutput


class CurrentTime:
    name = "current_time"
    description = "The current date and time. Optionally give an IANA time zone such as 'Europe/Paris'."
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {"timezone": {"type": "string", "description": "IANA time zone name"}},
        "additionalProperties": False,
    }

    async def run(self, args: dict[str, Any], ctx: ToolContext) -> ToolOutput:
        zone_name = args.get("timezone") or ctx.config.timezone
        try:
            tz = ZoneInfo(zone_name) if zone_name else None
        except (ZoneInfoNotFoundError, ValueError) as err:
            raise ToolError(f"unknown time zone {zone_name!r}") from err
        now = datetime.now(tz).astimezone(tz) if tz else datetime.now().astimezone()
        return ToolOutput(f"{now.isoformat(timespec='seconds')} ({now.strftime('%A')}, {now.tzname()})")
