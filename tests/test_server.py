"""The server glue: one write per response (CoalescingTransport), the head limit and
the parser's refusals as problem documents (ProxyHttpProtocol)."""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any, cast

import pytest
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from proxy.server import CoalescingTransport, ProxyHttpProtocol


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class RecordingTransport:
    """Just enough of a transport to see what leaves, and in how many calls."""

    def __init__(self) -> None:
        self.calls: list[list[bytes]] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.calls.append([data])

    def writelines(self, data: list[bytes]) -> None:
        self.calls.append(list(data))

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 1234)}.get(name, default)


async def _step() -> None:
    await asyncio.sleep(0)


@pytest.mark.anyio
async def test_writes_of_one_step_leave_in_one_call() -> None:
    inner = RecordingTransport()
    transport = CoalescingTransport(inner)  # type: ignore[arg-type]
    transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
    transport.write(b"ok")
    assert inner.calls == []  # nothing leaves before the step ends
    await _step()
    assert inner.calls == [[b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n", b"ok"]]
    transport.write(b"next")
    await _step()
    assert inner.calls[-1] == [b"next"]
    assert len(inner.calls) == 2


@pytest.mark.anyio
async def test_close_sends_what_is_buffered_first() -> None:
    inner = RecordingTransport()
    transport = CoalescingTransport(inner)  # type: ignore[arg-type]
    transport.write(b"last words")
    transport.close()
    assert inner.calls == [[b"last words"]]
    assert inner.closed
    await _step()  # the scheduled flush finds nothing more to send
    assert inner.calls == [[b"last words"]]


@pytest.mark.anyio
async def test_everything_else_is_the_wrapped_transport() -> None:
    inner = RecordingTransport()
    transport = CoalescingTransport(inner)  # type: ignore[arg-type]
    assert transport.get_extra_info("peername") == ("127.0.0.1", 1234)


@pytest.mark.anyio
async def test_the_server_protocol_writes_through_a_coalescing_transport() -> None:
    config = uvicorn.Config(app=_app, http=ProxyHttpProtocol, loop="none")
    config.load()
    protocol = ProxyHttpProtocol(config, ServerState(), app_state={})
    inner = RecordingTransport()
    protocol.connection_made(inner)  # type: ignore[arg-type]
    assert isinstance(protocol.transport, CoalescingTransport)
    protocol.transport.write(b"a")
    protocol.transport.write(b"b")
    await _step()
    assert inner.calls == [[b"a", b"b"]]


async def _app(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError("not called")


def _protocol(max_header_bytes: int) -> tuple[ProxyHttpProtocol, RecordingTransport]:
    """The protocol on a recording transport; its app is never to be called."""
    config = uvicorn.Config(app=_app, http=ProxyHttpProtocol, loop="none", log_level="error")
    config.load()
    protocol = ProxyHttpProtocol(
        config, ServerState(), app_state={}, max_header_bytes=max_header_bytes
    )
    inner = RecordingTransport()
    protocol.connection_made(inner)  # type: ignore[arg-type]
    return protocol, inner


def _answer(inner: RecordingTransport) -> tuple[int, dict[str, Any]]:
    """The status and problem document the protocol wrote (one write, then closed)."""
    assert inner.closed
    (written,) = [b"".join(call) for call in inner.calls]
    head, body = written.split(b"\r\n\r\n", 1)
    assert b"content-type: application/problem+json" in head.split(b"\r\n")
    assert b"connection: close" in head.split(b"\r\n")
    return int(head.split()[1]), json.loads(body)


@pytest.mark.anyio
async def test_a_head_over_the_limit_is_refused_while_it_arrives() -> None:
    protocol, inner = _protocol(4096)
    protocol.data_received(b"POST /tools/x HTTP/1.1\r\nHost: a\r\nX-Big: ")
    protocol.data_received(b"a" * 3000)
    await _step()
    assert inner.calls == []  # 3000 bytes of head so far: under the limit
    protocol.data_received(b"a" * 3000)  # the value is not complete: httptools still holds it
    protocol.data_received(b"a" * 10_000_000)  # ignored: the answer is out
    await _step()
    status, problem = _answer(inner)
    assert status == 431
    assert problem["type"] == "urn:tool-proxy:problem:request-header-fields-too-large"
    assert not protocol.tasks  # no request reached the app


@pytest.mark.anyio
async def test_a_head_over_the_limit_that_arrives_at_once_is_refused() -> None:
    protocol, inner = _protocol(4096)
    headers = b"".join(b"X-%d: %s\r\n" % (n, b"v" * 100) for n in range(40))  # 4.4 KB
    protocol.data_received(b"GET / HTTP/1.1\r\nHost: a\r\n" + headers + b"\r\n")
    await _step()
    assert _answer(inner)[0] == 431
    assert not protocol.tasks  # no request reached the app


@pytest.mark.anyio
async def test_a_head_just_under_the_limit_passes() -> None:
    protocol, inner = _protocol(4096)
    head = b"GET / HTTP/1.1\r\nHost: a\r\nX-Pad: "
    head += b"v" * (4096 - len(head) - 4) + b"\r\n\r\n"
    assert len(head) == 4096
    protocol.data_received(head[:100])
    protocol.data_received(head[100:4000])
    protocol.data_received(head[4000:])
    assert inner.calls == [] and not inner.closed
    assert protocol.scope["path"] == "/"  # parsed: the request went on to the app
    for task in protocol.tasks:
        task.cancel()


@pytest.mark.anyio
async def test_a_request_the_parser_refuses_gets_a_problem_document() -> None:
    protocol, inner = _protocol(4096)
    protocol.data_received(
        b"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n"
    )
    await _step()
    status, problem = _answer(inner)
    assert status == 400
    assert problem["type"] == "urn:tool-proxy:problem:bad-request"


def test_uvicorn_still_answers_parser_errors_through_send_400_response() -> None:
    """ProxyHttpProtocol overrides uvicorn's send_400_response (not a public API): if
    uvicorn renames it or stops calling it on a parser error, this fails."""
    source = inspect.getsource(HttpToolsProtocol.data_received)
    assert "except httptools.HttpParserError" in source
    assert "self.send_400_response(" in source
    assert list(inspect.signature(HttpToolsProtocol.send_400_response).parameters) == [
        "self",
        "msg",
    ]


@pytest.mark.anyio
async def test_a_parser_error_during_a_response_closes_without_a_second_answer() -> None:
    started = asyncio.Event()

    async def streaming(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        started.set()
        await asyncio.Event().wait()  # the body never comes

    config = uvicorn.Config(app=streaming, http=ProxyHttpProtocol, loop="none", log_level="error")
    config.load()
    protocol = ProxyHttpProtocol(config, ServerState(), app_state={})
    inner = RecordingTransport()
    protocol.connection_made(inner)  # type: ignore[arg-type]
    protocol.data_received(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n")
    await started.wait()
    protocol.data_received(b"GARBAGE\r\n\r\n")  # a malformed request pipelined behind it
    await _step()
    written = b"".join(b"".join(call) for call in inner.calls)
    assert written.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b" 400 " not in written
    assert inner.closed
    for task in protocol.tasks:
        task.cancel()


# The head and body timers against a real uvicorn server on a thread (0.5 s each).
TIMER = 0.5


async def _timed_app(scope: Any, receive: Any, send: Any) -> None:
    """/wait asks for its body after most of a timer, /slow answers after several,
    /early answers without reading its body; each says how many body bytes it read."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    path, body = scope["path"], b""
    await asyncio.sleep({"/wait": TIMER * 0.9, "/slow": TIMER * 5}.get(path, 0))
    while path != "/early":
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    out = b"read %d" % len(body)
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-length", b"%d" % len(out))],
        }
    )
    await send({"type": "http.response.body", "body": out})


@pytest.fixture(scope="module")
def timed_port() -> Iterator[int]:

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    protocol = functools.partial(ProxyHttpProtocol, header_seconds=TIMER, body_seconds=TIMER)
    config = uvicorn.Config(
        _timed_app,
        host="127.0.0.1",
        port=port,
        http=cast(type[asyncio.Protocol], protocol),
        ws="none",
        log_level="warning",
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        thread.join(0.02)
    yield port
    server.should_exit = True
    thread.join(5)


def _until_closed(sock: socket.socket, seconds: float = 8) -> bytes:
    sock.settimeout(seconds)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_a_body_held_back_by_100_continue_is_not_counted_as_silence(timed_port: int) -> None:
    """The proxy asks for the body late (the 100 goes out just before the timer): the
    caller's time starts then, not at the head."""

    with socket.create_connection(("127.0.0.1", timed_port), timeout=5) as sock:
        head = (
            b"POST /wait HTTP/1.1\r\nHost: a\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n"
        )
        sock.sendall(head)
        assert sock.recv(65536) == b"HTTP/1.1 100 Continue\r\n\r\n"
        time.sleep(TIMER * 0.6)  # past the timer counted from the head, within it from the 100
        sock.sendall(b"abcd")
        sock.settimeout(5)
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 200 "), answer
    assert answer.endswith(b"read 4")


def test_a_pipelined_head_waits_for_the_answer_before_it(timed_port: int) -> None:
    """Half a head behind a request still being answered: the answer comes first and
    whole, the 408 only after it (HTTP/1.1 answers in order)."""

    with socket.create_connection(("127.0.0.1", timed_port), timeout=5) as sock:
        sock.sendall(b"GET /slow HTTP/1.1\r\nHost: a\r\n\r\nGET /x HT")
        data = _until_closed(sock)
    first, _, rest = data.partition(b"read 0")
    assert first.startswith(b"HTTP/1.1 200 "), data
    assert rest.startswith(b"HTTP/1.1 408 "), data


def test_a_body_left_unread_after_its_answer_gets_no_second_answer(timed_port: int) -> None:
    """The app answered without reading the body; the body then stalls: the connection
    is closed, with no 408 after the 200."""

    with socket.create_connection(("127.0.0.1", timed_port), timeout=5) as sock:
        sock.sendall(b"POST /early HTTP/1.1\r\nHost: a\r\nContent-Length: 10\r\n\r\nab")
        data = _until_closed(sock)
    assert data.startswith(b"HTTP/1.1 200 "), data
    assert data.endswith(b"read 0")
    assert b"408" not in data
