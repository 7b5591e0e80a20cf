"""Redis Sentinel under guarded calls: the primary found through three real sentinels
and followed across failovers; calls fail closed (503) while no primary is known, work
again after promotion, and nothing executes twice."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import ProxyFactory, new_key, route
from tests.servers import CountingTool, RedisSentinels, wait_for

PLAN = "plan-failover"


@pytest.fixture
def sentinels(tmp_path: Path) -> Iterator[RedisSentinels]:
    group = RedisSentinels(tmp_path).start()
    yield group
    group.stop()


async def _call(client: httpx.AsyncClient, url: str, i: int, refused: list[int]) -> httpx.Response:
    """One guarded call, retried (same key) while the proxy answers 409 or 503 (their
    statuses kept in ``refused``)."""
    body = {"i": i}
    key = new_key(body, step=i, plan=PLAN)
    for _ in range(600):
        response = await client.post(url, json=body, headers={"Idempotency-Key": key})
        if response.status_code not in (409, 503):
            return response
        refused.append(response.status_code)
        await asyncio.sleep(0.05)
    raise AssertionError(f"call {i} never answered")


async def _run(url: str, calls: range, refused: list[int]) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=30) as client:
        return await asyncio.gather(*(_call(client, url, i, refused) for i in calls))


def _executed_once(tool: CountingTool, answers: list[httpx.Response], calls: int) -> None:
    assert [r.status_code for r in answers] == [200] * len(answers)
    assert sorted(tool.executions.values()) == [1] * calls


def test_a_primary_killed_during_guarded_calls_fails_closed_then_follows_the_promotion(
    tool: CountingTool, make_proxy: ProxyFactory, sentinels: RedisSentinels
) -> None:
    proxy = make_proxy(route(tool.url), store=sentinels.url)
    url = f"{proxy.url}/tools/p?delay=0.3"
    refused: list[int] = []
    before = asyncio.run(_run(url, range(4), refused))

    async def fail_over_during_calls() -> list[httpx.Response]:
        running = asyncio.ensure_future(_run(url, range(4, 12), refused))
        await asyncio.to_thread(wait_for, lambda: len(tool.arrived) == 12, 10, "calls sent")
        # their claims replicated (asynchronous replication: an unreplicated claim would
        # be lost with the primary, the documented window)
        await asyncio.to_thread(wait_for, lambda: sentinels.synced(sentinels.primary.port))
        sentinels.primary.kill()
        late = await _run(url, range(12, 16), refused)  # claims while no primary is known
        return [*await running, *late]

    during = asyncio.run(fail_over_during_calls())
    assert sentinels.primary_port() == sentinels.replica.port
    assert 503 in refused  # failed closed while no primary was known
    after = asyncio.run(_run(url, range(16), refused))
    _executed_once(tool, [*before, *during, *after], 16)
    assert all(r.headers.get("idempotent-replayed") == "true" for r in after)


def test_a_primary_demoted_while_connected_is_left_for_the_new_one(
    tool: CountingTool, make_proxy: ProxyFactory, sentinels: RedisSentinels
) -> None:
    """SENTINEL FAILOVER: the old primary stays up as a replica, the proxy's connection to
    it too, and its writes answer READONLY: the proxy asks the sentinels again."""
    proxy = make_proxy(route(tool.url), store=sentinels.url)
    url = f"{proxy.url}/tools/p"
    refused: list[int] = []
    before = asyncio.run(_run(url, range(4), refused))
    old = sentinels.primary.port
    assert sentinels.cli(sentinels.ports[0], "SENTINEL", "FAILOVER", sentinels.NAME) == "OK"
    wait_for(lambda: sentinels.primary_port() != old, seconds=30, what="failover")
    wait_for(lambda: sentinels.cli(old, "ROLE").splitlines()[:1] == ["slave"], seconds=30)
    after = asyncio.run(_run(url, range(8), refused))
    _executed_once(tool, [*before, *after], 8)
    assert all(r.headers.get("idempotent-replayed") == "true" for r in after[:4])
