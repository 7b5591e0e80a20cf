"""The examples run against the demo tool behind a real proxy."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from examples import agent_loop
from proxy.demo.tool import create_tool_app
from tests.conftest import ProxyFactory, route
from tests.servers import ThreadServer


@pytest.fixture
def demo_tool() -> Iterator[ThreadServer]:
    server = ThreadServer(create_tool_app()).start()
    yield server
    server.stop()


def test_the_python_agent_loop(make_proxy: ProxyFactory, demo_tool: ThreadServer) -> None:
    charge = route(demo_tool.url, prefix="/tools/charge", lock_ttl="10s")
    long = {
        **route(demo_tool.url, name="long", prefix="/long", strip_prefix=True, lock_ttl="10s"),
        "async": {"visibility": "2s"},
    }
    proxy = make_proxy(charge, long)
    lines = agent_loop.main(proxy.url, "/long")
    assert lines == [
        "attempt 1, step 1: timed out (the charge goes on)",
        "attempt 2, step 1: 201, replayed=True (409 waited out)",
        "attempt 3, step 1: 201, replayed=True",
        "step 2 (long call): 201, its operation ended completed",
        "the tool ran 2 charges",
    ]
