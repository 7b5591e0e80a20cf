"""What a named resource with cached reads costs (``routes[].resource``): a write that
invalidates them, and a cache hit fenced by the resource's version, against the same
call on a route without a resource, in one run.

    PYTHONPATH=. .venv/bin/python bench/invalidation.py [--requests N] [--rounds R]

In process, as ``bench/hot_path.py`` (the ASGI app called directly, an upstream that
answers at once), on the memory store and on a real ``redis-server`` started here
(loopback). Per scenario, the best of R rounds of N sequential requests: µs of wall time
and of CPU per request, and on Redis the round trips per request (Redis's network reads,
``INFO stats``: requests go one at a time, each round trip is one read). Then the
ratios: an invalidating write against a guarded write on a route without a resource, a
fenced hit against a plain hit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from hot_path import CannedUpstream, asgi_scope, quiet_logs, receive, sender
from store_servers import redis_info, redis_usage

from proxy.app import App, create_app
from proxy.config import parse_config
from tests.servers import RedisServer

SESSION = b"session-1"
SCENARIOS = {
    # name: (method, path, guarded: a new Idempotency-Key per request)
    "write": ("POST", "/plain", True),
    "write-invalidating": ("POST", "/writes", True),
    "hit": ("GET", "/cached", False),
    "hit-fenced": ("GET", "/reads", False),
}
_KEYS = iter(range(1 << 62))


def make_app(store: str) -> App:
    named = {"name": "memory", "key": "header:x-session"}
    routes: list[dict[str, Any]] = [
        {"name": "plain", "path_prefix": "/plain", "idempotency": {"key": "opaque"}},
        {
            "name": "writes",
            "path_prefix": "/writes",
            "idempotency": {"key": "opaque"},
            "resource": named,
        },
        {"name": "cached", "path_prefix": "/cached", "cache": {"scope": "route"}},
        {"name": "reads", "path_prefix": "/reads", "cache": {"scope": "route"}, "resource": named},
    ]
    upstream = "http://127.0.0.1:9"
    config = parse_config(
        {"store": {"url": store}, "routes": [{**r, "upstream": upstream} for r in routes]},
        env={},
    )
    app = create_app(config)
    app.proxy.upstream = CannedUpstream()
    return app


def scope(scenario: str) -> dict[str, Any]:
    method, path, guarded = SCENARIOS[scenario]
    headers = [(b"host", b"127.0.0.1:8080"), (b"x-session", SESSION)]
    if method == "POST":
        headers += [(b"content-type", b"application/json"), (b"content-length", b"2")]
    if guarded:
        headers.append((b"idempotency-key", f"k{next(_KEYS)}".encode()))
    return asgi_scope(method, path, headers)


def snapshot(client: redis.Redis | None) -> list[dict[str, Any]]:
    return [] if client is None else [redis_info(client)]


async def measure(
    app: App, scenario: str, n: int, client: redis.Redis | None
) -> tuple[float, float, float]:
    """µs of wall time and of CPU per request, and Redis round trips per request."""
    send, statuses = sender()
    for _ in range(200):
        await app(scope(scenario), receive, send)
    await asyncio.sleep(0.05)  # the background releases of the warm-up
    batch = [scope(scenario) for _ in range(n)]
    statuses.clear()
    before = snapshot(client)
    wall, cpu = time.perf_counter(), time.process_time()
    for one in batch:
        await app(one, receive, send)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    await asyncio.sleep(0.05)
    # one request at a time: each round trip is one network read of Redis's (commandstats
    # cannot tell a GET sent from one a script ran)
    sent = redis_usage(before, snapshot(client), n)[1] if client is not None else 0.0
    if statuses != [200] * n:
        raise RuntimeError(f"{scenario}: unexpected statuses {sorted(set(statuses))}")
    return wall / n * 1e6, cpu / n * 1e6, sent


async def main(store: str, port: int | None, requests: int, rounds: int) -> dict[str, Any]:
    app = make_app(store)
    client = None if port is None else redis.Redis(port=port)
    await app.proxy.store.open()
    best: dict[str, list[float]] = {}
    try:
        for _ in range(rounds):
            for scenario in SCENARIOS:
                wall, cpu, sent = await measure(app, scenario, requests, client)
                old = best.get(scenario, [wall, cpu, sent])
                best[scenario] = [min(old[0], wall), min(old[1], cpu), sent]
    finally:
        await app.proxy.store.close()
    return {
        "scenarios": best,
        "write_ratio": best["write-invalidating"][0] / best["write"][0],
        "hit_ratio": best["hit-fenced"][0] / best["hit"][0],
    }


def run(requests: int, rounds: int) -> dict[str, Any]:
    import uvloop

    quiet_logs()
    results = {"memory": uvloop.run(main("memory://", None, requests, rounds))}
    with tempfile.TemporaryDirectory() as directory:
        redis = RedisServer(aof_dir=Path(directory)).start()
        try:
            results["redis"] = uvloop.run(main(redis.url, redis.port, requests, rounds))
        finally:
            redis.stop()
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args()
    results = run(args.requests, args.rounds)
    if args.json:
        print(json.dumps(results))
        raise SystemExit(0)
    for store, result in results.items():
        print(f"{store}:")
        for scenario, (wall, cpu, sent) in result["scenarios"].items():
            print(f"  {scenario:20} {wall:7.1f} µs wall {cpu:7.1f} µs CPU {sent:5.2f} round trips")
        print(f"  an invalidating write: {result['write_ratio']:.2f} x a write")
        print(f"  a fenced hit: {result['hit_ratio']:.2f} x a hit")
