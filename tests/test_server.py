"""The server glue: one write per response (CoalescingTransport)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import uvicorn
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
