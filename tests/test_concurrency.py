"""Many simultaneous duplicates: exactly one execution, in one process and across two."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import httpx

from tests.conftest import ProxyFactory, new_key, route
from tests.servers import CountingTool, ProxyProcess, RedisServer

BODY = {"op": "provision", "size": "small"}
DUPLICATES = 50


async def _storm(urls: list[str], key: str) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=DUPLICATES)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:
        return await asyncio.gather(
            *(
                client.post(urls[i % len(urls)], json=BODY, headers={"Idempotency-Key": key})
                for i in range(DUPLICATES)
            )
        )


def _check(responses: list[httpx.Response]) -> Counter[str]:
    kinds: Counter[str] = Counter()
    for response in responses:
        if response.status_code == 409:
            assert response.headers["retry-after"]
            kinds["conflict"] += 1
        else:
            assert response.status_code == 200, response.text
            kinds["replayed" if "idempotent-replayed" in response.headers else "executed"] += 1
    assert kinds["executed"] == 1
    return kinds


def test_fifty_duplicates_execute_once(
    tool: CountingTool, make_proxy: ProxyFactory, store_url: str
) -> None:
    proxy = make_proxy(route(tool.url), store=store_url)
    key = new_key(BODY)
    responses = asyncio.run(_storm([f"{proxy.url}/tools/p?delay=0.5"], key))
    kinds = _check(responses)
    assert kinds["conflict"] >= 1
    assert tool.count(key) == 1


def test_fifty_duplicates_across_two_processes_sharing_redis(
    tool: CountingTool, redis_url: str, tmp_path: Path
) -> None:
    config = {"store": {"url": redis_url}, "routes": [route(tool.url)]}
    proxies = [ProxyProcess(config, tmp_path).start(), ProxyProcess(config, tmp_path).start()]
    try:
        key = new_key(BODY)
        responses = asyncio.run(_storm([f"{p.url}/tools/p?delay=0.5" for p in proxies], key))
        _check(responses)
        assert tool.count(key) == 1
        replay = httpx.post(
            f"{proxies[1].url}/tools/p?delay=0.5", json=BODY, headers={"Idempotency-Key": key}
        )
        assert replay.headers["idempotent-replayed"] == "true"
    finally:
        for proxy in proxies:
            proxy.stop()
    outcomes = Counter(e["outcome"] for p in proxies for e in p.events() if e["event"] == "request")
    assert outcomes["executed"] == 1
    assert outcomes["executed"] + outcomes["conflict"] + outcomes["replayed"] == DUPLICATES + 1


def test_two_worker_processes_share_the_sqlite_store(tool: CountingTool, tmp_path: Path) -> None:
    config = {"store": {"url": f"sqlite://{tmp_path}/state.db"}, "routes": [route(tool.url)]}
    proxy = ProxyProcess(config, tmp_path, workers=2).start()
    try:
        key = new_key(BODY)
        responses = asyncio.run(_storm([f"{proxy.url}/tools/p?delay=0.5"], key))
        _check(responses)
    finally:
        proxy.stop()
    assert tool.count(key) == 1


def test_redis_restart_mid_run(tool: CountingTool, make_proxy: ProxyFactory) -> None:
    redis = RedisServer().start()
    try:
        proxy = make_proxy(
            route(tool.url),
            route(tool.url, name="plain", prefix="/plain", guarded=False),
            store=redis.url,
        )
        key = new_key(BODY)
        assert (
            httpx.post(
                f"{proxy.url}/tools/a", json=BODY, headers={"Idempotency-Key": key}
            ).status_code
            == 200
        )
        redis.stop()
        down = httpx.post(
            f"{proxy.url}/tools/a", json=BODY, headers={"Idempotency-Key": new_key(BODY)}
        )
        assert down.status_code == 503
        assert down.headers["retry-after"]
        assert down.json()["type"].endswith("store-unavailable")
        assert httpx.get(f"{proxy.url}/_proxy/readyz").status_code == 503
        assert httpx.get(f"{proxy.url}/plain/x").status_code == 200  # pass-through still works
        executed_while_down = tool.total
        redis.start()
        assert httpx.get(f"{proxy.url}/_proxy/readyz").status_code == 200
        after = new_key(BODY)
        again = httpx.post(f"{proxy.url}/tools/a", json=BODY, headers={"Idempotency-Key": after})
        assert again.status_code == 200
        replay = httpx.post(f"{proxy.url}/tools/a", json=BODY, headers={"Idempotency-Key": after})
        assert replay.headers["idempotent-replayed"] == "true"
        assert tool.total == executed_while_down + 1
    finally:
        redis.stop()


def test_sqlite_store_survives_a_proxy_restart(
    tool: CountingTool, make_proxy: ProxyFactory, tmp_path: Path
) -> None:
    store = f"sqlite://{tmp_path}/state.db"
    first = make_proxy(route(tool.url), store=store)
    key = new_key(BODY)
    original = httpx.post(f"{first.url}/tools/a", json=BODY, headers={"Idempotency-Key": key})
    first.stop()
    second = make_proxy(route(tool.url), store=store)
    replay = httpx.post(f"{second.url}/tools/a", json=BODY, headers={"Idempotency-Key": key})
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.content == original.content
    assert tool.count(key) == 1
