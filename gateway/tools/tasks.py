"""`schedule_task`, `list_tasks`, `cancel_task` (SPEC §5.3): tasks people schedule in chat.

The tools only talk to the running `TaskScheduler` (gateway/jobs/tasks.py); a task belongs to
the scope of the session it was made in, so a session sees and cancels its scope's tasks
only (admins: any). Built-in tools: without a running scheduler they say so."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Protocol

from gateway.access import is_admin
from gateway.config.cron import zone
from gateway.config.schema import Config
from gateway.tasks.schedule import TaskError, format_time
from gateway.tasks.store import Task
from gateway.tools.base import ToolArgumentError, ToolContext, ToolError, ToolOutput, check_arguments
from gateway.types import Inbound


class TaskBook(Protocol):
    """What the tools ask of the running scheduler (gateway/jobs/tasks.py's TaskScheduler)."""

    async def create(self, *, scope: str, session_key: str, inbound: Inbound, prompt: str, at: str | None,
                     every: str | None, cron: str | None, cfg: Config) -> Task: ...

    async def visible(self, scope: str, *, everything: bool = False) -> list[Task]: ...

    async def cancel(self, task_id: str, *, scope: str, identity: str, cfg: Config) -> Task: ...

    def describe(self, tasks: list[Task], cfg: Config, *, with_scope: bool = False) -> list[str]: ...


def _scheduler(ctx: ToolContext) -> TaskBook:
    tasks = ctx.tasks
    if tasks is None:
        raise ToolError("scheduled tasks are not available in this gateway")
    return tasks


def _identity(ctx: ToolContext) -> str:
    return ctx.inbound.identity if ctx.inbound is not None else ""


class ScheduleTask:
    name = "schedule_task"
    description = (
        "Schedule a task in this chat: at the given time(s) you receive `prompt` as a message and your reply is "
        "sent here, without anyone writing first. Write `prompt` as an instruction to yourself, e.g. "
        "'Remind them to stretch' or 'Summarize the open issues'. Give exactly one of at (once), every or cron "
        "(repeating). Times without an offset are local time."
    )
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {
            "prompt": {"type": "string", "description": "What to do when the task runs."},
            "at": {"type": "string", "description": "Once: an ISO 8601 time such as '2026-05-01T09:30', or a "
                                                    "delay such as 'in 20m', 'in 2h', 'in 1d 3h'."},
            "every": {"type": "string", "description": "Repeat with this period, such as '30m', '2h', '1d'."},
            "cron": {"type": "string", "description": "Repeat on a crontab schedule in local time: five fields "
                                                      "(minute hour day month weekday), such as '0 9 * * 1-5'."},
        },
        "required": ["prompt"],
        "additionalProperties": False,
    }

    def status(self, args: dict[str, Any]) -> str:
        return "scheduling a task…"

    async def run(self, args: dict[str, Any], ctx: ToolContext) -> ToolOutput:
        check_arguments(self.parameters, args)
        tasks = _scheduler(ctx)
        if ctx.inbound is None:
            raise ToolError("tasks can only be scheduled from a chat")
        try:
            task = await tasks.create(scope=ctx.scope, session_key=ctx.session_key, inbound=ctx.inbound,
                                      prompt=args["prompt"], at=args.get("at"), every=args.get("every"),
                                      cron=args.get("cron"), cfg=ctx.config)
        except TaskError as err:
            raise ToolArgumentError(str(err)) from None
        tz = zone(ctx.config.timezone)
        first = format_time(datetime.fromtimestamp(task.next_run or 0, UTC), tz)
        chained = (f" (a task made during a task's run starts at least {ctx.config.tasks.min_interval_s}s "
                   "after that run: tasks.min_interval_s)" if task.made_by_task else "")
        return ToolOutput(f"Scheduled task {task.id}: {task.schedule.describe(tz)}; first run {first}{chained}. "
                          f"It can be cancelled with cancel_task(id='{task.id}') or /tasks cancel {task.id}.")


class ListTasks:
    name = "list_tasks"
    description = "The tasks scheduled in this chat's scope: id, schedule, next run and prompt."
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {"all": {"type": "boolean", "description": "Admins only: every chat's tasks."}},
        "additionalProperties": False,
    }

    async def run(self, args: dict[str, Any], ctx: ToolContext) -> ToolOutput:
        check_arguments(self.parameters, args)
        tasks = _scheduler(ctx)
        everything = bool(args.get("all"))
        if everything and not is_admin(ctx.config, _identity(ctx)):
            raise ToolArgumentError("only admins may list every chat's tasks; call list_tasks() without `all`")
        found = await tasks.visible(ctx.scope, everything=everything)
        if not found:
            return ToolOutput("No scheduled tasks." if everything else "No scheduled tasks in this chat.")
        head = f"{len(found)} scheduled task{'s' if len(found) != 1 else ''}:"
        return ToolOutput("\n".join([head, *tasks.describe(found, ctx.config, with_scope=everything)]))


class CancelTask:
    name = "cancel_task"
    description = "Cancel a scheduled task of this chat by its id (as list_tasks shows it)."
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {"id": {"type": "string", "description": "The task's id, such as 'k3f2'."}},
        "required": ["id"],
        "additionalProperties": False,
    }

    async def run(self, args: dict[str, Any], ctx: ToolContext) -> ToolOutput:
        check_arguments(self.parameters, args)
        tasks = _scheduler(ctx)
        try:
            task = await tasks.cancel(args["id"], scope=ctx.scope, identity=_identity(ctx), cfg=ctx.config)
        except TaskError as err:
            raise ToolArgumentError(str(err)) from None
        return ToolOutput(f"Cancelled task {task.id} ({task.preview()}).")
