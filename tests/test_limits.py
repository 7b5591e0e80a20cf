"""Shared limits (proxy/policies/limits.py): rates, slots, token costs, the tool's pauses.

In-process proxies on the memory store for the behaviour; real ``tool-proxy serve``
processes sharing a real Redis for what replicas share.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
from collections.abc import Iterator
from email.utils import formatdate
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from proxy.config import parse_config
from proxy.errors import ConfigError
from proxy.policies.limits import pause_seconds, pointed
from tests.conftest import Clock, ProxyFactory, new_key, route
from tests.idp import IdentityProvider
from tests.servers import (
    CountingTool,
    ProxyProcess,
    RedisServer,
    ThreadServer,
    free_port,
    wait_for,
)
from tests.test_auth import auth_config

BODY = {"prompt": "hi", "max_tokens": 60}
RPM = {"name": "rpm", "key": "route", "rate": "60/1m", "burst": 5}


def limited(upstream: str, *limits: dict[str, Any], guarded: bool = True, **extra: Any) -> Any:
    spec = route(upstream, guarded=guarded)
    spec.update({"limits": list(limits), **extra})
    return spec


def post(
    url: str, body: Any = BODY, key: str | None = None, agent: str | None = None
) -> httpx.Response:
    sent = {"content-type": "application/json"}
    if agent is not None:
        sent["x-agent"] = agent
    if key is not None:
        sent["idempotency-key"] = key
    return httpx.post(url, content=json.dumps(body), headers=sent, timeout=30)


def call(base: str, path: str = "/tools/llm", body: Any = BODY) -> httpx.Response:
    return post(base + path, body, new_key(body))


def assert_limited(answer: httpx.Response, retry_after: int) -> None:
    assert answer.status_code == 429, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    assert answer.json()["type"] == "urn:tool-proxy:problem:rate-limited"
    assert answer.headers["retry-after"] == str(retry_after)


# -- rates --------------------------------------------------------------------------------


def test_a_burst_of_five_passes_with_ratelimit_fields_and_the_sixth_is_refused(
    make_proxy: ProxyFactory, tool: CountingTool
) -> None:
    proxy = make_proxy(limited(tool.url, RPM))
    answers = [call(proxy.url) for _ in range(5)]
    assert [a.status_code for a in answers] == [200] * 5
    assert answers[0].headers["ratelimit-policy"] == '"rpm";q=60;w=60'
    assert [a.headers["ratelimit"] for a in answers] == [
        f'"rpm";r={4 - i};t={i + 1}' for i in range(5)
    ]
    refused = call(proxy.url)
    assert_limited(refused, 1)
    assert refused.headers["ratelimit-policy"] == '"rpm";q=60;w=60'
    assert refused.headers["ratelimit"] == '"rpm";r=0;t=5'
    assert tool.total == 5


def test_replays_and_duplicates_take_no_quota_and_a_refused_key_is_released(
    make_proxy: ProxyFactory, tool: CountingTool
) -> None:
    clock = Clock()
    proxy = make_proxy(limited(tool.url, {**RPM, "burst": 2}), clock=clock)
    key = new_key(BODY)
    url = proxy.url + "/tools/llm"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(post, url + "?delay=0.5", BODY, key)
        wait_for(lambda: tool.arrived[key] == 1, what="the first call at the tool")
        assert post(url + "?delay=0.5", BODY, key).status_code == 409  # not 429
        assert first.result().status_code == 200
    for _ in range(3):
        replay = post(url + "?delay=0.5", BODY, key)
        assert replay.headers["idempotent-replayed"] == "true"
        assert "ratelimit" not in replay.headers  # a replay takes nothing and says nothing
    assert call(proxy.url).status_code == 200  # the second unit of the burst
    other = new_key({"n": 2})
    assert_limited(post(url, {"n": 2}, other), 1)
    clock.now += 1.05  # the store's clock: a unit comes back
    assert post(url, {"n": 2}, other).status_code == 200  # released: it executes now
    assert tool.count(other) == 1


def test_a_pass_through_route_is_limited_per_header_value(
    make_proxy: ProxyFactory, tool: CountingTool
) -> None:
    per_agent = {"name": "per-agent", "key": "header:X-Agent", "rate": "2/1m"}
    proxy = make_proxy(limited(tool.url, per_agent, guarded=False))
    url = proxy.url + "/tools/llm"
    assert [post(url, agent="a").status_code for _ in range(3)] == [200, 200, 429]
    assert post(url, agent="b").status_code == 200
    refused = post(url, agent="a")
    assert_limited(refused, 30)
    assert tool.total == 3


def test_a_limit_keyed_by_a_header_refuses_its_repeated_lines(
    make_proxy: ProxyFactory, tool: CountingTool
) -> None:
    """Keyed by the first of two lines, a caller would count as agent "a" while a tool
    that joins them sees "a, b": one reading, or none."""
    per_agent = {"name": "per-agent", "key": "header:X-Agent", "rate": "2/1m"}
    proxy = make_proxy(limited(tool.url, per_agent, guarded=False))
    headers = [("content-type", "application/json"), ("x-agent", "a"), ("X-Agent", "b")]
    refused = httpx.post(proxy.url + "/tools/llm", content=json.dumps(BODY), headers=headers)
    assert refused.status_code == 400, refused.text
    assert refused.json()["type"] == "urn:tool-proxy:problem:invalid-header"
    assert "x-agent" in refused.json()["detail"]
    assert post(proxy.url + "/tools/llm", agent="a").status_code == 200
    assert tool.total == 1


def test_a_call_costing_more_than_the_burst_is_refused_without_a_store_call(
    make_proxy: ProxyFactory, tool: CountingTool
) -> None:
    tpm = {"name": "tpm", "rate": "100/1m", "burst": 50, "cost": {"request": "json:/max_tokens"}}
    proxy = make_proxy(limited(tool.url, tpm))
    answer = call(proxy.url)  # max_tokens 60
    assert answer.status_code == 429 and "never pass" in answer.json()["detail"]
    assert tool.total == 0


def test_a_call_costing_exactly_the_burst_passes(
    make_proxy: ProxyFactory, tool: CountingTool
) -> None:
    """1,001 a minute: the interval times the quota, divided again, is 1,000.999...; a
    call that costs the whole burst still fits, as the store's bucket counts it."""
    tpm = {"name": "tpm", "rate": "1001/1m", "cost": {"request": "json:/max_tokens"}}
    proxy = make_proxy(limited(tool.url, tpm, guarded=False))
    body = {"prompt": "x", "max_tokens": 1001}
    answer = httpx.post(proxy.url + "/tools/llm", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.headers["ratelimit"].startswith('"tpm";r=0;')
    assert tool.total == 1


@pytest.mark.parametrize("tokens", [b"NaN", b"Infinity", b"1e400", b"1" + b"0" * 400])
def test_a_cost_that_is_no_finite_number_is_unreadable_and_costs_one(
    make_proxy: ProxyFactory, tool: CountingTool, tokens: bytes
) -> None:
    """Python's JSON reader takes NaN and reads 1e400 as infinity: such a cost is read as
    none (cost 1, logged), never passed on to the bucket's arithmetic."""
    tpm = {"name": "tpm", "rate": "100/1m", "cost": {"request": "json:/max_tokens"}}
    proxy = make_proxy(limited(tool.url, tpm, guarded=False))
    body = b'{"prompt": "x", "max_tokens": ' + tokens + b"}"
    sent = {"content-type": "application/json"}
    answer = httpx.post(proxy.url + "/tools/llm", content=body, headers=sent)
    assert answer.status_code == 200, answer.text
    assert answer.headers["ratelimit"].startswith('"tpm";r=99;')
    assert tool.total == 1


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (b"[" * 5000 + b"]" * 5000, "invalid-json-body"),
        (b'{"account": "\\ud800"}', "resource-key-missing"),
        (b'{"account": "A1", "account": "B1"}', "duplicate-json-member"),
    ],
)
def test_a_limit_key_the_body_holds_unreadably_is_a_400_and_nothing_is_sent(
    make_proxy: ProxyFactory, tool: CountingTool, body: bytes, problem: str
) -> None:
    """A body too deep to read, a key that is not Unicode, or one named twice (the tool
    may read the first, the proxy would count the last): refused, never a 500."""
    per_account = {"name": "per-account", "key": "json:/account", "rate": "2/1m"}
    proxy = make_proxy(limited(tool.url, per_account, guarded=False))
    sent = {"content-type": "application/json"}
    refused = httpx.post(proxy.url + "/tools/llm", content=body, headers=sent)
    assert refused.status_code == 400, refused.text
    assert refused.headers["content-type"] == "application/problem+json"
    assert refused.json()["type"] == f"urn:tool-proxy:problem:{problem}"
    assert tool.total == 0
    answer = httpx.post(proxy.url + "/tools/llm", content=b'{"account": "A1"}', headers=sent)
    assert answer.status_code == 200, answer.text
    assert tool.total == 1


def test_a_body_too_deep_to_read_that_is_not_said_to_be_json_has_no_key(
    make_proxy: ProxyFactory, tool: CountingTool
) -> None:
    """Read as its hash reads it (``keys.fingerprint``): declared as text, or not at all,
    a body too deep to parse is not JSON, so its members are absent (the shared bucket),
    never a 400; declared JSON, it is ``invalid-json-body`` (above)."""
    per_account = {"name": "per-account", "key": "json:/account", "rate": "2/1m"}
    proxy = make_proxy(limited(tool.url, per_account, guarded=False))
    body = b"notes: " + b"{" * 300 + b" and so on"
    for sent in ({"content-type": "text/plain"}, {}):
        answer = httpx.post(proxy.url + "/tools/llm", content=body, headers=sent)
        assert answer.status_code == 200, answer.text
    assert tool.total == 2


def test_a_cost_read_from_the_body_refuses_a_member_named_twice(
    make_proxy: ProxyFactory, tool: CountingTool
) -> None:
    tpm = {"name": "tpm", "rate": "100/1m", "cost": {"request": "json:/max_tokens"}}
    proxy = make_proxy(limited(tool.url, tpm, guarded=False))
    body = b'{"max_tokens": 90, "max_tokens": 1}'
    sent = {"content-type": "application/json"}
    refused = httpx.post(proxy.url + "/tools/llm", content=body, headers=sent)
    assert refused.status_code == 400, refused.text
    assert refused.json()["type"] == "urn:tool-proxy:problem:duplicate-json-member"
    assert tool.total == 0


def test_an_answer_too_deep_to_read_keeps_the_estimate() -> None:
    assert pointed(b"[" * 5000 + b"]" * 5000, "/usage/total_tokens") is None


# -- configuration -------------------------------------------------------------------------


def test_limits_are_validated_with_every_problem_named() -> None:
    bad = limited(
        "http://h",
        {"name": "rpm", "rate": "sixty"},
        {"name": "x", "rate": "5/1s", "max_in_flight": 2},
        {"name": "y", "key": "json:no-slash", "rate": "5/1s", "burst": 6},
        {"name": "z", "max_in_flight": 1, "cost": {"request": 2}},
        {"name": "t", "rate": "5/1s", "cost": {"response": "/usage"}, "colour": 1},
        limits_on_store_down="maybe",
    )
    with pytest.raises(ConfigError) as caught:
        parse_config({"routes": [bad]}, env={})
    fields = [p.split(":", 1)[0] for p in caught.value.problems]
    for field in (
        "routes[0].limits[0].rate",
        "routes[0].limits[1]",
        "routes[0].limits[2].key",
        "routes[0].limits[3]",
        "routes[0].limits[4].cost.response",
        "routes[0].limits[4].colour",
        "routes[0].limits_on_store_down",
    ):
        assert field in fields, caught.value.problems
    with pytest.raises(ConfigError, match="burst must be at most"):
        parse_config({"routes": [limited("http://h", {**RPM, "burst": 61})]}, env={})
    with pytest.raises(ConfigError, match=r"routes\[0\].limits: limit names must be unique"):
        parse_config({"routes": [limited("http://h", RPM, RPM)]}, env={})


# -- the tool's own limits ------------------------------------------------------------------


def test_pause_seconds_from_the_tools_headers() -> None:
    now = 1_700_000_000.0
    assert pause_seconds([(b"Retry-After", b"3")], now) == 3
    date = formatdate(now + 7, usegmt=True).encode()
    assert pause_seconds([(b"retry-after", date)], now) == pytest.approx(7, abs=1)
    openai = [
        (b"x-ratelimit-remaining-requests", b"0"),
        (b"x-ratelimit-reset-requests", b"1m2.5s"),
        (b"x-ratelimit-remaining-tokens", b"9000"),
        (b"x-ratelimit-reset-tokens", b"6m0s"),
    ]
    assert pause_seconds(openai, now) == 62.5
    anthropic = [
        (b"anthropic-ratelimit-tokens-remaining", b"0"),
        (b"anthropic-ratelimit-tokens-reset", b"2023-11-14T22:13:40Z"),
    ]
    assert pause_seconds(anthropic, now) == pytest.approx(20)
    assert pause_seconds([(b"x-ratelimit-reset-requests", b"soon")], now) is None
    assert pause_seconds([(b"content-type", b"text/plain")], now) is None


def test_a_tool_429_pauses_the_route_and_nothing_reaches_the_tool_meanwhile(
    make_proxy: ProxyFactory, tool: CountingTool
) -> None:
    clock = Clock()  # limits: [] follows the tool only
    proxy = make_proxy(limited(tool.url, guarded=False), clock=clock)
    url = proxy.url + "/tools/llm"
    assert post(url + "?status=429&retry_after=1").status_code == 429
    paused = post(url)
    assert_limited(paused, 1)
    assert "pause" in paused.json()["detail"]
    assert tool.total == 1
    clock.now += 0.9
    assert_limited(post(url), 1)  # still paused
    clock.now += 0.15
    assert post(url).status_code == 200
    metrics = httpx.get(proxy.url + "/_proxy/metrics").text
    assert 'tool_proxy_limit_decisions_total{decision="paused",limit="",route="tool"} 2.0' in (
        metrics
    )


def as_user(base: str, token: str, query: str = "") -> httpx.Response:
    sent = {"content-type": "application/json", "authorization": f"Bearer {token}"}
    return httpx.post(f"{base}/tools/llm{query}", content=json.dumps(BODY), headers=sent)


def paused_by_tool(answer: httpx.Response, whom: str) -> str:
    """The Retry-After of the proxy's 429 for a pause the tool asked for."""
    assert answer.status_code == 429, answer.text
    assert f"the tool asked to pause {whom}" in answer.json()["detail"]
    return str(answer.headers["retry-after"])


@pytest.fixture(params=["memory", "redis", "postgres"])
def replicas(
    request: pytest.FixtureRequest, make_proxy: ProxyFactory, idp: IdentityProvider
) -> Any:
    """Two proxies of one route (``spec``) and ``idp``'s callers: on one Redis or one
    PostgreSQL, or the one proxy twice on memory (whose limits are per process)."""

    def start(spec: dict[str, Any]) -> list[ThreadServer]:
        spec["auth"] = {"required": True}
        if request.param == "memory":
            return [make_proxy(spec, auth=auth_config(idp))] * 2
        url = request.getfixturevalue(f"{request.param}_url")
        return [make_proxy(spec, store=url, auth=auth_config(idp)) for _ in range(2)]

    return start


def test_a_callers_429_pauses_that_caller_on_every_replica_and_no_one_else(
    replicas: Any, tool: CountingTool, idp: IdentityProvider
) -> None:
    per_user = {"name": "rpm", "key": "principal", "rate": "60/1m"}
    a, b = replicas(limited(tool.url, per_user, guarded=False))
    alice, bob = idp.token("alice"), idp.token("bob")
    told = as_user(a.url, alice, "?status=429&retry_after=600")
    assert told.status_code == 429 and told.headers["retry-after"] == "600"  # the tool's own
    assert paused_by_tool(as_user(b.url, alice), "this caller on route") == "60"  # pause_max
    assert as_user(b.url, bob).status_code == 200
    assert as_user(a.url, bob).status_code == 200
    assert tool.total == 3


def test_pause_scope_route_pauses_every_caller_at_most_pause_max(
    replicas: Any, tool: CountingTool, idp: IdentityProvider
) -> None:
    spec = limited(tool.url, guarded=False, pause_scope="route", pause_max="5s")
    a, b = replicas(spec)
    assert as_user(a.url, idp.token("alice"), "?status=503&retry_after=600").status_code == 503
    assert paused_by_tool(as_user(b.url, idp.token("bob")), "route") in ("4", "5")
    assert paused_by_tool(as_user(a.url, idp.token("alice")), "route") in ("4", "5")
    assert tool.total == 1


def test_without_auth_or_caller_keys_every_caller_is_one_caller(
    make_proxy: ProxyFactory, tool: CountingTool
) -> None:
    proxy = make_proxy(limited(tool.url, RPM, guarded=False))
    url = proxy.url + "/tools/llm"
    assert post(url + "?status=429&retry_after=2", agent="a").status_code == 429
    assert paused_by_tool(post(url, agent="b"), "this caller on route") in ("1", "2")
    assert tool.total == 1


# -- the store down --------------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "status"), [("closed", 503), ("open", 200)])
def test_the_store_down_fails_closed_or_open_per_route(
    make_proxy: ProxyFactory, tool: CountingTool, mode: str, status: int
) -> None:
    nowhere = f"redis://127.0.0.1:{free_port()}/0?socket_connect_timeout=0.2"
    spec = limited(tool.url, RPM, guarded=False, limits_on_store_down=mode)
    proxy = make_proxy(spec, store=nowhere)
    answer = post(proxy.url + "/tools/llm")
    assert answer.status_code == status, answer.text
    assert tool.total == (1 if mode == "open" else 0)


# -- shared by replicas (real Redis, two proxy processes) -------------------------------------


@pytest.fixture
def redis_store(redis_server: RedisServer) -> str:
    redis_server.flush()
    return redis_server.url


@pytest.fixture
def two_proxies(
    request: pytest.FixtureRequest, tmp_path: Path, tool: CountingTool, redis_store: str
) -> Iterator[list[ProxyProcess]]:
    spec = request.param(tool.url)
    config = {"store": {"url": redis_store}, "routes": [spec]}
    proxies = [ProxyProcess(config, tmp_path).start() for _ in range(2)]
    yield proxies
    for proxy in proxies:
        if proxy.process is not None:
            proxy.stop()


def _rpm(url: str) -> Any:
    return limited(url, RPM)


@pytest.mark.parametrize("two_proxies", [_rpm], indirect=True)
def test_two_replicas_share_a_burst_and_admit_again_on_time(
    two_proxies: list[ProxyProcess], tool: CountingTool
) -> None:
    a, b = two_proxies
    answers = [call(p.url) for p in (a, b, a, b, a)]
    assert [x.status_code for x in answers] == [200] * 5
    assert answers[-1].headers["ratelimit"] == '"rpm";r=0;t=5'
    refused = call(b.url)
    assert_limited(refused, 1)
    assert refused.headers["ratelimit-policy"] == '"rpm";q=60;w=60'
    assert refused.headers["ratelimit"] == '"rpm";r=0;t=5'
    assert_limited(call(a.url), 1)
    time.sleep(1.05)
    again = call(a.url)
    assert again.status_code == 200 and again.headers["ratelimit"] == '"rpm";r=0;t=5'
    assert_limited(call(b.url), 1)
    assert tool.total == 6


def _tpm(url: str) -> Any:
    tpm = {
        "name": "tpm",
        "rate": "100/1m",
        "cost": {"request": "json:/max_tokens", "response": "json:/usage/total_tokens"},
    }
    return limited(url, tpm)


@pytest.mark.parametrize("two_proxies", [_tpm], indirect=True)
def test_a_token_reservation_is_trued_up_from_the_tools_answer(
    two_proxies: list[ProxyProcess], tool: CountingTool
) -> None:
    a, b = two_proxies
    first = call(a.url, "/tools/llm?usage=10")  # 60 reserved, 10 used
    assert first.status_code == 200
    assert first.headers["ratelimit"].startswith('"tpm";r=40;')
    time.sleep(0.2)  # the true-up follows the answer
    big = {"prompt": "more", "max_tokens": 80}
    second = call(b.url, "/tools/llm?usage=80", big)  # 90 left: 80 fit
    assert second.status_code == 200, second.text
    assert second.headers["ratelimit"].startswith('"tpm";r=10;')
    time.sleep(0.2)
    # about 10 left, 20 asked: 10 more at 0.6 s each, less what refilled meanwhile
    assert_limited(call(a.url, "/tools/llm", {"max_tokens": 20}), 6)
    assert tool.total == 2


def _slots(wait: str) -> Any:
    def spec(url: str) -> Any:
        return limited(url, {"name": "in-flight", "max_in_flight": 2}, limit_wait=wait)

    return spec


def _five_slow_calls(proxies: list[ProxyProcess]) -> list[httpx.Response]:
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        futures = [
            pool.submit(call, proxies[i % 2].url, "/tools/llm?delay=0.6", {"n": i})
            for i in range(5)
        ]
        return [f.result() for f in futures]


@pytest.mark.parametrize("two_proxies", [_slots("0s")], indirect=True)
def test_two_in_flight_across_replicas_refuses_the_rest(
    two_proxies: list[ProxyProcess], tool: CountingTool
) -> None:
    answers = _five_slow_calls(two_proxies)
    statuses = sorted(a.status_code for a in answers)
    assert statuses == [200, 200, 429, 429, 429]
    refused = next(a for a in answers if a.status_code == 429)
    assert refused.headers["ratelimit"] == '"in-flight";r=0'
    assert refused.headers["ratelimit-policy"] == '"in-flight";q=2;qu="concurrent-requests"'
    assert tool.most_in_flight == 2 and tool.total == 2


@pytest.mark.parametrize("two_proxies", [_slots("5s")], indirect=True)
def test_two_in_flight_across_replicas_with_limit_wait_runs_all_two_at_a_time(
    two_proxies: list[ProxyProcess], tool: CountingTool
) -> None:
    started = time.monotonic()
    answers = _five_slow_calls(two_proxies)
    assert [a.status_code for a in answers] == [200] * 5
    assert tool.most_in_flight == 2 and tool.total == 5
    assert time.monotonic() - started >= 3 * 0.6  # three rounds of two at most
    metrics = httpx.get(two_proxies[0].url + "/_proxy/metrics").text
    assert 'decision="waited",limit="in-flight"' in metrics or 'decision="waited"' in (
        httpx.get(two_proxies[1].url + "/_proxy/metrics").text
    )


def _pause(url: str) -> Any:
    return limited(url, RPM)


@pytest.mark.parametrize("two_proxies", [_pause], indirect=True)
def test_a_tool_429_with_retry_after_pauses_both_replicas(
    two_proxies: list[ProxyProcess], tool: CountingTool
) -> None:
    a, b = two_proxies
    told = call(a.url, "/tools/llm?status=429&retry_after=2")
    assert told.status_code == 429 and told.headers["retry-after"] == "2"
    assert "type" not in told.text  # the tool's own answer, passed on
    for proxy in (a, b):
        paused = call(proxy.url)
        assert paused.status_code == 429 and "pause" in paused.json()["detail"]
        assert paused.headers["retry-after"] in ("1", "2")
    assert tool.total == 1
    time.sleep(2.05)
    assert call(b.url).status_code == 200
    assert tool.total == 2


def _one_slot(url: str) -> Any:
    return limited(url, {"name": "in-flight", "max_in_flight": 1, "slot_ttl": "1s"})


@pytest.mark.parametrize("two_proxies", [_one_slot], indirect=True)
def test_a_killed_replica_frees_its_slot_when_its_lease_lapses(
    two_proxies: list[ProxyProcess], tool: CountingTool
) -> None:
    a, b = two_proxies
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(call, a.url, "/tools/llm?delay=3", {"n": "held"})
        wait_for(lambda: tool.in_flight == 1, what="the call at the tool")
        time.sleep(0.7)  # past one renewal: the lease is renewed while the call runs
        assert_limited(call(b.url, "/tools/llm", {"n": "b"}), 1)
        a.kill()
        with pytest.raises(httpx.HTTPError):
            held.result()
    assert_limited(call(b.url, "/tools/llm", {"n": "b"}), 1)
    time.sleep(1.1)
    assert call(b.url, "/tools/llm", {"n": "b"}).status_code == 200


# -- round trips ------------------------------------------------------------------------------


def _evalsha_calls(client: redis.Redis) -> int:
    """Round trips so far: every store operation of the proxy is one EVALSHA."""
    stats = client.info("commandstats").get("cmdstat_evalsha", {})
    return int(stats.get("calls", 0))


def test_one_rate_limit_costs_one_extra_redis_round_trip(
    make_proxy: ProxyFactory, tool: CountingTool, redis_store: str
) -> None:
    plain = route(tool.url, name="plain", prefix="/tools/plain")
    proxy = make_proxy(plain, limited(tool.url, RPM), store=redis_store)
    client = redis.Redis.from_url(redis_store)
    costs = {}
    for path in ("/tools/plain", "/tools/llm"):
        assert call(proxy.url, path).status_code == 200  # the scripts are loaded
        time.sleep(0.1)
        before = _evalsha_calls(client)
        assert call(proxy.url, path).status_code == 200
        time.sleep(0.1)
        costs[path] = _evalsha_calls(client) - before
    client.close()
    assert costs == {"/tools/plain": 2, "/tools/llm": 3}  # claim, complete (+ take)


def test_a_slot_is_renewed_while_its_call_runs_past_its_lease(
    make_proxy: ProxyFactory, tool: CountingTool
) -> None:
    slot = {"name": "in-flight", "max_in_flight": 1, "slot_ttl": "300ms"}
    proxy = make_proxy(limited(tool.url, slot))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        long = pool.submit(call, proxy.url, "/tools/llm?delay=1", {"n": "long"})
        wait_for(lambda: tool.in_flight == 1, what="the call at the tool")
        time.sleep(0.6)  # twice the lease: held only because it is renewed
        assert_limited(call(proxy.url, "/tools/llm", {"n": "other"}), 1)
        assert long.result().status_code == 200
    time.sleep(0.1)  # the slot is freed after the answer
    assert call(proxy.url, "/tools/llm", {"n": "other"}).status_code == 200


def test_an_answer_without_the_cost_field_keeps_the_estimate(
    make_proxy: ProxyFactory, tool: CountingTool
) -> None:
    """No `usage` in the tool's answer: the reservation stands (logged), it is neither
    refunded nor trued up to nothing."""
    proxy = make_proxy(_tpm(tool.url))
    first = call(proxy.url, "/tools/llm")  # 60 reserved; the answer says nothing of usage
    assert first.status_code == 200
    assert first.headers["ratelimit"].startswith('"tpm";r=40;')
    time.sleep(0.2)  # the true-up would have followed the answer
    refused = call(proxy.url, "/tools/llm", {"prompt": "more", "max_tokens": 50})
    assert refused.status_code == 429, refused.text  # had 60 come back, 50 would fit
    assert tool.total == 1
