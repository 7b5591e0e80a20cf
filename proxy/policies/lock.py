"""Per-resource locks: calls on one resource run one at a time across replicas, each
with a fencing token the tool can check.

Per call, around the send (after a successful claim on a guarded route: a duplicate's
409 or replay never waits for the lock)::

    the resource key (json:, header:, path:, principal; 400 if the request lacks it)
      └─▶ take the lock within lock.wait (resources.Locker), else 409 resource-locked
            └─▶ forward with ``Fencing-Token: <n>`` ──▶ the answer read (whole, or
                   │                                    streamed to its end): free it
                   ├─ nothing sent: free it at once
                   └─ outcome unknown: left to lapse after lock.ttl (the tool may
                      still be working; the next holder's token is larger)

The lock is renewed every ttl/3 while the call runs; the idempotency lease is renewed
by its own timer meanwhile.
"""

from __future__ import annotations

from typing import Any

from proxy.background import TaskSet
from proxy.config import RouteConfig
from proxy.errors import NOT_SENT
from proxy.forwarding import UpstreamResponse
from proxy.metrics import Metrics
from proxy.policies import Context, Forward
from proxy.policies.limits import Settled
from proxy.policies.resources import Held, Locker, Resource
from proxy.store.locks import Locks


class Lock:
    """The lock policy of one route."""

    def __init__(
        self,
        route: RouteConfig,
        locks: Locks,
        metrics: Metrics,
        tasks: TaskSet,
        log: Any,
        *,
        max_json_depth: int | None = None,
    ) -> None:
        assert route.lock is not None
        self.resource = Resource.of(route, route.lock, max_depth=max_json_depth)
        self.header = route.lock.fencing_header.lower().encode()
        self.locker = Locker(
            route.name,
            "lock",
            locks,
            route.lock.ttl,
            route.lock.wait,
            route.timeout,
            metrics,
            tasks,
            log,
            scope=route.resource_scope("lock"),
        )

    def wrap(self, context: Context, forward: Forward) -> Forward:
        async def locked() -> UpstreamResponse:
            held = await self.locker.take(self.resource.key(context))
            context.send_header(self.header, str(held.token).encode())
            return await self._forward(held, forward)

        return locked

    async def _forward(self, held: Held, forward: Forward) -> UpstreamResponse:
        try:
            upstream = await forward()
        except NOT_SENT:
            self.locker.release(held)
            raise
        except BaseException:
            self.locker.abandon(held)
            raise
        return Settled(upstream, lambda body, whole: self._settled(held, whole))

    def _settled(self, held: Held, whole: bool) -> None:
        """Free the lock once the answer is read; if the exchange broke, the tool may still
        be working: the lock is left to lapse after its ttl instead."""
        if whole:
            self.locker.release(held)
        else:
            self.locker.abandon(held)
