"""Structured logs: one line per event, `key=value` extras (session key included),
every configured secret redacted."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterable

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


class Redactor(logging.Filter):
    """Replaces secret values wherever they appear in a formatted line."""

    def __init__(self) -> None:
        super().__init__()
        self.secrets: list[str] = []

    def set_secrets(self, values: Iterable[str | None]) -> None:
        self.secrets = sorted({v for v in values if v and len(v) >= 4}, key=len, reverse=True)

    def redact(self, text: str) -> str:
        for secret in self.secrets:
            if secret in text:
                text = text.replace(secret, "***")
        return text


class LineFormatter(logging.Formatter):
    def __init__(self, redactor: Redactor) -> None:
        super().__init__()
        self.redactor = redactor

    def format(self, record: logging.LogRecord) -> str:
        parts = [
            self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            record.levelname,
            record.name,
            json.dumps(record.getMessage(), ensure_ascii=False),
        ]
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                parts.append(f"{key}={json.dumps(value, ensure_ascii=False, default=str)}")
        line = " ".join(parts)
        if record.exc_info:
            line += " exc=" + json.dumps(self.formatException(record.exc_info), ensure_ascii=False)
        return self.redactor.redact(line)


REDACTOR = Redactor()


def setup_logging(level: str = "INFO") -> Redactor:
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_gateway", False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(LineFormatter(REDACTOR))
    handler._gateway = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    set_log_level(level)
    return REDACTOR


def set_log_level(level: str) -> None:
    """The gateway's level; chatty libraries stay at WARNING or above. A reload calls it too."""
    logging.getLogger().setLevel(level)
    noisy_libraries = ("httpx", "httpcore", "httpx2", "httpcore2", "openai", "telegram", "slack_sdk",
                       "slack_bolt", "apscheduler", "aiosqlite")
    for noisy in noisy_libraries:
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLevelName(level)))
