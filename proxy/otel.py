"""The spans of a request, made with the OpenTelemetry SDK (imported only when tracing is
configured: ``tracing.from_env``).

One trace per call, from the agent's context (``traceparent`` in the headers, or on MCP
routes in ``params._meta``) to the tool's::

    SERVER  POST /tools/charge              route, outcome, plan/step, problem type
      SERVER  tools/call charge             MCP routes: mcp.*, gen_ai.*, jsonrpc.*
        INTERNAL  policy lock | limits ...  the time a policy took before it let the call go
        INTERNAL  token fetch               the route's downstream token
        CLIENT    POST                      the request to the tool, its traceparent sent
    CONSUMER  job review                    a long call's run, child of (and linked to)
      CLIENT    POST                        the request that submitted it

The spans are written by hand rather than by the ASGI and aiohttp instrumentations: the
attributes the operator asks for (outcome, key, problem type) are known only inside the
proxy's own code, the hot path has no middleware to hang them on, and one span per
request costs less than the ASGI middleware's three (docs/tracing.md).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from importlib import metadata
from typing import TYPE_CHECKING, Any, TypeVar

from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.responses import Response

from proxy.asgi import Incoming, RawHeaders, Reply
from proxy.config import RouteConfig, RouteProtocol
from proxy.errors import ProxyError
from proxy.forwarding import Upstream, UpstreamResponse
from proxy.idempotency import OWNERS
from proxy.keys import parse_composite
from proxy.tracing import CURRENT, ENV_TRACE_KEYS

if TYPE_CHECKING:
    from proxy.app import Trace
    from proxy.policies import Chain, Context, Forward

T = TypeVar("T")

SERVICE = "tool-proxy"
# The W3C trace context fields: taken from the caller, replaced by the proxy's own.
CONTEXT_FIELDS = frozenset({"traceparent", "tracestate"})
_CONTEXT_BYTES = frozenset(name.encode() for name in CONTEXT_FIELDS)
# The MCP conventions' attributes that Streamable HTTP carries in headers.
_MCP_HEADERS = {
    b"mcp-session-id": "mcp.session.id",
    b"mcp-protocol-version": "mcp.protocol.version",
}
# A problem type in an answer the proxy made (a problem document, or a JSON-RPC error's
# data); only this much of the body is looked at.
_PROBLEM = re.compile(rb"urn:tool-proxy:problem:([a-z0-9-]+)")
PROBLEM_SCAN_BYTES = 4096
# HTTP/protobuf is the default of the OTLP specification (OTEL_EXPORTER_OTLP_PROTOCOL).
DEFAULT_PROTOCOL = "http/protobuf"
# The store calls of guarded requests that get spans (``Tracing.trace_store``).
STORE_OPERATIONS = ("claim", "renew", "complete", "release", "get")
# ``db.system.name`` of each store URL's scheme (OpenTelemetry's database conventions).
_STORE_SYSTEMS = {
    "redis": "redis",
    "rediss": "redis",
    "sqlite": "sqlite",
    "postgresql": "postgresql",
    "postgres": "postgresql",
    "memory": "memory",
}


def _version() -> str:
    try:
        return metadata.version(SERVICE)
    except metadata.PackageNotFoundError:
        return "0"


def _exporter(env: Mapping[str, str], kind: str) -> SpanExporter:
    """The exporter OTEL_TRACES_EXPORTER and OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL name; the
    OTLP exporters read their endpoint, headers and timeout from the environment."""
    if kind == "console":
        return ConsoleSpanExporter()
    protocol = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or DEFAULT_PROTOCOL
    )
    if protocol.strip().lower() == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        return GrpcExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def resource() -> Resource:
    """OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME, with ``service.name`` tool-proxy
    when neither names the service."""
    found = Resource.create({"service.version": _version()})
    if str(found.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        found = found.merge(Resource({SERVICE_NAME: SERVICE}))
    return found


def _now() -> int:
    return time.time_ns()


async def _timed_event(span: Span, name: str, system: str, operation: str, work: Awaitable[T]) -> T:
    """``work`` as an event of ``span`` at its start, with its duration (and its error)."""
    started = _now()
    attributes: dict[str, str | float] = {"db.system.name": system, "db.operation.name": operation}
    try:
        return await work
    except BaseException as exc:
        attributes["error.type"] = type(exc).__name__
        raise
    finally:
        attributes["tool_proxy.store_ms"] = round((_now() - started) / 1e6, 3)
        span.add_event(name, attributes, timestamp=started)


def _headers(raw: RawHeaders) -> dict[str, str]:
    """The trace context fields among ASGI headers (names lower-case)."""
    return {k.decode(): v.decode("latin-1") for k, v in raw if k in _CONTEXT_BYTES}


def _plan_attributes(span: Span, label: str, full: bool) -> None:
    """A composite key's plan session id and step (the whole key only if ``full``)."""
    if full:
        span.set_attribute("tool_proxy.idempotency_key", label)
    try:
        key = parse_composite(label)
    except ProxyError:
        return
    span.set_attribute("tool_proxy.plan.session_id", key.plan)
    span.set_attribute("tool_proxy.plan.step", key.step)


def problem_in(response: Response) -> str | None:
    """The problem type of an answer the proxy made whole (HTTP problem documents, MCP
    JSON-RPC errors), if it carries one."""
    if not isinstance(response, Reply):
        return None
    found = _PROBLEM.search(response.body[:PROBLEM_SCAN_BYTES])
    return None if found is None else found.group(0).decode()


def with_meta(body: bytes, carrier: Mapping[str, str]) -> bytes:
    """A JSON-RPC message with ``params._meta`` carrying ``carrier`` (the MCP trace
    context convention); other bodies as they are."""
    try:
        message = json.loads(body)
    except ValueError:
        return body
    if not isinstance(message, dict) or not isinstance(message.get("method"), str):
        return body
    params = message.get("params")
    if not isinstance(params, dict):
        return body
    meta = params.setdefault("_meta", {})
    if not isinstance(meta, dict):
        return body
    for name in CONTEXT_FIELDS:
        meta.pop(name, None)
    meta.update(carrier)
    return json.dumps(message, separators=(",", ":"), ensure_ascii=False).encode()


class Tracing:
    """The spans of one application (``create_app``), from one tracer provider."""

    def __init__(self, provider: TracerProvider, *, full_keys: bool = False) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("tool_proxy", _version())
        self.propagator = TraceContextTextMapPropagator()
        self.full_keys = full_keys

    @classmethod
    def from_env(cls, env: Mapping[str, str], exporter: str = "otlp") -> Tracing:
        """A batch exporter (OTEL_BSP_*) to ``exporter``; the sampler is OTEL_TRACES_SAMPLER
        (default: parentbased_always_on), read by the SDK."""
        provider = TracerProvider(resource=resource())
        provider.add_span_processor(BatchSpanProcessor(_exporter(env, exporter)))
        return cls(provider, full_keys=env.get(ENV_TRACE_KEYS, "").lower() == "full")

    def shutdown(self) -> None:
        """Export what is buffered, then stop."""
        self.provider.shutdown()

    # -- the request -------------------------------------------------------------------

    def server(self, scope: Mapping[str, Any], trace_: Trace) -> None:
        """Start the request's span, a child of the caller's ``traceparent``."""
        parent = self.propagator.extract(_headers(scope["headers"]))
        client = scope.get("client")
        attributes: dict[str, str | int] = {
            "http.request.method": scope["method"],
            "url.path": scope["path"],
            "url.scheme": scope["scheme"],
            "network.protocol.version": scope.get("http_version", "1.1"),
            "tool_proxy.replica": OWNERS.prefix.rstrip("."),
        }
        if client:
            attributes["client.address"] = client[0]
        span = self.tracer.start_span(
            scope["method"], context=parent, kind=SpanKind.SERVER, attributes=attributes
        )
        trace_.span = span
        trace_.token = CURRENT.set(span)

    def routed(self, span: Span, route: RouteConfig, method: str) -> None:
        span.update_name(f"{method} {route.path_prefix}")
        span.set_attribute("http.route", route.path_prefix)
        span.set_attribute("tool_proxy.route", route.name)

    def answered(self, trace_: Trace, response: Response) -> None:
        if trace_.problem is None and (response.status_code >= 400 or trace_.mcp is not None):
            trace_.problem = problem_in(response)

    def log_fields(self, trace_: Trace) -> dict[str, str]:
        context = trace_.span.get_span_context()
        return {
            "trace_id": format(context.trace_id, "032x"),
            "span_id": format(context.span_id, "016x"),
        }

    def finish(self, trace_: Trace, status: int) -> None:
        """End the request's spans with what the request log says of it."""
        span: Span = trace_.span
        CURRENT.reset(trace_.token)
        if trace_.mcp is not None:
            self._outcome(trace_.mcp, trace_)
            trace_.mcp.end()
        self._outcome(span, trace_)
        span.set_attribute("http.response.status_code", status)
        if status >= 500:
            span.set_attribute("error.type", trace_.problem or str(status))
            span.set_status(Status(StatusCode.ERROR))
        span.end()

    def _outcome(self, span: Span, trace_: Trace) -> None:
        span.set_attribute("tool_proxy.outcome", trace_.outcome.value)
        if trace_.key is not None:
            _plan_attributes(span, trace_.key, self.full_keys)
        if trace_.problem is not None:
            span.set_attribute("tool_proxy.problem.type", trace_.problem)

    # -- MCP ---------------------------------------------------------------------------

    async def read_mcp(self, read: Awaitable[bytes], request: Incoming, trace_: Trace) -> bytes:
        """The body of a POST on an MCP route, and the MCP server span of its JSON-RPC
        message: a child of ``params._meta``'s context when the client sent one there (the
        HTTP span linked), else of the HTTP span."""
        body = await read
        try:
            message = json.loads(body)
        except ValueError:
            return body
        if not isinstance(message, dict) or not isinstance(message.get("method"), str):
            return body
        method: str = message["method"]
        params = message.get("params")
        params = params if isinstance(params, dict) else {}
        meta = params.get("_meta")
        http: Span = trace_.span
        links = []
        parent = trace.set_span_in_context(http)
        if isinstance(meta, dict) and isinstance(meta.get("traceparent"), str):
            carrier = {k: meta[k] for k in CONTEXT_FIELDS if isinstance(meta.get(k), str)}
            parent = self.propagator.extract(carrier)
            links.append(Link(http.get_span_context(), {"tool_proxy.link": "http"}))
        attributes: dict[str, str] = {
            "mcp.method.name": method,
            "network.transport": "tcp",
            "network.protocol.name": "http",
        }
        name = method
        if "id" in message:
            attributes["jsonrpc.request.id"] = str(message["id"])
        tool = params.get("name")
        if method == "tools/call" and isinstance(tool, str):
            attributes["gen_ai.tool.name"] = tool
            attributes["gen_ai.operation.name"] = "execute_tool"
            name = f"{method} {tool}"
        for field, value in request.scope["headers"]:
            if field in _MCP_HEADERS:
                attributes[_MCP_HEADERS[field]] = value.decode("latin-1")
        span = self.tracer.start_span(
            name, context=parent, kind=SpanKind.SERVER, attributes=attributes, links=links
        )
        trace_.mcp = span
        CURRENT.set(span)  # reset with the HTTP span's token at the end (``finish``)
        return body

    # -- around the send ---------------------------------------------------------------

    def wrap(self, chain: Chain, context: Context, forward: Forward) -> Forward:
        """``chain.wrap`` with a span per policy: from when the policy starts to when it
        lets the call go (its wait), or to its own answer or refusal."""
        for policy in reversed(chain.policies):
            forward = self._timed(type(policy).__name__.lower(), policy.wrap, context, forward)
        return forward

    def _timed(self, name: str, wrap: Any, context: Context, inner: Forward) -> Forward:
        async def run() -> UpstreamResponse:
            started = _now()
            parent = trace.set_span_in_context(CURRENT.get() or trace.INVALID_SPAN)
            let_go: list[bool] = []

            def policy_span(end: int, sent: bool, exc: BaseException | None = None) -> None:
                span = self.tracer.start_span(
                    f"policy {name}",
                    context=parent,
                    start_time=started,
                    attributes={"tool_proxy.policy": name, "tool_proxy.policy.sent": sent},
                )
                span.set_attribute("tool_proxy.wait_ms", round((end - started) / 1e6, 3))
                if isinstance(exc, ProxyError):
                    span.set_attribute("tool_proxy.problem.type", exc.type)
                    span.set_status(Status(StatusCode.ERROR, exc.slug))
                span.end(end_time=end)

            async def reached() -> UpstreamResponse:
                let_go.append(True)
                policy_span(_now(), True)
                return await inner()

            try:
                answer: UpstreamResponse = await wrap(context, reached)()
            except BaseException as exc:
                if not let_go:
                    policy_span(_now(), False, exc)
                raise
            if not let_go:  # answered by the policy itself (a cache hit)
                policy_span(_now(), False)
            return answer

        return run

    def trace_store(self, store: object, url: str) -> None:
        """The round trips of guarded calls to ``store`` (claim, renew, complete, release,
        get) as events of their request's span, each with its duration: the store's own
        time, apart from the tool's. Events, not spans: a span costs the SDK several
        times more (docs/tracing.md#overhead). Calls made outside a request (renewals in
        the background, sweeps, jobs' chores) make none."""
        system = _STORE_SYSTEMS.get(url.split("://", 1)[0].split("+", 1)[0], "other")
        for operation in STORE_OPERATIONS:
            call = getattr(store, operation)
            setattr(store, operation, self._store_call(system, operation, call))

    def _store_call(
        self, system: str, operation: str, call: Callable[..., Awaitable[T]]
    ) -> Callable[..., Awaitable[T]]:
        name = f"store {operation}"

        def traced(*args: Any, **kwargs: Any) -> Awaitable[T]:
            request = CURRENT.get()
            if request is None or not request.is_recording():
                return call(*args, **kwargs)
            return _timed_event(request, name, system, operation, call(*args, **kwargs))

        return traced

    async def timed(self, name: str, work: Awaitable[T]) -> T:
        """``work`` in a span of its own (e.g. a token fetch)."""
        parent = trace.set_span_in_context(CURRENT.get() or trace.INVALID_SPAN)
        with self.tracer.start_as_current_span(name, context=parent, end_on_exit=True):
            return await work

    async def send(
        self,
        upstream: Upstream,
        route: RouteConfig,
        method: str,
        url: str,
        headers: list[tuple[str, str]],
        body: bytes | AsyncIterator[bytes],
        at_most_once: bool,
        connect_within: float | None = None,
    ) -> UpstreamResponse:
        """The request to the tool in a client span, whose context the tool gets: in
        ``traceparent``/``tracestate`` (the caller's replaced), and on MCP routes also in
        the JSON-RPC message's ``params._meta``."""
        parent = trace.set_span_in_context(CURRENT.get() or trace.INVALID_SPAN)
        target = url.split("?", 1)[0]
        span = self.tracer.start_span(
            method,
            context=parent,
            kind=SpanKind.CLIENT,
            attributes={
                "http.request.method": method,
                "url.full": target,
                "tool_proxy.route": route.name,
            },
        )
        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, context=trace.set_span_in_context(span))
        headers = [(k, v) for k, v in headers if k.lower() not in CONTEXT_FIELDS]
        headers.extend(carrier.items())
        if route.protocol is RouteProtocol.MCP and isinstance(body, bytes):
            body = with_meta(body, carrier)
        try:
            answer = await upstream.send(
                method,
                url,
                headers,
                body,
                route.timeout,
                at_most_once=at_most_once,
                connect_within=connect_within,
            )
        except ProxyError as exc:
            span.set_attribute("error.type", exc.type)
            span.set_status(Status(StatusCode.ERROR, exc.slug))
            span.end()
            raise
        except BaseException as exc:
            span.set_attribute("error.type", type(exc).__name__)
            span.set_status(Status(StatusCode.ERROR))
            span.end()
            raise
        span.set_attribute("http.response.status_code", answer.status)
        if answer.status >= 500:
            span.set_attribute("error.type", str(answer.status))
            span.set_status(Status(StatusCode.ERROR))
        span.end()
        return answer

    # -- long calls --------------------------------------------------------------------

    def stamp(self, headers: RawHeaders) -> RawHeaders:
        """A job's stored headers with the submitting request's trace context in place of
        the caller's: its worker's span is that request's child, on whichever replica."""
        span = CURRENT.get()
        if span is None:
            return headers
        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, context=trace.set_span_in_context(span))
        kept = [(k, v) for k, v in headers if k not in _CONTEXT_BYTES]
        return [*kept, *((k.encode(), v.encode()) for k, v in carrier.items())]

    @contextmanager
    def job(
        self, route: RouteConfig, job_id: str, label: str, attempt: int, headers: RawHeaders
    ) -> Iterator[Span]:
        """A job's run, a child of (and linked to) the request that submitted it."""
        parent = self.propagator.extract(_headers(headers))
        submitter = trace.get_current_span(parent).get_span_context()
        links = [Link(submitter, {"tool_proxy.link": "submitter"})] if submitter.is_valid else []
        span = self.tracer.start_span(
            f"job {route.name}",
            context=parent,
            kind=SpanKind.CONSUMER,
            links=links,
            attributes={
                "tool_proxy.route": route.name,
                "tool_proxy.job.id": job_id,
                "tool_proxy.job.attempt": attempt,
                "tool_proxy.replica": OWNERS.prefix.rstrip("."),
            },
        )
        _plan_attributes(span, label, self.full_keys)
        token = CURRENT.set(span)
        try:
            yield span
        except BaseException as exc:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR))
            raise
        finally:
            CURRENT.reset(token)
            span.end()
