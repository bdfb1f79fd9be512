"""Reading a config: JSON, `${ENV}` references expanded in secrets (and nowhere else),
unknown keys refused with their path and a "did you mean"; and the atomic write that
replaces a config file."""

from __future__ import annotations

import difflib
import json
import os
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from pydantic import (
    BaseModel,
    SecretStr,
    ValidationError,
)

from gateway.beneath import write_replacing
from gateway.config.schema import ENV_REF, STORE_SCHEMES, Config, secret_text

_M = TypeVar("_M", bound=BaseModel)

class ConfigError(Exception):
    """A config that cannot be used; `problems` are `key.path: message` lines."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def _expand(text: str, env: Mapping[str, str]) -> tuple[str, list[str]]:
    """`text` with each `${NAME}` replaced, and the names that are not set."""
    missing = [m.group(1) for m in ENV_REF.finditer(text) if m.group(1) not in env]
    return ENV_REF.sub(lambda m: env.get(m.group(1), m.group(0)), text), missing


def _resolve_secrets(model: _M, prefix: str, env: Mapping[str, str], unset: list[tuple[str, str]]) -> _M:
    """Expand `${NAME}` in the secret fields only (SecretStr), defaults included; a secret
    whose variable is unset becomes None and is listed in `unset`. Other strings (prompts,
    URLs, anything an admin can set in chat) are never expanded."""
    updates: dict[str, Any] = {}
    for name in type(model).model_fields:
        value = getattr(model, name)
        path = f"{prefix}{name}"
        if isinstance(value, dict):  # named entries (mcp.servers) or secret values (env, headers)
            entries = {key: _resolved_value(item, f"{path}.{key}", env, unset) for key, item in value.items()}
            if any(entries[key] is not item for key, item in value.items()):
                updates[name] = entries
            continue
        resolved = _resolved_value(value, path, env, unset)
        if resolved is not value:
            updates[name] = resolved
    return model.model_copy(update=updates) if updates else model


def _resolved_value(value: Any, path: str, env: Mapping[str, str], unset: list[tuple[str, str]]) -> Any:
    if isinstance(value, SecretStr):
        text, missing = _expand(value.get_secret_value(), env)
        if missing:
            unset.extend((path, var) for var in missing)
            return None
        return SecretStr(text) if text != value.get_secret_value() else value
    if isinstance(value, BaseModel):
        return _resolve_secrets(value, f"{path}.", env, unset)
    return value


def _known_keys(model: type[BaseModel]) -> list[str]:
    return list(model.model_fields)


def _model_at(path: tuple[Any, ...]) -> type[BaseModel] | None:
    model: type[BaseModel] = Config
    named = False  # the next part is an entry's name (mcp.servers.<name>), not a field
    for part in path:
        if named:
            named = False
            continue
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        ann = field.annotation
        candidates = getattr(ann, "__args__", (ann,))
        nxt = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if nxt is None:
            return None
        named = typing.get_origin(ann) is dict
        model = nxt
    return model


def _format_errors(err: ValidationError) -> list[str]:
    problems = []
    for e in err.errors():
        loc = tuple(e["loc"])
        key = ".".join(str(p) for p in loc) or "(root)"
        if e["type"] == "extra_forbidden":
            parent = _model_at(loc[:-1])
            hint = ""
            if parent is not None:
                close = difflib.get_close_matches(str(loc[-1]), _known_keys(parent), n=1)
                if close:
                    hint = f" (did you mean {'.'.join([*map(str, loc[:-1]), close[0]])!r}?)"
            problems.append(f"{key}: unknown key{hint}")
        elif e["type"] == "tuple_type":
            # The schema's tuples are JSON arrays in the file: say so, not "a valid tuple".
            example = LIST_EXAMPLES.get(key, '["a", "b"]')
            problems.append(f"{key}: should be a list (a JSON array), e.g. {example}")
        else:
            msg = e["msg"].removeprefix("Value error, ").replace("Input should be", "should be")
            problems.append(f"{key}: {msg}")
    return problems


LIST_EXAMPLES = {"admins": '["telegram:123456789", "slack:U0123ABCD"]',
                 "access.allow_from": '["telegram:123456789", "telegram:-1001234567890"]'}


def json_problem(text: str, err: json.JSONDecodeError) -> str:
    """Where a JSON error really is. The decoder notices a missing comma only at the next
    value, which is often on the next line: name the line the comma belongs after."""
    before = text[: err.pos].rstrip()
    prev_line = before.count("\n") + 1
    last = before.splitlines()[-1].strip() if before else ""
    if err.msg == "Expecting ',' delimiter" and before and prev_line < err.lineno and text[err.pos] not in "}]":
        return f"invalid JSON: missing comma after line {prev_line} ({last[-60:]})"
    at = text[err.pos: err.pos + 1]
    if err.msg == "Expecting ',' delimiter" and at in ("}", "]"):
        return (f"invalid JSON at line {err.lineno} column {err.colno}: {at!r} closes the wrong bracket "
                "(a ']' or '}' missing before it?)")
    if before.endswith(",") and at in ("}", "]") and err.msg.startswith("Expecting"):
        return (f"invalid JSON: a trailing comma at the end of line {prev_line} ({last[-60:]}); "
                f"JSON allows no comma before {at!r}")
    if err.msg == "Expecting ',' delimiter":
        return f"invalid JSON at line {err.lineno} column {err.colno}: missing comma"
    return f"invalid JSON at line {err.lineno} column {err.colno}: {err.msg}"


def parse_config(raw: dict[str, Any], environ: dict[str, str] | None = None) -> Config:
    if not isinstance(raw, dict):
        raise ConfigError(["(root): the config must be a JSON object"])
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_errors(err)) from None
    problems = cfg.reference_problems()
    if problems:
        raise ConfigError(problems)
    unset: list[tuple[str, str]] = []
    cfg = _resolve_secrets(cfg, "", os.environ if environ is None else environ, unset)
    url = secret_text(cfg.store.url)
    if url is not None and not url.strip().startswith(STORE_SCHEMES):  # its value is a secret: not shown
        raise ConfigError(["store.url: the environment variable it names must hold a sqlite:/// or "
                           "postgresql:// URL"])
    cfg._unset_env = tuple(unset)
    return cfg


def parse_config_text(text: str, environ: dict[str, str] | None = None) -> Config:
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError([f"(file): {json_problem(text, err)}"]) from None
    return parse_config(raw, environ)


def load_config(path: Path, environ: dict[str, str] | None = None) -> Config:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([f"(file): {path} does not exist"]) from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError([f"(file): cannot read {path}: {err}"]) from None
    return parse_config_text(text, environ)


def atomic_write_text(path: Path, text: str) -> None:
    """Write via temp file + fsync + rename, so readers see the old or the new file whole.

    A file that exists keeps its mode (and owner and group, where this user may set them:
    an operator's 0640 config.json stays readable by its group); a new file is 0600. For
    the operator's own files (config.json beside it); a workspace's go through
    gateway.beneath, which follows no link."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        before: os.stat_result | None = os.stat(path)
    except FileNotFoundError:
        before = None
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        write_replacing(dir_fd, path.name, text.encode("utf-8"), like=before)
    finally:
        os.close(dir_fd)
