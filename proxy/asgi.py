"""The hot path's side of ASGI: a proxied request as read, a whole response as sent.

Starlette's ``Request`` and ``Response`` do more than a proxy needs on every request
(a header view per lookup, an async generator per body, content negotiation of
headers that are then replaced); these do only what the proxy uses. The proxy's own
endpoints under ``/_proxy/`` keep Starlette's.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.responses import Response
from starlette.types import Receive, Scope

from proxy.errors import (
    BadRequest,
    CallerLeft,
    InvalidHeader,
    InvalidIdempotencyKey,
    TransferCodingNotImplemented,
)

RawHeaders = list[tuple[bytes, bytes]]
SSE = "text/event-stream"
"""The media type of an event stream (MCP answers, operation events)."""

# The request headers the proxy itself reads. Each is one value: a repeated line with
# another value is refused (the proxy would read one, the tool perhaps the other), and
# Idempotency-Key, an RFC 8941 Item, and Host (RFC 9112 3.2) may not be repeated at all
# (Idempotency-Key: refused by the route, ``KeyRepeated``). Transfer-Encoding is read to
# refuse any coding but one ``chunked`` (the HTTP parser undoes that one only).
READ_HEADERS = frozenset(
    {
        b"authorization",
        b"content-length",
        b"content-type",
        b"host",
        b"idempotency-key",
        b"origin",
        b"transfer-encoding",
    }
)


@dataclass(slots=True)
class Incoming:
    """A proxied request: its scope, its body channel, and the headers the proxy reads."""

    scope: Scope
    receive: Receive
    method: str
    headers: dict[bytes, str]

    @classmethod
    def of(cls, scope: Scope, receive: Receive) -> Incoming:
        """The request; ``BadRequest`` for a header the proxy cannot pass on unchanged."""
        headers: dict[bytes, str] = {}
        for name, value in scope["headers"]:
            if not value.isascii():
                _check_utf8(name, value)
            if name in READ_HEADERS:
                if name in headers:
                    if name == b"idempotency-key":
                        cls = KeyRepeated  # refused as the route answers: see KeyRepeated
                    else:
                        _check_repeated(name, value, headers[name])
                else:
                    headers[name] = value.decode("latin-1")
        if b"host" not in headers and scope.get("http_version") == "1.1":
            raise InvalidHeader("an HTTP/1.1 request must have a Host header (RFC 9112 3.2)")
        coding = headers.get(b"transfer-encoding")
        if coding is not None and coding != "chunked":
            _check_coding(coding)
        return cls(scope, receive, scope["method"], headers)

    def header(self, name: bytes) -> str | None:
        """The first value of ``name`` (lower case), if it is one of ``READ_HEADERS``."""
        return self.headers.get(name)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives; ``CallerLeft`` if the caller goes away first."""
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                raise CallerLeft("the caller closed the connection before sending its body")
            chunk = message.get("body", b"")
            if chunk:
                yield chunk
            if not message.get("more_body", False):
                return


_SENT_ONCE = "Idempotency-Key must be sent once (one RFC 8941 Item)"


@dataclass(slots=True)
class KeyRepeated(Incoming):
    """A request with more than one Idempotency-Key line, refused before anything is
    forwarded. Which refusal is the route's: reading the key or the body raises
    ``InvalidIdempotencyKey`` (an HTTP route's 400 problem), except that an MCP route,
    having set ``jsonrpc``, reads the body to answer with a JSON-RPC error for the
    request's id (``mcp.py``). Requests with one line never meet this class."""

    jsonrpc: bool = False

    def header(self, name: bytes) -> str | None:
        if name == b"idempotency-key":
            raise InvalidIdempotencyKey(_SENT_ONCE)
        return self.headers.get(name)

    def chunks(self) -> AsyncIterator[bytes]:
        if not self.jsonrpc:  # raised here, before any send is started with the body
            raise InvalidIdempotencyKey(_SENT_ONCE)
        return Incoming.chunks(self)


def _check_utf8(name: bytes, value: bytes) -> None:
    """Header values are forwarded as UTF-8 (aiohttp encodes text so), which is byte for
    byte only for values that are UTF-8: any other is refused, never altered."""
    try:
        value.decode()
    except UnicodeDecodeError:
        field = name.decode("latin-1")
        raise InvalidHeader(f"the value of {field} is not UTF-8: it cannot be forwarded") from None


def _check_coding(value: str) -> None:
    """``TransferCodingNotImplemented`` unless ``value`` is ``chunked`` (any case, empty
    list elements aside)."""
    codings = [c.strip().lower() for c in value.split(",") if c.strip()]
    if not codings or codings.count("chunked") > 1:  # framing no reader can follow
        raise BadRequest(f"Transfer-Encoding {value[:60]!r} is not a transfer coding list")
    if codings != ["chunked"]:
        raise TransferCodingNotImplemented(
            f"Transfer-Encoding {value[:60]!r}: only chunked is understood (RFC 9112 6.1); "
            "send the body chunked alone, or with a Content-Length"
        )


def _check_repeated(name: bytes, value: bytes, first: str) -> None:
    if name == b"transfer-encoding":  # a second line: another coding (chunked twice: 400)
        _check_coding(f"{first}, {value.decode('latin-1')}")
    if name == b"host":
        raise InvalidHeader("Host is sent twice (RFC 9112 3.2: one Host header)")
    if value.decode("latin-1") != first:
        field = name.decode("latin-1")
        raise InvalidHeader(f"{field} is sent twice with different values")


class Reply(Response):
    """A whole response whose headers are final as given (framing included)."""

    def __init__(self, status: int, headers: RawHeaders, body: bytes) -> None:
        self.status_code = status
        self.raw_headers = headers
        self.body = body
        self.background = None
