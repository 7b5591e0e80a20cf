"""MCP revision 2026-07-28 with the official SDK 2.x on both sides.

mcp 2.x (which speaks 2026-07-28) and mcp 1.x (which the proxy and the rest of the suite
use) cannot share a virtual environment, so scripts/install keeps 2.x alone in
``.venv-mcp2``: its server (tests/mcp2/server.py, MCPServer over Streamable HTTP, in JSON
and in SSE mode) runs as a process, tool-proxy runs in front of it here, and its client
(tests/mcp2/client.py, ``mcp.Client``) is a process that calls through the proxy and
prints what it got, as JSON.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy import mcp
from tests.conftest import SEALING_ENV, ProxyFactory, new_key
from tests.servers import ROOT, ProxyProcess, RedisServer, free_port, wait_for
from tests.test_mcp import mcp_route

VENV = ROOT / ".venv-mcp2"
SCRIPTS = ROOT / "tests" / "mcp2"
REVISION = "2026-07-28"


def sdk2_python(venv: Path = VENV) -> Path:
    """The Python of the venv with mcp 2.x; a failure (not a skip) naming scripts/install
    when it is missing, so that the 2026-07-28 tests never pass by not running."""
    python = venv / "bin" / "python"
    if not python.exists():
        pytest.fail(
            f"{venv} (the MCP SDK 2.x, for the 2026-07-28 tests) is missing: run scripts/install",
            pytrace=False,
        )
    return python


@dataclass
class Server2:
    """The SDK 2.x server process, and its side effects as it counts them."""

    url: str
    form: str

    def executions(self) -> dict[str, int]:
        counts: dict[str, int] = httpx.get(f"{self.url}/executions").json()
        return counts


@pytest.fixture(scope="module", params=["json", "sse"])
def server2(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server2]:
    port = free_port()
    command = [str(sdk2_python()), str(SCRIPTS / "server.py"), str(port), request.param]
    log = tmp_path_factory.mktemp("mcp2") / "server.log"
    server = Server2(f"http://127.0.0.1:{port}", request.param)
    with log.open("wb") as output, subprocess.Popen(command, stderr=output) as process:

        def ready() -> bool:
            if process.poll() is not None:
                raise AssertionError(f"the MCP SDK 2.x server exited: {log.read_text()}")
            return server.executions() is not None

        try:
            wait_for(ready, seconds=30, what=f"the MCP SDK 2.x server; log: {log}")
            yield server
        finally:  # a call still held open keeps uvicorn's graceful stop waiting
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)


def sessions(url: str, *calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run the SDK 2.x client: each list of calls in a new ``Client`` on ``url``."""
    plan = json.dumps({"url": url, "sessions": list(calls)})
    command = [str(sdk2_python()), str(SCRIPTS / "client.py")]
    ran = subprocess.run(command, input=plan.encode(), capture_output=True, timeout=60)
    assert ran.returncode == 0, ran.stderr.decode()
    answers: list[dict[str, Any]] = json.loads(ran.stdout)
    assert [answer["protocol_version"] for answer in answers] == [REVISION] * len(calls)
    return answers


def charge(who: str, cents: int, key: str) -> dict[str, Any]:
    return {"tool": "charge", "arguments": {"account": who, "cents": cents}, "key": key}


def text(call: dict[str, Any]) -> str:
    return str(call["result"]["content"][0]["text"])


def account() -> str:
    return f"acct-{time.monotonic_ns()}"


def test_the_2026_revision_is_negotiated_through_the_proxy(
    make_proxy: ProxyFactory, server2: Server2
) -> None:
    """The SDK 2.x client, through the proxy, speaks 2026-07-28 with the server
    (``sessions`` asserts the version each ``Client`` negotiated)."""
    proxy = make_proxy(mcp_route(server2.url))
    who = account()
    [answer] = sessions(proxy.url + "/mcp", [charge(who, 1, new_key({"account": who, "cents": 1}))])
    assert answer["protocol_version"] == REVISION
    assert text(answer["results"][0]) == f"charged 1 to {who} (#1)"


def test_a_call_sent_again_from_a_new_session_is_executed_once(
    make_proxy: ProxyFactory, server2: Server2
) -> None:
    proxy = make_proxy(mcp_route(server2.url))
    who = account()
    key = new_key({"account": who, "cents": 250})

    first, again = sessions(proxy.url + "/mcp", [charge(who, 250, key)], [charge(who, 250, key)])

    assert server2.executions()[who] == 1
    assert again["results"][0]["result"] == first["results"][0]["result"]
    assert text(first["results"][0]) == f"charged 250 to {who} (#1)"
    # Progress comes over SSE only, to the first execution's caller; the replay has none.
    assert first["results"][0]["progress"] == ([1.0] if server2.form == "sse" else [])
    assert again["results"][0]["progress"] == []


def test_an_error_result_is_replayed(make_proxy: ProxyFactory, server2: Server2) -> None:
    proxy = make_proxy(mcp_route(server2.url))
    who = account()
    refund = {"tool": "refund", "arguments": {"account": who}, "key": new_key({"account": who})}

    first, again = sessions(proxy.url + "/mcp", [refund], [refund])

    assert first["results"][0]["result"]["isError"] is True
    assert again["results"][0]["result"] == first["results"][0]["result"]
    assert "refund #1 refused" in text(first["results"][0])
    assert server2.executions()[f"refund:{who}"] == 1


def test_other_arguments_under_the_same_step_are_a_new_execution(
    make_proxy: ProxyFactory, server2: Server2
) -> None:
    proxy = make_proxy(mcp_route(server2.url))
    who = account()
    plan = f"plan-{who}"
    calls = [
        charge(who, cents, new_key({"account": who, "cents": cents}, step=3, plan=plan))
        for cents in (10, 20, 20)
    ]

    [answer] = sessions(proxy.url + "/mcp", calls)

    assert [text(call) for call in answer["results"]] == [
        f"charged 10 to {who} (#1)",
        f"charged 20 to {who} (#2)",
        f"charged 20 to {who} (#2)",
    ]
    assert server2.executions()[who] == 2


def test_the_user_is_asked_once_and_the_call_that_brings_the_input_runs_once(
    make_proxy: ProxyFactory, server2: Server2
) -> None:
    """``close`` needs a confirmation: the server answers the call with an
    ``InputRequiredResult``, which the proxy passes on and does not record (the key is
    released); the SDK asks the user and sends the call again with the answer, under the
    same key: that one runs and is recorded, so a later retry gets its result, and the user
    is not asked again."""
    proxy = make_proxy(mcp_route(server2.url))
    who = account()
    close = {"tool": "close", "arguments": {"account": who}, "key": new_key({"account": who})}

    first, again = sessions(proxy.url + "/mcp", [close], [close])

    assert first["asked"] == [f"Close {who}?"]
    assert again["asked"] == []
    assert text(first["results"][0]) == f"closed {who} (#1)"
    assert again["results"][0]["result"] == first["results"][0]["result"]
    assert server2.executions()[f"close:{who}"] == 1
    # Over SSE each round's progress reached the first caller (the InputRequiredResult
    # came on an SSE stream too); the replay has none.
    assert first["results"][0]["progress"] == ([0.0, 0.0] if server2.form == "sse" else [])
    assert again["results"][0]["progress"] == []


def test_annotations_are_learnt_from_a_2026_tools_list(
    make_proxy: ProxyFactory, server2: Server2
) -> None:
    """``guard: annotated``: once a 2026-07-28 ``tools/list`` answer has passed, the
    read-only tool is not guarded (no key needed), the others still are."""
    proxy = make_proxy(mcp_route(server2.url, guard="annotated", required=True))
    who = account()
    read = {"tool": "balance", "arguments": {"account": who}}
    write = {"tool": "charge", "arguments": {"account": who, "cents": 1}}

    [answer] = sessions(proxy.url + "/mcp", [{"list": True}, read, read, write])

    listed, first, again, refused = answer["results"]
    assert {"balance", "charge"} <= set(listed["tools"])
    assert text(first) == text(again) == f"{who}: 0 charges"
    assert server2.executions()[f"balance:{who}"] == 2
    assert refused["error"]["code"] == mcp.KEY_MISSING
    assert who not in server2.executions()


def test_a_client_that_times_out_gets_in_progress_then_the_replay(
    make_proxy: ProxyFactory, server2: Server2
) -> None:
    """At 2026-07-28 a client cancels a request by closing its response stream (the
    SDK's client does on its read timeout; its server in SSE mode then cancels the tool,
    which without the proxy never completes): the proxy must not pass that on for a
    guarded call. The call runs on, the retry while it runs is told it is in progress,
    and the retry after it ended gets its result."""
    proxy = make_proxy(mcp_route(server2.url))
    who = account()
    hold = {"tool": "hold", "arguments": {"account": who}, "key": new_key({"account": who})}

    gave_up, busy = sessions(proxy.url + "/mcp", [{**hold, "timeout": 0.5}], [hold])
    assert "error" in gave_up["results"][0]
    assert busy["results"][0]["error"]["code"] == mcp.IN_PROGRESS
    httpx.post(f"{server2.url}/open", params={"account": who})
    wait_for(lambda: server2.executions().get(f"hold:{who}") == 1, what="the held call to end")
    replayed = until_recorded(proxy.url + "/mcp", hold)

    assert text(replayed) == f"held {who} (#1)"
    assert server2.executions()[f"hold:{who}"] == 1


def test_on_an_async_route_callers_of_one_key_follow_the_same_job(
    make_proxy: ProxyFactory, server2: Server2
) -> None:
    """``async: {mode: always}``: every guarded call runs on the route's workers. A client
    whose read timeout (0.5 s) is shorter than the call gives up (the SDK's -32001, and
    its courtesy cancellation): the job runs on. A second client with the same key
    follows the same job, and the first, sending the call again, follows it too. All get
    the one execution's result."""
    route = {**mcp_route(server2.url), "async": {"mode": "always", "visibility": "1s"}}
    proxy = make_proxy(route)
    who = account()
    hold = {"tool": "hold", "arguments": {"account": who}, "key": new_key({"account": who})}
    [impatient] = sessions(proxy.url + "/mcp", [{**hold, "timeout": 0.5}])
    assert impatient["results"][0]["error"]["code"] == -32001  # the client's own timeout
    assert server2.executions()[f"running:{who}"] == 1
    answers: list[dict[str, Any]] = []
    followers = [
        threading.Thread(target=lambda: answers.extend(sessions(proxy.url + "/mcp", [hold])))
        for _ in range(2)
    ]
    for follower in followers:
        follower.start()
    time.sleep(1)  # the followers reach the job (a late one replays: the same answer)
    httpx.post(f"{server2.url}/open", params={"account": who})
    for follower in followers:
        follower.join(30)
    assert [text(answer["results"][0]) for answer in answers] == [f"held {who} (#1)"] * 2
    assert server2.executions()[f"hold:{who}"] == 1
    assert server2.executions()[f"running:{who}"] == 1


def test_a_slow_call_through_two_replicas_runs_once(
    redis_server: RedisServer, server2: Server2, tmp_path: Path
) -> None:
    """Two ``tool-proxy serve`` processes on one Redis, ``async: {mode: always}``. A client
    of replica a gives up after 0.5 s; a client of replica b sending the call again with
    the same key while it runs follows the job (it too gives up, after 2 s: no -32010, no
    second execution); once the tool goes on, a third client, of b, gets the result of the
    one execution."""
    redis_server.flush()
    route = {**mcp_route(server2.url), "async": {"mode": "always", "visibility": "1s"}}
    spec = {"store": {"url": redis_server.url, "sealing_key_env": SEALING_ENV}}
    spec["routes"] = [route]  # type: ignore[assignment]
    proxies = [ProxyProcess(spec, tmp_path).start() for _ in range(2)]
    a, b = (proxy.url + "/mcp" for proxy in proxies)
    who = account()
    hold = {"tool": "hold", "arguments": {"account": who}, "key": new_key({"account": who})}
    try:
        [impatient] = sessions(a, [{**hold, "timeout": 0.5}])
        wait_for(lambda: server2.executions().get(f"running:{who}") == 1, what="the call sent")
        [following] = sessions(b, [{**hold, "timeout": 2}])
        httpx.post(f"{server2.url}/open", params={"account": who})
        [answer] = sessions(b, [hold])
    finally:
        for proxy in proxies:
            proxy.stop()
    assert impatient["results"][0]["error"]["code"] == -32001  # the client's own timeout
    assert following["results"][0]["error"]["code"] == -32001  # followed, not refused
    assert text(answer["results"][0]) == f"held {who} (#1)"
    assert server2.executions()[f"hold:{who}"] == 1
    assert server2.executions()[f"running:{who}"] == 1


def until_recorded(url: str, call: dict[str, Any], attempts: int = 20) -> dict[str, Any]:
    """``call``'s answer once it is no longer in progress (its tool has answered; the
    recording takes a moment more)."""
    for _ in range(attempts):
        [answer] = sessions(url, [call])
        result: dict[str, Any] = answer["results"][0]
        if result.get("error", {}).get("code") != mcp.IN_PROGRESS:
            return result
    raise AssertionError(f"still in progress after {attempts} attempts")


def test_without_the_sdk2_venv_the_tests_fail_and_name_scripts_install(tmp_path: Path) -> None:
    with pytest.raises(pytest.fail.Exception, match="run scripts/install"):
        sdk2_python(tmp_path / ".venv-mcp2")
