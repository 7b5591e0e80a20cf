"""What only the Redis store does: its coalescer's resends after a lost reply, and its
per-scope index. Against a real redis-server, through a real TCP proxy that swallows
replies (``ReplyDropper``) where a reply must be lost after the command ran."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis

from proxy.errors import StoreUnavailable
from proxy.store import RecordKey, State
from proxy.store.buckets import Rate
from proxy.store.redis import RedisStore, index_key, legacy_index_key, record_key
from tests.servers import RedisServer, ReplyDropper

pytestmark = pytest.mark.anyio

# One unit a minute, a burst of 3: nothing refills during a test.
RATE = Rate("rpm|k", interval=60.0, tolerance=180.0)
GROUP = "route-a"
KEY = RecordKey("route|anon|plan|1", "a" * 64)
# The coalescer's deadline per round trip, through the dropper (?socket_timeout=).
TIMEOUT = 0.2


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def direct(redis_url: str) -> AsyncIterator[RedisStore]:
    """A store straight to Redis, its scripts loaded (a lost NOSCRIPT reply proves nothing)."""
    store = RedisStore(redis_url)
    await store.buckets().take("warm-up", [RATE], [], "o", 5)
    await store.buckets().finish("warm-up", [(RATE, -1.0)], [], "o")
    await store.claim(RecordKey("warm|up|1", "w"), "fp", "o", 5, 5)
    await store.put_value("warm-up", b"", 5)
    yield store
    await store.close()


@pytest.fixture
async def dropper(redis_server: RedisServer) -> AsyncIterator[ReplyDropper]:
    proxy = ReplyDropper(redis_server.port)
    yield proxy
    await proxy.stop()


@pytest.fixture
async def lossy(dropper: ReplyDropper, direct: RedisStore) -> AsyncIterator[RedisStore]:
    """A store whose round trips go through ``dropper``."""
    url = await dropper.start()
    store = RedisStore(f"{url}?socket_timeout={TIMEOUT}")
    yield store
    await store.close()


async def remaining(store: RedisStore) -> int:
    """Units left in ``RATE``'s bucket, after taking one more to see."""
    admission = await store.buckets().take(GROUP, [RATE], [], "o", 5)
    assert admission.allowed
    return admission.rates[0].remaining


async def test_a_take_whose_reply_is_lost_fails_and_takes_its_units_once(
    lossy: RedisStore, direct: RedisStore, dropper: ReplyDropper
) -> None:
    dropper.armed = True
    with pytest.raises(StoreUnavailable):
        await lossy.buckets().take(GROUP, [RATE], [], "o", 5)
    assert dropper.dropped == 1
    assert await remaining(direct) == 1  # 3, less the lost take, less this one (not 0)


async def test_a_true_up_whose_reply_is_lost_fails_and_applies_once(
    lossy: RedisStore, direct: RedisStore, dropper: ReplyDropper
) -> None:
    assert await remaining(direct) == 2
    dropper.armed = True
    with pytest.raises(StoreUnavailable):
        await lossy.buckets().finish(GROUP, [(RATE, -1.0)], [], "o")  # one unit back
    assert await remaining(direct) == 2  # given back once and taken again (not 3)


async def test_a_claim_whose_reply_is_lost_is_sent_again_and_claims(
    lossy: RedisStore, direct: RedisStore, dropper: ReplyDropper
) -> None:
    dropper.armed = True
    assert (await lossy.claim(KEY, "fp", "owner-1", 5, 60)).claimed  # the same owner's
    assert dropper.dropped == 1
    record = await direct.get(KEY)
    assert record is not None and record.owner == "owner-1"


async def test_in_one_lost_round_trip_only_what_is_safe_is_sent_again(
    lossy: RedisStore, direct: RedisStore, dropper: ReplyDropper
) -> None:
    """A GET goes alone; the claim and the take issued meanwhile ride the next round trip
    together, whose replies are lost: the claim is sent again, the take fails."""
    dropper.armed = True
    value, claim, take = await asyncio.gather(
        lossy.get_value("warm-up"),
        lossy.claim(KEY, "fp", "owner-1", 5, 60),
        lossy.buckets().take(GROUP, [RATE], [], "o", 5),
        return_exceptions=True,
    )
    assert value == b""
    assert not isinstance(claim, BaseException) and claim.claimed
    assert isinstance(take, StoreUnavailable)
    assert await remaining(direct) == 1


# -- the per-scope index ----------------------------------------------------------------------

SCOPE = "route|anon|plan"


def step(i: int) -> RecordKey:
    return RecordKey(f"{SCOPE}|{i}", "h" * 64)


def index_size(url: str) -> int:
    client = redis.Redis.from_url(url)
    try:
        return int(client.zcard(index_key(SCOPE)))
    finally:
        client.close()


async def test_released_records_leave_the_index(direct: RedisStore, redis_url: str) -> None:
    await asyncio.gather(*(direct.claim(step(i), "fp", "o", 5, 60) for i in range(10)))
    assert all(await asyncio.gather(*(direct.release(step(i), "o") for i in range(6))))
    assert index_size(redis_url) == 4
    assert [r.key for r in await direct.records(SCOPE)] == [step(i) for i in range(6, 10)]


async def test_a_claim_drops_the_members_whose_record_expired(
    direct: RedisStore, redis_url: str
) -> None:
    for i in range(5):
        await direct.claim(step(i), "fp", "o", 5, 60)
        await direct.complete(step(i), "o", "fp", State.COMPLETED, b"x", 0.1)
    await direct.claim(step(5), "fp", "o", 5, 60)
    await asyncio.sleep(0.15)  # Redis expires by its own clock
    await direct.claim(step(6), "fp", "o", 5, 60)
    assert index_size(redis_url) == 2  # 5 and 6, not the 5 that expired


async def test_a_renewal_that_extends_a_record_keeps_it_listed(direct: RedisStore) -> None:
    await direct.claim(step(1), "fp", "o", 5, 0.1)
    assert await direct.renew(step(1), "o", 5, 60)  # now lives a minute
    await asyncio.sleep(0.15)
    await direct.claim(step(2), "fp", "o", 5, 60)  # prunes what expired
    assert [r.key for r in await direct.records(SCOPE)] == [step(1), step(2)]


async def test_a_settle_keeps_the_index_in_step(direct: RedisStore, redis_url: str) -> None:
    for i in (1, 2):
        await direct.claim(step(i), "fp", "o", 5, 0.1)
        await direct.complete(step(i), "o", "fp", State.FAILED, b"unknown", 0.1)
    assert await direct.settle(step(1), None, b"", 0.0)  # deleted: leaves the index
    assert await direct.settle(step(2), State.COMPLETED, b"ok", 60)  # now lives a minute
    assert index_size(redis_url) == 1
    await asyncio.sleep(0.15)
    await direct.claim(step(3), "fp", "o", 5, 60)
    assert [r.key for r in await direct.records(SCOPE)] == [step(2), step(3)]


def score_over_expiry(url: str, key: RecordKey) -> float:
    """Seconds by which the record's score in its scope's index is past its expiry."""
    client = redis.Redis.from_url(url)
    try:
        score = client.zscore(index_key(SCOPE), f"{key.slot.rpartition('|')[2]}:{key.name}")
        expires = client.pexpiretime(record_key(key))
    finally:
        client.close()
    assert score is not None and expires > 0
    return (float(score) - int(expires)) / 1000


async def test_a_record_is_indexed_until_it_expires_and_not_much_longer(
    direct: RedisStore, redis_url: str
) -> None:
    """A score before the record's expiry would drop it from listings while it lives;
    one far past it would keep dead members. Within the lease, renewed, lapsed, or after
    a long queued lease: the score is at or past the expiry, by at most result_ttl."""
    # claimed as the guard does: the record's life is the lease plus result_ttl
    await direct.claim(step(1), "fp", "o", 5, 65)
    await direct.complete(step(1), "o", "fp", State.COMPLETED, b"x" * 200, 60)
    assert 0 <= score_over_expiry(redis_url, step(1)) <= 60
    # the lease lapsed before the outcome came: the complete moves the score
    await direct.claim(step(2), "fp", "o", 0.05, 0.3)
    await asyncio.sleep(0.1)
    await direct.complete(step(2), "o", "fp", State.COMPLETED, b"x" * 200, 0.3)
    assert 0 <= score_over_expiry(redis_url, step(2)) <= 0.3
    # renewed past the claim's reckoning, then recorded within the new lease
    await direct.claim(step(3), "fp", "o", 0.2, 0.3)
    await asyncio.sleep(0.1)
    assert await direct.renew(step(3), "o", 0.2, 0.5)
    await direct.complete(step(3), "o", "fp", State.COMPLETED, b"x" * 200, 0.3)
    assert 0 <= score_over_expiry(redis_url, step(3)) <= 0.3
    # a job's key, queued for an hour, recorded with a minute to live
    await direct.claim(step(4), "fp", "o", 3600, 3660)
    await direct.complete(step(4), "o", "fp", State.COMPLETED, b"x" * 200, 60)
    assert 0 <= score_over_expiry(redis_url, step(4)) <= 60


async def test_a_call_recorded_within_its_lease_leaves_the_index_alone(
    direct: RedisStore, redis_url: str
) -> None:
    """The hot path's index work: a new plan's first claim adds and dates its index (no
    prune of an index just made), and its complete does not touch it."""
    client = redis.Redis.from_url(redis_url)
    try:
        client.config_resetstat()
        await direct.claim(step(1), "fp", "o", 5, 65)
        await direct.complete(step(1), "o", "fp", State.COMPLETED, b"x" * 200, 60)
        stats = client.info("commandstats")
    finally:
        client.close()
    assert stats["cmdstat_zadd"]["calls"] == 1
    assert "cmdstat_zremrangebyscore" not in stats
    assert stats["cmdstat_pexpire"]["calls"] == 3  # the record twice, the new index once
    assert [r.key for r in await direct.records(SCOPE)] == [step(1)]


async def test_a_long_index_is_listed_page_by_page(direct: RedisStore, redis_url: str) -> None:
    await asyncio.gather(*(direct.claim(step(i), "fp", "o", 5, 60) for i in range(300)))
    client = redis.Redis.from_url(redis_url)
    try:
        client.delete(record_key(step(0)))  # an operator's delete: found gone, dropped
        client.config_resetstat()
        listed = await direct.records(SCOPE)
        stats = client.info("commandstats")
    finally:
        client.close()
    assert {r.key for r in listed} == {step(i) for i in range(1, 300)} and len(listed) == 299
    assert stats["cmdstat_zscan"]["calls"] >= 3  # pages, not one script over the whole set
    assert "cmdstat_smembers" not in stats
    assert index_size(redis_url) == 299


async def test_a_legacy_set_index_is_still_listed(direct: RedisStore, redis_url: str) -> None:
    """Records indexed by a version that kept a set (``:idx``) are listed until it expires."""
    await direct.claim(step(1), "fp", "o", 5, 60)
    await direct.claim(step(2), "fp", "o", 5, 60)
    client = redis.Redis.from_url(redis_url)
    try:
        client.zrem(index_key(SCOPE), f"2:{'h' * 64}")
        client.sadd(legacy_index_key(SCOPE), f"2:{'h' * 64}", f"3:{'h' * 64}")
    finally:
        client.close()
    assert [r.key for r in await direct.records(SCOPE)] == [step(1), step(2)]


async def test_a_replay_is_served_by_a_redis_that_refuses_writes(
    direct: RedisStore, redis_server: RedisServer
) -> None:
    """Counting a replay is a write; a Redis that refuses writes (noeviction over its
    maxmemory, min-replicas-to-write unmet) still hands back the recorded outcome, its
    count unchanged, where a claim script whose write failed would refuse it all."""
    key = RecordKey("route|anon|plan|oom", "b" * 64)
    assert (await direct.claim(key, "fp", "o", 5, 60)).claimed
    assert await direct.complete(key, "o", "fp", State.COMPLETED, b"answer", 60)
    assert (await direct.claim(key, "fp", "o2", 5, 60)).record.replays == 1  # type: ignore[union-attr]
    admin = redis.Redis(port=redis_server.port)
    policy = str(admin.config_get("maxmemory-policy")["maxmemory-policy"])
    try:
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", 1)
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            admin.set("probe", "x")  # Redis refuses writes now
        replayed = (await direct.claim(key, "fp", "o3", 5, 60)).record
        assert replayed is not None and replayed.payload == b"answer"
        assert replayed.replays == 1
    finally:
        admin.config_set("maxmemory", 0)
        admin.config_set("maxmemory-policy", policy)
        admin.close()
    assert (await direct.claim(key, "fp", "o4", 5, 60)).record.replays == 2  # type: ignore[union-attr]
