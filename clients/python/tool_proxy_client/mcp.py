"""MCP through tool-proxy: the step's key in ``params._meta`` of ``tools/call``, and the
proxy's JSON-RPC errors raised as the same exceptions as on HTTP routes.

    result = await call_tool(session, plan.step(3), "charge", {"account": "acme", "cents": 250})

``session`` is the official SDK's ``mcp.ClientSession`` (anything with its ``call_tool``).
A ``-32010`` (the same call runs now) is waited out as a ``409`` is, within :class:`Waits`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from datetime import timedelta
from typing import Any, Protocol, TypeVar

from tool_proxy_client.answers import Waits
from tool_proxy_client.errors import (
    PROBLEM_BASE,
    ProxyProblem,
    RecordIdentity,
    is_proxy_problem,
    problem_error,
)
from tool_proxy_client.session import Step

T = TypeVar("T")

KEY_META = "idempotencyKey"
"""The ``params._meta`` member the proxy reads (the route's ``mcp.key_meta``)."""

CODES: dict[int, str] = {
    -32010: "request-in-progress",
    -32011: "args-hash-mismatch",
    -32012: "idempotency-key-reused",
    -32013: "idempotency-key-missing",
    -32014: "idempotency-key-invalid",
    -32015: "outcome-unknown",
    -32016: "response-not-stored",
}
"""The proxy's JSON-RPC error codes and their problem types; ``-32019`` is any other,
named by ``error.data.type``."""
OTHER_CODE = -32019


class CallsTools(Protocol):
    """What :func:`call_tool` needs of a session: ``mcp.ClientSession.call_tool``."""

    async def call_tool(
        self,
        name: str,
        arguments: dict[str, Any] | None = None,
        read_timeout_seconds: timedelta | None = None,
        progress_callback: Any = None,
        *,
        meta: dict[str, Any] | None = None,
    ) -> Any:
        """Send ``tools/call``."""


def meta_for(
    step: Step, arguments: Mapping[str, Any] | None, name: str = KEY_META
) -> dict[str, str]:
    """``params._meta`` for a ``tools/call`` of ``step`` with ``arguments``: the key is the
    digest of the arguments (``{}`` when there are none), as the proxy computes it."""
    return step.meta(dict(arguments or {}), name)


def problem_of_error(
    error: BaseException, record: RecordIdentity | None = None
) -> ProxyProblem | None:
    """The exception for an MCP error that is the proxy's (an ``McpError`` whose JSON-RPC
    code is one of :data:`CODES` or ``-32019`` with a problem document), else None."""
    data = getattr(error, "error", None)
    code = getattr(data, "code", None)
    if code not in CODES and code != OTHER_CODE:
        return None
    document = getattr(data, "data", None)
    if not is_proxy_problem(document):
        if code == OTHER_CODE:
            return None
        document = {"type": PROBLEM_BASE + CODES[code], "detail": getattr(data, "message", "")}
    wait = document.get("retry_after")
    return problem_error(
        document,
        retry_after=float(wait) if isinstance(wait, int | float) else None,
        record=record,
    )


async def call_tool(
    session: CallsTools,
    step: Step,
    name: str,
    arguments: Mapping[str, Any] | None = None,
    *,
    waits: Waits | None = None,
    key: str | None = None,
    meta: Mapping[str, Any] | None = None,
    key_meta: str = KEY_META,
    **options: Any,
) -> Any:
    """``session.call_tool(name, arguments)`` as ``step`` of its plan, with its key in
    ``params._meta``; the proxy's refusals raised as :mod:`tool_proxy_client.errors`
    classes. ``options`` go to ``call_tool`` (``read_timeout_seconds``, ...)."""
    waits = waits or Waits()
    args = dict(arguments or {})
    sent = {**(meta or {}), key_meta: key or step.key(args)}
    record = RecordIdentity(sent[key_meta], "tools/call", name)
    return await waiting(lambda: session.call_tool(name, args, meta=sent, **options), record, waits)


async def waiting(
    send: Callable[[], Awaitable[T]],
    record: RecordIdentity,
    waits: Waits,
    problem_of: Callable[[Exception, RecordIdentity], ProxyProblem | None] | None = None,
) -> T:
    """``send()``, sent again while the proxy's refusal is one ``waits`` retries (an
    in-progress call, a rate limit), within its bounds; any other refusal raised as its
    :mod:`tool_proxy_client.errors` class. ``problem_of`` finds the proxy's problem in
    an exception (default: :func:`problem_of_error`)."""
    find = problem_of or problem_of_error
    started, attempt = time.monotonic(), 0
    while True:
        try:
            return await send()
        except Exception as exc:
            problem = find(exc, record)
            if problem is None:
                raise
            delay = _delay(problem, waits, attempt, time.monotonic() - started)
            if delay is None:
                raise problem from exc
        await asyncio.sleep(delay)
        attempt += 1


def _delay(problem: ProxyProblem, waits: Waits, attempt: int, spent: float) -> float | None:
    if problem.type.removeprefix(PROBLEM_BASE) not in waits.retried:
        return None
    delay = waits.delay(attempt, problem.retry_after)
    return delay if spent + delay <= waits.total else None
