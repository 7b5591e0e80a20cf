"""``routes[]``: one route, the capabilities it combines, and their checks across sections."""

from __future__ import annotations

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from proxy.config.auth import (
    TOKEN_TIMEOUT_SECONDS,
    RouteAuthConfig,
    TokenConfig,
    TokenMode,
    check_http_url,
)
from proxy.config.cache import CacheConfig, CacheScope
from proxy.config.fields import Duration, Strict, Wait, check_name
from proxy.config.idempotency import IdempotencyConfig, ReconcileConfig
from proxy.config.jobs import AsyncConfig, AsyncMode, WorkersConfig
from proxy.config.limits import DEFAULT_PAUSE_MAX, LimitConfig, PauseScope, StoreDown
from proxy.config.mcp import McpConfig, RouteProtocol
from proxy.config.resources import (
    DEFAULT_RESOURCE_WAIT,
    DEFAULT_VERSION_TTL,
    LockConfig,
    ResourceConfig,
    VersioningConfig,
    resource_scope,
)
from proxy.keys import KeyKind

# The whole upstream exchange (connect, send, wait, read) must fit in this.
DEFAULT_TIMEOUT = 30.0

# Paths under this prefix are the proxy's own (/_proxy/healthz, /_proxy/readyz).
RESERVED_PREFIX = "/_proxy"


class RouteConfig(Strict):
    """One tool behind the proxy."""

    name: str
    path_prefix: str
    upstream: str
    strip_prefix: bool = False
    timeout: Duration = DEFAULT_TIMEOUT
    idempotency: IdempotencyConfig | None = None
    auth: RouteAuthConfig | None = None
    token: TokenConfig | None = None
    reconcile: ReconcileConfig | None = None

    @model_validator(mode="after")
    def _reconcile_needs_keys(self) -> RouteConfig:
        if self.reconcile is None:
            return self
        if self.idempotency is None:
            raise ValueError("reconcile: needs idempotency (it settles unknown outcomes)")
        composite_only = self.reconcile.placeholders() - {"key"}
        if self.idempotency.key is KeyKind.OPAQUE and composite_only:
            raise ValueError(
                f"reconcile.path: {{{min(composite_only)}}} needs composite keys; use {{key}}"
            )
        return self

    limits: tuple[LimitConfig, ...] | None = None
    """Present (even empty): the route follows the tool's own limits (429/503 pauses)."""
    limit_wait: Wait = 0.0
    limits_on_store_down: StoreDown = StoreDown.CLOSED
    pause_scope: PauseScope = PauseScope.CALLER
    pause_max: Duration = DEFAULT_PAUSE_MAX
    resource: ResourceConfig | None = None
    lock: LockConfig | None = None
    versioning: VersioningConfig | None = None

    @model_validator(mode="after")
    def _resource_keys(self) -> RouteConfig:
        parts = (("resource", self.resource), ("lock", self.lock), ("versioning", self.versioning))
        for name, part in parts:
            if part is None:
                continue
            if name != "resource" and (part.key is None) == (self.resource is None):
                raise ValueError(
                    f"{name}.key: required without routes[].resource"
                    if self.resource is None
                    else f"{name}.key: the route names its resource (resource.key): drop it"
                )
            if part.key == "principal" and self.auth is None:
                raise ValueError(f"{name}.key: principal needs the route's auth (a caller)")
        if (
            self.resource is not None
            and self.protocol is RouteProtocol.MCP
            and "writes" in self.resource.model_fields_set
        ):
            raise ValueError(
                "resource.writes: not on protocol: mcp routes (every MCP request is a POST: "
                "a tools/call the cache does not answer is a write of its resource)"
            )
        return self

    def resource_name(self) -> str | None:
        """The name of the resource the route's requests are about (``resource.name``, else
        the route's own name); None without ``routes[].resource``."""
        if self.resource is None:
            return None
        return self.resource.name or self.name

    def resource_scope(self, policy: str = "") -> str:
        """Where the route's resource state is kept in the store: the named resource's
        scope (shared by the routes that name it), or the route's own (legacy keys)."""
        name = self.resource_name()
        scope = self.name if name is None else resource_scope(name)
        return f"{scope}|{policy}" if policy else scope

    def resource_key(self, part: LockConfig | VersioningConfig | None = None) -> str:
        """The key form that names a request's resource: ``part``'s own, or ``resource.key``."""
        if part is not None and part.key is not None:
            return part.key
        assert self.resource is not None  # checked by _resource_keys
        return self.resource.key

    def version_ttl(self) -> float:
        """How long the resource's versions are kept after their last use."""
        return DEFAULT_VERSION_TTL if self.versioning is None else self.versioning.ttl

    def write_methods(self) -> frozenset[str]:
        """The methods that change the route's resource: ``resource.writes`` and the
        versioned methods."""
        writes = set(self.resource.writes) if self.resource is not None else set()
        if self.versioning is not None:
            writes |= set(self.versioning.methods)
        return frozenset(writes)

    def resource_wait(self) -> float:
        """The longest a call waits for its resource's lock and version reservation (a
        write of a resource with cached reads takes the reservation without versioning)."""
        lock = 0.0 if self.lock is None else self.lock.wait
        return lock + self.reservation_wait()

    def reservation_wait(self) -> float:
        """How long a write waits for its resource's reservation: ``versioning.wait``;
        without versioning, on a route with a resource, the default."""
        if self.versioning is not None:
            return self.versioning.wait
        return 0.0 if self.resource is None else DEFAULT_RESOURCE_WAIT

    async_: AsyncConfig | None = Field(default=None, alias="async")
    workers: WorkersConfig = WorkersConfig()

    @model_validator(mode="after")
    def _async_needs_idempotency(self) -> RouteConfig:
        if self.async_ is None or self.async_.mode is AsyncMode.NEVER:
            return self
        if self.idempotency is None:
            raise ValueError("async: needs idempotency (a job concludes the call's record)")
        if self.async_.visibility >= self.idempotency.lock_ttl:
            raise ValueError(
                "async.visibility must be below idempotency.lock_ttl (a job whose worker "
                "died is taken over before its record's lease lapses)"
            )
        return self

    def runs_jobs(self) -> bool:
        """True if some calls of this route are answered 202 and run by workers."""
        return self.async_ is not None and self.async_.mode is not AsyncMode.NEVER

    protocol: RouteProtocol = RouteProtocol.HTTP
    mcp: McpConfig | None = None

    @model_validator(mode="after")
    def _mcp_needs_protocol(self) -> RouteConfig:
        if self.mcp is not None and self.protocol is not RouteProtocol.MCP:
            raise ValueError("mcp: needs protocol: mcp")
        if self.reconcile is not None and self.protocol is RouteProtocol.MCP:
            raise ValueError(
                "reconcile: not on protocol: mcp routes (a look-up's answer is no JSON-RPC "
                "response to replay)"
            )
        return self

    cache: CacheConfig | None = None

    @model_validator(mode="after")
    def _cache_fits_the_route(self) -> RouteConfig:
        cache = self.cache
        if cache is None:
            return self
        if cache.scope is CacheScope.PRINCIPAL and self.auth is None:
            raise ValueError(
                "cache.scope: principal needs the route's auth (a caller); scope: route "
                "shares the cached answers between all callers"
            )
        if self.protocol is RouteProtocol.MCP:
            http_only = sorted({"methods", "statuses"} & cache.model_fields_set)
            if http_only:
                raise ValueError(
                    f"cache.{http_only[0]}: not on protocol: mcp routes (every MCP request is a "
                    "POST; a tools/call is cached by tool, cache.tools, and only a successful "
                    "result is kept)"
                )
        elif cache.tools is not None:
            raise ValueError("cache.tools: only on protocol: mcp routes (tools/call answers)")
        if self.versioning is not None and self.resource is None:
            raise ValueError(
                "cache and versioning: on one route they need routes[].resource (so that "
                "cached reads carry its ETag and its writes invalidate them)"
            )
        if self.resource is not None and self.protocol is not RouteProtocol.MCP:
            writes = sorted(set(cache.methods) & self.write_methods())
            if writes and "methods" in cache.model_fields_set:
                raise ValueError(
                    f"cache.methods: {writes[0]} writes the route's resource (resource.writes, "
                    "versioning.methods): a write is never answered from the cache"
                )
        return self

    def cached_methods(self) -> frozenset[str]:
        """The methods whose answers the cache keeps: ``cache.methods``, but the resource's
        writes (by default POST is both: on a route with a resource it is a write)."""
        if self.cache is None:
            return frozenset()
        return frozenset(self.cache.methods) - self.write_methods()

    def cache_wait(self) -> float:
        """The longest a cache miss waits for an identical call's answer: by default as
        long as that call can take (``send_seconds``, the bound of the fill lock too)."""
        if self.cache is None:
            return 0.0
        if self.cache.wait is not None:
            return self.cache.wait
        return self.send_seconds()

    def send_seconds(self) -> float:
        """The longest the send of one call can take: its token fetches and sends (two of
        each with ``token.retry_on_401``), and the waits of limits and resources."""
        token = self.token
        sends = 2 if token is not None and token.retry_on_401 else 1
        fetches = token is not None and token.mode is not TokenMode.PASSTHROUGH
        seconds = (self.timeout + (TOKEN_TIMEOUT_SECONDS if fetches else 0.0)) * sends
        return seconds + self.limit_wait + self.resource_wait()

    @field_validator("limits")
    @classmethod
    def _unique_limits(
        cls, limits: tuple[LimitConfig, ...] | None
    ) -> tuple[LimitConfig, ...] | None:
        names = [limit.name for limit in limits or ()]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"limit names must be unique: {', '.join(repeated)} repeated")
        return limits

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        return check_name(name, "route")

    @field_validator("path_prefix")
    @classmethod
    def _prefix(cls, prefix: str) -> str:
        if not prefix.startswith("/") or "//" in prefix or "/../" in f"{prefix}/" or "%" in prefix:
            raise ValueError("must start with '/' and be a plain path (no '//', '..' or '%')")
        prefix = prefix.rstrip("/") or "/"
        if prefix == RESERVED_PREFIX or prefix.startswith(RESERVED_PREFIX + "/"):
            raise ValueError(f"{RESERVED_PREFIX} is reserved for the proxy's own endpoints")
        return prefix

    @field_validator("upstream")
    @classmethod
    def _upstream(cls, upstream: str) -> str:
        parts = check_http_url(upstream)
        if parts.query or parts.fragment:
            raise ValueError("an upstream is a base URL: no query or fragment")
        if parts.username is not None:
            raise ValueError(
                "an upstream has no user or password: a URL reaches logs and traces, and "
                "the client refuses credentials in it next to a caller's Authorization"
            )
        return upstream.rstrip("/")
