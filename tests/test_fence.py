"""The fence at the send (issue 20, 1.1): a guarded call's lease is checked right before
its bytes go to the tool, after every wait of the route's policies, so a wait that
outlasts the lease can never end in a second execution.

Two replicas share one real Redis; the first reaches it through a relay the test cuts
(its renewals fail while it waits for a resource lock), so its call's lease lapses and a
retry through the second replica takes the key over and executes it."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests.conftest import ProxyFactory, new_key
from tests.servers import RedisServer, Relay, ThreadServer, wait_for


class GatedTool:
    """A tool whose calls on account ``slow`` wait until the test opens the gate; every
    execution is counted by its Idempotency-Key."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.executions: Counter[str] = Counter()
        self.waiting = 0
        self.app = Starlette(routes=[Route("/{path:path}", self.handle, methods=["POST"])])

    async def handle(self, request: Request) -> Response:
        body = await request.json()
        if body.get("account") == "slow":
            self.waiting += 1
            await asyncio.to_thread(self.gate.wait, 60)
        key = request.headers.get("idempotency-key", "")
        self.executions[key] += 1
        fencing = request.headers.get("fencing-token")
        return JSONResponse({"key": key, "fencing_token": fencing})


@pytest.fixture
def gated() -> Iterator[tuple[GatedTool, ThreadServer]]:
    tool = GatedTool()
    server = ThreadServer(tool.app).start()
    yield tool, server
    tool.gate.set()
    server.stop()


@pytest.fixture
def relay(redis_server: RedisServer, redis_url: str) -> Iterator[Relay]:
    relay = Relay(redis_server.port).start()
    yield relay
    relay.stop()


def _route(upstream: str) -> dict[str, Any]:
    return {
        "name": "charge",
        "path_prefix": "/tools",
        "upstream": upstream,
        "timeout": "30s",
        "idempotency": {
            "lock_ttl": "1s",
            "result_ttl": "1h",
            "retry_after": "1s",
            "on_lapsed_lease": "reexecute",  # a retry takes a lapsed key over and runs it
        },
        # the resource lock: one call per resource, waiting far longer than lock_ttl
        "lock": {"key": "json:/resource", "ttl": "1s", "wait": "30s"},
    }


def test_a_lock_wait_that_outlasts_the_lease_never_sends_a_second_execution(
    make_proxy: ProxyFactory,
    gated: tuple[GatedTool, ThreadServer],
    relay: Relay,
    redis_url: str,
) -> None:
    tool, upstream = gated
    first = make_proxy(_route(upstream.url), store=relay.url())
    second = make_proxy(_route(upstream.url), store=redis_url)
    holder = {"resource": "r1", "account": "slow"}
    waiter = {"resource": "r1", "account": "acme"}
    holder_key, key = new_key(holder), new_key(waiter)
    plan = key.split(":", 1)[0]

    def post(proxy: ThreadServer, body: dict[str, Any], idem: str) -> httpx.Response:
        return httpx.post(
            f"{proxy.url}/tools/charge", json=body, headers={"Idempotency-Key": idem}, timeout=60
        )

    def waiting_in_line() -> bool:
        steps = httpx.get(f"{second.url}/_proxy/sessions/{plan}/steps").json().get("steps")
        return [s["state"] for s in steps or []] == ["in_progress"]

    with ThreadPoolExecutor(2) as pool:
        held = pool.submit(post, first, holder, holder_key)  # holds r1 at the tool
        wait_for(lambda: tool.waiting == 1, what="the first call at the tool")
        waits = pool.submit(post, first, waiter, key)  # claimed, then waits for r1
        wait_for(waiting_in_line, what="the second call's claim")
        relay.cut()  # the first replica loses the store: its leases lapse while it waits

        def retried() -> bool:  # the agent retries through the other replica
            return post(second, waiter, key).status_code == 200

        wait_for(retried, seconds=20, what="the retry to take the lapsed key over")
        assert tool.executions[key] == 1
        relay.mend()
        tool.gate.set()  # r1 is freed on the first replica: its waiting call goes on
        refused, first_answer = waits.result(60), held.result(60)

    assert first_answer.status_code == 200
    assert tool.executions[key] == 1, "the call whose lease lapsed while it waited was sent"
    assert refused.status_code == 502, refused.text
    assert refused.json()["type"] == "urn:tool-proxy:problem:lease-lost"
    replay = post(second, waiter, key)  # what the retry executed is the key's outcome
    assert replay.headers.get("idempotent-replayed") == "true"
    assert replay.json()["key"] == key and tool.executions[key] == 1


@pytest.fixture
def unanswered() -> Iterator[str]:
    """An upstream whose listen queue is full: a new connection waits (its SYN dropped)
    until a connect timeout, as behind a saturated tool or pool."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(4):
        filler = socket.socket()
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            filler.connect(("127.0.0.1", port))
        fillers.append(filler)
    yield f"http://127.0.0.1:{port}"
    for sock in [*fillers, listener]:
        sock.close()


def test_the_wait_for_a_connection_is_bounded_by_the_lease(
    make_proxy: ProxyFactory, unanswered: str
) -> None:
    """Past the fence a call may still wait for an upstream connection: that wait ends
    with what is left of the lease (not the route's 9 s connect timeout), nothing sent."""
    spec = {
        "name": "charge",
        "path_prefix": "/tools",
        "upstream": unanswered,
        "timeout": "10s",
        "idempotency": {"lock_ttl": "1s", "result_ttl": "1h"},
    }
    proxy = make_proxy(spec)
    body = {"account": "acme"}
    started = time.monotonic()
    answer = httpx.post(
        f"{proxy.url}/tools/charge",
        json=body,
        headers={"Idempotency-Key": new_key(body)},
        timeout=30,
    )
    assert answer.status_code == 502, answer.text
    assert answer.json()["type"] == "urn:tool-proxy:problem:upstream-unreachable"
    assert time.monotonic() - started < 4  # lock_ttl, not CONNECT_TIMEOUT
