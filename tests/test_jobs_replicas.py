"""Long calls across replicas: real ``tool-proxy serve`` processes sharing one real
redis-server, in front of real upstream servers.

A replica that dies with an operation queued leaves it to the other, which runs it once;
one that dies while its operation's call is in flight leaves it FAILED, never sent again.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests.conftest import SEALING_ENV, new_key, route
from tests.servers import CountingTool, ProxyProcess, RedisServer, ThreadServer, running, wait_for
from tests.test_jobs import ASYNC, BODY, FlakyTool, post, sse, until


def config(redis: RedisServer, upstream: str, **extra: Any) -> dict[str, Any]:
    spec = route(upstream)  # lock_ttl 5s
    spec["async"] = {"backoff": "50ms", "backoff_max": "100ms", "visibility": "1s"}
    spec.update(extra)
    return {"store": {"url": redis.url, "sealing_key_env": SEALING_ENV}, "routes": [spec]}


@pytest.fixture
def redis(redis_server: RedisServer) -> RedisServer:
    redis_server.flush()
    return redis_server


@pytest.fixture
def replicas(
    redis: RedisServer, tool: CountingTool, tmp_path: Path
) -> Iterator[list[ProxyProcess]]:
    proxies = [ProxyProcess(config(redis, tool.url), tmp_path).start() for _ in range(2)]
    yield proxies
    for proxy in proxies:
        if proxy.process is not None:
            proxy.stop()


def test_a_3s_call_is_accepted_at_once_and_followed_from_the_other_replica(
    replicas: list[ProxyProcess], tool: CountingTool
) -> None:
    a, b = replicas
    key = new_key(BODY)
    accepted = post(a.url, key=key, query="?delay=3", **ASYNC)
    assert accepted.status_code == 202, accepted.text
    assert tool.count(key) == 0  # answered before the tool did anything
    location = accepted.headers["location"]
    again = post(b.url, key=key, query="?delay=3", **ASYNC)  # a retry, at the other replica
    assert again.status_code == 202 and again.headers["location"] == location

    events = sse(b.url, location)
    assert [e[2]["state"] for e in events] == ["queued", "running", "completed"]
    missed = sse(a.url, location, last="1")
    assert [(e[1], e[2]["state"]) for e in missed] == [("2", "running"), ("3", "completed")]

    assert httpx.get(b.url + location).status_code == 303
    result = httpx.get(a.url + location + "/result")
    assert result.status_code == 200 and result.headers["idempotent-replayed"] == "true"
    expected = {"execution": 1, "path": "/tools/run", "body": json.dumps(BODY)}
    assert result.content == json.dumps(expected).encode()  # the tool's bytes
    assert tool.count(key) == 1 and tool.arrived[key] == 1


def test_a_replica_killed_with_one_call_in_flight_and_one_queued(
    redis: RedisServer, tool: CountingTool, tmp_path: Path
) -> None:
    single = config(redis, tool.url, workers={"concurrency": 1})
    a = ProxyProcess(single, tmp_path).start()
    sending, queued = new_key(BODY, step=1), new_key(BODY, step=2)
    in_flight = post(a.url, key=sending, query="?delay=4", **ASYNC).headers["location"]
    wait_for(lambda: tool.arrived[sending] == 1, what="the first call to reach the tool")
    waiting = post(a.url, key=queued, **ASYNC).headers["location"]
    assert until(a.url, waiting, "queued", "running")["state"] == "queued"  # a is busy
    a.kill()

    b = ProxyProcess(single, tmp_path).start()
    try:
        done = until(b.url, waiting, "completed", "failed")
        assert done["state"] == "completed" and done["attempts"] == 1
        assert tool.count(queued) == 1
        failed = until(b.url, in_flight, "failed", "completed")
        assert failed["state"] == "failed"
        assert failed["error"]["type"] == "urn:tool-proxy:problem:outcome-unknown"
        assert "not sent again" in failed["error"]["detail"]
        retry = post(b.url, key=sending, query="?delay=4", **ASYNC)
        assert retry.status_code == 502  # the recorded unknown outcome, replayed
        assert retry.headers["idempotent-replayed"] == "true"
        assert tool.arrived[sending] == 1  # never sent twice
        wait_for(  # the log is flushed a moment later
            lambda: any(e["event"] == "job_taken_over_after_sending" for e in b.events()),
            what="the takeover in b's log",
        )
    finally:
        b.stop()


@contextmanager
def flaky_replicas(
    redis: RedisServer, tmp_path: Path, failures: int, **async_: Any
) -> Iterator[tuple[FlakyTool, list[ProxyProcess]]]:
    """Two replicas in front of a tool answering 503 ``failures`` times (always: -1)."""
    tool = FlakyTool(failures)
    with running(ThreadServer(tool.app)) as server:
        spec = config(redis, server.url)
        spec["routes"][0]["async"].update(async_)
        proxies = [ProxyProcess(spec, tmp_path).start() for _ in range(2)]
        try:
            yield tool, proxies
        finally:
            for proxy in proxies:
                proxy.stop()


def test_a_tool_answering_503_twice_then_200_completes_across_replicas(
    redis: RedisServer, tmp_path: Path
) -> None:
    with flaky_replicas(redis, tmp_path, 2) as (tool, (a, b)):
        key = new_key(BODY)
        location = post(a.url, key=key, **ASYNC).headers["location"]
        done = until(b.url, location, "completed", "dead", "failed")
        assert done["state"] == "completed" and done["attempts"] == 3
        assert tool.calls[key] == 3


def test_a_tool_that_always_answers_503_ends_dead(redis: RedisServer, tmp_path: Path) -> None:
    with flaky_replicas(redis, tmp_path, -1, attempts=3) as (tool, (a, b)):
        key = new_key(BODY)
        location = post(a.url, key=key, **ASYNC).headers["location"]
        dead = until(b.url, location, "dead", "completed", "failed")
        assert dead["state"] == "dead" and dead["attempts"] == 3
        assert tool.calls[key] == 3


# -- a takeover never contradicts its record -------------------------------------------------


class GateTool:
    """Holds every call until ``gate`` is set, then answers it; counts arrivals."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.arrived: Counter[str] = Counter()
        self.app = Starlette(routes=[Route("/{path:path}", self.handle, methods=["POST"])])

    async def handle(self, request: Request) -> Response:
        key = request.headers["idempotency-key"]
        self.arrived[key] += 1
        await asyncio.to_thread(self.gate.wait, 60)
        return JSONResponse({"answer": key})


@contextmanager
def stalled_worker(
    redis: RedisServer, tmp_path: Path, lock_ttl: str
) -> Iterator[tuple[GateTool, ProxyProcess, ProxyProcess, str, str]]:
    """Replica ``a`` sends a call that the tool holds, then ``b`` starts and ``a`` is
    stopped (SIGSTOP) with the call in flight: ``b`` takes the job over once ``a``'s hold
    (visibility 1 s) lapses, while ``a`` lives on. Yields the tool, a, b, key, location."""
    tool = GateTool()
    with running(ThreadServer(tool.app)) as server:
        spec = config(redis, server.url, workers={"concurrency": 1})
        spec["routes"][0]["idempotency"]["lock_ttl"] = lock_ttl
        a = ProxyProcess(spec, tmp_path).start()
        b: ProxyProcess | None = None
        try:
            key = new_key(BODY)
            location = post(a.url, key=key, **ASYNC).headers["location"]
            wait_for(lambda: tool.arrived[key] == 1, what="a's call to reach the tool")
            b = ProxyProcess(spec, tmp_path).start()
            a.pause()
            yield tool, a, b, key, location
        finally:
            tool.gate.set()
            if a.process is not None:
                a.resume()
                a.stop()
            if b is not None:
                b.stop()


def _agree(proxy: ProxyProcess, key: str, location: str, state: str) -> httpx.Response:
    """The operation's state, its /result and the key's replay say the same."""
    assert until(proxy.url, location, "completed", "failed")["state"] == state
    result = httpx.get(proxy.url + location + "/result")
    replay = post(proxy.url, key=key)
    assert replay.headers["idempotent-replayed"] == "true"
    assert (result.status_code, result.content) == (replay.status_code, replay.content)
    assert result.status_code == (200 if state == "completed" else 502)
    return result


def test_a_taker_waits_for_a_stalled_worker_whose_lease_is_live(
    redis: RedisServer, tmp_path: Path
) -> None:
    """``a``'s hold lapses but not its lease (10 s): ``b`` waits on the record instead of
    ending the operation failed; ``a`` wakes, gets the answer, and its answer is the
    operation's, its result's and its key's."""
    with stalled_worker(redis, tmp_path, "10s") as (tool, a, b, key, location):
        wait_for(
            lambda: (
                any(e["event"] == "job_takeover_deferred" for e in b.events())
                or until(b.url, location, "queued", "running", "failed", "completed")["state"]
                == "failed"
            ),
            what="b to take the job over",
        )
        a.resume()
        tool.gate.set()
        result = _agree(b, key, location, "completed")
        assert result.json() == {"answer": key} and tool.arrived[key] == 1


def test_a_stalled_workers_late_answer_never_replaces_its_takers_unknown(
    redis: RedisServer, tmp_path: Path
) -> None:
    """``a`` stays stopped past its lease (3 s): ``b`` records the outcome as unknown and
    ends the operation failed. ``a`` then wakes and gets the tool's answer: it is not
    recorded over ``b``'s (the record is fenced), so all three still say failed."""
    with stalled_worker(redis, tmp_path, "3s") as (tool, a, b, key, location):
        until(b.url, location, "failed", "completed")
        a.resume()
        tool.gate.set()
        wait_for(
            lambda: any(e["event"] == "job_ended" for e in a.events()),
            what="a to get its answer and end",
        )
        result = _agree(b, key, location, "failed")
        assert result.json()["type"] == "urn:tool-proxy:problem:outcome-unknown"
        assert tool.arrived[key] == 1
