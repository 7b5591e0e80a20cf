"""The store failing around an execution: fail closed before, never lose the outcome after."""

from __future__ import annotations

import concurrent.futures
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis as redis_client

from proxy import idempotency
from tests.conftest import ProxyFactory, new_key, route
from tests.servers import CountingTool, ProxyProcess, RedisServer, free_port, wait_for

BODY = {"op": "charge"}


def test_store_down_from_the_start_fails_closed_and_recovers(
    tool: CountingTool, make_proxy: ProxyFactory
) -> None:
    redis = RedisServer()  # not started yet: the proxy starts without its store
    proxy = make_proxy(
        route(tool.url),
        route(tool.url, name="plain", prefix="/plain", guarded=False),
        store=redis.url,
    )
    try:
        key = new_key(BODY)
        refused = httpx.post(f"{proxy.url}/tools/a", json=BODY, headers={"Idempotency-Key": key})
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        assert httpx.get(f"{proxy.url}/_proxy/readyz").status_code == 503
        assert httpx.get(f"{proxy.url}/plain/a").status_code == 200
        assert tool.count(key) == 0  # never forwarded
        redis.start()
        assert httpx.get(f"{proxy.url}/_proxy/readyz").status_code == 200
        ok = httpx.post(f"{proxy.url}/tools/a", json=BODY, headers={"Idempotency-Key": key})
        assert ok.status_code == 200
        assert tool.count(key) == 1
    finally:
        redis.stop()


def test_outcome_is_recorded_after_the_store_comes_back(
    tool: CountingTool, make_proxy: ProxyFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(idempotency, "RECORD_RETRY_SECONDS", 0.05)  # the proxy is in process
    redis = RedisServer(free_port()).start()
    proxy = make_proxy(route(tool.url, lock_ttl="10s"), store=redis.url)
    key = new_key(BODY)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            first = pool.submit(
                httpx.post,
                f"{proxy.url}/tools/a?delay=1",
                json=BODY,
                headers={"Idempotency-Key": key},
                timeout=30,
            )
            wait_for(lambda: tool.arrived[key] == 1, what="the call at the tool")
            redis.stop()  # the store goes away while the tool works
            answer = first.result()
        assert answer.status_code == 200  # the caller still gets the real answer
        redis.start()  # Redis comes back (empty: it keeps nothing on disk here)
        client = redis_client.Redis.from_url(redis.url)
        wait_for(  # the proxy asks again while the lease lasts (not a request: it would run)
            lambda: any(client.hget(k, "st") == b"completed" for k in client.keys("tp:*:r:*")),
            what="the outcome recorded",
        )
        client.close()
        replay = httpx.post(
            f"{proxy.url}/tools/a?delay=1", json=BODY, headers={"Idempotency-Key": key}, timeout=30
        )
        assert replay.status_code == 200
        assert replay.headers["idempotent-replayed"] == "true"
        assert replay.content == answer.content
        assert tool.count(key) == 1
    finally:
        redis.stop()


def kill_mid_call(
    tool: CountingTool, config: dict[str, Any], tmp_path: Path, key: str, path: str
) -> None:
    """Start a proxy, send it a call, SIGKILL it while the tool works on it."""
    first = ProxyProcess(config, tmp_path).start()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(
            httpx.post, first.url + path, json=BODY, headers={"Idempotency-Key": key}, timeout=30
        )
        wait_for(lambda: tool.arrived[key] == 1, what="the call at the tool")
        first.kill()
        with pytest.raises(httpx.HTTPError):
            pending.result()


@pytest.mark.parametrize("backend", ["sqlite", "redis"])
def test_a_killed_proxy_never_causes_a_second_execution(
    tool: CountingTool, tmp_path: Path, backend: str, request: pytest.FixtureRequest
) -> None:
    """SIGKILL mid-call (a three-second call): the retries, against the restarted
    proxy and against a second replica, get 409 while the lease lives, then the FAILED
    replay (outcome unknown), never a second execution."""
    url = (
        f"sqlite://{tmp_path}/state.db"
        if backend == "sqlite"
        else request.getfixturevalue("redis_url")
    )
    config = {"store": {"url": url}, "routes": [route(tool.url, lock_ttl="1.5s")]}
    key = new_key(BODY)
    path = "/tools/a?delay=3"
    replica = ProxyProcess(config, tmp_path).start()
    restarted = None
    try:
        kill_mid_call(tool, config, tmp_path, key, path)
        held = httpx.post(replica.url + path, json=BODY, headers={"Idempotency-Key": key})
        assert held.status_code == 409  # the dead proxy's lease still runs
        restarted = ProxyProcess(config, tmp_path).start()
        wait_for(lambda: tool.count(key) == 1, what="the killed proxy's call to end")
        time.sleep(1.6)  # the lease lapses
        for proxy in (restarted, replica, restarted):
            again = httpx.post(proxy.url + path, json=BODY, headers={"Idempotency-Key": key})
            assert again.status_code == 502
            assert again.headers["idempotent-replayed"] == "true"
            assert again.json()["type"] == "urn:tool-proxy:problem:outcome-unknown"
        time.sleep(0.2)
        assert tool.count(key) == 1
    finally:
        replica.stop()
        if restarted is not None:
            restarted.stop()


def test_reexecute_on_a_lapsed_lease_runs_the_call_again(
    tool: CountingTool, tmp_path: Path
) -> None:
    """The opt-in trade-off: after a crash, the lease lapses and a retry executes."""
    config = {
        "store": {"url": f"sqlite://{tmp_path}/state.db"},
        "routes": [route(tool.url, lock_ttl="1.5s", on_lapsed_lease="reexecute")],
    }
    key = new_key(BODY)
    path = "/tools/a?delay=2"
    kill_mid_call(tool, config, tmp_path, key, path)
    second = ProxyProcess(config, tmp_path).start()
    try:
        time.sleep(1.6)
        again = httpx.post(second.url + path, json=BODY, headers={"Idempotency-Key": key})
        assert again.status_code == 200
        assert "idempotent-replayed" not in again.headers
        # The tool ran the step twice: the crashed proxy's call finished, unrecorded.
        wait_for(lambda: tool.count(key) == 2, what="both executions")
    finally:
        second.stop()


def replay_on_a_fresh_proxy(
    config: dict[str, Any], tmp_path: Path, path: str, key: str
) -> httpx.Response:
    """The same request sent again, to a new proxy process on the same store."""
    proxy = ProxyProcess(config, tmp_path).start()
    try:
        return httpx.post(proxy.url + path, json=BODY, headers={"Idempotency-Key": key})
    finally:
        proxy.stop()


def test_sigterm_after_the_caller_left_still_records_the_call(
    tool: CountingTool, tmp_path: Path
) -> None:
    """The agent timed out, then the proxy is stopped: the call ends and is recorded."""
    config = {"store": {"url": f"sqlite://{tmp_path}/state.db"}, "routes": [route(tool.url)]}
    first = ProxyProcess(config, tmp_path).start()
    key = new_key(BODY)
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                first.url + "/tools/a?delay=1.5",
                json=BODY,
                headers={"Idempotency-Key": key},
                timeout=0.3,
            )
        assert first.stop() in (0, -signal.SIGTERM)  # while the upstream still works
    finally:
        if first.process is not None:  # a failed check must not leave it running
            first.stop()
    assert tool.count(key) == 1
    replay = replay_on_a_fresh_proxy(config, tmp_path, "/tools/a?delay=1.5", key)
    assert replay.status_code == 200
    assert replay.headers["idempotent-replayed"] == "true"
    assert tool.count(key) == 1


def test_sigterm_finishes_and_records_calls_in_flight(tool: CountingTool, tmp_path: Path) -> None:
    config = {"store": {"url": f"sqlite://{tmp_path}/state.db"}, "routes": [route(tool.url)]}
    first = ProxyProcess(config, tmp_path).start()
    key = new_key(BODY)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(
            httpx.post,
            first.url + "/tools/a?delay=1.5",
            json=BODY,
            headers={"Idempotency-Key": key},
            timeout=30,
        )
        time.sleep(0.5)
        # SIGTERM; uvicorn re-raises it once the graceful shutdown is over
        assert first.stop() in (0, -signal.SIGTERM)
        answer = pending.result()
    assert answer.status_code == 200
    replay = replay_on_a_fresh_proxy(config, tmp_path, "/tools/a?delay=1.5", key)
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.content == answer.content
    assert tool.count(key) == 1


def test_a_call_cancelled_by_the_shutdown_is_recorded_before_the_store_closes(
    tool: CountingTool, tmp_path: Path, redis_url: str
) -> None:
    """A real SIGTERM on real Redis: uvicorn stops waiting for the call after the graceful
    timeout and cancels it; its FAILED record is written before the store is closed, so
    a retry on another proxy gets outcome-unknown, never a second execution."""
    config = {"store": {"url": redis_url}, "routes": [route(tool.url, timeout="20s")]}
    first = ProxyProcess(config, tmp_path, args=("--graceful-timeout", "1")).start()
    key = new_key(BODY)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(
                httpx.post,
                first.url + "/tools/a?delay=4",
                json=BODY,
                headers={"Idempotency-Key": key},
                timeout=30,
            )
            time.sleep(0.5)  # the tool is working on it
            assert first.stop() in (0, -signal.SIGTERM)
            cut = pending.result()
    finally:
        if first.process is not None:
            first.stop()
    assert cut.status_code >= 500  # uvicorn answers a cancelled request 500
    replay = replay_on_a_fresh_proxy(config, tmp_path, "/tools/a?delay=4", key)
    assert replay.status_code == 502
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.json()["type"] == "urn:tool-proxy:problem:outcome-unknown"
    wait_for(lambda: tool.count(key) == 1, what="the one execution")


def test_sigterm_is_not_held_up_forever_by_a_caller_that_stopped_reading(
    tool: CountingTool, tmp_path: Path
) -> None:
    """A response stuck on a caller that reads nothing: the graceful shutdown waits the
    longest route timeout plus 5 s for it, then ends it, instead of waiting forever."""
    import socket

    plain = route(tool.url, guarded=False, timeout="1s")
    config = {"store": {"url": "memory://"}, "routes": [plain]}
    proxy = ProxyProcess(config, tmp_path).start()
    size = 256 * 1024 * 1024  # far more than the socket buffers hold
    with socket.create_connection(("127.0.0.1", proxy.port)) as caller:
        caller.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        caller.sendall(f"GET /tools/big?size={size} HTTP/1.1\r\nHost: p\r\n\r\n".encode())
        time.sleep(1.5)
        started = time.monotonic()
        code = proxy.stop()  # waits up to 30 s
        took = time.monotonic() - started
    assert code in (0, -signal.SIGTERM)
    assert took < 15


def post(url: str, key: str) -> httpx.Response:
    return httpx.post(url, json=BODY, headers={"Idempotency-Key": key}, timeout=30)


@pytest.mark.parametrize("shared", ["sqlite", "redis"])
def test_a_lease_taken_over_by_another_process_keeps_the_second_outcome(
    tool: CountingTool, tmp_path: Path, request: pytest.FixtureRequest, shared: str
) -> None:
    """With on_lapsed_lease: reexecute, two proxy processes share one store. The first is
    frozen (SIGSTOP) mid-call until its lease lapses; the second claims the key and
    executes. The first, thawed, gets its answer late: it is refused by the owner fence,
    and the second's outcome is the one replayed."""
    store = (
        f"sqlite://{tmp_path}/state.db"
        if shared == "sqlite"
        else request.getfixturevalue("redis_url")
    )
    spec = route(tool.url, lock_ttl="1s", on_lapsed_lease="reexecute")
    config = {"store": {"url": store}, "routes": [spec]}
    first, second = (ProxyProcess(config, tmp_path).start() for _ in range(2))
    key = new_key(BODY)
    url = "/tools/a?delay=2"
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            late = pool.submit(post, f"{first.url}{url}", key)
            wait_for(lambda: tool.arrived[key] == 1, what="the first call at the tool")
            assert first.process is not None
            first.process.send_signal(signal.SIGSTOP)  # no renewals: the lease lapses in 1 s
            time.sleep(1.5)
            taken = pool.submit(post, f"{second.url}{url}", key)
            wait_for(lambda: tool.arrived[key] == 2, what="the second call at the tool")
            first.process.send_signal(signal.SIGCONT)
            late_response, taken_response = late.result(), taken.result()
        assert late_response.status_code == taken_response.status_code == 200
        assert late_response.json()["execution"] == 1  # its caller still gets its answer
        assert taken_response.json()["execution"] == 2
        for proxy in (first, second):
            replay = post(f"{proxy.url}{url}", key)
            assert replay.headers["idempotent-replayed"] == "true"
            assert replay.json()["execution"] == 2  # the late outcome did not overwrite it
        assert tool.count(key) == 2
        wait_for(
            lambda: "lease_lost_before_recording" in {e["event"] for e in first.events()},
            what="the first process to report its refused outcome",
        )
    finally:
        for proxy in (first, second):
            if proxy.process is not None:
                proxy.process.send_signal(signal.SIGCONT)
                proxy.stop()


@pytest.mark.parametrize("shared", ["sqlite", "redis"])
def test_a_frozen_proxys_late_outcome_replaces_the_lapsed_failure(
    tool: CountingTool, tmp_path: Path, request: pytest.FixtureRequest, shared: str
) -> None:
    """By default a lapsed lease is FAILED for the second proxy (never a second run); when
    the first proxy thaws and records the tool's real answer, later retries get it."""
    store = (
        f"sqlite://{tmp_path}/state.db"
        if shared == "sqlite"
        else request.getfixturevalue("redis_url")
    )
    config = {"store": {"url": store}, "routes": [route(tool.url, lock_ttl="1s")]}
    first, second = (ProxyProcess(config, tmp_path).start() for _ in range(2))
    key = new_key(BODY)
    url = "/tools/a?delay=1.5"
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            late = pool.submit(post, f"{first.url}{url}", key)
            wait_for(lambda: tool.arrived[key] == 1, what="the call at the tool")
            assert first.process is not None
            first.process.send_signal(signal.SIGSTOP)
            time.sleep(1.5)  # the lease lapses
            failed = post(f"{second.url}{url}", key)
            assert failed.status_code == 502
            assert failed.json()["type"] == "urn:tool-proxy:problem:outcome-unknown"
            first.process.send_signal(signal.SIGCONT)
            assert late.result().status_code == 200
        replay = post(f"{second.url}{url}", key)
        assert replay.headers["idempotent-replayed"] == "true"
        assert (replay.status_code, replay.json()["execution"]) == (200, 1)
        assert tool.count(key) == 1
    finally:
        for proxy in (first, second):
            if proxy.process is not None:
                proxy.process.send_signal(signal.SIGCONT)
                proxy.stop()
