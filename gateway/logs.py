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


class LineHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """stderr, one line per record. A stderr that went away (`gateway run 2>&1 | tee log`,
    then Ctrl+C ends tee too) silences the log; it never raises into the shutdown."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.broken = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.broken:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        if isinstance(sys.exc_info()[1], OSError):  # BrokenPipeError, EIO: nobody reads any more
            self.broken = True
            return
        super().handleError(record)


def setup_logging(level: str = "INFO") -> Redactor:
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_gateway", False):
            root.removeHandler(handler)
    handler = LineHandler()
    handler.setFormatter(LineFormatter(REDACTOR))
    handler._gateway = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    # Python warnings (a library's DeprecationWarning, an unclosed socket) print two lines of
    # their own to stderr; through logging each is one record on one line like the rest.
    logging.captureWarnings(True)
    set_log_level(level)
    return REDACTOR


def set_log_level(level: str) -> None:
    """The gateway's level; chatty libraries stay at WARNING or above. A reload calls it too."""
    logging.getLogger().setLevel(level)
    # watchfiles says "1 change detected" at INFO for every save of config.json; the
    # reload logs what changed.
    noisy_libraries = ("httpx", "httpcore", "httpx2", "httpcore2", "openai", "telegram", "slack_sdk",
                       "slack_bolt", "apscheduler", "aiosqlite", "watchfiles")
    for noisy in noisy_libraries:
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLevelName(level)))
