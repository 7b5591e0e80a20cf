"""The TypeScript client's tests (clients/typescript, `npm test`: tsc, then `node --test`)
against a real tool-proxy: the routes its tests call, in front of a CountingTool and a
FastMCP server. scripts/install runs `npm ci` there; scripts/check builds it (`tsc`, the
type check): built JavaScript that is older than its sources is built again here."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.demo.tool import create_tool_app
from tests.conftest import ProxyFactory, route
from tests.mcp_servers import McpTool
from tests.servers import CountingTool, ThreadServer
from tests.test_jobs import long_route
from tests.test_mcp import mcp_route

CLIENT = Path(__file__).parent.parent / "clients" / "typescript"


@pytest.fixture(scope="module")
def mcp_tool() -> Iterator[McpTool]:
    tool = McpTool(json_response=True).start()
    yield tool
    tool.stop()


@pytest.fixture
def demo_tool() -> Iterator[ThreadServer]:
    server = ThreadServer(create_tool_app()).start()
    yield server
    server.stop()


def test_the_typescript_client_against_a_real_proxy(
    tool: CountingTool, make_proxy: ProxyFactory, mcp_tool: McpTool, demo_tool: ThreadServer
) -> None:
    npm = shutil.which("npm")
    assert npm is not None, "npm is not installed (node 20+ is needed for clients/typescript)"
    assert (CLIENT / "node_modules").is_dir(), "run scripts/install (npm ci in clients/typescript)"
    short = {**route(tool.url, name="short", prefix="/short"), "timeout": "300ms"}
    long = {**long_route(tool.url), "name": "long", "path_prefix": "/long/"}
    one_worker = long_route(tool.url, workers={"concurrency": 1})
    long1 = {**one_worker, "name": "long1", "path_prefix": "/long1"}
    demo = route(demo_tool.url, name="demo", prefix="/demo", strip_prefix=True, lock_ttl="10s")
    demo_long = {
        **demo,
        "name": "demolong",
        "path_prefix": "/demolong",
        "async": {"visibility": "2s"},
    }
    routes = [route(tool.url), short, long, long1, mcp_route(mcp_tool.url), demo, demo_long]
    proxy = make_proxy(*routes)
    if _stale():
        subprocess.run([npm, "run", "build", "--silent"], cwd=CLIENT, check=True, timeout=120)
    done = subprocess.run(
        ["node", "--test", "dist/test/"],
        cwd=CLIENT,
        env={**os.environ, "TOOL_PROXY_URL": proxy.url},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert "# fail 0" in done.stdout


def _stale() -> bool:
    """True if dist/ is missing or older than a TypeScript source."""
    built = [path.stat().st_mtime for path in (CLIENT / "dist").rglob("*.js")]
    folders = ("src", "test", "examples")
    sources = [p.stat().st_mtime for d in folders for p in (CLIENT / d).glob("*.ts")]
    return not built or max(sources) > min(built)
