"""The store failing around an execution: fail closed before, never lose the outcome after."""

from __future__ import annotations

import concurrent.futures
import time

import httpx

from tests.conftest import ProxyFactory, new_key, route
from tests.servers import CountingTool, RedisServer, free_port

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
    tool: CountingTool, make_proxy: ProxyFactory
) -> None:
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
            time.sleep(0.3)
            redis.stop()  # the store goes away while the tool works
            answer = first.result()
        assert answer.status_code == 200  # the caller still gets the real answer
        redis.start()  # Redis comes back (empty: it keeps nothing on disk here)
        time.sleep(1.5)  # the proxy retries recording every 0.5 s
        replay = httpx.post(
            f"{proxy.url}/tools/a?delay=1", json=BODY, headers={"Idempotency-Key": key}, timeout=30
        )
        assert replay.status_code == 200
        assert replay.headers["idempotent-replayed"] == "true"
        assert replay.content == answer.content
        assert tool.count(key) == 1
    finally:
        redis.stop()
