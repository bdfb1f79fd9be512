"""`delegate(task, agent?)` (SPEC §5.8): hand a self-contained piece of work to a sub-agent.

The sub-turn itself runs in the message path (gateway/turns/agent.py): a fresh context that
holds only the task, its own step limit and token budget, the tools and skills of the named
agent (default: this one) without `delegate`, its messages stored apart from the session's
turns. Here is only the tool the model sees, which hands the call to `ToolContext.delegate`."""

from __future__ import annotations

from typing import Any

from gateway.tools.base import ToolArgumentError, ToolContext, ToolError, ToolOutput, check_arguments

MAX_TASK_CHARS = 8000


WHAT = (
    "Hand a self-contained task to a sub-agent that works on it alone and returns its final answer. "
    "It starts with a fresh context holding only `task` (nothing of this conversation), so write the task "
    "with everything it needs. Use it for independent pieces of work; several delegate calls in one step "
    "run at the same time (at most 3)."
)


class Delegate:
    name = "delegate"
    description = WHAT + " `agent` names another configured agent; default: this one."
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {
            "task": {"type": "string", "description": "the whole task, self-contained"},
            "agent": {"type": "string", "description": "a configured agent's name; default: this one"},
        },
        "required": ["task"],
        "additionalProperties": False,
    }

    @classmethod
    def schema_for(cls, own: str, agents: tuple[str, ...]) -> dict[str, Any]:
        """The tool as agent `own` is offered it: the agents it may hand work to are named
        (and the only values `agent` takes), so the model is not led to others."""
        others = [a for a in agents if a != own]
        if others:
            reach = (f" `agent` is one of: {', '.join(others)}, or this agent ({own}) when left out; "
                     "no other agent takes work from here.")
        else:
            reach = f" Only this agent ({own}) takes the task: leave `agent` out."
        agent_param = {"type": "string", "enum": [own, *others], "description": "the agent to hand it to"}
        parameters = {**cls.parameters, "properties": {**cls.parameters["properties"], "agent": agent_param}}
        return {"type": "function",
                "function": {"name": cls.name, "description": WHAT + reach, "parameters": parameters}}

    def status(self, args: dict[str, Any]) -> str:
        agent = args.get("agent")
        return f"working on a sub-task ({agent})…" if isinstance(agent, str) and agent else "working on a sub-task…"

    async def run(self, args: dict[str, Any], ctx: ToolContext) -> ToolOutput:
        check_arguments(self.parameters, args)
        task = args["task"].strip()
        if not task:
            raise ToolArgumentError("task is empty; write the whole task for the sub-agent")
        if len(task) > MAX_TASK_CHARS:
            raise ToolArgumentError(f"task is {len(task):,} characters; keep it under {MAX_TASK_CHARS:,}")
        if ctx.delegate is None:
            raise ToolError("a sub-agent cannot delegate further; do the task yourself")
        agent = args.get("agent")
        return await ctx.delegate(task, agent.strip() if isinstance(agent, str) and agent.strip() else None)
