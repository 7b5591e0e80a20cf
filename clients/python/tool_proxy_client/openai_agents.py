"""The OpenAI Agents SDK: keys for the tool calls of its MCP servers.

    plan = PlanSession.derive(conversation_id)
    server = MCPServerStreamableHttp(
        {"url": "http://tool-proxy:8080/billing/mcp"},
        tool_meta_resolver=tool_meta_resolver(plan.counter()),
    )

Each ``tools/call`` the agent makes through ``server`` carries the key of the counter's
next step, computed from the call's arguments. Function tools that call HTTP tools use
:class:`tool_proxy_client.ToolProxy` inside the function, with a step of the same counter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tool_proxy_client.mcp import KEY_META
from tool_proxy_client.session import Step, StepCounter

MetaResolver = Callable[[Any], dict[str, Any] | None]
"""The SDK's ``MCPToolMetaResolver``: an ``MCPToolMetaContext`` to ``_meta``."""


def tool_meta_resolver(
    steps: StepCounter | Callable[[Any], Step], key_meta: str = KEY_META
) -> MetaResolver:
    """A ``tool_meta_resolver`` for an MCP server of the SDK: ``steps`` is a counter, or a
    function of the ``MCPToolMetaContext`` (its ``run_context.context`` is yours) to a step."""

    def resolve(context: Any) -> dict[str, Any]:
        step = steps.next() if isinstance(steps, StepCounter) else steps(context)
        return step.meta(context.arguments or {}, key_meta)

    return resolve
