"""Bad input, end to end: what the proxy refuses, against a real tool and real servers."""

from __future__ import annotations

import json
import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from proxy.keys import composite_key
from tests.conftest import ProxyFactory, route
from tests.servers import BreakingTool, CountingTool, ProxyProcess, ThreadServer, running


def exchange(port: int, request: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
    """Send raw bytes; the status, headers and body of the one response that comes back."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            assert chunk, f"connection closed after {data!r}"
            data += chunk
        head, body = data.split(b"\r\n\r\n", 1)
        status_line, *lines = head.split(b"\r\n")
        headers = dict(line.lower().split(b": ", 1) for line in lines)
        while len(body) < int(headers.get(b"content-length", b"0")):
            chunk = sock.recv(65536)
            assert chunk, "connection closed mid-body"
            body += chunk
    return int(status_line.split()[1]), headers, body


def raw_problem(port: int, request: bytes) -> tuple[int, str]:
    """The status and problem type of the answer to raw request bytes."""
    status, headers, body = exchange(port, request)
    assert headers[b"content-type"] == b"application/problem+json", (status, headers, body)
    document = json.loads(body)
    assert document["status"] == status
    return status, str(document["type"]).rsplit(":", 1)[-1]


def problem_type(response: httpx.Response) -> str:
    assert response.headers["content-type"] == "application/problem+json"
    document = response.json()
    assert document["status"] == response.status_code
    return str(document["type"]).rsplit(":", 1)[-1]


def post_json(url: str, body: bytes, key: str) -> httpx.Response:
    headers = {"Idempotency-Key": key, "Content-Type": "application/json"}
    return httpx.post(url, content=body, headers=headers)


def test_a_deeply_nested_body_is_a_400_not_a_500(
    tool: CountingTool, make_proxy: ProxyFactory
) -> None:
    proxy = make_proxy(route(tool.url))
    attack = b"[" * 1000 + b"]" * 1000  # 2 KB; made the decoders recurse 1000 deep
    response = post_json(f"{proxy.url}/tools/x", attack, f"p:1:{'ab' * 32}")
    assert response.status_code == 400
    assert problem_type(response) == "invalid-json-body"
    assert tool.total == 0


def test_the_depth_limit_comes_from_the_configuration(
    tool: CountingTool, make_proxy: ProxyFactory
) -> None:
    proxy = make_proxy(route(tool.url), limits={"max_json_depth": 4})
    four, five = b"[[[[1]]]]", b"[[[[[1]]]]]"
    assert post_json(f"{proxy.url}/tools/x", four, composite_key("p", 1, four)).status_code == 200
    refused = post_json(f"{proxy.url}/tools/x", five, composite_key("p", 2, five))
    assert refused.status_code == 400
    assert "deeper than 4" in refused.json()["detail"]
    assert tool.total == 1


@pytest.mark.parametrize("key_kind", ["composite", "opaque"])
def test_a_body_that_repeats_a_member_name_is_refused(
    tool: CountingTool, make_proxy: ProxyFactory, key_kind: str
) -> None:
    proxy = make_proxy(route(tool.url, key=key_kind))
    body = b'{"amount":1,"amount":1000}'
    key = composite_key("p", 1, b'{"amount":1000}') if key_kind == "composite" else "order-1"
    response = post_json(f"{proxy.url}/tools/charge", body, key)
    assert response.status_code == 400
    assert problem_type(response) == "duplicate-json-member"
    assert tool.total == 0


def test_idempotency_key_sent_twice_is_refused(
    tool: CountingTool, make_proxy: ProxyFactory
) -> None:
    proxy = make_proxy(route(tool.url))
    key = composite_key("p", 1, b"{}")
    for keys in ([key, key], [key, composite_key("p", 2, b"{}")]):
        headers = [("Content-Type", "application/json"), *(("Idempotency-Key", k) for k in keys)]
        response = httpx.post(f"{proxy.url}/tools/x", content=b"{}", headers=headers)
        assert response.status_code == 400
        assert problem_type(response) == "idempotency-key-invalid"
    assert tool.total == 0


def test_content_type_twice_with_other_values_is_refused(
    tool: CountingTool, make_proxy: ProxyFactory
) -> None:
    proxy = make_proxy(route(tool.url))
    body = b'{"a":1}'
    key = composite_key("p", 1, body)
    types = [("Content-Type", "text/plain"), ("Content-Type", "application/json")]
    response = httpx.post(
        f"{proxy.url}/tools/x", content=body, headers=[*types, ("Idempotency-Key", key)]
    )
    assert response.status_code == 400
    assert problem_type(response) == "invalid-header"
    assert tool.total == 0
    same = [("Content-Type", "application/json")] * 2
    response = httpx.post(
        f"{proxy.url}/tools/x", content=body, headers=[*same, ("Idempotency-Key", key)]
    )
    assert response.status_code == 200


# Not UTF-8 (0xFF), UTF-8 (é and an emoji), and Latin-1 text that happens to be UTF-8.
RAW_VALUE = b"\xff\xfe"
UTF8_VALUES = ["é".encode(), "🔑 clé".encode(), b"\xc3\xbf"]


class EchoTool:
    """Records the raw header bytes it gets; answers with raw bytes in X-Raw."""

    def __init__(self) -> None:
        self.received: list[list[tuple[bytes, bytes]]] = []
        self.targets: list[bytes] = []
        self.app = Starlette(routes=[Route("/{path:path}", self.handle, methods=["GET", "POST"])])

    async def handle(self, request: Request) -> Response:
        self.received.append(list(request.headers.raw))
        self.targets.append(request.scope["raw_path"])
        value = (RAW_VALUE + b" " + UTF8_VALUES[1]).decode("latin-1")  # sent as these bytes
        return Response(b"ok", headers={"X-Raw": value})


@pytest.fixture
def echo() -> Iterator[tuple[EchoTool, ThreadServer]]:
    tool = EchoTool()
    with running(ThreadServer(tool.app)) as server:
        yield tool, server


def test_request_header_bytes_reach_the_tool_unchanged_or_are_refused(
    echo: tuple[EchoTool, ThreadServer], make_proxy: ProxyFactory
) -> None:
    tool, server = echo
    proxy = make_proxy(route(server.url, guarded=False))
    for value in UTF8_VALUES:
        assert httpx.get(f"{proxy.url}/tools/x", headers={b"X-Value": value}).status_code == 200
        assert (b"x-value", value) in tool.received[-1]
    refused = httpx.get(f"{proxy.url}/tools/x", headers={b"X-Value": RAW_VALUE})
    assert refused.status_code == 400
    assert problem_type(refused) == "invalid-header"
    assert len(tool.received) == len(UTF8_VALUES)


def test_response_header_bytes_reach_the_caller_unchanged(
    echo: tuple[EchoTool, ThreadServer], make_proxy: ProxyFactory
) -> None:
    _, server = echo
    proxy = make_proxy(route(server.url))
    sent = RAW_VALUE + b" " + UTF8_VALUES[1]
    passed = httpx.get(f"{proxy.url}/tools/x")
    key = composite_key("p", 1, b"")
    first = httpx.post(f"{proxy.url}/tools/x", headers={"Idempotency-Key": key})
    replay = httpx.post(f"{proxy.url}/tools/x", headers={"Idempotency-Key": key})
    assert replay.headers["idempotent-replayed"] == "true"
    for response in (passed, first, replay):
        assert (b"x-raw", sent) in response.headers.raw


@pytest.mark.parametrize("method", [b"CONNECT", b"TRACE"])
def test_connect_and_trace_are_never_forwarded(make_proxy: ProxyFactory, method: bytes) -> None:
    tool = BreakingTool()  # counts every request that reaches it, whatever its method
    try:
        proxy = make_proxy(route(tool.url, prefix="/", guarded=False))
        request = b"%s /tools/x HTTP/1.1\r\nHost: a\r\n\r\n" % method
        assert raw_problem(proxy.port, request) == (501, "method-not-implemented")
        assert tool.received == 0
    finally:
        tool.close()


@pytest.mark.parametrize("path", ["healthz/", "readyz/", "metrics/"])
def test_no_redirect_points_at_the_host_header(make_proxy: ProxyFactory, path: str) -> None:
    proxy = make_proxy(route("http://127.0.0.1:9"))
    response = httpx.get(f"{proxy.url}/_proxy/{path}", headers={"Host": "evil.example"})
    assert response.status_code == 404
    assert problem_type(response) == "not-found"
    assert "location" not in response.headers


@pytest.mark.parametrize("target", [b"//127.0.0.1:9/x", b"/a//b", b"/a/b//", b"//"])
def test_empty_path_segments_are_refused(
    echo: tuple[EchoTool, ThreadServer], make_proxy: ProxyFactory, target: bytes
) -> None:
    tool, server = echo
    proxy = make_proxy(route(server.url + "/api", prefix="/", guarded=False))
    request = b"GET %s HTTP/1.1\r\nHost: a\r\n\r\n" % target
    assert raw_problem(proxy.port, request) == (400, "invalid-path")
    assert tool.targets == []


@pytest.mark.parametrize("strip", [False, True])
def test_the_upstream_target_is_always_the_routes_base(
    echo: tuple[EchoTool, ThreadServer], make_proxy: ProxyFactory, strip: bool
) -> None:
    tool, server = echo
    catch_all = route(server.url + "/api/", prefix="/", guarded=False, strip_prefix=strip)
    tools = route(server.url + "/api/", name="t", prefix="/t", guarded=False, strip_prefix=strip)
    proxy = make_proxy(catch_all, tools)
    for target in (b"/", b"/x", b"/t", b"/t/", b"/t/x/y?q=//z"):
        status, _, _ = exchange(proxy.port, b"GET %s HTTP/1.1\r\nHost: a\r\n\r\n" % target)
        assert status == 200
    expected = [b"/api/", b"/api/x", b"/api/t", b"/api/t/", b"/api/t/x/y"]
    if strip:
        expected[2:] = [b"/api/", b"/api/", b"/api/x/y"]
    assert tool.targets == expected


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GARBAGE\r\n\r\n",
        b"GET /tools/x HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
        b"POST /tools/x HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b"CONNECT 127.0.0.1:9 HTTP/1.1\r\nHost: 127.0.0.1:9\r\n\r\n",
        b"GET /tools/\xff HTTP/1.1\r\nHost: a\r\n\r\n",
        b"GET /tools/x HTTP/1.1\r\nHost: a\r\nBad Name: v\r\n\r\n",
        b"GET /tools/x HTTP/1.1\r\nHost: a\r\nX: a\rb\r\n\r\n",
    ],
)
def test_requests_the_http_parser_refuses_get_a_problem_document(
    tool: CountingTool, make_proxy: ProxyFactory, request_bytes: bytes
) -> None:
    proxy = make_proxy(route(tool.url, prefix="/", guarded=False))
    assert raw_problem(proxy.port, request_bytes) == (400, "bad-request")
    assert tool.total == 0


@pytest.mark.parametrize(
    ("coding", "status"),
    [
        (b"gzip, chunked", 501),
        (b"identity, chunked", 501),
        (b"gzip\r\nTransfer-Encoding: chunked", 501),  # two lines: gzip, then chunked
        (b"chunked, chunked", 400),  # the HTTP parser's own refusals
        (b"chunked\r\nTransfer-Encoding: chunked", 400),  # chunked twice, on two lines
        (b"", 400),  # no coding at all
        (b"gzip", 400),
        (b"Chunked", 200),
        (b",chunked", 200),
    ],
)
def test_a_transfer_coding_other_than_chunked_is_501_never_forwarded_as_the_body(
    tool: CountingTool, make_proxy: ProxyFactory, coding: bytes, status: int
) -> None:
    """RFC 9112 6.1: only chunked is undone; the rest of ``gzip, chunked`` would reach the
    tool (and the key's hash) as the body."""
    proxy = make_proxy(route(tool.url, prefix="/", guarded=False))
    request = (
        b"POST /tools/x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: %s\r\n\r\n"
        b"5\r\nhello\r\n0\r\n\r\n" % coding
    )
    if status == 200:
        assert exchange(proxy.port, request)[0] == 200
        assert tool.total == 1
        return
    slug = "transfer-coding-not-implemented" if status == 501 else "bad-request"
    assert raw_problem(proxy.port, request) == (status, slug)
    assert tool.total == 0


def _send_until_answered(port: int, head: bytes, filler: bytes, most: int) -> tuple[bytes, int]:
    """Send ``head``, then ``filler`` until an answer comes (or ``most`` bytes went out):
    the answer, read to its end, and how many filler bytes were sent."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head)
        sent = 0
        while sent < most:
            readable, _, _ = select.select([sock], [sock], [], 10)
            if readable:
                break
            try:
                sent += sock.send(filler)
            except OSError:  # the proxy closed: its answer is in the receive buffer
                break
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except ConnectionResetError:  # the rest of what was sent reached a closed socket
            pass
    return answer, sent


def test_a_huge_header_is_refused_before_it_is_read_whole(
    tool: CountingTool, make_proxy: ProxyFactory
) -> None:
    proxy = make_proxy(route(tool.url, prefix="/", guarded=False))
    most = 64 * 1024 * 1024
    head = b"GET /tools/x HTTP/1.1\r\nHost: a\r\nX-Big: "
    answer, sent = _send_until_answered(proxy.port, head, b"a" * 65536, most)
    assert answer.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")
    assert b"request-header-fields-too-large" in answer
    assert sent < most // 4  # refused as it arrived (what was sent sits in socket buffers)
    assert tool.total == 0


@pytest.fixture
def served(tool: CountingTool, tmp_path: Path) -> Iterator[ProxyProcess]:
    """``tool-proxy serve`` with a small header limit, in front of the counting tool."""
    config = {
        "store": {"url": "memory://"},
        "limits": {"max_header_bytes": 2048, "header_timeout": "500ms", "body_timeout": "500ms"},
        "routes": [route(tool.url, guarded=False)],
    }
    proxy = ProxyProcess(config, tmp_path).start()
    yield proxy
    proxy.stop()


def answer_to(sock: socket.socket) -> tuple[int, str, bytes]:
    """The status and problem type of the answer on ``sock``, and what follows it (b""
    once the proxy closed the connection)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed after {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    headers = dict(line.lower().split(b": ", 1) for line in head.split(b"\r\n")[1:])
    while len(body) < int(headers[b"content-length"]):
        body += sock.recv(65536)
    document = json.loads(body)
    return int(head.split()[1]), str(document["type"]).rsplit(":", 1)[-1], sock.recv(65536)


def test_a_head_or_body_that_stops_arriving_is_a_408_and_the_connection_closed(
    tool: CountingTool, served: ProxyProcess
) -> None:
    """limits.header_timeout bounds a head's arrival, limits.body_timeout a body's silence
    (500ms each here): a stalled caller holds no connection for ever, and its call never
    reaches the tool; a body that keeps coming, however slowly, is read."""
    head = b"POST /tools/x HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 12\r\n"
    for sent in (head[:20], head + b"\r\nabcd"):  # half a head, a third of a body
        with socket.create_connection(("127.0.0.1", served.port), timeout=5) as sock:
            sock.sendall(sent)
            started = time.monotonic()
            assert answer_to(sock) == (408, "request-timeout", b""), sent
            assert 0.4 < time.monotonic() - started < 3, sent
    with socket.create_connection(("127.0.0.1", served.port), timeout=5) as sock:
        started = time.monotonic()
        assert sock.recv(65536) == b""  # a connection that sends nothing: closed, unanswered
        assert 0.4 < time.monotonic() - started < 3
    with socket.create_connection(("127.0.0.1", served.port), timeout=5) as sock:
        sock.sendall(head + b"\r\n")
        for part in (b"abcd", b"efgh", b"ijkl"):  # 0.9 s in all, never 0.5 s silent
            time.sleep(0.3)
            sock.sendall(part)
        data = sock.recv(65536)
    assert data.startswith(b"HTTP/1.1 200"), data
    assert tool.total == 1


def test_the_served_proxy_takes_its_limits_and_answers_problems(
    tool: CountingTool, served: ProxyProcess
) -> None:
    url = f"{served.url}/tools/x"
    assert httpx.get(url, headers={"X-Pad": "v" * 1500}).status_code == 200
    refused = httpx.get(url, headers={"X-Pad": "v" * 2100})
    assert refused.status_code == 431
    assert problem_type(refused) == "request-header-fields-too-large"
    assert raw_problem(served.port, b"GARBAGE\r\n\r\n") == (400, "bad-request")
    upgrade = {"Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13"}
    upgrade["Sec-WebSocket-Key"] = "dGhlIHNhbXBsZSBub25jZQ=="
    # not a WebSocket proxy: a plain request to the tool, never a library's own text 403
    assert httpx.get(url, headers=upgrade).status_code == 200
    assert tool.total == 2


def test_a_request_needs_one_host(make_proxy: ProxyFactory, tool: CountingTool) -> None:
    """RFC 9112 3.2: an HTTP/1.1 request without Host, or with two, is a 400; HTTP/1.0
    needs none."""
    proxy = make_proxy(route(tool.url, guarded=False))
    missing = b"GET /tools/x HTTP/1.1\r\nConnection: close\r\n\r\n"
    assert raw_problem(proxy.port, missing) == (400, "invalid-header")
    two = b"GET /tools/x HTTP/1.1\r\nHost: a\r\nHost: a\r\nConnection: close\r\n\r\n"
    assert raw_problem(proxy.port, two) == (400, "invalid-header")
    old = b"GET /tools/x HTTP/1.0\r\n\r\n"
    assert exchange(proxy.port, old)[0] == 200
    assert tool.total == 1
