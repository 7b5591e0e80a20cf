"""``store``: where records live (the URL's scheme picks the store) and how durable writes are."""

from __future__ import annotations

from urllib.parse import parse_qs, unquote, urlsplit

from pydantic import (
    Field,
    ValidationInfo,
    field_validator,
)

from proxy.config.fields import Duration, Strict
from proxy.store.base import Durability

# The store used when the file names none: the embedded SQLite database.
DEFAULT_STORE_URL = "sqlite:///var/lib/tool-proxy/state.db"

# Where the journal lives when the store is Redis and no state_dir is configured (for
# SQLite: the database's directory; memory:// keeps no journal).
DEFAULT_STATE_DIR = "/var/lib/tool-proxy"

# store.durability: how long a claim or an outcome waits for its replicas by default, and
# at most (a WAIT holds back every command behind it on the connection requests share).
DEFAULT_DURABILITY_TIMEOUT = 0.2

MAX_DURABILITY_TIMEOUT = 5.0

# The most replicas store.durability.replicas may ask for (Redis counts them in an int).
MAX_DURABILITY_REPLICAS = 64

_STORE_SCHEMES = ("memory", "sqlite", "redis", "rediss", "postgresql", "postgres")

# Redis Cluster (seed nodes) and Sentinel (the sentinels, then /<master-name>).
_REDIS_TOPOLOGIES = ("+cluster", "+sentinel")


class DurabilityConfig(Strict):
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


class StoreConfig(Strict):
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


def check_store_url(url: str) -> str:
    """Raise ValueError unless ``url`` names a known store, in a form its store can use:
    the parsers the stores use read it here (a bad port, a query parameter redis-py or the
    SQLite store refuses), so that ``check-config`` names it, not a traceback at start."""
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
    if scheme == "sqlite":
        _check_sqlite(url)
    if scheme in ("redis", "rediss"):
        _check_redis_node(url)
        database = unquote(urlsplit(url).path).replace("/", "")  # as redis-py reads it
        if database and not database.isdigit():
            raise ValueError(f"the path is the database's number (/0), not /{database}")
    if scheme in ("postgresql", "postgres"):
        from proxy.store.postgres import parse_postgres_url

        _check_ports(url)
        parse_postgres_url(url)
    return url


def _check_sqlite(url: str) -> None:
    """The SQLite store's own parser reads it; a query parameter it ignores is a typo."""
    from proxy.errors import StoreUnavailable
    from proxy.store.sqlite import parse_sqlite_url

    try:
        path, _ = parse_sqlite_url(url)
    except StoreUnavailable as exc:
        raise ValueError(str(exc)) from None
    if not path:
        raise ValueError("sqlite:// needs a file path, e.g. sqlite:///var/lib/tool-proxy/state.db")
    if "\x00" in path:  # SQLite's open refuses it at start-up
        raise ValueError("the file path holds a NUL byte")
    unknown = sorted(set(parse_qs(url.partition("?")[2], keep_blank_values=True)) - {"synchronous"})
    if unknown:
        raise ValueError(f"unknown query parameter {unknown[0]!r} (sqlite:// takes synchronous)")


def _check_redis_node(url: str) -> None:
    """The pool and a connection of one Redis node made as the store makes them (nothing
    is connected): redis-py's parser reads the URL, the connection its query parameters."""
    from redis.asyncio import ConnectionPool
    from redis.exceptions import RedisError

    try:
        pool = ConnectionPool.from_url(url)
        pool.connection_class(**pool.connection_kwargs)
    except TypeError as exc:  # a query parameter no connection takes
        name = str(exc).rpartition("argument ")[2]
        raise ValueError(f"not a usable Redis URL: unknown query parameter {name}") from None
    except (ValueError, RedisError) as exc:
        raise ValueError(f"not a usable Redis URL: {exc}") from None


def _check_ports(url: str) -> None:
    """Each host's port, as urllib reads it (libpq's URLs may list several hosts)."""
    try:
        for host in urlsplit(url).netloc.rpartition("@")[2].split(","):
            _ = urlsplit(f"//{host}").port
    except ValueError as exc:
        raise ValueError(f"not a usable PostgreSQL URL: {exc}") from None


def _check_redis_nodes(url: str, topology: str) -> str:
    """A ``redis+cluster://`` URL names host:port seeds; ``redis+sentinel://`` also the
    master's name (its path). Each seed's URL is made as the store makes it, and checked."""
    from proxy.store.redis_nodes import seeds

    rest = url.split("://", 1)[1]
    hosts, _, path = rest.partition("?")[0].rpartition("@")[2].partition("/")
    for item in hosts.split(","):
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"redis+{topology}://: {item!r} is not host:port")
    if topology == "sentinel" and not path.strip("/"):
        raise ValueError("redis+sentinel:// needs the master's name: .../<master-name>")
    try:
        addresses, node_url = seeds(url)
    except ValueError as exc:
        raise ValueError(f"not a usable Redis URL: {exc}") from None
    for address in addresses:
        _check_redis_node(node_url.format(f"{address[0]}:{address[1]}"))
    return url
