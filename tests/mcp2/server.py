"""An MCP server of the official SDK 2.x (MCPServer over Streamable HTTP), run by
tests/test_mcp_2026.py with .venv-mcp2's Python (the test suite's own venv has mcp 1.x).

    server.py PORT json|sse

``charge`` counts its side effects per account, after a progress notification (which
makes an SSE-mode server answer with an SSE stream; without one it answers JSON);
``close`` asks the user to confirm (an elicitation: an ``InputRequiredResult`` at
2026-07-28) before it counts; ``hold`` waits until ``POST /open?account=...``, then
counts (``hold:<account>``); ``slow`` takes ``seconds`` (counted when it starts,
``running:<account>``, and when it ends, ``slow:<account>``); ``refund`` fails
(``isError``) after counting; ``balance`` is annotated read-only. The counts are at
``GET /executions``, read by the test directly (not through the proxy).
"""

from __future__ import annotations

import asyncio
import sys
from collections import Counter, defaultdict
from typing import Annotated

import uvicorn
from mcp.server.mcpserver import Context, Elicit, MCPServer, Resolve
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

executions: Counter[str] = Counter()
gates: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)
server = MCPServer("billing-2026", log_level="WARNING")


class Confirmation(BaseModel):
    """What ``close`` asks the user for."""

    sure: bool


async def confirm(account: str, ctx: Context) -> Elicit[Confirmation]:
    """The question ``close`` needs answered before it acts, after a progress
    notification (so that in SSE mode the ``InputRequiredResult`` comes over SSE too)."""
    await ctx.report_progress(0, 1, "asking")
    return Elicit(f"Close {account}?", Confirmation)


@server.tool()
async def charge(account: str, cents: int, ctx: Context) -> str:
    """Charge an account (a side effect, counted), reporting progress first."""
    await ctx.report_progress(1, 2, "charging")
    executions[account] += 1
    return f"charged {cents} to {account} (#{executions[account]})"


@server.tool()
def close(account: str, answer: Annotated[Confirmation, Resolve(confirm)]) -> str:
    """Close an account once the user confirms (counted when it acts)."""
    if not answer.sure:
        return f"kept {account}"
    executions[f"close:{account}"] += 1
    return f"closed {account} (#{executions[f'close:{account}']})"


@server.tool()
def refund(account: str) -> str:
    """Always fails (an ``isError`` result), after counting."""
    executions[f"refund:{account}"] += 1
    raise ToolError(f"refund #{executions[f'refund:{account}']} refused")


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def balance(account: str) -> str:
    """Read a balance (no side effect, but counted, to see each call that reached it)."""
    executions[f"balance:{account}"] += 1
    return f"{account}: {executions[account]} charges"


@server.tool()
async def hold(account: str) -> str:
    """Waits for its gate to open, then acts (counted)."""
    executions[f"running:{account}"] += 1
    await gates[account].wait()
    executions[f"hold:{account}"] += 1
    return f"held {account} (#{executions[f'hold:{account}']})"


@server.tool()
async def slow(account: str, seconds: float) -> str:
    """A slow tool without tasks support: counted as it starts and as it ends."""
    executions[f"running:{account}"] += 1
    await asyncio.sleep(seconds)
    executions[f"slow:{account}"] += 1
    return f"slow {account} (#{executions[f'slow:{account}']})"


@server.custom_route("/open", methods=["POST"])  # type: ignore[untyped-decorator]
async def open_gate(request: Request) -> Response:
    """Lets the ``hold`` calls of ``?account=`` go on."""
    gates[request.query_params["account"]].set()
    return Response(status_code=204)


@server.custom_route("/executions", methods=["GET"])  # type: ignore[untyped-decorator]
async def counts(request: Request) -> Response:
    """The side effects so far, per account (``close:<account>`` for closes)."""
    return JSONResponse(dict(executions))


if __name__ == "__main__":
    port, form = int(sys.argv[1]), sys.argv[2]
    app = server.streamable_http_app(json_response=form == "json")
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
