"""Background summaries of trimmed turns (SPEC §4.2): never delays a reply; a failure or
timeout falls back to an extractive note; nothing is lost (the raw rows stay in the
database and are archived to dialog/)."""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime

from context.engine import SummarizeTurns
from context.summary import extractive_summary, summary_request
from gateway.live import LiveSession
from gateway.model import ModelError
from gateway.services import Services

log = logging.getLogger("gateway.summarizer")


def dialog_rows(effect: SummarizeTurns) -> list[dict[str, object]]:
    return [
        {
            "session_key": effect.session_key,
            "turn": m.turn,
            "role": m.role,
            "content": m.content,
            "tool_call_ids": [c.id for c in m.tool_calls] or ([m.tool_call_id] if m.tool_call_id else []),
            "tool_calls": [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in m.tool_calls],
            "time": datetime.fromtimestamp(m.created_at).astimezone().isoformat(timespec="seconds"),
        }
        for m in effect.messages
        if not m.injected
    ]


class Summarizer:
    def __init__(self, services: Services) -> None:
        self.s = services

    def submit(self, live: LiveSession, effect: SummarizeTurns) -> None:
        if effect.upto_turn in live.summarizing:
            return
        live.summarizing.add(effect.upto_turn)
        self.s.background.spawn(self._run(live, effect), name=f"summary:{live.key}:{effect.upto_turn}")

    async def _model_summary(self, effect: SummarizeTurns) -> str | None:
        try:
            async with asyncio.timeout(self.s.cfg.summary_timeout_s):
                async with self.s.model_slots:
                    reply = await self.s.summary_model.complete(summary_request(effect))
        except (ModelError, TimeoutError) as err:
            log.warning("summary failed; using the extractive note",
                        extra={"session": effect.session_key, "error": str(err)[:200]})
            return None
        text = (reply.content or "").strip()
        return text or None

    async def _run(self, live: LiveSession, effect: SummarizeTurns) -> None:
        try:
            text = await self._model_summary(effect)
            if text is None:
                self.s.metrics.summary_failures.inc()
                text = extractive_summary(effect)
            self.s.metrics.compactions.labels(effect.reason).inc()
            await self.s.store.add_summary(live.key, live.scope, upto_turn=effect.upto_turn,
                                           reason=effect.reason, text=text)
            memory = self.s.memory
            if memory is not None:
                heading = f"Summary of {live.key}, turns up to {effect.upto_turn} ({effect.reason})"
                await memory.append_daily(live.scope, text, heading=heading)
                rows = [r for r in dialog_rows(effect) if int(r["turn"]) > live.archived_upto]  # type: ignore[call-overload]
                if rows:
                    await memory.archive_dialog(live.scope, rows)
            live.archived_upto = max(live.archived_upto, effect.upto_turn)
            live.ctx.offer_summary(text, effect.upto_turn)
        finally:
            live.summarizing.discard(effect.upto_turn)
