"""The lock contract: per-resource locks with fencing tokens, and resource versions.

Kept apart from the records contract (``base.Store``) and the rate buckets
(``buckets.Buckets``): a backend implements it in a class of its own (``MemoryLocks``,
``SQLiteLocks``, ``RedisLocks``), over the same connection as its records, and one
contract test suite (tests/test_locks_contract.py) runs against all three.

A lock is a lease: one owner at a time, until its ``ttl`` ends (renewed by its owner
while the call runs), so a replica that dies frees its locks when they lapse. Every
acquisition of a lock key gets a *fencing token*: the next value of a counter kept
beside the lock, which outlives the lock's expiry, so a tool can refuse a write that
carries a smaller token than one it has seen (a holder that lost its lock).

A version is a counter per resource: 0 until the first ``bump``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Grant:
    """What ``acquire`` decided: the fencing token, or None if another owner holds the
    lock (for ``expires_in`` seconds more, at most)."""

    token: int | None
    expires_in: float = 0.0


class Locks(Protocol):
    """Locks and versions of resource keys. Every method is atomic; failures raise
    ``StoreUnavailable`` (``StoreRefused`` for a write the store refuses)."""

    async def acquire(self, key: str, owner: str, ttl: float) -> Grant:
        """Take the lock for ``owner`` until ``ttl`` from now, with a fencing token larger
        than every one given for ``key`` before; an owner that holds it already keeps it
        (and its token)."""

    async def renew(self, key: str, owner: str, ttl: float) -> bool:
        """Extend ``owner``'s lock to ``ttl`` from now; False if it is not held by
        ``owner`` (lapsed, or taken by another: it is not retaken)."""

    async def release(self, key: str, owner: str) -> bool:
        """Free the lock if ``owner`` holds it (compare and delete); False otherwise."""

    async def version(self, key: str) -> int:
        """The resource's version: 0 before its first bump."""

    async def bump(self, key: str) -> int:
        """Add one to the resource's version and return it."""
