"""The store contract: what every backend (memory, sqlite, redis, postgres) must do,
atomically.

A record lives under a ``RecordKey``: ``slot`` names one logical step (route, principal,
plan and step for composite keys; route, principal and a digest for opaque ones) and
``name`` tells apart the records of a step (the args_hash). The slot's part before its
last ``|`` is its *scope*: one plan session of one principal on one route. Each scope
keeps an index of its records (``records``), and each slot the last name claimed in it,
so the proxy can log a replan (the same step executed again with other arguments).

State machine::

    (absent) --claim--> IN_PROGRESS --complete--> COMPLETED | FAILED --result_ttl--> (absent)
                         |   ^    |
                         |   renew (owner only)
                         |        +--lease lapses, then a claim by another owner--> FAILED
                         |                        (or, reexecute_lapsed, its new IN_PROGRESS)
                         +--release (owner only)--> (absent)

An IN_PROGRESS record carries its lease's end, evaluated with the store's own clock
(Redis ``TIME``; PostgreSQL's ``statement_timestamp()``; the host's wall clock for
SQLite; the process's for memory); the record itself lives ``result_ttl`` past its last
write, so a lapsed lease is seen, never mistaken for a free key. A FAILED record with an
empty payload is such a lapsed lease: the proxy renders it as "outcome unknown".

Only the owner token given to ``claim`` may renew, complete or release: a proxy whose
lease was taken over can never overwrite the newer owner's outcome. Its own lapsed lease
(FAILED, empty payload, still its owner) it may still complete or release: its late
outcome is the truth. (A late outcome whose record vanished is still recorded.)
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple, Protocol


class State(StrEnum):
    """The state of one idempotency record."""

    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    FAILED = "failed"


class RecordKey(NamedTuple):
    """Where a record lives: its slot (one step) and its name within the slot."""

    slot: str
    name: str

    @property
    def scope(self) -> str:
        """The slot up to its last ``|``: the plan session (route, principal, plan)."""
        head, sep, _ = self.slot.rpartition("|")
        return head if sep else self.slot

    @property
    def step(self) -> str:
        """The slot after its last ``|``."""
        return self.slot.rpartition("|")[2]


class Record(NamedTuple):
    """A record as read from the store (a tuple: one is built per claim that finds a
    record, e.g. each replay, at a quarter of the cost of a frozen dataclass)."""

    state: State
    fingerprint: str
    owner: str
    ttl: float
    """Seconds left: on the lease while IN_PROGRESS, on the outcome otherwise."""
    payload: bytes = b""
    """The recorded outcome (``outcome.encode``); empty while IN_PROGRESS, and for a
    FAILED record whose lease lapsed."""
    key: RecordKey | None = None
    """Where it lives (set by ``records`` and ``scan``)."""
    created_at: float = 0.0
    """When it was claimed (Unix seconds, the store's clock)."""
    updated_at: float = 0.0
    """When it was last written (claimed, renewed, recorded)."""
    replays: int = 0
    """How many times a claim handed this outcome back to a caller to replay (counted by
    the claim itself, in the same atomic step: see ``Store.claim``)."""

    @property
    def lapsed(self) -> bool:
        """FAILED because the lease of the call lapsed (nobody recorded its outcome)."""
        return self.state is State.FAILED and not self.payload


class Claim(NamedTuple):
    """What ``Store.claim`` found (a tuple: built once per guarded request, at half the
    cost of a frozen dataclass)."""

    record: Record | None
    """None: the caller now owns a fresh IN_PROGRESS record. Else the existing record."""
    previous: str | None = None
    """On a successful claim, the name last claimed in the same slot, if it differs."""

    @property
    def claimed(self) -> bool:
        return self.record is None


@dataclass(frozen=True, slots=True)
class Durability:
    """``store.durability``: a claim or an outcome counts as written only once
    ``replicas`` replicas have it (Redis ``WAIT``; with ``aof``, ``WAITAOF``: in the
    primary's append-only file and in theirs), within ``timeout`` seconds; else the store
    raises ``StoreUnavailable`` (a claim is released and not sent, an outcome journaled)."""

    replicas: int
    timeout: float
    aof: bool = False

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError("durability: replicas must be 1 or more")
        if not self.timeout > 0:  # NaN too
            raise ValueError("durability: timeout must be positive")

    @property
    def timeout_ms(self) -> int:
        return max(int(self.timeout * 1000), 1)

    def describe(self) -> str:
        """``1 replica within 200ms`` (``, in their append-only files``)."""
        replicas = f"{self.replicas} replica" + ("s" if self.replicas > 1 else "")
        files = " (and in the append-only files)" if self.aof else ""
        return f"{replicas}{files} within {self.timeout_ms}ms"


class Store(Protocol):
    """An idempotency store. Every method is atomic; failures raise ``StoreUnavailable``,
    and a write the store answers but refuses (too large, out of memory, too few
    replicas) raises its subclass ``StoreRefused``."""

    max_payload_bytes: int
    """The largest outcome payload the backend can hold; larger ones are never sent."""

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
        """Create an IN_PROGRESS record owned by ``owner`` unless one exists (then return it).

        If the existing record is already owned by ``owner`` and IN_PROGRESS (a retried
        claim whose first answer was lost), it counts as claimed; an outcome ``owner``
        recorded (COMPLETED or FAILED) is returned, never claimed over. An IN_PROGRESS
        record of another owner whose lease has lapsed becomes FAILED (empty payload) and
        is returned, unless ``reexecute_lapsed``: then ``owner`` claims it.

        A finished record returned (COMPLETED or FAILED, also one that lapses now) whose
        fingerprint is ``fingerprint`` is a replay served: its ``replays`` goes up by one
        in the same atomic step, and the record returned shows the new count; unless
        ``replay`` is False (a job's submission, an operator's requeue: they serve
        nothing from it). An IN_PROGRESS record (a 409) or another fingerprint (a 422)
        counts nothing. A fresh claim starts at 0; ``complete`` and ``settle`` keep the
        count.
        """

    async def renew(self, key: RecordKey, owner: str, lock_ttl: float, result_ttl: float) -> bool:
        """Extend the lease by ``lock_ttl`` (and the record's life by ``result_ttl``);
        False if ``owner`` no longer holds it."""

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
        """Record the outcome (COMPLETED or FAILED); False if another owner holds the record,
        or, with ``replace_outcome=False``, if the record already holds an outcome (a job's
        taker concludes "unknown" only where its worker recorded nothing; a lapsed lease,
        FAILED with an empty payload, holds none).

        Given ``successor``, the record is written as ``successor``'s: ``owner`` can no
        longer write it (a job's taker fences the attempt it takes over, so that
        attempt's late answer never replaces the outcome the taker recorded).

        If the record is gone (the lease lapsed, or the store lost it) and nobody took the
        key over, the outcome is written anyway: it is the truth, and keeping it is what
        stops a second execution.
        """

    async def release(self, key: RecordKey, owner: str) -> bool:
        """Delete an IN_PROGRESS (or lapsed) record held by ``owner``; False if not held."""

    async def get(self, key: RecordKey) -> Record | None:
        """Read a record, or None."""

    async def records(self, scope: str) -> list[Record]:
        """Every live record of one scope (plan session), from its index, oldest first."""

    async def scan(self, cursor: str, count: int) -> tuple[str, list[Record]]:
        """About ``count`` records from ``cursor`` ("" to start); the next cursor, "" at the
        end. For operators: bounded work per call, however many records there are."""

    async def settle(
        self,
        key: RecordKey,
        state: State | None,
        payload: bytes,
        result_ttl: float,
        *,
        owner: str | None = None,
    ) -> bool:
        """Resolve a FAILED record: record it as ``state`` with ``payload``, or delete it
        (``state`` None); False unless the record is FAILED now (and, given ``owner``,
        still the one of that owner: not a newer failure of another call)."""

    async def delete(self, key: RecordKey) -> bool:
        """Delete a record whatever its state; False if there was none."""

    async def put_value(self, key: str, value: bytes, ttl: float) -> None:
        """Keep ``value`` under ``key`` for ``ttl`` seconds (shared values, e.g. tokens)."""

    async def get_value(self, key: str) -> bytes | None:
        """The value under ``key``, or None if absent or expired."""

    async def acquire(self, key: str, owner: str, ttl: float) -> bool:
        """Take the lock ``key`` for ``ttl`` seconds unless another owner holds it."""

    async def unlock(self, key: str, owner: str) -> None:
        """Give the lock back if ``owner`` still holds it."""

    async def open(self) -> None:
        """Prepare the store (files, schema); raise ``StoreUnavailable`` if it cannot be used."""

    async def sweep(self) -> int:
        """Delete expired records that the backend does not expire by itself; return how many."""

    async def ping(self) -> None:
        """Raise ``StoreUnavailable`` unless the store answers."""

    async def close(self) -> None:
        """Release connections and files."""
