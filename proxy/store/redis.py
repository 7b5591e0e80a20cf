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

    tp:{<slot>}:r:<name>   hash: st (state), fp (fingerprint), ow (owner), pl (payload),
                           lu (lease's end), ct, ut (created, updated), rp (replays served),
                           ix (its score in the scope's index)
    tp:{<slot>}:last       string: the last name claimed in the slot (to log replans)
    tp:{<scope>}:steps     sorted set: the scope's records (<step>:<name>), scored by
                           their expiry (ms) as claimed (the lease's end plus result_ttl,
                           kept in the record as ix; moved only if the record outlives it,
                           or would be outlived by more than result_ttl); a member leaves
                           as its record is released, settled away or found gone, or at
                           the next claim after its score passed
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
    tp:{ops:<shard>}:...      the job queue, one tag per route (``RedisQueue``: its keys
                              are listed there)

Every key a script touches is one of its KEYS (redis_scripts/), never built inside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import hiredis
from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.client import PubSub
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, OutOfMemoryError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from proxy.errors import StoreError, StoreRefused, StoreUnavailable
from proxy.store.base import Claim, Durability, Record, RecordKey, State
from proxy.store.buckets import Admission, Entry, GroupState, Rate, RateState, Slots, group_state
from proxy.store.locks import Grant, HeldLock, LocksHeld, Version, counter_start, locks_held
from proxy.store.queue import Job, JobState, job_shard
from proxy.store.redis_nodes import ClusterCoalescer, SentinelCoalescer, seeds
from proxy.store.redis_scripts import SCRIPTS, Script

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

# The scripts (redis_scripts/<name>-<keys>.lua): the records'.
_CLAIM, _GET, _RECORDS, _RENEW = (SCRIPTS[n] for n in ("claim", "get", "records", "renew"))
_COMPLETE, _RELEASE, _SETTLE, _UNLOCK = (
    SCRIPTS[n] for n in ("complete", "release", "settle", "unlock")
)


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


@dataclass(frozen=True, slots=True)
class Confirm:
    """The command that confirms the writes sent before it on a connection (``WAIT`` or
    ``WAITAOF``, ``store.durability``) and how long it may block Redis (seconds)."""

    command: Command
    seconds: float


class _Batch:
    """The commands that ride the next round trip, in the lists it sends them from: each
    command, whether it is safe to send again (``resend``), its caller's future; the
    confirmation some of them wait for (the first asked: one per connection is the same)
    and which they are."""

    __slots__ = ("commands", "confirm", "confirmed", "futures", "resend")

    def __init__(self) -> None:
        self.commands: list[Command] = []
        self.resend: list[bool] = []
        self.futures: list[asyncio.Future[Any]] = []
        self.confirm: Confirm | None = None
        self.confirmed: list[int] = []

    def add(self, command: Command, resend: bool, confirm: Confirm | None) -> asyncio.Future[Any]:
        if confirm is not None:
            self.confirm = self.confirm or confirm
            self.confirmed.append(len(self.commands))
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.commands.append(command)
        self.resend.append(resend)
        self.futures.append(future)
        return future


class Coalescer:
    """One round trip to Redis at a time; commands issued meanwhile ride the next one.

    An idle proxy sends a command at once (no added latency); under load, the commands
    that arrive while a round trip is under way are sent together when it returns
    (auto-pipelining): one write and one read for many requests.

    The round trips go over one connection of the coalescer's own, packed by hiredis
    and bounded by one timer each: redis-py's pipeline costs several times more per
    command (a task per write when socket_timeout is set, a timer per reply, Python
    packing), and this is the hot path of every guarded request.

    A command sent with a ``Confirm`` (``store.durability``) is followed in its round
    trip by one ``WAIT`` (or ``WAITAOF``) for the whole batch, after its last command: its
    reply confirms every write before it on the connection, so the batch pays for one
    wait for the replicas however many writes it carries. Such a caller gets its reply
    and the ``WAIT``'s (or the error that kept it).

    A round trip that breaks or times out is tried again on a new connection, but only
    with what is safe to send twice: every command if none had been written yet, else
    only the commands still without a reply that their caller marked ``resend`` (reads,
    and writes that find their own token or owner applied and answer as the first time).
    A command that may have run and is not safe to run again (a rate take, a true-up, a
    compare-and-set whose answer would change) fails with the connection's error. A
    ``WAIT`` is never sent again on its own (on a new connection it would confirm
    nothing): its callers then get the error, their writes unconfirmed.
    """

    def __init__(self, pool: ConnectionPool) -> None:
        kwargs = {**pool.connection_kwargs, "socket_timeout": None}  # one timer per trip
        self._connection: AbstractConnection = pool.connection_class(**kwargs)
        self._timeout = float(pool.connection_kwargs.get("socket_timeout") or SOCKET_TIMEOUT)
        self._busy = False
        self._pending: _Batch | None = None
        self._flushing: set[asyncio.Task[None]] = set()

    async def call(
        self,
        *command: Any,
        resend: bool = False,
        key: str | None = None,
        confirm: Confirm | None = None,
    ) -> Any:
        """Send ``command`` (now, or with the next batch) and return its reply;
        ``resend``: safe to send again if its reply is lost (see the class). ``key``
        routes a command in a cluster (``ClusterCoalescer``); one node holds them all.
        With ``confirm``: its reply and the confirmation's (see the class)."""
        if self._busy:  # rides the next round trip; its error is raised from the future
            return await (self._pending or self._open()).add(command, resend, confirm)
        self._busy = True
        try:
            (reply,) = await self._send([command], [resend], confirm, [0])
        finally:
            self._next()
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def call_asking(
        self, *command: Any, resend: bool = False, confirm: Confirm | None = None
    ) -> Any:
        """``ASKING`` then ``command``, next to each other in one round trip (a Cluster's
        migration under way: ``ClusterCoalescer``)."""
        if self._busy:
            preamble = self._later(("ASKING",), True, None)  # its reply is not awaited
            preamble.add_done_callback(lambda f: f.cancelled() or f.exception())
            return await self._later(command, resend, confirm)
        self._busy = True
        try:
            replies = await self._send([("ASKING",), command], [True, resend], confirm, [1])
        finally:
            self._next()
        if isinstance(replies[-1], Exception):
            raise replies[-1]
        return replies[-1]

    def _later(
        self, command: Command, resend: bool, confirm: Confirm | None
    ) -> asyncio.Future[Any]:
        """The reply of ``command`` from the next round trip."""
        return (self._pending or self._open()).add(command, resend, confirm)

    def _open(self) -> _Batch:
        """The batch of the next round trip, new."""
        self._pending = _Batch()
        return self._pending

    def _next(self) -> None:
        batch = self._pending
        if batch is None:
            self._busy = False
            return
        self._pending = None
        task = asyncio.get_running_loop().create_task(self._flush(batch))
        self._flushing.add(task)
        task.add_done_callback(self._flushing.discard)

    async def _flush(self, batch: _Batch) -> None:
        try:
            replies = await self._send(batch.commands, batch.resend, batch.confirm, batch.confirmed)
        except (RedisError, OSError) as exc:
            replies = [exc] * len(batch.commands)
        except BaseException:  # cancelled (shutdown): nobody may wait forever
            for future in batch.futures:
                future.cancel()
            raise
        finally:
            self._next()
        for future, reply in zip(batch.futures, replies, strict=True):
            if future.done():
                continue
            if isinstance(reply, Exception):
                future.set_exception(reply)
            else:
                future.set_result(reply)

    async def _send(
        self,
        commands: list[Command],
        resend: list[bool],
        confirm: Confirm | None,
        confirmed: list[int],
    ) -> list[Any]:
        """One round trip for ``commands``, and one ``confirm`` after them if given: the
        reply of each command in ``confirmed`` (their places) becomes (its reply, the
        confirmation's)."""
        if confirm is None:
            return await self._round_trip(commands, resend)
        replies = await self._round_trip([*commands, confirm.command], [*resend, False], confirm)
        acks = replies.pop()
        for i in confirmed:
            if not isinstance(replies[i], Exception):
                replies[i] = (replies[i], acks)
        return replies

    async def _round_trip(
        self, commands: list[Command], resend: list[bool], confirm: Confirm | None = None
    ) -> list[Any]:
        """Send ``commands`` and read their replies. An error reply, or the error that
        kept a command from its reply, is returned in its place, not raised.

        A broken or timed-out connection is dropped and what is safe to send again (see
        the class) sent once more on a new one, up to ``RETRIES`` times. A ``confirm``
        (the last command) extends the deadline by as long as it may block.
        """
        packed = [hiredis.pack_command(command) for command in commands]
        blocking = 0.0 if confirm is None else confirm.seconds
        read, written, error = await self._attempt(packed, blocking)
        if error is None:  # the common case: every reply read at the first attempt
            return read
        replies: list[Any] = [None] * len(commands)
        todo = list(range(len(commands)))
        attempt = 0
        while True:
            for i, reply in zip(todo, read, strict=False):
                replies[i] = reply
            if error is None:
                return replies
            left, todo = todo[len(read) :], []
            for i in left:
                if attempt < RETRIES and (not written or resend[i]):
                    todo.append(i)
                else:
                    replies[i] = error
            if not todo:
                return replies
            attempt += 1
            read, written, error = await self._attempt([packed[i] for i in todo], blocking)

    async def _attempt(
        self, packed: list[bytes], blocking: float = 0.0
    ) -> tuple[list[Any], bool, RedisError | None]:
        """One try: the replies read (in order, maybe not all), whether any byte may have
        reached Redis, and the error that ended it early (the connection is dropped).
        ``blocking``: how long a command of it may block Redis (a ``WAIT``)."""
        data = b"".join(packed)
        connection = self._connection
        read: list[Any] = []
        written = False
        deadline = self._timeout + blocking + len(data) / BYTES_PER_SECOND
        try:
            async with asyncio.timeout(deadline):
                if not connection.is_connected:
                    await connection.connect()  # type: ignore[no-untyped-call]
                written = True
                await connection.send_packed_command(data, check_health=False)
                for _ in packed:
                    try:
                        read.append(await connection.read_response())
                    except ResponseError as exc:  # an error reply: its caller's
                        read.append(exc)
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


def _pool(url: str) -> ConnectionPool:
    """The connections of one Redis node (``redis://`` or ``rediss://``)."""
    return ConnectionPool.from_url(
        url,
        max_connections=MAX_CONNECTIONS,
        socket_connect_timeout=SOCKET_CONNECT_TIMEOUT,
        socket_timeout=SOCKET_TIMEOUT,
        retry=Retry(ExponentialBackoff(cap=0.2, base=0.02), RETRIES),
    )


class RedisStore:
    """Lua scripts over one pooled ``redis.asyncio`` client (hiredis parser when installed)."""

    max_payload_bytes = MAX_PAYLOAD_BYTES

    def __init__(self, url: str, durability: Durability | None = None) -> None:
        self.url = url
        self.durability = durability
        self._confirm = None if durability is None else _confirmation(durability)
        scheme = url.partition("://")[0]
        self._redis: Redis | None = None
        self._coalescer: Coalescer | ClusterCoalescer | SentinelCoalescer
        if scheme.endswith("+cluster"):
            self._coalescer = ClusterCoalescer(url, _pool)
        elif scheme.endswith("+sentinel"):
            self._coalescer = SentinelCoalescer(url, _pool)
        else:
            pool = _pool(url)
            self._redis = Redis.from_pool(pool)
            self._coalescer = Coalescer(pool)
        self._queue: RedisQueue | None = None

    async def _script(
        self,
        script: Script,
        keys: list[str],
        *args: Any,
        resend: bool | None = None,
        confirm: Confirm | None = None,
    ) -> Any:
        """Run a script; ``resend`` (by default: whether it is in ``RESENDABLE``) lets the
        coalescer send it again when its reply is lost; ``confirm``: followed by it in
        the round trip (its reply and the confirmation's: ``Coalescer``)."""
        if script.keys is not None and len(keys) != script.keys:
            raise TypeError(f"redis script {script.name} takes {script.keys} keys, not {len(keys)}")
        again = script.name in RESENDABLE if resend is None else resend
        command = ("EVALSHA", script.sha, len(keys), *keys, *args)
        key = keys[0] if keys else None
        call = self._coalescer.call
        try:
            try:
                return await call(*command, resend=again, key=key, confirm=confirm)
            except NoScriptError:  # a restarted or flushed Redis: load the script, once
                await call("SCRIPT", "LOAD", script.source, resend=True, key=key)
                return await call(*command, resend=again, key=key, confirm=confirm)
        except ResponseError as exc:
            raise _translated(exc) from exc
        except RedisError as exc:
            raise StoreUnavailable(f"redis store: {type(exc).__name__}: {exc}") from exc
        except OSError as exc:
            raise StoreUnavailable(f"redis store: {exc}") from exc

    async def _durable(
        self, script: Script, keys: list[str], *args: Any, resend: bool | None = None
    ) -> tuple[Any, str | None]:
        """Run a script that writes what ``store.durability`` must confirm: its reply, and
        None once confirmed (or without durability), else why it is not."""
        if self._confirm is None:
            return await self._script(script, keys, *args, resend=resend), None
        reply, acks = await self._script(script, keys, *args, resend=resend, confirm=self._confirm)
        assert self.durability is not None
        return reply, shortfall(self.durability, acks)

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
        record, slot, index, member = _names(key)
        keys = [record, slot, index]
        args = (key.name, fingerprint, owner, _ms(lock_ttl), _ms(result_ttl))
        flags = (int(reexecute_lapsed), member, int(replay))
        if self._confirm is None:  # the hot path: one frame less per await
            reply, unconfirmed = await self._script(_CLAIM, keys, *args, *flags), None
        else:
            reply, unconfirmed = await self._durable(_CLAIM, keys, *args, *flags)
        if reply[0] == 1:
            if unconfirmed is not None:
                await self._unclaim(key, owner)
                raise StoreUnavailable(
                    f"redis store: the claim was not confirmed ({unconfirmed}); released, not sent"
                )
            previous = reply[1].decode() if reply[1] else ""
            return Claim(None, previous if previous and previous != key.name else None)
        return Claim(_record(keys[0], reply[1:], key))

    async def _unclaim(self, key: RecordKey, owner: str) -> None:
        """Release a claim that was not confirmed (it was not sent), if Redis answers: if
        the release is lost and the claim not, it lapses (FAILED: never executed twice)."""
        with contextlib.suppress(StoreUnavailable):
            await self.release(key, owner)

    async def renew(self, key: RecordKey, owner: str, lock_ttl: float, result_ttl: float) -> bool:
        """Confirmed with ``store.durability``: a lease the replicas do not know renewed
        could lapse on a promoted one while its call is still sent."""
        record, _, index, member = _names(key)
        args = (owner, _ms(lock_ttl), _ms(result_ttl), member)
        held, unconfirmed = await self._durable(_RENEW, [record, index], *args)
        if held and unconfirmed is not None:
            raise StoreUnavailable(f"redis store: the renewal was not confirmed ({unconfirmed})")
        return bool(held)

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
        if self._confirm is None:  # the hot path: one frame less per await
            done, unconfirmed = (
                await self._script(_COMPLETE, keys, *args, resend=replace_outcome),
                None,
            )
        else:
            done, unconfirmed = await self._durable(_COMPLETE, keys, *args, resend=replace_outcome)
        if done and unconfirmed is not None:  # written again from the journal
            raise StoreUnavailable(f"redis store: the outcome was not confirmed ({unconfirmed})")
        return bool(done)

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
        """One SCAN step over the record keys (``MATCH tp:*:r:*``): bounded work per call.
        On a cluster, primary after primary (the cursor ``<primary>:<its cursor>``)."""
        scan = ("SCAN", cursor or "0", "MATCH", f"{KEY_PREFIX}{{*}}:r:*", "COUNT", max(count, 1))
        if isinstance(self._coalescer, ClusterCoalescer):
            return await self._scan_cluster(self._coalescer, cursor, scan)
        position, names = await self._command(*scan, resend=True)
        return await self._scanned(position, names)

    async def _scan_cluster(
        self, cluster: ClusterCoalescer, cursor: str, scan: tuple[Any, ...]
    ) -> tuple[str, list[Record]]:
        primaries = await cluster.primaries()
        index, _, position = (cursor or "0:0").partition(":")
        address = primaries[min(int(index), len(primaries) - 1)]
        try:
            at, names = await cluster.call_at(address, scan[0], position, *scan[2:], resend=True)
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"redis store: {type(exc).__name__}: {exc}") from exc
        next_, found = await self._scanned(at, names)
        if next_:
            return f"{index}:{next_}", found
        more = int(index) + 1 < len(primaries)
        return (f"{int(index) + 1}:0" if more else ""), found

    async def _scanned(self, position: Any, names: list[bytes]) -> tuple[str, list[Record]]:
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

    async def tagged(self, tag: str, pattern: str) -> tuple[list[str], bool]:
        """The keys matching ``pattern`` (all under the hash tag of key ``tag``: one node
        of a cluster holds them), in at most ``TAG_SCANS`` SCAN steps; and whether the
        scan ended (it saw every key)."""
        found: set[str] = set()
        cursor = "0"
        for _ in range(TAG_SCANS):
            position, names = await self._scan_step(tag, cursor, pattern)
            found.update(n.decode() for n in names)
            cursor = position.decode() if isinstance(position, bytes) else str(position)
            if cursor == "0":
                return sorted(found), True
        return sorted(found), False

    async def _scan_step(self, tag: str, cursor: str, pattern: str) -> Any:
        scan = ("SCAN", cursor, "MATCH", pattern, "COUNT", TAG_SCAN_COUNT)
        if not isinstance(self._coalescer, ClusterCoalescer):
            return await self._command(*scan, resend=True)
        try:
            address = await self._coalescer.owner_of(tag)
            return await self._coalescer.call_at(address, *scan, resend=True)
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"redis store: {type(exc).__name__}: {exc}") from exc

    async def _command(self, *command: Any, resend: bool = False) -> Any:
        """One plain command; ``resend`` as for ``Coalescer.call`` (reads, plain SETs)."""
        key = command[1] if len(command) > 1 else None
        try:
            return await self._coalescer.call(*command, resend=resend, key=key)
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

    async def _subscriber(self) -> PubSub:
        """A pub/sub client over a connection of its own (``RedisQueue.changes``): on a
        cluster's node or the sentinels' primary, whose PUBLISH reach it."""
        if self._redis is not None:
            return self._redis.pubsub()
        assert not isinstance(self._coalescer, Coalescer)
        host, port = await self._coalescer.subscriber_address()
        _, node_url = seeds(self.url)
        return Redis.from_pool(_pool(node_url.format(f"{host}:{port}"))).pubsub()

    async def ping(self) -> None:
        try:
            if self._redis is None:
                assert not isinstance(self._coalescer, Coalescer)
                await self._coalescer.ping()
                return
            await self._redis.ping()
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"redis store: {type(exc).__name__}: {exc}") from exc

    async def close(self) -> None:
        await self._coalescer.close()
        if self._redis is not None:
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


def _confirmation(durability: Durability) -> Confirm:
    """``WAIT <replicas> <ms>``, or with ``aof`` ``WAITAOF 1 <replicas> <ms>`` (Redis 7.2:
    the write in the primary's append-only file and in as many replicas')."""
    ms = durability.timeout_ms
    if durability.aof:
        return Confirm(("WAITAOF", 1, durability.replicas, ms), durability.timeout)
    return Confirm(("WAIT", durability.replicas, ms), durability.timeout)


def shortfall(durability: Durability, acks: Any) -> str | None:
    """None if a ``WAIT`` (``WAITAOF``) reply confirms ``durability``, else why not."""
    wanted = durability.describe()
    if isinstance(acks, Exception):
        if "unknown command" in str(acks):
            return f"{wanted}: this Redis has no WAITAOF (store.durability.aof needs 7.2)"
        return f"{wanted}: {type(acks).__name__}: {acks}"
    try:
        local, replicas = (int(acks[0]), int(acks[1])) if durability.aof else (1, int(acks))
    except (ValueError, TypeError, IndexError, KeyError):
        return f"{wanted}: malformed reply {acks!r}"
    if local < 1:
        return f"{wanted}: not yet in the primary's append-only file"
    if replicas < durability.replicas:
        return f"{wanted}: {replicas} had it"
    return None


def _translated(exc: ResponseError) -> StoreUnavailable:
    """An error reply: a refusal (``StoreRefused``) or the store unusable for now."""
    message = str(exc)
    if isinstance(exc, OutOfMemoryError):  # redis-py strips its "OOM" from the message
        return StoreRefused(f"redis store: OOM {message}")
    kind = StoreRefused if message.startswith(REFUSALS) else StoreUnavailable
    return kind(f"redis store: {message}")


# A record's state as its hash keeps it (a dict look-up: a third of ``State(...)``'s cost).
_STATES = {state.value.encode(): state for state in State}


def _record(name: str, fields: list[Any], key: RecordKey) -> Record:
    try:
        state, fp, owner, payload, left, created, updated, replays = fields
        return Record(
            _STATES[state],
            fp.decode(),
            owner.decode(),
            max(left, 0) / 1000,
            payload,
            key,
            int(created or 0) / 1000,
            int(updated or 0) / 1000,
            int(replays or 0),
        )
    except (KeyError, ValueError, AttributeError, TypeError) as exc:
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


# The rate buckets' scripts.
_TAKE, _FINISH, _RENEW_SLOTS, _PAUSE = (
    SCRIPTS[n] for n in ("take_units", "finish_units", "renew_slots", "pause")
)
# The reads of the operator console: a group's limits, a scope's locks.
_LIMIT_STATE, _HELD_LOCKS = (SCRIPTS[n] for n in ("limit_state", "held_locks"))
# What a console read of one hash tag's keys scans at most: SCAN steps, and their COUNT
# hint (keys of the whole keyspace looked at per step); more keys: the state is partial.
TAG_SCANS = 10
TAG_SCAN_COUNT = 1000
# Keys one read script is given at most (a script blocks Redis while it runs).
READ_BATCH = 200


def limit_key(group: str, kind: str, key: str = "") -> str:
    """The Redis key of a group's bucket (``r``), slot set (``s``) or pause: one hash tag
    per group, so one script may touch all of a route's limits in a Redis Cluster."""
    return f"{KEY_PREFIX}{{lim:{group}}}:{kind}" + (f":{key}" if key else "")


def _fms(seconds: float) -> str:
    """Milliseconds as the shortest text that reads back as the same double (Lua's
    ``tonumber``): a bucket's interval and tolerance do the same arithmetic as the
    memory store's. Rounded to 0.001 ms, an interval no decimal holds (200 s / 300) ran
    over the tolerance by the burst's rounding, and the last unit never passed."""
    return repr(seconds * 1000)


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

    async def state(self, group: str, limit: int) -> GroupState:
        tag = limit_key(group, "")
        names, seen = await self._store.tagged(tag, _glob(tag) + "*")
        kinds: dict[str, list[Entry]] = {"r": [], "s": [], "pause": []}
        for batch in _batches([_limit_entry(tag, n) for n in names]):
            keys = [name for name, _, _ in batch]
            reply = await self._store._script(_LIMIT_STATE, keys, *(k for _, k, _ in batch))
            for (_, kind, key), (ms, held) in zip(batch, reply, strict=True):
                kinds[kind].append(Entry(key, int(ms) / 1000, int(held)))
        return group_state(kinds["r"], kinds["s"], kinds["pause"], limit, seen)


def _limit_entry(tag: str, name: str) -> tuple[str, str, str]:
    """A group's Redis key as (the key, its kind: r, s or pause, the bucket's key or the
    pause's scope)."""
    kind, _, key = name[len(tag) :].partition(":")
    return name, kind, key


def _batches(items: list[tuple[str, str, str]]) -> Iterator[list[tuple[str, str, str]]]:
    for start in range(0, len(items), READ_BATCH):
        yield items[start : start + READ_BATCH]


def _glob(text: str) -> str:
    """``text`` matched literally by a SCAN pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


# The resource locks' and versions' scripts.
_ACQUIRE_LOCK, _RENEW_LOCK, _RELEASE_LOCK = (
    SCRIPTS[n] for n in ("acquire_lock", "renew_lock", "release_lock")
)
_READ_VERSION, _BEGIN_WRITE, _SETTLE_WRITE = (
    SCRIPTS[n] for n in ("read_version", "begin_write", "settle_write")
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

    async def held(self, scope: str, limit: int) -> LocksHeld:
        prefix = resource_keys(scope, "l", "")[0]
        names, seen = await self._store.tagged(prefix, _glob(prefix) + "*")
        found = []
        for start in range(0, len(names), READ_BATCH):
            batch = names[start : start + READ_BATCH]
            for name, (token, ms) in zip(
                batch, await self._store._script(_HELD_LOCKS, batch), strict=True
            ):
                if token and int(ms) > 0:
                    found.append(HeldLock(name[len(prefix) :], int(token), int(ms) / 1000))
        return locks_held(found, limit, seen)

    async def settle(self, scope: str, key: str, owner: str, wrote: bool, ttl: float) -> int | None:
        keys = resource_keys(scope, "v", key)
        reply = await self._store._script(
            _SETTLE_WRITE, keys, owner, int(wrote), _ms(ttl), counter_start()
        )
        return None if reply is None else int(reply)


def _version(key: str, reply: Any) -> Version:
    try:
        return Version(int(reply[0]), bool(int(reply[1])), bool(int(reply[2])))
    except (ValueError, TypeError, IndexError) as exc:
        raise StoreError(f"redis store: malformed version reply for {key}") from exc


# The job queue: a job's keys and its route's queue share one hash tag per route
# (``tp:{ops:<shard>}:``, the shard from ``job_shard``: each job id starts with it), so
# every script touches one slot and a Redis Cluster spreads the routes over its nodes.
# Two keys are shared by every route: the set of routes and the channel of changes.
ROUTES_KEY = f"{KEY_PREFIX}{{ops}}:routes"
CHANNEL = f"{KEY_PREFIX}{{ops}}:changes"
GROUP = "workers"
# Consumers (workers) with no pending entry that did not read for this long are deleted
# by the sweep.
IDLE_CONSUMER_MS = 3600 * 1000
# Steps of one take at most (each a round trip: the next entry, then its job).
TAKE_STEPS = 100
_JOB_FIELDS = (
    *("id", "rt", "pr", "sl", "nm", "lb", "rq", "kp"),
    *("st", "at", "sn", "er", "ct", "ut", "du", "sq"),
)

_SUBMIT, _NEXT_JOB, _REQUEUE_JOB, _HAND_JOB = (
    SCRIPTS[n] for n in ("submit_job", "next_job", "requeue_job", "hand_job")
)
_HOLD_JOB, _MOVE_JOB, _JOB_EVENTS, _SWEEP_JOBS = (
    SCRIPTS[n] for n in ("hold_job", "move_job", "job_events", "sweep_jobs")
)


# The scripts the coalescer may send again when their reply is lost (``Coalescer``): reads,
# and writes that, run twice, do and answer as once: the same owner's claim (a replay it
# serves is then counted twice: ``replays`` is for operators, the answer is the same) and
# renewals (not a record's release: its answer is read), the queue's writes (each carries a
# token, or finds its work done), a pause (the later end wins). Not the rate take and
# true-up (units taken twice), a settle or a lock's release (their answer would say
# "changed meanwhile"), nor a complete that must not replace an outcome (it would find
# its own); those fail with ``StoreUnavailable``, as when Redis is out of reach.
RESENDABLE = frozenset(
    script.name
    for script in (
        *(_CLAIM, _GET, _RECORDS, _RENEW, _UNLOCK),
        *(_RENEW_SLOTS, _PAUSE, _ACQUIRE_LOCK, _RENEW_LOCK, _READ_VERSION, _BEGIN_WRITE),
        *(_SUBMIT, _NEXT_JOB, _REQUEUE_JOB, _HAND_JOB, _HOLD_JOB, _MOVE_JOB),
        *(_JOB_EVENTS, _SWEEP_JOBS),
    )
)


def queue_key(kind: str, shard: str, name: str = "") -> str:
    """A key of the job queue under a route's tag: ``job``, ``ev`` (a job id's events) or
    ``took`` (a take's token) of ``name``, or the route's ``q``, ``due``, ``ids``, ``exp``."""
    return f"{KEY_PREFIX}{{ops:{shard}}}:{kind}" + (f":{name}" if name else "")


def _shard_of(id: str) -> str:
    """The shard a job id starts with (``new_job_id``)."""
    return id.partition("~")[0]


class RedisQueue:
    """``Queue`` as Lua scripts, atomic, one round trip per call (two or more per take),
    a route's keys and its jobs' under one hash tag, ``tp:{ops:<shard>}:``::

        job:<id>    hash: the job (``_JOB_FIELDS``; ms times), its holder (ho), hold's
                    end (hu, ms), stream entry (en, '' if none) and the token of its last
                    write (tk)
        took:<tk>   string: the id a take (its token) handed out, for its hold
        ev:<id>     stream: its events, entry 0-<seq>
        q           stream: the route's queued jobs (field id), read by the group 'workers'
        due         sorted set: jobs queued again, scored by when due (ms)
        ids         sorted set: the route's job ids, score 0 (``list`` pages by id)
        exp         sorted set: job ids by expiry (ms): ``submit`` drops a few expired
                    ones from both indexes each time

    and ``tp:{ops}:routes`` (set: the routes, for ``list`` and ``sweep``) and the pub/sub
    channel ``tp:{ops}:changes`` (the id of each job that changed). The job and its events
    expire ``keep`` after each change (PEXPIRE). A take is two steps, each a script on
    the route's keys: the next entry (``next_job``: XREADGROUP, else XAUTOCLAIM of one
    idle for ``visibility``), then its job (``hand_job``: held, or the entry dropped if its
    job ended); an entry read and not handed stays pending for the worker and is taken
    over like any other. ``hold`` resets its idle time (XCLAIM JUSTID); the job's ``hu``
    decides whether a hold lapsed. A move back to QUEUED or to an end drops the entry
    (XACK, XDEL). Needs Redis 6.2 or later (XAUTOCLAIM, ZRANGE BYSCORE and BYLEX,
    exclusive XRANGE).
    """

    def __init__(self, store: RedisStore) -> None:
        self._store = store
        self._routes: set[str] = set()  # known to be in ROUTES_KEY

    async def submit(self, job: Job) -> Job:
        shard = job_shard(job.route)
        if _shard_of(job.id) != shard:
            raise ValueError(f"job {job.id} is not an id of route {job.route} (new_job_id)")
        if job.route not in self._routes:
            await self._store._command("SADD", ROUTES_KEY, job.route, resend=True)
            self._routes.add(job.route)
        keys = [queue_key("job", shard, job.id), queue_key("ev", shard, job.id)]
        keys += [queue_key(kind, shard) for kind in ("q", "ids", "exp")]
        args = (job.id, job.route, job.principal, job.slot, job.name, job.label, job.request)
        reply = await self._store._script(_SUBMIT, keys, *args, _ms(job.keep), _token(), CHANNEL)
        if reply is None:
            raise ValueError(f"job {job.id} exists")
        return _job(reply)

    async def get(self, id: str) -> Job | None:
        key = queue_key("job", _shard_of(id), id)
        reply = await self._store._command("HMGET", key, *_JOB_FIELDS, resend=True)
        return None if reply[0] is None else _job(reply)

    async def events(self, id: str, after: int) -> list[Job] | None:
        shard = _shard_of(id)
        keys = [queue_key("job", shard, id), queue_key("ev", shard, id)]
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
        shard, token, cursor = job_shard(route), _token(), ""
        stream, due = queue_key("q", shard), queue_key("due", shard)
        took = queue_key("took", shard, token)
        for _ in range(TAKE_STEPS):
            reply = await self._store._script(
                _NEXT_JOB, [stream, due, took], worker, _ms(visibility), cursor
            )
            kind = reply[0]
            if kind == b"none":
                return None
            if kind == b"due":
                await self._requeue(shard, [id.decode() for id in reply[1]])
                continue
            entry, id = reply[1].decode(), reply[2].decode()
            if kind == b"old":
                cursor = reply[3].decode()
            keys = [queue_key("job", shard, id), stream, took]
            args = (entry, id, worker, _ms(visibility), int(kind == b"new"), token)
            handed = await self._store._script(_HAND_JOB, keys, *args)
            if handed[0] == 1:
                return _job(handed[1])
            if kind == b"took" or cursor == "0-0":  # held no more; every idle entry seen
                return None
        return None

    async def _requeue(self, shard: str, ids: list[str]) -> None:
        """Retries now due go into the route's stream (one script per job, sent at once)."""
        stream, due = queue_key("q", shard), queue_key("due", shard)
        await asyncio.gather(
            *(
                self._store._script(_REQUEUE_JOB, [queue_key("job", shard, id), stream, due], id)
                for id in ids
            )
        )

    async def hold(self, id: str, worker: str, visibility: float) -> bool:
        shard = _shard_of(id)
        keys = [queue_key("job", shard, id), queue_key("q", shard)]
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
        shard = _shard_of(id)
        keys = [queue_key("job", shard, id), queue_key("ev", shard, id)]
        keys += [queue_key(kind, shard) for kind in ("q", "due", "exp")]
        expected = "," + ",".join(s.value for s in expect) + ","
        ms = max(int(due * 1000), 0)
        args = (expected, state.value, worker or "", ms, _token(), CHANNEL, *fields)
        if not sent:
            reply = await self._store._script(_MOVE_JOB, keys, *args)
            return None if reply is None else _job(reply)
        # The mark that the call is being sent is what keeps a taker from sending it again
        # (every attempt renews the record as the same owner): confirmed as a claim is.
        reply, unconfirmed = await self._store._durable(_MOVE_JOB, keys, *args)
        if reply is None or unconfirmed is None:
            return None if reply is None else _job(reply)
        previous = None if attempts is None else attempts - 1
        with contextlib.suppress(StoreError):  # back in the queue, not sent; else it lapses
            await self.move(id, frozenset({state}), JobState.QUEUED, attempts=previous, sent=False)
        raise StoreUnavailable(
            f"redis store: the job's start was not confirmed ({unconfirmed}); not sent"
        )

    async def list(self, state: JobState | None, cursor: str, count: int) -> tuple[str, list[Job]]:
        """Route by route (by shard), each route's jobs by id; the cursor is the last id
        listed, or ``<shard>~`` to start a route."""
        shards = sorted({job_shard(r.decode()) for r in await self._routes_stored()})
        shard = _shard_of(cursor) if cursor else (shards[0] if shards else "")
        if shard not in shards:
            return "", []
        start = "(" + cursor if cursor else "-"
        count = max(count, 1)
        ids = await self._store._command(
            "ZRANGE", queue_key("ids", shard), start, "+", "BYLEX", "LIMIT", 0, count, resend=True
        )
        replies = await asyncio.gather(
            *(
                self._store._command(
                    "HMGET", queue_key("job", shard, id.decode()), *_JOB_FIELDS, resend=True
                )
                for id in ids
            )
        )
        jobs = [_job([*r[:6], b"", *r[7:]]) for r in replies if r[0] is not None]
        if state is not None:
            jobs = [j for j in jobs if j.state is state]
        if len(ids) == count:
            return ids[-1].decode(), jobs
        later = shards[shards.index(shard) + 1 :]
        return (f"{later[0]}~" if later else ""), jobs

    async def _routes_stored(self) -> Sequence[bytes]:
        return list(await self._store._command("SMEMBERS", ROUTES_KEY, resend=True))

    async def sweep(self) -> int:
        """Delete the consumers with nothing pending that have not read for an hour
        (workers gone); return how many."""
        streams = {queue_key("q", job_shard(r.decode())) for r in await self._routes_stored()}
        deleted = await asyncio.gather(
            *(self._store._script(_SWEEP_JOBS, [s], IDLE_CONSUMER_MS) for s in sorted(streams))
        )
        return sum(int(n) for n in deleted)

    async def changes(self) -> AsyncIterator[str]:
        """Over a connection of its own (SUBSCRIBE), closed when the iterator is."""
        pubsub = await self._store._subscriber()
        try:
            await pubsub.subscribe(CHANNEL)
            while True:
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=None)
                if message is not None:
                    yield message["data"].decode()
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"redis store: {type(exc).__name__}: {exc}") from exc
        finally:
            await pubsub.aclose()  # type: ignore[no-untyped-call,unused-ignore]  # typed from redis 8.2


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
