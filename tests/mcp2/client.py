"""The official MCP SDK 2.x client (``mcp.Client``), run by tests/test_mcp_2026.py with
.venv-mcp2's Python. It reads a plan as JSON on stdin and prints what happened as JSON:

    {"url": "...", "sessions": [[{"tool": "charge", "arguments": {...}, "key": "..."}]]}

Each session is a new ``Client`` (a new connection, ``mode="auto"``: it negotiates the
newest revision both sides speak); each call sends its key in
``params._meta.idempotencyKey`` and takes progress notifications (they come only over
SSE, to a first execution's caller). An elicitation is answered ``{"sure": true}`` and
counted. A call's ``timeout`` is its read timeout, in seconds; ``{"list": true}`` in
place of a call lists the tools. Printed: per session, the negotiated version, the
elicitations, each call's result and progress (or its error), or the tools listed.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any, cast

from mcp import Client, MCPError, types
from mcp.client.session import ClientRequestContext


async def run_session(url: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
    asked: list[str] = []

    async def elicit(
        context: ClientRequestContext, params: types.ElicitRequestParams
    ) -> types.ElicitResult:
        asked.append(params.message)
        return types.ElicitResult(action="accept", content={"sure": True})

    results: list[dict[str, Any]] = []
    async with Client(url, elicitation_callback=elicit) as client:
        for call in calls:
            results.append(await run_call(client, call))
        return {"protocol_version": client.protocol_version, "asked": asked, "results": results}


async def run_call(client: Client, call: dict[str, Any]) -> dict[str, Any]:
    if call.get("list"):
        listed = await client.list_tools()
        return {"tools": [tool.name for tool in listed.tools]}
    meta: types.RequestParamsMeta | None = None
    if "key" in call:
        # An open TypedDict (PEP 728 extra_items), which mypy does not read yet.
        meta = cast(types.RequestParamsMeta, {"idempotencyKey": call["key"]})
    seen: list[float] = []

    async def report(progress: float, total: float | None, message: str | None) -> None:
        seen.append(progress)

    try:
        result = await client.call_tool(
            call["tool"],
            call["arguments"],
            read_timeout_seconds=call.get("timeout"),
            progress_callback=report,
            meta=meta,
        )
    except MCPError as exc:
        return {"error": {"code": exc.code, "message": str(exc)}}
    answer = result.model_dump(mode="json", by_alias=True, exclude_none=True)
    return {"result": answer, "progress": seen}


async def main() -> None:
    plan = json.load(sys.stdin)
    sessions = [await run_session(plan["url"], calls) for calls in plan["sessions"]]
    json.dump(sessions, sys.stdout)


if __name__ == "__main__":
    asyncio.run(main())
