"""Running the app under uvicorn (uvloop, httptools), one or several worker processes."""

from __future__ import annotations

import os
from typing import Any, cast

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from proxy.config import ENV_CONFIG
from proxy.logs import ENV_LOG_LEVEL
from proxy.routes import ABSOLUTE_FORM


class ProxyHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, marking requests whose target is not origin-form.

    httptools keeps only the path of ``GET http://host/path HTTP/1.1``; the app must know
    the target was absolute-form to refuse it, so this sets a scope extension.
    """

    def on_headers_complete(self) -> None:
        if not self.url.startswith(b"/"):
            scope = cast(dict[str, Any], self.scope)
            scope.setdefault("extensions", {})[ABSOLUTE_FORM] = {}
        super().on_headers_complete()


def serve(config_path: str | None, host: str, port: int, workers: int, log_level: str) -> None:
    """Serve until SIGTERM/SIGINT; in-flight upstream calls finish and are recorded first."""
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
    )
