from __future__ import annotations

import asyncio
from typing import NoReturn

import aiohttp
import pytest
from multidict import CIMultiDict

from proxy import forwarding
from proxy.errors import UpstreamUnreachable
from proxy.forwarding import Upstream, UpstreamResponse, request_headers, response_headers
from proxy.outcome import StoredResponse
from proxy.replay import REPLAYED_HEADER, reply


def test_connection_named_fields_are_dropped() -> None:
    headers = [
        (b"Connection", b"close, X-Secret-Hop"),
        (b"X-Secret-Hop", b"1"),
        (b"X-End", b"2"),
        (b"Transfer-Encoding", b"chunked"),
        (b"Content-Length", b"9"),
        (b"Keep-Alive", b"t"),
    ]
    assert response_headers(headers) == [(b"X-End", b"2")]
    # Connection may come twice, and after the fields it names
    twice = [(b"X-A", b"1"), (b"connection", b"x-a"), (b"X-B", b"2"), (b"Connection", b"X-B")]
    assert response_headers(twice) == []


def test_request_headers_add_forwarding_fields() -> None:
    sent = request_headers(
        [
            (b"host", b"proxy:8080"),
            (b"x-forwarded-for", b"1.1.1.1"),
            (b"te", b"trailers"),
            (b"upgrade", b"h2c"),
            (b"proxy-connection", b"keep-alive"),
            (b"accept", b"a"),
            (b"accept", b"b"),
            (b"content-length", b"3"),
            (b"expect", b"100-continue"),
        ],
        "10.0.0.9",
        "https",
    )
    out = CIMultiDict(sent)
    assert out.getall("accept") == ["a", "b"]
    assert out["X-Forwarded-For"] == "1.1.1.1, 10.0.0.9"
    assert out["X-Forwarded-Proto"] == "https"
    assert out["X-Forwarded-Host"] == "proxy:8080"
    # Expect: the proxy answered the caller's 100-continue itself and holds the body; sent
    # on, aiohttp would wait for the tool's 100 before sending the body.
    for dropped in ("host", "te", "upgrade", "proxy-connection", "content-length", "expect"):
        assert dropped not in out


def test_request_headers_replace_the_callers_token_and_framing() -> None:
    sent = request_headers(
        [
            (b"authorization", b"Bearer caller"),
            (b"connection", b"keep-alive, x-hop"),
            (b"x-hop", b"1"),
            (b"content-length", b"3"),
            (b"x-end", b"2"),
        ],
        None,
        "http",
        length=10,
        authorization="fresh",
    )
    assert sent == [
        ("x-end", "2"),
        ("X-Forwarded-Proto", "http"),
        ("Content-Length", "10"),
        ("Authorization", "Bearer fresh"),
    ]


def test_stored_responses_round_trip_without_set_cookie() -> None:
    headers = [
        (b"Content-Type", b"application/json"),
        (b"Set-Cookie", b"a=b"),
        (b"X-A", b"1"),
        (b"X-A", b"2"),
        (b"Content-Length", b"4"),
    ]
    stored = StoredResponse.of(201, headers, b"\x00body\xff")
    decoded = StoredResponse.decode(stored.encode())
    assert decoded == stored
    assert (b"Set-Cookie", b"a=b") not in decoded.headers
    response = reply(decoded, replayed=True)
    assert response.status_code == 201
    assert REPLAYED_HEADER in response.raw_headers
    assert (b"content-length", b"6") in response.raw_headers
    assert [v for k, v in response.raw_headers if k == b"X-A"] == [b"1", b"2"]


def test_a_lease_bounds_the_connect_timeout_only_when_it_binds() -> None:
    usual = forwarding._timeout(30.0)
    assert usual.total == 30.0
    assert usual.connect == usual.sock_connect == forwarding.CONNECT_TIMEOUT
    # A lease with more left than the usual connect timeout: the same (cached) timeout.
    assert forwarding._timeout(30.0, 299.123) is usual
    cached = forwarding._usual_timeout.cache_info().currsize
    short = forwarding._timeout(30.0, 1.5)
    assert (short.total, short.connect, short.sock_connect) == (30.0, 1.5, 1.5)
    # A lease that binds gets a timeout of its own: its time left never repeats, so it
    # would only push the usual timeouts out of the cache.
    assert forwarding._timeout(30.0, 1.5) is not short
    assert forwarding._usual_timeout.cache_info().currsize == cached
    tiny_route = forwarding._timeout(1.0, 5.0)
    assert tiny_route.connect == 1.0 * forwarding.CONNECT_SHARE


class _Tool:
    """A raw HTTP server that counts the requests it reads and answers each 200."""

    def __init__(self) -> None:
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._answer, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return
        self.requests.append(head)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        await writer.drain()
        writer.close()


async def _send(url: str, headers: list[tuple[str, str]]) -> UpstreamResponse:
    upstream = Upstream()
    await upstream.start()
    try:
        answer = await upstream.send("POST", url, headers, b"{}", 5.0, at_most_once=True)
        await answer.read()
        return answer
    finally:
        await upstream.close()


@pytest.mark.parametrize("base", ["http://127.0.0.1:99999", "http://127.0.0.1:abc"])
def test_a_url_that_cannot_be_built_is_unreachable_not_unknown(base: str) -> None:
    """A URL yarl refuses (a port out of range, or not a number) raised ValueError out of
    the send: a guarded call was recorded FAILED, "may have been executed", though
    nothing was sent. It is UpstreamUnreachable: the key is released."""
    with pytest.raises(UpstreamUnreachable, match="nothing was sent"):
        asyncio.run(_send(f"{base}/x", []))


def test_a_request_aiohttp_refuses_before_writing_is_unreachable() -> None:
    """Credentials in the URL next to an Authorization header: aiohttp raises ValueError
    before it connects. Nothing reached the tool, so the key is released."""

    async def run() -> list[bytes]:
        tool = _Tool()
        async with tool as url:
            with_user = url.replace("http://", "http://user:pw@")
            with pytest.raises(UpstreamUnreachable, match="nothing was sent"):
                await _send(f"{with_user}/x", [("Authorization", "Bearer t")])
            assert (await _send(f"{url}/x", [])).status == 200  # the tool is there
        return tool.requests

    assert len(asyncio.run(run())) == 1


def test_a_value_error_once_the_request_is_written_stays_unknown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once aiohttp has started writing the request, a ValueError may come after the tool
    got it: it is not taken for "nothing was sent"."""

    async def broken(self: aiohttp.ClientResponse, connection: object) -> NoReturn:
        await asyncio.sleep(0.1)  # the request is written (and read by the tool)
        raise ValueError("read after the request was written")

    monkeypatch.setattr(aiohttp.ClientResponse, "start", broken)

    async def run() -> list[bytes]:
        tool = _Tool()
        async with tool as url:
            with pytest.raises(ValueError, match="read after") as raised:
                await _send(f"{url}/x", [])
            assert not isinstance(raised.value, UpstreamUnreachable)
        return tool.requests

    assert len(asyncio.run(run())) == 1
