"""``memory://``: a store in this process's memory, for tests and demos (one process only)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from proxy.store.base import Claim, Record, RecordKey, State

# The largest payload kept, as for Redis (a process's memory is no place for more).
MAX_PAYLOAD_BYTES = 512 * 1024 * 1024


@dataclass(slots=True)
class _Entry:
    record: Record
    expires_at: float
    lease_until: float = 0.0


class MemoryStore:
    """Dictionaries and a monotonic clock; expired entries are dropped when touched or swept.

    Times shown in records (``created_at``, ``updated_at``) are wall-clock seconds.
    """

    max_payload_bytes = MAX_PAYLOAD_BYTES

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._records: dict[RecordKey, _Entry] = {}
        self._scopes: dict[str, set[RecordKey]] = {}
        self._last_in_slot: dict[str, tuple[str, float]] = {}
        self._values: dict[str, tuple[bytes, float]] = {}

    def _live(self, key: RecordKey) -> _Entry | None:
        entry = self._records.get(key)
        if entry is not None and entry.expires_at <= self._clock():
            self._forget(key)
            return None
        return entry

    def _forget(self, key: RecordKey) -> None:
        del self._records[key]
        scope = self._scopes.get(key.scope)
        if scope is not None:
            scope.discard(key)
            if not scope:
                del self._scopes[key.scope]

    def _put(self, key: RecordKey, entry: _Entry) -> None:
        self._records[key] = entry
        self._scopes.setdefault(key.scope, set()).add(key)

    def _view(self, key: RecordKey, entry: _Entry) -> Record:
        r = entry.record  # built field by field: dataclasses.replace costs twice as much
        left = (entry.lease_until if r.state is State.IN_PROGRESS else entry.expires_at) - (
            self._clock()
        )
        ttl = left if left > 0 else 0.0
        return Record(
            r.state, r.fingerprint, r.owner, ttl, r.payload, key, r.created_at, r.updated_at
        )

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
        entry = self._live(key)
        now = self._clock()
        if entry is not None and entry.record.owner != owner:
            lapsed = entry.record.state is State.IN_PROGRESS and entry.lease_until <= now
            if not lapsed:
                return Claim(self._view(key, entry))
            if not reexecute_lapsed:
                entry.record = replace(entry.record, state=State.FAILED, updated_at=time.time())
                return Claim(self._view(key, entry))
        wall = time.time()
        record = Record(State.IN_PROGRESS, fingerprint, owner, lock_ttl, b"", None, wall, wall)
        self._put(key, _Entry(record, now + result_ttl, now + lock_ttl))
        last = self._last_in_slot.get(key.slot)
        self._last_in_slot[key.slot] = (key.name, now + result_ttl)
        previous = last[0] if last and last[1] > now and last[0] != key.name else None
        return Claim(None, previous)

    def _held(self, key: RecordKey, owner: str) -> _Entry | None:
        entry = self._live(key)
        if entry is None or entry.record.owner != owner:
            return None
        return entry

    async def renew(self, key: RecordKey, owner: str, lock_ttl: float, result_ttl: float) -> bool:
        entry = self._held(key, owner)
        if entry is None or entry.record.state is not State.IN_PROGRESS:
            return False
        now = self._clock()
        entry.lease_until = now + lock_ttl
        entry.expires_at = max(entry.expires_at, now + result_ttl)
        entry.record = replace(entry.record, updated_at=time.time())
        return True

    async def complete(
        self,
        key: RecordKey,
        owner: str,
        fingerprint: str,
        state: State,
        payload: bytes,
        result_ttl: float,
    ) -> bool:
        entry = self._live(key)
        if entry is not None and entry.record.owner != owner:
            return False
        wall = time.time()
        created = entry.record.created_at if entry is not None else wall
        record = Record(state, fingerprint, owner, result_ttl, payload, None, created, wall)
        self._put(key, _Entry(record, self._clock() + result_ttl))
        return True

    async def release(self, key: RecordKey, owner: str) -> bool:
        entry = self._held(key, owner)
        if entry is None or not _releasable(entry.record):
            return False
        self._forget(key)
        return True

    async def get(self, key: RecordKey) -> Record | None:
        entry = self._live(key)
        return None if entry is None else self._view(key, entry)

    async def records(self, scope: str) -> list[Record]:
        keys = list(self._scopes.get(scope, ()))
        found = [self._view(k, e) for k in keys if (e := self._live(k)) is not None]
        return sorted(found, key=lambda r: (r.created_at, r.key or ("", "")))

    async def scan(self, cursor: str, count: int) -> tuple[str, list[Record]]:
        keys = sorted(k for k in self._records if "\x00".join(k) > cursor)[: max(count, 1)]
        found = [self._view(k, e) for k in keys if (e := self._live(k)) is not None]
        more = len(keys) == max(count, 1)
        return ("\x00".join(keys[-1]) if more else ""), found

    async def settle(
        self, key: RecordKey, state: State | None, payload: bytes, result_ttl: float
    ) -> bool:
        entry = self._live(key)
        if entry is None or entry.record.state is not State.FAILED:
            return False
        if state is None:
            self._forget(key)
            return True
        record = replace(entry.record, state=state, payload=payload, updated_at=time.time())
        self._put(key, _Entry(record, self._clock() + result_ttl))
        return True

    async def delete(self, key: RecordKey) -> bool:
        if self._live(key) is None:
            return False
        self._forget(key)
        return True

    async def sweep(self) -> int:
        """Drop every expired record; return how many."""
        now = self._clock()
        expired = [k for k, e in self._records.items() if e.expires_at <= now]
        for key in expired:
            self._forget(key)
        for slot in [s for s, (_, exp) in self._last_in_slot.items() if exp <= now]:
            del self._last_in_slot[slot]
        for name in [k for k, (_, exp) in self._values.items() if exp <= now]:
            del self._values[name]
        return len(expired)

    async def put_value(self, key: str, value: bytes, ttl: float) -> None:
        self._values[key] = (value, self._clock() + ttl)

    async def get_value(self, key: str) -> bytes | None:
        found = self._values.get(key)
        if found is None or found[1] <= self._clock():
            self._values.pop(key, None)
            return None
        return found[0]

    async def acquire(self, key: str, owner: str, ttl: float) -> bool:
        held = await self.get_value(f"lock|{key}")
        if held is not None and held != owner.encode():
            return False
        await self.put_value(f"lock|{key}", owner.encode(), ttl)
        return True

    async def unlock(self, key: str, owner: str) -> None:
        if await self.get_value(f"lock|{key}") == owner.encode():
            self._values.pop(f"lock|{key}", None)

    async def open(self) -> None:
        return None

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        return None


def _releasable(record: Record) -> bool:
    """IN_PROGRESS, or its lease lapsed (FAILED with no payload): nothing recorded yet."""
    return record.state is State.IN_PROGRESS or record.lapsed
