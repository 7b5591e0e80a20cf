"""Bad input, end to end: what the proxy refuses, against a real tool and real servers."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from proxy.keys import composite_key
from tests.conftest import ProxyFactory, route
from tests.servers import CountingTool, ThreadServer, running


def problem_type(response: httpx.Response) -> str:
    assert response.headers["content-type"] == "application/problem+json"
    document = response.json()
    assert document["status"] == response.status_code
    return str(document["type"]).rsplit(":", 1)[-1]


def post_json(url: str, body: bytes, key: str) -> httpx.Response:
    headers = {"Idempotency-Key": key, "Content-Type": "application/json"}
    return httpx.post(url, content=body, headers=headers)


def test_a_deeply_nested_body_is_a_400_not_a_500(
    tool: CountingTool, make_proxy: ProxyFactory
) -> None:
    proxy = make_proxy(route(tool.url))
    attack = b"[" * 1000 + b"]" * 1000  # 2 KB; made the decoders recurse 1000 deep
    response = post_json(f"{proxy.url}/tools/x", attack, f"p:1:{'ab' * 32}")
    assert response.status_code == 400
    assert problem_type(response) == "invalid-json-body"
    assert tool.total == 0


def test_the_depth_limit_comes_from_the_configuration(
    tool: CountingTool, make_proxy: ProxyFactory
) -> None:
    proxy = make_proxy(route(tool.url), limits={"max_json_depth": 4})
    four, five = b"[[[[1]]]]", b"[[[[[1]]]]]"
    assert post_json(f"{proxy.url}/tools/x", four, composite_key("p", 1, four)).status_code == 200
    refused = post_json(f"{proxy.url}/tools/x", five, composite_key("p", 2, five))
    assert refused.status_code == 400
    assert "deeper than 4" in refused.json()["detail"]
    assert tool.total == 1


@pytest.mark.parametrize("key_kind", ["composite", "opaque"])
def test_a_body_that_repeats_a_member_name_is_refused(
    tool: CountingTool, make_proxy: ProxyFactory, key_kind: str
) -> None:
    proxy = make_proxy(route(tool.url, key=key_kind))
    body = b'{"amount":1,"amount":1000}'
    key = composite_key("p", 1, b'{"amount":1000}') if key_kind == "composite" else "order-1"
    response = post_json(f"{proxy.url}/tools/charge", body, key)
    assert response.status_code == 400
    assert problem_type(response) == "duplicate-json-member"
    assert tool.total == 0


def test_idempotency_key_sent_twice_is_refused(
    tool: CountingTool, make_proxy: ProxyFactory
) -> None:
    proxy = make_proxy(route(tool.url))
    key = composite_key("p", 1, b"{}")
    for keys in ([key, key], [key, composite_key("p", 2, b"{}")]):
        headers = [("Content-Type", "application/json"), *(("Idempotency-Key", k) for k in keys)]
        response = httpx.post(f"{proxy.url}/tools/x", content=b"{}", headers=headers)
        assert response.status_code == 400
        assert problem_type(response) == "idempotency-key-invalid"
    assert tool.total == 0


def test_content_type_twice_with_other_values_is_refused(
    tool: CountingTool, make_proxy: ProxyFactory
) -> None:
    proxy = make_proxy(route(tool.url))
    body = b'{"a":1}'
    key = composite_key("p", 1, body)
    types = [("Content-Type", "text/plain"), ("Content-Type", "application/json")]
    response = httpx.post(
        f"{proxy.url}/tools/x", content=body, headers=[*types, ("Idempotency-Key", key)]
    )
    assert response.status_code == 400
    assert problem_type(response) == "invalid-header"
    assert tool.total == 0
    same = [("Content-Type", "application/json")] * 2
    response = httpx.post(
        f"{proxy.url}/tools/x", content=body, headers=[*same, ("Idempotency-Key", key)]
    )
    assert response.status_code == 200


# Not UTF-8 (0xFF), UTF-8 (é and an emoji), and Latin-1 text that happens to be UTF-8.
RAW_VALUE = b"\xff\xfe"
UTF8_VALUES = ["é".encode(), "🔑 clé".encode(), b"\xc3\xbf"]


class EchoTool:
    """Records the raw header bytes it gets; answers with raw bytes in X-Raw."""

    def __init__(self) -> None:
        self.received: list[list[tuple[bytes, bytes]]] = []
        self.app = Starlette(routes=[Route("/{path:path}", self.handle, methods=["GET", "POST"])])

    async def handle(self, request: Request) -> Response:
        self.received.append(list(request.headers.raw))
        value = (RAW_VALUE + b" " + UTF8_VALUES[1]).decode("latin-1")  # sent as these bytes
        return Response(b"ok", headers={"X-Raw": value})


@pytest.fixture
def echo() -> Iterator[tuple[EchoTool, ThreadServer]]:
    tool = EchoTool()
    with running(ThreadServer(tool.app)) as server:
        yield tool, server


def test_request_header_bytes_reach_the_tool_unchanged_or_are_refused(
    echo: tuple[EchoTool, ThreadServer], make_proxy: ProxyFactory
) -> None:
    tool, server = echo
    proxy = make_proxy(route(server.url, guarded=False))
    for value in UTF8_VALUES:
        assert httpx.get(f"{proxy.url}/tools/x", headers={b"X-Value": value}).status_code == 200
        assert (b"x-value", value) in tool.received[-1]
    refused = httpx.get(f"{proxy.url}/tools/x", headers={b"X-Value": RAW_VALUE})
    assert refused.status_code == 400
    assert problem_type(refused) == "invalid-header"
    assert len(tool.received) == len(UTF8_VALUES)


def test_response_header_bytes_reach_the_caller_unchanged(
    echo: tuple[EchoTool, ThreadServer], make_proxy: ProxyFactory
) -> None:
    _, server = echo
    proxy = make_proxy(route(server.url))
    sent = RAW_VALUE + b" " + UTF8_VALUES[1]
    passed = httpx.get(f"{proxy.url}/tools/x")
    key = composite_key("p", 1, b"")
    first = httpx.post(f"{proxy.url}/tools/x", headers={"Idempotency-Key": key})
    replay = httpx.post(f"{proxy.url}/tools/x", headers={"Idempotency-Key": key})
    assert replay.headers["idempotent-replayed"] == "true"
    for response in (passed, first, replay):
        assert (b"x-raw", sent) in response.headers.raw
