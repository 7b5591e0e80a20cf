"""Bad input, end to end: what the proxy refuses, against a real tool and real servers."""

from __future__ import annotations

import httpx
import pytest

from proxy.keys import composite_key
from tests.conftest import ProxyFactory, route
from tests.servers import CountingTool


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
