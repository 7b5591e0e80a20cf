"""tool_proxy_client.mcp: the SDK's ClientSession through a real proxy to a real FastMCP server."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from mcp.shared.exceptions import McpError
from tool_proxy_client import OutcomeUnknown, PlanSession, RequestInProgress, Waits
from tool_proxy_client.errors import ArgsHashMismatch, IdempotencyKeyMissing
from tool_proxy_client.mcp import call_tool, meta_for, problem_of_error

from tests.conftest import ProxyFactory
from tests.mcp_servers import McpTool, session
from tests.test_mcp import mcp_route


@pytest.fixture(scope="module")
def mcp_tool() -> Iterator[McpTool]:
    tool = McpTool(json_response=False).start()
    yield tool
    tool.stop()


def who() -> str:
    return f"acct-{uuid.uuid4().hex[:8]}"


def text(result: Any) -> str:
    return str(result.content[0].text)


def test_a_step_runs_once_and_a_new_session_gets_its_result(
    make_proxy: ProxyFactory, mcp_tool: McpTool
) -> None:
    proxy = make_proxy(mcp_route(mcp_tool.url))
    step, account = PlanSession.new().step(1), who()
    arguments = {"account": account, "cents": 250}

    async def scenario() -> list[str]:
        async with session(proxy.url + "/mcp") as client:
            first = await call_tool(client, step, "charge", arguments)
        async with session(proxy.url + "/mcp") as client:
            again = await call_tool(client, step, "charge", arguments)
            replanned = await call_tool(client, step, "charge", {**arguments, "cents": 1})
        return [text(first), text(again), text(replanned)]

    first, again, replanned = asyncio.run(scenario())
    assert first == again == f"charged 250 to {account} (#1)"
    assert replanned == f"charged 1 to {account} (#2)"
    assert meta_for(step, arguments) == {"idempotencyKey": step.key(arguments)}


def test_in_progress_is_waited_out_and_the_wait_is_bounded(
    make_proxy: ProxyFactory, mcp_tool: McpTool
) -> None:
    proxy = make_proxy(mcp_route(mcp_tool.url))
    step, account = PlanSession.new().step(1), who()
    arguments = {"account": account, "cents": 5, "hold": True}

    async def scenario() -> tuple[str, str, RequestInProgress]:
        async with session(proxy.url + "/mcp") as client, session(proxy.url + "/mcp") as other:
            with mcp_tool.holding():
                first = asyncio.ensure_future(call_tool(client, step, "charge", arguments))
                await asyncio.sleep(0.3)
                with pytest.raises(RequestInProgress) as busy:
                    await call_tool(other, step, "charge", arguments, waits=Waits(total=0.5))
                threading.Timer(1.0, mcp_tool.gate.set).start()
                waited = await call_tool(other, step, "charge", arguments)
            return text(await first), text(waited), busy.value

    first, waited, busy = asyncio.run(scenario())
    assert first == waited == f"charged 5 to {account} (#1)"
    assert busy.retry_after == 1.0 and busy.record is not None
    assert busy.record.key == step.key(arguments) and busy.record.target == "charge"
    assert mcp_tool.executions[account] == 1


def test_outcome_unknown_and_other_refusals_are_the_clients_exceptions(
    make_proxy: ProxyFactory, mcp_tool: McpTool
) -> None:
    proxy = make_proxy({**mcp_route(mcp_tool.url, required=True), "timeout": "300ms"})
    step, account = PlanSession.new().step(4), who()
    arguments = {"account": account, "cents": 9, "hold": True}

    async def scenario() -> tuple[OutcomeUnknown, ArgsHashMismatch]:
        async with session(proxy.url + "/mcp") as client:
            with mcp_tool.holding(), pytest.raises(OutcomeUnknown) as lost:
                await call_tool(client, step, "charge", arguments)
            with pytest.raises(ArgsHashMismatch) as mismatch:
                await call_tool(client, step, "charge", {"account": account}, key=step.key({}))
            with pytest.raises(IdempotencyKeyMissing):
                await client_without_key(client, account)
            return lost.value, mismatch.value

    lost, mismatch = asyncio.run(scenario())
    assert lost.record is not None and lost.record.args_hash == step.key(arguments)[-64:]
    assert "may have been executed" in lost.detail and mismatch.status == 422


async def client_without_key(client: Any, account: str) -> None:
    try:
        await client.call_tool("charge", {"account": account, "cents": 1})
    except McpError as exc:
        problem = problem_of_error(exc)
        assert problem is not None
        raise problem from exc
