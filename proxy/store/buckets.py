"""The rate-bucket contract: GCRA rates, leased slots and pauses, shared by replicas.

Kept apart from the records contract (``base.Store``): a backend implements it in a
class of its own (``MemoryBuckets``, ``SQLiteBuckets``, ``RedisBuckets``), over the same
connection as its records, and one contract test suite (tests/test_buckets_contract.py)
runs against all three.

Everything lives in a *group* (a route): a group's rates, slots and pauses are read and
written together, atomically, by ``take`` (on Redis one script, all keys under the
group's hash tag). A pause has a *scope* within its group: "" for the whole group, else
the one caller it stops (``policies.limits`` makes it from the caller's keys).

Rates are GCRA (the generic cell rate algorithm): one stored time per bucket, the
*theoretical arrival time* ``tat``. A unit costs ``interval`` seconds (the period
divided by the quota); a take of ``cost`` units is allowed while
``max(tat, now) + cost * interval - now <= tolerance`` (``tolerance`` = ``interval *
burst``), and then moves ``tat`` there. It is the token bucket's exact equivalent:
``burst`` units at once, refilled one per ``interval``.

Slots are leases: ``capacity`` owners at a time, each until its lease ends (``ttl``,
renewed while the call runs), so a replica that dies frees its slots when they lapse.

``state`` reads a group without changing it (the operator console's routes view): the
buckets not full now, the slot sets with leases held, the pauses in force.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

# Seconds of float rounding ignored when a take is compared with the tolerance (times
# are about 1.7e9 s: their doubles are exact to about 0.2 µs).
EPSILON = 1e-6


@dataclass(frozen=True, slots=True)
class Rate:
    """One GCRA bucket of a take: where it lives, its interval and tolerance, the cost."""

    key: str
    interval: float
    """Seconds per unit: the period divided by the quota."""
    tolerance: float
    """``interval * burst``: how far ahead of now ``tat`` may run."""
    cost: float = 1.0


@dataclass(frozen=True, slots=True)
class Slots:
    """A concurrency limit of a take: where its slots live, and how many there are."""

    key: str
    capacity: int


@dataclass(frozen=True, slots=True)
class RateState:
    """A rate after a take: whole units left now, seconds until the bucket is full, and
    whether this rate had no room for the take."""

    remaining: int
    reset: float
    limited: bool = False


@dataclass(frozen=True, slots=True)
class Admission:
    """What ``take`` decided. Refused (``allowed`` False): nothing was taken."""

    allowed: bool
    paused: float
    """Above 0: the group is paused for this many seconds more; nothing was evaluated."""
    retry_after: float
    """Refused by a rate: seconds until the take could pass (0: refused by a full slot)."""
    rates: tuple[RateState, ...] = ()
    free: tuple[int, ...] = ()
    """Per ``Slots``: free slots after the take (0 and below: full)."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One live entry of a group, as ``Buckets.state`` reads it."""

    key: str
    """A rate's or slot set's key; a pause's scope ("" for the whole group)."""
    seconds: float
    """A rate: how far its tat runs ahead of now (its bucket is full again then); a slot
    set: the longest lease left; a pause: how long it holds still."""
    held: int = 0
    """A slot set: the leases held now (0 for rates and pauses)."""


@dataclass(frozen=True, slots=True)
class GroupState:
    """What a group holds now: rates whose bucket is not full, slot sets with leases held,
    pauses in force; each the most used first (the largest ``seconds``; slot sets: the
    most ``held``). ``complete`` is False when some were left out (more than the limit
    asked for, or a read bounded before it saw them all)."""

    rates: tuple[Entry, ...] = ()
    slots: tuple[Entry, ...] = ()
    pauses: tuple[Entry, ...] = ()
    complete: bool = True


def group_state(
    rates: Sequence[Entry], slots: Sequence[Entry], pauses: Sequence[Entry], limit: int, seen: bool
) -> GroupState:
    """The state of live entries (those with time left): ordered, at most ``limit`` of
    each kind; ``seen`` whether the read saw every entry of the group."""

    def most(entries: Sequence[Entry]) -> list[Entry]:
        live = [e for e in entries if e.seconds > 0]
        return sorted(live, key=lambda e: (-e.held, -e.seconds, e.key))

    kinds = [most(rates), most([s for s in slots if s.held > 0]), most(pauses)]
    complete = seen and all(len(k) <= limit for k in kinds)
    first = [tuple(k[: max(limit, 0)]) for k in kinds]
    return GroupState(first[0], first[1], first[2], complete)


class Buckets(Protocol):
    """Rate buckets, slots and pauses of groups. Every method is atomic; failures raise
    ``StoreUnavailable`` (``StoreRefused`` for a write the store refuses)."""

    async def take(
        self,
        group: str,
        rates: Sequence[Rate],
        slots: Sequence[Slots],
        owner: str,
        slot_ttl: float,
        scope: str = "",
    ) -> Admission:
        """Unless the group's pause of ``scope`` holds, take ``cost`` from every rate and a
        slot (leased to ``owner`` for ``slot_ttl``) from every ``Slots``: all of them, or
        none. An owner that holds a slot already keeps it (a retried take)."""

    async def finish(
        self,
        group: str,
        changes: Sequence[tuple[Rate, float]],
        slots: Sequence[str],
        owner: str,
    ) -> None:
        """After a call: add ``units`` to each rate (negative: give back, never beyond a
        full bucket) and free ``owner``'s slots under the ``slots`` keys."""

    async def renew(self, group: str, slots: Sequence[str], owner: str, ttl: float) -> bool:
        """Extend ``owner``'s slots by ``ttl``; False if one had lapsed (it is not retaken)."""

    async def pause(self, group: str, seconds: float, scope: str = "") -> None:
        """Refuse every take of the group under ``scope`` for ``seconds`` (a longer pause
        already set wins); lapsed pauses are dropped, not kept."""

    async def state(self, group: str, limit: int) -> GroupState:
        """Read the group (nothing changes): at most ``limit`` entries of each kind."""


def gcra(tat: float, now: float, rate: Rate) -> tuple[float, float, RateState]:
    """One rate's decision: (new tat, 0 if allowed else the seconds to wait, its state).

    The same arithmetic as the Redis script, for the backends that run it in Python.
    """
    base = max(tat, now)
    new = base + rate.interval * rate.cost
    over = new - rate.tolerance - now
    if over > EPSILON:
        return tat, over, RateState(0, base - now, True)
    return new, 0.0, RateState(_remaining(new, now, rate), new - now)


def _remaining(tat: float, now: float, rate: Rate) -> int:
    return max(math.floor((rate.tolerance - (tat - now)) / rate.interval + 1e-6), 0)


def adjusted(tat: float, now: float, rate: Rate, units: float) -> float:
    """The tat after adding ``units`` (negative: a refund, never below ``now``)."""
    return max(max(tat, now) + rate.interval * units, now)
