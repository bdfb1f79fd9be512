"""The budgets one request must respect (SPEC §2, §4.3): a frozen snapshot of the config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.config import Config

# When the output reserve eats the whole window (a misconfiguration), keep a usable part
# of the window instead of a zero budget.
_MIN_WINDOW_SHARE = 2


@dataclass(frozen=True, slots=True)
class Budget:
    max_tokens: int  # agent_max_context_tokens
    max_turns: int  # agent_max_context_turns
    context_window: int | None  # model.context_window (or the table in gateway.config)
    max_output_tokens: int  # model.max_output_tokens: reserved for the answer
    tool_result_max_chars: int  # stage-1 cap
    history_tool_result_max_chars: int  # stage-2 cap

    @property
    def effective_tokens(self) -> int:
        """min(budget, window − output reserve) when the window is known (SPEC §4.3)."""
        if self.context_window is None:
            return self.max_tokens
        room = self.context_window - self.max_output_tokens
        if room <= 0:
            room = self.context_window // _MIN_WINDOW_SHARE
        return max(1, min(self.max_tokens, room))

    @classmethod
    def from_config(cls, cfg: Config) -> Budget:
        return cls(
            max_tokens=cfg.agent_max_context_tokens,
            max_turns=cfg.agent_max_context_turns,
            context_window=cfg.model.window(),
            max_output_tokens=cfg.model.max_output_tokens,
            tool_result_max_chars=cfg.tool_result_max_chars,
            history_tool_result_max_chars=cfg.history_tool_result_max_chars,
        )
