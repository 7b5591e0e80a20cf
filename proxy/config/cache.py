"""``routes[].cache``: the response cache."""

from __future__ import annotations

from enum import StrEnum

from pydantic import (
    Field,
    field_validator,
)

from proxy.config.fields import Duration, Strict, Wait, check_methods, check_statuses

# How long a cached answer is served (routes[].cache.ttl), unless the tool says less.
DEFAULT_CACHE_TTL = 24 * 3600.0

# The methods whose answers are cached by default (HEAD never is: it has no body to keep).
DEFAULT_CACHE_METHODS = ("GET", "POST")

# Statuses cached by default: the successful ones that RFC 9111 lets a cache reuse
# without explicit freshness (heuristically cacheable).
DEFAULT_CACHE_STATUSES = (200, 203, 204)

# What cache.statuses may hold: RFC 9111 4.2.2's heuristically cacheable statuses but 206
# (the proxy does not combine ranges).
CACHEABLE_STATUSES = frozenset({200, 203, 204, 300, 301, 308, 404, 405, 410, 414, 501})

# The largest answer body the cache keeps (larger ones are passed on, not stored).
DEFAULT_CACHE_MAX_BYTES = 10 * 1024 * 1024


class CacheScope(StrEnum):
    """Who shares a route's cached answers."""

    PRINCIPAL = "principal"
    """Each authenticated caller has its own (the route needs ``auth``)."""
    ROUTE = "route"
    """Every caller of the route gets the same cached answer for the same request."""


class CachedTools(StrEnum):
    """Which MCP tools' ``tools/call`` answers the cache keeps (``protocol: mcp`` routes)."""

    ANNOTATED = "annotated"
    """Every tool whose ``tools/list`` entry says ``readOnlyHint: true`` (an unknown tool
    is not cached)."""


class CacheConfig(Strict):
    """A response cache for a tool whose answer depends only on the request."""

    ttl: Duration = DEFAULT_CACHE_TTL
    scope: CacheScope = CacheScope.PRINCIPAL
    methods: tuple[str, ...] = DEFAULT_CACHE_METHODS
    statuses: tuple[int, ...] = DEFAULT_CACHE_STATUSES
    wait: Wait | None = None
    """How long identical misses wait for the one call to the tool; None: as long as that
    call can take (``RouteConfig.cache_wait``). Past it, a waiter calls the tool itself."""
    max_bytes: int = Field(default=DEFAULT_CACHE_MAX_BYTES, ge=0)
    tools: CachedTools | tuple[str, ...] | None = None
    """On ``protocol: mcp`` routes, the tools whose ``tools/call`` is cached (None:
    ``annotated``); HTTP routes cache by ``methods`` and ``statuses`` instead."""

    @field_validator("tools")
    @classmethod
    def _tool_names(
        cls, tools: CachedTools | tuple[str, ...] | None
    ) -> CachedTools | tuple[str, ...] | None:
        if isinstance(tools, tuple) and (not tools or not all(tools)):
            raise ValueError("annotated, or a non-empty list of tool names")
        return tools

    def cached_tools(self) -> CachedTools | frozenset[str]:
        """``tools`` on an MCP route: ``annotated``, or the names."""
        if self.tools is None or isinstance(self.tools, CachedTools):
            return CachedTools.ANNOTATED
        return frozenset(self.tools)

    @field_validator("methods")
    @classmethod
    def _upper_methods(cls, methods: tuple[str, ...]) -> tuple[str, ...]:
        why = "HEAD is never cached (its answer has no body to keep)"
        return check_methods(methods, "cached", ("HEAD",), why)

    @field_validator("statuses")
    @classmethod
    def _statuses(cls, statuses: tuple[int, ...]) -> tuple[int, ...]:
        for status in check_statuses(statuses):
            if status not in CACHEABLE_STATUSES:
                allowed = ", ".join(str(s) for s in sorted(CACHEABLE_STATUSES))
                raise ValueError(f"{status} is not safe to reuse; cacheable: {allowed}")
        return statuses
