"""tool_proxy_client's framework integrations, with the real framework packages (the
``integrations`` extra), through a real proxy to a real FastMCP server."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator

import pytest
from agents import RunContextWrapper, function_tool
from agents.mcp import MCPServerStreamableHttp, MCPUtil
from agents.tool_context import ToolContext
from langchain_mcp_adapters.client import MultiServerMCPClient
from tool_proxy_client import AsyncToolProxy, PlanSession, StepCounter
from tool_proxy_client.errors import IdempotencyKeyReused
from tool_proxy_client.langchain import key_interceptor
from tool_proxy_client.openai_agents import tool_meta_resolver

from tests.conftest import ProxyFactory, route
from tests.mcp_servers import McpTool
from tests.servers import CountingTool
from tests.test_mcp import mcp_route


@pytest.fixture(scope="module")
def mcp_tool() -> Iterator[McpTool]:
    tool = McpTool(json_response=False).start()
    yield tool
    tool.stop()


def who() -> str:
    return f"acct-{uuid.uuid4().hex[:8]}"


@pytest.mark.filterwarnings(  # the SDK 0.24 calls mcp 1.x's streamablehttp_client
    "ignore:Use `streamable_http_client` instead:DeprecationWarning"
)
def test_openai_agents_mcp_calls_carry_the_steps_keys(
    make_proxy: ProxyFactory, mcp_tool: McpTool
) -> None:
    proxy = make_proxy(mcp_route(mcp_tool.url, required=True))
    plan, account = PlanSession.new(), who()

    async def run() -> list[str]:
        """One run of a scripted plan: two charges, through the SDK's MCP server."""
        steps = plan.counter()
        server = MCPServerStreamableHttp(
            {"url": proxy.url + "/mcp"}, tool_meta_resolver=tool_meta_resolver(steps)
        )
        async with server:
            charge = next(t for t in await server.list_tools() if t.name == "charge")
            context = RunContextWrapper(context=None)
            return [
                str(
                    await MCPUtil.invoke_mcp_tool(
                        server, charge, context, json.dumps({"account": account, "cents": cents})
                    )
                )
                for cents in (100, 200)
            ]

    first = asyncio.run(run())
    again = asyncio.run(run())  # the run made again from its start: the same keys
    assert again == first
    assert mcp_tool.executions[account] == 2
    assert "(#1)" in first[0] and "(#2)" in first[1]


def test_langchain_mcp_adapters_interceptor_sends_the_key(
    make_proxy: ProxyFactory, mcp_tool: McpTool
) -> None:
    proxy = make_proxy(mcp_route(mcp_tool.url, required=True))
    plan, account = PlanSession.new(), who()

    async def run(*cents: int) -> list[str]:
        client = MultiServerMCPClient(
            {"billing": {"url": proxy.url + "/mcp", "transport": "streamable_http"}},
            tool_interceptors=[key_interceptor(plan.counter())],
        )
        charge = next(t for t in await client.get_tools() if t.name == "charge")
        results = [await charge.ainvoke({"account": account, "cents": c}) for c in cents]
        return [str(result[0]["text"]) for result in results]  # content blocks (with new ids)

    first = asyncio.run(run(100, 200))
    again = asyncio.run(run(100, 200))
    assert again == first == [f"charged 100 to {account} (#1)", f"charged 200 to {account} (#2)"]
    assert mcp_tool.executions[account] == 2
    with pytest.raises(IdempotencyKeyReused):  # one step's key for two tools
        asyncio.run(_two_tools_one_step(proxy.url, plan, account))


async def _two_tools_one_step(url: str, plan: PlanSession, account: str) -> None:
    client = MultiServerMCPClient(
        {"billing": {"url": url + "/mcp", "transport": "streamable_http"}},
        tool_interceptors=[key_interceptor(lambda request: plan.step("x"))],
    )
    tools = {t.name: t for t in await client.get_tools()}
    await tools["balance"].ainvoke({"account": account})
    await tools["refund"].ainvoke({"account": account})


def test_openai_agents_function_tools_call_http_tools_with_the_runs_steps(
    tool: CountingTool, make_proxy: ProxyFactory
) -> None:
    """The step comes from the run context the orchestrator passes, never from the
    model's tool_call_id (new on every attempt)."""
    proxy = make_proxy(route(tool.url))
    plan = PlanSession.new()

    @function_tool
    async def charge(ctx: RunContextWrapper[StepCounter], account: str, amount: int) -> str:
        """Charge an account."""
        async with AsyncToolProxy(proxy.url) as client:
            answer = await client.call(
                ctx.context.next(), "/tools/charge", {"account": account, "amount": amount}
            )
        return f"execution {answer.json()['execution']}, replayed={answer.replayed}"

    async def run() -> str:
        arguments = json.dumps({"account": "acme", "amount": 42})
        context = ToolContext(
            plan.counter(),
            tool_name="charge",
            tool_call_id=f"call_{uuid.uuid4().hex}",
            tool_arguments=arguments,
        )
        return str(await charge.on_invoke_tool(context, arguments))

    assert asyncio.run(run()) == "execution 1, replayed=False"
    assert asyncio.run(run()) == "execution 1, replayed=True"  # a new tool_call_id, same step
    assert tool.total == 1
