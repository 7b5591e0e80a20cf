"""Traces: real ``tool-proxy serve`` processes export over OTLP (HTTP/protobuf, gRPC) to
real receivers that decode the protobuf payloads; real tools record the trace context
they get (headers, and on MCP routes ``params._meta``, through the official SDK)."""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from mcp.server.fastmcp import Context, FastMCP
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from proxy import tracing
from proxy.app import create_app
from proxy.asgi import Reply
from proxy.config import parse_config
from proxy.errors import ConfigError
from proxy.otel import Tracing, problem_in, with_meta
from tests.conftest import SEALING_ENV, new_key, route
from tests.idp import IdentityProvider
from tests.mcp_servers import session
from tests.otlp import GrpcReceiver, HttpReceiver, Span
from tests.servers import CountingTool, ProxyProcess, RedisServer, ThreadServer, wait_for
from tests.test_tokens import SECRET_ENV, token_route

BODY = {"account": "acme", "cents": 42}


def traced_env(endpoint: str, **extra: str) -> dict[str, str]:
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_TRACES_SAMPLER": "always_on",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
        "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=test",
        **extra,
    }


def caller() -> tuple[str, str, str]:
    """A caller's trace id, span id and the ``traceparent`` naming them."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


def post(
    base: str, path: str = "/tools/charge", key: str | None = None, **headers: str
) -> httpx.Response:
    sent = {"content-type": "application/json", **headers}
    if key is not None:
        sent["idempotency-key"] = key
    return httpx.post(base + path, content=json.dumps(BODY), headers=sent, timeout=30)


def one(spans: list[Span], **match: Any) -> Span:
    found = [s for s in spans if all(getattr(s, k) == v for k, v in match.items())]
    assert len(found) == 1, (match, spans)
    return found[0]


def sent(spans: list[Span]) -> Span:
    """The client span of the call sent to the tool."""
    return one(spans, kind="client")


@pytest.fixture(scope="module")
def receiver() -> Iterator[HttpReceiver]:
    server = HttpReceiver().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tool() -> Iterator[CountingTool]:
    counting = CountingTool()
    server = ThreadServer(counting.app).start()
    counting.url = server.url
    yield counting
    server.stop()


@pytest.fixture(scope="module")
def proxy(
    receiver: HttpReceiver, tool: CountingTool, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ProxyProcess]:
    routes = [
        route(tool.url),
        route(tool.url, name="strict", prefix="/strict", required=True),
        {
            **route(tool.url, name="limited", prefix="/limited"),
            "limits": [{"name": "once", "key": "principal", "rate": "1/1h"}],
        },
        {
            **route(tool.url, name="locked", prefix="/locked"),
            "lock": {"key": "json:/account", "ttl": "30s", "wait": "10s"},
        },
    ]
    config = {"store": {"url": "memory://"}, "routes": routes}
    tmp = tmp_path_factory.mktemp("traced")
    process = ProxyProcess(config, tmp, env=traced_env(receiver.endpoint)).start()
    yield process
    process.stop()


def test_a_first_execution_then_its_replay(
    proxy: ProxyProcess, receiver: HttpReceiver, tool: CountingTool
) -> None:
    trace_id, parent, traceparent = caller()
    key = new_key(BODY, step=3, plan="plan-7f3a")
    assert post(proxy.url, key=key, traceparent=traceparent).status_code == 200

    spans = receiver.received.wait(lambda s: s.trace_id == trace_id, count=2)
    server = one(spans, kind="server")
    client = sent(spans)
    assert server.parent_id == parent and client.parent_id == server.span_id
    # the store's round trips, events of the request's span with their durations: the
    # claim before the send, the recorded outcome after the answer
    events = {name: (at, attributes) for name, at, attributes in server.events}
    (claimed, claim), (completed, complete) = events["store claim"], events["store complete"]
    for store in (claim, complete):
        assert store["db.system.name"] == "memory" and store["tool_proxy.store_ms"] >= 0
    assert claim["db.operation.name"] == "claim"
    assert server.start <= claimed <= client.start <= client.end <= completed <= server.end
    assert server.name == "POST /tools"
    attributes = server.attributes
    assert attributes["http.request.method"] == "POST"
    assert attributes["http.route"] == "/tools"
    assert attributes["url.path"] == "/tools/charge"
    assert attributes["http.response.status_code"] == 200
    assert attributes["tool_proxy.route"] == "tool"
    assert attributes["tool_proxy.outcome"] == "executed"
    assert attributes["tool_proxy.plan.session_id"] == "plan-7f3a"
    assert attributes["tool_proxy.plan.step"] == "3"
    assert "tool_proxy.idempotency_key" not in attributes  # only with TOOL_PROXY_TRACE_KEYS
    assert attributes["tool_proxy.replica"]
    assert server.resource["service.name"] == "tool-proxy"
    assert server.resource["deployment.environment"] == "test"
    assert client.attributes["http.response.status_code"] == 200
    assert client.attributes["url.full"] == tool.url + "/tools/charge"
    assert client.start >= server.start and client.end <= server.end
    # the tool got the proxy's client span as its parent, in the caller's trace
    assert tool.requests[-1]["headers"]["traceparent"] == f"00-{trace_id}-{client.span_id}-01"

    # the request log line leads to the trace
    def logged() -> dict[str, Any] | None:
        lines = [e for e in proxy.events() if e.get("event") == "request" and e.get("key") == key]
        return lines[0] if lines else None

    wait_for(lambda: logged() is not None, what="the request log line")
    line = logged()
    assert line is not None
    assert line["trace_id"] == trace_id and line["span_id"] == server.span_id

    replay_trace, replay_parent, replay_traceparent = caller()
    again = post(proxy.url, key=key, traceparent=replay_traceparent)
    assert again.headers["idempotent-replayed"] == "true"
    replayed = receiver.received.wait(lambda s: s.trace_id == replay_trace)
    server = one(replayed, kind="server")
    assert server.parent_id == replay_parent
    assert server.attributes["tool_proxy.outcome"] == "replayed"
    assert server.attributes["tool_proxy.plan.step"] == "3"
    # nothing sent to the tool: the replay's one round trip is the store's claim
    assert not [s for s in receiver.received.trace(replay_trace) if s.kind == "client"]
    assert [name for name, _, _ in server.events] == ["store claim"]
    assert tool.count(key) == 1


def test_a_duplicate_in_flight_is_a_conflict_naming_the_lease_owner(
    proxy: ProxyProcess, receiver: HttpReceiver, tool: CountingTool
) -> None:
    key = new_key(BODY)
    first_trace, _, first_parent = caller()
    path = "/tools/charge?delay=1.5"
    first = threading.Thread(
        target=post, args=(proxy.url, path, key), kwargs={"traceparent": first_parent}
    )
    first.start()
    received = receiver.received
    wait_for(lambda: tool.arrived[key] == 1, what="the first call at the tool")
    trace_id, _, traceparent = caller()
    refused = post(proxy.url, path, key, traceparent=traceparent)
    first.join()
    assert refused.status_code == 409
    server = one(received.wait(lambda s: s.trace_id == trace_id), kind="server")
    assert server.attributes["tool_proxy.outcome"] == "conflict"
    assert (
        server.attributes["tool_proxy.problem.type"] == "urn:tool-proxy:problem:request-in-progress"
    )
    executed = one(received.wait(lambda s: s.trace_id == first_trace and s.kind == "server"))
    assert server.attributes["tool_proxy.lease.owner"] == executed.attributes["tool_proxy.replica"]


def test_refusals_carry_their_problem_type(proxy: ProxyProcess, receiver: HttpReceiver) -> None:
    trace_id, _, traceparent = caller()
    assert post(proxy.url, "/strict/x", traceparent=traceparent).status_code == 400
    server = one(receiver.received.wait(lambda s: s.trace_id == trace_id), kind="server")
    assert server.attributes["tool_proxy.outcome"] == "rejected"
    assert server.attributes["tool_proxy.problem.type"] == (
        "urn:tool-proxy:problem:idempotency-key-missing"
    )

    assert post(proxy.url, "/limited/x", new_key(BODY)).status_code == 200
    trace_id, _, traceparent = caller()
    limited = post(proxy.url, "/limited/x", new_key(BODY), traceparent=traceparent)
    assert limited.status_code == 429
    spans = receiver.received.wait(lambda s: s.trace_id == trace_id, count=2)
    server = one(spans, kind="server")
    assert server.attributes["tool_proxy.outcome"] == "rejected"
    assert server.attributes["tool_proxy.problem.type"] == "urn:tool-proxy:problem:rate-limited"
    policy = one(spans, name="policy limits")
    assert policy.parent_id == server.span_id
    assert policy.attributes["tool_proxy.policy.sent"] is False
    assert policy.attributes["tool_proxy.problem.type"] == "urn:tool-proxy:problem:rate-limited"
    assert not [s for s in spans if s.kind == "client"]


def test_a_lock_wait_is_a_child_span(
    proxy: ProxyProcess, receiver: HttpReceiver, tool: CountingTool
) -> None:
    held = new_key(BODY)
    holder = threading.Thread(target=post, args=(proxy.url, "/locked/x?delay=1", held))
    holder.start()
    wait_for(lambda: tool.arrived[held] == 1, what="the lock holder at the tool")
    trace_id, _, traceparent = caller()
    assert post(proxy.url, "/locked/x", new_key(BODY), traceparent=traceparent).status_code == 200
    holder.join()
    spans = receiver.received.wait(lambda s: s.trace_id == trace_id, count=3)
    server, lock, client = (
        one(spans, kind="server"),
        one(spans, name="policy lock"),
        sent(spans),
    )
    assert lock.parent_id == server.span_id and client.parent_id == server.span_id
    assert lock.attributes["tool_proxy.policy.sent"] is True
    assert lock.attributes["tool_proxy.wait_ms"] > 400
    assert lock.end <= client.start


def test_off_unless_configured(tool: CountingTool, receiver: HttpReceiver, tmp_path: Path) -> None:
    assert not tracing.configured({})
    assert not tracing.configured({"OTEL_SERVICE_NAME": "x"})
    assert not tracing.configured({"OTEL_TRACES_EXPORTER": "none"})
    assert tracing.configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"})
    assert not tracing.configured(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"}
    )
    assert tracing.from_env({}) is None
    with pytest.raises(ConfigError, match="OTEL_TRACES_EXPORTER"):
        tracing.from_env({"OTEL_TRACES_EXPORTER": "zipkin"})

    config = {"store": {"url": "memory://"}, "routes": [route(tool.url)]}
    # everything set up to send spans to the receiver, but the SDK switched off
    env = traced_env(receiver.endpoint, OTEL_SDK_DISABLED="true")
    plain = ProxyProcess(config, tmp_path, env=env).start()
    try:
        trace_id, _, traceparent = caller()
        key = new_key(BODY)
        assert post(plain.url, key=key, traceparent=traceparent).status_code == 200
        # the caller's context passes as it came, as any end-to-end header
        assert tool.requests[-1]["headers"]["traceparent"] == traceparent
        wait_for(lambda: any(e.get("key") == key for e in plain.events()), what="the log line")
        line = next(e for e in plain.events() if e.get("key") == key)
        assert "trace_id" not in line
    finally:
        plain.stop()  # a tracing proxy would flush its spans here
    assert not receiver.received.trace(trace_id)


def test_otlp_over_grpc(tool: CountingTool, tmp_path: Path) -> None:
    grpc_receiver = GrpcReceiver().start()
    env = traced_env(grpc_receiver.endpoint, OTEL_EXPORTER_OTLP_PROTOCOL="grpc")
    config = {"store": {"url": "memory://"}, "routes": [route(tool.url)]}
    process = ProxyProcess(config, tmp_path, env=env).start()
    try:
        trace_id, parent, traceparent = caller()
        assert post(process.url, key=new_key(BODY), traceparent=traceparent).status_code == 200
        spans = grpc_receiver.received.wait(lambda s: s.trace_id == trace_id, count=2)
        assert one(spans, kind="server").parent_id == parent
    finally:
        process.stop()
        grpc_receiver.stop()


# -- MCP -------------------------------------------------------------------------------


class TracedMcpTool:
    """A FastMCP server whose ``charge`` records the trace context each call came with:
    the ``traceparent`` header and ``params._meta``."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        server = FastMCP("billing", json_response=True, log_level="WARNING")

        @server.tool()
        def charge(account: str, cents: int, ctx: Context) -> str:  # type: ignore[type-arg]
            request = ctx.request_context.request
            meta = ctx.request_context.meta
            self.seen.append(
                {
                    "header": request.headers.get("traceparent") if request is not None else None,
                    "meta": meta.model_dump() if meta is not None else {},
                }
            )
            return f"charged {cents} to {account}"

        self.server = ThreadServer(server.streamable_http_app())


def test_an_mcp_tools_call_with_its_meta_context(receiver: HttpReceiver, tmp_path: Path) -> None:
    mcp_tool = TracedMcpTool()
    mcp_tool.server.start()
    config = {
        "store": {"url": "memory://"},
        "routes": [
            {
                "name": "billing",
                "path_prefix": "/mcp",
                "upstream": mcp_tool.server.url,
                "timeout": "10s",
                "protocol": "mcp",
                "mcp": {"guard": "all"},
                "idempotency": {"lock_ttl": "5s", "result_ttl": "1h"},
            }
        ],
    }
    process = ProxyProcess(config, tmp_path, env=traced_env(receiver.endpoint)).start()
    trace_id, parent, traceparent = caller()
    key = new_key(BODY, step=2, plan="plan-mcp")

    async def scenario() -> None:
        async with session(process.url + "/mcp") as client:
            meta = {"idempotencyKey": key, "traceparent": traceparent}
            first = await client.call_tool("charge", BODY, meta=meta)
            again = await client.call_tool("charge", BODY, meta=meta)
            assert first.content == again.content

    try:
        asyncio.run(scenario())
        spans = receiver.received.wait(
            lambda s: s.trace_id == trace_id and s.name == "tools/call charge", count=2
        )
    finally:
        process.stop()
        mcp_tool.server.stop()
    executed = next(s for s in spans if s.attributes["tool_proxy.outcome"] == "executed")
    replayed = next(s for s in spans if s.attributes["tool_proxy.outcome"] == "replayed")
    for span in (executed, replayed):
        assert span.kind == "server" and span.parent_id == parent
        assert span.attributes["mcp.method.name"] == "tools/call"
        assert span.attributes["gen_ai.tool.name"] == "charge"
        assert span.attributes["gen_ai.operation.name"] == "execute_tool"
        assert span.attributes["mcp.session.id"], span.attributes
        assert span.attributes["mcp.protocol.version"]
        assert span.attributes["jsonrpc.request.id"]
        assert span.attributes["tool_proxy.plan.session_id"] == "plan-mcp"
        assert span.attributes["tool_proxy.plan.step"] == "2"
        ((_, http_span_id, _),) = span.links  # the HTTP request's span, in a trace of its own
        http = one(receiver.received.spans, span_id=http_span_id)
        assert http.kind == "server" and http.name == "POST /mcp"
        assert http.trace_id != trace_id
    assert executed.attributes["jsonrpc.request.id"] != replayed.attributes["jsonrpc.request.id"]
    client = sent(receiver.received.trace(trace_id))
    assert client.parent_id == executed.span_id
    (seen,) = mcp_tool.seen  # executed once; both places carry the proxy's client span
    expected = f"00-{trace_id}-{client.span_id}-01"
    assert seen["header"] == expected
    assert seen["meta"]["traceparent"] == expected
    assert seen["meta"]["idempotencyKey"] == key


# -- long calls --------------------------------------------------------------------------


def test_a_long_call_run_on_another_replica_is_linked_to_its_submitter(
    redis_server: RedisServer, receiver: HttpReceiver, tool: CountingTool, tmp_path: Path
) -> None:
    redis_server.flush()
    spec = route(tool.url)
    spec["async"] = {"backoff": "50ms", "backoff_max": "100ms", "visibility": "1s"}
    spec["workers"] = {"concurrency": 1}
    config = {"store": {"url": redis_server.url, "sealing_key_env": SEALING_ENV}, "routes": [spec]}
    env = traced_env(receiver.endpoint)
    a = ProxyProcess(config, tmp_path, env=env).start()
    busy, queued = new_key(BODY, step=1), new_key(BODY, step=2)
    trace_id, _, traceparent = caller()
    async_ = {"prefer": "respond-async"}
    assert post(a.url, "/tools/run?delay=4", busy, **async_).status_code == 202
    wait_for(lambda: tool.arrived[busy] == 1, what="a's worker to be busy")
    accepted = post(a.url, "/tools/run", queued, traceparent=traceparent, **async_)
    assert accepted.status_code == 202
    submitted = one(receiver.received.wait(lambda s: s.trace_id == trace_id and s.kind == "server"))
    assert submitted.attributes["tool_proxy.outcome"] == "accepted"
    a.kill()  # its worker never gets to the queued job

    b = ProxyProcess(config, tmp_path, env=env).start()
    try:
        wait_for(lambda: tool.count(queued) == 1, seconds=20, what="b to run the queued job")
        spans = receiver.received.wait(lambda s: s.trace_id == trace_id, count=3)
    finally:
        b.stop()
    job = one(spans, kind="consumer")
    assert job.name == "job tool"
    assert job.parent_id == submitted.span_id
    assert job.links[0][:2] == (trace_id, submitted.span_id)
    assert job.attributes["tool_proxy.replica"] != submitted.attributes["tool_proxy.replica"]
    assert job.attributes["tool_proxy.outcome"] == "executed"
    assert job.attributes["tool_proxy.plan.step"] == "2"
    client = sent(spans)
    assert client.parent_id == job.span_id
    requests = [r for r in tool.requests if r["headers"].get("idempotency-key") == queued]
    assert requests[-1]["headers"]["traceparent"] == f"00-{trace_id}-{client.span_id}-01"


# -- units ---------------------------------------------------------------------------------


def test_the_meta_context_is_set_in_json_rpc_messages_only() -> None:
    carrier = {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}
    message = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": "x", "_meta": {"traceparent": "old", "tracestate": "a=b", "k": 1}},
    }
    sent = json.loads(with_meta(json.dumps(message).encode(), carrier))
    assert sent["params"]["_meta"] == {"k": 1, **carrier}
    for body in (b"not json", b"[1]", b'{"jsonrpc":"2.0","id":1,"result":{}}'):
        assert with_meta(body, carrier) == body


def test_the_problem_type_is_read_from_the_proxys_own_answers() -> None:
    body = b'{"type":"urn:tool-proxy:problem:rate-limited","status":429}'
    assert problem_in(Reply(429, [], body)) == "urn:tool-proxy:problem:rate-limited"
    assert problem_in(Reply(200, [], b'{"ok":true}')) is None


# -- in process, with the SDK's in-memory exporter -----------------------------------------


@pytest.fixture
def memory_spans() -> Iterator[tuple[InMemorySpanExporter, Tracing]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield exporter, Tracing(provider)
    provider.shutdown()


def serve(tracer: Tracing, *routes: dict[str, Any]) -> ThreadServer:
    config = parse_config({"store": {"url": "memory://"}, "routes": list(routes)}, env={})
    return ThreadServer(create_app(config, tracing=tracer)).start()


def test_a_token_fetch_and_a_cache_hit_have_spans(
    memory_spans: tuple[InMemorySpanExporter, Tracing],
    tool: CountingTool,
    idp: IdentityProvider,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    exporter, tracer = memory_spans
    monkeypatch.setenv(SECRET_ENV, idp.client_secret)
    tokened = token_route(tool, idp, "client_credentials")
    cached = {**route(tool.url, name="cached", prefix="/cached", guarded=False)}
    cached["cache"] = {"scope": "route", "ttl": "1h"}
    server = serve(tracer, tokened, cached)
    try:
        assert post(server.url, "/tools/db", new_key(BODY)).status_code == 200
        for _ in range(2):
            assert httpx.get(server.url + "/cached/x?cache_control=max-age=60").status_code == 200
    finally:
        server.stop()
    spans = exporter.get_finished_spans()
    by_name = {s.name: s for s in spans}
    fetch, http = by_name["token fetch"], by_name["POST /tools"]
    assert fetch.parent is not None and fetch.parent.span_id == http.context.span_id
    client = next(s for s in spans if s.name == "POST" and s.parent == http.context)
    assert fetch.end_time is not None and client.start_time is not None
    assert fetch.end_time <= client.start_time
    hits = [dict(s.attributes or {}) for s in spans if s.name == "policy cache"]
    assert [h["tool_proxy.policy.sent"] for h in hits] == [True, False]
    assert tool.count("/cached/x") == 1
