"""Running the app under uvicorn (uvloop, httptools), one or several worker processes."""

from __future__ import annotations

import asyncio
import math
import os
from typing import Any, cast

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from proxy.config import ENV_CONFIG
from proxy.logs import ENV_LOG_LEVEL
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


class ProxyHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with two changes.

    - Requests whose target is not origin-form are marked: httptools keeps only the path
      of ``GET http://host/path HTTP/1.1``; the app must know the target was absolute-form
      to refuse it, so this sets a scope extension.
    - The transport is a :class:`CoalescingTransport`: one write per response.
    """

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(cast(asyncio.Transport, CoalescingTransport(transport)))

    def on_headers_complete(self) -> None:
        if not self.url.startswith(b"/"):
            scope = cast(dict[str, Any], self.scope)
            scope.setdefault("extensions", {})[ABSOLUTE_FORM] = {}
        super().on_headers_complete()


def serve(
    config_path: str | None,
    host: str,
    port: int,
    workers: int,
    log_level: str,
    graceful_seconds: float,
) -> None:
    """Serve until SIGTERM/SIGINT; in-flight upstream calls finish and are recorded first.

    After ``graceful_seconds`` uvicorn stops waiting for requests (a response still
    streaming to a caller that stopped reading, say) and cancels them; a guarded call
    still in flight then (a 401 retry, a slow token endpoint) is cancelled too, and
    recorded FAILED (outcome unknown), never left to run again.
    """
    if config_path:
        os.environ[ENV_CONFIG] = os.path.abspath(config_path)
    os.environ[ENV_LOG_LEVEL] = log_level
    uvicorn.run(
        "proxy.app:app_from_env",
        factory=True,
        host=host,
        port=port,
        workers=workers if workers > 1 else None,
        loop="uvloop",
        http=ProxyHttpProtocol,
        log_level=log_level,
        access_log=False,
        server_header=False,
        date_header=False,
        lifespan="on",
        proxy_headers=False,  # the peer address is the client: X-Forwarded-For is appended to
        timeout_graceful_shutdown=math.ceil(graceful_seconds),
    )
