"""The response cache (proxy/policies/cache.py): hits and misses, Cache-Control both
ways, statuses, Vary, single-flight, offload, scoping by principal.

In-process proxies (memory, SQLite, Redis stores) for the behaviour; real ``tool-proxy
serve`` processes sharing a real Redis for what replicas share.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import structlog

from proxy.app import create_app
from proxy.asgi import Incoming
from proxy.background import TaskSet
from proxy.config import parse_config
from proxy.errors import ConfigError, LeaseLost, OutcomeUnknown, StoreUnavailable
from proxy.fence import Fence
from proxy.forwarding import UpstreamResponse
from proxy.metrics import Metrics
from proxy.outcome import StoredResponse
from proxy.policies import Context
from proxy.policies.cache import (
    FILL_MARGIN_SECONDS,
    Cache,
    decode_entry,
    directives,
    encode_entry,
    fill_seconds,
    seconds,
)
from proxy.store.memory import MemoryStore
from tests.conftest import Clock, ProxyFactory, new_key, route
from tests.idp import IdentityProvider
from tests.servers import CountingTool, ProxyProcess, RedisServer, ThreadServer, wait_for
from tests.test_auth import auth_config
from tests.test_cli import cli, write
from tests.test_offload import BUCKET, S3, expected, s3_offload

BODY = {"prompt": "summarise", "doc": 7}
HIT = "tool-proxy; hit"
STORED = "tool-proxy; fwd=miss; stored"


def cached(upstream: str, guarded: bool = False, **cache: Any) -> dict[str, Any]:
    spec = route(upstream, guarded=guarded)
    spec["cache"] = {"scope": "route", **cache}
    return spec


def ask(
    base: str,
    query: str = "",
    body: Any = BODY,
    headers: dict[str, str] | None = None,
    path: str = "/tools/infer",
) -> httpx.Response:
    sent = {"content-type": "application/json", **(headers or {})}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{base}{path}{query}", content=content, headers=sent, timeout=30)


def cache_status(answer: httpx.Response) -> str:
    return str(answer.headers.get("cache-status", ""))


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[S3]:
    """moto's S3 server with one bucket (as in tests/test_offload.py)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    server = S3()
    server.server.start()
    httpx.post(f"{server.endpoint}/moto-api/reset")
    server.client().create_bucket(Bucket=BUCKET)
    yield server
    server.server.stop()


@pytest.fixture
def clocked(tmp_path: Path) -> Iterator[Any]:
    """An in-process proxy on a memory store and a cache that both run on a Clock."""
    started: list[ThreadServer] = []

    def make(*routes: dict[str, Any], clock: Clock) -> ThreadServer:
        config = parse_config(
            {"store": {"url": "memory://"}, "routes": list(routes), "state_dir": str(tmp_path)},
            env={},
        )
        app = create_app(config, store=MemoryStore(clock))
        for chain in app.proxy.chains.values():
            for policy in chain.policies:
                if hasattr(policy, "clock"):
                    policy.clock = clock
        server = ThreadServer(app, proxy_protocol=True).start()
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()


# -- configuration --------------------------------------------------------------------------


def test_cache_keys_are_checked_each_naming_its_field() -> None:
    bad = cached("http://h", ttl=0, scope="everyone", methods=["HEAD"], statuses=[500], x=1)
    with pytest.raises(ConfigError) as caught:
        parse_config({"routes": [bad]}, env={})
    fields = [p.split(":", 1)[0] for p in caught.value.problems]
    for field in (
        "routes[0].cache.ttl",
        "routes[0].cache.scope",
        "routes[0].cache.methods",
        "routes[0].cache.statuses",
        "routes[0].cache.x",
    ):
        assert field in fields, caught.value.problems
    with pytest.raises(ConfigError, match=r"routes\[0\]: .*cache.scope: principal needs"):
        parse_config({"routes": [cached("http://h", scope="principal")]}, env={})
    mcp = {**cached("http://h", methods=["POST"]), "protocol": "mcp"}  # cached by tool there
    with pytest.raises(ConfigError, match=r"routes\[0\]: .*cache.methods: not on protocol: mcp"):
        parse_config({"routes": [mcp]}, env={})
    # without a named resource, a versioned write could not invalidate the cached reads
    versioned = {**cached("http://h", methods=["GET"]), "versioning": {"key": "path:0"}}
    with pytest.raises(ConfigError, match=r"routes\[0\]: .*cache and versioning: on one route"):
        parse_config({"routes": [versioned]}, env={})
    good = parse_config({"routes": [cached("http://h", ttl="1h", methods=["post"])]}, env={})
    cache = good.routes[0].cache
    assert cache is not None and cache.ttl == 3600 and cache.methods == ("POST",)
    assert cache.statuses == (200, 203, 204) and good.routes[0].cache_wait() == 10.0


def test_the_default_wait_is_as_long_as_the_call_it_waits_for() -> None:
    spec = {**cached("http://h"), "timeout": "20s"}
    spec["token"] = {
        "mode": "client_credentials",
        "token_endpoint": "https://idp/token",
        "client_id": "tool-proxy",
        "client_secret_env": "SECRET",
        "retry_on_401": True,
    }
    route = parse_config({"routes": [spec]}, env={"SECRET": "s"}).routes[0]
    assert route.cache_wait() == (20 + 10) * 2  # two token fetches and two sends
    assert route.cache_wait() == fill_seconds(route) - FILL_MARGIN_SECONDS


def test_check_config_names_the_cache_fields(tmp_path: Path) -> None:
    bad = cached("http://h", ttl="soon", statuses=[201])
    result = cli("check-config", write(tmp_path, {"routes": [bad]}))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "routes[0].cache.ttl: not a duration" in result.stderr
    assert "routes[0].cache.statuses: 201 is not safe to reuse" in result.stderr


# -- units ----------------------------------------------------------------------------------


def test_cache_control_directives_and_entries_round_trip() -> None:
    assert directives('no-cache, Max-Age="60", private=x') == {
        "no-cache": "",
        "max-age": "60",
        "private": "x",
    }
    stored = StoredResponse(200, [(b"content-type", b"application/json")], b"{}\r\n\r\nx")
    entry = encode_entry(12.5, [(b"accept-language", b"de")], stored)
    assert decode_entry(entry) == (12.5, [(b"accept-language", b"de")], stored)
    assert decode_entry(encode_entry(1.0, [], stored))[2] == stored


def test_delta_seconds_are_ascii_digits_and_a_huge_one_is_very_large() -> None:
    assert seconds("60") == 60 and seconds("0") == 0
    for invalid in ("", "-1", "1.5", " 6", "\u00b2", "\u0663", "6s"):  # ² and Arabic-Indic 3
        assert seconds(invalid) == 0, invalid
    assert seconds("9" * 5000) == seconds("1" + "0" * 20) == 9_999_999_999


# -- hits and misses ------------------------------------------------------------------------


def test_a_repeated_request_is_a_hit_served_without_calling_the_tool(
    store_url: str, make_proxy: ProxyFactory, tool: CountingTool
) -> None:
    proxy = make_proxy(cached(tool.url), store=store_url)
    first = ask(proxy.url)
    assert first.status_code == 200 and cache_status(first) == STORED
    again = ask(proxy.url)
    assert again.status_code == 200 and cache_status(again) == HIT
    assert again.content == first.content and again.headers["age"] == "0"
    assert again.headers["x-tool"] == "counting"
    reordered = ask(proxy.url, body=b'{ "doc": 7,  "prompt": "summarise" }')  # RFC 8785
    assert cache_status(reordered) == HIT
    assert tool.total == 1
    for other in (
        ask(proxy.url, "?v=2"),
        ask(proxy.url, body={"doc": 8}),
        ask(proxy.url, path="/tools/x"),
    ):
        assert cache_status(other) == STORED
    assert httpx.get(proxy.url + "/tools/infer").headers["cache-status"] == STORED  # GET too
    assert tool.total == 5


def test_the_same_bytes_of_another_media_type_are_another_request(
    make_proxy: ProxyFactory, tool: CountingTool
) -> None:
    proxy = make_proxy(cached(tool.url))
    canonical = b'{"doc":7,"prompt":"summarise"}'  # its RFC 8785 form is its bytes
    assert cache_status(ask(proxy.url, body=canonical)) == STORED
    as_text = ask(proxy.url, body=canonical, headers={"content-type": "text/plain"})
    assert cache_status(as_text) == STORED
    charset = {"content-type": "Application/JSON; charset=utf-8"}  # the same media type
    assert cache_status(ask(proxy.url, body=canonical, headers=charset)) == HIT
    assert tool.total == 2


def test_methods_not_cached_pass_without_a_cache_status(
    make_proxy: ProxyFactory, tool: CountingTool
) -> None:
    proxy = make_proxy(cached(tool.url, methods=["POST"]))
    for _ in range(2):
        answer = httpx.put(proxy.url + "/tools/infer", json=BODY)
        assert answer.status_code == 200 and "cache-status" not in answer.headers
    assert tool.total == 2


def test_request_no_cache_forces_a_fresh_call_and_stores_it(
    make_proxy: ProxyFactory, tool: CountingTool
) -> None:
    proxy = make_proxy(cached(tool.url))
    assert ask(proxy.url).json()["execution"] == 1
    fresh = ask(proxy.url, headers={"cache-control": "no-cache"})
    assert cache_status(fresh) == "tool-proxy; fwd=request; stored"
    assert fresh.json()["execution"] == 2
    assert ask(proxy.url, headers={"cache-control": "max-age=0"}).json()["execution"] == 3
    later = ask(proxy.url)
    assert cache_status(later) == HIT and later.json()["execution"] == 3
    assert ask(proxy.url, headers={"cache-control": "max-age=60"}).json()["execution"] == 3


@pytest.mark.parametrize("asked", ["no-cache", "max-age=0"])
def test_request_no_cache_during_a_fill_calls_at_once_without_waiting_for_it(
    make_proxy: ProxyFactory, tool: CountingTool, asked: str
) -> None:
    proxy = make_proxy(cached(tool.url))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(ask, proxy.url, "?delay=1")
        wait_for(lambda: tool.in_flight == 1, what="the fill at the tool")
        fresh = ask(proxy.url, "?delay=1", headers={"cache-control": asked})
        assert cache_status(fresh) == "tool-proxy; fwd=request; stored"
        assert cache_status(first.result()) == STORED
    assert tool.most_in_flight == 2 and tool.total == 2  # it did not wait for the fill
    assert cache_status(ask(proxy.url, "?delay=1")) == HIT


def test_request_no_store_skips_the_cache_both_ways(
    make_proxy: ProxyFactory, tool: CountingTool
) -> None:
    proxy = make_proxy(cached(tool.url))
    skipped = ask(proxy.url, headers={"cache-control": "no-store"})
    assert cache_status(skipped) == "tool-proxy; fwd=request; detail=no-store"
    assert cache_status(ask(proxy.url)) == STORED  # nothing was stored by it
    again = ask(proxy.url, headers={"cache-control": "no-store"})
    assert again.json()["execution"] == 3  # nor was the stored answer used
    assert tool.total == 3


@pytest.mark.parametrize(
    ("query", "detail"),
    [
        ("?cache_control=no-store", "no-store"),
        ("?cache_control=no-cache", "no-cache"),
        ("?cache_control=private", "private"),
        ("?cache_control=max-age=0", "max-age"),
        ("?vary=*", "vary"),
        ("?status=500", "status"),
        ("?status=404", "status"),
        ("?status=201", "status"),
    ],
)
def test_answers_that_may_not_be_reused_are_passed_on_and_not_stored(
    make_proxy: ProxyFactory, tool: CountingTool, query: str, detail: str
) -> None:
    proxy = make_proxy(cached(tool.url))
    for _ in range(2):
        answer = ask(proxy.url, query)
        assert cache_status(answer) == f"tool-proxy; fwd=miss; detail={detail}"
    assert tool.total == 2


def test_statuses_can_add_the_other_cacheable_ones(
    make_proxy: ProxyFactory, tool: CountingTool
) -> None:
    proxy = make_proxy(cached(tool.url, statuses=[200, 404]))
    assert cache_status(ask(proxy.url, "?status=404")) == STORED
    missing = ask(proxy.url, "?status=404")
    assert missing.status_code == 404 and cache_status(missing) == HIT
    assert tool.total == 1


def test_max_age_of_the_answer_shortens_its_life_and_age_is_sent(
    clocked: Any, tool: CountingTool
) -> None:
    clock = Clock()
    proxy = clocked(cached(tool.url, ttl="1h"), clock=clock)
    assert cache_status(ask(proxy.url, "?cache_control=max-age=60")) == STORED
    clock.now += 59
    hit = ask(proxy.url, "?cache_control=max-age=60")
    assert cache_status(hit) == HIT and hit.headers["age"] == "59"
    clock.now += 2
    assert cache_status(ask(proxy.url, "?cache_control=max-age=60")) == STORED
    assert cache_status(ask(proxy.url)) == STORED  # no max-age: the route's ttl
    clock.now += 3599
    assert cache_status(ask(proxy.url)) == HIT
    clock.now += 2
    assert cache_status(ask(proxy.url)) == STORED
    assert tool.total == 4


def test_s_maxage_takes_precedence_over_max_age(clocked: Any, tool: CountingTool) -> None:
    clock = Clock()
    proxy = clocked(cached(tool.url, ttl="1h"), clock=clock)
    shorter, longer = (
        "?cache_control=max-age=3600,s-maxage=60",
        "?cache_control=s-maxage=600,max-age=60",
    )
    assert cache_status(ask(proxy.url, shorter)) == STORED
    assert cache_status(ask(proxy.url, longer)) == STORED
    clock.now += 61
    assert cache_status(ask(proxy.url, shorter)) == STORED  # s-maxage=60 ended it
    assert cache_status(ask(proxy.url, longer)) == HIT  # max-age=60 did not
    assert tool.total == 3


def test_set_cookie_is_never_stored(make_proxy: ProxyFactory, tool: CountingTool) -> None:
    proxy = make_proxy(cached(tool.url))
    first = ask(proxy.url, "?cookie=1")
    assert cache_status(first) == STORED and "secret-session" in first.headers["set-cookie"]
    hit = ask(proxy.url, "?cookie=1")
    assert cache_status(hit) == HIT and "set-cookie" not in hit.headers
    assert hit.headers["x-tool"] == "counting" and tool.total == 1


def test_an_answer_that_varies_is_reused_only_for_the_same_request_fields(
    make_proxy: ProxyFactory, tool: CountingTool
) -> None:
    proxy = make_proxy(cached(tool.url))
    german = {"accept-language": "de"}
    assert cache_status(ask(proxy.url, "?vary=Accept-Language", headers=german)) == STORED
    assert cache_status(ask(proxy.url, "?vary=Accept-Language", headers=german)) == HIT
    french = ask(proxy.url, "?vary=Accept-Language", headers={"accept-language": "fr"})
    assert cache_status(french) == "tool-proxy; fwd=vary-miss; stored"
    assert tool.total == 2


def test_a_body_without_a_digest_is_passed_on_uncached(
    make_proxy: ProxyFactory, tool: CountingTool
) -> None:
    proxy = make_proxy(cached(tool.url))
    broken = ask(proxy.url, body=b'{"prompt": ')
    assert broken.status_code == 200
    assert cache_status(broken) == "tool-proxy; fwd=bypass; detail=body"


# -- with idempotency -----------------------------------------------------------------------


def test_a_huge_max_age_either_way_is_served_on_a_guarded_route(
    make_proxy: ProxyFactory, tool: CountingTool
) -> None:
    proxy = make_proxy(cached(tool.url, guarded=True))
    huge = "max-age=" + "9" * 5000  # beyond int()'s digit limit
    asked = ask(proxy.url, headers={"idempotency-key": new_key(BODY), "cache-control": huge})
    assert asked.status_code == 200 and asked.json()["execution"] == 1
    assert cache_status(asked) == STORED
    told = ask(
        proxy.url, f"?cache_control={huge}", {"n": 2}, {"idempotency-key": new_key({"n": 2})}
    )
    assert told.status_code == 200 and cache_status(told) == STORED
    again = ask(
        proxy.url, f"?cache_control={huge}", {"n": 2}, {"idempotency-key": new_key({"n": 2})}
    )
    assert cache_status(again) == HIT and again.content == told.content
    superscript = ask(
        proxy.url, "?cache_control=max-age=%C2%B2", {"n": 3}, {"idempotency-key": new_key({"n": 3})}
    )
    assert superscript.status_code == 200  # the tool sent max-age=\xb2: latin-1 "²", not a number
    assert cache_status(superscript) == "tool-proxy; fwd=miss; detail=max-age"
    assert tool.total == 3


def test_on_a_guarded_route_a_hit_is_recorded_as_its_keys_outcome(
    make_proxy: ProxyFactory, tool: CountingTool
) -> None:
    proxy = make_proxy(cached(tool.url, guarded=True))
    first_key, second_key = new_key(BODY), new_key(BODY)
    first = ask(proxy.url, headers={"idempotency-key": first_key})
    assert cache_status(first) == STORED
    second = ask(proxy.url, headers={"idempotency-key": second_key})
    assert cache_status(second) == HIT and second.content == first.content
    replay = ask(proxy.url, headers={"idempotency-key": second_key})
    assert replay.headers["idempotent-replayed"] == "true"
    assert "cache-status" not in replay.headers  # a replay of its record, not a hit
    assert "age" not in replay.headers
    assert replay.content == first.content
    assert tool.total == 1
    metrics = httpx.get(f"{proxy.url}/_proxy/metrics").text
    for outcome in ("executed", "cached", "replayed"):  # a hit is not an execution
        assert (
            f'tool_proxy_requests_total{{outcome="{outcome}",route="tool",status="200"}} 1.0'
            in (metrics)
        ), outcome


# -- single-flight --------------------------------------------------------------------------


def assert_one_call(answers: list[httpx.Response]) -> None:
    """One answer made the call and stored it; the others waited for it (collapsed), or,
    arriving after it was stored, hit."""
    statuses = [cache_status(a) for a in answers]
    assert statuses.count(STORED) == 1, statuses
    assert "tool-proxy; fwd=miss; collapsed" in statuses
    assert set(statuses) <= {STORED, "tool-proxy; fwd=miss; collapsed", HIT}, statuses


def test_identical_misses_at_once_make_one_call(
    store_url: str, make_proxy: ProxyFactory, tool: CountingTool
) -> None:
    proxy = make_proxy(cached(tool.url), store=store_url)
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        answers = list(pool.map(lambda _: ask(proxy.url, "?delay=0.3"), range(5)))
    assert [a.status_code for a in answers] == [200] * 5
    assert len({a.content for a in answers}) == 1
    assert_one_call(answers)
    assert tool.total == 1


def test_waiters_call_the_tool_themselves_past_wait(
    make_proxy: ProxyFactory, tool: CountingTool
) -> None:
    proxy = make_proxy(cached(tool.url, wait="100ms"))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(ask, proxy.url, "?delay=0.6")
        wait_for(lambda: tool.in_flight == 1, what="the first call at the tool")
        second = ask(proxy.url, "?delay=0.6")
        assert cache_status(second) == STORED  # its own call: it stopped waiting for the first
        assert first.result().status_code == 200
    assert tool.total == 2


def test_waiters_of_an_uncacheable_answer_call_at_once(
    make_proxy: ProxyFactory, tool: CountingTool
) -> None:
    proxy = make_proxy(cached(tool.url))
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: ask(proxy.url, "?delay=0.5&status=500"), range(4)))
    assert [a.status_code for a in answers] == [500] * 4
    assert time.monotonic() - started < 1.6  # the first, then the others at once: not 4 x 0.5 s
    assert tool.most_in_flight == 3
    assert tool.total == 4


# -- offload --------------------------------------------------------------------------------


def test_a_large_cached_answer_lives_in_object_storage(
    make_proxy: ProxyFactory, tool: CountingTool, s3: S3
) -> None:
    proxy = make_proxy(cached(tool.url), offload=s3_offload(s3, threshold=10_000))
    first = ask(proxy.url, "?size=300000")
    assert first.content == expected(300_000) and cache_status(first) == STORED
    [object_key] = s3.keys()
    assert object_key.startswith("responses/tool/")
    again = ask(proxy.url, "?size=300000")
    assert cache_status(again) == HIT and again.content == expected(300_000)
    assert tool.total == 1
    s3.client().delete_object(Bucket=BUCKET, Key=object_key)  # gone: a miss, not an error
    lost = ask(proxy.url, "?size=300000")
    assert lost.content == expected(300_000) and cache_status(lost) == STORED
    assert tool.total == 2


def test_a_large_cached_answer_altered_in_object_storage_is_cut_short_then_a_miss(
    make_proxy: ProxyFactory, tool: CountingTool, s3: S3
) -> None:
    size = 2_000_000  # above VERIFY_WHOLE_BYTES: checked as it streams
    proxy = make_proxy(cached(tool.url), offload=s3_offload(s3, threshold=10_000))
    assert ask(proxy.url, f"?size={size}").content == expected(size)
    [object_key] = s3.keys()
    s3.client().put_object(Bucket=BUCKET, Key=object_key, Body=b"x" * size)  # same size
    with pytest.raises(httpx.HTTPError):  # never a wrong whole body
        ask(proxy.url, f"?size={size}")
    wait_for(
        lambda: (
            cache_status(again := ask(proxy.url, f"?size={size}")) == STORED
            and again.content == expected(size)
        ),
        what="the altered entry dropped: a miss",
    )
    assert tool.total == 2


def test_a_caller_that_leaves_mid_stream_does_not_discard_a_good_answer(
    make_proxy: ProxyFactory, tool: CountingTool
) -> None:
    size, query = 1_000_000, "?size=1000000&chunk_delay=0.05"  # 16 chunks, 0.05 s apart
    proxy = make_proxy(cached(tool.url))
    content = json.dumps(BODY).encode()
    headers = {"content-type": "application/json"}
    with httpx.stream(
        "POST", f"{proxy.url}/tools/infer{query}", content=content, headers=headers
    ) as r:
        assert cache_status(r) == STORED
        next(r.iter_raw())  # the first chunk, then the caller leaves
    wait_for(
        lambda: cache_status(hit := ask(proxy.url, query)) == HIT and hit.content == expected(size),
        what="the answer read to its end and stored without its caller",
    )
    assert tool.total == 1


def test_an_answer_above_max_bytes_is_not_stored(
    make_proxy: ProxyFactory, tool: CountingTool
) -> None:
    proxy = make_proxy(cached(tool.url, max_bytes=100_000))
    for _ in range(2):
        assert ask(proxy.url, "?size=200000").content == expected(200_000)
    assert tool.total == 2


# -- scoping --------------------------------------------------------------------------------


def test_scope_principal_never_serves_another_callers_answer(
    make_proxy: ProxyFactory, tool: CountingTool, idp: IdentityProvider
) -> None:
    spec = cached(tool.url, scope="principal")
    spec["auth"] = {"required": True}
    proxy = make_proxy(spec, auth=auth_config(idp))

    def as_(who: str, query: str = "") -> httpx.Response:
        return ask(proxy.url, query, headers={"authorization": f"Bearer {idp.token(who)}"})

    assert cache_status(as_("alice")) == STORED
    assert cache_status(as_("alice")) == HIT
    assert cache_status(as_("bob")) == STORED
    assert cache_status(as_("bob", "?cache_control=private")) == STORED  # private: per caller
    assert cache_status(as_("bob", "?cache_control=private")) == HIT
    assert cache_status(as_("alice", "?cache_control=private")) == STORED  # not bob's
    assert tool.total == 4


def test_a_private_answer_is_one_users_when_the_principal_is_a_tenant(
    make_proxy: ProxyFactory, tool: CountingTool, idp: IdentityProvider, store_url: str
) -> None:
    """``principal: [tid]``: alice and bob share a cache, but not their private answers,
    not even as identical misses collapsed onto one call."""
    spec = cached(tool.url, scope="principal")
    spec["auth"] = {"required": True}
    proxy = make_proxy(spec, store=store_url, auth={**auth_config(idp), "principal": ["tid"]})

    def as_(who: str, query: str = "?cache_control=private") -> httpx.Response:
        token = idp.token(who, tid="t1")
        return ask(proxy.url, query, headers={"authorization": f"Bearer {token}"})

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        alices = pool.submit(as_, "alice", "?cache_control=private&delay=0.3")
        wait_for(lambda: tool.arrived["/tools/infer"] == 1, what="alice's call at the tool")
        bobs = as_("bob", "?cache_control=private&delay=0.3")  # waits for alice's, then its own
        assert cache_status(alices.result()) == STORED
    assert cache_status(bobs).endswith("stored") and bobs.json()["execution"] == 2
    for who, execution in (("alice", 1), ("bob", 2), ("alice", 1)):
        again = as_(who, "?cache_control=private&delay=0.3")
        assert cache_status(again) == HIT and again.json()["execution"] == execution, who
    assert cache_status(as_("carol", "?cache_control=private&delay=0.3")) == STORED
    assert cache_status(as_("alice", "")) == STORED  # what is not private the tenant shares
    assert cache_status(as_("bob", "")) == HIT
    assert tool.total == 4


def test_a_private_answer_is_not_shared_by_the_anonymous_callers(
    make_proxy: ProxyFactory, tool: CountingTool, idp: IdentityProvider
) -> None:
    spec = cached(tool.url, scope="principal")
    spec["auth"] = {"required": False}
    proxy = make_proxy(spec, auth=auth_config(idp))
    for _ in range(2):  # no token: principal "", one cache for all of them
        assert cache_status(ask(proxy.url, "?cache_control=private")) == (
            "tool-proxy; fwd=miss; detail=private"
        )
    assert cache_status(ask(proxy.url)) == STORED  # what is not private they share
    assert cache_status(ask(proxy.url)) == HIT
    assert tool.total == 3


# -- shared by replicas (real Redis, two proxy processes) -------------------------------------


@pytest.fixture
def two_proxies(
    tmp_path: Path, tool: CountingTool, redis_server: RedisServer, idp: IdentityProvider
) -> Iterator[list[ProxyProcess]]:
    redis_server.flush()
    spec = cached(tool.url, scope="principal")
    spec["auth"] = {"required": True}
    config = {"store": {"url": redis_server.url}, "routes": [spec], "auth": auth_config(idp)}
    proxies = [ProxyProcess(config, tmp_path).start() for _ in range(2)]
    yield proxies
    for proxy in proxies:
        if proxy.process is not None:
            proxy.stop()


def test_ten_identical_misses_across_replicas_make_one_call_and_other_callers_miss(
    two_proxies: list[ProxyProcess], tool: CountingTool, idp: IdentityProvider
) -> None:
    alice = {"authorization": f"Bearer {idp.token('alice')}"}
    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        answers = list(
            pool.map(lambda n: ask(two_proxies[n % 2].url, "?delay=0.5", headers=alice), range(10))
        )
    assert [a.status_code for a in answers] == [200] * 10
    assert tool.total == 1
    assert len({a.content for a in answers}) == 1
    assert_one_call(answers)
    for proxy in two_proxies:
        assert cache_status(ask(proxy.url, "?delay=0.5", headers=alice)) == HIT
    bob = {"authorization": f"Bearer {idp.token('bob')}"}
    other = ask(two_proxies[1].url, "?delay=0.5", headers=bob)
    assert cache_status(other) == STORED and other.json()["execution"] == 2
    assert tool.total == 2


# -- failures (units: a store that fails, an answer that breaks) ------------------------------


class Answer(UpstreamResponse):
    """A tool's answer without a connection; ``broken``: its body never arrives whole."""

    def __init__(self, broken: bool = False, headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
        sent = [(b"content-type", b"application/json"), *headers]
        super().__init__(200, sent, 11)
        self.broken = broken

    async def read(self) -> bytes:
        if self.broken:
            raise OutcomeUnknown("the connection broke mid-body")
        return b'{"ok":true}'

    async def stream(self) -> AsyncIterator[bytes]:
        yield b'{"ok":'
        if self.broken:
            raise OutcomeUnknown("the connection broke mid-body")
        yield b"true}"


class DownStore(MemoryStore):
    async def get_value(self, key: str) -> bytes | None:
        raise StoreUnavailable("redis store: ConnectionError")


ROUTE = parse_config({"routes": [cached("http://h")]}, env={}).routes[0]


def policy(store: MemoryStore) -> tuple[Cache, TaskSet]:
    tasks = TaskSet()
    return Cache(ROUTE, store, Metrics(), tasks, structlog.get_logger()), tasks


def context_of(*headers: tuple[bytes, bytes]) -> Context:
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/tools/infer",
        "raw_path": b"/tools/infer",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), *headers],
    }
    request = Incoming.of(scope, None)  # type: ignore[arg-type]
    return Context(ROUTE, request, json.dumps(BODY).encode())


def test_the_cache_fails_open_when_the_store_is_down() -> None:
    async def run() -> tuple[bytes, Context]:
        cache, _ = policy(DownStore())
        context = context_of()

        async def forward() -> UpstreamResponse:
            return Answer()

        return await (await cache.wrap(context, forward)()).read(), context

    body, context = asyncio.run(run())
    assert body == b'{"ok":true}'
    assert context.headers == [(b"cache-status", b"tool-proxy; fwd=miss; detail=store-unavailable")]


def test_an_answer_that_breaks_is_not_stored_and_frees_its_waiters_at_once() -> None:
    async def run() -> tuple[bytes | None, bool]:
        store = MemoryStore()
        cache, tasks = policy(store)
        context = context_of()

        async def forward() -> UpstreamResponse:
            return Answer(broken=True)

        upstream = await cache.wrap(context, forward)()
        with pytest.raises(OutcomeUnknown):
            await upstream.read()
        await tasks.drain(1)
        key = cache.key(context)
        return await store.get_value(key), await store.acquire(key, "another", 1)

    value, free = asyncio.run(run())
    assert value == b"uncacheable" and free  # waiters call the tool themselves, now


def test_a_failure_of_the_cache_before_the_send_forwards_the_call_once() -> None:
    async def run() -> tuple[bytes, Context, int]:
        cache, _ = policy(MemoryStore())
        context = context_of()
        calls = 0

        def broken(context: Context) -> str:
            raise RuntimeError("a bug in the key")

        async def forward() -> UpstreamResponse:
            nonlocal calls
            calls += 1
            return Answer()

        cache.key = broken  # type: ignore[method-assign]
        return await (await cache.wrap(context, forward)()).read(), context, calls

    body, context, calls = asyncio.run(run())
    assert body == b'{"ok":true}' and calls == 1
    assert context.headers == [(b"cache-status", b"tool-proxy; fwd=miss; detail=error")]


def test_an_error_of_the_send_itself_is_raised_not_sent_again() -> None:
    async def run() -> int:
        cache, tasks = policy(MemoryStore())
        calls = 0

        async def forward() -> UpstreamResponse:
            nonlocal calls
            calls += 1
            raise OutcomeUnknown("the tool timed out")

        with pytest.raises(OutcomeUnknown):
            await cache.wrap(context_of(), forward)()
        await tasks.drain(1)
        return calls

    assert asyncio.run(run()) == 1


class SecondReadFails(MemoryStore):
    """The first read of an entry answers; every later one fails (after the fill lock)."""

    reads = 0

    async def get_value(self, key: str) -> bytes | None:
        self.reads += key.startswith("cache|")  # not the lock's own key
        if self.reads > 1 and key.startswith("cache|"):
            raise StoreUnavailable("redis store: ConnectionError")
        return await super().get_value(key)


def test_the_fill_lock_is_freed_when_the_read_after_it_fails() -> None:
    async def run() -> tuple[bytes, bool]:
        store = SecondReadFails()
        cache, tasks = policy(store)
        context = context_of()

        async def forward() -> UpstreamResponse:
            return Answer()

        body = await (await cache.wrap(context, forward)()).read()
        await tasks.drain(1)
        return body, await store.acquire(cache.key(context), "another", 1)

    body, free = asyncio.run(run())
    assert body == b'{"ok":true}' and free


def test_a_failure_of_the_cache_after_the_send_keeps_the_answer_and_frees_the_lock() -> None:
    async def run() -> tuple[bytes, bytes | None, bool, Context]:
        store = MemoryStore()
        cache, tasks = policy(store)
        context = context_of()

        def broken(upstream: UpstreamResponse, principal: str) -> tuple[float, bytes]:
            raise RuntimeError("a bug in freshness")

        async def forward() -> UpstreamResponse:
            return Answer()

        cache._freshness = broken  # type: ignore[method-assign]
        body = await (await cache.wrap(context, forward)()).read()
        await tasks.drain(1)
        key = cache.key(context)
        return body, await store.get_value(key), await store.acquire(key, "another", 1), context

    body, value, free, context = asyncio.run(run())
    assert body == b'{"ok":true}' and value == b"uncacheable" and free
    assert context.headers == []


def test_the_values_of_varyd_fields_are_kept_as_digests_never_as_sent() -> None:
    secret = b"Bearer secret-token-of-alice"

    async def run() -> tuple[bytes | None, list[bytes]]:
        store = MemoryStore()
        cache, tasks = policy(store)
        statuses = []
        for token in (secret, secret, b"Bearer another"):
            context = context_of((b"authorization", token))

            async def forward() -> UpstreamResponse:
                return Answer(headers=((b"vary", b"Authorization"),))

            await (await cache.wrap(context, forward)()).read()
            await tasks.drain(1)
            statuses.append(dict(context.headers)[b"cache-status"])
        return await store.get_value(cache.key(context)), statuses

    value, statuses = asyncio.run(run())
    assert statuses == [STORED.encode(), HIT.encode(), b"tool-proxy; fwd=vary-miss; stored"]
    assert value is not None and b"secret-token" not in value and b"another" not in value


def test_a_mark_never_replaces_an_answer_stored_meanwhile() -> None:
    stored = encode_entry(time.time(), [], StoredResponse(200, [], b'{"ok":1}'))

    async def run() -> bytes | None:
        store = MemoryStore()
        cache, tasks = policy(store)
        context = context_of()

        async def forward() -> UpstreamResponse:  # a waiter past its wait stores its answer
            await store.put_value(cache.key(context), stored, 60)
            return Answer(broken=True)

        upstream = await cache.wrap(context, forward)()
        with pytest.raises(OutcomeUnknown):
            await upstream.read()
        await tasks.drain(1)
        return await store.get_value(cache.key(context))

    assert asyncio.run(run()) == stored


class WritesFail(MemoryStore):
    async def put_value(self, key: str, value: bytes, ttl: float) -> None:
        if key.startswith("cache|"):  # entries and marks; the fill lock (lock|...) works
            raise StoreUnavailable("redis store: ConnectionError")
        await super().put_value(key, value, ttl)


def test_an_answer_sent_stored_that_cannot_be_written_is_counted_not_kept() -> None:
    async def run() -> tuple[bytes, Context, Metrics, bool]:
        store = WritesFail()
        tasks, metrics = TaskSet(), Metrics()
        cache = Cache(ROUTE, store, metrics, tasks, structlog.get_logger())
        context = context_of()

        async def forward() -> UpstreamResponse:
            return Answer()

        body = await (await cache.wrap(context, forward)()).read()
        await tasks.drain(1)
        return body, context, metrics, await store.acquire(cache.key(context), "another", 1)

    body, context, metrics, free = asyncio.run(run())
    assert body == b'{"ok":true}' and free
    assert context.headers == [(b"cache-status", STORED.encode())]  # sent before the write
    for decision in ("stored", "not_kept"):
        labels = {"route": "tool", "decision": decision}
        assert metrics.registry.get_sample_value("tool_proxy_cache_decisions_total", labels) == 1


@pytest.mark.parametrize("broken", [False, True])
def test_a_streamed_answer_is_stored_whole_or_its_break_reaches_the_caller(broken: bool) -> None:
    async def run() -> tuple[list[bytes], BaseException | None, bytes | None, bool]:
        store = MemoryStore()
        cache, tasks = policy(store)
        context = context_of()

        async def forward() -> UpstreamResponse:
            return Answer(broken=broken)

        got: list[bytes] = []
        error = None
        try:
            async for chunk in (await cache.wrap(context, forward)()).stream():
                got.append(chunk)
        except OutcomeUnknown as exc:
            error = exc
        await tasks.drain(1)
        key = cache.key(context)
        return got, error, await store.get_value(key), await store.acquire(key, "another", 1)

    got, error, value, free = asyncio.run(run())
    assert free
    if broken:  # the first chunk is held back until the end: nothing, then the break
        assert got == [] and error is not None and value == b"uncacheable"
    else:
        assert got == [b'{"ok":', b"true}"] and error is None
        assert value is not None and decode_entry(value)[2].body == b'{"ok":true}'


def test_a_hit_for_a_call_whose_lease_was_lost_is_not_its_answer() -> None:
    """A guarded call answered from the cache after a wait that outlived its lease (a
    retry took its key over meanwhile) is refused as not sent: its key replays the other
    attempt's answer, so this caller must not be told another one."""

    class Lost:
        def check(self) -> float:
            raise LeaseLost("taken over")

    async def run() -> None:
        cache, tasks = policy(MemoryStore())

        async def forward() -> UpstreamResponse:
            return Answer()

        filled = await cache.wrap(context_of(), forward)()
        assert await filled.read() == b'{"ok":true}'
        assert await tasks.drain(5)
        fence = Fence()
        fence.arm(Lost())
        lost = context_of()
        lost.fence = fence
        with pytest.raises(LeaseLost):
            await cache.wrap(lost, forward)()
        live = context_of()  # without a fence (or with a live lease): the hit
        assert await (await cache.wrap(live, forward)()).read() == b'{"ok":true}'
        assert live.cached

    asyncio.run(run())
