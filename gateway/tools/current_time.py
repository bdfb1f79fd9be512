"""`current_time`: the date and time in the configured (or a requested) time zone."""

from __future__ import annotations

from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from gateway.tools.base import ToolArgumentError, ToolContext, ToolOutput, check_arguments, shown

MAX_ZONE_CHARS = 64  # the longest IANA names are about 30 characters


class CurrentTime:
    name = "current_time"
    description = "The current date and time. Optionally give an IANA time zone such as 'Europe/Paris'."
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {"timezone": {"type": "string", "description": "IANA time zone name"}},
        "additionalProperties": False,
    }

    async def run(self, args: dict[str, Any], ctx: ToolContext) -> ToolOutput:
        try:
            check_arguments(self.parameters, args)
        except ToolArgumentError as err:
            raise ToolArgumentError(f"{err}; give an IANA time zone name such as 'Europe/Paris'") from None
        zone_name = args.get("timezone") or ctx.config.timezone
        try:
            if zone_name and len(zone_name) > MAX_ZONE_CHARS:
                raise ValueError("too long")
            tz = ZoneInfo(zone_name) if zone_name else None
        except (ZoneInfoNotFoundError, ValueError, OSError) as err:
            # OSError: a name that is a directory of the zone database ("America") or too long.
            raise ToolArgumentError(f"unknown time zone {shown(zone_name)}; give an IANA name such as "
                                    f"'Europe/Paris'") from err
        now = datetime.now(tz).astimezone(tz) if tz else datetime.now().astimezone()
        return ToolOutput(f"{now.isoformat(timespec='seconds')} ({now.strftime('%A')}, {now.tzname()})")
