"""Redis Cluster under guarded calls: a slot migrated while they run loses nothing and
executes nothing twice (the store follows ASK, waits out TRYAGAIN, follows MOVED)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import redis
from redis.crc import key_slot

from tests.conftest import ProxyFactory, new_key, route
from tests.servers import CountingTool, RedisCluster, replica_synced, wait_for

PLAN = "plan-migrating"
CALLS = 24


def _node(port: int) -> redis.Redis:
    return redis.Redis(port=port)


def _do(node: redis.Redis, *command: object) -> Any:
    """One command to one node (CLUSTER ..., which redis-py leaves untyped)."""
    return node.execute_command(*command)  # type: ignore[no-untyped-call]


def _slot_owner(cluster: RedisCluster, slot: int) -> int:
    """The port of the primary that serves ``slot``, as every node sees it."""
    owners = set()
    for port in cluster.primaries():
        for start, end, primary, *_ in _do(_node(port), "CLUSTER", "SLOTS"):
            if start <= slot <= end:
                owners.add(int(primary[1]))
    assert len(owners) == 1, owners
    return owners.pop()


def _record_slot(cluster: RedisCluster) -> int:
    """The slot of the plan's records (one hash tag per step's scope)."""
    for port in cluster.primaries():
        for name in _node(port).scan_iter(match="tp:*:r:*"):
            if PLAN.encode() in name:
                return key_slot(name)
    raise AssertionError("no record of the plan")


class Migration(threading.Thread):
    """Moves ``slot`` from its owner to another primary a key at a time (MIGRATING and
    IMPORTING, then MIGRATE), then hands the slot over (CLUSTER SETSLOT ... NODE)."""

    def __init__(self, cluster: RedisCluster, slot: int) -> None:
        super().__init__(daemon=True)
        self.cluster, self.slot = cluster, slot
        self.source = _slot_owner(cluster, slot)
        self.target = next(p for p in cluster.primaries() if p != self.source)
        self.moved = 0
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            self._migrate()
        except Exception as exc:  # the test fails on it
            self.error = exc

    def _migrate(self) -> None:
        source, target = _node(self.source), _node(self.target)
        source_id = _do(source, "CLUSTER", "MYID").decode()
        target_id = _do(target, "CLUSTER", "MYID").decode()
        _do(target, "CLUSTER", "SETSLOT", self.slot, "IMPORTING", source_id)
        _do(source, "CLUSTER", "SETSLOT", self.slot, "MIGRATING", target_id)
        while keys := _do(source, "CLUSTER", "GETKEYSINSLOT", self.slot, 1):
            source.migrate("127.0.0.1", self.target, keys, 0, 5000)
            self.moved += len(keys)
            time.sleep(0.02)  # pace: the calls meet the slot half moved
        for port in self.cluster.primaries():
            _do(_node(port), "CLUSTER", "SETSLOT", self.slot, "NODE", target_id)


async def _call(
    client: httpx.AsyncClient, url: str, i: int, refused: list[httpx.Response]
) -> httpx.Response:
    """One guarded call, retried (same key) while the proxy answers 409 or 503 (kept in
    ``refused``)."""
    body = {"i": i}
    key = new_key(body, step=i, plan=PLAN)
    for _ in range(200):
        response = await client.post(url, json=body, headers={"Idempotency-Key": key})
        if response.status_code not in (409, 503):
            return response
        refused.append(response)
        await asyncio.sleep(0.05)
    raise AssertionError(f"call {i} never answered")


async def _run(url: str, calls: range, refused: list[httpx.Response]) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=30) as client:
        return await asyncio.gather(*(_call(client, url, i, refused) for i in calls))


def test_a_slot_migrated_during_guarded_calls_loses_nothing_and_runs_nothing_twice(
    tool: CountingTool, make_proxy: ProxyFactory, redis_cluster: RedisCluster
) -> None:
    """The slot of a plan's records moves while new calls of the plan claim keys in it
    (TRYAGAIN while its keys are split, ASK once they moved) and earlier ones are retried
    (replays, each key read where it is now), then again after the move (MOVED): each
    answered without a 503, each executed once."""
    redis_cluster.flush()
    proxy = make_proxy(route(tool.url), store=redis_cluster.url)
    url = f"{proxy.url}/tools/p?delay=0.05"
    refused: list[httpx.Response] = []
    earlier = asyncio.run(_run(url, range(CALLS), refused))  # about 2 keys each to move
    migration = Migration(redis_cluster, _record_slot(redis_cluster))
    migration.start()
    during = asyncio.run(_run(url, range(CALLS // 2, CALLS * 2), refused))
    migration.join(60)
    assert migration.error is None and not migration.is_alive() and migration.moved > CALLS
    assert _slot_owner(redis_cluster, migration.slot) == migration.target
    after = asyncio.run(_run(url, range(CALLS * 2), refused))
    assert [r.status_code for r in refused] == []  # waited out, not refused
    answers = [*earlier, *during, *after]
    assert [r.status_code for r in answers] == [200] * len(answers)
    replays = [*during[: CALLS // 2], *after]
    assert all(r.headers.get("idempotent-replayed") == "true" for r in replays)
    assert sorted(tool.executions.values()) == [1] * CALLS * 2
    first = {r.request.headers["idempotency-key"]: r.content for r in [*earlier, *during]}
    assert all(first[r.request.headers["idempotency-key"]] == r.content for r in after)


def test_a_primary_killed_during_guarded_calls_fails_closed_then_its_replica_serves(
    tool: CountingTool, make_proxy: ProxyFactory, tmp_path: Path
) -> None:
    """The primary of the plan's slot is killed while calls run (their claims replicated):
    new calls get 503 until its replica is promoted, then everything works and nothing
    ran twice. A cluster of the test's own: it loses a node."""
    cluster = RedisCluster(tmp_path).start()
    try:
        proxy = make_proxy(route(tool.url), store=cluster.url)
        url = f"{proxy.url}/tools/p?delay=0.3"
        refused: list[httpx.Response] = []
        before = asyncio.run(_run(url, range(4), refused))
        primary = _slot_owner(cluster, _record_slot(cluster))

        async def kill_during_calls() -> list[httpx.Response]:
            running = asyncio.ensure_future(_run(url, range(4, 12), refused))
            await asyncio.to_thread(wait_for, lambda: len(tool.arrived) == 12, 10, "calls sent")
            await asyncio.to_thread(wait_for, lambda: replica_synced(primary), 10, "replicated")
            killed = cluster.processes.pop(primary)
            killed.kill()
            killed.wait(10)
            late = await _run(url, range(12, 16), refused)  # while the slot has no primary
            return [*await running, *late]

        during = asyncio.run(kill_during_calls())
        assert 503 in {r.status_code for r in refused}
        assert _slot_owner(cluster, _record_slot(cluster)) != primary
        after = asyncio.run(_run(url, range(16), refused))
        answers = [*before, *during, *after]
        assert [r.status_code for r in answers] == [200] * len(answers)
        assert all(r.headers.get("idempotent-replayed") == "true" for r in after)
        assert sorted(tool.executions.values()) == [1] * 16
    finally:
        cluster.stop()
