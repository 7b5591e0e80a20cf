"""The store contract: what every backend (memory, sqlite, redis) must do, atomically.

A record lives under a ``RecordKey``: ``slot`` groups the records of one logical
step (route, principal, plan and step for composite keys) and ``name`` tells them
apart (the args_hash). Each slot remembers the last name claimed in it, so the proxy
can log a replan (the same step executed again with other arguments).

State machine::

    (absent) --claim--> IN_PROGRESS --complete--> COMPLETED | FAILED --result_ttl--> (absent)
                         |   ^
                         |   renew (owner only)
                         +--release (owner only)--> (absent)
                         +--lock_ttl passes without renew--> (absent)

Only the owner token given to ``claim`` may renew, complete or release: a proxy whose
lease expired and was taken over can never overwrite the newer owner's outcome.
(A late outcome whose record vanished and was not taken over is still recorded.)
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


@dataclass(frozen=True, slots=True)
class Record:
    """A record as read from the store."""

    state: State
    fingerprint: str
    owner: str
    ttl: float
    """Seconds left: on the lease while IN_PROGRESS, on the outcome otherwise."""
    payload: bytes = b""
    """The recorded outcome (``outcome.encode``); empty while IN_PROGRESS."""


@dataclass(frozen=True, slots=True)
class Claim:
    """What ``Store.claim`` found."""

    record: Record | None
    """None: the caller now owns a fresh IN_PROGRESS record. Else the existing record."""
    previous: str | None = None
    """On a successful claim, the name last claimed in the same slot, if it differs."""

    @property
    def claimed(self) -> bool:
        return self.record is None


class Store(Protocol):
    """An idempotency store. Every method is atomic; failures raise ``StoreUnavailable``,
    and a write the store answers but refuses (too large, out of memory, too few
    replicas) raises its subclass ``StoreRefused``."""

    max_payload_bytes: int
    """The largest outcome payload the backend can hold; larger ones are never sent."""

    async def claim(
        self, key: RecordKey, fingerprint: str, owner: str, lock_ttl: float, result_ttl: float
    ) -> Claim:
        """Create an IN_PROGRESS record owned by ``owner`` unless one exists (then return it).

        If the existing record is already owned by ``owner`` (a retried claim whose first
        answer was lost), it counts as claimed.
        """

    async def renew(self, key: RecordKey, owner: str, lock_ttl: float) -> bool:
        """Extend the lease; False if ``owner`` no longer holds it."""

    async def complete(
        self,
        key: RecordKey,
        owner: str,
        fingerprint: str,
        state: State,
        payload: bytes,
        result_ttl: float,
    ) -> bool:
        """Record the outcome (COMPLETED or FAILED); False if another owner holds the record.

        If the record is gone (the lease lapsed, or the store lost it) and nobody took the
        key over, the outcome is written anyway: it is the truth, and keeping it is what
        stops a second execution.
        """

    async def release(self, key: RecordKey, owner: str) -> bool:
        """Delete an IN_PROGRESS record held by ``owner``; False if not held."""

    async def get(self, key: RecordKey) -> Record | None:
        """Read a record, or None."""

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
