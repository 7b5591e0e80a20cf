from __future__ import annotations

from multidict import CIMultiDict

from proxy import forwarding
from proxy.forwarding import request_headers, response_headers
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
