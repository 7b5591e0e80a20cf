"""``store.durability``: claims and outcomes confirmed by Redis replicas (``WAIT``) before
they count. Against real redis-servers: a primary, its replica (replication through a
relay the test can cut, so that the replica lags on purpose), the primary killed with
SIGKILL and the replica promoted. With durability on, no guarded call executes twice and
no recorded outcome is lost; with it off, the same run shows the loss the docs describe."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.config import parse_config
from proxy.errors import ConfigError, StoreUnavailable
from proxy.store import Durability, RecordKey, State, make_store
from proxy.store.queue import JobState
from proxy.store.redis import RedisStore, record_key
from tests.conftest import ProxyFactory, new_key, route
from tests.servers import CountingTool, RedisCluster, RedisServer, ReplicatedRedis, wait_for
from tests.test_queue_contract import jid
from tests.test_queue_contract import job as queue_job

KEY = RecordKey("route|anon|plan|1", "a" * 64)
ON = Durability(replicas=1, timeout=0.2)
PLAN = "plan-durability"


@pytest.fixture
def redis_pair(tmp_path: Path) -> Iterator[ReplicatedRedis]:
    pair = ReplicatedRedis(tmp_path / "redis").start()
    yield pair
    pair.stop()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def durable(redis_pair: ReplicatedRedis) -> AsyncIterator[RedisStore]:
    store = RedisStore(redis_pair.url, ON)
    yield store
    await store.close()


def _on_replica(pair: ReplicatedRedis, key: RecordKey) -> str:
    """The record's state as the replica has it ('' if it has none)."""
    return pair.cli(pair.replica.port, "HGET", record_key(key), "st")


def _commands(port: int, name: str) -> int:
    """How many ``name`` commands the Redis on ``port`` ran (INFO commandstats)."""
    done = subprocess.run(
        ["redis-cli", "-p", str(port), "INFO", "commandstats"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    for line in done.stdout.splitlines():
        if line.startswith(f"cmdstat_{name}:"):
            return int(line.split("calls=")[1].split(",")[0])
    return 0


# -- the store -----------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_confirmed_claim_and_outcome_are_on_the_replica_when_they_return(
    durable: RedisStore, redis_pair: ReplicatedRedis
) -> None:
    assert (await durable.claim(KEY, "fp", "me", 5, 60)).claimed
    assert _on_replica(redis_pair, KEY) == "in_progress"
    assert await durable.renew(KEY, "me", 5, 60)
    assert await durable.complete(KEY, "me", "fp", State.COMPLETED, b"v2 200", 60)
    assert _on_replica(redis_pair, KEY) == "completed"


@pytest.mark.anyio
async def test_a_claim_no_replica_confirms_is_released_and_refused(
    durable: RedisStore, redis_pair: ReplicatedRedis
) -> None:
    redis_pair.lag()
    with pytest.raises(StoreUnavailable, match=r"claim was not confirmed \(1 replica within "):
        await durable.claim(KEY, "fp", "me", 5, 60)
    assert await durable.get(KEY) is None  # released on the primary: a retry may claim it
    redis_pair.catch_up()
    assert (await durable.claim(KEY, "fp", "me", 5, 60)).claimed


@pytest.mark.anyio
async def test_an_outcome_no_replica_confirms_is_written_but_raised_to_be_written_again(
    durable: RedisStore, redis_pair: ReplicatedRedis
) -> None:
    assert (await durable.claim(KEY, "fp", "me", 5, 60)).claimed
    redis_pair.lag()
    with pytest.raises(StoreUnavailable, match="renewal was not confirmed"):
        await durable.renew(KEY, "me", 5, 60)
    with pytest.raises(StoreUnavailable, match="outcome was not confirmed"):
        await durable.complete(KEY, "me", "fp", State.COMPLETED, b"v2 200", 60)
    record = await durable.get(KEY)
    assert record is not None and record.state is State.COMPLETED  # on the primary only
    assert _on_replica(redis_pair, KEY) == "in_progress"
    redis_pair.catch_up()  # the journal's next try: the same outcome, confirmed now
    assert await durable.complete(KEY, "me", "fp", State.COMPLETED, b"v2 200", 60)
    assert _on_replica(redis_pair, KEY) == "completed"


@pytest.mark.anyio
async def test_a_jobs_start_no_replica_confirms_is_put_back_unsent(
    durable: RedisStore, redis_pair: ReplicatedRedis
) -> None:
    """The move to RUNNING with ``sent`` is what keeps a taker from sending a job's call
    again (every attempt renews its record as the same owner): unconfirmed, it is put
    back in the queue unsent and raised, so the worker does not send; a failover can
    only lose a start that was never sent."""
    queue = durable.queue()
    submitted = await queue.submit(queue_job(jid("durable-1")))
    taken = await queue.take("slow", "w1", 30)
    assert taken is not None and taken.id == submitted.id
    redis_pair.lag()
    with pytest.raises(StoreUnavailable, match="job's start was not confirmed"):
        await queue.move(
            taken.id, frozenset({JobState.QUEUED}), JobState.RUNNING, worker="w1",
            attempts=1, sent=True,
        )  # fmt: skip
    back = await queue.get(taken.id)
    assert back is not None and back.state is JobState.QUEUED
    assert (back.sent, back.attempts) == (False, 0)
    redis_pair.catch_up()
    again = await queue.take("slow", "w2", 30)
    assert again is not None and again.id == taken.id and not again.sent
    running = await queue.move(
        again.id, frozenset({JobState.QUEUED}), JobState.RUNNING, worker="w2",
        attempts=1, sent=True,
    )  # fmt: skip
    assert running is not None and running.sent


@pytest.mark.anyio
async def test_concurrent_writes_share_one_wait_per_round_trip(
    durable: RedisStore, redis_pair: ReplicatedRedis
) -> None:
    await durable.get(KEY)  # the scripts loaded, the connection made
    before = _commands(redis_pair.primary.port, "wait")
    keys = [RecordKey(f"route|anon|plan|{i}", "n") for i in range(50)]
    claims = await asyncio.gather(*(durable.claim(k, "fp", "me", 5, 60) for k in keys))
    assert all(c.claimed for c in claims)
    waits = _commands(redis_pair.primary.port, "wait") - before
    assert 1 <= waits <= 5  # the first alone, the others in a batch or a few


@pytest.mark.anyio
async def test_aof_durability_needs_waitaof(redis_server: RedisServer) -> None:
    """Redis before 7.2 has no WAITAOF; a later one refuses it without appendonly: the
    claim fails closed with a message naming it, either way."""
    redis_server.flush()
    store = RedisStore(redis_server.url, Durability(1, 0.2, aof=True))
    try:
        with pytest.raises(StoreUnavailable, match="WAITAOF"):
            await store.claim(KEY, "fp", "me", 5, 60)
    finally:
        await store.close()


def test_durability_is_refused_where_there_are_no_replicas_to_wait_for() -> None:
    routes = [{"name": "t", "path_prefix": "/t", "upstream": "http://127.0.0.1:1"}]
    cases = {
        "memory://": "store.durability: only for Redis stores",
        "sqlite:///tmp/x.db": "store.durability: only for Redis stores",
        "postgresql://u@h/db": "store.durability: not for PostgreSQL: its own synchronous_commit",
    }
    for url, message in cases.items():
        store = {"url": url, "durability": {"replicas": 1}}
        with pytest.raises(ConfigError, match=message):
            parse_config({"store": store, "routes": routes}, env={})
    bad = {"replicas": 0, "timeout": "6s", "wait": 1}
    with pytest.raises(ConfigError) as caught:
        parse_config({"store": {"url": "redis://h:1/0", "durability": bad}, "routes": routes})
    assert caught.value.problems == [
        "store.durability.replicas: Input should be greater than or equal to 1",
        "store.durability.timeout: at most 5s: a WAIT holds back every command behind it "
        "on the connection that requests share",
        "store.durability.wait: unknown key",
    ]
    store = {"url": "redis+sentinel://h:1/m", "durability": {"replicas": 2, "aof": True}}
    config = parse_config({"store": store, "routes": routes}, env={})
    assert config.store.durable() == Durability(2, 0.2, aof=True)
    with pytest.raises(ValueError, match=r"store\.durability: only for Redis"):
        make_store("memory://", ON)


# -- guarded calls across a failover -------------------------------------------------------


async def _send(client: httpx.AsyncClient, url: str, i: int, *, retry: bool) -> httpx.Response:
    """Call ``i`` (its own key); with ``retry``, again while 409 or 503."""
    body = {"i": i}
    key = new_key(body, step=i, plan=PLAN)
    for _ in range(400):
        response = await client.post(url, json=body, headers={"Idempotency-Key": key})
        if not retry or response.status_code not in (409, 503):
            return response
        await asyncio.sleep(0.05)
    raise AssertionError(f"call {i} never answered")


async def _calls(url: str, calls: range, *, retry: bool = True) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=30) as client:
        return await asyncio.gather(*(_send(client, url, i, retry=retry) for i in calls))


def _key(i: int) -> str:
    return new_key({"i": i}, step=i, plan=PLAN)


def _problem(response: httpx.Response) -> str:
    return str(response.json().get("type", "")).rpartition(":")[2]


DONE = range(0, 3)  # recorded before replication stops
FLIGHT = range(3, 5)  # claimed before, their outcome recorded after
LATE = range(5, 7)  # claimed and recorded while the replica lags


@pytest.mark.parametrize("on", [True, False], ids=["durability-on", "durability-off"])
def test_a_primary_killed_after_claims_and_outcomes_loses_nothing_only_with_durability(
    on: bool, tool: CountingTool, make_proxy: ProxyFactory, redis_pair: ReplicatedRedis
) -> None:
    options: dict[str, Any] = {"durability": {"replicas": 1, "timeout": "200ms"}} if on else {}
    proxy = make_proxy(route(tool.url), store=redis_pair.url, store_options=options)
    url = f"{proxy.url}/tools/p"
    assert [r.status_code for r in asyncio.run(_calls(url, DONE))] == [200] * len(DONE)

    async def replica_lags_under_calls() -> tuple[list[httpx.Response], list[httpx.Response]]:
        tool.gate.clear()  # the calls in flight answer once the replica lags
        flying = asyncio.ensure_future(_calls(f"{url}?gated=1", FLIGHT))
        arrived = lambda: all(tool.arrived[_key(i)] for i in FLIGHT)  # noqa: E731
        await asyncio.to_thread(wait_for, arrived, 10, "calls sent")
        await asyncio.to_thread(wait_for, redis_pair.synced)  # their claims replicated
        redis_pair.lag()
        tool.gate.set()
        late = await _calls(url, LATE, retry=False)
        return await flying, late

    flight, late = asyncio.run(replica_lags_under_calls())
    assert [r.status_code for r in flight] == [200] * len(FLIGHT)
    redis_pair.primary.kill()  # right after those claims and outcomes
    redis_pair.promote()

    async def again() -> list[httpx.Response]:  # the same calls, the same keys
        done, flight, late = DONE, FLIGHT, LATE
        return [
            *await _calls(url, done, retry=on),
            *await _calls(f"{url}?gated=1", flight, retry=on),
            *await _calls(url, late, retry=on),
        ]

    after = asyncio.run(again())
    if on:
        # The late calls were refused before they were sent (their claims unconfirmed),
        # the outcomes in flight went to the journal and are on the promoted replica.
        assert [r.status_code for r in late] == [503] * len(LATE)
        assert {_problem(r) for r in late} == {"store-unavailable"}
        assert "not confirmed" in late[0].json()["detail"]
        assert [r.status_code for r in after] == [200] * 7
        assert all(r.headers.get("idempotent-replayed") == "true" for r in after[:5])
        assert sorted(tool.executions.values()) == [1] * 7
        assert [r.json() for r in after[3:5]] == [r.json() for r in flight]
    else:
        # The documented loss: what the replica did not have is gone with the primary.
        assert [r.status_code for r in late] == [200] * len(LATE)
        assert [tool.count(_key(i)) for i in LATE] == [2, 2]  # executed twice
        # Their recorded outcomes are lost: 409 while the replicated lease lasts, then
        # outcome-unknown, instead of the answer the callers got.
        assert {r.status_code for r in after[3:5]} <= {409, 502}, after[3].text
        assert [tool.count(_key(i)) for i in range(5)] == [1] * 5


@pytest.mark.anyio
async def test_a_cluster_confirms_each_write_on_its_slots_primary(
    redis_cluster: RedisCluster,
) -> None:
    """Each WAIT goes with its writes to their slot's primary, whose replica confirms it."""
    redis_cluster.flush()
    store = RedisStore(redis_cluster.url, Durability(1, 1.0))
    keys = [RecordKey(f"route|anon|plan-{i}|1", "n") for i in range(24)]  # over every node
    try:
        claims = await asyncio.gather(*(store.claim(k, "fp", "me", 5, 60) for k in keys))
        assert all(c.claimed for c in claims)
        done = [store.complete(k, "me", "fp", State.COMPLETED, b"v2 200", 60) for k in keys]
        assert all(await asyncio.gather(*done))
    finally:
        await store.close()
    waits = sum(_commands(port, "wait") for port in redis_cluster.primaries())
    assert waits >= len(redis_cluster.primaries())  # each primary confirmed its own
