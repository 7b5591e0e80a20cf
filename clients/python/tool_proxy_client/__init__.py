"""tool-proxy-client: the agent's side of tool-proxy.

Keys from plan sessions and steps (:class:`PlanSession`), HTTP calls that wait out
``409`` and follow ``202`` operations (:class:`ToolProxy`, :class:`AsyncToolProxy`),
and one exception per problem the proxy answers (:mod:`tool_proxy_client.errors`). The MCP
helper is :mod:`tool_proxy_client.mcp` (the ``mcp`` extra).
"""

from tool_proxy_client.answers import Answer, Operation, Waits
from tool_proxy_client.client import AsyncToolProxy, ToolProxy
from tool_proxy_client.errors import (
    Executed,
    InvalidKey,
    KeyRefused,
    NotSent,
    OperationCancelled,
    OperationDead,
    OutcomeUnknown,
    ProxyProblem,
    RecordIdentity,
    RequestInProgress,
    ResponseNotStored,
    StillRunning,
    ToolProxyError,
    TransportError,
)
from tool_proxy_client.keys import args_hash, body_hash, canonical_json, composite_key
from tool_proxy_client.session import PlanSession, Step, StepCounter

__all__ = [
    "Answer",
    "AsyncToolProxy",
    "Executed",
    "InvalidKey",
    "KeyRefused",
    "NotSent",
    "Operation",
    "OperationCancelled",
    "OperationDead",
    "OutcomeUnknown",
    "PlanSession",
    "ProxyProblem",
    "RecordIdentity",
    "RequestInProgress",
    "ResponseNotStored",
    "Step",
    "StepCounter",
    "StillRunning",
    "ToolProxy",
    "ToolProxyError",
    "TransportError",
    "Waits",
    "args_hash",
    "body_hash",
    "canonical_json",
    "composite_key",
]
