"""``postgresql://...``: records, rate buckets, locks and the job queue in PostgreSQL.

Every operation is one call of a function of the schema (``postgres.sql``), so it costs
one round trip (a claim, then a completion: two for a first execution, one for a
replay), in autocommit: each call its own transaction, which also suits PgBouncer in
transaction mode. A function that decides on a key first takes a transaction-level
advisory lock on it, so calls on one key are serialized whichever replica sends them.

Times are the server's clock (``statement_timestamp()``), shared by every replica;
the contract tests pass a clock of their own instead. Expired rows are invisible at
once and deleted in bounded batches by ``sweep``.

The driver is psycopg 3 (async) with a bounded ``psycopg_pool`` (docs/benchmarks.md has
the measurement against asyncpg). The pool is set by the URL's query::

    postgresql://user:password@host:5432/db?pool_max=10&pool_timeout=2s&timeout=5s

``pool_min``/``pool_max`` connections (default 1 and 10); a call waits ``pool_timeout``
for a free one, then fails with ``StoreUnavailable`` (503); ``timeout`` bounds a whole
call; ``prepare=true`` prepares statements on the server after five uses (off by default:
PgBouncer before 1.21 in transaction mode refuses them, and they measured no faster).
Every other parameter goes to libpq as it is (``sslmode``, ``connect_timeout``,
...). The schema (``tool_proxy`` unless ``schema=``) is created or migrated by ``open``,
in one transaction under an advisory lock, so replicas that start together apply it once;
``schema_version`` says which version the database has.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from importlib import resources
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import psycopg
import psycopg_pool
from psycopg import sql

from proxy.errors import StoreError, StoreRefused, StoreUnavailable
from proxy.store.base import Claim, Record, RecordKey, State
from proxy.store.buckets import Admission, Entry, GroupState, Rate, RateState, Slots, group_state
from proxy.store.locks import Grant, HeldLock, LocksHeld, Version, counter_start, locks_held
from proxy.store.queue import Job, JobState

# Connections the pool keeps open at least, and opens at most.
DEFAULT_POOL_MIN = 1
DEFAULT_POOL_MAX = 10
# Seconds a call waits for a free connection before it fails (503), not a hang.
DEFAULT_POOL_TIMEOUT = 2.0
# Seconds one call may take in all (connection, statement, answer).
DEFAULT_TIMEOUT = 5.0
# Seconds the pool retries a connection that fails (backing off) before it gives up; the
# next call that needs one starts again at once. psycopg_pool's default (300 s, its delay
# doubling) would leave a proxy failing for a minute after its server came back.
RECONNECT_SECONDS = 2.0
# Seconds libpq waits for a new connection, unless the URL sets connect_timeout.
DEFAULT_CONNECT_TIMEOUT = 3
# The schema the store's tables and functions live in, unless the URL sets schema=.
DEFAULT_SCHEMA = "tool_proxy"
# Expired rows of each table that one sweep transaction deletes at most.
SWEEP_BATCH = 1000
# Sweep transactions one ``sweep`` runs at most (more expired rows wait for the next).
SWEEP_ROUNDS = 10
# bytea holds 1 GB; less a margin for the rest of the row.
MAX_PAYLOAD_BYTES = 1_000_000_000 - 64 * 1024
# The schema's versions, each a file beside this module applied once, in order: a change
# of the schema is a new file (CREATE OR REPLACE FUNCTION, ALTER TABLE), never an edit
# of one that databases have applied already.
# Version 2 added the replays counter (new ``_v2`` functions; version 1's still answer
# as before, for its replicas running during a rolling upgrade); version 3 a version's
# mark in its answer (``version_op_v3``; ``version_op`` answers as before).
MIGRATIONS: tuple[tuple[int, str], ...] = (
    (1, "postgres.sql"),
    (2, "postgres-2.sql"),
    (3, "postgres-3.sql"),
)
# The advisory lock that serializes migrations of replicas starting at once.
MIGRATION_LOCK = 0x746F6F6C70727879  # "toolprxy"
# Where job changes are told (NOTIFY), within the database.
CHANNEL = "tool_proxy_jobs"
_SCHEMES = ("postgresql", "postgres")
_OPTIONS = ("pool_min", "pool_max", "pool_timeout", "timeout", "prepare", "schema")
_IDENTIFIER = re.compile(r"[a-z_][a-z0-9_]{0,62}")
# SQLSTATE classes of a server that cannot serve now (a retry may pass): connection
# exceptions, transaction rollbacks (deadlocks, serialization), operator intervention
# (shutdown), system errors; and "too many connections".
_UNAVAILABLE = ("08", "40", "57", "58", "53300")
# SQLSTATE classes of writes that no retry will turn into success: insufficient
# resources (disk full, out of memory), program limits (a value too large).
_REFUSED = ("53", "54")


@dataclass(frozen=True, slots=True)
class PostgresOptions:
    """What a ``postgresql://`` URL says: libpq's connection string and the pool's bounds."""

    conninfo: str = field(repr=False)  # it may hold a password
    pool_min: int = DEFAULT_POOL_MIN
    pool_max: int = DEFAULT_POOL_MAX
    pool_timeout: float = DEFAULT_POOL_TIMEOUT
    timeout: float = DEFAULT_TIMEOUT
    prepare: bool = False
    schema: str = DEFAULT_SCHEMA


def parse_postgres_url(url: str) -> PostgresOptions:
    """The options of ``url``; ``ValueError`` naming the parameter that is wrong."""
    parts = urlsplit(url)
    if parts.scheme not in _SCHEMES:
        raise ValueError("must start with postgresql:// (or postgres://)")
    query = parse_qsl(parts.query, keep_blank_values=True)
    ours = {k: v for k, v in query if k in _OPTIONS}
    libpq = [(k, v) for k, v in query if k not in _OPTIONS]
    if not any(k == "connect_timeout" for k, _ in libpq):
        libpq.append(("connect_timeout", str(DEFAULT_CONNECT_TIMEOUT)))
    options = PostgresOptions(
        urlunsplit(parts._replace(query=urlencode(libpq))),
        pool_min=_count(ours, "pool_min", DEFAULT_POOL_MIN, 0),
        pool_max=_count(ours, "pool_max", DEFAULT_POOL_MAX, 1),
        pool_timeout=_seconds(ours, "pool_timeout", DEFAULT_POOL_TIMEOUT),
        timeout=_seconds(ours, "timeout", DEFAULT_TIMEOUT),
        prepare=_flag(ours, "prepare", False),
        schema=ours.get("schema", DEFAULT_SCHEMA),
    )
    if options.pool_min > options.pool_max:
        raise ValueError(f"pool_min ({options.pool_min}) is above pool_max ({options.pool_max})")
    if not _IDENTIFIER.fullmatch(options.schema):
        raise ValueError(f"schema must be a lower-case SQL identifier, not {options.schema!r}")
    return options


def _count(query: dict[str, str], name: str, default: int, least: int) -> int:
    raw = query.get(name)
    if raw is None:
        return default
    if not raw.isdigit() or int(raw) < least:
        raise ValueError(f"{name} must be a whole number of at least {least}, not {raw!r}")
    return int(raw)


def _seconds(query: dict[str, str], name: str, default: float) -> float:
    raw = query.get(name)
    if raw is None:
        return default
    number, scale = (raw[:-2], 0.001) if raw.endswith("ms") else (raw.removesuffix("s"), 1.0)
    try:
        value = float(number) * scale
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise ValueError(f"{name} must be a positive duration (2s, 500ms), not {raw!r}")
    return value


def _flag(query: dict[str, str], name: str, default: bool) -> bool:
    raw = query.get(name, str(default)).lower()
    if raw not in ("true", "false"):
        raise ValueError(f"{name} must be true or false, not {raw!r}")
    return raw == "true"


def _where(exc: psycopg.Error) -> str:
    return f"postgres store: {type(exc).__name__}: {str(exc).strip() or exc.sqlstate}"


def translate(exc: Exception) -> Exception:
    """The proxy's error for a foreign one (the one place they are translated)."""
    if isinstance(exc, psycopg_pool.PoolTimeout):
        return StoreUnavailable(f"postgres store: no free connection in the pool ({exc})")
    if isinstance(exc, TimeoutError):
        return StoreUnavailable("postgres store: the call timed out")
    if isinstance(exc, OSError):
        return StoreUnavailable(f"postgres store: {exc.strerror or exc}")
    if not isinstance(exc, psycopg.Error):
        return exc
    state = exc.sqlstate or ""
    if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError) and not state:
        return StoreUnavailable(_where(exc))
    if state.startswith(_UNAVAILABLE):
        return StoreUnavailable(_where(exc))
    if state.startswith(_REFUSED):
        return StoreRefused(_where(exc))
    return StoreError(_where(exc))


@contextmanager
def _translated() -> Iterator[None]:
    try:
        yield
    except (psycopg.Error, psycopg_pool.PoolTimeout, TimeoutError, OSError) as exc:
        raise translate(exc) from exc


Row = tuple[Any, ...]


class PostgresStore:
    """A bounded pool of connections to one PostgreSQL database (or PgBouncer)."""

    max_payload_bytes = MAX_PAYLOAD_BYTES

    def __init__(self, url: str, clock: Callable[[], float] | None = None) -> None:
        try:
            self.options = parse_postgres_url(url)
        except ValueError as exc:
            raise StoreUnavailable(f"postgres store URL: {exc}") from exc
        self._clock = clock
        self._pool: psycopg_pool.AsyncConnectionPool[psycopg.AsyncConnection[Row]] | None = None
        self._queue: PostgresQueue | None = None
        self._migrated = False
        self._migrating = asyncio.Lock()

    def now(self) -> float | None:
        """The time the functions are given: None for the server's own clock."""
        return None if self._clock is None else self._clock()

    def _connect_kwargs(self) -> dict[str, Any]:
        prepare = None if not self.options.prepare else 5
        return {"autocommit": True, "prepare_threshold": prepare}

    async def open(self) -> None:
        """Open the pool and bring the schema to this version. A server that cannot be
        reached now is not an error (as with Redis, the proxy starts and fails closed):
        the first call migrates then. A database whose schema is newer than this proxy's
        raises ``StoreError``."""
        if self._pool is None:
            self._pool = psycopg_pool.AsyncConnectionPool(
                self.options.conninfo,
                min_size=self.options.pool_min,
                max_size=self.options.pool_max,
                timeout=self.options.pool_timeout,
                reconnect_timeout=RECONNECT_SECONDS,
                kwargs=self._connect_kwargs(),
                open=False,
            )
            await self._pool.open(wait=False)
        with contextlib.suppress(StoreUnavailable):
            await self._migrate()

    async def _migrate(self) -> None:
        assert self._pool is not None
        async with self._migrating:
            if self._migrated:
                return
            with _translated():
                async with asyncio.timeout(self.options.timeout * 2):
                    async with self._pool.connection() as conn:
                        await migrate(conn, self.options.schema)
            self._migrated = True

    async def call(self, function: str, args: Sequence[Any]) -> list[Row]:
        """The rows of ``schema.function(args..., now)``: one statement, one round trip."""
        if self._pool is None:
            raise StoreUnavailable("postgres store: not opened")
        if not self._migrated:
            await self._migrate()
        marks = ", ".join(["%s"] * (len(args) + 1))
        query = f"SELECT * FROM {self.options.schema}.{function}({marks})"
        with _translated():
            async with asyncio.timeout(self.options.timeout):
                async with self._pool.connection() as conn:
                    cursor = await conn.execute(query, [*args, self.now()])
                    return await cursor.fetchall()

    async def read(self, query: str, args: Sequence[Any]) -> list[Row]:
        """The rows of a read-only ``query`` whose ``{s}`` names the schema and whose last
        ``%s`` is the time (as for ``call``): the operator console's reads, plain SELECTs
        rather than functions, so that adding them needs no new schema version (a replica
        of the version before would refuse to start against it)."""
        if self._pool is None:
            raise StoreUnavailable("postgres store: not opened")
        if not self._migrated:
            await self._migrate()
        statement = sql.SQL(query).format(s=sql.Identifier(self.options.schema))
        with _translated():
            async with asyncio.timeout(self.options.timeout):
                async with self._pool.connection() as conn:
                    cursor = await conn.execute(statement, [*args, self.now()])
                    return await cursor.fetchall()

    async def claim(
        self,
        key: RecordKey,
        fingerprint: str,
        owner: str,
        lock_ttl: float,
        result_ttl: float,
        *,
        reexecute_lapsed: bool = False,
        replay: bool = True,
    ) -> Claim:
        args = (*key, key.scope, fingerprint, owner, lock_ttl, result_ttl, reexecute_lapsed)
        (row,) = await self.call("claim_v2", (*args, replay))
        if row[0]:
            return Claim(None, row[1])
        return Claim(_record(row[2:]))

    async def renew(self, key: RecordKey, owner: str, lock_ttl: float, result_ttl: float) -> bool:
        return await self._flag("renew", (*key, owner, lock_ttl, result_ttl))

    async def complete(
        self,
        key: RecordKey,
        owner: str,
        fingerprint: str,
        state: State,
        payload: bytes,
        result_ttl: float,
        *,
        replace_outcome: bool = True,
        successor: str | None = None,
    ) -> bool:
        args = (*key, key.scope, owner, fingerprint, state.value, payload, result_ttl)
        return await self._flag("complete", (*args, replace_outcome, successor or owner))

    async def release(self, key: RecordKey, owner: str) -> bool:
        return await self._flag("release", (*key, owner))

    async def get(self, key: RecordKey) -> Record | None:
        rows = await self.call("get_v2", key)
        return _record(rows[0]) if rows else None

    async def records(self, scope: str) -> list[Record]:
        return [_record(row) for row in await self.call("scope_records_v2", (scope,))]

    async def scan(self, cursor: str, count: int) -> tuple[str, list[Record]]:
        slot, name = json.loads(cursor) if cursor else ("", "")
        rows = await self.call("scan_v2", (slot, name, max(count, 1)))
        found = [_record(row[1:]) for row in rows if row[0]]
        more = len(rows) == max(count, 1)
        return (json.dumps([rows[-1][1], rows[-1][2]]) if more else ""), found

    async def settle(
        self,
        key: RecordKey,
        state: State | None,
        payload: bytes,
        result_ttl: float,
        *,
        owner: str | None = None,
    ) -> bool:
        value = None if state is None else state.value
        return await self._flag("settle", (*key, value, payload, result_ttl, owner))

    async def delete(self, key: RecordKey) -> bool:
        return await self._flag("delete_record", key)

    async def put_value(self, key: str, value: bytes, ttl: float) -> None:
        await self.call("put_value", (key, value, ttl))

    async def get_value(self, key: str) -> bytes | None:
        (row,) = await self.call("get_value", (key,))
        return None if row[0] is None else bytes(row[0])

    async def acquire(self, key: str, owner: str, ttl: float) -> bool:
        return await self._flag("acquire_value", (f"lock|{key}", owner.encode(), ttl))

    async def unlock(self, key: str, owner: str) -> None:
        await self.call("unlock_value", (f"lock|{key}", owner.encode()))

    async def sweep(self) -> int:
        """Delete expired rows of every table, ``SWEEP_BATCH`` of each per transaction;
        return how many records."""
        swept = 0
        for _ in range(SWEEP_ROUNDS):
            ((count,),) = await self.call("sweep", (SWEEP_BATCH,))
            swept += count
            if count < SWEEP_BATCH:
                break
        return swept

    async def ping(self) -> None:
        await self.call("clock", ())

    async def _flag(self, function: str, args: Sequence[Any]) -> bool:
        ((answer,),) = await self.call(function, args)
        return bool(answer)

    def buckets(self) -> PostgresBuckets:
        """The rate buckets in the same database, pool and clock."""
        return PostgresBuckets(self)

    def locks(self) -> PostgresLocks:
        """The resource locks and versions in the same database, pool and clock."""
        return PostgresLocks(self)

    def queue(self) -> PostgresQueue:
        """The job queue in the same database, pool and clock (one per store)."""
        if self._queue is None:
            self._queue = PostgresQueue(self)
        return self._queue

    async def listen(self) -> psycopg.AsyncConnection[Row]:
        """A connection of its own (not the pool's) that listens to job changes."""
        with _translated():
            conn = await psycopg.AsyncConnection.connect(self.options.conninfo, autocommit=True)
            await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(CHANNEL)))
            return conn

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None


async def apply_schema(url: str) -> tuple[int, int]:
    """``tool-proxy migrate``: bring the URL's schema to this version now, over one
    connection (the same transaction and advisory lock as a replica's start-up); the
    version it was at (0: none) and the one it is at."""
    try:
        options = parse_postgres_url(url)
    except ValueError as exc:
        raise StoreUnavailable(f"postgres store URL: {exc}") from exc
    with _translated():
        async with asyncio.timeout(options.timeout * 2):
            conn = await psycopg.AsyncConnection.connect(options.conninfo, autocommit=True)
            async with conn:
                before = await _version(conn, options.schema)
                return before, await migrate(conn, options.schema)


async def _version(conn: psycopg.AsyncConnection[Row], schema: str) -> int:
    """The version ``schema`` is at; 0 if it has none yet."""
    cursor = await conn.execute(
        "SELECT to_regclass(format('%%I.schema_version', %s::text)) IS NOT NULL", (schema,)
    )
    row = await cursor.fetchone()
    if row is None or not row[0]:
        return 0
    query = sql.SQL("SELECT coalesce(max(version), 0) FROM {}.schema_version")
    cursor = await conn.execute(query.format(sql.Identifier(schema)))
    row = await cursor.fetchone()
    return int(row[0]) if row is not None else 0


async def migrate(conn: psycopg.AsyncConnection[Row], schema: str) -> int:
    """Bring ``schema`` to the latest version in one transaction, under an advisory lock
    (replicas that start together wait for each other); the version it is at."""
    name = sql.Identifier(schema)
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
        await conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(name))
        await conn.execute(sql.SQL("SET LOCAL search_path = {}").format(name))
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_version (version integer PRIMARY KEY,"
            " applied_at timestamptz NOT NULL DEFAULT now())"
        )
        cursor = await conn.execute("SELECT coalesce(max(version), 0) FROM schema_version")
        row = await cursor.fetchone()
        current = int(row[0]) if row is not None else 0
        latest = MIGRATIONS[-1][0]
        if current > latest:
            raise StoreError(
                f"postgres store: schema {schema} is at version {current}, newer than this"
                f" proxy's {latest}: upgrade the proxy"
            )
        for version, filename in MIGRATIONS:
            if version > current:
                text = resources.files("proxy.store").joinpath(filename).read_text()
                await conn.execute(text)
                await conn.execute("INSERT INTO schema_version (version) VALUES (%s)", (version,))
        return latest


def _record(row: Row) -> Record:
    slot, name, state, fingerprint, owner, ttl, payload, created, updated, replays = row
    key = RecordKey(slot, name)
    return Record(
        State(state), fingerprint, owner, ttl, bytes(payload), key, created, updated, replays
    )


def _paused(group: str, scope: str) -> str:
    """The ``limit_pauses`` row of a group's pause of ``scope``."""
    return f"{group}\x1f{scope}" if scope else group


class PostgresBuckets:
    """``Buckets`` in the store's database: each call one function (``take``, ``finish``,
    ``renew_slots``, ``pause``) under the group's advisory lock."""

    def __init__(self, store: PostgresStore) -> None:
        self._store = store

    async def take(
        self,
        group: str,
        rates: Sequence[Rate],
        slots: Sequence[Slots],
        owner: str,
        slot_ttl: float,
        scope: str = "",
    ) -> Admission:
        args = (
            group,
            [rate.key for rate in rates],
            [rate.interval for rate in rates],
            [rate.tolerance for rate in rates],
            [rate.cost for rate in rates],
            [slot.key for slot in slots],
            [slot.capacity for slot in slots],
            owner,
            slot_ttl,
            _paused(group, scope),
        )
        ((allowed, paused, retry_after, remaining, reset, limited, free),) = await self._store.call(
            "take", args
        )
        states = tuple(map(RateState, remaining, reset, limited))
        return Admission(allowed, paused, retry_after, states, tuple(free))

    async def finish(
        self, group: str, changes: Sequence[tuple[Rate, float]], slots: Sequence[str], owner: str
    ) -> None:
        keys = [rate.key for rate, _ in changes]
        intervals = [rate.interval for rate, _ in changes]
        units = [float(units) for _, units in changes]
        await self._store.call("finish", (group, keys, intervals, units, list(slots), owner))

    async def renew(self, group: str, slots: Sequence[str], owner: str, ttl: float) -> bool:
        ((kept,),) = await self._store.call("renew_slots", (group, list(slots), owner, ttl))
        return bool(kept)

    async def pause(self, group: str, seconds: float, scope: str = "") -> None:
        await self._store.call("pause", (_paused(group, scope), seconds))

    async def state(self, group: str, limit: int) -> GroupState:
        prefix = _paused(group, "x")[:-1]
        rows = await self._store.read(_GROUP_STATE, (group, limit + 1, prefix))
        kinds: dict[str, list[Entry]] = {"rate": [], "slots": [], "pause": []}
        for kind, key, seconds, held in rows:
            kinds[kind].append(Entry(key, float(seconds), int(held)))
        return group_state(kinds["rate"], kinds["slots"], kinds["pause"], limit, seen=True)


# A group's live entries, at most p_limit (+1) of each kind: %s are the group, the limit,
# the prefix of its scoped pauses, then the time (``PostgresStore.read``).
_GROUP_STATE = """
WITH a AS (SELECT %s::text AS grp, %s::integer AS n, %s::text AS scoped, {s}.clock(%s) AS now)
(SELECT 'rate', r.key, r.tat - a.now, 0::bigint FROM {s}.limit_rates r, a
    WHERE r.grp = a.grp AND r.tat > a.now ORDER BY r.tat DESC LIMIT (SELECT n FROM a))
UNION ALL
(SELECT 'slots', l.key, max(l.until) - min(a.now), count(*) FROM {s}.limit_slots l, a
    WHERE l.grp = a.grp AND l.until > a.now GROUP BY l.key
    ORDER BY count(*) DESC, max(l.until) DESC LIMIT (SELECT n FROM a))
UNION ALL
(SELECT 'pause', CASE WHEN p.grp = a.grp THEN '' ELSE substr(p.grp, length(a.scoped) + 1) END,
    p.until - a.now, 0::bigint FROM {s}.limit_pauses p, a
    WHERE (p.grp = a.grp OR left(p.grp, length(a.scoped)) = a.scoped) AND p.until > a.now
    ORDER BY p.until DESC LIMIT (SELECT n FROM a))
"""


class PostgresLocks:
    """``Locks`` in the store's database: a scope's counter is a row of
    ``resource_counters`` that is never deleted; lapsed locks and versions are deleted by
    the store's ``sweep``."""

    def __init__(self, store: PostgresStore) -> None:
        self._store = store

    async def acquire(self, scope: str, key: str, owner: str, ttl: float) -> Grant:
        ((token, expires_in),) = await self._store.call(
            "acquire_lock", (scope, key, owner, ttl, counter_start())
        )
        return Grant(token, expires_in)

    async def renew(self, scope: str, key: str, owner: str, ttl: float) -> bool:
        ((kept,),) = await self._store.call("renew_lock", (_scoped(scope, key), owner, ttl))
        return bool(kept)

    async def release(self, scope: str, key: str, owner: str) -> bool:
        ((freed,),) = await self._store.call("release_lock", (_scoped(scope, key), owner))
        return bool(freed)

    async def version(self, scope: str, key: str, ttl: float) -> Version:
        return await self._version("read", scope, key, "", False, ttl)

    async def begin(self, scope: str, key: str, owner: str, ttl: float) -> Version:
        return await self._version("begin", scope, key, owner, False, ttl)

    async def settle(self, scope: str, key: str, owner: str, wrote: bool, ttl: float) -> int | None:
        rows = await self._store.call(
            "version_op_v3", ("settle", scope, key, owner, wrote, ttl, counter_start())
        )
        return int(rows[0][0]) if rows else None

    async def held(self, scope: str, limit: int) -> LocksHeld:
        prefix = _scoped(scope, "")
        rows = await self._store.read(_HELD_LOCKS, (prefix, limit + 1))
        found = [HeldLock(key, int(token), float(left)) for key, token, left in rows]
        return locks_held(found, limit, seen=True)

    async def _version(
        self, op: str, scope: str, key: str, owner: str, wrote: bool, ttl: float
    ) -> Version:
        ((number, written, writing),) = await self._store.call(
            "version_op_v3", (op, scope, key, owner, wrote, ttl, counter_start())
        )
        return Version(int(number), bool(written), bool(writing))


def _scoped(scope: str, key: str) -> str:
    return f"{scope}\n{key}"


# A scope's locks held now, the newest first: %s are the prefix of its keys, the limit,
# then the time (``PostgresStore.read``).
_HELD_LOCKS = """
WITH a AS (SELECT %s::text AS scoped, %s::integer AS n, {s}.clock(%s) AS now)
SELECT substr(l.key, length(a.scoped) + 1), l.token, l.until - a.now
    FROM {s}.resource_locks l, a
    WHERE left(l.key, length(a.scoped)) = a.scoped AND l.until > a.now
    ORDER BY l.token DESC LIMIT (SELECT n FROM a)
"""


class PostgresQueue:
    """``Queue`` in the store's database (tables ``jobs`` and ``job_events``): ``take``
    picks with ``FOR UPDATE SKIP LOCKED``, so workers of every replica share the queue
    without waiting on each other; every change is told with ``NOTIFY``, and ``changes``
    listens on a connection of its own (closed when the iterator is)."""

    def __init__(self, store: PostgresStore) -> None:
        self._store = store

    async def submit(self, job: Job) -> Job:
        args = (job.id, job.route, job.principal, job.slot, job.name, job.label)
        rows = await self._store.call("submit_job", (*args, job.request, job.keep))
        if not rows:
            raise ValueError(f"job {job.id} exists")
        return _job(rows[0])

    async def get(self, id: str) -> Job | None:
        rows = await self._store.call("get_job", (id,))
        return _job(rows[0]) if rows else None

    async def events(self, id: str, after: int) -> list[Job] | None:
        rows = await self._store.call("job_events", (id, after))
        if rows and not rows[0][0]:
            return None
        return [_job(row[1:]) for row in rows]

    async def take(self, route: str, worker: str, visibility: float) -> Job | None:
        rows = await self._store.call("take_job", (route, worker, visibility))
        return _job(rows[0]) if rows else None

    async def hold(self, id: str, worker: str, visibility: float) -> bool:
        ((held,),) = await self._store.call("hold_job", (id, worker, visibility))
        return bool(held)

    async def move(
        self,
        id: str,
        expect: frozenset[JobState],
        state: JobState,
        *,
        worker: str | None = None,
        attempts: int | None = None,
        sent: bool | None = None,
        error: bytes | None = None,
        due: float = 0.0,
    ) -> Job | None:
        expected = sorted(s.value for s in expect)
        args = (id, expected, state.value, worker, attempts, sent, error, due, state.spent)
        rows = await self._store.call("move_job", args)
        return _job(rows[0]) if rows else None

    async def list(self, state: JobState | None, cursor: str, count: int) -> tuple[str, list[Job]]:
        value = None if state is None else state.value
        rows = await self._store.call("list_jobs", (value, cursor, max(count, 1)))
        jobs = [_job(row) for row in rows]
        return (jobs[-1].id if len(jobs) == max(count, 1) else ""), jobs

    async def changes(self) -> AsyncIterator[str]:
        conn = await self._store.listen()
        try:
            with _translated():
                async for note in conn.notifies():
                    yield note.payload
        finally:
            await conn.close()


def _job(row: Row) -> Job:
    """A job from the columns of ``jobs`` (``Job``'s order; the hold's after them)."""
    job = Job(*row[:16])
    state, request, error = JobState(job.state), bytes(job.request), bytes(job.error)
    return replace(job, state=state, request=request, error=error)
