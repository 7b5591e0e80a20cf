"""One contract for the job queue of ``async`` routes: memory, SQLite and a real
redis-server.

Memory and SQLite take a clock that ``later`` fast-forwards; Redis keeps time on its own
clock, so there ``later`` sleeps (holds are a few hundred milliseconds).
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from redis.asyncio import Redis
from redis.crc import key_slot

from proxy.store import Job, JobState, Queue, Store, make_queue
from proxy.store import redis as redis_store
from proxy.store.queue import job_shard
from proxy.store.redis import _SWEEP_JOBS, GROUP, ROUTES_KEY, RedisStore, queue_key
from proxy.store.sqlite import SQLiteStore
from tests.conftest import CONTRACT_STORES, Clock, Later, clocked_store, each_store_url

pytestmark = pytest.mark.anyio

VISIBILITY = 0.3
KEEP = 60.0
ACTIVE = frozenset({JobState.QUEUED, JobState.RUNNING})
QUEUED = frozenset({JobState.QUEUED})
RUNNING = frozenset({JobState.RUNNING})


# Every backend, and a Redis Cluster.
store_url = pytest.fixture(params=CONTRACT_STORES)(each_store_url)


async def kept_events(queue: Queue, id: str, after: int) -> list[Job]:
    """The events of a job that exists."""
    events = await queue.events(id, after)
    assert events is not None
    return events


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def queue(opened: Store) -> Queue:
    return make_queue(opened)


def jid(name: str, route: str = "slow") -> str:
    """A job id of ``route`` (``new_job_id``'s form) ending in ``name``."""
    return f"{job_shard(route)}~{name}"


def job(id: str = "", route: str = "slow", keep: float = KEEP) -> Job:
    return Job(
        id=id or jid("job-1", route),
        route=route,
        principal="alice",
        slot=f"{route}|alice|plan|1",
        name="abc",
        label="plan:1:abc",
        request=b"POST /run\n\nbody \x00 bytes",
        keep=keep,
    )


async def test_a_submitted_job_is_queued_with_its_first_event(queue: Queue) -> None:
    submitted = await queue.submit(job())
    stored = await queue.get(jid("job-1"))
    assert stored == submitted
    assert stored is not None
    assert (stored.state, stored.seq, stored.attempts, stored.sent) == (
        JobState.QUEUED,
        1,
        0,
        False,
    )
    assert stored.request == b"POST /run\n\nbody \x00 bytes"
    assert stored.created_at > 1e9 and stored.updated_at == stored.created_at
    assert (stored.principal, stored.slot, stored.name, stored.label) == (
        "alice",
        "slow|alice|plan|1",
        "abc",
        "plan:1:abc",
    )
    events = await kept_events(queue, jid("job-1"), 0)
    assert [(e.seq, e.state, e.request) for e in events] == [(1, JobState.QUEUED, b"")]


async def test_an_id_in_use_is_refused(queue: Queue) -> None:
    await queue.submit(job())
    with pytest.raises(ValueError, match=jid("job-1")):
        await queue.submit(job())


async def test_unknown_jobs(queue: Queue) -> None:
    assert await queue.get(jid("nope")) is None
    assert await queue.events(jid("nope"), 0) is None
    assert await queue.move(jid("nope"), ACTIVE, JobState.CANCELLED) is None
    assert not await queue.hold(jid("nope"), "w1", VISIBILITY)
    assert await queue.take("slow", "w1", VISIBILITY) is None


async def test_one_worker_takes_a_job_and_holds_it(queue: Queue) -> None:
    await queue.submit(job())
    taken = await queue.take("slow", "w1", VISIBILITY)
    assert taken is not None and taken.id == jid("job-1")
    assert taken.request == b"POST /run\n\nbody \x00 bytes"
    assert await queue.take("slow", "w2", VISIBILITY) is None
    assert await queue.hold(jid("job-1"), "w1", VISIBILITY)
    assert not await queue.hold(jid("job-1"), "w2", VISIBILITY)


async def test_routes_are_apart(queue: Queue) -> None:
    await queue.submit(job(jid("a"), "slow"))
    await queue.submit(job(jid("b", "other"), "other"))
    taken = await queue.take("other", "w1", VISIBILITY)
    assert taken is not None and taken.id == jid("b", "other")
    assert await queue.take("other", "w1", VISIBILITY) is None
    taken = await queue.take("slow", "w1", VISIBILITY)
    assert taken is not None and taken.id == jid("a")


async def test_jobs_are_taken_oldest_first(queue: Queue, later: Later) -> None:
    for id in (jid("first"), jid("second"), jid("third")):
        await queue.submit(job(id))
        await later(0.01)
    taken = [await queue.take("slow", "w1", VISIBILITY) for _ in range(3)]
    assert [t.id for t in taken if t is not None] == [jid("first"), jid("second"), jid("third")]


async def test_a_lapsed_hold_hands_the_job_to_another_as_it_was_left(
    queue: Queue, later: Later
) -> None:
    await queue.submit(job())
    await queue.take("slow", "w1", VISIBILITY)
    running = await queue.move(
        jid("job-1"), QUEUED, JobState.RUNNING, worker="w1", sent=True, attempts=1
    )
    assert running is not None and running.sent
    await later(VISIBILITY + 0.1)
    assert not await queue.hold(jid("job-1"), "w1", VISIBILITY)
    taken = await queue.take("slow", "w2", VISIBILITY)
    assert taken is not None
    assert (taken.state, taken.sent, taken.attempts) == (JobState.RUNNING, True, 1)
    assert await queue.take("slow", "w3", VISIBILITY) is None  # w2 holds it now
    assert await queue.move(jid("job-1"), RUNNING, JobState.FAILED, worker="w1") is None
    failed = await queue.move(jid("job-1"), RUNNING, JobState.FAILED, worker="w2", error=b"{}")
    assert failed is not None and failed.error == b"{}"


async def test_a_renewed_hold_is_kept(queue: Queue, later: Later) -> None:
    await queue.submit(job())
    await queue.take("slow", "w1", VISIBILITY)
    await later(0.2)
    assert await queue.hold(jid("job-1"), "w1", VISIBILITY)
    await later(0.2)  # past the first hold, within the renewed one
    assert await queue.take("slow", "w2", VISIBILITY) is None


async def test_a_taken_job_that_was_never_started_is_taken_over_queued(
    queue: Queue, later: Later
) -> None:
    await queue.submit(job())
    await queue.take("slow", "w1", VISIBILITY)
    await later(VISIBILITY + 0.1)
    taken = await queue.take("slow", "w2", VISIBILITY)
    assert taken is not None and (taken.state, taken.sent) == (JobState.QUEUED, False)


async def test_moves_compare_the_state_and_the_hold(queue: Queue) -> None:
    await queue.submit(job())
    assert await queue.move(jid("job-1"), RUNNING, JobState.COMPLETED) is None
    assert await queue.move(jid("job-1"), QUEUED, JobState.RUNNING, worker="w1") is None  # not held
    await queue.take("slow", "w1", VISIBILITY)
    assert await queue.move(jid("job-1"), QUEUED, JobState.RUNNING, worker="w2") is None
    running = await queue.move(jid("job-1"), QUEUED, JobState.RUNNING, worker="w1", attempts=1)
    assert running is not None and (running.state, running.seq, running.attempts) == (
        JobState.RUNNING,
        2,
        1,
    )
    assert await queue.hold(jid("job-1"), "w1", VISIBILITY)  # RUNNING stays held
    done = await queue.move(jid("job-1"), RUNNING, JobState.COMPLETED, worker="w1")
    assert done is not None and (done.state, done.seq) == (JobState.COMPLETED, 3)
    assert done.updated_at >= done.created_at
    assert not await queue.hold(jid("job-1"), "w1", VISIBILITY)  # ended: out of the queue
    assert await queue.take("slow", "w2", VISIBILITY) is None
    assert await queue.move(jid("job-1"), ACTIVE, JobState.CANCELLED) is None
    stored = await queue.get(jid("job-1"))
    assert stored is not None and stored.state is JobState.COMPLETED


async def test_a_queued_job_cancelled_is_never_taken(queue: Queue) -> None:
    await queue.submit(job())
    cancelled = await queue.move(jid("job-1"), QUEUED, JobState.CANCELLED)
    assert cancelled is not None and cancelled.state is JobState.CANCELLED
    assert await queue.take("slow", "w1", VISIBILITY) is None


async def test_a_cancel_between_take_and_start_wins(queue: Queue) -> None:
    await queue.submit(job())
    assert await queue.take("slow", "w1", VISIBILITY) is not None
    assert await queue.move(jid("job-1"), QUEUED, JobState.CANCELLED) is not None
    assert await queue.move(jid("job-1"), QUEUED, JobState.RUNNING, worker="w1") is None
    assert not await queue.hold(jid("job-1"), "w1", VISIBILITY)


async def test_a_job_queued_again_waits_until_it_is_due(queue: Queue, later: Later) -> None:
    await queue.submit(job())
    await queue.take("slow", "w1", VISIBILITY)
    await queue.move(jid("job-1"), QUEUED, JobState.RUNNING, worker="w1", attempts=1)
    again = await queue.move(
        jid("job-1"), RUNNING, JobState.QUEUED, worker="w1", error=b'{"status": 503}', due=0.5
    )
    assert again is not None and again.state is JobState.QUEUED and again.attempts == 1
    assert again.due >= again.updated_at + 0.45
    assert not await queue.hold(jid("job-1"), "w1", VISIBILITY)  # held by nobody
    assert await queue.take("slow", "w1", VISIBILITY) is None  # not due yet
    await later(0.6)
    taken = await queue.take("slow", "w2", VISIBILITY)
    assert taken is not None and taken.error == b'{"status": 503}'


async def test_a_job_queued_again_at_once_is_taken_at_once(queue: Queue) -> None:
    await queue.submit(job())
    await queue.take("slow", "w1", VISIBILITY)
    await queue.move(jid("job-1"), QUEUED, JobState.RUNNING, worker="w1")
    await queue.move(jid("job-1"), RUNNING, JobState.DEAD, worker="w1")
    requeued = await queue.move(jid("job-1"), frozenset({JobState.DEAD}), JobState.QUEUED)
    assert requeued is not None
    taken = await queue.take("slow", "w2", VISIBILITY)
    assert taken is not None and taken.state is JobState.QUEUED


async def test_a_spent_job_drops_its_request_and_a_dead_one_keeps_it(queue: Queue) -> None:
    """The request holds the caller's credentials: once the job ends for good (completed,
    failed, cancelled) it is never sent again and is dropped; a dead job may be requeued."""
    for state in (JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED, JobState.DEAD):
        await queue.submit(job(jid(state.value)))
        ended = await queue.move(jid(state.value), QUEUED, state)
        got = await queue.get(jid(state.value))
        assert ended is not None and got is not None
        kept = job().request if state is JobState.DEAD else b""
        assert (ended.request, got.request) == (kept, kept), state


async def test_events_keep_every_change(queue: Queue) -> None:
    await queue.submit(job())
    await queue.take("slow", "w1", VISIBILITY)
    await queue.move(jid("job-1"), QUEUED, JobState.RUNNING, worker="w1", attempts=1, sent=True)
    await queue.move(jid("job-1"), RUNNING, JobState.COMPLETED, worker="w1")
    events = await kept_events(queue, jid("job-1"), 0)
    assert [(e.seq, e.state, e.attempts) for e in events] == [
        (1, JobState.QUEUED, 0),
        (2, JobState.RUNNING, 1),
        (3, JobState.COMPLETED, 1),
    ]
    assert all(e.request == b"" and e.id == jid("job-1") for e in events)
    assert [e.seq for e in await kept_events(queue, jid("job-1"), 2)] == [3]
    assert await queue.events(jid("job-1"), 3) == []


async def test_a_job_lives_keep_seconds_past_its_last_change(queue: Queue, later: Later) -> None:
    await queue.submit(job(keep=0.5))
    await later(0.3)
    await queue.move(jid("job-1"), QUEUED, JobState.CANCELLED)
    await later(0.3)  # 0.6 s after the submit, 0.3 s after the change
    assert await queue.get(jid("job-1")) is not None
    await later(0.4)
    assert await queue.get(jid("job-1")) is None
    assert await queue.events(jid("job-1"), 0) is None  # a reader stops


async def test_list_pages_through_jobs_by_state(queue: Queue) -> None:
    for i in range(5):
        await queue.submit(job(jid(f"job-{i}")))
    for i in (1, 3):
        await queue.move(jid(f"job-{i}"), QUEUED, JobState.DEAD)
    seen: list[str] = []
    cursor = ""
    while True:
        cursor, page = await queue.list(None, cursor, 2)
        assert all(j.request == b"" for j in page)
        seen += [j.id for j in page]
        if not cursor:
            break
    assert sorted(seen) == [jid(f"job-{i}") for i in range(5)]
    dead: list[str] = []
    cursor = ""
    while True:
        cursor, page = await queue.list(JobState.DEAD, cursor, 10)
        dead += [j.id for j in page]
        if not cursor:
            break
    assert sorted(dead) == [jid("job-1"), jid("job-3")]
    assert {j.state for j in page} <= {JobState.DEAD}


async def test_changes_name_the_jobs_that_change(queue: Queue) -> None:
    seen: list[str] = []
    ready = asyncio.Event()

    async def subscribe(changes: AsyncIterator[str]) -> None:
        ready.set()
        async for id in changes:
            seen.append(id)
            if id == jid("job-2"):
                return

    listener = asyncio.create_task(subscribe(queue.changes()))
    await ready.wait()
    await asyncio.sleep(0.05)  # Redis: the subscription is made
    await queue.submit(job(jid("job-1")))
    await queue.move(jid("job-1"), QUEUED, JobState.CANCELLED)
    await queue.submit(job(jid("job-2")))
    async with asyncio.timeout(5):
        await listener
    assert seen == [jid("job-1"), jid("job-1"), jid("job-2")]


async def test_concurrent_takers_get_different_jobs(queue: Queue) -> None:
    for i in range(6):
        await queue.submit(job(jid(f"job-{i}")))
    taken = await asyncio.gather(*(queue.take("slow", f"w{i}", VISIBILITY) for i in range(8)))
    ids = [t.id for t in taken if t is not None]
    assert sorted(ids) == [jid(f"job-{i}") for i in range(6)]


async def test_new_jobs_are_taken_before_lapsed_ones(queue: Queue, later: Later) -> None:
    await queue.submit(job(jid("old")))
    await queue.take("slow", "w1", VISIBILITY)
    await later(VISIBILITY + 0.1)
    await queue.submit(job(jid("new")))
    first = await queue.take("slow", "w2", VISIBILITY)
    second = await queue.take("slow", "w3", VISIBILITY)
    assert (first and first.id, second and second.id) == (jid("new"), jid("old"))


async def test_a_retry_cancelled_while_it_waits_is_never_taken(queue: Queue, later: Later) -> None:
    await queue.submit(job())
    await queue.take("slow", "w1", VISIBILITY)
    await queue.move(jid("job-1"), QUEUED, JobState.RUNNING, worker="w1", attempts=1)
    await queue.move(jid("job-1"), RUNNING, JobState.QUEUED, worker="w1", due=0.3)
    assert await queue.move(jid("job-1"), QUEUED, JobState.CANCELLED) is not None
    await later(0.4)
    assert await queue.take("slow", "w2", VISIBILITY) is None
    stored = await queue.get(jid("job-1"))
    assert stored is not None and stored.state is JobState.CANCELLED


async def test_an_expired_job_is_not_listed_and_its_id_is_free(
    opened: Store, queue: Queue, later: Later
) -> None:
    await queue.submit(job(keep=0.3))
    await queue.take("slow", "w1", VISIBILITY)
    await later(0.4)
    await opened.sweep()
    assert await queue.list(None, "", 10) == ("", [])
    assert await queue.take("slow", "w2", VISIBILITY) is None
    again = await queue.submit(job())
    assert again.seq == 1
    assert [e.seq for e in await kept_events(queue, jid("job-1"), 0)] == [1]
    taken = await queue.take("slow", "w2", VISIBILITY)
    assert taken is not None and taken.id == jid("job-1")


async def test_two_processes_share_the_queue(store_url: str, clock: Clock, queue: Queue) -> None:
    if store_url.startswith("memory://"):
        pytest.skip("the memory store lives in one process")
    other = clocked_store(store_url, clock)  # its own connection, as another process has
    await other.open()
    try:
        theirs = make_queue(other)
        await queue.submit(job())
        taken = await theirs.take("slow", "w2", VISIBILITY)
        assert taken is not None and taken.request == job().request
        assert await queue.take("slow", "w1", VISIBILITY) is None
        assert await theirs.move(jid("job-1"), QUEUED, JobState.RUNNING, worker="w2") is not None
        stored = await queue.get(jid("job-1"))
        assert stored is not None and stored.state is JobState.RUNNING
    finally:
        await other.close()


async def test_redis_keeps_a_route_s_queue_in_one_slot_and_expiring(redis_url: str) -> None:
    """Redis specifics: a route's keys and its jobs' in one hash slot (Cluster-safe
    scripts), routes in different slots, PEXPIRE on the job and its events, the stream
    entry dropped at the end, idle consumers pruned by the sweep."""
    store = RedisStore(redis_url)
    raw = Redis.from_url(redis_url)
    shard = job_shard("slow")
    try:
        queue = store.queue()
        assert queue is store.queue()
        await queue.submit(job())
        await queue.take("slow", "w1", VISIBILITY)
        names = [name for name in await raw.keys("*") if isinstance(name, bytes)]
        assert len(names) >= 6
        slots = {key_slot(name) for name in names if name != ROUTES_KEY.encode()}
        assert slots == {key_slot(queue_key("ids", shard).encode())}
        await queue.submit(job(jid("b", "other"), "other"))
        assert key_slot(queue_key("q", job_shard("other")).encode()) not in slots
        for name in (queue_key("job", shard, jid("job-1")), queue_key("ev", shard, jid("job-1"))):
            assert 0 < await raw.pttl(name) <= KEEP * 1000
        stream = queue_key("q", shard)
        assert (await raw.xpending(stream, GROUP))["consumers"] == [{"name": b"w1", "pending": 1}]
        await queue.move(jid("job-1"), QUEUED, JobState.CANCELLED)
        assert await raw.xlen(stream) == 0
        assert (await raw.xpending(stream, GROUP))["pending"] == 0
        assert await store._script(_SWEEP_JOBS, [stream], 0) == 1  # w1
        assert await raw.xinfo_consumers(stream, GROUP) == []
        await queue.submit(job(jid("brief"), keep=0.1))
        await asyncio.sleep(0.2)
        await queue.submit(job(jid("next")))  # drops the expired id from the indexes
        assert await raw.zrange(queue_key("ids", shard), 0, -1) == [
            jid("job-1").encode(),
            jid("next").encode(),
        ]
        with pytest.raises(ValueError, match="new_job_id"):
            await queue.submit(job("job-9"))
    finally:
        await raw.aclose()
        await store.close()


async def test_redis_changes_close_their_connection(redis_url: str) -> None:
    store = RedisStore(redis_url)
    raw = Redis.from_url(redis_url)
    try:
        queue = store.queue()
        assert await queue.get(jid("job-1")) is None  # the store's own connection is made
        before = len(await raw.client_list())
        changes = queue.changes()

        async def next_change() -> str:
            return await anext(changes)

        first = asyncio.create_task(next_change())
        await asyncio.sleep(0.1)
        assert len(await raw.client_list()) == before + 1
        await queue.submit(job())
        assert await first == jid("job-1")
        await changes.aclose()  # type: ignore[attr-defined]
        await asyncio.sleep(0.1)
        assert len(await raw.client_list()) == before
    finally:
        await raw.aclose()
        await store.close()


async def test_sqlite_sweeps_expired_jobs_and_their_events(tmp_path: Path, clock: Clock) -> None:
    store = SQLiteStore(f"sqlite://{tmp_path}/state.db", clock)
    await store.open()
    try:
        queue = store.queue()
        assert queue is store.queue()
        await queue.submit(job(jid("brief"), keep=1.0))
        await queue.move(jid("brief"), QUEUED, JobState.CANCELLED)
        await queue.submit(job(jid("kept")))
        clock.now += 2
        await store.sweep()
        db = sqlite3.connect(store.path)
        try:
            assert db.execute("SELECT id FROM jobs").fetchall() == [(jid("kept"),)]
            assert db.execute("SELECT id, seq FROM job_events").fetchall() == [(jid("kept"), 1)]
        finally:
            db.close()
    finally:
        await store.close()


async def test_redis_writes_sent_again_answer_as_the_first_time(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Coalescer sends a round trip again after a connection error: a script that
    finds its own token applied answers as it did, and does nothing twice."""
    store = RedisStore(redis_url)
    try:
        queue = store.queue()
        monkeypatch.setattr(redis_store, "_token", lambda: "once")
        first = await queue.submit(job())
        assert await queue.submit(job()) == first
        taken = await queue.take("slow", "w1", VISIBILITY)
        assert taken is not None and await queue.take("slow", "w1", VISIBILITY) == taken
        monkeypatch.setattr(redis_store, "_token", lambda: "twice")
        running = await queue.move(jid("job-1"), QUEUED, JobState.RUNNING, worker="w1", attempts=1)
        assert running is not None and running.seq == 2
        again = await queue.move(jid("job-1"), QUEUED, JobState.RUNNING, worker="w1", attempts=1)
        assert again == running
        assert [e.seq for e in await kept_events(queue, jid("job-1"), 0)] == [1, 2]
        monkeypatch.setattr(redis_store, "_token", lambda: "other")
        assert await queue.move(jid("job-1"), QUEUED, JobState.RUNNING, worker="w1") is None
        with pytest.raises(ValueError, match=jid("job-1")):
            await queue.submit(job())
    finally:
        await store.close()
