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

from tests.conftest import ProxyFactory, route
from tests.mcp_servers import McpTool
from tests.servers import CountingTool
from tests.test_jobs import long_route
from tests.test_mcp import mcp_route

CLIENT = Path(__file__).parent.parent / "clients" / "typescript"


@pytest.fixture(scope="module")
def mcp_tool() -> Iterator[McpTool]:
    tool = McpTool(json_response=True).start()
    yield tool
    tool.stop()


def test_the_typescript_client_against_a_real_proxy(
    tool: CountingTool, make_proxy: ProxyFactory, mcp_tool: McpTool
) -> None:
    npm = shutil.which("npm")
    assert npm is not None, "npm is not installed (node 20+ is needed for clients/typescript)"
    assert (CLIENT / "node_modules").is_dir(), "run scripts/install (npm ci in clients/typescript)"
    short = {**route(tool.url, name="short", prefix="/short"), "timeout": "300ms"}
    long = {**long_route(tool.url), "name": "long", "path_prefix": "/long/"}
    one_worker = long_route(tool.url, workers={"concurrency": 1})
    long1 = {**one_worker, "name": "long1", "path_prefix": "/long1"}
    proxy = make_proxy(route(tool.url), short, long, long1, mcp_route(mcp_tool.url))
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
    sources = [p.stat().st_mtime for d in ("src", "test") for p in (CLIENT / d).glob("*.ts")]
    return not built or max(sources) > min(built)
