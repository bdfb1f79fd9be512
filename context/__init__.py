"""The context engine (SPEC §4): a pure, synchronous library. No I/O, no asyncio.

The agent loop keeps one `SessionContext` per live session, appends every stored
message, and calls `prepare()` before each decision step; effects in the result
(summaries to write) and stage-1 `SaveFile`s are performed by the shell.
"""

from .budget import Budget
from .effects import Prepared, SummarizeTurns, TrimEvent
from .engine import (
    FINAL_INSTRUCTION,
    SessionContext,
    compact,
    context_stats,
    prepare,
    recover_overflow,
)
from .restore import restore_messages, restored_turn_count
from .stats import ContextStats, format_context_stats
from .summary import SUMMARY_SECTIONS, extractive_summary, injection_text, summary_request
from .tokens import TokenCounter
from .truncate import CutResult, FileRef, SaveFile, cut_tool_result, read_window, result_path, shorten
from .turns import is_paired, split_turns

__all__ = [
    "FINAL_INSTRUCTION",
    "SUMMARY_SECTIONS",
    "Budget",
    "ContextStats",
    "CutResult",
    "FileRef",
    "Prepared",
    "SaveFile",
    "SessionContext",
    "SummarizeTurns",
    "TokenCounter",
    "TrimEvent",
    "compact",
    "context_stats",
    "cut_tool_result",
    "extractive_summary",
    "format_context_stats",
    "injection_text",
    "is_paired",
    "prepare",
    "read_window",
    "recover_overflow",
    "restore_messages",
    "restored_turn_count",
    "result_path",
    "shorten",
    "split_turns",
    "summary_request",
]
