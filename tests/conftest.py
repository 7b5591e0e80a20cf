from __future__ import annotations

import asyncio
import base64
import os
import sqlite3
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from proxy.app import create_app
from proxy.config import parse_config
from proxy.keys import composite_key
from proxy.store import Store, make_store, memory, postgres, sqlite
from proxy.store import redis as redis_store
from proxy.store.memory import MemoryStore
from proxy.store.postgres import PostgresStore
from proxy.store.redis import RedisStore
from proxy.store.sqlite import SQLiteStore
from tests.idp import IdentityProvider
from tests.postgres_server import PostgresServer
from tests.servers import CountingTool, RedisCluster, RedisServer, ThreadServer

ProxyFactory = Callable[..., ThreadServer]

# The sealing key of the tests' stores (store.sealing_key_env): async jobs' stored
# credentials are sealed with it; replicas started as processes inherit it.
SEALING_ENV = "TEST_SEALING_KEY"
os.environ.setdefault(SEALING_ENV, base64.b64encode(b"k" * 32).decode())


@pytest.fixture(autouse=True)
def counters_from_zero(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Scopes' counters of fencing tokens and versions start at 0 in the tests' own
    process, so their numbers read 1, 2, 3 (the stores start them at the clock, in
    microseconds: ``locks.counter_start``); ``@pytest.mark.real_counters`` keeps that."""
    if request.node.get_closest_marker("real_counters") is None:
        for module in (memory, sqlite, redis_store, postgres):
            monkeypatch.setattr(module, "counter_start", lambda: 0)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    redis_server.flush()
    return redis_server.url


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    server = PostgresServer.local_or_started()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def postgres_database(postgres_server: PostgresServer) -> str:
    """This run's own database (a random name, dropped at the end)."""
    return postgres_server.create_database()


@pytest.fixture
def postgres_url(postgres_server: PostgresServer, postgres_database: str) -> str:
    postgres_server.empty(postgres_database)
    return postgres_server.url(postgres_database)


@pytest.fixture
def tool() -> Iterator[CountingTool]:
    counting = CountingTool()
    server = ThreadServer(counting.app).start()
    counting.url = server.url
    yield counting
    server.stop()


@pytest.fixture
def idp_server() -> Iterator[tuple[IdentityProvider, ThreadServer]]:
    """A real identity provider (JWKS, discovery, token endpoint) on a free port."""
    provider = IdentityProvider()
    server = ThreadServer(provider.app).start()
    provider.url = server.url
    yield provider, server
    server.stop()


@pytest.fixture
def idp(idp_server: tuple[IdentityProvider, ThreadServer]) -> IdentityProvider:
    return idp_server[0]


def route(
    upstream: str,
    *,
    name: str = "tool",
    prefix: str = "/tools",
    guarded: bool = True,
    **idempotency: Any,
) -> dict[str, Any]:
    """A route for a config dict; ``idempotency`` keys override the defaults."""
    spec: dict[str, Any] = {
        "name": name,
        "path_prefix": prefix,
        "upstream": upstream,
        "timeout": idempotency.pop("timeout", "10s"),
    }
    for option in ("strip_prefix", "auth"):
        if option in idempotency:
            spec[option] = idempotency.pop(option)
    if guarded:
        spec["idempotency"] = {
            "lock_ttl": "5s",
            "result_ttl": "1h",
            "retry_after": "1s",
            **idempotency,
        }
    return spec


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """A real Redis Cluster (3 primaries, 3 replicas), shared by the session."""
    cluster = RedisCluster(tmp_path_factory.mktemp("cluster")).start()
    yield cluster
    cluster.stop()


def shared_store_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> str:
    """The URL of the store ``request.param`` names (memory, sqlite, redis, postgres),
    emptied once: for a module's proxies shared by its tests (module-scoped fixtures)."""
    if request.param == "sqlite":
        return f"sqlite://{tmp_path_factory.mktemp('store')}/state.db"
    if request.param == "postgres":
        server: PostgresServer = request.getfixturevalue("postgres_server")
        database: str = request.getfixturevalue("postgres_database")
        server.empty(database)
        return server.url(database)
    if request.param == "redis":
        redis: RedisServer = request.getfixturevalue("redis_server")
        redis.flush()
        return redis.url
    return "memory://"


def each_store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The URL of the store ``request.param`` names, emptied: memory, sqlite, redis, or
    redis-cluster (only the contract suites ask for it: ``CONTRACT_STORES``)."""
    if request.param == "memory":
        return "memory://"
    if request.param == "sqlite":
        return f"sqlite://{tmp_path}/state.db"
    if request.param == "postgres":
        url: str = request.getfixturevalue("postgres_url")
        return url
    if request.param == "redis-cluster":
        cluster: RedisCluster = request.getfixturevalue("redis_cluster")
        cluster.flush()
        return cluster.url
    redis: RedisServer = request.getfixturevalue("redis_server")
    redis.flush()
    return redis.url


STORES = ["memory", "sqlite", "redis", "postgres"]
# The contract suites also run on a Redis Cluster (a module's own ``store_url`` fixture).
CONTRACT_STORES = [*STORES, "redis-cluster"]
store_url = pytest.fixture(params=STORES)(each_store_url)


def proxies(state_dir: Path) -> tuple[ProxyFactory, Callable[[], None]]:
    """A factory that starts tool-proxy (uvicorn on a thread) for a list of routes and a
    store URL, and what stops every proxy it started (``make_proxy``; a module's shared
    proxies too)."""
    started: list[ThreadServer] = []

    def make(
        *routes: dict[str, Any],
        store: str = "memory://",
        port: int | None = None,
        store_options: dict[str, Any] | None = None,
        clock: Clock | None = None,
        **top: Any,
    ) -> ThreadServer:
        """``clock``: a memory store on it (rates, pauses and leases move when it does)."""
        top.setdefault("state_dir", str(state_dir))
        stored = {"url": store, "sealing_key_env": SEALING_ENV, **(store_options or {})}
        config = parse_config({"store": stored, "routes": list(routes), **top}, env={})
        on_clock = None if clock is None else MemoryStore(clock)
        app = create_app(config, store=on_clock)
        server = ThreadServer(app, port=port, proxy_protocol=True).start()
        started.append(server)
        return server

    def stop() -> None:
        for server in started:
            if server.thread.is_alive():
                server.stop()

    return make, stop


@pytest.fixture
def make_proxy(tmp_path: Path) -> Iterator[ProxyFactory]:
    """Start tool-proxy (uvicorn on a thread) for a list of routes and a store URL."""
    make, stop = proxies(tmp_path / "state")
    yield make
    stop()


def new_key(body: Any, step: int = 1, plan: str | None = None) -> str:
    return composite_key(plan or f"plan-{uuid.uuid4().hex[:12]}", step, body)


Later = Callable[[float], Awaitable[None]]
"""Let ``seconds`` pass for the store under test."""


class Clock:
    """A clock the test moves by hand (the contract suites' stores take it)."""

    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def clocked_store(url: str, clock: Clock) -> Store:
    """The store ``url`` names, on ``clock`` where it takes one (all but Redis)."""
    if url.startswith("memory://"):
        return MemoryStore(clock)
    if url.startswith("sqlite://"):
        return SQLiteStore(url, clock)
    if url.startswith("postgresql://"):
        return PostgresStore(url, clock)
    return make_store(url)


@pytest.fixture
async def opened(store_url: str, clock: Clock) -> AsyncIterator[Store]:
    """The store under test (memory, SQLite, Redis, PostgreSQL), opened, on ``clock``."""
    store = clocked_store(store_url, clock)
    await store.open()
    yield store
    await store.close()


@pytest.fixture
def later(store_url: str, clock: Clock) -> Later:
    """Move time on: the clock for memory, SQLite and PostgreSQL; Redis expires by its own,
    so sleep."""

    async def fast_forward(seconds: float) -> None:
        if store_url.startswith("redis"):
            await asyncio.sleep(seconds)
        else:
            clock.now += seconds

    return fast_forward


# What each part keeps, by backend: the SQLite tables, the Redis key patterns.
_TABLES = {"buckets": ("limit_rates", "limit_slots", "limit_pauses"), "locks": ("resource_locks",)}
_PATTERNS = {"buckets": "tp:{lim:*", "locks": "tp:{res:*}:l:*"}


def stored_entries(store: Store, part: str) -> int:
    """How many entries ``part`` (``buckets``: rate buckets, slot leases, pauses;
    ``locks``: resource locks, not their counters) keeps in ``store`` now, lapsed or not:
    entries in memory, rows in SQLite, keys in Redis."""
    if isinstance(store, MemoryStore):
        return len(store.buckets() if part == "buckets" else store.locks())
    if isinstance(store, SQLiteStore):
        db = sqlite3.connect(store.path)
        try:
            return sum(_rows(db, table) for table in _TABLES[part])
        finally:
            db.close()
    if isinstance(store, PostgresStore):  # its sweep: tests/test_postgres.py
        pytest.skip("the PostgreSQL sweep has its own test (tests/test_postgres.py)")
    assert isinstance(store, RedisStore)
    if store.url.startswith("redis+cluster://"):
        host, _, port = store.url.removeprefix("redis+cluster://").split(",")[0].partition(":")
        nodes = redis.RedisCluster(host=host, port=int(port))
        try:
            return sum(1 for _ in nodes.scan_iter(match=_PATTERNS[part]))
        finally:
            nodes.close()
    client = redis.Redis.from_url(store.url)
    try:
        return sum(1 for _ in client.scan_iter(match=_PATTERNS[part]))
    finally:
        client.close()


def _rows(db: sqlite3.Connection, table: str) -> int:
    exists = db.execute("SELECT 1 FROM sqlite_master WHERE name = ?", (table,)).fetchone()
    return int(db.execute(f"SELECT count(*) FROM {table}").fetchone()[0]) if exists else 0
