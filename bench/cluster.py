"""Claim + complete round trips per second: one Redis (today's coalescer), a 3-primary
Redis Cluster through a coalescer per node (``redis+cluster://``), and the same cluster
through redis-py's asyncio ``RedisCluster`` (EVALSHA of the same scripts).

    PYTHONPATH=. .venv/bin/python bench/cluster.py [--seconds 5] [--concurrency 64]

Starts its own servers on free ports (tests/servers.py); prints one line per client.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from redis.asyncio.cluster import RedisCluster as PyCluster

from proxy.store.base import RecordKey, State
from proxy.store.redis import _COMPLETE, RedisStore, _names
from proxy.store.redis_scripts import Script
from tests.servers import RedisCluster, RedisServer

Pair = Callable[[int], Awaitable[None]]


def _key(i: int) -> RecordKey:
    return RecordKey(f"bench|p|plan-{i % 997}-{secrets.token_hex(2)}|{i}", secrets.token_hex(8))


def store_pair(store: RedisStore) -> Pair:
    async def pair(i: int) -> None:
        key = _key(i)
        await store.claim(key, "fp", "owner", 30, 60)
        await store.complete(key, "owner", "fp", State.COMPLETED, b"x" * 256, 60)

    return pair


def redis_py_pair(client: PyCluster) -> Pair:
    from proxy.store.redis import _CLAIM

    async def script(s: Script, keys: list[str], *args: object) -> None:
        await client.evalsha(s.sha, len(keys), *keys, *args)  # type: ignore[arg-type]

    async def pair(i: int) -> None:
        key = _key(i)
        record, slot, index, member = _names(key)
        await script(
            _CLAIM, [record, slot, index], key.name, "fp", "owner", 30000, 60000, 0, member
        )
        args = ("owner", "completed", b"x" * 256, 60000, "fp", member, "1", "owner")
        await script(_COMPLETE, [record, index], *args)

    return pair


async def measure(pair: Pair, seconds: float, concurrency: int) -> float:
    done = 0
    deadline = time.monotonic() + seconds

    async def worker(w: int) -> None:
        nonlocal done
        i = w
        while time.monotonic() < deadline:
            await pair(i)
            done += 1
            i += concurrency

    await pair(-1)  # warm: connections made, scripts loaded
    started = time.monotonic()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return done / (time.monotonic() - started)


async def load_scripts(client: PyCluster) -> None:
    from proxy.store.redis import _CLAIM

    for s in (_CLAIM, _COMPLETE):
        await client.script_load(s.source)


async def run(seconds: float, concurrency: int, single: str, cluster: str) -> None:
    one = RedisStore(single)
    report("one redis, coalescer", await measure(store_pair(one), seconds, concurrency))
    await one.close()
    nodes = RedisStore(cluster)
    report("cluster, coalescer per node", await measure(store_pair(nodes), seconds, concurrency))
    await nodes.close()
    host, _, port = cluster.removeprefix("redis+cluster://").split(",")[0].partition(":")
    client = PyCluster(host=host, port=int(port))
    await load_scripts(client)
    report(
        "cluster, redis-py RedisCluster", await measure(redis_py_pair(client), seconds, concurrency)
    )
    await client.aclose()


def report(what: str, rate: float) -> None:
    print(f"{what + ':':32} {rate:8.0f} claim+complete pairs/s")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=64)
    options = parser.parse_args()
    server = RedisServer().start()
    cluster = RedisCluster(Path(tempfile.mkdtemp(prefix="tp-cluster-"))).start()
    try:
        asyncio.run(run(options.seconds, options.concurrency, server.url, cluster.url))
    finally:
        cluster.stop()
        server.stop()


if __name__ == "__main__":
    main()
