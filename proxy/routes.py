"""Route matching: the longest ``path_prefix`` wins; only safe origin-form paths pass.

Only configured routes are forwarded, so tool-proxy is never an open proxy:
absolute-form targets, dot segments, empty segments (``//``) and encoded slashes are
rejected before matching, so the upstream URL is always the route's base and a path.
"""

from __future__ import annotations

from collections.abc import Iterable

from proxy.config import RESERVED_PREFIX, RouteConfig
from proxy.errors import InvalidPath, RouteNotFound

# Set in the ASGI scope's extensions by ``server.ProxyHttpProtocol`` for a request
# whose target is not origin-form (``GET http://elsewhere/ HTTP/1.1``).
ABSOLUTE_FORM = "tool_proxy.absolute_form"

_ENCODED_SEPARATORS = (b"%2f", b"%2F", b"%5c", b"%5C", b"\\")


def check_path(path: str, raw_path: bytes) -> None:
    """Raise ``InvalidPath`` for paths that could escape a route's prefix."""
    if not path.startswith("/"):
        raise InvalidPath("the request target must be an absolute path (origin-form)")
    # find() and not ``in``: CPython 3.11 tries a bytes operand of ``in`` as an integer
    # first and formats the TypeError it drops (several times the cost of the search)
    if (raw_path.find(b"%") != -1 or raw_path.find(b"\\") != -1) and any(
        s in raw_path for s in _ENCODED_SEPARATORS
    ):
        raise InvalidPath("encoded '/' or '\\' are not allowed in the path")
    if "/." in path and any(seg in (".", "..") for seg in path.split("/")):
        raise InvalidPath("dot segments ('.', '..') are not allowed in the path")
    if "//" in path:  # '//host/x' appended to a base reads as another authority to some
        raise InvalidPath("empty path segments ('//') are not allowed in the path")
    if "\x00" in path:
        raise InvalidPath("NUL is not allowed in the path")


def _under(path: str, prefix: str) -> bool:
    return prefix == "/" or path == prefix or path.startswith(prefix + "/")


def _first_segment(path: str) -> str:
    """``tools`` of ``/tools/charge`` (and of ``/tools``); ``""`` of ``/``."""
    return path.split("/", 2)[1] if path.startswith("/") else ""


class Router:
    """Routes by the first segment of their prefix, each segment's longest first; a
    request is matched against its own segment's routes, then the root route's."""

    def __init__(self, routes: Iterable[RouteConfig]) -> None:
        self.routes = sorted(routes, key=lambda r: len(r.path_prefix), reverse=True)
        self._by_segment: dict[str, tuple[RouteConfig, ...]] = {}
        for route in self.routes:
            segment = "" if route.path_prefix == "/" else _first_segment(route.path_prefix)
            self._by_segment[segment] = (*self._by_segment.get(segment, ()), route)
        self._root = self._by_segment.pop("", ())

    def match(self, path: str) -> RouteConfig:
        """The route for ``path`` or ``RouteNotFound`` (never for the proxy's own paths):
        the longest prefix that ``path`` is under."""
        if _under(path, RESERVED_PREFIX):
            raise RouteNotFound(f"{path} is not one of the proxy's own endpoints")
        for route in self._by_segment.get(_first_segment(path), ()):
            if _under(path, route.path_prefix):
                return route
        if self._root:
            return self._root[0]
        raise RouteNotFound(f"no route serves {path}")


def upstream_url(route: RouteConfig, raw_path: bytes, query: bytes) -> str:
    """The URL to forward to: the upstream base, the (maybe stripped) path and the query."""
    path = raw_path.decode("latin-1")
    if route.strip_prefix and route.path_prefix != "/":
        if not _under(path, route.path_prefix):
            raise InvalidPath("the route prefix must not be percent-encoded in the path")
        path = path[len(route.path_prefix) :] or "/"
    url = route.upstream + path
    return f"{url}?{query.decode('latin-1')}" if query else url
