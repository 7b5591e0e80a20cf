"""The lock contract: per-resource locks with fencing tokens, and resource versions.

Kept apart from the records contract (``base.Store``) and the rate buckets
(``buckets.Buckets``): a backend implements it in a class of its own (``MemoryLocks``,
``SQLiteLocks``, ``RedisLocks``), over the same connection as its records, and one
contract test suite (tests/test_locks_contract.py) runs against all three.

Every key lives in a *scope* (a route). Each scope has one counter, which only grows and
never expires; fencing tokens and version numbers are both drawn from it. So the state
kept per resource (a caller-chosen value) can expire, and a resource forgotten is given a
fresh number larger than every one given before in its scope: no stale token or ETag
matches it again. A counter starts at the clock in microseconds (``counter_start``) when
it is absent, new or lost with its store: its numbers are larger than those an earlier
release (one counter per resource) or a store that lost its data gave, unless a scope
drew more than a million a second on average.

A lock is a lease: one owner at a time, until its ``ttl`` ends (renewed by its owner
while the call runs), so a replica that dies frees its locks when they lapse. Every
acquisition gets a *fencing token*, the next value of the scope's counter, kept with the
lock while it is held: a tool can refuse a write that carries a smaller token than one it
has seen (a holder that lost its lock).

A version is a number, whether a write through the proxy set it, and whether a write's
mark is there now (``writing``). A resource with no entry (never seen, or not seen for
``ttl``) gets a fresh, unwritten one. A write marks its resource before it is sent
(``begin``) and settles the mark afterwards (``settle``): a mark left unsettled (the
store failed, or the proxy died, between the send and the bump) means the write may have
happened, so the next ``begin`` draws a fresh number, and every ``If-Match`` of the old
one fails.

    version   ──▶ (number, written, writing)      reads: the ETag
    begin     ──▶ mark the write (a stale mark: a fresh number, written)
      └─▶ send ──▶ settle(wrote=True): a fresh number, written; the mark cleared
             └──▶ settle(wrote=False): the mark cleared, the number kept

A number stays while a write is in flight, and after a write whose bump failed (its mark
left): so a reader that keys anything on the number (the response cache) must not trust
it while ``writing`` is True. A mark goes with its ``settle``, or with the next owner's
``begin`` and ``settle``, or with the version when its ``ttl`` lapses.

``held`` reads the locks of a scope without changing them (the operator console).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol


def counter_start() -> int:
    """Where a scope's counter starts: the wall clock in microseconds."""
    return int(time.time() * 1_000_000)


@dataclass(frozen=True, slots=True)
class Grant:
    """What ``acquire`` decided: the fencing token, or None if another owner holds the
    lock (for ``expires_in`` seconds more, at most)."""

    token: int | None
    expires_in: float = 0.0


@dataclass(frozen=True, slots=True)
class HeldLock:
    """A lock held now, as ``Locks.held`` reads it: the resource key, its fencing token,
    and the seconds left on its lease."""

    key: str
    token: int
    expires_in: float


@dataclass(frozen=True, slots=True)
class LocksHeld:
    """The locks held in a scope, the newest (largest token) first; ``complete`` False
    when some were left out (more than the limit asked for, or a bounded read)."""

    locks: tuple[HeldLock, ...] = ()
    complete: bool = True


def locks_held(found: list[HeldLock], limit: int, seen: bool) -> LocksHeld:
    """The live locks of ``found``, newest first, at most ``limit``; ``seen`` whether the
    read saw every lock of the scope."""
    live = sorted((h for h in found if h.expires_in > 0), key=lambda h: (-h.token, h.key))
    return LocksHeld(tuple(live[: max(limit, 0)]), seen and len(live) <= limit)


@dataclass(frozen=True, slots=True)
class Version:
    """A resource's version: a number drawn from its scope's counter, whether a write
    through the proxy set it (False for a resource the store had no entry of), and
    ``writing``: a write's mark is there (a write through the proxy is in flight, or one
    whose settle never came: it may have happened, and the number not moved)."""

    number: int
    written: bool
    writing: bool = False


class Locks(Protocol):
    """Locks and versions of resource keys, per scope. Every method is atomic and safe to
    repeat with the same arguments (a resend after a lost reply changes nothing more);
    failures raise ``StoreUnavailable`` (``StoreRefused`` for a write the store refuses)."""

    async def acquire(self, scope: str, key: str, owner: str, ttl: float) -> Grant:
        """Take the lock for ``owner`` until ``ttl`` from now, with a fencing token larger
        than every one given in ``scope`` before; an owner that holds it already keeps it
        (and its token)."""

    async def renew(self, scope: str, key: str, owner: str, ttl: float) -> bool:
        """Extend ``owner``'s lock to ``ttl`` from now; False if it is not held by
        ``owner`` (lapsed, or taken by another: it is not retaken)."""

    async def release(self, scope: str, key: str, owner: str) -> bool:
        """Free the lock if ``owner`` holds it (compare and delete); False otherwise."""

    async def version(self, scope: str, key: str, ttl: float) -> Version:
        """The resource's version, kept ``ttl`` more; a fresh unwritten one if it has no
        entry. ``writing`` is True while any owner's mark is there (unsettled)."""

    async def begin(self, scope: str, key: str, owner: str, ttl: float) -> Version:
        """Mark a write of ``owner`` (who holds the resource's reservation) and return the
        version it is checked against: a fresh written one if another owner's mark was
        left unsettled (that write may have happened). ``writing`` is True: ``owner``'s
        mark is there now."""

    async def settle(self, scope: str, key: str, owner: str, wrote: bool, ttl: float) -> int | None:
        """Clear ``owner``'s mark; if ``wrote``, move the version to a fresh number. The
        resulting number, or None if ``owner``'s mark is not there (settled already)."""

    async def held(self, scope: str, limit: int) -> LocksHeld:
        """Read the locks held in ``scope`` now (nothing changes): at most ``limit``."""
