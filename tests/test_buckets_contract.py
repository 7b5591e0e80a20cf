"""One contract for rate buckets, slots and pauses: memory, SQLite and a real redis-server.

Memory and SQLite take a clock that ``later`` fast-forwards; Redis uses its own ``TIME``,
so there ``later`` sleeps (the intervals are a few hundred milliseconds at most).
"""

from __future__ import annotations

import asyncio

import pytest

from proxy.store import Buckets, Store, make_buckets
from proxy.store.buckets import Rate, Slots
from tests.conftest import CONTRACT_STORES, Later, each_store_url, stored_entries

pytestmark = pytest.mark.anyio

GROUP = "route-a"
# 10 per second (one unit per 100 ms), a burst of 3.
RATE = Rate("rpm|k", interval=0.1, tolerance=0.3)
SLOTS = Slots("in-flight|k", capacity=2)


# Every backend, and a Redis Cluster.
store_url = pytest.fixture(params=CONTRACT_STORES)(each_store_url)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def buckets(opened: Store) -> Buckets:
    return make_buckets(opened)


async def take(buckets: Buckets, *rates: Rate, owner: str = "o", ttl: float = 5.0) -> bool:
    return (await buckets.take(GROUP, rates, (), owner, ttl)).allowed


async def test_a_burst_passes_then_the_next_waits_one_interval(buckets: Buckets) -> None:
    first = await buckets.take(GROUP, [RATE], [], "o", 5)
    assert first.allowed and first.rates[0].remaining == 2
    assert 0.09 <= first.rates[0].reset <= 0.101
    assert await take(buckets, RATE)
    third = await buckets.take(GROUP, [RATE], [], "o", 5)
    assert third.allowed and third.rates[0].remaining == 0
    refused = await buckets.take(GROUP, [RATE], [], "o", 5)
    assert not refused.allowed and refused.paused == 0
    assert 0.05 < refused.retry_after <= 0.101
    assert refused.rates[0].remaining == 0 and refused.rates[0].limited
    assert not third.rates[0].limited
    assert 0.2 < refused.rates[0].reset <= 0.301


@pytest.mark.parametrize(("quota", "period"), [(300, 200.0), (3, 2.0), (1001, 60.0)])
async def test_the_whole_burst_passes_whatever_the_interval_rounds_to(
    buckets: Buckets, quota: int, period: float
) -> None:
    """An interval no decimal holds (200 s / 300): the burst taken whole at once, and unit
    by unit, fits; one unit more does not. A store that rounds the interval up (Redis was
    sent 0.001 ms) refused the last unit for ever."""
    interval = period / quota
    whole = Rate(f"whole|{quota}", interval, interval * quota, cost=float(quota))
    assert await take(buckets, whole)
    units = Rate(f"units|{quota}", interval, interval * quota)
    assert all([await take(buckets, units) for _ in range(min(quota, 5))])
    rest = Rate(units.key, interval, interval * quota, cost=float(quota - min(quota, 5)))
    assert quota <= 5 or await take(buckets, rest)
    assert not await take(buckets, units)


async def test_the_bucket_refills_at_the_rate(buckets: Buckets, later: Later) -> None:
    for _ in range(3):
        assert await take(buckets, RATE)
    assert not await take(buckets, RATE)
    await later(0.12)
    assert await take(buckets, RATE)
    assert not await take(buckets, RATE)
    await later(0.35)
    assert all([await take(buckets, RATE) for _ in range(3)])
    assert not await take(buckets, RATE)


async def test_a_refused_take_takes_nothing_from_any_rate(buckets: Buckets) -> None:
    other = Rate("tpm|k", interval=0.1, tolerance=0.3)
    for _ in range(3):
        assert await take(buckets, RATE)
    both = await buckets.take(GROUP, [other, RATE], [], "o", 5)
    assert not both.allowed
    assert [r.limited for r in both.rates] == [False, True]
    got = await buckets.take(GROUP, [other], [], "o", 5)
    assert got.allowed and got.rates[0].remaining == 2


async def test_costs_take_several_units_and_one_above_the_burst_never_passes(
    buckets: Buckets,
) -> None:
    heavy = Rate(RATE.key, RATE.interval, RATE.tolerance, cost=2)
    got = await buckets.take(GROUP, [heavy], [], "o", 5)
    assert got.allowed and got.rates[0].remaining == 1
    refused = await buckets.take(GROUP, [heavy], [], "o", 5)
    assert not refused.allowed and 0.05 < refused.retry_after <= 0.101
    assert not await take(buckets, Rate("x", 0.1, 0.3, cost=4))


async def test_finish_trues_up_a_reservation(buckets: Buckets) -> None:
    reserve = Rate(RATE.key, RATE.interval, RATE.tolerance, cost=3)
    assert await take(buckets, reserve)
    await buckets.finish(GROUP, [(RATE, -2)], [], "o")  # the call cost 1
    got = await buckets.take(GROUP, [RATE], [], "o", 5)
    assert got.allowed and got.rates[0].remaining == 1
    await buckets.finish(GROUP, [(RATE, 1)], [], "o")  # and 1 more than reserved
    assert not await take(buckets, RATE)


async def test_a_refund_never_fills_beyond_the_burst(buckets: Buckets) -> None:
    await buckets.finish(GROUP, [(RATE, -10)], [], "o")
    assert [await take(buckets, RATE) for _ in range(4)] == [True, True, True, False]


async def test_slots_admit_capacity_owners_until_one_leaves(buckets: Buckets) -> None:
    a = await buckets.take(GROUP, [], [SLOTS], "a", 5)
    assert a.allowed and a.free == (1,)
    assert (await buckets.take(GROUP, [], [SLOTS], "b", 5)).allowed
    refused = await buckets.take(GROUP, [], [SLOTS], "c", 5)
    assert not refused.allowed and refused.retry_after == 0 and refused.free[0] < 0
    assert (await buckets.take(GROUP, [], [SLOTS], "a", 5)).allowed  # a retried take
    await buckets.finish(GROUP, [], [SLOTS.key], "a")
    assert (await buckets.take(GROUP, [], [SLOTS], "c", 5)).allowed


async def test_a_slot_whose_lease_lapses_is_free_and_renewal_keeps_it(
    buckets: Buckets, later: Later
) -> None:
    assert (await buckets.take(GROUP, [], [SLOTS], "a", 0.3)).allowed
    assert (await buckets.take(GROUP, [], [SLOTS], "b", 0.3)).allowed
    await later(0.2)
    assert await buckets.renew(GROUP, [SLOTS.key], "a", 0.3)
    await later(0.2)  # b lapsed, a was renewed
    assert (await buckets.take(GROUP, [], [SLOTS], "c", 5)).allowed
    assert not (await buckets.take(GROUP, [], [SLOTS], "d", 5)).allowed
    assert not await buckets.renew(GROUP, [SLOTS.key], "b", 0.3)


async def test_a_full_slot_refuses_the_rates_too(buckets: Buckets) -> None:
    one = Slots("one", 1)
    assert (await buckets.take(GROUP, [], [one], "a", 5)).allowed
    assert not (await buckets.take(GROUP, [RATE], [one], "b", 5)).allowed
    got = await buckets.take(GROUP, [RATE], [], "b", 5)
    assert got.rates[0].remaining == 2


async def test_a_pause_refuses_every_take_of_its_group_until_it_ends(
    buckets: Buckets, later: Later
) -> None:
    await buckets.pause(GROUP, 0.3)
    await buckets.pause(GROUP, 0.1)  # shorter: the longer one stands
    refused = await buckets.take(GROUP, [RATE], [SLOTS], "a", 5)
    assert not refused.allowed and 0.2 < refused.paused <= 0.301
    assert await take_other_group(buckets)
    await later(0.35)
    got = await buckets.take(GROUP, [RATE], [SLOTS], "a", 5)
    assert got.allowed and got.rates[0].remaining == 2


async def test_a_pause_of_one_scope_stops_only_that_scope(buckets: Buckets, later: Later) -> None:
    await buckets.pause(GROUP, 0.3, "alice")
    refused = await buckets.take(GROUP, [RATE], [SLOTS], "a", 5, "alice")
    assert not refused.allowed and 0.2 < refused.paused <= 0.301
    assert (await buckets.take(GROUP, [RATE], [], "b", 5, "bob")).allowed
    assert (await buckets.take(GROUP, [RATE], [], "c", 5)).allowed  # the whole group: no pause
    await later(0.35)
    await buckets.pause(GROUP, 0.3, "bob")  # and alice's lapsed pause is dropped
    assert (await buckets.take(GROUP, [RATE], [], "a", 5, "alice")).allowed
    assert not (await buckets.take(GROUP, [RATE], [], "b", 5, "bob")).allowed


async def take_other_group(buckets: Buckets) -> bool:
    return (await buckets.take("route-b", [RATE], [], "a", 5)).allowed


async def test_groups_and_keys_are_apart(buckets: Buckets) -> None:
    for _ in range(3):
        assert await take(buckets, RATE)
    assert await take(buckets, Rate("rpm|other", RATE.interval, RATE.tolerance))
    assert await take_other_group(buckets)


async def test_concurrent_takes_never_exceed_the_burst_or_the_slots(buckets: Buckets) -> None:
    got = await asyncio.gather(
        *(buckets.take(GROUP, [RATE], [Slots("many", 50)], f"o{i}", 5) for i in range(20))
    )
    assert sum(a.allowed for a in got) == 3
    slots = await asyncio.gather(*(buckets.take(GROUP, [], [SLOTS], f"p{i}", 5) for i in range(20)))
    assert sum(a.allowed for a in slots) == 2


async def test_the_sweep_drops_buckets_at_rest_lapsed_slots_and_ended_pauses(
    opened: Store, buckets: Buckets, later: Later
) -> None:
    """Memory and SQLite keep every key's bucket until swept (Redis expires its keys)."""
    rates = [Rate(f"k{i}", 0.1, 0.3) for i in range(5)]
    slots = [Slots(f"s{i}", 1) for i in range(5)]
    for i in range(5):
        assert (await buckets.take(GROUP, [rates[i]], [slots[i]], f"o{i}", 0.2)).allowed
    await buckets.pause("route-b", 0.2)
    await opened.sweep()  # nothing has lapsed yet: kept
    assert not (await buckets.take(GROUP, [], [slots[0]], "late", 5)).allowed
    assert not await take_other_group(buckets)
    assert stored_entries(opened, "buckets") > 0
    await later(0.35)
    await opened.sweep()
    assert stored_entries(opened, "buckets") == 0
    got = await buckets.take(GROUP, [rates[0]], [slots[0]], "late", 5)
    assert got.allowed and got.rates[0].remaining == 2 and got.free == (0,)


# -- the read of a group (the operator console) ------------------------------------------


async def test_state_reads_a_groups_buckets_slots_and_pauses_without_changing_them(
    buckets: Buckets,
) -> None:
    other = Rate("rpm|other", RATE.interval, RATE.tolerance)
    for _ in range(2):
        assert await take(buckets, RATE)
    assert await take(buckets, other)
    assert (await buckets.take(GROUP, [], [SLOTS], "a", 5)).allowed
    assert (await buckets.take(GROUP, [], [SLOTS], "b", 2)).allowed
    await buckets.pause(GROUP, 3, "alice")
    await buckets.pause(GROUP, 4)
    await buckets.take("route-ab", [RATE], [SLOTS], "c", 5)  # groups apart, prefix or not
    await buckets.pause("route-ab", 9)
    state = await buckets.state(GROUP, 10)
    assert state.complete
    assert [r.key for r in state.rates] == [RATE.key, other.key]  # the most used first
    assert 0.15 < state.rates[0].seconds <= 0.201 and 0.05 < state.rates[1].seconds <= 0.101
    assert all(r.held == 0 for r in state.rates)
    (slots,) = state.slots
    assert slots.key == SLOTS.key and slots.held == 2 and 4.5 < slots.seconds <= 5.001
    assert [(p.key, round(p.seconds)) for p in state.pauses] == [("", 4), ("alice", 3)]
    again = await buckets.state(GROUP, 10)  # a read: nothing moved
    assert [(e.key, e.held) for e in again.rates + again.slots + again.pauses] == [
        (e.key, e.held) for e in state.rates + state.slots + state.pauses
    ]
    got = await buckets.take(GROUP, [RATE], [], "o", 5)
    assert not got.allowed and got.paused > 3  # the pause stands: the read changed nothing
    empty = await buckets.state("route-c", 10)
    assert empty.rates == empty.slots == empty.pauses == () and empty.complete


async def test_state_is_bounded_and_leaves_out_what_lapsed(buckets: Buckets, later: Later) -> None:
    for i in range(3):
        assert await take(buckets, Rate(f"k{i}", 0.1, 0.3, cost=i + 1))
    assert (await buckets.take(GROUP, [], [SLOTS], "a", 0.2)).allowed
    await buckets.pause(GROUP, 0.2, "bob")
    first = await buckets.state(GROUP, 2)
    assert not first.complete and [r.key for r in first.rates] == ["k2", "k1"]
    assert len(first.slots) == len(first.pauses) == 1
    assert (await buckets.state(GROUP, 3)).complete
    await later(0.35)
    gone = await buckets.state(GROUP, 3)
    assert gone.rates == gone.slots == gone.pauses == () and gone.complete
