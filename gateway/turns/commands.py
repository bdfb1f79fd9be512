"""In-chat commands (SPEC §6), handled without calling the model.

Commands that change a session (/context clear, /new, /compact) run in that session's
queue, so they never interleave with a turn. /stop is answered at once: it is for the turn
that queue waits on. An unknown `/word` is answered with the list, never sent to the model."""

from __future__ import annotations

import asyncio
import difflib
import json
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any

from context.engine import compact, context_stats
from context.stats import format_context_stats
from gateway.access import Pairing, is_admin
from gateway.agents import agent_of_scope, agent_view, bound_agent, model_chain
from gateway.config.changes import (
    change_effect,
    is_credential_destination,
    is_host_folder,
    is_operator_only,
    is_secret_key,
)
from gateway.config.chat import ChatSettings, set_dotted
from gateway.config.cron import zone
from gateway.config.load import ConfigError, atomic_write_text, parse_config
from gateway.config.schema import Config, ModelConfig
from gateway.hub import Replies
from gateway.keys import is_shared
from gateway.services import Services
from gateway.store.rows import slot_words
from gateway.tasks.schedule import TaskError
from gateway.turns.live import LiveSession
from gateway.turns.sessions import CommandJob, SessionManager, keep_command_answer
from gateway.types import Inbound

log = logging.getLogger("gateway.commands")

HELP = """Commands:
/stop: stop the answer being written now; what was shown stays, marked [stopped]
/context: what the live context holds (messages, tokens vs budget, turns, last trim)
/context clear (or /new, /reset): start a fresh context; everything stays stored and searchable
/compact: summarize the conversation now, keeping the last 2 turns
/config: budgets, limits, time zone, the model here (admins: all); /config KEY shows one, KEY VALUE sets it (admins)
/tools: the tools I can use here, and the state of each MCP server
/skills: the skills I can use here
/tasks: this chat's scheduled tasks; /tasks cancel ID cancels one
/model: the model answering here and the ones you may pick; /model NAME picks one, /model default goes back
/agent: the agent that answers here, its model and skills
/usage: your tokens and messages today and this month, and what your daily budget leaves
/allow ID, /deny ID: answer an approval the assistant asked for (approvers)
/approve CODE: approve a pairing code (admins)
/revoke ID: take a person's approval back, e.g. /revoke telegram:7 (admins)
/help: this list"""

WELCOME = ("Hi! I'm an assistant: write to me as you would to a person, and send files, pictures or voice "
           "notes when they help. I remember our conversation; /new starts a fresh one, and /stop stops an "
           "answer while I write it.\n\n")

BOT_COMMANDS: list[tuple[str, str]] = [
    ("stop", "Stop the answer being written now"),
    ("context", "Show what the live context holds; /context clear to reset"),
    ("new", "Start a fresh context"),
    ("compact", "Summarize now, keeping the last 2 turns"),
    ("config", "Show or change settings"),
    ("tools", "List the tools and MCP servers"),
    ("skills", "List the skills I can use"),
    ("tasks", "List scheduled tasks; /tasks cancel ID"),
    ("model", "Show or pick the model for this chat"),
    ("agent", "Which agent answers here"),
    ("usage", "Your usage today and this month"),
    ("help", "List commands"),
]

OnConfigChange = Callable[[], Awaitable[None]]
StartupCheck = Callable[[Config], list[str]]

EFFECT_NOTE = {
    "live": "saved; applies from the next step",
    "channel": "saved; the channel restarts with it",
    "restart": "saved; applies after the gateway restarts",
}


KNOWN = frozenset({"context", "new", "reset", "compact", "config", "help", "approve", "start", "tools", "tasks",
                   "model", "agent", "usage", "skills", "allow", "deny", "stop", "revoke"})
# A command is `/word` at the start of a message: a word of ASCII letters, digits and _
# (Telegram's own rule), maybe with Telegram's `@botname`, then whitespace or the end. So
# "/usr/bin is where…" or "/día" is text for the model, "/tmp is full" an unknown command.
COMMAND = re.compile(r"/([A-Za-z0-9_]+)(?:@[A-Za-z0-9_]+)?(?=\s|$)")
SHOWN_NAME_MAX = 64  # an unknown command's name, as the answer repeats it


def parse_command(text: str) -> tuple[str, list[str]] | None:
    """(name, arguments) of a command, known or not; None for ordinary text."""
    stripped = text.strip()
    found = COMMAND.match(stripped)
    if found is None:
        return None
    name, rest = found[1].lower(), stripped[found.end():]
    return name, rest.split(maxsplit=1) if name == "config" else rest.split()


def unknown_command(name: str) -> str:
    shown = name if len(name) <= SHOWN_NAME_MAX else name[:SHOWN_NAME_MAX - 1] + "…"
    return f"`/{shown}`: unknown command.\n\n{HELP}"


STOP_ANSWERS = {
    "stopped": "Stopped.",
    "idle": "Nothing to stop: no answer is being written here.",
    "pending": "Stopping: the answer ends as soon as its last update is delivered.",
    "unreached": "The gateway writing this answer did not take the stop in time; send /stop again.",
}


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict) and (data or not prefix):  # an empty section (mcp.servers) is a setting too
        out: dict[str, Any] = {}
        for k, v in data.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: data}


def masked_settings(services: Services) -> dict[str, Any]:
    flat = flatten(services.cfg.model_dump(mode="json"))
    return {k: ("***" if is_secret_key(k) and v else v) for k, v in flat.items()}


# What everyone may read with /config: the budgets and limits that shape their answers, the
# time zone their tasks and daily notes follow, and the model answering them (SESSION_KEYS).
# The rest (admins, addresses, the system prompt, channels) is for admins.
EVERYONE_KEYS = frozenset({"agent_max_context_tokens", "agent_max_context_turns", "agent_max_steps",
                           "tool_result_max_chars", "history_tool_result_max_chars", "session_retention_days",
                           "memory_max_tokens", "timezone"})
EVERYONE_SECTIONS = ("limits.", "tasks.")
# Shown to people as the session's own model (its /model pick or its agent's), not `model`.
SESSION_KEYS = ("model.name", "model.vision")


def shown_to_everyone(key: str) -> bool:
    return key in EVERYONE_KEYS or key in SESSION_KEYS or key.startswith(EVERYONE_SECTIONS)


def suggest_key(key: str, known: list[str]) -> str | None:
    """The setting a mistyped KEY most likely meant: a close spelling, or the one key whose
    last part it is (`port` → `http.port`)."""
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
    if close:
        return close[0]
    tails = [k for k in known if k.rsplit(".", 1)[-1] == key]
    if len(tails) == 1:
        return tails[0]
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    return close[0] if close else None


def parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def chat_refusal(key: str, value: Any) -> str | None:
    """Why `/config KEY VALUE` may not set this from chat: secrets, and the addresses
    secrets are sent to, are the operator's (config.json and the environment). Values set
    here are stored as typed: a `${NAME}` in them is never expanded."""
    for path in flatten(value, f"{key}.") if isinstance(value, dict) else [key]:
        if is_secret_key(path):
            return f"{path} is a secret: it can only be changed in config.json or the environment, not in chat."
        if is_credential_destination(path):
            return (f"{path} decides where credentials are sent: it can only be changed in config.json, "
                    "not in chat.")
        if is_host_folder(path):
            return (f"{path} names folders of this machine the agent may read; change it in config.json, "
                    "not in chat.")
        if is_operator_only(path):
            if path.startswith("tools.exec"):
                return (f"{path}: running commands on this machine is the operator's decision; change it in "
                        "config.json, not in chat.")
            if path.startswith("approvals"):
                return (f"{path}: which tools wait for a person's yes, and who gives it, is the operator's "
                        "decision; change it in config.json, not in chat.")
            return (f"{path}: MCP servers are programs the gateway runs and addresses it sends credentials "
                    "to; add or change them in config.json, not in chat.")
    return None


class Commands:
    def __init__(self, services: Services, sessions: SessionManager, pairing: Pairing, *,
                 replies: Replies, on_config_change: OnConfigChange | None = None,
                 check: StartupCheck | None = None, settings: ChatSettings | None = None) -> None:
        self.s = services
        self.sessions = sessions
        self.pairing = pairing
        self.reply = replies.deliver  # the answers go where the command came from
        self.on_config_change = on_config_change
        self.check = check
        # Changes made in chat, kept in the database (shared with other gateways: SPEC §10).
        self.settings = settings
        self._config_lock = settings.lock if settings is not None else asyncio.Lock()

    async def handle(self, inbound: Inbound, key: str, scope: str) -> bool:
        """True when `inbound` was a command (answered or queued)."""
        parsed = parse_command(inbound.text)
        if parsed is None:
            return False
        name, args = parsed
        if name == "stop":
            # Answered at once, never queued: it is meant for the turn the queue waits on.
            outcome = await self.sessions.stop_turn(key, inbound.identity, inbound)
            await self._answer(inbound, key, STOP_ANSWERS[outcome])
        elif name not in KNOWN:
            await self._answer(inbound, key, unknown_command(name))
        elif name == "help":
            await self._answer(inbound, key, HELP)
        elif name == "start":
            await self._answer(inbound, key, WELCOME + HELP)
        elif name == "config":
            await self._answer(inbound, key, await self.config(inbound, args, session=key, scope=scope))
        elif name == "approve":
            await self._answer(inbound, key, await self.approve(inbound, args))
        elif name == "revoke":
            await self._answer(inbound, key, await self.revoke(inbound, args))
        elif name == "tools":
            await self._answer(inbound, key, self.tools(details=is_admin(self.s.cfg, inbound.identity)))
        elif name == "skills":
            await self._answer(inbound, key, self.skills(inbound))
        elif name == "tasks":
            await self._answer(inbound, key, await self.tasks(inbound, scope, args))
        elif name in ("new", "reset") or (name == "context" and args[:1] == ["clear"]):
            await self._queue(inbound, key, scope, self._clear, fresh_context=True)
        elif name == "context":
            identity = inbound.identity

            async def stats(live: LiveSession) -> str:
                return await self._stats(live, identity)

            await self._queue(inbound, key, scope, stats)
        elif name == "compact":
            await self._queue(inbound, key, scope, self._compact)
        elif name == "model":
            async def model(live: LiveSession) -> str:
                return await self._model(live, inbound, args)

            await self._queue(inbound, key, scope, model)
        elif name == "agent":
            await self._queue(inbound, key, scope, self._agent)
        elif name == "usage":
            await self._answer(inbound, key, await self.usage(inbound))
        elif name in ("allow", "deny"):
            await self._answer(inbound, key, await self.answer_approval(inbound, args, allow=name == "allow"))
        return True

    async def _answer(self, inbound: Inbound, key: str, text: str) -> None:
        await keep_command_answer(self.s, key, inbound, text)
        await self.reply(inbound, text)
        await self.s.store.mark_event(inbound.channel, inbound.event_id, "answered")

    async def _queue(self, inbound: Inbound, key: str, scope: str,
                     run: Callable[[LiveSession], Awaitable[str]], *, fresh_context: bool = False) -> None:
        if not await self.sessions.submit(key, scope, CommandJob(inbound, run, fresh_context=fresh_context)):
            await self._answer(inbound, key, "I'm still working on your earlier messages; try again in a moment.")

    # -- session commands (run inside the session queue) ----------------------------------

    async def _stats(self, live: LiveSession, identity: str) -> str:
        cfg = self.s.cfg
        admin = is_admin(cfg, identity)
        system = await self.sessions.agent.system_prompt(live, cfg)
        plan = self.sessions.agent.step(live, cfg)
        stats = context_stats(live.ctx, system_prompt=system, tools=self.sessions.agent.tool_schemas(plan.view),
                              budget=cfg.context_budget(plan.model), counter=self.s.counter_for(plan.model.name))
        # Strategy names, the token calibration and the job runs are the operator's view.
        text = format_context_stats(stats, details=admin)
        answered = f" (the last answer came from {live.last_model})" if live.last_model else ""
        text += f"\nAgent: {live.agent}; model: {plan.model.name}{answered}"
        if live.sub_turns:  # delegated work (SPEC §5.8): stored apart, counted with the turn that asked
            tokens = sum(sub.tokens for sub in live.sub_turns)
            text += f"\nSub-turns: {len(live.sub_turns)} since the session loaded, {tokens:,} tokens"
            for sub in live.sub_turns[-3:]:
                task = " ".join(sub.task.split())
                task = task if len(task) <= 60 else task[:59] + "…"
                text += f"\n- {sub.agent}: {task!r}, {sub.steps} steps, {sub.tokens:,} tokens ({sub.outcome})"
        runs = await self.s.store.job_runs(limit=3) if admin else []
        if runs:
            text += "\nLast jobs: " + ", ".join(f"{r.job} {slot_words(r.slot)}: {r.outcome}" for r in runs)
        if self.s.usage is not None:
            text += "\n" + await self.s.usage.describe(cfg, identity)
        return text

    async def _model(self, live: LiveSession, inbound: Inbound, args: list[str]) -> str:
        """/model: show the session's model, or pick one of the agent's aliases (SPEC §5.5)."""
        cfg = self.s.cfg
        view = agent_view(cfg, live.agent)
        chain = model_chain(cfg, view, live.model_alias)
        alias, settings = chain[0]
        if not args:
            using = f"{alias} ({settings.name})" if alias else settings.name
            picked = " (picked for this chat)" if live.model_alias is not None and alias == live.model_alias else ""
            lines = [f"Model here: {using}{picked}."]
            if live.last_model and live.last_model != settings.name:
                lines.append(f"The last answer came from {live.last_model} (a fallback).")
            if view.choosable:
                lines.append("You may pick: " + ", ".join(view.choosable) + ". Send /model NAME, or /model default.")
            else:
                lines.append("There are no other models to pick (models in config.json).")
            return "\n".join(lines)
        wanted = args[0]
        if is_shared(inbound, cfg.group_session_scope) and not is_admin(cfg, inbound.identity):
            return "Everyone here shares this conversation, so only admins can change its model."
        if wanted.lower() == "default":
            live.model_alias = None
            await self.s.store.set_session_model(live.key, None)
            own = model_chain(cfg, view, None)[0]
            return f"Back to this agent's model: {own[1].name}."
        if wanted not in cfg.models or wanted not in view.choosable:
            choices = ", ".join(view.choosable) or "none"
            return f"There is no model {wanted!r} to pick here. You may pick: {choices}."
        live.model_alias = wanted
        await self.s.store.set_session_model(live.key, wanted)
        return f"This chat now uses {wanted} ({cfg.model_for(wanted).name}) from the next message."

    async def _agent(self, live: LiveSession) -> str:
        """/agent: who answers here, with which model and skills."""
        cfg = self.s.cfg
        view = agent_view(cfg, live.agent)
        alias, settings = model_chain(cfg, view, live.model_alias)[0]
        model = f"{alias} ({settings.name})" if alias else settings.name
        skills = view.skill_names()
        skill_text = "all skills" if skills is None else (", ".join(skills) or "none")
        tools = "every tool" if view.settings.tools is None else ", ".join(view.settings.tools)
        return (f"Agent here: {view.name}. Model: {model}. Skills: {skill_text}. Tools: {tools}."
                + (" Fallbacks: " + ", ".join(view.fallbacks) + "." if view.fallbacks else ""))

    async def answer_approval(self, inbound: Inbound, args: list[str], *, allow: bool) -> str:
        """/allow ID, /deny ID (SPEC §5.7): the same path as a card's buttons."""
        if self.s.approvals is None:
            return "Approvals are not available here."
        if not args:
            return f"Send /{'allow' if allow else 'deny'} ID with the id the approval card shows."
        return str(await self.s.approvals.decide(args[0], inbound, allow))

    async def usage(self, inbound: Inbound) -> str:
        """/usage: this person's use today and this month, and what the daily budget leaves."""
        if self.s.usage is None:
            return "Usage is not recorded here."
        return await self.s.usage.report(self.s.cfg, inbound.identity)

    async def _clear(self, live: LiveSession) -> str:
        turn = max(await self.s.store.last_turn(live.key), live.ctx.current_turn)
        live.ctx.clear()
        live.context_start = turn + 1
        await self.s.store.set_context_start(live.key, turn + 1)
        return "Started a fresh context. Earlier messages stay stored and can be found with memory search."

    async def _compact(self, live: LiveSession) -> str:
        before = live.ctx.turn_count
        effect = compact(live.ctx, keep_turns=2,
                         counter=self.s.counter_for(self.sessions.agent.step(live, self.s.cfg).model.name))
        dropped = before - live.ctx.turn_count
        if dropped <= 0:
            return "Nothing to compact yet: the context holds 2 turns or fewer."
        # No effect means a summary prepared ahead (the prefetch) covers the dropped turns
        # already: it is injected from the next turn on like a fresh one.
        if effect is not None:
            self.sessions.agent.summarizer.submit(live, effect)
        what = "are being summarized" if effect is not None else "are covered by the summary already made"
        return (f"Compacted: {dropped} earlier turn{'s' if dropped != 1 else ''} left the live context and {what}; "
                "the last 2 turns stay as they are.")

    # -- /config and /approve ---------------------------------------------------------------

    async def _model_here(self, key: str, scope: str) -> ModelConfig:
        """The model answering in this session: its /model pick, else its agent's."""
        cfg = self.s.cfg
        live = self.sessions.live.get(key)
        if live is not None:
            agent, alias = live.agent, live.model_alias
        else:
            row = await self.s.store.get_session(key)
            agent, alias = agent_of_scope(scope), row.model if row is not None else None
        return model_chain(cfg, agent_view(cfg, agent), alias)[0][1]

    async def config(self, inbound: Inbound, args: list[str], *, session: str = "", scope: str = "") -> str:
        settings = masked_settings(self.s)
        admin = is_admin(self.s.cfg, inbound.identity)
        visible = settings if admin else {k: v for k, v in settings.items() if shown_to_everyone(k)}
        model = await self._model_here(session, scope) if session else self.s.cfg.model
        here = {"model.name": model.name, "model.vision": model.sees_images()}
        if not admin:
            visible.update(here)
        if not args:
            title = "Settings (secrets shown as ***)" if admin else "Budgets and limits (admins see every setting)"
            zone_name = self.s.cfg.timezone or f"{zone(None)}, the machine's"
            vision = "images go to it" if here["model.vision"] else "it sees no images"
            return (f"{title}:\n" + _settings_block(visible)
                    + f"\nHere: model {model.name} ({vision}); time zone {zone_name}.")
        key = args[0]
        if len(args) > 1 and is_operator_only(key):  # also for servers that do not exist yet
            return chat_refusal(key, parse_value(args[1])) or ""
        if key not in settings:
            section = {k: v for k, v in visible.items() if k.startswith(f"{key}.")}
            if section and len(args) == 1:
                return _settings_block(section)
            hint = suggest_key(key, list(settings))
            did_you_mean = f" Did you mean {hint}?" if hint else ""
            return f"There is no setting {key!r}.{did_you_mean} Send /config to list them."
        if key not in visible:
            return f"{key} is shown to admins only."
        if len(args) == 1:
            return f"{key} = {json.dumps(visible[key], ensure_ascii=False)}"
        if not admin:
            return f"Only admins can change settings (you are {inbound.identity}; see the `admins` setting)."
        value = parse_value(args[1])
        refusal = chat_refusal(key, value)
        if refusal is not None:
            return refusal
        return await self._write_setting(key, value, by=inbound.identity)

    async def _write_setting(self, key: str, value: Any, *, by: str) -> str:
        holder = self.s.config
        if holder.path is None:
            return "This gateway runs without a config file, so settings cannot be changed here."
        async with self._config_lock:
            try:
                raw_text = await asyncio.to_thread(holder.path.read_text, encoding="utf-8")
                raw = json.loads(raw_text)
            except (OSError, ValueError) as err:
                return f"Cannot read {holder.path.name}: {err}"
            set_dotted(raw, key, value)
            try:
                if self.settings is not None:
                    # With other gateways: their chat changes stay on top of this file.
                    new_cfg = self.settings.stage(raw, key, value)
                else:
                    new_cfg = parse_config(raw)
                    problems = self.check(new_cfg) if self.check is not None else []
                    if problems:
                        raise ConfigError(problems)
            except ConfigError as err:
                return "Not changed: " + "; ".join(err.problems)
            if self.settings is not None and self.settings.shared:
                try:
                    await self.settings.record(key, value, by=by, file=raw)
                except Exception as err:  # the other gateways would not get it: change nothing
                    log.warning("setting not changed: the database did not take it",
                                extra={"key": key, "error": str(err)[:200]})
                    return f"Not changed: the database did not take it ({type(err).__name__}); try again."
            try:
                await asyncio.to_thread(atomic_write_text, holder.path,
                                        json.dumps(raw, indent=2, ensure_ascii=False) + "\n")
            except OSError as err:
                if self.settings is None or not self.settings.shared:
                    return f"Not changed: cannot write {holder.path.name}: {err.strerror or err}"
                # The database has it (every gateway applies it from there); a read-only
                # config file, as in the compose cluster profile, only misses the copy.
                log.warning("setting kept in the database only: the config file is not writable",
                            extra={"key": key, "error": str(err)[:200]})
            if self.settings is not None and not self.settings.shared:
                await self.settings.record(key, value, by=by, file=raw)  # the history, best effort
            holder.swap(new_cfg)
            log.info("setting changed in chat", extra={"key": key})
        if self.on_config_change is not None:
            await self.on_config_change()
        shown = masked_settings(self.s).get(key)
        return f"{key} = {json.dumps(shown, ensure_ascii=False)} ({EFFECT_NOTE[change_effect(key)]})"

    def tools(self, *, details: bool = False) -> str:
        """/tools: every tool a turn here may call, and each MCP server's state; why a
        server failed (its error, its last stderr line) only with `details` (admins)."""
        registry = self.s.tools
        mcp = self.s.mcp
        by_server: dict[str, list[str]] = {}
        builtin: list[str] = []
        for name in registry.names:
            server = getattr(registry.get(name), "server", None)
            if mcp is not None and server is not None:
                by_server.setdefault(server, []).append(name)
            else:
                builtin.append(name)
        lines = [f"Tools ({len(registry.names)}):", "built-in: " + ", ".join(builtin)]
        for source in registry.sources:  # a source that offers less than it could says why (exec)
            detail = getattr(source, "detail", None) if getattr(source, "statuses", None) is None else None
            if isinstance(detail, str):
                lines.append(f"{source.name}: {detail}")
        statuses = mcp.statuses() if mcp is not None else []
        if not statuses:
            lines.append("MCP servers: none configured (mcp.servers in config.json)")
            return "\n".join(lines)
        lines.append("MCP servers:")
        for status in statuses:
            lines.append(f"- {status.name}: {status.describe(details=details)}")
            if by_server.get(status.name):
                lines.append("  " + ", ".join(by_server[status.name]))
        return "\n".join(lines)

    def skills(self, inbound: Inbound) -> str:
        """/skills: the skills this agent may use, name and description (SPEC §5.6)."""
        cfg = self.s.cfg
        skills = self.sessions.agent.usable_skills(cfg, bound_agent(cfg, inbound))
        if not skills:
            where = (f"skills.dirs: {', '.join(cfg.skills.dirs) or 'none'}, relative to the config file"
                     if is_admin(cfg, inbound.identity) else "skills.dirs in config.json")
            return ("No skills here. A skill is a folder holding a SKILL.md (YAML front matter with name and "
                    f"description, then the instructions), placed in one of the skills folders ({where}).")
        lines = [f"Skills ({len(skills)}); I read one's instructions when a task calls for it:"]
        lines += [f"- {skill.name}: {skill.description}" for skill in skills]
        return "\n".join(lines)

    async def tasks(self, inbound: Inbound, scope: str, args: list[str]) -> str:
        """/tasks: the scope's scheduled tasks; /tasks cancel ID; /tasks all (admins)."""
        tasks = self.s.tasks
        if tasks is None:
            return "Scheduled tasks are not available here."
        cfg = self.s.cfg
        sub = args[0].lower() if args else ""
        if sub == "cancel":
            if len(args) < 2:
                return "Usage: /tasks cancel ID (the ids are in /tasks)"
            try:
                task = await tasks.cancel(args[1], scope=scope, identity=inbound.identity, cfg=cfg)
            except TaskError as err:
                return f"Not cancelled: {err}."
            return f"Cancelled task {task.id} ({task.preview()})."
        if sub not in ("", "all"):
            return "Usage: /tasks lists this chat's scheduled tasks; /tasks cancel ID cancels one."
        everything = sub == "all"
        if everything and not is_admin(cfg, inbound.identity):
            return "Only admins can list every chat's tasks."
        found = await tasks.visible(scope, everything=everything)
        if not found:
            return ("No scheduled tasks." if everything else
                    "No scheduled tasks in this chat. Ask me to schedule one, e.g. \"remind me in 20 minutes "
                    "to stretch\".")
        where = "in every chat" if everything else "in this chat"
        return "\n".join([f"Scheduled tasks {where} ({len(found)}, next runs in local time):",
                          *tasks.describe(found, cfg, with_scope=everything),
                          "Cancel one with /tasks cancel ID."])

    async def approve(self, inbound: Inbound, args: list[str]) -> str:
        """/approve CODE: the same path as the admin page's Approve and the CLI's."""
        if not is_admin(self.s.cfg, inbound.identity):
            return "Only admins can approve pairing codes."
        if not args:
            return "Usage: /approve CODE"
        return (await self.pairing.approve_code(args[0], by=inbound.identity)).text

    async def revoke(self, inbound: Inbound, args: list[str]) -> str:
        """/revoke ID (e.g. telegram:7): the person is a stranger again from their next message."""
        if not is_admin(self.s.cfg, inbound.identity):
            return "Only admins can revoke an approval."
        if not args:
            approved = [p.identity for p in await self.pairing.approved(limit=20)]
            listed = ", ".join(approved) if approved else "nobody yet"
            return f"Usage: /revoke ID, e.g. /revoke telegram:7. Approved by pairing: {listed}."
        return (await self.pairing.revoke(args[0], by=inbound.identity, cfg=self.s.cfg)).text


def _settings_block(settings: dict[str, Any]) -> str:
    lines = [f"{k} = {json.dumps(v, ensure_ascii=False)}" for k, v in sorted(settings.items())]
    return "```\n" + "\n".join(lines) + "\n```"
