"""``redis://`` and ``rediss://``: the store shared by replicas.

One round trip per operation: each is a Lua script (EVALSHA), atomic on the server.
The keys of one step share a hash tag, ``tp:{<slot>}:...``, so a Redis Cluster keeps
them in one hash slot and the scripts stay legal there. Expiry is Redis's own.

Keys::

    tp:{<slot>}:r:<name>   hash: st (state), fp (fingerprint), ow (owner), pl (payload)
    tp:{<slot>}:last       string: the last name claimed in the slot (to log replans)
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from redis.asyncio import Redis
from redis.backoff import ExponentialBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from proxy.errors import StoreError, StoreUnavailable
from proxy.store.base import Claim, Record, RecordKey, State

T = TypeVar("T")

KEY_PREFIX = "tp:"
# Connection defaults; query parameters of the URL (e.g. ?socket_timeout=5) win.
SOCKET_CONNECT_TIMEOUT = 1.0
SOCKET_TIMEOUT = 2.0
# Retries of a command on a connection error: cheap, because every script is
# idempotent for the same owner token.
RETRIES = 2

_CLAIM = """
local r = redis.call('HMGET', KEYS[1], 'st', 'fp', 'ow', 'pl')
if r[1] and r[3] ~= ARGV[3] then
  return {0, r[1], r[2], r[3], r[4] or '', redis.call('PTTL', KEYS[1])}
end
redis.call('HSET', KEYS[1], 'st', 'in_progress', 'fp', ARGV[2], 'ow', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
local prev = redis.call('SET', KEYS[2], ARGV[1], 'GET', 'PX', ARGV[5])
return {1, prev or ''}
"""

_RENEW = """
local r = redis.call('HMGET', KEYS[1], 'st', 'ow')
if r[1] ~= 'in_progress' or r[2] ~= ARGV[1] then return 0 end
return redis.call('PEXPIRE', KEYS[1], ARGV[2])
"""

_COMPLETE = """
local ow = redis.call('HGET', KEYS[1], 'ow')
if ow and ow ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'st', ARGV[2], 'pl', ARGV[3], 'fp', ARGV[5], 'ow', ARGV[1])
return redis.call('PEXPIRE', KEYS[1], ARGV[4])
"""

_RELEASE = """
local r = redis.call('HMGET', KEYS[1], 'st', 'ow')
if r[1] ~= 'in_progress' or r[2] ~= ARGV[1] then return 0 end
return redis.call('DEL', KEYS[1])
"""


def _ms(seconds: float) -> int:
    return max(int(seconds * 1000), 1)


def record_key(key: RecordKey) -> str:
    """The Redis key of a record."""
    return f"{KEY_PREFIX}{{{key.slot}}}:r:{key.name}"


def slot_key(key: RecordKey) -> str:
    """The Redis key that remembers the last name claimed in the record's slot."""
    return f"{KEY_PREFIX}{{{key.slot}}}:last"


class RedisStore:
    """Lua scripts over one pooled ``redis.asyncio`` client (hiredis parser when installed)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._redis: Redis = Redis.from_url(
            url,
            socket_connect_timeout=SOCKET_CONNECT_TIMEOUT,
            socket_timeout=SOCKET_TIMEOUT,
            retry=Retry(ExponentialBackoff(cap=0.2, base=0.02), RETRIES),
        )
        self._claim = self._redis.register_script(_CLAIM)
        self._renew = self._redis.register_script(_RENEW)
        self._complete = self._redis.register_script(_COMPLETE)
        self._release = self._redis.register_script(_RELEASE)

    async def _call(self, command: Callable[[], Awaitable[T]]) -> T:
        try:
            return await command()
        except RedisError as exc:
            raise StoreUnavailable(f"redis store: {type(exc).__name__}: {exc}") from exc
        except OSError as exc:
            raise StoreUnavailable(f"redis store: {exc}") from exc

    async def claim(
        self, key: RecordKey, fingerprint: str, owner: str, lock_ttl: float, result_ttl: float
    ) -> Claim:
        keys = [record_key(key), slot_key(key)]
        args: list[str | int | bytes] = [
            key.name,
            fingerprint,
            owner,
            _ms(lock_ttl),
            _ms(result_ttl),
        ]
        reply: list[Any] = await self._call(lambda: self._claim(keys=keys, args=args))
        if reply[0] == 1:
            previous = reply[1].decode() if reply[1] else ""
            return Claim(None, previous if previous and previous != key.name else None)
        _, state, fp, ow, payload, pttl = reply
        try:
            record = Record(State(state.decode()), fp.decode(), ow.decode(), pttl / 1000, payload)
        except (ValueError, AttributeError) as exc:
            raise StoreError(f"redis store: malformed record at {keys[0]}") from exc
        return Claim(record)

    async def renew(self, key: RecordKey, owner: str, lock_ttl: float) -> bool:
        args: list[str | int] = [owner, _ms(lock_ttl)]
        reply = await self._call(lambda: self._renew(keys=[record_key(key)], args=args))
        return bool(reply)

    async def complete(
        self,
        key: RecordKey,
        owner: str,
        fingerprint: str,
        state: State,
        payload: bytes,
        result_ttl: float,
    ) -> bool:
        args: list[str | int | bytes] = [owner, state.value, payload, _ms(result_ttl), fingerprint]
        reply = await self._call(lambda: self._complete(keys=[record_key(key)], args=args))
        return bool(reply)

    async def release(self, key: RecordKey, owner: str) -> bool:
        reply = await self._call(lambda: self._release(keys=[record_key(key)], args=[owner]))
        return bool(reply)

    async def get(self, key: RecordKey) -> Record | None:
        name = record_key(key)

        async def read() -> list[Any]:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.hmget(name, "st", "fp", "ow", "pl")
                pipe.pttl(name)
                return await pipe.execute()

        (state, fp, ow, payload), pttl = await self._call(read)
        if state is None or pttl < 0:
            return None
        return Record(State(state.decode()), fp.decode(), ow.decode(), pttl / 1000, payload or b"")

    async def sweep(self) -> int:
        """Redis expires keys itself."""
        return 0

    async def open(self) -> None:
        """Nothing to do: connections are made on first use, and remade after a failure."""

    async def ping(self) -> None:
        await self._call(self._redis.ping)

    async def close(self) -> None:
        await self._redis.aclose()
