"""tool_proxy_client's framework integrations, with the real framework packages (the
``integrations`` extra), through a real proxy to a real FastMCP server."""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from agents import RunContextWrapper, function_tool
from agents.mcp import MCPServerStreamableHttp, MCPUtil
from agents.tool_context import ToolContext
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.runnables import RunnableConfig
from langchain_mcp_adapters.client import MultiServerMCPClient
from langchain_mcp_adapters.interceptors import MCPToolCallRequest
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode
from pydantic_ai import Agent, RunContext
from pydantic_ai.mcp import MCPToolset
from pydantic_ai.messages import (
    ModelMessage,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from tool_proxy_client import AsyncToolProxy, PlanSession, StepCounter
from tool_proxy_client.errors import IdempotencyKeyReused
from tool_proxy_client.langchain import Handler, key_interceptor
from tool_proxy_client.langgraph import graph_plan, graph_step
from tool_proxy_client.mcp import call_tool
from tool_proxy_client.openai_agents import tool_meta_resolver
from tool_proxy_client.pydantic_ai import key_tool_calls, run_step

from tests.conftest import ProxyFactory, route
from tests.mcp_servers import McpTool, session
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


# Pydantic AI: a scripted FunctionModel (no LLM), the real Agent and MCPToolset.


def scripted(*calls: tuple[str, dict[str, Any]]) -> FunctionModel:
    """A model that answers the prompt with ``calls`` (one response: parallel tool calls,
    each with a new tool_call_id), then with the tools' returns, in order, as its text."""

    def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        returns = [
            str(part.content)
            for message in messages
            for part in message.parts
            if isinstance(part, ToolReturnPart)
        ]
        if returns:
            return ModelResponse(parts=[TextPart(" | ".join(returns))])
        return ModelResponse(
            parts=[
                ToolCallPart(name, args, tool_call_id=f"call_{uuid.uuid4().hex}")
                for name, args in calls
            ]
        )

    return FunctionModel(respond)


def billing(url: str, **options: Any) -> MCPToolset[Any]:
    return MCPToolset(url + "/mcp", process_tool_call=key_tool_calls(**options))


def test_pydantic_ai_mcp_toolset_calls_carry_the_runs_keys(
    make_proxy: ProxyFactory, mcp_tool: McpTool
) -> None:
    """The plan from the run's run_id, the step from the run's step and the call's position:
    the run made again with its run_id replays, whatever ids the model gives its calls."""
    proxy = make_proxy(mcp_route(mcp_tool.url, required=True))
    account, run_id = who(), f"job-{uuid.uuid4().hex}"
    model = scripted(
        ("charge", {"account": account, "cents": 100}),
        ("charge", {"account": account, "cents": 200}),
    )

    async def run(run_id: str) -> list[str]:
        async with billing(proxy.url) as server:
            result = await Agent(model, toolsets=[server]).run("charge twice", run_id=run_id)
        return result.output.split(" | ")

    first = asyncio.run(run(run_id))
    again = asyncio.run(run(run_id))  # made again (a crash, a retried job): the same keys
    assert again == first
    assert sorted(text.split(" (#")[0] for text in first) == [
        f"charged 100 to {account}",
        f"charged 200 to {account}",
    ]
    assert mcp_tool.executions[account] == 2
    other = asyncio.run(run(f"job-{uuid.uuid4().hex}"))  # another run: new calls
    assert mcp_tool.executions[account] == 4 and other != first


def test_pydantic_ai_waits_out_the_same_call_running_and_raises_the_proxys_refusals(
    make_proxy: ProxyFactory, mcp_tool: McpTool
) -> None:
    proxy = make_proxy(mcp_route(mcp_tool.url, required=True))
    account, run_id = who(), f"job-{uuid.uuid4().hex}"
    arguments = {"account": account, "cents": 7, "hold": True}
    # What the run's first call will be: step 1 (its first model response), call 1.
    step = PlanSession.derive("pydantic-ai", run_id).step(1).sub(1)

    async def scenario() -> tuple[str, str]:
        async with session(proxy.url + "/mcp") as client:
            with mcp_tool.holding():
                first = asyncio.ensure_future(call_tool(client, step, "charge", arguments))
                await asyncio.sleep(0.3)  # in flight: the run's call gets -32010, waits
                threading.Timer(1.0, mcp_tool.gate.set).start()
                async with billing(proxy.url) as server:
                    agent = Agent(scripted(("charge", arguments)), toolsets=[server])
                    result = await agent.run("charge", run_id=run_id)
            return str((await first).content[0].text), result.output

    direct, waited = asyncio.run(scenario())
    assert direct == waited == f"charged 7 to {account} (#1)"
    assert mcp_tool.executions[account] == 1

    async def one_step_for_two_tools() -> None:
        """A step function giving every call one step: two tools, one key."""
        plan = PlanSession.new()
        async with billing(proxy.url, steps=lambda ctx: plan.step("x")) as server:
            model = scripted(("balance", {"account": account}))
            await Agent(model, toolsets=[server]).run("balance")
            model = scripted(("refund", {"account": account}))
            await Agent(model, toolsets=[server]).run("refund")

    with pytest.raises(IdempotencyKeyReused) as reused:  # raised, not handed to the model
        asyncio.run(one_step_for_two_tools())
    assert reused.value.record is not None and reused.value.record.target == "refund"


def test_pydantic_ai_function_tools_call_http_tools_with_the_runs_steps(
    tool: CountingTool, make_proxy: ProxyFactory
) -> None:
    proxy = make_proxy(route(tool.url))
    run_id = f"job-{uuid.uuid4().hex}"
    agent = Agent(scripted(("charge", {"account": "acme", "amount": 42})), deps_type=AsyncToolProxy)

    @agent.tool
    async def charge(ctx: RunContext[AsyncToolProxy], account: str, amount: int) -> str:
        """Charge an account."""
        answer = await ctx.deps.call(
            run_step(ctx), "/tools/charge", {"account": account, "amount": amount}
        )
        return f"execution {answer.json()['execution']}, replayed={answer.replayed}"

    async def run() -> str:
        async with AsyncToolProxy(proxy.url) as client:
            return (await agent.run("charge", deps=client, run_id=run_id)).output

    assert asyncio.run(run()) == "execution 1, replayed=False"
    assert asyncio.run(run()) == "execution 1, replayed=True"  # the same run_id, step 1.1
    assert tool.total == 1


# LangGraph: a checkpointed graph whose run fails after its tool calls went out (the answer
# lost on the way back) and is resumed from its checkpoint.


class LostAnswers:
    """An interceptor inside the key's: the first ``count`` calls reach the tool, and then
    their answers are lost (a connection dropped on the way back)."""

    def __init__(self, count: int) -> None:
        self.count = count

    async def __call__(self, request: MCPToolCallRequest, handler: Handler) -> Any:
        result = await handler(request)
        if self.count > 0:
            self.count -= 1
            raise ConnectionError("the answer was lost")
        return result


def charges(account: str, *cents: int) -> AIMessage:
    return AIMessage(
        "",
        tool_calls=[
            {"name": "charge", "args": {"account": account, "cents": c}, "id": uuid.uuid4().hex}
            for c in cents
        ],
    )


def test_langgraph_resumed_graph_sends_the_same_keys(
    make_proxy: ProxyFactory, mcp_tool: McpTool
) -> None:
    """The plan from the graph's thread, the step from its step, node and the call's place
    in the AIMessage: the tools node run again on resume replays both calls."""
    proxy = make_proxy(mcp_route(mcp_tool.url, required=True))
    account = who()
    model = GenericFakeChatModel(messages=iter([charges(account, 100, 200), charges(account, 300)]))
    config: RunnableConfig = {"configurable": {"thread_id": f"thread-{uuid.uuid4().hex}"}}

    async def scenario() -> tuple[list[str], list[str]]:
        client = MultiServerMCPClient(
            {"billing": {"url": proxy.url + "/mcp", "transport": "streamable_http"}},
            tool_interceptors=[key_interceptor(), LostAnswers(1)],
        )
        tools = [t for t in await client.get_tools() if t.name == "charge"]

        async def agent(state: MessagesState) -> dict[str, Any]:
            return {"messages": [await model.ainvoke(state["messages"])]}

        builder = StateGraph(MessagesState)
        builder.add_node("agent", agent)
        builder.add_node("tools", ToolNode(tools))
        builder.add_edge(START, "agent")
        builder.add_edge("agent", "tools")
        builder.add_edge("tools", END)
        graph = builder.compile(checkpointer=InMemorySaver())
        with pytest.raises(ConnectionError):  # the run fails in its tools node
            await graph.ainvoke({"messages": [HumanMessage("charge twice")]}, config)
        resumed = await graph.ainvoke(None, config)  # from the checkpoint: the tools again
        later = await graph.ainvoke({"messages": [HumanMessage("once more")]}, config)
        return answers(resumed), answers(later)

    resumed, later = asyncio.run(scenario())
    assert sorted(text.split(" (#")[0] for text in resumed) == [
        f"charged 100 to {account}",
        f"charged 200 to {account}",
    ]
    assert later[-1] == f"charged 300 to {account} (#3)"  # a new input: later steps, new calls
    assert mcp_tool.executions[account] == 3  # not 4: the lost answer's call was replayed


def answers(state: dict[str, Any]) -> list[str]:
    return [
        str(block["text"]) if isinstance(block, dict) else str(block)
        for message in state["messages"]
        if isinstance(message, ToolMessage)
        for block in (message.content if isinstance(message.content, list) else [message.content])
    ]


def test_langgraph_nodes_call_http_tools_with_the_graphs_step(
    tool: CountingTool, make_proxy: ProxyFactory
) -> None:
    proxy = make_proxy(route(tool.url))
    config: RunnableConfig = {"configurable": {"thread_id": f"thread-{uuid.uuid4().hex}"}}
    crashes = [True]
    seen: list[str] = []

    async def bill(state: MessagesState, config: RunnableConfig) -> dict[str, Any]:
        async with AsyncToolProxy(proxy.url) as client:
            answer = await client.call(
                graph_step(config), "/tools/charge", {"account": "acme", "amount": 42}
            )
        seen.append(f"execution {answer.json()['execution']}, replayed={answer.replayed}")
        if crashes.pop() if crashes else False:
            raise ConnectionError("the worker died before the checkpoint")
        return {"messages": [AIMessage(seen[-1])]}

    builder = StateGraph(MessagesState)
    builder.add_node("bill", bill)
    builder.add_edge(START, "bill")
    builder.add_edge("bill", END)
    graph = builder.compile(checkpointer=InMemorySaver())

    async def scenario() -> None:
        with pytest.raises(ConnectionError):
            await graph.ainvoke({"messages": [HumanMessage("bill")]}, config)
        await graph.ainvoke(None, config)

    asyncio.run(scenario())
    assert seen == ["execution 1, replayed=False", "execution 1, replayed=True"]
    assert tool.total == 1
    step = graph_step({**config, "metadata": {"langgraph_step": 1, "langgraph_node": "bill"}})
    assert step.plan == graph_plan(config) and step.index == "1.bill"
