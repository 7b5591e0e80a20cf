"""MCP routes: exactly-once ``tools/call`` with the official SDK on both sides."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from mcp.shared.exceptions import McpError
from starlette.responses import StreamingResponse

from proxy import mcp
from proxy.config import parse_config
from proxy.errors import ConfigError, McpRefused, OutcomeUnknown, ResponseNotStored
from proxy.forwarding import UpstreamResponse
from tests import test_offload
from tests.conftest import ProxyFactory, new_key
from tests.idp import IdentityProvider
from tests.mcp_servers import McpTool, RawSession, TaskTool, confirming, message_of, session
from tests.servers import ThreadServer
from tests.test_auth import auth_config
from tests.test_offload import BUCKET, S3, s3_offload
from tests.test_tokens import SECRET_ENV, auth_section


@pytest.fixture(scope="module", params=["json", "sse"])
def mcp_tool(request: pytest.FixtureRequest) -> Iterator[McpTool]:
    tool = McpTool(json_response=request.param == "json").start()
    yield tool
    tool.stop()


T = TypeVar("T")
s3 = test_offload.s3  # moto's S3 server, the fixture of the offload tests


def mcp_route(upstream: str, guard: Any = "all", **idempotency: Any) -> dict[str, Any]:
    return {
        "name": "billing",
        "path_prefix": "/mcp",
        "upstream": upstream,
        "timeout": "10s",
        "protocol": "mcp",
        "mcp": {"guard": guard},
        "idempotency": {"lock_ttl": "5s", "result_ttl": "1h", "retry_after": "1s", **idempotency},
    }


def through(make_proxy: ProxyFactory, tool: McpTool, **route: Any) -> ThreadServer:
    return make_proxy(mcp_route(tool.url, **route))


def account() -> str:
    return f"acct-{time.monotonic_ns()}"


def text(result: Any) -> str:
    return str(result.content[0].text)


def test_a_call_sent_again_is_executed_once(make_proxy: ProxyFactory, mcp_tool: McpTool) -> None:
    proxy = through(make_proxy, mcp_tool)
    who = account()
    arguments = {"account": who, "cents": 250}
    key = new_key(arguments)

    async def scenario() -> tuple[Any, Any]:
        async with session(proxy.url + "/mcp") as client:
            first = await client.call_tool("charge", arguments, meta={"idempotencyKey": key})
            again = await client.call_tool("charge", arguments, meta={"idempotencyKey": key})
            return first, again

    first, again = asyncio.run(scenario())
    assert mcp_tool.executions[who] == 1
    assert again == first
    assert text(first) == f"charged 250 to {who} (#1)"


def test_the_key_may_be_an_http_header(make_proxy: ProxyFactory, mcp_tool: McpTool) -> None:
    proxy = through(make_proxy, mcp_tool, key="opaque")
    who = account()

    async def scenario() -> list[str]:
        async with session(proxy.url + "/mcp", {"Idempotency-Key": f"charge-{who}"}) as client:
            calls = [client.call_tool("charge", {"account": who, "cents": 1}) for _ in range(2)]
            return [text(await call) for call in calls]

    assert asyncio.run(scenario()) == [f"charged 1 to {who} (#1)"] * 2
    assert mcp_tool.executions[who] == 1


def test_a_key_in_the_header_and_in_meta_is_compared_as_read_not_as_spelt(
    make_proxy: ProxyFactory, mcp_tool: McpTool
) -> None:
    """The header's RFC 8941 sf-string form (``"k"``) and ``_meta``'s bare ``k`` are one
    key (each is read unquoted); two keys that differ as read are refused."""
    proxy = through(make_proxy, mcp_tool, key="opaque")
    who = account()
    key = f"charge-{who}"
    call = {"name": "charge", "arguments": {"account": who, "cents": 5}, "_meta": {}}
    with httpx.Client(timeout=10) as http:
        raw = RawSession(http, proxy.url + "/mcp", "application/json, text/event-stream").open()
        headers = {**raw.headers, "Idempotency-Key": f'"{key}"'}

        def send(meta_key: str, id: int) -> Any:
            params = {**call, "_meta": {"idempotencyKey": meta_key}}
            message = {"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": params}
            return message_of(http.post(raw.url, json=message, headers=headers))

        first, again, other = send(key, 1), send(key, 2), send(key + "-x", 3)
    assert "error" not in first and "error" not in again, first
    assert mcp_tool.executions[who] == 1
    assert other["error"]["code"] == mcp.KEY_INVALID
    assert "differ" in other["error"]["message"]


def test_a_key_header_sent_twice_is_the_json_rpc_error_of_the_request(
    make_proxy: ProxyFactory, mcp_tool: McpTool
) -> None:
    """Two Idempotency-Key lines on an MCP route: -32014 for the request's id (a call's,
    another request's), -32014 with id null (400) for a notification; a GET, with no id,
    the HTTP problem. Nothing is claimed or forwarded: the call sent again with one key
    runs once."""
    proxy = through(make_proxy, mcp_tool, key="opaque")
    who = account()
    call = {"name": "charge", "arguments": {"account": who, "cents": 5}}
    key = f"charge-{who}"
    with httpx.Client(timeout=10) as http:
        raw = RawSession(http, proxy.url + "/mcp", "application/json, text/event-stream").open()
        url, headers = raw.url, list(raw.headers.items())
        twice = [*headers, ("Idempotency-Key", key), ("Idempotency-Key", key)]

        def post(message: Any) -> httpx.Response:
            return http.post(url, content=json.dumps(message), headers=twice)

        called = post({"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": call})
        listed = post({"jsonrpc": "2.0", "id": "l", "method": "tools/list"})
        noted = post({"jsonrpc": "2.0", "method": "notifications/progress", "params": {}})
        streamed = http.get(url, headers=twice)
        again = raw.post(
            {"jsonrpc": "2.0", "id": 8, "method": "tools/call", "params": call},
            **{"Idempotency-Key": key},
        )
    for answer, id in ((called, 7), (listed, "l")):
        assert answer.status_code == 200
        assert answer.headers["content-type"] == "application/json"
        error = answer.json()
        assert error["id"] == id and error["error"]["code"] == mcp.KEY_INVALID
        assert error["error"]["data"]["type"] == "urn:tool-proxy:problem:idempotency-key-invalid"
        assert "sent once" in error["error"]["message"]
    assert noted.status_code == 400
    assert noted.json()["id"] is None and noted.json()["error"]["code"] == mcp.KEY_INVALID
    assert streamed.status_code == 400
    assert streamed.headers["content-type"] == "application/problem+json"
    assert message_of(again)["result"]["content"][0]["text"] == f"charged 5 to {who} (#1)"
    assert mcp_tool.executions[who] == 1


def test_a_client_that_times_out_gets_in_progress_then_the_replay(
    make_proxy: ProxyFactory, mcp_tool: McpTool
) -> None:
    proxy = through(make_proxy, mcp_tool)
    who = account()
    arguments = {"account": who, "cents": 5, "hold": True}
    meta = {"idempotencyKey": new_key(arguments)}

    async def scenario() -> tuple[McpError, McpError, Any]:
        async with session(proxy.url + "/mcp") as client:
            with mcp_tool.holding():
                short = timedelta(seconds=0.2)
                with pytest.raises(McpError) as timed_out:  # the SDK then sends a cancellation
                    await client.call_tool("charge", arguments, short, meta=meta)
                with pytest.raises(McpError) as busy:
                    await client.call_tool("charge", arguments, meta=meta)
            await asyncio.to_thread(mcp_tool.finished[who].wait, 10)
            replayed = await until_recorded(
                lambda: client.call_tool("charge", arguments, meta=meta)
            )
            return timed_out.value, busy.value, replayed

    timed_out, busy, replayed = asyncio.run(scenario())
    assert "Timed out" in str(timed_out)
    assert busy.error.code == mcp.IN_PROGRESS
    assert "Wait 1 seconds" in busy.error.message
    assert isinstance(busy.error.data, dict)
    assert busy.error.data["status"] == 409
    assert busy.error.data["retry_after"] == 1
    assert text(replayed) == f"charged 5 to {who} (#1)"  # the cancelled call completed
    assert mcp_tool.executions[who] == 1


async def until_recorded(call: Callable[[], Awaitable[T]], attempts: int = 200) -> T:
    """``call``'s answer once the call it repeats is no longer in progress (its tool has
    answered; its recording takes a moment more)."""
    for _ in range(attempts - 1):
        try:
            return await call()
        except McpError as exc:
            if exc.error.code != mcp.IN_PROGRESS:
                raise
    return await call()


def test_other_arguments_under_the_same_step_are_a_new_execution(
    make_proxy: ProxyFactory, mcp_tool: McpTool
) -> None:
    proxy = through(make_proxy, mcp_tool)
    who = account()
    plan = f"plan-{who}"

    async def scenario() -> list[str]:
        async with session(proxy.url + "/mcp") as client:
            answers = []
            for cents in (10, 20, 20):
                arguments = {"account": who, "cents": cents}
                key = new_key(arguments, step=3, plan=plan)
                result = await client.call_tool("charge", arguments, meta={"idempotencyKey": key})
                answers.append(text(result))
            return answers

    assert asyncio.run(scenario()) == [
        f"charged 10 to {who} (#1)",
        f"charged 20 to {who} (#2)",
        f"charged 20 to {who} (#2)",
    ]


def test_an_error_result_is_replayed(make_proxy: ProxyFactory, mcp_tool: McpTool) -> None:
    proxy = through(make_proxy, mcp_tool)
    who = account()
    meta = {"idempotencyKey": new_key({"account": who})}

    async def scenario() -> list[Any]:
        async with session(proxy.url + "/mcp") as client:
            return [await client.call_tool("refund", {"account": who}, meta=meta) for _ in "ab"]

    first, again = asyncio.run(scenario())
    assert first.isError and again == first
    assert text(first) == "Error executing tool refund: refund #1 refused"
    assert mcp_tool.executions[f"refund:{who}"] == 1


def test_progress_reaches_the_first_caller_and_is_not_recorded(
    make_proxy: ProxyFactory, mcp_tool: McpTool
) -> None:
    """Over SSE the first caller gets the progress as it comes, then the result; the
    retry gets the recorded result alone. (FastMCP's JSON mode sends no progress.)"""
    proxy = through(make_proxy, mcp_tool)
    who = account()
    meta = {"idempotencyKey": new_key({"account": who})}
    seen: list[list[float]] = []

    async def scenario() -> list[str]:
        async with session(proxy.url + "/mcp") as client:
            answers = []
            for _ in "ab":
                seen.append([])

                async def report(progress: float, total: float | None, message: str | None) -> None:
                    seen[-1].append(progress)

                result = await client.call_tool("export", {"account": who}, None, report, meta=meta)
                answers.append(text(result))
            return answers

    assert asyncio.run(scenario()) == [f"exported {who}"] * 2
    assert mcp_tool.executions[f"export:{who}"] == 1
    assert seen == ([[], []] if mcp_tool.json_response else [[0, 1, 2], []])


def test_the_servers_request_reaches_the_first_caller_who_answers_it(
    make_proxy: ProxyFactory, mcp_tool: McpTool
) -> None:
    """A guarded tool that asks the client (elicitation) on its SSE stream gets its answer
    through the proxy; the retry gets the recorded result and is asked nothing."""
    if mcp_tool.json_response:
        pytest.skip("the server's requests need an SSE answer")
    proxy = through(make_proxy, mcp_tool)
    who = account()
    meta = {"idempotencyKey": new_key({"account": who})}
    asked: list[str] = []

    async def scenario() -> list[str]:
        async with session(proxy.url + "/mcp", elicitation_callback=confirming(asked)) as client:
            return [
                text(await client.call_tool("close", {"account": who}, meta=meta)) for _ in "ab"
            ]

    assert asyncio.run(scenario()) == [f"closed {who}"] * 2
    assert asked == [f"Close {who}?"]
    assert mcp_tool.executions[f"close:{who}"] == 1


def test_an_unknown_outcome_is_an_error_that_says_what_to_do(
    make_proxy: ProxyFactory, mcp_tool: McpTool
) -> None:
    proxy = make_proxy({**mcp_route(mcp_tool.url), "timeout": "300ms"})
    who = account()
    arguments = {"account": who, "cents": 3, "hold": True}
    meta = {"idempotencyKey": new_key(arguments)}

    async def scenario() -> list[McpError]:
        async with session(proxy.url + "/mcp") as client:
            errors = []
            with mcp_tool.holding():  # past the route's timeout
                for _ in "ab":
                    with pytest.raises(McpError) as unknown:
                        await client.call_tool("charge", arguments, meta=meta)
                    errors.append(unknown.value)
            await asyncio.to_thread(mcp_tool.finished[who].wait, 10)  # in the session
            return errors

    first, again = asyncio.run(scenario())
    assert first.error.code == again.error.code == mcp.OUTCOME_UNKNOWN
    assert first.error.message.startswith("The tool call may or may not have run")
    assert "will not be run again under this key" in again.error.message
    assert isinstance(first.error.data, dict)
    assert first.error.data["status"] == 504
    assert mcp_tool.executions[who] == 1


def test_annotated_guards_only_tools_with_side_effects(
    make_proxy: ProxyFactory, mcp_tool: McpTool
) -> None:
    proxy = through(make_proxy, mcp_tool, guard="annotated", required=True)
    who = account()

    async def scenario() -> tuple[list[str], McpError]:
        async with session(proxy.url + "/mcp") as client:
            with pytest.raises(McpError) as unknown:  # before tools/list: guarded
                await client.call_tool("balance", {"account": who})
            listed = await client.list_tools()
            await client.send_ping()
            for _ in range(2):  # read-only: passes through, no key needed
                await client.call_tool("balance", {"account": who})
            return sorted(tool.name for tool in listed.tools), unknown.value

    names, unknown = asyncio.run(scenario())
    assert names == sorted(mcp_tool.tools)
    assert unknown.error.code == mcp.KEY_MISSING
    assert "params._meta.idempotencyKey" in unknown.error.message
    assert mcp_tool.executions[f"balance:{who}"] == 2


def test_annotations_learnt_by_one_replica_guard_calls_on_another(
    make_proxy: ProxyFactory, mcp_tool: McpTool, tmp_path: Path
) -> None:
    """Two replicas on one store: the tools/list answer that passed replica a makes the
    read-only tool unguarded on replica b too (no key needed), the others still guarded."""
    store = f"sqlite:///{tmp_path / 'shared.db'}"
    spec = mcp_route(mcp_tool.url, guard="annotated", required=True)
    a, b = make_proxy(spec, store=store), make_proxy(spec, store=store)
    who = account()

    async def scenario() -> McpError:
        async with session(a.url + "/mcp") as client:
            await client.list_tools()
        async with session(b.url + "/mcp") as client:
            await client.call_tool("balance", {"account": who})  # read-only, learnt by a
            with pytest.raises(McpError) as guarded:
                await client.call_tool("charge", {"account": who, "cents": 1})
            return guarded.value

    assert asyncio.run(scenario()).error.code == mcp.KEY_MISSING
    assert mcp_tool.executions[f"balance:{who}"] == 1


def test_guarded_tools_may_be_named(make_proxy: ProxyFactory, mcp_tool: McpTool) -> None:
    """Only the named tool is guarded: it needs a key and runs once under it; the others
    pass through without one."""
    proxy = through(make_proxy, mcp_tool, guard=["refund"], required=True)
    who = account()
    key = new_key({"account": who})

    async def scenario() -> tuple[McpError, Any, Any]:
        async with session(proxy.url + "/mcp") as client:
            await client.call_tool("charge", {"account": who, "cents": 1})
            await client.call_tool("charge", {"account": who, "cents": 1})
            with pytest.raises(McpError) as keyless:
                await client.call_tool("refund", {"account": who})
            meta = {"idempotencyKey": key}
            first = await client.call_tool("refund", {"account": who}, meta=meta)
            again = await client.call_tool("refund", {"account": who}, meta=meta)
            return keyless.value, first, again

    keyless, first, again = asyncio.run(scenario())
    assert mcp_tool.executions[who] == 2
    assert keyless.error.code == mcp.KEY_MISSING
    assert first.isError and again == first
    assert mcp_tool.executions[f"refund:{who}"] == 1


def test_a_replay_has_the_new_id_and_is_marked(make_proxy: ProxyFactory, mcp_tool: McpTool) -> None:
    proxy = through(make_proxy, mcp_tool)
    who = account()
    arguments = {"account": who, "cents": 7}
    call = {
        "name": "charge",
        "arguments": arguments,
        "_meta": {"idempotencyKey": new_key(arguments)},
    }
    with httpx.Client(timeout=10) as http:
        raw = RawSession(http, proxy.url + "/mcp", "application/json, text/event-stream").open()
        first = raw.post({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": call})
        again = raw.post({"jsonrpc": "2.0", "id": "two", "method": "tools/call", "params": call})
        json_only = raw.post(
            {"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": call},
            Accept="application/json;q=1, text/event-stream;q=0.5",
        )
        sse_first = raw.post(
            {"jsonrpc": "2.0", "id": 4, "method": "tools/call", "params": call},
            Accept="text/event-stream, application/json;q=0.9",
        )
    form = "application/json" if mcp_tool.json_response else "text/event-stream"
    assert first.headers["content-type"].startswith(form)
    assert again.headers["content-type"].startswith(form)
    assert json_only.headers["content-type"] == "application/json"
    assert sse_first.headers["content-type"] == "text/event-stream"
    assert "idempotent-replayed" not in first.headers
    assert again.headers["idempotent-replayed"] == "true"
    assert again.headers["mcp-session-id"] == raw.headers["Mcp-Session-Id"]
    ids = [message_of(r)["id"] for r in (first, again, json_only, sse_first)]
    assert ids == [1, "two", 3, 4]
    results = [message_of(r)["result"] for r in (first, again, json_only, sse_first)]
    assert all(r == results[0] for r in results)
    assert mcp_tool.executions[who] == 1


def test_the_servers_priming_event_reaches_no_caller(make_proxy: ProxyFactory) -> None:
    """A resumable server (2025-11-25) opens each SSE answer with an event that has an id
    and empty data: not a message. Neither the first caller nor a replay gets it as an
    ``event: message`` with empty data."""
    tool = McpTool(json_response=False, resumable=True).start()
    try:
        proxy = through(make_proxy, tool)
        direct, answers = _two_calls(tool.url + "/mcp"), _two_calls(proxy.url + "/mcp")
    finally:
        tool.stop()
    assert b"\ndata: \n" in b"\n" + direct[0].replace(b"\r\n", b"\n")  # the server sends one
    for answer in answers:
        events = answer.replace(b"\r\n", b"\n").split(b"\n\n")
        assert all(b"data: " in e and not e.endswith(b"data: ") for e in events if e), answer
        assert b'"result"' in answer


def _two_calls(url: str) -> list[bytes]:
    """A guarded call and its replay, both over SSE, their raw bodies."""
    arguments = {"account": account(), "cents": 3}
    call = {"name": "charge", "arguments": arguments}
    call["_meta"] = {"idempotencyKey": new_key(arguments)}
    sse = "text/event-stream, application/json;q=0.9"
    with httpx.Client(timeout=10) as http:
        raw = RawSession(http, url, sse).open("2025-11-25")
        message = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": call}
        return [raw.post({**message, "id": n}).content for n in (1, 2)]


def test_a_key_sent_again_with_other_arguments_is_refused(
    make_proxy: ProxyFactory, mcp_tool: McpTool
) -> None:
    proxy = through(make_proxy, mcp_tool, key="opaque")
    who = account()
    meta = {"idempotencyKey": f"k-{who}"}

    async def scenario() -> McpError:
        async with session(proxy.url + "/mcp") as client:
            await client.call_tool("charge", {"account": who, "cents": 1}, meta=meta)
            with pytest.raises(McpError) as reused:
                await client.call_tool("charge", {"account": who, "cents": 2}, meta=meta)
            return reused.value

    reused = asyncio.run(scenario())
    assert reused.error.code == mcp.KEY_REUSED
    assert isinstance(reused.error.data, dict)
    assert reused.error.data["type"] == "urn:tool-proxy:problem:idempotency-key-reused"
    assert mcp_tool.executions[who] == 1


def test_a_composite_key_must_hash_the_arguments(
    make_proxy: ProxyFactory, mcp_tool: McpTool
) -> None:
    proxy = through(make_proxy, mcp_tool)
    wrong = new_key({"account": "someone else"})

    async def scenario() -> McpError:
        async with session(proxy.url + "/mcp") as client:
            with pytest.raises(McpError) as mismatch:
                await client.call_tool(
                    "charge", {"account": "a", "cents": 1}, meta={"idempotencyKey": wrong}
                )
            return mismatch.value

    assert asyncio.run(scenario()).error.code == mcp.ARGS_HASH_MISMATCH


@pytest.mark.filterwarnings("ignore:The experimental tasks API:DeprecationWarning")
def test_a_task_augmented_call_sent_again_gets_the_same_task(make_proxy: ProxyFactory) -> None:
    tool = TaskTool().start()
    try:
        proxy = make_proxy(mcp_route(tool.url))
        meta = {"idempotencyKey": new_key({"db": "orders"})}

        async def scenario() -> tuple[Any, Any, Any]:
            async with session(proxy.url + "/mcp/") as client:  # the server's mount: /mcp/
                tasks = client.experimental
                first = await tasks.call_tool_as_task("provision", {"db": "orders"}, meta=meta)
                again = await tasks.call_tool_as_task("provision", {"db": "orders"}, meta=meta)
                async for status in tasks.poll_task(again.task.taskId):  # tasks/* pass through
                    if status.status != "working":
                        break
                return first, again, status

        first, again, status = asyncio.run(scenario())
        assert again.task.taskId == first.task.taskId
        assert status.status == "completed"
        assert tool.runs["orders"] == 1
    finally:
        tool.stop()


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"{not json", -32700),
        (b'{"jsonrpc": "1.0", "id": 9, "method": "tools/call"}', -32600),
        (b'[{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "x"}}]', -32600),
        (b'{"jsonrpc": "2.0", "id": 9, "method": "tools/call", "params": {"name": 5}}', -32602),
        # ids JSON-RPC lets a server take, which would make the call a "notification":
        (b'{"jsonrpc": "2.0", "id": 1.5, "method": "tools/call", "params": {"name": "x"}}', -32600),
        (
            b'{"jsonrpc": "2.0", "id": true, "method": "tools/call", "params": {"name": "x"}}',
            -32600,
        ),
        (b'{"jsonrpc": "2.0", "id": null, "method": "ping"}', -32600),
        (b'{"jsonrpc": "2.0", "method": "tools/call", "params": {"name": "x"}}', -32600),
    ],
)
def test_a_body_that_cannot_be_guarded_is_a_json_rpc_error(
    make_proxy: ProxyFactory, mcp_tool: McpTool, body: bytes, code: int
) -> None:
    proxy = through(make_proxy, mcp_tool)
    answer = httpx.post(
        proxy.url + "/mcp",
        content=body,
        headers={"Content-Type": "application/json", "Accept": "application/json"},
    )
    assert answer.status_code == (200 if code == -32602 else 400)
    assert answer.json()["error"]["code"] == code
    assert answer.json()["jsonrpc"] == "2.0"


@pytest.mark.parametrize(
    ("body", "id"),
    [
        (b'{"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": %s, "method": "ping"}', 7),
        (b'{"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": %s, "id": 8}', None),
        (
            b'{"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": "charge", '
            b'"arguments": {"account": "%s", "cents": 1, "cents": 2}}}',
            7,
        ),
        (
            b'[{"jsonrpc": "2.0", "id": 7, "method": "ping", "method": "tools/call", '
            b'"params": %s}]',
            None,
        ),
    ],
)
def test_a_message_that_repeats_a_member_name_is_refused_and_not_sent(
    make_proxy: ProxyFactory, mcp_tool: McpTool, body: bytes, id: int | None
) -> None:
    """Read as the last ``method`` by the proxy, perhaps as the first by the server: an
    unguarded call. One reading, as on HTTP routes (duplicate-json-member)."""
    proxy = through(make_proxy, mcp_tool)
    who = account()
    params = json.dumps({"name": "charge", "arguments": {"account": who, "cents": 1}})
    filled = body % (who.encode() if b"cents" in body else params.encode())
    with httpx.Client(timeout=10) as http:
        raw = RawSession(http, proxy.url + "/mcp", "application/json, text/event-stream").open()
        answer = http.post(raw.url, content=filled, headers=raw.headers)
    assert answer.status_code == 400, answer.text
    error = answer.json()
    assert (error["id"], error["error"]["code"]) == (id, -32600)
    assert error["error"]["data"]["type"] == "urn:tool-proxy:problem:duplicate-json-member"
    assert mcp_tool.executions[who] == 0


@pytest.mark.parametrize("guarded", [True, False])
def test_a_cancellation_is_answered_here_on_a_guarded_route_and_forwarded_elsewhere(
    make_proxy: ProxyFactory, mcp_tool: McpTool, guarded: bool
) -> None:
    """On a route that guards calls the cancelled call runs on (and is recorded, for the
    retry): the proxy answers the notification and keeps it from the server; a route
    that guards nothing passes it through."""
    route = mcp_route(mcp_tool.url)
    if not guarded:
        del route["idempotency"]
    proxy = make_proxy(route)
    before = len(mcp_tool.notifications)
    with httpx.Client(timeout=10) as http:
        raw = RawSession(http, proxy.url + "/mcp", "application/json, text/event-stream").open()
        note = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 77}}
        answer = raw.post(note)
        gone = http.delete(proxy.url + "/mcp", headers=raw.headers)
    assert answer.status_code == 202
    assert gone.status_code == 200
    noted = mcp_tool.notifications[before:]
    assert "notifications/initialized" in noted  # the server's notifications are seen
    assert ("notifications/cancelled" in noted) is not guarded


@pytest.mark.parametrize(
    ("route", "problem"),
    [
        ({"mcp": {"guard": []}}, "routes[0].mcp.guard: all, annotated, or a non-empty list"),
        ({"mcp": {"key_meta": "a b"}}, "routes[0].mcp.key_meta: a _meta member name"),
        ({"mcp": {"other": 1}}, "routes[0].mcp.other: unknown key"),
        ({"protocol": "grpc"}, "routes[0].protocol: Input should be 'http' or 'mcp'"),
    ],
)
def test_mcp_settings_are_validated(route: dict[str, Any], problem: str) -> None:
    spec = {"name": "m", "path_prefix": "/mcp", "upstream": "http://t/mcp", "protocol": "mcp"}
    with pytest.raises(ConfigError) as caught:
        parse_config({"routes": [{**spec, **route}]}, env={})
    assert any(p.startswith(problem) for p in caught.value.problems), caught.value.problems


def test_mcp_settings_need_protocol_mcp() -> None:
    spec = {"name": "m", "path_prefix": "/mcp", "upstream": "http://t/mcp", "mcp": {}}
    with pytest.raises(ConfigError, match="mcp: needs protocol: mcp"):
        parse_config({"routes": [spec]}, env={})


def test_sse_data_reads_message_events() -> None:
    stream = b'event: message\r\ndata: {"a":\r\ndata: 1}\r\n\r\n: ping\n\nevent: other\ndata: x\n\n'
    assert list(mcp.sse_data(stream)) == [b'{"a":\n1}']


class _Answer(UpstreamResponse):
    """An MCP server's HTTP answer, already read."""

    def __init__(self, status: int, body: bytes = b"{}") -> None:
        super().__init__(status, [(b"content-type", b"application/json")], len(body))
        self.body = body

    async def read(self) -> bytes:
        return self.body

    async def stream(self) -> AsyncIterator[bytes]:
        yield self.body


@pytest.mark.parametrize("status", [500, 502, 504, 409])
def test_an_http_error_after_the_call_was_sent_is_an_unknown_outcome(status: int) -> None:
    """A gateway's 502/504 or a server's 500 can come after the tool ran: the key is not
    released (it is recorded FAILED), so a retry never runs the tool a second time."""
    with pytest.raises(OutcomeUnknown):
        asyncio.run(mcp.read_answer(_Answer(status), 1, mcp.TRANSPORT_REFUSALS))


@pytest.mark.parametrize("status", [400, 404, 406, 429])
def test_a_transport_refusal_or_release_status_releases_the_key(status: int) -> None:
    not_run = mcp.TRANSPORT_REFUSALS | {429}
    with pytest.raises(McpRefused):
        asyncio.run(mcp.read_answer(_Answer(status), 1, not_run))


def test_reconcile_is_refused_on_mcp_routes() -> None:
    spec = {
        "name": "m",
        "path_prefix": "/mcp",
        "upstream": "http://t/mcp",
        "protocol": "mcp",
        "idempotency": {},
        "reconcile": {"path": "/c/{key}"},
    }
    with pytest.raises(ConfigError, match="reconcile: not on protocol: mcp"):
        parse_config({"routes": [spec]}, env={})


# -- route policies keyed per tool ------------------------------------------------------


def test_a_rate_limit_keyed_by_tool_name_limits_each_tool_on_its_own(
    make_proxy: ProxyFactory, mcp_tool: McpTool
) -> None:
    """``key: json:/params/name``: one bucket per tool. ``charge`` (guarded) runs out and
    is refused as a JSON-RPC error, its key released; ``balance`` (unguarded) still has
    its own room, then runs out too."""
    spec = mcp_route(mcp_tool.url, guard=["charge"])
    spec["limits"] = [{"name": "per-tool", "key": "json:/params/name", "rate": "2/1h"}]
    proxy = make_proxy(spec)
    who = account()

    async def scenario() -> tuple[McpError, list[str], McpError]:
        async with session(proxy.url + "/mcp") as client:
            for cents in (1, 2):
                arguments = {"account": who, "cents": cents}
                await client.call_tool(
                    "charge", arguments, meta={"idempotencyKey": new_key(arguments)}
                )
            arguments = {"account": who, "cents": 3}
            with pytest.raises(McpError) as limited:
                await client.call_tool(
                    "charge", arguments, meta={"idempotencyKey": new_key(arguments)}
                )
            balances = [text(await client.call_tool("balance", {"account": who})) for _ in "ab"]
            with pytest.raises(McpError) as read_limited:
                await client.call_tool("balance", {"account": who})
            return limited.value, balances, read_limited.value

    limited, balances, read_limited = asyncio.run(scenario())
    assert mcp_tool.executions[who] == 2
    assert balances == [f"{who}: 2 charges"] * 2
    assert mcp_tool.executions[f"balance:{who}"] == 2
    for refused in (limited, read_limited):
        assert refused.error.code == mcp.REFUSED
        assert isinstance(refused.error.data, dict)
        assert refused.error.data["type"] == "urn:tool-proxy:problem:rate-limited"
        assert refused.error.data["retry_after"] > 0
        assert "limit per-tool of route billing has no room" in refused.error.message


def test_a_rate_limit_keyed_by_an_argument_counts_per_value(
    make_proxy: ProxyFactory, mcp_tool: McpTool
) -> None:
    spec = mcp_route(mcp_tool.url)
    spec["limits"] = [
        {"name": "per-account", "key": "json:/params/arguments/account", "rate": "1/1h"}
    ]
    proxy = make_proxy(spec)
    first, second = account(), account()

    async def scenario() -> list[str | int]:
        async with session(proxy.url + "/mcp") as client:
            seen: list[str | int] = []
            for who in (first, second, first):
                arguments = {"account": who, "cents": 1}
                meta = {"idempotencyKey": new_key(arguments)}
                try:
                    seen.append(text(await client.call_tool("charge", arguments, meta=meta)))
                except McpError as exc:
                    seen.append(exc.error.code)
            return seen

    assert asyncio.run(scenario()) == [
        f"charged 1 to {first} (#1)",
        f"charged 1 to {second} (#1)",
        mcp.REFUSED,
    ]


def test_a_lock_keyed_by_an_argument_runs_calls_on_one_account_one_at_a_time(
    make_proxy: ProxyFactory, mcp_tool: McpTool
) -> None:
    """``lock.key: json:/params/arguments/account``: concurrent transfers of one account
    from three sessions never overlap at the tool, each with a larger fencing token."""
    spec = mcp_route(mcp_tool.url)
    spec["lock"] = {"key": "json:/params/arguments/account", "ttl": "5s", "wait": "10s"}
    proxy = make_proxy(spec)
    who = account()
    before = len(mcp_tool.fencing)

    async def transfer(cents: int) -> str:
        arguments = {"account": who, "cents": cents, "delay": 0.1}
        async with session(proxy.url + "/mcp") as client:
            meta = {"idempotencyKey": new_key(arguments)}
            return text(await client.call_tool("transfer", arguments, meta=meta))

    async def scenario() -> list[str]:
        return list(await asyncio.gather(*(transfer(cents) for cents in (1, 2, 3))))

    assert sorted(asyncio.run(scenario())) == [f"moved {c} from {who}" for c in (1, 2, 3)]
    assert mcp_tool.executions[f"transfer:{who}"] == 3
    assert mcp_tool.overlap[who] == 1
    tokens = [int(token) for token in mcp_tool.fencing[before:]]
    assert tokens == sorted(tokens) and len(set(tokens)) == 3


def test_a_lock_key_missing_from_the_arguments_is_refused_before_the_call(
    make_proxy: ProxyFactory, mcp_tool: McpTool
) -> None:
    spec = mcp_route(mcp_tool.url)
    spec["lock"] = {"key": "json:/params/arguments/account"}
    proxy = make_proxy(spec)
    with httpx.Client(timeout=10) as http:
        raw = RawSession(http, proxy.url + "/mcp", "application/json, text/event-stream").open()
        arguments = {"cents": 1}
        call = {
            "name": "charge",
            "arguments": arguments,
            "_meta": {"idempotencyKey": new_key(arguments)},
        }
        answer = raw.post({"jsonrpc": "2.0", "id": 5, "method": "tools/call", "params": call})
    error = message_of(answer)["error"]
    assert answer.status_code == 200 and message_of(answer)["id"] == 5
    assert error["code"] == mcp.REFUSED
    assert error["data"]["type"] == "urn:tool-proxy:problem:resource-key-missing"
    assert "JSON member /params/arguments/account" in error["data"]["detail"]


# -- protocol versions ------------------------------------------------------------------


@pytest.mark.parametrize("version", ["2025-06-18", "2025-11-25", None])
def test_a_guarded_call_of_a_supported_revision_is_guarded(
    make_proxy: ProxyFactory, mcp_tool: McpTool, version: str | None
) -> None:
    """Without the header the transport spec's assumption (2025-03-26) holds: guarded."""
    proxy = through(make_proxy, mcp_tool)
    who = account()
    arguments = {"account": who, "cents": 4}
    call = {
        "name": "charge",
        "arguments": arguments,
        "_meta": {"idempotencyKey": new_key(arguments)},
    }
    with httpx.Client(timeout=10) as http:
        raw = RawSession(http, proxy.url + "/mcp", "application/json, text/event-stream").open()
        if version is None:
            del raw.headers["MCP-Protocol-Version"]
        else:
            raw.headers["MCP-Protocol-Version"] = version
        answers = [
            raw.post({"jsonrpc": "2.0", "id": n, "method": "tools/call", "params": call})
            for n in (1, 2)
        ]
    assert [a.status_code for a in answers] == [200, 200]
    assert answers[1].headers["idempotent-replayed"] == "true"
    assert message_of(answers[1])["result"] == message_of(answers[0])["result"]
    assert mcp_tool.executions[who] == 1


@pytest.mark.parametrize("version", ["1999-01-01", "2024-11-05", "2099-12-31", "latest"])
def test_an_unsupported_revision_is_refused_with_400_and_nothing_sent(
    make_proxy: ProxyFactory, mcp_tool: McpTool, version: str
) -> None:
    proxy = through(make_proxy, mcp_tool)
    who = account()
    arguments = {"account": who, "cents": 4}
    call = {
        "name": "charge",
        "arguments": arguments,
        "_meta": {"idempotencyKey": new_key(arguments)},
    }
    with httpx.Client(timeout=10) as http:
        raw = RawSession(http, proxy.url + "/mcp", "application/json, text/event-stream").open()
        answer = raw.post(
            {"jsonrpc": "2.0", "id": 8, "method": "tools/call", "params": call},
            **{"MCP-Protocol-Version": version},
        )
        raw.headers["MCP-Protocol-Version"] = "2025-11-25"
        listed = raw.post({"jsonrpc": "2.0", "id": 9, "method": "tools/list"})
        retried = raw.post({"jsonrpc": "2.0", "id": 10, "method": "tools/call", "params": call})
    assert answer.status_code == 400
    assert answer.headers["content-type"] == "application/json"
    message = answer.json()
    assert message["id"] == 8 and message["error"]["code"] == mcp.UNSUPPORTED_PROTOCOL_VERSION
    assert f"Unsupported protocol version '{version}'" in message["error"]["message"]
    assert message["error"]["data"] == {
        "supported": ["2025-03-26", "2025-06-18", "2025-11-25", "2026-07-28"],
        "requested": version,
    }
    assert listed.status_code == 200
    assert "idempotent-replayed" not in retried.headers  # nothing was claimed
    assert mcp_tool.executions[who] == 1


@pytest.mark.parametrize(
    ("header", "declared", "code"),
    [
        ("2026-07-28", "2025-11-25", mcp.HEADER_MISMATCH),
        (None, "2099-01-01", mcp.UNSUPPORTED_PROTOCOL_VERSION),
        ("2026-07-28", "2099-01-01", mcp.HEADER_MISMATCH),
        ("2025-06-18", [1], mcp.UNSUPPORTED_PROTOCOL_VERSION),
        ("2025-06-18", {"a": 1}, mcp.UNSUPPORTED_PROTOCOL_VERSION),
        (None, [1], mcp.UNSUPPORTED_PROTOCOL_VERSION),
    ],
)
def test_a_revision_stated_in_the_request_must_be_supported_and_match_the_header(
    make_proxy: ProxyFactory, mcp_tool: McpTool, header: str | None, declared: object, code: int
) -> None:
    """2026-07-28 requests state their revision in params._meta too; one that is not a
    string (a list, an object) is an unsupported revision, not a 500."""
    proxy = through(make_proxy, mcp_tool)
    who = account()
    arguments = {"account": who, "cents": 4}
    meta = {"idempotencyKey": new_key(arguments), mcp.VERSION_META: declared}
    call = {"name": "charge", "arguments": arguments, "_meta": meta}
    with httpx.Client(timeout=10) as http:
        raw = RawSession(http, proxy.url + "/mcp", "application/json, text/event-stream").open()
        del raw.headers["MCP-Protocol-Version"]
        extra = {} if header is None else {"MCP-Protocol-Version": header}
        answer = raw.post(
            {"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": call}, **extra
        )
    assert answer.status_code == 400
    assert answer.json()["id"] == 3
    assert answer.json()["error"]["code"] == code
    assert mcp_tool.executions[who] == 0


@pytest.mark.parametrize(
    ("headers", "refused"),
    [
        ({"Mcp-Method": "tools/list"}, True),
        ({"Mcp-Method": "tools/call", "Mcp-Name": "refund"}, True),
        ({"Mcp-Name": "=?base64?not base64?="}, True),
        ({"Mcp-Method": "tools/call", "Mcp-Name": "=?base64?Y2hhcmdl?="}, False),  # "charge"
    ],
)
def test_routing_headers_that_disagree_with_the_body_are_refused_before_the_claim(
    make_proxy: ProxyFactory, mcp_tool: McpTool, headers: dict[str, str], refused: bool
) -> None:
    """2026-07-28's Mcp-Method and Mcp-Name: the proxy guards by the body, so a guarded
    call whose headers name another method or tool is refused (400, -32020), nothing
    claimed or sent; headers that agree (base64 form decoded) pass."""
    proxy = through(make_proxy, mcp_tool)
    who = account()
    arguments = {"account": who, "cents": 3}
    call = {
        "name": "charge",
        "arguments": arguments,
        "_meta": {"idempotencyKey": new_key(arguments)},
    }
    with httpx.Client(timeout=10) as http:
        raw = RawSession(http, proxy.url + "/mcp", "application/json, text/event-stream").open()
        answer = raw.post(
            {"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": call}, **headers
        )
        again = raw.post({"jsonrpc": "2.0", "id": 4, "method": "tools/call", "params": call})
    if refused:
        assert answer.status_code == 400
        assert answer.json()["error"]["code"] == mcp.HEADER_MISMATCH
        assert "idempotent-replayed" not in again.headers  # nothing was claimed: it runs
    else:
        assert "result" in message_of(answer)
        assert again.headers["idempotent-replayed"] == "true"
    assert mcp_tool.executions[who] == 1


def test_the_newest_revision_passes_the_proxy_and_the_server_answers_it(
    make_proxy: ProxyFactory, mcp_tool: McpTool
) -> None:
    """2026-07-28 is accepted by the proxy; this SDK's server does not speak it and
    refuses the POST (400) before any tool runs: the key is released."""
    proxy = through(make_proxy, mcp_tool)
    who = account()
    arguments = {"account": who, "cents": 4}
    call = {
        "name": "charge",
        "arguments": arguments,
        "_meta": {"idempotencyKey": new_key(arguments)},
    }
    with httpx.Client(timeout=10) as http:
        raw = RawSession(http, proxy.url + "/mcp", "application/json, text/event-stream").open()
        newest = raw.post(
            {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": call},
            **{"MCP-Protocol-Version": "2026-07-28"},
        )
        again = raw.post({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": call})
    assert newest.status_code == 400
    assert "Unsupported protocol version: 2026-07-28" in newest.json()["error"]["message"]
    assert again.status_code == 200 and "idempotent-replayed" not in again.headers
    assert mcp_tool.executions[who] == 1


def test_an_unguarded_call_keeps_its_revision_to_the_server(
    make_proxy: ProxyFactory, mcp_tool: McpTool
) -> None:
    """Only guarded calls are checked: the rest is the server's to answer."""
    proxy = through(make_proxy, mcp_tool, guard=["refund"])
    with httpx.Client(timeout=10) as http:
        raw = RawSession(http, proxy.url + "/mcp", "application/json, text/event-stream").open()
        answer = raw.post(
            {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
             "params": {"name": "balance", "arguments": {"account": "x"}}},
            **{"MCP-Protocol-Version": "1999-01-01"},
        )  # fmt: skip
    assert answer.status_code == 400
    assert "Unsupported protocol version: 1999-01-01" in answer.json()["error"]["message"]


# -- the bound on an answer read whole --------------------------------------------------


def bounded_route(upstream: str, bound: int, **idempotency: Any) -> dict[str, Any]:
    spec = mcp_route(upstream, **idempotency)
    spec["mcp"]["max_answer_bytes"] = bound
    return spec


@pytest.mark.parametrize("limit", ["max_answer_bytes", "max_stored_bytes"])
def test_an_answer_past_the_bound_is_executed_once_and_not_kept(
    make_proxy: ProxyFactory, mcp_tool: McpTool, limit: str
) -> None:
    """Past ``mcp.max_answer_bytes`` (or, without offload, what the route can record) the
    answer is dropped as it is read: the first caller and every retry get -32016, and the
    tool ran once."""
    if limit == "max_answer_bytes":
        proxy = make_proxy(bounded_route(mcp_tool.url, 4096))
    else:
        proxy = make_proxy(mcp_route(mcp_tool.url, max_stored_bytes=4096))
    who = account()
    arguments = {"account": who, "size": 200_000}
    meta = {"idempotencyKey": new_key(arguments)}

    async def scenario() -> list[McpError]:
        async with session(proxy.url + "/mcp") as client:
            errors = []
            for _ in "ab":
                with pytest.raises(McpError) as not_kept:
                    await client.call_tool("report", arguments, meta=meta)
                errors.append(not_kept.value)
            return errors

    first, again = asyncio.run(scenario())
    assert first.error.code == again.error.code == mcp.RESULT_NOT_KEPT
    assert first.error.message.startswith(
        "The tool call was executed once, but its result was not kept"
    )
    assert "passed 4096 bytes" in first.error.message
    assert "will not be run again under this key" in again.error.message
    assert isinstance(again.error.data, dict)
    assert again.error.data["type"] == "urn:tool-proxy:problem:response-not-stored"
    assert mcp_tool.executions[f"report:{who}"] == 1


def test_progress_does_not_count_towards_the_bound(
    make_proxy: ProxyFactory, mcp_tool: McpTool
) -> None:
    """SSE events are parsed as they arrive and progress is dropped: 40 KB of progress
    then a short result pass a 4 KiB bound."""
    proxy = make_proxy(bounded_route(mcp_tool.url, 4096))
    who = account()
    arguments = {"account": who, "notes": 40}
    meta = {"idempotencyKey": new_key(arguments)}

    async def scenario() -> list[str]:
        async with session(proxy.url + "/mcp") as client:
            return [text(await client.call_tool("chatty", arguments, meta=meta)) for _ in "ab"]

    assert asyncio.run(scenario()) == [f"told {who}"] * 2
    assert mcp_tool.executions[f"chatty:{who}"] == 1


class _Chunks(UpstreamResponse):
    """An MCP server's SSE answer arriving in the given chunks; counts those read."""

    def __init__(self, *chunks: bytes) -> None:
        super().__init__(200, [(b"content-type", b"text/event-stream")], None)
        self.chunks = chunks
        self.read_chunks = 0
        self.closed = False

    async def stream(self) -> AsyncIterator[bytes]:
        try:
            for chunk in self.chunks:
                self.read_chunks += 1
                yield chunk
        finally:
            self.closed = True


def _event(message: dict[str, Any]) -> bytes:
    return b"event: message\r\ndata: " + json.dumps(message).encode() + b"\r\n\r\n"


def test_an_sse_answer_is_parsed_across_chunks_and_crlf() -> None:
    params = {"progressToken": 1, "progress": 1, "message": "result"}
    progress = _event({"jsonrpc": "2.0", "method": "notifications/progress", "params": params})
    final = _event({"jsonrpc": "2.0", "id": 7, "result": {"content": []}})
    stream = progress * 3 + final
    chunks = [stream[i : i + 5] for i in range(0, len(stream), 5)]  # CR and LF split apart
    bound = len(progress)  # an event is held until it is whole; the largest is progress
    answer = asyncio.run(mcp.read_answer(_Chunks(*chunks), 7, bound=bound))
    assert json.loads(asyncio.run(answer.read())) == {
        "jsonrpc": "2.0",
        "id": 7,
        "result": {"content": []},
    }


def test_an_answer_declared_past_the_bound_is_not_read_and_its_connection_freed() -> None:
    answer = _Chunks(b"x" * 1000, b"x" * 1000)
    answer.headers, answer.length = [(b"content-type", b"application/json")], 2000
    kept = asyncio.run(mcp.read_answer(answer, 7, bound=1500))
    assert isinstance(kept, mcp.NotKept)
    assert answer.read_chunks == 1 and answer.closed


def test_reading_stops_at_the_bound() -> None:
    huge = _Chunks(b"event: message\ndata: {", *([b"x" * 1000] * 100), b"}\n\n")
    answer = asyncio.run(mcp.read_answer(huge, 7, bound=10_000))
    assert isinstance(answer, mcp.NotKept)
    assert huge.read_chunks == 11 and huge.closed  # the rest is never read
    with pytest.raises(ResponseNotStored, match="passed 10000 bytes"):
        asyncio.run(answer.read())


# -- authentication, downstream tokens, offload -----------------------------------------


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_callers_are_authenticated_and_records_scoped_by_principal(
    make_proxy: ProxyFactory, mcp_tool: McpTool, idp: IdentityProvider
) -> None:
    """One key from alice twice: one execution, replayed (with a new token too); from bob:
    his own execution. Without a token: 401 before any JSON-RPC is read."""
    spec = {**mcp_route(mcp_tool.url), "auth": {"required": True}}
    proxy = make_proxy(spec, auth=auth_config(idp))
    who = account()
    arguments = {"account": who, "cents": 9}
    meta = {"idempotencyKey": new_key(arguments)}

    async def call(user: str) -> str:
        async with session(proxy.url + "/mcp", bearer(idp.token(user))) as client:
            return text(await client.call_tool("charge", arguments, meta=meta))

    async def scenario() -> list[str]:
        return [await call(user) for user in ("alice", "alice", "bob")]

    alice, alice_again, bob = asyncio.run(scenario())
    assert alice == alice_again == f"charged 9 to {who} (#1)"
    assert bob == f"charged 9 to {who} (#2)"
    assert mcp_tool.executions[who] == 2
    anonymous = httpx.post(
        proxy.url + "/mcp",
        json={"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "charge"}},
        headers={"Accept": "application/json, text/event-stream"},
    )
    assert anonymous.status_code == 401
    assert anonymous.headers["content-type"] == "application/problem+json"
    assert mcp_tool.executions[who] == 2


def test_downstream_tokens_are_exchanged_per_caller(
    make_proxy: ProxyFactory,
    mcp_tool: McpTool,
    idp: IdentityProvider,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``token: token_exchange``: the MCP server gets the proxy's token for each caller,
    on the session's requests and on the guarded call (fetched once per caller); a
    replay is alice's own answer."""
    monkeypatch.setenv(SECRET_ENV, idp.client_secret)
    spec = {**mcp_route(mcp_tool.url), "auth": {"required": True}}
    spec["token"] = {
        "mode": "token_exchange",
        "token_endpoint": f"{idp.url}/token",
        "client_id": "tool-proxy",
        "client_secret_env": SECRET_ENV,
        "audience": "billing-mcp",
    }
    proxy = make_proxy(spec, auth=auth_section(idp))
    who = account()
    meta = {"idempotencyKey": new_key({"account": who})}

    async def call(user: str) -> str:
        async with session(proxy.url + "/mcp", bearer(idp.token(user))) as client:
            return text(await client.call_tool("whoami", {"account": who}, meta=meta))

    async def scenario() -> list[str]:
        return [await call(user) for user in ("alice", "alice", "bob")]

    assert asyncio.run(scenario()) == ["Bearer dt-1-alice", "Bearer dt-1-alice", "Bearer dt-2-bob"]
    assert mcp_tool.executions[f"whoami:{who}"] == 2
    assert len(idp.grants) == 2
    assert idp.grants[0]["grant_type"] == "urn:ietf:params:oauth:grant-type:token-exchange"


def test_a_large_result_is_offloaded_to_s3_and_replayed_from_it(
    make_proxy: ProxyFactory, mcp_tool: McpTool, s3: S3
) -> None:
    proxy = make_proxy(mcp_route(mcp_tool.url), offload=s3_offload(s3, threshold=1024))
    who = account()
    arguments = {"account": who, "size": 300_000}
    meta = {"idempotencyKey": new_key(arguments)}

    async def scenario() -> list[str]:
        async with session(proxy.url + "/mcp") as client:
            return [text(await client.call_tool("report", arguments, meta=meta)) for _ in "ab"]

    first, again = asyncio.run(scenario())
    assert first == again == "r" * 300_000
    assert mcp_tool.executions[f"report:{who}"] == 1
    [stored] = s3.keys()
    body = s3.client().get_object(Bucket=BUCKET, Key=stored)["Body"].read()
    assert json.loads(body)["result"]["content"][0]["text"] == first  # the JSON-RPC response


def test_offload_lifts_the_stores_bound_but_not_max_answer_bytes(
    make_proxy: ProxyFactory, mcp_tool: McpTool, s3: S3
) -> None:
    spec = bounded_route(mcp_tool.url, 100_000, max_stored_bytes=1000)
    proxy = make_proxy(spec, offload=s3_offload(s3, threshold=1024))
    who = account()

    async def scenario() -> tuple[str, McpError]:
        async with session(proxy.url + "/mcp") as client:
            fits = {"account": who, "size": 20_000}
            kept = await client.call_tool("report", fits, meta={"idempotencyKey": new_key(fits)})
            huge = {"account": who, "size": 200_000}
            with pytest.raises(McpError) as not_kept:
                await client.call_tool("report", huge, meta={"idempotencyKey": new_key(huge)})
            return text(kept), not_kept.value

    kept, not_kept = asyncio.run(scenario())
    assert kept == "r" * 20_000
    assert not_kept.error.code == mcp.RESULT_NOT_KEPT
    assert mcp_tool.executions[f"report:{who}"] == 2


def test_versioned_writes_keyed_by_an_argument_refuse_a_stale_if_match(
    make_proxy: ProxyFactory, mcp_tool: McpTool
) -> None:
    """``versioning.key: json:/params/arguments/account``: each tools/call is a write; two
    calls with the same precondition (the account never written): the first runs (its
    ETag), the second gets 412 as its JSON-RPC error, nothing sent. (HTTP headers: MCP
    clients rarely set them per call.)"""
    spec = mcp_route(mcp_tool.url)
    spec["versioning"] = {"key": "json:/params/arguments/account"}
    proxy = make_proxy(spec)
    who = account()
    with httpx.Client(timeout=10) as http:
        raw = RawSession(http, proxy.url + "/mcp", "application/json, text/event-stream").open()
        answers = []
        for cents in (1, 2):
            arguments = {"account": who, "cents": cents}
            call = {"name": "transfer", "arguments": arguments,
                    "_meta": {"idempotencyKey": new_key(arguments)}}  # fmt: skip
            message = {"jsonrpc": "2.0", "id": cents, "method": "tools/call", "params": call}
            answers.append(raw.post(message, **{"If-None-Match": "*"}))
    first, stale = answers
    assert first.headers["etag"] == '"2"'  # 1: the fresh version it was checked against
    assert message_of(first)["result"]["content"][0]["text"] == f"moved 1 from {who}"
    error = message_of(stale)["error"]
    assert error["code"] == mcp.REFUSED
    assert error["data"]["type"] == "urn:tool-proxy:problem:precondition-failed"
    assert stale.headers["etag"] == '"2"'
    assert mcp_tool.executions[f"transfer:{who}"] == 1


def test_an_input_required_result_is_not_the_calls_outcome() -> None:
    """2026-07-28: a server that needs input answers ``resultType: input_required``; the
    client sends the call again with ``inputResponses``: the key is released for it."""
    result = {"resultType": "input_required", "requestState": "s1", "inputRequests": {}}
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "result": result}).encode()
    with pytest.raises(McpRefused) as released:
        asyncio.run(mcp.read_answer(_Answer(200, body), 1))
    assert json.loads(released.value.answer.body)["result"] == result
    done = json.dumps({"jsonrpc": "2.0", "id": 1, "result": {"content": []}}).encode()
    assert isinstance(asyncio.run(mcp.read_answer(_Answer(200, done), 1)), mcp.ReadAnswer)


def test_a_slow_first_caller_loses_progress_past_the_held_events_never_requests() -> None:
    async def scenario() -> list[bytes]:
        progress = mcp.Progress()

        async def attempt() -> mcp.Attempt:
            return OutcomeUnknown("the upstream did not answer in time", status=504)

        run = asyncio.get_running_loop().create_task(attempt())
        note = b'{"jsonrpc":"2.0","method":"notifications/progress","params":{}}'
        for _ in range(mcp.MAX_HELD_EVENTS + 10):
            progress.event(note)
        progress.event(b'{"jsonrpc":"2.0","id":9,"method":"elicitation/create"}')
        await run
        response = progress.response(run, 7, "text/event-stream", "s-1", "key")
        assert isinstance(response, StreamingResponse)
        return [bytes(chunk) async for chunk in response.body_iterator]  # type: ignore[arg-type]

    frames = asyncio.run(scenario())
    assert len(frames) == mcp.MAX_HELD_EVENTS + 2
    assert b"elicitation/create" in frames[-2]
    final = json.loads(frames[-1].removeprefix(b"event: message\ndata: "))
    assert final["id"] == 7 and final["error"]["code"] == mcp.OUTCOME_UNKNOWN


async def _held_frames(messages: list[bytes]) -> tuple[list[bytes], mcp.Progress]:
    """The frames a first caller gets that starts reading only after ``messages`` (and
    the call's end)."""
    progress = mcp.Progress()

    async def attempt() -> mcp.Attempt:
        return OutcomeUnknown("the upstream did not answer in time", status=504)

    run = asyncio.get_running_loop().create_task(attempt())
    for message in messages:
        progress.event(message)
    await run
    response = progress.response(run, 7, "text/event-stream", "s-1", "key")
    assert isinstance(response, StreamingResponse)
    return [bytes(chunk) async for chunk in response.body_iterator], progress  # type: ignore[arg-type]


def _final(frames: list[bytes]) -> Any:
    return json.loads(frames[-1].removeprefix(b"event: message\ndata: "))


@pytest.mark.parametrize(
    ("count", "size"), [(mcp.MAX_HELD_MESSAGES + 1, 10), (9, mcp.MAX_HELD_BYTES // 8)]
)
def test_a_first_caller_too_far_behind_is_cut_off_past_the_held_bounds(
    count: int, size: int
) -> None:
    """Log lines and requests of the server are held for a slow caller up to
    MAX_HELD_MESSAGES and MAX_HELD_BYTES; past them its stream is cut off (nothing more
    is held) and ends with "in progress": the same call under the same key gets the
    result."""
    log = b'{"jsonrpc":"2.0","method":"notifications/message","params":{"data":"%s"}}'
    frames, progress = asyncio.run(_held_frames([log % (b"x" * size)] * count))
    assert len(frames) == 1
    final = _final(frames)
    assert final["id"] == 7 and final["error"]["code"] == mcp.IN_PROGRESS
    assert "fell too far behind" in final["error"]["data"]["detail"]
    progress.event(log % b"late")  # after the cut: dropped, never held
    assert progress.held == 0


def test_progress_past_the_held_bytes_is_dropped_without_a_cut() -> None:
    note = b'{"jsonrpc":"2.0","method":"notifications/progress","params":{"m":"%s"}}'
    frames, _ = asyncio.run(_held_frames([note % (b"p" * (mcp.MAX_HELD_BYTES // 4))] * 6))
    assert len(frames) == 4  # three held, then the result
    assert _final(frames)["error"]["code"] == mcp.OUTCOME_UNKNOWN


def test_a_first_caller_that_leaves_its_stream_does_not_stop_the_call(
    make_proxy: ProxyFactory, mcp_tool: McpTool
) -> None:
    """The SSE answer has started (its headers reached the caller), the caller goes away:
    the call runs on and is recorded, and the retry gets its result."""
    if mcp_tool.json_response:
        pytest.skip("a stream needs an SSE answer")
    proxy = through(make_proxy, mcp_tool)
    who = account()
    arguments = {"account": who, "cents": 6, "hold": True}
    call = {
        "name": "charge",
        "arguments": arguments,
        "_meta": {"idempotencyKey": new_key(arguments)},
    }
    with httpx.Client(timeout=10) as http:
        raw = RawSession(http, proxy.url + "/mcp", "application/json, text/event-stream").open()
        message = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": call}
        with mcp_tool.holding():
            headers = {**raw.headers}
            with http.stream("POST", raw.url, json=message, headers=headers) as streamed:
                assert streamed.status_code == 200
                assert streamed.headers["content-type"] == "text/event-stream"
        assert mcp_tool.finished[who].wait(10)
        again = {**message, "id": 2}
        answers = [raw.post(again)]
        for _ in range(200):  # recorded a moment after the tool answered
            if message_of(answers[-1]).get("error", {}).get("code") != mcp.IN_PROGRESS:
                break
            answers.append(raw.post(again))
    assert answers[-1].headers["idempotent-replayed"] == "true"
    assert message_of(answers[-1])["result"]["content"][0]["text"] == f"charged 6 to {who} (#1)"
    assert mcp_tool.executions[who] == 1
