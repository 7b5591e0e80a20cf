"""LangGraph: the plan session from the graph's thread, the step from the graph's step.

    client = MultiServerMCPClient(
        {"billing": {"url": "http://tool-proxy:8080/billing/mcp", "transport": "streamable_http"}},
        tool_interceptors=[key_interceptor(tool_call_step)],  # tool_proxy_client.langchain
    )
    graph = builder.compile(checkpointer=saver)  # ToolNode(await client.get_tools()) in it

A tool call made by a node of a checkpointed graph is keyed by the thread
(``configurable.thread_id``: the plan session), the superstep and the node that run it
(``langgraph_step``, ``langgraph_node``) and, for a ``ToolNode``, the call's position
among the tool calls of its ``AIMessage``. A graph resumed from its checkpoint after a
failure runs the failed node again at the same step, with the same message: its calls
send the keys they sent before, and get the recorded answers. A new input on the thread
runs at later steps: new calls.

A node that calls HTTP tools takes its step from its ``config``:

    async def bill(state: State, config: RunnableConfig) -> dict[str, Any]:
        answer = await proxy.call(graph_step(config), "/tools/charge", {...})
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from tool_proxy_client.keys import is_key_part
from tool_proxy_client.session import PlanSession, Step

PLAN_PREFIX = "langgraph"
"""The first part of the name a thread's plan session is derived from."""


def graph_plan(config: Mapping[str, Any]) -> PlanSession:
    """The plan session of the graph's thread (a ``RunnableConfig`` of a node or tool):
    derived from ``configurable.thread_id`` and, within a subgraph, the names of the nodes
    it runs in (a subgraph numbers its steps on its own)."""
    configurable = config.get("configurable") or {}
    metadata = config.get("metadata") or {}
    thread = configurable.get("thread_id") or metadata.get("thread_id")
    if not thread:
        raise ValueError("the graph runs without a thread: invoke it with configurable.thread_id")
    namespace = str(configurable.get("checkpoint_ns") or metadata.get("checkpoint_ns") or "")
    parents = [part.split(":")[0] for part in namespace.split("|")[:-1] if part]
    return PlanSession.derive(PLAN_PREFIX, str(thread), *parents)


def graph_step(config: Mapping[str, Any], position: int | None = None) -> Step:
    """The step of the node running with ``config``: ``<langgraph_step>.<node>``, and
    ``.<position>`` when given (several calls of one node: number them in a fixed order)."""
    metadata = config.get("metadata") or {}
    if "langgraph_step" not in metadata:
        raise ValueError("not a graph's config: no metadata.langgraph_step")
    node = str(metadata.get("langgraph_node") or "node")
    step = graph_plan(config).step(int(metadata["langgraph_step"])).sub(_part(node))
    return step if position is None else step.sub(position)


def tool_call_step(request: Any) -> Step:
    """The step of a tool call of the LangChain MCP adapters (an ``MCPToolCallRequest``)
    made by a graph's ``ToolNode``: :func:`graph_step` of its runtime's config, with the
    position of the call among the tool calls of its ``AIMessage``."""
    runtime = getattr(request, "runtime", None)
    config = getattr(runtime, "config", None)
    if config is None:
        raise ValueError(
            "the tool call is not made in a graph (no runtime): give key_interceptor a counter"
        )
    position = _position(getattr(runtime, "state", None), getattr(runtime, "tool_call_id", None))
    return graph_step(config, position)


def _part(name: str) -> str:
    """A node's name as a key part (a digest of it when it has other characters)."""
    return name if is_key_part(name) else hashlib.sha256(name.encode()).hexdigest()[:16]


def _position(state: Any, call_id: str | None) -> int:
    """Where ``call_id`` is among the tool calls of the last message of ``state`` that has
    it (1 when it is not found)."""
    if isinstance(state, Mapping):
        messages = state.get("messages")
    else:
        messages = state if isinstance(state, list) else getattr(state, "messages", None)
    for message in reversed(messages if isinstance(messages, list) else []):
        calls = getattr(message, "tool_calls", None) or []
        for position, call in enumerate(calls, 1):
            if call.get("id") == call_id:
                return position
    return 1
