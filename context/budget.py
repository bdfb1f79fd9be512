"""The budgets one request must respect (SPEC §2, §4.3): a frozen snapshot of the config.

The shell builds it from its config (`gateway.config.Config.context_budget()`); the engine
knows nothing of the config itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# When the output reserve eats the whole window (a misconfiguration), keep a usable part
# of the window instead of a zero budget.
_MIN_WINDOW_SHARE = 2
# Requests stay this far under the budget: counts are exact by tiktoken and our framing
# constants, but a provider frames messages and tool schemas its own way, and until its
# reported usage has calibrated a session (its first request, or after a restart) a
# request filled to the last token overflows a window by a few. 1 % of the budget, at
# least 16 tokens, never more than a tenth of a tiny budget.
FRAMING_MARGIN_SHARE = 0.01
FRAMING_MARGIN_MIN = 16


def framing_margin(tokens: int) -> int:
    """The tokens a request leaves unused under a budget of `tokens`."""
    return min(max(FRAMING_MARGIN_MIN, math.ceil(tokens * FRAMING_MARGIN_SHARE)), tokens // 10)


@dataclass(frozen=True, slots=True)
class Budget:
    max_tokens: int  # agent_max_context_tokens
    max_turns: int  # agent_max_context_turns
    context_window: int | None  # the model's context window, when known
    max_output_tokens: int  # model.max_output_tokens: reserved for the answer
    tool_result_max_chars: int  # stage-1 cap
    history_tool_result_max_chars: int  # stage-2 cap
    vision: bool = False  # model.vision: images a person sent are shown to the model (SPEC §5.4)

    @property
    def effective_tokens(self) -> int:
        """min(budget, window − output reserve) when the window is known (SPEC §4.3)."""
        if self.context_window is None:
            return self.max_tokens
        room = self.context_window - self.max_output_tokens
        if room <= 0:
            room = self.context_window // _MIN_WINDOW_SHARE
        return max(1, min(self.max_tokens, room))
