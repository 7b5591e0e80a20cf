"""What ``store.durability`` costs: a guarded call's two store writes (claim, complete)
against a real primary and its replica on this machine, with and without ``WAIT``.

    PYTHONPATH=. .venv/bin/python bench/durability.py [--calls N] [--concurrency C] [--rounds R]

The store talks to the primary directly, and the replica to it (no relay). Prints, for
durability off and on (``replicas: 1``), the latency of a claim and a complete
made one after the other (median and p99, µs: the round trip, plus the replica's
acknowledgement when on), and the throughput of C concurrent callers (claims and completes
a second: the coalescer sends one ``WAIT`` per round trip, whatever it carries), and the
``WAIT`` commands Redis ran per write.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from proxy.store import Durability, RecordKey, State
from proxy.store.redis import RedisStore
from tests.servers import RedisServer, replica_acknowledges, replica_synced, wait_for


async def _call(store: RedisStore, i: int, tag: str) -> None:
    key = RecordKey(f"bench|anon|{tag}|{i}", "n")
    assert (await store.claim(key, "fp", "me", 30, 60)).claimed
    assert await store.complete(key, "me", "fp", State.COMPLETED, b"v2 200 {}", 60)


async def _sequential(store: RedisStore, calls: int, tag: str) -> list[float]:
    times = []
    for i in range(calls):
        started = time.perf_counter()
        await _call(store, i, tag)
        times.append((time.perf_counter() - started) * 1e6 / 2)  # per write
    return times


async def _concurrent(store: RedisStore, calls: int, concurrency: int, tag: str) -> float:
    queue = iter(range(calls))

    async def worker() -> None:
        for i in queue:
            await _call(store, i, tag)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return 2 * calls / (time.perf_counter() - started)


def _cli(port: int, *args: str) -> str:
    done = subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True, text=True)
    return done.stdout.strip()


def _waits(primary: RedisServer) -> int:
    for line in _cli(primary.port, "INFO", "commandstats").splitlines():
        if line.startswith("cmdstat_wait:"):
            return int(line.split("calls=")[1].split(",")[0])
    return 0


async def _measure(primary: RedisServer, calls: int, concurrency: int, rounds: int) -> None:
    settings = (("off", None), ("on", Durability(1, 0.2))) * rounds
    for n, (name, durability) in enumerate(settings):
        store = RedisStore(primary.url, durability)
        try:
            await _sequential(store, 200, f"warm-{name}-{n}")
            times = sorted(await _sequential(store, calls, f"seq-{name}-{n}"))
            before = _waits(primary)
            rate = await _concurrent(store, calls, concurrency, f"par-{name}-{n}")
            waits = (_waits(primary) - before) / (2 * calls)
        finally:
            await store.close()
        p99 = times[int(len(times) * 0.99) - 1]
        print(
            f"durability {name:3}: one at a time {statistics.median(times):6.0f} µs a write "
            f"(p99 {p99:6.0f}); {concurrency} at once {rate:8.0f} writes/s; "
            f"{waits:.3f} WAIT a write at once"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="off and on, alternating")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        primary, replica = (
            RedisServer(
                directory=Path(directory, name), options=("--repl-diskless-sync-delay", "0")
            )
            for name in ("primary", "replica")
        )
        for server in (primary, replica):
            assert server.directory is not None
            server.directory.mkdir()
            server.start()
        try:
            _cli(replica.port, "REPLICAOF", "127.0.0.1", str(primary.port))
            wait_for(lambda: replica_synced(primary.port), what="replica in sync")
            wait_for(lambda: replica_acknowledges(primary.port), what="replica acknowledging")
            asyncio.run(_measure(primary, args.calls, args.concurrency, args.rounds))
        finally:
            primary.stop()
            replica.stop()


if __name__ == "__main__":
    main()
