"""Shared resources (proxy/policies/lock.py, versioning.py): per-resource locks with
fencing tokens, and versioned writes.

In-process proxies on the memory store for the behaviour; real ``tool-proxy serve``
processes sharing a real Redis for what replicas share.
"""

from __future__ import annotations

import concurrent.futures
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from proxy.config import parse_config
from proxy.errors import ConfigError
from proxy.policies import versioning
from tests.conftest import ProxyFactory, new_key, route
from tests.servers import CountingTool, ProxyProcess, RedisServer, ThreadServer, wait_for


def locked(upstream: str, guarded: bool = False, **lock: Any) -> dict[str, Any]:
    spec = route(upstream, guarded=guarded)
    spec["lock"] = {"key": "json:/account", "ttl": "1s", "wait": "5s", **lock}
    return spec


def versioned(upstream: str, **versioning: Any) -> dict[str, Any]:
    spec = route(upstream, guarded=False)
    spec["versioning"] = {"key": "path:0", **versioning}
    return spec


def debit(
    base: str, account: str = "A", query: str = "", headers: dict[str, str] | None = None
) -> httpx.Response:
    body = json.dumps({"account": account, "amount": 5})
    sent = {"content-type": "application/json", **(headers or {})}
    return httpx.post(f"{base}/tools/debit{query}", content=body, headers=sent, timeout=30)


def tokens(tool: CountingTool) -> list[int]:
    return [int(r["headers"]["fencing-token"]) for r in tool.requests]


def assert_locked(answer: httpx.Response) -> None:
    assert answer.status_code == 409, answer.text
    assert answer.json()["type"] == "urn:tool-proxy:problem:resource-locked"
    assert int(answer.headers["retry-after"]) >= 1


# -- configuration --------------------------------------------------------------------------


def test_lock_and_versioning_keys_are_checked_each_naming_its_field() -> None:
    bad = locked("http://h", key="body:/account", ttl=0, colour=1)
    bad["versioning"] = {"key": "path:x", "methods": ["GET"], "required": "maybe"}
    with pytest.raises(ConfigError) as caught:
        parse_config({"routes": [bad]}, env={})
    fields = [p.split(":", 1)[0] for p in caught.value.problems]
    for field in (
        "routes[0].lock.key",
        "routes[0].lock.ttl",
        "routes[0].lock.colour",
        "routes[0].versioning.key",
        "routes[0].versioning.methods",
        "routes[0].versioning.required",
    ):
        assert field in fields, caught.value.problems
    with pytest.raises(ConfigError, match=r"routes\[0\]: .*lock.key: principal needs"):
        parse_config({"routes": [locked("http://h", key="principal")]}, env={})
    with pytest.raises(ConfigError, match=r"routes\[0\].lock.fencing_header: Authorization"):
        parse_config({"routes": [locked("http://h", fencing_header="Authorization")]}, env={})
    good = parse_config({"routes": [locked("http://h", key="header:X-Account")]}, env={})
    lock = good.routes[0].lock
    assert lock is not None and lock.key == "header:x-account" and lock.ttl == 1.0
    kept = parse_config({"routes": [versioned("http://h", ttl="1d")]}, env={}).routes[0]
    assert kept.versioning is not None and kept.versioning.ttl == 86400.0
    with pytest.raises(ConfigError, match=r"routes\[0\].versioning.ttl"):
        parse_config({"routes": [versioned("http://h", ttl=0)]}, env={})


# -- locks ------------------------------------------------------------------------------------


def test_calls_on_one_resource_run_one_at_a_time_with_growing_fencing_tokens(
    make_proxy: ProxyFactory, tool: CountingTool
) -> None:
    proxy = make_proxy(locked(tool.url))
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda _: debit(proxy.url, query="?delay=0.05"), range(6)))
    assert [a.status_code for a in answers] == [200] * 6
    assert tool.most_in_flight == 1
    assert tokens(tool) == [1, 2, 3, 4, 5, 6]


def test_calls_on_other_resources_run_at_the_same_time(
    make_proxy: ProxyFactory, tool: CountingTool
) -> None:
    proxy = make_proxy(locked(tool.url))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda a: debit(proxy.url, a, "?delay=0.3"), ["A", "B"]))
    assert [a.status_code for a in answers] == [200, 200]
    assert tool.most_in_flight == 2
    assert sorted(tokens(tool)) == [1, 2]  # one counter per route, not one per resource


def test_a_caller_cannot_choose_its_fencing_token(
    make_proxy: ProxyFactory, tool: CountingTool
) -> None:
    proxy = make_proxy(locked(tool.url, fencing_header="X-Fence"))
    assert debit(proxy.url, headers={"x-fence": "999"}).status_code == 200
    assert tool.requests[0]["headers"]["x-fence"] == "1"
    assert "fencing-token" not in tool.requests[0]["headers"]


def test_a_waiter_past_wait_gets_409_and_nothing_is_sent(
    make_proxy: ProxyFactory, tool: CountingTool
) -> None:
    proxy = make_proxy(locked(tool.url, wait="200ms"))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(debit, proxy.url, "A", "?delay=1")
        wait_for(lambda: tool.in_flight == 1, what="the holder at the tool")
        started = time.monotonic()
        assert_locked(debit(proxy.url, "A"))
        assert 0.15 < time.monotonic() - started < 0.8
        assert held.result().status_code == 200
    assert tool.total == 1
    assert debit(proxy.url, "A").status_code == 200  # freed with the holder's answer


def test_a_request_without_its_lock_key_is_a_400_naming_it(
    make_proxy: ProxyFactory, tool: CountingTool
) -> None:
    proxy = make_proxy(locked(tool.url))
    answer = httpx.post(proxy.url + "/tools/debit", json={"amount": 5})
    assert answer.status_code == 400, answer.text
    assert answer.json()["type"] == "urn:tool-proxy:problem:resource-key-missing"
    assert "/account" in answer.json()["detail"]
    assert tool.total == 0


# Bodies whose json: key cannot be read as the tool reads it: nested past any depth a
# reader takes, a lone surrogate (not Unicode), a member named twice (a tool may read the
# first value, the proxy would lock the last: another resource).
UNREADABLE_KEYS = [
    (b"[" * 5000 + b"]" * 5000, "invalid-json-body", "deeper"),
    (b'{"account": "\\ud800", "amount": 5}', "resource-key-missing", "/account"),
    (b'{"account": "A1", "account": "B1"}', "duplicate-json-member", "'account'"),
]


@pytest.mark.parametrize(("body", "problem", "named"), UNREADABLE_KEYS)
def test_a_lock_key_the_body_holds_unreadably_is_a_400_and_frees_the_key(
    make_proxy: ProxyFactory, tool: CountingTool, body: bytes, problem: str, named: str
) -> None:
    """Refused before the send, as a missing key is: the idempotency key is released (not
    recorded FAILED, "may have been executed"), so the same request gets the same 400.
    text/plain: the body is hashed as bytes, so only the lock reads it as JSON."""
    spec = locked(tool.url, guarded=True)
    spec["idempotency"]["key"] = "opaque"
    proxy = make_proxy(spec)
    url = proxy.url + "/tools/debit"
    sent = {"content-type": "text/plain", "idempotency-key": "bad-1"}
    if problem == "invalid-json-body":  # said not to be JSON, too deep to read: it is not
        problem, named = "resource-key-missing", "/account"
    for _ in range(2):
        refused = httpx.post(url, content=body, headers=sent)
        assert refused.status_code == 400, refused.text
        assert refused.headers["content-type"] == "application/problem+json"
        assert refused.json()["type"] == f"urn:tool-proxy:problem:{problem}"
        assert named in refused.json()["detail"]
    assert tool.total == 0
    good = {**sent, "idempotency-key": "good-1"}
    answer = httpx.post(url, content=b'{"account": "A1", "amount": 5}', headers=good)
    assert answer.status_code == 200, answer.text
    assert tool.total == 1


@pytest.mark.parametrize(("body", "problem", "named"), UNREADABLE_KEYS)
def test_a_versioned_write_whose_key_the_body_holds_unreadably_is_a_400(
    make_proxy: ProxyFactory, tool: CountingTool, body: bytes, problem: str, named: str
) -> None:
    """Never taken for a write of no one resource (forwarded unchecked)."""
    spec = versioned(tool.url, key="json:/account")
    proxy = make_proxy(spec)
    sent = {"content-type": "application/json", "if-none-match": "*"}
    refused = httpx.put(proxy.url + "/tools/s1", content=body, headers=sent)
    assert refused.status_code == 400, refused.text
    assert refused.json()["type"] == f"urn:tool-proxy:problem:{problem}"
    assert tool.total == 0


def test_a_lock_keyed_by_a_header_refuses_its_repeated_lines_and_frees_the_key(
    make_proxy: ProxyFactory, tool: CountingTool
) -> None:
    proxy = make_proxy(locked(tool.url, guarded=True, key="header:X-Account"))
    body = {"account": "A", "amount": 5}
    key = new_key(body)
    sent = [("content-type", "application/json"), ("idempotency-key", key)]
    twice = [*sent, ("x-account", "A"), ("x-account", "B")]
    url = proxy.url + "/tools/debit"
    refused = httpx.post(url, content=json.dumps(body), headers=twice)
    assert refused.status_code == 400, refused.text
    assert refused.json()["type"] == "urn:tool-proxy:problem:invalid-header"
    assert "x-account" in refused.json()["detail"]
    assert tool.total == 0
    once = httpx.post(url, content=json.dumps(body), headers=[*sent, ("x-account", "A")])
    assert once.status_code == 200, once.text  # the key was not left claimed
    assert tool.total == 1


def test_a_streamed_answer_holds_the_lock_until_its_end(
    make_proxy: ProxyFactory, tool: CountingTool
) -> None:
    proxy = make_proxy(locked(tool.url, wait=0))
    body = json.dumps({"account": "A"})
    url = proxy.url + "/tools/debit?size=655360&chunk_delay=0.05"  # 10 chunks, ~0.5 s
    with httpx.stream("POST", url, content=body, timeout=10) as streamed:
        assert streamed.status_code == 200
        chunks = streamed.iter_bytes()
        next(chunks)
        assert tool.in_flight == 0  # the tool has answered, its body is still coming
        assert_locked(debit(proxy.url, "A"))
        assert sum(len(c) for c in chunks) > 0
    wait_for(lambda: debit(proxy.url, "A").status_code == 200, 2, "the lock freed")


def test_a_path_segment_names_the_resource(make_proxy: ProxyFactory, tool: CountingTool) -> None:
    proxy = make_proxy(locked(tool.url, key="path:1"))
    for path in ("/tools/accounts/A", "/tools/accounts/A", "/tools/accounts/B"):
        assert httpx.post(proxy.url + path, content=b"{}").status_code == 200
    assert tokens(tool) == [1, 2, 3]  # growing per resource, drawn from the route's counter
    assert httpx.post(proxy.url + "/tools/accounts", content=b"{}").status_code == 400


def test_a_duplicate_is_answered_before_waiting_for_the_lock(
    make_proxy: ProxyFactory, tool: CountingTool
) -> None:
    proxy = make_proxy(locked(tool.url, guarded=True))
    body = {"account": "A", "amount": 5}
    key = new_key(body)
    url = proxy.url + "/tools/debit?delay=1"
    sent = {"idempotency-key": key, "content-type": "application/json"}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(httpx.post, url, content=json.dumps(body), headers=sent, timeout=10)
        wait_for(lambda: tool.in_flight == 1, what="the first call at the tool")
        started = time.monotonic()
        duplicate = httpx.post(url, content=json.dumps(body), headers=sent, timeout=10)
        assert time.monotonic() - started < 0.5  # not after the lock's wait
        assert duplicate.status_code == 409
        assert duplicate.json()["type"] == "urn:tool-proxy:problem:request-in-progress"
        assert first.result().status_code == 200
    replay = httpx.post(url, content=json.dumps(body), headers=sent, timeout=10)
    assert replay.headers["idempotent-replayed"] == "true"
    assert tool.total == 1


def test_a_guarded_call_refused_by_the_lock_releases_its_key(
    make_proxy: ProxyFactory, tool: CountingTool
) -> None:
    proxy = make_proxy(locked(tool.url, guarded=True, wait="100ms"))
    url = proxy.url + "/tools/debit"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        holder = {"idempotency-key": new_key({"account": "A", "amount": 5})}
        held = pool.submit(debit, proxy.url, "A", "?delay=0.5", holder)
        wait_for(lambda: tool.in_flight == 1, what="the holder at the tool")
        body = {"account": "A", "n": 2}
        sent = {"idempotency-key": new_key(body), "content-type": "application/json"}
        assert_locked(httpx.post(url, content=json.dumps(body), headers=sent))
        assert held.result().status_code == 200
    again = httpx.post(url, content=json.dumps(body), headers=sent)
    assert again.status_code == 200 and "idempotent-replayed" not in again.headers


# -- versioned writes -------------------------------------------------------------------------


def put(base: str, resource: str = "s1", **headers: str) -> httpx.Response:
    sent = {k.replace("_", "-"): v for k, v in headers.items()}
    query = sent.pop("query", "")
    return httpx.put(f"{base}/tools/{resource}{query}", content=b"{}", headers=sent, timeout=10)


def test_reads_carry_the_version_and_writes_must_name_the_current_one(
    make_proxy: ProxyFactory, tool: CountingTool
) -> None:
    proxy = make_proxy(versioned(tool.url))
    assert httpx.get(proxy.url + "/tools/s1").headers["etag"] == '"1"'  # from the route's counter
    first = put(proxy.url, if_none_match="*")
    assert first.status_code == 200 and first.headers["etag"] == '"2"'
    again = put(proxy.url, if_none_match="*")
    assert again.status_code == 412, again.text
    assert again.json()["type"] == "urn:tool-proxy:problem:precondition-failed"
    assert again.headers["etag"] == '"2"'
    assert put(proxy.url, if_match='"2"').headers["etag"] == '"3"'
    stale = put(proxy.url, if_match='"2"')
    assert stale.status_code == 412 and stale.headers["etag"] == '"3"'
    assert put(proxy.url, if_match='W/"3"').status_code == 412  # weak tags never match
    assert put(proxy.url, if_match='"7", "3"').status_code == 200
    assert httpx.get(proxy.url + "/tools/s1").headers["etag"] == '"4"'
    assert httpx.get(proxy.url + "/tools/s2").headers["etag"] == '"5"'  # fresh, never reused
    listing = httpx.get(proxy.url + "/tools")
    assert listing.status_code == 200 and "etag" not in listing.headers
    assert httpx.put(proxy.url + "/tools", content=b"{}").status_code == 400
    assert put(proxy.url).headers["etag"] == '"6"'  # not required: counted all the same
    writes = [r for r in tool.requests if r["method"] == "PUT"]
    assert len(writes) == 4


def test_a_refused_write_keeps_the_version_a_failed_one_moves_it(
    make_proxy: ProxyFactory, tool: CountingTool
) -> None:
    """A 4xx refusal wrote nothing; a 5xx may have written part: the version moves on, so
    a writer that read the old one gets 412, never a lost update."""
    proxy = make_proxy(versioned(tool.url))
    refused = put(proxy.url, if_match="*", query="?status=500")
    assert refused.status_code == 412  # never written: * does not match
    assert refused.headers["etag"] == '"1"'
    kept = put(proxy.url, if_none_match="*", query="?status=409")
    assert kept.status_code == 409 and kept.headers["etag"] == '"1"'
    failed = put(proxy.url, if_none_match="*", query="?status=500")
    assert failed.status_code == 500 and failed.headers["etag"] == '"2"'
    assert put(proxy.url, if_none_match="*").status_code == 412  # it may have been written


def test_a_write_without_a_precondition_is_428_when_required(
    make_proxy: ProxyFactory, tool: CountingTool
) -> None:
    proxy = make_proxy(versioned(tool.url, required=True))
    answer = put(proxy.url)
    assert answer.status_code == 428, answer.text
    assert answer.json()["type"] == "urn:tool-proxy:problem:precondition-required"
    assert httpx.get(proxy.url + "/tools/s1").status_code == 200  # reads need none
    assert tool.total == 1


@pytest.mark.parametrize("required", [False, True])
@pytest.mark.parametrize("field", ["if-match", "if-none-match"])
@pytest.mark.parametrize(
    "value",
    ["", '"2', '2"', "2", '"2" "3"', '*, "2"', 'w/"2"', '"2 3"', ","],
)
def test_a_precondition_present_but_empty_or_malformed_is_a_400_and_nothing_is_sent(
    make_proxy: ProxyFactory, tool: CountingTool, required: bool, field: str, value: str
) -> None:
    """Never read as no precondition (an unconditional write), nor cut to a tag: an
    unterminated ``"2`` once matched the ETag ``"2"``."""
    proxy = make_proxy(versioned(tool.url, required=required))
    assert put(proxy.url, if_none_match="*").headers["etag"] == '"2"'
    answer = put(proxy.url, **{field.replace("-", "_"): value})
    assert answer.status_code == 400, answer.text
    assert answer.json()["type"] == "urn:tool-proxy:problem:invalid-header"
    assert field in answer.json()["detail"]
    assert tool.total == 1
    assert put(proxy.url, if_match='"2"').headers["etag"] == '"3"'  # the version unmoved


def test_a_precondition_of_only_whitespace_is_a_400(
    make_proxy: ProxyFactory, tool: CountingTool
) -> None:
    """Sent as it is (an HTTP client refuses such a value; a caller's own code may not)."""
    proxy = make_proxy(versioned(tool.url, required=True))
    host, port = proxy.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"PUT /tools/s1 HTTP/1.1\r\nHost: " + host.encode() + b"\r\n"
            b"If-Match: \t  \r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"
        )
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 400 "), answer
    assert b"invalid-header" in answer and b"if-match is empty" in answer
    assert tool.total == 0


def test_entity_tags_are_read_whole_as_rfc_9110_writes_them(
    make_proxy: ProxyFactory, tool: CountingTool
) -> None:
    proxy = make_proxy(versioned(tool.url))
    assert put(proxy.url, if_none_match="*").headers["etag"] == '"2"'
    assert put(proxy.url, if_match='"*"').status_code == 412  # a tag, not the wildcard
    assert put(proxy.url, if_match='"2,3"').status_code == 412  # one tag, commas and all
    assert put(proxy.url, if_none_match='W/"2"').status_code == 412  # compared weakly
    assert put(proxy.url, if_match=', "9",, "2" ,').headers["etag"] == '"3"'
    assert put(proxy.url, if_none_match='"7", W/"8"').headers["etag"] == '"4"'


def test_concurrent_writes_with_the_same_if_match_reach_the_tool_once(
    make_proxy: ProxyFactory, tool: CountingTool
) -> None:
    proxy = make_proxy(versioned(tool.url))
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        answers = list(
            pool.map(lambda _: put(proxy.url, if_none_match="*", query="?delay=0.1"), range(5))
        )
    assert sorted(a.status_code for a in answers) == [200, 412, 412, 412, 412]
    assert tool.total == 1


def test_a_write_whose_bump_failed_makes_the_next_one_with_its_if_match_fail(
    make_proxy: ProxyFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store dies between the send and the bump (the tool's handler kills it; its
    append-only file keeps what it had): the write happened, the version did not move.
    Once the store is back and the reservation has lapsed, a second writer with the same
    If-Match is refused with a new ETag, never forwarded (a lost update)."""
    monkeypatch.setattr(versioning, "RESERVATION_TTL_SECONDS", 0.5)  # lapses fast
    redis = RedisServer(aof_dir=tmp_path).start()
    writes: list[str] = []

    async def handler(request: Request) -> Response:
        if request.method == "PUT":
            writes.append(request.headers["if-match"])
            if len(writes) == 1:
                redis.kill()  # sent, not bumped
        return Response(b"{}", media_type="application/json")

    tool = ThreadServer(Starlette(routes=[Route("/{p:path}", handler, methods=["GET", "PUT"])]))
    tool.start()
    try:
        proxy = make_proxy(versioned(tool.url), store=redis.url)
        read = httpx.get(proxy.url + "/tools/s1").headers["etag"]
        first = put(proxy.url, if_match=read)
        assert first.status_code == 200 and "etag" not in first.headers  # no version known
        redis.start()
        second = put(proxy.url, if_match=read)
        assert second.status_code == 412, second.text
        assert second.headers["etag"] != read
        assert writes == [read]
        third = put(proxy.url, if_match=second.headers["etag"])  # read again: it goes
        assert third.status_code == 200 and writes[-1] == second.headers["etag"]
    finally:
        tool.stop()
        redis.stop()


# -- shared by replicas (real Redis, two proxy processes) -------------------------------------


@pytest.fixture
def two_proxies(
    request: pytest.FixtureRequest, tmp_path: Path, tool: CountingTool, redis_server: RedisServer
) -> Iterator[list[ProxyProcess]]:
    redis_server.flush()
    config = {"store": {"url": redis_server.url}, "routes": [request.param(tool.url)]}
    proxies = [ProxyProcess(config, tmp_path).start() for _ in range(2)]
    yield proxies
    for proxy in proxies:
        if proxy.process is not None:
            proxy.stop()


def _lock(url: str) -> Any:
    return locked(url)


def _short_wait(url: str) -> Any:
    return locked(url, wait="300ms")


@pytest.mark.parametrize("two_proxies", [_lock], indirect=True)
def test_twenty_calls_on_one_account_across_replicas_run_one_at_a_time(
    two_proxies: list[ProxyProcess], tool: CountingTool
) -> None:
    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        answers = list(
            pool.map(lambda n: debit(two_proxies[n % 2].url, query="?delay=0.02"), range(20))
        )
    assert [a.status_code for a in answers] == [200] * 20
    assert tool.most_in_flight == 1
    seen = tokens(tool)
    assert len(seen) == 20 and seen == sorted(set(seen))  # strictly increasing


@pytest.mark.parametrize("two_proxies", [_lock], indirect=True)
def test_a_killed_holder_frees_the_lock_after_its_ttl_and_the_next_token_is_larger(
    two_proxies: list[ProxyProcess], tool: CountingTool
) -> None:
    a, b = two_proxies
    assert debit(a.url, "B").status_code == 200  # processes: counters start at the clock
    base = int(tool.requests[-1]["headers"]["fencing-token"])
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(debit, a.url, "A", "?delay=5")
        wait_for(lambda: tool.in_flight == 1, what="the holder at the tool")
        time.sleep(0.5)  # past one renewal (ttl/3): the lock is renewed while it runs
        a.kill()
        killed = time.monotonic()
        with pytest.raises(httpx.HTTPError):
            held.result()
    answer = debit(b.url, "A")
    waited = time.monotonic() - killed
    assert answer.status_code == 200, answer.text
    assert 0.3 < waited < 2.0  # the ttl (1 s) after the holder's last renewal, not its 5 s
    assert int(tool.requests[-1]["headers"]["fencing-token"]) == base + 2  # the holder's + 1


def test_a_lock_is_renewed_while_its_call_runs_past_its_ttl(
    make_proxy: ProxyFactory, tool: CountingTool, redis_server: RedisServer
) -> None:
    redis_server.flush()
    a, b = (make_proxy(locked(tool.url, ttl="600ms", wait=0), store=redis_server.url) for _ in "ab")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(debit, a.url, "A", "?delay=1.5")
        wait_for(lambda: tool.in_flight == 1, what="the holder at the tool")
        time.sleep(1.0)  # past the first lease: only renewals keep it
        assert_locked(debit(b.url, "A"))
        assert held.result().status_code == 200
    assert debit(b.url, "A").status_code == 200
    assert tokens(tool) == [1, 2]


@pytest.mark.parametrize("two_proxies", [_short_wait], indirect=True)
def test_a_waiter_on_another_replica_past_wait_gets_409(
    two_proxies: list[ProxyProcess], tool: CountingTool
) -> None:
    a, b = two_proxies
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(debit, a.url, "A", "?delay=1")
        wait_for(lambda: tool.in_flight == 1, what="the holder at the tool")
        assert_locked(debit(b.url, "A"))
        assert debit(b.url, "B").status_code == 200  # another account is free
        assert held.result().status_code == 200
    assert tool.total == 2


@pytest.mark.parametrize("two_proxies", [versioned], indirect=True)
def test_two_agents_writing_version_1_across_replicas_one_wins_one_gets_412(
    two_proxies: list[ProxyProcess], tool: CountingTool
) -> None:
    a, b = two_proxies  # processes: their counters start at the clock, in microseconds
    etag = put(a.url, if_none_match="*").headers["etag"]
    read = [httpx.get(p.url + "/tools/s1").headers["etag"] for p in (a, b)]
    assert read == [etag, etag]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda p: put(p.url, if_match=etag, query="?delay=0.3"), (a, b)))
    assert sorted(r.status_code for r in answers) == [200, 412]
    (after,) = {r.headers["etag"] for r in answers}
    assert int(after.strip('"')) == int(etag.strip('"')) + 1
    assert len([r for r in tool.requests if r["method"] == "PUT"]) == 2  # the first, one more


def test_an_answer_whose_body_broke_leaves_the_lock_to_lapse() -> None:
    """Released only when the answer was read to its end; if the exchange broke, the
    tool may still be at work, so the lock lapses after its ttl instead."""
    import asyncio

    from proxy.errors import OutcomeUnknown
    from proxy.forwarding import UpstreamResponse
    from proxy.policies.limits import Settled

    class Broken(UpstreamResponse):
        def __init__(self) -> None:
            super().__init__(200, [], None)

        async def read(self) -> bytes:
            raise OutcomeUnknown("the connection broke mid-body")

    ends: list[tuple[bytes | None, bool]] = []
    settled = Settled(Broken(), lambda body, whole: ends.append((body, whole)))
    with pytest.raises(OutcomeUnknown):
        asyncio.run(settled.read())
    assert ends == [(None, False)]


@pytest.mark.parametrize(
    ("status", "wrote"),
    [(200, True), (201, True), (500, True), (504, True), (409, False), (503, False)],
)
def test_a_version_moves_on_unless_the_tool_certainly_did_not_write(
    status: int, wrote: bool
) -> None:
    from proxy.policies.versioning import _may_have_written

    assert _may_have_written(status) is wrote
