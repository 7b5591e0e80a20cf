"""tool_proxy_client's HTTP calls against a real tool-proxy in front of a real tool."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from tool_proxy_client import (
    Answer,
    AsyncToolProxy,
    Operation,
    OperationCancelled,
    OutcomeUnknown,
    PlanSession,
    RequestInProgress,
    ToolProxy,
    TransportError,
    Waits,
)
from tool_proxy_client.answers import EventParser
from tool_proxy_client.errors import (
    ArgsHashMismatch,
    IdempotencyKeyReused,
    OperationState,
    RouteNotFound,
    problem_class,
)

from tests.conftest import ProxyFactory, route
from tests.servers import CountingTool, ThreadServer, free_port
from tests.test_jobs import long_route

ARGS = {"account": "acme", "amount": 42}


def plan() -> PlanSession:
    return PlanSession(f"plan-{uuid.uuid4().hex[:12]}")


def test_a_step_runs_once_and_its_retry_is_a_replay(
    tool: CountingTool, make_proxy: ProxyFactory
) -> None:
    proxy = make_proxy(route(tool.url))
    step = plan().step(3)
    with ToolProxy(proxy.url) as client:
        first = client.call(step, "/tools/charge", ARGS)
        again = client.call(step, "/tools/charge", {"amount": 42, "account": "acme"})
        replanned = client.call(step, "/tools/charge", {**ARGS, "amount": 43})
    assert (first.status_code, first.replayed, again.replayed) == (200, False, True)
    assert again.content == first.content and first.json()["execution"] == 1
    assert first.key == step.key(ARGS) and tool.count(step.key(ARGS)) == 1
    assert not replanned.replayed and tool.count(step.key({**ARGS, "amount": 43})) == 1


def test_a_raw_body_is_keyed_as_the_proxy_hashes_it(
    tool: CountingTool, make_proxy: ProxyFactory
) -> None:
    proxy = make_proxy(route(tool.url))
    step = plan().step(1)
    body = b'{ "b": 2, "a": 1 }'
    headers = {"Content-Type": "application/json"}
    with ToolProxy(proxy.url) as client:
        first = client.call(step, "/tools/x", content=body, headers=headers)
        again = client.call(step, "/tools/x", content=b'{"a":1,"b":2}', headers=headers)
    assert not first.replayed and again.replayed


def test_a_409_is_waited_out_then_the_answer_is_replayed(
    tool: CountingTool, make_proxy: ProxyFactory
) -> None:
    proxy = make_proxy(route(tool.url))
    step = plan().step(1)
    answers: list[Answer] = []
    with ToolProxy(proxy.url) as client:
        first = threading.Thread(
            target=lambda: answers.append(client.call(step, "/tools/slow?delay=1.5", ARGS))
        )
        first.start()
        while not tool.arrived[step.key(ARGS)]:
            time.sleep(0.02)
        waited = client.call(step, "/tools/slow?delay=1.5", ARGS)
        first.join()
    assert waited.replayed and waited.content == answers[0].content
    assert tool.count(step.key(ARGS)) == 1


def test_the_wait_is_bounded(tool: CountingTool, make_proxy: ProxyFactory) -> None:
    proxy = make_proxy(route(tool.url))
    step = plan().step(1)
    with ToolProxy(proxy.url) as client, ToolProxy(proxy.url, waits=Waits(total=0.5)) as hasty:
        first = threading.Thread(target=lambda: client.call(step, "/tools/s?delay=1.5", ARGS))
        first.start()
        while not tool.arrived[step.key(ARGS)]:
            time.sleep(0.02)
        started = time.monotonic()
        with pytest.raises(RequestInProgress) as busy:
            hasty.call(step, "/tools/s?delay=1.5", ARGS)
        spent = time.monotonic() - started
        first.join()
    assert spent < 0.5
    assert busy.value.status == 409 and busy.value.retry_after == 1.0
    assert busy.value.type == "urn:tool-proxy:problem:request-in-progress"


def test_outcome_unknown_names_the_record_and_is_never_run_again(
    tool: CountingTool, make_proxy: ProxyFactory
) -> None:
    proxy = make_proxy(route(tool.url, timeout="300ms"))
    step = plan().step(7)
    with ToolProxy(proxy.url) as client:
        with pytest.raises(OutcomeUnknown) as lost:
            client.call(step, "/tools/charge?delay=1", ARGS)
        time.sleep(1)
        with pytest.raises(OutcomeUnknown) as again:
            client.call(step, "/tools/charge?delay=1", ARGS)
    record = lost.value.record
    assert record is not None and record.key == step.key(ARGS)
    assert (record.plan, record.step, record.args_hash) == (step.plan.id, "7", step.key(ARGS)[-64:])
    assert record.method == "POST" and record.target == proxy.url + "/tools/charge?delay=1"
    assert lost.value.status == 504 and again.value.status == 504
    assert tool.count(step.key(ARGS)) == 1


def test_other_problems_are_their_own_exceptions(
    tool: CountingTool, make_proxy: ProxyFactory
) -> None:
    proxy = make_proxy(route(tool.url))
    step = plan().step(1)
    with ToolProxy(proxy.url) as client:
        with pytest.raises(ArgsHashMismatch) as mismatch:
            client.call(step, "/tools/a", ARGS, key=step.key({"other": 1}))
        client.call(step, "/tools/a", ARGS)
        with pytest.raises(IdempotencyKeyReused):
            client.call(step, "/tools/b", ARGS)
        with pytest.raises(RouteNotFound):
            client.call(step, "/elsewhere", ARGS)
    assert mismatch.value.status == 422 and "args_hash" in mismatch.value.detail
    assert problem_class("urn:tool-proxy:problem:some-future-type").__name__ == "ProxyProblem"


def test_the_tools_own_errors_are_its_answer(tool: CountingTool, make_proxy: ProxyFactory) -> None:
    proxy = make_proxy(route(tool.url))
    with ToolProxy(proxy.url) as client:
        answer = client.call(plan().step(1), "/tools/a?status=502", ARGS)
    assert answer.status_code == 502 and answer.headers["x-tool"] == "counting"


def test_no_proxy_is_a_transport_error_once_the_wait_is_spent() -> None:
    with (
        ToolProxy(f"http://127.0.0.1:{free_port()}", waits=Waits(total=0.5)) as client,
        pytest.raises(TransportError),
    ):
        client.call(plan().step(1), "/tools/a", ARGS)


@pytest.mark.parametrize("follow", ["sse", "poll"])
def test_a_long_call_is_followed_to_its_result(
    tool: CountingTool, make_proxy: ProxyFactory, follow: Any
) -> None:
    proxy = make_proxy(long_route(tool.url))
    step = plan().step(2)
    seen: list[str] = []
    with ToolProxy(proxy.url, follow=follow) as client:
        answer = client.call(
            step,
            "/tools/review?delay=1",
            ARGS,
            respond_async=True,
            on_status=lambda doc: seen.append(doc["state"]),
        )
        again = client.call(step, "/tools/review?delay=1", ARGS, respond_async=True)
    assert answer.operation is not None and answer.json()["execution"] == 1
    assert seen[-1] == "completed" if follow == "sse" else seen[-1] in ("running", "queued")
    assert again.replayed and again.content == answer.content
    assert tool.count(step.key(ARGS)) == 1


def test_a_long_call_whose_outcome_is_unknown_raises_it(
    tool: CountingTool, make_proxy: ProxyFactory
) -> None:
    proxy = make_proxy(long_route(tool.url, timeout="300ms"))
    step = plan().step(2)
    with ToolProxy(proxy.url) as client:
        operation = client.submit(step, "/tools/review?delay=1", ARGS)
        assert isinstance(operation, Operation) and operation.state in ("queued", "running")
        with pytest.raises(OutcomeUnknown) as lost:
            client.follow(operation)
    assert lost.value.record is not None and lost.value.record.operation == operation.id


def test_a_queued_operation_is_cancelled(tool: CountingTool, make_proxy: ProxyFactory) -> None:
    proxy = make_proxy(long_route(tool.url, workers={"concurrency": 1}))
    plan_ = plan()
    with ToolProxy(proxy.url) as client:
        running = client.submit(plan_.step(1), "/tools/review?delay=1", ARGS)
        assert isinstance(running, Operation)
        while client.status(running)["state"] != "running":
            time.sleep(0.05)
        queued = client.submit(plan_.step(2), "/tools/review", ARGS)
        assert isinstance(queued, Operation)
        assert client.cancel(queued)["state"] == "cancelled"
        with pytest.raises(OperationState):
            client.cancel(running)
        with pytest.raises(OperationCancelled):
            client.follow(queued)
        assert client.follow(running).json()["execution"] == 1
    assert tool.count(plan_.step(2).key(ARGS)) == 0


def test_a_quick_long_call_answers_within_wait(
    tool: CountingTool, make_proxy: ProxyFactory
) -> None:
    proxy = make_proxy(long_route(tool.url))
    with ToolProxy(proxy.url) as client:
        answer = client.submit(plan().step(1), "/tools/review", ARGS, wait=10)
    assert isinstance(answer, Answer) and answer.json()["execution"] == 1


def test_the_async_client(tool: CountingTool, make_proxy: ProxyFactory) -> None:
    proxy = make_proxy(long_route(tool.url))
    steps = plan()

    async def scenario() -> tuple[Answer, Answer, Answer, list[dict[str, Any]]]:
        async with AsyncToolProxy(proxy.url) as client:

            async def duplicate() -> Answer:
                await asyncio.sleep(0.3)
                return await client.call(steps.step(1), "/tools/a?delay=1", ARGS)

            first, waited = await asyncio.gather(
                client.call(steps.step(1), "/tools/a?delay=1", ARGS), duplicate()
            )
            long = await client.call(steps.step(2), "/tools/b?delay=0.5", ARGS, respond_async=True)
            return first, waited, long, await client.steps(steps.id)

    first, waited, long, recorded = asyncio.run(scenario())
    assert not first.replayed and waited.replayed and waited.content == first.content
    assert long.operation is not None and long.json()["execution"] == 1
    assert [s["step"] for s in recorded] == ["1", "2"]
    assert tool.count(steps.step(1).key(ARGS)) == 1


def test_server_sent_events_are_parsed_with_their_ids() -> None:
    parser = EventParser()
    lines = [
        "event: state",
        "id: 2",
        'data: {"state":',
        "data: 1}",
        "",
        ": ping",
        "",
        "data: x",
        "",
    ]
    events = [event for line in lines for event in parser.feed(line)]
    assert [(e.event, e.id, e.data) for e in events] == [
        ("state", "2", '{"state":\n1}'),
        ("message", "2", "x"),
    ]
    assert parser.last_id == "2"


def test_the_sync_client_takes_an_httpx_client(
    tool: CountingTool, make_proxy: ProxyFactory
) -> None:
    """Its calls go through the client given (its headers reach the tool)."""
    proxy = make_proxy(route(tool.url))
    http = httpx.Client(headers={"Authorization": "Bearer t"})
    with ToolProxy(proxy.url + "/", http=http) as client:
        assert client.base_url == proxy.url
        answer = client.call(plan().step(1), "/tools/charge", ARGS)
    assert answer.status_code == 200
    assert tool.requests[-1]["headers"]["authorization"] == "Bearer t"


class CuttingRelay:
    """A relay in front of the proxy that cuts the first event stream after its first
    event (the connection breaks mid-stream), and notes each stream's Last-Event-ID."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.last_event_ids: list[str | None] = []
        self.app = Starlette(routes=[Route("/{path:path}", self.handle, methods=["GET", "POST"])])

    async def handle(self, request: Request) -> Response:
        url = (
            self.target + request.url.path + (f"?{request.url.query}" if request.url.query else "")
        )
        headers = {k: v for k, v in request.headers.items() if k not in ("host", "content-length")}
        if "text/event-stream" in request.headers.get("accept", ""):
            self.last_event_ids.append(request.headers.get("last-event-id"))
            return StreamingResponse(
                self._events(url, headers, cut=len(self.last_event_ids) == 1),
                media_type="text/event-stream",
            )
        async with httpx.AsyncClient() as http:
            answer = await http.request(
                request.method, url, content=await request.body(), headers=headers
            )
        kept = {k: v for k, v in answer.headers.items() if k not in _HOP}
        return Response(answer.content, answer.status_code, headers=kept)

    async def _events(self, url: str, headers: dict[str, str], cut: bool) -> AsyncIterator[bytes]:
        async with httpx.AsyncClient() as http, http.stream("GET", url, headers=headers) as answer:
            async for chunk in answer.aiter_raw():
                yield chunk
                if cut and (b"\n\n" in chunk or b"\r\n\r\n" in chunk):
                    raise ConnectionAbortedError("the relay cuts the stream")


_HOP = ("content-length", "transfer-encoding", "content-encoding", "connection")


def test_a_broken_event_stream_is_resumed_with_last_event_id(
    tool: CountingTool, make_proxy: ProxyFactory
) -> None:
    proxy = make_proxy(long_route(tool.url))
    relay = CuttingRelay(proxy.url)
    server = ThreadServer(relay.app).start()
    step = plan().step(1)
    try:
        with ToolProxy(server.url) as client:
            answer = client.call(step, "/tools/review?delay=1.5", ARGS, respond_async=True)
    finally:
        server.stop()
    assert answer.json()["execution"] == 1
    assert relay.last_event_ids[:2] == [None, "1"]
