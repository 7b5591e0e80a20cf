"""MCP routes with ``async``: slow guarded calls answered as tasks made by the proxy, run
once on the route's workers; followed by clients that do not ask for a task. The SDK 1.x
client (its experimental tasks) on one side, a FastMCP server without tasks on the other."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from mcp import ClientSession, types
from mcp.shared.exceptions import McpError

from proxy import mcp, mcp_tasks, mcp_tools
from proxy.store import RecordKey
from proxy.store.memory import MemoryStore
from tests.conftest import SEALING_ENV, ProxyFactory, new_key
from tests.idp import IdentityProvider
from tests.mcp_servers import McpTool, RawSession, message_of, session
from tests.servers import ProxyProcess, RedisServer, ThreadServer, wait_for
from tests.test_auth import auth_config
from tests.test_mcp import account, bearer, mcp_route, text

# The SDK 1.x client's tasks API (tasks left the core spec for an extension in 2026-07-28)
pytestmark = pytest.mark.filterwarnings("ignore:The experimental tasks API:DeprecationWarning")


@pytest.fixture(scope="module", params=["json", "sse"])
def mcp_tool(request: pytest.FixtureRequest) -> Iterator[McpTool]:
    tool = McpTool(json_response=request.param == "json").start()
    yield tool
    tool.stop()


def tasks_route(upstream: str, **async_: Any) -> dict[str, Any]:
    spec = mcp_route(upstream)
    spec["workers"] = {"concurrency": 1}
    spec["async"] = {"visibility": "1s", "backoff": "50ms", "backoff_max": "100ms", **async_}
    return spec


def through(make_proxy: ProxyFactory, tool: McpTool, **async_: Any) -> ThreadServer:
    return make_proxy(tasks_route(tool.url, **async_))


async def until_ended(client: ClientSession, task_id: str) -> types.GetTaskResult:
    async for status in client.experimental.poll_task(task_id):
        if status.status != "working":
            return status
    raise AssertionError("poll_task ended without a status")


def test_a_task_augmented_call_is_the_proxys_task_run_once(
    make_proxy: ProxyFactory, mcp_tool: McpTool
) -> None:
    proxy = through(make_proxy, mcp_tool)
    who = account()
    arguments = {"account": who}
    meta = {"idempotencyKey": new_key(arguments)}

    async def scenario() -> tuple[Any, ...]:
        async with session(proxy.url + "/mcp") as client:
            tasks = client.experimental
            with mcp_tool.holding():
                created = await tasks.call_tool_as_task("deploy", arguments, meta=meta)
                again = await tasks.call_tool_as_task("deploy", arguments, meta=meta)
                working = await tasks.get_task(created.task.taskId)
                listed = await tasks.list_tasks()
            ended = await until_ended(client, created.task.taskId)
            result = await tasks.get_task_result(created.task.taskId, types.CallToolResult)
            after = await tasks.call_tool_as_task("deploy", arguments, meta=meta)
            plain = await client.call_tool("deploy", arguments, meta=meta)  # a replay
            capabilities = client.get_server_capabilities()
            return created, again, working, listed, ended, result, after, plain, capabilities

    created, again, working, listed, ended, result, after, plain, capabilities = asyncio.run(
        scenario()
    )
    assert capabilities is not None and capabilities.tasks is not None  # the proxy's, added
    assert capabilities.tasks.requests and capabilities.tasks.requests.tools
    assert capabilities.tasks.requests.tools.call is not None
    assert capabilities.tools is not None  # the server's own, kept
    task_id = created.task.taskId
    assert created.task.status == "working"
    assert created.task.ttl and created.task.pollInterval == 1000
    assert again.task.taskId == task_id and after.task.taskId == task_id
    assert working.status == "working"
    assert task_id in [task.taskId for task in listed.tasks]
    assert ended.status == "completed"
    assert after.task.status == "completed"
    assert text(result) == f"deployed {who} (#1)"
    assert result.meta == {mcp_tasks.RELATED_TASK: {"taskId": task_id}}
    assert text(plain) == f"deployed {who} (#1)"
    assert mcp_tool.executions[f"deploy:{who}"] == 1


def test_a_failed_tool_is_a_failed_task_and_its_result_the_error(
    make_proxy: ProxyFactory, mcp_tool: McpTool
) -> None:
    proxy = through(make_proxy, mcp_tool)
    who = account()
    meta = {"idempotencyKey": new_key({"account": who})}

    async def scenario() -> tuple[Any, Any]:
        async with session(proxy.url + "/mcp") as client:
            tasks = client.experimental
            created = await tasks.call_tool_as_task("refund", {"account": who}, meta=meta)
            ended = await until_ended(client, created.task.taskId)
            result = await tasks.get_task_result(created.task.taskId, types.CallToolResult)
            return ended, result

    ended, result = asyncio.run(scenario())
    assert ended.status == "failed"
    assert result.isError and "refund #1 refused" in text(result)
    assert mcp_tool.executions[f"refund:{who}"] == 1


def test_a_queued_task_is_cancelled_a_sent_one_is_not(
    make_proxy: ProxyFactory, mcp_tool: McpTool
) -> None:
    proxy = through(make_proxy, mcp_tool)  # one worker: the second task waits
    first, second = account(), account()

    async def scenario() -> tuple[Any, ...]:
        async with session(proxy.url + "/mcp") as client:
            tasks = client.experimental
            with mcp_tool.holding():
                running = await tasks.call_tool_as_task(
                    "deploy",
                    {"account": first},
                    meta={"idempotencyKey": new_key({"account": first})},
                )
                queued = await tasks.call_tool_as_task(
                    "deploy",
                    {"account": second},
                    meta={"idempotencyKey": new_key({"account": second})},
                )
                await asyncio.sleep(0.5)  # the one worker has sent the first
                cancelled = await tasks.cancel_task(queued.task.taskId)
                with pytest.raises(McpError) as not_cancelled:
                    await tasks.cancel_task(running.task.taskId)
            await until_ended(client, running.task.taskId)
            with pytest.raises(McpError) as ended:
                await tasks.cancel_task(running.task.taskId)
            with pytest.raises(McpError) as result:
                await tasks.get_task_result(queued.task.taskId, types.CallToolResult)
            return cancelled, not_cancelled.value, ended.value, result.value

    cancelled, not_cancelled, ended, result = asyncio.run(scenario())
    assert cancelled.status == "cancelled"
    assert not_cancelled.error.code == mcp.REFUSED
    assert ended.error.code == types.INVALID_PARAMS
    assert "cancelled" in result.error.message
    assert mcp_tool.executions[f"deploy:{first}"] == 1
    assert mcp_tool.executions[f"deploy:{second}"] == 0


def test_another_servers_task_id_passes_through(
    make_proxy: ProxyFactory, mcp_tool: McpTool
) -> None:
    proxy = through(make_proxy, mcp_tool)

    async def scenario(url: str) -> McpError:
        async with session(url) as client:
            with pytest.raises(McpError) as unknown:
                await client.experimental.get_task("not-a-task-of-the-proxy")
            return unknown.value

    through_proxy = asyncio.run(scenario(proxy.url + "/mcp")).error
    direct = asyncio.run(scenario(mcp_tool.url + "/mcp")).error  # the server's own answer
    assert through_proxy.code != mcp.REFUSED
    assert (through_proxy.code, through_proxy.message) == (direct.code, direct.message)


def test_a_client_without_tasks_follows_the_job_and_its_retry_the_same_job(
    make_proxy: ProxyFactory, mcp_tool: McpTool
) -> None:
    proxy = through(make_proxy, mcp_tool, mode="always")
    who = account()
    arguments = {"account": who}
    meta = {"idempotencyKey": new_key(arguments)}
    notes: list[tuple[float, str | None]] = []

    async def progress(progress: float, total: float | None, message: str | None) -> None:
        notes.append((progress, message))

    async def scenario() -> tuple[McpError, Any]:
        async with session(proxy.url + "/mcp") as client:
            with mcp_tool.holding():
                with pytest.raises(McpError) as timed_out:  # the SDK then sends a cancellation
                    await client.call_tool("deploy", arguments, timedelta(seconds=0.3), meta=meta)
                retry = asyncio.ensure_future(
                    client.call_tool("deploy", arguments, meta=meta, progress_callback=progress)
                )
                await asyncio.sleep(0.5)
                assert not retry.done()  # followed, not refused as in progress
            return timed_out.value, await retry

    timed_out, result = asyncio.run(scenario())
    assert "Timed out" in str(timed_out)
    assert text(result) == f"deployed {who} (#1)"
    assert mcp_tool.executions[f"deploy:{who}"] == 1
    if not mcp_tool.json_response:  # the tool's progress reaches the follower
        assert (1.0, "almost") in notes


def test_a_followed_call_is_kept_alive(
    make_proxy: ProxyFactory, mcp_tool: McpTool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mcp_tasks, "KEEP_ALIVE_SECONDS", 0.1)
    proxy = through(make_proxy, mcp_tool, mode="always")
    who = account()
    arguments = {"account": who}
    call = {"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {
        "name": "deploy", "arguments": arguments, "_meta": {"idempotencyKey": new_key(arguments)},
    }}  # fmt: skip
    with httpx.Client(timeout=30) as http:
        raw = RawSession(http, proxy.url + "/mcp", "application/json, text/event-stream").open()
        with (
            mcp_tool.holding(),
            http.stream("POST", raw.url, json=call, headers=raw.headers) as answer,
        ):
            lines = answer.iter_lines()
            comments = 0
            for line in lines:
                comments += line.startswith(":")
                if comments == 3:
                    break
            mcp_tool.gate.set()
            rest = list(lines)
    assert answer.headers["content-type"].startswith("text/event-stream")
    final = [line for line in rest if line.startswith("data:")][-1]
    assert f"deployed {who} (#1)" in final and '"id":7' in final.replace(" ", "")


def test_tasks_are_their_principals_own(
    make_proxy: ProxyFactory, mcp_tool: McpTool, idp: IdentityProvider
) -> None:
    spec = {**tasks_route(mcp_tool.url), "auth": {"required": True}}
    proxy = make_proxy(spec, auth=auth_config(idp))
    who = account()
    meta = {"idempotencyKey": new_key({"account": who})}

    async def scenario() -> tuple[Any, ...]:
        async with (
            session(proxy.url + "/mcp", bearer(idp.token("alice"))) as alice,
            session(proxy.url + "/mcp", bearer(idp.token("bob"))) as bob,
        ):
            created = await alice.experimental.call_tool_as_task(
                "deploy", {"account": who}, meta=meta
            )
            task_id = created.task.taskId
            with pytest.raises(McpError) as hidden:  # to bob, the proxy has no such task
                await bob.experimental.get_task(task_id)
            listed = await bob.experimental.list_tasks()
            ended = await until_ended(alice, task_id)
            return hidden.value, listed, ended, await alice.experimental.list_tasks()

    hidden, bobs, ended, alices = asyncio.run(scenario())
    assert hidden.error.code != mcp.REFUSED  # the server's answer: not one of its tasks
    assert bobs.tasks == []
    assert ended.status == "completed"
    assert [task.taskId for task in alices.tasks] == [ended.taskId]


def _task_call(id: int, who: str) -> dict[str, Any]:
    arguments = {"account": who}
    return {"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": {
        "name": "deploy", "arguments": arguments, "task": {"ttl": 60000},
        "_meta": {"idempotencyKey": new_key(arguments)},
    }}  # fmt: skip


def test_a_replica_killed_with_one_task_sent_and_one_queued(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """The queued task runs once on the next replica; the sent one is never sent again:
    ``tasks/get`` says failed, with the outcome-unknown problem document."""
    redis_server.flush()
    tool = McpTool(json_response=True).start()
    spec = {"store": {"url": redis_server.url, "sealing_key_env": SEALING_ENV}}
    spec["routes"] = [tasks_route(tool.url)]  # type: ignore[assignment]
    sent, queued = account(), account()
    a = ProxyProcess(spec, tmp_path).start()
    try:
        with tool.holding(), httpx.Client(timeout=30) as http:
            raw = RawSession(http, a.url + "/mcp", "application/json, text/event-stream")
            raw.open("2025-11-25")
            first = message_of(raw.post(_task_call(1, sent)))["result"]["task"]["taskId"]
            wait_for(lambda: tool.arrived[f"deploy:{sent}"] == 1, what="the first call sent")
            second = message_of(raw.post(_task_call(2, queued)))["result"]["task"]["taskId"]
            a.kill()  # with the first call in flight, the second queued behind it
        b = ProxyProcess(spec, tmp_path).start()

        async def scenario() -> tuple[Any, ...]:
            async with session(b.url + "/mcp") as client:
                done = await until_ended(client, second)
                result = await client.experimental.get_task_result(second, types.CallToolResult)
                failed = await until_ended(client, first)
                with pytest.raises(McpError) as unknown:
                    await client.experimental.get_task_result(first, types.CallToolResult)
                return done, result, failed, unknown.value

        try:
            done, result, failed, unknown = asyncio.run(scenario())
        finally:
            b.stop()
    finally:
        tool.stop()
    assert done.status == "completed" and text(result) == f"deployed {queued} (#1)"
    assert tool.executions[f"deploy:{queued}"] == 1
    assert failed.status == "failed"
    problem = (failed.meta or {})[mcp_tasks.PROBLEM_META]
    assert problem["type"] == "urn:tool-proxy:problem:outcome-unknown"
    assert unknown.error.code == mcp.OUTCOME_UNKNOWN
    assert tool.arrived[f"deploy:{sent}"] == 1  # never sent again


def test_progress_reaches_a_follower_on_another_replica(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """A task runs on replica a's worker; a client of replica b sends the same call with
    the same key, gives up after 0.3 s, sends it again and follows the job: the tool's
    progress reaches it through the store (the latest when it starts following, then the
    one right before the result), and the call runs once: for the client that asked for a
    task, the one that gave up and the one that waited."""
    redis_server.flush()
    tool = McpTool(json_response=False).start()  # progress comes on the SSE answer
    spec = {"store": {"url": redis_server.url, "sealing_key_env": SEALING_ENV}}
    spec["routes"] = [tasks_route(tool.url, mode="always")]  # type: ignore[assignment]
    who = account()
    arguments = {"account": who}
    meta = {"idempotencyKey": new_key(arguments)}
    notes: list[tuple[float, str | None]] = []
    started = asyncio.Event()

    async def progress(progress: float, total: float | None, message: str | None) -> None:
        notes.append((progress, message))
        if message == "started":
            started.set()

    proxies = [ProxyProcess(spec, tmp_path).start()]

    async def scenario() -> Any:
        # a's session stays open while its task waits: the server knows the session
        async with session(proxies[0].url + "/mcp") as client:
            await client.experimental.call_tool_as_task("deploy", arguments, meta=meta)
            sent = lambda: tool.arrived[f"deploy:{who}"] == 1  # noqa: E731
            await asyncio.to_thread(wait_for, sent, what="the call sent by a's worker")
            b = await asyncio.to_thread(ProxyProcess(spec, tmp_path).start)
            proxies.append(b)  # its worker finds nothing to take: the job is a's
            async with session(b.url + "/mcp") as follower:
                with pytest.raises(McpError) as timed_out:  # gives up; the job runs on
                    await follower.call_tool("deploy", arguments, timedelta(seconds=0.3), meta=meta)
                assert "Timed out" in str(timed_out.value)  # not -32010: it followed the job
                followed = asyncio.ensure_future(
                    follower.call_tool("deploy", arguments, meta=meta, progress_callback=progress)
                )
                async with asyncio.timeout(20):
                    await started.wait()  # a's latest progress, from before b followed
                tool.gate.set()  # the tool goes on: "almost", then its result
                return await followed

    try:
        with tool.holding():
            result = asyncio.run(scenario())
    finally:
        for proxy in proxies:
            proxy.stop()
        tool.stop()
    assert text(result) == f"deployed {who} (#1)"
    assert notes[0] == (0.0, "started") and (1.0, "almost") in notes
    assert tool.executions[f"deploy:{who}"] == 1 and tool.arrived[f"deploy:{who}"] == 1


def test_the_requester_of_a_task_gets_its_status_notification(
    make_proxy: ProxyFactory, mcp_tool: McpTool
) -> None:
    """Over SSE, ``tasks/result`` ends with ``notifications/tasks/status`` (the task's
    last status), then the result; tools/list marks the guarded tools as taking tasks."""
    proxy = through(make_proxy, mcp_tool)
    who = account()
    meta = {"idempotencyKey": new_key({"account": who})}
    seen: list[Any] = []

    async def handler(message: Any) -> None:
        if isinstance(message, types.ServerNotification):
            seen.append(message.root)

    async def scenario() -> tuple[Any, Any]:
        async with session(proxy.url + "/mcp", message_handler=handler) as client:
            listed = await client.list_tools()
            tasks = client.experimental
            created = await tasks.call_tool_as_task("deploy", {"account": who}, meta=meta)
            result = await tasks.get_task_result(created.task.taskId, types.CallToolResult)
            return listed, (created, result)

    listed, (created, result) = asyncio.run(scenario())
    support = {tool.name: tool.execution and tool.execution.taskSupport for tool in listed.tools}
    assert support["deploy"] == "optional" and support["charge"] == "optional"
    assert text(result) == f"deployed {who} (#1)"
    statuses = [n for n in seen if isinstance(n, types.TaskStatusNotification)]
    assert [(n.params.taskId, n.params.status) for n in statuses] == [
        (created.task.taskId, "completed")
    ]


def test_a_tools_list_ttl_bounds_the_shared_annotations() -> None:
    assert mcp.listed_ttl({"tools": []}) == mcp_tools.TOOLS_TTL_SECONDS
    assert mcp.listed_ttl({"ttlMs": 120_000}) == 120.0
    assert mcp.listed_ttl({"ttlMs": 0}) == mcp_tools.MIN_TTL_SECONDS
    assert mcp.listed_ttl({"ttlMs": 10**12}) == mcp_tools.MAX_TTL_SECONDS
    assert mcp.listed_ttl({"ttlMs": "60000"}) == mcp_tools.TOOLS_TTL_SECONDS
    assert mcp.listed_ttl({"ttlMs": True}) == mcp_tools.TOOLS_TTL_SECONDS


def test_only_guarded_tools_are_offered_as_tasks() -> None:
    result: dict[str, Any] = {"tools": [
        {"name": "deploy"}, {"name": "balance"},
        {"name": "review", "execution": {"taskSupport": "required"}},
        {"name": "build", "execution": {"taskSupport": "forbidden"}}, "junk",
    ]}  # fmt: skip
    assert mcp.offer_tasks(result, lambda name: name != "balance")
    support = [tool.get("execution") for tool in result["tools"][:4]]
    assert support == [
        {"taskSupport": "optional"}, None, {"taskSupport": "required"}, {"taskSupport": "optional"},
    ]  # fmt: skip
    assert not mcp.offer_tasks({"tools": [{"name": "balance"}]}, lambda name: False)


def _progress(message: str, size: int = 0) -> bytes:
    note = {"jsonrpc": "2.0", "method": "notifications/progress", "params": {
        "progressToken": "tool-proxy", "progress": 1, "message": message + "x" * size,
    }}  # fmt: skip
    return json.dumps(note).encode()


def test_shared_progress_reaches_other_processes_only_the_latest_and_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Unit: two ``Followers`` on one store, as two replicas. The worker's process hands
    its progress to its own followers once (its value in the store is not read back); the
    other one reads the latest from the store; a note past the bound (as it is kept:
    UTF-8, not escaped) or not UTF-8 is not shared, and never raises."""
    monkeypatch.setattr(mcp_tasks, "PROGRESS_POLL_SECONDS", 0.01)
    key = RecordKey("slot", "name")

    async def scenario() -> tuple[list[bytes], list[bytes], bytes | None]:
        store = MemoryStore()
        worker, other = mcp_tasks.Followers(store, None), mcp_tasks.Followers(store, None)
        with worker.follow(key) as here, other.follow(key) as there:
            with worker.running(key):
                for message in ("one", "two", "three"):
                    worker.publish(key, _progress(message))
                    worker.share(key, _progress(message))
                await worker.flush(key)
                worker.share(key, _progress("big", mcp_tasks.MAX_SHARED_PROGRESS_BYTES))
                worker.share(key, _progress("é" * (mcp_tasks.MAX_SHARED_PROGRESS_BYTES // 3)))
                worker.share(key, _progress("bad") + b"\xff")  # not UTF-8: not shared, no error
                await worker.flush(key)
            async with asyncio.timeout(5):
                got = [await there.get()]
            await worker.settle(key)  # its own value: not handed to its followers again
            await other.settle(key)  # seen already: not again
            mine = [here.get_nowait() for _ in range(here.qsize())]
            got += [there.get_nowait() for _ in range(there.qsize())]
        return mine, got, await store.get_value(mcp_tasks.progress_key(key))

    mine, got, kept = asyncio.run(scenario())
    assert [json.loads(n)["params"]["message"] for n in mine] == ["one", "two", "three"]
    assert [json.loads(n)["params"]["message"] for n in got] == ["three"]
    assert kept is not None and b"big" not in kept and b"bad" not in kept
    assert len(kept) <= mcp_tasks.MAX_SHARED_PROGRESS_BYTES
