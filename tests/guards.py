"""Helpers for unit tests of the state machine: a Guard on a store, and its log events."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.responses import Response

from proxy.background import TaskSet
from proxy.config import parse_config
from proxy.fence import Fence
from proxy.forwarding import UpstreamResponse
from proxy.idempotency import Guard, Outcome
from proxy.metrics import Metrics
from proxy.operation import Operation
from proxy.reconcile import Lookup
from proxy.store import RecordKey, Store

OP = Operation(RecordKey("tool||plan|1", "f" * 64), "plan:1", "f" * 64)


class EventLog:
    """A logger that keeps the names of the events it is given, in order."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def info(self, event: str, **fields: Any) -> None:
        self.events.append(event)

    warning = error = critical = info


def make_guard(store: Store, log: EventLog, metrics: Metrics | None = None, **policy: Any) -> Guard:
    """The Guard of one route ``tool`` with ``policy`` as its idempotency section."""
    spec = {"name": "tool", "path_prefix": "/t", "upstream": "http://127.0.0.1:9"}
    config = parse_config(
        {"store": {"url": "memory://"}, "routes": [{**spec, "idempotency": policy}]}, env={}
    )
    (route,) = config.routes
    assert route.idempotency is not None
    return Guard(route, route.idempotency, store, TaskSet(), log, None, metrics)


async def run(
    guard: Guard,
    op: Operation,
    forward: Callable[[], Awaitable[UpstreamResponse]],
    lookup: Lookup | None = None,
) -> tuple[Response, Outcome]:
    """``guard.run`` with ``forward`` behind a fence, as the proxy's send has it: the
    lease is checked right before ``forward`` is called."""
    fence = Fence()

    async def fenced() -> UpstreamResponse:
        fence.check()
        return await forward()

    return await guard.run(op, fenced, fence, lookup)
