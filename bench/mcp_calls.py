"""MCP ``tools/call`` through tool-proxy against the same MCP server called directly.

A FastMCP server (the official SDK, Streamable HTTP, JSON answers, stateless) and
tool-proxy (memory store, one ``protocol: mcp`` route) run each in a process of their
own; this process is the client (httpx, one keep-alive connection, one call at a time):

- **direct**: ``tools/call`` to the server itself;
- **first-exec**: through the proxy, a new key in ``params._meta.idempotencyKey`` per call
  (claimed, forwarded, the JSON-RPC response recorded);
- **replay**: through the proxy, one key executed once before: every call a replay with
  its own ``id``;
- **cache-hit**: through a second route with the response cache (``cache.tools``), the
  same call without a key, answered from the cache with its own ``id`` after the first;
- **task**: through a third route with ``async``, a new key per call with ``params.task``:
  the time to the proxy's ``CreateTaskResult`` (the job kept in the store and queued; the
  route's workers run the calls meanwhile, in the same process);
- **task-2026**: the same route, the call in the 2026-07-28 tasks extension's form
  (``params._meta`` with the revision, client info and capabilities declaring
  ``io.modelcontextprotocol/tasks``, as ``@modelcontextprotocol/ext-tasks`` frames it): the
  time to the flat ``CreateTaskResult`` (``resultType: "task"``). No
  ``MCP-Protocol-Version`` header, so that the bench's server (mcp 1.x, which refuses
  2026-07-28) runs the workers' calls, as in ``task``.

    .venv/bin/python bench/mcp_calls.py [--calls N] [--rounds R]

Prints calls/s, p50 and p99 in ms per scenario (the best of R rounds), and the ratio of
calls/s to direct.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx
from processes import free_port, spawn, wait_up

HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
ARGUMENTS = {"account": "bench", "cents": 1}
EXTENSION_META = {
    "io.modelcontextprotocol/protocolVersion": "2026-07-28",
    "io.modelcontextprotocol/clientInfo": {"name": "bench", "version": "1"},
    "io.modelcontextprotocol/clientCapabilities": {
        "extensions": {"io.modelcontextprotocol/tasks": {}}
    },
}


def serve_tool(port: int) -> None:
    import uvicorn
    from mcp.server.fastmcp import FastMCP

    server = FastMCP("bench", json_response=True, stateless_http=True, log_level="WARNING")

    @server.tool()
    def charge(account: str, cents: int) -> str:
        """A trivial tool."""
        return f"charged {cents} to {account}"

    app = server.streamable_http_app()
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", http="httptools")


def serve_proxy(port: int, upstream: str) -> None:
    import uvicorn

    from proxy import logs
    from proxy.app import create_app
    from proxy.config import parse_config

    logs.configure("warning")
    route = {
        "name": "bench",
        "path_prefix": "/mcp",
        "upstream": upstream,
        "protocol": "mcp",
        "idempotency": {"key": "opaque"},
    }
    cached = {
        "name": "cached",
        "path_prefix": "/cached",
        "upstream": upstream,
        "strip_prefix": True,
        "protocol": "mcp",
        "cache": {"scope": "route", "tools": ["charge"]},
    }
    tasks = {**route, "name": "tasks", "path_prefix": "/tasks", "strip_prefix": True}
    tasks["async"] = {"mode": "prefer"}
    routes = [route, cached, tasks]
    state = tempfile.mkdtemp()
    config = parse_config({"store": {"url": "memory://"}, "routes": routes, "state_dir": state})
    uvicorn.run(create_app(config), host="127.0.0.1", port=port, log_level="warning")


def _spawn(*args: str) -> subprocess.Popen[bytes]:
    return spawn(__file__, *args)


def _call(http: httpx.Client, url: str, n: int, key: str | None, form: str = "") -> float:
    """One call; ``form``: ``task`` (``params.task``), ``task-2026`` (the extension)."""
    params: dict[str, Any] = {"name": "charge", "arguments": ARGUMENTS}
    if key is not None:
        params["_meta"] = {"idempotencyKey": key}
    task = form.startswith("task")
    if form == "task":
        params["task"] = {"ttl": 60000}
    elif form == "task-2026":
        params["_meta"] = {**params.get("_meta", {}), **EXTENSION_META}
    message = {"jsonrpc": "2.0", "id": n, "method": "tools/call", "params": params}
    started = time.perf_counter()
    answer = http.post(url, content=json.dumps(message), headers=HEADERS)
    seconds = time.perf_counter() - started
    result = answer.json()
    created = result.get("result", {})
    answered = "result" in result and (
        not task or "task" in created or created.get("resultType") == "task"
    )
    if answer.status_code != 200 or result.get("id") != n or not answered:
        raise SystemExit(f"unexpected answer ({form}): {answer.status_code} {answer.text[:200]}")
    return seconds


def _check_hit(http: httpx.Client, url: str) -> None:
    params = {"name": "charge", "arguments": ARGUMENTS}
    message = {"jsonrpc": "2.0", "id": "check", "method": "tools/call", "params": params}
    answer = http.post(url, content=json.dumps(message), headers=HEADERS)
    if answer.headers.get("cache-status") != "tool-proxy; hit":
        raise SystemExit(f"the cache-hit scenario does not hit: {answer.headers}")


def _round(
    http: httpx.Client, url: str, calls: int, keys: Any, form: str
) -> tuple[float, list[float]]:
    started = time.perf_counter()
    latencies = [_call(http, url, n, keys(n), form) for n in range(calls)]
    return calls / (time.perf_counter() - started), latencies


def measure(calls: int, rounds: int) -> dict[str, tuple[float, float, float]]:
    tool_port, proxy_port = free_port(), free_port()
    tool = _spawn("serve-tool", str(tool_port))
    proxy = _spawn("serve-proxy", str(proxy_port), f"http://127.0.0.1:{tool_port}")
    try:
        wait_up(f"http://127.0.0.1:{tool_port}/")
        wait_up(f"http://127.0.0.1:{proxy_port}/_proxy/healthz")
        direct = f"http://127.0.0.1:{tool_port}/mcp"
        proxied = f"http://127.0.0.1:{proxy_port}/mcp"
        cached = f"http://127.0.0.1:{proxy_port}/cached/mcp"
        tasks = f"http://127.0.0.1:{proxy_port}/tasks/mcp"
        plans: dict[str, tuple[str, Any, str]] = {
            "direct": (direct, lambda n: None, ""),
            "first-exec": (proxied, None, ""),
            "replay": (proxied, lambda n: "bench-replay", ""),
            "cache-hit": (cached, lambda n: None, ""),
            "task": (tasks, None, "task"),
            "task-2026": (tasks, None, "task-2026"),
        }
        results: dict[str, tuple[float, float, float]] = {}
        with httpx.Client(timeout=10) as http:
            _call(http, proxied, 0, "bench-replay")  # the replayed key, executed once
            _call(http, cached, 0, None)  # the cached answer, stored once
            _check_hit(http, cached)
            for name, (url, keys, form) in plans.items():
                best: tuple[float, list[float]] = (0.0, [])
                for r in range(rounds):
                    use = keys or (lambda n, r=r: f"bench-{r}-{n}-{time.monotonic_ns()}")
                    _round(http, url, min(50, calls), use, form)  # warm-up
                    measured = _round(http, url, calls, use, form)
                    best = max(best, measured, key=lambda b: b[0])
                rate, latencies = best
                ms = sorted(x * 1000 for x in latencies)
                results[name] = (rate, statistics.median(ms), ms[int(len(ms) * 0.99) - 1])
        return results
    finally:
        for process in (proxy, tool):
            process.terminate()
            process.wait(10)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "serve-tool":
        serve_tool(int(sys.argv[2]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "serve-proxy":
        serve_proxy(int(sys.argv[2]), sys.argv[3])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    options = parser.parse_args()
    results = measure(options.calls, options.rounds)
    base = results["direct"][0]
    print(f"{'scenario':<12} {'calls/s':>9} {'ratio':>7} {'p50 ms':>8} {'p99 ms':>8}")
    for name, (rate, p50, p99) in results.items():
        print(f"{name:<12} {rate:>9.1f} {rate / base:>7.3f} {p50:>8.2f} {p99:>8.2f}")


if __name__ == "__main__":
    main()
