"""Running the app under uvicorn (uvloop, httptools), one or several worker processes."""

from __future__ import annotations

import asyncio
import functools
import math
import os
from typing import Any, cast

import uvicorn
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from proxy.config import (
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_HEADER_TIMEOUT,
    DEFAULT_MAX_HEADER_BYTES,
    ENV_CONFIG,
    ENV_HOST,
)
from proxy.errors import BadRequest, HeaderFieldsTooLarge, ProxyError, RequestTimeout
from proxy.logs import ENV_LOG_LEVEL
from proxy.problems import raw_problem_response
from proxy.routes import ABSOLUTE_FORM


class CoalescingTransport:
    """A transport whose writes made in one step of the event loop leave together.

    uvicorn writes a response's head and its body separately; on their own they are two
    system calls and two TCP segments per response. Buffered until the step ends (one
    ``call_soon``), they are one. Everything but ``write`` and ``close`` is the wrapped
    transport's own.
    """

    __slots__ = ("_buffer", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._loop = asyncio.get_running_loop()
        self._buffer: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._buffer:
            self._loop.call_soon(self._flush)
        self._buffer.append(data)

    def _flush(self) -> None:
        buffer, self._buffer = self._buffer, []
        if len(buffer) == 1:
            self._transport.write(buffer[0])
        elif buffer:
            self._transport.writelines(buffer)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _Refused(Exception):
    """Raised in a parser callback to stop httptools: the request has been refused."""


# While the proxy itself holds a body back (reading paused, 100-continue not yet sent), its
# timer looks again after this share of limits.body_timeout.
HELD_SHARE = 0.1


class ProxyHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with five changes.

    - Requests whose target is not origin-form are marked: httptools keeps only the path
      of ``GET http://host/path HTTP/1.1``; the app must know the target was absolute-form
      to refuse it, so this sets a scope extension.
    - The transport is a :class:`CoalescingTransport`: one write per response.
    - The request head (request line and header lines) is limited to ``max_header_bytes``
      (431). httptools hands a header over only once it is whole, so the bytes are counted
      as they arrive: a head is refused as soon as the chunks received wholly inside it
      pass the limit, and once complete if its lines do. At most the limit and two reads
      of the socket are ever buffered.
    - A request the HTTP parser refuses gets a problem+json 400, not uvicorn's plain text.
      That overrides ``send_400_response``, uvicorn's own (tests/test_server.py fails if
      uvicorn stops calling it so).
    - A request head must arrive whole within ``header_seconds`` (from the connection, or
      from its first byte on a kept-alive one), and a body may go ``body_seconds`` without
      a byte (not counting while the proxy itself does not read it: paused, or not yet
      asked for under ``Expect: 100-continue``): else 408 and the connection is closed
      (the app, if it waits for the body, sees the caller leave; a guarded call is
      claimed only once its body is whole). A new connection that sends nothing is
      closed silently after ``header_seconds``. uvicorn has neither bound (a stalled
      caller held a connection for ever). Past the connection's first, a timer runs only
      while a head or body is incomplete after a read.
    """

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
        *,
        max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
        header_seconds: float = DEFAULT_HEADER_TIMEOUT,
        body_seconds: float = DEFAULT_BODY_TIMEOUT,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.max_header_bytes = max_header_bytes
        self.header_seconds = header_seconds
        self.body_seconds = body_seconds
        self._timer: asyncio.TimerHandle | None = None
        self._in_body = False  # between a head and the end of its body
        self._body_at = 0.0  # when a body's bytes last came (the loop's clock)
        self._head_bytes: int | None = None  # None: not inside a request head
        self._chunk = 0  # the length of the chunk being parsed
        self._first = 0  # the length of the chunk the request head began in
        self._refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(cast(asyncio.Transport, CoalescingTransport(transport)))
        self._arm(self.header_seconds)  # the first head, counted from the connection

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:  # answered, the connection is closing
            return
        self._chunk = len(data)
        inside = self._head_bytes is not None
        super().data_received(data)
        if inside and self._head_bytes is not None and not self._refused:
            self._head_bytes += len(data)  # a chunk all of whose bytes are head
            if self._head_bytes > self.max_header_bytes:
                self._refuse(self._too_large())
        if self._in_body:
            self._body_at = self.loop.time()
            if self._timer is None:
                self._arm(self.body_seconds * HELD_SHARE if self._held() else self.body_seconds)
        elif self._head_bytes is not None and self._timer is None:
            self._arm(self.header_seconds)  # a kept-alive connection's next head

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = 0
        self._first = self._chunk

    def on_headers_complete(self) -> None:
        # The head is within the chunk it began in, those wholly inside it and this one:
        # its lines are counted only when that bound is over the limit (a large chunk).
        bound = self._first + (self._head_bytes or 0) + self._chunk
        self._head_bytes = None
        self._disarm()
        self._in_body = True
        if bound > self.max_header_bytes and self._head_size() > self.max_header_bytes:
            self._refuse(self._too_large())
            raise _Refused  # stops the parser; uvicorn then calls send_400_response
        if not self.url.startswith(b"/"):
            scope = cast(dict[str, Any], self.scope)
            scope.setdefault("extensions", {})[ABSOLUTE_FORM] = {}
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_body = False
        self._disarm()
        super().on_message_complete()

    def _arm(self, seconds: float) -> None:
        self._timer = self.loop.call_later(seconds, self._late)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _held(self) -> bool:
        """Whether the proxy itself keeps the body from coming: reading paused, or the
        ``100 Continue`` not yet sent."""
        cycle = self.cycle
        return self.flow.read_paused or (cycle is not None and cycle.waiting_for_100_continue)

    def _late(self) -> None:
        """The head or the body has stopped arriving: 408, unless the proxy itself paused
        reading (a body streamed to a slow upstream) or a body's bytes came meanwhile."""
        self._timer = None
        cycle = self.cycle
        if self._in_body:
            if self._held():
                # the proxy is the one not reading yet: looked at again soon, so that
                # at most a tenth of the bound passes uncounted once it reads
                self._body_at = self.loop.time()
                self._arm(self.body_seconds * HELD_SHARE)
                return
            idle = self.loop.time() - self._body_at
            if idle < self.body_seconds:
                self._arm(self.body_seconds - idle)
                return
            late = f"the request body sent nothing for {self.body_seconds:g} s"
        elif self._head_bytes is None:  # not a byte of a request: an idle connection
            self._refused = True
            self.transport.close()
            return
        elif cycle is not None and not cycle.response_complete:
            # a pipelined head behind a request still answered: not timed out while that
            # answer is unfinished, looked at again a whole bound later (a 408 now would
            # read as the earlier request's answer)
            self._arm(self.header_seconds)
            return
        else:
            late = f"the request head did not arrive whole within {self.header_seconds:g} s"
        if self._in_body and cycle is not None and cycle.response_started:
            # the body's request is being answered, or was answered whole (an app that
            # answered without reading it): a 408 now would be read as another answer
            self._refused = True
            self.transport.close()
            return
        self._refuse(RequestTimeout(late))

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request its parser refused, as a problem document; if a
        response is being sent on the connection (a pipelined request after it is
        malformed), nothing can be said any more: the connection is closed."""
        cycle = self.cycle
        if cycle is not None and cycle.response_started and not cycle.response_complete:
            self._refused = True
            self.transport.close()
            return
        self._refuse(BadRequest("the request is not valid HTTP/1.1; the HTTP parser refused it"))

    def _head_size(self) -> int:
        """The head's size as parsed: request line, header lines, the blank line."""
        line = len(self.parser.get_method()) + len(self.url) + len(b"  HTTP/1.1\r\n")
        return line + sum(len(name) + len(value) + 4 for name, value in self.headers) + 2

    def _too_large(self) -> HeaderFieldsTooLarge:
        return HeaderFieldsTooLarge(
            f"the request line and headers are over the limit of {self.max_header_bytes} bytes"
        )

    def _refuse(self, exc: ProxyError) -> None:
        """Answer ``exc`` once and close the connection; nothing more is parsed."""
        if self._refused:
            return
        self._refused = True
        self._disarm()
        self.transport.write(raw_problem_response(exc))
        self.transport.close()


def serve(
    config_path: str | None,
    host: str,
    port: int,
    workers: int,
    log_level: str,
    graceful_seconds: float,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
    header_seconds: float = DEFAULT_HEADER_TIMEOUT,
    body_seconds: float = DEFAULT_BODY_TIMEOUT,
) -> None:
    """Serve until SIGTERM/SIGINT; in-flight upstream calls finish and are recorded first.

    After ``graceful_seconds`` uvicorn stops waiting for requests (a response still
    streaming to a caller that stopped reading, say) and cancels them; a guarded call
    still in flight then (a 401 retry, a slow token endpoint) is cancelled too, and
    recorded FAILED (outcome unknown), never left to run again.

    ``max_header_bytes`` and the head and body timeouts reach the protocol as arguments
    bound to its class (a partial: it survives the pickling that hands the configuration
    to worker processes).
    ``host`` reaches the app as ``server.host`` (``ENV_HOST``): its Host checks follow
    the address actually bound, whatever the file says.
    """
    protocol = functools.partial(
        ProxyHttpProtocol,
        max_header_bytes=max_header_bytes,
        header_seconds=header_seconds,
        body_seconds=body_seconds,
    )
    if config_path:
        os.environ[ENV_CONFIG] = os.path.abspath(config_path)
    os.environ[ENV_HOST] = host
    os.environ[ENV_LOG_LEVEL] = log_level
    uvicorn.run(
        "proxy.app:app_from_env",
        factory=True,
        host=host,
        port=port,
        workers=workers if workers > 1 else None,
        loop="uvloop",
        http=cast(type[asyncio.Protocol], protocol),
        ws="none",  # not a WebSocket proxy: no library's own plain-text 403 either
        log_level=log_level,
        access_log=False,
        server_header=False,
        date_header=False,
        lifespan="on",
        proxy_headers=False,  # the peer address is the client: X-Forwarded-For is appended to
        timeout_graceful_shutdown=math.ceil(graceful_seconds),
    )
