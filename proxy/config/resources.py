"""``routes[].resource``, ``routes[].lock`` and ``routes[].versioning``: shared resources."""

from __future__ import annotations

from pydantic import (
    field_validator,
)

from proxy.config.fields import (
    HEADER_NAME,
    Duration,
    Strict,
    Wait,
    check_json_source,
    check_methods,
    check_name,
)
from proxy.numbers import whole

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
    if key.startswith("header:") and HEADER_NAME.fullmatch(key[7:]):
        return "header:" + key[7:].lower()
    if key.startswith("path:") and (index := whole(key[5:])) is not None and index < 64:
        return "path:" + str(index)
    if key.startswith("json:"):
        return check_json_source(key)
    raise ValueError(
        "must be json:<pointer>, header:<name>, path:<segment index, 0..63> or principal"
    )


# The methods that write a named resource by default (routes[].resource.writes): a 2xx
# answer (or an unknown outcome) of one supersedes the cached reads of the resource.
DEFAULT_RESOURCE_WRITES = ("POST", "PUT", "PATCH", "DELETE")


class ResourceConfig(Strict):
    """What a request of the route is about, named once for its lock, its versions and
    its cached reads; routes that give the same ``name`` share the resource (its lock, its
    versions, the invalidation of its cached reads)."""

    name: str | None = None
    """None: the route's own name (the resource is the route's alone)."""
    key: str
    writes: tuple[str, ...] = DEFAULT_RESOURCE_WRITES
    """The methods that change the resource (HTTP routes; on ``protocol: mcp`` routes every
    ``tools/call`` the cache does not answer is a write)."""

    @field_validator("name")
    @classmethod
    def _name(cls, name: str | None) -> str | None:
        return None if name is None else check_name(name, "resource")

    @field_validator("key")
    @classmethod
    def _key(cls, key: str) -> str:
        return check_resource_key(key)

    @field_validator("writes")
    @classmethod
    def _upper_methods(cls, methods: tuple[str, ...]) -> tuple[str, ...]:
        why = "{method} is a read: it never changes the resource"
        return check_methods(methods, "a write", ("GET", "HEAD"), why)


def resource_scope(name: str) -> str:
    """The store scope of a named resource's versions and locks (``resource:<name>``: never
    a route's own, which legacy ``lock.key`` and ``versioning.key`` use)."""
    return f"resource:{name}"


class LockConfig(Strict):
    """A per-resource lock: calls on one resource key run one at a time, across replicas."""

    key: str | None = None
    """None: the route's ``resource.key``."""
    ttl: Duration = DEFAULT_RESOURCE_LOCK_TTL
    wait: Wait = DEFAULT_RESOURCE_WAIT
    fencing_header: str = DEFAULT_FENCING_HEADER

    @field_validator("key")
    @classmethod
    def _key(cls, key: str | None) -> str | None:
        return None if key is None else check_resource_key(key)

    @field_validator("fencing_header")
    @classmethod
    def _header(cls, name: str) -> str:
        if not HEADER_NAME.fullmatch(name):
            raise ValueError("not a header name")
        low = name.lower()
        if low in _PROXY_HEADERS or low.startswith("x-forwarded-"):
            raise ValueError(f"{name} is a header the proxy reads or sets itself")
        return name


class VersioningConfig(Strict):
    """Optimistic concurrency for a tool without it: a version per resource key, ETags,
    If-Match and If-None-Match checked before a write is forwarded."""

    key: str | None = None
    """None: the route's ``resource.key``."""
    methods: tuple[str, ...] = DEFAULT_VERSIONED_METHODS
    required: bool = False
    wait: Wait = DEFAULT_RESOURCE_WAIT
    """How long a write waits while another write of the same resource is in flight."""
    ttl: Duration = DEFAULT_VERSION_TTL
    """How long a resource's version is kept after its last read or write."""

    @field_validator("key")
    @classmethod
    def _key(cls, key: str | None) -> str | None:
        return None if key is None else check_resource_key(key)

    @field_validator("methods")
    @classmethod
    def _upper_methods(cls, methods: tuple[str, ...]) -> tuple[str, ...]:
        why = "{method} is a read: it gets an ETag, it is never a write"
        return check_methods(methods, "versioned", ("GET", "HEAD"), why)
