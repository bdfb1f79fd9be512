"""Agents and bindings (SPEC §5.5): which agent answers a message, what that agent is
(prompt, model, fallbacks, tools, skills, the models its people may pick), and the
memory scope it keeps for a session.

The binding is a pure function of the running config and the message, so a session keeps
its agent across restarts and a change of `bindings` applies from the next turn. In a
shared session (a group in `group` mode, a topic, a thread) a binding that names a `user`
never matches: the session belongs to its chat, and whoever writes first must not decide
the agent for everyone in it.
"""

from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass
from pathlib import Path

from gateway.config.holder import ConfigHolder
from gateway.config.schema import AgentConfig, Binding, Config, ModelConfig
from gateway.keys import is_shared, memory_scope, session_key, workspace_dir
from gateway.types import Inbound

log = logging.getLogger("gateway.agents")

DEFAULT = "default"
PROMPT_FILE_MAX_BYTES = 200_000  # a system prompt file larger than this is surely a mistake


def binding_matches(binding: Binding, inbound: Inbound, *, shared: bool) -> bool:
    match = binding.match
    if match.user is not None and shared:
        return False
    wanted = ((match.channel, inbound.channel), (match.chat, inbound.chat_id),
              (match.thread, inbound.thread_id), (match.user, inbound.user_id))
    return all(want is None or want == str(have) for want, have in wanted)


def bound_agent(cfg: Config, inbound: Inbound) -> str:
    """The agent of the first binding whose given fields all match `inbound`; `default`."""
    if not cfg.bindings:
        return DEFAULT
    shared = is_shared(inbound, cfg.group_session_scope)
    for binding in cfg.bindings:
        if binding_matches(binding, inbound, shared=shared):
            return binding.agent
    return DEFAULT


def agent_scope(agent: str, scope: str) -> str:
    """The memory scope `agent` keeps for a session whose scope is `scope`: agents never
    read each other's MEMORY.md, notes, files or tasks."""
    return scope if agent == DEFAULT else f"{agent}/{scope}"


class Places:
    """Where a message belongs under the running config: its session key, and the memory
    scope the agent bound to it keeps (SPEC §1, §5.5). The router places every message it
    takes with it, the sessions of a shared database place the events they take over, and
    channels put a person's files in the workspace it names."""

    def __init__(self, config: ConfigHolder) -> None:
        self._config = config

    def keys(self, inbound: Inbound) -> tuple[str, str]:
        """(session key, memory scope): the scope is the bound agent's."""
        cfg = self._config.current
        scope_mode = cfg.group_session_scope
        scope = agent_scope(bound_agent(cfg, inbound), memory_scope(inbound, scope_mode))
        return session_key(inbound, scope_mode), scope

    def workspace_for(self, inbound: Inbound) -> Path:
        """The workspace of the message's scope. No mkdir here (it runs on the loop): the
        channel makes it off the loop."""
        return workspace_dir(self._config.data_dir, self.keys(inbound)[1])


def agent_of_scope(scope: str) -> str:
    """The agent a stored scope belongs to (scopes of channels never hold a '/')."""
    head, sep, _ = scope.partition("/")
    return head if sep else DEFAULT


@dataclass(frozen=True, slots=True)
class AgentView:
    """One agent as the running config defines it, the top level filled in."""

    name: str
    settings: AgentConfig
    model_alias: str | None  # None: `model`
    fallbacks: tuple[str, ...]
    choosable: tuple[str, ...]  # aliases its people may pick with /model
    # The agents it may hand work to with `delegate` (itself among them), by name.
    delegates_to: tuple[str, ...] = ()

    def tool_allowed(self, tool: str) -> bool:
        patterns = self.settings.tools
        return patterns is None or any(fnmatch.fnmatchcase(tool, p) for p in patterns)

    def skill_names(self) -> tuple[str, ...] | None:
        """The skills it may use; None for every skill."""
        skills = self.settings.skills
        return None if skills == "*" else tuple(skills)


def delegate_targets(cfg: Config, name: str, settings: AgentConfig) -> tuple[str, ...]:
    """The agents `name` may hand work to (SPEC §5.12): itself always; the others its
    `delegates` names (`*` patterns allowed). Unset: none but itself — except the top-level
    agent `default`, which has every tool and no `delegates` key, and may reach them all
    (a sub-turn never has a tool its parent lacks, so no agent gains one by delegating)."""
    everyone = (DEFAULT, *sorted(a for a in cfg.agents if a != DEFAULT))
    patterns = settings.delegates
    if patterns is None:
        return everyone if name == DEFAULT and name not in cfg.agents else (name,)
    return tuple(a for a in everyone if a == name or any(fnmatch.fnmatchcase(a, p) for p in patterns))


def agent_view(cfg: Config, name: str) -> AgentView:
    settings = cfg.agent(name) if name in cfg.agents else AgentConfig()
    fallbacks = settings.fallbacks if settings.fallbacks is not None else cfg.model.fallbacks
    choosable = settings.models if settings.models is not None else tuple(sorted(cfg.models))
    return AgentView(name=name, settings=settings, model_alias=settings.model, fallbacks=tuple(fallbacks),
                     choosable=tuple(choosable), delegates_to=delegate_targets(cfg, name, settings))


def model_chain(cfg: Config, view: AgentView, chosen: str | None) -> list[tuple[str | None, ModelConfig]]:
    """The models a decision step tries, in order: the session's choice (or the agent's
    model), then its fallbacks, each once. An alias no longer defined is skipped."""
    first = chosen if chosen is not None and chosen in cfg.models else view.model_alias
    chain: list[tuple[str | None, ModelConfig]] = []
    seen: set[str | None] = set()
    for alias in (first, *view.fallbacks):
        if alias in seen or (alias is not None and alias not in cfg.models):
            continue
        seen.add(alias)
        chain.append((alias, cfg.model_for(alias)))
    return chain


class PromptFiles:
    """`agents.<name>.system_prompt_file`, read when it changes (by size and mtime), so a
    prompt edited on disk applies from the next step and an unchanged one costs a stat."""

    def __init__(self, base_dir: Path) -> None:
        self.base_dir = base_dir
        self._cache: dict[Path, tuple[tuple[int, int], str]] = {}

    def path(self, name: str) -> Path:
        path = Path(name)
        return path if path.is_absolute() else self.base_dir / path

    def read(self, name: str) -> str:
        """The file's text (blocking: call it off the loop); OSError when unreadable."""
        path = self.path(name)
        stat = path.stat()
        stamp = (stat.st_size, stat.st_mtime_ns)
        cached = self._cache.get(path)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        if stat.st_size > PROMPT_FILE_MAX_BYTES:
            raise OSError(f"{path} is {stat.st_size:,} bytes, over {PROMPT_FILE_MAX_BYTES:,}")
        text = path.read_text(encoding="utf-8", errors="replace")
        self._cache[path] = (stamp, text)
        return text


def system_prompt_text(cfg: Config, view: AgentView, files: PromptFiles) -> str:
    """The agent's own instructions (blocking when they live in a file). A file that
    cannot be read falls back to the top level's prompt, with a warning."""
    settings = view.settings
    if settings.system_prompt is not None:
        return settings.system_prompt
    if settings.system_prompt_file is not None:
        try:
            return files.read(settings.system_prompt_file)
        except OSError as err:
            log.warning("agent prompt file unreadable; using the top-level system_prompt",
                        extra={"agent": view.name, "error": str(err)[:200]})
    return cfg.system_prompt
