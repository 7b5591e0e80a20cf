"""The YAML configuration: validated models, defaults, and every problem reported at once.

Unknown keys are errors. Durations are seconds (a number) or a string with a unit:
``250ms``, ``5s``, ``2m``, ``24h``, ``7d``.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

import jsonpointer
import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from proxy.errors import ConfigError
from proxy.hosts import check_host_entry, check_origin_entry
from proxy.keys import Canonicalization, KeyKind
from proxy.numbers import whole
from proxy.store.base import Durability

# The store used when the file names none: the embedded SQLite database.
DEFAULT_STORE_URL = "sqlite:///var/lib/tool-proxy/state.db"
# Where `serve` listens unless the file or --host/--port say otherwise.
DEFAULT_HOST = "0.0.0.0"
DEFAULT_PORT = 8080
# Request bodies above this get 413 and are never forwarded (10 MiB).
DEFAULT_MAX_BODY_BYTES = 10 * 1024 * 1024
# JSON bodies that nest arrays and objects deeper than this are refused before they are
# parsed (400). serde_json's default; tool arguments nest a few levels (structured
# outputs of LLM APIs allow 5 to 10), and the decoders and the RFC 8785 encoder, which
# recurse once per level, stay far below Python's recursion limit (1000).
DEFAULT_MAX_JSON_DEPTH = 128
# The most that limits.max_json_depth may be: room left under Python's recursion limit.
MAX_JSON_DEPTH_LIMIT = 512
# A request head (request line and header lines) above this gets 431: Envoy's default
# (60 KiB); nginx allows 32 KiB in all (4 lines of 8 KiB). Room for large bearer tokens.
DEFAULT_MAX_HEADER_BYTES = 60 * 1024
# The least that limits.max_header_bytes may be.
MIN_HEADER_BYTES = 1024
# The whole upstream exchange (connect, send, wait, read) must fit in this.
DEFAULT_TIMEOUT = 30.0
# Guarded by default: the non-idempotent methods.
DEFAULT_METHODS = ("POST", "PATCH")
# The IN_PROGRESS lease; renewed every lock_ttl/3 while the upstream works.
DEFAULT_LOCK_TTL = 120.0
# How long COMPLETED and FAILED outcomes are replayed.
DEFAULT_RESULT_TTL = 24 * 3600.0
# Retry-After sent with a 409 (capped by the time left on the lease).
DEFAULT_RETRY_AFTER = 5.0
# Response bodies above this go to object storage when `offload` is configured.
DEFAULT_OFFLOAD_THRESHOLD = 100 * 1024
# Token signatures accepted unless an issuer pins others (never symmetric ones or none).
DEFAULT_ALGORITHMS = ("RS256", "ES256")
# Clock skew tolerated on exp, nbf and iat.
DEFAULT_LEEWAY = 30.0
# The claims whose values scope idempotency records to one caller.
DEFAULT_PRINCIPAL_CLAIMS = ("iss", "sub")
# Downstream tokens are renewed at this fraction of their lifetime.
DEFAULT_REFRESH_AHEAD = 0.8
# Downstream tokens kept in each process at most (auth.token_cache_entries): one per route,
# user and grant in use; the least recently used is evicted first.
DEFAULT_TOKEN_CACHE_ENTRIES = 10_000
# How long fetched signing keys are trusted before they are fetched again.
DEFAULT_JWKS_TTL = 300.0
# How long a presigned URL of an offloaded body (offload.presign) stays valid.
DEFAULT_PRESIGN_TTL = 300.0
# Upstream statuses that are passed on but release the key, so a retry executes: only
# those that mean "not run". 502 and 504 are opt-in: behind an ingress, a mesh or a load
# balancer they come after the tool may have run the call.
DEFAULT_RELEASE_ON_STATUS = (408, 425, 429, 503)
# The JWT claim holding an operator's roles (admin.role must be one of them).
DEFAULT_ROLES_CLAIM = "roles"

# The longest a tool's own 429/503 reset pauses calls (routes[].pause_max): a wrong or
# hostile Retry-After cannot stop a caller, or a route, for longer.
DEFAULT_PAUSE_MAX = 60.0

# A concurrency slot's lease (routes[].limits[].slot_ttl): renewed every third of it while
# the call runs; the slots of a replica that dies are free again at most this long after.
DEFAULT_SLOT_TTL = 10.0

# Where the journal lives when the store is Redis and no state_dir is configured (for
# SQLite: the database's directory; memory:// keeps no journal).
DEFAULT_STATE_DIR = "/var/lib/tool-proxy"

# How long a reconcile look-up may take, and how often a proxy asks again about one FAILED
# record when retries meet it (at least RECONCILE_INTERVAL apart).
DEFAULT_RECONCILE_TIMEOUT = 5.0
DEFAULT_RECONCILE_RETRIES = 3
DEFAULT_RECONCILE_INTERVAL = 5.0

# store.durability: how long a claim or an outcome waits for its replicas by default, and
# at most (a WAIT holds back every command behind it on the connection requests share).
DEFAULT_DURABILITY_TIMEOUT = 0.2
MAX_DURABILITY_TIMEOUT = 5.0
# The most replicas store.durability.replicas may ask for (Redis counts them in an int).
MAX_DURABILITY_REPLICAS = 64

# Paths under this prefix are the proxy's own (/_proxy/healthz, /_proxy/readyz).
RESERVED_PREFIX = "/_proxy"

ENV_CONFIG = "TOOL_PROXY_CONFIG"
ENV_STORE_URL = "TOOL_PROXY_STORE_URL"
ENV_STATE_DIR = "TOOL_PROXY_STATE_DIR"
# The address `serve` binds (--host), for the app in each worker: the Host checks follow it.
ENV_HOST = "TOOL_PROXY_HOST"

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)\s*")
_ROUTE_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
_METHOD = re.compile(r"[A-Z]{1,20}")
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}")
_QUOTA = re.compile(r"\d+(?:\.\d+)?")
_STORE_SCHEMES = ("memory", "sqlite", "redis", "rediss", "postgresql", "postgres")
# Redis Cluster (seed nodes) and Sentinel (the sentinels, then /<master-name>).
_REDIS_TOPOLOGIES = ("+cluster", "+sentinel")
_ASYMMETRIC_ALGORITHMS = (
    "RS256",
    "RS384",
    "RS512",
    "PS256",
    "PS384",
    "PS512",
    "ES256",
    "ES384",
    "ES512",
    "EdDSA",
)
_OFFLOAD_SCHEMES = ("s3", "s3a", "gs", "az", "azure", "abfs", "abfss", "file", "memory")


def check_statuses(statuses: tuple[int, ...]) -> tuple[int, ...]:
    """``statuses`` if each is an HTTP status, else ValueError naming the first that is not."""
    for status in statuses:
        if not 100 <= status <= 599:
            raise ValueError(f"not an HTTP status: {status}")
    return statuses


def check_name(name: str, what: str) -> str:
    """``name`` if it may name a route or a limit (in logs and metrics), else ValueError."""
    if not _ROUTE_NAME.fullmatch(name):
        raise ValueError(f"a {what} name is 1..64 characters of [A-Za-z0-9._-]")
    return name


def parse_duration(value: Any) -> float:
    """Seconds from a number or a string such as ``250ms``, ``5s``, ``2m``, ``24h``, ``7d``."""
    if isinstance(value, bool):
        raise ValueError("expected a duration such as 5s, 2m, 24h")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and (match := _DURATION.fullmatch(value)):
        seconds = float(match[1]) * _UNITS[match[2]]
    else:
        raise ValueError(f"not a duration: {value!r} (use a number of seconds or 250ms, 5s, 2m)")
    if not math.isfinite(seconds):
        raise ValueError("a duration must be a finite number of seconds")
    if seconds <= 0:
        raise ValueError("a duration must be positive")
    return seconds


def parse_wait(value: Any) -> float:
    """Like :func:`parse_duration`, but zero (``0``, ``0s``) is allowed: no waiting."""
    if isinstance(value, str) and (match := _DURATION.fullmatch(value)):
        value = float(match[1]) * _UNITS[match[2]]
    if value == 0 and not isinstance(value, bool):
        return 0.0
    return parse_duration(value)


Duration = Annotated[float, BeforeValidator(parse_duration)]
Wait = Annotated[float, BeforeValidator(parse_wait)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DurabilityConfig(_Strict):
    """``store.durability`` (Redis only): a claim, a lease's renewal and a recorded
    outcome count as written once ``replicas`` replicas have them (``WAIT``; with
    ``aof``, ``WAITAOF``: in the primary's append-only file and in theirs), within
    ``timeout``. A claim not confirmed is released and not sent (503); an outcome not
    confirmed goes to the journal and is written again."""

    replicas: int = Field(ge=1, le=MAX_DURABILITY_REPLICAS)
    timeout: Duration = DEFAULT_DURABILITY_TIMEOUT
    aof: bool = False

    @field_validator("timeout")
    @classmethod
    def _short(cls, timeout: float) -> float:
        if timeout > MAX_DURABILITY_TIMEOUT:
            raise ValueError(
                f"at most {MAX_DURABILITY_TIMEOUT:g}s: a WAIT holds back every command "
                "behind it on the connection that requests share"
            )
        return timeout

    def spec(self) -> Durability:
        return Durability(self.replicas, self.timeout, self.aof)


class StoreConfig(_Strict):
    """Where idempotency records live."""

    url: str = DEFAULT_STORE_URL
    sealing_key_env: str | None = None
    """The environment variable holding the key that seals the credentials of async
    jobs' stored requests (else ``auth.token_cache_key_env``'s key does)."""
    durability: DurabilityConfig | None = None
    """None: a write counts once the store (the Redis primary) has it."""

    @field_validator("url")
    @classmethod
    def _known_scheme(cls, url: str) -> str:
        return check_store_url(url)

    @field_validator("durability")
    @classmethod
    def _redis_only(
        cls, durability: DurabilityConfig | None, info: ValidationInfo
    ) -> DurabilityConfig | None:
        url = info.data.get("url")
        if durability is None or url is None:  # an invalid url is reported on its own
            return durability
        scheme = url.partition("://")[0]
        if scheme.partition("+")[0] in ("redis", "rediss"):
            return durability
        if scheme in ("postgresql", "postgres"):
            raise ValueError(
                "not for PostgreSQL: its own synchronous_commit and "
                "synchronous_standby_names confirm a commit on standbys (docs/operations.md)"
            )
        raise ValueError(
            f"only for Redis stores (redis://, rediss://, redis+cluster://, "
            f"redis+sentinel://): {scheme}:// has no replicas to wait for"
        )

    def durable(self) -> Durability | None:
        """The store's ``Durability`` (None: off)."""
        return None if self.durability is None else self.durability.spec()


class ServerConfig(_Strict):
    """Where `serve` listens, and the Host and Origin it answers (``proxy/hosts.py``)."""

    host: str = DEFAULT_HOST
    port: int = Field(default=DEFAULT_PORT, ge=1, le=65535)
    allowed_hosts: tuple[str, ...] | None = None
    """None: loopback names when bound to loopback, else every Host."""
    allowed_origins: tuple[str, ...] | None = None
    """None: the origins of the allowed Hosts (every Origin if every Host)."""

    @field_validator("allowed_hosts")
    @classmethod
    def _hosts(cls, hosts: tuple[str, ...] | None) -> tuple[str, ...] | None:
        return None if hosts is None else _entries(hosts, check_host_entry)

    @field_validator("allowed_origins")
    @classmethod
    def _origins(cls, origins: tuple[str, ...] | None) -> tuple[str, ...] | None:
        return None if origins is None else _entries(origins, check_origin_entry)


def _entries(entries: tuple[str, ...], check: Callable[[str], str]) -> tuple[str, ...]:
    if not entries:
        raise ValueError("at least one entry (or leave it out for the default)")
    return tuple(check(entry) for entry in entries)


class LimitsConfig(_Strict):
    """Request limits."""

    max_body_bytes: int = Field(default=DEFAULT_MAX_BODY_BYTES, ge=0)
    max_json_depth: int = Field(default=DEFAULT_MAX_JSON_DEPTH, ge=1, le=MAX_JSON_DEPTH_LIMIT)
    max_header_bytes: int = Field(default=DEFAULT_MAX_HEADER_BYTES, ge=MIN_HEADER_BYTES)


class LapsedLease(StrEnum):
    """What a claim makes of an IN_PROGRESS record whose lease lapsed (its proxy died, or
    lost the store, with the call perhaps sent)."""

    FAIL = "fail"
    """FAILED: outcome unknown, replayed, never re-executed (unless reconciled)."""
    REEXECUTE = "reexecute"
    """Claim it: the call runs again (a crashed proxy never blocks a key for long)."""


class IdempotencyConfig(_Strict):
    """How a route guards its calls."""

    methods: tuple[str, ...] = DEFAULT_METHODS
    required: bool = True
    key: KeyKind = KeyKind.COMPOSITE
    canonicalization: Canonicalization = Canonicalization.JCS
    lock_ttl: Duration = DEFAULT_LOCK_TTL
    result_ttl: Duration = DEFAULT_RESULT_TTL
    retry_after: Duration = DEFAULT_RETRY_AFTER
    conflict_wait: Wait = 0.0
    release_on_status: tuple[int, ...] = DEFAULT_RELEASE_ON_STATUS
    max_stored_bytes: int | None = Field(default=None, ge=0)
    on_lapsed_lease: LapsedLease = LapsedLease.FAIL

    @field_validator("methods")
    @classmethod
    def _upper_methods(cls, methods: tuple[str, ...]) -> tuple[str, ...]:
        upper = tuple(m.upper() for m in methods)
        for method in upper:
            if not _METHOD.fullmatch(method):
                raise ValueError(f"not an HTTP method: {method!r}")
        if not upper:
            raise ValueError("at least one method must be guarded")
        return upper

    @field_validator("release_on_status")
    @classmethod
    def _statuses(cls, statuses: tuple[int, ...]) -> tuple[int, ...]:
        return check_statuses(statuses)

    @model_validator(mode="after")
    def _result_outlives_lease(self) -> IdempotencyConfig:
        if self.result_ttl < self.lock_ttl:
            raise ValueError("result_ttl must be at least lock_ttl")
        return self


_RECONCILE_FIELDS = frozenset({"key", "plan", "step", "args_hash"})
_PLACEHOLDER = re.compile(r"\{([^{}]*)\}")


class ReconcileConfig(_Strict):
    """How to ask the tool whether a call whose outcome is unknown ran."""

    method: str = "GET"
    path: str
    found: tuple[int, ...] = (200,)
    not_found: tuple[int, ...] = (404,)
    timeout: Duration = DEFAULT_RECONCILE_TIMEOUT
    retries: int = Field(default=DEFAULT_RECONCILE_RETRIES, ge=0, le=100)
    interval: Duration = DEFAULT_RECONCILE_INTERVAL

    @field_validator("method")
    @classmethod
    def _method(cls, method: str) -> str:
        if not _METHOD.fullmatch(method.upper()):
            raise ValueError(f"not an HTTP method: {method!r}")
        return method.upper()

    @field_validator("path")
    @classmethod
    def _path(cls, path: str) -> str:
        if not path.startswith("/") or "//" in path.split("?", 1)[0]:
            raise ValueError("must start with '/' (a path and query on the route's upstream)")
        unknown = set(_PLACEHOLDER.findall(path)) - _RECONCILE_FIELDS
        if unknown:
            names = ", ".join("{" + n + "}" for n in sorted(_RECONCILE_FIELDS))
            raise ValueError(f"unknown placeholder {sorted(unknown)[0]!r}: use {names}")
        return path

    @field_validator("found", "not_found")
    @classmethod
    def _statuses(cls, statuses: tuple[int, ...]) -> tuple[int, ...]:
        return check_statuses(statuses)

    @model_validator(mode="after")
    def _disjoint(self) -> ReconcileConfig:
        if both := set(self.found) & set(self.not_found):
            raise ValueError(f"status {min(both)} cannot be both found and not_found")
        return self

    def placeholders(self) -> set[str]:
        return set(_PLACEHOLDER.findall(self.path))


class StoreDown(StrEnum):
    """What a route with limits does while the store cannot be reached."""

    CLOSED = "closed"
    """Refuse (503 store-unavailable): no limit is ever exceeded."""
    OPEN = "open"
    """Forward without limits (logged and counted): the tool stays reachable."""


class PauseScope(StrEnum):
    """Whom a tool's own 429/503 with a reset pauses (``routes[].pause_scope``)."""

    CALLER = "caller"
    """The calls of the caller that got it: the same principal and the same values of the
    route's limit keys (a quota one caller exhausts at the tool stops only that caller)."""
    ROUTE = "route"
    """Every call of the route, on every replica (a quota the tool keeps for all callers)."""


class CostConfig(_Strict):
    """What one call costs a rate limit: reserved before, trued up after."""

    request: float | str = 1
    """A number, or ``json:<JSON pointer>`` into the request body."""
    response: str | None = None
    """``json:<JSON pointer>`` into the tool's answer: the real cost."""

    @field_validator("request")
    @classmethod
    def _request(cls, value: float | str) -> float | str:
        if isinstance(value, str):
            return check_json_source(value)
        if value <= 0:
            raise ValueError("a cost must be positive")
        return value

    @field_validator("response")
    @classmethod
    def _response(cls, value: str | None) -> str | None:
        return None if value is None else check_json_source(value)


class LimitConfig(_Strict):
    """One rate or concurrency limit of a route."""

    name: str
    key: str = "route"
    rate: str | None = None
    burst: int | None = Field(default=None, ge=1)
    cost: CostConfig | None = None
    max_in_flight: int | None = Field(default=None, ge=1)
    slot_ttl: Duration = DEFAULT_SLOT_TTL

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        return check_name(name, "limit")

    @field_validator("key")
    @classmethod
    def _key(cls, key: str) -> str:
        if key in ("route", "principal", "client_ip"):
            return key
        if key.startswith("header:") and _HEADER_NAME.fullmatch(key[7:]):
            return "header:" + key[7:].lower()
        if key.startswith("json:"):
            return check_json_source(key)
        raise ValueError("must be route, principal, client_ip, header:<name> or json:<pointer>")

    @field_validator("rate")
    @classmethod
    def _rate(cls, rate: str | None) -> str | None:
        if rate is not None:
            parse_rate(rate)
        return rate

    @model_validator(mode="after")
    def _one_kind(self) -> LimitConfig:
        if (self.rate is None) == (self.max_in_flight is None):
            raise ValueError("set exactly one of rate and max_in_flight")
        if self.rate is None and (self.burst is not None or self.cost is not None):
            raise ValueError("burst and cost go with a rate, not with max_in_flight")
        quota = self.quota_period()[0]
        if self.burst is not None and self.burst > quota:
            raise ValueError(f"burst must be at most the rate's quota ({quota:g})")
        return self

    def quota_period(self) -> tuple[float, float]:
        """The rate as (units, seconds); (0, 0) for a concurrency limit."""
        return (0.0, 0.0) if self.rate is None else parse_rate(self.rate)


# A resource lock's lease (routes[].lock.ttl): renewed every third of it while the call
# runs; the lock of a replica that dies is free again at most this long after.
DEFAULT_RESOURCE_LOCK_TTL = 30.0
# How long a call waits for a resource's lock (routes[].lock.wait, versioning.wait).
DEFAULT_RESOURCE_WAIT = 10.0
# The request header that carries the lock's fencing token to the tool.
DEFAULT_FENCING_HEADER = "Fencing-Token"
# Headers a fencing token may not take the place of.
_PROXY_HEADERS = frozenset(
    {
        "host",
        "authorization",
        "content-length",
        "content-type",
        "idempotency-key",
        "connection",
        "transfer-encoding",
        "if-match",
        "if-none-match",
    }
)
# The writes that versioning checks and counts by default.
DEFAULT_VERSIONED_METHODS = ("PUT", "PATCH", "POST")
# How long the store keeps a resource's version after its last read or write
# (routes[].versioning.ttl): longer than an agent takes from a read to its write back.
# Forgotten, a resource gets a fresh version: every earlier ETag fails (412), none matches.
DEFAULT_VERSION_TTL = 7 * 24 * 3600.0


def check_resource_key(key: str) -> str:
    """``json:<pointer>``, ``header:<name>`` (lower-cased), ``path:<segment index>`` or
    ``principal``: where a request names the resource it acts on."""
    if key == "principal":
        return key
    if key.startswith("header:") and _HEADER_NAME.fullmatch(key[7:]):
        return "header:" + key[7:].lower()
    if key.startswith("path:") and (index := whole(key[5:])) is not None and index < 64:
        return "path:" + str(index)
    if key.startswith("json:"):
        return check_json_source(key)
    raise ValueError(
        "must be json:<pointer>, header:<name>, path:<segment index, 0..63> or principal"
    )


class LockConfig(_Strict):
    """A per-resource lock: calls on one resource key run one at a time, across replicas."""

    key: str
    ttl: Duration = DEFAULT_RESOURCE_LOCK_TTL
    wait: Wait = DEFAULT_RESOURCE_WAIT
    fencing_header: str = DEFAULT_FENCING_HEADER

    @field_validator("key")
    @classmethod
    def _key(cls, key: str) -> str:
        return check_resource_key(key)

    @field_validator("fencing_header")
    @classmethod
    def _header(cls, name: str) -> str:
        if not _HEADER_NAME.fullmatch(name):
            raise ValueError("not a header name")
        low = name.lower()
        if low in _PROXY_HEADERS or low.startswith("x-forwarded-"):
            raise ValueError(f"{name} is a header the proxy reads or sets itself")
        return name


class VersioningConfig(_Strict):
    """Optimistic concurrency for a tool without it: a version per resource key, ETags,
    If-Match and If-None-Match checked before a write is forwarded."""

    key: str
    methods: tuple[str, ...] = DEFAULT_VERSIONED_METHODS
    required: bool = False
    wait: Wait = DEFAULT_RESOURCE_WAIT
    """How long a write waits while another write of the same resource is in flight."""
    ttl: Duration = DEFAULT_VERSION_TTL
    """How long a resource's version is kept after its last read or write."""

    @field_validator("key")
    @classmethod
    def _key(cls, key: str) -> str:
        return check_resource_key(key)

    @field_validator("methods")
    @classmethod
    def _upper_methods(cls, methods: tuple[str, ...]) -> tuple[str, ...]:
        upper = tuple(m.upper() for m in methods)
        for method in upper:
            if not _METHOD.fullmatch(method):
                raise ValueError(f"not an HTTP method: {method!r}")
            if method in ("GET", "HEAD"):
                raise ValueError(f"{method} is a read: it gets an ETag, it is never a write")
        if not upper:
            raise ValueError("at least one method must be versioned")
        return upper


# Time allowed for one token endpoint call (proxy/auth/tokens.py), and so counted in the
# longest a call can take.
TOKEN_TIMEOUT_SECONDS = 10.0
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


class CacheConfig(_Strict):
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
        upper = tuple(m.upper() for m in methods)
        for method in upper:
            if not _METHOD.fullmatch(method):
                raise ValueError(f"not an HTTP method: {method!r}")
            if method == "HEAD":
                raise ValueError("HEAD is never cached (its answer has no body to keep)")
        if not upper:
            raise ValueError("at least one method must be cached")
        return upper

    @field_validator("statuses")
    @classmethod
    def _statuses(cls, statuses: tuple[int, ...]) -> tuple[int, ...]:
        for status in check_statuses(statuses):
            if status not in CACHEABLE_STATUSES:
                allowed = ", ".join(str(s) for s in sorted(CACHEABLE_STATUSES))
                raise ValueError(f"{status} is not safe to reuse; cacheable: {allowed}")
        return statuses


class RouteProtocol(StrEnum):
    """What a route's requests are: plain HTTP calls, or MCP (JSON-RPC over Streamable HTTP)."""

    HTTP = "http"
    MCP = "mcp"


class McpGuard(StrEnum):
    """Which MCP tools' ``tools/call`` requests are guarded."""

    ALL = "all"
    ANNOTATED = "annotated"
    """Every tool whose ``tools/list`` entry is neither readOnlyHint nor idempotentHint."""


# Where an MCP client may send its key besides the header: params._meta.<this>.
DEFAULT_KEY_META = "idempotencyKey"
# The most of a guarded tools/call's answer the proxy holds while it reads it whole: the
# final JSON-RPC response and the part of the SSE stream not yet parsed (progress read
# and dropped does not count). Past it (or past what the route can record, without
# offload) the call is recorded as executed, its result not kept.
DEFAULT_MAX_ANSWER_BYTES = 64 * 1024 * 1024
_META_NAME = re.compile(r"[A-Za-z0-9._/-]{1,128}")


class McpConfig(_Strict):
    """How a ``protocol: mcp`` route guards ``tools/call``."""

    guard: McpGuard | tuple[str, ...] = McpGuard.ALL
    key_meta: str = DEFAULT_KEY_META
    max_answer_bytes: int = Field(default=DEFAULT_MAX_ANSWER_BYTES, ge=1)

    @field_validator("guard")
    @classmethod
    def _tools(cls, guard: McpGuard | tuple[str, ...]) -> McpGuard | tuple[str, ...]:
        if isinstance(guard, tuple) and (not guard or not all(guard)):
            raise ValueError("all, annotated, or a non-empty list of tool names")
        return guard

    @field_validator("key_meta")
    @classmethod
    def _meta_name(cls, name: str) -> str:
        if not _META_NAME.fullmatch(name):
            raise ValueError("a _meta member name: 1..128 characters of [A-Za-z0-9._/-]")
        return name


class AsyncMode(StrEnum):
    """When a guarded call is answered ``202 Accepted`` and run by the route's workers."""

    NEVER = "never"
    PREFER = "prefer"
    """When the caller sends ``Prefer: respond-async`` (or waits past ``after``)."""
    ALWAYS = "always"


DEFAULT_ASYNC_ATTEMPTS = 5
DEFAULT_ASYNC_BACKOFF = 1.0
DEFAULT_ASYNC_BACKOFF_MAX = 60.0
DEFAULT_ASYNC_VISIBILITY = 30.0
DEFAULT_ASYNC_MAX_QUEUED = 3600.0
DEFAULT_WORKERS = 4


class CredentialsAtRest(StrEnum):
    """How an async job's stored request keeps the caller's credentials."""

    SEAL = "seal"
    """AES-256-GCM with the store's sealing key (``store.sealing_key_env``)."""
    CLEAR = "clear"
    """As they came: anyone who can read the store can read them (opt-in)."""


class AsyncConfig(_Strict):
    """Long calls: answered 202 with an operation to follow, run durably by workers."""

    mode: AsyncMode = AsyncMode.PREFER
    after: Duration | None = None
    """A caller still waiting this long gets its 202 while the call goes on."""
    attempts: int = Field(default=DEFAULT_ASYNC_ATTEMPTS, ge=1, le=100)
    backoff: Duration = DEFAULT_ASYNC_BACKOFF
    backoff_max: Duration = DEFAULT_ASYNC_BACKOFF_MAX
    visibility: Duration = DEFAULT_ASYNC_VISIBILITY
    """A worker's hold on its job, renewed while it works; past it, another replica
    takes the job over (and never sends one that may have been sent)."""
    max_queued: Duration = DEFAULT_ASYNC_MAX_QUEUED
    """The longest a job waits in the queue (for a worker, or between attempts)."""
    credentials: CredentialsAtRest = CredentialsAtRest.SEAL
    """How a stored request keeps the caller's Authorization, Cookie and
    Proxy-Authorization: sealed (the store's sealing key), or in clear (an explicit
    opt-in)."""

    @model_validator(mode="after")
    def _backoff_cap(self) -> AsyncConfig:
        if self.backoff_max < self.backoff:
            raise ValueError("backoff_max must be at least backoff")
        return self


class WorkersConfig(_Strict):
    """The workers that run a route's jobs, per process."""

    concurrency: int = Field(default=DEFAULT_WORKERS, ge=1, le=1000)


class RouteConfig(_Strict):
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
    lock: LockConfig | None = None
    versioning: VersioningConfig | None = None

    @model_validator(mode="after")
    def _principal_needs_auth(self) -> RouteConfig:
        for name, part in (("lock", self.lock), ("versioning", self.versioning)):
            if part is not None and part.key == "principal" and self.auth is None:
                raise ValueError(f"{name}.key: principal needs the route's auth (a caller)")
        return self

    def resource_wait(self) -> float:
        """The longest a call waits for its resource's lock and version reservation."""
        lock = 0.0 if self.lock is None else self.lock.wait
        return lock + (0.0 if self.versioning is None else self.versioning.wait)

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
        if self.versioning is not None:  # the cache is outermost: Versioning never sees a hit
            raise ValueError(
                "cache and versioning: not on one route (a cached answer carries no ETag, "
                "and a versioned write does not invalidate it: reads would be stale)"
            )
        return self

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
        parts = urlsplit(upstream)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("not an absolute http(s) URL")
        if parts.query or parts.fragment:
            raise ValueError("an upstream is a base URL: no query or fragment")
        return upstream.rstrip("/")


class OffloadConfig(_Strict):
    """Object storage for large response bodies (the claim check)."""

    url: str
    threshold_bytes: int = Field(default=DEFAULT_OFFLOAD_THRESHOLD, ge=0)
    endpoint_url: str | None = None
    region: str | None = None
    allow_http: bool = False
    presign: bool = False
    presign_ttl: Duration = DEFAULT_PRESIGN_TTL
    sweep: bool = True

    @field_validator("url")
    @classmethod
    def _scheme(cls, url: str) -> str:
        scheme = url.split("://", 1)[0] if "://" in url else ""
        if scheme not in _OFFLOAD_SCHEMES:
            raise ValueError(
                "must be s3://bucket/prefix, gs://..., az://..., file:///dir or memory://"
            )
        return url


class IssuerConfig(_Strict):
    """A trusted token issuer."""

    issuer: str
    jwks_url: str | None = None
    discovery: bool = False
    audiences: tuple[str, ...] = Field(min_length=1)
    algorithms: tuple[str, ...] = DEFAULT_ALGORITHMS
    leeway: Duration = DEFAULT_LEEWAY
    required_claims: tuple[str, ...] = ()

    @field_validator("algorithms")
    @classmethod
    def _pinned(cls, algorithms: tuple[str, ...]) -> tuple[str, ...]:
        for algorithm in algorithms:
            if algorithm not in _ASYMMETRIC_ALGORITHMS:
                raise ValueError(
                    f"{algorithm!r} is not allowed: use asymmetric algorithms "
                    f"({', '.join(_ASYMMETRIC_ALGORITHMS)})"
                )
        return algorithms

    @model_validator(mode="after")
    def _keys_source(self) -> IssuerConfig:
        if (self.jwks_url is None) == (not self.discovery):
            raise ValueError("set exactly one of jwks_url and discovery: true")
        return self


class AuthConfig(_Strict):
    """Who may call: trusted issuers, and the claims that make a principal."""

    issuers: tuple[IssuerConfig, ...] = Field(min_length=1)
    principal: tuple[str, ...] = DEFAULT_PRINCIPAL_CLAIMS
    jwks_ttl: Duration = DEFAULT_JWKS_TTL
    token_cache_key_env: str | None = None
    token_cache_entries: int = Field(default=DEFAULT_TOKEN_CACHE_ENTRIES, ge=1)


class TokenMode(StrEnum):
    """What a route sends upstream as Authorization."""

    PASSTHROUGH = "passthrough"
    CLIENT_CREDENTIALS = "client_credentials"
    TOKEN_EXCHANGE = "token_exchange"
    OBO = "obo"


class TokenConfig(_Strict):
    """The token a route forwards (on-behalf-of, exchange or the proxy's own)."""

    mode: TokenMode = TokenMode.PASSTHROUGH
    token_endpoint: str | None = None
    client_id: str | None = None
    client_secret_env: str | None = None
    client_secret_file: str | None = None
    audience: str | None = None
    resource: str | None = None
    scope: str | None = None
    refresh_ahead: float = Field(default=DEFAULT_REFRESH_AHEAD, gt=0, lt=1)
    use_refresh_tokens: bool = False
    actor_token_env: str | None = None
    retry_on_401: bool = False
    """Send a call once more, with a new token, when the tool answers 401. It assumes that a
    tool answering 401 did nothing: if it can act and then answer 401, a call runs twice."""

    @model_validator(mode="after")
    def _complete(self) -> TokenConfig:
        if self.mode is TokenMode.PASSTHROUGH:
            return self
        missing = [f for f in ("token_endpoint", "client_id") if getattr(self, f) is None]
        if missing:
            raise ValueError(f"mode {self.mode.value} needs {' and '.join(missing)}")
        if (self.client_secret_env is None) == (self.client_secret_file is None):
            raise ValueError("set exactly one of client_secret_env and client_secret_file")
        return self


class RouteAuthConfig(_Strict):
    """Caller authentication on one route."""

    required: bool = True


class AdminConfig(_Strict):
    """Operator access to ``/_proxy/admin/``: a bearer token read from a secret, or a JWT
    from the ``auth`` issuers carrying a role."""

    token_env: str | None = None
    token_file: str | None = None
    role: str | None = None
    roles_claim: str = DEFAULT_ROLES_CLAIM
    read_role: str | None = None
    """A JWT role that may look at the console's views, and change nothing."""

    @model_validator(mode="after")
    def _one_credential(self) -> AdminConfig:
        if sum(v is not None for v in (self.token_env, self.token_file, self.role)) != 1:
            raise ValueError("set exactly one of token_env, token_file and role")
        return self


class Config(_Strict):
    """The whole file."""

    store: StoreConfig = StoreConfig()
    offload: OffloadConfig | None = None
    auth: AuthConfig | None = None
    server: ServerConfig = ServerConfig()
    limits: LimitsConfig = LimitsConfig()
    state_dir: str | None = None
    """Where the journal of outcomes not yet recorded is kept (see ``journal_dir``)."""
    routes: tuple[RouteConfig, ...] = Field(min_length=1)
    admin: AdminConfig | None = None

    def sealing_key_env(self) -> tuple[str, str] | None:
        """The variable of the key that seals stored requests' credentials, and the
        option that names it (``store.sealing_key_env``, else
        ``auth.token_cache_key_env``); None if neither is set."""
        if self.store.sealing_key_env:
            return self.store.sealing_key_env, "store.sealing_key_env"
        if self.auth is not None and self.auth.token_cache_key_env:
            return self.auth.token_cache_key_env, "auth.token_cache_key_env"
        return None

    @model_validator(mode="after")
    def _sealed_credentials_need_a_key(self) -> Config:
        if self.store.url.startswith("memory://") or self.sealing_key_env():
            return self
        for route in self.routes:
            if route.async_ is not None and route.async_.credentials is CredentialsAtRest.SEAL:
                raise ValueError(
                    f"routes[{route.name}].async.credentials: seal (the default) needs a "
                    "sealing key for the stored requests' credentials: set "
                    "store.sealing_key_env (32 bytes in base64), or say credentials: clear"
                )
        return self

    @model_validator(mode="after")
    def _admin_role_needs_auth(self) -> Config:
        if self.admin is not None and self.admin.role is not None and self.auth is None:
            raise ValueError("admin.role: needs a top-level auth section with trusted issuers")
        if self.admin is not None and self.admin.read_role is not None and self.auth is None:
            raise ValueError("admin.read_role: needs a top-level auth section with trusted issuers")
        return self

    def journal_dir(self) -> Path | None:
        """The journal's directory: ``state_dir``; else the SQLite database's directory,
        or DEFAULT_STATE_DIR for Redis; None for memory:// (nothing outlives the process)."""
        if self.state_dir:
            return Path(self.state_dir)
        url = self.store.url
        if url.startswith("memory://"):
            return None
        if url.startswith("sqlite://"):
            path = url.removeprefix("sqlite://").partition("?")[0]
            return Path(path).parent
        return Path(DEFAULT_STATE_DIR)

    @model_validator(mode="after")
    def _unique_routes(self) -> Config:
        problems = []
        if self.auth is None:
            problems += [
                f"routes[{i}].auth: needs a top-level auth section with trusted issuers"
                for i, route in enumerate(self.routes)
                if route.auth is not None
            ]
        problems += [
            f"routes[{i}].token: mode {route.token.mode.value} needs caller authentication "
            "(routes[].auth) to take the caller's token from"
            for i, route in enumerate(self.routes)
            if route.token is not None
            and route.token.mode in (TokenMode.TOKEN_EXCHANGE, TokenMode.OBO)
            and route.auth is None
        ]
        for attr in ("name", "path_prefix"):
            seen: set[str] = set()
            for i, route in enumerate(self.routes):
                value = getattr(route, attr)
                if value in seen:
                    problems.append(f"routes[{i}].{attr}: {value!r} is used by another route")
                seen.add(value)
        if problems:
            raise ValueError("; ".join(problems))
        return self


def parse_rate(rate: str) -> tuple[float, float]:
    """``N/<duration>`` (``60/1m``, ``90000/1m``, ``5/250ms``) as (N, seconds)."""
    count, slash, period = rate.partition("/")
    if not slash or not _QUOTA.fullmatch(count.strip()):
        raise ValueError(f"not a rate: {rate!r} (use N/<duration>, e.g. 60/1m)")
    quota = float(count)
    if quota <= 0:
        raise ValueError("a rate's quota must be positive")
    return quota, parse_duration(period.strip())


def check_json_source(value: str) -> str:
    """``json:<JSON pointer>`` (RFC 6901), checked with the jsonpointer library."""
    if not value.startswith("json:"):
        raise ValueError("must be json:<JSON pointer>, e.g. json:/usage/total_tokens")
    try:
        jsonpointer.JsonPointer(value[5:])
    except jsonpointer.JsonPointerException as exc:
        raise ValueError(f"not a JSON pointer: {value[5:]!r} ({exc})") from None
    return value


def check_store_url(url: str) -> str:
    """Raise ValueError unless ``url`` names a known store."""
    scheme = url.split("://", 1)[0] if "://" in url else ""
    base, plus, topology = scheme.partition("+")
    if base in ("redis", "rediss") and plus and plus + topology in _REDIS_TOPOLOGIES:
        return _check_redis_nodes(url, topology)
    if scheme not in _STORE_SCHEMES:
        raise ValueError(
            "must be memory://, sqlite:///path, redis://..., rediss://..., "
            "redis+cluster://host:port[,host:port...], "
            "redis+sentinel://host:port[,host:port...]/<master-name> or postgresql://..."
        )
    if scheme == "sqlite" and not url.removeprefix("sqlite://"):
        raise ValueError("sqlite:// needs a file path, e.g. sqlite:///var/lib/tool-proxy/state.db")
    if scheme in ("postgresql", "postgres"):
        from proxy.store.postgres import parse_postgres_url

        parse_postgres_url(url)
    return url


def _check_redis_nodes(url: str, topology: str) -> str:
    """A ``redis+cluster://`` URL names host:port seeds; ``redis+sentinel://`` also the
    master's name (its path)."""
    rest = url.split("://", 1)[1]
    hosts, _, path = rest.partition("?")[0].rpartition("@")[2].partition("/")
    for item in hosts.split(","):
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"redis+{topology}://: {item!r} is not host:port")
    if topology == "sentinel" and not path.strip("/"):
        raise ValueError("redis+sentinel:// needs the master's name: .../<master-name>")
    return url


def _location(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.startswith("function-") or "[" in part:
            continue
        else:
            out += f".{part}" if out else part
    return out or "(top level)"


def _message(error: Any) -> str:
    kind, msg = error["type"], str(error["msg"])
    if kind == "extra_forbidden":
        return "unknown key"
    if kind == "missing":
        return "required"
    return msg.removeprefix("Value error, ")


def parse_config(data: Any, *, env: Mapping[str, str] | None = None) -> Config:
    """Validate parsed YAML; raise ``ConfigError`` listing every problem."""
    if not isinstance(data, dict):
        raise ConfigError(["(top level): the configuration must be a mapping"])
    environ = os.environ if env is None else env
    if store_url := environ.get(ENV_STORE_URL):
        data = {**data, "store": {**(data.get("store") or {}), "url": store_url}}
    if state_dir := environ.get(ENV_STATE_DIR):
        data = {**data, "state_dir": state_dir}
    if host := environ.get(ENV_HOST):
        data = {**data, "server": {**(data.get("server") or {}), "host": host}}
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError([f"{_location(e['loc'])}: {_message(e)}" for e in exc.errors()]) from None


def load_config(path: str | Path | None = None, *, env: Mapping[str, str] | None = None) -> Config:
    """Read, parse and validate a YAML file (``TOOL_PROXY_CONFIG`` when no path is given)."""
    path = path or (os.environ if env is None else env).get(ENV_CONFIG)
    if not path:
        raise ConfigError([f"no configuration: pass --config FILE or set {ENV_CONFIG}"])
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read: {exc.strerror}"]) from None
    except UnicodeDecodeError as exc:
        raise ConfigError([f"{path}: not UTF-8 text (byte {exc.start})"]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError([f"{path}: not valid YAML: {exc}"]) from None
    return parse_config(data, env=env)
