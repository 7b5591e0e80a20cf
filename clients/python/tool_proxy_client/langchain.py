"""LangChain's MCP adapters: a tool call interceptor that sends each call's key.

    client = MultiServerMCPClient(
        {"billing": {"url": "http://tool-proxy:8080/billing/mcp", "transport": "streamable_http"}},
        tool_interceptors=[key_interceptor()],
    )

In a LangGraph graph (a ``ToolNode`` of the adapters' tools) the default steps are
:func:`tool_proxy_client.langgraph.tool_call_step`: the plan from the graph's thread, the
step from the graph's step, so a graph resumed from its checkpoint sends the same keys.
Outside a graph, give it a counter (``key_interceptor(plan.counter())``).

The adapters' interceptors cannot set ``params._meta``: the key goes in the
``Idempotency-Key`` header of the call (the adapters open a connection per call with the
interceptor's headers), which the proxy reads as well. The proxy's JSON-RPC errors are
raised as :mod:`tool_proxy_client.errors` classes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from tool_proxy_client.errors import RecordIdentity
from tool_proxy_client.langgraph import tool_call_step
from tool_proxy_client.mcp import problem_of_error
from tool_proxy_client.session import Step, StepCounter

Handler = Callable[[Any], Awaitable[Any]]
"""The adapters' next handler: an ``MCPToolCallRequest`` to its result."""


class Interceptor(Protocol):
    """The adapters' ``ToolCallInterceptor``."""

    async def __call__(self, request: Any, handler: Handler) -> Any:
        """Handle one tool call (``request``), calling ``handler`` to make it."""


def key_interceptor(
    steps: StepCounter | Callable[[Any], Step] = tool_call_step,
) -> Interceptor:
    """An interceptor for ``MultiServerMCPClient(tool_interceptors=[...])``: ``steps`` is a
    counter, or a function of the ``MCPToolCallRequest`` (``runtime`` is LangGraph's) to a
    step; by default the graph's (:func:`tool_proxy_client.langgraph.tool_call_step`)."""

    async def intercept(request: Any, handler: Handler) -> Any:
        step = steps.next() if isinstance(steps, StepCounter) else steps(request)
        key = step.key(dict(request.args or {}))
        headers = {**(request.headers or {}), "Idempotency-Key": key}
        try:
            return await handler(request.override(headers=headers))
        except Exception as exc:
            problem = problem_of_error(
                _mcp_error(exc), RecordIdentity(key, "tools/call", request.name)
            )
            if problem is None:
                raise
            raise problem from exc

    return intercept


def _mcp_error(exc: BaseException) -> BaseException:
    """The SDK's McpError, also when the adapters wrapped it (an exception group)."""
    if getattr(exc, "error", None) is not None:
        return exc
    for inner in getattr(exc, "exceptions", ()):
        return _mcp_error(inner)
    return exc.__cause__ if exc.__cause__ is not None else exc
