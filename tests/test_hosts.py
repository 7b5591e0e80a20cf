"""Host and Origin on the proxy's own listener (DNS rebinding): ``proxy/hosts.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from proxy.config import parse_config
from proxy.errors import ConfigError
from proxy.hosts import Listener
from tests.conftest import ProxyFactory, route
from tests.mcp_servers import McpTool, session
from tests.servers import CountingTool, ProxyProcess

LOOPBACK = {"host": "127.0.0.1"}
EVIL = "evil.example.com"


def get(proxy_url: str, path: str = "/tools/x", **headers: str) -> httpx.Response:
    return httpx.get(proxy_url + path, headers=headers, timeout=10)


def problem_type(answer: httpx.Response) -> str:
    assert answer.headers["content-type"] == "application/problem+json"
    return str(answer.json()["type"]).rsplit(":", 1)[-1]


def test_bound_to_loopback_a_foreign_host_is_misdirected(
    make_proxy: ProxyFactory, tool: CountingTool
) -> None:
    proxy = make_proxy(route(tool.url, guarded=False), server=LOOPBACK)
    refused = get(proxy.url, Host=EVIL)
    assert refused.status_code == 421
    assert problem_type(refused) == "misdirected-request"
    assert EVIL in refused.json()["detail"]
    assert get(proxy.url, Host=f"{EVIL}:{proxy.port}").status_code == 421
    assert tool.total == 0


@pytest.mark.parametrize(
    "host", ["localhost:{port}", "localhost", "LocalHost:{port}", "127.0.0.1", "[::1]:{port}"]
)
def test_bound_to_loopback_a_loopback_host_passes_with_or_without_a_port(
    make_proxy: ProxyFactory, tool: CountingTool, host: str
) -> None:
    proxy = make_proxy(route(tool.url, guarded=False), server=LOOPBACK)
    answer = get(proxy.url, Host=host.format(port=proxy.port))
    assert answer.status_code == 200
    assert answer.headers["x-tool"] == "counting"


def test_an_origin_not_allowed_is_forbidden_and_an_absent_one_passes(
    make_proxy: ProxyFactory, tool: CountingTool
) -> None:
    proxy = make_proxy(route(tool.url, guarded=False), server=LOOPBACK)
    refused = get(proxy.url, Origin=f"http://{EVIL}")
    assert refused.status_code == 403
    assert problem_type(refused) == "origin-not-allowed"
    assert get(proxy.url, Origin="null").status_code == 403
    assert get(proxy.url, Origin=f"http://localhost:{proxy.port}").status_code == 200
    assert get(proxy.url, Origin="https://127.0.0.1").status_code == 200
    assert get(proxy.url).status_code == 200
    two = [("Origin", "http://localhost"), ("Origin", f"http://{EVIL}")]
    repeated = httpx.get(proxy.url + "/tools/x", headers=two)
    assert (repeated.status_code, problem_type(repeated)) == (400, "invalid-header")
    assert tool.total == 3


def test_probes_answer_whatever_the_host_and_other_endpoints_are_checked(
    make_proxy: ProxyFactory, tool: CountingTool
) -> None:
    proxy = make_proxy(route(tool.url, guarded=False), server=LOOPBACK)
    assert get(proxy.url, "/_proxy/healthz", Host="10.1.2.3:8080").status_code == 200
    assert get(proxy.url, "/_proxy/readyz", Host="10.1.2.3:8080").status_code == 200
    metrics = get(proxy.url, "/_proxy/metrics", Host=EVIL)
    assert metrics.status_code == 421
    assert problem_type(metrics) == "misdirected-request"
    steps = get(proxy.url, "/_proxy/sessions/plan-1/steps", Origin=f"https://{EVIL}")
    assert steps.status_code == 403
    assert get(proxy.url, "/_proxy/metrics").status_code == 200


def test_bound_to_any_address_every_host_passes_unless_configured(
    make_proxy: ProxyFactory, tool: CountingTool
) -> None:
    open_proxy = make_proxy(route(tool.url, guarded=False))  # server.host 0.0.0.0
    assert get(open_proxy.url, Host=EVIL, Origin=f"http://{EVIL}").status_code == 200
    configured = {"host": "0.0.0.0", "allowed_hosts": ["tool-proxy.svc", "10.0.0.7:8080"]}
    proxy = make_proxy(route(tool.url, guarded=False), server=configured)
    assert get(proxy.url, Host="tool-proxy.svc:8080").status_code == 200
    assert get(proxy.url, Host="10.0.0.7:8080").status_code == 200
    assert get(proxy.url, Host="10.0.0.7:9999").status_code == 421
    assert get(proxy.url, Host=f"127.0.0.1:{proxy.port}").status_code == 421
    assert get(proxy.url, Host="tool-proxy.svc", Origin="https://tool-proxy.svc").status_code == 200
    assert get(proxy.url, Host="tool-proxy.svc", Origin=f"https://{EVIL}").status_code == 403


def test_allowed_origins_replace_those_of_the_allowed_hosts(
    make_proxy: ProxyFactory, tool: CountingTool
) -> None:
    server = {**LOOPBACK, "allowed_origins": ["https://app.example.com", "http://localhost:*"]}
    proxy = make_proxy(route(tool.url, guarded=False), server=server)
    assert get(proxy.url, Origin="https://app.example.com").status_code == 200
    assert get(proxy.url, Origin="https://app.example.com:8443").status_code == 403
    assert get(proxy.url, Origin="http://localhost:3000").status_code == 200
    assert get(proxy.url, Origin="http://127.0.0.1:3000").status_code == 403


def test_an_mcp_route_refuses_a_foreign_host_and_serves_the_sdk_client(
    make_proxy: ProxyFactory,
) -> None:
    tool = McpTool(json_response=True).start()
    try:
        mcp = {**route(tool.url, guarded=False, prefix="/mcp"), "protocol": "mcp"}
        proxy = make_proxy(mcp, server=LOOPBACK)
        hello = {"jsonrpc": "2.0", "id": 1, "method": "ping"}
        refused = httpx.post(
            proxy.url + "/mcp",
            json=hello,
            headers={"Host": EVIL, "Accept": "application/json, text/event-stream"},
        )
        assert refused.status_code == 421
        assert problem_type(refused) == "misdirected-request"

        async def listed() -> list[str]:
            async with session(f"http://localhost:{proxy.port}/mcp") as client:
                return [t.name for t in (await client.list_tools()).tools]

        assert "charge" in anyio.run(listed)
    finally:
        tool.stop()


def test_the_check_follows_the_address_serve_binds(tmp_path: Path, tool: CountingTool) -> None:
    """The file says 0.0.0.0; ``serve --host 127.0.0.1`` binds loopback: checked."""
    config = {
        "store": {"url": "memory://"},
        "server": {"host": "0.0.0.0"},
        "routes": [route(tool.url, guarded=False)],
    }
    proxy = ProxyProcess(config, tmp_path).start()
    try:
        assert get(proxy.url, Host=EVIL).status_code == 421
        assert get(proxy.url, Host=f"localhost:{proxy.port}").status_code == 200
    finally:
        proxy.stop()


@pytest.mark.parametrize(
    ("server", "problem"),
    [
        ({"allowed_hosts": []}, "server.allowed_hosts: at least one entry"),
        ({"allowed_hosts": ["http://x"]}, "server.allowed_hosts: not a host"),
        ({"allowed_hosts": ["a b"]}, "server.allowed_hosts: not a host"),
        ({"allowed_hosts": ["x:port"]}, "server.allowed_hosts: not a host"),
        ({"allowed_origins": ["example.com"]}, "server.allowed_origins: not an origin"),
        ({"allowed_origins": ["https://"]}, "server.allowed_origins: not an origin"),
    ],
)
def test_bad_entries_are_named(server: dict[str, Any], problem: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config({"server": server, "routes": [route("http://127.0.0.1:9")]}, env={})
    assert any(p.startswith(problem) for p in caught.value.problems), caught.value.problems


def test_nothing_is_checked_when_everything_passes() -> None:
    assert Listener.of("0.0.0.0", None, None) is None
    assert Listener.of("127.0.0.1", ("*",), None) is None
    assert Listener.of("::1", None, None) is not None
    assert Listener.of("127.0.0.2", None, None) is not None
