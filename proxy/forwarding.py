"""The upstream client: one pooled aiohttp session, header filtering, error translation.

aiohttp is on the hot path because it is much faster than httpx under concurrency (the
measurement is in docs/benchmarks.md, "Upstream client"). This is the only module that
imports aiohttp: swap the client here.

aiohttp errors become ``UpstreamUnreachable`` when nothing can have reached the tool (no
connection could be made) and ``OutcomeUnknown`` otherwise (the request may have run).
"""

from __future__ import annotations

import functools
import math
from collections.abc import AsyncIterator, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import aiohttp
from yarl import URL

from proxy.asgi import RawHeaders
from proxy.errors import OutcomeUnknown, UpstreamUnreachable

# RFC 9110 7.6.1 hop-by-hop fields, plus the framing fields the proxy recomputes.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
# Dropped from requests as well: aiohttp sets the framing; the proxy sets X-Forwarded-*
# (Host and X-Forwarded-For are read first, then rewritten); Expect: 100-continue was
# the caller's business with the proxy (uvicorn answers it), and passed on it would make
# aiohttp hold the body back until the tool sends a 100 (a tool that never does would
# time out without having seen the body).
_REQUEST_DROP = HOP_BY_HOP | {
    b"content-length",
    b"expect",
    b"x-forwarded-proto",
    b"x-forwarded-host",
}
_REQUEST_DROP_WITH_TOKEN = _REQUEST_DROP | {b"authorization"}  # the proxy sends its own
_RESPONSE_DROP = HOP_BY_HOP | {b"content-length"}
# Idle upstream connections are closed before common servers close them (uvicorn and
# Node: 5 s), so a request is rarely written into a connection the server is closing.
KEEPALIVE_TIMEOUT = 4.0
# Connections per upstream host; beyond it requests wait for a free connection.
CONNECTIONS_PER_HOST = 256
# How long getting an upstream connection (pooled or new) may take, at most, and as a
# share of the route's timeout.
CONNECT_TIMEOUT = 10.0
CONNECT_SHARE = 0.9


def _tokens(value: bytes) -> set[bytes]:
    """The field names a Connection header lists (hop-by-hop too)."""
    return {t.strip().lower() for t in value.split(b",") if t.strip()}


def filter_headers(headers: Iterable[tuple[bytes, bytes]], drop: frozenset[bytes]) -> RawHeaders:
    """Headers without ``drop`` and without the fields that Connection names.

    ``drop`` must hold ``connection``. One pass; a second only if Connection names fields.
    """
    kept: RawHeaders = []
    named: set[bytes] = set()
    for name, value in headers:
        low = name.lower()
        if low in drop:
            if low == b"connection":
                named.update(_tokens(value))
            continue
        kept.append((name, value))
    if named:
        return [(k, v) for k, v in kept if k.lower() not in named]
    return kept


def request_headers(
    headers: Iterable[tuple[bytes, bytes]],
    client: str | None,
    scheme: str,
    *,
    length: int | None = None,
    authorization: str | None = None,
) -> list[tuple[str, str]]:
    """What is sent upstream: end-to-end headers plus X-Forwarded-For/Proto/Host, and the
    given Content-Length (a streamed body) and bearer token (in place of the caller's).

    ``headers`` are ASGI headers (names already lower-case), their values UTF-8
    (``Incoming.of`` refuses others): aiohttp encodes the decoded text as UTF-8 again,
    so the tool gets the caller's bytes.
    """
    out: list[tuple[str, str]] = []
    forwarded_for: list[str] = []
    host = None
    drop = _REQUEST_DROP if authorization is None else _REQUEST_DROP_WITH_TOKEN
    for name, value in filter_headers(headers, drop):
        if name == b"x-forwarded-for":
            forwarded_for.append(value.decode())
        elif name == b"host":
            host = value.decode()
        else:
            out.append((name.decode("latin-1"), value.decode()))
    if client:
        forwarded_for.append(client)
    if forwarded_for:
        out.append(("X-Forwarded-For", ", ".join(forwarded_for)))
    out.append(("X-Forwarded-Proto", scheme))
    if host:
        out.append(("X-Forwarded-Host", host))
    if length is not None:
        out.append(("Content-Length", str(length)))
    if authorization is not None:
        out.append(("Authorization", f"Bearer {authorization}"))
    return out


def response_headers(headers: Iterable[tuple[bytes, bytes]]) -> RawHeaders:
    """Upstream response headers that may be passed to the caller (framing recomputed)."""
    return filter_headers(headers, _RESPONSE_DROP)


@dataclass(slots=True)
class UpstreamResponse:
    """An answer whose body is still to be read (``read`` or ``stream``): the tool's
    (``ToolAnswer``), or one a policy wraps (to learn when it is read) or makes (a cached
    answer, an MCP result read whole)."""

    status: int
    headers: RawHeaders
    length: int | None

    async def read(self) -> bytes:
        """The whole body."""
        raise NotImplementedError

    def stream(self) -> AsyncIterator[bytes]:
        """The body chunk by chunk."""
        raise NotImplementedError


@dataclass(slots=True)
class ToolAnswer(UpstreamResponse):
    """The tool's answer, as aiohttp has it (its connection back to the pool once read)."""

    response: aiohttp.ClientResponse

    async def read(self) -> bytes:
        """The whole body; the connection goes back to the pool."""
        try:
            with _translated():
                return await self.response.read()
        finally:
            self.response.release()

    async def stream(self) -> AsyncIterator[bytes]:
        """The body chunk by chunk; the connection goes back to the pool at the end."""
        try:
            with _translated():
                async for chunk in self.response.content.iter_any():
                    yield chunk
        finally:
            self.response.release()


@contextmanager
def _translated() -> Iterator[None]:
    """Translate aiohttp's errors into the proxy's, at this one boundary."""
    try:
        yield
    except aiohttp.ConnectionTimeoutError as exc:
        raise UpstreamUnreachable("timed out connecting to the upstream") from exc
    except aiohttp.ClientConnectorError as exc:
        raise UpstreamUnreachable(f"cannot connect to the upstream: {exc.os_error}") from exc
    except TimeoutError as exc:
        raise OutcomeUnknown(
            "the upstream did not answer in time; the request may have been executed",
            status=504,
        ) from exc
    except (aiohttp.ClientError, OSError) as exc:
        raise OutcomeUnknown(
            f"the connection to the upstream broke ({type(exc).__name__}); "
            "the request may have been executed",
            status=502,
        ) from exc


def _timeout(seconds: float, connect_within: float | None = None) -> aiohttp.ClientTimeout:
    """``total`` bounds the whole exchange; ``connect`` bounds getting a connection (a free
    one from the pool, or DNS and a new one) and ends strictly first, so running out of
    time before anything was sent is a ``ConnectionTimeoutError`` (the key is released)
    and never a plain timeout (FAILED). No rounding up to whole seconds, which could make
    the two end together. ``connect_within`` bounds getting a connection further (a
    guarded call's lease: what is left of it); it is a new number on every call, so it
    takes part only when it binds (a timeout of its own, never cached), and the usual
    timeout is the cached one."""
    if connect_within is not None and connect_within < _connect(seconds):
        return _new_timeout(seconds, connect_within)
    return _usual_timeout(seconds)


def _connect(seconds: float) -> float:
    return min(seconds * CONNECT_SHARE, CONNECT_TIMEOUT)


@functools.lru_cache(maxsize=64)
def _usual_timeout(seconds: float) -> aiohttp.ClientTimeout:
    return _new_timeout(seconds, _connect(seconds))


def _new_timeout(seconds: float, connect: float) -> aiohttp.ClientTimeout:
    return aiohttp.ClientTimeout(
        total=seconds, connect=connect, sock_connect=connect, ceil_threshold=math.inf
    )


class Upstream:
    """One connection pool for the process, and two sessions over it.

    aiohttp sends a request with a method that HTTP calls idempotent (GET, HEAD, OPTIONS,
    TRACE, PUT, DELETE) a second time when the connection breaks before the answer
    (RFC 9112 9.3.1), as nginx does. That is right for a plain proxy and wrong for a
    guarded call: the tool may have executed the first one before the connection broke.
    Guarded calls (``at_most_once``) go through a session that never resends; aiohttp has
    no public switch for it, so this sets the attribute its own test client sets, and a
    test fails if it stops working.
    """

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None
        self._once: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=0, limit_per_host=CONNECTIONS_PER_HOST, keepalive_timeout=KEEPALIVE_TIMEOUT
        )
        self._session = _session(connector, owner=True)
        self._once = _session(connector, owner=False)
        self._once._retry_connection = False

    async def close(self) -> None:
        if self._once is not None:
            await self._once.close()
        if self._session is not None:
            await self._session.close()  # and the connector

    async def send(
        self,
        method: str,
        url: str,
        headers: list[tuple[str, str]],
        body: bytes | AsyncIterator[bytes],
        seconds: float,
        *,
        at_most_once: bool = False,
        connect_within: float | None = None,
    ) -> UpstreamResponse:
        """Send a request and wait for the headers; the exchange must end within ``seconds``.

        ``at_most_once``: never send it a second time, whatever happens to the connection.
        ``connect_within``: not sent at all (``UpstreamUnreachable``) unless a connection
        is had within that many seconds (a guarded call's lease).
        An empty ``body`` is sent as none: a GET, HEAD or OPTIONS without one gets no
        ``Content-Length: 0`` (RFC 9110 8.6); aiohttp still adds it to other methods.
        """
        session = self._once if at_most_once else self._session
        assert session is not None, "Upstream.start() was not awaited"
        client_timeout = _timeout(seconds, connect_within)
        with _translated():
            response = await session.request(
                method,
                URL(url, encoded=True),
                headers=headers,
                data=body if body != b"" else None,  # b"" is sent as Content-Length: 0
                allow_redirects=False,
                timeout=client_timeout,
            )
        return ToolAnswer(
            response.status,
            response_headers(response.raw_headers),
            response.content_length,
            response,
        )


def _session(connector: aiohttp.TCPConnector, *, owner: bool) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=connector,
        connector_owner=owner,
        auto_decompress=False,
        skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
        cookie_jar=aiohttp.DummyCookieJar(),
    )
