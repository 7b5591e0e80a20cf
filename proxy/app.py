"""``create_app(config)``: wires routes, guards, the store and the upstream client."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import time
from collections.abc import AsyncIterator, Awaitable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from proxy import logs
from proxy.admin import AdminAuth, record_routes
from proxy.asgi import Incoming, Reply
from proxy.auth.callers import Authenticator, bearer_token
from proxy.auth.sealing import Sealer, load_key
from proxy.auth.tokens import DownstreamTokens
from proxy.background import TaskSet
from proxy.config import (
    DEFAULT_TOKEN_CACHE_ENTRIES,
    RESERVED_PREFIX,
    Config,
    RouteConfig,
    RouteProtocol,
    TokenMode,
    load_config,
)
from proxy.console import console_routes
from proxy.errors import (
    BadRequest,
    CallerLeft,
    InvalidPath,
    MethodNotImplemented,
    OffloadUnavailable,
    OutcomeUnknown,
    ProxyError,
    RequestInProgress,
    RequestTooLarge,
    StoredResponseUnavailable,
    StoreUnavailable,
    Unauthorized,
    UpstreamUnreachable,
)
from proxy.fence import Fence, Leased
from proxy.forwarding import Upstream, UpstreamResponse, request_headers
from proxy.hosts import Listener
from proxy.idempotency import Guard, Lease, Outcome
from proxy.job_events import Hub
from proxy.jobs import RouteJobs, asked, prefer
from proxy.journal import Journal
from proxy.metrics import Metrics
from proxy.numbers import MAX_DIGITS, digits, whole
from proxy.offload import Offload
from proxy.operation import identify
from proxy.operations import operation_routes
from proxy.policies import Call, Chain, Context, Forward, build_chain
from proxy.problems import (
    handle_http_exception,
    handle_proxy_error,
    internal_error_response,
    problem_response,
)
from proxy.reconcile import Lookup
from proxy.routes import ABSOLUTE_FORM, Router, check_path, upstream_url
from proxy.store import Queue, Store, make_queue, make_store
from proxy.tracing import from_env as tracing_from_env

if TYPE_CHECKING:
    from proxy.mcp import McpView
    from proxy.mcp_tasks import McpTasks
    from proxy.otel import Tracing

# The proxy's own endpoints live under this path; nothing under it is forwarded.
ADMIN_PREFIX = RESERVED_PREFIX + "/"
# Bodies up to this size are read whole (one write upstream); larger ones are streamed.
SMALL_BODY_BYTES = 64 * 1024
# How often expired records are deleted from stores that do not expire them themselves.
SWEEP_INTERVAL_SECONDS = 60.0
# How often offloaded objects past the expiry in their names are looked for.
OBJECT_SWEEP_INTERVAL_SECONDS = 600.0
# readyz gives up on the store after this long.
READY_TIMEOUT_SECONDS = 2.0
# Extra time, beyond the longest a call can take, that shutdown waits for calls in flight.
SHUTDOWN_GRACE_SECONDS = 5.0
# The longest one store operation takes with its own retries (Redis: three attempts of a
# 2 s socket timeout with backoff; SQLite: a 5 s busy timeout): a claim, then a conclusion.
STORE_OPERATION_SECONDS = 7.0
# The collector's youngest generation is collected after this many more container
# objects (CPython's default: 700). Some 30 guarded calls in flight hold more than 700
# between them, so the default collected every 25 calls and moved the live ones to the
# older generations, to be traversed again there; a collection of 5,000 young objects
# takes some 0.13 ms. See docs/benchmarks.md, "The collector".
YOUNG_COLLECTION_THRESHOLD = 5_000
# The health probes: answered whatever the Host and Origin (a kubelet sends the pod's IP).
PROBES = frozenset({ADMIN_PREFIX + "healthz", ADMIN_PREFIX + "readyz"})
# Methods never forwarded (501): the proxy is not a tunnel, and TRACE would echo the
# caller's headers, and those the proxy adds, back.
NEVER_FORWARDED = frozenset({"CONNECT", "TRACE"})

_ERROR_OUTCOMES: dict[type[ProxyError], Outcome] = {
    RequestInProgress: Outcome.CONFLICT,
    UpstreamUnreachable: Outcome.RELEASED,
    OutcomeUnknown: Outcome.FAILED,
    StoredResponseUnavailable: Outcome.FAILED,
}


@dataclass(slots=True)
class Trace:
    """What the request log line says about one request."""

    route: str | None = None
    key: str | None = None
    outcome: Outcome = Outcome.REJECTED
    problem: str | None = None
    """The problem type of the proxy's refusal, if it refused."""
    span: Any = None
    """The request's span, when tracing is on (``otel.py``); then also its token in
    ``tracing.CURRENT`` and, on MCP routes, the JSON-RPC message's span."""
    token: Any = None
    mcp: Any = None


class Handling(NamedTuple):
    """What the proxy does with one route's requests: built once per route, found with
    one look-up per request."""

    view: McpView | None
    """The JSON-RPC view of a ``protocol: mcp`` route."""
    guard: Guard | None
    chain: Chain | None
    jobs: RouteJobs | None
    plain: bool
    """No policy and no downstream token of its own: an unguarded request is passed
    through as it comes."""


async def read_body(request: Incoming, limit: int) -> bytes:
    """The whole request body, or ``RequestTooLarge`` as soon as it passes ``limit``."""
    declared = request.header(b"content-length")
    if declared is not None:
        if not digits(declared):
            raise BadRequest("Content-Length is not a number")
        if len(declared) > MAX_DIGITS or int(declared) > limit:
            raise RequestTooLarge(f"the body is {declared} bytes; the limit is {limit}")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.chunks():
        size += len(chunk)
        if size > limit:
            raise RequestTooLarge(f"the body is over the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)  # one chunk: the same object, not a copy


def _raw_path(scope: Scope) -> bytes:
    """The path as the caller sent it (percent-encoding kept)."""
    raw: bytes | None = scope.get("raw_path")
    return raw or scope["path"].encode()


def _target(scope: Scope) -> bytes:
    """``METHOD /raw/path?query``: what, besides the body, a guarded request asks for."""
    target = b"%s %s" % (scope["method"].encode(), _raw_path(scope))
    query: bytes = scope["query_string"]
    return b"%s?%s" % (target, query) if query else target


def _respond(upstream: UpstreamResponse, body: bytes, head: bool) -> Response:
    length = upstream.length if head and upstream.length is not None else len(body)
    headers = [*upstream.headers, (b"content-length", str(length).encode())]
    return Reply(upstream.status, headers, body)


def _downstream_tokens(config: Config, store: Store) -> DownstreamTokens | None:
    """The token cache, when some route forwards a token of its own."""
    if not any(r.token and r.token.mode is not TokenMode.PASSTHROUGH for r in config.routes):
        return None
    sealer, entries = None, DEFAULT_TOKEN_CACHE_ENTRIES
    if config.auth is not None:
        entries = config.auth.token_cache_entries
        if config.auth.token_cache_key_env:
            sealer = Sealer(load_key(config.auth.token_cache_key_env))
    return DownstreamTokens(list(config.routes), store=store, sealer=sealer, max_entries=entries)


def _request_sealer(config: Config) -> Sealer | None:
    """What seals the credentials of async jobs' stored requests, if a key is set."""
    sealing = config.sealing_key_env()
    return None if sealing is None else Sealer(load_key(*sealing))


class Proxy:
    """The catch-all endpoint: match a route, then pass through or guard."""

    def __init__(
        self,
        config: Config,
        store: Store,
        upstream: Upstream,
        tasks: TaskSet,
        tracing: Tracing | None = None,
    ) -> None:
        self.config = config
        self.tracing = tracing
        if tracing is not None:
            tracing.trace_store(store, config.store.url)
        self.store = store
        self.upstream = upstream
        self.tasks = tasks
        self.log = logs.get_logger()
        self.request_log = logs.get_request_log()
        self.router = Router(config.routes)
        server = config.server
        self.listener = Listener.of(server.host, server.allowed_hosts, server.allowed_origins)
        """The Host and Origin checks; None when every Host and Origin passes."""
        ttls = {r.name: r.idempotency.result_ttl for r in config.routes if r.idempotency}
        self.offload = Offload(config.offload, ttls) if config.offload else None
        self.metrics = Metrics()
        journal_dir = config.journal_dir()
        self.journal = None if journal_dir is None else Journal(journal_dir, store, self.log)
        self.guards = {
            r.name: Guard(
                r, r.idempotency, store, tasks, self.log, self.offload, self.metrics, self.journal
            )
            for r in config.routes
            if r.idempotency is not None
        }
        self.max_body = config.limits.max_body_bytes
        self.max_json_depth = config.limits.max_json_depth
        self.auth = Authenticator(config.auth) if config.auth else None
        self.tokens = _downstream_tokens(config, store)
        cached, versioned = config.cached_resources(), config.versioned_resources()
        chains = {
            r.name: build_chain(
                r,
                store,
                self.metrics,
                tasks,
                self.log,
                offload=self.offload,
                max_json_depth=self.max_json_depth,
                cached=cached,
                versioned=versioned,
            )
            for r in config.routes
        }
        self.chains = {name: chain for name, chain in chains.items() if chain is not None}
        self.mcp = self._mcp_views(config.routes, store)
        self.jobs: dict[str, RouteJobs] = {}
        self.hub: Hub | None = None
        self.queue: Queue | None = None
        if any(r.runs_jobs() for r in config.routes):
            self.queue = queue = make_queue(store)
            self.hub = Hub(queue, self.log)
            sealer = _request_sealer(config)
            self.jobs = {
                r.name: RouteJobs(
                    r,
                    self.guards[r.name],
                    queue,
                    store,
                    self.hub,
                    self.forwarder,
                    self.offload,
                    tasks,
                    self.log,
                    sealer,
                    tracing,
                )
                for r in config.routes
                if r.runs_jobs()
            }
        self.mcp_tasks = self._mcp_tasks()
        self.handling = {r.name: self._handling(r.name) for r in config.routes}

    def _handling(self, route: str) -> Handling:
        chain = self.chains.get(route)
        tokened = self.tokens is not None and self.tokens.applies(route)
        return Handling(
            self.mcp.get(route),
            self.guards.get(route),
            chain,
            self.jobs.get(route),
            chain is None and not tokened,
        )

    def _mcp_views(self, routes: Iterable[RouteConfig], store: Store) -> dict[str, McpView]:
        """The JSON-RPC view of each ``protocol: mcp`` route. The MCP modules are imported
        only if a route speaks MCP: the SDK's types are most of the objects a proxy holds
        otherwise (start-up memory, and more for the collector to go through)."""
        mcp = [r for r in routes if r.protocol is RouteProtocol.MCP]
        if not mcp:
            return {}
        from proxy.mcp import McpView
        from proxy.mcp_tools import SharedTools

        return {
            r.name: McpView(r, self.guards.get(r.name), SharedTools(store, r.name, self.log))
            for r in mcp
        }

    def _mcp_tasks(self) -> dict[str, McpTasks]:
        """The proxy's own MCP tasks, on each ``protocol: mcp`` route with jobs."""
        if not any(name in self.jobs for name in self.mcp):
            return {}
        from proxy.mcp_tasks import Followers, McpTasks

        followers = Followers(self.store, self.log)
        tasks = {
            name: McpTasks(view, self.jobs[name], followers)
            for name, view in self.mcp.items()
            if name in self.jobs
        }
        for name, made in tasks.items():
            self.mcp[name].tasks = made
        return tasks

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """ASGI entry for every proxied request; logs one ``request`` event."""
        started = time.perf_counter()
        trace = Trace()
        if self.tracing is not None:
            self.tracing.server(scope, trace)
        try:
            response = await self._dispatch(Incoming.of(scope, receive), trace)
        except CallerLeft as exc:
            self._log(scope, trace, exc.status, time.perf_counter() - started)
            return
        except ProxyError as exc:
            if trace.key is not None:
                trace.outcome = _ERROR_OUTCOMES.get(type(exc), Outcome.REJECTED)
            trace.problem = exc.type
            response = problem_response(exc)
        except Exception:
            self.log.exception("unexpected_error", path=scope["path"])
            response = internal_error_response()
        seconds = time.perf_counter() - started
        if self.tracing is not None:
            self.tracing.answered(trace, response)
        try:
            await response(scope, receive, send)
        finally:  # after the response: the caller does not wait for the bookkeeping
            self._log(scope, trace, response.status_code, seconds)

    def _log(self, scope: Scope, trace: Trace, status: int, seconds: float) -> None:
        """The request event and its metrics (and the end of its span)."""
        tracing = self.tracing if trace.span is not None else None
        self.request_log.write(
            scope["method"],
            scope["path"],
            trace.route,
            trace.key,
            trace.outcome.value,
            status,
            round(seconds * 1000, 3),
            None if tracing is None else tracing.log_fields(trace),  # the line names its trace
        )
        self.metrics.observe(trace.route or "", trace.outcome.value, status, seconds)
        if tracing is not None:
            tracing.finish(trace, status)

    async def _dispatch(self, request: Incoming, trace: Trace) -> Response:
        scope = request.scope
        if self.listener is not None:
            self.listener.check(request.header(b"host"), request.header(b"origin"))
        if request.method in NEVER_FORWARDED:
            raise MethodNotImplemented(f"{request.method} is never forwarded by this proxy")
        if ABSOLUTE_FORM in scope.get("extensions", {}):
            raise InvalidPath(
                "absolute-form request targets are refused: this is not a forward proxy"
            )
        path = scope["path"]
        check_path(path, _raw_path(scope))
        route = self.router.match(path)
        trace.route = route.name
        if self.tracing is not None:
            self.tracing.routed(trace.span, route, request.method)
        principal, identity = ("", "") if route.auth is None else await self.caller(request, route)
        handling = self.handling[route.name]
        view = handling.view
        if view is not None:  # JSON-RPC: guard tools/call, pass the rest through (mcp.py)
            exchange = McpExchange(self, request, route, principal, identity, trace)
            handled = await view.handle(request, exchange, principal)
            trace.outcome, trace.key = handled.outcome, handled.key
            if exchange.cached and handled.outcome is Outcome.EXECUTED:
                trace.outcome = Outcome.CACHED
            return exchange.decorate(handled.response)
        guard = handling.guard
        if guard is not None and not guard.guards(request.method):
            guard = None
        if guard is None and handling.plain:
            trace.outcome = Outcome.PASSED
            return await self.pass_through(request, route)
        # read whole: to hash it, or to send it again after a 401 with a new token
        body = await read_body(request, self.max_body)
        op = None
        if guard is not None:
            op = identify(
                route.name,
                guard.policy,
                request.header(b"idempotency-key"),
                body,
                request.header(b"content-type"),
                principal,
                _target(scope),
                max_depth=self.max_json_depth,
            )
        if op is not None and handling.jobs is not None:  # a long call: 202, then workers
            how = asked(route.async_, prefer(scope))  # type: ignore[arg-type]
            if how is not None:
                trace.key = op.label
                answer = await handling.jobs.submit(op, request, body, principal, identity, how)
                if answer is not None:
                    trace.outcome = Outcome.ACCEPTED
                    return answer
        if guard is None or op is None:
            trace.outcome = Outcome.PASSED
            send, context = self._forward(request, route, body, principal, identity, None)
            response = await self.relay(request, await send())
            return response if context is None else Chain.decorate(context, response)
        trace.key = op.label
        lookup = None if route.reconcile is None else self.lookup(request, route, identity)
        claimed = await guard.claim(op, lookup)
        if not isinstance(claimed, Lease):  # a replay: no send, so no policy, was built
            trace.outcome = Outcome.REPLAYED
            return claimed
        # the send, built now that the key is claimed, checks the lease itself (its fence)
        send, context = self._forward(request, route, body, principal, identity, claimed)
        response, trace.outcome = await guard.execute(claimed, send)
        if context is None:
            return response
        if context.cached and trace.outcome is Outcome.EXECUTED:
            trace.outcome = Outcome.CACHED
        return Chain.decorate(context, response)

    def _forward(
        self,
        request: Incoming,
        route: RouteConfig,
        body: bytes,
        principal: str,
        identity: str,
        fence: Leased | None,
    ) -> tuple[Forward, Context | None]:
        """The send of a request whose body is read, inside the route's policies (the
        context they share)."""
        forward = self.sender(request, route, body, identity, fence)
        chain = self.chains.get(route.name)
        if chain is None:
            return forward, None
        context = Context(route, request, body, principal, identity, fence=fence)  # after a claim
        if self.tracing is not None:
            return self.tracing.wrap(chain, context, forward), context
        return chain.wrap(context, forward), context

    def forwarder(
        self,
        request: Incoming,
        route: RouteConfig,
        body: bytes,
        principal: str,
        identity: str,
        fence: Fence,
    ) -> Forward:
        """A job's send (``jobs.Forwarder``): a guarded call's, as if it came now (on an
        MCP route, its answer read as a guarded call's)."""
        forward = self._forward(request, route, body, principal, identity, fence)[0]
        tasks = self.mcp_tasks.get(route.name)
        return forward if tasks is None else tasks.deferred(forward, request, body, principal)

    def sender(
        self,
        request: Incoming,
        route: RouteConfig,
        body: bytes,
        identity: str,
        fence: Leased | None,
    ) -> Forward:
        """The innermost send, which every policy wraps: with the route's downstream
        token, and, for a guarded call (``fence``: its lease, or a ``Fence`` armed with it),
        checked by its fence right before each request is written (``fence.py``), never
        sent twice by the client."""
        if self.tokens is not None and self.tokens.applies(route.name):
            return lambda: self._send_with_token(request, route, body, identity, fence)
        return lambda: self.send(request, route, body, fence=fence)

    def lookup(self, request: Incoming, route: RouteConfig, identity: str) -> Lookup:
        """The route's reconcile look-up for this caller: its Idempotency-Key and its
        credentials (or the route's downstream token), nothing of its body."""

        async def lookup(method: str, target: str, seconds: float) -> UpstreamResponse:
            headers = [("Idempotency-Key", request.header(b"idempotency-key") or "")]
            authorization = request.header(b"authorization")
            if self.tokens is not None and self.tokens.applies(route.name):
                subject = bearer_token(authorization)
                token = await self.tokens.token(route.name, identity, subject)
                authorization = f"Bearer {token}"
            if authorization:
                headers.append(("Authorization", authorization))
            url = route.upstream + target
            return await self.upstream.send(method, url, headers, b"", seconds, at_most_once=True)

        return lookup

    async def _send_with_token(
        self,
        request: Incoming,
        route: RouteConfig,
        body: bytes,
        identity: str,
        fence: Leased | None,
    ) -> UpstreamResponse:
        """Send with the route's downstream token. On a 401 the token is dropped (the next
        call gets a new one); with ``token.retry_on_401`` this call is sent once more with
        a new token (which takes a 401 to mean that the tool did nothing)."""
        assert self.tokens is not None and route.token is not None
        subject = bearer_token(request.header(b"authorization"))
        token = await self._token(route, identity, subject)
        upstream = await self.send(request, route, body, authorization=token, fence=fence)
        if upstream.status != 401:
            return upstream
        self.tokens.drop(route.name, identity, subject, token)
        if not route.token.retry_on_401:
            return upstream  # the tool's answer, recorded like any other
        await upstream.read()
        token = await self._token(route, identity, subject)
        return await self.send(request, route, body, authorization=token, fence=fence)

    def _token(self, route: RouteConfig, identity: str, subject: str | None) -> Awaitable[str]:
        """The route's downstream token for this caller (cached, or fetched now)."""
        assert self.tokens is not None
        fetch = self.tokens.token(route.name, identity, subject)
        return fetch if self.tracing is None else self.tracing.timed("token fetch", fetch)

    async def caller(self, request: Incoming, route: RouteConfig) -> tuple[str, str]:
        """The caller's principal and identity digests (both "" when no token is sent and
        none is required): records are scoped by the first, downstream tokens by the second.

        On a route that opted in to refresh tokens, a genuine but expired caller token
        still passes while the proxy holds a refresh token for that caller.
        """
        assert route.auth is not None
        if self.auth is None:
            return "", ""
        refreshes = self.tokens is not None and self.tokens.refreshes(route.name)
        caller = await self.auth.caller(
            request.header(b"authorization"), route.auth.required, allow_expired=refreshes
        )
        if caller is None:
            return "", ""
        if caller.expired and not (
            self.tokens is not None
            and await self.tokens.can_refresh(
                route.name, caller.identity, bearer_token(request.header(b"authorization"))
            )
        ):
            raise Unauthorized("the token has expired")
        return caller.principal, caller.identity

    def send(
        self,
        request: Incoming,
        route: RouteConfig,
        body: bytes | AsyncIterator[bytes],
        length: int | None = None,
        authorization: str | None = None,
        *,
        fence: Leased | None = None,
    ) -> Awaitable[UpstreamResponse]:
        """The upstream exchange (not a coroutine itself: one frame less per await); a
        guarded call's only if its ``fence`` lets it, and never sent twice by the client."""
        within = None
        if fence is not None:  # after every wait of the policies: the lease is still ours,
            within = fence.check()  # and a connection not had while it lasts is none
        scope = request.scope
        client = scope.get("client")
        headers = request_headers(
            scope["headers"],
            client[0] if client else None,
            scope["scheme"],
            length=length,
            authorization=authorization,
        )
        url = upstream_url(route, _raw_path(scope), scope["query_string"])
        if self.tracing is not None:
            once = fence is not None
            return self.tracing.send(
                self.upstream, route, request.method, url, headers, body, once, within
            )
        return self.upstream.send(
            request.method,
            url,
            headers,
            body,
            route.timeout,
            at_most_once=fence is not None,
            connect_within=within,
        )

    async def pass_through(self, request: Incoming, route: RouteConfig) -> Response:
        declared = request.header(b"content-length")
        if declared is None or (length := whole(declared)) is None or length <= SMALL_BODY_BYTES:
            body = await read_body(request, self.max_body)
            return await self.relay(request, await self.send(request, route, body))
        if length > self.max_body:
            raise RequestTooLarge(f"the body is {length} bytes; the limit is {self.max_body}")
        upstream = await self.send(request, route, request.chunks(), length)
        return await self.relay(request, upstream)

    async def relay(self, request: Incoming, upstream: UpstreamResponse) -> Response:
        head = request.method == "HEAD"
        if head or (upstream.length is not None and upstream.length <= SMALL_BODY_BYTES):
            return _respond(upstream, await upstream.read(), head)
        response = StreamingResponse(upstream.stream(), upstream.status)
        length = (
            [] if upstream.length is None else [(b"content-length", str(upstream.length).encode())]
        )
        response.raw_headers = [*upstream.headers, *length]
        return response

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(self, request: Request) -> Response:
        try:
            async with asyncio.timeout(READY_TIMEOUT_SECONDS):
                await self.store.ping()
        except TimeoutError:
            raise StoreUnavailable("the store did not answer in time") from None
        return JSONResponse({"status": "ready"})


class McpExchange:
    """The proxy's side of one request on a ``protocol: mcp`` route (``mcp.Exchange``):
    the same tokens, policies and upstream as an HTTP route's requests."""

    def __init__(
        self,
        proxy: Proxy,
        request: Incoming,
        route: RouteConfig,
        principal: str,
        identity: str,
        trace: Trace,
    ) -> None:
        self.proxy = proxy
        self.trace = trace
        self.request = request
        self.route = route
        self.principal = principal
        self.identity = identity
        self.context: Context | None = None

    def read(self) -> Awaitable[bytes]:
        read = read_body(self.request, self.proxy.max_body)
        tracing = self.proxy.tracing
        return read if tracing is None else tracing.read_mcp(read, self.request, self.trace)

    def forward(
        self,
        body: bytes,
        *,
        fence: Fence | None = None,
        policies: bool = False,
        call: Call | None = None,
    ) -> Awaitable[UpstreamResponse]:
        proxy, request, route = self.proxy, self.request, self.route
        send = proxy.sender(request, route, body, self.identity, fence)
        chain = proxy.chains.get(route.name) if policies else None
        if chain is None:  # initialize, tools/list, notifications, streams: no policy
            return send()
        self.context = Context(
            route, request, body, self.principal, self.identity, call=call, fence=fence
        )
        if proxy.tracing is not None:
            return proxy.tracing.wrap(chain, self.context, send)()
        return chain.wrap(self.context, send)()

    def relay(self, upstream: UpstreamResponse) -> Awaitable[Response]:
        return self.proxy.relay(self.request, upstream)

    async def pass_through(self, route: RouteConfig) -> Response:
        proxy, name = self.proxy, route.name
        self.route = route  # a GET stream's: the same route with a longer timeout
        if proxy.tokens is None or not proxy.tokens.applies(name):
            return await proxy.pass_through(self.request, route)
        return await self.relay(await self.forward(await self.read()))

    def lookup(self) -> Lookup | None:
        if self.route.reconcile is None:
            return None
        return self.proxy.lookup(self.request, self.route, self.identity)

    @property
    def cached(self) -> bool:
        """True if the cache answered the call (the tool not called for it)."""
        return self.context is not None and self.context.cached

    def decorate(self, response: Response) -> Response:
        return response if self.context is None else Chain.decorate(self.context, response)


async def _flush_logs_forever() -> None:
    while True:
        await asyncio.sleep(logs.FLUSH_INTERVAL_SECONDS)
        logs.flush()


async def _sweep_forever(store: Store, log: Any) -> None:
    while True:
        await asyncio.sleep(SWEEP_INTERVAL_SECONDS)
        try:
            swept = await store.sweep()
        except StoreUnavailable as exc:
            log.warning("sweep_failed", error=exc.detail)
            continue
        if swept:
            log.info("swept", records=swept)


async def _sweep_objects_forever(offload: Offload, log: Any) -> None:
    while True:
        await asyncio.sleep(OBJECT_SWEEP_INTERVAL_SECONDS)
        try:
            swept = await offload.sweep()
        except OffloadUnavailable as exc:
            log.warning("object_sweep_failed", error=exc.detail)
            continue
        if swept:
            log.info("objects_swept", objects=swept)


class App:
    """The ASGI application.

    Proxied requests go straight to ``Proxy`` (the hot path: no router, no middleware);
    the proxy's own endpoints under ``/_proxy/`` and the lifespan go through a small
    Starlette app. Both turn errors into responses with ``problems.py``.
    """

    def __init__(self, proxy: Proxy, admin: Starlette) -> None:
        self.proxy = proxy
        self.admin = admin

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.admin(scope, receive, send)
        elif not scope["path"].startswith(ADMIN_PREFIX):
            await self.proxy(scope, receive, send)
        elif (listener := self.proxy.listener) is None or scope["path"] in PROBES:
            await self.admin(scope, receive, send)
        else:
            await self._checked(listener, scope, receive, send)

    async def _checked(
        self, listener: Listener, scope: Scope, receive: Receive, send: Send
    ) -> None:
        """An endpoint under ``/_proxy/`` (not a probe) once its Host and Origin pass."""
        try:
            listener.check_headers(scope["headers"])
        except ProxyError as exc:
            await problem_response(exc)(scope, receive, send)
            return
        await self.admin(scope, receive, send)


def call_seconds(route: RouteConfig) -> float:
    """The longest a call of ``route`` can take, from its arrival to its conclusion: the
    wait for a duplicate (conflict_wait), the claim, the token fetches and sends (two of
    each with ``token.retry_on_401``), the reconcile look-ups (at the failure, or on a
    retry and then the execution after its ``not_found``), the wait of a cache miss for
    an identical call, and the recording."""
    seconds = route.send_seconds() + route.cache_wait()
    if route.idempotency is not None:
        seconds += route.idempotency.conflict_wait + 2 * STORE_OPERATION_SECONDS
    if route.reconcile is not None:  # a retry's look-up, then the whole call; or one at failure
        seconds += route.reconcile.timeout + route.timeout + STORE_OPERATION_SECONDS
    return seconds


def shutdown_seconds(config: Config) -> float:
    """How long a graceful shutdown waits for requests in flight, and then for the
    conclusions and recordings that outlive their requests."""
    return max(call_seconds(r) for r in config.routes) + SHUTDOWN_GRACE_SECONDS


def create_app(
    config: Config, *, store: Store | None = None, tracing: Tracing | None = None
) -> App:
    """The ASGI application for ``config``; ``store`` overrides ``config.store.url``;
    ``tracing`` (``tracing.from_env``) makes spans, None: none."""
    tasks = TaskSet(logs.get_logger())
    upstream = Upstream()
    proxy = Proxy(
        config,
        store or make_store(config.store.url, config.store.durable()),
        upstream,
        tasks,
        tracing,
    )
    drain_seconds = shutdown_seconds(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await proxy.store.open()
        await upstream.start()
        chores = [
            asyncio.create_task(_sweep_forever(proxy.store, proxy.log)),
            asyncio.create_task(_flush_logs_forever()),
        ]
        journaling = None
        if proxy.journal is not None:
            proxy.journal.open()
            journaling = asyncio.create_task(proxy.journal.run_forever())
        if proxy.offload is not None and proxy.offload.sweeps:
            chores.append(asyncio.create_task(_sweep_objects_forever(proxy.offload, proxy.log)))
        for jobs in proxy.jobs.values():
            jobs.start()
        gc.collect()
        gc.freeze()  # start-up objects leave the collector's view: shorter pauses (p99)
        gc.set_threshold(YOUNG_COLLECTION_THRESHOLD, *gc.get_threshold()[1:])
        proxy.log.info(
            "started",
            routes=[r.name for r in config.routes],
            store=config.store.url.split("://", 1)[0],
        )
        try:
            yield
        finally:
            for chore in chores:
                chore.cancel()
            # workers take no more jobs; running ones finish (queued ones stay queued)
            await asyncio.gather(*(jobs.stop(drain_seconds) for jobs in proxy.jobs.values()))
            if proxy.hub is not None:
                proxy.hub.close()
            # uvicorn has waited for the requests, and cancelled those still running: their
            # calls conclude now (a cancelled one records FAILED), before the store closes.
            if not await tasks.drain(drain_seconds):
                proxy.log.critical("shutdown_with_calls_in_flight", calls=len(tasks))
            if journaling is not None:  # it ran through the drain; one last try, then what
                journaling.cancel()  # is left waits for the next start on this state_dir
            if proxy.journal is not None:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(STORE_OPERATION_SECONDS):
                        await proxy.journal.flush()
                proxy.journal.close()
            await upstream.close()
            await proxy.store.close()
            if proxy.auth is not None:
                await proxy.auth.close()
            if proxy.tokens is not None:
                await proxy.tokens.close()
            if tracing is not None:  # the spans still buffered are exported
                await asyncio.to_thread(tracing.shutdown)
            logs.flush()

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        proxy.log.exception("unexpected_error", path=request.url.path)
        return internal_error_response()

    admin = Starlette(
        routes=[
            Route(f"{ADMIN_PREFIX}healthz", proxy.healthz, methods=["GET", "HEAD"]),
            Route(f"{ADMIN_PREFIX}readyz", proxy.readyz, methods=["GET", "HEAD"]),
            Route(f"{ADMIN_PREFIX}metrics", proxy.metrics.endpoint, methods=["GET"]),
            *record_routes(config, proxy.store, proxy.auth, proxy.log, ADMIN_PREFIX),
            *operation_routes(
                proxy.jobs,
                proxy.queue,
                proxy.hub,
                proxy.caller,
                None if config.admin is None else AdminAuth(config.admin, proxy.auth),
            ),
            *console_routes(
                config,
                proxy.store,
                proxy.auth,
                proxy.log,
                proxy.jobs,
                proxy.queue,
                proxy.hub,
                proxy.caller,
                proxy.offload,
            ),
        ],
        lifespan=lifespan,
        exception_handlers={
            ProxyError: handle_proxy_error,
            HTTPException: handle_http_exception,
            Exception: on_unexpected,
        },
    )
    # '/_proxy/healthz/' is a 404, not a redirect to a Location built from the Host header
    admin.router.redirect_slashes = False
    return App(proxy, admin)


def app_from_env() -> App:
    """uvicorn factory: the configuration from ``TOOL_PROXY_CONFIG`` (and env overrides)."""
    logs.configure(os.environ.get(logs.ENV_LOG_LEVEL, "info"))
    config = load_config()
    return create_app(config, tracing=tracing_from_env(os.environ))
