"""Long calls (``async`` routes): time to 202, operations completed per second, SSE fan-out.

A tool (uvicorn, answers after ``?delay=`` seconds), redis-server (or ``--store`` another
URL) and tool-proxy (one ``async`` route, 32 workers) run each in a process of their
own; this process is the client (aiohttp, and httpx for the SSE readers):

- **time-to-202**: 32 callers, each posting long calls (``Prefer: respond-async``, a new
  key each) one after another for ``--seconds``; p50 and p99 of the time to the 202.
  The baseline, measured in the same run at the same concurrency: the same proxy's
  pass-through of an unguarded call of the tool answering at once (``baseline``).
- **completed/s**: ``--jobs`` operations submitted at once to a tool answering at once
  (another route, with workers of its own); operations completed per second, from the
  first submit to the last one completed.
- **fan-out**: ``--subscribers`` SSE readers of one operation (a 1 s call): the seconds
  between the first and the last reader's ``completed`` event, and how often the proxy
  read the operation's events from Redis (``XRANGE``), against one reader of another
  operation.

    .venv/bin/python bench/long_calls.py [--seconds S] [--jobs N] [--subscribers K]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

import aiohttp
import httpx
import rfc8785
from processes import free_port, spawn, wait_up

CALLERS = 32
BODY = json.dumps({"task": "review", "pr": 12}).encode()
ARGS_HASH = hashlib.sha256(rfc8785.dumps(json.loads(BODY))).hexdigest()
# The sealing key of the stored requests' credentials (the proxy's own process).
SEALING_ENV = "TOOL_PROXY_BENCH_SEALING_KEY"
ASYNC = {"Prefer": "respond-async", "Content-Type": "application/json"}


def serve_tool(port: int) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def handle(request: Request) -> JSONResponse:
        await request.body()
        await asyncio.sleep(float(request.query_params.get("delay", 0)))
        return JSONResponse({"done": True})

    app = Starlette(routes=[Route("/{path:path}", handle, methods=["GET", "POST"])])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", http="httptools")


def serve_proxy(port: int, upstream: str, store: str) -> None:
    import uvicorn

    from proxy import logs
    from proxy.app import create_app
    from proxy.config import parse_config

    logs.configure("warning")

    def long_calls(name: str) -> dict[str, Any]:
        return {
            "name": name,
            "path_prefix": f"/{name}",
            "upstream": upstream,
            "strip_prefix": True,
            "idempotency": {"lock_ttl": "30s", "result_ttl": "1h"},
            "async": {"mode": "prefer", "visibility": "10s"},
            "workers": {"concurrency": 32},
        }

    plain = {"name": "plain", "path_prefix": "/plain", "upstream": upstream, "strip_prefix": True}
    routes = [long_calls("long"), long_calls("fast"), plain]
    state = tempfile.mkdtemp()
    os.environ.setdefault(SEALING_ENV, base64.b64encode(os.urandom(32)).decode())
    stored = {"url": store, "sealing_key_env": SEALING_ENV}
    config = parse_config({"store": stored, "routes": routes, "state_dir": state})
    uvicorn.run(create_app(config), host="127.0.0.1", port=port, log_level="warning")


def _spawn(*args: str) -> subprocess.Popen[bytes]:
    return spawn(__file__, *args)


def _key() -> str:
    return f"bench-{uuid.uuid4().hex[:16]}:1:{ARGS_HASH}"


def _percentiles(seconds: list[float]) -> tuple[float, float]:
    ms = sorted(s * 1000 for s in seconds)
    return statistics.median(ms), ms[max(0, int(len(ms) * 0.99) - 1)]


async def _callers(base: str, seconds: float, long: bool) -> list[float]:
    """Every call's latency, CALLERS callers calling one after another for ``seconds``
    (aiohttp: httpx's async pool was the bottleneck at 32 callers, not the proxy)."""
    latencies: list[float] = []
    deadline = time.monotonic() + seconds
    connector = aiohttp.TCPConnector(limit=CALLERS)
    async with aiohttp.ClientSession(base, connector=connector) as http:

        async def caller() -> None:
            while time.monotonic() < deadline:
                started = time.perf_counter()
                if long:
                    headers = {**ASYNC, "Idempotency-Key": _key()}
                    path, expected = "/long/run?delay=2", 202
                else:
                    headers, path, expected = {}, "/plain/run", 200
                async with http.post(path, data=BODY, headers=headers) as answer:
                    await answer.read()
                latencies.append(time.perf_counter() - started)
                if answer.status != expected:
                    raise SystemExit(f"unexpected {answer.status} for {path}")

        await asyncio.gather(*(caller() for _ in range(CALLERS)))
    return latencies


async def _completed_per_second(base: str, jobs: int) -> float:
    connector = aiohttp.TCPConnector(limit=CALLERS)
    async with aiohttp.ClientSession(base, connector=connector) as http:

        async def submit() -> str:
            headers = {**ASYNC, "Idempotency-Key": _key()}
            async with http.post("/fast/run", data=BODY, headers=headers) as answer:
                await answer.read()
                return answer.headers["Location"]

        async def ended(location: str) -> bool:
            async with http.get(location, allow_redirects=False) as answer:
                doc = await answer.json(content_type=None)
                if answer.status != 303 and doc["state"] not in ("queued", "running"):
                    raise SystemExit(f"operation ended {doc}")
                return answer.status == 303

        started = time.perf_counter()
        pending = set(await asyncio.gather(*(submit() for _ in range(jobs))))
        while pending:
            batch = sorted(pending)[:CALLERS]
            answers = await asyncio.gather(*map(ended, batch))
            for location, done in zip(batch, answers, strict=True):
                if done:
                    pending.discard(location)
        return jobs / (time.perf_counter() - started)


async def _read_until_completed(http: httpx.AsyncClient, location: str) -> float:
    headers = {"Accept": "text/event-stream"}
    async with http.stream("GET", location, headers=headers) as stream:
        async for line in stream.aiter_lines():
            if line.startswith("data:") and '"completed"' in line:
                return time.monotonic()
    raise SystemExit("the stream ended without a completed event")


async def _fan_out(base: str, subscribers: int, redis_port: int | None) -> tuple[float, int]:
    """Seconds between the first and the last reader's last event; event reads."""
    limits = httpx.Limits(max_connections=subscribers + 4)
    async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as http:
        headers = {**ASYNC, "Idempotency-Key": _key()}
        answer = await http.post("/fast/run?delay=1", content=BODY, headers=headers)
        location = answer.headers["location"]
        before = _redis_commands(redis_port)
        readers = [
            asyncio.create_task(_read_until_completed(http, location)) for _ in range(subscribers)
        ]
        ended = await asyncio.gather(*readers)
        commands = _redis_commands(redis_port) - before
        first, last = min(ended), max(ended)
        return last - first, commands


def _redis_commands(port: int | None) -> int:
    """How many times the proxy has read operations' events (``XRANGE``) so far."""
    if port is None:
        return 0
    import redis

    stats = redis.Redis(port=port).info("commandstats")
    return int(stats.get("cmdstat_xrange", {}).get("calls", 0))


def measure(options: argparse.Namespace) -> dict[str, Any]:
    tool_port, proxy_port = free_port(), free_port()
    redis_process = None
    redis_port = None
    store = options.store
    if store == "redis":
        redis_port = free_port()
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server is not installed (scripts/install installs it)")
        redis_process = subprocess.Popen(
            [binary, "--port", str(redis_port), "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
        )
        store = f"redis://127.0.0.1:{redis_port}/0"
    tool = _spawn("serve-tool", str(tool_port))
    proxy = _spawn("serve-proxy", str(proxy_port), f"http://127.0.0.1:{tool_port}", store)
    try:
        wait_up(f"http://127.0.0.1:{tool_port}/")
        base = f"http://127.0.0.1:{proxy_port}"
        wait_up(f"{base}/_proxy/healthz")
        asyncio.run(_callers(base, 1, long=False))  # warm-up
        baseline = asyncio.run(_callers(base, options.seconds, long=False))
        accepted = asyncio.run(_callers(base, options.seconds, long=True))
        completed = asyncio.run(_completed_per_second(base, options.jobs))
        one = asyncio.run(_fan_out(base, 1, redis_port))
        many = asyncio.run(_fan_out(base, options.subscribers, redis_port))
        return {
            "baseline": _percentiles(baseline),
            "time-to-202": _percentiles(accepted),
            "accepted/s": len(accepted) / options.seconds,
            "completed/s": completed,
            "fan-out": {"one": one, "many": many, "subscribers": options.subscribers},
        }
    finally:
        for process in (proxy, tool, redis_process):
            if process is not None:
                process.terminate()
                process.wait(10)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "serve-tool":
        serve_tool(int(sys.argv[2]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "serve-proxy":
        serve_proxy(int(sys.argv[2]), sys.argv[3], sys.argv[4])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--jobs", type=int, default=500)
    parser.add_argument("--subscribers", type=int, default=200)
    parser.add_argument("--store", default="redis", help="redis (started here), or a URL")
    options = parser.parse_args()
    results = measure(options)
    base50, base99 = results["baseline"]
    p50, p99 = results["time-to-202"]
    print(f"{'scenario':<24} {'p50 ms':>8} {'p99 ms':>8} {'p99/baseline':>13}")
    print(f"{'baseline (pass-through)':<24} {base50:>8.2f} {base99:>8.2f} {1.0:>13.2f}")
    print(f"{'time-to-202':<24} {p50:>8.2f} {p99:>8.2f} {p99 / base99:>13.2f}")
    print(f"accepted/s at {CALLERS} callers: {results['accepted/s']:.0f}")
    print(f"operations completed/s ({options.jobs} at once): {results['completed/s']:.0f}")
    fan = results["fan-out"]
    print(
        f"fan-out: 1 reader {fan['one'][0] * 1000:.1f} ms spread, {fan['one'][1]} event reads; "
        f"{fan['subscribers']} readers {fan['many'][0] * 1000:.1f} ms spread, "
        f"{fan['many'][1]} event reads"
    )


if __name__ == "__main__":
    main()
