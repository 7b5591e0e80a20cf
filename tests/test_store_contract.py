"""One contract, every store: memory, SQLite, a real redis-server and a real PostgreSQL.

Expiry is tested by moving time on: memory, SQLite and PostgreSQL take a clock, which ``later``
fast-forwards; Redis expires keys by its own clock, so there ``later`` sleeps for real
(the TTLs are a few hundred milliseconds).
"""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis

from proxy.errors import StoreUnavailable
from proxy.store import RecordKey, State, Store, make_store
from proxy.store.memory import MemoryStore
from proxy.store.postgres import PostgresStore
from proxy.store.sqlite import SQLiteStore
from tests.conftest import CONTRACT_STORES, Later, each_store_url
from tests.servers import RedisServer, free_port

pytestmark = pytest.mark.anyio

KEY = RecordKey("route|anon|plan|1", "a" * 64)
LOCK = 5.0
RESULT = 60.0


# Every backend, and a Redis Cluster.
store_url = pytest.fixture(params=CONTRACT_STORES)(each_store_url)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def store(opened: Store) -> Store:
    return opened


def gone(store: Store, key: RecordKey) -> bool:
    """True if no row of ``key`` is left, looking under the store's own reads (which
    hide, and in memory drop, expired records)."""
    if isinstance(store, MemoryStore):
        return key not in store._records
    if isinstance(store, PostgresStore):
        with psycopg.connect(store.options.conninfo) as conn:
            query = "SELECT count(*) FROM tool_proxy.records WHERE slot = %s AND name = %s"
            row = conn.execute(query, key).fetchone()
            return row is not None and row[0] == 0
    assert isinstance(store, SQLiteStore)
    with sqlite3.connect(store.path) as db:
        query = "SELECT count(*) FROM step_records WHERE slot = ? AND name = ?"
        return bool(db.execute(query, key).fetchone()[0] == 0)


async def test_first_claim_wins(store: Store) -> None:
    assert (await store.claim(KEY, "fp", "a", LOCK, RESULT)).claimed
    second = await store.claim(KEY, "fp", "b", LOCK, RESULT)
    assert not second.claimed
    assert second.record is not None
    assert second.record.state is State.IN_PROGRESS
    assert second.record.owner == "a"
    assert 0 < second.record.ttl <= LOCK


async def test_a_retried_claim_by_the_same_owner_is_still_claimed(store: Store) -> None:
    assert (await store.claim(KEY, "fp", "a", LOCK, RESULT)).claimed
    assert (await store.claim(KEY, "fp", "a", LOCK, RESULT)).claimed


async def test_a_claim_by_the_same_owner_never_overwrites_its_outcome(store: Store) -> None:
    """A job's owner is the same on every claim (``job.<id>``): claimed again after it
    recorded its answer (or its failure), it finds that outcome, which stays."""
    for state, payload in ((State.COMPLETED, b"answer"), (State.FAILED, b"unknown")):
        key = RecordKey(KEY.slot, state.value)
        assert (await store.claim(key, "fp", "a", LOCK, RESULT)).claimed
        assert await store.complete(key, "a", "fp", state, payload, RESULT)
        again = await store.claim(key, "fp", "a", LOCK, RESULT)
        assert not again.claimed and again.record is not None
        assert (again.record.state, again.record.payload) == (state, payload)
        kept = await store.get(key)
        assert kept is not None and (kept.state, kept.payload) == (state, payload)


async def test_concurrent_claims_have_exactly_one_winner(store: Store) -> None:
    claims = await asyncio.gather(
        *(store.claim(KEY, "fp", f"owner-{i}", LOCK, RESULT) for i in range(50))
    )
    assert sum(c.claimed for c in claims) == 1


async def test_hundreds_of_simultaneous_operations_all_get_an_answer(store: Store) -> None:
    keys = [RecordKey(f"slot-{i}", "n") for i in range(500)]
    claims = await asyncio.gather(*(store.claim(k, "fp", "a", LOCK, RESULT) for k in keys))
    assert all(c.claimed for c in claims)
    done = await asyncio.gather(
        *(store.complete(k, "a", "fp", State.COMPLETED, b"x", RESULT) for k in keys)
    )
    assert all(done)


async def test_complete_then_replay(store: Store) -> None:
    await store.claim(KEY, "fp", "a", LOCK, RESULT)
    assert await store.complete(KEY, "a", "fp", State.COMPLETED, b"payload\x00\xff", RESULT)
    found = await store.claim(KEY, "fp", "b", LOCK, RESULT)
    assert found.record is not None
    assert found.record.state is State.COMPLETED
    assert found.record.payload == b"payload\x00\xff"
    assert LOCK < found.record.ttl <= RESULT
    got = await store.get(KEY)
    assert got is not None and got.payload == b"payload\x00\xff"


async def test_failed_is_kept_like_completed(store: Store) -> None:
    await store.claim(KEY, "fp", "a", LOCK, RESULT)
    assert await store.complete(KEY, "a", "fp", State.FAILED, b"problem", RESULT)
    found = await store.claim(KEY, "fp", "b", LOCK, RESULT)
    assert found.record is not None and found.record.state is State.FAILED


async def test_a_claim_counts_the_replays_it_serves(store: Store) -> None:
    """A finished record handed back with the caller's fingerprint is a replay served,
    counted by the claim itself; a 409 (in progress) and a 422 (another body) are not."""
    assert (await store.claim(KEY, "fp", "a", LOCK, RESULT)).claimed
    running = await store.claim(KEY, "fp", "b", LOCK, RESULT)  # a 409
    assert running.record is not None and running.record.replays == 0
    assert await store.complete(KEY, "a", "fp", State.COMPLETED, b"done", RESULT)
    first = await store.claim(KEY, "fp", "c", LOCK, RESULT)
    assert first.record is not None and first.record.replays == 1
    other = await store.claim(KEY, "other-fp", "d", LOCK, RESULT)  # a 422
    assert other.record is not None and other.record.replays == 1
    second = await store.claim(KEY, "fp", "a", LOCK, RESULT)  # its own owner's retry too
    assert second.record is not None and second.record.replays == 2
    unserved = await store.claim(KEY, "fp", "job", LOCK, RESULT, replay=False)
    assert unserved.record is not None and unserved.record.replays == 2
    got = await store.get(KEY)
    assert got is not None and got.replays == 2
    assert [r.replays for r in await store.records(KEY.scope)] == [2]
    cursor, seen = "", []
    while True:
        cursor, page = await store.scan(cursor, 10)
        seen += [r.replays for r in page if r.key == KEY]
        if not cursor:
            break
    assert seen == [2]


async def test_the_replay_count_starts_afresh_with_a_new_claim_and_survives_a_settle(
    store: Store,
) -> None:
    await store.claim(KEY, "fp", "a", LOCK, RESULT)
    await store.complete(KEY, "a", "fp", State.FAILED, b"unknown", RESULT)
    failed = await store.claim(KEY, "fp", "b", LOCK, RESULT)  # a FAILED outcome replayed
    assert failed.record is not None and failed.record.replays == 1
    assert await store.settle(KEY, State.COMPLETED, b"resolved", RESULT)
    settled = await store.get(KEY)
    assert settled is not None and settled.replays == 1
    assert await store.delete(KEY)
    assert (await store.claim(KEY, "fp", "c", LOCK, RESULT)).claimed
    fresh = await store.get(KEY)
    assert fresh is not None and fresh.replays == 0


async def test_a_lapsed_lease_found_counts_as_a_replay_of_its_unknown_outcome(
    store: Store, later: Later
) -> None:
    await store.claim(KEY, "fp", "a", 0.2, RESULT)
    await later(0.35)
    lapsed = await store.claim(KEY, "fp", "b", LOCK, RESULT)
    assert lapsed.record is not None and lapsed.record.lapsed and lapsed.record.replays == 1
    assert await store.complete(KEY, "a", "fp", State.COMPLETED, b"late", RESULT)
    late = await store.get(KEY)  # the late outcome keeps the count of what was served
    assert late is not None and (late.payload, late.replays) == (b"late", 1)


async def test_an_outcome_that_must_not_replace_one_is_written_only_where_none_is(
    store: Store,
) -> None:
    """``replace_outcome=False`` (a job's taker concluding "unknown"): over the owner's
    IN_PROGRESS record, or where the record is gone, it is written; over an outcome the
    owner recorded meanwhile, it is not, and the outcome stays."""
    other = RecordKey(KEY.slot, "other")
    await store.claim(KEY, "fp", "a", LOCK, RESULT)
    assert await store.complete(KEY, "a", "fp", State.COMPLETED, b"answer", RESULT)
    unknown = (State.FAILED, b"unknown", RESULT)
    assert not await store.complete(KEY, "a", "fp", *unknown, replace_outcome=False)
    kept = await store.get(KEY)
    assert kept is not None and kept.state is State.COMPLETED and kept.payload == b"answer"
    await store.claim(other, "fp", "a", LOCK, RESULT)
    assert await store.complete(other, "a", "fp", *unknown, replace_outcome=False)
    failed = await store.get(other)
    assert failed is not None and failed.state is State.FAILED
    gone = RecordKey(KEY.slot, "gone")
    assert await store.complete(gone, "a", "fp", *unknown, replace_outcome=False)
    written = await store.get(gone)
    assert written is not None and written.payload == b"unknown"


async def test_a_successor_fences_the_owner_it_took_the_record_from(
    store: Store, later: Later
) -> None:
    """A job's taker records "unknown" as its own (``successor``): the first attempt's
    late answer no longer replaces it, nor may that attempt renew or release it. Over a
    lapsed lease (FAILED, empty payload: no outcome) it is written too."""
    unknown = (State.FAILED, b"unknown", RESULT)
    await store.claim(KEY, "fp", "a", LOCK, RESULT)
    assert await store.complete(KEY, "a", "fp", *unknown, replace_outcome=False, successor="t")
    assert not await store.complete(KEY, "a", "fp", State.COMPLETED, b"late", RESULT)
    assert not await store.renew(KEY, "a", LOCK, RESULT)
    assert not await store.release(KEY, "a")
    kept = await store.get(KEY)
    assert kept is not None and (kept.state, kept.owner, kept.payload) == (
        State.FAILED,
        "t",
        b"unknown",
    )
    lapsed = RecordKey(KEY.slot, "lapsed")
    await store.claim(lapsed, "fp", "a", 0.2, RESULT)
    await later(0.35)
    assert not (await store.claim(lapsed, "fp", "b", LOCK, RESULT)).claimed  # FAILED, empty
    assert await store.complete(lapsed, "a", "fp", *unknown, replace_outcome=False, successor="t")
    assert not await store.complete(lapsed, "a", "fp", State.COMPLETED, b"late", RESULT)
    fenced = await store.get(lapsed)
    assert fenced is not None and (fenced.owner, fenced.payload) == ("t", b"unknown")


async def test_only_the_owner_may_renew_complete_or_release(store: Store) -> None:
    await store.claim(KEY, "fp", "a", LOCK, RESULT)
    assert not await store.renew(KEY, "b", LOCK, RESULT)
    assert not await store.complete(KEY, "b", "fp", State.COMPLETED, b"x", RESULT)
    assert not await store.release(KEY, "b")
    record = await store.get(KEY)
    assert record is not None and record.state is State.IN_PROGRESS and record.owner == "a"
    assert await store.renew(KEY, "a", LOCK, RESULT)
    assert await store.release(KEY, "a")
    assert await store.get(KEY) is None
    assert (await store.claim(KEY, "fp", "b", LOCK, RESULT)).claimed


async def test_a_completed_record_cannot_be_released(store: Store) -> None:
    await store.claim(KEY, "fp", "a", LOCK, RESULT)
    await store.complete(KEY, "a", "fp", State.COMPLETED, b"x", RESULT)
    assert not await store.release(KEY, "a")
    assert not await store.renew(KEY, "a", LOCK, RESULT)
    assert (await store.get(KEY)) is not None


async def test_a_lapsed_lease_is_failed_not_a_free_key(store: Store, later: Later) -> None:
    """The proxy that claimed may have sent the call: a claim after its lease lapsed
    finds a FAILED record (empty payload: lapsed), never a free key."""
    await store.claim(KEY, "fp", "a", 0.2, RESULT)
    await later(0.35)
    held = await store.get(KEY)
    assert held is not None and held.state is State.IN_PROGRESS and held.ttl == 0
    found = await store.claim(KEY, "fp", "b", LOCK, RESULT)
    assert not found.claimed and found.record is not None
    assert (found.record.state, found.record.owner, found.record.lapsed) == (
        State.FAILED,
        "a",
        True,
    )
    assert LOCK < found.record.ttl <= RESULT  # the record outlives its lease
    again = await store.claim(KEY, "fp", "c", LOCK, RESULT)
    assert again.record is not None and again.record.lapsed
    assert not await store.renew(KEY, "a", LOCK, RESULT)  # too late to renew


async def test_the_late_outcome_of_a_lapsed_lease_is_recorded(store: Store, later: Later) -> None:
    await store.claim(KEY, "fp", "a", 0.2, RESULT)
    await later(0.35)
    assert not (await store.claim(KEY, "fp", "b", LOCK, RESULT)).claimed  # now FAILED
    assert await store.complete(KEY, "a", "fp", State.COMPLETED, b"late", RESULT)
    record = await store.get(KEY)
    assert record is not None and (record.state, record.payload) == (State.COMPLETED, b"late")


async def test_the_owner_of_a_lapsed_lease_may_still_release_it(store: Store, later: Later) -> None:
    """It knows nothing was sent (say, no connection could be made)."""
    await store.claim(KEY, "fp", "a", 0.2, RESULT)
    await later(0.35)
    assert not (await store.claim(KEY, "fp", "b", LOCK, RESULT)).claimed
    assert not await store.release(KEY, "b")
    assert await store.release(KEY, "a")
    assert (await store.claim(KEY, "fp", "c", LOCK, RESULT)).claimed


async def test_reexecute_lapsed_claims_it_and_fences_the_old_owner(
    store: Store, later: Later
) -> None:
    await store.claim(KEY, "fp", "a", 0.2, RESULT)
    await later(0.35)
    assert (await store.claim(KEY, "fp", "b", LOCK, RESULT, reexecute_lapsed=True)).claimed
    assert not await store.complete(KEY, "a", "fp", State.COMPLETED, b"stale", RESULT)
    assert not await store.renew(KEY, "a", LOCK, RESULT)
    assert await store.complete(KEY, "b", "fp", State.COMPLETED, b"fresh", RESULT)
    record = await store.get(KEY)
    assert record is not None and record.payload == b"fresh"


async def test_reexecute_lapsed_never_takes_a_live_lease(store: Store) -> None:
    await store.claim(KEY, "fp", "a", LOCK, RESULT)
    found = await store.claim(KEY, "fp", "b", LOCK, RESULT, reexecute_lapsed=True)
    assert found.record is not None and found.record.state is State.IN_PROGRESS


async def test_a_late_outcome_is_kept_if_nobody_took_over(store: Store, later: Later) -> None:
    await store.claim(KEY, "fp", "a", 0.2, RESULT)
    await later(0.35)
    assert await store.complete(KEY, "a", "fp", State.COMPLETED, b"late", RESULT)
    found = await store.claim(KEY, "fp", "b", LOCK, RESULT)
    assert found.record is not None
    assert (found.record.state, found.record.payload, found.record.fingerprint) == (
        State.COMPLETED,
        b"late",
        "fp",
    )


async def test_renewal_keeps_the_lease(store: Store, later: Later) -> None:
    await store.claim(KEY, "fp", "a", 0.3, RESULT)
    for _ in range(3):
        await later(0.15)
        assert await store.renew(KEY, "a", 0.3, RESULT)
    live = await store.claim(KEY, "fp", "b", LOCK, RESULT)  # 0.45 s > 0.3 s
    assert live.record is not None and live.record.state is State.IN_PROGRESS
    await later(0.45)  # no renewal now: the lease lapses
    lapsed = await store.claim(KEY, "fp", "b", LOCK, RESULT)
    assert lapsed.record is not None and lapsed.record.lapsed


async def test_renewal_keeps_a_long_call_past_its_result_ttl(store: Store, later: Later) -> None:
    """A call renewed for longer than result_ttl still has its record."""
    await store.claim(KEY, "fp", "a", 0.3, 0.4)
    for _ in range(5):
        await later(0.2)
        assert await store.renew(KEY, "a", 0.3, 0.4)
    record = await store.get(KEY)
    assert record is not None and record.state is State.IN_PROGRESS and record.owner == "a"


async def test_results_expire(store: Store, later: Later) -> None:
    await store.claim(KEY, "fp", "a", 0.2, 0.3)
    await store.complete(KEY, "a", "fp", State.COMPLETED, b"x", 0.3)
    await later(0.2)  # past the lease, within result_ttl
    found = await store.get(KEY)
    assert found is not None and found.state is State.COMPLETED
    await later(0.25)
    assert await store.get(KEY) is None
    assert (await store.claim(KEY, "fp", "b", LOCK, RESULT)).claimed


async def test_sweep_removes_expired_records(store: Store, later: Later) -> None:
    live = RecordKey("live", "n")
    await store.claim(KEY, "fp", "a", 0.1, 0.1)
    await store.claim(live, "fp", "a", LOCK, RESULT)
    await later(0.2)
    swept = await store.sweep()
    if isinstance(store, MemoryStore | SQLiteStore | PostgresStore):
        assert swept == 1
        assert gone(store, KEY) and not gone(store, live)
    else:
        assert swept == 0  # Redis expires keys itself
    assert await store.get(KEY) is None
    assert await store.get(live) is not None
    assert await store.sweep() == 0  # nothing expired is left


async def test_records_lists_one_scope_from_its_index(store: Store, later: Later) -> None:
    plan = "route|anon|plan-7"
    steps = [RecordKey(f"{plan}|{n}", name) for n, name in ((1, "h1"), (2, "h2"), (2, "h3"))]
    for key in steps:
        assert (await store.claim(key, "fp", "a", LOCK, RESULT)).claimed
    await store.claim(RecordKey("route|anon|other|1", "h1"), "fp", "a", LOCK, RESULT)
    await store.complete(steps[0], "a", "fp", State.COMPLETED, b"done", RESULT)
    short = RecordKey(f"{plan}|3", "h4")
    await store.claim(short, "fp", "a", 0.1, 0.2)
    listed = await store.records(plan)
    assert {r.key for r in listed} == {*steps, short}
    first = next(r for r in listed if r.key == steps[0])
    assert (first.state, first.payload) == (State.COMPLETED, b"done")
    assert 0 < first.created_at <= first.updated_at
    await later(0.3)  # the short record expires and leaves the listing
    assert {r.key for r in await store.records(plan)} == set(steps)
    assert await store.records("route|anon|nothing") == []


async def test_scan_visits_every_record_in_bounded_pages(store: Store) -> None:
    keys = {RecordKey(f"route|p|plan-{i}|1", "h") for i in range(25)}
    for key in keys:
        await store.claim(key, "fp", "a", LOCK, RESULT)
    seen: set[RecordKey | None] = set()
    cursor, calls = "", 0
    while True:
        cursor, page = await store.scan(cursor, 10)
        seen.update(r.key for r in page)
        calls += 1
        if not cursor:
            break
    assert seen == keys
    assert calls >= 2


async def test_settle_resolves_failed_records_only(store: Store) -> None:
    await store.claim(KEY, "fp", "a", LOCK, RESULT)
    assert not await store.settle(KEY, State.COMPLETED, b"x", RESULT)  # IN_PROGRESS
    await store.complete(KEY, "a", "fp", State.FAILED, b"unknown", RESULT)
    assert await store.settle(KEY, State.COMPLETED, b"resolved", RESULT)
    record = await store.get(KEY)
    assert record is not None and (record.state, record.payload) == (State.COMPLETED, b"resolved")
    assert not await store.settle(KEY, None, b"", RESULT)  # COMPLETED now
    other = RecordKey("route|anon|plan|2", "b" * 64)
    await store.claim(other, "fp", "a", LOCK, RESULT)
    await store.complete(other, "a", "fp", State.FAILED, b"unknown", RESULT)
    assert await store.settle(other, None, b"", RESULT)  # released: a retry executes
    assert (await store.claim(other, "fp", "b", LOCK, RESULT)).claimed


async def test_delete_removes_a_record_in_any_state(store: Store) -> None:
    await store.claim(KEY, "fp", "a", LOCK, RESULT)
    assert await store.delete(KEY)
    assert not await store.delete(KEY)
    assert await store.get(KEY) is None
    assert (await store.claim(KEY, "fp", "b", LOCK, RESULT)).claimed


async def test_claim_reports_the_previous_name_in_the_slot(store: Store) -> None:
    first = await store.claim(RecordKey("slot", "h1"), "h1", "a", LOCK, RESULT)
    assert first.claimed and first.previous is None
    second = await store.claim(RecordKey("slot", "h2"), "h2", "b", LOCK, RESULT)
    assert second.claimed and second.previous == "h1"
    again = await store.claim(RecordKey("slot", "h3"), "h3", "c", LOCK, RESULT)
    assert again.previous == "h2"


async def test_records_are_independent(store: Store) -> None:
    assert (await store.claim(RecordKey("s1", "n"), "fp", "a", LOCK, RESULT)).claimed
    assert (await store.claim(RecordKey("s2", "n"), "fp", "a", LOCK, RESULT)).claimed
    assert (await store.claim(RecordKey("s1", "m"), "fp", "a", LOCK, RESULT)).claimed


async def test_ping_answers_on_a_reachable_store(store: Store) -> None:
    await store.ping()  # raises StoreUnavailable when the store cannot be reached (below)
    assert (await store.claim(KEY, "fp", "a", LOCK, RESULT)).claimed


async def test_unreachable_redis_raises_store_unavailable() -> None:
    store = make_store(f"redis://127.0.0.1:{free_port()}/0")
    with pytest.raises(StoreUnavailable):
        await store.claim(KEY, "fp", "a", LOCK, RESULT)
    with pytest.raises(StoreUnavailable):
        await store.ping()
    await store.close()


async def test_redis_reconnects_after_a_restart() -> None:
    server = RedisServer().start()
    store = make_store(server.url)
    try:
        assert (await store.claim(KEY, "fp", "a", LOCK, RESULT)).claimed
        server.stop()
        with pytest.raises(StoreUnavailable):
            await store.claim(KEY, "fp", "b", LOCK, RESULT)
        server.start()
        assert (await store.claim(RecordKey("s", "n"), "fp", "b", LOCK, RESULT)).claimed
    finally:
        await store.close()
        server.stop()


async def test_redis_resends_a_batch_when_its_connection_is_cut(
    redis_server: RedisServer,
) -> None:
    """Commands on a connection Redis closes are sent again on a new one, and each
    caller gets its own reply (the scripts are idempotent for the same owner)."""
    redis_server.flush()
    store = make_store(redis_server.url)
    try:
        keys = [RecordKey("cut", f"n{i}") for i in range(20)]
        assert all([(await store.claim(k, "fp", "a", LOCK, RESULT)).claimed for k in keys])
        admin = redis.Redis.from_url(redis_server.url)
        admin.client_kill_filter(_type="normal", skipme=True)  # the store's connection too
        admin.close()
        claims = await asyncio.gather(*(store.claim(k, "fp", "a", LOCK, RESULT) for k in keys))
        assert all(c.claimed for c in claims)  # the same owner: still its claims
        others = await asyncio.gather(*(store.claim(k, "fp", "b", LOCK, RESULT) for k in keys))
        assert not any(c.claimed for c in others)
    finally:
        await store.close()


async def test_redis_reloads_its_scripts_for_a_whole_batch(redis_server: RedisServer) -> None:
    """After SCRIPT FLUSH (a restarted Redis) every command of a batch fails alone with
    NOSCRIPT; each is loaded and sent again, and every caller gets its own answer."""
    redis_server.flush()
    store = make_store(redis_server.url)
    try:
        assert (await store.claim(KEY, "fp", "a", LOCK, RESULT)).claimed  # scripts loaded
        admin = redis.Redis.from_url(redis_server.url)
        admin.script_flush()
        admin.close()
        keys = [RecordKey("flushed", f"n{i}") for i in range(20)]
        claims = await asyncio.gather(*(store.claim(k, "fp", "a", LOCK, RESULT) for k in keys))
        assert all(c.claimed for c in claims)
        assert not (await store.claim(keys[0], "fp", "b", LOCK, RESULT)).claimed
    finally:
        await store.close()


@pytest.mark.parametrize("synchronous", ["full", "normal"])
async def test_sqlite_counts_replays_whatever_its_synchronous(
    tmp_path: Path, synchronous: str
) -> None:
    """Under ``full`` the count is a transaction of its own that does not wait for the
    disk (it would sync the WAL at every replay); under ``normal``, in the claim's."""
    store = make_store(f"sqlite://{tmp_path}/state.db?synchronous={synchronous}")
    await store.open()
    try:
        await store.claim(KEY, "fp", "a", LOCK, RESULT)
        await store.complete(KEY, "a", "fp", State.COMPLETED, b"done", RESULT)
        for n in (1, 2):
            found = await store.claim(KEY, "fp", "b", LOCK, RESULT)
            assert found.record is not None and found.record.replays == n
        got = await store.get(KEY)
        assert got is not None and got.replays == 2
        assert isinstance(store, SQLiteStore)  # its connection is back to its own level
        level = await store._run(lambda: store._conn().execute("PRAGMA synchronous").fetchone())
        assert level == ({"full": 2, "normal": 1}[synchronous],)
    finally:
        await store.close()


async def test_sqlite_adds_the_replays_column_to_a_file_of_an_earlier_release(
    tmp_path: Path,
) -> None:
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as db:
        db.execute(
            "CREATE TABLE step_records (slot TEXT NOT NULL, name TEXT NOT NULL,"
            " scope TEXT NOT NULL, state TEXT NOT NULL, fingerprint TEXT NOT NULL,"
            " owner TEXT NOT NULL, lease_until REAL NOT NULL DEFAULT 0,"
            " expires_at REAL NOT NULL, created_at REAL NOT NULL, updated_at REAL NOT NULL,"
            " payload BLOB NOT NULL DEFAULT x'', PRIMARY KEY (slot, name)) WITHOUT ROWID"
        )
        db.execute(
            "INSERT INTO step_records VALUES (?, ?, ?, 'completed', 'fp', 'a', 0, 9e9, 1, 1,"
            " x'00')",
            (*KEY, KEY.scope),
        )
    store = make_store(f"sqlite://{path}")
    await store.open()
    try:
        found = await store.claim(KEY, "fp", "b", LOCK, RESULT)
        assert found.record is not None and found.record.replays == 1
    finally:
        await store.close()


async def test_sqlite_survives_a_restart(tmp_path: Path) -> None:
    url = f"sqlite://{tmp_path}/state.db"
    first = make_store(url)
    await first.open()
    await first.claim(KEY, "fp", "a", LOCK, RESULT)
    await first.complete(KEY, "a", "fp", State.COMPLETED, b"kept", RESULT)
    await first.close()
    second = make_store(url)
    await second.open()
    record = await second.get(KEY)
    await second.close()
    assert record is not None and record.payload == b"kept"


async def test_sqlite_shared_by_two_connections_has_one_winner(tmp_path: Path) -> None:
    url = f"sqlite://{tmp_path}/state.db"
    stores = [make_store(url), make_store(url)]
    for s in stores:
        await s.open()
    claims = await asyncio.gather(
        *(stores[i % 2].claim(KEY, "fp", f"o{i}", LOCK, RESULT) for i in range(40))
    )
    for s in stores:
        await s.close()
    assert sum(c.claimed for c in claims) == 1


async def test_sqlite_unusable_path_is_store_unavailable(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    store = make_store(f"sqlite://{blocker}/state.db")
    with pytest.raises(StoreUnavailable, match="sqlite"):
        await store.open()
    with pytest.raises(StoreUnavailable, match="sqlite"):
        await store.ping()  # readyz says 503
    await store.close()


async def test_sqlite_failed_commit_is_rolled_back(tmp_path: Path) -> None:
    """A COMMIT that fails (disk full, I/O error) must not leave the transaction open:
    every later BEGIN would fail, and the write lock would stay held."""
    schema = SQLiteStore(f"sqlite://{tmp_path}/state.db")
    await schema.open()
    await schema.close()
    store = SQLiteStore(f"sqlite://{tmp_path}/state.db")
    failures = [sqlite3.OperationalError("database or disk is full")]

    class FailingCommit(sqlite3.Connection):
        def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
            if sql == "COMMIT" and failures:
                raise failures.pop()
            return super().execute(sql, *args)

    store._db = sqlite3.connect(
        store.path, isolation_level=None, factory=FailingCommit, check_same_thread=False
    )
    try:
        with pytest.raises(StoreUnavailable, match="disk is full"):
            await store.claim(KEY, "fp", "a", LOCK, RESULT)
        assert await store.get(KEY) is None  # rolled back
        assert (await store.claim(KEY, "fp", "b", LOCK, RESULT)).claimed
    finally:
        await store.close()


async def test_redis_keys_share_a_hash_tag() -> None:
    from proxy.store.redis import _names, index_key, record_key, slot_key

    key = RecordKey("route|anon|plan|1", "h")
    tags = {record_key(key).split("}")[0], slot_key(key).split("}")[0]}
    assert tags == {index_key(key.scope).split("}")[0]} == {"tp:{route|anon|plan"}
    for one in (key, RecordKey("no-bar", "n")):  # the hot path's names are the same keys
        assert _names(one) == (
            record_key(one),
            slot_key(one),
            index_key(one.scope),
            f"{one.step}:{one.name}",
        )


async def test_shared_values_expire(store: Store, later: Later) -> None:
    assert await store.get_value("token|r|p") is None
    await store.put_value("token|r|p", b"\x00sealed\xff", 0.3)
    assert await store.get_value("token|r|p") == b"\x00sealed\xff"
    await later(0.45)
    assert await store.get_value("token|r|p") is None


async def test_locks_have_one_holder_and_expire(store: Store, later: Later) -> None:
    results = await asyncio.gather(*(store.acquire("fetch", f"o{i}", 0.3) for i in range(20)))
    assert sum(results) == 1
    holder = f"o{results.index(True)}"
    assert await store.acquire("fetch", holder, 0.3)  # re-entrant for its holder
    await store.unlock("fetch", "someone-else")
    assert not await store.acquire("fetch", "late", 0.3)
    await store.unlock("fetch", holder)
    assert await store.acquire("fetch", "late", 0.2)
    assert not await store.acquire("fetch", "later", 0.2)
    await later(0.35)
    assert await store.acquire("fetch", "later", 0.2)


async def test_settle_is_fenced_by_the_owner_it_saw(store: Store) -> None:
    """A slow look-up must not settle a newer failure of another call."""
    await store.claim(KEY, "fp", "a", LOCK, RESULT)
    await store.complete(KEY, "a", "fp", State.FAILED, b"unknown", RESULT)
    assert not await store.settle(KEY, None, b"", RESULT, owner="b")
    assert not await store.settle(KEY, State.COMPLETED, b"x", RESULT, owner="b")
    assert await store.settle(KEY, None, b"", RESULT, owner="a")
    assert await store.get(KEY) is None
