"""RFC 9457 problem details: the one place where errors become responses."""

from __future__ import annotations

import json
from http import HTTPStatus

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from proxy.errors import PROBLEM_BASE, ProxyError

MEDIA_TYPE = "application/problem+json"


def problem_body(exc: ProxyError) -> bytes:
    """The JSON document for ``exc``: type, title, status, detail."""
    return json.dumps(
        {"type": exc.type, "title": exc.title, "status": exc.status, "detail": exc.detail}
    ).encode()


def problem_response(exc: ProxyError) -> Response:
    """A problem+json response for ``exc``, with the headers it carries (e.g. Retry-After)."""
    return Response(problem_body(exc), exc.status, headers=exc.headers, media_type=MEDIA_TYPE)


async def handle_proxy_error(request: Request, exc: Exception) -> Response:
    """Starlette exception handler for every ``ProxyError``."""
    assert isinstance(exc, ProxyError)
    return problem_response(exc)


async def handle_http_exception(request: Request, exc: Exception) -> Response:
    """Starlette's own errors (e.g. 405 on /_proxy/healthz) as problem documents too."""
    assert isinstance(exc, HTTPException)
    phrase = HTTPStatus(exc.status_code).phrase
    body = json.dumps(
        {
            "type": PROBLEM_BASE + phrase.lower().replace(" ", "-"),
            "title": phrase,
            "status": exc.status_code,
            "detail": str(exc.detail),
        }
    ).encode()
    return Response(body, exc.status_code, headers=exc.headers, media_type=MEDIA_TYPE)


def raw_problem_response(exc: ProxyError) -> bytes:
    """``exc`` as a whole HTTP/1.1 response, for the protocol layer: a request the HTTP
    parser refused, or a head above the limit, answered before any ASGI app sees it.
    The connection is closed after it."""
    body = problem_body(exc)
    lines = [
        f"HTTP/1.1 {exc.status} {HTTPStatus(exc.status).phrase}",
        f"content-type: {MEDIA_TYPE}",
        f"content-length: {len(body)}",
        "connection: close",
        *(f"{name}: {value}" for name, value in exc.headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def internal_error_response() -> Response:
    """Last resort: a bug. The caller gets a problem document, never a traceback."""
    body = json.dumps(
        {
            "type": PROBLEM_BASE + "internal-error",
            "title": "Internal error",
            "status": 500,
            "detail": "tool-proxy hit an unexpected error; it is logged.",
        }
    ).encode()
    return Response(body, 500, media_type=MEDIA_TYPE)
