"""Structured logs: one line per event, `key=value` extras (session key included),
every configured secret redacted."""

from __future__ import annotations

import contextlib
import json
import logging
import logging.handlers
import os
import sys
from collections import deque
from collections.abc import Iterable
from pathlib import Path

from gateway.model.errors import redact as redact_shapes

_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}
# One encoder for every value of every line: json.dumps with options builds a new encoder per
# call, which was most of the cost of a turn's log line (~80 µs of ~90).
_ENCODER = json.JSONEncoder(ensure_ascii=False, default=str)


def _json(value: object) -> str:
    """`json.dumps(value, ensure_ascii=False, default=str)`, faster for the common kinds."""
    kind = type(value)
    if kind is str:
        return _ENCODER.encode(value)  # the C string encoder, without the generic path
    if kind is int:
        return int.__repr__(value)  # type: ignore[arg-type]
    return _ENCODER.encode(value)


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

    def redact_shown(self, text: str) -> str:
        """Text from outside shown to people (an MCP server's error or stderr line): the
        configured secrets, and anything shaped like a key, which a server may print on an
        auth error with a key the gateway never saw."""
        return redact_shapes(self.redact(text))


class LineFormatter(logging.Formatter):
    """`time LEVEL logger "message" key=value…`; `terse` (for a person at a terminal):
    `level: message key=value…`, without the traceback."""

    def __init__(self, redactor: Redactor, *, terse: bool = False) -> None:
        super().__init__()
        self.redactor = redactor
        self.terse = terse
        self._second: tuple[int, str] = (-1, "")  # the last second formatted, and its text

    def _time(self, record: logging.LogRecord) -> str:
        second = int(record.created)
        if second != self._second[0]:  # a busy gateway logs many lines a second
            self._second = (second, self.formatTime(record, "%Y-%m-%dT%H:%M:%S"))
        return self._second[1]

    def format(self, record: logging.LogRecord) -> str:
        if self.terse:
            parts = [f"{record.levelname.lower()}: {record.getMessage()}"]
        else:
            parts = [self._time(record), record.levelname, record.name, _json(record.getMessage())]
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                parts.append(f"{key}={_json(value)}")
        line = " ".join(parts)
        if record.exc_info and not self.terse:
            line += " exc=" + _json(self.formatException(record.exc_info))
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


class QuietFileHandler(logging.handlers.RotatingFileHandler):
    """The chat's log file (0600, at most 2 × 5 MB). A file that cannot be written
    silences the log: it never prints tracebacks into the chat."""

    def __init__(self, path: Path) -> None:
        with contextlib.suppress(OSError):
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))
        super().__init__(path, maxBytes=5_000_000, backupCount=1, encoding="utf-8", delay=True)

    def handleError(self, record: logging.LogRecord) -> None:
        pass


class HeldLines(logging.Handler):
    """Warnings and errors for the person at the terminal chat, held while a prompt or an
    answer is on screen, so that no line lands inside either; the chat prints them
    (`take`) between an answer and the next prompt. Bounded: the oldest go first."""

    def __init__(self, limit: int = 50) -> None:
        super().__init__(logging.WARNING)
        self.lines: deque[str] = deque(maxlen=limit)
        self.dropped = 0

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:
            self.handleError(record)
            return
        # emit() runs under the handler's lock (any thread may log); take() holds it too.
        if len(self.lines) == self.lines.maxlen:
            self.dropped += 1
        self.lines.append(line)

    def take(self) -> list[str]:
        with self.lock:  # type: ignore[union-attr]
            lines, dropped = list(self.lines), self.dropped
            self.lines.clear()
            self.dropped = 0
        if dropped:
            lines.insert(0, f"({dropped} earlier warnings not shown; all are in the log file)")
        return lines


def _install(*handlers: logging.Handler) -> None:
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_gateway", False):
            root.removeHandler(handler)
            handler.close()
    for handler in handlers:
        handler._gateway = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    # Python warnings (a library's DeprecationWarning, an unclosed socket) print two lines of
    # their own to stderr; through logging each is one record on one line like the rest.
    logging.captureWarnings(True)


def _lean_records() -> None:
    """No thread, process or multiprocessing names in log records: no line shows them, and
    looking them up was a third of what each record cost (the logging HOWTO's
    "Optimization" flags)."""
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False


def setup_logging(level: str = "INFO") -> Redactor:
    _lean_records()
    handler = LineHandler()
    handler.setFormatter(LineFormatter(REDACTOR))
    _install(handler)
    set_log_level(level)
    return REDACTOR


def setup_chat_logging(level: str, path: Path) -> HeldLines:
    """`gateway chat`: the whole log (at `level`) goes to `path`; warnings and errors are
    also shown in the chat, between answers (HeldLines)."""
    _lean_records()
    to_file = QuietFileHandler(path)
    to_file.setFormatter(LineFormatter(REDACTOR))
    held = HeldLines()
    held.setFormatter(LineFormatter(REDACTOR, terse=True))
    _install(to_file, held)
    set_log_level(level)
    return held


def set_log_level(level: str) -> None:
    """The gateway's level; chatty libraries stay at WARNING or above. A reload calls it too."""
    logging.getLogger().setLevel(level)
    # watchfiles says "1 change detected" at INFO for every save of config.json; the
    # reload logs what changed.
    noisy_libraries = ("httpx", "httpcore", "httpx2", "httpcore2", "openai", "telegram", "slack_sdk",
                       "slack_bolt", "discord", "apscheduler", "aiosqlite", "watchfiles")
    for noisy in noisy_libraries:
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLevelName(level)))


def start_banner(config_path: Path | None, data_dir: Path) -> str:
    """The first line `run` and `chat` print: which config file and data dir they use, so
    a newcomer who started in another folder sees it at once."""
    source = f"config {config_path}" if config_path is not None else "no config.json here: defaults"
    return f"{source}; data in {data_dir}"
