"""Route policies: each a module with the same small interface, chained per route.

    Context    one per request, built once by app.py: the route, the caller, the body,
               and the headers the policies add to the caller's answer
    Policy     ``wrap(context, forward) -> forward``: runs around the send, so on a
               guarded route only after a successful claim (a duplicate's 409 and a
               replay come first, and take nothing); raising a "nothing sent" error
               (e.g. ``RateLimited``) releases the key
    Chain      a route's policies, built once at start-up from its configuration;
               ``build_chain`` gives None for a route without any: it pays nothing

The policies: ``cache`` (answers served again without calling the tool, one call for
identical misses), ``lock`` (one call at a time per resource, with fencing tokens),
``versioning`` (ETags and If-Match for tools without them), ``limits`` (rates,
concurrency, token costs, the tool's own pauses), in that order around the send: a cache
hit takes no lock and no quota, and a call waits for its resource before it takes from
the limits.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from starlette.responses import Response

from proxy.asgi import Incoming, RawHeaders
from proxy.background import TaskSet
from proxy.config import RouteConfig
from proxy.fence import Leased
from proxy.forwarding import UpstreamResponse
from proxy.metrics import Metrics
from proxy.offload import Offload
from proxy.store import Store
from proxy.store.locks import Version

UNREAD: Any = object()
"""``Context.document`` before the body has been read as JSON."""

Forward = Callable[[], Awaitable[UpstreamResponse]]
"""Sends the request upstream and returns the answer, its body still to be read."""


@dataclass(slots=True)
class Context:
    """One request as the policies see it, built once."""

    route: RouteConfig
    request: Incoming
    body: bytes
    principal: str = ""
    identity: str = ""
    """The caller's issuer and subject (a digest, ``auth.callers.Caller.identity``): one
    user, where the principal may be a tenant; "" for an anonymous caller."""
    headers: RawHeaders = field(default_factory=list)
    """Added to the caller's answer by ``Chain.decorate`` (never recorded or replayed)."""
    cached: bool = False
    """Set by the cache when the answer is a stored one (the tool not called for it)."""
    call: Call | None = None
    """On an MCP route, a ``tools/call`` the route caches, as the cache sees it
    (``mcp.CachedCall``); None otherwise (on HTTP routes the cache sees the request)."""
    fence: Leased | None = None
    """A guarded call's fence (``fence.py``): the send checks it; so does the cache before
    it answers a call from the store (a lease lost while the call waited: not answered)."""
    version: Version | None = None
    """The version of the request's resource, as the cache read it (a cached read on a
    route with ``resource``): its ETag is set; versioning does not read it again."""
    document: Any = UNREAD
    """The body's JSON value, once a ``json:`` key has read it (``limits.body_json``):
    read once for every policy; ``UNREAD`` before."""

    def send_header(self, name: bytes, value: bytes) -> None:
        """Send ``name: value`` to the tool in place of any the caller sent (e.g. a
        fencing token, which a caller must not be able to choose)."""
        headers = [(k, v) for k, v in self.request.scope["headers"] if k != name]
        self.request.scope["headers"] = [*headers, (name, value)]

    @property
    def client_ip(self) -> str:
        client = self.request.scope.get("client")
        return str(client[0]) if client else ""


class Call(Protocol):
    """A JSON-RPC call whose answer the cache keeps by what it asks, not by its bytes (the
    envelope's ``id`` changes on every retry): an MCP ``tools/call`` of a cached tool."""

    def material(self) -> bytes:
        """What identifies the call to the cache: the tool, its arguments' digest, ..."""

    def kept(self, headers: RawHeaders, body: bytes) -> tuple[RawHeaders, bytes] | None:
        """What is stored of the tool server's answer (``headers``, ``body``: as it was
        sent, SSE included); None if it is not a result to reuse (an error, ...)."""

    def served(self, headers: RawHeaders, body: bytes) -> tuple[RawHeaders, bytes]:
        """A stored answer as this call's answer (its ``id``, the form it accepts)."""


class Policy(Protocol):
    """A route policy."""

    def wrap(self, context: Context, forward: Forward) -> Forward:
        """``forward`` with this policy around it."""


class Chain:
    """A route's policies, the first one outermost."""

    __slots__ = ("policies",)

    def __init__(self, policies: list[Policy]) -> None:
        self.policies = policies

    def wrap(self, context: Context, forward: Forward) -> Forward:
        for policy in reversed(self.policies):
            forward = policy.wrap(context, forward)
        return forward

    @staticmethod
    def decorate(context: Context, response: Response) -> Response:
        """Add the policies' headers (e.g. RateLimit) to the answer the caller gets; an
        ``ETag`` of the proxy's (versioning, a cached resource) replaces the tool's."""
        if context.headers:
            kept = response.raw_headers
            if any(name == b"etag" for name, _ in context.headers):
                kept = [(k, v) for k, v in kept if k.lower() != b"etag"]
            response.raw_headers = [*kept, *context.headers]
        return response


def build_chain(
    route: RouteConfig,
    store: Store,
    metrics: Metrics,
    tasks: TaskSet,
    log: Any,
    *,
    offload: Offload | None = None,
    max_json_depth: int | None = None,
    cached: frozenset[str] = frozenset(),
    versioned: frozenset[str] = frozenset(),
) -> Chain | None:
    """The route's chain from its configuration; None if it has no policy. ``offload``
    keeps large cached answers; ``max_json_depth`` is ``limits.max_json_depth``;
    ``cached`` and ``versioned`` name the resources some route caches or versions
    (``Config.cached_resources``): the writes of a cached one invalidate its reads, the
    cached reads of a versioned one carry its ETag."""
    policies: list[Policy] = []
    resource = route.resource_name()
    invalidates = resource is not None and resource in cached
    if route.cache is not None:  # outermost: a hit takes no lock and no quota
        from proxy.policies.cache import Cache

        policies.append(
            Cache(
                route,
                store,
                metrics,
                tasks,
                log,
                offload=offload,
                max_json_depth=max_json_depth,
                etags=resource is not None and resource in versioned,
            )
        )
    if route.lock is not None or route.versioning is not None or invalidates:
        from proxy.store import make_locks

        locks = make_locks(store)
        if route.lock is not None:
            from proxy.policies.lock import Lock

            policies.append(Lock(route, locks, metrics, tasks, log, max_json_depth=max_json_depth))
        if route.versioning is not None or invalidates:
            from proxy.policies.versioning import Versioning

            policies.append(
                Versioning(
                    route,
                    locks,
                    metrics,
                    tasks,
                    log,
                    invalidates=invalidates,
                    max_json_depth=max_json_depth,
                )
            )
    if route.limits is not None:
        from proxy.policies.limits import Limits
        from proxy.store import make_buckets

        buckets = make_buckets(store)
        policies.append(Limits(route, buckets, metrics, tasks, log, max_json_depth=max_json_depth))
    return Chain(policies) if policies else None
