"""End to end: a real upstream, tool-proxy on uvicorn, real stores."""

from __future__ import annotations

import gc
import json
import socket
import time
import uuid

import httpx
import pytest

from proxy import app
from tests.conftest import ProxyFactory, new_key, route
from tests.servers import BreakingTool, CountingTool, free_port, wait_for

BODY = {"account": "acme", "amount": 42}


def post(url: str, body: object = BODY, key: str | None = None) -> httpx.Response:
    headers = {"Idempotency-Key": key} if key else {}
    return httpx.post(url, json=body, headers=headers, timeout=30)


def problem_type(response: httpx.Response) -> str:
    assert response.headers["content-type"] == "application/problem+json"
    document = response.json()
    assert document["status"] == response.status_code
    assert document["title"] and document["detail"]
    return str(document["type"]).rsplit(":", 1)[-1]


def test_first_call_executes_and_retry_replays(
    tool: CountingTool, make_proxy: ProxyFactory, store_url: str
) -> None:
    proxy = make_proxy(route(tool.url), store=store_url)
    key = new_key(BODY)
    first = post(f"{proxy.url}/tools/charge", key=key)
    second = post(f"{proxy.url}/tools/charge", key=key)
    assert first.status_code == second.status_code == 200
    assert "idempotent-replayed" not in first.headers
    assert second.headers["idempotent-replayed"] == "true"
    assert second.content == first.content
    assert second.headers["x-tool"] == "counting"
    assert tool.count(key) == 1


def test_key_order_and_whitespace_do_not_matter(
    tool: CountingTool, make_proxy: ProxyFactory
) -> None:
    proxy = make_proxy(route(tool.url))
    key = new_key({"b": 2, "a": [1, 2]})
    spaced = b'{ "a" : [1, 2],\n "b": 2 }'
    response = httpx.post(
        f"{proxy.url}/tools/x",
        content=spaced,
        headers={"Idempotency-Key": key, "Content-Type": "application/json"},
    )
    assert response.status_code == 200
    replay = post(f"{proxy.url}/tools/x", {"a": [1, 2], "b": 2}, key)
    assert replay.headers["idempotent-replayed"] == "true"
    assert tool.count(key) == 1


def test_duplicate_in_flight_gets_409_with_retry_after(
    tool: CountingTool, make_proxy: ProxyFactory, store_url: str
) -> None:
    proxy = make_proxy(route(tool.url, retry_after="3s"), store=store_url)
    key = new_key(BODY)
    with httpx.Client(timeout=30) as client:
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            first = pool.submit(
                client.post,
                f"{proxy.url}/tools/slow?delay=1",
                json=BODY,
                headers={"Idempotency-Key": key},
            )
            wait_for(lambda: tool.arrived[key] == 1, what="the first call at the tool")
            duplicate = client.post(
                f"{proxy.url}/tools/slow?delay=1", json=BODY, headers={"Idempotency-Key": key}
            )
            assert duplicate.status_code == 409
            assert problem_type(duplicate) == "request-in-progress"
            assert duplicate.headers["retry-after"] == "3"
            assert first.result().status_code == 200
    assert tool.count(key) == 1
    assert tool.arrived[key] == 1  # the duplicate never reached the tool


def test_a_duplicate_waiting_on_a_released_call_executes_it_itself(
    tool: CountingTool, make_proxy: ProxyFactory
) -> None:
    """The first call ends with a status in release_on_status (503): the key is free, so
    the duplicate held by conflict_wait claims it and executes (no 409, no replay)."""
    import concurrent.futures

    proxy = make_proxy(route(tool.url, conflict_wait="5s"))
    key = new_key(BODY)
    url = f"{proxy.url}/tools/slow?delay=1&status=503"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(post, url, BODY, key)
        wait_for(lambda: tool.arrived[key] == 1, what="the first call at the tool")
        assert not first.done()  # the duplicate comes while the first runs (1 s)
        duplicate = pool.submit(post, url, BODY, key)
        first_response, second = first.result(), duplicate.result()
    assert first_response.status_code == second.status_code == 503
    assert "idempotent-replayed" not in second.headers
    assert (first_response.json()["execution"], second.json()["execution"]) == (1, 2)
    assert tool.count(key) == 2


def test_conflict_wait_turns_a_duplicate_into_a_replay(
    tool: CountingTool, make_proxy: ProxyFactory
) -> None:
    proxy = make_proxy(route(tool.url, conflict_wait="5s"))
    key = new_key(BODY)
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(post, f"{proxy.url}/tools/slow?delay=0.8", BODY, key)
        time.sleep(0.3)
        duplicate = post(f"{proxy.url}/tools/slow?delay=0.8", BODY, key)
        assert first.result().status_code == 200
    assert duplicate.status_code == 200
    assert duplicate.headers["idempotent-replayed"] == "true"
    assert duplicate.content == first.result().content
    assert tool.count(key) == 1


def test_statuses_are_recorded_and_replayed(tool: CountingTool, make_proxy: ProxyFactory) -> None:
    proxy = make_proxy(route(tool.url))
    for status in (201, 302, 400, 404, 500):
        key = new_key(BODY, step=status)
        url = f"{proxy.url}/tools/x?status={status}"
        first = httpx.post(url, json=BODY, headers={"Idempotency-Key": key})
        again = httpx.post(url, json=BODY, headers={"Idempotency-Key": key})
        assert first.status_code == again.status_code == status
        assert again.headers["idempotent-replayed"] == "true"
        assert tool.count(key) == 1


def test_release_on_status_lets_the_retry_execute(
    tool: CountingTool, make_proxy: ProxyFactory
) -> None:
    proxy = make_proxy(route(tool.url))
    key = new_key(BODY)
    first = post(f"{proxy.url}/tools/x?status=503", key=key)
    second = post(f"{proxy.url}/tools/x?status=503", key=key)
    assert first.status_code == second.status_code == 503
    assert "idempotent-replayed" not in second.headers
    assert tool.count(key) == 2


@pytest.mark.parametrize("status", [502, 504])
def test_a_gateways_502_or_504_is_recorded_by_default_never_run_again(
    tool: CountingTool, make_proxy: ProxyFactory, status: int
) -> None:
    """Behind an ingress or a mesh a 502/504 can come after the tool ran the call: by
    default it is the call's outcome, replayed; releasing on it is opt-in."""
    proxy = make_proxy(route(tool.url))
    key = new_key(BODY)
    first = post(f"{proxy.url}/tools/x?status={status}", key=key)
    retry = post(f"{proxy.url}/tools/x?status={status}", key=key)
    assert first.status_code == retry.status_code == status
    assert retry.headers["idempotent-replayed"] == "true"
    assert tool.count(key) == 1
    opted = make_proxy(route(tool.url, name="opt", release_on_status=[status]))
    other = new_key(BODY, step=2)
    for _ in range(2):
        assert post(f"{opted.url}/tools/x?status={status}", key=other).status_code == status
    assert tool.count(other) == 2


def test_unreachable_upstream_releases_the_key(make_proxy: ProxyFactory) -> None:
    proxy = make_proxy(route(f"http://127.0.0.1:{free_port()}"))
    key = new_key(BODY)
    for _ in range(2):
        response = post(f"{proxy.url}/tools/x", key=key)
        assert response.status_code == 502
        assert problem_type(response) == "upstream-unreachable"
        assert "idempotent-replayed" not in response.headers


def test_timeout_records_failure_and_never_reexecutes(
    tool: CountingTool, make_proxy: ProxyFactory, store_url: str
) -> None:
    proxy = make_proxy(route(tool.url, timeout="0.4s"), store=store_url)
    key = new_key(BODY)
    first = post(f"{proxy.url}/tools/x?delay=1", key=key)
    assert first.status_code == 504
    assert problem_type(first) == "outcome-unknown"
    time.sleep(0.8)  # the tool finishes its (single) execution
    retry = post(f"{proxy.url}/tools/x?delay=1", key=key)
    assert retry.status_code == 504
    assert retry.headers["idempotent-replayed"] == "true"
    assert problem_type(retry) == "outcome-unknown"
    assert tool.count(key) == 1


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE"])
def test_broken_connection_records_failure(make_proxy: ProxyFactory, method: str) -> None:
    """The tool read the request and closed the connection: it may have executed it.

    aiohttp resends PUT and DELETE (idempotent in HTTP) once on a broken connection; a
    guarded call must never be resent, so the tool sees it exactly once.
    """
    breaking = BreakingTool()
    try:
        proxy = make_proxy(route(breaking.url, methods=[method]))
        key = new_key(BODY)
        url = f"{proxy.url}/tools/x"
        headers = {"Idempotency-Key": key}
        first = httpx.request(method, url, json=BODY, headers=headers, timeout=30)
        retry = httpx.request(method, url, json=BODY, headers=headers, timeout=30)
    finally:
        breaking.close()
    assert first.status_code == retry.status_code == 502
    assert problem_type(first) == "outcome-unknown"
    assert retry.headers["idempotent-replayed"] == "true"
    assert breaking.received == 1


def test_no_free_upstream_connection_in_time_releases_the_key(
    tool: CountingTool, make_proxy: ProxyFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Time ran out while waiting for a pooled connection: nothing was sent, so the key
    is released (502 upstream-unreachable) and the retry executes; not FAILED."""
    import concurrent.futures

    from proxy import forwarding

    monkeypatch.setattr(forwarding, "CONNECTIONS_PER_HOST", 1)
    slow = route(tool.url, name="slow", prefix="/slow", timeout="10s")
    proxy = make_proxy(slow, route(tool.url, timeout="1s"))
    key = new_key(BODY)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        holder = pool.submit(post, f"{proxy.url}/slow/x?delay=2", BODY, new_key(BODY))
        time.sleep(0.3)  # the slow call holds the only connection
        waiting = post(f"{proxy.url}/tools/x", key=key)
        assert holder.result().status_code == 200
    assert waiting.status_code == 502
    assert problem_type(waiting) == "upstream-unreachable"
    assert tool.count(key) == 0
    retry = post(f"{proxy.url}/tools/x", key=key)
    assert retry.status_code == 200
    assert "idempotent-replayed" not in retry.headers
    assert tool.count(key) == 1


def test_pass_through_put_is_resent_once_on_a_broken_connection(
    make_proxy: ProxyFactory,
) -> None:
    """Unguarded, the proxy behaves like nginx: an idempotent method is tried twice."""
    breaking = BreakingTool()
    try:
        proxy = make_proxy(route(breaking.url, guarded=False))
        response = httpx.put(f"{proxy.url}/tools/x", json=BODY, timeout=30)
        wait_for(lambda: breaking.received == 2, what="the second attempt")
    finally:
        breaking.close()
    assert response.status_code == 502
    assert problem_type(response) == "outcome-unknown"


def test_caller_disconnect_does_not_cancel_the_call(
    tool: CountingTool, make_proxy: ProxyFactory, store_url: str
) -> None:
    proxy = make_proxy(route(tool.url), store=store_url)
    key = new_key(BODY)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{proxy.url}/tools/x?delay=1", json=BODY, headers={"Idempotency-Key": key}, timeout=0.3
        )
    wait_for(lambda: tool.count(key) == 1, what="the upstream call to finish")
    time.sleep(0.2)
    retry = post(f"{proxy.url}/tools/x?delay=1", key=key)
    assert retry.status_code == 200
    assert retry.headers["idempotent-replayed"] == "true"
    assert retry.json()["execution"] == 1
    assert tool.count(key) == 1


def test_lease_is_renewed_while_the_upstream_works(
    tool: CountingTool, make_proxy: ProxyFactory
) -> None:
    proxy = make_proxy(route(tool.url, lock_ttl="0.5s"))
    key = new_key(BODY)
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(post, f"{proxy.url}/tools/x?delay=1.5", BODY, key)
        time.sleep(1.0)  # two lease lengths later: only renewal keeps the key locked
        duplicate = post(f"{proxy.url}/tools/x?delay=1.5", BODY, key)
        assert duplicate.status_code == 409
        assert first.result().status_code == 200
    assert tool.count(key) == 1


def test_replanned_step_executes_again(tool: CountingTool, make_proxy: ProxyFactory) -> None:
    proxy = make_proxy(route(tool.url))
    plan = f"plan-{uuid.uuid4().hex[:8]}"
    one = post(f"{proxy.url}/tools/x", {"n": 1}, new_key({"n": 1}, plan=plan))
    two = post(f"{proxy.url}/tools/x", {"n": 2}, new_key({"n": 2}, plan=plan))
    assert one.status_code == two.status_code == 200
    assert "idempotent-replayed" not in two.headers
    assert tool.total == 2


def test_records_are_scoped_by_route(tool: CountingTool, make_proxy: ProxyFactory) -> None:
    proxy = make_proxy(
        route(tool.url, name="a", prefix="/a"), route(tool.url, name="b", prefix="/b")
    )
    key = new_key(BODY)
    a = post(f"{proxy.url}/a/x", key=key)
    b = post(f"{proxy.url}/b/x", key=key)
    assert "idempotent-replayed" not in b.headers
    assert a.json()["path"] == "/a/x" and b.json()["path"] == "/b/x"


def test_opaque_keys_fingerprint_the_body(tool: CountingTool, make_proxy: ProxyFactory) -> None:
    proxy = make_proxy(route(tool.url, key="opaque"))
    key = f'"order-{uuid.uuid4().hex}"'
    first = post(f"{proxy.url}/tools/x", {"a": 1, "b": 2}, key)
    again = post(f"{proxy.url}/tools/x", {"b": 2, "a": 1}, key)
    other = post(f"{proxy.url}/tools/x", {"a": 1, "b": 3}, key)
    assert first.status_code == again.status_code == 200
    assert again.headers["idempotent-replayed"] == "true"
    assert other.status_code == 422
    assert problem_type(other) == "idempotency-key-reused"
    assert tool.total == 1


@pytest.mark.parametrize("kind", ["composite", "opaque"])
def test_a_key_sent_with_another_method_path_or_query_is_refused(
    tool: CountingTool, make_proxy: ProxyFactory, kind: str
) -> None:
    """Same key, same body, another request: 422, never the first request's answer."""
    proxy = make_proxy(route(tool.url, key=kind, methods=["POST", "PUT"]))
    key = new_key(BODY) if kind == "composite" else f"order-{uuid.uuid4().hex}"
    headers = {"Idempotency-Key": key}
    first = httpx.post(f"{proxy.url}/tools/refund?account=alice", json=BODY, headers=headers)
    same = httpx.post(f"{proxy.url}/tools/refund?account=alice", json=BODY, headers=headers)
    others = [
        httpx.post(f"{proxy.url}/tools/delete-repo?account=alice", json=BODY, headers=headers),
        httpx.post(f"{proxy.url}/tools/refund?account=bob", json=BODY, headers=headers),
        httpx.post(f"{proxy.url}/tools/refund", json=BODY, headers=headers),
        httpx.put(f"{proxy.url}/tools/refund?account=alice", json=BODY, headers=headers),
    ]
    assert first.status_code == same.status_code == 200
    assert same.headers["idempotent-replayed"] == "true"
    assert [r.status_code for r in others] == [422] * 4
    assert {problem_type(r) for r in others} == {"idempotency-key-reused"}
    assert tool.total == 1


@pytest.mark.parametrize(
    ("key", "status", "kind"),
    [
        (None, 400, "idempotency-key-missing"),
        ("not-a-key", 400, "idempotency-key-invalid"),
        ("p:1:" + "0" * 63, 400, "idempotency-key-invalid"),
        ("p" * 129 + ":1:" + "0" * 64, 400, "idempotency-key-invalid"),
        ("p:1:" + "0" * 64, 422, "args-hash-mismatch"),
    ],
)
def test_bad_keys_are_refused(
    tool: CountingTool, make_proxy: ProxyFactory, key: str | None, status: int, kind: str
) -> None:
    proxy = make_proxy(route(tool.url))
    response = post(f"{proxy.url}/tools/x", key=key)
    assert response.status_code == status
    assert problem_type(response) == kind
    assert tool.total == 0


def test_json_content_type_with_invalid_body_is_400(
    tool: CountingTool, make_proxy: ProxyFactory
) -> None:
    proxy = make_proxy(route(tool.url))
    response = httpx.post(
        f"{proxy.url}/tools/x",
        content=b"{nope",
        headers={"Idempotency-Key": new_key(BODY), "Content-Type": "application/json"},
    )
    assert response.status_code == 400
    assert problem_type(response) == "invalid-json-body"


def test_raw_and_empty_bodies_are_hashed_as_bytes(
    tool: CountingTool, make_proxy: ProxyFactory
) -> None:
    import hashlib

    proxy = make_proxy(route(tool.url))
    raw = b"plain text, not json"
    key = f"p-{uuid.uuid4().hex[:6]}:1:{hashlib.sha256(raw).hexdigest()}"
    text = httpx.post(
        f"{proxy.url}/tools/x",
        content=raw,
        headers={"Idempotency-Key": key, "Content-Type": "text/plain"},
    )
    empty_key = f"p-{uuid.uuid4().hex[:6]}:1:{hashlib.sha256(b'').hexdigest()}"
    empty = httpx.post(f"{proxy.url}/tools/x", headers={"Idempotency-Key": empty_key})
    assert text.status_code == empty.status_code == 200
    assert tool.total == 2


def test_optional_key_passes_unguarded(tool: CountingTool, make_proxy: ProxyFactory) -> None:
    proxy = make_proxy(route(tool.url, required=False))
    for _ in range(2):
        assert post(f"{proxy.url}/tools/x").status_code == 200
    assert tool.total == 2


def test_unguarded_methods_pass_through(tool: CountingTool, make_proxy: ProxyFactory) -> None:
    proxy = make_proxy(route(tool.url, methods=["POST"]))
    assert httpx.put(f"{proxy.url}/tools/x", json=BODY).status_code == 200
    assert httpx.get(f"{proxy.url}/tools/x").status_code == 200
    assert tool.total == 2


def test_body_over_the_limit_is_413_and_not_forwarded(
    tool: CountingTool, make_proxy: ProxyFactory
) -> None:
    proxy = make_proxy(
        route(tool.url),
        route(tool.url, name="plain", prefix="/plain", guarded=False),
        limits={"max_body_bytes": 1000},
    )
    big = {"blob": "x" * 2000}
    guarded = post(f"{proxy.url}/tools/x", big, new_key(big))
    plain = httpx.post(f"{proxy.url}/plain/x", content=b"y" * 100_000)

    def chunks() -> object:
        yield b"z" * 800
        yield b"z" * 800

    streamed = httpx.post(f"{proxy.url}/plain/x", content=chunks())  # type: ignore[arg-type]
    for response in (guarded, plain, streamed):
        assert response.status_code == 413
        assert problem_type(response) == "request-too-large"
    assert tool.total == 0


def test_unknown_path_is_404(tool: CountingTool, make_proxy: ProxyFactory) -> None:
    proxy = make_proxy(route(tool.url))
    response = httpx.get(f"{proxy.url}/elsewhere")
    assert response.status_code == 404
    assert problem_type(response) == "route-not-found"


def raw_request(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
        return data


@pytest.mark.parametrize(
    "target",
    [
        b"/tools/../admin",
        b"/tools/%2e%2e/admin",
        b"/tools/a%2Fb",
        b"/tools/a%5cb",
        b"http://evil.example/tools/x",
        b"/tools/./x",
    ],
)
def test_targets_that_could_escape_are_400(
    tool: CountingTool, make_proxy: ProxyFactory, target: bytes
) -> None:
    proxy = make_proxy(route(tool.url, guarded=False))
    head = raw_request(proxy.port, b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), head
    assert b"invalid-path" in head or b"application/problem+json" in head
    assert tool.total == 0


def test_forwarding_is_transparent(tool: CountingTool, make_proxy: ProxyFactory) -> None:
    proxy = make_proxy(route(tool.url, guarded=False, prefix="/svc", strip_prefix=True))
    response = httpx.post(
        f"{proxy.url}/svc/deep/path?q=1&r=a%20b",
        content=b"payload",
        headers={
            "Connection": "keep-alive, X-Hop",
            "X-Hop": "drop me",
            "Keep-Alive": "5",
            "X-End": "keep me",
            "Idempotency-Key": "k1",
            "X-Forwarded-For": "10.0.0.1",
            "Authorization": "Bearer abc",
        },
    )
    assert response.status_code == 200
    seen = tool.requests[-1]
    assert seen["path"] == "/deep/path" and seen["query"] == "q=1&r=a%20b"
    assert seen["body"] == b"payload"
    headers = seen["headers"]
    assert "x-hop" not in headers and "keep-alive" not in headers
    assert headers["x-end"] == "keep me"
    assert headers["idempotency-key"] == "k1"
    assert headers["authorization"] == "Bearer abc"
    assert headers["x-forwarded-for"] == "10.0.0.1, 127.0.0.1"
    assert headers["x-forwarded-proto"] == "http"
    assert headers["x-forwarded-host"] == f"127.0.0.1:{proxy.port}"
    assert headers["host"] == tool.url.removeprefix("http://")


@pytest.mark.parametrize("policies", [False, True])
def test_a_request_without_a_body_gets_no_content_length_added(
    tool: CountingTool, make_proxy: ProxyFactory, policies: bool
) -> None:
    """A GET or HEAD without a body reaches the tool as it was sent: no
    ``Content-Length: 0`` (RFC 9110 8.6: a request without content should not send one);
    an empty POST keeps its ``Content-Length: 0``. Through a plain route, and one whose
    policies read the body whole (a rate limit)."""
    spec = route(tool.url, guarded=False)
    if policies:
        spec["limits"] = [{"name": "all", "rate": "100/1m"}]
    proxy = make_proxy(spec)
    for method in ("GET", "HEAD"):
        assert httpx.request(method, f"{proxy.url}/tools/x").status_code == 200
        assert "content-length" not in tool.requests[-1]["headers"], method
        assert "transfer-encoding" not in tool.requests[-1]["headers"], method
    assert httpx.post(f"{proxy.url}/tools/x", content=b"").status_code == 200
    assert tool.requests[-1]["headers"]["content-length"] == "0"


def test_longest_prefix_wins(tool: CountingTool, make_proxy: ProxyFactory) -> None:
    proxy = make_proxy(
        route(tool.url, name="root", prefix="/", guarded=False),
        route(tool.url, name="deep", prefix="/tools/deep", guarded=True),
    )
    assert httpx.post(f"{proxy.url}/tools/other", json=BODY).status_code == 200
    assert httpx.post(f"{proxy.url}/tools/deep/x", json=BODY).status_code == 400  # key required
    assert httpx.post(f"{proxy.url}/tools/deeper", json=BODY).status_code == 200


def test_set_cookie_is_never_replayed(tool: CountingTool, make_proxy: ProxyFactory) -> None:
    proxy = make_proxy(route(tool.url))
    key = new_key(BODY)
    first = post(f"{proxy.url}/tools/x?cookie=1", key=key)
    replay = post(f"{proxy.url}/tools/x?cookie=1", key=key)
    assert "set-cookie" in first.headers
    assert "set-cookie" not in replay.headers
    assert replay.headers["content-length"] == str(len(first.content))


def test_large_responses_stream_through_and_replay(
    tool: CountingTool, make_proxy: ProxyFactory
) -> None:
    proxy = make_proxy(
        route(tool.url), route(tool.url, name="plain", prefix="/plain", guarded=False)
    )
    size = 3 * 1024 * 1024 + 17
    expected = (bytes(range(256)) * 256 * 49)[:size]
    plain = httpx.get(f"{proxy.url}/plain/big?size={size}")
    assert plain.content == expected
    key = new_key(BODY)
    first = post(f"{proxy.url}/tools/big?size={size}", key=key)
    replay = post(f"{proxy.url}/tools/big?size={size}", key=key)
    assert first.content == replay.content == expected
    assert replay.headers["idempotent-replayed"] == "true"


def test_health_and_readiness(make_proxy: ProxyFactory, tool: CountingTool, store_url: str) -> None:
    proxy = make_proxy(route(tool.url), store=store_url)
    assert httpx.get(f"{proxy.url}/_proxy/healthz").json() == {"status": "ok"}
    assert httpx.get(f"{proxy.url}/_proxy/readyz").status_code == 200
    post(f"{proxy.url}/tools/x", key=new_key(BODY))
    metrics = httpx.get(f"{proxy.url}/_proxy/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    assert 'tool_proxy_requests_total{outcome="executed",route="tool",status="200"} 1.0' in (
        metrics.text
    )


def test_the_proxy_namespace_is_never_forwarded(
    tool: CountingTool, make_proxy: ProxyFactory
) -> None:
    proxy = make_proxy(route(tool.url, name="root", prefix="/", guarded=False))
    other = httpx.get(f"{proxy.url}/_proxy/other")
    assert other.status_code == 404
    assert problem_type(other) == "not-found"
    bare = httpx.get(f"{proxy.url}/_proxy")
    assert bare.status_code == 404
    assert problem_type(bare) == "route-not-found"
    wrong_method = httpx.post(f"{proxy.url}/_proxy/healthz")
    assert wrong_method.status_code == 405
    assert problem_type(wrong_method) == "method-not-allowed"
    assert tool.total == 0


def test_problem_documents_are_json(tool: CountingTool, make_proxy: ProxyFactory) -> None:
    proxy = make_proxy(route(tool.url))
    response = httpx.post(f"{proxy.url}/tools/x", json=BODY)
    document = json.loads(response.content)
    assert set(document) == {"type", "title", "status", "detail"}


def test_a_started_proxy_collects_young_objects_less_often(
    tool: CountingTool, make_proxy: ProxyFactory
) -> None:
    """Once started (gc.freeze), the youngest generation's threshold is the proxy's own:
    some 30 calls in flight hold more than CPython's 700 young objects (benchmarks.md)."""
    before = gc.get_threshold()
    gc.set_threshold(700, *before[1:])
    try:
        make_proxy(route(tool.url))
        assert gc.get_threshold() == (app.YOUNG_COLLECTION_THRESHOLD, *before[1:])
    finally:
        gc.set_threshold(*before)
