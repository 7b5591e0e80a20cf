"""MCP revision 2026-07-28: the tasks extension (``io.modelcontextprotocol/tasks``,
SEP-2663) spoken by the proxy for the calls of a route with ``async``, in front of the
official SDK 2.x server (tests/mcp2/server.py, whose tools know nothing of tasks).

The client that asks for a task is the official TypeScript client 2.x
(``@modelcontextprotocol/client``) with the extension's requester
(``@modelcontextprotocol/ext-tasks``): tests/mcp2ts/tasks.mjs, run by node (scripts/install
runs ``npm ci`` in tests/mcp2ts). The clients that wait, or time out and retry, are the
SDK 2.x Python client (tests/mcp2/client.py, ``sessions``). The wire forms the package
does not exercise (a request without the extension, ``tasks/update``, a cancel too late)
are sent as raw JSON-RPC.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx

from proxy import mcp, mcp_tasks
from tests.conftest import SEALING_ENV, ProxyFactory, new_key
from tests.idp import IdentityProvider
from tests.servers import ROOT, ProxyProcess, RedisServer, wait_for
from tests.test_auth import auth_config
from tests.test_mcp import bearer, mcp_route
from tests.test_mcp_2026 import REVISION, Server2, account, sessions, text
from tests.test_mcp_2026 import server2 as server2  # the fixture (the SDK 2.x server)

CLIENT_TS = ROOT / "tests" / "mcp2ts"


def ts_sessions(
    url: str, *calls: list[dict[str, Any]], tasks_url: str | None = None
) -> list[dict[str, Any]]:
    """Run the TypeScript client: each list of calls in a new ``Client`` and task session
    on ``url``; its ``tasks/*`` to ``tasks_url`` when given (another replica)."""
    node = shutil.which("node")
    assert node is not None, "node is not installed (Node.js 20+ runs tests/mcp2ts)"
    assert (CLIENT_TS / "node_modules").is_dir(), "run scripts/install (npm ci in tests/mcp2ts)"
    plan: dict[str, Any] = {"url": url, "sessions": list(calls)}
    if tasks_url is not None:
        plan["tasksUrl"] = tasks_url
    command = [node, str(CLIENT_TS / "tasks.mjs")]
    ran = subprocess.run(command, input=json.dumps(plan).encode(), capture_output=True, timeout=90)
    assert ran.returncode == 0, ran.stderr.decode()
    answers: list[dict[str, Any]] = json.loads(ran.stdout)
    assert [answer["protocol_version"] for answer in answers] == [REVISION] * len(calls)
    return answers


def tasks_route(upstream: str, **async_: Any) -> dict[str, Any]:
    spec = mcp_route(upstream)
    spec["async"] = {"visibility": "1s", "backoff": "50ms", "backoff_max": "100ms", **async_}
    return spec


def slow(who: str, seconds: float, key: str, **extra: Any) -> dict[str, Any]:
    arguments = {"account": who, "seconds": seconds}
    return {"tool": "slow", "arguments": arguments, "key": key, **extra}


def raw(
    url: str,
    method: str,
    params: dict[str, Any],
    extension: bool = True,
    auth: dict[str, str] | None = None,
    routed: bool = True,
) -> dict[str, Any]:
    """One JSON-RPC request of revision 2026-07-28 (its ``_meta`` as the SDKs frame it),
    declaring the tasks extension or not, with the ``Mcp-Name`` header (``routed``) or not;
    the JSON-RPC response."""
    declared: dict[str, Any] = {"extensions": {mcp_tasks.TASKS_EXTENSION: {}}}
    capabilities: dict[str, Any] = declared if extension else {}
    meta = {
        mcp.VERSION_META: REVISION,
        "io.modelcontextprotocol/clientInfo": {"name": "raw", "version": "1"},
        mcp_tasks.CAPABILITIES_META: capabilities,
        **params.pop("_meta", {}),
    }
    body = {"jsonrpc": "2.0", "id": 7, "method": method, "params": {**params, "_meta": meta}}
    headers = {
        "accept": "application/json, text/event-stream",
        "mcp-protocol-version": REVISION,
        "mcp-method": method,
        **(auth or {}),
    }
    if routed:  # the routing header, which the SDK 2.x server requires of a tools/call
        headers["mcp-name"] = str(params.get("name") or params.get("taskId"))
    answer = httpx.post(url, json=body, headers=headers, timeout=30)
    if answer.headers["content-type"].startswith("text/event-stream"):
        data = [line[5:].strip() for line in answer.text.splitlines() if line.startswith("data:")]
        message: dict[str, Any] = json.loads(data[-1])
        return message
    answered: dict[str, Any] = answer.json()
    return answered


def test_the_extension_is_offered_and_a_call_asked_as_a_task_is_the_proxys(
    make_proxy: ProxyFactory, server2: Server2
) -> None:
    """``server/discover`` answers advertise the extension on a route with ``async`` only;
    there, the package's call is answered with the proxy's task (``require``: it must
    be), polled with ``tasks/get`` until its result, the tool's, run once. On the route
    without ``async`` the same client gets the server's immediate result."""
    plain_proxy, proxy = make_proxy(mcp_route(server2.url)), make_proxy(tasks_route(server2.url))
    who = account()
    key = new_key({"account": who, "seconds": 1})
    fast = slow(who, 0.1, new_key({"account": who, "seconds": 0.1}))

    [plain] = ts_sessions(plain_proxy.url + "/mcp", [fast])
    [tasked] = ts_sessions(proxy.url + "/mcp", [slow(who, 1, key, preference="require")])

    assert plain["era"] == "modern" and plain["offered"] is False
    assert plain["results"][0]["kind"] == "immediate"
    assert tasked["offered"] is True
    call = tasked["results"][0]
    assert call["kind"] == "task", call
    assert call["answeredMs"] < 900  # answered before the 1 s tool ends
    methods = [sent["method"] for sent in call["sent"]]
    assert methods[0] == "tools/call" and "tasks/get" in methods
    assert text(call) == f"slow {who} (#2)"  # the plain call was #1
    assert server2.executions()[f"slow:{who}"] == 2  # the plain call, then the task's
    assert server2.executions()[f"running:{who}"] == 2


def test_the_extensions_wire_forms(make_proxy: ProxyFactory, server2: Server2) -> None:
    """Raw 2026-07-28 requests: the flat ``CreateTaskResult``, ``tasks/get`` (working,
    then ``completed`` with the tool's ``isError`` result inlined: the extension's
    ``failed`` is for JSON-RPC errors), -32021 without the extension, ``tasks/update``
    acknowledged, ``tasks/cancel`` of an ended task refused (-32602); the call asked again
    with its key is the same task, the tool called once."""
    proxy = make_proxy(tasks_route(server2.url))
    url = proxy.url + "/mcp"
    who = account()
    call = {"name": "refund", "arguments": {"account": who}}
    keyed = {**call, "_meta": {"idempotencyKey": new_key({"account": who})}}

    created = raw(url, "tools/call", dict(keyed))["result"]
    assert created["resultType"] == "task"
    assert created["status"] == "working"
    assert {"taskId", "createdAt", "lastUpdatedAt", "ttlMs", "pollIntervalMs"} <= set(created)
    task_id = created["taskId"]

    seen: list[dict[str, Any]] = []

    def ended() -> bool:
        seen.append(raw(url, "tasks/get", {"taskId": task_id})["result"])
        return bool(seen[-1]["status"] != "working")

    wait_for(ended, what="the task to end")
    got = seen[-1]
    assert got["resultType"] == "complete"
    assert got["status"] == "completed"
    assert got["result"]["isError"] is True
    assert "refund #1 refused" in got["result"]["content"][0]["text"]
    refused = raw(url, "tasks/get", {"taskId": task_id}, extension=False)["error"]
    assert refused["code"] == mcp_tasks.MISSING_CAPABILITY
    assert refused["data"] == {
        "requiredCapabilities": {"extensions": {mcp_tasks.TASKS_EXTENSION: {}}}
    }
    updated = raw(url, "tasks/update", {"taskId": task_id, "inputResponses": {}})
    assert updated["result"] == {"resultType": "complete"}
    assert raw(url, "tasks/cancel", {"taskId": task_id})["error"]["code"] == -32602
    again = raw(url, "tools/call", dict(keyed))["result"]
    assert again["taskId"] == task_id and again["status"] == "completed"
    assert "result" not in again  # tasks/get has it
    assert server2.executions()[f"refund:{who}"] == 1


def test_a_call_that_could_not_be_made_is_a_failed_task(
    make_proxy: ProxyFactory, server2: Server2
) -> None:
    """The server refuses every attempt of the worker's call (HTTP 400: this call lacks
    the ``Mcp-Name`` header it requires), so the job ends ``dead``: the task is ``failed``,
    with the JSON-RPC error a retry of the call would get (its RFC 9457 document in
    ``data``), and the tool never ran."""
    proxy = make_proxy(tasks_route(server2.url, attempts=2))
    url = proxy.url + "/mcp"
    who = account()
    arguments = {"account": who, "cents": 9}
    keyed = {
        "name": "charge",
        "arguments": arguments,
        "_meta": {"idempotencyKey": new_key(arguments)},
    }
    task_id = raw(url, "tools/call", keyed, routed=False)["result"]["taskId"]
    seen: list[dict[str, Any]] = []

    def ended() -> bool:
        seen.append(raw(url, "tasks/get", {"taskId": task_id})["result"])
        return bool(seen[-1]["status"] != "working")

    wait_for(ended, what="the task to end")
    failed = seen[-1]
    assert failed["status"] == "failed", failed
    assert isinstance(failed["error"]["code"], int) and failed["error"]["data"]["status"]
    assert failed["statusMessage"] == failed["error"]["message"]
    assert who not in server2.executions()


def test_a_slow_call_through_two_replicas_completes_once_for_every_client(
    redis_server: RedisServer, server2: Server2, tmp_path: Path
) -> None:
    """Two ``tool-proxy serve`` processes on one Redis, ``async: {mode: always}``, a 3 s
    tool: the SDK 2.x Python client of replica a times out (0.5 s) and gives up; the
    TypeScript client of replica b, asking for a task with the same key while the call
    runs, gets the proxy's task (the same job) and polls it through replica a until the
    result; the TypeScript client sending it again (replica a, polling b) gets the same
    task, ended; the Python client that waits (replica b) gets the same result. One
    execution."""
    redis_server.flush()
    spec: dict[str, Any] = {"store": {"url": redis_server.url, "sealing_key_env": SEALING_ENV}}
    spec["routes"] = [tasks_route(server2.url, mode="always")]
    proxies = [ProxyProcess(spec, tmp_path).start() for _ in range(2)]
    a, b = (proxy.url + "/mcp" for proxy in proxies)
    who = account()
    call = slow(who, 3, new_key({"account": who, "seconds": 3}))
    try:
        [impatient] = sessions(a, [{**call, "timeout": 0.5}])
        wait_for(lambda: server2.executions().get(f"running:{who}") == 1, what="the call sent")
        [tasked] = ts_sessions(b, [{**call, "preference": "require"}], tasks_url=a)
        [again] = ts_sessions(a, [call], tasks_url=b)
        [waited] = sessions(b, [call])
    finally:
        for proxy in proxies:
            proxy.stop()
    assert impatient["results"][0]["error"]["code"] == -32001  # the client's own timeout
    first, second = tasked["results"][0], again["results"][0]
    assert first["kind"] == second["kind"] == "task"
    assert first["taskId"] == second["taskId"]
    assert first["answeredMs"] < 2000  # the task handle, while the tool still runs
    polled = {sent["to"] for sent in first["sent"] if sent["method"] == "tasks/get"}
    assert polled == {"tasksUrl"}  # the task seen from the other replica
    assert text(first) == text(second) == text(waited["results"][0]) == f"slow {who} (#1)"
    assert server2.executions()[f"slow:{who}"] == 1
    assert server2.executions()[f"running:{who}"] == 1


def test_a_queued_task_is_cancelled_and_a_sent_one_is_not(
    make_proxy: ProxyFactory, server2: Server2
) -> None:
    """One worker, held by a first task (its call sent): a second task stays queued.
    ``tasks/cancel`` of the queued one is acknowledged (``resultType: "complete"``) and
    its ``tasks/get`` says ``cancelled``: its tool never runs; the sent one cannot be
    cancelled (-32019), and completes."""
    proxy = make_proxy({**tasks_route(server2.url), "workers": {"concurrency": 1}})
    url = proxy.url + "/mcp"
    who = account()
    held = {"name": "hold", "arguments": {"account": who}}
    queued = {"name": "charge", "arguments": {"account": who, "cents": 5}}

    def task(call: dict[str, Any]) -> str:
        keyed = {**call, "_meta": {"idempotencyKey": new_key(call["arguments"])}}
        created: dict[str, Any] = raw(url, "tools/call", keyed)["result"]
        assert created["resultType"] == "task"
        return str(created["taskId"])

    first = task(held)
    wait_for(lambda: server2.executions().get(f"running:{who}") == 1, what="the call sent")
    second = task(queued)

    assert raw(url, "tasks/cancel", {"taskId": second}) == {
        "jsonrpc": "2.0",
        "id": 7,
        "result": {"resultType": "complete"},
    }
    cancelled = raw(url, "tasks/get", {"taskId": second})["result"]
    assert cancelled["status"] == "cancelled"
    assert "result" not in cancelled and "error" not in cancelled
    assert raw(url, "tasks/cancel", {"taskId": first})["error"]["code"] == mcp.REFUSED
    httpx.post(f"{server2.url}/open", params={"account": who})

    def completed() -> bool:
        return bool(raw(url, "tasks/get", {"taskId": first})["result"]["status"] == "completed")

    wait_for(completed, what="the held task to complete")
    assert server2.executions()[f"hold:{who}"] == 1
    assert who not in server2.executions()  # the cancelled charge never ran


def test_a_task_is_its_principals_own(
    make_proxy: ProxyFactory, server2: Server2, idp: IdentityProvider
) -> None:
    """On a route with ``auth``: bob's ``tasks/get`` of alice's task is not the proxy's to
    answer (it goes to the server, which has no such task); alice's is."""
    spec = {**tasks_route(server2.url), "auth": {"required": True}}
    proxy = make_proxy(spec, auth=auth_config(idp))
    url = proxy.url + "/mcp"
    alice, bob = bearer(idp.token("alice")), bearer(idp.token("bob"))
    who = account()
    call = {"name": "charge", "arguments": {"account": who, "cents": 3}}
    keyed = {**call, "_meta": {"idempotencyKey": new_key(call["arguments"])}}

    task_id = raw(url, "tools/call", keyed, auth=alice)["result"]["taskId"]
    hidden = raw(url, "tasks/get", {"taskId": task_id}, auth=bob)
    seen = raw(url, "tasks/get", {"taskId": task_id}, auth=alice)

    assert "result" not in hidden  # the server's answer: not one of its tasks
    assert hidden["error"]["code"] not in (mcp_tasks.MISSING_CAPABILITY, mcp.REFUSED)
    assert seen["result"]["taskId"] == task_id


def test_a_replica_killed_with_one_task_sent_and_one_queued(
    redis_server: RedisServer, server2: Server2, tmp_path: Path
) -> None:
    """One worker: the first task's call at the tool, the second queued behind it, when
    replica a is killed. On replica b the queued task runs once; the sent one is never sent
    again: ``tasks/get`` says failed, with the outcome-unknown JSON-RPC error."""
    redis_server.flush()
    spec: dict[str, Any] = {"store": {"url": redis_server.url, "sealing_key_env": SEALING_ENV}}
    spec["routes"] = [{**tasks_route(server2.url), "workers": {"concurrency": 1}}]
    sent, queued = account(), account()

    def call(who: str) -> dict[str, Any]:
        arguments = {"account": who, "seconds": 3}
        meta = {"idempotencyKey": new_key(arguments)}
        return {"name": "slow", "arguments": arguments, "_meta": meta}

    a = ProxyProcess(spec, tmp_path).start()
    try:
        first = raw(a.url + "/mcp", "tools/call", call(sent))["result"]["taskId"]
        wait_for(lambda: server2.executions().get(f"running:{sent}") == 1, what="the call sent")
        second = raw(a.url + "/mcp", "tools/call", call(queued))["result"]["taskId"]
        a.kill()
    finally:
        if a.process is not None:
            a.stop()
    b = ProxyProcess(spec, tmp_path).start()
    try:
        url = b.url + "/mcp"

        def ended(task_id: str) -> dict[str, Any]:
            seen: list[dict[str, Any]] = []

            def done() -> bool:
                seen.append(raw(url, "tasks/get", {"taskId": task_id})["result"])
                return bool(seen[-1]["status"] != "working")

            wait_for(done, seconds=30, what=f"task {task_id} to end")
            return seen[-1]

        completed, failed = ended(second), ended(first)
    finally:
        b.stop()
    assert completed["status"] == "completed"
    assert completed["result"]["content"][0]["text"] == f"slow {queued} (#1)"
    assert server2.executions()[f"running:{queued}"] == 1
    assert failed["status"] == "failed"
    assert failed["error"]["code"] == mcp.OUTCOME_UNKNOWN
    assert server2.executions()[f"running:{sent}"] == 1  # never sent again
