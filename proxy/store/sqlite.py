"""``sqlite:///path``: the embedded default store.

Durable across restarts and safe for several worker processes on one host: every
state change is one ``BEGIN IMMEDIATE`` transaction in WAL mode, so writers are
serialized by SQLite's own lock. Calls run on one dedicated thread per process so the
event loop never blocks on the database lock. Expiry uses the wall clock (shared by
the processes); expired rows are invisible at once and deleted by ``sweep``.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qs

from proxy.errors import StoreRefused, StoreUnavailable
from proxy.store.base import Claim, Record, RecordKey, State
from proxy.store.buckets import (
    Admission,
    Entry,
    GroupState,
    Rate,
    Slots,
    adjusted,
    gcra,
    group_state,
)
from proxy.store.locks import Grant, HeldLock, LocksHeld, Version, counter_start, locks_held
from proxy.store.queue import Job, JobState

T = TypeVar("T")

# How long a writer waits for another process's transaction before giving up.
BUSY_TIMEOUT_SECONDS = 5.0
_SYNCHRONOUS = ("full", "normal", "extra")
# SQLite's default SQLITE_MAX_LENGTH (1e9 bytes), less a margin for the rest of the row.
MAX_PAYLOAD_BYTES = 1_000_000_000 - 64 * 1024
# Result codes of writes that no retry will turn into success: the disk is full, or the
# value is above SQLite's limits (``StoreRefused``).
_REFUSALS = frozenset({sqlite3.SQLITE_FULL, sqlite3.SQLITE_TOOBIG})

_SCHEMA = """
CREATE TABLE IF NOT EXISTS step_records (
    slot TEXT NOT NULL, name TEXT NOT NULL, scope TEXT NOT NULL, state TEXT NOT NULL,
    fingerprint TEXT NOT NULL, owner TEXT NOT NULL, lease_until REAL NOT NULL DEFAULT 0,
    expires_at REAL NOT NULL, created_at REAL NOT NULL, updated_at REAL NOT NULL,
    payload BLOB NOT NULL DEFAULT x'', replays INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (slot, name)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS step_records_expiry ON step_records (expires_at);
CREATE INDEX IF NOT EXISTS step_records_scope ON step_records (scope, created_at);
CREATE TABLE IF NOT EXISTS slots (
    slot TEXT PRIMARY KEY, name TEXT NOT NULL, expires_at REAL NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS kv (
    key TEXT PRIMARY KEY, value BLOB NOT NULL, expires_at REAL NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY, route TEXT NOT NULL, principal TEXT NOT NULL, slot TEXT NOT NULL,
    name TEXT NOT NULL, label TEXT NOT NULL, request BLOB NOT NULL, keep REAL NOT NULL,
    state TEXT NOT NULL, attempts INTEGER NOT NULL, sent INTEGER NOT NULL, error BLOB NOT NULL,
    created_at REAL NOT NULL, updated_at REAL NOT NULL, due REAL NOT NULL, seq INTEGER NOT NULL,
    holder TEXT NOT NULL DEFAULT '', held_until REAL NOT NULL DEFAULT 0,
    expires_at REAL NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS jobs_expiry ON jobs (expires_at);
CREATE INDEX IF NOT EXISTS jobs_queue ON jobs (route, holder, due)
    WHERE state IN ('queued', 'running');
CREATE TABLE IF NOT EXISTS job_events (
    id TEXT NOT NULL, seq INTEGER NOT NULL, state TEXT NOT NULL, attempts INTEGER NOT NULL,
    sent INTEGER NOT NULL, error BLOB NOT NULL, updated_at REAL NOT NULL, due REAL NOT NULL,
    PRIMARY KEY (id, seq)
) WITHOUT ROWID;
"""
_COLUMNS = "slot, name, state, fingerprint, owner, lease_until, expires_at, created_at, updated_at"
_RECORD = f"SELECT {_COLUMNS}, payload, replays FROM step_records"
# Columns added to a table after it was first created, each with its DEFAULT: a file an
# older release made gets them at start-up (an older release ignores them).
_ADDED = (("step_records", "replays", "INTEGER NOT NULL DEFAULT 0"),)


def parse_sqlite_url(url: str) -> tuple[str, str]:
    """``sqlite:///abs/path.db`` or ``sqlite://relative.db``, optional ``?synchronous=normal``."""
    rest = url.removeprefix("sqlite://")
    path, _, query = rest.partition("?")
    synchronous = parse_qs(query).get("synchronous", ["full"])[-1].lower()
    if synchronous not in _SYNCHRONOUS:
        raise StoreUnavailable(f"sqlite synchronous must be one of {', '.join(_SYNCHRONOUS)}")
    return path, synchronous


class SQLiteStore:
    """One SQLite connection on one thread, shared-file safe across processes."""

    max_payload_bytes = MAX_PAYLOAD_BYTES

    def __init__(self, url: str, clock: Callable[[], float] = time.time) -> None:
        self.path, self._synchronous = parse_sqlite_url(url)
        self._clock = clock
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="tool-proxy-sqlite")
        self._db: sqlite3.Connection | None = None
        self._queue: SQLiteQueue | None = None

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor, fn, *args)
        except sqlite3.Error as exc:
            if getattr(exc, "sqlite_errorcode", None) in _REFUSALS:
                raise StoreRefused(f"sqlite store {self.path}: {exc}") from exc
            raise StoreUnavailable(f"sqlite store {self.path}: {exc}") from exc
        except OSError as exc:
            raise StoreUnavailable(f"sqlite store {self.path}: {exc.strerror}") from exc

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_SECONDS, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute(f"PRAGMA synchronous={self._synchronous}")
            db.executescript(_SCHEMA)
            _add_columns(db)
            self._db = db
        return self._db

    def _transaction(self, fn: Callable[..., T], *args: Any) -> T:
        db = self._conn()
        db.execute("BEGIN IMMEDIATE")
        try:
            result = fn(db, self._clock(), *args)
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:  # also after a failed COMMIT (disk full, I/O error):
                db.execute("ROLLBACK")  # else every later BEGIN fails and the lock is held
            raise
        return result

    async def open(self) -> None:
        """Create the file and schema now, so a bad path fails at start-up."""
        await self._run(self._conn)

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
        args = (key, fingerprint, owner, lock_ttl, result_ttl, reexecute_lapsed, replay)
        return await self._run(self._claim, *args)

    def _claim(self, *args: Any) -> Claim:
        """The claim's transaction; then, for a replay it served under ``synchronous=full``,
        the count in a transaction of its own that does not wait for the disk (the same
        call, on the same thread: no extra round trip). Counted inline, a replay's commit
        would sync the WAL: 60 µs became 500 here. Its count may be lost with the
        machine's power (a later commit syncs it), never the record."""
        inline = self._synchronous != "full"
        claim, served = self._transaction(_claim, *args, inline)
        if served is not None:
            db = self._conn()
            db.execute("PRAGMA synchronous=normal")
            try:
                self._transaction(_count_replay, served)
            except sqlite3.Error:
                pass  # the count is for operators: a replay is never refused for it
            finally:
                db.execute(f"PRAGMA synchronous={self._synchronous}")
        return claim

    async def renew(self, key: RecordKey, owner: str, lock_ttl: float, result_ttl: float) -> bool:
        return await self._run(self._transaction, _renew, key, owner, lock_ttl, result_ttl)

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
        return await self._run(
            self._transaction,
            _complete,
            key,
            owner,
            fingerprint,
            state,
            payload,
            result_ttl,
            replace_outcome,
            successor or owner,
        )

    async def release(self, key: RecordKey, owner: str) -> bool:
        return await self._run(self._transaction, _release, key, owner)

    async def get(self, key: RecordKey) -> Record | None:
        return await self._run(lambda: _select(self._conn(), self._clock(), key))

    async def records(self, scope: str) -> list[Record]:
        return await self._run(lambda: _records(self._conn(), self._clock(), scope))

    async def scan(self, cursor: str, count: int) -> tuple[str, list[Record]]:
        return await self._run(lambda: _scan(self._conn(), self._clock(), cursor, count))

    async def settle(
        self,
        key: RecordKey,
        state: State | None,
        payload: bytes,
        result_ttl: float,
        *,
        owner: str | None = None,
    ) -> bool:
        args = (key, state, payload, result_ttl, owner)
        return await self._run(self._transaction, _settle, *args)

    async def delete(self, key: RecordKey) -> bool:
        return await self._run(self._transaction, _delete, key)

    async def put_value(self, key: str, value: bytes, ttl: float) -> None:
        await self._run(self._transaction, _put_value, key, value, ttl)

    async def get_value(self, key: str) -> bytes | None:
        return await self._run(lambda: _get_value(self._conn(), self._clock(), key))

    async def acquire(self, key: str, owner: str, ttl: float) -> bool:
        return await self._run(self._transaction, _acquire, f"lock|{key}", owner.encode(), ttl)

    async def unlock(self, key: str, owner: str) -> None:
        await self._run(self._transaction, _unlock, f"lock|{key}", owner.encode())

    async def sweep(self) -> int:
        """Delete expired records, slot pointers, values and jobs (with their events), and
        the rate buckets at rest, lapsed slot leases, ended pauses and lapsed resource
        locks (not their fencing counters); return how many records."""
        return await self._run(self._transaction, _sweep)

    async def ping(self) -> None:
        await self._run(lambda: self._conn().execute("SELECT 1").fetchone())

    def buckets(self) -> SQLiteBuckets:
        """The rate buckets in the same database, on the same thread and clock."""
        return SQLiteBuckets(self)

    def locks(self) -> SQLiteLocks:
        """The resource locks and versions in the same database, thread and clock."""
        return SQLiteLocks(self)

    def queue(self) -> SQLiteQueue:
        """The job queue in the same database, thread and clock (one per store)."""
        if self._queue is None:
            self._queue = SQLiteQueue(self)
        return self._queue

    async def close(self) -> None:
        def _close() -> None:
            if self._db is not None:
                self._db.close()
                self._db = None

        await self._run(_close)
        self._executor.shutdown(wait=True)


def _add_columns(db: sqlite3.Connection) -> None:
    """Add the columns of ``_ADDED`` that the file's tables lack (another process may add
    one at the same moment: its "duplicate column" is as good as ours)."""
    for table, column, kind in _ADDED:
        present = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
        if column in present:
            continue
        try:
            db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
        except sqlite3.OperationalError as exc:
            if "duplicate column" not in str(exc):
                raise


def _row(row: tuple[Any, ...], now: float) -> Record:
    slot, name, state, fp, owner, lease_until, expires_at, created, updated, payload, n = row
    status = State(state)
    left = (lease_until if status is State.IN_PROGRESS else expires_at) - now
    key = RecordKey(slot, name)
    return Record(status, fp, owner, max(left, 0.0), bytes(payload), key, created, updated, n)


def _select(db: sqlite3.Connection, now: float, key: RecordKey) -> Record | None:
    row = db.execute(
        f"{_RECORD} WHERE slot = ? AND name = ? AND expires_at > ?", (key.slot, key.name, now)
    ).fetchone()
    return None if row is None else _row(row, now)


def _lapsed(db: sqlite3.Connection, now: float, key: RecordKey) -> bool:
    row = db.execute(
        "SELECT 1 FROM step_records WHERE slot = ? AND name = ? AND state = 'in_progress'"
        " AND lease_until <= ? AND expires_at > ?",
        (key.slot, key.name, now, now),
    ).fetchone()
    return row is not None


def _claim(
    db: sqlite3.Connection,
    now: float,
    key: RecordKey,
    fingerprint: str,
    owner: str,
    lock_ttl: float,
    result_ttl: float,
    reexecute_lapsed: bool,
    replay: bool = True,
    inline: bool = True,
) -> tuple[Claim, Record | None]:
    """The claim, and the record whose replay it served if that is still to count
    (``inline`` False: ``SQLiteStore._claim`` counts it after the commit)."""
    existing = _select(db, now, key)
    if existing is not None and existing.state is not State.IN_PROGRESS:
        if not (replay and existing.fingerprint == fingerprint):
            return Claim(existing), None  # an outcome: never claimed over
        if inline:  # a replay served: counted
            _count_replay(db, now, existing)
        return Claim(existing._replace(replays=existing.replays + 1)), (
            None if inline else existing
        )
    if existing is not None and existing.owner != owner:
        if not _lapsed(db, now, key):
            return Claim(existing), None
        if not reexecute_lapsed:  # a write already: counted inline
            served = int(replay and existing.fingerprint == fingerprint)
            db.execute(
                "UPDATE step_records SET state = 'failed', updated_at = ?,"
                " replays = replays + ? WHERE slot = ? AND name = ?",
                (now, served, key.slot, key.name),
            )
            return Claim(_select(db, now, key)), None
    db.execute(
        f"INSERT OR REPLACE INTO step_records ({_COLUMNS}, scope)"
        " VALUES (?, ?, 'in_progress', ?, ?, ?, ?, ?, ?, ?)",
        (
            key.slot,
            key.name,
            fingerprint,
            owner,
            now + lock_ttl,
            now + result_ttl,
            now,
            now,
            key.scope,
        ),
    )
    last = db.execute(
        "SELECT name FROM slots WHERE slot = ? AND expires_at > ?", (key.slot, now)
    ).fetchone()
    db.execute(
        "INSERT OR REPLACE INTO slots (slot, name, expires_at) VALUES (?, ?, ?)",
        (key.slot, key.name, now + result_ttl),
    )
    previous = last[0] if last is not None and last[0] != key.name else None
    return Claim(None, previous), None


def _count_replay(db: sqlite3.Connection, now: float, record: Record) -> None:
    """One more replay served by ``record``, if it is still that outcome."""
    assert record.key is not None
    db.execute(
        "UPDATE step_records SET replays = replays + 1 WHERE slot = ? AND name = ?"
        " AND created_at = ? AND state != 'in_progress' AND fingerprint = ?",
        (record.key.slot, record.key.name, record.created_at, record.fingerprint),
    )


def _renew(
    db: sqlite3.Connection,
    now: float,
    key: RecordKey,
    owner: str,
    lock_ttl: float,
    result_ttl: float,
) -> bool:
    cursor = db.execute(
        "UPDATE step_records SET lease_until = ?, updated_at = ?,"
        " expires_at = max(expires_at, ?) WHERE slot = ? AND name = ? AND owner = ?"
        " AND state = 'in_progress' AND expires_at > ?",
        (now + lock_ttl, now, now + result_ttl, key.slot, key.name, owner, now),
    )
    return cursor.rowcount == 1


def _release(db: sqlite3.Connection, now: float, key: RecordKey, owner: str) -> bool:
    cursor = db.execute(
        "DELETE FROM step_records WHERE slot = ? AND name = ? AND owner = ? AND expires_at > ?"
        " AND (state = 'in_progress' OR (state = 'failed' AND length(payload) = 0))",
        (key.slot, key.name, owner, now),
    )
    return cursor.rowcount == 1


def _complete(
    db: sqlite3.Connection,
    now: float,
    key: RecordKey,
    owner: str,
    fingerprint: str,
    state: State,
    payload: bytes,
    result_ttl: float,
    replace_outcome: bool = True,
    successor: str = "",
) -> bool:
    existing = _select(db, now, key)
    if existing is not None and existing.owner != owner:
        return False
    if not replace_outcome and existing is not None and _has_outcome(existing):
        return False
    created = existing.created_at if existing is not None else now
    db.execute(
        f"INSERT OR REPLACE INTO step_records ({_COLUMNS}, scope, payload, replays)"
        " VALUES (?, ?, ?, ?, ?, 0, ?, ?, ?, ?, ?, ?)",
        [
            key.slot,
            key.name,
            state.value,
            fingerprint,
            successor or owner,
            now + result_ttl,
            created,
            now,
            key.scope,
            payload,
            existing.replays if existing is not None else 0,
        ],
    )
    return True


def _has_outcome(record: Record) -> bool:
    """COMPLETED, or FAILED with its reason (not a lapsed lease): an attempt's outcome."""
    return record.state is not State.IN_PROGRESS and not record.lapsed


def _records(db: sqlite3.Connection, now: float, scope: str) -> list[Record]:
    rows = db.execute(
        f"{_RECORD} WHERE scope = ? AND expires_at > ? ORDER BY created_at, slot, name",
        (scope, now),
    ).fetchall()
    return [_row(row, now) for row in rows]


def _scan(db: sqlite3.Connection, now: float, cursor: str, count: int) -> tuple[str, list[Record]]:
    slot, _, name = cursor.partition("\x00")
    rows = db.execute(
        f"{_RECORD} WHERE (slot, name) > (?, ?) ORDER BY slot, name LIMIT ?",
        (slot, name, max(count, 1)),
    ).fetchall()
    found = [_row(row, now) for row in rows if row[6] > now]
    more = len(rows) == max(count, 1)
    return (f"{rows[-1][0]}\x00{rows[-1][1]}" if more else ""), found


def _settle(
    db: sqlite3.Connection,
    now: float,
    key: RecordKey,
    state: State | None,
    payload: bytes,
    result_ttl: float,
    owner: str | None,
) -> bool:
    where = "WHERE slot = ? AND name = ? AND state = 'failed' AND expires_at > ?"
    fence: tuple[Any, ...] = (key.slot, key.name, now)
    if owner is not None:
        where += " AND owner = ?"
        fence += (owner,)
    if state is None:
        cursor = db.execute(f"DELETE FROM step_records {where}", fence)
    else:
        cursor = db.execute(
            f"UPDATE step_records SET state = ?, payload = ?, expires_at = ?, updated_at = ?"
            f" {where}",
            (state.value, payload, now + result_ttl, now, *fence),
        )
    return cursor.rowcount == 1


def _delete(db: sqlite3.Connection, now: float, key: RecordKey) -> bool:
    cursor = db.execute(
        "DELETE FROM step_records WHERE slot = ? AND name = ? AND expires_at > ?",
        (key.slot, key.name, now),
    )
    return cursor.rowcount == 1


# Rows of the rate buckets and resource locks whose time has passed (as good as absent),
# by table and column; the tables exist once their part was first used.
_LAPSED = {
    "limit_rates": "tat",
    "limit_slots": "until",
    "limit_pauses": "until",
    "resource_locks": "until",
    "resource_versions": "until",
}


def _sweep(db: sqlite3.Connection, now: float) -> int:
    count = db.execute("DELETE FROM step_records WHERE expires_at <= ?", (now,)).rowcount
    db.execute("DELETE FROM slots WHERE expires_at <= ?", (now,))
    db.execute("DELETE FROM kv WHERE expires_at <= ?", (now,))
    db.execute(
        "DELETE FROM job_events WHERE id IN (SELECT id FROM jobs WHERE expires_at <= ?)", (now,)
    )
    db.execute("DELETE FROM jobs WHERE expires_at <= ?", (now,))
    for (table,) in db.execute(
        f"SELECT name FROM sqlite_master WHERE type = 'table' AND name IN"
        f" ({', '.join('?' * len(_LAPSED))})",
        tuple(_LAPSED),
    ).fetchall():
        db.execute(f"DELETE FROM {table} WHERE {_LAPSED[table]} <= ?", (now,))
    return count


def _put_value(db: sqlite3.Connection, now: float, key: str, value: bytes, ttl: float) -> None:
    db.execute(
        "INSERT OR REPLACE INTO kv (key, value, expires_at) VALUES (?, ?, ?)",
        (key, value, now + ttl),
    )


def _get_value(db: sqlite3.Connection, now: float, key: str) -> bytes | None:
    row = db.execute("SELECT value FROM kv WHERE key = ? AND expires_at > ?", (key, now)).fetchone()
    return None if row is None else bytes(row[0])


def _acquire(db: sqlite3.Connection, now: float, key: str, owner: bytes, ttl: float) -> bool:
    held = _get_value(db, now, key)
    if held is not None and held != owner:
        return False
    _put_value(db, now, key, owner, ttl)
    return True


def _unlock(db: sqlite3.Connection, now: float, key: str, owner: bytes) -> None:
    db.execute("DELETE FROM kv WHERE key = ? AND value = ?", (key, owner))


_BUCKETS_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS limit_rates (grp TEXT NOT NULL, key TEXT NOT NULL,"
    " tat REAL NOT NULL, PRIMARY KEY (grp, key)) WITHOUT ROWID",
    "CREATE TABLE IF NOT EXISTS limit_slots (grp TEXT NOT NULL, key TEXT NOT NULL,"
    " owner TEXT NOT NULL, until REAL NOT NULL, PRIMARY KEY (grp, key, owner)) WITHOUT ROWID",
    "CREATE TABLE IF NOT EXISTS limit_pauses (grp TEXT PRIMARY KEY, until REAL NOT NULL)"
    " WITHOUT ROWID",
)


class SQLiteBuckets:
    """``Buckets`` in the store's database: each call one ``BEGIN IMMEDIATE`` transaction
    (so the processes of one host share them), on the store's thread and clock."""

    def __init__(self, store: SQLiteStore) -> None:
        self._store = store
        self._ready = False

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        if not self._ready:
            await self._store._run(self._store._transaction, _create_buckets)
            self._ready = True
        return await self._store._run(self._store._transaction, fn, *args)

    async def take(
        self,
        group: str,
        rates: Sequence[Rate],
        slots: Sequence[Slots],
        owner: str,
        slot_ttl: float,
        scope: str = "",
    ) -> Admission:
        return await self._call(_take, group, rates, slots, owner, slot_ttl, _paused(group, scope))

    async def finish(
        self, group: str, changes: Sequence[tuple[Rate, float]], slots: Sequence[str], owner: str
    ) -> None:
        await self._call(_finish, group, changes, slots, owner)

    async def renew(self, group: str, slots: Sequence[str], owner: str, ttl: float) -> bool:
        return await self._call(_renew_slots, group, slots, owner, ttl)

    async def pause(self, group: str, seconds: float, scope: str = "") -> None:
        await self._call(_pause, _paused(group, scope), seconds)

    async def state(self, group: str, limit: int) -> GroupState:
        if not self._ready:  # the tables, on a database that never took a unit
            await self._call(_nothing)
        return await _read(self._store, _group_state, group, limit)


def _nothing(db: sqlite3.Connection, now: float) -> None:
    """A transaction that changes nothing (``_call`` creates the tables first)."""


def _read(store: SQLiteStore, fn: Callable[..., T], *args: Any) -> Awaitable[T]:
    """``fn(db, now, *args)`` outside a write transaction: a read takes no write lock."""
    return store._run(lambda: fn(store._conn(), store._clock(), *args))


def _group_state(db: sqlite3.Connection, now: float, group: str, limit: int) -> GroupState:
    more = limit + 1  # one more than asked: whether some were left out
    rates = db.execute(
        "SELECT key, tat - ? FROM limit_rates WHERE grp = ? AND tat > ? ORDER BY tat DESC LIMIT ?",
        (now, group, now, more),
    )
    slots = db.execute(
        "SELECT key, max(until) - ?, count(*) FROM limit_slots WHERE grp = ? AND until > ?"
        " GROUP BY key ORDER BY count(*) DESC, max(until) DESC LIMIT ?",
        (now, group, now, more),
    )
    prefix = _paused(group, "x")[:-1]
    pauses = db.execute(
        "SELECT substr(grp, ?), until - ? FROM limit_pauses"
        " WHERE (grp = ? OR substr(grp, 1, ?) = ?) AND until > ? ORDER BY until DESC LIMIT ?",
        (len(prefix) + 1, now, group, len(prefix), prefix, now, more),
    )
    return group_state(
        [Entry(k, t) for k, t in rates],
        [Entry(k, t, n) for k, t, n in slots],
        [Entry(k, t) for k, t in pauses],
        limit,
        seen=True,
    )


def _paused(group: str, scope: str) -> str:
    """The ``limit_pauses`` row of a group's pause of ``scope`` (the group's own name for
    the whole group, as before scopes)."""
    return f"{group}\x1f{scope}" if scope else group


def _create_buckets(db: sqlite3.Connection, now: float) -> None:
    for statement in _BUCKETS_SCHEMA:
        db.execute(statement)


def _tat(db: sqlite3.Connection, group: str, key: str, now: float) -> float:
    row = db.execute("SELECT tat FROM limit_rates WHERE grp = ? AND key = ?", (group, key))
    found = row.fetchone()
    return now if found is None else float(found[0])


def _take(
    db: sqlite3.Connection,
    now: float,
    group: str,
    rates: Sequence[Rate],
    slots: Sequence[Slots],
    owner: str,
    slot_ttl: float,
    paused: str,
) -> Admission:
    row = db.execute("SELECT until FROM limit_pauses WHERE grp = ?", (paused,)).fetchone()
    if row is not None and row[0] > now:
        return Admission(False, row[0] - now, 0.0)
    wait = 0.0
    states, tats = [], []
    for rate in rates:
        tat, over, state = gcra(_tat(db, group, rate.key, now), now, rate)
        wait = max(wait, over)
        tats.append(tat)
        states.append(state)
    free, full = [], False
    for slot in slots:
        db.execute(
            "DELETE FROM limit_slots WHERE grp = ? AND key = ? AND until <= ?",
            (group, slot.key, now),
        )
        held = {
            r[0]
            for r in db.execute(
                "SELECT owner FROM limit_slots WHERE grp = ? AND key = ?", (group, slot.key)
            )
        }
        left = slot.capacity - len(held) - (owner not in held)
        full = full or left < 0
        free.append(left)
    if wait > 0 or full:
        return Admission(False, 0.0, wait, tuple(states), tuple(free))
    db.executemany(
        "INSERT OR REPLACE INTO limit_rates (grp, key, tat) VALUES (?, ?, ?)",
        [(group, rate.key, tat) for rate, tat in zip(rates, tats, strict=True)],
    )
    db.executemany(
        "INSERT OR REPLACE INTO limit_slots (grp, key, owner, until) VALUES (?, ?, ?, ?)",
        [(group, slot.key, owner, now + slot_ttl) for slot in slots],
    )
    return Admission(True, 0.0, 0.0, tuple(states), tuple(free))


def _finish(
    db: sqlite3.Connection,
    now: float,
    group: str,
    changes: Sequence[tuple[Rate, float]],
    slots: Sequence[str],
    owner: str,
) -> None:
    for rate, units in changes:
        tat = adjusted(_tat(db, group, rate.key, now), now, rate, units)
        db.execute(
            "INSERT OR REPLACE INTO limit_rates (grp, key, tat) VALUES (?, ?, ?)",
            (group, rate.key, tat),
        )
    db.executemany(
        "DELETE FROM limit_slots WHERE grp = ? AND key = ? AND owner = ?",
        [(group, key, owner) for key in slots],
    )


def _renew_slots(
    db: sqlite3.Connection, now: float, group: str, slots: Sequence[str], owner: str, ttl: float
) -> bool:
    kept = True
    for key in slots:
        cursor = db.execute(
            "UPDATE limit_slots SET until = ? WHERE grp = ? AND key = ? AND owner = ?"
            " AND until > ?",
            (now + ttl, group, key, owner, now),
        )
        kept = kept and cursor.rowcount == 1
    return kept


def _pause(db: sqlite3.Connection, now: float, paused: str, seconds: float) -> None:
    db.execute("DELETE FROM limit_pauses WHERE until <= ?", (now,))  # lapsed: not kept
    db.execute(
        "INSERT INTO limit_pauses (grp, until) VALUES (?, ?)"
        " ON CONFLICT (grp) DO UPDATE SET until = max(until, excluded.until)",
        (paused, now + seconds),
    )


_LOCKS_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS resource_locks (key TEXT PRIMARY KEY, owner TEXT NOT NULL,"
    " until REAL NOT NULL, token INTEGER NOT NULL DEFAULT 0) WITHOUT ROWID",
    "CREATE TABLE IF NOT EXISTS resource_counters (kind TEXT NOT NULL, key TEXT NOT NULL,"
    " n INTEGER NOT NULL, PRIMARY KEY (kind, key)) WITHOUT ROWID",
    "CREATE TABLE IF NOT EXISTS resource_versions (key TEXT PRIMARY KEY, n INTEGER NOT NULL,"
    " written INTEGER NOT NULL, pending TEXT NOT NULL, until REAL NOT NULL) WITHOUT ROWID",
    "CREATE INDEX IF NOT EXISTS resource_versions_until ON resource_versions (until)",
    # counters per resource, from before they were drawn per scope: unbounded, unused
    "DELETE FROM resource_counters WHERE kind IN ('fence', 'version')",
)
# How many lapsed versions one change of a version deletes at most.
SWEEP_EACH = 16


class SQLiteLocks:
    """``Locks`` in the store's database: each call one ``BEGIN IMMEDIATE`` transaction
    (so the processes of one host share them), on the store's thread and clock. A scope's
    counter is a row of ``resource_counters`` (kind 'scope') that is never deleted; lapsed
    versions are deleted, a few with each change of one."""

    def __init__(self, store: SQLiteStore) -> None:
        self._store = store
        self._ready = False

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        if not self._ready:
            await self._store._run(self._store._transaction, _create_locks)
            self._ready = True
        return await self._store._run(self._store._transaction, fn, *args)

    async def acquire(self, scope: str, key: str, owner: str, ttl: float) -> Grant:
        return await self._call(_acquire_lock, scope, key, owner, ttl)

    async def renew(self, scope: str, key: str, owner: str, ttl: float) -> bool:
        return await self._call(_renew_lock, _scoped(scope, key), owner, ttl)

    async def release(self, scope: str, key: str, owner: str) -> bool:
        return await self._call(_release_lock, _scoped(scope, key), owner)

    async def version(self, scope: str, key: str, ttl: float) -> Version:
        return await self._call(_read_version, scope, key, ttl)

    async def begin(self, scope: str, key: str, owner: str, ttl: float) -> Version:
        return await self._call(_begin_write, scope, key, owner, ttl)

    async def settle(self, scope: str, key: str, owner: str, wrote: bool, ttl: float) -> int | None:
        return await self._call(_settle_write, scope, key, owner, wrote, ttl)

    async def held(self, scope: str, limit: int) -> LocksHeld:
        if not self._ready:  # the tables, on a database that never locked
            await self._call(_nothing)
        return await _read(self._store, _held_locks, scope, limit)


def _held_locks(db: sqlite3.Connection, now: float, scope: str, limit: int) -> LocksHeld:
    prefix = _scoped(scope, "")
    rows = db.execute(
        "SELECT substr(key, ?), token, until - ? FROM resource_locks"
        " WHERE substr(key, 1, ?) = ? AND until > ? ORDER BY token DESC LIMIT ?",
        (len(prefix) + 1, now, len(prefix), prefix, now, limit + 1),
    )
    return locks_held([HeldLock(k, int(t), left) for k, t, left in rows], limit, seen=True)


def _scoped(scope: str, key: str) -> str:
    return f"{scope}\n{key}"


def _create_locks(db: sqlite3.Connection, now: float) -> None:
    columns = {row[1] for row in db.execute("PRAGMA table_info(resource_locks)")}
    if columns and "token" not in columns:  # a table from before tokens were kept with locks
        db.execute("ALTER TABLE resource_locks ADD COLUMN token INTEGER NOT NULL DEFAULT 0")
    for statement in _LOCKS_SCHEMA:
        db.execute(statement)


def _draw(db: sqlite3.Connection, scope: str) -> int:
    """The next value of ``scope``'s counter, started at the clock (``counter_start``)."""
    row = db.execute(
        "INSERT INTO resource_counters (kind, key, n) VALUES ('scope', ?, ?)"
        " ON CONFLICT (kind, key) DO UPDATE SET n = n + 1 RETURNING n",
        (scope, counter_start() + 1),
    ).fetchone()
    return int(row[0])


def _acquire_lock(
    db: sqlite3.Connection, now: float, scope: str, key: str, owner: str, ttl: float
) -> Grant:
    name = _scoped(scope, key)
    row = db.execute(
        "SELECT owner, until, token FROM resource_locks WHERE key = ?", (name,)
    ).fetchone()
    held = row is not None and row[1] > now
    if held and row[0] != owner:
        return Grant(None, row[1] - now)
    token = int(row[2]) if held else _draw(db, scope)
    db.execute(
        "INSERT OR REPLACE INTO resource_locks (key, owner, until, token) VALUES (?, ?, ?, ?)",
        (name, owner, now + ttl, token),
    )
    return Grant(token)


def _renew_lock(db: sqlite3.Connection, now: float, key: str, owner: str, ttl: float) -> bool:
    cursor = db.execute(
        "UPDATE resource_locks SET until = ? WHERE key = ? AND owner = ? AND until > ?",
        (now + ttl, key, owner, now),
    )
    return cursor.rowcount == 1


def _release_lock(db: sqlite3.Connection, now: float, key: str, owner: str) -> bool:
    cursor = db.execute(
        "DELETE FROM resource_locks WHERE key = ? AND owner = ? AND until > ?", (key, owner, now)
    )
    return cursor.rowcount == 1


def _live_version(db: sqlite3.Connection, now: float, name: str) -> tuple[int, bool, str] | None:
    row = db.execute(
        "SELECT n, written, pending FROM resource_versions WHERE key = ? AND until > ?",
        (name, now),
    ).fetchone()
    return None if row is None else (int(row[0]), bool(row[1]), str(row[2]))


def _keep_version(
    db: sqlite3.Connection, now: float, name: str, entry: tuple[int, bool, str], ttl: float
) -> Version:
    db.execute(
        "INSERT OR REPLACE INTO resource_versions (key, n, written, pending, until)"
        " VALUES (?, ?, ?, ?, ?)",
        (name, entry[0], int(entry[1]), entry[2], now + ttl),
    )
    db.execute(
        "DELETE FROM resource_versions WHERE key IN"
        " (SELECT key FROM resource_versions WHERE until <= ? LIMIT ?)",
        (now, SWEEP_EACH),
    )
    return Version(entry[0], entry[1], entry[2] != "")


def _read_version(db: sqlite3.Connection, now: float, scope: str, key: str, ttl: float) -> Version:
    name = _scoped(scope, key)
    entry = _live_version(db, now, name) or (_draw(db, scope), False, "")
    return _keep_version(db, now, name, entry, ttl)


def _begin_write(
    db: sqlite3.Connection, now: float, scope: str, key: str, owner: str, ttl: float
) -> Version:
    name = _scoped(scope, key)
    number, written, pending = _live_version(db, now, name) or (_draw(db, scope), False, "")
    if pending not in ("", owner):  # a write that never settled may have happened
        number, written = _draw(db, scope), True
    return _keep_version(db, now, name, (number, written, owner), ttl)


def _settle_write(
    db: sqlite3.Connection, now: float, scope: str, key: str, owner: str, wrote: bool, ttl: float
) -> int | None:
    name = _scoped(scope, key)
    entry = _live_version(db, now, name)
    if entry is None or entry[2] != owner:
        return None
    number, written = (_draw(db, scope), True) if wrote else entry[:2]
    return _keep_version(db, now, name, (number, written, ""), ttl).number


# A job's columns in ``Job``'s order (``request`` is read as x'' where it is not shown).
_JOB = (
    "id, route, principal, slot, name, label, {request}, keep, state, attempts, sent, error,"
    " created_at, updated_at, due, seq"
)
_JOB_COLUMNS = _JOB.format(request="request")
_JOB_SHOWN = _JOB.format(request="x''")
_ACTIVE = "state IN ('queued', 'running')"


class SQLiteQueue:
    """``Queue`` in the store's database (tables ``jobs`` and ``job_events``), on the
    store's thread and clock: every write one ``BEGIN IMMEDIATE`` transaction whose
    compare-and-set is one ``UPDATE ... WHERE ... RETURNING`` (SQLite 3.35 or later), so
    the processes of one host share the queue. Expired jobs are invisible at once and
    deleted, with their events, by the store's ``sweep``.

    ``changes`` tells only of this process's own submits and moves (one ``asyncio.Queue``
    per subscriber); what other processes change, the caller sees by polling.
    """

    def __init__(self, store: SQLiteStore) -> None:
        self._store = store
        self._subscribers: set[asyncio.Queue[str]] = set()

    async def _write(self, fn: Callable[..., T], *args: Any) -> T:
        return await self._store._run(self._store._transaction, fn, *args)

    async def _read(self, fn: Callable[..., T], *args: Any) -> T:
        return await self._store._run(lambda: fn(self._store._conn(), self._store._clock(), *args))

    def _tell(self, job: Job | None) -> Job | None:
        """Tell this process's subscribers that ``job`` changed."""
        if job is not None:
            for subscriber in self._subscribers:
                subscriber.put_nowait(job.id)
        return job

    async def submit(self, job: Job) -> Job:
        submitted = await self._write(_submit_job, job)
        self._tell(submitted)
        return submitted

    async def get(self, id: str) -> Job | None:
        return await self._read(_get_job, id)

    async def events(self, id: str, after: int) -> list[Job] | None:
        return await self._read(_job_events, id, after)

    async def take(self, route: str, worker: str, visibility: float) -> Job | None:
        return await self._write(_take_job, route, worker, visibility)

    async def hold(self, id: str, worker: str, visibility: float) -> bool:
        return await self._write(_hold_job, id, worker, visibility)

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
        args = (id, expect, state, worker, attempts, sent, error, due)
        return self._tell(await self._write(_move_job, *args))

    async def list(self, state: JobState | None, cursor: str, count: int) -> tuple[str, list[Job]]:
        return await self._read(_list_jobs, state, cursor, count)

    async def changes(self) -> AsyncIterator[str]:
        subscriber: asyncio.Queue[str] = asyncio.Queue()
        self._subscribers.add(subscriber)
        try:
            while True:
                yield await subscriber.get()
        finally:
            self._subscribers.discard(subscriber)


def _job(row: tuple[Any, ...]) -> Job:
    """A job from its columns (``_JOB``'s order); BLOBs come as bytes."""
    job = Job(*row)
    return replace(job, state=JobState(job.state), sent=bool(job.sent))


def _event(db: sqlite3.Connection, job: Job) -> Job:
    """Keep ``job``'s snapshot as its event ``seq``."""
    db.execute(
        "INSERT OR REPLACE INTO job_events"
        " (id, seq, state, attempts, sent, error, updated_at, due) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        (
            job.id,
            job.seq,
            job.state.value,
            job.attempts,
            job.sent,
            job.error,
            job.updated_at,
            job.due,
        ),
    )
    return job


def _submit_job(db: sqlite3.Connection, now: float, job: Job) -> Job:
    if _get_job(db, now, job.id) is not None:
        raise ValueError(f"job {job.id} exists")
    db.execute("DELETE FROM jobs WHERE id = ?", (job.id,))  # expired, not yet swept
    db.execute("DELETE FROM job_events WHERE id = ?", (job.id,))
    row = db.execute(
        f"INSERT INTO jobs ({_JOB_COLUMNS}, expires_at)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, 'queued', 0, 0, x'', ?, ?, ?, 1, ?)"
        f" RETURNING {_JOB_COLUMNS}",
        (
            job.id,
            job.route,
            job.principal,
            job.slot,
            job.name,
            job.label,
            job.request,
            job.keep,
            now,
            now,
            now,
            now + job.keep,
        ),
    ).fetchone()
    return _event(db, _job(row))


def _get_job(db: sqlite3.Connection, now: float, id: str) -> Job | None:
    row = db.execute(
        f"SELECT {_JOB_COLUMNS} FROM jobs WHERE id = ? AND expires_at > ?", (id, now)
    ).fetchone()
    return None if row is None else _job(row)


def _job_events(db: sqlite3.Connection, now: float, id: str, after: int) -> list[Job] | None:
    job = _get_job(db, now, id)
    if job is None:
        return None
    rows = db.execute(
        "SELECT seq, state, attempts, sent, error, updated_at, due FROM job_events"
        " WHERE id = ? AND seq > ? ORDER BY seq",
        (id, after),
    ).fetchall()
    return [
        replace(
            job,
            request=b"",
            state=JobState(state),
            attempts=attempts,
            sent=bool(sent),
            error=error,
            updated_at=updated_at,
            due=due,
            seq=seq,
        )
        for seq, state, attempts, sent, error, updated_at, due in rows
    ]


def _take_job(
    db: sqlite3.Connection, now: float, route: str, worker: str, visibility: float
) -> Job | None:
    """The oldest due QUEUED job held by nobody, else one whose hold lapsed (one
    statement: the pick and the hold are atomic)."""
    pick = f"SELECT id FROM jobs WHERE route = ? AND {_ACTIVE} AND expires_at > ? AND holder"
    row = db.execute(
        f"UPDATE jobs SET holder = ?, held_until = ? WHERE id = coalesce("
        f" ({pick} = '' AND state = 'queued' AND due <= ? ORDER BY due, id LIMIT 1),"
        f" ({pick} > '' AND held_until <= ? ORDER BY held_until LIMIT 1)"
        f") RETURNING {_JOB_COLUMNS}",
        (worker, now + visibility, route, now, now, route, now, now),
    ).fetchone()
    return None if row is None else _job(row)


def _hold_job(db: sqlite3.Connection, now: float, id: str, worker: str, visibility: float) -> bool:
    cursor = db.execute(
        f"UPDATE jobs SET held_until = ? WHERE id = ? AND holder = ? AND held_until > ?"
        f" AND {_ACTIVE} AND expires_at > ?",
        (now + visibility, id, worker, now, now),
    )
    return cursor.rowcount == 1


def _move_job(
    db: sqlite3.Connection,
    now: float,
    id: str,
    expect: frozenset[JobState],
    state: JobState,
    worker: str | None,
    attempts: int | None,
    sent: bool | None,
    error: bytes | None,
    due: float,
) -> Job | None:
    """Compare (state, and the hold given a worker) and set, in one statement."""
    if not expect:
        return None
    where = f"id = ? AND expires_at > ? AND state IN ({', '.join('?' * len(expect))})"
    fence: list[Any] = [id, now, *(s.value for s in expect)]
    if worker is not None:
        where += " AND holder = ? AND held_until > ?"
        fence += [worker, now]
    # held by nobody but while RUNNING; due ``due`` from now when QUEUED again
    held = state is JobState.RUNNING
    row = db.execute(
        "UPDATE jobs SET state = ?, attempts = coalesce(?, attempts), sent = coalesce(?, sent),"
        " error = coalesce(?, error), updated_at = ?, expires_at = ? + keep, seq = seq + 1,"
        " due = coalesce(?, due), holder = CASE WHEN ? THEN holder ELSE '' END,"
        " held_until = CASE WHEN ? THEN held_until ELSE 0 END,"
        " request = CASE WHEN ? THEN x'' ELSE request END"
        f" WHERE {where} RETURNING {_JOB_COLUMNS}",
        (
            state.value,
            attempts,
            sent,
            error,
            now,
            now,
            now + due if state is JobState.QUEUED else None,
            held,
            held,
            state.spent,
            *fence,
        ),
    ).fetchone()
    return None if row is None else _event(db, _job(row))


def _list_jobs(
    db: sqlite3.Connection, now: float, state: JobState | None, cursor: str, count: int
) -> tuple[str, list[Job]]:
    where, args = "id > ? AND expires_at > ?", [cursor, now]
    if state is not None:
        where += " AND state = ?"
        args.append(state.value)
    rows = db.execute(
        f"SELECT {_JOB_SHOWN} FROM jobs WHERE {where} ORDER BY id LIMIT ?",
        (*args, max(count, 1)),
    ).fetchall()
    jobs = [_job(row) for row in rows]
    return (jobs[-1].id if len(jobs) == max(count, 1) else ""), jobs
