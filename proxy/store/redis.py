"""``redis://`` and ``rediss://``: the store shared by replicas.

One round trip per operation: each is a Lua script (EVALSHA), atomic on the server.
Commands that requests issue while a round trip is under way are sent together when it
returns (auto-pipelining, see ``Coalescer``), over one connection, packed by hiredis.
Under concurrency that costs a fraction of the CPU of redis-py's pipelines or of a
command per call, whose per-command pool, timeout and observability work dominate
otherwise (the figures are in docs/benchmarks.md); an idle proxy still sends each
command at once. It changes nothing for Redis: each
script is still one command, applied atomically, and each caller gets its own reply.

The keys of one step share a hash tag, ``tp:{<slot>}:...``, so a Redis Cluster keeps
them in one hash slot and the scripts stay legal there. Expiry is Redis's own.

Keys::

    tp:{<slot>}:r:<name>   hash: st (state), fp (fingerprint), ow (owner), pl (payload)
    tp:{<slot>}:last       string: the last name claimed in the slot (to log replans)
    tp:{<scope>}:steps     sorted set: the scope's records (<step>:<name>), scored by
                           their expiry (ms); a member leaves as its record is released,
                           settled away or found gone, or at the next claim after it expired
    tp:v:{<key>}           string: a shared value (an encrypted downstream token)
    tp:l:{<key>}           string: a short lock (who fetches a shared value)
    tp:{lim:<group>}:r:<key>  string: a GCRA bucket's tat (ms), expiring when it is full
    tp:{lim:<group>}:s:<key>  sorted set: slot owners, scored by their lease's end (ms)
    tp:{lim:<group>}:pause[:<scope>]  string: until when (ms) the group (a route) is
                              paused, for all its callers or for one (expiring then)
    tp:{res:<scope>}:n        string: a scope's (a route's) counter of fencing tokens and
                              versions, never expiring
    tp:{res:<scope>}:l:<key>  hash: a resource lock's owner and token, for its lease
    tp:{res:<scope>}:v:<key>  hash: a resource's version, its write mark, for versioning.ttl
    tp:{ops}:...              the job queue (``RedisQueue``: its keys are listed there)
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
from collections.abc import AsyncIterator, Sequence
from typing import Any

import hiredis
from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.connection import AbstractConnection
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, OutOfMemoryError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from proxy.errors import StoreError, StoreRefused, StoreUnavailable
from proxy.store.base import Claim, Record, RecordKey, State
from proxy.store.buckets import Admission, Rate, RateState, Slots
from proxy.store.locks import Grant, Version, counter_start
from proxy.store.queue import Job, JobState

KEY_PREFIX = "tp:"
# Connection defaults; query parameters of the URL (e.g. ?socket_timeout=5) win.
SOCKET_CONNECT_TIMEOUT = 1.0
SOCKET_TIMEOUT = 2.0
# Connections per process beside the coalescer's own (readiness pings).
MAX_CONNECTIONS = 16
# Retries of a round trip on a connection error, with what is safe to send again
# (``Coalescer``, ``RESENDABLE``).
RETRIES = 2

Command = tuple[Any, ...]
# The largest payload kept inline: a round trip carries it whole, over the one connection
# every request shares (Redis itself would take up to proto-max-bulk-len, 512 MiB). Larger
# answers go to object storage (offload) or are recorded as not kept (410).
MAX_PAYLOAD_BYTES = 64 * 1024 * 1024
# A round trip's deadline grows with what it sends, at this many bytes a second (a slow
# link must not time out, and resend, a large outcome for ever).
BYTES_PER_SECOND = 8 * 1024 * 1024
# Members of a scope's index read per call when it is listed (a ZSCAN COUNT hint: an
# index of up to 128 members, kept compact by Redis, comes in one).
LIST_PAGE = 100
# Error replies that no retry will turn into success: the write is refused (``StoreRefused``),
# not the store out of reach. READONLY (a failover under way) is not among them.
REFUSALS = ("OOM", "NOREPLICAS", "MISCONF", "ERR string exceeds maximum allowed size")

# Every script that writes a record starts with ``redis.replicate_commands()`` (a no-op on
# Redis 7, required on 5 and 6 before writing after ``TIME``). Times are milliseconds.
_NOW = """
redis.replicate_commands()
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
"""

# KEYS: record, slot pointer, scope index. ARGV: name, fingerprint, owner, lock_ms,
# result_ms, reexecute_lapsed (0/1), index member. The index drops the members whose
# record expired (their score passed) as a new one comes in; its own life is extended
# twice as far as needed, so most claims skip that write.
_CLAIM = (
    _NOW
    + """
local r = redis.call('HMGET', KEYS[1], 'st', 'fp', 'ow', 'pl', 'lu', 'ct', 'ut')
if r[1] and (r[3] ~= ARGV[3] or r[1] ~= 'in_progress') then
  if r[1] ~= 'in_progress' then
    return {0, r[1], r[2], r[3], r[4] or '', redis.call('PTTL', KEYS[1]), r[6], r[7]}
  end
  local left = tonumber(r[5] or 0) - now
  if left > 0 then return {0, r[1], r[2], r[3], '', left, r[6], r[7]} end
  if ARGV[6] == '0' then
    redis.call('HSET', KEYS[1], 'st', 'failed', 'pl', '', 'ut', now)
    return {0, 'failed', r[2], r[3], '', redis.call('PTTL', KEYS[1]), r[6], now}
  end
end
if r[1] then redis.call('HDEL', KEYS[1], 'pl') end -- a fresh record has none
redis.call('HSET', KEYS[1], 'st', 'in_progress', 'fp', ARGV[2], 'ow', ARGV[3],
  'lu', now + ARGV[4], 'ct', now, 'ut', now)
redis.call('PEXPIRE', KEYS[1], ARGV[5])
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
redis.call('ZADD', KEYS[3], now + ARGV[5], ARGV[7])
if redis.call('PTTL', KEYS[3]) < tonumber(ARGV[5]) then
  redis.call('PEXPIRE', KEYS[3], ARGV[5] * 2)
end
local prev = redis.call('SET', KEYS[2], ARGV[1], 'GET', 'PX', ARGV[5])
return {1, prev or ''}
"""
)

_FIELDS = "'st', 'fp', 'ow', 'pl', 'lu', 'ct', 'ut'"
# A record as {1, state, fingerprint, owner, payload, ms left, created, updated} or {0}.
_READ = f"""
local function read(key, now)
  local r = redis.call('HMGET', key, {_FIELDS})
  if not r[1] then return {{0}} end
  local left = redis.call('PTTL', key)
  if r[1] == 'in_progress' then left = tonumber(r[5] or 0) - now end
  return {{1, r[1], r[2], r[3], r[4] or '', left, r[6], r[7]}}
end
"""

_GET = (
    _NOW
    + _READ
    + """
return read(KEYS[1], now)
"""
)

# One page of a scope's listing. KEYS: the scope index, then the page's records. ARGV:
# 1 to drop from the index the members whose record is gone (0: a legacy set index),
# then the page's members. Returns the records found, each with its member appended.
_RECORDS = (
    _NOW
    + _READ
    + """
local out = {}
for i = 2, #KEYS do
  local found = read(KEYS[i], now)
  if found[1] == 1 then
    table.insert(found, ARGV[i])
    table.insert(out, found)
  elseif ARGV[1] == '1' then
    redis.call('ZREM', KEYS[1], ARGV[i])
  end
end
return out
"""
)

# KEYS: record, scope index. ARGV: owner, lock_ms, result_ms, index member.
_RENEW = (
    _NOW
    + """
local r = redis.call('HMGET', KEYS[1], 'st', 'ow')
if r[1] ~= 'in_progress' or r[2] ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'lu', now + ARGV[2], 'ut', now)
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[3]) then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  redis.call('ZADD', KEYS[2], 'GT', now + ARGV[3], ARGV[4])
  if redis.call('PTTL', KEYS[2]) < tonumber(ARGV[3]) then
    redis.call('PEXPIRE', KEYS[2], ARGV[3])
  end
end
return 1
"""
)

# KEYS: record, scope index. ARGV: owner, state, payload, result_ms, fingerprint, member,
# replace_outcome (0/1), the owner from now on.
_COMPLETE = (
    _NOW
    + """
local r = redis.call('HMGET', KEYS[1], 'ow', 'ct', 'st')
if r[1] and r[1] ~= ARGV[1] then return 0 end
if ARGV[7] == '0' and r[3] and r[3] ~= 'in_progress' and
  (r[3] ~= 'failed' or redis.call('HSTRLEN', KEYS[1], 'pl') > 0) then return 0 end
redis.call('HSET', KEYS[1], 'st', ARGV[2], 'pl', ARGV[3], 'fp', ARGV[5], 'ow', ARGV[8],
  'ct', r[2] or now, 'ut', now)
redis.call('PEXPIRE', KEYS[1], ARGV[4])
redis.call('ZADD', KEYS[2], now + ARGV[4], ARGV[6])
if redis.call('PTTL', KEYS[2]) < tonumber(ARGV[4]) then redis.call('PEXPIRE', KEYS[2], ARGV[4]) end
return 1
"""
)

# KEYS: record, scope index. ARGV: owner, index member.
_RELEASE = """
local r = redis.call('HMGET', KEYS[1], 'st', 'ow', 'pl')
if r[2] ~= ARGV[1] then return 0 end
if r[1] == 'in_progress' or (r[1] == 'failed' and r[3] == '') then
  redis.call('ZREM', KEYS[2], ARGV[2])
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# KEYS: record, scope index. ARGV: new state ('' to delete), payload, result_ms, owner
# ('' for any), index member.
_SETTLE = (
    _NOW
    + """
local r = redis.call('HMGET', KEYS[1], 'st', 'ow')
if r[1] ~= 'failed' or (ARGV[4] ~= '' and r[2] ~= ARGV[4]) then return 0 end
if ARGV[1] == '' then
  redis.call('ZREM', KEYS[2], ARGV[5])
  return redis.call('DEL', KEYS[1])
end
redis.call('HSET', KEYS[1], 'st', ARGV[1], 'pl', ARGV[2], 'ut', now)
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('ZADD', KEYS[2], now + ARGV[3], ARGV[5])
if redis.call('PTTL', KEYS[2]) < tonumber(ARGV[3]) then redis.call('PEXPIRE', KEYS[2], ARGV[3]) end
return 1
"""
)

_UNLOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

_SHA = {
    s: hashlib.sha1(s.encode()).hexdigest()
    for s in (_CLAIM, _GET, _RECORDS, _RENEW, _COMPLETE, _RELEASE, _SETTLE, _UNLOCK)
}


def _ms(seconds: float) -> int:
    return max(int(seconds * 1000), 1)


def _member(key: RecordKey) -> str:
    """A record's member in its scope's index (and the tail of its Redis key)."""
    return f"{key.step}:{key.name}"


def record_prefix(scope: str) -> str:
    return f"{KEY_PREFIX}{{{scope}}}:r:"


def record_key(key: RecordKey) -> str:
    """The Redis key of a record."""
    return record_prefix(key.scope) + _member(key)


def slot_key(key: RecordKey) -> str:
    """The Redis key that remembers the last name claimed in the record's slot."""
    return f"{KEY_PREFIX}{{{key.scope}}}:last:{key.step}"


def _names(key: RecordKey) -> tuple[str, str, str, str]:
    """The record, slot pointer and scope index keys of ``key``, and its index member:
    ``record_key``, ``slot_key``, ``index_key`` and ``_member`` at once (the hot path)."""
    scope, sep, step = key.slot.rpartition("|")
    if not sep:
        scope = step = key.slot
    tag = f"{KEY_PREFIX}{{{scope}}}:"
    member = f"{step}:{key.name}"
    return f"{tag}r:{member}", f"{tag}last:{step}", f"{tag}steps", member


def index_key(scope: str) -> str:
    """The Redis key of a scope's index: a sorted set of members, each scored by when its
    record expires (ms)."""
    return f"{KEY_PREFIX}{{{scope}}}:steps"


def legacy_index_key(scope: str) -> str:
    """The set that indexed a scope before ``index_key``: still listed (never written)
    until it expires, ``result_ttl`` after the last claim of a version that wrote it."""
    return f"{KEY_PREFIX}{{{scope}}}:idx"


class Coalescer:
    """One round trip to Redis at a time; commands issued meanwhile ride the next one.

    An idle proxy sends a command at once (no added latency); under load, the commands
    that arrive while a round trip is under way are sent together when it returns
    (auto-pipelining): one write and one read for many requests.

    The round trips go over one connection of the coalescer's own, packed by hiredis
    and bounded by one timer each: redis-py's pipeline costs several times more per
    command (a task per write when socket_timeout is set, a timer per reply, Python
    packing), and this is the hot path of every guarded request.

    A round trip that breaks or times out is tried again on a new connection, but only
    with what is safe to send twice: every command if none had been written yet, else
    only the commands still without a reply that their caller marked ``resend`` (reads,
    and writes that find their own token or owner applied and answer as the first time).
    A command that may have run and is not safe to run again (a rate take, a true-up, a
    compare-and-set whose answer would change) fails with the connection's error.
    """

    def __init__(self, pool: ConnectionPool) -> None:
        kwargs = {**pool.connection_kwargs, "socket_timeout": None}  # one timer per trip
        self._connection: AbstractConnection = pool.connection_class(**kwargs)
        self._timeout = float(pool.connection_kwargs.get("socket_timeout") or SOCKET_TIMEOUT)
        self._busy = False
        self._pending: list[tuple[Command, bool, asyncio.Future[Any]]] = []
        self._flushing: set[asyncio.Task[None]] = set()

    async def call(self, *command: Any, resend: bool = False) -> Any:
        """Send ``command`` (now, or with the next batch) and return its reply;
        ``resend``: safe to send again if its reply is lost (see the class)."""
        if self._busy:
            future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            self._pending.append((command, resend, future))
            return await future
        self._busy = True
        try:
            (reply,) = await self._round_trip([command], [resend])
        finally:
            self._next()
        if isinstance(reply, Exception):
            raise reply
        return reply

    def _next(self) -> None:
        if not self._pending:
            self._busy = False
            return
        batch, self._pending = self._pending, []
        task = asyncio.get_running_loop().create_task(self._flush(batch))
        self._flushing.add(task)
        task.add_done_callback(self._flushing.discard)

    async def _flush(self, batch: list[tuple[Command, bool, asyncio.Future[Any]]]) -> None:
        try:
            replies = await self._round_trip([c for c, _, _ in batch], [r for _, r, _ in batch])
        except (RedisError, OSError) as exc:
            replies = [exc] * len(batch)
        except BaseException:  # cancelled (shutdown): nobody may wait forever
            for _, _, future in batch:
                future.cancel()
            raise
        finally:
            self._next()
        for (_, _, future), reply in zip(batch, replies, strict=True):
            if future.done():
                continue
            if isinstance(reply, Exception):
                future.set_exception(reply)
            else:
                future.set_result(reply)

    async def _round_trip(self, commands: list[Command], resend: list[bool]) -> list[Any]:
        """Send ``commands`` and read their replies. An error reply, or the error that
        kept a command from its reply, is returned in its place, not raised.

        A broken or timed-out connection is dropped and what is safe to send again (see
        the class) sent once more on a new one, up to ``RETRIES`` times.
        """
        packed = [hiredis.pack_command(command) for command in commands]
        replies: list[Any] = [None] * len(commands)
        todo = list(range(len(commands)))
        for attempt in range(RETRIES + 1):
            read, written, error = await self._attempt([packed[i] for i in todo])
            for i, reply in zip(todo, read, strict=False):
                replies[i] = reply
            if error is None:
                break
            left, todo = todo[len(read) :], []
            for i in left:
                if attempt < RETRIES and (not written or resend[i]):
                    todo.append(i)
                else:
                    replies[i] = error
            if not todo:
                break
        return replies

    async def _attempt(self, packed: list[bytes]) -> tuple[list[Any], bool, RedisError | None]:
        """One try: the replies read (in order, maybe not all), whether any byte may have
        reached Redis, and the error that ended it early (the connection is dropped)."""
        data = b"".join(packed)
        connection = self._connection
        read: list[Any] = []
        written = False
        try:
            async with asyncio.timeout(self._timeout + len(data) / BYTES_PER_SECOND):
                if not connection.is_connected:
                    await connection.connect()  # type: ignore[no-untyped-call]
                written = True
                await connection.send_packed_command(data, check_health=False)
                for _ in packed:
                    read.append(await _reply(connection))
        except (RedisConnectionError, RedisTimeoutError, TimeoutError, OSError) as exc:
            await connection.disconnect(nowait=True)
            if isinstance(exc, RedisError):
                return read, written, exc
            error = RedisConnectionError(str(exc) or type(exc).__name__)
            error.__cause__ = exc
            return read, written, error
        return read, written, None

    async def close(self) -> None:
        await self._connection.disconnect()


async def _reply(connection: AbstractConnection) -> Any:
    try:
        return await connection.read_response()
    except ResponseError as exc:
        return exc


class RedisStore:
    """Lua scripts over one pooled ``redis.asyncio`` client (hiredis parser when installed)."""

    max_payload_bytes = MAX_PAYLOAD_BYTES

    def __init__(self, url: str) -> None:
        self.url = url
        pool = ConnectionPool.from_url(
            url,
            max_connections=MAX_CONNECTIONS,
            socket_connect_timeout=SOCKET_CONNECT_TIMEOUT,
            socket_timeout=SOCKET_TIMEOUT,
            retry=Retry(ExponentialBackoff(cap=0.2, base=0.02), RETRIES),
        )
        self._redis = Redis.from_pool(pool)
        self._coalescer = Coalescer(pool)
        self._queue: RedisQueue | None = None

    async def _script(
        self, source: str, keys: list[str], *args: Any, resend: bool | None = None
    ) -> Any:
        """Run a script; ``resend`` (by default: whether it is in ``RESENDABLE``) lets the
        coalescer send it again when its reply is lost."""
        sha = _SHA[source]
        again = source in RESENDABLE if resend is None else resend
        command = ("EVALSHA", sha, len(keys), *keys, *args)
        try:
            try:
                return await self._coalescer.call(*command, resend=again)
            except NoScriptError:  # a restarted or flushed Redis: load the script, once
                await self._coalescer.call("SCRIPT", "LOAD", source, resend=True)
                return await self._coalescer.call(*command, resend=again)
        except ResponseError as exc:
            raise _translated(exc) from exc
        except RedisError as exc:
            raise StoreUnavailable(f"redis store: {type(exc).__name__}: {exc}") from exc
        except OSError as exc:
            raise StoreUnavailable(f"redis store: {exc}") from exc

    async def claim(
        self,
        key: RecordKey,
        fingerprint: str,
        owner: str,
        lock_ttl: float,
        result_ttl: float,
        *,
        reexecute_lapsed: bool = False,
    ) -> Claim:
        record, slot, index, member = _names(key)
        keys = [record, slot, index]
        args = (key.name, fingerprint, owner, _ms(lock_ttl), _ms(result_ttl))
        reply = await self._script(_CLAIM, keys, *args, int(reexecute_lapsed), member)
        if reply[0] == 1:
            previous = reply[1].decode() if reply[1] else ""
            return Claim(None, previous if previous and previous != key.name else None)
        return Claim(_record(keys[0], reply[1:], key))

    async def renew(self, key: RecordKey, owner: str, lock_ttl: float, result_ttl: float) -> bool:
        record, _, index, member = _names(key)
        args = (owner, _ms(lock_ttl), _ms(result_ttl), member)
        return bool(await self._script(_RENEW, [record, index], *args))

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
        record, _, index, member = _names(key)
        keys = [record, index]
        replace = "1" if replace_outcome else "0"
        fenced = successor or owner
        args = (owner, state.value, payload, _ms(result_ttl), fingerprint, member, replace, fenced)
        # sent again, a complete that must not replace an outcome would find its own
        return bool(await self._script(_COMPLETE, keys, *args, resend=replace_outcome))

    async def release(self, key: RecordKey, owner: str) -> bool:
        record, _, index, member = _names(key)
        return bool(await self._script(_RELEASE, [record, index], owner, member))

    async def get(self, key: RecordKey) -> Record | None:
        name = record_key(key)
        reply = await self._script(_GET, [name])
        return _record(name, reply[1:], key) if reply[0] == 1 else None

    async def records(self, scope: str) -> list[Record]:
        """Page by page (``ZSCAN``, then ``SSCAN`` of a legacy index): no call to Redis
        reads more than about ``LIST_PAGE`` records, however long the scope's index."""
        prefix = record_prefix(scope)
        found: dict[str, Record] = {}
        for index, pairs in ((index_key(scope), True), (legacy_index_key(scope), False)):
            cursor = "0"
            while True:
                cursor, members = await self._index_page(index, pairs, cursor)
                page = [m for m in members if m not in found]
                if page:
                    keys = [index, *(prefix + m for m in page)]
                    for reply in await self._script(_RECORDS, keys, int(pairs), *page):
                        found[reply[-1].decode()] = _indexed(scope, prefix, reply)
                if cursor == "0":
                    break
        return sorted(found.values(), key=lambda r: (r.created_at, r.key or ("", "")))

    async def _index_page(self, index: str, scored: bool, cursor: str) -> tuple[str, list[str]]:
        """One ``ZSCAN`` (``scored``) or ``SSCAN`` step: the next cursor, the members."""
        scan = "ZSCAN" if scored else "SSCAN"
        position, items = await self._command(scan, index, cursor, "COUNT", LIST_PAGE, resend=True)
        members = items[::2] if scored else items
        position = position.decode() if isinstance(position, bytes) else str(position)
        return position, [m.decode() for m in members]

    async def scan(self, cursor: str, count: int) -> tuple[str, list[Record]]:
        """One SCAN step over the record keys (``MATCH tp:*:r:*``): bounded work per call."""
        position, names = await self._command(
            "SCAN",
            cursor or "0",
            "MATCH",
            f"{KEY_PREFIX}{{*}}:r:*",
            "COUNT",
            max(count, 1),
            resend=True,
        )
        found = []
        for raw in names:
            key = _parse_record_key(raw.decode())
            if key is not None and (record := await self.get(key)) is not None:
                found.append(record)
        position = position.decode() if isinstance(position, bytes) else str(position)
        return ("" if position == "0" else position), found

    async def settle(
        self,
        key: RecordKey,
        state: State | None,
        payload: bytes,
        result_ttl: float,
        *,
        owner: str | None = None,
    ) -> bool:
        record, _, index, member = _names(key)
        args = ("" if state is None else state.value, payload, _ms(result_ttl), owner or "")
        return bool(await self._script(_SETTLE, [record, index], *args, member))

    async def delete(self, key: RecordKey) -> bool:
        return bool(await self._command("DEL", record_key(key)))

    async def _command(self, *command: Any, resend: bool = False) -> Any:
        """One plain command; ``resend`` as for ``Coalescer.call`` (reads, plain SETs)."""
        try:
            return await self._coalescer.call(*command, resend=resend)
        except ResponseError as exc:
            raise _translated(exc) from exc
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"redis store: {type(exc).__name__}: {exc}") from exc

    async def put_value(self, key: str, value: bytes, ttl: float) -> None:
        await self._command("SET", f"{KEY_PREFIX}v:{{{key}}}", value, "PX", _ms(ttl), resend=True)

    async def get_value(self, key: str) -> bytes | None:
        value = await self._command("GET", f"{KEY_PREFIX}v:{{{key}}}", resend=True)
        return None if value is None else bytes(value)

    async def acquire(self, key: str, owner: str, ttl: float) -> bool:
        name = f"{KEY_PREFIX}l:{{{key}}}"
        # both safe to send again: a lost SET NX is found by the GET (its owner)
        if await self._command("SET", name, owner, "NX", "PX", _ms(ttl), resend=True):
            return True
        return bool(await self._command("GET", name, resend=True) == owner.encode())

    async def unlock(self, key: str, owner: str) -> None:
        await self._script(_UNLOCK, [f"{KEY_PREFIX}l:{{{key}}}"], owner)

    async def open(self) -> None:
        """Nothing to do: connections are made on first use, and remade after a failure."""

    async def sweep(self) -> int:
        """Redis expires keys itself; this only deletes the job queue's consumers that
        are gone (``RedisQueue.sweep``). No record is counted."""
        await self.queue().sweep()
        return 0

    async def ping(self) -> None:
        try:
            await self._redis.ping()
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"redis store: {type(exc).__name__}: {exc}") from exc

    async def close(self) -> None:
        await self._coalescer.close()
        await self._redis.aclose()

    def buckets(self) -> RedisBuckets:
        """The rate buckets in the same Redis, over the same coalesced connection."""
        return RedisBuckets(self)

    def locks(self) -> RedisLocks:
        """The resource locks and versions in the same Redis, over the same connection."""
        return RedisLocks(self)

    def queue(self) -> RedisQueue:
        """The job queue in the same Redis, over the same connection (one per store)."""
        if self._queue is None:
            self._queue = RedisQueue(self)
        return self._queue


def _translated(exc: ResponseError) -> StoreUnavailable:
    """An error reply: a refusal (``StoreRefused``) or the store unusable for now."""
    message = str(exc)
    if isinstance(exc, OutOfMemoryError):  # redis-py strips its "OOM" from the message
        return StoreRefused(f"redis store: OOM {message}")
    kind = StoreRefused if message.startswith(REFUSALS) else StoreUnavailable
    return kind(f"redis store: {message}")


def _record(name: str, fields: list[Any], key: RecordKey) -> Record:
    try:
        state, fp, owner, payload, left, created, updated = fields
        return Record(
            State(state.decode()),
            fp.decode(),
            owner.decode(),
            max(left, 0) / 1000,
            payload,
            key,
            int(created or 0) / 1000,
            int(updated or 0) / 1000,
        )
    except (ValueError, AttributeError, TypeError) as exc:
        raise StoreError(f"redis store: malformed record at {name}") from exc


def _indexed(scope: str, prefix: str, reply: list[Any]) -> Record:
    step, _, name = reply[-1].decode().partition(":")
    return _record(prefix + reply[-1].decode(), reply[1:-1], RecordKey(f"{scope}|{step}", name))


def _parse_record_key(redis_key: str) -> RecordKey | None:
    """The RecordKey of ``tp:{<scope>}:r:<step>:<name>`` (None if it is not one)."""
    if not redis_key.startswith(KEY_PREFIX + "{"):
        return None
    scope, sep, rest = redis_key[len(KEY_PREFIX) + 1 :].rpartition("}:r:")
    step, colon, name = rest.partition(":")
    if not sep or not colon:
        return None
    return RecordKey(f"{scope}|{step}", name)


_NOW_MS = """
redis.replicate_commands()
local t = redis.call('TIME')
local now = t[1] * 1000 + t[2] / 1000
"""

# KEYS: pause, rate buckets..., slot sets... ARGV: nrates, nslots, owner, slot ttl (ms),
# then (interval ms, tolerance ms, cost) per rate, then the capacity per slot set.
# Returns {allowed, paused ms, retry ms, (remaining, reset ms, limited) per rate, then the
# free slots per slot set}.
_TAKE = (
    _NOW_MS
    + """
local paused = tonumber(redis.call('GET', KEYS[1]) or 0)
if paused > now then return {0, math.ceil(paused - now), 0} end
local nr, ns, owner, ttl = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4])
local out, tats, wait, full = {1, 0, 0}, {}, 0, false
for i = 1, nr do
  local a = 4 + (i - 1) * 3
  local interval, tolerance = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local cost = tonumber(ARGV[a + 3])
  local base = math.max(tonumber(redis.call('GET', KEYS[1 + i]) or now), now)
  local new = base + interval * cost
  local over = new - tolerance - now
  if over > 0.001 then
    wait = math.max(wait, over)
    table.insert(out, 0)
    table.insert(out, math.ceil(base - now))
    table.insert(out, 1)
  else
    tats[i] = new
    table.insert(out, math.max(math.floor((tolerance - (new - now)) / interval + 1e-6), 0))
    table.insert(out, math.ceil(new - now))
    table.insert(out, 0)
  end
end
for j = 1, ns do
  local key = KEYS[1 + nr + j]
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  local held = redis.call('ZCARD', key)
  local mine = redis.call('ZSCORE', key, owner)
  local left = tonumber(ARGV[4 + nr * 3 + j]) - held
  if not mine then left = left - 1 end
  if left < 0 then full = true end
  table.insert(out, left)
end
if wait > 0 or full then
  out[1] = 0
  out[3] = math.ceil(wait)
  return out
end
for i = 1, nr do
  redis.call('SET', KEYS[1 + i], string.format('%.3f', tats[i]), 'PX', math.ceil(tats[i] - now) + 1)
end
for j = 1, ns do
  local key = KEYS[1 + nr + j]
  redis.call('ZADD', key, now + ttl, owner)
  if redis.call('PTTL', key) < ttl then redis.call('PEXPIRE', key, math.ceil(ttl)) end
end
return out
"""
)

# KEYS: rate buckets..., slot sets... ARGV: nrates, owner, then (interval ms, units) per rate.
_FINISH = (
    _NOW_MS
    + """
local nr, owner = tonumber(ARGV[1]), ARGV[2]
for i = 1, nr do
  local interval, units = tonumber(ARGV[1 + i * 2]), tonumber(ARGV[2 + i * 2])
  local tat = math.max(tonumber(redis.call('GET', KEYS[i]) or now), now) + interval * units
  if tat <= now then
    redis.call('DEL', KEYS[i])
  else
    redis.call('SET', KEYS[i], string.format('%.3f', tat), 'PX', math.ceil(tat - now) + 1)
  end
end
for j = nr + 1, #KEYS do redis.call('ZREM', KEYS[j], owner) end
return 1
"""
)

# KEYS: slot sets. ARGV: owner, ttl (ms). 1 if every slot was still held.
_RENEW_SLOTS = (
    _NOW_MS
    + """
local kept = 1
for _, key in ipairs(KEYS) do
  local lease = tonumber(redis.call('ZSCORE', key, ARGV[1]) or 0)
  if lease > now then
    redis.call('ZADD', key, 'XX', now + ARGV[2], ARGV[1])
    local ttl = math.ceil(tonumber(ARGV[2]))
    if redis.call('PTTL', key) < ttl then redis.call('PEXPIRE', key, ttl) end
  else
    kept = 0
  end
end
return kept
"""
)

# KEYS: pause. ARGV: seconds (ms).
_PAUSE = (
    _NOW_MS
    + """
local stop = now + tonumber(ARGV[1])
if tonumber(redis.call('GET', KEYS[1]) or 0) < stop then
  redis.call('SET', KEYS[1], string.format('%.3f', stop), 'PX', math.ceil(tonumber(ARGV[1])) + 1)
end
return 1
"""
)

_SHA.update(
    {s: hashlib.sha1(s.encode()).hexdigest() for s in (_TAKE, _FINISH, _RENEW_SLOTS, _PAUSE)}
)


def limit_key(group: str, kind: str, key: str = "") -> str:
    """The Redis key of a group's bucket (``r``), slot set (``s``) or pause: one hash tag
    per group, so one script may touch all of a route's limits in a Redis Cluster."""
    return f"{KEY_PREFIX}{{lim:{group}}}:{kind}" + (f":{key}" if key else "")


def _fms(seconds: float) -> str:
    return f"{seconds * 1000:.3f}"


class RedisBuckets:
    """``Buckets`` as Lua scripts: one round trip per call, all of a group's keys under
    one hash tag."""

    def __init__(self, store: RedisStore) -> None:
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
        keys = [limit_key(group, "pause", scope)]
        keys += [limit_key(group, "r", rate.key) for rate in rates]
        keys += [limit_key(group, "s", slot.key) for slot in slots]
        args: list[Any] = [len(rates), len(slots), owner, _fms(slot_ttl)]
        for rate in rates:
            args += [_fms(rate.interval), _fms(rate.tolerance), repr(float(rate.cost))]
        args += [slot.capacity for slot in slots]
        reply = await self._store._script(_TAKE, keys, *args)
        try:
            allowed, paused, retry = (int(v) for v in reply[:3])
            if paused > 0:
                return Admission(False, paused / 1000, 0.0)
            end = 3 + 3 * len(rates)
            triples = reply[3:end]
            states = tuple(
                RateState(int(triples[i]), int(triples[i + 1]) / 1000, bool(triples[i + 2]))
                for i in range(0, len(triples), 3)
            )
            free = tuple(int(v) for v in reply[end:])
        except (ValueError, TypeError, IndexError) as exc:
            raise StoreError(f"redis store: malformed limits reply for {group}") from exc
        return Admission(bool(allowed), 0.0, retry / 1000, states, free)

    async def finish(
        self, group: str, changes: Sequence[tuple[Rate, float]], slots: Sequence[str], owner: str
    ) -> None:
        keys = [limit_key(group, "r", rate.key) for rate, _ in changes]
        keys += [limit_key(group, "s", key) for key in slots]
        args: list[Any] = [len(changes), owner]
        for rate, units in changes:
            args += [_fms(rate.interval), repr(float(units))]
        await self._store._script(_FINISH, keys, *args)

    async def renew(self, group: str, slots: Sequence[str], owner: str, ttl: float) -> bool:
        keys = [limit_key(group, "s", key) for key in slots]
        return bool(await self._store._script(_RENEW_SLOTS, keys, owner, _fms(ttl)))

    async def pause(self, group: str, seconds: float, scope: str = "") -> None:
        await self._store._script(_PAUSE, [limit_key(group, "pause", scope)], _fms(seconds))


# A scope's counter of fencing tokens and versions (KEYS[2]), started where the last
# argument says (``locks.counter_start``: the clock in microseconds) when it is absent
# (new, or lost with its Redis): a token or version never repeats one given before.
_DRAW_LIB = """
local function draw()
  if redis.call('EXISTS', KEYS[2]) == 0 then
    redis.call('SET', KEYS[2], ARGV[#ARGV])
  end
  return redis.call('INCR', KEYS[2])
end
"""

# KEYS: lock, the scope's counter. ARGV: owner, ttl (ms), counter start. Returns {token, 0}
# when taken (or already held by the owner: its token), {0, pttl} when another holds it.
_ACQUIRE_LOCK = (
    _DRAW_LIB
    + """
local r = redis.call('HMGET', KEYS[1], 'ow', 'tk')
if r[1] and r[1] ~= ARGV[1] then
  return {0, redis.call('PTTL', KEYS[1])}
end
local token = r[2]
if not r[1] then
  token = draw()
  redis.call('HSET', KEYS[1], 'ow', ARGV[1], 'tk', token)
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {tonumber(token), 0}
"""
)

# KEYS: lock. ARGV: owner, ttl (ms). 1 if the owner held it (now extended).
_RENEW_LOCK = """
if redis.call('HGET', KEYS[1], 'ow') == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

# KEYS: lock. ARGV: owner. 1 if the owner held it (now deleted).
_RELEASE_LOCK = """
if redis.call('HGET', KEYS[1], 'ow') == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# A version is a hash: n (number), w (1: set by a write), p (the owner of a write sent
# and not settled, or ''). ``entry`` reads it, or makes a fresh unwritten one.
_VERSION_LIB = (
    _DRAW_LIB
    + """
local function entry()
  local r = redis.call('HMGET', KEYS[1], 'n', 'w', 'p')
  if r[1] then return r end
  return {draw(), '0', ''}
end
local function keep(n, w, p, ttl)
  redis.call('HSET', KEYS[1], 'n', n, 'w', w, 'p', p)
  redis.call('PEXPIRE', KEYS[1], ttl)
  return {tonumber(n), tonumber(w)}
end
"""
)

# KEYS: version, the scope's counter. ARGV: ttl (ms), counter start. {number, written}.
_READ_VERSION = (
    _VERSION_LIB
    + """
local r = entry()
return keep(r[1], r[2], r[3], ARGV[1])
"""
)

# KEYS: version, the scope's counter. ARGV: owner, ttl (ms), counter start. {number, written}:
# another owner's mark left unsettled gives a fresh written number (it may have written).
_BEGIN_WRITE = (
    _VERSION_LIB
    + """
local r = entry()
if r[3] ~= '' and r[3] ~= ARGV[1] then
  r = {draw(), '1'}
end
return keep(r[1], r[2], ARGV[1], ARGV[2])
"""
)

# KEYS: version, the scope's counter. ARGV: owner, wrote (0/1), ttl (ms), counter start.
# The number after it, or nil if the owner's mark is not there (settled already).
_SETTLE_WRITE = (
    _VERSION_LIB
    + """
local r = redis.call('HMGET', KEYS[1], 'n', 'w', 'p')
if r[3] ~= ARGV[1] then return nil end
if ARGV[2] == '1' then
  r = {draw(), '1'}
end
return keep(r[1], r[2], '', ARGV[3])[1]
"""
)

_SHA.update(
    {
        s: hashlib.sha1(s.encode()).hexdigest()
        for s in (
            _ACQUIRE_LOCK,
            _RENEW_LOCK,
            _RELEASE_LOCK,
            _READ_VERSION,
            _BEGIN_WRITE,
            _SETTLE_WRITE,
        )
    }
)


def resource_keys(scope: str, kind: str, key: str) -> list[str]:
    """The Redis keys of a resource's lock (``kind`` 'l') or version ('v'), then of its
    scope's counter: one hash tag per scope, so one script touches both in a Redis
    Cluster. The counter has no expiry (it only grows); the others do."""
    tag = f"{KEY_PREFIX}{{res:{scope}}}"
    return [f"{tag}:{kind}:{key}", tag + ":n"]


class RedisLocks:
    """``Locks`` as Lua scripts (compare and set, compare and delete, a version and its
    mark): one round trip per call."""

    def __init__(self, store: RedisStore) -> None:
        self._store = store

    async def acquire(self, scope: str, key: str, owner: str, ttl: float) -> Grant:
        keys = resource_keys(scope, "l", key)
        reply = await self._store._script(_ACQUIRE_LOCK, keys, owner, _ms(ttl), counter_start())
        try:
            token, pttl = int(reply[0]), int(reply[1])
        except (ValueError, TypeError, IndexError) as exc:
            raise StoreError(f"redis store: malformed lock reply for {key}") from exc
        return Grant(None, max(pttl, 0) / 1000) if token == 0 else Grant(token)

    async def renew(self, scope: str, key: str, owner: str, ttl: float) -> bool:
        keys = resource_keys(scope, "l", key)[:1]
        return bool(await self._store._script(_RENEW_LOCK, keys, owner, _ms(ttl)))

    async def release(self, scope: str, key: str, owner: str) -> bool:
        keys = resource_keys(scope, "l", key)[:1]
        return bool(await self._store._script(_RELEASE_LOCK, keys, owner))

    async def version(self, scope: str, key: str, ttl: float) -> Version:
        keys = resource_keys(scope, "v", key)
        return _version(
            key, await self._store._script(_READ_VERSION, keys, _ms(ttl), counter_start())
        )

    async def begin(self, scope: str, key: str, owner: str, ttl: float) -> Version:
        keys = resource_keys(scope, "v", key)
        start = counter_start()
        reply = await self._store._script(_BEGIN_WRITE, keys, owner, _ms(ttl), start)
        return _version(key, reply)

    async def settle(self, scope: str, key: str, owner: str, wrote: bool, ttl: float) -> int | None:
        keys = resource_keys(scope, "v", key)
        reply = await self._store._script(
            _SETTLE_WRITE, keys, owner, int(wrote), _ms(ttl), counter_start()
        )
        return None if reply is None else int(reply)


def _version(key: str, reply: Any) -> Version:
    try:
        return Version(int(reply[0]), bool(int(reply[1])))
    except (ValueError, TypeError, IndexError) as exc:
        raise StoreError(f"redis store: malformed version reply for {key}") from exc


# The job queue: every key under one hash tag, so each operation is one script, legal in
# a Redis Cluster (the scripts derive a job's route keys from the tag: same slot).
QUEUE_TAG = f"{KEY_PREFIX}{{ops}}:"
GROUP = "workers"
# Consumers (workers) with no pending entry that did not read for this long are deleted
# by the sweep.
IDLE_CONSUMER_MS = 3600 * 1000
_JOB_FIELDS = (
    *("id", "rt", "pr", "sl", "nm", "lb", "rq", "kp"),
    *("st", "at", "sn", "er", "ct", "ut", "du", "sq"),
)
_EVENT_FIELDS = ("st", "at", "sn", "er", "ut", "du")

# Times are milliseconds (Redis TIME). ``changed`` keeps the job's snapshot as the event
# ``0-<seq>`` of its event stream, restarts both keys' expiry and tells subscribers.
_QUEUE_LIB = (
    _NOW
    + f"""
local Q, GROUP = '{QUEUE_TAG}', '{GROUP}'
local FIELDS = {{{", ".join(f"'{f}'" for f in _JOB_FIELDS)}}}
local function enqueue(route, id)
  local stream = Q .. 'q:' .. route
  if redis.call('EXISTS', stream) == 0 then
    redis.call('XGROUP', 'CREATE', stream, GROUP, '0', 'MKSTREAM')
  end
  return redis.call('XADD', stream, '*', 'id', id)
end
local function unqueue(route, id, entry)
  if entry ~= '' then
    redis.call('XACK', Q .. 'q:' .. route, GROUP, entry)
    redis.call('XDEL', Q .. 'q:' .. route, entry)
  end
  redis.call('ZREM', Q .. 'due:' .. route, id)
end
local function changed(id)
  local job, events = Q .. 'job:' .. id, Q .. 'ev:' .. id
  local r = redis.call('HMGET', job, 'sq', 'kp', {", ".join(f"'{f}'" for f in _EVENT_FIELDS)})
  redis.call('XADD', events, '0-' .. r[1], 'st', r[3], 'at', r[4], 'sn', r[5], 'er', r[6],
    'ut', r[7], 'du', r[8])
  redis.call('PEXPIRE', job, r[2])
  redis.call('PEXPIRE', events, r[2])
  redis.call('ZADD', Q .. 'exp', now + r[2], id)
  redis.call('PUBLISH', Q .. 'changes', id)
  return redis.call('HMGET', job, unpack(FIELDS))
end
"""
)

# KEYS: job. ARGV: id, route, principal, slot, name, label, request, keep (ms), token.
# Drops a few expired jobs from the indexes on the way: each job is submitted once, so
# the indexes hold about the live jobs.
_SUBMIT = (
    _QUEUE_LIB
    + """
local tk = redis.call('HGET', KEYS[1], 'tk')
if tk then return tk == ARGV[9] and redis.call('HMGET', KEYS[1], unpack(FIELDS)) end
local gone = redis.call('ZRANGE', Q .. 'exp', '-inf', now, 'BYSCORE', 'LIMIT', 0, 16)
if #gone > 0 then
  redis.call('ZREM', Q .. 'ids', unpack(gone))
  redis.call('ZREM', Q .. 'exp', unpack(gone))
end
redis.call('DEL', Q .. 'ev:' .. ARGV[1])
redis.call('HSET', KEYS[1], 'id', ARGV[1], 'rt', ARGV[2], 'pr', ARGV[3], 'sl', ARGV[4],
  'nm', ARGV[5], 'lb', ARGV[6], 'rq', ARGV[7], 'kp', ARGV[8], 'st', 'queued', 'at', 0,
  'sn', 0, 'er', '', 'ct', now, 'ut', now, 'du', now, 'sq', 1, 'ho', '', 'hu', 0,
  'en', enqueue(ARGV[2], ARGV[1]), 'tk', ARGV[9])
redis.call('ZADD', Q .. 'ids', 0, ARGV[1])
redis.call('SADD', Q .. 'routes', ARGV[2])
return changed(ARGV[1])
"""
)

# KEYS: the route's stream. ARGV: route, worker, visibility (ms), token. Due retries go
# into the stream first; then a new entry (XREADGROUP), else one whose hold lapsed
# (XAUTOCLAIM). Entries whose job ended, expired or was queued again under another entry
# are dropped.
_TAKE_JOB = (
    _QUEUE_LIB
    + """
local route, worker, vis, stream = ARGV[1], ARGV[2], tonumber(ARGV[3]), KEYS[1]
local took = redis.call('GET', Q .. 'took:' .. ARGV[4])
if took and redis.call('HGET', Q .. 'job:' .. took, 'ho') == worker then
  return redis.call('HMGET', Q .. 'job:' .. took, unpack(FIELDS))
end
local due = Q .. 'due:' .. route
for _, id in ipairs(redis.call('ZRANGE', due, '-inf', now, 'BYSCORE', 'LIMIT', 0, 100)) do
  redis.call('ZREM', due, id)
  if redis.call('HGET', Q .. 'job:' .. id, 'st') == 'queued' then
    redis.call('HSET', Q .. 'job:' .. id, 'en', enqueue(route, id))
  end
end
if redis.call('EXISTS', stream) == 0 then return false end
local function hand(entry, new)
  local job = Q .. 'job:' .. entry[2][2]
  local r = redis.call('HMGET', job, 'st', 'en', 'hu')
  if r[2] ~= entry[1] or not (r[1] == 'queued' or (r[1] == 'running' and not new)) then
    redis.call('XACK', stream, GROUP, entry[1])
    redis.call('XDEL', stream, entry[1])
    return nil
  end
  if tonumber(r[3]) > now then return nil end -- held for longer than this visibility
  redis.call('HSET', job, 'ho', worker, 'hu', now + vis)
  redis.call('SET', Q .. 'took:' .. ARGV[4], entry[2][2], 'PX', vis)
  return redis.call('HMGET', job, unpack(FIELDS))
end
for _ = 1, 100 do
  local got = redis.call('XREADGROUP', 'GROUP', GROUP, worker, 'COUNT', 1, 'STREAMS', stream, '>')
  if not got then break end
  local job = hand(got[1][2][1], true)
  if job then return job end
end
local cursor = '0-0'
for _ = 1, 100 do
  local got = redis.call('XAUTOCLAIM', stream, GROUP, worker, vis, cursor, 'COUNT', 1)
  for _, entry in ipairs(got[2]) do
    local job = hand(entry, false)
    if job then return job end
  end
  cursor = got[1]
  if cursor == '0-0' then break end
end
return false
"""
)

# KEYS: job. ARGV: worker, visibility (ms). 1 if the worker held it (renewed: the hold's
# end in the job, the entry's idle time in the group).
_HOLD_JOB = (
    _QUEUE_LIB
    + """
local r = redis.call('HMGET', KEYS[1], 'st', 'ho', 'hu', 'en', 'rt')
if not (r[1] == 'queued' or r[1] == 'running') or r[2] ~= ARGV[1] then return 0 end
if tonumber(r[3]) <= now then return 0 end
redis.call('HSET', KEYS[1], 'hu', now + ARGV[2])
if r[4] ~= '' then
  redis.call('XCLAIM', Q .. 'q:' .. r[5], GROUP, ARGV[1], 0, r[4], 'JUSTID')
end
return 1
"""
)

# KEYS: job. ARGV: expected states (",queued,running,"), state, worker ('' for any),
# due (ms from now), token, then the fields to set (name, value, ...). The job, or nil.
_MOVE_JOB = (
    _QUEUE_LIB
    + """
local r = redis.call('HMGET', KEYS[1], 'st', 'ho', 'hu', 'en', 'rt', 'id', 'sq', 'tk')
if r[8] == ARGV[5] then return redis.call('HMGET', KEYS[1], unpack(FIELDS)) end
if not r[1] or not string.find(ARGV[1], ',' .. r[1] .. ',', 1, true) then return false end
if ARGV[3] ~= '' and (r[2] ~= ARGV[3] or tonumber(r[3]) <= now) then return false end
local state, set = ARGV[2], {'st', ARGV[2], 'ut', now, 'sq', r[7] + 1, 'tk', ARGV[5]}
for i = 6, #ARGV do table.insert(set, ARGV[i]) end
if state == 'completed' or state == 'failed' or state == 'cancelled' then
  table.insert(set, 'rq') -- spent: the request (credentials and all) is dropped
  table.insert(set, '')
end
if state ~= 'running' then
  unqueue(r[5], r[6], r[4])
  local entry, due = '', now + tonumber(ARGV[4])
  if state == 'queued' then
    if due > now then
      redis.call('ZADD', Q .. 'due:' .. r[5], due, r[6])
    else
      entry = enqueue(r[5], r[6])
    end
    table.insert(set, 'du')
    table.insert(set, due)
  end
  for _, v in ipairs({'ho', '', 'hu', 0, 'en', entry}) do table.insert(set, v) end
end
redis.call('HSET', KEYS[1], unpack(set))
return changed(r[6])
"""
)

# KEYS: job, its events. ARGV: after (seq). {the job's fixed fields, events} or nil.
_JOB_EVENTS = """
local job = redis.call('HMGET', KEYS[1], 'id', 'rt', 'pr', 'sl', 'nm', 'lb', 'kp', 'ct')
if not job[1] then return false end
return {job, redis.call('XRANGE', KEYS[2], '(0-' .. ARGV[1], '+')}
"""

# KEYS: the id index. ARGV: cursor ('' to start), count, state ('' for any). {next
# cursor, jobs...} (``request`` empty); ids of expired jobs are skipped.
_LIST_JOBS = f"""
local Q = '{QUEUE_TAG}'
local FIELDS = {{{", ".join(f"'{f}'" for f in _JOB_FIELDS)}}}
local start = ARGV[1] == '' and '-' or '(' .. ARGV[1]
local ids = redis.call('ZRANGE', KEYS[1], start, '+', 'BYLEX', 'LIMIT', 0, ARGV[2])
local out = {{#ids == tonumber(ARGV[2]) and ids[#ids] or ''}}
for _, id in ipairs(ids) do
  local job = redis.call('HMGET', Q .. 'job:' .. id, unpack(FIELDS))
  if job[1] and (ARGV[3] == '' or job[9] == ARGV[3]) then
    job[7] = ''
    table.insert(out, job)
  end
end
return out
"""

# KEYS: the route index. ARGV: the idle time (ms) past which a consumer with no pending
# entry is deleted (a worker that reads again is a consumer again). Returns how many.
_SWEEP_JOBS = (
    _QUEUE_LIB
    + """
local deleted = 0
for _, route in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local stream = Q .. 'q:' .. route
  if redis.call('EXISTS', stream) == 1 then
    for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', stream, GROUP)) do
      local info = {}
      for i = 1, #c, 2 do info[c[i]] = c[i + 1] end
      if info['pending'] == 0 and info['idle'] > tonumber(ARGV[1]) then
        redis.call('XGROUP', 'DELCONSUMER', stream, GROUP, info['name'])
        deleted = deleted + 1
      end
    end
  end
end
return deleted
"""
)

_SHA.update(
    {
        s: hashlib.sha1(s.encode()).hexdigest()
        for s in (_SUBMIT, _TAKE_JOB, _HOLD_JOB, _MOVE_JOB, _JOB_EVENTS, _LIST_JOBS, _SWEEP_JOBS)
    }
)


# The scripts the coalescer may send again when their reply is lost (``Coalescer``): reads,
# and writes that, run twice, do and answer as once: the same owner's claim and
# renewals, the queue's writes (each carries a token), a pause (the later end wins). Not
# a record's release: its answer is read (a job's refusal: whether the key was still its
# own), and a resend would answer "not yours". Not the rate take and true-up (units taken twice),
# a settle or a lock's release (their answer would say "changed meanwhile"), nor a
# complete that must not replace an outcome (it would find its own); those fail with
# ``StoreUnavailable``, as when Redis is out of reach.
RESENDABLE = frozenset(
    {
        *(_CLAIM, _GET, _RECORDS, _RENEW, _UNLOCK),
        *(_RENEW_SLOTS, _PAUSE, _ACQUIRE_LOCK, _RENEW_LOCK, _READ_VERSION, _BEGIN_WRITE),
        *(_SUBMIT, _TAKE_JOB, _HOLD_JOB, _MOVE_JOB, _JOB_EVENTS, _LIST_JOBS, _SWEEP_JOBS),
    }
)


def queue_key(kind: str, name: str = "") -> str:
    """A key of the job queue: ``job`` or ``ev`` of a job id, ``q`` or ``due`` of a route,
    or the indexes ``ids``, ``exp``, ``routes``."""
    return f"{QUEUE_TAG}{kind}" + (f":{name}" if name else "")


class RedisQueue:
    """``Queue`` as Lua scripts (one round trip, atomic, per call), every key under the
    hash tag ``{ops}``::

        tp:{ops}:job:<id>    hash: the job (``_JOB_FIELDS``; ms times), its holder (ho),
                             hold's end (hu, ms), stream entry (en, '' if none) and the
                             token of its last write (tk)
        tp:{ops}:took:<tk>   string: the id a take (its token) handed out, for its hold
        tp:{ops}:ev:<id>     stream: its events, entry 0-<seq> (``_EVENT_FIELDS``)
        tp:{ops}:q:<route>   stream: queued jobs (field id), read by the group 'workers'
        tp:{ops}:due:<route> sorted set: jobs queued again, scored by when due (ms)
        tp:{ops}:ids         sorted set: every job id, score 0 (``list`` pages by id)
        tp:{ops}:exp         sorted set: job ids by expiry (ms): ``submit`` drops a few
                             expired ones from both indexes each time
        tp:{ops}:routes      set: the routes that have a stream (``sweep``)
        tp:{ops}:changes     pub/sub channel: the id of each job that changed

    The job and its events expire ``keep`` after each change (PEXPIRE). A taken job's
    entry is pending for its worker (the consumer); ``hold`` resets its idle time
    (XCLAIM JUSTID) and ``take`` takes over entries idle for ``visibility`` (XAUTOCLAIM):
    the job's ``hu`` decides whether a hold lapsed. A move back to QUEUED or to an end
    drops the entry (XACK, XDEL). Needs Redis 6.2 or later (XAUTOCLAIM, ZRANGE BYSCORE
    and BYLEX, exclusive XRANGE).
    """

    def __init__(self, store: RedisStore) -> None:
        self._store = store

    async def submit(self, job: Job) -> Job:
        args = (job.id, job.route, job.principal, job.slot, job.name, job.label, job.request)
        keys = [queue_key("job", job.id)]
        reply = await self._store._script(_SUBMIT, keys, *args, _ms(job.keep), _token())
        if reply is None:
            raise ValueError(f"job {job.id} exists")
        return _job(reply)

    async def get(self, id: str) -> Job | None:
        reply = await self._store._command("HMGET", queue_key("job", id), *_JOB_FIELDS, resend=True)
        return None if reply[0] is None else _job(reply)

    async def events(self, id: str, after: int) -> list[Job] | None:
        keys = [queue_key("job", id), queue_key("ev", id)]
        reply = await self._store._script(_JOB_EVENTS, keys, after)
        if reply is None:
            return None
        try:
            id_, route, principal, slot, name, label, keep, created = reply[0]
            fixed = (id_, route, principal, slot, name, label, b"", keep)
            events = []
            for entry, pairs in reply[1]:
                e = dict(zip(pairs[::2], pairs[1::2], strict=True))
                changing = (e[b"st"], e[b"at"], e[b"sn"], e[b"er"], created, e[b"ut"], e[b"du"])
                events.append(_job([*fixed, *changing, entry.split(b"-")[1]]))
        except (ValueError, TypeError, KeyError) as exc:
            raise StoreError(f"redis store: malformed events of job {id}") from exc
        return events

    async def take(self, route: str, worker: str, visibility: float) -> Job | None:
        keys = [queue_key("q", route)]
        args = (route, worker, _ms(visibility), _token())
        reply = await self._store._script(_TAKE_JOB, keys, *args)
        return None if reply is None else _job(reply)

    async def hold(self, id: str, worker: str, visibility: float) -> bool:
        keys = [queue_key("job", id)]
        return bool(await self._store._script(_HOLD_JOB, keys, worker, _ms(visibility)))

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
        fields: list[Any] = []
        if attempts is not None:
            fields += ["at", attempts]
        if sent is not None:
            fields += ["sn", int(sent)]
        if error is not None:
            fields += ["er", error]
        expected = "," + ",".join(s.value for s in expect) + ","
        args = (expected, state.value, worker or "", max(int(due * 1000), 0), _token(), *fields)
        reply = await self._store._script(_MOVE_JOB, [queue_key("job", id)], *args)
        return None if reply is None else _job(reply)

    async def list(self, state: JobState | None, cursor: str, count: int) -> tuple[str, list[Job]]:
        args = (cursor, max(count, 1), "" if state is None else state.value)
        reply = await self._store._script(_LIST_JOBS, [queue_key("ids")], *args)
        return reply[0].decode(), [_job(fields) for fields in reply[1:]]

    async def sweep(self) -> int:
        """Delete the consumers with nothing pending that have not read for an hour
        (workers gone); return how many."""
        keys = [queue_key("routes")]
        return int(await self._store._script(_SWEEP_JOBS, keys, IDLE_CONSUMER_MS))

    async def changes(self) -> AsyncIterator[str]:
        """Over a connection of its own (SUBSCRIBE), closed when the iterator is."""
        pubsub = self._store._redis.pubsub()
        try:
            await pubsub.subscribe(queue_key("changes"))
            while True:
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=None)
                if message is not None:
                    yield message["data"].decode()
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"redis store: {type(exc).__name__}: {exc}") from exc
        finally:
            await pubsub.aclose()  # type: ignore[no-untyped-call]


def _token() -> str:
    """A write's own token: the Coalescer sends a round trip again after a connection
    error, and a script that finds its token already applied answers as it did."""
    return secrets.token_hex(8)


def _job(fields: list[Any]) -> Job:
    """A job from its hash fields (``_JOB_FIELDS``' order)."""
    try:
        id, route, principal, slot, name, label, request, keep, state, *rest = fields
        attempts, sent, error, created, updated, due, seq = rest
        return Job(
            id.decode(),
            route.decode(),
            principal.decode(),
            slot.decode(),
            name.decode(),
            label.decode(),
            bytes(request),
            int(keep) / 1000,
            JobState(state.decode()),
            int(attempts),
            sent == b"1",
            bytes(error),
            int(created) / 1000,
            int(updated) / 1000,
            int(due) / 1000,
            int(seq),
        )
    except (ValueError, TypeError, AttributeError) as exc:
        raise StoreError("redis store: malformed job") from exc
