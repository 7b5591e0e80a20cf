"""``memory://``: a store in this process's memory, for tests and demos (one process only)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

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

K = TypeVar("K")
V = TypeVar("V")

# The largest payload kept, as for Redis (a process's memory is no place for more).
MAX_PAYLOAD_BYTES = 512 * 1024 * 1024


@dataclass(slots=True)
class _Entry:
    """One record, its fields kept in place (``_view`` makes the ``Record`` a caller
    reads): one object per record, changed by assignment."""

    state: State
    fingerprint: str
    owner: str
    expires_at: float
    lease_until: float = 0.0
    payload: bytes = b""
    created_at: float = 0.0
    updated_at: float = 0.0
    replays: int = 0

    @property
    def releasable(self) -> bool:
        """IN_PROGRESS, or its lease lapsed (FAILED with no payload): nothing recorded yet."""
        return self.state is State.IN_PROGRESS or (self.state is State.FAILED and not self.payload)


class MemoryStore:
    """Dictionaries and a monotonic clock; expired entries are dropped when touched or swept.

    Times shown in records (``created_at``, ``updated_at``) are wall-clock seconds.
    """

    max_payload_bytes = MAX_PAYLOAD_BYTES

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._records: dict[RecordKey, _Entry] = {}
        self._scopes: dict[str, RecordKey | set[RecordKey]] = {}
        """Each scope's records: the key of its only one, or the set of them (most scopes
        hold one record: no set for them)."""
        self._last_in_slot: dict[str, tuple[str, float]] = {}
        self._values: dict[str, tuple[bytes, float]] = {}
        self._queue: MemoryQueue | None = None
        self._buckets: MemoryBuckets | None = None
        self._locks: MemoryLocks | None = None

    def _live(self, key: RecordKey) -> _Entry | None:
        entry = self._records.get(key)
        if entry is not None and entry.expires_at <= self._clock():
            self._forget(key)
            return None
        return entry

    def _forget(self, key: RecordKey) -> None:
        del self._records[key]
        scope = key.scope
        held = self._scopes.get(scope)
        if isinstance(held, set):
            held.discard(key)
            if not held:
                del self._scopes[scope]
        elif held == key:
            del self._scopes[scope]

    def _put(self, key: RecordKey, entry: _Entry) -> None:
        self._records[key] = entry
        scope = key.scope
        held = self._scopes.get(scope)
        if held is None:
            self._scopes[scope] = key
        elif isinstance(held, set):
            held.add(key)
        elif held != key:
            self._scopes[scope] = {held, key}

    def _view(self, key: RecordKey, entry: _Entry) -> Record:
        left = (entry.lease_until if entry.state is State.IN_PROGRESS else entry.expires_at) - (
            self._clock()
        )
        return Record(
            entry.state,
            entry.fingerprint,
            entry.owner,
            left if left > 0 else 0.0,
            entry.payload,
            key,
            entry.created_at,
            entry.updated_at,
            entry.replays,
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
        replay: bool = True,
    ) -> Claim:
        entry = self._live(key)
        now = self._clock()
        if entry is not None:
            if entry.state is not State.IN_PROGRESS:  # an outcome: never claimed over
                if replay and entry.fingerprint == fingerprint:
                    entry.replays += 1
                return Claim(self._view(key, entry))
            if entry.owner != owner:
                if entry.lease_until > now:
                    return Claim(self._view(key, entry))
                if not reexecute_lapsed:
                    entry.state, entry.updated_at = State.FAILED, time.time()
                    if replay and entry.fingerprint == fingerprint:
                        entry.replays += 1
                    return Claim(self._view(key, entry))
        wall = time.time()
        claimed = _Entry(
            State.IN_PROGRESS, fingerprint, owner, now + result_ttl, now + lock_ttl, b"", wall, wall
        )
        self._put(key, claimed)
        last = self._last_in_slot.get(key.slot)
        self._last_in_slot[key.slot] = (key.name, now + result_ttl)
        previous = last[0] if last and last[1] > now and last[0] != key.name else None
        return Claim(None, previous)

    def _held(self, key: RecordKey, owner: str) -> _Entry | None:
        entry = self._live(key)
        if entry is None or entry.owner != owner:
            return None
        return entry

    async def renew(self, key: RecordKey, owner: str, lock_ttl: float, result_ttl: float) -> bool:
        entry = self._held(key, owner)
        if entry is None or entry.state is not State.IN_PROGRESS:
            return False
        now = self._clock()
        entry.lease_until = now + lock_ttl
        entry.expires_at = max(entry.expires_at, now + result_ttl)
        entry.updated_at = time.time()
        return True

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
        entry = self._live(key)
        if entry is not None and entry.owner != owner:
            return False
        if not replace_outcome and entry is not None and not entry.releasable:
            return False
        wall = time.time()
        expires = self._clock() + result_ttl
        if entry is None:  # a late outcome whose record vanished is still recorded
            entry = _Entry(state, fingerprint, owner, expires, created_at=wall)
            self._put(key, entry)
        # in place: in its scope's index already, its creation time and replays kept
        entry.state, entry.fingerprint, entry.owner = state, fingerprint, successor or owner
        entry.expires_at, entry.lease_until, entry.payload = expires, 0.0, payload
        entry.updated_at = wall
        return True

    async def release(self, key: RecordKey, owner: str) -> bool:
        entry = self._held(key, owner)
        if entry is None or not entry.releasable:
            return False
        self._forget(key)
        return True

    async def get(self, key: RecordKey) -> Record | None:
        entry = self._live(key)
        return None if entry is None else self._view(key, entry)

    async def records(self, scope: str) -> list[Record]:
        held = self._scopes.get(scope)
        keys = [] if held is None else list(held) if isinstance(held, set) else [held]
        found = [self._view(k, e) for k in keys if (e := self._live(k)) is not None]
        return sorted(found, key=lambda r: (r.created_at, r.key or ("", "")))

    async def scan(self, cursor: str, count: int) -> tuple[str, list[Record]]:
        keys = sorted(k for k in self._records if "\x00".join(k) > cursor)[: max(count, 1)]
        found = [self._view(k, e) for k in keys if (e := self._live(k)) is not None]
        more = len(keys) == max(count, 1)
        return ("\x00".join(keys[-1]) if more else ""), found

    async def settle(
        self,
        key: RecordKey,
        state: State | None,
        payload: bytes,
        result_ttl: float,
        *,
        owner: str | None = None,
    ) -> bool:
        entry = self._live(key)
        if entry is None or entry.state is not State.FAILED:
            return False
        if owner is not None and entry.owner != owner:
            return False
        if state is None:
            self._forget(key)
            return True
        entry.state, entry.payload, entry.updated_at = state, payload, time.time()
        entry.expires_at, entry.lease_until = self._clock() + result_ttl, 0.0
        return True

    async def delete(self, key: RecordKey) -> bool:
        if self._live(key) is None:
            return False
        self._forget(key)
        return True

    async def sweep(self) -> int:
        """Drop every expired record, slot pointer and value, and the rate buckets, slot
        leases, pauses and locks whose time has passed; return how many records."""
        now = self._clock()
        if self._buckets is not None:
            self._buckets.sweep()
        if self._locks is not None:
            self._locks.sweep()
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

    def buckets(self) -> MemoryBuckets:
        """The rate buckets of this process (one per store, swept with it), on the same
        clock."""
        if self._buckets is None:
            self._buckets = MemoryBuckets(self._clock)
        return self._buckets

    def locks(self) -> MemoryLocks:
        """The resource locks and versions of this process (one per store, swept with
        it), on the same clock."""
        if self._locks is None:
            self._locks = MemoryLocks(self._clock)
        return self._locks

    def queue(self) -> MemoryQueue:
        """The job queue of this process (one per store), on the wall clock: its times
        are shown to callers."""
        if self._queue is None:
            # an injected clock (tests) stands for the wall clock too
            self._queue = MemoryQueue(time.time if self._clock is time.monotonic else self._clock)
        return self._queue

    async def open(self) -> None:
        return None

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        return None


class MemoryBuckets:
    """``Buckets`` in this process's memory (one process only): tats, slot leases, pauses.

    Entries whose time has passed are dropped when touched, and all of them by ``sweep``:
    a bucket at rest (its tat passed), a lapsed lease or a pause that ended is as good as
    absent.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._tats: dict[tuple[str, str], float] = {}
        self._slots: dict[tuple[str, str], dict[str, float]] = {}
        self._pauses: dict[tuple[str, str], float] = {}

    async def take(
        self,
        group: str,
        rates: Sequence[Rate],
        slots: Sequence[Slots],
        owner: str,
        slot_ttl: float,
        scope: str = "",
    ) -> Admission:
        now = self._clock()
        paused = self._pauses.get((group, scope), 0.0) - now
        if paused > 0:
            return Admission(False, paused, 0.0)
        wait = 0.0
        states, tats = [], []
        for rate in rates:
            tat, over, state = gcra(self._tats.get((group, rate.key), now), now, rate)
            wait = max(wait, over)
            tats.append(tat)
            states.append(state)
        free, full = [], False
        for slot in slots:
            held = self._live_slots(group, slot.key, now)
            left = slot.capacity - len(held) - (owner not in held)
            full = full or left < 0
            free.append(left)
        if wait > 0 or full:
            return Admission(False, 0.0, wait, tuple(states), tuple(free))
        for rate, tat in zip(rates, tats, strict=True):
            self._tats[(group, rate.key)] = tat
        for slot in slots:
            self._slots.setdefault((group, slot.key), {})[owner] = now + slot_ttl
        return Admission(True, 0.0, 0.0, tuple(states), tuple(free))

    def _live_slots(self, group: str, key: str, now: float) -> dict[str, float]:
        held = self._slots.get((group, key), {})
        for owner in [o for o, until in held.items() if until <= now]:
            del held[owner]
        return held

    async def finish(
        self, group: str, changes: Sequence[tuple[Rate, float]], slots: Sequence[str], owner: str
    ) -> None:
        now = self._clock()
        for rate, units in changes:
            tat = self._tats.get((group, rate.key), now)
            self._tats[(group, rate.key)] = adjusted(tat, now, rate, units)
        for key in slots:
            self._slots.get((group, key), {}).pop(owner, None)

    async def renew(self, group: str, slots: Sequence[str], owner: str, ttl: float) -> bool:
        now = self._clock()
        kept = True
        for key in slots:
            held = self._live_slots(group, key, now)
            if owner in held:
                held[owner] = now + ttl
            else:
                kept = False
        return kept

    async def pause(self, group: str, seconds: float, scope: str = "") -> None:
        now = self._clock()
        for lapsed in [k for k, until in self._pauses.items() if until <= now]:
            del self._pauses[lapsed]  # one entry per caller paused now, not per caller ever
        key = (group, scope)
        self._pauses[key] = max(self._pauses.get(key, 0.0), now + seconds)

    async def state(self, group: str, limit: int) -> GroupState:
        now = self._clock()
        rates = [Entry(k, tat - now) for (g, k), tat in self._tats.items() if g == group]
        slots = []
        for (g, key), held in self._slots.items():
            live = [until - now for until in held.values() if until > now] if g == group else []
            if live:
                slots.append(Entry(key, max(live), len(live)))
        pauses = [Entry(k, until - now) for (g, k), until in self._pauses.items() if g == group]
        return group_state(rates, slots, pauses, limit, seen=True)

    def sweep(self) -> int:
        """Drop the buckets at rest, the lapsed slot leases and the ended pauses; return
        how many entries."""
        now = self._clock()
        dropped = _drop(self._tats, lambda tat: tat <= now)
        for held in self._slots.values():
            dropped += _drop(held, lambda until: until <= now)
        _drop(self._slots, lambda held: not held)
        return dropped + _drop(self._pauses, lambda until: until <= now)

    def __len__(self) -> int:
        """Entries held: buckets, slot leases and pauses."""
        return len(self._tats) + sum(map(len, self._slots.values())) + len(self._pauses)


class MemoryLocks:
    """``Locks`` in this process's memory (one process only): leases, a counter per scope
    (never dropped: it must only grow), versions that expire ``ttl`` after their last use.
    Entries are kept in the order of their last use, so the lapsed ones are at the front:
    each change drops a few of them."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._counters: dict[str, int] = {}
        self._held: dict[tuple[str, str], _Held] = {}
        self._versions: dict[tuple[str, str], _Versioned] = {}

    def _draw(self, scope: str) -> int:
        self._counters[scope] = self._counters.get(scope, counter_start()) + 1
        return self._counters[scope]

    def _holder(self, scope: str, key: str, now: float) -> _Held | None:
        held = self._held.get((scope, key))
        return None if held is None or held.until <= now else held

    async def acquire(self, scope: str, key: str, owner: str, ttl: float) -> Grant:
        now = self._clock()
        held = self._holder(scope, key, now)
        if held is not None and held.owner != owner:
            return Grant(None, held.until - now)
        token = self._draw(scope) if held is None else held.token
        _touch(self._held, (scope, key), _Held(owner, now + ttl, token), now)
        return Grant(token)

    async def renew(self, scope: str, key: str, owner: str, ttl: float) -> bool:
        now = self._clock()
        held = self._holder(scope, key, now)
        if held is None or held.owner != owner:
            return False
        _touch(self._held, (scope, key), _Held(owner, now + ttl, held.token), now)
        return True

    async def release(self, scope: str, key: str, owner: str) -> bool:
        held = self._holder(scope, key, self._clock())
        if held is None or held.owner != owner:
            return False
        del self._held[(scope, key)]
        return True

    def _entry(self, scope: str, key: str, now: float) -> _Versioned:
        entry = self._versions.get((scope, key))
        if entry is None or entry.until <= now:
            return _Versioned(self._draw(scope), False, "", now)
        return entry

    def _keep(self, scope: str, key: str, entry: _Versioned, ttl: float) -> Version:
        now = self._clock()
        entry.until = now + ttl
        _touch(self._versions, (scope, key), entry, now)
        return Version(entry.number, entry.written, entry.pending != "")

    async def version(self, scope: str, key: str, ttl: float) -> Version:
        return self._keep(scope, key, self._entry(scope, key, self._clock()), ttl)

    async def begin(self, scope: str, key: str, owner: str, ttl: float) -> Version:
        entry = self._entry(scope, key, self._clock())
        if entry.pending not in ("", owner):  # a write that never settled may have happened
            entry = _Versioned(self._draw(scope), True, "", 0.0)
        entry.pending = owner
        return self._keep(scope, key, entry, ttl)

    async def settle(self, scope: str, key: str, owner: str, wrote: bool, ttl: float) -> int | None:
        entry = self._versions.get((scope, key))
        if entry is None or entry.until <= self._clock() or entry.pending != owner:
            return None
        entry.pending = ""
        if wrote:
            entry.number, entry.written = self._draw(scope), True
        return self._keep(scope, key, entry, ttl).number

    async def held(self, scope: str, limit: int) -> LocksHeld:
        now = self._clock()
        found = [
            HeldLock(key, held.token, held.until - now)
            for (s, key), held in self._held.items()
            if s == scope
        ]
        return locks_held(found, limit, seen=True)

    def sweep(self) -> int:
        """Drop the lapsed locks and versions (not the counters); return how many."""
        now = self._clock()
        return _drop(self._held, lambda held: held.until <= now) + _drop(
            self._versions, lambda entry: entry.until <= now
        )

    def __len__(self) -> int:
        """Locks held, or lapsed and not yet dropped (counters and versions aside)."""
        return len(self._held)


@dataclass(slots=True)
class _Held:
    owner: str
    until: float
    token: int


@dataclass(slots=True)
class _Versioned:
    number: int
    written: bool
    pending: str
    """The owner of a write sent and not settled yet; "" if none."""
    until: float


# How many lapsed entries one change of a lock or version drops at most.
SWEEP_EACH = 16


_E = TypeVar("_E", _Held, _Versioned)


def _touch(entries: dict[tuple[str, str], _E], key: tuple[str, str], entry: _E, now: float) -> None:
    """Put ``entry`` last (the order of last use), and drop a few lapsed ones at the front
    (with ttls that differ, one that lapses behind a longer one waits for it)."""
    entries.pop(key, None)
    entries[key] = entry
    for _ in range(SWEEP_EACH):
        first = next(iter(entries))
        if entries[first].until > now:
            return
        del entries[first]


def _drop(entries: dict[K, V], gone: Callable[[V], bool]) -> int:
    """Delete the entries whose value is ``gone``; return how many."""
    keys = [key for key, value in entries.items() if gone(value)]
    for key in keys:
        del entries[key]
    return len(keys)


class MemoryQueue:
    """``Queue`` in this process's memory (one process only): jobs, their events, holds.
    Ended jobs and their events are dropped ``keep`` seconds after their last change."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._jobs: dict[str, Job] = {}
        self._events: dict[str, list[Job]] = {}
        self._holds: dict[str, tuple[str, float]] = {}
        self._subscribers: set[asyncio.Queue[str]] = set()

    def _live(self, id: str) -> Job | None:
        job = self._jobs.get(id)
        if job is not None and job.updated_at + job.keep <= self._clock():
            del self._jobs[id]
            self._events.pop(id, None)
            self._holds.pop(id, None)
            return None
        return job

    def _changed(self, job: Job) -> Job:
        self._jobs[job.id] = job
        self._events.setdefault(job.id, []).append(replace(job, request=b""))
        for subscriber in self._subscribers:
            subscriber.put_nowait(job.id)
        return job

    async def submit(self, job: Job) -> Job:
        if self._live(job.id) is not None:
            raise ValueError(f"job {job.id} exists")
        now = self._clock()
        queued = replace(job, state=JobState.QUEUED, created_at=now, updated_at=now, due=now, seq=1)
        return self._changed(queued)

    async def get(self, id: str) -> Job | None:
        return self._live(id)

    async def events(self, id: str, after: int) -> list[Job] | None:
        if self._live(id) is None:
            return None
        return [event for event in self._events.get(id, []) if event.seq > after]

    def _held(self, id: str, now: float) -> tuple[str, float] | None:
        hold = self._holds.get(id)
        return hold if hold is not None and hold[1] > now else None

    async def take(self, route: str, worker: str, visibility: float) -> Job | None:
        now = self._clock()
        lapsed = None
        for id in list(self._jobs):
            job = self._live(id)
            if job is None or job.route != route or job.state.terminal:
                continue
            if self._held(id, now) is not None:
                continue
            if id in self._holds:  # held once, and the hold lapsed
                lapsed = lapsed or job
            elif job.state is JobState.QUEUED and job.due <= now:
                self._holds[id] = (worker, now + visibility)
                return job
        if lapsed is not None:
            self._holds[lapsed.id] = (worker, now + visibility)
        return lapsed

    async def hold(self, id: str, worker: str, visibility: float) -> bool:
        now = self._clock()
        job = self._live(id)
        hold = self._held(id, now)
        if job is None or job.state.terminal or hold is None or hold[0] != worker:
            return False
        self._holds[id] = (worker, now + visibility)
        return True

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
        now = self._clock()
        job = self._live(id)
        if job is None or job.state not in expect:
            return None
        if worker is not None:
            hold = self._held(id, now)
            if hold is None or hold[0] != worker:
                return None
        moved = replace(
            job,
            state=state,
            attempts=job.attempts if attempts is None else attempts,
            sent=job.sent if sent is None else sent,
            error=job.error if error is None else error,
            updated_at=now,
            due=now + due if state is JobState.QUEUED else job.due,
            seq=job.seq + 1,
            request=b"" if state.spent else job.request,
        )
        if state is not JobState.RUNNING:
            self._holds.pop(id, None)
        return self._changed(moved)

    async def list(self, state: JobState | None, cursor: str, count: int) -> tuple[str, list[Job]]:
        ids = sorted(self._jobs)
        start = 0 if not cursor else next((i for i, id in enumerate(ids) if id > cursor), len(ids))
        page: list[Job] = []
        for id in ids[start:]:
            job = self._live(id)
            if job is not None and (state is None or job.state is state):
                page.append(replace(job, request=b""))
            if len(page) >= count:
                return id, page
        return "", page

    async def changes(self) -> AsyncIterator[str]:
        subscriber: asyncio.Queue[str] = asyncio.Queue()
        self._subscribers.add(subscriber)
        try:
            while True:
                yield await subscriber.get()
        finally:
            self._subscribers.discard(subscriber)
