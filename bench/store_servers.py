"""The stores bench/run.py measures first executions and replays on, each started here,
and what it can count of the proxy's round trips to each.

- ``redis``: a private ``redis-server`` without persistence; ``INFO commandstats``.
- ``sqlite``: a file in the run's temporary directory, the store's default
  ``synchronous=full``; nothing to count (no server).
- ``postgresql``: the machine's own server on 127.0.0.1:5432 when it answers, else one
  started in a temporary folder (tests/postgres_server.py, as the tests do), in a database
  of its own; ``xact_commit`` of ``pg_stat_database`` (every store call is one statement
  in its own transaction, so a commit is a round trip).
- ``redis-cluster``: 3 primaries and 3 replicas (tests/servers.py, as the tests do);
  ``INFO commandstats`` of every primary, summed.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from psycopg import sql

from tests.postgres_server import PostgresServer
from tests.servers import RedisCluster, RedisServer

STORES = ("redis", "sqlite", "postgresql", "redis-cluster")

Usage = tuple[float | None, float | None, dict[str, float] | None]
"""Round trips, network reads and commands by name per request (None: not counted)."""
Count = Callable[[int], Usage]
"""Given the requests wrk completed, the usage since the snapshot that made it."""
Counter = Callable[[], Count]
"""Takes a snapshot of the store's counters."""

# Commands a client sends itself; the others in commandstats ran inside Lua scripts.
CLIENT_COMMANDS = (
    "evalsha",
    "eval",
    "script",
    "ping",
    "hello",
    "client",
    "select",
    "cluster",
    "readonly",
    "asking",
)
# A PostgreSQL server process (15 and later) that flushed its statistics less than a
# second ago keeps the next ones pending until it has been idle for up to 10 s
# (PGSTAT_IDLE_INTERVAL): wait that out before reading pg_stat_database, before and after.
PG_STATS_SECONDS = 10.5


@dataclass(frozen=True)
class Store:
    name: str
    url: str
    counter: Counter | None
    about: str
    """What the report says of it: the server's version and settings."""


def redis_info(client: redis.Redis) -> dict[str, Any]:
    return client.info("stats", "commandstats")


def redis_usage(
    before: list[dict[str, Any]], after: list[dict[str, Any]], requests: int
) -> tuple[float, float, dict[str, float]]:
    """Round trips, network reads and commands per request between INFO snapshots of
    one or more servers (summed)."""
    reads = 0
    calls: dict[str, int] = {}
    for old, new in zip(before, after, strict=True):
        # The INFO that took `new` is one of the reads; commandstats lists it as `info`.
        reads += new["total_reads_processed"] - old["total_reads_processed"] - 1
        for name, stats in new.items():
            if name.startswith("cmdstat_") and name != "cmdstat_info":
                short = name.removeprefix("cmdstat_")
                calls[short] = (
                    calls.get(short, 0) + stats["calls"] - old.get(name, {}).get("calls", 0)
                )
    per_request = {name: n / requests for name, n in sorted(calls.items()) if n}
    trips = sum(n for name, n in calls.items() if name.split("|")[0] in CLIENT_COMMANDS)
    return trips / requests, reads / requests, per_request


def redis_counter(*clients: redis.Redis) -> Counter:
    def snapshot() -> Count:
        before = [redis_info(c) for c in clients]

        def count(requests: int) -> Usage:
            return redis_usage(before, [redis_info(c) for c in clients], requests)

        return count

    return snapshot


def postgres_counter(server: PostgresServer, dbname: str) -> Counter:
    """Transactions committed in ``dbname`` (read from another database, so the reading
    does not count itself)."""

    def commits() -> int:
        time.sleep(PG_STATS_SECONDS)
        with server.admin() as conn:
            row = conn.execute(
                "SELECT xact_commit FROM pg_stat_database WHERE datname = %s", (dbname,)
            ).fetchone()
        assert row is not None, f"no pg_stat_database row for {dbname}"
        return int(str(row[0]))

    def snapshot() -> Count:
        before = commits()

        def count(requests: int) -> Usage:
            return (commits() - before) / requests, None, None

        return count

    return snapshot


def redis_version(client: redis.Redis) -> str:
    return str(client.info("server")["redis_version"])


def start_redis(stack: ExitStack) -> Store:
    """A private redis-server on a free port, without persistence (as the tests')."""
    server = RedisServer().start()
    stack.callback(server.stop)
    client = redis.Redis(port=server.port)
    stack.callback(client.close)
    about = f"Redis {redis_version(client)}, one server, no persistence"
    return Store("redis", server.url, redis_counter(client), about)


def start_sqlite(workdir: Path) -> Store:
    import sqlite3

    path = workdir / "sqlite" / "state.db"
    path.parent.mkdir()
    about = f"SQLite {sqlite3.sqlite_version}, WAL, synchronous=full (the default)"
    return Store("sqlite", f"sqlite://{path}", None, about)


def start_postgres(stack: ExitStack) -> Store:
    server = PostgresServer.local_or_started()
    stack.callback(server.stop)
    dbname = server.create_database()
    with server.admin() as conn:
        # The tests' databases do not wait for the disk; this one keeps the server's setting.
        conn.execute(
            sql.SQL("ALTER DATABASE {} RESET synchronous_commit").format(sql.Identifier(dbname))
        )
        settings = {}
        for name in ("server_version", "synchronous_commit", "fsync"):
            row = conn.execute(sql.SQL("SHOW {}").format(sql.Identifier(name))).fetchone()
            settings[name] = "?" if row is None else str(row[0])
    where = "the machine's own server" if not server.owned else "a server started for the run"
    about = (
        f"PostgreSQL {settings['server_version'].split()[0]}, {where}, "
        f"synchronous_commit={settings['synchronous_commit']}, fsync={settings['fsync']}"
    )
    return Store("postgresql", server.url(dbname), postgres_counter(server, dbname), about)


def start_cluster(stack: ExitStack) -> Store:
    cluster = RedisCluster(Path(tempfile.mkdtemp(prefix="tool-proxy-bench-cluster-"))).start()
    stack.callback(cluster.stop)
    clients = [redis.Redis(port=port) for port in cluster.primaries()]
    for client in clients:
        stack.callback(client.close)
    about = f"Redis {redis_version(clients[0])}, 3 primaries and 3 replicas, no persistence"
    return Store("redis-cluster", cluster.url, redis_counter(*clients), about)


def start_store(name: str, stack: ExitStack, workdir: Path) -> Store:
    """The store ``name`` (one of STORES), running until ``stack`` closes."""
    if name == "redis":
        return start_redis(stack)
    if name == "sqlite":
        return start_sqlite(workdir)
    if name == "postgresql":
        return start_postgres(stack)
    if name == "redis-cluster":
        return start_cluster(stack)
    raise ValueError(f"unknown store {name!r}: one of {', '.join(STORES)}")
