"""``memory://``: a store in this process's memory, for tests and demos (one process only)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from proxy.store.base import Claim, Record, RecordKey, State


@dataclass(slots=True)
class _Entry:
    record: Record
    expires_at: float


# The largest payload kept, as for Redis (a process's memory is no place for more).
MAX_PAYLOAD_BYTES = 512 * 1024 * 1024


class MemoryStore:
    """Dictionaries and a monotonic clock; expired entries are dropped when touched or swept."""

    max_payload_bytes = MAX_PAYLOAD_BYTES

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._records: dict[RecordKey, _Entry] = {}
        self._last_in_slot: dict[str, tuple[str, float]] = {}
        self._values: dict[str, tuple[bytes, float]] = {}

    def _live(self, key: RecordKey) -> _Entry | None:
        entry = self._records.get(key)
        if entry is not None and entry.expires_at <= self._clock():
            del self._records[key]
            return None
        return entry

    def _view(self, entry: _Entry) -> Record:
        return replace(entry.record, ttl=max(entry.expires_at - self._clock(), 0.0))

    async def claim(
        self, key: RecordKey, fingerprint: str, owner: str, lock_ttl: float, result_ttl: float
    ) -> Claim:
        entry = self._live(key)
        if entry is not None and entry.record.owner != owner:
            return Claim(self._view(entry))
        now = self._clock()
        record = Record(State.IN_PROGRESS, fingerprint, owner, lock_ttl)
        self._records[key] = _Entry(record, now + lock_ttl)
        last = self._last_in_slot.get(key.slot)
        self._last_in_slot[key.slot] = (key.name, now + result_ttl)
        previous = last[0] if last and last[1] > now and last[0] != key.name else None
        return Claim(None, previous)

    def _held(self, key: RecordKey, owner: str) -> _Entry | None:
        entry = self._live(key)
        if entry is None or entry.record.owner != owner:
            return None
        return entry

    async def renew(self, key: RecordKey, owner: str, lock_ttl: float) -> bool:
        entry = self._held(key, owner)
        if entry is None or entry.record.state is not State.IN_PROGRESS:
            return False
        entry.expires_at = self._clock() + lock_ttl
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
        record = Record(state, fingerprint, owner, result_ttl, payload)
        self._records[key] = _Entry(record, self._clock() + result_ttl)
        return True

    async def release(self, key: RecordKey, owner: str) -> bool:
        entry = self._held(key, owner)
        if entry is None or entry.record.state is not State.IN_PROGRESS:
            return False
        del self._records[key]
        return True

    async def get(self, key: RecordKey) -> Record | None:
        entry = self._live(key)
        return None if entry is None else self._view(entry)

    async def sweep(self) -> int:
        """Drop every expired record; return how many."""
        now = self._clock()
        expired = [k for k, e in self._records.items() if e.expires_at <= now]
        for key in expired:
            del self._records[key]
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
