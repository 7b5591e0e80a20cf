"""Pydantic AI: keys for the tool calls of its MCP toolsets, and steps for function tools.

    server = MCPToolset("http://tool-proxy:8080/billing/mcp", process_tool_call=key_tool_calls())
    agent = Agent(model, toolsets=[server])
    await agent.run(prompt, run_id=job_id)  # the same run_id again: the same keys

Each ``tools/call`` of the toolset carries a key in ``params._meta``: the plan session is
derived from the run's ``run_id`` (pass your own durable one: a job id, a conversation
turn; Pydantic AI's durable executions derive it from the workflow, so a re-executed
workflow keeps it), the step is the run's step (``ctx.run_step``, one per model response)
and the call's position among that response's tool calls (parallel calls keep their
positions). A ``-32010`` (the same call runs now) is waited out; the proxy's other
refusals are raised as :mod:`tool_proxy_client.errors` classes, not handed to the model.

Function tools that call HTTP tools take their step from :func:`run_step`:

    @agent.tool
    async def charge(ctx: RunContext[AsyncToolProxy], account: str, cents: int) -> str:
        answer = await ctx.deps.call(run_step(ctx), "/tools/charge", {...})
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from tool_proxy_client.answers import Waits
from tool_proxy_client.errors import ProxyProblem, RecordIdentity
from tool_proxy_client.mcp import KEY_META, problem_of_error, waiting
from tool_proxy_client.session import PlanSession, Step, StepCounter

PLAN_PREFIX = "pydantic-ai"
"""The first part of the name a run's plan session is derived from (then its ``run_id``)."""


class CallToolFunc(Protocol):
    """Pydantic AI's ``CallToolFunc``: the toolset's own call, ``metadata`` as ``_meta``."""

    async def __call__(
        self, name: str, args: dict[str, Any], *, metadata: dict[str, Any] | None = None
    ) -> Any:
        """Send ``tools/call``."""


ProcessToolCallback = Callable[[Any, CallToolFunc, str, dict[str, Any]], Awaitable[Any]]
"""Pydantic AI's ``ProcessToolCallback``: a ``RunContext``, the call, the tool, its arguments."""

Steps = PlanSession | StepCounter | Callable[[Any], PlanSession | Step]
"""Where a call's step comes from: a plan (its steps from the run's), a counter, or a
function of the ``RunContext`` (``ctx.deps`` is yours) to a plan or a step."""


def run_plan(ctx: Any) -> PlanSession:
    """The plan session of a run: derived from its ``run_id`` (``Agent.run(run_id=...)``)."""
    run_id = getattr(ctx, "run_id", None)
    if not run_id:
        raise ValueError("the run has no run_id: pass Agent.run(..., run_id=...)")
    return PlanSession.derive(PLAN_PREFIX, str(run_id))


def run_step(ctx: Any, plan: PlanSession | None = None) -> Step:
    """The step of the tool call ``ctx`` is the ``RunContext`` of: the run's step
    (``ctx.run_step``) and the call's position among the tool calls of that model response
    (``3.1``, ``3.2``), in ``plan`` or the run's plan (:func:`run_plan`). Never the
    ``tool_call_id``: a model answering again names its calls anew."""
    plan = plan or run_plan(ctx)
    return plan.step(int(ctx.run_step)).sub(_position(ctx))


def _position(ctx: Any) -> int:
    """Where ``ctx.tool_call_id`` is among the tool calls of the last model response that
    has it (1 when unknown: a run context made outside an agent's run)."""
    call_id = getattr(ctx, "tool_call_id", None)
    for message in reversed(list(getattr(ctx, "messages", None) or ())):
        calls = [p for p in getattr(message, "parts", ()) if p.part_kind == "tool-call"]
        for position, part in enumerate(calls, 1):
            if part.tool_call_id == call_id:
                return position
    return 1


def _step_of(steps: Steps, ctx: Any) -> Step:
    if isinstance(steps, StepCounter):
        return steps.next()
    found = steps if isinstance(steps, PlanSession) else steps(ctx)
    return found if isinstance(found, Step) else run_step(ctx, found)


def key_tool_calls(
    steps: Steps = run_plan, *, waits: Waits | None = None, key_meta: str = KEY_META
) -> ProcessToolCallback:
    """A ``process_tool_call`` for ``MCPToolset`` (or the ``MCPServer*`` classes): each call
    sent with its step's key in ``params._meta``. ``steps`` defaults to the run's plan
    (:func:`run_plan`) and steps (:func:`run_step`)."""
    waits = waits or Waits()

    async def process(
        ctx: Any, call_tool: CallToolFunc, name: str, tool_args: dict[str, Any]
    ) -> Any:
        key = _step_of(steps, ctx).key(dict(tool_args or {}))
        record = RecordIdentity(key, "tools/call", name)
        metadata = {key_meta: key}
        return await waiting(
            lambda: call_tool(name, tool_args, metadata=metadata), record, waits, _problem
        )

    return process


def _problem(exc: BaseException, record: RecordIdentity) -> ProxyProblem | None:
    """The proxy's problem behind ``exc``: the toolset raises the SDK's ``McpError`` as a
    ``ModelRetry`` (or ``ToolFailed``, or in an exception group) caused by it."""
    seen: set[int] = set()
    pending: list[BaseException] = [exc]
    while pending:
        error = pending.pop()
        if id(error) in seen:
            continue
        seen.add(id(error))
        problem = problem_of_error(error, record)
        if problem is not None:
            return problem
        pending.extend(getattr(error, "exceptions", ()))
        if error.__cause__ is not None:
            pending.append(error.__cause__)
    return None
