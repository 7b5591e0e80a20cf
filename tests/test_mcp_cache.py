"""The response cache on MCP routes: ``tools/call`` of cached tools answered again from the
store, by tool and arguments (not by the envelope, whose id changes), with the SDK on both
sides."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from mcp import types

from proxy import mcp
from proxy.asgi import Incoming
from proxy.config import RouteConfig, parse_config
from proxy.errors import ConfigError
from tests import test_offload
from tests.conftest import ProxyFactory, new_key
from tests.idp import IdentityProvider
from tests.mcp_servers import McpTool, RawSession, TaskTool, confirming, message_of, session
from tests.servers import ThreadServer
from tests.test_auth import auth_config
from tests.test_mcp import account, bearer, text
from tests.test_offload import BUCKET, S3, s3_offload

BOTH = "application/json, text/event-stream"
s3 = test_offload.s3  # moto's S3 server, the fixture of the offload tests


@pytest.fixture(scope="module", params=["json", "sse"])
def mcp_tool(request: pytest.FixtureRequest) -> Iterator[McpTool]:
    tool = McpTool(json_response=request.param == "json").start()
    yield tool
    tool.stop()


def cached_route(
    upstream: str, cache: dict[str, Any] | None = None, **route: Any
) -> dict[str, Any]:
    return {
        "name": "billing",
        "path_prefix": "/mcp",
        "upstream": upstream,
        "timeout": "10s",
        "protocol": "mcp",
        "cache": {"scope": "route", "ttl": "1m", **(cache or {})},
        **route,
    }


def guarded(guard: Any = "all") -> dict[str, Any]:
    return {
        "mcp": {"guard": guard},
        "idempotency": {"lock_ttl": "5s", "result_ttl": "1h", "retry_after": "1s"},
    }


def call(id: int | str, name: str, arguments: dict[str, Any], **params: Any) -> dict[str, Any]:
    return {
        "jsonrpc": "2.0",
        "id": id,
        "method": "tools/call",
        "params": {"name": name, "arguments": arguments, **params},
    }


def test_a_read_only_tool_is_answered_once_per_arguments(
    make_proxy: ProxyFactory, mcp_tool: McpTool
) -> None:
    proxy = make_proxy(cached_route(mcp_tool.url))
    who, other = account(), account()

    async def scenario() -> list[str]:
        async with session(proxy.url + "/mcp") as client:
            unknown = await client.call_tool("balance", {"account": who})  # not listed yet
            await client.list_tools()  # balance says readOnlyHint: it is cached from now on
            calls = [await client.call_tool("balance", {"account": who}) for _ in range(3)]
            calls.append(await client.call_tool("balance", {"account": other}))
            await client.call_tool("charge", {"account": who, "cents": 1})  # not read-only
            await client.call_tool("charge", {"account": who, "cents": 1})
            stale = await client.call_tool("balance", {"account": who})
            return [text(r) for r in (unknown, *calls, stale)]

    answers = asyncio.run(scenario())
    assert answers == [f"{who}: 0 charges"] * 4 + [f"{other}: 0 charges", f"{who}: 0 charges"]
    assert mcp_tool.executions[f"balance:{who}"] == 2  # before tools/list, then one fill
    assert mcp_tool.executions[f"balance:{other}"] == 1
    assert mcp_tool.executions[who] == 2


def test_a_hit_has_the_new_id_the_form_asked_for_and_cache_status(
    make_proxy: ProxyFactory, mcp_tool: McpTool
) -> None:
    proxy = make_proxy(cached_route(mcp_tool.url, {"tools": ["balance"]}))
    who = account()
    with httpx.Client(timeout=10) as http:
        raw = RawSession(http, proxy.url + "/mcp", BOTH).open()
        first = raw.post(call(1, "balance", {"account": who}))
        raw = RawSession(http, proxy.url + "/mcp", BOTH).open()  # another session
        again = raw.post(call("two", "balance", {"account": who}, _meta={"progressToken": 5}))
        json_only = raw.post(
            call(3, "balance", {"account": who}), Accept="application/json, text/event-stream;q=0.5"
        )
        sse_first = raw.post(
            call(4, "balance", {"account": who}), Accept="text/event-stream, application/json;q=0.9"
        )
    form = "application/json" if mcp_tool.json_response else "text/event-stream"
    assert first.headers["cache-status"] == "tool-proxy; fwd=miss" + (
        "; stored" if mcp_tool.json_response else ""  # an SSE answer's headers went first
    )
    assert again.headers["cache-status"] == "tool-proxy; hit"
    assert again.headers["content-type"].startswith(form)
    assert json_only.headers["content-type"] == "application/json"
    assert sse_first.headers["content-type"] == "text/event-stream"
    assert again.headers["mcp-session-id"] == raw.headers["Mcp-Session-Id"]
    assert "idempotent-replayed" not in again.headers
    messages = [message_of(r) for r in (first, again, json_only, sse_first)]
    assert [m["id"] for m in messages] == [1, "two", 3, 4]
    assert all(m["result"] == messages[0]["result"] for m in messages)
    assert mcp_tool.executions[f"balance:{who}"] == 1


def test_errors_and_other_revisions_are_not_shared(
    make_proxy: ProxyFactory, mcp_tool: McpTool
) -> None:
    proxy = make_proxy(cached_route(mcp_tool.url, {"tools": ["balance", "refund"]}))
    who = account()
    with httpx.Client(timeout=10) as http:
        raw = RawSession(http, proxy.url + "/mcp", BOTH).open()
        refusals = [raw.post(call(n, "refund", {"account": who})) for n in range(2)]
        newer = {"MCP-Protocol-Version": "2025-11-25"}
        reads = [raw.post(call(n, "balance", {"account": who}), **newer) for n in range(2)]
        older = raw.post(call(9, "balance", {"account": who}))
    assert [message_of(r)["result"]["isError"] for r in refusals] == [True, True]
    told = "; detail=result" if mcp_tool.json_response else ""  # SSE: the headers went first
    assert [r.headers["cache-status"] for r in refusals] == ["tool-proxy; fwd=miss" + told] * 2
    assert mcp_tool.executions[f"refund:{who}"] == 2  # an isError result is not kept
    assert reads[1].headers["cache-status"] == "tool-proxy; hit"
    assert older.headers["cache-status"].startswith("tool-proxy; fwd=miss")
    assert mcp_tool.executions[f"balance:{who}"] == 2  # one per revision


def test_identical_misses_make_one_call(make_proxy: ProxyFactory, mcp_tool: McpTool) -> None:
    proxy = make_proxy(cached_route(mcp_tool.url, {"tools": ["balance"]}))
    who = account()

    async def scenario() -> list[str]:
        async with session(proxy.url + "/mcp") as client:
            calls = [
                asyncio.ensure_future(client.call_tool("balance", {"account": who, "hold": True}))
                for _ in range(5)
            ]
            await asyncio.sleep(0.3)  # all five sent: one holds the fill lock, four wait
            mcp_tool.gate.set()
            return [text(await c) for c in calls]

    mcp_tool.gate.clear()
    try:
        answers = asyncio.run(scenario())
    finally:
        mcp_tool.gate.set()
    assert answers == [f"{who}: 0 charges"] * 5
    assert mcp_tool.executions[f"balance:{who}"] == 1
    waited = metric(proxy, 'tool_proxy_cache_decisions_total{decision="collapsed",route="billing"}')
    assert waited >= 1  # they waited for the one call, not merely hit after it


def metric(proxy: ThreadServer, series: str) -> float:
    for line in httpx.get(f"{proxy.url}/_proxy/metrics").text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_guarded_call_answered_from_the_cache_is_its_keys_outcome(
    make_proxy: ProxyFactory, mcp_tool: McpTool
) -> None:
    proxy = make_proxy(cached_route(mcp_tool.url, {"tools": ["balance"]}, **guarded()))
    who = account()
    arguments = {"account": who}

    async def scenario() -> list[Any]:
        async with session(proxy.url + "/mcp") as client:
            first, second = (new_key(arguments) for _ in range(2))
            return [
                await client.call_tool("balance", arguments, meta={"idempotencyKey": key})
                for key in (first, second, second)
            ]

    first, hit, replay = asyncio.run(scenario())
    assert hit == first
    assert replay == first
    assert mcp_tool.executions[f"balance:{who}"] == 1
    for outcome in ("executed", "cached", "replayed"):  # a hit is not an execution
        assert (
            metric(
                proxy,
                f'tool_proxy_requests_total{{outcome="{outcome}",route="billing",status="200"}}',
            )
            == 1
        ), outcome


@pytest.mark.filterwarnings("ignore:The experimental tasks API:DeprecationWarning")
def test_a_task_augmented_call_is_never_answered_from_the_cache(
    make_proxy: ProxyFactory,
) -> None:
    tool = TaskTool().start()
    try:
        proxy = make_proxy(cached_route(tool.url, {"tools": ["provision"]}))

        async def scenario() -> tuple[str, str]:
            async with session(proxy.url + "/mcp/") as client:  # the server's mount: /mcp/
                tasks = client.experimental
                first = await tasks.call_tool_as_task("provision", {"db": "orders"})
                again = await tasks.call_tool_as_task("provision", {"db": "orders"})
                for task in (first, again):
                    async for status in tasks.poll_task(task.task.taskId):
                        if status.status != "working":
                            break
                for _ in range(2):  # the same call without a task: cached
                    await client.call_tool("provision", {"db": "plain"})
                return first.task.taskId, again.task.taskId

        first, again = asyncio.run(scenario())
        assert first != again
        assert tool.runs["orders"] == 2
        assert tool.runs["plain"] == 1
    finally:
        tool.stop()


def test_cache_settings_on_mcp_routes_are_validated() -> None:
    route = cached_route("http://tool")
    cases: list[tuple[dict[str, Any], str]] = [
        ({"methods": ["POST"]}, "cache.methods: not on protocol: mcp routes"),
        ({"statuses": [200]}, "cache.statuses: not on protocol: mcp routes"),
        ({"tools": []}, "annotated, or a non-empty list of tool names"),
    ]
    for cache, problem in cases:
        with pytest.raises(ConfigError, match=problem):
            parse_config({"routes": [{**route, "cache": {"scope": "route", **cache}}]}, env={})
    http = {"name": "r", "path_prefix": "/", "upstream": "http://tool"}
    with pytest.raises(ConfigError, match=r"cache\.tools: only on protocol: mcp routes"):
        parse_config({"routes": [{**http, "cache": {"scope": "route", "tools": ["x"]}}]}, env={})


# -- unit ------------------------------------------------------------------------------


def _view(tools: Any = None) -> mcp.McpView:
    cache: dict[str, Any] = (
        {"scope": "route"} if tools is None else {"scope": "route", "tools": tools}
    )
    route = RouteConfig.model_validate(cached_route("http://tool", cache))
    return mcp.McpView(route, None)


def _incoming(*headers: tuple[bytes, bytes]) -> Incoming:
    scope = {"type": "http", "method": "POST", "headers": list(headers)}

    async def receive() -> Any:  # pragma: no cover: never read
        return {"type": "http.request", "body": b""}

    return Incoming.of(scope, receive)


def _tool_call(name: str = "balance", **params: Any) -> mcp.ToolCall:
    message = types.JSONRPCRequest.model_validate(call(7, name, {"account": "a"}, **params))
    return mcp.tool_call(message)


def test_only_plain_calls_of_cached_tools_are_cacheable() -> None:
    view = _view(["balance"])
    request = _incoming()
    assert view.caching(request, _tool_call()) is not None
    assert view.caching(request, _tool_call("charge")) is None
    assert view.caching(request, _tool_call(task={"ttl": 1000})) is None
    assert view.caching(request, _tool_call(requestState="s")) is None
    annotated = _view()
    assert annotated.caching(request, _tool_call()) is None  # not listed: unknown
    annotated._learn({"tools": [{"name": "balance", "inputSchema": {"type": "object"},
                                 "annotations": {"readOnlyHint": True}}]})  # fmt: skip
    assert annotated.caching(request, _tool_call()) is not None


def test_the_cache_key_is_the_tool_arguments_and_revision_not_the_envelope() -> None:
    view = _view(["balance"])
    request = _incoming()
    base = view.caching(request, _tool_call())
    same = view.caching(request, _tool_call(_meta={"progressToken": 1, "idempotencyKey": "k"}))
    newer = view.caching(_incoming((b"mcp-protocol-version", b"2025-11-25")), _tool_call())
    assert base is not None and same is not None and newer is not None
    assert base.material() == same.material()
    assert base.material() != newer.material()


@pytest.mark.parametrize(
    "result",
    [
        {"content": [], "isError": True},
        {"task": {"taskId": "t", "status": "working"}},
        {"resultType": "input_required", "inputRequests": {}},
    ],
)
def test_a_result_that_is_one_calls_own_is_not_kept(result: dict[str, Any]) -> None:
    cached = _view(["balance"]).caching(_incoming(), _tool_call())
    assert cached is not None
    json_type = [(b"content-type", b"application/json")]
    body = json.dumps({"jsonrpc": "2.0", "id": 7, "result": result}).encode()
    assert cached.kept(json_type, body) is None
    error = {"jsonrpc": "2.0", "id": 7, "error": {"code": -32000, "message": "no"}}
    assert cached.kept(json_type, json.dumps(error).encode()) is None
    ok = {"jsonrpc": "2.0", "id": 7, "result": {"content": []}}
    assert cached.kept(json_type, json.dumps({**ok, "id": 8}).encode()) is None  # not its id
    assert cached.kept(json_type, json.dumps(ok).encode()) is not None


def test_an_sse_answer_is_kept_as_its_result_and_served_readdressed() -> None:
    cached = _view(["balance"]).caching(_incoming((b"accept", BOTH.encode())), _tool_call())
    assert cached is not None
    progress = {"jsonrpc": "2.0", "method": "notifications/progress",
                "params": {"progressToken": 1, "progress": 1}}  # fmt: skip
    result = {"jsonrpc": "2.0", "id": 7, "result": {"content": [{"type": "text", "text": "1"}]}}
    stream = b"".join(b"event: message\ndata: " + json.dumps(m).encode() + b"\n\n"
                      for m in (progress, result))  # fmt: skip
    kept = cached.kept([(b"content-type", b"text/event-stream")], stream)
    assert kept is not None
    headers, body = kept
    assert json.loads(body) == result
    later = _view(["balance"]).caching(
        _incoming((b"accept", BOTH.encode()), (b"mcp-session-id", b"s2")),
        mcp.tool_call(types.JSONRPCRequest.model_validate(call("x", "balance", {"account": "a"}))),
    )
    assert later is not None
    served_headers, served = later.served(headers, body)
    assert (b"content-type", b"text/event-stream") in served_headers  # the tool's form
    assert (b"mcp-session-id", b"s2") in served_headers
    assert message_of(httpx.Response(200, headers=served_headers, content=served)) == {
        **result,
        "id": "x",
    }


def test_scope_principal_keeps_each_callers_answers_apart(
    make_proxy: ProxyFactory, mcp_tool: McpTool, idp: IdentityProvider
) -> None:
    spec = cached_route(mcp_tool.url, {"scope": "principal", "tools": ["balance"]})
    proxy = make_proxy({**spec, "auth": {"required": True}}, auth=auth_config(idp))
    who = account()

    async def read(user: str) -> str:
        async with session(proxy.url + "/mcp", bearer(idp.token(user))) as client:
            return text(await client.call_tool("balance", {"account": who}))

    async def scenario() -> list[str]:
        return [await read(user) for user in ("alice", "alice", "bob", "bob")]

    assert asyncio.run(scenario()) == [f"{who}: 0 charges"] * 4
    assert mcp_tool.executions[f"balance:{who}"] == 2  # one fill per caller


@pytest.fixture(scope="module")
def sse_tool() -> Iterator[McpTool]:
    tool = McpTool(json_response=False).start()
    yield tool
    tool.stop()


@pytest.mark.parametrize("guard", [False, True])
def test_a_call_on_which_the_server_asked_the_client_is_not_kept(
    make_proxy: ProxyFactory, sse_tool: McpTool, guard: bool
) -> None:
    """``close`` elicits on its SSE stream: the request reaches the caller at once (nothing
    held back by the cache), and the result, which depends on the answer, is not stored."""
    proxy = make_proxy(
        cached_route(sse_tool.url, {"tools": ["close"]}, **(guarded() if guard else {}))
    )
    who = account()
    asked: list[str] = []

    async def scenario() -> list[str]:
        async with session(proxy.url + "/mcp", elicitation_callback=confirming(asked)) as client:
            answers = []
            for _ in range(2):
                meta = {"idempotencyKey": new_key({"account": who})} if guard else None
                answer = client.call_tool("close", {"account": who}, meta=meta)
                answers.append(text(await asyncio.wait_for(answer, 10)))
            return answers

    assert asyncio.run(scenario()) == [f"closed {who}"] * 2
    assert asked == [f"Close {who}?"] * 2
    assert sse_tool.executions[f"close:{who}"] == 2


def test_progress_reaches_the_filling_caller_and_a_hit_is_the_result_alone(
    make_proxy: ProxyFactory, sse_tool: McpTool
) -> None:
    proxy = make_proxy(cached_route(sse_tool.url, {"tools": ["export"]}))
    who = account()
    seen: list[list[float]] = [[], []]

    async def scenario() -> list[str]:
        async with session(proxy.url + "/mcp") as client:
            answers = []
            for got in seen:

                async def note(
                    progress: float,
                    total: float | None,
                    message: str | None,
                    got: list[float] = got,
                ) -> None:
                    got.append(progress)

                answer = await client.call_tool("export", {"account": who}, progress_callback=note)
                answers.append(text(answer))
            return answers

    assert asyncio.run(scenario()) == [f"exported {who}"] * 2
    assert seen == [[0, 1, 2], []]
    assert sse_tool.executions[f"export:{who}"] == 1


def test_arguments_without_a_canonical_form_pass_uncached(
    make_proxy: ProxyFactory, mcp_tool: McpTool
) -> None:
    proxy = make_proxy(cached_route(mcp_tool.url, {"tools": ["balance"]}))
    who = account()
    with httpx.Client(timeout=10) as http:
        raw = RawSession(http, proxy.url + "/mcp", BOTH).open()
        answers = [raw.post(call(n, "balance", {"account": who, "big": 2**60})) for n in range(2)]
    assert [a.status_code for a in answers] == [200, 200]
    assert [message_of(a)["id"] for a in answers] == [0, 1]
    assert "cache-status" not in answers[1].headers
    assert mcp_tool.executions[f"balance:{who}"] == 2


def test_each_endpoint_of_a_route_has_its_own_entries(
    make_proxy: ProxyFactory, mcp_tool: McpTool
) -> None:
    proxy = make_proxy(cached_route(mcp_tool.url, {"tools": ["balance"]}))
    who = account()
    statuses = []
    with httpx.Client(timeout=10) as http:
        for query in ("?tenant=a", "?tenant=b", "?tenant=a"):
            raw = RawSession(http, proxy.url + "/mcp" + query, BOTH).open()
            statuses.append(raw.post(call(1, "balance", {"account": who})).headers["cache-status"])
    assert [s.split(";")[1].strip() for s in statuses] == ["fwd=miss", "fwd=miss", "hit"]
    assert mcp_tool.executions[f"balance:{who}"] == 2


def test_a_large_result_is_cached_in_object_storage(
    make_proxy: ProxyFactory, mcp_tool: McpTool, s3: S3
) -> None:
    spec = cached_route(mcp_tool.url, {"tools": ["report"]})
    proxy = make_proxy(spec, offload=s3_offload(s3, threshold=1024))
    who = account()

    async def scenario() -> list[str]:
        async with session(proxy.url + "/mcp") as client:
            arguments = {"account": who, "size": 300_000}
            return [text(await client.call_tool("report", arguments)) for _ in "ab"]

    assert asyncio.run(scenario()) == ["r" * 300_000] * 2
    assert mcp_tool.executions[f"report:{who}"] == 1
    [stored] = s3.keys()
    body = s3.client().get_object(Bucket=BUCKET, Key=stored)["Body"].read()
    assert json.loads(body)["result"]["content"][0]["text"] == "r" * 300_000  # the result


def test_a_stream_on_which_the_server_asked_the_client_is_not_kept() -> None:
    cached = _view(["balance"]).caching(_incoming(), _tool_call())
    assert cached is not None
    roots = {"jsonrpc": "2.0", "id": 0, "method": "roots/list"}
    result = {"jsonrpc": "2.0", "id": 7, "result": {"content": []}}
    events = [b"event: message\ndata: " + json.dumps(m).encode() + b"\n\n" for m in (roots, result)]
    sse = [(b"content-type", b"text/event-stream")]
    assert cached.kept(sse, b"".join(events)) is None
    assert cached.kept(sse, events[1]) is not None
