"""Real OTLP receivers for the tracing tests: OTLP/HTTP (protobuf POSTs on /v1/traces)
and OTLP/gRPC, each decoding what the proxy's real exporter sends with opentelemetry-proto."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as ProtoSpan

from tests.servers import free_port

KINDS = {
    ProtoSpan.SPAN_KIND_INTERNAL: "internal",
    ProtoSpan.SPAN_KIND_SERVER: "server",
    ProtoSpan.SPAN_KIND_CLIENT: "client",
    ProtoSpan.SPAN_KIND_PRODUCER: "producer",
    ProtoSpan.SPAN_KIND_CONSUMER: "consumer",
}


def _value(value: AnyValue) -> Any:
    which = value.WhichOneof("value")
    return None if which is None else getattr(value, which)


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs if isinstance(pair, KeyValue)}


@dataclass
class Span:
    """One span as the receiver decoded it (ids in hex)."""

    name: str
    kind: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]
    resource: dict[str, Any]
    links: list[tuple[str, str, dict[str, Any]]]
    status: int
    start: int
    end: int
    events: list[tuple[str, int, dict[str, Any]]] = field(default_factory=list)
    """(name, time in ns, attributes) of each event."""

    @property
    def seconds(self) -> float:
        return (self.end - self.start) / 1e9


@dataclass
class Received:
    """Every span the receiver got, in arrival order."""

    spans: list[Span] = field(default_factory=list)
    requests: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, payload: trace_service_pb2.ExportTraceServiceRequest) -> None:
        decoded = []
        for resource_spans in payload.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    decoded.append(
                        Span(
                            name=span.name,
                            kind=KINDS[span.kind],
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_id=span.parent_span_id.hex(),
                            attributes=_attributes(span.attributes),
                            resource=resource,
                            links=[
                                (
                                    link.trace_id.hex(),
                                    link.span_id.hex(),
                                    _attributes(link.attributes),
                                )
                                for link in span.links
                            ],
                            status=span.status.code,
                            start=span.start_time_unix_nano,
                            end=span.end_time_unix_nano,
                            events=[
                                (e.name, e.time_unix_nano, _attributes(e.attributes))
                                for e in span.events
                            ],
                        )
                    )
        with self.lock:
            self.requests += 1
            self.spans.extend(decoded)

    def where(self, predicate: Callable[[Span], bool]) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if predicate(s)]

    def wait(
        self, predicate: Callable[[Span], bool], count: int = 1, seconds: float = 10
    ) -> list[Span]:
        """The spans matching ``predicate`` once there are ``count`` of them."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            found = self.where(predicate)
            if len(found) >= count:
                return found
            time.sleep(0.05)
        raise AssertionError(f"{len(self.where(predicate))} of {count} spans; got {self.spans}")

    def trace(self, trace_id: str) -> list[Span]:
        return self.where(lambda s: s.trace_id == trace_id)

    def clear(self) -> None:
        with self.lock:
            self.spans.clear()


class HttpReceiver:
    """OTLP/HTTP with protobuf bodies on ``/v1/traces``, on a thread."""

    def __init__(self) -> None:
        self.received = Received()
        received = self.received

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.path != "/v1/traces" or "protobuf" not in self.headers.get(
                    "content-type", ""
                ):
                    self.send_response(404)
                    self.end_headers()
                    return
                payload = trace_service_pb2.ExportTraceServiceRequest()
                payload.ParseFromString(body)
                received.take(payload)
                answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.port = free_port()
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> HttpReceiver:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, received: Received) -> None:
        self.received = received

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        self.received.take(request)
        return trace_service_pb2.ExportTraceServiceResponse()


class GrpcReceiver:
    """OTLP/gRPC (the collector's TraceService), without TLS."""

    def __init__(self) -> None:
        self.received = Received()
        self.port = free_port()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(  # type: ignore[no-untyped-call]
            _TraceService(self.received), self.server
        )
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> GrpcReceiver:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop(1).wait(5)
