"""One contract for resource locks, fencing tokens and versions: memory, SQLite and a
real redis-server.

Memory and SQLite take a clock that ``later`` fast-forwards; Redis expires keys on its
own clock, so there ``later`` sleeps (the leases are a few hundred milliseconds).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from proxy.store import Locks, Store, make_locks
from proxy.store.locks import Version
from tests.conftest import CONTRACT_STORES, Later, each_store_url, stored_entries

pytestmark = pytest.mark.anyio

SCOPE = "route-a"
KEY = "route-a|account-1"
TTL = 0.3


# Every backend, and a Redis Cluster.
store_url = pytest.fixture(params=CONTRACT_STORES)(each_store_url)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def locks(opened: Store) -> Locks:
    return make_locks(opened)


async def test_one_owner_at_a_time(locks: Locks) -> None:
    first = await locks.acquire(SCOPE, KEY, "a", TTL)
    refused = await locks.acquire(SCOPE, KEY, "b", TTL)
    assert first.token == 1
    assert refused.token is None
    assert 0.2 < refused.expires_in <= TTL


async def test_an_owner_that_holds_the_lock_keeps_it_and_its_token(locks: Locks) -> None:
    first = await locks.acquire(SCOPE, KEY, "a", TTL)
    await locks.acquire(SCOPE, "other", "b", TTL)  # the scope's counter moves on
    again = await locks.acquire(SCOPE, KEY, "a", TTL)
    assert again.token == first.token


async def test_tokens_grow_per_scope_across_releases_and_keys(locks: Locks) -> None:
    tokens = []
    for owner in "abc":
        grant = await locks.acquire(SCOPE, KEY, owner, TTL)
        tokens.append(grant.token)
        assert await locks.release(SCOPE, KEY, owner)
    tokens.append((await locks.acquire(SCOPE, "other", "a", TTL)).token)
    assert tokens == [1, 2, 3, 4]  # one counter per scope
    assert (await locks.acquire("route-b", KEY, "a", TTL)).token == 1  # scopes are apart
    assert (await locks.acquire("route-b", KEY, "b", TTL)).token is None


async def test_a_lapsed_lock_is_free_and_the_next_token_is_larger(
    locks: Locks, later: Later
) -> None:
    first = await locks.acquire(SCOPE, KEY, "a", TTL)
    await later(TTL + 0.05)
    second = await locks.acquire(SCOPE, KEY, "b", TTL)
    assert first.token is not None and second.token is not None
    assert second.token > first.token
    assert not await locks.renew(SCOPE, KEY, "a", TTL)
    assert not await locks.release(SCOPE, KEY, "a")
    assert (await locks.acquire(SCOPE, KEY, "c", TTL)).token is None  # b still holds it


async def test_only_the_owner_renews_and_renewal_extends(locks: Locks, later: Later) -> None:
    await locks.acquire(SCOPE, KEY, "a", TTL)
    assert not await locks.renew(SCOPE, KEY, "b", TTL)
    await later(0.2)
    assert await locks.renew(SCOPE, KEY, "a", TTL)
    await later(0.2)  # past the first lease, within the renewed one
    assert (await locks.acquire(SCOPE, KEY, "b", TTL)).token is None


async def test_only_the_owner_releases(locks: Locks) -> None:
    await locks.acquire(SCOPE, KEY, "a", TTL)
    assert not await locks.release(SCOPE, KEY, "b")
    assert (await locks.acquire(SCOPE, KEY, "b", TTL)).token is None
    assert await locks.release(SCOPE, KEY, "a")
    assert not await locks.release(SCOPE, KEY, "a")
    assert (await locks.acquire(SCOPE, KEY, "b", TTL)).token == 2


async def test_a_lapsed_lock_cannot_be_renewed_into_life(locks: Locks, later: Later) -> None:
    await locks.acquire(SCOPE, KEY, "a", TTL)
    await later(TTL + 0.05)
    assert not await locks.renew(SCOPE, KEY, "a", TTL)


async def test_concurrent_acquisitions_give_one_owner(locks: Locks) -> None:
    grants = await asyncio.gather(*(locks.acquire(SCOPE, KEY, f"o{n}", TTL) for n in range(10)))
    assert sum(g.token is not None for g in grants) == 1


# -- versions ----------------------------------------------------------------------------


async def test_a_resource_without_an_entry_gets_a_fresh_unwritten_version_kept(
    locks: Locks,
) -> None:
    first = await locks.version(SCOPE, KEY, TTL)
    assert first == Version(1, False)
    assert await locks.version(SCOPE, KEY, TTL) == first  # kept
    assert await locks.version(SCOPE, "other", TTL) == Version(2, False)  # one counter
    assert (await locks.acquire(SCOPE, KEY, "a", TTL)).token == 3  # with fencing tokens
    assert await locks.version("route-b", KEY, TTL) == Version(1, False)


async def test_a_settled_write_moves_the_version_a_refused_one_keeps_it(locks: Locks) -> None:
    start = await locks.begin(SCOPE, KEY, "a", TTL)
    assert start == Version(1, False, writing=True)
    assert await locks.settle(SCOPE, KEY, "a", True, TTL) == 2
    assert await locks.version(SCOPE, KEY, TTL) == Version(2, True)
    assert await locks.begin(SCOPE, KEY, "b", TTL) == Version(2, True, writing=True)
    assert await locks.settle(SCOPE, KEY, "b", False, TTL) == 2
    # b's mark is gone: the same number
    assert await locks.begin(SCOPE, KEY, "c", TTL) == Version(2, True, writing=True)


async def test_begin_and_settle_can_be_repeated(locks: Locks) -> None:
    """A resend after a lost reply changes nothing more."""
    first = await locks.begin(SCOPE, KEY, "a", TTL)
    assert await locks.begin(SCOPE, KEY, "a", TTL) == first
    assert await locks.settle(SCOPE, KEY, "a", True, TTL) == 2
    assert await locks.settle(SCOPE, KEY, "a", True, TTL) is None  # settled already
    assert await locks.version(SCOPE, KEY, TTL) == Version(2, True)


async def test_a_write_left_unsettled_makes_the_next_one_draw_a_fresh_version(
    locks: Locks,
) -> None:
    """The store failed (or the proxy died) between the send and the bump: the write may
    have happened, so no If-Match of the version before it may match again."""
    before = await locks.begin(SCOPE, KEY, "a", TTL)
    assert await locks.version(SCOPE, KEY, TTL) == before  # a read meanwhile: the old one
    after = await locks.begin(SCOPE, KEY, "b", TTL)
    assert after.written and after.number > before.number
    assert await locks.settle(SCOPE, KEY, "a", True, TTL) is None  # a's mark was taken over
    assert await locks.settle(SCOPE, KEY, "b", False, TTL) == after.number


async def test_a_fresh_resource_is_not_being_written(locks: Locks) -> None:
    assert not (await locks.version(SCOPE, KEY, TTL)).writing
    assert not (await locks.version(SCOPE, KEY, TTL)).writing  # kept, still not


async def test_a_mark_makes_the_version_writing_until_it_is_settled(locks: Locks) -> None:
    """A write in flight keeps the number; ``writing`` tells a reader that keys anything
    on it (the response cache) not to trust it meanwhile."""
    before = await locks.version(SCOPE, KEY, TTL)
    begun = await locks.begin(SCOPE, KEY, "a", TTL)
    assert begun == Version(before.number, False, writing=True)  # its own mark
    assert await locks.version(SCOPE, KEY, TTL) == Version(before.number, False, writing=True)
    assert await locks.begin(SCOPE, KEY, "a", TTL) == begun  # a resend: the same
    written = await locks.settle(SCOPE, KEY, "a", True, TTL)
    assert written is not None and written > before.number
    assert await locks.version(SCOPE, KEY, TTL) == Version(written, True, writing=False)
    assert (await locks.begin(SCOPE, KEY, "b", TTL)).writing
    assert (await locks.version(SCOPE, KEY, TTL)).writing
    assert await locks.settle(SCOPE, KEY, "b", False, TTL) == written
    assert await locks.version(SCOPE, KEY, TTL) == Version(written, True, writing=False)


async def test_a_mark_whose_settle_never_came_stays_writing_until_the_next_write_settles(
    locks: Locks, later: Later
) -> None:
    """The store failed (or the proxy died) between a's send and its bump: the number is
    the old one, so every read says writing, however long (within the version's ttl),
    until another owner's write draws a fresh number and settles."""
    before = await locks.begin(SCOPE, KEY, "a", TTL)
    for _ in range(3):
        await later(0.2)  # reads keep the version (and the mark) past its first ttl
        assert await locks.version(SCOPE, KEY, TTL) == Version(before.number, False, True)
    after = await locks.begin(SCOPE, KEY, "b", TTL)
    assert after.number > before.number and after.writing
    assert (await locks.version(SCOPE, KEY, TTL)).writing  # b's mark now
    assert await locks.settle(SCOPE, KEY, "a", False, TTL) is None  # not a's any more
    assert (await locks.version(SCOPE, KEY, TTL)).writing
    assert await locks.settle(SCOPE, KEY, "b", False, TTL) == after.number
    assert await locks.version(SCOPE, KEY, TTL) == Version(after.number, True, writing=False)


async def test_a_mark_whose_settle_never_came_is_forgotten_with_its_version(
    locks: Locks, later: Later
) -> None:
    before = await locks.begin(SCOPE, KEY, "a", TTL)
    await later(TTL + 0.05)
    fresh = await locks.version(SCOPE, KEY, TTL)
    assert fresh.number > before.number and fresh == Version(fresh.number, False, False)


async def test_a_version_expires_after_its_ttl_since_its_last_use_and_comes_back_fresh(
    locks: Locks, later: Later
) -> None:
    await locks.begin(SCOPE, KEY, "a", TTL)
    written = await locks.settle(SCOPE, KEY, "a", True, TTL)
    await later(0.2)
    assert await locks.version(SCOPE, KEY, TTL) == Version(2, True)  # a read keeps it
    await later(0.2)
    assert await locks.version(SCOPE, KEY, TTL) == Version(2, True)
    await later(TTL + 0.05)
    fresh = await locks.version(SCOPE, KEY, TTL)
    assert written is not None and fresh.number > written and not fresh.written


async def test_a_mark_expires_with_its_version(locks: Locks, later: Later) -> None:
    await locks.begin(SCOPE, KEY, "a", TTL)
    await later(TTL + 0.05)
    assert await locks.settle(SCOPE, KEY, "a", True, TTL) is None
    assert not (await locks.begin(SCOPE, KEY, "b", TTL)).written  # forgotten: fresh


async def test_the_sweep_drops_lapsed_locks_and_keeps_their_counters(
    opened: Store, locks: Locks, later: Later
) -> None:
    """Memory and SQLite keep every lock until swept (Redis expires its keys)."""
    for i in range(5):
        assert (await locks.acquire(SCOPE, f"{KEY}{i}", "a", TTL)).token == i + 1
    await opened.sweep()  # nothing has lapsed yet: kept
    assert (await locks.acquire(SCOPE, f"{KEY}0", "b", TTL)).token is None
    assert stored_entries(opened, "locks") == 5
    await later(TTL + 0.05)
    await opened.sweep()
    assert stored_entries(opened, "locks") == 0
    assert (await locks.acquire(SCOPE, f"{KEY}0", "b", TTL)).token == 6  # the counter stayed


@pytest.mark.real_counters
async def test_a_new_scopes_counter_starts_at_the_clock_above_what_was_given_before(
    locks: Locks,
) -> None:
    """A scope's counter starts at the clock in microseconds: after an upgrade from one
    counter per resource (small numbers), or a store that lost its counters, no token or
    version repeats one given before, so no stale If-Match matches again."""
    before = int(time.time() * 1_000_000)
    token = (await locks.acquire(SCOPE, KEY, "a", TTL)).token
    version = await locks.version(SCOPE, "other", TTL)
    assert token is not None and token > before
    assert version == Version(token + 1, False)
    assert token < 2**53  # an integer every JSON reader takes exactly


# -- the read of a scope's locks (the operator console) ----------------------------------


async def test_held_lists_a_scopes_locks_newest_first_without_changing_them(
    locks: Locks, later: Later
) -> None:
    first = await locks.acquire(SCOPE, f"{KEY}-1", "a", TTL)
    second = await locks.acquire(SCOPE, f"{KEY}-2", "b", 5)
    await locks.acquire(f"{SCOPE}x", f"{KEY}-3", "c", TTL)  # scopes apart, prefix or not
    await locks.version(SCOPE, f"{KEY}-4", TTL)  # a version is no lock
    held = await locks.held(SCOPE, 10)
    assert held.complete
    assert [(h.key, h.token) for h in held.locks] == [
        (f"{KEY}-2", second.token),
        (f"{KEY}-1", first.token),
    ]
    assert 4.5 < held.locks[0].expires_in <= 5 and 0.2 < held.locks[1].expires_in <= TTL
    assert (await locks.acquire(SCOPE, f"{KEY}-1", "z", TTL)).token is None  # still a's
    bounded = await locks.held(SCOPE, 1)
    assert not bounded.complete and [h.key for h in bounded.locks] == [f"{KEY}-2"]
    assert await locks.release(SCOPE, f"{KEY}-2", "b")
    await later(TTL + 0.05)
    assert (await locks.held(SCOPE, 10)).locks == ()
    assert (await locks.held("nobody", 10)).complete
