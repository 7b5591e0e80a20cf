"""The proxy's own CPU per request, without sockets: a steadier measure than wrk on a
shared machine, for comparing changes to the hot path.

The app (``create_app``) is called in-process with ASGI messages, on the memory store,
with the upstream client replaced by a canned 200 answer: what is left is tool-proxy's
own code (routing, key and body checks, the state machine, the stored outcome, the
request log and metrics) plus Starlette-free ASGI glue. aiohttp, uvicorn, Redis and the
kernel are not in these numbers; ``bench/run`` measures them all together.

    .venv/bin/python bench/hot_path.py [--requests N] [--rounds R] [--traced]

``--traced`` turns tracing on as the ``OTEL_*`` variables configure it (an exporter is
needed: e.g. ``OTEL_EXPORTER_OTLP_ENDPOINT`` of a local receiver, and
``OTEL_TRACES_SAMPLER=always_on``); the exporter's thread is in the CPU counted.

Prints, for pass-through, first executions (a new key per request), replays (one key),
first executions on a route with one rate limit (``first-exec-limited``, a quota no run
reaches) and on a route with a resource lock (``first-exec-locked``, every call on the
same resource, one after the other: each takes and frees the lock), and cache hits (a
route with ``cache``, no idempotency, the same request every time: after the warm-up's
first call every request is answered from the cache), the best of R rounds of N requests,
in µs of CPU per request; the limited and locked routes' overheads as ratios against the
same run's plain first execution, and the cache hit's against its pass-through.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from proxy import forwarding, logs, tracing
from proxy.app import App, create_app
from proxy.config import parse_config
from proxy.keys import composite_key

BODY = b'{"tool":"bench","n":1}'
ANSWER = b'{"ok":true}'
UPSTREAM_HEADERS = [
    (b"Server", b"nginx/1.22.1"),
    (b"Date", b"Sun, 29 Nov 2026 12:00:00 GMT"),
    (b"Content-Type", b"application/json"),
    (b"Content-Length", b"11"),
    (b"Connection", b"keep-alive"),
]
SCENARIOS = (
    "passthrough",
    "first-exec",
    "replay",
    "first-exec-limited",
    "first-exec-locked",
    "cache-hit",
)
# A rate no benchmark run reaches: every request is admitted, and pays for the check.
BENCH_LIMIT = {"name": "rpm", "key": "principal", "rate": "1000000000/1s"}
# Every call on one resource (the body's "tool"): taken and freed once per request.
BENCH_LOCK = {"key": "json:/tool", "ttl": "30s", "wait": "10s"}
# One answer for every caller of the route (no auth here): the same request is a hit.
BENCH_CACHE = {"scope": "route", "ttl": "24h"}
# The plans of first executions, never repeated in a run (a repeated one is a replay).
_PLANS = itertools.count()


class CannedUpstream(forwarding.Upstream):
    """Answers every request at once with 200 and ``ANSWER``."""

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def send(
        self,
        method: str,
        url: str,
        headers: list[tuple[str, str]],
        body: Any,
        seconds: float,
        *,
        at_most_once: bool = False,
        connect_within: float | None = None,
    ) -> forwarding.UpstreamResponse:
        return CannedResponse(200, forwarding.response_headers(UPSTREAM_HEADERS), len(ANSWER))


class CannedResponse(forwarding.UpstreamResponse):
    async def read(self) -> bytes:
        return ANSWER


def make_app(traced: bool = False) -> App:
    routes = [
        {"name": "pass", "path_prefix": "/pass", "strip_prefix": True},
        {"name": "tool", "path_prefix": "/tool", "strip_prefix": True, "idempotency": {}},
        {
            "name": "limited",
            "path_prefix": "/limited",
            "strip_prefix": True,
            "idempotency": {},
            "limits": [BENCH_LIMIT],
        },
        {
            "name": "locked",
            "path_prefix": "/locked",
            "strip_prefix": True,
            "idempotency": {},
            "lock": BENCH_LOCK,
        },
        {"name": "cached", "path_prefix": "/cached", "strip_prefix": True, "cache": BENCH_CACHE},
    ]
    upstream = "http://127.0.0.1:9"
    config = parse_config(
        {"store": {"url": "memory://"}, "routes": [{**r, "upstream": upstream} for r in routes]},
        env={},
    )
    traces = tracing.from_env(os.environ) if traced else None
    if traced and traces is None:
        raise SystemExit("--traced: no OTEL_* variable configures an exporter")
    app = create_app(config, tracing=traces)
    app.proxy.upstream = CannedUpstream()
    return app


def scopes(scenario: str, n: int) -> list[dict[str, Any]]:
    """``n`` ASGI scopes as uvicorn makes them for wrk's requests in ``bench/run``."""
    args_hash = composite_key("bench", 1, BODY).rsplit(":", 1)[1]
    plans = (f"hot{i}" for i in _PLANS)  # new keys in every batch, warm-up and round
    paths = {
        "passthrough": "/pass",
        "first-exec-limited": "/limited",
        "first-exec-locked": "/locked",
        "cache-hit": "/cached",
    }
    path = paths.get(scenario, "/tool")
    out = []
    for _ in range(n):
        headers = [
            (b"host", b"127.0.0.1:8080"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(BODY)).encode()),
        ]
        if scenario.startswith("first-exec"):
            headers.append((b"idempotency-key", f"{next(plans)}:1:{args_hash}".encode()))
        elif scenario == "replay":
            headers.append((b"idempotency-key", f"fixed:1:{args_hash}".encode()))
        out.append(asgi_scope("POST", path, headers))
    return out


def asgi_scope(method: str, path: str, headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    """An HTTP request's ASGI scope as uvicorn makes it."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": headers,
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8080),
        "root_path": "",
    }


async def receive() -> dict[str, Any]:
    return {"type": "http.request", "body": BODY, "more_body": False}


Message = MutableMapping[str, Any]


def sender() -> tuple[Callable[[Message], Awaitable[None]], list[int]]:
    statuses: list[int] = []

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    return send, statuses


async def measure(app: App, scenario: str, n: int) -> float:
    """µs of CPU per request over ``n`` requests (after a warm-up of its own)."""
    send, statuses = sender()
    for scope in scopes(scenario, 2000):
        await app(scope, receive, send)
    batch = scopes(scenario, n)
    statuses.clear()
    started = time.process_time()
    for scope in batch:
        await app(scope, receive, send)
    spent = time.process_time() - started
    if statuses != [200] * n:
        raise RuntimeError(f"{scenario}: unexpected statuses {sorted(set(statuses))}")
    return spent / n * 1e6


async def main(requests: int, rounds: int, traced: bool = False) -> dict[str, float]:
    app = make_app(traced)
    await app.proxy.store.open()
    best: dict[str, float] = {}
    for _ in range(rounds):
        for scenario in SCENARIOS:
            value = await measure(app, scenario, requests)
            best[scenario] = min(best.get(scenario, value), value)
    await app.proxy.store.close()
    if app.proxy.tracing is not None:
        app.proxy.tracing.shutdown()
    return best


def quiet_logs() -> None:
    """Log lines are rendered as in production, then dropped."""
    devnull = open(os.devnull, "w", buffering=logs.LOG_BUFFER_BYTES)  # noqa: SIM115
    logs.configure("info", stream=devnull)


def run(requests: int = 20000, rounds: int = 3, traced: bool = False) -> dict[str, float]:
    """The best µs of CPU per request of each scenario (uvloop, as in ``serve``)."""
    import uvloop

    quiet_logs()
    return uvloop.run(main(requests, rounds, traced))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--traced", action="store_true", help="tracing on, from OTEL_*")
    args = parser.parse_args()
    best = run(args.requests, args.rounds, args.traced)
    if args.json:
        print(json.dumps(best))
    else:
        for scenario, value in best.items():
            print(f"{scenario:18} {value:6.1f} µs of CPU per request")
        ratio = best["first-exec-limited"] / best["first-exec"]
        print(f"one rate limit: {ratio:.3f} x first-exec")
        ratio = best["first-exec-locked"] / best["first-exec"]
        print(f"one resource lock: {ratio:.3f} x first-exec")
        ratio = best["cache-hit"] / best["passthrough"]
        print(f"a cache hit: {ratio:.3f} x passthrough")
