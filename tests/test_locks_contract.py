"""One contract for resource locks, fencing tokens and versions: memory, SQLite and a
real redis-server.

Memory and SQLite take a clock that ``later`` fast-forwards; Redis expires keys on its
own clock, so there ``later`` sleeps (the leases are a few hundred milliseconds).
"""

from __future__ import annotations

import asyncio

import pytest

from proxy.store import Locks, Store, make_locks
from tests.conftest import Later, stored_entries

pytestmark = pytest.mark.anyio

KEY = "route-a|account-1"
TTL = 0.3


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def locks(opened: Store) -> Locks:
    return make_locks(opened)


async def test_one_owner_at_a_time(locks: Locks) -> None:
    first = await locks.acquire(KEY, "a", TTL)
    refused = await locks.acquire(KEY, "b", TTL)
    assert first.token == 1
    assert refused.token is None
    assert 0.2 < refused.expires_in <= TTL


async def test_an_owner_that_holds_the_lock_keeps_it_and_its_token(locks: Locks) -> None:
    first = await locks.acquire(KEY, "a", TTL)
    again = await locks.acquire(KEY, "a", TTL)
    assert again.token == first.token


async def test_tokens_grow_across_releases_and_keys_are_apart(locks: Locks) -> None:
    tokens = []
    for owner in "abc":
        grant = await locks.acquire(KEY, owner, TTL)
        tokens.append(grant.token)
        assert await locks.release(KEY, owner)
    assert tokens == [1, 2, 3]
    assert (await locks.acquire("other", "a", TTL)).token == 1


async def test_a_lapsed_lock_is_free_and_the_next_token_is_larger(
    locks: Locks, later: Later
) -> None:
    first = await locks.acquire(KEY, "a", TTL)
    await later(TTL + 0.05)
    second = await locks.acquire(KEY, "b", TTL)
    assert first.token is not None and second.token is not None
    assert second.token > first.token
    assert not await locks.renew(KEY, "a", TTL)
    assert not await locks.release(KEY, "a")
    assert (await locks.acquire(KEY, "c", TTL)).token is None  # b still holds it


async def test_only_the_owner_renews_and_renewal_extends(locks: Locks, later: Later) -> None:
    await locks.acquire(KEY, "a", TTL)
    assert not await locks.renew(KEY, "b", TTL)
    await later(0.2)
    assert await locks.renew(KEY, "a", TTL)
    await later(0.2)  # past the first lease, within the renewed one
    assert (await locks.acquire(KEY, "b", TTL)).token is None


async def test_only_the_owner_releases(locks: Locks) -> None:
    await locks.acquire(KEY, "a", TTL)
    assert not await locks.release(KEY, "b")
    assert (await locks.acquire(KEY, "b", TTL)).token is None
    assert await locks.release(KEY, "a")
    assert not await locks.release(KEY, "a")
    assert (await locks.acquire(KEY, "b", TTL)).token == 2


async def test_a_lapsed_lock_cannot_be_renewed_into_life(locks: Locks, later: Later) -> None:
    await locks.acquire(KEY, "a", TTL)
    await later(TTL + 0.05)
    assert not await locks.renew(KEY, "a", TTL)


async def test_versions_start_at_zero_and_bumps_count(locks: Locks) -> None:
    assert await locks.version(KEY) == 0
    assert await locks.bump(KEY) == 1
    assert await locks.bump(KEY) == 2
    assert await locks.version(KEY) == 2
    assert await locks.version("other") == 0


async def test_concurrent_acquisitions_give_one_owner(locks: Locks) -> None:
    grants = await asyncio.gather(*(locks.acquire(KEY, f"o{n}", TTL) for n in range(10)))
    assert sum(g.token is not None for g in grants) == 1


async def test_the_sweep_drops_lapsed_locks_and_keeps_their_counters(
    opened: Store, locks: Locks, later: Later
) -> None:
    """Memory and SQLite keep every lock until swept (Redis expires its keys)."""
    for i in range(5):
        assert (await locks.acquire(f"{KEY}{i}", "a", TTL)).token == 1
    await opened.sweep()  # nothing has lapsed yet: kept
    assert (await locks.acquire(f"{KEY}0", "b", TTL)).token is None
    assert stored_entries(opened, "locks") == 5
    await later(TTL + 0.05)
    await opened.sweep()
    assert stored_entries(opened, "locks") == 0
    assert (await locks.acquire(f"{KEY}0", "b", TTL)).token == 2  # the counter stayed
